"""The `lazoo` command line under hostile input and interrupts.

Bad input: every row exits with status 2 and prints one line `lazoo <command>: error: ...` naming the problem,
before any work (a saved config with a wrong field, text that is not UTF-8, absurd sizes, a path under a file,
an argparse error of a pass-through command). Interrupts: checkpoints are written under a staging name and
renamed when complete, so Ctrl-C at any moment leaves only complete checkpoint-N folders, and `--resume`
passes over (and names) incomplete ones, never deleting a folder lazoo did not write."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_model
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from transformers import Trainer

from lazoo import cli

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "300"]
TRAIN = ["train", "--config", "gated_delta_net", "--output", "OUT", "--text", "TEXT", "--steps", "2", "--seq-len",
         "32", "--batch-size", "2", "--eval-blocks", "2", "--threads", "1", "--no-progress", *TINY]
DEMO = ["demo", "--output", "OUT", "--text", "TEXT", "--steps", "1", "--seq-len", "32", "--eval-blocks", "2",
        "--threads", "1", "--no-progress", *TINY]


@pytest.fixture(scope="module")
def text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:80]), encoding="utf-8")
    return path


def _saved_copy(model: Path, folder: Path, **config_changes) -> Path:
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tokenizer, text):
    """Files the rows name: a saved model (MODEL) and copies with a bad config field, sizes its weights do not
    have, damaged weights or a README.md folder; a plain file (AFILE), a folder named like a .json (DIRJSON), Latin-1
    metrics, a config folder with a config naming an unknown mechanism, a config too large to train, the training
    text."""
    root = tmp_path_factory.mktemp("hardening")
    model = root / "model"
    tiny_model("gated_delta_net", vocab_size=len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    _saved_copy(model, root / "mixkw", mixer_kwargs={"no_such_option": 3})
    _saved_copy(model, root / "strhidden", hidden_size="32")
    _saved_copy(model, root / "badlayer", layer_types=["no_such_mechanism"])
    _saved_copy(model, root / "resized", hidden_size=64, intermediate_size=128)
    _saved_copy(model, root / "baddtype", dtype="float99")
    (_saved_copy(model, root / "badweights") / "model.safetensors").write_bytes(b"\x10" * 100)
    readme_dir = _saved_copy(model, root / "readmedir")
    (readme_dir / "README.md").unlink()
    (readme_dir / "README.md").mkdir()
    (root / "afile").write_text("a file, not a folder\n")
    (root / "dir.json").mkdir()
    (root / "latin1.json").write_bytes('{"caf\xe9": 1}'.encode("latin-1"))
    (root / "configs").mkdir()
    (root / "configs" / "broken.json").write_text(json.dumps(
        {"model_type": "lazoo_hybrid", "layer_types": ["no_such_mechanism"], "num_hidden_layers": 1}))
    shutil.copy(text, root / "text.txt")
    (root / "huge.json").write_text(json.dumps({"model_type": "lazoo_linear", "vocab_size": 10**9}))
    (root / "dtype.json").write_text(json.dumps({"model_type": "lazoo_linear", "dtype": "float99"}))
    return root


CASES = [  # (argv, text the single error line must contain)
    # generate
    (["generate", "MODEL", "--max-new-tokens", "0"], "--max-new-tokens must be a positive number, got 0"),
    (["generate", "MODEL", "--max-new-tokens", str(10**30)], "--max-new-tokens must be at most"),
    (["generate", "MIXKW"], "mixer_kwargs"),
    (["generate", "STRHIDDEN"], "hidden_size must be a positive int, got '32'"),
    (["generate", "BADLAYER"], "unknown mechanism 'no_such_mechanism' in layer_types"),
    (["generate", "BADDTYPE"], "dtype 'float99' is not a torch dtype"),
    (["generate", "MODEL", "--prompt", "\udc80"], "--prompt is not UTF-8 text"),
    (["generate", "MODEL", "--seed", str(2**40)], "--seed must be at most 4294967295"),
    (["generate", "MODEL", "--temperature", "1e-300"], "--temperature must be a positive finite number, at least"),
    (["generate", "BADWEIGHTS"], "cannot load a causal LM from"),
    (["generate", "MODEL", "--top-k", "x"], "argument --top-k: invalid int value"),
    (["generate", "RESIZED"], "model.embed_tokens.weight has shape"),  # config.json edited after saving
    # card and cards
    (["card", "MIXKW"], "mixer_kwargs"),
    (["card", "STRHIDDEN"], "hidden_size must be a positive int, got '32'"),
    (["card", "BADLAYER"], "unknown mechanism 'no_such_mechanism' in layer_types"),
    (["card", "BADDTYPE"], "dtype 'float99' is not a torch dtype"),
    (["card", "MODEL", "--metrics", "LATIN1"], "latin1.json is not UTF-8 text"),
    (["card", "MODEL", "--metrics", "DIRJSON"], "dir.json' is a folder"),
    (["card", "MODEL", "--metrics", '{"ppl": "\\udc80"}'], "--metrics is not UTF-8 text"),
    (["card", "MODEL", "--training-data", "\udc80"], "--training-data is not UTF-8 text"),
    (["card", "READMEDIR", "--overwrite"], "README.md: Is a directory"),
    (["cards", "--configs", "CONFIGS", "--output", "OUT"], "broken.json: unknown mechanism 'no_such_mechanism'"),
    (["cards", "--output", "AFILE"], "afile' is a file; give a folder"),
    # train
    (TRAIN[:4] + ["AFILE/sub"] + TRAIN[5:], "afile' is a file, so no folder can be made under it"),
    (TRAIN + ["--batch-size", "1000000000"], "--batch-size must be at most"),
    (TRAIN + ["--batch-size", "5000"], "more than the"),  # the text gives fewer training blocks
    (TRAIN + ["--grad-accum", "5000"], "more than the"),
    (TRAIN + ["--steps", str(10**30)], "--steps must be at most"),
    (TRAIN + ["--seq-len", str(10**12)], "--seq-len must be at most"),
    (TRAIN + ["--hidden-size", str(10**9)], "--hidden-size must be at most"),
    (TRAIN + ["--layers", str(10**7)], "--layers must be at most"),
    (TRAIN + ["--vocab-size", str(10**9)], "--vocab-size must be at most"),
    (TRAIN + ["--sliding-window", str(10**30)], "--sliding-window must be at most"),
    (TRAIN + ["--threads", str(10**6)], "--threads must be at most"),
    (TRAIN + ["--seed", str(2**40)], "--seed must be at most"),
    (TRAIN + ["--steps", "x"], "argument --steps: invalid int value"),
    (TRAIN[:2] + ["DIRJSON"] + TRAIN[3:], "dir.json' is a folder"),
    (["train", "--config", "HUGE", "--output", "OUT"], "vocab_size 1000000000 is more than"),
    (["train", "--config", "DTYPE", "--output", "OUT"], "dtype 'float99' is not a torch dtype"),
    # demo and eval (their own command lines)
    (DEMO + ["--config", "bogus"], "--config: unknown layout 'bogus'"),
    (DEMO + ["--text", "LATIN1"], "latin1.json is not UTF-8 text"),
    (DEMO + ["--text", "nowhere.txt"], "--text: no such file or folder"),
    (DEMO + ["--threads", "0"], "--threads must be a positive number"),
    (DEMO + ["--prompt", "\udc80"], "--prompt is not UTF-8 text"),
    (DEMO + ["--batch-size", "5000"], "more than the"),
    (DEMO + ["--seed", str(2**40)], "--seed must be at most"),
    (DEMO + ["--steps", "x"], "argument --steps: invalid int value"),
    (DEMO[:2] + ["AFILE/x"] + DEMO[3:], "afile' is a file, so no folder can be made under it"),
    (["eval", "MIXKW"], "mixer_kwargs"),
    (["eval", "MODEL", "--output", "AFILE/results.json"], "afile' is a file, so no folder can be made under it"),
    (["eval", "MODEL", "--batch-size", "x"], "argument --batch-size: invalid int value"),
    (["eval", "MODEL", "--device", "nonsense"], "--device: 'nonsense' is not a torch device"),
    (["eval", "MODEL", "--output", "DIRJSON"], "dir.json' is a folder; give the path of a file"),
    (["eval", "MODEL", "--threads", str(10**6)], "--threads must be at most"),
    (["generate", "MODEL", "--threads", "0"], "--threads must be a positive number"),
]


PROGRESS = re.compile(r"%\||[0-9?.]+ (examples|it)/s")


def _one_error_line(err: str, command: str) -> str:
    """The single line of `err` besides progress bars (datasets may draw some before a refusal)."""
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS.search(line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"lazoo {command}: error: "), err
    return lines[0]


def _case_id(argv: list[str]) -> str:
    """The command and what a row changes in its base command line."""
    base = {"train": TRAIN, "demo": DEMO}.get(argv[0])
    if base is None or len(argv) < len(base):
        return " ".join(argv)[:70]
    changed = [a for a, b in zip(argv, base) if a != b] + argv[len(base):]
    return " ".join([argv[0], *changed])[:70]


@pytest.mark.parametrize("argv, message", CASES, ids=[_case_id(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_status_2(argv, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    out = workdir / "out"
    names = {"OUT": str(out), "TEXT": str(workdir / "text.txt"), "AFILE/sub": str(workdir / "afile" / "sub"),
             "AFILE/x": str(workdir / "afile" / "x"), "AFILE/results.json": str(workdir / "afile" / "results.json"),
             **{k: str(workdir / v) for k, v in [("MODEL", "model"), ("MIXKW", "mixkw"), ("STRHIDDEN", "strhidden"),
                                                 ("BADLAYER", "badlayer"), ("BADWEIGHTS", "badweights"),
                                                 ("RESIZED", "resized"), ("HUGE", "huge.json"),
                                                 ("BADDTYPE", "baddtype"), ("DTYPE", "dtype.json"),
                                                 ("READMEDIR", "readmedir"), ("AFILE", "afile"),
                                                 ("DIRJSON", "dir.json"), ("LATIN1", "latin1.json"),
                                                 ("CONFIGS", "configs")]}}
    code = cli.main([names.get(a, a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in _one_error_line(err, argv[0]), err
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("argv, flag", [(TRAIN, "--text"), (DEMO, "--text"), (["card", "MODEL", "--metrics", "TEXT"],
                                                                            "--metrics")],
                         ids=["train --text", "demo --text", "card --metrics"])
def test_an_unreadable_file_is_named(argv, flag, workdir, monkeypatch, capsys):
    """Permission denied (simulated: as root every file is readable)."""
    text = str(workdir / "text.txt")
    argv = [{"TEXT": text, "MODEL": str(workdir / "model"), "OUT": str(workdir / "out")}.get(a, a) for a in argv]
    access, read_text = os.access, Path.read_text
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != text and access(path, mode))

    def denied(path, *args, **kwargs):
        if str(path) == text:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    code = cli.main(argv)
    line = _one_error_line(capsys.readouterr().err, argv[0])
    assert code == 2 and flag in line and "text.txt" in line and "ermission denied" in line, line


# ----------------------------------------------------------------------------- main(): the last line of defence
def _raising(exc):
    def command(args):
        raise exc
    return command


@pytest.mark.parametrize("exc, message", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/model.safetensors"),
     "/data/run/model.safetensors: No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/notes.txt"), "/data/notes.txt: Permission denied"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not UTF-8"),
], ids=["no space", "permission", "unicode"])
def test_expected_error_kinds_become_one_line(exc, message, monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_list", _raising(exc))
    code = cli.main(["list"])
    err = capsys.readouterr().err
    assert code == 2 and message in _one_error_line(err, "list"), err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_list", _raising(KeyboardInterrupt()))
    assert cli.main(["list"]) == 130
    assert capsys.readouterr().err.strip() == "lazoo list: interrupted"


def test_a_closed_output_pipe_ends_quietly(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_list", _raising(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert cli.main(["list"]) == 141  # as a process killed by SIGPIPE; `lazoo list | head -1` prints no error
    assert capsys.readouterr().err == ""


def test_a_bug_still_shows_its_traceback(monkeypatch):
    monkeypatch.setattr(cli, "cmd_list", _raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main(["list"])


# ----------------------------------------------------------------------------- interrupted saves and --resume
def resume_argv(text, out, *extra):
    return ["train", "--config", "gated_delta_net", "--output", str(out), "--text", str(text), "--steps", "12",
            "--save-steps", "4", "--seq-len", "32", "--batch-size", "2", "--eval-blocks", "2", "--threads", "1",
            "--no-progress", *TINY, *extra]


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def assert_checkpoints_complete(out: Path) -> list[str]:
    """Every checkpoint-N in `out` has its trainer_state.json; returns their names."""
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert all((out / n / "trainer_state.json").is_file() for n in names), names
    return names


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_interrupted_save_leaves_no_checkpoint_and_resume_goes_on(text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    save_rng_state = Trainer._save_rng_state

    def interrupted_at_step_8(self, output_dir):  # after the model and optimizer, before the RNG and state
        if self.state.global_step == 8:
            raise KeyboardInterrupt
        return save_rng_state(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", interrupted_at_step_8)
    assert cli.main(resume_argv(text, out)) == 130
    assert "lazoo train: interrupted" in capsys.readouterr().err
    assert assert_checkpoints_complete(out) == ["checkpoint-4"]  # no checkpoint-8 without its state
    assert (out / ".lazoo-saving-checkpoint-8" / "checkpoint-8" / "model.safetensors").is_file()

    monkeypatch.setattr(Trainer, "_save_rng_state", save_rng_state)
    code = cli.main(resume_argv(text, out, "--resume"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"removing {out / '.lazoo-saving-checkpoint-8'}" in captured.out
    assert f"resuming from {out / 'checkpoint-4'}" in captured.out
    assert assert_checkpoints_complete(out) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert not list(out.glob(".lazoo-saving-*"))


def test_resume_passes_over_incomplete_checkpoints_and_keeps_them(text, tmp_path, capsys):
    """checkpoint-8 and checkpoint-10 as an interrupted save of an older version leaves them: partly written
    (model and config, no trainer_state.json) and empty. --resume goes on from checkpoint-4 and names both;
    at step 8 the partial one is set aside, not deleted; rotation (--save-total-limit 1) never touches them."""
    out = tmp_path / "run"
    assert cli.main(resume_argv(text, out, "--steps", "4")) == 0
    partial = out / "checkpoint-8"
    partial.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(out / "checkpoint-4" / name, partial / name)
    kept = snapshot(partial)
    (out / "checkpoint-10").mkdir()
    capsys.readouterr()

    code = cli.main(resume_argv(text, out, "--resume", "--save-total-limit", "1"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for name in ("checkpoint-8", "checkpoint-10"):
        assert f"skipping {out / name}: it has no trainer_state.json" in captured.out
    assert f"resuming from {out / 'checkpoint-4'}" in captured.out
    assert snapshot(out / "incomplete-checkpoint-8") == kept  # set aside when step 8 was saved
    assert (out / "checkpoint-10").is_dir()  # still there, empty: never rotated
    assert [p.name for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file()] == ["checkpoint-12"]


def test_resume_without_a_complete_checkpoint_is_one_line(text, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-8").mkdir(parents=True)
    code = cli.main(resume_argv(text, out, "--resume"))
    line = _one_error_line(capsys.readouterr().err, "train")
    assert code == 2 and "no checkpoint-N folder" in line and "checkpoint-8" in line
    code = cli.main(resume_argv(text, out, f"--resume={out / 'checkpoint-8'}"))
    line = _one_error_line(capsys.readouterr().err, "train")
    assert code == 2 and "has no trainer_state.json" in line
    assert listing(out) == ["checkpoint-8"]


def test_a_users_folder_named_like_a_checkpoint_is_refused(text, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "thesis.txt").write_text("mine\n")
    code = cli.main(resume_argv(text, out, "--overwrite"))
    assert code == 2 and "checkpoint-3 is not a Trainer checkpoint" in _one_error_line(capsys.readouterr().err, "train")
    assert snapshot(out) == {"checkpoint-3/thesis.txt": b"mine\n"}


# ----------------------------------------------------------------------------- a real Ctrl-C (SIGINT)
def _sigint_as_a_terminal_sends_it():
    """In the child before it starts: SIGINT back to its default action, as in a shell's foreground job. A suite run in
    the background of a non-interactive shell (`.ci/run &`, nohup) inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler: the run would ignore the test's Ctrl-C and end with status 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_run(text, out: Path, moment: str) -> subprocess.CompletedProcess | None:
    """`lazoo train` in a process of its own, sent SIGINT at `moment`: "saving" (as soon as the staging folder
    of a checkpoint after the first and before the last appears: the last one's save ends the run, and a signal
    then can land after the run has ended) or "after-save" (once checkpoint-10 is complete). None where the run
    ended before the moment was seen (a save can be over between two looks at the folder)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    argv = resume_argv(text, out, "--steps", "40", "--save-steps", "5")
    proc = subprocess.Popen([sys.executable, "-m", "lazoo.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_a_terminal_sends_it)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        names = os.listdir(out) if out.is_dir() else []
        mid_save = any(n.startswith(".lazoo-saving-") and not n.endswith(("-5", "-40")) for n in names)
        if (moment == "saving" and mid_save) or \
                (moment == "after-save" and (out / "checkpoint-10" / "trainer_state.json").is_file()):
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.002)
    else:
        proc.communicate(timeout=120)
        return None
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _sigint_then_resume(text, tmp_path, capsys, moment):
    for attempt in range(5):  # until a run is caught at the moment
        out = tmp_path / f"run{attempt}"
        run = _sigint_run(text, out, moment)
        if run is not None:
            break
    assert run is not None, f"no run was caught {moment}"
    assert run.returncode == 130, run.stderr[-3000:]  # interrupted before the end
    assert run.stderr.strip().splitlines()[-1] == "lazoo train: interrupted", run.stderr[-3000:]
    assert_checkpoints_complete(out)
    leftovers = list(out.glob(".lazoo-saving-*"))  # the save that was interrupted, if SIGINT came during one
    code = cli.main(resume_argv(text, out, "--steps", "40", "--save-steps", "5", "--resume"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "resuming from" in captured.out and all(f"removing {p}" in captured.out for p in leftovers)
    assert "checkpoint-40" in assert_checkpoints_complete(out)
    assert not list(out.glob(".lazoo-saving-*"))


def test_sigint_during_a_save_then_resume(text, tmp_path, capsys):
    _sigint_then_resume(text, tmp_path, capsys, "saving")


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_sigint_during_a_save_then_resume_again(text, tmp_path, capsys, attempt):
    _sigint_then_resume(text, tmp_path, capsys, "saving")


@pytest.mark.slow
def test_sigint_between_saves_then_resume(text, tmp_path, capsys):
    _sigint_then_resume(text, tmp_path, capsys, "after-save")
