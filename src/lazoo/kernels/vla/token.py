"""Triton kernels for VLA's precision scan: the write directions α̂_t of every token, and their gradients.

Per head (the VLA paper, Algorithm 1; û and k̂ normalised by the caller, û = 0 at pads):

    z = A û;  δ = 1 + û·z;  A ← A - z zᵀ / δ;  if refresh_t: A ← A + ηI;  a = A k̂;  α̂ = a / |a|

A depends only on the û, so this scan is the only part of VLA that must run token by token; the S
update then runs as the generalised delta rule (``lazoo.kernels.delta.chunk_generalized_delta_rule``).

Kernels: ``_scan_fwd_kernel`` (one program per sample and head, A ``[dk, dk]`` in fp32 registers; for
training it also keeps z = A_prev û and δ of every token, and every ``CKPT`` tokens a checkpoint of A).
The backward is two reverse passes that each hold one dk x dk matrix (both at once spill registers):
``_scan_bwd_gs_kernel`` carries the gradient of A, kept symmetrised as gS = gA + gAᵀ (A is symmetric,
so that is all the rule needs; the initial A gets gS / 2), and needs no A since z and δ are saved;
``_scan_bwd_a_kernel`` rebuilds A token by token with the exact inverse of the Sherman–Morrison
downdate, A_prev = A - f ηI + z zᵀ/δ, reset from the checkpoint at every segment boundary (rounding
never accumulates over more than ``CKPT`` tokens), and applies it to the gradients.

Pieces: every kernel runs on a grid (B, H, N), program n taking the tokens of piece n. With N > 1 (where B·H
programs leave the GPU idle, ``time_pieces``) each piece's start A comes from ``lazoo.kernels.vla.split``, and the
backward runs the gradient-of-A pass twice (see ``VLAScanFunction``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..limits import VLA_MAX_HEAD_DIM as MAX_HEAD_DIM

#: tokens between checkpoints of A (memory: B·H·T/CKPT·dk² fp32)
CKPT = 256


@triton.jit
def _load_token(k, u, flags, i_b, i_h, t, T, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """(k̂, û, refresh flag) of token t of sample i_b, head i_h."""
    o = tl.arange(0, BD)
    row = (i_b * T + t) * H + i_h
    b_k = tl.load(k + row * D + o, mask=o < D, other=0.0).to(tl.float32)
    b_u = tl.load(u + row * D + o, mask=o < D, other=0.0).to(tl.float32)
    return b_k, b_u, tl.load(flags + i_b * T + t)


@triton.jit
def _piece(T, L, H: tl.constexpr):
    """Grid (B, H, N): sample, head, the row of [B, N, H] per-piece tensors, and the piece's tokens [start, end)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    start = i_n * L
    return i_b, i_h, (i_b * tl.num_programs(2) + i_n) * H + i_h, start, tl.minimum(start + L, T)


@triton.jit
def _store_square(ptr, A, t, D: tl.constexpr, BD: tl.constexpr):
    """Store the D x D tile A. Its offsets are made from the loop's t so that they are computed here, not kept
    in registers through the whole scan (64 of them a thread at d = 128 and 8 warps)."""
    o = tl.arange(0, BD) + (t - t)
    tl.store(ptr + o[:, None] * D + o[None, :], A, mask=(o < D)[:, None] & (o < D)[None, :])


@triton.jit
def _load_square(ptr, t, D: tl.constexpr, BD: tl.constexpr):
    """Load a D x D tile (see _store_square for t)."""
    o = tl.arange(0, BD) + (t - t)
    return tl.load(ptr + o[:, None] * D + o[None, :], mask=(o < D)[:, None] & (o < D)[None, :], other=0.0)


@triton.jit
def _identity(f, t, D: tl.constexpr, BD: tl.constexpr):
    """f I as a BD x BD tile (see _store_square for t)."""
    o = tl.arange(0, BD) + (t - t)
    return tl.where((o[:, None] == o[None, :]) & (o < D)[:, None], f, 0.0)


