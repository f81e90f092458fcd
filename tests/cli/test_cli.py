"""The `lazoo` command line, called in-process through `lazoo.cli.main(argv)` (fast): every subcommand's
--help, `lazoo list`, train -> generate -> card on a tiny text, and clear errors with a nonzero status."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import lazoo
from lazoo import cli

pytestmark = pytest.mark.usefixtures("single_thread")

SUBCOMMANDS = ["list", "train", "generate", "card", "cards", "convert", "bench", "eval", "demo"]
TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "300", "--sliding-window", "8"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def fake_eval(monkeypatch):
    """A stand-in for lazoo.eval (written separately): records the parsed arguments `lazoo eval` hands it."""
    calls = []

    def run(args):
        calls.append(args)
        return 0

    monkeypatch.setitem(sys.modules, "lazoo.eval", types.SimpleNamespace(check_args=lambda args: None, run=run))
    return calls


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command, capsys):
    code, out, err = run(capsys, command, "--help")
    assert code == 0, err
    assert f"usage: lazoo {command}" in out


def test_top_level_help_names_every_subcommand(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in SUBCOMMANDS:
        assert command in out


def test_list_shows_every_mechanism_with_its_kernels(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name in lazoo.list_mechanisms():
        assert name in rows and f"lazoo_{name}" in rows[name]
    # derived from the code: the ops that dispatch to a Triton kernel module, and those that have none
    assert "triton" in rows["vla"] and "kernels/vla/token.py" in rows["vla"]
    assert "triton" in rows["gla"] and "kernels/gla.py" in rows["gla"]
    assert "kernels/delta.py" in rows["delta_product"]  # through ops.delta_rule
    assert "triton" not in rows["softmax"] and "none" in rows["softmax"]
    code, out, _ = run(capsys, "list", "--json")
    info = json.loads(out)
    assert [m["name"] for m in info["mechanisms"]] == lazoo.list_mechanisms()
    for row in info["mechanisms"]:  # each row says what the mechanism's declaration says
        declared = lazoo.registry.get(row["name"])
        assert row["backends"] == ", ".join(declared.backends) and row["ops"] == f"ops.{declared.op}"
    assert "sw-vla" in info["hybrids"]


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:80]), encoding="utf-8")
    return path


def test_train_then_generate_then_card(tiny_text, tmp_path, capsys):
    out_dir = tmp_path / "model"
    code, out, err = run(capsys, "train", "--config", "sw-vla", "--output", str(out_dir), "--text", str(tiny_text),
                         "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--eval-blocks", "4",
                         "--threads", "1", "--no-progress", *TINY)
    assert code == 0, err
    assert "eval perplexity after 4 steps" in out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (out_dir / name).is_file(), name
    assert "eval_perplexity" in (out_dir / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    assert model.config.layer_types == ["sliding_window", "vla"] and model.config.hidden_size == 32

    code, out, err = run(capsys, "generate", str(out_dir), "--prompt", "And God said", "--max-new-tokens", "5",
                         "--greedy")
    assert code == 0, err
    text = out.strip()
    assert text.startswith("And God said") and len(text) > len("And God said")
    code, again, _ = run(capsys, "generate", str(out_dir), "--prompt", "And God said", "--max-new-tokens", "5",
                         "--greedy")
    assert again.strip() == text  # greedy is deterministic
    code, static, _ = run(capsys, "generate", str(out_dir), "--prompt", "And God said", "--max-new-tokens", "5",
                          "--greedy", "--static")
    assert code == 0 and static.strip() == text  # the static cache gives the same tokens
    code, eager, _ = run(capsys, "generate", str(out_dir), "--prompt", "And God said", "--max-new-tokens", "5",
                         "--greedy", "--eager")
    assert code == 0 and eager.strip() == text
    code, out, err = run(capsys, "generate", str(out_dir), "--max-new-tokens", "3", "--temperature", "0.7")
    assert code == 0, err

    (out_dir / "README.md").unlink()
    code, out, err = run(capsys, "card", str(out_dir), "--metrics", '{"my_score": 0.5}',
                         "--training-data", "a tiny slice of the KJV")
    assert code == 0, err
    card = (out_dir / "README.md").read_text()
    assert "my_score" in card and "a tiny slice of the KJV" in card and "`vla`" in card
    assert "parameters" in card
    metrics_file = tmp_path / "metrics.json"
    metrics_file.write_text('{"from_file": 1}')
    assert run(capsys, "card", str(out_dir), "--metrics", str(metrics_file))[0] == 0
    assert "from_file" in (out_dir / "README.md").read_text()


def test_eval_dispatches_to_lazoo_eval(capsys, fake_eval):
    code, _, _ = run(capsys, "eval", "some/model", "--tasks", "lazoo_mqar", "--threads", "1", "--no-progress")
    assert code == 0 and len(fake_eval) == 1
    args = fake_eval[0]
    assert args.models == ["some/model"] and args.tasks == "lazoo_mqar" and args.threads == 1 and args.no_progress


def test_eval_without_the_extras_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lazoo.eval", None)  # makes the import fail
    code, _, err = run(capsys, "eval", "some/model")
    assert code != 0 and "pip install 'lazoo[eval]'" in err
    code, out, _ = run(capsys, "eval", "--help")  # the options are lazoo_cli's: shown without the extras
    assert code == 0 and "--tasks" in out


def test_bench_runs_the_module_with_its_arguments(capsys, monkeypatch):
    import lazoo.bench.vla

    calls = []
    monkeypatch.setattr(lazoo.bench.vla, "main", calls.append)
    assert run(capsys, "bench", "vla", "--lengths", "1024", "--no-loop")[0] == 0
    assert calls == [["--lengths", "1024", "--no-loop"]]
    code, _, err = run(capsys, "bench", "vla", "--no-such-option")  # refused by the parser, before the module runs
    assert code == 2 and "unrecognized arguments: --no-such-option" in err and len(calls) == 1
    code, _, err = run(capsys, "bench", "nope")
    assert code == 2 and "invalid choice" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_needs_cuda(capsys):
    code, _, err = run(capsys, "bench", "kernels", "--quick")
    assert code != 0 and "CUDA" in err


@pytest.mark.parametrize("argv, message", [
    (["frobnicate"], "invalid choice"),
    (["train", "--config", "vla"], "the following arguments are required: --output"),
    (["train", "--config", "no_such_mechanism", "--output", "OUT"], "unknown layout 'no_such_mechanism'"),
    (["train", "--config", "missing.json", "--output", "OUT"], "no such file 'missing.json'"),
    (["train", "--config", "vla", "--output", "OUT", "--steps", "0"], "--steps must be a positive number"),
    (["train", "--config", "vla", "--output", "OUT", "--text", "no/such.txt"], "--text: no such file"),
    (["train", "--config", "vla", "--output", "OUT", "--steps", "many"], "invalid int value: 'many'"),
    (["generate", "no/such/folder"], "no such folder"),
    (["generate", "HERE", "--greedy", "--temperature", "0.5"], "not allowed with argument"),
    (["card", "HERE"], "has no config.json"),
])
def test_bad_arguments_give_a_clear_message_and_a_nonzero_status(argv, message, capsys, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else str(tmp_path) if a == "HERE" else a for a in argv]
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert message in err, err


def test_bad_metrics_json(tiny_text, tmp_path, capsys):
    config = lazoo.MODEL_CLASSES["lazoo_linear"][0](vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    code, _, err = run(capsys, "card", str(tmp_path), "--metrics", "{not json")
    assert code == 2 and "--metrics: not valid JSON" in err
    code, _, err = run(capsys, "card", str(tmp_path), "--metrics", "[1, 2]")
    assert code == 2 and "must be a JSON object" in err


def test_train_refuses_a_bad_config_file_and_a_too_short_text(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 32}')
    code, _, err = run(capsys, "train", "--config", str(bad), "--output", str(tmp_path / "o"))
    assert code == 2 and "has no 'model_type'" in err
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.")
    code, _, err = run(capsys, "train", "--config", "linear", "--output", str(tmp_path / "o"), "--text", str(short),
                       "--seq-len", "64", *TINY)
    assert code == 2 and "give a longer text" in err and "--seq-len" in err
