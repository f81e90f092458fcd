"""Global (non-causal) token mixing over the H×W positions of a feature map.

``GlobalAttention2d`` wraps a mechanism with a bidirectional form around a ``[B, C, H, W]`` map:
"linear" (``lazoo.ops.bidirectional_linear_attention``: normalised linear attention where every position
sees every position, two matmuls and no T×T matrix; elu+1 features by default), "ela"
(``lazoo.ops.ela(causal=False)``, any ELA kernel), or "softmax" (full softmax attention through
``scaled_dot_product_attention``: quadratic in H·W, kept as a reference point).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.bidirectional import bidirectional_linear_attention

GLOBAL_ATTENTIONS = ("linear", "ela", "softmax")


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
            o, _ = ops.ela(q, k, v, causal=False, **self.attention_kwargs)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               **self.attention_kwargs).transpose(1, 2)
        o = o.reshape(B, H * W, C).transpose(1, 2).reshape(B, C, H, W)
        return self.proj(o)
