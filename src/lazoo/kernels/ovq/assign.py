"""Triton kernels for step 1 of OVQ attention's Triton path: every chunk's slot assignments, run by
``lazoo.ops.ovq_attention(..., backend="triton", triton_assign=True)`` (the mixer option ``triton_assign``).

The same rule as ``lazoo.ops.ovq._assign`` / ``_chunk_slots`` (no gradient: it only decides slots). The
dictionary is tracked as sums Σk (fp32, ``[B, H, M, dk]``) and int64 counts. The chunks depend on each other
(a chunk's keys move the centroids the next chunk compares with), so they run in order, two launches each:

  * ``_nearest_kernel``, one program per (block of BN slots, sample·head):
      1. the previous chunk's keys are added to the block's slots (a one-hot BN×L product on tensor cores, the
         keys split into three bf16 parts that add up to them exactly: each program owns its rows, so no two
         writers touch one) and the block's counts before this chunk are
         written out;
      2. the similarities of the chunk's L keys to the block's active centroids (sums / counts) and, per key,
         the block's best similarity and the FIRST slot reaching it (``torch.max``'s choice).
    The whole GPU applies and searches one chunk at a time. At head dims up to 64 the two parts are two launches,
    the search's programs taking 64 of the chunk's keys each (fewer registers a program: faster there, slower at
    d = 128).
  * ``_merge_kernel``, one program per sample·head (the short sequential part):
      1. size = number of active slots (carried from chunk to chunk: the slots in use are 0..size-1);
         n_new = clamp(ovq_dict_size(t_end, N) − size, 0, L);
      2. each key's best over the blocks (an earlier block keeps a tie: the first slot overall);
      3. rank of every key in a stable ascending sort of the best similarities, computed exactly as
         #{j: s_j < s_i} + #{j < i: s_j = s_i} (so ties go to the earlier key, as ``sort(stable=True)``);
         keys with rank < n_new open slots size + rank;
      4. with an empty dictionary (size = 0) every other key goes to its most similar new centroid
         (K Kᵀ over the new keys, first index on ties);
      5. the slots are written; the next launch of ``_nearest_kernel`` adds the keys to them (after the last
         chunk, a launch that only adds).

Chunks past a sample's complete ones get slots −1 and leave the dictionary unchanged (the counts before them
are still written). Everything is deterministic. Tie-breaking follows PyTorch exactly given the same
similarity values; the values themselves are fp32 dot products summed in another order (``SIM_PRECISION``:
full fp32, not bit-equal), so a key whose two best similarities differ by rounding only may
pick another slot than PyTorch does (exact ties, e.g. duplicated keys or exactly representable values, break
identically).

On CUDA the launches of ``GRAPH_STEPS`` chunks are captured once in a CUDA graph (per shape) and replayed, so
a chunk costs two kernel nodes and no host work. (One launch for all chunks, the programs of a (sample, head)
waiting for each other once a chunk, was built and measured: exact, and 2× slower on an H200, 12.3 / 40.8 ms
against 6.4 / 17.7 for the op at T = 4k / 16k, with B·H = 8 and 2048 slots: its 128 programs, one an SM, each wait
at every chunk for a head's slowest, and the blocks they need spill; docs/changelog.md. The first form, one program
per sample·head walking all chunks, used B·H SMs and was slower than PyTorch from T = 4k: docs/ovq.md.) Limits:
chunk_size <= 128 and dk <= 128 (a chunk's L×dk keys and L×L rank comparisons are held whole by one program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._graphs import GraphCache, capture
from .._utils import is_interpreting, next_pow2
from ..limits import OVQ_ASSIGN_MAX_CHUNK as MAX_CHUNK
from ..limits import OVQ_ASSIGN_MAX_HEAD_DIM as MAX_HEAD_DIM

#: the similarities' products: full fp32 ("ieee"). Split products on tensor cores changed the assignments: at
#: T = 64k (H = 8, d = 128, N = 2048, bench_ovq's inputs) "tf32x3" and a six-product bf16 split both left the op's
#: output 6.9e-2 from the float64 chunk form, where PyTorch's fp32 assignment and "ieee" were 2.7e-3 (equal
#: slots); "ieee" costs 1.5× the split's forward time there (65.6 against 43 ms, H200)
SIM_PRECISION = "ieee"
#: chunks per captured CUDA graph (one replay runs this many chunks)
GRAPH_STEPS = 16


@triton.jit
def _chunk_keys(k, i_b, i_h, step, P, H, L, DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    """The L keys of chunk ``step`` of one (sample, head) as a [BL, BD] tile (0 past L and DK)."""
    rl = tl.arange(0, BL)
    od = tl.arange(0, BD)
    rows = (i_b * P + step * L + rl) * H + i_h
    return tl.load(k + rows[:, None] * DK + od[None, :], mask=(rl < L)[:, None] & (od < DK)[None, :], other=0.0)


@triton.jit
def _bf16_parts(x):
    """fp32 ``x`` as three bf16 tiles whose sum is ``x`` exactly (8 + 8 + 8 bits of mantissa)."""
    x1 = x.to(tl.bfloat16)
    r1 = x - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    return x1, x2, (r1 - x2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _block_program(counts, H, M, BL: tl.constexpr, BN: tl.constexpr):
    """A search program on grid (blocks of BN slots, B·H): its block and (sample, head), its slots ``cols`` (real:
    ``ok``) and their counts."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    nblk = tl.num_programs(0)
    cols = blk * BN + tl.arange(0, BN)
    ok = cols < M
    cnt = tl.load(counts + bh * M + cols, mask=ok, other=0)
    return blk, bh, bh // H, bh % H, nblk, tl.arange(0, BL), cols, ok, cnt


