"""The drivers of the test-time regression paper's experiments (Wang et al. 2025, §5 and §6:
experiments/online_regression.py, experiments/mqar_short_conv.py): the data they generate has the stated
statistics, both run end to end on tiny settings, and the keys-only short convolution option they rely on does what
it says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    if str(ROOT / "experiments") not in sys.path:  # mqar_short_conv imports experiments/mqar.py as a sibling
        sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location(f"_ttr_{name}", ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def online():
    return _load("online_regression")


@pytest.fixture(scope="module")
def mqar_sc():
    return _load("mqar_short_conv")


# ----------------------------------------------------------------------------- online regression (§5)
def test_correlation_matrices_have_unit_diagonal_and_real_correlations(online):
    sigma = online.random_correlation(4, 16, torch.Generator().manual_seed(0))
    torch.testing.assert_close(sigma.diagonal(dim1=1, dim2=2), torch.ones(4, 16, dtype=torch.float64))
    off = sigma[:, ~torch.eye(16, dtype=torch.bool)]
    assert off.abs().mean() > 0.05  # Kᵀ K ≠ I: the point of a non-identity Σ
    assert torch.linalg.eigvalsh(sigma).min() > 0


def test_switching_ar_regimes_have_the_stated_coefficients_and_noise(online):
    """Least squares of k_{t+1} on k_t (pooled over sequences and dims) recovers 0.9 before T/4 and 0.999
    after; the innovations have std 0.02 per dim; k_1 has the first regime's stationary variance."""
    N, T, D = 256, 64, 16
    keys = online.switching_ar_keys(N, T, D, generator=torch.Generator().manual_seed(1))
    assert keys.shape == (N, T + 2, D)
    switch = T // 4  # k_{t+1} uses 0.9 for 1-based t < switch: 0-based steps 0..switch-2 -> switch-1
    prev, nxt = keys[:, :-1], keys[:, 1:]
    for sl, a in ((slice(0, switch - 1), 0.9), (slice(switch - 1, None), 0.999)):
        x, y = prev[:, sl].reshape(-1), nxt[:, sl].reshape(-1)
        coef = (x @ y) / (x @ x)
        noise = (y - a * x).std()
        assert abs(coef - a) < 0.02, (a, coef)
        assert abs(noise - 0.02) < 0.002, noise
    assert abs(keys[:, 0].var() - 0.02 ** 2 / (1 - 0.81)) < 3e-4


def test_regression_sequences_alignment(online):
    keys = online.switching_ar_keys(2, 12, 8, generator=torch.Generator().manual_seed(2))
    q, k, v, target = online.regression_sequences(keys)
    assert q.shape == k.shape == v.shape == target.shape == (2, 12, 1, 8)
    torch.testing.assert_close(k[:, 1:], q[:, :-1])  # q_t = k_{t+1}
    torch.testing.assert_close(v, F.normalize(q, dim=-1))  # v_t = k_{t+1} / |k_{t+1}|
    torch.testing.assert_close(target[:, :-1], v[:, 1:])  # target = v_{t+1}


