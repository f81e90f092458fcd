"""Triton kernels for the features of ELA's polynomial kernels (``lazoo.ops.ela``), forward and backward.

A polynomial kernel's features split as φ(q) = [q', a], ψ(k) = [k', c]: D scaled inputs (in the inputs' dtype) and
E = 2 or 1 scalars a token (fp32), which ``lazoo.kernels.normalized`` takes as they are:

    sum / sub_sq_euclid (SIGN = ±2):  q' = q,           k' = SIGN k,       a = [‖q‖², 1],  c = [1, ‖k‖²]
    magnitude_direction:              q' = (‖q‖²+1) q,  k' = (‖k‖²+1) k,   a = [‖q‖²+1],   c = [‖k‖²+1]

c is zero at pads. One pass over q and k forms them, without gradient: dq and dk are formed inside
``lazoo.kernels.normalized``'s backward (its ``poly_of``), where dq', dk', da and dc are at hand (a pass of their
own, reading q, k and the four gradients, added 0.2 ms to ELA's fwd + bwd at T = 1k..32k on an H100):

    sum / sub:  dq = dq' + 2 q da₀,                         dk = SIGN dk' + 2 k dc₁
    magnitude:  dq = (‖q‖²+1) dq' + 2 q (q·dq' + da₀),      dk likewise

Layout: q, k ``[B, T, H, D]`` contiguous (rows of D), mask ``[B, T]`` or None; a, c ``[B, T, H, E]`` float32. The
norms are summed in fp32 from the inputs; q' and k' are rounded once, to the inputs' dtype.

hadamard_exp (``exp_features``), with one shift c per sequence, head and feature: φ̃(q) = exp(q + c - M) with
M = max_d (q + c), ψ̃(k) = exp(k - c), and the clamp eps·exp(-M) per token and head, in one pass. They carry no
gradient: dq = dφ̃ φ̃ and dk = dψ̃ ψ̃ (the shifts carry none) are formed inside ``lazoo.kernels.normalized``'s backward
(its ``exp_of``), where dφ̃ and dψ̃ are still in registers beside φ̃ and ψ̃.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

#: kernel name -> (magnitude_direction's scaling, sign of k'); the scalar feature count is 1 with the scaling, else 2
KERNELS = {"sum_sq_euclid": (False, 2.0), "sub_sq_euclid": (False, -2.0), "magnitude_direction": (True, 1.0)}
#: rows (token·heads) a program
ROWS = 16


@triton.jit
def _rows(ptr, o_r, o_d, m, D: tl.constexpr):
    return tl.load(ptr + o_r[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _block(q, k, rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """A program's rows: their indices (int64) and mask, the [BR, BD] element mask and offsets, and q, k in fp32."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < rows
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d[None, :] < D)
    return o_r, m_r, m, o_r[:, None] * D + o_d[None, :], _rows(q, o_r, o_d, m, D), _rows(k, o_r, o_d, m, D)


