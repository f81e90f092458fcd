"""The static cache (`LazooCache(static=True)`, `generate(..., cache_implementation="static")`): the same tokens as the
dynamic cache for every mechanism and the hybrids, tensors that keep their shape and address, clear errors, and decode
steps that `torch.compile(fullgraph=True)` traces once (CPU; compiled generate on CUDA: test_compile_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MODELS, left_padded, random_ids, tiny_model
from torch.utils._pytree import tree_leaves
from transformers import CompileConfig

import lazoo
from lazoo.models.cache import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")

#: the default run compiles these; the slow run every model
QUICK = ("gated_delta_net", "sliding_window", "softmax", "hybrid")


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_static_cache_generates_the_dynamic_tokens(name):
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    for kwargs in (dict(max_new_tokens=10, do_sample=False), dict(max_new_tokens=5, do_sample=False, num_beams=3)):
        dynamic = generate(model, ids, mask, **kwargs)
        static = generate(model, ids, mask, cache_implementation="static", **kwargs)
        assert torch.equal(dynamic, static), (name, kwargs)
    # every step's logits too: a position or a cached slot off by one moves them, seldom the greedy tokens
    logits = [torch.stack(generate(model, ids, mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, cache_implementation=impl).logits)
              for impl in ("dynamic", "static")]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5, msg=name)
    torch.manual_seed(7)
    sampled = generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(7)
    assert torch.equal(sampled, generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=20,
                                         cache_implementation="static"))


def state_tensors(cache):
    return [t for t in tree_leaves([cache.states, cache.lobe_states, cache.real_tokens, cache._seen])
            if isinstance(t, torch.Tensor)]


def test_static_cache_keeps_shapes_and_addresses_and_is_reused():
    model = tiny_model("hybrid", seed=1)
    ids, mask = left_padded()
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append([(t.data_ptr(), tuple(t.shape)) for t in state_tensors(out.past_key_values)])
        return out

    model.forward = recording
    out = generate(model, ids, mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
                   return_dict_in_generate=True, max_cache_len=20)
    cache = out.past_key_values
    assert cache.static and cache.is_compileable and cache.seen_positions == 9 + 5
    assert len(seen) == 6 and all(step == seen[0] for step in seen)
    # a second generate of the same size refills the same buffers, and still gives the dynamic cache's tokens
    other_ids, _ = left_padded(seed=11)
    again = generate(model, other_ids, mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
                     return_dict_in_generate=True, max_cache_len=20)
    assert again.past_key_values is cache and seen[-1] == seen[0]
    model.forward = forward
    assert torch.equal(again.sequences, generate(model, other_ids, mask, max_new_tokens=6, do_sample=False))


def test_static_cache_needs_room_for_every_position():
    model = tiny_model("softmax", seed=1)
    ids = random_ids(2, 4, seed=5)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_cache_len"):
            model(input_ids=ids, cache=LazooCache(2, static=True), use_cache=True)
        cache = LazooCache(2, static=True, max_cache_len=5)
        model(input_ids=ids, cache=cache, use_cache=True)
        model(input_ids=ids[:, :1], cache=cache, use_cache=True)  # position 5 of 5
        with pytest.raises(ValueError, match="keeps 5 positions"):
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
    # a window needs no length: its cache keeps window - 1 positions
    window = tiny_model("sliding_window", seed=1)
    with torch.no_grad():
        cache = LazooCache(2, static=True)
        window(input_ids=ids, cache=cache, use_cache=True)
        assert cache.states[0]["k"].shape[1] == window.config.sliding_window - 1


def test_static_cache_refuses_a_new_shape():
    model = tiny_model("gated_delta_net", seed=1)
    cache = LazooCache(2, static=True)
    with torch.no_grad():
        model(input_ids=random_ids(2, 4, seed=5), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="holds 2 sequences but the input has 3"):
            model(input_ids=random_ids(3, 1, seed=5), cache=cache, use_cache=True)
    # a state of another shape cannot be copied into the buffers (here: a window cut short by hand)
    window = tiny_model("sliding_window", seed=1)
    cache = LazooCache(2, static=True)
    with torch.no_grad():
        window(input_ids=random_ids(2, 4, seed=5), cache=cache, use_cache=True)
        cache.states[0] = {name: x[:, :1] for name, x in cache.states[0].items()}
        with pytest.raises(ValueError, match="keeps its shapes"):
            window(input_ids=random_ids(2, 1, seed=5), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="max_cache_len"):
        LazooCache(2, static=True, max_cache_len=0)


def test_static_cache_matches_a_states_dicts_by_key():
    # a form may build its state dict in another key order (OVQ's Triton path once did): the static cache copies
    # by key into the buffers it holds; another key set is still refused
    cache = LazooCache(1, static=True)
    first = {"op": {"S": torch.zeros(2, 3), "t": torch.zeros(2, dtype=torch.long)}, "conv": None}
    cache.write_state(0, first)
    held = cache.states[0]["op"]["S"]
    cache.write_state(0, {"conv": None, "op": {"t": torch.full((2,), 4), "S": torch.ones(2, 3)}})
    assert cache.states[0]["op"]["S"] is held and torch.equal(held, torch.ones(2, 3))
    assert torch.equal(cache.states[0]["op"]["t"], torch.full((2,), 4))
    with pytest.raises(ValueError, match="different structure"):
        cache.write_state(0, {"op": {"S": torch.ones(2, 3), "z": torch.zeros(2)}, "conv": None})


def test_cache_preparation_reads_its_arguments_by_name():
    """generate passes batch_size and max_cache_length positionally today; a call by keyword (or a later release
    that passes them so) builds the same cache: beams times the batch, the larger of the two lengths (in its
    bucket: 300 -> 512, 600 -> 768)."""
    from transformers import GenerationConfig

    model = tiny_model("softmax", seed=1)  # a full-length KV cache: its size follows the length
    config = GenerationConfig(cache_implementation="static", num_beams=2, max_cache_len=300)
    made = []
    for args, kwargs in (((None, 3, 25), {}), ((), dict(generation_mode=None, batch_size=3, max_cache_length=25)),
                         ((None,), dict(batch_size=3, max_cache_length=600))):
        model_kwargs = {}
        model._prepare_cache_for_generation(config, model_kwargs, *args, **kwargs)
        cache = next(v for k, v in model_kwargs.items() if isinstance(v, LazooCache))
        made.append((cache.static, cache.max_cache_len))
    assert made == [(True, 512), (True, 512), (True, 768)]
    assert model._lazoo_static_cache_key[0] == 6  # 3 samples x 2 beams


def test_other_cache_implementations_are_refused():
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="cache_implementation may be 'static'"):
        generate(model, ids, mask, max_new_tokens=2, cache_implementation="offloaded")


@pytest.fixture
def fresh_dynamo():
    """Every compiled test starts from no compiled code: the models share their forward's code object, and dynamo's
    recompile limit counts the compiles of one code object across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(compiles):
    def backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    return backend


