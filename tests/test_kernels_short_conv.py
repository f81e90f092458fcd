"""Triton kernels of the depthwise causal short convolution (lazoo.kernels.short_conv) against a float64
per-position loop: outputs and the gradients of x and the weights, SiLU or none, K = 1…4, ragged T, channel
counts that are not a multiple of the block; and ShortConvolution with the kernel equal to its conv1d path
(padding mask, the state it hands on).

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``test_short_conv_kernels_in_subprocess`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at T = 2048."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazoo.ops._testing import run_interpreter_tests

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def loop_reference(x, w, silu):
    """y_t = act(Σ_j w[:, j] x_{t−(K−1−j)}), one position at a time (float64)."""
    B, T, C = x.shape
    K = w.shape[1]
    y = torch.zeros(B, T, C, dtype=F64)
    for t in range(T):
        acc = torch.zeros(B, C, dtype=F64)
        for j in range(K):
            s = t - (K - 1 - j)
            if s >= 0:
                acc = acc + w[:, j] * x[:, s]
        y[:, t] = F.silu(acc) if silu else acc
    return y


def check(B, T, C, K, silu, dtype, tol, device="cpu", seed=0):
    from lazoo.kernels.short_conv import short_conv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=F64)
    w = torch.randn(C, 1, K, generator=gen, dtype=F64) / K ** 0.5
    proj = torch.randn(B, T, C, generator=gen, dtype=F64)
    xr, wr = x.to(dtype).to(F64).requires_grad_(), w.float().to(F64).requires_grad_()
    ref = loop_reference(xr, wr[:, 0], silu)
    gx_ref, gw_ref = torch.autograd.grad((ref * proj).sum(), (xr, wr))
    xk = x.to(dtype).to(device).requires_grad_()
    wk = w.float().to(device).requires_grad_()
    y = short_conv(xk, wk, "silu" if silu else None)
    assert y.dtype == dtype and y.shape == (B, T, C)
    gx, gw = torch.autograd.grad((y.to(F64) * proj.to(device)).sum(), (xk, wk))
    for name, got, want in (("y", y, ref), ("dx", gx, gx_ref), ("dw", gw, gw_ref)):
        err = (got.detach().cpu().to(F64) - want).norm() / want.norm()
        assert err < tol, f"{name}: relative error {err:.2e} (B={B} T={T} C={C} K={K} silu={silu} {dtype})"


@needs_interp
@pytest.mark.parametrize("T,C,K", [(37, 5, 4), (1, 3, 4), (20, 48, 3), (17, 33, 1), (40, 7, 2)])
@pytest.mark.parametrize("silu", [True, False])
def test_interp_kernel_matches_loop(T, C, K, silu):
    check(2, T, C, K, silu, torch.float32, 1e-6)


@needs_interp
def test_interp_kernel_half_precision():
    check(2, 23, 40, 4, True, torch.bfloat16, 2e-2)
    check(1, 23, 40, 4, True, torch.float16, 3e-3)


@needs_interp
@pytest.mark.parametrize("output_state", [False, True])
def test_interp_module_kernel_equals_conv1d(output_state, monkeypatch):
    from lazoo.layers import short_conv as sc

    torch.manual_seed(0)
    conv = sc.ShortConvolution(12, 4, "silu")
    x = torch.randn(3, 9, 12, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded sample
    outs = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setattr(sc, "KERNEL", kernel)
        y, st = conv(x, mask=mask, output_state=output_state)
        gx, gw = torch.autograd.grad((y * torch.linspace(-1, 1, 12)).sum(), (x, conv.weight))
        outs[kernel] = (y, st, gx, gw)
    (y0, s0, gx0, gw0), (y1, s1, gx1, gw1) = outs["torch"], outs["triton"]
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-5)
    if output_state:
        assert torch.equal(s1, s0)  # the same last K − 1 (masked) inputs
    else:
        assert s0 is None and s1 is None
    short = conv(x[:, :2], output_state=True)[1]  # T < K − 1: zeros before the inputs
    monkeypatch.setattr(sc, "KERNEL", "torch")
    assert torch.equal(short, conv(x[:, :2], output_state=True)[1])


def test_unsupported_inputs_are_named():
    from lazoo.kernels.short_conv import check_supported, short_conv

    assert "dtype" in check_supported(torch.zeros(1, 2, 3, dtype=F64), 4)
    assert "kernel_size" in check_supported(torch.zeros(1, 2, 3), 9)
    with pytest.raises(ValueError, match="activation"):
        short_conv(torch.zeros(1, 2, 3), torch.zeros(3, 1, 4), "gelu")


def test_short_conv_kernels_in_subprocess():
    if INTERP:
        pytest.skip("the interpreter tests run in this process")
    run_interpreter_tests(__file__)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("K,silu", [(4, True), (2, False)])
def test_gpu_bf16_matches_loop_and_conv1d(K, silu):
    check(2, 300, 96, K, silu, torch.bfloat16, 2e-2, device="cuda")
    check(2, 300, 96, K, silu, torch.float32, 1e-5, device="cuda")
    from lazoo.layers import short_conv as sc

    conv = sc.ShortConvolution(768, K, "silu" if silu else None).cuda()
    x = torch.randn(2, 2048, 768, device="cuda", dtype=torch.bfloat16)
    y = conv(x)[0]
    ref = F.conv1d(F.pad(x.float().transpose(1, 2), (K - 1, 0)), conv.weight.float(), groups=768).transpose(1, 2)
    ref = F.silu(ref) if silu else ref
    assert not sc._kernel_failed
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
