"""RLS robustness, case by case (table-driven): poorly conditioned keys against an independent float64 closed form,
a precision shortfall that warns with the measured residual, one non-finite sample that leaves the others
bit-identical, large inputs in fp32/bf16/fp16, and λ ≤ 0 refused at the op boundary.

The Triton path's share (its sampled residual check, the fallback to the float64 chunk form) is in
tests/kernels/test_kernels_rls.py (interpreter). ``PYTHONPATH=tests python tests/ops/test_rls_robustness.py`` prints
the accuracy table of docs/rls.md ("Accuracy for poorly conditioned keys").
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from op_helpers import rel_err, rls_closed_form

from lazoo.ops import rls

rls_module = importlib.import_module("lazoo.ops.rls")  # (lazoo.ops.rls, the attribute, is the function)
F64 = torch.float64
H = 2


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Each test sees the op's say-once notes empty (they are process-wide)."""
    monkeypatch.setattr(rls_module, "_SAID", set())


def keys(T, *, B=2, dk=16, rank=None, noise=0.0, seed=0, dv=None):
    """float64 q, k, v: unit q; unit k, near rank ``rank`` (a rank-``rank`` mix of random directions plus ``noise``
    times a full-rank one) or plain random directions (rank None); v standard normal."""
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        k = torch.randn(B, T, H, dk, generator=g, dtype=F64)
    else:
        k = torch.einsum("bthr,hrd->bthd", torch.randn(B, T, H, rank, generator=g, dtype=F64),
                         torch.randn(H, rank, dk, generator=g, dtype=F64))
        k = k + noise * torch.randn(B, T, H, dk, generator=g, dtype=F64)
    q = torch.randn(B, T, H, dk, generator=g, dtype=F64)
    v = torch.randn(B, T, H, dv or dk, generator=g, dtype=F64)
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v


def rounded(dtype, *xs):
    return tuple(x.to(dtype) for x in xs)


# ============================================================================ poorly conditioned keys
# (name, T, λ, key rank (None: random unit keys), noise, bound vs the closed form on the same fp32 inputs)
ACCURACY = [
    ("near rank 4 of 16, lam 1e-6", 512, 1e-6, 4, 1e-2, 1e-5),
    ("random unit keys, lam 1e-3", 512, 1e-3, None, 0.0, 1e-5),
]
ACCURACY_SLOW = [
    ("near rank 4 of 16, lam 1e-6, T 4096", 4096, 1e-6, 4, 1e-2, 1e-5),
    ("random unit keys, lam 1e-3, T 16384", 16384, 1e-3, None, 0.0, 1e-5),
]


