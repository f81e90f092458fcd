"""experiments/gdn_kernel_profile.py: ``--impl`` names lazoo and the frontier's anchors only; an anchor that cannot
run gives a row with its error instead of stopping the others; without a CUDA GPU the script says so."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_experiment


@pytest.fixture(scope="module")
def prof():
    return load_experiment("gdn_kernel_profile")


@pytest.mark.parametrize("impl", ["bogus", "lazoo,flash", ""])
def test_unknown_implementations_are_refused(prof, impl):
    with pytest.raises(SystemExit, match="--impl"):
        prof.main(["--impl", impl])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(prof):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        prof.main(["--impl", "lazoo,fla"])


def test_an_anchor_that_fails_gives_its_error_row(prof, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prof.torch.cuda, "is_available", lambda: True)

    def lazoo(x):
        return x
    monkeypatch.setattr(prof, "implementations", lambda gated: {"lazoo": lazoo, "fla": "ImportError: no fla",
                                                                "flashqla": lambda x: x})

    def kernel_times(T, B, H, HV, fn, steps=10, grad=True):
        if fn is not lazoo:
            raise RuntimeError("the backward refuses this Triton")
        return dict(kernels_ms={"k": 1.0}, total=1.0)
    monkeypatch.setattr(prof, "kernel_times", kernel_times)
    out = tmp_path / "rows.jsonl"
    prof.main(["--impl", "lazoo,fla,flashqla", "--shapes", "64:1:2:2", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["lazoo", "fla", "flashqla"]
    assert rows[0]["total"] == 1.0
    assert rows[1]["error"] == "ImportError: no fla"
    assert rows[2]["error"].startswith("RuntimeError: the backward refuses")
