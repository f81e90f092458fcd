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
