"""VLA's precision scan split in time: the A at the start of every piece of the sequence without running the scan
through the pieces before it, so that the token scan (``lazoo.kernels.vla.token``) can run all pieces at once.

One token of the scan, A ← A - A û ûᵀ A / (1 + ûᵀ A û), is A ← (A⁻¹ + û ûᵀ)⁻¹, and the refresh is
A ← A + ηI.
Both are linear fractional maps of A: with A = X Y⁻¹,

    token:    [X; Y] ← [[I, 0], [û ûᵀ, I]] [X; Y]       (Y ← Y + û (ûᵀ X))
    refresh:  [X; Y] ← [[I, ηI], [0, I]] [X; Y]         (X ← X + η Y)

so a whole piece is one 2d × 2d matrix [[a, b], [c, d]], built from the identity by these linear steps
(``_piece_map_kernel``, every piece and column block in parallel), and the piece maps A_n to

    A_{n+1} = (a A_n + b)(c A_n + d)⁻¹.

The chain over pieces is the only sequential part: one d × d inverse a piece (``chain_starts``; the inverse is
``_inverse_kernel``'s Newton-Schulz iteration from the previous piece's inverse: pieces alike have inverses alike).
This is exact algebra, the same function as the scan while its clip δ ≥ ε does not bind (δ ≥ 1 while A is
positive definite, as the scan keeps it). The map kernel stores a - I, b, c, d - I: the identity parts are
exact that way, and the small parts that carry the piece keep fp32's relative precision (storing a and d
whole lost it: 1.3e-5 from float64 at T = 8k, d = 128, against 3e-7 this way).

Backward: the chain's Jacobian is two-sided, dA_{n+1} = (a - A_{n+1} c) dA_n (c A_n + d)⁻¹ = L_n dA_n R_n, so
the gradient of A_n is g_n = h_n + sym(L_nᵀ g_{n+1} R_nᵀ) (``chain_adjoint``), h_n the gradient that piece n's
own outputs give its start A.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: most tokens a step of the map kernel takes at once (a segment ends there or at a refresh; tl.dot needs >= 16)
BLOCK = 32
#: columns of the 2d-wide map a program builds (H100, T = 32k, H = 16, d = 128: 4.1 ms at 64 and 8 warps, 8.6 at 32)
COLUMNS = 64
#: num_warps of the map kernel (4: 5.2 ms in the run above)
WARPS = 8
#: tl.dot input precision of the map kernel (GPU); the pieces' maps accumulate over many tokens
PRECISION = "tf32x3"
#: the inverse kernel: num_warps, products' precision, the residual |I - Y R|_F after which one more step ends
#: it, the most steps
INVERSE_WARPS = 8
INVERSE_PRECISION = "tf32x3"
INVERSE_TOL = 1e-3
INVERSE_MAXIT = 100


@triton.jit
def _next_segment(flags, i_b, s, end, T, r, BC: tl.constexpr):
    """(last position, refresh flag there) of the segment that starts at s: up to the first flagged position,
    at most BC tokens, within the piece."""
    pos = s + r
    valid = pos < end
    fl = tl.load(flags + i_b * T + pos, mask=valid, other=0.0)
    e = tl.minimum(tl.min(tl.where((fl != 0) & valid, pos, s + BC - 1), 0), end - 1)
    return e, tl.sum(tl.where(pos == e, fl, 0.0), 0)


@triton.jit
def _segment_rows(u, i_b, i_h, s, e, T, r, col, x_col, H: tl.constexpr, D: tl.constexpr, od):
    """û of tokens s..e as rows ``[BC, BD]``, and their columns ``col`` where the map of X is built (else 0)."""
    pos = s + r
    keep = (pos <= e)[:, None]
    rows = (((i_b * T + pos) * H + i_h) * D)[:, None]
    U = tl.load(u + rows + od[None, :], mask=keep & (od < D)[None, :], other=0.0).to(tl.float32)
    U_id = tl.load(u + rows + col[None, :], mask=keep & (x_col < D)[None, :], other=0.0).to(tl.float32)
    return U, U_id


@triton.jit
def _piece_map_kernel(
    u, flags, maps, T, L, NM, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):
    """Columns [j·BJ, (j+1)·BJ) of one piece's map, deviations from the identity, ``maps [B, NM, H, 2, D, 2, D]``
    (row block 0: X = [a - I, b], 1: Y = [c, d - I]; column block 0: the map of X's identity part, 1: of Y's).
    Grid (B·NM, H, 2·BD/BJ) for the first NM pieces. The piece goes in segments that end at its flagged tokens (or
    after BC tokens): within one, X is fixed, so Y gains Uᵀ (U X) at once."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_bn = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_j = tl.program_id(2)
    i_b, i_n = i_bn // NM, i_bn % NM
    part = (i_j * BJ) // BD  # 0: columns of the map of X, 1: of Y
    col = (i_j * BJ) % BD + tl.arange(0, BJ)
    x_col = tl.where(part == 0, col, D)  # col for the map of X, else none
    od = tl.arange(0, BD)
    r = tl.arange(0, BC)
    ident = tl.where((od[:, None] == col[None, :]) & (col < D)[None, :] & (part == 1), 1.0, 0.0)
    Xd = tl.zeros([BD, BJ], dtype=tl.float32)
    Yd = tl.zeros([BD, BJ], dtype=tl.float32)
    s = (i_n * L).to(tl.int32)
    end = tl.minimum(s + L, T)
    while s < end:
        e, f = _next_segment(flags, i_b, s, end, T, r, BC)
        U, U_id = _segment_rows(u, i_b, i_h, s, e, T, r, col, x_col, H, D, od)
        UX = tl.dot(U, Xd, input_precision=PREC) + U_id
        Yd += tl.dot(tl.trans(U), UX, input_precision=PREC)
        Xd += (f * eta) * (Yd + ident)
        s = e + 1
    base = ((i_b * NM + i_n) * H + i_h) * 2 * D * 2 * D  # [2, D, 2, D] per piece and head
    offs = od[:, None] * (2 * D) + part * D + col[None, :]
    keep = (od < D)[:, None] & (col < D)[None, :]
    tl.store(maps + base + offs, Xd, mask=keep)
    tl.store(maps + base + D * 2 * D + offs, Yd, mask=keep)


