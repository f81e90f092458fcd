"""Triton kernels for OVQ attention's chunk step (``lazoo.ops.ovq_attention``, backend "triton").

For every chunk c of L tokens, per sample and head, the queries of the chunk attend to the chunk's
dictionary followed by the chunk's own keys:

    O_c = softmax(Q_c [Dk_c; K_c]ᵀ + [log counts_c; 0] + causal mask) [Dv_c; V_c]

(q already carries the scale β). Dictionary slots with count 0 are empty and masked out; keys at
positions >= ``length[b]`` are masked out too (the packed tail of a sample). All chunks of a call run
in one launch: the assignments are known before (``lazoo.ops.ovq``), so chunks do not depend on each
other here.

The dictionaries come as *versions*, not one copy per chunk: a slot's centroid changes only when a key
joins it, so every value a slot takes in the call is one row of a table ``dict_k [B, H, R, dk]`` (likewise
``dict_v``), and chunk g reads slot s at row ``base[b, h, s] + counts[g, b, h, s]`` (its count before the
chunk picks the version). The table holds O(T + M) rows where per-chunk dictionaries held O(T/L · M).

Kernels, flash-attention style (online softmax over key blocks, fp32 accumulators, the log-sum-exp
of every query row saved for the backward):
  * ``_fwd_kernel``: one program per (chunk, block of BM query rows, sample·head); loops over the
    chunk's active dictionary rows (up to the last non-empty slot) and then its causal key blocks.
  * ``_bwd_dq_kernel``: the same loops, accumulating dQ = Σ dS K.
  * ``_bwd_dkv_kernel``: one program per block of BN key rows, either the slots one chunk reads (DICT: all L
    queries of that chunk see them) or the chunk's own keys (the queries at or after them); accumulates
    dK = dSᵀ Q and dV = Pᵀ dO. A version row read by several chunks gets the sum of their gradients (fp32
    atomic adds, so the last bits depend on the order); the op's autograd carries them into the keys and
    values that built the versions.
  * ``_decode_kernel``: one token (no autograd) against the state: the dictionary split over programs plus the
    partial chunk, combined from each share's softmax statistics (``ovq_decode_attention``).

bf16/fp16 inputs go to ``tl.dot`` as they are, with fp32 accumulation; fp32 inputs use the default
dot precision (tf32 on GPUs). Under ``TRITON_INTERPRET=1`` the kernels run in fp32/fp16 only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import is_interpreting, next_pow2, num_sms

#: a finite "minus infinity" for masked logits (keeps fully masked rows NaN-free)
NEG_INF = -1.0e30
NEG = tl.constexpr(NEG_INF)


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _tile(ptr, rows, row_ok, D: tl.constexpr, BD: tl.constexpr):
    """Rows ``rows`` (int64 row indices into a row-major [*, D] tensor) as a [len, BD] tile (0 past D)."""
    o = tl.arange(0, BD)
    return tl.load(ptr + rows[:, None] * D + o[None, :], mask=row_ok[:, None] & (o < D)[None, :], other=0.0)


@triton.jit
def _dict_block(dk, dv, counts, base, cbase, bbase, vbase, j, n, DQK: tl.constexpr, DV: tl.constexpr,
                BDK: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr):
    """Slots j..j+BN as one (chunk, sample, head) reads them: keys, values, the log-count bias, which are
    active, and their rows in the version tables (slot s is row vbase + base[s] + count[s])."""
    cols = j + tl.arange(0, BN)
    ok = cols < n
    cnt = tl.load(counts + cbase + cols, mask=ok, other=0)
    active = ok & (cnt > 0)
    rows = vbase + tl.load(base + bbase + cols, mask=active, other=0) + cnt
    bb = tl.where(active, tl.log(tl.maximum(cnt, 1).to(tl.float32)), NEG)
    return _tile(dk, rows, active, DQK, BDK), _tile(dv, rows, active, DV, BDV), bb, active, rows


@triton.jit
def _chunk_block(k, v, qkbase, i_h, g, j, L, H, n_valid, DQK: tl.constexpr, DV: tl.constexpr,
                 BDK: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr):
    """The chunk's own key rows j..j+BN: keys, values, their row in the chunk, and which are real."""
    r = j + tl.arange(0, BN)
    t = g * L + r
    ok = (r < L) & (t < n_valid)
    rows = (qkbase + t) * H + i_h
    return _tile(k, rows, ok, DQK, BDK), _tile(v, rows, ok, DV, BDV), r, ok


