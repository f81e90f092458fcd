"""`lazoo convert` over hundreds of mutated fla and transformers folders (a seeded generator: every run makes the
same cases): truncated, bit-flipped, renamed, deleted and symlinked files, oversized and junk config values, edited
index files, swapped dtypes, shapes and names in safetensors headers, NaN weights, junk JSON, and destinations that
exist, are files or are links. Every conversion must end in exit status 0 with a folder that loads with finite
weights, or exit status 2 with one error line and the destination as it was; never a traceback, never a read of
the files outside the source folder that mutations point at, never a staging folder left behind, each in a few
seconds at most, and the process's peak memory bounded."""

from __future__ import annotations

import functools
import json
import random
import resource
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from convert_helpers import (
    check_outcome,
    fla_folder,
    outside_files,
    qwen3_5_available,
    read_raw,
    recording_opens,
    run_convert,
    snapshot,
    transformers_folder,
    write_raw,
)
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = 500  # the default run; the slow run adds SLOW_CASES more
SLOW_CASES = 3000
SECONDS = 5.0  # per conversion: far below what building a model of an oversized claim takes
RSS_GROWTH_MB = 1024  # the process's peak memory may grow by this much over a whole run


# ----------------------------------------------------------------------------- the folders mutated
@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """fla folders of each model type (one sharded, one in bfloat16), a Llama folder (refused) and a Qwen3.5 one."""
    root = tmp_path_factory.mktemp("bases")
    folders = {"gla": fla_folder(root / "gla", "gla"),
               "gdn-sharded": fla_folder(root / "gdn-sharded", "gated_deltanet+attn", shards=2),
               "transformer": fla_folder(root / "transformer", "transformer"),
               "llama": transformers_folder(root / "llama", "llama")}
    delta = fla_folder(root / "delta-bf16", "delta_net")
    resave(delta / "model.safetensors", lambda tensors: {k: v.bfloat16() for k, v in tensors.items()})
    folders["delta-bf16"] = delta
    if qwen3_5_available():
        folders["qwen3_5"] = transformers_folder(root / "qwen3_5", "qwen3_5")
    return folders


@pytest.fixture(scope="module")
def export_once():
    """lazoo's trust_remote_code export, computed once for each set of mechanisms (it parses lazoo's sources: most
    of a tiny conversion's time); the files written are the same."""
    from lazoo.models import export

    patch = pytest.MonkeyPatch()
    memo = functools.cache(export.exported_sources)
    patch.setattr(export, "exported_sources", lambda names=(), entries=tuple(export.LANGUAGE_ENTRIES):
                  dict(memo(tuple(names), tuple(entries))))
    yield
    patch.undo()


# ----------------------------------------------------------------------------- mutations
class Case:
    """One mutated source folder: `src`, the files outside it (`outside`), the destination `dst`, the generator."""

    def __init__(self, root: Path, outside: Path, rng: random.Random):
        self.src, self.outside, self.dst, self.rng = root / "src", outside, root / "out", rng

    def files(self, pattern="*") -> list[Path]:
        return sorted(p for p in self.src.glob(pattern) if p.is_file() and not p.is_symlink())

    def pick(self, options):
        return options[self.rng.randrange(len(options))]


def resave(path: Path, change) -> None:
    """A safetensors file re-saved (consistent) with `change` applied to its {name: tensor}."""
    from safetensors.torch import load_file

    save_file({k: v.contiguous() for k, v in change(load_file(str(path))).items()}, str(path))


def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def truncate(case: Case) -> str:
    file = case.pick(case.files())
    data = file.read_bytes()
    file.write_bytes(data[:case.rng.randrange(len(data) + 1)])
    return f"truncate {file.name}"


def flip_bits(case: Case) -> str:
    file = case.pick(case.files())
    data = bytearray(file.read_bytes())
    if not data:
        return "flip nothing"
    in_header = file.suffix == ".safetensors" and case.rng.random() < 0.5
    end = min(len(data), 8 + int.from_bytes(data[:8], "little")) if in_header else len(data)
    for _ in range(case.rng.randint(1, 8)):
        data[case.rng.randrange(end)] ^= 1 << case.rng.randrange(8)
    file.write_bytes(bytes(data))
    return f"flip bits of {file.name}{' (header)' if in_header else ''}"


def rename(case: Case) -> str:
    file = case.pick(case.files())
    names = [p.name for p in case.files()] + ["model.bin", "config.jsn", "tokenizer.json", "model.safetensors",
                                              "model.safetensors.index.json", "sub/config.json"]
    target = case.src / case.pick(names)
    target.parent.mkdir(exist_ok=True)
    file.replace(target)
    return f"rename {file.name} -> {target.relative_to(case.src)}"


