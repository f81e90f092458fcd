"""The chunk forms' layout: time padded to whole chunks, ``[B, T, H, d]`` to ``[B, H, N, C, d]`` and back."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_time(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of ``x`` up to a multiple of ``multiple``."""
    T = x.shape[1]
    extra = (-T) % multiple
    if extra == 0:
        return x
    # F.pad pads the last dims first: zeros for every dim after time, then `extra` after time.
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra))


def split_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, N*C, H, d]`` -> ``[B, H, N, C, d]``."""
    B, Tp, H, d = x.shape
    return x.reshape(B, Tp // C, C, H, d).permute(0, 3, 1, 2, 4)


def merge_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, d]`` -> ``[B, T, H, d]`` (the padding dropped)."""
    B, H, N, C, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, d)[:, :T]
