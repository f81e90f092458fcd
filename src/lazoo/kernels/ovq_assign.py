"""Triton kernels for step 1 of OVQ attention's Triton path: every chunk's slot assignments, run by
``lazoo.ops.ovq_attention(..., backend="triton", triton_assign=True)`` (the mixer option ``triton_assign``).

The same rule as ``lazoo.ops.ovq._assign`` / ``_chunk_slots`` (no gradient: it only decides slots). The
dictionary is tracked as sums Σk (fp32, ``[B, H, M, dk]``) and int64 counts. The chunks depend on each other
(a chunk's keys move the centroids the next chunk compares with), so they run in order, two launches each:

  * ``_nearest_kernel``, one program per (block of BN slots, sample·head): the similarities of the chunk's
    L keys to the block's active centroids (sums / counts) and, per key, the block's best similarity and the
    FIRST slot reaching it (``torch.max``'s choice). The whole GPU searches one chunk at a time.
  * ``_merge_kernel``, one program per sample·head (the short sequential part):
      1. the counts before the chunk are written out; size = number of active slots (count > 0);
         n_new = clamp(ovq_dict_size(t_end, N) − size, 0, L);
      2. each key's best over the blocks (an earlier block keeps a tie: the first slot overall);
      3. rank of every key in a stable ascending sort of the best similarities, computed exactly as
         #{j: s_j < s_i} + #{j < i: s_j = s_i} (so ties go to the earlier key, as ``sort(stable=True)``);
         keys with rank < n_new open slots size + rank;
      4. with an empty dictionary (size = 0) every other key goes to its most similar new centroid
         (K Kᵀ over the new keys, first index on ties);
      5. the sums and counts are updated, BR keys at a time: keys sharing a slot are added up (a one-hot
         BR×L product in full fp32) and the first key of each slot adds that sum to its slot, so no two
         writers touch one row (a slot that receives one key gets exactly PyTorch's sum).

Chunks past a sample's complete ones get slots −1 and leave the dictionary unchanged (the counts before them
are still written). Everything is deterministic. Tie-breaking follows PyTorch exactly given the same
similarity values; the values themselves are fp32 dot products summed in another order (``tl.dot``, tf32x3
on the GPU: fp32-accurate, not bit-equal), so a key whose two best similarities differ by rounding only may
pick another slot than PyTorch does (exact ties, e.g. duplicated keys or exactly representable values, break
identically).

On CUDA the launches of ``GRAPH_STEPS`` chunks are captured once in a CUDA graph (per shape) and replayed, so
a chunk costs two kernel nodes and no host work. (The first form, one program per sample·head walking all
chunks, used B·H SMs and was slower than PyTorch from T = 4k: docs/ovq.md.) Limits: chunk_size <= 128 and
dk <= 128 (a chunk's L×dk keys and L×L rank comparisons are held whole by one program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._graphs import GraphCache, capture
from ._utils import is_interpreting, next_pow2

#: largest chunk size and head dim (keys of a chunk and L×L matrices are held in registers)
MAX_CHUNK = 128
MAX_HEAD_DIM = 128
#: fp32-accurate products on tensor cores for the similarities (plain tf32 would flip near ties)
SIM_PRECISION = "tf32x3"
#: chunks per captured CUDA graph (one replay runs this many chunks)
GRAPH_STEPS = 16


@triton.jit
def _chunk_keys(k, i_b, i_h, step, P, H, L, DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    """The L keys of chunk ``step`` of one (sample, head) as a [BL, BD] tile (0 past L and DK)."""
    rl = tl.arange(0, BL)
    od = tl.arange(0, BD)
    rows = (i_b * P + step * L + rl) * H + i_h
    return tl.load(k + rows[:, None] * DK + od[None, :], mask=(rl < L)[:, None] & (od < DK)[None, :], other=0.0)


@triton.jit(do_not_specialize=["step"])
def _nearest_kernel(k, sums, counts, best, arg, n_full, step, B, P, H, M, L,
                    DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                    SIM_PRECISION: tl.constexpr):
    """Per key of chunk ``step``: the best similarity to this block's active centroids and its first slot."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    nblk = tl.num_programs(0)
    rl = tl.arange(0, BL)
    out = (bh * nblk + blk) * BL + rl
    bmax = tl.full([BL], float("-inf"), tl.float32)
    barg = tl.full([BL], 2147483647, tl.int32)
    cols = blk * BN + tl.arange(0, BN)
    ok = cols < M
    cnt = tl.load(counts + bh * M + cols, mask=ok, other=0)
    if (step < tl.load(n_full + i_b)) & (tl.max(cnt, 0) > 0):  # a complete chunk and a non-empty block
        kt = _chunk_keys(k, i_b, i_h, step, P, H, L, DK, BL, BD)
        od = tl.arange(0, BD)
        sk = tl.load(sums + (bh * M + cols)[:, None] * DK + od[None, :], mask=ok[:, None] & (od < DK)[None, :],
                     other=0.0)
        mean = sk / tl.maximum(cnt, 1).to(tl.float32)[:, None]
        sim = tl.dot(kt, tl.trans(mean), input_precision=SIM_PRECISION)
        sim = tl.where((cnt > 0)[None, :], sim, float("-inf"))
        bmax = tl.max(sim, 1)
        barg = tl.min(tl.where(sim == bmax[:, None], cols[None, :], 2147483647), 1)  # first slot at the max
    tl.store(best + out, bmax)
    tl.store(arg + out, barg)


