"""softmax_attention: eager (recurrent) vs SDPA (chunk), a per-query loop, windows, KV cache, pads."""

import math

import pytest
import torch
from op_helpers import assert_close, assert_state_close, compare_backends, left_pad_mask

from lazoo.ops import softmax_attention

F64 = torch.float64
B, H, DK, DV = 3, 2, 6, 5


def make_inputs(T, dtype=F64, b=B, seed=0):
    torch.manual_seed(seed)
    q, k = (torch.randn(b, T, H, DK, dtype=dtype) for _ in range(2))
    v = torch.randn(b, T, H, DV, dtype=dtype)
    return q, k, v


def random_cache(Tc, b=B, dtype=F64):
    mask = torch.ones(b, Tc, dtype=torch.bool)
    mask[1, :2] = False  # a left-padded cached sample
    return {"k": torch.randn(b, Tc, H, DK, dtype=dtype), "v": torch.randn(b, Tc, H, DV, dtype=dtype),
            "mask": mask}


def loop_reference(q, k, v, scale, window, cache, mask):
    """Per-query, per-head loop: o_t = Σ_s softmax_s(scale q_t·k_s) v_s over the visible keys."""
    b_, T = q.shape[:2]
    keys = torch.cat([cache["k"], k], 1) if cache else k
    vals = torch.cat([cache["v"], v], 1) if cache else v
    km = torch.cat([cache["mask"], mask], 1) if cache else mask
    Tc = keys.shape[1] - T
    o = torch.zeros(b_, T, H, DV, dtype=q.dtype)
    for b in range(b_):
        for h in range(H):
            for t in range(T):
                p = Tc + t
                if not mask[b, t]:
                    continue
                seen = [s for s in range(p + 1) if km[b, s] and (window is None or s > p - window)]
                logits = torch.stack([scale * q[b, t, h] @ keys[b, s, h] for s in seen])
                w = torch.softmax(logits, 0)
                o[b, t, h] = sum(wi * vals[b, s, h] for wi, s in zip(w, seen))
    return o


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 4])
def test_softmax_matches_per_query_loop(backend, window):
    T = 9
    q, k, v = make_inputs(T)
    cache = random_cache(5)
    mask = left_pad_mask([9, 6, 1], T, holes=[(0, 3)])
    o, _ = softmax_attention(q, k, v, window=window, initial_state=cache, mask=mask, backend=backend)
    ref = loop_reference(q, k, v, DK ** -0.5, window, cache, mask)
    assert_close(o, ref, 1e-12, "output vs loop")


@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_softmax_chunk_matches_recurrent_with_grads(T, window, padded, cached):
    q, k, v = make_inputs(T)
    cache = random_cache(7) if cached else None
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)]) if padded else None
    scale = torch.rand(H, dtype=F64) + 0.5  # a per-head learned scale (QK-norm style)
    leaves = {"q": q, "k": k, "v": v, "scale": scale}
    if cached:
        leaves.update(cache_k=cache["k"], cache_v=cache["v"])
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return softmax_attention(q, k, v, scale=scale, window=window, initial_state=cache,
                                 output_final_state=True, mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_softmax_pad_query_gives_zero_and_no_nan(backend):
    T = 6
    q, k, v = make_inputs(T)
    mask = left_pad_mask([6, 2, 0], T)  # sample 2 is all padding: its rows see no key at all
    for x in (q, k, v):
        x.requires_grad_(True)
    o, _ = softmax_attention(q, k, v, mask=mask, backend=backend, window=3)
    assert torch.isfinite(o).all()
    assert torch.all(o[~mask] == 0) and o[mask].abs().min() > 0
    gq, gk, gv = torch.autograd.grad(o.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
    assert torch.all(gq[2] == 0)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 4])
def test_softmax_left_padded_batch_equals_samples_one_by_one(backend, window):
    T, lengths = 12, [12, 8, 3]
    q, k, v = make_inputs(T)
    q2, k2, v2 = make_inputs(2, seed=1)  # a continuation step after the prefix
    mask = left_pad_mask(lengths, T)
    o, s = softmax_attention(q, k, v, mask=mask, window=window, output_final_state=True, backend=backend)
    o_next, _ = softmax_attention(q2, k2, v2, window=window, initial_state=s, backend=backend)
    for b, n in enumerate(lengths):
        ob, sb = softmax_attention(q[b:b + 1, T - n:], k[b:b + 1, T - n:], v[b:b + 1, T - n:],
                                   window=window, output_final_state=True, backend=backend)
        assert_close(o[b:b + 1, T - n:], ob, 1e-12, f"sample {b} output")
        # The cache keeps the pads (masked out); its real entries equal the unpadded cache.
        real = s["mask"][b]
        assert_close(s["k"][b, real], sb["k"][0], 0.0, f"sample {b} cached keys")
        ob_next, _ = softmax_attention(q2[b:b + 1], k2[b:b + 1], v2[b:b + 1], window=window,
                                       initial_state=sb, backend=backend)
        assert_close(o_next[b:b + 1], ob_next, 1e-12, f"sample {b} continuation")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 5])
