"""fla (flash-linear-attention) checkpoints into lazoo folders.

`from_fla(src, dst)` reads a fla checkpoint folder (`config.json` with a fla `model_type`, safetensors weights,
sharded or not) and writes a lazoo folder: config, weights, the tokenizer files, a model card naming the source,
and lazoo's `trust_remote_code` code. The result loads with `AutoModelForCausalLM.from_pretrained(dst)` after
`import lazoo`, and with `trust_remote_code=True` where lazoo is not installed.

Every config field of the checkpoint is either expressed by a lazoo option (the layer computes the same function)
or changes no math (kernel choice, fused implementations, training losses); anything else is refused with an
`UnsupportedCheckpointError` naming the field, before anything is written. Nothing of fla is imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import fla_layers
from .fla_layers import ConversionError, UnsupportedCheckpointError, refuse

#: fla model type -> the lazoo mechanism of its non-attention layers (None: every layer is attention)
FLA_MODEL_TYPES = {"transformer": None, "gla": "gla", "delta_net": "delta_net", "gated_deltanet": "gated_delta_net"}

#: fields that change no computed function: kernel modes, fused implementations, training-only losses and inits
NO_MATH_FIELDS = {"attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy",
                  "use_l2warp", "initializer_range", "use_cache"}
#: fields every fla language model has, read by `_common_fields`
COMMON_FIELDS = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "hidden_ratio",
                 "intermediate_size", "hidden_act", "norm_eps", "elementwise_affine", "tie_word_embeddings",
                 "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attn",
                 "attnres_block_size"}
#: files copied from the checkpoint as they are (the tokenizer's, and the generation defaults)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


# ============================================================================ the config
def fla_intermediate_size(hidden_size: int, hidden_ratio, intermediate_size) -> int:
    """fla's MLP width: `intermediate_size` when given, else the multiple of 256 at or above
    `2/3 · hidden_ratio · hidden_size` (hidden_ratio 4 by default), as fla's GatedMLP computes it."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    width = int(hidden_size * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def _standard_fields() -> set[str]:
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


def _attention_specs(fla: dict) -> list[dict]:
    """fla's `attn` block as a list of specs (`layers`, `num_heads`, `num_kv_heads`, `qkv_bias`, `window_size`,
    `rope_theta`), with fla's defaults filled in."""
    attn = fla.get("attn")
    if attn is None:
        return []
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) and "layers" in s for s in specs):
        refuse("attn", attn, "expected a dict or a list of dicts with 'layers' and 'num_heads'")
    known = {"layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta"}
    for spec in specs:
        extra = sorted(set(spec) - known)
        if extra:
            refuse(f"attn.{extra[0]}", spec[extra[0]], "not an attention option lazoo knows how to convert")
    return [{"num_kv_heads": None, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0, **s} for s in specs]


def fla_config_to_lazoo(fla: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a fla config dict; UnsupportedCheckpointError naming the
    field for anything lazoo cannot express exactly."""
    model_type = fla.get("model_type")
    if model_type not in FLA_MODEL_TYPES:
        refuse("model_type", model_type, f"lazoo converts fla model types {', '.join(FLA_MODEL_TYPES)}")
    mechanism = FLA_MODEL_TYPES[model_type]
    layer_fields = fla_layers.LAYER_FIELDS[model_type]
    unknown = sorted(set(fla) - COMMON_FIELDS - NO_MATH_FIELDS - layer_fields - _standard_fields())
    if unknown:
        refuse(unknown[0], fla[unknown[0]], f"an option of fla's {model_type!r} that lazoo does not know")
    fields = _common_fields(fla)
    n = fields["num_hidden_layers"]
    if mechanism is None:  # a transformer: every layer attention, from the top-level fields
        specs = [{"layers": list(range(n)), "num_heads": fla["num_heads"], "num_kv_heads": fla.get("num_kv_heads"),
                  "qkv_bias": fla.get("qkv_bias", False), "window_size": fla.get("window_size"),
                  "rope_theta": fla.get("rope_theta", 10000.0), "qk_norm": fla.get("qk_norm", False)}]
        if specs[0]["rope_theta"] is None:
            refuse("rope_theta", None, "lazoo's attention always applies RoPE")
    else:
        specs = _attention_specs(fla)
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
def _read_weights(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (model.safetensors, or the shards its index names)."""
    from safetensors.torch import load_file

    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ConversionError(f"{src} has no model.safetensors (or model.safetensors.index.json); convert a "
                              "checkpoint saved with safetensors")
    state = {}
    for shard in shards:
        state.update(load_file(str(src / shard)))
    return state


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(attn_norm|mlp_norm|attn|mlp)\.(.+)$")


def convert_weights(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """fla's tensors under lazoo's names for a lazoo `config` (from `fla_config_to_lazoo`)."""
    out = {}
    for name, tensor in state.items():
        if name == "model.embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name in ("model.norm.weight", "lm_head.weight"):
            out[name] = tensor
        elif (m := _LAYER.match(name)) is not None:
            i, part, rest = int(m.group(1)), m.group(2), m.group(3)
            prefix = f"model.layers.{i}."
            if part == "attn_norm":
                out[prefix + "input_norm." + rest] = tensor
            elif part == "mlp_norm":
                out[prefix + "post_mixer_norm." + rest] = tensor
            elif part == "mlp":
                out[prefix + "mlp." + rest] = tensor
            else:
                for key, value in fla_layers.mixer_weights(config.layer_types[i], rest, tensor, config).items():
                    out[prefix + "mixer." + key] = value
        else:
            raise UnsupportedCheckpointError(f"the checkpoint has a tensor {name!r} that fla's models do not write; "
                                             "nothing was converted")
    return out


def _build_model(config, state: dict[str, torch.Tensor]):
    """The lazoo causal LM of `config` holding exactly `state` (no random init: built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise UnsupportedCheckpointError(f"the checkpoint's tensors do not match the converted model: missing "
                                         f"{missing[:5]}, unexpected {unexpected[:5]}; nothing was converted")
    model.load_state_dict(state, strict=False, assign=True)  # every key checked above; a tied head comes next
    if config.tie_word_embeddings:
        model.tie_weights()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UnsupportedCheckpointError(f"the converted model has tensors the checkpoint does not fill: {left[:5]}")
    return model.eval()


# ============================================================================ the folder
def _check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty folder; convert into a new folder (nothing is "
                              "overwritten)")


def from_fla(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert the fla checkpoint folder `src` into a new lazoo folder `dst` (see the module docstring). Refuses,
    before writing anything, a checkpoint lazoo cannot express (UnsupportedCheckpointError) and a `dst` that exists
    and is not empty (FileExistsError). Returns `dst`."""
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{src} has no config.json: give a fla checkpoint folder")
    try:
        fla = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_file}: not valid JSON ({err})") from err
    fields = fla_config_to_lazoo(fla)
    _check_destination(dst)
    state = _read_weights(src)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.converted_from = {"format": "fla", "model_type": fla["model_type"], "source": src.resolve().name}
    model = _build_model(config, convert_weights(state, config))
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, staging / name)
        if dst.exists():
            dst.rmdir()  # empty: checked above
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst
