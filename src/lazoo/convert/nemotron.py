"""Nemotron-H checkpoints of transformers (`nemotron_h`) into lazoo folders.

A Nemotron-H model ("Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer Models", NVIDIA, 2025)
is a list of blocks (`layers_block_type`, or the older `hybrid_override_pattern` string `M`, `*`, `-`, `E`), each
`x + f(RMSNorm(x))` around one of: a Mamba-2 mixer, attention without positional encoding, a plain MLP
`down(act(up(x)))` (`mlp_hidden_act`, relu² in the published models) or a mixture of such experts. A lazoo decoder
layer is `h = x + mixer(norm(x)); out = h + mlp(norm(h))`, so a token-mixing block followed by an MLP or MoE block is
exactly one lazoo layer; a mixing block followed by another becomes a layer without a feed-forward (not in
`mlp_layers`), and an MLP or MoE block with no mixing block before it a layer without a token mixer (`layer_types`
entry None). The converted model computes transformers' function, block for block:

- Mamba-2 blocks become `mamba2` layers (transformers' parameter names), with `dt_clamp_min = time_step_min`:
  transformers clamps the step sizes at `time_step_min` in its chunked form (a prompt) but not when it decodes one
  token; lazoo clamps in every form, so a decoded token gets the numbers the whole sequence run at once gives it;
- attention blocks become `softmax` layers without RoPE (grouped-query key/value heads, `head_dim` channels);
- MLP blocks become plain MLPs (`mlp_gated=False`, `mlp_activation = mlp_hidden_act`);
- MoE blocks become lazoo's routed MoE with Nemotron-H's router (sigmoid scores, a score-correction bias that only
  chooses the experts, group-limited top-k, the weights renormalised with `norm_topk_prob` and times
  `routed_scaling_factor`), plain experts, the latent projections of `moe_latent_size` and an ungated shared expert;
  the load-balancing loss is off (`router_aux_loss_coef` 0: transformers' loss has none).

The head is the folder's `lm_head.weight` whatever `tie_word_embeddings` says: transformers' `NemotronHForCausalLM`
ties nothing (a folder without that tensor is refused, where transformers would draw a random head).

Left out: the multi-token-prediction layers (`mtp.*`, `num_nextn_predict_layers`), which transformers'
`NemotronHForCausalLM` does not run either. What lazoo does not copy: `residual_in_fp32` and `mamba_ssm_cache_dtype`
(precision choices: lazoo keeps the residual and the cache in the model's dtype, the same numbers in float32 and
float64). Refused by name: biases (`use_bias` other than in the Mamba-2 projections, `mlp_bias`, `attention_bias`,
`mamba_proj_bias`), a sliding window, dropout, an activation other than silu in the Mamba-2 convolution, an MLP
activation lazoo lacks, and a `time_step_limit` other than the default (transformers ignores it, clamping at
`time_step_min`). As for the other converters the folder is untrusted input (`lazoo.convert.mamba`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..layers.mlp import ACTIVATIONS
from . import fla
from .mamba import check_time_step_limit, filled_fields
from .qwen import (
    Piece,
    check_layer_count,
    check_plan,
    malformed,
    piece,
    read_plan,
    read_source_config,
    refuse,
    source_names,
    stacked,
)
from .source import SourceFolder

__all__ = ["NEMOTRON_MODEL_TYPES", "from_nemotron", "nemotron_config_to_lazoo"]

NEMOTRON_MODEL_TYPES = ("nemotron_h",)

#: the config fields lazoo reads, with their kinds (fla_layers.KINDS; "?" allows null) and transformers' defaults
NEMOTRON_FIELDS = {
    "model_type": ("name", None), "vocab_size": ("count", 131072), "hidden_size": ("count", 4096),
    "layers_block_type": ("any", None), "hybrid_override_pattern": ("any", None), "num_hidden_layers": ("any", None),
    "tie_word_embeddings": ("flag", False),  # read by no transformers release: the head is lm_head.weight
    "num_attention_heads": ("count", 32), "num_key_value_heads": ("count?", 8),
    "head_dim": ("count", 128), "attention_head_dim": ("count?", None), "max_position_embeddings": ("count?", 4096),
    "attention_bias": ("flag", False), "attention_dropout": ("real?", 0.0), "sliding_window": ("any", None),
    "intermediate_size": ("count", 21504), "mlp_hidden_act": ("name", "relu2"), "mlp_bias": ("flag", False),
    "ssm_state_size": ("count", 128), "mamba_num_heads": ("count", 128), "mamba_head_dim": ("count", 64),
    "mamba_hidden_act": ("name", "silu"), "n_groups": ("count", 8), "conv_kernel": ("count", 4),
    "expand": ("count", 2), "time_step_min": ("number", 0.001), "time_step_max": ("number", 0.1),
    "time_step_limit": ("any", None), "time_step_floor": ("real", 1e-4), "use_conv_bias": ("flag", True),
    "mamba_proj_bias": ("flag", False), "n_routed_experts": ("count", 8), "moe_intermediate_size": ("count", 7688),
    "moe_shared_expert_intermediate_size": ("count", 7688), "moe_latent_size": ("count?", None),
    "num_experts_per_tok": ("count", 2), "routed_scaling_factor": ("number", 1.0), "n_group": ("count", 1),
    "topk_group": ("count", 1), "norm_topk_prob": ("flag", True), "num_nextn_predict_layers": ("any", 0),
    "use_bias": ("flag", False), "layer_norm_epsilon": ("number", 1e-5), "hidden_dropout": ("real?", 0.0),
    "bos_token_id": ("token?", None), "eos_token_id": ("tokens?", None), "pad_token_id": ("token?", None),
}
#: fields that change no computed function: inits, kernel hints and chunk lengths, how many logits generate keeps,
#: precision choices (module docstring), the multi-token-prediction layers' kinds, an expert-parallel hint, whether
#: router logits are returned; transformers' model has one shared expert whatever `n_shared_experts` says
NEMOTRON_NO_MATH = {"initializer_range", "use_cache", "num_logits_to_keep", "use_mamba_kernels", "chunk_size",
                    "rescale_prenorm_residual", "residual_in_fp32", "mamba_ssm_cache_dtype", "mtp_layers_block_type",
                    "mtp_hybrid_override_pattern", "moe_shared_expert_overlap", "output_router_logits",
                    "n_shared_experts", "time_step_rank"}
#: names earlier releases wrote -> transformers' names now (transformers reads the earlier name first, as here)
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
                "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size"}
#: a block's kind, by its names in `layers_block_type` (either release's) and in `hybrid_override_pattern`
BLOCK_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
               "attention": "attention", "full_attention": "attention", "*": "attention",
               "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}
MIXING, FEED_FORWARD = ("mamba", "attention"), ("mlp", "moe")
#: the lazoo mechanism of each mixing block
MECHANISMS = {"mamba": "mamba2", "attention": "softmax"}


# ============================================================================ the blocks and the layers
def _renamed(cfg: dict) -> dict:
    """`cfg` with the fields of earlier releases under transformers' names."""
    cfg = dict(cfg)
    for old, new in LEGACY_NAMES.items():
        if old in cfg:
            cfg[new] = cfg.pop(old)
    return cfg


