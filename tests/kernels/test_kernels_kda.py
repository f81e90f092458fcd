"""The Kimi Delta Attention kernels (lazoo.kernels.kda: the delta rule with a decay per key channel, "Kimi Linear:
An Expressive, Efficient Attention Architecture", Kimi Team, 2025) through ``ops.kda(backend="triton")``, against
the float64 step-by-step reference: outputs, final states and the gradients of q, k, v, g, β and the initial state,
at ragged T (not multiples of the 16-row sub-chunk or the 64-row chunk), with left padding and holes, packed
sequences (an empty one among them), grouped value heads, and decays strong enough (log decay −5 to −40 per step in
every third key dim) that exp(−G) over a chunk overflows if it is ever formed; the decode kernel, a prompt then a
few tokens at a time, against one pass.

CPU (default run): the ``interp_*`` tests run in a fresh process with ``TRITON_INTERPRET=1``
(``tests/test_interpreter.py``); the wider matrix is ``-m slow``. ``-m gpu``: T = 1000 in fp32 and bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close, forward_and_grads, kda_inputs, left_pad_mask, prefill_then_steps, record_launches

from lazoo import ops

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

needs_interp = pytest.mark.skipif(
    not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
NAMES = ("q", "k", "v", "g", "beta")


def check(x, dtype, rtol, grad_rtol=None, device="cpu", **kw):
    """Triton in ``dtype`` (g, β and the state in float32) against the float64 recurrent reference on the CPU."""
    ref = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    run = lambda L, be: ops.kda(*(L[n] for n in NAMES), initial_state=L["S0"], output_final_state=True,  # noqa: E731
                                backend=be, **{k: (v if v is None else v.to(L["q"].device)) for k, v in kw.items()})
    o_r, s_r, g_r = forward_and_grads(lambda: run(ref, "recurrent"), ref)
    tri = {n: t.detach().to(device, dtype if n in ("q", "k", "v") else torch.float32).requires_grad_(True)
           for n, t in x.items()}
    o, s, g = forward_and_grads(lambda: run(tri, "triton"), tri)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o.cpu(), o_r, rtol, "output")
    assert_close(s.cpu(), s_r, rtol, "final state")
    for name in x:
        assert g[name] is not None, f"no gradient reaches {name}"
        assert_close(g[name].cpu(), g_r[name], grad_rtol or rtol, f"grad {name}")


@pytest.fixture
def chunk_launches(monkeypatch):
    """The grids of the chunk kernels' launches (the op must take the chunk path, not the decode kernel)."""
    from lazoo.kernels import kda as kk

    return record_launches(monkeypatch, kk, "_fwd_h_kernel", "_bwd_intra_kernel")


def test_kda_uniform_chunk_tables_are_built_once():
    """One chunk table per uniform (B, T, device), the same as a fresh one; packed batches build theirs once per
    cu_seqlens tensor (tests/ops/test_ops_packing_tables.py); the cache keeps at most 64 shapes."""
    from lazoo.kernels import _chunk_layout
    from lazoo.kernels import kda as kk

    cpu = torch.device("cpu")
    a = kk.seqs_for(2, 70, None, cpu)
    assert kk.seqs_for(2, 70, None, cpu) is a and kk.seqs_for(2, 71, None, cpu) is not a
    fresh = kk._Seqs(2, 70, None, cpu)
    assert a.NT == fresh.NT == 4
    assert all(torch.equal(getattr(a, n), getattr(fresh, n)) for n in ("cu", "coff", "chunks"))
    cu = torch.tensor([0, 30, 70])
    assert kk.seqs_for(1, 70, cu, cpu) is kk.seqs_for(1, 70, cu, cpu)
    assert kk.seqs_for(1, 70, cu.clone(), cpu) is not kk.seqs_for(1, 70, cu, cpu)
    cache, built = {}, []
    for i in range(65):
        _chunk_layout.cached_uniform(cache, (i,), cpu, lambda: built.append(1))
    assert len(built) == 65 and len(cache) == 1


