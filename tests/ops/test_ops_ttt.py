"""TTT-Linear and TTT-MLP (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
States"): both backends against literal definitions written here with autograd for the inner gradient (mini-batch
GD: every gradient of a mini-batch at its start weights; b = 1 is per-token GD), in float64: outputs, final states
and gradients (q, k, v, η, W₀), ragged T, a state carried over a split, padding."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, compare_backends, left_pad_mask

from lazoo.ops import ttt_linear, ttt_mlp

F64 = torch.float64
B, H, D, DV, DH = 2, 2, 4, 3, 6


def make(T, seed=0, b=B, mlp=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=F64), dim=-1)
    v = torch.randn(b, T, H, DV, generator=g, dtype=F64)
    eta = 0.1 + 0.8 * torch.rand(b, T, H, generator=g, dtype=F64)
    if mlp:
        W = {"W1": 0.5 * torch.randn(b, H, DH, D, generator=g, dtype=F64),
             "W2": 0.3 * torch.randn(b, H, DV, DH, generator=g, dtype=F64)}
    else:
        W = {"W": torch.randn(b, H, DV, D, generator=g, dtype=F64)}
    leaves = dict(q=q, k=k, v=v, eta=eta, **W)
    for x in leaves.values():
        x.requires_grad_()
    return leaves


def f_linear(W, x):
    return torch.einsum("bhvk,bhk->bhv", W["W"], x)


def f_mlp(W, x):
    return torch.einsum("bhvn,bhn->bhv", W["W2"], F.gelu(torch.einsum("bhnk,bhk->bhn", W["W1"], x)))


def literal(f, q, k, v, eta, W, b):
    """Mini-batch GD, literally: per mini-batch, the gradient of ½‖f(k_s; W_start) − v_s‖² by autograd at the
    start weights for each token, W_t = W_start − Σ_{s≤t} η_s ∇ℓ_s, o_t = f(q_t; W_t)."""
    outs, T = [], q.shape[1]
    for s0 in range(0, T, b):
        start = dict(W)
        for t in range(s0, min(s0 + b, T)):
            loss = 0.5 * ((f(start, k[:, t]) - v[:, t]) ** 2).sum()
            grads = torch.autograd.grad(loss, list(start.values()), create_graph=True)
            W = {n: W[n] - eta[:, t, :, None, None] * gr for n, gr in zip(start, grads)}
            outs.append(f(W, q[:, t]))
    return torch.stack(outs, 1), W


OPS = {"linear": (ttt_linear, f_linear), "mlp": (ttt_mlp, f_mlp)}


def call(kind, x, backend, b, **kw):
    op, _ = OPS[kind]
    W = {n: x[n] for n in ("W", "W1", "W2") if n in x}
    return op(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=b, initial_state=kw.pop("initial_state", W),
              output_final_state=True, backend=backend, **kw)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("T,b", [(11, 4), (9, 1), (8, 8), (5, 16)])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_both_backends_equal_the_literal_mini_batch_gd(kind, T, b, backend):
    x = make(T, seed=T + b, mlp=kind == "mlp")
    f = OPS[kind][1]
    W = {n: x[n] for n in ("W", "W1", "W2") if n in x}

    def ref():
        return literal(f, x["q"], x["k"], x["v"], x["eta"], W, b)

    o1, s1, g1 = _output_state_grads(lambda: call(kind, x, backend, b), x, W)
    o2, s2, g2 = _output_state_grads(ref, x, W)
    assert_close(o1, o2, 1e-11, "output")
    for n in W:
        assert_close(s1[n], s2[n], 1e-11, f"final {n}")
    for n in x:
        assert_close(g1[n], g2[n], 1e-10, f"grad {n}")


def _output_state_grads(fn, leaves, W):
    """Output, final weights, and the gradients of a random projection of both (the literal loop has no
    W_start / n parts, so only the current weights are compared)."""
    o, state = fn()
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum()
    loss = loss + sum((state[n] * torch.randn(state[n].shape, generator=gen, dtype=F64)).sum() for n in W)
    return o, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_chunk_b1_is_per_token_recurrent(kind):
    x = make(7, seed=3, mlp=kind == "mlp")
    compare_backends(lambda be: call(kind, x, be, 1), x, 1e-11)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_backends_agree_with_padding_and_a_partial_mini_batch_state(kind):
    x0 = make(6, seed=4, mlp=kind == "mlp")
    with torch.no_grad():
        _, state = call(kind, x0, "recurrent", 4, mask=left_pad_mask([6, 3], 6))  # n = 2 and 3
    assert state["n"].tolist() == [2, 3]
    x = make(13, seed=5, mlp=kind == "mlp")
    mask = left_pad_mask([13, 8], 13, holes=[(0, 5), (1, 9)])
    leaves = {n: x[n] for n in ("q", "k", "v", "eta")}
    compare_backends(lambda be: call(kind, x, be, 4, initial_state=state, mask=mask), leaves, 1e-11)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_split_equals_whole(kind, backend):
    x = make(14, seed=6, mlp=kind == "mlp")
    with torch.no_grad():
        o, s = call(kind, x, backend, 4)
        first = {n: (t[:, :5] if n in "q k v eta".split() else t) for n, t in x.items()}
        rest = {n: t[:, 5:] for n, t in x.items() if n in "q k v eta".split()}
        o1, s1 = call(kind, first, backend, 4)
        o2, s2 = call(kind, rest, backend, 4, initial_state=s1)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "outputs")
    for n in s:
        assert_close(s2[n], s[n], 1e-12, f"state {n}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_pads_change_nothing(kind, backend):
    x = make(10, seed=7, mlp=kind == "mlp")
    mask = left_pad_mask([10, 6], 10, holes=[(0, 2), (1, 7)])
    with torch.no_grad():
        o, s = call(kind, x, backend, 4, mask=mask)
        assert (o[~mask] == 0).all()
        for i in range(B):
            keep = mask[i]
            xi = {n: (t[i:i + 1, keep] if n in "q k v eta".split() else t[i:i + 1]) for n, t in x.items()}
            oi, si = call(kind, xi, backend, 4)
            assert_close(o[i, keep], oi[0], 1e-12, f"sample {i}")
            for n in s:
                assert_close(s[n][i], si[n][0], 1e-12, f"sample {i} state {n}")


def test_float32_and_errors():
    x = {n: t.detach().float() for n, t in make(9, seed=8).items()}
    o, s = ttt_linear(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=4, initial_state={"W": x["W"]},
                      output_final_state=True)
    assert o.dtype == torch.float32 and s["W"].dtype == torch.float32 and s["n"].tolist() == [1, 1]
    o0, _ = ttt_linear(x["q"], x["k"], x["v"], x["eta"])  # default W₀ = 0
    assert torch.isfinite(o0).all()
    with pytest.raises(ValueError, match="mini_batch_size"):
        ttt_linear(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=0)
    with pytest.raises(ValueError, match="initial_state\\['n'\\]"):
        ttt_linear(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=1, initial_state=s)
    with pytest.raises(ValueError, match="W1"):
        ttt_mlp(x["q"], x["k"], x["v"], x["eta"])
    with pytest.raises(ValueError, match="eta"):
        ttt_linear(x["q"], x["k"], x["v"], x["eta"][..., :1])
