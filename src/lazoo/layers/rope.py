"""Rotary position embedding (RoPE), applied per position id so left padding and caches agree."""

from __future__ import annotations

import torch


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables `[B, T, 1, head_dim]` for integer positions `[B, T]`."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got head_dim={head_dim}")
    cdt = torch.promote_types(dtype, torch.float32)  # half types in fp32; float64 stays float64
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=cdt) / head_dim))
    angles = position_ids.to(cdt)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, H, D]` (half-split convention, as in Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
