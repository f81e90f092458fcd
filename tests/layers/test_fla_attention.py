"""lazoo's attention mixers and MLP express fla's (flash-linear-attention 0.6.0) `Attention` layer and `GatedMLP`
exactly: grouped-query heads, q/k/v biases, per-head RMSNorm of q and k, a head count of its own, RoPE θ, the
flash-attention window, fla's MLP width rule.

Checked against a float64 transcription of fla's layer (`fla_attention_reference`, no fla needed) and, where fla is
importable (/tmp/fla/site), against fla's own `Attention.forward` run on the CPU in float64 with torch stand-ins
for the kernels it calls (flash-attention, fla's RoPE and RMSNorm kernels), with and without fla's cache.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import fla_attention_reference as ref
import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import AutoConfig

from lazoo.layers.mixers import mixer_class
from lazoo.layers.mlp import GatedMLP
from lazoo.models import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")

FLA_SITE = os.environ.get("LAZOO_FLA_SITE", "/tmp/fla/site")
HIDDEN = 32

#: fla Attention settings (its argument names) -> lazoo mechanism and options. Every case sets a head count other
#: than the config's num_attention_heads (2), as fla's hybrids do.
CASES = {
    "mha": dict(num_heads=4),
    "gqa_bias": dict(num_heads=4, num_kv_heads=2, qkv_bias=True, rope_theta=500.0),
    "qk_norm_window": dict(num_heads=4, qk_norm=True, window_size=3),
    "mqa_all": dict(num_heads=8, num_kv_heads=1, qkv_bias=True, qk_norm=True, window_size=5, rope_theta=1e6),
}


def lazoo_settings(fla: dict) -> tuple[str, dict, dict]:
    """(mechanism, lazoo options, config fields) for fla Attention settings: the mapping a converter applies."""
    options = {"num_heads": fla["num_heads"], "num_kv_heads": fla.get("num_kv_heads"),
               "qkv_bias": fla.get("qkv_bias", False), "qk_rmsnorm": fla.get("qk_norm", False),
               "rope_theta": fla.get("rope_theta", 10000.0)}
    window = fla.get("window_size")
    return ("softmax" if window is None else "sliding_window"), options, {"sliding_window": window}


def lazoo_mixer(fla: dict, backend=None):
    name, options, fields = lazoo_settings(fla)
    config = AutoConfig.for_model(f"lazoo_{name}", hidden_size=HIDDEN, num_attention_heads=2, **fields, **options)
    return mixer_class(name)(config, 0, {**config.mixer_options(name), "backend": backend}).double()


def random_fla_params(fla: dict, seed: int) -> dict[str, torch.Tensor]:
    """Fresh float64 weights under fla's parameter names and shapes (norm weights away from 1)."""
    gen = torch.Generator().manual_seed(seed)
    heads = fla["num_heads"]
    head_dim, kv = HIDDEN // heads, (fla.get("num_kv_heads") or heads) * (HIDDEN // heads)
    shapes = {"q_proj.weight": (HIDDEN, HIDDEN), "k_proj.weight": (kv, HIDDEN), "v_proj.weight": (kv, HIDDEN),
              "o_proj.weight": (HIDDEN, HIDDEN)}
    if fla.get("qkv_bias"):
        shapes.update({"q_proj.bias": (HIDDEN,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    params = {n: torch.randn(s, generator=gen, dtype=torch.float64) * 0.3 for n, s in shapes.items()}
    if fla.get("qk_norm"):
        for n in ("q_norm.weight", "k_norm.weight"):
            params[n] = 1 + 0.5 * torch.randn(head_dim, generator=gen, dtype=torch.float64)
    return params


def load_fla_params(mixer, params: dict) -> None:
    mixer.load_state_dict({ref.FLA_TO_LAZOO_ATTENTION[n]: t for n, t in params.items()}, strict=True)


def ragged_batch(seed: int, T: int = 11):
    """x `[3, T, hidden]` float64 and a mask: a full row, a left-padded row, a right-padded row (pads hold noise)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, T, HIDDEN, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, :4] = False
    mask[2, T - 3:] = False
    return x, mask


def lazoo_positions(mask, offset=None):
    """RoPE positions as lazoo's model computes them: real tokens counted per row (after `offset` seen)."""
    offset = torch.zeros(mask.shape[0], dtype=torch.long) if offset is None else offset
    return (offset[:, None] + mask.long().cumsum(1) - 1).clamp_min(0)


def run_lazoo(mixer, x, mask, cache=None, offset=None):
    op_mask = None if bool(mask.all()) else mask
    return mixer(x, mask=op_mask, position_ids=lazoo_positions(mask, offset), cache=cache)


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max abs error {err:.2e} (scale {scale:.2e}, tol {tol:.0e})"


def transcription(params, fla, x, mask):
    return ref.fla_attention(x, params, num_heads=fla["num_heads"], num_kv_heads=fla.get("num_kv_heads"),
                             qk_norm=fla.get("qk_norm", False), window_size=fla.get("window_size"),
                             rope_theta=fla.get("rope_theta", 10000.0), attention_mask=mask)


# ----------------------------------------------------------------------------- no fla needed
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("case", list(CASES))
def test_mixer_equals_the_float64_transcription_of_fla_attention(case, backend):
    fla = CASES[case]
    params = random_fla_params(fla, seed=len(case))
    mixer = lazoo_mixer(fla, backend)
    load_fla_params(mixer, params)
    x, mask = ragged_batch(seed=3)
    x_ref = x.clone().requires_grad_()
    x_lazoo = x.clone().requires_grad_()
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    expected = transcription(leaves, fla, x_ref, mask)
    out = run_lazoo(mixer, x_lazoo, mask)
    assert_close(out, expected, 1e-10, f"{case}: output")
    assert out[~mask].abs().max() == 0, "pads give zeros"
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (expected * weight).sum().backward()
    (out * weight).sum().backward()
    assert_close(x_lazoo.grad, x_ref.grad, 1e-10, f"{case}: grad of x")
    lazoo_params = dict(mixer.named_parameters())
    for name, leaf in leaves.items():
        assert_close(lazoo_params[ref.FLA_TO_LAZOO_ATTENTION[name]].grad, leaf.grad, 1e-10, f"{case}: grad of {name}")


def test_each_option_changes_the_output():
    """The options are live: with one setting changed (and the same weights, less those it drops) the output
    follows the transcription and differs from the original."""
    base = CASES["mqa_all"]
    x, mask = ragged_batch(seed=8)
    params = random_fla_params(base, seed=9)
    expected = transcription(params, base, x, mask)
    for key, other in (("window_size", 7), ("rope_theta", 10000.0), ("qk_norm", False), ("qkv_bias", False)):
        changed = {**base, key: other}
        kept = {n: t for n, t in params.items() if n in random_fla_params(changed, seed=0)}
        mixer = lazoo_mixer(changed)
        load_fla_params(mixer, kept)
        out = run_lazoo(mixer, x, mask)
        assert_close(out, transcription(kept, changed, x, mask), 1e-10, f"{key}={other}")
        assert (out - expected).abs().max() > 1e-4, f"{key}={other} made no difference"


def test_fla_intermediate_size():
    for args, width in {(1024, 4, None): 2816, (2048, 4, None): 5632, (2048, None, None): 5632, (32, 4, None): 256,
                        (48, 2, None): 256, (64, 4, 100): 100, (768, 3.5, None): 1792}.items():
        assert ref.fla_intermediate_size(*args) == width, args


def test_gated_mlp_is_fla_swiglu():
    gen = torch.Generator().manual_seed(21)
    mlp = GatedMLP(HIDDEN, 48).double()
    weights = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in mlp.named_parameters()}
    mlp.load_state_dict(weights)  # fla's names: gate_proj, up_proj, down_proj (no biases)
    x = torch.randn(2, 5, HIDDEN, generator=gen, dtype=torch.float64)
    expected = ref.gated_mlp(x, weights["gate_proj.weight"], weights["up_proj.weight"], weights["down_proj.weight"])
    assert_close(mlp(x), expected, 1e-12, "GatedMLP")


def test_a_head_count_that_does_not_divide_hidden_size_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"hidden_size=32 must be divisible by the 'softmax' option num_heads=5"):
        AutoConfig.for_model("lazoo_softmax", hidden_size=HIDDEN, num_attention_heads=2, num_heads=5)


@pytest.mark.parametrize("options, match", [
    ({"num_kv_heads": 3, "num_heads": 4}, r"num_kv_heads=3 must divide num_heads=4"),
    ({"num_kv_heads": 4}, r"num_kv_heads=4 must divide num_heads=2"),
    ({"qk_norm": True, "qk_rmsnorm": True}, r"qk_norm and qk_rmsnorm"),
    ({"qk_rmsnorm": True, "qk_rmsnorm_eps": 0.0}, r"qk_rmsnorm_eps must be a number > 0"),
])
def test_bad_head_and_norm_options_are_refused_at_construction(options, match):
    config = AutoConfig.for_model("lazoo_softmax", hidden_size=HIDDEN, num_attention_heads=2, **options)
    with pytest.raises(ValueError, match=match):
        mixer_class("softmax")(config, 0, config.mixer_options("softmax"))


@pytest.mark.parametrize("fields, match", [
    ({"num_heads": 2.0}, r"^num_heads \(softmax option\) must be None or a positive int"),
    ({"num_kv_heads": 0}, r"^num_kv_heads \(softmax option\) must be None or a positive int"),
    ({"qkv_bias": 1}, r"^qkv_bias \(softmax option\) must be True or False"),
    ({"mixer_kwargs": {"softmax": {"num_heads": "4"}}, "layer_types": ["softmax"] * 4},
     r"^mixer_kwargs\['softmax'\]\['num_heads'\] \(softmax option\) must be None or a positive int"),
])
def test_bad_option_values_are_refused_by_the_config(fields, match):
    with pytest.raises(ValueError, match=match):
        AutoConfig.for_model("lazoo_softmax", hidden_size=HIDDEN, num_attention_heads=2, **fields)


# ----------------------------------------------------------------------------- a model with the options
FLA_LIKE_HYBRID = dict(
    layer_types=["softmax", "sliding_window", "gated_delta_net"],
    mixer_kwargs={"softmax": {"num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "qk_rmsnorm": True},
                  "sliding_window": {"num_heads": 8, "num_kv_heads": 1, "qk_rmsnorm": True, "rope_theta": 500.0}},
)


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True, **kwargs)


def test_model_with_fla_attention_options_generates_the_same_with_and_without_cache():
    model = tiny_model("hybrid", **FLA_LIKE_HYBRID)
    attn = model.model.layers[0].mixer
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 8)
    assert attn.k_proj.weight.shape == (16, 32) and attn.q_proj.bias is not None
    assert model.model.layers[1].mixer.window == 6
    ids = random_ids(2, 7, seed=3)
    cached, full = _greedy(model, ids, use_cache=True), _greedy(model, ids, use_cache=False)
    assert torch.equal(cached.sequences, full.sequences)
    for step, (a, b) in enumerate(zip(cached.logits, full.logits)):
        assert_close(a, b, 1e-4, f"step {step} logits")
    # a left-padded batch: each row as if alone
    prompts = [random_ids(n, seed=40 + n) for n in (9, 4)]
    ids = random_ids(2, 9, seed=7)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 9 - len(p):], mask[b, 9 - len(p):] = p, 1
    batched = _greedy(model, ids, attention_mask=mask)
    for b, p in enumerate(prompts):
        alone = _greedy(model, p[None])
        assert torch.equal(batched.sequences[b, 9:], alone.sequences[0, len(p):]), f"row {b}"


