"""Triton kernels of linear / gated linear attention (lazoo.kernels.linear) through the ops'
``backend="triton"``, against the float64 recurrent reference: outputs, final states and the
gradients of q, k, v, g and the initial state, at ragged T, with masks and with ``cu_seqlens``; and with
grouped heads (q and k with fewer heads than v), their blocks of heads per program and partial sums of dq, dk.

CPU (default run): the ``interp_*`` tests need the Triton interpreter, and ``TRITON_INTERPRET=1``
must be set before triton is first imported (conftest imports lazoo, which imports triton through
torch), so ``tests/test_interpreter.py`` runs them in a fresh process with the variable set.
Running this file with ``TRITON_INTERPRET=1`` runs them in-process. GPU: ``-m gpu`` at real shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import (
    assert_close,
    assert_state_close,
    forward_and_grads,
    left_pad_mask,
    prefill_then_steps,
    record_launches,
)

from lazoo import ops

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def inputs(B, T, H, dk, dv, dtype=F64, device="cpu", seed=0, g_bias=2.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=F64) + g_bias)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g)]


def grouped_inputs(B, T, HK, m, dk, dv, dtype=F64, seed=0):
    """q, k with HK heads; v, g with m·HK (grouped heads)."""
    q, k, _, _ = inputs(B, T, HK, dk, dv, dtype=dtype, seed=seed)
    _, _, v, g = inputs(B, T, HK * m, dk, dv, dtype=dtype, seed=seed + 50)
    return q, k, v, g


def linear_state(N, H, dk, dv, normalize, seed=1):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(N, H, dv, dk, generator=gen, dtype=F64)
    return {"S": S, "z": torch.rand(N, H, dk, generator=gen, dtype=F64) * 3} if normalize else S


def as_leaves(state, dtype, device):
    """The state cast to dtype/device, as fresh leaves, and {name: leaf} for the gradients."""
    if isinstance(state, dict):
        out = {key: x.detach().to(device, dtype).requires_grad_(True) for key, x in state.items()}
        return out, {f"{key}0": x for key, x in out.items()}
    out = state.detach().to(device, dtype).requires_grad_(True)
    return out, {"S0": out}


def check_against_reference(call, tensors, state, dtype, rtol, device="cpu", grad_rtol=None):
    """``call(tensors, state, backend)`` with the Triton backend in ``dtype`` vs the float64
    recurrent reference on the CPU: output, final state, all gradients."""
    ref_t = {n: x.detach().to("cpu", F64).requires_grad_(True) for n, x in tensors.items()}
    ref_s, ref_sl = as_leaves(state, F64, "cpu")
    o_r, s_r, g_r = forward_and_grads(lambda: call(ref_t, ref_s, "recurrent"), {**ref_t, **ref_sl})

    tri_t = {n: x.detach().to(device, dtype).requires_grad_(True) for n, x in tensors.items()}
    tri_s, tri_sl = as_leaves(state, torch.float32, device)
    o, s, grads = forward_and_grads(lambda: call(tri_t, tri_s, "triton"), {**tri_t, **tri_sl})
    assert o.dtype == dtype and o.device.type == torch.device(device).type
    assert_close(o.cpu(), o_r, rtol, "output")
    assert_state_close({k: x.cpu() for k, x in s.items()} if isinstance(s, dict) else s.cpu(), s_r,
                       rtol, "final state")
    for name, gr in g_r.items():
        assert grads[name] is not None, f"no gradient reaches {name}"
        assert_close(grads[name].cpu(), gr, grad_rtol or rtol, f"grad {name}")


def linear_call(feature_map, normalize, chunk_size=16, mask=None, cu_seqlens=None):
    def call(t, state, backend):
        m = None if mask is None else mask.to(t["q"].device)
        cu = None if cu_seqlens is None else cu_seqlens.to(t["q"].device)
        return ops.linear_attention(t["q"], t["k"], t["v"], feature_map=feature_map, normalize=normalize,
                                    chunk_size=chunk_size, initial_state=state, output_final_state=True,
                                    mask=m, cu_seqlens=cu, backend=backend)
    return call


def gated_call(chunk_size=16, mask=None, cu_seqlens=None, scale=None):
    def call(t, state, backend):
        m = None if mask is None else mask.to(t["q"].device)
        cu = None if cu_seqlens is None else cu_seqlens.to(t["q"].device)
        return ops.gated_linear_attention(t["q"], t["k"], t["v"], t["g"], scale=scale, chunk_size=chunk_size,
                                          initial_state=state, output_final_state=True, mask=m,
                                          cu_seqlens=cu, backend=backend)
    return call


def kernels_linear():
    import importlib

    return importlib.import_module("lazoo.kernels.linear")


def state_grids(monkeypatch) -> list:
    """The grids of lazoo.kernels.linear's forward state-kernel launches, recorded from now on."""
    return record_launches(monkeypatch, kernels_linear(), "_fwd_h_kernel")