@triton.jit
def _scan_fwd_kernel(
    k, u, flags, A0, alpha, rnorm, zbuf, dbuf, A_out, ckpt, T, L, eta, eps,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, CK: tl.constexpr, SAVE: tl.constexpr,
):
    """Token by token through piece i_n (tokens [i_n·L, (i_n+1)·L)) from its start A ``A0 [B, N, H, D, D]``;
    the next token's inputs are loaded while this one is computed. A k̂ and A û come from one pass over A:
    the post-update a = A k̂ - z (z·k̂)/δ + f η k̂. With SAVE, z and δ of every token (and checkpoints of A)
    are kept for the backward. Writes the piece's end A."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    eps = tl.cast(eps, tl.float32)
    i_b, i_h, piece, start, end = _piece(T, L, H)
    NC = tl.cdiv(T, CK)
    o = tl.arange(0, BD)
    m = o < D
    A = _load_square(A0 + piece * D * D, start, D, BD)
    n_k, n_u, n_f = _load_token(k, u, flags, i_b, i_h, start, T, H, D, BD)
    for t in range(start, end):
        b_k, b_u, f = n_k, n_u, n_f.to(tl.float32) * eta
        n_k, n_u, n_f = _load_token(k, u, flags, i_b, i_h, tl.minimum(t + 1, end - 1), T, H, D, BD)
        if SAVE and t % CK == 0:
            _store_square(ckpt + ((i_b * NC + t // CK) * H + i_h) * D * D, A, t, D, BD)
        z = tl.sum(A * b_u[None, :], 1)
        Ak = tl.sum(A * b_k[None, :], 1)
        delta = tl.maximum(1.0 + tl.sum(b_u * z, 0), eps)
        a = Ak - z * (tl.sum(z * b_k, 0) / delta) + f * b_k
        A = A - z[:, None] * z[None, :] / delta
        if f != 0:  # the refresh, every few tokens: its identity tile lives only here
            A += _identity(f, t, D, BD)
        r = 1.0 / tl.maximum(tl.sqrt(tl.sum(a * a, 0)), 1e-12)
        row = (i_b * T + t) * H + i_h
        tl.store(alpha + row * D + o, a * r, mask=m)
        tl.store(rnorm + row, r)
        if SAVE:
            tl.store(zbuf + row * D + o, z, mask=m)
            tl.store(dbuf + row, delta)
    _store_square(A_out + piece * D * D, A, end, D, BD)


@triton.jit
def _scan_bwd_gs_kernel(
    k, u, alpha, rnorm, dalpha, zbuf, dbuf, dA_end, ga_out, gz_out, gd_out, dA0, T, L,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, STORE: tl.constexpr,
):
    """Backward, part 1 (reverse order, needs no A): the gradient of A held symmetrised, gS = gA + gAᵀ.
    Per token: ga (through α̂ = a/|a|), and back through A' = A_prev - z zᵀ/δ, δ = 1 + û·z, z = A_prev û:
    gδ = zᵀ gS z / (2δ²), gz = -gS z / δ + gδ û; then gS += ga k̂ᵀ + k̂ gaᵀ + gz ûᵀ + û gzᵀ.
    Writes ga, gz and gδ for part 2 (with STORE), and dA0 = gS / 2; per piece (grid (B, H, N)), dA_end and dA0
    being the piece's."""
    i_b, i_h, piece, start, end = _piece(T, L, H)
    o = tl.arange(0, BD)
    m = o < D
    m2 = m[:, None] & m[None, :]
    p2 = o[:, None] * D + o[None, :]
    pt = o[None, :] * D + o[:, None]  # the transposed view of the same D x D block
    base = piece * D * D
    # the end gradient (zeros where the output's A is not used) symmetrised
    gS = tl.load(dA_end + base + p2, mask=m2, other=0.0) + tl.load(dA_end + base + pt, mask=m2, other=0.0)
    for tt in range(start, end):
        t = start + end - 1 - tt
        row = (i_b * T + t) * H + i_h
        b_k = tl.load(k + row * D + o, mask=m, other=0.0).to(tl.float32)
        b_u = tl.load(u + row * D + o, mask=m, other=0.0).to(tl.float32)
        b_al = tl.load(alpha + row * D + o, mask=m, other=0.0)
        b_dal = tl.load(dalpha + row * D + o, mask=m, other=0.0).to(tl.float32)
        z = tl.load(zbuf + row * D + o, mask=m, other=0.0)
        delta = tl.load(dbuf + row)
        ga = (b_dal - b_al * tl.sum(b_al * b_dal, 0)) * tl.load(rnorm + row)
        # gS here is the gradient of A after token t; its α̂ terms (ga k̂ᵀ + k̂ gaᵀ) enter gS z directly
        gSz = tl.sum(gS * z[None, :], 1) + ga * tl.sum(b_k * z, 0) + b_k * tl.sum(ga * z, 0)
        gdelta = 0.5 * tl.sum(z * gSz, 0) / (delta * delta)
        gz = -gSz / delta + gdelta * b_u
        gS += ga[:, None] * b_k[None, :] + b_k[:, None] * ga[None, :] \
            + gz[:, None] * b_u[None, :] + b_u[:, None] * gz[None, :]
        if STORE:
            tl.store(ga_out + row * D + o, ga, mask=m)
            tl.store(gz_out + row * D + o, gz, mask=m)
            tl.store(gd_out + row, gdelta)
    _store_square(dA0 + base, 0.5 * gS, end, D, BD)