def test_kda_value_block_set_in_the_option_table():
    """A "BV" in a kernel's launch entry sets its value block on a GPU (capped at dv's power of two) and never
    reaches the launch options; the interpreter keeps the default block; the shipped table sets none."""
    from lazoo.kernels import kda as kk

    table = {"fwd_o": {"num_warps": 8, "num_stages": 2, "BV": 128}, "fwd_h": {"num_warps": 8}}
    assert kk._with_bv(table, "fwd_o", 64, 128, interp=False) == (128, {"num_warps": 8, "num_stages": 2})
    assert kk._with_bv(table, "fwd_o", 64, 48, interp=False)[0] == 64
    assert kk._with_bv(table, "fwd_o", 128, 128, interp=True)[0] == 128
    assert kk._with_bv(table, "fwd_h", 64, 128, interp=False) == (64, {"num_warps": 8})
    assert table["fwd_o"]["BV"] == 128  # the table is left as it was
    assert not any("BV" in cfg for t in (kk.LAUNCH, kk.LAUNCH_FP32) for cfg in t.values())


def test_kda_wy_backward_takes_fewer_warps_at_dk_16():
    """_bwd_wy at dk = 16 launches at no more than SMALL_DK_WY_WARPS warps on a GPU (at 8, fp32, Triton 3.6 faulted
    on an H200); wider keys and the interpreter keep the table's options."""
    from lazoo.kernels import kda as kk

    for table in (kk.LAUNCH, kk.LAUNCH_FP32):
        assert table["bwd_wy"]["num_warps"] > kk.SMALL_DK_WY_WARPS  # else the rule below tests nothing
        assert kk.wy_launch(table, 16, 16, 16, interp=False)[1]["num_warps"] == kk.SMALL_DK_WY_WARPS
        assert kk.wy_launch(table, 32, 32, 32, interp=False)[1] == table["bwd_wy"]
        assert kk.wy_launch(table, 128, 64, 128, interp=False) == (64, table["bwd_wy"])
        assert kk.wy_launch(table, 16, 16, 16, interp=True)[1] == table["bwd_wy"]


# ============================================================================ CPU: the interpreter
@needs_interp
def test_interp_kda_chunk_ragged_padded_strong(chunk_launches):
    """T = 70 (a chunk of 64 and one of 6, its last sub-chunk ragged), left padding and a hole, strong decays."""
    T = 70
    x = kda_inputs(2, T, 1, 16, 16, seed=1, strong=True)
    check(x, torch.float32, 1e-5, mask=left_pad_mask([T, T - 11], T, holes=[(0, 40)]))
    assert chunk_launches


@needs_interp
def test_interp_kda_chunk_packed_grouped_values(chunk_launches):
    """Packed sequences (37, 0 and 83 tokens) with two value heads per query/key head and dv ≠ dk."""
    cu = torch.tensor([0, 37, 37, 120])
    x = kda_inputs(1, 120, 1, 16, 32, HV=2, seed=2, strong=True)
    x["S0"] = torch.randn(3, 2, 32, 16, dtype=torch.float64)
    check(x, torch.float32, 1e-5, cu_seqlens=cu)
    assert chunk_launches


def chunk_intermediates_f64(x, cu):
    """Aqk, Mkk and A = (I + diag(β) Mkk)^{-1} of every chunk of 64 rows of every sequence, float64, in the kernels'
    layout ``[TT, HV, 64]`` (zeros outside each chunk's lower triangle), from the chunk form's formulas."""
    q, k, g, beta = (x[n][0] for n in ("q", "k", "g", "beta"))
    TT, HV = g.shape[:2]
    m = HV // q.shape[1]
    out = [torch.zeros(TT, HV, 64, dtype=torch.float64) for _ in range(3)]
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for s in range(bos, eos, 64):
            e = min(s + 64, eos)
            n = e - s
            for h in range(HV):
                G = g[s:e, h].cumsum(0)
                D = (G[:, None] - G[None, :]).masked_fill(~torch.ones(n, n).tril().bool()[..., None], -torch.inf)
                qh, kh = q[s:e, h // m], k[s:e, h // m]
                aqk = torch.einsum("td,id,tid->ti", qh, kh, D.exp())
                mkk = torch.einsum("td,id,tid->ti", kh, kh, D.exp()).tril(-1)
                a = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + beta[s:e, h, None] * mkk)
                for dst, val in zip(out, (aqk, mkk, a)):
                    dst[s:e, h, :n] = val
    return out


