"""Fused local-linear attention kernel (lazoo.kernels.local_linear) through the op's ``backend="triton"``,
against an explicit float64 reference: one weighted least-squares solve per query (a Python loop over the
queries, the normal equations of [1, P(k_i − q_t)] solved with torch.linalg.solve), with and without the
low-rank slope projection P, at ragged T and with query/key blocks (16 in the interpreter) smaller than T;
sliding window; pads and a KV cache; the gradients of q, k, v, the scale and P vs float64 autograd of the
reference. Also the PyTorch projection path (chunk and recurrent forms) against the same reference.

CPU (default run): the ``interp_*`` tests need ``TRITON_INTERPRET=1`` from the start, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu`` (T = 1024, dk = 64, bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, left_pad_mask

from lazoo.ops import local_linear_attention

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def make(B, T, H, dk, dv, r=None, per_head=False, seed=0):
    """Unit-norm q, k (as the mixer feeds them), values, per-head scales and (if r) a projection P."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=g, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, dv, generator=g, dtype=F64)
    scale = 1.5 + 2.5 * torch.rand(H, generator=g, dtype=F64)
    P = None
    if r is not None:
        P = torch.randn(*((H,) if per_head else ()), r, dk, generator=g, dtype=F64) * (2.0 / dk) ** 0.5
    return {"q": q, "k": k, "v": v, "scale": scale, "P": P}


def explicit_reference(q, k, v, scale, ridge, P=None, window=None, mask=None):
    """o_t = M⁰ of min Σ_i w_i‖v_i − M⁰ − M¹ P(k_i − q_t)‖² + ρ‖M¹‖² (P = I if None), w = softmax(β q_t·k_i)
    over the real keys i ≤ t (and > t − W): one (1 + r)-dim normal-equation solve per query (differentiable)."""
    B, T, H, dk = q.shape
    mask = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    rows = []
    for b in range(B):
        for t in range(T):
            idx = [i for i in range(t + 1) if mask[b, i] and (window is None or i > t - window)]
            for h in range(H):
                if not mask[b, t]:
                    rows.append(torch.zeros(v.shape[-1], dtype=q.dtype))
                    continue
                K, V, qt = k[b, idx, h], v[b, idx, h], q[b, t, h]
                w = torch.softmax(scale[h] * (K @ qt), 0)
                Ph = None if P is None else (P if P.dim() == 2 else P[h])
                Dm = K - qt if Ph is None else (K - qt) @ Ph.T
                X = torch.cat([torch.ones(len(idx), 1, dtype=q.dtype), Dm], 1)
                pen = torch.full((X.shape[1],), ridge, dtype=q.dtype)
                pen[0] = 0.0  # the intercept is not penalised
                A = X.T @ (w[:, None] * X) + torch.diag(pen)
                rows.append(torch.linalg.solve(A, X.T @ (w[:, None] * V))[0])
    return torch.stack(rows).reshape(out.shape)


def leaves(inputs, dtype, device="cpu"):
    return {n: (None if x is None else x.detach().to(device, dtype).requires_grad_(True)) for n, x in inputs.items()}


def forward_and_grads(fn, xs, seed=7):
    o = fn(xs)
    g = torch.Generator().manual_seed(seed)
    probe = torch.randn(o.shape, generator=g, dtype=F64).to(o.device, o.dtype)
    names = [n for n, x in xs.items() if x is not None]
    grads = torch.autograd.grad((o * probe).sum(), [xs[n] for n in names])
    return o, dict(zip(names, grads))


def op_call(ridge, window=None, mask=None, backend="triton", **kw):
    def call(xs):
        m = None if mask is None else mask.to(xs["q"].device)
        return local_linear_attention(xs["q"], xs["k"], xs["v"], scale=xs["scale"], ridge=ridge, window=window,
                                      mask=m, rank_projection=xs["P"], backend=backend, **kw)[0]
    return call


def ref_call(ridge, window=None, mask=None):
    return lambda xs: explicit_reference(xs["q"], xs["k"], xs["v"], xs["scale"], ridge, xs["P"], window, mask)


# ----------------------------------------------------------------------------- PyTorch projection path
@pytest.mark.parametrize("per_head,window", [(False, None), (True, 6)])
def test_projected_pytorch_forms_equal_the_explicit_solve(per_head, window):
    x = make(2, 13, 2, 6, 3, r=3, per_head=per_head, seed=1)
    ref = explicit_reference(x["q"], x["k"], x["v"], x["scale"], 0.03, x["P"], window)
    for backend in ("recurrent", "chunk"):
        o, _ = local_linear_attention(x["q"], x["k"], x["v"], scale=x["scale"], ridge=0.03, window=window,
                                      chunk_size=4, rank_projection=x["P"], backend=backend)
        assert_close(o, ref, 1e-10, f"{backend} with P vs explicit solve")
    exact, _ = local_linear_attention(x["q"], x["k"], x["v"], scale=x["scale"], ridge=0.03, window=window)
    assert (exact - ref).abs().max() > 1e-3  # the projection changes the answer (r < dk)