def test_softmax_split_sequence_equals_one_pass(backend, window):
    T, cut = 17, 7
    q, k, v = make_inputs(T)
    mask = left_pad_mask([T, T - 3, T - 9], T)
    kw = dict(window=window, output_final_state=True, backend=backend)
    o, s = softmax_attention(q, k, v, mask=mask, **kw)
    o1, s1 = softmax_attention(q[:, :cut], k[:, :cut], v[:, :cut], mask=mask[:, :cut], **kw)
    o2, s2 = softmax_attention(q[:, cut:], k[:, cut:], v[:, cut:], mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_state_close(s2, s, 0.0, "split final state")
    if window is not None:
        assert s["k"].shape[1] == window - 1


def test_softmax_window_one_sees_only_itself():
    q, k, v = make_inputs(5)
    o, s = softmax_attention(q, k, v, window=1, output_final_state=True)
    assert_close(o, v, 1e-12, "window 1 output")
    assert s["k"].shape[1] == 0


def test_softmax_scalar_scale_and_dtypes():
    q, k, v = make_inputs(11)
    o_default, _ = softmax_attention(q, k, v, backend="recurrent")
    o_scaled, _ = softmax_attention(q * math.sqrt(DK) * 0.7, k, v, scale=DK ** -0.5 / 0.7 * DK ** -0.5,
                                    backend="chunk")
    assert_close(o_scaled, o_default, 1e-12, "explicit scale")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        o, s = softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), output_final_state=True)
        # SDPA (the default "chunk" backend) keeps the input dtype, cache included
        assert o.dtype == dtype and s["k"].dtype == dtype
        assert_close(o, o_default, tol, f"{dtype}")


def test_softmax_bad_inputs():
    q, k, v = make_inputs(4)
    with pytest.raises(ValueError, match="window"):
        softmax_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match=r"scale must have shape \[H\]"):
        softmax_attention(q, k, v, scale=torch.ones(H + 1, dtype=F64))
    with pytest.raises(ValueError, match=r"initial_state\['v'\]"):
        cache = random_cache(3)
        cache["v"] = cache["v"][:, :2]
        softmax_attention(q, k, v, initial_state=cache)
    with pytest.raises(ValueError, match=r"initial_state\['mask'\]"):
        cache = random_cache(3)
        cache["mask"] = cache["mask"][:, :2]
        softmax_attention(q, k, v, initial_state=cache)


@pytest.mark.parametrize("T,window", [(24, 4), (23, 4), (11, 5), (40, 13)])
def test_sliding_window_blocks_match_loop_with_grads(T, window):
    """Long windowed inputs take SDPA over blocks of W queries (T > 2W): equal to the per-query loop, and its
    gradients to the eager (recurrent) backend's, at T a multiple of W and not."""
    q, k, v = make_inputs(T, seed=T)
    o, _ = softmax_attention(q, k, v, window=window, backend="chunk")
    ref = loop_reference(q, k, v, DK ** -0.5, window, None, torch.ones(B, T, dtype=torch.bool))
    assert_close(o, ref, 1e-12, "windowed blocks vs loop")
    leaves = {"q": q, "k": k, "v": v}
    for x in leaves.values():
        x.requires_grad_(True)
    compare_backends(
        lambda backend: softmax_attention(q, k, v, window=window, backend=backend, output_final_state=True),
        leaves, rtol=1e-10)


