"""Triton kernels of ELA's normaliser and scalar features (lazoo.kernels.ela) against a float64 token-by-token loop:
the output, the denominators, the final carries and the gradients of every input (the initial carries included),
E = 1 and 2 scalar features, ragged T, dims that are not a power of two, with and without initial carries and with
a gradient on the final carries; a denominator below eps (the clamp passes no gradient).

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``test_ela_kernels_in_subprocess`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at T = 2048."""

from __future__ import annotations

import pytest
import torch

from lazoo.ops._testing import run_interpreter_tests

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def loop_reference(q1, k1, a, c, v, om, eps, init):
    """(o, den, (Kc, Cc, W)) one token at a time, in the inputs' dtype (float64 here)."""
    B, T, H, D = q1.shape
    E, V = a.shape[-1], v.shape[-1]
    if init is None:
        kc, cc, w = (torch.zeros(s, dtype=q1.dtype) for s in ((B, H, D), (B, H, E), (B, H, E, V)))
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
    return torch.stack(outs, 1), torch.stack(dens, 1), (kc, cc, w)


def make(B, T, H, D, V, E, seed, dtype, with_init, low_den=False):
    gen = torch.Generator().manual_seed(seed)
    q1 = torch.randn(B, T, H, D, generator=gen, dtype=F64) * 0.2  # denominators kept away from 0: a·Cc ~ t leads
    k1 = torch.randn(B, T, H, D, generator=gen, dtype=F64)
    a = torch.rand(B, T, H, E, generator=gen, dtype=F64) + 0.5
    c = torch.rand(B, T, H, E, generator=gen, dtype=F64) + 0.5
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    om = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    if low_den:  # denominators on both sides of eps: q' = ±(the keys' running sum), tiny scalar features
        sign = 1.0 - 2.0 * (torch.arange(T, dtype=F64) % 2)
        q1 = k1.cumsum(1) * 0.3 * sign[None, :, None, None]
        a, c = a * 1e-3, c * 1e-3
    init = None
    if with_init:
        init = (torch.randn(B, H, D, generator=gen, dtype=F64), torch.rand(B, H, E, generator=gen, dtype=F64) + 1,
                torch.randn(B, H, E, V, generator=gen, dtype=F64))
    # 16-bit tensors are rounded once; the reference runs on the rounded values
    q1, k1, v, om = (x.to(dtype).to(F64) for x in (q1, k1, v, om))
    return [q1, k1, a, c, v, om], init


def check(B, T, H, D, V, E, *, dtype=torch.float32, with_init=False, final_grad=False, low_den=False, tol=5e-5,
          device="cpu", seed=0, segment=None):
    from lazoo.kernels.ela import ela_prefix

    eps = 1e-3 if low_den else 1e-6
    inputs, init = make(B, T, H, D, V, E, seed, dtype, with_init, low_den)
    gen = torch.Generator().manual_seed(seed + 100)
    proj = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    proj_final = [torch.randn(s, generator=gen, dtype=F64) for s in ((B, H, D), (B, H, E), (B, H, E, V))]

    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref_init = None if init is None else [x.clone().requires_grad_() for x in init]
    o_r, den_r, fin_r = loop_reference(*ref_in, eps, ref_init)
    loss = (o_r * proj).sum() + (sum((f * p).sum() for f, p in zip(fin_r, proj_final)) if final_grad else 0)
    leaves = ref_in + (ref_init or [])
    grads_r = torch.autograd.grad(loss, leaves)

    kd = [x.to(dtype if i in (0, 1, 4, 5) else torch.float32).to(device).requires_grad_()
          for i, x in enumerate(inputs)]
    k_init = None if init is None else [x.float().to(device).requires_grad_() for x in init]
    o, den, fin = ela_prefix(*kd, eps=eps, initial_state=k_init, output_final_state=True, segment=segment)
    assert o.dtype == kd[4].dtype and den.dtype == torch.float32
    loss = (o.to(F64) * proj.to(device)).sum()
    if final_grad:
        loss = loss + sum((f.to(F64) * p.to(device)).sum() for f, p in zip(fin, proj_final))
    grads = torch.autograd.grad(loss, kd + (k_init or []))

    def rel(got, want):
        return ((got.detach().cpu().to(F64) - want.detach()).norm() / want.detach().norm().clamp_min(1e-30)).item()

    where = f"B={B} T={T} H={H} D={D} V={V} E={E} {dtype} init={with_init} final_grad={final_grad} seg={segment}"
    assert rel(o, o_r) < tol, f"o: {rel(o, o_r):.2e} ({where})"
    assert rel(den, den_r) < tol, f"den: {rel(den, den_r):.2e} ({where})"
    for name, f, fr in zip(("Kc", "Cc", "W"), fin, fin_r):
        assert rel(f, fr) < tol, f"final {name}: {rel(f, fr):.2e} ({where})"
    names = ["q'", "k'", "a", "c", "v", "om", "Kc0", "Cc0", "W0"]
    for name, g, gr in zip(names, grads, grads_r):
        assert rel(g, gr) < tol, f"grad {name}: {rel(g, gr):.2e} ({where})"
    if low_den:
        assert (den_r < eps).any() and (den_r > eps).any(), "the inputs must put denominators on both sides of eps"


