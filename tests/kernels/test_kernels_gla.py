"""The chunk-parallel GLA kernels (lazoo.kernels.gla, a log decay per key dim) through
``ops.gla(backend="triton")`` and ``chunk_gla``, against the float64 recurrent reference: outputs,
final states and the gradients of q, k, v, g and the initial state, at ragged T (not multiples of
the 16-row sub-chunk or the 64-row chunk), with masks, with ``cu_seqlens``, in fp32 and fp16, and with
decays strong enough (log decay -5 to -20 per step in some key dims) that exp(-G) over a chunk
overflows if it is ever formed.

CPU (default run): the ``interp_*`` tests run in a fresh process with ``TRITON_INTERPRET=1``
(``tests/test_interpreter.py``). GPU shapes are in tests/ops/test_ops_gpu.py (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask, prefill_then_steps

from lazoo import ops

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def gla_inputs(B, T, H, dk, dv, seed=0, strong=False):
    """q, k, v ~ N(0, 1); g = logsigmoid(N(2, 1)) (mild), and with ``strong`` every third key dim
    decays by exp(-5) to exp(-20) per step."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, H, dk, generator=gen, dtype=F64) + 2)
    if strong:
        g[..., ::3] = -5 - 15 * torch.rand(B, T, H, len(range(0, dk, 3)), generator=gen, dtype=F64)
    return {"q": q, "k": k, "v": v, "g": g}


def state(N, H, dk, dv, seed=1):
    return torch.randn(N, H, dv, dk, generator=torch.Generator().manual_seed(seed), dtype=F64)


def gla_call(mask=None, cu_seqlens=None):
    def call(t, s, backend):
        m = None if mask is None else mask.to(t["q"].device)
        return ops.gla(t["q"], t["k"], t["v"], t["g"], initial_state=s, output_final_state=True, mask=m,
                       cu_seqlens=cu_seqlens, backend=backend)
    return call


def check(call, tensors, s0, dtype, rtol, grad_rtol=None):
    """Triton in ``dtype`` (state float32) vs the float64 recurrent reference: o, state, all grads."""
    ref = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    ref_s = None if s0 is None else s0.detach().clone().requires_grad_(True)
    leaves_r = {**ref, **({} if s0 is None else {"S0": ref_s})}
    o_r, s_r, g_r = forward_and_grads(lambda: call(ref, ref_s, "recurrent"), leaves_r)

    tri = {n: x.detach().to(dtype).requires_grad_(True) for n, x in tensors.items()}
    tri_s = None if s0 is None else s0.detach().float().requires_grad_(True)
    leaves = {**tri, **({} if s0 is None else {"S0": tri_s})}
    o, s, grads = forward_and_grads(lambda: call(tri, tri_s, "triton"), leaves)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o, o_r, rtol, "output")
    assert_state_close(s, s_r, rtol, "final state")
    for name, gr in g_r.items():
        assert grads[name] is not None, f"no gradient reaches {name}"
        assert_close(grads[name], gr, grad_rtol or rtol, f"grad {name}")


