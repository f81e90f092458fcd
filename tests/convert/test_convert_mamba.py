"""Mamba-2 ("Transformers are SSMs", Dao and Gu, 2024) and Bamba folders saved by transformers' own classes, converted
with `lazoo convert`: the same logits as transformers' model (float64 with its float32 casts lifted, and float32 as
it runs) at every real position of left-padded prompts, the same greedy tokens with the cache, a cache continued
across two `generate` calls, and refusals by field that leave DST as it was. On a transformers release without
these classes the tests skip, saying so. (Nemotron-H: test_convert_nemotron.py; GraniteMoeHybrid:
test_convert_granite.py.)"""

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
)
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from mamba_helpers import CONVERTED, VOCAB, greedy_tokens, groups, reference_logits, require, save_tiny
from qwen_helpers import prompt_and_mask, relative_error
from transformers import AutoModelForCausalLM

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.convert import UnsupportedCheckpointError, convert_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

#: each converted kind, and the variants: a tied head, biases on in_proj / out_proj
CASES = {"mamba2": ("mamba2", {}), "mamba2_tied_bias": ("mamba2", {"tie": True, "use_bias": True}),
         "bamba": ("bamba", {}), "bamba_tied": ("bamba", {"tie": True})}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, kind, transformers' model, the converted lazoo model, dst) for each case."""
    case = request.param
    kind, options = CASES[case]
    require(kind)
    root = tmp_path_factory.mktemp(case)
    reference = save_tiny(root / "src", kind, **options)
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    return case, kind, reference, ours, dst


def _logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def _prompts(case):
    """Left-padded prompts (rows padded by 0, 4 and 7), or unpadded ones where in_proj has a bias: transformers
    zeroes a pad's hidden state before in_proj, so there its bias reaches the convolution of the first real tokens
    (its padded rows differ from the same rows unpadded), while lazoo keeps pads out of every real token."""
    ids, mask = prompt_and_mask()
    if "bias" in case:
        ids, mask = ids[:, 7:], mask[:, 7:]
    return ids, mask


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-8), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_logits_equal_transformers(converted, dtype, rtol):
    """Every real position: transformers' model in float64 with its float32 casts lifted, or in float32 as it runs
    (its reference PyTorch forms, float32 casts included)."""
    case, kind, reference, ours, _ = converted
    ids, mask = _prompts(case)
    expected = reference_logits(reference, ids, mask, dtype)
    got = _logits(ours.to(dtype), ids, mask)
    real = mask.bool()
    assert relative_error(got[real], expected[real]) < rtol


def test_greedy_tokens_equal_transformers_for_32_steps_with_the_cache(converted):
    case, kind, reference, ours, _ = converted
    ids, mask = _prompts(case)
    expected, got = greedy_tokens(reference, ours, ids, mask)
    assert torch.equal(got, expected)


def test_a_cache_continues_across_two_generate_calls(converted):
    """8 tokens, then 8 more from the returned cache, are the 16 of one call."""
    case, _, _, ours, _ = converted
    ids, mask = _prompts(case)
    ours = ours.float()
    whole, second, _ = generate_in_two_calls(ours, ids, mask, dict(do_sample=False, pad_token_id=0, eos_token_id=None))
    assert torch.equal(second, whole)


def test_the_config_and_the_card_say_what_was_converted(converted):
    case, kind, reference, ours, dst = converted
    config = ours.config
    assert config.converted_from["format"] == "transformers" and config.converted_from["model_type"] == kind
    assert config.vocab_size == VOCAB and config.tie_word_embeddings == ("tied" in case)
    options = config.mixer_options("mamba2")
    layout = (options["num_heads"], options["head_dim"], options["state_size"], options["n_groups"])
    assert layout == (4, 16, 8, groups())
    if kind == "mamba2":
        assert config.layer_types == ["mamba2"] * 3 and config.intermediate_size == 0
        assert options["use_bias"] == ("bias" in case)
    else:
        assert config.layer_types == ["mamba2", "softmax", "mamba2", "mamba2"] and config.intermediate_size == 48
        attention = config.mixer_options("softmax")
        assert (attention["num_kv_heads"], attention["rotary_dim"]) == (2, 4)  # half of each head's 8 channels
    assert f"model type `{kind}`" in (dst / "README.md").read_text()


def test_the_fields_of_earlier_releases_convert(tmp_path):
    """Folders written by earlier transformers releases (as Mamba-Codestral's is): Mamba-2's `norm_before_gate` false
    and `rms_norm` true, and Bamba's `attn_rotary_emb` of half a head, say what the layers compute anyway."""
    require("mamba2")
    save_tiny(tmp_path / "src", "mamba2")
    edit_config(tmp_path / "src", lambda c: c.update(norm_before_gate=False, rms_norm=True))
    dst, _ = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert AutoModelForCausalLM.from_pretrained(dst).config.layer_types == ["mamba2"] * 3
    require("bamba")  # Bamba's attn_rotary_emb: half of each head's channels
    save_tiny(tmp_path / "bamba", "bamba")
    edit_config(tmp_path / "bamba", lambda c: c.update(attn_rotary_emb=4))
    dst, _ = convert_checkpoint(tmp_path / "bamba", tmp_path / "bamba_dst")
    assert AutoModelForCausalLM.from_pretrained(dst).config.mixer_options("softmax")["rotary_dim"] == 4


