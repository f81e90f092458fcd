"""lazoo's `gated_delta_net`, `delta_net` and `gla` mixers express fla 0.6.0's `GatedDeltaNet`, `DeltaNet` and
`GatedLinearAttention` layers exactly: independent key head dims, `expand_v`, grouped values (GVA) and grouped
keys/values (GQA), short convolutions with or without bias, q/k activations and norms, β options, output gate
activations, output norms without weight, GLA's feature map, clamp and low-rank gate.

Checked in float64 against `fla_reference` (a transcription of fla's layer code and naive recurrences, no fla
needed) on fla-named weights, outputs and every gradient, on a ragged padded batch; where fla is importable
(/tmp/fla/site, or LAZOO_FLA_SITE), also on the weights of fla's own layer classes built on the CPU, against
fla's own `forward` run on the CPU with torch stand-ins for the Triton kernels it calls, and the transcription's
recurrences against fla's naive reference functions.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
import types

import fla_reference as ref
import pytest
import torch
from transformers import AutoConfig

from lazoo.layers.mixers import mixer_class
from lazoo.models import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")

FLA_SITE = os.environ.get("LAZOO_FLA_SITE", "/tmp/fla/site")
T = 70  # crosses the delta rule's 64-token chunks and GLA's 16-token ones

#: fla layer arguments per case; every case's head count differs from the config's num_attention_heads (2)
CASES = {
    # the published checkpoints' settings (0.75 · hidden in q/k, expand_v 2, gate, conv; hidden not a multiple of
    # the head count, as 2048 and 6 heads), scaled down
    "gated_deltanet/published": ("gated_deltanet", dict(hidden_size=40, head_dim=10, num_heads=3, expand_v=2,
                                                        norm_eps=1e-6)),
    "gated_deltanet/gva_bias_sigmoid": ("gated_deltanet", dict(
        hidden_size=32, head_dim=8, num_heads=2, num_v_heads=6, expand_v=1.5, conv_bias=True,
        allow_neg_eigval=True, output_gate_activation="sigmoid", conv_size=3)),
    "gated_deltanet/no_gate_no_conv": ("gated_deltanet", dict(
        hidden_size=32, head_dim=12, num_heads=4, expand_v=1, use_gate=False, use_short_conv=False)),
    "delta_net/published": ("delta_net", dict(hidden_size=32, num_heads=4, norm_eps=1e-6)),
    "delta_net/gate_expand_bias": ("delta_net", dict(
        hidden_size=32, num_heads=4, expand_k=0.5, expand_v=1.5, use_gate=True, conv_bias=True,
        allow_neg_eigval=True)),
    "delta_net/relu_sum_no_beta": ("delta_net", dict(
        hidden_size=32, num_heads=4, qk_activation="relu", qk_norm="sum", use_beta=False)),
    "delta_net/elu_no_conv": ("delta_net", dict(hidden_size=32, num_heads=4, qk_activation="elu",
                                                use_short_conv=False)),
    "delta_net/identity_conv": ("delta_net", dict(hidden_size=32, num_heads=4, qk_activation="identity")),
    "gla/published": ("gla", dict(hidden_size=32, num_heads=4, norm_eps=1e-6)),
    "gla/gqa_conv_feature_map_clamp": ("gla", dict(
        hidden_size=32, num_heads=4, num_kv_heads=2, expand_v=2, use_short_conv=True, conv_bias=True,
        feature_map="relu", clamp_min=-0.05, gate_low_rank_dim=4)),
    "gla/unfused_sigmoid_no_affine": ("gla", dict(
        hidden_size=32, num_heads=4, fuse_norm=False, gate_fn="sigmoid", elementwise_affine=False,
        gate_logit_normalizer=8)),
    "gla/no_gate_swish_map": ("gla", dict(hidden_size=32, num_heads=8, expand_k=1, use_output_gate=False,
                                          feature_map="swish")),
}


# ----------------------------------------------------------------------------- helpers
def lazoo_mixer(layer: str, args: dict, backend=None):
    """The lazoo mixer of fla layer `layer` built with `args`, through a lazoo config (typed fields), float64."""
    name, options = ref.lazoo_mechanism(layer), ref.lazoo_options(layer, **args)
    config = AutoConfig.for_model(f"lazoo_{name}", hidden_size=args["hidden_size"], num_attention_heads=2,
                                  **options)
    return mixer_class(name)(config, 0, {**config.mixer_options(name), "backend": backend}).double()


def ragged_batch(hidden: int, seed: int, length: int = T):
    """x `[3, T, hidden]` float64 and a mask: a full row, a left-padded row, a right-padded row (pads hold noise)."""
    x = torch.randn(3, length, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    position = torch.arange(length)
    return x, torch.stack([position >= 0, position >= 5, position < length - 7])


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max abs error {err:.2e} (scale {scale:.2e}, tol {tol:.0e})"


def check_against_transcription(case: str, weights: dict, backend=None, seed: int = 3):
    """The lazoo mixer loaded with fla-named `weights` equals fla's transcribed layer: outputs, the gradient of
    x and of every weight."""
    layer, args = CASES[case]
    mixer = lazoo_mixer(layer, args, backend)
    mixer.load_state_dict(ref.lazoo_state_dict(layer, weights), strict=True)
    x, mask = ragged_batch(args["hidden_size"], seed)
    x_ref, x_lazoo = x.clone().requires_grad_(), x.clone().requires_grad_()
    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    expected = ref.padded_layer(layer, leaves, x_ref, mask, **args)
    out = mixer(x_lazoo, mask=mask)
    assert_close(out, expected, 1e-10, f"{case}: output")
    assert out[~mask].abs().max() == 0, "pads give zeros, as fla's repadding does"
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    (expected * probe).sum().backward()
    (out * probe).sum().backward()
    assert_close(x_lazoo.grad, x_ref.grad, 1e-10, f"{case}: grad of x")
    params = dict(mixer.named_parameters())
    for name, leaf in leaves.items():
        assert_close(params[ref.lazoo_name(layer, name)].grad, leaf.grad, 1e-10, f"{case}: grad of {name}")


# ----------------------------------------------------------------------------- no fla needed
@pytest.mark.parametrize("case", list(CASES))
def test_mixer_equals_the_float64_transcription_of_fla(case):
    layer, args = CASES[case]
    weights = ref.random_fla_weights(layer, torch.Generator().manual_seed(len(case)), **args)
    check_against_transcription(case, weights)


@pytest.mark.parametrize("case", ["gated_deltanet/gva_bias_sigmoid", "gla/gqa_conv_feature_map_clamp"])
def test_step_by_step_backend_agrees(case):
    """The recurrent backend (the op's step-by-step reference) gives the same layer as the default chunk form."""
    layer, args = CASES[case]
    weights = ref.random_fla_weights(layer, torch.Generator().manual_seed(11), **args)
    check_against_transcription(case, weights, backend="recurrent", seed=12)


@pytest.mark.parametrize("case", ["gated_deltanet/gva_bias_sigmoid", "delta_net/relu_sum_no_beta",
                                  "gla/gqa_conv_feature_map_clamp"])
def test_cached_decoding_and_packing_equal_the_full_forward(case):
    """With the new layouts the cache (prompt, then one token at a time, left padding) and packed sequences
    (`cu_seqlens`) give the full forward's outputs."""
    layer, args = CASES[case]
    mixer = lazoo_mixer(layer, args)
    mixer.load_state_dict(ref.lazoo_state_dict(
        layer, ref.random_fla_weights(layer, torch.Generator().manual_seed(4), **args)))
    x, mask = ragged_batch(args["hidden_size"], seed=5, length=12)
    mask[2] = True  # a left-padded batch, as generation has
    with torch.no_grad():
        full = mixer(x, mask=mask)
        cache = LazooCache(1)
        steps = [mixer(x[:, :6], mask=mask[:, :6], cache=cache)]
        steps += [mixer(x[:, t:t + 1], mask=mask[:, t:t + 1], cache=cache) for t in range(6, 12)]
        assert_close(torch.cat(steps, dim=1), full, 1e-10, f"{case}: cached decoding")
        rows = [x[b, mask[b]] for b in range(3)]
        cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
        packed = mixer.forward_packed(torch.cat(rows)[None], position_ids=None, cu_seqlens=cu)
        assert_close(packed[0], full[mask], 1e-10, f"{case}: packed sequences")


def test_each_new_option_changes_the_output():
    """The options are live: changing one (and the transcription with it) changes the output."""
    layer, base = CASES["gated_deltanet/gva_bias_sigmoid"]
    x, mask = ragged_batch(base["hidden_size"], seed=8, length=9)
    weights = ref.random_fla_weights(layer, torch.Generator().manual_seed(9), **base)
    reference = ref.padded_layer(layer, weights, x, mask, **base)
    for key, other in (("allow_neg_eigval", False), ("output_gate_activation", "swish"), ("conv_bias", False)):
        changed = {**base, key: other}
        w = {n: t for n, t in weights.items() if n in ref.fla_weight_shapes(layer, **changed)}
        mixer = lazoo_mixer(layer, changed)
        mixer.load_state_dict(ref.lazoo_state_dict(layer, w), strict=True)
        out = mixer(x, mask=mask)
        assert_close(out, ref.padded_layer(layer, w, x, mask, **changed), 1e-10, f"{key}={other}")
        assert (out - reference).abs().max() > 1e-4, f"{key}={other} made no difference"


def test_defaults_keep_todays_layers():
    """No new option set: the mixers have today's parameters (b_proj with a bias, q/k/v of hidden width)."""
    config = AutoConfig.for_model("lazoo_gated_delta_net", hidden_size=32, num_attention_heads=4)
    mixer = mixer_class("gated_delta_net")(config, 0, config.mixer_options("gated_delta_net"))
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters()}
    assert shapes["b_proj.bias"] == (4,) and shapes["v_proj.weight"] == (32, 32) and shapes["o_norm.weight"] == (8,)
    assert "short_conv.convs.q.bias" not in shapes and shapes["short_conv.convs.v.weight"] == (32, 1, 4)


