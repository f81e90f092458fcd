"""Conventions shared by every op: backend choice, errors naming the argument, dtypes, masks."""

import logging

import pytest
import torch

from lazoo import ops
from lazoo.ops import backend as op_backend

B, T, H, DK, DV = 2, 5, 2, 4, 3


def make(dtype=torch.float64):
    torch.manual_seed(0)
    q, k, u = (torch.randn(B, T, H, DK, dtype=dtype) for _ in range(3))
    v = torch.randn(B, T, H, DV, dtype=dtype)
    g = -torch.rand(B, T, H, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype)
    return dict(q=q, k=k, v=v, u=u, g=g, beta=beta)


# Every op as f(inputs, **kwargs); the extra inputs (g, beta, u) come from the same dict.
OPS = {
    "softmax_attention": lambda x, **kw: ops.softmax_attention(x["q"], x["k"], x["v"], **kw),
    "linear_attention": lambda x, **kw: ops.linear_attention(x["q"], x["k"], x["v"], **kw),
    "gated_linear_attention": lambda x, **kw: ops.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], **kw),
    "delta_rule": lambda x, **kw: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw),
    "gated_delta_rule": lambda x, **kw: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw),
    "vla": lambda x, **kw: ops.vla(x["q"], x["k"], x["v"], x["u"], **kw),
}
EXTRA = {"gated_linear_attention": ["g"], "delta_rule": ["beta"], "gated_delta_rule": ["g", "beta"], "vla": ["u"]}


@pytest.mark.parametrize("name", OPS)
def test_backends_unknown_and_forced_triton(name, monkeypatch):
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    x = make()
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'.*'recurrent', 'chunk', 'triton'"):
        OPS[name](x, backend="cuda")
    with pytest.raises(NotImplementedError, match=f"{name}: backend='triton'"):
        OPS[name](x, backend="triton")
    # The variable is read when backend is None, and an explicit backend wins over it.
    monkeypatch.setenv("LAZOO_BACKEND", "triton")
    with pytest.raises(NotImplementedError, match="LAZOO_BACKEND"):
        OPS[name](x)
    monkeypatch.setenv("LAZOO_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LAZOO_BACKEND"):
        OPS[name](x)
    o_env_ok, _ = OPS[name](x, backend="recurrent")
    monkeypatch.setenv("LAZOO_BACKEND", "chunk")
    o_auto, _ = OPS[name](x)
    assert torch.allclose(o_auto, o_env_ok, rtol=1e-10, atol=1e-12)


def test_env_variable_selects_the_backend(monkeypatch):
    called = []
    real = ops.linear._recurrent_linear
    monkeypatch.setattr(ops.linear, "_recurrent_linear", lambda *a: called.append(1) or real(*a))
    x = make()
    monkeypatch.setenv("LAZOO_BACKEND", "recurrent")
    OPS["linear_attention"](x)
    assert called == [1]
    monkeypatch.delenv("LAZOO_BACKEND")
    OPS["linear_attention"](x)  # auto -> chunk
    assert called == [1]


