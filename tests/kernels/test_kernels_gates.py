"""Triton kernels of a Gated DeltaNet layer's gates (lazoo.kernels.gates) against float64 PyTorch: g, beta and the
gradients of a, b, A_log and dt_bias for 1…48 heads, ragged row counts, several programs, fp32 / bf16 / fp16 inputs
with fp32 or bf16 parameters, neg_eigval, no b; softplus over a + dt_bias from −60 to 60 (torch's threshold, the
accuracy of log1p(e^z) for z ≪ 0); beta bit-equal to torch.sigmoid on bf16 and fp16; the layer's formulas.

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at [4, 4096, 32]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64
#: the norm-relative error allowed for a result stored in a dtype: its unit roundoff and fp32 arithmetic
TOL = {torch.float32: 2e-6, torch.bfloat16: 2.0 ** -8 + 2e-6, torch.float16: 2.0 ** -11 + 2e-6}


def reference(a, b, A_log, dt_bias, neg_eigval):
    """(g, beta) in float64, as the layer writes them (mamba2_log_decay, DeltaNetMixer.beta)."""
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = None if b is None else torch.sigmoid(b) * (2 if neg_eigval else 1)
    return g, beta


def inputs(shape, dtype, param_dtype, seed, spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    H = shape[-1]
    a = (torch.randn(shape, generator=gen, dtype=F64) * spread).to(dtype)
    b = (torch.randn(shape, generator=gen, dtype=F64) * spread).to(dtype)
    A_log = (torch.rand(H, generator=gen, dtype=F64) * 3 - 1).to(param_dtype)
    dt_bias = torch.randn(H, generator=gen, dtype=F64).to(param_dtype)
    return a, b, A_log, dt_bias, gen


def rel(got, want):
    got = got.detach().cpu().to(F64)
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def check(shape, dtype, param_dtype=torch.float32, neg_eigval=False, with_b=True, device="cpu", seed=0,
          tol_scale=1.0):
    """g, beta and the four gradients against float64 on the same (rounded) inputs, each at its dtype's rounding."""
    from lazoo.kernels.gates import gated_delta_gates

    a, b, A_log, dt_bias, gen = inputs(shape, dtype, param_dtype, seed)
    if not with_b:
        b = None
    ref_in = [None if x is None else x.to(F64).requires_grad_() for x in (a, b, A_log, dt_bias)]
    g_ref, beta_ref = reference(*ref_in, neg_eigval)
    pg = torch.randn(shape, generator=gen, dtype=F64)
    pb = torch.randn(shape, generator=gen, dtype=F64)
    loss = (g_ref * pg).sum() + ((beta_ref * pb).sum() if with_b else 0)
    wants = _grads(loss, ref_in)
    # the parameter gradients are sums over rows, whose fp32 rounding scales with the sums of their terms' sizes
    rows = tuple(range(len(shape) - 1))
    spread = {"dA_log": (g_ref * pg).abs().sum(rows).detach(), "ddt_bias": wants[0].abs().sum(rows)}

    got_in = [None if x is None else x.to(device).requires_grad_() for x in (a, b, A_log, dt_bias)]
    g, beta = gated_delta_gates(*got_in, neg_eigval=neg_eigval)
    assert g.dtype == torch.float32 and g.shape == shape
    if with_b:
        assert beta.dtype == dtype and beta.shape == shape
    else:
        assert beta is None
    loss = (g.to(F64) * pg.to(device)).sum() + ((beta.to(F64) * pb.to(device)).sum() if with_b else 0)
    gots = _grads(loss, got_in)
    case = f"shape={shape} {dtype} params {param_dtype} neg_eigval={neg_eigval} b={with_b}"
    results = [("g", g, g_ref, torch.float32), ("beta", beta, beta_ref, dtype)]
    for name, x, got, want in zip(("da", "db", "dA_log", "ddt_bias"), got_in, gots, wants):
        if x is not None:
            assert got.dtype == x.dtype, f"{name}: {got.dtype}, want {x.dtype} ({case})"
        results.append((name, got, want, None if x is None else x.dtype))
    for name, got, want, dt in results:
        if want is None:
            assert got is None, f"{name} should be None ({case})"
            continue
        want = want.detach()
        err = (got.detach().cpu().to(F64) - want).norm()
        bound = TOL[dt] * want.norm() + (2e-6 * spread[name].norm() if name in spread else 0)
        assert err <= bound * tol_scale, f"{name}: error {err:.2e}, bound {bound:.2e} ({case})"


def _grads(loss, xs):
    """d loss / d x for the tensors of ``xs`` (None where x is None)."""
    live = [x for x in xs if x is not None]
    it = iter(torch.autograd.grad(loss, live))
    return [None if x is None else next(it) for x in xs]