@pytest.mark.parametrize("name, options, match", [
    ("gated_delta_net", {"gate_activation": "tanh"}, r"gate_activation must be one of \['sigmoid', 'silu'\]"),
    ("gated_delta_net", {"qk_activation": "gelu"}, r"qk_activation must be one of"),
    ("gated_delta_net", {"head_k_dim": 8, "expand_v": 1.3}, r"expand_v=1.3 times head_k_dim=8 must be a positive"),
    ("gated_delta_net", {"num_heads": 4, "num_v_heads": 6}, r"the 4 heads of num_heads must divide the 6 state"),
    ("gla", {"num_heads": 4, "num_kv_heads": 3}, r"the 3 heads of num_kv_heads must divide the 4 state heads"),
    ("delta_net", {"qk_norm": "l1"}, r"qk_norm must be one of \('l2', 'sum'\)"),
    ("gla", {"clamp_min": 0.5}, r"clamp_min must be None or a number <= 0"),
    ("gla", {"feature_map": "gelu"}, r"feature_map must be None or one of"),
    ("vla", {"expand_v": 2}, r"vla: options \['expand_v'\] are not supported by this mechanism"),
    ("delta_product", {"num_v_heads": 4}, r"options \['num_v_heads'\] are not supported"),
])
def test_bad_values_are_refused_at_construction(name, options, match):
    config = AutoConfig.for_model(f"lazoo_{name}", hidden_size=32, num_attention_heads=2, **options)
    with pytest.raises(ValueError, match=match):
        mixer_class(name)(config, 0, config.mixer_options(name))


