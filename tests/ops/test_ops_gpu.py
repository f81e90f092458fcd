"""Ops on CUDA (``-m gpu``): the chunk forms in fp32/bf16 against the float64 CPU reference."""

import logging

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, forward_and_grads, left_pad_mask

from lazoo import ops
from lazoo.ops import backend as op_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, T, H, D = 2, 200, 2, 64


def inputs():
    torch.manual_seed(0)
    q, k, u = (torch.randn(B, T, H, D, dtype=torch.float64) for _ in range(3))
    v = torch.randn(B, T, H, D, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, dtype=torch.float64) + 3)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    M = torch.randn(B, H, D, D, dtype=torch.float64)
    states = {
        "softmax_attention": {"k": torch.randn(B, 9, H, D, dtype=torch.float64),
                              "v": torch.randn(B, 9, H, D, dtype=torch.float64),
                              "mask": torch.ones(B, 9, dtype=torch.bool)},
        "linear_attention": {"S": torch.randn(B, H, D, D, dtype=torch.float64),
                             "z": torch.rand(B, H, D, dtype=torch.float64) * 3},
        "matrix": torch.randn(B, H, D, D, dtype=torch.float64),
        "vla": {"S": torch.randn(B, H, D, D, dtype=torch.float64),
                "A": torch.eye(D, dtype=torch.float64) * 10 + 0.3 * M @ M.transpose(-1, -2) / D,
                "z": torch.rand(B, H, D, dtype=torch.float64) * 3,
                "t": torch.tensor([7, 0])},
    }
    return dict(q=q, k=k, v=v, u=u, g=g, beta=beta), states


CASES = {
    "softmax_attention": (lambda x, **kw: ops.softmax_attention(x["q"], x["k"], x["v"], window=64, **kw),
                          "softmax_attention"),
    "linear_attention": (lambda x, **kw: ops.linear_attention(x["q"], x["k"], x["v"], **kw), "linear_attention"),
    "gated_linear_attention": (lambda x, **kw: ops.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], **kw),
                               "matrix"),
    "delta_rule": (lambda x, **kw: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw), "matrix"),
    "gated_delta_rule": (lambda x, **kw: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw),
                         "matrix"),
    "vla": (lambda x, **kw: ops.vla(x["q"], x["k"], x["v"], x["u"], **kw), "vla"),
}


def to(obj, device, dtype=None):
    if isinstance(obj, dict):
        return {key: to(x, device, dtype) for key, x in obj.items()}
    return obj.to(device=device, dtype=dtype if obj.is_floating_point() and dtype else obj.dtype)


@pytest.mark.parametrize("name", CASES)
def test_cuda_chunk_fp32_matches_cpu_float64_reference(name):
    fn, state_key = CASES[name]
    x, states = inputs()
    mask = left_pad_mask([T, T - 37], T)
    state = states[state_key]
    ref_leaves = {key: x[key].requires_grad_(True) for key in ("q", "k", "v")}
    ref_o, ref_s, ref_g = forward_and_grads(
        lambda: fn(x, initial_state=state, mask=mask, output_final_state=True, backend="recurrent"), ref_leaves)

    xc = {key: t.detach().to("cuda", torch.float32) for key, t in x.items()}
    leaves = {key: xc[key].requires_grad_(True) for key in ("q", "k", "v")}
    o, s, grads = forward_and_grads(
        lambda: fn(xc, initial_state=to(state, "cuda", torch.float32), mask=mask.cuda(),
                   output_final_state=True, backend="chunk"), leaves)
    assert o.is_cuda and o.dtype == torch.float32
    assert_close(o.cpu(), ref_o, 1e-4, f"{name} output")
    assert_state_close(to(s, "cpu"), ref_s, 1e-4, f"{name} state")
    for key in leaves:
        assert_close(grads[key].cpu(), ref_g[key], 1e-3, f"{name} grad {key}")


@pytest.mark.parametrize("name", CASES)
def test_cuda_bf16_keeps_dtype(name):
    fn, _ = CASES[name]
    x, _ = inputs()
    ref, _ = fn(x, backend="recurrent")
    o, s = fn({key: t.to("cuda", torch.bfloat16) for key, t in x.items()}, output_final_state=True)
    assert o.dtype == torch.bfloat16
    parts = s.values() if isinstance(s, dict) else [s]
    # recurrent states are fp32; the softmax KV cache keeps the input dtype (SDPA runs in it)
    state_dtype = torch.bfloat16 if name == "softmax_attention" else torch.float32
    assert all(p.dtype == state_dtype for p in parts if p.is_floating_point())
    err = (o.double().cpu() - ref).abs().max() / ref.abs().max()
    assert err < 5e-2, f"{name} bf16: relative error {err:.2e}"


def test_cuda_auto_backend_logs_once(caplog, monkeypatch):
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    monkeypatch.setattr(op_backend, "_FALLBACK_LOGGED", set())
    # VLA's scan kernel holds A in registers: dk = 160 > 128 falls back to the chunk form, saying so once
    xc = {key: torch.randn(B, 16, H, 160, device="cuda") for key in ("q", "k", "v", "u")}
    with caplog.at_level(logging.INFO, logger="lazoo"):
        for _ in range(2):
            CASES["vla"][0](xc)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["vla"]
    assert "dk up to 128" in caplog.records[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_gla_chunk_kernel_matches_float64(dtype, monkeypatch):
    """ops.gla on the Triton backend (lazoo.kernels.gla: chunk kernels, hand-written backward) at
    T = 1000, H = 4, D = 128 against float64: outputs, final state and the gradients of q, k, v, g and
    the initial state. Mild decays in most key dims, strong ones (-5 to -20 per step) in every eighth,
    a left-padded row. The float64 reference is the PyTorch chunk form on the GPU (the CPU tests tie
    it to the step-by-step form)."""
    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    from lazoo.kernels import gla as kg

    calls = []
    orig = kg.chunk_gla
    monkeypatch.setattr(kg, "chunk_gla", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    Bg, Tg, Hg, Dg = 2, 1000, 4, 128
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(Bg, Tg, Hg, Dg, generator=gen, dtype=torch.float64) for _ in range(3))
    g = F.logsigmoid(torch.randn(Bg, Tg, Hg, Dg, generator=gen, dtype=torch.float64) + 4)
    g[..., ::8] = -5 - 15 * torch.rand(Bg, Tg, Hg, Dg // 8, generator=gen, dtype=torch.float64)
    S0 = torch.randn(Bg, Hg, Dg, Dg, generator=gen, dtype=torch.float64)
    mask = left_pad_mask([Tg, Tg - 77], Tg).cuda()

    def run(dt, backend):
        leaves = {n: x.to("cuda", dt).requires_grad_(True) for n, x in (("q", q), ("k", k), ("v", v), ("g", g))}
        state_dt = torch.float64 if dt == torch.float64 else torch.float32
        leaves["S0"] = S0.to("cuda", state_dt).requires_grad_(True)
        return forward_and_grads(
            lambda: ops.gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], initial_state=leaves["S0"],
                            output_final_state=True, mask=mask, backend=backend), leaves)

    o_r, s_r, g_r = run(torch.float64, "chunk")
    assert not calls
    o, s, grads = run(dtype, "triton")
    assert calls, "the Triton backend did not take the chunk kernel"
    assert o.dtype == dtype and s.dtype == torch.float32
    rtol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert_close(o, o_r, rtol, f"gla {dtype} output")
    assert_state_close(s, s_r, rtol, f"gla {dtype} final state")
    for name, gr in g_r.items():
        assert_close(grads[name], gr, rtol, f"gla {dtype} grad {name}")
