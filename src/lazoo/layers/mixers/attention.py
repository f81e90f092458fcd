"""Softmax attention mixers: full causal attention and sliding-window attention (RoPE by default)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import ops
from ..rope import apply_rotary, rotary_cos_sin
from ...registry import Mechanism, register
from .base import TokenMixer, init_qk_scale, unit_norm


class AttentionMixer(TokenMixer):
    """Multi-head softmax attention; the KV cache is the op's state (`k`, `v`, `mask`).

    Options: `use_rope`, `rope_theta`, `qk_norm` (unit-norm q and k with a learned per-head scale).
    `config._attn_implementation` "eager" runs the explicit softmax; otherwise the op picks its backend
    (`LAZOO_BACKEND`, else SDPA).
    """

    defaults = {"use_rope": True, "rope_theta": 10000.0, "qk_norm": False}
    packing = "native"  # cu_seqlens: the op's attention mask keeps every query inside its own sequence

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.add_qkvo_projections(config.hidden_size)
        self.window = None
        self._config = config  # read `_attn_implementation` at call time (it can change after init)
        if options["qk_norm"]:
            self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))

    def _init_lazoo_parameters(self, init):
        if self.options["qk_norm"]:
            init_qk_scale(self, init)

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        q = self.split_heads(self.q_proj(hidden_states))
        k = self.split_heads(self.k_proj(hidden_states))
        v = self.split_heads(self.v_proj(hidden_states))
        scale = None
        if self.options["qk_norm"]:
            q, k = unit_norm(q), unit_norm(k)
            scale = self.qk_scale
        if self.options["use_rope"]:
            cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.options["rope_theta"], q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
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


register(Mechanism(
    name="softmax", mixer=SoftmaxAttentionMixer, op="softmax_attention", title="Softmax attention",
    equation="o_t = Σ_{s≤t} softmax_s(q_t·k_s / √d) v_s (KV cache; optional QK-norm)",
    source="Vaswani et al. 2017, Attention Is All You Need",
    state='the KV cache: {"k", "v", "mask"} of every position seen',
))

register(Mechanism(
    name="sliding_window", mixer=SlidingWindowAttentionMixer, op="softmax_attention",
    title="Sliding-window attention", equation="softmax over the last W positions s ∈ (t−W, t], RoPE",
    source="Beltagy et al. 2020 (Longformer); Online Vector-Quantized attention (2026) §8.2",
    state='the KV cache of the last sliding_window - 1 positions: {"k", "v", "mask"}',
))
