"""Slope features of the local-linear kernels: f = P x for every row of x, in float32, zero-padded to R columns.

x ``[B, T, H, dk]`` in any float dtype, P ``[r, dk]`` (shared by the heads) or ``[H, r, dk]``. One program
takes a block of tokens of one head: a product with P instead of PyTorch's float32 copy of x, matrix product
and pad. Forward only: the local-linear kernels add the features' share of the gradients (dx = df P, dP = Σ dfᵀ x)
to their own, with the query and key blocks they hold (``lazoo.kernels.local_linear``). The products are "tf32x3"
(three tf32 tensor-core products, about fp32 accuracy: the features feed the per-query solve, where c = a − f·β
can cancel): on an H100 at 32k tokens, H = 16, dk = 64, r = 16 the forward took 0.053 ms at 2.2e-7 from the fp32
product, against 0.185 ms for fp32 products on the FMA units ("ieee") and 0.198 ms for PyTorch's x.float() @ Pᵀ
(a plain copy of x: 0.041 ms).
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
    return i_h, o_t.to(tl.int64) * H + i_h, o_t < N


@triton.jit
def _features_fwd_kernel(x, P, f, N, r, P_HEAD_STRIDE, H: tl.constexpr, DK: tl.constexpr, R: tl.constexpr,
                         BK: tl.constexpr, BT: tl.constexpr):
    """Grid (H, cdiv(N, BT)): f ``[BT, R]`` = x P[h]ᵀ, columns from r on zero."""
    i_h, rows, m_t = _rows(N, H, BT)
    o_d = tl.arange(0, BK)
    o_r = tl.arange(0, R)
    b_x = tl.load(x + rows[:, None] * DK + o_d[None, :], mask=m_t[:, None] & (o_d[None, :] < DK), other=0.0)
    b_pt = tl.load(P + i_h * P_HEAD_STRIDE + o_r[None, :] * DK + o_d[:, None],
                   mask=(o_r[None, :] < r) & (o_d[:, None] < DK), other=0.0)
    b_f = tl.dot(b_x.to(tl.float32), b_pt, input_precision="tf32x3")
    tl.store(f + rows[:, None] * R + o_r[None, :], b_f, mask=m_t[:, None])


def project(x: torch.Tensor, P: torch.Tensor, R: int) -> torch.Tensor:
    """``[B, T, H, R]`` float32: P x per row (P float32 ``[r, dk]`` or ``[H, r, dk]``, contiguous, r ≤ R), zero-padded
    to R features. Not differentiable: the local-linear kernels form the gradients of x and P themselves."""
    B, T, H, DK = x.shape
    x = x.contiguous()
    N = B * T
    f = torch.empty(B, T, H, R, dtype=torch.float32, device=x.device)
    _features_fwd_kernel[(H, triton.cdiv(N, BLOCK_TOKENS))](
        x, P, f, N, P.shape[-2], head_stride(P), H=H, DK=DK, R=R, BK=next_pow2(DK), BT=BLOCK_TOKENS)
    return f


def head_stride(P: torch.Tensor) -> int:
    """Elements between heads' projections: r·dk for ``[H, r, dk]``, 0 for one P shared by the heads."""
    return P.shape[-2] * P.shape[-1] if P.dim() == 3 else 0
