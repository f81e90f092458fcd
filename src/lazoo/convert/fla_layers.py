"""fla's layers as lazoo mixer options, and fla's parameter names as lazoo's.

For each fla model type: the config fields its blocks pass to the layers (`LAYER_FIELDS`), the lazoo options that
make lazoo's mixer compute the same function (`mixer_options`, `attention_options`), and the parameter renames
(`mixer_weights`). The equations behind each mapping are checked in float64 against transcriptions of fla's
layer code (tests/fla_reference.py, tests/fla_attention_reference.py).
"""

from __future__ import annotations

from typing import Any

import torch

#: per fla model type, the config fields beyond the common ones (fla.COMMON_FIELDS) that lazoo reads; the ones
#: in NO_EFFECT are read by no fla 0.6.0 layer (accepted, with no effect in fla either)
LAYER_FIELDS = {
    "transformer": {"num_kv_heads", "qkv_bias", "qk_norm", "window_size", "rope_theta"},
    "gla": {"expand_k", "expand_v", "num_kv_heads", "feature_map", "use_short_conv", "conv_size", "use_output_gate",
            "clamp_min", "use_gk", "use_gv"},
    "delta_net": {"expand_k", "expand_v", "use_gate", "use_short_conv", "allow_neg_eigval", "conv_size", "use_beta",
                  "use_output_norm", "qk_norm", "qk_activation"},
    "gated_deltanet": {"expand_v", "use_gate", "use_short_conv", "allow_neg_eigval", "conv_size", "head_dim",
                       "num_v_heads", "output_gate_activation"},
}
NO_EFFECT = {"use_gk", "use_gv", "use_output_norm"}

#: fla parameter (module) names that lazoo names otherwise; every other name is the same in both
RENAMED = {"q_conv1d": "short_conv.convs.q", "k_conv1d": "short_conv.convs.k", "v_conv1d": "short_conv.convs.v",
           "g_norm_swish_gate": "o_norm", "g_norm": "o_norm"}

#: fla's activations under lazoo's names (fla's "swish" is SiLU, its "elu" feature map is ELU + 1)
_SWISH = {"swish": "silu", "silu": "silu"}


class ConversionError(ValueError):
    """A checkpoint folder that cannot be converted: the one-line message names the file and, where there is one,
    the field (malformed input, a failed read or write). Nothing is left in the destination."""


class UnsupportedCheckpointError(ConversionError):
    """A fla checkpoint uses something lazoo cannot express exactly (the message names the field)."""


def refuse(field: str, value, why: str):
    """Raise UnsupportedCheckpointError naming a fla config field, its value and why."""
    raise UnsupportedCheckpointError(f"fla config field {field!r} = {value!r}: {why}; nothing was converted")


def _head_dims(fla: dict, expand_k: float, expand_v: float) -> tuple[int, float]:
    """(lazoo head_k_dim, lazoo expand_v) of a layer sized by fla's expand_k / expand_v ratios, as fla sizes it:
    key_dim = int(hidden · expand_k), head_k_dim = key_dim // num_heads (values alike)."""
    heads = fla["num_heads"]
    head_k_dim = int(fla["hidden_size"] * expand_k) // heads
    head_v_dim = int(fla["hidden_size"] * expand_v) // heads
    return head_k_dim, head_v_dim / head_k_dim


def _conv(fla: dict, default_on: bool) -> dict[str, Any]:
    """The short convolutions: fla's blocks never pass `conv_bias` (so no bias)."""
    return {"use_short_conv": bool(fla.get("use_short_conv", default_on)), "conv_size": fla.get("conv_size", 4),
            "conv_bias": False, "short_conv_targets": "qkv"}


def _gated_deltanet(fla: dict) -> dict[str, Any]:
    gate_act = fla.get("output_gate_activation", "swish")
    if gate_act not in ("swish", "silu", "sigmoid"):
        refuse("output_gate_activation", gate_act, "fla allows swish, silu or sigmoid")
    return {**_conv(fla, True), "num_heads": fla["num_heads"], "head_k_dim": fla.get("head_dim", 256),
            "expand_v": fla.get("expand_v", 2.0), "num_v_heads": fla.get("num_v_heads"),
            "qk_activation": "silu", "v_activation": "silu", "use_beta": True, "beta_bias": False,
            "allow_neg_eigval": bool(fla.get("allow_neg_eigval", False)), "qk_norm": "l2", "output_norm": True,
            "output_gate": bool(fla.get("use_gate", True)), "gate_activation": _SWISH.get(gate_act, gate_act),
            "norm_eps": fla.get("norm_eps", 1e-6)}