def test_the_older_name_of_the_embedding_converts(tmp_path):
    """Folders written before transformers renamed `backbone.embedding` to `backbone.embeddings` (its load hook
    still reads the old name)."""
    require("mamba2")
    reference = save_tiny(tmp_path / "src", "mamba2")
    edit_weights(tmp_path / "src", lambda t: t.update({"backbone.embedding.weight":
                                                        t.pop("backbone.embeddings.weight")}))
    dst, _ = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    ids, mask = prompt_and_mask()
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    real = mask.bool()
    assert relative_error(_logits(ours, ids, mask)[real], _logits(reference, ids, mask)[real]) < 1e-5


# ----------------------------------------------------------------------------- refusals
REFUSED_CONFIGS = {
    "a clamp on dt": ("mamba2", lambda c: c.update(time_step_limit=[0.0, 0.5]), "time_step_limit"),
    "a gelu convolution": ("mamba2", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    "an unknown field": ("mamba2", lambda c: c.update(mixer_type="mamba3"), "mixer_type"),
    "heads that do not fill expand · hidden_size": ("mamba2", lambda c: c.update(head_dim=8), "head_dim"),
    "groups that do not divide the heads": ("mamba2", lambda c: c.update(n_groups=3), "n_groups"),
    "a count that is a string": ("mamba2", lambda c: c.update(state_size="8"), "state_size"),
    "the norm before the gate": ("mamba2", lambda c: c.update(norm_before_gate=True), "norm_before_gate"),
    "a layer norm for the output": ("mamba2", lambda c: c.update(rms_norm=False), "rms_norm"),
    "a z-loss": ("bamba", lambda c: c.update(z_loss_coefficient=1e-4), "z_loss_coefficient"),
    "an attention bias": ("bamba", lambda c: c.update(attention_bias=True), "attention_bias"),
    "an MLP bias": ("bamba", lambda c: c.update(mlp_bias=True), "mlp_bias"),
    "rope on every channel": ("bamba", lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0),
                              "partial_rotary_factor"),
    "a rotary width other than half a head": ("bamba", lambda c: c.update(attn_rotary_emb=8), "attn_rotary_emb"),
    "an attention layer past the last": ("bamba", lambda c: c.update(attn_layer_indices=[9]), "attn_layer_indices"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_a_config_lazoo_cannot_express_is_refused_by_field_and_dst_is_untouched(case, tmp_path, capfd):
    kind, edit, field = REFUSED_CONFIGS[case]
    require(kind)
    save_tiny(tmp_path / "src", kind)
    edit_config(tmp_path / "src", edit)
    error = refusal_into_a_folder(tmp_path / "src", tmp_path / "dst", capfd)
    assert field in error and "config.json" in error, error


REFUSED_WEIGHTS = {
    "a missing A_log": (lambda t: t.pop("backbone.layers.1.mixer.A_log"), "A_log"),
    "a tensor no Mamba-2 model writes": (lambda t: t.update({"backbone.layers.0.extra.weight": torch.zeros(2)}),
                                         "extra.weight"),
    "an in_proj of the wrong width": (
        lambda t: t.update({"backbone.layers.0.mixer.in_proj.weight":
                            t["backbone.layers.0.mixer.in_proj.weight"][:-4]}), "in_proj"),
    "a NaN weight": (lambda t: t["backbone.layers.2.mixer.dt_bias"].fill_(float("nan")), "dt_bias"),
    "a layer more than the config says": (
        lambda t: t.update({"backbone.layers.7.norm.weight": torch.zeros(32)}), "layers"),
}


@pytest.mark.parametrize("case", list(REFUSED_WEIGHTS))
def test_weights_that_do_not_fit_are_refused_by_name_and_dst_is_untouched(case, tmp_path, capfd):
    require("mamba2")
    edit, name = REFUSED_WEIGHTS[case]
    save_tiny(tmp_path / "src", "mamba2")
    edit_weights(tmp_path / "src", edit)
    status, err, _ = run_convert(tmp_path / "src", tmp_path / "dst", capfd)
    check_outcome(status, err, tmp_path / "dst", None)
    assert status == 2 and name in err[0], err


def test_an_unknown_model_type_names_the_mamba_types_too(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "jamba"}))
    with pytest.raises(UnsupportedCheckpointError, match="mamba2, bamba"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("model_type,field", [("falcon_h1", "mamba_d_ssm"), ("zamba2", "hybrid_layer_ids")])
def test_hybrids_lazoo_cannot_express_are_refused_saying_why(model_type, field, tmp_path, capfd):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": model_type}))
    status, err, _ = run_convert(tmp_path / "src", tmp_path / "dst", capfd)
    check_outcome(status, err, tmp_path / "dst", None)
    assert status == 2 and f"'{field}'" in err[0] and ("a lazoo layer" in err[0] or "lazoo's layers" in err[0]), err


def test_every_converted_kind_has_a_case():
    assert {kind for kind, _ in CASES.values()} == set(CONVERTED)
