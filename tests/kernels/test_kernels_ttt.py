"""Triton kernel of TTT-Linear (lazoo.kernels.ttt) through ``ops.ttt_linear(backend="triton")`` against the
float64 per-token reference (``backend="recurrent"``, itself checked against literal autograd mini-batch GD in
test_ops_ttt.py): outputs, final states (W, W_start, n) and the gradients of q, k, v, η and the initial W, at
ragged T (not a multiple of the mini-batch), with an initial state. And the fused decode steps of ttt_linear
and ttt_mlp against one step of the reference.

CPU (default run): the ``interp_*`` tests need ``TRITON_INTERPRET=1`` set before triton is imported, so
``tests/test_interpreter.py`` runs them in a fresh process. GPU: ``-m gpu`` at T = 1024, D = 64/128, bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask, rel_err

from lazoo import ops
from lazoo.ops.ttt import ttt_linear_decode_step, ttt_mlp_decode_step

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


def inputs(B, T, H, dk, dv, seed=0, device="cpu"):
    """float64 q, k (unit norm, as the mixer feeds them), v, η ∈ (0.1, 0.9), W0."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    eta = 0.1 + 0.8 * torch.rand(B, T, H, generator=gen, dtype=F64)
    W = torch.randn(B, H, dv, dk, generator=gen, dtype=F64) / dk ** 0.5
    Ws = torch.randn(B, H, dv, dk, generator=gen, dtype=F64) / dk ** 0.5
    return {n: x.to(device) for n, x in dict(q=q, k=k, v=v, eta=eta, W=W, W_start=Ws).items()}


def run(x, b, backend, dtype, device="cpu", mask=None, n0=None):
    """Forward + gradients (of a random projection of o and of every float part of the final state).
    With ``n0`` the initial state holds a partial mini-batch: W, W_start (a leaf too) and n."""
    sdt = F64 if dtype == F64 else torch.float32
    leaves = {n: t.to(device=device, dtype=sdt if n.startswith("W") else dtype).requires_grad_(True)
              for n, t in x.items() if n != "W_start" or n0 is not None}
    state = {"W": leaves["W"]}
    if n0 is not None:
        state.update(W_start=leaves["W_start"], n=n0.to(device))
    mask = None if mask is None else mask.to(device)
    return forward_and_grads(
        lambda: ops.ttt_linear(leaves["q"], leaves["k"], leaves["v"], leaves["eta"], mini_batch_size=b,
                               initial_state=state, output_final_state=True, mask=mask, backend=backend),
        leaves) + (leaves,)


