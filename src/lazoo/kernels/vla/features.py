"""VLA's per-token features and its normaliser as two fused Triton functions. In PyTorch, the elementwise work around
VLA's kernels took about 19 ms of a 72 ms forward + backward at B = 1, T = 32k, H = 16, d = 128 on an H100: one pass
over the data per elementwise op, some 60 of them.

``vla_features(q, k, u, out_dtype, elu, unit_query)`` → ``(k̂, û, k̂ in out_dtype, q_r in out_dtype)``::

    k_f = φ(k);  k̂ = k_f / max(|k_f|, 1e-12);  û = u / max(|u|, 1e-12) / √d
    q_r = φ(q), or q_r = φ(q) / max(|φ(q)|, 1e-12) (``unit_query``)

with φ(x) = elu(x) + 1 (``elu``) or x, the same functions as ``F.elu(x) + 1`` and ``F.normalize`` (whose
gradient is g / 1e-12 where the norm is clamped). k̂ and û come back in fp32 for the A scan, k̂ and q_r again in
``out_dtype`` for the S update.

``vla_normaliser(q, k, z0, mask, eps, elu)`` → ``(den [B, T, H] fp32, z_T [B, H, d] fp32)``::

    z_t = z0 + Σ_{s ≤ t} m_s φ(k_s);   den_t = max(z_t · φ(q_t), ε)

(T is cut in ranges that run at once, each from z0 plus the sums of the ranges before it; a program walks its
range in blocks of BT tokens. The backward walks them in reverse from the z saved at each block start, with the
suffix sums Σ_{t ≥ s} ∂den_t φ(q_t) carried in from the later ranges, so nothing is subtracted back out of z).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: rows (token-heads) a program of the features kernels takes
ROWS = 16
#: tokens a step of the normaliser kernels takes, and their num_warps (d = 128, sm_90: the backward spills 884
#: bytes at 4 warps, none at 8; scripts/kernel_resources.py)
BT = 64
NORMALISER_WARPS = 8
#: F.normalize's floor of the norm
NORM_EPS = 1e-12


@triton.jit
def _phi(x, m, ELU: tl.constexpr):
    """φ(x) (0 outside the mask m) and φ'(x)."""
    if ELU:
        e = tl.exp(tl.minimum(x, 0.0))
        return tl.where(m, tl.where(x > 0, x + 1.0, e), 0.0), tl.where(x > 0, 1.0, e)
    else:
        return tl.where(m, x, 0.0), tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _unit(x, NEPS: tl.constexpr):
    """x / max(|x|, NEPS) by rows, and the rows' norms."""
    n = tl.sqrt(tl.sum(x * x, 1))
    return x / tl.maximum(n, NEPS)[:, None], n


@triton.jit
def _unit_grad(x_hat, n, g, NEPS: tl.constexpr):
    """The gradient through x ↦ x / max(|x|, NEPS) by rows, given x̂ and |x|."""
    return tl.where((n > NEPS)[:, None], (g - x_hat * tl.sum(x_hat * g, 1)[:, None]) / tl.maximum(n, NEPS)[:, None],
                    g / NEPS)


@triton.jit
def _rows(R, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BD)
    m = (r < R)[:, None] & (c < D)[None, :]
    return r[:, None] * D + c[None, :], m


