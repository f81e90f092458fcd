"""`lazoo card` (the model card README.md of a saved model) and `lazoo cards` (the cards of the ready configs,
or with --check the stale ones named)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config_checks import check_dtype_field, check_saved_model_folder
from ..user_input import CLIError, check_new_folder, check_text, read_text_file

__all__ = ["cmd_card", "cmd_cards"]


def cmd_card(args) -> int:
    from ..models.card import write_model_card

    path = check_saved_model_folder(args.model_dir)
    metrics = _card_metrics(args.metrics)
    check_text("--training-data", args.training_data)
    try:
        card = write_model_card(_card_model(path), path, metrics=metrics, training_data=args.training_data,
                                overwrite=args.overwrite)
    except FileExistsError as err:
        raise CLIError(f"{path / 'README.md'} is not a model card lazoo wrote; pass --overwrite to replace it") from err
    print(f"[lazoo] wrote {card}")
    return 0


def _card_model(path: Path):
    """The saved model's config, as a model built on the meta device (to count parameters without
    loading weights), or the config alone if that fails."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if not hasattr(config, "layer_types") or not hasattr(config, "mixer_options"):
        raise CLIError(f"{str(path)!r} holds a {config.model_type!r} model, not a lazoo one")
    auto = AutoModelForCausalLM
    if any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
        auto = AutoModelForSequenceClassification
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
        model.config._name_or_path = str(path)
        return model
    except Exception:  # noqa: BLE001 - the card is still written from the config
        return config


def _card_metrics(given: str | None) -> dict | None:
    """--metrics: a JSON object, given as text or as the path of a .json file."""
    if given is None:
        return None
    if os.path.isdir(given):
        raise CLIError(f"--metrics: {given!r} is a folder; give a .json file or a JSON object")
    text = read_text_file("--metrics", given) if os.path.isfile(given) else given
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError as err:
        raise CLIError(f"--metrics: not valid JSON ({err}); give a JSON object such as "
                       "'{\"eval_perplexity\": 12.3}' or a path to a .json file") from err
    if not isinstance(metrics, dict):
        raise CLIError(f"--metrics must be a JSON object (name: value), got {type(metrics).__name__}")
    check_text("--metrics", json.dumps(metrics, ensure_ascii=False))  # "\udc80" escapes decode to surrogates
    return metrics


def cmd_cards(args) -> int:
    from ..models.card import write_config_cards

    if not os.path.isdir(args.configs):
        raise CLIError(f"--configs: no such folder {args.configs!r}")
    check_new_folder("--output", args.output)
    _check_card_configs(args.configs)
    try:
        if args.check:
            return _check_cards(args.configs, args.output)
        written = write_config_cards(args.configs, args.output)
    except (FileExistsError, ValueError) as err:
        raise CLIError(str(err)) from err
    print(f"[lazoo] wrote {len(written)} cards into {args.output}")
    return 0


def _check_cards(configs: str, output: str) -> int:
    """`lazoo cards --check`: a verdict line either way (silence would not tell success from a check that did not
    run), the stale cards named; status 1 if there are any."""
    from ..models.card import config_cards, stale_config_cards

    folder, sources = os.path.join(output, ""), os.path.join(configs, "")
    stale = stale_config_cards(configs, output)
    if not stale:
        print(f"[lazoo] {folder}: all {len(config_cards(configs))} cards are up to date with {sources}")
        return 0
    for name in stale:
        print(f"stale: {os.path.join(output, name)}")
    print(f"[lazoo] {folder}: {len(stale)} stale card(s); run `lazoo cards --configs {configs} --output {output}` "
          "to regenerate them")
    return 1


def _check_card_configs(folder: str) -> None:
    """Each language-model config in `folder` builds (the cards would stop at a bad one without naming it;
    files that are not JSON objects are named by the cards themselves)."""
    from ..models import MODEL_CLASSES
    from ..presets import build_config

    for path in sorted(Path(folder).glob("*.json")):
        try:
            fields = json.loads(read_text_file("--configs", str(path)))
        except ValueError:
            continue
        if isinstance(fields, dict) and fields.get("model_type") in MODEL_CLASSES:
            check_dtype_field(path)
            try:
                build_config(str(path))
            except (ValueError, TypeError, KeyError) as err:
                raise CLIError(f"--configs: {path}: {err}") from err