def test_identity_projection_is_the_exact_slope():
    x = make(1, 9, 2, 4, 3, seed=2)
    exact, _ = local_linear_attention(x["q"], x["k"], x["v"], scale=x["scale"], ridge=0.02, backend="chunk")
    eye, _ = local_linear_attention(x["q"], x["k"], x["v"], scale=x["scale"], ridge=0.02, backend="chunk",
                                    rank_projection=torch.eye(4, dtype=F64))
    assert_close(eye, exact, 1e-12, "P = I vs no projection")


def test_projection_gradients_match_the_explicit_solve():
    x = make(1, 7, 2, 5, 3, r=2, per_head=True, seed=3)
    xs, rs = leaves(x, F64), leaves(x, F64)
    o, g = forward_and_grads(op_call(0.05, backend="chunk", chunk_size=3), xs)
    o_r, g_r = forward_and_grads(ref_call(0.05), rs)
    assert_close(o, o_r, 1e-10, "output")
    for n in g_r:
        assert_close(g[n], g_r[n], 1e-9, f"grad {n}")


def test_bad_projection_and_unsupported_triton_cases_are_named():
    x = make(1, 3, 2, 4, 3)
    with pytest.raises(ValueError, match="rank_projection"):
        local_linear_attention(x["q"], x["k"], x["v"], scale=1.0, rank_projection=torch.ones(2, 5, dtype=F64))
    with pytest.raises(TypeError, match="rank_projection"):
        local_linear_attention(x["q"], x["k"], x["v"], scale=1.0, rank_projection=[[1.0]])
    q = torch.randn(1, 4, 2, 64)
    # the exact slope at dk = 64 keeps 64×64 moments per query: the kernel refuses and names the way out
    with pytest.raises(NotImplementedError, match="rank_projection"):
        local_linear_attention(q, q, q, scale=1.0, backend="triton")
    with pytest.raises(NotImplementedError, match="float64"):
        local_linear_attention(q.double(), q.double(), q.double(), scale=1.0, backend="triton",
                               rank_projection=torch.ones(4, 64, dtype=F64))


# ----------------------------------------------------------------------------- Triton (interpreter)


