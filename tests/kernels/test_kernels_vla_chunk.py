"""The chunk-parallel VLA scan (lazoo.kernels.vla.chunk.vla_scan_chunked) against a float64 token-by-token
transcription of the scan and against the token kernel (lazoo.kernels.vla.token.vla_scan): α̂, the final A and the
gradients of k̂, û and A0 (symmetric part), at ragged T, with per-sample refresh flags (several per block
included), pads (û = 0, no flag), a non-identity A0 and several checkpoint intervals; and the whole op
(backend="triton") with either scan that its ``triton_scan`` argument selects.

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1 (see test_kernels_delta.py).
GPU (``-m gpu``): d = 128, T = 1000 in fp32 and bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, rel_err

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64
PARTS = ("alpha", "A_end", "dk", "du", "dA0")


def scan_inputs(B, T, H, D, *, period=20, offsets=(5, 13, 0), pads=(), seed=0):
    """float64 k̂, û (unit k̂, |û| = 1/√D as the op makes them), flags [B, T] and an SPD A0 that is not a
    multiple of I. pads: (sample, position) pairs with û = 0 and no flag (the step count skips them)."""
    gen = torch.Generator().manual_seed(seed)
    k_hat = F.normalize(F.elu(torch.randn(B, T, H, D, generator=gen, dtype=F64)) + 1, dim=-1)
    u_hat = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=F64), dim=-1) / D ** 0.5
    real = torch.ones(B, T, dtype=torch.bool)
    for b, t in pads:
        real[b, t] = False
    u_hat = u_hat * real[:, :, None, None]
    counts = torch.tensor(offsets[:B])[:, None] + real.long().cumsum(1)
    flags = real & (counts % period == 0)
    M = torch.randn(B, H, D, D, generator=gen, dtype=F64)
    A0 = torch.eye(D, dtype=F64) * 10 + 0.3 * M @ M.transpose(-1, -2) / D
    return k_hat, u_hat, flags, A0


def scan_reference(k_hat, u_hat, flags, A, eta):
    """The scan as written: z = A û, δ = 1 + û·z, A -= z zᵀ/δ, + ηI at a flag, α̂ = A k̂ / |A k̂|."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    alphas = []
    for t in range(k_hat.shape[1]):
        z = torch.einsum("bhij,bhj->bhi", A, u_hat[:, t])
        delta = 1.0 + (u_hat[:, t] * z).sum(-1)
        A = A - z[..., :, None] * z[..., None, :] / delta[..., None, None]
        A = A + (flags[:, t].to(A.dtype) * eta)[:, None, None, None] * eye
        alphas.append(F.normalize(torch.einsum("bhij,bhj->bhi", A, k_hat[:, t]), dim=-1))
    return torch.stack(alphas, 1), A


def run_scan(scan, inputs, dtype, device="cpu", eta=0.05, **kw):
    """(α̂, final A, dk̂, dû, sym(dA0)) of ``scan`` on ``dtype`` copies of the inputs, for a fixed random
    projection of α̂ and of the final A (a non-symmetric one: only its symmetric part may act)."""
    k_hat, u_hat, flags, A0 = inputs
    k = k_hat.to(device, dtype).requires_grad_(True)
    u = u_hat.to(device, dtype).requires_grad_(True)
    A = A0.to(device, F64 if dtype == F64 else torch.float32).requires_grad_(True)
    alpha, A_end = scan(k, u, flags.to(device), A, eta=eta, **kw)
    gen = torch.Generator().manual_seed(1)
    w_alpha = torch.randn(alpha.shape, generator=gen, dtype=F64).to(device, alpha.dtype)
    w_A = torch.randn(A_end.shape, generator=gen, dtype=F64).to(device, A_end.dtype)
    dk, du, dA = torch.autograd.grad((alpha * w_alpha).sum() + (A_end * w_A).sum(), [k, u, A])
    out = (alpha, A_end, dk, du, 0.5 * (dA + dA.transpose(-1, -2)))
    return {n: x.detach().cpu().double() for n, x in zip(PARTS, out)}


def reference(inputs, dtype, eta=0.05):
    """float64 reference on the inputs rounded to ``dtype`` (so it sees the kernel's numbers)."""
    k_hat, u_hat, flags, A0 = inputs
    rounded = (k_hat.to(dtype).to(F64), u_hat.to(dtype).to(F64), flags, A0.float().to(F64))
    return run_scan(scan_reference, rounded, F64, eta=eta)


def compare(got, want, rtol, grad_rtol, what):
    print(f"{what} rel errors: " + " ".join(f"{n}={rel_err(got[n], want[n]):.1e}" for n in PARTS))
    for n in PARTS:
        assert_close(got[n], want[n], rtol if n in ("alpha", "A_end") else grad_rtol, f"{what}: {n}")


def chunked(**kw):
    from lazoo.kernels.vla.chunk import vla_scan_chunked

    return lambda *a, **k: vla_scan_chunked(*a, **k, **kw)


