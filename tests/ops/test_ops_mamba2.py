"""Mamba-2's SSD layer ("Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State
Space Duality", Dao and Gu, 2024) as `lazoo.ops.mamba2`, against a float64 loop written here, one token at a time:
`S_t = exp(dt_t·A) S_{t−1} + dt_t · x_t B_tᵀ, y_t = S_t C_t + D·x_t`, heads reading their group of B and C. Outputs,
final states and the gradients of x, dt, A, B, C, D and the initial state, for the chunk and recurrent backends (and
the Triton kernels in the interpreter), at ragged lengths with left padding, packed sequences, a carried state and
fewer groups than heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, check_against, forward_and_grads, left_pad_mask, needs_interpreter

from lazoo import ops

F64 = torch.float64
BATCH, H, P, N = 3, 4, 5, 6


def make_inputs(T, groups=2, batch=BATCH, seed=0, heads=H, p=P, n=N):
    """x, dt (softplus'ed), A (< 0), B, C, D and an initial state, float64, fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, heads, p, generator=gen, dtype=F64)
    dt = F.softplus(torch.randn(batch, T, heads, generator=gen, dtype=F64) - 0.5)
    A = -torch.exp(torch.randn(heads, generator=gen, dtype=F64))
    B = torch.randn(batch, T, groups, n, generator=gen, dtype=F64)
    C = torch.randn(batch, T, groups, n, generator=gen, dtype=F64)
    D = torch.randn(heads, generator=gen, dtype=F64)
    S0 = torch.randn(batch, heads, p, n, generator=gen, dtype=F64)
    return {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "S0": S0}


def loop_reference(x, dt, A, B, C, D=None, S0=None):
    """The recurrence token by token in float64: `(y [B, T, H, P], S [B, H, P, N])`."""
    batch, T, heads, p = x.shape
    groups, n = B.shape[2:]
    S = x.new_zeros(batch, heads, p, n) if S0 is None else S0
    ys = []
    for t in range(T):
        b = B[:, t].repeat_interleave(heads // groups, dim=1)  # [batch, H, N]: head h reads group h // (H / G)
        c = C[:, t].repeat_interleave(heads // groups, dim=1)
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        S = decay * S + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", S, c)
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1), S


def padded_reference(inputs, mask):
    """Each sample on its real tokens alone (a pad neither writes nor decays): outputs at the real positions,
    zeros at the pads, and each sample's final state."""
    x, dt, B, C = (inputs[k] for k in ("x", "dt", "B", "C"))
    ys, states = torch.zeros_like(x), []
    for b in range(x.shape[0]):
        real = mask[b].nonzero().flatten()
        y, S = loop_reference(x[b:b + 1, real], dt[b:b + 1, real], inputs["A"], B[b:b + 1, real], C[b:b + 1, real],
                              inputs["D"], inputs["S0"][b:b + 1])
        ys[b, real] = y[0]
        states.append(S)
    return ys, torch.cat(states)


def _run(inputs, **kwargs):
    return ops.mamba2(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
                      initial_state=inputs["S0"], output_final_state=True, **kwargs)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("T,groups", [(1, 2), (13, 2), (37, 1), (20, 4)])
def test_outputs_states_and_every_gradient_equal_the_float64_loop(backend, T, groups):
    """Ragged T against chunks of 8 (T = 37 crosses four boundaries and ends inside a fifth), fewer groups than
    heads (1 and 2 for 4 heads) and one group per head."""
    inputs = make_inputs(T, groups=groups, seed=T + groups)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}
    check_against(lambda: _run(leaves, chunk_size=8, backend=backend),
                   lambda: loop_reference(*(leaves[k] for k in ("x", "dt", "A", "B", "C", "D", "S0"))),
                   leaves, 1e-10, f"{backend} T={T} G={groups}")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_left_padded_ragged_lengths_equal_each_sample_alone(backend):
    """Rows of 21, 14 and 5 real tokens, left-padded (one with a hole inside): pads neither write nor decay, output
    0 and get gradient 0."""
    T = 21
    inputs = make_inputs(T, seed=3)
    mask = left_pad_mask([21, 14, 5], T, holes=[(1, 12)])
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}
    check_against(lambda: _run(leaves, chunk_size=8, backend=backend, mask=mask),
                   lambda: padded_reference(leaves, mask), leaves, 1e-10, f"{backend} left padding")
    y, _, grads = forward_and_grads(lambda: _run(leaves, chunk_size=8, backend=backend, mask=mask), leaves)
    assert (y[~mask] == 0).all()
    for name in ("x", "dt", "B", "C"):
        assert (grads[name][~mask] == 0).all(), name


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_packed_sequences_equal_the_sequences_one_by_one(backend):
    """cu_seqlens: three sequences of 9, 1 and 14 tokens packed in one row, each from its own initial state."""
    lengths = [9, 1, 14]
    cu = torch.tensor([0, 9, 10, 24])
    inputs = make_inputs(sum(lengths), batch=1, seed=4)
    inputs["S0"] = torch.randn(len(lengths), H, P, N, dtype=F64)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}

    def one_by_one():
        ys, states = [], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            y, S = loop_reference(*(leaves[k][:, s:e] for k in ("x", "dt")), leaves["A"],
                                  *(leaves[k][:, s:e] for k in ("B", "C")), leaves["D"], leaves["S0"][i:i + 1])
            ys.append(y)
            states.append(S)
        return torch.cat(ys, dim=1), torch.cat(states)

    check_against(lambda: _run(leaves, chunk_size=8, backend=backend, cu_seqlens=cu), one_by_one, leaves, 1e-10,
                   f"{backend} packed")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_a_carried_state_continues_the_sequence(backend):
    """The first 11 tokens, then the other 16 from its final state, equal the 27 at once (as the cache does)."""
    inputs = make_inputs(27, seed=5)
    whole, S_whole = _run(inputs, chunk_size=8, backend=backend)
    first = {**inputs, **{k: inputs[k][:, :11] for k in ("x", "dt", "B", "C")}}
    second = {**inputs, **{k: inputs[k][:, 11:] for k in ("x", "dt", "B", "C")}}
    y1, S1 = _run(first, chunk_size=8, backend=backend)
    y2, S2 = _run({**second, "S0": S1}, chunk_size=8, backend=backend)
    assert_close(torch.cat([y1, y2], dim=1), whole, 1e-12, "output")
    assert_close(S2, S_whole, 1e-12, "state")


