"""fla (flash-linear-attention) checkpoints into lazoo folders.

`from_fla(src, dst)` reads a fla checkpoint folder (`config.json` with a fla `model_type`, safetensors weights,
sharded or not) and writes a lazoo folder: config, weights, the tokenizer files, a model card naming the source,
and lazoo's `trust_remote_code` code. The result loads with `AutoModelForCausalLM.from_pretrained(dst)` after
`import lazoo`, and with `trust_remote_code=True` where lazoo is not installed. The model types: `transformer`,
`gla`, `delta_net`, `gated_deltanet`, `kda` (each with fla's `attn` layers where the config has them); fla's
`mamba2` folders are laid out as transformers' Mamba-2 folders and convert with `lazoo.convert.mamba` (`lazoo
convert` picks it), which tells them apart by the fields only fla writes.

Every config field of the checkpoint is either expressed by a lazoo option (the layer computes the same function)
or changes no math (kernel choice, fused implementations, training losses); anything else is refused with an
`UnsupportedCheckpointError` naming the field, before anything is written. Nothing of fla is imported.

The source folder is untrusted input, and every refusal is a one-line `ConversionError` naming the file and the
field. Files resolve inside the folder only (an index entry with `..` or an absolute name, or a symbolic link that
leads out, is refused by name; `source.SourceFolder`). Config values must be of the kind fla writes (positive
integers for sizes, finite numbers, booleans). Before any model is built or any tensor data read, the safetensors
headers are checked against the files' lengths and the tensors they list against the config: the layer count
first (so a config claiming a million layers is refused at once), then every name and shape against the lazoo
model built on the meta device (no memory). The memory a conversion takes is then bounded by the bytes the
checkpoint really holds. Weights that are NaN or infinite are refused, naming the tensor. The folder is written
into a staging folder beside `dst` and renamed into place; on any failure (a full disk, a read-only or unreadable
folder, reported as such) the staging folder is removed and `dst` stays as it was; a `dst` that is a symbolic link
is refused.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from . import fla_layers
from .fla_layers import ConversionError, UnsupportedCheckpointError, check_fields, malformed, refuse
from .source import SourceFolder, TensorEntry, one_line, os_errno, os_failure, reporting_os_errors

#: fla model type -> the lazoo mechanism of its non-attention layers (None: every layer is attention)
FLA_MODEL_TYPES = {"transformer": None, "gla": "gla", "delta_net": "delta_net", "gated_deltanet": "gated_delta_net",
                   "kda": "kda"}
#: fla model types whose folders are laid out as transformers' of the same type, converted by `lazoo.convert.mamba`
#: (told apart there by the fields only fla writes)
FLA_MAMBA_MODEL_TYPES = ("mamba2",)

#: fields that change no computed function: kernel modes, fused implementations, training-only losses and inits
NO_MATH_FIELDS = {"attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy",
                  "use_l2warp", "initializer_range", "use_cache"}
#: fields every fla language model has, read by `_common_fields`, with the kind of value each holds
#: (fla_layers.KINDS; a trailing "?" allows null)
COMMON_FIELDS = {"model_type": "name", "vocab_size": "count", "hidden_size": "count", "num_hidden_layers": "count",
                 "num_heads": "count", "hidden_ratio": "number?", "intermediate_size": "count?", "hidden_act": "name",
                 "norm_eps": "number", "elementwise_affine": "flag", "tie_word_embeddings": "flag",
                 "max_position_embeddings": "count?", "bos_token_id": "token?", "eos_token_id": "tokens?",
                 "pad_token_id": "token?", "attn": "any", "attnres_block_size": "any"}
#: fields without which no model can be sized
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads")
#: the most layers a converted model may have (published language models have at most a few hundred)
MAX_LAYERS = 1024
#: files copied from the checkpoint as they are (the tokenizer's, and the generation defaults)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
#: a config.json larger than this is refused unread (fla's are a few kilobytes)
MAX_CONFIG_BYTES = 1 << 20


# ============================================================================ the config
def fla_intermediate_size(hidden_size: int, hidden_ratio, intermediate_size) -> int:
    """fla's MLP width: `intermediate_size` when given, else the multiple of 256 at or above
    `2/3 · hidden_ratio · hidden_size` (hidden_ratio 4 by default), as fla's GatedMLP computes it."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    width = int(hidden_size * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def standard_fields() -> set[str]:
    """The fields transformers writes into every config.json (architectures, dtype, versions, ...)."""
    from transformers import PreTrainedConfig

    return set(PreTrainedConfig().to_dict()) | {"architectures", "transformers_version", "dtype", "torch_dtype",
                                                "auto_map", "_name_or_path"}


