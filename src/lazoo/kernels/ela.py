"""Triton kernels for the normaliser and the scalar features of ELA's polynomial kernels (``lazoo.ops.ela``).

A polynomial kernel's features split as φ(q) = [q', a], ψ(k) = [k', c]: D scaled inputs and E = 1 or 2 scalars a
token, formed here from q and k (``MAG`` selects the kernel):

    sum_sq_euclid / sub_sq_euclid (SIGN = ±2):  q' = q,            k' = SIGN k,        a = [‖q‖², 1],  c = [1, ‖k‖²]
    magnitude_direction:                        q' = (‖q‖²+1) q,   k' = (‖k‖²+1) k,    a = [‖q‖²+1],   c = [‖k‖²+1]

The linear-attention kernel computes the D-feature numerator ``om_i = Σ_{j≤i} (q'_i·k'_j) v_j``; these kernels add
the rest, per sample and head, in one pass over time:

    num_i = om_i + Σ_e a_ie W_ie,     W_ie = W0_e + Σ_{j≤i} c_je v_j
    den_i = q'_i·Kc_i + Σ_e a_ie Cc_ie,  Kc_i = Kc0 + Σ_{j≤i} k'_j,  Cc_ie = Cc0_e + Σ_{j≤i} c_je
    o_i   = num_i / max(den_i, eps)

Carries (fp32): Kc ``[D]``, Cc ``[E]``, W ``[E, dv]``; they are the state's ``C`` and the scalar columns of ``S``.
The backward walks time twice: forward (recomputing the carries) for ∂om and ∂q (through q' and a), then in reverse
for the suffix sums that give ∂k (through k' and c) and ∂v, ending at the initial carries' gradients.

Layout: q, k ``[B, T, H, D]`` (zero at pads), v, om ``[B, T, H, dv]``, mask ``[B, T]`` (a pad adds nothing: c is
zeroed there). Every loaded value is cast to fp32. A program holds one sample·head's whole value row (∂den needs do·o
over all of dv) and one segment of time: a first kernel sums each segment, the carries at every segment's start are a
short prefix sum over segments, and the segments then run in parallel (the backward likewise, with suffix sums for the
reverse walk). Long sequences with few samples would otherwise run on B·H programs. Packed sequences (``cu_seqlens``,
B = 1) are cut into segments that never cross a boundary, and the carries flow only within a sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import device_unsupported, next_pow2, num_sms

#: the largest head and value dims (a program holds one token block's rows of both)
MAX_DIM = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNELS = {"sum_sq_euclid": (False, 2.0), "sub_sq_euclid": (False, -2.0), "magnitude_direction": (True, 1.0)}


@triton.jit
def _rows(ptr, tok, width, offs, ok):
    """``[BT, W]`` fp32 rows ``tok`` (token-head indices, int64) of a ``[.., width]`` tensor, zeros outside ``ok``."""
    return tl.load(ptr + tok[:, None] * width + offs[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _suffix(x):
    """Σ_{s ≥ t} x_s within the block (axis 0)."""
    return tl.sum(x, 0)[None] - tl.cumsum(x, 0) + x


@triton.jit
def _program(T, L, H, NS, SEGS, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
             VARLEN: tl.constexpr):
    """This program's sample·head (int64), its slot among the segment buffers, the segment's tokens [lo, hi), the
    sample and head, and the head-dim and value-dim offsets with their masks. Segments are [s·L, s·L + L) ∩ [0, T),
    or with ``VARLEN`` the rows of ``SEGS`` ``[NS, 2]`` (packed sequences: no segment crosses a boundary)."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    if VARLEN:
        lo = tl.load(SEGS + 2 * s)
        hi = tl.load(SEGS + 2 * s + 1)
    else:
        lo = s * L
        hi = tl.minimum(lo + L, T)
    od, ov = tl.arange(0, BD), tl.arange(0, BV)
    return bh, bh * NS + s, lo, hi, bh // H, bh % H, od, ov, od < D, ov < DV


