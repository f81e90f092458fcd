"""Triton kernels for Kimi Delta Attention (the delta rule with a decay per key channel): a chunk-parallel forward
with a hand-written backward, and a fused recurrent kernel for decoding.

Rule, per sequence and value head (state ``S`` ``[dv, dk]``; kernels hold ``Sᵀ`` ``[dk, dv]``):

    S' = S_{t-1} Diag(exp(g_t)),   S_t = S' + β_t (v_t - S' k_t) k_tᵀ,   o_t = scale S_t q_t

Chunks of ``BT = 64`` rows that never straddle a packed sequence; ``G`` the cumulative log decay inside a chunk
(per key dim, float32, stored in base 2: ``log2(e)`` times the natural one, so a decay is one ``exp2``; the formulas
write base e), ``S`` the chunk's start state:

    Aqk[t, i] = Σ_d q_td k_id exp(G_td - G_id) (i <= t),    Mkk[t, i] = Σ_d k_td k_id exp(G_td - G_id) (i < t)
    A  = (I + diag(β) Mkk)^{-1},   W = A (β ⊙ K ⊙ exp(G)),   U~ = A (β ⊙ V),   U = U~ - W Sᵀ
    O  = scale ((Q ⊙ exp(G)) Sᵀ + Aqk U),    S_end = S Diag(exp(G_C)) + Uᵀ (K ⊙ exp(G_C - G))

Aqk and Mkk are built from 16-row sub-chunks (as lazoo.kernels.gla builds GLA's A): a block below the diagonal
(rows I, columns J < I) through the first row r of I, ``(X_I ⊙ exp(G_I - G_r)) (K_J ⊙ exp(G_r - G_J))ᵀ`` (both
exponents <= 0); a diagonal block through its middle row m, ``(X_I ⊙ exp(G_I - G_m)) (K_I ⊙ exp(G_m - G_I))ᵀ``,
when every |G_t - G_m| of the block is within ``DIAG_PRODUCT_RANGE`` (2^96: no factor overflows, and each product
is the exact term up to rounding), and pair by pair, ``exp(G_t - G_i)`` for i <= t only, where a decay is stronger
(the backward decides the same way per block and channel slice). Any gate strength is stable.

Backward (``dS'`` the gradient of a chunk's end state, ``dU`` of its pseudo-values):

    dU  = scale Aqkᵀ dO + (K ⊙ exp(G_C - G)) dS'ᵀ,     dS = dS' Diag(exp(G_C)) + scale dOᵀ (Q ⊙ exp(G)) - dUᵀ W
    dAqk = scale dO Uᵀ,   dW = -dU S,   dA = dW (β K ⊙ exp(G))ᵀ + dU (β V)ᵀ,   dL = -Aᵀ dA Aᵀ (strictly lower),
    dMkk = diag(β) dL,    dv = β ⊙ Aᵀ dU,   dβ = Σ (Aᵀ dU) ⊙ V + Σ (Aᵀ dW) ⊙ K ⊙ exp(G) + Σ_i dL ⊙ Mkk

and dq, dk through the decayed products: each product in which a row of q or k meets exp(+G_t) adds ``x ⊙ dx`` to
dG_t and each in which it meets exp(-G_i) subtracts it; the chunk's last row also takes
``exp(G_C) ⊙ Σ_dv S ⊙ dS' + Σ_t k_t ⊙ (its part of dk through the end-of-chunk decay)``, and dg is the reverse
cumulative sum of dG inside the chunk.

Kernels: ``_cumsum`` (G), ``_fwd_intra`` (Aqk, Mkk left of the diagonal blocks), ``_fwd_diag`` (their diagonal
blocks, as a product or as 128 gathered pairs a block), ``_fwd_solve`` (A), ``_fwd_wu`` (W, U~), ``_fwd_h`` (the only
sequential forward pass: start states and U), ``_fwd_o``; ``_bwd_du_local`` (dAqk and scale Aqkᵀ dO), ``_bwd_dhu``
(sequential, reverse: dS' and dU), ``_bwd_inter`` (the state terms of dq, dk, dW and the last row's dG),
``_bwd_wy`` (back through A: dv, dβ, dMkk and the W term of dk), ``_bwd_intra`` (the sub-chunk sums, totals, dg;
launched for the chunk slices whose diagonal blocks are all products, then for the others).
One program per chunk for ``_fwd_intra`` and ``_fwd_solve`` (the diagonal blocks as 128 gathered pairs a 16-row block,
the four diagonal inverses in one substitution, 128 registers at 4 warps) was correct but slower: H200, bf16, T = 8k,
B = 4, H = 16, forward 3.43 ms against 3.10 (fwd + bwd 10.96 against 10.67).

Layout inside: tokens flattened, q/k ``[TT, HK, dk]``, v ``[TT, H, dv]``, g ``[TT, H, dk]``, β ``[TT, H]`` (B·T
tokens, or the packed batch); H = m·HK (grouped value heads: key head j serves value heads jm ... jm + m − 1, read in
place; dq and dk are formed per value head in float32 and summed over each group). Per-chunk states ``[NT, H, dk,
dv]``; initial and final states ``[N, H, dv, dk]``.

Like lazoo.kernels.delta and .gla, these kernels never transpose the register result of a ``tl.dot`` (Triton
3.4-3.7.0 miscompiles that on Hopper): every transposed operand is a tile loaded from memory or computed
elementwise from loads.

Precision: products of the inputs with the states and with decayed tiles take 16-bit operands for 16-bit inputs
(fp32 accumulation); the triangular algebra (A, W, U~ and their gradients) and the sub-chunk gradient sums take
fp32 operands (tf32 products for 16-bit inputs; tf32x3, about fp32, for fp32 inputs); G, A, Mkk, the gradients of
those and of Aqk, the state between chunks and the decode recurrence are fp32. Aqk is stored in q's dtype: both its
readers take it as a product operand in that dtype, so the rounding is the one they made before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._chunk_layout import cached_uniform, prepare_varlen
from ._launch import chunk_state_dtype, dot_types
from ._tensor_cache import cached_on
from ._tiles import inv_unit_lower16
from ._utils import next_pow2
from .limits import KDA_MAX_HEAD_DIM as MAX_HEAD_DIM
from .limits import KERNEL_DTYPES

#: chunk and sub-chunk rows
BT = 64
BC = 16
NC = BT // BC
LOG2E = 1.4426950408889634


# ============================================================================ tiles
@triton.jit
def _rows(ptr, row0, eos, stride, ncols, R: tl.constexpr, BCOL: tl.constexpr):
    """Rows ``row0 + [0, R)`` (masked to ``< eos``) and columns ``[0, BCOL)`` (masked to ``< ncols``) of a row-major
    tensor (``ptr`` at column 0 of the head), in its storage dtype, zeros outside."""
    r = tl.arange(0, R)
    c = tl.arange(0, BCOL)
    m = (r < eos - row0)[:, None] & (c < ncols)[None, :]
    return tl.load(ptr + row0 * stride + (r[:, None] * stride + c[None, :]), mask=m, other=0)


@triton.jit
def _rows_t(ptr, row0, eos, stride, ncols, R: tl.constexpr, BCOL: tl.constexpr):
    """``_rows`` loaded transposed: ``[BCOL, R]``."""
    r = tl.arange(0, R)
    c = tl.arange(0, BCOL)
    m = (c < ncols)[:, None] & (r < eos - row0)[None, :]
    return tl.load(ptr + row0 * stride + (c[:, None] + r[None, :] * stride), mask=m, other=0)


@triton.jit
def _put(ptr, x, row0, eos, stride, ncols, R: tl.constexpr, BCOL: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, BCOL)
    m = (r < eos - row0)[:, None] & (c < ncols)[None, :]
    tl.store(ptr + row0 * stride + (r[:, None] * stride + c[None, :]), x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _vec(ptr, row0, eos, stride, R: tl.constexpr):
    r = tl.arange(0, R)
    return tl.load(ptr + row0 * stride + r * stride, mask=r < eos - row0, other=0).to(tl.float32)


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with operands in DT (16-bit for 16-bit inputs), fp32 accumulation."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _dotf(a, b, PREC: tl.constexpr):
    """``a @ b`` with fp32 operands (tf32 for 16-bit inputs, tf32x3 for fp32 inputs)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _chunk(chunks, cu, i_c, CHUNK: tl.constexpr):
    """(first token, end of its sequence) of global chunk ``i_c``."""
    i_n = tl.load(chunks + i_c * 2).to(tl.int64)
    c = tl.load(chunks + i_c * 2 + 1).to(tl.int64)
    return tl.load(cu + i_n).to(tl.int64) + c * CHUNK, tl.load(cu + i_n + 1).to(tl.int64)


