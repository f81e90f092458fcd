"""lazoo's greedy loop of several decode steps per graph (lazoo.models.graph_decode), on the CPU where the same steps
run uncaptured: the tokens of transformers' loop for every model, with left padding, rows that stop early at an end
token, lengths that are not a multiple of the steps; the cases it refuses keep transformers' loop and say why once.
On a GPU (``-m gpu``) the steps are captured and replayed."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import ALL_MODELS, left_padded, tiny_model

from lazoo.models import graph_decode

pytestmark = pytest.mark.usefixtures("single_thread")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def generate(model, ids, mask, steps, **kwargs):
    model.generation_config.decode_steps_per_graph = steps
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **{"pad_token_id": 0, "do_sample": False,
                                                               "cache_implementation": "static", **kwargs})
    finally:
        model.generation_config.decode_steps_per_graph = None


@pytest.fixture
def rounds(monkeypatch):
    """Counts the rounds of lazoo's loop (it did run, not transformers' loop)."""
    calls = []
    real = graph_decode.GraphLoop.run
    monkeypatch.setattr(graph_decode.GraphLoop, "run", lambda self: calls.append(self.graph) or real(self))
    return calls


@pytest.mark.parametrize("name", ALL_MODELS)
def test_the_tokens_of_transformers_loop(name, rounds):
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    want = generate(model, ids, mask, 0, max_new_tokens=10)
    got = generate(model, ids, mask, 4, max_new_tokens=10)  # 1 token from the prompt, then rounds of 4, 4, 1 of 4
    assert torch.equal(got, want), name
    assert len(rounds) == 3


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_step_sees_the_inputs_and_gives_the_logits_of_transformers_loop(name, rounds):
    """Not only the tokens: each forward's position ids and logits equal those of transformers' loop (a position one
    behind changes a rotary model's logits a little, seldom its greedy tokens), for each copy of a prompt generate
    expands (num_return_sequences)."""
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    seen = []

    def inputs(module, args, kwargs):  # a copy: the rounds advance their position buffer in place
        position_ids = kwargs.get("position_ids")
        seen.append(("in", None if position_ids is None else position_ids.clone()))

    hooks = [model.register_forward_pre_hook(inputs, with_kwargs=True),
             model.register_forward_hook(lambda m, a, out: seen.append(("out", out.logits[:, -1].clone())))]
    try:
        runs = []
        for steps in (0, 4):
            seen.clear()
            torch.manual_seed(0)  # the same draws
            out = generate(model, ids, mask, steps, max_new_tokens=7, num_return_sequences=2, do_sample=True, top_k=5)
            runs.append((out, list(seen)))
    finally:
        for hook in hooks:
            hook.remove()
    (want, want_seen), (got, got_seen) = runs
    assert len(rounds) == 2 and len(want_seen) == 2 * 7 and len(got_seen) == 2 * 9, name  # the last round runs past
    for (kind, a), (_, b) in zip(got_seen, want_seen):
        if a is None or b is None:
            assert a is None and b is None, (name, kind)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name} {kind}")
    assert torch.equal(got, want), name


def test_a_later_generate_reuses_the_loop_and_a_new_model_state_does_not(rounds):
    """The second generate of the same shapes refills the kept loop's buffers (a replay of the same graph on CUDA)
    and gives transformers' tokens for its own prompt; weights moved to new tensors make a new loop."""
    model = tiny_model("hybrid", seed=1)
    ids, mask = left_padded()
    generate(model, ids, mask, 4, max_new_tokens=9)
    loop = graph_decode.LOOPS[model]
    other = torch.flip(ids, [1]) * mask  # another prompt, the same shapes
    assert torch.equal(generate(model, other, mask, 4, max_new_tokens=9),
                       generate(model, other, mask, 0, max_new_tokens=9))
    assert graph_decode.LOOPS[model] is loop
    copied = copy.deepcopy(model)  # a model with a loop copies (the loop is kept beside it)
    assert copied not in graph_decode.LOOPS
    model.double().float()  # every weight a new tensor
    assert torch.equal(generate(model, ids, mask, 4, max_new_tokens=9), generate(model, ids, mask, 0, max_new_tokens=9))
    assert graph_decode.LOOPS[model] is not loop


@pytest.mark.parametrize("steps", [1, 3, 16])
def test_rows_that_stop_early(steps, rounds):
    """An end token that some rows reach before the others: they take the pad token after it, and the loop ends
    with the step at which the last row stops (transformers' length), whatever the round size."""
    model = tiny_model("hybrid", seed=3)
    ids, mask = left_padded()
    free = generate(model, ids, mask, 0, max_new_tokens=12)
    eos = int(free[1, ids.shape[1] + 2])  # a token row 1 produces at its third step
    want = generate(model, ids, mask, 0, max_new_tokens=12, eos_token_id=eos)
    got = generate(model, ids, mask, steps, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(got, want)
    assert rounds  # lazoo's loop ran
    assert (want[1, ids.shape[1] + 3:] == 0).all() or want.shape[1] == ids.shape[1] + 3


def test_one_new_token_needs_no_round(rounds):
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    assert torch.equal(generate(model, ids, mask, 8, max_new_tokens=1), generate(model, ids, mask, 0, max_new_tokens=1))
    assert rounds == []


@pytest.mark.parametrize("warpers", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}])
def test_sampling_draws_the_tokens_of_transformers_loop(warpers, rounds):
    """From the same random state, the same draws in the same order: the tokens of transformers' loop, with the
    sampling warpers run inside the rounds."""
    model = tiny_model("hybrid", seed=2)
    ids, mask = left_padded()
    torch.manual_seed(7)
    want = generate(model, ids, mask, 0, max_new_tokens=9, do_sample=True, **warpers)
    torch.manual_seed(7)
    got = generate(model, ids, mask, 4, max_new_tokens=9, do_sample=True, **warpers)
    assert torch.equal(got, want)
    assert len(rounds) == 2