# ============================================================================ CPU: the interpreter


@needs_interp
@pytest.mark.parametrize("feature_map,normalize", [("elu1", True), ("identity", False)])
def test_interp_linear_matches_reference(feature_map, normalize):
    B, T, H, dk, dv = 2, 45, 2, 8, 12  # T ragged against chunk 16
    q, k, v, _ = inputs(B, T, H, dk, dv)
    mask = left_pad_mask([T, T - 7], T, holes=[(0, 20)])
    check_against_reference(linear_call(feature_map, normalize, mask=mask), {"q": q, "k": k, "v": v},
                            linear_state(B, H, dk, dv, normalize), torch.float32, 1e-5)


@needs_interp
@pytest.mark.parametrize("T,seg", [(100, 3), (45, 2)], ids=["three-segments", "two-segments"])
def test_interp_segmented_state_walks_match_reference(T, seg, monkeypatch):
    """The state walks split into segments of ``seg`` chunks (the last one shorter), as at long T with a small batch:
    the segments' sums, their prefix sums from the initial state, the walks from each segment's start, and the same
    in reverse for the gradients (dht into the last segment's end, dh0 out of the first one's start)."""
    monkeypatch.setattr(kernels_linear(), "FORCE_SEGMENT_CHUNKS", seg)
    calls = state_grids(monkeypatch)
    B, H, dk, dv = 2, 2, 8, 12
    q, k, v, _ = inputs(B, T, H, dk, dv, seed=7)
    mask = left_pad_mask([T, T - 7], T, holes=[(0, 20)])
    check_against_reference(linear_call("identity", False, mask=mask), {"q": q, "k": k, "v": v},
                            linear_state(B, H, dk, dv, False), torch.float32, 1e-5)
    assert calls and all(grid[2] == -(-((T + 15) // 16) // seg) for grid in calls), calls


@needs_interp
def test_interp_gated_matches_reference_with_mask():
    B, T, H, dk, dv = 2, 45, 2, 16, 8
    q, k, v, g = inputs(B, T, H, dk, dv)
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 30)])
    check_against_reference(gated_call(mask=mask), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(B, H, dk, dv, False), torch.float32, 1e-5)


@needs_interp
@pytest.mark.parametrize("name", ["gated", "linear"])
def test_interp_cu_seqlens_matches_reference(name):
    T, H, dk, dv = 70, 2, 8, 8
    cu = torch.tensor([0, 13, 13, 50, 70])  # an empty sequence and ragged ones
    q, k, v, g = inputs(1, T, H, dk, dv, seed=3)
    if name == "gated":
        call, t, state = gated_call(cu_seqlens=cu), {"q": q, "k": k, "v": v, "g": g}, linear_state(4, H, dk, dv, False)
    else:
        call, t, state = (linear_call("elu1", True, cu_seqlens=cu), {"q": q, "k": k, "v": v},
                          linear_state(4, H, dk, dv, True))
    check_against_reference(call, t, state, torch.float32, 1e-5)


@needs_interp
def test_interp_gated_fp16():
    B, T, H, dk, dv = 1, 45, 2, 16, 16
    q, k, v, g = inputs(B, T, H, dk, dv, seed=5)
    check_against_reference(gated_call(), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(B, H, dk, dv, False), torch.float16, 1e-2, grad_rtol=2e-2)