@triton.jit
def _add_keys(k, sums, counts, cnt, prev, cols, ok, i_b, i_h, bh, step, P, H, M, L,
              DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BDA: tl.constexpr, BF16_PARTS: tl.constexpr):
    """Chunk ``step − 1``'s keys (slots ``prev`` ``[BL]``; −1 joins nothing) added to this block's slots ``cols``:
    their sums in ``sums`` and counts ``cnt`` (stored, and returned)."""
    rl = tl.arange(0, BL)
    hit = prev.to(tl.int32)[None, :] == cols[:, None]  # [BN, BL]
    joined = tl.sum(hit.to(tl.int64), 1)
    if tl.max(joined, 0) > 0:
        onehot = hit.to(tl.float32)
        key_rows = (i_b * P + (step - 1) * L + rl) * H + i_h
        for d0 in range(0, BD, BDA):  # BDA columns at a time: the whole [BN, BD] product spills
            oc = d0 + tl.arange(0, BDA)
            c_ok = oc < DK
            kc = tl.load(k + key_rows[:, None] * DK + oc[None, :], mask=(rl < L)[:, None] & c_ok[None, :],
                         other=0.0)
            if BF16_PARTS:
                # the keys' exact bf16 parts: the one-hot sums on tensor cores, fp32-accurate (with full-fp32
                # "ieee" products the launch took 39.7 µs a chunk, with these 36.8: H200, T = 16k, BDA = 32)
                k1, k2, k3 = _bf16_parts(kc)
                h = onehot.to(tl.bfloat16)
                agg = tl.dot(h, k3) + tl.dot(h, k2) + tl.dot(h, k1)  # [BN, BDA], fp32
            else:  # the interpreter (bf16 is broken there)
                agg = tl.dot(onehot, kc, input_precision="ieee")
            at = (bh * M + cols)[:, None] * DK + oc[None, :]
            a_ok = ok[:, None] & c_ok[None, :]
            tl.store(sums + at, tl.load(sums + at, mask=a_ok, other=0.0) + agg, mask=a_ok)
        cnt += joined
        tl.store(counts + bh * M + cols, cnt, mask=ok)
    return cnt


@triton.jit
def _block_best(k, sums, cnt, cols, ok, i_b, i_h, bh, step, P, H, M, L, active, k0,
                DK: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BDS: tl.constexpr,
                SIM_PRECISION: tl.constexpr):
    """Per key ``k0 .. k0 + BK − 1`` of chunk ``step``: the best similarity to this block's active centroids (slots
    ``cols``, real where ``ok``) and the FIRST slot reaching it (-inf and a huge slot where not ``active``: an
    incomplete chunk or an empty block)."""
    bmax = tl.full([BK], float("-inf"), tl.float32)
    barg = tl.full([BK], 2147483647, tl.int32)
    if active:
        rl = k0 + tl.arange(0, BK)
        key_rows = (i_b * P + step * L + rl) * H + i_h
        sim = tl.zeros([BK, BN], tl.float32)
        for d0 in range(0, BD, BDS):  # BDS features a step into one accumulator (the FMA product's order is kept)
            od = d0 + tl.arange(0, BDS)
            d_ok = od < DK
            kc = tl.load(k + key_rows[:, None] * DK + od[None, :], mask=(rl < L)[:, None] & d_ok[None, :], other=0.0)
            sk = tl.load(sums + (bh * M + cols)[:, None] * DK + od[None, :], mask=ok[:, None] & d_ok[None, :],
                         other=0.0)
            mean = sk / tl.maximum(cnt, 1).to(tl.float32)[:, None]
            sim = tl.dot(kc, tl.trans(mean), sim, input_precision=SIM_PRECISION)
        sim = tl.where((cnt > 0)[None, :], sim, float("-inf"))
        bmax = tl.max(sim, 1)
        barg = tl.min(tl.where(sim == bmax[:, None], cols[None, :], 2147483647), 1)  # first slot at the max
    return bmax, barg