@triton.jit
def _block(Q, K, M, i_b, i_h, ot, mt, T, H, sign, D: tl.constexpr, MAG: tl.constexpr, HAS_MASK: tl.constexpr,
           od, md):
    """One block of tokens: the token-head indices, q, k ``[BT, BD]``, their squared norms, the features q', k', the
    scalar features as pairs of ``[BT]`` vectors (a0, a1), (c0, c1) (c zero at pads and past the segment; the second
    pair zero for magnitude_direction) and the real-token flags. Pairs, not ``[BT, 2]`` tiles: Triton 3.6 failed
    to lower a scan over such a tile on sm_90."""
    tok = (i_b * T + ot) * H + i_h
    q = _rows(Q, tok, D, od, mt[:, None] & md[None, :])
    k = _rows(K, tok, D, od, mt[:, None] & md[None, :])
    if HAS_MASK:
        real = tl.load(M + i_b * T + ot, mask=mt, other=0).to(tl.float32)
    else:
        real = mt.to(tl.float32)
    qq = tl.sum(q * q, 1)
    kk = tl.sum(k * k, 1)
    if MAG:
        q1 = q * (qq + 1)[:, None]
        k1 = k * (kk + 1)[:, None]
        a0, a1 = qq + 1, qq * 0.0
        c0, c1 = (kk + 1) * real, kk * 0.0
    else:
        q1 = q
        k1 = k * sign
        a0, a1 = qq, qq * 0.0 + 1.0
        c0, c1 = real, kk * real
    return tok, q, k, qq, kk, q1, k1, a0, a1, c0, c1, real


@triton.jit
def _load_carries(KS, CS, WS, i_c, D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, od, ov, md, mv):
    """Carries ``[BD]``, two scalars and two ``[BV]`` rows at slot ``i_c`` of ``[.., D]``, ``[.., E]``,
    ``[.., E, DV]`` buffers (the second ones zero where E = 1)."""
    kc = tl.load(KS + i_c * D + od, mask=md, other=0.0)
    cc0 = tl.load(CS + i_c * E)
    w0 = tl.load(WS + i_c * E * DV + ov, mask=mv, other=0.0)
    if E == 2:
        cc1 = tl.load(CS + i_c * E + 1)
        w1 = tl.load(WS + i_c * E * DV + DV + ov, mask=mv, other=0.0)
    else:
        cc1 = cc0 * 0.0
        w1 = w0 * 0.0
    return kc, cc0, cc1, w0, w1


@triton.jit
def _zero_carries(BD: tl.constexpr, BV: tl.constexpr):
    """Carries (or their gradients' sums) at zero: ``[BD]``, two fp32 scalars, two ``[BV]`` rows."""
    w0 = tl.zeros([BV], dtype=tl.float32)
    zero = tl.sum(w0, 0)
    return tl.zeros([BD], dtype=tl.float32), zero, zero, w0, tl.zeros([BV], dtype=tl.float32)


@triton.jit
def _store_carries(KS, CS, WS, i_c, kc, cc0, cc1, w0, w1, D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, od,
                   ov, md, mv):
    tl.store(KS + i_c * D + od, kc, mask=md)
    tl.store(CS + i_c * E, cc0)
    tl.store(WS + i_c * E * DV + ov, w0, mask=mv)
    if E == 2:
        tl.store(CS + i_c * E + 1, cc1)
        tl.store(WS + i_c * E * DV + DV + ov, w1, mask=mv)


