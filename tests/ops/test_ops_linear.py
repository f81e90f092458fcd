"""linear_attention and gated_linear_attention: recurrent vs chunk, quadratic form, pads, splits, grouped heads."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import (
    assert_close,
    assert_state_close,
    check_against,
    compare_backends,
    left_pad_mask,
    needs_interpreter,
)

from lazoo.ops import gated_linear_attention, linear_attention

F64 = torch.float64
B, H, DK, DV = 3, 2, 6, 5


def make_inputs(T, dtype=F64, b=B, seed=0):
    torch.manual_seed(seed)
    q, k = (torch.randn(b, T, H, DK, dtype=dtype) for _ in range(2))
    v = torch.randn(b, T, H, DV, dtype=dtype)
    g = F.logsigmoid(torch.randn(b, T, H, dtype=dtype) + 2)  # log decay in (-inf, 0)
    return q, k, v, g


def random_state(normalize, b=B, dtype=F64):
    S = torch.randn(b, H, DV, DK, dtype=dtype)
    return {"S": S, "z": torch.rand(b, H, DK, dtype=dtype) * 3} if normalize else S


def state_leaves(state):
    return {"S0": state["S"], "z0": state["z"]} if isinstance(state, dict) else {"S0": state}


# ----------------------------------------------------------------------------- linear attention
@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("feature_map,normalize", [("elu1", True), ("relu", True), ("identity", False)])
def test_linear_chunk_matches_recurrent_with_grads(T, padded, feature_map, normalize):
    q, k, v, _ = make_inputs(T)
    state = random_state(normalize)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)]) if padded else None
    leaves = {"q": q, "k": k, "v": v, **state_leaves(state)}
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return linear_attention(q, k, v, feature_map=feature_map, normalize=normalize, chunk_size=16,
                                initial_state=state, output_final_state=True, mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_linear_equals_quadratic_form(backend):
    T = 23
    q, k, v, _ = make_inputs(T)
    o, _ = linear_attention(q, k, v, backend=backend, chunk_size=8)
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    kernel = torch.einsum("bthd,bshd->bhts", fq, fk).tril()  # φ(q_t)·φ(k_s), s <= t
    ref = torch.einsum("bhts,bshv->bthv", kernel, v) / kernel.sum(-1).transpose(1, 2)[..., None]
    assert_close(o, ref, 1e-12, "linear vs quadratic")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_left_padded_batch_equals_samples_one_by_one(backend, normalize):
    T, lengths = 21, [21, 14, 5]
    q, k, v, _ = make_inputs(T)
    state = random_state(normalize)
    mask = left_pad_mask(lengths, T)
    kw = dict(normalize=normalize, output_final_state=True, backend=backend, chunk_size=8)
    o, s = linear_attention(q, k, v, mask=mask, initial_state=state, **kw)
    assert torch.all(o[~mask] == 0)
    for b, n in enumerate(lengths):
        one = {key: x[b:b + 1] for key, x in state.items()} if normalize else state[b:b + 1]
        ob, sb = linear_attention(q[b:b + 1, T - n:], k[b:b + 1, T - n:], v[b:b + 1, T - n:],
                                  initial_state=one, **kw)
        assert_close(o[b:b + 1, T - n:], ob, 1e-12, f"sample {b} output")
        s_b = {key: x[b:b + 1] for key, x in s.items()} if normalize else s[b:b + 1]
        assert_state_close(s_b, sb, 1e-12, f"sample {b} state")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_linear_split_sequence_equals_one_pass(backend):
    T, cut = 29, 11
    q, k, v, _ = make_inputs(T)
    mask = left_pad_mask([T, T - 3, T - 17], T)
    kw = dict(output_final_state=True, backend=backend, chunk_size=8)
    o, s = linear_attention(q, k, v, mask=mask, **kw)
    o1, s1 = linear_attention(q[:, :cut], k[:, :cut], v[:, :cut], mask=mask[:, :cut], **kw)
    o2, s2 = linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_state_close(s2, s, 1e-12, "split final state")


def test_linear_denominator_clamp_and_unknown_feature_map():
    q, k, v, _ = make_inputs(6)
    # identity features make φ(q)·z negative somewhere; the clamp keeps the output finite.
    for backend in ("recurrent", "chunk"):
        o, _ = linear_attention(q, k, v, feature_map="identity", normalize=True, eps=1e-3, backend=backend)
        assert torch.isfinite(o).all()
    with pytest.raises(ValueError, match=r"unknown feature_map 'softplus'.*elu1"):
        linear_attention(q, k, v, feature_map="softplus")
    with pytest.raises(TypeError, match="dict"):
        linear_attention(q, k, v, initial_state=random_state(False))
    with pytest.raises(ValueError, match=r"initial_state\['z'\]"):
        bad = random_state(True)
        bad["z"] = bad["z"][..., :-1]
        linear_attention(q, k, v, initial_state=bad)


# ----------------------------------------------------------------------------- gated linear
@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_gla_chunk_matches_recurrent_with_grads(T, padded):
    q, k, v, g = make_inputs(T)
    S0 = random_state(False)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)]) if padded else None
    leaves = {"q": q, "k": k, "v": v, "g": g, "S0": S0}
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return gated_linear_attention(q, k, v, g, chunk_size=16, initial_state=S0, output_final_state=True,
                                      mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


def test_gla_matches_closed_form():
    # o_t = Σ_{s<=t} exp(Σ_{s<r<=t} g_r) (scale q_t·k_s) v_s + exp(Σ_{r<=t} g_r) S0 (scale q_t)
    T = 19
    q, k, v, g = make_inputs(T)
    S0 = random_state(False)
    G = g.cumsum(1).transpose(1, 2)  # [B, H, T]
    decay = (G[..., :, None] - G[..., None, :]).tril().exp().tril()
    scores = torch.einsum("bthd,bshd->bhts", q, k) * DK ** -0.5 * decay
    ref = torch.einsum("bhts,bshv->bthv", scores, v)
    ref = ref + torch.einsum("bhvk,bthk->bthv", S0, q * DK ** -0.5) * G.exp().transpose(1, 2)[..., None]
    o, _ = gated_linear_attention(q, k, v, g, initial_state=S0, chunk_size=8)
    assert_close(o, ref, 1e-12, "gla vs closed form")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_gla_left_padded_batch_and_split(backend):
    T, lengths, cut = 21, [21, 14, 5], 9
    q, k, v, g = make_inputs(T)
    mask = left_pad_mask(lengths, T)
    kw = dict(output_final_state=True, backend=backend, chunk_size=8)
    o, s = gated_linear_attention(q, k, v, g, mask=mask, **kw)
    for b, n in enumerate(lengths):
        sl = (slice(b, b + 1), slice(T - n, None))
        ob, sb = gated_linear_attention(q[sl], k[sl], v[sl], g[sl], **kw)
        assert_close(o[sl], ob, 1e-12, f"sample {b} output")
        assert_close(s[b:b + 1], sb, 1e-12, f"sample {b} state")
    o1, s1 = gated_linear_attention(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], mask=mask[:, :cut], **kw)
    o2, s2 = gated_linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], mask=mask[:, cut:],
                                    initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_close(s2, s, 1e-12, "split state")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_heads_equal_repeated_query_key_heads(backend, packed):
    """q and k with 2 heads serving v's and g's 6 (3 each): the same as q and k repeated to the 6 heads, gradients
    summed over each group; with left padding and a hole, or packed sequences, and a carried state."""
    T, HK, m = 21, 2, 3
    torch.manual_seed(5)
    q, k = (torch.randn(B, T, HK, DK, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, HK * m, DV, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, HK * m, dtype=F64) + 2)
    S0 = torch.randn(B, HK * m, DV, DK, dtype=F64)
    kw = dict(output_final_state=True, backend=backend, chunk_size=8)
    if packed:
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        kw["cu_seqlens"] = torch.tensor([0, 7, 7 + T, B * T])
    else:
        kw["mask"] = left_pad_mask([T, T - 6, T - 13], T, holes=[(0, 9)])
    leaves = {"q": q, "k": k, "v": v, "g": g, "S0": S0}
    for x in leaves.values():
        x.requires_grad_(True)
    check_against(lambda: gated_linear_attention(q, k, v, g, initial_state=S0, **kw),
                  lambda: gated_linear_attention(q.repeat_interleave(m, 2), k.repeat_interleave(m, 2), v, g,
                                                 initial_state=S0, **kw), leaves, 1e-12, f"grouped {backend}")


def test_grouped_heads_refusals():
    q, k, v, g = make_inputs(5)
    with pytest.raises(ValueError, match=r"v must have shape .*or a multiple of H = 2 heads"):
        gated_linear_attention(q, k, torch.randn(B, 5, 3, DV, dtype=F64), g)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\] = \(3, 5, 4\)"):
        gated_linear_attention(q, k, torch.randn(B, 5, 4, DV, dtype=F64), g)
    with pytest.raises(TypeError, match="g has dtype torch.float32"):  # q's dtype (a float32 g with fp32_gate only)
        gated_linear_attention(q, k, v, g.float())


def test_linear_ops_float32_close_to_float64():
    q, k, v, g = make_inputs(37)
    mask = left_pad_mask([37, 30, 20], 37)
    ref, _ = linear_attention(q, k, v, mask=mask, backend="recurrent")
    ref_g, _ = gated_linear_attention(q, k, v, g, mask=mask, backend="recurrent")
    q32, k32, v32, g32 = (x.float() for x in (q, k, v, g))
    for backend in ("chunk", "recurrent"):
        o, s = linear_attention(q32, k32, v32, mask=mask, backend=backend, chunk_size=16, output_final_state=True)
        assert o.dtype == torch.float32 and s["S"].dtype == torch.float32
        assert_close(o, ref, 1e-4, f"linear fp32 {backend}")
        o, _ = gated_linear_attention(q32, k32, v32, g32, mask=mask, backend=backend, chunk_size=16)
        assert_close(o, ref_g, 1e-4, f"gla fp32 {backend}")
    o, s = gated_linear_attention(*(x.half() for x in (q, k, v, g)), output_final_state=True)
    assert o.dtype == torch.float16 and s.dtype == torch.float32


# ----------------------------------------------------------------------------- non-causal, Triton (interpreter on CPU)
@needs_interpreter
def test_interp_bidirectional_triton_matches_float64():
    """bidirectional_linear_attention on the non-causal kernels, fp32, vs its float64 matmul form: outputs and the
    gradients of q, k, v, with a left-padded sample and a hole; pads output 0 and a NaN at a pad reaches nothing."""
    from op_helpers import forward_and_grads

    from lazoo.ops.bidirectional import bidirectional_linear_attention

    gen = torch.Generator().manual_seed(3)
    B, T, H, D, Dv = 2, 37, 2, 24, 20
    q, k = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 20)])
    q[1, 0], k[1, 0], v[1, 0] = float("nan"), float("nan"), float("nan")  # a pad

    def run(backend, dtype):
        leaves = {n: x.detach().to(dtype).requires_grad_(True) for n, x in zip("qkv", (q, k, v))}
        return forward_and_grads(lambda: (bidirectional_linear_attention(
            leaves["q"], leaves["k"], leaves["v"], mask=mask, backend=backend)[0], None), leaves)

    o_r, _, g_r = run("chunk", torch.float64)
    o_t, _, g_t = run("triton", torch.float32)
    assert o_t.dtype == torch.float32 and torch.all(o_t[~mask] == 0)
    assert_close(o_t, o_r, 1e-5, "output")
    for name in g_r:
        assert_close(g_t[name], g_r[name], 1e-4, f"grad {name}")
    empty = bidirectional_linear_attention(*(x[:0].float() for x in (q, k, v)), backend="triton")[0]
    assert empty.shape == (0, T, H, Dv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bidirectional_matches_float64():
    """bidirectional_linear_attention on CUDA (auto: the non-causal kernels), fp32 and bf16 on the same rounded
    inputs, and under bf16 autocast with fp32 inputs, against its float64 matmul form on the CPU, gradients too."""
    from op_helpers import forward_and_grads

    from lazoo.ops.bidirectional import bidirectional_linear_attention

    gen = torch.Generator().manual_seed(5)
    B, T, H, D = 2, 700, 2, 128
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = left_pad_mask([T, T - 99], T)
    for dtype, rtol, autocast in ((torch.float32, 1e-4, False), (torch.bfloat16, 1e-2, False),
                                  (torch.float32, 2e-2, True)):
        rounded = {n: x.to(dtype).double().requires_grad_(True) for n, x in zip("qkv", (q, k, v))}
        o_r, _, g_r = forward_and_grads(lambda: (bidirectional_linear_attention(
            rounded["q"], rounded["k"], rounded["v"], mask=mask)[0], None), rounded)
        cu = {n: x.detach().cuda().to(dtype).requires_grad_(True) for n, x in zip("qkv", (q, k, v))}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            o, _, g = forward_and_grads(lambda: (bidirectional_linear_attention(
                cu["q"], cu["k"], cu["v"], mask=mask.cuda())[0], None), cu)
        assert o.dtype == dtype
        assert_close(o.cpu().double(), o_r, rtol, f"{dtype} autocast={autocast} output")
        for name in g_r:
            assert_close(g[name].cpu().double(), g_r[name], 3 * rtol, f"{dtype} autocast={autocast} grad {name}")
