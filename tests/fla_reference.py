"""Float64 transcriptions of fla 0.6.0's recurrent layers, and the map of their weights onto lazoo's mixers.

Four layers of fla (flash-linear-attention 0.6.0), written in plain torch from fla's own code, not from
lazoo's: `GatedDeltaNet` (fla/layers/gated_deltanet.py), `DeltaNet` (fla/layers/delta_net.py),
`GatedLinearAttention` (fla/layers/gla.py) and `KimiDeltaAttention` (fla/layers/kda.py), with their recurrences
from fla/ops/gated_delta_rule/naive.py, fla/ops/delta_rule/naive.py, fla/ops/gla/naive.py and fla/ops/kda/naive.py,
their norms from fla/modules (RMSNorm, FusedRMSNormGated, l2norm) and their short convolution from
fla/modules/causal_conv1d. fla is not imported.

Layer names (`layer` below): "gated_deltanet", "delta_net", "gla", "kda" (fla's model types). Layer arguments
(`**args`) are the keyword arguments of fla's layer classes, with fla's defaults, e.g.
`gated_deltanet_layer(weights, x, hidden_size=64, head_dim=16, num_heads=2, expand_v=2)`.
Weights are a dict `{fla parameter name: tensor}` exactly as fla's layer `state_dict()` names them
(`q_proj.weight`, `q_conv1d.weight`, `o_norm.weight`, ...).

Functions:
- `gated_deltanet_layer`, `delta_net_layer`, `gla_layer`, `kda_layer` `(weights, x [T, hidden], **args) -> [T, hidden]`:
  one sequence (fla unpads a batch into sequences that see nothing of each other).
- `padded_layer(layer, weights, x [B, T, hidden], mask [B, T], **args) -> [B, T, hidden]`: a padded batch as
  fla's layer runs it with `attention_mask`: each sample's real tokens alone, zeros at the pads.
- `random_fla_weights(layer, generator, dtype, **args) -> weights`: fresh random weights of fla's names and shapes.
- `lazoo_mechanism(layer)`, `lazoo_options(layer, **args)`, `lazoo_name(layer, fla_name)`,
  `lazoo_state_dict(layer, weights)`: the lazoo mechanism, mixer options and parameter names that express
  the fla layer exactly (what a converter of fla checkpoints applies to each layer's `attn.` weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ============================================================================ building blocks (fla/modules)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """fla's `ShortConvolution` on one sequence, from `causal_conv1d_fwd_kernel`: x `[T, C]`, weight `[C, 1, W]`:
    `y_t = act(Σ_{i=-W+1}^{0} x_{t+i} w[:, i + W − 1] + b)`, x before the start = 0."""
    T, W = x.shape[0], weight.shape[-1]
    w = weight[:, 0, :]
    y = torch.zeros_like(x)
    for i in range(-W + 1, 1):
        shifted = torch.cat([x.new_zeros(min(-i, T), x.shape[1]), x[: T + i]]) if i < 0 else x
        y = y + shifted * w[:, i + W - 1]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's `l2norm_fwd`: `x / sqrt(Σ x² + eps)` over the last dim (eps 1e-6, the kernels' default)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def sum_norm(x: torch.Tensor) -> torch.Tensor:
    """fla/layers/delta_net.py's `sum_norm`: `F.normalize(x, p=1, dim=-1, eps=1e-6)`."""
    return F.normalize(x, p=1, dim=-1, eps=1e-6)


def elu_p1(x: torch.Tensor) -> torch.Tensor:
    """fla's `elu_p1`: x + 1 for x >= 0, exp(x) below."""
    return torch.where(x >= 0, x + 1, torch.exp(torch.clamp(x, max=0)))


#: fla's `ACT2FN` (fla/modules/activations), the one-argument entries lazoo expresses
ACT2FN = {"relu": F.relu, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid, "silu": F.silu, "swish": F.silu,
          "sqrelu": lambda x: F.relu(x) ** 2}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fla's `RMSNorm`: `x / sqrt(mean(x²) + eps) * weight` (no weight without elementwise_affine)."""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rms_norm_gated(x, g, weight, eps: float, activation: str = "swish") -> torch.Tensor:
    """fla's `FusedRMSNormGated` (`layer_norm_gated_fwd_kernel`, RMS): `rms_norm(x) * g·sigmoid(g)` for
    swish/silu, `rms_norm(x) * sigmoid(g)` for sigmoid."""
    gate = g * torch.sigmoid(g) if activation in ("swish", "silu") else torch.sigmoid(g)
    return rms_norm(x, weight, eps) * gate


