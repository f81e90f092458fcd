"""Mixed precision: every mechanism and hybrid preset trains under bf16 autocast (the ops switch
autocast off and pick their own compute dtypes; q/k normalisation keeps the projections' dtype)."""

import pytest
import torch
from conftest import ALL_MODELS, tiny_model

from lazoo.layers.mixers.base import unit_norm
from lazoo.presets import HYBRIDS, build_config


def _step(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bf16_autocast_training_step(name):
    _step(tiny_model(name, eval=False))


@pytest.mark.parametrize("preset", sorted(HYBRIDS))
def test_bf16_autocast_hybrid_presets(preset):
    from transformers import AutoModelForCausalLM

    config = build_config(preset, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
                          intermediate_size=64)
    _step(AutoModelForCausalLM.from_config(config))


def test_unit_norm_keeps_the_dtype():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    y = unit_norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), torch.ones(3), rtol=1e-2, atol=1e-2)