def delete(case: Case) -> str:
    file = case.pick(case.files())
    file.unlink()
    return f"delete {file.name}"


def link_out(case: Case) -> str:
    """A file of the folder (or a tokenizer file it lacks) becomes a link to a file outside it."""
    name = case.pick([p.name for p in case.files()] + ["tokenizer.json", "generation_config.json"])
    target = case.outside / case.pick(["outside.safetensors", "secret.txt", "secret.json"])
    link = case.src / name
    link.unlink(missing_ok=True)
    link.symlink_to(target if case.rng.random() < 0.5 else Path("..") / ".." / target.relative_to(case.src.parents[1]))
    return f"link {name} -> {target.name} (outside)"


def link_inside(case: Case) -> str:
    """A link that stays inside (to another file, dangling, or a loop)."""
    name = case.pick([p.name for p in case.files()] + ["tokenizer.json"])
    link = case.src / name
    link.unlink(missing_ok=True)
    kind = case.pick(["other", "dangling", "loop", "folder"])
    if kind == "other":
        link.symlink_to(case.pick([p.name for p in case.files()] or ["nothing"]))
    elif kind == "dangling":
        link.symlink_to("nowhere.bin")
    elif kind == "loop":
        link.symlink_to(name + ".b")
        (case.src / (name + ".b")).symlink_to(name)
    else:
        link.symlink_to(".")
    return f"link {name} ({kind}, inside)"


def config_fields(case: Case) -> dict:
    value = json.loads((case.src / "config.json").read_text())
    return value if isinstance(value, dict) else {}


SIZE_FIELDS = ["num_hidden_layers", "vocab_size", "hidden_size", "num_heads", "intermediate_size", "head_dim",
               "conv_size", "num_kv_heads", "num_v_heads", "max_position_embeddings", "window_size", "hidden_ratio",
               "expand_k", "expand_v"]


def editable(path: Path) -> bool:
    """A file of the folder itself (a mutation never writes through a link: the files outside stay intact)."""
    return path.is_file() and not path.is_symlink()


def set_config(case: Case, field: str, value) -> str:
    if not editable(case.src / "config.json"):
        return "no config to edit"
    edit_json(case.src / "config.json", lambda cfg: cfg.__setitem__(field, value))
    return f"config {field} = {str(value)[:40]}"


def oversize(case: Case) -> str:
    value = case.pick([1000, 10**6, 10**9, 2**31, 2**40, 10**18, 2**63, 10**30])
    return set_config(case, case.pick(SIZE_FIELDS), value)


JUNK_VALUES = ["32", True, False, -1, 0, float("nan"), float("inf"), -float("inf"), None, [], {}, [1, 2], {"a": 1},
               1.5, 0.001, "x" * 5000, "swish", [[[[[]]]]]]


def junk_value(case: Case) -> str:
    fields = list(config_fields(case)) or ["vocab_size"]
    return set_config(case, case.pick(fields + SIZE_FIELDS + ["model_type", "attn", "tie_word_embeddings",
                                                              "eos_token_id", "norm_eps"]), case.pick(JUNK_VALUES))


def drop_field(case: Case) -> str:
    fields = list(config_fields(case))
    if not fields or not editable(case.src / "config.json"):
        return "no field to drop"
    field = case.pick(fields)
    edit_json(case.src / "config.json", lambda cfg: cfg.pop(field))
    return f"drop config {field}"


def model_type(case: Case) -> str:
    return set_config(case, "model_type", case.pick(["llama", "qwen3_5", "qwen3_5_text", "GLA", "", None, 5,
                                                     ["gla"], "transformer", "gla", "delta_net", "gated_deltanet"]))


def junk_attn(case: Case) -> str:
    return set_config(case, "attn", case.pick([
        "softmax", 3, [], [1], {"layers": [1]}, {"layers": [99], "num_heads": 2}, {"layers": 1, "num_heads": 2},
        {"layers": [0], "num_heads": 0}, {"layers": [0], "num_heads": 3}, {"layers": [-1], "num_heads": 2},
        {"layers": [0], "num_heads": 2, "window_size": -4}, {"layers": [0], "num_heads": 2, "rope_theta": "x"},
        {"layers": [True], "num_heads": 2}, [{"layers": [0], "num_heads": 2}, "x"]]))


