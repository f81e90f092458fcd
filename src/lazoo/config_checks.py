"""Checks of the model configs a command is given: a layout name or config .json to build a model from, and a
saved model folder (its config.json field by field, and its weights against it). Each refuses with one
`CLIError` line before any work, instead of a transformers error buried under its base config's."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lazoo_cli.parser import SIZE_FLAGS, SIZE_LIMITS

from .user_input import CLIError, check_text, read_text_file

__all__ = ["check_layout", "check_dtype_field", "check_saved_model_folder", "load_saved_config",
           "check_weight_shapes"]


def check_layout(layout: str, flag: str = "--config", args=None) -> None:
    """A layout name, or a config .json that builds, with sizes within the limits (those `args` does not
    override with its size options)."""
    from .presets import build_config, known_layouts

    check_text(flag, layout)
    if layout.endswith(".json"):
        if os.path.isdir(layout):
            raise CLIError(f"{flag}: {layout!r} is a folder; give a config .json (see configs/) or a layout name")
        if not os.path.isfile(layout):
            raise CLIError(f"{flag}: no such file {layout!r}; give a config .json (see configs/) or a layout name "
                           f"({', '.join(known_layouts())})")
        _check_config_model_type(layout, flag)
        check_dtype_field(Path(layout))
        try:
            config = build_config(layout)
        except (ValueError, TypeError, KeyError) as err:  # bad JSON, no/unknown model_type, bad fields
            raise CLIError(f"{flag} {layout}: {err}") from err
        _check_config_sizes(config, f"{flag} {layout}", args)
    elif layout not in known_layouts():
        raise CLIError(f"{flag}: unknown layout {layout!r}; use one of {', '.join(known_layouts())} "
                       "or a path to a config .json (see configs/)")


def _check_config_sizes(config, where: str, args=None) -> None:
    """A config file's sizes within the limits of the size options (a vocabulary of 10^9 aborts the tokenizer
    trainer; a hidden size of 10^6 does not fit in memory), except those the command line overrides."""
    for flag, key in SIZE_FLAGS.items():
        if args is not None and getattr(args, flag, None) is not None:
            continue
        value = getattr(config, key, None)
        if isinstance(value, int) and value > SIZE_LIMITS[flag]:
            raise CLIError(f"{where}: {key} {value} is more than {SIZE_LIMITS[flag]}, the largest lazoo trains")


def _check_config_model_type(path: str, flag: str) -> None:
    """A config file's model_type must be one of lazoo's causal LMs (the other types give errors listing
    every transformers model type, or train something that is not a lazoo model)."""
    from .models import MODEL_CLASSES

    try:
        fields = json.loads(read_text_file(flag, path))
    except ValueError as err:
        raise CLIError(f"{flag} {path}: not a JSON config file ({err})") from err
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type is None:
        raise CLIError(f"{flag} {path}: config file {path!r} has no 'model_type'; use one of "
                       f"{', '.join(MODEL_CLASSES)}")
    if model_type not in MODEL_CLASSES:
        raise CLIError(f"{flag} {path}: model_type {model_type!r} is not a lazoo language model; use one of "
                       f"{', '.join(MODEL_CLASSES)}")


def check_dtype_field(config_file: Path) -> None:
    """`dtype` (or the older `torch_dtype`) names a torch dtype: transformers looks any other name up on the
    torch module and fails with an AttributeError."""
    import torch

    fields = json.loads(config_file.read_text(encoding="utf-8"))  # known_model_type has read it as JSON
    for key in ("dtype", "torch_dtype"):
        value = fields.get(key)
        if value is not None and value != "auto" and not (
                isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            raise CLIError(f"{config_file}: {key} {value!r} is not a torch dtype (float32, bfloat16, float16, ...)")


def check_saved_model_folder(folder: str, what: str = "model") -> Path:
    """`folder` as a Path, after checking it holds a config.json of a model type transformers knows (so that
    loading it never asks to run the folder's own code)."""
    from .models.export import known_model_type

    path = Path(folder)
    if not path.is_dir():
        raise CLIError(f"no such folder {folder!r}; give a folder written by `lazoo train` or save_pretrained")
    if not (path / "config.json").is_file():
        raise CLIError(f"{folder!r} has no config.json, so it is not a saved {what}; "
                       "give a folder written by `lazoo train` or save_pretrained")
    try:
        known_model_type(path)
    except ValueError as err:
        raise CLIError(str(err)) from err
    load_saved_config(path)
    return path


def load_saved_config(path: Path):
    """The saved folder's config, checked field by field: a wrong field is one line naming it (loading the
    tokenizer or model would bury it under transformers' own errors about its base config)."""
    from transformers import AutoConfig

    check_dtype_field(path / "config.json")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, TypeError, KeyError) as err:
        raise CLIError(f"{path / 'config.json'}: {err}") from err


def check_weight_shapes(path: Path) -> None:
    """Each tensor in the folder's safetensors files has the shape config.json gives it (a config edited after
    saving would make loading print a long report and raise): one line naming the first that differs. Reads
    only the files' headers, and builds the model on the meta device."""
    import torch
    from safetensors import SafetensorError, safe_open
    from transformers import AutoModelForCausalLM

    config = load_saved_config(path)
    try:
        with torch.device("meta"):
            expected = {k: list(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except ValueError:  # not a causal LM: loading it says so
        return
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt") as weights:
                shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
        except (OSError, SafetensorError) as err:
            raise CLIError(f"cannot load a causal LM from {str(path)!r}: {file.name}: {err}") from err
        for key, shape in shapes.items():
            if key in expected and list(shape) != expected[key]:
                raise CLIError(f"{file}: {key} has shape {list(shape)}, but config.json's sizes give "
                               f"{expected[key]}; the config does not describe these weights")