@triton.jit
def _totals_kernel(Q, K, M, Vv, KT, CT, WT, T, H, L, NS, SEGS, sign,
                   D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                   BT: tl.constexpr, MAG: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr):
    """Each segment's sums of k', c and c vᵀ (the forward's carries over it)."""
    sign = tl.cast(sign, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    bh, slot, lo, hi, i_b, i_h, od, ov, md, mv = _program(T, L, H, NS, SEGS, D, DV, BD, BV, VARLEN)
    kc, cc0, cc1, w0, w1 = _zero_carries(BD, BV)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok, q, k, qq, kk, q1, k1, a0, a1, c0, c1, real = _block(Q, K, M, i_b, i_h, ot, mt, T, H, sign, D, MAG,
                                                                 HAS_MASK, od, md)
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        kc += tl.sum(k1, 0)
        cc0 += tl.sum(c0, 0)
        cc1 += tl.sum(c1, 0)
        w0 += tl.sum(c0[:, None] * v, 0)
        w1 += tl.sum(c1[:, None] * v, 0)
    _store_carries(KT, CT, WT, slot, kc, cc0, cc1, w0, w1, D, DV, E, od, ov, md, mv)


@triton.jit
def _fwd_kernel(Q, K, M, Vv, OM, O, DEN, KS, CS, WS, T, H, L, NS, SEGS, sign, eps,
                D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr, MAG: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr):
    """One segment, from the carries at its start (``KS``, ``CS``, ``WS`` ``[B, H, NS, ..]``)."""
    sign = tl.cast(sign, tl.float32)
    eps = tl.cast(eps, tl.float32)
    bh, slot, lo, hi, i_b, i_h, od, ov, md, mv = _program(T, L, H, NS, SEGS, D, DV, BD, BV, VARLEN)
    kc, cc0, cc1, w0, w1 = _load_carries(KS, CS, WS, slot, D, DV, E, od, ov, md, mv)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok, q, k, qq, kk, q1, k1, a0, a1, c0, c1, real = _block(Q, K, M, i_b, i_h, ot, mt, T, H, sign, D, MAG,
                                                                 HAS_MASK, od, md)
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        om = _rows(OM, tok, DV, ov, mt[:, None] & mv[None, :])
        cv0 = c0[:, None] * v
        num = om + a0[:, None] * (tl.cumsum(cv0, 0) + w0[None, :])
        den = tl.sum(q1 * (tl.cumsum(k1, 0) + kc[None, :]), 1) + a0 * (tl.cumsum(c0, 0) + cc0)
        if E == 2:
            cv1 = c1[:, None] * v
            num += a1[:, None] * (tl.cumsum(cv1, 0) + w1[None, :])
            den += a1 * (tl.cumsum(c1, 0) + cc1)
            w1 += tl.sum(cv1, 0)
            cc1 += tl.sum(c1, 0)
        o = num / tl.maximum(den, eps)[:, None]
        tl.store(O + tok[:, None] * DV + ov[None, :], o, mask=mt[:, None] & mv[None, :])
        tl.store(DEN + tok, den, mask=mt)
        kc += tl.sum(k1, 0)
        cc0 += tl.sum(c0, 0)
        w0 += tl.sum(cv0, 0)


@triton.jit
def _bwd_forward_kernel(Q, K, M, Vv, O, DEN, DO, KS, CS, WS, DQ, DOM, DDEN, XT, ZT, YT, T, H, L, NS, SEGS, sign,
                        eps, D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr,
                        BV: tl.constexpr, BT: tl.constexpr, MAG: tl.constexpr, HAS_MASK: tl.constexpr,
                        VARLEN: tl.constexpr):
    """The backward's forward walk over one segment: the carries again, then ∂om = ∂num, ∂den and ∂q (through q' and
    a); and the segment's sums of ∂den q', ∂den a and a ∂numᵀ (what the reverse walk carries into earlier
    segments)."""
    sign = tl.cast(sign, tl.float32)
    eps = tl.cast(eps, tl.float32)
    bh, slot, lo, hi, i_b, i_h, od, ov, md, mv = _program(T, L, H, NS, SEGS, D, DV, BD, BV, VARLEN)
    kc, cc0, _, w0, _ = _load_carries(KS, CS, WS, slot, D, DV, E, od, ov, md, mv)
    xs, zs0, zs1, ys0, ys1 = _zero_carries(BD, BV)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok, q, k, qq, kk, q1, k1, a0, a1, c0, c1, real = _block(Q, K, M, i_b, i_h, ot, mt, T, H, sign, D, MAG,
                                                                 HAS_MASK, od, md)
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        o = _rows(O, tok, DV, ov, mt[:, None] & mv[None, :])
        do = _rows(DO, tok, DV, ov, mt[:, None] & mv[None, :])
        den = tl.load(DEN + tok, mask=mt, other=1.0)
        dcl = tl.maximum(den, eps)
        dnum = do / dcl[:, None]
        dden = tl.where(den >= eps, -tl.sum(do * o, 1) / dcl, 0.0)  # max(den, eps) passes no gradient below eps
        cv0 = c0[:, None] * v
        # ∂a0: a0 holds ‖q‖² (+1); a1 is a constant
        da0 = tl.sum(dnum * (tl.cumsum(cv0, 0) + w0[None, :]), 1) + dden * (tl.cumsum(c0, 0) + cc0)
        dq1 = dden[:, None] * (tl.cumsum(k1, 0) + kc[None, :])
        if MAG:  # q' = (‖q‖²+1) q, a0 = ‖q‖²+1
            dq = (qq + 1)[:, None] * dq1 + 2.0 * q * (tl.sum(q * dq1, 1) + da0)[:, None]
        else:  # q' = q, a0 = ‖q‖²
            dq = dq1 + 2.0 * q * da0[:, None]
        tl.store(DOM + tok[:, None] * DV + ov[None, :], dnum, mask=mt[:, None] & mv[None, :])
        tl.store(DQ + tok[:, None] * D + od[None, :], dq, mask=mt[:, None] & md[None, :])
        tl.store(DDEN + tok, dden, mask=mt)
        kc += tl.sum(k1, 0)
        cc0 += tl.sum(c0, 0)
        w0 += tl.sum(cv0, 0)
        xs += tl.sum(dden[:, None] * q1, 0)
        zs0 += tl.sum(dden * a0, 0)
        ys0 += tl.sum(a0[:, None] * dnum, 0)
        if E == 2:  # a1 is a constant: its carries (Cc1, W1) feed no gradient here, only the reverse walk's sums
            zs1 += tl.sum(dden * a1, 0)
            ys1 += tl.sum(a1[:, None] * dnum, 0)
    _store_carries(XT, ZT, YT, slot, xs, zs0, zs1, ys0, ys1, D, DV, E, od, ov, md, mv)


@triton.jit
def _bwd_reverse_kernel(Q, K, M, Vv, DEN, DO, DDEN, RS, RCS, RWS, DK, DVV, T, H, L, NS, SEGS, sign, eps,
                        D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                        BT: tl.constexpr, MAG: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr):
    """The reverse walk over one segment, from the suffix sums after it (``RS``, ``RCS``, ``RWS``): ∂v, and ∂k
    through k' and c."""
    sign = tl.cast(sign, tl.float32)
    eps = tl.cast(eps, tl.float32)
    bh, slot, lo, hi, i_b, i_h, od, ov, md, mv = _program(T, L, H, NS, SEGS, D, DV, BD, BV, VARLEN)
    rk, rc0, rc1, rw0, rw1 = _load_carries(RS, RCS, RWS, slot, D, DV, E, od, ov, md, mv)
    nb = tl.cdiv(hi - lo, BT)
    for i in range(0, nb):
        ot = lo + (nb - 1 - i) * BT + tl.arange(0, BT)
        mt = ot < hi
        tok, q, k, qq, kk, q1, k1, a0, a1, c0, c1, real = _block(Q, K, M, i_b, i_h, ot, mt, T, H, sign, D, MAG,
                                                                 HAS_MASK, od, md)
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        do = _rows(DO, tok, DV, ov, mt[:, None] & mv[None, :])
        den = tl.load(DEN + tok, mask=mt, other=1.0)
        dden = tl.load(DDEN + tok, mask=mt, other=0.0)
        dnum = do / tl.maximum(den, eps)[:, None]
        x = dden[:, None] * q1  # ∂Kc_t
        dk1 = _suffix(x) + rk[None, :]
        rk += tl.sum(x, 0)
        y0 = a0[:, None] * dnum  # ∂W0_t
        r0 = _suffix(y0) + rw0[None, :]
        rw0 += tl.sum(y0, 0)
        z0 = dden * a0  # ∂Cc0_t
        if MAG:  # k' = (‖k‖²+1) k, c0 = ‖k‖²+1
            dc0 = (tl.sum(v * r0, 1) + _suffix(z0) + rc0) * real
            dk = (kk + 1)[:, None] * dk1 + 2.0 * k * (tl.sum(k * dk1, 1) + dc0)[:, None]
        else:  # k' = ±2k, c = [1, ‖k‖²]
            y1 = a1[:, None] * dnum
            r1 = _suffix(y1) + rw1[None, :]
            rw1 += tl.sum(y1, 0)
            z1 = dden * a1
            dc1 = (tl.sum(v * r1, 1) + _suffix(z1) + rc1) * real
            rc1 += tl.sum(z1, 0)
            dk = sign * dk1 + 2.0 * k * dc1[:, None]
        rc0 += tl.sum(z0, 0)
        dv = c0[:, None] * r0
        if not MAG:
            dv += c1[:, None] * r1
        tl.store(DK + tok[:, None] * D + od[None, :], dk, mask=mt[:, None] & md[None, :])
        tl.store(DVV + tok[:, None] * DV + ov[None, :], dv, mask=mt[:, None] & mv[None, :])


def _launch_meta(D, V):
    """One warp, 8 tokens a block up to dims of 128 (4 above). The sums and scans over a block's tokens cross
    threads; with more warps they go through shared memory, which bound the kernels (Nsight Compute on an H200:
    memory pipes 60-90 % busy, DRAM 17-20 %, at 4 warps). sum_sq_euclid fwd + bwd at T = 1k / 8k / 32k on an
    H200 (``scripts/tune_ela.py``, 16 programs an SM): 3.70 / 3.67 / 4.34 ms at 1 warp × 8 tokens, 3.94 / 3.89 /
    4.56 at 1 × 16, 4.69 / 4.79 / 5.48 at 2 × 8; 4.97 / 5.04 / 5.67 at 4 × 32 (8 programs an SM)."""
    BD, BV = next_pow2(D), next_pow2(V)
    BT = 4 if max(BD, BV) > 128 else 8
    return dict(BD=BD, BV=BV, BT=BT, num_warps=1)


#: programs per SM the segments aim at (each walks its tokens one block at a time, so few programs leave the
#: memory system idle). sum_sq_euclid fwd + bwd at T = 1k / 8k / 32k on an H200, 1 warp × 8 tokens: 3.82 / 4.13 /
#: 4.29 ms at 8, 3.70 / 3.67 / 4.34 at 16, 3.65 / 3.74 / 4.53 at 32
PROGRAMS_PER_SM = 16


def _segment_length(T, BH, BT, device, segment):
    """Tokens per segment: enough segments for ``PROGRAMS_PER_SM`` programs per SM (one segment where B·H already
    fills them), a multiple of BT; ``segment`` (a multiple of BT) overrides it (tests)."""
    if segment is not None:
        return segment
    n = max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms(device), BH), triton.cdiv(T, BT)))
    return triton.cdiv(triton.cdiv(max(T, 1), n), BT) * BT