@triton.jit(do_not_specialize=["step"])
def _nearest_kernel(k, sums, counts, best, arg, before, slots, n_full, step, B, P, H, M, L,
                    DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                    SIM_PRECISION: tl.constexpr, ADD: tl.constexpr, SEARCH: tl.constexpr, BK: tl.constexpr,
                    BDA: tl.constexpr, BDS: tl.constexpr, BF16_PARTS: tl.constexpr):
    """This block's slots: chunk ``step − 1``'s keys added (``ADD``), and (``SEARCH``) the counts before chunk
    ``step`` written out and per key of chunk ``step`` the best similarity to the block's active centroids and its
    first slot, for keys ``BK · program_id(2)`` onwards. Both in one launch (BK = BL), or the addition in one and the
    search in the next, whose programs then take BK keys each."""
    blk, bh, i_b, i_h, nblk, rl, cols, ok, cnt = _block_program(counts, H, M, BL, BN)
    if ADD:
        if step > 0:  # 1. the previous chunk's keys join their slots
            prev = tl.load(slots + ((step - 1) * B * H + bh) * L + rl, mask=rl < L, other=-1)
            cnt = _add_keys(k, sums, counts, cnt, prev, cols, ok, i_b, i_h, bh, step, P, H, M, L, DK, BL, BD, BDA,
                            BF16_PARTS)
        # the sums just stored are read back below in another layout, so by other threads of this program
        tl.debug_barrier()
    if SEARCH:  # 2. the counts before this chunk, and the block's best for a complete chunk
        part = tl.program_id(2)
        if part == 0:
            tl.store(before + (step * B * H + bh) * M + cols, cnt, mask=ok)
        active = (step < tl.load(n_full + i_b)) & (tl.max(cnt, 0) > 0)
        bmax, barg = _block_best(k, sums, cnt, cols, ok, i_b, i_h, bh, step, P, H, M, L, active, part * BK, DK, BK,
                                 BD, BN, BDS, SIM_PRECISION)
        out = (bh * nblk + blk) * BL + part * BK + tl.arange(0, BK)
        tl.store(best + out, bmax)
        tl.store(arg + out, barg)