def test_options_are_typed_fields_and_survive_a_save(tmp_path):
    model = tiny_model("sliding_window", num_heads=4, num_kv_heads=1, qkv_bias=True, qk_rmsnorm=True,
                       qk_rmsnorm_eps=1e-6)
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.num_heads, config.num_kv_heads, config.qkv_bias, config.qk_rmsnorm, config.qk_rmsnorm_eps) == (
        4, 1, True, True, 1e-6)
    names = {n for n, _ in model.model.layers[0].mixer.named_parameters()}
    assert names == {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                     "o_proj.weight", "q_norm.weight", "k_norm.weight"}
    assert model.model.layers[0].mixer.q_norm.eps == 1e-6


# ----------------------------------------------------------------------------- fla's own layer (when importable)
@pytest.fixture(scope="module")
def fla_attn():
    """fla's attention module, imported with a stub `flash_attn` (fla checks it at construction only); skips
    when fla is not importable."""
    if FLA_SITE not in sys.path:
        sys.path.insert(0, FLA_SITE)
    import transformers.activations  # noqa: F401  (transformers probes flash_attn at import: before the stub)

    stub = None
    if "flash_attn" not in sys.modules:
        stub = types.ModuleType("flash_attn")
        stub.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        stub.flash_attn_func = stub.flash_attn_varlen_func = ref.flash_attn_func
        sys.modules["flash_attn"] = stub
    try:
        import fla.layers.attn as attn_module
        import fla.models.cache_utils as cache_utils
        import fla.modules.rotary.ops as rotary_ops
        from fla.modules import GatedMLP as FlaGatedMLP
        from fla.modules import RMSNorm
    except ImportError as err:
        pytest.skip(f"fla 0.6.0 is not importable from {FLA_SITE} ({err}); the transcription tests still run")
    finally:
        if stub is not None and sys.modules.get("flash_attn") is stub:
            del sys.modules["flash_attn"]
    return types.SimpleNamespace(module=attn_module, rotary=rotary_ops, RMSNorm=RMSNorm, Cache=cache_utils.Cache,
                                 GatedMLP=FlaGatedMLP)


