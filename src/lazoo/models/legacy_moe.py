"""Loading folders saved before the routed MoE stored its experts stacked.

Until then `RoutedMoE` held one GatedMLP per expert (`...mlp.experts.{e}.gate_proj.weight` [I, D], `up_proj` [I, D],
`down_proj` [D, I]); it now holds `...mlp.experts.gate_up_proj` [E, 2I, D] and `...mlp.experts.down_proj` [E, D, I]
(`lazoo.layers.moe`). transformers' loader sets parameters by name, so `LazooPreTrainedModel.from_pretrained` gives it
a temporary copy of such a folder with the experts stacked (`stacked_experts_folder`); `load_state_dict` of an old
state dict (Trainer's resume) is converted by the experts module itself (a load_state_dict pre-hook).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from transformers.utils import logging

from ..layers.moe import has_legacy_experts, stack_legacy_experts

logger = logging.get_logger(__name__)

#: the from_pretrained arguments that say where a checkpoint's files are
HUB_ARGUMENTS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def _resolve(source: str, name: str, hub: dict) -> str | None:
    """The local path of file `name` of `source` (a folder or Hub repo), or None where it has none."""
    from transformers.utils import cached_file

    return cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub)


def _weight_files(source, hub: dict) -> tuple[list[str], list[str]] | None:
    """(the safetensors files of `source`, their tensor names), or None where there are none to read here."""

    def resolve(name):
        return _resolve(source, name, hub)

    index = resolve(SAFE_INDEX)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [resolve(name) for name in sorted(set(weight_map.values()))]
        return (None if None in files else files), list(weight_map)
    single = resolve(SAFE_WEIGHTS)
    if single is None:
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return [single], list(f.keys())


@contextlib.contextmanager
def stacked_experts_folder(source, kwargs: dict):
    """A temporary folder holding `source` (a folder or Hub repo, read with the hub arguments in `kwargs`) with its
    experts stacked, when its weights are in the per-expert layout; else None. The folder has the same config,
    generation config and other files, and one `model.safetensors`."""
    if source is None or not isinstance(source, (str, os.PathLike)) or kwargs.get("gguf_file") \
            or kwargs.get("state_dict") is not None:
        yield None
        return
    hub = {k: kwargs[k] for k in HUB_ARGUMENTS if kwargs.get(k) is not None}
    try:
        found = _weight_files(os.fspath(source), hub)
    except Exception:  # noqa: BLE001 - unreadable here: transformers' own loading reports it
        found = None
    if found is None or found[0] is None or not has_legacy_experts(found[1]):
        yield None
        return
    from safetensors.torch import load_file, save_file

    files, _ = found
    for name in ("config.json", "generation_config.json"):  # next to the weights (a Hub snapshot may lack them yet)
        _resolve(os.fspath(source), name, hub)
    state_dict = {}
    for file in files:
        state_dict.update(load_file(file))
    logger.info(f"{source}: the routed experts are stored one module per expert (saved before lazoo stored them "
                "stacked); stacking them while loading (save_pretrained writes the stacked layout)")
    with tempfile.TemporaryDirectory(prefix="lazoo-stacked-experts-", ignore_cleanup_errors=True) as folder:
        here = os.path.dirname(files[0])
        for name in os.listdir(here):
            path = os.path.join(here, name)
            if os.path.isfile(path) and not (name.endswith(".safetensors") or name == SAFE_INDEX):
                shutil.copy(path, os.path.join(folder, name))
        save_file({k: v.contiguous() for k, v in stack_legacy_experts(state_dict).items()},
                  os.path.join(folder, SAFE_WEIGHTS), metadata={"format": "pt"})
        yield folder
