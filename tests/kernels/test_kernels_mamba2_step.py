"""The fused decode step of a Mamba-2 layer (lazoo.kernels.mamba2_step) against the unfused step in float64: the
output, the new state S and the shifted conv state, over the options (one group of B and C or several, a conv bias
or none, head dims split into blocks or not, sizes that are no power of two, strided projections, a pad, in place or
into new tensors); the layer's step with it equal to the layer's unfused step (dynamic and static caches, a pad);
and the Mamba-2 model's `generate` with it equal to its generate without it.

CPU: ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported (tests/test_interpreter.py runs
them in a fresh process). GPU: ``-m gpu``, fp32 and bf16 against the unfused layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from decode_helpers import assert_all_equal, assert_close_on_gpu  # noqa: E402

from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def reference_step(p, G, eps):
    """The unfused step written out in float64 from the inputs `p` (see `inputs`): `(out, S, conv state)`."""
    B, H, P, N = p["S"].shape
    real = p["mask"].bool() if p["mask"] is not None else torch.ones(B, dtype=torch.bool)
    new = torch.where(real[:, None], p["xBC"][:, 0], 0.0)
    padded = torch.cat([p["conv"], new[:, None]], dim=1)  # [B, W, C]
    y = (padded * p["weight"][:, 0].T[None]).sum(1)
    if p["bias"] is not None:
        y = y + p["bias"]
    x, Bg, Cg = F.silu(y).split([H * P, G * N, G * N], dim=-1)
    x = x.view(B, H, P)
    Bh, Ch = (t.view(B, G, N).repeat_interleave(H // G, dim=1) for t in (Bg, Cg))
    dt = F.softplus(p["dt"][:, 0] + p["dt_bias"])  # [B, H]
    decay = (-dt * p["A_log"].exp()).exp()
    S = decay[..., None, None] * p["S"] + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", S, Ch) + p["D"][:, None] * x
    S = torch.where(real[:, None, None, None], S, p["S"])
    y = torch.where(real[:, None, None], y, 0.0)
    h = (y.reshape(B, H * P) * F.silu(p["z"][:, 0])).unflatten(-1, (G, -1))
    h = h / (h.square().mean(-1, keepdim=True) + eps).sqrt()
    return (h.flatten(-2) * p["norm_weight"]).view(B, 1, H * P), S, padded[:, 1:]


def inputs(B, H, P, G, N, W, *, bias, pad, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, dtype=F64)).to(dtype)

    C = H * P + 2 * G * N
    state_dtype = torch.float32 if dtype != F64 else F64
    return {
        "z": rand(B, 1, H * P), "xBC": rand(B, 1, C), "dt": rand(B, 1, H),
        "conv": rand(B, W - 1, C), "weight": rand(C, 1, W, s=W ** -0.5), "bias": rand(C, s=0.2) if bias else None,
        "S": rand(B, H, P, N, s=0.5).to(state_dtype),
        "dt_bias": rand(H, s=0.5), "A_log": torch.rand(H, generator=gen, dtype=F64).mul(2).to(dtype),
        "D": rand(H), "norm_weight": 1 + rand(H * P, s=0.2),
        "mask": torch.tensor([1] * (B - 1) + [0], dtype=torch.bool) if pad else None,
    }


def fused(p, G, eps, in_place, device="cpu"):
    from lazoo.kernels.mamba2_step import mamba2_step

    d = {key: (value.to(device) if isinstance(value, torch.Tensor) else value) for key, value in p.items()}
    S, conv = d["S"].clone(), d["conv"].clone()
    out, S_new, conv_new = mamba2_step(
        d["z"], d["xBC"], d["dt"], conv, d["weight"], d["bias"], S, dt_bias=d["dt_bias"], A_log=d["A_log"],
        D=d["D"], norm_weight=d["norm_weight"], norm_eps=eps, groups=G, mask=d["mask"], in_place=in_place)
    if in_place:
        assert S_new is S and conv_new is conv
    else:  # the cached tensors are left as they were
        assert S_new is not S and torch.equal(S, d["S"]) and torch.equal(conv, d["conv"])
    return out, S_new, conv_new


def assert_step_equal(got, want, p):
    for name, a, b in (("out", got[0], want[0]), ("S", got[1], want[1])):
        assert a.dtype == F64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0, msg="conv state")
    if p["mask"] is not None:  # the pad's output is zero and its state unchanged
        assert not got[0][-1].any() and torch.equal(got[1][-1], p["S"][-1])


CASES = [  # heads H, head dim P, groups G, state size N, taps W, conv bias, pad, in place, rows per block of S
    (4, 8, 1, 16, 4, True, False, True, None),
    (4, 6, 2, 12, 3, False, True, False, None),
    (6, 40, 3, 16, 4, True, True, True, 16),  # P in three blocks, the last one partial
    (3, 5, 1, 20, 2, False, False, False, None),  # 2·G·N = 40 B/C channels shifted in shares of 14
]


@needs_interp
@pytest.mark.parametrize("H, P, G, N, W, bias, pad, in_place, block", CASES)
def test_interp_mamba2_step_equals_the_unfused_step_in_float64(H, P, G, N, W, bias, pad, in_place, block,
                                                             monkeypatch):
    from lazoo.kernels import mamba2_step

    if block is not None:  # blocks of `block` rows of S: the head dim split over several programs
        monkeypatch.setattr(mamba2_step, "STATE_TILE", block * 16)
    p = inputs(3, H, P, G, N, W, bias=bias, pad=pad, seed=H + P)
    assert_step_equal(fused(p, G, 1e-5, in_place), reference_step(p, G, 1e-5), p)


@needs_interp
def test_interp_mamba2_step_reads_strided_rows():
    """z, xBC and dt as views of one wider tensor (in_proj's output, NaN between them), as the layer passes them."""
    B, H, P, G, N, W = 2, 2, 6, 2, 8, 4
    p = inputs(B, H, P, G, N, W, bias=True, pad=True)
    widths = [H * P, H * P + 2 * G * N, H]
    gap = torch.full((B, 1, 3), float("nan"), dtype=F64)
    wide = torch.cat([p["z"], gap, p["xBC"], gap, p["dt"], gap], dim=-1)
    starts = [0, widths[0] + 3, widths[0] + widths[1] + 6]
    views = {n: wide[..., s:s + w] for n, s, w in zip(("z", "xBC", "dt"), starts, widths)}
    assert views["xBC"].stride(1) > widths[1] and torch.equal(views["dt"], p["dt"])
    assert_step_equal(fused({**p, **views}, G, 1e-5, in_place=False), reference_step(p, G, 1e-5), p)


def test_mamba2_step_refuses_what_it_cannot_compute():
    pytest.importorskip("triton")
    from lazoo.kernels.mamba2_step import mamba2_step

    p = inputs(2, 4, 8, 2, 16, 4, bias=False, pad=False)
    args = (p["z"], p["xBC"], p["dt"], p["conv"], p["weight"], None)
    kwargs = dict(dt_bias=p["dt_bias"], A_log=p["A_log"], D=p["D"], norm_weight=p["norm_weight"], norm_eps=1e-5)
    with pytest.raises(ValueError, match="groups = 3 must divide the 4 heads"):
        mamba2_step(*args, p["S"], groups=3, **kwargs)
    with pytest.raises(ValueError, match="state sizes up to 256, got N = 512"):
        mamba2_step(*args, p["S"].new_zeros(2, 4, 8, 512), groups=2, **kwargs)
    with pytest.raises(ValueError, match="xBC has 40 features per token, expected 96"):
        mamba2_step(p["z"], p["xBC"][..., :40], *args[2:], p["S"], groups=2, **kwargs)
    with pytest.raises(ValueError, match="conv state must have shape"):
        mamba2_step(*args[:3], p["conv"][:, :1], *args[4:], p["S"], groups=2, **kwargs)


def layer_steps(options, static, seed=0):
    """A float64 Mamba-2 layer's decode step after a left-padded prompt, with the fused step and without it, the
    batch's last row a pad at that step: `{fused: (output, S, conv state)}`."""
    from transformers import AutoConfig

    from lazoo.layers.mixers.mamba2 import Mamba2Mixer
    from lazoo.models.cache import LazooCache

    config = AutoConfig.for_model("lazoo_mamba2", hidden_size=24, num_attention_heads=3, num_hidden_layers=1,
                                  intermediate_size=0, **options)
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(config, 0, config.mixer_options("mamba2")).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompt, token = torch.randn(3, 5, 24, dtype=F64), torch.randn(3, 1, 24, dtype=F64)
    prompt_mask = torch.ones(3, 5, dtype=torch.bool)
    prompt_mask[0, :2] = False
    token_mask = torch.tensor([[True], [True], [False]])
    results = {}
    for fused_decode in (True, False):
        cache = LazooCache(1, static=static)
        Mamba2Mixer.fused_decode = fused_decode
        try:
            with torch.no_grad():
                mixer(prompt, mask=prompt_mask, cache=cache)
                before = cache.read_state(0)["op"]
                out = mixer(token, mask=token_mask, cache=cache)
        finally:
            Mamba2Mixer.fused_decode = None
        state = cache.read_state(0)
        assert (state["op"] is before) == static  # in place in a static cache
        results[fused_decode] = out, state["op"].clone(), state["conv"].clone()
    return results


@needs_interp
@pytest.mark.parametrize("options, static", [({"state_size": 5}, False),
                                             ({"num_heads": 6, "head_dim": 5, "n_groups": 3, "state_size": 4,
                                               "use_bias": True, "use_conv_bias": False, "conv_kernel": 3}, True)])
def test_interp_the_layers_fused_step_equals_its_unfused_step(options, static):
    results = layer_steps(options, static)
    for name, a, b in zip(("out", "S", "conv state"), results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def fused_and_unfused_generate(options, device="cpu", dtype=F64, tokens=6):
    """`generate` of a tiny Mamba-2 model with the fused step and without it (the mixer's switch), greedy,
    left-padded, the dynamic cache and the static one: (tokens, logits) of each."""
    from decode_helpers import fused_and_unfused_generate as run

    from lazoo.kernels import mamba2_step
    from lazoo.layers.mixers.mamba2 import Mamba2Mixer

    return run("mamba2", options, Mamba2Mixer, mamba2_step, "mamba2_step", device=device, dtype=dtype, tokens=tokens)


MODEL_CASES = [{}, {"n_groups": 2, "use_conv_bias": False, "conv_kernel": 3}]


@needs_interp
@pytest.mark.parametrize("options", MODEL_CASES[:1])
def test_interp_generate_with_the_fused_step_equals_generate_without(options):
    assert_all_equal(fused_and_unfused_generate(options, tokens=4))


@needs_interp
@pytest.mark.slow
@pytest.mark.parametrize("options", MODEL_CASES[1:])
def test_interp_generate_with_the_fused_step_equals_generate_without_slow(options):
    test_interp_generate_with_the_fused_step_equals_generate_without(options)


def test_the_fused_step_is_taken_only_where_it_applies():
    """On the CPU without the interpreter no layer takes it, nor with autograd on or the switch off; the options it
    does not compute are known at construction, with the reason."""
    from conftest import tiny_model

    from lazoo.layers.mixers.mamba2 import Mamba2Mixer

    mixer = tiny_model("mamba2", seed=2).model.layers[0].mixer
    assert mixer._fused_step_unsupported is None
    x = torch.zeros(1, 1, 32)
    with torch.no_grad():
        assert not mixer.fused_step_applies(x)  # auto on the CPU: PyTorch
        Mamba2Mixer.fused_decode = False
        try:
            assert not mixer.fused_step_applies(x)
        finally:
            Mamba2Mixer.fused_decode = None
    assert not mixer.fused_step_applies(x)  # autograd on
    for options, reason in (({"state_size": 512}, "state sizes up to 256"), ({"conv_kernel": 1}, "at least 2 taps")):
        assert reason in tiny_model("mamba2", seed=2, **options).model.layers[0].mixer._fused_step_unsupported


@needs_interp
def test_interp_options_it_cannot_compute_keep_the_unfused_step_saying_so_once(caplog):
    from conftest import tiny_model

    from lazoo.layers.mixers.mamba2 import Mamba2Mixer

    mixer = tiny_model("mamba2", seed=2, conv_kernel=1).model.layers[0].mixer
    Mamba2Mixer.fused_decode = True
    try:
        with torch.no_grad(), caplog.at_level("WARNING"):
            assert not any(mixer.fused_step_applies(torch.zeros(1, 1, 32, dtype=F64)) for _ in range(3))
    finally:
        Mamba2Mixer.fused_decode = None
    said = [r.getMessage() for r in caplog.records if "decoding with the unfused step" in r.getMessage()]
    assert said == ["mamba2_step: it takes convolutions of at least 2 taps, got conv_kernel = 1; decoding with the "
                    "unfused step."]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("options", MODEL_CASES)
def test_fused_step_generate_on_gpu(options):
    """On CUDA: the same greedy tokens as the unfused step in float32, logits within float32 / bf16 rounding."""
    assert_close_on_gpu(lambda dtype, tokens: fused_and_unfused_generate(options, device="cuda", dtype=dtype,
                                                                         tokens=tokens))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 8])
def test_mamba2_step_kernel_on_gpu(G):
    """Bamba's shapes (128 heads of 64, state 128), fp32, in place, a pad: within 1e-5 of the float64 step."""
    B, H, P, N, W = 4, 128, 64, 128, 4
    p = inputs(B, H, P, G, N, W, bias=True, pad=True, dtype=torch.float32)
    want = reference_step({key: (value.to(F64) if isinstance(value, torch.Tensor) and value.is_floating_point()
                                 else value) for key, value in p.items()}, G, 1e-5)
    got = fused(p, G, 1e-5, in_place=True, device="cuda")
    for a, b in zip(got, want):
        err = (a.cpu().to(F64) - b).norm() / b.norm()
        assert err < 1e-5, err