class _PackedSegments:
    """Packed sequences (``cu_seqlens``, B = 1, N sequences along time): each sequence cut into segments of L tokens
    (``table`` ``[NS, 2]`` int32, their [lo, hi)); the carries flow only between segments of one sequence, and the
    initial and final carries are one per sequence ``[N, H, ...]``. Buffers of per-segment sums are
    ``[1, H, NS, ...]``."""

    def __init__(self, T, H, BT, device, segment, cu_seqlens):
        bounds = cu_seqlens.tolist()
        self.N = len(bounds) - 1
        self.L = _segment_length(T, H, BT, device, segment)
        rows, seq, first, last = [], [], [], []  # per segment: [lo, hi), its sequence, that sequence's ends
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            starts = range(lo, hi, self.L)
            rows += [(start, min(start + self.L, hi)) for start in starts]
            seq += [n] * len(starts)
            first += [len(rows) - len(starts)] * len(starts)
            last += [len(rows) - 1] * len(starts)
        self.NS = len(rows)
        self.table = torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=device)
        self.seq, self.first, self.last = (torch.tensor(x, dtype=torch.int64, device=device)
                                           for x in (seq, first, last))

    def _per_segment(self, y):
        """Per-sequence values ``[N, H, ...]`` at each segment ``[1, H, NS, ...]``."""
        return y[self.seq].transpose(0, 1).unsqueeze(0)

    def starts(self, totals, init):
        before = totals.cumsum(2) - totals
        return self._per_segment(init) + before - before.index_select(2, self.first)

    def final(self, init, totals):
        parts = totals[0].transpose(0, 1)
        return init + parts.new_zeros((self.N,) + parts.shape[1:]).index_add_(0, self.seq, parts)

    def suffix(self, totals, after):
        inclusive = totals.cumsum(2)
        return self._per_segment(after) + inclusive.index_select(2, self.last) - inclusive


