"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next folders saved by transformers' own classes, converted with `lazoo convert`:
the same logits as transformers' model (float64 with its float32 casts lifted, and float32 as it runs), the same
greedy tokens with the cache, a cache continued across two `generate` calls, and refusals that leave DST as it was.
On a transformers release without these classes the tests skip, saying so."""

from __future__ import annotations

import json

import pytest
import torch
from convert_helpers import check_outcome, edit_config, edit_weights, generate_in_two_calls, run_convert
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from qwen_helpers import (
    KINDS,
    MOE_KINDS,
    VOCAB,
    float64_faithful,
    prompt_and_mask,
    reference_forms,
    relative_error,
    require,
    save_tiny,
)
from transformers import AutoModelForCausalLM

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.convert import UnsupportedCheckpointError, convert_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=list(KINDS))
def converted(request, tmp_path_factory):
    """(kind, transformers' model, the converted lazoo model, what was left out) for each kind."""
    kind = request.param
    require(kind)
    root = tmp_path_factory.mktemp(kind)
    reference = save_tiny(root / "src", kind, tie=kind == "qwen3_5")
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    return kind, reference, ours, left_out, dst


def _logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def test_logits_equal_transformers_in_float64(converted):
    """Every real position of left-padded prompts, transformers' model in float64 with its float32 casts lifted.
    The MoE routers of transformers compute their probabilities in float32 whatever the model's dtype: there the
    float32 comparison below is the one that holds."""
    kind, reference, ours, _, _ = converted
    if kind in MOE_KINDS:
        pytest.skip("transformers' MoE router computes in float32 (checked in float32 below)")
    ids, mask = prompt_and_mask()
    reference, ours = reference.double(), ours.double()
    reference.config._attn_implementation = "sdpa"  # (the eager form takes its softmax in float32)
    with float64_faithful(kind, reference):
        expected = _logits(reference, ids, mask, use_cache=False)
    got = _logits(ours, ids, mask)
    real = mask.bool()
    assert relative_error(got[real], expected[real]) < 1e-8


def test_logits_equal_transformers_in_float32(converted):
    """transformers' model as it runs (its reference PyTorch forms, float32 casts included), float32."""
    kind, reference, ours, _, _ = converted
    ids, mask = prompt_and_mask()
    reference, ours = reference.float(), ours.float()
    with reference_forms(kind):
        expected = _logits(reference, ids, mask, use_cache=False)
    got = _logits(ours, ids, mask)
    real = mask.bool()
    assert relative_error(got[real], expected[real]) < 1e-5


def test_greedy_tokens_equal_transformers_for_32_steps_with_the_cache(converted):
    kind, reference, ours, _, _ = converted
    ids, mask = prompt_and_mask()
    reference, ours = reference.float(), ours.float()
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), reference_forms(kind):
        expected = reference.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert expected.shape[1] == ids.shape[1] + 32
    assert torch.equal(got, expected)


def test_a_cache_continues_across_two_generate_calls(converted):
    """8 tokens, then 8 more from the returned cache, are the 16 of one call."""
    _, _, ours, _, _ = converted
    ids, mask = prompt_and_mask()
    whole, second, _ = generate_in_two_calls(ours.float(), ids, mask,
                                             dict(do_sample=False, pad_token_id=0, eos_token_id=None))
    assert torch.equal(second, whole)


def test_the_card_and_the_config_say_what_was_converted_and_left_out(converted):
    kind, _, ours, left_out, dst = converted
    source = ours.config.converted_from
    assert source["format"] == "transformers" and source["model_type"] == kind
    assert ours.config.zero_centered_norm is True
    assert ours.config.layer_types == ["gated_delta_net", "softmax", "gated_delta_net", "gated_delta_net"]
    card = (dst / "README.md").read_text()
    assert f"model type `{kind}`" in card
    if KINDS[kind][2]:  # a vision-language folder: its vision tower is left out, and said so
        assert left_out and "vision tower" in left_out[0] and "vision tower" in card
    else:
        assert left_out == []


def test_the_command_line_says_the_vision_tower_was_left_out(tmp_path, capfd):
    from lazoo_cli import main

    require("qwen3_5")
    save_tiny(tmp_path / "src", "qwen3_5")
    capfd.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    out = capfd.readouterr().out
    assert "left out: the vision tower" in out


# ----------------------------------------------------------------------------- refusals
REFUSED_WEIGHTS = {
    "a missing GDN projection": (lambda t: t.pop("model.language_model.layers.0.linear_attn.in_proj_z.weight"),
                                 "in_proj_z"),
    "a tensor no Qwen model writes": (lambda t: t.update({"model.language_model.layers.0.extra.weight":
                                                          torch.zeros(2)}), "extra.weight"),
    "a q_proj without its gate half": (
        lambda t: t.update({"model.language_model.layers.1.self_attn.q_proj.weight":
                            t["model.language_model.layers.1.self_attn.q_proj.weight"][:64]}), "q_proj"),
    "a NaN weight": (lambda t: t["model.language_model.layers.2.linear_attn.A_log"].fill_(float("nan")), "A_log"),
    "a layer more than the config says": (
        lambda t: t.update({"model.language_model.layers.9.input_layernorm.weight": torch.zeros(32)}), "layers"),
}


