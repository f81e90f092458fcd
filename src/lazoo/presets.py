"""Named model layouts: a mechanism name, a hybrid preset, or a config JSON from `configs/`."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from .layers.mixers import MIXERS

#: hybrid presets: name -> the repeating pattern of layer types
HYBRIDS: dict[str, list[str]] = {
    "sw-vla": ["sliding_window", "vla"],
    "sw-gdn": ["sliding_window", "gated_delta_net"],
    "sw-softmax": ["sliding_window", "softmax"],
}


def known_layouts() -> list[str]:
    return [*MIXERS, *HYBRIDS]


def build_config(layout: str, **overrides):
    """A lazoo config for `layout` (mechanism name, hybrid preset or path to a config JSON) with `overrides`
    (sizes, token ids, ...) applied on top."""
    path = Path(layout)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"config file {layout!r} does not exist")
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"config file {layout!r} has no 'model_type'")
        fields.update(overrides)
        return AutoConfig.for_model(model_type, **fields)
    if layout in MIXERS:
        return AutoConfig.for_model(f"lazoo_{layout}", **overrides)
    if layout in HYBRIDS:
        layers = overrides.get("num_hidden_layers", 4)
        pattern = HYBRIDS[layout]
        overrides.setdefault("layer_types", [pattern[i % len(pattern)] for i in range(layers)])
        return AutoConfig.for_model("lazoo_hybrid", **overrides)
    raise ValueError(f"unknown layout {layout!r}: use a mechanism ({', '.join(MIXERS)}), a hybrid preset "
                     f"({', '.join(HYBRIDS)}) or a path to a config .json")
