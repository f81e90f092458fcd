"""Triton kernels for the element-wise parts of Mamba-2's SSD around the scalar-gated linear-attention kernels
(``lazoo.ops.mamba2``), per row r = (token, head h) of x ``[B, T, H, P]``:

    v = dt · x   (the kernels' values, in x's dtype),      out = y + D_h · x   (the output with its skip, in y's dtype)

in fp32 arithmetic. In PyTorch each is a chain of casts and products through float32 copies of x (about 6 and 10
bytes of memory traffic an element of x forward, more backward: at Bamba-9B's shapes x is 0.5 GiB per 32k tokens
in bf16); here each is one launch a direction that reads x once.

Backward:
    scale:  dx = dt · dv,   d dt = Σ_p x · dv                      (d dt in fp32, returned in dt's dtype)
    skip:   dy = dout,   dx = D_h · dout,   dD_h = Σ over h's rows Σ_p x · dout   (from fp32 sums per row, summed by
            torch: deterministic, no atomics)
x may be a strided view (a slice of a projection: rows of tokens at any stride, heads and channels packed); the
outputs and gradients are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import rounded_for
from ._utils import device_unsupported, next_pow2, num_sms
from .limits import KERNEL_DTYPES


@triton.jit
def _tile(R, H, P, BR: tl.constexpr, BP: tl.constexpr):
    """This program's rows [BR] (int64), their tokens and heads, the channels [BP] and the tile's mask."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    p = tl.arange(0, BP)
    return rows, rows // H, rows % H, p, (rows < R)[:, None] & (p < P)[None, :]


@triton.jit
def _scale_fwd_kernel(x, dt, v, R, H, P, SX, BR: tl.constexpr, BP: tl.constexpr):
    rows, t, h, p, ok = _tile(R, H, P, BR, BP)
    xv = tl.load(x + (t * SX + h * P)[:, None] + p[None, :], mask=ok, other=0).to(tl.float32)
    d = tl.load(dt + rows, mask=rows < R, other=0).to(tl.float32)
    tl.store(v + rows[:, None] * P + p[None, :], rounded_for(d[:, None] * xv, v), mask=ok)


@triton.jit
def _scale_bwd_kernel(x, dt, dv, dx, ddt, R, H, P, SX, BR: tl.constexpr, BP: tl.constexpr):
    rows, t, h, p, ok = _tile(R, H, P, BR, BP)
    xv = tl.load(x + (t * SX + h * P)[:, None] + p[None, :], mask=ok, other=0).to(tl.float32)
    d = tl.load(dt + rows, mask=rows < R, other=0).to(tl.float32)
    g = tl.load(dv + rows[:, None] * P + p[None, :], mask=ok, other=0).to(tl.float32)
    tl.store(dx + rows[:, None] * P + p[None, :], rounded_for(d[:, None] * g, dx), mask=ok)
    tl.store(ddt + rows, tl.sum(xv * g, 1), mask=rows < R)


@triton.jit
def _skip_fwd_kernel(y, x, D, out, R, H, P, SX, BR: tl.constexpr, BP: tl.constexpr):
    rows, t, h, p, ok = _tile(R, H, P, BR, BP)
    xv = tl.load(x + (t * SX + h * P)[:, None] + p[None, :], mask=ok, other=0).to(tl.float32)
    yv = tl.load(y + rows[:, None] * P + p[None, :], mask=ok, other=0).to(tl.float32)
    dh = tl.load(D + h, mask=rows < R, other=0).to(tl.float32)
    tl.store(out + rows[:, None] * P + p[None, :], rounded_for(yv + dh[:, None] * xv, out), mask=ok)


