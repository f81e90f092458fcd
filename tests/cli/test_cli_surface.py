"""The surface of the `lazoo` command line: `--help` of every command answers at once (the parser is built without
torch, transformers or lazoo's models), one option vocabulary across train, demo, eval and convert (the demo's
former names still work), `--threads` and the thread environment honoured, `--no-progress` silencing every bar,
and checks that print their verdict."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from lazoo import cli, runtime
from lazoo_cli import parser as light
from lazoo_cli.bench import BENCHMARKS

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["list", "train", "generate", "card", "cards", "convert", "bench", "eval", "demo"]
#: what `--help` must not import: the model stack takes seconds to import
HEAVY = ("torch", "transformers", "datasets", "lazoo")
HELP_SECONDS = 1.5
TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "300", "--threads", "1"]
#: a progress bar drawn by tqdm: its bar, its rate, or the carriage return that redraws it
PROGRESS_MARKS = ("%|", "it/s", "examples/s", "\r")


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- --help at once
def _help_in_a_process(*words: str) -> tuple[float, list[str], str]:
    """`lazoo [words...] --help` as the console script runs it: seconds, heavy modules imported, the help text."""
    argv = [*words, "--help"]
    code = ("import sys\nfrom lazoo_cli import main\nstatus = main(sys.argv[1:])\n"
            f"print('IMPORTED=' + ','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"
            "sys.exit(status)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    imported = done.stdout.rsplit("IMPORTED=", 1)[1].strip()
    return seconds, [m for m in imported.split(",") if m], done.stdout


@pytest.mark.parametrize("words", [[], *([c] for c in COMMANDS), *(["bench", name] for name in BENCHMARKS)],
                         ids=lambda words: " ".join(words) or "lazoo")
def test_help_imports_no_model_stack_and_answers_at_once(words):
    runs = [_help_in_a_process(*words) for _ in range(3)]
    for _, imported, text in runs:
        assert imported == [], f"--help imported {imported}"
        assert "usage: lazoo" in text
    median = statistics.median(seconds for seconds, _, _ in runs)
    assert median < HELP_SECONDS, f"lazoo {' '.join(words)} --help took {median:.2f} s (median of 3)"


def test_the_console_script_is_the_light_entry_point():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lazoo"] == "lazoo_cli:main"
    assert cli.main is __import__("lazoo_cli").main  # `lazoo.cli.main(argv)` is the same command line


def test_the_static_lists_of_the_parser_are_the_real_ones():
    from lazoo import demo
    from lazoo.eval import TASKS
    from lazoo.presets import known_layouts

    assert list(light.LAYOUTS) == known_layouts()
    assert list(light.EVAL_TASKS) == list(TASKS)
    assert (demo.SIZE_FLAGS, demo.SIZE_LIMITS, demo.DEFAULT_SIZES) == (
        light.SIZE_FLAGS, light.SIZE_LIMITS, light.DEFAULT_SIZES)


# ----------------------------------------------------------------------------- one vocabulary
def _options(command: str) -> set[str]:
    """The option strings `lazoo <command> --help` shows."""
    parser = light.command_parser(command)
    return {s for a in parser._actions if a.help != "==SUPPRESS==" for s in a.option_strings}


def test_train_demo_eval_and_convert_share_one_vocabulary():
    shared = {"--config", "--text", "--output", "--seq-len", "--steps", "--batch-size", "--lr", "--eval-blocks",
              "--threads", "--seed", "--no-progress", "--overwrite"}
    assert shared <= _options("train") and shared <= _options("demo")
    assert {"--output", "--batch-size", "--threads", "--no-progress", "--overwrite"} <= _options("eval")
    assert {"--threads", "--seed", "--no-progress"} <= _options("generate")
    assert "--output" in _options("convert")
    for old in light.DEPRECATED_DEMO_OPTIONS:  # hidden, but still accepted
        assert old not in _options("demo")


def test_the_demos_former_option_names_still_work_and_say_so_once(capsys):
    args = light.command_parser("demo").parse_args(
        ["--mechanism", "gated_delta_net", "--corpus", "my_text.txt", "--output-dir", "runs/x", "--block-size", "64",
         "--mechanism", "configs/vla-small.json", "--steps", "100"])
    assert (args.config, args.text, args.output, args.seq_len, args.steps) == (
        "configs/vla-small.json", "my_text.txt", "runs/x", 64, 100)
    err = capsys.readouterr().err
    for old, new in light.DEPRECATED_DEMO_OPTIONS.items():
        assert err.count(f"{old} is deprecated; use {new}") == 1, err
    defaults = light.command_parser("demo").parse_args([])
    assert (defaults.config, defaults.text, defaults.output, defaults.seq_len) == ("sw-vla", None, "outputs/demo", 128)
    assert capsys.readouterr().err == ""


def test_convert_takes_its_destination_once(capsys, tmp_path):
    src = tmp_path / "nowhere"
    code, _, err = run(capsys, "convert", src, "--output", tmp_path / "dst")
    assert code == 2 and "no such folder" in err  # --output DST parsed like DST
    fla = tmp_path / "fla"
    fla.mkdir()
    neither, both = ["convert", fla], ["convert", fla, tmp_path / "a", "--output", tmp_path / "b"]
    for argv in (neither, both):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "give the lazoo folder to write once" in err, err


# ----------------------------------------------------------------------------- threads
@pytest.fixture
def thread_calls(monkeypatch):
    """The values given to torch.set_num_threads (recorded, not applied)."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in runtime.THREAD_VARIABLES + ("LOCAL_WORLD_SIZE",):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_threads_option_wins_then_the_environment_then_all_cores(thread_calls, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runtime.set_cpu_threads(3)
    assert thread_calls == [3]
    runtime.set_cpu_threads(None)  # OMP_NUM_THREADS set: torch's own count (it read the variable) is kept
    assert thread_calls == [3]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    runtime.set_cpu_threads(None)
    assert thread_calls == [3]
    monkeypatch.delenv("MKL_NUM_THREADS")
    runtime.set_cpu_threads(None)
    assert thread_calls == [3, os.cpu_count()]


