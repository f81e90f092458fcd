"""Pads and bad samples are isolated, in every op and backend.

Property, per op and backend, on fresh random inputs and a random mask (left pads, a hole, right pads in every
sample): NaN / +Inf / -Inf planted at the pads of every per-token input, and NaN / Inf in real tokens of one
sample, leave the other samples' outputs, final states and gradients bit-identical to those of the run with
finite garbage at the pads; outputs and gradients at pads are 0.
Table-driven refusals: masks that are not 0/1, log decays g > 0 (and Titans' η, α outside [0, 1]) at real
tokens; B = 0 gives empty results; errors of ops that run another op name the op called.

The Triton backend runs under the interpreter in a subprocess (``tests/test_interpreter.py``), one small
ragged shape per kernel; the other kernel paths are ``-m slow`` (run this file with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from op_helpers import forward_and_grads, state_parts

from lazoo import ops

B, T, H, D = 3, 13, 2, 16  # D = 16: the kernels' tl.dot needs 16 rows
BAD = 2  # the sample that gets NaN / Inf in its real tokens


# ----------------------------------------------------------------------------- inputs per op
def _qkv(gen, unit=False):
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    if unit:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return {"q": q, "k": k, "v": v}


def _scalar(gen, *tail):
    return torch.randn(B, T, H, *tail, generator=gen)


def _log_decay(gen, *tail):
    return F.logsigmoid(_scalar(gen, *tail) + 2.0)


def _unit(gen, *tail):
    return torch.rand(B, T, H, *tail, generator=gen)


def _ttt_mlp_state(gen, batch):
    return {"W1": 0.3 * torch.randn(batch, H, 8, D, generator=gen),
            "W2": 0.3 * torch.randn(batch, H, D, 8, generator=gen)}


#: Mamba-2's per-head parameters (not per token): A < 0 and the skip D, cut to the heads a call runs
MAMBA2_A, MAMBA2_D = -torch.linspace(0.3, 1.5, H), torch.linspace(-1.0, 1.0, H)


def _mamba2(x, **kw):
    """Mamba-2 with x as "v", B as "k" and C as "q" (one group per head), so the tests plant their Inf there."""
    heads = x["v"].shape[2]
    return ops.mamba2(x["v"], x["dt"], MAMBA2_A[:heads], x["k"], x["q"], MAMBA2_D[:heads], chunk_size=16, **kw)


# name -> (the per-token inputs [B, T, H, ...] from a generator, the call on them; None: see _call)
OPS = {
    "softmax_attention": (_qkv, lambda x, **kw: ops.softmax_attention(x["q"], x["k"], x["v"], **kw)),
    "softmax_window": (_qkv, lambda x, **kw: ops.softmax_attention(x["q"], x["k"], x["v"], window=4, **kw)),
    "linear_attention": (_qkv, lambda x, **kw: ops.linear_attention(x["q"], x["k"], x["v"], chunk_size=16, **kw)),
    "gated_linear_attention": (
        lambda g: {**_qkv(g), "g": _log_decay(g)},
        lambda x, **kw: ops.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], chunk_size=16, **kw)),
    "gla": (lambda g: {**_qkv(g), "g": _log_decay(g, D)},
            lambda x, **kw: ops.gla(x["q"], x["k"], x["v"], x["g"], **kw)),
    "delta_rule": (lambda g: {**_qkv(g), "beta": _unit(g)},
                   lambda x, **kw: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], chunk_size=16, **kw)),
    "gated_delta_rule": (
        lambda g: {**_qkv(g), "g": _log_decay(g), "beta": _unit(g)},
        lambda x, **kw: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16, **kw)),
    "delta_product": (
        lambda g: {"q": torch.randn(B, T, H, D, generator=g), "k": _scalar(g, 2, D), "v": _scalar(g, 2, D),
                   "beta": 2 * _unit(g, 2), "g": _log_decay(g)},
        lambda x, **kw: ops.delta_product(x["q"], x["k"], x["v"], x["beta"], g=x["g"], chunk_size=16, **kw)),
    "vla": (lambda g: {**_qkv(g), "u": torch.randn(B, T, H, D, generator=g)},
            lambda x, **kw: ops.vla(x["q"], x["k"], x["v"], x["u"], refresh_period=5, chunk_size=16, **kw)),
    "ela_exp": (_qkv, lambda x, **kw: ops.ela(x["q"], x["k"], x["v"], kernel="hadamard_exp", chunk_size=16, **kw)),
    "ela_sum_sq": (_qkv, lambda x, **kw: ops.ela(x["q"], x["k"], x["v"], kernel="sum_sq_euclid", chunk_size=16,
                                                 **kw)),
    "ela_bidirectional": (_qkv, lambda x, output_final_state, **kw: ops.ela(x["q"], x["k"], x["v"], causal=False,
                                                                           **kw)),
    "bidirectional_linear_attention": (_qkv, lambda x, output_final_state, **kw: ops.bidirectional_linear_attention(
        x["q"], x["k"], x["v"], **kw)),
    "ovq_attention": (lambda g: _qkv(g, unit=True),
                      lambda x, **kw: ops.ovq_attention(x["q"], x["k"], x["v"], chunk_size=3, max_dict_size=4, **kw)),
    "vq_attention": (lambda g: _qkv(g, unit=True), None),  # and a codebook
    "rls": (_qkv, lambda x, **kw: ops.rls(x["q"], x["k"], x["v"], lam=0.5, **kw)),
    "local_linear_attention": (_qkv, lambda x, **kw: ops.local_linear_attention(x["q"], x["k"], x["v"], scale=0.5,
                                                                                  chunk_size=4, **kw)),
    "ttt_linear": (lambda g: {**_qkv(g), "eta": 0.3 * _unit(g)},
                   lambda x, **kw: ops.ttt_linear(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=4, **kw)),
    "ttt_mlp": (lambda g: {**_qkv(g), "eta": 0.3 * _unit(g)}, None),  # and an initial state
    "mamba2": (lambda g: {**_qkv(g), "dt": F.softplus(_scalar(g))}, _mamba2),
    "kda": (lambda g: {**_qkv(g), "g": _log_decay(g, D), "beta": _unit(g)},
            lambda x, **kw: ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=8, **kw)),
    "titans": (lambda g: {**_qkv(g), "theta": 0.3 * _unit(g), "eta": _unit(g), "alpha": 0.2 * _unit(g)},
               lambda x, **kw: ops.titans(x["q"], x["k"], x["v"], x["theta"], x["eta"], x["alpha"],
                                          mini_batch_size=4, **kw)),
}
#: ops with a Triton path; the first set runs in the default (interpreter) run: each kernel module once
TRITON_DEFAULT = ("linear_attention", "gla", "gated_delta_rule", "vla", "ovq_attention", "rls",
                  "local_linear_attention", "ttt_linear", "bidirectional_linear_attention")
TRITON_SLOW = ("gated_linear_attention", "delta_rule", "delta_product", "ela_exp", "ela_sum_sq", "ela_bidirectional",
               "mamba2", "kda")
#: local-linear's step-by-step reference takes seconds per run: in the full matrix only
CPU_CASES = [pytest.param(name, be, marks=[pytest.mark.slow] if (name, be) == ("local_linear_attention", "recurrent")
                          else []) for name in OPS for be in ("chunk", "recurrent")]


def _call(name, x, seed, **kw):
    """Run op ``name`` on the per-token inputs ``x``; extras that are not per token come from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if name == "vq_attention":
        codebook = F.normalize(torch.randn(H, 5, D, generator=gen), dim=-1)
        return ops.vq_attention(x["q"], x["k"], x["v"], codebook, chunk_size=4, **kw)
    if name == "ttt_mlp":
        state = _ttt_mlp_state(gen, len(x["q"]))
        return ops.ttt_mlp(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=4, initial_state=state, **kw)
    return OPS[name][1](x, **kw)


