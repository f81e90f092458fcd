"""experiments/mqar_short_conv.py's query-slot laws: Zoology's power law (slot i with weight a·i^(a−1), drawn without
replacement) and the uniform law, the layout they produce, and the uniform-slot accuracy in the report."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_experiment


@pytest.fixture(scope="module")
def msc():
    return load_experiment("mqar_short_conv")


def _power_law(n_slots: int, a: float) -> torch.Tensor:
    i = torch.arange(1, n_slots + 1, dtype=torch.float64)
    w = a * i ** (a - 1)
    return w / w.sum()


@pytest.mark.parametrize("a", [0.01, 0.5])
def test_power_law_first_draw_follows_zoology_weights(msc, a):
    """One slot per row: its frequencies match a·i^(a−1), normalised (float64 reference, 5 sigma)."""
    n_slots, rows = 12, 40_000
    slots = msc.query_slots(1, n_slots, rows, torch.Generator().manual_seed(0), "power", a)[:, 0]
    freq = torch.bincount(slots, minlength=n_slots).double() / rows
    p = _power_law(n_slots, a)
    sigma = (p * (1 - p) / rows).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), (freq, p)


def test_power_law_second_draw_renormalises_without_replacement(msc):
    """The second slot, given the first, follows the weights renormalised over the slots left."""
    n_slots, rows, a = 6, 60_000, 0.01
    slots = msc.query_slots(2, n_slots, rows, torch.Generator().manual_seed(1), "power", a)
    assert (slots[:, 0] != slots[:, 1]).all()
    p = _power_law(n_slots, a)
    given0 = slots[slots[:, 0] == 0, 1]
    freq = torch.bincount(given0, minlength=n_slots).double() / len(given0)
    expect = p.clone()
    expect[0] = 0
    expect /= expect.sum()
    sigma = (expect * (1 - expect) / len(given0)).sqrt()
    assert ((freq - expect).abs() <= 5 * sigma + 1e-12).all(), (freq, expect)


@pytest.mark.parametrize("gaps", ["power", "uniform"])
def test_slots_are_distinct_and_in_range(msc, gaps):
    slots = msc.query_slots(10, 10, 64, torch.Generator().manual_seed(2), gaps)
    assert torch.equal(slots.sort(dim=1).values, torch.arange(10).expand(64, 10))  # a permutation per row
    slots = msc.query_slots(5, 40, 64, torch.Generator().manual_seed(3), gaps)
    assert slots.min() >= 0 and slots.max() < 40
    assert all(len(set(row)) == 5 for row in slots.tolist())


def test_uniform_slots_are_flat_and_power_slots_are_near(msc):
    n_slots, rows = 50, 4000
    uni = msc.query_slots(1, n_slots, rows, torch.Generator().manual_seed(4), "uniform")[:, 0].double()
    assert abs(uni.mean().item() - (n_slots - 1) / 2) < 1.5  # std of the mean ≈ 0.23
    pw = msc.query_slots(1, n_slots, rows, torch.Generator().manual_seed(4), "power")[:, 0].double()
    expect = (_power_law(n_slots, 0.01) * torch.arange(n_slots, dtype=torch.float64)).sum().item()
    assert abs(pw.mean().item() - expect) < 1.5 and expect < 12


def test_unknown_gap_law_is_refused(msc):
    with pytest.raises(ValueError, match="gaps"):
        msc.query_slots(2, 8, 1, torch.Generator(), "zipf")
    with pytest.raises(ValueError, match="power_a"):
        msc.query_slots(2, 8, 1, torch.Generator(), "power", 0.0)


def test_power_law_layout_keeps_the_mqar_invariants(msc):
    P, T, V = 6, 64, 64
    batch = msc.long_mqar_batch(P, T, 8, V, torch.Generator().manual_seed(5), gaps="power")
    ids, labels = batch["input_ids"], batch["labels"]
    for b in range(8):
        pairs = dict(zip(ids[b, 0:2 * P:2].tolist(), ids[b, 1:2 * P:2].tolist()))
        pos = (labels[b] != msc.IGNORE_INDEX).nonzero()[:, 0]
        assert len(pos) == P and pos.min() >= 2 * P and ((pos - 2 * P) % 2 == 0).all()
        assert sorted(ids[b, pos].tolist()) == sorted(pairs)
        for p in pos.tolist():
            assert labels[b, p] == pairs[ids[b, p].item()] == ids[b, p + 1]
        filler = torch.ones(T, dtype=torch.bool)
        filler[:2 * P] = False
        filler[pos], filler[pos + 1] = False, False
        assert (ids[b, filler] == V - 1).all()


def test_report_has_uniform_slot_accuracy(msc, tmp_path):
    out = tmp_path / "r.json"
    msc.main(["--device", "cpu", "--steps", "2", "--lr", "1e-3", "--pairs", "4", "--seq-len", "32",
              "--mechanisms", "linear", "--vocab-size", "64", "--batch-size", "4", "--eval-batches", "1",
              "--out", str(out), "--plot", "none"])
    saved = json.loads(out.read_text())
    (run,) = saved["runs"]
    assert run["gaps"] == "power" and saved["settings"]["power_a"] == 0.01
    assert 0.0 <= run["acc_uniform_slots"] <= 1.0
    assert saved["best"]["linear/P=4/T=32"]["acc_uniform_slots"] == run["acc_uniform_slots"]
