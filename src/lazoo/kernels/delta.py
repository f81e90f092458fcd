"""Triton kernels for the (gated) delta rule: chunk-parallel WY/UT form with a hand-written backward,
and a fused recurrent kernel for decoding.

Rule (per head; state ``S`` ``[dv, dk]``, write key ``w_t = β_t k_t``, ``a_t = exp(g_t)``):

    S_t = a_t S_{t-1} + (v_t - a_t S_{t-1} k_t) w_t^T,        o_t = S_t (scale q_t)

Chunk form (C rows per chunk, ``G`` = cumsum of g inside the chunk, ``γ = exp(G)``, ``E[t,i] = exp(G_t - G_i)``,
``D_i = exp(G_C - G_i)``; ``S`` the chunk's start state):

    L = strict_tril(E ⊙ K W^T),  A = (I + L)^{-1},  W~ = A diag(γ) K,  U~ = A V
    U  = U~ - W~ S^T                              (pseudo-values v_t - a_t S_{t-1} k_t)
    O  = scale (diag(γ) Q S^T + tril(E ⊙ Q W^T) U)
    S' = γ_C S + U^T diag(D) W

Kernels (forward with autograd): ``_fwd_solve`` (G and A, parallel over chunks), ``_fwd_wu`` (W~ and U~ as
whole-chunk products), ``_fwd_h`` (the only sequential pass over chunks: start states and U), ``_fwd_o`` (outputs).
Without autograd (a prefill), after ``_fwd_solve``: ``_fwd_mix`` (M = tril(E ⊙ Q W^T) A and Y = A^T diag(D) W,
parallel) and ``_fwd_walk`` (per chunk X = V - Γ K S^T, O = scale (diag(γ) Q S^T + M X), S' = γ_C S + Y^T X): no
chunk state, W~ or U reaches memory. It is the same rule regrouped (U = A X); FlashQLA's fused forward (the Qwen
team's TileLang kernels) walks the chunks with the same X.
Backward: ``_bwd_dv_local`` (P^T dO), ``_bwd_dhu`` (sequential, reverse: state gradients and dU), ``_bwd_dqkw``
(dq, dW, dW~ and part of dG), ``_bwd_wy`` (back through A: dk, dv, dβ, dg). On Hopper the walks, the forward and
the backward's chunk-parallel part (``_bwd_dqkw`` + ``_bwd_wy``) have Gluon kernels of their own (``delta_gluon``,
``delta_fused``, ``delta_chunk_bwd``), taken where they run, and the solve one taken only where asked for
(``delta_solve``: slower); these Triton kernels stay the reference and serve every other GPU, dtype and head size.

Layout inside: tokens flattened, ``[TT, H, d]`` (B·T tokens, or the packed ``cu_seqlens`` batch); chunks
never straddle sequences. Per-chunk states are stored transposed, ``[NT, H, dk, dv]``.

Triton 3.4-3.7.0 on Hopper miscompiles ``tl.dot(tl.trans(x), y)`` when ``x`` is the register result of an
earlier ``tl.dot`` (wgmma accumulator layout transposed into a "linear" layout): that is the bug behind
flash-linear-attention's guards on its gated ``chunk_bwd_dqkwg`` and its ``prepare_wy_repr_bwd``. These
kernels never transpose a value that came out of a dot: every transposed operand is a tile loaded from
memory (or computed elementwise from loads), and a transposed product that is needed (``dP^T``, ``dA^T``)
is computed directly as its own dot of loaded tiles (a store and a transposed load back through memory, tried
instead, was slower: H200, bf16, T = 8k, the two kernels 1.69 against 1.51 ms; so was forming the write-key side
transposed, Kᵀ(E ⊙ dL) and Qᵀ M, and turning it with an elementwise ``tl.trans`` that feeds no dot: correct for the
(gated) rule on an H200, fwd + bwd 3.53 against 3.41 ms at T = 1k). The sequential kernels hold
the state transposed (``S^T [dk, dv]``) for the same reason. One program per chunk for all of ``_bwd_dqkw`` and
``_bwd_wy`` (through X = V - Γ K S^T: dA = dU X^T, dv = A^T dU, the write key's gradient built as ``[dk, C]``) was
correct but slower: H200, bf16, fwd + bwd at T = 1k (B = 32, H = 16) 4.7-6.8 ms against 3.68, at T = 8k with 32
value heads 9.6-12.9 against 7.18 (it spills at 255 registers with three ``[64, 128]`` accumulators live, at 4 or 8
warps, whole or halved dk blocks).

Precision: matrix products take 16-bit operands for 16-bit inputs (fp32 accumulation; the state and
the per-chunk states enter their products in the 16-bit type, as in fla), the training kernels' triangular products
too (W~, U~ and the WY backward; A is kept in fp32 and rounded as it enters a product: ``TRIANGULAR_16BIT``), while
the prefill's M and Y and given write keys take tf32 products; fp32 inputs use tf32x3 (about fp32 accuracy)
for every product; the 16x16 diagonal blocks of A are inverted in exact fp32 and merged in tf32 (tf32x3);
elementwise work, the state between chunks and all recurrences are fp32. Measured against float64 on an H100 with
tf32 triangular products: bf16 <= 7e-3, fp16 <= 8e-4, fp32 <= 5e-6 (max relative error of outputs, states and
gradients, T = 1000); on an H200 with 16-bit ones the bf16 gated rule's output and gradients (T = 1000, B = 2,
H = 16, HV = 16 and 32, two draws each) are 4.7e-3 to 9.7e-3 off, against 4.3e-3 to 8.2e-3 with tf32, and fp16
stays within the GPU tests' 3e-3.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from . import delta_split
from ._chunk_layout import cached_uniform
from ._delta_tiles import chunk_info, dot_acc, gate, load_factor, load_raw, load_tile, load_vec, parallel_ids
from ._launch import dot_types, fill_device
from ._tensor_cache import cached_on
from ._tiles import dot, inv_unit_lower16, inv_unit_lower16x4
from ._utils import next_pow2, num_sms
from .limits import DELTA_CHUNK_SIZES as CHUNK_SIZES
from .limits import DELTA_MAX_HEAD_DIM as MAX_HEAD_DIM
from .limits import KERNEL_DTYPES


# ============================================================================ small jit helpers
@triton.jit
def _dotf(a, b, PREC: tl.constexpr):
    """``a @ b`` with fp32 operands (tf32 for 16-bit inputs, exact fp32 for fp32 inputs)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _store_tile(ptr, x, row0, eos, stride, col0, ncols, R: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, R)
    c = col0 + tl.arange(0, BC)
    if ncols % BC == 0:
        m = (r < eos - row0)[:, None]
    else:
        m = (r < eos - row0)[:, None] & (c < ncols)[None, :]
    tl.store(ptr + row0 * stride + (r[:, None] * stride + c[None, :]), x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_vec(ptr, x, row0, eos, stride, R: tl.constexpr):
    r = tl.arange(0, R)
    tl.store(ptr + row0 * stride + r * stride, x, mask=r < eos - row0)


@triton.jit
def _load_beta(beta, row0, eos, H: tl.constexpr, HAS_W: tl.constexpr):
    """β of 16 rows as a ``[1, 16]`` column factor (ones when the write keys are given)."""
    if HAS_W:
        return tl.full([1, 16], 1.0, tl.float32)
    else:
        return load_vec(beta, row0, eos, H, 16)[None, :]


@triton.jit
def _decay_tile(Gi, Gj, DIAG: tl.constexpr):
    """``exp(G_t - G_i)`` for a 16x16 tile (rows t, cols i); on a diagonal tile only where t > i."""
    if DIAG:
        o = tl.arange(0, 16)
        m = o[:, None] > o[None, :]
        return tl.where(m, tl.exp(tl.where(m, Gi[:, None] - Gj[None, :], 0.0)), 0.0)
    else:
        return tl.exp(Gi[:, None] - Gj[None, :])


@triton.jit
def _store_a16(A, x, t0, eos, H: tl.constexpr, C: tl.constexpr, bi: tl.constexpr, bj: tl.constexpr):
    o = tl.arange(0, 16)
    r = bi * 16 + o
    tl.store(A + t0 * (H * C) + (r[:, None] * (H * C) + bj * 16 + o[None, :]), x, mask=(r < eos - t0)[:, None])


# ============================================================================ forward kernels
@triton.jit
def _fwd_solve_kernel(
    k, w, beta, g, Gc, A, chunks, cu,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk: G (within-chunk cumsum of g) and A = (I + strict_tril(E ⊙ K W^T))^{-1} (W = β K, or the
    given write keys). The inverse is built from 16x16 diagonal blocks (forward substitution, row by row: one
    warp does it fastest) merged by block products in tf32 (tf32x3 for fp32 inputs)."""
    i_c, _, i_h = parallel_ids(1, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    NB: tl.constexpr = C // 16
    k += (i_h // (H // HK)) * K  # the key head of value head i_h (HK == H without grouped value heads)
    w += (i_h // (H // HK)) * K
    beta += i_h
    Z = tl.zeros([16, 16], dtype=tl.float32)
    L00 = Z
    L10 = Z
    L11 = Z
    L20 = Z
    L21 = Z
    L22 = Z
    L30 = Z
    L31 = Z
    L32 = Z
    L33 = Z
    for kb in range(0, K, BK):  # K W^T blocks (for W = β K: K K^T, β applied to the columns below)
        k0 = load_raw(k, t0, eos, HK * K, kb, K, 16, BK)
        c0 = load_raw(w, t0, eos, HK * K, kb, K, 16, BK) if HAS_W else k0
        L00 = dot_acc(k0, tl.trans(c0), L00, DT, PREC)
        if NB >= 2:
            k1 = load_raw(k, t0 + 16, eos, HK * K, kb, K, 16, BK)
            c1 = load_raw(w, t0 + 16, eos, HK * K, kb, K, 16, BK) if HAS_W else k1
            L10 = dot_acc(k1, tl.trans(c0), L10, DT, PREC)
            L11 = dot_acc(k1, tl.trans(c1), L11, DT, PREC)
        if NB >= 4:
            k2 = load_raw(k, t0 + 32, eos, HK * K, kb, K, 16, BK)
            k3 = load_raw(k, t0 + 48, eos, HK * K, kb, K, 16, BK)
            c2 = load_raw(w, t0 + 32, eos, HK * K, kb, K, 16, BK) if HAS_W else k2
            c3 = load_raw(w, t0 + 48, eos, HK * K, kb, K, 16, BK) if HAS_W else k3
            L20 = dot_acc(k2, tl.trans(c0), L20, DT, PREC)
            L21 = dot_acc(k2, tl.trans(c1), L21, DT, PREC)
            L22 = dot_acc(k2, tl.trans(c2), L22, DT, PREC)
            L30 = dot_acc(k3, tl.trans(c0), L30, DT, PREC)
            L31 = dot_acc(k3, tl.trans(c1), L31, DT, PREC)
            L32 = dot_acc(k3, tl.trans(c2), L32, DT, PREC)
            L33 = dot_acc(k3, tl.trans(c3), L33, DT, PREC)
    b0 = _load_beta(beta, t0, eos, H, HAS_W)
    if NB >= 2:
        b1 = _load_beta(beta, t0 + 16, eos, H, HAS_W)
    if NB >= 4:
        b2 = _load_beta(beta, t0 + 32, eos, H, HAS_W)
        b3 = _load_beta(beta, t0 + 48, eos, H, HAS_W)
    o16 = tl.arange(0, 16)
    strict = o16[:, None] > o16[None, :]
    if HAS_G:  # G = within-chunk cumsum of g, one 16-row block at a time
        g += i_h
        b_gb = load_vec(g, t0, eos, H, 16)
        G0 = tl.cumsum(b_gb, 0)
        tot = tl.sum(b_gb, 0)
        _store_vec(Gc + i_h, G0, t0, eos, H, 16)
        if NB >= 2:
            b_gb = load_vec(g, t0 + 16, eos, H, 16)
            G1 = tl.cumsum(b_gb, 0) + tot
            tot += tl.sum(b_gb, 0)
            _store_vec(Gc + i_h, G1, t0 + 16, eos, H, 16)
        if NB >= 4:
            b_gb = load_vec(g, t0 + 32, eos, H, 16)
            G2 = tl.cumsum(b_gb, 0) + tot
            tot += tl.sum(b_gb, 0)
            _store_vec(Gc + i_h, G2, t0 + 32, eos, H, 16)
            G3 = tl.cumsum(load_vec(g, t0 + 48, eos, H, 16), 0) + tot
            _store_vec(Gc + i_h, G3, t0 + 48, eos, H, 16)
        L00 *= _decay_tile(G0, G0, True) * b0
        if NB >= 2:
            L10 *= _decay_tile(G1, G0, False) * b0
            L11 *= _decay_tile(G1, G1, True) * b1
        if NB >= 4:
            L20 *= _decay_tile(G2, G0, False) * b0
            L21 *= _decay_tile(G2, G1, False) * b1
            L22 *= _decay_tile(G2, G2, True) * b2
            L30 *= _decay_tile(G3, G0, False) * b0
            L31 *= _decay_tile(G3, G1, False) * b1
            L32 *= _decay_tile(G3, G2, False) * b2
            L33 *= _decay_tile(G3, G3, True) * b3
    else:
        L00 = tl.where(strict, L00 * b0, 0.0)
        if NB >= 2:
            L10 *= b0
            L11 = tl.where(strict, L11 * b1, 0.0)
        if NB >= 4:
            L20 *= b0
            L21 *= b1
            L22 = tl.where(strict, L22 * b2, 0.0)
            L30 *= b0
            L31 *= b1
            L32 *= b2
            L33 = tl.where(strict, L33 * b3, 0.0)

    A += i_h * C
    if NB >= 4:
        N00, N11, N22, N33 = inv_unit_lower16x4(L00, L11, L22, L33)
    else:
        N00 = inv_unit_lower16(L00)
        if NB >= 2:
            N11 = inv_unit_lower16(L11)
    _store_a16(A, N00, t0, eos, H, C, 0, 0)
    if NB >= 2:
        N10 = -_dotf(N11, _dotf(L10, N00, PREC), PREC)
        _store_a16(A, N10, t0, eos, H, C, 1, 0)
        _store_a16(A, N11, t0, eos, H, C, 1, 1)
        _store_a16(A, Z, t0, eos, H, C, 0, 1)
    if NB >= 4:
        N21 = -_dotf(N22, _dotf(L21, N11, PREC), PREC)
        N32 = -_dotf(N33, _dotf(L32, N22, PREC), PREC)
        N20 = -_dotf(N22, _dotf(L20, N00, PREC) + _dotf(L21, N10, PREC), PREC)
        N31 = -_dotf(N33, _dotf(L31, N11, PREC) + _dotf(L32, N21, PREC), PREC)
        N30 = -_dotf(N33, _dotf(L30, N00, PREC) + _dotf(L31, N10, PREC) + _dotf(L32, N20, PREC), PREC)
        _store_a16(A, N20, t0, eos, H, C, 2, 0)
        _store_a16(A, N21, t0, eos, H, C, 2, 1)
        _store_a16(A, N22, t0, eos, H, C, 2, 2)
        _store_a16(A, N30, t0, eos, H, C, 3, 0)
        _store_a16(A, N31, t0, eos, H, C, 3, 1)
        _store_a16(A, N32, t0, eos, H, C, 3, 2)
        _store_a16(A, N33, t0, eos, H, C, 3, 3)
        _store_a16(A, Z, t0, eos, H, C, 0, 2)
        _store_a16(A, Z, t0, eos, H, C, 0, 3)
        _store_a16(A, Z, t0, eos, H, C, 1, 2)
        _store_a16(A, Z, t0, eos, H, C, 1, 3)
        _store_a16(A, Z, t0, eos, H, C, 2, 3)


@triton.jit
def _fwd_wu_kernel(
    k, v, Gc, A, wt, ut, chunks, cu,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_G: tl.constexpr, TDT: tl.constexpr, PREC: tl.constexpr, STORE_U: tl.constexpr = True,
):
    """W~ = A Γ K and (where STORE_U) U~ = A V of one chunk from the stored A, as whole-chunk products (formed from
    A's 16x16 tiles inside the solve, they kept the tensor cores idle: H200, bf16, T = 8k, 0.70 ms for the fused
    kernel against 0.20 + 0.29 for the two)."""
    i_c, _, i_h = parallel_ids(1, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    b_A = load_tile(A + i_h * C, t0, eos, H * C, 0, C, C, C)
    if HAS_G:
        b_G, _ = gate(Gc, i_h, t0, eos, H, C)
        e = tl.exp(b_G)[:, None]
    for kb in range(0, K, BK):
        x = load_tile(k + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        if HAS_G:
            x = x * e
        _store_tile(wt + i_h * K, dot(b_A, x, TDT, PREC), t0, eos, H * K, kb, K, C, BK)
    if STORE_U:
        for vb in range(0, V, BV):
            y = load_tile(v + i_h * V, t0, eos, H * V, vb, V, C, BV)
            _store_tile(ut + i_h * V, dot(b_A, y, TDT, PREC), t0, eos, H * V, vb, V, C, BV)


@triton.jit
def _state_program(cu, coff, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BKF: tl.constexpr, BV: tl.constexpr):
    """A chunk-state program on grid (N, H, NV): its (sequence, head) row i_nh, head i_h and value block i_v, the
    sequence [bos, eos) of NTn chunks from chunk c0, the mask of its [BKF, BV] tile of Sᵀ and the tile's offsets
    in one head's initial or final state [V, K] (S[v, k] at v * K + k; the head's at i_nh * V * K) and in a
    per-chunk state [dk, dv]. (The head offset kept apart from the tile's: folded in, it cost 6 registers.)"""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    o_k = tl.arange(0, BKF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_end = o_v[None, :] * K + o_k[:, None]
    p_h = o_k[:, None] * V + o_v[None, :]
    return i_n * H + i_h, i_h, i_v, bos, eos, c0, tl.cdiv(eos - bos, C), m_s, p_end, p_h


@triton.jit
def _fwd_h_kernel(
    kw, beta, Gc, wt, ut, h, vnew, s0, sT, cu, coff,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Sequential over a sequence's chunks: stores each chunk's start state (transposed) and the
    pseudo-values U = U~ - W~ S^T, then S' = γ_C S + W^T diag(D) U (W = β K: ``kw`` is k and β is
    applied here; else ``kw`` holds W). State held as S^T [dk, dv]."""
    i_nh, i_h, i_v, bos, eos, c0, NTn, m_s, p_end, p_h = _state_program(cu, coff, H, K, V, C, BKF, BV)
    FULL: tl.constexpr = K == BKF and V % BV == 0  # tiles need no mask
    b_s = tl.zeros([BKF, BV], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + i_nh * V * K + p_end, mask=m_s, other=0).to(tl.float32)
    hb = h + (c0 * H + i_h) * K * V
    for j in range(0, NTn):
        t0 = bos + j * C
        if FULL:
            tl.store(hb + j * (H * K * V) + p_h, b_s.to(h.dtype.element_ty))
        else:
            tl.store(hb + j * (H * K * V) + p_h, b_s.to(h.dtype.element_ty), mask=m_s)
        b_wt = load_raw(wt + i_h * K, t0, eos, H * K, 0, K, C, BKF)
        b_u = load_tile(ut + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV) - dot(b_wt, b_s, DT, PREC)
        _store_tile(vnew + i_h * V, b_u, t0, eos, H * V, i_v * BV, V, C, BV)
        b_f = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
        if HAS_G:
            b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
            b_f = b_f * tl.exp(g_last - b_G)
            b_s = b_s * tl.exp(g_last)
        b_kT = tl.trans(load_raw(kw + (i_h // (H // HK)) * K, t0, eos, HK * K, 0, K, C, BKF))
        b_s = dot_acc(b_kT, b_u * b_f[:, None], b_s, DT, PREC)
    if STORE_S:
        tl.store(sT + i_nh * V * K + p_end, b_s, mask=m_s)


@triton.jit
def _fwd_o_kernel(
    q, kw, beta, Gc, h, vnew, o, chunks, cu, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """O = scale (diag(γ) Q S^T + tril(E ⊙ Q W^T) U) for one chunk and one block of dv (W = β K, or
    the given write keys in ``kw``)."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    NV: tl.constexpr = (V + BV - 1) // BV
    i_c, i_v, i_h = parallel_ids(NV, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    o_c = tl.arange(0, C)
    b_o = tl.zeros([C, BV], dtype=tl.float32)
    b_p = tl.zeros([C, C], dtype=tl.float32)
    hb = h + (i_c.to(tl.int64) * H + i_h) * K * V
    for kb in range(0, K, BK):
        b_q = load_raw(q + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_k = load_raw(kw + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_h = load_raw(hb + kb * V, 0, K - kb, V, i_v * BV, V, BK, BV)
        b_o = dot_acc(b_q, b_h, b_o, DT, PREC)
        b_p = dot_acc(b_q, tl.trans(b_k), b_p, DT, PREC)
    tril = o_c[:, None] >= o_c[None, :]
    b_b = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
    if HAS_G:
        b_G, _ = gate(Gc, i_h, t0, eos, H, C)
        b_o = b_o * tl.exp(b_G)[:, None]
        b_p = tl.where(tril, b_p * tl.exp(tl.where(tril, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    else:
        b_p = tl.where(tril, b_p, 0.0)
    b_u = load_raw(vnew + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV)
    b_o = dot_acc(b_p * b_b[None, :], b_u, b_o, DT, PREC) * scale
    _store_tile(o + i_h * V, b_o, t0, eos, H * V, i_v * BV, V, C, BV)


@triton.jit
def _fwd_mix_kernel(
    q, kw, beta, Gc, A, M, Y, chunks, cu,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """What ``_fwd_walk`` needs of a chunk beside its start state, all of it parallel over chunks:
    M = tril(E ⊙ Q W^T) A (outputs O = diag(γ) Q S^T + M X) and Y = A^T diag(D) W (S' = γ_C S + Y^T X), where
    X = V - Γ K S^T is what the walk computes from the state (W = β K: ``kw`` is k, β applied here; else the
    given write keys)."""
    i_c, _, i_h = parallel_ids(1, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    i_hk = i_h // (H // HK)
    o_c = tl.arange(0, C)
    tril = o_c[:, None] >= o_c[None, :]
    b_p = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(0, K, BK):
        b_q = load_raw(q + i_hk * K, t0, eos, HK * K, kb, K, C, BK)
        b_kw = load_raw(kw + i_hk * K, t0, eos, HK * K, kb, K, C, BK)
        b_p = dot_acc(b_q, tl.trans(b_kw), b_p, DT, PREC)
    b_f = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
    if HAS_G:
        b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
        b_p = tl.where(tril, b_p * tl.exp(tl.where(tril, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        b_d = b_f * tl.exp(g_last - b_G)
    else:
        b_p = tl.where(tril, b_p, 0.0)
        b_d = b_f
    b_A = load_tile(A + i_h * C, t0, eos, H * C, 0, C, C, C)
    _store_tile(M + i_h * C, _dotf(b_p * b_f[None, :], b_A, PREC), t0, eos, H * C, 0, C, C, C)
    b_At = tl.trans(b_A) * b_d[None, :]  # A^T diag(D β), a loaded tile's transpose
    for kb in range(0, K, BK):
        b_kw = load_tile(kw + i_hk * K, t0, eos, HK * K, kb, K, C, BK)
        _store_tile(Y + i_h * K, _dotf(b_At, b_kw, PREC), t0, eos, H * K, kb, K, C, BK)


@triton.jit
def _fwd_walk_kernel(
    q, k, v, Gc, M, Y, o, s0, sT, cu, coff, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """The forward without autograd after ``_fwd_mix``: per chunk X = V - Γ K S^T, O = scale (diag(γ) Q S^T + M X),
    S' = γ_C S + Y^T X; four products a chunk, and only O and the final state leave the chip."""
    scale = tl.cast(scale, tl.float32)
    i_nh, i_h, i_v, bos, eos, _, NTn, m_s, p_end, _ = _state_program(cu, coff, H, K, V, C, BKF, BV)
    i_hk = i_h // (H // HK)
    b_s = tl.zeros([BKF, BV], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + i_nh * V * K + p_end, mask=m_s, other=0).to(tl.float32)
    for j in range(0, NTn):
        t0 = bos + j * C
        b_k = load_raw(k + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
        b_q = load_raw(q + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
        b_ks = dot(b_k, b_s, DT, PREC)
        b_o = dot(b_q, b_s, DT, PREC)
        if HAS_G:
            b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
            e_G = tl.exp(b_G)[:, None]
            b_ks = b_ks * e_G
            b_o = b_o * e_G
            b_s = b_s * tl.exp(g_last)
        b_x = (load_tile(v + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV) - b_ks).to(DT)
        b_m = load_raw(M + i_h * C, t0, eos, H * C, 0, C, C, C)
        b_o = dot_acc(b_m, b_x, b_o, DT, PREC) * scale
        _store_tile(o + i_h * V, b_o, t0, eos, H * V, i_v * BV, V, C, BV)
        b_yT = tl.trans(load_raw(Y + i_h * K, t0, eos, H * K, 0, K, C, BKF))
        b_s = dot_acc(b_yT, b_x, b_s, DT, PREC)
    if STORE_S:
        tl.store(sT + i_nh * V * K + p_end, b_s, mask=m_s)


# ============================================================================ backward kernels
@triton.jit
def _bwd_dv_local_kernel(
    q, kw, beta, Gc, do, du, chunks, cu, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """dU (local part) = P^T dO, P^T[i, t] = scale [i <= t] E[t, i] (w_i . q_t), computed as its own
    product (never as the transpose of one)."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    NV: tl.constexpr = (V + BV - 1) // BV
    i_c, i_v, i_h = parallel_ids(NV, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    o_c = tl.arange(0, C)
    b_pt = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(0, K, BK):
        b_k = load_raw(kw + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_q = load_raw(q + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_pt = dot_acc(b_k, tl.trans(b_q), b_pt, DT, PREC)
    triu = o_c[:, None] <= o_c[None, :]
    b_f = load_factor(beta + i_h, t0, eos, H, C, HAS_W) * scale
    if HAS_G:
        b_G, _ = gate(Gc, i_h, t0, eos, H, C)
        b_pt = tl.where(triu, b_pt * tl.exp(tl.where(triu, b_G[None, :] - b_G[:, None], 0.0)), 0.0)
    else:
        b_pt = tl.where(triu, b_pt, 0.0)
    b_do = load_raw(do + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV)
    _store_tile(du + i_h * V, dot(b_pt * b_f[:, None], b_do, DT, PREC), t0, eos, H * V, i_v * BV, V, C, BV)


@triton.jit
def _bwd_dhu_kernel(
    q, kw, beta, Gc, wt, do, du, dh, dsT, ds0, cu, coff, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, USE_DST: tl.constexpr, STORE_DS0: tl.constexpr,
    LOCAL_DU: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse over a sequence's chunks: stores each chunk's end-state gradient dS' (transposed) and
    dU = P^T dO + diag(D) W dS'^T; dS = γ_C dS' + scale dO^T diag(γ) Q - dU^T W~. Held as dS^T. P^T dO is read from
    ``du`` (``_bwd_dv_local``'s), or with LOCAL_DU formed here from the chunk's k, q and dO tiles the walk loads
    anyway (two more products a chunk, one kernel and a round trip of dU less)."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_nh, i_h, i_v, bos, eos, c0, NTn, m_s, p_end, p_h = _state_program(cu, coff, H, K, V, C, BKF, BV)
    FULL: tl.constexpr = K == BKF and V % BV == 0  # tiles need no mask
    b_ds = tl.zeros([BKF, BV], dtype=tl.float32)
    if USE_DST:
        b_ds += tl.load(dsT + i_nh * V * K + p_end, mask=m_s, other=0).to(tl.float32)
    dhb = dh + (c0 * H + i_h) * K * V
    o_c = tl.arange(0, C)
    triu = o_c[:, None] <= o_c[None, :]
    for jj in range(0, NTn):
        j = NTn - 1 - jj
        t0 = bos + j * C
        if FULL:
            tl.store(dhb + j * (H * K * V) + p_h, b_ds.to(dh.dtype.element_ty))
        else:
            tl.store(dhb + j * (H * K * V) + p_h, b_ds.to(dh.dtype.element_ty), mask=m_s)
        b_b = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
        b_f = b_b
        b_fq = tl.full([C], 1.0, tl.float32) * scale
        if HAS_G:
            b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
            b_f = b_f * tl.exp(g_last - b_G)
            b_fq = b_fq * tl.exp(b_G)
        b_k = load_raw(kw + (i_h // (H // HK)) * K, t0, eos, HK * K, 0, K, C, BKF)
        if LOCAL_DU:  # P^T dO, P^T[i, t] = scale [i <= t] E[t, i] β_i (k_i . q_t), as ``_bwd_dv_local``
            b_q = load_raw(q + (i_h // (H // HK)) * K, t0, eos, HK * K, 0, K, C, BKF)
            b_do = load_raw(do + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV)
            b_pt = dot(b_k, tl.trans(b_q), DT, PREC)
            if HAS_G:
                b_pt = tl.where(triu, b_pt * tl.exp(tl.where(triu, b_G[None, :] - b_G[:, None], 0.0)), 0.0)
            else:
                b_pt = tl.where(triu, b_pt, 0.0)
            # the local part first: this order spills 212 bytes on sm_90 at 128-wide dv blocks, the other 520
            b_du = dot(b_pt * (b_b * scale)[:, None], b_do, DT, PREC) + dot(b_k, b_ds, DT, PREC) * b_f[:, None]
            _store_tile(du + i_h * V, b_du, t0, eos, H * V, i_v * BV, V, C, BV)
            b_do = b_do.to(tl.float32) * b_fq[:, None]
            b_qT = tl.trans(b_q)
        else:
            b_du = load_tile(du + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV) \
                + dot(b_k, b_ds, DT, PREC) * b_f[:, None]
            _store_tile(du + i_h * V, b_du, t0, eos, H * V, i_v * BV, V, C, BV)
            b_do = load_tile(do + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV) * b_fq[:, None]
            b_qT = tl.trans(load_raw(q + (i_h // (H // HK)) * K, t0, eos, HK * K, 0, K, C, BKF))
        b_wtT = tl.trans(load_raw(wt + i_h * K, t0, eos, H * K, 0, K, C, BKF))
        if HAS_G:
            b_ds = b_ds * tl.exp(g_last)
        b_ds = dot_acc(b_qT, b_do, b_ds, DT, PREC)
        b_ds = dot_acc(b_wtT, -b_du, b_ds, DT, PREC)
    if STORE_DS0:
        tl.store(ds0 + i_nh * V * K + p_end, b_ds, mask=m_s)


@triton.jit
def _bwd_dqkw_kernel(
    q, kw, beta, Gc, h, dh, vnew, do, du, dq, dw, dwt, dgp, rq, chunks, cu, scale, TT,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_W: tl.constexpr, NORM_Q: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """For one chunk and one block of dk: dq; the part of dW from the output and the state update;
    dW~ = -dU S; and this block's share of dG (written to dgp[i_k]). With NORM_Q (all of dk in the block, one value
    head a key head) q is the L2-normalised query and ``rq`` its rows' 1/sqrt(|x|² + 1e-6): dq is taken back through
    the norm here, dq_x = rstd (dq - q (q · dq)), rounded once."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    NK: tl.constexpr = (K + BK - 1) // BK
    i_c, i_k, i_h = parallel_ids(NK, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    kb = i_k * BK
    o_c = tl.arange(0, C)
    hb = h + (i_c.to(tl.int64) * H + i_h) * K * V + kb * V
    dhb = dh + (i_c.to(tl.int64) * H + i_h) * K * V + kb * V
    b_dp = tl.zeros([C, C], dtype=tl.float32)  # dP[t, i] = dO_t . u_i
    b_dpt = tl.zeros([C, C], dtype=tl.float32)  # its transpose, computed as its own product
    b_dos = tl.zeros([C, BK], dtype=tl.float32)  # dO S
    b_uds = tl.zeros([C, BK], dtype=tl.float32)  # U dS'
    b_dwt = tl.zeros([C, BK], dtype=tl.float32)  # dU S (negated below)
    b_dgl = tl.zeros([BK], dtype=tl.float32)  # sum(S ⊙ dS') over this block's rows of S^T
    for vb in range(0, V, BV):
        b_do = load_raw(do + i_h * V, t0, eos, H * V, vb, V, C, BV)
        b_u = load_raw(vnew + i_h * V, t0, eos, H * V, vb, V, C, BV)
        b_du = load_raw(du + i_h * V, t0, eos, H * V, vb, V, C, BV)
        b_sT = load_raw(hb, 0, K - kb, V, vb, V, BK, BV)  # S^T [BK, BV]
        b_dsT = load_raw(dhb, 0, K - kb, V, vb, V, BK, BV)
        b_dp = dot_acc(b_do, tl.trans(b_u), b_dp, DT, PREC)
        b_dpt = dot_acc(b_u, tl.trans(b_do), b_dpt, DT, PREC)
        b_dos = dot_acc(b_do, tl.trans(b_sT), b_dos, DT, PREC)
        b_uds = dot_acc(b_u, tl.trans(b_dsT), b_uds, DT, PREC)
        b_dwt = dot_acc(b_du, tl.trans(b_sT), b_dwt, DT, PREC)
        if HAS_G:
            b_dgl += tl.sum(b_sT.to(tl.float32) * b_dsT.to(tl.float32), 1)
    b_q = load_raw(q + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
    b_k = load_raw(kw + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)  # (β applied below) write key
    b_b = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
    tril = o_c[:, None] >= o_c[None, :]
    triu = o_c[:, None] <= o_c[None, :]
    if HAS_G:
        b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
        gam = tl.exp(b_G)
        last = tl.minimum(t0 + C, eos) - 1
        b_m = tl.where(tril, b_dp * tl.exp(tl.where(tril, b_G[:, None] - b_G[None, :], 0.0)), 0.0) * scale
        b_mt = tl.where(triu, b_dpt * tl.exp(tl.where(triu, b_G[None, :] - b_G[:, None], 0.0)), 0.0) * scale
        b_dqi = dot(b_m * b_b[None, :], b_k, DT, PREC)  # through P's query side
        b_dwi = dot(b_mt, b_q, DT, PREC)  # through P's key side
        b_dos = b_dos * (gam * scale)[:, None]
        b_dq = b_dos + b_dqi
        b_d = tl.exp(g_last - b_G)
        b_uds = b_uds * b_d[:, None]
        b_dw = b_dwi + b_uds
        # dG: Γ in the inter-chunk output, E in P (sum_i dP_ti P_ti = q_t . b_dqi_t and
        # sum_t dP_ti P_ti = β_i k_i . b_dwi_i), D and γ_C in the state update
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        b_dg = tl.sum(b_qf * b_dq, 1) - b_b * tl.sum(b_kf * b_dwi, 1)
        b_x = b_b * tl.sum(b_kf * b_uds, 1)
        b_dg -= b_x
        dg_last = tl.sum(b_x, 0) + tl.exp(g_last) * tl.sum(b_dgl, 0)
        b_dg += tl.where(t0 + o_c == last, dg_last, 0.0)
        tl.store(dgp + i_k * TT * H + (t0 + o_c) * H + i_h, b_dg, mask=o_c < eos - t0)
    else:
        b_m = tl.where(tril, b_dp, 0.0) * scale
        b_mt = tl.where(triu, b_dpt, 0.0) * scale
        b_dq = dot_acc(b_m * b_b[None, :], b_k, b_dos * scale, DT, PREC)
        b_dw = dot_acc(b_mt, b_q, b_uds, DT, PREC)
    _store_tile(dw + i_h * K, b_dw, t0, eos, H * K, kb, K, C, BK)
    _store_tile(dwt + i_h * K, -b_dwt, t0, eos, H * K, kb, K, C, BK)
    if NORM_Q:  # last, with fewer tiles live; q read again (from L2): kept from above it spilled 96 bytes on sm_90
        b_qn = load_tile(q + i_h * K, t0, eos, H * K, kb, K, C, BK)
        b_dq = (b_dq - b_qn * tl.sum(b_qn * b_dq, 1)[:, None]) * load_vec(rq + i_h, t0, eos, H, C)[:, None]
    _store_tile(dq + i_h * K, b_dq, t0, eos, H * K, kb, K, C, BK)


@triton.jit
def _bwd_wy_kernel(
    k, w, v, beta, Gc, A, du, dw, dwt, dgp, dk, dv, dbeta, dg, rk, chunks, cu, TT,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, HAS_G: tl.constexpr, HAS_W: tl.constexpr, NORM_K: tl.constexpr, DT: tl.constexpr,
    TDT: tl.constexpr, PREC: tl.constexpr,
):
    """Back through W~ = A Γ K, U~ = A V and A = (I + L)^{-1}: dv, dk, dβ (or, for given write keys,
    the full dW into ``dbeta``) and (gated) dg. dA and dA^T are each accumulated as their own products
    of loaded tiles. With NORM_K (one value head a key head) k is the L2-normalised key and ``rk`` its rows'
    1/sqrt(|x|² + 1e-6): dk is taken back through the norm here, in a second pass over the blocks it stored."""
    i_c, _, i_h = parallel_ids(1, H)
    t0, eos = chunk_info(chunks, cu, i_c)
    o_c = tl.arange(0, C)
    b_A = load_tile(A + i_h * C, t0, eos, H * C, 0, C, C, C)  # [t, i]
    b_At = tl.trans(b_A)  # a loaded tile
    b_b = load_factor(beta + i_h, t0, eos, H, C, HAS_W)
    # dA = dW~ (Γ K)^T + dU V^T and dA^T = (Γ K) dW~^T + V dU^T, each as its own products
    b_da = tl.zeros([C, C], dtype=tl.float32)
    b_dat = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(0, K, BK):
        b_k = load_raw(k + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_dwt = load_raw(dwt + i_h * K, t0, eos, H * K, kb, K, C, BK)
        b_da = dot_acc(b_dwt, tl.trans(b_k), b_da, DT, PREC)
        b_dat = dot_acc(b_k, tl.trans(b_dwt), b_dat, DT, PREC)
    strict_l = o_c[:, None] > o_c[None, :]
    strict_u = o_c[:, None] < o_c[None, :]
    if HAS_G:
        b_G, _ = gate(Gc, i_h, t0, eos, H, C)
        gam = tl.exp(b_G)
        b_da = b_da * gam[None, :]
        b_dat = b_dat * gam[:, None]
    for vb in range(0, V, BV):
        b_du = load_raw(du + i_h * V, t0, eos, H * V, vb, V, C, BV)
        b_v = load_raw(v + i_h * V, t0, eos, H * V, vb, V, C, BV)
        b_da = dot_acc(b_du, tl.trans(b_v), b_da, DT, PREC)
        b_dat = dot_acc(b_v, tl.trans(b_du), b_dat, DT, PREC)
        _store_tile(dv + i_h * V, dot(b_At, b_du, TDT, PREC), t0, eos, H * V, vb, V, C, BV)
    b_da = tl.where(strict_l, b_da, 0.0)
    b_dat = tl.where(strict_u, b_dat, 0.0)
    # dL = -A^T dA A^T (strictly lower); its transpose -A dA^T A computed on its own
    b_dl = tl.where(strict_l, -dot(b_At, dot(b_da, b_At, TDT, PREC), TDT, PREC), 0.0)
    b_dlt = tl.where(strict_u, -dot(b_A, dot(b_dat, b_A, TDT, PREC), TDT, PREC), 0.0)
    if HAS_G:
        b_dl = b_dl * tl.exp(tl.where(strict_l, b_G[:, None] - b_G[None, :], 0.0))
        b_dlt = b_dlt * tl.exp(tl.where(strict_u, b_G[None, :] - b_G[:, None], 0.0))
        b_dg = tl.zeros([C], dtype=tl.float32)
        for i_k in range(0, NK):
            b_dg += load_vec(dgp + i_k * TT * H + i_h, t0, eos, H, C)
        b_At = b_At * gam[:, None]  # d(Γ K) = A^T dW~, then Γ: diag(γ) A^T
    b_dl = b_dl * b_b[None, :]
    b_db = tl.zeros([C], dtype=tl.float32)
    b_kdk = tl.zeros([C], dtype=tl.float32)  # k · dk, for the norm's backward
    for kb in range(0, K, BK):
        b_k = load_raw(k + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK)
        b_kf = b_k.to(tl.float32)
        b_dwt = load_raw(dwt + i_h * K, t0, eos, H * K, kb, K, C, BK)
        b_dkg = dot(b_At, b_dwt, TDT, PREC)  # γ ⊙ (A^T dW~)
        b_dwl = dot(b_dlt, b_k, DT, PREC)  # (E ⊙ dL)^T K: through the write key of L
        b_dw = b_dwl + load_tile(dw + i_h * K, t0, eos, H * K, kb, K, C, BK)
        # β in b_dl and b_b
        b_w = load_raw(w + (i_h // (H // HK)) * K, t0, eos, HK * K, kb, K, C, BK) if HAS_W else b_k
        b_dkl = dot(b_dl, b_w, DT, PREC)  # (E ⊙ dL) W: through the read key of L
        if HAS_G:
            # Γ K, and E in L: sum_i dL_ti L_ti = k_t . b_dkl_t,  sum_t dL_ti L_ti = w_i . b_dwl_i
            b_dg += tl.sum(b_kf * (b_dkg + b_dkl) - b_w.to(tl.float32) * b_b[:, None] * b_dwl, 1)
        if HAS_W:
            b_dk = b_dkl + b_dkg
            _store_tile(dbeta + i_h * K, b_dw, t0, eos, H * K, kb, K, C, BK)
        else:
            b_dk = b_dkl + b_dw * b_b[:, None] + b_dkg
            b_db += tl.sum(b_dw * b_kf, 1)
        if NORM_K:
            b_kdk += tl.sum(b_kf * b_dk, 1)
        _store_tile(dk + i_h * K, b_dk, t0, eos, H * K, kb, K, C, BK)
    if NORM_K:  # dk_x = rstd (dk - k (k · dk)), over the blocks just stored (visible to the block after a barrier)
        tl.debug_barrier()
        b_rk = load_vec(rk + i_h, t0, eos, H, C)
        for kb in range(0, K, BK):
            b_kf = load_tile(k + i_h * K, t0, eos, H * K, kb, K, C, BK)
            b_dk = load_tile(dk + i_h * K, t0, eos, H * K, kb, K, C, BK)
            _store_tile(dk + i_h * K, (b_dk - b_kf * b_kdk[:, None]) * b_rk[:, None], t0, eos, H * K, kb, K, C, BK)
    if not HAS_W:
        tl.store(dbeta + (t0 + o_c) * H + i_h, b_db, mask=o_c < eos - t0)
    if HAS_G:
        # g_t feeds G_s for every s >= t of its chunk: reverse cumulative sum
        b_dg = tl.sum(tl.where(o_c[None, :] >= o_c[:, None], b_dg[None, :], 0.0), 1)
        tl.store(dg + (t0 + o_c) * H + i_h, b_dg, mask=o_c < eos - t0)


# ============================================================================ fused recurrent (decode)
@triton.jit
def _fused_recurrent_kernel(
    q, k, v, beta, g, s0, o, sT, cu, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr, L2NORM: tl.constexpr,
    HAS_W: tl.constexpr,
):
    """Token by token against a state S [BV, dk] in registers (decoding: one or a few tokens). With
    HAS_W, ``beta`` holds the write keys w ``[TT, H, dk]`` (the generalised rule)."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BKF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    p_s = (i_n * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :]
    b_s = tl.zeros([BV, BKF], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + p_s, mask=m_s, other=0).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + t * HK * K + (i_h // (H // HK)) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + t * HK * K + (i_h // (H // HK)) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + t * H * V + i_h * V + o_v, mask=m_v, other=0).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        if HAS_G:
            b_s = b_s * tl.exp(tl.load(g + t * H + i_h).to(tl.float32))
        b_u = b_v - tl.sum(b_s * b_k[None, :], 1)
        if HAS_W:
            b_w = tl.load(beta + t * H * K + i_h * K + o_k, mask=m_k, other=0).to(tl.float32)
        else:
            b_w = b_k * tl.load(beta + t * H + i_h).to(tl.float32)
        b_s += b_u[:, None] * b_w[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1) * scale
        tl.store(o + t * H * V + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_S:
        tl.store(sT + p_s, b_s, mask=m_s)


# ============================================================================ L2 normalisation
@triton.jit
def _l2norm_rows_fwd(x, y, rstd, blk, NR, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    r = blk * BR + tl.arange(0, BR)
    c = tl.arange(0, BD)
    m = (r < NR)[:, None] & (c < D)[None, :]
    p = r.to(tl.int64)[:, None] * D + c[None, :]
    b_x = tl.load(x + p, mask=m, other=0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + r, b_r, mask=r < NR)


@triton.jit
def _l2norm_rows_bwd(y, rstd, dy, dx, blk, NR, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                     G: tl.constexpr, NORM: tl.constexpr):
    """dx of rows ``blk``: dy summed over its G partials (row r's at ``dy[r, 0..G)``, ``[NR, G, D]``; G = 1: dy
    itself) in float32, then with NORM back through the L2 norm (y, rstd its output and 1/sqrt(.)), else the sum."""
    r = blk * BR + tl.arange(0, BR)
    c = tl.arange(0, BD)
    m = (r < NR)[:, None] & (c < D)[None, :]
    p = r.to(tl.int64)[:, None] * D + c[None, :]
    b_dy = tl.zeros([BR, BD], dtype=tl.float32)
    for i in tl.static_range(G):
        b_dy += tl.load(dy + (r.to(tl.int64)[:, None] * G + i) * D + c[None, :], mask=m, other=0).to(tl.float32)
    if NORM:
        b_y = tl.load(y + p, mask=m, other=0).to(tl.float32)
        b_r = tl.load(rstd + r, mask=r < NR, other=0)
        b_dy = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + p, b_dy.to(dx.dtype.element_ty), mask=m)


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, NR, x2, y2, rstd2, NR2, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                       PAIR: tl.constexpr):
    """y = x / sqrt(|x|^2 + 1e-6) over rows of length D (the ops' ``l2norm``); keeps 1/sqrt(.). With ``PAIR`` the
    programs past x's rows normalise x2 (q and k in one launch)."""
    blk = tl.program_id(0)
    nb = tl.cdiv(NR, BR)
    if PAIR and blk >= nb:
        _l2norm_rows_fwd(x2, y2, rstd2, blk - nb, NR2, D, BD, BR)
    else:
        _l2norm_rows_fwd(x, y, rstd, blk, NR, D, BD, BR)


@triton.jit
def _l2norm_bwd_kernel(y, rstd, dy, dx, NR, y2, rstd2, dy2, dx2, NR2, D: tl.constexpr, BD: tl.constexpr,
                       BR: tl.constexpr, PAIR: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr):
    """dx = (dy - y (y . dy)) / sqrt(|x|^2 + 1e-6) (and the same for the second tensor with ``PAIR``), dy first
    summed over its G partials (grouped value heads); without NORM the sums alone."""
    blk = tl.program_id(0)
    nb = tl.cdiv(NR, BR)
    if PAIR and blk >= nb:
        _l2norm_rows_bwd(y2, rstd2, dy2, dx2, blk - nb, NR2, D, BD, BR, G, NORM)
    else:
        _l2norm_rows_bwd(y, rstd, dy, dx, blk, NR, D, BD, BR, G, NORM)


# ============================================================================ host side
class _Seqs:
    """Sequence and chunk tables for a flattened token axis (uniform B x T, or packed cu_seqlens)."""

    def __init__(self, B: int, T: int, cu_seqlens, C: int, device):
        if cu_seqlens is None:
            nts = triton.cdiv(T, C)
            self.N, self.NT = B, B * nts
            i = torch.arange(self.NT, device=device, dtype=torch.int64)
            seq = i // nts
            self.cu = (torch.arange(B + 1, device=device, dtype=torch.int64) * T).to(torch.int32)
            self.coff = (torch.arange(B + 1, device=device, dtype=torch.int64) * nts).to(torch.int32)
            start = seq * T + (i % nts) * C
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.int64)
            self.N = cu.numel() - 1
            lens = cu[1:] - cu[:-1]
            nts = (lens + C - 1) // C
            coff = torch.cat([nts.new_zeros(1), nts.cumsum(0)])
            self.NT = int(coff[-1].item())
            seq = torch.repeat_interleave(torch.arange(self.N, device=device), nts)
            i = torch.arange(self.NT, device=device, dtype=torch.int64)
            start = cu[seq] + (i - coff[seq]) * C
            self.cu, self.coff = cu.to(torch.int32), coff.to(torch.int32)
        self.chunks = torch.stack([seq, start], 1).to(torch.int32).contiguous()


#: chunk tables of uniform batches by (B, T, C, device) (``cached_uniform``)
_UNIFORM_SEQS: dict = {}


def seqs_for(B: int, T: int, cu_seqlens, C: int, device) -> _Seqs:
    """The chunk table of this batch: built once per uniform shape, and once per ``cu_seqlens`` tensor (every layer
    of a model is handed the same one; the split's plan is kept on the table)."""
    if cu_seqlens is not None:
        return cached_on(cu_seqlens, ("delta_seqs", C, str(device)), lambda: _Seqs(B, T, cu_seqlens, C, device))
    return cached_uniform(_UNIFORM_SEQS, (B, T, C, device), device, lambda: _Seqs(B, T, None, C, device))


def _blocks(K: int, V: int, interpret: bool):
    BKF = next_pow2(K)
    BK = BKF if interpret else min(64, BKF)
    BV = next_pow2(V) if interpret else min(64, next_pow2(V))
    return BKF, BK, BV


#: programs a multiprocessor the sequential kernels' dv block aims at (``_launch.fill_device``): at 0.5, T = 8k
#: (B = 4, H = 16) runs 64-wide dv blocks, not 16-wide ones that read every chunk's keys 8 times a head. H200, bf16,
#: fwd + bwd at 1k / 8k / 32k in one run: delta rule 2.94 / 3.58 / 3.71 ms at 2, 2.93 / 2.92 / 3.71 at 0.5
SEQ_PROGRAMS_PER_SM = 0.5


def _seq_bv(K: int, V: int, parallel: int, device, interpret: bool, fp32: bool = False) -> int:
    """dv block of the sequential kernels: small enough to keep S^T in registers and to give the
    GPU enough programs when there are few sequences x heads."""
    if interpret:
        return next_pow2(V)
    BKF = next_pow2(K)
    bv = min(32 if fp32 else 64, next_pow2(V), max(16, 8192 // BKF))
    return fill_device(bv, V, parallel, device, per_sm=SEQ_PROGRAMS_PER_SM)


#: programs a multiprocessor the prefill walk's dv block aims at. H200, bf16, gated rule without autograd, 4 warps,
#: 3 stages: at 32k tokens in one sequence (16 heads) dv blocks of 32 ran 1.49 ms against 1.66 at 16 (2 stages) and
#: 1.77 at 64; at 1k and 8k (512 and 64 sequences x heads) blocks of 64 were fastest (1.04 / 0.99 against 1.28 / 1.11
#: at 32). 3 stages against 2 at blocks of 64: 1.04 / 0.99 / 1.77 against 1.11 / 1.09 / 1.93 ms.
WALK_PROGRAMS_PER_SM = 0.4
#: the prefill walk holds a chunk's q, k and Y rows whole: at dk = 256 its tiles outgrow a Hopper block's shared
#: memory (233 732 bytes at dv blocks of 32), so wider keys take the four training kernels without autograd too
WALK_MAX_HEAD_DIM = 128


def _walk_bv(V: int, parallel: int, device, interpret: bool, fp32: bool) -> int:
    """dv block of ``_fwd_walk``: 64 (32 for fp32 tiles) unless that leaves the GPU short of programs."""
    if interpret:
        return next_pow2(V)
    return fill_device(min(32 if fp32 else 64, next_pow2(V)), V, parallel, device, per_sm=WALK_PROGRAMS_PER_SM)


#: launch options per kernel on the GPU (fixed, no autotuning: device time is scarce and the
#: interpreter cannot autotune). "BV" for the sequential kernels overrides the dv block heuristic, for "o" and
#: "dv_local" the dv block (default 64), "BK" for "dqkw" the dk block (default: all of dk up to 128 in one program).
#: Measured on an H100 with Triton 3.6 (T = 32k, one sequence): num_stages=3 is the fastest for the
#: sequential kernels; num_stages=1 made ``_bwd_dhu_kernel`` fault (illegal address): never use 1.
#: Each kernel alone on an H200 (bf16, D = 128, T = 8k, B = 4; "dhu" at 8 warps, "o" and "dv_local" at 2
#: stages): _bwd_dhu 0.451 -> 0.361 ms (0.428 -> 0.424 at 1k), _fwd_o 0.244 -> 0.227, _bwd_dv_local 0.176 -> 0.164.
#: fp32 inputs take ``FP32_CONFIGS`` over these: _bwd_dhu at 8 warps gave fp32 dk 74 % off on an H100 (Triton 3.6;
#: 16-bit inputs pass the same tests there).
#: "solve" at 1 warp: its row-by-row substitutions reduce across the tile, and fewer warps sync less (H200, bf16,
#: gated, fwd at T = 8k: 1.19 ms at 1 warp, 1.28 at 2, 1.51 at 4; with the four diagonal blocks in one substitution,
#: fwd at T = 1k 0.96 ms at 1 warp, 1.17 at 2, 1.53 at 4).
CONFIGS = {
    "solve": {"num_warps": 1},
    "wu": {"num_warps": 4, "num_stages": 2},
    "h": {"num_warps": 4, "num_stages": 3},
    "o": {"num_warps": 4, "num_stages": 2},
    "mix": {"num_warps": 4, "num_stages": 2},
    "walk": {"num_warps": 4, "num_stages": 3},
    "dv_local": {"num_warps": 4, "num_stages": 2},
    "dhu": {"num_warps": 8, "num_stages": 3},
    "dqkw": {"num_warps": 8},
    "wy": {"num_warps": 4},
    "recurrent": {"num_warps": 2},
    "l2norm": {"num_warps": 4},
}
FP32_CONFIGS = {"dhu": {"num_warps": 4, "num_stages": 2}}
#: stages of ``_fwd_h`` when its programs outnumber the SMs: at 2 stages its shared memory lets two programs share an
#: SM, which pays once there is a second wave; with one wave the deeper pipeline wins (H200, bf16, gated, fwd + bwd,
#: 3 -> 2 stages: T = 1k B = 32 (1024 programs) 3.57 -> 3.50 ms, 8k HV = 2H (256) 6.80 -> 6.59; but 8k HV = H (128)
#: 3.55 -> 3.60 and 32k B = 1 4.46 -> 4.75)
H_STAGES_MANY_PROGRAMS = 2
#: ``_bwd_dhu``'s launch once 64-wide dv blocks would outnumber the SMs (16-bit inputs, dk <= 128): one 128-wide block
#: at 8 warps and 2 stages (3 ask 279 560 bytes of shared memory). H200, bf16, gated, fwd + bwd, each option alone
#: against the defaults in one process: T = 1k B = 32 (1,024 -> 512 programs) 3.46 -> 3.39 ms, 8k HV = 2H (256 ->
#: 128) 6.49 -> 6.36. None: the dv block heuristic alone
DHU_WIDE_DV = {"BV": 128, "num_warps": 8, "num_stages": 2}


#: the training kernels' triangular products (W~ = A Γ K, U~ = A V and the WY backward) take operands of the inputs'
#: 16-bit type, as fla's and FlashQLA's do, where tf32 was used before: H200, bf16, fwd + bwd 3.40 -> 3.09 ms at
#: T = 1k, 3.53 -> 3.23 at 8k, 4.46 -> 4.16 at 32k, 6.40 -> 5.84 at 8k with HV = 2H. A itself stays float32 (stored
#: in bf16 as well: fwd + bwd within 0.5 %, the forward 4 % slower)
TRIANGULAR_16BIT = True

#: dq and dk taken back through q's and k's L2 norms by ``_bwd_dqkw`` and ``_bwd_wy`` (one value head a key head)
#: instead of a pass of their own over both gradients (``qk_grads``). H200, bf16, gated, fwd + bwd with it against
#: without: T = 1k 3.086 -> 2.994 ms, 8k 3.221 -> 3.132, 32k 4.117 -> 4.030; dq rounded once instead of twice (errors
#: against float64 the same or lower)
NORM_BACKWARD_IN_KERNELS = True


#: ``_bwd_dhu`` forms the local part of dU (P^T dO) itself instead of reading ``_bwd_dv_local``'s: True, False, or
#: None for where it paid: one dv block a head (P^T formed once) and at least LOCAL_DU_MIN_PROGRAMS_PER_SM programs a
#: multiprocessor. H200, bf16, gated, fwd + bwd, forced on against off (norms' backward in the kernels both times):
#: T = 1k B = 32 (512 programs of 128-wide blocks) 2.994 -> 2.967 ms, 8k HV = 2H (128 such) 5.798 -> 5.698; but with
#: 64-wide blocks, 8k HV = H (128 programs, P^T formed twice a head) 3.132 -> 3.202 and 32k B = 1 (32) 4.030 -> 4.971:
#: the walk is the backward's sequential part, and with few programs its added products are not hidden. Measured for
#: the (gated) delta rule only: given write keys keep ``_bwd_dv_local``
LOCAL_DU_IN_WALK: bool | None = None
LOCAL_DU_MIN_PROGRAMS_PER_SM = 0.5


def _local_du_in_walk(programs: int, BV: int, V: int, device, interpret: bool, has_w: bool = False) -> bool:
    if LOCAL_DU_IN_WALK is not None:
        return LOCAL_DU_IN_WALK
    if has_w:
        return False
    return interpret or (BV >= V and programs >= LOCAL_DU_MIN_PROGRAMS_PER_SM * num_sms(device))


#: the training forward's state walk and outputs as one Hopper kernel (``delta_gluon``, Triton's Gluon dialect) in
#: place of ``_fwd_h`` and ``_fwd_o``: True, False, or None (the default) for where it is supported and the walk has at
#: least GLUON_WALK_MIN_PROGRAMS_PER_SM programs (sequence, value head, dv block of 64) a multiprocessor. With fewer, a
#: program's chunk step, which forms the outputs too, is the one sequential chain and the two Triton kernels are
#: faster. H200, bf16, gated, fwd + bwd, Triton walk -> Gluon walk: T = 1k B = 32 (1,024 programs) 2.98 -> 2.82 ms,
#: 8k B = 4 (128) 3.16 -> 2.97, 8k HV = 2H (256) 5.75 -> 5.65; 32k B = 1 (32) 4.08 -> 4.71
USE_GLUON_WALK: bool | None = None
GLUON_WALK_MIN_PROGRAMS_PER_SM = 0.75
#: whether the Gluon walk also serves the forward without autograd (after ``_fwd_wu``, storing neither chunk states
#: nor pseudo-values) in place of ``_fwd_mix`` and ``_fwd_walk``: off, as it was slower at every shape measured (H200,
#: bf16, gated: T = 1k B = 32 0.96 -> 1.05 ms, 8k B = 4 0.91 -> 1.63 at 32-wide dv blocks)
GLUON_WALK_IN_PREFILL = False
#: the backward's reverse walk as one Hopper kernel (``delta_gluon._bwd_walk_kernel``, forming Pᵀ dO itself) in place
#: of ``_bwd_dv_local`` and ``_bwd_dhu``: as USE_GLUON_WALK, on its own switch. H200, bf16, gated, fwd + bwd: T = 1k
#: B = 32 2.98 -> 2.88 ms, 8k B = 4 3.16 -> 2.91, 8k HV = 2H 5.75 -> 5.57; 32k B = 1 4.08 -> 4.41
USE_GLUON_BWD_WALK: bool | None = None
#: whether the walks run while torch.compile traces: off, since Dynamo does not trace a Gluon kernel (torch 2.11:
#: a graph break, "triton kernel unsupported feature"); a compiled model runs the Triton kernels
GLUON_WALK_UNDER_COMPILE = False
_HOPPER_REFUSALS: set = set()  # (kernel, reason) pairs said once


def gluon_walk(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool, seq_heads: int,
               switch: bool | None) -> int:
    """The dv block a ``delta_gluon`` walk runs for these inputs, or 0 for the Triton kernels, by ``switch``
    (``USE_GLUON_WALK`` or ``USE_GLUON_BWD_WALK``: True, False, or None for where it pays); where it was asked for and
    cannot run, says why once."""
    if not _hopper_kernel_runs(q, switch, lambda: _gluon().walk_supported(q, K, V, C, given_write_keys),
                               "the Gluon state walk"):
        return 0
    delta_gluon = _gluon()
    BV = delta_gluon.walk_block(V)
    programs = seq_heads * triton.cdiv(V, BV)
    return BV if switch or programs >= GLUON_WALK_MIN_PROGRAMS_PER_SM * num_sms(q.device) else 0


#: the forward as one warp-specialised Hopper kernel after the solve (``delta_fused``: the state chain, the outputs
#: and the loads in partitions of their own), where no split runs: without autograd in place of ``_fwd_mix`` and
#: ``_fwd_walk``; with autograd, storing the chunk states and pseudo-values, in place of the state walk and U~ (W~
#: still from ``_fwd_wu``). None (where it runs), True, False
USE_FUSED_PREFILL: bool | None = None
USE_FUSED_TRAINING: bool | None = None
#: where not asked for, the fused forward only from this many (token, value head) pairs: its launch takes more host
#: time than the Triton kernels' (H200 machine: ``chunk_fwd`` without autograd 227 against 151 µs a call, the TMA
#: descriptors' handling most of it), which a small call, whose kernels take less GPU time than that, would wait on
FUSED_MIN_TOKEN_HEADS = 1 << 16


def fused_forward(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool, switch: bool | None,
                  token_heads: int = FUSED_MIN_TOKEN_HEADS) -> bool:
    """Whether the forward runs ``delta_fused`` for ``token_heads`` (token, value head) pairs, by ``switch``
    (``USE_FUSED_PREFILL`` or ``USE_FUSED_TRAINING``: None where it pays); where it was asked for and cannot run,
    says why once."""
    if switch is None and token_heads < FUSED_MIN_TOKEN_HEADS:
        return False

    def why_not():
        from . import delta_fused

        return delta_fused.supported(q, K, V, C, given_write_keys)

    return _hopper_kernel_runs(q, switch, why_not, "the fused forward")


#: the backward's chunk-parallel part (after the reverse walk) as one Hopper kernel (``delta_chunk_bwd``, Gluon) in
#: place of ``_bwd_dqkw`` and ``_bwd_wy``: None (where it runs), True, False
USE_CHUNK_BWD: bool | None = None


def chunk_bwd_kernel(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> bool:
    """Whether ``chunk_bwd`` runs ``delta_chunk_bwd`` for inputs like q (``USE_CHUNK_BWD``); where it was asked for
    and cannot run, says why once."""

    def why_not():
        from . import delta_chunk_bwd

        return delta_chunk_bwd.supported(q, K, V, C, given_write_keys)

    return _hopper_kernel_runs(q, USE_CHUNK_BWD, why_not, "the Gluon chunk backward")


def _gluon():
    """``delta_gluon``, imported where a walk is asked for (Gluon's modules load only then)."""
    from . import delta_gluon

    return delta_gluon


def _hopper_kernel_runs(q: torch.Tensor, switch: bool | None, why_not, what: str) -> bool:
    """Whether a Hopper kernel (``what``) runs for inputs like q under its ``switch`` (True, False, None): never on
    the CPU (the interpreter runs the Triton kernels) nor while torch.compile traces (``GLUON_WALK_UNDER_COMPILE``),
    else where ``why_not()`` has no reason against it; where it was asked for and cannot run, says why once."""
    if switch is False or q.device.type == "cpu":
        return False
    if torch.compiler.is_compiling() and not GLUON_WALK_UNDER_COMPILE:
        return False
    why = why_not()
    if why is not None and switch and (what, why) not in _HOPPER_REFUSALS:
        _HOPPER_REFUSALS.add((what, why))
        warnings.warn(f"lazoo: {what} was asked for but {why}: the Triton kernels run instead", stacklevel=4)
    return why is None


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether each tensor starts on a 16-byte boundary, as a TMA descriptor's base must (a view into a larger
    buffer may not: the Triton kernels take it, the fused forward does not)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _triangular_type(q: torch.Tensor, DT, given_write_keys: bool):
    """Operand type of ``_fwd_wu``'s and ``_bwd_wy``'s triangular products for inputs like q: the 16-bit type, but
    fp32 (tf32; tf32x3 for fp32 inputs) for given write keys, whose 16-bit prefill gave non-finite outputs on an H200
    (the generalised rule's GPU test). The prefill's ``_fwd_mix`` (M and Y) keeps fp32 operands always: in 16 bits
    the gated rule's output error rose above FlashQLA's at HV = 2H (6.1e-3 against 5.9e-3)."""
    return DT if TRIANGULAR_16BIT and q.dtype != torch.float32 and not given_write_keys else tl.float32


def _opts(name: str, interpret: bool, fp32: bool = False) -> dict:
    if interpret:
        return {}
    opts = {key: val for key, val in (FP32_CONFIGS if fp32 else CONFIGS).get(name, CONFIGS[name]).items()
            if key not in ("BV", "BK")}
    if fp32:  # fp32 tiles take twice the shared memory: at most 2 stages
        opts["num_stages"] = min(opts.get("num_stages", 3), 2)
    return opts


def _table_bv(name: str, BV: int, interpret: bool) -> int:
    """The dv block of a chunk-parallel kernel: ``CONFIGS[name]["BV"]`` where the table sets one (a wider block
    recomputes the chunk's Q K^T for fewer dv blocks), else ``BV``."""
    return BV if interpret else CONFIGS[name].get("BV", BV)


def _h_opts(programs: int, device, interpret: bool, fp32: bool) -> dict:
    """``_fwd_h``'s launch options for a grid of ``programs``: fewer stages once they outnumber the SMs."""
    opts = _opts("h", interpret, fp32)
    if not interpret and programs > num_sms(device):
        opts["num_stages"] = min(opts.get("num_stages", 3), H_STAGES_MANY_PROGRAMS)
    return opts


def _dhu_launch(K: int, V: int, parallel: int, device, interpret: bool, fp32: bool,
                has_w: bool = False) -> tuple[int, dict]:
    """dv block and launch options of ``_bwd_dhu``: whole 128-wide dv blocks at 2 stages once 64-wide ones would
    outnumber the SMs (half the programs, each reading a chunk's keys once for all of dv). Measured for the (gated)
    delta rule only: given write keys (``has_w``) keep the heuristic."""
    if interpret:
        return next_pow2(V), {}
    opts = _opts("dhu", interpret, fp32)
    BKF = next_pow2(K)
    if BKF > 128 and "num_stages" in opts:  # dk = 256: 3 stages take 336 904 bytes of shared memory, 2 229 892
        opts["num_stages"] = min(opts["num_stages"], 2)
    if CONFIGS["dhu"].get("BV"):
        return CONFIGS["dhu"]["BV"], opts
    wide = DHU_WIDE_DV
    if wide and not (fp32 or has_w) and BKF <= 128 and next_pow2(V) >= wide["BV"] \
            and parallel * triton.cdiv(V, 64) > num_sms(device):
        return wide["BV"], {k: val for k, val in wide.items() if k != "BV"}
    return _seq_bv(K, V, parallel, device, interpret, fp32), opts


#: the solve (G and A of every chunk) as one Hopper kernel (``delta_solve``: a warpgroup a chunk and value head) in
#: place of ``_fwd_solve`` (one warp): True, False (the default), or None for wherever it is supported. Off, as it is
#: slower: H200, bf16, gated, the kernel's time (torch.profiler, forward without autograd) 0.186 -> 0.240 ms at T = 1k
#: B = 32, 0.337 -> 0.478 at 8k with HV = 2H. Its parts, each left out in turn: the two merges 0.062 / 0.152 ms, the
#: substitution 0.014 / 0.030, and the rest (K's rows in, K Kᵀ, L, A out) 0.180 / 0.329, as long as the whole Triton
#: kernel: one chunk a program and a few programs a multiprocessor leave the loads' latency open
USE_GLUON_SOLVE: bool | None = False


def solve_kernel(k: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> bool:
    """Whether ``fwd_solve`` runs ``delta_solve`` for keys like k (``USE_GLUON_SOLVE``); where it was asked for and
    cannot run, says why once."""

    def why_not():
        from . import delta_solve

        return delta_solve.supported(k, K, V, C, given_write_keys)

    return _hopper_kernel_runs(k, USE_GLUON_SOLVE, why_not, "the Gluon solve")


def fwd_solve(k, beta, g, seqs: _Seqs, C: int, H: int, V: int, a_dtype: torch.dtype, w=None):
    """``(G, A)`` of every chunk on flattened inputs as ``chunk_fwd`` takes them: G ``[TT, H]`` fp32 (None without
    g), A = (I + strict_tril(E ⊙ K Wᵀ))⁻¹ ``[TT, H, C]`` in ``a_dtype`` (W = β K, or the given write keys w)."""
    TT, HK, K = k.shape
    HAS_G, HAS_W = g is not None, w is not None
    if solve_kernel(k, K, V, C, HAS_W):
        from . import delta_solve

        return delta_solve.solve(k, beta, g, seqs, H, a_dtype)
    dev, f32 = k.device, torch.float32
    interp = dev.type == "cpu"
    DT, PREC = dot_types(k)
    BK = _blocks(K, V, interp)[1]
    Gc = torch.empty(TT, H, device=dev, dtype=f32) if HAS_G else None
    A = torch.empty(TT, H, C, device=dev, dtype=a_dtype)
    beta = w if HAS_W else beta  # a placeholder pointer when unused
    _fwd_solve_kernel[(seqs.NT * H,)](
        k, w if HAS_W else k, beta, g if HAS_G else beta, Gc if HAS_G else beta, A, seqs.chunks, seqs.cu,
        H=H, HK=HK, K=K, C=C, BK=BK, HAS_G=HAS_G, HAS_W=HAS_W, DT=DT, PREC=PREC,
        **_opts("solve", interp, k.dtype == f32))
    return Gc, A


def chunk_fwd(q, k, v, beta, g, S0, scale: float, seqs: _Seqs, C: int, output_final_state: bool, w=None,
              save: bool = True):
    """Forward on flattened inputs q/k ``[TT, HK, dk]``, v ``[TT, H, dv]``, beta/g ``[TT, H]`` (or write
    keys w ``[TT, H, dk]`` in place of β k, beta then unused; HK = H then). H = m·HK: each key head serves m
    consecutive value heads (grouped value heads), read in place. Returns ``(o, final_state or None, saved)``;
    ``saved`` is what ``chunk_bwd`` reads (None where the prefill kernels ran: not ``save``, dk <= 128)."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    dev = q.device
    interp = dev.type == "cpu"
    DT, PREC = dot_types(q)
    FP32 = q.dtype == torch.float32
    BKF, BK, BV = _blocks(K, V, interp)
    HAS_G, HAS_W = g is not None, w is not None
    beta = w if HAS_W else beta  # a placeholder pointer when unused
    kw = w if HAS_W else k  # the write key (β applied in the kernels when it is k)
    f32 = torch.float32
    TDT = _triangular_type(q, DT, HAS_W)
    segs = split_segments(seqs, H, V, q, C)
    fused = not segs and tma_aligned(q, k, v) and fused_forward(q, K, V, C, HAS_W,
                                                                USE_FUSED_TRAINING if save else USE_FUSED_PREFILL,
                                                                TT * H)
    if fused:
        from . import delta_fused

        fused = not save or delta_fused.AX_TF32  # the backward reads A in fp32
    NT, N = seqs.NT, seqs.N
    Gc, A = fwd_solve(k, beta, g, seqs, C, H, V, delta_fused.a_dtype(q) if fused else f32, w=w)
    Gc = Gc if HAS_G else beta  # a placeholder pointer when unused
    sT = torch.empty(N, H, V, K, device=dev, dtype=f32) if output_final_state else A
    if fused:
        wt = None
        if save:  # the backward's W~ (U~ the kernel forms itself)
            wt = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
            _fwd_wu_kernel[(NT * H,)](k, v, Gc, A, wt, wt, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, V=V, C=C, BK=BK,
                                    BV=BV, HAS_G=HAS_G, TDT=TDT, PREC=PREC, STORE_U=False,
                                    **_opts("wu", interp, FP32))
        o, h, vnew = delta_fused.fused_fwd(q, k, v, beta, Gc if HAS_G else None, A, S0, sT, seqs, scale,
                                           output_final_state, save)
        return o, (sT if output_final_state else None), ((Gc if HAS_G else None, A, wt, vnew, h, None)
                                                          if save else None)
    o = torch.empty(TT, H, V, device=dev, dtype=v.dtype)
    use_s0, S0 = S0 is not None, (S0 if S0 is not None else A)
    walk = segs or seqs  # the sequences the state walk runs over (segments of them, their starts chained first)
    BVg = gluon_walk(q, K, V, C, HAS_W, walk.N * H, USE_GLUON_WALK) if save or GLUON_WALK_IN_PREFILL else 0
    gluon = BVg > 0  # 0: the Triton kernels
    if not save and BKF <= WALK_MAX_HEAD_DIM and not gluon:  # a forward without autograd (a prefill): nothing stored
        M = torch.empty(TT, H, C, device=dev, dtype=q.dtype)
        Y = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
        _fwd_mix_kernel[(NT * H,)](q, kw, beta, Gc, A, M, Y, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, C=C, BK=BK,
                                 HAS_G=HAS_G, HAS_W=HAS_W, DT=DT, PREC=PREC, **_opts("mix", interp, FP32))
        if segs:
            S0, sT, _ = _chain_segments(seqs, segs, S0 if use_s0 else None, output_final_state, q, C, DT, PREC,
                                        HAS_W, bk=Y, beta=beta, Gc=Gc if HAS_G else None, cm=k, r=v, prefill=True)
            use_s0 = True
        BVw = _walk_bv(V, walk.N * H, dev, interp, FP32)
        _fwd_walk_kernel[(walk.N, H, triton.cdiv(V, BVw))](
            q, k, v, Gc, M, Y, o, S0, sT if sT is not None else A, walk.cu, walk.coff, scale,
            H=H, HK=HK, K=K, V=V, C=C, BKF=BKF, BV=BVw, HAS_G=HAS_G, USE_S0=use_s0,
            STORE_S=output_final_state and not segs, DT=DT, PREC=PREC, **_opts("walk", interp, FP32))
        return o, (sT if output_final_state else None), None
    wt = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    ut = torch.empty(TT, H, V, device=dev, dtype=q.dtype)
    _fwd_wu_kernel[(NT * H,)](k, v, Gc, A, wt, ut, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, V=V, C=C, BK=BK, BV=BV,
                            HAS_G=HAS_G, TDT=TDT, PREC=PREC, **_opts("wu", interp, FP32))
    seg_maps = None  # the segments' maps, whose transposes the backward's chaining can take
    if segs:
        S0, sT, seg_maps = _chain_segments(seqs, segs, S0 if use_s0 else None, output_final_state, q, C, DT, PREC,
                                           HAS_W, bk=kw, beta=beta, Gc=Gc if HAS_G else None, cm=wt, r=ut,
                                           prefill=False)
        use_s0, sT = True, (sT if output_final_state else A)
        seg_maps = seg_maps if delta_split.SEGMENT_BWD_MAPS_FROM_FORWARD else None
    store_s = output_final_state and not segs
    if gluon:
        from . import delta_gluon

        h, vnew, o = delta_gluon.fwd_walk(q, k, beta, Gc if HAS_G else None, wt, ut, S0 if use_s0 else None, sT,
                                          walk, scale, store_s, save, BVg)
        return o, (sT if output_final_state else None), ((Gc if HAS_G else None, A, wt, vnew, h, seg_maps)
                                                          if save else None)
    h = torch.empty(NT, H, K, V, device=dev, dtype=q.dtype)
    vnew = torch.empty(TT, H, V, device=dev, dtype=q.dtype)
    BVh = CONFIGS["h"].get("BV") or _seq_bv(K, V, walk.N * H, dev, interp, FP32) if not interp else next_pow2(V)
    _fwd_h_kernel[(walk.N, H, triton.cdiv(V, BVh))](
        kw, beta, Gc, wt, ut, h, vnew, S0, sT, walk.cu, walk.coff,
        H=H, HK=HK, K=K, V=V, C=C, BKF=BKF, BV=BVh, HAS_G=HAS_G, HAS_W=HAS_W, USE_S0=use_s0,
        STORE_S=store_s, DT=DT, PREC=PREC, **_h_opts(walk.N * H * triton.cdiv(V, BVh), dev, interp, FP32))
    BVo = _table_bv("o", BV, interp)
    _fwd_o_kernel[(NT * triton.cdiv(V, BVo) * H,)](
        q, kw, beta, Gc, h, vnew, o, seqs.chunks, seqs.cu, scale,
        H=H, HK=HK, K=K, V=V, C=C, BK=BK, BV=BVo, HAS_G=HAS_G, HAS_W=HAS_W, DT=DT, PREC=PREC,
        **_opts("o", interp, FP32))
    return o, (sT if output_final_state else None), (Gc if HAS_G else None, A, wt, vnew, h, seg_maps)


def split_segments(seqs: _Seqs, H: int, V: int, q: torch.Tensor, C: int):
    """The segments the state walks run over where few long sequences would leave the GPU idle, else None
    (``delta_split.plan``)."""
    if q.device.type == "cpu" and delta_split.SPLIT_LONG_SEQUENCES is not True:
        return None  # the interpreter: only where asked for (the tests)
    return delta_split.plan(seqs, H, V, q.device, C)


def _chain_segments(seqs, segs, S0, output_final_state: bool, q, C: int, DT, PREC, has_w: bool, **forms):
    """(each segment's start state, the final states or None, the segments' maps): one pass over the segments, then
    the chaining."""
    return delta_split.segment_starts(seqs, segs, S0, output_final_state, HK=q.shape[1], C=C, DT=DT, PREC=PREC,
                                        has_w=has_w, **forms)


def norms_in_backward(q: torch.Tensor, H: int, given_write_keys: bool) -> bool:
    """Whether ``chunk_bwd`` takes dq and dk back through q's and k's L2 norms itself (``NORM_BACKWARD_IN_KERNELS``,
    one value head a key head, all of dk in one dq program), sparing the caller's ``qk_grads`` pass."""
    K = q.shape[-1]
    return (NORM_BACKWARD_IN_KERNELS and q.shape[1] == H and not given_write_keys
            and (q.device.type == "cpu" or (next_pow2(K) <= 128 and q.dtype != torch.float32
                                              and not CONFIGS["dqkw"].get("BK"))))


def chunk_bwd(q, k, v, beta, g, S0, scale, seqs: _Seqs, C: int, saved, do, dsT, need_ds0: bool, w=None,
              norms=None):
    """Gradients ``(dq, dk, dv, dbeta, dg, ds0)``; with write keys w, ``dbeta`` is dw ``[TT, H, dk]``. dq and dk are
    per value head ``[TT, H, dk]``: with grouped value heads the caller sums each key head's group (``qk_grads``, with
    the L2 norms' backward in the same launch). ``norms``: ``(rstd_q, rstd_k)`` of ``l2norm_fwd`` where q and k are
    normalised and ``norms_in_backward`` holds: dq and dk come back through the norms."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    dev = q.device
    interp = dev.type == "cpu"
    DT, PREC = dot_types(q)
    FP32 = q.dtype == torch.float32
    BKF, BK, BV = _blocks(K, V, interp)
    HAS_G, HAS_W = g is not None, w is not None
    beta = w if HAS_W else beta
    kw = w if HAS_W else k
    Gc, A, wt, vnew, h, seg_maps = saved
    Gc = Gc if HAS_G else beta
    f32 = torch.float32
    NT, N = seqs.NT, seqs.N
    segs = split_segments(seqs, H, V, q, C)
    walk = segs or seqs
    ds0 = None
    if segs:  # the state gradient at each segment's end, chained from the last segment back
        dsT, ds0 = delta_split.segment_end_grads(
            seqs, segs, dsT, need_ds0, q=q, kw=kw, beta=beta, Gc=Gc if HAS_G else None, wt=wt, do=do, scale=scale,
            C=C, DT=DT, PREC=PREC, has_w=HAS_W, forward_maps=seg_maps)
    need_walk_ds0 = need_ds0 and not segs
    BVg = gluon_walk(q, K, V, C, HAS_W, walk.N * H, USE_GLUON_BWD_WALK)
    if BVg:  # the reverse walk as one Hopper kernel, Pᵀ dO formed in it
        from . import delta_gluon

        du, dh, walk_ds0 = delta_gluon.bwd_walk(q, k, beta, Gc if HAS_G else None, wt, do, dsT, walk, scale,
                                                need_walk_ds0, BVg)
    else:  # Triton: _bwd_dhu, after _bwd_dv_local where it does not form Pᵀ dO itself
        du = torch.empty(TT, H, V, device=dev, dtype=q.dtype)
        BVh, dhu_opts = _dhu_launch(K, V, walk.N * H, dev, interp, FP32, HAS_W)
        local_du = _local_du_in_walk(walk.N * H * triton.cdiv(V, BVh), BVh, V, dev, interp, HAS_W)
        if not local_du:
            BVd = _table_bv("dv_local", BV, interp)
            _bwd_dv_local_kernel[(NT * triton.cdiv(V, BVd) * H,)](
                q, kw, beta, Gc, do, du, seqs.chunks, seqs.cu, scale,
                H=H, HK=HK, K=K, V=V, C=C, BK=BK, BV=BVd, HAS_G=HAS_G, HAS_W=HAS_W, DT=DT, PREC=PREC,
                **_opts("dv_local", interp, FP32))
        dh = torch.empty(NT, H, K, V, device=dev, dtype=q.dtype)
        walk_ds0 = torch.empty(N, H, V, K, device=dev, dtype=f32) if need_walk_ds0 else A
        _bwd_dhu_kernel[(walk.N, H, triton.cdiv(V, BVh))](
            q, kw, beta, Gc, wt, do, du, dh, dsT if dsT is not None else A, walk_ds0, walk.cu, walk.coff, scale,
            H=H, HK=HK, K=K, V=V, C=C, BKF=BKF, BV=BVh, HAS_G=HAS_G, HAS_W=HAS_W, USE_DST=dsT is not None,
            STORE_DS0=need_walk_ds0, LOCAL_DU=local_du, DT=DT, PREC=PREC, **dhu_opts)
    if not segs:
        ds0 = walk_ds0
    NORM = norms is not None
    if NORM and (HK != H or HAS_W):
        raise ValueError("chunk_bwd: the norms' backward in the kernels needs one value head a key head")
    if chunk_bwd_kernel(q, K, V, C, HAS_W):
        from . import delta_chunk_bwd

        dq, dk, dv, dbeta, dg = delta_chunk_bwd.chunk_bwd(q, k, v, beta, Gc if HAS_G else None, A, h, dh, vnew, do,
                                                          du, seqs, scale, norms)
        return dq, dk, dv, dbeta, dg, (ds0 if need_ds0 else None)
    BKq = BKF if (interp or (BKF <= 128 and not FP32)) else 64  # dqkw: all of dk in one program up to 128
    if not interp and CONFIGS["dqkw"].get("BK"):
        BKq = CONFIGS["dqkw"]["BK"]
    NK = triton.cdiv(K, BKq)
    # per value head in q's dtype (a group's partials summed by the caller in float32, as fla does): half the bytes
    # of float32 partials, H200 8k HV = 2H fwd + bwd 7.92 against 8.03 ms, the same error against float64
    dq = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dw = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dwt = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dgp = torch.empty(NK, TT, H, device=dev, dtype=f32) if HAS_G else A
    if NORM and NK != 1:
        raise ValueError("chunk_bwd: the norms' backward in the kernels needs dk whole")
    rq, rk = norms if NORM else (A, A)
    _bwd_dqkw_kernel[(NT * NK * H,)](
        q, kw, beta, Gc, h, dh, vnew, do, du, dq, dw, dwt, dgp, rq, seqs.chunks, seqs.cu, scale, TT,
        H=H, HK=HK, K=K, V=V, C=C, BK=BKq, BV=BV, HAS_G=HAS_G, HAS_W=HAS_W, NORM_Q=NORM, DT=DT, PREC=PREC,
        **_opts("dqkw", interp, FP32))
    dk = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(w) if HAS_W else torch.empty(TT, H, device=dev, dtype=f32)
    dg = torch.empty(TT, H, device=dev, dtype=f32) if HAS_G else None
    _bwd_wy_kernel[(NT * H,)](
        k, kw, v, beta, Gc, A, du, dw, dwt, dgp, dk, dv, dbeta, dg if HAS_G else dbeta, rk, seqs.chunks, seqs.cu,
        TT, H=H, HK=HK, K=K, V=V, C=C, BK=BK, BV=BV, NK=NK, HAS_G=HAS_G, HAS_W=HAS_W, NORM_K=NORM, DT=DT,
        TDT=_triangular_type(q, DT, HAS_W), PREC=PREC, **_opts("wy", interp, FP32))
    return dq, dk, dv, dbeta, dg, (ds0 if need_ds0 else None)


def _l2norm_blocks(D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    return BD, max(1, min(64, 2048 // BD))


def l2norm_fwd(x: torch.Tensor, x2: torch.Tensor | None = None):
    """``(y, rstd)`` of contiguous ``x`` (and ``(y2, rstd2)`` of ``x2``, same last dim, in the same launch)."""
    D = x.shape[-1]
    BD, BR = _l2norm_blocks(D)
    outs = [(torch.empty_like(t), torch.empty(t.numel() // D, device=t.device, dtype=torch.float32))
            for t in (x, x if x2 is None else x2)]
    (y, r), (y2, r2) = outs
    NR, NR2 = x.numel() // D, (0 if x2 is None else x2.numel() // D)
    grid = (triton.cdiv(NR, BR) + triton.cdiv(NR2, BR),)
    _l2norm_fwd_kernel[grid](x, y, r, NR, x if x2 is None else x2, y2, r2, NR2, D=D, BD=BD, BR=BR,
                             PAIR=x2 is not None, **_opts("l2norm", x.device.type == "cpu"))
    return (y, r) if x2 is None else (y, r, y2, r2)


def l2norm_bwd(y, rstd, dy, y2=None, rstd2=None, dy2=None):
    """dx of ``l2norm_fwd``'s outputs ``y`` (and dx2 of ``y2``, in the same launch)."""
    pair = y2 is not None
    return qk_grads(dy, dy2 if pair else None, 1, (y, rstd), (y2, rstd2) if pair else None)


def qk_grads(dq, dk, groups: int, norm_q=None, norm_k=None):
    """The gradients of q and k ``[TT, HK, D]`` from the kernels' per-value-head partials ``dq``, ``dk``
    ``[TT, HK·groups, D]`` (``groups`` value heads a key head): each group summed in float32 and, where the norm's
    ``(y, rstd)`` is given (``l2norm_fwd``'s), taken back through the L2 norm, in one launch for both (dk may be None:
    dq alone). Rounded once, to the partials' dtype."""
    D = dq.shape[-1]
    BD, BR = _l2norm_blocks(D)
    pair = dk is not None
    NORM = norm_q is not None
    if pair and (norm_k is not None) != NORM:
        raise ValueError("qk_grads: normalise both q and k or neither")
    dq = dq.contiguous()
    dk = dk.contiguous() if pair else dq
    NR, NR2 = dq.numel() // (D * groups), (dk.numel() // (D * groups) if pair else 0)
    dxq = torch.empty(NR, D, device=dq.device, dtype=dq.dtype)
    dxk = torch.empty(NR2, D, device=dq.device, dtype=dq.dtype) if pair else dxq
    yq, rq = norm_q if NORM else (dq, dq)  # without the norm: never read
    yk, rk = (norm_k if NORM else (dk, dk)) if pair else (yq, rq)
    grid = (triton.cdiv(NR, BR) + triton.cdiv(NR2, BR),)
    _l2norm_bwd_kernel[grid](yq, rq, dq, dxq, NR, yk, rk, dk, dxk, NR2, D=D, BD=BD, BR=BR, PAIR=pair, G=groups,
                             NORM=NORM, **_opts("l2norm", dq.device.type == "cpu"))
    out_q = dxq.view(_summed_shape(dq, groups))
    return out_q if not pair else (out_q, dxk.view(_summed_shape(dk, groups)))


def _summed_shape(partials: torch.Tensor, groups: int) -> tuple:
    """``[..., H, D]`` partials -> ``[..., H / groups, D]`` (any shape ``[..., D]`` when groups = 1)."""
    if groups == 1:
        return tuple(partials.shape)
    return (*partials.shape[:-2], partials.shape[-2] // groups, partials.shape[-1])


class L2NormFunction(torch.autograd.Function):
    """``x / sqrt(|x|^2 + 1e-6)`` over the last dim in one pass (and one pass back), in x's dtype."""

    @staticmethod
    def forward(ctx, x):
        y, rstd = l2norm_fwd(x.contiguous())
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return l2norm_bwd(y, rstd, dy)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x / sqrt(|x|^2 + 1e-6)`` over the last dim (= ``lazoo.ops.norms.l2norm``)."""
    return L2NormFunction.apply(x)


class ChunkDeltaRuleFunction(torch.autograd.Function):
    """Chunk-parallel (gated) delta rule with a hand-written backward.

    Inputs: q, k ``[B, T, HK, dk]`` (normalised and scaled by the caller or through ``scale``),
    v ``[B, T, H, dv]`` with H = m·HK (grouped value heads: key head j serves value heads jm to jm + m - 1), the
    write keys as beta ``[B, T, H]`` (w = β k) or as w ``[B, T, H, dk]`` (the generalised rule; beta None; HK = H),
    g ``[B, T, H]`` log decays or None (beta and g in q's dtype or fp32), initial state ``[N, H, dv, dk]`` (fp32)
    or None; with ``cu_seqlens`` B = 1 and N sequences are packed.
    ``save``: keep what the backward reads (``records_graph``); without it the forward runs the prefill kernels.
    ``l2norm_qk``: q and k are L2-normalised here first (both in one launch each way, no autograd nodes of their own).
    Returns ``(o [B, T, H, dv], final_state [N, H, dv, dk] fp32 or None)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, w, initial_state, scale, cu_seqlens, chunk_size, output_final_state, save,
                l2norm_qk=False):
        B, T, HK, K = q.shape
        H, V = v.shape[2:]
        seqs = seqs_for(B, T, cu_seqlens, chunk_size, q.device)
        qf, kf = q.reshape(B * T, HK, K).contiguous(), k.reshape(B * T, HK, K).contiguous()
        rq = rk = None
        if l2norm_qk:
            qf, rq, kf, rk = l2norm_fwd(qf, kf)
        vf = v.reshape(B * T, H, V).contiguous()
        bf = None if beta is None else beta.reshape(B * T, H).contiguous()
        wf = None if w is None else w.reshape(B * T, H, K).contiguous()
        gf = None if g is None else g.reshape(B * T, H).contiguous()
        S0 = None if initial_state is None else initial_state.contiguous()
        o, sT, saved = chunk_fwd(qf, kf, vf, bf, gf, S0, float(scale), seqs, chunk_size, output_final_state,
                                 w=wf, save=save)
        if save:
            ctx.save_for_backward(qf, kf, vf, bf, gf, wf, S0, rq, rk, *saved)
        ctx.seqs, ctx.scale, ctx.C = seqs, float(scale), chunk_size
        ctx.shapes = (B, T, HK, H, K, V)
        ctx.dtypes = (None if beta is None else beta.dtype, None if g is None else g.dtype,
                      None if initial_state is None else initial_state.dtype)
        return o.view(B, T, H, V), sT

    @staticmethod
    def backward(ctx, do, dsT):
        qf, kf, vf, bf, gf, wf, S0, rq, rk, Gc, A, wt, vnew, h, seg_maps = ctx.saved_tensors
        B, T, HK, H, K, V = ctx.shapes
        do = do.reshape(B * T, H, V).contiguous()
        dsT = None if dsT is None else dsT.contiguous().float()
        need_ds0 = S0 is not None and ctx.needs_input_grad[6]
        inside = rq is not None and norms_in_backward(qf, H, wf is not None)
        dq, dk, dv, db, dg, ds0 = chunk_bwd(qf, kf, vf, bf, gf, S0, ctx.scale, ctx.seqs, ctx.C,
                                            (Gc, A, wt, vnew, h, seg_maps), do, dsT, need_ds0, w=wf,
                                            norms=(rq, rk) if inside else None)
        if (rq is not None and not inside) or H != HK:  # each group's partials summed, back through the L2 norms
            norms = ((qf, rq), (kf, rk)) if rq is not None else (None, None)
            dq, dk = qk_grads(dq, dk, H // HK, *norms)
        b_dt, g_dt, s_dt = ctx.dtypes
        dbeta = None if wf is not None else db.view(B, T, H).to(b_dt)
        dw = None if wf is None else db.view(B, T, H, K)
        return (dq.view(B, T, HK, K), dk.view(B, T, HK, K), dv.view(B, T, H, V),
                dbeta, None if dg is None else dg.view(B, T, H).to(g_dt), dw,
                None if ds0 is None else ds0.to(s_dt), None, None, None, None, None, None)


def records_graph(*inputs) -> bool:
    """Whether autograd records this call: grad mode is on and an input wants a gradient (inside
    ``Function.forward`` grad mode is always off and ``needs_input_grad`` ignores it, so the callers decide)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def _check(op: str, q: torch.Tensor, v: torch.Tensor, cu_seqlens) -> None:
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: the Triton kernel takes float32/float16/bfloat16 inputs, not {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dims up to {MAX_HEAD_DIM}, got dk={q.shape[-1]}, dv={v.shape[-1]}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch is packed along time, so B must be 1, got {q.shape[0]}")
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"{op}: v's {v.shape[2]} heads must be a multiple of q's and k's {q.shape[2]} (grouped value "
                         "heads)")


def chunk_delta_rule(q, k, v, beta, g=None, *, scale: float = 1.0, initial_state=None,
                     output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64,
                     use_qk_l2norm: bool = False):
    """Chunk-parallel (gated) delta rule, differentiable: see ``ChunkDeltaRuleFunction`` (``use_qk_l2norm``: q and
    k divided by sqrt(|x|^2 + 1e-6) first, inside the same autograd node)."""
    _check_chunk("chunk_delta_rule", q, v, cu_seqlens, chunk_size)
    return ChunkDeltaRuleFunction.apply(q, k, v, beta, g, None, initial_state, scale, cu_seqlens, chunk_size,
                                        output_final_state, records_graph(q, k, v, beta, g, initial_state),
                                        use_qk_l2norm)


def chunk_generalized_delta_rule(q, k, v, w, *, scale: float = 1.0, initial_state=None,
                                 output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64):
    """Chunk-parallel generalised delta rule with its own write keys w ``[B, T, H, dk]``:
    ``S_t = S_{t-1} + (v_t - S_{t-1} k_t) w_t^T``, ``o_t = S_t (scale q_t)`` (VLA: w = α̂);
    differentiable in q, k, v, w and the initial state.

    Not exposed with a gate: the kernels compute it (``HAS_G`` with ``HAS_W``, and it matches the
    float64 reference under the interpreter), but on an H100 with Triton 3.6 its backward faulted with
    an illegal memory access at head dims <= 16 in fp16/bf16 (fine at 128 and in fp32); until that is
    understood, no mechanism needs it."""
    _check_chunk("chunk_generalized_delta_rule", q, v, cu_seqlens, chunk_size)
    if w.shape != k.shape or w.dtype != k.dtype:
        raise ValueError(f"chunk_generalized_delta_rule: w must match k ({tuple(k.shape)}, {k.dtype}), "
                         f"got {tuple(w.shape)}, {w.dtype}")
    return ChunkDeltaRuleFunction.apply(q, k, v, None, None, w, initial_state, scale, cu_seqlens, chunk_size,
                                        output_final_state, records_graph(q, k, v, w, initial_state))


def _check_chunk(op: str, q: torch.Tensor, v: torch.Tensor, cu_seqlens, chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"{op}: chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    _check(op, q, v, cu_seqlens)


def fused_recurrent_generalized_delta_rule(q, k, v, w, *, scale: float = 1.0, initial_state=None,
                                           output_final_state: bool = False, cu_seqlens=None):
    """Token-by-token generalised delta rule (own write keys w, as ``chunk_generalized_delta_rule``)
    against a state, forward only (decoding)."""
    return fused_recurrent_delta_rule(q, k, v, w, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, _w=True)


def fused_recurrent_delta_rule(q, k, v, beta, g=None, *, scale: float = 1.0, initial_state=None,
                               output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm: bool = False,
                               _w: bool = False):
    """Token-by-token (gated) delta rule against a state, forward only (decoding). Same layout as
    ``chunk_delta_rule``; ``use_qk_l2norm`` normalises q and k inside the kernel (eps 1e-6)."""
    _check("fused_recurrent_delta_rule", q, v, cu_seqlens)
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    dev = q.device
    interp = dev.type == "cpu"
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu = (torch.arange(B + 1, device=dev, dtype=torch.int32) * T if cu_seqlens is None
          else cu_seqlens.to(device=dev, dtype=torch.int32))
    BKF = next_pow2(K)
    BV = next_pow2(V) if interp else min(next_pow2(V), max(16, 4096 // BKF))
    if not interp:
        BV = fill_device(BV, V, N * H, dev, per_sm=4)
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    sT = torch.empty(N, H, V, K, device=dev, dtype=torch.float32) if output_final_state else o
    S0 = None if initial_state is None else initial_state.contiguous()
    _fused_recurrent_kernel[(N, H, triton.cdiv(V, BV))](
        q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(),
        g.contiguous() if g is not None else beta, S0 if S0 is not None else o, o, sT, cu, float(scale),
        H=H, HK=HK, K=K, V=V, BKF=BKF, BV=BV, HAS_G=g is not None, USE_S0=S0 is not None,
        STORE_S=output_final_state, L2NORM=use_qk_l2norm, HAS_W=_w, **_opts("recurrent", interp))
    return o, (sT if output_final_state else None)
