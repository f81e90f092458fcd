"""VLA's token scan split in time (lazoo.kernels.vla.token with pieces > 1: each piece's start A from the piece maps of
lazoo.kernels.vla.split and their chain, every piece at once) against the float64 token-by-token transcription of
the scan: α̂, the final A and the gradients of k̂, û and A0, with refreshes at per-sample positions (several per
map block included), pads, ragged pieces and a non-identity A0; the piece maps themselves against float64 products
of the per-token linear steps; and the whole op through backend="triton" with a split scan against Algorithm 1.

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1 (see test_kernels_delta.py).
GPU (``-m gpu``): d = 128, T = 4096 in fp32 and bf16 inputs, split and unsplit.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close, left_pad_mask, rel_err

pytest.importorskip("triton")
from test_kernels_vla_chunk import compare, reference, run_scan, scan_inputs  # noqa: E402

from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def split(pieces):
    from lazoo.kernels.vla.token import vla_scan

    return lambda *a, **k: vla_scan(*a, **k, pieces=pieces)


@pytest.fixture
def short_checkpoints(monkeypatch):
    """Checkpoints (and so pieces) every 8 tokens, so that a short sequence has several pieces."""
    import lazoo.kernels.vla.token as kv

    monkeypatch.setattr(kv, "CKPT", 8)


def maps_reference(u_hat, flags, L, eta):
    """float64 [B, N, H, 2, D, 2, D]: each piece's product of the per-token steps Y += û (ûᵀ X), then X += η Y at a
    flag, applied to the 2D × 2D identity, minus the identity."""
    B, T, H, D = u_hat.shape
    N = -(-T // L)
    out = torch.zeros(B, N, H, 2 * D, 2 * D, dtype=F64)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                X = torch.cat([torch.eye(D, dtype=F64), torch.zeros(D, D, dtype=F64)], 1)
                Y = torch.cat([torch.zeros(D, D, dtype=F64), torch.eye(D, dtype=F64)], 1)
                for t in range(n * L, min((n + 1) * L, T)):
                    u = u_hat[b, t, h].double()
                    Y = Y + torch.outer(u, u @ X)
                    if flags[b, t]:
                        X = X + eta * Y
                out[b, n, h] = torch.cat([X, Y], 0) - torch.eye(2 * D, dtype=F64)
    return out.view(B, N, H, 2, D, 2, D)


def test_vla_scan_rejects_zero_pieces():
    from lazoo.kernels.vla.token import vla_scan

    k_hat, u_hat, flags, A0 = scan_inputs(1, 4, 1, 8)
    with pytest.raises(ValueError, match="pieces"):
        vla_scan(k_hat.float(), u_hat.float(), flags, A0.float(), eta=0.1, pieces=0)


def test_time_pieces_is_one_on_the_cpu_and_for_short_sequences():
    from lazoo.kernels.vla.token import time_pieces

    assert time_pieces(1, 1, 1 << 16, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert time_pieces(1, 16, 100, dev) == 1  # shorter than a checkpoint segment
        assert time_pieces(1, 16, 1 << 15, dev) > 1
        assert time_pieces(1024, 16, 1 << 15, dev) == 1  # B·H programs already fill the GPU


@needs_interp
@pytest.mark.parametrize("T,period,L", [(61, 3, 24), (150, 45, 64)])
def test_interp_piece_maps_match_float64(T, period, L):
    from lazoo.kernels.vla.split import piece_maps

    # d = 20 pads to 32 rows and two column blocks a part; period 3: a segment of 3 tokens at most; period 45:
    # segments cut at the kernel's 32 tokens with no refresh; the last piece ragged
    k_hat, u_hat, flags, A0 = scan_inputs(2, T, 2, 20, period=period, offsets=(1, 2), pads=[(0, 5), (1, 40)])
    got = piece_maps(u_hat.float(), flags.float(), L, 0.3)
    want = maps_reference(u_hat, flags, L, 0.3)
    assert_close(piece_maps(u_hat.float(), flags.float(), L, 0.3, pieces=2).double(), want[:, :2], 1e-5,
                 "the first two pieces' maps")
    print(f"piece maps rel error {rel_err(got.double(), want):.1e}")
    assert_close(got.double(), want, 1e-5, "piece maps")


def chain_reference(maps, A0):
    """float64 starts (one more than maps), L_n, R_n: A_{n+1} = (A + a' A + b)(I + d' + c A)⁻¹, R_n that inverse,
    L_n = I + a' - A_{n+1} c."""
    m = maps.double()
    eye = torch.eye(m.shape[-1], dtype=F64)
    A, starts, Ls, Rs = A0.double(), [A0.double()], [], []
    for n in range(m.shape[1]):
        a, b, c, d = m[:, n, :, 0, :, 0], m[:, n, :, 0, :, 1], m[:, n, :, 1, :, 0], m[:, n, :, 1, :, 1]
        R = torch.linalg.inv(eye + d + c @ A)
        A = (A + a @ A + b) @ R
        A = 0.5 * (A + A.transpose(-1, -2))
        starts.append(A), Ls.append(eye + a - A @ c), Rs.append(R)
    return torch.stack(starts, 1), torch.stack(Ls, 1), torch.stack(Rs, 1)


