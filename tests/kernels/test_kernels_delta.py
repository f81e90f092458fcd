"""Triton kernels of the delta rule and gated delta rule (lazoo.kernels.delta) through the ops'
``backend="triton"``, against the float64 references: outputs, final states and the gradients of
q, k, v, beta, g and the initial state, at ragged T, with masks and with ``cu_seqlens``; and the fused
recurrent (decoding) kernel against the same references.

CPU (default run): the ``interp_*`` tests need the Triton interpreter, and ``TRITON_INTERPRET=1`` must be
set before triton is first imported (conftest imports lazoo and transformers, which import triton), so
``tests/test_interpreter.py`` runs them in a fresh process with the variable set. Running this
file with ``TRITON_INTERPRET=1`` runs them in-process. GPU: ``-m gpu`` at real shapes
(B=2, T=1000, H=4, D=128) in bf16/fp16/fp32 against float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask, rel_err

from lazoo import ops

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(
    not INTERP, reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64



def test_state_walk_takes_two_stages_once_its_programs_outnumber_the_sms(monkeypatch):
    """_fwd_h keeps its three pipeline stages while its programs fit one wave and takes two past it (two programs
    then share an SM: faster on an H200 at T = 1k, slower at T = 32k with one sequence); fp32 never takes three; the
    interpreter gets no options."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert delta.CONFIGS["h"]["num_stages"] == 3
    assert delta._h_opts(132, cpu, interpret=False, fp32=False)["num_stages"] == 3
    assert delta._h_opts(133, cpu, interpret=False, fp32=False)["num_stages"] == delta.H_STAGES_MANY_PROGRAMS == 2
    assert delta._h_opts(16, cpu, interpret=False, fp32=True)["num_stages"] == 2
    assert delta._h_opts(1024, cpu, interpret=True, fp32=False) == {}


def test_state_gradient_walk_takes_whole_dv_blocks_once_its_programs_outnumber_the_sms(monkeypatch):
    """_bwd_dhu runs 128-wide dv blocks at 8 warps and 2 stages once 64-wide ones would need more programs than
    the SMs, for the (gated) delta rule's 16-bit inputs with dk <= 128; otherwise the dv block heuristic and the
    table's options."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "num_sms", lambda device: 132)
    monkeypatch.setattr(delta, "_seq_bv", lambda K, V, parallel, device, interpret, fp32=False: 64)
    cpu = torch.device("cpu")
    wide = {k: v for k, v in delta.DHU_WIDE_DV.items() if k != "BV"}
    assert delta._dhu_launch(128, 128, 512, cpu, False, False) == (128, wide)  # T = 1k, B = 32, H = 16
    assert delta._dhu_launch(128, 128, 128, cpu, False, False) == (128, wide)  # T = 8k, B = 4, HV = 32
    assert delta._dhu_launch(128, 128, 64, cpu, False, False) == (64, delta.CONFIGS["dhu"])  # 128 programs
    assert delta._dhu_launch(128, 128, 512, cpu, False, True)[0] == 64  # fp32 tiles
    assert delta._dhu_launch(128, 128, 512, cpu, False, False, has_w=True)[0] == 64  # given write keys
    BV, opts = delta._dhu_launch(256, 128, 512, cpu, False, False)  # dk = 256
    assert BV == 64 and opts["num_stages"] == 2
    assert delta._dhu_launch(128, 128, 512, cpu, True, False) == (128, {})


def test_state_gradient_walk_forms_local_du_only_with_whole_dv_blocks_and_programs_to_spare(monkeypatch):
    """_bwd_dhu forms P^T dO itself where each head's P^T is formed once (one dv block) and its programs fill at
    least half the SMs (T = 1k, B = 32; 8k with HV = 2H), not at 8k with HV = H (two 64-wide blocks a head) or at
    32k with one sequence, nor for given write keys; the interpreter takes it for the (gated) delta rule, and the
    module setting forces either."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert delta._local_du_in_walk(512, 128, 128, cpu, False)
    assert delta._local_du_in_walk(128, 128, 128, cpu, False)
    assert not delta._local_du_in_walk(128, 64, 128, cpu, False)
    assert not delta._local_du_in_walk(32, 128, 128, cpu, False)
    assert delta._local_du_in_walk(1, 64, 128, cpu, True)
    assert not delta._local_du_in_walk(512, 128, 128, cpu, False, has_w=True)  # given write keys: not measured
    monkeypatch.setattr(delta, "LOCAL_DU_IN_WALK", False)
    assert not delta._local_du_in_walk(512, 128, 128, cpu, False)


def test_norms_backward_in_the_kernels_only_with_one_value_head_a_key_head(monkeypatch):
    from lazoo.kernels import delta

    q = torch.empty(10, 4, 128, dtype=torch.bfloat16)
    assert delta.norms_in_backward(q, 4, given_write_keys=False)
    assert not delta.norms_in_backward(q, 8, given_write_keys=False)  # grouped value heads: the group sum first
    assert not delta.norms_in_backward(q, 4, given_write_keys=True)
    monkeypatch.setattr(delta, "NORM_BACKWARD_IN_KERNELS", False)
    assert not delta.norms_in_backward(q, 4, given_write_keys=False)


def test_chunk_parallel_dv_block_comes_from_the_table(monkeypatch):
    """_fwd_o and _bwd_dv_local take the table's "BV" where it sets one (never in the interpreter)."""
    from lazoo.kernels import delta

    assert delta._table_bv("o", 64, interpret=False) == 64 and "BV" not in delta._opts("o", False)
    monkeypatch.setitem(delta.CONFIGS, "o", dict(delta.CONFIGS["o"], BV=128))
    assert delta._table_bv("o", 64, interpret=False) == 128 and "BV" not in delta._opts("o", False)
    assert delta._table_bv("o", 64, interpret=True) == 64


def test_gluon_walk_only_where_asked_and_supported(monkeypatch):
    """The Gluon walks run by default where they pay (enough programs), never in the interpreter or while
    torch.compile traces; asked for where they cannot run (no Hopper GPU here), they say why once and the Triton
    kernels run; where they were not asked for, nothing is said."""
    from lazoo.kernels import delta

    assert delta.USE_GLUON_WALK is None and delta.USE_GLUON_BWD_WALK is None
    assert delta.GLUON_WALK_IN_PREFILL is False
    q = torch.empty(10, 4, 128, dtype=torch.bfloat16, device="meta")
    assert delta.gluon_walk(q, 128, 128, 64, False, 10_000, switch=False) == 0
    monkeypatch.setattr(delta, "_HOPPER_REFUSALS", set())
    assert delta.gluon_walk(torch.empty(1, 4, 128), 128, 128, 64, False, 10_000, switch=True) == 0  # CPU
    with pytest.warns(UserWarning, match="Gluon state walk was asked for but"):
        assert delta.gluon_walk(q, 128, 128, 64, False, 10_000, switch=True) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert delta.gluon_walk(q, 128, 128, 64, False, 10_000, switch=True) == 0  # said once
        assert delta.gluon_walk(q, 128, 128, 64, False, 10_000, switch=None) == 0  # not asked: nothing said


def test_gluon_walk_by_default_where_it_has_programs_for_the_gpu(monkeypatch):
    """Where the walk runs (stood in for here: no Hopper GPU), the default takes it from 0.75 programs of 64-wide dv
    blocks a multiprocessor, a switch set to True at any count, and torch.compile's tracing never."""
    from lazoo.kernels import delta, delta_gluon

    monkeypatch.setattr(delta_gluon, "walk_supported", lambda *a: None)
    monkeypatch.setattr(delta, "num_sms", lambda device: 132)
    q = torch.empty(10, 4, 128, dtype=torch.bfloat16, device="meta")
    assert delta.gluon_walk(q, 128, 128, 64, False, 512, switch=None) == 64  # T = 1k, B = 32, 16 heads
    assert delta.gluon_walk(q, 128, 128, 64, False, 64, switch=None) == 64  # T = 8k, B = 4: 128 programs
    assert delta.gluon_walk(q, 128, 128, 64, False, 16, switch=None) == 0  # one sequence of 16 heads: 32
    assert delta.gluon_walk(q, 128, 128, 64, False, 16, switch=True) == 64
    assert delta.gluon_walk(q, 128, 96, 64, False, 512, switch=None) == 32  # dv no multiple of 64
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert delta.gluon_walk(q, 128, 128, 64, False, 512, switch=None) == 0
    assert delta.gluon_walk(q, 128, 128, 64, False, 512, switch=True) == 0