@needs_interp
@pytest.mark.parametrize("name", ["gated", "linear", "grouped"])
def test_interp_prefill_then_decode_equals_one_pass(name):
    """Chunk kernel over a prompt, then the fused recurrent kernel token by token (the cache path); "grouped": q and k
    with 2 heads serving 6 value heads."""
    B, T, H, dk, dv, cut = 2, 37, 2, 8, 8, 33
    q, k, v, g = inputs(B, T, H, dk, dv, dtype=torch.float32, seed=7)
    if name == "grouped":
        q, k, v, g = grouped_inputs(B, T, H, 3, dk, dv, dtype=torch.float32, seed=7)
    if name != "linear":
        run = lambda sl, st, backend: ops.gated_linear_attention(  # noqa: E731
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=st, output_final_state=True, backend=backend)
    else:
        run = lambda sl, st, backend: ops.linear_attention(  # noqa: E731
            q[:, sl], k[:, sl], v[:, sl], initial_state=st, output_final_state=True, backend=backend)
    ref_o, ref_s = run(slice(None), None, "recurrent")
    o, s = prefill_then_steps(lambda sl, st: run(sl, st, "triton"), T, cut, step=2)  # two steps of 2 tokens
    assert_close(o, ref_o, 1e-5, "prefill + decode output")
    assert_state_close(s, ref_s, 1e-5, "prefill + decode state")


def heads_per_program(monkeypatch, heads):
    """Force the value heads per program of the output and gradient kernels (None: the launcher's choice)."""
    monkeypatch.setattr(kernels_linear(), "FORCE_HEADS_PER_PROGRAM", heads)


def recorded_grids(monkeypatch) -> list:
    """The grids of the output and gradient kernels' launches, recorded from now on."""
    return record_launches(monkeypatch, kernels_linear(), "_fwd_o_kernel", "_bwd_dqkv_kernel")


@needs_interp
@pytest.mark.parametrize("heads", [None, 1, 2], ids=["all-heads", "one-head-parts", "two-heads-parts"])
def test_interp_grouped_heads_match_reference(heads, monkeypatch):
    """q and k with 2 heads, v and g with 8 (4 per key head), against the float64 reference that repeats q and k:
    all 4 heads of a key head in one output program (the launcher's choice on the CPU; the gradient kernel takes
    one), or one or two per program in both (the gradients of q and k summed from 4 or 2 parts in q's dtype), with left
    padding, a hole and a carried state."""
    heads_per_program(monkeypatch, heads)
    grids = recorded_grids(monkeypatch)
    B, T, HK, m, dk, dv = 2, 45, 2, 4, 16, 8  # T ragged against chunk 16
    q, k, v, g = grouped_inputs(B, T, HK, m, dk, dv, seed=21)
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 30)])
    check_against_reference(gated_call(mask=mask), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(B, HK * m, dk, dv, False), torch.float32, 1e-5)
    forward_blocks = HK * m // (heads or m)  # the gradient kernel: one head a program unless forced
    assert len(grids) == 2 and grids[0][-2] == B * forward_blocks and grids[1][-2] == B * HK * m // (heads or 1), grids


@needs_interp
def test_interp_grouped_heads_cu_seqlens(monkeypatch):
    """Packed sequences (an empty one, ragged ones) with grouped heads, two heads per program: four parts."""
    heads_per_program(monkeypatch, 2)
    T, HK, m, dk, dv = 70, 1, 8, 8, 16
    cu = torch.tensor([0, 13, 13, 50, 70])
    q, k, v, g = grouped_inputs(1, T, HK, m, dk, dv, seed=23)
    check_against_reference(gated_call(cu_seqlens=cu), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(4, HK * m, dk, dv, False), torch.float32, 1e-5)


@needs_interp
@pytest.mark.parametrize("heads", [None, 1])
def test_interp_grouped_heads_without_decay(heads, monkeypatch):
    """lazoo.kernels.linear's ungated path (g None) with grouped heads, against the float64 reference with g = 0."""
    heads_per_program(monkeypatch, heads)
    kl = kernels_linear()
    B, T, HK, m, d = 2, 37, 2, 3, 8
    q, k, v, _ = grouped_inputs(B, T, HK, m, d, d, seed=25)

    def call(t, state, backend):
        if backend == "recurrent":
            return ops.gated_linear_attention(t["q"], t["k"], t["v"], t["q"].new_zeros(B, T, HK * m), scale=1.0,
                                              initial_state=state, output_final_state=True, backend=backend)
        return kl.chunk_linear_attention(t["q"], t["k"], t["v"], None, initial_state=state, output_final_state=True,
                                         chunk_size=16)

    check_against_reference(call, {"q": q, "k": k, "v": v}, linear_state(B, HK * m, d, d, False), torch.float32,
                            1e-5)


@needs_interp
def test_interp_grouped_heads_fp16():
    B, T, HK, m, dk, dv = 1, 45, 1, 2, 16, 16
    q, k, v, g = grouped_inputs(B, T, HK, m, dk, dv, seed=27)
    check_against_reference(gated_call(), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(B, HK * m, dk, dv, False), torch.float16, 1e-2, grad_rtol=2e-2)


