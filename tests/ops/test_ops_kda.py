"""Kimi Delta Attention ("Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team, 2025) as
`lazoo.ops.kda`, against a float64 loop written here one token at a time: the state decays per key channel,
`S' = S_{t−1} Diag(exp(g_t))`, then the delta-rule write `S_t = S' + β_t (v_t − S' k_t) k_tᵀ`, `o_t = S_t q_t / √dk`
with L2-normalised q and k. Outputs, final states and the gradients of q, k, v, g, β and the initial state, for the
chunk and recurrent backends, at ragged lengths with left padding and interior holes, packed sequences, a carried
state, grouped value heads, and decays strong enough that exp(−G) over a chunk would overflow if it were formed.
The Triton kernels are tested in tests/kernels/test_kernels_kda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, check_against, kda_inputs, left_pad_mask

from lazoo import ops

F64 = torch.float64


def loop_reference(q, k, v, g, beta, S0):
    """Token by token in float64, written from the equations: `(o [B, T, HV, dv], S [B, HV, dv, dk])`."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    m = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(m, dim=2), k.repeat_interleave(m, dim=2)
    S, outs = S0, []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t])[:, :, None, :]
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhvk,bhk->bhv", S, kt)
        S = S + beta[:, t, :, None, None] * err[..., None] * kt[:, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


def _leaves(x):
    return {n: t.clone().requires_grad_(True) for n, t in x.items()}


def _run(x, **kw):
    return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"], output_final_state=True, **kw)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("T,HV,strong,chunk", [(1, None, False, 16), (37, None, True, 16), (29, 4, False, 8)])
def test_kda_equals_the_token_loop(backend, T, HV, strong, chunk):
    x = _leaves(kda_inputs(2, T, 2, 6, 5, HV=HV, seed=T, strong=strong))
    check_against(lambda: _run(x, backend=backend, chunk_size=chunk),
           lambda: loop_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"]), x, 1e-10,
           f"{backend} T={T}")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_kda_pads_leave_the_state_alone(backend):
    """Left padding and interior holes: each sample equals its real tokens run alone (NaN at the pads stays out)."""
    T = 21
    x = kda_inputs(3, T, 2, 6, 5, seed=3)
    mask = left_pad_mask([21, 15, 9], T, holes=[(0, 4), (1, 10)])
    for name in ("q", "k", "v", "g", "beta"):
        x[name][~mask] = float("nan")
    x = _leaves(x)
    o, S = _run(x, mask=mask, backend=backend, chunk_size=8)
    assert torch.isfinite(o).all() and (o[~mask] == 0).all()
    o.sum().backward()
    for name in ("q", "k", "v", "g", "beta"):
        assert (x[name].grad[~mask] == 0).all(), name
    for b in range(3):
        real = mask[b].nonzero().flatten()
        o_ref, S_ref = loop_reference(*(x[n][b:b + 1, real].detach() for n in ("q", "k", "v", "g", "beta")),
                                      x["S0"][b:b + 1].detach())
        assert_close(o[b:b + 1, real], o_ref, 1e-10, f"sample {b} output")
        assert_close(S[b:b + 1], S_ref, 1e-10, f"sample {b} state")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_kda_packed_sequences_and_carried_state(backend):
    """Packed sequences (cu_seqlens, an empty one among them) equal each run alone from its own initial state, and
    a sequence split in two with the state carried across equals it run whole."""
    lens = [7, 0, 19, 4]
    cu = torch.tensor([0, 7, 7, 26, 30])
    x = kda_inputs(1, 30, 2, 6, 5, seed=5)
    S0 = torch.randn(4, 2, 5, 6, dtype=F64)
    o, S = ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=S0, output_final_state=True,
                   cu_seqlens=cu, backend=backend, chunk_size=8)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert lens[n] == e - s
        if e == s:
            assert_close(S[n], S0[n], 0.0, "empty sequence state")
            continue
        o_ref, S_ref = loop_reference(*(x[k][:, s:e] for k in ("q", "k", "v", "g", "beta")), S0[n:n + 1])
        assert_close(o[:, s:e], o_ref, 1e-10, f"sequence {n} output")
        assert_close(S[n:n + 1], S_ref, 1e-10, f"sequence {n} state")
    whole, S_whole = _run(x, backend=backend, chunk_size=8)
    a, S_a = ops.kda(*(x[k][:, :13] for k in ("q", "k", "v", "g", "beta")), initial_state=x["S0"],
                     output_final_state=True, backend=backend, chunk_size=8)
    b, S_b = ops.kda(*(x[k][:, 13:] for k in ("q", "k", "v", "g", "beta")), initial_state=S_a,
                     output_final_state=True, backend=backend, chunk_size=8)
    assert_close(torch.cat([a, b], 1), whole, 1e-10, "split output")
    assert_close(S_b, S_whole, 1e-10, "split state")


def test_kda_float32_and_no_l2norm():
    """float32 inputs against the float64 loop; use_qk_l2norm=False takes q and k as given."""
    x = kda_inputs(2, 40, 2, 8, 8, seed=7)
    o, S = ops.kda(*(x[k].float() for k in ("q", "k", "v", "g", "beta")), initial_state=x["S0"].float(),
                   output_final_state=True, backend="chunk")
    o_ref, S_ref = loop_reference(*(x[k] for k in ("q", "k", "v", "g", "beta", "S0")))
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert_close(o, o_ref, 1e-5, "float32 output")
    assert_close(S, S_ref, 1e-5, "float32 state")
    q = F.normalize(x["q"], dim=-1)
    k = F.normalize(x["k"], dim=-1)
    o1, _ = ops.kda(q, k, x["v"], x["g"], x["beta"], use_qk_l2norm=False, backend="recurrent")
    o2, _ = ops.kda(q, k, x["v"], x["g"], x["beta"], use_qk_l2norm=True, backend="recurrent")
    assert_close(o1, o2, 1e-5, "unit q, k with and without the norm")
    assert not torch.allclose(o1, ops.kda(2 * q, k, x["v"], x["g"], x["beta"], use_qk_l2norm=False,
                                          backend="recurrent")[0])


def test_kda_bad_input_is_named():
    x = kda_inputs(1, 5, 2, 4, 4)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="g must have shape"):
        ops.kda(*args[:3], x["g"][..., :3], args[4])
    with pytest.raises(TypeError, match="g must have q's dtype"):
        ops.kda(*args[:3], x["g"].half(), args[4])
    with pytest.raises(ValueError, match="beta must have shape"):
        ops.kda(*args[:4], x["beta"][..., :1])
    bad = x["g"].clone()
    bad[0, 2, 1, 0] = 0.5
    with pytest.raises(ValueError, match="g must lie in"):
        ops.kda(*args[:3], bad, args[4])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        ops.kda(*args, initial_state=torch.zeros(1, 2, 4, 3, dtype=F64))
    with pytest.raises(NotImplementedError, match="backend='triton'"):
        ops.kda(*args, backend="triton")
