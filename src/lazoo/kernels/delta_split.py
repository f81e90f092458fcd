"""Long sequences split over the card: the (gated) delta rule's state walks for few sequences x heads.

A state walk is sequential over a sequence's chunks, so one 32k-token sequence of 16 heads gives the walks 16-32
programs for 132 multiprocessors. Every chunk's update is affine in the state (Sᵀ as X ``[dk, dv]``):

    X' = T X + B,   T = γ I − Bkᵀ Cm,   B = Bkᵀ R

(the training form: Bk = diag(β e^(G_last − G)) K, Cm = W~, R = U~; the prefill's: Bk = Y, Cm = diag(e^G) K,
R = V). Splitting each sequence into segments of whole chunks, one pass walks every segment from a zero state and
from the identity at once (dk more columns beside the state's dv ones, with R = 0 in them), giving its end as
``T_s X_start + E_s``; a short pass chains the segments (a dk x dk product each) into every segment's true start
state; then the usual walk runs over the segments as if each were a sequence of its own, with those start states.
The backward's reverse walk splits the same way with the transposed maps. Nothing is approximated: the chained
starts are the walk's own arithmetic reordered. FlashQLA (Qwen team) also splits few long sequences over the card,
truncating each segment's look-back once the decay has made it negligible; this split is exact, needs no decay,
and serves the plain delta rule too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._delta_tiles import dot_acc, gate, load_factor, load_raw, load_tile
from ._tiles import dot
from ._utils import next_pow2, num_sms

#: None: split on a GPU where the longest sequence's walk is at least 2.5 times its fair share and makes 3 segments
#: of SPLIT_MIN_CHUNKS (below); True: there under the interpreter too (the tests); False: never. The fair share is
#: the chunks a walk program would take if the batch's walk work (chunks x heads x dv blocks of 64) were spread
#: evenly over SPLIT_PROGRAMS_PER_SM programs a multiprocessor: for equal sequences the split is where the walks
#: have at most 0.4 programs a multiprocessor; in a packed batch, where one long document outlasts the short ones.
SPLIT_LONG_SEQUENCES: bool | None = None
#: the longest sequence is cut into round(its length / its fair share) segments of SPLIT_MIN_CHUNKS or more, every
#: sequence as long into segments as long, where that makes SPLIT_MIN_PIECES segments or more. H200, bf16, gated,
#: H = 16, fwd + bwd, GPU time (``experiments/split_packed.py``): one sequence of 32k tokens, 4 segments,
#: 4.31 -> 3.94 ms; a packed 24k document and 16 of 512 tokens, 3 segments, 4.64 -> 4.37; but in 2 segments two
#: sequences of 16k 3.64 -> 3.93, a packed 16k document and 32 of 512 4.10 -> 4.68, 12k and 40 of 512
#: 3.84 -> 4.43 (the segment pass walks the same chunks first, over dv + dk columns, so halving the walk does not
#: pay for it). At 2 programs a multiprocessor (8 segments at 32k) 4.03 ms: more, shorter segments cost more than
#: the shorter chain saves
SPLIT_PROGRAMS_PER_SM = 1.0
SPLIT_MIN_PIECES = 3
#: no segment shorter than this many chunks: a single sequence of 4k or 8k tokens is not split. There the op waits
#: on the host (H200, fwd + bwd, 16 heads, wall 1.6-2.3 ms against 0.6-1.15 ms of GPU time), and four segments
#: save 0.015 and 0.06 ms of GPU time (0.61 -> 0.60, 1.15 -> 1.09) for four more launches; at 16k 2.24 -> 2.06
SPLIT_MIN_CHUNKS = 64
#: the segment passes' block of walked columns (dv, then dk). H200, 32k, fwd + bwd / forward, wall (``experiments/
#: launch_options.py variants``): 64 3.75 / 1.18 ms, 128 4.29 / 1.42
SEGMENT_BV = 64
#: the backward's chaining takes each segment's map T_s from the forward (the reverse walk's is its transpose)
#: instead of walking the dk columns again, so ``_seg_bwd`` runs its dv columns only: the same runs, fwd + bwd
#: 3.75 -> 3.70 ms (the dv columns' five products a chunk are most of that pass). Where the forward left no maps (it
#: ran under graph capture, the backward did not) the backward walks them itself
SEGMENT_BWD_MAPS_FROM_FORWARD = True
#: the chaining pass's launch
COMBINE_BV = 32
COMBINE_WARPS = 8


class Segments:
    """A sequence table (the walks read ``N``, ``NT``, ``cu``, ``coff``, ``chunks``) whose sequences are segments of
    whole chunks of the original ones, with ``soff[n]:soff[n + 1]`` the segments of original sequence n. Chunk
    indices stay the original ones, so per-chunk tensors are laid out as before."""

    def __init__(self, seqs, chunk_counts: list[int], L: int, C: int):
        device = seqs.cu.device
        starts, coffs, soff, pos = [], [], [0], []
        coff = 0
        for n, nts in enumerate(chunk_counts):
            pieces = max(1, triton.cdiv(nts, L))
            for s in range(pieces):
                starts.append((n, s * L * C))
                coffs.append(coff + s * L)
                pos.append((s == 0) + 2 * (s == pieces - 1))
            coff += nts
            soff.append(soff[-1] + pieces)
        cu_host = seqs.cu.tolist()
        cu = [cu_host[n] + off for n, off in starts] + [cu_host[-1]]
        self.N, self.NT, self.chunks = len(starts), seqs.NT, seqs.chunks
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.coff = torch.tensor(coffs + [seqs.NT], dtype=torch.int32, device=device)
        self.soff = torch.tensor(soff, dtype=torch.int32, device=device)
        self.pos = torch.tensor(pos, dtype=torch.int32, device=device)  # 1: a sequence's first, 2: its last
        self.L = L


def _chunk_counts(seqs) -> list[int]:
    return (seqs.coff[1:] - seqs.coff[:-1]).tolist()


def plan(seqs, H: int, V: int, device, C: int, switch: bool | None = None):
    """The segments the walks of this batch run over, or None to walk whole sequences. Cached on ``seqs`` (the
    forward's table is the backward's)."""
    switch = SPLIT_LONG_SEQUENCES if switch is None else switch
    if switch is False or torch.compiler.is_compiling():
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = (H, V, switch, SPLIT_PROGRAMS_PER_SM, SPLIT_MIN_PIECES, SPLIT_MIN_CHUNKS)
    cache = seqs.__dict__.setdefault("_segments", {})
    if key in cache:
        return cache[key]
    counts = _chunk_counts(seqs)
    longest = max(counts, default=0)
    sms = num_sms(device) if device.type == "cuda" else 132  # the interpreter (only where asked): an H100's or H200's
    fair_share = sum(counts) * H * triton.cdiv(V, 64) / (SPLIT_PROGRAMS_PER_SM * sms)
    pieces = max(1, round(longest / fair_share)) if fair_share else 1
    L = max(SPLIT_MIN_CHUNKS, triton.cdiv(longest, pieces))
    segments = Segments(seqs, counts, L, C) if triton.cdiv(longest, L) >= SPLIT_MIN_PIECES else None
    cache[key] = segments
    return segments


# ============================================================================ kernels
@triton.jit
def _seg_columns(i_b, NVB: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, V: tl.constexpr,
                 K: tl.constexpr):
    """A segment program's block of the walked columns: dv columns first (a zero start), then dk columns of the
    identity. Returns (is an identity block, the start tile, its columns in the ``[dk, dv + dk]`` end tensor, their
    mask)."""
    o_k = tl.arange(0, BKF)
    ident = i_b >= NVB
    col = tl.where(ident, (i_b - NVB) * BV, i_b * BV) + tl.arange(0, BV)
    x = tl.where(ident & (o_k[:, None] == col[None, :]), 1.0, 0.0)
    end_col = tl.where(ident, V + col, col)
    m = (o_k < K)[:, None] & (col < tl.where(ident, K, V))[None, :]
    return ident, x, end_col, m


@triton.jit
def _needed(pos, ident, FREE_IDENT: tl.constexpr, FREE_LAST: tl.constexpr, REVERSE: tl.constexpr):
    """Whether a segment program's walk is used by the chaining: not the identity block of the segment the chain
    starts from where it starts from zero (FREE_IDENT), nor any block of the segment it ends with where the sequence's
    end is not asked for (FREE_LAST). ``pos``: 1 for a sequence's first segment, 2 for its last, 3 for both."""
    if REVERSE:
        start = (pos & 2) != 0
        end = (pos & 1) != 0
    else:
        start = (pos & 1) != 0
        end = (pos & 2) != 0
    keep = pos >= 0
    if FREE_IDENT:
        keep = keep & ~(start & ident)
    if FREE_LAST:
        keep = keep & ~end
    return keep