@triton.jit
def _query_block(size, length, B, T, H, W, L, BM: tl.constexpr):
    """A query-block program on grid (chunks · query blocks, B · H): chunk g, query block qb, head i_h, the
    sample's real length n_valid and row base qkbase in [B, T, H, *] (before * H + i_h), the block's rows in
    the chunk rq (real: rq_ok) and in [B, T, H, *] (q_rows), the chunk's row in counts [G, B, H, W] (cbase),
    the (sample, head)'s in base [B, H, W] (bbase), and the dictionary's active size."""
    nqb = tl.cdiv(L, BM)
    g = tl.program_id(0) // nqb
    qb = tl.program_id(0) % nqb
    bh = tl.program_id(1).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    n_valid = tl.load(length + i_b)
    rq = qb * BM + tl.arange(0, BM)
    rq_ok = rq < L
    qkbase = i_b * T
    q_rows = (qkbase + g * L + rq) * H + i_h
    gbh = (g * B + i_b) * H + i_h
    return g, qb, i_h, n_valid, rq, rq_ok, qkbase, q_rows, gbh * W, bh * W, tl.load(size + gbh)


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_kernel(q, k, v, dk, dv, counts, base, size, length, o, lse, B, T, H, W, R, L,
                DQK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    g, qb, i_h, n_valid, rq, rq_ok, qkbase, q_rows, cbase, bbase, n = _query_block(size, length, B, T, H, W, L,
                                                                                 BM)
    vbase = tl.program_id(1).to(tl.int64) * R
    b_q = _tile(q, q_rows, rq_ok, DQK, BDK)

    m_i = tl.full([BM], NEG, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for j in range(0, n, BN):  # the dictionary (active prefix), bias log counts
        b_k, b_v, bb, active, _ = _dict_block(dk, dv, counts, base, cbase, bbase, vbase, j, n, DQK, DV, BDK,
                                              BDV, BN)
        s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32) + bb[None, :]
        allowed = active[None, :] & rq_ok[:, None]
        s = tl.where(allowed, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v).to(tl.float32)
        m_i = m_new
    for j in range(0, tl.minimum((qb + 1) * BM, L), BN):  # the chunk's keys, causal
        b_k, b_v, rk, ok = _chunk_block(k, v, qkbase, i_h, g, j, L, H, n_valid, DQK, DV, BDK, BDV, BN)
        s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32)
        allowed = ok[None, :] & (rk[None, :] <= rq[:, None]) & rq_ok[:, None]
        s = tl.where(allowed, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v).to(tl.float32)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    ov = tl.arange(0, BDV)
    tl.store(o + q_rows[:, None] * DV + ov[None, :], out.to(o.dtype.element_ty),
             mask=rq_ok[:, None] & (ov < DV)[None, :])
    tl.store(lse + q_rows, tl.where(l_i > 0, m_i + tl.log(l_safe), 0.0), mask=rq_ok)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _bwd_dq_kernel(q, k, v, dk, dv, counts, base, size, length, do, lse, delta, dq, B, T, H, W, R, L,
                   DQK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    g, qb, i_h, n_valid, rq, rq_ok, qkbase, q_rows, cbase, bbase, n = _query_block(size, length, B, T, H, W, L,
                                                                                 BM)
    vbase = tl.program_id(1).to(tl.int64) * R
    b_q = _tile(q, q_rows, rq_ok, DQK, BDK)
    b_do = _tile(do, q_rows, rq_ok, DV, BDV)
    b_lse = tl.load(lse + q_rows, mask=rq_ok, other=0.0)
    b_delta = tl.load(delta + q_rows, mask=rq_ok, other=0.0)

    acc = tl.zeros([BM, BDK], tl.float32)
    for j in range(0, n, BN):
        b_k, b_v, bb, active, _ = _dict_block(dk, dv, counts, base, cbase, bbase, vbase, j, n, DQK, DV, BDK,
                                              BDV, BN)
        s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32) + bb[None, :]
        allowed = active[None, :] & rq_ok[:, None]
        p = tl.where(allowed, tl.exp(s - b_lse[:, None]), 0.0)
        dp = tl.dot(b_do, tl.trans(b_v)).to(tl.float32)
        ds = p * (dp - b_delta[:, None])
        acc += tl.dot(ds.to(b_k.dtype), b_k).to(tl.float32)
    for j in range(0, tl.minimum((qb + 1) * BM, L), BN):
        b_k, b_v, rk, ok = _chunk_block(k, v, qkbase, i_h, g, j, L, H, n_valid, DQK, DV, BDK, BDV, BN)
        s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32)
        allowed = ok[None, :] & (rk[None, :] <= rq[:, None]) & rq_ok[:, None]
        p = tl.where(allowed, tl.exp(s - b_lse[:, None]), 0.0)
        dp = tl.dot(b_do, tl.trans(b_v)).to(tl.float32)
        ds = p * (dp - b_delta[:, None])
        acc += tl.dot(ds.to(b_k.dtype), b_k).to(tl.float32)
    od = tl.arange(0, BDK)
    tl.store(dq + q_rows[:, None] * DQK + od[None, :], acc.to(dq.dtype.element_ty),
             mask=rq_ok[:, None] & (od < DQK)[None, :])