def compiled_decode(name):
    """Eager and `torch.compile(fullgraph=True)` decode steps, each on its own static cache filled by the same
    left-padded prompt: the largest logit difference and the graphs compiled at each step."""
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    compiles = []
    step = torch.compile(model, fullgraph=True, backend=counting_backend(compiles))
    caches = [LazooCache(model.config.num_hidden_layers, static=True, max_cache_len=20) for _ in range(2)]
    worst, per_step = 0.0, []
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        token, positions = ids[:, -1:].clone(), (mask.sum(1, keepdim=True) - 1)
        for _ in range(5):
            positions = positions + 1
            kwargs = dict(input_ids=token, attention_mask=torch.ones_like(token), position_ids=positions,
                          use_cache=True)
            eager = model(cache=caches[0], **kwargs).logits
            before = len(compiles)
            compiled = step(cache=caches[1], **kwargs).logits
            per_step.append(len(compiles) - before)
            worst = max(worst, (eager - compiled).abs().max().item())
            token = eager[:, -1:].argmax(-1)
    return worst, per_step


def compiled_cases():
    for name in ALL_MODELS:
        yield pytest.param(name, marks=[] if name in QUICK else [pytest.mark.slow], id=name)


@pytest.mark.parametrize("name", list(compiled_cases()))
def test_compiled_decode_step_traces_once_and_equals_eager(name, fresh_dynamo):
    worst, per_step = compiled_decode(name)
    assert per_step == [1, 0, 0, 0, 0], f"graphs compiled per decode step: {per_step}"
    assert worst < 1e-5


@pytest.mark.parametrize("name", list(compiled_cases()))
def test_fullgraph_compiled_forward_equals_eager(name, fresh_dynamo):
    model = tiny_model(name, seed=1)
    ids, mask = left_padded(length=13)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert (eager[real] - got[real]).abs().max().item() < 1e-5


def test_generate_compiles_its_decode_steps_once(fresh_dynamo):
    """generate's own compile path (on CUDA by default; here forced onto the CPU with an eager backend)."""
    model = tiny_model("hybrid", seed=1)
    ids, mask = left_padded()
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    torch._dynamo.utils.counters.clear()
    for new_tokens in (6, 3, 6):
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
        compiled = generate(model, ids, mask, cache_implementation="static", compile_config=config,
                            max_cache_len=20, **kwargs)
        assert torch.equal(compiled, generate(model, ids, mask, **kwargs))
    assert getattr(model, "_compiled_call", None) is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_every_model_is_covered():
    assert set(ALL_MODELS) >= set(lazoo.list_mechanisms())
