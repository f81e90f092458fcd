"""torch.compile can trace lazoo models without graph breaks (docs/compile_audit.md lists what still breaks): a
forward with a left-padded attention mask, and one decode step against the cache, on CPU.

`torch._dynamo.explain` only traces (no code generation), so each case takes a second or two. The mechanisms that
still break are expected failures (strict: the test says so when one starts to trace)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model

import lazoo

dynamo = pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.usefixtures("single_thread")

#: where each check still breaks, and why (docs/compile_audit.md): none since the compile-safe paths of ovq, ttt,
#: titans, vla and local_linear (sizes from shapes, no host syncs while traced)
STILL_BREAKS: dict[str, dict[str, str]] = {"padded forward": {}, "decode step": {}}
#: the default run checks these; the slow run every mechanism
QUICK = ("gated_delta_net", "sliding_window", "ela")


def break_reasons(fn, *args) -> list[str]:
    dynamo.reset()
    try:
        explanation = dynamo.explain(fn)(*args)
    finally:
        dynamo.reset()
    return [str(reason.reason).splitlines()[0] for reason in explanation.break_reasons]


def padded_forward(name):
    model = tiny_model(name, seed=1)
    ids = random_ids(2, 8, seed=3)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as generate passes it

    with torch.no_grad():
        return break_reasons(lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False).logits, ids, mask)


def decode_step(name):
    model = tiny_model(name, seed=1)
    ids = random_ids(2, 8, seed=4)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        position = torch.full((2, 1), ids.shape[1])  # what generate passes for an unpadded batch
        return break_reasons(lambda i: model(input_ids=i, cache=cache, position_ids=position, use_cache=True).logits,
                             ids[:, :1])


CHECKS = {"padded forward": padded_forward, "decode step": decode_step}


def cases(names):
    for check in CHECKS:
        for name in names:
            why = STILL_BREAKS[check].get(name)
            marks = [pytest.mark.xfail(reason=f"breaks: {why}", strict=True)] if why else []
            yield pytest.param(check, name, marks=marks, id=f"{check}-{name}")


@pytest.mark.parametrize("check,name", list(cases(QUICK)))
def test_traces_without_graph_breaks(check, name):
    assert CHECKS[check](name) == []


@pytest.mark.slow
@pytest.mark.parametrize("check,name", list(cases([n for n in lazoo.list_mechanisms() if n not in QUICK])))
def test_every_mechanism_traces_without_graph_breaks(check, name):
    assert CHECKS[check](name) == []
