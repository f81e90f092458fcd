"""`generate` with no cache argument: the static cache on CUDA (compiled there), the dynamic cache elsewhere, the
opt-out `cache_implementation="dynamic"`, and static caches sized in buckets so that prompts of other lengths reuse
one cache (and so one compiled decode step). The CUDA default is tested here by making the CPU take it."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import ALL_MODELS, left_padded, tiny_model
from transformers import GenerationConfig

from lazoo.models import graph_decode, modeling_lazoo
from lazoo.models.cache import LazooCache
from lazoo.models.compat import CACHE_FIELD
from lazoo.models.modeling_lazoo import cache_length_bucket, default_cache_implementation

pytestmark = pytest.mark.usefixtures("single_thread")


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, return_dict_in_generate=True,
                              **kwargs)


@pytest.fixture
def cuda_default(monkeypatch):
    """The CPU takes the default generate takes on CUDA: the static cache, and rounds of decode steps (uncaptured
    here; 4 a round, so that the tests' few tokens span several)."""
    monkeypatch.setattr(modeling_lazoo, "default_cache_implementation", lambda device: "static")
    monkeypatch.setattr(graph_decode, "default_steps", lambda device: 4)


@pytest.fixture
def rounds(monkeypatch):
    """The caches of the `generate` calls that took lazoo's rounds (graph_decode.decode)."""
    caches, decode = [], graph_decode.decode

    def recording(model, *args):
        caches.append(args[6][CACHE_FIELD])  # model_kwargs
        return decode(model, *args)

    monkeypatch.setattr(graph_decode, "decode", recording)
    return caches


def test_the_default_is_static_with_graph_rounds_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_cache_implementation(cuda) == "static"
    assert default_cache_implementation(cpu) == "dynamic"
    config = GenerationConfig()
    assert graph_decode.requested_steps(config, cuda) == graph_decode.DEFAULT_STEPS_ON_CUDA == 16
    assert graph_decode.requested_steps(config, cpu) == 0 and not graph_decode.asked_for(config)
    config.decode_steps_per_graph = 0  # the opt-out
    assert graph_decode.requested_steps(config, cuda) == 0 and graph_decode.asked_for(config)
    config.decode_steps_per_graph = 3
    assert graph_decode.requested_steps(config, cpu) == 3


def test_the_default_on_the_cpu_is_the_dynamic_cache():
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    out = generate(model, ids, mask, max_new_tokens=3)
    assert isinstance(out.past_key_values, LazooCache) and not out.past_key_values.static


@pytest.mark.parametrize("name", ALL_MODELS)
def test_default_generate_equals_the_static_and_the_dynamic_cache(name, cuda_default, rounds):
    """No argument: lazoo's rounds on the static cache; the same tokens as transformers' loop on the static cache
    (rounds opted out) and on the dynamic cache."""
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    with torch.no_grad():
        default = model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, max_new_tokens=10)
    assert len(rounds) == 1 and rounds[0].static, name
    static = generate(model, ids, mask, max_new_tokens=10, cache_implementation="static", decode_steps_per_graph=0)
    dynamic = generate(model, ids, mask, max_new_tokens=10, cache_implementation="dynamic")
    assert len(rounds) == 1  # neither took the rounds
    assert static.past_key_values.static and not dynamic.past_key_values.static
    assert torch.equal(default, static.sequences), name
    assert torch.equal(default, dynamic.sequences), name


def test_the_rounds_opt_out_and_their_fallbacks(cuda_default, rounds, caplog, monkeypatch):
    """`decode_steps_per_graph=0` (argument or generation config) keeps transformers' loop; a case the rounds do not
    compute (a repetition penalty) takes transformers' loop under the default, saying so at info level, once."""
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, decode_steps_per_graph=0)
        model.generation_config.decode_steps_per_graph = 0
        model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3)
        model.generation_config.decode_steps_per_graph = None
        assert rounds == []
        monkeypatch.setattr(graph_decode, "_REFUSALS_LOGGED", set())
        with caplog.at_level(logging.INFO, logger="lazoo.models.graph_decode"):
            for _ in range(2):
                model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, repetition_penalty=1.2)
        assert rounds == []
    said = [r for r in caplog.records if "RepetitionPenalty" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


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


def test_after_a_failed_capture_the_default_takes_transformers_loop(cuda_default, rounds, caplog, monkeypatch):
    """Eager rounds are slower than the compiled step: once capturing a model's steps has failed, its later default
    generate calls take transformers' loop (said once), the same tokens; asking for the rounds still runs them."""
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    with torch.no_grad():
        first = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=9)
        assert len(rounds) == 1
        graph_decode.LOOPS[model].graph = "uncaptured"  # what a failed capture leaves (CUDA only)
        assert graph_decode.capture_failed(model)
        monkeypatch.setattr(graph_decode, "_REFUSALS_LOGGED", set())
        with caplog.at_level(logging.INFO, logger="lazoo.models.graph_decode"):
            again = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=9)
        assert len(rounds) == 1 and torch.equal(again, first)
        assert any("earlier capture" in r.getMessage() for r in caplog.records)
        model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=9, decode_steps_per_graph=4)
        assert len(rounds) == 2
