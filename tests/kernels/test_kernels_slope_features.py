"""Slope-feature kernel (lazoo.kernels.slope_features): f = P x padded to R columns against the float64 product,
for a shared and a per-head P, r and dk not powers of two, and token counts that are not a multiple of the block
(the gradients are the local-linear kernels', tested with them). CPU: the ``interp_*`` tests run in a fresh
``TRITON_INTERPRET=1`` process. GPU: ``-m gpu``."""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def reference(x, P, R):
    """Float64 features of x through P (per head if P is 3-D), zero-padded to R."""
    f = x @ P.transpose(-1, -2) if P.dim() == 2 else torch.einsum("bthd,hrd->bthr", x, P)
    return torch.nn.functional.pad(f, (0, R - f.shape[-1]))


def check(B, T, H, dk, r, R, per_head, dtype, device, rtol):
    from lazoo.kernels.slope_features import project

    g = torch.Generator().manual_seed(B * 100 + T + r)
    x = torch.randn(B, T, H, dk, generator=g, dtype=F64)
    P = torch.randn(*((H,) if per_head else ()), r, dk, generator=g, dtype=F64) / dk ** 0.5
    xs = x.to(device, dtype)
    f = project(xs, P.to(device, torch.float32).contiguous(), R)
    assert f.dtype == torch.float32 and f.shape == (B, T, H, R)
    assert torch.all(f[..., r:] == 0), "the padded features must be exactly zero"
    # against the float64 product of the rounded inputs, so only the kernel's arithmetic is measured
    assert_close(f.double().cpu(), reference(xs.double().cpu(), P.float().double(), R), rtol, "features")


@needs_interp
@pytest.mark.parametrize("B,T,H,dk,r,R,per_head", [
    (2, 37, 3, 24, 5, 16, False),   # ragged token count, dk and r not powers of two
    (1, 70, 2, 16, 16, 16, True),   # per-head P, more than one token block
    (2, 19, 2, 40, 20, 32, True),   # r padded to 32
])
def test_interp_features_match_float64(B, T, H, dk, r, R, per_head):
    check(B, T, H, dk, r, R, per_head, torch.float32, "cpu", rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_gpu_features_match_float64(dtype, per_head):
    check(2, 1000, 4, 64, 16, 16, per_head, dtype, "cuda", rtol=1e-6)
