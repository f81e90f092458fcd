"""Folders saved by lazoo 0.1.0 (tests/fixtures/release_0_1_0, see its README) load with the current code and
give the logits they gave then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import lazoo  # noqa: F401  (registers the model types)

RELEASE = Path(__file__).resolve().parents[1] / "fixtures" / "release_0_1_0"
EXPECTED = torch.load(RELEASE / "expected_logits.pt")
FOLDERS = sorted(EXPECTED["logits"])


@pytest.mark.parametrize("name", FOLDERS)
def test_folder_of_0_1_0_gives_the_same_logits(name, single_thread):
    auto = AutoModelForSequenceClassification if "seqcls" in name else AutoModelForCausalLM
    model = auto.from_pretrained(RELEASE / name).eval()
    with torch.no_grad():
        logits = model(EXPECTED["input_ids"]).logits.double()
    torch.testing.assert_close(logits, EXPECTED["logits"][name], rtol=0, atol=1e-6)


#: mechanisms that lazoo 0.1.0 did not have: no folder of that release can hold them
ADDED_AFTER_0_1_0 = {"mamba2", "kda", "mla"}


def test_every_model_type_has_a_saved_folder():
    missing = set(lazoo.list_mechanisms()) - set(FOLDERS)
    assert missing == ADDED_AFTER_0_1_0, f"no 0.1.0 folder for {sorted(missing - ADDED_AFTER_0_1_0)}"


def test_a_resaved_old_folder_keeps_the_defaults_it_was_saved_with(tmp_path, single_thread):
    # VLA's defaults changed in config format 2 (qk_prenorm, output_norm) and 3 (penalty_norm): an old folder keeps
    # Algorithm 1, and saving it again writes the old values out, so it still does after the next load
    import json

    from lazoo.models.configuration_lazoo import CONFIG_FORMAT

    for name, options in (("vla", None), ("hybrid", "vla")):
        model = AutoModelForCausalLM.from_pretrained(RELEASE / name).eval()
        model.save_pretrained(tmp_path / name)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        fields = saved if options is None else saved["mixer_kwargs"][options]
        assert (fields["qk_prenorm"], fields["output_norm"], fields["penalty_norm"], saved["lazoo_format"]) == (
            False, False, "algorithm1", CONFIG_FORMAT)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(EXPECTED["input_ids"]).logits.double(), EXPECTED["logits"][name],
                                       rtol=0, atol=1e-6)


def test_new_configs_take_the_current_defaults(tmp_path):
    from transformers import AutoConfig

    from lazoo.models.configuration_lazoo import CONFIG_FORMAT

    fresh = AutoConfig.for_model("lazoo_vla", hidden_size=16, num_attention_heads=2)
    assert (fresh.qk_prenorm, fresh.output_norm, fresh.lazoo_format) == (True, True, CONFIG_FORMAT)
    fresh.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert (loaded.qk_prenorm, loaded.output_norm) == (True, True)
    hybrid = AutoConfig.for_model("lazoo_hybrid", hidden_size=16, num_attention_heads=2, num_hidden_layers=2,
                                  layer_types=["sliding_window", "vla"])
    assert hybrid.mixer_options("vla")["qk_prenorm"] is True and hybrid.mixer_kwargs == {}
    assert fresh.penalty_norm == loaded.penalty_norm == hybrid.mixer_options("vla")["penalty_norm"] == "unit"


def test_a_format_2_config_keeps_algorithm1_penalty_directions(tmp_path):
    import json

    from transformers import AutoConfig

    AutoConfig.for_model("lazoo_vla", hidden_size=16, num_attention_heads=2).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("penalty_norm")
    saved["lazoo_format"] = 2
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert (loaded.penalty_norm, loaded.qk_prenorm) == ("algorithm1", True)


# ----------------------------------------------------------------------------- folders whose config was edited
def _vla_relabelled(model_type, drop_architectures=False):
    def edit(config):
        config["model_type"] = model_type
        if drop_architectures:
            config.pop("architectures")
    return edit


def _set_layer_types(*names):
    def edit(config):
        config["layer_types"] = list(names)
    return edit


def _set(key, value):
    def edit(config):
        config[key] = value
    return edit


#: (saved model, an edit of its config.json, what the refusal names); each once loaded with other logits
EDITED_FOLDERS = {
    "hybrid without lazoo_format": ("hybrid", lambda c: c.pop("lazoo_format"), "weights do not match config.json"),
    "vla relabelled gated_delta_net": ("vla", _vla_relabelled("lazoo_gated_delta_net"), "was saved by LazooVLA"),
    "vla relabelled hybrid": ("vla", _vla_relabelled("lazoo_hybrid"), "was saved by LazooVLA"),
    "vla relabelled, architectures removed": ("vla", _vla_relabelled("lazoo_gated_delta_net", True),
                                              "is an option of the 'vla' layers"),
    "gated_delta_net relabelled linear": ("gated_delta_net", _vla_relabelled("lazoo_linear"),
                                          "was saved by LazooGatedDeltaNet"),
    "hybrid layer_types edited": ("hybrid", _set_layer_types("sliding_window", "gated_delta_net"),
                                  "weights do not match config.json"),
    "vla output norm switched off": ("vla", _set("output_norm", False), "weights do not match config.json"),
}


def _save_and_edit(name, edit, folder):
    import json

    from conftest import tiny_model

    model = tiny_model(name)
    model.save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("case", list(EDITED_FOLDERS))
def test_a_config_that_no_longer_matches_its_weights_is_refused(case, tmp_path, single_thread):
    name, edit, message = EDITED_FOLDERS[case]
    _save_and_edit(name, edit, tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_allow_layer_mismatch_loads_anyway_and_loading_info_still_comes_back(tmp_path, single_thread):
    _save_and_edit("hybrid", lambda c: c.pop("lazoo_format"), tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, allow_layer_mismatch=True, output_loading_info=True)
    assert info["unexpected_keys"] == {"model.layers.1.mixer.o_norm.weight"}


def test_an_unedited_folder_loads_into_every_head(tmp_path, single_thread):
    saved = _save_and_edit("vla", lambda c: None, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, saved(ids).logits)
    AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)  # a new score head is expected
