"""The one-kernel decode step of DeltaNet, Gated DeltaNet and Kimi Delta Attention layers (lazoo.kernels.delta_step)
against the unfused step in float64: the output, the new state S and the shifted conv states, over the options the
kernel computes (gate or none, a decay per key channel, β or none, negative eigenvalues, output norm with or without
weight or none, output gate SiLU, sigmoid or none, conv biases, grouped value heads, a pad, in place or into new
tensors); and the models' `generate` with it equal to their generate without it.

CPU: ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported (tests/test_interpreter.py runs
them in a fresh process). GPU: ``-m gpu``, bf16 against the unfused layer."""

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


def reference_step(p, H, HV, scale, neg_eigval, eps, gate_activation, key_gate=None, bound=None):
    """The unfused step, written out in float64 from the inputs `p` (see `inputs`); `key_gate` "softplus" or
    "bounded" (with `bound`): Kimi Delta Attention's decay per key channel from `a` `[B, 1, HV·dk]`."""
    B = p["q"].shape[0]
    real = p["mask"].bool() if p["mask"] is not None else torch.ones(B, dtype=torch.bool)
    streams, conv = {}, {}
    for n in "qkv":
        x = torch.where(real[:, None], p[n][:, 0], 0.0)
        padded = torch.cat([p["conv"][n], x[:, None]], dim=1)  # [B, W, C]
        y = (padded * p["weights"][n][:, 0].T[None]).sum(1)
        if p["biases"] is not None:
            y = y + p["biases"][n]
        streams[n], conv[n] = F.silu(y), padded[:, 1:]
    K = streams["q"].shape[1] // H
    V = streams["v"].shape[1] // HV
    q, k = (streams[n].view(B, H, K) for n in "qk")
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() * scale
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    q, k = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))
    v = streams["v"].view(B, HV, V)
    beta = torch.sigmoid(p["b"][:, 0]) if p["b"] is not None else torch.ones(B, HV, dtype=F64)
    beta = 2 * beta if neg_eigval else beta
    S = p["S"].clone()
    if key_gate is not None:  # S Diag(α): a decay per value head and key channel
        z = (p["a"][:, 0] + p["dt_bias"]).view(B, HV, K)
        rate = p["A_log"].exp()[:, None]
        log_a = -rate * F.softplus(z) if key_gate == "softplus" else bound * torch.sigmoid(rate * z)
        S = S * log_a.exp()[:, :, None, :]
    elif p["a"] is not None:
        S = S * (-p["A_log"].exp() * F.softplus(p["a"][:, 0] + p["dt_bias"])).exp()[..., None, None]
    u = v - torch.einsum("bhvk,bhk->bhv", S, k)
    S = S + (beta[..., None] * u)[..., None] * k[:, :, None, :]
    o = torch.einsum("bhvk,bhk->bhv", S, q)
    S = torch.where(real[:, None, None, None], S, p["S"])
    o = torch.where(real[:, None, None], o, 0.0)
    if eps is not None:
        o = o / (o.square().mean(-1, keepdim=True) + eps).sqrt()
        if p["norm_weight"] is not None:
            o = o * p["norm_weight"]
    if gate_activation is not None:
        act = F.silu if gate_activation == "silu" else torch.sigmoid
        o = o * act(p["gate"][:, 0].view(B, HV, V))
    return o.reshape(B, 1, HV * V), S, conv


def inputs(B, H, HV, K, V, W, *, gated, use_beta, norm, affine, gate, bias, pad, dtype=F64, seed=0, key_gate=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, dtype=F64)).to(dtype)

    widths = {"q": H * K, "k": H * K, "v": HV * V}
    p = {n: rand(B, 1, c) for n, c in widths.items()}
    p["conv"] = {n: rand(B, W - 1, c) for n, c in widths.items()}
    p["weights"] = {n: rand(c, 1, W, s=W ** -0.5) for n, c in widths.items()}
    p["biases"] = {n: rand(c, s=0.1) for n, c in widths.items()} if bias else None
    p["S"] = rand(B, HV, V, K, s=0.5).to(torch.float32 if dtype != F64 else F64)
    gates = HV * K if key_gate else HV
    p["a"] = rand(B, 1, gates) if gated else None
    p["A_log"] = torch.rand(HV, generator=gen, dtype=F64).mul(2).to(torch.float32 if dtype != F64 else F64)
    p["dt_bias"] = rand(gates, s=0.5).to(p["A_log"].dtype)
    p["b"] = rand(B, 1, HV) if use_beta else None
    p["norm_weight"] = (1 + rand(V, s=0.2)) if norm and affine else None
    p["gate"] = rand(B, 1, HV * V) if gate else None
    p["mask"] = torch.tensor([1] * (B - 1) + [0], dtype=torch.long) if pad else None
    return p