@triton.jit
def _segment_program(cu, segpos, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, FREE_IDENT: tl.constexpr,
                     FREE_LAST: tl.constexpr, REVERSE: tl.constexpr):
    """A segment program on grid (segments, heads, column blocks): (segment, head, block, its key head, the segment
    [bos, eos), the chunks it walks (0 where the chaining does not read its result), ``_seg_columns``' four)."""
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    NVB: tl.constexpr = (V + BV - 1) // BV
    bos = tl.load(cu + i_s).to(tl.int64)
    eos = tl.load(cu + i_s + 1).to(tl.int64)
    ident, x, end_col, m_end = _seg_columns(i_b, NVB, BKF, BV, V, K)
    keep = _needed(tl.load(segpos + i_s), ident, FREE_IDENT, FREE_LAST, REVERSE)
    walked = tl.where(keep, tl.cdiv(eos - bos, C), 0)
    return i_s, i_h, i_b, i_h // (H // HK), bos, eos, walked, ident, x, end_col, m_end


@triton.jit
def _store_segment_end(ends, i_s, i_h, x, end_col, m_end, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BKF: tl.constexpr):
    o_k = tl.arange(0, BKF)
    tl.store(ends + (i_s * H + i_h).to(tl.int64) * K * (V + K) + o_k[:, None] * (V + K) + end_col[None, :], x,
             mask=m_end)


