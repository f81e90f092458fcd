"""Nemotron-H folders ("Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer Models", NVIDIA, 2025)
saved by transformers' own `NemotronHForCausalLM`, converted with `lazoo convert`: the same logits as transformers'
model in float64 (its float32 casts lifted) and in float32 as it runs, at every real position of left-padded prompts,
the same greedy tokens for 32 steps with the cache, and refusals naming the field that leave DST as it was.

The blocks of the tiny models pair in every way lazoo maps them: an MLP block with no mixing block before it (a lazoo
layer without a token mixer), Mamba-2 + MLP (one layer), attention alone (a layer without a feed-forward), Mamba-2 +
MoE, MoE after MoE (no mixer again) and a last Mamba-2 block alone. The MoE routes with grouped top-k, a
score-correction bias, renormalised and scaled weights, latent projections and a shared expert. On a transformers
release without these classes the tests skip, saying so."""

from __future__ import annotations

import json

import pytest
import torch
from convert_helpers import (
    check_outcome,
    edit_config,
    edit_weights,
    generate_in_two_calls,
    refusal_into_a_folder,
    run_convert,
    save_with_tokenizer_config,
)
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from mamba_helpers import logits_of, reference_logits, tiny_model
from qwen_helpers import prompt_and_mask, relative_error
from transformers import AutoModelForCausalLM

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.convert import convert_checkpoint, nemotron_config_to_lazoo
from lazoo.convert.nemotron import BLOCK_KINDS, pair_blocks

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCKS = ["mlp", "mamba", "mlp", "attention", "mamba", "moe", "moe", "mamba"]
#: the lazoo layers of BLOCKS: their mixers (None: none) and the layers with a feed-forward, and a MoE
LAYER_TYPES = [None, "mamba2", "softmax", "mamba2", None, "mamba2"]
MLP_LAYERS, MOE_LAYERS = [0, 1, 3, 4], [3, 4]
MOE = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, moe_shared_expert_intermediate_size=12,
           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
#: each case: the transformers config's overrides (and whether the head is tied)
CASES = {
    "blocks": {**MOE},
    # tie_word_embeddings, which transformers' model reads nowhere (its head is lm_head.weight all the same)
    "latent_tie_field": {**MOE, "moe_latent_size": 16, "tie": True, "head_dim": 12, "norm_topk_prob": False},
    # a clamp on dt that changes most step sizes (transformers clamps them at time_step_min)
    "dt_clamp": {**MOE, "time_step_min": 0.6, "time_step_max": 1.0, "n_group": 1, "topk_group": 1},
}


def nemotron_model(seed: int = 0, blocks=BLOCKS, tie: bool = False, **overrides):
    """transformers' NemotronHForCausalLM with random weights everywhere (the correction bias and the router too, so
    that a wrong choice of experts shows)."""
    model = tiny_model("nemotron_h", seed=seed, tie=tie, layers_block_type=list(blocks), **overrides)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p))
    model.config._experts_implementation = "eager"  # (its grouped GEMM refuses float64)
    return model


def save_nemotron(folder, seed: int = 0, **overrides):
    return save_with_tokenizer_config(nemotron_model(seed, **overrides), folder)


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, transformers' model, the converted lazoo model, dst) for each case."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    reference = save_nemotron(root / "src", **CASES[case])
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    return case, reference, ours, dst


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-8), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_logits_equal_transformers(converted, dtype, rtol):
    """Every real position of left-padded prompts (rows padded by 0, 4 and 7): transformers' model in float64 with its
    float32 casts lifted, or in float32 as it runs."""
    _, reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    expected = reference_logits(reference, ids, mask, dtype)
    got = logits_of(ours.to(dtype), ids, mask)
    real = mask.bool()
    assert relative_error(got[real], expected[real]) < rtol


def test_greedy_tokens_equal_transformers_for_32_steps_with_the_cache(converted):
    """lazoo with its cache against transformers without one (its function: it clamps dt only when it runs a whole
    sequence) and, where the clamp leaves every step size alone, with one."""
    case, reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    reference, ours = reference.float(), ours.float()
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        expected = reference.generate(ids, use_cache=False, **kwargs)
        got = ours.generate(ids, **kwargs)
        if case != "dt_clamp":
            assert torch.equal(reference.generate(ids, **kwargs), expected)
    assert expected.shape[1] == ids.shape[1] + 32
    assert torch.equal(got, expected)


