"""DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
Products"): the interleaved delta-rule form vs the literal per-token float64 loop (outputs, final states,
gradients) at ragged T with masks and carried states; n_h = 1 is DeltaNet; one token by hand."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, compare_backends, left_pad_mask, needs_interpreter

from lazoo.ops import delta_product, delta_rule, gated_delta_rule

F64 = torch.float64
B, H, DK, DV = 3, 2, 6, 5


def make_inputs(T, n, dtype=F64, b=B, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, T, H, DK, generator=gen, dtype=F64)
    k = torch.randn(b, T, H, n, DK, generator=gen, dtype=F64)
    v = torch.randn(b, T, H, n, DV, generator=gen, dtype=F64)
    beta = torch.sigmoid(torch.randn(b, T, H, n, generator=gen, dtype=F64))
    g = F.logsigmoid(torch.randn(b, T, H, generator=gen, dtype=F64) + 2)
    return [x.to(dtype) for x in (q, k, v, beta, g)]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("T,n", [(23, 2), (13, 3), (1, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_chunk_matches_recurrent_with_grads(T, n, gated, padded):
    q, k, v, beta, g = make_inputs(T, n)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 9, 0)], T, holes=[(0, T // 2)]) if padded else None
    leaves = {"q": q, "k": k, "v": v, "beta": beta, "S0": S0}
    if gated:
        leaves["g"] = g
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):  # chunk 16 over T·n steps: ragged, and token boundaries cross chunk boundaries
        return delta_product(q, k, v, beta, g=g if gated else None, chunk_size=16, initial_state=S0,
                             output_final_state=True, mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_one_householder_step_is_the_delta_rule(backend):
    q, k, v, beta, g = make_inputs(29, 1)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask([29, 20, 7], 29)
    kw = dict(initial_state=S0, output_final_state=True, mask=mask, backend=backend, chunk_size=8)
    o, s = delta_product(q, k, v, beta, **kw)
    o_ref, s_ref = delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], **kw)
    assert_close(o, o_ref, 1e-12, "output vs delta_rule")
    assert_close(s, s_ref, 1e-12, "state vs delta_rule")
    o, s = delta_product(q, k, v, beta, g=g, **kw)
    o_ref, s_ref = gated_delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], g, beta[..., 0], **kw)
    assert_close(o, o_ref, 1e-12, "output vs gated_delta_rule")
    assert_close(s, s_ref, 1e-12, "state vs gated_delta_rule")


def test_one_token_by_hand():
    # S1 = α S0 H1 H2 + β1 v1 k1ᵀ H2 + β2 v2 k2ᵀ, H_j = I - β_j k_j k_jᵀ (unit keys), o = S1 (scale q̂)
    q, k, v, beta, g = make_inputs(1, 2, b=1, seed=3)
    S0 = torch.randn(1, H, DV, DK, dtype=F64)
    for backend in ("chunk", "recurrent"):
        o, S1 = delta_product(q, k, v, beta, g=g, initial_state=S0, output_final_state=True, backend=backend)
        for h in range(H):
            kn = k[0, 0, h] / torch.sqrt((k[0, 0, h] ** 2).sum(-1, keepdim=True) + 1e-6)  # the op's l2norm
            b1, b2 = beta[0, 0, h]
            I = torch.eye(DK, dtype=F64)
            H1, H2 = I - b1 * torch.outer(kn[0], kn[0]), I - b2 * torch.outer(kn[1], kn[1])
            ref = (g[0, 0, h].exp() * S0[0, h] @ H1 @ H2 + b1 * torch.outer(v[0, 0, h, 0], kn[0]) @ H2
                   + b2 * torch.outer(v[0, 0, h, 1], kn[1]))
            assert_close(S1[0, h], ref, 1e-12, f"{backend} state head {h}")
            qn = q[0, 0, h] / torch.sqrt((q[0, 0, h] ** 2).sum() + 1e-6)
            assert_close(o[0, 0, h], ref @ qn * DK ** -0.5, 1e-12, f"{backend} output head {h}")


def test_interleaved_layout_equals_stacked_layout():
    T, n = 11, 3
    q, k, v, beta, g = make_inputs(T, n)
    o, s = delta_product(q, k, v, beta, g=g, output_final_state=True, chunk_size=8)
    k_i = k.transpose(2, 3).reshape(B, T * n, H, DK)  # step j of token t at t·n + j
    v_i = v.transpose(2, 3).reshape(B, T * n, H, DV)
    b_i = beta.transpose(2, 3).reshape(B, T * n, H)
    for backend in ("chunk", "recurrent"):
        o2, s2 = delta_product(q, k_i, v_i, b_i, g=g, num_householder=n, output_final_state=True,
                               chunk_size=8, backend=backend)
        assert_close(o2, o, 1e-12, f"interleaved output {backend}")
        assert_close(s2, s, 1e-12, f"interleaved state {backend}")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_left_padded_batch_and_split(backend):
    T, n, lengths, cut = 21, 2, [21, 14, 5], 9
    q, k, v, beta, g = make_inputs(T, n, seed=4)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask(lengths, T)
    kw = dict(output_final_state=True, backend=backend, chunk_size=8)
    o, s = delta_product(q, k, v, beta, g=g, mask=mask, initial_state=S0, **kw)
    assert torch.all(o[~mask] == 0)
    for b, m in enumerate(lengths):
        sl = (slice(b, b + 1), slice(T - m, None))
        ob, sb = delta_product(q[sl], k[sl], v[sl], beta[sl], g=g[sl], initial_state=S0[b:b + 1], **kw)
        assert_close(o[sl], ob, 1e-12, f"sample {b} output")
        assert_close(s[b:b + 1], sb, 1e-12, f"sample {b} state")
    first = [x[:, :cut] for x in (q, k, v, beta, g)]
    second = [x[:, cut:] for x in (q, k, v, beta, g)]
    o1, s1 = delta_product(*first[:4], g=first[4], mask=mask[:, :cut], initial_state=S0, **kw)
    o2, s2 = delta_product(*second[:4], g=second[4], mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_close(s2, s, 1e-12, "split state")


def test_float32_close_to_float64_and_extra_steps_matter():
    q, k, v, beta, g = make_inputs(37, 2, seed=5)
    mask = left_pad_mask([37, 30, 20], 37)
    ref, _ = delta_product(q, k, v, beta, g=g, mask=mask, backend="recurrent")
    for backend in ("chunk", "recurrent"):
        o, s = delta_product(*(x.float() for x in (q, k, v, beta)), g=g.float(), mask=mask, backend=backend,
                             chunk_size=16, output_final_state=True)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        assert_close(o, ref, 1e-4, f"fp32 {backend}")
    o, s = delta_product(*(x.bfloat16() for x in (q, k, v, beta)), g=g.bfloat16(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    one, _ = delta_product(q, k[:, :, :, :1], v[:, :, :, :1], beta[..., :1], g=g, mask=mask)
    assert (one - ref).abs().max() > 1e-3  # the second step changes the result


def test_bad_arguments_raise_clear_errors():
    q, k, v, beta, g = make_inputs(5, 2)
    with pytest.raises(ValueError, match="num_householder=3 but k holds 2"):
        delta_product(q, k, v, beta, num_householder=3)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H, n_h\]"):
        delta_product(q, k, v, beta[..., 0])
    with pytest.raises(ValueError, match=r"interleaved k must have shape"):
        delta_product(q, k.reshape(B, 5 * 2, H, DK)[:, :9], v, beta)
    with pytest.raises(ValueError, match=r"g must be None or a tensor of shape \[B, T, H\]"):
        delta_product(q, k, v, beta, g=g[..., None])
    with pytest.raises(TypeError, match="dtype"):
        delta_product(q, k.float(), v, beta)
    with pytest.raises(ValueError, match="unknown backend"):
        delta_product(q, k, v, beta, backend="fast")


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)
@needs_interpreter
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_interp_triton_matches_reference(gated):
    """backend="triton" (the delta rule kernel on the interleaved sequence), fp32, vs the float64 per-token
    loop: outputs, final states, gradients at ragged T·n_h with a mask and a state; then a no-grad decode."""
    from op_helpers import forward_and_grads

    T, n = 21, 2
    q, k, v, beta, g = make_inputs(T, n, seed=6)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask([T, T - 6, T - 13], T, holes=[(0, 4)])
    names = ("q", "k", "v", "beta", "S0") + (("g",) if gated else ())
    base = dict(q=q, k=k, v=v, beta=beta, S0=S0, g=g)

    def run(backend, dtype):
        leaves = {nm: base[nm].detach().to(torch.float32 if nm == "S0" and dtype != F64 else dtype)
                  .requires_grad_(True) for nm in names}
        return forward_and_grads(lambda: delta_product(
            leaves["q"], leaves["k"], leaves["v"], leaves["beta"], g=leaves.get("g"), mask=mask, chunk_size=16,
            initial_state=leaves["S0"], output_final_state=True, backend=backend), leaves)

    o_r, s_r, g_r = run("recurrent", F64)
    o_t, s_t, g_t = run("triton", torch.float32)
    assert_close(o_t, o_r, 1e-5, "output")
    assert_close(s_t, s_r, 1e-5, "final state")
    for name in g_r:
        assert_close(g_t[name], g_r[name], 1e-4, f"grad {name}")
    with torch.no_grad():  # decoding: the fused recurrent kernel (few steps, no autograd)
        gg = g[:, :2] if gated else None
        o_d, s_d = delta_product(q[:, :2].float(), k[:, :2].float(), v[:, :2].float(), beta[:, :2].float(),
                                 g=None if gg is None else gg.float(), initial_state=s_r.float(),
                                 output_final_state=True, backend="triton")
        o_dr, s_dr = delta_product(q[:, :2], k[:, :2], v[:, :2], beta[:, :2], g=gg, initial_state=s_r,
                                   output_final_state=True, backend="recurrent")
    assert_close(o_d, o_dr, 1e-5, "decode output")
    assert_close(s_d, s_dr, 1e-5, "decode state")


# ----------------------------------------------------------------------------- GPU (-m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_cuda_auto_backend_matches_reference(gated):
    """Auto backend on CUDA (the delta rule's Triton kernel on the interleaved sequence), fp32 vs the float64
    per-token loop with grads at a real head dim; bf16 close, state in fp32."""
    from op_helpers import forward_and_grads

    T, n = 150, 2
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, T, 2, 64, generator=gen, dtype=F64)
    k = torch.randn(2, T, 2, n, 64, generator=gen, dtype=F64)
    v = torch.randn(2, T, 2, n, 64, generator=gen, dtype=F64)
    beta = torch.rand(2, T, 2, n, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(2, T, 2, generator=gen, dtype=F64) + 3) if gated else None
    mask = left_pad_mask([T, T - 33], T)
    base = {"q": q, "k": k, "v": v, "beta": beta}

    def run(tensors, backend, m):
        return lambda: delta_product(tensors["q"], tensors["k"], tensors["v"], tensors["beta"], mask=m,
                                     g=None if g is None else g.to(tensors["q"].device, tensors["q"].dtype),
                                     output_final_state=True, backend=backend)

    ref_l = {nm: x.clone().requires_grad_(True) for nm, x in base.items()}
    o_r, s_r, g_r = forward_and_grads(run(ref_l, "recurrent", mask), ref_l)
    cu = {nm: x.detach().cuda().float().requires_grad_(True) for nm, x in base.items()}
    o, s, grads = forward_and_grads(run(cu, None, mask.cuda()), cu)
    assert_close(o.cpu(), o_r, 1e-4, "output")
    assert_close(s.cpu(), s_r, 1e-4, "state")
    for nm in g_r:
        assert_close(grads[nm].cpu(), g_r[nm], 1e-3, f"grad {nm}")
    bf = {nm: x.detach().cuda().bfloat16() for nm, x in base.items()}
    o, s = run(bf, None, mask.cuda())()
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(o.float().cpu(), o_r.detach(), 5e-2, "bf16 output")
