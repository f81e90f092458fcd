"""Every JSON in configs/ loads through AutoConfig.for_model and builds its model: a causal LM (one 1x8 forward)
or a YOLO-LAT detector and backbone (one 1x3x64x64 forward). The hybrid files are written from
`lazoo.presets` and must not be stale, and they build the same models as the files of lazoo 0.1.0."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoBackbone, AutoConfig, AutoModelForCausalLM, AutoModelForObjectDetection

import lazoo  # noqa: F401  (registers the lazoo model types)
from lazoo.presets import (
    HYBRIDS,
    PRESET_CONFIG_FILES,
    SMALL_SIZES,
    WRITE_CONFIGS_COMMAND,
    stale_preset_configs,
    write_preset_configs,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.json"))
VISION_TYPE = "lazoo_yolo_lat"
LM_FILES = [p for p in CONFIG_FILES if json.loads(p.read_text())["model_type"] != VISION_TYPE]
VISION_FILES = [p for p in CONFIG_FILES if p not in LM_FILES]
EXPECTED = {
    "lazoo_softmax", "lazoo_sliding_window", "lazoo_linear", "lazoo_gated_linear", "lazoo_delta_net",
    "lazoo_gated_delta_net", "lazoo_vla", "lazoo_ela", "lazoo_gla", "lazoo_delta_product", "lazoo_hybrid",
    VISION_TYPE,
}

SW_ROPE = {"sliding_window": {"qk_norm": True, "use_rope": True}}
#: the hybrid files of lazoo 0.1.0, where the seed-002 hybrids took their global mixer's model type (sizes:
#: SMALL_SIZES; the pattern repeats twice)
HYBRIDS_0_1_0 = {
    "sw-vla-hybrid-small.json": (["sliding_window", "vla"], {"model_type": "lazoo_hybrid", "sliding_window": 64}),
    "sw-ovq-small.json": (["sliding_window", "ovq"], {"model_type": "lazoo_ovq", "sliding_window": 128,
                                                      "chunk_size": 128, "max_dict_size": 2048,
                                                      "mixer_kwargs": SW_ROPE}),
    "sw-nope-small.json": (["sliding_window", "softmax"], {"model_type": "lazoo_softmax", "sliding_window": 128,
                                                           "use_rope": False, "qk_norm": True,
                                                           "mixer_kwargs": SW_ROPE}),
    "sw-vq-small.json": (["sliding_window", "vq"], {"model_type": "lazoo_vq", "sliding_window": 128, "chunk_size": 64,
                                                    "codebook_size": 1024, "mixer_kwargs": SW_ROPE}),
    "gdn-ovq-small.json": (["gated_delta_net", "ovq"], {"model_type": "lazoo_ovq", "chunk_size": 128,
                                                        "max_dict_size": 2048}),
}


def load(path: Path):
    fields = json.loads(path.read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_every_model_type_has_a_config():
    types = {json.loads(p.read_text())["model_type"] for p in CONFIG_FILES}
    assert EXPECTED <= types, f"missing configs for {sorted(EXPECTED - types)}"


@pytest.mark.parametrize("path", LM_FILES, ids=[p.stem for p in LM_FILES])
def test_config_loads_and_builds(path):
    fields = json.loads(path.read_text())
    cfg = load(path)
    assert cfg.model_type == fields["model_type"]
    for key, value in fields.items():
        if key != "model_type":
            assert getattr(cfg, key) == value, key
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    if path.name in PRESET_CONFIG_FILES:
        assert cfg.model_type == "lazoo_hybrid"
        pattern = HYBRIDS[PRESET_CONFIG_FILES[path.name]]
        assert cfg.layer_types == pattern * (cfg.num_hidden_layers // len(pattern))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert isinstance(model, lazoo.LazooForCausalLM)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e6 < n_params < 1e7
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, cfg.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("path", VISION_FILES, ids=[p.stem for p in VISION_FILES])
def test_vision_config_loads_and_builds(path):
    fields = json.loads(path.read_text())
    cfg = load(path)
    assert cfg.model_type == VISION_TYPE
    assert json.loads(cfg.to_json_string()).items() >= fields.items()
    assert cfg.id2label == {0: "tree"} and cfg.num_labels == 1

    torch.manual_seed(0)
    detector = AutoModelForObjectDetection.from_config(cfg).eval()
    backbone = AutoBackbone.from_config(cfg).eval()
    assert isinstance(detector, lazoo.YoloLatForObjectDetection) and isinstance(backbone, lazoo.YoloLatBackbone)
    assert 5e5 < sum(p.numel() for p in detector.parameters()) < 1e7
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        detection, features = detector(pixels), backbone(pixels)
    assert detection.logits.shape == (1, 8 * 8 + 4 * 4 + 2 * 2, 1)  # anchors at strides 8, 16, 32
    assert detection.pred_boxes.shape == (1, 84, 4)
    assert [tuple(f.shape) for f in features.feature_maps] == [(1, cfg.widths[-1], 2, 2)]
    assert torch.isfinite(detection.logits).all() and torch.isfinite(detection.pred_boxes).all()


# ----------------------------------------------------------------------------- the preset files
def test_preset_configs_are_generated_from_the_presets():
    stale = stale_preset_configs(CONFIG_DIR)
    assert not stale, (f"configs/{', configs/'.join(stale)} differ from lazoo.presets: edit the presets "
                       f"(HYBRIDS, HYBRID_OPTIONS), not the files, and run `{WRITE_CONFIGS_COMMAND}`")


def test_writing_the_preset_configs_touches_no_other_file(tmp_path):
    mine = {"mine.json": '{"model_type": "lazoo_vla"}\n', "vla-small.json": "a user's own text\n"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "sw-ovq-small.json").write_text("{}\n")  # stale: rewritten

    written = write_preset_configs(tmp_path)
    assert sorted(p.name for p in written) == sorted(PRESET_CONFIG_FILES)
    assert stale_preset_configs(tmp_path) == []
    assert {name: (tmp_path / name).read_text() for name in mine} == mine
    assert write_preset_configs(tmp_path) == []  # nothing stale, nothing written


@pytest.mark.parametrize("name", sorted(HYBRIDS_0_1_0))
def test_hybrid_configs_build_the_models_of_0_1_0(name):
    """A preset file (`lazoo_hybrid`) gives the model its 0.1.0 file gave: the same fields, the same options
    for every layer, the same weights and logits."""
    pattern, fields = HYBRIDS_0_1_0[name]
    old_fields = {**SMALL_SIZES, "layer_types": pattern * 2, **fields}
    old = AutoConfig.for_model(old_fields.pop("model_type"), **old_fields)
    new = load(CONFIG_DIR / name)

    assert new.model_type == "lazoo_hybrid"
    old_dict, new_dict = old.to_dict(), new.to_dict()
    typed = set(old_dict) - set(new_dict)  # the old model type's own fields, now in mixer_kwargs
    assert typed <= set(old.mixer_options(old.mechanism)) if old.mechanism else not typed
    assert set(new_dict) <= set(old_dict)
    for key in set(new_dict) - typed - {"model_type", "mixer_kwargs"}:
        assert new_dict[key] == old_dict[key], key
    for mechanism in set(pattern):
        assert new.mixer_options(mechanism) == old.mixer_options(mechanism), mechanism

    models = []
    for config in (old, new):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    old_weights, new_weights = (m.state_dict() for m in models)
    assert old_weights.keys() == new_weights.keys()
    assert all(torch.equal(old_weights[k], new_weights[k]) for k in old_weights)
    ids = torch.randint(0, SMALL_SIZES["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(models[0](ids).logits, models[1](ids).logits)
