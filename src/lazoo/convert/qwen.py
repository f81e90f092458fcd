"""Qwen3.5 and Qwen3-Next checkpoints (transformers' `qwen3_5`, `qwen3_5_moe`, `qwen3_next`) into lazoo folders.

`from_qwen(src, dst)` reads a folder that transformers' Qwen3.5 / Qwen3.5-MoE / Qwen3-Next classes saved (or one
published in their format) and writes a lazoo causal LM computing the same function:

- the Gated DeltaNet layers (`linear_attention`) become lazoo `gated_delta_net` layers: the fused projections
  (`in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` of Qwen3.5; `in_proj_qkvz` / `in_proj_ba` of Qwen3-Next,
  laid out per key-head group) and the one short convolution over q, k, v are split into lazoo's q/k/v/g/b/a
  projections and its three convolutions; grouped value heads stay grouped;
- the attention layers (`full_attention`) become lazoo `softmax` layers with Qwen's sigmoid output gate (the gate
  half of `q_proj`, interleaved per head, becomes `g_proj`), partial rotary position embedding, zero-centred q/k
  RMSNorms and grouped-query key/value heads;
- the decoder's RMSNorms are zero-centred (`(1 + w)·x̂`, lazoo's `zero_centered_norm`), and the MLP is SwiGLU, or a
  routed MoE with a shared expert (Qwen3.5-MoE, Qwen3-Next).

A vision-language folder (`...ForConditionalGeneration`, model type `qwen3_5` / `qwen3_5_moe` with a
`text_config`) converts to its language model: the vision tower is left out, as is a multi-token-prediction head
(`mtp.*`); `converted_from["left_out"]` lists what was, and the card and `lazoo convert` say so.

As for fla checkpoints (`lazoo.convert.fla`), the source folder is untrusted input: every config field is either
expressed by a lazoo option, changes no math, or is refused by name before anything is written; tensor names and
shapes are checked against the lazoo model (built on the meta device) from the safetensors headers alone; NaN or
infinite weights are refused; the folder is written through a staging folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .fla import (
    MAX_CONFIG_BYTES,
    MAX_LAYERS,
    check_destination,
    fill_model,
    meta_model,
    standard_fields,
    tensor_entries,
    tokenizer_files,
    write_folder,
)
from .fla_layers import KINDS
from .source import ConversionError, SourceFolder, TensorEntry, UnsupportedCheckpointError, shown

__all__ = ["QWEN_MODEL_TYPES", "from_qwen", "qwen_config_to_lazoo"]

#: the model types converted: the text configs, and the vision-language configs holding one in `text_config`
TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
WRAPPER_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
QWEN_MODEL_TYPES = (*WRAPPER_MODEL_TYPES, *TEXT_MODEL_TYPES)

#: the text config's fields lazoo reads, with their kinds (fla_layers.KINDS; "?" allows null)
TEXT_FIELDS = {
    "model_type": "name", "vocab_size": "count", "hidden_size": "count", "num_hidden_layers": "count",
    "num_attention_heads": "count", "num_key_value_heads": "count?", "head_dim": "count?",
    "intermediate_size": "count?", "hidden_act": "name", "rms_norm_eps": "number", "tie_word_embeddings": "flag",
    "max_position_embeddings": "count?", "attention_bias": "flag", "attention_dropout": "real",
    "linear_conv_kernel_dim": "count", "linear_key_head_dim": "count", "linear_value_head_dim": "count",
    "linear_num_key_heads": "count", "linear_num_value_heads": "count", "layer_types": "any",
    "full_attention_interval": "count?", "rope_parameters": "any", "rope_theta": "number?",
    "partial_rotary_factor": "number?", "rope_scaling": "any",
    "bos_token_id": "token?", "eos_token_id": "tokens?", "pad_token_id": "token?",
    # mixture of experts
    "num_experts": "count?", "num_experts_per_tok": "count?", "moe_intermediate_size": "count?",
    "shared_expert_intermediate_size": "count?", "norm_topk_prob": "flag?", "decoder_sparse_step": "count?",
    "mlp_only_layers": "any", "router_aux_loss_coef": "real?",
}
#: fields that change no computed function: training-only outputs and inits, kernel hints, the multi-token-prediction
#: head (left out), the attention gate flag (transformers' classes always gate)
NO_MATH_FIELDS = {"initializer_range", "use_cache", "output_router_logits", "mamba_ssm_dtype", "attn_output_gate",
                  "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "layer_norm_epsilon"}
#: fields of a vision-language wrapper config besides `text_config` (the vision tower, which is left out)
WRAPPER_FIELDS = {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                  "vision_end_token_id", "tie_word_embeddings", "model_type"}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
#: Qwen's layer kinds -> lazoo mechanisms
LAYER_KINDS = {"linear_attention": "gated_delta_net", "full_attention": "softmax"}


def refuse(field: str, value, why: str):
    raise UnsupportedCheckpointError(f"config field {field!r} = {shown(value)}: {why}; nothing was converted")


def malformed(field: str, value, why: str):
    raise ConversionError(f"config field {field!r} = {shown(value)}: {why}; nothing was converted")


def check_kinds(cfg: dict, prefix: str, kinds: dict[str, str] = TEXT_FIELDS) -> None:
    """Every field of `kinds` present in `cfg` holds a value of its kind (null where the kind ends in "?"), else a
    ConversionError naming the field (`prefix` + its name)."""
    for field, kind in kinds.items():
        if field not in cfg or (cfg[field] is None and kind.endswith("?")):
            continue
        test, what = KINDS[kind.rstrip("?")]
        if not test(cfg[field]):
            malformed(prefix + field, cfg[field], f"expected {what}{' or null' if kind.endswith('?') else ''}")


# ============================================================================ the config
def text_config(cfg: dict) -> tuple[dict, str, bool, list[str]]:
    """(the text config, the field prefix to name its fields by, whether the head is tied, what is left out) of a
    Qwen config (a text config, or a vision-language one holding it in `text_config`)."""
    model_type = cfg.get("model_type")
    if model_type not in QWEN_MODEL_TYPES:
        refuse("model_type", model_type, f"lazoo converts {', '.join(QWEN_MODEL_TYPES)} here")
    if model_type not in WRAPPER_MODEL_TYPES:
        return cfg, "", cfg.get("tie_word_embeddings", False), []
    unknown = sorted(set(cfg) - WRAPPER_FIELDS - standard_fields())
    if unknown:
        refuse(unknown[0], cfg[unknown[0]], f"a field of {model_type!r} that lazoo does not know")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        malformed("text_config", text, "expected the language model's config (an object)")
    expected = WRAPPER_MODEL_TYPES[model_type]
    if text.get("model_type", expected) != expected:
        malformed("text_config.model_type", text.get("model_type"), f"a {model_type} folder holds a {expected}")
    text = {"model_type": expected, **text}
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    left_out = ["the vision tower (vision_config, model.visual.*)"] if "vision_config" in cfg else []
    return text, "text_config.", tied, left_out


def rope_fields(text: dict, prefix: str, head_dim: int, default_factor: float = 0.25) -> tuple[float, int]:
    """(rope θ, rotary dim) from `rope_parameters` (or the older top-level `rope_theta` /
    `partial_rotary_factor`, `default_factor` where neither says). With the text positions Qwen3.5 gives every
    multimodal section the same position, so its sectioned rope is the plain one."""
    if text.get("rope_scaling") is not None:
        refuse(prefix + "rope_scaling", text["rope_scaling"], "lazoo's attention has plain RoPE only")
    rope = text.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        malformed(prefix + "rope_parameters", rope, "expected an object")
    extra = sorted(set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section",
                                "mrope_interleaved"})
    if extra:
        refuse(f"{prefix}rope_parameters.{extra[0]}", rope[extra[0]], "lazoo's attention has plain RoPE only")
    if rope.get("rope_type", "default") != "default":
        refuse(prefix + "rope_parameters.rope_type", rope.get("rope_type"), "lazoo's attention has plain RoPE only")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", default_factor))
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if not KINDS["number"][0](value):
            malformed(f"{prefix}rope_parameters.{name}", value, "expected a positive finite number")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        refuse(f"{prefix}rope_parameters.partial_rotary_factor", factor,
               f"head_dim {head_dim} · factor must be an even number of channels up to head_dim")
    return float(theta), rotary_dim


def _layer_types(text: dict, prefix: str, n: int) -> list[str]:
    kinds = text.get("layer_types")
    if kinds is None:
        interval = text.get("full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not all(k in LAYER_KINDS for k in kinds):
        malformed(prefix + "layer_types", kinds, f"expected {n} entries, each one of {sorted(LAYER_KINDS)}")
    return [LAYER_KINDS[k] for k in kinds]


def _moe_fields(text: dict, prefix: str, n: int) -> dict[str, Any]:
    """lazoo's MoE fields of a Qwen3.5-MoE or Qwen3-Next config (empty for a dense one)."""
    experts = text.get("num_experts") or 0
    if text["model_type"] == "qwen3_5_text" or experts == 0:
        return {}
    for field in ("num_experts_per_tok", "moe_intermediate_size"):
        if text.get(field) is None:
            malformed(prefix + field, None, "a mixture-of-experts config needs it")
    if text["num_experts_per_tok"] > experts:
        malformed(prefix + "num_experts_per_tok", text["num_experts_per_tok"], f"more than num_experts = {experts}")
    if text["model_type"] == "qwen3_next":
        only, step = text.get("mlp_only_layers") or [], text.get("decoder_sparse_step") or 1
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            malformed(prefix + "mlp_only_layers", only, "expected a list of layer numbers")
        moe_layers = [i for i in range(n) if i not in only and (i + 1) % step == 0]
        normalise = bool(text.get("norm_topk_prob", True))
    else:  # Qwen3.5-MoE: every layer, the top-k scores always renormalised
        moe_layers, normalise = list(range(n)), True
    fields = {"moe_num_experts": experts, "moe_top_k": text["num_experts_per_tok"],
              "moe_intermediate_size": text["moe_intermediate_size"], "moe_bias": None,
              "moe_shared_expert_intermediate_size": text.get("shared_expert_intermediate_size") or None,
              "moe_norm_top_k": normalise, "router_aux_loss_coef": float(text.get("router_aux_loss_coef") or 0.0)}
    if moe_layers != list(range(n)):
        fields["moe_layers"] = moe_layers
    return fields