@triton.jit
def _bwd_dkv_kernel(q, k, v, dk, dv, counts, base, size, length, do, lse, delta, gk, gv, B, T, H, W, R, L,
                    DICT: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One block of BN key rows: the slots one chunk reads (DICT) or the chunk's own keys. DICT adds dK and
    dV (fp32) into the version rows read (``gk [B, H, R, dk]``, atomically: other chunks read them too);
    otherwise writes them into ``gk [B, T, H, dk]``, ``gv``."""
    if DICT:
        nkb = tl.cdiv(W, BN)
    else:
        nkb = tl.cdiv(L, BN)
    g = tl.program_id(0) // nkb
    kb = tl.program_id(0) % nkb
    bh = tl.program_id(1).to(tl.int64)
    i_b = bh // H
    i_h = bh % H
    n_valid = tl.load(length + i_b)
    qkbase = i_b * T
    gbh = (g * B + i_b) * H + i_h
    j = kb * BN
    if DICT:
        n = tl.load(size + gbh)
        b_k, b_v, bb, active, k_rows = _dict_block(dk, dv, counts, base, gbh * W, bh * W, bh * R, j, n, DQK, DV,
                                                   BDK, BDV, BN)
        rk = j + tl.arange(0, BN)
        q_start = 0
        q_end = tl.where(j < n, L, 0)  # an empty block: no query sees it, nothing to add
    else:
        b_k, b_v, rk, active = _chunk_block(k, v, qkbase, i_h, g, j, L, H, n_valid, DQK, DV, BDK, BDV, BN)
        k_rows = (qkbase + g * L + rk) * H + i_h
        bb = tl.zeros([BN], tl.float32)
        q_start = (j // BM) * BM
        q_end = L
    acc_k = tl.zeros([BN, BDK], tl.float32)
    acc_v = tl.zeros([BN, BDV], tl.float32)
    for i in range(q_start, q_end, BM):
        rq = i + tl.arange(0, BM)
        rq_ok = rq < L
        q_rows = (qkbase + g * L + rq) * H + i_h
        b_q = _tile(q, q_rows, rq_ok, DQK, BDK)
        b_do = _tile(do, q_rows, rq_ok, DV, BDV)
        b_lse = tl.load(lse + q_rows, mask=rq_ok, other=0.0)
        b_delta = tl.load(delta + q_rows, mask=rq_ok, other=0.0)
        s = tl.dot(b_q, tl.trans(b_k)).to(tl.float32) + bb[None, :]
        allowed = active[None, :] & rq_ok[:, None]
        if not DICT:
            allowed = allowed & (rk[None, :] <= rq[:, None])
        p = tl.where(allowed, tl.exp(s - b_lse[:, None]), 0.0)
        acc_v += tl.dot(tl.trans(p.to(b_do.dtype)), b_do).to(tl.float32)
        dp = tl.dot(b_do, tl.trans(b_v)).to(tl.float32)
        ds = p * (dp - b_delta[:, None])
        acc_k += tl.dot(tl.trans(ds.to(b_q.dtype)), b_q).to(tl.float32)
    od = tl.arange(0, BDK)
    ov = tl.arange(0, BDV)
    if DICT:
        if j < n:
            tl.atomic_add(gk + k_rows[:, None] * DQK + od[None, :], acc_k,
                          mask=active[:, None] & (od < DQK)[None, :], sem="relaxed")
            tl.atomic_add(gv + k_rows[:, None] * DV + ov[None, :], acc_v,
                          mask=active[:, None] & (ov < DV)[None, :], sem="relaxed")
    else:
        k_ok = rk < L
        tl.store(gk + k_rows[:, None] * DQK + od[None, :], acc_k.to(gk.dtype.element_ty),
                 mask=k_ok[:, None] & (od < DQK)[None, :])
        tl.store(gv + k_rows[:, None] * DV + ov[None, :], acc_v.to(gv.dtype.element_ty),
                 mask=k_ok[:, None] & (ov < DV)[None, :])


# ----------------------------------------------------------------------------- decoding one token
@triton.jit
def _decode_kernel(q, dk, dv, counts, pk, pv, n_part, m_out, l_out, acc_out, H, M, L, ROWS,
                   DQK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                   BL: tl.constexpr):
    """One query per sample·head against a share of its state: dictionary rows [sp·ROWS, sp·ROWS + ROWS) for
    programs sp < last, the partial chunk's first n_part rows for the last one. Writes the share's softmax
    statistics (max, sum of exponentials, weighted sum of values) for the combine."""
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    i_b = bh // H
    i_h = bh % H
    od = tl.arange(0, BDK)
    ov = tl.arange(0, BDV)
    md = od < DQK
    mv = ov < DV
    b_q = tl.load(q + bh * DQK + od, mask=md, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BN], NEG, tl.float32), 0)
    l_i = m_i * 0.0
    acc = tl.zeros([BDV], tl.float32)
    if sp < nsp - 1:  # dictionary rows, bias log counts
        lo = sp * ROWS
        hi = tl.minimum(lo + ROWS, M)
        for j in range(lo, hi, BN):
            cols = j + tl.arange(0, BN)
            cnt = tl.load(counts + bh * M + cols, mask=cols < hi, other=0)
            act = cnt > 0
            rows = bh * M + cols
            b_k = tl.load(dk + rows[:, None] * DQK + od[None, :], mask=act[:, None] & md[None, :], other=0.0)
            s = tl.sum(b_k.to(tl.float32) * b_q[None, :], 1) + tl.log(tl.maximum(cnt, 1).to(tl.float32))
            s = tl.where(act, s, NEG)
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.where(act, tl.exp(s - m_new), 0.0)
            b_v = tl.load(dv + rows[:, None] * DV + ov[None, :], mask=act[:, None] & mv[None, :], other=0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * b_v.to(tl.float32), 0)
            m_i = m_new
    else:  # the partial chunk (the new token included)
        r = tl.arange(0, BL)
        ok = r < tl.load(n_part + i_b)
        rows = (i_b * L + r) * H + i_h
        b_k = tl.load(pk + rows[:, None] * DQK + od[None, :], mask=ok[:, None] & md[None, :], other=0.0)
        s = tl.where(ok, tl.sum(b_k.to(tl.float32) * b_q[None, :], 1), NEG)
        m_i = tl.max(s, 0)
        p = tl.where(ok, tl.exp(s - m_i), 0.0)
        b_v = tl.load(pv + rows[:, None] * DV + ov[None, :], mask=ok[:, None] & mv[None, :], other=0.0)
        l_i = tl.sum(p, 0)
        acc = tl.sum(p[:, None] * b_v.to(tl.float32), 0)
    out = bh * nsp + sp
    tl.store(m_out + out, m_i)
    tl.store(l_out + out, l_i)
    tl.store(acc_out + out * DV + ov, acc, mask=mv)


@torch.no_grad()
def ovq_decode_attention(q, dict_k, dict_v, counts, part_k, part_v, n_part):
    """One token's attention over [the dictionary (bias log counts); the partial chunk's first ``n_part`` rows]:
    q ``[B, H, dk]`` (carrying the scale), dict_k ``[B, H, M, dk]``, dict_v ``[B, H, M, dv]``, counts ``[B, H, M]``
    (0 = empty), part_k ``[B, L, H, dk]``, part_v ``[B, L, H, dv]`` (the new token already written), n_part ``[B]``.
    Returns o ``[B, H, dv]`` fp32 (0 where nothing is visible). No autograd (decoding). The dictionary is split
    over programs so that a few sequences still fill the GPU; the shares' statistics are combined here."""
    B, H, dk = q.shape
    M, dv, L = dict_k.shape[2], dict_v.shape[-1], part_k.shape[1]
    BN = 16 if is_interpreting() else 64
    splits = max(1, min(triton.cdiv(2 * num_sms(q.device), B * H), triton.cdiv(max(M, 1), BN)))
    rows = triton.cdiv(triton.cdiv(max(M, 1), splits), BN) * BN
    S = triton.cdiv(max(M, 1), rows) + 1  # the dictionary's shares and the partial chunk
    f32 = dict(dtype=torch.float32, device=q.device)
    m, l, acc = torch.empty(B * H, S, **f32), torch.empty(B * H, S, **f32), torch.empty(B * H, S, dv, **f32)
    _decode_kernel[(B * H, S)](q.contiguous(), dict_k.contiguous(), dict_v.contiguous(), counts.contiguous(),
                               part_k.contiguous(), part_v.contiguous(), n_part.to(torch.int32).contiguous(),
                               m, l, acc, H, M, L, rows, DQK=dk, DV=dv, BDK=next_pow2(dk), BDV=next_pow2(dv), BN=BN,
                               BL=next_pow2(L))
    w = torch.exp(m - m.amax(1, keepdim=True))  # shares with nothing visible hold NEG_INF: weight 0
    den = (w * l).sum(1)
    o = (w[..., None] * acc).sum(1) / torch.where(den > 0, den, 1.0)[:, None]
    return o.view(B, H, dv)