def test_refusals_keep_transformers_loop_and_say_why(rounds, caplog):
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    graph_decode._REFUSALS_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="lazoo.models.graph_decode"):
        beams = generate(model, ids, mask, 4, max_new_tokens=4, num_beams=2)  # transformers' beam search, as ever
        penalised = generate(model, ids, mask, 4, max_new_tokens=4, repetition_penalty=1.3)
        generate(model, ids, mask, 4, max_new_tokens=4, repetition_penalty=1.3)  # said once
        dynamic = generate(model, ids, mask, 4, max_new_tokens=4, cache_implementation="dynamic")
    assert rounds == [] and beams.shape == penalised.shape == dynamic.shape
    said = [r.getMessage() for r in caplog.records]
    assert sum("logits processors other than temperature" in m and "RepetitionPenaltyLogitsProcessor" in m
               for m in said) == 1
    assert any("static lazoo cache" in m for m in said)
    with pytest.raises(ValueError, match="decode_steps_per_graph must be a whole number"):
        generate(model, ids, mask, -1, max_new_tokens=2)


def generate_kwarg(model, ids, mask):
    """The field passes through `generate` like the config's others (it is in the model's generation config)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=5, do_sample=False,
                              cache_implementation="static", decode_steps_per_graph=2)


def test_the_field_is_a_generate_argument(rounds):
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    assert torch.equal(generate_kwarg(model, ids, mask), generate(model, ids, mask, 0, max_new_tokens=5))
    assert len(rounds) == 2


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL_MODELS)
def test_gpu_captured_rounds_give_the_tokens_of_transformers_loop(name, rounds):
    model = tiny_model(name, seed=1).cuda()
    ids, mask = (t.cuda() for t in left_padded())
    want = generate(model, ids, mask, 0, max_new_tokens=20, disable_compile=True)  # transformers' loop, eager
    got = generate(model, ids, mask, 4, max_new_tokens=20)
    assert torch.equal(got, want), name
    assert rounds[0] is False and len(rounds) == 5  # an eager round, then captured ones
    assert isinstance(graph_decode.LOOPS[model].graph, torch.cuda.CUDAGraph)
    other = torch.flip(ids, [1]) * mask  # a second generate replays the same graph
    graph = graph_decode.LOOPS[model].graph
    assert torch.equal(generate(model, other, mask, 4, max_new_tokens=20),
                       generate(model, other, mask, 0, max_new_tokens=20, disable_compile=True))
    assert graph_decode.LOOPS[model].graph is graph


@pytest.mark.parametrize("name", ALL_MODELS)
def test_a_decode_step_keeps_every_cache_tensor_where_it_was(name):
    """What a captured round needs of the static cache: a decode step writes its states into the tensors that hold
    them (a replay reads and writes those addresses) and counts the position on the device."""
    from lazoo.models.compat import CACHE_FIELD

    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, do_sample=False,
                             cache_implementation="static", return_dict_in_generate=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    where = graph_decode._addresses(cache.states, cache.lobe_states, cache._seen, cache.real_tokens)
    seen = cache.seen_positions
    full = torch.cat([mask, mask.new_ones(mask.shape[0], 3)], dim=1)
    inputs = graph_decode.decode_inputs(model, out.sequences, full, {CACHE_FIELD: cache, "use_cache": True})
    with torch.no_grad():
        model(**inputs)
    assert graph_decode._addresses(cache.states, cache.lobe_states, cache._seen, cache.real_tokens) == where, name
    assert cache.seen_positions == seen + 1


@needs_cuda
@pytest.mark.gpu
def test_gpu_sampling_in_captured_rounds(rounds):
    """Sampling with top-k = 1 is a draw that can only give the argmax: captured rounds of it give greedy's tokens;
    and a plain sampled run makes its tokens."""
    model = tiny_model("hybrid", seed=2).cuda()
    ids, mask = (t.cuda() for t in left_padded())
    want = generate(model, ids, mask, 0, max_new_tokens=20, disable_compile=True)
    assert torch.equal(generate(model, ids, mask, 4, max_new_tokens=20, do_sample=True, top_k=1), want)
    sampled = generate(model, ids, mask, 4, max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9)
    assert sampled.shape == want.shape and len(rounds) == 10


def test_the_draw_is_multinomials_and_refuses_bad_probabilities():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    torch.manual_seed(3)
    want = torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(3)
    assert torch.equal(graph_decode._draw(probs), want)
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        graph_decode._draw(torch.tensor([[float("nan"), 1.0]]))
