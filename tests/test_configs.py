"""Every JSON in configs/ loads through AutoConfig.for_model and builds a causal LM (one 1x8 forward)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo  # noqa: F401  (registers the lazoo model types)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.json"))
EXPECTED = {
    "lazoo_softmax", "lazoo_sliding_window", "lazoo_linear", "lazoo_gated_linear", "lazoo_delta_net",
    "lazoo_gated_delta_net", "lazoo_vla", "lazoo_ela", "lazoo_gla", "lazoo_delta_product", "lazoo_hybrid",
}


def load(path: Path):
    fields = json.loads(path.read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_every_model_type_has_a_config():
    types = {json.loads(p.read_text())["model_type"] for p in CONFIG_FILES}
    assert EXPECTED <= types, f"missing configs for {sorted(EXPECTED - types)}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.stem for p in CONFIG_FILES])
def test_config_loads_and_builds(path):
    fields = json.loads(path.read_text())
    cfg = load(path)
    assert cfg.model_type == fields["model_type"]
    for key, value in fields.items():
        if key != "model_type":
            assert getattr(cfg, key) == value, key
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    if cfg.model_type == "lazoo_hybrid":
        assert cfg.layer_types == ["sliding_window", "vla"] * (cfg.num_hidden_layers // 2)

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
