"""Triton kernels for linear attention and gated linear attention (scalar log decay per head).

Recurrence, per sequence and head (``h = S^T`` is the state in the kernels' ``[dk, dv]`` layout):

    h_t = exp(g_t) h_{t-1} + k_t v_t^T,        o_t = scale * h_t^T q_t         (g = 0: no decay)

Chunk-parallel form with chunks of ``BT`` tokens, ``G`` the cumulative log decay inside a chunk,
``H_n`` the state at the start of chunk ``n`` and ``Γ_ij = exp(G_i - G_j)`` for ``i >= j``:

    O       = scale * (exp(G) ⊙ Q H_n + (Q K^T ⊙ Γ) V)
    H_{n+1} = exp(G_C) H_n + (exp(G_C - G) ⊙ K)^T V

Backward (``dH_n`` the gradient of the state at the end of chunk ``n``):

    dH_{n-1} = exp(G_C) dH_n + scale * (exp(G) ⊙ Q)^T dO
    dQ = scale * (exp(G) ⊙ dO H_n^T + (dO V^T ⊙ Γ) K)
    dK = scale * (dO V^T ⊙ Γ)^T Q + exp(G_C - G) ⊙ V dH_n^T
    dV = scale * (Q K^T ⊙ Γ)^T dO + exp(G_C - G) ⊙ K dH_n
    dg = reverse cumsum inside the chunk of (q·dq - k·dk), the chunk's last token also taking
         <dH_n, H_{n+1}> = exp(G_C) <dH_n, H_n> + Σ v·dv through dH_n (what the rest of the sequence adds; a
         reverse cumsum over the whole sequence reaches it through terms that cancel: 0.25-1 relative error
         in Mamba-2's dA = Σ dt·dg at bf16 and T = 512-2048, 1-2e-2 this way).

Kernels: ``_fwd_h`` (states at chunk starts, sequential over chunks), ``_fwd_o`` (outputs, parallel
over chunks), ``_bwd_dh`` (state gradients, sequential in reverse), ``_bwd_dqkv`` (parallel over
chunks) and ``_fused_recurrent`` (decoding a few tokens against a state, no autograd). At long T
with few sequences × heads, the two sequential walks run in segments side by side (``_segments``):
each segment's sum, a prefix sum over the segments, then the walks from each segment's start (not with
a decay: ``lazoo.kernels._segments``).

Grouped heads: q and k may have HK heads and v, g, the states H = m·HK, value head h reading q and k of head
h // m (Mamba-2's B and C groups). The output and gradient kernels take a block of HB value heads of one key head
per program: their scores q k^T are formed once, and no per-head copy of q or k is written. The backward sums dq and
dk over a program's heads; where a key head's m heads take several programs (the backward runs one head a program),
each writes its part in q's dtype and the parts are summed afterwards in float32.

Conventions (see lazoo.ops): q/k ``[B, T, HK, dk]``, v ``[B, T, H, dv]``, g ``[B, T, H]``, states
``[N, H, dv, dk]`` in float32; ``cu_seqlens`` packs N sequences into B = 1. Inputs may be fp32,
fp16 or bf16; every loaded value is cast to fp32 before element-wise arithmetic, ``tl.dot`` takes
16-bit operands where the inputs are 16-bit and accumulates in fp32.

Hopper + Triton 3.4-3.7.0 miscompiles ``tl.trans`` of a ``tl.dot`` result fed to another
``tl.dot`` (why flash-linear-attention refuses its gated backward there). These
kernels never transpose a computed matrix: where a transposed product is needed (``dS^T``,
``A^T``) it is computed directly from operands loaded in transposed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _segments
from ._chunk_layout import ChunkLayout
from ._launch import chunk_state_dtype, dqkv_configs, fill_device, launch_first_fitting, state_blocks
from ._segments import segment_bounds, state_walks, walk_segments
from ._tiles import chunk_bounds, end_state, load_end_state, seq_bounds, state_program, store_chunk_state
from ._utils import device_unsupported, next_pow2, num_sms
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES
from .limits import LINEAR_MAX_HEAD_DIM as MAX_HEAD_DIM

#: the state walks in segments (``_segments.walk_segments``): at least this many, and chunks per segment forced
#: (tests: segments at small T; None: walk_segments decides)
MIN_SEGMENTS = _segments.MIN_SEGMENTS
FORCE_SEGMENT_CHUNKS = None
#: value heads per program of the output and gradient kernels with grouped heads (tests; None:
#: ``_heads_per_program`` decides); it must divide the value heads per key head
FORCE_HEADS_PER_PROGRAM = None
#: ``_heads_per_program`` keeps at least this many programs per multiprocessor
PROGRAMS_PER_SM = 4


# ============================================================================ kernels
@triton.jit
def _key_rows(a, bos, o_t, m_t, i_hk, o_k, HK: tl.constexpr, K: tl.constexpr):
    """Tokens o_t of key head i_hk of a ``[.., HK, K]`` (q or k) at key dims o_k, [BT, BK] in a's dtype, zeros past
    the sequence (m_t) and the key dim."""
    p = a + (bos + o_t[:, None]) * (HK * K) + i_hk * K + o_k[None, :]
    return tl.load(p, mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)


@triton.jit
def _key_cols(a, bos, o_t, m_t, i_hk, o_k, HK: tl.constexpr, K: tl.constexpr):
    """``_key_rows`` loaded transposed: [BK, BT]."""
    p = a + (bos + o_t[None, :]) * (HK * K) + i_hk * K + o_k[:, None]
    return tl.load(p, mask=m_t[None, :] & (o_k[:, None] < K), other=0.0)


@triton.jit
def _chunk_tiles(a, b, bos, i_t, T_seq, i_h, o_k, o_v, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr):
    """Chunk i_t of a ``[.., HK, K]`` (q or k: the key head of value head i_h) loaded transposed (a^T [BK, BT]) and
    of b ``[.., H, V]`` ([BT, BV]), in their storage dtypes, zeros past the sequence."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    b_at = _key_cols(a, bos, o_t, m_t, i_h // (H // HK), o_k, HK, K)
    p_b = b + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
    b_b = tl.load(p_b, mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)
    return b_at, b_b