def check(x, b, dtype, rtol, grad_rtol, ref_backend="recurrent", device="cpu", **kw):
    x = {n: t.to(dtype).to(F64) for n, t in x.items()}  # the reference sees the same rounded numbers
    ro, rs, rg, _ = run(x, b, ref_backend, F64, device, **kw)
    to, ts, tg, leaves = run(x, b, "triton", dtype, device, **kw)
    assert to.dtype == dtype
    errs = {"o": rel_err(to, ro), **{f"d{n}": rel_err(tg[n], rg[n]) for n in tg}}
    print(f"ttt_linear b={b} {dtype} rel errors: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    assert_close(to, ro, rtol, "output")
    assert_state_close({n: s.double() if s.is_floating_point() else s for n, s in ts.items()}, rs, rtol, "final")
    for n in leaves:
        assert tg[n] is not None, f"no gradient reaches {n}"
        assert tg[n].dtype == leaves[n].dtype
        assert_close(tg[n], rg[n], grad_rtol, f"grad {n}")


# ============================================================================ dispatch (no kernel runs)
def test_triton_refuses_clearly():
    x = {n: t.float() for n, t in inputs(1, 5, 1, 8, 8).items()}
    args = (x["q"], x["k"], x["v"], x["eta"])
    state = {"W": x["W"], "W_start": x["W_start"], "n": torch.tensor([0])}
    with pytest.raises(NotImplementedError, match="W_start = W"):  # b = 1 is the delta rule: no W_start
        ops.ttt_linear(*args, initial_state=state, mini_batch_size=1, backend="triton")
    with pytest.raises(NotImplementedError, match="mini_batch_size up to"):
        ops.ttt_linear(*args, mini_batch_size=256, backend="triton")
    big = torch.randn(1, 5, 1, 300)
    with pytest.raises(NotImplementedError, match="head dims"):
        ops.ttt_linear(big, big, x["v"], x["eta"], backend="triton")
    d = {n: t.double() for n, t in x.items()}
    with pytest.raises(NotImplementedError, match="float64"):  # b = 1 runs the delta-rule kernels
        ops.ttt_linear(d["q"], d["k"], d["v"], d["eta"], mini_batch_size=1, backend="triton")


# ============================================================================ interpreter (CPU)


@needs_interp
@pytest.mark.parametrize("T,b", [(23, 4), (3, 4), (20, 5)])  # ragged; shorter than b; a multiple of b
def test_interp_float64_matches_reference(T, b):
    # float64 through the kernels: the hand-written backward must match to rounding
    x = inputs(2, T, 2, 12, 10, seed=T)  # head dims below the 16-wide tiles: masked loads
    check(x, b, F64, 1e-10, 1e-10)


@needs_interp
@pytest.mark.parametrize("T,b,dk,dv", [(45, 16, 16, 32), (37, 32, 32, 16)])
def test_interp_float32_matches_reference(T, b, dk, dv):
    x = inputs(2, T, 2, dk, dv, seed=1)
    check(x, b, torch.float32, 1e-4, 1e-4)


@needs_interp
def test_interp_float16():
    # 16-bit inputs: products in fp16, the per-mini-batch weights stored in fp16, W and the errors fp32
    x = inputs(1, 40, 2, 16, 16, seed=8)
    check(x, 16, torch.float16, 3e-3, 5e-3)


@needs_interp
def test_interp_float64_padding_and_a_partial_mini_batch_state():
    # left padding, a hole, per-sample partial mini-batches (n0 = 1, 3) with W_start != W: the slot grid
    T, b = 17, 4
    x = inputs(2, T, 2, 12, 10, seed=3)
    mask = left_pad_mask([T, T - 5], T, holes=[(0, 6)])
    check(x, b, F64, 1e-10, 1e-10, mask=mask, n0=torch.tensor([1, 3]))
    check(x, b, F64, 1e-10, 1e-10, mask=mask)  # fresh state, padding only
    short = inputs(2, 2, 2, 12, 10, seed=4)  # the mini-batch never fills: final W_start = the initial one
    check(short, b, F64, 1e-10, 1e-10, n0=torch.tensor([1, 0]))


@needs_interp
def test_interp_per_token_runs_the_delta_rule():
    # b = 1 is DeltaNet with β = η: lazoo.kernels.delta's chunk kernel; a pad is η = 0
    x = inputs(2, 21, 2, 16, 16, seed=2)
    check(x, 1, torch.float32, 1e-4, 1e-4, mask=left_pad_mask([21, 15], 21))


# ============================================================================ decode steps (PyTorch)
def _mlp_state(gen, B, H, dk, dh, dv):
    return {"W1": 0.5 * torch.randn(B, H, dh, dk, generator=gen, dtype=F64),
            "W2": 0.3 * torch.randn(B, H, dv, dh, generator=gen, dtype=F64)}


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_decode_step_is_one_step_of_the_reference(kind):
    B, T, H, dk, dv, dh, b = 3, 6, 2, 8, 5, 12, 4
    x = inputs(B, T + 2, H, dk, dv, seed=4)
    gen = torch.Generator().manual_seed(5)
    op = ops.ttt_linear if kind == "linear" else ops.ttt_mlp
    step = ttt_linear_decode_step if kind == "linear" else ttt_mlp_decode_step
    W0 = {"W": x["W"]} if kind == "linear" else _mlp_state(gen, B, H, dk, dh, dv)
    # prefill with different lengths: sample 0 ends with n = 3 = b - 1 (the decode token fills its mini-batch)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :1] = False
    mask[1, :3] = False
    sl = slice(0, T)
    _, state = op(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["eta"][:, sl], mini_batch_size=b,
                  initial_state=W0, output_final_state=True, mask=mask, backend="recurrent")
    assert state["n"].tolist() == [1, 3, 2]
    for t in (T, T + 1):  # two decode steps; sample 2 is a pad in the first
        real = torch.tensor([True, True, t != T])
        args = [x[n][:, t:t + 1] for n in ("q", "k", "v", "eta")]
        ro, rstate = op(*args, mini_batch_size=b, initial_state=state, output_final_state=True,
                        mask=real[:, None], backend="recurrent")
        o, new = step(*(a[:, 0] for a in args), state, mini_batch_size=b, real=real)
        assert_close(o, ro[:, 0], 1e-12, f"decode output at {t}")
        assert_state_close(new, {n: s for n, s in rstate.items()}, 1e-12, f"decode state at {t}")
        state = new
    assert state["n"].tolist() == [3, 1, 3]


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_mixer_decode_uses_the_step_and_equals_the_full_forward(kind, monkeypatch):
    from lazoo.layers.mixers import ttt as mixers
    from lazoo.layers.mixers.ttt import TTTLinearMixer, TTTMLPMixer

    calls = []
    name = f"{kind}_decode_step"
    real_step = getattr(mixers, name)
    monkeypatch.setattr(mixers, name, lambda *a, **kw: calls.append(1) or real_step(*a, **kw))

    class Cfg:
        hidden_size, num_attention_heads = 16, 2

    cls = TTTLinearMixer if kind == "ttt_linear" else TTTMLPMixer
    mixer = cls(Cfg(), 0, {**cls.defaults, "mini_batch_size": 3}).double()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, 16, generator=gen, dtype=F64)
    with torch.no_grad():
        full = mixer(x)
        q, k, v = (mixer.split_heads(p(x)) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
        o_pre, state = mixer.mix(q[:, :5], k[:, :5], v[:, :5], x[:, :5], mask=None, state=None, want_state=True)
        outs = [o_pre]
        for t in (5, 6):
            o_t, state = mixer.mix(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], x[:, t:t + 1], mask=None,
                                   state=state, want_state=True)
            outs.append(o_t)
        o = torch.cat(outs, 1)
        if mixer.o_norm is not None:
            o = mixer.o_norm(o)
        out = mixer.o_proj(mixer.merge_heads(o))
    assert_close(out, full, 1e-10, "prefill + decode steps vs full forward")
    assert len(calls) == 2, "the mixer's one-token calls against a state must take the fused step"


# ============================================================================ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("b", [16, 1])
def test_gpu_bf16_matches_float64(D, b):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = inputs(2, 1024, 4, D, D, seed=7, device="cuda")
    check(x, b, torch.bfloat16, 2e-2, 3e-2, ref_backend="chunk", device="cuda")