@pytest.fixture
def small_tiles(monkeypatch):
    """Row blocks of 4 rows: several programs (and their parameter-gradient partials) even at a few rows."""
    from lazoo.kernels import gates

    blocks = gates._blocks
    monkeypatch.setattr(gates, "_blocks", lambda R, H, device: (4, *blocks(R, H, device)[1:]))


@needs_interp
@pytest.mark.parametrize("H", [1, 3, 16, 48])
@pytest.mark.parametrize("lead", [(1,), (7,), (130,), (2, 37)])
def test_interp_fp32_matches_float64(H, lead):
    check((*lead, H), torch.float32)
    check((*lead, H), torch.float32, neg_eigval=True, seed=1)


@needs_interp
@pytest.mark.parametrize("H", [1, 3, 16, 48])
@pytest.mark.parametrize("lead", [(7,), (2, 37)])
def test_interp_fp32_several_programs(H, lead, small_tiles):
    check((*lead, H), torch.float32, seed=2)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_interp_half_precision_at_its_rounding(dtype, param_dtype, neg_eigval):
    for shape in ((130, 3), (2, 37, 48)):
        check(shape, dtype, param_dtype, neg_eigval, seed=3)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_interp_without_b(dtype, param_dtype):
    check((2, 37, 16), dtype, param_dtype, with_b=False, seed=4)


@needs_interp
def test_interp_only_one_output_used():
    """The gradient of an unused g or beta comes back as None to the kernel: only the other part runs."""
    from lazoo.kernels.gates import gated_delta_gates

    a, b, A_log, dt_bias, _ = inputs((2, 9, 5), torch.float32, torch.float32, seed=5)
    xs = [x.requires_grad_() for x in (a, b, A_log, dt_bias)]
    g, beta = gated_delta_gates(*xs)
    da, db, dA, ddt = torch.autograd.grad(beta.sum(), xs, allow_unused=True)
    assert da is None and dA is None and ddt is None
    torch.testing.assert_close(db, torch.sigmoid(b) * (1 - torch.sigmoid(b)), rtol=1e-6, atol=1e-7)
    g, beta = gated_delta_gates(*xs)
    da, db, dA, ddt = torch.autograd.grad(g.sum(), xs, allow_unused=True)
    assert db is None and da is not None and dA is not None and ddt is not None
    # only A_log wanted: still right
    g, _ = gated_delta_gates(a.detach(), None, A_log, dt_bias.detach())
    (dA,) = torch.autograd.grad(g.sum(), [A_log])
    torch.testing.assert_close(dA, g.sum((0, 1)), rtol=1e-6, atol=1e-6)


@needs_interp
@pytest.mark.parametrize("with_dt", [False, True])
def test_interp_softplus_from_minus_60_to_60(with_dt):
    """z = a + dt_bias over [−60, 60]: g finite, ≤ 0, and each element within a few fp32 ulps of float64 — also for
    z ≪ 0, where log(1 + e^z) would keep only e^z's digits above fp32's epsilon (1e-3 relative at z = −10), and
    around torch's threshold at 20. With dt_bias 0 (z exact in fp32) a few ulps; else the rounding of a + dt_bias
    in fp32 (|z| · 6e-8 relative) too. Gradients element by element as well."""
    from lazoo.kernels.gates import gated_delta_gates

    H = 16
    z = torch.linspace(-60, 60, 64 * H, dtype=F64)
    z = torch.cat([z, torch.tensor([-20.5, -15.0, -10.0, -1e-3, 0.0, 1e-3, 19.999, 20.0, 20.001] + [0.0] * 7,
                                   dtype=F64)])
    dt_bias = (torch.linspace(-3, 3, H, dtype=F64) if with_dt else torch.zeros(H, dtype=F64)).float()
    a = (z.view(-1, H) - dt_bias.to(F64)).float()
    A_log = torch.linspace(-2, 2, H).float()
    xs = [x.clone().requires_grad_() for x in (a, A_log, dt_bias)]
    g, _ = gated_delta_gates(xs[0], None, xs[1], xs[2])
    assert torch.isfinite(g).all() and (g <= 0).all()
    refs = [x.to(F64).requires_grad_() for x in (a, A_log, dt_bias)]
    g_ref, _ = reference(refs[0], None, refs[1], refs[2], False)
    rtol = 1e-5 if with_dt else 1e-6
    torch.testing.assert_close(g.to(F64), g_ref.detach(), rtol=rtol, atol=0)
    da, dA, ddt = torch.autograd.grad(g.sum(), xs)
    da_ref, dA_ref, ddt_ref = torch.autograd.grad(g_ref.sum(), refs)
    assert torch.isfinite(da).all()
    torch.testing.assert_close(da.to(F64), da_ref, rtol=rtol, atol=0)
    torch.testing.assert_close(dA.to(F64), dA_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(ddt.to(F64), ddt_ref, rtol=1e-5, atol=0)


def every_value(dtype, bound=20.0, H=32):
    """Every finite value of a 16-bit float dtype in [−bound, bound], as rows of H (a few repeated)."""
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits) & (bits.float().abs() <= bound)]
    return torch.cat([x, x[: (-x.numel()) % H]]).view(-1, H)