def _accuracy(backend, T, lam, rank, noise, bound, seed):
    q, k, v = keys(T, rank=rank, noise=noise, seed=seed, B=2 if T <= 4096 else 1)
    q32, k32, v32 = rounded(torch.float32, q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these cases are within the precision asked for: no warning
        o, _ = rls(q32, k32, v32, lam=lam, backend=backend)
    assert o.dtype == torch.float32 and torch.isfinite(o).all()
    err = rel_err(o, rls_closed_form(q32, k32, v32, lam))
    assert err <= bound, f"{backend}: {err:.2e} from the float64 closed form on the same inputs (bound {bound:.0e})"
    # and from the float64 inputs themselves: the fp32 rounding of q, k, v is the only difference left
    floor = rel_err(rls_closed_form(q32, k32, v32, lam), rls_closed_form(q, k, v, lam))
    assert rel_err(o, rls_closed_form(q, k, v, lam)) <= floor + bound


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,T,lam,rank,noise,bound", ACCURACY, ids=[c[0] for c in ACCURACY])
def test_fp32_tracks_float64_for_poorly_conditioned_keys(backend, name, T, lam, rank, noise, bound):
    """Before the float64 solves (near rank 4, λ = 1e-6, T = 512): fp32 chunk 2.9e-1, recurrent 2.4e-2 from the
    closed form on the same inputs; random unit keys, λ = 1e-3: 1.3e-4 and 3.2e-5."""
    _accuracy(backend, T, lam, rank, noise, bound, seed=T)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,T,lam,rank,noise,bound", ACCURACY_SLOW, ids=[c[0] for c in ACCURACY_SLOW])
def test_fp32_tracks_float64_for_poorly_conditioned_keys_long(backend, name, T, lam, rank, noise, bound):
    _accuracy(backend, T, lam, rank, noise, bound, seed=T + 1)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_gamma_below_one_tracks_float64(backend):
    q, k, v = keys(200, rank=4, noise=1e-2, seed=11)
    q32, k32, v32 = rounded(torch.float32, q, k, v)
    o, _ = rls(q32, k32, v32, lam=1e-6, gamma=0.97, chunk_size=32, backend=backend)
    assert rel_err(o, rls_closed_form(q32, k32, v32, 1e-6, 0.97)) <= 1e-5


# ============================================================================ a shortfall says so, once
# (name, λ, key rank, noise, initial state's KK: None or "indefinite" (a rounded state, −1e-9 eigenvalue))
SHORTFALL = [
    ("exactly rank 4 of 16, lam 1e-10", 1e-10, 4, 0.0, None),
    ("near rank 4 of 16, lam 1e-9", 1e-9, 4, 1e-6, None),
    ("state indefinite by rounding, lam 1e-12", 1e-12, 4, 1e-2, "indefinite"),
]


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,lam,rank,noise,state", SHORTFALL, ids=[c[0] for c in SHORTFALL])
def test_precision_shortfall_warns_once_with_the_measured_residual(backend, name, lam, rank, noise, state):
    T, dk = 96, 16
    q, k, v = rounded(torch.float32, *keys(T, rank=rank, noise=noise, seed=3))
    init = None
    if state == "indefinite":
        g = torch.Generator().manual_seed(4)
        X = torch.randn(2, H, dk, 3, generator=g, dtype=F64)
        init = {"KK": X @ X.transpose(-1, -2) - 1e-9 * torch.eye(dk, dtype=F64), "VK": torch.zeros(2, H, dk, dk)}
    with pytest.warns(RuntimeWarning, match=r"relative residual .* of (\d\.\de[-+]\d\d), above the 1e-04") as rec:
        o, _ = rls(q, k, v, lam=lam, backend=backend, initial_state=init)
    assert torch.isfinite(o).all()
    msg = str(rec[0].message)
    measured = float(msg.split("‖q_t‖ of ")[1].split(",")[0])
    assert measured > 1e-4
    if state == "indefinite":
        assert "diagonal shift" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        rls(q, k, v, lam=lam, backend=backend, initial_state=init)


def test_no_warning_when_well_conditioned():
    q, k, v = rounded(torch.float32, *keys(200, seed=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backend in ("chunk", "recurrent"):
            rls(q, k, v, lam=0.5, backend=backend)


def test_a_state_that_is_not_positive_semidefinite_is_refused():
    q, k, v = keys(8, dk=4, seed=6)
    init = {"KK": -torch.eye(4, dtype=F64).expand(2, H, 4, 4).clone(), "VK": torch.zeros(2, H, 4, 4, dtype=F64)}
    for backend in ("chunk", "recurrent"):
        with pytest.raises(ValueError, match=r"initial_state\['KK'\].*positive semi-definite"):
            rls(q, k, v, lam=0.1, backend=backend, initial_state=init)


# ============================================================================ one non-finite sample
def _plant(where, value, q, k, v, state):
    x = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "KK": state["KK"].clone(), "VK": state["VK"].clone()}
    if where in ("KK", "VK"):
        x[where][1, 0, 2, 1] = value  # (a lower-triangle entry of KK, which a Cholesky reads)
    else:
        x[where][1, 9, 1, 3] = value
    return x


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("where,value", [("q", math.nan), ("k", math.nan), ("v", math.nan), ("k", math.inf),
                                         ("KK", math.nan), ("VK", -math.inf)])
def test_one_non_finite_sample_leaves_the_others_bit_identical(gamma, backend, where, value):
    T, dk = 37, 8
    q, k, v = rounded(torch.float32, *keys(T, B=3, dk=dk, seed=7))
    g = torch.Generator().manual_seed(8)
    X = torch.randn(3, H, dk, 2 * dk, generator=g)
    state = {"KK": X @ X.transpose(-1, -2) / dk, "VK": torch.randn(3, H, dk, dk, generator=g)}
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[2, :5] = False

    def run(x):
        return rls(x["q"], x["k"], x["v"], lam=0.3, gamma=gamma, chunk_size=16, initial_state={
            "KK": x["KK"], "VK": x["VK"]}, output_final_state=True, mask=mask, backend=backend)

    clean_o, clean_s = run({"q": q, "k": k, "v": v, **state})
    o, s = run(_plant(where, value, q, k, v, state))  # no exception
    for b in (0, 2):
        assert torch.equal(o[b], clean_o[b]), f"sample {b}'s output changed"
        for name in ("KK", "VK"):
            assert torch.equal(s[name][b], clean_s[name][b]), f"sample {b}'s final {name} changed"
    assert not torch.isfinite(o[1]).all()  # the bad sample says so in its own outputs


# ============================================================================ large inputs
# (dtype, scale of q and k, scale of v, bound vs the float64 closed form on the same inputs)
LARGE = [
    (torch.float32, 1e3, 1e3, 1e-5),
    (torch.bfloat16, 1e4, 1e4, 1e-2),
    (torch.float16, 1e4, 1.0, 2e-3),  # (v at 1e4 too would put the exact outputs past fp16's 65504)
]


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype,scale,v_scale,bound", LARGE, ids=[str(c[0]).split(".")[-1] for c in LARGE])
def test_large_inputs_work(backend, dtype, scale, v_scale, bound):
    """Before: a raw torch._LinAlgError from the chunk form (fp32 at 1e3, bf16/fp16 at 1e4)."""
    q, k, v = keys(80, rank=None, seed=9)
    q, k, v = rounded(dtype, q * scale, k * scale, v * v_scale)
    o, _ = rls(q, k, v, lam=1.0, backend=backend)
    assert o.dtype == dtype
    assert rel_err(o, rls_closed_form(q, k, v, 1.0)) <= bound


# ============================================================================ λ ≤ 0
BAD_LAMBDA = [
    ("zero", 0.0), ("negative", -1e-3), ("nan", math.nan), ("inf", math.inf),
    ("0-d tensor zero", torch.tensor(0.0)), ("0-d tensor negative", torch.tensor(-2.0)),
    ("[H] tensor, one head negative", torch.tensor([0.5, -0.5])),
    ("[H] tensor, one head zero", torch.tensor([0.0, 1.0])),
    ("[H] tensor with nan", torch.tensor([1.0, math.nan])),
]


@pytest.mark.parametrize("backend", ["chunk", "recurrent", "triton", None])
@pytest.mark.parametrize("name,lam", BAD_LAMBDA, ids=[c[0] for c in BAD_LAMBDA])
def test_lambda_must_be_positive_and_finite(backend, name, lam):
    q, k, v = rounded(torch.float32, *keys(5, dk=4, seed=10))
    with pytest.raises(ValueError, match=r"lam must be a finite number > 0 .*\(0, inf\)"):
        rls(q, k, v, lam=lam, backend=backend)


def test_a_learned_lambda_keeps_its_gradient():
    q, k, v = rounded(torch.float32, *keys(12, dk=4, seed=12))
    lam = torch.tensor([0.5, 2.0], requires_grad=True)
    rls(q, k, v, lam=lam, backend="chunk")[0].sum().backward()
    assert lam.grad is not None and torch.isfinite(lam.grad).all() and (lam.grad != 0).all()


# ============================================================================ the table of docs/rls.md
def _table():  # pragma: no cover - a measurement, run by hand
    import time

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    cases = [("near rank 4 of 16 (noise 1e-2), lam 1e-6", T, 1e-6, 4, 1e-2) for T in (512, 4096)]
    cases += [("random unit keys, lam 1e-3", T, 1e-3, None, 0.0) for T in (512, 16384)]
    print("| keys | T | input rounding floor | chunk fp32 | recurrent fp32 |")
    print("|---|---|---|---|---|")
    for name, T, lam, rank, noise in cases:
        q, k, v = keys(T, B=1, rank=rank, noise=noise, seed=T)
        q32, k32, v32 = rounded(torch.float32, q, k, v)
        ref = rls_closed_form(q, k, v, lam)
        floor = rel_err(rls_closed_form(q32, k32, v32, lam), ref)
        row = []
        for backend in ("chunk", "recurrent"):
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                o, _ = rls(q32, k32, v32, lam=lam, backend=backend)
            row.append(f"{rel_err(o, ref):.1e} ({time.perf_counter() - t0:.2f} s{', warned' if rec else ''})")
        print(f"| {name} | {T} | {floor:.1e} | {row[0]} | {row[1]} |")


if __name__ == "__main__":
    _table()
