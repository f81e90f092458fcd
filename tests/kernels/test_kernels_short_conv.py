"""Triton kernels of the depthwise causal short convolution (lazoo.kernels.short_conv) against a float64
per-position loop: outputs and the gradients of x and the weights, SiLU or none, K = 1…4, ragged T, channel
counts that are not a multiple of the block; ShortConvolution with the kernel equal to its conv1d path
(padding mask, the state it hands on) and its backend choice (``backend=``, LAZOO_BACKEND, the reasons a forced
"triton" cannot run).

CPU (default run): ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu``, bf16 at T = 2048."""

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


def loop_reference(x, w, silu, cu=None):
    """y_t = act(Σ_j w[:, j] x_{t−(K−1−j)}), one position at a time (float64); with the packed boundaries ``cu``,
    only the positions of t's own sequence."""
    B, T, C = x.shape
    K = w.shape[1]
    y = torch.zeros(B, T, C, dtype=F64)
    first = [0] * T if cu is None else [max(b for b in cu if b <= t) for t in range(T)]
    for t in range(T):
        acc = torch.zeros(B, C, dtype=F64)
        for j in range(K):
            s = t - (K - 1 - j)
            if s >= first[t]:
                acc = acc + w[:, j] * x[:, s]
        y[:, t] = F.silu(acc) if silu else acc
    return y


