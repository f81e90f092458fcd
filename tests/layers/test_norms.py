"""The decoder's zero-centred RMSNorm (`zero_centered_norm`): (1 + w)·x̂ in float64, float32 for half types, w
starting at zero, and the config field checked."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lazoo import LazooConfig
from lazoo.layers.norms import ZeroCenteredRMSNorm


def test_zero_centered_rms_norm_is_one_plus_w_times_the_normalised_input():
    torch.manual_seed(0)
    norm = ZeroCenteredRMSNorm(8, eps=1e-6).double()
    assert torch.equal(norm.weight, torch.zeros(8, dtype=torch.float64))
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    expected = (1 + norm.weight) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected, rtol=1e-14, atol=1e-14)
    half = norm.to(torch.bfloat16)
    out = half(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_a_model_with_zero_centered_norms_uses_them_everywhere_and_round_trips(tmp_path):
    config = LazooConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         layer_types=["softmax", "gated_delta_net"], zero_centered_norm=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    norms = [m for m in model.modules() if isinstance(m, ZeroCenteredRMSNorm)]
    assert len(norms) == 5 and all(torch.equal(n.weight, torch.zeros_like(n.weight)) for n in norms)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.zero_centered_norm is True
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_zero_centered_norm_must_be_a_bool():
    with pytest.raises(ValueError, match="zero_centered_norm must be True or False"):
        LazooConfig(zero_centered_norm="yes")