@triton.jit
def _chunk_slots_of(k, best, arg, part, nblk, size, t_end, i_b, i_h, step, P, H, M, L, N,
                    DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, SIM_PRECISION: tl.constexpr,
                    BRK: tl.constexpr, NBG: tl.constexpr):
    """The slots ``[BL]`` of a complete chunk ``step``'s keys and the dictionary's size after it, from the blocks'
    bests (``best`` / ``arg`` rows ``part .. part + nblk − 1``) and the size before it."""
    rl = tl.arange(0, BL)
    row_ok = rl < L
    NEG_INF = float("-inf")
    n_new = tl.minimum(tl.maximum(tl.maximum((t_end * N) // (t_end + N), 1) - size, 0), L)
    # best old centroid per key over the blocks (an earlier block keeps a tie: its first slot is the smaller), NBG
    # blocks a load: with one a load, each waited for the last, and the merge took 12-13 µs a chunk at 32 blocks
    # (H200; step 1 is 4-7 % faster now); ".cg": the search launch wrote them
    best_v = tl.full([BL], NEG_INF, tl.float32)
    best_i = tl.zeros([BL], tl.int32)
    for g0 in range(0, nblk, NBG):
        gb = g0 + tl.arange(0, NBG)
        at = (part + gb)[:, None] * BL + rl[None, :]
        v = tl.load(best + at, mask=(gb < nblk)[:, None], other=NEG_INF, cache_modifier=".cg")  # [NBG, BL]
        a = tl.load(arg + at, mask=(gb < nblk)[:, None], other=2147483647, cache_modifier=".cg")
        gv = tl.max(v, 0)
        gi = tl.min(tl.where(v == gv[None, :], a, 2147483647), 0)
        better = gv > best_v
        best_i = tl.where(better, gi, best_i)
        best_v = tl.where(better, gv, best_v)

    # rank in a stable ascending sort of the best similarities (real keys only)
    bi = best_v[:, None]
    bj = best_v[None, :]
    earlier = (bj < bi) | ((bj == bi) & (rl[None, :] < rl[:, None]))
    rank = tl.sum((earlier & row_ok[None, :]).to(tl.int32), 1)
    is_new = (rank < n_new) & row_ok
    slot = tl.where(is_new, tl.minimum(size + rank, M - 1), tl.minimum(tl.maximum(best_i, 0), M - 1)).to(tl.int64)
    if size == 0:  # empty dictionary: the other keys go to their most similar new centroid
        # BRK keys at a time (a full-fp32 L×L product held whole spills)
        slot = tl.zeros([BL], tl.int64)
        kt = _chunk_keys(k, i_b, i_h, step, P, H, L, DK, BL, BD)
        od = tl.arange(0, BD)
        for r0 in range(0, BL, BRK):
            rr = r0 + tl.arange(0, BRK)
            pick = rl[None, :] == rr[:, None]  # [BRK, BL]: row r's own entry of a [BL] vector
            new_r = tl.sum(tl.where(pick, is_new.to(tl.int32)[None, :], 0), 1) > 0
            rank_r = tl.sum(tl.where(pick, rank[None, :], 0), 1)
            key_rows = (i_b * P + step * L + rr) * H + i_h
            kr = tl.load(k + key_rows[:, None] * DK + od[None, :],
                         mask=(rr < L)[:, None] & (od < DK)[None, :], other=0.0)
            s2 = tl.dot(kr, tl.trans(kt), input_precision=SIM_PRECISION)  # [BRK, BL]
            s2 = tl.where(is_new[None, :], s2, NEG_INF)
            # the first key j at the row's max, encoded with its rank as j·BL + rank_j
            code = tl.min(tl.where(s2 == tl.max(s2, 1)[:, None], rl[None, :] * BL + rank[None, :], BL * BL), 1)
            slot_r = tl.where(new_r, tl.minimum(rank_r, M - 1), tl.minimum(code % BL, M - 1)).to(tl.int64)
            slot += tl.sum(tl.where(pick, slot_r[:, None], 0), 0)
    slot = tl.where(row_ok, slot, -1)  # rows past L join nothing
    return slot, tl.minimum(size + n_new, M).to(tl.int32)


@triton.jit(do_not_specialize=["step"])
def _merge_kernel(k, best, arg, slots, size_of, n_full, t_base, step, B, P, H, M, L, N, NBLK,
                  DK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, SIM_PRECISION: tl.constexpr,
                  BRK: tl.constexpr, NBG: tl.constexpr):
    """Chunk ``step`` of one (sample, head): the slots of its keys (written; the next search launch adds the keys),
    and the dictionary's size after it."""
    bh = tl.program_id(0).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    rl = tl.arange(0, BL)
    srow = (step * B * H + bh) * L
    slot = tl.full([BL], -1, tl.int64)  # an incomplete chunk: no update, slots -1
    if step < tl.load(n_full + i_b):
        t_end = tl.load(t_base + i_b) + L * (step + 1)
        slot, size = _chunk_slots_of(k, best, arg, bh * NBLK, NBLK, tl.load(size_of + bh), t_end, i_b, i_h, step,
                                     P, H, M, L, N, DK, BL, BD, SIM_PRECISION, BRK, NBG)
        tl.store(size_of + bh, size)
    tl.store(slots + srow + rl, slot, mask=rl < L)


def _blocks(dk: int = 128) -> dict:
    """Launch settings for head dim ``dk``."""
    if is_interpreting():
        return dict(BN=16, BDA=16, BDS=16, BRK=8, NBG=2, BK=4, BF16_PARTS=False, nearest={}, search={}, merge={})
    # sm_90, Triton 3.6, L = dk = 128: the search in 4 warps, one stage, with the add and the similarity product 32
    # features a step (step 1 at T = 4k / 16k, H = 8, H100: 1.89 / 7.22 ms, against 2.15 / 9.40 with both whole at
    # 8 warps, which spilled 792 bytes offline (Triton 3.9); BN 32 or 128, BDS / BDA 16 or 64, 2 or 16 warps and two
    # stages were all slower: docs/changelog.md); the merge's first-chunk rule BRK = 16 keys at a time (32: 4.3 KB of
    # spills); the merge reads the blocks' bests NBG = 32 blocks a load
    cfg = dict(BN=64, BDA=32, BDS=32, BRK=16, NBG=32, BK=128, BF16_PARTS=True,
               nearest=dict(num_warps=4, num_stages=1), search=dict(num_warps=4, num_stages=1),
               merge=dict(num_warps=8, num_stages=1))
    if dk <= 64:
        # the addition in a launch of its own, then the search on 64 keys a program at 2 warps: 5.20 against 5.45 ms
        # in one launch at sw-ovq's training shape (T = 8k, B 2, H 12, d 64); at d = 128 it was slower, 1.81 / 7.03
        # against 1.76 / 6.69 ms at T = 4k / 16k (H200, docs/changelog.md)
        cfg.update(BK=64, search=dict(num_warps=2, num_stages=1))
    return cfg


class _Launcher:
    """The launches of S chunks on fixed buffers: keys ``[B, S·L, H, dk]``, the running sums, counts and
    dictionary sizes, the per-block bests, and the outputs ``before [S, B, H, M]``, ``slots [S, B, H, L]``."""

    def __init__(self, B, H, L, M, dk, N, steps, device):
        self.B, self.H, self.L, self.M, self.dk, self.N, self.steps = B, H, L, M, dk, N, steps
        self.cfg = _blocks(dk)
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:  # no bf16 products before sm_80
            self.cfg = dict(self.cfg, BF16_PARTS=False)
        self.nblk = triton.cdiv(M, self.cfg["BN"])
        self.BL, self.BD = next_pow2(L), next_pow2(dk)
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        self.k = torch.zeros(B, steps * L, H, dk, **f32)
        self.sums = torch.zeros(B, H, M, dk, **f32)
        self.counts = torch.zeros(B, H, M, **i64)
        self.size = torch.zeros(B * H, dtype=torch.int32, device=device)  # active slots (0..size-1)
        self.n_full = torch.zeros(B, dtype=torch.int32, device=device)  # complete chunks among the S
        self.t_base = torch.zeros(B, **i64)  # real tokens before the first of the S chunks
        self.best = torch.empty(B * H * self.nblk * self.BL, **f32)
        self.arg = torch.empty(B * H * self.nblk * self.BL, dtype=torch.int32, device=device)
        self.before = torch.empty(steps, B, H, M, **i64)
        self.slots = torch.empty(steps, B, H, L, **i64)

    def run(self, n: int | None = None):
        """Chunks 0..n-1 of the buffers (all S by default), ending with the last one's keys added."""
        B, H, L, M, dk, cfg = self.B, self.H, self.L, self.M, self.dk, self.cfg
        P = self.steps * L
        n = self.steps if n is None else n
        BK = min(cfg["BK"], self.BL)

        def nearest(step, parts, add, search, keys, opts):
            _nearest_kernel[(self.nblk, B * H, parts)](
                self.k, self.sums, self.counts, self.best, self.arg, self.before, self.slots, self.n_full, step,
                B, P, H, M, L, DK=dk, BL=self.BL, BD=self.BD, BN=cfg["BN"], SIM_PRECISION=SIM_PRECISION,
                ADD=add, SEARCH=search, BK=keys, BDA=cfg["BDA"], BDS=cfg["BDS"], BF16_PARTS=cfg["BF16_PARTS"], **opts)

        for step in range(n + 1):
            if BK == self.BL:  # the addition and the search in one launch
                nearest(step, 1, True, step < n, BK, cfg["nearest"])
            else:  # the addition, then the search on BL / BK programs a block
                if step > 0:
                    nearest(step, 1, True, False, self.BL, cfg["nearest"])
                if step < n:
                    nearest(step, self.BL // BK, False, True, BK, cfg["search"])
            if step < n:
                _merge_kernel[(B * H,)](
                    self.k, self.best, self.arg, self.slots, self.size, self.n_full, self.t_base, step, B, P, H, M,
                    L, self.N, self.nblk, DK=dk, BL=self.BL, BD=self.BD, SIM_PRECISION=SIM_PRECISION,
                    BRK=min(self.BL, cfg["BRK"]), NBG=min(next_pow2(self.nblk), cfg["NBG"]), **cfg["merge"])


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
    run.size.copy_((cnt > 0).sum(-1).flatten())
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