# ----------------------------------------------------------------------------- launch
#: tile sizes and launch options of each kernel on a GPU (BM query rows, BN key rows a tile), from
#: ``scripts/tune_ovq_attention.py`` (H100, Triton 3.6, T = 16k, d = 128: the kernels' fwd + bwd 4.04 -> 3.72 ms).
#: Keep BM >= 64 in the dk, dv kernels: BM = 32 gave wrong gradients there on that GPU (relative 2e-3 to 0.17),
#: where the interpreter is exact at the same tiles
LAUNCH = {
    "fwd": dict(BM=64, BN=64, num_warps=4, num_stages=3),
    "dq": dict(BM=128, BN=64, num_warps=8, num_stages=2),
    "dkv_chunk": dict(BM=64, BN=64, num_warps=4, num_stages=2),
    "dkv_dict": dict(BM=64, BN=64, num_warps=4, num_stages=2),
}


def _blocks(kernel: str) -> dict:
    """``kernel``'s tile sizes and launch options (16-row tiles under the interpreter, where speed is not the
    point)."""
    if is_interpreting():
        return dict(BM=16, BN=16)
    return LAUNCH[kernel]


def _prepare(q, counts, length):
    """The rows to visit per (chunk, sample, head) (up to the last active slot) and the lengths."""
    B, T, H, dk = q.shape
    G, W = counts.shape[0], counts.shape[3]
    active = counts > 0
    size = ((torch.arange(1, W + 1, device=q.device, dtype=torch.int32) * active).amax(-1)
            if W else torch.zeros(G, B, H, dtype=torch.int32, device=q.device))
    if length is None:
        length = torch.full((B,), T, dtype=torch.int32, device=q.device)
    return size.to(torch.int32).contiguous(), length.to(torch.int32).contiguous()


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dict_k, dict_v, counts, base, size, length, chunk_size):
        B, T, H, dk = q.shape
        dv = v.shape[-1]
        G, W, R = counts.shape[0], max(counts.shape[3], 1), dict_k.shape[2]
        L = chunk_size
        cfg = _blocks("fwd")
        BDK, BDV = next_pow2(dk), next_pow2(dv)
        o = torch.empty(B, T, H, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        grid = (G * triton.cdiv(L, cfg["BM"]), B * H)
        _fwd_kernel[grid](q, k, v, dict_k, dict_v, counts, base, size, length, o, lse, B, T, H, W, R, L,
                          DQK=dk, DV=dv, BDK=BDK, BDV=BDV, **cfg)
        ctx.save_for_backward(q, k, v, dict_k, dict_v, counts, base, size, length, o, lse)
        ctx.chunk_size = L
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, dict_k, dict_v, counts, base, size, length, o, lse = ctx.saved_tensors
        B, T, H, dk = q.shape
        dv = v.shape[-1]
        G, W, R = counts.shape[0], max(counts.shape[3], 1), dict_k.shape[2]
        L = ctx.chunk_size
        BDK, BDV = next_pow2(dk), next_pow2(dv)
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1).contiguous()  # rowsum(dO ⊙ O)
        # every row of the chunk gradients is written (rows no query sees get zeros), in the inputs' dtypes;
        # the version rows are summed into in fp32
        dq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        gdk = torch.zeros(dict_k.shape, dtype=torch.float32, device=q.device)
        gdv = torch.zeros(dict_v.shape, dtype=torch.float32, device=q.device)
        args = (q, k, v, dict_k, dict_v, counts, base, size, length, do, lse, delta)
        cfg = _blocks("dq")
        _bwd_dq_kernel[(G * triton.cdiv(L, cfg["BM"]), B * H)](*args, dq, B, T, H, W, R, L, DQK=dk, DV=dv,
                                                                BDK=BDK, BDV=BDV, **cfg)
        cfg = _blocks("dkv_chunk")
        _bwd_dkv_kernel[(G * triton.cdiv(L, cfg["BN"]), B * H)](*args, gk, gv, B, T, H, W, R, L, DICT=False,
                                                                 DQK=dk, DV=dv, BDK=BDK, BDV=BDV, **cfg)
        if counts.shape[3]:
            cfg = _blocks("dkv_dict")
            _bwd_dkv_kernel[(G * triton.cdiv(W, cfg["BN"]), B * H)](*args, gdk, gdv, B, T, H, W, R, L, DICT=True,
                                                                     DQK=dk, DV=dv, BDK=BDK, BDV=BDV, **cfg)
        return dq, gk, gv, gdk.to(dict_k.dtype), gdv.to(dict_v.dtype), None, None, None, None, None