@pytest.fixture
def fla_on_cpu(fla_attn, monkeypatch):
    """fla's Attention.forward on the CPU: its kernels replaced by the torch stand-ins."""
    monkeypatch.setattr(fla_attn.module, "flash_attn_func", ref.flash_attn_func)
    monkeypatch.setattr(fla_attn.module, "flash_attn_varlen_func", ref.flash_attn_varlen_func)
    monkeypatch.setattr(fla_attn.rotary, "rotary_embedding", ref.rotary_embedding)
    monkeypatch.setattr(fla_attn.RMSNorm, "forward", ref.rms_norm_forward)
    return fla_attn


def fla_layer(fla_attn, fla: dict, seed: int):
    """fla's Attention with `fla` settings, random float64 weights, RoPE tables built in float64 (fla builds
    them in fp32 then casts)."""
    layer = fla_attn.module.Attention(hidden_size=HIDDEN, layer_idx=0, **fla).double()
    layer.load_state_dict(random_fla_params(fla, seed), strict=True)
    rotary = layer.rotary
    rotary.pos_idx_in_fp32 = False
    rotary.inv_freq.copy_(1.0 / (rotary.base ** (torch.arange(0, rotary.dim, 2, dtype=torch.float64) / rotary.dim)))
    return layer


@pytest.mark.parametrize("case", list(CASES))
def test_fla_attention_layer_equals_lazoo_and_the_transcription(fla_on_cpu, case):
    fla = CASES[case]
    layer = fla_layer(fla_on_cpu, fla, seed=11)
    params = {n: p.detach() for n, p in layer.state_dict().items()}
    assert set(params) == {n for n in ref.FLA_TO_LAZOO_ATTENTION if n in params}, "unmapped fla parameter"
    mixer = lazoo_mixer(fla)
    load_fla_params(mixer, params)
    x, mask = ragged_batch(seed=12)
    with torch.no_grad():
        fla_out = layer(x, attention_mask=mask.long())[0]
        fla_unpadded = layer(x[:1])[0]  # the flash_attn_func path (no mask)
        lazoo_out = run_lazoo(mixer, x, mask)
    assert_close(lazoo_out, fla_out, 1e-10, f"{case}: lazoo vs fla")
    assert_close(lazoo_out[:1], fla_unpadded, 1e-10, f"{case}: lazoo vs fla without a mask")
    assert_close(transcription(params, fla, x, mask), fla_out, 1e-10, f"{case}: transcription vs fla")


