"""Triton kernels for normalised linear attention, with optional scalar features: the normaliser inside the chunks.

Per sequence and head, with features q, k ``[T, K]`` (storage dtype) and, optionally, E = 1 or 2 scalar features a
token a, c ``[T, E]`` (fp32; ELA's ‖q‖², ‖k‖² and ones):

    num_i = Σ_{j≤i} (q_i·k_j + a_i·c_j) v_j,    den_i = Σ_{j≤i} (q_i·k_j + a_i·c_j),
    o_i = num_i / max(den_i, eps)

Chunk form (chunks of BT tokens; at a chunk's start the state h = Σ k vᵀ [K, V], he = Σ c vᵀ [E, V], z = Σ k [K],
ze = Σ c [E], each from the initial state): with P = causal(Q Kᵀ + A Cᵀ) inside the chunk,

    num = Q h + A he + P V,    den = Q z + A ze + P 1

so the normaliser is the row sums of the score tile the outputs already form, plus one more column of the state.
The backward is linear attention's with the values [v, 1] and the output gradients [do / den', dden], where
den' = max(den, eps) and dden = -(do·o) / den' (0 where the clamp holds): a small kernel forms 1/den' and dden from
do, o and den (stored by the forward). The state-gradient kernel scales do by 1/den' as it loads it (its products
are fp32 for fp16 inputs); the dq, dk, dv kernel scales its products' results instead, since do / den' can fall
below fp16's normal range. The state kernels give each state its own programs (tiles of h, key blocks of z, value
blocks of he and ze), which walk the chunks side by side, and form every sum over a chunk's tokens as a tile
product, so the walk has no reduction across warps. The normaliser's sums (z, ze and their gradients)
keep fp32's precision on tf32 tensor cores: each fp32 operand enters as two parts exact in tf32 (``_tf32_split``)
in spare rows or columns of the same tile, and a tile's value is the sum of its parts (``_fold``). dk and dc are
differences of the numerator's and the normaliser's terms, which cancel closely, so a single tf32 rounding there
shows in them; exact fp32 products ("ieee") there made the backward 20% slower.

Kernels: ``_fwd_h`` (chunk-start states, sequential over chunks), ``_fwd_o`` (outputs and den, parallel over
chunks), ``_bwd_prep`` (1/den', dden), ``_bwd_dh`` (state gradients at chunk ends, sequential in reverse),
``_bwd_dqkv`` (parallel over chunks) and, with scalar features, ``_bwd_dv`` (dv, which the dq, dk, dv kernel then
leaves out: with it that kernel spilled). No computed matrix is transposed (see lazoo.kernels.linear). Where q, k (and
a, c) are features of the op's inputs, ``_bwd_dqkv`` carries their gradients to the inputs while it holds them:
ELA's hadamard_exp (``exp_of``) and polynomial kernels (``poly_of``), so no pass of their own reads them back.

The non-causal form (``causal=False``; j ≤ i becomes every j of the sequence) runs the same kernels: ``_fwd_h`` and
``_bwd_dh`` store only the sums over the whole sequence (as a final state, and as an initial state's gradient),
and ``_fwd_o`` and ``_bwd_dqkv`` read those for every chunk (``CAUSAL``: no score tiles).

Layout as in lazoo.kernels.linear: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, a, c ``[B, T, H, E]`` float32, states
``h0 [N, H, V, K]``, ``he0 [N, H, V, E]``, ``z0 [N, H, K]``, ``ze0 [N, H, E]`` (float32), ``cu_seqlens`` packing N
sequences into B = 1. k and c must be zero at pads (a pad adds nothing); q at a pad only reaches its own output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _segments
from ._chunk_layout import ChunkLayout
from ._launch import chunk_state_dtype, dqkv_configs, launch_first_fitting, state_blocks
from ._segments import segment_bounds, state_walks, walk_segments
from ._tiles import chunk_bounds, end_state, load_end_state, seq_bounds, store_chunk_state
from ._utils import next_pow2

#: the largest scalar-feature count (E = 1 or 2, ELA's)
MAX_SCALARS = 2
#: the value block of the output kernel for 16-bit inputs (at 128, bf16 outputs with scalar features were 4e-2 off
#: on an H100 with Triton 3.6, in two builds of the kernel; 64 was right in every case measured)
FWD_BV = 64
#: the value block of the dq, dk, dv kernel for 16-bit inputs
DQKV_BV = 64
#: warps of the state kernels' programs
STATE_WARPS = 4
#: the state walks in segments (``_segments.walk_segments``): at least this many, without and with scalar features.
#: Timed on an H200 (bf16, H = 16, D = 128, fwd + bwd at T = 32k, B = 1): normalised linear attention 2.155 -> 1.944
#: ms; ELA's polynomial kernels (two scalar features) 2.93 -> 3.38 ms, so off there (1 << 30); 1k and 8k walk once.
MIN_SEGMENTS = _segments.MIN_SEGMENTS
MIN_SEGMENTS_SCALARS = 1 << 30
#: chunks per segment forced (tests: segments at small T; None: walk_segments decides)
FORCE_SEGMENT_CHUNKS = None


# ============================================================================ tile helpers
@triton.jit
def _vec(ptr, row0, width, o, m):
    """fp32 ``[len(o)]`` slice of row ``row0`` of a ``[.., width]`` buffer (zeros outside ``m``)."""
    return tl.load(ptr + row0 * width + o, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _tokens(ptr, bos, o_t, m_t, i_h, H: tl.constexpr, W: tl.constexpr, o_w, TRANS: tl.constexpr):
    """A chunk's rows of a ``[.., H, W]`` tensor, ``[BT, BW]`` (or ``[BW, BT]`` with TRANS), storage dtype, zeros
    outside the sequence and past W."""
    if TRANS:  # (one return: the compiler wants one return type, whichever branch is taken)
        x = tl.load(ptr + (bos + o_t[None, :]) * (H * W) + i_h * W + o_w[:, None],
                    mask=m_t[None, :] & (o_w[:, None] < W), other=0.0)
    else:
        x = tl.load(ptr + (bos + o_t[:, None]) * (H * W) + i_h * W + o_w[None, :],
                    mask=m_t[:, None] & (o_w[None, :] < W), other=0.0)
    return x


@triton.jit
def _row_values(ptr, bos, o_t, m_t, i_h, H: tl.constexpr):
    """fp32 ``[BT]`` of a ``[.., H]`` per-token buffer (den, 1/den', dden)."""
    return tl.load(ptr + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def _col(ptr, bos, o_t, m_t, i_h, e: tl.constexpr, H: tl.constexpr, E: tl.constexpr):
    """fp32 ``[BT]``: scalar feature e of a chunk's tokens (a or c, ``[.., H, E]``)."""
    return tl.load(ptr + (bos + o_t) * (H * E) + i_h * E + e, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def _srow(ptr, i_tg, i_h, e: tl.constexpr, o_v, H: tl.constexpr, E: tl.constexpr, V: tl.constexpr):
    """fp32 ``[BV]``: row e of a chunk's he or dhe (``[chunks, H, E, V]``)."""
    return tl.load(ptr + (i_tg * H + i_h) * (E * V) + e * V + o_v, mask=o_v < V, other=0.0)


@triton.jit
def _tf32_split(x):
    """(hi, lo), x = hi + lo exactly, hi exact in tf32 (its low 13 mantissa bits cleared): tf32 products of both
    parts carry x to about 2^-21 of itself, where one of x would round it at 2^-11."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _split_features(ptr, bos, o_t, m_t, i_h, H: tl.constexpr, E: tl.constexpr, o_e, TRANS: tl.constexpr):
    """A chunk's scalar features (a or c, ``[.., H, E]``) as an fp32 tile, ``[16, BT]`` with TRANS else ``[BT, 16]``,
    split by ``_tf32_split``: the high parts at feature e, the low at 8 + e (zeros elsewhere)."""
    return _split_rows(_tokens(ptr, bos, o_t, m_t, i_h, H, E, o_e % 8, TRANS), o_e, TRANS)


@triton.jit
def _split_rows(x, o_e, TRANS: tl.constexpr):
    """``_split_features`` of a loaded tile x (feature e at rows, or columns, e and 8 + e)."""
    hi, lo = _tf32_split(x)
    if TRANS:
        x = tl.where((o_e < 8)[:, None], hi, lo)
    else:
        x = tl.where((o_e < 8)[None, :], hi, lo)
    return x


@triton.jit
def _split_column(d, o_e):
    """``[BT, 16]``: a per-token fp32 value split by ``_tf32_split``, the high part in column 0, the low in 1."""
    hi, lo = _tf32_split(d)
    return tl.where((o_e == 0)[None, :], hi[:, None], tl.where((o_e == 1)[None, :], lo[:, None], 0.0))


@triton.jit
def _fold(tile, N: tl.constexpr):
    """``[4, N]``: a scalar-feature tile's value, rows e + 4 g of ``[16, N]`` summed over g (``_split_features``'
    parts at e and 8 + e; E <= 4). (Four rows, not eight: the reverse walk at value blocks of 64 held 96 registers,
    not 125, offline for sm_90.)"""
    return tl.sum(tl.reshape(tile, [4, 4, N]), 0)


@triton.jit
def _start_z(z0, i_nh, o_k, o_e, K: tl.constexpr, BK: tl.constexpr, USE: tl.constexpr):
    """A key block's starting z tile ``[BK, 16]``: the given z in column 0 when USE, else zeros."""
    b_z = tl.zeros([BK, 16], dtype=tl.float32)
    if USE:
        b_z += tl.where((o_e == 0)[None, :], _vec(z0, i_nh, K, o_k, o_k < K)[:, None], 0.0)
    return b_z


@triton.jit
def _start_he(he0, i_nh, o_e, o_v, E: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, USE: tl.constexpr):
    """A value block's starting he tile ``[16, BV]``: the given one in rows 0..E-1 when USE, else zeros."""
    m_ev = (o_e[:, None] < E) & (o_v[None, :] < V)
    return load_end_state(he0, i_nh, o_e, o_v, m_ev, E, V, 16, BV, USE)


@triton.jit
def _start_ze(ze0, i_nh, o_e, E: tl.constexpr, USE: tl.constexpr):
    """The starting ze tile ``[16, 16]``: the given ze in column 0 (rows 0..E-1) when USE, else zeros."""
    b_ze = tl.zeros([16, 16], dtype=tl.float32)
    if USE:
        b_ze += tl.where((o_e == 0)[None, :], _vec(ze0, i_nh, E, o_e, o_e < E)[:, None], 0.0)
    return b_ze


@triton.jit
def _store_z(ptr, row, K: tl.constexpr, o_k, b_z):
    """Store a z-like tile's value (its column sums) into row ``row`` of a ``[.., K]`` buffer."""
    tl.store(ptr + row * K + o_k, tl.sum(b_z, 1), mask=o_k < K)


@triton.jit
def _store_ze(ptr, row, E: tl.constexpr, b_ze):
    """Store a ze-like tile's value (``_fold`` and column sums) into row ``row`` of a ``[.., E]`` buffer."""
    o_e = tl.arange(0, 4)
    tl.store(ptr + row * E + o_e, tl.sum(_fold(b_ze, 16), 1), mask=o_e < E)


@triton.jit
def _store_he(ptr, b_he, i_tg, i_h, o_v, H: tl.constexpr, E: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Store an he-like tile's value (``_fold``) as chunk i_tg's (buffer ``[chunks, H, E, V]``)."""
    o_e = tl.arange(0, 4)
    store_chunk_state(ptr, _fold(b_he, BV), i_tg, i_h, o_e, o_v, (o_e[:, None] < E) & (o_v[None, :] < V), H, E, V)


@triton.jit
def _store_he_end(ptr, b_he, i_nh, o_v, E: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Store an he-like tile's value into an initial or final he ``[N, H, V, E]`` (head i_nh)."""
    o_e = tl.arange(0, 4)
    tl.store(end_state(ptr, i_nh, o_e, o_v, E, V), _fold(b_he, BV), mask=(o_e[:, None] < E) & (o_v[None, :] < V))


@triton.jit
def _role_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A state program's role index i_p (its grid column), head (i_nh, i_h) and sequence (``seq_bounds``).
    (Not ``state_program``: its h-tile offsets, formed before the roles branch, raised the state kernels' registers
    from 96 / 109 to 102 / 140 with Triton 3.9.)"""
    i_p, i_nh = tl.program_id(0), tl.program_id(1)
    bos, T_seq, NT, boh = seq_bounds(cu_seqlens, chunk_offsets, i_nh // H, T, BT, IS_VARLEN)
    return i_p, i_nh, i_nh % H, bos, T_seq, NT, boh


@triton.jit
def _state_index(chunk_indices, i_t, i_bh, i_tg, H: tl.constexpr, IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr):
    """The index of a chunk program's state rows: its global chunk (causal: the state at the chunk's start), or its
    sequence (non-causal: the sums over the whole sequence, one per sequence)."""
    i_s = i_tg
    if not CAUSAL:
        if IS_VARLEN:
            i_s = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        else:
            i_s = (i_bh // H).to(tl.int64)
    return i_s


@triton.jit
def _h_tile(i_p, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The offsets and mask of program i_p's [BK, BV] tile of h (i_p < NK * NV)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    o_k = (i_p // NV) * BK + tl.arange(0, BK)
    o_v = (i_p % NV) * BV + tl.arange(0, BV)
    return o_k, o_v, (o_k[:, None] < K) & (o_v[None, :] < V)


# ============================================================================ forward
# The state kernels' programs take one of four roles and walk the chunks side by side: a [BK, BV] tile of h; a
# key block of z; with scalar features, a value block of he, or ze. The walk lasts as long as its slowest program,
# so no program carries another's sums, and no loop branches on its role. Grid: (NK * NV + NK (+ NV + 1), N * H).
@triton.jit
def _fwd_h_kernel(
    k, c, v, h, he, z, ze, h0, he0, z0, ze0, ht, het, zt, zet, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXTRA: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    SPREC: tl.constexpr, STORE_CHUNKS: tl.constexpr, SDT: tl.constexpr, SEG: tl.constexpr,
):
    """Every chunk's starting state (unless not STORE_CHUNKS: the non-causal form needs the sums only), then the final
    one (roles above). z is a ``[BK, 16]`` tile whose column 0
    holds it, he and ze ``_fold`` tiles: every sum over a chunk's tokens is a tile product."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_nh, i_h, bos, T_seq, NT, boh = _role_program(cu_seqlens, chunk_offsets, T, H, BT, IS_VARLEN)
    i_st, lo, hi = segment_bounds(i_nh, NT, SEG)  # (segments: its own rows of the end states)
    o_e = tl.arange(0, 16)
    ones = tl.where((o_e == 0)[None, :], tl.full([BT, 16], 1.0, tl.float32), 0.0)  # sums into column 0
    if i_p < NK * NV:  # a tile of h
        o_k, o_v, m_kv = _h_tile(i_p, K, V, BK, BV)
        b_h = load_end_state(h0, i_st, o_k, o_v, m_kv, K, V, BK, BV, USE_H0)
        for i_t in range(lo, hi):
            if STORE_CHUNKS:
                store_chunk_state(h, b_h, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_kt = _tokens(k, bos, o_t, m_t, i_h, H, K, o_k, True)  # [BK, BT]
            b_v = _tokens(v, bos, o_t, m_t, i_h, H, V, o_v, False)  # [BT, BV]
            b_h += tl.dot(b_kt.to(SDT), b_v.to(SDT), input_precision=PREC)
        if STORE_HT:
            tl.store(end_state(ht, i_st, o_k, o_v, K, V), b_h, mask=m_kv)
    elif i_p < NK * NV + NK:  # a key block of z
        o_k = (i_p - NK * NV) * BK + tl.arange(0, BK)
        b_z = _start_z(z0, i_st, o_k, o_e, K, BK, USE_H0)
        for i_t in range(lo, hi):
            if STORE_CHUNKS:
                _store_z(z, (boh + i_t) * H + i_h, K, o_k, b_z)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            # k in the state's dtype (fp32, exact in tf32, for fp16 inputs: an fp16 product for z beside the fp32
            # one for h gave z 1% off at chunks of 64 on an H200, Triton 3.6)
            b_kt = _tokens(k, bos, o_t, m_t, i_h, H, K, o_k, True).to(SDT)  # [BK, BT]
            b_z += tl.dot(b_kt, ones.to(b_kt.dtype), input_precision=PREC)
        if STORE_HT:
            _store_z(zt, i_st.to(tl.int64), K, o_k, b_z)
    elif EXTRA and i_p < NK * NV + NK + NV:  # a value block of he
        o_v = (i_p - NK * NV - NK) * BV + tl.arange(0, BV)
        b_he = _start_he(he0, i_st, o_e, o_v, E, V, BV, USE_H0)
        for i_t in range(lo, hi):
            if STORE_CHUNKS:
                _store_he(he, b_he, boh + i_t, i_h, o_v, H, E, V, BV)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_ct = _split_features(c, bos, o_t, m_t, i_h, H, E, o_e, True)  # [16, BT]
            b_v = _tokens(v, bos, o_t, m_t, i_h, H, V, o_v, False)  # [BT, BV]
            b_he += tl.dot(b_ct, b_v.to(tl.float32), input_precision=SPREC)
        if STORE_HT:
            _store_he_end(het, b_he, i_st, o_v, E, V, BV)
    elif EXTRA:  # ze
        b_ze = _start_ze(ze0, i_st, o_e, E, USE_H0)
        for i_t in range(lo, hi):
            if STORE_CHUNKS:
                _store_ze(ze, (boh + i_t) * H + i_h, E, b_ze)
            o_t = i_t * BT + tl.arange(0, BT)
            b_ct = _split_features(c, bos, o_t, o_t < T_seq, i_h, H, E, o_e, True)
            b_ze += tl.dot(b_ct, ones, input_precision=SPREC)
        if STORE_HT:
            _store_ze(zet, i_st.to(tl.int64), E, b_ze)


# The output and dq, dk, dv kernels take the scalar features (E = 1 or 2) as per-token vectors, not tiles: their
# products are outer products and row sums in fp32 (a tile product would pad E to 16).
@triton.jit
def _fwd_o_kernel(
    q, k, a, c, v, h, he, z, ze, o, den, cu_seqlens, chunk_indices, eps, eps_rows, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXTRA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, ROW_EPS: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Grid (NV, NT, B * H) or (NV, total chunks, H): one chunk's outputs (and, from the first value block, its
    denominators). Non-causal: the sequence's sums alone, no score tile."""
    eps = tl.cast(eps, tl.float32)
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    i_tg = _state_index(chunk_indices, i_t, i_bh, i_tg, H, IS_VARLEN, CAUSAL)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    o_v = i_v * BV + tl.arange(0, BV)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    b_den = tl.zeros([BT], dtype=tl.float32)
    row = i_tg * H + i_h
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, False)
        b_h = tl.load(h + row * (K * V) + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & (o_v[None, :] < V),
                      other=0.0)
        b_o += tl.dot(b_q.to(b_h.dtype), b_h, input_precision=PREC)
        if CAUSAL:
            b_s += tl.dot(b_q, _tokens(k, bos, o_t, m_t, i_h, H, K, o_k, True), input_precision=PREC)
        b_den += tl.sum(b_q.to(tl.float32) * _vec(z, row, K, o_k, m_k)[None, :], 1)
    if EXTRA:
        for e in tl.static_range(E):
            a_e = _col(a, bos, o_t, m_t, i_h, e, H, E)
            if CAUSAL:
                b_s += a_e[:, None] * _col(c, bos, o_t, m_t, i_h, e, H, E)[None, :]
            b_o += a_e[:, None] * _srow(he, i_tg, i_h, e, o_v, H, E, V)[None, :]
            b_den += a_e * tl.load(ze + row * E + e)
    if CAUSAL:
        o_i = tl.arange(0, BT)
        b_s = tl.where(o_i[:, None] >= o_i[None, :], b_s, 0.0)
        b_den += tl.sum(b_s, 1)
        b_v = _tokens(v, bos, o_t, m_t, i_h, H, V, o_v, False)
        b_o += tl.dot(b_s.to(b_v.dtype), b_v, input_precision=PREC)
    if ROW_EPS:  # a clamp per token and head
        eps = tl.load(eps_rows + (bos + o_t) * H + i_h, mask=m_t, other=1.0)
    b_o = b_o / tl.maximum(b_den, eps)[:, None]
    p_o = o + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & (o_v[None, :] < V))
    if i_v == 0:
        tl.store(den + (bos + o_t) * H + i_h, b_den, mask=m_t)


# ============================================================================ backward
@triton.jit
def _bwd_prep_kernel(o, do, den, rden, dden, eps, eps_rows, rows, H: tl.constexpr, V: tl.constexpr,
                     BR: tl.constexpr, BV: tl.constexpr, ROW_EPS: tl.constexpr):
    """Grid (cdiv(B * T * H, BR)): per token and head, 1/den' and dden = -(do·o)/den' (0 where den <= eps)."""
    eps = tl.cast(eps, tl.float32)
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < rows
    o_v = tl.arange(0, BV)
    m = m_r[:, None] & (o_v[None, :] < V)
    b_o = tl.load(o + o_r[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)
    b_do = tl.load(do + o_r[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)
    b_den = tl.load(den + o_r, mask=m_r, other=1.0)
    if ROW_EPS:
        eps = tl.load(eps_rows + o_r, mask=m_r, other=1.0)
    r = 1.0 / tl.maximum(b_den, eps)
    tl.store(rden + o_r, r, mask=m_r)
    tl.store(dden + o_r, tl.where(b_den > eps, -tl.sum(b_o * b_do, 1) * r, 0.0), mask=m_r)


@triton.jit
def _bwd_dh_kernel(
    q, a, do, rden, dden, dh, dhe, dz, dze, dht, dhet, dzt, dzet, dh0, dhe0, dz0, dze0,
    cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXTRA: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr, SPREC: tl.constexpr, STORE_CHUNKS: tl.constexpr, SDT: tl.constexpr, SEG: tl.constexpr,
):
    """The gradients of the states at every chunk's end (unless not STORE_CHUNKS), in reverse (roles and tiles as in
    _fwd_h; dden enters the products of dz and dze as columns 0 and 1, its two tf32 parts)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_nh, i_h, bos, T_seq, NT, boh = _role_program(cu_seqlens, chunk_offsets, T, H, BT, IS_VARLEN)
    i_st, lo, hi = segment_bounds(i_nh, NT, SEG)  # (segments: its own rows of the end states)
    o_e = tl.arange(0, 16)
    if i_p < NK * NV:  # a tile of dh
        o_k, o_v, m_kv = _h_tile(i_p, K, V, BK, BV)
        b_dh = load_end_state(dht, i_st, o_k, o_v, m_kv, K, V, BK, BV, USE_DHT)
        for i_r in range(hi - lo):
            i_t = hi - 1 - i_r
            if STORE_CHUNKS:
                store_chunk_state(dh, b_dh, boh + i_t, i_h, o_k, o_v, m_kv, H, K, V)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_qt = _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, True)  # [BK, BT]
            b_do = _tokens(do, bos, o_t, m_t, i_h, H, V, o_v, False)  # [BT, BV]
            b_do = b_do.to(tl.float32) * _row_values(rden, bos, o_t, m_t, i_h, H)[:, None]  # do / den'
            b_dh += tl.dot(b_qt.to(SDT), b_do.to(SDT), input_precision=PREC)
        if STORE_DH0:
            tl.store(end_state(dh0, i_st, o_k, o_v, K, V), b_dh, mask=m_kv)
    elif i_p < NK * NV + NK:  # a key block of dz (q is exact in tf32)
        o_k = (i_p - NK * NV) * BK + tl.arange(0, BK)
        b_dz = _start_z(dzt, i_st, o_k, o_e, K, BK, USE_DHT)
        for i_r in range(hi - lo):
            i_t = hi - 1 - i_r
            if STORE_CHUNKS:
                _store_z(dz, (boh + i_t) * H + i_h, K, o_k, b_dz)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_qt = _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, True)  # [BK, BT]
            b_dd = _split_column(_row_values(dden, bos, o_t, m_t, i_h, H), o_e)  # [BT, 16]
            b_dz += tl.dot(b_qt.to(tl.float32), b_dd, input_precision=SPREC)
        if STORE_DH0:
            _store_z(dz0, i_st.to(tl.int64), K, o_k, b_dz)
    elif EXTRA and i_p < NK * NV + NK + NV:  # a value block of dhe
        o_v = (i_p - NK * NV - NK) * BV + tl.arange(0, BV)
        b_dhe = _start_he(dhet, i_st, o_e, o_v, E, V, BV, USE_DHT)
        for i_r in range(hi - lo):
            i_t = hi - 1 - i_r
            if STORE_CHUNKS:
                _store_he(dhe, b_dhe, boh + i_t, i_h, o_v, H, E, V, BV)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_do = _tokens(do, bos, o_t, m_t, i_h, H, V, o_v, False)  # [BT, BV]
            b_r = _row_values(rden, bos, o_t, m_t, i_h, H)
            b_at = _split_features(a, bos, o_t, m_t, i_h, H, E, o_e, True)  # [16, BT]
            b_dhe += tl.dot(b_at, b_do.to(tl.float32) * b_r[:, None], input_precision=SPREC)
        if STORE_DH0:
            _store_he_end(dhe0, b_dhe, i_st, o_v, E, V, BV)
    elif EXTRA:  # dze
        b_dze = _start_ze(dzet, i_st, o_e, E, USE_DHT)
        for i_r in range(hi - lo):
            i_t = hi - 1 - i_r
            if STORE_CHUNKS:
                _store_ze(dze, (boh + i_t) * H + i_h, E, b_dze)
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T_seq
            b_at = _split_features(a, bos, o_t, m_t, i_h, H, E, o_e, True)
            b_dd = _split_column(_row_values(dden, bos, o_t, m_t, i_h, H), o_e)
            b_dze += tl.dot(b_at, b_dd, input_precision=SPREC)
        if STORE_DH0:
            _store_ze(dze0, i_st.to(tl.int64), E, b_dze)


@triton.jit
def _bwd_dqkv_kernel(
    q, k, a, c, v, h, he, z, ze, do, rden, dden, dh, dhe, dz, dze, dq, dk, da, dc, dv, q_in, k_in,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXTRA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr,
    TIMES_FEATURES: tl.constexpr, POLY: tl.constexpr, SIGN: tl.constexpr, DV: tl.constexpr,
):
    """Grid (NT, B * H) or (total chunks, H): dq, dk, dv (and da, dc) of one chunk; BK >= K; dv only where DV (with
    scalar features ``_bwd_dv_kernel`` forms it). With TIMES_FEATURES, q
    and k are exp of the op's inputs, and dq ⊙ q, dk ⊙ k are stored (their gradients). With POLY, q, k, a, c are a
    polynomial kernel's features of the op's inputs (``lazoo.kernels.ela_features``), and their gradients are
    carried to those (q_in, k_in): 1, the sum / sub kernels (q' = q, k' = SIGN k, a = [‖q‖², 1], c = [1, ‖k‖²]);
    2, magnitude_direction (q' = a q, a = ‖q‖² + 1; k likewise); da, dc are not stored.

    With dnum = do / den' and P the chunk's causal scores: dS_ij = dnum_i·v_j + dden_i (i >= j) and
        dq = dnum hᵀ + dden zᵀ + dS K,      dk = v dhᵀ + 1 dzᵀ + dSᵀ Q,      dv = Pᵀ dnum + K dh + C dhe
    (da, dc likewise with he, ze, dhe, dze and A, C), h, z from the chunk's start and dh, dz from its end. The
    scalar features' terms are fp32 row sums. Non-causal: h, z, dh, dz are the sequence's sums, and no dS, P."""
    tl.static_assert(not (DV and EXTRA), "with scalar features dv is _bwd_dv_kernel's")
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    i_tg = _state_index(chunk_indices, i_t, i_bh, i_tg, H, IS_VARLEN, CAUSAL)
    E2: tl.constexpr = E == 2
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q = _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, False)
    b_k = _tokens(k, bos, o_t, m_t, i_h, H, K, o_k, False)
    b_r = _row_values(rden, bos, o_t, m_t, i_h, H)
    b_dden = _row_values(dden, bos, o_t, m_t, i_h, H)
    b_da0 = tl.zeros([BT], dtype=tl.float32)
    b_da1 = tl.zeros([BT], dtype=tl.float32)
    b_dc0 = tl.zeros([BT], dtype=tl.float32)
    b_dc1 = tl.zeros([BT], dtype=tl.float32)
    if CAUSAL:
        b_qt = _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, True)
        o_i = tl.arange(0, BT)
        causal = o_i[:, None] >= o_i[None, :]  # [i, j]: i >= j
        causal_t = o_i[:, None] <= o_i[None, :]  # [j, i]: i >= j
        if DV:
            b_pt = _scores_t(b_k, b_qt, a, c, b_r, causal_t, bos, o_t, m_t, i_h, H, E, EXTRA, PREC)

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)
    p_h = h + (i_tg * H + i_h) * (K * V)
    p_dh = dh + (i_tg * H + i_h) * (K * V)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        m_vk = m_v[:, None] & m_k[None, :]
        b_v = _tokens(v, bos, o_t, m_t, i_h, H, V, o_v, False)
        if CAUSAL:
            b_vt = _tokens(v, bos, o_t, m_t, i_h, H, V, o_v, True)
        b_do = _tokens(do, bos, o_t, m_t, i_h, H, V, o_v, False)
        if CAUSAL:
            b_dot = _tokens(do, bos, o_t, m_t, i_h, H, V, o_v, True)
        b_ht = tl.load(p_h + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)  # [BV, BK]
        b_dht = tl.load(p_dh + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
        if DV:
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dq += tl.dot(b_do.to(b_ht.dtype), b_ht, input_precision=PREC)
        b_dk += tl.dot(b_v.to(b_dht.dtype), b_dht, input_precision=PREC)
        if CAUSAL:
            b_ds += tl.dot(b_do, b_vt, input_precision=PREC)
            b_dst += tl.dot(b_v, b_dot, input_precision=PREC)
        if DV:
            if CAUSAL:
                b_dv = tl.dot(b_pt, b_do, input_precision=PREC) + tl.dot(b_k.to(b_dh.dtype), b_dh,
                                                                          input_precision=PREC)
            else:
                b_dv = tl.dot(b_k.to(b_dh.dtype), b_dh, input_precision=PREC)
        if EXTRA:  # da and dc's sums over these values
            b_da0, b_dc0, b_da1, b_dc1 = _scalar_sums(b_do, b_v, he, dhe, i_tg, i_h, o_v, H, E, V,
                                                      b_da0, b_dc0, b_da1, b_dc1)
        if DV:
            p_dv = dv + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
            tl.store(p_dv, b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    # dnum = do / den'; the normaliser is one more value column of ones, with output gradient dden
    row = i_tg * H + i_h
    b_dq = b_dq * b_r[:, None] + b_dden[:, None] * _vec(z, row, K, o_k, m_k)[None, :]
    b_dk += _vec(dz, row, K, o_k, m_k)[None, :]
    if CAUSAL:
        b_ds = tl.where(causal, b_ds * b_r[:, None] + b_dden[:, None], 0.0)
        b_dst = tl.where(causal_t, b_dst * b_r[None, :] + b_dden[None, :], 0.0)
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q, input_precision=PREC)
    if EXTRA:
        p_e = (bos + o_t) * (H * E) + i_h * E
        a0 = _col(a, bos, o_t, m_t, i_h, 0, H, E)
        c0 = _col(c, bos, o_t, m_t, i_h, 0, H, E)
        b_da0 = b_da0 * b_r + b_dden * tl.load(ze + row * E)
        b_dc0 += tl.load(dze + row * E)
        if CAUSAL:
            b_da0 += tl.sum(b_ds * c0[None, :], 1)
            b_dc0 += tl.sum(b_dst * a0[None, :], 1)
        if POLY == 0:
            tl.store(da + p_e, b_da0, mask=m_t)
            tl.store(dc + p_e, b_dc0, mask=m_t)
        if E2:
            a1 = _col(a, bos, o_t, m_t, i_h, 1, H, E)
            c1 = _col(c, bos, o_t, m_t, i_h, 1, H, E)
            b_da1 = b_da1 * b_r + b_dden * tl.load(ze + row * E + 1)
            b_dc1 += tl.load(dze + row * E + 1)
            if CAUSAL:
                b_da1 += tl.sum(b_ds * c1[None, :], 1)
                b_dc1 += tl.sum(b_dst * a1[None, :], 1)
            if POLY == 0:
                tl.store(da + p_e + 1, b_da1, mask=m_t)
                tl.store(dc + p_e + 1, b_dc1, mask=m_t)
    if TIMES_FEATURES:  # d exp(x) = exp(x) dx, with the features' tiles at hand
        b_dq = b_dq * b_q.to(tl.float32)
        b_dk = b_dk * b_k.to(tl.float32)
    if POLY == 1:  # dq = dq' + 2 q da_0, dk = SIGN dk' + 2 k dc_1 (q, k the inputs: loading q' and k' again
        # kept them live from the chunk's start, and more of the tile spilled)
        b_dq += (2.0 * b_da0)[:, None] * _tokens(q_in, bos, o_t, m_t, i_h, H, K, o_k, False).to(tl.float32)
        b_dk = SIGN * b_dk + (2.0 * b_dc1)[:, None] * _tokens(k_in, bos, o_t, m_t, i_h, H, K, o_k,
                                                               False).to(tl.float32)
    if POLY == 2:  # dq = a dq' + 2 q (q·dq' + da_0), a = ‖q‖² + 1; dk likewise
        b_dq = _magnitude_grad(q_in, bos, o_t, m_t, i_h, H, K, o_k, b_dq, b_da0)
        b_dk = _magnitude_grad(k_in, bos, o_t, m_t, i_h, H, K, o_k, b_dk, b_dc0)
    m_tk = m_t[:, None] & m_k[None, :]
    tl.store(dq + (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)


@triton.jit
def _scores_t(b_k, b_qt, a, c, b_r, causal_t, bos, o_t, m_t, i_h, H: tl.constexpr, E: tl.constexpr,
              EXTRA: tl.constexpr, PREC: tl.constexpr):
    """Pᵀ diag(1/den') ``[BT, BT]`` in k's dtype: Pᵀ[j, i] = k_j·q_i (+ c_j·a_i) where causal_t (i >= j), else 0,
    computed directly (1/den' scales the product, not do: do / den' can fall below fp16's normal range)."""
    b_pt = tl.dot(b_k, b_qt, input_precision=PREC)
    if EXTRA:
        b_pt += _col(c, bos, o_t, m_t, i_h, 0, H, E)[:, None] * _col(a, bos, o_t, m_t, i_h, 0, H, E)[None, :]
        if E == 2:
            b_pt += _col(c, bos, o_t, m_t, i_h, 1, H, E)[:, None] * _col(a, bos, o_t, m_t, i_h, 1, H, E)[None, :]
    return tl.where(causal_t, b_pt * b_r[None, :], 0.0).to(b_k.dtype)


@triton.jit
def _scalar_dv(c, dhe, bos, o_t, m_t, i_h, i_tg, o_v, H: tl.constexpr, E: tl.constexpr, V: tl.constexpr):
    """dv's scalar terms C dhe ``[BT, BV]`` (fp32 outer products)."""
    x = _col(c, bos, o_t, m_t, i_h, 0, H, E)[:, None] * _srow(dhe, i_tg, i_h, 0, o_v, H, E, V)[None, :]
    if E == 2:
        x += _col(c, bos, o_t, m_t, i_h, 1, H, E)[:, None] * _srow(dhe, i_tg, i_h, 1, o_v, H, E, V)[None, :]
    return x


@triton.jit
def _bwd_dv_kernel(
    q, k, a, c, do, rden, dh, dhe, dv, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXTRA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Grid (NV, NT, B * H) or (NV, total chunks, H), with scalar features: dv = Pᵀ dnum + K dh + C dhe of one chunk's
    value block (terms as in _bwd_dqkv; BK >= K)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T_seq, i_c, i_tg = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H, BT, IS_VARLEN)
    i_tg = _state_index(chunk_indices, i_t, i_bh, i_tg, H, IS_VARLEN, CAUSAL)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_k = _tokens(k, bos, o_t, m_t, i_h, H, K, o_k, False)
    b_dh = tl.load(dh + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :],
                   mask=(o_k[:, None] < K) & m_v[None, :], other=0.0)
    b_dv = tl.dot(b_k.to(b_dh.dtype), b_dh, input_precision=PREC)
    if CAUSAL:
        o_i = tl.arange(0, BT)
        b_pt = _scores_t(b_k, _tokens(q, bos, o_t, m_t, i_h, H, K, o_k, True), a, c,
                         _row_values(rden, bos, o_t, m_t, i_h, H), o_i[:, None] <= o_i[None, :], bos, o_t, m_t, i_h,
                         H, E, EXTRA, PREC)
        b_dv += tl.dot(b_pt, _tokens(do, bos, o_t, m_t, i_h, H, V, o_v, False), input_precision=PREC)
    if EXTRA:
        b_dv += _scalar_dv(c, dhe, bos, o_t, m_t, i_h, i_tg, o_v, H, E, V)
    tl.store(dv + (bos + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _scalar_sums(b_do, b_v, he, dhe, i_tg, i_h, o_v, H: tl.constexpr, E: tl.constexpr, V: tl.constexpr,
                 da0, dc0, da1, dc1):
    """The scalar features' gradient sums over a block of values, added to (da0, dc0, da1, dc1): da_e += do·he_e
    (do / den' applied later), dc_e += v·dhe_e, in fp32."""
    b_dof = b_do.to(tl.float32)
    b_vf = b_v.to(tl.float32)
    da0 += tl.sum(b_dof * _srow(he, i_tg, i_h, 0, o_v, H, E, V)[None, :], 1)
    dc0 += tl.sum(b_vf * _srow(dhe, i_tg, i_h, 0, o_v, H, E, V)[None, :], 1)
    if E == 2:
        da1 += tl.sum(b_dof * _srow(he, i_tg, i_h, 1, o_v, H, E, V)[None, :], 1)
        dc1 += tl.sum(b_vf * _srow(dhe, i_tg, i_h, 1, o_v, H, E, V)[None, :], 1)
    return da0, dc0, da1, dc1


@triton.jit
def _magnitude_grad(x_in, bos, o_t, m_t, i_h, H: tl.constexpr, K: tl.constexpr, o_k, g, ga):
    """The gradient of x of magnitude_direction's features x' = (‖x‖² + 1) x and a = ‖x‖² + 1, from theirs (g
    ``[BT, BK]``, ga ``[BT]``), x the op's input (norms in fp32)."""
    x = _tokens(x_in, bos, o_t, m_t, i_h, H, K, o_k, False).to(tl.float32)
    return (tl.sum(x * x, 1) + 1.0)[:, None] * g + 2.0 * x * (tl.sum(x * g, 1) + ga)[:, None]


# ============================================================================ launchers
class _Ctx(ChunkLayout):
    def __init__(self, q, v, a, cu_seqlens, chunk_size, eps, causal=True, exp_of=False, poly=None):
        super().__init__(q, v, cu_seqlens, chunk_size)
        self.causal = causal
        self.exp_of = exp_of  # q, k are exp features of the op's inputs: the gradients go to those
        self.poly = poly  # None, or (POLY, SIGN) of _bwd_dqkv_kernel: q, k, a, c are those features of the inputs
        self.E = 1 if a is None else a.shape[-1]  # (without features: the width of the unused buffers)
        self.extra = a is not None
        self.row_eps = isinstance(eps, torch.Tensor)  # [B, T, H] float32, or one number
        self.eps = eps if self.row_eps else float(eps)
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"
        self.state_dtype = chunk_state_dtype(q.dtype)
        self.two_byte = q.element_size() == 2

    def eps_args(self):
        """(eps, eps_rows) for the kernels: one number and an unused pointer, or 0 and the per-row tensor."""
        return (0.0, self.eps) if self.row_eps else (self.eps, None)

    def meta(self):
        return dict(H=self.H, K=self.K, V=self.V, E=self.E, BT=self.BT, EXTRA=self.extra,
                    IS_VARLEN=self.varlen, PREC=self.prec)

    def state_meta(self):
        """``meta``, the precision of the state kernels' fp32 tile products (tf32 for 16-bit inputs) and the dtype of
        their products' operands (the chunk states' dtype)."""
        sdt = tl.bfloat16 if self.state_dtype == torch.bfloat16 else tl.float32
        return dict(self.meta(), SPREC="ieee" if self.prec == "ieee" else "tf32", SDT=sdt)

    def state_grid(self, BK, BV):
        """The state kernels' grid, less its segments: the tiles of h, the key blocks of z and, with scalar
        features, the value blocks of he and one program for ze (the roles in the kernels' comment)."""
        NK, NV = triton.cdiv(self.K, BK), triton.cdiv(self.V, BV)
        return (NK * NV + NK + (NV + 1 if self.extra else 0), self.N * self.H)

    def buffers(self, dev):
        """Per-chunk buffers (h, he, z, ze) for the states or their gradients."""
        NT, H, K, V, E = self.NT, self.H, self.K, self.V, self.E
        f32 = torch.float32
        return (torch.empty(NT, H, K, V, dtype=self.state_dtype, device=dev), torch.empty(NT, H, E, V, dtype=f32,
                device=dev) if self.extra else None, torch.empty(NT, H, K, dtype=f32, device=dev),
                torch.empty(NT, H, E, dtype=f32, device=dev) if self.extra else None)

    def sums_as_chunk_states(self, h, he, z, ze):
        """The non-causal form's sums (``end_states`` layout) as the chunk kernels read states, one row per sequence:
        ``[N, H, K, V]`` in the chunk states' dtype, ``[N, H, E, V]``, z and ze as they are."""
        return (h.transpose(-1, -2).to(self.state_dtype).contiguous(),
                None if he is None else he.transpose(-1, -2).contiguous(), z, ze)

    def end_states(self, dev, segments: int | None = None):
        """Initial- or final-state buffers (h, he, z, ze), or with ``segments`` one per segment: ``[N, H, S, ...]``."""
        N, H, K, V, E = self.N, self.H, self.K, self.V, self.E
        lead = (N, H) if segments is None else (N, H, segments)
        f32 = torch.float32
        return (torch.empty(*lead, V, K, dtype=f32, device=dev),
                torch.empty(*lead, V, E, dtype=f32, device=dev) if self.extra else None,
                torch.empty(*lead, K, dtype=f32, device=dev),
                torch.empty(*lead, E, dtype=f32, device=dev) if self.extra else None)


def _state_walks(kernel, c: _Ctx, inputs, chunks, first, want_last: bool, reverse: bool):
    """Run a state kernel (``_fwd_h_kernel``, or ``_bwd_dh_kernel`` walking in ``reverse``) through
    ``_segments.state_walks``: every chunk's state into ``chunks`` (causal), from ``first`` (4 parts or None); returns
    the walk's last states (4 parts) where ``want_last``, else None. Non-causal: the sequences' sums alone."""
    dev = inputs[0].device
    BK, BV = state_blocks(c.K, c.V)
    roles, rows = c.state_grid(BK, BV)
    meta = dict(c.state_meta(), BK=BK, BV=BV, num_warps=STATE_WARPS, num_stages=2)
    use, store = ("USE_DHT", "STORE_DH0") if reverse else ("USE_H0", "STORE_HT")
    none = (None,) * 4

    def launch(S, SEG, start, end, store_chunks):
        start, end = start or none, end or none
        kernel[(roles, rows, S)](*inputs, *chunks, *start, *end, c.cu, c.chunk_offsets, c.T, SEG=SEG,
                                 STORE_CHUNKS=store_chunks, **{use: start[0] is not None, store: end[0] is not None},
                                 **meta)

    least = MIN_SEGMENTS_SCALARS if c.extra else MIN_SEGMENTS
    seg = walk_segments(c, roles * rows, dev, FORCE_SEGMENT_CHUNKS, least)
    return state_walks(launch, c, seg, first, want_last, lambda S: c.end_states(dev, S), reverse,
                       totals_only=not c.causal)


def _fwd(c: _Ctx, q, k, a, cf, v, s0, output_final_state):
    dev = q.device
    # non-causal: the sequence's sums alone (as its final state), which every chunk then reads
    h, he, z, ze = c.buffers(dev) if c.causal else (None,) * 4
    st = _state_walks(_fwd_h_kernel, c, (k, cf, v), (h, he, z, ze), s0, output_final_state or not c.causal,
                      reverse=False)
    st = st if st is not None else (None,) * 4
    if not c.causal:
        (h, he, z, ze), st = c.sums_as_chunk_states(*st), (None,) * 4
    o = torch.empty(c.B, c.T, c.H, c.V, dtype=v.dtype, device=dev)
    den = torch.empty(c.B, c.T, c.H, dtype=torch.float32, device=dev)
    BV = min(FWD_BV if c.two_byte else 64, next_pow2(c.V))
    eps, eps_rows = c.eps_args()
    _fwd_o_kernel[c.grid(triton.cdiv(c.V, BV))](q, k, a, cf, v, h, he, z, ze, o, den, c.cu, c.chunk_indices,
                                                eps, eps_rows, c.T, BK=min(64, next_pow2(c.K)), BV=BV,
                                                ROW_EPS=c.row_eps, CAUSAL=c.causal, **c.meta(),
                                                num_warps=4, num_stages=2)
    return o, den, (h, he, z, ze), st


def _bwd(c: _Ctx, q, k, a, cf, v, states, o, den, do, dst, want_ds0, q_in=None, k_in=None):
    dev = q.device
    rows = c.B * c.T * c.H
    rden = torch.empty(c.B, c.T, c.H, dtype=torch.float32, device=dev)
    dden = torch.empty_like(rden)
    BR = 32
    _bwd_prep_kernel[(triton.cdiv(rows, BR),)](o, do, den, rden, dden, *c.eps_args(), rows, H=c.H, V=c.V, BR=BR,
                                               BV=next_pow2(c.V), ROW_EPS=c.row_eps, num_warps=4)
    # non-causal: the gradients of the sequence's sums (as an initial state's), which every chunk then reads
    dh, dhe, dz, dze = c.buffers(dev) if c.causal else (None,) * 4
    ds0 = _state_walks(_bwd_dh_kernel, c, (q, a, do, rden, dden), (dh, dhe, dz, dze), dst, want_ds0 or not c.causal,
                       reverse=True)
    ds0 = ds0 if ds0 is not None else (None,) * 4
    if not c.causal:
        (dh, dhe, dz, dze), ds0 = c.sums_as_chunk_states(*ds0), (None,) * 4
    # the gradients of the op's inputs where q, k are features of them
    dq, dk, dv = torch.empty_like(q if q_in is None else q_in), torch.empty_like(k if k_in is None else k_in), \
        torch.empty_like(v)
    da = torch.empty_like(a) if c.extra and c.poly is None else None
    dc = torch.empty_like(cf) if c.extra and c.poly is None else None
    BK = next_pow2(c.K)
    h, he, z, ze = states
    configs = dqkv_configs(BK, c.V, c.two_byte, DQKV_BV)
    poly, sign = c.poly or (0, 1.0)
    # with scalar features, dv in a kernel of its own: the dq, dk, dv kernel then holds no score tile and spills
    # nothing (offline, sm_90: 188-236 bytes with dv), 1-3 % faster on an H100 (docs/changelog.md)
    dv_apart = c.extra
    key = ("normalized bwd_dqkv", q.dtype, c.H, c.K, c.V, c.E, c.BT, c.varlen, c.causal, c.exp_of, poly, sign,
           q.device.type)  # (c.E decides dv_apart)
    launch_first_fitting(_bwd_dqkv_kernel, lambda cfg: c.grid(), key, configs, q, k, a, cf, v, h, he, z, ze, do, rden,
                         dden, dh, dhe, dz, dze, dq, dk, da, dc, dv, q_in, k_in, c.cu, c.chunk_indices, c.T, BK=BK,
                         CAUSAL=c.causal, TIMES_FEATURES=c.exp_of, POLY=poly, SIGN=sign, DV=not dv_apart, **c.meta())
    if dv_apart:
        BV = min(64, next_pow2(c.V))
        _bwd_dv_kernel[c.grid(triton.cdiv(c.V, BV))](q, k, a, cf, do, rden, dh, dhe, dv, c.cu, c.chunk_indices, c.T,
                                                     BK=BK, BV=BV, CAUSAL=c.causal, **c.meta(), num_warps=4,
                                                     num_stages=2)
    return dq, dk, da, dc, dv, ds0


class NormalizedLinearAttentionFunction(torch.autograd.Function):
    """Chunked normalised linear attention with scalar features and a hand-written backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, a, cf, v, h0, he0, z0, ze0, eps, output_final_state, cu_seqlens, chunk_size, causal,
                q_in=None, k_in=None, poly=None):
        c = _Ctx(q, v, a, cu_seqlens, chunk_size, eps, causal, exp_of=q_in is not None and poly is None, poly=poly)
        s0 = None if h0 is None else (h0, he0, z0, ze0)
        o, den, states, st = _fwd(c, q, k, a, cf, v, s0, output_final_state)
        ctx.c = c
        ctx.s0_dtypes = None if s0 is None else [None if x is None else x.dtype for x in s0]
        inputs = (q_in, k_in) if poly is not None else (None, None)
        ctx.save_for_backward(q, k, a, cf, v, o, den, *inputs, *states)
        return (o, *st)

    @staticmethod
    def backward(ctx, do, dht, dhet, dzt, dzet):
        q, k, a, cf, v, o, den, q_in, k_in, *states = ctx.saved_tensors
        c = ctx.c
        finals = (dht, dhet, dzt, dzet)
        dst = None
        if any(x is not None for x in finals):  # the gradients of the final states (zeros for those not used)
            dst = tuple(None if like is None else like.zero_() if x is None else x.contiguous().float()
                        for x, like in zip(finals, c.end_states(q.device)))
        want = ctx.s0_dtypes is not None
        dq, dk, da, dc, dv, ds0 = _bwd(c, q, k, a, cf, v, states, o, den, do.contiguous(), dst, want, q_in, k_in)
        if want:
            ds0 = tuple(None if x is None or t is None else x.to(t) for x, t in zip(ds0, ctx.s0_dtypes))
        else:
            ds0 = (None,) * 4
        if c.exp_of or c.poly is not None:  # q, k are features of inputs that take the gradients
            return None, None, da, dc, dv, *ds0, None, None, None, None, None, dq, dk, None
        return dq, dk, da, dc, dv, *ds0, None, None, None, None, None, None, None, None


def chunk_normalized_linear_attention(q, k, v, a=None, c=None, *, eps: float | torch.Tensor = 1e-6, initial_state=None,
                                      output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64,
                                      causal: bool = True, exp_of=None, poly_of=None):
    """``(o [B, T, H, V] in v's dtype, final state or None)``: o_i = num_i / max(den_i, eps) (module docstring).

    q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` of one dtype (k zero at pads); a, c ``[B, T, H, E]`` scalar
    features, E = 1 or 2 (cast to float32; c zero at pads), or None. States are tuples
    ``(h [N, H, V, K], he [N, H, V, E], z [N, H, K], ze [N, H, E])`` in float32 (he, ze None without scalar
    features). Differentiable in all of them. ``eps`` is one number, or a clamp per token and head ``[B, T, H]``
    (float32, no gradient; ELA's hadamard_exp, whose features are scaled per query).

    ``causal=False`` is the non-causal form: every token's sums run over its whole sequence (j ≤ i becomes any j).
    The same kernels run without the chunks' score tiles, on the sequence's sums; it has no state.

    ``exp_of=(x, y)``: q and k are features exp(x + shift), exp(y + shift) (shifts without gradient; ELA's
    hadamard_exp, ``lazoo.kernels.ela_features.exp_features``), given without gradient. x and y get theirs,
    dq ⊙ q and dk ⊙ k, formed in the backward kernel (no scalar features then).

    ``poly_of=(x, y, magnitude, sign)``: q, k, a, c are the features of x, y of ELA's polynomial kernel whose
    ``lazoo.kernels.ela_features.KERNELS`` entry is (magnitude, sign) (``poly_features``), given without gradient; x
    and y get theirs from the backward kernel, which then stores no da, dc.
    """
    if not causal and (initial_state is not None or output_final_state):
        raise ValueError("chunk_normalized_linear_attention: the non-causal form (causal=False) has no state; leave "
                         "initial_state=None and output_final_state=False")
    if (a is None) != (c is None):
        raise ValueError("chunk_normalized_linear_attention: give both scalar features a and c, or neither")
    if a is not None and not (a.shape == c.shape and a.shape[:3] == q.shape[:3]
                              and 1 <= a.shape[-1] <= MAX_SCALARS):
        raise ValueError(f"chunk_normalized_linear_attention: a and c must be [B, T, H, E] with 1 <= E <= "
                         f"{MAX_SCALARS}, got {tuple(a.shape)} and {tuple(c.shape)} for q {tuple(q.shape)}")
    if initial_state is not None:
        given = [x is not None for x in initial_state]
        if len(given) != 4 or given != [True, a is not None, True, a is not None]:
            raise ValueError("chunk_normalized_linear_attention: initial_state is (h, he, z, ze), with he and ze "
                             "exactly when there are scalar features")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # one scalar feature runs as two, the second zero: with one, the state kernels took 0.57 / 0.69 ms at T = 8k on
    # an H200 (Triton 3.6) where two took 0.35 / 0.46 (ELA magnitude_direction fwd + bwd at 8k / 32k: 2.97 / 4.03 ms
    # as one, 2.72 / 3.36 as two; 2.23 / 2.33 at 1k, where the dq, dk, dv kernel's second feature costs more)
    pad = a is not None and a.shape[-1] == 1
    if a is not None:
        a, c = (_second_zero(x) if pad else x.float().contiguous() for x in (a, c))
    s0 = (None,) * 4
    if initial_state is not None:
        s0 = tuple(None if x is None else x.float().contiguous() for x in initial_state)
        if pad:  # he0 [N, H, V, 1], ze0 [N, H, 1]
            s0 = (s0[0], _second_zero(s0[1]), s0[2], _second_zero(s0[3]))
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    chunk = chunk_size if chunk_size in (16, 32, 64) else 64
    if isinstance(eps, torch.Tensor):
        if eps.shape != q.shape[:3]:
            raise ValueError(f"chunk_normalized_linear_attention: eps per row must be [B, T, H] = "
                             f"{tuple(q.shape[:3])}, got {tuple(eps.shape)}")
        eps = eps.detach().float().contiguous()
    else:
        eps = float(eps)
    q_in, k_in = (None, None) if exp_of is None else exp_of
    if exp_of is not None and (a is not None or q_in.shape != q.shape or k_in.shape != k.shape):
        raise ValueError("chunk_normalized_linear_attention: exp_of is (x, y) of q's and k's shapes, without scalar "
                         "features")
    poly = None
    if poly_of is not None:
        q_in, k_in, mag, sign = poly_of
        if exp_of is not None or a is None or q_in.shape != q.shape or k_in.shape != k.shape or \
                (not mag and sign not in (2.0, -2.0)):
            raise ValueError("chunk_normalized_linear_attention: poly_of is (x, y, magnitude, sign) of q's and k's "
                             "shapes, with scalar features and without exp_of, sign ±2 unless magnitude")
        poly = (2, 1.0) if mag else (1, float(sign))
        q_in, k_in = q_in.contiguous(), k_in.contiguous()
    o, *st = NormalizedLinearAttentionFunction.apply(q, k, a, c, v, *s0, eps, bool(output_final_state),
                                                     cu_seqlens, chunk, bool(causal), q_in, k_in, poly)
    if pad and output_final_state:
        st = [st[0], st[1][..., :1], st[2], st[3][..., :1]]
    return o, (tuple(st) if output_final_state else None)


def _second_zero(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]`` -> ``[..., 2]`` fp32, the second feature zero (differentiable)."""
    x = x.float()
    return torch.cat([x, torch.zeros_like(x)], -1).contiguous()
