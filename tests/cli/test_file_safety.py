"""Files a user made survive lazoo: `lazoo train` into a folder holding the user's checkpoint-7,
README.md or code, `lazoo card`, `lazoo eval --output` and `save_pretrained` into a folder holding the user's
modeling_lazoo.py leave them byte-identical, refusing before any work with a message that names the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import tiny_model

from lazoo import cli
from lazoo.models.card import CARD_MARKER, is_lazoo_card, write_model_card
from lazoo.models.export import EXPORT_HEADER

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "300", "--sliding-window", "8"]
THESIS = b"chapter 1: nothing here may be lost\n" * 50


def train_argv(text, out, *extra):
    return ["train", "--config", "sw-vla", "--output", str(out), "--text", str(text), "--steps", "2",
            "--seq-len", "32", "--batch-size", "4", "--eval-blocks", "2", "--save-steps", "1",
            "--save-total-limit", "1", "--threads", "1", "--no-progress", *TINY, *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run(capsys, argv):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:80]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def earlier_run(text, tmp_path_factory):
    """A folder `lazoo train` wrote: tokenizer, checkpoint-2, model, card (what --resume goes on from)."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    assert cli.main(train_argv(text, out)) == 0
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and is_lazoo_card(out / "README.md")
    return out


#: a user's files in the output folder -> each is refused with or without --resume / --overwrite
USER_FILES = {
    "checkpoint": {"checkpoint-7/sub/thesis.txt": THESIS},
    "readme": {"README.md": b"# My model\nmy own notes\n"},
    "code": {"modeling_lazoo.py": b"print('my own modeling code')\n"},
}
CASES = [  # (user files, extra flags, text the error names)
    ("checkpoint", [], "checkpoint-7"),
    ("checkpoint", ["--resume"], "checkpoint-7"),
    ("checkpoint", ["--overwrite"], "checkpoint-7"),
    ("readme", [], "README.md"),
    ("readme", ["--resume"], "README.md"),
    ("code", [], "modeling_lazoo.py"),
    ("code", ["--resume"], "modeling_lazoo.py"),
    ("code", ["--overwrite"], "modeling_lazoo.py"),
]


@pytest.mark.parametrize("kind, flags, named", CASES, ids=[f"{k}{''.join(f)}" for k, f, _ in CASES])
def test_train_refuses_an_output_folder_with_the_users_files(kind, flags, named, text, earlier_run, tmp_path,
                                                              capsys):
    out = tmp_path / "out"
    out.mkdir()
    if "--resume" in flags:  # an interrupted run's checkpoint and tokenizer, next to the user's file
        shutil.copytree(earlier_run / "checkpoint-2", out / "checkpoint-2")
        for f in earlier_run.glob("tokenizer*"):
            shutil.copy(f, out / f.name)
    for name, data in USER_FILES[kind].items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    before = snapshot(out)
    code, err = run(capsys, train_argv(text, out, *flags))
    assert code == 2 and named in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert snapshot(out) == before


def test_resume_keeps_the_users_other_files_while_checkpoints_rotate(text, earlier_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(earlier_run, out)
    (out / "notes").mkdir()
    (out / "notes" / "thesis.txt").write_bytes(THESIS)
    code, err = run(capsys, train_argv(text, out, "--steps", "4", "--resume"))  # the last --steps counts
    assert code == 0, err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # the run's own, rotated
    assert (out / "notes" / "thesis.txt").read_bytes() == THESIS
    assert is_lazoo_card(out / "README.md")  # the earlier run's card, rewritten


def test_overwrite_replaces_the_users_readme_when_asked(text, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my card\n")
    code, err = run(capsys, train_argv(text, out, "--overwrite"))
    assert code == 0, err
    assert is_lazoo_card(out / "README.md")


# ----------------------------------------------------------------------------- save_pretrained
@pytest.mark.parametrize("name", ["modeling_lazoo.py", "configuration_lazoo.py", "lazoo_ops.py"])
def test_save_pretrained_never_overwrites_the_users_code(name, tmp_path):
    mine = b"# my own code, same name as lazoo's export\nVALUE = 1\n"
    (tmp_path / name).write_bytes(mine)
    with pytest.raises(FileExistsError, match=name):
        tiny_model("linear").save_pretrained(tmp_path)
    assert snapshot(tmp_path) == {name: mine}  # refused before writing anything


def test_save_pretrained_replaces_its_own_export(tmp_path):
    model = tiny_model("linear")
    model.save_pretrained(tmp_path)
    modeling = tmp_path / "modeling_lazoo.py"
    assert modeling.read_text().startswith(EXPORT_HEADER)
    modeling.write_text(modeling.read_text() + "# stale\n")  # an older lazoo export
    model.save_pretrained(tmp_path)
    assert "# stale" not in modeling.read_text()


# ----------------------------------------------------------------------------- cards and eval output
def test_card_keeps_the_users_readme_unless_asked(tmp_path, capsys):
    tiny_model("linear").save_pretrained(tmp_path)
    assert is_lazoo_card(tmp_path / "README.md")
    assert run(capsys, ["card", tmp_path, "--metrics", '{"a": 1}'])[0] == 0  # its own card: rewritten
    (tmp_path / "README.md").write_bytes(b"my card\n")
    code, err = run(capsys, ["card", tmp_path])
    assert code == 2 and "README.md" in err and "--overwrite" in err
    assert (tmp_path / "README.md").read_bytes() == b"my card\n"
    with pytest.raises(FileExistsError, match="README.md"):
        write_model_card(tiny_model("linear"), tmp_path, overwrite=False)
    assert run(capsys, ["card", tmp_path, "--overwrite"])[0] == 0
    assert (tmp_path / "README.md").read_text().rstrip().endswith(CARD_MARKER)


def test_eval_keeps_the_users_output_file(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "model"
    tiny_model("linear", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    results = tmp_path / "results.json"
    results.write_bytes(b"my results\n")
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "mqar.jsonl").write_bytes(b"my data\n")
    for argv, named in [(["--output", results], "results.json"),
                        (["--tasks", "lazoo_mqar", "--task-dir", task_dir], "mqar.jsonl")]:
        code, err = run(capsys, ["eval", model_dir, *argv])
        assert code == 2 and named in err and "--overwrite" in err, err
    assert results.read_bytes() == b"my results\n" and snapshot(task_dir) == {"mqar.jsonl": b"my data\n"}