def _carries_at_starts(packed, totals, init):
    """The carries at every segment's start: the initial ones plus the segments before it (of its sample, or of its
    sequence where ``packed``)."""
    return init.unsqueeze(2) + totals.cumsum(2) - totals if packed is None else packed.starts(totals, init)


def _final_carries(packed, init, totals):
    """The carries after the last token (per sample, or per sequence)."""
    return init + totals.sum(2) if packed is None else packed.final(init, totals)


def _carries_after(packed, totals, after):
    """The reverse walk's carries after every segment: ``after`` (the final carries' gradients) plus the later
    segments of the same sample or sequence."""
    if packed is None:
        return after.unsqueeze(2) + totals.sum(2, keepdim=True) - totals.cumsum(2)
    return packed.suffix(totals, after)


class ElaPrefixFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, om, mask, kc0, cc0, w0, kernel, eps, output_final_state, segment, cu_seqlens):
        B, T, H, D = q.shape
        V = v.shape[-1]
        mag, sign = KERNELS[kernel]
        E = 1 if mag else 2
        meta = dict(_launch_meta(D, V), MAG=mag, HAS_MASK=mask is not None, VARLEN=cu_seqlens is not None)
        if cu_seqlens is None:
            packed, N = None, B
            L = _segment_length(T, B * H, meta["BT"], v.device, segment)
            NS, table = triton.cdiv(T, L), q  # q: an unused pointer without VARLEN
        else:
            packed = _PackedSegments(T, H, meta["BT"], v.device, segment, cu_seqlens)
            L, NS, N, table = packed.L, packed.NS, packed.N, packed.table
        f32 = dict(dtype=torch.float32, device=v.device)
        shapes = ((H, D), (H, E), (H, E, V))
        init = [torch.zeros((N,) + sh, **f32) for sh in shapes] if kc0 is None else [kc0, cc0, w0]
        totals = [torch.empty((B, H, NS) + sh[1:], **f32) for sh in shapes]
        m = mask if mask is not None else q  # an unused pointer without a mask
        new = torch.empty if NS else torch.zeros  # the segments cover every token; no token, no segment
        o = new(v.shape, dtype=v.dtype, device=v.device)
        den = new(B, T, H, **f32)
        starts = totals
        if NS:
            _totals_kernel[(B * H, NS)](q, k, m, v, *totals, T, H, L, NS, table, sign, D=D, DV=V, E=E, **meta)
            starts = [_carries_at_starts(packed, t, x).contiguous() for t, x in zip(totals, init)]
            _fwd_kernel[(B * H, NS)](q, k, m, v, om, o, den, *starts, T, H, L, NS, table, sign, float(eps), D=D,
                                     DV=V, E=E, **meta)
        ctx.save_for_backward(q, k, m, v, o, den, *starts)
        ctx.meta, ctx.sign, ctx.eps, ctx.has_init = meta, sign, eps, kc0 is not None
        ctx.L, ctx.NS, ctx.N, ctx.packed = L, NS, N, packed
        ctx.mark_non_differentiable(den)
        if not output_final_state:
            return o, den
        return (o, den, *(_final_carries(packed, x, t) for x, t in zip(init, totals)))

    @staticmethod
    def backward(ctx, do, _dden, *dfinal):
        q, k, m, v, o, den, *starts = ctx.saved_tensors
        B, T, H, D = q.shape
        V = v.shape[-1]
        E = starts[1].shape[-1]
        meta, packed, L, NS = ctx.meta, ctx.packed, ctx.L, ctx.NS
        table = q if packed is None else packed.table
        f32 = dict(dtype=torch.float32, device=v.device)
        shapes = ((ctx.N, H, D), (ctx.N, H, E), (ctx.N, H, E, V))
        new = torch.empty_like if NS else torch.zeros_like  # the segments cover every token
        dq, dk, dvv, dom = (new(x) for x in (q, k, v, v))
        dden = new(den)
        totals = [torch.empty((B, H, NS) + sh[2:], **f32) for sh in shapes]
        # the reverse walk of a segment starts from the final carries' gradients plus every later segment's sums
        after = [torch.zeros(sh, **f32) if g is None else g.float() for g, sh in zip(list(dfinal) or [None] * 3,
                                                                                  shapes)]
        if NS:
            do = do.contiguous()
            args = (T, H, L, NS, table, ctx.sign, float(ctx.eps))
            _bwd_forward_kernel[(B * H, NS)](q, k, m, v, o, den, do, *starts, dq, dom, dden, *totals, *args, D=D,
                                             DV=V, E=E, **meta)
            suffix = [_carries_after(packed, t, x).contiguous() for t, x in zip(totals, after)]
            _bwd_reverse_kernel[(B * H, NS)](q, k, m, v, den, do, dden, *suffix, dk, dvv, *args, D=D, DV=V, E=E,
                                             **meta)
        dinit = [_final_carries(packed, x, t) for x, t in zip(after, totals)] if ctx.has_init else [None, None, None]
        return dq, dk, dvv, dom, None, *dinit, None, None, None, None, None