@pytest.mark.parametrize("case", ["gqa_bias", "mqa_all"])
def test_fla_packed_sequences_equal_lazoo_packed_sequences(fla_on_cpu, case):
    """fla's `cu_seqlens` path (packed sequences, RoPE restarting per sequence) against lazoo's packed forward."""
    fla = CASES[case]
    layer = fla_layer(fla_on_cpu, fla, seed=15)
    mixer = lazoo_mixer(fla)
    load_fla_params(mixer, {n: p.detach() for n, p in layer.state_dict().items()})
    x = torch.randn(1, 13, HIDDEN, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 6, 7, 13])
    positions = torch.cat([torch.arange(e - s) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])[None]
    with torch.no_grad():
        fla_out = layer(x, cu_seqlens=cu_seqlens)[0]
        lazoo_out = mixer.forward_packed(x, position_ids=positions, cu_seqlens=cu_seqlens)
    assert_close(lazoo_out, fla_out, 1e-10, f"{case}: packed")


@pytest.mark.parametrize("case", ["gqa_bias", "mqa_all"])
def test_fla_cached_decoding_equals_lazoo_cached_decoding(fla_on_cpu, case):
    """A left-padded prompt then single tokens, through fla's cache and lazoo's: the same outputs at every step
    (RoPE positions count real tokens in both; the window keeps the last W real tokens)."""
    fla = CASES[case]
    layer = fla_layer(fla_on_cpu, fla, seed=13)
    mixer = lazoo_mixer(fla)
    load_fla_params(mixer, {n: p.detach() for n, p in layer.state_dict().items()})
    x, mask = ragged_batch(seed=14, T=14)
    x, mask = x[:2], mask[:2]  # full and left-padded rows
    prompt = 8
    fla_cache, lazoo_cache = fla_on_cpu.Cache(), LazooCache(1)
    seen = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, x.shape[1])]:
            fla_out = layer(x[:, start:end], attention_mask=mask[:, :end].long(), past_key_values=fla_cache,
                            use_cache=True)[0]
            lazoo_out = run_lazoo(mixer, x[:, start:end], mask[:, start:end], cache=lazoo_cache, offset=seen)
            seen = seen + mask[:, start:end].sum(1)
            assert_close(lazoo_out, fla_out, 1e-10, f"{case}: positions {start}..{end - 1}")


def test_fla_mlp_width_and_names(fla_attn):
    for hidden, ratio, size in [(1024, 4, None), (2048, None, None), (48, 2, None), (64, 4, 100), (768, 3.5, None)]:
        mlp = fla_attn.GatedMLP(hidden_size=hidden, hidden_ratio=ratio, intermediate_size=size)
        assert mlp.intermediate_size == ref.fla_intermediate_size(hidden, ratio, size), (hidden, ratio, size)
    fla_names = set(fla_attn.GatedMLP(hidden_size=HIDDEN, intermediate_size=48).state_dict())
    assert fla_names == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert fla_names == set(GatedMLP(HIDDEN, 48).state_dict())


def test_the_converters_mlp_width_rule_is_fla_s():
    convert = pytest.importorskip("lazoo.convert.fla", reason="the fla converter is not there")
    for args in [(1024, 4, None), (2048, None, None), (48, 2, None), (64, 4, 100), (768, 3.5, None)]:
        assert convert.fla_intermediate_size(*args) == ref.fla_intermediate_size(*args), args