def test_the_clamp_on_dt_changes_the_logits(converted, tmp_path):
    """The dt_clamp case tests the clamp: without it the converted model computes other logits."""
    case, _, ours, dst = converted
    if case != "dt_clamp":
        pytest.skip("the clamp bites in the dt_clamp case only")
    assert ours.config.mixer_options("mamba2")["dt_clamp_min"] == 0.6
    ids, mask = prompt_and_mask()
    options = ours.config.mixer_kwargs
    unclamped = AutoModelForCausalLM.from_pretrained(dst, mixer_kwargs={
        **options, "mamba2": {**options["mamba2"], "dt_clamp_min": 0.0}}).eval()
    real = mask.bool()
    assert relative_error(logits_of(unclamped, ids, mask)[real], logits_of(ours.float(), ids, mask)[real]) > 1e-3


def test_the_config_says_how_the_blocks_became_layers(converted):
    case, _, ours, dst = converted
    config = ours.config
    assert config.converted_from["model_type"] == "nemotron_h"
    assert config.layer_types == LAYER_TYPES and config.mlp_layers == MLP_LAYERS and config.moe_layers == MOE_LAYERS
    assert (config.mlp_gated, config.mlp_activation, config.moe_router_score) == (False, "relu2", "sigmoid")
    assert (config.moe_num_groups, config.moe_top_k_groups) == ((1, 1) if case == "dt_clamp" else (4, 2))
    assert config.moe_latent_size == (16 if case == "latent_tie_field" else None)
    assert config.tie_word_embeddings is False
    assert config.mixer_options("softmax")["use_rope"] is False
    layers = ours.model.layers
    assert layers[0].mixer is None and layers[2].mlp is None and layers[4].mixer is None
    assert "model type `nemotron_h`" in (dst / "README.md").read_text()


def test_a_cache_continues_across_two_generate_calls(converted):
    """8 tokens, then 8 more from the returned cache, are the 16 of one call (layers without a mixer keep nothing)."""
    _, _, ours, _ = converted
    ids, mask = prompt_and_mask()
    whole, second, cache = generate_in_two_calls(ours.float(), ids, mask,
                                                 dict(do_sample=False, pad_token_id=0, eos_token_id=None))
    assert cache.read_state(0) is None and cache.read_state(4) is None and cache.read_state(1) is not None
    assert torch.equal(second, whole)


# ----------------------------------------------------------------------------- the blocks, the fields
@pytest.mark.parametrize("kinds,expected", [
    ("M-M*E", [(0, 1), (2, None), (3, 4)]),
    ("MM*", [(0, None), (1, None), (2, None)]),
    ("--E", [(None, 0), (None, 1), (None, 2)]),
    ("M*--", [(0, None), (1, 2), (None, 3)]),
])
def test_a_mixing_block_takes_the_feed_forward_block_after_it(kinds, expected):
    assert pair_blocks([BLOCK_KINDS[k] for k in kinds]) == expected


def test_the_fields_of_earlier_releases_convert(tmp_path):
    """A folder as the first published Nemotron-H checkpoints wrote it: `hybrid_override_pattern` in place of
    `layers_block_type`, the Mamba-2 fields under their `mamba_` names, `attention_head_dim`, and the tensors of one
    module per expert (as transformers saves them too) computes the same logits."""
    reference = save_nemotron(tmp_path / "src", **MOE)

    def earlier(c):
        c["hybrid_override_pattern"] = "".join({"mlp": "-", "mamba": "M", "attention": "*", "moe": "E"}[k]
                                               for k in BLOCKS)
        del c["layers_block_type"]
        c.update(mamba_n_groups=c.pop("n_groups"), mamba_d_conv=c.pop("conv_kernel"),
                 mamba_dt_min=c.pop("time_step_min"), attention_head_dim=c["head_dim"], num_hidden_layers=52)

    edit_config(tmp_path / "src", earlier)
    dst, _ = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.layer_types == LAYER_TYPES
    ids, mask = prompt_and_mask()
    real = mask.bool()
    assert relative_error(logits_of(ours, ids, mask)[real], logits_of(reference, ids, mask)[real]) < 1e-5


