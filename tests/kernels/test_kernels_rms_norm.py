"""The Triton RMSNorm (lazoo.kernels.rms_norm) against a float64 reference written plainly in PyTorch: the output
and the gradients of x, the weight and the gate, for torch's form (offset 0) and the zero-centred one (offset 1),
with and without a weight and a SiLU gate, D a power of two or not, ragged row counts and leading dims; fp32 inputs
tightly, bf16/fp16 at their rounding (against the reference of the same rounded inputs and output gradient);
fp32 and bf16 weights; the GPU tile sizes, gate views, the reasons the kernel names for inputs it does not take.

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at [4, 2048, 1024] and per head
at [4, 2048, 16, 128] with a gate."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def reference(x, w, gate, eps, offset):
    """x / sqrt(mean(x²) + eps) · (offset + w) · silu(gate), in float64 (no weight: a scale of 1)."""
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (offset + w)
    if gate is not None:
        y = y * gate * torch.sigmoid(gate)
    return y


def inputs(shape, dtype=F32, *, w_dtype=F32, g_dtype=None, offset=0.0, weight=True, gate=False, scale=3.0,
           seed=0, device="cpu"):
    """(x, w, gate, dy) in their dtypes: w around 1 − offset, so that offset + w is around 1."""
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (scale * torch.randn(shape, generator=gen, dtype=F64)).to(dtype)
    w = (1 - offset + 0.5 * torch.randn(D, generator=gen, dtype=F64)).to(w_dtype) if weight else None
    g = (2 * torch.randn(shape, generator=gen, dtype=F64)).to(g_dtype or dtype) if gate else None
    dy = torch.randn(shape, generator=gen, dtype=F64).to(dtype)
    return tuple(None if t is None else t.to(device) for t in (x, w, g, dy))


def errors(x, w, g, dy, eps=1e-6, offset=0.0):
    """Norm-relative errors {name: error} of the kernel's output and gradients against the float64 reference of
    the same (rounded) inputs and output gradient."""
    from lazoo.kernels.rms_norm import rms_norm

    names = [n for n, t in (("x", x), ("w", w), ("gate", g)) if t is not None]
    ours = {n: t.detach().clone().requires_grad_() for n, t in zip(("x", "w", "gate"), (x, w, g)) if t is not None}
    refs = {n: t.detach().to(F64).requires_grad_() for n, t in ours.items()}
    y = rms_norm(ours["x"], ours.get("w"), eps, offset=offset, gate=ours.get("gate"))
    assert y.dtype == x.dtype and y.shape == x.shape
    want = reference(refs["x"], refs.get("w"), refs.get("gate"), eps, offset)
    got_g = torch.autograd.grad(y, [ours[n] for n in names], dy)
    want_g = torch.autograd.grad(want, [refs[n] for n in names], dy.to(F64))
    out = {"y": (y, want)} | {f"d{n}": pair for n, pair in zip(names, zip(got_g, want_g))}
    errs = {}
    for name, (got, ref) in out.items():
        if name != "y":  # each gradient in its input's dtype and shape
            src = ours[name[1:]]
            assert got.dtype == src.dtype and got.shape == src.shape, name
        errs[name] = ((got.detach().to(F64) - ref.detach()).norm() / ref.detach().norm()).item()
    return errs


def assert_within(errs, tol, what):
    bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < tol}
    assert not bad, f"{what}: relative errors over {tol:g}: {bad}"


# (offset, weight, gate): torch's norm, the zero-centred one, each gated, no weight (offset then unused)
FORMS = [(0.0, True, False), (1.0, True, False), (0.0, True, True), (1.0, True, True), (0.0, False, False),
         (1.0, False, True)]


@needs_interp
@pytest.mark.parametrize("D,lead", [(16, (1,)), (16, (7, 11)), (100, (7,)), (100, (2, 5, 3)), (128, (1,)),
                                    (128, (33,)), (1024, (7,)), (1024, (2, 3))])
@pytest.mark.parametrize("offset,weight,gate", FORMS)
def test_interp_float32_matches_reference(D, lead, offset, weight, gate):
    x, w, g, dy = inputs((*lead, D), offset=offset, weight=weight, gate=gate, seed=D + len(lead))
    assert_within(errors(x, w, g, dy, offset=offset), 1e-5, f"D={D} lead={lead} offset={offset} w={weight} g={gate}")


@needs_interp
@pytest.mark.parametrize("dtype,tol", [(BF16, 5e-3), (F16, 1e-3)])
@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("D,lead,offset,gate", [(100, (2, 5, 3), 0.0, False), (128, (33,), 1.0, True)])
def test_interp_half_precision_at_its_rounding(dtype, tol, w_dtype, D, lead, offset, gate):
    """One rounding of each output (y, dx, dgate in the input dtype, dw in the weight's) against the float64
    reference of the same rounded inputs: bf16's unit roundoff is 2⁻⁸, fp16's 2⁻¹¹ (norm-relative about a third
    of that); a bf16 weight's gradient is rounded at bf16's. The interpreter truncates fp32 → bf16 (a GPU rounds
    to nearest), about twice the error: 3.3e-3 here, against 5e-3."""
    x, w, g, dy = inputs((*lead, D), dtype, w_dtype=w_dtype, offset=offset, gate=gate, seed=1)
    errs = errors(x, w, g, dy, offset=offset)
    assert_within({k: v for k, v in errs.items() if k != "dw"}, tol, f"{dtype} D={D}")
    assert_within({"dw": errs["dw"]}, max(tol, 5e-3 if w_dtype == BF16 else 0), f"{dtype} dw in {w_dtype}")


@needs_interp
def test_interp_gate_and_weight_in_other_dtypes():
    """bf16 x with an fp32 gate (and a bf16 weight); fp32 x with a bf16 gate and an fp16 weight (each gradient at
    its own dtype's rounding)."""
    x, w, g, dy = inputs((7, 100), BF16, w_dtype=BF16, g_dtype=F32, offset=1.0, gate=True)
    assert_within(errors(x, w, g, dy, offset=1.0), 5e-3, "bf16 x, fp32 gate")
    x, w, g, dy = inputs((7, 100), F32, w_dtype=F16, g_dtype=BF16, gate=True)
    errs = errors(x, w, g, dy)  # dw rounded to fp16, dgate to bf16
    assert_within({"y": errs["y"], "dx": errs["dx"]}, 1e-5, "fp32 x, bf16 gate, fp16 weight")
    assert_within({"dw": errs["dw"]}, 1e-3, "dw in fp16")
    assert_within({"dgate": errs["dgate"]}, 5e-3, "dgate in bf16")


@needs_interp
def test_interp_a_wrong_norm_is_caught():
    """Where eps and the offset change the output well beyond the tolerance (x of the size of sqrt(eps), a weight
    around 0 that the offset lifts to 1), so that a kernel which dropped either, or the gate, fails."""
    eps = 0.25
    x, w, g, dy = inputs((33, 100), offset=1.0, gate=True, scale=0.5, seed=3)
    xd, wd, gd = (t.to(F64) for t in (x, w, g))
    want = reference(xd, wd, gd, eps, 1.0)
    for wrong in (reference(xd, wd, gd, 0.0, 1.0), reference(xd, wd, gd, eps, 0.0),
                  reference(xd, wd, None, eps, 1.0)):
        assert (wrong - want).norm() / want.norm() > 0.1
    assert_within(errors(x, w, g, dy, eps=eps, offset=1.0), 1e-5, "eps 0.25, offset 1, gated")


@needs_interp
@pytest.mark.parametrize("D,R", [(128, 70), (16, 300), (100, 5)])
def test_interp_gpu_tiles(D, R, monkeypatch):
    """The tile sizes the GPU takes (32 rows a program at D = 128, 256 at D = 16) and its number of backward
    programs, run through the interpreter."""
    from lazoo.kernels import rms_norm as krn

    monkeypatch.setattr(krn, "is_interpreting", lambda: False)
    assert krn._tiles(128) == (32, 128, 8) and krn._tiles(16) == (256, 16, 8) and krn._tiles(8192) == (1, 8192, 16)
    x, w, g, dy = inputs((R, D), offset=1.0, gate=True, seed=4)
    assert_within(errors(x, w, g, dy, offset=1.0), 1e-5, f"GPU tiles D={D} R={R}")


@needs_interp
def test_interp_equals_torch_and_lazoo_norms():
    """offset 0 is ``nn.RMSNorm``, offset 1 lazoo's ZeroCenteredRMSNorm (values and weight gradients)."""
    from lazoo.kernels.rms_norm import rms_norm
    from lazoo.layers.norms import ZeroCenteredRMSNorm

    torch.manual_seed(5)
    x = torch.randn(3, 4, 48)
    for norm, offset in ((torch.nn.RMSNorm(48, eps=1e-5), 0.0), (ZeroCenteredRMSNorm(48, eps=1e-5), 1.0)):
        with torch.no_grad():
            norm.weight.add_(0.3 * torch.randn(48))
        want = norm(x)
        (gw_want,) = torch.autograd.grad(want.pow(2).sum(), norm.weight)
        got = rms_norm(x, norm.weight, norm.eps, offset=offset)
        (gw,) = torch.autograd.grad(got.pow(2).sum(), norm.weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, gw_want, rtol=1e-5, atol=1e-5)


@needs_interp
def test_interp_strided_inputs_and_gradients():
    """A gate sliced out of a wider projection (rows D-contiguous, not contiguous), x transposed (copied), a
    strided weight, and an expanded output gradient (``y.sum()``): the same as on contiguous copies; dgate has the
    view's shape."""
    from lazoo.kernels.rms_norm import rms_norm

    torch.manual_seed(6)
    proj = torch.randn(2, 5, 3 * 32, requires_grad=True)
    gate = proj[..., 32:64]
    x = torch.randn(5, 2, 32).transpose(0, 1).requires_grad_()
    w = torch.randn(32, requires_grad=True)
    w2 = torch.randn(32, 2)
    w2[:, 0] = w.detach()
    w_view = w2[:, 0].requires_grad_()  # strided weight
    y = rms_norm(x, w, 1e-6, offset=1.0, gate=gate)
    dx, dw, dproj = torch.autograd.grad(y.sum(), (x, w, proj))
    y_view = rms_norm(x, w_view, 1e-6, offset=1.0, gate=gate)
    assert torch.equal(y_view, y) and torch.equal(torch.autograd.grad(y_view.sum(), w_view)[0], dw)
    xc, gc = x.detach().contiguous().requires_grad_(), gate.detach().contiguous().requires_grad_()
    yc = rms_norm(xc, w, 1e-6, offset=1.0, gate=gc)
    dxc, dwc, dgc = torch.autograd.grad(yc.sum(), (xc, w, gc))
    assert torch.equal(y, yc) and torch.equal(dx, dxc) and torch.equal(dw, dwc)
    assert torch.equal(dproj[..., 32:64], dgc) and not dproj[..., :32].any()


@needs_interp
def test_interp_partial_gradients_and_empty_rows():
    """Only the gradients asked for (the weight or gate frozen), the same values; no rows at all; the weight's
    gradient is the same bits run to run (no atomics)."""
    from lazoo.kernels.rms_norm import rms_norm

    x, w, g, dy = inputs((33, 100), offset=1.0, gate=True, seed=7)
    xs, ws, gs = (t.clone().requires_grad_() for t in (x, w, g))
    full = torch.autograd.grad(rms_norm(xs, ws, 1e-6, offset=1.0, gate=gs), (xs, ws, gs), dy)
    again = torch.autograd.grad(rms_norm(xs, ws, 1e-6, offset=1.0, gate=gs), (xs, ws, gs), dy)
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    (dx,) = torch.autograd.grad(rms_norm(xs, w, 1e-6, offset=1.0, gate=g), xs, dy)
    assert torch.equal(dx, full[0])
    (dg,) = torch.autograd.grad(rms_norm(x, w, 1e-6, offset=1.0, gate=gs), gs, dy)
    assert torch.equal(dg, full[2])
    e = torch.zeros(0, 4, 16, requires_grad=True)
    we = torch.ones(16, requires_grad=True)
    ye = rms_norm(e, we, 1e-6)
    assert ye.shape == (0, 4, 16)
    de, dwe = torch.autograd.grad(ye.sum(), (e, we))
    assert de.shape == e.shape and torch.equal(dwe, torch.zeros(16))


def test_unsupported_inputs_are_named():
    from lazoo.kernels.rms_norm import MAX_DIM, check_supported, rms_norm

    x = torch.zeros(2, 8)
    assert "dtype" in check_supported(x.double())
    assert f"up to {MAX_DIM}" in check_supported(torch.zeros(1, MAX_DIM + 1))
    assert "shape (8,)" in check_supported(x, torch.zeros(4))
    assert "weight of dtype" in check_supported(x, torch.zeros(8, dtype=F64))
    assert "gate of x's shape" in check_supported(x, None, torch.zeros(2, 4))
    assert "gate of dtype" in check_supported(x, None, torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="rms_norm: .*dtype"):
        rms_norm(x.double(), None, 1e-6)
    if INTERP:
        assert check_supported(x, torch.zeros(8, dtype=BF16), torch.zeros(2, 8, dtype=F16)) is None
    else:
        assert "TRITON_INTERPRET" in check_supported(x, torch.zeros(8), torch.zeros(2, 8))


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_matches_reference():
    """bf16 at a hidden size ([4, 2048, 1024], zero-centred, fp32 weight) and per head ([4, 2048, 16, 128] with
    an fp32 weight and a bf16 gate), outputs and gradients against float64; fp32 tightly at the per-head shape."""
    x, w, g, dy = inputs((4, 2048, 1024), BF16, offset=1.0, device="cuda")
    assert_within(errors(x, w, g, dy, offset=1.0), 5e-3, "bf16 [4, 2048, 1024]")
    x, w, g, dy = inputs((4, 2048, 16, 128), BF16, gate=True, device="cuda", seed=1)
    assert_within(errors(x, w, g, dy), 5e-3, "bf16 [4, 2048, 16, 128] gated")
    x, w, g, dy = inputs((4, 2048, 16, 128), F32, w_dtype=BF16, gate=True, device="cuda", seed=2)
    errs = errors(x, w, g, dy)
    assert_within({"dw": errs.pop("dw")}, 2.0 ** -8, "fp32 [4, 2048, 16, 128] gated, dw in the bf16 weight's dtype")
    assert_within(errs, 1e-5, "fp32 [4, 2048, 16, 128] gated")