@triton.jit
def _seg_fwd_kernel(
    bk, beta, Gc, cm, r, ends, cu, segpos,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_W: tl.constexpr, PREFILL: tl.constexpr,
    FREE_IDENT: tl.constexpr, FREE_LAST: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """One segment's walk from zero (dv columns) and from the identity (dk columns): X' = γ X + Bkᵀ (R − Cm X),
    only the end stored (``ends[s, h]`` ``[dk, dv + dk]`` fp32). Training form: Bk = β e^(G_last − G) K (``bk`` the
    keys, or the given write keys), Cm = W~, R = U~; PREFILL: Bk = Y, Cm = e^G K (``cm`` the keys), R = V."""
    i_s, i_h, i_b, i_hk, bos, eos, walked, ident, b_x, end_col, m_end = _segment_program(
        cu, segpos, H, HK, K, V, C, BKF, BV, FREE_IDENT, FREE_LAST, False)
    r_col = tl.where(ident, V, i_b * BV)  # identity blocks read no R: their columns are masked out
    for j in range(0, walked):
        t0 = bos + j * C
        b_r = load_tile(r + i_h * V, t0, tl.where(ident, t0, eos), H * V, r_col, V, C, BV)
        if PREFILL:
            b_cm = load_raw(cm + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
            b_bk = load_raw(bk + i_h * K, t0, eos, H * K, 0, K, C, BKF)
            b_cx = dot(b_cm, b_x, DT, PREC)
            if HAS_G:
                b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
                b_cx = b_cx * tl.exp(b_G)[:, None]
                b_x = b_x * tl.exp(g_last)
            b_u = b_r - b_cx
        else:
            b_cm = load_raw(cm + i_h * K, t0, eos, H * K, 0, K, C, BKF)
            b_bk = load_raw(bk + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
            b_f = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
            b_u = b_r - dot(b_cm, b_x, DT, PREC)
            if HAS_G:
                b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
                b_f = b_f * tl.exp(g_last - b_G)
                b_x = b_x * tl.exp(g_last)
            b_u = b_u * b_f[:, None]
        b_x = dot_acc(tl.trans(b_bk), b_u, b_x, DT, PREC)
    _store_segment_end(ends, i_s, i_h, b_x, end_col, m_end, H, K, V, BKF)


@triton.jit
def _seg_bwd_kernel(
    q, kw, beta, Gc, wt, do, ends, cu, segpos, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_W: tl.constexpr,
    FREE_IDENT: tl.constexpr, FREE_LAST: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """The reverse walk over one segment from a zero end gradient (dv columns, with dO's terms) and from the
    identity (dk columns, without): dU = [Pᵀ dO] + diag(D) K dX, dX ← γ dX + [scale Qᵀ diag(e^G) dO] − W~ᵀ dU, as
    ``delta._bwd_dhu``; the segment's start stored (``ends[s, h]`` ``[dk, dv + dk]`` fp32)."""
    scale = tl.cast(scale, tl.float32)
    i_s, i_h, i_b, i_hk, bos, eos, NTn, ident, b_ds, end_col, m_end = _segment_program(
        cu, segpos, H, HK, K, V, C, BKF, BV, FREE_IDENT, FREE_LAST, True)
    NVB: tl.constexpr = (V + BV - 1) // BV
    o_c = tl.arange(0, C)
    triu = o_c[:, None] <= o_c[None, :]
    for jj in range(0, NTn):  # NTn: the chunks walked (0 where the chaining does not read the result)
        t0 = bos + (NTn - 1 - jj) * C
        b_b = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
        b_f = b_b
        if HAS_G:
            b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
            b_f = b_f * tl.exp(g_last - b_G)
        b_k = load_raw(kw + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
        b_du = dot(b_k, b_ds, DT, PREC) * b_f[:, None]
        if HAS_G:
            b_ds = b_ds * tl.exp(g_last)
        if i_b < NVB:  # dO's terms: P^T dO in dU, scale Q^T diag(e^G) dO in dS
            b_q = load_raw(q + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
            b_do = load_raw(do + i_h * V, t0, eos, H * V, i_b * BV, V, C, BV)
            b_pt = dot(b_k, tl.trans(b_q), DT, PREC)
            b_fq = tl.full([C], 1.0, tl.float32) * scale
            if HAS_G:
                b_pt = tl.where(triu, b_pt * tl.exp(tl.where(triu, b_G[None, :] - b_G[:, None], 0.0)), 0.0)
                b_fq = b_fq * tl.exp(b_G)
            else:
                b_pt = tl.where(triu, b_pt, 0.0)
            b_du += dot(b_pt * (b_b * scale)[:, None], b_do, DT, PREC)
            b_ds = dot_acc(tl.trans(b_q), b_do.to(tl.float32) * b_fq[:, None], b_ds, DT, PREC)
        b_wt = load_raw(wt + i_h * K, t0, eos, H * K, 0, K, C, BKF)
        b_ds = dot_acc(tl.trans(b_wt), -b_du, b_ds, DT, PREC)
    _store_segment_end(ends, i_s, i_h, b_ds, end_col, m_end, H, K, V, BKF)


@triton.jit
def _seg_chain_kernel(
    ends, maps, x0, starts, xT, soff,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    USE_X0: tl.constexpr, STORE_XT: tl.constexpr, REVERSE: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """Chains one sequence's segments: X ← T_s X + E_s from its first segment to its last (the reverse walk's from
    the last to the first), storing each segment's start in ``starts`` and the sequence's end in ``xT`` (states
    ``[., H, dv, dk]`` fp32, as the walks' initial and final states). E_s is ``ends``' dv columns, T_s ``maps``' dk
    columns (``[NS, H, dk, dv + dk]`` both), transposed where TRANSPOSE (the forward's maps for the reverse walk)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    s_lo = tl.load(soff + i_n)
    s_hi = tl.load(soff + i_n + 1)
    o_k = tl.arange(0, BKF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_x = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_x = o_v[None, :] * K + o_k[:, None]
    b_x = tl.zeros([BKF, BV], dtype=tl.float32)
    if USE_X0:
        b_x += tl.load(x0 + (i_n * H + i_h).to(tl.int64) * V * K + p_x, mask=m_x, other=0)
    m_t = (o_k < K)[:, None] & (o_k < K)[None, :]
    for ii in range(0, s_hi - s_lo):
        s = (s_hi - 1 - ii) if REVERSE else (s_lo + ii)
        tl.store(starts + (s * H + i_h).to(tl.int64) * V * K + p_x, b_x, mask=m_x)
        off = (s * H + i_h).to(tl.int64) * K * (V + K)
        if TRANSPOSE:
            b_t = tl.load(maps + off + o_k[None, :] * (V + K) + V + o_k[:, None], mask=m_t, other=0)
        else:
            b_t = tl.load(maps + off + o_k[:, None] * (V + K) + V + o_k[None, :], mask=m_t, other=0)
        b_e = tl.load(ends + off + o_k[:, None] * (V + K) + o_v[None, :], mask=m_x, other=0)
        b_x = tl.dot(b_t, b_x, b_e, input_precision="tf32x3")
    if STORE_XT:
        tl.store(xT + (i_n * H + i_h).to(tl.int64) * V * K + p_x, b_x, mask=m_x)


# ============================================================================ host side
def _pass_bv(V: int, interpret: bool) -> int:
    return next_pow2(V) if interpret else min(SEGMENT_BV, next_pow2(V))


def _chain(ends, x0, seqs, segs: Segments, H: int, K: int, V: int, store_end: bool, reverse: bool, interpret: bool,
           maps=None):
    """(each segment's start state ``[NS, H, V, K]``, the sequences' end ``[N, H, V, K]`` or None); the maps T_s
    from ``ends``, or transposed from the forward's ``maps``."""
    f32 = torch.float32
    starts = torch.empty(segs.N, H, V, K, device=ends.device, dtype=f32)
    xT = torch.empty(seqs.N, H, V, K, device=ends.device, dtype=f32) if store_end else starts
    BV = next_pow2(V) if interpret else min(COMBINE_BV, next_pow2(V))
    _seg_chain_kernel[(seqs.N, H, triton.cdiv(V, BV))](
        ends, maps if maps is not None else ends, x0 if x0 is not None else starts, starts, xT, segs.soff, H=H, K=K,
        V=V, BKF=next_pow2(K), BV=BV, USE_X0=x0 is not None, STORE_XT=store_end, REVERSE=reverse,
        TRANSPOSE=maps is not None, **({} if interpret else {"num_warps": COMBINE_WARPS}))
    return starts, (xT if store_end else None)


def segment_starts(seqs, segs: Segments, S0, store_end: bool, *, bk, beta, Gc, cm, r, prefill: bool, HK: int,
                   C: int, DT, PREC, has_w: bool = False):
    """The forward's start state of every segment ``[NS, H, V, K]``, the sequences' final states (or None) and the
    segments' maps (``[NS, H, dk, dv + dk]``: E_s, T_s): ``bk``, ``cm``, ``r`` as ``_seg_fwd_kernel`` takes them in
    the training form (k, W~, U~) or the prefill's (Y, k, V)."""
    H, V = r.shape[1:]
    K = cm.shape[-1]
    interp = r.device.type == "cpu"
    BV = _pass_bv(V, interp)
    ends = torch.empty(segs.N, H, K, V + K, device=r.device, dtype=torch.float32)
    _seg_fwd_kernel[(segs.N, H, triton.cdiv(V, BV) + triton.cdiv(K, BV))](
        bk, beta, Gc if Gc is not None else beta, cm, r, ends, segs.cu, segs.pos, H=H, HK=HK, K=K, V=V, C=C,
        BKF=next_pow2(K), BV=BV, HAS_G=Gc is not None, HAS_W=has_w, PREFILL=prefill, FREE_IDENT=S0 is None,
        FREE_LAST=not store_end, DT=DT, PREC=PREC, **({} if interp else {"num_warps": 4, "num_stages": 2}))
    return (*_chain(ends, S0, seqs, segs, H, K, V, store_end, False, interp), ends)


def segment_end_grads(seqs, segs: Segments, dsT, need_ds0: bool, *, q, kw, beta, Gc, wt, do, scale: float, C: int,
                      DT, PREC, has_w: bool = False, forward_maps=None):
    """The backward's state gradient at every segment's end ``[NS, H, V, K]`` and the initial states' (or None).
    With ``forward_maps`` (``segment_starts``' third result) the reverse maps are their transposes and only the dv
    columns are walked."""
    H, V = do.shape[1:]
    HK, K = q.shape[1:]
    interp = do.device.type == "cpu"
    BV = _pass_bv(V, interp)
    ends = torch.empty(segs.N, H, K, V + K, device=do.device, dtype=torch.float32)
    blocks = triton.cdiv(V, BV) + (0 if forward_maps is not None else triton.cdiv(K, BV))
    _seg_bwd_kernel[(segs.N, H, blocks)](
        q, kw, beta, Gc if Gc is not None else beta, wt, do, ends, segs.cu, segs.pos, scale, H=H, HK=HK, K=K,
        V=V, C=C, BKF=next_pow2(K), BV=BV, HAS_G=Gc is not None, HAS_W=has_w, FREE_IDENT=dsT is None,
        FREE_LAST=not need_ds0, DT=DT, PREC=PREC, **({} if interp else {"num_warps": 8, "num_stages": 2}))
    return _chain(ends, dsT, seqs, segs, H, K, V, need_ds0, True, interp, forward_maps)


