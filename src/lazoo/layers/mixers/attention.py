"""Softmax attention mixers: full causal attention and sliding-window attention (RoPE by default)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...ops.softmax import repeat_kv_heads  # noqa: F401  (kept importable here; the op repeats the heads now)
from ...registry import Mechanism, register
from ..norms import ZeroCenteredRMSNorm
from ..rope import apply_rotary, rotary_cos_sin
from .base import TokenMixer, init_qk_scale, unit_norm


def head_rms_norm(norm: nn.RMSNorm | ZeroCenteredRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of each head's vector (the last dim) with the norm's learned weight, computed in fp32 (or fp64)
    and returned in x's dtype, as fla's q/k norms do; a zero-centred norm scales by (1 + w), as Qwen3.5's do."""
    if isinstance(norm, ZeroCenteredRMSNorm):
        return norm(x)  # (1 + w)·x̂, in fp32 for half types (float64 stays), returned in x's dtype
    cdt = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(cdt), norm.normalized_shape, norm.weight.to(cdt), norm.eps).to(x.dtype)


class AttentionMixer(TokenMixer):
    """Multi-head softmax attention; the KV cache is the op's state (`k`, `v`, `mask`).

    Options: `use_rope`, `rope_theta`, `rotary_dim` (RoPE on the first rotary_dim channels of each head only;
    None: all), `qk_norm` (unit-norm q and k with a learned per-head scale), `num_heads` (None:
    `config.num_attention_heads`), `num_kv_heads` (grouped-query attention; None: one key/value head per query
    head), `head_dim` (None: `hidden_size // num_heads`), `qkv_bias`, `qk_rmsnorm` with `qk_rmsnorm_eps` and
    `qk_rmsnorm_zero_centered` (RMSNorm with a learned weight over each head's q and k, before RoPE; zero-centred:
    (1 + w)), `output_gate` (the attention output times sigmoid(g_proj(x)) per channel, before o_proj),
    `softmax_scale` (the number the scores q·k are multiplied by; None: head_dim^-0.5, or the learned scale of
    `qk_norm`). With every option on (head_dim, num_kv_heads, qk_rmsnorm, qk_rmsnorm_zero_centered, rotary_dim,
    output_gate) the layer computes transformers' `Qwen3_5Attention` / `Qwen3NextAttention`, whose q_proj holds
    lazoo's q_proj and g_proj interleaved per head ([H, 2·head_dim] rows: query then gate); with `softmax_scale`,
    NoPE or full RoPE and grouped key/value heads, Granite 4.0-H's attention. `config._attn_implementation` "eager"
    runs the explicit softmax; otherwise the op picks its backend (`LAZOO_BACKEND`, else SDPA). The KV cache keeps
    num_kv_heads heads.
    """

    defaults = {"use_rope": True, "rope_theta": 10000.0, "rotary_dim": None, "qk_norm": False, "num_heads": None,
                "num_kv_heads": None, "head_dim": None, "qkv_bias": False, "qk_rmsnorm": False,
                "qk_rmsnorm_eps": 1e-5, "qk_rmsnorm_zero_centered": False, "output_gate": False,
                "softmax_scale": None}
    optional_int_options = ("num_heads", "num_kv_heads", "head_dim", "rotary_dim")  # None or a positive int
    packing = "native"  # cu_seqlens: the op's attention mask keeps every query inside its own sequence
    has_attention_weights = True

    def __init__(self, config, layer_idx, options):
        self.check_options({k: options[k] for k in self.optional_int_options})
        super().__init__(config, layer_idx, options, num_heads=options["num_heads"], head_dim=options["head_dim"])
        self.num_kv_heads = self._kv_heads(options["num_kv_heads"])
        self.rotary_dim = self._rotary_dim(options)
        self.softmax_scale = self._softmax_scale(options)
        self._add_projections(config.hidden_size, options["qkv_bias"])
        if options["output_gate"]:
            self.g_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=options["qkv_bias"])
        self.window = None
        self._config = config  # read `_attn_implementation` at call time (it can change after init)
        if options["qk_norm"] and options["qk_rmsnorm"]:
            raise ValueError(f"{self.mechanism}: qk_norm and qk_rmsnorm are two different q/k norms; set at most "
                             "one of them to True")
        if options["qk_rmsnorm_zero_centered"] and not options["qk_rmsnorm"]:
            raise ValueError(f"{self.mechanism}: qk_rmsnorm_zero_centered=True is a form of the qk_rmsnorm norms; set "
                             "qk_rmsnorm=True as well")
        if options["qk_norm"]:
            self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))
        if options["qk_rmsnorm"]:
            eps = options["qk_rmsnorm_eps"]
            if not eps > 0:
                raise ValueError(f"{self.mechanism}: qk_rmsnorm_eps must be a number > 0, got {eps!r}")
            norm = ZeroCenteredRMSNorm if options["qk_rmsnorm_zero_centered"] else nn.RMSNorm
            self.q_norm = norm(self.head_dim, eps=float(eps))
            self.k_norm = norm(self.head_dim, eps=float(eps))

    def _rotary_dim(self, options) -> int:
        """The channels of each head that RoPE turns: `rotary_dim` (even, at most head_dim), or the whole head."""
        rotary = options["rotary_dim"]
        if rotary is None:
            if options["use_rope"] and options["head_dim"] is not None and self.head_dim % 2:
                raise ValueError(f"{self.mechanism}: RoPE (use_rope=True) needs an even head_dim, got "
                                 f"head_dim={self.head_dim}; set rotary_dim to an even number of its channels or "
                                 "use_rope=False")
            return self.head_dim
        if not options["use_rope"]:
            raise ValueError(f"{self.mechanism}: rotary_dim={rotary} is the RoPE width but use_rope is False; leave "
                             "rotary_dim None or set use_rope=True")
        if rotary % 2 or rotary > self.head_dim:
            raise ValueError(f"{self.mechanism}: rotary_dim must be an even number of channels at most head_dim="
                             f"{self.head_dim} (RoPE turns pairs of them), got {rotary}")
        return rotary

    def _softmax_scale(self, options) -> float | None:
        """The scores' scale: `softmax_scale` (a finite number > 0; Granite's `attention_multiplier`), or None for
        head_dim^-0.5. Not with qk_norm, whose learned per-head scale takes its place."""
        scale = options["softmax_scale"]
        if scale is None:
            return None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"{self.mechanism}: softmax_scale must be None (head_dim^-0.5) or a finite number > 0, "
                             f"got {scale!r}")
        if options["qk_norm"]:
            raise ValueError(f"{self.mechanism}: softmax_scale={scale} and qk_norm=True both scale the scores (qk_norm "
                             "by its learned per-head scale); set at most one of them")
        return float(scale)

    def _kv_heads(self, num_kv_heads) -> int:
        """Key/value heads: `num_kv_heads`, or one per query head; they must divide the query heads."""
        kv_heads = num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"{self.mechanism}: num_kv_heads={kv_heads} must divide num_heads={self.num_heads} (each "
                             "key/value head serves num_heads // num_kv_heads query heads)")
        return kv_heads

    def _add_projections(self, hidden_size: int, bias: bool) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=False)

    def _init_lazoo_parameters(self, init):
        if self.options["qk_norm"]:
            init_qk_scale(self, init)
        if self.options["qk_rmsnorm"] and self.options["qk_rmsnorm_zero_centered"]:
            # w = 0 (a scale of 1), not the ones transformers gives every "RMSNorm"; a loaded weight is kept
            self.q_norm.reset_parameters(init)
            self.k_norm.reset_parameters(init)

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None,
                output_attentions=False):
        """The layer's output; with `output_attentions=True`, `(output, weights [B, H, T, S])` (the explicit softmax
        the output is made of, over the S cached + new key positions)."""
        q, k, v = self._project(hidden_states)
        scale = self.softmax_scale
        if self.options["qk_norm"]:
            q, k = unit_norm(q), unit_norm(k)
            scale = self.qk_scale
        if self.options["qk_rmsnorm"]:
            q, k = head_rms_norm(self.q_norm, q), head_rms_norm(self.k_norm, k)
        if self.options["use_rope"]:
            cos, sin = rotary_cos_sin(position_ids, self.rotary_dim, self.options["rope_theta"], q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # k and v keep their num_kv_heads heads (and so does the cache): the op repeats them for the compute only
        # a backend only where the config names one (mixer option, or attn_implementation="eager"); else None,
        # so that the op reads LAZOO_BACKEND (auto: SDPA)
        eager = getattr(self._config, "_attn_implementation", None) == "eager"
        backend = self.options.get("backend") or ("recurrent" if eager else None)
        o, state, *weights = ops.softmax_attention(
            q, k, v, scale=scale, window=self.window, initial_state=self.read_state(cache),
            output_final_state=cache is not None, mask=mask, backend=backend,
            **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}),
            **({"output_attentions": True} if output_attentions else {}),
        )
        self.write_state(cache, state)
        o = self.merge_heads(o)
        if self.options["output_gate"]:
            o = o * torch.sigmoid(self.g_proj(hidden_states))
        o = self.o_proj(o)
        return (o, weights[0]) if output_attentions else o

    def keeps_every_position(self) -> bool:
        return self.window is None

    def kv_cache_length(self) -> int | None:
        return None if self.window is None else self.window - 1

    def _project(self, x):
        """q `[B, T, num_heads, D]`, k and v `[B, T, num_kv_heads, D]`."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return q, k, v


class SoftmaxAttentionMixer(AttentionMixer):
    """Full causal softmax attention (optional QK-norm with a learned per-head scale)."""

    mechanism = "softmax"


class SlidingWindowAttentionMixer(AttentionMixer):
    """Softmax over the last `config.sliding_window` positions (the query's own included)."""

    mechanism = "sliding_window"

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        if not config.sliding_window or config.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int for sliding_window layers, got "
                             f"{config.sliding_window}")
        self.window = int(config.sliding_window)


