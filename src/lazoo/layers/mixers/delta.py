"""DeltaNet, Gated DeltaNet and DeltaProduct mixers (short convolution and L2-normalised q/k by default)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .base import ShortConvProjections, set_parameter
from .recurrent import RecurrentMixer


class DeltaNetMixer(RecurrentMixer):
    """`S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ`, `β_t = sigmoid(w_β·x_t)` per head."""

    mechanism = "delta_net"
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.b_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        beta = torch.sigmoid(self.b_proj(x))
        return ops.delta_rule(q, k, v, beta, **self.op_kwargs(mask, state, want_state, cu_seqlens))


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
        set_parameter(self.A_log, a.to(self.A_log.device, self.A_log.dtype), init)
        set_parameter(self.dt_bias, dt_bias.to(self.dt_bias.device, self.dt_bias.dtype), init)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        beta = torch.sigmoid(self.b_proj(x))
        cdt = torch.promote_types(x.dtype, torch.float32)  # half types in fp32; float64 stays float64
        g = -self.A_log.to(cdt).exp() * F.softplus(self.a_proj(x).to(cdt) + self.dt_bias.to(cdt))
        return ops.gated_delta_rule(q, k, v, g.to(q.dtype), beta,
                                    **self.op_kwargs(mask, state, want_state, cu_seqlens))


class DeltaProductMixer(RecurrentMixer):
    """DeltaProduct (seed 001): `num_householder` delta-rule (Householder) steps per token.

    Each step has its own key, value and β (`S_t = α_t S_{t−1} Π_j (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) + …`);
    short convolution, L2-normalised keys, per-head RMSNorm and SiLU output gate; an optional Mamba-2 style
    forget gate (`use_forget_gate`); `allow_neg_eigval` doubles β (Householder eigenvalues in (−1, 1))."""

    mechanism = "delta_product"
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True, "output_gate": True, "num_householder": 2,
                "use_forget_gate": False, "allow_neg_eigval": False}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        n = self.check_positive_int("num_householder")
        d = config.hidden_size
        self.k_proj = nn.Linear(d, n * d, bias=False)  # one key and one value per Householder step
        self.v_proj = nn.Linear(d, n * d, bias=False)
        if self.short_conv is not None:
            self.short_conv = ShortConvProjections({"q": d, "k": n * d, "v": n * d}, options["conv_size"])
        self.b_proj = nn.Linear(d, self.num_heads * n, bias=True)
        if options["use_forget_gate"]:
            self.a_proj = nn.Linear(d, self.num_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(self.num_heads))
            self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
            self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        if self.options["use_forget_gate"]:
            GatedDeltaNetMixer._init_lazoo_parameters(self, init)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        B, T, H, _ = q.shape
        n = self.options["num_householder"]
        k = k.view(B, T, H, n, -1)
        v = v.view(B, T, H, n, -1)
        beta = torch.sigmoid(self.b_proj(x)).view(B, T, H, n)
        if self.options["allow_neg_eigval"]:  # β in (0, 2): Householder eigenvalues 1 − β in (−1, 1)
            beta = 2 * beta
        g = None
        if self.options["use_forget_gate"]:
            cdt = torch.promote_types(x.dtype, torch.float32)
            g = -self.A_log.to(cdt).exp() * F.softplus(self.a_proj(x).to(cdt) + self.dt_bias.to(cdt))
            g = g.to(q.dtype)
        return ops.delta_product(q, k, v, beta, g=g, **self.op_kwargs(mask, state, want_state))


register(Mechanism(
    name="delta_net", mixer=DeltaNetMixer, op="delta_rule", title="DeltaNet",
    equation="S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, β_t = σ(w_β·x_t); o_t = S_t q_t",
    source="Schlag et al. 2021; Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.delta",),
))

register(Mechanism(
    name="gated_delta_net", mixer=GatedDeltaNetMixer, op="gated_delta_rule", title="Gated DeltaNet",
    equation="S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ; o_t = S_t q_t",
    source="Yang, Kautz, Hatamizadeh 2024, Gated Delta Networks",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.delta",),
))

register(Mechanism(
    name="delta_product", mixer=DeltaProductMixer, op="delta_product", title="DeltaProduct",
    equation=(
        "S_t = S_{t−1} Π_j (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) + Σ_j β_{t,j} v_{t,j} k_{t,j}ᵀ (n_h Householder steps per "
        "token); o_t = S_t q_t"
    ),
    source="Siems et al. 2025, DeltaProduct", state='{"op": S [B, H, dv, dk], "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"), kernels=("lazoo.kernels.delta",),
))
