"""fla's layers as lazoo mixer options, and fla's parameter names as lazoo's.

For each fla model type: the config fields its blocks pass to the layers and the kind of value each holds
(`LAYER_FIELDS`), the lazoo options that make lazoo's mixer compute the same function (`mixer_options`,
`attention_options`), and the parameter renames (`mixer_parameter_name`). The equations behind each mapping are
checked in float64 against transcriptions of fla's layer code (tests/fla_reference.py,
tests/fla_attention_reference.py). A config is untrusted input: `check_fields` refuses a value of the wrong kind
(a string where a count belongs, a bool, a negative or non-finite number) before any is used.
"""

from __future__ import annotations

import math
from typing import Any

from .source import ConversionError, UnsupportedCheckpointError, shown

__all__ = ["ConversionError", "UnsupportedCheckpointError", "LAYER_FIELDS", "attention_options", "check_fields",
           "is_layer_number", "malformed", "mixer_options", "mixer_parameter_name", "refuse"]

#: per fla model type, the config fields beyond the common ones (fla.COMMON_FIELDS) that lazoo reads, with the kind
#: of value each holds (`KINDS`; a trailing "?" allows null); the ones in NO_EFFECT are read by no fla 0.6.0 layer
#: (accepted, with no effect in fla either)
LAYER_FIELDS = {
    "transformer": {"num_kv_heads": "count?", "qkv_bias": "flag", "qk_norm": "flag", "window_size": "count?",
                    "rope_theta": "number?"},
    "gla": {"expand_k": "number", "expand_v": "number", "num_kv_heads": "count?", "feature_map": "name?",
            "use_short_conv": "flag", "conv_size": "count", "use_output_gate": "flag", "clamp_min": "real?",
            "use_gk": "flag?", "use_gv": "flag?"},
    "delta_net": {"expand_k": "number", "expand_v": "number", "use_gate": "flag", "use_short_conv": "flag",
                  "allow_neg_eigval": "flag", "conv_size": "count", "use_beta": "flag", "use_output_norm": "flag?",
                  "qk_norm": "name", "qk_activation": "name"},
    "gated_deltanet": {"expand_v": "number", "use_gate": "flag", "use_short_conv": "flag", "allow_neg_eigval": "flag",
                       "conv_size": "count", "head_dim": "count", "num_v_heads": "count?",
                       "output_gate_activation": "name"},
    "kda": {"expand_v": "number", "use_short_conv": "flag", "allow_neg_eigval": "flag", "safe_gate": "flag",
            "lower_bound": "real?", "conv_size": "count", "head_dim": "count", "num_v_heads": "count?"},
}
NO_EFFECT = {"use_gk", "use_gv", "use_output_norm"}
#: the fields of one spec of fla's `attn` block, with their kinds
ATTENTION_FIELDS = {"layers": "any", "num_heads": "count", "num_kv_heads": "count?", "qkv_bias": "flag",
                    "window_size": "count?", "rope_theta": "number"}

#: the largest count a config may hold (far below where torch's shapes, products of counts, overflow) and the
#: largest magnitude of a real-valued field
MAX_COUNT = 2**31 - 1
MAX_NUMBER = 1e12


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_layer_number(value, num_layers: int) -> bool:
    """An int in [0, num_layers)."""
    return _is_int(value) and 0 <= value < num_layers


def _is_token(value) -> bool:
    return _is_int(value) and 0 <= value <= MAX_COUNT