def block_kinds(cfg: dict) -> list[str]:
    """Each block's kind ("mamba", "attention", "mlp", "moe"), from `layers_block_type` (where given, as
    transformers reads it) or `hybrid_override_pattern`."""
    field = "layers_block_type" if cfg.get("layers_block_type") is not None else "hybrid_override_pattern"
    listed = cfg.get(field)
    if listed is None:
        malformed("layers_block_type", None, "a Nemotron-H config lists its blocks (or hybrid_override_pattern)")
    if not isinstance(listed, (list, str)) or not listed or not all(
            isinstance(kind, str) and kind in BLOCK_KINDS for kind in listed):
        malformed(field, listed, f"expected a non-empty list (or string) of the block kinds {sorted(BLOCK_KINDS)}")
    if len(listed) > fla.MAX_LAYERS:
        malformed(field, listed, f"more than {fla.MAX_LAYERS} blocks")
    return [BLOCK_KINDS[kind] for kind in listed]


def pair_blocks(kinds: list[str]) -> list[tuple[int | None, int | None]]:
    """The lazoo layers of the blocks `kinds`: (the mixing block, the MLP / MoE block) of each, either None where
    the layer has no such part. A mixing block takes the MLP or MoE block right after it."""
    layers, i = [], 0
    while i < len(kinds):
        if kinds[i] in FEED_FORWARD:
            layers.append((None, i))
            i += 1
        elif i + 1 < len(kinds) and kinds[i + 1] in FEED_FORWARD:
            layers.append((i, i + 1))
            i += 2
        else:
            layers.append((i, None))
            i += 1
    return layers


