"""Global (non-causal) token mixing over the H×W positions of a feature map.

``bidirectional_linear_attention`` is normalised linear attention where every position sees every
position (no prefix sums): with φ the feature map,

    S = Σ_j v_j φ(k_j)^T   [dv, dk],   z = Σ_j φ(k_j)   [dk],   o_i = S φ(q_i) / max(φ(q_i)·z, eps)

per sample and head: two matmuls, O(T·dk·dv) time and O(dk·dv) extra memory; the T×T score matrix of
the quadratic form ``o_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j)`` is never formed.

``GlobalAttention2d`` wraps a mechanism with a bidirectional form around a ``[B, C, H, W]`` map:
"linear" (the op above, elu+1 features by default), "ela" (``lazoo.ops.ela(causal=False)``, any ELA
kernel), or "softmax" (full softmax attention through ``scaled_dot_product_attention``: quadratic in
H·W, kept as a reference point).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common import check_mask, check_qkv, compute_dtype, zero_masked
from ..ops.linear import get_feature_map

GLOBAL_ATTENTIONS = ("linear", "ela", "softmax")


def bidirectional_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str = "elu1",
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Non-causal normalised linear attention. q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask
    ``[B, T]`` (1 = real position; a pad contributes nothing and outputs 0). Returns
    ``(o [B, T, H, dv] in v's dtype, None)`` (no state: the whole sequence is summed at once)."""
    op = "bidirectional_linear_attention"
    B, T, H, dk, dv = check_qkv(op, q, k, v)
    mask = check_mask(op, mask, B, T, q.device)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"{op}: eps must be a positive number, got {eps!r}")
    phi = get_feature_map(feature_map, op)
    cdt = compute_dtype(q.dtype)
    fq = phi(q.to(cdt))
    fk = zero_masked(phi(k.to(cdt)), mask)
    S = torch.einsum("bthv,bthk->bhvk", v.to(cdt), fk)
    z = fk.sum(1)  # [B, H, dk]
    num = torch.einsum("bhvk,bthk->bthv", S, fq)
    den = torch.einsum("bhk,bthk->bth", z, fq)[..., None].clamp_min(eps)
    return zero_masked(num / den, mask).to(v.dtype), None


class GlobalAttention2d(nn.Module):
    """Multi-head global mixing of a ``[B, C, H, W]`` map: 1×1 q/k/v projections, a bidirectional
    mechanism over the H·W positions, 1×1 output projection. Position information comes from the
    local (depthwise) mixing around it: the attention itself is permutation-equivariant."""

    def __init__(self, channels: int, num_heads: int, attention: str = "linear",
                 attention_kwargs: dict | None = None):
        super().__init__()
        if attention not in GLOBAL_ATTENTIONS:
            raise ValueError(f"attention must be one of {GLOBAL_ATTENTIONS}, got {attention!r}")
        if channels % num_heads:
            raise ValueError(f"attention_heads={num_heads} must divide the channel count {channels}")
        self.attention = attention
        self.attention_kwargs = dict(attention_kwargs or {})
        self.num_heads = num_heads
        self.qkv = nn.Conv2d(channels, 3 * channels, 1, bias=False)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        heads = self.num_heads
        # [B, 3C, H, W] -> 3 x [B, T, heads, C/heads], T = H·W
        q, k, v = self.qkv(x).flatten(2).transpose(1, 2).reshape(B, H * W, 3, heads, C // heads).unbind(2)
        if self.attention == "linear":
            o, _ = bidirectional_linear_attention(q, k, v, **self.attention_kwargs)
        elif self.attention == "ela":
            from ..ops import ela  # the public op (autocast off)

            o, _ = ela(q, k, v, causal=False, **self.attention_kwargs)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               **self.attention_kwargs).transpose(1, 2)
        o = o.reshape(B, H * W, C).transpose(1, 2).reshape(B, C, H, W)
        return self.proj(o)
