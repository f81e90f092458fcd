"""Local-linear (p = 1) attention (eqs. 52–54 of the test-time regression paper, Wang et al. 2025): an independent
per-query weighted ridge regression (least squares on the stacked, √w-weighted design) vs the per-query
normal-equation reference and the batched moment form, float64, ragged T; gradients; sliding window; KV-cache
carry-over; padding; and the limit ρ → ∞, where the slope vanishes and the output is softmax attention
Σ w_i v_i."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, compare_backends, left_pad_mask

from lazoo.ops import local_linear_attention, softmax_attention

F64 = torch.float64
B, H, D, DV = 2, 2, 4, 3


def make(T, b=B, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=F64), dim=-1)
    v = torch.randn(b, T, H, DV, generator=g, dtype=F64)
    beta = torch.tensor([1.5, 3.0], dtype=F64)
    if grad:
        for x in (q, k, v, beta):
            x.requires_grad_()
    return q, k, v, beta


def lstsq_reference(q, k, v, beta, ridge, window=None, mask=None):
    """o_t = M⁰ of min Σ_i w_i‖v_i − M⁰ − M¹(k_i − q_t)‖² + ρ‖M¹‖², solved as one least-squares problem per
    query on [√w_i (1, k_i − q_t); (0, √ρ I)] (no normal equations), over the real keys i ≤ t (and > t − W)."""
    b_, T = q.shape[:2]
    mask = torch.ones(b_, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=F64)
    for b in range(b_):
        for t in range(T):
            if not mask[b, t]:
                continue
            idx = [i for i in range(t + 1) if mask[b, i] and (window is None or i > t - window)]
            for h in range(H):
                K, V, qt = k[b, idx, h], v[b, idx, h], q[b, t, h]
                w = torch.softmax(beta[h] * (K @ qt), 0)
                X = torch.cat([torch.ones(len(idx), 1, dtype=F64), K - qt], 1) * w.sqrt()[:, None]
                X = torch.cat([X, torch.cat([torch.zeros(D, 1, dtype=F64), ridge ** 0.5 * torch.eye(D, dtype=F64)], 1)])
                Y = torch.cat([V * w.sqrt()[:, None], torch.zeros(D, V.shape[1], dtype=F64)])
                out[b, t, h] = torch.linalg.lstsq(X, Y).solution[0]
    return out


@pytest.mark.parametrize("T,C,window", [(1, 4, None), (11, 4, None), (17, 5, 6)])
def test_both_forms_equal_the_explicit_regression(T, C, window):
    q, k, v, beta = make(T, seed=T)
    ref = lstsq_reference(q, k, v, beta, 0.05, window)
    for backend in ("recurrent", "chunk"):
        o, _ = local_linear_attention(q, k, v, scale=beta, ridge=0.05, window=window, chunk_size=C, backend=backend)
        assert_close(o, ref, 1e-10, f"{backend} vs explicit least squares")


@pytest.mark.parametrize("window", [None, 5])
def test_backends_agree_on_outputs_states_and_gradients(window):
    q, k, v, beta = make(13, seed=2, grad=True)
    compare_backends(lambda be: local_linear_attention(q, k, v, scale=beta, ridge=0.02, window=window, chunk_size=4,
                                                       output_final_state=True, backend=be),
                     {"q": q, "k": k, "v": v, "beta": beta}, 1e-10)


def test_slope_matters_and_huge_ridge_gives_softmax_attention():
    q, k, v, beta = make(15, seed=3)
    soft, _ = softmax_attention(q, k, v, scale=beta, backend="recurrent")
    for backend in ("recurrent", "chunk"):
        ll, _ = local_linear_attention(q, k, v, scale=beta, ridge=1e-2, backend=backend)
        assert (ll - soft).abs().max() > 1e-2  # a real correction at a small ridge
        errs = [(local_linear_attention(q, k, v, scale=beta, ridge=r, backend=backend)[0] - soft).abs().max().item()
                for r in (1e2, 1e4, 1e6)]
        assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-6, errs  # → Σ w_i v_i as O(1/ρ)


@pytest.mark.parametrize("window", [None, 4])
def test_cache_carry_over_split_equals_whole(window):
    q, k, v, beta = make(14, seed=4)
    whole, _ = local_linear_attention(q, k, v, scale=beta, window=window, backend="chunk")
    state, outs = None, []
    for (a, b), backend in zip(((0, 6), (6, 7), (7, 14)), ("chunk", "recurrent", "chunk")):
        o, state = local_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=beta, window=window, chunk_size=4,
                                          initial_state=state, output_final_state=True, backend=backend)
        outs.append(o)
    assert_close(torch.cat(outs, 1), whole, 1e-10, "split vs whole")
    assert state["k"].shape[1] == (14 if window is None else window - 1)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_pads_change_nothing(backend):
    T = 12
    q, k, v, beta = make(T, seed=5)
    mask = left_pad_mask([12, 8], T, holes=[(1, 7), (0, 2)])
    o, state = local_linear_attention(q, k, v, scale=beta, ridge=0.05, window=5, chunk_size=5, mask=mask,
                                      output_final_state=True, backend=backend)
    assert (o[~mask] == 0).all()
    # pads count as positions of the window (as in softmax_attention) but are never keys
    assert_close(o, lstsq_reference(q, k, v, beta, 0.05, window=5, mask=mask), 1e-10, "padded, windowed")
    assert torch.equal(state["mask"], mask[:, -4:]) and (state["k"][~state["mask"]] == 0).all()
    # no window: a padded sample equals the sample alone
    o, _ = local_linear_attention(q, k, v, scale=beta, ridge=0.05, chunk_size=5, mask=mask, backend=backend)
    for b in range(B):
        r = mask[b]
        alone, _ = local_linear_attention(q[b:b + 1, r], k[b:b + 1, r], v[b:b + 1, r], scale=beta, ridge=0.05,
                                          chunk_size=5, backend=backend)
        assert_close(o[b:b + 1, r], alone, 1e-12, f"sample {b} alone")
    assert_close(o, lstsq_reference(q, k, v, beta, 0.05, mask=mask), 1e-10, "padded vs explicit")


@pytest.mark.parametrize("window,per_head_rank", [(None, None), (5, 3)])
def test_blocked_chunk_form_across_key_blocks(monkeypatch, window, per_head_rank):
    """Key blocks of 3 (the running maximum carried across blocks, blocks skipped by the window), query blocks of
    4, ragged T, a cache in front, pads and a hole, an optional per-head low-rank slope: the chunk form equals the
    reference in outputs, final state and the gradients of q, k, v, β, P and the cached keys and values."""
    import lazoo.ops.local_linear as ll

    monkeypatch.setattr(ll, "_KEY_BLOCK", 3)
    g = torch.Generator().manual_seed(6)
    q, k, v, beta = make(11, seed=6, grad=True)
    mask = left_pad_mask([11, 7], 11, holes=[(1, 8)])
    cache = {"k": F.normalize(torch.randn(B, 5, H, D, generator=g, dtype=F64), dim=-1).requires_grad_(),
             "v": torch.randn(B, 5, H, DV, generator=g, dtype=F64).requires_grad_(),
             "mask": torch.tensor([[True] * 5, [False, True, True, False, True]])}
    leaves = {"q": q, "k": k, "v": v, "beta": beta, "cache k": cache["k"], "cache v": cache["v"]}
    P = None
    if per_head_rank:
        P = torch.randn(H, per_head_rank, D, generator=g, dtype=F64).requires_grad_()
        leaves["P"] = P
    compare_backends(lambda be: local_linear_attention(q, k, v, scale=beta, ridge=0.03, window=window, chunk_size=4,
                                                       mask=mask, initial_state=cache, output_final_state=True,
                                                       rank_projection=P, backend=be),
                     leaves, 1e-10)


def test_bad_arguments_are_named():
    q, k, v, beta = make(3)
    with pytest.raises(ValueError, match="ridge"):
        local_linear_attention(q, k, v, scale=beta, ridge=0.0)
    with pytest.raises(ValueError, match="window"):
        local_linear_attention(q, k, v, scale=beta, window=0)
    with pytest.raises(ValueError, match=r"scale.*\[H\]"):
        local_linear_attention(q, k, v, scale=torch.ones(3, dtype=F64))
    with pytest.raises(NotImplementedError, match="triton"):
        local_linear_attention(q, k, v, scale=1.0, backend="triton")