@triton.jit
def _chunk_decay(g, bos, i_t, T_seq, i_h, H: tl.constexpr, BT: tl.constexpr):
    """(G [BT], G_C): the cumulative log decay inside chunk i_t and its total, in fp32."""
    o_t = i_t * BT + tl.arange(0, BT)
    b_g = tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T_seq, other=0.0).to(tl.float32)
    return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)


@triton.jit
def _fwd_h_kernel(
    k, v, g, h, h0, ht, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, SEG: tl.constexpr, STORE_CHUNKS: tl.constexpr,
):
    """Grid (NK * NV, N * H, S): store the state at the start of every chunk, then the final state. With S
    segments of SEG chunks (``_segments.walk_segments``), a program walks one segment, from and to its own rows of h0
    and ht (``[N, H, S, V, K]``); without STORE_CHUNKS it only sums (the segments' totals)."""
    i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv = state_program(cu_seqlens, chunk_offsets, T, H, K, V, BT, BK,
                                                                   BV, IS_VARLEN)
    i_st, lo, hi = segment_bounds(i_nh, NT, SEG)
    b_h = load_end_state(h0, i_st, o_k, o_v, m_kv, K, V, BK, BV, USE_H0)
    for i_t in range(lo, hi):
        if STORE_CHUNKS:
            store_chunk_state(h, b_h, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
        b_kt, b_v = _chunk_tiles(k, v, bos, i_t, T_seq, i_h, o_k, o_v, H, HK, K, V, BT)  # k^T [BK, BT], v [BT, BV]
        if USE_G:
            b_G, g_last = _chunk_decay(g, bos, i_t, T_seq, i_h, H, BT)
            b_h = b_h * tl.exp(g_last)
            b_v = (b_v.to(tl.float32) * tl.exp(g_last - b_G)[:, None]).to(b_kt.dtype)
        b_h += tl.dot(b_kt.to(h.dtype.element_ty), b_v.to(h.dtype.element_ty), input_precision=PREC)

    if STORE_HT:
        tl.store(end_state(ht, i_st, o_k, o_v, K, V), b_h, mask=m_kv)


@triton.jit
def _fwd_o_kernel(
    q, k, v, g, h, o, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
    USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NV, B * H / HB, NT) or (NV, H / HB, total chunks) with cu_seqlens: the outputs of one chunk for a
    block of HB value heads of one key head, their scores q k^T computed once."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_v, i_bs, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bs, T, H // HB, BT, IS_VARLEN)
    i_hk = i_s * HB // (H // HK)  # the key head of the program's HB value heads (HB divides H / HK)

    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        b_s += tl.dot(_key_rows(q, bos, o_t, m_t, i_hk, o_k, HK, K), _key_cols(k, bos, o_t, m_t, i_hk, o_k, HK, K),
                      input_precision=PREC)

    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    for i_hb in range(HB):
        i_h = i_s * HB + i_hb
        b_o = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            p_h = h + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(p_h, mask=(o_k[:, None] < K) & m_v[None, :], other=0.0)
            b_q = _key_rows(q, bos, o_t, m_t, i_hk, o_k, HK, K)
            b_o += tl.dot(b_q.to(b_h.dtype), b_h, input_precision=PREC)
        if USE_G:
            b_G, _ = _chunk_decay(g, bos, i_c, T_seq, i_h, H, BT)
            b_o = b_o * tl.exp(b_G)[:, None]
            b_a = b_s * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
        else:
            b_a = tl.where(causal, b_s, 0.0)
        p_v = v + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_o = (b_o + tl.dot(b_a.to(b_v.dtype), b_v, input_precision=PREC)) * scale
        p_o = o + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _bwd_dh_kernel(
    q, do, g, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, SEG: tl.constexpr, STORE_CHUNKS: tl.constexpr,
):
    """Grid (NK * NV, N * H, S): the gradient of the state at the end of every chunk, in reverse (segments as in
    ``_fwd_h_kernel``: dht holds each segment's end, dh0 receives its start)."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv = state_program(cu_seqlens, chunk_offsets, T, H, K, V, BT, BK,
                                                                   BV, IS_VARLEN)
    i_st, lo, hi = segment_bounds(i_nh, NT, SEG)
    b_dh = load_end_state(dht, i_st, o_k, o_v, m_kv, K, V, BK, BV, USE_DHT)
    for i_r in range(hi - lo):
        i_t = hi - 1 - i_r
        if STORE_CHUNKS:
            store_chunk_state(dh, b_dh, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
        b_qt, b_do = _chunk_tiles(q, do, bos, i_t, T_seq, i_h, o_k, o_v, H, HK, K, V, BT)  # q^T [BK, BT], do [BT, BV]
        if USE_G:
            b_G, g_last = _chunk_decay(g, bos, i_t, T_seq, i_h, H, BT)
            b_dh = b_dh * tl.exp(g_last)
            b_qt = (b_qt.to(tl.float32) * tl.exp(b_G)[None, :]).to(b_do.dtype)
        b_dh += tl.dot(b_qt.to(dh.dtype.element_ty), b_do.to(dh.dtype.element_ty),
                       input_precision=PREC) * scale

    if STORE_DH0:
        tl.store(end_state(dh0, i_st, o_k, o_v, K, V), b_dh, mask=m_kv)


@triton.jit
def _local_dg(b_dG, b_hdh, b_vdv, g_last, last, o_i, causal_t):
    """dg of a chunk's tokens from its dG = q·dq - k·dk: the reverse cumsum inside the chunk, its last token
    also taking what lies past the chunk, <dH_end, H_end> = exp(g_last) <dh, h> + Σ v·dv through the end state
    (module docstring)."""
    b_dG = tl.where(o_i == last, b_dG + tl.exp(g_last) * tl.sum(b_hdh, axis=0) + tl.sum(b_vdv, axis=0), b_dG)
    return tl.sum(tl.where(causal_t, b_dG[None, :], 0.0), axis=1)  # [j]: Σ_{i >= j} dG_i


@triton.jit
def _bwd_dqkv_kernel(
    q, k, v, g, h, do, dh, dq, dk, dv, dg, cu_seqlens, chunk_indices, scale, T, TT,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
    USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (B * H / HB, NT) or (H / HB, total chunks) with cu_seqlens: dv (and dg) of one chunk for each of a block
    of HB value heads of one key head, and the sum of their dq and dk, accumulated head by head in one pair of tiles:

        dq = scale * Σ_h (exp(G_h) ⊙ dO_h) H_h^T + (dO_h V_h^T ⊙ Γ_h) K     (dk alike)

    dG of a head is q·dq - k·dk for one head (HB = 1), else do·o - v·dv (the same sum) with o recomputed; its dg
    the reverse cumsum inside the chunk with the end state's <dH, H> (``_local_dg``). The
    block's dq and dk go to part i_p (its block within its key head) of dq, dk ``[H / HK / HB, B, T, HK, K]``
    (TT = B * T tokens); one part is the gradient itself, in q's dtype. BK >= K: the whole key dim is held; the
    value dim is walked in blocks of BV.
    """
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_bs, i_t = tl.program_id(0), tl.program_id(1)
    i_s, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bs, T, H // HB, BT, IS_VARLEN)
    NP: tl.constexpr = H // HK // HB  # programs (head blocks) per key head
    i_hk, i_p = i_s // NP, i_s % NP
    DG_FROM_O: tl.constexpr = USE_G and HB > 1

    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q = _key_rows(q, bos, o_t, m_t, i_hk, o_k, HK, K)
    b_k = _key_rows(k, bos, o_t, m_t, i_hk, o_k, HK, K)

    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]     # [i, j]: i >= j
    causal_t = o_i[:, None] <= o_i[None, :]   # [j, i]: i >= j
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    last = tl.minimum(BT, T_seq - i_c * BT) - 1  # the chunk's last token
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # Σ h ⊙ dh over the value dim (one head)
    b_vdv = tl.zeros([BT], dtype=tl.float32)  # v · dv through the chunk's end state (one head)
    for i_hb in range(HB):
        i_h = i_s * HB + i_hb
        # A^T[j, i] = k_j · q_i (i >= j), computed directly (no transpose of a dot result); per head: the
        # registers a shared copy would hold cost more than the product
        b_at = tl.dot(b_k, _key_cols(q, bos, o_t, m_t, i_hk, o_k, HK, K), input_precision=PREC)
        if USE_G:
            b_G, g_last = _chunk_decay(g, bos, i_c, T_seq, i_h, H, BT)
            decay_q = tl.exp(b_G)
            decay_k = tl.exp(g_last - b_G)
            b_at = b_at * tl.exp(tl.where(causal_t, b_G[None, :] - b_G[:, None], float("-inf")))
        else:
            b_at = tl.where(causal_t, b_at, 0.0)
        b_at = (b_at * scale).to(b_k.dtype)
        if DG_FROM_O:  # A[i, j] = scale * q_i · k_j * Γ_ij (i >= j), for o
            b_a = tl.dot(b_q, _key_cols(k, bos, o_t, m_t, i_hk, o_k, HK, K), input_precision=PREC)
            b_a = (b_a * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf"))) * scale)
            b_a = b_a.to(b_q.dtype)
            b_dg = tl.zeros([BT], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)
        b_vdv = tl.zeros([BT], dtype=tl.float32)

        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        b_dst = tl.zeros([BT, BT], dtype=tl.float32)
        p_h_base = h + (i_tg * H + i_h) * (K * V)
        p_dh_base = dh + (i_tg * H + i_h) * (K * V)
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_vt = m_v[:, None] & m_t[None, :]
            m_vk = m_v[:, None] & m_k[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            p_tv = (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
            p_vt = (bos + o_t[None, :]) * (H * V) + i_h * V + o_v[:, None]
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
            b_vt = tl.load(v + p_vt, mask=m_vt, other=0.0)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
            b_dot = tl.load(do + p_vt, mask=m_vt, other=0.0)
            # h^T and dh^T [BV, BK] (state buffers are [K, V]), dh [BK, BV]
            b_ht = tl.load(p_h_base + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
            b_dht = tl.load(p_dh_base + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
            b_dh = tl.load(p_dh_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_dvi = tl.dot(b_k.to(b_dh.dtype), b_dh, input_precision=PREC)
            if USE_G:  # the decays on the operands: one accumulator for the block's heads
                b_dq = tl.dot((b_do.to(tl.float32) * decay_q[:, None]).to(b_ht.dtype), b_ht, b_dq,
                              input_precision=PREC)
                b_dk = tl.dot((b_v.to(tl.float32) * decay_k[:, None]).to(b_dht.dtype), b_dht, b_dk,
                              input_precision=PREC)
                b_dvi = b_dvi * decay_k[:, None]
                b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
                b_vdv += tl.sum(b_v.to(tl.float32) * b_dvi, axis=1)
            else:
                b_dq = tl.dot(b_do.to(b_ht.dtype), b_ht, b_dq, input_precision=PREC)
                b_dk = tl.dot(b_v.to(b_dht.dtype), b_dht, b_dk, input_precision=PREC)
            b_ds += tl.dot(b_do, b_vt, input_precision=PREC)
            b_dst += tl.dot(b_v, b_dot, input_precision=PREC)
            b_dv = tl.dot(b_at, b_do, input_precision=PREC) + b_dvi
            tl.store(dv + p_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
            if DG_FROM_O:  # this value block of o, as the forward forms it
                b_h = tl.load(p_h_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
                b_o = tl.dot(b_q.to(b_h.dtype), b_h, input_precision=PREC) * (decay_q * scale)[:, None]
                b_o += tl.dot(b_a, b_v, input_precision=PREC)
                b_dg += tl.sum(b_do.to(tl.float32) * b_o - b_v.to(tl.float32) * b_dv, axis=1)

        if USE_G:
            b_ds = b_ds * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
            b_dst = b_dst * tl.exp(tl.where(causal_t, b_G[None, :] - b_G[:, None], float("-inf")))
        else:
            b_ds = tl.where(causal, b_ds, 0.0)
            b_dst = tl.where(causal_t, b_dst, 0.0)
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=PREC)
        b_dk = tl.dot((b_dst * scale).to(b_q.dtype), b_q, b_dk, input_precision=PREC)
        if DG_FROM_O:
            b_dg = _local_dg(b_dg, b_hdh, b_vdv, g_last, last, o_i, causal_t)
            tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=m_t)

    b_dq = b_dq * scale
    if USE_G and not DG_FROM_O:  # one head: its own q·dq - k·dk
        b_dg = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, axis=1)
        _, g_last = _chunk_decay(g, bos, i_c, T_seq, i_s, H, BT)
        b_dg = _local_dg(b_dg, b_hdh, b_vdv, g_last, last, o_i, causal_t)
        tl.store(dg + (bos + o_t) * H + i_s, b_dg, mask=m_t)
    p_part = i_p.to(tl.int64) * TT * (HK * K) + (bos + o_t[:, None]) * (HK * K) + i_hk * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    tl.store(dq + p_part, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_part, b_dk.to(dk.dtype.element_ty), mask=m_tk)


@triton.jit
def _fused_recurrent_kernel(
    q, k, v, g, s0, z0, o, st, zt, scale, eps, T,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_S0: tl.constexpr, NORMALIZE: tl.constexpr, STORE_ST: tl.constexpr,
):
    """Grid (NV, B * H): a few tokens against a state S ``[B, H, V, K]`` held in registers (value head i_h reads
    q and k of key head i_h // (H / HK))."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    eps = tl.cast(eps, tl.float32)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    p_s = i_bh.to(tl.int64) * (V * K) + o_v[:, None] * K + o_k[None, :]
    b_s = tl.zeros([BV, BK], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + p_s, mask=m_vk, other=0.0).to(tl.float32)
        if NORMALIZE:
            b_z += tl.load(z0 + i_bh.to(tl.int64) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    bos = i_b.to(tl.int64) * T
    for t in range(T):
        row = (bos + t) * H + i_h
        key_row = (bos + t) * HK + i_h // (H // HK)
        b_q = tl.load(q + key_row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + key_row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if USE_G:
            b_s = b_s * tl.exp(tl.load(g + row).to(tl.float32))
        b_s += b_v[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], axis=1) * scale
        if NORMALIZE:
            b_z += b_k
            b_o = b_o / tl.maximum(tl.sum(b_q * b_z, axis=0), eps)
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_ST:
        tl.store(st + p_s, b_s, mask=m_vk)
        if NORMALIZE:
            if i_v == 0:
                tl.store(zt + i_bh.to(tl.int64) * K + o_k, b_z, mask=m_k)


# ============================================================================ launch helpers
def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision dots (the reference semantics); 16-bit ones use tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


class _Ctx(ChunkLayout):
    """Shapes and launch parameters shared by the forward and the backward."""

    def __init__(self, q, v, cu_seqlens, chunk_size):
        super().__init__(q, v, cu_seqlens, chunk_size)
        self.H, self.HK = v.shape[2], q.shape[2]  # value heads (the states'), and q's and k's heads
        self.prec = _prec(q.dtype)
        self.state_dtype = chunk_state_dtype(q.dtype)
        self.two_byte = q.element_size() == 2
        self.key = (q.dtype, self.H, self.HK, self.K, self.V, chunk_size, self.varlen, q.device.type)

    def head_grid(self, HB: int, *lead):
        """A chunk kernel's grid over blocks of HB value heads: (lead..., B * H / HB, chunks), or (lead..., H / HB,
        total chunks) with cu_seqlens. The heads vary fastest, so that the programs reading one chunk of q and k
        run side by side (and find it in the L2 cache)."""
        if self.varlen:
            return (*lead, self.H // HB, self.NT)
        return (*lead, self.B * self.H // HB, triton.cdiv(self.T, self.BT))


def _heads_per_program(c: _Ctx, programs_per_head: int, device) -> int:
    """HB, the value heads of one key head that a program of the output or gradient kernel takes: as many as leave
    ``PROGRAMS_PER_SM`` programs per multiprocessor (``programs_per_head`` of them per head block). A block's
    heads share their q k^T (and in the backward, one sum of dq and dk instead of one per head, partial sums where
    a key head's heads take several programs); 1 without grouped heads."""
    group = c.H // c.HK
    if FORCE_HEADS_PER_PROGRAM is not None:
        if group % FORCE_HEADS_PER_PROGRAM:
            raise ValueError(f"FORCE_HEADS_PER_PROGRAM = {FORCE_HEADS_PER_PROGRAM} must divide the {group} value "
                             "heads per key head")
        return FORCE_HEADS_PER_PROGRAM
    wanted = PROGRAMS_PER_SM * num_sms(device)
    for parts in range(1, group + 1):
        if group % parts == 0 and programs_per_head * c.HK * parts >= wanted:
            return group // parts
    return 1


def _segments(c: _Ctx, tiles: int, gated: bool, device) -> int:
    """Chunks per segment of the state walks (``_segments.walk_segments``), or 0 (always with a decay)."""
    if gated:
        return 0
    return walk_segments(c, c.N * c.H * tiles, device, FORCE_SEGMENT_CHUNKS, MIN_SEGMENTS)


def _walks(kernel, c: _Ctx, args, state_args, g, first, want_last: bool, BK, BV, tiles, reverse: bool):
    """``_fwd_h_kernel``'s walks (or ``_bwd_dh_kernel``'s, ``reverse``) through ``_segments.state_walks``: ``args`` go
    before the start and end states (``first``: the initial state, or the final state's gradient; None: zeros),
    ``state_args`` after them. Returns the last state (the final state, or the initial state's gradient) where
    ``want_last``."""
    meta = dict(H=c.H, HK=c.HK, K=c.K, V=c.V, BT=c.BT, BK=BK, BV=BV, USE_G=g is not None, IS_VARLEN=c.varlen,
                PREC=c.prec, num_warps=4, num_stages=2)
    use, store = ("USE_DHT", "STORE_DH0") if reverse else ("USE_H0", "STORE_HT")

    def launch(S, SEG, start, end, store_chunks):
        start, end = (None if x is None else x[0] for x in (start, end))
        kernel[(tiles, c.N * c.H, S)](*args, start, end, *state_args, SEG=SEG, STORE_CHUNKS=store_chunks,
                                      **{use: start is not None, store: end is not None}, **meta)

    def end_states(S):
        lead = (c.N, c.H) if S is None else (c.N, c.H, S)
        return (torch.empty(*lead, c.V, c.K, dtype=torch.float32, device=args[0].device),)

    seg = _segments(c, tiles, g is not None, args[0].device)
    last = state_walks(launch, c, seg, None if first is None else (first,), want_last, end_states, reverse)
    return None if last is None else last[0]


def _fwd(c: _Ctx, q, k, v, g, scale, h0, output_final_state):
    dev = q.device
    BK, BV = state_blocks(c.K, c.V)
    h = torch.empty(c.NT, c.H, c.K, c.V, dtype=c.state_dtype, device=dev)
    tiles = triton.cdiv(c.K, BK) * triton.cdiv(c.V, BV)
    ht = _walks(_fwd_h_kernel, c, (k, v, g, h), (c.cu, c.chunk_offsets, c.T), g, h0, output_final_state, BK, BV,
                tiles, reverse=False)
    o = torch.empty(c.B, c.T, c.H, c.V, dtype=v.dtype, device=dev)
    BK = min(64, next_pow2(c.K))
    configs = [dict(BV=min(128 if c.two_byte else 64, next_pow2(c.V)), num_warps=4, num_stages=2),
               dict(BV=min(32, next_pow2(c.V)), num_warps=4, num_stages=1)]
    HB = _heads_per_program(c, c.NT * triton.cdiv(c.V, configs[0]["BV"]), dev)
    launch_first_fitting(_fwd_o_kernel, lambda cfg: c.head_grid(HB, triton.cdiv(c.V, cfg["BV"])),
                         ("linear fwd_o", HB, c.key), configs, q, k, v, g, h, o, c.cu, c.chunk_indices, scale, c.T,
                         H=c.H, HK=c.HK, K=c.K, V=c.V, BT=c.BT, BK=BK, HB=HB, USE_G=g is not None,
                         IS_VARLEN=c.varlen, PREC=c.prec)
    return o, h, ht


def _bwd(c: _Ctx, q, k, v, g, scale, h, do, dht, want_dh0):
    dev = q.device
    BK, BV = state_blocks(c.K, c.V)
    dh = torch.empty(c.NT, c.H, c.K, c.V, dtype=c.state_dtype, device=dev)
    tiles = triton.cdiv(c.K, BK) * triton.cdiv(c.V, BV)
    dh0 = _walks(_bwd_dh_kernel, c, (q, do, g, dh), (c.cu, c.chunk_offsets, scale, c.T), g, dht, want_dh0, BK, BV,
                 tiles, reverse=True)
    # one value head a program unless a test forces more: several heads a program at value blocks of 64 ran 1.6 x
    # slower at Mamba-2's shapes on an H200 (their tiles spill), and at blocks of 32 the bf16 compile (Triton 3.6,
    # sm_90) faulted with an illegal memory access
    HB = FORCE_HEADS_PER_PROGRAM or 1
    if (c.H // c.HK) % HB:
        raise ValueError(f"FORCE_HEADS_PER_PROGRAM = {HB} must divide the {c.H // c.HK} value heads per key head")
    parts = c.H // c.HK // HB  # programs per key head: each writes the sum of dq and dk over its heads
    # the parts in q's dtype, summed below in float32 (as fla sums its per-head dq and dk): half the bytes of float32
    # parts, which at Mamba-2's shapes (128 heads of one group, one part each) are 2 GiB each for dq and dk a 32k tokens
    dq, dk = (torch.empty(parts, *q.shape, dtype=q.dtype, device=dev) for _ in range(2))
    dv = torch.empty_like(v)
    dg = torch.empty(c.B, c.T, c.H, dtype=torch.float32, device=dev) if g is not None else None
    BK = next_pow2(c.K)
    configs = dqkv_configs(BK, c.V, c.two_byte)
    launch_first_fitting(_bwd_dqkv_kernel, lambda cfg: c.head_grid(HB), ("linear bwd_dqkv", HB, c.key), configs,
                         q, k, v, g, h, do, dh, dq, dk, dv, dg, c.cu, c.chunk_indices, scale, c.T, c.B * c.T,
                         H=c.H, HK=c.HK, K=c.K, V=c.V, BT=c.BT, BK=BK, HB=HB, USE_G=g is not None,
                         IS_VARLEN=c.varlen, PREC=c.prec)
    dq, dk = (x[0] if parts == 1 else x.sum(0, dtype=torch.float32).to(q.dtype) for x in (dq, dk))
    return dq, dk, dv, dg, dh0


class ChunkLinearAttentionFunction(torch.autograd.Function):
    """Chunked (gated) linear attention with hand-written backward; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, output_final_state, cu_seqlens, chunk_size):
        c = _Ctx(q, v, cu_seqlens, chunk_size)
        o, h, ht = _fwd(c, q, k, v, g, scale, h0, output_final_state)
        ctx.c, ctx.scale = c, scale
        ctx.h0_dtype = None if h0 is None else h0.dtype
        ctx.g_dtype = None if g is None else g.dtype
        ctx.save_for_backward(q, k, v, g, h, ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, h, ht = ctx.saved_tensors
        c = ctx.c
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous().float()
        want_dh0 = ctx.h0_dtype is not None
        dq, dk, dv, dG, dh0 = _bwd(c, q, k, v, g, ctx.scale, h, do, dht, want_dh0)
        dg = None
        if g is not None:
            dg = dG.to(ctx.g_dtype)  # the kernel's sums (the final state's <dH_T, H_T> with them)
        if dh0 is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        return dq, dk, dv, dg, dh0, None, None, None, None


# ============================================================================ public entry points
def check_supported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernels can run this case, else the reason (for ``resolve_backend``)."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes float32/float16/bfloat16 inputs, not {q.dtype}"
    dk, dv = q.shape[-1], v.shape[-1]
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return f"the Triton kernel takes head dims up to {MAX_HEAD_DIM}, got dk={dk}, dv={dv}"
    return device_unsupported(q)


def _check_heads(fn: str, q, k, v) -> None:
    if k.shape != q.shape or v.shape[2] % q.shape[2]:
        raise ValueError(f"{fn}: k must have q's shape {tuple(q.shape)} and v a multiple of its heads (grouped "
                         f"heads), got k {tuple(k.shape)}, v {tuple(v.shape)}")


def kernel_chunk_size(chunk_size: int) -> int:
    """The op's chunk_size if it is a power of two in [16, 128], else 64 (same result either way)."""
    if chunk_size in (16, 32, 64, 128):
        return chunk_size
    return 64


def chunk_linear_attention(q, k, v, g=None, *, scale: float = 1.0, initial_state=None,
                           output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64):
    """``(o [B, T, H, dv] in q's dtype, final state [N, H, dv, dk] float32 or None)``.

    q, k ``[B, T, HK, dk]``, v ``[B, T, H, dv]`` of one dtype, H = m·HK (grouped heads: value head h reads q and k
    of head h // m; m = 1 without); g ``[B, T, H]`` log decay or None; initial_state ``[N, H, dv, dk]``;
    cu_seqlens ``[N + 1]`` int (B must be 1) or None. Differentiable in q, k, v, g and initial_state.
    """
    _check_heads("chunk_linear_attention", q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if g is not None:
        g = g.contiguous().float() if g.dtype != torch.float32 else g.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    return ChunkLinearAttentionFunction.apply(q, k, v, g, initial_state, float(scale),
                                              bool(output_final_state), cu_seqlens,
                                              kernel_chunk_size(chunk_size))


def fused_recurrent_linear_attention(q, k, v, g=None, *, scale: float = 1.0, initial_state=None,
                                     z0=None, normalize: bool = False, eps: float = 1e-6,
                                     output_final_state: bool = True):
    """Decoding: a few tokens against a state, no autograd. Returns ``(o, S, z)``. q and k may have fewer heads
    than v (a divisor: grouped heads, as in ``chunk_linear_attention``).

    ``S`` ``[B, H, dv, dk]`` float32 (None unless output_final_state), ``z`` ``[B, H, dk]`` (None
    unless normalize): with normalize, ``o_t = S_t q_t / max(q_t · z_t, eps)`` (z from z0).
    """
    _check_heads("fused_recurrent_linear_attention", q, k, v)
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if g is not None:
        g = g.contiguous()
    s0 = None if initial_state is None else initial_state.contiguous()
    if z0 is not None:
        z0 = z0.contiguous()
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    st = torch.empty(B, H, V, K, dtype=torch.float32, device=q.device) if output_final_state else None
    zt = (torch.empty(B, H, K, dtype=torch.float32, device=q.device)
          if output_final_state and normalize else None)
    BK = next_pow2(K)
    BV = min(32 if BK <= 128 else 16, next_pow2(V))
    _fused_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, s0, z0, o, st, zt, float(scale), float(eps), T,
        H=H, HK=HK, K=K, V=V, BK=BK, BV=BV, USE_G=g is not None, USE_S0=s0 is not None,
        NORMALIZE=normalize, STORE_ST=output_final_state, num_warps=4 if BK * BV >= 4096 else 2,
    )
    return o, st, zt


# ============================================================================ GLA: a gate per key dim
# S_t = S_{t-1} diag(exp(g_t)) + v_t k_t^T (g [B, T, H, dk]), o_t = scale * S_t q_t. The decoding kernel:
# parallel over (sequence, head, value block), sequential in time, forward only (training and prefill run
# the chunk kernels of lazoo.kernels.gla). Every step decays by exp(g) <= 1, so any gate strength is stable.
@triton.jit
def _gla_rec_fwd_kernel(
    q, k, v, g, h0, o, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Grid (NV, N * H): outputs and final state; the state [BK, BV] stays in registers."""
    scale = tl.cast(scale, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_seq, NT, boh = seq_bounds(cu_seqlens, cu_seqlens, i_n, T, 1, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    b_h = load_end_state(h0, i_nh, o_k, o_v, m_kv, K, V, BK, BV, USE_H0)
    for t in range(T_seq):
        row = (bos + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(end_state(ht, i_nh, o_k, o_v, K, V), b_h, mask=m_kv)


def _gla_blocks(K, V, n_seq_heads, device):
    BK = next_pow2(K)
    BV = min(32 if BK <= 128 else 16, next_pow2(V))
    BV = fill_device(BV, V, n_seq_heads, device)
    return BK, BV, (4 if BK * BV >= 4096 else 2)


def _gla_n_seq(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1


def fused_recurrent_gla(q, k, v, g, *, scale: float, initial_state=None, output_final_state: bool = False,
                        cu_seqlens=None):
    """GLA (gate per key dim) token by token against a state, forward only (decoding; training runs
    ``lazoo.kernels.gla.chunk_gla``): ``(o [B, T, H, dv], final state [N, H, dv, dk] float32 or None)``.
    g ``[B, T, H, dk]`` log decay (cast to float32 here)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.contiguous().float() if g.dtype != torch.float32 else g.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _gla_n_seq(q, cu_seqlens)
    BK, BV, warps = _gla_blocks(K, V, N * H, q.device)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    ht = torch.empty(N, H, V, K, dtype=torch.float32, device=q.device) if output_final_state else None
    _gla_rec_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, initial_state, o, ht, cu_seqlens, float(scale), T, H=H, K=K, V=V, BK=BK, BV=BV,
        USE_H0=initial_state is not None, STORE_HT=bool(output_final_state), IS_VARLEN=cu_seqlens is not None,
        num_warps=warps,
    )
    return o, ht
