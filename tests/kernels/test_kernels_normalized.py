"""The normalised linear-attention kernels (lazoo.kernels.normalized) against a float64 token-by-token loop: outputs,
final states and the gradients of q, k, v, the scalar features a, c and every part of the initial state, at ragged T,
with pads (k and c zero there), denominators under the clamp, and packed sequences with an empty one; the
non-causal form (every token reads its whole sequence's sums) likewise.

CPU (default run): the ``interp_*`` tests run under the Triton interpreter (tests/test_interpreter.py runs them).
GPU: ``-m gpu``, bf16 and fp32 at T = 2048 and D = 128."""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close, forward_and_grads, left_pad_mask, record_launches

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start "
                                                     "(tests/test_interpreter.py runs it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def reference(q, k, v, a, c, eps, state, cu_seqlens, causal=True):
    """Token by token in the inputs' dtype: ``(o, (h, he, z, ze))``, states as the kernel lays them out. Non-causal:
    the sums over the whole sequence first, then every token's output from them."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    E = 0 if a is None else a.shape[-1]
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [
        (0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outs, finals = torch.zeros_like(v).unbind(0), []
    outs = [list(x.unbind(0)) for x in outs]
    for n, (b, s, e) in enumerate(bounds):
        if state is None:
            h, he = q.new_zeros(H, V, K), q.new_zeros(H, V, E)
            z, ze = q.new_zeros(H, K), q.new_zeros(H, E)
        else:
            h, z = state[0][n], state[2][n]
            he, ze = (state[1][n], state[3][n]) if E else (q.new_zeros(H, V, 0), q.new_zeros(H, 0))
        def add(t, h, he, z, ze):  # token t into the sums
            h, z = h + v[b, t, :, :, None] * k[b, t, :, None, :], z + k[b, t]
            if E:
                he, ze = he + v[b, t, :, :, None] * c[b, t, :, None, :], ze + c[b, t]
            return h, he, z, ze

        if not causal:
            for t in range(s, e):
                h, he, z, ze = add(t, h, he, z, ze)
        for t in range(s, e):
            if causal:
                h, he, z, ze = add(t, h, he, z, ze)
            num = (h * q[b, t, :, None, :]).sum(-1)
            den = (z * q[b, t]).sum(-1)
            if E:
                num = num + (he * a[b, t, :, None, :]).sum(-1)
                den = den + (ze * a[b, t]).sum(-1)
            outs[b][t] = num / den.clamp_min(eps)[:, None]
        finals.append((h, he, z, ze))
    o = torch.stack([torch.stack(x, 0) for x in outs], 0)
    st = tuple(torch.stack([f[i] for f in finals], 0) for i in range(4))
    return o, (st if E else (st[0], None, st[2], None))


def make_inputs(B, T, H, K, V, E, seed, mask=None, clamped=()):
    """Positive features (denominators are sums of positive terms), except rows (b, t) with small negative q and a
    (den < 0: the clamp holds, and the numerator is not 0), and k, c zero at pads."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    a, c = (torch.rand(B, T, H, E, generator=gen, dtype=F64) * 2 for _ in range(2)) if E else (None, None)
    for b, t in clamped:
        q[b, t] *= -1e-3
        if E:
            a[b, t] *= -1e-3
    if mask is not None:
        k = k * mask[..., None, None]
        if E:
            c = c * mask[..., None, None]
    return q, k, v, a, c


def make_state(N, H, K, V, E, seed=9):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, V, K, generator=gen, dtype=F64)
    z = torch.rand(N, H, K, generator=gen, dtype=F64) * 3
    if not E:
        return (h, None, z, None)
    return (h, torch.randn(N, H, V, E, generator=gen, dtype=F64), z, torch.rand(N, H, E, generator=gen, dtype=F64))