def ovq_chunk_attention(q, k, v, dict_k, dict_v, counts, base, chunk_size: int, length=None):
    """Every chunk's attention over [its dictionary (bias log counts); its own keys (causal)].

    q, k ``[B, G·L, H, dk]``, v ``[B, G·L, H, dv]`` (G whole chunks of L = ``chunk_size`` rows; q carries
    the scale); the dictionaries as version tables dict_k ``[B, H, R, dk]``, dict_v ``[B, H, R, dv]`` (q's
    dtype), counts ``[G, B, H, W]`` (each slot's count before each chunk, 0 = empty; no gradient) and base
    ``[B, H, W]``: chunk g reads slot s at row ``base[b, h, s] + counts[g, b, h, s]`` of the tables (every
    such row of an active slot must be < R). length ``[B]`` or None: keys at positions >= length[b] are
    ignored. Returns o ``[B, G·L, H, dv]`` in q's dtype, with gradients to q, k, v, dict_k and dict_v."""
    B, T, H, dk = q.shape
    if T % chunk_size:
        raise ValueError(f"ovq_chunk_attention: the length {T} is not a whole number of chunks of {chunk_size}")
    G = T // chunk_size
    if dict_k.dim() != 4 or dict_k.shape[:2] != (B, H) or dict_k.shape[-1] != dk \
            or dict_v.dim() != 4 or dict_v.shape[:3] != dict_k.shape[:3]:
        raise ValueError(f"ovq_chunk_attention: dict_k must be [B, H, R, dk] = ({B}, {H}, R, {dk}) with dict_v "
                         f"[B, H, R, dv], got {tuple(dict_k.shape)} and {tuple(dict_v.shape)}")
    if counts.dim() != 4 or counts.shape[:3] != (G, B, H) or tuple(base.shape) != (B, H, counts.shape[3]):
        raise ValueError(f"ovq_chunk_attention: counts must be [G, B, H, W] = ({G}, {B}, {H}, W) and base "
                         f"[B, H, W], got {tuple(counts.shape)} and {tuple(base.shape)}")
    if dict_k.dtype != q.dtype or dict_v.dtype != q.dtype:
        raise ValueError("ovq_chunk_attention: the dictionaries must have q's dtype")
    size, length = _prepare(q, counts, length)
    return _ChunkAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), dict_k.contiguous(),
                                 dict_v.contiguous(), counts.contiguous(), base.to(torch.int64).contiguous(), size,
                                 length, chunk_size)