#: the attention options, documented once for both mechanisms
ATTENTION_OPTION_DOCS = {
    "use_rope": "rotary position embedding on q and k (half-split pairs, positions counting real tokens)",
    "rope_theta": "RoPE base θ: pair i of the R rotated channels (R = rotary_dim) turns by position · θ^(−2i/R)",
    "rotary_dim": "channels R of each head that RoPE turns: the first R (even, ≤ head_dim; channel i paired with "
                  "i + R/2, as transformers' partial_rotary_factor does), the others pass through; None: the whole "
                  "head",
    "qk_norm": "unit-norm q and k with a learned per-head scale (initialised to √head_dim) in place of 1/√d",
    "num_heads": "query heads of this layer (head dim hidden_size // num_heads unless head_dim is set); None: "
                 "num_attention_heads",
    "num_kv_heads": "key/value heads (grouped-query attention: query head h reads head h // (num_heads // "
                    "num_kv_heads); the KV cache keeps num_kv_heads heads); None: num_heads",
    "head_dim": "the dim of each head, independent of hidden_size (q_proj: hidden_size -> num_heads·head_dim, k_proj "
                "and v_proj: hidden_size -> num_kv_heads·head_dim, o_proj: num_heads·head_dim -> hidden_size); "
                "None: hidden_size // num_heads",
    "qkv_bias": "biases on the q, k and v projections (and on g_proj; the output projection has none)",
    "qk_rmsnorm": "RMSNorm with a learned weight (head_dim, shared by the heads) over each head's q and k, "
                  "before RoPE (fla's qk_norm); not together with qk_norm",
    "qk_rmsnorm_eps": "the ε of the qk_rmsnorm norms",
    "qk_rmsnorm_zero_centered": "the qk_rmsnorm norms scale by (1 + w), w initialised to 0, computed in fp32 for "
                                "half types (Qwen3.5 / Qwen3-Next); needs qk_rmsnorm",
    "output_gate": "the attention output times sigmoid(g_proj(x)) per channel before o_proj (g_proj: hidden_size -> "
                   "num_heads·head_dim; Qwen3.5 / Qwen3-Next gated attention)",
    "softmax_scale": "the number the scores q·k are multiplied by before the softmax (Granite's attention_multiplier); "
                     "None: 1/√head_dim (or qk_norm's learned scale, with which it cannot be combined)",
}

register(Mechanism(
    name="softmax", mixer=SoftmaxAttentionMixer, op="softmax_attention", title="Softmax attention",
    equation="o_t = Σ_{s≤t} softmax_s(q_t·k_s / √d) v_s (KV cache; optional QK-norm)",
    source="Vaswani et al. 2017, Attention Is All You Need",
    state='the KV cache: {"k", "v", "mask"} of every position seen (k and v with num_kv_heads heads)',
    option_docs=ATTENTION_OPTION_DOCS,
))

register(Mechanism(
    name="sliding_window", mixer=SlidingWindowAttentionMixer, op="softmax_attention",
    title="Sliding-window attention", equation="softmax over the last W positions s ∈ (t−W, t], RoPE",
    source="Beltagy, Peters, Cohan 2020, Longformer; hybrid layout: Online Vector Quantized Attention (2026) §8.2",
    state='the KV cache of the last sliding_window - 1 positions: {"k", "v", "mask"} (k and v with num_kv_heads '
          'heads)',
    option_docs=ATTENTION_OPTION_DOCS,
))
