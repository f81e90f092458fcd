"""Kimi Linear checkpoints (transformers' `kimi_linear`; "Kimi Linear: An Expressive, Efficient Attention
Architecture", Kimi Team, 2025) into lazoo folders.

`from_kimi(src, dst)` reads a folder that transformers' `KimiLinearForCausalLM` saved (or one published in that
format) and writes a lazoo causal LM computing the same function:

- the KDA layers (`linear_attention`) become lazoo `kda` layers: q/k/v/o and β projections as they are, the three
  short convolutions (`q_conv1d` / `k_conv1d` / `v_conv1d`, or the one `conv1d` over q, k, v that transformers holds
  in memory), the low-rank forget gate (`f_a_proj`, `f_b_proj`, `A_log` per head, `dt_bias`) and output gate
  (`g_a_proj`, `g_b_proj`) and the gated output norm (`o_norm`);
- the attention layers (`full_attention`) become lazoo `mla` layers (multi-head latent attention without positional
  encoding, transformers' parameter names);
- the MLP of each layer is the dense SwiGLU MLP (`mlp_layer_types` "dense", or the first `first_k_dense_replace`
  layers) or the MoE (`block_sparse_moe`): sigmoid router scores with the score-correction bias choosing the
  experts, group-limited top-k (`n_group` / `topk_group`), the weights renormalised (`norm_topk_prob`) and times
  `routed_scaling_factor`, and a shared expert without a gate of width `moe_intermediate_size · n_shared_experts`
  (lazoo's RoutedMoE with `moe_router_score="sigmoid"`, `moe_score_correction_bias`, `moe_num_groups`,
  `moe_top_k_groups`, `moe_routed_scaling_factor`, `moe_shared_expert_gate=False`); the experts (`experts.{e}.w1`
  gate, `w3` up, `w2` down, or the stacked `gate_up_proj` / `down_proj`) are stacked.

The config fields are read under either of the names transformers uses (its attributes, e.g. `n_group`, and the
names it writes, e.g. `num_expert_group`), and as published (`linear_attn_config`, `first_k_dense_replace`).
Refused, naming the field: another activation than silu, attention dropout, `num_key_value_heads` other than
`num_attention_heads` (MLA's keys and values have one head per query head), a router other than sigmoid, the MoE in
only some layers by `moe_layer_freq`, MLA with rotary positions (`mla_use_nope` false), rope scaling, a
multi-token-prediction head and no shared expert (`n_shared_experts` 0). As for the other converters, the folder is
untrusted input: every field is expressed, changes no math or is refused before anything is written; tensor names
and shapes are checked on the meta device from the safetensors headers alone; NaN or infinite weights are refused;
the folder is written through a staging folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import fla
from .fla_layers import KINDS
from .qwen import (
    Piece,
    convert_model_folder,
    decoder_plan,
    malformed,
    per_expert_piece,
    piece,
    refuse,
)
from .source import ConversionError

__all__ = ["KIMI_MODEL_TYPES", "from_kimi", "kimi_config_to_lazoo"]

KIMI_MODEL_TYPES = ("kimi_linear",)

#: each setting -> (the names it is stored under, its kind (fla_layers.KINDS; "?" allows null), transformers'
#: default); the first name is transformers' attribute, the others what save_pretrained or the published folders write
SETTINGS: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "vocab_size": (("vocab_size",), "count", None),
    "hidden_size": (("hidden_size",), "count", None),
    "num_hidden_layers": (("num_hidden_layers",), "count", None),
    "intermediate_size": (("intermediate_size",), "count", 9216),
    "moe_intermediate_size": (("moe_intermediate_size",), "count", 1024),
    "num_attention_heads": (("num_attention_heads",), "count", 32),
    "num_key_value_heads": (("num_key_value_heads",), "count?", None),
    "n_shared_experts": (("n_shared_experts", "num_shared_experts"), "real", 1),
    "routed_scaling_factor": (("routed_scaling_factor",), "number", 2.446),
    "kv_lora_rank": (("kv_lora_rank",), "count", 512),
    "q_lora_rank": (("q_lora_rank",), "count?", None),
    "qk_rope_head_dim": (("qk_rope_head_dim",), "real", 64),
    "v_head_dim": (("v_head_dim",), "count", 128),
    "qk_nope_head_dim": (("qk_nope_head_dim",), "count", 128),
    "n_group": (("n_group", "num_expert_group"), "count", 1),
    "topk_group": (("topk_group",), "count?", 1),
    "num_experts_per_tok": (("num_experts_per_tok", "num_experts_per_token"), "count", 8),
    "norm_topk_prob": (("norm_topk_prob", "moe_renormalize"), "flag", True),
    "num_local_experts": (("num_local_experts", "num_experts"), "count", 256),
    "hidden_act": (("hidden_act",), "name", "silu"),
    "max_position_embeddings": (("max_position_embeddings", "model_max_length"), "count?", None),
    "rms_norm_eps": (("rms_norm_eps",), "number", 1e-5),
    "tie_word_embeddings": (("tie_word_embeddings",), "flag", False),
    "attention_bias": (("attention_bias",), "flag", False),
    "attention_dropout": (("attention_dropout",), "real?", 0.0),
    "mlp_layer_types": (("mlp_layer_types",), "any", None),
    "layer_types": (("layer_types",), "any", None),
    "linear_head_dim": (("linear_head_dim",), "count", 128),
    "linear_num_heads": (("linear_num_heads",), "count", 32),
    "linear_conv_kernel_dim": (("linear_conv_kernel_dim",), "count", 4),
    "bos_token_id": (("bos_token_id",), "token?", None),
    "eos_token_id": (("eos_token_id",), "tokens?", None),
    "pad_token_id": (("pad_token_id",), "token?", None),
    # as the published folders write them (transformers reads them once, when it builds its config)
    "linear_attn_config": (("linear_attn_config",), "any", None),
    "first_k_dense_replace": (("first_k_dense_replace",), "real", 1),
    "moe_layer_freq": (("moe_layer_freq",), "real", 1),
    "use_grouped_topk": (("use_grouped_topk",), "flag", True),
    "moe_router_activation_func": (("moe_router_activation_func",), "name", "sigmoid"),
    "mla_use_nope": (("mla_use_nope",), "flag", True),
    "num_nextn_predict_layers": (("num_nextn_predict_layers",), "real", 0),
    "rope_scaling": (("rope_scaling",), "any", None),
}
#: fields that change no computed function: inits, training-only outputs, tensor-parallel hints, the rotary base of
#: a model without rotary positions, and the two that transformers derives from the head dims (checked against them)
NO_MATH_FIELDS = {"initializer_range", "use_cache", "output_router_logits", "pretraining_tp", "rope_theta",
                  "head_dim", "qk_head_dim", "keys_to_ignore_at_inference"}
#: Kimi's layer kinds -> lazoo mechanisms
LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
#: the published linear_attn_config's keys -> the settings they give
LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                    "short_conv_kernel_size": "linear_conv_kernel_dim"}


# ============================================================================ the config
def _settings(cfg: dict) -> dict[str, Any]:
    """Every setting of SETTINGS from `cfg` (transformers' default where it is absent), after refusing an unknown
    field, a setting stored under two names with two values, and a value of the wrong kind; `out["field"]` maps each
    setting to the name the folder stores it under (its first name where absent), for the errors to name."""
    known = {name for names, _, _ in SETTINGS.values() for name in names}
    unknown = sorted(set(cfg) - known - NO_MATH_FIELDS - fla.standard_fields() - {"model_type"})
    if unknown:
        refuse(unknown[0], cfg[unknown[0]], "a field of 'kimi_linear' that lazoo does not know")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if field not in cfg:
            raise ConversionError(f"config field {field!r} is missing; nothing was converted")
    out: dict[str, Any] = {"field": {}}
    for setting, (names, kind, default) in SETTINGS.items():
        given = [name for name in names if name in cfg]
        out["field"][setting] = given[0] if given else names[0]
        if len(given) > 1 and any(cfg[name] != cfg[given[0]] for name in given[1:]):
            malformed(given[1], cfg[given[1]], f"the same setting as {given[0]!r} = {cfg[given[0]]!r}, another value")
        value = cfg[given[0]] if given else default
        if given and not (value is None and kind.endswith("?")):
            test, what = KINDS[kind.rstrip("?")]
            if not test(value):
                malformed(given[0], value, f"expected {what}{' or null' if kind.endswith('?') else ''}")
        out[setting] = value
    for setting in ("n_shared_experts", "qk_rope_head_dim", "first_k_dense_replace", "moe_layer_freq",
                    "num_nextn_predict_layers"):  # integers that may be 0
        value = out[setting]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            malformed(out["field"][setting], value, "expected an integer >= 0")
    if out["num_hidden_layers"] > fla.MAX_LAYERS:
        malformed("num_hidden_layers", out["num_hidden_layers"], f"more than {fla.MAX_LAYERS} layers")
    return out


def _linear_attn_config(s: dict) -> dict[str, Any]:
    """The published `linear_attn_config` read as transformers reads it: its head dim, head count and convolution
    size override the settings, its 1-based `full_attn_layers` / `kda_layers` give the layer kinds (where
    `layer_types` is absent)."""
    linear = s["linear_attn_config"]
    if linear is None:
        return {}
    if not isinstance(linear, dict):
        malformed("linear_attn_config", linear, "expected an object")
    extra = sorted(set(linear) - set(LINEAR_ATTN_KEYS) - {"full_attn_layers", "kda_layers"})
    if extra:
        refuse(f"linear_attn_config.{extra[0]}", linear[extra[0]], "a field lazoo does not know")
    for key, setting in LINEAR_ATTN_KEYS.items():
        if key in linear:
            if not KINDS["count"][0](linear[key]):
                malformed(f"linear_attn_config.{key}", linear[key], f"expected {KINDS['count'][1]}")
            s[setting] = linear[key]
    return linear


def _layer_types(s: dict, linear: dict) -> list[str]:
    n, kinds = s["num_hidden_layers"], s["layer_types"]
    if kinds is None and "full_attn_layers" in linear and "kda_layers" in linear:
        kinds = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            layers = linear[key]
            if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       and 1 <= i <= n for i in layers):
                malformed(f"linear_attn_config.{key}", layers, f"expected a list of layer numbers from 1 to {n}")
            for i in layers:
                kinds[i - 1] = kind
    elif kinds is None:  # transformers' default: attention in layers 4, 8, ... (counted from 0)
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not all(k in LAYER_KINDS for k in kinds):
        malformed("layer_types", kinds, f"expected {n} entries, each one of {sorted(LAYER_KINDS)}")
    return [LAYER_KINDS[k] for k in kinds]


def _moe_layers(s: dict) -> list[int]:
    n, kinds = s["num_hidden_layers"], s["mlp_layer_types"]
    if kinds is None:
        kinds = ["dense" if i < s["first_k_dense_replace"] else "sparse" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not all(k in ("dense", "sparse") for k in kinds):
        malformed("mlp_layer_types", kinds, f"expected {n} entries, each 'dense' or 'sparse'")
    return [i for i, kind in enumerate(kinds) if kind == "sparse"]


def _refusals(s: dict) -> None:
    """The settings lazoo cannot express (or transformers' class does not compute as the field says)."""
    if s["hidden_act"] != "silu":
        refuse("hidden_act", s["hidden_act"], "lazoo's MLP, MoE and KDA convolutions use silu")
    if s["attention_dropout"]:
        refuse("attention_dropout", s["attention_dropout"], "lazoo's MLA has no dropout")
    kv_heads = s["num_key_value_heads"]
    if kv_heads is not None and kv_heads != s["num_attention_heads"]:
        refuse("num_key_value_heads", kv_heads, f"MLA's keys and values have one head per query head "
               f"(num_attention_heads = {s['num_attention_heads']})")
    if s["moe_router_activation_func"] != "sigmoid":
        refuse("moe_router_activation_func", s["moe_router_activation_func"], "transformers' Kimi Linear routes "
               "with sigmoid scores only")
    if not s["use_grouped_topk"]:
        refuse("use_grouped_topk", False, "transformers' Kimi Linear always limits top-k to the best groups")
    if s["moe_layer_freq"] != 1:
        refuse("moe_layer_freq", s["moe_layer_freq"], "transformers' Kimi Linear puts the MoE in every layer after "
               "the first first_k_dense_replace")
    if not s["mla_use_nope"]:
        refuse("mla_use_nope", False, "transformers' Kimi Linear attention has no rotary positions")
    if s["rope_scaling"] is not None:
        refuse("rope_scaling", s["rope_scaling"], "Kimi Linear's attention has no rotary positions to scale")
    if s["num_nextn_predict_layers"]:
        refuse("num_nextn_predict_layers", s["num_nextn_predict_layers"], "a multi-token-prediction head is not "
               "part of transformers' Kimi Linear")


def kimi_config_to_lazoo(cfg: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a Kimi Linear config dict; ConversionError naming the field
    for a malformed value, UnsupportedCheckpointError for anything lazoo cannot express exactly."""
    if cfg.get("model_type") not in KIMI_MODEL_TYPES:
        refuse("model_type", cfg.get("model_type"), f"lazoo converts {', '.join(KIMI_MODEL_TYPES)} here")
    s = _settings(cfg)
    linear = _linear_attn_config(s)
    _refusals(s)
    n, heads = s["num_hidden_layers"], s["num_attention_heads"]
    dn, dr, dv = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    for field, value in (("head_dim", dr), ("qk_head_dim", dn + dr)):  # derived by transformers
        if field in cfg and cfg[field] != value:
            malformed(field, cfg[field], f"transformers derives {value} from the head dims")
    layer_types = _layer_types(s, linear)
    moe_layers = _moe_layers(s)
    mixer_kwargs = {}
    if "kda" in layer_types:
        mixer_kwargs["kda"] = {"num_heads": s["linear_num_heads"], "head_k_dim": s["linear_head_dim"],
                               "expand_v": 1.0, "num_v_heads": None, "conv_size": s["linear_conv_kernel_dim"],
                               "gate_low_rank_dim": s["linear_head_dim"], "gate_bias": False,
                               "allow_neg_eigval": False, "norm_eps": float(s["rms_norm_eps"])}
    if "mla" in layer_types:
        mixer_kwargs["mla"] = {"num_heads": heads, "q_lora_rank": s["q_lora_rank"], "kv_lora_rank": s["kv_lora_rank"],
                               "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv,
                               "attention_bias": s["attention_bias"], "latent_norm_eps": 1e-6, "use_rope": False}
    fields = {
        "model_type": "lazoo_hybrid", "vocab_size": s["vocab_size"], "hidden_size": s["hidden_size"],
        "num_hidden_layers": n, "num_attention_heads": heads, "intermediate_size": s["intermediate_size"],
        "layer_types": layer_types, "mixer_kwargs": mixer_kwargs, "sliding_window": None, "use_short_conv": None,
        "rms_norm_eps": float(s["rms_norm_eps"]), "zero_centered_norm": False,
        "tie_word_embeddings": s["tie_word_embeddings"], "bos_token_id": s["bos_token_id"],
        "eos_token_id": s["eos_token_id"], "pad_token_id": s["pad_token_id"],
    }
    if s["max_position_embeddings"] is not None:
        fields["max_position_embeddings"] = s["max_position_embeddings"]
    if moe_layers:
        experts, top_k, groups = s["num_local_experts"], s["num_experts_per_tok"], s["n_group"]
        name = s["field"]
        if top_k > experts:
            malformed(name["num_experts_per_tok"], top_k, f"more than {name['num_local_experts']} = {experts}")
        if experts % groups:
            malformed(name["n_group"], groups, f"must divide {name['num_local_experts']} = {experts}")
        top_groups = s["topk_group"] if s["topk_group"] is not None else groups
        if top_groups > groups:
            malformed("topk_group", top_groups, f"more than {name['n_group']} = {groups}")
        if top_groups < groups and experts // groups < 2:
            refuse(name["n_group"], groups, "groups of one expert (transformers' router takes each group's two best "
                   "scores and fails)")
        if top_k > top_groups * (experts // groups):
            malformed(name["num_experts_per_tok"], top_k, f"more than the experts of the topk_group = {top_groups} "
                      "groups")
        if not s["n_shared_experts"]:
            refuse(name["n_shared_experts"], 0, "lazoo converts Kimi Linear's MoE with its shared expert")
        fields.update({
            "moe_num_experts": experts, "moe_top_k": top_k, "moe_intermediate_size": s["moe_intermediate_size"],
            "moe_bias": None, "moe_norm_top_k": s["norm_topk_prob"], "moe_router_score": "sigmoid",
            "moe_score_correction_bias": True, "moe_num_groups": groups,
            "moe_top_k_groups": None if top_groups == groups else top_groups,
            "moe_routed_scaling_factor": float(s["routed_scaling_factor"]),
            "moe_shared_expert_intermediate_size": s["moe_intermediate_size"] * s["n_shared_experts"],
            "moe_shared_expert_gate": False, "router_aux_loss_coef": 0.0})
        if moe_layers != list(range(n)):
            fields["moe_layers"] = moe_layers
    return fields


# ============================================================================ the weights
def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _third(part: int):
    return lambda t: t.chunk(3, dim=0)[part]


class _Names:
    """Picks, of the names a tensor may have (as saved, as transformers holds it in memory), the one the folder
    holds (the first where it holds none, for the missing-tensor error)."""

    def __init__(self, names: set[str]):
        self.names = names

    def __call__(self, *candidates: str) -> str:
        return next((c for c in candidates if c in self.names), candidates[0])


def _kda_pieces(src: str, dst: str, name: _Names) -> dict[str, Piece]:
    pieces = {f"{dst}.{p}.weight": piece(f"{src}.{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "b_proj", "o_norm")}
    for ours, theirs in (("f_proj.0", "f_a_proj"), ("f_proj.1", "f_b_proj")):
        pieces[f"{dst}.{ours}.weight"] = piece(name(f"{src}.{theirs}.weight", f"{src}.forget_gate.{theirs}.weight"))
    for ours, theirs in (("g_proj.0", "g_a_proj"), ("g_proj.1", "g_b_proj")):
        pieces[f"{dst}.{ours}.weight"] = piece(f"{src}.{theirs}.weight")
    pieces[f"{dst}.A_log"] = piece(name(f"{src}.A_log", f"{src}.forget_gate.A_log"), _flat)
    pieces[f"{dst}.dt_bias"] = piece(name(f"{src}.dt_bias", f"{src}.forget_gate.dt_bias"))
    fused = f"{src}.conv1d.weight"
    for part, x in enumerate("qkv"):
        own = f"{src}.{x}_conv1d.weight"
        pieces[f"{dst}.short_conv.convs.{x}.weight"] = piece(own) if name(own, fused) == own \
            else piece(fused, _third(part))
    return pieces


def _mla_pieces(src: str, dst: str, model_names: list[str]) -> dict[str, Piece]:
    """transformers' names are lazoo's: every tensor of the lazoo layer from the one of that name."""
    return {n: piece(f"{src}.{n[len(dst) + 1:]}") for n in model_names if n.startswith(dst + ".")}


def _mlp_pieces(src: str, dst: str, model_names: list[str], name: _Names, experts: int) -> dict[str, Piece]:
    """The dense MLP's or the MoE's tensors (the router is Kimi's `gate`, its bias `gate.e_score_correction_bias`,
    the shared expert `shared_experts`), from `block_sparse_moe` (as saved) or `mlp` (as held in memory)."""
    pieces = {}
    for ours in (n[len(dst) + 1:] for n in model_names if n.startswith(dst + ".")):
        theirs = {"router.weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias"}.get(
            ours, ours.replace("shared_expert.", "shared_experts."))
        source = name(f"{src[0]}.{theirs}", f"{src[1]}.{theirs}")
        if ours.startswith("experts.") and source not in name.names:  # one module per expert, as saved
            pieces[f"{dst}.{ours}"] = per_expert_piece(ours, f"{src[0]}.experts", experts, ("w1", "w3", "w2"))
            continue
        pieces[f"{dst}.{ours}"] = piece(source)
    return pieces


def tensor_plan(fields: dict, model, names: set[str]) -> dict[str, Piece]:
    """lazoo tensor name -> the piece of a Kimi tensor (by its name inside the model, `layers.0.…`) it is."""
    model_names = list(model.state_dict())
    name = _Names(names)
    plan = decoder_plan(fields)
    for i, kind in enumerate(fields["layer_types"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        if kind == "kda":
            plan.update(_kda_pieces(f"{src}.self_attn", f"{dst}.mixer", name))
        else:
            plan.update(_mla_pieces(f"{src}.self_attn", f"{dst}.mixer", model_names))
        plan.update(_mlp_pieces((f"{src}.block_sparse_moe", f"{src}.mlp"), f"{dst}.mlp", model_names, name,
                                fields.get("moe_num_experts", 0)))
    return plan


# ============================================================================ the folder
def from_kimi(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None = None) -> tuple[Path, list[str]]:
    """Convert the Kimi Linear folder `src` into a new lazoo folder `dst` (see the module docstring); `config` is
    src's config.json when already read. Returns (`dst`, what was left out: nothing). Refuses before writing
    anything, as `from_fla` does."""
    return convert_model_folder(src, dst, config, kimi_config_to_lazoo, tensor_plan, "Kimi Linear")
