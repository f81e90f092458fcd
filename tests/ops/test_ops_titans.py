"""Titans' linear neural memory (Behrouz et al. 2024, "Titans: Learning to Memorize at Test Time") with momentum
and forgetting: both backends against a literal loop of the mini-batch definition written here (gradients by
autograd at the mini-batch's start memory, momentum and decay token by token; b = 1 is the per-token recurrence),
in float64: outputs, final M and S and gradients (q, k, v, θ, η, α, M₀, S₀), ragged T, a state carried over a
split, padding."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, compare_backends, left_pad_mask

from lazoo.ops import titans

F64 = torch.float64
B, H, D, DV = 2, 2, 4, 3
SEQ = ("q", "k", "v", "theta", "eta", "alpha")


def make(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"q": F.normalize(torch.randn(B, T, H, D, generator=g, dtype=F64), dim=-1),
         "k": F.normalize(torch.randn(B, T, H, D, generator=g, dtype=F64), dim=-1),
         "v": torch.randn(B, T, H, DV, generator=g, dtype=F64),
         "theta": 0.1 + 0.6 * torch.rand(B, T, H, generator=g, dtype=F64),
         "eta": 0.1 + 0.8 * torch.rand(B, T, H, generator=g, dtype=F64),
         "alpha": 0.05 + 0.5 * torch.rand(B, T, H, generator=g, dtype=F64),
         "M": torch.randn(B, H, DV, D, generator=g, dtype=F64),
         "S": 0.3 * torch.randn(B, H, DV, D, generator=g, dtype=F64)}
    for t in x.values():
        t.requires_grad_()
    return x


def call(x, backend, b, **kw):
    state = kw.pop("initial_state", {"M": x["M"], "S": x["S"]})
    return titans(*(x[n] for n in SEQ), mini_batch_size=b, initial_state=state, output_final_state=True,
                  backend=backend, **kw)


def literal(x, b):
    """Per mini-batch: M_g = the memory at its start; per token, ∇ℓ by autograd at M_g,
    S = η S − θ ∇ℓ, M = (1 − α) M + S, o = M q."""
    q, k, v, theta, eta, alpha = (x[n] for n in SEQ)
    M, S, outs = x["M"], x["S"], []
    for s0 in range(0, q.shape[1], b):
        Mg = M
        for t in range(s0, min(s0 + b, q.shape[1])):
            loss = 0.5 * ((torch.einsum("bhvk,bhk->bhv", Mg, k[:, t]) - v[:, t]) ** 2).sum()
            (grad,) = torch.autograd.grad(loss, Mg, create_graph=True)
            S = eta[:, t, :, None, None] * S - theta[:, t, :, None, None] * grad
            M = (1 - alpha[:, t, :, None, None]) * M + S
            outs.append(torch.einsum("bhvk,bhk->bhv", M, q[:, t]))
    return torch.stack(outs, 1), {"M": M, "S": S}


def output_state_grads(fn, leaves):
    o, state = fn()
    gen = torch.Generator().manual_seed(5)
    loss = sum((p * torch.randn(p.shape, generator=gen, dtype=F64)).sum() for p in (o, state["M"], state["S"]))
    return o, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize("T,b", [(11, 4), (9, 1), (8, 8), (5, 16)])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_both_backends_equal_the_literal_mini_batch_definition(T, b, backend):
    x = make(T, seed=T + b)
    o1, s1, g1 = output_state_grads(lambda: call(x, backend, b), x)
    o2, s2, g2 = output_state_grads(lambda: literal(x, b), x)
    assert_close(o1, o2, 1e-11, "output")
    for n in ("M", "S"):
        assert_close(s1[n], s2[n], 1e-11, f"final {n}")
    for n in x:
        assert_close(g1[n], g2[n], 1e-10, f"grad {n}")


def test_chunk_b1_is_per_token_recurrent():
    x = make(7, seed=3)
    compare_backends(lambda be: call(x, be, 1), x, 1e-11)


def test_backends_agree_with_padding_and_a_partial_mini_batch_state():
    x0 = make(6, seed=4)
    with torch.no_grad():
        _, state = call(x0, "recurrent", 4, mask=left_pad_mask([6, 3], 6))
    assert state["n"].tolist() == [2, 3] and set(state) == {"M", "S", "M_start", "n"}
    x = make(13, seed=5)
    mask = left_pad_mask([13, 8], 13, holes=[(0, 5), (1, 9)])
    compare_backends(lambda be: call(x, be, 4, initial_state=state, mask=mask), {n: x[n] for n in SEQ}, 1e-11)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_split_equals_whole(backend):
    x = make(14, seed=6)
    with torch.no_grad():
        o, s = call(x, backend, 4)
        o1, s1 = call({n: (t[:, :5] if n in SEQ else t) for n, t in x.items()}, backend, 4)
        o2, s2 = call({n: (t[:, 5:] if n in SEQ else t) for n, t in x.items()}, backend, 4, initial_state=s1)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "outputs")
    for n in s:
        assert_close(s2[n], s[n], 1e-12, f"state {n}")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_pads_change_nothing(backend):
    x = make(10, seed=7)
    mask = left_pad_mask([10, 6], 10, holes=[(0, 2), (1, 7)])
    with torch.no_grad():
        o, s = call(x, backend, 4, mask=mask)
        assert (o[~mask] == 0).all()
        for i in range(B):
            keep = mask[i]
            xi = {n: (t[i:i + 1, keep] if n in SEQ else t[i:i + 1]) for n, t in x.items()}
            oi, si = call(xi, backend, 4)
            assert_close(o[i, keep], oi[0], 1e-12, f"sample {i}")
            for n in s:
                assert_close(s[n][i], si[n][0], 1e-12, f"sample {i} state {n}")


def test_float32_extreme_gates_and_errors():
    x = {n: t.detach().float() for n, t in make(9, seed=8).items()}
    x["eta"][0, 2] = 0.0  # underflowed gates must not give NaN in the chunk form
    x["alpha"][1, 3] = 1.0
    o1, s1 = call(x, "chunk", 4)
    o2, s2 = call(x, "recurrent", 4)
    assert o1.dtype == torch.float32 and s1["M"].dtype == torch.float32
    assert_close(o1, o2, 1e-4, "fp32 chunk vs recurrent")
    o0, _ = titans(*(x[n] for n in SEQ))  # default M₀ = S₀ = 0
    assert torch.isfinite(o0).all()
    with pytest.raises(ValueError, match="alpha"):
        titans(*(x[n] for n in SEQ[:5]), x["alpha"][..., :1])
    with pytest.raises(ValueError, match="mini_batch_size"):
        titans(*(x[n] for n in SEQ), mini_batch_size=-1)


# ----------------------------------------------------------------------------- memory as context (model level)
def _mac_model():
    from conftest import tiny_model

    # segments of 4 real tokens, 2 persistent tokens; float64 so that every check below is to rounding
    return tiny_model("titans", memory_as_context=True, num_persistent=2).double()


def test_mac_cache_padding_backends_and_grads(monkeypatch):
    from conftest import random_ids

    model = _mac_model()
    assert model.config.memory_as_context and model.model.layers[0].mixer.persistent.shape == (2, 32)
    ids = random_ids(2, 23, seed=3)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :10], use_cache=True)  # a partial segment (10 = 2·4 + 2) in the cache
        assert_close(out.logits, full[:, :10], 1e-10, "prefill")
        for t in range(10, 23):  # token by token: segments complete and restart inside the cache
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values)
            assert_close(out.logits[:, 0], full[:, t], 1e-10, f"decode step {t}")
        # a left-padded batch with a hole equals its samples one by one
        mask = torch.ones(2, 23, dtype=torch.long)
        mask[1, :9] = 0
        mask[0, 5] = 0
        batch = model(ids, attention_mask=mask, use_cache=False).logits
        for b in range(2):
            keep = mask[b].bool()
            alone = model(ids[b:b + 1, keep], use_cache=False).logits[0]
            assert_close(batch[b, keep], alone, 1e-10, f"sample {b}")
        monkeypatch.setenv("LAZOO_BACKEND", "recurrent")
        assert_close(model(ids, use_cache=False).logits, full, 1e-10, "recurrent backend")
    monkeypatch.delenv("LAZOO_BACKEND")
    model.train()
    model(ids, labels=ids).loss.backward()
    mixer = model.model.layers[0].mixer
    for p in (mixer.persistent, mixer.M0, mixer.mq_proj.weight, mixer.gate_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    greedy = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    model.eval()
    assert torch.equal(model.generate(ids[:, :7], use_cache=True, **greedy),
                       model.generate(ids[:, :7], use_cache=False, **greedy))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :6], use_cache=True, **beams),
                       model.generate(ids[:, :6], use_cache=False, **beams))
    with torch.no_grad():  # the persistent tokens and the memory matter
        before = model(ids).logits
        mixer.persistent.add_(0.5)
        assert (model(ids).logits - before).abs().max() > 1e-6
