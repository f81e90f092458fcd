"""An op's compute dtype (float64 stays, the rest is computed in float32), and autocast switched off around it."""

from __future__ import annotations

import functools

import torch


def without_autocast(op):
    """Run ``op`` with autocast off: an op chooses its own compute dtypes (fp32 states and
    accumulation, the kernels' operand types); autocast would re-cast its products to 16 bits
    (and CPU autocast makes ``solve_triangular`` fail in bf16)."""

    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return wrapper


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
