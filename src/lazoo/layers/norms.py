"""The decoder's RMSNorms: torch's `nn.RMSNorm` (`w·x̂`, w initialised to ones), or the zero-centred form
`(1 + w)·x̂` (w initialised to zeros) that Qwen3.5 and Qwen3-Next checkpoints store.

On CUDA the Triton RMSNorm (`lazoo.kernels.rms_norm`: fp32 arithmetic, the weight read in its own dtype, one
rounding to x's dtype) runs where it replaces several PyTorch ops and the float32 copies they keep: a norm whose
weight's dtype is not its input's (bf16 activations, fp32 weights under autocast: torch then runs its unfused
composite form), and a recurrent mixer's output norm with its SiLU gate. Where torch runs one fused op (weight and
input of one dtype), or a few casts around one, torch stays: a Triton launch costs the host several native ops
(H200 machine, torch 2.11, Triton 3.6: 56 µs a call of the delta rule's L2 norm against 12 µs of `torch.mul`), and a
training step or prefill of a few thousand tokens is paced by the host. While torch.compile traces (it fuses the
PyTorch form itself) the PyTorch form runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops.backend import triton_missing


def fused_norm_runs(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor | None = None) -> bool:
    """Whether the Triton RMSNorm takes this call: CUDA tensors, Triton present, not while torch.compile traces,
    and inputs the kernel takes."""
    if not x.is_cuda or torch.compiler.is_compiling() or triton_missing():
        return False
    try:
        from ..kernels.rms_norm import check_supported  # defines the kernels: only where they can run
    except ImportError:  # an exported model folder: no kernels there
        return False
    return check_supported(x, weight, gate) is None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, offset: float = 0.0,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """`x̂ · (offset + w) [· silu(gate)]` by the Triton kernel (`fused_norm_runs` said yes); eps None is torch's
    default, x's dtype's machine epsilon."""
    from ..kernels.rms_norm import rms_norm

    return rms_norm(x, weight, torch.finfo(x.dtype).eps if eps is None else eps, offset=offset, gate=gate)


class RMSNorm(nn.RMSNorm):
    """torch's `nn.RMSNorm`, the same parameters and values; on CUDA one Triton launch a direction where the weight's
    dtype is not x's (torch's form is then unfused and keeps float32 copies of x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.dtype != x.dtype and fused_norm_runs(x, self.weight):
            return fused_rms_norm(x, self.weight, self.eps)
        return super().forward(x)


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
    return ZeroCenteredRMSNorm(hidden_size, eps) if zero_centered else RMSNorm(hidden_size, eps=eps)


def norm_keeping_only_input(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``. Where x's dtype differs from the norm's weight (bf16 activations against fp32 weights under
    autocast), torch's RMSNorm cannot run its fused kernel and its composite form keeps two float32 copies of x
    for the backward; there the norm is recomputed in the backward instead (``torch.utils.checkpoint``), keeping
    only x. The same values and gradients either way."""
    weight = getattr(norm, "weight", None)
    mixed = weight is not None and weight.dtype != x.dtype
    if mixed and isinstance(norm, RMSNorm) and fused_norm_runs(x, weight):  # keeps only x (and its rstd)
        return norm(x)
    if mixed and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return checkpoint(norm, x, use_reentrant=False)
    return norm(x)


def norm_then_silu_gate(norm: nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`norm(x) · silu(gate)` (gate of x's shape): one Triton launch a direction where the kernel runs and `norm`
    is an `nn.RMSNorm` (a recurrent mixer's output norm and gate), else the norm (``norm_keeping_only_input``)
    and then ``silu_mul``."""
    weight = getattr(norm, "weight", None)
    if isinstance(norm, nn.RMSNorm) and fused_norm_runs(x, weight, gate):
        return fused_rms_norm(x, weight, norm.eps, gate=gate)
    from .mlp import silu_mul

    return silu_mul(gate, norm_keeping_only_input(norm, x))