def random_mask(gen) -> torch.Tensor:
    """``[B, T]`` bool: every sample has left pads, a hole and right pads of random lengths (>= 1 each)."""
    mask = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        left, right = (int(torch.randint(1, 4, (), generator=gen)) for _ in range(2))
        mask[b, :left] = False
        mask[b, T - right:] = False
        mask[b, int(torch.randint(left + 1, T - right - 1, (), generator=gen))] = False
    return mask


def planted(x: dict, where: torch.Tensor, values) -> dict:
    """Copies of the inputs with ``values`` (cycled over the inputs) at the ``[B, T]`` positions ``where``."""
    out = {}
    for i, (n, t) in enumerate(x.items()):
        val = values[i % len(values)]
        out[n] = t.masked_fill(where.view(B, T, *([1] * (t.dim() - 2))), val)
    return out


def run(name, x, mask, backend, seed, **op_kwargs):
    """Outputs, final state and the gradients of every per-token input (random projections of all outputs)."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, state, grads = forward_and_grads(
        lambda: _call(name, leaves, seed, mask=mask, backend=backend, output_final_state=True, **op_kwargs), leaves,
        seed=seed)
    return o.detach(), [(n, s.detach()) for n, s in state_parts(state)], grads


def assert_same(a, b, what, rows=slice(None), rtol: float = 0.0):
    """Bit-identical (NaN equal to NaN) on the batch rows ``rows``; with ``rtol``, equal up to it."""
    assert torch.equal(torch.isnan(a[rows]), torch.isnan(b[rows])), f"{what}: NaN in one run only"
    if rtol:
        torch.testing.assert_close(a[rows].nan_to_num(), b[rows].nan_to_num(), rtol=rtol, atol=rtol, msg=what)
    else:
        assert torch.equal(a[rows].nan_to_num(), b[rows].nan_to_num()), f"{what}: differs"


def check_isolation(name: str, backend: str, seed: int, heads: int = H, device: str = "cpu", **op_kwargs) -> None:
    """A run with finite random garbage at the pads against one with NaN / +Inf / -Inf at every pad of every
    input plus NaN (every input) and Inf (q, k, v) at two real tokens of sample BAD: the other samples (each with
    left pads, a hole and right pads) must not change by a bit, in outputs, final state and gradients.
    ``heads``: the first heads only (the interpreter's time grows with them); ``op_kwargs`` go to the op."""
    gen = torch.Generator().manual_seed(seed)
    x = {n: t[:, :, :heads].contiguous() for n, t in OPS[name][0](gen).items()}  # heads are dim 2 of every input
    mask = random_mask(gen)
    pads = ~mask
    real = mask[BAD].nonzero().flatten()
    nan_at, inf_at = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    nan_at[BAD, real[len(real) // 2]] = True
    inf_at[BAD, real[-1]] = True
    bad = planted(planted(x, pads, (math.nan, math.inf, -math.inf)), nan_at, (math.nan,))
    bad.update(planted({n: bad[n] for n in ("q", "k", "v")}, inf_at, (math.inf, -math.inf, math.inf)))
    x, bad = ({n: t.to(device) for n, t in d.items()} for d in (x, bad))
    mask, pads = mask.to(device), pads.to(device)

    o_a, s_a, g_a = run(name, x, mask, backend, seed, **op_kwargs)
    o_b, s_b, g_b = run(name, bad, mask, backend, seed, **op_kwargs)
    clean = [b for b in range(B) if b != BAD]
    what = f"{name}/{backend}"
    assert (o_a[pads] == 0).all() and (o_b[pads] == 0).all(), f"{what}: a pad's output is not 0"
    assert torch.isfinite(o_b[clean]).all(), f"{what}: non-finite output"
    assert_same(o_b, o_a, f"{what} output", clean)
    # OVQ's dictionaries are sums by scatter_add, whose order on CUDA (atomics) differs from run to run: there
    # even two clean runs differ in the last bits
    state_rtol = 1e-5 if device == "cuda" and name == "ovq_attention" else 0.0
    for (n, sb), (_, sa) in zip(s_b, s_a):
        assert_same(sb, sa, f"{what} final {n}", clean, rtol=state_rtol)
    for n, g in g_b.items():
        if g is None:  # an input that gets no gradient from the op (vq's k)
            continue
        assert torch.isfinite(g[clean]).all(), f"{what}: non-finite gradient of {n}"
        assert (g[pads] == 0).all(), f"{what}: gradient of {n} at a pad is not 0"
        assert_same(g, g_a[n], f"{what} grad {n}", clean)


@pytest.mark.parametrize("name,backend", CPU_CASES)
def test_pads_and_bad_samples_are_isolated(name, backend):
    check_isolation(name, backend, seed=sum(map(ord, name + backend)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TRITON_DEFAULT + TRITON_SLOW)
def test_gpu_kernels_isolate_pads_and_bad_samples(name):
    check_isolation(name, "triton", seed=sum(map(ord, name)) + 2, device="cuda")


# ----------------------------------------------------------------------------- Triton (interpreter)


def _needs_interp():
    pytest.importorskip("triton")
    from lazoo.kernels._utils import interpreter_ready

    if not interpreter_ready():
        pytest.skip("needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")


@pytest.mark.parametrize("name", TRITON_DEFAULT)
def test_interp_pads_and_bad_samples_are_isolated(name):
    _needs_interp()
    check_isolation(name, "triton", seed=sum(map(ord, name)), heads=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRITON_SLOW)
def test_interp_pads_isolated_slow(name):
    _needs_interp()
    check_isolation(name, "triton", seed=sum(map(ord, name)) + 1, heads=1)


@pytest.mark.slow
@pytest.mark.parametrize("name,option,kernel", [
    ("vla", {"triton_scan": "chunk"}, ("lazoo.kernels.vla.chunk", "vla_scan_chunked")),
    ("ovq_attention", {"triton_assign": True}, ("lazoo.kernels.ovq.assign", "ovq_assign")),
])
def test_interp_opt_in_kernels_isolate_pads(name, option, kernel, monkeypatch):
    """The kernels an op argument opts into (lazoo.kernels.vla.chunk, lazoo.kernels.ovq.assign)."""
    _needs_interp()
    module = importlib.import_module(kernel[0])
    real, calls = getattr(module, kernel[1]), []
    monkeypatch.setattr(module, kernel[1], lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    if name == "vla":  # T = 13 is a decoding-sized call, which takes the token scan: let the chunked scan run
        monkeypatch.setattr(sys.modules["lazoo.ops.vla"], "_DECODE_MAX_T", 0)  # sys.modules: ops.vla is the op
    check_isolation(name, "triton", seed=7, heads=1, **option)
    assert calls, f"{kernel[0]} did not run"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear_attention", "gated_linear_attention", "gla", "gated_delta_rule", "vla"])
def test_interp_decoding_kernels_isolate_pads(name):
    """Without autograd, T <= 16 runs the fused recurrent (decoding) kernels: pads isolated there too."""
    _needs_interp()
    gen = torch.Generator().manual_seed(3)
    x = OPS[name][0](gen)
    mask = random_mask(gen)
    with torch.no_grad():
        o_a, s_a = _call(name, x, 3, mask=mask, backend="triton", output_final_state=True)
        o_b, s_b = _call(name, planted(x, ~mask, (math.nan, math.inf)), 3, mask=mask, backend="triton",
                         output_final_state=True)
    assert torch.equal(o_a, o_b)
    for (n, a), (_, b) in zip(state_parts(s_a), state_parts(s_b)):
        assert torch.equal(a, b), n


# ----------------------------------------------------------------------------- refusals
BAD_MASK_VALUES = (2.0, -1.0, 0.5, math.nan)


@pytest.mark.parametrize("name", list(OPS))
def test_masks_must_be_0_or_1(name):
    x = OPS[name][0](torch.Generator().manual_seed(11))
    op = {"softmax_window": "softmax_attention", "ela_exp": "ela", "ela_sum_sq": "ela",
          "ela_bidirectional": "ela"}.get(name, name)
    for value in BAD_MASK_VALUES:
        for dtype in (torch.float32, torch.int64):
            if dtype == torch.int64 and (math.isnan(value) or value != int(value)):
                continue  # no such integer
            mask = torch.ones(B, T, dtype=dtype)
            mask[1, 3] = value
            with pytest.raises(ValueError, match=rf"^{op}: mask must be bool or hold only the numbers 0 \(pad\) "
                                                 rf"and 1 \(real token\), got {value:g}"):
                _call(name, x, 11, mask=mask, backend="chunk", output_final_state=False)


def test_integer_and_float_masks_equal_the_bool_mask():
    x = OPS["linear_attention"][0](torch.Generator().manual_seed(15))
    mask = random_mask(torch.Generator().manual_seed(15))
    o_bool, _ = _call("linear_attention", x, 15, mask=mask, backend="chunk", output_final_state=False)
    for dtype in (torch.int64, torch.int8, torch.float16, torch.float64):
        o, _ = _call("linear_attention", x, 15, mask=mask.to(dtype), backend="chunk", output_final_state=False)
        assert torch.equal(o, o_bool), dtype


# op, the gate's input name, a value outside the documented range
BAD_GATES = [
    ("gated_linear_attention", "g", 0.5, r"g must lie in \[-inf, 0\]"),
    ("gla", "g", 0.5, r"g must lie in \[-inf, 0\]"),
    ("gated_delta_rule", "g", 0.5, r"g must lie in \[-inf, 0\]"),
    ("delta_product", "g", 0.5, r"g must lie in \[-inf, 0\]"),
    ("mamba2", "dt", -0.5, r"dt must lie in \[0, inf\]"),
    ("titans", "eta", -0.1, r"eta must lie in \[0, 1\]"),
    ("titans", "alpha", 1.5, r"alpha must lie in \[0, 1\]"),
]


@pytest.mark.parametrize("name,gate,value,message", BAD_GATES)
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_gates_outside_their_range_are_refused_at_real_tokens_only(name, gate, value, message, backend):
    gen = torch.Generator().manual_seed(12)
    x = OPS[name][0](gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4] = False
    at_pad = {**x, gate: x[gate].clone()}
    at_pad[gate][1, 4] = value  # a pad is no input: no error
    o, _ = _call(name, at_pad, 12, mask=mask, backend=backend, output_final_state=False)
    assert torch.isfinite(o).all()
    at_real = {**x, gate: x[gate].clone()}
    at_real[gate][1, 5] = value
    with pytest.raises(ValueError, match=rf"^{name}: {message} at real tokens"):
        _call(name, at_real, 12, mask=mask, backend=backend, output_final_state=False)


@pytest.mark.parametrize("name", ["gated_linear_attention", "gla", "gated_delta_rule", "delta_product"])
def test_interp_log_decays_above_zero_are_refused_on_the_kernels(name):
    """On the kernels the g <= 0 check is read back after the launches (one host sync that waits on the op's own
    work): the op must still raise, naming g, and never return the outputs of a bad g."""
    _needs_interp()
    x = OPS[name][0](torch.Generator().manual_seed(16))
    x["g"] = x["g"].clone()
    x["g"][2, 7] = 0.5
    with pytest.raises(ValueError, match=rf"^{name}: g must lie in \[-inf, 0\] at real tokens"):
        _call(name, x, 16, backend="triton", output_final_state=False)


@pytest.mark.parametrize("name", list(OPS))
def test_empty_batch_gives_empty_results(name):
    x = {n: t[:0] for n, t in OPS[name][0](torch.Generator().manual_seed(13)).items()}
    o, state = _call(name, x, 13, backend="chunk", output_final_state=name != "ela_bidirectional")
    assert o.shape == (0,) + tuple(x["v"].shape[1:3]) + (D,)
    for n, s in state_parts(state):
        assert s.shape[0] == 0, n


# ----------------------------------------------------------------------------- error names
def test_ops_that_run_another_op_name_themselves():
    gen = torch.Generator().manual_seed(14)
    x = {n: t.double() for n, t in OPS["delta_product"][0](gen).items()}
    # chunk_size 8 has no Triton kernel: the refusal comes from the delta rule it runs
    with pytest.raises(NotImplementedError, match=r"^delta_product: backend='triton'.*chunk_size"):
        ops.delta_product(x["q"], x["k"], x["v"], x["beta"], g=x["g"], chunk_size=8, backend="triton")
    y = {n: t.double() for n, t in _qkv(gen).items()}
    for kernel in ("hadamard_exp", "sum_sq_euclid"):  # gla and linear_attention inside; float64 has no kernel
        with pytest.raises(NotImplementedError, match=r"^ela: backend='triton'.*float64"):
            ops.ela(y["q"], y["k"], y["v"], kernel=kernel, backend="triton")


def test_lazoo_backend_reaches_the_attention_layers(monkeypatch):
    from transformers import AutoConfig

    from lazoo.layers.mixers.attention import SlidingWindowAttentionMixer, SoftmaxAttentionMixer

    config = AutoConfig.for_model("lazoo_softmax", hidden_size=32, num_attention_heads=2, sliding_window=4)
    calls = []
    real_eager = ops.softmax._eager
    monkeypatch.setattr(ops.softmax, "_eager", lambda *a: calls.append(1) or real_eager(*a))
    x = torch.randn(2, 6, 32)
    for cls in (SoftmaxAttentionMixer, SlidingWindowAttentionMixer):
        mixer = cls(config, 0, {**cls.defaults})
        monkeypatch.setenv("LAZOO_BACKEND", "recurrent")
        ref = mixer(x, position_ids=torch.arange(6).expand(2, -1))
        assert calls, f"{cls.__name__}: LAZOO_BACKEND=recurrent did not reach the op"
        calls.clear()
        monkeypatch.setenv("LAZOO_BACKEND", "chunk")
        out = mixer(x, position_ids=torch.arange(6).expand(2, -1))
        assert not calls
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
