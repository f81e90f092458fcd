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
    # seed 002 (§8.2): sliding window 128 with RoPE alternating with a NoPE global mixer, unit-norm q/k with a
    # learned per-head scale everywhere (HYBRID_OPTIONS)
    "sw-ovq": ["sliding_window", "ovq"],
    "sw-nope": ["sliding_window", "softmax"],
    "sw-vq": ["sliding_window", "vq"],
    "gdn-ovq": ["gated_delta_net", "ovq"],
}

#: config fields a hybrid preset sets unless overridden (per-mixer options merge key by key into
#: the caller's `mixer_kwargs`)
_SEED002_SW = {"sliding_window": 128, "mixer_kwargs": {"sliding_window": {"qk_norm": True, "use_rope": True}}}
HYBRID_OPTIONS: dict[str, dict] = {
    "sw-ovq": _SEED002_SW,
    "sw-nope": {"sliding_window": 128, "mixer_kwargs": {"sliding_window": {"qk_norm": True, "use_rope": True},
                                                        "softmax": {"qk_norm": True, "use_rope": False}}},
    "sw-vq": _SEED002_SW,
    "gdn-ovq": {},
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
        preset = HYBRID_OPTIONS.get(layout, {})
        for key, value in preset.items():
            if key == "mixer_kwargs":
                given = overrides.get("mixer_kwargs") or {}
                merged = {name: dict(opts) for name, opts in value.items()}
                for name, opts in given.items():
                    merged[name] = {**merged.get(name, {}), **opts}
                overrides["mixer_kwargs"] = merged
            else:
                overrides.setdefault(key, value)
        return AutoConfig.for_model("lazoo_hybrid", **overrides)
    raise ValueError(f"unknown layout {layout!r}: use a mechanism ({', '.join(MIXERS)}), a hybrid preset "
                     f"({', '.join(HYBRIDS)}) or a path to a config .json")