def test_heads_per_program_fill_the_device(monkeypatch):
    """The launcher takes as many of a key head's value heads per program as leave PROGRAMS_PER_SM programs per
    multiprocessor, a divisor of them; one without grouped heads; a forced count must divide them."""
    import types

    kl = kernels_linear()
    monkeypatch.setattr(kl, "num_sms", lambda device: 132)
    bamba = types.SimpleNamespace(H=128, HK=1)
    assert kl._heads_per_program(bamba, 512, "cuda") == 64  # 512 chunks: two programs per key head
    assert kl._heads_per_program(bamba, 9, "cuda") == 2  # 64 programs of 9 chunks each fill 4 x 132
    assert kl._heads_per_program(bamba, 8, "cuda") == 1  # 512 programs would not: one head each
    assert kl._heads_per_program(types.SimpleNamespace(H=16, HK=16), 1, "cuda") == 1
    assert kl._heads_per_program(types.SimpleNamespace(H=12, HK=1), 150, "cuda") == 3  # 4 parts (3 would not fill)
    monkeypatch.setattr(kl, "FORCE_HEADS_PER_PROGRAM", 3)
    with pytest.raises(ValueError, match="must divide the 4 value heads per key head"):
        kl._heads_per_program(types.SimpleNamespace(H=8, HK=2), 10, "cuda")


def gla_inputs(B, T, H, dk, dv, seed=0, strong=False):
    q, k, v, _ = inputs(B, T, H, dk, dv, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    logits = torch.randn(B, T, H, dk, generator=gen, dtype=F64) * (4 if strong else 1) + (0 if strong else 2)
    return q, k, v, F.logsigmoid(logits)


def gla_call(chunk_size=8, mask=None, cu_seqlens=None):
    def call(t, state, backend):
        m = None if mask is None else mask.to(t["q"].device)
        cu = None if cu_seqlens is None else cu_seqlens.to(t["q"].device)
        return ops.gla(t["q"], t["k"], t["v"], t["g"], chunk_size=chunk_size, initial_state=state,
                       output_final_state=True, mask=m, cu_seqlens=cu, backend=backend)
    return call


@pytest.mark.parametrize("strong", [False, True])
def test_gla_chunk_matches_recurrent(strong):
    """The PyTorch chunk form of GLA (gate per key dim) against the step-by-step reference, float64,
    with decays strong enough that exp(-G) over a chunk would overflow if it were split."""
    B, T, H, dk, dv = 2, 27, 2, 5, 4
    q, k, v, g = gla_inputs(B, T, H, dk, dv, strong=strong)
    if strong:
        g = g * 40  # log decays down to ~-800 per step
    mask = left_pad_mask([T, T - 6], T, holes=[(0, 9)])
    S0 = linear_state(B, H, dk, dv, False)
    leaves = {"q": q, "k": k, "v": v, "g": g, "S0": S0}
    for x in leaves.values():
        x.requires_grad_(True)
    from op_helpers import compare_backends

    compare_backends(lambda backend: ops.gla(q, k, v, g, chunk_size=8, initial_state=S0, output_final_state=True,
                                             mask=mask, backend=backend), leaves, rtol=1e-10)


@needs_interp
def test_interp_gla_matches_reference():
    B, T, H, dk, dv = 2, 29, 2, 8, 40  # dv spans more than one value block
    q, k, v, g = gla_inputs(B, T, H, dk, dv, seed=4)
    mask = left_pad_mask([T, T - 5], T, holes=[(0, 12)])
    check_against_reference(gla_call(mask=mask), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(B, H, dk, dv, False), torch.float32, 1e-5)


@needs_interp
def test_interp_gla_cu_seqlens():
    T, H, dk, dv = 40, 2, 8, 8
    cu = torch.tensor([0, 9, 9, 40])
    q, k, v, g = gla_inputs(1, T, H, dk, dv, seed=6, strong=True)
    check_against_reference(gla_call(cu_seqlens=cu), {"q": q, "k": k, "v": v, "g": g},
                            linear_state(3, H, dk, dv, False), torch.float32, 1e-5)


def test_triton_refuses_unsupported_cases(monkeypatch):
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    q = torch.randn(1, 4, 1, 300)
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        ops.linear_attention(q, q, q, backend="triton")
    q = torch.randn(1, 4, 1, 8, dtype=F64)
    with pytest.raises(NotImplementedError, match="float32/float16/bfloat16"):
        ops.gated_linear_attention(q, q, q, q[..., 0], backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ops.gated_linear_attention(q, q, q, q[..., 0], cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="B must be 1"):
        q2 = torch.randn(2, 4, 1, 8)
        ops.linear_attention(q2, q2, q2, cu_seqlens=torch.tensor([0, 4]))


def test_cu_seqlens_reference_equals_sequences_one_by_one():
    """The PyTorch backends' packed path: each sequence alone, with its own states."""
    T, H, d = 30, 2, 4
    cu = torch.tensor([0, 11, 11, 30])
    q, k, v, g = inputs(1, T, H, d, d, seed=9)
    state = linear_state(3, H, d, d, False)
    for backend in ("recurrent", "chunk"):
        o, s = ops.gated_linear_attention(q, k, v, g, initial_state=state, output_final_state=True,
                                          cu_seqlens=cu, backend=backend, chunk_size=8)
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if b == a:
                assert_close(s[n], state[n], 0, "empty sequence keeps its state")
                continue
            on, sn = ops.gated_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b],
                                                initial_state=state[n:n + 1], output_final_state=True,
                                                backend="recurrent")
            assert_close(o[:, a:b], on, 1e-12, f"{backend} sequence {n}")
            assert_close(s[n:n + 1], sn, 1e-12, f"{backend} state {n}")


