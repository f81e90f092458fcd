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

#: the template ships inside the package (lazoo/model_cards/), so wheel installs have it too
TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "model_cards" / "README_template.md"

#: what the card says about the model's head: (pipeline tag, description, Auto class), by class-name suffix
_HEADS = {
    "ForSequenceClassification": ("text-classification", "sequence classifier",
                                  "AutoModelForSequenceClassification"),
    "ForCausalLM": ("text-generation", "causal language model", "AutoModelForCausalLM"),
}
_BASE_HEAD = ("feature-extraction", "base model (hidden states)", "AutoModel")


#: mechanism -> (full name, state update / read-out per head, source). Notation: q_t, k_t, v_t per head,
#: state S_t [dv, dk]; the seeds are the papers this repository implements (shared/MECHANISMS.md).
MECHANISM_INFO: dict[str, tuple[str, str, str]] = {
    "softmax": ("Softmax attention", "o_t = Σ_{s≤t} softmax_s(q_t·k_s / √d) v_s (KV cache; optional QK-norm)",
                "Vaswani et al. 2017, Attention Is All You Need"),
    "sliding_window": ("Sliding-window attention", "softmax over the last W positions s ∈ (t−W, t], RoPE",
                       "Beltagy et al. 2020 (Longformer); Online Vector-Quantized attention (2026) §8.2"),
    "linear": ("Linear attention", "S_t = S_{t−1} + v_t φ(k_t)ᵀ, z_t = z_{t−1} + φ(k_t); o_t = S_t φ(q_t) / φ(q_t)·z_t",
               "Katharopoulos et al. 2020, Transformers are RNNs"),
    "gated_linear": ("Gated linear attention (scalar decay)", "S_t = a_t S_{t−1} + v_t k_tᵀ, a_t ∈ (0, 1) per head; o_t = S_t q_t",
                     "RetNet / Mamba-2 style decay (linear-attention survey)"),
    "delta_net": ("DeltaNet", "S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, β_t = σ(w_β·x_t); o_t = S_t q_t",
                  "Schlag et al. 2021; Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule"),
    "gated_delta_net": ("Gated DeltaNet", "S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ; o_t = S_t q_t",
                        "Yang, Kautz, Hatamizadeh 2024, Gated Delta Networks"),
    "vla": ("Variational Linear Attention", "S_t = S_{t−1} + (v_t − S_{t−1} k̂_t) α̂_tᵀ, α̂_t = A_t k̂_t / ‖A_t k̂_t‖ "
            "(A_t: Sherman–Morrison penalty geometry, refreshed every P steps); o_t = S_t q_t / max(z_t·q_t, ε)",
            "Variational Linear Attention: Stable Associative Memory for Long-Context Transformers (2026)"),
    "ela": ("Exact Linear Attention", "S_t = S_{t−1} + v_t ψ(k_t)ᵀ, C_t = C_{t−1} + ψ(k_t); o_t = S_t φ(q_t) / φ(q_t)·C_t",
            "Ou, Exact Linear Attention (2026)"),
    "gla": ("Gated Linear Attention (GLA)", "S_t = S_{t−1} diag(a_t) + v_t k_tᵀ, a_t ∈ (0, 1)^dk; o_t = S_t q_t",
            "Yang et al. 2023, Gated Linear Attention Transformers with Hardware-Efficient Training"),
    "delta_product": ("DeltaProduct", "S_t = S_{t−1} Π_j (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) + Σ_j β_{t,j} v_{t,j} k_{t,j}ᵀ "
                      "(n_h Householder steps per token); o_t = S_t q_t",
                      "Siems et al. 2025, DeltaProduct"),
    "ovq": ("Online Vector-Quantized attention", "per chunk c: O_c = softmax(β Q_c [D_k; K_c]ᵀ + [log c; 0] + causal) "
            "[D_v; V_c]; then n_new = N_{Lc} − N_{L(c−1)} (N_t = tN/(t+N)) lowest-similarity keys become centroids, "
            "the others move theirs by (x − μ)/(c_old + c_chunk)",
            "Online Vector Quantized Attention (2026), arXiv:2602.03922"),
    "vq": ("VQ-attention (learned key codebook)", "o_t = softmax(β q_t Cᵀ + log c_t) D_v,t: causal softmax over keys "
           "replaced by their nearest code; counts c_t and value means D_v,t per code",
           "Lingle 2023, Transformer-VQ; Online Vector Quantized Attention (2026) §2.2"),
    "rls": ("Recursive least squares (Mesa layer)", "S_t = argmin_S Σ_{i≤t} γ^{t−i}‖v_i − S k_i‖² + λ‖S‖_F² "
            "= VK_t (KK_t + λI)^{-1} (exact ridge regression; Sherman–Morrison per token for γ = 1); o_t = S_t q_t",
            "Wang et al. 2025, Test-time regression (eq 11); von Oswald et al. 2023/2025, MesaNet"),
    "local_linear": ("Local-linear (p = 1) attention", "o_t = M⁰ of min Σ_{i≤t} w_i‖v_i − M⁰ − M¹(k_i − q_t)‖² + ρ‖M¹‖², "
                     "w_i = softmax_i(β q_t·k_i) (KV cache, quadratic like softmax)",
                     "Wang et al. 2025, Test-time regression (eqs 52–54)"),
    "ttt_linear": ("TTT-Linear (test-time training)", "W_t = W_{t'} − Σ_{t'<s≤t} η_s (W_{t'} k_s − v_s) k_sᵀ (mini-batch GD "
                   "on ½‖W k_s − v_s‖² from a learned W₀; t' = end of the previous mini-batch); o_t = W_t q_t",
                   "Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive Hidden States"),
    "ttt_mlp": ("TTT-MLP (test-time training)", "f(x) = W2 gelu(W1 x); W_t = W_{t'} − Σ_{t'<s≤t} η_s ∇ℓ_s(W_{t'}), "
                "ℓ_s = ½‖f(k_s) − v_s‖², from learned W₀; o_t = f(q_t; W_t)",
                "Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive Hidden States"),
    "titans": ("Titans neural memory (linear memory)", "S_t = η_t S_{t−1} − θ_t (M_{t'} k_t − v_t) k_tᵀ, "
               "M_t = (1 − α_t) M_{t−1} + S_t (gradients at the mini-batch start M_{t'}); o_t = M_t q_t",
               "Behrouz, Zhong, Mirrokni 2024, Titans: Learning to Memorize at Test Time"),
}

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


