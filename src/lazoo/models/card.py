"""Model cards: `write_model_card(model, folder)` fills `model_cards/README_template.md` from the config.

`LazooPreTrainedModel.save_pretrained` writes the card as `README.md` unless the folder already has one.
The template's placeholders are `{{name}}`; every one must be filled (an unknown one raises). A written card
ends with `CARD_MARKER`, so the command line can tell its own cards (which it may rewrite) from a user's.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..registry import get as get_mechanism

#: the template ships inside the package (lazoo/model_cards/), so wheel installs have it too
TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "model_cards" / "README_template.md"

#: what the card says about the model's head: (pipeline tag, description, Auto class), by class-name suffix
_HEADS = {
    "ForSequenceClassification": ("text-classification", "sequence classifier",
                                  "AutoModelForSequenceClassification"),
    "ForCausalLM": ("text-generation", "causal language model", "AutoModelForCausalLM"),
}
_BASE_HEAD = ("feature-extraction", "base model (hidden states)", "AutoModel")


#: the last line of every card `write_model_card` writes
CARD_MARKER = "<!-- model card written by lazoo (lazoo.models.card); `lazoo card` rewrites it -->"

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
#: config fields shown in the card's configuration table
_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "sliding_window", "use_short_conv", "max_position_embeddings",
                  "tie_word_embeddings", "dtype")


def load_template() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def _cell(value: Any) -> str:
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except TypeError:  # e.g. a torch.dtype
            text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _head(model, head: str | None = None) -> tuple[str, str, str]:
    name = head or type(model).__name__
    return next((head for suffix, head in _HEADS.items() if name.endswith(suffix)), _BASE_HEAD)


def _mechanism_row(name: str) -> str:
    """The card's table row of mechanism `name`, from its declaration (`lazoo.registry`). Notation: q_t, k_t, v_t
    per head, state S_t [dv, dk]."""
    m = get_mechanism(name)
    return f"| `{name}` | {_cell(m.title)} | {_cell(m.equation)} | {_cell(m.source)} |"


def _layer_pattern(layer_types: list[str | None]) -> str:
    layer_types = [t or "no mixer" for t in layer_types]  # None: a layer of its feed-forward alone
    counts = Counter(layer_types)
    listing = ", ".join(f"`{t}`" for t in layer_types) if len(layer_types) <= 12 else (
        ", ".join(f"`{t}` × {n}" for t, n in counts.items()))
    return listing


def _metrics_text(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "No metrics were given when this card was written."
    rows = ["| metric | value |", "|---|---|"]
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        rows.append(f"| {_cell(str(key))} | {_cell(value)} |")
    return "\n".join(rows)


def _conversion_note(config) -> str | None:
    """What the card says of a model converted from another library's checkpoint (`config.converted_from`, set by
    `lazoo convert`)."""
    source = getattr(config, "converted_from", None)
    if not isinstance(source, dict):
        return None
    note = (f"Converted by `lazoo convert` from the {source.get('format', '?')} checkpoint "
            f"`{source.get('source', '?')}` "
            f"({source.get('format', '?')} model type `{source.get('model_type', '?')}`): the weights are that "
            "checkpoint's, unchanged (fused projections split into lazoo's); its training data is the source's.")
    left_out = source.get("left_out")
    if isinstance(left_out, list) and left_out:
        note += " Left out of the conversion: " + "; ".join(str(part) for part in left_out) + "."
    return note


def card_fields(model, metrics: dict[str, Any] | None = None, training_data: str | None = None,
                model_path: str | None = None, head: str | None = None) -> dict[str, str]:
    """The values of the template's placeholders for `model` (a lazoo model, or a lazoo config; `head` names the
    model class the card is for when `model` is a config, e.g. "ForCausalLM")."""
    config = getattr(model, "config", model)
    layer_types = list(config.layer_types)
    mechanisms = [name for name in dict.fromkeys(layer_types) if name is not None]
    mechanism_table = "\n".join(
        ["| name | mechanism | state update / read-out (per head) | source |", "|---|---|---|---|"]
        + [_mechanism_row(m) for m in mechanisms])
    config_rows = ["| field | value |", "|---|---|"]
    for field in _CONFIG_FIELDS:
        if hasattr(config, field) and getattr(config, field) is not None:
            config_rows.append(f"| `{field}` | {_cell(getattr(config, field))} |")
    for name in mechanisms:  # the resolved hyper-parameters of each mechanism
        options = {k: v for k, v in config.mixer_options(name).items() if k != "backend"}
        config_rows.append(f"| `{name}` options | {_cell(options)} |")
    if hasattr(model, "num_parameters"):
        config_rows.append(f"| parameters | {model.num_parameters():,} |")
    name = getattr(config, "_name_or_path", "") or ""
    model_name = Path(model_path).name if model_path else (Path(name).name if name else config.model_type)
    summary = " + ".join(get_mechanism(m).title for m in mechanisms)
    if len(mechanisms) > 1:
        summary = f"a hybrid of {summary}"
    pipeline_tag, task_description, auto_class = _head(model, head)
    tags = ["lazoo", config.model_type] + [f"lazoo-{m.replace('_', '-')}" for m in mechanisms]
    if any(m not in ("softmax", "sliding_window") for m in mechanisms):
        tags.append("linear-attention")
    return {
        "model_name": model_name or config.model_type,
        "model_type": config.model_type,
        "pipeline_tag": pipeline_tag,
        "task_description": task_description,
        "auto_class": auto_class,
        "model_path": model_path or "path/to/this/folder",
        "mechanism_summary": summary,
        "mechanism_table": mechanism_table,
        "num_layers": str(len(layer_types)),
        "layer_pattern": _layer_pattern(layer_types),
        "config_table": "\n".join(config_rows),
        "training_data": training_data or _conversion_note(config) or "Not stated when this card was written.",
        "metrics": _metrics_text(metrics),
        "tags": "\n".join(f"- {t}" for t in dict.fromkeys(tags)),
    }


def render_model_card(model, metrics=None, training_data=None, model_path=None, template: str | None = None,
                      head: str | None = None) -> str:
    """The filled card text; raises if the template has a placeholder with no value."""
    fields = card_fields(model, metrics=metrics, training_data=training_data, model_path=model_path, head=head)
    template = load_template() if template is None else template
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(fields))
    if missing:
        raise ValueError(f"model card template has placeholders with no value: {missing}; known: {sorted(fields)}")
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], template)


def is_lazoo_card(path: str | os.PathLike) -> bool:
    """Whether the file at `path` is a model card `write_model_card` wrote (it holds `CARD_MARKER`)."""
    try:
        return CARD_MARKER in Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def write_model_card(model, folder: str | os.PathLike, metrics: dict[str, Any] | None = None,
                     training_data: str | None = None, overwrite: bool = True) -> Path:
    """Write `folder/README.md`: the model card of `model` (mechanisms, equations, sources, config summary,
    training data and measured metrics, if given). `overwrite=False` replaces only a README.md that lazoo
    wrote and raises FileExistsError for any other (the user's own card)."""
    folder = Path(folder)
    path = folder / "README.md"
    if not overwrite and path.exists() and not is_lazoo_card(path):
        raise FileExistsError(f"{path} is not a model card lazoo wrote; it is kept (move it away, or pass "
                              "overwrite=True to replace it)")
    text = render_model_card(model, metrics=metrics, training_data=training_data, model_path=str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text.rstrip()}\n\n{CARD_MARKER}\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the cards of the ready configs
def _generated_line(config_file: str) -> str:
    return f"<!-- generated from {config_file} by `lazoo cards`; edit the config or the template, not this file -->"


def config_cards(config_dir: str | os.PathLike) -> dict[str, str]:
    """`{card file name: text}`: the model card of every lazoo language-model config in `config_dir` (the card a
    model built from it gets, without metrics), named after the config (`vla-small.json` -> `vla-small.md`).
    Configs of other model types (vision) are left out."""
    from ..presets import build_config
    from ..registry import mechanisms

    language_models = {"lazoo_hybrid"} | {m.model_type for m in mechanisms().values()}
    cards = {}
    for path in sorted(Path(config_dir).glob("*.json")):
        try:
            model_type = json.loads(path.read_text(encoding="utf-8")).get("model_type")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{path}: not a JSON config object ({err})") from err
        if model_type not in language_models:
            continue
        config = build_config(str(path))
        config._name_or_path = path.stem
        text = render_model_card(config, head="ForCausalLM")  # the ready configs are language models
        cards[f"{path.stem}.md"] = f"{text.rstrip()}\n\n{_generated_line(f'{Path(config_dir).name}/{path.name}')}\n" \
                                   f"{CARD_MARKER}\n"
    return cards


def stale_config_cards(config_dir, card_dir) -> list[str]:
    """The card files in `card_dir` that differ from `config_cards(config_dir)`: missing, outdated, or written by
    lazoo for a config that no longer exists."""
    card_dir = Path(card_dir)
    cards = config_cards(config_dir)
    stale = [name for name, text in cards.items()
             if not (card_dir / name).is_file() or (card_dir / name).read_text(encoding="utf-8") != text]
    stale += [p.name for p in sorted(card_dir.glob("*.md")) if p.name not in cards and is_lazoo_card(p)
              and "by `lazoo cards`" in p.read_text(encoding="utf-8")]
    return stale


def write_config_cards(config_dir, card_dir) -> list[Path]:
    """Write the cards of `config_cards(config_dir)` into `card_dir` and remove the cards lazoo generated for
    configs that are gone. A file of a card's name that lazoo did not write is refused (FileExistsError, before
    anything is written). Returns the files written."""
    card_dir = Path(card_dir)
    cards = config_cards(config_dir)
    foreign = [card_dir / n for n in cards if (card_dir / n).exists() and not is_lazoo_card(card_dir / n)]
    if foreign:
        raise FileExistsError(f"{foreign[0]} is not a card lazoo wrote; move it away (it is kept)")
    card_dir.mkdir(parents=True, exist_ok=True)
    for name in stale_config_cards(config_dir, card_dir):
        if name not in cards:
            (card_dir / name).unlink()
    written = []
    for name, text in cards.items():
        (card_dir / name).write_text(text, encoding="utf-8")
        written.append(card_dir / name)
    return written
