"""Decoder layers without a token mixer (a `layer_types` entry None) or without a feed-forward (not in `mlp_layers`),
the plain MLP (`mlp_gated=False`) with its activation (`mlp_activation`), experts with a latent space
(`moe_latent_size`) and Mamba-2's clamp on dt (`dt_clamp_min`): each layer computes what its parts say (against a
float64 reference written here), the config round-trips through save_pretrained / from_pretrained, generate with the
cache equals generate without it, and bad values are refused naming the field. The defaults keep the layers as they
were."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.layers.mlp import PlainMLP
from lazoo.layers.moe import RoutedMoE
from lazoo.models.configuration_lazoo import LazooConfig
from lazoo.models.modeling_lazoo import LazooForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")


def partial_config(**overrides) -> LazooConfig:
    """A feed-forward alone, Mamba-2 + MLP, attention alone, Mamba-2 + MoE (latent experts), a MoE alone."""
    fields = dict(vocab_size=61, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=40,
                  layer_types=[None, "mamba2", "softmax", "mamba2", None], mlp_layers=[0, 1, 3, 4],
                  moe_layers=[3, 4], moe_num_experts=4, moe_top_k=2, moe_intermediate_size=12, moe_bias=None,
                  moe_latent_size=16, moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=False,
                  mlp_gated=False, mlp_activation="relu2", sliding_window=None, pad_token_id=0,
                  mixer_kwargs={"mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 8, "chunk_size": 8,
                                           "dt_clamp_min": 0.05},
                                "softmax": {"use_rope": False}})
    fields.update(overrides)
    return LazooConfig(**fields)


def partial_model(seed: int = 0, **overrides) -> LazooForCausalLM:
    torch.manual_seed(seed)
    model = LazooForCausalLM(partial_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def test_each_layer_has_the_parts_the_config_gives_it():
    layers = partial_model().model.layers
    assert layers[0].mixer is None and layers[0].input_norm is None and isinstance(layers[0].mlp, PlainMLP)
    assert layers[2].mlp is None and layers[2].post_mixer_norm is None and layers[2].mixer is not None
    assert isinstance(layers[3].mlp, RoutedMoE) and layers[3].mlp.experts.up_proj.shape == (4, 12, 16)
    assert not hasattr(layers[3].mlp.experts, "gate_up_proj") and layers[3].mlp.latent_in_proj.weight.shape == (16, 32)


def _reference_layer(layer, x):
    """The layer from its parts, in float64: `h = x + mixer(norm(x))` where it has a mixer, `h + mlp(norm(h))` where
    it has a feed-forward (the MLP written out: down(relu(up(x))²))."""
    h = x if layer.mixer is None else x + layer.mixer(layer.input_norm(x))
    if layer.mlp is None:
        return h
    normed = layer.post_mixer_norm(h)
    if isinstance(layer.mlp, PlainMLP):
        return h + F.relu(normed @ layer.mlp.up_proj.weight.T).square() @ layer.mlp.down_proj.weight.T
    return h + layer.mlp(normed)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_layer_computes_its_parts(index):
    model = partial_model().double()
    layer = model.model.layers[index]
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference_layer(layer, x), rtol=1e-12, atol=1e-12)


def test_the_latent_experts_compute_what_the_module_docstring_says():
    """`y = W_out Σ w_e · f_e(W_in x) + f_shared(x)`, with plain relu² experts, in float64."""
    moe = partial_model().double().model.layers[3].mlp
    x = torch.randn(9, 32, dtype=torch.float64)
    with torch.no_grad():
        _, weights, chosen = moe.route(x)
        latent = moe.latent_in_proj(x)
        routed = torch.zeros_like(latent)
        for n in range(x.shape[0]):
            for w, e in zip(weights[n], chosen[n]):
                hidden = F.relu(latent[n] @ moe.experts.up_proj[e].T).square()
                routed[n] += w * (hidden @ moe.experts.down_proj[e].T)
        expected = moe.latent_out_proj(routed) + moe.shared_expert(x)
        assert torch.allclose(moe(x), expected, rtol=1e-12, atol=1e-12)


def test_the_clamp_on_dt_changes_the_layer_and_zero_is_no_clamp():
    model = partial_model().double()
    ids = torch.randint(1, 61, (2, 9))
    with torch.no_grad():
        clamped = model(ids).logits
        for layer in (model.model.layers[1], model.model.layers[3]):
            layer.mixer.options = {**layer.mixer.options, "dt_clamp_min": 0.0}
        unclamped = model(ids).logits
        for layer in (model.model.layers[1], model.model.layers[3]):
            layer.mixer.options = {**layer.mixer.options, "dt_clamp_min": 1e3}
        all_clamped = model(ids).logits
    assert not torch.allclose(clamped, unclamped) and not torch.allclose(clamped, all_clamped)


def test_save_load_round_trip_and_generate_with_the_cache_equals_without(tmp_path):
    model = partial_model()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"][0] is None and saved["mlp_layers"] == [0, 1, 3, 4]
    assert (saved["mlp_gated"], saved["mlp_activation"], saved["moe_latent_size"]) == (False, "relu2", 16)
    loaded = LazooForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 61, (3, 11))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
        kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        cached = loaded.generate(ids, **kwargs)
        assert torch.equal(cached, loaded.generate(ids, use_cache=False, **kwargs))


def test_a_cache_of_attention_and_feed_forward_layers_crops():
    """A layer without a mixer writes no state, and so does not keep a cache of attention layers from cropping."""
    model = partial_model(layer_types=[None, "softmax", "softmax", "softmax", None], mixer_kwargs={})
    ids = torch.randint(1, 61, (1, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache.read_state(0) is None and cache.is_croppable
    cache.crop(5)
    assert cache.seen_positions == 5


def test_the_defaults_keep_the_gated_mlp_in_every_layer():
    config = LazooConfig(num_hidden_layers=2, layer_types=["softmax", "softmax"], hidden_size=32,
                         num_attention_heads=4)
    assert (config.mlp_layers, config.mlp_gated, config.mlp_activation, config.moe_latent_size) == (
        None, True, "silu", None)
    layer = LazooForCausalLM(config).model.layers[0]
    assert hasattr(layer.mlp, "gate_proj") and layer.mixer.options["use_rope"]


@pytest.mark.parametrize("overrides,message", [
    ({"mlp_layers": [0, 1, 3]}, "layer 4 has neither a token mixer"),
    ({"mlp_layers": [0, 7]}, "mlp_layers entries must be layer indices"),
    ({"mlp_layers": [0, 1, 2, 4]}, "moe_layers lists layer 3, which has no feed-forward"),
    ({"mlp_gated": "no"}, "mlp_gated must be True"),
    ({"mlp_activation": "mish"}, "mlp_activation must be one of"),
    ({"moe_latent_size": 0}, "moe_latent_size must be None"),
    ({"hyper_link": True}, "hyper_link=True feeds each layer's mixer output"),
    ({"layer_types": [None, 3, "softmax", "mamba2", None]}, "layer_types entries must be mechanism names"),
])
def test_bad_values_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        partial_config(**overrides)


def test_a_negative_clamp_is_refused():
    with pytest.raises(ValueError, match="dt_clamp_min must be a finite number >= 0"):
        LazooForCausalLM(partial_config(mixer_kwargs={"mamba2": {"num_heads": 4, "head_dim": 16,
                                                                  "dt_clamp_min": -1.0}}))