def _head(model) -> tuple[str, str, str]:
    name = type(model).__name__
    return next((head for suffix, head in _HEADS.items() if name.endswith(suffix)), _BASE_HEAD)


def _mechanism_row(name: str) -> str:
    if name in MECHANISM_INFO:
        title, equation, source = MECHANISM_INFO[name]
    else:  # a mechanism added without an entry here: its mixer's docstring
        from ..layers.mixers import mixer_class

        doc = (mixer_class(name).__doc__ or name).strip().split("\n\n")[0]
        title, equation, source = name, " ".join(doc.split()), "see the lazoo sources"
    return f"| `{name}` | {_cell(title)} | {_cell(equation)} | {_cell(source)} |"


def _layer_pattern(layer_types: list[str]) -> str:
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


def card_fields(model, metrics: dict[str, Any] | None = None, training_data: str | None = None,
                model_path: str | None = None) -> dict[str, str]:
    """The values of the template's placeholders for `model` (a lazoo model, or a lazoo config)."""
    config = getattr(model, "config", model)
    layer_types = list(config.layer_types)
    mechanisms = list(dict.fromkeys(layer_types))
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
    summary = " + ".join(MECHANISM_INFO.get(m, (m,))[0] for m in mechanisms)
    if len(mechanisms) > 1:
        summary = f"a hybrid of {summary}"
    pipeline_tag, task_description, auto_class = _head(model)
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
        "training_data": training_data or "Not stated when this card was written.",
        "metrics": _metrics_text(metrics),
        "tags": "\n".join(f"- {t}" for t in dict.fromkeys(tags)),
    }


def render_model_card(model, metrics=None, training_data=None, model_path=None, template: str | None = None) -> str:
    """The filled card text; raises if the template has a placeholder with no value."""
    fields = card_fields(model, metrics=metrics, training_data=training_data, model_path=model_path)
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