def check(B, T, H, K, V, E, dtype, device, rtol, *, chunk=16, mask=None, cu=None, with_state=True, clamped=(),
          eps=1e-3, seed=0, grad_rtol=None, causal=True):
    from lazoo.kernels.normalized import chunk_normalized_linear_attention

    with_state = with_state and causal  # (the non-causal form has no state)
    q, k, v, a, c = make_inputs(B, T, H, K, V, E, seed, mask, clamped)
    N = B if cu is None else len(cu) - 1
    state = make_state(N, H, K, V, E) if with_state else None
    names = ["q", "k", "v"] + (["a", "c"] if E else [])
    tensors = dict(q=q, k=k, v=v, a=a, c=c)
    st_names = [n for n, x in zip(("h0", "he0", "z0", "ze0"), state or ()) if x is not None]

    def run(leaves, fn):
        st = None if state is None else tuple(leaves.get(n) for n in ("h0", "he0", "z0", "ze0"))
        o, final = fn(*(leaves.get(n) for n in ("q", "k", "v", "a", "c")), st)
        return o, {f"final_{i}": x for i, x in enumerate(final if causal else ()) if x is not None}

    # the float64 reference runs token by token on the kernels' device: on a GPU its autograd graph over thousands
    # of tokens takes seconds, where the CPU took minutes
    ref_leaves = {n: tensors[n].to(device, copy=True).requires_grad_(True) for n in names}
    ref_leaves.update({n: x.to(device, copy=True).requires_grad_(True)
                       for n, x in zip(("h0", "he0", "z0", "ze0"), state or ()) if x is not None})
    o_r, s_r, g_r = forward_and_grads(
        lambda: run(ref_leaves, lambda q_, k_, v_, a_, c_, st: reference(q_, k_, v_, a_, c_, eps, st, cu, causal)),
        ref_leaves)
    o_r, s_r = o_r.cpu(), {n: x.cpu() for n, x in s_r.items()}
    g_r = {n: x if x is None else x.cpu() for n, x in g_r.items()}
    tri_leaves = {n: x.detach().to(device, dtype if n in ("q", "k", "v") else torch.float32).requires_grad_(True)
                  for n, x in ref_leaves.items()}
    cu_d = None if cu is None else cu.to(device)
    o, s, g = forward_and_grads(
        lambda: run(tri_leaves, lambda q_, k_, v_, a_, c_, st: chunk_normalized_linear_attention(
            q_, k_, v_, a_, c_, eps=eps, initial_state=st, output_final_state=causal, cu_seqlens=cu_d,
            chunk_size=chunk, causal=causal)), tri_leaves)
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    # outputs at pads are not defined (the op zeroes them): compared at real tokens only
    assert_close(o.cpu().double()[real], o_r[real], rtol, "output")
    assert sorted(s) == sorted(s_r), (sorted(s), sorted(s_r))
    for name in s_r:
        assert_close(s[name].cpu().double(), s_r[name], rtol, name)
    for name in list(names) + st_names:
        assert g[name] is not None, f"no gradient reaches {name}"
        assert_close(g[name].cpu().double(), g_r[name], grad_rtol or rtol, f"grad {name}")


@needs_interp
@pytest.mark.parametrize("E", [0, 1, 2], ids=["plain", "one-scalar", "scalars"])
def test_interp_matches_reference_with_pads_and_clamps(E):
    B, T, H, K, V = 2, 37, 2, 24, 20  # T ragged against chunks of 16; K, V not powers of two
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 20)])
    # two real rows under the clamp (den < 0: no gradient through den)
    check(B, T, H, K, V, E, torch.float32, "cpu", 2e-5, mask=mask, clamped=[(0, 5), (1, 30)])


@needs_interp
def test_interp_packed_sequences_with_an_empty_one():
    cu = torch.tensor([0, 7, 7, 30, 45])
    check(1, 45, 2, 16, 16, 2, torch.float32, "cpu", 2e-5, cu=cu, chunk=16)


@needs_interp
def test_interp_from_zero_state_one_chunk_width():
    check(2, 64, 1, 16, 32, 1, torch.float32, "cpu", 2e-5, chunk=32, with_state=False)