@needs_interp
def test_interp_kda_backward_channel_slices(chunk_launches):
    """dk = 48: the intra-chunk backward runs two channel slices of 32, the second with 16 real channels; every
    gradient against float64, packed sequences (a chunk of 64 and a ragged one)."""
    from lazoo.kernels import kda as kk

    assert kk.INTRA_BWD_CHANNELS == 32
    x = kda_inputs(1, 90, 1, 48, 16, seed=4, strong=True)
    x["S0"] = torch.randn(2, 1, 16, 48, dtype=torch.float64)
    check(x, torch.float32, 1e-5, cu_seqlens=torch.tensor([0, 70, 90]))
    assert (3 * 2, 1) in chunk_launches  # 3 chunks, 2 channel slices, 1 head


@needs_interp
def test_interp_kda_chunk_intermediates_packed():
    """Aqk, Mkk and A as the forward stores them (fp32 inputs, strong decays, grouped value heads) against float64,
    with packed sequences of 37 (its end cuts a sub-chunk after 5 rows), 0, 1 and 82 tokens (a last chunk of 18:
    a sub-chunk of 2 rows, two sub-chunks past the end)."""
    from lazoo.kernels import kda as kk

    cu = torch.tensor([0, 37, 37, 38, 120])
    x = kda_inputs(1, 120, 2, 16, 16, HV=4, seed=7, strong=True)
    f = {n: x[n][0].float().contiguous() for n in NAMES}
    seqs = kk._Seqs(1, 120, cu, torch.device("cpu"))
    _, _, saved = kk.chunk_fwd(f["q"], f["k"], f["v"], f["g"], f["beta"], None, 1.0, seqs, False)
    Aqk, Mkk, A = saved[1:4]
    ref = chunk_intermediates_f64(x, cu)
    for name, got, want, rtol in zip(("Aqk", "Mkk", "A"), (Aqk, Mkk, A), ref, (1e-6, 1e-6, 1e-5)):
        assert got.dtype == torch.float32, name
        assert_close(got, want, rtol, name)


def mixed_decay_inputs():
    """Packed sequences of 70 and 50 tokens, dk = 48 (two channel slices in the backward), two value heads a key
    head, mild decays except key dim 5 of value head 0 at tokens 54-63 (-70 a step, to the first chunk's end: no
    later row of the chunk carries a large G, whose float32 rounding would cost both paths alike): that sub-chunk's
    diagonal block is beyond DIAG_PRODUCT_RANGE in the forward and in the backward's first channel slice, and within
    it in the second slice; every other block is within."""
    x = kda_inputs(1, 120, 1, 48, 16, HV=2, seed=13)
    x["g"][0, 54:64, 0, 5] = -70.0
    x["S0"] = torch.randn(2, 2, 16, 48, dtype=torch.float64)
    return x, torch.tensor([0, 70, 120])


@needs_interp
@pytest.mark.parametrize("product_range", [None, -1.0, 1e30], ids=["default", "pairs_only", "products_where_finite"])
def test_interp_kda_diagonal_blocks_by_product_or_pairs(monkeypatch, product_range):
    """The diagonal 16x16 blocks, as products through the middle row where the decays allow and pair by pair
    otherwise (per block in the forward, per block and channel slice in the backward), against float64: outputs,
    states, every gradient. pairs_only takes the pair path everywhere; products_where_finite (mild decays only) the
    product path everywhere."""
    from lazoo.kernels import kda as kk

    x, cu = mixed_decay_inputs()
    if product_range is not None:
        monkeypatch.setattr(kk, "DIAG_PRODUCT_RANGE", product_range)
    if product_range == 1e30:
        x["g"][0, 54:64, 0, 5] = -0.1
    check(x, torch.float32, 1e-5, cu_seqlens=cu)


