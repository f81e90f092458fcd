"""`generate`'s stopping check read one step late for a lazoo cache that `generate` drops, on CUDA
(`lazoo.models.stop_check`). The CPU takes the CUDA rule here (`DEFERRED_STOP_DEVICES`): the tokens equal those of
the check at every token, the loop runs one step more once every row has stopped (the proof that it deferred), and a
cache the user passes or gets back is checked at every token."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded, tiny_model
from transformers import DynamicCache
from transformers.generation import utils as generation_utils

from lazoo.models import modeling_lazoo, stop_check
from lazoo.models.cache import LazooCache
from lazoo.models.compat import CACHE_FIELD
from lazoo.models.stop_check import LazooDeferredStopCheck, lazoo_cache_defers

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(LazooDeferredStopCheck is None,
                                 reason="this transformers release has no DeferredStopCheck: its loop is unchanged")]

CUDA = torch.device("cuda", 0)


def test_the_rule():
    cache = LazooCache(2)
    assert lazoo_cache_defers(CUDA, cache, cache_is_returned=False, is_assistant=False)
    assert not lazoo_cache_defers(CUDA, cache, cache_is_returned=True, is_assistant=False)
    assert not lazoo_cache_defers(CUDA, cache, cache_is_returned=False, is_assistant=True)
    assert not lazoo_cache_defers(torch.device("cpu"), cache, cache_is_returned=False, is_assistant=False)
    assert not lazoo_cache_defers(CUDA, DynamicCache(), cache_is_returned=False, is_assistant=False)
    # other caches: transformers' own rule (mps only)
    assert not LazooDeferredStopCheck.is_supported(CUDA, DynamicCache(), False, False)
    assert LazooDeferredStopCheck.is_supported(torch.device("mps"), None, False, False)
    assert LazooDeferredStopCheck.is_supported(CUDA, cache, False, False)


class HostEvent:
    """A CPU stand-in for `torch.Event` (the CPU backend has none; its work is done when queued)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def cpu_events(monkeypatch):
    monkeypatch.setattr(torch, "Event", HostEvent)


@pytest.fixture
def cpu_as_cuda(monkeypatch, cpu_events):
    defer_on_the_cpu(monkeypatch)


def counted_generate(model, ids, mask, **kwargs) -> tuple[torch.Tensor, int]:
    """`generate`'s output and the number of forwards it ran."""
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, **kwargs)
    finally:
        handle.remove()
    assert generation_utils.DeferredStopCheck is stop_check._TRANSFORMERS_CHECK  # put back
    return out, len(calls)


def early_stops(model, ids, mask, cache_implementation) -> list[int]:
    """End-of-sequence ids that stop row 0 by the 3rd and row 1 by the 5th new token (row 2 by its own), well
    before the 12 asked for."""
    free, _ = counted_generate(model, ids, mask, max_new_tokens=12, cache_implementation=cache_implementation)
    start = ids.shape[1]
    return sorted({int(free[0, start + 2]), int(free[1, start + 4]), int(free[2, start + 6])})


def stopping_early(name: str, cache_implementation: str | None = None):
    """A tiny model `name` and `run(**kwargs)`: its counted `generate` of up to 12 tokens on left-padded prompts
    (with `cache_implementation`, or generate's default), with end-of-sequence ids that stop every row early."""
    model = tiny_model(name, seed=1)
    ids, mask = left_padded()
    eos = early_stops(model, ids, mask, cache_implementation)
    chosen = {"cache_implementation": cache_implementation} if cache_implementation else {}
    return model, lambda **kwargs: counted_generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos,
                                                    **chosen, **kwargs)


def defer_on_the_cpu(monkeypatch):
    monkeypatch.setattr(stop_check, "DEFERRED_STOP_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("name", ["gated_delta_net", "hybrid", "softmax", "kda"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_deferred_check_gives_the_same_tokens(name, cache_implementation, monkeypatch, cpu_events):
    _, run = stopping_early(name, cache_implementation)
    every, every_calls = run()
    assert every.shape[1] < left_padded()[0].shape[1] + 12  # every row stopped early
    defer_on_the_cpu(monkeypatch)
    late, late_calls = run()
    assert torch.equal(late, every), name
    assert late_calls == every_calls + 1  # read one step late: one step more, its token removed


def test_max_length_stops_without_an_extra_step(cpu_as_cuda):
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    out, calls = counted_generate(model, ids, mask, max_new_tokens=5)
    assert out.shape[1] == ids.shape[1] + 5 and calls == 5


def test_a_cache_given_back_is_checked_every_token(monkeypatch, cpu_events):
    """With `return_dict_in_generate` the cache is handed back: no step too many reaches it."""
    _, run = stopping_early("gated_delta_net")
    every, every_calls = run()
    defer_on_the_cpu(monkeypatch)
    given, calls = run(return_dict_in_generate=True)
    assert calls == every_calls and torch.equal(given.sequences, every)
    assert given.past_key_values.seen_positions == given.sequences.shape[1] - 1
    assert run()[1] == every_calls + 1


def test_a_users_cache_is_checked_every_token(monkeypatch, cpu_events):
    model, run = stopping_early("gated_delta_net")
    _, every_calls = run()
    defer_on_the_cpu(monkeypatch)
    _, calls = run(**{CACHE_FIELD: LazooCache(model.config.num_hidden_layers)})
    assert calls == every_calls


def test_the_cuda_default_defers(monkeypatch, cpu_as_cuda):
    """The default `generate` on CUDA (the static cache) takes the deferred check."""
    monkeypatch.setattr(modeling_lazoo, "default_cache_implementation", lambda device: "static")
    model = tiny_model("gated_delta_net", seed=1)
    ids, mask = left_padded()
    eos = early_stops(model, ids, mask, "static")
    taken = []
    original = LazooDeferredStopCheck.__init__
    monkeypatch.setattr(LazooDeferredStopCheck, "__init__",
                        lambda self, *a, **k: (taken.append(1), original(self, *a, **k))[1])
    counted_generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos)
    assert taken == [1]
