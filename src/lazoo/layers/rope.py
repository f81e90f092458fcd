"""Rotary position embedding (RoPE), applied per position id so left padding and caches agree.

Convention (Llama's, and transformers' `apply_rotary_pos_emb` in qwen3_5 / qwen3_next): the rotated channels are split
in two halves, channel i paired with channel i + R/2, pair i turning by position · θ^(−2i/R). Partial rotary (Qwen3.5,
Qwen3-Next: `partial_rotary_factor` 0.25) rotates the first R = rotary_dim channels of each head that way and passes
the others through unchanged.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables `[B, T, 1, head_dim]` for integer positions `[B, T]` (`head_dim`: the rotated channels R)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got head_dim={head_dim}")
    cdt = torch.promote_types(dtype, torch.float32)  # half types in fp32; float64 stays float64
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=cdt) / head_dim))
    angles = position_ids.to(cdt)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, H, D]` (half-split convention, as in Llama). Tables narrower than the head (`[..., R]`,
    R < D) rotate the first R channels and pass the other D − R through (partial rotary)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