def _common_fields(fla: dict) -> dict[str, Any]:
    """The lazoo fields of the model around the mixers: sizes, MLP width, norms, embeddings, token ids."""
    act = fla.get("hidden_act", "swish")
    if act not in ("swish", "silu"):
        refuse("hidden_act", act, "lazoo's MLP is SwiGLU (swish / silu) only")
    if fla.get("attnres_block_size") is not None:
        refuse("attnres_block_size", fla["attnres_block_size"], "attention residuals are not a lazoo decoder option")
    hidden = fla["hidden_size"]
    fields = {
        "vocab_size": fla["vocab_size"], "hidden_size": hidden, "num_hidden_layers": fla["num_hidden_layers"],
        "num_attention_heads": fla["num_heads"],
        "intermediate_size": fla_intermediate_size(hidden, fla.get("hidden_ratio", 4), fla.get("intermediate_size")),
        "rms_norm_eps": fla.get("norm_eps", 1e-6), "tie_word_embeddings": bool(fla.get("tie_word_embeddings", False)),
        "bos_token_id": fla.get("bos_token_id"), "eos_token_id": fla.get("eos_token_id"),
        "pad_token_id": fla.get("pad_token_id"),
    }
    if fla.get("max_position_embeddings") is not None:
        fields["max_position_embeddings"] = fla["max_position_embeddings"]
    return fields


def _attention_specs(fla: dict, num_layers: int) -> list[dict]:
    """fla's `attn` block as a list of specs (`layers`, `num_heads`, `num_kv_heads`, `qkv_bias`, `window_size`,
    `rope_theta`), checked and with fla's defaults filled in."""
    attn = fla.get("attn")
    if attn is None:
        return []
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) and {"layers", "num_heads"} <= set(s)
                                              for s in specs):
        malformed("attn", attn, "expected a dict or a list of dicts with 'layers' and 'num_heads'")
    for spec in specs:
        extra = sorted(set(spec) - set(fla_layers.ATTENTION_FIELDS))
        if extra:
            refuse(f"attn.{extra[0]}", spec[extra[0]], "not an attention option lazoo knows how to convert")
        check_fields(spec, fla_layers.ATTENTION_FIELDS, prefix="attn.")
        layers = spec["layers"]
        if not isinstance(layers, list) or not all(fla_layers.is_layer_number(i, num_layers) for i in layers):
            malformed("attn.layers", layers, f"expected a list of layer numbers below num_hidden_layers = "
                      f"{num_layers}")
    return [{"num_kv_heads": None, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0, **s} for s in specs]


def _check_values(fla: dict, model_type: str) -> None:
    """The config's values are of the kinds fla writes (ConversionError naming the first field that is not)."""
    for field in REQUIRED_FIELDS:
        if field not in fla:
            raise ConversionError(f"fla config field {field!r} is missing; every fla model config has it; nothing "
                                  "was converted")
    check_fields(fla, COMMON_FIELDS)
    check_fields(fla, fla_layers.LAYER_FIELDS[model_type])
    if fla["num_hidden_layers"] > MAX_LAYERS:
        malformed("num_hidden_layers", fla["num_hidden_layers"], f"more than {MAX_LAYERS} layers")


