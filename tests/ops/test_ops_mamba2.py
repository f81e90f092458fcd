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
from op_helpers import assert_close, check_against, forward_and_grads, left_pad_mask, needs_interpreter, rel_err

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


def packed_reference(inputs, cu):
    """Each packed sequence of ``cu`` alone through the loop, from its own initial state: `(y, final states)`."""
    ys, states = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, S = loop_reference(*(inputs[k][:, s:e] for k in ("x", "dt")), inputs["A"],
                              *(inputs[k][:, s:e] for k in ("B", "C")), inputs["D"], inputs["S0"][i:i + 1])
        ys.append(y)
        states.append(S)
    return torch.cat(ys, dim=1), torch.cat(states)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_packed_sequences_equal_the_sequences_one_by_one(backend):
    """cu_seqlens: three sequences of 9, 1 and 14 tokens packed in one row, each from its own initial state."""
    lengths = [9, 1, 14]
    cu = torch.tensor([0, 9, 10, 24])
    inputs = make_inputs(sum(lengths), batch=1, seed=4)
    inputs["S0"] = torch.randn(len(lengths), H, P, N, dtype=F64)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items()}
    check_against(lambda: _run(leaves, chunk_size=8, backend=backend, cu_seqlens=cu),
                  lambda: packed_reference(leaves, cu), leaves, 1e-10, f"{backend} packed")


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
def float32_triton_matches(inputs, run, reference) -> dict:
    """``run`` on float32 copies of the float64 ``inputs`` against ``reference`` on them: outputs, final states and
    every gradient to 1e-4. Returns the float32 leaves."""
    leaves = {k: v.float().requires_grad_(True) for k, v in inputs.items()}
    ref = {k: v.requires_grad_(True) for k, v in inputs.items()}
    o1, s1, g1 = forward_and_grads(lambda: run(leaves), leaves)
    o2, s2, g2 = forward_and_grads(lambda: reference(ref), ref)
    assert_close(o1, o2, 1e-4, "triton output")
    assert_close(s1, s2, 1e-4, "triton final state")
    for name in leaves:
        assert_close(g1[name], g2[name], 1e-4, f"triton grad {name}")
    return leaves


@needs_interpreter
def test_interp_triton_matches_the_float64_loop():
    """lazoo.kernels.linear through the op, float32 in the interpreter: ragged T, left padding, G < H, every
    gradient; and the decoding kernel (no autograd, few tokens) from a carried state."""
    T = 21
    inputs = make_inputs(T, groups=1, batch=2, seed=10, heads=2, p=16, n=16)
    mask = left_pad_mask([21, 9], T)
    leaves = float32_triton_matches(inputs, lambda x: _run(x, chunk_size=16, backend="triton", mask=mask),
                                    lambda x: padded_reference(x, mask))
    with torch.no_grad():
        step = {**{k: v.detach() for k, v in leaves.items()},
                **{k: leaves[k].detach()[:, -3:] for k in ("x", "dt", "B", "C")}}
        y, S = _run(step, backend="triton")
        y_ref, S_ref = loop_reference(*(inputs[k][:, -3:] if k in ("x", "dt", "B", "C") else inputs[k]
                                        for k in ("x", "dt", "A", "B", "C", "D", "S0")))
    assert_close(y, y_ref, 1e-4, "decoding output")
    assert_close(S, S_ref, 1e-4, "decoding state")


@needs_interpreter
@pytest.mark.parametrize("groups", [1, 2])
def test_interp_triton_packed_sequences_with_groups(groups):
    """The Triton kernels reading each group's B and C in place (4 heads: 4 or 2 per group) on packed sequences of
    9, 1 and 20 tokens, each from its own state, float32 against the float64 loop one sequence at a time: outputs,
    final states and every gradient, those of B and C summed over the group's heads inside the kernels."""
    cu = torch.tensor([0, 9, 10, 30])
    inputs = make_inputs(30, groups=groups, batch=1, seed=11, heads=4, p=16, n=16)
    inputs["S0"] = torch.randn(3, 4, 16, 16, dtype=F64)
    float32_triton_matches(inputs, lambda x: _run(x, chunk_size=16, backend="triton", cu_seqlens=cu),
                           lambda x: packed_reference(x, cu))


@needs_interpreter
def test_interp_triton_bf16_grad_A_equals_float64():
    """The decay's gradient dA = Σ_t dt_t·dg_t at bf16 (products rounded as a GPU does, tests/interp_bf16.py) over
    1024 tokens stays within 3e-2 of the float64 chunk form: dg summed over the whole sequence instead of inside each
    chunk (the rest through the chunk's end state) gave 0.15 here, from rounding errors in terms that cancel."""
    from interp_bf16 import gpu_like_bf16

    T, n = 1024, 64
    inputs = make_inputs(T, groups=1, batch=1, seed=0, heads=4, p=32, n=n)
    inputs["B"], inputs["C"] = inputs["B"] * n ** -0.5, inputs["C"] * n ** -0.5
    ref = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    run = {k: v.to(torch.bfloat16 if k in ("x", "B", "C") else torch.float32).requires_grad_(True)
           for k, v in inputs.items()}
    *_, g_ref = forward_and_grads(lambda: _run(ref, backend="chunk"), ref)
    with gpu_like_bf16():
        *_, g = forward_and_grads(lambda: _run(run, backend="triton"), run)
    assert rel_err(g["A"], g_ref["A"]) < 3e-2, (g["A"], g_ref["A"])


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-4)])
def test_gpu_triton_matches_float64(dtype, rtol, groups):
    """The Triton kernels at Bamba's head and state sizes (heads of 64, state 128; 32 heads here) reading B and C of 1
    or 4 groups in place, against the op's chunked form in float64 on the GPU (tied to the loop above on the CPU):
    outputs, final states and every gradient, with a left-padded row and a carried state."""
    T = 2048
    inputs = make_inputs(T, groups=groups, batch=2, seed=12, heads=32, p=64, n=128)
    inputs["B"], inputs["C"] = inputs["B"] * 128 ** -0.5, inputs["C"] * 128 ** -0.5
    mask = left_pad_mask([T, T - 300], T).cuda()
    ref = {k: v.cuda().requires_grad_(True) for k, v in inputs.items()}
    run = {k: v.to("cuda", dtype if k in ("x", "B", "C") else torch.float32).requires_grad_(True)
           for k, v in inputs.items()}
    o2, s2, g2 = forward_and_grads(lambda: _run(ref, backend="chunk", mask=mask), ref)
    o1, s1, g1 = forward_and_grads(lambda: _run(run, backend="triton", mask=mask), run)
    assert o1.dtype == dtype
    assert_close(o1.double(), o2, rtol, "triton output")
    assert_close(s1.double(), s2, rtol, "triton final state")
    for name in run:
        assert_close(g1[name].double(), g2[name], rtol, f"triton grad {name}")