def _delta_net(fla: dict) -> dict[str, Any]:
    qk_act, qk_norm = fla.get("qk_activation", "silu"), fla.get("qk_norm", "l2")
    if qk_act not in ("silu", "relu", "elu", "identity"):
        refuse("qk_activation", qk_act, "fla's DeltaNet takes silu, relu, elu or identity")
    if qk_norm not in ("l2", "sum"):
        refuse("qk_norm", qk_norm, "fla's DeltaNet takes l2 or sum")
    head_k_dim, expand_v = _head_dims(fla, fla.get("expand_k", 1.0), fla.get("expand_v", 1.0))
    return {**_conv(fla, True), "num_heads": fla["num_heads"], "head_k_dim": head_k_dim, "expand_v": expand_v,
            "qk_activation": {"elu": "elu1"}.get(qk_act, qk_act), "v_activation": "silu",
            "use_beta": bool(fla.get("use_beta", True)), "beta_bias": False,
            "allow_neg_eigval": bool(fla.get("allow_neg_eigval", False)), "qk_norm": qk_norm, "output_norm": True,
            "output_gate": bool(fla.get("use_gate", False)), "gate_activation": "silu",
            "norm_eps": fla.get("norm_eps", 1e-6)}


def _gla(fla: dict) -> dict[str, Any]:
    feature_map = fla.get("feature_map")
    if feature_map is not None and feature_map not in ("swish", "relu", "sigmoid", "identity"):
        refuse("feature_map", feature_map, "lazoo's GLA takes fla's swish, relu, sigmoid or identity feature maps "
                "(fla's gelu uses a truncated constant lazoo does not reproduce)")
    gate_fn = fla.get("hidden_act", "swish")  # fla's blocks pass hidden_act as the output gate's function
    head_k_dim, expand_v = _head_dims(fla, fla.get("expand_k", 0.5), fla.get("expand_v", 1.0))
    return {**_conv(fla, False), "num_heads": fla["num_heads"], "head_k_dim": head_k_dim, "expand_v": expand_v,
            "num_kv_heads": fla.get("num_kv_heads"), "qk_activation": None, "v_activation": None,
            "conv_activation": "silu", "feature_map": _SWISH.get(feature_map, feature_map),
            "output_norm": True, "output_norm_affine": fla.get("elementwise_affine", True) is not False,
            "output_gate": bool(fla.get("use_output_gate", True)), "gate_activation": _SWISH.get(gate_fn, gate_fn),
            "norm_eps": fla.get("norm_eps", 1e-6), "gate_logit_normalizer": 16.0, "gate_low_rank_dim": 16,
            "clamp_min": fla.get("clamp_min")}


_MIXERS = {"gated_deltanet": _gated_deltanet, "delta_net": _delta_net, "gla": _gla}


def mixer_options(model_type: str, fla: dict) -> dict[str, Any]:
    """The lazoo options (`mixer_kwargs[mechanism]`) of the non-attention layers of a fla `model_type` model."""
    return _MIXERS[model_type](fla)


def attention_options(spec: dict, fla: dict) -> dict[str, Any]:
    """The lazoo softmax / sliding-window options of one fla attention spec (`layers`, `num_heads`, `num_kv_heads`,
    `qkv_bias`, `window_size`, `rope_theta`, and for fla's transformer `qk_norm`): fla's Attention applies RoPE
    always and, with qk_norm, an RMSNorm with a learned weight over each head's q and k before it."""
    kv = spec.get("num_kv_heads")
    return {"num_heads": spec["num_heads"], "num_kv_heads": None if kv in (None, spec["num_heads"]) else kv,
            "qkv_bias": bool(spec.get("qkv_bias", False)), "qk_rmsnorm": bool(spec.get("qk_norm", False)),
            "use_rope": True, "rope_theta": float(spec.get("rope_theta", 10000.0))}


def mixer_weights(layer_type: str, fla_name: str, tensor: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """`{lazoo mixer parameter name: tensor}` for fla layer parameter `fla_name` (relative to the layer's `attn`)
    of a layer whose lazoo mechanism is `layer_type`."""
    module, _, leaf = fla_name.rpartition(".")
    if layer_type in ("softmax", "sliding_window") or not module:
        return {fla_name: tensor}
    return {f"{RENAMED.get(module, module)}.{leaf}": tensor}
