"""Mamba-2 checkpoints of transformers (`mamba2`) and fla (flash-linear-attention's `mamba2`), and transformers'
hybrid with attention (`bamba`), into lazoo folders.

`from_mamba(src, dst)` reads a folder that transformers' `Mamba2ForCausalLM` or `BambaForCausalLM` or fla's
`Mamba2ForCausalLM` saved (or one published in their format) and writes a lazoo causal LM computing the same
function:

- the Mamba-2 layers become lazoo `mamba2` layers, whose parameters have transformers' names and layout (`in_proj`,
  `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`): each tensor is copied as it is;
- `mamba2`: a layer is `x + mixer(RMSNorm(x))` with no MLP; lazoo's decoder layer has an MLP after the mixer, so the
  converted model has `intermediate_size` 0 (an MLP of width 0 adds exactly 0; its norm is there, of weight 1);
- fla's `mamba2` (told from transformers' by a field only fla writes, e.g. `norm_eps`, `dt_min`, `rmsnorm`): the same
  layer, block and tensor names as transformers' under fla's config names (`norm_eps`; the initialisation ranges
  `dt_min`, `dt_max`, `dt_init_floor`, `A_init_range` kept as lazoo's options); fla's options lazoo does not compute
  are refused by name: `D_has_hdim` (a skip weight per channel), `rmsnorm` false (no output norm),
  `norm_before_gate`, a `dt_limit` other than (0, inf), an activation other than silu;
- `bamba`: the attention layers (`attn_layer_indices`) become lazoo `softmax` layers (grouped-query key/value heads,
  RoPE on the first half of each head's channels), and every layer has Bamba's SwiGLU MLP.

(`granitemoehybrid` folders convert through `lazoo.convert.granite`, `nemotron_h` folders through
`lazoo.convert.nemotron`.)

What lazoo does not copy, and why: `time_step_limit` other than (0, inf) is refused (transformers clamps dt to it in
its chunked form but not when it decodes one token, so the model has no one function to copy); `residual_in_fp32`
(the residual stream kept in float32 when the model runs in 16 bits) is a precision choice: lazoo keeps the residual
in the model's dtype, the same numbers in float32 and float64. As for fla and Qwen checkpoints (`lazoo.convert.fla`,
`lazoo.convert.qwen`), the folder is untrusted input: every config field is expressed, changes no math, or is refused
by name before anything is written; every tensor name and shape is checked on the meta device from the safetensors
headers alone; NaN or infinite weights are refused; the folder is written through a staging folder.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from . import fla
from .fla_layers import KINDS, is_layer_number
from .qwen import (
    Piece,
    check_kinds,
    check_layer_count,
    check_plan,
    malformed,
    piece,
    read_plan,
    refuse,
    rope_fields,
    source_names,
)
from .source import ConversionError, SourceFolder

__all__ = ["MAMBA_MODEL_TYPES", "from_mamba", "mamba_config_to_lazoo"]

#: the model types converted, and those refused by the first field lazoo cannot express
CONVERTED_MODEL_TYPES = ("mamba2", "bamba")
MAMBA_MODEL_TYPES = CONVERTED_MODEL_TYPES

#: the config fields lazoo reads, with their kinds (fla_layers.KINDS; "?" allows null) and transformers' defaults
MAMBA2_FIELDS = {
    "model_type": ("name", None), "vocab_size": ("count", None), "hidden_size": ("count", None),
    "num_hidden_layers": ("count", None), "num_heads": ("count", 128), "head_dim": ("count", 64),
    "state_size": ("count", 128), "expand": ("count", 2), "conv_kernel": ("count", 4), "n_groups": ("count", 8),
    "use_bias": ("flag", False), "use_conv_bias": ("flag", True), "hidden_act": ("name", "silu"),
    "layer_norm_epsilon": ("number", 1e-5), "time_step_limit": ("any", [0.0, math.inf]),
    "tie_word_embeddings": ("flag", False),
    "time_step_min": ("number", 0.001), "time_step_max": ("number", 0.1), "time_step_floor": ("real", 1e-4),
    "bos_token_id": ("token?", None), "eos_token_id": ("tokens?", None), "pad_token_id": ("token?", None),
    # written by earlier releases (Mamba-Codestral's folder has them): the output norm is an RMSNorm after the gate
    "norm_before_gate": ("flag", False), "rms_norm": ("flag", True),
}
BAMBA_FIELDS = {
    "model_type": ("name", None), "vocab_size": ("count", None), "hidden_size": ("count", None),
    "num_hidden_layers": ("count", None), "num_attention_heads": ("count", None),
    "num_key_value_heads": ("count?", None), "intermediate_size": ("count", None), "hidden_act": ("name", "silu"),
    "rms_norm_eps": ("number", 1e-5), "tie_word_embeddings": ("flag", False),
    "max_position_embeddings": ("count?", None),
    "attention_bias": ("flag", False), "attention_dropout": ("real?", 0.0), "mlp_bias": ("flag", False),
    "attn_layer_indices": ("any", None), "rope_parameters": ("any", None), "rope_theta": ("number?", None),
    "partial_rotary_factor": ("number?", None), "rope_scaling": ("any", None),
    "mamba_n_heads": ("count", 128), "mamba_d_head": ("count?", None), "mamba_n_groups": ("count", 1),
    "mamba_d_state": ("count", 256), "mamba_d_conv": ("count", 4), "mamba_expand": ("count", 2),
    "mamba_conv_bias": ("flag", True), "mamba_proj_bias": ("flag", False),
    "time_step_limit": ("any", [0.0, math.inf]),
    "z_loss_coefficient": ("real?", 0.0),
    "attn_rotary_emb": ("count?", None),  # written by earlier releases: the rotated channels of each head
    "bos_token_id": ("token?", None), "eos_token_id": ("tokens?", None), "pad_token_id": ("token?", None),
}
#: fields that change no computed function: inits, kernel hints and chunk lengths, how many logits generate keeps,
#: the residual stream's precision (see the module docstring)
MAMBA2_NO_MATH = {"initializer_range", "use_cache", "chunk_size", "time_step_rank", "rescale_prenorm_residual",
                  "residual_in_fp32"}
BAMBA_NO_MATH = {"initializer_range", "use_cache", "mamba_chunk_size", "num_logits_to_keep", "use_mamba_kernels"}
#: the fields of fla's Mamba-2 (flash-linear-attention 0.6.0, model type `mamba2` as well), with fla's defaults
FLA_MAMBA2_FIELDS = {
    "model_type": ("name", None), "vocab_size": ("count", None), "hidden_size": ("count", None),
    "num_hidden_layers": ("count", None), "num_heads": ("count", None), "head_dim": ("count", 64),
    "state_size": ("count", 128), "expand": ("number", 2), "conv_kernel": ("count", 4), "n_groups": ("count", 1),
    "use_bias": ("flag", False), "use_conv_bias": ("flag", True), "hidden_act": ("name", "silu"),
    "norm_eps": ("number", 1e-5), "rmsnorm": ("flag", True), "norm_before_gate": ("flag", False),
    "D_has_hdim": ("flag", False), "dt_limit": ("any", None), "A_init_range": ("any", [1, 16]),
    "dt_min": ("number", 0.001), "dt_max": ("number", 0.1), "dt_init_floor": ("number", 1e-4),
    "tie_word_embeddings": ("flag", False),
    "bos_token_id": ("token?", 1), "eos_token_id": ("tokens?", 2), "pad_token_id": ("token?", 0),
}
#: fla's fields that change no computed function: inits, kernel choices and chunk lengths, training losses, the
#: residual stream's precision
FLA_MAMBA2_NO_MATH = {"initializer_range", "use_cache", "chunk_size", "conv_init", "rescale_prenorm_residual",
                      "residual_in_fp32", "fuse_norm", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp"}
#: fields only fla's Mamba-2 config writes: a `mamba2` config holding one of them is read as fla's
FLA_MAMBA2_MARKERS = ("norm_eps", "rmsnorm", "D_has_hdim", "dt_limit", "A_init_range", "dt_min", "dt_max",
                      "dt_init_floor", "conv_init", "fuse_norm", "fuse_cross_entropy", "fuse_linear_cross_entropy",
                      "use_l2warp")


# ============================================================================ the config
def filled_fields(cfg: dict, kinds: dict[str, tuple[str, Any]], no_math: set[str], owner: str = "") -> dict[str, Any]:
    """`cfg` with the defaults of `kinds` filled in, after refusing an unknown field and a value of the wrong kind
    (`owner`: whose config it is, for the error)."""
    unknown = sorted(set(cfg) - kinds.keys() - no_math - fla.standard_fields())
    if unknown:
        refuse(unknown[0], cfg[unknown[0]], f"a field of {owner}{cfg['model_type']!r} that lazoo does not know")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if field not in cfg:
            raise ConversionError(f"config field {field!r} is missing; nothing was converted")
    check_kinds(cfg, "", {field: kind for field, (kind, _) in kinds.items()})
    if cfg["num_hidden_layers"] > fla.MAX_LAYERS:
        malformed("num_hidden_layers", cfg["num_hidden_layers"], f"more than {fla.MAX_LAYERS} layers")
    return {**{field: default for field, (_, default) in kinds.items()}, **cfg}


def _is_no_clamp(limit) -> bool:
    """Whether a dt limit is (0, inf), as saved: [0.0, Infinity] (written {"__float__": "Infinity"} by transformers)."""
    return isinstance(limit, list) and len(limit) == 2 and limit[0] == 0 and not isinstance(limit[0], bool) \
        and (limit[1] == math.inf or limit[1] == {"__float__": "Infinity"})


def check_time_step_limit(cfg: dict) -> None:
    """(0, inf), the default, is no clamp (dt = softplus(...) >= 0); anything else is refused."""
    limit = cfg.get("time_step_limit", [0.0, math.inf])
    if _is_no_clamp(limit):
        return
    refuse("time_step_limit", limit, "lazoo does not clamp dt (transformers clamps it in its chunked form only, not "
           "when decoding one token); only the default [0.0, Infinity] converts")


def mamba_layer_options(cfg: dict, *, heads: str, head_dim: str, state: str, groups: str, conv: str, expand: str,
                        conv_bias: str, proj_bias: str, eps: float) -> dict[str, Any]:
    """The lazoo `mamba2` options of a Mamba-2 layer whose sizes the config's fields named here hold."""
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", cfg["hidden_act"], "lazoo's Mamba-2 convolution is followed by silu")
    check_time_step_limit(cfg)
    if cfg[head_dim] is None:  # transformers' "auto": expand · hidden_size / heads
        cfg = {**cfg, head_dim: cfg[expand] * cfg["hidden_size"] // cfg[heads]}
    if cfg[heads] * cfg[head_dim] != cfg[expand] * cfg["hidden_size"]:
        malformed(head_dim, cfg[head_dim], f"{heads} · {head_dim} must equal {expand} · hidden_size = "
                  f"{cfg[expand] * cfg['hidden_size']}")
    if cfg[heads] % cfg[groups]:
        malformed(groups, cfg[groups], f"must divide {heads} = {cfg[heads]}")
    options = {"num_heads": cfg[heads], "head_dim": cfg[head_dim], "state_size": cfg[state], "n_groups": cfg[groups],
               "conv_kernel": cfg[conv], "use_conv_bias": cfg[conv_bias], "use_bias": cfg[proj_bias],
               "norm_eps": float(eps)}
    for field in ("time_step_min", "time_step_max", "time_step_floor"):  # initialisation only, kept where given
        if field in cfg:
            options[field] = float(cfg[field])
    return options


def common_fields(cfg: dict, eps: float) -> dict[str, Any]:
    fields = {"model_type": "lazoo_hybrid", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
              "num_hidden_layers": cfg["num_hidden_layers"], "sliding_window": None, "use_short_conv": None,
              "rms_norm_eps": float(eps), "tie_word_embeddings": cfg["tie_word_embeddings"],
              "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
              "pad_token_id": cfg["pad_token_id"]}
    if cfg.get("max_position_embeddings") is not None:
        fields["max_position_embeddings"] = cfg["max_position_embeddings"]
    return fields


def _mamba2_config(cfg: dict) -> dict[str, Any]:
    cfg = filled_fields(cfg, MAMBA2_FIELDS, MAMBA2_NO_MATH)
    if cfg["norm_before_gate"]:
        refuse("norm_before_gate", True, "lazoo's Mamba-2 output norm comes after the gate, as transformers' does")
    if not cfg["rms_norm"]:
        refuse("rms_norm", False, "lazoo's Mamba-2 output norm is an RMSNorm, as transformers' is")
    eps = cfg["layer_norm_epsilon"]
    mamba = mamba_layer_options(cfg, heads="num_heads", head_dim="head_dim", state="state_size", groups="n_groups",
                                conv="conv_kernel", expand="expand", conv_bias="use_conv_bias", proj_bias="use_bias",
                                eps=eps)
    n = cfg["num_hidden_layers"]
    return {**common_fields(cfg, eps), "num_attention_heads": mamba["num_heads"], "intermediate_size": 0,
            "layer_types": ["mamba2"] * n, "mixer_kwargs": {"mamba2": mamba}}


def is_fla_mamba2(cfg: dict) -> bool:
    """Whether a `mamba2` config is fla's (it holds a field only fla's Mamba-2 config writes)."""
    return cfg.get("model_type") == "mamba2" and any(field in cfg for field in FLA_MAMBA2_MARKERS)


def _fla_refusals(cfg: dict) -> None:
    """fla's Mamba-2 options that lazoo's layer does not compute."""
    if cfg["hidden_act"] not in ("silu", "swish"):
        refuse("hidden_act", cfg["hidden_act"], "lazoo's Mamba-2 convolution is followed by silu")
    if not cfg["rmsnorm"]:
        refuse("rmsnorm", False, "lazoo's Mamba-2 has its gated RMSNorm before out_proj (fla's rmsnorm=true)")
    if cfg["norm_before_gate"]:
        refuse("norm_before_gate", True, "lazoo's Mamba-2 output norm comes after the gate")
    if cfg["D_has_hdim"]:
        refuse("D_has_hdim", True, "lazoo's Mamba-2 has one skip weight D per head, not per channel")
    if cfg["dt_limit"] is not None and not _is_no_clamp(cfg["dt_limit"]):
        refuse("dt_limit", cfg["dt_limit"], "lazoo does not clamp dt; only the default [0.0, Infinity] converts")


def _fla_init_ranges(cfg: dict) -> dict[str, float]:
    """The initialisation ranges of fla's config as lazoo's options (they change no computed function)."""
    low_high = cfg["A_init_range"]
    if not (isinstance(low_high, list) and len(low_high) == 2 and all(KINDS["number"][0](v) for v in low_high)
            and low_high[0] <= low_high[1]):
        malformed("A_init_range", low_high, "expected [min, max], two positive numbers")
    if cfg["dt_min"] > cfg["dt_max"]:
        malformed("dt_min", cfg["dt_min"], f"more than dt_max = {cfg['dt_max']}")
    return {"time_step_min": float(cfg["dt_min"]), "time_step_max": float(cfg["dt_max"]),
            "time_step_floor": float(cfg["dt_init_floor"]), "A_init_min": float(low_high[0]),
            "A_init_max": float(low_high[1])}


def _fla_mamba2_config(cfg: dict) -> dict[str, Any]:
    """fla's Mamba-2 (fla/models/mamba2): the layer of transformers' Mamba-2 under other config names, the heads
    derived from expand · hidden_size / head_dim (a `num_heads` saved beside them must agree)."""
    cfg = filled_fields(cfg, FLA_MAMBA2_FIELDS, FLA_MAMBA2_NO_MATH, owner="fla's ")
    _fla_refusals(cfg)
    inner = int(cfg["expand"] * cfg["hidden_size"])
    if inner % cfg["head_dim"]:
        malformed("head_dim", cfg["head_dim"], f"must divide expand · hidden_size = {inner}")
    heads = inner // cfg["head_dim"]
    if cfg["num_heads"] not in (None, heads):
        malformed("num_heads", cfg["num_heads"], f"fla derives expand · hidden_size / head_dim = {heads}")
    if heads % cfg["n_groups"]:
        malformed("n_groups", cfg["n_groups"], f"must divide the {heads} heads")
    eps = cfg["norm_eps"]
    mamba = {"num_heads": heads, "head_dim": cfg["head_dim"], "state_size": cfg["state_size"],
             "n_groups": cfg["n_groups"], "conv_kernel": cfg["conv_kernel"], "use_conv_bias": cfg["use_conv_bias"],
             "use_bias": cfg["use_bias"], "norm_eps": float(eps), **_fla_init_ranges(cfg)}
    n = cfg["num_hidden_layers"]
    return {**common_fields(cfg, eps), "num_attention_heads": heads, "intermediate_size": 0,
            "layer_types": ["mamba2"] * n, "mixer_kwargs": {"mamba2": mamba}}


def _bamba_config(cfg: dict) -> dict[str, Any]:
    if cfg.get("mamba_d_head") == "auto":  # as transformers reads it: expand · hidden_size / heads
        cfg = {**cfg, "mamba_d_head": None}
    cfg = filled_fields(cfg, BAMBA_FIELDS, BAMBA_NO_MATH)
    for field, why in (("attention_bias", "lazoo's attention output projection has no bias"),
                       ("mlp_bias", "lazoo's MLP has no biases")):
        if cfg[field]:
            refuse(field, True, why)
    for field, why in (("attention_dropout", "lazoo's attention has no dropout"),
                       ("z_loss_coefficient", "lazoo's loss has no z-loss term")):
        if cfg[field]:
            refuse(field, cfg[field], why)
    eps, n = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    mamba = mamba_layer_options(cfg, heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state",
                                groups="mamba_n_groups", conv="mamba_d_conv", expand="mamba_expand",
                                conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias", eps=eps)
    attention = cfg["attn_layer_indices"] or []
    if not isinstance(attention, list) or not all(is_layer_number(i, n) for i in attention):
        malformed("attn_layer_indices", attention, f"expected a list of layer numbers below num_hidden_layers = {n}")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"] or heads
    if cfg["hidden_size"] % heads:
        malformed("num_attention_heads", heads, f"must divide hidden_size = {cfg['hidden_size']}")
    if heads % kv_heads:
        malformed("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    head_dim = cfg["hidden_size"] // heads
    # transformers' Bamba rotates half of each head's channels, whatever the config says
    theta, rotary_dim = rope_fields(cfg, "", head_dim, default_factor=0.5)
    if rotary_dim != int(head_dim * 0.5):
        refuse("rope_parameters.partial_rotary_factor", rotary_dim / head_dim, "Bamba rotates half of each head")
    if cfg["attn_rotary_emb"] not in (None, rotary_dim):
        refuse("attn_rotary_emb", cfg["attn_rotary_emb"], f"Bamba rotates half of each head ({rotary_dim} channels)")
    layer_types = ["softmax" if i in attention else "mamba2" for i in range(n)]
    mixer_kwargs = {}
    if "mamba2" in layer_types:
        mixer_kwargs["mamba2"] = mamba
    if "softmax" in layer_types:
        mixer_kwargs["softmax"] = {"num_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads,
                                   "head_dim": head_dim, "qkv_bias": False, "use_rope": True, "rope_theta": theta,
                                   "rotary_dim": rotary_dim, "qk_norm": False, "qk_rmsnorm": False,
                                   "output_gate": False}
    return {**common_fields(cfg, eps), "num_attention_heads": heads, "intermediate_size": cfg["intermediate_size"],
            "layer_types": layer_types, "mixer_kwargs": mixer_kwargs}


def mamba_config_to_lazoo(cfg: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a `mamba2` (transformers' or fla's) or `bamba` config dict;
    ConversionError naming the field for a malformed value, UnsupportedCheckpointError for anything lazoo cannot
    express exactly, by its first such field."""
    model_type = cfg.get("model_type")
    if is_fla_mamba2(cfg):
        return _fla_mamba2_config(cfg)
    if model_type == "mamba2":
        return _mamba2_config(cfg)
    if model_type == "bamba":
        return _bamba_config(cfg)
    refuse("model_type", model_type, f"lazoo converts {', '.join(CONVERTED_MODEL_TYPES)} here")


# ============================================================================ the weights
def _ones_like(t: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(t)


def _no_rows(t: torch.Tensor) -> torch.Tensor:
    return t.new_zeros(0, t.shape[0])


def _no_columns(t: torch.Tensor) -> torch.Tensor:
    return t.new_zeros(t.shape[0], 0)


def _no_mlp(norm: str, dst: str) -> dict[str, Piece]:
    """The norm and the MLP of width 0 of a layer that has no MLP: the norm's weight 1 and the MLP's empty
    matrices, made like the layer's input norm `norm` (its shape [hidden_size] and dtype)."""
    return {f"{dst}.post_mixer_norm.weight": piece(norm, _ones_like),
            f"{dst}.mlp.gate_proj.weight": piece(norm, _no_rows), f"{dst}.mlp.up_proj.weight": piece(norm, _no_rows),
            f"{dst}.mlp.down_proj.weight": piece(norm, _no_columns)}


def same_names(model_names: list[str], dst: str, src: str) -> dict[str, Piece]:
    """Every tensor of the lazoo model under `dst` from the checkpoint's tensor of the same name under `src`."""
    return {name: piece(src + name[len(dst):]) for name in model_names if name.startswith(dst + ".")}


def tensor_plan(fields: dict, model, model_type: str, names: set[str]) -> dict[str, Piece]:
    """lazoo tensor name -> the checkpoint tensor (by its name inside the backbone / model, `layers.0.…`) it is."""
    model_names = list(model.state_dict())
    if model_type == "mamba2":
        # transformers' load hook still reads the older name of the embedding
        embed = "embeddings.weight" if "embeddings.weight" in names or "embedding.weight" not in names \
            else "embedding.weight"
        plan = {"model.embed_tokens.weight": piece(embed), "model.norm.weight": piece("norm_f.weight")}
    else:
        plan = {"model.embed_tokens.weight": piece("embed_tokens.weight"),
                "model.norm.weight": piece("final_layernorm.weight")}
    if not fields["tie_word_embeddings"]:
        plan["lm_head.weight"] = piece("lm_head.weight")
    for i, kind in enumerate(fields["layer_types"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        if model_type == "mamba2":
            plan[f"{dst}.input_norm.weight"] = piece(f"{src}.norm.weight")
            plan.update(_no_mlp(f"{src}.norm.weight", dst))
            plan.update(same_names(model_names, f"{dst}.mixer", f"{src}.mixer"))
            continue
        plan[f"{dst}.input_norm.weight"] = piece(f"{src}.input_layernorm.weight")
        plan[f"{dst}.post_mixer_norm.weight"] = piece(f"{src}.pre_ff_layernorm.weight")
        plan.update(same_names(model_names, f"{dst}.mlp", f"{src}.feed_forward"))
        plan.update(same_names(model_names, f"{dst}.mixer", f"{src}.{'mamba' if kind == 'mamba2' else 'self_attn'}"))
    return plan


#: the prefix of the backbone's tensors in the folders each model type's causal LM writes
PREFIXES = {"mamba2": ("backbone.",), "bamba": ("model.",)}
FAMILIES = {"mamba2": "a transformers Mamba-2 model", "bamba": "a transformers Bamba model"}


# ============================================================================ the folder
def from_mamba(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None = None) -> tuple[Path, list[str]]:
    """Convert the Mamba-2 or Bamba folder `src` into a new lazoo folder `dst` (see the module docstring); `config`
    is src's config.json when already read. Returns (`dst`, what was left out: nothing). Refuses before writing
    anything, as `from_fla` does."""
    source, dst = SourceFolder(src), Path(dst)
    config_file = source.file("config.json", required=False)
    if config_file is None:
        raise ConversionError(f"{src} has no config.json: give a Mamba-2 or Bamba checkpoint folder")
    cfg = config if config is not None else source.read_json(config_file, limit=fla.MAX_CONFIG_BYTES)
    try:
        fields = mamba_config_to_lazoo(cfg)
    except ConversionError as err:
        raise type(err)(f"{config_file}: {err}") from err
    model_type = cfg["model_type"]
    flavour = "fla" if is_fla_mamba2(cfg) else "transformers"
    fla.check_destination(dst)
    copied = fla.tokenizer_files(source)
    entries = fla.tensor_entries(source)
    family = "a fla Mamba-2 model" if flavour == "fla" else FAMILIES[model_type]
    names = source_names(entries, prefixes=PREFIXES[model_type], left_out=(), family=family)
    check_layer_count(names, entries, fields["num_hidden_layers"], config_file)
    converted_from = {"format": flavour, "model_type": model_type, "source": source.root.name, "left_out": []}
    model = fla.meta_model(fields, config_file, converted_from)
    plan = tensor_plan(fields, model, model_type, set(names))
    check_plan(plan, names, entries, model, config_file)
    model = fla.fill_model(model, read_plan(source, plan, names, entries))
    return fla.write_folder(model, copied, dst), []
