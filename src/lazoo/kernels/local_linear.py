"""Flash-style Triton kernels for local-linear (p = 1) attention (lazoo.ops.local_linear_attention).

Per head and query t, over the visible keys i (causal, optional window W, real keys only), with slope
features f_i = P k_i and g_t = P q_t (r of them; P = I for the exact slope), logits s_i = σ_h q_t·k_i (σ_h
the head's scale, ``scale_h``, applied to the fp32 products in the kernels) and weights p_i = softmax_i(s_i):

    m = Σ p f,  S = Σ p f fᵀ,  A = S − m mᵀ + ρI (r×r),  b = m − g,  β = A⁻¹ b
    o_t = v̄ − C_vf β = Σ_i p_i c_i v_i,   c_i = 1 − (f_i − m)·β = a − f_i·β,  a = 1 + m·β

(C_vf β = Σ p (v − v̄)(f − m)·β = Σ p v (f − m)·β since Σ p (f − m) = 0.) So the forward is two passes
over the key blocks of a query block, each its own kernel (the second then runs with far fewer registers, so
more programs share a multiprocessor): ``_fwd_stats`` keeps the online-softmax running max and sum and the
running moments Σ e f (r) and Σ e f fᵀ (r², as one ``tl.dot`` of the weights with the keys' flattened outer
products f fᵀ, formed once outside the kernels), then an r-step Gauss–Jordan solve per query (A is SPD: no
pivoting), vectorised over the block; ``_fwd_out`` is attention with the weights p_i c_i. Saved for the
backward: the log-sum-exp, m and β per query (2r + 1 numbers), and A itself when it is small (RM = 8
below: 64 numbers a query).

Backward, with δ_i = do·v_i, D = Σ p δ = do·v̄ and E = Σ p δ f:

    dβ = D m − E,   λ = A⁻¹ dβ (A symmetric),   dg = −λ
    dm = D β + λ + λ (β·m) + β (λ·m)                    (through c, b and −m mᵀ)
    dp_i = c_i δ_i + f_i·dm − (f_i·λ)(f_i·β)           (through o, m and S)
    ds_i = p_i (dp_i − Δ),  Δ = Σ p dp = a D − E·β + m·dm − λᵀ S β
    dv_i = Σ_t p c do,  dq = σ Σ_i ds k + dg P,  dk_i = σ Σ_t ds q + df_i P,  dσ = Σ_t q·(Σ_i ds k),
    df_i = Σ_t p (dm − (δ + f·λ) β − (f·β) λ),  dP = Σ_i df_iᵀ k_i + Σ_t dg_tᵀ q_t

With f·β = a − c these regroup per pair as ds = p (c u + f·ψ), u = δ + f·λ, and df = Σ_t p (ψ + u γ + c λ), where
c = f·γ and f·ψ come from the per-query γ = −β and ψ = dm − a λ (``_coefficients``): three r-wide products
and three multiplies a pair instead of eight operations. When r < R a feature column is spare (R − 1, zero in
the stored features); the kernels hold it at 1 in registers, so that column of γ carries a, that of ψ carries
−Δ, and the forward's Σ p f and the prep's E sum Σ p and D there, at no extra product (r = 8, 4k: key-block
kernel 3.38 → 2.76 ms). The backward runs in three passes: ``_bwd_prep`` (per query block: D and E, then λ,
dm, Δ; with A saved, the solve is a small kernel of its own, ``_bwd_solve``, and the prep holds few registers;
otherwise the prep recomputes S and solves at its end; either stores λ, γ, ψ, a and Δ), ``_bwd_dkv`` (per key
block over its query blocks: dk, dv, with df P and the block's share of dP from the df it holds) and
``_bwd_dq`` (per query block over its keys: dq with −λ P, and the shares of dσ and dP). The keys' features P k
are formed once per call (``lazoo.kernels.slope_features``, forward only) and P q inside the statistics
kernel; the features' gradients never leave the kernels (no df or dg tensors, no separate products with P
and no sums of gradients afterwards; the kernels around the attention's took 0.49 ms of a step at r = 8, 4k
before, 0.10 after, in a profile).
The query-block kernels mask only the key blocks that hold a hidden pair (``_needs_mask``: the causal
diagonal, window edges, key masks); the key-block kernel masks every block (skipping made it slower) but only
by what can hide a pair there (``_seen_t``).

Layouts: q/k ``[B, T|S, H, dk]``, v ``[B, S, H, dv]``, features ``[B, T|S, H, R]`` float32 padded with
zeros to R ∈ {16, 32} (a zero feature adds ρ on A's diagonal and 0 to b: exact). The moments and the solve
take RM of them: 8 for up to 8 slope features (64 moments a query instead of 256: at r = 8 the step at 4k
took 11.7 ms instead of 15.2), else R; the keys' outer products are ``[B, S, H, RM²]`` in the moments'
operand dtype. Keys may run ahead of the queries (a KV cache): query t sits at position t + S − T. The
logits and the value products take the input dtype on the tensor cores; with 16-bit inputs so do the r²
moments (weights and outer products rounded to it, fp32 sums: measured as accurate against float64 as tf32
operands, 1.2× faster for the whole step) and the key-block kernel's df products (like its dk and dv
products); the solve stays in fp32, and so do the r-wide products that form m, E and c.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import device_unsupported, next_pow2
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES
from .limits import LOCAL_LINEAR_MAX_HEAD_DIM as MAX_HEAD_DIM
from .limits import LOCAL_LINEAR_MAX_RANK as MAX_RANK
from .slope_features import head_stride, project

_LOG2E = tl.constexpr(1.4426950408889634)


class Launch(NamedTuple):
    """One kernel's launch: query-block rows BM, key-block rows BN, warps, software-pipeline stages."""
    BM: int
    BN: int
    warps: int
    stages: int


#: launches on a GPU for up to 16 slope features, from a sweep per kernel (H100, bf16, T = 4k, B·T = 32k,
#: H = 16, dk = 64, r = 16: fwd+bwd 27.1 → 19.2 ms, mostly the key-block kernel: 32-row query blocks against
#: 64-row key blocks need no register spills there, 64 × 32 spilled ~330 B). Warps: 4 for the kernels that
#: accumulate the r² moments ("stats", "prep_moments") and for the key-block and dq kernels. When the forward
#: was one kernel and every prep formed the moments, 8 warps (with 64-row query blocks) made Triton 3.6 on an
#: H100 produce wrong outputs (tf32 moments) or an illegal memory access (tf32x3); with the bf16 moments 8 warps
#: were correct but slower (forward 4.9 → 8.3 ms; prep, dq and key blocks +0.4 to +4 ms fwd+bwd). The outputs
#: kernel and the prep without moments hold no moment accumulators: 8 warps won their sweep after the forward's
#: split. The [BM, R²] moment accumulators of the query-block kernels must fit in registers. "prep" is the prep
#: without moments (A saved by the forward), "prep_moments" the one with. The statistics, outputs, prep,
#: key-block and dq launches from a sweep after the forward's split (r = 8: fwd+bwd 9.72 → 9.50 ms,
#: ``scripts/tune_local_linear.py --rank 8``); the statistics' 64 × 64 only for 8 features (at 16, fp32 inputs
#: need 266 KB of shared memory there). The key-block, dq and statistics launches again after the backward's
#: regrouping (``_coefficients``): r = 8 8.00 → 7.80 ms, r = 16 dq only (the rest within noise).
LAUNCH = {"stats": Launch(64, 32, 4, 3), "out": Launch(128, 64, 8, 3), "prep": Launch(128, 32, 8, 2),
          "prep_moments": Launch(64, 32, 4, 2), "dkv": Launch(32, 64, 4, 2), "dq": Launch(64, 64, 4, 3)}