@pytest.fixture(scope="module")
def text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:60]), encoding="utf-8")
    return path


def demo_argv(text, out, *extra):
    return ["demo", "--output", out, "--text", text, "--steps", "1", "--seq-len", "32", "--batch-size", "2",
            "--eval-blocks", "2", "--max-new-tokens", "2", *TINY, *extra]


def train_argv(text, out, *extra):
    return ["train", "--config", "gated_delta_net", "--output", out, "--text", text, "--steps", "2", "--seq-len", "32",
            "--batch-size", "2", "--eval-blocks", "2", *TINY, *extra]


def test_demo_and_generate_honour_threads(text, tmp_path, thread_calls, capsys):
    code, _, err = run(capsys, *demo_argv(text, tmp_path / "demo", "--no-progress"))
    assert code == 0, err
    assert thread_calls == [1]
    code, _, err = run(capsys, "generate", tmp_path / "demo" / "model", "--max-new-tokens", "2", "--threads", "1")
    assert code == 0, err
    assert thread_calls == [1, 1]


# ----------------------------------------------------------------------------- --no-progress
def _bars(text: str) -> list[str]:
    return [mark for mark in PROGRESS_MARKS if mark in text]


@pytest.mark.parametrize("command", ["train", "demo"])
def test_no_progress_silences_every_bar(command, text, tmp_path, capfd):
    import datasets
    import transformers

    argv = {"train": train_argv, "demo": demo_argv}[command]
    assert cli.main([str(a) for a in argv(text, tmp_path / "quiet", "--no-progress")]) == 0
    out, err = capfd.readouterr()
    assert _bars(out + err) == [], err[-2000:]
    # the switches are restored for whatever runs next in this process
    assert datasets.is_progress_bar_enabled() and transformers.utils.logging.is_progress_bar_enabled()
    assert cli.main([str(a) for a in argv(text, tmp_path / "bars")]) == 0
    out, err = capfd.readouterr()
    assert _bars(out + err), "without --no-progress the run draws bars (so the check above can see them)"


# ----------------------------------------------------------------------------- checks print their verdict
def test_cards_check_says_up_to_date_or_names_the_stale_cards(tmp_path, capsys):
    configs, cards = tmp_path / "configs", tmp_path / "cards"
    configs.mkdir()
    for name in ("linear-small.json", "vla-small.json"):
        (configs / name).write_text((ROOT / "configs" / name).read_text())
    assert run(capsys, "cards", "--configs", configs, "--output", cards)[0] == 0
    code, out, _ = run(capsys, "cards", "--check", "--configs", configs, "--output", cards)
    assert code == 0 and f"{cards}/: all 2 cards are up to date" in out, out
    (cards / "vla-small.md").write_text("outdated\n")
    code, out, _ = run(capsys, "cards", "--check", "--configs", configs, "--output", cards)
    assert code == 1 and f"stale: {cards / 'vla-small.md'}" in out and "1 stale card(s)" in out, out
