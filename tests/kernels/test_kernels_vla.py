"""Triton VLA (lazoo.kernels.vla.token scan + the generalised delta rule kernel) through ``vla(backend="triton")``
against the float64 recurrent form (Algorithm 1, itself tested against a literal transcription in
test_ops_vla.py): outputs, every part of the final state and the gradients of q, k, v, u and the
initial S, A, z, at ragged T with refreshes (per-sample step counts), left padding and interior pads.

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1 (see test_kernels_delta.py).
GPU (``-m gpu``): real shapes in bf16/fp32, and a long sequence that crosses many checkpoints of A.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close, forward_and_grads, left_pad_mask, rel_err, state_parts

from lazoo.ops import vla

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def inputs(B, T, H, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, u = (torch.randn(B, T, H, dk, generator=gen, dtype=F64) for _ in range(3))
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    M = torch.randn(B, H, dk, dk, generator=gen, dtype=F64)
    state = {"S": torch.randn(B, H, dv, dk, generator=gen, dtype=F64),
             "A": torch.eye(dk, dtype=F64) * 10 + 0.3 * M @ M.transpose(-1, -2) / dk,
             "z": torch.rand(B, H, dk, generator=gen, dtype=F64) * 3,
             "t": torch.tensor([7, 19, 0, 3][:B])}
    return {"q": q, "k": k, "v": v, "u": u}, state


def check(B, T, H, dk, dv, rtol, grad_rtol, dtype=torch.float32, device="cpu", mask=None, seed=0,
          ref_backend="recurrent", **hp):
    x, state = inputs(B, T, H, dk, dv, seed)
    x = {n: t.to(dtype).to(F64) for n, t in x.items()}
    float_parts = ("S", "A", "z")

    def run(leaves, backend, dev, dt):
        st = {**{n: leaves[n] for n in float_parts}, "t": state["t"].to(dev)}
        m = None if mask is None else mask.to(dev)
        return vla(leaves["q"], leaves["k"], leaves["v"], leaves["u"], initial_state=st, output_final_state=True,
                   mask=m, backend=backend, **hp)

    ref = {**{n: t.to(device if ref_backend == "chunk" else "cpu").requires_grad_(True) for n, t in x.items()},
           **{n: state[n].to(device if ref_backend == "chunk" else "cpu").requires_grad_(True)
              for n in float_parts}}
    ro, rs, rg = forward_and_grads(lambda: run(ref, ref_backend, ref["q"].device, F64), ref)
    tst = {**{n: t.to(device, dtype).requires_grad_(True) for n, t in x.items()},
           **{n: state[n].to(device, torch.float32).requires_grad_(True) for n in float_parts}}
    to, ts, tg = forward_and_grads(lambda: run(tst, "triton", device, dtype), tst)
    assert to.dtype == dtype
    errs = {"o": rel_err(to, ro)} | {n: rel_err(a, b) for (n, a), (_, b) in zip(state_parts(ts), state_parts(rs))}
    errs |= {f"d{n}": rel_err(tg[n], rg[n]) for n in tst}
    print("vla triton rel errors: " + " ".join(f"{key}={val:.1e}" for key, val in errs.items()))
    assert_close(to.cpu(), ro.cpu(), rtol, "output")
    for (name, a), (_, b) in zip(state_parts(ts), state_parts(rs)):
        assert_close(a.cpu(), b.cpu().to(a.dtype) if not a.is_floating_point() else b.cpu(), rtol, name)
    for n in tst:
        assert tg[n] is not None, f"no gradient reaches {n}"
        assert_close(tg[n].cpu(), rg[n].cpu(), grad_rtol, f"grad {n}")


@needs_interp
def test_interp_vla_matches_algorithm1():
    # T = 45: refreshes at different positions per sample (t0 = 7, 19, 0), a partial last chunk
    mask = left_pad_mask([45, 38, 30], 45, holes=[(0, 21), (1, 40)])
    check(3, 45, 2, 12, 10, 1e-4, 1e-4, mask=mask, chunk_size=16)


@needs_interp
def test_interp_vla_fp16_other_period():
    check(2, 37, 1, 16, 16, 5e-3, 1e-2, dtype=torch.float16, refresh_period=7, refresh_eta=0.05, chunk_size=32)


@needs_interp
def test_interp_vla_checkpoint_segments(monkeypatch):
    # more tokens than one checkpoint segment: the backward rebuilds A from every checkpoint
    import lazoo.kernels.vla.token as kv

    monkeypatch.setattr(kv, "CKPT", 8)
    check(1, 30, 1, 8, 8, 1e-4, 1e-4, chunk_size=16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, (1e-4, 1e-3)), (torch.bfloat16, (2e-2, 5e-2))], ids=str)
def test_gpu_vla_matches_float64(dtype, tol):
    mask = left_pad_mask([1000, 700], 1000, holes=[(0, 100)])
    check(2, 1000, 4, 128, 128, *tol, dtype=dtype, device="cuda", mask=mask, ref_backend="chunk")


@pytest.mark.gpu
@needs_cuda
def test_gpu_vla_long_sequence():
    # 4096 tokens: 16 checkpoint segments of A in the backward
    check(1, 4096, 2, 64, 64, 1e-4, 1e-3, device="cuda", ref_backend="chunk")


@needs_interp
def test_interp_vla_decode_matches_algorithm1():
    # no autograd, a few tokens against a carried state: the fused recurrent S update
    x, state = inputs(3, 3, 2, 16, 12, seed=5)
    mask = left_pad_mask([3, 2, 1], 3)
    with torch.no_grad():
        ro, rs = vla(*x.values(), initial_state=state, output_final_state=True, mask=mask, backend="recurrent")
        st = {n: (t.float() if t.is_floating_point() else t) for n, t in state.items()}
        o, s = vla(*(t.float() for t in x.values()), initial_state=st, output_final_state=True, mask=mask,
                   backend="triton")
    assert_close(o, ro.float(), 1e-5, "decode output")
    for (name, a), (_, b) in zip(state_parts(s), state_parts(rs)):
        assert_close(a, b.to(a.dtype) if not a.is_floating_point() else b.float(), 1e-5, name)