# ============================================================================ recurrences (fla/ops/*/naive.py)


def gated_delta_rule(q, k, v, g, beta, scale: float | None = None) -> torch.Tensor:
    """`naive_recurrent_gated_delta_rule` on one sequence: q, k `[T, H, K]`, v `[T, HV, V]`, g, beta `[T, HV]`.

    Grouped values (HV > H) as fla's kernels index them (`i_h = i_hv // (HV // H)` in
    fused_recurrent_gated_delta_rule_fwd_kernel): value head j reads query/key head j // (HV // H)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    qk_head = torch.arange(HV) // (HV // H)
    q, k = q[:, qk_head], k[:, qk_head]
    scale = K ** -0.5 if scale is None else scale
    h = q.new_zeros(HV, K, V)
    o = []
    for i in range(T):
        b_q, b_k = q[i] * scale, k[i]
        h = h * g[i].exp()[:, None, None]
        b_v = (v[i] - (h * b_k[..., None]).sum(-2)) * beta[i][:, None]
        h = h + b_k[..., None] * b_v[:, None, :]
        o.append(torch.einsum("hd,hdm->hm", b_q, h))
    return torch.stack(o)


def delta_rule(q, k, v, beta) -> torch.Tensor:
    """`delta_rule_recurrence` on one sequence: q, k `[T, H, K]`, v `[T, H, V]`, beta `[T, H]`."""
    T, H, K = q.shape
    q = q * K ** -0.5
    S = q.new_zeros(H, K, v.shape[-1])
    o = []
    for i in range(T):
        _k = k[i]
        _v = (v[i] - (S * _k[..., None]).sum(-2)) * beta[i][:, None]
        S = S + _k[..., None] * _v[:, None, :]
        o.append(torch.einsum("hd,hdm->hm", q[i], S))
    return torch.stack(o)


def gla_recurrence(q, k, v, gk) -> torch.Tensor:
    """`naive_recurrent_gla` on one sequence: q, k, gk `[T, H, K]`, v `[T, H, V]`."""
    T, H, K = q.shape
    scale = K ** -0.5
    h = q.new_zeros(H, K, v.shape[-1])
    o = []
    for i in range(T):
        h = h * gk[i].exp()[..., None] + k[i][..., None] * v[i][:, None, :]
        o.append((q[i][..., None] * scale * h).sum(-2))
    return torch.stack(o)


def kda_recurrence(q, k, v, g, beta, scale: float | None = None) -> torch.Tensor:
    """`naive_recurrent_kda` (fla/ops/kda/naive.py) on one sequence: q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV, K]`
    (a log decay per key channel), beta `[T, HV]`; value head j reads query/key head j // (HV // H)."""
    T, H, K = q.shape
    HV = v.shape[1]
    qk_head = torch.arange(HV) // (HV // H)
    q, k = q[:, qk_head] * (K ** -0.5 if scale is None else scale), k[:, qk_head]
    S = q.new_zeros(HV, K, v.shape[-1])
    o = []
    for i in range(T):
        S = S * g[i].exp()[..., None]
        S = S + (beta[i][:, None] * k[i])[..., None] * (v[i] - (k[i][..., None] * S).sum(-2))[:, None, :]
        o.append(torch.einsum("hk,hkv->hv", q[i], S))
    return torch.stack(o)


# ============================================================================ layers (fla/layers/*.py)


def _linear(weights, name, x):
    return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))


def _conv(weights, name, x, activation):
    return short_conv(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"), activation)


def _heads(x, head_dim):
    return x.view(x.shape[0], -1, head_dim)


def _silu_qkv_heads(weights, x, head_dim: int, head_v_dim: int, use_short_conv: bool):
    """q, k, v `[T, heads, dim]`: the projections, through their short convolutions with silu (silu alone
    without them), as GatedDeltaNet and KimiDeltaAttention compute them."""
    q, k, v = (_linear(weights, f"{n}_proj", x) for n in "qkv")
    if use_short_conv:
        q, k, v = (_conv(weights, f"{n}_conv1d", t, "silu") for n, t in zip("qkv", (q, k, v)))
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    return _heads(q, head_dim), _heads(k, head_dim), _heads(v, head_v_dim)


def gated_deltanet_layer(weights, x, *, hidden_size=2048, expand_v=2, head_dim=256, num_heads=6,
                         num_v_heads=None, use_gate=True, use_short_conv=True, allow_neg_eigval=False,
                         conv_size=4, conv_bias=False, norm_eps=1e-5, output_gate_activation="swish", **_):
    """fla's `GatedDeltaNet.forward` on one sequence x `[T, hidden]`."""
    head_v_dim = int(head_dim * expand_v)
    q, k, v = _silu_qkv_heads(weights, x, head_dim, head_v_dim, use_short_conv)
    beta = torch.sigmoid(_linear(weights, "b_proj", x)) * (2.0 if allow_neg_eigval else 1.0)
    g = -weights["A_log"].exp() * F.softplus(_linear(weights, "a_proj", x) + weights["dt_bias"])
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)  # use_qk_l2norm_in_kernel=True
    if use_gate:
        gate = _heads(_linear(weights, "g_proj", x), head_v_dim)
        o = rms_norm_gated(o, gate, weights["o_norm.weight"], norm_eps, output_gate_activation)
    else:
        o = rms_norm(o, weights["o_norm.weight"], norm_eps)
    return _linear(weights, "o_proj", o.reshape(o.shape[0], -1))


def kda_layer(weights, x, *, hidden_size=2048, expand_v=1.0, head_dim=128, num_heads=16, num_v_heads=None,
              use_short_conv=True, allow_neg_eigval=False, lower_bound=None, conv_size=4, conv_bias=False,
              norm_eps=1e-5, **_):
    """fla's `KimiDeltaAttention.forward` on one sequence x `[T, hidden]`: the gate as fla's `naive_kda_gate`
    (`naive_kda_lowerbound_gate` with `lower_bound`), q and k l2-normalised and β a sigmoid in the kernel, the output
    through `FusedRMSNormGated(activation="sigmoid")` with g_proj (two layers, a bias on the second)."""
    head_v_dim = int(head_dim * expand_v)
    q, k, v = _silu_qkv_heads(weights, x, head_dim, head_v_dim, use_short_conv)
    f = _heads(_linear(weights, "f_proj.1", _linear(weights, "f_proj.0", x)), head_dim)
    f = f + weights["dt_bias"].view(f.shape[1], head_dim)
    rate = weights["A_log"].exp()[:, None]
    g = -rate * F.softplus(f) if lower_bound is None else lower_bound * torch.sigmoid(rate * f)
    beta = torch.sigmoid(_linear(weights, "b_proj", x)) * (2.0 if allow_neg_eigval else 1.0)
    o = kda_recurrence(l2norm(q), l2norm(k), v, g, beta)
    gate = _heads(_linear(weights, "g_proj.1", _linear(weights, "g_proj.0", x)), head_v_dim)
    o = rms_norm_gated(o, gate, weights["o_norm.weight"], norm_eps, "sigmoid")
    return _linear(weights, "o_proj", o.reshape(o.shape[0], -1))


def delta_net_layer(weights, x, *, hidden_size=1024, expand_k=1.0, expand_v=1.0, num_heads=4, use_beta=True,
                    use_gate=False, use_short_conv=True, conv_size=4, conv_bias=False, allow_neg_eigval=False,
                    qk_activation="silu", qk_norm="l2", norm_eps=1e-5, **_):
    """fla's `DeltaNet.forward` on one sequence x `[T, hidden]`."""
    head_k_dim = round(hidden_size * expand_k) // num_heads
    head_v_dim = round(hidden_size * expand_v) // num_heads
    q, k, v = (_linear(weights, f"{n}_proj", x) for n in "qkv")
    if use_short_conv:
        qk_conv_act = "silu" if qk_activation == "silu" else None
        q, k = _conv(weights, "q_conv1d", q, qk_conv_act), _conv(weights, "k_conv1d", k, qk_conv_act)
        v = _conv(weights, "v_conv1d", v, "silu")
    else:
        if qk_activation == "silu":
            q, k = F.silu(q), F.silu(k)
        v = F.silu(v)
    q, k, v = _heads(q, head_k_dim), _heads(k, head_k_dim), _heads(v, head_v_dim)
    if qk_activation == "relu":
        q, k = q.relu(), k.relu()
    elif qk_activation == "elu":
        q, k = elu_p1(q), elu_p1(k)
    if qk_norm == "sum":
        q, k = sum_norm(q), sum_norm(k)
    beta = torch.sigmoid(_linear(weights, "b_proj", x)) if use_beta else torch.ones_like(q[..., 0])
    if allow_neg_eigval:
        beta = beta * 2.0
    if qk_norm == "l2":  # use_qk_l2norm_in_kernel
        q, k = l2norm(q), l2norm(k)
    o = delta_rule(q, k, v, beta)
    if use_gate:
        gate = _heads(_linear(weights, "g_proj", x), head_v_dim)
        o = rms_norm_gated(o, gate, weights["o_norm.weight"], norm_eps)
    else:
        o = rms_norm(o, weights["o_norm.weight"], norm_eps)
    return _linear(weights, "o_proj", o.reshape(o.shape[0], -1))


def _gla_fuses_norm(gate_fn="swish", fuse_norm=True, use_output_gate=True, **_) -> bool:
    return gate_fn == "swish" and fuse_norm and use_output_gate


def gla_layer(weights, x, *, hidden_size=1024, expand_k=0.5, expand_v=1.0, num_heads=4, num_kv_heads=None,
              feature_map=None, use_short_conv=False, conv_size=4, conv_bias=False, use_output_gate=True,
              gate_fn="swish", elementwise_affine=True, norm_eps=1e-5, gate_logit_normalizer=16,
              gate_low_rank_dim=16, clamp_min=None, fuse_norm=True, **_):
    """fla's `GatedLinearAttention.forward` on one sequence x `[T, hidden]`."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_k_dim = round(hidden_size * expand_k) // num_heads
    head_v_dim = round(hidden_size * expand_v) // num_heads
    q, k, v = (_linear(weights, f"{n}_proj", x) for n in "qkv")
    if use_short_conv:
        q, k, v = (_conv(weights, f"{n}_conv1d", t, "silu") for n, t in zip("qkv", (q, k, v)))
    gk = _linear(weights, "gk_proj.1", _linear(weights, "gk_proj.0", x))
    # repeat(x, '... (h d) -> ... (h g) d'): query head j reads key/value head j // (num_heads / num_kv_heads)
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
    q = _heads(q, head_k_dim)
    k, gk, v = _heads(k, head_k_dim)[:, kv_head], _heads(gk, head_k_dim)[:, kv_head], _heads(v, head_v_dim)[:, kv_head]
    gk = F.logsigmoid(gk) / gate_logit_normalizer
    if clamp_min is not None:
        gk = torch.clamp_min(gk, clamp_min)
    if feature_map is not None:
        q, k = ACT2FN[feature_map](q), ACT2FN[feature_map](k)
    o = gla_recurrence(q, k, v, gk)
    if _gla_fuses_norm(gate_fn, fuse_norm, use_output_gate):
        gate = _heads(_linear(weights, "g_proj", x), head_v_dim)
        o = rms_norm_gated(o, gate, weights.get("g_norm_swish_gate.weight"), norm_eps).reshape(o.shape[0], -1)
    else:
        o = rms_norm(o, weights.get("g_norm.weight"), norm_eps).reshape(o.shape[0], -1)
        if use_output_gate:
            o = o * ACT2FN[gate_fn](_linear(weights, "g_proj", x))
    return _linear(weights, "o_proj", o)


LAYERS = {"gated_deltanet": gated_deltanet_layer, "delta_net": delta_net_layer, "gla": gla_layer, "kda": kda_layer}


def padded_layer(layer: str, weights, x: torch.Tensor, mask: torch.Tensor, **args) -> torch.Tensor:
    """fla's layer on a padded batch x `[B, T, hidden]` with `attention_mask` `mask` `[B, T]` (1 = real):
    fla unpads (each sample's real tokens form one sequence) and repads the output with zeros."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        real = mask[b].bool()
        out[b, real] = LAYERS[layer](weights, x[b, real], **args)
    return out


# ============================================================================ weights in fla's layout


def fla_weight_shapes(layer: str, **args) -> dict[str, tuple[int, ...]]:
    """`{fla parameter name: shape}` of fla's layer built with `args` (its `__init__` arguments)."""
    return _SHAPES[layer](**args)


def _conv_shapes(widths: dict[str, int], conv_size: int, conv_bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for n, width in widths.items():
        shapes[f"{n}_conv1d.weight"] = (width, 1, conv_size)
        if conv_bias:
            shapes[f"{n}_conv1d.bias"] = (width,)
    return shapes


def _gated_deltanet_shapes(*, hidden_size=2048, expand_v=2, head_dim=256, num_heads=6, num_v_heads=None,
                           use_gate=True, use_short_conv=True, conv_size=4, conv_bias=False, **_):
    hv = num_heads if num_v_heads is None else num_v_heads
    key_dim, head_v_dim = num_heads * head_dim, int(head_dim * expand_v)
    value_dim = hv * head_v_dim
    shapes = {"A_log": (hv,), "dt_bias": (hv,), "q_proj.weight": (key_dim, hidden_size),
              "k_proj.weight": (key_dim, hidden_size), "v_proj.weight": (value_dim, hidden_size),
              "a_proj.weight": (hv, hidden_size), "b_proj.weight": (hv, hidden_size)}
    if use_short_conv:
        shapes.update(_conv_shapes({"q": key_dim, "k": key_dim, "v": value_dim}, conv_size, conv_bias))
    if use_gate:
        shapes["g_proj.weight"] = (value_dim, hidden_size)
    shapes.update({"o_norm.weight": (head_v_dim,), "o_proj.weight": (hidden_size, value_dim)})
    return shapes


def _delta_net_shapes(*, hidden_size=1024, expand_k=1.0, expand_v=1.0, num_heads=4, use_beta=True,
                      use_gate=False, use_short_conv=True, conv_size=4, conv_bias=False, **_):
    key_dim, value_dim = round(hidden_size * expand_k), round(hidden_size * expand_v)
    shapes = {"q_proj.weight": (key_dim, hidden_size), "k_proj.weight": (key_dim, hidden_size),
              "v_proj.weight": (value_dim, hidden_size)}
    if use_beta:
        shapes["b_proj.weight"] = (num_heads, hidden_size)
    if use_short_conv:
        shapes.update(_conv_shapes({"q": key_dim, "k": key_dim, "v": value_dim}, conv_size, conv_bias))
    if use_gate:
        shapes["g_proj.weight"] = (value_dim, hidden_size)
    shapes.update({"o_norm.weight": (value_dim // num_heads,), "o_proj.weight": (hidden_size, value_dim)})
    return shapes


def _gla_shapes(*, hidden_size=1024, expand_k=0.5, expand_v=1.0, num_heads=4, num_kv_heads=None,
                use_short_conv=False, conv_size=4, conv_bias=False, use_output_gate=True, gate_fn="swish",
                elementwise_affine=True, gate_low_rank_dim=16, fuse_norm=True, **_):
    groups = num_heads // (num_heads if num_kv_heads is None else num_kv_heads)
    key_dim, value_dim = round(hidden_size * expand_k), round(hidden_size * expand_v)
    shapes = {"q_proj.weight": (key_dim, hidden_size), "k_proj.weight": (key_dim // groups, hidden_size),
              "v_proj.weight": (value_dim // groups, hidden_size)}
    if use_output_gate:
        shapes["g_proj.weight"] = (value_dim, hidden_size)
    if use_short_conv:
        shapes.update(_conv_shapes({"q": key_dim, "k": key_dim // groups, "v": value_dim // groups},
                                   conv_size, conv_bias))
    shapes.update({"gk_proj.0.weight": (gate_low_rank_dim, hidden_size),
                   "gk_proj.1.weight": (key_dim // groups, gate_low_rank_dim),
                   "gk_proj.1.bias": (key_dim // groups,), "o_proj.weight": (hidden_size, value_dim)})
    if elementwise_affine:
        norm = "g_norm_swish_gate" if _gla_fuses_norm(gate_fn, fuse_norm, use_output_gate) else "g_norm"
        shapes[f"{norm}.weight"] = (value_dim // num_heads,)
    return shapes


def _kda_shapes(*, hidden_size=2048, expand_v=1.0, head_dim=128, num_heads=16, num_v_heads=None,
                use_short_conv=True, conv_size=4, conv_bias=False, **_):
    hv = num_heads if num_v_heads is None else num_v_heads
    key_dim, head_v_dim = num_heads * head_dim, int(head_dim * expand_v)
    value_dim = hv * head_v_dim
    shapes = {"A_log": (hv,), "dt_bias": (hv * head_dim,), "q_proj.weight": (key_dim, hidden_size),
              "k_proj.weight": (key_dim, hidden_size), "v_proj.weight": (value_dim, hidden_size),
              "f_proj.0.weight": (head_v_dim, hidden_size), "f_proj.1.weight": (hv * head_dim, head_v_dim),
              "b_proj.weight": (hv, hidden_size), "g_proj.0.weight": (head_v_dim, hidden_size),
              "g_proj.1.weight": (value_dim, head_v_dim), "g_proj.1.bias": (value_dim,),
              "o_norm.weight": (head_v_dim,), "o_proj.weight": (hidden_size, value_dim)}
    if use_short_conv:
        shapes.update(_conv_shapes({"q": key_dim, "k": key_dim, "v": value_dim}, conv_size, conv_bias))
    return shapes


_SHAPES = {"gated_deltanet": _gated_deltanet_shapes, "delta_net": _delta_net_shapes, "gla": _gla_shapes,
           "kda": _kda_shapes}


def random_fla_weights(layer: str, generator: torch.Generator, dtype=torch.float64, **args) -> dict:
    """Fresh random weights in fla's names and shapes: projections ~ N(0, 1/fan_in), norm weights around 1,
    A_log, dt_bias and biases ~ N(0, 0.5²) (never zeros or fla's constant inits)."""
    weights = {}
    for name, shape in fla_weight_shapes(layer, **args).items():
        w = torch.randn(shape, generator=generator, dtype=dtype)
        if name.endswith("norm.weight") or name.endswith("gate.weight"):
            w = 1 + 0.3 * w
        elif len(shape) >= 2:
            w = w / math.sqrt(shape[-1])  # fan-in of a projection, width of a convolution
        else:
            w = 0.5 * w
        weights[name] = w
    return weights


# ============================================================================ fla layer -> lazoo mixer


def lazoo_mechanism(layer: str) -> str:
    """The lazoo mechanism (`layer_types` entry) of fla layer `layer`."""
    return {"gated_deltanet": "gated_delta_net", "delta_net": "delta_net", "gla": "gla"}[layer]


def _fla_head_dims(hidden_size, expand_k, expand_v, num_heads) -> tuple[int, float]:
    """(lazoo head_k_dim, lazoo expand_v) of a layer sized by fla's expand_k / expand_v ratios."""
    head_k_dim = round(hidden_size * expand_k) // num_heads
    head_v_dim = round(hidden_size * expand_v) // num_heads
    return head_k_dim, head_v_dim / head_k_dim


def _conv_options(use_short_conv, conv_size, conv_bias) -> dict:
    return {"use_short_conv": bool(use_short_conv), "conv_size": conv_size, "conv_bias": bool(conv_bias),
            "short_conv_targets": "qkv"}


def lazoo_options(layer: str, **args) -> dict:
    """The lazoo mixer options (`mixer_kwargs[lazoo_mechanism(layer)]`) that express fla's layer built with
    `args`. Each layer's q/k/v activations are stated, with or without the short convolution."""
    if layer == "gated_deltanet":
        a = {"expand_v": 2, "head_dim": 256, "num_heads": 6, "num_v_heads": None, "use_gate": True,
             "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "conv_bias": False,
             "norm_eps": 1e-5, "output_gate_activation": "swish", **args}
        return {**_conv_options(a["use_short_conv"], a["conv_size"], a["conv_bias"]),
                "num_heads": a["num_heads"], "head_k_dim": a["head_dim"], "expand_v": a["expand_v"],
                "num_v_heads": a["num_v_heads"], "qk_activation": "silu", "v_activation": "silu",
                "use_beta": True, "beta_bias": False, "allow_neg_eigval": a["allow_neg_eigval"], "qk_norm": "l2",
                "output_norm": True, "output_gate": a["use_gate"],
                "gate_activation": "sigmoid" if a["output_gate_activation"] == "sigmoid" else "silu",
                "norm_eps": a["norm_eps"]}
    if layer == "delta_net":
        a = {"hidden_size": 1024, "expand_k": 1.0, "expand_v": 1.0, "num_heads": 4, "use_beta": True,
             "use_gate": False, "use_short_conv": True, "conv_size": 4, "conv_bias": False,
             "allow_neg_eigval": False, "qk_activation": "silu", "qk_norm": "l2", "norm_eps": 1e-5, **args}
        head_k_dim, expand_v = _fla_head_dims(a["hidden_size"], a["expand_k"], a["expand_v"], a["num_heads"])
        return {**_conv_options(a["use_short_conv"], a["conv_size"], a["conv_bias"]),
                "num_heads": a["num_heads"], "head_k_dim": head_k_dim, "expand_v": expand_v,
                "qk_activation": {"elu": "elu1"}.get(a["qk_activation"], a["qk_activation"]),
                "v_activation": "silu", "use_beta": a["use_beta"], "beta_bias": False,
                "allow_neg_eigval": a["allow_neg_eigval"], "qk_norm": a["qk_norm"], "output_norm": True,
                "output_gate": a["use_gate"], "gate_activation": "silu", "norm_eps": a["norm_eps"]}
    if layer == "gla":
        a = {"hidden_size": 1024, "expand_k": 0.5, "expand_v": 1.0, "num_heads": 4, "num_kv_heads": None,
             "feature_map": None, "use_short_conv": False, "conv_size": 4, "conv_bias": False,
             "use_output_gate": True, "gate_fn": "swish", "elementwise_affine": True, "norm_eps": 1e-5,
             "gate_logit_normalizer": 16, "gate_low_rank_dim": 16, "clamp_min": None, **args}
        head_k_dim, expand_v = _fla_head_dims(a["hidden_size"], a["expand_k"], a["expand_v"], a["num_heads"])
        swish = {"swish": "silu"}
        return {**_conv_options(a["use_short_conv"], a["conv_size"], a["conv_bias"]),
                "num_heads": a["num_heads"], "head_k_dim": head_k_dim, "expand_v": expand_v,
                "num_kv_heads": a["num_kv_heads"], "qk_activation": None, "v_activation": None,
                "conv_activation": "silu", "feature_map": swish.get(a["feature_map"], a["feature_map"]),
                "output_norm": True, "output_norm_affine": bool(a["elementwise_affine"]),
                "output_gate": a["use_output_gate"], "gate_activation": swish.get(a["gate_fn"], a["gate_fn"]),
                "norm_eps": a["norm_eps"], "gate_logit_normalizer": a["gate_logit_normalizer"],
                "gate_low_rank_dim": a["gate_low_rank_dim"], "clamp_min": a["clamp_min"]}
    raise ValueError(f"unknown fla layer {layer!r}; known: {sorted(LAYERS)}")


#: fla parameter names that lazoo names otherwise (every other name is the same in both)
_RENAMED = {"q_conv1d": "short_conv.convs.q", "k_conv1d": "short_conv.convs.k", "v_conv1d": "short_conv.convs.v",
            "g_norm_swish_gate": "o_norm", "g_norm": "o_norm"}


def lazoo_name(layer: str, fla_name: str) -> str:
    """The lazoo mixer parameter name of fla parameter `fla_name` (`q_conv1d.weight` ->
    `short_conv.convs.q.weight`, GLA's `g_norm_swish_gate.weight` / `g_norm.weight` -> `o_norm.weight`)."""
    module, _, leaf = fla_name.rpartition(".")
    return f"{_RENAMED.get(module, module)}.{leaf}" if module else fla_name


def lazoo_state_dict(layer: str, weights: dict) -> dict:
    """fla layer weights renamed for the lazoo mixer (same tensors, no copy)."""
    return {lazoo_name(layer, name): w for name, w in weights.items()}
