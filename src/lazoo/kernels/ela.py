"""Triton kernels for the normaliser and the scalar features of ELA's polynomial kernels (``lazoo.ops.ela``).

A polynomial kernel's features split as φ(q) = [q', a], ψ(k) = [k', c]: D scaled inputs and E = 1 or 2 scalars a
token. The linear-attention kernel computes the D-feature numerator ``om_i = Σ_{j≤i} (q'_i·k'_j) v_j``; these kernels
add the rest, per sample and head, in one pass over time:

    num_i = om_i + Σ_e a_ie W_ie,     W_ie = W0_e + Σ_{j≤i} c_je v_j
    den_i = q'_i·Kc_i + Σ_e a_ie Cc_ie,  Kc_i = Kc0 + Σ_{j≤i} k'_j,  Cc_ie = Cc0_e + Σ_{j≤i} c_je
    o_i   = num_i / max(den_i, eps)

Carries (fp32): Kc ``[D]``, Cc ``[E]``, W ``[E, dv]``; they are the state's ``C`` and the scalar columns of ``S``.
The backward walks time twice: forward (recomputing the carries) for ∂om, ∂a, ∂q' and ∂den, then in reverse for the
suffix sums that give ∂k', ∂c and ∂v, ending at the initial carries' gradients.

Layout: q', k' ``[B, T, H, D]``, a, c ``[B, T, H, E]`` (fp32), v, om ``[B, T, H, dv]``; k' and c zero at pads. Every
loaded value is cast to fp32. A program holds one sample·head's whole value row (∂den needs do·o over all of dv) and
one segment of time: a first kernel sums each segment, the carries at every segment's start are a short prefix sum
over segments, and the segments then run in parallel (the backward likewise, with suffix sums for the reverse walk).
Long sequences with few samples would otherwise run on B·H programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import device_unsupported, next_pow2, num_sms

#: the largest q'/k' and value dims (a program holds one token block's rows of both)
MAX_DIM = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EP = 2  # the scalar features' tile width (E = 1 or 2, padded)


@triton.jit
def _rows(ptr, tok, width, offs, ok):
    """``[BT, W]`` fp32 rows ``tok`` (token-head indices, int64) of a ``[.., width]`` tensor, zeros outside ``ok``."""
    return tl.load(ptr + tok[:, None] * width + offs[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _suffix(x):
    """Σ_{s ≥ t} x_s within the block (axis 0)."""
    return tl.sum(x, 0)[None] - tl.cumsum(x, 0) + x


@triton.jit
def _segment(T, L, BT: tl.constexpr):
    """This program's sample·head (int64) and its segment [lo, hi) of L tokens."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * L
    return bh, s, lo, tl.minimum(lo + L, T)


@triton.jit
def _load_carries(KS, CS, WS, i_c, D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, od, ov, oe, md, mv, me):
    """Carries ``[D]``, ``[2]``, ``[2, BV]`` at slot ``i_c`` of ``[.., D]``, ``[.., E]``, ``[.., E, DV]`` buffers."""
    kc = tl.load(KS + i_c * D + od, mask=md, other=0.0)
    cc = tl.load(CS + i_c * E + oe, mask=me, other=0.0)
    w = tl.load(WS + i_c * E * DV + oe[:, None] * DV + ov[None, :], mask=me[:, None] & mv[None, :], other=0.0)
    return kc, cc, w


@triton.jit
def _store_carries(KS, CS, WS, i_c, kc, cc, w, D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, od, ov, oe, md,
                   mv, me):
    tl.store(KS + i_c * D + od, kc, mask=md)
    tl.store(CS + i_c * E + oe, cc, mask=me)
    tl.store(WS + i_c * E * DV + oe[:, None] * DV + ov[None, :], w, mask=me[:, None] & mv[None, :])


@triton.jit
def _totals_kernel(K, C, Vv, KT, CT, WT, T, H, L, NS,
                   D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                   BT: tl.constexpr):
    """Each segment's sums of k', c and c vᵀ (the forward's carries over it)."""
    bh, s, lo, hi = _segment(T, L, BT)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    kc = tl.zeros([BD], dtype=tl.float32)
    cc = tl.zeros([2], dtype=tl.float32)
    w = tl.zeros([2, BV], dtype=tl.float32)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok = (i_b * T + ot) * H + i_h
        c = _rows(C, tok, E, oe, mt[:, None] & me[None, :])
        kc += tl.sum(_rows(K, tok, D, od, mt[:, None] & md[None, :]), 0)
        cc += tl.sum(c, 0)
        w += tl.sum(c[:, :, None] * _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])[:, None, :], 0)
    _store_carries(KT, CT, WT, bh * NS + s, kc, cc, w, D, DV, E, od, ov, oe, md, mv, me)