def fla_config_to_lazoo(fla: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a fla config dict; ConversionError naming the field for a
    malformed value, UnsupportedCheckpointError for anything lazoo cannot express exactly."""
    model_type = fla.get("model_type")
    if model_type in FLA_MAMBA_MODEL_TYPES:
        refuse("model_type", model_type, "fla's Mamba-2 folders are laid out as transformers' and convert with "
               "`lazoo convert` (convert_checkpoint) or lazoo.convert.mamba_config_to_lazoo / from_mamba")
    if not isinstance(model_type, str) or model_type not in FLA_MODEL_TYPES:
        refuse("model_type", model_type, f"lazoo converts fla model types "
               f"{', '.join([*FLA_MODEL_TYPES, *FLA_MAMBA_MODEL_TYPES])}")
    mechanism = FLA_MODEL_TYPES[model_type]
    layer_fields = fla_layers.LAYER_FIELDS[model_type].keys()
    unknown = sorted(set(fla) - COMMON_FIELDS.keys() - NO_MATH_FIELDS - layer_fields - standard_fields())
    if unknown:
        refuse(unknown[0], fla[unknown[0]], f"an option of fla's {model_type!r} that lazoo does not know")
    _check_values(fla, model_type)
    fields = _common_fields(fla)
    n = fields["num_hidden_layers"]
    if mechanism is None:  # a transformer: every layer attention, from the top-level fields
        specs = [{"layers": list(range(n)), "num_heads": fla["num_heads"], "num_kv_heads": fla.get("num_kv_heads"),
                  "qkv_bias": fla.get("qkv_bias", False), "window_size": fla.get("window_size"),
                  "rope_theta": fla.get("rope_theta", 10000.0), "qk_norm": fla.get("qk_norm", False)}]
        if specs[0]["rope_theta"] is None:
            refuse("rope_theta", None, "lazoo's attention always applies RoPE")
    else:
        specs = _attention_specs(fla, n)
    layer_types = [mechanism] * n
    mixer_kwargs: dict[str, dict] = {}
    windows = set()
    for spec in specs:
        kind = "softmax" if spec["window_size"] is None else "sliding_window"
        options = fla_layers.attention_options(spec, fla)
        if mixer_kwargs.setdefault(kind, options) != options:
            refuse("attn", fla.get("attn"), f"{kind} layers with different settings; lazoo has one set per kind")
        if spec["window_size"] is not None:
            windows.add(spec["window_size"])
        for i in spec["layers"]:
            layer_types[i] = kind
    if len(windows) > 1:
        refuse("attn.window_size", sorted(windows), "lazoo has one sliding window size per model")
    fields["sliding_window"] = windows.pop() if windows else None
    if mechanism is not None and mechanism in layer_types:
        mixer_kwargs[mechanism] = fla_layers.mixer_options(model_type, fla)
    fields.update(layer_types=layer_types, mixer_kwargs=mixer_kwargs, use_short_conv=None)
    fields["model_type"] = "lazoo_hybrid"
    return fields


# ============================================================================ the weights
def _weight_map(source: SourceFolder, index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name)."""
    weight_map = source.read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
    return weight_map


def _shards(source: SourceFolder) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of the checkpoint, and where it has an index, the file each tensor is in."""
    index = source.file(INDEX_FILE, required=False)
    if index is None:
        single = source.file(WEIGHTS_FILE, required=False)
        if single is None:
            raise ConversionError(f"{source.root} has no {WEIGHTS_FILE} (or {INDEX_FILE}); convert a checkpoint "
                                  "saved with safetensors")
        return [single], None
    weight_map = _weight_map(source, index)
    paths = {name: source.file(name, f"{index}: weight_map file") for name in sorted(set(weight_map.values()))}
    placed = {tensor: paths[name] for tensor, name in weight_map.items()}
    return sorted(set(paths.values())), placed


def tensor_entries(source: SourceFolder) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint (model.safetensors, or the shards its index names) from the safetensors
    headers alone: no tensor data is read. A tensor in two files, or not where the index places it, is refused."""
    files, placed = _shards(source)
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in source.safetensors_header(path).items():
            if name in entries:
                raise ConversionError(f"{path}: tensor {name!r} is also in {entries[name].file}")
            if placed is not None and placed.get(name) != path:
                raise ConversionError(f"{path}: holds tensor {name!r}, which {INDEX_FILE} places "
                                      f"{'elsewhere' if name in placed else 'nowhere'}")
            entries[name] = entry
    absent = sorted(set(placed or ()) - set(entries))
    if absent:
        raise ConversionError(f"{source.root / INDEX_FILE}: weight_map places tensor {absent[0]!r} in "
                              f"{placed[absent[0]]}, which does not hold it")
    return entries


#: a layer's tensor (a layer number in canonical form: "01" is no layer number)
_LAYER = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,8})\.(attn_norm|mlp_norm|attn|mlp)\.(.+)$")
#: the parts of a fla layer under lazoo's names
_LAYER_PARTS = {"attn_norm": "input_norm", "mlp_norm": "post_mixer_norm", "attn": "mixer", "mlp": "mlp"}


def check_layer_count(entries: dict[str, TensorEntry], num_layers: int, config_file: Path) -> None:
    """The checkpoint's tensors hold layers 0 .. num_layers - 1, no more, no fewer: checked before any model is
    built, so that a config claiming more layers than the files hold costs nothing."""
    found = {int(m.group(1)) for name in entries if (m := _LAYER.match(name))}
    if found != set(range(num_layers)):
        held = f"{len(found)} layers" + (f" ({min(found)} to {max(found)})" if found else "")
        raise ConversionError(f"{config_file}: num_hidden_layers = {num_layers}, but the safetensors files hold "
                              f"tensors of {held}; nothing was converted")


