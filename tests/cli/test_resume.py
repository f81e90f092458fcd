"""`lazoo train` / scripts/train_lm.py checkpoints: a run resumed from its middle checkpoint follows the loss
curve of the uninterrupted run (same data order, same RNG) and ends with the same weights (CPU, tiny model)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from lazoo import cli

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "300", "--sliding-window", "8"]


@pytest.fixture(scope="module")
def text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:80]), encoding="utf-8")
    return path


def train_argv(text, out, *extra):
    return ["train", "--config", "sw-vla", "--output", str(out), "--text", str(text), "--steps", "6",
            "--seq-len", "32", "--batch-size", "4", "--grad-accum", "2", "--eval-blocks", "4", "--lr", "5e-3",
            "--save-steps", "2", "--logging-steps", "1", "--threads", "1", "--no-progress", *TINY, *extra]


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def losses(checkpoint):
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_resume_from_the_middle_checkpoint_follows_the_same_curve(text, tmp_path, packing):
    extra = ["--packing"] if packing else []
    full = tmp_path / "full"
    assert cli.main(train_argv(text, full, *extra)) == 0
    assert sorted(p.name for p in full.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    reference = losses(full / "checkpoint-6")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    # an interrupted run: what the full run had written after step 4 (tokenizer and checkpoints 2 and 4)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for f in full.glob("tokenizer*"):
        shutil.copy(f, resumed / f.name)
    for step in (2, 4):
        shutil.copytree(full / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
    counter = StepCounter()
    cli.run_training(cli.build_parser().parse_args(train_argv(text, resumed, *extra, "--resume")), [counter])
    assert counter.steps == [5, 6]  # it resumed: only the last two steps ran
    after = losses(resumed / "checkpoint-6")
    assert sorted(after) == [1, 2, 3, 4, 5, 6]  # steps 1-4 come from checkpoint-4's state
    for step in (5, 6):
        assert after[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, after, reference)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_resume_without_a_checkpoint_is_a_clear_error(text, tmp_path, capsys):
    code = cli.main(train_argv(text, tmp_path / "empty", "--resume"))
    assert code == 2
    assert "--resume" in capsys.readouterr().err