def qwen_config_to_lazoo(cfg: dict) -> tuple[dict[str, Any], list[str]]:
    """(the lazoo config fields with `model_type`, what the conversion leaves out) of a Qwen config dict;
    ConversionError naming the field for a malformed value, UnsupportedCheckpointError for anything lazoo cannot
    express exactly."""
    text, prefix, tied, left_out = text_config(cfg)
    unknown = sorted(set(text) - TEXT_FIELDS.keys() - NO_MATH_FIELDS - standard_fields())
    if unknown:
        refuse(prefix + unknown[0], text[unknown[0]], f"a field of {text['model_type']!r} that lazoo does not know")
    for field in REQUIRED_FIELDS:
        if field not in text:
            raise ConversionError(f"config field {prefix + field!r} is missing; nothing was converted")
    check_kinds(text, prefix)
    if not isinstance(tied, bool):
        malformed("tie_word_embeddings", tied, "expected true or false")
    n = text["num_hidden_layers"]
    if n > MAX_LAYERS:
        malformed(prefix + "num_hidden_layers", n, f"more than {MAX_LAYERS} layers")
    if text.get("hidden_act", "silu") != "silu":
        refuse(prefix + "hidden_act", text["hidden_act"], "lazoo's MLP and Gated DeltaNet use silu")
    if text.get("attention_bias", False):
        refuse(prefix + "attention_bias", True, "lazoo's attention output projection has no bias")
    if text.get("attention_dropout", 0.0) != 0:
        refuse(prefix + "attention_dropout", text["attention_dropout"], "lazoo's attention has no dropout")
    if text.get("mtp_num_hidden_layers"):
        left_out.append("the multi-token-prediction head (mtp.*)")
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv_heads = text.get("num_key_value_heads") or heads
    if heads % kv_heads:
        malformed(prefix + "num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if v_heads % k_heads:
        malformed(prefix + "linear_num_value_heads", v_heads, f"must be a multiple of linear_num_key_heads = "
                  f"{k_heads}")
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    eps = float(text.get("rms_norm_eps", 1e-6))
    theta, rotary_dim = rope_fields(text, prefix, head_dim)
    layer_types = _layer_types(text, prefix, n)
    mixer_kwargs = {}
    if "softmax" in layer_types:
        mixer_kwargs["softmax"] = {
            "num_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads, "head_dim": head_dim,
            "qkv_bias": False, "use_rope": True, "rope_theta": theta, "rotary_dim": rotary_dim,
            "qk_rmsnorm": True, "qk_rmsnorm_eps": eps, "qk_rmsnorm_zero_centered": True, "output_gate": True}
    if "gated_delta_net" in layer_types:
        mixer_kwargs["gated_delta_net"] = {
            "num_heads": k_heads, "head_k_dim": dk, "expand_v": dv / dk,
            "num_v_heads": None if v_heads == k_heads else v_heads,
            "use_short_conv": True, "conv_size": text.get("linear_conv_kernel_dim", 4), "conv_bias": False,
            "short_conv_targets": "qkv", "conv_activation": "silu", "qk_activation": None, "v_activation": None,
            "use_beta": True, "beta_bias": False, "allow_neg_eigval": False, "qk_norm": "l2",
            "output_norm": True, "output_norm_affine": True, "output_gate": True, "gate_activation": "silu",
            "norm_eps": eps}
    moe = _moe_fields(text, prefix, n)
    dense = text.get("intermediate_size")
    if dense is None and (not moe or "moe_layers" in moe):
        malformed(prefix + "intermediate_size", None, "the dense MLP layers need it")
    fields = {
        "model_type": "lazoo_hybrid", "vocab_size": text["vocab_size"], "hidden_size": hidden,
        "num_hidden_layers": n, "num_attention_heads": heads,
        "intermediate_size": dense or moe["moe_intermediate_size"],
        "layer_types": layer_types, "mixer_kwargs": mixer_kwargs, "sliding_window": None, "use_short_conv": None,
        "rms_norm_eps": eps, "zero_centered_norm": True, "tie_word_embeddings": tied,
        "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id"),
        "pad_token_id": text.get("pad_token_id"), **moe,
    }
    if text.get("max_position_embeddings") is not None:
        fields["max_position_embeddings"] = text["max_position_embeddings"]
    return fields, left_out


