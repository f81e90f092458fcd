"""experiments/state_norms.py (the stability experiment of the VLA paper, §6.2) on a short run: files, sane values,
the claim."""

import json
import math

import pytest
import torch
from conftest import load_experiment

pytest.importorskip("matplotlib")

state_norms = load_experiment("state_norms")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("state_norms")
    summary = state_norms.main(["--steps", "60", "--head-dim", "16", "--seeds", "0", "1", "--out", str(out)])
    return out, summary


def test_writes_png_and_json(short_run):
    out, summary = short_run
    png, js = out / "state_norms.png", out / "state_norms.json"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert data == json.loads(json.dumps(summary))
    assert data["settings"]["steps"] == 60 and data["settings"]["head_dim"] == 16
    assert data["settings"]["seeds"] == [0, 1]
    assert data["versions"]["torch"] == torch.__version__
    assert data["checkpoints"] == [60]


def test_values_are_finite_and_sane(short_run):
    _, data = short_run
    for name in ("linear", "delta_net", "vla", "vla_A"):
        m = data["mechanisms"][name]
        assert m["finite"], name
        at = m["at_t"]["60"]
        assert len(at["per_seed"]) == 2
        assert all(math.isfinite(x) and x > 0 for x in at["per_seed"]), name
        assert at["min"] <= at["mean"] <= at["max"] <= m["max_over_t"]["max"] + 1e-9
    # VLA's A starts at I / λ0 = 10 I; the first Sherman-Morrison downdate (‖û‖² = 1/d) takes the
    # eigenvalue along û from 10 to 10 - (100/d) / (1 + 10/d) = 10 d / (d + 10); A only shrinks
    # between refreshes.
    d = 16
    expected = ((d - 1) * 100 + (10 * d / (d + 10)) ** 2) ** 0.5
    assert data["mechanisms"]["vla_A"]["initial"]["mean"] == pytest.approx(expected, rel=1e-5)
    assert data["mechanisms"]["vla_A"]["at_t"]["60"]["max"] < data["mechanisms"]["vla_A"]["initial"]["min"]
    # Stepping token by token with the state passed along equals one call on the whole sequence.
    for name, err in data["consistency_stepped_vs_one_call_chunk_rel_err"].items():
        assert err < 1e-3, name
    jac = data["vla_jacobian"]
    # ‖I - α̂ k̂ᵀ‖₂ is in [1, (1+√5)/2] for unit α̂, k̂ with α̂·k̂ > 0, and matches the closed form.
    assert 1 - 1e-6 <= jac["spectral_norm"]["min"] <= jac["spectral_norm"]["max"] <= (1 + 5 ** 0.5) / 2 + 1e-6
    assert jac["closed_form_max_abs_diff"] < 1e-5
    assert 0 < jac["cos_alpha_k"]["min"] <= jac["cos_alpha_k"]["max"] <= 1 + 1e-6


def test_claim_linear_state_outgrows_vla(short_run):
    """The VLA paper's claim, qualitatively: linear attention's ‖S‖_F ends far above VLA's."""
    _, data = short_run
    lin = data["mechanisms"]["linear"]["at_t"]["60"]["per_seed"]
    vla = data["mechanisms"]["vla"]["at_t"]["60"]["per_seed"]
    assert all(a > 2 * b for a, b in zip(lin, vla)), (lin, vla)
    assert data["ratio_linear_over_vla_at_end"]["min"] > 2


def test_expected_linear_norm_matches_monte_carlo():
    """The closed form for E‖S_t‖² used as the reference curve (zero-mean and shifted v)."""
    g = torch.Generator().manual_seed(0)
    n, t, d = 4000, 20, 8
    for v_mean in (0.0, 0.3):
        k = torch.randn(n, t, d, generator=g, dtype=torch.float64)
        v = torch.randn(n, t, d, generator=g, dtype=torch.float64) + v_mean
        S = torch.einsum("ntv,ntk->nvk", v, torch.nn.functional.elu(k) + 1)
        mc = S.pow(2).sum((1, 2)).mean().sqrt().item()
        assert mc == pytest.approx(state_norms.expected_linear_norm(t, d, 1.0, v_mean), rel=0.03)