def check(B, T, C, K, silu, dtype, tol, device="cpu", seed=0, cu=None):
    """The kernel against ``loop_reference``: output, dx and dw; ``cu``: packed boundaries (B = 1)."""
    from lazoo.kernels.short_conv import short_conv
    from lazoo.ops.packing import packed_row_starts

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=F64)
    w = torch.randn(C, 1, K, generator=gen, dtype=F64) / K ** 0.5
    proj = torch.randn(B, T, C, generator=gen, dtype=F64)
    xr, wr = x.to(dtype).to(F64).requires_grad_(), w.float().to(F64).requires_grad_()
    ref = loop_reference(xr, wr[:, 0], silu, cu)
    gx_ref, gw_ref = torch.autograd.grad((ref * proj).sum(), (xr, wr))
    xk = x.to(dtype).to(device).requires_grad_()
    wk = w.float().to(device).requires_grad_()
    starts = None if cu is None else packed_row_starts(torch.tensor(cu, device=device), T, device)
    y = short_conv(xk, wk, "silu" if silu else None, starts=starts)
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
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_interp_a_half_precision_weight_is_read_as_it_is(w_dtype):
    """A bf16 model's conv weight goes to the kernels without a cast op; dw comes back in its dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lazoo.kernels.short_conv import short_conv

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Casts.count += func.overloadpacket.__name__ == "_to_copy"
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, 24, generator=gen, dtype=F64).to(w_dtype)
    w = (torch.randn(24, 1, 4, generator=gen, dtype=F64) / 2).to(w_dtype)
    proj = torch.randn(2, 19, 24, generator=gen, dtype=F64)
    xr, wr = x.to(F64).requires_grad_(), w.to(F64).requires_grad_()
    ref = loop_reference(xr, wr[:, 0], True)
    gx_ref, gw_ref = torch.autograd.grad((ref * proj).sum(), (xr, wr))
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    with Casts():
        y = short_conv(xk, wk, "silu")
    assert Casts.count == 0
    gx, gw = torch.autograd.grad((y.to(F64) * proj).sum(), (xk, wk))
    assert gw.dtype == w_dtype and gx.dtype == w_dtype
    for name, got, want in (("y", y, ref), ("dx", gx, gx_ref), ("dw", gw, gw_ref)):
        err = (got.detach().to(F64) - want).norm() / want.norm()
        assert err < 2e-2, f"{name}: relative error {err:.2e} ({w_dtype})"


@needs_interp
@pytest.mark.parametrize("silu", [True, False])
def test_interp_a_slice_of_a_wider_projection_is_read_in_place(silu, monkeypatch):
    """x as the middle third of a [B, T, 3C] projection (rows 3C apart): the kernels get it where it is (no copy),
    with the same outputs and gradients as from a contiguous copy."""
    from lazoo.kernels import short_conv as ksc

    monkeypatch.setattr(ksc, "_bwd_blocks", lambda B, T, C: (5, 4, 16, 1))  # several runs and channel blocks
    strides = []
    apply = ksc._ShortConv.apply
    monkeypatch.setattr(ksc._ShortConv, "apply", lambda x, *a: strides.append(x.stride()) or apply(x, *a))
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 21, 3 * 20, generator=gen)
    w = torch.randn(20, 1, 4, generator=gen) / 2
    proj = torch.randn(2, 21, 20, generator=gen)
    results = []
    for x in (wide[..., 20:40].detach().requires_grad_(), wide[..., 20:40].contiguous().requires_grad_()):
        wk = w.clone().requires_grad_()
        y = ksc.short_conv(x, wk, "silu" if silu else None)
        results.append((y, *torch.autograd.grad((y * proj).sum(), (x, wk))))
    assert strides == [(21 * 60, 60, 1), (21 * 20, 20, 1)]
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = loop_reference(wide[..., 20:40].double(), w.double()[:, 0], silu)
    torch.testing.assert_close(results[0][0].double(), ref, rtol=1e-5, atol=1e-5)


@needs_interp
@pytest.mark.parametrize("L,R,BC", [(6, 4, 8), (4, 8, 16), (1, 1, 16)])
@pytest.mark.parametrize("silu", [True, False])
def test_interp_backward_runs_and_load_groups(L, R, BC, silu, monkeypatch):
    """The backward walks runs of L rows, loading R rows at a time: several groups a run, runs that end inside
    a group, a final partial run (T not a multiple of L), groups longer than a run, one-row runs, T < K, the
    widest K, channel blocks that end past C; B = 3."""
    from lazoo.kernels import short_conv as ksc

    monkeypatch.setattr(ksc, "_bwd_blocks", lambda B, T, C: (L, R, BC, 1))
    for T, C, K in ((23, 13, 4), (2, 5, 4), (11, 9, 8), (9, 6, 1)):
        check(3, T, C, K, silu, torch.float32, 1e-6)


@needs_interp
def test_interp_backward_at_the_gpu_block_sizes(monkeypatch):
    """The launch settings CUDA gets (R = 8 rows a load, 256 channels a program), here over several runs with a
    final partial one and a partial channel block."""
    from lazoo.kernels import short_conv as ksc

    monkeypatch.setattr(ksc, "is_interpreting", lambda: False)
    assert ksc._bwd_blocks(2, 70, 300) == (8, 8, 256, 2)
    for silu in (True, False):
        check(2, 70, 300, 4, silu, torch.float32, 1e-6)


@needs_interp
@pytest.mark.parametrize("L,R,BC", [(7, 3, 16), (4, 8, 8), (1, 1, 16)])
@pytest.mark.parametrize("silu", [True, False])
def test_interp_packed_sequences_match_the_loop(L, R, BC, silu, monkeypatch):
    """Packed sequences (B = 1): no position reads another sequence's inputs, forward or backward: ragged lengths
    (one of a single token, an empty one, ones shorter than K, a start inside a run and inside a load group), K = 1
    to 4 and 8, runs and load groups of several sizes, channel blocks that end past C."""
    from lazoo.kernels import short_conv as ksc

    monkeypatch.setattr(ksc, "_bwd_blocks", lambda B, T, C: (L, R, BC, 1))
    for cu, C, K in (([0, 1, 1, 3, 11, 12, 29], 13, 4), ([0, 9, 10, 25], 6, 8), ([0, 5, 6, 20], 9, 1),
                     ([0, 2, 4, 6, 17], 5, 2), ([0, 17], 7, 3)):
        check(1, cu[-1], C, K, silu, torch.float32, 1e-6, cu=cu)


@needs_interp
def test_interp_packed_module_kernel_equals_its_pytorch_form(kernel_calls, monkeypatch):
    """ShortConvolution on packed sequences: the kernel and the masked PyTorch form agree in output and
    gradients."""
    from lazoo.layers import short_conv as sc

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    monkeypatch.setattr(sc, "PACKED_KERNEL", True)
    conv = sc.ShortConvolution(11, 4, "silu")
    cu = torch.tensor([0, 3, 4, 19, 30])
    x = torch.randn(1, 30, 11, requires_grad=True)
    kernel_calls.clear()
    y = conv(x, cu_seqlens=cu, backend="triton")[0]
    assert kernel_calls
    y_ref = conv._packed(x, cu)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, conv.weight), g)
    want = torch.autograd.grad(y_ref, (x, conv.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_packed_starts_are_checked():
    from lazoo.kernels.short_conv import short_conv

    with pytest.raises(ValueError, match="starts"):
        short_conv(torch.zeros(2, 5, 3), torch.zeros(3, 1, 4), starts=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="starts"):
        short_conv(torch.zeros(1, 5, 3), torch.zeros(3, 1, 4), starts=torch.zeros(5, dtype=torch.int64))


def test_backward_launch_rule(monkeypatch):
    """Enough programs for 132 multiprocessors at small B·T; few (about 1024 to 2048) at large B·T."""
    import triton

    from lazoo.kernels import short_conv as ksc

    monkeypatch.setattr(ksc, "is_interpreting", lambda: False)

    def programs(B, T, C):
        L, R, BC, warps = ksc._bwd_blocks(B, T, C)
        assert BC == 4 * 32 * warps and R == 8
        return B * triton.cdiv(T, L) * triton.cdiv(C, BC), L

    assert programs(1, 512, 768)[0] >= 132
    assert programs(1, 4096, 2048) == (1024, 32)
    for shape in ((1, 32768, 2048), (8, 2048, 2048)):
        n, L = programs(*shape)
        assert L == 128 and 1024 <= n <= 2048, (shape, n, L)


@needs_interp
@pytest.mark.parametrize("output_state", [False, True])
def test_interp_module_kernel_equals_conv1d(output_state):
    from lazoo.layers import short_conv as sc

    torch.manual_seed(0)
    conv = sc.ShortConvolution(12, 4, "silu")
    x = torch.randn(3, 9, 12, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded sample
    outs = {}
    for backend in ("chunk", "triton"):
        y, st = conv(x, mask=mask, output_state=output_state, backend=backend)
        gx, gw = torch.autograd.grad((y * torch.linspace(-1, 1, 12)).sum(), (x, conv.weight))
        outs[backend] = (y, st, gx, gw)
    (y0, s0, gx0, gw0), (y1, s1, gx1, gw1) = outs["chunk"], outs["triton"]
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-5)
    if output_state:
        assert torch.equal(s1, s0)  # the same last K − 1 (masked) inputs
    else:
        assert s0 is None and s1 is None
    short = conv(x[:, :2], output_state=True, backend="triton")[1]  # T < K − 1: zeros before the inputs
    assert torch.equal(short, conv(x[:, :2], output_state=True, backend="chunk")[1])


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls of the Triton kernel (lazoo.kernels.short_conv.short_conv), one entry each."""
    from lazoo.kernels import short_conv as ksc

    calls, kernel = [], ksc.short_conv
    monkeypatch.setattr(ksc, "short_conv", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls


@needs_interp
@pytest.mark.parametrize("backend,env,kernel", [("triton", None, True), ("chunk", None, False),
                                                ("recurrent", "triton", False), (None, "triton", True),
                                                (None, "chunk", False), (None, None, False)])
def test_interp_backend_choice(backend, env, kernel, kernel_calls, monkeypatch):
    """backend= wins over LAZOO_BACKEND; "triton" runs the kernel (here under the interpreter), "chunk" and
    "recurrent" conv1d; auto takes the kernel on CUDA only, so conv1d on these CPU tensors."""
    from lazoo.layers.short_conv import ShortConvolution

    if env is None:
        monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LAZOO_BACKEND", env)
    conv = ShortConvolution(6, 3, None)
    x = torch.randn(2, 7, 6)
    y, _ = conv(x, backend=backend)
    assert bool(kernel_calls) == kernel
    ref = F.conv1d(F.pad(x.transpose(1, 2), (2, 0)), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@needs_interp
def test_interp_forced_triton_names_what_the_kernel_does_not_take():
    from lazoo.layers.short_conv import ShortConvolution

    x = torch.randn(1, 5, 4)
    with pytest.raises(NotImplementedError, match="float64"):
        ShortConvolution(4, 4).double()(x.double(), backend="triton")
    with pytest.raises(NotImplementedError, match="kernel_size up to 8, got 9"):
        ShortConvolution(4, 9)(x, backend="triton")
    assert ShortConvolution(4, 9)(x)[0].shape == x.shape  # auto: conv1d


@needs_interp
def test_interp_a_cached_state_runs_the_kernel_over_the_cached_inputs(kernel_calls, monkeypatch):
    """Decoding with forced "triton" (or LAZOO_BACKEND=triton): the kernel runs over the K − 1 cached inputs and
    the new ones, exactly as conv1d does; packed sequences take the kernel's packed form, or with PACKED_KERNEL off
    the PyTorch form, which agrees with it."""
    from lazoo.layers import short_conv as sc
    from lazoo.layers.short_conv import ShortConvolution

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    torch.manual_seed(1)
    conv = ShortConvolution(4, 3)
    x, state = torch.randn(2, 5, 4), torch.randn(2, 2, 4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    y0, s0 = conv(x, mask=mask, state=state, output_state=True, backend="chunk")
    assert not kernel_calls
    y1, s1 = conv(x, mask=mask, state=state, output_state=True, backend="triton")
    assert len(kernel_calls) == 1
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert torch.equal(s1, s0)
    monkeypatch.setenv("LAZOO_BACKEND", "triton")
    torch.testing.assert_close(conv(x[:, -1:], state=state)[0], conv(x[:, -1:], state=state, backend="chunk")[0],
                               rtol=1e-5, atol=1e-6)
    cu = torch.tensor([0, 2, 5])
    calls = len(kernel_calls)
    packed = conv(x[:1], cu_seqlens=cu, backend="triton")[0]
    assert len(kernel_calls) == calls + 1  # the packed kernel form, the default
    monkeypatch.setattr(sc, "PACKED_KERNEL", False)
    torch.testing.assert_close(conv(x[:1], cu_seqlens=cu, backend="triton")[0], packed, rtol=1e-5, atol=1e-6)
    assert len(kernel_calls) == calls + 1  # switched off: the PyTorch form
    torch.testing.assert_close(packed, conv(x[:1], cu_seqlens=cu, backend="chunk")[0], rtol=1e-5, atol=1e-6)


def test_forced_triton_that_cannot_run_raises_with_the_reason(monkeypatch):
    """Known before any launch: Triton missing (then the device and the kernel's own checks); auto runs conv1d."""
    from lazoo.layers import short_conv as sc

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    conv = sc.ShortConvolution(4, 3)
    x = torch.randn(1, 5, 4)
    monkeypatch.setattr(sc, "triton_missing", lambda: "Triton is not installed")
    with pytest.raises(NotImplementedError, match="Triton is not installed"):
        conv(x, backend="triton")
    monkeypatch.setenv("LAZOO_BACKEND", "triton")
    with pytest.raises(NotImplementedError, match="LAZOO_BACKEND.*Triton is not installed"):
        conv(x, state=torch.randn(1, 2, 4))
    monkeypatch.delenv("LAZOO_BACKEND")
    assert conv(x)[0].shape == x.shape
    with pytest.raises(ValueError, match="unknown backend 'torch'"):
        conv(x, backend="torch")


def test_forced_triton_on_plain_cpu_says_what_is_missing():
    if INTERP:
        pytest.skip("the interpreter runs CPU tensors here")
    from lazoo.layers.short_conv import ShortConvolution

    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET"):
        ShortConvolution(4, 3)(torch.randn(1, 5, 4), backend="triton")


def test_unsupported_inputs_are_named():
    from lazoo.kernels.short_conv import check_supported, short_conv

    assert "dtype" in check_supported(torch.zeros(1, 2, 3, dtype=F64), 4)
    assert "kernel_size" in check_supported(torch.zeros(1, 2, 3), 9)
    assert "activation" in check_supported(torch.zeros(1, 2, 3), 4, "gelu")
    with pytest.raises(ValueError, match="activation"):
        short_conv(torch.zeros(1, 2, 3), torch.zeros(3, 1, 4), "gelu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("K,silu", [(4, True), (2, False)])
def test_gpu_bf16_matches_loop_and_conv1d(K, silu, kernel_calls, monkeypatch):
    check(2, 300, 96, K, silu, torch.bfloat16, 2e-2, device="cuda")
    check(2, 300, 96, K, silu, torch.float32, 1e-5, device="cuda")
    from lazoo.layers import short_conv as sc

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    conv = sc.ShortConvolution(768, K, "silu" if silu else None).cuda()
    x = torch.randn(2, 2048, 768, device="cuda", dtype=torch.bfloat16)
    kernel_calls.clear()
    y = conv(x)[0]
    assert kernel_calls  # auto takes the kernel on CUDA
    ref = F.conv1d(F.pad(x.float().transpose(1, 2), (K - 1, 0)), conv.weight.float(), groups=768).transpose(1, 2)
    ref = F.silu(ref) if silu else ref
    assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("silu", [True, False])
def test_gpu_packed_sequences_match_the_loop(silu):
    cu = [0, 1, 5, 300, 301, 700, 1000]
    check(1, 1000, 96, 4, silu, torch.bfloat16, 2e-2, device="cuda", cu=cu)
    check(1, 1000, 96, 4, silu, torch.float32, 1e-5, device="cuda", cu=cu)


@pytest.mark.gpu
@needs_cuda
def test_gpu_backward_is_deterministic():
    """dw sums per-program partial rows in a fixed order (no atomics): the same bits on every run."""
    from lazoo.kernels.short_conv import short_conv

    x = torch.randn(2, 3000, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, 1, 4, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    runs = [torch.autograd.grad(short_conv(x, w), (x, w), dy) for _ in range(3)]
    for gx, gw in runs[1:]:
        assert torch.equal(gx, runs[0][0]) and torch.equal(gw, runs[0][1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_slice_of_a_wider_projection_equals_its_copy():
    """x as the k slice of a [2, 2048, 3 · 768] bf16 projection (rows 2304 apart) and a bf16 weight: the same bits as
    from a contiguous copy, forward and backward."""
    from lazoo.kernels.short_conv import short_conv

    wide = torch.randn(2, 2048, 3 * 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1, 4, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 2048, 768, device="cuda", dtype=torch.bfloat16)
    out = []
    for x in (wide[..., 768:1536], wide[..., 768:1536].contiguous()):
        x, wk = x.detach().requires_grad_(), w.clone().requires_grad_()
        y = short_conv(x, wk)
        out.append((y, *torch.autograd.grad(y, (x, wk), dy)))
    for got, want in zip(*out):
        assert torch.equal(got, want)