def check_embedding(entries: dict[str, TensorEntry], fla: dict, config_file: Path) -> None:
    """The embedding is [vocab_size, hidden_size], checked before any model is built: the config's largest claims
    against what the files hold."""
    entry = entries.get("model.embeddings.weight")
    vocab, hidden = fla["vocab_size"], fla["hidden_size"]
    if entry is not None and entry.shape != (vocab, hidden):
        raise ConversionError(f"{config_file}: vocab_size = {vocab} and hidden_size = {hidden}, but {entry.file} "
                              f"holds model.embeddings.weight of shape {list(entry.shape)}; nothing was converted")


def lazoo_name(name: str, config) -> str | None:
    """The lazoo parameter name of fla parameter `name` for a lazoo `config` (from `fla_config_to_lazoo`); None for
    a name fla's models do not write."""
    if name == "model.embeddings.weight":
        return "model.embed_tokens.weight"
    if name in ("model.norm.weight", "lm_head.weight"):
        return name
    if (m := _LAYER.match(name)) is not None and int(m.group(1)) < config.num_hidden_layers:
        i, part, rest = int(m.group(1)), m.group(2), m.group(3)
        if part == "attn":
            rest = fla_layers.mixer_parameter_name(config.layer_types[i], rest)
        return f"model.layers.{i}.{_LAYER_PARTS[part]}.{rest}"
    return None


def meta_model(fields: dict[str, Any], config_file: Path, converted_from: dict):
    """The lazoo causal LM of `fields` on the meta device (no memory, no random init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.converted_from = converted_from
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - lazoo's checks of the values (a ValueError naming the field), or
        # anything else the values break while the model is built: either way the config is at fault
        raise ConversionError(f"{config_file}: describes no model lazoo can build ({type(err).__name__}: {err}); "
                              "nothing was converted") from err


def lazoo_names(entries: dict[str, TensorEntry], config) -> dict[str, str]:
    """fla name -> lazoo name of every tensor of the checkpoint; a name fla's models do not write, or two names of
    one parameter, refused naming the file."""
    names, fla_name_of = {}, {}
    for fla_name, entry in entries.items():
        name = lazoo_name(fla_name, config)
        if name is None:
            raise UnsupportedCheckpointError(f"{entry.file}: tensor {fla_name!r} is not one that fla's models "
                                             "write; nothing was converted")
        if name in fla_name_of:
            raise UnsupportedCheckpointError(f"{entry.file}: tensors {fla_name_of[name]!r} and {fla_name!r} are the "
                                             "same parameter; nothing was converted")
        names[fla_name], fla_name_of[name] = name, fla_name
    return names


def expected_tensors(entries: dict[str, TensorEntry], model, config_file: Path) -> dict[str, str]:
    """fla name -> lazoo name of each tensor the model takes, refused unless the names and the shapes are exactly
    the model's (a tied head is the embedding: a checkpoint's `lm_head.weight` is then left unread)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    names = lazoo_names(entries, model.config)
    if model.config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    unexpected = sorted(fla_name for fla_name, name in names.items() if name not in shapes)
    if unexpected:
        raise UnsupportedCheckpointError(f"{entries[unexpected[0]].file}: tensor {unexpected[0]!r} is not in the "
                                         f"model {config_file} describes; nothing was converted")
    missing = sorted(shapes.keys() - set(names.values()))
    if missing:
        raise UnsupportedCheckpointError(f"{config_file}: the model it describes has tensors the safetensors files "
                                         f"lack: {missing[:5]} (lazoo's names); nothing was converted")
    for fla_name, name in names.items():
        entry = entries[fla_name]
        if entry.shape != shapes[name]:
            raise ConversionError(f"{entry.file}: tensor {fla_name!r} has shape {list(entry.shape)}, but "
                                  f"{config_file} implies {list(shapes[name])}; nothing was converted")
    return names