#: what changes when the moments take 8 features (RM = 8)
LAUNCH_RM8 = {"stats": Launch(64, 64, 4, 2), "dkv": Launch(32, 64, 4, 3), "dq": Launch(64, 128, 4, 2)}
#: queries per program of the backward's solve kernel (``_bwd_solve``)
SOLVE_ROWS = 32
#: under TRITON_INTERPRET=1: blocks smaller than the test sequences (each kernel may take its own)
INTERPRET_LAUNCH = {name: Launch(16, 16, 4, 1) for name in LAUNCH}


# ============================================================================ device helpers
@triton.jit
def _eliminate(A, b, j, R: tl.constexpr):
    """One Gauss–Jordan step on column j of every row's system (A ``[BM, R, R]``, b ``[BM, R]``)."""
    o_r = tl.arange(0, R)
    col = tl.sum(tl.where(o_r[None, None, :] == j, A, 0.0), 2)  # A[:, :, j]
    row = tl.sum(tl.where(o_r[None, :, None] == j, A, 0.0), 1)  # A[:, j, :]
    sel = o_r[None, :] == j
    piv = tl.sum(tl.where(sel, col, 0.0), 1)
    bj = tl.sum(tl.where(sel, b, 0.0), 1)
    fac = tl.where(sel, 0.0, col / piv[:, None])
    return A - fac[:, :, None] * row[:, None, :], b - fac * bj[:, None]


@triton.jit
def _solve(A, b, BM: tl.constexpr, R: tl.constexpr, UNROLL: tl.constexpr):
    """x = A⁻¹ b for every row of a block: A ``[BM, R, R]`` SPD, b ``[BM, R]`` (Gauss–Jordan, no pivoting).
    Unrolled, j is a constant and the selections of the rows held in registers cost nothing (half the
    instructions), but the live ranges grow: unrolled where the registers allow (the backward prep)."""
    if UNROLL:
        for j in tl.static_range(R):
            A, b = _eliminate(A, b, j, R)
    else:
        for j in range(R):
            A, b = _eliminate(A, b, j, R)
    o_r = tl.arange(0, R)
    diag = tl.sum(tl.where(o_r[None, :, None] == o_r[None, None, :], A, 0.0), 2)
    return b / diag


@triton.jit
def _narrow(x, BM: tl.constexpr, R: tl.constexpr, RM: tl.constexpr):
    """The first RM of the R columns of x ``[BM, R]`` (RM = R, or R = 2 RM)."""
    if RM == R:
        return x
    else:
        lo, _ = tl.split(tl.permute(tl.reshape(x, [BM, 2, RM]), (0, 2, 1)))
        return lo


@triton.jit
def _widen(x, BM: tl.constexpr, R: tl.constexpr, RM: tl.constexpr):
    """x ``[BM, RM]`` padded with zero columns to ``[BM, R]`` (RM = R, or R = 2 RM)."""
    if RM == R:
        return x
    else:
        return tl.reshape(tl.permute(tl.join(x, tl.zeros_like(x)), (0, 2, 1)), [BM, R])


@triton.jit
def _rows(x, row, live, D: tl.constexpr, BD: tl.constexpr):
    """``[len(row), BD]``: rows ``row`` of x ``[.., D]``, zero past D and in the rows that are not live."""
    o_d = tl.arange(0, BD)
    return tl.load(x + row[:, None] * D + o_d[None, :], mask=live[:, None] & (o_d[None, :] < D), other=0.0)


