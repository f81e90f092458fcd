"""A decode step's input products in one launch (lazoo.kernels.decode_linear): several weights read in place
(``linear_many``) and a gated MLP's gate, up and activation (``gated_linear_unit``) against float64 products, the
unfused modules' rounding in fp16, the refusals; and the layers that take them (a mixer's fused step through
``project_together``, ``GatedMLP``) equal to the unfused forms.

CPU: ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported (tests/test_interpreter.py runs
them in a fresh process; bf16 is broken in the interpreter, so fp16 stands for the half types there). GPU:
``-m gpu``, bf16 and fp32 against cuBLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)
from lazoo.layers.mlp import ACTIVATIONS, GatedMLP  # noqa: E402
from lazoo.layers.projections import project_together  # noqa: E402

needs_interp = pytest.mark.skipif(not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64
#: a Gated DeltaNet mixer's six projections at tiny sizes (q, k, v, beta, a, gate), widths off the block sizes
WIDTHS = [48, 48, 64, 3, 3, 64]


def make(rows, K, widths, dtype, device="cpu", seed=0, strided=True):
    """x ``[rows, 1, K]`` (a slice of a wider tensor when ``strided``: rows not packed) and weights ``[N, K]``."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 1, K + (7 if strided else 0), generator=gen)
    x = wide[..., 3:3 + K] if strided else wide
    weights = [torch.randn(n, K, generator=gen) / K ** 0.5 for n in widths]
    return x.to(device, dtype), [w.to(device, dtype) for w in weights]


def rel_err(a, b):
    return ((a.to(F64) - b).norm() / b.norm()).item()


