"""delta_rule and gated_delta_rule: recurrent vs the shared chunk routine, pads, splits, dtypes."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, compare_backends, left_pad_mask

from lazoo.ops import chunk_generalized_delta, delta_rule, gated_delta_rule

F64 = torch.float64
B, H, DK, DV = 3, 2, 6, 5


def make_inputs(T, dtype=F64, b=B, seed=0):
    torch.manual_seed(seed)
    q, k = (torch.randn(b, T, H, DK, dtype=dtype) for _ in range(2))
    v = torch.randn(b, T, H, DV, dtype=dtype)
    g = F.logsigmoid(torch.randn(b, T, H, dtype=dtype) + 2)
    beta = torch.sigmoid(torch.randn(b, T, H, dtype=dtype))
    return q, k, v, g, beta


def call(op, q, k, v, g, beta, **kw):
    """Run delta_rule (gate ignored) or gated_delta_rule with the same arguments."""
    if op == "delta":
        return delta_rule(q, k, v, beta, **kw)
    return gated_delta_rule(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_delta_chunk_matches_recurrent_with_grads(op, T, padded):
    q, k, v, g, beta = make_inputs(T)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)]) if padded else None
    leaves = {"q": q, "k": k, "v": v, "beta": beta, "S0": S0}
    if op == "gated":
        leaves["g"] = g
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return call(op, q, k, v, g, beta, chunk_size=16, initial_state=S0, output_final_state=True,
                    mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


@pytest.mark.parametrize("op", ["delta", "gated"])
def test_delta_without_l2norm_and_custom_scale(op):
    q, k, v, g, beta = make_inputs(20)
    k = F.normalize(k, dim=-1) * 0.9  # keep |k| < 1 so that the unnormalised rule stays stable
    kw = dict(use_qk_l2norm=False, scale=0.37, chunk_size=8, output_final_state=True)
    o1, s1 = call(op, q, k, v, g, beta, backend="chunk", **kw)
    o2, s2 = call(op, q, k, v, g, beta, backend="recurrent", **kw)
    assert_close(o1, o2, 1e-10, "output")
    assert_close(s1, s2, 1e-10, "state")
    o3, _ = call(op, q, k, v, g, beta, **{**kw, "use_qk_l2norm": True})
    assert (o3 - o1).abs().max() > 1e-6  # the flag matters


def test_delta_literal_single_step():
    # One token from a given state: S1 = exp(g) S0 (I - β k k^T) + β v k^T, o = S1 (scale q).
    q, k, v, g, beta = make_inputs(1, b=1)
    S0 = torch.randn(1, H, DV, DK, dtype=F64)
    o, S1 = gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for h in range(H):
        kn = k[0, 0, h] / torch.sqrt(k[0, 0, h] @ k[0, 0, h] + 1e-6)
        qn = q[0, 0, h] / torch.sqrt(q[0, 0, h] @ q[0, 0, h] + 1e-6)
        b_, a = beta[0, 0, h], g[0, 0, h].exp()
        ref = a * S0[0, h] @ (torch.eye(DK, dtype=F64) - b_ * torch.outer(kn, kn)) + b_ * torch.outer(v[0, 0, h], kn)
        assert_close(S1[0, h], ref, 1e-12, "one step state")
        assert_close(o[0, 0, h], ref @ qn * DK ** -0.5, 1e-12, "one step output")


def test_gated_with_zero_gate_equals_delta():
    q, k, v, g, beta = make_inputs(23)
    o1, s1 = delta_rule(q, k, v, beta, output_final_state=True, chunk_size=8)
    o2, s2 = gated_delta_rule(q, k, v, torch.zeros_like(g), beta, output_final_state=True, chunk_size=8)
    assert_close(o2, o1, 1e-12, "output")
    o3, _ = gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    assert (o3 - o1).abs().max() > 1e-6


@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_delta_left_padded_batch_and_split(op, backend):
    T, lengths, cut = 21, [21, 14, 5], 9
    q, k, v, g, beta = make_inputs(T)
    S0 = torch.randn(B, H, DV, DK, dtype=F64)
    mask = left_pad_mask(lengths, T)
    kw = dict(output_final_state=True, backend=backend, chunk_size=8)
    o, s = call(op, q, k, v, g, beta, mask=mask, initial_state=S0, **kw)
    assert torch.all(o[~mask] == 0)
    for b, n in enumerate(lengths):
        sl = (slice(b, b + 1), slice(T - n, None))
        ob, sb = call(op, q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=S0[b:b + 1], **kw)
        assert_close(o[sl], ob, 1e-12, f"sample {b} output")
        assert_close(s[b:b + 1], sb, 1e-12, f"sample {b} state")
    first = [x[:, :cut] for x in (q, k, v, g, beta)]
    second = [x[:, cut:] for x in (q, k, v, g, beta)]
    o1, s1 = call(op, *first, mask=mask[:, :cut], initial_state=S0, **kw)
    o2, s2 = call(op, *second, mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_close(s2, s, 1e-12, "split state")


def test_chunk_generalized_delta_matches_loop():
    # The shared routine directly, with an arbitrary write key w (not β k) and a gate.
    torch.manual_seed(3)
    T = 13
    q, k, w = (torch.randn(2, T, H, DK, dtype=F64) * 0.4 for _ in range(3))
    v = torch.randn(2, T, H, DV, dtype=F64)
    g = F.logsigmoid(torch.randn(2, T, H, dtype=F64))
    S = torch.randn(2, H, DV, DK, dtype=F64)
    o, S_end = chunk_generalized_delta(q, k, v, w, g, S, 4)
    outs = []
    for t in range(T):
        a = g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhvk,bhk->bhv", a * S, k[:, t])
        S = a * S + torch.einsum("bhv,bhk->bhvk", v[:, t] - pred, w[:, t])
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    assert_close(o, torch.stack(outs, 1), 1e-12, "output")
    assert_close(S_end, S, 1e-12, "state")


def test_delta_float32_close_to_float64():
    q, k, v, g, beta = make_inputs(37)
    mask = left_pad_mask([37, 30, 20], 37)
    for op in ("delta", "gated"):
        ref, _ = call(op, q, k, v, g, beta, mask=mask, backend="recurrent")
        for backend in ("chunk", "recurrent"):
            o, s = call(op, *(x.float() for x in (q, k, v, g, beta)), mask=mask, backend=backend,
                        chunk_size=16, output_final_state=True)
            assert o.dtype == torch.float32 and s.dtype == torch.float32
            assert_close(o, ref, 1e-4, f"{op} fp32 {backend}")
    o, s = call("gated", *(x.bfloat16() for x in (q, k, v, g, beta)), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


# ============================================================================ grouped value heads
def _grouped(B=2, T=37, H=2, m=3, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    x = {"q": torch.randn(B, T, H, D, generator=gen, **f64), "k": torch.randn(B, T, H, D, generator=gen, **f64),
         "v": torch.randn(B, T, H * m, D, generator=gen, **f64), "beta": torch.rand(B, T, H * m, generator=gen, **f64),
         "g": F.logsigmoid(torch.randn(B, T, H * m, generator=gen, **f64) + 2)}
    return x, torch.randn(B, H * m, D, D, generator=gen, **f64), m


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_grouped_value_heads_equal_repeated_query_key_heads(op, backend):
    # query/key head j serves value heads jm..jm+m-1: the same as repeating q and k head by head, in outputs, final
    # state and every gradient (q's and k's summed over their value heads), with a mask and a carried state
    x, S0, m = _grouped(seed=1 if op == "delta" else 2)
    mask = left_pad_mask([37, 30], 37)

    def run(repeat):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        q, k = (leaves[n].repeat_interleave(m, 2) if repeat else leaves[n] for n in ("q", "k"))
        fn = delta_rule if op == "delta" else gated_delta_rule
        args = (q, k, leaves["v"], leaves["beta"]) if op == "delta" else (q, k, leaves["v"], leaves["g"],
                                                                            leaves["beta"])
        o, S = fn(*args, initial_state=S0, output_final_state=True, mask=mask, backend=backend, chunk_size=16)
        probe = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view(o.shape)
        names = [n for n in leaves if op == "gated" or n != "g"]
        grads = torch.autograd.grad((o * probe).sum() + S.sum(), [leaves[n] for n in names])
        return o, S, dict(zip(names, grads))

    (o, S, g), (ro, rS, rg) = run(False), run(True)
    assert_close(o, ro, 1e-12, "output")
    assert_close(S, rS, 1e-12, "state")
    for name in g:
        assert_close(g[name], rg[name], 1e-12, f"grad {name}")


def test_grouped_value_heads_refusals_and_fp32_scalars():
    x, _, _ = _grouped(T=5)
    with pytest.raises(ValueError, match="multiple of H = 2 heads"):
        gated_delta_rule(x["q"], x["k"], x["v"][:, :, :5], x["g"][:, :, :5], x["beta"][:, :, :5])
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\] = \(2, 5, 6\)"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"][:, :, :2])
    q, k, v = (x[n].float() for n in "qkv")  # float32 g and β beside float16 ... and beside float32 q
    half = gated_delta_rule(q.half(), k.half(), v.half(), x["g"].float(), x["beta"].float(), backend="chunk")[0]
    full = gated_delta_rule(q, k, v, x["g"].float(), x["beta"].float(), backend="chunk")[0]
    assert half.dtype == torch.float16
    assert_close(half.float(), full, 5e-3, "fp16 with fp32 scalars")


def test_check_g_false_skips_the_log_decay_check_only():
    """A g > 0 is refused by default; with ``check_g=False`` (a caller whose g is <= 0 by construction) the op runs
    it as given, with the same outputs as the checked call wherever g is valid."""
    q, k, v, g, beta = make_inputs(9)
    o, _ = gated_delta_rule(q, k, v, g, beta, backend="chunk")
    o_unchecked, _ = gated_delta_rule(q, k, v, g, beta, backend="chunk", check_g=False)
    assert torch.equal(o, o_unchecked)
    bad = g.clone()
    bad[0, 3] = 0.25
    with pytest.raises(ValueError, match=r"^gated_delta_rule: g must lie in \[-inf, 0\]"):
        gated_delta_rule(q, k, v, bad, beta, backend="chunk")
    o_bad, _ = gated_delta_rule(q, k, v, bad, beta, backend="chunk", check_g=False)
    assert o_bad.shape == o.shape and not torch.equal(o_bad, o)


def test_fp32_backward_head_dim_limit_is_named():
    """float32 training with dk > 128 has a reason on a GPU (its backward's state walk does not fit a block's shared
    memory): auto takes the chunk form, a forced 'triton' raises with it. 16-bit inputs and dk <= 128 have none."""
    from lazoo.ops.delta import backward_unsupported

    reason = backward_unsupported(torch.float32, 256)
    assert reason and "dk=256" in reason and "bfloat16" in reason
    assert backward_unsupported(torch.float32, 128) is None
    assert backward_unsupported(torch.bfloat16, 256) is None
    assert backward_unsupported(torch.float16, 256) is None