def test_unweighted_rls_interpolates_a_stationary_linear_map(online):
    """RLS with γ = 1 is exact least squares: on a fixed linear map v = A k (a stationary regression) its
    out-of-sample loss drops to ~0 once t > D_k, so the experiment's 'RLS stays high after the switch' is a
    property of the non-stationary data, not of a broken regressor."""
    g = torch.Generator().manual_seed(3)
    N, T, D = 4, 48, 8
    A = torch.randn(N, 1, 1, D, D, generator=g, dtype=torch.float64)
    keys = torch.randn(N, T + 1, 1, D, generator=g, dtype=torch.float64)
    k, q = keys[:, :-1], keys[:, 1:]
    v = (A @ k[..., None])[..., 0]
    target = (A @ q[..., None])[..., 0]
    pred = online.predict("rls", q, k, v, lam=1e-6)
    loss = (pred - target).pow(2).sum(-1)[:, :, 0]
    assert loss[:, :D // 2].mean() > 1.0  # underdetermined at first
    assert loss[:, 2 * D:].max() < 1e-6  # vs ~D² at the start: only the 1e-6 ridge is left
    # linear attention cannot: Σ v kᵀ is not A unless the keys are orthonormal
    lin = online.predict("linear", q, k, v)
    assert (lin - F.normalize(target, dim=-1)).pow(2).sum(-1)[:, 2 * D:].mean() > 1e-2


def test_online_regression_end_to_end_and_the_papers_orderings(online, tmp_path):
    out, fig = tmp_path / "o.json", tmp_path / "o.png"
    report = online.main(["--num-seqs", "16", "--seq-len", "96", "--dim", "16", "--no-sweep",
                          "--out", str(out), "--plot", str(fig)])
    assert json.loads(out.read_text())["summary"].keys() == set(online.METHODS)
    assert fig.stat().st_size > 0
    s = report["summary"]
    for m in online.METHODS:
        assert len(report["curves"][m]["mean"]) == 96
        assert s[m]["fast_regime"] > s[m]["last_half"]  # the first regime is the harder one
    # the seed's Figure 2 statements: forgetting matters after the switch, p = 1 beats p = 0, linear is worst
    assert s["rls"]["last_half"] > 2 * s["rls_weighted"]["last_half"]
    assert s["local_linear"]["after_switch_32"] < s["softmax"]["after_switch_32"]
    assert s["linear"]["last_half"] == max(s[m]["last_half"] for m in ("linear", "rls", "rls_weighted",
                                                                       "softmax", "local_linear"))


# ----------------------------------------------------------------------------- MQAR with a key conv (§6)
def test_long_mqar_layout(mqar_sc):
    P, T, V = 5, 29, 64
    batch = mqar_sc.long_mqar_batch(P, T, 3, V, torch.Generator().manual_seed(0))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (3, T)
    for b in range(3):
        pairs = dict(zip(ids[b, 0:2 * P:2].tolist(), ids[b, 1:2 * P:2].tolist()))
        assert len(pairs) == P and all(k < V // 2 <= pairs[k] < V - 1 for k in pairs)
        pos = (labels[b] != mqar_sc.IGNORE_INDEX).nonzero()[:, 0]
        assert len(pos) == P and pos.min() >= 2 * P
        assert sorted(ids[b, pos].tolist()) == sorted(pairs)  # every key is queried once
        for p in pos.tolist():
            assert labels[b, p] == pairs[ids[b, p].item()] == ids[b, p + 1]  # the target, then the value
        filler = torch.ones(T, dtype=torch.bool)
        filler[:2 * P] = False
        filler[pos], filler[pos + 1] = False, False
        assert (ids[b, filler] == V - 1).all()
    with pytest.raises(ValueError, match="4 \\* n_pairs"):
        mqar_sc.long_mqar_batch(8, 31, 1, V, torch.Generator())


def test_mqar_short_conv_end_to_end(mqar_sc, tmp_path):
    out, fig = tmp_path / "m.json", tmp_path / "m.png"
    report = mqar_sc.main(["--device", "cpu", "--steps", "2", "--lr", "1e-3", "--pairs", "4,8", "--seq-len", "16,24",
                           "--vocab-size", "64", "--batch-size", "4", "--eval-batches", "1", "--log-every", "1",
                           "--out", str(out), "--plot", str(fig)])
    saved = json.loads(out.read_text())
    assert saved["skipped_T_below_4P"] == ["P=8/T=16", "P=8/T=24"]
    assert {(r["mechanism"], r["n_pairs"], r["seq_len"]) for r in saved["runs"]} == {
        (m, 4, T) for m in ("linear", "rls") for T in (16, 24)}
    assert all(0.0 <= r["acc"] <= 1.0 and r["nonfinite_steps"] == 0 for r in report["runs"])
    assert fig.stat().st_size > 0
    # pieces run separately merge into one result file
    other = tmp_path / "m2.json"
    mqar_sc.main(["--device", "cpu", "--steps", "1", "--lr", "1e-3", "--pairs", "2", "--seq-len", "8",
                  "--mechanisms", "rls", "--vocab-size", "64", "--batch-size", "2", "--eval-batches", "1",
                  "--out", str(other), "--plot", "none"])
    merged = mqar_sc.main(["--merge", f"{out},{other}", "--out", str(tmp_path / "all.json"), "--plot", "none"])
    assert len(merged["runs"]) == 5 and "rls/P=2/T=8" in merged["best"]


def test_key_only_short_conv_is_a_plain_shift_of_the_keys(mqar_sc):
    """`short_conv_targets="k"`, `conv_size=2`, `conv_activation=None` with taps (w0, w1) = (0, 1) gives seed
    004's construction k_t = W_K x_{t−1} while q and v stay plain projections (float64 reference)."""
    from lazoo import ops

    torch.manual_seed(0)
    model = mqar_sc.build_model("linear", 32).double()
    mixer = model.model.layers[0].mixer
    assert set(mixer.short_conv.convs) == {"k"}
    with torch.no_grad():  # conv1d tap 0 multiplies x_{t−1}, tap 1 multiplies x_t
        mixer.short_conv.convs["k"].weight.zero_()
        mixer.short_conv.convs["k"].weight[:, 0, 0] = 1.0
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    q, k, v = mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)
    k = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
    o, _ = ops.linear_attention(*(t[:, :, None] for t in (q, k, v)), feature_map="identity", normalize=False,
                                backend="recurrent")
    expected = mixer.o_proj(mixer.o_norm(o)[:, :, 0])
    torch.testing.assert_close(mixer(x), expected)


@pytest.mark.parametrize("bad", [{"short_conv_targets": "kx"}, {"short_conv_targets": ""},
                                 {"conv_activation": "relu"}])
def test_short_conv_options_are_checked(bad):
    from transformers import AutoModelForCausalLM

    from lazoo.presets import build_config

    config = build_config("linear", vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=1,
                          use_short_conv=True, mixer_kwargs={"linear": bad})
    with pytest.raises(ValueError, match=next(iter(bad))):
        AutoModelForCausalLM.from_config(config)


def test_query_only_head_matches_full_logits(mqar_sc):
    """The loss and hits from the LM head at the query positions equal experiments/mqar.py's full-logits ones."""
    import mqar as mqar_protocol

    torch.manual_seed(0)
    model = mqar_sc.build_model("linear", 64).eval()
    batch = mqar_sc.long_mqar_batch(4, 32, 3, 64, torch.Generator().manual_seed(1))
    loss, hits, mask = mqar_sc.masked_loss_and_hits(model, batch)
    ref_loss, ref_hits, ref_mask = mqar_protocol.masked_loss_and_hits(model, batch)
    assert torch.equal(mask, ref_mask) and torch.equal(hits, ref_hits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
