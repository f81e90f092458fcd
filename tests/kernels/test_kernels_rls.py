"""RLS's Triton path (γ = 1): the precision part batched over chunks, the memory part on the Triton
linear-attention kernel, against the float64 closed form and the float64 chunk form (outputs, final
moments, gradients of q, k, v, λ and the initial moments), at ragged T with pads and an initial state.

CPU (default run): ``tests/test_interpreter.py`` runs the ``interp`` tests with ``TRITON_INTERPRET=1``
in a fresh process. GPU: ``-m gpu`` at real shapes in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask, rel_err, rls_closed_form

from lazoo.ops import rls

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def inputs(B, T, H, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=F64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    lam = 0.2 + torch.rand(H, generator=gen, dtype=F64)
    KK = torch.randn(B, H, dk, 2 * dk, generator=gen, dtype=F64)
    state = {"KK": KK @ KK.transpose(-1, -2) / dk, "VK": torch.randn(B, H, dv, dk, generator=gen, dtype=F64)}
    return {"q": q, "k": k, "v": v, "lam": lam}, state


def run(t, state, backend, mask=None, chunk_size=16):
    return rls(t["q"], t["k"], t["v"], lam=t["lam"], chunk_size=chunk_size, initial_state=state,
               output_final_state=True, mask=mask, backend=backend)


def check(tensors, state, dtype, device, rtol, mask=None, chunk_size=16):
    """The Triton path in ``dtype`` vs the float64 chunk form (itself tied to the closed form in test_ops_rls)."""
    def leaves(d, dt):
        return {n: x.detach().to(device, dt).requires_grad_(True) for n, x in d.items()}

    m = None if mask is None else mask.to(device)
    ref_t, ref_s = leaves(tensors, F64), leaves(state, F64)
    o_r, s_r, g_r = forward_and_grads(lambda: run(ref_t, ref_s, "chunk", m, chunk_size), {**ref_t, **ref_s})
    tri_t = {n: x.detach().to(device, dtype if n != "lam" else torch.float32).requires_grad_(True)
             for n, x in tensors.items()}
    tri_s = leaves(state, torch.float32)
    o, s, g = forward_and_grads(lambda: run(tri_t, tri_s, "triton", m, chunk_size), {**tri_t, **tri_s})
    assert o.dtype == dtype
    assert_close(o, o_r, rtol, "output")
    assert_state_close(s, s_r, rtol, "final state")
    for name, gr in g_r.items():
        assert_close(g[name], gr, rtol, f"grad {name}")


# ============================================================================ interpreter (CPU)


@needs_interp
@pytest.mark.parametrize("T,dk", [(37, 16), (70, 16), (45, 24), (50, 32)])
def test_interp_rls_triton_matches_float64(T, dk):
    """dk = 24 runs padded to 32 on chip; dk = 32 takes two pivot blocks in the dk×dk inverse."""
    tensors, state = inputs(2, T, 2, dk, 8, seed=T)
    mask = left_pad_mask([T, T - 9], T, holes=[(1, 20)])
    check(tensors, state, torch.float32, "cpu", 2e-4, mask=mask)


@needs_interp
@pytest.mark.parametrize("T,dk,chunk,dtype", [(37, 16, 16, torch.float32), (70, 32, 32, torch.float32),
                                               pytest.param(45, 24, 32, torch.float32, marks=pytest.mark.slow),
                                               (1, 16, 32, torch.float32), (37, 16, 16, torch.bfloat16),
                                               pytest.param(45, 24, 32, torch.bfloat16, marks=pytest.mark.slow)])
def test_interp_rls_solve_kernel_matches_float64_solves(T, dk, chunk, dtype):
    """The kernel alone: z_t = (A_c + Σ_{i≤t in chunk c} k_i k_iᵀ)^{-1} r_t against one float64 solve per t,
    with a random positive definite A_c per chunk (not a prefix of the keys). bf16 keys and right-hand sides
    take the kernel's split-product variant (P split into tf32 hi/lo parts)."""
    from lazoo.kernels.rls import rls_solve

    gen = torch.Generator().manual_seed(dk + T)
    B, H = 2, 2
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to(dtype)
    r = torch.randn(B, T, H, dk, generator=gen).to(dtype)
    N = -(-T // chunk)
    X = torch.randn(B, H, N, dk, 3 * dk, generator=gen) / dk ** 0.5
    A = X @ X.transpose(-1, -2) + 0.5 * torch.eye(dk)
    z = rls_solve(A.float(), k, r, chunk)
    ref = torch.empty(B, T, H, dk, dtype=F64)
    for t in range(T):
        c = t // chunk
        Kc = k[:, c * chunk:t + 1].double().transpose(1, 2)  # [B, H, n, dk]
        At = A[:, :, c].double() + Kc.transpose(-1, -2) @ Kc
        ref[:, t] = torch.linalg.solve(At, r[:, t].double()[..., None])[..., 0]
    assert_close(z, ref, 1e-5, "z")
    # the backward's call: the kept factors and a new right-hand side give the same as a fresh solve
    _, factors = rls_solve(A.float(), k, r, chunk, keep_factors=True)
    r2 = torch.randn(B, T, H, dk, generator=gen).to(dtype)
    assert_close(rls_solve(None, k, r2, chunk, factors=factors), rls_solve(A.float(), k, r2, chunk).double(),
                 1e-6, "z from kept factors")


@needs_interp
def test_interp_rls_triton_refuses_gamma_below_one():
    tensors, _ = inputs(1, 8, 1, 16, 8)
    t = {n: x.float() for n, x in tensors.items()}
    with pytest.raises(NotImplementedError, match="gamma"):
        rls(t["q"], t["k"], t["v"], lam=1.0, gamma=0.9, backend="triton")


def _two_samples(T=48, dk=16, seed=21):
    """Sample 0 well conditioned at λ = 0.5; sample 1 the same kind of keys at scale 1e3 (κ ~ 1e6·T: the fp32 solve
    breaks down there, 1e8 off before the check)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(2, T, 2, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, T, 2, dk, generator=gen)
    scale = torch.tensor([1.0, 1e3])[:, None, None, None]
    return q * scale, k * scale, v


@needs_interp
def test_interp_rls_triton_checks_its_fp32_solve(monkeypatch, caplog):
    """A forced Triton path warns once with the measured residual; chosen automatically, it recomputes the samples
    that miss the precision with the float64 chunk form (logged once) and keeps the others' Triton outputs."""
    import importlib
    import logging

    mod = importlib.import_module("lazoo.ops.rls")
    monkeypatch.setattr(mod, "_SAID", set())
    q, k, v = _two_samples()
    with pytest.warns(RuntimeWarning, match=r"Triton path \(fp32 solve\).* of 1 sample\(s\) only to a relative"):
        o_tri, _ = rls(q, k, v, lam=0.5, chunk_size=16, backend="triton")
    ref = rls_closed_form(q, k, v, 0.5)
    assert_close(o_tri[:1], ref[:1], 1e-4, "sample 0, Triton")
    lam_h = torch.full((2,), 0.5, dtype=F64)
    zeros = (torch.zeros(2, 2, 16, 16, dtype=F64), torch.zeros(2, 2, 16, 16, dtype=F64))
    qg = q.clone().requires_grad_()
    with caplog.at_level(logging.WARNING, logger="lazoo"):
        o, _, _ = mod._rls_triton_checked(qg, k, v, None, lam_h, *zeros, 16, False, False,
                                          mod.TOLERANCE[torch.float32])
    assert sum("recomputed with the float64 chunk form" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(o[0], o_tri[0])  # sample 0 keeps its Triton output
    assert_close(o[1:], ref[1:], 1e-5, "sample 1, recomputed")
    o.sum().backward()
    assert torch.isfinite(qg.grad).all()


@needs_interp
def test_interp_rls_triton_checks_the_rounding_of_z_at_the_sequence_start(monkeypatch):
    """fp16 inputs hand z on in fp16; at small λ its rounding where KK_t is rank-deficient (t < dk) is what costs,
    which the chunk-end check of the fp32 solve does not see: the start-of-sequence check does."""
    import importlib
    import warnings

    mod = importlib.import_module("lazoo.ops.rls")
    monkeypatch.setattr(mod, "_SAID", set())
    gen = torch.Generator().manual_seed(23)
    q, k = (F.normalize(torch.randn(2, 32, 2, 16, generator=gen), dim=-1).half() for _ in range(2))
    v = torch.randn(2, 32, 2, 16, generator=gen).half()
    with pytest.warns(RuntimeWarning, match=r"Triton path \(fp32 solve, z handed on in float16\)"):
        o, _ = rls(q, k, v, lam=1e-3, chunk_size=16, backend="triton")
    assert rel_err(o, rls_closed_form(q, k, v, 1e-3)) > 4e-3  # (what the check is about)
    monkeypatch.setattr(mod, "_SAID", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at λ = 1 the same inputs are within fp16's tolerance
        o1, _ = rls(q, k, v, lam=1.0, chunk_size=16, backend="triton")
    assert rel_err(o1, rls_closed_form(q, k, v, 1.0)) <= 4e-3


@needs_interp
def test_interp_rls_triton_one_nan_sample_leaves_the_others_bit_identical():
    """A NaN key in sample 1 (chunk 1 of 2): samples 0 and 2 bit-identical to a clean run, no exception, no
    warning and no fallback."""
    import warnings

    gen = torch.Generator().manual_seed(22)
    q, k = (F.normalize(torch.randn(3, 28, 2, 16, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(3, 28, 2, 16, generator=gen)
    x = {"q": q, "k": k, "v": v}
    bad = {n: t.clone() for n, t in x.items()}
    bad["k"][1, 20, 0, 3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN sample is not a precision shortfall of the others
        clean, _ = rls(x["q"], x["k"], x["v"], lam=0.4, chunk_size=16, backend="triton")
        o, _ = rls(bad["q"], bad["k"], bad["v"], lam=0.4, chunk_size=16, backend="triton")
    for b in (0, 2):
        assert torch.equal(o[b], clean[b])
    assert not torch.isfinite(o[1]).all()


# ============================================================================ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("chunk_size", [64, None])  # None: the kernel's own chunk (lazoo.kernels.rls.CHUNK)
def test_gpu_rls_triton_matches_float64(dtype, rtol, chunk_size):
    T = 2000
    tensors, state = inputs(2, T, 4, 128, 128, seed=5)
    check(tensors, state, dtype, "cuda", rtol, mask=left_pad_mask([T, T - 300], T), chunk_size=chunk_size)