def test_auto_on_cuda_logs_once_per_op(caplog, monkeypatch):
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    monkeypatch.setattr(op_backend, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="lazoo"):
        assert op_backend.resolve_backend("some_op", None, torch.device("cpu")) == "chunk"
        assert not caplog.records
        for _ in range(3):
            assert op_backend.resolve_backend("some_op", None, torch.device("cuda")) == "chunk"
        op_backend.resolve_backend("other_op", None, torch.device("cuda"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "some_op" in messages[0] and "Triton" in messages[0]


def test_the_fallback_note_waits_for_an_eager_call_while_compiled(caplog, monkeypatch):
    """A log call inside a compiled region is a graph break: the note is said by the first eager call instead."""
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    monkeypatch.setattr(op_backend, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="lazoo"):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert op_backend.resolve_backend("some_op", None, torch.device("cuda")) == "chunk"
        assert not caplog.records
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        assert op_backend.resolve_backend("some_op", None, torch.device("cuda")) == "chunk"
    assert len(caplog.records) == 1 and "some_op" in caplog.records[0].getMessage()


@pytest.mark.parametrize("name", OPS)
def test_shape_dtype_and_mask_errors_name_the_argument(name):
    x = make()
    bad = dict(x, k=x["k"][:, :-1])
    with pytest.raises(ValueError,
                       match=r"k must have shape \[B, T, H, dk\] = \(2, 5, 2, 4\) like q, got \(2, 4, 2, 4\)"):
        OPS[name](bad)
    with pytest.raises(ValueError, match="v must have shape"):
        OPS[name](dict(x, v=x["v"][:1]))
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        OPS[name](dict(x, q=x["q"][0]))
    with pytest.raises(TypeError, match="floating-point"):
        OPS[name](dict(x, q=x["q"].long(), k=x["k"].long(), v=x["v"].long()))
    with pytest.raises(TypeError, match="v has dtype torch.float32"):
        OPS[name](dict(x, v=x["v"].float()))
    with pytest.raises(ValueError, match=r"mask must have shape \[B, T\]"):
        OPS[name](x, mask=torch.ones(B, T + 1, dtype=torch.bool))
    for arg in EXTRA.get(name, []):
        with pytest.raises(ValueError, match=f"{arg} must have shape"):
            OPS[name](dict(x, **{arg: x[arg][:, :-1]}))
        with pytest.raises(TypeError, match=f"{arg} has dtype"):  # neither q's dtype nor float32
            OPS[name](dict(x, **{arg: x[arg].half()}))


@pytest.mark.parametrize("name", [n for n in OPS if n != "softmax_attention"])
def test_bad_initial_state_shape(name):
    x = make()
    _, state = OPS[name](x, output_final_state=True)
    if isinstance(state, dict):
        key = "S"
        bad = dict(state, S=state["S"][:, :1])
        match = r"initial_state\['S'\] must have shape"
    else:
        bad, match = state[..., :-1], "initial_state must have shape"
    with pytest.raises(ValueError, match=match):
        OPS[name](x, initial_state=bad)
    if isinstance(state, dict):
        with pytest.raises(ValueError, match="keys"):
            OPS[name](x, initial_state={key: state[key]})


@pytest.mark.parametrize("name", OPS)
def test_mask_dtypes_agree_and_none_equals_all_ones(name):
    x = make()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False
    o_bool, _ = OPS[name](x, mask=mask)
    o_int, _ = OPS[name](x, mask=mask.long())
    o_float, _ = OPS[name](x, mask=mask.double())
    assert torch.equal(o_bool, o_int) and torch.equal(o_bool, o_float)
    assert torch.all(o_bool[1, :2] == 0) and o_bool[1, 2:].abs().max() > 0
    o_none, _ = OPS[name](x)
    o_ones, _ = OPS[name](x, mask=torch.ones(B, T))
    assert torch.allclose(o_none, o_ones, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_their_dtype(name, dtype):
    x64 = make()
    x = {key: t.to(dtype) for key, t in x64.items()}
    o, state = OPS[name](x, output_final_state=True)
    ref, _ = OPS[name](x64)
    assert o.dtype == dtype
    parts = state.values() if isinstance(state, dict) else [state]
    # recurrent states are fp32; the softmax KV cache keeps the input dtype (SDPA runs in it)
    state_dtype = dtype if name == "softmax_attention" else torch.float32
    assert all(p.dtype == state_dtype for p in parts if p.is_floating_point())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    err = (o.double() - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{name} {dtype}: relative error {err:.2e}"


def test_time_cumsum_equals_cumsum_over_dim_1():
    """The normaliser's cumsum scanned with time innermost equals x.cumsum(1) (float64, exactly: same order)."""
    from lazoo.ops.scan import time_cumsum

    x = torch.randn(3, 37, 2, 5, dtype=torch.float64, requires_grad=True)
    got = time_cumsum(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, x.cumsum(1), rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad((got * torch.arange(5.0, dtype=torch.float64)).sum(), x)
    (ref,) = torch.autograd.grad((x.cumsum(1) * torch.arange(5.0, dtype=torch.float64)).sum(), x)
    torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)


def test_kernel_range_check_reads_the_kernels_flag_or_compares_itself():
    """``KernelRangeCheck``: once queued, the flag a kernel set decides (and the message names the bad value);
    never queued (no kernel ran), it compares x itself."""
    from lazoo.ops.checks import kernel_log_decay_check

    g = torch.full((1, 4, 2), -0.5)
    check = kernel_log_decay_check("op", "g", g)
    check.queued()
    check()  # the flag is 0
    g[0, 2, 1] = 0.75
    check.flag.fill_(1)  # as the kernel leaves it
    with pytest.raises(ValueError, match=r"op: g must lie in \[-inf, 0\] at real tokens.*got 0\.75"):
        check()
    unqueued = kernel_log_decay_check("op", "g", g)
    with pytest.raises(ValueError, match="got 0.75"):
        unqueued()
    assert kernel_log_decay_check("op", "g", None) is None