def edit_index(case: Case) -> str:
    index = case.src / "model.safetensors.index.json"
    entry = case.pick(["../outside/outside.safetensors", str(case.outside / "outside.safetensors"),
                       "missing.safetensors", ".", "", "/etc/passwd", "sub/../x.safetensors", 5, None,
                       "model.safetensors", "./" + case.pick(["model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors"])])
    if index.is_symlink():
        return "index is a link"
    if not index.is_file():  # a folder without an index gets one that points at the entry
        index.write_text(json.dumps({"weight_map": {"model.norm.weight": entry}}))
        return f"new index -> {entry}"
    edit_json(index, lambda value: value["weight_map"].update({case.pick(sorted(value["weight_map"])): entry}))
    return f"index entry -> {entry}"


def header_entry(case: Case, change) -> str:
    """`change(header, name)` applied to a random tensor of a random safetensors file, the data intact."""
    files = case.files("*.safetensors")
    if not files:
        return "no weights"
    file = case.pick(files)
    header, data = read_raw(file)
    name = case.pick(sorted(k for k in header if k != "__metadata__"))
    what = change(header, name)
    write_raw(file, header, data)
    return f"{file.name}: {name} {what}"


def swap_dtype(case: Case) -> str:
    dtype = case.pick(["F16", "BF16", "F64", "I32", "I8", "BOOL", "U8", "F8_E4M3", "X", 3])

    def change(header, name):
        header[name]["dtype"] = dtype
        return f"dtype -> {dtype}"
    return header_entry(case, change)


def swap_shape(case: Case) -> str:
    def change(header, name):
        shape = header[name]["shape"]
        new = case.pick([shape[::-1], [d + 1 for d in shape], [], [0], [-1], [2.0], "x", shape + [1], [2**40, 2**40]])
        header[name]["shape"] = new
        return f"shape {shape} -> {new}"
    return header_entry(case, change)


def shift_offsets(case: Case) -> str:
    def change(header, name):
        begin, end = header[name]["data_offsets"]
        shift = case.pick([1, -1, 2**40, -(2**40), end])
        header[name]["data_offsets"] = [begin + shift, end + shift]
        return f"offsets shifted {shift}"
    return header_entry(case, change)


def rename_tensor(case: Case) -> str:
    def change(header, name):
        new = case.pick(["model.layers.01.mlp.up_proj.weight", "model.layers.99999999999999.mlp.up_proj.weight",
                         "../x", "model.layers.1e3.attn.q_proj.weight", "lm_head.weight", "model.norm.weight",
                         "model.layers.0.attn.g_norm.weight", "model.embeddings.weight", "x" * 1000])
        header[new] = header.pop(name)
        return f"renamed {new[:40]}"
    return header_entry(case, change)


def resave_one(case: Case, change) -> str:
    """`change` applied to the tensors of a random safetensors file of the folder, re-saved (consistent): the
    file's name, or why there was none."""
    files = case.files("*.safetensors")
    if not files:
        return "no weights"
    file = case.pick(files)
    resave(file, change)
    return file.name


def bad_values(case: Case) -> str:
    """A tensor re-saved with a NaN or an infinity in it, or in another float dtype."""
    value = case.pick([float("nan"), float("inf"), -float("inf"), "float16", "float64", "bfloat16"])

    def change(tensors):
        name = case.pick(sorted(tensors))
        if isinstance(value, str):
            tensors[name] = tensors[name].to(getattr(torch, value))
        elif tensors[name].numel():
            flat = tensors[name].clone().reshape(-1)
            flat[case.rng.randrange(flat.numel())] = value
            tensors[name] = flat.reshape(tensors[name].shape)
        return tensors
    return f"{resave_one(case, change)}: a tensor gets {value}"


def tensors_added_or_removed(case: Case) -> str:
    add = case.rng.random() < 0.5

    def change(tensors):
        if add:
            tensors[case.pick(["model.layers.2.mlp.up_proj.weight", "extra", "model.layers.0.attn.new.weight"])] = (
                torch.zeros(3, 4))
        else:
            tensors.pop(case.pick(sorted(tensors)))
        return tensors
    return f"{resave_one(case, change)}: a tensor {'added' if add else 'removed'}"


JUNK_JSON = [b"", b"[]", b"null", b"{", b"\xff\xfe\x00{}", b"{" * 5 + b"}" * 5, b'{"a": NaN}',
             b'{"model_type": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", b"1" * 5000,
             b'{"model_type": "gla", "vocab_size": 1' + b"0" * 5000 + b"}", b'{"weight_map": {"a": 1}}',
             b'{"x": "' + b"y" * (2 << 20) + b'"}']