def grouped_loop_reference(q, k, v, scale, window, cache, mask):
    """The per-query loop with grouped key/value heads: query head h reads key/value head h // (H // Hkv)."""
    b_, T, Hq = q.shape[:3]
    groups = Hq // k.shape[2]
    keys, vals, km = (torch.cat([cache[n], x], 1) for n, x in (("k", k), ("v", v), ("mask", mask)))
    Tc = keys.shape[1] - T
    o = torch.zeros(b_, T, Hq, v.shape[-1], dtype=q.dtype)
    for b in range(b_):
        for h in range(Hq):
            for t in range(T):
                p = Tc + t
                if not mask[b, t]:
                    continue
                seen = [s for s in range(p + 1) if km[b, s] and (window is None or s > p - window)]
                w = torch.softmax(torch.stack([scale * q[b, t, h] @ keys[b, s, h // groups] for s in seen]), 0)
                o[b, t, h] = sum(wi * vals[b, s, h // groups] for wi, s in zip(w, seen))
    return o


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 4])
def test_grouped_kv_heads_match_the_loop_and_keep_a_compact_state(backend, window):
    """k and v with Hkv < H heads (grouped-query attention): the loop's output with head h reading head h // (H //
    Hkv), a state of Hkv heads that continues the sequence, and the same numbers as repeated heads."""
    T, Hq = 9, 2 * H
    torch.manual_seed(3)
    q = torch.randn(B, T, Hq, DK, dtype=F64)
    q2 = torch.randn(B, 2, Hq, DK, dtype=F64)
    k, v, k2, v2 = make_inputs(T)[1:] + make_inputs(2, seed=4)[1:]
    cache = random_cache(5)
    mask = left_pad_mask([9, 6, 1], T)
    o, s = softmax_attention(q, k, v, window=window, initial_state=cache, mask=mask, output_final_state=True,
                             backend=backend)
    assert_close(o, grouped_loop_reference(q, k, v, DK ** -0.5, window, cache, mask), 1e-12, "grouped vs loop")
    kept = 5 + T if window is None else window - 1
    assert s["k"].shape == (B, kept, H, DK) and s["v"].shape == (B, kept, H, DV)
    o2, _ = softmax_attention(q2, k2, v2, window=window, initial_state=s, backend=backend)
    rep = {name: (x.repeat_interleave(2, 2) if name != "mask" else x) for name, x in s.items()}
    o2_rep, _ = softmax_attention(q2, k2.repeat_interleave(2, 2), v2.repeat_interleave(2, 2), window=window,
                                  initial_state=rep, backend=backend)
    assert_close(o2, o2_rep, 1e-12, "continuation from the compact state vs repeated heads")


@pytest.mark.parametrize("T,window", [(37, None), (37, 5), (1, None)])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_kv_heads_chunk_matches_recurrent_with_grads(T, window, padded):
    """Every path of the chunk backend (plain causal SDPA, windowed blocks, masked SDPA) with grouped heads: outputs,
    the compact final state and the gradients (of k and v summed over the query heads of a group)."""
    torch.manual_seed(T)
    q = torch.randn(B, T, 3 * H, DK, dtype=F64, requires_grad=True)
    k, v = (x.requires_grad_(True) for x in make_inputs(T, seed=T)[1:])
    scale = torch.rand(3 * H, dtype=F64, requires_grad=True)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T) if padded else None
    compare_backends(lambda backend: softmax_attention(q, k, v, scale=scale, window=window, mask=mask,
                                                       output_final_state=True, backend=backend),
                     {"q": q, "k": k, "v": v, "scale": scale}, rtol=1e-10)


def test_grouped_kv_heads_bad_inputs():
    q, k, v = make_inputs(4)
    q3 = torch.randn(B, 4, 3, DK, dtype=F64)  # 3 query heads: H = 2 key/value heads do not divide them
    with pytest.raises(ValueError, match=r"k must have shape .*Hkv dividing H"):
        softmax_attention(q3, k, v)
    with pytest.raises(ValueError, match=r"v must have shape .*like k \(1 key/value heads\)"):
        softmax_attention(torch.cat([q, q], 2), k[:, :, :1], v)
    with pytest.raises(ValueError, match=r"initial_state\['k'\]"):  # a cache of repeated heads for a grouped call
        cache = {name: (x.repeat_interleave(2, 2) if name != "mask" else x) for name, x in random_cache(3).items()}
        softmax_attention(torch.cat([q, q], 2), k, v, initial_state=cache)


@pytest.mark.parametrize("window", [None, 4])
def test_attention_weights_are_the_per_query_softmax_the_output_is_made_of(window):
    """output_attentions=True: weights [B, H, T, Tc + T], each real query's row the softmax over its visible keys
    (a row of 0 for a pad), and the same output and final state as without them (here against SDPA)."""
    T, Tc = 9, 5
    q, k, v = make_inputs(T, seed=3)
    cache = random_cache(Tc)
    mask = left_pad_mask([9, 6, 1], T, holes=[(0, 3)])
    o, state, weights = softmax_attention(q, k, v, window=window, initial_state=cache, mask=mask, backend="chunk",
                                          output_final_state=True, output_attentions=True)
    o_ref, state_ref = softmax_attention(q, k, v, window=window, initial_state=cache, mask=mask, backend="chunk",
                                         output_final_state=True)
    assert_close(o, o_ref, 1e-12, "output with weights vs without")
    assert_state_close(state, state_ref, 0.0, "final state")
    assert weights.shape == (B, H, T, Tc + T)
    keys_mask = torch.cat([cache["mask"], mask], 1)
    for b in range(B):
        for t in range(T):
            row = weights[b, :, t]
            if not mask[b, t]:
                assert torch.equal(row, torch.zeros_like(row)), f"pad query {b, t} has weights"
                continue
            p = Tc + t
            seen = [s for s in range(p + 1) if keys_mask[b, s] and (window is None or s > p - window)]
            logits = DK ** -0.5 * torch.einsum("hd,shd->hs", q[b, t], torch.cat([cache["k"], k], 1)[b, seen])
            assert_close(row[:, seen], torch.softmax(logits, -1), 1e-12, f"row {b, t}")
            others = [s for s in range(Tc + T) if s not in seen]
            assert torch.equal(row[:, others], torch.zeros_like(row[:, others])), f"row {b, t}: unseen keys weighted"
