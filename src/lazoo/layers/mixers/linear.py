"""Linear attention (feature map, normalised or with an output norm), gated linear attention
(scalar data-dependent decay per head), Exact Linear Attention (kernel pairs) and GLA (decay per key dim)."""

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

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        return ops.linear_attention(
            q, k, v, feature_map=self.options["feature_map"], normalize=self.options["normalize"],
            **self.op_kwargs(mask, state, want_state, cu_seqlens),
        )


class GatedLinearAttentionMixer(RecurrentMixer):
    """`S_t = a_t S_{t−1} + v_t k_tᵀ` with `log a_t = logsigmoid(w·x_t) / gate_logit_normalizer` per head."""

    mechanism = "gated_linear"
    defaults = {**RecurrentMixer.defaults, "gate_logit_normalizer": 16.0}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.gk_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        g = F.logsigmoid(self.gk_proj(x)) / self.options["gate_logit_normalizer"]
        return ops.gated_linear_attention(q, k, v, g, **self.op_kwargs(mask, state, want_state, cu_seqlens))


class ELAMixer(RecurrentMixer):
    """Exact Linear Attention (seed 003): `Σ_s k(q_t,k_s) v_s / Σ_s k(q_t,k_s)`, s ≤ t, in linear form.

    The kernel is exactly decomposable, `k(a, b) = φ(a)·ψ(b)` (`kernel`: hadamard_exp, sum_sq_euclid,
    sub_sq_euclid, magnitude_direction). q/k are projected to the head dim; the op expands them to the
    kernel's feature dim F (D, D + 2 or D + 1): the state is `S [B, H, dv, F]`, `C [B, H, F]` (+ the
    running key maximum `m [B, H, D]` for hadamard_exp)."""

    mechanism = "ela"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,  # the kernel-weighted average is already normalised
        "kernel": "hadamard_exp",
        "eps": 1e-6,
    }

    def __init__(self, config, layer_idx, options):
        if options["kernel"] not in ops.ELA_KERNELS:
            raise ValueError(f"ela: unknown kernel {options['kernel']!r}; "
                             f"valid kernels are {', '.join(ops.ELA_KERNELS)}")
        super().__init__(config, layer_idx, options)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        return ops.ela(q, k, v, kernel=self.options["kernel"], eps=self.options["eps"],
                       **self.op_kwargs(mask, state, want_state))


class GLAMixer(RecurrentMixer):
    """Gated Linear Attention (GLA): a decay per key dim, `S_t = S_{t−1} diag(a_t) + v_t k_tᵀ`.

    `log a_t = logsigmoid(W_g x_t) / gate_logit_normalizer` with a low-rank gate projection
    (hidden → `gate_low_rank_dim` → hidden), then a per-head RMSNorm and a SiLU output gate."""

    mechanism = "gla"
    defaults = {**RecurrentMixer.defaults, "output_gate": True, "gate_logit_normalizer": 16.0,
                "gate_low_rank_dim": 16}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        d, r = config.hidden_size, options["gate_low_rank_dim"]
        self.gk_proj = nn.Sequential(nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=True))

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        g = F.logsigmoid(self.split_heads(self.gk_proj(x))) / self.options["gate_logit_normalizer"]
        return ops.gla(q, k, v, g.to(q.dtype), **self.op_kwargs(mask, state, want_state, cu_seqlens))