# ============================================================================ the config
def _refuse_unexpressed(cfg: dict) -> None:
    """The fields lazoo cannot express, each refused by name."""
    for field, why in (("attention_bias", "lazoo's attention has no biases (nor has transformers' Nemotron-H, "
                                          "whatever this says: a checkpoint trained with them would lose them)"),
                       ("mlp_bias", "lazoo's MLPs, experts and latent projections have no biases"),
                       ("mamba_proj_bias", "transformers' Nemotron-H reads use_bias for the Mamba-2 projections; a "
                                           "folder asking for mamba_proj_bias has no one function to copy")):
        if cfg[field]:
            refuse(field, True, why)
    for field in ("attention_dropout", "hidden_dropout"):
        if cfg[field]:
            refuse(field, cfg[field], "lazoo's decoder has no dropout there")
    if cfg["sliding_window"] is not None:
        refuse("sliding_window", cfg["sliding_window"], "transformers' Nemotron-H attention has no window whatever "
               "this says: a checkpoint trained with one would compute something else")
    if cfg["mamba_hidden_act"] != "silu":
        refuse("mamba_hidden_act", cfg["mamba_hidden_act"], "lazoo's Mamba-2 convolution is followed by silu")
    if cfg["mlp_hidden_act"] not in ACTIVATIONS:
        refuse("mlp_hidden_act", cfg["mlp_hidden_act"], f"lazoo's MLP activations are {', '.join(ACTIVATIONS)}")
    if cfg["attention_head_dim"] not in (None, cfg["head_dim"]):
        refuse("attention_head_dim", cfg["attention_head_dim"], f"transformers' Nemotron-H reads head_dim = "
               f"{cfg['head_dim']} for its attention heads, not this earlier field")


def _mamba_options(cfg: dict) -> dict[str, Any]:
    heads, groups = cfg["mamba_num_heads"], cfg["n_groups"]
    if heads % groups:
        malformed("n_groups", groups, f"must divide mamba_num_heads = {heads}")
    return {"num_heads": heads, "head_dim": cfg["mamba_head_dim"], "state_size": cfg["ssm_state_size"],
            "n_groups": groups, "conv_kernel": cfg["conv_kernel"], "use_conv_bias": cfg["use_conv_bias"],
            "use_bias": cfg["use_bias"], "norm_eps": float(cfg["layer_norm_epsilon"]),
            "dt_clamp_min": float(cfg["time_step_min"]), "time_step_min": float(cfg["time_step_min"]),
            "time_step_max": float(cfg["time_step_max"]), "time_step_floor": float(cfg["time_step_floor"])}


def _attention_options(cfg: dict) -> dict[str, Any]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    if heads % kv_heads:
        malformed("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    return {"num_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads, "head_dim": cfg["head_dim"],
            "qkv_bias": False, "use_rope": False, "qk_norm": False, "qk_rmsnorm": False, "output_gate": False}