@pytest.mark.parametrize("fields, match", [
    ({"num_v_heads": 2.0}, r"^num_v_heads \(gated_delta_net option\) must be None or a positive int"),
    ({"head_k_dim": 0}, r"^head_k_dim \(gated_delta_net option\) must be None or a positive int"),
    ({"conv_bias": 1}, r"^conv_bias \(gated_delta_net option\) must be True or False"),
    ({"beta_bias": "no"}, r"^beta_bias \(gated_delta_net option\) must be True or False"),
])
def test_bad_option_kinds_are_refused_by_the_config(fields, match):
    with pytest.raises(ValueError, match=match):
        AutoConfig.for_model("lazoo_gated_delta_net", hidden_size=32, num_attention_heads=2, **fields)


def test_a_model_with_fla_layouts_trains_and_generates_as_without_cache():
    """A lazoo model mixing the three mechanisms with fla's layouts (head counts other than the config's,
    hidden not a multiple of the heads' dims) runs, back-propagates, and decodes as it recomputes."""
    from transformers import AutoModelForCausalLM

    kwargs = {layer: ref.lazoo_options(layer, **args) for layer, args in
              (CASES["gated_deltanet/gva_bias_sigmoid"], CASES["delta_net/gate_expand_bias"],
               CASES["gla/gqa_conv_feature_map_clamp"])}
    names = [ref.lazoo_mechanism(layer) for layer in kwargs]
    config = AutoConfig.for_model("lazoo_hybrid", vocab_size=61, hidden_size=32, num_attention_heads=2,
                                  num_hidden_layers=3, intermediate_size=48, layer_types=names,
                                  mixer_kwargs={ref.lazoo_mechanism(k): v for k, v in kwargs.items()})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        full = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, full)