@triton.jit
def _skip_bwd_kernel(x, D, dout, dx, d_rows, R, H, P, SX, BR: tl.constexpr, BP: tl.constexpr):
    rows, t, h, p, ok = _tile(R, H, P, BR, BP)
    xv = tl.load(x + (t * SX + h * P)[:, None] + p[None, :], mask=ok, other=0).to(tl.float32)
    g = tl.load(dout + rows[:, None] * P + p[None, :], mask=ok, other=0).to(tl.float32)
    dh = tl.load(D + h, mask=rows < R, other=0).to(tl.float32)
    tl.store(dx + rows[:, None] * P + p[None, :], rounded_for(dh[:, None] * g, dx), mask=ok)
    tl.store(d_rows + rows, tl.sum(xv * g, 1), mask=rows < R)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x ``[B, T, H, P]`` and the stride between its tokens, read in place where its heads and channels are packed
    and its tokens evenly strided (a slice of a projection's output), else a contiguous copy."""
    B, T, H, P = x.shape
    if x.stride(3) == 1 and x.stride(2) == P and (B == 1 or x.stride(0) == T * x.stride(1)):
        return x, x.stride(1)
    return x.contiguous(), H * P


def _blocks(R: int, P: int, device) -> tuple[int, int, int]:
    """(BR, BP, warps): tiles of BR rows × BP ≥ P channels, ~2048 elements, their rows halved (down to 256 elements)
    while the grid has fewer than two programs an SM (the kernels are bound by memory: every SM only needs loads in
    flight); a warp per 256 elements, at most 8."""
    BP = next_pow2(P, 1)
    BR = max(1, 2048 // BP)
    while BR > 1 and BR * BP > 256 and triton.cdiv(R, BR) < 2 * num_sms(device):
        BR //= 2
    return BR, BP, min(8, max(1, BR * BP // 256))


def _launch(kernel, x: torch.Tensor, sx: int, *tensors: torch.Tensor) -> None:
    """``kernel`` over the B·T·H rows of P channels of x ``[B, T, H, P]`` (tokens at stride ``sx``)."""
    B, T, H, P = x.shape
    R = B * T * H
    if R == 0:
        return
    BR, BP, warps = _blocks(R, P, x.device)
    kernel[(triton.cdiv(R, BR),)](*tensors, R, H, P, sx, BR=BR, BP=BP, num_warps=warps)


class _ScaleByDt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt):
        xr, ctx.sx = _rows(x)
        dt = dt.contiguous()
        v = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(_scale_fwd_kernel, xr, ctx.sx, xr, dt, v)
        ctx.save_for_backward(xr, dt)
        return v

    @staticmethod
    def backward(ctx, dv):
        xr, dt = ctx.saved_tensors
        dx = torch.empty(xr.shape, dtype=xr.dtype, device=xr.device)
        ddt = torch.empty(dt.shape, dtype=torch.float32, device=xr.device)
        _launch(_scale_bwd_kernel, xr, ctx.sx, xr, dt, dv.contiguous(), dx, ddt)
        return dx, ddt.to(dt.dtype)


class _AddSkip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, D):
        xr, ctx.sx = _rows(x)
        out = torch.empty(x.shape, dtype=y.dtype, device=y.device)
        _launch(_skip_fwd_kernel, xr, ctx.sx, y.contiguous(), xr, D, out)
        ctx.save_for_backward(xr, D)
        return out

    @staticmethod
    def backward(ctx, dout):
        xr, D = ctx.saved_tensors
        dx = torch.empty(xr.shape, dtype=xr.dtype, device=xr.device)
        d_rows = torch.empty(xr.shape[:3], dtype=torch.float32, device=xr.device)  # Σ_p x · dout per row
        _launch(_skip_bwd_kernel, xr, ctx.sx, xr, D, dout.contiguous(), dx, d_rows)
        return dout, dx, d_rows.flatten(0, 1).sum(0).to(D.dtype)


def check_supported(x: torch.Tensor, dt: torch.Tensor, D: torch.Tensor | None) -> str | None:
    """Why the kernels cannot take these inputs (None if they can): x ``[B, T, H, P]``, dt ``[B, T, H]``, D ``[H]``,
    of the kernels' dtypes, on one device."""
    if x.dim() != 4 or dt.shape != x.shape[:3] or (D is not None and D.shape != x.shape[2:3]):
        return "the kernels take x [B, T, H, P], dt [B, T, H] and D [H]"
    for name, t in (("x", x), ("dt", dt), ("D", D)):
        if t is not None and (t.dtype not in KERNEL_DTYPES or t.device != x.device):
            return f"the kernels take {name} of dtype float32, float16 or bfloat16 on x's device"
    return device_unsupported(x)


def scale_by_dt(x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """dt · x in x's dtype (fp32 arithmetic), differentiable in both; x ``[B, T, H, P]``, dt ``[B, T, H]``."""
    return _ScaleByDt.apply(x, dt)


def add_skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y + D_h · x in y's dtype (fp32 arithmetic), differentiable in all three; y and x ``[B, T, H, P]``, D ``[H]``."""
    return _AddSkip.apply(y, x, D.contiguous())
