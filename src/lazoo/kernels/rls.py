"""Triton kernel for RLS's precision part (γ = 1): z_t = (KK_t + λI)^{-1} r_t at every position, exactly.

Per head, with A_c = KK_0 + λI + Σ_{earlier chunks} KᵀK the ridged moments at the start of chunk c (a prefix sum
computed outside), one program per (chunk, sample·head):

  1. P = A_c^{-1} on chip by the symmetric block sweep (Gauss–Jordan without pivoting, which is stable for
     a positive definite matrix): for each block j of BS columns, with c = A[:, j] and p = A_jj^{-1},
     A ← A − (c p) cᵀ, then A[:, j] ← c p and A_jj ← −p (and the mirror rows); after every block A = −P.
     The BS×BS pivots are inverted from their LDLᵀ factors (below).
  2. The chunk's positions BS at a time, P carried along (Sherman–Morrison/Woodbury, exact for γ = 1): with
     U = K_s P, W = R_s P, M = I + K_s Uᵀ = L D Lᵀ and Rm[i, t] = k_iᵀ P r_t, every position's leading
     principal solve comes from L⁻¹ and D⁻¹ (matrix products only):
         X = N ⊙ L⁻ᵀ D⁻¹ (N ⊙ L⁻¹ (N ⊙ Rm)),   N[i, t] = [i ≤ t],     z_t = W_t − Σ_i X[i, t] U_i
     then P ← P − Uᵀ M⁻¹ U for the next BS positions. L and D come from a symmetric elimination of the
     BS×BS matrix M in registers, L⁻¹ from a nilpotent product (``_ldl_inverse``).

Everything is fp32; the products run at ``precision``: ``"tf32x3"`` (fp32-accurate on the tensor cores, the
default: 3-4e-7 from a float64 solve at T = 1k; plain tf32 gave 1e-3) or ``"ieee"`` (fp32 FMAs, ~10× slower
on an H100). With bf16/fp16 keys and right-hand sides, which tf32 holds exactly, U = K_s P and W = R_s P
take two tf32 products with P split once per block into a tf32 part and its remainder (``_split``) instead of
tf32x3's three (7.6e-7 from float64; the step 1.3× faster at T = 32k). A head dim below a power of two is
padded on chip with an identity block (exact: the padded coordinates decouple). Limits: dk <= 128 (P is held
in registers), the chunk a multiple of BS = 16.

The backward of z needs the same solve with r = ∂L/∂z (A is symmetric): ``RLSPrecisionFunction`` (below;
``rls_precision``, used by ``lazoo.ops.rls``) calls the kernel twice per training step and forms the other
gradients from z and that solve; the forward keeps the factors (every chunk's P and every block's L⁻¹, D⁻¹),
so the backward's call does the products only; z is handed on in the memory part's dtype, so ∂L/∂z arrives
in bf16 for bf16 models and that call takes the split products too.

The fp32 solve is not accurate for every input (poorly conditioned ridge systems: small λ, keys close to linearly
dependent, large inputs). ``rls_precision(..., check=True)`` also returns its relative residual at every chunk's
last position (``chunk_end_residual``, computed in the forward from the chunk-start moments it already has), with
which ``lazoo.ops.rls`` warns or recomputes the samples that miss the precision asked for (docs/rls.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import is_interpreting, next_pow2
from .limits import RLS_BLOCK as BS
from .limits import RLS_MAX_HEAD_DIM as MAX_HEAD_DIM

#: positions per program (one dk×dk inverse each), product precision and warps per program (chosen from a
#: sweep on an H100: docs/rls.md)
CHUNK = 512
PRECISION = "tf32x3"
NUM_WARPS = 8
#: warps for head dims <= 64: with 8 warps, Triton 3.6 compiled the block sweep's rank-16 product at DK = 64 into an
#: invalid shared-memory read (compute-sanitizer on an H100, in the backward's fp32 variant); 4 warps run clean
NUM_WARPS_SMALL = 4


@triton.jit
def _take_cols(X, j, R: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """Column block j (B wide) of X ``[R, NB·B]`` → ``[R, B]``."""
    X3 = tl.reshape(X, [R, NB, B])
    sel = (tl.arange(0, NB) == j)[None, :, None]
    return tl.sum(tl.where(sel, X3, 0.0), axis=1)


@triton.jit
def _take_rows(X, j, NB: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """Row block j (B tall) of X ``[NB·B, C]`` → ``[B, C]``."""
    X3 = tl.reshape(X, [NB, B, C])
    sel = (tl.arange(0, NB) == j)[:, None, None]
    return tl.sum(tl.where(sel, X3, 0.0), axis=0)


@triton.jit
def _put_cols(X, Y, j, R: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """X ``[R, NB·B]`` with column block j replaced by Y ``[R, B]``."""
    X3 = tl.reshape(X, [R, NB, B])
    sel = (tl.arange(0, NB) == j)[None, :, None]
    return tl.reshape(tl.where(sel, Y[:, None, :], X3), [R, NB * B])


@triton.jit
def _put_rows(X, Y, j, NB: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """X ``[NB·B, C]`` with row block j replaced by Y ``[B, C]``."""
    X3 = tl.reshape(X, [NB, B, C])
    sel = (tl.arange(0, NB) == j)[:, None, None]
    return tl.reshape(tl.where(sel, Y[None, :, :], X3), [NB * B, C])


@triton.jit
def _small_inverse(a, B: tl.constexpr, PREC: tl.constexpr):
    """Inverse of a symmetric positive definite ``[B, B]`` matrix: L⁻ᵀ D⁻¹ L⁻¹ from its LDLᵀ factors."""
    E, dinv = _ldl_inverse(a, B, PREC)
    return tl.dot(tl.trans(E), dinv[:, None] * E, input_precision=PREC)


@triton.jit
def _spd_inverse(A, DK: tl.constexpr, B: tl.constexpr, PREC: tl.constexpr):
    """Inverse of a symmetric positive definite ``[DK, DK]`` matrix by the block sweep (blocks of B)."""
    NB: tl.constexpr = DK // B
    for j in range(NB):
        c = _take_cols(A, j, DK, NB, B)  # [DK, B]
        p = _small_inverse(_take_rows(c, j, NB, B, B), B, PREC)
        f = tl.dot(c, p, input_precision=PREC)
        A = A - tl.dot(f, tl.trans(c), input_precision=PREC)
        g = _put_rows(f, -p, j, NB, B, B)
        A = _put_cols(A, g, j, DK, NB, B)
        A = _put_rows(A, tl.trans(g), j, NB, B, DK)
    return -A


@triton.jit
def _ldl_inverse(M, B: tl.constexpr, PREC: tl.constexpr):
    """M = L D Lᵀ (symmetric positive definite ``[B, B]``): returns L⁻¹ (unit lower) and D⁻¹ ``[B]``.

    Symmetric elimination, four pivots a step (the loop is latency-bound: one round of reductions a step
    instead of one a pivot): the remaining matrix is symmetric, so its columns c_j (j = p … p + 3) are also
    its rows; the 4×4 pivot block's entries m_ij = c_j[p + i] give its LDLᵀ in scalars, each column is
    cleared of the earlier pivots (c_j ← c_j − Σ_{i<j} l_i m'_ij), l_j = c_j / d_j, and
    M ← M − Σ_j l_j c_jᵀ. L⁻¹ = (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸) for the strictly lower N
    (nilpotent: N^B = 0), four products instead of a second sequential loop."""
    r = tl.arange(0, B)
    L = tl.zeros([B, B], dtype=tl.float32)
    dvec = tl.zeros([B], dtype=tl.float32)
    for p in range(0, B, 4):
        c0 = tl.sum(tl.where(r[None, :] == p, M, 0.0), axis=1)
        c1 = tl.sum(tl.where(r[None, :] == p + 1, M, 0.0), axis=1)
        c2 = tl.sum(tl.where(r[None, :] == p + 2, M, 0.0), axis=1)
        c3 = tl.sum(tl.where(r[None, :] == p + 3, M, 0.0), axis=1)
        m00 = tl.sum(tl.where(r == p, c0, 0.0), axis=0)
        m01 = tl.sum(tl.where(r == p, c1, 0.0), axis=0)
        m02 = tl.sum(tl.where(r == p, c2, 0.0), axis=0)
        m03 = tl.sum(tl.where(r == p, c3, 0.0), axis=0)
        m11 = tl.sum(tl.where(r == p + 1, c1, 0.0), axis=0)
        m12 = tl.sum(tl.where(r == p + 1, c2, 0.0), axis=0)
        m13 = tl.sum(tl.where(r == p + 1, c3, 0.0), axis=0)
        m22 = tl.sum(tl.where(r == p + 2, c2, 0.0), axis=0)
        m23 = tl.sum(tl.where(r == p + 2, c3, 0.0), axis=0)
        m33 = tl.sum(tl.where(r == p + 3, c3, 0.0), axis=0)
        # the pivot block's LDLᵀ in scalars (primes: entries after the earlier pivots are out)
        d0 = m00
        d1 = m11 - m01 * m01 / d0
        m12 = m12 - m01 * m02 / d0
        m13 = m13 - m01 * m03 / d0
        d2 = m22 - m02 * m02 / d0 - m12 * m12 / d1
        m23 = m23 - m02 * m03 / d0 - m12 * m13 / d1
        d3 = m33 - m03 * m03 / d0 - m13 * m13 / d1 - m23 * m23 / d2
        l0 = c0 / d0
        c1 = c1 - l0 * m01
        l1 = c1 / d1
        c2 = c2 - l0 * m02 - l1 * m12
        l2 = c2 / d2
        c3 = c3 - l0 * m03 - l1 * m13 - l2 * m23
        l3 = c3 / d3
        M = M - l0[:, None] * c0[None, :] - l1[:, None] * c1[None, :] - l2[:, None] * c2[None, :] \
            - l3[:, None] * c3[None, :]
        L = tl.where(r[None, :] == p, l0[:, None], L)
        L = tl.where(r[None, :] == p + 1, l1[:, None], L)
        L = tl.where(r[None, :] == p + 2, l2[:, None], L)
        L = tl.where(r[None, :] == p + 3, l3[:, None], L)
        dvec = tl.where(r == p, d0, tl.where(r == p + 1, d1, dvec))
        dvec = tl.where(r == p + 2, d2, tl.where(r == p + 3, d3, dvec))
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    N = tl.where(r[:, None] > r[None, :], L, 0.0)
    E = eye - N
    Nk = N
    for _ in tl.static_range(3):  # B <= 16: N^16 = 0
        Nk = tl.dot(Nk, Nk, input_precision=PREC)
        E = tl.dot(E, eye + Nk, input_precision=PREC)
    return E, 1.0 / dvec


@triton.jit
def _split(x):
    """x = hi + lo with hi exact in tf32 (the low 13 of fp32's 23 mantissa bits cleared) and lo the rest."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _solve_kernel(A, K, R, Z, P0, E_, D_, T, H, N, dk, BC: tl.constexpr, DK: tl.constexpr, B: tl.constexpr,
                  PREC: tl.constexpr, SAVE: tl.constexpr, REUSE: tl.constexpr, SPLIT: tl.constexpr):
    i_n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = bh // H, bh % H
    d = tl.arange(0, DK)
    d_ok = d < dk
    p_offs = (bh * N + i_n) * DK * DK + d[:, None] * DK + d[None, :]
    if REUSE:  # the factors of an earlier call on the same keys (the backward's solve)
        P = tl.load(P0 + p_offs)
    else:
        a = tl.load(A + (bh * N + i_n) * dk * dk + d[:, None] * dk + d[None, :],
                    mask=d_ok[:, None] & d_ok[None, :], other=0.0)
        a = tl.where((d[:, None] == d[None, :]) & ~d_ok[:, None], 1.0, a)  # identity on the padded coordinates
        P = _spd_inverse(a, DK, B, PREC)
        if SAVE:
            tl.store(P0 + p_offs, P)

    s = tl.arange(0, B)
    eye = tl.where(s[:, None] == s[None, :], 1.0, 0.0)
    upto = s[:, None] <= s[None, :]  # [i, t]: i ≤ t
    base = i_b * T * H * dk + i_h * dk
    for s0 in range(0, tl.minimum(BC, T - i_n * BC), B):  # a short last chunk (decoding: one token) stops early
        t = i_n * BC + s0 + s
        ok = (t < T)[:, None] & d_ok[None, :]
        offs = base + t[:, None] * (H * dk) + d[None, :]
        sb = (bh * N + i_n) * (BC // B) + s0 // B  # this sub-block's slot in the saved factors
        Ks = tl.load(K + offs, mask=ok, other=0.0).to(tl.float32)
        Rs = tl.load(R + offs, mask=ok, other=0.0).to(tl.float32)
        if SPLIT:  # K and R exact in tf32 (bf16/fp16 in memory): P split once, two tf32 passes per product
            P_hi, P_lo = _split(P)
            U = tl.dot(Ks, P_hi, input_precision="tf32") + tl.dot(Ks, P_lo, input_precision="tf32")
            W = tl.dot(Rs, P_hi, input_precision="tf32") + tl.dot(Rs, P_lo, input_precision="tf32")
        else:
            U = tl.dot(Ks, P, input_precision=PREC)  # rows (P k_i)ᵀ
            W = tl.dot(Rs, P, input_precision=PREC)  # rows (P r_t)ᵀ
        if REUSE:
            E = tl.load(E_ + sb * B * B + s[:, None] * B + s[None, :])
            dinv = tl.load(D_ + sb * B + s)
        else:
            M = eye + tl.dot(Ks, tl.trans(U), input_precision=PREC)
            E, dinv = _ldl_inverse(M, B, PREC)
            if SAVE:
                tl.store(E_ + sb * B * B + s[:, None] * B + s[None, :], E)
                tl.store(D_ + sb * B + s, dinv)
        Rm = tl.dot(U, tl.trans(Rs), input_precision=PREC)  # [i, t] = k_iᵀ P r_t
        Y = tl.where(upto, tl.dot(E, tl.where(upto, Rm, 0.0), input_precision=PREC), 0.0)
        X = tl.where(upto, tl.dot(tl.trans(E), dinv[:, None] * Y, input_precision=PREC), 0.0)
        Zs = W - tl.dot(tl.trans(X), U, input_precision=PREC)
        tl.store(Z + offs, Zs, mask=ok)
        Minv = tl.dot(tl.trans(E), dinv[:, None] * E, input_precision=PREC)
        P = P - tl.dot(tl.trans(U), tl.dot(Minv, U, input_precision=PREC), input_precision=PREC)


@triton.jit
def _gram_kernel(K, G, T, H, N, dk, BC: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    i_n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = bh // H, bh % H
    d = tl.arange(0, DK)
    d_ok = d < dk
    base = i_b * T * H * dk + i_h * dk
    acc = tl.zeros([DK, DK], dtype=tl.float32)
    for s0 in range(0, tl.minimum(BC, T - i_n * BC), BT):
        t = i_n * BC + s0 + tl.arange(0, BT)
        kb = tl.load(K + base + t[:, None] * (H * dk) + d[None, :], mask=(t < T)[:, None] & d_ok[None, :], other=0.0)
        acc += tl.dot(tl.trans(kb), kb, input_precision=PREC)  # bf16/fp16: exact products, fp32 sums
    tl.store(G + (bh * N + i_n) * dk * dk + d[:, None] * dk + d[None, :], acc, mask=d_ok[:, None] & d_ok[None, :])


def chunk_gram(k: torch.Tensor, chunk: int) -> torch.Tensor:
    """Σ_{i in chunk c} k_i k_iᵀ for every chunk: fp32 ``[B, H, N, dk, dk]`` from ``k [B, T, H, dk]``."""
    Bn, T, H, dk = k.shape
    N = triton.cdiv(T, chunk)
    k = k.contiguous()
    G = torch.empty(Bn, H, N, dk, dk, dtype=torch.float32, device=k.device)
    bt = min(64, chunk)
    precision = "ieee" if is_interpreting() else PRECISION
    _gram_kernel[(N, Bn * H)](k, G, T, H, N, dk, BC=chunk, DK=next_pow2(dk, BS), BT=bt, PREC=precision,
                              num_warps=4, num_stages=2)
    return G


class SolveFactors(NamedTuple):
    """What ``rls_solve`` can keep from one call for another on the same keys and chunk starts: every
    chunk's start inverse ``P0 [B, H, N, DK, DK]`` (DK the padded head dim) and every 16-position block's
    L⁻¹ ``E [B, H, N, chunk/16, 16, 16]`` and D⁻¹ ``dinv [B, H, N, chunk/16, 16]``, fp32 (≈ 17 + DK²/chunk
    floats a position)."""

    P0: torch.Tensor
    E: torch.Tensor
    dinv: torch.Tensor


def rls_solve(A: torch.Tensor | None, k: torch.Tensor, r: torch.Tensor, chunk: int, *,
              factors: SolveFactors | None = None, keep_factors: bool = False, precision: str | None = None,
              num_warps: int | None = None):
    """z_t = (A_c + Σ_{i ≤ t in chunk c} k_i k_iᵀ)^{-1} r_t for every position.

    ``A [B, H, N, dk, dk]`` fp32: the ridged moments at every chunk start (N = ⌈T / chunk⌉, positive
    definite); ``k``, ``r`` ``[B, T, H, dk]`` (any float dtype, k zero at pads). Returns z ``[B, T, H, dk]``
    fp32, and its ``SolveFactors`` too with ``keep_factors``. Given ``factors`` from a call on the same k and
    A (A may then be None), the call skips the inverses and eliminations: only the products remain."""
    Bn, T, H, dk = k.shape
    if dk > MAX_HEAD_DIM:
        raise ValueError(f"rls_solve: head dim {dk} > {MAX_HEAD_DIM} (the dk×dk inverse is held in registers)")
    if chunk % BS:
        raise ValueError(f"rls_solve: chunk {chunk} is not a multiple of {BS}")
    N = triton.cdiv(T, chunk)
    DK = next_pow2(dk, BS)
    if factors is None and (A is None or tuple(A.shape) != (Bn, H, N, dk, dk) or A.dtype != torch.float32):
        raise ValueError(f"rls_solve: A must be fp32 [B, H, N, dk, dk] = {(Bn, H, N, dk, dk)}, got "
                         f"{None if A is None else (A.dtype, tuple(A.shape))}")
    shapes = ((Bn, H, N, DK, DK), (Bn, H, N, chunk // BS, BS, BS), (Bn, H, N, chunk // BS, BS))
    if factors is not None and tuple(tuple(f.shape) for f in factors) != shapes:
        raise ValueError(f"rls_solve: factors do not match these keys and chunk: expected shapes {shapes}")
    k, r = k.contiguous(), r.contiguous()
    z = torch.empty(Bn, T, H, dk, dtype=torch.float32, device=k.device)
    out = factors
    if out is None and keep_factors:
        out = SolveFactors(*(torch.empty(sh, dtype=torch.float32, device=k.device) for sh in shapes))
    dummy = z  # pointer arguments that a variant does not touch
    P0, E, dinv = out if out is not None else (dummy, dummy, dummy)
    half = (torch.bfloat16, torch.float16)
    split = (precision or PRECISION) == "tf32x3" and k.dtype in half and r.dtype in half
    precision = "ieee" if is_interpreting() else (precision or PRECISION)
    num_warps = num_warps or (NUM_WARPS if DK > 64 else NUM_WARPS_SMALL)
    _solve_kernel[(N, Bn * H)](A.contiguous() if A is not None else dummy, k, r, z, P0, E, dinv, T, H, N, dk,
                               BC=chunk, DK=DK, B=BS, PREC=precision, SAVE=factors is None and keep_factors,
                               REUSE=factors is not None, SPLIT=split, num_warps=num_warps, num_stages=1)
    return (z, out) if keep_factors else z


# ----------------------------------------------------------------------------- autograd
def memory_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16 inputs run the linear-attention parts in their precision; everything else in fp32."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def chunk_moments(k: torch.Tensor, KK: torch.Tensor, lam_h: torch.Tensor, chunk: int):
    """``(A, gram)``, fp32 ``[B, H, N, dk, dk]``: A_c = KK_0 + λI + Σ_{earlier chunks} KᵀK, the ridged moments at every
    chunk start, and gram_c = Σ_{i in chunk c} k_i k_iᵀ (``KK [B, H, dk, dk]``, λ ``[H]``)."""
    gram = chunk_gram(k, chunk)
    eye = torch.eye(k.shape[-1], dtype=torch.float32, device=k.device)
    return KK.float()[:, :, None] + gram.cumsum(2) - gram + lam_h.float()[:, None, None, None] * eye, gram


def chunk_end_residual(q: torch.Tensor, z: torch.Tensor, A: torch.Tensor, gram: torch.Tensor,
                       chunk: int) -> torch.Tensor:
    """ρ ``[B, H, N]`` (fp32): ‖q_t − A_t z_t‖ / ‖q_t‖ (q the right-hand sides) at the last position t of every chunk,
    where A_t is the ridged moments through t: A_{c+1} for every chunk c but the last, A_c + gram_c for the last (0
    where q_t = 0). A sampled
    check of the fp32 solve: the Woodbury steps carry P over the chunk, so its last position sees the chunk-start
    inverse's error and every step's. N small matrix-vector products as elementwise products and sums (never
    TF32), no pass over the sequence; the evaluation's own rounding, ~eps·√dk·cond(A_t), stays far below the
    tolerances where the systems are well conditioned (3e-7 at dk = 128 for unit keys, against 2e-7 in float64)."""
    T = q.shape[1]
    N = A.shape[2]
    ends = (torch.arange(1, N + 1, device=q.device) * chunk).clamp(max=T) - 1
    zt = z[:, ends].float().transpose(1, 2)  # [B, H, N, dk]
    qt = q[:, ends].float().transpose(1, 2)
    Az = torch.cat([(A[:, :, 1:] * zt[:, :, :-1, None, :]).sum(-1),
                    ((A[:, :, -1] + gram[:, :, -1]) * zt[:, :, -1, None, :]).sum(-1)[:, :, None]], 2)
    r = (qt - Az).norm(dim=-1)
    qn = qt.norm(dim=-1)
    return torch.where(qn > 0, r / qn.clamp_min(torch.finfo(torch.float32).tiny), r)


def _key_grad(k, z, y):
    """With z_t = A_t^{-1} q_t and y_t = A_t^{-1} ∂L/∂z_t (A_t = KK_t + λI), ∂L/∂A_t = −y_t z_tᵀ, so
    ∂L/∂k_i = −Σ_{t≥i} [(z_t·k_i) y_t + (y_t·k_i) z_t]: two anti-causal linear attentions (queries k), run as
    causal ones on the time-reversed sequence, in k's precision (fp32 for fp32 inputs), returned in it."""
    from .linear import chunk_linear_attention

    mem = memory_dtype(k.dtype)
    kr, zr, yr = (x.to(mem).flip(1) for x in (k, z, y))  # one copy each (the reversal)
    o, _ = chunk_linear_attention(kr, zr, yr)
    o2, _ = chunk_linear_attention(kr, yr, zr)
    return o.add_(o2).flip(1).neg_()


class RLSPrecisionFunction(torch.autograd.Function):
    """z_t = (KK_t + λI)^{-1} q_t on the solve kernel; the backward solves again with ∂L/∂z (one more kernel
    call, reusing the forward's factors) and forms ∂k, ∂λ = −Σ y·z and ∂KK_0 = −sym(Σ y zᵀ) from z and that
    solve (no autograd through any factorisation)."""

    @staticmethod
    def forward(ctx, q, k, lam_h, KK, chunk, keep, out_dtype, check):
        A, gram = chunk_moments(k, KK, lam_h, chunk)
        if keep:
            z, factors = rls_solve(A, k, q, chunk, keep_factors=True)
            ctx.save_for_backward(k, z, *factors)
            ctx.chunk, ctx.dtypes = chunk, (q.dtype, k.dtype, lam_h.dtype, KK.dtype)
        else:  # no backward to come: keeping the factors costs ~1.4 ms at 32k tokens (H100)
            z = rls_solve(A, k, q, chunk)
        rho = chunk_end_residual(q, z, A, gram, chunk) if check else z.new_zeros(0)
        ctx.mark_non_differentiable(rho)
        # fp32 z is returned as the tensor itself: under torch.compile (dynamo, PyTorch 2.11), returning `z.to(fp32)`,
        # an alias of a saved tensor, made the backward's gradients vanish
        return (z if z.dtype == out_dtype else z.to(out_dtype)), rho

    @staticmethod
    def backward(ctx, dz, _drho):
        k, z, *factors = ctx.saved_tensors
        q_dt, k_dt, lam_dt, KK_dt = ctx.dtypes
        # dz in z's output dtype: bf16/fp16 right-hand sides let the kernel use its cheaper products
        y = rls_solve(None, k, dz, ctx.chunk, factors=SolveFactors(*factors))
        dq = y.to(q_dt)
        y_mem = dq if q_dt == memory_dtype(k_dt) else y  # one rounding of y serves ∂q and the key gradient
        dk = _key_grad(k, z, y_mem).to(k_dt) if ctx.needs_input_grad[1] else None
        dlam = -(y * z).sum((0, 1, 3)).to(lam_dt) if ctx.needs_input_grad[2] else None
        dKK = None
        if ctx.needs_input_grad[3]:
            total = torch.einsum("bthd,bthe->bhde", y, z)  # Σ_t y_t z_tᵀ
            dKK = (-0.5 * (total + total.transpose(-1, -2))).to(KK_dt)
        return dq, dk, dlam, dKK, None, None, None, None


def rls_precision(q: torch.Tensor, k: torch.Tensor, lam_h: torch.Tensor, KK: torch.Tensor, chunk: int,
                  out_dtype: torch.dtype = torch.float32, check: bool = False):
    """z_t = (KK_0 + Σ_{i≤t} k_i k_iᵀ + λI)^{-1} q_t, ``[B, T, H, dk]`` solved in fp32 and returned in
    ``out_dtype``, differentiable in q, k, λ ``[H]`` and ``KK [B, H, dk, dk]`` (k zero at pads). The solve's
    factors are kept only when a backward will run. With ``check``, returns ``(z, ρ)``: ρ ``[B, H, N]`` the
    relative residual of the fp32 solve (before z is rounded to ``out_dtype``) at every chunk's last position
    (``chunk_end_residual``)."""
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, lam_h, KK))
    z, rho = RLSPrecisionFunction.apply(q, k, lam_h, KK, chunk, keep, out_dtype, check)
    return (z, rho) if check else z