def test_without_D_there_is_no_skip():
    inputs = make_inputs(9, seed=6)
    y, S = ops.mamba2(*(inputs[k] for k in ("x", "dt", "A", "B", "C")), initial_state=inputs["S0"],
                      output_final_state=True, backend="chunk", chunk_size=4)
    y_ref, S_ref = loop_reference(*(inputs[k] for k in ("x", "dt", "A", "B", "C")), None, inputs["S0"])
    assert_close(y, y_ref, 1e-12, "output")
    assert_close(S, S_ref, 1e-12, "state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_take_a_float32_dt_and_keep_their_dtype(dtype):
    """x, B, C in 16 bits with dt in float32 (the log decay keeps its precision); the state comes back in float32."""
    inputs = make_inputs(17, seed=7)
    y_ref, S_ref = loop_reference(*(inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "S0")))
    half = {k: inputs[k].to(dtype) for k in ("x", "B", "C")}
    y, S = ops.mamba2(half["x"], inputs["dt"].float(), inputs["A"].float(), half["B"], half["C"], inputs["D"].float(),
                      initial_state=inputs["S0"].float(), output_final_state=True, backend="chunk", chunk_size=8)
    assert y.dtype == dtype and S.dtype == torch.float32
    assert_close(y, y_ref, 3e-2, "output")
    assert_close(S, S_ref, 3e-2, "state")


