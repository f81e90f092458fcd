"""The decoder's RMSNorms: torch's `nn.RMSNorm` (`w·x̂`, w initialised to ones), or the zero-centred form
`(1 + w)·x̂` (w initialised to zeros) that Qwen3.5 and Qwen3-Next checkpoints store."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class ZeroCenteredRMSNorm(nn.Module):
    """`(1 + w)·x / sqrt(mean(x²) + eps)` over the last dim, computed in float32 for half types (float64 stays) and
    returned in x's dtype; `w` starts at zero, so weight decay pulls the scale towards 1."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        scale = 1.0 + self.weight.to(cdt)
        return F.rms_norm(x.to(cdt), self.weight.shape, scale, self.eps).to(x.dtype)

    def reset_parameters(self, init=nn.init) -> None:
        init.zeros_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero-centred"


def rms_norm(hidden_size: int, eps: float, zero_centered: bool = False) -> nn.Module:
    """The RMSNorm of a decoder (its two norms per layer and the final one)."""
    return ZeroCenteredRMSNorm(hidden_size, eps) if zero_centered else nn.RMSNorm(hidden_size, eps=eps)


def norm_keeping_only_input(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``. Where x's dtype differs from the norm's weight (bf16 activations against fp32 weights under
    autocast), torch's RMSNorm cannot run its fused kernel and its composite form keeps two float32 copies of x
    for the backward; there the norm is recomputed in the backward instead (``torch.utils.checkpoint``), keeping
    only x. The same values and gradients either way."""
    weight = getattr(norm, "weight", None)
    mixed = weight is not None and weight.dtype != x.dtype
    if mixed and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return checkpoint(norm, x, use_reentrant=False)
    return norm(x)