# ----------------------------------------------------------------------------- against fla's own code
@contextlib.contextmanager
def _fla_path():
    sys.path.insert(0, FLA_SITE)
    try:
        yield
    finally:
        sys.path.remove(FLA_SITE)


def _no_flash_attention(*args, **kwargs):
    raise RuntimeError("flash_attn is not installed: a stand-in module was imported for fla's import only")


@pytest.fixture(scope="module")
def fla():
    """fla's layer modules, imported from FLA_SITE for these tests only; skip when fla cannot be imported."""
    if not os.path.isdir(FLA_SITE):
        pytest.skip(f"fla 0.6.0 not found at {FLA_SITE} (set LAZOO_FLA_SITE); the transcription tests still run")
    import transformers.activations  # noqa: F401  (transformers looks for flash_attn at import: before the stand-in)

    # fla's attention layer (imported with fla.layers) binds flash_attn's functions when it can import them, as
    # test_fla_attention.py expects whichever file imports fla first: a stand-in module for the import only
    stand_in = None if "flash_attn" in sys.modules else types.ModuleType("flash_attn")
    if stand_in is not None:
        stand_in.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        stand_in.flash_attn_func = stand_in.flash_attn_varlen_func = _no_flash_attention
        sys.modules["flash_attn"] = stand_in
    with _fla_path():
        try:
            import fla.layers.delta_net as delta_net
            import fla.layers.gated_deltanet as gated_deltanet
            import fla.layers.gla as gla
            from fla.ops.delta_rule.naive import delta_rule_recurrence
            from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
            from fla.ops.gla.naive import naive_recurrent_gla
        except Exception as err:  # noqa: BLE001 - any import failure means: no fla here
            pytest.skip(f"fla is not importable from {FLA_SITE}: {type(err).__name__}: {err}")
        finally:
            if stand_in is not None and sys.modules.get("flash_attn") is stand_in:
                del sys.modules["flash_attn"]
    return {"modules": {"gated_deltanet": gated_deltanet, "delta_net": delta_net, "gla": gla},
            "classes": {"gated_deltanet": gated_deltanet.GatedDeltaNet, "delta_net": delta_net.DeltaNet,
                        "gla": gla.GatedLinearAttention},
            "naive": {"gated": naive_recurrent_gated_delta_rule, "delta": delta_rule_recurrence,
                      "gla": naive_recurrent_gla}}


def fla_layer(fla, case: str, seed: int):
    """fla's layer class built on the CPU with the case's arguments, every parameter redrawn (float64)."""
    layer, args = CASES[case]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns about use_short_conv=False and about the CPU
        module = fla["classes"][layer](**args, layer_idx=0).double()
    fresh = ref.random_fla_weights(layer, torch.Generator().manual_seed(seed), **args)
    module.load_state_dict(fresh, strict=True)  # same names and shapes as fla_reference's, or this raises
    return module


@pytest.mark.parametrize("case", list(CASES))
def test_mixer_equals_the_transcription_on_fla_class_weights(fla, case):
    """fla's own layer class names and shapes its weights as `fla_reference` does; on them, lazoo = transcription."""
    layer, args = CASES[case]
    module = fla_layer(fla, case, seed=21)
    weights = {n: p.detach().clone() for n, p in module.state_dict().items()}
    assert {n: tuple(w.shape) for n, w in weights.items()} == ref.fla_weight_shapes(layer, **args)
    check_against_transcription(case, weights, seed=22)


def _torch_short_conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                              cu_seqlens=None, **kwargs):
    """fla's `ShortConvolution.forward` without its kernels (no cache): per packed sequence, fla's formula."""
    assert cache is None and not output_final_state and residual is None and mask is None
    bounds = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    parts = [ref.short_conv(x[0, s:e], self.weight, self.bias, self.activation) for s, e in zip(bounds, bounds[1:])]
    return torch.cat(parts)[None], None


def _per_sequence(fn, cu_seqlens, *tensors):
    """Run `fn` on each packed sequence of `[1, T, ...]` tensors and concatenate."""
    bounds = cu_seqlens.tolist()
    return torch.cat([fn(*(t[0, s:e] for t in tensors)) for s, e in zip(bounds, bounds[1:])])[None]


def _gated_delta_rule_stub(q, k, v, g, beta, *, use_qk_l2norm_in_kernel, allow_neg_eigval, A_log, dt_bias,
                           cu_seqlens, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, **kwargs):
    """fla's chunk/fused gated delta rule as its docstring defines the fused options, on torch."""
    assert use_beta_sigmoid_in_kernel and use_gate_in_kernel and kwargs.get("initial_state") is None
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    g = -A_log.exp() * torch.nn.functional.softplus(g + dt_bias)
    return _per_sequence(ref.gated_delta_rule, cu_seqlens, q, k, v, g, beta), None


