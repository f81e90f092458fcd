"""The compile-safe path of TTT-Linear, TTT-MLP and Titans (taken while torch.compile traces or a CUDA graph is
captured: no host sync, every size from tensor shapes) equals the eager path, run here without compiling by
making ``host_sync_allowed`` (as ``lazoo.ops.ttt`` looks it up) answer False.

That path puts the real tokens on a slot grid long enough for any partial mini-batch n0 ≤ b − 1 and T new
tokens, so it runs empty mini-batches the eager path does not: they must leave the state exactly as it is.
Checked on fresh random inputs at ragged lengths with masks, with a partial mini-batch carried in the state over a
split sequence: outputs, final states (same parts and shapes), gradients; and tiny models (prompt + decode
steps against the cache, Titans' memory-as-context layout too)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model
from op_helpers import left_pad_mask

import lazoo.ops.ttt as ttt_module
from lazoo.ops import titans, ttt_linear, ttt_mlp

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, D, DV, DH = 3, 2, 4, 3, 6
TOL = 1e-6  # float32: the two paths run the same per-chunk products


@contextlib.contextmanager
def compile_safe_path(monkeypatch):
    """Take the path of a traced or captured run (and check that the static slot grid was built)."""
    built, static_slot_grid = [], ttt_module._static_slot_grid

    def static_grid(*args):
        built.append(True)
        return static_slot_grid(*args)

    with monkeypatch.context() as patch:
        patch.setattr(ttt_module, "host_sync_allowed", lambda: False)
        patch.setattr(ttt_module, "_static_slot_grid", static_grid)
        yield
    assert built, "the compile-safe slot grid was not used"


def make(op, T, seed, grad=False):
    """Random float32 inputs of ``op`` (positional args) and its initial weights."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def unit(*shape):
        return 0.1 + 0.8 * torch.rand(*shape, generator=g)

    q, k = (F.normalize(rand(B, T, H, D), dim=-1) for _ in range(2))
    v = rand(B, T, H, DV)
    if op == "titans":
        args = [q, k, v, 0.5 * unit(B, T, H), unit(B, T, H), 0.2 * unit(B, T, H)]
        weights = {"M": 0.3 * rand(B, H, DV, D)}
    else:
        args = [q, k, v, unit(B, T, H)]
        weights = ({"W1": 0.5 * rand(B, H, DH, D), "W2": 0.3 * rand(B, H, DV, DH)} if op == "ttt_mlp"
                   else {"W": rand(B, H, DV, D)})
    if grad:
        for x in args + list(weights.values()):
            x.requires_grad_()
    return args, weights


OPS = {"ttt_linear": ttt_linear, "ttt_mlp": ttt_mlp, "titans": titans}


def run_split(op, args, weights, masks, b, backend="chunk"):
    """The sequence in two calls (the state carried between them): ``(outputs, final states)``."""
    cut = masks[0].shape[1]
    state, outs, states = weights, [], []
    for part, mask in ((slice(0, cut), masks[0]), (slice(cut, None), masks[1])):
        o, state = OPS[op](*(x[:, part] for x in args), mini_batch_size=b, initial_state=state,
                           output_final_state=True, mask=mask, backend=backend)
        outs.append(o)
        states.append(state)
    return outs, states


