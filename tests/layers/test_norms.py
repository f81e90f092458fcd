"""The decoder's zero-centred RMSNorm (`zero_centered_norm`): (1 + w)·x̂ in float64, float32 for half types, w
starting at zero, and the config field checked. `norm_keeping_only_input`: an RMSNorm whose weight's dtype differs
from its input's (bf16 activations, fp32 weights, as under autocast) recomputed in the backward: the same values and
gradients, bit for bit, and only the input kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lazoo import LazooConfig
from lazoo.layers.norms import ZeroCenteredRMSNorm, norm_keeping_only_input


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


def _saved(fn, *args):
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sorted(kept.values(), key=str)


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=gen) + 0.5)
    x = (torch.randn(3, 17, 4, 32, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    return norm, x


def test_same_values_and_gradients_as_the_norm():
    norm, x = _case()
    grad = torch.randn(3, 17, 4, 32).to(torch.bfloat16)
    ours = norm_keeping_only_input(norm, x)
    d_ours = torch.autograd.grad(ours, (x, norm.weight), grad)
    ref = norm(x)
    d_ref = torch.autograd.grad(ref, (x, norm.weight), grad)
    assert ours.dtype == ref.dtype == torch.bfloat16 and torch.equal(ours, ref)
    for a, b, name in zip(d_ours, d_ref, ("x", "weight")):
        assert torch.equal(a, b), f"d{name}: {(a.float() - b.float()).abs().max().item():.3e} from the norm's own"


def test_keeps_only_the_input():
    norm, x = _case(1)
    _, ref_kept = _saved(norm, x)
    _, ours_kept = _saved(lambda t: norm_keeping_only_input(norm, t), x)
    assert sum(n for _, n in ours_kept) == x.numel() * x.element_size()  # x itself, nothing in float32
    assert sum(n for dtype, n in ref_kept if dtype == torch.float32) >= 2 * x.numel() * 4  # the norm: float32 copies


def test_plain_call_where_nothing_is_gained():
    norm, x = _case(2)
    same = x.detach().float().requires_grad_()  # the weight's dtype: torch's fused form keeps little already
    out = norm_keeping_only_input(norm, same)
    assert "Checkpoint" not in type(out.grad_fn).__name__
    with torch.no_grad():
        assert norm_keeping_only_input(norm, x).grad_fn is None