@needs_interp
@pytest.mark.parametrize("rows,K", [(1, 40), (5, 130), (64, 33)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_interp_linear_many_equals_the_products(rows, K, dtype, tol):
    from lazoo.kernels.decode_linear import linear_many

    x, weights = make(rows, K, WIDTHS, dtype)
    for biases in (None, bias_every_other(weights)):
        outs = linear_many(x, weights, biases)
        assert [o.shape for o in outs] == [(rows, 1, n) for n in WIDTHS]
        assert len({o.untyped_storage().data_ptr() for o in outs}) == 1  # views of one output
        for o, w, b in zip(outs, weights, biases or [None] * len(weights)):
            assert o.dtype == dtype
            assert rel_err(o, F.linear(x.to(F64), w.to(F64), None if b is None else b.to(F64))) < tol


def bias_every_other(weights, seed=3):
    """A bias for weights 1, 3, ... (None for the others), as a mixer whose β projection alone has one."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(w.shape[0], generator=gen).to(w) if i % 2 else None for i, w in enumerate(weights)]


@needs_interp
@pytest.mark.parametrize("count", [1, 2, 8])
def test_interp_linear_many_takes_one_to_eight_weights(count):
    from lazoo.kernels.decode_linear import linear_many

    widths = [17, 1, 64, 65, 16, 5, 33, 2][:count]
    x, weights = make(3, 24, widths, F64, seed=count)
    for o, w in zip(linear_many(x, weights), weights):
        torch.testing.assert_close(o, F.linear(x, w), rtol=1e-12, atol=1e-12)
    biases = [None] * (count - 1) + [torch.randn(widths[count - 1], dtype=F64)]  # the last weight's (bit count - 1)
    for o, w, b in zip(linear_many(x, weights, biases), weights, biases):
        torch.testing.assert_close(o, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


@needs_interp
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_interp_gated_unit_equals_the_module(act):
    """float64 to the products' rounding; fp16 within one rounding of the unfused module's values (the kernel
    rounds where the module stores: the two products, the activation, the result)."""
    from lazoo.kernels.decode_linear import gated_linear_unit

    for dtype, tol in ((F64, 1e-12), (torch.float16, 2e-3)):
        x, (wg, wu) = make(4, 72, [40, 40], dtype, seed=1)
        got = gated_linear_unit(x, wg, wu, act)
        x64, g64, u64 = x.to(F64), wg.to(F64), wu.to(F64)
        want = ACTIVATIONS[act](F.linear(x64, g64)) * F.linear(x64, u64)
        assert got.shape == (4, 1, 40) and got.dtype == dtype
        assert rel_err(got, want) < tol, (dtype, rel_err(got, want))


def test_the_refusals_name_the_problem():
    from lazoo.kernels.decode_linear import check_supported, gated_linear_unit

    x, weights = make(2, 16, [8, 8], torch.float32, strided=False)
    assert check_supported(x, weights) is None
    assert "rows" in check_supported(torch.zeros(65, 16), weights)
    assert "1 to 8 weights" in check_supported(x, weights * 5)
    assert "contiguous [N, 16]" in check_supported(x, [weights[0].double()])
    assert "contiguous [N, 16]" in check_supported(x, [torch.zeros(16, 8).T])
    assert "float16/bfloat16/float32" in check_supported(x.to(torch.int32), weights)
    assert check_supported(x, weights, [None, torch.zeros(8)]) is None
    assert "2 biases for 1 weights" in check_supported(x, weights[:1], [None, None])
    assert "contiguous [8] vector" in check_supported(x, weights, [torch.zeros(9), None])
    assert "contiguous [8] vector" in check_supported(x, weights, [None, torch.zeros(8, dtype=torch.float64)])
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        gated_linear_unit(x, *weights, "swish")
    with pytest.raises(ValueError, match="one shape"):
        gated_linear_unit(x, weights[0], torch.zeros(4, 16))


@needs_interp
def test_interp_project_together_in_one_launch():
    """The fused steps' projections: one launch = the stacked product (float64), with a bias on some projections
    too (a mixer's β); a module that is not a plain Linear (here one with a forward hook, an adapter's way) runs as
    itself."""
    from lazoo.kernels import decode_linear

    x, _ = make(3, 32, [], F64)
    linears = [torch.nn.Linear(32, n, bias=False, dtype=F64) for n in (16, 5, 20)]
    calls = []
    real = decode_linear.launch_many
    decode_linear.launch_many = lambda *a: calls.append(1) or real(*a)
    try:
        got = project_together(x, linears, one_launch=True)
        want = project_together(x, linears)
        linears[1].bias = torch.nn.Parameter(torch.ones(5, dtype=F64))
        with_bias = project_together(x, linears, one_launch=True)
        handle = linears[2].register_forward_hook(lambda *a: None)
        hooked = project_together(x, linears, one_launch=True)
        handle.remove()
    finally:
        decode_linear.launch_many = real
    assert len(calls) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(with_bias[1], want[1] + 1, rtol=1e-12, atol=1e-12)
    for a, b in zip(hooked, with_bias):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_interp
@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_interp_gated_mlp_decode_equals_the_unfused_module(act):
    """GatedMLP with its switch on takes the kernel for a decode step's rows without autograd (float64: equal to
    rounding), not with autograd, not for more rows, not with a forward hook on a projection (an adapter's way)."""
    from lazoo.kernels import decode_linear

    mlp = GatedMLP(24, 40, act).double()
    x, more = torch.randn(3, 1, 24, dtype=F64), torch.randn(65, 1, 24, dtype=F64)
    with torch.no_grad():
        want = mlp(x)  # the switch's default: off on the CPU
    calls = []
    real = decode_linear.launch_gated_unit
    decode_linear.launch_gated_unit = lambda *a: calls.append(1) or real(*a)
    GatedMLP.fused_decode = True
    try:
        with torch.no_grad():
            got = mlp(x)
            mlp(more)  # more rows than a decode step's
        assert len(calls) == 1
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        mlp(x)  # autograd on
        handle = mlp.up_proj.register_forward_hook(lambda *a: None)
        with torch.no_grad():
            mlp(x)
        handle.remove()
        assert len(calls) == 1
    finally:
        GatedMLP.fused_decode = None
        decode_linear.launch_gated_unit = real


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_gpu_decode_products_equal_cublas(rows, dtype, tol):
    from lazoo.kernels.decode_linear import gated_linear_unit, linear_many

    widths = [768, 768, 768, 12, 12, 768]
    x, weights = make(rows, 768, widths, dtype, device="cuda")
    for o, w in zip(linear_many(x, weights), weights):
        assert rel_err(o.cpu(), F.linear(x, w).cpu().to(F64)) < tol
    biases = bias_every_other(weights)
    for o, w, b in zip(linear_many(x, weights, biases), weights, biases):
        assert rel_err(o.cpu(), F.linear(x, w, b).cpu().to(F64)) < tol
    mlp = GatedMLP(768, 3072).to("cuda", dtype)
    with torch.no_grad():
        fused = gated_linear_unit(x, mlp.gate_proj.weight, mlp.up_proj.weight)
        unfused = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    assert rel_err(fused.cpu(), unfused.cpu().to(F64)) < tol