# ----------------------------------------------------------------------------- refusals
def _call(**changes):
    inputs = {**make_inputs(6, seed=8), **changes}
    return ops.mamba2(*(inputs[k] for k in ("x", "dt", "A", "B", "C", "D")), backend="chunk")


@pytest.mark.parametrize("changes,message", [
    (lambda x: {"B": x["B"][:, :, :1].expand(-1, -1, 3, -1)}, r"^mamba2: B must have shape \[B, T, G, N\].*G dividing"),
    (lambda x: {"C": x["C"][..., :2]}, r"^mamba2: C must have the shape of B"),
    (lambda x: {"dt": x["dt"][..., :2]}, r"^mamba2: dt must have shape \[B, T, H\]"),
    (lambda x: {"A": x["A"][None]}, r"^mamba2: A must have shape \[H\]"),
    (lambda x: {"D": x["D"][:2]}, r"^mamba2: D must be None or a float tensor of shape \[H\]"),
    (lambda x: {"x": x["x"][0]}, r"^mamba2: x must have shape \[B, T, H, P\]"),
    (lambda x: {"B": x["B"].float()}, r"^mamba2: B has dtype torch.float32 but x has dtype torch.float64"),
    (lambda x: {"dt": x["dt"].half()}, r"^mamba2: dt must have x's dtype"),
])
def test_bad_shapes_and_dtypes_are_refused_naming_the_argument(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _call(**changes(make_inputs(6, seed=8)))


def test_a_negative_dt_or_a_positive_A_is_refused_at_real_tokens_only():
    inputs = make_inputs(6, seed=9)
    dt = inputs["dt"].clone()
    dt[1, 2] = -0.5
    with pytest.raises(ValueError, match=r"^mamba2: dt must lie in \[0, inf\] at real tokens"):
        _call(dt=dt)
    mask = torch.ones(BATCH, 6, dtype=torch.bool)
    mask[1, 2] = False  # a pad is no input
    y, _ = ops.mamba2(*(inputs[k] for k in ("x",)), dt, *(inputs[k] for k in ("A", "B", "C", "D")), mask=mask)
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match=r"^mamba2: A must lie in \[-inf, 0\]"):
        _call(A=inputs["A"].abs())


# ----------------------------------------------------------------------------- Triton (interpreter)
@needs_interpreter
def test_interp_triton_matches_the_float64_loop():
    """lazoo.kernels.linear through the op, float32 in the interpreter: ragged T, left padding, G < H, every
    gradient; and the decoding kernel (no autograd, few tokens) from a carried state."""
    T = 21
    inputs = make_inputs(T, groups=1, batch=2, seed=10, heads=2, p=16, n=16)
    mask = left_pad_mask([21, 9], T)
    leaves = {k: v.float().requires_grad_(True) for k, v in inputs.items()}
    ref = {k: v.requires_grad_(True) for k, v in inputs.items()}
    o1, s1, g1 = forward_and_grads(lambda: _run(leaves, chunk_size=16, backend="triton", mask=mask), leaves)
    o2, s2, g2 = forward_and_grads(lambda: padded_reference(ref, mask), ref)
    assert_close(o1, o2, 1e-4, "triton output")
    assert_close(s1, s2, 1e-4, "triton final state")
    for name in leaves:
        assert_close(g1[name], g2[name], 1e-4, f"triton grad {name}")
    with torch.no_grad():
        step = {**{k: v.detach() for k, v in leaves.items()},
                **{k: leaves[k].detach()[:, -3:] for k in ("x", "dt", "B", "C")}}
        y, S = _run(step, backend="triton")
        y_ref, S_ref = loop_reference(*(inputs[k][:, -3:] if k in ("x", "dt", "B", "C") else inputs[k]
                                        for k in ("x", "dt", "A", "B", "C", "D", "S0")))
    assert_close(y, y_ref, 1e-4, "decoding output")
    assert_close(S, S_ref, 1e-4, "decoding state")
