"""Triton kernels for the depthwise causal short convolution (lazoo.layers.short_conv), channels last.

    pre_t = Σ_{j<K} w_j ⊙ x_{t−(K−1−j)}  (x_s = 0 for s < 0),   y_t = act(pre_t),   act = SiLU or identity

on ``x [B, T, C]`` with ``w [C, K]``. PyTorch's ``conv1d`` wants ``[B, C, T]``: in a Gated DeltaNet training step
(three convolutions per layer; H200 profile in docs/changelog.md) its depthwise kernels took 12 of 106 ms and the
layout copies around them up to 14 ms more. Here each program reads its time block and the K − 1 rows before it
in place.

Backward, with dpre = dy ⊙ act'(pre) (pre recomputed from x):
    dx_s = Σ_j w_j ⊙ dpre_{s+(K−1−j)}  (dpre_t = 0 for t ≥ T),   dw_j = Σ_{b,t} dpre_t ⊙ x_{t−(K−1−j)}
in two kernels: ``_bwd_dpre_kernel`` (dpre, and dw summed over each program's time block) and
``_bwd_dx_kernel``. Arithmetic in fp32; x, y, dx in the input dtype; w and dw fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import is_interpreting, next_pow2
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES
from .limits import SHORT_CONV_MAX_KERNEL_SIZE as MAX_KERNEL_SIZE


@triton.jit
def _pre(x, w, t, c, C, t_ok, c_ok, K: tl.constexpr):
    """pre at rows ``t`` (``[BT]``) and channels ``c`` (``[BC]``) of one sample (``x`` points at its row 0),
    fp32 ``[BT, BC]``."""
    acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1 - j)
        ok = (src >= 0) & t_ok
        xv = tl.load(x + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        wj = tl.load(w + c * K + j, mask=c_ok, other=0.0)
        acc += xv.to(tl.float32) * wj[None, :]
    return acc


@triton.jit
def _fwd_kernel(x, w, y, T, C, K: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += b * T * C  # this sample (64-bit once; offsets inside it stay 32-bit)
    y += b * T * C
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    pre = _pre(x, w, t, c, C, t_ok, c_ok, K)
    out = pre * tl.sigmoid(pre) if SILU else pre
    tl.store(y + t[:, None] * C + c[None, :], out.to(y.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _bwd_dpre_kernel(x, w, dy, dpre, dw_part, T, C, K: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += b * T * C
    dy += b * T * C
    dpre += b * T * C
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    tc_ok = t_ok[:, None] & c_ok[None, :]
    g = tl.load(dy + t[:, None] * C + c[None, :], mask=tc_ok, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre(x, w, t, c, C, t_ok, c_ok, K)
        s = tl.sigmoid(pre)
        g = g * s * (1 + pre * (1 - s))
    tl.store(dpre + t[:, None] * C + c[None, :], g, mask=tc_ok)
    # dw_j over this block: Σ_t dpre_t x_{t−(K−1−j)}, one row of partial sums per (sample, time block)
    row = (b * tl.num_programs(0) + i_t) * C
    for j in tl.static_range(K):
        src = t - (K - 1 - j)
        ok = (src >= 0) & t_ok
        xv = tl.load(x + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        tl.store(dw_part + (row + c) * K + j, tl.sum(g * xv.to(tl.float32), 0), mask=c_ok)


@triton.jit
def _bwd_dx_kernel(dpre, w, dx, T, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    dpre += b * T * C
    dx += b * T * C
    s = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    s_ok, c_ok = s < T, c < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        dst = s + (K - 1 - j)  # the output row that tap j of x_s feeds
        ok = (dst < T) & s_ok
        g = tl.load(dpre + dst[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        wj = tl.load(w + c * K + j, mask=c_ok, other=0.0)
        acc += g * wj[None, :]
    tl.store(dx + s[:, None] * C + c[None, :], acc.to(dx.dtype.element_ty), mask=s_ok[:, None] & c_ok[None, :])


def _blocks(C: int) -> tuple[int, int, int]:
    """(BT, BC, warps). 16 × 128 tiles with 4 warps compile for sm_90 (Triton 3.6) with no spills: 72 / 150 / 80
    registers for the forward / dpre / dx kernels (32-row tiles spill in dpre)."""
    if is_interpreting():
        return 16, min(32, next_pow2(C)), 1
    return 16, min(128, next_pow2(C)), 4


def _grid(B, T, C, BT, BC):
    return (triton.cdiv(T, BT), triton.cdiv(C, BC), B)


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, silu):
        B, T, C = x.shape
        K = w.shape[1]
        BT, BC, warps = _blocks(C)
        y = torch.empty_like(x)
        _fwd_kernel[_grid(B, T, C, BT, BC)](x, w, y, T, C, K=K, SILU=silu, BT=BT, BC=BC, num_warps=warps)
        ctx.save_for_backward(x, w)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        B, T, C = x.shape
        K = w.shape[1]
        BT, BC, warps = _blocks(C)
        grid = _grid(B, T, C, BT, BC)
        dpre = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
        dw_part = torch.empty(B, grid[0], C, K, dtype=torch.float32, device=x.device)
        _bwd_dpre_kernel[grid](x, w, dy.contiguous(), dpre, dw_part, T, C, K=K, SILU=ctx.silu, BT=BT, BC=BC,
                               num_warps=warps)
        dx = torch.empty_like(x)
        _bwd_dx_kernel[grid](dpre, w, dx, T, C, K=K, BT=BT, BC=BC, num_warps=warps)
        return dx, dw_part.sum((0, 1)), None


def check_supported(x: torch.Tensor, kernel_size: int, activation: str | None = "silu") -> str | None:
    """Why the kernels cannot take this input (None if they can)."""
    if activation not in ("silu", None):
        return f"the Triton kernel applies activation 'silu' or None, not {activation!r}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes dtype float32, float16 or bfloat16, not {x.dtype}"
    if kernel_size > MAX_KERNEL_SIZE:
        return f"the Triton kernel takes kernel_size up to {MAX_KERNEL_SIZE}, got {kernel_size}"
    if x.dim() != 3:
        return f"the Triton kernel takes x of shape [B, T, C], got {tuple(x.shape)}"
    return None


def short_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """``act(causal depthwise conv(x))`` for ``x [B, T, C]`` from a zero state; ``weight [C, K]`` (conv1d's
    ``[C, 1, K]`` squeezed: tap j multiplies x_{t−(K−1−j)}), kept in fp32 for the arithmetic. Differentiable
    in x and weight."""
    why = check_supported(x, weight.shape[-1], activation)
    if why is not None:
        raise ValueError(f"short_conv: {why}")
    w = weight.reshape(weight.shape[0], -1).float().contiguous()
    return _ShortConv.apply(x.contiguous(), w, activation == "silu")