@needs_interp
def test_interp_several_key_and_value_blocks():
    """K, V over several blocks of the state kernels (the last ones ragged): each role (h tiles, z key blocks, he
    value blocks, ze) from a given state to the final one."""
    check(2, 40, 1, 72, 80, 2, torch.float32, "cpu", 2e-5, chunk=16, mask=left_pad_mask([40, 31], 40))


@needs_interp
@pytest.mark.parametrize("E", [0, 1, 2], ids=["plain", "one-scalar", "scalars"])
def test_interp_non_causal_with_pads_and_clamps(E):
    """Every token reads its whole sequence's sums (no score tiles), from the same kernels: pads add nothing, rows
    under the clamp, K and V over several blocks of the state kernels."""
    B, T, H, K, V = 2, 37, 2, 72, 20
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 20)])
    check(B, T, H, K, V, E, torch.float32, "cpu", 2e-5, mask=mask, clamped=[(0, 5), (1, 30)], causal=False)


@needs_interp
def test_interp_non_causal_packed_sequences_with_an_empty_one():
    """Packed sequences: each token reads its own sequence's sums only (chunks of 16 straddle no sequence)."""
    cu = torch.tensor([0, 7, 7, 30, 45])
    check(1, 45, 2, 16, 24, 2, torch.float32, "cpu", 2e-5, cu=cu, chunk=16, causal=False)


@needs_interp
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("E", [0, 2], ids=["plain", "scalars"])
def test_interp_state_walks_in_segments(E, causal, monkeypatch):
    """The state walks split into segments of 2 chunks (the last one shorter), as at long T with a small batch: every
    role's segment sums, their prefix sums from the initial state (and, in reverse, from the final state's gradient),
    the walks from each segment's start; non-causal, the sums' total. K and V over several blocks."""
    import importlib

    kn = importlib.import_module("lazoo.kernels.normalized")
    monkeypatch.setattr(kn, "FORCE_SEGMENT_CHUNKS", 2)
    grids = record_launches(monkeypatch, kn, "_fwd_h_kernel", "_bwd_dh_kernel")
    T = 80  # 5 chunks of 16: segments of 2, 2 and 1
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 20)])
    check(2, T, 2, 72, 40, E, torch.float32, "cpu", 2e-5, mask=mask, causal=causal)
    assert len(grids) == (4 if causal else 2) and all(g[2] == 3 for g in grids), grids


@needs_interp
@pytest.mark.parametrize("E", [0, 2], ids=["plain", "scalars"])
def test_interp_dv_kernel_with_scalar_features_only(E, monkeypatch):
    """With scalar features dv comes from a kernel of its own (the dq, dk, dv kernel forms it otherwise); both
    against float64 with gradients, several value blocks."""
    import importlib

    kn = importlib.import_module("lazoo.kernels.normalized")
    grids = record_launches(monkeypatch, kn, "_bwd_dv_kernel")
    check(2, 40, 1, 24, 80, E, torch.float32, "cpu", 2e-5, chunk=16, mask=left_pad_mask([40, 31], 40))
    assert [g[0] for g in grids] == ([2] if E else []), grids