@triton.jit
def _projection(P, i_h, NR, P_STRIDE, DK: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Head i_h's slope projection ``[R, BK]`` fp32 (NR rows of P, the rest zero; P_STRIDE 0 when the heads share
    it)."""
    o_r = tl.arange(0, R)
    o_d = tl.arange(0, BK)
    return tl.load(P + i_h * P_STRIDE + o_r[:, None] * DK + o_d[None, :],
                   mask=(o_r[:, None] < NR) & (o_d[None, :] < DK), other=0.0)


@triton.jit
def _with_one(x, col):
    """x with its feature column R − 1 (``col``: that column's mask, broadcast to x) set to 1: with a spare
    feature column (SPARE, r < R, a zero feature there otherwise) the r-wide products carry a per-query
    constant or Σ p through it at no extra product."""
    return tl.where(col, 1.0, x)


@triton.jit
def _coefficients(b_m, b_beta, b_lam, b_dm, b_delta, spare, SPARE: tl.constexpr):
    """Per query ``[BM, R]``: γ with f·γ = c = a − f·β and ψ with f·ψ = f·(dm − a λ) − Δ for the spare-column
    features (without SPARE the kernels add a and −Δ themselves), and a = 1 + m·β. The backward's weights are
    then c (dv) and c (δ + f·λ) + f·ψ (ds): ``c δ + f·dm − (f·λ)(f·β) − Δ`` regrouped with f·β = a − c."""
    b_a = 1.0 + tl.sum(b_m * b_beta, 1)
    gam = -b_beta
    psi = b_dm - b_a[:, None] * b_lam
    if SPARE:
        gam = tl.where(spare[None, :], b_a[:, None], gam)
        psi = tl.where(spare[None, :], -b_delta[:, None], psi)
    return gam, psi, b_a


@triton.jit
def _needs_mask(q_lo, k_lo, OFF, WINDOW, BM: tl.constexpr, BN: tl.constexpr, USE_WINDOW: tl.constexpr,
                USE_KMASK: tl.constexpr):
    """Whether some (query, key) pair of the query block from q_lo and the key block from k_lo is hidden (causal
    order, the window, a key mask); blocks with every pair visible skip the mask. Keys past S are past every
    query too; query rows past T need none (never stored; their statistics load as an infinite log-sum-exp)."""
    need = k_lo + BN - 1 > q_lo + OFF
    if USE_WINDOW:
        need = need | (k_lo <= q_lo + BM - 1 + OFF - WINDOW)
    if USE_KMASK:
        need = need | (k_lo >= 0)
    return need


@triton.jit
def _visible(o_m, o_n, T, S, OFF, WINDOW, kmask_row, USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr):
    """``[BM, BN]``: query o_m (position o_m + OFF) sees key o_n."""
    pos = o_m + OFF
    vis = (o_n[None, :] <= pos[:, None]) & (o_n[None, :] < S) & (o_m[:, None] < T)
    if USE_WINDOW:
        vis = vis & (o_n[None, :] > pos[:, None] - WINDOW)
    if USE_KMASK:
        km = tl.load(kmask_row + o_n, mask=o_n < S, other=0)
        vis = vis & (km[None, :] != 0)
    return vis


@triton.jit
def _seen_t(o_n, o_m, OFF, WINDOW, km, USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr):
    """``[BN, BM]``: key o_n visible to query o_m, for the key-block kernel, where keys past S are never stored
    and queries past T carry an infinite log-sum-exp (zero weights): only the causal order, the window and the
    key mask (km, the block's keys) hide a pair (a third of the selections of the full test)."""
    pos = o_m + OFF
    vis = o_n[:, None] <= pos[None, :]
    if USE_WINDOW:
        vis = vis & (o_n[:, None] > pos[None, :] - WINDOW)
    if USE_KMASK:
        vis = vis & (km[:, None] != 0)
    return vis


@triton.jit
def _key_range(i_m, T, S, OFF, WINDOW, BM: tl.constexpr, BN: tl.constexpr, USE_WINDOW: tl.constexpr):
    """[lo, hi): the key blocks a query block can see (lo a multiple of BN)."""
    first = i_m * BM + OFF
    last = tl.minimum(i_m * BM + BM, T) - 1 + OFF
    hi = tl.minimum(last + 1, S)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first - WINDOW + 1, 0)
        lo = (lo // BN) * BN
    return lo, hi


@triton.jit
def _query_block(kmask, scale_h, T, S, OFF, WINDOW, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 USE_WINDOW: tl.constexpr):
    """The query block of a program on grid (cdiv(T, BM), B * H): its positions o_m and which are real (m_m),
    their rows in ``[B, T, H, *]`` (q_row) and in the ``[B, H, T, *]`` statistics (stat), the sample's first
    key row (k_base) and key-mask row, [lo, hi) of the keys it can see, and the head's logit scale σ log2 e."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BM + tl.arange(0, BM)
    q_row = (i_b.to(tl.int64) * T + o_m) * H + i_h
    k_base = i_b.to(tl.int64) * S * H + i_h
    stat = i_bh.to(tl.int64) * T + o_m
    lo, hi = _key_range(i_m, T, S, OFF, WINDOW, BM, BN, USE_WINDOW)
    qk_scale = tl.load(scale_h + i_h) * _LOG2E
    return o_m, o_m < T, q_row, k_base, kmask + i_b.to(tl.int64) * S, stat, lo, hi, qk_scale


@triton.jit
def _key_block_logits(b_q, qk_scale, k, k_base, start, o_m, kmask_row, T, S, OFF, WINDOW, H: tl.constexpr,
                      DK: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, USE_WINDOW: tl.constexpr,
                      USE_KMASK: tl.constexpr, PREC: tl.constexpr):
    """For a query-block program, the key block from start: its positions o_n, which are real (m_n), their rows
    (k_row), the keys transposed ``[BK, BN]`` and the logits σ q·k in log2 units ``[BM, BN]`` (qk_scale = σ log2 e),
    hidden pairs at −inf."""
    o_n = start + tl.arange(0, BN)
    m_n = o_n < S
    k_row = k_base + o_n * H
    o_dk = tl.arange(0, BK)
    b_kt = tl.load(k + k_row[None, :] * DK + o_dk[:, None], mask=m_n[None, :] & (o_dk[:, None] < DK), other=0.0)
    s = tl.dot(b_q, b_kt, input_precision=PREC) * qk_scale
    if _needs_mask(tl.program_id(0) * BM, start, OFF, WINDOW, BM, BN, USE_WINDOW, USE_KMASK):
        s = tl.where(_visible(o_m, o_n, T, S, OFF, WINDOW, kmask_row, USE_WINDOW, USE_KMASK), s, float("-inf"))
    return o_n, m_n, k_row, b_kt, s


@triton.jit
def _moments(p, ff, k_row, m_n, R: tl.constexpr, MPREC: tl.constexpr):
    """Σ_i p_i f_i f_iᵀ flattened ``[BM, R*R]`` for weights p ``[BM, BN]``, from the keys' outer products
    ``ff [.., R*R]`` (rows k_row): 16-bit outer products take p in their dtype, fp32 ones MPREC."""
    o_rr = tl.arange(0, R * R)
    outer = tl.load(ff + k_row[:, None] * (R * R) + o_rr[None, :], mask=m_n[:, None], other=0.0)
    if outer.dtype == tl.float32:
        return tl.dot(p, outer, input_precision=MPREC)
    return tl.dot(p.to(outer.dtype), outer)


@triton.jit
def _outer_products_kernel(f, out, N, R: tl.constexpr, RM: tl.constexpr, BLOCK: tl.constexpr):
    """out ``[N, RM²]`` = f fᵀ of the first RM features of each row of f ``[N, R]``, flattened (fp32 products
    rounded once to out's dtype)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_r = tl.arange(0, RM)
    o_rr = tl.arange(0, RM * RM)
    m_n = rows[:, None] < N
    b_f = tl.load(f + rows[:, None] * R + o_r[None, :], mask=m_n, other=0.0)
    ff = tl.reshape(b_f[:, :, None] * b_f[:, None, :], [BLOCK, RM * RM])
    tl.store(out + rows[:, None] * (RM * RM) + o_rr[None, :], ff.to(out.dtype.element_ty), mask=m_n)


# ============================================================================ forward
@triton.jit
def _fwd_stats_kernel(
    q, k, fk, ffk, P, NR, P_STRIDE, kmask, scale_h, lse, mbuf, bbuf, abuf, ridge, T, S, OFF, WINDOW,
    H: tl.constexpr, DK: tl.constexpr, R: tl.constexpr, RM: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr, PREC: tl.constexpr,
    MPREC: tl.constexpr, SAVE_A: tl.constexpr, SPARE: tl.constexpr,
):
    """Grid (cdiv(T, BM), B * H): log-sum-exp, m and β of one query block (and A when SAVE_A)."""
    ridge = tl.cast(ridge, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    o_m, m_m, q_row, k_base, kmask_row, stat, lo, hi, qk_scale = _query_block(kmask, scale_h, T, S, OFF, WINDOW,
                                                                               H, BM, BN, USE_WINDOW)
    o_r = tl.arange(0, R)

    b_q = _rows(q, q_row, m_m, DK, BK)
    # g = P q (tf32x3: about fp32, like the keys' features), before the loop: the fp32 copies of q it takes
    # after it raised the kernel's registers from 168 to 218 (sm_90, r = 8)
    b_p = _projection(P, tl.program_id(1) % H, NR, P_STRIDE, DK, R, BK)
    b_g = _narrow(tl.dot(b_q.to(tl.float32), tl.trans(b_p), input_precision="tf32x3"), BM, R, RM)

    # running max (log2 units), running sum, Σ e f and Σ e f fᵀ (the sum in Σ e f's spare column if SPARE)
    spare = o_r == R - 1
    b_mx = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_f1 = tl.zeros([BM, R], tl.float32)
    b_f2 = tl.zeros([BM, RM * RM], tl.float32)
    for start in range(lo, hi, BN):
        o_n, m_n, k_row, _, s = _key_block_logits(b_q, qk_scale, k, k_base, start, o_m, kmask_row, T, S, OFF, WINDOW,
                                                  H, DK, BK, BM, BN, USE_WINDOW, USE_KMASK, PREC)
        new_mx = tl.maximum(b_mx, tl.max(s, 1))
        ref = tl.where(new_mx == float("-inf"), 0.0, new_mx)  # a row that sees nothing yet stays at 0
        alpha = tl.exp2(b_mx - ref)
        p = tl.exp2(s - ref[:, None])
        b_f = tl.load(fk + k_row[:, None] * R + o_r[None, :], mask=m_n[:, None], other=0.0)
        if SPARE:
            b_f = _with_one(b_f, spare[None, :])
        else:
            b_l = b_l * alpha + tl.sum(p, 1)
        b_f1 = b_f1 * alpha[:, None] + tl.dot(p, b_f, input_precision=MPREC)
        b_f2 = b_f2 * alpha[:, None] + _moments(p, ffk, k_row, m_n, RM, MPREC)
        b_mx = new_mx

    if SPARE:
        b_l = tl.sum(tl.where(spare[None, :], b_f1, 0.0), 1)
        b_f1 = tl.where(spare[None, :], 0.0, b_f1)
    seen = b_l > 0
    l_safe = tl.where(seen, b_l, 1.0)
    b_lse = tl.where(seen, b_mx + tl.log2(l_safe), float("inf"))  # log2 units; p = exp2(s − lse)
    b_m = b_f1 / l_safe[:, None]
    # the solve over the RM features that carry moments (the rest pad the r-wide products to 16 columns)
    o_rm = tl.arange(0, RM)
    b_mm = _narrow(b_m, BM, R, RM)
    eye = (o_rm[None, :, None] == o_rm[None, None, :]).to(tl.float32)
    A = tl.reshape(b_f2 / l_safe[:, None], [BM, RM, RM]) - b_mm[:, :, None] * b_mm[:, None, :] + ridge * eye
    if SAVE_A:
        o_rr = tl.arange(0, RM * RM)
        tl.store(abuf + stat[:, None] * (RM * RM) + o_rr[None, :], tl.reshape(A, [BM, RM * RM]), mask=m_m[:, None])
    # a loop: unrolled, it spilled ~0.9 KB at RM = 16; at RM = 8 unrolling saved nothing (2.74 vs 2.72 ms)
    b_beta = _widen(_solve(A, b_mm - b_g, BM, RM, False), BM, R, RM)
    tl.store(lse + stat, b_lse, mask=m_m)
    tl.store(mbuf + stat[:, None] * R + o_r[None, :], b_m, mask=m_m[:, None])
    tl.store(bbuf + stat[:, None] * R + o_r[None, :], b_beta, mask=m_m[:, None])


@triton.jit
def _fwd_out_kernel(
    q, k, v, fk, kmask, scale_h, o, lse, mbuf, bbuf, T, S, OFF, WINDOW,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr, PREC: tl.constexpr,
    MPREC: tl.constexpr,
):
    """Grid (cdiv(T, BM), B * H): o = Σ p_i (a − f_i·β) v_i of one query block, from its statistics."""
    o_m, m_m, q_row, k_base, kmask_row, stat, lo, hi, qk_scale = _query_block(kmask, scale_h, T, S, OFF, WINDOW,
                                                                               H, BM, BN, USE_WINDOW)
    o_dv = tl.arange(0, BV)
    o_r = tl.arange(0, R)
    b_q = _rows(q, q_row, m_m, DK, BK)
    b_lse = tl.load(lse + stat, mask=m_m, other=float("inf"))
    b_beta = _rows(bbuf, stat, m_m, R, R)
    b_m = _rows(mbuf, stat, m_m, R, R)
    b_a = 1.0 + tl.sum(b_m * b_beta, 1)
    acc = tl.zeros([BM, BV], tl.float32)
    for start in range(lo, hi, BN):
        o_n, m_n, k_row, _, s = _key_block_logits(b_q, qk_scale, k, k_base, start, o_m, kmask_row, T, S, OFF, WINDOW,
                                                  H, DK, BK, BM, BN, USE_WINDOW, USE_KMASK, PREC)
        p = tl.exp2(s - b_lse[:, None])
        b_ft = tl.load(fk + k_row[None, :] * R + o_r[:, None], mask=m_n[None, :], other=0.0)
        w = p * (b_a[:, None] - tl.dot(b_beta, b_ft, input_precision=MPREC))
        b_v = tl.load(v + k_row[:, None] * DV + o_dv[None, :], mask=m_n[:, None] & (o_dv[None, :] < DV), other=0.0)
        acc += tl.dot(w.to(b_v.dtype), b_v, input_precision=PREC)
    tl.store(o + q_row[:, None] * DV + o_dv[None, :], acc.to(o.dtype.element_ty),
             mask=m_m[:, None] & (o_dv[None, :] < DV))


# ============================================================================ backward
@triton.jit
def _backward_terms(A, b_m, b_beta, b_D, b_E, ridge, BM: tl.constexpr, RM: tl.constexpr, UNROLL: tl.constexpr):
    """λ = A⁻¹(D m − E), dm and Δ of every row (A ``[BM, RM, RM]`` with the ridge; m, β, E ``[BM, RM]``)."""
    bm = tl.sum(b_beta * b_m, 1)
    # S β = A β + m (m·β) − ρ β before the solve, so that A's copy is dead inside it (S β taken afterwards
    # kept S live through the solve loop, which spilled: 347 of its 1449 instructions, sm_90 / Triton 3.6)
    s_beta = tl.sum(A * b_beta[:, None, :], 2) + b_m * bm[:, None] - ridge * b_beta
    b_lam = _solve(A, b_D[:, None] * b_m - b_E, BM, RM, UNROLL)
    lm = tl.sum(b_lam * b_m, 1)
    b_dm = b_D[:, None] * b_beta + b_lam * (1.0 + bm)[:, None] + b_beta * lm[:, None]
    b_delta = ((1.0 + bm) * b_D - tl.sum(b_E * b_beta, 1) + tl.sum(b_m * b_dm, 1)
               - tl.sum(b_lam * s_beta, 1))
    return b_lam, b_dm, b_delta


@triton.jit
def _store_terms(b_m, b_beta, b_lam, b_dm, b_delta, rows, live, lbuf, gbuf, pbuf, abar, delta,
                 BM: tl.constexpr, R: tl.constexpr, RM: tl.constexpr, SPARE: tl.constexpr):
    """What the dk/dv and dq kernels take per query (rows ``rows`` of ``[B, H, T, *]``): λ, γ and ψ
    (``_coefficients``), a and Δ. The inputs are RM features wide."""
    o_r = tl.arange(0, R)
    b_lam = _widen(b_lam, BM, R, RM)
    gam, psi, b_a = _coefficients(_widen(b_m, BM, R, RM), _widen(b_beta, BM, R, RM), b_lam,
                                  _widen(b_dm, BM, R, RM), b_delta, o_r == R - 1, SPARE)
    p_r = rows[:, None] * R + o_r[None, :]
    tl.store(lbuf + p_r, b_lam, mask=live[:, None])
    tl.store(gbuf + p_r, gam, mask=live[:, None])
    tl.store(pbuf + p_r, psi, mask=live[:, None])
    tl.store(abar + rows, b_a, mask=live)
    tl.store(delta + rows, b_delta, mask=live)


@triton.jit
def _bwd_prep_kernel(
    q, k, v, fk, ffk, do, kmask, scale_h, lse, mbuf, bbuf, dbuf, ebuf, lbuf, gbuf, pbuf, abar, delta, ridge, T, S,
    OFF, WINDOW,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, RM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr, PREC: tl.constexpr, MPREC: tl.constexpr,
    MOMENTS: tl.constexpr, SPARE: tl.constexpr,
):
    """Grid (cdiv(T, BM), B * H): D = Σ p δ and E = Σ p δ f of one query block, stored for ``_bwd_solve``;
    with MOMENTS (A not saved), S too, and then λ, dm, Δ and what ``_store_terms`` stores, here."""
    ridge = tl.cast(ridge, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    o_m, m_m, q_row, k_base, kmask_row, stat, lo, hi, qk_scale = _query_block(kmask, scale_h, T, S, OFF, WINDOW,
                                                                               H, BM, BN, USE_WINDOW)
    o_dv = tl.arange(0, BV)
    o_r = tl.arange(0, R)

    b_q = _rows(q, q_row, m_m, DK, BK)
    b_do = _rows(do, q_row, m_m, DV, BV)
    b_lse = tl.load(lse + stat, mask=m_m, other=float("inf"))

    spare = o_r == R - 1  # with SPARE, E's spare column sums D
    b_D = tl.zeros([BM], tl.float32)
    b_E = tl.zeros([BM, R], tl.float32)
    if MOMENTS:
        b_S = tl.zeros([BM, RM * RM], tl.float32)
    for start in range(lo, hi, BN):
        o_n, m_n, k_row, _, s = _key_block_logits(b_q, qk_scale, k, k_base, start, o_m, kmask_row, T, S, OFF, WINDOW,
                                                  H, DK, BK, BM, BN, USE_WINDOW, USE_KMASK, PREC)
        p = tl.exp2(s - b_lse[:, None])
        b_vt = tl.load(v + k_row[None, :] * DV + o_dv[:, None], mask=m_n[None, :] & (o_dv[:, None] < DV), other=0.0)
        pd = p * tl.dot(b_do, b_vt, input_precision=PREC)  # p_i δ_i
        b_f = tl.load(fk + k_row[:, None] * R + o_r[None, :], mask=m_n[:, None], other=0.0)
        if SPARE:
            b_f = _with_one(b_f, spare[None, :])
        else:
            b_D += tl.sum(pd, 1)
        b_E += tl.dot(pd, b_f, input_precision=MPREC)
        if MOMENTS:
            b_S += _moments(p, ffk, k_row, m_n, RM, MPREC)
    if SPARE:
        b_D = tl.sum(tl.where(spare[None, :], b_E, 0.0), 1)
        b_E = tl.where(spare[None, :], 0.0, b_E)

    if MOMENTS:
        o_rm = tl.arange(0, RM)  # the features that carry moments
        b_m = tl.load(mbuf + stat[:, None] * R + o_rm[None, :], mask=m_m[:, None], other=0.0)
        b_beta = tl.load(bbuf + stat[:, None] * R + o_rm[None, :], mask=m_m[:, None], other=0.0)
        eye = (o_rm[None, :, None] == o_rm[None, None, :]).to(tl.float32)
        A = tl.reshape(b_S, [BM, RM, RM]) - b_m[:, :, None] * b_m[:, None, :] + ridge * eye
        b_lam, b_dm, b_delta = _backward_terms(A, b_m, b_beta, b_D, _narrow(b_E, BM, R, RM), ridge, BM, RM, True)
        _store_terms(b_m, b_beta, b_lam, b_dm, b_delta, stat, m_m, lbuf, gbuf, pbuf, abar, delta, BM, R, RM, SPARE)
    else:
        tl.store(dbuf + stat, b_D, mask=m_m)
        tl.store(ebuf + stat[:, None] * R + o_r[None, :], b_E, mask=m_m[:, None])


@triton.jit
def _bwd_solve_kernel(abuf, mbuf, bbuf, dbuf, ebuf, lbuf, gbuf, pbuf, abar, delta, ridge, N, R: tl.constexpr,
                      RM: tl.constexpr, BQ: tl.constexpr, SPARE: tl.constexpr):
    """Grid (cdiv(N, BQ),) over the N = B·H·T queries' statistics ``[B, H, T, *]``: λ, dm and Δ from the saved
    A, m and β and the prep's D and E, then what ``_store_terms`` stores."""
    ridge = tl.cast(ridge, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    rows = tl.program_id(0).to(tl.int64) * BQ + tl.arange(0, BQ)
    live = rows < N
    o_rm = tl.arange(0, RM)
    o_rr = tl.arange(0, RM * RM)
    eye = (o_rm[None, :, None] == o_rm[None, None, :]).to(tl.float32)
    A = tl.load(abuf + rows[:, None] * (RM * RM) + o_rr[None, :], mask=live[:, None], other=0.0)
    A = tl.where(live[:, None, None], tl.reshape(A, [BQ, RM, RM]), eye)  # rows past N: solvable, not stored
    p_rm = rows[:, None] * R + o_rm[None, :]
    b_m = tl.load(mbuf + p_rm, mask=live[:, None], other=0.0)
    b_beta = tl.load(bbuf + p_rm, mask=live[:, None], other=0.0)
    b_E = tl.load(ebuf + p_rm, mask=live[:, None], other=0.0)
    b_D = tl.load(dbuf + rows, mask=live, other=0.0)
    b_lam, b_dm, b_delta = _backward_terms(A, b_m, b_beta, b_D, b_E, ridge, BQ, RM, True)
    _store_terms(b_m, b_beta, b_lam, b_dm, b_delta, rows, live, lbuf, gbuf, pbuf, abar, delta, BQ, R, RM, SPARE)


@triton.jit
def _bwd_dkv_kernel(
    q, k, v, fk, P, NR, P_STRIDE, do, kmask, scale_h, lse, gbuf, lbuf, pbuf, abar, delta, dk, dv, dp_part, T, S,
    OFF, WINDOW,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr, PREC: tl.constexpr, MPREC: tl.constexpr,
    SPARE: tl.constexpr, WANT_DP: tl.constexpr,
):
    """Grid (cdiv(S, BN), B * H): dk and dv of one key block, over the queries that see it, with the share of
    the features f = P k (df P in dk; Σ dfᵀ k, this program's share of dP, in ``dp_part [.., R, BK]``).

    Everything is computed in the transposed ``[BN, BM]`` layout, so no computed matrix is transposed; the
    query block's tiles are loaded once and transposed as loaded (loading both orders took 7 % longer)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < S
    o_dk = tl.arange(0, BK)
    o_dv = tl.arange(0, BV)
    o_r = tl.arange(0, R)
    k_row = (i_b.to(tl.int64) * S + o_n) * H + i_h
    q_base = i_b.to(tl.int64) * T * H + i_h
    kmask_row = kmask + i_b.to(tl.int64) * S
    stat_base = i_bh.to(tl.int64) * T
    b_scale = tl.load(scale_h + i_h)
    qk_scale = b_scale * _LOG2E

    b_k = tl.load(k + k_row[:, None] * DK + o_dk[None, :], mask=m_n[:, None] & (o_dk[None, :] < DK), other=0.0)
    b_v = tl.load(v + k_row[:, None] * DV + o_dv[None, :], mask=m_n[:, None] & (o_dv[None, :] < DV), other=0.0)
    b_f = tl.load(fk + k_row[:, None] * R + o_r[None, :], mask=m_n[:, None], other=0.0)
    spare = o_r == R - 1
    if SPARE:
        b_f = _with_one(b_f, spare[None, :])
    km = tl.load(kmask_row + o_n, mask=m_n, other=0) if USE_KMASK else 0

    # queries at positions >= the block's first key (and, with a window, < its last key + W)
    q_lo = tl.maximum(i_n * BN - OFF, 0)
    q_lo = (q_lo // BM) * BM
    q_hi = T
    if USE_WINDOW:
        q_hi = tl.minimum(T, i_n * BN + BN - 1 + WINDOW - OFF)
    acc_k = tl.zeros([BN, BK], tl.float32)
    acc_v = tl.zeros([BN, BV], tl.float32)
    acc_f = tl.zeros([BN, R], tl.float32)
    for start in range(q_lo, q_hi, BM):
        o_m = start + tl.arange(0, BM)
        m_m = o_m < T
        q_row = q_base + o_m * H
        stat = stat_base + o_m
        b_q = _rows(q, q_row, m_m, DK, BK)
        b_qt = tl.trans(b_q)
        b_do = _rows(do, q_row, m_m, DV, BV)
        b_dot = tl.trans(b_do)
        b_lse = tl.load(lse + stat, mask=m_m, other=float("inf"))
        b_gam = _rows(gbuf, stat, m_m, R, R)
        b_lam = _rows(lbuf, stat, m_m, R, R)
        b_psi = _rows(pbuf, stat, m_m, R, R)

        # the mask on the exponent, so the scale and the log-sum-exp fold into one multiply-add
        st = tl.dot(b_k, b_qt, input_precision=PREC) * qk_scale - b_lse[None, :]
        pt = tl.exp2(tl.where(_seen_t(o_n, o_m, OFF, WINDOW, km, USE_WINDOW, USE_KMASK), st, float("-inf")))
        # u = δ + f·λ (one accumulator), c and f·ψ
        u = tl.dot(b_f, tl.trans(b_lam), acc=tl.dot(b_v, b_dot, input_precision=PREC), input_precision=MPREC)
        ct = tl.dot(b_f, tl.trans(b_gam), input_precision=MPREC)
        fpsi = tl.dot(b_f, tl.trans(b_psi), input_precision=MPREC)
        if not SPARE:
            ct += tl.load(abar + stat, mask=m_m, other=0.0)[None, :]
            fpsi -= tl.load(delta + stat, mask=m_m, other=0.0)[None, :]
        pc = pt * ct
        dst = pt * (ct * u + fpsi)
        acc_v += tl.dot(pc.to(b_do.dtype), b_do, input_precision=PREC)
        acc_k += tl.dot(dst.to(b_q.dtype), b_q, input_precision=PREC)
        # df = Σ_t p (ψ + u γ + c λ) (f·dm − (f·λ)(f·β) regrouped as in dst, γ = −β; the spare column's share
        # is dropped below), in the input dtype like dk and dv (tf32 operands from registers took 0.8 of 4.1 ms
        # at r = 8, 4k)
        lo_t = b_q.dtype
        acc_f += (tl.dot(pt.to(lo_t), b_psi.to(lo_t), input_precision=PREC)
                  + tl.dot((pt * u).to(lo_t), b_gam.to(lo_t), input_precision=PREC)
                  + tl.dot(pc.to(lo_t), b_lam.to(lo_t), input_precision=PREC))

    # df = acc_f (rows past S, never stored, hold weights of keys that do not exist; the spare column is no feature)
    acc_f = tl.where(m_n[:, None] & (o_r[None, :] < NR), acc_f, 0.0)
    b_p = _projection(P, i_h, NR, P_STRIDE, DK, R, BK)
    b_dk = acc_k * b_scale + tl.dot(acc_f, b_p, input_precision="tf32x3")
    tl.store(dk + k_row[:, None] * DK + o_dk[None, :], b_dk.to(dk.dtype.element_ty),
             mask=m_n[:, None] & (o_dk[None, :] < DK))
    tl.store(dv + k_row[:, None] * DV + o_dv[None, :], acc_v.to(dv.dtype.element_ty),
             mask=m_n[:, None] & (o_dv[None, :] < DV))
    if WANT_DP:
        part = (i_n * tl.num_programs(1) + i_bh).to(tl.int64) * (R * BK)
        tl.store(dp_part + part + o_r[:, None] * BK + o_dk[None, :],
                 tl.dot(tl.trans(acc_f), b_k.to(tl.float32), input_precision="tf32x3"))


@triton.jit
def _bwd_dq_kernel(
    q, k, v, fk, P, NR, P_STRIDE, do, kmask, scale_h, lse, gbuf, lbuf, pbuf, abar, delta, dq, dscale, dp_part, T, S,
    OFF, WINDOW,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_KMASK: tl.constexpr, PREC: tl.constexpr, MPREC: tl.constexpr,
    SPARE: tl.constexpr, WANT_DP: tl.constexpr,
):
    """Grid (cdiv(T, BM), B * H): dq = σ Σ ds k − λ P of one query block (−λ is the gradient of g = P q), its
    share Σ q·(Σ ds k) of the head's dσ (``dscale [cdiv(T, BM), B * H]``) and its share −Σ λᵀ q of dP
    (``dp_part [.., R, BK]``)."""
    o_m, m_m, q_row, k_base, kmask_row, stat, lo, hi, qk_scale = _query_block(kmask, scale_h, T, S, OFF, WINDOW,
                                                                               H, BM, BN, USE_WINDOW)
    o_dk = tl.arange(0, BK)
    o_dv = tl.arange(0, BV)
    o_r = tl.arange(0, R)
    b_q = _rows(q, q_row, m_m, DK, BK)
    b_do = _rows(do, q_row, m_m, DV, BV)
    b_lse = tl.load(lse + stat, mask=m_m, other=float("inf"))
    b_gam = _rows(gbuf, stat, m_m, R, R)
    b_lam = _rows(lbuf, stat, m_m, R, R)
    b_psi = _rows(pbuf, stat, m_m, R, R)
    b_a = tl.load(abar + stat, mask=m_m, other=0.0)
    b_delta = tl.load(delta + stat, mask=m_m, other=0.0)
    spare = o_r == R - 1

    acc = tl.zeros([BM, BK], tl.float32)
    for start in range(lo, hi, BN):
        o_n, m_n, k_row, b_kt, s = _key_block_logits(b_q, qk_scale, k, k_base, start, o_m, kmask_row, T, S, OFF,
                                                     WINDOW, H, DK, BK, BM, BN, USE_WINDOW, USE_KMASK, PREC)
        b_k = tl.trans(b_kt)  # one load for both products
        p = tl.exp2(s - b_lse[:, None])
        b_vt = tl.load(v + k_row[None, :] * DV + o_dv[:, None], mask=m_n[None, :] & (o_dv[:, None] < DV), other=0.0)
        b_ft = tl.load(fk + k_row[None, :] * R + o_r[:, None], mask=m_n[None, :], other=0.0)
        if SPARE:
            b_ft = _with_one(b_ft, spare[:, None])
        u = tl.dot(b_lam, b_ft, acc=tl.dot(b_do, b_vt, input_precision=PREC), input_precision=MPREC)  # δ + f·λ
        c = tl.dot(b_gam, b_ft, input_precision=MPREC)
        fpsi = tl.dot(b_psi, b_ft, input_precision=MPREC)
        if not SPARE:
            c += b_a[:, None]
            fpsi -= b_delta[:, None]
        ds = p * (c * u + fpsi)  # as in _bwd_dkv
        acc += tl.dot(ds.to(b_k.dtype), b_k, input_precision=PREC)
    i_h = tl.program_id(1) % H
    part = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    b_qf = b_q.to(tl.float32)
    tl.store(dscale + part, tl.sum(tl.sum(b_qf * acc, 1), 0))
    b_p = _projection(P, i_h, NR, P_STRIDE, DK, R, BK)
    b_dq = acc * tl.load(scale_h + i_h) - tl.dot(b_lam, b_p, input_precision="tf32x3")
    tl.store(dq + q_row[:, None] * DK + o_dk[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_m[:, None] & (o_dk[None, :] < DK))
    if WANT_DP:
        tl.store(dp_part + part.to(tl.int64) * (R * BK) + o_r[:, None] * BK + o_dk[None, :],
                 -tl.dot(tl.trans(b_lam), b_qf, input_precision="tf32x3"))


# ============================================================================ launch helpers
class _Ctx:
    """Shapes, block sizes and flags shared by the forward and the backward."""

    def __init__(self, q, k, v, R, rank, window, key_mask):
        B, T, H, DK = q.shape
        self.B, self.T, self.H, self.DK = B, T, H, DK
        self.S, self.DV, self.R, self.rank = k.shape[1], v.shape[-1], R, rank
        # features that carry the r×r moments and the solve: up to 8 slope features keep 8 (64 moments a
        # query, not 256); the r-wide products still take R ≥ 16 columns (the smallest tensor-core product)
        self.RM = 8 if rank <= 8 and R == 16 else R
        # the forward saves A (RM² numbers a query) when it is small: the backward's prep then needs no
        # moments and few registers (r = 8, 4k: prep 2.05 → 1.16 ms, plus 0.19 for the solve kernel); at
        # RM = 16 it would be 1 KB a query and head, and the solve of 16 features alone took 2.3 ms as a kernel
        self.save_a = self.RM <= 8
        # a zero feature column (r < R) that the kernels can hold at 1 (``_with_one``)
        self.spare = rank < R
        self.OFF = self.S - T
        self.BK, self.BV = next_pow2(DK), next_pow2(self.DV)
        self.window = window
        self.kmask = key_mask
        self.dtype = q.dtype
        # fp32 inputs: full-precision logits (the reference semantics) and moments from three tf32 products
        # ("tf32x3", about fp32 accuracy, on tensor cores: a plain fp32 dot runs on the FMA units, 4–8× slower
        # at r² = 256 columns). 16-bit inputs: tensor cores throughout; the r² moments take 16-bit operands
        # (``_outer_products``), the r-wide feature products tf32 (c = a − f·β can cancel, so β stays fp32).
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"
        interp = q.device.type == "cpu"
        self.mprec = "ieee" if interp else ("tf32x3" if q.dtype == torch.float32 else "tf32")
        if interp:
            self.launch = dict(INTERPRET_LAUNCH)
        elif R <= 16:
            self.launch = dict(LAUNCH, **(LAUNCH_RM8 if self.RM == 8 else {}))
        else:  # the [BM, R²] moment accumulators of 32 features fit in registers only with 16-row query blocks;
            # the [BN, R²] outer-product tiles of the moment kernels in shared memory only 16 rows at one stage
            self.launch = {name: Launch(16, 32, 4, cfg.stages) for name, cfg in LAUNCH.items()}
            self.launch.update(stats=Launch(16, 16, 4, 1), prep_moments=Launch(16, 16, 4, 1))

    def meta(self, kernel: str, fn):
        """The launch of ``kernel`` (a key of LAUNCH) and the constants of fn that it takes."""
        cfg = self.launch[kernel]
        consts = dict(H=self.H, DK=self.DK, DV=self.DV, R=self.R, RM=self.RM, BK=self.BK, BV=self.BV, BM=cfg.BM,
                      BN=cfg.BN, USE_WINDOW=self.window is not None, USE_KMASK=self.kmask is not None,
                      PREC=self.prec, MPREC=self.mprec, SPARE=self.spare)
        return dict({n: x for n, x in consts.items() if n in fn.arg_names}, num_warps=cfg.warps,
                    num_stages=cfg.stages)

    def grid(self, kernel: str, over_keys: bool = False):
        cfg = self.launch[kernel]
        return (triton.cdiv(self.S, cfg.BN) if over_keys else triton.cdiv(self.T, cfg.BM), self.B * self.H)

    def kmask_arg(self, like):
        return self.kmask if self.kmask is not None else like


def _outer_products(c: _Ctx, fk):
    """f fᵀ of every key's first RM features, flattened ``[B, S, H, RM²]``: in the input dtype for 16-bit inputs
    (the moments' tensor-core operands), fp32 otherwise. Formed for each pass rather than saved (RM² numbers a
    key)."""
    dt = c.dtype if c.dtype in (torch.float16, torch.bfloat16) else torch.float32
    out = torch.empty(*fk.shape[:-1], c.RM * c.RM, dtype=dt, device=fk.device)
    n, block = fk.numel() // c.R, 8192 // (c.RM * c.RM)  # (a broadcast torch.mul took 4-5x as long on an H100)
    _outer_products_kernel[(triton.cdiv(n, block),)](fk, out, n, R=c.R, RM=c.RM, BLOCK=block)
    return out


def _fwd(c: _Ctx, q, k, v, fk, P, scale_h, ridge):
    """Outputs and the statistics the backward needs: log-sum-exp, m, β and (``c.save_a``) A."""
    dev = q.device
    o = torch.empty(c.B, c.T, c.H, c.DV, dtype=v.dtype, device=dev)
    lse = torch.empty(c.B, c.H, c.T, dtype=torch.float32, device=dev)
    mbuf = torch.empty(c.B, c.H, c.T, c.R, dtype=torch.float32, device=dev)
    bbuf = torch.empty_like(mbuf)
    abuf = torch.empty(c.B, c.H, c.T, c.RM * c.RM if c.save_a else 0, dtype=torch.float32, device=dev)
    km, W = c.kmask_arg(q), c.window or 0
    _fwd_stats_kernel[c.grid("stats")](q, k, fk, _outer_products(c, fk), P, c.rank, head_stride(P), km, scale_h, lse,
                                       mbuf, bbuf, abuf, ridge, c.T, c.S, c.OFF, W, SAVE_A=c.save_a,
                                       **c.meta("stats", _fwd_stats_kernel))
    _fwd_out_kernel[c.grid("out")](q, k, v, fk, km, scale_h, o, lse, mbuf, bbuf, c.T, c.S, c.OFF, W,
                                   **c.meta("out", _fwd_out_kernel))
    return o, lse, mbuf, bbuf, abuf


def _bwd(c: _Ctx, q, k, v, fk, P, do, scale_h, lse, mbuf, bbuf, abuf, ridge, want_dp):
    """dq, dk, dv (with the features' shares), dσ ``[H]`` and dP (float32, P's shape; None unless want_dp)."""
    # per query for the dk/dv and dq kernels: λ, γ, ψ, a and Δ (``_store_terms``)
    lbuf, gbuf, pbuf = torch.empty_like(mbuf), torch.empty_like(mbuf), torch.empty_like(mbuf)
    abar, delta = torch.empty_like(lse), torch.empty_like(lse)
    W = c.window or 0
    km = c.kmask_arg(q)
    if c.save_a:  # D and E per query, then the solves of all queries in a kernel of their own
        dbuf, ebuf = torch.empty_like(lse), torch.empty_like(mbuf)
        _bwd_prep_kernel[c.grid("prep")](q, k, v, fk, None, do, km, scale_h, lse, mbuf, bbuf, dbuf, ebuf, lbuf,
                                         gbuf, pbuf, abar, delta, ridge, c.T, c.S, c.OFF, W, MOMENTS=False,
                                         **c.meta("prep", _bwd_prep_kernel))
        n = c.B * c.H * c.T
        _bwd_solve_kernel[(triton.cdiv(n, SOLVE_ROWS),)](abuf, mbuf, bbuf, dbuf, ebuf, lbuf, gbuf, pbuf, abar, delta,
                                                        ridge, n, R=c.R, RM=c.RM, BQ=SOLVE_ROWS, SPARE=c.spare,
                                                        num_warps=4)
    else:  # the moments again and the solves at the prep's end (D and E stay in registers: no dbuf, ebuf)
        _bwd_prep_kernel[c.grid("prep_moments")](q, k, v, fk, _outer_products(c, fk), do, km, scale_h, lse, mbuf,
                                                 bbuf, None, None, lbuf, gbuf, pbuf, abar, delta, ridge, c.T, c.S,
                                                 c.OFF, W, MOMENTS=True, **c.meta("prep_moments", _bwd_prep_kernel))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    proj = (P, c.rank, head_stride(P))
    grid_k, grid_q = c.grid("dkv", over_keys=True), c.grid("dq")
    # each program's share of dP (keys' and queries' features), summed below; not formed for a frozen P
    dp_k = torch.empty(*(grid_k if want_dp else (0,)), c.R, c.BK, dtype=torch.float32, device=q.device)
    dp_q = torch.empty(*(grid_q if want_dp else (0,)), c.R, c.BK, dtype=torch.float32, device=q.device)
    _bwd_dkv_kernel[grid_k](q, k, v, fk, *proj, do, km, scale_h, lse, gbuf, lbuf, pbuf, abar, delta, dk, dv, dp_k,
                            c.T, c.S, c.OFF, W, WANT_DP=want_dp, **c.meta("dkv", _bwd_dkv_kernel))
    dscale = torch.empty(grid_q, dtype=torch.float32, device=q.device)  # per-program shares of dσ
    _bwd_dq_kernel[grid_q](q, k, v, fk, *proj, do, km, scale_h, lse, gbuf, lbuf, pbuf, abar, delta, dq, dscale, dp_q,
                           c.T, c.S, c.OFF, W, WANT_DP=want_dp, **c.meta("dq", _bwd_dq_kernel))
    dP = None
    if want_dp:  # shares [programs, B·H, R, BK] → per head → P's shape
        dP = sum(x.view(-1, c.B, c.H, c.R, c.BK).sum((0, 1)) for x in (dp_k, dp_q))[:, :c.rank, :c.DK]
        dP = dP.sum(0) if P.dim() == 2 else dP
    return dq, dk, dv, dscale.view(-1, c.B, c.H).sum((0, 1)), dP


class LocalLinearAttentionFunction(torch.autograd.Function):
    """Fused local-linear attention on queries, keys, values, the slope projection P (float32 ``[r, dk]`` or
    ``[H, r, dk]``; the identity for the exact slope) and the per-head logit scales σ (fp32 ``[H]``); see the
    module docstring. The keys' features P k are formed once here; P q inside the statistics kernel."""

    @staticmethod
    def forward(ctx, q, k, v, P, scale_h, key_mask, ridge, window):
        rank = P.shape[-2]
        R = next_pow2(rank)
        c = _Ctx(q, k, v, R, rank, window, key_mask)
        fk = project(k, P, R)
        o, lse, mbuf, bbuf, abuf = _fwd(c, q, k, v, fk, P, scale_h, ridge)
        ctx.c, ctx.ridge = c, ridge
        ctx.save_for_backward(q, k, v, fk, P, scale_h, lse, mbuf, bbuf, abuf)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, fk, P, scale_h, lse, mbuf, bbuf, abuf = ctx.saved_tensors
        dq, dk, dv, dscale, dP = _bwd(ctx.c, q, k, v, fk, P, do.contiguous(), scale_h, lse, mbuf, bbuf, abuf,
                                      ctx.ridge, ctx.needs_input_grad[3])
        return dq, dk, dv, dP, dscale, None, None, None


# ============================================================================ public entry points
def check_supported(q: torch.Tensor, v: torch.Tensor, r: int) -> str | None:
    """None when the kernels can run this case (r slope features), else the reason."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes float32/float16/bfloat16 inputs, not {q.dtype}"
    dk, dv = q.shape[-1], v.shape[-1]
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return f"the Triton kernel takes head dims up to {MAX_HEAD_DIM}, got dk={dk}, dv={dv}"
    if r > MAX_RANK:
        return f"the Triton kernel takes up to {MAX_RANK} slope features, got r={r}"
    return device_unsupported(q)


def local_linear_attention(q, k, v, *, scale, ridge: float, window: int | None = None, key_mask=None,
                           rank_projection=None):
    """``o [B, T, H, dv]`` in v's dtype. q ``[B, T, H, dk]``, k ``[B, S, H, dk]``, v ``[B, S, H, dv]`` of
    one dtype (S ≥ T: the last T keys are the queries' own positions); scale: a number or a tensor ``[H]``
    (the logits' β); key_mask ``[B, S]`` bool or None; rank_projection None (exact slope, dk ≤ 32) or
    P ``[r, dk]`` / ``[H, r, dk]``. Differentiable in q, k, v, scale and P."""
    H, DK = q.shape[2:]
    # the scale goes to the kernels as it is (the logits σ q·k formed in fp32 there), not folded into a copy of q
    # rounded to its dtype (that copy, its casts and their backward: fwd+bwd 9.8–10.1 → 8.7–8.9 ms with a learned
    # per-head scale, r = 8, 4k, H100)
    if isinstance(scale, torch.Tensor):
        scale_h = scale.to(torch.float32).reshape(-1).expand(H).contiguous()
    else:
        scale_h = torch.full((H,), float(scale), dtype=torch.float32, device=q.device)
    if rank_projection is None:  # the exact slope: the features are q and k themselves
        P = torch.eye(DK, dtype=torch.float32, device=q.device)
    else:  # (a float32 P passes through as it is, so autograd hands its gradient straight back)
        P = rank_projection.to(torch.float32).contiguous()
    km = None if key_mask is None else key_mask.to(torch.int8).contiguous()
    return LocalLinearAttentionFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), P, scale_h, km,
                                              float(ridge), window)
