"""Triton kernels for VLA's precision scan: the write directions α̂_t of every token, and their gradients.

Per head (seed 000, Algorithm 1; û and k̂ normalised by the caller, û = 0 at pads):

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: largest head dim (A is held whole in registers)
MAX_HEAD_DIM = 128
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
def _square(D: tl.constexpr, BD: tl.constexpr):
    """Index vector, its mask, the D x D mask and row-major offsets, and the identity, of a BD tile."""
    o = tl.arange(0, BD)
    m = o < D
    m2 = m[:, None] & m[None, :]
    return o, m, m2, o[:, None] * D + o[None, :], tl.where((o[:, None] == o[None, :]) & m2, 1.0, 0.0)


@triton.jit
def _scan_fwd_kernel(
    k, u, flags, A0, alpha, rnorm, zbuf, dbuf, A_out, ckpt, T, eta, eps,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, CK: tl.constexpr, SAVE: tl.constexpr,
):
    """Token by token; the next token's inputs are loaded while this one is computed. A k̂ and A û come
    from one pass over A: the post-update a = A k̂ - z (z·k̂)/δ + f η k̂. With SAVE, z and δ of every
    token (and checkpoints of A) are kept for the backward."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    eps = tl.cast(eps, tl.float32)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    NC = tl.cdiv(T, CK)
    o, m, m2, p2, eye = _square(D, BD)
    A = tl.load(A0 + (i_b * H + i_h) * D * D + p2, mask=m2, other=0.0)
    n_k, n_u, n_f = _load_token(k, u, flags, i_b, i_h, 0, T, H, D, BD)
    for t in range(0, T):
        b_k, b_u, f = n_k, n_u, n_f.to(tl.float32) * eta
        n_k, n_u, n_f = _load_token(k, u, flags, i_b, i_h, tl.minimum(t + 1, T - 1), T, H, D, BD)
        if SAVE and t % CK == 0:
            tl.store(ckpt + ((i_b * NC + t // CK) * H + i_h) * D * D + p2, A, mask=m2)
        z = tl.sum(A * b_u[None, :], 1)
        Ak = tl.sum(A * b_k[None, :], 1)
        delta = tl.maximum(1.0 + tl.sum(b_u * z, 0), eps)
        a = Ak - z * (tl.sum(z * b_k, 0) / delta) + f * b_k
        A = A - z[:, None] * z[None, :] / delta + f * eye
        r = 1.0 / tl.maximum(tl.sqrt(tl.sum(a * a, 0)), 1e-12)
        row = (i_b * T + t) * H + i_h
        tl.store(alpha + row * D + o, a * r, mask=m)
        tl.store(rnorm + row, r)
        if SAVE:
            tl.store(zbuf + row * D + o, z, mask=m)
            tl.store(dbuf + row, delta)
    tl.store(A_out + (i_b * H + i_h) * D * D + p2, A, mask=m2)


@triton.jit
def _scan_bwd_gs_kernel(
    k, u, alpha, rnorm, dalpha, zbuf, dbuf, dA_end, ga_out, gz_out, gd_out, dA0, T,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, USE_DA: tl.constexpr,
):
    """Backward, part 1 (reverse order, needs no A): the gradient of A held symmetrised, gS = gA + gAᵀ.
    Per token: ga (through α̂ = a/|a|), and back through A' = A_prev - z zᵀ/δ, δ = 1 + û·z, z = A_prev û:
    gδ = zᵀ gS z / (2δ²), gz = -gS z / δ + gδ û; then gS += ga k̂ᵀ + k̂ gaᵀ + gz ûᵀ + û gzᵀ.
    Writes ga, gz and gδ for part 2, and dA0 = gS / 2."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o = tl.arange(0, BD)
    m = o < D
    m2 = m[:, None] & m[None, :]
    p2 = o[:, None] * D + o[None, :]
    pt = o[None, :] * D + o[:, None]  # the transposed view of the same D x D block
    base = (i_b * H + i_h) * D * D
    gS = tl.zeros([BD, BD], dtype=tl.float32)
    if USE_DA:
        gS += tl.load(dA_end + base + p2, mask=m2, other=0.0) + tl.load(dA_end + base + pt, mask=m2, other=0.0)
    for tt in range(0, T):
        t = T - 1 - tt
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
        tl.store(ga_out + row * D + o, ga, mask=m)
        tl.store(gz_out + row * D + o, gz, mask=m)
        tl.store(gd_out + row, gdelta)
    tl.store(dA0 + base + p2, 0.5 * gS, mask=m2)


@triton.jit
def _scan_bwd_a_kernel(
    flags, zbuf, dbuf, A_end, ckpt, dk, du, gd, T, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, CK: tl.constexpr,
):
    """Backward, part 2 (reverse order, needs no gS): A rebuilt token by token with the exact inverse
    of the downdate, A_prev = A' + z zᵀ/δ (A' = A - f η I), reset from the checkpoints. In place:
    dk̂ = A ga (dk holds ga), dû = A_prev gz + gδ z (du holds gz)."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    NC = tl.cdiv(T, CK)
    o, m, m2, p2, eye = _square(D, BD)
    A = tl.load(A_end + (i_b * H + i_h) * D * D + p2, mask=m2, other=0.0)
    for tt in range(0, T):
        t = T - 1 - tt
        if (t + 1) % CK == 0 and t + 1 < T:  # A after token t is the next segment's checkpoint
            A = tl.load(ckpt + ((i_b * NC + (t + 1) // CK) * H + i_h) * D * D + p2, mask=m2, other=0.0)
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
        A = A - f * eye + z[:, None] * z[None, :] / delta


#: num_warps of the scan kernels by head dim (measured on an H100, see BENCHMARKS.md)
WARPS = {32: 4, 64: 8, 128: 8}


def _launch_opts(D: int, device) -> dict:
    if device.type == "cpu":  # the interpreter
        return {}
    return {"num_warps": WARPS[max(32, triton.next_power_of_2(D))]}


class VLAScanFunction(torch.autograd.Function):
    """α̂ ``[B, T, H, dk]`` and the final A from k̂, û ``[B, T, H, dk]``, refresh flags ``[B, T]`` and
    the initial A ``[B, H, dk, dk]`` (symmetric, fp32). Differentiable in k̂, û and A0."""

    @staticmethod
    def forward(ctx, k_hat, u_hat, flags, A0, eta: float, eps: float):
        B, T, H, D = k_hat.shape
        dev = k_hat.device
        BD = triton.next_power_of_2(D)
        save = any(ctx.needs_input_grad[i] for i in (0, 1, 3))
        k_hat, u_hat = k_hat.contiguous(), u_hat.contiguous()
        flags = flags.to(torch.float32).contiguous()
        A0 = A0.to(torch.float32).contiguous()
        f32 = torch.float32
        alpha = torch.empty(B, T, H, D, device=dev, dtype=f32)
        rnorm = torch.empty(B, T, H, device=dev, dtype=f32)
        A_end = torch.empty(B, H, D, D, device=dev, dtype=f32)
        if save:
            zbuf, dbuf = torch.empty_like(alpha), torch.empty_like(rnorm)
            ckpt = torch.empty(B, triton.cdiv(T, CKPT), H, D, D, device=dev, dtype=f32)
        else:
            zbuf = dbuf = ckpt = alpha
        _scan_fwd_kernel[(B, H)](k_hat, u_hat, flags, A0, alpha, rnorm, zbuf, dbuf, A_end, ckpt, T, float(eta),
                                 float(eps), H=H, D=D, BD=BD, CK=CKPT, SAVE=save, **_launch_opts(D, dev))
        if save:
            ctx.save_for_backward(k_hat, u_hat, flags, alpha, rnorm, zbuf, dbuf, A_end, ckpt)
        ctx.eta = float(eta)
        ctx.dtypes = (k_hat.dtype, u_hat.dtype, A0.dtype)
        return alpha, A_end

    @staticmethod
    def backward(ctx, dalpha, dA_end):
        k_hat, u_hat, flags, alpha, rnorm, zbuf, dbuf, A_end, ckpt = ctx.saved_tensors
        B, T, H, D = k_hat.shape
        dev = k_hat.device
        BD = triton.next_power_of_2(D)
        f32 = torch.float32
        dalpha = torch.zeros_like(alpha) if dalpha is None else dalpha.to(f32).contiguous()
        dk, du = torch.empty_like(alpha), torch.empty_like(alpha)
        gd = torch.empty_like(rnorm)
        dA0 = torch.empty(B, H, D, D, device=dev, dtype=f32)
        use_da = dA_end is not None
        _scan_bwd_gs_kernel[(B, H)](
            k_hat, u_hat, alpha, rnorm, dalpha, zbuf, dbuf, dA_end.to(f32).contiguous() if use_da else A_end,
            dk, du, gd, dA0, T, H=H, D=D, BD=BD, USE_DA=use_da, **_launch_opts(D, dev))
        _scan_bwd_a_kernel[(B, H)](flags, zbuf, dbuf, A_end, ckpt, dk, du, gd, T, ctx.eta,
                                   H=H, D=D, BD=BD, CK=CKPT, **_launch_opts(D, dev))
        k_dt, u_dt, a_dt = ctx.dtypes
        return dk.to(k_dt), du.to(u_dt), None, dA0.to(a_dt), None, None


def vla_scan(k_hat, u_hat, flags, A0, *, eta: float, eps: float = 1e-4):
    """``(α̂ [B, T, H, dk] fp32, final A [B, H, dk, dk] fp32)``: see ``VLAScanFunction``."""
    D = k_hat.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"vla_scan: head dims up to {MAX_HEAD_DIM} (A is held in registers), got {D}")
    return VLAScanFunction.apply(k_hat, u_hat, flags, A0, eta, eps)