@triton.jit
def _fwd_kernel(Q, K, A, C, Vv, OM, O, DEN, KS, CS, WS, T, H, L, NS, eps,
                D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr):
    """One segment, from the carries at its start (``KS``, ``CS``, ``WS`` ``[B, H, NS, ..]``)."""
    eps = tl.cast(eps, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    bh, s, lo, hi = _segment(T, L, BT)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    kc, cc, w = _load_carries(KS, CS, WS, bh * NS + s, D, DV, E, od, ov, oe, md, mv, me)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok = (i_b * T + ot) * H + i_h
        q = _rows(Q, tok, D, od, mt[:, None] & md[None, :])
        k = _rows(K, tok, D, od, mt[:, None] & md[None, :])
        a = _rows(A, tok, E, oe, mt[:, None] & me[None, :])
        c = _rows(C, tok, E, oe, mt[:, None] & me[None, :])
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        om = _rows(OM, tok, DV, ov, mt[:, None] & mv[None, :])
        kc_t = tl.cumsum(k, 0) + kc[None, :]
        cc_t = tl.cumsum(c, 0) + cc[None, :]
        cv = c[:, :, None] * v[:, None, :]  # [BT, 2, BV]
        w_t = tl.cumsum(cv, 0) + w[None, :, :]
        num = om + tl.sum(a[:, :, None] * w_t, 1)
        den = tl.sum(q * kc_t, 1) + tl.sum(a * cc_t, 1)
        o = num / tl.maximum(den, eps)[:, None]
        tl.store(O + tok[:, None] * DV + ov[None, :], o, mask=mt[:, None] & mv[None, :])
        tl.store(DEN + tok, den, mask=mt)
        kc += tl.sum(k, 0)
        cc += tl.sum(c, 0)
        w += tl.sum(cv, 0)


@triton.jit
def _bwd_forward_kernel(K, A, C, Vv, O, DEN, DO, KS, CS, WS, Q, DQ, DA, DOM, DDEN, XT, ZT, YT, T, H, L, NS, eps,
                        D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                        BT: tl.constexpr):
    """The backward's forward walk over one segment: the carries again, then ∂om = ∂num, ∂a, ∂q' and ∂den; and the
    segment's sums of ∂den q', ∂den a and a ∂numᵀ (what the reverse walk carries into earlier segments)."""
    eps = tl.cast(eps, tl.float32)
    bh, s, lo, hi = _segment(T, L, BT)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    kc, cc, w = _load_carries(KS, CS, WS, bh * NS + s, D, DV, E, od, ov, oe, md, mv, me)
    xs = tl.zeros([BD], dtype=tl.float32)
    zs = tl.zeros([2], dtype=tl.float32)
    ys = tl.zeros([2, BV], dtype=tl.float32)
    for t0 in range(lo, hi, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < hi
        tok = (i_b * T + ot) * H + i_h
        q = _rows(Q, tok, D, od, mt[:, None] & md[None, :])
        k = _rows(K, tok, D, od, mt[:, None] & md[None, :])
        a = _rows(A, tok, E, oe, mt[:, None] & me[None, :])
        c = _rows(C, tok, E, oe, mt[:, None] & me[None, :])
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        o = _rows(O, tok, DV, ov, mt[:, None] & mv[None, :])
        do = _rows(DO, tok, DV, ov, mt[:, None] & mv[None, :])
        den = tl.load(DEN + tok, mask=mt, other=1.0)
        kc_t = tl.cumsum(k, 0) + kc[None, :]
        cc_t = tl.cumsum(c, 0) + cc[None, :]
        cv = c[:, :, None] * v[:, None, :]
        w_t = tl.cumsum(cv, 0) + w[None, :, :]
        dcl = tl.maximum(den, eps)
        dnum = do / dcl[:, None]
        dden = tl.where(den >= eps, -tl.sum(do * o, 1) / dcl, 0.0)  # max(den, eps) passes no gradient below eps
        da = tl.sum(dnum[:, None, :] * w_t, 2) + dden[:, None] * cc_t
        tl.store(DOM + tok[:, None] * DV + ov[None, :], dnum, mask=mt[:, None] & mv[None, :])
        tl.store(DQ + tok[:, None] * D + od[None, :], dden[:, None] * kc_t, mask=mt[:, None] & md[None, :])
        tl.store(DA + tok[:, None] * E + oe[None, :], da, mask=mt[:, None] & me[None, :])
        tl.store(DDEN + tok, dden, mask=mt)
        kc += tl.sum(k, 0)
        cc += tl.sum(c, 0)
        w += tl.sum(cv, 0)
        xs += tl.sum(dden[:, None] * q, 0)
        zs += tl.sum(dden[:, None] * a, 0)
        ys += tl.sum(a[:, :, None] * dnum[:, None, :], 0)
    _store_carries(XT, ZT, YT, bh * NS + s, xs, zs, ys, D, DV, E, od, ov, oe, md, mv, me)


@triton.jit
def _bwd_reverse_kernel(Q, A, C, Vv, DEN, DO, DDEN, RS, RCS, RWS, DK, DC, DVV, T, H, L, NS, eps,
                        D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                        BT: tl.constexpr):
    """The reverse walk over one segment, from the suffix sums after it (``RS``, ``RCS``, ``RWS``): ∂k', ∂c, ∂v."""
    eps = tl.cast(eps, tl.float32)
    bh, s, lo, hi = _segment(T, L, BT)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    rk, rc, rw = _load_carries(RS, RCS, RWS, bh * NS + s, D, DV, E, od, ov, oe, md, mv, me)
    nb = tl.cdiv(hi - lo, BT)
    for i in range(0, nb):
        ot = lo + (nb - 1 - i) * BT + tl.arange(0, BT)
        mt = ot < hi
        tok = (i_b * T + ot) * H + i_h
        q = _rows(Q, tok, D, od, mt[:, None] & md[None, :])
        a = _rows(A, tok, E, oe, mt[:, None] & me[None, :])
        c = _rows(C, tok, E, oe, mt[:, None] & me[None, :])
        v = _rows(Vv, tok, DV, ov, mt[:, None] & mv[None, :])
        do = _rows(DO, tok, DV, ov, mt[:, None] & mv[None, :])
        den = tl.load(DEN + tok, mask=mt, other=1.0)
        dden = tl.load(DDEN + tok, mask=mt, other=0.0)
        dnum = do / tl.maximum(den, eps)[:, None]
        x = dden[:, None] * q  # ∂Kc_t
        tl.store(DK + tok[:, None] * D + od[None, :], _suffix(x) + rk[None, :], mask=mt[:, None] & md[None, :])
        rk += tl.sum(x, 0)
        y = a[:, :, None] * dnum[:, None, :]  # ∂W_t  [BT, 2, BV]
        r = _suffix(y) + rw[None, :, :]
        rw += tl.sum(y, 0)
        z = dden[:, None] * a  # ∂Cc_t
        dc = tl.sum(v[:, None, :] * r, 2) + _suffix(z) + rc[None, :]
        rc += tl.sum(z, 0)
        tl.store(DVV + tok[:, None] * DV + ov[None, :], tl.sum(c[:, :, None] * r, 1), mask=mt[:, None] & mv[None, :])
        tl.store(DC + tok[:, None] * E + oe[None, :], dc, mask=mt[:, None] & me[None, :])


def _launch_meta(D, V):
    BD, BV = next_pow2(D), next_pow2(V)
    BT = 16 if max(BD, BV) > 128 else 32
    return dict(BD=BD, BV=BV, BT=BT, num_warps=4)


def _segment_length(T, BH, BT, device, segment):
    """Tokens per segment: enough segments for two programs per SM (one segment where B·H already fills them),
    a multiple of BT; ``segment`` (a multiple of BT) overrides it (tests)."""
    if segment is not None:
        return segment
    n = max(1, min(triton.cdiv(2 * num_sms(device), BH), triton.cdiv(T, BT)))
    return triton.cdiv(triton.cdiv(max(T, 1), n), BT) * BT


def _exclusive(totals, start):
    """The carries at every segment's start: ``start`` plus the sums of the segments before it (dim 2)."""
    return start.unsqueeze(2) + totals.cumsum(2) - totals


class ElaPrefixFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, k1, a, c, v, om, kc0, cc0, w0, eps, output_final_state, segment):
        B, T, H, D = q1.shape
        V, E = v.shape[-1], a.shape[-1]
        meta = _launch_meta(D, V)
        L = _segment_length(T, B * H, meta["BT"], v.device, segment)
        NS = triton.cdiv(T, L)
        f32 = dict(dtype=torch.float32, device=v.device)
        shapes = ((B, H, D), (B, H, E), (B, H, E, V))
        init = [torch.zeros(sh, **f32) for sh in shapes] if kc0 is None else [kc0, cc0, w0]
        totals = [torch.empty(sh[:2] + (NS,) + sh[2:], **f32) for sh in shapes]
        _totals_kernel[(B * H, NS)](k1, c, v, *totals, T, H, L, NS, D=D, DV=V, E=E, **meta)
        starts = [_exclusive(t, x) for t, x in zip(totals, init)]
        o = torch.empty_like(v)
        den = torch.empty(B, T, H, **f32)
        _fwd_kernel[(B * H, NS)](q1, k1, a, c, v, om, o, den, *starts, T, H, L, NS, float(eps), D=D, DV=V, E=E, **meta)
        ctx.save_for_backward(q1, k1, a, c, v, o, den, *starts)
        ctx.eps, ctx.L, ctx.has_init = eps, L, kc0 is not None
        ctx.mark_non_differentiable(den)
        if not output_final_state:
            return o, den
        final = [x + t.sum(2) for x, t in zip(init, totals)]
        return (o, den, *final)

    @staticmethod
    def backward(ctx, do, _dden, *dfinal):
        q1, k1, a, c, v, o, den, *starts = ctx.saved_tensors
        B, T, H, D = q1.shape
        V, E = v.shape[-1], a.shape[-1]
        meta = _launch_meta(D, V)
        L = ctx.L
        NS = triton.cdiv(T, L)
        f32 = dict(dtype=torch.float32, device=v.device)
        shapes = ((B, H, D), (B, H, E), (B, H, E, V))
        dq, dk, dvv, dom = (torch.empty_like(x) for x in (q1, k1, v, v))
        da, dc = torch.empty_like(a), torch.empty_like(c)
        dden = torch.empty(B, T, H, **f32)
        totals = [torch.empty(sh[:2] + (NS,) + sh[2:], **f32) for sh in shapes]
        _bwd_forward_kernel[(B * H, NS)](k1, a, c, v, o, den, do.contiguous(), *starts, q1, dq, da, dom, dden,
                                         *totals, T, H, L, NS, float(ctx.eps), D=D, DV=V, E=E, **meta)
        # the reverse walk of a segment starts from the final carries' gradients plus every later segment's sums
        after = [torch.zeros(sh, **f32) if g is None else g.float() for g, sh in zip(list(dfinal) or [None] * 3,
                                                                                  shapes)]
        suffix = [x.unsqueeze(2) + t.sum(2, keepdim=True) - t.cumsum(2) for t, x in zip(totals, after)]
        _bwd_reverse_kernel[(B * H, NS)](q1, a, c, v, den, do.contiguous(), dden, *(x.contiguous() for x in suffix),
                                         dk, dc, dvv, T, H, L, NS, float(ctx.eps), D=D, DV=V, E=E, **meta)
        dinit = [x + t.sum(2) for x, t in zip(after, totals)] if ctx.has_init else [None, None, None]
        return dq, dk, da, dc, dvv, dom, *dinit, None, None, None


def ela_prefix(q1: torch.Tensor, k1: torch.Tensor, a: torch.Tensor, c: torch.Tensor, v: torch.Tensor,
               om: torch.Tensor, *, eps: float, initial_state=None, output_final_state: bool = False,
               segment: int | None = None):
    """``(o [B, T, H, dv] in v's dtype, den [B, T, H] fp32, final carries (Kc, Cc, W) fp32 or None)`` (module
    docstring). ``initial_state``: the carries ``(Kc0 [B, H, D], Cc0 [B, H, E], W0 [B, H, E, dv])``, fp32, or None
    (zeros). Differentiable in every tensor input, the initial carries included; ``den`` carries no gradient.
    ``segment``: tokens per parallel segment (a multiple of the token block; default: from the device)."""
    B, T, H, D = q1.shape
    V, E = v.shape[-1], a.shape[-1]
    why = device_unsupported(q1)
    if why:
        raise RuntimeError(f"ela_prefix: {why}")
    if E not in (1, 2) or max(D, V) > MAX_DIM:
        raise ValueError(f"ela_prefix: E = {E} scalar features (1 or 2) and dims D = {D}, dv = {V} (at most "
                         f"{MAX_DIM}) expected")
    if q1.dtype not in SUPPORTED_DTYPES or k1.dtype != q1.dtype or om.shape != v.shape:
        raise ValueError(f"ela_prefix: q' and k' of one float dtype and om shaped like v expected, got "
                         f"{q1.dtype}/{k1.dtype}, om {tuple(om.shape)} vs v {tuple(v.shape)}")
    block = _launch_meta(D, V)["BT"]
    if segment is not None and (segment < block or segment % block):
        raise ValueError(f"ela_prefix: segment must be a positive multiple of {block}, got {segment}")
    q1, k1, v, om = (x.contiguous() for x in (q1, k1, v, om))
    a, c = (x.float().contiguous() for x in (a, c))
    init = [None, None, None] if initial_state is None else [x.float().contiguous() for x in initial_state]
    out = ElaPrefixFunction.apply(q1, k1, a, c, v, om, *init, float(eps), output_final_state, segment)
    if output_final_state:
        o, den, *final = out
        return o, den, tuple(final)
    o, den = out
    return o, den, None
