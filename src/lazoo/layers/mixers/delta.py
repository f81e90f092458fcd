"""DeltaNet and Gated DeltaNet mixers (short convolution and L2-normalised q/k by default)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from .recurrent import RecurrentMixer


class DeltaNetMixer(RecurrentMixer):
    """`S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ`, `β_t = sigmoid(w_β·x_t)` per head."""

    mechanism = "delta_net"
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.b_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        beta = torch.sigmoid(self.b_proj(x))
        return ops.delta_rule(q, k, v, beta, **self.op_kwargs(mask, state, want_state))


class GatedDeltaNetMixer(DeltaNetMixer):
    """Gated DeltaNet: `S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ` with a Mamba-2 style decay
    `log α_t = −exp(A_log) · softplus(w_a·x_t + dt_bias)` and a SiLU output gate."""

    mechanism = "gated_delta_net"
    defaults = {**DeltaNetMixer.defaults, "output_gate": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.a_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        # A in [1, 16] and dt in [1e-3, 1e-1] log-uniform, as in Mamba-2 / Gated DeltaNet
        with torch.no_grad():
            a = torch.empty(self.num_heads).uniform_(1, 16).log()
            dt = torch.exp(torch.empty(self.num_heads).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
            dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        copy = init.copy_ if init is not None else (lambda p, v: p.data.copy_(v))
        copy(self.A_log, a.to(self.A_log.device, self.A_log.dtype))
        copy(self.dt_bias, dt_bias.to(self.dt_bias.device, self.dt_bias.dtype))

    def mix(self, q, k, v, x, *, mask, state, want_state):
        beta = torch.sigmoid(self.b_proj(x))
        cdt = torch.promote_types(x.dtype, torch.float32)  # half types in fp32; float64 stays float64
        g = -self.A_log.to(cdt).exp() * F.softplus(self.a_proj(x).to(cdt) + self.dt_bias.to(cdt))
        return ops.gated_delta_rule(q, k, v, g.to(q.dtype), beta, **self.op_kwargs(mask, state, want_state))
