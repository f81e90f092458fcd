"""Kimi Delta Attention ("Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team, 2025): the KDA
layer as Kimi Linear writes it (transformers' `KimiLinearDeltaAttention`, fla's `KimiDeltaAttention`), on
`lazoo.ops.kda`.

    q, k, v = silu(conv(q_proj(x))), silu(conv(k_proj(x))), silu(conv(v_proj(x)))   (depthwise causal short convs)
    g = −exp(A_log) · softplus(f_proj(x) + dt_bias)        a log decay per value head and key channel; f_proj low-rank
      (with gate_lower_bound b: g = b · sigmoid(exp(A_log) · (f_proj(x) + dt_bias)), in (b, 0), as fla's lower_bound)
    β = sigmoid(b_proj(x))                                  (doubled with allow_neg_eigval)
    o = KDA(l2norm(q), l2norm(k), v, g, β)                 (lazoo.ops.kda; scale 1/√dk)
    out = o_proj(RMSNorm_head(o) · sigmoid(g_proj(x)))      the gated output norm; g_proj low-rank

The low-rank projections are `f_proj` and `g_proj`, each `nn.Sequential(Linear(hidden, r), Linear(r, ...))` with r
= `gate_low_rank_dim` (None: the value head dim), fla's names; `A_log` is one per value head, `dt_bias` one per value
head and key channel. The norm and gate are computed in float32 for half types (as Kimi Linear's gated norm). The
cache entry is `{"op": S [B, H, dv, dk], "conv": the short convolutions' tails}`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from ..projections import project_together
from ._fused_decode import FUSED_DECODE_DEFAULT, delta_step_layout, delta_step_state, fused_decode_runs
from .base import set_parameter
from .recurrent import RECURRENT_OPTION_DOCS, RecurrentMixer


class KimiDeltaAttentionMixer(RecurrentMixer):
    """The KDA layer (module docstring). Head layout options as `RecurrentMixer` (`num_v_heads` > `num_heads`: grouped
    value heads, read in place by the kernels)."""

    mechanism = "kda"
    head_layout = True
    grouped_values = True
    optional_int_options = (*RecurrentMixer.optional_int_options, "gate_low_rank_dim")
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True, "output_gate": True, "gate_activation": "sigmoid",
                "norm_eps": 1e-5, "allow_neg_eigval": False, "gate_low_rank_dim": None, "gate_bias": False,
                "gate_lower_bound": None, "chunk_size": 16}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        if not options["output_gate"] or not options["output_norm"]:
            raise ValueError("kda: the KDA layer always has its gated output norm; output_gate and output_norm must "
                             "stay True")
        self.check_positive_int("chunk_size")
        bound = options["gate_lower_bound"]
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not -math.inf < bound < 0):
            raise ValueError(f"kda: gate_lower_bound must be None or a finite negative number, got {bound!r}")
        d, heads = config.hidden_size, self.num_state_heads
        rank = options["gate_low_rank_dim"] or self.head_v_dim
        self.f_proj = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, heads * self.head_dim, bias=False))
        self.g_proj = nn.Sequential(nn.Linear(d, rank, bias=False),
                                    nn.Linear(rank, self.value_dim, bias=options["gate_bias"]))
        self.b_proj = nn.Linear(d, heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads * self.head_dim))
        self._init_lazoo_parameters(None)
        self._fused_step_options = delta_step_layout(self)

    def _init_lazoo_parameters(self, init):
        # A in [1, 16], dt log-uniform in [1e-3, 1e-1] through the inverse softplus of dt_bias (fla, Kimi Linear)
        with torch.no_grad():
            a = torch.empty(self.A_log.numel()).uniform_(1, 16).log()
            dt = torch.exp(torch.empty(self.dt_bias.numel()).uniform_(math.log(1e-3), math.log(1e-1)))
            dt = dt.clamp_min(1e-4)
            dt_bias = dt + torch.log(-torch.expm1(-dt))
        set_parameter(self.A_log, a.to(self.A_log.device, self.A_log.dtype), init)
        set_parameter(self.dt_bias, dt_bias.to(self.dt_bias.device, self.dt_bias.dtype), init)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g `[B, T, H, dk]` = −exp(A_log) · softplus(f_proj(x) + dt_bias), or with `gate_lower_bound` b
        b · sigmoid(exp(A_log) · (f_proj(x) + dt_bias)); in float32 (float64 stays)."""
        cdt = torch.promote_types(x.dtype, torch.float32)
        f = (self.f_proj(x).to(cdt) + self.dt_bias.to(cdt)).unflatten(-1, (self.num_state_heads, self.head_dim))
        rate = self.A_log.to(cdt).exp()[:, None]
        bound = self.options["gate_lower_bound"]
        if bound is not None:
            return bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))
        if self.options["allow_neg_eigval"]:
            beta = 2 * beta
        return ops.kda(q, k, v, self.log_decay(x), beta, use_qk_l2norm=True, chunk_size=self.options["chunk_size"],
                       **self.op_kwargs(mask, state, want_state, cu_seqlens))

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`RMSNorm_head(o) · sigmoid(g_proj(x))`, heads merged, in float32 for half types."""
        cdt = torch.promote_types(o.dtype, torch.float32)
        w = None if self.o_norm.weight is None else self.o_norm.weight.to(cdt)
        h = F.rms_norm(o.to(cdt), (self.head_v_dim,), w, self.o_norm.eps)
        gate = self.g_proj(x).to(cdt).unflatten(-1, (self.num_state_heads, self.head_v_dim))
        return self.merge_heads(h * torch.sigmoid(gate)).to(o.dtype)


    #: whether a decode step runs as one kernel (`lazoo.kernels.delta_step` with a decay per key channel), as
    #: DeltaNet's switch: None (the default) where the op would run its Triton kernels, True wherever that kernel can
    #: run, False never (`LAZOO_FUSED_DECODE=0` at import).
    fused_decode: ClassVar[bool | None] = FUSED_DECODE_DEFAULT

    def fused_step_applies(self, x):
        return self._fused_step_options and fused_decode_runs(self.fused_decode, "delta_step", x,
                                                              self.options.get("backend"))

    def fused_step(self, x, entry, mask, in_place):
        from ...kernels.delta_step import delta_step  # lazy: importing defines the kernel

        q, k, v, b, f, g = project_together(x, [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_proj[0],
                                                self.g_proj[0]], one_launch=True)
        norm = self.o_norm
        bound = self.options["gate_lower_bound"]
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        return delta_step(
            q, k, v, *delta_step_state(self, entry, in_place),
            heads=self.num_heads, value_heads=self.num_v_heads, scale=self.head_dim ** -0.5, a=self.f_proj[1](f),
            A_log=self.A_log, dt_bias=self.dt_bias, b=b, neg_eigval=self.options["allow_neg_eigval"],
            norm_weight=norm.weight, norm_eps=eps, gate=self.g_proj[1](g), gate_activation="sigmoid", mask=mask,
            in_place=in_place, key_gate="softplus" if bound is None else "bounded", gate_lower_bound=bound,
            round_to_dtype=False)  # the layer keeps β, the norm's output and the gate in fp32

register(Mechanism(
    name="kda", mixer=KimiDeltaAttentionMixer, op="kda", title="Kimi Delta Attention (KDA)",
    equation="S_t = S_{t−1} Diag(α_t)(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, a decay α_t per key channel; o_t = S_t q_t",
    source="Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention Architecture",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.kda",),
    option_docs={
        **RECURRENT_OPTION_DOCS,
        "output_gate": "the gated output norm (always on in KDA)",
        "output_norm": "the per-head RMSNorm of the gated output norm (always on in KDA)",
        "gate_activation": "the output gate's activation (sigmoid, as Kimi Linear)",
        "allow_neg_eigval": "β is doubled, in (0, 2): the transition I − β k kᵀ may have a negative eigenvalue",
        "gate_low_rank_dim": "the rank r of the decay and output-gate projections f_proj and g_proj (hidden -> r -> "
                             "...); None: the value head dim",
        "gate_bias": "the second layer of g_proj has a bias (fla's KimiDeltaAttention; Kimi Linear's has none)",
        "gate_lower_bound": "None, or a negative b: the log decay is b · sigmoid(exp(A_log) · (f_proj(x) + dt_bias)), "
                            "bounded in (b, 0) (fla's lower_bound) instead of −exp(A_log) · softplus(...)",
        "chunk_size": "chunk length of the PyTorch chunk form (changes no result; the Triton kernels use 64)",
    },
    tiny_options={"chunk_size": 8},
))
