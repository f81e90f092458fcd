"""Mamba-2's element-wise parts around its SSD kernels (lazoo.kernels.ssd_io): v = dt·x and out = y + D·x, against
their PyTorch forms (the arithmetic `lazoo.ops.mamba2` runs elsewhere) and float64: the values bit for bit in the
inputs' dtypes, the gradients of x, dt, y and D, with x a strided slice of a wider projection, a head dim that is
no power of two, and dt in float32 or in x's dtype; and the op taking them where its Triton kernels run, with the
same outputs and gradients as without them.

CPU: ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported (tests/test_interpreter.py runs
them in a fresh process). GPU: ``-m gpu``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from op_helpers import assert_close, record_launches  # noqa: E402

from lazoo import ops  # noqa: E402
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

needs_interp = pytest.mark.skipif(not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def inputs(dtype, dt_dtype, device="cpu", B=2, T=7, H=3, P=12, seed=0):
    """x as the middle slice of a wider projection's output (tokens strided), dt > 0 in ``dt_dtype``, y, D (float32)
    and the output gradients."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x = randn(B, T, H * P + 9)[..., 4:4 + H * P].unflatten(-1, (H, P))
    assert not x.is_contiguous()
    dt = torch.nn.functional.softplus(randn(B, T, H, dtype=torch.float32)).to(dt_dtype)
    return {"x": x, "dt": dt, "y": randn(B, T, H, P), "D": randn(H, dtype=torch.float32), "dv": randn(B, T, H, P),
            "dout": randn(B, T, H, P)}


def pytorch_forms(t):
    """The PyTorch arithmetic of lazoo.ops.mamba2 (float32 for half inputs): v, out and their gradients."""
    x, dt, y, D = (t[n].detach().requires_grad_() for n in ("x", "dt", "y", "D"))
    v = (dt.float()[..., None] * x.float()).to(x.dtype)
    out = (y.float() + D.float()[:, None] * x.float()).to(y.dtype)
    torch.autograd.backward([v, out], [t["dv"], t["dout"]])
    return v, out, {"x": x.grad, "dt": dt.grad, "y": y.grad, "D": D.grad}


def kernel_forms(t):
    from lazoo.kernels.ssd_io import add_skip, scale_by_dt

    x, dt, y, D = (t[n].detach().requires_grad_() for n in ("x", "dt", "y", "D"))
    v, out = scale_by_dt(x, dt), add_skip(y, x, D)
    torch.autograd.backward([v, out], [t["dv"], t["dout"]])
    return v, out, {"x": x.grad, "dt": dt.grad, "y": y.grad, "D": D.grad}


def float64_grads(t):
    x, dt, y, D = (t[n].detach().double().requires_grad_() for n in ("x", "dt", "y", "D"))
    torch.autograd.backward([dt[..., None] * x, y + D[:, None] * x], [t["dv"].double(), t["dout"].double()])
    return {"x": x.grad, "dt": dt.grad, "y": y.grad, "D": D.grad}


def check(dtype, dt_dtype, device):
    t = inputs(dtype, dt_dtype, device)
    v1, o1, g1 = kernel_forms(t)
    v2, o2, g2 = pytorch_forms(t)
    assert v1.dtype == dtype and o1.dtype == dtype and g1["dt"].dtype == dt_dtype
    assert torch.equal(v1, v2)  # the same float32 product, rounded once
    # y + D·x: a GPU may contract it into one fused multiply-add (one rounding where PyTorch rounds twice), so the
    # two agree to a rounding of the operands' scale, not bit for bit
    scale = t["y"].float().abs() + (t["D"].float()[:, None] * t["x"].float()).abs()
    assert ((o1.float() - o2.float()).abs() <= 2 * torch.finfo(dtype).eps * scale).all()
    assert torch.equal(g1["y"], g2["y"])
    g64 = float64_grads(t)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name in g64:
        assert_close(g1[name].double(), g64[name], tol, f"grad {name}")
        assert_close(g1[name].double(), g2[name].double(), tol, f"grad {name} against the PyTorch form")


@needs_interp
@pytest.mark.parametrize("dtype,dt_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float16)])
def test_interp_kernels_equal_the_pytorch_forms(dtype, dt_dtype):
    check(dtype, dt_dtype, "cpu")


@needs_interp
def test_interp_the_op_takes_them_with_the_same_result(monkeypatch):
    """ops.mamba2 on its Triton path launches the two kernels each way, and gives the outputs and gradients it gives
    with them switched off (the PyTorch forms)."""
    import importlib

    from lazoo.kernels import ssd_io

    op_module = importlib.import_module("lazoo.ops.mamba2")  # the module (lazoo.ops.mamba2 names the op too)

    gen = torch.Generator().manual_seed(3)
    B, T, H, P, N = 2, 20, 4, 16, 16
    x, B_, C_ = (torch.randn(B, T, *s, generator=gen) for s in ((H, P), (1, N), (1, N)))
    dt = torch.nn.functional.softplus(torch.randn(B, T, H, generator=gen))
    A, D = -torch.rand(H, generator=gen) - 0.5, torch.randn(H, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :5] = False

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, dt, A, B_, C_, D)]
        y = ops.mamba2(*leaves, chunk_size=16, backend="triton", mask=mask)[0]
        y.backward(torch.ones_like(y))
        return y, [t.grad for t in leaves]

    grids = record_launches(monkeypatch, ssd_io, "_scale_fwd_kernel", "_scale_bwd_kernel", "_skip_fwd_kernel",
                            "_skip_bwd_kernel")
    y1, g1 = run()
    assert len(grids) == 4, grids
    monkeypatch.setattr(op_module, "_io_kernels", lambda *a: None)
    y2, g2 = run()
    assert len(grids) == 4
    assert torch.equal(y1, y2)
    for name, a, b in zip(("x", "dt", "A", "B", "C", "D"), g1, g2):
        assert_close(a, b, 1e-6, f"grad {name}")


@needs_interp
def test_interp_refuses_what_it_cannot_take():
    from lazoo.kernels.ssd_io import check_supported

    x = torch.zeros(1, 2, 3, 4)
    assert check_supported(x, torch.zeros(1, 2, 3), torch.zeros(3)) is None
    assert "x [B, T, H, P]" in check_supported(x, torch.zeros(1, 2, 4), None)
    assert "dtype" in check_supported(x.double(), torch.zeros(1, 2, 3), None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,dt_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
def test_gpu_kernels_equal_the_pytorch_forms(dtype, dt_dtype):
    check(dtype, dt_dtype, "cuda")