def read_finite_tensors(source: SourceFolder, entries: dict[str, TensorEntry],
                        names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors of `names` (fla name -> lazoo name) under their lazoo names; NaN or infinite values refused."""
    state = {}
    for fla_name in sorted(names, key=lambda n: (entries[n].file, entries[n].start)):  # each file front to back
        entry = entries[fla_name]
        tensor = source.read_tensor(entry, fla_name)
        finite = torch.isfinite(tensor)
        if not finite.all():
            raise ConversionError(f"{entry.file}: tensor {fla_name!r} holds {int((~finite).sum())} NaN or infinite "
                                  "values; nothing was converted")
        state[names[fla_name]] = tensor
    return state


def fill_model(model, state: dict[str, torch.Tensor]):
    """`model` (on the meta device) holding exactly `state`, whose names and shapes are the model's."""
    model.load_state_dict(state, strict=False, assign=True)  # every key checked; a tied head comes next
    if model.config.tie_word_embeddings:
        model.tie_weights()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UnsupportedCheckpointError(f"the converted model has tensors the checkpoint does not fill: {left[:5]}")
    return model.eval()


# ============================================================================ the folder
def check_destination(dst: Path) -> None:
    """`dst` is new or an empty folder, and no symbolic link (a conversion never writes through one)."""
    if dst.is_symlink():
        raise ConversionError(f"{dst} is a symbolic link; convert into a new folder (a link is never written "
                              "through)")
    with reporting_os_errors("reading", dst):
        taken = dst.exists() and (not dst.is_dir() or any(dst.iterdir()))
    if taken:
        raise FileExistsError(one_line(f"{dst} exists and is not an empty folder; convert into a new folder "
                                       "(nothing is overwritten)"))


@contextmanager
def _without_progress_bars():
    """transformers' progress bars off: one drawn before a failure would add lines to the one-line report."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _save_model(model, staging: Path, dst: Path) -> None:
    """`model.save_pretrained(staging)`, with a failure of the file system reported as writing `dst`."""
    try:
        with _without_progress_bars():
            model.save_pretrained(staging)
    except Exception as err:  # safetensors reports a full disk as its own error type, "(os error 28)" in the text
        if not isinstance(err, OSError) and os_errno(err) is None:
            raise
        raise os_failure(err, "writing", dst) from err


def tokenizer_files(source: SourceFolder) -> dict[str, Path]:
    """The checkpoint's tokenizer files and generation defaults that are there (name -> path; a JSON one among them
    must parse), checked before anything is built or written."""
    found = {name: path for name in TOKENIZER_FILES if (path := source.file(name, required=False)) is not None}
    for name, path in found.items():
        if name.endswith(".json"):
            source.read_json(path)
    return found


def _copy_files(files: dict[str, Path], staging: Path, dst: Path) -> None:
    """`files` (name in the new folder -> path) into `staging`."""
    for name, path in files.items():
        with reporting_os_errors("reading", path):
            data = path.read_bytes()
        with reporting_os_errors("writing", dst):
            (staging / name).write_bytes(data)


def write_folder(model, files: dict[str, Path], dst: Path) -> Path:
    """The lazoo folder `dst` of `model` and `files` (name -> path, copied as they are): written into a staging
    folder beside it, renamed into place (over `dst` when it is an empty folder); on any failure the staging folder
    is removed and `dst` is as it was."""
    with reporting_os_errors("writing", dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        _save_model(model, staging, dst)
        _copy_files(files, staging, dst)
        with reporting_os_errors("writing", dst):
            os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def from_fla(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert the fla checkpoint folder `src` into a new lazoo folder `dst` (see the module docstring). Refuses,
    before writing anything, a checkpoint lazoo cannot express (UnsupportedCheckpointError), malformed input or a
    failed read or write (ConversionError), and a `dst` that exists and is not empty (FileExistsError). Returns
    `dst`."""
    source, dst = SourceFolder(src), Path(dst)
    config_file = source.file("config.json", required=False)
    if config_file is None:
        raise ConversionError(f"{src} has no config.json: give a fla checkpoint folder")
    fla = source.read_json(config_file, limit=MAX_CONFIG_BYTES)
    try:
        fields = fla_config_to_lazoo(fla)
    except ConversionError as err:
        raise type(err)(f"{config_file}: {err}") from err
    check_destination(dst)
    copied = tokenizer_files(source)
    entries = tensor_entries(source)
    check_layer_count(entries, fields["num_hidden_layers"], config_file)
    check_embedding(entries, fla, config_file)
    converted_from = {"format": "fla", "model_type": fla["model_type"], "source": source.root.name}
    model = meta_model(fields, config_file, converted_from)
    names = expected_tensors(entries, model, config_file)
    model = fill_model(model, read_finite_tensors(source, entries, names))
    return write_folder(model, copied, dst)
