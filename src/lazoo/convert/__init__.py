"""Checkpoint conversion into lazoo folders: `from_fla` (flash-linear-attention checkpoints), `from_qwen` (Qwen3.5,
Qwen3.5-MoE and Qwen3-Next folders of transformers), `from_mamba` (Mamba-2 and Bamba folders of transformers),
`from_kimi` (Kimi Linear folders of transformers), `from_nemotron` (Nemotron-H folders of transformers),
`from_granite` (GraniteMoeHybrid folders of transformers), and `convert_checkpoint`, which picks one by the
folder's `model_type` (`lazoo convert`)."""

from __future__ import annotations

import os
from pathlib import Path

from .fla import (
    FLA_MAMBA_MODEL_TYPES,
    FLA_MODEL_TYPES,
    MAX_CONFIG_BYTES,
    ConversionError,
    UnsupportedCheckpointError,
    fla_config_to_lazoo,
    from_fla,
)
from .granite import GRANITE_MODEL_TYPES, from_granite, granite_config_to_lazoo
from .kimi import KIMI_MODEL_TYPES, from_kimi, kimi_config_to_lazoo
from .mamba import CONVERTED_MODEL_TYPES, MAMBA_MODEL_TYPES, from_mamba, mamba_config_to_lazoo
from .nemotron import NEMOTRON_MODEL_TYPES, from_nemotron, nemotron_config_to_lazoo
from .qwen import QWEN_MODEL_TYPES, from_qwen, qwen_config_to_lazoo
from .source import SourceFolder, shown

__all__ = ["ConversionError", "UnsupportedCheckpointError", "convert_checkpoint", "fla_config_to_lazoo", "from_fla",
           "from_granite", "from_kimi", "from_mamba", "from_nemotron", "from_qwen", "granite_config_to_lazoo",
           "kimi_config_to_lazoo", "mamba_config_to_lazoo", "nemotron_config_to_lazoo", "qwen_config_to_lazoo",
           "FLA_MODEL_TYPES", "GRANITE_MODEL_TYPES", "KIMI_MODEL_TYPES", "MAMBA_MODEL_TYPES", "NEMOTRON_MODEL_TYPES",
           "QWEN_MODEL_TYPES"]


#: hybrids transformers ships whose layer structure lazoo's decoder cannot express: model type -> (the config field
#: that shows it, why)
STRUCTURES_REFUSED = {
    "falcon_h1": ("mamba_d_ssm", "Falcon-H1 runs attention and Mamba-2 side by side in every layer on the same input "
                  "and adds them, each with its own multipliers (attention_in_multiplier, ssm_in_multiplier, "
                  "ssm_multipliers, ...); a lazoo layer has one token mixer"),
    "zamba2": ("hybrid_layer_ids", "Zamba2's attention blocks are shared between layers (one set of weights, "
               "applied at several depths to the concatenated embeddings and hidden state); lazoo's layers each own "
               "their weights"),
}


def _from_fla(src, dst, config):
    return from_fla(src, dst), []


#: the converter of each model type, as (model types, converter(src, dst, config=...) -> (dst, what it left out))
CONVERTERS = ((QWEN_MODEL_TYPES, from_qwen), (MAMBA_MODEL_TYPES, from_mamba), (KIMI_MODEL_TYPES, from_kimi),
              (NEMOTRON_MODEL_TYPES, from_nemotron), (GRANITE_MODEL_TYPES, from_granite),
              (FLA_MODEL_TYPES, _from_fla))


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[Path, list[str]]:
    """Convert the checkpoint folder `src` (fla, or Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / Mamba-2 / Bamba / Kimi Linear
    / Nemotron-H / GraniteMoeHybrid as transformers saves them) into a new lazoo folder `dst`, by the `model_type` of
    its config.json (a `mamba2` folder is fla's or transformers', by the fields of its config). Returns (`dst`, what
    the conversion left out, e.g. a vision tower). Refuses, before writing anything, what it cannot convert exactly."""
    source = SourceFolder(src)
    config_file = source.file("config.json", required=False)
    if config_file is None:
        raise ConversionError(f"{src} has no config.json: give a checkpoint folder (config.json + safetensors)")
    config = source.read_json(config_file, limit=MAX_CONFIG_BYTES)
    model_type = config.get("model_type")
    for model_types, convert in CONVERTERS:
        if isinstance(model_type, str) and model_type in model_types:
            return convert(src, dst, config=config)
    if isinstance(model_type, str) and model_type in STRUCTURES_REFUSED:
        field, why = STRUCTURES_REFUSED[model_type]
        raise UnsupportedCheckpointError(f"{config_file}: model_type {model_type!r} (config field {field!r}): {why}; "
                                         "nothing was converted")
    raise UnsupportedCheckpointError(
        f"{config_file}: config field 'model_type' = {shown(config.get('model_type'))}: lazoo converts fla model "
        f"types {', '.join([*FLA_MODEL_TYPES, *FLA_MAMBA_MODEL_TYPES])} and transformers' "
        f"{', '.join(QWEN_MODEL_TYPES)}, {', '.join(CONVERTED_MODEL_TYPES)}, {', '.join(KIMI_MODEL_TYPES)}, "
        f"{', '.join(NEMOTRON_MODEL_TYPES)}, {', '.join(GRANITE_MODEL_TYPES)}; "
        "nothing was converted")