def ela_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, om: torch.Tensor, *, kernel: str, eps: float,
               mask: torch.Tensor | None = None, initial_state=None, output_final_state: bool = False,
               segment: int | None = None, cu_seqlens: torch.Tensor | None = None):
    """``(o [B, T, H, dv] in v's dtype, den [B, T, H] fp32, final carries (Kc, Cc, W) fp32 or None)`` (module
    docstring) for ``kernel`` (``KERNELS``). q, k zero at pads; ``mask`` ``[B, T]`` (True = a real token) or None.
    ``initial_state``: the carries ``(Kc0 [B, H, D], Cc0 [B, H, E], W0 [B, H, E, dv])``, fp32, or None (zeros).
    ``cu_seqlens`` ``[N + 1]`` (int, 0 to T, B = 1, no mask): N sequences packed along time, each with its own
    carries (initial and final ones ``[N, ...]``). Differentiable in q, k, v, om and the initial carries; ``den``
    carries no gradient. ``segment``: tokens per parallel segment (a multiple of the token block; default: from the
    device)."""
    B, T, H, D = q.shape
    V = v.shape[-1]
    why = device_unsupported(q)
    if why:
        raise RuntimeError(f"ela_prefix: {why}")
    if kernel not in KERNELS:
        raise ValueError(f"ela_prefix: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if max(D, V) > MAX_DIM:
        raise ValueError(f"ela_prefix: head dims up to {MAX_DIM}, got D = {D}, dv = {V}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or om.shape != v.shape:
        raise ValueError(f"ela_prefix: q and k of one float dtype and om shaped like v expected, got "
                         f"{q.dtype}/{k.dtype}, om {tuple(om.shape)} vs v {tuple(v.shape)}")
    if cu_seqlens is not None and (B != 1 or mask is not None or cu_seqlens.dim() != 1
                                   or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T):
        raise ValueError(f"ela_prefix: cu_seqlens [N + 1] from 0 to T = {T} needs B = 1 and no mask, got B = {B}, "
                         f"mask {'given' if mask is not None else 'None'}, cu_seqlens {cu_seqlens.tolist()}")
    block = _launch_meta(D, V)["BT"]
    if segment is not None and (segment < block or segment % block):
        raise ValueError(f"ela_prefix: segment must be a positive multiple of {block}, got {segment}")
    q, k, v, om = (x.contiguous() for x in (q, k, v, om))
    mask = None if mask is None else mask.to(torch.int8).contiguous()
    init = [None, None, None] if initial_state is None else [x.float().contiguous() for x in initial_state]
    out = ElaPrefixFunction.apply(q, k, v, om, mask, *init, kernel, float(eps), output_final_state, segment,
                                  cu_seqlens)
    if output_final_state:
        o, den, *final = out
        return o, den, tuple(final)
    o, den = out
    return o, den, None