@pytest.fixture
def count_chunk_calls(monkeypatch):
    """Counts calls of lazoo.kernels.gla.chunk_gla (the op must take the chunk kernel)."""
    from lazoo.kernels import gla as kg

    calls = []
    orig = kg.chunk_gla
    monkeypatch.setattr(kg, "chunk_gla", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    return calls


# ============================================================================ CPU: the interpreter


@needs_interp
def test_interp_gla_chunk_fp32_ragged_with_mask(count_chunk_calls):
    B, T, H, dk, dv = 2, 70, 2, 32, 48  # T: 64 + 6; dv not a power of two
    t = gla_inputs(B, T, H, dk, dv, seed=1)
    mask = left_pad_mask([T, T - 11], T, holes=[(0, 40)])
    check(gla_call(mask=mask), t, state(B, H, dk, dv), torch.float32, 1e-5)
    assert count_chunk_calls


@needs_interp
def test_interp_gla_chunk_cu_seqlens_strong_decay(count_chunk_calls):
    T, H, dk, dv = 120, 2, 32, 32
    cu = torch.tensor([0, 37, 37, 107, 120])  # ragged lengths, an empty sequence, one over 64
    t = gla_inputs(1, T, H, dk, dv, seed=2, strong=True)
    check(gla_call(cu_seqlens=cu), t, state(4, H, dk, dv), torch.float32, 1e-5)
    assert count_chunk_calls


@needs_interp
def test_interp_gla_diagonal_blocks_ragged():
    """_bwd_intra's diagonal blocks (one exponent a pair for dq and dk): ragged T with a mask (rows past the sequence
    in the last sub-chunk), and packed sequences with strong decays."""
    B, T, H, dk, dv = 2, 70, 2, 32, 16
    mask = left_pad_mask([T, T - 11], T, holes=[(0, 40)])
    check(gla_call(mask=mask), gla_inputs(B, T, H, dk, dv, seed=6, strong=True), state(B, H, dk, dv), torch.float32,
          1e-5)
    cu = torch.tensor([0, 37, 37, 107, 120])
    check(gla_call(cu_seqlens=cu), gla_inputs(1, 120, H, dk, dv, seed=7, strong=True), state(4, H, dk, dv),
          torch.float32, 1e-5)


@needs_interp
def test_interp_gla_chunk_fp16_strong_decay():
    B, T, H, dk, dv = 1, 37, 2, 32, 32
    t = gla_inputs(B, T, H, dk, dv, seed=3, strong=True)
    check(gla_call(), t, state(B, H, dk, dv), torch.float16, 1e-2, grad_rtol=2e-2)


@needs_interp
def test_interp_gla_chunk_head_dim_blocks(monkeypatch):
    """Tiles of 16 along the head dims: the kernels' loops over key and value blocks (the GPU's
    tiles are 64 wide, so D = 128 and 256 take several), no initial state, no final state."""
    from lazoo.kernels import gla as kg

    monkeypatch.setattr(kg, "MAX_BLOCK", 16)
    B, T, H, dk, dv = 1, 70, 1, 40, 24
    t = gla_inputs(B, T, H, dk, dv, seed=4, strong=True)
    ref = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
    tri = {n: x.detach().float().requires_grad_(True) for n, x in t.items()}
    o_r, _, g_r = forward_and_grads(lambda: (ops.gla(**ref, backend="recurrent")[0], None), ref)
    o, _, g = forward_and_grads(lambda: (kg.chunk_gla(**tri, scale=dk ** -0.5)[0], None), tri)
    assert_close(o, o_r, 1e-5, "output")
    for name in t:
        assert_close(g[name], g_r[name], 1e-5, f"grad {name}")


@needs_interp
def test_interp_gla_prefill_then_decode_equals_one_pass():
    """Chunk kernel over a prompt, then the fused recurrent kernel a few tokens at a time."""
    B, T, H, dk, dv, cut = 2, 45, 2, 16, 16, 37
    t = {n: x.float() for n, x in gla_inputs(B, T, H, dk, dv, seed=5, strong=True).items()}
    run = lambda sl, st, backend: ops.gla(*(t[n][:, sl] for n in "qkvg"), initial_state=st,  # noqa: E731
                                          output_final_state=True, backend=backend)
    ref_o, ref_s = run(slice(None), None, "recurrent")
    o, s = prefill_then_steps(lambda sl, st: run(sl, st, "triton"), T, cut)
    assert_close(o, ref_o, 1e-5, "prefill + decode output")
    assert_state_close(s, ref_s, 1e-5, "prefill + decode state")


@needs_interp
def test_interp_chunk_gla_refuses_large_head_dims():
    from lazoo.kernels.gla import chunk_gla

    q = torch.randn(1, 20, 1, 272)
    v = torch.randn(1, 20, 1, 8)
    with pytest.raises(ValueError, match="head dims up to 256"):
        chunk_gla(q, q, v, -q.abs(), scale=1.0)