def test_the_multi_token_prediction_layers_are_left_out_and_said_so(tmp_path):
    reference = save_nemotron(tmp_path / "src", **MOE)
    edit_weights(tmp_path / "src", lambda t: t.update({"mtp.layers.0.norm.weight": torch.ones(32)}))
    edit_config(tmp_path / "src", lambda c: c.update(num_nextn_predict_layers=1))
    dst, left_out = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert len(left_out) == 1 and "mtp" in left_out[0]
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.converted_from["left_out"] == left_out
    ids, mask = prompt_and_mask()
    real = mask.bool()
    assert relative_error(logits_of(ours, ids, mask)[real], logits_of(reference, ids, mask)[real]) < 1e-5


def test_a_dense_folder_without_moe_blocks_converts():
    fields = nemotron_config_to_lazoo({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-*-",
                                       "vocab_size": 97, "hidden_size": 32})
    assert fields["layer_types"] == ["mamba2", "mamba2", "softmax"] and "moe_num_experts" not in fields
    assert "mlp_layers" not in fields and fields["mlp_activation"] == "relu2"


# ----------------------------------------------------------------------------- refusals
REFUSED_CONFIGS = {
    "an MLP bias": (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    "an attention bias": (lambda c: c.update(attention_bias=True), "attention_bias"),
    "a Mamba-2 projection bias field": (lambda c: c.update(mamba_proj_bias=True), "mamba_proj_bias"),
    "a sliding window": (lambda c: c.update(sliding_window=16), "sliding_window"),
    "attention dropout": (lambda c: c.update(attention_dropout=0.1), "attention_dropout"),
    "a gelu convolution": (lambda c: c.update(mamba_hidden_act="gelu"), "mamba_hidden_act"),
    "an MLP activation lazoo lacks": (lambda c: c.update(mlp_hidden_act="mish"), "mlp_hidden_act"),
    "a clamp other than time_step_min": (lambda c: c.update(time_step_limit=[0.0, 0.5]), "time_step_limit"),
    "an unknown field": (lambda c: c.update(mixer_type="mamba3"), "mixer_type"),
    "an unknown block kind": (lambda c: c.update(layers_block_type=["mamba", "gdn"]), "layers_block_type"),
    "groups of one expert": (lambda c: c.update(n_group=8), "n_group"),
    "groups that do not divide the heads": (lambda c: c.update(n_groups=3), "n_groups"),
    "an attention head width of its own": (lambda c: c.update(attention_head_dim=16), "attention_head_dim"),
    "a count that is a string": (lambda c: c.update(ssm_state_size="8"), "ssm_state_size"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_a_config_lazoo_cannot_express_is_refused_by_field_and_dst_is_untouched(case, tmp_path, capfd):
    edit, field = REFUSED_CONFIGS[case]
    save_nemotron(tmp_path / "src", **MOE)
    edit_config(tmp_path / "src", edit)
    error = refusal_into_a_folder(tmp_path / "src", tmp_path / "dst", capfd)
    assert field in error and "config.json" in error, error


REFUSED_WEIGHTS = {
    "a missing expert": (lambda t: t.pop("backbone.layers.5.mixer.experts.3.up_proj.weight"), "experts.3.up_proj"),
    "a tensor no Nemotron-H model writes": (lambda t: t.update({"backbone.layers.0.extra.weight": torch.zeros(2)}),
                                            "extra.weight"),
    "a NaN weight": (lambda t: t["backbone.layers.1.mixer.dt_bias"].fill_(float("nan")), "dt_bias"),
    "a block more than the config says": (lambda t: t.update({"backbone.layers.9.norm.weight": torch.zeros(32)}),
                                          "layers"),
}


@pytest.mark.parametrize("case", list(REFUSED_WEIGHTS))
def test_weights_that_do_not_fit_are_refused_by_name_and_dst_is_untouched(case, tmp_path, capfd):
    edit, name = REFUSED_WEIGHTS[case]
    save_nemotron(tmp_path / "src", **MOE)
    edit_weights(tmp_path / "src", edit)
    status, err, _ = run_convert(tmp_path / "src", tmp_path / "dst", capfd)
    check_outcome(status, err, tmp_path / "dst", None)
    assert status == 2 and name in err[0], err


def test_the_saved_config_is_plain_json(converted):
    """The converted config.json writes a layer without a mixer as null, and loads back to the same fields."""
    _, _, ours, dst = converted
    saved = json.loads((dst / "config.json").read_text())
    assert saved["layer_types"] == LAYER_TYPES and saved["mlp_layers"] == MLP_LAYERS
