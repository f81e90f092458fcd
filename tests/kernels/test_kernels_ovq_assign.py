"""Triton OVQ assignments (lazoo.kernels.ovq.assign): slots, counts before every chunk and final counts equal
to step 1 of the PyTorch Triton path (``lazoo.ops.ovq._chunk_slots``, the ``_assign`` rule) at ragged T, over
several chunks with a growing dictionary, with pads and holes, a carried state (a dictionary and partial
chunks), a raised and a lowered ``max_dict_size``, and exact ties; and the whole op with
``triton_assign=True`` against the float64 recurrent form (outputs, state, gradients).

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1. GPU (``-m gpu``): T = 4096,
H = 8, d = 128 against ``_chunk_slots``, printing the time of both.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from op_helpers import left_pad_mask

import lazoo.ops.ovq as ovq_mod
from lazoo.ops import ovq_attention

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def keys(B, T, H, dk, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to(device)


def packed(k, L, N, mask=None, state=None):
    """The packed keys and the state as ``_ovq_triton`` hands them to step 1."""
    B, T, H, dk = k.shape
    st = ovq_mod._ovq_initial_state(state, B, H, dk, dk, L, N, k.device, torch.float32)
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=k.device)
    _, Kp, _, valid, _, _, nb = ovq_mod._pack(k, k, k, real, st["k"], st["v"], st["t"], L)
    return Kp, valid, st, st["t"], nb


def run_both(k, L, N, mask=None, state=None):
    from lazoo.kernels.ovq.assign import ovq_assign

    Kp, valid, st, t0, nb = packed(k, L, N, mask, state)
    ref = ovq_mod._chunk_slots(Kp, valid, st, t0, nb, L, N)
    got = ovq_assign(Kp, valid.sum(1) // L, t0 - nb, st["Dk"], st["counts"], L, N)
    return got, ref


def assert_same(got, ref):
    for name, a, b in zip(("slots", "counts before each chunk", "final counts"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


def carried_state(B, H, dk, L, N, lengths, seed):
    """A state after a chunk-form pass over left-padded samples of the given lengths."""
    T = max(lengths)
    k = keys(B, T, H, dk, seed)
    with torch.no_grad():
        _, st = ovq_attention(k, k, torch.randn(B, T, H, dk), chunk_size=L, max_dict_size=N,
                              mask=left_pad_mask(lengths, T), output_final_state=True, backend="chunk")
    return st


@needs_interp
def test_interp_assign_matches_pytorch_ragged_padded_growing():
    # ragged lengths (45, 30 with a hole, 7 < L), 6 chunks of 8; N = 9: the first chunk opens 4 centroids
    # and merges 4 keys into them, later chunks grow the dictionary and merge into old centroids
    mask = left_pad_mask([45, 30, 7], 45, holes=[(1, 20)])
    got, ref = run_both(keys(3, 45, 2, 16, seed=0), 8, 9, mask=mask)
    assert_same(got, ref)
    sizes = (ref[1] > 0).sum(-1)[:, 0, 0]
    assert sizes[0] == 0 and int(sizes[-1]) > int(sizes[1]) > 0  # the dictionary grew over chunks
    assert (got[0][:, 2] == -1).all()  # sample 2 never completes a chunk
    # a head dim and a chunk size that are not powers of two, more than one block of slots
    got, ref = run_both(keys(2, 70, 1, 40, seed=4), 12, 30, mask=left_pad_mask([70, 51], 70))
    assert_same(got, ref)
    assert int((ref[2] > 0).sum(-1).max()) > 16


@needs_interp
def test_interp_assign_matches_pytorch_with_carried_state_and_changed_budget():
    st = carried_state(3, 2, 16, 8, 9, [21, 13, 6], seed=1)  # t = 21, 13, 6: partial chunks of 5, 5, 6
    k = keys(3, 40, 2, 16, seed=2)
    mask = left_pad_mask([40, 27, 12], 40)
    for N in (9, 14, 3):  # the same budget, a raised one, one below the current size (no growth)
        got, ref = run_both(k, 8, N, mask=mask, state=st)
        assert_same(got, ref)
    # the carried dictionary is read: another state gives other slots
    other, _ = run_both(k, 8, 9, mask=mask)
    assert not torch.equal(other[0], got[0])


@needs_interp
@pytest.mark.parametrize("group, keys_a_program", [(1, 4), (2, 4), (2, 128)])
def test_interp_assign_breaks_exact_ties_like_pytorch(monkeypatch, group, keys_a_program):
    # keys with entries in {-1, 0, 1} / 2 (dot products exact in any order) and every key twice in a
    # row: best similarities and nearest new centroids tie exactly; ranks follow the stable sort. The merge reads
    # the blocks' bests `group` blocks a load: ties across loads (1) and inside one (2) keep the first slot. The
    # search runs on programs of 4 keys (a launch after the addition's) or of the whole chunk (one launch).
    from lazoo.kernels.ovq import assign as oa

    cfg = dict(oa._blocks(), NBG=group, BK=keys_a_program)
    monkeypatch.setattr(oa, "_blocks", lambda dk: cfg)
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(-1, 2, (2, 24, 2, 16), generator=gen).float() / 2
    k = base.repeat_interleave(2, dim=1)  # [2, 48, 2, 16]
    for L, N in ((8, 9), (16, 40)):
        got, ref = run_both(k, L, N)
        assert_same(got, ref)


@needs_interp
def test_interp_op_with_triton_assign_matches_recurrent(monkeypatch):
    # the whole op (triton_assign=True) against the float64 recurrent form, as the existing triton-path test does
    from test_kernels_ovq import check_op, op_inputs

    def pytorch_step1(*args, **kwargs):
        raise AssertionError("the Triton path should not run the PyTorch step 1 with triton_assign=True")

    monkeypatch.setattr(ovq_mod, "_chunk_slots", pytorch_step1)
    x0 = op_inputs(3, 21, 2, 16, 12, seed=1)
    with torch.no_grad():
        _, state = ovq_attention(x0["q"], x0["k"], x0["v"], scale=x0["beta"], chunk_size=8, max_dict_size=9,
                                 mask=left_pad_mask([21, 13, 6], 21), output_final_state=True, backend="chunk")
    mask = left_pad_mask([45, 30, 17], 45, holes=[(0, 21)])
    check_op(op_inputs(3, 45, 2, 16, 12), 8, 12, mask, 1e-5, 1e-5, state=state, triton_assign=True)


# ----------------------------------------------------------------------------- GPU
def _ms(fn, reps=5):
    fn()  # warm-up (compilation, CUDA-graph capture)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2], out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("keys_a_program", [128, 64, 32])
def test_gpu_assign_T4096_H8_d128_matches_pytorch(monkeypatch, keys_a_program):
    # 128: the addition and the search in one launch; fewer: the search split over the chunk's keys
    from lazoo.kernels._graphs import GraphCache
    from lazoo.kernels.ovq import assign as oa

    cfg = dict(oa._blocks(), BK=keys_a_program)
    monkeypatch.setattr(oa, "_blocks", lambda dk: cfg)
    monkeypatch.setattr(oa._Graph, "cache", GraphCache())  # graphs captured with another setting
    ovq_assign = oa.ovq_assign
    L, N = 128, 2048
    Kp, valid, st, t0, nb = packed(keys(1, 4096, 8, 128, seed=5, device="cuda"), L, N)
    ms_ref, ref = _ms(lambda: ovq_mod._chunk_slots(Kp, valid, st, t0, nb, L, N))
    ms_tri, got = _ms(lambda: ovq_assign(Kp, valid.sum(1) // L, t0 - nb, st["Dk"], st["counts"], L, N))
    print(f"OVQ step 1 at T=4096, H=8, d=128: PyTorch {ms_ref:.2f} ms, Triton ({keys_a_program} keys a search "
          f"program) {ms_tri:.2f} ms")
    assert_same(got, ref)
