"""transformers' Kimi Linear (`transformers.models.kimi_linear`) as a reference for the MoE routing and conversion
tests: on its own PyTorch forms (not fla's or causal-conv1d's kernels, which transformers binds where they import),
and in float64 with its float32 casts lifted (its RMSNorms, the gated output norm, the KDA functions and the forget
gate cast to float32, the router to float32 with `.type`): every cast of a float64 tensor to float32 keeps float64
inside `float32_casts_lifted()`. Everything else is transformers' own code."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers_reference import unwrapped_kernels

#: transformers' functions that take fla's or causal-conv1d's kernels where those are importable
KERNEL_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update")


def kimi_module():
    """transformers' modeling_kimi_linear, or a skip naming the release that lacks it."""
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def reference_forms():
    """transformers' Kimi Linear on its own PyTorch reference forms, also where fla is importable."""
    return unwrapped_kernels(kimi_module(), KERNEL_FUNCTIONS)


def _lift(self: torch.Tensor, value):
    """`value`, or float64 where it asks a float64 tensor for float32."""
    return torch.float64 if value is torch.float32 and self.dtype == torch.float64 else value


@contextlib.contextmanager
def float32_casts_lifted():
    """`float64_kept()` with transformers' Kimi Linear on its `reference_forms()`."""
    with float64_kept(), reference_forms():
        yield


@contextlib.contextmanager
def float64_kept():
    """Inside the block a float64 tensor cast to float32 (`.to(torch.float32)`, `.to(dtype=torch.float32)`,
    `.type(torch.float32)`, `.float()`) stays float64; every other cast is unchanged."""
    real_to, real_type, real_float = torch.Tensor.to, torch.Tensor.type, torch.Tensor.float

    def to(self, *args, **kwargs):
        args = tuple(_lift(self, a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _lift(self, kwargs["dtype"])
        return real_to(self, *args, **kwargs)

    def type_(self, *args, **kwargs):
        if args and _lift(self, args[0]) is torch.float64 and self.dtype == torch.float64:
            return self
        return real_type(self, *args, **kwargs)

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else real_float(self, *args, **kwargs)

    try:
        torch.Tensor.to, torch.Tensor.type, torch.Tensor.float = to, type_, float_
        yield
    finally:
        torch.Tensor.to, torch.Tensor.type, torch.Tensor.float = real_to, real_type, real_float


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()
