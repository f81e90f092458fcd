"""Exact Linear Attention (Ou 2026, "Exact Linear Attention"): the linear form equals the quadratic kernel
attention; chunk vs the float64 step-by-step reference (outputs, states, gradients); masks, carried states,
overflow-safe exp."""

import pytest
import torch
from op_helpers import assert_close, assert_state_close, compare_backends, left_pad_mask, needs_interpreter

from lazoo.ops import ELA_KERNELS, ela
from lazoo.ops.ela import ela_feature_dim, ela_features, ela_kernel

F64 = torch.float64
B, H, D, DV = 3, 2, 6, 5
EPS = 1e-6


def make_inputs(T, scale=0.35, dtype=F64, b=B, seed=0):
    """Small q/k keep a·b > -1, so every kernel (magnitude_direction included) stays positive."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, T, H, D, generator=gen, dtype=F64) * scale for _ in range(2))
    v = torch.randn(b, T, H, DV, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (q, k, v)]


def quadratic(kernel, q, k, v, causal, mask=None, eps=EPS):
    """Σ_j k(q_i, k_j) v_j / max(Σ_j k(q_i, k_j), eps), the kernel evaluated from its definition."""
    K = ela_kernel(kernel, q, k)  # [B, H, T, S]
    if causal:
        K = K.tril()
    if mask is not None:
        K = K * mask[:, None, None, :]
    den = K.sum(-1).transpose(1, 2)[..., None]  # [B, T, H, 1]
    o = torch.einsum("bhts,bshv->bthv", K, v) / den.clamp_min(eps)
    if mask is not None:
        o = o * mask[..., None, None]
    return o, den


def real_state(kernel, seed=5):
    """A state as the op produces it: from a random prefix (so the normaliser is consistent)."""
    q, k, v = make_inputs(9, seed=seed)
    _, s = ela(q, k, v, kernel=kernel, output_final_state=True, backend="recurrent")
    return {key: x.detach() for key, x in s.items()}


# ----------------------------------------------------------------------------- the exactness claim
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_linear_form_equals_quadratic_kernel_attention(kernel, causal):
    T = 29
    q, k, v = make_inputs(T)
    mask = left_pad_mask([T, T - 6, T - 17], T, holes=[(0, 11)])
    for m in (None, mask):
        ref, den = quadratic(kernel, q, k, v, causal, m)
        real = torch.ones(B, T, dtype=torch.bool) if m is None else m
        assert den[real].min() > 1e-3, "inputs must keep the kernel sums well above eps"
        for backend in ("chunk", "recurrent"):
            o, _ = ela(q, k, v, kernel=kernel, causal=causal, mask=m, backend=backend, chunk_size=8)
            assert_close(o, ref, 1e-12, f"{kernel} {'causal' if causal else 'bidir'} {backend} mask={m is not None}")


def test_features_reproduce_the_kernels():
    q, k, _ = make_inputs(7)
    for kernel in ELA_KERNELS:
        fq, fk = ela_features(kernel, q, k)
        assert fq.shape[-1] == fk.shape[-1] == ela_feature_dim(kernel, D)
        assert_close(torch.einsum("bthf,bshf->bhts", fq, fk), ela_kernel(kernel, q, k), 1e-13, kernel)


# ----------------------------------------------------------------------------- chunk vs reference
@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_chunk_matches_recurrent_with_grads_mask_and_state(kernel, T):
    q, k, v = make_inputs(T, seed=1)
    state = real_state(kernel)
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)])
    leaves = {"q": q, "k": k, "v": v, "S0": state["S"], "C0": state["C"]}
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return ela(q, k, v, kernel=kernel, chunk_size=16, initial_state=state, output_final_state=True,
                   mask=mask, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_bidirectional_recurrent_matches_matmul_with_grads(kernel):
    q, k, v = make_inputs(19, seed=2)
    mask = left_pad_mask([19, 12, 4], 19, holes=[(0, 3)])
    leaves = {"q": q, "k": k, "v": v}
    for x in leaves.values():
        x.requires_grad_(True)
    compare_backends(lambda be: (ela(q, k, v, kernel=kernel, causal=False, mask=mask, backend=be)[0], None),
                     leaves, rtol=1e-10)


@pytest.mark.parametrize("kernel", ["hadamard_exp", "sub_sq_euclid"])
@pytest.mark.parametrize("causal", [True, False])
def test_left_padded_batch_equals_samples_one_by_one(kernel, causal):
    T, lengths = 21, [21, 14, 5]
    q, k, v = make_inputs(T, seed=3)
    q, k = q * 8, k * 8  # hadamard_exp: values where a plain exp would be far from 1
    mask = left_pad_mask(lengths, T)
    kw = dict(kernel=kernel, causal=causal, chunk_size=8)
    o, s = ela(q, k, v, mask=mask, output_final_state=causal, **kw)
    assert torch.all(o[~mask] == 0)
    for b, n in enumerate(lengths):
        sl = (slice(b, b + 1), slice(T - n, None))
        ob, sb = ela(q[sl], k[sl], v[sl], output_final_state=causal, **kw)
        assert_close(o[sl], ob, 1e-12, f"sample {b} output")
        if causal:
            assert_state_close({key: x[b:b + 1] for key, x in s.items()}, sb, 1e-12, f"sample {b} state")


@pytest.mark.parametrize("kernel", ["hadamard_exp", "magnitude_direction"])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_split_sequence_equals_one_pass(kernel, backend):
    T, cut = 29, 11
    q, k, v = make_inputs(T, seed=4)
    k = k + torch.linspace(0, 3, T, dtype=F64)[None, :, None, None]  # hadamard_exp: the max moves later
    mask = left_pad_mask([T, T - 3, T - 17], T)
    kw = dict(kernel=kernel, output_final_state=True, backend=backend, chunk_size=8)
    o, s = ela(q, k, v, mask=mask, **kw)
    o1, s1 = ela(q[:, :cut], k[:, :cut], v[:, :cut], mask=mask[:, :cut], **kw)
    o2, s2 = ela(q[:, cut:], k[:, cut:], v[:, cut:], mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split output")
    assert_state_close(s2, s, 1e-12, "split state")
    ref, _ = quadratic(kernel, q, k, v, True, mask)
    assert_close(o, ref, 1e-12, "vs quadratic")


def packed_case(kernel, lengths, seed=6):
    """Sequences of ``lengths`` (B = 1 each) packed along time, their boundaries and one state per sequence."""
    T = sum(lengths)
    q, k, v = make_inputs(T, b=1, seed=seed)
    k = k * 4  # hadamard_exp: the running max moves inside each sequence
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    states = [real_state(kernel, seed=seed + n) for n in range(len(lengths))]
    state = {key: torch.cat([st[key][:1] for st in states], 0) for key in states[0]}
    return (q, k, v), bounds, state


def assert_packed_equals_alone(kernel, backend, lengths, dtype=F64, tol=1e-12):
    (q, k, v), bounds, state = packed_case(kernel, lengths)
    cast = {key: x.to(dtype if dtype == F64 else torch.float32) for key, x in state.items()}
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    o, s = ela(*leaves, kernel=kernel, initial_state=cast, output_final_state=True, chunk_size=8, backend=backend,
               cu_seqlens=torch.tensor(bounds))
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = (slice(None), slice(lo, hi))
        alone = {key: x[n:n + 1] for key, x in state.items()}
        if hi > lo:
            o_n, s_n = ela(q[sl], k[sl], v[sl], kernel=kernel, initial_state=alone, output_final_state=True,
                           chunk_size=8, backend="recurrent")
            assert_close(o[sl].detach().double(), o_n, tol, f"sequence {n} output")
        else:
            s_n = alone  # an empty sequence passes its state through
        assert_state_close({key: x[n:n + 1].double() for key, x in s.items()}, s_n, tol, f"sequence {n} state")
    # gradients: the packed call against the sequences run one by one in one graph
    grads = torch.autograd.grad(o.double().square().sum(), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs = [ela(*(x[:, lo:hi] for x in ref_leaves), kernel=kernel, backend="recurrent",
                initial_state={key: x[n:n + 1] for key, x in state.items()})[0]
            for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo]
    ref = torch.autograd.grad(torch.cat(outs, 1).square().sum(), ref_leaves)
    for name, g, r in zip("qkv", grads, ref):
        assert_close(g.double(), r, tol * 10, f"grad {name}")


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_packed_sequences_equal_each_sequence_alone(kernel, backend):
    assert_packed_equals_alone(kernel, backend, [7, 0, 12, 5])


@pytest.mark.parametrize("kernel", ["hadamard_exp", "magnitude_direction"])
def test_packed_bidirectional_never_crosses_a_boundary(kernel):
    (q, k, v), bounds, _ = packed_case(kernel, [6, 9, 4])
    o, _ = ela(q, k, v, kernel=kernel, causal=False, cu_seqlens=torch.tensor(bounds))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        alone, _ = ela(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], kernel=kernel, causal=False)
        assert_close(o[:, lo:hi], alone, 1e-12, "bidirectional sequence")
    with pytest.raises(ValueError, match="either mask or cu_seqlens"):
        ela(q, k, v, kernel=kernel, mask=torch.ones(1, q.shape[1], dtype=torch.bool), cu_seqlens=torch.tensor(bounds))


@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_gradients_equal_the_quadratic_form_through_a_split(kernel):
    """Gradients of q, k, v against autograd through the quadratic form, the sequence run in two parts (the second
    from the first's state: the state's gradient path, e.g. hadamard_exp's log key sums, is exercised)."""
    T, cut = 23, 9
    q, k, v = make_inputs(T, seed=7)
    k = k + torch.linspace(0, 2, T, dtype=F64)[None, :, None, None]  # hadamard_exp: the max moves in part two
    mask = left_pad_mask([T, T - 4, T - 12], T)
    w = torch.randn(B, T, H, DV, generator=torch.Generator().manual_seed(3), dtype=F64)
    ref_l = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = quadratic(kernel, *ref_l, True, mask)
    g_ref = torch.autograd.grad((ref * w).sum(), ref_l)
    for backend in ("chunk", "recurrent"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        kw = dict(kernel=kernel, backend=backend, chunk_size=8)
        o1, s1 = ela(*(x[:, :cut] for x in leaves), mask=mask[:, :cut], output_final_state=True, **kw)
        o2, _ = ela(*(x[:, cut:] for x in leaves), mask=mask[:, cut:], initial_state=s1, **kw)
        g = torch.autograd.grad((torch.cat([o1, o2], 1) * w).sum(), leaves)
        for name, a, b in zip("qkv", g, g_ref):
            assert_close(a, b, 1e-10, f"{kernel} {backend} grad {name}")


# ----------------------------------------------------------------------------- finite exp, clamps, dtypes
@pytest.mark.parametrize("causal", [True, False])
def test_hadamard_exp_stays_finite_where_exp_overflows(causal):
    # exp overflows above ~88 in float32 and ~11 in float16; the shifted features never see it
    q, k, v = make_inputs(33, scale=1.0, seed=6)
    for dtype, amp in ((torch.float32, 45.0), (torch.float16, 7.0)):
        qa, ka = q * amp, k * amp
        ref, _ = quadratic("hadamard_exp", qa, ka, v, causal)  # float64: exp(±200) is representable
        for backend in ("chunk", "recurrent"):
            o, s = ela(qa.to(dtype), ka.to(dtype), v.to(dtype), causal=causal, backend=backend,
                       output_final_state=causal, chunk_size=16)
            assert o.dtype == dtype and torch.isfinite(o).all()
            # fp16 rounds the inputs themselves (relative 5e-4 of a value ~20 moves exp by ~1 %)
            ref_d, _ = quadratic("hadamard_exp", qa.to(dtype).double(), ka.to(dtype).double(),
                                 v.to(dtype).double(), causal)
            assert_close(o, ref_d, 1e-4 if dtype == torch.float32 else 2e-3, f"{dtype} {backend}")
            if causal:
                assert all(torch.isfinite(x).all() and x.dtype == torch.float32 for x in s.values())
        assert (ref.abs() > 0).any()


def test_denominator_clamp_for_vanishing_and_negative_kernels():
    v = torch.randn(1, 1, 1, DV, dtype=F64)
    q = torch.full((1, 1, 1, D), 0.7, dtype=F64)
    # sub_sq_euclid at k = q: k(q, q) = 0, so the denominator is clamped to eps and the output is 0
    o, _ = ela(q, q.clone(), v, kernel="sub_sq_euclid")
    assert torch.isfinite(o).all() and o.abs().max() < 1e-9
    # magnitude_direction with a·b = -2.94 < -1: a negative kernel sum is clamped to eps (sign of num kept)
    k = -q
    kern = ela_kernel("magnitude_direction", q, k)[0, 0, 0, 0]
    assert kern < 0
    for eps in (1e-6, 0.5):
        for causal in (True, False):
            o, _ = ela(q, k, v, kernel="magnitude_direction", eps=eps, causal=causal)
            assert_close(o, kern * v / eps, 1e-12, f"clamped output eps={eps}")
        ref, _ = quadratic("magnitude_direction", q, k, v, True, eps=eps)
        assert_close(o, ref, 1e-12, "quadratic form with the same clamp")


def test_float32_close_to_float64_and_state_dtype():
    q, k, v = make_inputs(37, seed=7)
    mask = left_pad_mask([37, 30, 20], 37)
    for kernel in ELA_KERNELS:
        ref, _ = ela(q, k, v, kernel=kernel, mask=mask, backend="recurrent")
        o, s = ela(q.float(), k.float(), v.float(), kernel=kernel, mask=mask, chunk_size=16, output_final_state=True)
        assert o.dtype == torch.float32 and all(x.dtype == torch.float32 for x in s.values())
        assert_close(o, ref, 1e-4, f"{kernel} fp32")
        assert s["S"].shape == (B, H, DV, ela_feature_dim(kernel, D))
        o, _ = ela(q.bfloat16(), k.bfloat16(), v.bfloat16(), kernel=kernel, mask=mask)
        assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()


def test_bad_arguments_raise_clear_errors():
    q, k, v = make_inputs(5)
    with pytest.raises(ValueError, match=r"unknown kernel 'softmax'.*hadamard_exp"):
        ela(q, k, v, kernel="softmax")
    with pytest.raises(ValueError, match="bidirectional.*no state"):
        ela(q, k, v, causal=False, output_final_state=True)
    with pytest.raises(ValueError, match=r"keys \['C', 'S', 'm'\]"):
        ela(q, k, v, initial_state={"S": torch.zeros(B, H, DV, D, dtype=F64), "C": torch.zeros(B, H, D, dtype=F64)})
    with pytest.raises(ValueError, match=r"initial_state\['S'\]"):
        ela(q, k, v, kernel="sum_sq_euclid",
            initial_state={"S": torch.zeros(B, H, DV, D, dtype=F64), "C": torch.zeros(B, H, D + 2, dtype=F64)})
    with pytest.raises(ValueError, match="eps"):
        ela(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match="unknown backend"):
        ela(q, k, v, backend="cuda")


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)
@needs_interpreter
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_interp_triton_matches_reference(kernel):
    """backend="triton" (the normalised kernel, or gla's for hadamard_exp), fp32, vs the float64 reference:
    outputs, final states and gradients at ragged T with a mask and a carried state; then a no-grad decode step."""
    from op_helpers import forward_and_grads

    T = 21
    q, k, v = make_inputs(T, seed=8)
    k = k * 6  # hadamard_exp: a spread where the shifts matter
    mask = left_pad_mask([T, T - 6, T - 13], T, holes=[(0, 4)])
    state = real_state(kernel)

    def run(backend, dtype):
        leaves = {n: x.detach().to(dtype).requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
        st = {key: x.to(torch.float32 if dtype != F64 else F64) for key, x in state.items()}
        return forward_and_grads(lambda: ela(leaves["q"], leaves["k"], leaves["v"], kernel=kernel, mask=mask,
                                             initial_state=st, output_final_state=True, chunk_size=16,
                                             backend=backend), leaves)

    o_r, s_r, g_r = run("recurrent", F64)
    o_t, s_t, g_t = run("triton", torch.float32)
    assert o_t.dtype == torch.float32
    assert_close(o_t, o_r, 1e-5, "output")
    assert_state_close(s_t, s_r, 1e-5, "final state")
    for name in g_r:
        assert_close(g_t[name], g_r[name], 1e-4, f"grad {name}")
    with torch.no_grad():  # decoding: a few tokens against the state
        o_d, _ = ela(q[:, :2].float(), k[:, :2].float(), v[:, :2].float(), kernel=kernel, backend="triton",
                     initial_state={key: x.float() for key, x in s_r.items()})
        o_dr, _ = ela(q[:, :2], k[:, :2], v[:, :2], kernel=kernel, backend="recurrent", initial_state=s_r)
    assert_close(o_d, o_dr, 1e-5, "decode")


@needs_interpreter
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_interp_triton_packed_sequences(kernel):
    """backend="triton" with cu_seqlens (the normalised-linear, linear and GLA kernels on packed sequences), fp32:
    each sequence as if alone, outputs, states and gradients."""
    assert_packed_equals_alone(kernel, "triton", [7, 0, 40, 5], dtype=torch.float32, tol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_interp_triton_bidirectional(kernel):
    """The bidirectional form on the normalised kernel (causal=False), fp32, vs the float64 reference: outputs and
    gradients with a mask (hadamard_exp with keys spread far beyond the causal form's limit: one shift is safe here),
    then packed sequences (one empty) against each sequence alone."""
    from op_helpers import forward_and_grads

    T = 21
    q, k, v = make_inputs(T, seed=8)
    if kernel == "hadamard_exp":
        k = k * 6 + torch.linspace(-40, 40, T, dtype=F64)[None, :, None, None]
    mask = left_pad_mask([T, T - 6, T - 13], T, holes=[(0, 4)])

    def run(backend, dtype, cu=None, leaves_from=(q, k, v), m=mask):
        leaves = {n: x.detach().to(dtype).requires_grad_(True) for n, x in zip("qkv", leaves_from)}
        return forward_and_grads(lambda: (ela(leaves["q"], leaves["k"], leaves["v"], kernel=kernel, causal=False,
                                              mask=m, chunk_size=16, backend=backend, cu_seqlens=cu)[0], None), leaves)

    o_r, _, g_r = run("recurrent", F64)
    o_t, _, g_t = run("triton", torch.float32)
    assert o_t.dtype == torch.float32 and torch.all(o_t[~mask] == 0)
    assert_close(o_t, o_r, 1e-5, "output")
    for name in g_r:
        assert_close(g_t[name], g_r[name], 1e-4, f"grad {name}")
    empty, _ = ela(*(x[:0].float() for x in (q, k, v)), kernel=kernel, causal=False, backend="triton")
    assert empty.shape == (0, T, H, DV)
    bounds = [0, 7, 7, 30, 35]  # packed: each sequence attends to itself only
    packed = [x[:1, :35] if x.shape[1] >= 35 else x[:1] for x in make_inputs(35, seed=9)]
    o_p, _, _ = run("triton", torch.float32, torch.tensor(bounds), packed, None)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            alone, _ = ela(*(x[:, lo:hi] for x in packed), kernel=kernel, causal=False, backend="recurrent")
            assert_close(o_p[:, lo:hi].double(), alone, 1e-5, f"sequence {lo}:{hi}")


@needs_interpreter
@pytest.mark.parametrize("limit", [60.0, 1.0], ids=["one-shift", "falls-back"])
def test_interp_triton_hadamard_exp_shift_and_fallback(limit, monkeypatch, caplog):
    """hadamard_exp on the normalised kernel with one shift per sequence (keys within the spread limit), and the
    running-max form where they spread further (said once): both match the float64 reference with a mask, a state
    and packed sequences, gradients included."""
    import importlib

    from op_helpers import forward_and_grads

    ela_module = importlib.import_module("lazoo.ops.ela")  # (lazoo.ops.ela is also the function's name)

    monkeypatch.setattr(ela_module, "EXP_SPREAD_LIMIT", limit)
    monkeypatch.setattr(ela_module, "_EXP_FALLBACK_SAID", set())
    T = 19
    q, k, v = make_inputs(T, seed=3)
    k = k * 4
    mask = left_pad_mask([T, T - 5, T - 11], T)
    state = real_state("hadamard_exp")

    def run(backend, dtype):
        leaves = {n: x.detach().to(dtype).requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
        st = {key: x.to(dtype) for key, x in state.items()}
        return forward_and_grads(lambda: ela(leaves["q"], leaves["k"], leaves["v"], kernel="hadamard_exp", mask=mask,
                                             initial_state=st, output_final_state=True, chunk_size=16,
                                             backend=backend), leaves)

    with caplog.at_level("WARNING", logger="lazoo"):
        o_t, s_t, g_t = run("triton", torch.float32)
        run("triton", torch.float32)
    o_r, s_r, g_r = run("recurrent", F64)
    assert_close(o_t, o_r, 1e-5, "output")
    assert_state_close(s_t, s_r, 1e-5, "final state")
    for name in g_r:
        assert_close(g_t[name], g_r[name], 1e-4, f"grad {name}")
    said = [r for r in caplog.records if "spread by more than" in r.getMessage()]
    assert len(said) == (0 if limit == 60.0 else 1), [r.getMessage() for r in said]


@needs_interpreter
def test_interp_triton_hadamard_exp_clamp_per_query():
    """Keys and queries near -9: the true denominators fall under eps for early tokens, so the clamp holds there;
    the normalised kernel's per-query clamp eps·exp(-M) gives the reference's max(den, eps)."""
    T = 23
    q, k, v = make_inputs(T, scale=0.1, seed=4)
    q, k = q - 9, k - 9
    o_r, _ = ela(q, k, v, kernel="hadamard_exp", eps=1e-6, backend="recurrent")
    den = torch.einsum("bihd,bjhd->bhij", q.exp(), k.exp()).tril().sum(-1)
    assert (den < 1e-6).any() and (den > 1e-6).any()  # both sides of the clamp
    o_t, _ = ela(q.float(), k.float(), v.float(), kernel="hadamard_exp", eps=1e-6, backend="triton", chunk_size=16)
    assert_close(o_t, o_r, 1e-5, "output")


# ----------------------------------------------------------------------------- GPU (-m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_cuda_auto_backend_matches_reference(kernel):
    """Auto backend on CUDA (the Triton kernels of linear_attention / gla): fp32 vs the float64 CPU reference
    with grads at a real head dim; bf16 and fp16 stay finite and close, states in fp32."""
    from op_helpers import forward_and_grads

    T, Dh = 300, 64
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(2, T, 2, Dh, generator=gen, dtype=F64) * 0.15 for _ in range(2))
    v = torch.randn(2, T, 2, Dh, generator=gen, dtype=F64)
    mask = left_pad_mask([T, T - 41], T)
    ref_l = {n: x.clone().requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
    o_r, s_r, g_r = forward_and_grads(lambda: ela(ref_l["q"], ref_l["k"], ref_l["v"], kernel=kernel, mask=mask,
                                                  output_final_state=True, backend="recurrent"), ref_l)
    cu = {n: x.detach().cuda().float().requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
    o, s, g = forward_and_grads(lambda: ela(cu["q"], cu["k"], cu["v"], kernel=kernel, mask=mask.cuda(),
                                            output_final_state=True), cu)
    assert_close(o.cpu(), o_r, 1e-4, "output")
    assert_state_close({key: x.cpu() for key, x in s.items()}, s_r, 1e-4, "state")
    for name in g_r:
        assert_close(g[name].cpu(), g_r[name], 1e-3, f"grad {name}")
    big = [x * 40 for x in (q, k)] + [v]
    big_ref, _ = ela(*big, kernel=kernel, backend="recurrent")
    for dtype in (torch.bfloat16, torch.float16):
        o, s = ela(*(x.cuda().to(dtype) for x in big), kernel=kernel, output_final_state=True)
        # finite wherever the float64 output fits the dtype (magnitude_direction's eps rows reach 1e17: inf in fp16)
        fits = big_ref.abs() <= torch.finfo(dtype).max / 2
        assert o.dtype == dtype and torch.isfinite(o.cpu()[fits]).all() and not torch.isnan(o).any()
        assert all(x.dtype == torch.float32 for x in s.values())
    # bf16 against float64 on the same rounded inputs: the polynomial kernels' split form (D features in the kernel in
    # bf16, the scalars in fp32) and hadamard_exp's bf16 features
    rounded = {n: x.to(torch.bfloat16).to(F64).requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
    o_r, s_r, g_r = forward_and_grads(lambda: ela(rounded["q"], rounded["k"], rounded["v"], kernel=kernel,
                                                  mask=mask, output_final_state=True, backend="recurrent"),
                                      rounded)
    cu = {n: x.detach().cuda().to(torch.bfloat16).requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v))}
    o, s, g = forward_and_grads(lambda: ela(cu["q"], cu["k"], cu["v"], kernel=kernel, mask=mask.cuda(),
                                            output_final_state=True), cu)
    assert o.dtype == torch.bfloat16
    assert_close(o.cpu(), o_r, 1e-2, "bf16 output")
    assert_state_close({key: x.cpu() for key, x in s.items()}, s_r, 1e-2, "bf16 state")
    for name in g_r:
        assert_close(g[name].cpu(), g_r[name], 3e-2, f"bf16 grad {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ELA_KERNELS)
def test_cuda_bidirectional_matches_reference(kernel):
    """The bidirectional form on CUDA (auto: the non-causal kernels) against the float64 CPU reference with grads:
    fp32, and bf16 on the same rounded inputs; packed sequences as each alone."""
    from op_helpers import forward_and_grads

    T, Dh = 300, 64
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(2, T, 2, Dh, generator=gen, dtype=F64) * 0.15 for _ in range(2))
    v = torch.randn(2, T, 2, Dh, generator=gen, dtype=F64)
    mask = left_pad_mask([T, T - 41], T)
    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        rounded = {n: x.to(dtype).to(F64).requires_grad_(True) for n, x in zip("qkv", (q, k, v))}
        o_r, _, g_r = forward_and_grads(lambda: (ela(rounded["q"], rounded["k"], rounded["v"], kernel=kernel,
                                                     causal=False, mask=mask, backend="recurrent")[0], None), rounded)
        cu = {n: x.detach().cuda().to(dtype).requires_grad_(True) for n, x in zip("qkv", (q, k, v))}
        o, _, g = forward_and_grads(lambda: (ela(cu["q"], cu["k"], cu["v"], kernel=kernel, causal=False,
                                                 mask=mask.cuda())[0], None), cu)
        assert o.dtype == dtype
        assert_close(o.cpu().double(), o_r, rtol, f"{dtype} output")
        for name in g_r:
            assert_close(g[name].cpu().double(), g_r[name], 3 * rtol, f"{dtype} grad {name}")
    bounds = [0, 100, 100, 260, 300]
    packed = [x[:1].cuda().float() for x in (q, k, v)]
    o, _ = ela(*packed, kernel=kernel, causal=False, cu_seqlens=torch.tensor(bounds, device="cuda"))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            alone, _ = ela(*(x[:1, lo:hi] for x in (q, k, v)), kernel=kernel, causal=False, backend="recurrent")
            assert_close(o[:, lo:hi].cpu().double(), alone, 1e-4, f"sequence {lo}:{hi}")
