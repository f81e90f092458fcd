"""Slope features of the local-linear kernels: f = P x for every row of x, in float32, zero-padded to R columns.

x ``[B, T, H, dk]`` in any float dtype, P ``[r, dk]`` (shared by the heads) or ``[H, r, dk]``. One program
takes a block of tokens of one head: a product with P instead of PyTorch's float32 copy of x, matrix product
and pad. The backward writes dx = df P in x's dtype and each program's share of dP = Σ dfᵀ x, summed afterwards.
The products are "tf32x3" (three tf32 tensor-core products, about fp32 accuracy: the features feed the
per-query solve, where c = a − f·β can cancel): on an H100 at 32k tokens, H = 16, dk = 64, r = 16 the forward
took 0.053 ms at 2.2e-7 from the fp32 product, against 0.185 ms for fp32 products on the FMA units ("ieee")
and 0.198 ms for PyTorch's x.float() @ Pᵀ (a plain copy of x: 0.041 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

#: tokens a program takes (one head)
BLOCK_TOKENS = 64


@triton.jit
def _rows(N, H: tl.constexpr, BT: tl.constexpr):
    """A program's token block and head, the block's rows in ``[B·T, H, *]`` and which tokens are real (the
    head is the grid's fast axis, so the programs running together read whole token rows)."""
    i_h, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    return i_t, i_h, o_t.to(tl.int64) * H + i_h, o_t < N


@triton.jit
def _features_fwd_kernel(x, P, f, N, r, P_HEAD_STRIDE, H: tl.constexpr, DK: tl.constexpr, R: tl.constexpr,
                         BK: tl.constexpr, BT: tl.constexpr):
    """Grid (H, cdiv(N, BT)): f ``[BT, R]`` = x P[h]ᵀ, columns from r on zero."""
    _, i_h, rows, m_t = _rows(N, H, BT)
    o_d = tl.arange(0, BK)
    o_r = tl.arange(0, R)
    b_x = tl.load(x + rows[:, None] * DK + o_d[None, :], mask=m_t[:, None] & (o_d[None, :] < DK), other=0.0)
    b_pt = tl.load(P + i_h * P_HEAD_STRIDE + o_r[None, :] * DK + o_d[:, None],
                   mask=(o_r[None, :] < r) & (o_d[:, None] < DK), other=0.0)
    b_f = tl.dot(b_x.to(tl.float32), b_pt, input_precision="tf32x3")
    tl.store(f + rows[:, None] * R + o_r[None, :], b_f, mask=m_t[:, None])


@triton.jit
def _features_bwd_kernel(x, P, df, dx, dp_part, N, r, P_HEAD_STRIDE, H: tl.constexpr, DK: tl.constexpr,
                         R: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, WANT_DX: tl.constexpr,
                         WANT_DP: tl.constexpr):
    """Grid (H, cdiv(N, BT)): dx = df P[h] in x's dtype, and this program's dfᵀ x ``[R, BK]`` in dp_part
    (``[cdiv(N, BT), H, R, BK]``)."""
    i_t, i_h, rows, m_t = _rows(N, H, BT)
    o_d = tl.arange(0, BK)
    o_r = tl.arange(0, R)
    m_x = m_t[:, None] & (o_d[None, :] < DK)
    b_df = tl.load(df + rows[:, None] * R + o_r[None, :], mask=m_t[:, None] & (o_r[None, :] < r), other=0.0)
    if WANT_DX:
        b_p = tl.load(P + i_h * P_HEAD_STRIDE + o_r[:, None] * DK + o_d[None, :],
                      mask=(o_r[:, None] < r) & (o_d[None, :] < DK), other=0.0)
        b_dx = tl.dot(b_df, b_p, input_precision="tf32x3")
        tl.store(dx + rows[:, None] * DK + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_x)
    if WANT_DP:
        b_x = tl.load(x + rows[:, None] * DK + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_dp = tl.dot(tl.trans(b_df), b_x, input_precision="tf32x3")
        part = (i_t * H + i_h).to(tl.int64) * R * BK
        tl.store(dp_part + part + o_r[:, None] * BK + o_d[None, :], b_dp)


class SlopeFeatures(torch.autograd.Function):
    """f = P x (float32, padded to R columns) with its backward to x and P; see the module docstring."""

    @staticmethod
    def forward(ctx, x, P, R):
        B, T, H, DK = x.shape
        r = P.shape[-2]
        x, Pf = x.contiguous(), P.float().contiguous()
        N = B * T
        meta = dict(H=H, DK=DK, R=R, BK=max(16, next_pow2(DK)), BT=BLOCK_TOKENS)
        head_stride = r * DK if P.dim() == 3 else 0
        f = torch.empty(B, T, H, R, dtype=torch.float32, device=x.device)
        _features_fwd_kernel[(H, triton.cdiv(N, BLOCK_TOKENS))](x, Pf, f, N, r, head_stride, **meta)
        ctx.save_for_backward(x, Pf)
        ctx.meta, ctx.head_stride, ctx.p_shape, ctx.p_dtype = meta, head_stride, P.shape, P.dtype
        return f

    @staticmethod
    def backward(ctx, df):
        x, Pf = ctx.saved_tensors
        meta = ctx.meta
        B, T, H, DK = x.shape
        N, R, BK = B * T, meta["R"], meta["BK"]
        r = ctx.p_shape[-2]
        want_dx, want_dp = ctx.needs_input_grad[:2]
        grid = (H, triton.cdiv(N, BLOCK_TOKENS))
        dx = torch.empty_like(x) if want_dx else None
        dp_part = torch.empty(grid[1], H, R, BK, dtype=torch.float32, device=x.device) if want_dp else None
        _features_bwd_kernel[grid](x, Pf, df.float().contiguous(), dx if want_dx else x, dp_part if want_dp else Pf,
                                   N, r, ctx.head_stride, WANT_DX=want_dx, WANT_DP=want_dp, **meta)
        dP = None
        if want_dp:
            dP = dp_part.sum(0)[:, :r, :DK]
            dP = (dP.sum(0) if len(ctx.p_shape) == 2 else dP).to(ctx.p_dtype)
        return dx, dP, None


def slope_features(x: torch.Tensor, P: torch.Tensor, R: int) -> torch.Tensor:
    """``[B, T, H, R]`` float32: P x per row (P ``[r, dk]`` or ``[H, r, dk]``, r ≤ R), zero-padded to R features;
    differentiable in x and P."""
    return SlopeFeatures.apply(x, P, R)