def fused(p, H, HV, scale, neg_eigval, eps, gate_activation, in_place, device="cpu", key_gate=None, bound=None):
    from lazoo.kernels.delta_step import delta_step

    d = {key: (value.to(device) if isinstance(value, torch.Tensor) else value) for key, value in p.items()}
    for key in ("conv", "weights", "biases"):
        d[key] = None if p[key] is None else {n: t.to(device).clone() for n, t in p[key].items()}
    S = d["S"].clone()
    out, S_new, conv_new = delta_step(
        d["q"], d["k"], d["v"], d["conv"], d["weights"], d["biases"], S, heads=H, value_heads=HV, scale=scale,
        a=d["a"], A_log=d["A_log"] if d["a"] is not None else None,
        dt_bias=d["dt_bias"] if d["a"] is not None else None, b=d["b"], neg_eigval=neg_eigval,
        norm_weight=d["norm_weight"], norm_eps=eps, gate=d["gate"],
        gate_activation=gate_activation if d["gate"] is not None else None, mask=d["mask"], in_place=in_place,
        key_gate=key_gate, gate_lower_bound=bound, round_to_dtype=key_gate is None)  # as each layer calls it
    if in_place:
        assert S_new is S and all(conv_new[n] is d["conv"][n] for n in "qkv")
    else:
        assert S_new is not S and torch.equal(S, d["S"])  # the cached state is left as it was
    return out, S_new, conv_new


CASES = [  # gated, use_beta, neg_eigval, norm, affine, gate, bias, pad, m (value heads per key head), in_place
    (True, True, False, True, True, "silu", False, False, 1, True),
    (True, True, False, True, True, "silu", True, True, 2, False),
    (False, True, True, True, False, "sigmoid", False, True, 1, True),
    (False, False, False, False, False, None, True, False, 3, False),
    (True, False, True, True, True, None, False, True, 2, True),
]


@needs_interp
@pytest.mark.parametrize("gated, use_beta, neg, norm, affine, gate, bias, pad, m, in_place", CASES)
def test_interp_delta_step_equals_the_unfused_step_in_float64(gated, use_beta, neg, norm, affine, gate, bias, pad,
                                                            m, in_place):
    B, H, K, V, W = 3, 2, 16, 8, 4
    HV = m * H
    p = inputs(B, H, HV, K, V, W, gated=gated, use_beta=use_beta, norm=norm, affine=affine, gate=gate, bias=bias,
               pad=pad, seed=m)
    eps = 1e-6 if norm else None
    want = reference_step(p, H, HV, K ** -0.5, neg, eps, gate)
    got = fused(p, H, HV, K ** -0.5, neg, eps, gate, in_place)
    for name, a, b in (("o", got[0], want[0]), ("S", got[1], want[1])):
        assert a.dtype == F64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    for n in "qkv":
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0, msg=f"conv {n}")
    if pad:  # the pad's output is zero and its state unchanged
        assert not got[0][-1].any() and torch.equal(got[1][-1], p["S"][-1])


@needs_interp
@pytest.mark.parametrize("key_gate, bound, m, pad, in_place", [("softplus", None, 1, True, True),
                                                              ("bounded", -5.0, 2, False, False)])
def test_interp_kda_step_equals_the_unfused_step_in_float64(key_gate, bound, m, pad, in_place):
    # Kimi Delta Attention: a decay per key channel, β, the gated output norm (sigmoid), grouped value heads
    B, H, K, V, W = 3, 2, 16, 8, 4
    HV = m * H
    p = inputs(B, H, HV, K, V, W, gated=True, use_beta=True, norm=True, affine=True, gate="sigmoid", bias=pad,
               pad=pad, seed=5 + m, key_gate=True)
    want = reference_step(p, H, HV, K ** -0.5, False, 1e-5, "sigmoid", key_gate=key_gate, bound=bound)
    got = fused(p, H, HV, K ** -0.5, False, 1e-5, "sigmoid", in_place, key_gate=key_gate, bound=bound)
    for name, a, b in (("o", got[0], want[0]), ("S", got[1], want[1])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    for n in "qkv":
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0, msg=f"conv {n}")


def test_the_step_refuses_a_lower_bound_without_the_bounded_key_gate():
    from lazoo.kernels.delta_step import delta_step

    p = inputs(1, 1, 1, 16, 16, 4, gated=True, use_beta=True, norm=False, affine=False, gate=None, bias=False,
               pad=False, key_gate=True)
    with pytest.raises(ValueError, match="key_gate"):
        delta_step(p["q"], p["k"], p["v"], p["conv"], p["weights"], None, p["S"], heads=1, value_heads=1, scale=1.0,
                   a=p["a"], A_log=p["A_log"], dt_bias=p["dt_bias"], key_gate="softplus", gate_lower_bound=-5.0)


