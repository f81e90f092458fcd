"""OVQ attention ("Online Vector Quantized Attention", §3.2, §8.3) and VQ-attention: the per-token reference vs the
chunk form, state carry-over, padding, the pinned growth schedule, and independent checks (plain softmax attention
on the first chunk, a hand-built second chunk, the count-weighted mean invariant, the quadratic form of VQ)."""

import math

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, compare_backends, left_pad_mask

from lazoo.ops import ovq_attention, ovq_dict_size, softmax_attention, vq_attention

F64 = torch.float64
B, H, D, DV = 3, 2, 6, 5


def make(T, b=B, seed=0, dtype=F64, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(b, T, H, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, T, H, DV, generator=g, dtype=dtype)
    beta = torch.tensor([2.0, 3.5], dtype=dtype)
    if grad:
        for x in (q, k, v, beta):
            x.requires_grad_()
    return q, k, v, beta


def run(q, k, v, beta, L=4, N=7, backend="chunk", **kw):
    return ovq_attention(q, k, v, scale=beta, chunk_size=L, max_dict_size=N, output_final_state=True,
                         backend=backend, **kw)


def sizes(state):
    return (state["counts"] > 0).sum(-1)


# ----------------------------------------------------------------------------- the two forms
@pytest.mark.parametrize("T,L,N", [(1, 4, 7), (13, 4, 7), (23, 5, 9), (17, 3, 2)])
def test_recurrent_equals_chunk_float64_outputs_states_grads(T, L, N):
    q, k, v, beta = make(T, grad=True)
    compare_backends(lambda b: run(q, k, v, beta, L, N, backend=b), dict(q=q, k=k, v=v, beta=beta), 1e-11,
                     backends=("chunk", "recurrent"))


def test_recurrent_equals_chunk_from_a_state_with_a_partial_chunk_and_padding():
    q0, k0, v0, beta = make(10, seed=1)
    _, state = run(q0, k0, v0, beta, mask=left_pad_mask([10, 6, 3], 10))  # t = 10, 6, 3: partial chunks differ
    q, k, v, _ = make(15, seed=2, grad=True)
    mask = left_pad_mask([15, 9, 12], 15, holes=[(0, 4), (2, 7)])
    compare_backends(lambda b: run(q, k, v, beta, initial_state=state, mask=mask, backend=b),
                     dict(q=q, k=k, v=v), 1e-11, backends=("chunk", "recurrent"))


def test_float32_forms_agree():
    q, k, v, beta = make(29, dtype=torch.float32)
    o1, s1 = run(q, k, v, beta, backend="chunk")
    o2, s2 = run(q, k, v, beta, backend="recurrent")
    assert o1.dtype == torch.float32 and s1["Dk"].dtype == torch.float32 and s1["counts"].dtype == torch.int64
    assert_close(o1, o2, 1e-5, "fp32 output")
    assert_state_close(s1, s2, 1e-5, "fp32 state")


# ----------------------------------------------------------------------------- independent checks
def test_first_chunk_is_plain_causal_softmax_attention():
    q, k, v, beta = make(6)
    for backend in ("chunk", "recurrent"):
        o, _ = run(q, k, v, beta, L=8, backend=backend)
        ref, _ = softmax_attention(q, k, v, scale=beta, backend="recurrent")
        assert_close(o, ref, 1e-13, f"first chunk ({backend})")


def _second_chunk_by_hand(q, k, v, beta, L, N):
    """Per sample and head: chunk 1 attends to itself; its first n = N_L keys become centroids and the
    others join their most similar one (running mean); chunk 2 attends to [D (log counts); chunk 2]."""
    n = ovq_dict_size(L, N)
    out = torch.zeros(q.shape[0], 2 * L, H, DV, dtype=q.dtype)
    for b in range(q.shape[0]):
        for h in range(H):
            K, V, Q = k[b, :, h], v[b, :, h], q[b, :, h] * beta[h]
            Dk, Dv, c = [K[i].clone() for i in range(n)], [V[i].clone() for i in range(n)], [1] * n
            for i in range(n, L):
                j = max(range(n), key=lambda j: float(K[i] @ K[j]))  # nearest new centroid (its key)
                c[j] += 1
                Dk[j] = Dk[j] + (K[i] - Dk[j]) / c[j]
                Dv[j] = Dv[j] + (V[i] - Dv[j]) / c[j]
            for t in range(2 * L):
                if t < L:
                    keys, vals, bias = K[:t + 1], V[:t + 1], torch.zeros(t + 1, dtype=q.dtype)
                else:
                    keys = torch.cat([torch.stack(Dk), K[L:t + 1]])
                    vals = torch.cat([torch.stack(Dv), V[L:t + 1]])
                    bias = torch.cat([torch.tensor(c, dtype=q.dtype).log(), torch.zeros(t + 1 - L, dtype=q.dtype)])
                out[b, t, h] = torch.softmax(keys @ Q[t] + bias, 0) @ vals
    return out


def test_second_chunk_against_a_hand_built_dictionary():
    L, N = 5, 6  # N_5 = floor(30 / 11) = 2 centroids from the first chunk, 3 keys merged into them
    q, k, v, beta = make(2 * L)
    ref = _second_chunk_by_hand(q, k, v, beta, L, N)
    for backend in ("chunk", "recurrent"):
        o, _ = run(q, k, v, beta, L, N, backend=backend)
        assert_close(o, ref, 1e-12, f"two chunks ({backend})")


def test_dictionary_growth_follows_N_t_and_counts_are_exact_means():
    L, N, T = 4, 10, 61
    q, k, v, beta = make(T)
    for backend in ("chunk", "recurrent"):
        seen = []
        for stop in range(1, T + 1, 5):
            _, s = run(q[:, :stop], k[:, :stop], v[:, :stop], beta, L, N, backend=backend)
            flushed = (stop // L) * L
            assert (sizes(s) == ovq_dict_size(flushed, N)).all(), (stop, sizes(s))
            assert (s["counts"].sum(-1) == flushed).all()
            seen.append(int(sizes(s)[0, 0]))
            # every flushed key/value sits in exactly one centroid, as an exact running mean
            if flushed:
                sum_k = (s["counts"][..., None] * s["Dk"]).sum(2)
                sum_v = (s["counts"][..., None] * s["Dv"]).sum(2)
                assert_close(sum_k, k[:, :flushed].sum(1), 1e-12, f"Σ c·μ_k ({backend})")
                assert_close(sum_v, v[:, :flushed].sum(1), 1e-12, f"Σ c·μ_v ({backend})")
            assert (s["t"] == stop).all()
            assert s["Dk"].shape[2] == N  # capacity = max_dict_size: O(N·d) whatever T
        assert seen == sorted(seen)
    # the schedule itself: floor(tN/(t+N)), at least 1, below N, never shrinking
    assert [ovq_dict_size(t, 2048) for t in (0, 128, 256, 1 << 20)] == [0, 120, 227, 2044]
    assert ovq_dict_size(1, 1) == 1 and ovq_dict_size(10 ** 6, 1) == 1
    t = torch.arange(0, 5000, 128)
    assert torch.equal(ovq_dict_size(t, 2048), torch.tensor([ovq_dict_size(int(x), 2048) for x in t]))


def test_gradients_flow_through_the_dictionaries():
    q, k, v, beta = make(16, grad=True)
    o, _ = run(q, k, v, beta, L=4, N=6)
    o[:, 12:].sum().backward()  # the last chunk only reads chunks 1-3 through D_k, D_v
    assert k.grad[:, :12].abs().sum() > 0 and v.grad[:, :12].abs().sum() > 0
    assert k.grad[:, 12:].abs().sum() > 0


# ----------------------------------------------------------------------------- state and padding
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_split_sequence_equals_whole(backend):
    q, k, v, beta = make(27)
    whole, s_whole = run(q, k, v, beta, backend=backend)
    state, outs = None, []
    for a, b in ((0, 6), (6, 7), (7, 18), (18, 27)):  # pieces that start and end inside chunks
        o, state = run(q[:, a:b], k[:, a:b], v[:, a:b], beta, initial_state=state, backend=backend)
        outs.append(o)
    assert_close(torch.cat(outs, 1), whole, 1e-12, "split output")
    assert_state_close(state, s_whole, 1e-12, "split state")


def test_token_by_token_decoding_equals_whole():
    q, k, v, beta = make(21)
    whole, s_whole = run(q, k, v, beta)
    o, state = run(q[:, :9], k[:, :9], v[:, :9], beta)
    outs = [o]
    for t in range(9, 21):
        o, state = run(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta, initial_state=state)
        outs.append(o)
    assert_close(torch.cat(outs, 1), whole, 1e-12, "decoded output")
    assert_state_close(state, s_whole, 1e-12, "decoded state")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_left_padding_and_holes_equal_each_sample_alone(backend):
    T, lengths = 19, [19, 11, 6]
    q, k, v, beta = make(T)
    mask = left_pad_mask(lengths, T, holes=[(0, 5), (0, 12), (1, 15)])
    o, s = run(q, k, v, beta, mask=mask, backend=backend)
    for b in range(B):
        m = mask[b]
        ob, sb = run(q[b:b + 1, m], k[b:b + 1, m], v[b:b + 1, m], beta, backend=backend)
        assert_close(o[b, m], ob[0], 1e-12, f"sample {b}")
        assert (o[b, ~m] == 0).all()
        assert_state_close({n: x[b:b + 1] for n, x in s.items()}, sb, 1e-12, f"state {b}")
    # the pad contents do not matter
    q2 = torch.where(mask[:, :, None, None], q, torch.randn_like(q))
    assert torch.equal(run(q2, k, v, beta, mask=mask, backend=backend)[0], o)


# ----------------------------------------------------------------------------- max_dict_size at inference
def test_max_dict_size_can_change_between_calls():
    L, T = 4, 40
    q, k, v, beta = make(T)
    _, s8 = run(q[:, :20], k[:, :20], v[:, :20], beta, L, 8)
    assert (sizes(s8) == ovq_dict_size(20, 8)).all()  # 5 centroids
    # a larger budget: capacity grows, growth catches up with N_t under the new N at the next chunk end
    o32, s32 = run(q[:, 20:], k[:, 20:], v[:, 20:], beta, L, 32, initial_state=s8)
    assert s32["Dk"].shape[2] == 32 and (sizes(s32) == ovq_dict_size(40, 32)).all()
    o8, s8b = run(q[:, 20:], k[:, 20:], v[:, 20:], beta, L, 8, initial_state=s8)
    assert (sizes(s8b) == ovq_dict_size(40, 8)).all()
    assert not torch.allclose(o32[:, 4:], o8[:, 4:])  # after the next chunk end the budgets differ
    assert_close(o32[:, :4], o8[:, :4], 1e-13, "same dictionary until the next update")
    # a smaller budget than the current size: nothing is added or dropped
    _, s3 = run(q[:, 20:], k[:, 20:], v[:, 20:], beta, L, 3, initial_state=s8)
    assert (sizes(s3) == sizes(s8)).all() and s3["Dk"].shape[2] == 5
    assert (s3["counts"].sum(-1) == 40).all()
    # both forms agree on the changed budget
    o_rec, s_rec = run(q[:, 20:], k[:, 20:], v[:, 20:], beta, L, 32, initial_state=s8, backend="recurrent")
    assert_close(o_rec, o32, 1e-12, "recurrent with a new budget")
    assert_state_close(s_rec, s32, 1e-12, "recurrent state with a new budget")


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise_clear_errors():
    q, k, v, beta = make(5)
    _, s = run(q, k, v, beta, L=4)
    with pytest.raises(ValueError, match="chunk_size"):
        run(q, k, v, beta, L=5, initial_state=s)
    with pytest.raises(ValueError, match="max_dict_size"):
        run(q, k, v, beta, N=0)
    with pytest.raises(NotImplementedError, match="triton"):
        run(q, k, v, beta, backend="triton")
    with pytest.raises(ValueError, match="keys"):
        run(q, k, v, beta, initial_state={"Dk": s["Dk"]})
    bad = dict(s, Dk=s["Dk"].clone().fill_(math.nan))
    with pytest.raises(ValueError, match=r"initial_state\['Dk'\] holds NaN"):
        run(q, k, v, beta, initial_state=bad)
    bad_v = s["Dv"].clone()
    bad_v[0, 0, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"initial_state\['Dv'\] holds NaN or inf"):
        run(q, k, v, beta, initial_state=dict(s, Dv=bad_v))
    bad_counts = s["counts"].clone()
    bad_counts[0, 0, 0] = -1
    with pytest.raises(ValueError, match=r"initial_state\['counts'\] must be >= 0"):
        run(q, k, v, beta, initial_state=dict(s, counts=bad_counts))
    with pytest.raises(ValueError, match="shape"):
        vq_attention(q, k, v, torch.randn(H + 1, 4, D, dtype=F64))


# ----------------------------------------------------------------------------- VQ-attention
def vq_run(q, k, v, beta, cb, backend="chunk", C=4, **kw):
    return vq_attention(q, k, v, cb, scale=beta, chunk_size=C, output_final_state=True, backend=backend, **kw)


def codebook(n=5, seed=3, grad=False):
    g = torch.Generator().manual_seed(seed)
    cb = F.normalize(torch.randn(H, n, D, generator=g, dtype=F64), dim=-1)
    return cb.requires_grad_() if grad else cb


def test_vq_recurrent_equals_chunk_and_the_quadratic_form():
    q, k, v, beta = make(19, grad=True)
    cb = codebook(grad=True)
    compare_backends(lambda b: vq_run(q, k, v, beta, cb, backend=b), dict(q=q, v=v, beta=beta, cb=cb), 1e-11,
                     backends=("chunk", "recurrent"))
    # quadratic form: causal softmax attention over the keys replaced by their nearest code
    idx = torch.einsum("bthd,hnd->bthn", k, cb).argmax(-1)
    k_hat = cb.detach()[torch.arange(H)[None, None], idx]
    ref, _ = softmax_attention(q.detach(), k_hat, v.detach(), scale=beta.detach(), backend="recurrent")
    o, s = vq_run(q.detach(), k, v.detach(), beta.detach(), cb.detach())
    assert_close(o, ref, 1e-12, "VQ linear form vs quadratic form")
    assert (s["counts"].sum(-1) == 19).all()


def test_vq_split_padding_and_decoding():
    q, k, v, beta = make(14)
    cb = codebook()
    whole, s_whole = vq_run(q, k, v, beta, cb)
    o1, s1 = vq_run(q[:, :5], k[:, :5], v[:, :5], beta, cb)
    o2, s2 = vq_run(q[:, 5:], k[:, 5:], v[:, 5:], beta, cb, initial_state=s1)
    assert_close(torch.cat([o1, o2], 1), whole, 1e-12, "VQ split")
    assert_state_close(s2, s_whole, 1e-12, "VQ split state")
    mask = left_pad_mask([14, 8, 3], 14, holes=[(0, 9)])
    for backend in ("chunk", "recurrent"):
        o, s = vq_run(q, k, v, beta, cb, backend=backend, mask=mask)
        for b in range(B):
            m = mask[b]
            ob, _ = vq_run(q[b:b + 1, m], k[b:b + 1, m], v[b:b + 1, m], beta, cb, backend=backend)
            assert_close(o[b, m], ob[0], 1e-12, f"VQ sample {b} ({backend})")


# ----------------------------------------------------------------------------- model level
def test_model_reads_max_dict_size_at_forward_time_and_caches_the_op_state(tmp_path):
    from conftest import random_ids, tiny_model
    from transformers import AutoModelForCausalLM

    model = tiny_model("ovq")  # chunk_size 4, max_dict_size 12
    ids = random_ids(2, 40, seed=5)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        state = out.past_key_values.states[0]["op"]
        assert set(state) == {"Dk", "Dv", "counts", "k", "v", "t"} and state["Dk"].shape[2] == 12
        assert (sizes(state) == ovq_dict_size(40, 12)).all()
        model.config.max_dict_size = 32  # a bigger memory budget at inference, no reload
        bigger = model(ids, use_cache=True)
        assert bigger.past_key_values.states[0]["op"]["Dk"].shape[2] == 32
        assert_close(bigger.logits[:, :4], out.logits[:, :4], 1e-6, "first chunk (no dictionary yet)")
        assert not torch.allclose(bigger.logits[:, 8:], out.logits[:, 8:], atol=1e-4)
        model.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert loaded.config.max_dict_size == 32
        assert torch.equal(loaded(ids).logits, bigger.logits)
        loaded.config.mixer_kwargs = {"ovq": {"max_dict_size": 12}}  # mixer_kwargs win over the typed field
        assert_close(loaded(ids).logits, out.logits, 1e-6, "back to 12 through mixer_kwargs")


def test_ovq_paper_hybrid_presets():
    from lazoo.presets import build_config

    nope = build_config("sw-nope", num_hidden_layers=4, mixer_kwargs={"softmax": {"rope_theta": 500.0}})
    assert nope.layer_types == ["sliding_window", "softmax"] * 2 and nope.sliding_window == 128
    softmax = nope.mixer_options("softmax")  # the preset's NoPE + QK-norm, merged with the caller's option
    assert softmax["use_rope"] is False and softmax["qk_norm"] is True and softmax["rope_theta"] == 500.0
    assert nope.mixer_options("sliding_window")["use_rope"] and nope.mixer_options("sliding_window")["qk_norm"]
    assert build_config("sw-ovq").layer_types == ["sliding_window", "ovq"] * 2
    assert build_config("sw-vq").layer_types == ["sliding_window", "vq"] * 2
    assert build_config("gdn-ovq", num_hidden_layers=2).layer_types == ["gated_delta_net", "ovq"]
