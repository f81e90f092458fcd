"""Softmax attention mixers: full causal attention and sliding-window attention (RoPE by default)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from ..rope import apply_rotary, rotary_cos_sin
from .base import TokenMixer, init_qk_scale, unit_norm


def head_rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of each head's vector (the last dim) with the norm's learned weight, computed in fp32 (or fp64)
    and returned in x's dtype, as fla's q/k norms do."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(cdt), norm.normalized_shape, norm.weight.to(cdt), norm.eps).to(x.dtype)


def repeat_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, T, Hkv, D]` -> `[B, T, Hkv·groups, D]`: query head h reads key/value head h // groups (grouped-query
    attention, as flash-attention and fla group them)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


class AttentionMixer(TokenMixer):
    """Multi-head softmax attention; the KV cache is the op's state (`k`, `v`, `mask`).

    Options: `use_rope`, `rope_theta`, `qk_norm` (unit-norm q and k with a learned per-head scale),
    `num_heads` (None: `config.num_attention_heads`), `num_kv_heads` (grouped-query attention; None: one
    key/value head per query head), `qkv_bias`, `qk_rmsnorm` with `qk_rmsnorm_eps` (RMSNorm with a learned
    weight over each head's q and k, before RoPE). The head dim is `hidden_size // num_heads` and the softmax
    scale head_dim^-0.5 (unless `qk_norm`). `config._attn_implementation` "eager" runs the explicit softmax;
    otherwise the op picks its backend (`LAZOO_BACKEND`, else SDPA).
    """

    defaults = {"use_rope": True, "rope_theta": 10000.0, "qk_norm": False, "num_heads": None,
                "num_kv_heads": None, "qkv_bias": False, "qk_rmsnorm": False, "qk_rmsnorm_eps": 1e-5}
    optional_int_options = ("num_heads", "num_kv_heads")  # None or a positive int
    packing = "native"  # cu_seqlens: the op's attention mask keeps every query inside its own sequence

    def __init__(self, config, layer_idx, options):
        self.check_options({k: options[k] for k in self.optional_int_options})
        super().__init__(config, layer_idx, options, num_heads=options["num_heads"])
        self.num_kv_heads = self._kv_heads(options["num_kv_heads"])
        self._add_projections(config.hidden_size, options["qkv_bias"])
        self.window = None
        self._config = config  # read `_attn_implementation` at call time (it can change after init)
        if options["qk_norm"] and options["qk_rmsnorm"]:
            raise ValueError(f"{self.mechanism}: qk_norm and qk_rmsnorm are two different q/k norms; set at most "
                             "one of them to True")
        if options["qk_norm"]:
            self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))
        if options["qk_rmsnorm"]:
            eps = options["qk_rmsnorm_eps"]
            if not eps > 0:
                raise ValueError(f"{self.mechanism}: qk_rmsnorm_eps must be a number > 0, got {eps!r}")
            self.q_norm = nn.RMSNorm(self.head_dim, eps=float(eps))
            self.k_norm = nn.RMSNorm(self.head_dim, eps=float(eps))

    def _kv_heads(self, num_kv_heads) -> int:
        """Key/value heads: `num_kv_heads`, or one per query head; they must divide the query heads."""
        kv_heads = num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"{self.mechanism}: num_kv_heads={kv_heads} must divide num_heads={self.num_heads} (each "
                             "key/value head serves num_heads // num_kv_heads query heads)")
        return kv_heads

    def _add_projections(self, hidden_size: int, bias: bool) -> None:
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def _init_lazoo_parameters(self, init):
        if self.options["qk_norm"]:
            init_qk_scale(self, init)

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        q, k, v = self._project(hidden_states)
        scale = None
        if self.options["qk_norm"]:
            q, k = unit_norm(q), unit_norm(k)
            scale = self.qk_scale
        if self.options["qk_rmsnorm"]:
            q, k = head_rms_norm(self.q_norm, q), head_rms_norm(self.k_norm, k)
        if self.options["use_rope"]:
            cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.options["rope_theta"], q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
        # a backend only where the config names one (mixer option, or attn_implementation="eager"); else None,
        # so that the op reads LAZOO_BACKEND (auto: SDPA)
        eager = getattr(self._config, "_attn_implementation", None) == "eager"
        backend = self.options.get("backend") or ("recurrent" if eager else None)
        o, state = ops.softmax_attention(
            q, k, v, scale=scale, window=self.window, initial_state=self.read_state(cache),
            output_final_state=cache is not None, mask=mask, backend=backend,
            **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}),
        )
        self.write_state(cache, state)
        return self.o_proj(self.merge_heads(o))

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
            raise ValueError(f"sliding_window must be a positive int for sliding_window layers, got {config.sliding_window}")
        self.window = int(config.sliding_window)


#: the attention options, documented once for both mechanisms
ATTENTION_OPTION_DOCS = {
    "use_rope": "rotary position embedding on q and k (half-split pairs, positions counting real tokens)",
    "rope_theta": "RoPE base θ: pair i of a head of dim D turns by position · θ^(−2i/D)",
    "qk_norm": "unit-norm q and k with a learned per-head scale (initialised to √head_dim) in place of 1/√d",
    "num_heads": "query heads of this layer (head dim hidden_size // num_heads); None: num_attention_heads",
    "num_kv_heads": "key/value heads (grouped-query attention: query head h reads head h // (num_heads // "
                    "num_kv_heads)); None: num_heads",
    "qkv_bias": "biases on the q, k and v projections (the output projection has none)",
    "qk_rmsnorm": "RMSNorm with a learned weight (head_dim, shared by the heads) over each head's q and k, "
                  "before RoPE (fla's qk_norm); not together with qk_norm",
    "qk_rmsnorm_eps": "the ε of the qk_rmsnorm norms",
}

register(Mechanism(
    name="softmax", mixer=SoftmaxAttentionMixer, op="softmax_attention", title="Softmax attention",
    equation="o_t = Σ_{s≤t} softmax_s(q_t·k_s / √d) v_s (KV cache; optional QK-norm)",
    source="Vaswani et al. 2017, Attention Is All You Need",
    state='the KV cache: {"k", "v", "mask"} of every position seen (k and v with num_heads heads)',
    option_docs=ATTENTION_OPTION_DOCS,
))

register(Mechanism(
    name="sliding_window", mixer=SlidingWindowAttentionMixer, op="softmax_attention",
    title="Sliding-window attention", equation="softmax over the last W positions s ∈ (t−W, t], RoPE",
    source="Beltagy, Peters, Cohan 2020, Longformer; hybrid layout: Online Vector Quantized Attention (2026) §8.2",
    state='the KV cache of the last sliding_window - 1 positions: {"k", "v", "mask"} (k and v with num_heads heads)',
    option_docs=ATTENTION_OPTION_DOCS,
))
