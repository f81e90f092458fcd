"""Device functions the chunked kernels share (lazoo.kernels.linear, .gla, .normalized, .delta, .kda): which sequence,
chunk and state tile a program owns, its state tiles' loads and stores, ``tl.dot`` on operands of one type, the exact
inverse of unit lower-triangular 16 × 16 tiles (the delta rules' WY solves), and a float32 value rounded to a
pointer's element type the same way in the interpreter and on a GPU (the element-wise kernels).

Chunked kernels split every sequence into chunks of ``BT`` tokens that never straddle a packed sequence. Without
``cu_seqlens`` a row is a sample (B rows of T tokens); with it, B = 1 and row i_n is the packed sequence
``cu_seqlens[i_n]:cu_seqlens[i_n + 1]``. Per-chunk state buffers are ``[total chunks, H, K, V]``; initial and final
states ``[N, H, V, K]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(bos, T_seq, NT, boh): first token, length, chunk count and first chunk of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T_seq = (eos - bos).to(tl.int32)
        NT = (T_seq + BT - 1) // BT
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_seq = T
        NT = (T + BT - 1) // BT
        boh = i_n.to(tl.int64) * NT
    return bos, T_seq, NT, boh


@triton.jit
def state_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A state kernel's program on grid (NK * NV, N * H): (i_nh, i_h), its sequence (bos, T_seq, NT, boh as in
    ``seq_bounds``) and its [BK, BV] tile of the state (o_k, o_v, m_kv)."""
    i_kv, i_nh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_k, i_v = i_kv // NV, i_kv % NV
    i_h = i_nh % H
    bos, T_seq, NT, boh = seq_bounds(cu_seqlens, chunk_offsets, i_nh // H, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    return i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv


@triton.jit
def end_state(ptr, i_nh, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Pointers to a program's [BK, BV] tile of an initial or final state ``[N, H, V, K]`` (element (k, v) of head
    i_nh at v * K + k: the layout the ops hand over)."""
    return ptr + i_nh.to(tl.int64) * (V * K) + o_v[None, :] * K + o_k[:, None]


@triton.jit
def load_end_state(ptr, i_nh, o_k, o_v, m_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, USE: tl.constexpr):
    """A state kernel's starting [BK, BV] tile in fp32: the program's tile of ``ptr`` (``end_state``) when USE,
    else zeros."""
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE:
        b_h += tl.load(end_state(ptr, i_nh, o_k, o_v, K, V), mask=m_kv, other=0.0).to(tl.float32)
    return b_h


@triton.jit
def store_chunk_state(ptr, b_h, i_tg, i_h, o_k, o_v, m_kv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Store a program's [BK, BV] tile of the state of global chunk i_tg (buffer ``[chunks, H, K, V]``)."""
    p_h = ptr + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    tl.store(p_h, b_h.to(ptr.dtype.element_ty), mask=m_kv)


@triton.jit
def chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H: tl.constexpr, BT: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """(i_h, bos, T_seq, i_c, i_tg) for program chunk i_t of row i_bh (sample or sequence, head): the head,
    sequence start and length, chunk index in the sequence, and global chunk index (into the state buffers)."""
    i_b, i_h = i_bh // H, i_bh % H
    NT_b = (T + BT - 1) // BT
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T_seq = (eos - bos).to(tl.int32)
        i_tg = i_t.to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        T_seq = T
        i_c = i_t
        i_tg = i_b.to(tl.int64) * NT_b + i_t
    return i_h, bos, T_seq, i_c, i_tg


@triton.jit
def dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with operands cast to DT (a no-op for tiles loaded raw) and fp32 (fp64) accumulation."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def inv_unit_lower16(L):
    """``(I + L)^{-1}`` of a strictly lower-triangular 16x16 fp32 tile, by forward substitution."""
    o = tl.arange(0, 16)
    Y = -L
    for i in tl.static_range(2, 16):
        y = tl.sum(tl.where(o[:, None] == i, Y, 0.0), 0)  # row i (still -L[i, :])
        y = y + tl.sum(y[:, None] * Y, 0)  # + sum_j (-L[i, j]) X[j, :] over finished rows j < i
        Y = tl.where(o[:, None] == i, y[None, :], Y)
    return Y + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def inv_unit_lower16x4(L0, L1, L2, L3):
    """``inv_unit_lower16`` of four tiles at once, row i of all four in one step: a serial chain of 14 steps where
    the four one after another take 56."""
    o = tl.arange(0, 16)
    Y = -tl.join(tl.join(L0, L1), tl.join(L2, L3))  # [16, 16, 2, 2]
    for i in tl.static_range(2, 16):
        y = tl.sum(tl.where(o[:, None, None, None] == i, Y, 0.0), 0)  # rows i [16, 2, 2]
        y = y + tl.sum(y[:, None, :, :] * Y, 0)
        Y = tl.where(o[:, None, None, None] == i, y[None, :, :, :], Y)
    Y = Y + (o[:, None] == o[None, :]).to(tl.float32)[:, :, None, None]
    Y01, Y23 = tl.split(Y)
    N0, N1 = tl.split(Y01)
    N2, N3 = tl.split(Y23)
    return N0, N1, N2, N3


@triton.jit
def rounded_for(x, ptr):
    """fp32 ``x`` in ``ptr``'s element type, rounded to nearest even. The interpreter truncates fp32 to bf16 (the
    GPU rounds), so bf16 is rounded here on the bits first and the cast is exact on both (x finite)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)
