"""The KDA mixer (Kimi Delta Attention, "Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team,
2025) against transformers' own `KimiLinearDeltaAttention` with the same weights: a prompt with left padding, then
decoding token by token from the cache (transformers computes KDA in float32: 1e-5). Its options' errors. The
model-level tests (cache = no cache, padding, packing, save/load, Trainer, PEFT, export) run it with every other
mechanism; `tests/convert/test_convert_kimi.py` converts whole Kimi Linear models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import lazoo  # noqa: F401  (registers the mechanisms)
from lazoo.layers.mixers.kda import KimiDeltaAttentionMixer
from lazoo.models.cache import LazooCache

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def pair(hidden=32, heads=2, head_dim=16, conv=4):
    """A transformers KDA layer with random weights and a lazoo mixer holding the same ones (float64)."""
    from transformers import KimiLinearConfig

    ref_config = KimiLinearConfig(hidden_size=hidden, num_hidden_layers=1, layer_types=["linear_attention"],
                                  linear_attn_config={"num_heads": heads, "head_dim": head_dim,
                                                      "short_conv_kernel_size": conv},
                                  num_attention_heads=heads, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    ref = kimi.KimiLinearDeltaAttention(ref_config, 0).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        ref.forget_gate.A_log.copy_(torch.rand(1, 1, heads, 1).mul(2).log())
    config = AutoConfig.for_model("lazoo_kda", hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1,
                                  intermediate_size=0, head_k_dim=head_dim, conv_size=conv)
    mixer = KimiDeltaAttentionMixer(config, 0, config.mixer_options("kda")).double()
    qkv = ref.conv1d.weight.chunk(3, 0)
    weights = {"q_proj.weight": ref.q_proj.weight, "k_proj.weight": ref.k_proj.weight,
               "v_proj.weight": ref.v_proj.weight, "o_proj.weight": ref.o_proj.weight,
               "short_conv.convs.q.weight": qkv[0], "short_conv.convs.k.weight": qkv[1],
               "short_conv.convs.v.weight": qkv[2], "b_proj.weight": ref.b_proj.weight,
               "f_proj.0.weight": ref.forget_gate.f_a_proj.weight, "f_proj.1.weight": ref.forget_gate.f_b_proj.weight,
               "A_log": ref.forget_gate.A_log.flatten(), "dt_bias": ref.forget_gate.dt_bias,
               "g_proj.0.weight": ref.g_a_proj.weight, "g_proj.1.weight": ref.g_b_proj.weight,
               "o_norm.weight": ref.o_norm.weight}
    mixer.load_state_dict(weights, strict=True)
    return ref, mixer, ref_config


def test_the_layer_equals_transformers_kimi_delta_attention_with_its_cache():
    from transformers import DynamicCache

    ref, mixer, ref_config = pair()
    T, extra = 21, 4
    h = torch.randn(2, T + extra, 32, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :5] = False
    ref_cache, cache = DynamicCache(config=ref_config), LazooCache(num_layers=1)
    with torch.no_grad():
        expected = ref(h[:, :T], cache=ref_cache, attention_mask=mask.long())
        got = mixer(h[:, :T], mask=mask, cache=cache)
        torch.testing.assert_close(got[mask], expected[mask], rtol=1e-5, atol=1e-6)
        for t in range(T, T + extra):  # decoding: transformers' recurrent path against lazoo's cached state
            expected = ref(h[:, t:t + 1], cache=ref_cache)
            got = mixer(h[:, t:t + 1], cache=cache)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_kda_options_are_checked():
    config = AutoConfig.for_model("lazoo_kda", hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    with pytest.raises(ValueError, match="output_gate and output_norm must stay True"):
        KimiDeltaAttentionMixer(config, 0, {**config.mixer_options("kda"), "output_gate": False})
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        KimiDeltaAttentionMixer(config, 0, {**config.mixer_options("kda"), "chunk_size": 0})
    mixer = KimiDeltaAttentionMixer(config, 0, {**config.mixer_options("kda"), "num_v_heads": 4,
                                                 "gate_low_rank_dim": 8, "gate_bias": True})
    assert mixer.f_proj[0].out_features == 8 and mixer.f_proj[1].out_features == 4 * 16
    assert mixer.g_proj[1].bias is not None and mixer.A_log.shape == (4,) and mixer.dt_bias.shape == (64,)
    out = mixer(torch.randn(2, 9, 32))
    assert out.shape == (2, 9, 32) and torch.isfinite(out).all()