@needs_interp
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unguarded product overflows, as it should here
def test_interp_kda_range_guard_routes_strong_decays_to_pairs(monkeypatch):
    """With the range guard lifted, the one diagonal block beyond DIAG_PRODUCT_RANGE comes out wrong (the product
    overflows: so the product path makes the blocks the guard lets through) and every other entry of Aqk and Mkk
    still equals float64; with the guard in place that block is exact too (the pair path)."""
    from lazoo.kernels import kda as kk

    x, cu = mixed_decay_inputs()
    f = {n: x[n][0].float().contiguous() for n in NAMES}
    seqs = kk._Seqs(1, 120, cu, torch.device("cpu"))
    ref_aqk, ref_mkk = chunk_intermediates_f64(x, cu)[:2]
    beyond = (slice(48, 64), 0, slice(48, 64))  # sequence 0, chunk 0, sub-chunk 3, value head 0
    for product_range in (1e30, kk.DIAG_PRODUCT_RANGE):
        monkeypatch.setattr(kk, "DIAG_PRODUCT_RANGE", product_range)
        Aqk, Mkk = kk.chunk_fwd(f["q"], f["k"], f["v"], f["g"], f["beta"], None, 1.0, seqs, False)[2][1:3]
        for got, want, name in ((Aqk, ref_aqk, "Aqk"), (Mkk, ref_mkk, "Mkk")):
            got = got.double().clone()
            err = float((got[beyond] - want[beyond]).norm() / want[beyond].norm())  # NaN where it overflowed
            ok = err <= 1e-6
            assert ok == (product_range < 1e30), (name, product_range, err)
            if not ok:
                got[beyond] = want[beyond]
            assert_close(got, want, 1e-6, name)


@needs_interp
def test_interp_kda_no_future_token_reaches_an_output():
    """Decays 30 stronger at the 5 tokens after t (inside t's sub-chunk, at a chunk's end, across a chunk's
    boundary) leave the outputs up to t bitwise as they were: no pair, reference row or product lets a later row
    into an earlier one."""
    T = 70
    x = {n: t.float() for n, t in kda_inputs(1, T, 1, 16, 16, HV=2, seed=8, strong=True).items()}
    run = lambda g: ops.kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["S0"], backend="triton")[0]  # noqa: E731
    o = run(x["g"])
    for t in (0, 20, 33, 47, 61, 64):
        g = x["g"].clone()
        g[:, t + 1:t + 6] -= 30
        assert torch.equal(run(g)[:, :t + 1], o[:, :t + 1]), t


def positive_gate_is_named(route, device):
    """A log decay g > 0 at a real token is refused with its value, whether the chunk kernels' first kernel compares
    (with autograd, or a long prompt) or the op does (the decode kernel); the same g > 0 at a pad passes."""
    T = 70 if route == "chunk" else 5
    x = {n: t.float().to(device) for n, t in kda_inputs(1, T, 1, 16, 16, HV=2, seed=9).items()}
    g = x["g"].clone()
    g[0, T - 3, 1, 7] = 0.25
    with pytest.raises(ValueError, match=r"g must lie in \[-inf, 0\] at real tokens.*got 0\.25"):
        ops.kda(x["q"], x["k"], x["v"], g, x["beta"], backend="triton")
    mask = torch.ones(1, T, dtype=torch.bool, device=device)
    mask[0, T - 3] = False
    o = ops.kda(x["q"], x["k"], x["v"], g, x["beta"], mask=mask, backend="triton")[0]
    assert torch.isfinite(o).all()
    if route == "chunk":  # with autograd too (the chunk kernels whatever T)
        q = x["q"][:, :5].clone().requires_grad_()
        with pytest.raises(ValueError, match="g must lie in"):
            ops.kda(q, x["k"][:, :5], x["v"][:, :5], g[:, T - 5:], x["beta"][:, :5], backend="triton")


@needs_interp
@pytest.mark.parametrize("route", ["chunk", "decode"])
def test_interp_kda_positive_gate_is_named_on_both_routes(route):
    positive_gate_is_named(route, "cpu")


