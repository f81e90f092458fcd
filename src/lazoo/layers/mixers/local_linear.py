"""Local-linear (p = 1) attention mixer (seed 004 eqs 52–54): the output at t is the intercept of a
softmax-weighted local linear ridge regression of the values on `k_i − q_t` (`lazoo.ops.local_linear_attention`).

Unit-norm q and k with a learned per-head scale β (QK-norm, which seed 004 shows makes softmax attention a
proper local constant regressor), no positional encoding (NoPE), optional causal sliding `window`, ridge ρ on
the slope (`ridge`). Quadratic in T like softmax attention; the cache entry is
`{"op": {"k", "v", "mask"}, "conv": None}`, a KV cache (the last `window − 1` positions with a window).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import ops
from .base import init_qk_scale, unit_norm
from .recurrent import RecurrentMixer


class LocalLinearMixer(RecurrentMixer):
    """o_t = M⁰ of min Σ_i w_i‖v_i − M⁰ − M¹(k_i − q_t)‖² + ρ‖M¹‖², w = softmax_i(β q_t·k_i)."""

    mechanism = "local_linear"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,  # like softmax, the read-out is already a (corrected) average of values
        "ridge": 0.1,  # relative to unit-norm keys and unit total weight; fp32 rounding grows like eps/ρ
        "window": None,
        "chunk_size": 64,
    }

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))

    def _init_lazoo_parameters(self, init):
        init_qk_scale(self, init)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        q, k = unit_norm(q), unit_norm(k)
        return ops.local_linear_attention(q, k, v, scale=self.qk_scale, ridge=o["ridge"], window=o["window"],
                                          chunk_size=o["chunk_size"], **self.op_kwargs(mask, state, want_state))
