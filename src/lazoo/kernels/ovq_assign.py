"""Triton kernel for step 1 of OVQ attention's Triton path: every chunk's slot assignments, run by
``lazoo.ops.ovq_attention(..., backend="triton", triton_assign=True)`` (the mixer option ``triton_assign``).

The same rule as ``lazoo.ops.ovq._assign`` / ``_chunk_slots`` (no gradient: it only decides slots), for
all chunks of a call in ONE launch, one program per (sample, head) walking its chunks in order. The
dictionary is tracked as sums Σk (fp32, ``[B, H, M, dk]``, in global memory) and int64 counts; per
complete chunk of L keys:

  1. the counts before the chunk are written out; size = number of active slots (count > 0);
     n_new = clamp(ovq_dict_size(t_end, N) − size, 0, L);
  2. similarities of the L keys to the active centroids (sums / counts), BN slots at a time, keeping
     each key's best similarity and the FIRST slot reaching it (``torch.max``'s choice);
  3. rank of every key in a stable ascending sort of the best similarities, computed exactly as
     #{j: s_j < s_i} + #{j < i: s_j = s_i} (so ties go to the earlier key, as ``sort(stable=True)``);
     keys with rank < n_new open slots size + rank;
  4. with an empty dictionary (size = 0) every other key goes to its most similar new centroid
     (K Kᵀ over the new keys, first index on ties);
  5. the sums and counts are updated, BR keys at a time: keys sharing a slot are added up (a one-hot
     BR×L product in full fp32) and the first key of each slot adds that sum to its slot, so no two
     writers touch one row (a slot that receives one key gets exactly PyTorch's sum).

Chunks past a sample's complete ones get slots −1 and leave the dictionary unchanged (the counts
before them are still written). Everything is deterministic. Tie-breaking follows PyTorch exactly given
the same similarity values; the values themselves are fp32 dot products summed in another order
(``tl.dot``, tf32x3 on the GPU: fp32-accurate, not bit-equal), so a key whose two best similarities
differ by rounding only may pick another slot than PyTorch does (exact ties, e.g. duplicated keys or
exactly representable values, break identically). PyTorch's own CUDA scatter-add is not bit-reproducible
either.

Why one program per (sample, head) rather than two kernels per chunk: one launch replaces the ~40
small PyTorch ops per chunk (0.25 ms per chunk even as CUDA-graph replays, docs/ovq.md); a chunk's
work is one L×size×dk product (≤ 128×2048×128 multiply-adds; estimated at tens of µs on one SM, not
measured), and it needs no host loop, no partial results in global memory and no CUDA graph. It uses
only B·H SMs; splitting the similarities over slot blocks would be the next step if the measured time
says so. Limits: chunk_size <= 128 and dk <= 128 (a chunk's L×dk keys and L×L rank comparisons are
held whole). Compiled for sm_90 by Triton 3.6 at L = dk = 128, 8 warps, one stage, BN = 16: 255 registers,
~2.9 KB spilled per thread, 213 KB shared memory (ptxas -v, without a GPU). The first GPU run (H200, with
3 stages and BN = 32: 262 KB) failed to launch for want of shared memory; the fitted launch has not run on
a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import is_interpreting, next_pow2

#: largest chunk size and head dim (keys of a chunk and L×L matrices are held in registers)
MAX_CHUNK = 128
MAX_HEAD_DIM = 128
#: fp32-accurate products on tensor cores for the similarities (plain tf32 would flip near ties)
SIM_PRECISION = "tf32x3"


@triton.jit
def _counts_pass(counts, before, sbase, cbase, M, BS: tl.constexpr):
    """Copy the counts of one (sample, head) into ``before`` and return (active slots, last active + 1)."""
    size = 0
    hi = 0
    for s0 in range(0, M, BS):
        cols = s0 + tl.arange(0, BS)
        ok = cols < M
        cnt = tl.load(counts + sbase + cols, mask=ok, other=0)
        tl.store(before + cbase + cols, cnt, mask=ok)
        act = cnt > 0
        size += tl.sum(act.to(tl.int32), 0)
        hi = tl.maximum(hi, tl.max(tl.where(act, cols + 1, 0), 0))
    return size, hi


@triton.jit
def _assign_kernel(k, sums, counts, before, slots, n_full, t_base, B, P, H, C, M, L, N,
                   DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                   BS: tl.constexpr, BR: tl.constexpr, SIM_PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    nf = tl.load(n_full + i_b)
    tb = tl.load(t_base + i_b)  # real tokens before the first packed chunk (a multiple of L)
    rl = tl.arange(0, BL)
    row_ok = rl < L
    od = tl.arange(0, BD)
    d_ok = od < DK
    sbase = bh * M  # row of slot 0 of this (sample, head) in sums / counts
    NEG_INF = float("-inf")
    for c in range(0, nf):  # complete chunks (a prefix of the packed chunks)
        cbase = (c * B * H + bh) * M
        size, hi = _counts_pass(counts, before, sbase, cbase, M, BS)
        t_end = tb + L * (c + 1)
        n_new = tl.minimum(tl.maximum(tl.maximum((t_end * N) // (t_end + N), 1) - size, 0), L)
        rows = (i_b * P + c * L + rl) * H + i_h
        kt = tl.load(k + rows[:, None] * DK + od[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # best old centroid per key: max similarity, first slot on ties
        best = tl.full([BL], NEG_INF, tl.float32)
        best_idx = tl.zeros([BL], tl.int32)
        for s0 in range(0, hi, BN):
            cols = s0 + tl.arange(0, BN)
            ok = cols < hi
            cnt = tl.load(counts + sbase + cols, mask=ok, other=0)
            sk = tl.load(sums + (sbase + cols)[:, None] * DK + od[None, :], mask=ok[:, None] & d_ok[None, :],
                         other=0.0)
            mean = sk / tl.maximum(cnt, 1).to(tl.float32)[:, None]
            sim = tl.dot(kt, tl.trans(mean), input_precision=SIM_PRECISION)
            sim = tl.where((cnt > 0)[None, :], sim, NEG_INF)
            bmax = tl.max(sim, 1)
            barg = tl.min(tl.where(sim == bmax[:, None], cols[None, :], 2147483647), 1)  # first slot at the max
            better = bmax > best  # strict: an earlier block keeps a tie
            best_idx = tl.where(better, barg, best_idx)
            best = tl.where(better, bmax, best)

        # rank in a stable ascending sort of the best similarities (real keys only)
        bi = best[:, None]
        bj = best[None, :]
        earlier = (bj < bi) | ((bj == bi) & (rl[None, :] < rl[:, None]))
        rank = tl.sum((earlier & row_ok[None, :]).to(tl.int32), 1)
        is_new = (rank < n_new) & row_ok
        new_slot = size + rank

        old = best_idx
        if size == 0:  # empty dictionary: the other keys go to their most similar new centroid
            s2 = tl.dot(kt, tl.trans(kt), input_precision=SIM_PRECISION)
            s2 = tl.where(is_new[None, :], s2, NEG_INF)
            # the first key j at the row's max, encoded with its rank as j·BL + rank_j
            code = tl.min(tl.where(s2 == tl.max(s2, 1)[:, None], rl[None, :] * BL + rank[None, :],
                                   BL * BL), 1)
            old = code % BL  # size + rank of that key, size = 0
        slot = tl.where(is_new, tl.minimum(new_slot, M - 1), tl.minimum(tl.maximum(old, 0), M - 1))
        srow = (c * B * H + bh) * L
        tl.store(slots + srow + rl, slot.to(tl.int64), mask=row_ok)

        # update: the first key of each slot adds the chunk's sum of that slot's keys, BR keys at a time
        tl.debug_barrier()  # the slots just stored are read back in blocks
        for r0 in range(0, L, BR):
            rr = r0 + tl.arange(0, BR)
            rr_ok = rr < L
            s_blk = tl.load(slots + srow + rr, mask=rr_ok, other=-1).to(tl.int32)
            same = (s_blk[:, None] == slot[None, :]) & rr_ok[:, None] & row_ok[None, :]
            lead = rr_ok & (tl.sum((same & (rl[None, :] < rr[:, None])).to(tl.int32), 1) == 0)
            m = tl.sum(same.to(tl.int64), 1)
            agg = tl.dot(same.to(tl.float32), kt, input_precision="ieee")  # [BR, BD]
            dst = sbase + s_blk
            wmask = lead[:, None] & d_ok[None, :]
            acc = tl.load(sums + dst[:, None] * DK + od[None, :], mask=wmask, other=0.0)
            tl.store(sums + dst[:, None] * DK + od[None, :], acc + agg, mask=wmask)
            cnt_old = tl.load(counts + dst, mask=lead, other=0)
            tl.store(counts + dst, cnt_old + m, mask=lead)
        tl.debug_barrier()  # the next chunk reads what this one wrote
    for c in range(nf, C):  # incomplete chunks: no update, slots -1
        cbase = (c * B * H + bh) * M
        _counts_pass(counts, before, sbase, cbase, M, BS)
        srow = (c * B * H + bh) * L
        tl.store(slots + srow + rl, tl.full([BL], -1, tl.int64), mask=row_ok)


def _blocks() -> dict:
    if is_interpreting():
        return dict(BN=16, BS=64, BR=16)
    # one pipeline stage and 16-slot similarity blocks: 213 KB of shared memory at L = dk = 128 under Triton 3.6
    # (the tf32x3 operand copies of the L×dk keys dominate); the default 3 stages asked for 262 KB and did not
    # launch on an H200 (232 KB per block)
    return dict(BN=16, BS=256, BR=16, num_warps=8, num_stages=1)


@torch.no_grad()
def ovq_assign(k, n_full, t_base, dict_k, counts, chunk_size: int, max_dict_size: int):
    """Slot assignments of every chunk (``lazoo.ops.ovq._chunk_slots``'s rule and outputs).

    k ``[B, C·L, H, dk]`` float32: each sample's keys packed into C chunks of L = ``chunk_size``;
    n_full ``[B]``: how many leading chunks are complete (the others are not applied);
    t_base ``[B]`` int64: real tokens before the first chunk (a multiple of L);
    dict_k ``[B, H, M, dk]`` float32 and counts ``[B, H, M]`` int64: the dictionary before the first chunk
    (means; empty slots hold zeros). Returns (slots ``[C, B, H, L]`` int64, −1 for incomplete chunks;
    the counts before every chunk ``[C, B, H, M]``; the counts after the last ``[B, H, M]``)."""
    B, P, H, dk = k.shape
    L = chunk_size
    if P % L:
        raise ValueError(f"ovq_assign: the packed length {P} is not a whole number of chunks of {L}")
    if L > MAX_CHUNK or dk > MAX_HEAD_DIM:
        raise ValueError(f"ovq_assign: chunk_size <= {MAX_CHUNK} and dk <= {MAX_HEAD_DIM} only, got {L}, {dk}")
    if k.dtype != torch.float32 or dict_k.dtype != torch.float32:
        raise ValueError("ovq_assign: k and dict_k must be float32")
    M = dict_k.shape[2]
    C = P // L
    cnt = counts.to(torch.int64).contiguous().clone()
    # the running sums, computed as _chunk_slots does (an exact mean times its count)
    sums = (dict_k.detach() * cnt[..., None].to(dict_k.dtype)).contiguous()
    before = torch.empty(C, B, H, M, dtype=torch.int64, device=k.device)
    slots = torch.empty(C, B, H, L, dtype=torch.int64, device=k.device)
    if M == 0 or C == 0:
        return slots.fill_(-1), before.zero_(), cnt
    cfg = _blocks()
    _assign_kernel[(B * H,)](k.detach().contiguous(), sums, cnt, before, slots,
                             n_full.to(torch.int32).contiguous(), t_base.to(torch.int64).contiguous(),
                             B, P, H, C, M, L, max_dict_size, DK=dk, BL=next_pow2(L), BD=next_pow2(dk),
                             SIM_PRECISION=SIM_PRECISION, **cfg)
    return slots, before, cnt