@triton.jit
def _features_fwd_kernel(q, k, u, k_hat, u_hat, k_out, q_out, R, scale_u, D: tl.constexpr, BD: tl.constexpr,
                         ROWS: tl.constexpr, ELU: tl.constexpr, UNIT_Q: tl.constexpr, NEPS: tl.constexpr):
    offs, m = _rows(R, D, BD, ROWS)
    kf, _ = _phi(tl.load(k + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    kh, _ = _unit(kf, NEPS)
    tl.store(k_hat + offs, kh, mask=m)
    tl.store(k_out + offs, kh.to(k_out.dtype.element_ty), mask=m)
    uh, _ = _unit(tl.load(u + offs, mask=m, other=0.0).to(tl.float32), NEPS)
    tl.store(u_hat + offs, uh * scale_u, mask=m)
    qf, _ = _phi(tl.load(q + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    if UNIT_Q:
        qf, _ = _unit(qf, NEPS)
    tl.store(q_out + offs, qf.to(q_out.dtype.element_ty), mask=m)


@triton.jit
def _features_bwd_kernel(q, k, u, g_kh, g_uh, g_kout, g_qout, dq, dk, du, R, scale_u, D: tl.constexpr,
                         BD: tl.constexpr, ROWS: tl.constexpr, ELU: tl.constexpr, UNIT_Q: tl.constexpr,
                         NEPS: tl.constexpr):
    offs, m = _rows(R, D, BD, ROWS)
    kf, dphi = _phi(tl.load(k + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    kh, kn = _unit(kf, NEPS)
    g = tl.load(g_kh + offs, mask=m, other=0.0) + tl.load(g_kout + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dk + offs, _unit_grad(kh, kn, g, NEPS) * dphi, mask=m)
    uh, un = _unit(tl.load(u + offs, mask=m, other=0.0).to(tl.float32), NEPS)
    tl.store(du + offs, _unit_grad(uh, un, tl.load(g_uh + offs, mask=m, other=0.0) * scale_u, NEPS), mask=m)
    qf, dphi = _phi(tl.load(q + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    g = tl.load(g_qout + offs, mask=m, other=0.0).to(tl.float32)
    if UNIT_Q:
        qh, qn = _unit(qf, NEPS)
        g = _unit_grad(qh, qn, g, NEPS)
    tl.store(dq + offs, g * dphi, mask=m)


class VLAFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, u, out_dtype, elu: bool, unit_query: bool):
        q, k, u = q.contiguous(), k.contiguous(), u.contiguous()
        D = q.shape[-1]
        R = q.numel() // D
        k_hat = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        u_hat = torch.empty_like(k_hat)
        k_out = torch.empty(q.shape, device=q.device, dtype=out_dtype)
        q_out = torch.empty_like(k_out)
        ctx.opts = dict(D=D, BD=triton.next_power_of_2(D), ROWS=ROWS, ELU=elu, UNIT_Q=unit_query, NEPS=NORM_EPS)
        ctx.scale_u = 1.0 / math.sqrt(D)
        if R:
            _features_fwd_kernel[(triton.cdiv(R, ROWS),)](q, k, u, k_hat, u_hat, k_out, q_out, R, ctx.scale_u,
                                                          **ctx.opts)
        ctx.save_for_backward(q, k, u)
        return k_hat, u_hat, k_out, q_out

    @staticmethod
    def backward(ctx, g_kh, g_uh, g_kout, g_qout):
        q, k, u = ctx.saved_tensors
        R = q.numel() // q.shape[-1]

        def grad(g, dtype):
            return torch.zeros(q.shape, device=q.device, dtype=dtype) if g is None else g.to(dtype).contiguous()

        g_kh, g_uh = grad(g_kh, torch.float32), grad(g_uh, torch.float32)
        g_kout, g_qout = grad(g_kout, torch.float32), grad(g_qout, torch.float32)
        dq, dk, du = (torch.empty(q.shape, device=q.device, dtype=torch.float32) for _ in range(3))
        if R:
            _features_bwd_kernel[(triton.cdiv(R, ROWS),)](q, k, u, g_kh, g_uh, g_kout, g_qout, dq, dk, du, R,
                                                          ctx.scale_u, **ctx.opts)
        return dq.to(q.dtype), dk.to(k.dtype), du.to(u.dtype), None, None, None


def vla_features(q, k, u, out_dtype, *, elu: bool = True, unit_query: bool = False):
    """``(k̂ fp32, û fp32, k̂ in out_dtype, q_r in out_dtype)`` of q, k, u ``[..., d]``: see the module docstring."""
    return VLAFeatures.apply(q, k, u, out_dtype, bool(elu), bool(unit_query))


@triton.jit
def _block_features(q, k, mask, i_b, i_h, c, T, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    BT: tl.constexpr, ELU: tl.constexpr, HAS_MASK: tl.constexpr):
    """Rows (token-head indices), validity, m·φ(k), φ(q), φ'(k), φ'(q) of block c of sample i_b, head i_h."""
    t = c * BT + tl.arange(0, BT)
    valid = t < T
    col = tl.arange(0, BD)
    m = valid[:, None] & (col < D)[None, :]
    rows = (i_b * T + t) * H + i_h
    offs = rows[:, None] * D + col[None, :]
    kf, dk_phi = _phi(tl.load(k + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    if HAS_MASK:
        real = tl.load(mask + i_b * T + t, mask=valid, other=0.0)
        kf = kf * real[:, None]
        dk_phi = dk_phi * real[:, None]
    qf, dq_phi = _phi(tl.load(q + offs, mask=m, other=0.0).to(tl.float32), m, ELU)
    return rows, valid, offs, m, kf, qf, dk_phi, dq_phi


@triton.jit
def _range(T, LS, BT: tl.constexpr):
    """Grid (B, H, R): sample, head, range r, and the range's blocks [c0, c1) of BT tokens (LS a multiple of BT)."""
    r = tl.program_id(2)
    NC = tl.cdiv(T, BT)
    return (tl.program_id(0).to(tl.int64), tl.program_id(1), r, tl.num_programs(2), NC, r * (LS // BT),
            tl.minimum((r + 1) * (LS // BT), NC))


@triton.jit
def _key_sums_kernel(q, k, mask, sums, T, LS, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                     ELU: tl.constexpr, HAS_MASK: tl.constexpr):
    """Σ m·φ(k) over each range of each sample and head, ``sums [B, H, R, D]``."""
    i_b, i_h, r, R, NC, c0, c1 = _range(T, LS, BT)
    col = tl.arange(0, BD)
    acc = tl.zeros([BD], dtype=tl.float32)
    for c in range(c0, c1):
        _, _, _, _, kf, _, _, _ = _block_features(q, k, mask, i_b, i_h, c, T, H, D, BD, BT, ELU, HAS_MASK)
        acc += tl.sum(kf, 0)
    tl.store(sums + ((i_b * H + i_h) * R + r) * D + col, acc, mask=col < D)


@triton.jit
def _normaliser_fwd_kernel(q, k, mask, z_range, den, z_end, z_starts, T, LS, eps, H: tl.constexpr, D: tl.constexpr,
                           BD: tl.constexpr, BT: tl.constexpr, ELU: tl.constexpr, HAS_MASK: tl.constexpr,
                           SAVE: tl.constexpr):
    """Range r from its start z ``z_range [B, H, R, D]``; z at every block start kept (SAVE) for the backward."""
    eps = tl.cast(eps, tl.float32)
    i_b, i_h, r, R, NC, c0, c1 = _range(T, LS, BT)
    col = tl.arange(0, BD)
    bh = (i_b * H + i_h) * D
    z = tl.load(z_range + ((i_b * H + i_h) * R + r) * D + col, mask=col < D, other=0.0)
    for c in range(c0, c1):
        if SAVE:
            tl.store(z_starts + (bh * NC) + c * D + col, z, mask=col < D)
        rows, valid, offs, m, kf, qf, _, _ = _block_features(q, k, mask, i_b, i_h, c, T, H, D, BD, BT, ELU,
                                                             HAS_MASK)
        zt = z[None, :] + tl.cumsum(kf, 0)
        tl.store(den + rows, tl.maximum(tl.sum(zt * qf, 1), eps), mask=valid)
        z += tl.sum(kf, 0)
    if r == R - 1:
        tl.store(z_end + bh + col, z, mask=col < D)


@triton.jit
def _normaliser_bwd_kernel(q, k, mask, z_starts, dden, carry, sums, dq, dk, dz0, T, LS, eps, H: tl.constexpr,
                           D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, ELU: tl.constexpr,
                           HAS_MASK: tl.constexpr, SUMS: tl.constexpr):
    """Range r in reverse from G = ``carry [B, H, R, D]`` (∂z_T plus Σ ∂den_t φ(q_t) over the later ranges). With
    SUMS, only this range's Σ ∂den_t φ(q_t) into ``sums``."""
    eps = tl.cast(eps, tl.float32)
    i_b, i_h, r, R, NC, c0, c1 = _range(T, LS, BT)
    col = tl.arange(0, BD)
    bh = (i_b * H + i_h) * D
    at = ((i_b * H + i_h) * R + r) * D + col
    G = tl.zeros([BD], dtype=tl.float32)
    if not SUMS:
        G += tl.load(carry + at, mask=col < D, other=0.0)
    for cc in range(c0, c1):
        c = c0 + c1 - 1 - cc
        rows, valid, offs, m, kf, qf, dk_phi, dq_phi = _block_features(q, k, mask, i_b, i_h, c, T, H, D, BD, BT,
                                                                       ELU, HAS_MASK)
        zt = tl.load(z_starts + (bh * NC) + c * D + col, mask=col < D, other=0.0)[None, :] + tl.cumsum(kf, 0)
        g = tl.load(dden + rows, mask=valid, other=0.0)
        g = tl.where(tl.sum(zt * qf, 1) >= eps, g, 0.0)  # max(·, ε) passes no gradient where it clamps
        P = g[:, None] * qf
        if not SUMS:
            tl.store(dq + offs, g[:, None] * zt * dq_phi, mask=m)
            suffix = tl.sum(P, 0)[None, :] - tl.cumsum(P, 0) + P  # Σ_{t ≥ s} within the block
            tl.store(dk + offs, (G[None, :] + suffix) * dk_phi, mask=m)
        G += tl.sum(P, 0)
    if SUMS:
        tl.store(sums + at, G, mask=col < D)
    elif r == 0:
        tl.store(dz0 + bh + col, G, mask=col < D)


def _exclusive(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Exclusive cumulative sum over dim 2 (the ranges), forward or from the end."""
    if reverse:
        return x.flip(2).cumsum(2).flip(2) - x
    return x.cumsum(2) - x


def _range_length(B: int, H: int, T: int, device, ranges: int | None) -> tuple[int, int]:
    """(tokens a range, ranges): one range on the CPU, else enough for about two programs an SM."""
    blocks = max(triton.cdiv(T, BT), 1)
    if ranges is None:
        ranges = 1
        if device.type == "cuda":
            ranges = triton.cdiv(2 * torch.cuda.get_device_properties(device).multi_processor_count, B * H)
    per = triton.cdiv(blocks, max(1, min(int(ranges), blocks)))
    return per * BT, triton.cdiv(blocks, per)


class VLANormaliser(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, z0, mask, eps: float, elu: bool, ranges: int | None):
        B, T, H, D = q.shape
        q, k = q.contiguous(), k.contiguous()
        ctx.z_dtype = z0.dtype
        z0 = z0.to(torch.float32).contiguous()
        m = None if mask is None else mask.to(torch.float32).contiguous()
        den = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
        z_end = torch.empty(B, H, D, device=q.device, dtype=torch.float32)
        save = any(ctx.needs_input_grad[:3])
        z_starts = torch.empty(B, H, triton.cdiv(T, BT), D, device=q.device, dtype=torch.float32) if save else den
        LS, R = _range_length(B, H, T, q.device, ranges)
        ctx.opts = dict(H=H, D=D, BD=triton.next_power_of_2(D), BT=BT, ELU=elu, HAS_MASK=m is not None,
                        **({} if q.device.type == "cpu" else {"num_warps": NORMALISER_WARPS}))
        mask_arg = den if m is None else m
        z_range = z0[:, :, None]
        if R > 1:  # each range's start z: z0 plus the sums of the ranges before it
            sums = torch.empty(B, H, R, D, device=q.device, dtype=torch.float32)
            _key_sums_kernel[(B, H, R)](q, k, mask_arg, sums, T, LS, **ctx.opts)
            z_range = z0[:, :, None] + _exclusive(sums)
        _normaliser_fwd_kernel[(B, H, R)](q, k, mask_arg, z_range.contiguous(), den, z_end, z_starts, T, LS,
                                          float(eps), SAVE=save, **ctx.opts)
        if save:
            ctx.save_for_backward(q, k, z_starts, *(() if m is None else (m,)))
        ctx.eps, ctx.LS, ctx.R = float(eps), LS, R
        return den, z_end

    @staticmethod
    def backward(ctx, dden, dz_end):
        q, k, z_starts, *m = ctx.saved_tensors
        B, T, H, D = q.shape
        R, dev = ctx.R, q.device
        dden = torch.zeros(B, T, H, device=dev) if dden is None else dden.to(torch.float32).contiguous()
        dz_end = torch.zeros(B, H, D, device=dev) if dz_end is None else dz_end.to(torch.float32).contiguous()
        dq, dk = torch.empty(q.shape, device=dev, dtype=torch.float32), torch.empty(
            k.shape, device=dev, dtype=torch.float32)
        dz0 = torch.empty(B, H, D, device=dev, dtype=torch.float32)
        args = (q, k, m[0] if m else dden, z_starts, dden)
        carry = dz_end[:, :, None]
        if R > 1:  # what the later ranges carry into each range
            sums = torch.empty(B, H, R, D, device=dev, dtype=torch.float32)
            _normaliser_bwd_kernel[(B, H, R)](*args, sums, sums, dq, dk, dz0, T, ctx.LS, ctx.eps, SUMS=True,
                                              **ctx.opts)
            carry = dz_end[:, :, None] + _exclusive(sums, reverse=True)
        _normaliser_bwd_kernel[(B, H, R)](*args, carry.contiguous(), carry, dq, dk, dz0, T, ctx.LS, ctx.eps,
                                          SUMS=False, **ctx.opts)
        return dq.to(q.dtype), dk.to(k.dtype), dz0.to(ctx.z_dtype), None, None, None, None


def vla_normaliser(q, k, z0, mask, eps: float, *, elu: bool = True, ranges: int | None = None):
    """``(den [B, T, H] fp32, z_T [B, H, d] fp32)`` from q, k ``[B, T, H, d]``, the start z0 ``[B, H, d]`` and the
    mask ``[B, T]`` (or None): see the module docstring. ``ranges``: how many parts of T run at once (default:
    about two programs an SM on a GPU, one on the CPU); each starts from z0 plus the sums of the parts before it."""
    return VLANormaliser.apply(q, k, z0, mask, eps, bool(elu), ranges)