@triton.jit
def _features_fwd_kernel(q, k, mask, q1, k1, a, c, rows, H, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                         MAG: tl.constexpr, SIGN: tl.constexpr, HAS_MASK: tl.constexpr):
    """Grid (cdiv(rows, BR)): q' (magnitude only), k', a and c of BR rows."""
    o_r, m_r, m, p, b_q, b_k = _block(q, k, rows, D, BD, BR)
    qq = tl.sum(b_q * b_q, 1)
    kk = tl.sum(b_k * b_k, 1)
    real = tl.full([BR], 1.0, tl.float32)
    if HAS_MASK:  # row (b, t, h) of [B, T, H] is token b·T + t of the mask
        real = tl.load(mask + o_r // H, mask=m_r, other=0).to(tl.float32)
    if MAG:
        tl.store(q1 + p, ((qq + 1.0)[:, None] * b_q).to(q1.dtype.element_ty), mask=m)
        tl.store(k1 + p, ((kk + 1.0)[:, None] * b_k).to(k1.dtype.element_ty), mask=m)
        tl.store(a + o_r, qq + 1.0, mask=m_r)
        tl.store(c + o_r, (kk + 1.0) * real, mask=m_r)
    else:
        tl.store(k1 + p, (SIGN * b_k).to(k1.dtype.element_ty), mask=m)
        tl.store(a + 2 * o_r, qq, mask=m_r)
        tl.store(a + 2 * o_r + 1, tl.full([BR], 1.0, tl.float32), mask=m_r)
        tl.store(c + 2 * o_r, real, mask=m_r)
        tl.store(c + 2 * o_r + 1, kk * real, mask=m_r)


def poly_features(q: torch.Tensor, k: torch.Tensor, kernel: str, mask: torch.Tensor | None = None):
    """``(q', k', a, c)`` of ``kernel`` (module docstring) for q, k ``[B, T, H, D]`` (zero at pads) and mask ``[B, T]``
    or None, without gradient; q' is q itself for the sum / sub kernels."""
    if kernel not in KERNELS:
        raise ValueError(f"poly_features: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    q, k = q.detach().contiguous(), k.detach().contiguous()
    if mask is not None:
        mask = mask.to(torch.int8).contiguous()
    mag, sign = KERNELS[kernel]
    B, T, H, D = q.shape
    rows = B * T * H
    E = 1 if mag else 2
    k1 = torch.empty_like(k)
    q1 = torch.empty_like(q) if mag else q
    a = torch.empty(B, T, H, E, dtype=torch.float32, device=q.device)
    c = torch.empty_like(a)
    _features_fwd_kernel[(triton.cdiv(rows, ROWS),)](
        q, k, mask, q1, k1, a, c, rows, H, D=D, BD=next_pow2(D), BR=ROWS, MAG=mag, SIGN=sign,
        HAS_MASK=mask is not None, num_warps=4)
    return q1, k1, a, c


# ============================================================================ hadamard_exp, one shift a sequence
@triton.jit
def _exp_features_fwd_kernel(q, k, shift, seq, mask, fq, fk, eps_rows, log_eps, rows, T, H,
                             D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, HAS_SEQ: tl.constexpr,
                             HAS_MASK: tl.constexpr):
    """Grid (cdiv(rows, BR)): φ̃(q) = exp(q + c - M), ψ̃(k) = exp(k - c) (0 at pads) and eps·exp(-M) of BR rows, c the
    row's sequence's shift ``[N, H, D]`` and M = max_d (q + c)."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # row = (b·T + t)·H + h
    m_r = o_r < rows
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d[None, :] < D)
    tok = o_r // H
    if HAS_SEQ:  # packed sequences (B = 1): the token's sequence
        n = tl.load(seq + tok, mask=m_r, other=0).to(tl.int64)
    else:
        n = tok // T
    p_c = (n * H + o_r % H)[:, None] * D + o_d[None, :]
    b_c = tl.load(shift + p_c, mask=m, other=0.0)
    p = o_r[:, None] * D + o_d[None, :]
    b_qc = tl.load(q + p, mask=m, other=0.0).to(tl.float32) + b_c
    b_M = tl.max(tl.where(m, b_qc, float("-inf")), 1)
    b_M = tl.where(m_r, b_M, 0.0)
    tl.store(fq + p, tl.exp(b_qc - b_M[:, None]).to(fq.dtype.element_ty), mask=m)
    b_fk = tl.exp(tl.load(k + p, mask=m, other=0.0).to(tl.float32) - b_c)
    if HAS_MASK:
        b_fk = b_fk * tl.load(mask + tok, mask=m_r, other=0).to(tl.float32)[:, None]
    tl.store(fk + p, b_fk.to(fk.dtype.element_ty), mask=m)
    tl.store(eps_rows + o_r, tl.exp(log_eps - b_M), mask=m_r)


def exp_features(q: torch.Tensor, k: torch.Tensor, shift: torch.Tensor, eps: float,
                 mask: torch.Tensor | None = None, seq: torch.Tensor | None = None):
    """hadamard_exp's features with one shift per sequence (``lazoo.ops.ela._causal_exp_fused``): for q, k
    ``[B, T, H, D]`` and ``shift`` c ``[N, H, D]`` float32 (N = B, or with packed sequences (B = 1) ``seq`` ``[T]``
    holds each token's sequence, ``ops.packing.packed_sequence_ids``),
    ``(exp(q + c - M), exp(k - c), eps·exp(-M))`` with M = max_d (q + c) per token and head: the features in q's
    dtype (ψ̃ zero at pads), the clamp per row ``[B, T, H]`` float32. No gradient: pass q and k as
    ``chunk_normalized_linear_attention``'s ``exp_of``, which gives them theirs."""
    q, k, shift = q.detach().contiguous(), k.detach().contiguous(), shift.detach().float().contiguous()
    if mask is not None:
        mask = mask.to(torch.int8).contiguous()
    B, T, H, D = q.shape
    rows = B * T * H
    fq, fk = torch.empty_like(q), torch.empty_like(k)
    eps_rows = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    _exp_features_fwd_kernel[(triton.cdiv(rows, ROWS),)](
        q, k, shift, seq, mask, fq, fk, eps_rows, math.log(eps), rows, T, H, D=D, BD=next_pow2(D), BR=ROWS,
        HAS_SEQ=seq is not None, HAS_MASK=mask is not None, num_warps=4)
    return fq, fk, eps_rows
