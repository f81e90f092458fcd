"""lazoo.bench.gdn_training on the CPU: fla's Gated DeltaNet model built, saved and converted, lazoo's side trained
(fla's kernels do not run on a CPU: its row records the error and the run goes on), and the comparison of two loss
curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lazoo.bench import gdn_training

FLA_SITE = os.environ.get("LAZOO_FLA_SITE", "/tmp/fla/site")


def test_the_comparison_names_the_largest_gap_and_the_speed_ratio():
    rows = {"fla": {"losses": [10.0, 8.0, 6.0], "tokens_per_s": 100.0},
            "lazoo": {"losses": [10.0, 8.5, 6.1], "tokens_per_s": 125.0}}
    got = gdn_training.compare(rows)
    assert got["lazoo_over_fla_tokens_per_s"] == 1.25
    assert got["at_step"] == 1 and got["largest_loss_gap"] == 0.5
    assert got["largest_relative_loss_gap"] == pytest.approx(0.5 / 8.0)


@pytest.mark.slow  # 24 s on 2 cores, most of it the child's imports
def test_a_tiny_run_trains_the_converted_model_from_fla_s_weights(tmp_path):
    if not os.path.isdir(FLA_SITE):
        pytest.skip(f"fla 0.6.0 not found at {FLA_SITE} (set LAZOO_FLA_SITE)")
    out = tmp_path / "rows.jsonl"
    # a child process: fla imported here would stay imported for the other tests, without their flash_attn stand-in
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FLA_SITE, *sys.path])}
    subprocess.run([sys.executable, "-m", "lazoo.bench.gdn_training", "--device", "cpu", "--implementations",
                    "fla,lazoo", "--hidden-size", "64", "--layers", "2", "--heads", "2", "--head-dim", "32",
                    "--vocab-size", "256", "--length", "16", "--batch", "2", "--steps", "3", "--warmup", "1",
                    "--out", str(out)], env=env, check=True, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    env = next(r["env"] for r in rows if "env" in r)
    assert env["flash-linear-attention"] and "gdn_training" in env["command"]
    trained = {r["implementation"]: r for r in rows if r.get("row") == "train"}
    assert "error" in trained["fla"]  # no fla kernels on a CPU
    lazoo = trained["lazoo"]
    assert "error" not in lazoo, lazoo
    assert len(lazoo["losses"]) == 3 and all(4.0 < x < 7.0 for x in lazoo["losses"])  # ln 256 = 5.5 at the start
    assert lazoo["params"] > 0 and lazoo["tokens_per_s"] > 0
    assert not any(r.get("row") == "comparison" for r in rows)