@triton.jit(do_not_specialize=["step"])
def _merge_kernel(k, sums, counts, best, arg, before, slots, n_full, t_base, step, B, P, H, M, L, N, NBLK,
                  DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr,
                  SIM_PRECISION: tl.constexpr):
    """Chunk ``step`` of one (sample, head): the counts before it, the slots of its keys, the update."""
    bh = tl.program_id(0).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    rl = tl.arange(0, BL)
    row_ok = rl < L
    sbase = bh * M  # row of slot 0 of this (sample, head) in sums / counts
    cbase = (step * B * H + bh) * M
    srow = (step * B * H + bh) * L
    NEG_INF = float("-inf")

    # 1. the counts before the chunk, the dictionary's size
    size = 0
    for s0 in range(0, M, BS):
        cols = s0 + tl.arange(0, BS)
        ok = cols < M
        cnt = tl.load(counts + sbase + cols, mask=ok, other=0)
        tl.store(before + cbase + cols, cnt, mask=ok)
        size += tl.sum((cnt > 0).to(tl.int32), 0)

    if step < tl.load(n_full + i_b):
        t_end = tl.load(t_base + i_b) + L * (step + 1)
        n_new = tl.minimum(tl.maximum(tl.maximum((t_end * N) // (t_end + N), 1) - size, 0), L)
        # 2. best old centroid per key over the blocks (strict: an earlier block keeps a tie)
        best_v = tl.full([BL], NEG_INF, tl.float32)
        best_i = tl.zeros([BL], tl.int32)
        for blk in range(0, NBLK):
            v = tl.load(best + (bh * NBLK + blk) * BL + rl)
            a = tl.load(arg + (bh * NBLK + blk) * BL + rl)
            better = v > best_v
            best_i = tl.where(better, a, best_i)
            best_v = tl.where(better, v, best_v)

        # 3. rank in a stable ascending sort of the best similarities (real keys only)
        bi = best_v[:, None]
        bj = best_v[None, :]
        earlier = (bj < bi) | ((bj == bi) & (rl[None, :] < rl[:, None]))
        rank = tl.sum((earlier & row_ok[None, :]).to(tl.int32), 1)
        is_new = (rank < n_new) & row_ok
        new_slot = size + rank

        kt = _chunk_keys(k, i_b, i_h, step, P, H, L, DK, BL, BD)
        old = best_i
        if size == 0:  # 4. empty dictionary: the other keys go to their most similar new centroid
            s2 = tl.dot(kt, tl.trans(kt), input_precision=SIM_PRECISION)
            s2 = tl.where(is_new[None, :], s2, NEG_INF)
            # the first key j at the row's max, encoded with its rank as j·BL + rank_j
            code = tl.min(tl.where(s2 == tl.max(s2, 1)[:, None], rl[None, :] * BL + rank[None, :],
                                   BL * BL), 1)
            old = code % BL  # size + rank of that key, size = 0
        slot = tl.where(is_new, tl.minimum(new_slot, M - 1), tl.minimum(tl.maximum(old, 0), M - 1))
        tl.store(slots + srow + rl, slot.to(tl.int64), mask=row_ok)

        # 5. update: the first key of each slot adds the chunk's sum of that slot's keys, BR keys at a time
        tl.debug_barrier()  # the slots just stored are read back in blocks
        od = tl.arange(0, BD)
        d_ok = od < DK
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
    else:  # an incomplete chunk: no update, slots -1
        tl.store(slots + srow + rl, tl.full([BL], -1, tl.int64), mask=row_ok)


def _blocks() -> dict:
    if is_interpreting():
        return dict(BN=16, BS=64, BR=16, nearest={}, merge={})
    # sm_90, Triton 3.6, L = dk = 128 (scripts/kernel_resources.py, no GPU): the search at BN = 64 with 8 warps
    # spills nothing (4 warps: 416 bytes); the merge program holds a chunk's L×dk keys, L×L rank comparisons
    # and a BR×L one-hot: BR = 8 spills 204 bytes (16: 1.3 KB), 197 KB of shared memory
    return dict(BN=64, BS=256, BR=8, nearest=dict(num_warps=8, num_stages=1),
                merge=dict(num_warps=8, num_stages=1))


class _Launcher:
    """The two launches of one chunk on fixed buffers: keys ``[B, S·L, H, dk]`` (S chunks), the running sums
    and counts, the per-block bests, and the outputs ``before [S, B, H, M]``, ``slots [S, B, H, L]``."""

    def __init__(self, B, H, L, M, dk, N, steps, device):
        self.B, self.H, self.L, self.M, self.dk, self.N, self.steps = B, H, L, M, dk, N, steps
        self.cfg = _blocks()
        self.nblk = triton.cdiv(M, self.cfg["BN"])
        self.BL, self.BD = next_pow2(L), next_pow2(dk)
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        self.k = torch.zeros(B, steps * L, H, dk, **f32)
        self.sums = torch.zeros(B, H, M, dk, **f32)
        self.counts = torch.zeros(B, H, M, **i64)
        self.n_full = torch.zeros(B, dtype=torch.int32, device=device)  # complete chunks among the S
        self.t_base = torch.zeros(B, **i64)  # real tokens before the first of the S chunks
        self.best = torch.empty(B * H * self.nblk * self.BL, **f32)
        self.arg = torch.empty(B * H * self.nblk * self.BL, dtype=torch.int32, device=device)
        self.before = torch.empty(steps, B, H, M, **i64)
        self.slots = torch.empty(steps, B, H, L, **i64)

    def run(self, n: int | None = None):
        """Chunks 0..n-1 of the buffers (all S by default)."""
        B, H, L, M, dk, cfg = self.B, self.H, self.L, self.M, self.dk, self.cfg
        P = self.steps * L
        for step in range(self.steps if n is None else n):
            _nearest_kernel[(self.nblk, B * H)](
                self.k, self.sums, self.counts, self.best, self.arg, self.n_full, step, B, P, H, M, L,
                DK=dk, BL=self.BL, BD=self.BD, BN=cfg["BN"], SIM_PRECISION=SIM_PRECISION, **cfg["nearest"])
            _merge_kernel[(B * H,)](
                self.k, self.sums, self.counts, self.best, self.arg, self.before, self.slots, self.n_full,
                self.t_base, step, B, P, H, M, L, self.N, self.nblk, DK=dk, BL=self.BL, BD=self.BD,
                BS=cfg["BS"], BR=cfg["BR"], SIM_PRECISION=SIM_PRECISION, **cfg["merge"])


class _Graph:
    """``GRAPH_STEPS`` chunks of ``_Launcher`` captured in one CUDA graph."""

    cache = GraphCache()

    def __init__(self, B, H, L, M, dk, N, device):
        self.launcher = _Launcher(B, H, L, M, dk, N, GRAPH_STEPS, device)
        self.graph, _ = capture(self.launcher.run, device)

    @classmethod
    def get(cls, B, H, L, M, dk, N, device):
        """The graph for this shape (built on first use), or None where it cannot be captured."""
        return cls.cache.get((B, H, L, M, dk, N, device), lambda: cls(B, H, L, M, dk, N, device))


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
    cnt = counts.to(torch.int64)
    if M == 0 or C == 0:
        return (torch.full((C, B, H, L), -1, dtype=torch.int64, device=k.device),
                torch.zeros(C, B, H, M, dtype=torch.int64, device=k.device), cnt.clone())
    graph = _Graph.get(B, H, L, M, dk, max_dict_size, k.device) if k.is_cuda else None
    run = graph.launcher if graph is not None else _Launcher(B, H, L, M, dk, max_dict_size, C, k.device)
    S = run.steps
    run.counts.copy_(cnt)
    # the running sums, computed as _chunk_slots does (an exact mean times its count)
    run.sums.copy_(dict_k.detach() * cnt[..., None].to(dict_k.dtype))
    kd = k.detach()
    n_full = n_full.to(torch.int64)
    slots, before = [], []
    for c0 in range(0, C, S):
        n = min(S, C - c0)
        run.k[:, :n * L].copy_(kd[:, c0 * L:(c0 + n) * L])
        run.n_full.copy_((n_full - c0).clamp(0, n))  # steps past the last chunk change nothing
        run.t_base.copy_(t_base.to(torch.int64) + L * c0)
        if graph is not None:
            graph.graph.replay()
        else:
            run.run(n)
        slots.append(run.slots[:n].clone())
        before.append(run.before[:n].clone())
    return torch.cat(slots), torch.cat(before), run.counts.clone()
