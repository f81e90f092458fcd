"""OVQ attention without host syncs: while torch.compile traces (or a CUDA graph is captured) ``host_sync_allowed()``
is False and the op takes sizes from shapes only (the whole dictionary capacity, a packed length bounded by
L - 1 + T). These tests force that path without compiling and compare it with the normal one: outputs, final
states (shapes included) and gradients, on ragged left-padded batches over many chunks (the dictionaries grow,
saturate and merge), and across a sequence split between calls. One test traces the op with dynamo."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask

from lazoo.ops import ovq_attention

ovq_module = importlib.import_module("lazoo.ops.ovq")

F64 = torch.float64
H, D, DV = 2, 6, 5


def make(B, T, seed, dtype=F64, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, DV, generator=g, dtype=dtype)
    beta = torch.tensor([2.0, 3.5], dtype=dtype)
    if grad:
        for x in (q, k, v, beta):
            x.requires_grad_()
    return q, k, v, beta


def run(q, k, v, beta, L, N, backend="chunk", **kw):
    return ovq_attention(q, k, v, scale=beta, chunk_size=L, max_dict_size=N, output_final_state=True,
                         backend=backend, **kw)


def without_sync(monkeypatch, fn):
    """``fn()`` on the path taken while compiling (no host reads), then the normal path restored."""
    with monkeypatch.context() as patch:
        patch.setattr(ovq_module, "host_sync_allowed", lambda: False)
        return fn()


def assert_same_result(monkeypatch, fn, rtol, what):
    o_sync, s_sync = fn()
    o_static, s_static = without_sync(monkeypatch, fn)
    assert_close(o_static, o_sync, rtol, f"{what} output")
    assert_state_close(s_static, s_sync, rtol, f"{what} state")
    return s_sync


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("T,L,N", [(1, 4, 7), (23, 4, 7), (26, 5, 9), (17, 3, 2), (9, 1, 3)])
def test_no_sync_path_equals_normal_path_ragged(monkeypatch, backend, T, L, N):
    lengths = [T, max(T - 7, 0), max(T // 2, 1)]
    holes = [(0, T // 2)] if T > 2 else []
    q, k, v, beta = make(3, T, seed=T + L)
    mask = left_pad_mask(lengths, T, holes=holes)
    assert_same_result(monkeypatch, lambda: run(q, k, v, beta, L, N, backend, mask=mask), 1e-12, f"T={T}")


def test_no_sync_path_float32(monkeypatch):
    q, k, v, beta = make(3, 31, seed=5, dtype=torch.float32)
    mask = left_pad_mask([31, 20, 9], 31, holes=[(1, 25)])
    assert_same_result(monkeypatch, lambda: run(q, k, v, beta, 4, 7, mask=mask), 1e-6, "float32")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_no_sync_path_carries_a_state_over_a_split_sequence(monkeypatch, backend):
    q, k, v, beta = make(3, 30, seed=7)
    mask = left_pad_mask([30, 22, 13], 30, holes=[(0, 17)])
    cut = 11  # the samples stop mid-chunk at different points
    first = lambda: run(q[:, :cut], k[:, :cut], v[:, :cut], beta, 4, 7, backend, mask=mask[:, :cut])
    state = assert_same_result(monkeypatch, first, 1e-12, "first part")
    second = lambda s: run(q[:, cut:], k[:, cut:], v[:, cut:], beta, 4, 7, backend, initial_state=s,
                           mask=mask[:, cut:])
    assert_same_result(monkeypatch, lambda: second(state), 1e-12, "second part")
    # both parts without sync, the state handed over between them, equal to the whole sequence in one call
    o1, s1 = without_sync(monkeypatch, first)
    o2, s2 = without_sync(monkeypatch, lambda: second(s1))
    o, s = run(q, k, v, beta, 4, 7, backend, mask=mask)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_state_close(s2, s, 1e-12, "split state")


def test_no_sync_decode_steps_from_a_state(monkeypatch):
    """One token at a time (the decode step), against the state of a padded prompt."""
    q, k, v, beta = make(2, 16, seed=9)
    mask = left_pad_mask([9, 6], 9)
    _, state = run(q[:, :9], k[:, :9], v[:, :9], beta, 4, 7, mask=mask)
    s_sync = s_static = state
    for i in range(9, 16):
        step = lambda s: run(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], beta, 4, 7, initial_state=s)
        o_sync, s_sync = step(s_sync)
        o_static, s_static = without_sync(monkeypatch, lambda: step(s_static))
        assert_close(o_static, o_sync, 1e-12, f"step {i} output")
        assert_state_close(s_static, s_sync, 1e-12, f"step {i} state")


def test_no_sync_path_gradients(monkeypatch):
    q, k, v, beta = make(2, 14, seed=11, grad=True)
    mask = left_pad_mask([14, 10], 14)
    leaves = dict(q=q, k=k, v=v, beta=beta)
    fn = lambda: run(q, k, v, beta, 3, 5, mask=mask)
    o_sync, s_sync, g_sync = forward_and_grads(fn, leaves)
    o_static, s_static, g_static = without_sync(monkeypatch, lambda: forward_and_grads(fn, leaves))
    assert_close(o_static, o_sync, 1e-12, "output")
    assert_state_close(s_static, s_sync, 1e-12, "state")
    for name in leaves:
        assert_close(g_static[name], g_sync[name], 1e-10, f"grad {name}")


def test_no_sync_path_keeps_a_larger_capacity(monkeypatch):
    """A state of capacity M0 > max_dict_size: the normal path cuts the empty slots past max(N, size), the path
    without sync keeps all M0 (a size it cannot read); the centroids and every output agree."""
    q, k, v, beta = make(2, 20, seed=13)
    _, state = run(q[:, :12], k[:, :12], v[:, :12], beta, 4, 9)
    fn = lambda: run(q[:, 12:], k[:, 12:], v[:, 12:], beta, 4, 5, initial_state=state)
    o_sync, s_sync = fn()
    o_static, s_static = without_sync(monkeypatch, fn)
    assert_close(o_static, o_sync, 1e-12, "output")
    M = s_sync["counts"].shape[-1]
    assert s_static["counts"].shape[-1] == state["counts"].shape[-1] > M
    assert (s_static["counts"][..., M:] == 0).all()
    assert_state_close({key: x[..., :M, :] if key in ("Dk", "Dv") else x[..., :M] if key == "counts" else x
                        for key, x in s_static.items()}, s_sync, 1e-12, "state")


def test_op_traces_without_graph_breaks():
    dynamo = pytest.importorskip("torch._dynamo")
    q, k, v, beta = make(2, 10, seed=15, dtype=torch.float32)
    _, state = run(q[:, :6], k[:, :6], v[:, :6], beta, 4, 7, mask=left_pad_mask([6, 3], 6))
    mask = left_pad_mask([4, 2], 4)

    def fn(q, k, v, mask):
        return run(q, k, v, beta, 4, 7, initial_state=state, mask=mask)

    dynamo.reset()
    try:
        explanation = dynamo.explain(fn)(q[:, 6:], k[:, 6:], v[:, 6:], mask)
    finally:
        dynamo.reset()
    assert [str(reason.reason).splitlines()[0] for reason in explanation.break_reasons] == []