@needs_interp
def test_interp_kda_prefill_then_decode_equals_one_pass():
    """The chunk kernel over a prompt, then the fused recurrent kernel (no autograd) a few tokens at a time, with
    grouped value heads: outputs and state equal the float64 pass over the whole sequence."""
    T, cut = 45, 37
    x = {n: t.float() for n, t in kda_inputs(2, T, 1, 16, 16, HV=2, seed=5, strong=True).items()}
    run = lambda sl, st, backend: ops.kda(*(x[n][:, sl] for n in NAMES), initial_state=st,  # noqa: E731
                                          output_final_state=True, backend=backend)
    ref_o, ref_s = ops.kda(*(x[n].double() for n in NAMES), initial_state=x["S0"].double(), output_final_state=True,
                           backend="recurrent")
    o, s = prefill_then_steps(lambda sl, st: run(sl, st, "triton"), T, cut, x["S0"])
    assert_close(o, ref_o, 1e-5, "prefill + decode output")
    assert_close(s, ref_s, 1e-5, "prefill + decode state")


@needs_interp
def test_interp_kda_kernels_refuse_what_they_cannot_run():
    from lazoo.kernels.kda import chunk_kda, fused_recurrent_kda

    q = torch.randn(1, 20, 1, 144)
    v = torch.randn(1, 20, 1, 16)
    with pytest.raises(ValueError, match="head dims from 16 to 128"):
        chunk_kda(q, q, v, -q.abs(), torch.rand(1, 20, 1), scale=1.0)
    q = torch.randn(1, 20, 2, 16)
    with pytest.raises(ValueError, match="beta must be a float tensor"):
        fused_recurrent_kda(q, q, q, -q.abs(), torch.rand(1, 20, 1), scale=1.0)
    with pytest.raises(NotImplementedError, match="head dims of at least 16"):
        ops.kda(q[..., :8], q[..., :8], q, -q[..., :8].abs(), torch.rand(1, 20, 2), backend="triton")


def kimi_gate_inputs(B, T, H, D, seed=0):
    """bf16 unit-norm q, k, bf16 v and β, and a float32 log decay shaped as Kimi Linear's gate,
    −exp(A_log)·softplus(x + dt_bias) with exp(A_log) from 1 to 16 per head and dt from 1e-3 to 1e-1 per channel."""
    import math

    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=gen)
    decay = torch.empty(H).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(H, D).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -decay[:, None] * torch.nn.functional.softplus(torch.randn(B, T, H, D, generator=gen) + dt_bias)
    beta = torch.rand(B, T, H, generator=gen)
    bf16 = torch.bfloat16
    return {"q": q.to(bf16), "k": k.to(bf16), "v": v.to(bf16), "g": g, "beta": beta.to(bf16)}


@needs_interp
def test_interp_kda_bf16_gradients_of_k_g_beta_as_accurate_as_q_v():
    """bf16 inputs (products as a GPU computes them, tests/interp_bf16.py), Kimi Linear's gate, two chunks (the
    second ragged): the errors of dk, dg and dβ against float64 stay within twice those of dq and dv (all about
    3e-3 here; an H200 once gave 0.022-0.030 for dk, dg, dβ against 0.003 for dq, dv, from a race in the compiled
    _bwd_inter, which kernel_resources.inflight_refills now guards)."""
    from interp_bf16 import gpu_like_bf16

    def rel_err(a, b):  # Frobenius, as experiments/kda_vs_fla.py measures
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    x = kimi_gate_inputs(1, 100, 2, 64, seed=3)
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref = {n: t.double().requires_grad_(True) for n, t in x.items()}
    o_ref = ops.kda(*ref.values(), use_qk_l2norm=False, backend="recurrent")[0]
    g_ref = torch.autograd.grad(o_ref, list(ref.values()), do.double())
    tri = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    with gpu_like_bf16():
        o = ops.kda(*tri.values(), use_qk_l2norm=False, backend="triton")[0]
        grads = torch.autograd.grad(o, list(tri.values()), do)
    err = {"o": rel_err(o, o_ref), **{n: rel_err(a, b) for n, a, b in zip(tri, grads, g_ref)}}
    assert max(err.values()) < 1e-2, err
    for name in ("k", "g", "beta"):
        assert err[name] <= 2 * max(err["q"], err["v"]), (name, err)


@needs_interp
@pytest.mark.slow
@pytest.mark.parametrize("T,HK,HV,dk,dv,dtype", [(100, 2, 2, 32, 16, torch.float32), (129, 1, 1, 64, 48, torch.float32),
                                                 (37, 2, 4, 16, 16, torch.float16), (64, 1, 1, 128, 16, torch.float32)])
