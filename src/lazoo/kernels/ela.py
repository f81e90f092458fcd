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
loaded value is cast to fp32; one program per sample and head (its whole value row: ∂den needs do·o over all of dv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import device_unsupported, next_pow2

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
def _fwd_kernel(Q, K, A, C, Vv, OM, O, DEN, KC0, CC0, W0, KCT, CCT, WT, T, H, eps,
                D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr, USE_INIT: tl.constexpr, STORE_FINAL: tl.constexpr):
    eps = tl.cast(eps, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    mw = me[:, None] & mv[None, :]
    if USE_INIT:
        kc = tl.load(KC0 + bh * D + od, mask=md, other=0.0)
        cc = tl.load(CC0 + bh * E + oe, mask=me, other=0.0)
        w = tl.load(W0 + bh * E * DV + oe[:, None] * DV + ov[None, :], mask=mw, other=0.0)
    else:
        kc = tl.zeros([BD], dtype=tl.float32)
        cc = tl.zeros([2], dtype=tl.float32)
        w = tl.zeros([2, BV], dtype=tl.float32)
    for t0 in range(0, T, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < T
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
    if STORE_FINAL:
        tl.store(KCT + bh * D + od, kc, mask=md)
        tl.store(CCT + bh * E + oe, cc, mask=me)
        tl.store(WT + bh * E * DV + oe[:, None] * DV + ov[None, :], w, mask=mw)


@triton.jit
def _bwd_kernel(Q, K, A, C, Vv, O, DEN, DO, KC0, CC0, W0, DKCT, DCCT, DWT,
                DQ, DK, DA, DC, DVV, DOM, DDEN, DKC0, DCC0, DW0, T, H, eps,
                D: tl.constexpr, DV: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr, USE_INIT: tl.constexpr, USE_DFINAL: tl.constexpr):
    eps = tl.cast(eps, tl.float32)
    bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = bh // H, bh % H
    od, ov, oe = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, 2)
    md, mv, me = od < D, ov < DV, oe < E
    mw = me[:, None] & mv[None, :]
    # forward in time: the carries again, then ∂om = ∂num, ∂a, ∂q' and ∂den (kept for the reverse pass)
    if USE_INIT:
        kc = tl.load(KC0 + bh * D + od, mask=md, other=0.0)
        cc = tl.load(CC0 + bh * E + oe, mask=me, other=0.0)
        w = tl.load(W0 + bh * E * DV + oe[:, None] * DV + ov[None, :], mask=mw, other=0.0)
    else:
        kc = tl.zeros([BD], dtype=tl.float32)
        cc = tl.zeros([2], dtype=tl.float32)
        w = tl.zeros([2, BV], dtype=tl.float32)
    for t0 in range(0, T, BT):
        ot = t0 + tl.arange(0, BT)
        mt = ot < T
        tok = (i_b * T + ot) * H + i_h
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
    tl.debug_barrier()  # the reverse pass reads ∂den written by other threads of this program
    # reverse in time: suffix sums of ∂den q', a ∂num and ∂den a, from the final carries' gradients
    if USE_DFINAL:
        rk = tl.load(DKCT + bh * D + od, mask=md, other=0.0)
        rc = tl.load(DCCT + bh * E + oe, mask=me, other=0.0)
        rw = tl.load(DWT + bh * E * DV + oe[:, None] * DV + ov[None, :], mask=mw, other=0.0)
    else:
        rk = tl.zeros([BD], dtype=tl.float32)
        rc = tl.zeros([2], dtype=tl.float32)
        rw = tl.zeros([2, BV], dtype=tl.float32)
    NB = tl.cdiv(T, BT)
    for i in range(0, NB):
        ot = (NB - 1 - i) * BT + tl.arange(0, BT)
        mt = ot < T
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
    if USE_INIT:
        tl.store(DKC0 + bh * D + od, rk, mask=md)
        tl.store(DCC0 + bh * E + oe, rc, mask=me)
        tl.store(DW0 + bh * E * DV + oe[:, None] * DV + ov[None, :], rw, mask=mw)


def _launch_meta(D, V):
    BD, BV = next_pow2(D), next_pow2(V)
    BT = 16 if max(BD, BV) > 128 else 32
    return dict(BD=BD, BV=BV, BT=BT, num_warps=4)


class ElaPrefixFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, k1, a, c, v, om, kc0, cc0, w0, eps, output_final_state):
        B, T, H, D = q1.shape
        V, E = v.shape[-1], a.shape[-1]
        use_init = kc0 is not None
        o = torch.empty_like(v)
        den = torch.empty(B, T, H, dtype=torch.float32, device=v.device)
        final = [torch.empty(s, dtype=torch.float32, device=v.device) for s in ((B, H, D), (B, H, E), (B, H, E, V))] \
            if output_final_state else [den, den, den]  # unused pointers
        init = (kc0, cc0, w0) if use_init else (den, den, den)
        _fwd_kernel[(B * H,)](q1, k1, a, c, v, om, o, den, *init, *final, T, H, float(eps), D=D, DV=V, E=E,
                              USE_INIT=use_init, STORE_FINAL=output_final_state, **_launch_meta(D, V))
        ctx.save_for_backward(q1, k1, a, c, v, o, den, *(init if use_init else ()))
        ctx.eps, ctx.use_init, ctx.output_final_state = eps, use_init, output_final_state
        ctx.mark_non_differentiable(den)
        return (o, den, *final) if output_final_state else (o, den)

    @staticmethod
    def backward(ctx, do, _dden, *dfinal):
        q1, k1, a, c, v, o, den, *init = ctx.saved_tensors
        B, T, H, D = q1.shape
        V, E = v.shape[-1], a.shape[-1]
        use_dfinal = bool(dfinal) and any(g is not None for g in dfinal)
        if use_dfinal:
            shapes = ((B, H, D), (B, H, E), (B, H, E, V))
            dfinal = [torch.zeros(s, dtype=torch.float32, device=v.device) if g is None else g.float().contiguous()
                      for g, s in zip(dfinal, shapes)]
        dq, dk, dvv, dom = (torch.empty_like(x) for x in (q1, k1, v, v))
        da, dc = torch.empty_like(a), torch.empty_like(c)
        dden = torch.empty(B, T, H, dtype=torch.float32, device=v.device)
        dinit = [torch.empty_like(x) for x in init] if ctx.use_init else [dden, dden, dden]
        _bwd_kernel[(B * H,)](q1, k1, a, c, v, o, den, do.contiguous(), *(init if ctx.use_init else [dden] * 3),
                              *(dfinal if use_dfinal else [dden] * 3), dq, dk, da, dc, dvv, dom, dden, *dinit, T, H,
                              float(ctx.eps), D=D, DV=V, E=E, USE_INIT=ctx.use_init, USE_DFINAL=use_dfinal,
                              **_launch_meta(D, V))
        dinit = dinit if ctx.use_init else [None, None, None]
        return dq, dk, da, dc, dvv, dom, *dinit, None, None


def ela_prefix(q1: torch.Tensor, k1: torch.Tensor, a: torch.Tensor, c: torch.Tensor, v: torch.Tensor,
               om: torch.Tensor, *, eps: float, initial_state=None, output_final_state: bool = False):
    """``(o [B, T, H, dv] in v's dtype, den [B, T, H] fp32, final carries (Kc, Cc, W) fp32 or None)`` (module
    docstring). ``initial_state``: the carries ``(Kc0 [B, H, D], Cc0 [B, H, E], W0 [B, H, E, dv])``, fp32, or None
    (zeros). Differentiable in every tensor input, the initial carries included; ``den`` carries no gradient."""
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
    q1, k1, v, om = (x.contiguous() for x in (q1, k1, v, om))
    a, c = (x.float().contiguous() for x in (a, c))
    init = [None, None, None] if initial_state is None else [x.float().contiguous() for x in initial_state]
    out = ElaPrefixFunction.apply(q1, k1, a, c, v, om, *init, float(eps), output_final_state)
    if output_final_state:
        o, den, *final = out
        return o, den, tuple(final)
    o, den = out
    return o, den, None