def assert_same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    if a.is_floating_point():
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err <= TOL, f"{what}: max |diff| {err:.2e}"
    else:
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def assert_same_states(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: parts {sorted(a)} != {sorted(b)}"
    for name in a:
        assert_same(a[name], b[name], f"{what} [{name}]")


def ragged_masks(T1, T2):
    """Left padding of different lengths, a hole, and a row with no token in the second part."""
    first = left_pad_mask([T1, T1 - 3, 1], T1, holes=[(0, 2)])
    second = left_pad_mask([T2, T2 - 2, 0], T2, holes=[(1, T2 - 1)])
    return first, second


@pytest.mark.parametrize("b", [1, 3, 4])
@pytest.mark.parametrize("op", list(OPS))
def test_split_ragged_sequence_equals_eager(monkeypatch, op, b):
    args, weights = make(op, 11, seed=b)
    masks = ragged_masks(6, 5)
    eager_o, eager_s = run_split(op, args, weights, masks, b)
    with compile_safe_path(monkeypatch):
        static_o, static_s = run_split(op, args, weights, masks, b)
    assert eager_s[0]["n"].tolist() != [0, 0, 0] or b == 1, "no partial mini-batch carried"
    for i in range(2):
        assert_same(static_o[i], eager_o[i], f"{op} b={b} output {i}")
        assert_same_states(static_s[i], eager_s[i], f"{op} b={b} state {i}")


@pytest.mark.parametrize("op", list(OPS))
def test_empty_mini_batches_leave_the_state_unchanged(monkeypatch, op):
    """A row with no real token meets only empty mini-batches: its state must come back bit for bit."""
    args, weights = make(op, 9, seed=7)
    first = left_pad_mask([5, 2, 4], 5)
    _, state = OPS[op](*(x[:, :5] for x in args), mini_batch_size=4, initial_state=weights,
                       output_final_state=True, mask=first)
    none = torch.zeros(B, 4, dtype=torch.bool)
    with compile_safe_path(monkeypatch):
        o, after = OPS[op](*(x[:, 5:] for x in args), mini_batch_size=4, initial_state=state,
                           output_final_state=True, mask=none)
    assert not o.any()
    for name, x in state.items():
        assert torch.equal(after[name], x), f"{op}: state part {name} changed"


@pytest.mark.parametrize("op", ["ttt_linear", "titans"])
def test_gradients_equal_eager(monkeypatch, op):
    args, weights = make(op, 9, seed=3, grad=True)
    masks = ragged_masks(5, 4)
    leaves = args + list(weights.values())

    def grads():
        outs, states = run_split(op, args, weights, masks, 3)
        g = torch.Generator().manual_seed(0)
        parts = outs + [x for s in states for x in s.values() if x.is_floating_point()]
        loss = sum((x * torch.randn(x.shape, generator=g)).sum() for x in parts)
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    eager = grads()
    with compile_safe_path(monkeypatch):
        static = grads()
    for i, (a, c) in enumerate(zip(static, eager)):
        assert (a is None) == (c is None)
        if a is not None:
            assert_same(a, c, f"{op} grad {i}")


# ----------------------------------------------------------------------------- models: prompt and decode steps
def prompt_and_decode(model, steps=3):
    """A left-padded prompt into the cache, then one-token steps: every step's logits, and the cache states (as
    ``flat_parts`` of each layer) after the prompt and after the last step."""
    ids = random_ids(2, 7, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # 4 and 3 real tokens: the compile-safe grid holds a segment of Titans' MAC that eager's lacks
    mask[1, :4] = 0
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        states = [layer_parts(cache)]
        logits.append(out.logits)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            position = (mask.cumsum(1) - 1)[:, -1:]
            out = model(input_ids=tok, attention_mask=mask, position_ids=position, cache=cache, use_cache=True)
            logits.append(out.logits)
            tok = out.logits[:, -1:].argmax(-1)
    return logits, states + [layer_parts(cache)]


def layer_parts(cache):
    return [[(name, x.clone()) for name, x in flat_parts(entry)] for entry in cache.states]


def flat_parts(entry, prefix=""):
    if isinstance(entry, torch.Tensor):
        return [(prefix, entry)]
    if isinstance(entry, dict):
        return [p for key in sorted(entry) for p in flat_parts(entry[key], f"{prefix}.{key}")]
    assert entry is None, f"{prefix}: unexpected {type(entry).__name__}"
    return []


@pytest.mark.parametrize("name,options", [("ttt_linear", {}), ("ttt_mlp", {}), ("titans", {}),
                                          ("titans", {"memory_as_context": True})],
                         ids=["ttt_linear", "ttt_mlp", "titans", "titans_mac"])
def test_model_prompt_and_decode_equal_eager(monkeypatch, name, options):
    model = tiny_model(name, seed=1, **options)
    eager_logits, eager_states = prompt_and_decode(model)
    with compile_safe_path(monkeypatch):
        static_logits, static_states = prompt_and_decode(model)
    for i, (a, c) in enumerate(zip(static_logits, eager_logits)):
        assert_same(a, c, f"{name} logits {i}")
    for when, static_layers, eager_layers in zip(("prompt", "last step"), static_states, eager_states):
        for layer, (pa, pc) in enumerate(zip(static_layers, eager_layers)):
            assert [n for n, _ in pa] == [n for n, _ in pc], f"{when} layer {layer}: state parts differ"
            for (part, x), (_, y) in zip(pa, pc):
                assert_same(x, y, f"{name} {when} layer {layer} state{part}")
