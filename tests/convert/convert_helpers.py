"""Helpers of the tests that give `lazoo convert` untrusted folders (tests/convert/test_convert_untrusted.py,
tests/convert/test_convert_fuzz.py): fla folders to break (written as tests/convert/test_convert_fla.py writes
them), raw safetensors editing, files outside the source folder that no conversion may read, and the check every
conversion must pass: exit status 0 with a complete folder that loads with finite weights, or status 2 with one error
line and the destination as it was, no staging folder left beside it."""

from __future__ import annotations

import builtins
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_convert_fla import fla_config, random_fla_checkpoint, write_fla_folder
from transformers import AutoModelForCausalLM

from lazoo.cli import main
from lazoo.models.compat import CACHE_FIELD

#: every element of the tensors outside the source folder (no finite weight of a random checkpoint is this)
SENTINEL = 12345.0
#: the text of the plain files outside the source folder
SECRET = b"a file outside the checkpoint folder\n"


def fla_folder(folder: Path, case: str = "gla", shards: int = 1, seed: int = 0) -> Path:
    """A float32 fla checkpoint folder of tests/convert/test_convert_fla.py's `case`."""
    cfg = fla_config(case)
    write_fla_folder(folder, cfg, random_fla_checkpoint(cfg, seed=seed, dtype=torch.float32), shards=shards)
    return folder


def edit_config(folder: Path, edit) -> None:
    """`edit(config)` on the folder's config.json in place (on its `text_config` where it has one)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config.get("text_config", config))
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, edit) -> None:
    """`edit(tensors)` on the folder's model.safetensors in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def save_with_tokenizer_config(model, folder: Path):
    """`model.save_pretrained(folder)` and a tokenizer_config.json beside it, as published folders have; returns
    the model."""
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    return model


def qwen3_5_available() -> bool:
    import transformers

    return hasattr(transformers, "Qwen3_5ForCausalLM")


def transformers_folder(folder: Path, kind: str) -> Path:
    """A tiny transformers causal LM saved with save_pretrained (a folder lazoo convert must refuse)."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=64)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3_5TextConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
        model = transformers.Qwen3_5ForCausalLM(config)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return folder


def outside_files(folder: Path, like: Path) -> Path:
    """Files a conversion must never read, in `folder`: `outside.safetensors` (every tensor of checkpoint file
    `like`, each filled with SENTINEL) and `secret.txt` / `secret.json` (SECRET)."""
    folder.mkdir(parents=True, exist_ok=True)
    header, _ = read_raw(like)
    tensors = {name: torch.full(info["shape"], SENTINEL) for name, info in header.items() if name != "__metadata__"}
    save_file(tensors, str(folder / "outside.safetensors"))
    (folder / "secret.txt").write_bytes(SECRET)
    (folder / "secret.json").write_bytes(b'{"secret": "' + SECRET.strip() + b'"}')
    return folder


# ----------------------------------------------------------------------------- raw safetensors
def read_raw(path: Path) -> tuple[dict, bytes]:
    """The header (a dict) and the data bytes of a safetensors file."""
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file of `header` and `data` exactly as given (consistent or not)."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


# ----------------------------------------------------------------------------- running and checking
@contextmanager
def recording_opens(watched: Path):
    """The paths under `watched` that Python's `open` is asked for inside the block (a list, filled as it runs)."""
    seen, real_open = [], builtins.open

    def open_(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).resolve().is_relative_to(watched.resolve()):
            seen.append(str(file))
        return real_open(file, *args, **kwargs)

    builtins.open = open_
    try:
        yield seen
    finally:
        builtins.open = real_open


def run_convert(src: Path, dst: Path, capfd) -> tuple[int, list[str], float]:
    """`lazoo convert src dst`: its exit status, the lines it wrote to stderr, and its seconds."""
    capfd.readouterr()
    start = time.perf_counter()
    status = main(["convert", str(src), str(dst)])
    seconds = time.perf_counter() - start
    return status, capfd.readouterr().err.splitlines(), seconds


def snapshot(path: Path):
    """What is at `path`: None, a link and its target, a file's bytes, or a folder's entries."""
    if path.is_symlink():
        return ("link", str(path.readlink()))
    if not path.exists():
        return None
    if path.is_file():
        return ("file", path.read_bytes())
    return ("folder", sorted(p.name for p in path.iterdir()))


def check_outcome(status: int, err: list[str], dst: Path, before) -> None:
    """Exit 0: `dst` loads, with finite weights and nothing from outside the source; exit 2: one error line and
    `dst` as it was. Either way no staging folder beside `dst`."""
    assert status in (0, 2), (status, err)
    if dst.parent.is_dir():
        staging = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
        assert not staging, staging
    if status == 2:
        assert len(err) == 1 and err[0].startswith("lazoo convert: error: "), err
        assert "Traceback" not in err[0]
        assert snapshot(dst) == before
        return
    for file in dst.iterdir():
        assert SECRET.strip() not in file.read_bytes(), file
    model = AutoModelForCausalLM.from_pretrained(dst)
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), name
        assert not (tensor == SENTINEL).any(), name


def refusal_into_a_folder(src: Path, dst: Path, capfd) -> str:
    """`lazoo convert src dst` into an existing empty folder `dst`, which it must refuse (exit 2) leaving `dst` as it
    was: the error line."""
    dst.mkdir()
    before = snapshot(dst)
    status, err, _ = run_convert(src, dst, capfd)
    check_outcome(status, err, dst, before)
    assert status == 2, err
    return err[0]


def generate_in_two_calls(model, ids, mask, kwargs):
    """(16 greedy tokens of one `generate` call, 8 then 8 more from the cache the first call returned, that cache)."""
    with torch.no_grad():
        whole = model.generate(ids, attention_mask=mask, max_new_tokens=16, **kwargs)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, **kwargs)
        cache = getattr(first, CACHE_FIELD)
        longer = torch.cat([mask, torch.ones_like(first.sequences[:, ids.shape[1]:])], dim=1)
        second = model.generate(first.sequences, attention_mask=longer, max_new_tokens=8, **{CACHE_FIELD: cache},
                                **kwargs)
    return whole, second, cache


def check_refused(src: Path, dst: Path, edit, error: type, field: str, capfd) -> None:
    """With `edit(config)` applied to `src`'s config.json, converting into `dst` raises `error` naming `field`, and
    `lazoo convert` exits 2 with one line naming it, leaving `dst` as it was."""
    from lazoo.convert import convert_checkpoint

    edit_config(src, edit)
    try:
        convert_checkpoint(src, dst)
    except error as err:
        assert f"'{field}'" in str(err), err
    else:
        raise AssertionError(f"{src}: converted, though {field!r} should be refused")
    status, err, _ = run_convert(src, dst, capfd)
    check_outcome(status, err, dst, None)
    assert status == 2 and field in err[0], err
