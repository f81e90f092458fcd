"""The MLA mixer (multi-head latent attention, "DeepSeek-V2", DeepSeek-AI, 2024, as Kimi Linear uses it) against
transformers' own `KimiLinearAttention` with the same weights, in float64 (SDPA): the expanded form (no cache) and the
latent form (a prompt with left padding into the cache, then decoding token by token), to 1e-10; the cache keeps the
latent only. The model-level tests run it with every other mechanism; `tests/convert/test_convert_kimi.py` converts
whole Kimi Linear models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import lazoo  # noqa: F401  (registers the mechanisms)
from lazoo.layers.mixers.mla import MultiHeadLatentAttentionMixer
from lazoo.models.cache import LazooCache

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
HIDDEN, HEADS = 32, 4
DIMS = {"kv_lora_rank": 12, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5}


def pair(q_lora_rank=None):
    """transformers' KimiLinearAttention with random weights and a lazoo MLA mixer holding the same ones."""
    from transformers import KimiLinearConfig

    ref_config = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["full_attention"],
                                  num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
                                  **DIMS)
    ref_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = kimi.KimiLinearAttention(ref_config, 0).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1 if p.dim() == 1 else 0))
    config = AutoConfig.for_model("lazoo_mla", hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1,
                                  intermediate_size=0, q_lora_rank=q_lora_rank, **DIMS)
    mixer = MultiHeadLatentAttentionMixer(config, 0, config.mixer_options("mla")).double()
    mixer.load_state_dict(ref.state_dict(), strict=True)
    return ref, mixer, ref_config


def _rms_norm_float64(self, x):
    """KimiLinearRMSNorm in the input's dtype (transformers' form normalises in float32)."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("q_lora_rank", [None, 7])
def test_mla_equals_transformers_kimi_linear_attention(q_lora_rank, monkeypatch):
    from transformers import DynamicCache

    monkeypatch.setattr(kimi.KimiLinearRMSNorm, "forward", _rms_norm_float64)

    ref, mixer, ref_config = pair(q_lora_rank)
    T, extra = 13, 3
    h = torch.randn(2, T + extra, HIDDEN, dtype=torch.float64)
    mask = torch.ones(2, T + extra, dtype=torch.bool)
    mask[1, :4] = False

    def reference(x, cache, m, past):
        """transformers' layer with a boolean [B, 1, T, past + T] mask: causal, pads never attended."""
        allowed = (torch.arange(past + x.shape[1])[None, :] <= torch.arange(past, past + x.shape[1])[:, None])
        return ref(x, (allowed[None] & m[:, None, :])[:, None], cache=cache)[0]

    with torch.no_grad():
        whole = reference(h, None, mask, 0)
        torch.testing.assert_close(mixer(h, mask=mask)[mask], whole[mask], rtol=1e-10, atol=1e-12)
        cache, ref_cache = LazooCache(num_layers=1), DynamicCache(config=ref_config)
        got = mixer(h[:, :T], mask=mask[:, :T], cache=cache)
        torch.testing.assert_close(got[mask[:, :T]], whole[:, :T][mask[:, :T]], rtol=1e-10, atol=1e-12)
        state = cache.read_state(0)
        assert state["k"].shape == (2, T, 1, 12 + 4) and state["v"].shape == (2, T, 1, 12)  # the latent only
        reference(h[:, :T], ref_cache, mask[:, :T], 0)
        for t in range(T, T + extra):
            got = mixer(h[:, t:t + 1], mask=mask[:, t:t + 1], cache=cache)
            torch.testing.assert_close(got, reference(h[:, t:t + 1], ref_cache, mask[:, :t + 1], t),
                                       rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got, whole[:, t:t + 1], rtol=1e-10, atol=1e-12)


def test_mla_options_are_checked():
    config = AutoConfig.for_model("lazoo_mla", hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be an int >= 0"):
        MultiHeadLatentAttentionMixer(config, 0, {**config.mixer_options("mla"), **DIMS, "qk_rope_head_dim": 3,
                                                  "use_rope": True})
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
        MultiHeadLatentAttentionMixer(config, 0, {**config.mixer_options("mla"), **DIMS, "kv_lora_rank": 0})
    rope = MultiHeadLatentAttentionMixer(config, 0, {**config.mixer_options("mla"), **DIMS, "use_rope": True})
    h = torch.randn(1, 6, HIDDEN)
    positions = torch.arange(6)[None]
    with torch.no_grad():  # with RoPE the latent form (decoding from the cache) still equals the expanded one
        cache = LazooCache(num_layers=1)
        rope(h[:, :5], position_ids=positions[:, :5], cache=cache)
        torch.testing.assert_close(rope(h[:, 5:], position_ids=positions[:, 5:], cache=cache),
                                   rope(h, position_ids=positions)[:, 5:], rtol=1e-5, atol=1e-6)