@needs_interp
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_interp_beta_bit_equals_torch_sigmoid_bf16(neg_eigval):
    """sigmoid in fp32 rounded once (to nearest even), as torch.sigmoid on a bf16 tensor: every bf16 value in
    [−20, 20], doubled or not."""
    from lazoo.kernels.gates import gated_delta_gates

    b = every_value(torch.bfloat16)
    _, beta = gated_delta_gates(b, b, torch.zeros(32), torch.zeros(32), neg_eigval=neg_eigval)
    assert torch.equal(beta, 2 * torch.sigmoid(b) if neg_eigval else torch.sigmoid(b))


@needs_interp
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_interp_beta_bit_equals_torch_sigmoid_fp16(neg_eigval):
    """fp16: torch.sigmoid's fp32 value rounded once, bit for bit, but where that value lies within the fp32 error
    of an exp (numpy's in the interpreter, torch's vectorised one; a few fp32 ulps apart) of a midpoint between two
    fp16 values: 2 of the 39426 values in [−20, 20]. Doubled in fp32 before the rounding (torch's 2 * sigmoid(b)
    rounds twice where the fp16 sigmoid is subnormal)."""
    from lazoo.kernels.gates import gated_delta_gates

    b = every_value(torch.float16)
    _, beta = gated_delta_gates(b, b, torch.zeros(32), torch.zeros(32), neg_eigval=neg_eigval)
    s = torch.sigmoid(b.float()) * (2 if neg_eigval else 1)  # torch.sigmoid(b) is s.half() without neg_eigval
    if not neg_eigval:
        assert torch.equal(torch.sigmoid(b), s.half())
    bad = beta != s.half()
    assert bad.sum() <= 4, bad.sum()
    near = [(s[bad].view(torch.int32) + d).view(torch.float32).half() for d in range(-3, 4)]
    assert torch.stack(near).eq(beta[bad]).any(0).all()  # the rounding of a value a few fp32 ulps away


@needs_interp
def test_interp_layer_formulas():
    """The layer's own expressions in fp32 / bf16 (mamba2_log_decay, β = sigmoid(b_proj(x)) in x's dtype): g to
    fp32 rounding with the same sign (never positive), beta equal."""
    from lazoo.kernels.gates import gated_delta_gates

    a, b, A_log, dt_bias, _ = inputs((2, 37, 16), torch.bfloat16, torch.float32, seed=6, spread=6.0)
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    g_torch = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    torch.testing.assert_close(g, g_torch, rtol=2e-6, atol=0)
    assert torch.equal(torch.sign(g), torch.sign(g_torch)) and (g <= 0).all()
    assert torch.equal(beta, torch.sigmoid(b))


@needs_interp
def test_interp_no_rows():
    from lazoo.kernels.gates import gated_delta_gates

    xs = [torch.zeros(0, 4).requires_grad_(), torch.zeros(0, 4).requires_grad_(), torch.zeros(4).requires_grad_(),
          torch.zeros(4).requires_grad_()]
    g, beta = gated_delta_gates(*xs)
    assert g.shape == beta.shape == (0, 4)
    grads = torch.autograd.grad(g.sum() + beta.sum(), xs)
    assert [tuple(x.shape) for x in grads] == [(0, 4), (0, 4), (4,), (4,)]
    assert not grads[2].any() and not grads[3].any()


@needs_interp
def test_interp_non_contiguous_inputs():
    from lazoo.kernels.gates import gated_delta_gates

    a, b, A_log, dt_bias, _ = inputs((2, 37, 16), torch.float32, torch.float32, seed=7)
    at, bt = a.transpose(0, 1), b.transpose(0, 1)
    g, beta = gated_delta_gates(at, bt, A_log, dt_bias)
    g_ref, beta_ref = reference(at.to(F64), bt.to(F64), A_log.to(F64), dt_bias.to(F64), False)
    assert rel(g, g_ref) < 2e-6 and rel(beta, beta_ref) < 2e-6


