"""LazooCache in transformers' Cache API: one layer object per model layer, of transformers' kinds (a key/value layer
for attention mixers, a linear-attention state layer for recurrent ones), reading the states the mixers wrote;
beam reordering and cropping through transformers' per-layer code paths."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from torch.utils._pytree import tree_leaves
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from lazoo.models import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")


def _tensors(state):
    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def test_each_layer_is_a_transformers_layer_of_its_kind_reading_the_mixers_state():
    model = tiny_model("hybrid")  # sliding window, then VLA
    with torch.no_grad():
        cache = model(random_ids(2, 9, seed=1), use_cache=True).past_key_values
    assert isinstance(cache, Cache) and len(cache.layers) == len(cache) == 2
    attention, recurrent = cache.layers
    assert isinstance(attention, CacheLayerMixin) and not isinstance(attention, LinearAttentionCacheLayerMixin)
    assert isinstance(recurrent, LinearAttentionCacheLayerMixin) and not isinstance(recurrent, CacheLayerMixin)
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    kept = model.config.sliding_window - 1
    assert attention.is_sliding and attention.keys.shape == attention.values.shape == (2, heads, kept, head_dim)
    assert torch.equal(attention.keys, cache.states[0]["k"].transpose(1, 2))
    assert torch.equal(attention.values, cache.states[0]["v"].transpose(1, 2))
    # the recurrent layer numbers the very tensors of the VLA state (S, A, z, the step counter)
    assert list(recurrent.recurrent_states.values()) == _tensors(cache.states[1]["op"]) != []
    assert all(a is b for a, b in zip(recurrent.recurrent_states.values(), _tensors(cache.states[1]["op"])))
    assert cache.get_seq_length() == attention.get_seq_length() == recurrent.get_seq_length() == 9
    assert recurrent.has_previous_state[0] and not cache.is_croppable


def test_reorder_cache_selects_rows_of_every_layer_and_of_the_token_counts():
    model = tiny_model("hybrid")
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        cache = model(random_ids(3, 7, seed=2), attention_mask=mask, use_cache=True).past_key_values
    before = [t.clone() for t in _tensors(cache.states)]
    order = torch.tensor([2, 0, 0])
    cache.reorder_cache(order)
    assert all(torch.equal(a, b[order]) for a, b in zip(_tensors(cache.states), before))
    assert cache.real_tokens.tolist() == [7, 4, 4]


def test_crop_takes_positions_back_where_every_layer_keeps_them():
    """Full softmax attention keeps every position: cropping 3 and feeding them again gives the logits of one pass."""
    model = tiny_model("softmax")
    ids = random_ids(2, 10, seed=3)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = LazooCache(model.config.num_hidden_layers)
        model(ids[:, :8], attention_mask=mask[:, :8], cache=cache, use_cache=True)
        assert cache.is_croppable
        cache.crop(-3)
        assert cache.seen_positions == 5 and cache.real_tokens.tolist() == [5, 3]
        assert all(layer.keys.shape[2] == 5 for layer in cache.layers)
        again = model(ids[:, 5:], attention_mask=mask, cache=cache, use_cache=True).logits
    torch.testing.assert_close(again, full[:, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["vla", "sliding_window"])
def test_a_cache_that_dropped_what_it_saw_refuses_to_crop(name):
    model = tiny_model(name)
    with torch.no_grad():
        cache = model(random_ids(2, 9, seed=4), use_cache=True).past_key_values
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
