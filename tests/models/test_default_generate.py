"""`generate` with no cache argument: the static cache on CUDA (compiled there), the dynamic cache elsewhere, the
opt-out `cache_implementation="dynamic"`, and static caches sized in buckets so that prompts of other lengths reuse
one cache (and so one compiled decode step). The CUDA default is tested here by making the CPU take it."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MODELS, left_padded, tiny_model

from lazoo.models import modeling_lazoo
from lazoo.models.cache import LazooCache
from lazoo.models.modeling_lazoo import cache_length_bucket, default_cache_implementation

pytestmark = pytest.mark.usefixtures("single_thread")


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, return_dict_in_generate=True,
                              **kwargs)


@pytest.fixture
def cuda_default(monkeypatch):
    """The CPU takes the default generate takes on CUDA."""
    monkeypatch.setattr(modeling_lazoo, "default_cache_implementation", lambda device: "static")


def test_the_default_is_static_on_cuda_only():
    assert default_cache_implementation(torch.device("cuda", 0)) == "static"
    assert default_cache_implementation(torch.device("cpu")) == "dynamic"


def test_the_default_on_the_cpu_is_the_dynamic_cache():
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    out = generate(model, ids, mask, max_new_tokens=3)
    assert isinstance(out.past_key_values, LazooCache) and not out.past_key_values.static


@pytest.mark.parametrize("name", ALL_MODELS)
def test_default_generate_equals_the_static_and_the_dynamic_cache(name, cuda_default):
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    default = generate(model, ids, mask, max_new_tokens=8)
    assert default.past_key_values.static, name
    static = generate(model, ids, mask, max_new_tokens=8, cache_implementation="static")
    dynamic = generate(model, ids, mask, max_new_tokens=8, cache_implementation="dynamic")
    assert not dynamic.past_key_values.static
    assert torch.equal(default.sequences, static.sequences), name
    assert torch.equal(default.sequences, dynamic.sequences), name


def test_the_opt_out_in_the_generation_config(cuda_default):
    model = tiny_model("hybrid", seed=1)
    ids, mask = left_padded()
    model.generation_config.cache_implementation = "dynamic"
    assert not generate(model, ids, mask, max_new_tokens=2).past_key_values.static
    model.generation_config.cache_implementation = None
    assert generate(model, ids, mask, max_new_tokens=2).past_key_values.static


def test_buckets_round_up_by_at_most_a_quarter():
    for length in [1, 255, 256, 257, 1000, 2047, 2048, 2049, 16448, 65600, 10**6 + 1]:
        bucket = cache_length_bucket(length)
        assert bucket >= length and bucket % 256 == 0
        assert bucket - length < (256 if length < 2048 else length / 4), length
    assert cache_length_bucket(16384 + 64) == cache_length_bucket(17000)


@pytest.mark.parametrize("name, full_length", [("gated_delta_net", False), ("sliding_window", False),
                                               ("softmax", True), ("hybrid", False)])
def test_prompts_of_other_lengths_reuse_the_static_cache(name, full_length, cuda_default):
    model = tiny_model(name, seed=1)
    assert model._keeps_every_position() == full_length
    first = generate(model, *left_padded(length=9), max_new_tokens=4).past_key_values
    second = generate(model, *left_padded(length=14, seed=5), max_new_tokens=6).past_key_values
    assert second is first  # the same buffers, so the same captured decode step
    assert first.max_cache_len == (256 if full_length else None)
    longer = generate(model, *left_padded(length=300, seed=6), max_new_tokens=2).past_key_values
    assert (longer is first) != full_length  # a full-length KV cache needs the next bucket


@pytest.mark.parametrize("name", ALL_MODELS)
def test_models_that_keep_every_position_say_so(name):
    """A static cache without a length works exactly for the models whose layers keep no full-length KV cache."""
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    cache = LazooCache(model.config.num_hidden_layers, static=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        needs_length = False
    except ValueError as error:
        assert "max_cache_len" in str(error)
        needs_length = True
    assert model._keeps_every_position() == needs_length, name


def test_decode_steps_of_generate_skip_the_value_checks():
    """generate marks its decode steps (ids it sampled, a mask column of ones): the model then reads no input value
    back from the device; the prompt's forward is checked as every other call."""
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    steps = []
    forward = model.forward

    def recording(*args, **kwargs):
        steps.append(kwargs.get("_generated_step", False))
        return forward(*args, **kwargs)

    model.forward = recording
    try:
        expected = generate(model, ids, mask, max_new_tokens=4, cache_implementation="dynamic").sequences
    finally:
        model.forward = forward
    assert steps == [False, True, True, True]
    assert torch.equal(expected, generate(model, ids, mask, max_new_tokens=4, cache_implementation="dynamic").sequences)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        bad = torch.full((3, 1), model.config.vocab_size + 5)
        with pytest.raises(ValueError, match="token ids in"):
            model(input_ids=bad, cache=cache, use_cache=True)
        with pytest.raises(IndexError):  # not checked: the embedding's own error
            model(input_ids=bad, cache=cache, use_cache=True, _generated_step=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_generated_decode_step_does_not_wait_for_the_device():
    model = tiny_model("gated_delta_net", seed=1).cuda()
    ids, mask = (t.cuda() for t in left_padded())
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        token = ids[:, -1:]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(input_ids=token, attention_mask=torch.ones_like(mask[:, :1]), cache=cache, use_cache=True,
                  position_ids=mask.sum(1, keepdim=True), _generated_step=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