def _moe_fields(cfg: dict, moe_layers: list[int], ffn_layers: list[int]) -> dict[str, Any]:
    """The routed MoE's fields (module docstring), after the checks transformers' router needs."""
    experts, top_k, groups, top_groups = (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"],
                                          cfg["topk_group"])
    if top_k > experts:
        malformed("num_experts_per_tok", top_k, f"more than n_routed_experts = {experts}")
    if experts % groups:
        malformed("n_group", groups, f"must divide n_routed_experts = {experts}")
    if top_groups > groups:
        malformed("topk_group", top_groups, f"more than n_group = {groups}")
    if experts // groups < 2:  # transformers' router sums each group's two best scores, whatever topk_group is
        malformed("n_group", groups, "groups of one expert (transformers' router takes each group's two best scores)")
    if top_k > top_groups * (experts // groups):
        malformed("num_experts_per_tok", top_k, f"more than the experts of the topk_group = {top_groups} groups")
    fields = {"moe_num_experts": experts, "moe_top_k": top_k, "moe_intermediate_size": cfg["moe_intermediate_size"],
              "moe_bias": None, "moe_norm_top_k": cfg["norm_topk_prob"], "moe_router_score": "sigmoid",
              "moe_score_correction_bias": True, "moe_num_groups": groups, "moe_top_k_groups": top_groups,
              "moe_routed_scaling_factor": float(cfg["routed_scaling_factor"]),
              "moe_shared_expert_intermediate_size": cfg["moe_shared_expert_intermediate_size"],
              "moe_shared_expert_gate": False, "moe_latent_size": cfg["moe_latent_size"], "router_aux_loss_coef": 0.0}
    if moe_layers != ffn_layers:
        fields["moe_layers"] = moe_layers
    return fields


def nemotron_config_to_lazoo(cfg: dict) -> dict[str, Any]:
    """The lazoo config fields (with `model_type`) of a `nemotron_h` config dict, and `blocks`: the (mixing block,
    MLP / MoE block) of each lazoo layer. ConversionError naming the field for a malformed value,
    UnsupportedCheckpointError for anything lazoo cannot express exactly."""
    if cfg.get("model_type") != "nemotron_h":
        refuse("model_type", cfg.get("model_type"), "lazoo converts nemotron_h here")
    cfg = _renamed(cfg)
    kinds = block_kinds(cfg)
    check_time_step_limit(cfg)
    # transformers counts the blocks of the list, whatever num_hidden_layers says
    cfg = filled_fields({**cfg, "num_hidden_layers": len(kinds), "vocab_size": cfg.get("vocab_size", 131072),
                   "hidden_size": cfg.get("hidden_size", 4096)}, NEMOTRON_FIELDS, NEMOTRON_NO_MATH)
    _refuse_unexpressed(cfg)
    blocks = pair_blocks(kinds)
    ffn_layers = [j for j, (_, ffn) in enumerate(blocks) if ffn is not None]
    moe_layers = [j for j, (_, ffn) in enumerate(blocks) if ffn is not None and kinds[ffn] == "moe"]
    layer_types = [None if mix is None else MECHANISMS[kinds[mix]] for mix, _ in blocks]
    eps = float(cfg["layer_norm_epsilon"])
    fields = {"model_type": "lazoo_hybrid", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
              "num_hidden_layers": len(blocks), "num_attention_heads": cfg["num_attention_heads"],
              "intermediate_size": cfg["intermediate_size"], "layer_types": layer_types, "sliding_window": None,
              "use_short_conv": None, "rms_norm_eps": eps, "tie_word_embeddings": False,
              "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
              "pad_token_id": cfg["pad_token_id"], "mlp_gated": False, "mlp_activation": cfg["mlp_hidden_act"]}
    if cfg["max_position_embeddings"] is not None:
        fields["max_position_embeddings"] = cfg["max_position_embeddings"]
    if len(ffn_layers) < len(blocks):
        fields["mlp_layers"] = ffn_layers
    mixer_kwargs = {}
    if "mamba2" in layer_types:
        mixer_kwargs["mamba2"] = _mamba_options(cfg)
    if "softmax" in layer_types:
        mixer_kwargs["softmax"] = _attention_options(cfg)
    fields["mixer_kwargs"] = mixer_kwargs
    if moe_layers:
        fields.update(_moe_fields(cfg, moe_layers, ffn_layers))
    return {**fields, "blocks": blocks}


# ============================================================================ the weights
#: lazoo's name inside a routed MoE -> transformers' name inside its NemotronHMoE
MOE_NAMES = {"router.weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias",
             "latent_in_proj.weight": "fc1_latent_proj.weight", "latent_out_proj.weight": "fc2_latent_proj.weight"}


def _feed_forward_pieces(src: str, dst: str, model_names: list[str], names: set[str],
                         experts: int) -> dict[str, Piece]:
    """The MLP's or MoE's tensors of lazoo layer `dst` from block `src`'s `mixer`; the experts stacked from one
    module per expert (`experts.{e}.up_proj.weight`, as transformers saves them) where the folder has no stacked
    tensor."""
    pieces = {}
    for ours in (n[len(dst) + 1:] for n in model_names if n.startswith(dst + ".")):
        theirs = f"{src}.{MOE_NAMES.get(ours, ours.replace('shared_expert.', 'shared_experts.'))}"
        if ours.startswith("experts.") and theirs not in names:
            projection = ours.removeprefix("experts.")
            pieces[f"{dst}.{ours}"] = Piece(tuple(f"{src}.experts.{e}.{projection}.weight" for e in range(experts)),
                                            stacked)
        else:
            pieces[f"{dst}.{ours}"] = piece(theirs)
    return pieces


def tensor_plan(fields: dict, blocks: list[tuple[int | None, int | None]], model, names: set[str]) -> dict[str, Piece]:
    """lazoo tensor name -> the checkpoint tensor (by its name inside the backbone, `layers.0.…`) it is."""
    model_names = list(model.state_dict())
    plan = {"model.embed_tokens.weight": piece("embeddings.weight"), "model.norm.weight": piece("norm_f.weight"),
            "lm_head.weight": piece("lm_head.weight")}
    for j, (mix, ffn) in enumerate(blocks):
        dst = f"model.layers.{j}"
        if mix is not None:
            plan[f"{dst}.input_norm.weight"] = piece(f"layers.{mix}.norm.weight")
            plan.update({n: piece(f"layers.{mix}.mixer.{n[len(dst) + 7:]}") for n in model_names
                         if n.startswith(f"{dst}.mixer.")})
        if ffn is not None:
            plan[f"{dst}.post_mixer_norm.weight"] = piece(f"layers.{ffn}.norm.weight")
            plan.update(_feed_forward_pieces(f"layers.{ffn}.mixer", f"{dst}.mlp", model_names, names,
                                             fields.get("moe_num_experts", 0)))
    return plan


#: the tensors of the multi-token-prediction layers, which transformers' causal LM does not load either
MTP_PREFIXES = ("mtp.", "model.mtp.", "backbone.mtp.")


# ============================================================================ the folder
def from_nemotron(src: str | os.PathLike, dst: str | os.PathLike, config: dict | None = None) -> tuple[Path, list[str]]:
    """Convert the Nemotron-H folder `src` into a new lazoo folder `dst` (see the module docstring); `config` is
    src's config.json when already read. Returns (`dst`, what was left out: the multi-token-prediction layers, where
    the folder has them). Refuses before writing anything, as `from_fla` does."""
    source, dst = SourceFolder(src), Path(dst)
    config_file, cfg, fields = read_source_config(source, config, nemotron_config_to_lazoo, "Nemotron-H")
    blocks = fields.pop("blocks")
    fla.check_destination(dst)
    copied = fla.tokenizer_files(source)
    entries = fla.tensor_entries(source)
    mtp = sorted(name for name in entries if name.startswith(MTP_PREFIXES))
    names = source_names(entries, prefixes=("backbone.", "model."), left_out=MTP_PREFIXES,
                         family="a transformers Nemotron-H model")
    check_layer_count(names, entries, len(block_kinds(_renamed(cfg))), config_file)
    left_out = [f"the multi-token-prediction layers ({len(mtp)} tensors under mtp.), which transformers' "
                "NemotronHForCausalLM does not run either"] if mtp else []
    converted_from = {"format": "transformers", "model_type": "nemotron_h", "source": source.root.name,
                      "left_out": left_out}
    model = fla.meta_model(fields, config_file, converted_from)
    plan = tensor_plan(fields, blocks, model, set(names))
    check_plan(plan, names, entries, model, config_file)
    model = fla.fill_model(model, read_plan(source, plan, names, entries))
    return fla.write_folder(model, copied, dst), left_out