#: kind -> (test, what a value of it is)
KINDS = {
    "count": (lambda v: _is_int(v) and 1 <= v <= MAX_COUNT, f"a positive integer up to {MAX_COUNT}"),
    "number": (lambda v: _is_real(v) and 0 < v <= MAX_NUMBER, f"a positive finite number up to {MAX_NUMBER:g}"),
    "real": (lambda v: _is_real(v) and abs(v) <= MAX_NUMBER, "a finite number"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "name": (lambda v: isinstance(v, str), "a string"),
    "token": (_is_token, "a token id (an integer >= 0)"),
    "tokens": (lambda v: _is_token(v) or (isinstance(v, list) and bool(v) and all(map(_is_token, v))),
               "a token id (an integer >= 0) or a list of them"),
    "any": (lambda v: True, "anything"),
}


def refuse(field: str, value, why: str):
    """Raise UnsupportedCheckpointError naming a fla config field, its value and why."""
    raise UnsupportedCheckpointError(f"fla config field {field!r} = {shown(value)}: {why}; nothing was converted")


def malformed(field: str, value, why: str):
    """Raise ConversionError naming a fla config field whose value is not what fla writes there."""
    raise ConversionError(f"fla config field {field!r} = {shown(value)}: {why}; nothing was converted")


def check_fields(fla: dict, kinds: dict[str, str], prefix: str = "") -> None:
    """Every field of `kinds` present in `fla` holds a value of its kind (null where the kind ends in "?")."""
    for field, kind in kinds.items():
        if field not in fla or (fla[field] is None and kind.endswith("?")):
            continue
        test, what = KINDS[kind.rstrip("?")]
        if not test(fla[field]):
            malformed(prefix + field, fla[field], f"expected {what}{' or null' if kind.endswith('?') else ''}")


#: fla parameter (module) names that lazoo names otherwise; every other name is the same in both
RENAMED = {"q_conv1d": "short_conv.convs.q", "k_conv1d": "short_conv.convs.k", "v_conv1d": "short_conv.convs.v",
           "g_norm_swish_gate": "o_norm", "g_norm": "o_norm"}

#: fla's activations under lazoo's names (fla's "swish" is SiLU, its "elu" feature map is ELU + 1)
_SWISH = {"swish": "silu", "silu": "silu"}


def _head_dims(fla: dict, expand_k: float, expand_v: float) -> tuple[int, float]:
    """(lazoo head_k_dim, lazoo expand_v) of a layer sized by fla's expand_k / expand_v ratios, as fla sizes it:
    key_dim = int(hidden · expand_k), head_k_dim = key_dim // num_heads (values alike)."""
    heads = fla["num_heads"]
    head_k_dim = int(fla["hidden_size"] * expand_k) // heads
    head_v_dim = int(fla["hidden_size"] * expand_v) // heads
    for field, dim in (("expand_k", head_k_dim), ("expand_v", head_v_dim)):
        if dim < 1:
            malformed(field, fla.get(field), f"hidden_size {fla['hidden_size']} · {field} leaves less than one "
                      f"channel for each of num_heads = {heads} heads")
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


def _kda(fla: dict) -> dict[str, Any]:
    """fla's KimiDeltaAttention: Kimi Linear's KDA layer with a bias on the output gate's second projection, both
    low-rank projections of rank head_v_dim, grouped value heads (`num_v_heads` a multiple of `num_heads`), and with
    `lower_bound` the bounded decay lower_bound · sigmoid(exp(A_log) · (f + dt_bias)) (`safe_gate` only lets the
    kernels rely on that bound)."""
    heads, head_dim = fla["num_heads"], fla.get("head_dim", 128)
    v_heads, expand_v = fla.get("num_v_heads"), fla.get("expand_v", 1.0)
    if v_heads is not None and (v_heads < heads or v_heads % heads):
        malformed("num_v_heads", v_heads, f"must be a multiple of num_heads = {heads}")
    if not math.isclose(head_dim * expand_v, round(head_dim * expand_v), abs_tol=1e-6):
        malformed("expand_v", expand_v, f"head_dim = {head_dim} · expand_v must be an integer")
    lower_bound = fla.get("lower_bound")
    if lower_bound is not None and not lower_bound < 0:
        malformed("lower_bound", lower_bound, "expected a negative number (the least log decay)")
    if fla.get("safe_gate", False) and lower_bound is None:
        malformed("safe_gate", True, "fla requires lower_bound with safe_gate")
    return {**_conv(fla, True), "num_heads": heads, "head_k_dim": head_dim, "expand_v": expand_v,
            "num_v_heads": None if v_heads in (None, heads) else v_heads, "qk_activation": "silu",
            "v_activation": "silu", "gate_low_rank_dim": None, "gate_bias": True,
            "allow_neg_eigval": bool(fla.get("allow_neg_eigval", False)), "gate_lower_bound": lower_bound,
            "norm_eps": fla.get("norm_eps", 1e-6)}


_MIXERS = {"gated_deltanet": _gated_deltanet, "delta_net": _delta_net, "gla": _gla, "kda": _kda}


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


def mixer_parameter_name(layer_type: str, fla_name: str) -> str:
    """The lazoo mixer parameter name of fla layer parameter `fla_name` (relative to the layer's `attn`) in a layer
    whose lazoo mechanism is `layer_type`."""
    module, _, leaf = fla_name.rpartition(".")
    if layer_type in ("softmax", "sliding_window") or not module:
        return fla_name
    return f"{RENAMED.get(module, module)}.{leaf}"
