"""GraniteMoeHybrid checkpoints (transformers' `granitemoehybrid`: Granite 4.0-H) into lazoo folders.

`from_granite(src, dst)` reads a folder that transformers' `GraniteMoeHybridForCausalLM` saved (or one published in
that format) and writes a lazoo causal LM computing the same function:

- the Mamba-2 layers (`layer_types` "mamba" / "linear_attention") become lazoo `mamba2` layers whose tensors keep
  transformers' names and layout (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`), as for Bamba
  (`lazoo.convert.mamba`);
- the attention layers ("attention" / "full_attention") become lazoo `softmax` layers: grouped key/value heads, the
  scores times `attention_multiplier` (lazoo's `softmax_scale`), RoPE on the whole head where
  `position_embedding_type` is "rope" and none otherwise ("nope", or unset);
- every layer's feed-forward part is the MoE (`num_local_experts` > 0): a router whose top-k logits go through a
  softmax (lazoo's softmax over all experts with the top-k weights renormalised, `moe_norm_top_k=True`: the same
  weights), SwiGLU experts stored as `input_linear` [E, 2I, D] (gate rows, then up rows) and `output_linear`
  [E, D, I] (lazoo's stacked `gate_up_proj` / `down_proj` as they are), and the shared MLP added without a gate
  (`moe_shared_expert_gate=False`); with no experts it is the shared MLP alone (lazoo's dense MLP);
- Granite's scaling: the embeddings times `embedding_multiplier`, each residual branch times `residual_multiplier`
  before it is added, the logits divided by `logits_scaling` (lazoo's config fields of the same names).

Refused, naming the field, before anything is written: another activation than silu, attention biases or dropout,
another normalisation than RMSNorm, a `position_embedding_type` other than rope or nope, rope scaling or a rotary
factor other than 1 (transformers' Granite turns the whole head whatever the factor says), a `time_step_limit`
other than (0, inf) (see `lazoo.convert.mamba`), a shared MLP of width 0 beside the experts, an unknown field. As for
the other converters, the folder is untrusted input: tensor names and shapes are checked on the meta device from the
safetensors headers alone; NaN or infinite weights are refused; the folder is written through a staging folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .mamba import common_fields, filled_fields, mamba_layer_options, same_names
from .qwen import (
    Piece,
    convert_model_folder,
    decoder_plan,
    malformed,
    piece,
    refuse,
    rope_fields,
)

__all__ = ["GRANITE_MODEL_TYPES", "from_granite", "granite_config_to_lazoo"]

GRANITE_MODEL_TYPES = ("granitemoehybrid",)

#: the config fields lazoo reads, with their kinds (fla_layers.KINDS; "?" allows null) and transformers' defaults
GRANITE_FIELDS = {
    "model_type": ("name", None), "vocab_size": ("count", None), "hidden_size": ("count", None),
    "num_hidden_layers": ("count", None), "intermediate_size": ("count", 11008),
    "num_attention_heads": ("count", 32), "num_key_value_heads": ("count?", None), "hidden_act": ("name", "silu"),
    "max_position_embeddings": ("count?", 2048), "rms_norm_eps": ("number", 1e-6),
    "tie_word_embeddings": ("flag", False), "attention_bias": ("flag", False), "attention_dropout": ("real?", 0.0),
    "rope_parameters": ("any", None), "rope_theta": ("number?", None), "rope_scaling": ("any", None),
    "partial_rotary_factor": ("number?", None), "position_embedding_type": ("name?", None),
    "embedding_multiplier": ("number", 1.0), "residual_multiplier": ("number", 1.0),
    "logits_scaling": ("number", 1.0), "attention_multiplier": ("number", 1.0),
    "num_local_experts": ("real", 8), "num_experts_per_tok": ("count?", 2), "shared_intermediate_size": ("real", 1024),
    "layer_types": ("any", None), "layers_block_type": ("any", None),
    "mamba_n_heads": ("count", 128), "mamba_n_groups": ("count", 1), "mamba_d_state": ("count", 256),
    "mamba_d_head": ("count?", None), "mamba_d_conv": ("count", 4), "mamba_expand": ("count", 2),
    "mamba_conv_bias": ("flag", True), "mamba_proj_bias": ("flag", False), "time_step_limit": ("any", None),
    "normalization_function": ("name", "rmsnorm"),  # written by the published folders
    "bos_token_id": ("token?", 1), "eos_token_id": ("tokens?", 2), "pad_token_id": ("token?", None),
}
#: fields that change no computed function: inits, chunk lengths, training-only outputs (the router's balance loss,
#: which transformers adds only with output_router_logits: the converted model's loss is the cross-entropy alone)
GRANITE_NO_MATH = {"initializer_range", "init_method", "use_cache", "mamba_chunk_size", "output_router_logits",
                   "router_aux_loss_coef", "num_logits_to_keep", "use_mamba_kernels"}
#: Granite's layer kinds, under their newer and older names -> lazoo mechanisms
LAYER_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "softmax", "attention": "softmax"}


# ============================================================================ the config
def _layer_types(cfg: dict) -> list[str]:
    """The lazoo mechanism of each layer, from `layer_types` (or its alias `layers_block_type`); every layer Mamba-2
    where neither is given, as transformers does."""
    n = cfg["num_hidden_layers"]
    given = [field for field in ("layer_types", "layers_block_type") if cfg.get(field) is not None]
    if len(given) == 2 and cfg["layer_types"] != cfg["layers_block_type"]:
        malformed("layers_block_type", cfg["layers_block_type"], "the same setting as 'layer_types', another value")
    kinds = cfg[given[0]] if given else ["linear_attention"] * n
    if not isinstance(kinds, list) or len(kinds) != n or not all(isinstance(k, str) and k in LAYER_KINDS
                                                                   for k in kinds):
        malformed(given[0] if given else "layer_types", kinds,
                  f"expected {n} entries, each one of {sorted(LAYER_KINDS)}")
    return [LAYER_KINDS[k] for k in kinds]


def _refusals(cfg: dict) -> None:
    """The settings lazoo cannot express (or that transformers' class does not compute as the field says)."""
    if cfg["hidden_act"] != "silu":
        refuse("hidden_act", cfg["hidden_act"], "lazoo's MLP, experts and Mamba-2 convolution use silu")
    if cfg["attention_bias"]:
        refuse("attention_bias", True, "lazoo's attention output projection has no bias")
    if cfg["attention_dropout"]:
        refuse("attention_dropout", cfg["attention_dropout"], "lazoo's attention has no dropout")
    if cfg["normalization_function"] != "rmsnorm":
        refuse("normalization_function", cfg["normalization_function"], "transformers' GraniteMoeHybrid (and lazoo) "
               "normalise with RMSNorm")
    if cfg["position_embedding_type"] not in (None, "nope", "rope"):
        refuse("position_embedding_type", cfg["position_embedding_type"], "lazoo converts rope and nope (none)")


def _attention_options(cfg: dict) -> dict[str, Any]:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg["num_key_value_heads"] or heads
    if hidden % heads:
        malformed("num_attention_heads", heads, f"must divide hidden_size = {hidden}")
    if heads % kv_heads:
        malformed("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    head_dim = hidden // heads
    options = {"num_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads, "head_dim": head_dim,
               "qkv_bias": False, "qk_norm": False, "qk_rmsnorm": False, "output_gate": False,
               "softmax_scale": float(cfg["attention_multiplier"]), "use_rope": False}
    if cfg["position_embedding_type"] == "rope":  # transformers builds no rotary embedding otherwise
        given = {field: value for field, value in cfg.items() if value is not None}  # not the defaults of null
        theta, rotary_dim = rope_fields(given, "", head_dim, default_factor=1.0)
        if rotary_dim != head_dim:
            refuse("rope_parameters.partial_rotary_factor", rotary_dim / head_dim, "transformers' GraniteMoeHybrid "
                   "turns the whole head whatever the factor says")
        options.update(use_rope=True, rope_theta=theta, rotary_dim=None)
    return options


def _feed_forward_fields(cfg: dict) -> dict[str, Any]:
    """lazoo's MLP fields: the routed MoE with its ungated shared expert, or the shared MLP alone as the dense MLP."""
    experts, shared = cfg["num_local_experts"], cfg["shared_intermediate_size"]
    for field, value in (("num_local_experts", experts), ("shared_intermediate_size", shared)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            malformed(field, value, "expected an integer >= 0")
    if not experts:
        return {"intermediate_size": shared}
    top_k = cfg["num_experts_per_tok"]
    if top_k is None or top_k > experts:
        malformed("num_experts_per_tok", top_k, f"expected a count up to num_local_experts = {experts}")
    if not shared:
        refuse("shared_intermediate_size", 0, "a shared MLP of width 0 beside the experts: lazoo's MoE then has no "
               "shared expert to take its empty tensors")
    return {"intermediate_size": cfg["intermediate_size"], "moe_num_experts": experts, "moe_top_k": top_k,
            "moe_intermediate_size": cfg["intermediate_size"], "moe_bias": None, "moe_norm_top_k": True,
            "moe_router_score": "softmax", "moe_shared_expert_intermediate_size": shared,
            "moe_shared_expert_gate": False, "router_aux_loss_coef": 0.0}


def granite_config_to_lazoo(cfg: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a GraniteMoeHybrid config dict; ConversionError naming the
    field for a malformed value, UnsupportedCheckpointError for anything lazoo cannot express exactly."""
    if cfg.get("model_type") not in GRANITE_MODEL_TYPES:
        refuse("model_type", cfg.get("model_type"), f"lazoo converts {', '.join(GRANITE_MODEL_TYPES)} here")
    if cfg.get("mamba_d_head") == "auto":  # as transformers reads it: expand · hidden_size / heads
        cfg = {**cfg, "mamba_d_head": None}
    cfg = filled_fields(cfg, GRANITE_FIELDS, GRANITE_NO_MATH)
    _refusals(cfg)
    layer_types = _layer_types(cfg)
    mixer_kwargs = {}
    if "mamba2" in layer_types:
        mixer_kwargs["mamba2"] = mamba_layer_options(
            cfg, heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state", groups="mamba_n_groups",
            conv="mamba_d_conv", expand="mamba_expand", conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias",
            eps=cfg["rms_norm_eps"])
    if "softmax" in layer_types:
        mixer_kwargs["softmax"] = _attention_options(cfg)
    return {**common_fields(cfg, cfg["rms_norm_eps"]), "num_attention_heads": cfg["num_attention_heads"],
            "layer_types": layer_types, "mixer_kwargs": mixer_kwargs, **_feed_forward_fields(cfg),
            "embedding_multiplier": float(cfg["embedding_multiplier"]),
            "residual_multiplier": float(cfg["residual_multiplier"]), "logits_scaling": float(cfg["logits_scaling"])}


# ============================================================================ the weights
def _half(part: int):
    """Rows [:S] (part 0, the gate) or [S:] (part 1, the up projection) of a shared MLP's `input_linear` [2S, D]."""
    return lambda t: t[:t.shape[0] // 2] if part == 0 else t[t.shape[0] // 2:]


def _held_name(names: set[str], saved: str, in_memory: str) -> str:
    """`in_memory` (the name transformers holds a tensor under) where the folder has it, else `saved` (the name its
    save_pretrained and the published folders write)."""
    return in_memory if in_memory in names and saved not in names else saved


def _feed_forward_pieces(src: str, dst: str, moe: bool, names: set[str]) -> dict[str, Piece]:
    """The shared MLP as lazoo's dense MLP or as the MoE's shared expert, and the MoE's router and experts."""
    shared = f"{dst}.shared_expert" if moe else dst
    pieces = {f"{shared}.gate_proj.weight": piece(f"{src}.shared_mlp.input_linear.weight", _half(0)),
              f"{shared}.up_proj.weight": piece(f"{src}.shared_mlp.input_linear.weight", _half(1)),
              f"{shared}.down_proj.weight": piece(f"{src}.shared_mlp.output_linear.weight")}
    if moe:
        block = f"{src}.block_sparse_moe"
        for ours, saved, in_memory in (("router.weight", "router.layer.weight", "router.weight"),
                                       ("experts.gate_up_proj", "input_linear.weight", "experts.gate_up_proj"),
                                       ("experts.down_proj", "output_linear.weight", "experts.down_proj")):
            pieces[f"{dst}.{ours}"] = piece(_held_name(names, f"{block}.{saved}", f"{block}.{in_memory}"))
    return pieces


def tensor_plan(fields: dict, model, names: set[str]) -> dict[str, Piece]:
    """lazoo tensor name -> the checkpoint tensor (by its name inside the model, `layers.0.…`) it is made from."""
    model_names = list(model.state_dict())
    plan = decoder_plan(fields)
    moe = bool(fields.get("moe_num_experts"))
    for i, kind in enumerate(fields["layer_types"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        plan.update(same_names(model_names, f"{dst}.mixer", f"{src}.{'mamba' if kind == 'mamba2' else 'self_attn'}"))
        plan.update(_feed_forward_pieces(src, f"{dst}.mlp", moe, names))
    return plan


# ============================================================================ the folder
def from_granite(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None = None) -> tuple[Path, list[str]]:
    """Convert the GraniteMoeHybrid folder `src` into a new lazoo folder `dst` (see the module docstring); `config`
    is src's config.json when already read. Returns (`dst`, what was left out: nothing). Refuses before writing
    anything, as `from_fla` does."""
    return convert_model_folder(src, dst, config, granite_config_to_lazoo, tensor_plan, "GraniteMoeHybrid")