def piece_maps(u_hat: torch.Tensor, flags: torch.Tensor, L: int, eta: float, pieces: int | None = None):
    """``[B, N, H, 2, D, 2, D]`` fp32: the deviations (a - I, b; c, d - I) of the first ``pieces`` pieces of L
    tokens (default all; the chain needs all but the last). ``u_hat [B, T, H, D]`` (0 at pads), ``flags [B, T]``
    fp32 (1 where the refresh follows the token)."""
    B, T, H, D = u_hat.shape
    N = triton.cdiv(T, L) if pieces is None else pieces
    BD = max(16, triton.next_power_of_2(D))
    BJ = min(COLUMNS, BD)
    maps = torch.empty(B, N, H, 2, D, 2, D, device=u_hat.device, dtype=torch.float32)
    interp = u_hat.device.type == "cpu"
    if N == 0:
        return maps
    _piece_map_kernel[(B * N, H, 2 * BD // BJ)](
        u_hat.contiguous(), flags.contiguous(), maps, T, L, N, float(eta), H=H, D=D, BD=BD, BJ=BJ, BC=BLOCK,
        PREC="ieee" if interp else PRECISION, **({} if interp else {"num_warps": WARPS}))
    return maps


@triton.jit
def _matmul(pa, pb, o, D: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """The BD x BD product of two row-major D x D matrices in memory, 32 of the inner dim at a time: whole
    128 x 128 operands spill registers."""
    acc = tl.zeros([BD, BD], dtype=tl.float32)
    for kk in tl.static_range(0, BD, 32):
        kc = kk + tl.arange(0, 32)
        x = tl.load(pa + o[:, None] * D + kc[None, :], mask=(o < D)[:, None] & (kc < D)[None, :], other=0.0)
        y = tl.load(pb + kc[:, None] * D + o[None, :], mask=(kc < D)[:, None] & (o < D)[None, :], other=0.0)
        acc += tl.dot(x, y, input_precision=PREC)
    return acc


@triton.jit
def _residual(Y, R, E, o, eye, p2, m2, D: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """E = I - Y R, stored; returns |E|_F."""
    Em = eye - _matmul(Y, R, o, D, BD, PREC)
    tl.store(E + p2, Em, mask=m2)
    return tl.sqrt(tl.sum(tl.sum(Em * Em, 1), 0))


@triton.jit
def _inverse_kernel(
    Y, R, E, D: tl.constexpr, BD: tl.constexpr, TOL: tl.constexpr, MAXIT: tl.constexpr, PREC: tl.constexpr,
):
    """R ← Y⁻¹ for one D x D matrix a program, by Newton-Schulz steps R ← R + R E, E = I - Y R (E' = E²), from
    the start in R: a nearby inverse (the previous piece's), or, where its |E|_F ≥ 1/2 (or not finite),
    Yᵀ / (|Y|₁ |Y|_∞), from which the steps converge for any invertible Y. It stops one step after |E|_F < TOL
    (then |E| ~ TOL², at fp32's rounding), or after MAXIT steps. ``E`` is scratch."""
    base = tl.program_id(0).to(tl.int64) * D * D
    Y, R, E = Y + base, R + base, E + base
    o = tl.arange(0, BD)
    m2 = (o < D)[:, None] & (o < D)[None, :]
    p2 = o[:, None] * D + o[None, :]
    eye = tl.where((o[:, None] == o[None, :]) & m2, 1.0, 0.0)
    err = _residual(Y, R, E, o, eye, p2, m2, D, BD, PREC)
    if (err >= 0.5) | (err != err):
        Ya = tl.abs(tl.load(Y + p2, mask=m2, other=0.0))
        scale = tl.max(tl.sum(Ya, 0), 0) * tl.max(tl.sum(Ya, 1), 0)
        tl.store(R + p2, tl.load(Y + o[None, :] * D + o[:, None], mask=m2, other=0.0) / scale, mask=m2)
        tl.debug_barrier()
        err = _residual(Y, R, E, o, eye, p2, m2, D, BD, PREC)
    it = 0
    going = 1
    while going != 0:
        tl.debug_barrier()  # E and R are read back whole
        Rn = tl.load(R + p2, mask=m2, other=0.0) + _matmul(R, E, o, D, BD, PREC)
        tl.debug_barrier()
        tl.store(R + p2, Rn, mask=m2)
        it += 1
        going = ((err >= TOL) & (it < MAXIT)).to(tl.int32)
        if going != 0:
            tl.debug_barrier()
            err = _residual(Y, R, E, o, eye, p2, m2, D, BD, PREC)


def inverse(Y: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """``Y⁻¹`` of a batch ``[..., D, D]`` of invertible matrices, fp32, by ``_inverse_kernel`` (one program a
    matrix) from ``start`` (a nearby inverse, e.g. the previous piece's) or from scratch."""
    D = Y.shape[-1]
    Yc = Y.to(torch.float32).contiguous()
    R = torch.full_like(Yc, float("nan")) if start is None else start.to(torch.float32).contiguous().clone()
    E = torch.empty_like(Yc)
    interp = Y.device.type == "cpu"
    _inverse_kernel[(max(Yc.numel() // (D * D), 1),)](Yc, R, E, D=D, BD=max(32, triton.next_power_of_2(D)),
                                                      TOL=INVERSE_TOL, MAXIT=INVERSE_MAXIT,
                                                      PREC="ieee" if interp else INVERSE_PRECISION,
                                                      **({} if interp else {"num_warps": INVERSE_WARPS}))
    return R


def chain_starts(maps: torch.Tensor, A0: torch.Tensor, with_jacobians: bool):
    """The A at the start of every piece, ``[B, N, H, D, D]`` fp32, from A0 ``[B, H, D, D]`` through the maps of
    the first N - 1 pieces ``maps [B, N - 1, ...]`` (products in float64, one fp32 inverse a piece, refined from
    the previous piece's), and the chain's L_n, R_n ``[B, N-1, H, D, D]`` fp32 (L_n only ``with_jacobians``, else
    None; both None for one piece)."""
    B, N, H, _, D, _, _ = maps.shape
    N += 1
    eye = torch.eye(D, dtype=torch.float64, device=maps.device)
    A = A0.to(torch.float64)
    starts, Ls, Rs = [A], [], []
    for n in range(N - 1):
        m = maps[:, n].to(torch.float64)
        a, b, c, d = m[:, :, 0, :, 0], m[:, :, 0, :, 1], m[:, :, 1, :, 0], m[:, :, 1, :, 1]
        R = inverse(eye + d + c @ A, start=Rs[-1] if Rs else None)  # neighbouring pieces: nearby inverses
        A = (A + a @ A + b) @ R.to(torch.float64)
        A = 0.5 * (A + A.transpose(-1, -2))
        starts.append(A)
        Rs.append(R)
        if with_jacobians:
            Ls.append((eye + a - A @ c).float())
    starts = torch.stack(starts, 1).float()
    Rs = torch.stack(Rs, 1) if Rs else None
    return starts, (torch.stack(Ls, 1) if with_jacobians and Ls else None), Rs


def chain_adjoint(h: torch.Tensor, Ls: torch.Tensor, Rs: torch.Tensor) -> torch.Tensor:
    """``g [B, N, H, D, D]``: the gradient of every piece's start A, g_n = h_n + sym(L_nᵀ g_{n+1} R_nᵀ), from
    ``h`` (each piece's own gradient of its start A, symmetric; the last one also carries the end's)."""
    N = h.shape[1]
    g = [h[:, N - 1].to(torch.float64)]
    for n in range(N - 2, -1, -1):
        x = Ls[:, n].to(torch.float64).transpose(-1, -2) @ g[-1] @ Rs[:, n].to(torch.float64).transpose(-1, -2)
        g.append(h[:, n].to(torch.float64) + 0.5 * (x + x.transpose(-1, -2)))
    return torch.stack(g[::-1], 1).float()