@needs_interp
def test_interp_refuses_what_it_does_not_take():
    from lazoo.kernels.normalized import chunk_normalized_linear_attention

    x = torch.ones(1, 4, 1, 16)
    with pytest.raises(ValueError, match="both scalar features"):
        chunk_normalized_linear_attention(x, x, x, x[..., :2])
    with pytest.raises(ValueError, match="E <= 2"):
        chunk_normalized_linear_attention(x, x, x, x[..., :3], x[..., :3])
    with pytest.raises(ValueError, match="eps per row must be"):
        chunk_normalized_linear_attention(x, x, x, eps=torch.ones(1, 4))
    h0, z0 = torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="exactly when there are scalar features"):
        chunk_normalized_linear_attention(x, x, x, x[..., :2], x[..., :2], initial_state=(h0, None, z0, None))
    with pytest.raises(ValueError, match="non-causal form .* has no state"):
        chunk_normalized_linear_attention(x, x, x, output_final_state=True, causal=False)
    with pytest.raises(ValueError, match="exp_of is .* without scalar features"):
        chunk_normalized_linear_attention(x, x, x, x[..., :2], x[..., :2], exp_of=(x, x))
    with pytest.raises(ValueError, match="exp_of is .* of q's and k's shapes"):
        chunk_normalized_linear_attention(x, x, x, exp_of=(x[:, :3], x))
    with pytest.raises(ValueError, match="poly_of is .* with scalar features"):
        chunk_normalized_linear_attention(x, x, x, poly_of=(x, x, False, 2.0))
    with pytest.raises(ValueError, match="sign ±2 unless magnitude"):
        chunk_normalized_linear_attention(x, x, x, x[..., :2], x[..., :2], poly_of=(x, x, False, 1.0))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,rtol,E", [
    (torch.bfloat16, 2e-2, 0), (torch.float16, 1e-2, 0), (torch.float32, 1e-4, 0),
    (torch.bfloat16, 2e-2, 1), (torch.float32, 1e-4, 1), (torch.bfloat16, 2e-2, 2), (torch.float32, 1e-4, 2)],
    ids=["plain-bf16", "plain-fp16", "plain-fp32", "one-scalar-bf16", "one-scalar-fp32", "two-scalars-bf16",
         "two-scalars-fp32"])
def test_gpu_matches_reference(dtype, rtol, E):
    # no rows under the clamp here: their outputs (num / eps) would set the scale of the relative errors and hide
    # the others' (the interpreter tests cover the clamp); an output block of 128 in the output kernel failed this
    T = 2048
    mask = left_pad_mask([T, T - 300], T, holes=[(0, 1000)])
    check(2, T, 2, 128, 128, E, dtype, "cuda", rtol, chunk=64, mask=mask, grad_rtol=3 * rtol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,rtol,E", [(torch.bfloat16, 2e-2, 0), (torch.float32, 1e-4, 0),
                                          (torch.bfloat16, 2e-2, 2), (torch.float32, 1e-4, 2)],
                         ids=["plain-bf16", "plain-fp32", "two-scalars-bf16", "two-scalars-fp32"])
def test_gpu_non_causal(dtype, rtol, E):
    T = 1500
    mask = left_pad_mask([T, T - 300], T, holes=[(0, 700)])
    check(2, T, 2, 128, 128, E, dtype, "cuda", rtol, chunk=64, mask=mask, grad_rtol=3 * rtol, causal=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_gpu_state_walks_in_segments(dtype, rtol, causal, monkeypatch):
    """The state walks in segments of 7 chunks (the last one shorter) on the GPU, scalar features, pads."""
    import importlib

    monkeypatch.setattr(importlib.import_module("lazoo.kernels.normalized"), "FORCE_SEGMENT_CHUNKS", 7)
    T = 1500  # 24 chunks of 64
    check(1, T, 2, 128, 128, 2, dtype, "cuda", rtol, chunk=64, mask=left_pad_mask([T - 70], T), grad_rtol=3 * rtol,
          causal=causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2), (torch.float32, 1e-4)],
                         ids=["bf16", "fp16", "fp32"])
def test_gpu_scalar_features_every_dtype(dtype, rtol, causal):
    """Two scalar features (dv from its own kernel), pads, causal and not, at each input dtype."""
    T = 1500
    check(2, T, 2, 128, 128, 2, dtype, "cuda", rtol, chunk=64, mask=left_pad_mask([T, T - 300], T, holes=[(0, 700)]),
          grad_rtol=3 * rtol, causal=causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_gpu_head_dim_256(dtype, rtol):
    """The largest head dim: the dq, dk, dv kernel holds a whole key row (fp32 falls back to a smaller value block
    when the first does not fit the shared memory)."""
    T = 600
    check(1, T, 2, 256, 256, 2, dtype, "cuda", rtol, chunk=64, mask=left_pad_mask([T - 50], T), grad_rtol=3 * rtol)
