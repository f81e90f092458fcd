"""The L2 normalisation of keys and queries that the delta-rule family and the test-time-training layers use."""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim: smooth at 0, so always differentiable. In x's dtype (CUDA autocast
    would return the float32 of its rsqrt, and the ops take inputs of one dtype)."""
    return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)).to(x.dtype)
