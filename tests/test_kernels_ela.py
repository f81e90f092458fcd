"""Triton kernels of ELA's normaliser and scalar features (lazoo.kernels.ela) against a float64 token-by-token loop:
the output, the denominators, the final carries and the gradients of every input (the initial carries included),
for the three polynomial kernels (features formed in the kernel), ragged T, pads, dims that are not a power of two,
with and without initial carries, a gradient on the final carries, several segments of time run in parallel,
sequences packed along time (``cu_seqlens``, each with its own carries); a denominator below eps (the clamp passes no
gradient).

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at T = 2048."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


KERNELS = ["sum_sq_euclid", "sub_sq_euclid", "magnitude_direction"]


def loop_reference(kernel, q, k, v, om, mask, eps, init):
    """(o, den, (Kc, Cc, W)) one token at a time, from the features of ``ops.ela`` (float64 here)."""
    from lazoo.ops.ela import _poly_parts

    B, T, H, D = q.shape
    q1, k1, a, c = _poly_parts(kernel, q, k)
    if mask is not None:  # a pad adds nothing (q and k are zero there already)
        c = c * mask[:, :, None, None]
    E, V = a.shape[-1], v.shape[-1]
    if init is None:
        kc, cc, w = (torch.zeros(s, dtype=q.dtype) for s in ((B, H, D), (B, H, E), (B, H, E, V)))
    else:
        kc, cc, w = init
    outs, dens = [], []
    for t in range(T):
        kc = kc + k1[:, t]
        cc = cc + c[:, t]
        w = w + c[:, t, :, :, None] * v[:, t, :, None, :]
        num = om[:, t] + (a[:, t, :, :, None] * w).sum(2)
        den = (q1[:, t] * kc).sum(-1) + (a[:, t] * cc).sum(-1)
        outs.append(num / den.clamp_min(eps)[..., None])
        dens.append(den)
    if not outs:  # no token: the carries pass through
        return q.new_zeros(B, 0, H, V), q.new_zeros(B, 0, H), (kc, cc, w)
    return torch.stack(outs, 1), torch.stack(dens, 1), (kc, cc, w)


def make(kernel, B, T, H, D, V, seed, dtype, with_init, low_den, masked):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=F64) * 0.3
    k = torch.randn(B, T, H, D, generator=gen, dtype=F64) * 0.3
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    om = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    if low_den:  # magnitude_direction with q = ±3u, k = u: each term is (9+1)·2·(±3+1), of either sign
        u = torch.nn.functional.normalize(torch.randn(B, 1, H, D, generator=gen, dtype=F64), dim=-1)
        sign = 1.0 - 2.0 * (torch.arange(T, dtype=F64) % 2)
        q, k = 3.0 * sign[None, :, None, None] * u.expand(B, T, H, D), u.expand(B, T, H, D).clone()
    mask = None
    if masked:  # left padding of different lengths and a hole
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, : T // 3] = False
        mask[-1, T // 2: T // 2 + 2] = False
        q, k, v = (x * mask[:, :, None, None] for x in (q, k, v))
    E = 1 if kernel == "magnitude_direction" else 2
    init = None
    if with_init:
        init = (torch.randn(B, H, D, generator=gen, dtype=F64), torch.rand(B, H, E, generator=gen, dtype=F64) + 1,
                torch.randn(B, H, E, V, generator=gen, dtype=F64))
    # 16-bit tensors are rounded once; the reference runs on the rounded values
    q, k, v, om = (x.to(dtype).to(F64) for x in (q, k, v, om))
    return [q, k, v, om], mask, init


def check(kernel, B, T, H, D, V, *, dtype=torch.float32, with_init=False, final_grad=False, low_den=False,
          masked=True, tol=5e-5, device="cpu", seed=0, segment=None):
    from lazoo.kernels.ela import ela_prefix

    eps = 1e-3 if low_den else 1e-6
    inputs, mask, init = make(kernel, B, T, H, D, V, seed, dtype, with_init, low_den, masked)
    E = 1 if kernel == "magnitude_direction" else 2
    gen = torch.Generator().manual_seed(seed + 100)
    proj = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    proj_final = [torch.randn(s, generator=gen, dtype=F64) for s in ((B, H, D), (B, H, E), (B, H, E, V))]

    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref_init = None if init is None else [x.clone().requires_grad_() for x in init]
    o_r, den_r, fin_r = loop_reference(kernel, *ref_in, mask, eps, ref_init)
    real = 1.0 if mask is None else mask[:, :, None, None]  # the op zeroes pads' outputs; so does this check
    loss = (o_r * proj * real).sum() + (sum((f * p).sum() for f, p in zip(fin_r, proj_final)) if final_grad else 0)
    grads_r = torch.autograd.grad(loss, ref_in + (ref_init or []))

    kd = [x.to(dtype).to(device).requires_grad_() for x in inputs]
    k_init = None if init is None else [x.float().to(device).requires_grad_() for x in init]
    o, den, fin = ela_prefix(*kd, kernel=kernel, eps=eps, mask=None if mask is None else mask.to(device),
                             initial_state=k_init, output_final_state=True, segment=segment)
    assert o.dtype == dtype and den.dtype == torch.float32
    loss = (o.to(F64) * (proj * real).to(device)).sum()
    if final_grad:
        loss = loss + sum((f.to(F64) * p.to(device)).sum() for f, p in zip(fin, proj_final))
    grads = torch.autograd.grad(loss, kd + (k_init or []))

    def rel(got, want, keep=None):
        got, want = got.detach().cpu().to(F64), want.detach()
        if keep is not None:
            got, want = got * keep, want * keep
        return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()

    where = (f"{kernel} B={B} T={T} H={H} D={D} V={V} {dtype} init={with_init} final_grad={final_grad} "
             f"seg={segment} masked={masked}")
    assert rel(o, o_r, real) < tol, f"o: {rel(o, o_r, real):.2e} ({where})"
    assert rel(den, den_r, real if mask is None else mask[:, :, None]) < tol, f"den ({where})"
    for name, f, fr in zip(("Kc", "Cc", "W"), fin, fin_r):
        assert rel(f, fr) < tol, f"final {name}: {rel(f, fr):.2e} ({where})"
    for name, g, gr in zip(["q", "k", "v", "om", "Kc0", "Cc0", "W0"], grads, grads_r):
        assert rel(g, gr) < tol, f"grad {name}: {rel(g, gr):.2e} ({where})"
    if low_den:
        assert (den_r < eps).any() and (den_r > eps).any(), "the inputs must put denominators on both sides of eps"


@needs_interp
@pytest.mark.parametrize("T", [1, 7, 37, 70])
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_matches_loop(T, kernel):
    check(kernel, 2, T, 2, 20, 12)


@needs_interp
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_initial_carries_and_final_gradient(kernel):
    check(kernel, 2, 45, 3, 16, 24, with_init=True, final_grad=True)
    check(kernel, 1, 33, 1, 8, 40, final_grad=True, masked=False)


@needs_interp
@pytest.mark.parametrize("T", [32, 65, pytest.param(100, marks=pytest.mark.slow)])  # 65 already crosses segments
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_segments_in_parallel(T, kernel):
    """Segments of 32 tokens (several per sequence, a short last one): the carries handed between segments."""
    check(kernel, 2, T, 2, 20, 12, segment=32, with_init=True, final_grad=True)
    check(kernel, 1, T, 1, 16, 8, segment=64, masked=False)


def check_packed_on(kernel, lengths, H, D, V, device, tol=3e-4):
    """fp32 sums over ~1k tokens in the device's order: magnitude_direction's features carry ‖k‖² + 1 ≈ 129 at
    D = 128 (the H200 measured 1.3e-4 on ∂Kc0)."""
    check_packed(kernel, lengths, H, D, V, None, tol=tol, device=device)


def check_packed(kernel, lengths, H, D, V, segment, seed=0, tol=5e-5, device="cpu"):
    """Sequences of ``lengths`` packed along time (``cu_seqlens``, an empty one included) against the float64 loop
    run on each alone from its own initial carries: outputs, denominators, final carries and every gradient."""
    from lazoo.kernels.ela import ela_prefix

    T, N = sum(lengths), len(lengths)
    inputs, _, _ = make(kernel, 1, T, H, D, V, seed, torch.float32, False, False, False)
    E = 1 if kernel == "magnitude_direction" else 2
    gen = torch.Generator().manual_seed(seed + 7)
    init = [torch.randn(N, H, D, generator=gen, dtype=F64), torch.rand(N, H, E, generator=gen, dtype=F64) + 1,
            torch.randn(N, H, E, V, generator=gen, dtype=F64)]
    proj = torch.randn(1, T, H, V, generator=gen, dtype=F64)
    proj_final = [torch.randn(x.shape, generator=gen, dtype=F64) for x in init]
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()

    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref_init = [x.clone().requires_grad_() for x in init]
    outs, dens, finals = [], [], []
    for n in range(N):
        sl = slice(bounds[n], bounds[n + 1])
        o, den, fin = loop_reference(kernel, *(x[:, sl] for x in ref_in), None, 1e-6,
                                     [x[n:n + 1] for x in ref_init])
        outs.append(o)
        dens.append(den)
        finals.append(fin)
    o_r, den_r = torch.cat(outs, 1), torch.cat(dens, 1)
    fin_r = [torch.cat(parts, 0) for parts in zip(*finals)]
    loss = (o_r * proj).sum() + sum((f * p).sum() for f, p in zip(fin_r, proj_final))
    grads_r = torch.autograd.grad(loss, ref_in + ref_init)

    kd = [x.float().to(device).requires_grad_() for x in inputs]
    k_init = [x.float().to(device).requires_grad_() for x in init]
    o, den, fin = ela_prefix(*kd, kernel=kernel, eps=1e-6, initial_state=k_init, output_final_state=True,
                             segment=segment, cu_seqlens=torch.tensor(bounds, device=device))
    loss = (o.to(F64) * proj.to(device)).sum() + sum((f.to(F64) * p.to(device)).sum() for f, p in zip(fin, proj_final))
    grads = torch.autograd.grad(loss, kd + k_init)

    def rel(got, want):
        return ((got.detach().cpu().to(F64) - want.detach()).norm() / want.detach().norm().clamp_min(1e-30)).item()

    assert rel(o, o_r) < tol and rel(den, den_r) < tol, (rel(o, o_r), rel(den, den_r))
    for name, f, fr in zip(("Kc", "Cc", "W"), fin, fin_r):
        assert rel(f, fr) < tol, f"final {name}: {rel(f, fr):.2e}"
    for name, g, gr in zip(["q", "k", "v", "om", "Kc0", "Cc0", "W0"], grads, grads_r):
        assert rel(g, gr) < tol, f"grad {name}: {rel(g, gr):.2e}"


@needs_interp
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_packed_sequences(kernel):
    # segments of 32: sequences of one, several (with a short last one) and no segment, an empty sequence in the
    # middle and at the end; and the device's default segment length
    check_packed(kernel, [5, 70, 0, 33, 1, 0], 2, 12, 20, segment=32)
    check_packed(kernel, [40, 3], 1, 8, 8, segment=None)


@needs_interp
def test_interp_half_precision_inputs():
    check("sum_sq_euclid", 2, 37, 2, 16, 16, dtype=torch.float16, with_init=True, tol=2e-3)


@needs_interp
def test_interp_denominator_clamped_at_eps():
    check("magnitude_direction", 1, 40, 2, 8, 8, low_den=True, masked=False, segment=32)


@needs_interp
def test_interp_refuses_what_it_does_not_take():
    from lazoo.kernels.ela import ela_prefix

    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        ela_prefix(x, x, x, x, kernel="hadamard_exp", eps=1e-6)
    with pytest.raises(ValueError, match="om shaped like v"):
        ela_prefix(x, x, x, x[..., :4], kernel="sum_sq_euclid", eps=1e-6)
    with pytest.raises(ValueError, match="segment must be a positive multiple of 8"):
        ela_prefix(x, x, x, x, kernel="sum_sq_euclid", eps=1e-6, segment=20)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ela_prefix(x, x, x, x, kernel="sum_sq_euclid", eps=1e-6, cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="needs B = 1 and no mask"):
        ela_prefix(x, x, x, x, kernel="sum_sq_euclid", eps=1e-6, mask=torch.ones(1, 4, dtype=torch.bool),
                   cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_bf16_long(kernel):
    # the output and the 16-bit gradients are rounded to bf16 (2^-9 relative): measured up to 6.7e-3 (norm-relative)
    check(kernel, 2, 2048, 4, 128, 128, dtype=torch.bfloat16, with_init=True, final_grad=True, tol=1e-2,
          device="cuda", segment=256)
    check(kernel, 1, 4096, 2, 128, 64, dtype=torch.bfloat16, with_init=True, final_grad=True, tol=1e-2,
          device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_head_dim_256(kernel):
    """The widest head (4 tokens a block): fp32, ragged T, a mask, the device's segments."""
    check(kernel, 2, 333, 2, 256, 200, with_init=True, final_grad=True, tol=3e-4, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_packed_sequences(kernel):
    """cu_seqlens on the GPU: ragged sequences (one of 1 token, one empty), fp32 inputs, the device's segments."""
    check_packed_on(kernel, [700, 1, 0, 1333, 64], 4, 128, 128, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["sum_sq_euclid", "magnitude_direction"])
def test_gpu_compiled_op_equals_eager(kernel):
    """torch.compile(fullgraph=True) traces the split form (the linear-attention kernel and these kernels): the same
    output and gradients as eager, bf16."""
    import torch._dynamo as dynamo

    from lazoo import ops

    dynamo.reset()
    gen = torch.Generator("cuda").manual_seed(3)
    x = [torch.randn(2, 300, 2, 64, device="cuda", generator=gen).mul(0.3).bfloat16() for _ in range(3)]
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[1, :37] = False

    def loss(q, k, v):
        return ops.ela(q, k, v, kernel=kernel, mask=mask)[0].float().square().sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in x]
        value = fn(*leaves)
        value.backward()
        return [value.detach()] + [t.grad for t in leaves]

    eager, compiled = grads(loss), grads(torch.compile(loss, fullgraph=True))
    for name, e, c in zip(("loss", "dq", "dk", "dv"), eager, compiled):
        error = ((c.float() - e.float()).norm() / e.float().norm()).item()
        assert error < 2e-2, (name, error)  # bf16 gradients, rounded where the compiler fuses
    dynamo.reset()
