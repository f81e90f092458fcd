"""`lazoo convert` treats its source folder as untrusted input: one row per kind of hostile or broken folder, each
refused with exit status 2 and one line naming the file and the field, nothing read outside the folder, the
destination as it was and no staging folder left beside it, in well under the time a model build takes."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from convert_helpers import (
    check_outcome,
    fla_folder,
    outside_files,
    read_raw,
    recording_opens,
    run_convert,
    snapshot,
    transformers_folder,
    write_raw,
)
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)

pytestmark = pytest.mark.usefixtures("single_thread")

INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00002.safetensors"
#: every refusal comes well before a model of the claimed size could be built
SECONDS = 5.0


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A single-file fla folder (GLA) and a sharded one with an index (Gated DeltaNet + attention layers)."""
    root = tmp_path_factory.mktemp("bases")
    return {"single": fla_folder(root / "single", "gla"),
            "sharded": fla_folder(root / "sharded", "gated_deltanet+attn", shards=2)}


# ----------------------------------------------------------------------------- ways to break a folder
def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def edit_config(**fields):
    def change(src, outside, dst, monkeypatch):
        edit_json(src / "config.json", lambda cfg: cfg.update(fields))
    return change


def drop_config_field(field):
    def change(src, outside, dst, monkeypatch):
        edit_json(src / "config.json", lambda cfg: cfg.pop(field))
    return change


def edit_attn(attn):
    return edit_config(attn=attn)


def point_index_at(file_of):
    """The index places model.norm.weight in the file `file_of(outside)` names."""
    def change(src, outside, dst, monkeypatch):
        edit_json(src / INDEX, lambda index: index["weight_map"].update({"model.norm.weight": file_of(outside)}))
    return change


def link_out(name, target):
    """`name` in the folder becomes a symbolic link to file `target` of the outside folder."""
    def change(src, outside, dst, monkeypatch):
        (src / name).unlink(missing_ok=True)
        (src / name).symlink_to(outside / target)
    return change


def config_outside(src, outside, dst, monkeypatch):
    shutil.copy(src / "config.json", outside / "config.json")
    link_out("config.json", "config.json")(src, outside, dst, monkeypatch)


def set_element(tensor_name, value):
    """One element of a tensor of model.safetensors set to `value`, the file otherwise intact."""
    def change(src, outside, dst, monkeypatch):
        header, data = read_raw(src / "model.safetensors")
        start = header[tensor_name]["data_offsets"][0]
        data = data[:start] + torch.tensor([value], dtype=torch.float32).numpy().tobytes() + data[start + 4:]
        write_raw(src / "model.safetensors", header, data)
    return change


def edit_header(tensor_name, change_entry):
    """`change_entry` applied to the header entry of a tensor of model.safetensors, the data intact."""
    def change(src, outside, dst, monkeypatch):
        header, data = read_raw(src / "model.safetensors")
        change_entry(header[tensor_name])
        write_raw(src / "model.safetensors", header, data)
    return change


def rewrite_bytes(name, rewrite):
    def change(src, outside, dst, monkeypatch):
        (src / name).write_bytes(rewrite((src / name).read_bytes()))
    return change


def make_pipe(name):
    """`name` in the folder becomes a named pipe (reading it would block)."""
    def change(src, outside, dst, monkeypatch):
        (src / name).unlink(missing_ok=True)
        os.mkfifo(src / name)
    return change