def test_block_rule_fills_the_gpu(monkeypatch):
    """4k–32k rows of 16–64 heads: at least two programs an SM of 132, 256 to 2048 elements each, warps for ~8 a
    thread."""
    from lazoo.kernels import gates

    monkeypatch.setattr(gates, "num_sms", lambda device: 132)
    for R in (4096, 8192, 32768):
        for H in (16, 32, 48, 64):
            BR, BH, warps = gates._blocks(R, H, torch.device("cuda"))
            assert BH >= H and 256 <= BR * BH <= 2048 and BR * BH == 256 * warps
            assert -(-R // BR) >= 264 or BR * BH == 256, (R, H, BR)


def test_unsupported_inputs_are_named():
    from lazoo.kernels.gates import check_supported, gated_delta_gates

    x, p = torch.zeros(2, 3, 4), torch.zeros(4)
    if not INTERP:
        assert "TRITON_INTERPRET" in check_supported(x, x, p, p)
    else:
        assert check_supported(x, x, p, p) is None
        assert check_supported(x, None, p.bfloat16(), p) is None
    assert "dtype" in check_supported(x.double(), x, p, p)
    assert "dtype" in check_supported(x, x.double(), p, p)
    assert "dtype" in check_supported(x, x, p.double(), p)
    assert "shape" in check_supported(x, x, torch.zeros(3), p)
    assert "shape" in check_supported(x, x, p, torch.zeros(1, 4))
    assert "shape" in check_supported(x, torch.zeros(2, 4, 4), p, p)
    assert "heads" in check_supported(torch.zeros(2, 0), None, torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="gated_delta_gates: .*dtype"):
        gated_delta_gates(x.double(), None, p, p)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_matches_float64():
    from lazoo.kernels.gates import gated_delta_gates

    shape = (4, 4096, 32)
    # the GPU's exp (ex2.approx) and sigmoid differ from the CPU's by a few fp32 ulps: a looser bound
    check(shape, torch.bfloat16, torch.float32, device="cuda", tol_scale=2.0)
    check(shape, torch.bfloat16, torch.bfloat16, neg_eigval=True, device="cuda", tol_scale=2.0)
    a, b, A_log, dt_bias, _ = inputs(shape, torch.bfloat16, torch.float32, seed=8)
    a, b, A_log, dt_bias = (x.cuda() for x in (a, b, A_log, dt_bias))
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    g_torch = -A_log.exp() * F.softplus(a.float() + dt_bias)
    assert (g <= 0).all() and rel(g, g_torch.cpu().to(F64)) < 1e-5
    # beta: torch's fp32 sigmoid rounded once; the two exps may differ in the last fp32 bit, rarely flipping a
    # rounding
    assert (beta != torch.sigmoid(b)).float().mean() < 1e-3


@needs_interp
@pytest.mark.parametrize("use_beta,neg_eigval", [(True, False), (True, True), (False, False)])
def test_interp_gated_deltanet_layer_takes_the_kernel(use_beta, neg_eigval, monkeypatch):
    """The layer's `gates` on the kernel (as on CUDA) gives its PyTorch form's g, β and parameter gradients."""
    from transformers import AutoConfig

    from lazoo.kernels import gates as kg
    from lazoo.layers.mixers import delta as mixers
    from lazoo.layers.mixers import mixer_class

    config = AutoConfig.for_model("lazoo_gated_delta_net", hidden_size=32, num_attention_heads=4,
                                  mixer_kwargs={"gated_delta_net": {"use_beta": use_beta,
                                                                    "allow_neg_eigval": neg_eigval}})
    torch.manual_seed(0)
    layer = mixer_class("gated_delta_net")(config, 0, config.mixer_options("gated_delta_net"))
    x = torch.randn(2, 9, 32)
    calls = []
    real = kg.gated_delta_gates

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def run(kernel: bool):
        monkeypatch.setattr(mixers, "gates_kernel_runs", lambda *a: kernel)
        monkeypatch.setattr(kg, "gated_delta_gates", counted)
        layer.zero_grad(set_to_none=True)
        g, beta = layer.gates(x)
        proj = torch.randn(g.shape, generator=torch.Generator().manual_seed(1))
        ((g * proj).sum() + (beta * proj.flip(0)).sum()).backward()
        return g.detach(), beta.detach(), {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}

    g_k, beta_k, grads_k = run(True)
    assert calls == [1]
    g_t, beta_t, grads_t = run(False)
    assert calls == [1] and g_k.dtype == g_t.dtype == torch.float32 and beta_k.dtype == beta_t.dtype
    torch.testing.assert_close(g_k, g_t, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(beta_k, beta_t, rtol=1e-6, atol=1e-7)
    assert grads_k.keys() == grads_t.keys() >= {"A_log", "dt_bias", "a_proj.weight"}
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-5, atol=1e-6, msg=name)