@triton.jit
def _scan_bwd_a_kernel(
    flags, zbuf, dbuf, A_end, ckpt, dk, du, gd, T, L, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, CK: tl.constexpr,
):
    """Backward, part 2 (reverse order, needs no gS): A rebuilt token by token with the exact inverse
    of the downdate, A_prev = A' + z zᵀ/δ (A' = A - f η I), reset from the checkpoints. In place:
    dk̂ = A ga (dk holds ga), dû = A_prev gz + gδ z (du holds gz). Per piece (grid (B, H, N)), from its end A."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_b, i_h, piece, start, end = _piece(T, L, H)
    NC = tl.cdiv(T, CK)
    o = tl.arange(0, BD)
    m = o < D
    A = _load_square(A_end + piece * D * D, start, D, BD)
    for tt in range(start, end):
        t = start + end - 1 - tt
        if (t + 1) % CK == 0 and t + 1 < end:  # A after token t is the next segment's checkpoint
            A = _load_square(ckpt + ((i_b * NC + (t + 1) // CK) * H + i_h) * D * D, t, D, BD)
        row = (i_b * T + t) * H + i_h
        ga = tl.load(dk + row * D + o, mask=m, other=0.0)
        gz = tl.load(du + row * D + o, mask=m, other=0.0)
        z = tl.load(zbuf + row * D + o, mask=m, other=0.0)
        delta = tl.load(dbuf + row)
        f = tl.load(flags + i_b * T + t).to(tl.float32) * eta
        tl.store(dk + row * D + o, tl.sum(A * ga[None, :], 1), mask=m)
        Agz = tl.sum(A * gz[None, :], 1)
        dz = Agz - f * gz + z * (tl.sum(z * gz, 0) / delta) + tl.load(gd + row) * z
        tl.store(du + row * D + o, dz, mask=m)
        A = A + z[:, None] * z[None, :] / delta
        if f != 0:
            A -= _identity(f, t, D, BD)


#: num_warps of the scan kernels by head dim (measured on an H100, see docs/changelog.md)
WARPS = {32: 4, 64: 8, 128: 8}
#: the scan splits time into pieces (``lazoo.kernels.vla.split``) until B·H·pieces reaches this many programs a
#: streaming multiprocessor; a piece is a whole number of checkpoint segments
PROGRAMS_PER_SM = 1


#: a register cap for the scan kernels (None: the compiler's choice, all 255 at d = 128, one program an SM)
MAXNREG = None


def _launch_opts(D: int, device) -> dict:
    if device.type == "cpu":  # the interpreter
        return {}
    return {"num_warps": WARPS[max(32, triton.next_power_of_2(D))], **({"maxnreg": MAXNREG} if MAXNREG else {})}


def time_pieces(B: int, H: int, T: int, device) -> int:
    """How many pieces the scan of ``[B, T, H]`` splits time into: 1 where B·H programs fill the GPU (and on the
    CPU), else as many as one wave of PROGRAMS_PER_SM programs an SM holds (a second, part-filled wave would take
    as long as the first), each piece at least CKPT tokens."""
    if device.type != "cuda":
        return 1
    programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(programs // (B * H), T // CKPT))


def _piece_length(T: int, pieces: int) -> int:
    """Tokens a piece: T for one piece, else a multiple of CKPT (the backward rebuilds A from the checkpoints)."""
    if pieces <= 1:
        return max(T, 1)
    return triton.cdiv(triton.cdiv(T, pieces), CKPT) * CKPT


class VLAScanFunction(torch.autograd.Function):
    """α̂ ``[B, T, H, dk]`` and the final A from k̂, û ``[B, T, H, dk]``, refresh flags ``[B, T]`` and
    the initial A ``[B, H, dk, dk]`` (symmetric, fp32). Differentiable in k̂, û and A0.

    With more than one piece, the start A of every piece comes from ``lazoo.kernels.vla.split`` and the pieces
    run at once; the backward then runs the gradient-of-A pass twice: first each piece from a zero end gradient
    (its own part h_n of its start's gradient), then, after the chain's adjoint has given every piece's end
    gradient g_{n+1}, for real."""

    @staticmethod
    def forward(ctx, k_hat, u_hat, flags, A0, eta: float, eps: float, pieces: int):
        from . import split

        B, T, H, D = k_hat.shape
        dev = k_hat.device
        BD = triton.next_power_of_2(D)
        L = _piece_length(T, pieces)
        N = triton.cdiv(T, L)
        save = any(ctx.needs_input_grad[i] for i in (0, 1, 3))
        k_hat, u_hat = k_hat.contiguous(), u_hat.contiguous()
        flags = flags.to(torch.float32).contiguous()
        A0 = A0.to(torch.float32).contiguous()
        f32 = torch.float32
        Ls = Rs = None
        if N > 1:
            maps = split.piece_maps(u_hat, flags, L, eta, pieces=N - 1)  # the last one leads nowhere
            starts, Ls, Rs = split.chain_starts(maps, A0, with_jacobians=save)
        else:
            starts = A0[:, None]
        alpha = torch.empty(B, T, H, D, device=dev, dtype=f32)
        rnorm = torch.empty(B, T, H, device=dev, dtype=f32)
        A_ends = torch.empty(B, N, H, D, D, device=dev, dtype=f32)
        if save:
            zbuf, dbuf = torch.empty_like(alpha), torch.empty_like(rnorm)
            ckpt = torch.empty(B, triton.cdiv(T, CKPT), H, D, D, device=dev, dtype=f32)
        else:
            zbuf = dbuf = ckpt = alpha
        _scan_fwd_kernel[(B, H, N)](k_hat, u_hat, flags, starts.contiguous(), alpha, rnorm, zbuf, dbuf, A_ends,
                                    ckpt, T, L, float(eta), float(eps), H=H, D=D, BD=BD, CK=CKPT, SAVE=save,
                                    **_launch_opts(D, dev))
        if save:
            ctx.save_for_backward(k_hat, u_hat, flags, alpha, rnorm, zbuf, dbuf, A_ends, ckpt,
                                  *((Ls, Rs) if N > 1 else ()))
        ctx.eta, ctx.L = float(eta), L
        ctx.dtypes = (k_hat.dtype, u_hat.dtype, A0.dtype)
        return alpha, A_ends[:, -1]

    @staticmethod
    def backward(ctx, dalpha, dA_end):
        from . import split

        k_hat, u_hat, flags, alpha, rnorm, zbuf, dbuf, A_ends, ckpt, *jac = ctx.saved_tensors
        B, T, H, D = k_hat.shape
        N = A_ends.shape[1]
        dev = k_hat.device
        BD = triton.next_power_of_2(D)
        f32 = torch.float32
        dalpha = torch.zeros_like(alpha) if dalpha is None else dalpha.to(f32).contiguous()
        dk, du = torch.empty_like(alpha), torch.empty_like(alpha)
        gd = torch.empty_like(rnorm)
        dA0 = torch.empty(B, N, H, D, D, device=dev, dtype=f32)
        ends = torch.zeros_like(A_ends)  # the end gradient of every piece
        if dA_end is not None:
            ends[:, -1] = dA_end.to(f32)
        opts = dict(H=H, D=D, BD=BD, **_launch_opts(D, dev))
        grid = (B, H, N)
        if N > 1:  # each piece's own gradient of its start A, then the chain's adjoint gives the true ends
            _scan_bwd_gs_kernel[grid](k_hat, u_hat, alpha, rnorm, dalpha, zbuf, dbuf, ends, dk, du, gd, dA0, T,
                                      ctx.L, STORE=False, **opts)
            ends[:, :-1] = split.chain_adjoint(dA0, *jac)[:, 1:]
        _scan_bwd_gs_kernel[grid](k_hat, u_hat, alpha, rnorm, dalpha, zbuf, dbuf, ends, dk, du, gd, dA0, T, ctx.L,
                                  STORE=True, **opts)
        _scan_bwd_a_kernel[grid](flags, zbuf, dbuf, A_ends, ckpt, dk, du, gd, T, ctx.L, ctx.eta,
                                 H=H, D=D, BD=BD, CK=CKPT, **_launch_opts(D, dev))
        k_dt, u_dt, a_dt = ctx.dtypes
        return dk.to(k_dt), du.to(u_dt), None, dA0[:, 0].to(a_dt), None, None, None


def vla_scan(k_hat, u_hat, flags, A0, *, eta: float, eps: float = 1e-4, pieces: int | None = None):
    """``(α̂ [B, T, H, dk] fp32, final A [B, H, dk, dk] fp32)``: see ``VLAScanFunction``. ``pieces``: how many
    pieces time is split into (default ``time_pieces``: one unless B·H programs leave the GPU idle)."""
    B, T, H, D = k_hat.shape
    if D > MAX_HEAD_DIM:
        raise ValueError(f"vla_scan: head dims up to {MAX_HEAD_DIM} (A is held in registers), got {D}")
    pieces = time_pieces(B, H, T, k_hat.device) if pieces is None else int(pieces)
    if pieces < 1:
        raise ValueError(f"vla_scan: pieces must be >= 1, got {pieces}")
    return VLAScanFunction.apply(k_hat, u_hat, flags, A0, eta, eps, pieces)