def refuse_open(name, error):
    """Python's `open` of `name` in the folder fails with `error` (an unreadable file, where the tests run as
    root and permissions would not stop them)."""
    def change(src, outside, dst, monkeypatch):
        import builtins

        real_open, target = builtins.open, (src / name).resolve()

        def open_(file, *args, **kwargs):
            if isinstance(file, (str, Path)) and Path(file).resolve() == target:
                raise error
            return real_open(file, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", open_)
    return change


def fail_save(error):
    """Saving the model writes part of a file, then fails with `error` (a full disk)."""
    def change(src, outside, dst, monkeypatch):
        from transformers import PreTrainedModel

        def save_pretrained(self, folder, *args, **kwargs):
            Path(folder, "model.safetensors").write_bytes(b"partial")
            raise error
        monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    return change


def fail_staging(error):
    """Creating the staging folder beside the destination fails with `error`."""
    def change(src, outside, dst, monkeypatch):
        import tempfile

        def mkdtemp(*args, **kwargs):
            raise error
        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return change


def dst_links_elsewhere(src, outside, dst, monkeypatch):
    (outside / "elsewhere").mkdir()
    dst.symlink_to(outside / "elsewhere")


def safetensors_error(message):
    from safetensors import SafetensorError

    return SafetensorError(message)


UP = "model.layers.0.mlp.up_proj.weight"
NESTED = b'{"model_type": "gla", "attn": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

# (id, base folder, change, words the error line must hold: the file and the field)
ROWS = [
    # files resolve inside the source folder only
    ("index-entry-with-dotdot", "sharded", point_index_at(lambda out: "../outside/outside.safetensors"),
     [INDEX, "../outside/outside.safetensors", "outside the checkpoint folder"]),
    ("index-entry-absolute", "sharded", point_index_at(lambda out: str(out / "outside.safetensors")),
     [INDEX, "outside.safetensors", "outside the checkpoint folder"]),
    ("weights-link-out", "single", link_out("model.safetensors", "outside.safetensors"),
     ["model.safetensors", "symbolic link"]),
    ("tokenizer-link-out", "single", link_out("tokenizer.json", "secret.json"), ["tokenizer.json", "symbolic link"]),
    ("config-link-out", "single", config_outside, ["config.json", "symbolic link"]),
    # weights that are not finite
    ("nan-weight", "single", set_element(UP, float("nan")), ["model.safetensors", UP, "NaN"]),
    ("inf-weight", "single", set_element("model.embeddings.weight", float("inf")),
     ["model.safetensors", "model.embeddings.weight", "infinite"]),
    # claims the files do not back, checked before any model is built
    ("a-million-layers", "single", edit_config(num_hidden_layers=1_000_000), ["config.json", "num_hidden_layers"]),
    ("more-layers-than-the-files", "single", edit_config(num_hidden_layers=1000),
     ["config.json", "num_hidden_layers = 1000", "2 layers"]),
    ("huge-vocabulary", "single", edit_config(vocab_size=10**9), ["config.json", "vocab_size = 1000000000"]),
    ("huge-hidden-size", "single", edit_config(hidden_size=10**6), ["config.json", "hidden_size = 1000000"]),
    # malformed files and values
    ("truncated-weights", "single", rewrite_bytes("model.safetensors", lambda b: b[:len(b) // 2]),
     ["model.safetensors", "truncated"]),
    ("empty-weights", "single", rewrite_bytes("model.safetensors", lambda b: b""), ["model.safetensors"]),
    ("corrupt-header", "single", rewrite_bytes("model.safetensors", lambda b: b[:8] + b"\x00garbage" + b[16:]),
     ["model.safetensors", "header"]),
    ("header-length-past-the-file", "single",
     rewrite_bytes("model.safetensors", lambda b: (2**60).to_bytes(8, "little") + b[8:]),
     ["model.safetensors", "header length"]),
    ("shape-of-another-tensor", "single", edit_header(UP, lambda entry: entry.update(shape=[32, 48])),
     ["model.safetensors", UP, "shape"]),
    ("integer-dtype", "single", edit_header(UP, lambda entry: entry.update(dtype="I32")),
     ["model.safetensors", UP, "dtype"]),
    ("dtype-without-its-bytes", "single", edit_header(UP, lambda entry: entry.update(dtype="F16")),
     ["model.safetensors", UP, "bytes"]),
    ("header-entry-without-dtype", "single", edit_header(UP, lambda entry: entry.pop("dtype")),
     ["model.safetensors", UP, "dtype"]),
    ("zero-hidden-size", "single", edit_config(hidden_size=0), ["config.json", "'hidden_size'"]),
    ("head-dim-rounds-to-zero", "single", edit_config(expand_k=0.001), ["config.json", "'expand_k'"]),
    ("nan-expand-v", "single", edit_config(expand_v=float("nan")), ["config.json", "'expand_v'"]),
    ("attn-a-string", "sharded", edit_attn("softmax"), ["config.json", "'attn'"]),
    ("attn-layer-out-of-range", "sharded", edit_attn({"layers": [7], "num_heads": 4}),
     ["config.json", "'attn.layers'"]),
    ("attn-heads-a-string", "sharded", edit_attn({"layers": [1], "num_heads": "4"}),
     ["config.json", "'attn.num_heads'"]),
    ("attn-without-heads", "sharded", edit_attn({"layers": [1]}), ["config.json", "'attn'"]),
    ("config-not-utf8", "single", rewrite_bytes("config.json", lambda b: b[:-1] + b' "x": "\xff\xfe"}'),
     ["config.json", "UTF-8"]),
    ("config-nested-deeply", "single", rewrite_bytes("config.json", lambda b: NESTED), ["config.json", "nested"]),
    ("index-not-json", "sharded", rewrite_bytes(INDEX, lambda b: b"{not json"), [INDEX, "not valid JSON"]),
    ("index-weight-map-a-list", "sharded", rewrite_bytes(INDEX, lambda b: b'{"weight_map": []}'),
     [INDEX, "weight_map"]),
    ("tokenizer-file-a-pipe", "single", make_pipe("tokenizer_config.json"),
     ["tokenizer_config.json", "not a regular file"]),
    ("config-unreadable", "single", refuse_open("config.json", PermissionError(errno.EACCES, "Permission denied")),
     ["permission denied reading", "config.json"]),
    ("weights-unreadable", "single",
     refuse_open("model.safetensors", PermissionError(errno.EACCES, "Permission denied")),
     ["permission denied reading", "model.safetensors"]),
    ("disk-full", "single", fail_save(OSError(errno.ENOSPC, "No space left on device")),
     ["no space left on device writing", "/out"]),
    ("disk-full-in-safetensors", "single",
     fail_save(safetensors_error("Error while serializing: I/O error: No space left on device (os error 28)")),
     ["no space left on device writing", "/out"]),
    ("read-only-destination", "single", fail_staging(OSError(errno.EROFS, "Read-only file system")),
     ["read-only file system writing", "/out"]),
    ("destination-not-writable", "single", fail_staging(PermissionError(errno.EACCES, "Permission denied")),
     ["permission denied writing", "/out"]),
    ("destination-a-symlink", "single", dst_links_elsewhere, ["/out", "symbolic link"]),
    # config values of the wrong kind, and missing ones
    ("hidden-size-a-string", "single", edit_config(hidden_size="32"), ["config.json", "'hidden_size'"]),
    ("num-heads-a-bool", "single", edit_config(num_heads=True), ["config.json", "'num_heads'"]),
    ("negative-layer-count", "single", edit_config(num_hidden_layers=-2), ["config.json", "'num_hidden_layers'"]),
    ("nan-norm-eps", "single", edit_config(norm_eps=float("nan")), ["config.json", "'norm_eps'"]),
    *[(f"missing-{field}", "single", drop_config_field(field), ["config.json", f"'{field}'", "missing"])
      for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads")],
]


@pytest.mark.parametrize("base, change, words", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_an_untrusted_folder_is_refused_in_one_line_naming_the_file_and_field(base, change, words, bases, tmp_path,
                                                                               monkeypatch, capfd):
    src, outside, dst = tmp_path / "src", tmp_path / "outside", tmp_path / "out"
    shutil.copytree(bases[base], src)
    outside_files(outside, like=sorted(src.glob("*.safetensors"))[0])
    change(src, outside, dst, monkeypatch)
    before = snapshot(dst)
    with recording_opens(outside) as opened:
        status, err, seconds = run_convert(src, dst, capfd)
    monkeypatch.undo()
    assert status == 2, err
    check_outcome(status, err, dst, before)
    for word in words:
        assert word in err[0], (word, err[0])
    assert not opened, opened
    assert seconds < SECONDS
    if (outside / "elsewhere").exists():
        assert not os.listdir(outside / "elsewhere")  # nothing written through the link


def test_a_sound_folder_still_converts(bases, tmp_path, capfd):
    for base in bases.values():
        dst = tmp_path / base.name
        status, err, _ = run_convert(base, dst, capfd)
        assert status == 0, err
        check_outcome(status, err, dst, None)


def test_a_link_that_stays_inside_the_folder_is_followed(bases, tmp_path, capfd):
    src = tmp_path / "src"
    shutil.copytree(bases["single"], src)
    (src / "weights").mkdir()
    (src / "model.safetensors").rename(src / "weights" / "model.safetensors")
    (src / "model.safetensors").symlink_to(Path("weights") / "model.safetensors")
    status, err, _ = run_convert(src, tmp_path / "out", capfd)
    assert status == 0, err


def test_a_transformers_folder_of_another_model_type_is_refused_by_its_model_type(tmp_path, capfd):
    kind = "llama"
    src = transformers_folder(tmp_path / kind, kind)
    status, err, _ = run_convert(src, tmp_path / "out", capfd)
    check_outcome(status, err, tmp_path / "out", None)
    assert status == 2 and "'model_type'" in err[0] and "config.json" in err[0], err
