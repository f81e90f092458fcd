"""Bad input to the `lazoo` command line: each case exits with status 2 and one line that names the
problem, never a traceback or a question on the terminal (empty or binary text, non-finite numbers, a missing
folder, a config.json with a model type nobody knows)."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)

from lazoo import cli

pytestmark = pytest.mark.usefixtures("single_thread")


TRAIN = ["train", "--config", "sw-vla", "--output", "OUT", "--steps", "2", "--seq-len", "32", "--batch-size", "4",
         "--eval-blocks", "2", "--threads", "1", "--no-progress", "--hidden-size", "32", "--layers", "2", "--heads",
         "2", "--vocab-size", "300"]
LAZOO_TYPES = "lazoo_vla"  # one of the known types the message must list

#: files the cases refer to by name (bytes)
FILES = {
    "empty.txt": b"",
    "blank.txt": b"\n\n   \n\n",
    "binary.txt": bytes(range(256)) * 8,
    "latin1.txt": "caf\xe9 au lait\n\nun autre paragraphe\n".encode("latin-1"),
    "bad.jsonl": b'{"text": "fine"}\n{"text": broken\n',
    "notext.jsonl": b'{"body": "no text field"}\n',
    "bogus.json": json.dumps({"model_type": "lazoo_bogus", "hidden_size": 32}).encode(),
}

CASES = [  # (argv, text the single error line must contain)
    (TRAIN + ["--text", "empty.txt"], "empty.txt is empty"),
    (TRAIN + ["--text", "blank.txt"], "blank.txt holds no text"),
    (TRAIN + ["--text", "binary.txt"], "binary.txt is not a text file"),
    (TRAIN + ["--text", "latin1.txt"], "latin1.txt is not UTF-8 text"),
    (TRAIN + ["--text", "bad.jsonl"], "bad.jsonl is not valid JSON lines"),
    (TRAIN + ["--text", "notext.jsonl"], "has no 'text' field"),
    (TRAIN + ["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (TRAIN + ["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (TRAIN + ["--lr=-1e-3"], "--lr must be a positive finite number"),
    (TRAIN + ["--threads", "0"], "--threads must be a positive number"),
    (TRAIN + ["--seed", "-1"], "--seed must be >= 0"),
    (TRAIN + ["--resume"], "--resume: no checkpoint-N folder"),
    (["train", "--config", "bogus.json", "--output", "OUT"], "model_type 'lazoo_bogus' is not a lazoo language model"),
    (["eval", "nowhere"], "model folder 'nowhere' does not exist"),
    (["eval", "BOGUS"], "model_type 'lazoo_bogus'"),
    (["generate", "BOGUS"], "model_type 'lazoo_bogus'"),
    (["card", "BOGUS"], "model_type 'lazoo_bogus'"),
    (["generate", "MODEL", "--temperature", "nan"], "--temperature must be a positive finite number"),
    (["generate", "MODEL", "--top-k", "-1"], "--top-k must be >= 0"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tokenizer):
    """The FILES, a saved model with its tokenizer (MODEL), and a copy whose config.json names an unknown model
    type but keeps lazoo's auto_map (BOGUS: transformers would offer to run its code)."""
    root = tmp_path_factory.mktemp("cli_errors")
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    model = root / "model"
    tiny_model("linear", vocab_size=len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    bogus = root / "bogus"
    tiny_model("linear", vocab_size=len(tokenizer)).save_pretrained(bogus)
    tokenizer.save_pretrained(bogus)
    config = json.loads((bogus / "config.json").read_text())
    assert config["auto_map"]
    (bogus / "config.json").write_text(json.dumps({**config, "model_type": "lazoo_bogus"}))
    return root


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_clear_line_and_status_2(argv, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    # a question on the terminal would read stdin: make that fail loudly instead of waiting
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("the command asked a question"))
    names = {"OUT": str(workdir / "out"), "MODEL": str(workdir / "model"), "BOGUS": str(workdir / "bogus")}
    code = cli.main([names.get(a, a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert message in err, err
    # one error line (progress bars of `datasets` may come before it), no traceback
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line.lower()] == [
        err.strip().splitlines()[-1]], err
    assert err.strip().splitlines()[-1].startswith(f"lazoo {argv[0]}: error: "), err
    if "BOGUS" in argv:
        assert LAZOO_TYPES in err  # the known types are listed
    assert not (workdir / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("argv, message", [
    (["eval", "MODEL", "--limit", "nan"], "--limit must be a positive finite number"),
    (["eval", "MODEL", "--max-length", "0"], "--max-length must be positive"),
    (["demo", "--lr", "nan"], "--lr must be a positive finite number"),
    (["demo", "--steps", "0"], "--steps must be a positive number"),
])
def test_bad_options_of_pass_through_commands(argv, message, workdir, capsys):
    code = cli.main([str(workdir / "model") if a == "MODEL" else a for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