# ============================================================================ GPU, real shapes
GPU_RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def gpu_reference_check(call, tensors, state, dtype, rtol):
    """Like check_against_reference, with the float64 reference on the GPU (chunk form, exact in
    float64; the CPU tests tie it to the recurrent form)."""
    ref_t = {n: x.detach().to("cuda", F64).requires_grad_(True) for n, x in tensors.items()}
    ref_s, ref_sl = as_leaves(state, F64, "cuda")
    o_r, s_r, g_r = forward_and_grads(lambda: call(ref_t, ref_s, "chunk"), {**ref_t, **ref_sl})
    tri_t = {n: x.detach().to("cuda", dtype).requires_grad_(True) for n, x in tensors.items()}
    tri_s, tri_sl = as_leaves(state, torch.float32, "cuda")
    o, s, grads = forward_and_grads(lambda: call(tri_t, tri_s, "triton"), {**tri_t, **tri_sl})
    assert o.dtype == dtype
    assert_close(o, o_r, rtol, "output")
    assert_state_close(s, s_r, rtol, "final state")
    for name, gr in g_r.items():
        assert_close(grads[name], gr, rtol, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["linear_elu1", "linear_identity", "gated"])
def test_gpu_matches_float64(name, dtype):
    B, T, H, D = 2, 1000, 4, 128
    q, k, v, g = inputs(B, T, H, D, D, seed=11, g_bias=4.0)
    mask = left_pad_mask([T, T - 123], T)
    if name == "gated":
        call, t, st = (gated_call(chunk_size=64, mask=mask), {"q": q, "k": k, "v": v, "g": g},
                       linear_state(B, H, D, D, False))
    else:
        fm, norm = ("elu1", True) if name == "linear_elu1" else ("identity", False)
        if not norm:  # keep the unnormalised outputs O(1)
            q, k = q * D ** -0.5, k * D ** -0.5
        call, t, st = (linear_call(fm, norm, chunk_size=64, mask=mask), {"q": q, "k": k, "v": v},
                       linear_state(B, H, D, D, norm))
    gpu_reference_check(call, t, st, dtype, GPU_RTOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_long_sequence_walks_in_segments(dtype, monkeypatch):
    """One long sample with few heads: the state walks split into segments by themselves, against float64."""
    calls = state_grids(monkeypatch)
    B, T, H, D = 1, 8192, 2, 128
    q, k, v, _ = inputs(B, T, H, D, D, seed=17)
    q, k = q * D ** -0.5, k * D ** -0.5
    mask = left_pad_mask([T - 77], T)
    call, t = linear_call("identity", False, chunk_size=64, mask=mask), {"q": q, "k": k, "v": v}
    gpu_reference_check(call, t, linear_state(B, H, D, D, False), dtype, GPU_RTOL[dtype])
    assert calls and all(grid[2] > 1 for grid in calls), calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grouped", [False, True], ids=["heads", "grouped-heads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_cu_seqlens_and_decode(dtype, grouped):
    """Packed sequences, then prefill and token-by-token decoding; grouped: two key heads of 4 value heads each."""
    T, H, D = 1500, 4, 128
    cu = torch.tensor([0, 1, 300, 300, 1077, 1500])
    q, k, v, g = inputs(1, T, H, D, D, seed=13, g_bias=4.0)
    if grouped:
        q, k = q[:, :, :2], k[:, :, :2]
    gpu_reference_check(gated_call(chunk_size=64, cu_seqlens=cu), {"q": q, "k": k, "v": v, "g": g},
                        linear_state(5, H, D, D, False), dtype, GPU_RTOL[dtype])
    # prefill 1000 tokens, then decode one token at a time with the fused recurrent kernel
    qc, kc, vc, gc = (x.to("cuda", dtype) for x in (q, k, v, g))
    ref_o, ref_s = ops.gated_linear_attention(*(x.to("cuda", F64) for x in (q, k, v, g)),
                                              output_final_state=True, backend="chunk")
    with torch.no_grad():
        o, s = ops.gated_linear_attention(qc[:, :1000], kc[:, :1000], vc[:, :1000], gc[:, :1000],
                                          output_final_state=True, backend="triton")
        outs = [o]
        for t in range(1000, 1008):
            o, s = ops.gated_linear_attention(qc[:, t:t + 1], kc[:, t:t + 1], vc[:, t:t + 1], gc[:, t:t + 1],
                                              initial_state=s, output_final_state=True, backend="triton")
            outs.append(o)
    assert_close(torch.cat(outs, 1), ref_o[:, :1008], GPU_RTOL[dtype], "prefill + decode")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [None, 1, 4], ids=["launcher", "one-head-parts", "four-heads-parts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_grouped_heads_match_float64(dtype, heads, monkeypatch):
    """Mamba-2's shape at a smaller scale: one key head of dk = 128 serving 16 value heads of 64, with a left-padded
    row; the heads per program the launcher picks, or one or four (dq, dk summed from 16 or 4 parts in q's dtype)."""
    heads_per_program(monkeypatch, heads)
    B, T, HK, m, dk, dv = 2, 1000, 1, 16, 128, 64
    q, k, v, g = grouped_inputs(B, T, HK, m, dk, dv, seed=31)
    q, k = q * dk ** -0.5, k * dk ** -0.5
    g = g / 4
    mask = left_pad_mask([T, T - 123], T)
    gpu_reference_check(gated_call(chunk_size=64, mask=mask, scale=1.0), {"q": q, "k": k, "v": v, "g": g},
                        linear_state(B, HK * m, dk, dv, False), dtype, GPU_RTOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gla_matches_float64(dtype):
    B, T, H, D = 2, 500, 4, 128
    q, k, v, g = gla_inputs(B, T, H, D, D, seed=15)
    g = g / 8  # mild per-key decays, as a GLA layer's gate normaliser gives
    mask = left_pad_mask([T, T - 77], T)
    gpu_reference_check(gla_call(chunk_size=16, mask=mask), {"q": q, "k": k, "v": v, "g": g},
                        linear_state(B, H, D, D, False), dtype, GPU_RTOL[dtype])
    cu = torch.tensor([0, 100, 100, 2 * T])
    flat = {n: x.reshape(1, 2 * T, *x.shape[2:]) for n, x in (("q", q), ("k", k), ("v", v), ("g", g))}
    gpu_reference_check(gla_call(chunk_size=16, cu_seqlens=cu), flat, linear_state(3, H, D, D, False),
                        dtype, GPU_RTOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_auto_backend_is_triton(monkeypatch):
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    from lazoo.kernels import linear as kl
    from lazoo.kernels import normalized as kn

    calls = []
    for module, name in ((kl, "chunk_linear_attention"), (kn, "chunk_normalized_linear_attention")):
        orig = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, name=name, orig=orig, **kw: calls.append(name) or orig(*a, **kw))
    q, k, v, g = inputs(1, 100, 2, 64, 64, dtype=torch.bfloat16, device="cuda")
    ops.gated_linear_attention(q, k, v, g)
    ops.linear_attention(q, k, v)  # normalised: the normaliser inside the kernel
    ops.linear_attention(q, k, v, normalize=False)
    assert calls == ["chunk_linear_attention", "chunk_normalized_linear_attention", "chunk_linear_attention"], calls