@needs_interp
def test_interp_delta_step_reads_strided_rows():
    """Projections that are views of a wider tensor (row stride > width) and head dims that are no power of two."""
    B, H, HV, K, V, W = 2, 1, 2, 12, 20, 3
    p = inputs(B, H, HV, K, V, W, gated=True, use_beta=True, norm=True, affine=True, gate="silu", bias=False,
               pad=False)
    wide = {n: torch.cat([p[n], torch.full_like(p[n], float("nan"))], dim=-1)[..., :p[n].shape[-1]] for n in "qkv"}
    assert wide["q"].stride(1) > p["q"].shape[-1]
    want = reference_step(p, H, HV, K ** -0.5, False, 1e-6, "silu")
    got = fused({**p, **wide}, H, HV, K ** -0.5, False, 1e-6, "silu", in_place=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


def fused_and_unfused_generate(name, options, device="cpu", dtype=F64, tokens=6):
    """`generate` of a tiny model with the one-kernel step and without it (the mixer's switch), greedy, left-padded,
    the dynamic cache and the static one: (tokens, logits) of each."""
    from decode_helpers import fused_and_unfused_generate as run

    from lazoo.kernels import delta_step
    from lazoo.layers.mixers.delta import DeltaNetMixer
    from lazoo.layers.mixers.kda import KimiDeltaAttentionMixer

    mixer = KimiDeltaAttentionMixer if name == "kda" else DeltaNetMixer
    return run(name, options, mixer, delta_step, "delta_step", device=device, dtype=dtype, tokens=tokens)


MODEL_CASES = [("gated_delta_net", {}), ("kda", {}), ("delta_net", {}), ("gated_delta_net", {"num_v_heads": 4}),
               ("delta_net", {"use_beta": False, "allow_neg_eigval": True}),
               ("kda", {"gate_lower_bound": -5.0, "num_v_heads": 4, "conv_bias": True})]


@needs_interp
@pytest.mark.parametrize("name, options", MODEL_CASES[:2])
def test_interp_generate_with_the_fused_step_equals_generate_without(name, options):
    assert_all_equal(fused_and_unfused_generate(name, options))


@needs_interp
@pytest.mark.slow
@pytest.mark.parametrize("name, options", MODEL_CASES[2:])
def test_interp_generate_with_the_fused_step_equals_generate_without_slow(name, options):
    test_interp_generate_with_the_fused_step_equals_generate_without(name, options)


def test_the_fused_step_is_taken_only_where_it_applies():
    """On the CPU without the interpreter no layer takes it; options it does not compute keep the unfused step."""
    from conftest import tiny_model

    model = tiny_model("gated_delta_net", seed=2)
    mixer = model.model.layers[0].mixer
    assert mixer._fused_step_options
    with torch.no_grad():
        assert not mixer.fused_step_applies(torch.zeros(1, 1, 32))  # auto on the CPU: PyTorch
    assert not mixer.fused_step_applies(torch.zeros(1, 1, 32))  # autograd on
    for options in ({"qk_norm": "sum"}, {"use_short_conv": False}, {"short_conv_targets": "k"},
                    {"qk_activation": "relu"}, {"conv_activation": None}, {"num_kv_heads": 1}):
        assert not tiny_model("gated_delta_net", seed=2, **options).model.layers[0].mixer._fused_step_options, options
    assert tiny_model("kda", seed=2).model.layers[0].mixer._fused_step_options
    assert not tiny_model("kda", seed=2, use_short_conv=False).model.layers[0].mixer._fused_step_options


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name, options", MODEL_CASES)
def test_fused_step_generate_on_gpu(name, options):
    """bf16 on CUDA: the same greedy tokens as the unfused step and logits within bf16 rounding; float32 close."""
    assert_close_on_gpu(lambda dtype, tokens: fused_and_unfused_generate(name, options, device="cuda", dtype=dtype,
                                                                         tokens=tokens))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_delta_step_kernel_on_gpu(m):
    B, H, K, V, W = 8, 4, 128, 128, 4
    p = inputs(B, H, m * H, K, V, W, gated=True, use_beta=True, norm=True, affine=True, gate="silu", bias=False,
               pad=True, dtype=torch.float32)
    want = reference_step({key: (value.to(F64) if isinstance(value, torch.Tensor) else
                                 ({n: t.to(F64) for n, t in value.items()} if isinstance(value, dict) else value))
                           for key, value in p.items()}, H, m * H, K ** -0.5, False, 1e-6, "silu")
    got = fused(p, H, m * H, K ** -0.5, False, 1e-6, "silu", in_place=True, device="cuda")
    for a, b in ((got[0], want[0]), (got[1], want[1])):
        err = (a.cpu().to(F64) - b).norm() / b.norm()
        assert err < 1e-5, err