def test_interp_kda_chunk_matrix(T, HK, HV, dk, dv, dtype):
    x = kda_inputs(2, T, HK, dk, dv, HV=HV, seed=T, strong=True)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    check(x, dtype, rtol, grad_rtol=None if dtype == torch.float32 else 3e-2,
          mask=left_pad_mask([T, T - 5], T, holes=[(1, T // 2)]))


# ============================================================================ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 2e-2, 3e-2)])
@pytest.mark.parametrize("HV", [4, 8])
def test_cuda_kda_kernels_match_float64(dtype, rtol, grad_rtol, HV):
    """T = 1000 (ragged), dk = dv = 128, left padding, strong decays: fp32 and bf16 against float64."""
    T = 1000
    x = kda_inputs(2, T, 4, 128, 128, HV=HV, seed=11, strong=True)
    check(x, dtype, rtol, grad_rtol, device="cuda", mask=left_pad_mask([T, T - 77], T))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("route", ["chunk", "decode"])
def test_cuda_kda_positive_gate_is_named_on_both_routes(route):
    positive_gate_is_named(route, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kda_bf16_gradients_of_k_g_beta_as_accurate_as_q_v():
    """Kimi Linear's shapes (T = 1000, 16 heads of 128, bf16, its gate): dk, dg and dβ within twice the dq and dv
    errors against float64 (a race in the compiled _bwd_inter once made them 0.022-0.030 against 0.003)."""
    x = {n: t.cuda() for n, t in kimi_gate_inputs(2, 1000, 16, 128, seed=1).items()}
    do = torch.randn_like(x["v"])
    ref = {n: t.double().requires_grad_(True) for n, t in x.items()}
    o_ref = ops.kda(*ref.values(), use_qk_l2norm=False, backend="chunk")[0]
    g_ref = torch.autograd.grad(o_ref, list(ref.values()), do.double())
    tri = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    grads = torch.autograd.grad(ops.kda(*tri.values(), use_qk_l2norm=False, backend="triton")[0], list(tri.values()),
                                do)
    err = {n: float((a.double() - b).norm() / b.norm()) for n, a, b in zip(tri, grads, g_ref)}
    for name in ("k", "g", "beta"):
        assert err[name] <= 2 * max(err["q"], err["v"]), (name, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kda_packed_and_decode_match_float64():
    cu = torch.tensor([0, 300, 301, 1000])
    x = kda_inputs(1, 1000, 4, 128, 128, seed=12)
    x["S0"] = torch.randn(3, 4, 128, 128, dtype=torch.float64)
    check(x, torch.float32, 1e-4, device="cuda", cu_seqlens=cu)
    y = {n: t.float().cuda() for n, t in x.items()}
    with torch.no_grad():
        o, s = ops.kda(*(y[n][:, :5] for n in NAMES), initial_state=y["S0"][:1], output_final_state=True,
                       backend="triton")
    o_r, s_r = ops.kda(*(x[n][:, :5] for n in NAMES), initial_state=x["S0"][:1], output_final_state=True,
                       backend="recurrent")
    assert_close(o.cpu(), o_r, 1e-4, "decode output")
    assert_close(s.cpu(), s_r, 1e-4, "decode state")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 2e-2, 3e-2)])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_cuda_kda_head_dim_16_over_several_chunks(dtype, rtol, grad_rtol, packed):
    """dk = dv = 16 (a tiny model's heads) over several 64-token chunks: _bwd_wy at its launch for dk = 16 (at 8
    warps its fp32 build faulted with an illegal memory access on an H200), outputs and every gradient against
    float64."""
    if packed:
        x = kda_inputs(1, 270, 2, 16, 16, seed=13)
        x["S0"] = torch.randn(3, 2, 16, 16, dtype=torch.float64)
        check(x, dtype, rtol, grad_rtol, device="cuda", cu_seqlens=torch.tensor([0, 90, 140, 270]))
    else:
        x = kda_inputs(2, 270, 2, 16, 16, seed=13)
        check(x, dtype, rtol, grad_rtol, device="cuda")