@triton.jit
def _sub_chunk(chunks, cu, i_p):
    """(first token of the chunk, first token of the sub-chunk, end of the sequence, the sub-chunk's index) of
    program ``i_p`` of a grid over the chunks' four 16-row sub-chunks."""
    i_i = i_p % 4
    t0, eos = _chunk(chunks, cu, i_p // 4, 64)
    return t0, t0 + i_i * 16, eos, i_i


@triton.jit
def _mid_exponents(b_G, gh, r0, eos, stride, ncols, m_i, BK: tl.constexpr, RANGE: tl.constexpr):
    """(x, ok) of a 16-row sub-chunk from row r0: x = G - G_m (base 2, zeros outside m_i) through its middle row m,
    and whether every |x| <= RANGE (NaN counts as out of range), the condition for its diagonal block as a
    product. Every kernel deciding on one block computes this the same way, so they agree."""
    ck = tl.arange(0, BK)
    rm = r0 + tl.minimum(7, eos - r0 - 1)
    x = tl.where(m_i, b_G - tl.load(gh + rm * stride + ck, mask=ck < ncols, other=0)[None, :], 0.0)
    return x, tl.max(tl.where(x == x, tl.abs(x), float("inf"))) <= RANGE


# ============================================================================ forward
@triton.jit
def _cumsum_kernel(g, Gc, positive, chunks, cu, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   CHECK: tl.constexpr):
    """Grid (NT, H): G = cumulative sum of g inside the chunk, times log2(e), float32; with CHECK, positive[0] = 1
    where a g > 0 is met (the caller's range check: no pass of its own over g)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    b_g = _rows(g + i_h * K, t0, eos, H * K, K, 64, BK).to(tl.float32)
    _put(Gc + i_h * K, tl.cumsum(b_g, axis=0) * 1.4426950408889634, t0, eos, H * K, K, 64, BK)
    if CHECK:
        if tl.sum((b_g > 0).to(tl.int32)) > 0:  # NaN passes, as in the PyTorch check
            tl.store(positive, 1)


@triton.jit
def _fwd_intra_kernel(q, k, Gc, Aqk, Mkk, chunks, cu,
                      H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      DT: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT * 4, H): rows of sub-chunk I of Aqk (q's dtype) and Mkk (float32), ``[TT, H, 64]``: the blocks
    left of the diagonal block (tensor-core products through the sub-chunk's first row) and zeros right of it. The
    diagonal block is ``_fwd_diag_kernel``'s."""
    t0, r0, eos, i_i = _sub_chunk(chunks, cu, tl.program_id(0))
    i_h = tl.program_id(1)
    if r0 >= eos:
        return
    qh = q + (i_h // (H // HK)) * K
    kh = k + (i_h // (H // HK)) * K
    gh = Gc + i_h * K
    o = tl.arange(0, 16)
    ck = tl.arange(0, BK)
    m_i = (o < eos - r0)[:, None] & (ck < K)[None, :]
    b_q = _rows(qh, r0, eos, HK * K, K, 16, BK).to(tl.float32)
    b_k = _rows(kh, r0, eos, HK * K, K, 16, BK).to(tl.float32)
    b_G = _rows(gh, r0, eos, H * K, K, 16, BK)
    b_Gr = tl.load(gh + r0 * (H * K) + ck, mask=ck < K, other=0)
    e_r = tl.exp2(tl.where(m_i, b_G - b_Gr[None, :], float("-inf")))
    b_qr = b_q * e_r
    b_kr = b_k * e_r
    pa = Aqk + i_h * 64 + r0 * (H * 64)
    pm = Mkk + i_h * 64 + r0 * (H * 64)
    m_row = (o < eos - r0)[:, None]
    for i_j in range(0, i_i):  # blocks below the diagonal, through row r
        c0 = t0 + i_j * 16
        b_kj = _rows(kh, c0, eos, HK * K, K, 16, BK).to(tl.float32)
        b_Gj = _rows(gh, c0, eos, H * K, K, 16, BK)
        b_kc = tl.trans(b_kj * tl.exp2(b_Gr[None, :] - b_Gj))
        p = o[:, None] * (H * 64) + i_j * 16 + o[None, :]
        tl.store(pa + p, _dot(b_qr, b_kc, DT, PREC), mask=m_row)
        tl.store(pm + p, _dot(b_kr, b_kc, DT, PREC), mask=m_row)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    for i_j in range(i_i + 1, 4):  # above the diagonal: zeros, so readers load whole rows
        p = o[:, None] * (H * 64) + i_j * 16 + o[None, :]
        tl.store(pa + p, zero, mask=m_row)
        tl.store(pm + p, zero, mask=m_row)


@triton.jit
def _fwd_diag_kernel(q, k, Gc, Aqk, Mkk, chunks, cu,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr,
                     RANGE: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT * 4, H): the diagonal 16x16 block of sub-chunk I of Aqk and Mkk, zeros above its diagonal (and on
    Mkk's). Where every |G_t - G_m| is within RANGE, as one product through the middle row m (fp32 operands); where
    not, pair by pair, exp(G_t - G_i) for i < t only (never a positive exponent): the 120 pairs of the block as 128
    pairs (a, a + d mod 16), d = 1 ... 8 (d = 8 meets each of its pairs twice: half of those are off), BKP channels
    at a time; Aqk[t, t] = q_t . k_t."""
    t0, r0, eos, i_i = _sub_chunk(chunks, cu, tl.program_id(0))
    i_h = tl.program_id(1)
    if r0 >= eos:
        return
    SQ: tl.constexpr = HK * K
    SG: tl.constexpr = H * K
    qh = q + (i_h // (H // HK)) * K + r0 * SQ  # row r0 of the head: rows below count from 0, up to n = eos - r0
    kh = k + (i_h // (H // HK)) * K + r0 * SQ
    gh = Gc + i_h * K + r0 * SG
    n = eos - r0
    d0 = i_h * 64 + r0 * (H * 64) + i_i * 16  # row r0, first column of the diagonal block
    o = tl.arange(0, 16)
    ck = tl.arange(0, BK)
    p_blk = o[:, None] * (H * 64) + o[None, :]
    m_i = (o < n)[:, None] & (ck < K)[None, :]
    x, in_range = _mid_exponents(_rows(gh, 0, n, SG, K, 16, BK), gh, 0, n, SG, K, m_i, BK, RANGE)
    if in_range:  # (X_I ⊙ exp(G - G_m)) (K_I ⊙ exp(G_m - G))ᵀ: one factor >= 1, both within 2^RANGE
        b_k = _rows(kh, 0, n, SQ, K, 16, BK).to(tl.float32)
        b_kd = tl.trans(b_k * tl.exp2(tl.where(m_i, -x, float("-inf"))))
        e_up = tl.exp2(tl.where(m_i, x, float("-inf")))
        b_aqk = _dotf(_rows(qh, 0, n, SQ, K, 16, BK).to(tl.float32) * e_up, b_kd, PREC)
        m_row = (o < n)[:, None]
        tl.store(Aqk + d0 + p_blk, tl.where(o[None, :] <= o[:, None], b_aqk, 0.0), mask=m_row)
        tl.store(Mkk + d0 + p_blk, tl.where(o[None, :] < o[:, None], _dotf(b_k * e_up, b_kd, PREC), 0.0),
                 mask=m_row)
        return
    p = tl.arange(0, 128)
    pa = p // 8
    pb = (pa + p % 8 + 1) % 16
    pt = tl.maximum(pa, pb)
    pi = tl.minimum(pa, pb)
    m_p = ((p % 8 < 7) | (pa < 8)) & (pt < n)
    c = tl.arange(0, BKP)
    b_a = tl.zeros([128], dtype=tl.float32)
    b_m = tl.zeros([128], dtype=tl.float32)
    b_d = tl.zeros([16], dtype=tl.float32)
    for c0 in range(0, K, BKP):
        m = m_p[:, None] & (c < K - c0)[None, :]
        b_kt = tl.load(kh + c0 + (pt[:, None] * SQ + c[None, :]), mask=m, other=0).to(tl.float32)
        b_ki = tl.load(kh + c0 + (pi[:, None] * SQ + c[None, :]), mask=m, other=0).to(tl.float32)
        b_qt = tl.load(qh + c0 + (pt[:, None] * SQ + c[None, :]), mask=m, other=0).to(tl.float32)
        e = tl.exp2(tl.where(m, tl.load(gh + c0 + (pt[:, None] * SG + c[None, :]), mask=m, other=0)
                             - tl.load(gh + c0 + (pi[:, None] * SG + c[None, :]), mask=m, other=0), float("-inf")))
        b_kie = b_ki * e
        b_a += tl.sum(b_qt * b_kie, 1)
        b_m += tl.sum(b_kt * b_kie, 1)
        md = (o < n)[:, None] & (c < K - c0)[None, :]
        p_d = o[:, None] * SQ + c0 + c[None, :]
        b_d += tl.sum(tl.load(qh + p_d, mask=md, other=0).to(tl.float32)
                      * tl.load(kh + p_d, mask=md, other=0).to(tl.float32), 1)
    p_pair = pt * (H * 64) + pi
    tl.store(Aqk + d0 + p_pair, b_a, mask=m_p)
    tl.store(Mkk + d0 + p_pair, b_m, mask=m_p)
    m_up = (o < n)[:, None] & (o[None, :] >= o[:, None])  # on and above the diagonal: no pair writes there
    tl.store(Aqk + d0 + p_blk, tl.where(o[None, :] == o[:, None], b_d[:, None], 0.0), mask=m_up)
    tl.store(Mkk + d0 + p_blk, tl.zeros([16, 16], dtype=tl.float32), mask=m_up)


@triton.jit
def _blk(M, t0, eos, i_h, H: tl.constexpr, I: tl.constexpr, J: tl.constexpr):
    """Block (I, J) ``[16, 16]`` of a chunk's ``[64, 64]`` matrix stored ``[TT, H, 64]``, fp32."""
    return _rows(M + i_h * 64 + J * 16, t0 + I * 16, eos, H * 64, 16, 16, 16).to(tl.float32)


@triton.jit
def _put_blk(M, x, t0, eos, i_h, H: tl.constexpr, I: tl.constexpr, J: tl.constexpr):
    _put(M + i_h * 64 + J * 16, x, t0 + I * 16, eos, H * 64, 16, 16, 16)


@triton.jit
def _fwd_solve_kernel(Mkk, beta, A, chunks, cu, H: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT, H): A = (I + diag(β) Mkk)^{-1} from 16x16 diagonal inverses merged by block products."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    b0 = _vec(beta + i_h, t0, eos, H, 16)[:, None]
    b1 = _vec(beta + i_h, t0 + 16, eos, H, 16)[:, None]
    b2 = _vec(beta + i_h, t0 + 32, eos, H, 16)[:, None]
    b3 = _vec(beta + i_h, t0 + 48, eos, H, 16)[:, None]
    N00 = inv_unit_lower16(_blk(Mkk, t0, eos, i_h, H, 0, 0) * b0)
    N11 = inv_unit_lower16(_blk(Mkk, t0, eos, i_h, H, 1, 1) * b1)
    N22 = inv_unit_lower16(_blk(Mkk, t0, eos, i_h, H, 2, 2) * b2)
    N33 = inv_unit_lower16(_blk(Mkk, t0, eos, i_h, H, 3, 3) * b3)
    L10 = _blk(Mkk, t0, eos, i_h, H, 1, 0) * b1
    L20 = _blk(Mkk, t0, eos, i_h, H, 2, 0) * b2
    L21 = _blk(Mkk, t0, eos, i_h, H, 2, 1) * b2
    L30 = _blk(Mkk, t0, eos, i_h, H, 3, 0) * b3
    L31 = _blk(Mkk, t0, eos, i_h, H, 3, 1) * b3
    L32 = _blk(Mkk, t0, eos, i_h, H, 3, 2) * b3
    N10 = -_dotf(N11, _dotf(L10, N00, PREC), PREC)
    N21 = -_dotf(N22, _dotf(L21, N11, PREC), PREC)
    N32 = -_dotf(N33, _dotf(L32, N22, PREC), PREC)
    N20 = -_dotf(N22, _dotf(L20, N00, PREC) + _dotf(L21, N10, PREC), PREC)
    N31 = -_dotf(N33, _dotf(L31, N11, PREC) + _dotf(L32, N21, PREC), PREC)
    N30 = -_dotf(N33, _dotf(L30, N00, PREC) + _dotf(L31, N10, PREC) + _dotf(L32, N20, PREC), PREC)
    Z = tl.zeros([16, 16], dtype=tl.float32)
    _put_blk(A, N00, t0, eos, i_h, H, 0, 0)
    _put_blk(A, Z, t0, eos, i_h, H, 0, 1)
    _put_blk(A, Z, t0, eos, i_h, H, 0, 2)
    _put_blk(A, Z, t0, eos, i_h, H, 0, 3)
    _put_blk(A, N10, t0, eos, i_h, H, 1, 0)
    _put_blk(A, N11, t0, eos, i_h, H, 1, 1)
    _put_blk(A, Z, t0, eos, i_h, H, 1, 2)
    _put_blk(A, Z, t0, eos, i_h, H, 1, 3)
    _put_blk(A, N20, t0, eos, i_h, H, 2, 0)
    _put_blk(A, N21, t0, eos, i_h, H, 2, 1)
    _put_blk(A, N22, t0, eos, i_h, H, 2, 2)
    _put_blk(A, Z, t0, eos, i_h, H, 2, 3)
    _put_blk(A, N30, t0, eos, i_h, H, 3, 0)
    _put_blk(A, N31, t0, eos, i_h, H, 3, 1)
    _put_blk(A, N32, t0, eos, i_h, H, 3, 2)
    _put_blk(A, N33, t0, eos, i_h, H, 3, 3)


@triton.jit
def _fwd_wu_kernel(k, v, beta, Gc, A, w, ut, chunks, cu,
                   H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT, H): W = A (β ⊙ K ⊙ exp(G)) and U~ = A (β ⊙ V)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    b_A = _rows(A + i_h * 64, t0, eos, H * 64, 64, 64, 64)
    b_b = _vec(beta + i_h, t0, eos, H, 64)[:, None]
    ck = tl.arange(0, BK)
    m = (tl.arange(0, 64) < eos - t0)[:, None] & (ck < K)[None, :]
    b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
    b_k = _rows(k + (i_h // (H // HK)) * K, t0, eos, HK * K, K, 64, BK).to(tl.float32)
    b_kg = b_k * tl.exp2(tl.where(m, b_G, float("-inf"))) * b_b
    _put(w + i_h * K, _dotf(b_A, b_kg, PREC), t0, eos, H * K, K, 64, BK)
    for vb in range(0, V, BV):
        b_v = _rows(v + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV).to(tl.float32) * b_b
        _put(ut + i_h * V + vb, _dotf(b_A, b_v, PREC), t0, eos, H * V, V - vb, 64, BV)


@triton.jit
def _walk(cu, coff, s0, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
          USE_S0: tl.constexpr):
    """A sequential program on grid (N, H, NV): (head, sequence [bos, eos), its first chunk, the starting [BK, BV]
    tile of Sᵀ from ``s0`` ``[N, H, V, K]`` (zeros without USE_S0), its mask, its offsets there and in a per-chunk
    state ``[K, V]``)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_s = (ck < K)[:, None] & (cv < V)[None, :]
    p_end = (i_n * H + i_h) * (V * K) + cv[None, :] * K + ck[:, None]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + p_end, mask=m_s, other=0).to(tl.float32)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    return i_h, bos, eos, tl.load(coff + i_n).to(tl.int64), b_s, m_s, p_end, ck[:, None] * V + cv[None, :]


@triton.jit
def _fwd_h_kernel(k, Gc, w, ut, h, vnew, s0, sT, cu, coff,
                  H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr,
                  DT: tl.constexpr, PREC: tl.constexpr):
    """Grid (N, H, NV): over a sequence's chunks, store each start state Sᵀ and U = U~ - W Sᵀ, then
    Sᵀ <- exp(G_C) ⊙ Sᵀ + (K ⊙ exp(G_C - G))ᵀ U."""
    i_h, bos, eos, c0, b_s, m_s, p_end, p_h = _walk(cu, coff, s0, H, K, V, BK, BV, USE_S0)
    i_v = tl.program_id(2)
    ck = tl.arange(0, BK)
    kh = k + (i_h // (H // HK)) * K
    for j in range(0, tl.cdiv(eos - bos, 64)):
        t0 = bos + j * 64
        tl.store(h + ((c0 + j) * H + i_h) * (K * V) + p_h, b_s.to(h.dtype.element_ty), mask=m_s)
        b_w = _rows(w + i_h * K, t0, eos, H * K, K, 64, BK)
        b_u = _rows(ut + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, 64, BV).to(tl.float32) \
            - _dot(b_w, b_s, DT, PREC)
        _put(vnew + i_h * V + i_v * BV, b_u, t0, eos, H * V, V - i_v * BV, 64, BV)
        last = tl.minimum(t0 + 64, eos) - 1
        b_gl = tl.load(Gc + last * (H * K) + i_h * K + ck, mask=ck < K, other=0)
        m = (tl.arange(0, 64) < eos - t0)[:, None] & (ck < K)[None, :]
        b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
        b_kd = _rows(kh, t0, eos, HK * K, K, 64, BK).to(tl.float32) \
            * tl.exp2(tl.where(m, b_gl[None, :] - b_G, float("-inf")))
        b_s = b_s * tl.exp2(b_gl)[:, None] + _dot(tl.trans(b_kd), b_u, DT, PREC)
    if STORE_S:
        tl.store(sT + p_end, b_s, mask=m_s)


@triton.jit
def _fwd_o_kernel(q, Gc, h, Aqk, vnew, o, chunks, cu, scale,
                  H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT * NV, H): O = scale ((Q ⊙ exp(G)) Sᵀ + Aqk U)."""
    scale = tl.cast(scale, tl.float32)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_v = i_p // NV, i_p % NV
    t0, eos = _chunk(chunks, cu, i_c, 64)
    ck = tl.arange(0, BK)
    m = (tl.arange(0, 64) < eos - t0)[:, None] & (ck < K)[None, :]
    b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
    b_qg = _rows(q + (i_h // (H // HK)) * K, t0, eos, HK * K, K, 64, BK).to(tl.float32) \
        * tl.exp2(tl.where(m, b_G, float("-inf")))
    b_h = _rows(h + (i_c.to(tl.int64) * H + i_h) * (K * V) + i_v * BV, 0, K, V, V - i_v * BV, BK, BV)
    b_o = _dot(b_qg, b_h, DT, PREC)
    b_a = _rows(Aqk + i_h * 64, t0, eos, H * 64, 64, 64, 64)
    b_u = _rows(vnew + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, 64, BV)
    b_o += _dot(b_a, b_u, DT, PREC)
    _put(o + i_h * V + i_v * BV, b_o * scale, t0, eos, H * V, V - i_v * BV, 64, BV)


# ============================================================================ backward
@triton.jit
def _bwd_du_local_kernel(Aqk, vnew, do, dAqk, du, chunks, cu, scale,
                         H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                         PREC: tl.constexpr):
    """Grid (NT, H): dAqk = scale dO Uᵀ (lower triangle) and the local part of dU, scale Aqkᵀ dO."""
    scale = tl.cast(scale, tl.float32)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    o = tl.arange(0, 64)
    b_at = _rows_t(Aqk + i_h * 64, t0, eos, H * 64, 64, 64, 64)  # Aqkᵀ, loaded transposed
    b_da = tl.zeros([64, 64], dtype=tl.float32)
    for vb in range(0, V, BV):
        b_do = _rows(do + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_ut = _rows_t(vnew + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_da += _dot(b_do, b_ut, DT, PREC)
        _put(du + i_h * V + vb, _dot(b_at, b_do, DT, PREC) * scale, t0, eos, H * V, V - vb, 64, BV)
    _put(dAqk + i_h * 64, tl.where(o[:, None] >= o[None, :], b_da * scale, 0.0), t0, eos, H * 64, 64, 64, 64)


@triton.jit
def _bwd_dhu_kernel(q, k, Gc, w, do, du, dh, dsT, ds0, cu, coff, scale,
                    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, USE_DST: tl.constexpr, STORE_DS0: tl.constexpr,
                    DT: tl.constexpr, PREC: tl.constexpr):
    """Grid (N, H, NV), reverse over a sequence's chunks: store each end-state gradient dS'ᵀ, complete
    dU += (K ⊙ exp(G_C - G)) dS'ᵀ, then dSᵀ = exp(G_C) ⊙ dS'ᵀ + scale (Q ⊙ exp(G))ᵀ dO - Wᵀ dU."""
    scale = tl.cast(scale, tl.float32)
    i_h, bos, eos, c0, b_ds, m_s, p_end, p_h = _walk(cu, coff, dsT, H, K, V, BK, BV, USE_DST)
    i_v = tl.program_id(2)
    ck = tl.arange(0, BK)
    kh = k + (i_h // (H // HK)) * K
    qh = q + (i_h // (H // HK)) * K
    NTn = tl.cdiv(eos - bos, 64)
    for jj in range(0, NTn):
        j = NTn - 1 - jj
        t0 = bos + j * 64
        tl.store(dh + ((c0 + j) * H + i_h) * (K * V) + p_h, b_ds.to(dh.dtype.element_ty), mask=m_s)
        last = tl.minimum(t0 + 64, eos) - 1
        b_gl = tl.load(Gc + last * (H * K) + i_h * K + ck, mask=ck < K, other=0)
        m = (tl.arange(0, 64) < eos - t0)[:, None] & (ck < K)[None, :]
        b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
        b_kd = _rows(kh, t0, eos, HK * K, K, 64, BK).to(tl.float32) \
            * tl.exp2(tl.where(m, b_gl[None, :] - b_G, float("-inf")))
        b_du = _rows(du + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, 64, BV).to(tl.float32) \
            + _dot(b_kd, b_ds, DT, PREC)
        _put(du + i_h * V + i_v * BV, b_du, t0, eos, H * V, V - i_v * BV, 64, BV)
        b_qgt = tl.trans(_rows(qh, t0, eos, HK * K, K, 64, BK).to(tl.float32)
                         * tl.exp2(tl.where(m, b_G, float("-inf"))) * scale)
        b_do = _rows(do + i_h * V + i_v * BV, t0, eos, H * V, V - i_v * BV, 64, BV)
        b_wt = _rows_t(w + i_h * K, t0, eos, H * K, K, 64, BK)
        b_ds = b_ds * tl.exp2(b_gl)[:, None] + _dot(b_qgt, b_do, DT, PREC) - _dot(b_wt, b_du, DT, PREC)
    if STORE_DS0:
        tl.store(ds0 + p_end, b_ds, mask=m_s)


@triton.jit
def _bwd_inter_kernel(k, Gc, h, dh, vnew, do, du, dq, dkn, dw, later, chunks, cu, scale,
                      H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT, H): the state terms. dq = scale exp(G) ⊙ dO S, dk (through the end-of-chunk decay)
    = exp(G_C - G) ⊙ U dS', dW = -dU S, and the last row's dG: exp(G_C) ⊙ Σ_dv S ⊙ dS' + Σ_t k ⊙ that dk."""
    scale = tl.cast(scale, tl.float32)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    ck = tl.arange(0, BK)
    b_dq = tl.zeros([64, BK], dtype=tl.float32)
    b_dk = tl.zeros([64, BK], dtype=tl.float32)
    b_dw = tl.zeros([64, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    hb = h + (i_c.to(tl.int64) * H + i_h) * (K * V)
    dhb = dh + (i_c.to(tl.int64) * H + i_h) * (K * V)
    for vb in range(0, V, BV):
        b_st = _rows_t(hb + vb, 0, K, V, V - vb, BK, BV)  # S [BV, BK]: the stored Sᵀ loaded transposed
        b_dst = _rows_t(dhb + vb, 0, K, V, V - vb, BK, BV)
        b_do = _rows(do + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_u = _rows(vnew + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_du = _rows(du + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_dq += _dot(b_do, b_st, DT, PREC)
        b_dk += _dot(b_u, b_dst, DT, PREC)
        b_dw += _dot(b_du, b_st, DT, PREC)
        b_hdh += tl.sum(b_st.to(tl.float32) * b_dst.to(tl.float32), 0)
    m = (tl.arange(0, 64) < eos - t0)[:, None] & (ck < K)[None, :]
    last = tl.minimum(t0 + 64, eos) - 1
    b_gl = tl.load(Gc + last * (H * K) + i_h * K + ck, mask=ck < K, other=0)
    b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
    b_dq = b_dq * tl.exp2(tl.where(m, b_G, float("-inf"))) * scale
    b_dk = b_dk * tl.exp2(tl.where(m, b_gl[None, :] - b_G, float("-inf")))
    b_k = _rows(k + (i_h // (H // HK)) * K, t0, eos, HK * K, K, 64, BK).to(tl.float32)
    b_later = tl.exp2(b_gl) * b_hdh + tl.sum(b_k * b_dk, 0)
    _put(dq + i_h * K, b_dq, t0, eos, H * K, K, 64, BK)
    _put(dkn + i_h * K, b_dk, t0, eos, H * K, K, 64, BK)
    _put(dw + i_h * K, -b_dw, t0, eos, H * K, K, 64, BK)
    tl.store(later + (i_c.to(tl.int64) * H + i_h) * K + ck, b_later, mask=ck < K)


@triton.jit
def _bwd_wy_kernel(k, v, beta, Gc, A, Mkk, dw, du, dkp, dv, dbeta, dMkk, chunks, cu,
                   H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Grid (NT, H): back through W = A (β K ⊙ exp(G)), U~ = A (β V) and A = (I + diag(β) Mkk)^{-1}: dv, dβ, the W
    term of dk (into dkp) and dMkk."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk(chunks, cu, i_c, 64)
    o = tl.arange(0, 64)
    ck = tl.arange(0, BK)
    m = (o < eos - t0)[:, None] & (ck < K)[None, :]
    b_at = _rows_t(A + i_h * 64, t0, eos, H * 64, 64, 64, 64)  # Aᵀ, loaded transposed
    b_b = _vec(beta + i_h, t0, eos, H, 64)
    b_G = _rows(Gc + i_h * K, t0, eos, H * K, K, 64, BK)
    b_kg = _rows(k + (i_h // (H // HK)) * K, t0, eos, HK * K, K, 64, BK).to(tl.float32) \
        * tl.exp2(tl.where(m, b_G, float("-inf")))
    b_dw = _rows(dw + i_h * K, t0, eos, H * K, K, 64, BK)
    b_da = _dotf(b_dw, tl.trans(b_kg * b_b[:, None]), PREC)
    b_dkgb = _dotf(b_at, b_dw, PREC)  # d(β K ⊙ exp(G))
    b_db = tl.sum(b_dkgb * b_kg, 1)
    _put(dkp + i_h * K, b_dkgb * b_b[:, None] * tl.exp2(tl.where(m, b_G, float("-inf"))), t0, eos, H * K, K,
         64, BK)
    for vb in range(0, V, BV):
        b_du = _rows(du + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV)
        b_v = _rows(v + i_h * V + vb, t0, eos, H * V, V - vb, 64, BV).to(tl.float32)
        b_da += _dotf(b_du, tl.trans(b_v * b_b[:, None]), PREC)
        b_dvb = _dotf(b_at, b_du, PREC)  # d(β V)
        b_db += tl.sum(b_dvb * b_v, 1)
        _put(dv + i_h * V + vb, b_dvb * b_b[:, None], t0, eos, H * V, V - vb, 64, BV)
    strict = o[:, None] > o[None, :]
    b_da = tl.where(strict, b_da, 0.0)
    b_dl = tl.where(strict, -_dotf(b_at, _dotf(b_da, b_at, PREC), PREC), 0.0)
    b_m = _rows(Mkk + i_h * 64, t0, eos, H * 64, 64, 64, 64)
    b_db += tl.sum(b_dl * b_m, 1)
    _put(dMkk + i_h * 64, b_dl * b_b[:, None], t0, eos, H * 64, 64, 64, 64)
    tl.store(dbeta + (t0 + o) * H + i_h, b_db, mask=o < eos - t0)


@triton.jit
def _bwd_diag_products(p_d, p_m, r0, eos, b_q, b_k, x, m_i, H: tl.constexpr, PREC: tl.constexpr):
    """(dq, dk as a row of Mkk, dk as a column) of the diagonal block of the sub-chunk from row r0 through its
    middle row (x = G - G_m, within range): the gradients of _fwd_diag's products. p_d, p_m: dAqk and dMkk at the
    block's first column."""
    o = tl.arange(0, 16)
    e_up = tl.exp2(tl.where(m_i, x, float("-inf")))
    e_dn = tl.exp2(tl.where(m_i, -x, float("-inf")))
    low = o[:, None] >= o[None, :]  # [t, i]: i <= t
    up = o[:, None] <= o[None, :]  # [i, t] of the transposed loads
    b_kd = b_k * e_dn
    a_q = e_up * _dotf(tl.where(low, _rows(p_d, r0, eos, H * 64, 16, 16, 16), 0.0), b_kd, PREC)
    a_r = e_up * _dotf(tl.where(low & ~up, _rows(p_m, r0, eos, H * 64, 16, 16, 16), 0.0), b_kd, PREC)
    a_c = e_dn * (_dotf(tl.where(up, _rows_t(p_d, r0, eos, H * 64, 16, 16, 16), 0.0), b_q * e_up, PREC)
                  + _dotf(tl.where(up & ~low, _rows_t(p_m, r0, eos, H * 64, 16, 16, 16), 0.0), b_k * e_up, PREC))
    return a_q, a_r, a_c


@triton.jit
def _bwd_diag_pairs(p_d, p_m, qh, kh, gh, r0, eos, nk, b_G, m_i, H: tl.constexpr, HK: tl.constexpr,
                    K: tl.constexpr, BK: tl.constexpr):
    """The same pair by pair, at any decay: row t = r0 + j; one exponent <= 0 a pair serves both directions."""
    o = tl.arange(0, 16)
    ck = tl.arange(0, BK)
    a_q = tl.zeros([16, BK], dtype=tl.float32)
    a_r = tl.zeros([16, BK], dtype=tl.float32)
    a_c = tl.zeros([16, BK], dtype=tl.float32)
    for j in tl.range(0, 16, loop_unroll_factor=2):
        t = r0 + j
        t_ok = ck * 0 + t < eos
        b_qt = tl.load(qh + t * (HK * K) + ck, mask=(ck < nk) & t_ok, other=0).to(tl.float32)
        b_kt = tl.load(kh + t * (HK * K) + ck, mask=(ck < nk) & t_ok, other=0).to(tl.float32)
        b_Gt = tl.load(gh + t * (H * K) + ck, mask=(ck < nk) & t_ok, other=0)
        o_ok = o * 0 + t < eos
        p_c = (r0 + o) * (H * 64) + j  # column t, rows of I: [i, t]
        p_r = t * (H * 64) + o  # row t, columns of I: [t, i]
        c_ok = (o < eos - r0) & (o >= j)
        r_ok = (o <= j) & o_ok
        b_ac = tl.load(p_d + p_c, mask=c_ok, other=0)
        b_ar = tl.load(p_d + p_r, mask=r_ok, other=0)
        b_mc = tl.load(p_m + p_c, mask=c_ok, other=0)
        b_mr = tl.load(p_m + p_r, mask=r_ok, other=0)
        d = tl.where((o >= j)[:, None], b_G - b_Gt[None, :], b_Gt[None, :] - b_G)
        e = tl.exp2(tl.where(m_i & o_ok[:, None], d, float("-inf")))
        a_q += b_ac[:, None] * b_kt[None, :] * e
        a_r += b_mc[:, None] * b_kt[None, :] * e
        a_c += (b_ar[:, None] * b_qt[None, :] + b_mr[:, None] * b_kt[None, :]) * e
    return a_q, a_r, a_c


@triton.jit
def _bwd_intra_kernel(q, k, Gc, dAqk, dMkk, dq, dkn, dkp, later, dq_out, dk_out, dg, chunks, cu,
                      H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NKS: tl.constexpr,
                      PREC: tl.constexpr, RANGE: tl.constexpr, PAIRS: tl.constexpr):
    """Grid (NT * NKS, H), the channel slice fastest: BK channels from ch0 (nothing here mixes channels, so the
    NKS programs of a chunk share only its dAqk and dMkk rows, through L2). The sub-chunk sums through Aqk and Mkk,
    added to the state and W terms; dq, dk (per value head, fp32) and dg, the reverse cumulative sum of dG over the
    chunk (sub-chunks from the last). Launched twice: without PAIRS it takes the chunk slices whose diagonal blocks
    are all within RANGE (products only: no pair loop holding registers), with PAIRS the others (products where a
    block allows, pairs where not)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_c = i_p // NKS
    ch0 = (i_p % NKS) * BK
    nk = K - ch0  # channels of this slice below K: the columns the loads and stores keep
    t0, eos = _chunk(chunks, cu, i_c, 64)
    qh = q + (i_h // (H // HK)) * K + ch0
    kh = k + (i_h // (H // HK)) * K + ch0
    gh = Gc + i_h * K + ch0
    o = tl.arange(0, 16)
    ck = tl.arange(0, BK)
    all_in = t0 >= 0  # (True)
    for i_i in tl.static_range(0, 4):
        r0 = t0 + i_i * 16
        if r0 < eos:
            m_i = (o < eos - r0)[:, None] & (ck < nk)[None, :]
            all_in = all_in & _mid_exponents(_rows(gh, r0, eos, H * K, nk, 16, BK), gh, r0, eos, H * K, nk, m_i,
                                             BK, RANGE)[1]
    if all_in == PAIRS:  # the other launch's
        return
    carry = tl.load(later + (i_c.to(tl.int64) * H + i_h) * K + ch0 + ck, mask=ck < nk, other=0)
    for i_i in tl.static_range(3, -1, -1):  # a constexpr: the bounds of the static loops over J below
        r0 = t0 + i_i * 16
        if r0 < eos:  # a sub-chunk past the sequence adds nothing (its decays would read rows of no token)
            m_i = (o < eos - r0)[:, None] & (ck < nk)[None, :]
            b_q = _rows(qh, r0, eos, HK * K, nk, 16, BK).to(tl.float32)
            b_k = _rows(kh, r0, eos, HK * K, nk, 16, BK).to(tl.float32)
            b_G = _rows(gh, r0, eos, H * K, nk, 16, BK)
            r_ok = ck * 0 + r0 < eos
            b_Gr = tl.load(gh + r0 * (H * K) + ck, mask=(ck < nk) & r_ok, other=0)
            n = tl.minimum(r0 + 15, eos - 1)
            b_Gn = tl.load(gh + n * (H * K) + ck, mask=(ck < nk) & r_ok, other=0)
            # sub-chunks J < I, through the first row r of I
            b_dq = tl.zeros([16, BK], dtype=tl.float32)
            b_dkr = tl.zeros([16, BK], dtype=tl.float32)
            for i_j in tl.static_range(0, i_i):
                c0 = t0 + i_j * 16
                b_kc = _rows(kh, c0, eos, HK * K, nk, 16, BK).to(tl.float32) \
                    * tl.exp2(b_Gr[None, :] - _rows(gh, c0, eos, H * K, nk, 16, BK))
                b_dq += _dotf(_rows(dAqk + i_h * 64 + i_j * 16, r0, eos, H * 64, 16, 16, 16), b_kc, PREC)
                b_dkr += _dotf(_rows(dMkk + i_h * 64 + i_j * 16, r0, eos, H * 64, 16, 16, 16), b_kc, PREC)
            e_r = tl.exp2(tl.where(m_i, b_G - b_Gr[None, :], float("-inf")))
            b_dq = b_dq * e_r
            b_dkr = b_dkr * e_r
            # sub-chunks J > I, through the last row n of I
            b_dkc = tl.zeros([16, BK], dtype=tl.float32)
            for i_j in tl.static_range(i_i + 1, 4):
                c0 = t0 + i_j * 16
                m_j = (o < eos - c0)[:, None] & (ck < nk)[None, :]
                e_n = tl.exp2(tl.where(m_j, _rows(gh, c0, eos, H * K, nk, 16, BK) - b_Gn[None, :], float("-inf")))
                b_qn = _rows(qh, c0, eos, HK * K, nk, 16, BK).to(tl.float32) * e_n
                b_kn = _rows(kh, c0, eos, HK * K, nk, 16, BK).to(tl.float32) * e_n
                b_dkc += _dotf(_rows_t(dAqk + i_h * 64 + i_i * 16, c0, eos, H * 64, 16, 16, 16), b_qn, PREC)
                b_dkc += _dotf(_rows_t(dMkk + i_h * 64 + i_i * 16, c0, eos, H * 64, 16, 16, 16), b_kn, PREC)
            b_dkc = b_dkc * tl.exp2(tl.where(m_i, b_Gn[None, :] - b_G, float("-inf")))
            x, in_range = _mid_exponents(b_G, gh, r0, eos, H * K, nk, m_i, BK, RANGE)
            p_d = dAqk + i_h * 64 + i_i * 16  # the diagonal block's columns
            p_m = dMkk + i_h * 64 + i_i * 16
            if PAIRS:
                if in_range:
                    a_q, a_r, a_c = _bwd_diag_products(p_d, p_m, r0, eos, b_q, b_k, x, m_i, H, PREC)
                else:
                    a_q, a_r, a_c = _bwd_diag_pairs(p_d, p_m, qh, kh, gh, r0, eos, nk, b_G, m_i, H, HK, K, BK)
            else:
                a_q, a_r, a_c = _bwd_diag_products(p_d, p_m, r0, eos, b_q, b_k, x, m_i, H, PREC)
            b_dq += a_q
            b_dkr += a_r
            b_dkc += a_c
            b_dqt = _rows(dq + i_h * K + ch0, r0, eos, H * K, nk, 16, BK) + b_dq
            b_neg = _rows(dkn + i_h * K + ch0, r0, eos, H * K, nk, 16, BK) + b_dkc
            b_pos = _rows(dkp + i_h * K + ch0, r0, eos, H * K, nk, 16, BK) + b_dkr
            _put(dq_out + i_h * K + ch0, b_dqt, r0, eos, H * K, nk, 16, BK)
            _put(dk_out + i_h * K + ch0, b_neg + b_pos, r0, eos, H * K, nk, 16, BK)
            b_dG = b_q * b_dqt + b_k * (b_pos - b_neg)
            _put(dg + i_h * K + ch0, tl.cumsum(b_dG, axis=0, reverse=True) + carry[None, :], r0, eos, H * K, nk,
                 16, BK)
            carry += tl.sum(b_dG, 0)


# ============================================================================ fused recurrent (decode)
@triton.jit
def _fused_recurrent_kernel(q, k, v, g, beta, s0, o, sT, cu, scale,
                            H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr):
    """Grid (N, H, NV): token by token against S ``[BV, dk]`` in registers (fp32)."""
    scale = tl.cast(scale, tl.float32)
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    m_s = m_v[:, None] & m_k[None, :]
    p_s = (i_n * H + i_h) * (V * K) + cv[:, None] * K + ck[None, :]
    b_s = tl.zeros([BV, BK], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + p_s, mask=m_s, other=0).to(tl.float32)
    kh = i_h // (H // HK)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * HK + kh) * K + ck, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + (t * HK + kh) * K + ck, mask=m_k, other=0).to(tl.float32)
        b_g = tl.load(g + (t * H + i_h) * K + ck, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + cv, mask=m_v, other=0).to(tl.float32)
        b_b = tl.load(beta + t * H + i_h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)[None, :]
        b_u = b_b * (b_v - tl.sum(b_s * b_k[None, :], 1))
        b_s = b_s + b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1) * scale
        tl.store(o + (t * H + i_h) * V + cv, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_S:
        tl.store(sT + p_s, b_s, mask=m_s)


# ============================================================================ launch
class _Seqs:
    """The chunks of one call: sequence boundaries ``cu`` ``[N + 1]``, per-sequence first chunks ``coff`` and the
    (sequence, chunk) pair of every chunk ``chunks`` ``[NT, 2]``."""

    def __init__(self, B: int, T: int, cu_seqlens, device):
        if cu_seqlens is None:
            per = triton.cdiv(T, BT)
            self.N, self.NT = B, B * per
            self.cu = torch.arange(B + 1, device=device, dtype=torch.int64) * T
            self.coff = torch.arange(B + 1, device=device, dtype=torch.int64) * per
            seq = torch.arange(B, device=device, dtype=torch.int64).repeat_interleave(per)
            self.chunks = torch.stack([seq, torch.arange(per, device=device, dtype=torch.int64).repeat(B)], 1)
        else:
            self.N = cu_seqlens.numel() - 1
            self.cu = cu_seqlens.to(device=device, dtype=torch.int64).contiguous()
            self.coff, self.chunks, self.NT = prepare_varlen(self.cu, BT)
        self.chunks = self.chunks.contiguous()


#: chunk tables of uniform batches by (B, T, device) (``cached_uniform``)
_UNIFORM_SEQS: dict = {}


def seqs_for(B: int, T: int, cu_seqlens, device) -> _Seqs:
    """The chunk table of this batch: built once per uniform shape, and once per ``cu_seqlens`` tensor (every layer
    of a model is handed the same one)."""
    if cu_seqlens is not None:
        return cached_on(cu_seqlens, ("kda_seqs", str(device)), lambda: _Seqs(B, T, cu_seqlens, device))
    return cached_uniform(_UNIFORM_SEQS, (B, T, device), device, lambda: _Seqs(B, T, None, device))


#: launch options of each kernel on a GPU for 16-bit inputs (lazoo.bench.kernel_resources compiles every kernel with
#: them for Hopper at the blocks ``_blocks`` gives, and a test holds each within a Hopper block's shared memory; the
#: interpreter ignores them). 8 warps where a program holds several [64, dk] fp32 tiles (at 4 they spill at dk = 128);
#: two pipeline stages but in _fwd_h (three asked for 295 424 bytes of shared memory in _bwd_dhu for fp32 inputs and
#: 246 784 for bf16; in _fwd_h they fit and took the H200 forward from 3.13 to 3.06 ms at T = 1k, 3.12 to 3.03 at 8k).
#: _bwd_inter runs unpipelined: with two stages Triton (3.6 to 3.9) leaves its dk and dW products (wgmma) in flight
#: while it copies the next value block of S, dS' and dU into the single buffers they read. That race fits the bf16
#: errors measured on an H200, dk, dg and dβ against float64 six times dq's and dv's (only the dq product was sure to
#: be done before the copies), which the kernels' arithmetic, run exactly in the interpreter, does not give;
#: ``kernel_resources.inflight_refills`` finds such copies in the compiled kernel.
LAUNCH = {
    "cumsum": dict(num_warps=4, num_stages=1),
    "fwd_intra": dict(num_warps=4, num_stages=1),
    "fwd_diag": dict(num_warps=4, num_stages=1),
    "fwd_solve": dict(num_warps=1, num_stages=1),
    "fwd_wu": dict(num_warps=4, num_stages=2),
    "fwd_h": dict(num_warps=8, num_stages=3),
    "fwd_o": dict(num_warps=4, num_stages=2),
    "bwd_du_local": dict(num_warps=4, num_stages=2),
    "bwd_dhu": dict(num_warps=8, num_stages=2),
    "bwd_inter": dict(num_warps=8, num_stages=1),
    "bwd_wy": dict(num_warps=8, num_stages=2),
    "bwd_intra": dict(num_warps=4, num_stages=1),
    "fused_recurrent": dict(num_warps=4, num_stages=1),
}
#: for fp32 inputs (4-byte operand tiles, fp32 per-chunk states, tf32x3 products): one stage where two would not fit
#: (_bwd_dhu, _bwd_inter) or buy nothing, more warps for the tiles
LAUNCH_FP32 = {**LAUNCH, **{name: dict(num_warps=8, num_stages=1) for name in (
    "fwd_intra", "fwd_wu", "fwd_h", "bwd_du_local", "bwd_dhu", "bwd_inter", "bwd_wy")}}
#: the most warps _bwd_wy takes at dk = 16 (BK = 16): at 8 warps, fp32 inputs and more than one chunk, Triton 3.6's
#: compiled kernel faulted on an H200 with an illegal memory access (packed and batched alike; dk = 32 and bf16 ran);
#: at 4 it ran, 1.1e-6 off float64 (T = 270, H = 2)
SMALL_DK_WY_WARPS = 4
#: channels of _fwd_diag's gathered [128, BKP] pair tiles
DIAG_CHANNELS = 16
#: the largest |G_t - G_m| (base 2) over a 16-row sub-chunk and its middle row m with which its diagonal block is
#: a product of decayed tiles: factors up to 2^96 leave 2^31 of fp32's range to q, k and the gradients, and keep
#: 2^-96 k in the normal range for |k| > 2^-30. Stronger decays take the pair-by-pair path (exact at any strength).
DIAG_PRODUCT_RANGE = 96.0
#: channels a program of _bwd_intra takes (the interpreter too, so that its tests cover the slices)
INTRA_BWD_CHANNELS = 32
#: value block of the decode kernel on a GPU
DECODE_BV = 32


def launch_options(dtype: torch.dtype) -> dict:
    """``LAUNCH`` or, for fp32 inputs, ``LAUNCH_FP32``."""
    return LAUNCH_FP32 if dtype == torch.float32 else LAUNCH


def _blocks(K: int, V: int, interp: bool):
    """(BK: all of dk, BV: value blocks of the chunk kernels, BVs: of the sequential ones)."""
    BK = next_pow2(K)
    return BK, min(64, next_pow2(V)), (next_pow2(V) if interp else min(64, next_pow2(V)))


def _with_bv(opts: dict, name: str, BV: int, V: int, interp: bool) -> tuple[int, dict]:
    """(value block, launch options) of kernel ``name``: a "BV" in its entry of the option table overrides the
    block from ``_blocks`` on a GPU (what ``experiments/launch_options.py`` sweeps); the interpreter keeps it."""
    cfg = dict(opts[name])
    bv = cfg.pop("BV", None)
    return (BV if bv is None or interp else min(bv, next_pow2(V))), cfg


def wy_launch(opts: dict, BK: int, BV: int, V: int, interp: bool) -> tuple[int, dict]:
    """(value block, launch options) of ``_bwd_wy``: the table's, at most ``SMALL_DK_WY_WARPS`` warps at dk = 16."""
    bv, cfg = _with_bv(opts, "bwd_wy", BV, V, interp)
    if BK <= 16 and not interp:
        cfg["num_warps"] = min(cfg.get("num_warps", 4), SMALL_DK_WY_WARPS)
    return bv, cfg


def chunk_fwd(q, k, v, g, beta, S0, scale: float, seqs: _Seqs, output_final_state: bool, gate_check=None):
    """Forward on flattened inputs (module docstring): ``(o, final state or None, saved)``. ``gate_check``: None or
    an object with ``flag`` (int32 ``[1]``, zeros), set to 1 by the first kernel where a g > 0 is met, and
    ``queued()``, called right after that kernel's launch (``lazoo.ops.checks.KernelRangeCheck``)."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    dev = q.device
    interp = dev.type == "cpu"
    DT, PREC = dot_types(q)
    BK, BV, BVs = _blocks(K, V, interp)
    opts = launch_options(q.dtype)
    f32 = torch.float32
    NT, N = seqs.NT, seqs.N
    Gc = torch.empty(TT, H, K, device=dev, dtype=f32)
    _cumsum_kernel[(NT, H)](g, Gc, Gc if gate_check is None else gate_check.flag, seqs.chunks, seqs.cu, H=H, K=K,
                            BK=BK, CHECK=gate_check is not None, **opts["cumsum"])
    if gate_check is not None:
        gate_check.queued()
    Aqk = torch.empty(TT, H, BT, device=dev, dtype=q.dtype)  # its readers take it in q's dtype (_dot)
    Mkk = torch.empty(TT, H, BT, device=dev, dtype=f32)
    _fwd_intra_kernel[(NT * NC, H)](q, k, Gc, Aqk, Mkk, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, BK=BK, DT=DT,
                                    PREC=PREC, **opts["fwd_intra"])
    _fwd_diag_kernel[(NT * NC, H)](q, k, Gc, Aqk, Mkk, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, BK=BK,
                                   BKP=min(DIAG_CHANNELS, BK), RANGE=DIAG_PRODUCT_RANGE, PREC=PREC, **opts["fwd_diag"])
    A = torch.empty(TT, H, BT, device=dev, dtype=f32)
    _fwd_solve_kernel[(NT, H)](Mkk, beta, A, seqs.chunks, seqs.cu, H=H, PREC=PREC, **opts["fwd_solve"])
    w = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    ut = torch.empty(TT, H, V, device=dev, dtype=q.dtype)
    bv, cfg = _with_bv(opts, "fwd_wu", BV, V, interp)
    _fwd_wu_kernel[(NT, H)](k, v, beta, Gc, A, w, ut, seqs.chunks, seqs.cu, H=H, HK=HK, K=K, V=V, BK=BK, BV=bv,
                            PREC=PREC, **cfg)
    h = torch.empty(NT, H, K, V, device=dev, dtype=chunk_state_dtype(q.dtype))
    vnew = torch.empty(TT, H, V, device=dev, dtype=q.dtype)
    sT = torch.empty(N, H, V, K, device=dev, dtype=f32) if output_final_state else A
    bv, cfg = _with_bv(opts, "fwd_h", BVs, V, interp)
    _fwd_h_kernel[(N, H, triton.cdiv(V, bv))](
        k, Gc, w, ut, h, vnew, S0 if S0 is not None else A, sT, seqs.cu, seqs.coff, H=H, HK=HK, K=K, V=V, BK=BK,
        BV=bv, USE_S0=S0 is not None, STORE_S=output_final_state, DT=DT, PREC=PREC, **cfg)
    o = torch.empty(TT, H, V, device=dev, dtype=v.dtype)
    bv, cfg = _with_bv(opts, "fwd_o", BV, V, interp)
    _fwd_o_kernel[(NT * triton.cdiv(V, bv), H)](
        q, Gc, h, Aqk, vnew, o, seqs.chunks, seqs.cu, scale, H=H, HK=HK, K=K, V=V, BK=BK, BV=bv, DT=DT, PREC=PREC,
        **cfg)
    return o, (sT if output_final_state else None), (Gc, Aqk, Mkk, A, w, vnew, h)


def chunk_bwd(q, k, v, g, beta, S0, scale, seqs: _Seqs, saved, do, dsT, need_ds0: bool):
    """Gradients ``(dq, dk, dv, dg, dbeta, ds0)`` of the flattened inputs."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    dev = q.device
    interp = dev.type == "cpu"
    DT, PREC = dot_types(q)
    BK, BV, BVs = _blocks(K, V, interp)
    opts = launch_options(q.dtype)
    f32 = torch.float32
    NT, N = seqs.NT, seqs.N
    Gc, Aqk, Mkk, A, w, vnew, h = saved
    dAqk = torch.empty(TT, H, BT, device=dev, dtype=f32)
    du = torch.empty(TT, H, V, device=dev, dtype=f32)
    bv, cfg = _with_bv(opts, "bwd_du_local", BV, V, interp)
    _bwd_du_local_kernel[(NT, H)](Aqk, vnew, do, dAqk, du, seqs.chunks, seqs.cu, scale, H=H, V=V, BV=bv, DT=DT,
                                  PREC=PREC, **cfg)
    dh = torch.empty(NT, H, K, V, device=dev, dtype=h.dtype)
    ds0 = torch.empty(N, H, V, K, device=dev, dtype=f32) if need_ds0 else A
    bv, cfg = _with_bv(opts, "bwd_dhu", BVs, V, interp)
    _bwd_dhu_kernel[(N, H, triton.cdiv(V, bv))](
        q, k, Gc, w, do, du, dh, dsT if dsT is not None else A, ds0, seqs.cu, seqs.coff, scale, H=H, HK=HK, K=K,
        V=V, BK=BK, BV=bv, USE_DST=dsT is not None, STORE_DS0=need_ds0, DT=DT, PREC=PREC, **cfg)
    dq = torch.empty(TT, H, K, device=dev, dtype=f32)
    dkn = torch.empty(TT, H, K, device=dev, dtype=f32)
    dw = torch.empty(TT, H, K, device=dev, dtype=f32)
    later = torch.empty(NT, H, K, device=dev, dtype=f32)
    bv, cfg = _with_bv(opts, "bwd_inter", BV, V, interp)
    _bwd_inter_kernel[(NT, H)](k, Gc, h, dh, vnew, do, du, dq, dkn, dw, later, seqs.chunks, seqs.cu, scale, H=H,
                               HK=HK, K=K, V=V, BK=BK, BV=bv, DT=DT, PREC=PREC, **cfg)
    dkp = torch.empty(TT, H, K, device=dev, dtype=f32)
    dv = torch.empty_like(v)
    dbeta = torch.empty(TT, H, device=dev, dtype=f32)
    dMkk = torch.empty(TT, H, BT, device=dev, dtype=f32)
    bv, cfg = wy_launch(opts, BK, BV, V, interp)
    _bwd_wy_kernel[(NT, H)](k, v, beta, Gc, A, Mkk, dw, du, dkp, dv, dbeta, dMkk, seqs.chunks, seqs.cu, H=H, HK=HK,
                            K=K, V=V, BK=BK, BV=bv, PREC=PREC, **cfg)
    grouped = H != HK
    dq_out = dq if grouped or q.dtype == f32 else torch.empty_like(q)
    dk_out = dkn if grouped or k.dtype == f32 else torch.empty_like(k)
    dg = torch.empty(TT, H, K, device=dev, dtype=g.dtype)
    BKi = min(BK, INTRA_BWD_CHANNELS)  # channel slices: more, smaller programs
    NKS = triton.cdiv(K, BKi)
    for pairs in (False, True):
        _bwd_intra_kernel[(NT * NKS, H)](q, k, Gc, dAqk, dMkk, dq, dkn, dkp, later, dq_out, dk_out, dg, seqs.chunks,
                                         seqs.cu, H=H, HK=HK, K=K, BK=BKi, NKS=NKS, PREC=PREC,
                                         RANGE=DIAG_PRODUCT_RANGE, PAIRS=pairs, **opts["bwd_intra"])
    if grouped:  # each key head's gradient: the sum over the value heads it serves
        dq_out, dk_out = (x.view(TT, HK, H // HK, K).sum(2).to(q.dtype) for x in (dq_out, dk_out))
    return dq_out, dk_out, dv, dg, dbeta.to(beta.dtype), (ds0 if need_ds0 else None)


class ChunkKDAFunction(torch.autograd.Function):
    """KDA, chunk-parallel, with a hand-written backward (see ``chunk_kda``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, output_final_state, gate_check):
        B, T, HK, K = q.shape
        H, V = v.shape[2:]
        seqs = seqs_for(B, T, cu_seqlens, q.device)
        qf, kf = (x.reshape(B * T, HK, K).contiguous() for x in (q, k))
        vf = v.reshape(B * T, H, V).contiguous()
        gf = g.reshape(B * T, H, K).contiguous()
        bf = beta.reshape(B * T, H).contiguous()
        S0 = None if initial_state is None else initial_state.contiguous()
        o, sT, saved = chunk_fwd(qf, kf, vf, gf, bf, S0, float(scale), seqs, output_final_state, gate_check)
        ctx.save_for_backward(qf, kf, vf, gf, bf, S0, *saved)
        ctx.seqs, ctx.scale, ctx.shapes = seqs, float(scale), (B, T, HK, H, K, V)
        ctx.s0_dtype = None if initial_state is None else initial_state.dtype
        return o.view(B, T, H, V), sT

    @staticmethod
    def backward(ctx, do, dsT):
        qf, kf, vf, gf, bf, S0, *saved = ctx.saved_tensors
        B, T, HK, H, K, V = ctx.shapes
        do = do.reshape(B * T, H, V).contiguous()
        dsT = None if dsT is None else dsT.contiguous().float()
        need_ds0 = S0 is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dg, db, ds0 = chunk_bwd(qf, kf, vf, gf, bf, S0, ctx.scale, ctx.seqs, saved, do, dsT, need_ds0)
        return (dq.view(B, T, HK, K), dk.view(B, T, HK, K), dv.view(B, T, H, V), dg.view(B, T, H, K),
                db.view(B, T, H), None if ds0 is None else ds0.to(ctx.s0_dtype), None, None, None, None)


def _check(op: str, q, k, v, g, beta, cu_seqlens) -> None:
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype of float32/float16/bfloat16, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    K, V = q.shape[-1], v.shape[-1]
    if not (16 <= K <= MAX_HEAD_DIM and 16 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"{op}: head dims from 16 to {MAX_HEAD_DIM}, got dk={K}, dv={V}")
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"{op}: k must have q's shape {tuple(q.shape)} and v [B, T, m·H, dv], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(g.shape) != (*v.shape[:3], K) or not g.is_floating_point():
        raise ValueError(f"{op}: g must be a float tensor [B, T, HV, dk] = {(*v.shape[:3], K)}, got {g.dtype} "
                         f"{tuple(g.shape)}")
    if tuple(beta.shape) != tuple(v.shape[:3]) or not beta.is_floating_point():
        raise ValueError(f"{op}: beta must be a float tensor [B, T, HV] = {tuple(v.shape[:3])}, got {beta.dtype} "
                         f"{tuple(beta.shape)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch is packed along time, so B must be 1, got {q.shape[0]}")


def chunk_kda(q, k, v, g, beta, *, scale: float, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, gate_check=None):
    """KDA, chunk-parallel and differentiable in q, k, v, g, β and the initial state: ``(o [B, T, HV, dv] in v's
    dtype, final state [N, HV, dv, dk] float32 or None)``.

    q, k ``[B, T, H, dk]`` (normalised by the caller), v ``[B, T, HV, dv]`` (HV = m·H), g ``[B, T, HV, dk]`` log
    decays (float32 or q's dtype), beta ``[B, T, HV]``, initial_state ``[N, HV, dv, dk]``, ``cu_seqlens`` ``[N + 1]``
    (B = 1) or None. Head dims 16 to ``KDA_MAX_HEAD_DIM``. ``gate_check``: the caller's check that g <= 0, made by
    the first kernel (``chunk_fwd``)."""
    _check("chunk_kda", q, k, v, g, beta, cu_seqlens)
    return ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, float(scale), cu_seqlens, bool(output_final_state),
                                  gate_check)


def fused_recurrent_kda(q, k, v, g, beta, *, scale: float, initial_state=None, output_final_state: bool = False,
                        cu_seqlens=None):
    """KDA token by token against a state, forward only (decoding); the layout of ``chunk_kda``."""
    _check("fused_recurrent_kda", q, k, v, g, beta, cu_seqlens)
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    dev = q.device
    interp = dev.type == "cpu"
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu = (torch.arange(B + 1, device=dev, dtype=torch.int64) * T if cu_seqlens is None
          else cu_seqlens.to(device=dev, dtype=torch.int64))
    BK = next_pow2(K)
    BV = next_pow2(V) if interp else min(next_pow2(V), DECODE_BV)
    opts = launch_options(q.dtype)
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    sT = torch.empty(N, H, V, K, device=dev, dtype=torch.float32) if output_final_state else o
    S0 = None if initial_state is None else initial_state.contiguous()
    _fused_recurrent_kernel[(N, H, triton.cdiv(V, BV))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        S0 if S0 is not None else o, o, sT, cu, float(scale), H=H, HK=HK, K=K, V=V, BK=BK, BV=BV,
        USE_S0=S0 is not None, STORE_S=output_final_state, **opts["fused_recurrent"])
    return o, (sT if output_final_state else None)
