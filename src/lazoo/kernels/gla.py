"""Chunk-parallel Triton kernels for GLA (a log decay per key dim) with a hand-written backward.

Rule, per sequence and head (``h = S^T`` ``[dk, dv]`` is the state in the kernels' layout):

    S_t = S_{t-1} diag(exp(g_t)) + v_t k_t^T,        o_t = scale * S_t q_t,     g ``[B, T, H, dk]`` <= 0

Chunks of ``BT = 64`` tokens (never straddling a packed sequence), ``G`` the cumulative log decay
inside a chunk (per key dim, stored in float32 in base 2, ``log2(e)`` times the natural one, so that every
decay is one ``exp2``; the formulas below write it in base e), ``H_n`` the state at the start of chunk ``n``:

    O       = scale * ((Q ⊙ exp(G)) H_n + A V),      A_ij = Σ_d q_id k_jd exp(G_id - G_jd)  (i >= j)
    H_{n+1} = diag(exp(G_C)) H_n + (K ⊙ exp(G_C - G))^T V

Inside a chunk G can fall to -1000s, so ``exp(±G)`` is never formed on its own. ``A`` is built from
16-row sub-chunks: off-diagonal blocks (sub-chunk I > J) through the first row r of I,
``(Q_I ⊙ exp(G_I - G_r)) (K_J ⊙ exp(G_r - G_J))^T`` (both exponents <= 0); diagonal blocks pair by pair,
``exp(G_i - G_j)`` for i >= j only. Every exponent in these kernels is <= 0 (or masked to -inf).

Backward (``dH_n`` the gradient of the state at the end of chunk n, ``dA_ij = scale do_i · v_j``):

    dH_{n-1} = diag(exp(G_C)) dH_n + scale (Q ⊙ exp(G))^T dO
    dV = scale A^T dO + (K ⊙ exp(G_C - G)) dH_n
    dQ = scale exp(G) ⊙ dO H_n^T + [Σ_j dA_ij k_j ⊙ exp(G_i - G_j)]
    dK = exp(G_C - G) ⊙ V dH_n^T + [Σ_i dA_ij q_i ⊙ exp(G_i - G_j)]
    dg = reverse cumsum over the sequence of (q ⊙ dq - k ⊙ dk), plus (dS_T ⊙ S_T) summed over dv at
         the last token of each sequence (the final state), per key dim

Scaling the state's key dims by e^ε and every later q, k by e^∓ε changes no output, so the part of that
sum from the chunks after chunk n, with the final state's term, is Σ_dv H_{n+1} ⊙ dH_n; with
H_{n+1} = diag(exp(G_C)) H_n + (K ⊙ exp(G_C - G))^T V that is exp(G_C) ⊙ Σ_dv H_n ⊙ dH_n plus the chunk's
Σ_t k_t ⊙ (its inter-chunk part of dk_t). So dg needs no pass over the sequence: each chunk adds it to
its own reverse cumsum.
The bracketed sums use the same sub-chunk split as A (off-diagonal blocks through a reference row:
the first row of I for dq, its last row for dk; diagonal blocks pair by pair, dq and dk in one pass with one
exponent a pair).

Kernels: ``_cumsum`` (G), ``_fwd_h`` (states at chunk starts; the only sequential forward pass),
``_fwd_A`` (A, per sub-chunk pair), ``_fwd_o``; ``_bwd_dh`` (sequential, reverse), ``_bwd_dA``,
``_bwd_dv``, ``_bwd_intra`` (the bracketed sums), ``_bwd_inter`` (the state terms; dq, dk in the
inputs' dtype; dg in g's).

Precision: products take 16-bit operands for 16-bit inputs where both are bounded by the inputs
(decay factors <= 1), fp32 accumulation; the per-chunk states are float32 (bfloat16 for bfloat16
inputs, as in lazoo.kernels.linear) and enter their products in that type (tf32 for fp16 inputs);
fp32 inputs use tf32x3 products (about fp32 accuracy); A, dA, G, the intra-chunk parts of dq and dk and the
state carried between chunks are float32.

Triton 3.4-3.7 on Hopper miscompiles ``tl.trans`` of a ``tl.dot`` result (see lazoo.kernels.delta):
these kernels never transpose anything; transposed operands (``K^T``, ``A^T``, ``dA^T``, ``H^T``,
``dH^T``) are loaded from memory in transposed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._chunk_layout import ChunkLayout
from ._launch import chunk_state_dtype, dot_types, state_blocks
from ._tiles import chunk_bounds, end_state, load_end_state, state_program, store_chunk_state
from ._utils import next_pow2
from .limits import GLA_MAX_HEAD_DIM as MAX_HEAD_DIM
from .limits import KERNEL_DTYPES

#: chunk and sub-chunk sizes
CHUNK = 64
SUB = 16
#: largest tile along a head dim (the kernels loop over blocks of it; tests lower it to cover the loops)
MAX_BLOCK = 64
#: key blocks of A's off-diagonal and diagonal sub-chunk blocks (within MAX_BLOCK and 2 * MAX_BLOCK)
A_BK = 32
DIAG_BK = 128
#: warps of the sub-chunk kernels' programs (16-row tiles; fla 0.6.0's autotuning also picks one warp for its
#: kernels of the same shape on the H200)
INTRA_WARPS = 1
#: warps of _bwd_inter. At 4 it spills 36 B offline (255 registers, sm_90) and is still the faster: H200, GLA fwd +
#: bwd at T = 1k / 8k / 32k, 5.30 / 5.55 / 6.53 ms against 5.75 / 5.98 / 6.97 at 8 warps, in one run
INTER_WARPS = 4


# ============================================================================ forward kernels
@triton.jit
def _cumsum_kernel(g, G, cu_seqlens, chunk_indices, T,
                   H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """Grid (NK, NT, B * H): G = cumulative sum of g inside each chunk (float32, base 2)."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    o_t = i_c * BT + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m = (o_t < T_seq)[:, None] & (o_k < K)[None, :]
    p = (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
    b_g = tl.load(g + p, mask=m, other=0.0).to(tl.float32)
    tl.store(G + p, tl.cumsum(b_g, axis=0) * 1.4426950408889634, mask=m)  # base 2: times log2(e)


@triton.jit
def _fwd_h_kernel(
    k, v, G, h, h0, ht, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NK * NV, N * H): store the state at the start of every chunk, then the final state."""
    i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv = state_program(cu_seqlens, chunk_offsets, T, H, K, V, BT, BK,
                                                                   BV, IS_VARLEN)
    m_k = o_k < K
    b_h = load_end_state(h0, i_nh, o_k, o_v, m_kv, K, V, BK, BV, USE_H0)
    for i_t in range(NT):
        store_chunk_state(h, b_h, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T_seq
        last = tl.minimum(i_t * BT + BT, T_seq) - 1
        m_kt = m_k[:, None] & m_t[None, :]
        p_kt = (bos + o_t[None, :]) * (H * K) + i_h * K + o_k[:, None]  # [BK, BT]
        b_kt = tl.load(k + p_kt, mask=m_kt, other=0.0).to(tl.float32)
        b_Gt = tl.load(G + p_kt, mask=m_kt, other=0.0)
        b_gl = tl.load(G + (bos + last) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
        p_v = v + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        b_kt = b_kt * tl.exp2(b_gl[:, None] - b_Gt)  # exponent <= 0 (k = 0 on masked rows)
        b_h = b_h * tl.exp2(b_gl)[:, None] + tl.dot(b_kt.to(DT), b_v.to(DT), input_precision=PREC)
    if STORE_HT:
        tl.store(end_state(ht, i_nh, o_k, o_v, K, V), b_h, mask=m_kv)


@triton.jit
def _below_diagonal(p, NC: tl.constexpr):
    """Block (I, J), I > J, of the p-th program in the order (1, 0), (2, 0), (2, 1), (3, 0), ..."""
    i = p * 0 + 1
    for s in tl.static_range(1, NC - 1):
        past = p >= s
        p = tl.where(past, p - s, p)
        i = tl.where(past, i + 1, i)
    return i, p


@triton.jit
def _fwd_A_kernel(
    q, k, G, A, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    DIAG: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NC (NC - 1) / 2, or NC with DIAG; NT; B * H): block (I, J) of A for the rows of sub-chunk I, one
    program per block below the diagonal (I > J) or, DIAG, per diagonal block. A ``[B, T, H, BT]`` float32:
    row t holds A_{t, chunk start + c}; blocks above the diagonal are never written (readers mask them)."""
    i_p, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    if DIAG:
        i_i, i_j = i_p, i_p
    else:
        i_i, i_j = _below_diagonal(i_p, NC)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    t0 = i_c * BT + i_i * BC  # first row of sub-chunk I
    if t0 >= T_seq:
        return
    o_c = tl.arange(0, BC)
    o_i = t0 + o_c
    m_i = o_i < T_seq
    o_j = i_c * BT + i_j * BC + o_c  # all valid when J < I
    b_A = tl.zeros([BC, BC], dtype=tl.float32)
    if not DIAG:
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            m_k = o_k < K
            m_ik = m_i[:, None] & m_k[None, :]
            m_kj = m_k[:, None] & (o_j < T_seq)[None, :]
            p_i = (bos + o_i[:, None]) * (H * K) + i_h * K + o_k[None, :]
            p_jt = (bos + o_j[None, :]) * (H * K) + i_h * K + o_k[:, None]  # [BK, BC]
            b_q = tl.load(q + p_i, mask=m_ik, other=0.0).to(tl.float32)
            b_Gi = tl.load(G + p_i, mask=m_ik, other=0.0)
            b_kt = tl.load(k + p_jt, mask=m_kj, other=0.0).to(tl.float32)
            b_Gjt = tl.load(G + p_jt, mask=m_kj, other=0.0)
            b_Gr = tl.load(G + (bos + t0) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
            b_qg = b_q * tl.exp2(tl.where(m_ik, b_Gi - b_Gr[None, :], float("-inf")))
            b_kg = b_kt * tl.exp2(b_Gr[:, None] - b_Gjt)
            b_A += tl.dot(b_qg.to(DT), b_kg.to(DT), input_precision=PREC)
    else:  # diagonal block: exact per pair, exp(G_i - G_j) for i >= j only
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            m_k = o_k < K
            m_ik = m_i[:, None] & m_k[None, :]
            p_i = (bos + o_i[:, None]) * (H * K) + i_h * K + o_k[None, :]
            b_q = tl.load(q + p_i, mask=m_ik, other=0.0).to(tl.float32)
            b_Gi = tl.load(G + p_i, mask=m_ik, other=0.0)
            for j in range(0, BC):
                m_j = m_k & (t0 + j + o_k * 0 < T_seq)
                p_j = (bos + t0 + j) * (H * K) + i_h * K + o_k
                b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
                b_Gj = tl.load(G + p_j, mask=m_j, other=0.0)
                keep = m_ik & (o_c >= j)[:, None]
                b_e = tl.exp2(tl.where(keep, b_Gi - b_Gj[None, :], float("-inf")))
                b_a = tl.sum(b_q * b_kj[None, :] * b_e, axis=1)
                b_A += tl.where(o_c[None, :] == j, b_a[:, None], 0.0)
    p_A = A + (bos + o_i[:, None]) * (H * BT) + i_h * BT + i_j * BC + o_c[None, :]
    tl.store(p_A, b_A, mask=m_i[:, None])


@triton.jit
def _fwd_o_kernel(
    q, v, G, h, A, o, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NV, NT, B * H): O = scale ((Q ⊙ exp(G)) H_n + A V) for one chunk."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    o_c = tl.arange(0, BT)
    o_t = i_c * BT + o_c
    m_t = o_t < T_seq
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_q = (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
        b_q = tl.load(q + p_q, mask=m_tk, other=0.0).to(tl.float32)
        b_G = tl.load(G + p_q, mask=m_tk, other=0.0)
        b_qg = b_q * tl.exp2(b_G)
        p_h = h + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_qg.to(b_h.dtype), b_h, input_precision=PREC)
    m_A = m_t[:, None] & (o_c[:, None] >= o_c[None, :])
    b_A = tl.load(A + (bos + o_t[:, None]) * (H * BT) + i_h * BT + o_c[None, :], mask=m_A, other=0.0)
    p_v = (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
    b_o = (b_o + tl.dot(b_A.to(DT), b_v.to(DT), input_precision=PREC)) * scale
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)


# ============================================================================ backward kernels
@triton.jit
def _bwd_dh_kernel(
    q, do, G, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NK * NV, N * H): the gradient of the state at the end of every chunk, in reverse."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv = state_program(cu_seqlens, chunk_offsets, T, H, K, V, BT, BK,
                                                                   BV, IS_VARLEN)
    m_k = o_k < K
    b_dh = load_end_state(dht, i_nh, o_k, o_v, m_kv, K, V, BK, BV, USE_DHT)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        store_chunk_state(dh, b_dh, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T_seq
        last = tl.minimum(i_t * BT + BT, T_seq) - 1
        m_kt = m_k[:, None] & m_t[None, :]
        p_qt = (bos + o_t[None, :]) * (H * K) + i_h * K + o_k[:, None]  # [BK, BT]
        b_qt = tl.load(q + p_qt, mask=m_kt, other=0.0).to(tl.float32)
        b_Gt = tl.load(G + p_qt, mask=m_kt, other=0.0)
        b_gl = tl.load(G + (bos + last) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
        p_do = do + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        b_do = tl.load(p_do, mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
        b_qt = b_qt * tl.exp2(b_Gt) * scale
        b_dh = b_dh * tl.exp2(b_gl)[:, None] + tl.dot(b_qt.to(DT), b_do.to(DT), input_precision=PREC)
    if STORE_DH0:
        tl.store(end_state(dh0, i_nh, o_k, o_v, K, V), b_dh, mask=m_kv)


@triton.jit
def _bwd_dA_kernel(
    v, do, dA, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NT, B * H): dA = scale dO V^T (lower triangle; zeros above) ``[B, T, H, BT]``."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    o_c = tl.arange(0, BT)
    o_t = i_c * BT + o_c
    m_t = o_t < T_seq
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        b_do = tl.load(do + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_vt = tl.load(v + (bos + o_t[None, :]) * (H * V) + i_h * V + o_v[:, None],
                       mask=m_v[:, None] & m_t[None, :], other=0.0)
        b_dA += tl.dot(b_do.to(DT), b_vt.to(DT), input_precision=PREC)
    b_dA = tl.where(o_c[:, None] >= o_c[None, :], b_dA * scale, 0.0)
    tl.store(dA + (bos + o_t[:, None]) * (H * BT) + i_h * BT + o_c[None, :], b_dA, mask=m_t[:, None])


@triton.jit
def _bwd_dv_kernel(
    k, G, A, do, dh, dv, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NV, NT, B * H): dV = scale A^T dO + (K ⊙ exp(G_C - G)) dH_n."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    o_c = tl.arange(0, BT)
    o_t = i_c * BT + o_c
    m_t = o_t < T_seq
    last = tl.minimum(i_c * BT + BT, T_seq) - 1
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0).to(tl.float32)
        b_G = tl.load(G + p_k, mask=m_tk, other=0.0)
        b_gl = tl.load(G + (bos + last) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
        b_kg = b_k * tl.exp2(b_gl[None, :] - b_G)
        p_dh = dh + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_dh = tl.load(p_dh, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dv += tl.dot(b_kg.to(b_dh.dtype), b_dh, input_precision=PREC)
    # A^T [j, i] = A[i, j] for i >= j, loaded transposed
    m_At = m_t[None, :] & (o_c[None, :] >= o_c[:, None])
    b_At = tl.load(A + (bos + o_t[None, :]) * (H * BT) + i_h * BT + o_c[:, None], mask=m_At, other=0.0)
    p_do = (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_do = tl.load(do + p_do, mask=m_tv, other=0.0)
    b_dv += tl.dot((b_At * scale).to(DT), b_do.to(DT), input_precision=PREC)
    tl.store(dv + p_do, b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.jit
def _bwd_intra_kernel(
    q, k, G, dA, dq, dk, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NK, NT * NC, B * H): for the rows of sub-chunk I, the intra-chunk parts
    dq_i = Σ_{j<=i} dA_ij k_j ⊙ exp(G_i - G_j) and dk_i = Σ_{t>=i} dA_ti q_t ⊙ exp(G_t - G_i)
    (float32, written to dq and dk; _bwd_inter adds the state terms)."""
    i_k, i_tc, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_t, i_i = i_tc // NC, i_tc % NC
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    t0 = i_c * BT + i_i * BC
    if t0 >= T_seq:
        return
    o_c = tl.arange(0, BC)
    o_i = t0 + o_c
    m_i = o_i < T_seq
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ik = m_i[:, None] & m_k[None, :]
    p_i = (bos + o_i[:, None]) * (H * K) + i_h * K + o_k[None, :]
    b_Gi = tl.load(G + p_i, mask=m_ik, other=0.0)
    p_dA_i = dA + (bos + o_i[:, None]) * (H * BT) + i_h * BT  # rows of I

    # dq, sub-chunks J < I, through the first row r of I: exp(G_i - G_r) Σ_j dA_ij (k_j exp(G_r - G_j))
    b_Gr = tl.load(G + (bos + t0) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(0, i_i):
        o_j = i_c * BT + i_j * BC + o_c  # all valid
        m_jk = (o_j < T_seq)[:, None] & m_k[None, :]
        p_j = (bos + o_j[:, None]) * (H * K) + i_h * K + o_k[None, :]
        b_kj = tl.load(k + p_j, mask=m_jk, other=0.0).to(tl.float32)
        b_Gj = tl.load(G + p_j, mask=m_jk, other=0.0)
        b_kg = b_kj * tl.exp2(b_Gr[None, :] - b_Gj)
        b_dAij = tl.load(p_dA_i + i_j * BC + o_c[None, :], mask=m_i[:, None], other=0.0)
        b_dq += tl.dot(b_dAij.to(DT), b_kg.to(DT), input_precision=PREC)
    b_dq = b_dq * tl.exp2(tl.where(m_ik, b_Gi - b_Gr[None, :], float("-inf")))

    # dk, sub-chunks J > I, through the last row n of I: exp(G_n - G_i) Σ_t dA_ti (q_t exp(G_t - G_n))
    last = tl.minimum(t0 + BC, T_seq) - 1
    b_Gn = tl.load(G + (bos + last) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(i_i + 1, NC):
        o_j = i_c * BT + i_j * BC + o_c
        m_j = o_j < T_seq
        m_jk = m_j[:, None] & m_k[None, :]
        p_j = (bos + o_j[:, None]) * (H * K) + i_h * K + o_k[None, :]
        b_qj = tl.load(q + p_j, mask=m_jk, other=0.0).to(tl.float32)
        b_Gj = tl.load(G + p_j, mask=m_jk, other=0.0)
        b_qg = b_qj * tl.exp2(tl.where(m_jk, b_Gj - b_Gn[None, :], float("-inf")))
        # dA^T [i in I, t in J] = dA[t, i], loaded transposed
        p_dAt = dA + (bos + o_j[None, :]) * (H * BT) + i_h * BT + i_i * BC + o_c[:, None]
        b_dAt = tl.load(p_dAt, mask=m_j[None, :], other=0.0)
        b_dk += tl.dot(b_dAt.to(DT), b_qg.to(DT), input_precision=PREC)
    b_dk = b_dk * tl.exp2(tl.where(m_ik, b_Gn[None, :] - b_Gi, float("-inf")))

    # the diagonal block, pair by pair, dq and dk together. With row t = t0 + j of I and x = G_i - G_t, dq_i takes
    # dA[i, t] k_t exp(x) for i >= t and dk_i takes dA[t, i] q_t exp(-x) for i <= t: one exponent <= 0 a pair
    # serves both (G falls along the chunk; a row past the sequence gives 0, never exp of a positive number)
    for j in range(0, BC):
        t_real = t0 + j + o_c * 0 < T_seq  # row t is real (a tile: the interpreter takes no scalar mask)
        m_j = m_k & (t0 + j + o_k * 0 < T_seq)
        p_j = (bos + t0 + j) * (H * K) + i_h * K + o_k
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_qj = tl.load(q + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_Gj = tl.load(G + p_j, mask=m_j, other=0.0)
        p_dAj = dA + i_h * BT + i_i * BC
        b_dAc = tl.load(p_dAj + (bos + o_i) * (H * BT) + j, mask=m_i & (o_c >= j), other=0.0)  # dA[i, t]
        b_dAr = tl.load(p_dAj + (bos + t0 + j) * (H * BT) + o_c, mask=(o_c <= j) & t_real, other=0.0)  # dA[t, i]
        b_x = tl.where((o_c >= j)[:, None], b_Gi - b_Gj[None, :], b_Gj[None, :] - b_Gi)
        b_e = tl.exp2(tl.where(m_ik & t_real[:, None], b_x, float("-inf")))
        b_dq += b_dAc[:, None] * b_kj[None, :] * b_e
        b_dk += b_dAr[:, None] * b_qj[None, :] * b_e
    tl.store(dq + p_i, b_dq, mask=m_ik)
    tl.store(dk + p_i, b_dk, mask=m_ik)


@triton.jit
def _bwd_inter_kernel(
    q, k, v, G, h, do, dh, dq, dk, dq_out, dk_out, dg, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NK, NT, B * H): dq = scale exp(G) ⊙ dO H_n^T + dq_intra and dk = exp(G_C - G) ⊙ V dH_n^T + dk_intra
    (into dq_out, dk_out in their dtype; they may be dq, dk), and dg: the reverse cumsum of q ⊙ dq - k ⊙ dk inside
    the chunk plus the later chunks' share, Σ_dv H_{n+1} ⊙ dH_n (module docstring), in dg's dtype."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    last = tl.minimum(i_c * BT + BT, T_seq) - 1
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # Σ_dv H_n ⊙ dH_n
    p_h = h + (i_tg * H + i_h) * (K * V)
    p_dh = dh + (i_tg * H + i_h) * (K * V)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        p_v = (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        # H^T and dH^T [BV, BK] (state buffers are [K, V]), loaded transposed
        b_ht = tl.load(p_h + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
        b_dht = tl.load(p_dh + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
        b_dq += tl.dot(b_do.to(b_ht.dtype), b_ht, input_precision=PREC)
        b_dk += tl.dot(b_v.to(b_dht.dtype), b_dht, input_precision=PREC)
        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
    p_k = (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
    b_G = tl.load(G + p_k, mask=m_tk, other=0.0)
    b_gl = tl.load(G + (bos + last) * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0).to(tl.float32)
    b_dk = b_dk * tl.exp2(b_gl[None, :] - b_G)  # the inter-chunk part of dk
    b_later = tl.exp2(b_gl) * b_hdh + tl.sum(b_k * b_dk, axis=0)  # Σ_dv H_{n+1} ⊙ dH_n
    b_dk = b_dk + tl.load(dk + p_k, mask=m_tk, other=0.0)
    tl.store(dk_out + p_k, b_dk.to(dk_out.dtype.element_ty), mask=m_tk)
    b_dq = b_dq * (tl.exp2(b_G) * scale) + tl.load(dq + p_k, mask=m_tk, other=0.0)
    tl.store(dq_out + p_k, b_dq.to(dq_out.dtype.element_ty), mask=m_tk)
    b_q = tl.load(q + p_k, mask=m_tk, other=0.0).to(tl.float32)
    # q ⊙ dq - k ⊙ dk summed over the rows at and after each one inside the chunk (rows past the sequence are 0)
    b_dg = tl.cumsum(b_q * b_dq - b_k * b_dk, axis=0, reverse=True) + b_later[None, :]
    tl.store(dg + p_k, b_dg.to(dg.dtype.element_ty), mask=m_tk)


# ============================================================================ launch helpers
class _Ctx(ChunkLayout):
    """Shapes, chunk maps and tile sizes shared by the forward and the backward."""

    def __init__(self, q, v, cu_seqlens):
        super().__init__(q, v, cu_seqlens, CHUNK)
        K, V = self.K, self.V
        self.BC = SUB
        self.NC = CHUNK // SUB
        self.DT, self.prec = dot_types(q)
        self.state_dtype = chunk_state_dtype(q.dtype)
        self.BK = min(MAX_BLOCK, next_pow2(K))
        self.BV = min(MAX_BLOCK, next_pow2(V))
        self.BKC = self.BK  # sub-chunk kernels
        self.BKA = min(A_BK, self.BK)
        self.BKD = min(DIAG_BK, 2 * MAX_BLOCK, next_pow2(K))
        self.NK = triton.cdiv(K, self.BK)
        self.NV = triton.cdiv(V, self.BV)
        self.state_blocks = state_blocks(K, V, MAX_BLOCK)


def _fwd(c: _Ctx, q, k, v, g, scale, h0, output_final_state):
    dev = q.device
    G = torch.empty(c.B, c.T, c.H, c.K, dtype=torch.float32, device=dev)
    _cumsum_kernel[c.grid(triton.cdiv(c.K, c.BK))](
        g, G, c.cu, c.chunk_indices, c.T, H=c.H, K=c.K, BT=c.BT, BK=c.BK, IS_VARLEN=c.varlen, num_warps=4)

    BKs, BVs = c.state_blocks
    h = torch.empty(c.NT, c.H, c.K, c.V, dtype=c.state_dtype, device=dev)
    ht = torch.empty(c.N, c.H, c.V, c.K, dtype=torch.float32, device=dev) if output_final_state else None
    _fwd_h_kernel[(triton.cdiv(c.K, BKs) * triton.cdiv(c.V, BVs), c.N * c.H)](
        k, v, G, h, h0, ht, c.cu, c.chunk_offsets, c.T, H=c.H, K=c.K, V=c.V, BT=c.BT, BK=BKs, BV=BVs,
        USE_H0=h0 is not None, STORE_HT=output_final_state, IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec,
        num_warps=4, num_stages=2)

    A = torch.empty(c.B, c.T, c.H, c.BT, dtype=torch.float32, device=dev)
    for diag, programs, BK in ((False, c.NC * (c.NC - 1) // 2, c.BKA), (True, c.NC, c.BKD)):
        _fwd_A_kernel[c.grid(programs)](
            q, k, G, A, c.cu, c.chunk_indices, c.T, H=c.H, K=c.K, BT=c.BT, BC=c.BC, BK=BK, DIAG=diag,
            IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec, num_warps=INTRA_WARPS)

    o = torch.empty(c.B, c.T, c.H, c.V, dtype=v.dtype, device=dev)
    _fwd_o_kernel[c.grid(c.NV)](
        q, v, G, h, A, o, c.cu, c.chunk_indices, scale, c.T, H=c.H, K=c.K, V=c.V, BT=c.BT, BK=c.BK,
        BV=c.BV, IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec, num_warps=4, num_stages=2)
    return o, G, h, A, ht


def _bwd(c: _Ctx, q, k, v, G, h, A, scale, do, dht, want_dh0, g_dtype):
    dev = q.device
    BKs, BVs = c.state_blocks
    dh = torch.empty(c.NT, c.H, c.K, c.V, dtype=c.state_dtype, device=dev)
    dh0 = torch.empty(c.N, c.H, c.V, c.K, dtype=torch.float32, device=dev) if want_dh0 else None
    _bwd_dh_kernel[(triton.cdiv(c.K, BKs) * triton.cdiv(c.V, BVs), c.N * c.H)](
        q, do, G, dh, dht, dh0, c.cu, c.chunk_offsets, scale, c.T, H=c.H, K=c.K, V=c.V, BT=c.BT,
        BK=BKs, BV=BVs, USE_DHT=dht is not None, STORE_DH0=want_dh0, IS_VARLEN=c.varlen, DT=c.DT,
        PREC=c.prec, num_warps=4, num_stages=2)

    dA = torch.empty(c.B, c.T, c.H, c.BT, dtype=torch.float32, device=dev)
    _bwd_dA_kernel[c.grid()](
        v, do, dA, c.cu, c.chunk_indices, scale, c.T, H=c.H, V=c.V, BT=c.BT, BV=c.BV,
        IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec, num_warps=4)

    dv = torch.empty_like(v)
    _bwd_dv_kernel[c.grid(c.NV)](
        k, G, A, do, dh, dv, c.cu, c.chunk_indices, scale, c.T, H=c.H, K=c.K, V=c.V, BT=c.BT, BK=c.BK,
        BV=c.BV, IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec, num_warps=4, num_stages=2)

    dq = torch.empty(c.B, c.T, c.H, c.K, dtype=torch.float32, device=dev)
    dk = torch.empty(c.B, c.T, c.H, c.K, dtype=torch.float32, device=dev)
    if c.varlen:
        grid = (triton.cdiv(c.K, c.BKC), c.NT * c.NC, c.H)
    else:
        grid = (triton.cdiv(c.K, c.BKC), triton.cdiv(c.T, c.BT) * c.NC, c.B * c.H)
    _bwd_intra_kernel[grid](
        q, k, G, dA, dq, dk, c.cu, c.chunk_indices, c.T, H=c.H, K=c.K, BT=c.BT, BC=c.BC, BK=c.BKC,
        IS_VARLEN=c.varlen, DT=c.DT, PREC=c.prec, num_warps=INTRA_WARPS)

    # the totals in the inputs' dtype (fp32 inputs: in place of the intra-chunk parts), dg in g's
    dq_out, dk_out = (x if x.dtype == q.dtype else torch.empty_like(q) for x in (dq, dk))
    dg = torch.empty(c.B, c.T, c.H, c.K, dtype=g_dtype, device=dev)
    _bwd_inter_kernel[c.grid(c.NK)](
        q, k, v, G, h, do, dh, dq, dk, dq_out, dk_out, dg, c.cu, c.chunk_indices, scale, c.T, H=c.H, K=c.K,
        V=c.V, BT=c.BT, BK=c.BK, BV=c.BV, IS_VARLEN=c.varlen, PREC=c.prec, num_warps=INTER_WARPS, num_stages=2)
    return dq_out, dk_out, dv, dg, dh0


class ChunkGLAFunction(torch.autograd.Function):
    """GLA (a gate per key dim): chunked forward and hand-written backward; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, output_final_state, cu_seqlens):
        c = _Ctx(q, v, cu_seqlens)
        o, G, h, A, ht = _fwd(c, q, k, v, g, scale, h0, output_final_state)
        ctx.c, ctx.scale = c, scale
        ctx.h0_dtype = None if h0 is None else h0.dtype
        ctx.g_dtype = g.dtype
        ctx.save_for_backward(q, k, v, G, h, A)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, G, h, A = ctx.saved_tensors
        c = ctx.c
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous().float()
        want_dh0 = ctx.h0_dtype is not None
        dq, dk, dv, dg, dh0 = _bwd(c, q, k, v, G, h, A, ctx.scale, do, dht, want_dh0, ctx.g_dtype)
        if dh0 is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        return dq, dk, dv, dg, dh0, None, None, None


# ============================================================================ public entry point
def chunk_gla(q, k, v, g, *, scale: float, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None):
    """GLA (gate per key dim), chunk-parallel: ``(o [B, T, H, dv] in v's dtype, final state
    [N, H, dv, dk] float32 or None)``.

    q, k ``[B, T, H, dk]``, v ``[B, T, H, dv]`` of one dtype (float32/float16/bfloat16); g
    ``[B, T, H, dk]`` log decay (<= 0; a float dtype, read in float32); initial_state ``[N, H, dv, dk]``;
    cu_seqlens ``[N + 1]`` int (B must be 1) or None. Differentiable in q, k, v, g and initial_state.
    Head dims up to MAX_HEAD_DIM (ValueError beyond).
    """
    dk, dv = q.shape[-1], v.shape[-1]
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise ValueError(f"chunk_gla: head dims up to {MAX_HEAD_DIM} are supported, got dk={dk}, dv={dv}")
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"chunk_gla: q, k, v must share one dtype of float32/float16/bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not g.is_floating_point():
        raise ValueError(f"chunk_gla: g must be a float tensor, got {g.dtype}")
    if tuple(g.shape) != tuple(q.shape):
        raise ValueError(f"chunk_gla: g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"chunk_gla: with cu_seqlens, B must be 1, got {q.shape[0]}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.contiguous()  # any float dtype: the cumsum kernel reads it in float32, dg comes back in it
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    return ChunkGLAFunction.apply(q, k, v, g, initial_state, float(scale), bool(output_final_state), cu_seqlens)