@needs_interp
@pytest.mark.parametrize("T", [1, 7, 37, 70])
@pytest.mark.parametrize("E", [1, 2])
def test_interp_matches_loop(T, E):
    check(2, T, 2, 20, 12, E)


@needs_interp
@pytest.mark.parametrize("E", [1, 2])
def test_interp_initial_carries_and_final_gradient(E):
    check(2, 45, 3, 16, 24, E, with_init=True, final_grad=True)
    check(1, 33, 1, 8, 40, E, with_init=False, final_grad=True)


@needs_interp
@pytest.mark.parametrize("T", [32, 65, 100])
@pytest.mark.parametrize("E", [1, 2])
def test_interp_segments_in_parallel(T, E):
    """Segments of 32 tokens (several per sequence, a short last one): the carries handed between segments."""
    check(2, T, 2, 20, 12, E, segment=32, with_init=True, final_grad=True)
    check(1, T, 1, 16, 8, E, segment=64, low_den=True)


@needs_interp
def test_interp_half_precision_inputs():
    check(2, 37, 2, 16, 16, 2, dtype=torch.float16, with_init=True, tol=2e-3)


@needs_interp
def test_interp_denominator_clamped_at_eps():
    check(1, 40, 2, 8, 8, 2, low_den=True)


@needs_interp
def test_interp_refuses_what_it_does_not_take():
    from lazoo.kernels.ela import ela_prefix

    x = torch.zeros(1, 4, 1, 8)
    e3 = torch.zeros(1, 4, 1, 3)
    with pytest.raises(ValueError, match="E = 3"):
        ela_prefix(x, x, e3, e3, x, x, eps=1e-6)
    with pytest.raises(ValueError, match="om shaped like v"):
        ela_prefix(x, x, e3[..., :2], e3[..., :2], x, x[..., :4], eps=1e-6)
    with pytest.raises(ValueError, match="segment must be a positive multiple of 32"):
        ela_prefix(x, x, e3[..., :2], e3[..., :2], x, x, eps=1e-6, segment=48)


def test_ela_kernels_in_subprocess():
    run_interpreter_tests(__file__)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("E", [1, 2])
def test_gpu_bf16_long(E):
    # the output and the 16-bit gradients are rounded to bf16 (2^-9 relative): measured up to 6.7e-3 (norm-relative)
    check(2, 2048, 4, 128, 128, E, dtype=torch.bfloat16, with_init=True, final_grad=True, tol=1e-2, device="cuda")
    check(1, 8192, 2, 128, 64, E, dtype=torch.bfloat16, with_init=True, final_grad=True, tol=1e-2, device="cuda")


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