def test_vla_chunk_rejects_bad_options():
    from lazoo.kernels.vla.chunk import vla_scan_chunked

    k_hat, u_hat, flags, A0 = scan_inputs(1, 4, 1, 8)
    for kw, word in (({"block": 8}, "block"), ({"block": 24}, "block"), ({"ckpt_blocks": 0}, "ckpt_blocks"),
                     ({"precision": "tf64"}, "precision")):
        with pytest.raises(ValueError, match=word):
            vla_scan_chunked(k_hat.float(), u_hat.float(), flags, A0.float(), eta=0.1, **kw)
    big = torch.zeros(1, 4, 1, 256)
    with pytest.raises(ValueError, match="head dims"):
        vla_scan_chunked(big, big, flags, torch.zeros(1, 1, 256, 256), eta=0.1)


@needs_interp
@pytest.mark.parametrize("T,ckpt_blocks", [(37, 1), pytest.param(70, 2, marks=pytest.mark.slow)])
def test_interp_chunk_scan_matches_float64(T, ckpt_blocks):
    # blocks of 16 with a ragged last one; refreshes at period 20 from per-sample step offsets (a flag on
    # a block's last token: sample 0 at t = 15), pads in the middle, 3 checkpoint intervals
    inputs = scan_inputs(2, T, 2, 16, pads=[(0, 3), (1, 17), (1, 18), (0, T - 1)])
    got = run_scan(chunked(block=16, ckpt_blocks=ckpt_blocks), inputs, torch.float32)
    compare(got, reference(inputs, torch.float32), 1e-5, 2e-5, f"chunk T={T}")


@needs_interp
@pytest.mark.slow  # the chunked scan is not the default; the full matrix runs with -m slow
def test_interp_chunk_scan_fp16_several_flags_per_block():
    # period 5 and blocks of 32: up to 7 segments per block (the backward rebuilds each segment's start);
    # d = 24 pads the 32-wide tiles; fp16 inputs (the kernel computes in fp32, gradients come back in fp16)
    inputs = scan_inputs(2, 45, 1, 24, period=5, offsets=(0, 3), pads=[(1, 9), (0, 30)], seed=3)
    got = run_scan(chunked(block=32, ckpt_blocks=1), inputs, torch.float16, eta=0.2)
    compare(got, reference(inputs, torch.float16, eta=0.2), 1e-5, 2e-3, "chunk fp16 period 5")


@needs_interp
@pytest.mark.slow  # both kernels are checked against float64 in the default run
def test_interp_chunk_scan_matches_token_kernel():
    from lazoo.kernels.vla.token import vla_scan

    inputs = scan_inputs(2, 37, 2, 16, offsets=(8, 0), pads=[(1, 4)], seed=7)
    got = run_scan(chunked(ckpt_blocks=1), inputs, torch.float32)
    want = run_scan(vla_scan, inputs, torch.float32)
    compare(got, want, 1e-5, 2e-5, "chunk vs token kernel")
    # without autograd (no checkpoints kept): the same forward
    k_hat, u_hat, flags, A0 = inputs
    with torch.no_grad():
        alpha, A_end = chunked()(k_hat.float(), u_hat.float(), flags, A0.float(), eta=0.05)
    assert_close(alpha.double(), got["alpha"], 1e-6, "alpha without autograd")
    assert_close(A_end.double(), got["A_end"], 1e-6, "A_end without autograd")


@needs_interp
@pytest.mark.parametrize("scan", ["chunk", pytest.param("token", marks=pytest.mark.slow)])  # token: test_kernels_vla
def test_interp_vla_op_with_either_scan(scan):
    # the whole op through backend="triton" with the scan that ``triton_scan`` selects, against Algorithm 1
    from op_helpers import left_pad_mask
    from test_kernels_vla import check

    check(2, 37, 1, 16, 16, 1e-4, 1e-4, mask=left_pad_mask([37, 30], 37, holes=[(0, 20)]), chunk_size=16,
          triton_scan=scan)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,grad_rtol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)], ids=str)
def test_gpu_chunk_scan_matches_token_kernel(dtype, grad_rtol):
    # the scans compute in fp32 from the rounded inputs; dk̂ and dû come back in the input dtype
    from lazoo.kernels.vla.token import vla_scan

    inputs = scan_inputs(2, 1000, 4, 128, pads=[(0, 100), (1, 500), (1, 501)], seed=11)
    got = run_scan(chunked(), inputs, dtype, device="cuda", eta=1e-3)
    token = run_scan(vla_scan, inputs, dtype, device="cuda", eta=1e-3)
    k_hat, u_hat, flags, A0 = inputs
    rounded = (k_hat.to(dtype).to(F64), u_hat.to(dtype).to(F64), flags, A0.float().to(F64))
    want = run_scan(scan_reference, rounded, F64, device="cuda", eta=1e-3)
    compare(token, want, 1e-4, grad_rtol, "token kernel vs float64")
    compare(got, want, 1e-4, grad_rtol, "chunk kernel vs float64")
    compare(got, token, 1e-4, grad_rtol, "chunk vs token kernel")
