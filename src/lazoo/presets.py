"""Named model layouts: a mechanism name, a hybrid preset, or a config JSON from `configs/`.

The hybrid presets live here only: the hybrid files of `configs/` (`PRESET_CONFIG_FILES`) are written from them
by `python -m lazoo.presets --write-configs configs/`, and a test fails when one is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoConfig

from .layers.mixers import MIXERS

#: hybrid presets: name -> the repeating pattern of layer types
HYBRIDS: dict[str, list[str]] = {
    "sw-vla": ["sliding_window", "vla"],
    "sw-gdn": ["sliding_window", "gated_delta_net"],
    "sw-softmax": ["sliding_window", "softmax"],
    # the OVQ paper (§8.2): sliding window 128 with RoPE alternating with a NoPE global mixer, unit-norm q/k with a
    # learned per-head scale everywhere (HYBRID_OPTIONS)
    "sw-ovq": ["sliding_window", "ovq"],
    "sw-nope": ["sliding_window", "softmax"],
    "sw-vq": ["sliding_window", "vq"],
    "gdn-ovq": ["gated_delta_net", "ovq"],
    # Kimi Linear's layout: three KDA layers to one multi-head latent attention layer (NoPE)
    "kda-mla": ["kda", "kda", "kda", "mla"],
}

#: config fields a hybrid preset sets unless overridden (per-mixer options merge key by key into
#: the caller's `mixer_kwargs`)
#: MLA's latent and head dims at the small models' size (Kimi Linear's: 512, 128, 64, 128)
_SMALL_MLA = {"kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
_OVQ_PAPER_SW = {"sliding_window": 128, "mixer_kwargs": {"sliding_window": {"qk_norm": True, "use_rope": True}}}
HYBRID_OPTIONS: dict[str, dict] = {
    "sw-ovq": _OVQ_PAPER_SW,
    "sw-nope": {"sliding_window": 128, "mixer_kwargs": {"sliding_window": {"qk_norm": True, "use_rope": True},
                                                        "softmax": {"qk_norm": True, "use_rope": False}}},
    "sw-vq": _OVQ_PAPER_SW,
    "gdn-ovq": {},
    "kda-mla": {"mixer_kwargs": {"mla": _SMALL_MLA}},
}

#: the sizes of the small configs in configs/ (configs/README.md)
SMALL_SIZES = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "intermediate_size": 512}

#: the files of configs/ written from the presets at `SMALL_SIZES`: file name -> preset
PRESET_CONFIG_FILES: dict[str, str] = {
    "sw-vla-hybrid-small.json": "sw-vla",
    "sw-ovq-small.json": "sw-ovq",
    "sw-nope-small.json": "sw-nope",
    "sw-vq-small.json": "sw-vq",
    "gdn-ovq-small.json": "gdn-ovq",
    "kda-mla-small.json": "kda-mla",
}
WRITE_CONFIGS_COMMAND = "python -m lazoo.presets --write-configs configs/"


def known_layouts() -> list[str]:
    return [*MIXERS, *HYBRIDS]


def preset_fields(preset: str, overrides: dict) -> dict:
    """The config fields of hybrid `preset`: `overrides`, then the preset's layer pattern repeated over
    `num_hidden_layers` (unless `layer_types` is given) and its `HYBRID_OPTIONS` (unless overridden; per-mixer
    options merge key by key into the caller's `mixer_kwargs`, for the mechanisms the layers run: a pattern cut
    short by few layers may leave one out)."""
    fields = dict(overrides)
    pattern = HYBRIDS[preset]
    layers = fields.get("num_hidden_layers", 4)
    fields.setdefault("layer_types", [pattern[i % len(pattern)] for i in range(layers)])
    for key, value in HYBRID_OPTIONS.get(preset, {}).items():
        if key == "mixer_kwargs":  # the preset's own options of mechanisms its (possibly few) layers run
            merged = {name: dict(opts) for name, opts in value.items() if name in fields["layer_types"]}
            for name, opts in (fields.get("mixer_kwargs") or {}).items():
                merged[name] = {**merged.get(name, {}), **opts}
            fields["mixer_kwargs"] = merged
        else:
            fields.setdefault(key, value)
    return fields


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
        return AutoConfig.for_model("lazoo_hybrid", **preset_fields(layout, overrides))
    raise ValueError(f"unknown layout {layout!r}: use a mechanism ({', '.join(MIXERS)}), a hybrid preset "
                     f"({', '.join(HYBRIDS)}) or a path to a config .json")


# ----------------------------------------------------------------------------- the preset files of configs/
def preset_config_texts() -> dict[str, str]:
    """`{file name: JSON text}` of the files `PRESET_CONFIG_FILES` lists."""
    return {name: json.dumps({"model_type": "lazoo_hybrid", **preset_fields(preset, SMALL_SIZES)}, indent=2) + "\n"
            for name, preset in PRESET_CONFIG_FILES.items()}


def stale_preset_configs(config_dir: str | Path) -> list[str]:
    """The files of `PRESET_CONFIG_FILES` that are missing from `config_dir` or differ from their presets."""
    folder = Path(config_dir)
    return [name for name, text in preset_config_texts().items()
            if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text]


def write_preset_configs(config_dir: str | Path) -> list[Path]:
    """Write the stale files of `PRESET_CONFIG_FILES` into `config_dir`; no other file is touched. Returns the
    files written."""
    folder = Path(config_dir)
    folder.mkdir(parents=True, exist_ok=True)
    texts = preset_config_texts()
    written = [folder / name for name in stale_preset_configs(folder)]
    for path in written:
        path.write_text(texts[path.name], encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lazoo.presets",
                                     description="Write or check the hybrid-preset configs of configs/ "
                                                 f"({', '.join(PRESET_CONFIG_FILES)}).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-configs", metavar="DIR", help="write the stale preset files into DIR")
    action.add_argument("--check", metavar="DIR", help="exit 1 if a preset file in DIR is missing or stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_preset_configs(args.check)
        for name in stale:
            print(f"stale: {Path(args.check) / name} (run: {WRITE_CONFIGS_COMMAND})")
        return 1 if stale else 0
    for path in write_preset_configs(args.write_configs):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
