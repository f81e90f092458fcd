"""Linear attention (feature map, normalised or with an output norm) and gated linear attention
(scalar data-dependent decay per head)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ... import ops
from .recurrent import RecurrentMixer


class LinearAttentionMixer(RecurrentMixer):
    """`S_t = S_{t−1} + v_t φ(k_t)ᵀ`; normalised read-out `S_t φ(q_t) / φ(q_t)·z_t`, or an RMSNorm instead."""

    mechanism = "linear"
    defaults = {**RecurrentMixer.defaults, "feature_map": "elu1", "normalize": True, "output_norm": None}

    def __init__(self, config, layer_idx, options):
        if options["output_norm"] is None:  # the denominator already normalises; otherwise use a norm
            options = {**options, "output_norm": not options["normalize"]}
        super().__init__(config, layer_idx, options)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        return ops.linear_attention(
            q, k, v, feature_map=self.options["feature_map"], normalize=self.options["normalize"],
            **self.op_kwargs(mask, state, want_state),
        )


class GatedLinearAttentionMixer(RecurrentMixer):
    """`S_t = a_t S_{t−1} + v_t k_tᵀ` with `log a_t = logsigmoid(w·x_t) / gate_logit_normalizer` per head."""

    mechanism = "gated_linear"
    defaults = {**RecurrentMixer.defaults, "gate_logit_normalizer": 16.0}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.gk_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        g = F.logsigmoid(self.gk_proj(x)) / self.options["gate_logit_normalizer"]
        return ops.gated_linear_attention(q, k, v, g, **self.op_kwargs(mask, state, want_state))