@needs_interp
@pytest.mark.parametrize("D", [5, 16])
def test_interp_inverse_from_any_start(D):
    from lazoo.kernels.vla.split import inverse

    # a permutation (zeros on the diagonal: elimination without pivoting divides by 0) plus a little noise
    gen = torch.Generator().manual_seed(D)
    perm = torch.eye(D, dtype=F64)[torch.randperm(D, generator=gen)]
    Y = torch.stack([perm * 3 + 0.1 * torch.randn(D, D, generator=gen, dtype=F64) for _ in range(3)])
    Y[0, range(D), range(D)] = 0.0
    want = torch.linalg.inv(Y)
    # from scratch; from a nearby inverse (the refinement); from a start too far off (|I - Y R| >= 1/2: restarted)
    for start, what in ((None, "from scratch"), (want * 1.05, "from a nearby start"), (want * 0.2, "from a bad start")):
        got = inverse(Y, start=start)
        print(f"inverse {what} rel error {rel_err(got.double(), want):.1e}")
        assert_close(got.double(), want, 1e-5, f"inverse {what}")


@needs_interp
def test_interp_chain_matches_float64():
    from lazoo.kernels.vla.split import chain_starts, piece_maps

    # d = 20 (tiles of 32), 3 pieces of 40 tokens with refreshes every 7 (η = 0.2: large map parts), a
    # non-identity start
    k_hat, u_hat, flags, A0 = scan_inputs(2, 110, 2, 20, period=7, offsets=(1, 4), pads=[(1, 33)])
    maps = piece_maps(u_hat.float() * 4, flags.float(), 40, 0.2)
    starts, Ls, Rs = chain_starts(maps, A0.float(), with_jacobians=True)
    want = chain_reference(maps, A0.float())
    for name, got, ref in zip(("starts", "L", "R"), (starts, Ls, Rs), want):
        print(f"chain {name} rel error {rel_err(got.double(), ref):.1e}")
        assert_close(got.double(), ref, 1e-5, f"chain {name}")
    no_jac = chain_starts(maps, A0.float(), with_jacobians=False)
    assert chain_starts(maps[:, :0], A0.float(), with_jacobians=True)[1:] == (None, None)  # one piece: no chain
    assert no_jac[1] is None
    assert_close(no_jac[0].double(), want[0], 1e-5, "chain starts without the Jacobians")


@needs_interp
@pytest.mark.parametrize("T,pieces", [(37, 3), (40, 5), pytest.param(50, 2, marks=pytest.mark.slow)])
def test_interp_split_scan_matches_float64(short_checkpoints, T, pieces):
    # pieces of a whole number of 8-token checkpoint segments (T = 37, 3 pieces: 16 + 16 + 5; T = 40 in 5 pieces
    # of 8; T = 50 in 2 of 32 and 18), refreshes at period 20 from per-sample offsets, pads in the middle
    inputs = scan_inputs(2, T, 2, 16, pads=[(0, 3), (1, 17), (1, 18), (0, T - 1)])
    got = run_scan(split(pieces), inputs, torch.float32)
    compare(got, reference(inputs, torch.float32), 1e-5, 2e-5, f"split T={T} pieces={pieces}")


@needs_interp
def test_interp_split_scan_matches_unsplit(short_checkpoints):
    # period 5 (a refresh on a piece's last token included), fp16 inputs, and the forward without autograd
    inputs = scan_inputs(2, 45, 1, 24, period=5, offsets=(0, 3), pads=[(1, 9), (0, 30)], seed=3)
    got = run_scan(split(4), inputs, torch.float16, eta=0.2)
    want = run_scan(split(1), inputs, torch.float16, eta=0.2)
    compare(got, want, 1e-5, 2e-3, "split vs unsplit fp16 period 5")
    compare(got, reference(inputs, torch.float16, eta=0.2), 1e-5, 2e-3, "split fp16 vs float64")
    k_hat, u_hat, flags, A0 = inputs
    with torch.no_grad():
        alpha, A_end = split(4)(k_hat.half(), u_hat.half(), flags, A0.float(), eta=0.2)
    assert_close(alpha.double(), got["alpha"], 1e-6, "alpha without autograd")
    assert_close(A_end.double(), got["A_end"], 1e-6, "A_end without autograd")


@needs_interp
def test_interp_vla_op_with_split_scan(short_checkpoints, monkeypatch):
    # the whole op through backend="triton", its scan split in 5 pieces, against Algorithm 1
    from test_kernels_vla import check

    import lazoo.kernels.vla.token as kv

    monkeypatch.setattr(kv, "time_pieces", lambda *a: 5)
    check(2, 37, 1, 16, 16, 1e-4, 1e-4, mask=left_pad_mask([37, 30], 37, holes=[(0, 20)]), chunk_size=16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,grad_rtol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)], ids=str)
def test_gpu_split_scan_matches_float64(dtype, grad_rtol):
    inputs = scan_inputs(2, 4096, 2, 128, pads=[(0, 100), (1, 3000), (1, 3001)], seed=11)
    k_hat, u_hat, flags, A0 = inputs
    rounded = (k_hat.to(dtype).to(F64), u_hat.to(dtype).to(F64), flags, A0.float().to(F64))
    want = run_scan(__import__("test_kernels_vla_chunk").scan_reference, rounded, F64, device="cuda", eta=1e-3)
    whole = run_scan(split(1), inputs, dtype, device="cuda", eta=1e-3)
    got = run_scan(split(8), inputs, dtype, device="cuda", eta=1e-3)
    compare(whole, want, 1e-4, grad_rtol, "unsplit vs float64")
    compare(got, want, 1e-4, grad_rtol, "split in 8 vs float64")
