"""VLA's fused features and normaliser (lazoo.kernels.vla.features) against their PyTorch float64 forms
(``F.elu(x) + 1`` or the identity, ``F.normalize``, a cumulative sum and a clamped dot product): outputs and the
gradients of every input, with zero rows (the norm's clamp), a mask, a start z and an ε that clamps part of the
denominators (so the clamp's zero gradient is checked), at a head dim that pads the tile.

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1 (see test_kernels_delta.py).
GPU (``-m gpu``): bf16 inputs at d = 128, T = 1000.
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


def phi(x, elu):
    return F.elu(x) + 1 if elu else x


def features_reference(q, k, u, elu, unit_query):
    k_hat = F.normalize(phi(k, elu), dim=-1)
    u_hat = F.normalize(u, dim=-1) / u.shape[-1] ** 0.5
    q_r = phi(q, elu)
    return k_hat, u_hat, k_hat, (F.normalize(q_r, dim=-1) if unit_query else q_r)


def normaliser_reference(q, k, z0, mask, eps, elu):
    kf = phi(k, elu) * (1.0 if mask is None else mask[:, :, None, None])
    z = z0[:, None] + kf.cumsum(1)
    return (z * phi(q, elu)).sum(-1).clamp_min(eps), z[:, -1]


def grads_of(fn, leaves, seed=1):
    """Outputs of fn(*leaves) and the gradients of a fixed random projection of them."""
    outs = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64).to(o.device)).sum() for o in outs)
    return [o.detach().cpu().double() for o in outs], [
        g.cpu().double() for g in torch.autograd.grad(loss, leaves)]


def inputs(B, T, H, D, seed=0, device="cpu", dtype=torch.float32, zero_rows=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, u = (torch.randn(B, T, H, D, generator=gen, dtype=F64) for _ in range(3))
    if zero_rows:  # a pad's û, a signed key or query of 0: the norm's clamp (gradient g / 1e-12)
        u[0, 1, 0] = k[0, 2, 1] = q[1, 3, 2] = 0.0
    return [x.to(device, dtype) for x in (q, k, u)]


def check_features(q, k, u, elu, unit_query, rtol, rows=(slice(None),)):
    """``rows``: index sets compared apart (a clamped row's gradient is 1e12 times the others)."""
    from lazoo.kernels.vla.features import vla_features

    leaves = [x.requires_grad_(True) for x in (q, k, u)]
    got, got_g = grads_of(lambda *x: vla_features(*x, q.dtype, elu=elu, unit_query=unit_query), leaves)
    ref = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, u)]
    want, want_g = grads_of(lambda *x: features_reference(*x, elu, unit_query), ref)
    print("features rel errors: " + " ".join(f"{rel_err(a, b):.1e}" for a, b in zip(got + got_g, want + want_g)))
    for name, a, b in zip(("k_hat", "u_hat", "k_out", "q_out", "dq", "dk", "du"), got + got_g, want + want_g):
        for i, r in enumerate(rows):
            assert_close(a[r], b[r], rtol, f"{name} (rows {i})")


@needs_interp
@pytest.mark.parametrize("elu,unit_query", [(True, False), (False, True), (True, True)])
def test_interp_features_match_float64(elu, unit_query):
    check_features(*inputs(2, 7, 3, 20), elu, unit_query, 1e-5)


@needs_interp
def test_interp_features_at_zero_rows():
    # identity features (a zero key stays zero) and unit queries: every norm meets F.normalize's clamp somewhere
    zero = torch.zeros(2, 7, 3, dtype=torch.bool)
    zero[0, 1, 0] = zero[0, 2, 1] = zero[1, 3, 2] = True
    check_features(*inputs(2, 7, 3, 20, zero_rows=True), False, True, 1e-5, rows=(zero, ~zero))


def check_normaliser(q, k, z0, mask, eps, elu, rtol, grad_rtol=None, ranges=None):
    from lazoo.kernels.vla.features import vla_normaliser

    den_ref = normaliser_reference(q.double().cpu(), k.double().cpu(), z0.double().cpu(),
                                   None if mask is None else mask.cpu().double(), float("-inf"), elu)[0]
    clamped = (den_ref < eps).double().mean().item()
    leaves = [x.requires_grad_(True) for x in (q, k, z0)]
    got, got_g = grads_of(lambda *x: vla_normaliser(*x, mask, eps, elu=elu, ranges=ranges), leaves)
    ref = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, z0)]
    m = None if mask is None else mask.cpu().double()
    want, want_g = grads_of(lambda *x: normaliser_reference(*x, m, eps, elu), ref)
    print(f"normaliser ({clamped:.0%} clamped) rel errors: "
          + " ".join(f"{rel_err(a, b):.1e}" for a, b in zip(got + got_g, want + want_g)))
    for name, a, b in zip(("den", "z_T", "dq", "dk", "dz0"), got + got_g, want + want_g):
        assert_close(a, b, rtol if name in ("den", "z_T", "dz0") else grad_rtol or rtol, name)
    return clamped


@needs_interp
@pytest.mark.parametrize("elu,masked,ranges", [(True, True, None), (False, False, 1), (True, True, 2),
                                               (False, True, 3)])
def test_interp_normaliser_matches_float64(elu, masked, ranges):
    # T = 150: three blocks of 64, the last ragged, in 1, 2 (128 + 22 tokens) or 3 ranges run at once; ε near the
    # median dot: half the denominators clamp
    q, k, _ = inputs(2, 150, 2, 20, seed=4)
    z0 = torch.rand(2, 2, 20, dtype=torch.float32) * (1.0 if elu else 0.1)
    mask = None
    if masked:
        mask = torch.ones(2, 150)
        mask[0, :30] = 0.0
        mask[1, 77] = 0.0
    dots = normaliser_reference(q.double(), k.double(), z0.double(), None if mask is None else mask.double(), -1e30,
                                elu)[0]
    # ε in the widest gap between the middle dots: no dot lies within rounding of the clamp
    d = dots.flatten().sort().values
    lo, hi = int(0.4 * d.numel()), int(0.6 * d.numel())
    i = lo + int((d[lo + 1:hi + 1] - d[lo:hi]).argmax())
    clamped = check_normaliser(q, k, z0, mask, 0.5 * (d[i] + d[i + 1]).item(), elu, 1e-5, ranges=ranges)
    assert 0.3 < clamped < 0.7


@pytest.mark.gpu
@needs_cuda
def test_gpu_features_and_normaliser_bf16():
    q, k, u = inputs(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    check_features(q, k, u, True, False, 1e-2)
    z0 = torch.rand(2, 4, 128, device="cuda")
    mask = torch.ones(2, 1000, device="cuda")
    mask[1, :100] = 0.0
    for ranges in (None, 1):  # split as the GPU's size asks, and whole
        check_normaliser(q, k, z0, mask, 1e-4, True, 1e-4, grad_rtol=1e-2, ranges=ranges)  # dq, dk come in bf16
