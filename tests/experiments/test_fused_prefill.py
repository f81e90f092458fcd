"""experiments/fused_prefill.py: a misspelt ``--set`` is refused before anything runs, without a CUDA GPU the script
says so, and a run that fails gives a row with its error while the others go on."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_experiment


@pytest.fixture(scope="module")
def fp():
    return load_experiment("fused_prefill")


def test_a_misspelt_setting_is_refused(fp):
    with pytest.raises(ValueError, match="has no setting"):
        fp.main(["--set", "x:lazoo.kernels.delta_fused.NO_SUCH_SETTING=1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(fp):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fp.main([])


def test_a_failing_run_gives_its_error_row(fp, monkeypatch, capsys):
    monkeypatch.setattr(fp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp.torch.cuda, "get_device_name", lambda: "fake")
    monkeypatch.setattr(fp, "DEVICE", "cpu")

    def op(gated):
        def run(x):
            if fp.delta.USE_FUSED_PREFILL:
                raise RuntimeError("the fused kernel refused")
            return x["v"].float()
        return run

    monkeypatch.setattr(fp, "lazoo_op", op)
    monkeypatch.setattr(fp, "reference", lambda x, gated: x["v"].double())
    monkeypatch.setattr(fp.timing, "median_ms", lambda fn: (fn(), 1.5)[1])
    fp.main(["--rounds", "1", "--ops", "gated", "--shapes", "64:1:2:2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["triton", "fused"]
    assert rows[0]["ms"] == 1.5 and rows[0]["err_2k"] == 0.0
    assert rows[1]["ms"] is None and "the fused kernel refused" in rows[1]["err_2k"]