@needs_interp
@pytest.mark.parametrize("dk,r,per_head,window", [
    (16, None, False, None),   # exact slope (P = I), dk = 16
    (24, 5, False, None),      # dk and r not powers of two (features padded to 16)
    (32, 20, True, 11),        # per-head P, r padded to 32, sliding window
])
def test_interp_forward_and_gradients_match_explicit_solve(dk, r, per_head, window):
    x = make(2, 37, 2, dk, 12, r=r, per_head=per_head, seed=dk)
    o_r, g_r = forward_and_grads(ref_call(0.05, window), leaves(x, F64))
    o, g = forward_and_grads(op_call(0.05, window), leaves(x, torch.float32))
    assert o.dtype == torch.float32
    assert_close(o.double(), o_r, 2e-5, "output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 5e-5, f"grad {n}")


@needs_interp
@pytest.mark.parametrize("r", [4, 12])  # A saved by the forward (r ≤ 8) / the moments again in the backward
def test_interp_kernels_with_their_own_blocks(monkeypatch, r):
    """Each kernel launches with its own query/key block sizes (the forward's two kernels, the backward's
    query-block kernels and its key-block kernel need not agree): still the explicit solve, window on, ragged
    T."""
    from lazoo.kernels import local_linear as kernel

    L = kernel.Launch
    monkeypatch.setattr(kernel, "INTERPRET_LAUNCH", {
        "stats": L(32, 16, 4, 1), "out": L(16, 32, 4, 1), "prep": L(16, 32, 4, 1), "prep_moments": L(32, 16, 4, 1),
        "dkv": L(32, 16, 4, 1), "dq": L(16, 32, 4, 1)})
    monkeypatch.setattr(kernel, "SOLVE_ROWS", 16)
    x = make(1, 45, 2, 16, 8, r=r, seed=13)
    o_r, g_r = forward_and_grads(ref_call(0.05, 19), leaves(x, F64))
    o, g = forward_and_grads(op_call(0.05, 19), leaves(x, torch.float32))
    assert_close(o.double(), o_r, 2e-5, "output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 5e-5, f"grad {n}")


@needs_interp
def test_interp_rising_logits_move_the_running_reference():
    """Logits that climb along the sequence by more than fp32's exponent range (β = 100, keys turning from −u
    to +u, queries along u): the forward's running maximum must follow them and rescale what it has summed,
    or exp2 overflows (a reference frozen at the first key block gives NaNs here). Against the explicit
    solve, outputs and gradients."""
    g = torch.Generator().manual_seed(21)
    T, dk = 45, 16
    u = F.normalize(torch.randn(dk, generator=g, dtype=F64), dim=0)
    a = torch.linspace(-1.0, 1.0, T, dtype=F64)
    k = F.normalize(a[None, :, None, None] * u + 0.05 * torch.randn(1, T, 2, dk, generator=g, dtype=F64), dim=-1)
    q = F.normalize(u + 0.05 * torch.randn(1, T, 2, dk, generator=g, dtype=F64), dim=-1)
    x = {"q": q, "k": k, "v": torch.randn(1, T, 2, 8, generator=g, dtype=F64),
         "scale": torch.tensor([100.0, 80.0], dtype=F64), "P": torch.randn(4, dk, generator=g, dtype=F64) / 2}
    o_r, g_r = forward_and_grads(ref_call(0.05), leaves(x, F64))
    o, g = forward_and_grads(op_call(0.05), leaves(x, torch.float32))
    assert torch.isfinite(o).all()
    assert_close(o.double(), o_r, 2e-5, "output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 5e-3, f"grad {n}")  # β = 100 amplifies fp32 rounding (β: 1.6e-3)


@needs_interp
def test_interp_small_ridge_sees_the_slope():
    """ρ = 1e-3 (the op's default): the slope is a real correction and the kernel still matches."""
    x = make(1, 33, 2, 16, 8, r=4, seed=5)
    ref = explicit_reference(x["q"], x["k"], x["v"], x["scale"], 1e-3, x["P"])
    o = op_call(1e-3)(leaves(x, torch.float32))
    soft = op_call(1e6, backend="chunk")(leaves(x, F64))  # ρ → ∞: softmax attention
    assert (ref - soft).abs().max() > 0.1
    assert_close(o.detach().double(), ref, 1e-4, "output at ρ = 1e-3")


@needs_interp
def test_interp_pads_and_cache_match_the_reference():
    """Left pads and interior holes (never keys, zero outputs), a window, then a KV cache carried over."""
    x = make(2, 29, 2, 24, 6, r=6, seed=9)
    mask = left_pad_mask([29, 20], 29, holes=[(0, 3), (1, 15)])
    o_r, g_r = forward_and_grads(ref_call(0.05, 7, mask), leaves(x, F64))
    o, g = forward_and_grads(op_call(0.05, 7, mask), leaves(x, torch.float32))
    assert (o[~mask] == 0).all()
    assert_close(o.double(), o_r, 2e-5, "padded output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 5e-5, f"padded grad {n}")

    xs = leaves(x, torch.float32)
    a, state = local_linear_attention(xs["q"][:, :18], xs["k"][:, :18], xs["v"][:, :18], scale=xs["scale"],
                                      ridge=0.05, window=7, mask=mask[:, :18], rank_projection=xs["P"],
                                      output_final_state=True, backend="triton")
    b, _ = local_linear_attention(xs["q"][:, 18:], xs["k"][:, 18:], xs["v"][:, 18:], scale=xs["scale"],
                                  ridge=0.05, window=7, mask=mask[:, 18:], rank_projection=xs["P"],
                                  initial_state=state, backend="triton")
    assert_close(torch.cat([a, b], 1).detach().double(), o_r, 2e-5, "split with a KV cache")


@needs_interp
def test_interp_key_mask_inside_blocks_the_causal_order_leaves_whole():
    """Pads and holes in key blocks that lie wholly in the queries' past (no window): the kernels skip the causal
    mask there, the key mask must still apply."""
    x = make(2, 50, 2, 16, 8, r=4, seed=13)
    mask = left_pad_mask([50, 37], 50, holes=[(0, 3), (0, 20), (1, 17)])
    o_r, g_r = forward_and_grads(ref_call(0.05, None, mask), leaves(x, F64))
    o, g = forward_and_grads(op_call(0.05, None, mask), leaves(x, torch.float32))
    assert (o[~mask] == 0).all()
    assert_close(o.double(), o_r, 2e-5, "output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 5e-5, f"grad {n}")


@needs_interp
def test_interp_kernel_gives_hidden_keys_no_gradient():
    """Called directly (the op zeroes pad keys and drops their gradients, so it cannot tell), the kernel gives
    keys that its key mask hides exactly zero gradient, whatever their values: the key-block kernel must apply
    the mask, not only the causal order."""
    from lazoo.kernels.local_linear import local_linear_attention as kernel

    x = make(1, 40, 2, 16, 8, r=4, seed=17)
    mask = left_pad_mask([40], 40, holes=[(0, 5), (0, 22)])
    xs = leaves(x, torch.float32)
    o = kernel(xs["q"], xs["k"], xs["v"], scale=xs["scale"], ridge=0.05, key_mask=mask, rank_projection=xs["P"])
    probe = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
    gk, gv = torch.autograd.grad((o * probe).sum(), [xs["k"], xs["v"]])
    assert gk[~mask].abs().max() == 0 and gv[~mask].abs().max() == 0
    assert gk[mask].abs().min() > 0


@needs_interp
def test_interp_frozen_projection_gets_no_gradient():
    """A P that does not require grad: the kernels skip dP and give q, k, v, the scale exactly the gradients they
    get with a trainable P (the features' shares of dq and dk do not depend on forming dP)."""
    x = make(1, 40, 2, 16, 8, r=6, per_head=True, seed=19)
    o, g = forward_and_grads(op_call(0.05, 9), leaves(x, torch.float32))
    xs = leaves(x, torch.float32)
    xs["P"].requires_grad_(False)
    o_frozen = op_call(0.05, 9)(xs)
    probe = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=F64).float()
    names = ["q", "k", "v", "scale"]
    got = torch.autograd.grad((o_frozen * probe).sum(), [xs[n] for n in names])
    assert torch.equal(o_frozen, o) and xs["P"].grad is None
    for n, gr in zip(names, got):
        assert torch.equal(gr, g[n]), n


@needs_interp
def test_interp_fp16():
    x = make(1, 21, 2, 16, 16, r=4, seed=11)
    ref = explicit_reference(x["q"], x["k"], x["v"], x["scale"], 0.1, x["P"])
    o = op_call(0.1)(leaves(x, torch.float16))
    assert o.dtype == torch.float16
    assert_close(o.detach().double(), ref, 3e-3, "fp16 output")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.bfloat16, 2e-2, 3e-2), (torch.float32, 1e-4, 2e-4)])
@pytest.mark.parametrize("T,dk,r", [(1024, 64, 16), (1000, 64, 6), (333, 32, None)])
def test_gpu_matches_float64(dtype, rtol, grad_rtol, T, dk, r):
    """T = 1024, dk = 64, r = 16 (the headline case), r = 6 (moments over 8 features, ragged T) and the exact
    slope at dk = 32 (r = 32 features, ragged T), window off and on, vs the float64 chunk form on the GPU
    (itself checked against the explicit solve)."""
    x = make(2, T, 4, dk, 64, r=r, seed=3)
    x["scale"] = torch.full((4,), dk ** 0.5, dtype=F64)  # the mixer's initial β
    for window in (None, 300):
        o_r, g_r = forward_and_grads(op_call(0.1, window, backend="chunk"), leaves(x, F64, "cuda"))
        o, g = forward_and_grads(op_call(0.1, window), leaves(x, dtype, "cuda"))
        assert o.dtype == dtype
        assert_close(o.double(), o_r, rtol, f"output (window {window})")
        for n, gr in g_r.items():
            assert_close(g[n].double(), gr, grad_rtol, f"grad {n} (window {window})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("r", [6, 16])  # A saved by the forward / the moments again in the backward
def test_gpu_pads_holes_and_window_match_float64(r):
    """Left pads and interior holes (the key mask in every kernel, the key-block kernel's own test of it
    included), window on, fp32 on the GPU against the float64 chunk form: outputs (zero at pads) and gradients,
    the scale's among them."""
    x = make(2, 700, 4, 64, 64, r=r, seed=4)
    mask = left_pad_mask([700, 530], 700, holes=[(0, 100), (0, 400), (1, 333)])
    o_r, g_r = forward_and_grads(op_call(0.1, 200, mask, backend="chunk"), leaves(x, F64, "cuda"))
    o, g = forward_and_grads(op_call(0.1, 200, mask), leaves(x, torch.float32, "cuda"))
    assert (o[~mask.cuda()] == 0).all()
    assert_close(o.double(), o_r, 1e-4, "padded output")
    for n, gr in g_r.items():
        assert_close(g[n].double(), gr, 2e-4, f"padded grad {n}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_auto_backend_is_triton_when_supported(monkeypatch):
    from lazoo.kernels import local_linear as kernel

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    calls = []
    monkeypatch.setattr(kernel.LocalLinearAttentionFunction, "apply",
                        lambda *a: calls.append(1) or torch.zeros(1, 64, 2, 32, device="cuda"))
    q = torch.randn(1, 64, 2, 64, device="cuda")
    local_linear_attention(q, q, q[..., :32], scale=1.0, rank_projection=torch.randn(16, 64, device="cuda"))
    assert calls == [1]
    local_linear_attention(q, q, q[..., :32], scale=1.0)  # exact slope at dk = 64: the chunk form
    assert calls == [1]