# ============================================================================ the weights
@dataclass(frozen=True)
class Piece:
    """A lazoo tensor made from source tensors: `take(*sources) -> tensor` (a slice, a rearrangement, a stack)."""

    sources: tuple[str, ...]
    take: Callable[..., torch.Tensor]


def piece(source: str, take: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Piece:
    """A lazoo tensor made from one source tensor (as it is, or `take(source)`)."""
    return Piece((source,), take or _whole)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start:stop]


def _grouped_rows(groups: int, widths: tuple[int, ...], part: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Part `part` of each of `groups` row groups laid out as [w_0, w_1, ...] (Qwen's per-head q|gate of the
    attention q_proj, and Qwen3-Next's per-key-head q|k|v|z and b|a)."""
    start = sum(widths[:part])

    def take(t: torch.Tensor) -> torch.Tensor:
        grouped = t.reshape(groups, sum(widths), *t.shape[1:])
        return grouped[:, start:start + widths[part]].reshape(groups * widths[part], *t.shape[1:])

    return take


def _gdn_pieces(src: str, dst: str, mixer: dict, next_layout: bool) -> dict[str, Piece]:
    hk, dk = mixer["num_heads"], mixer["head_k_dim"]
    hv = mixer["num_v_heads"] or hk
    dv = int(dk * mixer["expand_v"])
    key, value = hk * dk, hv * dv
    pieces = {f"{dst}.{name}": piece(f"{src}.{name}") for name in ("A_log", "dt_bias")}
    pieces[f"{dst}.o_norm.weight"] = piece(f"{src}.norm.weight")
    pieces[f"{dst}.o_proj.weight"] = piece(f"{src}.out_proj.weight")
    spans = {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}
    for name, (start, stop) in spans.items():
        pieces[f"{dst}.short_conv.convs.{name}.weight"] = piece(f"{src}.conv1d.weight", _rows(start, stop))
    if next_layout:  # in_proj_qkvz / in_proj_ba: per key head [q, k, v (m heads), z (m heads)] and [b (m), a (m)]
        m = hv // hk
        widths = (dk, dk, m * dv, m * dv)
        for part, name in enumerate(("q_proj", "k_proj", "v_proj", "g_proj")):
            pieces[f"{dst}.{name}.weight"] = piece(f"{src}.in_proj_qkvz.weight", _grouped_rows(hk, widths, part))
        for part, name in enumerate(("b_proj", "a_proj")):
            pieces[f"{dst}.{name}.weight"] = piece(f"{src}.in_proj_ba.weight", _grouped_rows(hk, (m, m), part))
    else:
        for name, (start, stop) in spans.items():
            pieces[f"{dst}.{name}_proj.weight"] = piece(f"{src}.in_proj_qkv.weight", _rows(start, stop))
        for ours, theirs in (("g_proj", "in_proj_z"), ("b_proj", "in_proj_b"), ("a_proj", "in_proj_a")):
            pieces[f"{dst}.{ours}.weight"] = piece(f"{src}.{theirs}.weight")
    return pieces


def _attention_pieces(src: str, dst: str, mixer: dict) -> dict[str, Piece]:
    heads, head_dim = mixer["num_heads"], mixer["head_dim"]
    pieces = {f"{dst}.{name}.weight": piece(f"{src}.{name}.weight")
              for name in ("k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    for part, name in enumerate(("q_proj", "g_proj")):  # q_proj's rows: per head [query (D), gate (D)]
        pieces[f"{dst}.{name}.weight"] = piece(f"{src}.q_proj.weight", _grouped_rows(heads, (head_dim,) * 2, part))
    return pieces


def stacked(*experts: torch.Tensor) -> torch.Tensor:
    return torch.stack(experts)


def _gate_up_stacked(*gates_and_ups: torch.Tensor) -> torch.Tensor:
    """[E, 2I, D] from E gate and then E up projections ([I, D] each): gate rows first in each expert."""
    e = len(gates_and_ups) // 2
    return torch.stack([torch.cat([g, u]) for g, u in zip(gates_and_ups[:e], gates_and_ups[e:])])


def per_expert_piece(name: str, prefix: str, experts: int, projections: tuple[str, str, str]) -> Piece:
    """lazoo's stacked `experts.gate_up_proj` or `experts.down_proj` (`name`) from one module per expert
    (`{prefix}.{e}.{projection}.weight`, the projections named (gate, up, down))."""
    gate, up, down = (tuple(f"{prefix}.{e}.{proj}.weight" for e in range(experts)) for proj in projections)
    return Piece(gate + up, _gate_up_stacked) if name == "experts.gate_up_proj" else Piece(down, stacked)


def _mlp_pieces(src: str, dst: str, model_names: list[str], names: set[str], experts: int) -> dict[str, Piece]:
    """The dense MLP's or the MoE's tensors: lazoo's names from the model's, each from Qwen's name for it (the router
    is Qwen's `gate`); the routed experts from Qwen's stacked tensors where the folder holds them, else stacked from
    its one module per expert (`experts.{e}.gate_proj.weight`, ..., as the published checkpoints store them)."""
    pieces = {}
    for name in (n[len(dst) + 1:] for n in model_names if n.startswith(dst + ".")):
        if name.startswith("experts.") and f"{src}.{name}" not in names:
            pieces[f"{dst}.{name}"] = per_expert_piece(name, f"{src}.experts", experts,
                                                       ("gate_proj", "up_proj", "down_proj"))
            continue
        pieces[f"{dst}.{name}"] = piece(f"{src}.{re.sub(r'^router[.]', 'gate.', name)}")
    return pieces


def decoder_plan(fields: dict) -> dict[str, Piece]:
    """The pieces every transformers decoder of this shape has: the embedding, the final norm, the head (unless
    tied) and each layer's two norms (`input_layernorm`, `post_attention_layernorm`)."""
    plan = {"model.embed_tokens.weight": piece("embed_tokens.weight"), "model.norm.weight": piece("norm.weight")}
    if not fields["tie_word_embeddings"]:
        plan["lm_head.weight"] = piece("lm_head.weight")
    for i in range(fields["num_hidden_layers"]):
        plan[f"model.layers.{i}.input_norm.weight"] = piece(f"layers.{i}.input_layernorm.weight")
        plan[f"model.layers.{i}.post_mixer_norm.weight"] = piece(f"layers.{i}.post_attention_layernorm.weight")
    return plan


def tensor_plan(fields: dict, model, next_layout: bool, names: set[str]) -> dict[str, Piece]:
    """lazoo tensor name -> the piece of a Qwen tensor (by its name inside the text model, `layers.0.…`) it is."""
    model_names = list(model.state_dict())
    plan = decoder_plan(fields)
    for i, kind in enumerate(fields["layer_types"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        mixer = fields["mixer_kwargs"][kind]
        if kind == "gated_delta_net":
            plan.update(_gdn_pieces(f"{src}.linear_attn", f"{dst}.mixer", mixer, next_layout))
        else:
            plan.update(_attention_pieces(f"{src}.self_attn", f"{dst}.mixer", mixer))
        plan.update(_mlp_pieces(f"{src}.mlp", f"{dst}.mlp", model_names, names, fields.get("moe_num_experts", 0)))
    return plan


#: prefixes of the text model's tensors in the folders transformers writes: ...ForConditionalGeneration,
#: ...ForCausalLM; the ones left out (the vision tower, the multi-token-prediction head)
TEXT_PREFIXES = ("model.language_model.", "model.")
LEFT_OUT_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def source_names(entries: dict[str, TensorEntry], prefixes: tuple[str, ...] = TEXT_PREFIXES,
                 left_out: tuple[str, ...] = LEFT_OUT_PREFIXES,
                 family: str = "a Qwen language model") -> dict[str, str]:
    """The checkpoint's tensor names inside the text model (`layers.0.…`, `lm_head.weight`) -> the names in the
    files: the first of `prefixes` a name starts with is taken off; the tensors under `left_out` (the vision tower
    and the multi-token-prediction head) are left out; any other tensor is refused, as not one of `family`."""
    names = {}
    for name, entry in entries.items():
        if name.startswith(left_out):
            continue
        inner = name if name == "lm_head.weight" else next(
            (name[len(p):] for p in prefixes if name.startswith(p)), None)
        if inner is None:
            raise UnsupportedCheckpointError(f"{entry.file}: tensor {name!r} is not one of {family}; "
                                             "nothing was converted")
        if inner in names:
            raise UnsupportedCheckpointError(f"{entry.file}: tensors {names[inner]!r} and {name!r} are the same "
                                             "parameter; nothing was converted")
        names[inner] = name
    return names


_LAYER = re.compile(r"^layers\.(0|[1-9][0-9]{0,8})\.")


def check_layer_count(names: dict[str, str], entries: dict[str, TensorEntry], n: int, config_file: Path) -> None:
    """The files hold layers 0 .. n - 1: checked before any model is built."""
    found = {int(m.group(1)) for inner in names if (m := _LAYER.match(inner))}
    if found != set(range(n)):
        held = f"{len(found)} layers" + (f" ({min(found)} to {max(found)})" if found else "")
        raise ConversionError(f"{config_file}: num_hidden_layers = {n}, but the safetensors files hold tensors of "
                              f"{held}; nothing was converted")
    embed = names.get("embed_tokens.weight")
    if embed is not None and len(entries[embed].shape) != 2:
        raise ConversionError(f"{entries[embed].file}: {embed!r} is not a matrix; nothing was converted")


def check_plan(plan: dict[str, Piece], names: dict[str, str], entries: dict[str, TensorEntry], model,
               config_file: Path) -> None:
    """Every tensor the model takes comes from a checkpoint tensor of the right shape, and every checkpoint tensor
    (but a tied head) is used: shapes checked on the meta device, from the headers alone."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    missing = sorted(set(shapes) - set(plan))
    if missing:
        raise UnsupportedCheckpointError(f"{config_file}: the lazoo model has tensors no Qwen tensor fills: "
                                         f"{missing[:5]}; nothing was converted")
    used = set()
    for ours, part in plan.items():
        absent = [source for source in part.sources if source not in names]
        if absent:
            raise UnsupportedCheckpointError(f"{config_file}: the model it describes needs tensor {absent[0]!r}, "
                                             "which the safetensors files lack; nothing was converted")
        files = [entries[names[source]] for source in part.sources]
        first = names[part.sources[0]]
        try:
            shape = tuple(part.take(*(torch.empty(e.shape, device="meta") for e in files)).shape)
        except RuntimeError as err:
            raise ConversionError(f"{files[0].file}: tensor {first!r} of shape {list(files[0].shape)} does not fit "
                                  f"as {config_file} implies ({one_line_error(err)}); nothing was converted") from err
        if shape != shapes[ours]:
            raise ConversionError(f"{files[0].file}: tensor {first!r} has shape {list(files[0].shape)}, but "
                                  f"{config_file} implies {list(shapes[ours])} for its part {ours!r}; nothing was "
                                  "converted")
        used.update(part.sources)
    unused = sorted(set(names) - used - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    if unused:
        theirs = names[unused[0]]
        raise UnsupportedCheckpointError(f"{entries[theirs].file}: tensor {theirs!r} is not in the model "
                                         f"{config_file} describes; nothing was converted")


def one_line_error(err: Exception) -> str:
    return " ".join(str(err).split())[:200]


def read_plan(source: SourceFolder, plan: dict[str, Piece], names: dict[str, str],
              entries: dict[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """The lazoo tensors of `plan`, each source tensor read once (file by file, front to back); NaN or infinite
    values refused naming the tensor."""
    wanted = sorted({names[source] for part in plan.values() for source in part.sources},
                    key=lambda n: (str(entries[n].file), entries[n].start))
    read = {}
    for theirs in wanted:
        tensor = source.read_tensor(entries[theirs], theirs)
        finite = torch.isfinite(tensor)
        if not finite.all():
            raise ConversionError(f"{entries[theirs].file}: tensor {theirs!r} holds {int((~finite).sum())} NaN or "
                                  "infinite values; nothing was converted")
        read[theirs] = tensor
    return {ours: part.take(*(read[names[s]] for s in part.sources)).contiguous() for ours, part in plan.items()}


# ============================================================================ the folder
def read_source_config(source: SourceFolder, config: dict | None, to_lazoo, family: str):
    """(config.json's path, its dict, `to_lazoo(dict)`) of the folder `source` (`config`: the dict when already
    read); a folder without config.json is refused naming `family`, an error of `to_lazoo` names the file."""
    config_file = source.file("config.json", required=False)
    if config_file is None:
        raise ConversionError(f"{source.root} has no config.json: give a {family} checkpoint folder")
    cfg = config if config is not None else source.read_json(config_file, limit=MAX_CONFIG_BYTES)
    try:
        return config_file, cfg, to_lazoo(cfg)
    except ConversionError as err:
        raise type(err)(f"{config_file}: {err}") from err


def convert_model_folder(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None, to_lazoo, plan_of,
                         family: str) -> tuple[Path, list[str]]:
    """Convert a transformers folder whose language model's tensors are all under `model.` (and `lm_head`) with
    nothing left out (Kimi Linear, GraniteMoeHybrid): the lazoo config fields from `to_lazoo(config dict)`, each
    lazoo tensor from the pieces of `plan_of(fields, meta model, checkpoint names)`; `family` names the kind of folder
    in errors. Refuses before writing anything, as `from_fla` does. Returns (`dst`, [])."""
    source, dst = SourceFolder(src), Path(dst)
    config_file, cfg, fields = read_source_config(source, config, to_lazoo, family)
    check_destination(dst)
    copied = tokenizer_files(source)
    entries = tensor_entries(source)
    names = source_names(entries, prefixes=("model.",), left_out=(), family=f"a {family} language model")
    check_layer_count(names, entries, fields["num_hidden_layers"], config_file)
    converted_from = {"format": "transformers", "model_type": cfg["model_type"], "source": source.root.name,
                      "left_out": []}
    model = meta_model(fields, config_file, converted_from)
    plan = plan_of(fields, model, set(names))
    check_plan(plan, names, entries, model, config_file)
    model = fill_model(model, read_plan(source, plan, names, entries))
    return write_folder(model, copied, dst), []


def from_qwen(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None = None) -> tuple[Path, list[str]]:
    """Convert the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next folder `src` into a new lazoo folder `dst` (see the module
    docstring); `config` is src's config.json when already read. Returns (`dst`, what was left out). Refuses before
    writing anything, as `from_fla` does."""
    source, dst = SourceFolder(src), Path(dst)
    config_file = source.file("config.json", required=False)
    if config_file is None:
        raise ConversionError(f"{src} has no config.json: give a Qwen3.5 or Qwen3-Next checkpoint folder")
    cfg = config if config is not None else source.read_json(config_file, limit=MAX_CONFIG_BYTES)
    try:
        fields, left_out = qwen_config_to_lazoo(cfg)
    except ConversionError as err:
        raise type(err)(f"{config_file}: {err}") from err
    check_destination(dst)
    copied = tokenizer_files(source)
    entries = tensor_entries(source)
    names = source_names(entries)
    check_layer_count(names, entries, fields["num_hidden_layers"], config_file)
    converted_from = {"format": "transformers", "model_type": cfg["model_type"], "source": source.root.name,
                      "left_out": left_out}
    model = meta_model(fields, config_file, converted_from)
    plan = tensor_plan(fields, model, next_layout=cfg["model_type"] == "qwen3_next", names=set(names))
    check_plan(plan, names, entries, model, config_file)
    model = fill_model(model, read_plan(source, plan, names, entries))
    return write_folder(model, copied, dst), left_out
