"""The block algebra of the chunked VLA scan (``lazoo.kernels.vla.chunk``): a block's tokens and flags, its rows of a
[B, T, H, D] tensor, its segments (they end at the refresh flags: the +ηI refresh cannot enter the Woodbury form),
and the LDLᵀ of a segment's C × C matrix G = I + U A Uᵀ."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seg_end(fl, r, s0, BC: tl.constexpr):
    """Last position of the segment that starts at s0: the first flagged position >= s0, else the block end."""
    return tl.min(tl.where((fl != 0) & (r >= s0), r, BC - 1), 0)


@triton.jit
def seg_start(fl, r, e):
    """First position of the segment that ends at e: one after the last flagged position < e, else 0."""
    return tl.max(tl.where((fl != 0) & (r < e), r, -1), 0) + 1


@triton.jit
def ldl_inverse(G, r, BC: tl.constexpr, PREC: tl.constexpr):
    """N = L⁻¹ and D of G = L D Lᵀ (L unit lower; G is SPD, here G >= I).

    Right-looking and symmetric: step i takes column i of the Schur complement (pivot d_i, column
    l = g / d_i below it) and removes d_i l lᵀ; two reductions a step. Then L = I + L_o with L_o strictly
    lower, so nilpotent, and L⁻¹ = (I - L_o)(I + L_o²)(I + L_o⁴)... exactly, by log2(BC) - 1 squarings."""
    Sc = G
    Lo = tl.zeros([BC, BC], dtype=tl.float32)
    Dv = tl.full([BC], 1.0, dtype=tl.float32)
    for i in range(BC):
        g = tl.sum(tl.where(r[None, :] == i, Sc, 0.0), 1)  # column i (rows < i are stale and unused)
        d = tl.sum(tl.where(r == i, g, 0.0), 0)
        col = tl.where(r > i, g / d, 0.0)
        Sc = Sc - (col * d)[:, None] * col[None, :]
        Lo = tl.where(r[None, :] == i, col[:, None], Lo)
        Dv = tl.where(r == i, d, Dv)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    N = eye - Lo
    P = Lo
    for m in tl.static_range(5):  # BC <= 64
        if (2 << m) < BC:  # P = L_o^(2^(m+1)) is still nonzero
            P = tl.dot(P, P, input_precision=PREC)
            N = N + tl.dot(N, P, input_precision=PREC)
    return N, Dv


@triton.jit
def block_start(flags, i_b, j, T, BC: tl.constexpr):
    """Block j of sample i_b: its rows r, their token positions, which are real (< T), and their refresh flags."""
    r = tl.arange(0, BC)
    pos = j * BC + r
    valid = pos < T
    return r, pos, valid, tl.load(flags + i_b * T + pos, mask=valid, other=0.0)


@triton.jit
def rows(ptr, i_b, i_h, pos, rmask, T, H: tl.constexpr, D: tl.constexpr, od):
    """Rows ``pos`` (tokens of sample i_b, head i_h) of a [B, T, H, D] tensor at columns ``od``, fp32, 0 outside
    rmask and past D."""
    offs = ((i_b * T + pos) * H + i_h)[:, None] * D + od[None, :]
    return tl.load(ptr + offs, mask=rmask[:, None] & (od < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, x, i_b, i_h, pos, rmask, T, H: tl.constexpr, D: tl.constexpr, od):
    """Store x as rows ``pos`` at columns ``od`` of a [B, T, H, D] tensor (rows in rmask, columns below D)."""
    offs = ((i_b * T + pos) * H + i_h)[:, None] * D + od[None, :]
    tl.store(ptr + offs, x, mask=rmask[:, None] & (od < D)[None, :])