def junk_json(case: Case) -> str:
    name = case.pick(["config.json", "config.json", "model.safetensors.index.json", "tokenizer_config.json",
                      "generation_config.json", "tokenizer.json"])
    blob = case.pick(JUNK_JSON) if case.rng.random() < 0.8 else bytes(case.rng.randrange(256) for _ in range(64))
    (case.src / name).unlink(missing_ok=True)  # a link is replaced, never written through
    (case.src / name).write_bytes(blob)
    return f"junk {name} ({len(blob)} bytes)"


def destination(case: Case) -> str:
    """The destination exists beforehand: an empty folder (fine), a folder with a file, a file, a link."""
    kind = case.pick(["empty", "full", "file", "link", "dangling", "parent-file"])
    if kind == "empty":
        case.dst.mkdir()
    elif kind == "full":
        case.dst.mkdir()
        (case.dst / "notes.txt").write_text("mine")
    elif kind == "file":
        case.dst.write_text("mine")
    elif kind == "link":
        (case.dst.parent / "elsewhere").mkdir()
        case.dst.symlink_to(case.dst.parent / "elsewhere")
    elif kind == "dangling":
        case.dst.symlink_to(case.dst.parent / "nowhere")
    else:
        (case.dst.parent / "a-file").write_text("mine")
        case.dst = case.dst.parent / "a-file" / "out"
    return f"destination {kind}"


MUTATIONS = [truncate, flip_bits, rename, delete, link_out, link_inside, oversize, oversize, junk_value, junk_value,
             drop_field, model_type, junk_attn, edit_index, edit_index, swap_dtype, swap_shape, shift_offsets,
             rename_tensor, bad_values, tensors_added_or_removed, junk_json, destination]


# ----------------------------------------------------------------------------- the run
def apply(mutation, case: Case) -> str:
    """`mutation(case)`: what it did, or that the folder was too broken (by an earlier one) to apply it."""
    try:
        return mutation(case)
    except Exception as err:  # noqa: BLE001 - the folder stays as the earlier mutations left it
        return f"{mutation.__name__} not applied ({type(err).__name__})"


def run_case(seed: int, bases: dict, outside: Path, root: Path, capfd) -> tuple[int | None, str | None]:
    """Mutate a copy of a base folder as `seed` says, convert it, check the outcome: the exit status and a
    description of what went wrong (None: nothing)."""
    rng = random.Random(seed)
    base = rng.choice(sorted(bases))
    case = Case(root / f"case-{seed}", outside, rng)
    shutil.copytree(bases[base], case.src, symlinks=True)
    done = [apply(mutation, case) for mutation in rng.sample(MUTATIONS, rng.choice([0, 1, 1, 1, 2, 2, 3]))]
    where = f"case {seed} ({base}: {'; '.join(done) or 'unchanged'})"
    before, status = snapshot(case.dst), None
    try:
        with recording_opens(outside) as opened:
            status, err, seconds = run_convert(case.src, case.dst, capfd)
        check_outcome(status, err, case.dst, before)
        assert not opened, f"read outside the source folder: {opened}"
        assert seconds < SECONDS, f"took {seconds:.1f} s"
        if base == "llama":
            assert status == 2, "a Llama folder converted"
        elsewhere = case.src.parent / "elsewhere"
        assert not elsewhere.exists() or not any(elsewhere.iterdir()), "written through the destination's link"
    except Exception:  # noqa: BLE001 - collected: the report lists every failing case
        return status, f"{where}: {traceback.format_exc(limit=-3)}"
    finally:
        shutil.rmtree(case.src.parent, ignore_errors=True)
    return status, None


def fuzz(seeds, bases, tmp_path, capfd) -> None:
    outside = outside_files(tmp_path / "outside", like=bases["gla"] / "model.safetensors")
    outside_before = {p.name: p.read_bytes() for p in outside.iterdir()}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = [run_case(seed, bases, outside, tmp_path, capfd) for seed in seeds]
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    failures = [failure for _, failure in results if failure is not None]
    assert not failures, f"{len(failures)} of {len(seeds)} cases failed:\n" + "\n".join(failures[:10])
    converted = sum(status == 0 for status, _ in results)
    assert len(seeds) // 20 <= converted < len(seeds) // 2, converted  # both outcomes, refusals the most
    assert growth_mb < RSS_GROWTH_MB, f"peak memory grew by {growth_mb:.0f} MB"
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == outside_before


def test_lazoo_convert_survives_mutated_folders(bases, export_once, tmp_path, capfd):
    fuzz(range(CASES), bases, tmp_path, capfd)


@pytest.mark.slow
def test_lazoo_convert_survives_many_more_mutated_folders(bases, export_once, tmp_path, capfd):
    fuzz(range(CASES, CASES + SLOW_CASES), bases, tmp_path, capfd)