def test_fused_forward_only_where_asked_and_supported(monkeypatch):
    """The forward takes the fused kernel on a GPU that runs it unless switched off, says once why not where it was
    asked for and cannot run, and never on the CPU (the interpreter runs the Triton kernels)."""
    from lazoo.kernels import delta, delta_fused

    q = torch.empty(1, 4, 128)
    assert not delta.fused_forward(q, 128, 128, 64, False, switch=True)  # CPU
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(delta_fused, "supported", lambda *a: None)
    assert delta.fused_forward(q, 128, 128, 64, False, switch=True)
    assert delta.fused_forward(q, 128, 128, 64, False, switch=None)
    assert not delta.fused_forward(q, 128, 128, 64, False, switch=False)
    small = delta.FUSED_MIN_TOKEN_HEADS - 1  # a call too small for the fused launch to pay, unless asked for
    assert not delta.fused_forward(q, 128, 128, 64, False, switch=None, token_heads=small)
    assert delta.fused_forward(q, 128, 128, 64, False, switch=True, token_heads=small)
    monkeypatch.setattr(delta_fused, "supported", lambda *a: "needs a Hopper GPU (sm_90)")
    monkeypatch.setattr(delta, "_HOPPER_REFUSALS", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not delta.fused_forward(q, 128, 128, 64, False, switch=None)  # not asked for: nothing said
    with pytest.warns(UserWarning, match="fused forward was asked for but needs a Hopper GPU"):
        assert not delta.fused_forward(q, 128, 128, 64, False, switch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not delta.fused_forward(q, 128, 128, 64, False, switch=True)  # said once


@pytest.mark.parametrize("switch,dispatch,module,what", [
    ("USE_CHUNK_BWD", "chunk_bwd_kernel", "delta_chunk_bwd", "the Gluon chunk backward"),
    ("USE_GLUON_SOLVE", "solve_kernel", "delta_solve", "the Gluon solve"),
], ids=["chunk_backward", "solve"])
def test_hopper_kernel_only_where_asked_and_supported(monkeypatch, switch, dispatch, module, what):
    """A Hopper kernel behind its switch runs on a GPU that runs it where asked for (True) or wherever it is supported
    (None), not where switched off, never on the CPU (the interpreter runs the Triton kernels); where it was asked for
    and cannot run, it says why once, and where it was not asked for, nothing."""
    import importlib

    from lazoo.kernels import delta

    kernel = importlib.import_module(f"lazoo.kernels.{module}")
    runs = getattr(delta, dispatch)
    x = torch.empty(1, 4, 128)
    monkeypatch.setattr(delta, switch, True)
    assert not runs(x, 128, 128, 64, False)  # CPU
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(kernel, "supported", lambda *a: None)
    for on, want in ((True, True), (None, True), (False, False)):
        monkeypatch.setattr(delta, switch, on)
        assert runs(x, 128, 128, 64, False) == want, on
    monkeypatch.setattr(kernel, "supported", lambda *a: "needs dk = dv = 128 (got 64, 128)")
    monkeypatch.setattr(delta, "_HOPPER_REFUSALS", set())
    monkeypatch.setattr(delta, switch, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not runs(x, 64, 128, 64, False)  # not asked for: nothing said
    monkeypatch.setattr(delta, switch, True)
    with pytest.warns(UserWarning, match=f"{what} was asked for but needs dk = dv = 128"):
        assert not runs(x, 64, 128, 64, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not runs(x, 64, 128, 64, False)  # said once


def test_chunk_backward_kernel_takes_heads_of_128_only(monkeypatch):
    from lazoo.kernels import delta_chunk_bwd

    if delta_chunk_bwd.CHUNK_BWD_ERROR is not None:
        pytest.skip(f"this Triton lacks what the chunk backward needs: {delta_chunk_bwd.CHUNK_BWD_ERROR}")
    monkeypatch.setattr(delta_chunk_bwd.gw, "walk_supported", lambda *a: None)
    assert delta_chunk_bwd.supported(None, 128, 128, 64, False) is None
    assert "dk = dv = 128" in delta_chunk_bwd.supported(None, 128, 64, 64, False)


def test_fused_forward_only_for_inputs_on_16_byte_boundaries():
    from lazoo.kernels import delta

    buf = torch.zeros(1 + 4 * 128, dtype=torch.bfloat16)
    aligned, shifted = buf[:-1].view(4, 128), buf[1:].view(4, 128)  # the second starts 2 bytes in
    assert delta.tma_aligned(aligned, aligned)
    assert not delta.tma_aligned(aligned, shifted)


def test_fused_forward_takes_whole_heads_once_the_pairs_fill_the_gpu_and_heads_it_was_tested_on(monkeypatch):
    from lazoo.kernels import delta_fused

    if delta_fused.FUSED_ERROR is not None:
        pytest.skip(f"this Triton lacks what the fused forward needs: {delta_fused.FUSED_ERROR}")
    monkeypatch.setattr(delta_fused, "num_sms", lambda device: 132)
    dev = torch.device("cuda")
    assert delta_fused.block(128, 512, dev) == 128  # T = 1k, B = 32, 16 heads
    assert delta_fused.block(128, 128, dev) == 128  # T = 8k, B = 4, 32 value heads
    assert delta_fused.block(128, 64, dev) == 64  # T = 8k, B = 4, 16 heads
    assert delta_fused.block(192, 512, dev) == 64
    monkeypatch.setattr(delta_fused.dg, "walk_supported", lambda *a: None)
    assert delta_fused.supported(None, 128, 128, 64, False) is None
    assert "dv a multiple of 64" in delta_fused.supported(None, 128, 96, 64, False)
    assert "dk = 128" in delta_fused.supported(None, 64, 128, 64, False)


def test_triangular_products_take_16_bit_operands_only_where_measured(monkeypatch):
    """The training kernels' triangular products take the inputs' 16-bit type (W = β k); given write keys and fp32
    inputs keep fp32 operands (tf32 / tf32x3), as does everything with the switch off."""
    import triton.language as tl

    from lazoo.kernels import delta

    bf16, fp16, fp32 = (torch.empty(1, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert delta._triangular_type(bf16, tl.bfloat16, given_write_keys=False) == tl.bfloat16
    assert delta._triangular_type(fp16, tl.float16, given_write_keys=False) == tl.float16
    assert delta._triangular_type(bf16, tl.bfloat16, given_write_keys=True) == tl.float32
    assert delta._triangular_type(fp32, tl.float32, given_write_keys=False) == tl.float32
    monkeypatch.setattr(delta, "TRIANGULAR_16BIT", False)
    assert delta._triangular_type(bf16, tl.bfloat16, given_write_keys=False) == tl.float32


def inputs(B, T, H, dk, dv, seed=0, g_bias=2.0, value_heads=None):
    """float64 q, k, v, g (log decay), beta on the CPU; v, g and beta with ``value_heads`` heads when given
    (grouped value heads)."""
    gen = torch.Generator().manual_seed(seed)
    HV = value_heads or H
    q, k = (torch.randn(B, T, H, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, HV, dv, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen, dtype=F64) + g_bias)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def call(op, x, **kw):
    if op == "delta":
        return ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw)
    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


def check_against_reference(op, x, S0, rtol, grad_rtol, device="cpu", dtype=torch.float32,
                            ref_backend="recurrent", ref_device="cpu", scalar_dtype=None, **kw):
    """``call(op)`` with backend="triton" on ``dtype``/``device`` copies of the float64 inputs (rounded
    to ``dtype`` first, so the reference sees the same numbers; β and g in ``scalar_dtype`` when given) vs
    ``ref_backend`` in float64."""
    names = ["q", "k", "v", "beta"] + (["g"] if op == "gated" else [])
    kinds = {n: (scalar_dtype or dtype) if n in ("beta", "g") else dtype for n in x}
    x = {n: t.to(kinds[n]).to(F64) for n, t in x.items()}
    ref = {n: x[n].to(ref_device).requires_grad_(True) for n in names}
    ref["S0"] = S0.to(ref_device).requires_grad_(True)
    ref_kw = {key: (val.to(ref_device) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    ro, rs, rg = forward_and_grads(
        lambda: call(op, {**x, **ref}, initial_state=ref["S0"], output_final_state=True,
                     backend=ref_backend, **ref_kw), ref)
    tst = {n: x[n].to(device=device, dtype=kinds[n]).requires_grad_(True) for n in names}
    tst["S0"] = S0.to(device=device, dtype=torch.float32).requires_grad_(True)
    tst_kw = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    to, ts, tg = forward_and_grads(
        lambda: call(op, {**x, **tst}, initial_state=tst["S0"], output_final_state=True,
                     backend="triton", **tst_kw), tst)
    assert to.dtype == dtype and ts.dtype == torch.float32 and to.shape == ro.shape
    errs = {"o": rel_err(to, ro), "state": rel_err(ts, rs)}
    errs.update({f"d{n}": rel_err(tg[n], rg[n]) for n in tst if tg[n] is not None})
    print(f"{op} {dtype} rel errors: " + " ".join(f"{key}={val:.1e}" for key, val in errs.items()))
    assert_close(to.cpu(), ro.cpu(), rtol, f"{op} output")
    assert_state_close(ts.cpu(), rs.cpu(), rtol, f"{op} final")
    for n in tst:
        assert tg[n] is not None, f"no gradient reaches {n}"
        assert tg[n].dtype == tst[n].dtype
        assert_close(tg[n].cpu(), rg[n].cpu(), grad_rtol, f"{op} grad {n}")


# ============================================================================ dispatch
def test_triton_refuses_clearly():
    x = inputs(1, 5, 1, 8, 8)
    with pytest.raises(NotImplementedError, match="float32/float16/bfloat16"):
        call("delta", x, backend="triton")  # float64
    xf = {n: t.float() for n, t in x.items()}
    with pytest.raises(NotImplementedError, match="chunk_size"):
        call("gated", xf, backend="triton", chunk_size=8)
    big = {**xf, "q": torch.randn(1, 5, 1, 300), "k": torch.randn(1, 5, 1, 300)}
    with pytest.raises(NotImplementedError, match="head dims"):
        call("gated", big, backend="triton")


# ============================================================================ interpreter (CPU)


@needs_interp
@pytest.mark.parametrize("op,T,chunk", [("delta", 45, 16), ("gated", 45, 16), ("gated", 70, 64), ("delta", 40, 32)])
def test_interp_delta_matches_reference(op, T, chunk):
    B, H, dk, dv = 2, 2, 12, 10  # head dims below the 16-wide tiles: masked loads
    x = inputs(B, T, H, dk, dv)
    S0 = torch.randn(B, H, dv, dk, dtype=F64)
    mask = left_pad_mask([T, T - 7], T, holes=[(0, 20)])
    check_against_reference(op, x, S0, 1e-4, 1e-4, mask=mask, chunk_size=chunk)


@needs_interp
@pytest.mark.parametrize("local_du", [True, False], ids=["local_du_in_walk", "dv_local_kernel"])
@pytest.mark.parametrize("norms_inside", [True, False], ids=["norms_in_kernels", "norm_pass"])
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_backward_variants_match_reference(monkeypatch, op, local_du, norms_inside):
    """Both ways the state-gradient walk gets P^T dO (formed itself, or read from _bwd_dv_local) and both ways dq and
    dk go back through the L2 norms (in _bwd_dqkw and _bwd_wy, or a pass of their own), against float64: packed
    ragged sequences, a carried state, one sequence of a single token."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "LOCAL_DU_IN_WALK", local_du)
    monkeypatch.setattr(delta, "NORM_BACKWARD_IN_KERNELS", norms_inside)
    x = inputs(1, 90, 2, 12, 10, seed=31)
    check_against_reference(op, x, torch.randn(3, 2, 10, 12, dtype=F64), 1e-4, 1e-4, chunk_size=16,
                            cu_seqlens=torch.tensor([0, 1, 40, 90]))


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_delta_cu_seqlens(op):
    # packed: lengths 17, 0 (empty), 30, 5 = 52 tokens; one state per sequence
    H, dk, dv = 2, 16, 16
    cu = torch.tensor([0, 17, 17, 47, 52])
    x = inputs(1, 52, H, dk, dv, seed=3)
    S0 = torch.randn(4, H, dv, dk, dtype=F64)
    check_against_reference(op, x, S0, 1e-4, 1e-4, cu_seqlens=cu, chunk_size=16)


@needs_interp
def test_interp_gated_fp16_strong_decay():
    B, T, H, dk, dv = 2, 45, 2, 16, 16
    x = inputs(B, T, H, dk, dv, seed=5, g_bias=-1.0)  # fast decay: exp(G) spans many orders
    S0 = torch.randn(B, H, dv, dk, dtype=F64)
    check_against_reference("gated", x, S0, 3e-3, 6e-3, dtype=torch.float16, chunk_size=32)


@needs_interp
def test_interp_gated_very_fast_decay_ragged():
    # G falls by ~300 inside a chunk: exp(G_t - G_i) must only ever be taken for t >= i, pad rows
    # of the last (partial) chunk included, or inf * 0 turns into NaN
    B, T, H, dk, dv = 1, 120, 1, 16, 16  # the last chunk: 56 real rows, 8 pads
    x = inputs(B, T, H, dk, dv, seed=9, g_bias=-4.0)
    S0 = torch.randn(B, H, dv, dk, dtype=F64)
    check_against_reference("gated", x, S0, 1e-4, 1e-4, chunk_size=64)


@needs_interp
def test_interp_delta_without_l2norm_custom_scale():
    B, T, H, dk, dv = 1, 33, 2, 16, 16
    x = inputs(B, T, H, dk, dv, seed=7)
    x["k"] = F.normalize(x["k"], dim=-1) * 0.9  # |k| < 1 keeps the unnormalised rule stable
    S0 = torch.randn(B, H, dv, dk, dtype=F64)
    check_against_reference("gated", x, S0, 1e-4, 1e-4, use_qk_l2norm=False, scale=0.37, chunk_size=16)


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_grouped_value_heads(op):
    # 2 query/key heads serving 3 value heads each, read in place (q and k are not repeated); masks, a carried
    # state, a partial last chunk, fp16 inputs with fp32 β and g
    B, T, H, dk, dv = 2, 45, 2, 16, 12
    x = inputs(B, T, H, dk, dv, seed=31, value_heads=3 * H)
    S0 = torch.randn(B, 3 * H, dv, dk, dtype=F64)
    mask = left_pad_mask([T, T - 9], T, holes=[(0, 20)])
    check_against_reference(op, x, S0, 1e-4, 1e-4, mask=mask, chunk_size=16)
    check_against_reference(op, x, S0, 3e-3, 6e-3, dtype=torch.float16, scalar_dtype=torch.float32, chunk_size=32)


@needs_interp
def test_interp_grouped_value_heads_without_l2norm():
    # the group sums of dq and dk without the norm's backward (the finishing launch's other form)
    B, T, H, dk, dv = 1, 37, 2, 16, 12
    x = inputs(B, T, H, dk, dv, seed=33, value_heads=2 * H)
    x["k"] = F.normalize(x["k"], dim=-1) * 0.9
    S0 = torch.randn(B, 2 * H, dv, dk, dtype=F64)
    check_against_reference("gated", x, S0, 1e-4, 1e-4, use_qk_l2norm=False, scale=0.37, chunk_size=16)


@needs_interp
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("norm", [True, False])
def test_interp_qk_grads_sum_the_groups_and_undo_the_norm(groups, norm):
    """`qk_grads` against float64: each key head's m value-head partials summed, then (with the norm) dx = (dy −
    y (y·dy)) / sqrt(|x|² + 1e-6); q and k in one launch, and q alone."""
    from lazoo.kernels.delta import l2norm_fwd, qk_grads

    gen = torch.Generator().manual_seed(groups)
    TT, HK, D = 23, 2, 24  # D below the 32-wide row block: masked columns
    xq, xk = (torch.randn(TT, HK, D, generator=gen, dtype=torch.float32) for _ in range(2))
    dq, dk = (torch.randn(TT, HK * groups, D, generator=gen, dtype=torch.float32) for _ in range(2))
    yq, rq, yk, rk = l2norm_fwd(xq, xk)

    def want(x, d):
        s = d.double().view(TT, HK, groups, D).sum(2)
        if not norm:
            return s
        x = x.double()
        r = ((x * x).sum(-1, keepdim=True) + 1e-6).rsqrt()
        y = x * r
        return r * (s - y * (y * s).sum(-1, keepdim=True))

    norms = ((yq, rq), (yk, rk)) if norm else (None, None)
    got_q, got_k = qk_grads(dq, dk, groups, *norms)
    assert got_q.shape == got_k.shape == (TT, HK, D)
    torch.testing.assert_close(got_q.double(), want(xq, dq), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.double(), want(xk, dk), rtol=1e-5, atol=1e-5)
    alone = qk_grads(dq, None, groups, norms[0])
    torch.testing.assert_close(alone, got_q, rtol=0, atol=0)


@needs_interp
def test_interp_grouped_value_heads_packed_and_decode():
    H, dk, dv = 1, 16, 16
    cu = torch.tensor([0, 17, 47, 52])
    x = inputs(1, 52, H, dk, dv, seed=32, value_heads=2)
    check_against_reference("gated", x, torch.randn(3, 2, dv, dk, dtype=F64), 1e-4, 1e-4, cu_seqlens=cu,
                            chunk_size=16)
    x = inputs(3, 2, H, dk, dv, seed=33, value_heads=4)  # decoding: the fused recurrent kernel
    S0 = torch.randn(3, 4, dv, dk, dtype=F64)
    with torch.no_grad():
        ro, rs = call("gated", x, initial_state=S0, output_final_state=True, backend="recurrent")
        o, s = call("gated", {n: t.float() for n, t in x.items()}, initial_state=S0.float(), output_final_state=True,
                    backend="triton")
    assert_close(o, ro, 1e-5, "grouped decode output")
    assert_close(s, rs, 1e-5, "grouped decode state")


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_decode_matches_reference(op):
    # no autograd and a few tokens per sequence: the fused recurrent kernel (q/k norm inside)
    B, T, H, dk, dv = 3, 3, 2, 12, 20
    x = inputs(B, T, H, dk, dv, seed=11)
    S0 = torch.randn(B, H, dv, dk, dtype=F64)
    mask = left_pad_mask([3, 2, 1], T)
    with torch.no_grad():
        ro, rs = call(op, x, initial_state=S0, output_final_state=True, mask=mask, backend="recurrent")
        xf = {n: t.float() for n, t in x.items()}
        o, s = call(op, xf, initial_state=S0.float(), output_final_state=True, mask=mask, backend="triton")
        assert_close(o, ro, 1e-5, f"{op} decode output")
        assert_close(s, rs, 1e-5, f"{op} decode state")
        assert torch.all(o[~mask] == 0)
        # packed decode: one token for each of two sequences
        cu = torch.tensor([0, 1, 2])
        o2, s2 = call(op, {n: t[:1, :2] for n, t in xf.items()}, initial_state=S0[:2].float(), output_final_state=True,
                      cu_seqlens=cu, backend="triton")
        r2, rs2 = call(op, {n: t[:1, :2] for n, t in x.items()}, initial_state=S0[:2], output_final_state=True,
                       cu_seqlens=cu, backend="recurrent")
        assert_close(o2, r2, 1e-5, "packed decode output")
        assert_close(s2, rs2, 1e-5, "packed decode state")


@needs_interp
def test_interp_prefill_then_decode_equals_whole():
    # a chunked prefill (with autograd on) then token-by-token decoding == one pass over everything
    B, T, H, dk, dv = 2, 40, 2, 16, 16
    x = inputs(B, T, H, dk, dv, seed=13)
    xf = {n: t.float() for n, t in x.items()}
    leaves = {n: t.clone().requires_grad_(True) for n, t in xf.items()}  # autograd on: the chunk kernels
    whole, S_whole = call("gated", leaves, output_final_state=True, backend="triton", chunk_size=16)
    cut = 37
    first = {n: t[:, :cut].clone().requires_grad_(True) for n, t in xf.items()}
    o1, S = call("gated", first, output_final_state=True, backend="triton", chunk_size=16)
    outs = [o1.detach()]
    with torch.no_grad():
        for t in range(cut, T):
            o, S = call("gated", {n: v[:, t:t + 1] for n, v in xf.items()}, initial_state=S,
                        output_final_state=True, backend="triton")
            outs.append(o)
    assert_close(torch.cat(outs, 1), whole.detach(), 1e-5, "prefill + decode output")
    assert_close(S, S_whole.detach(), 1e-5, "prefill + decode state")


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_forward_without_autograd_matches_reference(op):
    # T > 64 without autograd: one walk that stores nothing for a backward (``_fwd_walk``); its outputs and state
    # are the float64 reference's and those of the kernels autograd runs. Grouped value heads, a carried state,
    # packed sequences of ragged lengths.
    H, HV, dk, dv = 2, 4, 16, 12
    cu = torch.tensor([0, 70, 71, 150])
    x = inputs(1, 150, H, dk, dv, seed=41, value_heads=HV)
    S0 = torch.randn(3, HV, dv, dk, dtype=F64)
    with torch.no_grad():
        ro, rs = call(op, x, initial_state=S0, output_final_state=True, cu_seqlens=cu, backend="recurrent")
        xf = {n: t.float() for n, t in x.items()}
        o, s = call(op, xf, initial_state=S0.float(), output_final_state=True, cu_seqlens=cu, backend="triton",
                    chunk_size=32)
    leaves = {n: t.clone().requires_grad_(True) for n, t in xf.items()}
    og, sg = call(op, leaves, initial_state=S0.float(), output_final_state=True, cu_seqlens=cu, backend="triton",
                  chunk_size=32)
    assert_close(o, ro, 1e-4, f"{op} output without autograd")
    assert_close(s, rs, 1e-4, f"{op} state without autograd")
    assert_close(o, og.detach(), 1e-5, f"{op} output with and without autograd")
    assert_close(s, sg.detach(), 1e-5, f"{op} state with and without autograd")


def _split_everything(monkeypatch, min_chunks=1):
    """Split every sequence into segments of ``min_chunks`` chunks (the interpreter runs the split only where asked)."""
    from lazoo.kernels import delta_split

    monkeypatch.setattr(delta_split, "SPLIT_LONG_SEQUENCES", True)
    monkeypatch.setattr(delta_split, "SPLIT_MIN_CHUNKS", min_chunks)
    monkeypatch.setattr(delta_split, "SPLIT_MIN_PIECES", 2)
    monkeypatch.setattr(delta_split, "SPLIT_PROGRAMS_PER_SM", 10_000.0)


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("min_chunks,backward", [(1, "maps_from_forward"), (2, "maps_from_forward"), (2, "walked")],
                         ids=["segments_of_1_chunk", "segments_of_2_chunks", "maps_walked"])
def test_interp_split_sequences_match_reference(monkeypatch, op, min_chunks, backward):
    """Long sequences split into segments whose start states are chained (forward) and whose end-state gradients
    are chained back (backward: the reverse maps taken from the forward's, or walked where it left none), against
    float64: packed sequences of ragged lengths (one of a
    single token, an empty one, one ending mid-chunk), a carried state, grouped value heads with fp16 inputs and fp32
    β and g."""
    from lazoo.kernels import delta, delta_split

    _split_everything(monkeypatch, min_chunks)
    monkeypatch.setattr(delta_split, "SEGMENT_BWD_MAPS_FROM_FORWARD", backward == "maps_from_forward")
    cu = torch.tensor([0, 1, 1, 40, 90])  # one token, none, three chunks (the last partial), four
    segs = delta_split.plan(delta.seqs_for(1, 90, cu, 16, torch.device("cpu")), 2, 10, torch.device("cpu"), 16)
    assert segs.soff.tolist() == ([0, 1, 2, 5, 9] if min_chunks == 1 else [0, 1, 2, 4, 6])
    x = inputs(1, 90, 2, 12, 10, seed=33)
    check_against_reference(op, x, torch.randn(4, 2, 10, 12, dtype=F64), 1e-4, 1e-4, chunk_size=16,
                            cu_seqlens=cu)
    x = inputs(2, 45, 2, 16, 12, seed=34, value_heads=4)
    mask = left_pad_mask([45, 36], 45, holes=[(0, 20)])
    check_against_reference(op, x, torch.randn(2, 4, 12, 16, dtype=F64), 3e-3, 6e-3, dtype=torch.float16,
                            scalar_dtype=torch.float32, chunk_size=16, mask=mask)


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_interp_split_sequences_without_autograd(monkeypatch, op):
    """The prefill's walk over segments (the prefill form of the segment pass) against float64 and against the
    unsplit kernels, with and without a carried state."""
    _split_everything(monkeypatch)
    cu = torch.tensor([0, 70, 71, 150])
    x = inputs(1, 150, 2, 16, 12, seed=42, value_heads=4)
    xf = {n: t.float() for n, t in x.items()}
    for S0 in (torch.randn(3, 4, 12, 16, dtype=F64), None):
        S0f = None if S0 is None else S0.float()
        with torch.no_grad():
            ro, rs = call(op, x, initial_state=S0, output_final_state=True, cu_seqlens=cu, backend="recurrent")
            o, s = call(op, xf, initial_state=S0f, output_final_state=True, cu_seqlens=cu, backend="triton",
                        chunk_size=16)
        assert_close(o, ro, 1e-4, f"{op} split prefill output")
        assert_close(s, rs, 1e-4, f"{op} split prefill state")


@needs_interp
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("maps_from_forward", [False, True], ids=["maps_walked", "maps_from_forward"])
def test_interp_split_sequences_without_states(monkeypatch, op, maps_from_forward):
    """With neither an initial nor a final state the segment passes skip the walks the chaining does not use (the
    first segment's identity block, the last segment), also where the backward takes the forward's maps: outputs and
    every gradient as without the split."""
    from lazoo.kernels import delta_split

    monkeypatch.setattr(delta_split, "SEGMENT_BWD_MAPS_FROM_FORWARD", maps_from_forward)

    cu = torch.tensor([0, 70, 71, 150])
    x = {n: t.float() for n, t in inputs(1, 150, 2, 16, 12, seed=47, value_heads=4).items()}
    runs = []
    for split in (False, True):
        monkeypatch.setattr(delta_split, "SPLIT_LONG_SEQUENCES", split)
        monkeypatch.setattr(delta_split, "SPLIT_MIN_CHUNKS", 1)
        monkeypatch.setattr(delta_split, "SPLIT_PROGRAMS_PER_SM", 10_000.0)
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, _ = call(op, leaves, cu_seqlens=cu, backend="triton", chunk_size=16)
        o.backward(torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o))
        with torch.no_grad():
            o_prefill, _ = call(op, x, cu_seqlens=cu, backend="triton", chunk_size=16)
        runs.append((o.detach(), o_prefill, {n: t.grad for n, t in leaves.items() if t.grad is not None}))
    (o0, p0, g0), (o1, p1, g1) = runs
    assert_close(o1, o0, 1e-5, f"{op} split output")
    assert_close(p1, p0, 1e-5, f"{op} split prefill output")
    assert g1.keys() == g0.keys() and len(g0) == (5 if op == "gated" else 4)
    for n in g0:
        assert_close(g1[n], g0[n], 1e-5, f"{op} split grad {n}")


def test_split_plan_only_where_a_walk_outlasts_its_fair_share(monkeypatch):
    """The default plan: no split with programs to spare or on the CPU; few long sequences, or one long document in
    a packed batch of short ones, split into segments of whole chunks that tile each sequence, as many as the
    longest walk's multiple of its fair share of the walk work, where that is three or more."""
    from lazoo.kernels import delta, delta_split

    cpu = torch.device("cpu")
    q = torch.empty(1, 1, 128)
    assert delta.split_segments(delta._Seqs(1, 32768, None, 64, cpu), 16, 128, q, 64) is None  # the interpreter
    monkeypatch.setattr(delta_split, "num_sms", lambda device: 132)
    seqs = delta._Seqs(1, 32768, None, 64, cpu)  # 512 chunks, 16 heads x 2 dv blocks = 32 programs
    segs = delta_split.plan(seqs, 16, 128, cpu, 64, switch=None)
    assert segs is not None and segs.N == 4 and segs.L == 128  # 132 / 32 -> 4 segments of 128 chunks
    assert segs.cu.tolist() == list(range(0, 32768 + 1, 8192)) and segs.coff.tolist() == list(range(0, 513, 128))
    assert delta_split.plan(delta._Seqs(32, 1024, None, 64, cpu), 16, 128, cpu, 64, switch=None) is None
    assert delta_split.plan(delta._Seqs(4, 8192, None, 64, cpu), 16, 128, cpu, 64, switch=None) is None  # 128
    assert delta_split.plan(delta._Seqs(3, 8192, None, 64, cpu), 16, 128, cpu, 64, switch=None) is None  # 96: 1.4
    assert delta_split.plan(delta._Seqs(2, 16384, None, 64, cpu), 16, 128, cpu, 64, switch=None) is None  # 2.1
    for T in (512, 4096, 8192):  # no 3 segments of SPLIT_MIN_CHUNKS (64)
        assert delta_split.plan(delta._Seqs(1, T, None, 64, cpu), 16, 128, cpu, 64, switch=None) is None
    assert delta_split.plan(delta._Seqs(1, 16384, None, 64, cpu), 16, 128, cpu, 64, switch=None).L == 64
    monkeypatch.setattr(delta_split, "SPLIT_MIN_CHUNKS", 16)
    ragged = delta._Seqs(1, 5000, torch.tensor([0, 4000, 4100, 5000]), 64, cpu)
    segs = delta_split.plan(ragged, 4, 128, cpu, 64, switch=None)
    assert segs.cu[0] == 0 and segs.cu[-1] == 5000 and segs.soff[-1] == segs.N
    cu = segs.cu.tolist()
    assert all((b - a) % 64 == 0 or b in (4000, 4100, 5000) for a, b in zip(cu[:-1], cu[1:]))
    monkeypatch.setattr(delta_split, "SPLIT_MIN_CHUNKS", 64)
    # packed: 1056 walk programs, but a 24k document's walk (384 chunks) is 3.1 times its fair share (124 chunks):
    # it alone is cut, into 3 segments of 128; the short documents stay whole
    cu = torch.tensor([0, 24576] + [24576 + 512 * i for i in range(1, 17)])
    segs = delta_split.plan(delta._Seqs(1, 32768, cu, 64, cpu), 16, 128, cpu, 64, switch=None)
    assert segs is not None and segs.L == 128 and segs.soff.tolist()[:3] == [0, 3, 4] and segs.N == 3 + 16
    for long in (16384, 12288, 8192):  # 2.1, 1.5, 1.03 shares: two segments do not pay
        cu = torch.tensor([0, long] + [long + 512 * i for i in range(1, (32768 - long) // 512 + 1)])
        assert delta_split.plan(delta._Seqs(1, 32768, cu, 64, cpu), 16, 128, cpu, 64, switch=None) is None


def generalized_reference(q, k, v, w, g, S0, scale, cu=None):
    """Step-by-step generalised gated delta rule (float64), one sequence at a time when packed."""
    B, T, H, _ = q.shape
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, int(cu[i]), int(cu[i + 1]))
                                                                for i in range(len(cu) - 1)]
    outs, finals = torch.zeros_like(v), []
    for n, (b, s, e) in enumerate(bounds):
        S = S0[n]
        for t in range(s, e):
            a = 1.0 if g is None else g[b, t].exp()[:, None, None]
            S = a * S
            u = v[b, t] - torch.einsum("hvk,hk->hv", S, k[b, t])
            S = S + u[:, :, None] * w[b, t][:, None, :]
            outs[b, t] = torch.einsum("hvk,hk->hv", S, q[b, t]) * scale
        finals.append(S)
    return outs, torch.stack(finals)


def check_generalized(T, gated, chunk, dtype=torch.float32, rtol=1e-4, cu=None, seed=31, device="cpu"):
    """The generalised rule (own write keys w) vs ``generalized_reference``; ``gated`` runs the kernels'
    gated variant directly (not exposed by ``chunk_generalized_delta_rule``, see its docstring)."""
    from lazoo.kernels.delta import ChunkDeltaRuleFunction, records_graph

    def chunk_generalized_delta_rule(q, k, v, w, g, *, scale, initial_state, output_final_state, cu_seqlens,
                                     chunk_size):
        return ChunkDeltaRuleFunction.apply(q, k, v, None, g, w, initial_state, scale, cu_seqlens, chunk_size,
                                            output_final_state, records_graph(q, k, v, w, g, initial_state))

    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    H, dk, dv = 2, 12, 20
    x = inputs(B, T, H, dk, dv, seed=seed, g_bias=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    x["k"] = F.normalize(x["k"], dim=-1)
    # VLA-like write keys: unit vectors near k (|I - k w^T| stays near 1); some rows zero (pads)
    w = F.normalize(x["k"] + 0.5 * torch.randn(x["k"].shape, generator=gen, dtype=F64), dim=-1)
    w[:, ::7] = 0.0
    x = {"q": x["q"], "k": x["k"], "v": x["v"], "w": w, **({"g": x["g"]} if gated else {})}
    x = {n: t.to(dtype).to(F64) for n, t in x.items()}
    S0 = torch.randn(N, H, dv, dk, dtype=F64)
    ref = {n: t.clone().requires_grad_(True) for n, t in {**x, "S0": S0}.items()}
    ro, rs, rg = forward_and_grads(lambda: generalized_reference(
        ref["q"], ref["k"], ref["v"], ref["w"], ref.get("g"), ref["S0"], 0.5, cu), ref)
    tst = {n: t.to(device, dtype).requires_grad_(True) for n, t in x.items()}
    tst["S0"] = S0.to(device, torch.float32).requires_grad_(True)
    to, ts, tg = forward_and_grads(lambda: chunk_generalized_delta_rule(
        tst["q"], tst["k"], tst["v"], tst["w"], tst.get("g"), scale=0.5, initial_state=tst["S0"],
        output_final_state=True, cu_seqlens=None if cu is None else torch.tensor(cu, device=device),
        chunk_size=chunk), tst)
    assert_close(to.cpu(), ro, rtol, "generalised output")
    assert_close(ts.cpu(), rs, rtol, "generalised final state")
    with torch.no_grad():  # without autograd: the prefill kernels
        po, ps = chunk_generalized_delta_rule(
            tst["q"], tst["k"], tst["v"], tst["w"], tst.get("g"), scale=0.5, initial_state=tst["S0"],
            output_final_state=True, cu_seqlens=None if cu is None else torch.tensor(cu, device=device),
            chunk_size=chunk)
    assert_close(po.cpu(), ro, rtol, "generalised output without autograd")
    assert_close(ps.cpu(), rs, rtol, "generalised final state without autograd")
    for n in tst:
        assert tg[n] is not None and tg[n].dtype == tst[n].dtype, n
        assert_close(tg[n].cpu(), rg[n], rtol, f"generalised grad {n}")


@needs_interp
@pytest.mark.parametrize("gated,T,chunk", [(False, 45, 16), (True, 70, 64)])
def test_interp_generalized_matches_reference(gated, T, chunk):
    check_generalized(T, gated, chunk)


@needs_interp
def test_interp_generalized_cu_seqlens_fp16():
    check_generalized(52, True, 32, dtype=torch.float16, rtol=3e-3, cu=[0, 17, 17, 47, 52])


# ============================================================================ GPU (device)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# relative error (max |err| / max |ref|) against float64 on the same rounded inputs; measured on an H100
# (Triton 3.6): bf16 <= 7e-3, fp16 <= 8e-4, fp32 <= 5e-6 (tf32x3 products)
GPU_RTOL = {torch.float32: (5e-5, 5e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (1.5e-2, 2e-2)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("g_bias", [2.0, -2.0], ids=["slow_decay", "fast_decay"])
def test_gpu_delta_matches_float64(op, dtype, g_bias):
    if op == "delta" and g_bias != 2.0:
        pytest.skip("no gate")
    B, T, H, D = 2, 1000, 4, 128
    x = inputs(B, T, H, D, D, seed=21, g_bias=g_bias)
    S0 = torch.randn(B, H, D, D, dtype=F64) * 0.5
    rtol, grad_rtol = GPU_RTOL[dtype]
    check_against_reference(op, x, S0, rtol, grad_rtol, device="cuda", dtype=dtype,
                            ref_backend="chunk", ref_device="cuda", chunk_size=64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_gpu_cu_seqlens_and_mask(op):
    H, D = 4, 128
    cu = torch.tensor([0, 300, 301, 1000, 1300, 2000])
    x = inputs(1, 2000, H, D, D, seed=22)
    S0 = torch.randn(5, H, D, D, dtype=F64) * 0.5
    check_against_reference(op, x, S0, *GPU_RTOL[torch.bfloat16], device="cuda", dtype=torch.bfloat16,
                            ref_backend="chunk", ref_device="cuda", cu_seqlens=cu)
    x = inputs(2, 777, H, D, D, seed=23)
    mask = left_pad_mask([777, 500], 777, holes=[(0, 100)])
    check_against_reference(op, x, torch.randn(2, H, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, ref_backend="chunk", ref_device="cuda",
                            mask=mask)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_gpu_state_gradient_walk_with_whole_dv_blocks(monkeypatch, op):
    """_bwd_dhu's 128-wide dv blocks (8 warps, 2 stages), taken where its programs outnumber the SMs: forced here at a
    small shape by reporting one SM; packed sequences with a carried state."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "num_sms", lambda device: 1)
    assert delta._dhu_launch(128, 128, 2, torch.device("cuda"), False, False)[0] == 128
    H, D = 4, 128
    x = inputs(1, 1000, H, D, D, seed=29)
    check_against_reference(op, x, torch.randn(3, H, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, ref_backend="chunk", ref_device="cuda",
                            cu_seqlens=torch.tensor([0, 1, 400, 1000]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("local_du", [True, False], ids=["local_du_in_walk", "dv_local_kernel"])
@pytest.mark.parametrize("norms_inside", [True, False], ids=["norms_in_kernels", "norm_pass"])
def test_gpu_backward_variants(monkeypatch, local_du, norms_inside):
    """The state-gradient walk forming P^T dO itself or reading it, and the L2 norms' backward in the kernels or in
    a pass of its own, each forced, against float64 (gated, bf16, packed sequences with a carried state)."""
    from lazoo.kernels import delta

    monkeypatch.setattr(delta, "LOCAL_DU_IN_WALK", local_du)
    monkeypatch.setattr(delta, "NORM_BACKWARD_IN_KERNELS", norms_inside)
    H, D = 4, 128
    x = inputs(1, 1000, H, D, D, seed=32)
    check_against_reference("gated", x, torch.randn(3, H, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, ref_backend="chunk", ref_device="cuda",
                            cu_seqlens=torch.tensor([0, 1, 400, 1000]))


def _needs_hopper_kernel(supported, what: str):
    """Skip unless ``supported`` (a kernel module's check) takes bf16 heads of 128 on this GPU."""
    why = supported(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128, 128, 64, False)
    if why is not None:
        pytest.skip(f"{what} does not run here: {why}")


def _needs_gluon_walk():
    from lazoo.kernels import delta_gluon

    _needs_hopper_kernel(delta_gluon.walk_supported, "the Gluon walk")


def _check_packed_and_grouped_against_float64(op, seed):
    """``check_against_reference`` on the GPU in bf16 (float64 chunk form): three packed sequences (one of a token)
    of 4 heads of 128 with a carried state, then a batch of 2 with two value heads a key head and fp32 β and g."""
    H, D = 4, 128
    x = inputs(1, 1000, H, D, D, seed=seed)
    check_against_reference(op, x, torch.randn(3, H, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, ref_backend="chunk", ref_device="cuda",
                            cu_seqlens=torch.tensor([0, 1, 400, 1000]))
    x = inputs(2, 1000, 2, D, D, seed=seed + 1, value_heads=4)
    check_against_reference(op, x, torch.randn(2, 4, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, scalar_dtype=torch.float32, ref_backend="chunk",
                            ref_device="cuda")


def _backward_with_and_without(monkeypatch, switch, label, q, k, v, beta, g, S0, seqs, saved, do, dsT):
    """``delta.chunk_bwd`` on the same saved forward and upstream gradients with ``delta.<switch>`` off and on: every
    gradient finite, of the same dtype and shape, within 1e-2 of the other (relative, Frobenius)."""
    from lazoo.kernels import delta

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(delta, switch, on)
        runs[on] = delta.chunk_bwd(q, k, v, beta, g, S0, q.shape[-1] ** -0.5, seqs, 64, saved, do, dsT, True)
    for name, ref, got in zip(["dq", "dk", "dv", "dbeta", "dg", "ds0"], runs[False], runs[True]):
        if ref is None:
            assert got is None, name
            continue
        err = rel_err(got.double(), ref.double())
        print(f"{label} {name}: {err:.1e}")
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.isfinite(got).all(), name
        assert err < 1e-2, (name, err)


def _packed_gpu_inputs(seed, op, dtype=torch.bfloat16):
    """Flattened inputs as ``delta.chunk_fwd`` takes them, on the GPU: four packed sequences of 1, 62, 337 and 600
    tokens (one shorter than a chunk), two key heads of normalised q and k, four value heads with fp32 β and g
    (gated), a carried state; returns q, k, v, beta, g, S0 and the sequences' table."""
    from lazoo.kernels import delta

    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, HK, H, D = 1000, 2, 4, 128
    cu = torch.tensor([0, 1, 63, 400, 1000], device="cuda")
    q, k = (F.normalize(torch.randn(T, HK, D, device="cuda", generator=gen), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(T, H, D, device="cuda", generator=gen).to(dtype)
    beta = torch.rand(T, H, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn(T, H, device="cuda", generator=gen) + 2) if op == "gated" else None
    S0 = torch.randn(4, H, D, D, device="cuda", generator=gen) * 0.5
    return q, k, v, beta, g, S0, delta.seqs_for(1, T, cu, 64, q.device)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bv", [64, 32], ids=["dv_blocks_64", "dv_blocks_32"])
def test_gpu_gluon_walk_matches_the_triton_kernels(monkeypatch, op, dtype, bv):
    """The training forward's state walk and outputs as one Gluon kernel against ``_fwd_h`` and ``_fwd_o`` on the same
    inputs (packed sequences of ragged lengths, one shorter than a chunk, a carried state, two value heads a key head
    with fp32 β and g): outputs, final state and what the backward reads (chunk states and pseudo-values); and the
    forward without autograd through the same kernel."""
    from lazoo.kernels import delta, delta_gluon

    _needs_gluon_walk()
    monkeypatch.setattr(delta_gluon, "walk_block", lambda V: bv)
    monkeypatch.setattr(delta, "GLUON_WALK_IN_PREFILL", True)  # off by default; kept working
    monkeypatch.setattr(delta, "USE_FUSED_TRAINING", False)  # the fused forward would stand in for the walk
    monkeypatch.setattr(delta, "USE_FUSED_PREFILL", False)
    q, k, v, beta, g, S0, seqs = _packed_gpu_inputs(41, op, dtype)
    D = q.shape[-1]
    runs = {}
    for gluon in (False, True):
        monkeypatch.setattr(delta, "USE_GLUON_WALK", gluon)
        o, sT, saved = delta.chunk_fwd(q, k, v, beta, g, S0, D ** -0.5, seqs, 64, True)
        runs[gluon] = (o, sT, saved[3], saved[4])
    o, sT, saved = delta.chunk_fwd(q, k, v, beta, g, S0, D ** -0.5, seqs, 64, True, save=False)  # no autograd
    assert saved is None
    names = ["output", "final state", "pseudo-values", "chunk states", "output without autograd",
             "final state without autograd"]
    for name, ref, got in zip(names, runs[False] + runs[False][:2], runs[True] + (o, sT)):
        err = rel_err(got.double(), ref.double())
        print(f"{op} {dtype} {name}: {err:.1e}")
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.isfinite(got).all(), name
        assert err < (2e-3 if "final state" in name else 1e-2), (name, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("bv", [64, 32], ids=["dv_blocks_64", "dv_blocks_32"])
def test_gpu_gluon_backward_walk_matches_the_triton_kernels(monkeypatch, op, bv):
    """The backward with its reverse walk as one Gluon kernel against the backward with ``_bwd_dv_local`` +
    ``_bwd_dhu`` on the same inputs and saved forward (packed ragged sequences, one shorter than a chunk, a carried
    state and a final-state gradient, two value heads a key head): every gradient."""
    from lazoo.kernels import delta, delta_gluon

    _needs_gluon_walk()
    monkeypatch.setattr(delta_gluon, "walk_block", lambda V: bv)
    gen = torch.Generator(device="cuda").manual_seed(45)
    T, HK, H, D = 1000, 2, 4, 128
    cu = torch.tensor([0, 1, 63, 400, 1000], device="cuda")
    q, k = (F.normalize(torch.randn(T, HK, D, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
            for _ in range(2))
    v, do = (torch.randn(T, H, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn(T, H, device="cuda", generator=gen) + 2) if op == "gated" else None
    S0, dsT = (torch.randn(4, H, D, D, device="cuda", generator=gen) * 0.5 for _ in range(2))
    seqs = delta.seqs_for(1, T, cu, 64, q.device)
    _, _, saved = delta.chunk_fwd(q, k, v, beta, g, S0, D ** -0.5, seqs, 64, False)
    _backward_with_and_without(monkeypatch, "USE_GLUON_BWD_WALK", f"{op} dv blocks of {bv}",
                               q, k, v, beta, g, S0, seqs, saved, do, dsT)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("bv", [64, 32], ids=["dv_blocks_64", "dv_blocks_32"])
@pytest.mark.parametrize("walks", ["forward", "backward", "both"])
def test_gpu_gluon_walk_matches_float64(monkeypatch, op, bv, walks):
    """Forward and backward with the Gluon walks forced (the forward's, the backward's or both), against float64:
    packed sequences with a carried state, and grouped value heads with fp32 β and g."""
    from lazoo.kernels import delta, delta_gluon

    _needs_gluon_walk()
    monkeypatch.setattr(delta, "USE_GLUON_WALK", walks in ("forward", "both"))
    monkeypatch.setattr(delta, "USE_GLUON_BWD_WALK", walks in ("backward", "both"))
    monkeypatch.setattr(delta, "USE_FUSED_TRAINING", False)  # the fused forward would stand in for the walk
    monkeypatch.setattr(delta_gluon, "walk_block", lambda V: bv)
    _check_packed_and_grouped_against_float64(op, seed=43)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("walks", ["triton", "gluon"])
@pytest.mark.parametrize("min_chunks,backward", [(4, "maps_from_forward"), (16, "maps_from_forward"), (4, "walked")],
                         ids=["segments_of_4", "segments_of_16", "maps_walked"])
def test_gpu_split_sequences_match_float64(monkeypatch, op, walks, min_chunks, backward):
    """Few long sequences split into segments (the default where a walk is 2.5 times its fair share), each walk
    kind, the backward's chaining with the forward's maps (the default) or with maps of its own walking, against
    float64: packed ragged sequences with a carried state, grouped value heads with fp32 β
    and g, and the forward without autograd."""
    from lazoo.kernels import delta, delta_split

    monkeypatch.setattr(delta_split, "SEGMENT_BWD_MAPS_FROM_FORWARD", backward == "maps_from_forward")
    if walks == "gluon":
        _needs_gluon_walk()
    monkeypatch.setattr(delta, "USE_GLUON_WALK", walks == "gluon")
    monkeypatch.setattr(delta, "USE_GLUON_BWD_WALK", walks == "gluon")
    monkeypatch.setattr(delta_split, "SPLIT_MIN_CHUNKS", min_chunks)
    monkeypatch.setattr(delta_split, "SPLIT_MIN_PIECES", 2)
    H, D = 4, 128
    cu = torch.tensor([0, 1, 700, 2000])
    seqs = delta.seqs_for(1, 2000, cu.cuda(), 64, torch.device("cuda"))
    assert delta.split_segments(seqs, H, D, torch.empty(1, device="cuda"), 64) is not None
    x = inputs(1, 2000, H, D, D, seed=45)
    check_against_reference(op, x, torch.randn(3, H, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, ref_backend="chunk", ref_device="cuda",
                            cu_seqlens=cu)
    x = inputs(1, 3000, 2, D, D, seed=46, value_heads=4)
    check_against_reference(op, x, torch.randn(1, 4, D, D, dtype=F64) * 0.5, *GPU_RTOL[torch.bfloat16],
                            device="cuda", dtype=torch.bfloat16, scalar_dtype=torch.float32, ref_backend="chunk",
                            ref_device="cuda")
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    S0 = torch.randn(1, 4, D, D) * 0.5
    with torch.no_grad():
        ro, rs = call(op, {n: t.to(F64).cuda() for n, t in xb.items()}, initial_state=S0.to(F64).cuda(),
                      output_final_state=True, backend="chunk")
        o, s = call(op, {n: t.cuda() for n, t in xb.items()}, initial_state=S0.cuda(), output_final_state=True,
                    backend="triton")
    assert_close(o.cpu(), ro.cpu(), GPU_RTOL[torch.bfloat16][0], f"{op} split prefill output")
    assert_state_close(s.cpu(), rs.cpu(), GPU_RTOL[torch.bfloat16][0], f"{op} split prefill state")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_gpu_grouped_value_heads(op):
    # Qwen3.5's layout: twice as many value heads as query/key heads, bf16 inputs with fp32 β and g
    B, T, H, D = 2, 1000, 2, 128
    x = inputs(B, T, H, D, D, seed=25, value_heads=2 * H)
    S0 = torch.randn(B, 2 * H, D, D, dtype=F64) * 0.5
    check_against_reference(op, x, S0, *GPU_RTOL[torch.bfloat16], device="cuda", dtype=torch.bfloat16,
                            scalar_dtype=torch.float32, ref_backend="chunk", ref_device="cuda", chunk_size=64,
                            cu_seqlens=None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["delta", "gated"])
def test_gpu_forward_without_autograd_matches_float64(op, dtype):
    # a prefill: the forward kernels that store nothing for a backward, packed ragged sequences, grouped value
    # heads and a carried state, against float64
    H, D = 2, 128
    cu = torch.tensor([0, 300, 301, 1000, 1777])
    x = inputs(1, 1777, H, D, D, seed=26, value_heads=2 * H)
    x = {n: t.to(dtype).to(F64) for n, t in x.items()}
    S0 = torch.randn(4, 2 * H, D, D, dtype=F64) * 0.5
    with torch.no_grad():
        ro, rs = call(op, {n: t.cuda() for n, t in x.items()}, initial_state=S0.cuda(), output_final_state=True,
                      cu_seqlens=cu.cuda(), backend="chunk")
        o, s = call(op, {n: t.to("cuda", dtype) for n, t in x.items()}, initial_state=S0.float().cuda(),
                    output_final_state=True, cu_seqlens=cu.cuda(), backend="triton")
    rtol = GPU_RTOL[dtype][0]
    assert o.dtype == dtype
    assert_close(o.cpu(), ro.cpu(), rtol, f"{op} output without autograd")
    assert_state_close(s.cpu(), rs.cpu(), rtol, f"{op} state without autograd")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_decode_matches_float64(dtype):
    B, H, D = 8, 16, 128
    x = inputs(B, 4, H, D, D, seed=24)
    S0 = torch.randn(B, H, D, D, dtype=F64) * 0.5
    x = {n: t.to(dtype).to(F64) for n, t in x.items()}
    with torch.no_grad():
        ro, rs = call("gated", x, initial_state=S0, output_final_state=True, backend="recurrent")
        xc = {n: t.to("cuda", dtype) for n, t in x.items()}
        o, s = call("gated", xc, initial_state=S0.float().cuda(), output_final_state=True)  # auto -> triton
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert o.dtype == dtype
    assert_close(o.cpu(), ro, tol, "decode output")
    assert_close(s.cpu(), rs, tol, "decode state")


@pytest.mark.gpu
@needs_cuda
def test_gpu_generalized_matches_float64():
    check_generalized(300, False, 64, dtype=torch.float32, rtol=5e-5, device="cuda")
    check_generalized(300, False, 64, dtype=torch.bfloat16, rtol=2e-2, device="cuda", cu=[0, 100, 101, 300])


def _needs_fused_forward():
    from lazoo.kernels import delta_fused

    _needs_hopper_kernel(delta_fused.supported, "the fused forward")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["packed", "batch"])
@pytest.mark.parametrize("bv", [64, 128], ids=["dv_blocks_64", "dv_blocks_128"])
def test_gpu_fused_forward_matches_the_triton_kernels_and_float64(monkeypatch, op, dtype, layout, bv):
    """The forward without autograd as one warp-specialised kernel (``delta_fused``) against ``_fwd_mix`` +
    ``_fwd_walk`` on the same inputs and against the float64 recurrence: packed sequences of ragged lengths (one of a
    single token, one shorter than a chunk; the last chunk's spare rows are the next sequence's) or a batch whose
    length is no multiple of a chunk (the last rows past the tensor's end), a carried state, two value heads a key
    head, β in q's dtype and g in fp32: outputs and final states, in dv blocks of 64 and of 128."""
    from lazoo.kernels import delta, delta_fused

    _needs_fused_forward()
    monkeypatch.setattr(delta_fused, "DV_BLOCK", bv)
    gen = torch.Generator(device="cuda").manual_seed(43)
    HK, H, D = 2, 4, 128
    B, T, cu = (1, 1000, torch.tensor([0, 1, 63, 400, 1000], device="cuda")) if layout == "packed" else (2, 300, None)
    N = 4 if cu is not None else B
    q, k = (torch.randn(B, T, HK, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 2)
    S0 = torch.randn(N, H, D, D, device="cuda", generator=gen) * 0.5
    x = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu, scale=D ** -0.5)
    runs = {}
    with torch.no_grad():
        for fused in (False, True):
            monkeypatch.setattr(delta, "USE_FUSED_PREFILL", fused)
            runs[fused] = call(op, x, backend="triton", **kw)
        x64 = {n: t.double() for n, t in x.items()}
        ref = call(op, x64, backend="recurrent", **{**kw, "initial_state": S0.double()})
    for name, base, got, want in zip(["output", "final state"], runs[False], runs[True], ref):
        assert got.dtype == base.dtype and got.shape == base.shape and torch.isfinite(got).all(), name
        err, base_err = rel_err(got.double(), want), rel_err(base.double(), want)
        print(f"{op} {dtype} {layout} dv blocks of {bv} {name}: fused {err:.1e}, Triton kernels {base_err:.1e}, "
              f"between {rel_err(got.double(), base.double()):.1e}")
        assert err < 1.5 * base_err + 1e-3, (name, err, base_err)


def _solve_float64(k, beta, g, seqs, C=64):
    """G and A = (I + strict_tril(E ⊙ K Kᵀ) diag(β))⁻¹ of every chunk in float64, by each chunk's own inverse."""
    TT, HK, D = k.shape
    H = beta.shape[1]
    kv = k.double()[:, torch.arange(H, device=k.device) // (H // HK)]  # each value head's key head
    G = torch.zeros(TT, H, dtype=F64, device=k.device)
    A = torch.zeros(TT, H, C, dtype=F64, device=k.device)
    cu = seqs.cu.tolist()
    for b, e in zip(cu[:-1], cu[1:]):
        for t0 in range(b, e, C):
            n = min(C, e - t0)
            rows = slice(t0, t0 + n)
            Gc = torch.cumsum(g[rows].double(), 0) if g is not None else torch.zeros(n, H, dtype=F64,
                                                                                     device=k.device)
            G[rows] = Gc
            kc = kv[rows].transpose(0, 1)  # [H, n, D]
            L = (kc @ kc.transpose(1, 2)) * beta[rows].double().T[:, None, :]
            L = L * torch.exp(Gc.T[:, :, None] - Gc.T[:, None, :])
            L = torch.tril(L, -1) + torch.eye(n, dtype=F64, device=k.device)
            A[rows, :, :n] = torch.linalg.inv(L).transpose(0, 1)
    return G, A


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gluon_solve_matches_the_triton_kernel_and_float64(monkeypatch, op, dtype):
    """The solve as one Gluon kernel (``delta_solve``) against ``_fwd_solve`` and against each chunk's float64
    inverse: packed ragged sequences (one of a single token, one shorter than a chunk), two value heads a key head,
    fp32 β and g; A stored in fp32 and in q's dtype. Then forward and backward against float64 with it forced."""
    from lazoo.kernels import delta, delta_solve

    _needs_hopper_kernel(delta_solve.supported, "the Gluon solve")
    q, k, v, beta, g, S0, seqs = _packed_gpu_inputs(51, op, dtype)
    H, V = v.shape[1:]
    want_G, want_A = _solve_float64(k, beta, g, seqs)
    for a_dtype in (torch.float32, dtype):
        runs = {}
        for on in (False, True):
            monkeypatch.setattr(delta, "USE_GLUON_SOLVE", on)
            runs[on] = delta.fwd_solve(k, beta, g, seqs, 64, H, V, a_dtype)
        for name, base, got, want in zip(["G", "A"], runs[False], runs[True], [want_G, want_A]):
            if base is None:
                assert got is None and op == "delta"
                continue
            assert got.dtype == base.dtype and got.shape == base.shape and torch.isfinite(got).all(), name
            err, base_err = rel_err(got.double(), want), rel_err(base.double(), want)
            print(f"{op} {dtype} A in {a_dtype} {name}: Gluon {err:.1e}, Triton {base_err:.1e}")
            assert err <= 1.5 * base_err + 1e-6, (name, err, base_err)
    monkeypatch.setattr(delta, "USE_GLUON_SOLVE", True)
    _check_packed_and_grouped_against_float64(op, seed=53)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_chunk_backward_matches_the_triton_kernels_and_float64(monkeypatch, op, dtype):
    """The backward's chunk-parallel part as one Gluon kernel (``delta_chunk_bwd``) against ``_bwd_dqkw`` +
    ``_bwd_wy`` on the same saved forward and upstream gradients (packed sequences of ragged lengths, one of a token,
    one shorter than a chunk, a carried state, two value heads a key head with fp32 β and g): every gradient; then
    forward and backward against float64 with it forced (packed, with the norms' backward inside the kernel, and
    grouped value heads)."""
    from lazoo.kernels import delta, delta_chunk_bwd

    _needs_hopper_kernel(delta_chunk_bwd.supported, "the Gluon chunk backward")
    q, k, v, beta, g, S0, seqs = _packed_gpu_inputs(53, op, dtype)
    D = q.shape[-1]
    o, sT, saved = delta.chunk_fwd(q, k, v, beta, g, S0, D ** -0.5, seqs, 64, True)
    gen = torch.Generator(device="cuda").manual_seed(54)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dsT = torch.randn(sT.shape, device="cuda", generator=gen)
    # 16-bit rounding apart: the Triton kernels round dW and dW~ between them, the Gluon kernel keeps dW in fp32
    _backward_with_and_without(monkeypatch, "USE_CHUNK_BWD", f"{op} {dtype}", q, k, v, beta, g, S0, seqs, saved, do,
                               dsT)
    if dtype == torch.bfloat16:  # the float64 checks run in bf16
        monkeypatch.setattr(delta, "USE_CHUNK_BWD", True)
        _check_packed_and_grouped_against_float64(op, seed=55)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["delta", "gated"])
@pytest.mark.parametrize("bv", [64, 128], ids=["dv_blocks_64", "dv_blocks_128"])
def test_gpu_fused_training_forward_matches_the_walk_and_float64(monkeypatch, op, bv):
    """The training forward through the fused kernel (storing the chunk states and pseudo-values) against the Gluon
    walk's on the same inputs (packed ragged sequences, one shorter than a chunk, a carried state, two value heads a
    key head with fp32 β and g): outputs, final state and what the backward reads; then forward and backward
    against float64 with the fused forward forced (packed, and grouped value heads)."""
    from lazoo.kernels import delta, delta_fused

    _needs_fused_forward()
    monkeypatch.setattr(delta_fused, "DV_BLOCK", bv)
    monkeypatch.setattr(delta, "USE_GLUON_WALK", True)
    q, k, v, beta, g, S0, seqs = _packed_gpu_inputs(47, op)
    D = q.shape[-1]
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(delta, "USE_FUSED_TRAINING", fused)
        o, sT, saved = delta.chunk_fwd(q, k, v, beta, g, S0, D ** -0.5, seqs, 64, True)
        runs[fused] = (o, sT, saved[2], saved[3], saved[4])
    # the same W~ (one kernel); the rest within bf16 rounding of each other (U = A X here in tf32 from fp32 A, there
    # U~ - W~ Sᵀ from A rounded to bf16), each checked against float64 below
    for name, ref, got in zip(["output", "final state", "W~", "pseudo-values", "chunk states"], runs[False],
                              runs[True]):
        err = rel_err(got.double(), ref.double())
        print(f"{op} dv blocks of {bv} {name}: {err:.1e}")
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.isfinite(got).all(), name
        assert err < (1e-6 if name == "W~" else 1e-2), (name, err)
    monkeypatch.setattr(delta, "USE_FUSED_TRAINING", True)
    _check_packed_and_grouped_against_float64(op, seed=48)
