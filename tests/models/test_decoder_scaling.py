"""Granite's scaling as config fields: `embedding_multiplier` (the embeddings scaled), `residual_multiplier` (each
residual branch scaled before it is added), `logits_scaling` (the logits divided), and the attention option
`softmax_scale` (the number the scores are multiplied by). Each does what it says against the model computed another
way in float64, bad values are refused naming the field, and a model with them saves and loads with its numbers; the
defaults leave the model as it was."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_config
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")


def _model(softmax: dict | None = None, **fields):
    """A float64 hybrid of softmax (with the options `softmax`) and Mamba-2 layers, untied, with random weights."""
    mixers = {"mamba2": {"num_heads": 2, "head_dim": 32, "state_size": 8}, "softmax": softmax or {}}
    config = tiny_config("hybrid", layer_types=["softmax", "mamba2"], tie_word_embeddings=False,
                         mixer_kwargs=mixers, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _same_weights(model, softmax: dict | None = None, **fields):
    """A model of `_model(softmax, **fields)` holding `model`'s weights."""
    other = _model(softmax, **fields)
    other.load_state_dict(model.state_dict())
    return other


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_embedding_multiplier_scales_the_embeddings():
    """The model with embedding_multiplier m computes the plain model with its embedding weights times m."""
    plain = _model()
    scaled = _same_weights(plain, embedding_multiplier=12.0)
    with torch.no_grad():
        plain.model.embed_tokens.weight.mul_(12.0)
    ids = random_ids(2, 9, seed=1)
    torch.testing.assert_close(_logits(scaled, ids), _logits(plain, ids), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(_logits(scaled, ids), _logits(_same_weights(scaled), ids))


def test_logits_scaling_divides_the_logits():
    plain = _model()
    scaled = _same_weights(plain, logits_scaling=6.0)
    ids = random_ids(2, 9, seed=1)
    assert torch.equal(_logits(scaled, ids), _logits(plain, ids) / 6.0)


def test_residual_multiplier_scales_each_branch_before_it_is_added():
    """A layer's output is `h + m·mlp(norm(h))` with `h = x + m·mixer(norm(x))`, computed here from its parts."""
    model = _model(residual_multiplier=0.22)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    positions = torch.arange(7).expand(2, -1)
    for layer in model.model.layers:
        with torch.no_grad():
            h = x + 0.22 * layer.mixer(layer.input_norm(x), position_ids=positions)
            expected = h + 0.22 * layer.mlp(layer.post_mixer_norm(h))
            got = layer(x, position_ids=positions)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    ids = random_ids(2, 9, seed=1)
    assert not torch.allclose(_logits(model, ids), _logits(_same_weights(model), ids))


def test_softmax_scale_multiplies_the_scores():
    """softmax_scale c equals the default 1/√d with q_proj's weights times c·√d (RoPE turns q linearly)."""
    scaled = _model({"softmax_scale": 0.125})
    plain = _same_weights(scaled)
    head_dim = 32 // 2
    with torch.no_grad():
        plain.model.layers[0].mixer.q_proj.weight.mul_(0.125 * math.sqrt(head_dim))
    ids = random_ids(2, 9, seed=1)
    torch.testing.assert_close(_logits(scaled, ids), _logits(plain, ids), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(_logits(scaled, ids), _logits(_same_weights(scaled), ids))


def test_the_fields_save_and_load_with_their_numbers(tmp_path):
    model = _model({"softmax_scale": 0.125, "use_rope": False}, embedding_multiplier=12.0, residual_multiplier=0.22,
                   logits_scaling=6.0)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    config = loaded.config
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (12.0, 0.22, 6.0)
    assert config.mixer_options("softmax")["softmax_scale"] == 0.125
    ids = random_ids(2, 9, seed=1)
    # the same function: equal to float64 rounding (a BLAS may round differently for other allocations of the same
    # weights: bit equality differed by one ulp on an AMD EPYC)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=1e-12, atol=1e-14)


def test_the_defaults_are_no_scaling():
    config = tiny_config("softmax")
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 1.0)
    assert config.mixer_options("softmax")["softmax_scale"] is None


@pytest.mark.parametrize("field", ["embedding_multiplier", "residual_multiplier", "logits_scaling"])
@pytest.mark.parametrize("value", [0.0, -2.0, math.inf, math.nan, True, "2"])
def test_a_bad_scaling_field_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        tiny_config("softmax", **{field: value})


def test_residual_multiplier_is_refused_with_a_memory_lobe():
    with pytest.raises(ValueError, match="residual_multiplier=0.5 .* memory_lobe"):
        tiny_config("softmax", residual_multiplier=0.5, memory_lobe="causal")


@pytest.mark.parametrize("options, message", [
    ({"softmax_scale": 0.0}, "softmax_scale must be None"),
    ({"softmax_scale": "0.1"}, "softmax_scale must be None"),
    ({"softmax_scale": 0.1, "qk_norm": True}, "softmax_scale=0.1 and qk_norm=True"),
])
def test_a_bad_softmax_scale_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(tiny_config("softmax", **options))