def _delta_rule_stub(q, k, v, beta, *, cu_seqlens, use_qk_l2norm_in_kernel, **kwargs):
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    return _per_sequence(ref.delta_rule, cu_seqlens, q, k, v, beta), None


def _gla_stub(q, k, v, gk=None, g=None, *, cu_seqlens, **kwargs):
    return _per_sequence(ref.gla_recurrence, cu_seqlens, q, k, v, g if gk is None else gk), None


@pytest.fixture
def fla_on_cpu(fla, monkeypatch):
    """fla's layers' own `forward`, with torch stand-ins for the Triton kernels they call: the short convolution,
    the recurrences (as fla's op docstrings define their fused options), RMSNorm, the gated RMSNorm and GLA's
    activations (feature map, gate)."""
    from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution

    monkeypatch.setattr(ShortConvolution, "forward", _torch_short_conv_forward)
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x, *a, **k: ref.rms_norm(x, self.weight, self.eps))
    monkeypatch.setattr(FusedRMSNormGated, "forward",
                        lambda self, x, g, *a, **k: ref.rms_norm_gated(x, g, self.weight, self.eps, self.activation))
    mods = fla["modules"]
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        monkeypatch.setattr(mods["gated_deltanet"], name, _gated_delta_rule_stub)
    for name in ("chunk_delta_rule", "fused_recurrent_delta_rule"):
        monkeypatch.setattr(mods["delta_net"], name, _delta_rule_stub)
    for name in ("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"):
        monkeypatch.setattr(mods["gla"], name, _gla_stub)
    monkeypatch.setattr(mods["gla"], "ACT2FN", ref.ACT2FN)  # fla's sigmoid and swish are Triton kernels
    return fla


@pytest.mark.parametrize("case", list(CASES))
def test_mixer_equals_fla_forward_on_cpu(fla_on_cpu, case):
    """fla's own layer code (head splits, GVA/GQA, activations, gates, unpadding) run on the CPU in float64 with
    torch kernels, against the lazoo mixer: outputs and the gradient of x."""
    layer, args = CASES[case]
    module = fla_layer(fla_on_cpu, case, seed=31)
    mixer = lazoo_mixer(layer, args)
    mixer.load_state_dict(ref.lazoo_state_dict(layer, module.state_dict()), strict=True)
    x, mask = ragged_batch(args["hidden_size"], seed=32, length=20)
    x_fla, x_lazoo = x.clone().requires_grad_(), x.clone().requires_grad_()
    with _fla_path():
        expected = module(x_fla, attention_mask=mask.long())[0]
    out = mixer(x_lazoo, mask=mask)
    assert_close(out, expected, 1e-10, f"{case}: output vs fla's forward")
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(33), dtype=torch.float64)
    (expected * probe).sum().backward()
    (out * probe).sum().backward()
    assert_close(x_lazoo.grad, x_fla.grad, 1e-10, f"{case}: grad of x vs fla's forward")


def test_transcribed_recurrences_equal_fla_naive_references(fla):
    """`fla_reference`'s recurrences against fla's naive functions (which compute in float32)."""
    gen = torch.Generator().manual_seed(41)
    T_, H, HV, K, V = 9, 2, 2, 8, 6
    q, k = torch.randn(2, T_, H, K, generator=gen, dtype=torch.float64).unbind(0)
    q, k = ref.l2norm(q), ref.l2norm(k)
    v = torch.randn(T_, HV, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(T_, HV, generator=gen, dtype=torch.float64)
    g = -torch.rand(T_, HV, generator=gen, dtype=torch.float64)
    naive = fla["naive"]
    expected = naive["gated"](q[None], k[None], v[None], beta[None], g[None])[0][0].double()
    assert_close(ref.gated_delta_rule(q, k, v, g, beta), expected, 1e-5, "gated delta rule")
    expected = naive["delta"](*(t[None].transpose(1, 2) for t in (q, k, v, beta)))[0][0].transpose(0, 1).double()
    assert_close(ref.delta_rule(q, k, v, beta), expected, 1e-5, "delta rule")
    gk = -torch.rand(T_, H, K, generator=gen, dtype=torch.float64)
    expected = naive["gla"](q[None], k[None], v[None], gk[None])[0][0].double()
    assert_close(ref.gla_recurrence(q, k, v, gk), expected, 1e-5, "gla")