@pytest.mark.parametrize("case", list(REFUSED_WEIGHTS))
def test_weights_that_do_not_fit_are_refused_by_name_and_dst_is_untouched(case, tmp_path, capfd):
    require("qwen3_5")
    edit, name = REFUSED_WEIGHTS[case]
    save_tiny(tmp_path / "src", "qwen3_5")
    edit_weights(tmp_path / "src", edit)
    status, err, _ = run_convert(tmp_path / "src", tmp_path / "dst", capfd)
    check_outcome(status, err, tmp_path / "dst", None)
    assert status == 2 and name in err[0], err


def test_an_unknown_model_type_names_every_format_lazoo_converts(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedCheckpointError, match="qwen3_5.*qwen3_next|gated_deltanet.*qwen3_5"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_the_converted_vocabulary_is_the_checkpoint_s(converted):
    _, _, ours, _, _ = converted
    assert ours.config.vocab_size == VOCAB


# ----------------------------------------------------------------------------- the worked path of docs/qwen.md
def test_the_worked_path_convert_lora_eval_push_and_load_without_lazoo(tmp_path, tokenizer, lm_blocks, capfd,
                                                                       monkeypatch):
    """A Qwen3.5 vision-language folder with its tokenizer: `lazoo convert` → LoRA with Trainer → `lazoo eval`
    (lm-eval) → `push_to_hub` (the Hub calls stubbed) → loaded where lazoo cannot be imported, generating the
    tokens lazoo generates."""
    from export_helpers import PROMPT, run_loader, stub_push_to_hub
    from lora_helpers import lora_fine_tune

    from lazoo.eval import main as eval_main
    from lazoo_cli import main

    require("qwen3_5")
    save_tiny(tmp_path / "qwen", "qwen3_5", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "qwen")
    capfd.readouterr()
    assert main(["convert", str(tmp_path / "qwen"), str(tmp_path / "converted")]) == 0
    assert "left out: the vision tower" in capfd.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    peft_model, losses = lora_fine_tune(model, lm_blocks, tmp_path / "run")
    assert losses[-1] < losses[0], losses
    tuned = tmp_path / "tuned"
    merged = peft_model.merge_and_unload().eval()
    merged.save_pretrained(tuned)
    tokenizer.save_pretrained(tuned)
    card = (tuned / "README.md").read_text()
    assert "lazoo convert" in card and "vision tower" in card  # the card still names the source
    out = tmp_path / "eval.json"
    assert eval_main([str(tuned), "--limit", "2", "--batch-size", "2", "--device", "cpu", "--output", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"][str(tuned)]
    assert metrics["lazoo_kjv_ppl"]["word_perplexity"] > 1
    uploaded = stub_push_to_hub(monkeypatch)
    merged.push_to_hub("someone/qwen3.5-tuned")
    assert {"config.json", "model.safetensors", "modeling_lazoo.py"} <= set(uploaded["files"])
    assert "`qwen`" in uploaded["card"] and "Gated DeltaNet" in uploaded["card"]
    results = run_loader([str(tuned)], tmp_path)
    assert results.pop("lazoo_imported") == []
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = merged.generate(prompt, attention_mask=(prompt != 0).long(), max_new_tokens=8, do_sample=False)
    assert results[str(tuned)]["tokens"] == expected.tolist()


def test_the_static_cache_generates_the_dynamic_cache_s_tokens(converted):
    """`generate(cache_implementation="static")` (lazoo's static cache; compiled on CUDA) on the converted model."""
    _, _, ours, _, _ = converted
    ids, mask = prompt_and_mask()
    ours = ours.float()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        dynamic = ours.generate(ids, **kwargs)
        static = ours.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, dynamic)


def test_a_folder_as_published_converts_leaving_out_the_mtp_head(tmp_path):
    """The published Qwen3.5 folders carry fields transformers' classes do not write (attn_output_gate,
    mtp_num_hidden_layers, mamba_ssm_dtype, full_attention_interval, the sectioned rope's mrope_section) and the
    tensors of a multi-token-prediction head (`mtp.*`): the language model converts, and the head is said to be
    left out."""
    require("qwen3_5")
    reference = save_tiny(tmp_path / "src", "qwen3_5", tie=True)

    def published(text):
        text.update(attn_output_gate=True, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                    mamba_ssm_dtype="float32", full_attention_interval=4)
        text["rope_parameters"].update(mrope_interleaved=True, mrope_section=[1, 1, 0])

    edit_config(tmp_path / "src", published)
    edit_weights(tmp_path / "src", lambda t: t.update({"mtp.fc.weight": torch.zeros(32, 64),
                                                        "mtp.norm.weight": torch.zeros(32)}))
    dst, left_out = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert any("vision tower" in part for part in left_out) and any("mtp" in part for part in left_out)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    ids, mask = prompt_and_mask()
    with reference_forms("qwen3_5"):
        expected = _logits(reference.float(), ids, mask, use_cache=False)
    real = mask.bool()
    assert relative_error(_logits(ours, ids, mask)[real], expected[real]) < 1e-5
