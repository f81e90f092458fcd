"""DeltaNet, Gated DeltaNet and DeltaProduct mixers (short convolution and L2-normalised q/k by default)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...ops.backend import triton_missing
from ...registry import Mechanism, register
from ..projections import project_together
from ._fused_decode import FUSED_DECODE_DEFAULT, delta_step_layout, delta_step_state, fused_decode_runs
from .base import ShortConvProjections, set_parameter
from .recurrent import RECURRENT_OPTION_DOCS, RecurrentMixer

QK_NORMS = ("l2", "sum")


def sum_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / max(Σ|x|, eps)` over the last dim (DeltaNet's `qk_norm="sum"`)."""
    return x / x.abs().sum(-1, keepdim=True).clamp_min(eps)


def mamba2_log_decay(module: nn.Module, x: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
    """`−exp(A_log) · softplus(a + dt_bias)`, a = `a_proj(x)` unless given, per head, in fp32 for half types (float64
    stays)."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    a = module.a_proj(x) if a is None else a
    return -module.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + module.dt_bias.to(cdt))


def gates_kernel_runs(a: torch.Tensor, b: torch.Tensor | None, A_log: torch.Tensor, dt_bias: torch.Tensor) -> bool:
    """Whether `lazoo.kernels.gates` computes a Gated DeltaNet layer's g and β: CUDA tensors, Triton present, not
    while torch.compile traces (it fuses the PyTorch form itself), inputs the kernel takes."""
    if not a.is_cuda or torch.compiler.is_compiling() or triton_missing():
        return False
    try:
        from ...kernels.gates import check_supported  # defines the kernels: only where they can run
    except ImportError:  # an exported model folder: no kernels there
        return False
    return check_supported(a, b, A_log, dt_bias) is None


class DeltaNetMixer(RecurrentMixer):
    """`S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ`, `β_t = sigmoid(w_β·x_t)` per head.

    Options: `use_beta` (False: β = 1, no `b_proj`), `beta_bias` (`b_proj` has a bias), `allow_neg_eigval`
    (β doubled, in (0, 2)), `qk_norm` ("l2": q/k divided by sqrt(|x|² + 1e-6) in the op; "sum": by
    max(Σ|x|, 1e-6) before it), and the head layout of `RecurrentMixer`."""

    mechanism = "delta_net"
    head_layout = True
    grouped_values = True  # the delta-rule ops read m value heads per query/key head in place
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True, "use_beta": True, "beta_bias": True,
                "allow_neg_eigval": False, "qk_norm": "l2"}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        if options["qk_norm"] not in QK_NORMS:
            raise ValueError(f"{self.mechanism}: qk_norm must be one of {QK_NORMS}, got {options['qk_norm']!r}")
        self.b_proj = (nn.Linear(config.hidden_size, self.num_state_heads, bias=options["beta_bias"])
                       if options["use_beta"] else None)
        self._fused_step_options = self.fused_step_computes_options()

    def beta(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """β `[B, T, H]`: sigmoid(b) with b = `b_proj(x)` unless given (ones without `use_beta`), doubled with
        `allow_neg_eigval`."""
        if self.b_proj is None:
            beta = x.new_ones(*x.shape[:2], self.num_state_heads)
        else:
            beta = torch.sigmoid(self.b_proj(x) if b is None else b)
        return 2 * beta if self.options["allow_neg_eigval"] else beta

    def normalized_qk(self, q, k) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(q, k, whether the op still L2-normalises them)."""
        if self.options["qk_norm"] == "sum":
            return sum_norm(q), sum_norm(k), False
        return q, k, True

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        q, k, l2 = self.normalized_qk(q, k)
        return ops.delta_rule(q, k, v, self.beta(x), use_qk_l2norm=l2,
                              **self.op_kwargs(mask, state, want_state, cu_seqlens))

    #: whether a decode step runs as one kernel (`lazoo.kernels.delta_step`): None where the op would run its Triton
    #: kernels (CUDA by default); True wherever that kernel can run (the CPU under the interpreter, float64 there
    #: too); False never (also the default with LAZOO_FUSED_DECODE=0 at import: benchmarks compare the unfused step)
    fused_decode: ClassVar[bool | None] = FUSED_DECODE_DEFAULT

    def fused_step_computes_options(self) -> bool:
        """Whether the one-kernel step computes this layer's options: SiLU short convolutions on q, k and v,
        L2-normalised q and k with their own heads (value heads a multiple of them), head dims within the kernel's
        limit. (Known at construction: `_fused_step_options`; a cached_property would lock, which torch.compile
        cannot trace on Python 3.11.)"""
        return delta_step_layout(self) and self.options["qk_norm"] == "l2"

    def fused_step_applies(self, x):
        return self._fused_step_options and fused_decode_runs(self.fused_decode, "delta_step", x,
                                                              self.options.get("backend"))

    def fused_step(self, x, entry, mask, in_place):
        from ...kernels.delta_step import delta_step  # lazy: importing defines the kernel

        gated = isinstance(self, GatedDeltaNetMixer)
        names = ["q", "k", "v"] + ["b"] * (self.b_proj is not None) + ["a"] * gated + ["g"] * (self.g_proj is not None)
        proj = dict(zip(names, project_together(x, [getattr(self, f"{n}_proj") for n in names], one_launch=True)))
        norm = self.o_norm
        return delta_step(
            proj["q"], proj["k"], proj["v"], *delta_step_state(self, entry, in_place),
            heads=self.num_heads, value_heads=self.num_v_heads, scale=self.head_dim ** -0.5,
            a=proj.get("a"), A_log=self.A_log if gated else None, dt_bias=self.dt_bias if gated else None,
            b=proj.get("b"), neg_eigval=self.options["allow_neg_eigval"],
            norm_weight=None if norm is None else norm.weight,
            norm_eps=None if norm is None else (norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps),
            gate=proj.get("g"), gate_activation=self.options["gate_activation"] if "g" in proj else None,
            mask=mask, in_place=in_place)


class GatedDeltaNetMixer(DeltaNetMixer):
    """Gated DeltaNet: `S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ` with a Mamba-2 style decay
    `log α_t = −exp(A_log) · softplus(w_a·x_t + dt_bias)` (`a_proj` has no bias) and an output gate."""

    mechanism = "gated_delta_net"
    defaults = {**DeltaNetMixer.defaults, "output_gate": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.a_proj = nn.Linear(config.hidden_size, self.num_state_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_state_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_state_heads))
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        # A in [1, 16] and dt in [1e-3, 1e-1] log-uniform, as in Mamba-2 / Gated DeltaNet
        n = self.A_log.numel()
        with torch.no_grad():
            a = torch.empty(n).uniform_(1, 16).log()
            dt = torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
            dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        set_parameter(self.A_log, a.to(self.A_log.device, self.A_log.dtype), init)
        set_parameter(self.dt_bias, dt_bias.to(self.dt_bias.device, self.dt_bias.dtype), init)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        q, k, l2 = self.normalized_qk(q, k)
        g, beta = self.gates(x)
        # g = −exp(·)·softplus(·) <= 0 by construction: no g <= 0 check, whose read-back would hold the host
        # back each layer until the GPU caught up
        return ops.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=l2, check_g=False,
                                    **self.op_kwargs(mask, state, want_state, cu_seqlens))

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g fp32, β) `[B, T, H]`: in one Triton launch a direction on CUDA (`lazoo.kernels.gates`), else in PyTorch
        (`mamba2_log_decay`, `beta`); the same formulas."""
        a = self.a_proj(x)
        b = None if self.b_proj is None else self.b_proj(x)
        if gates_kernel_runs(a, b, self.A_log, self.dt_bias):
            from ...kernels.gates import gated_delta_gates

            g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias, neg_eigval=self.options["allow_neg_eigval"])
            if beta is None:  # no b_proj: β = 1 (2 with allow_neg_eigval), as `beta`
                beta = self.beta(x)
            return g, beta
        return mamba2_log_decay(self, x, a), self.beta(x, b)


class DeltaProductMixer(RecurrentMixer):
    """DeltaProduct (Siems et al. 2025): `num_householder` delta-rule (Householder) steps per token.

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
            self.short_conv = ShortConvProjections({"q": d, "k": n * d, "v": n * d}, options["conv_size"],
                                                   bias=options["conv_bias"])
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
            g = mamba2_log_decay(self, x).to(q.dtype)
        return ops.delta_product(q, k, v, beta, g=g, **self.op_kwargs(mask, state, want_state))


#: the kernel modules the (gated) delta rule ops reach on the triton backend
#: (the TTT and VLA mixers reach them too, through the delta rule's op)
DELTA_KERNELS = ("lazoo.kernels.delta", "lazoo.kernels.delta_chunk_bwd", "lazoo.kernels.delta_fused",
                 "lazoo.kernels.delta_gluon", "lazoo.kernels.delta_solve", "lazoo.kernels.delta_split")
DELTA_OPTION_DOCS = {
    **RECURRENT_OPTION_DOCS,
    "use_beta": "a learned write strength β = sigmoid(b_proj(x)) per head (False: β = 1, no b_proj)",
    "beta_bias": "b_proj has a bias",
    "allow_neg_eigval": "β is doubled, in (0, 2): the transition I − β k kᵀ may have a negative eigenvalue",
    "qk_norm": "'l2': q and k divided by sqrt(|x|² + 1e-6); 'sum': by max(Σ|x|, 1e-6)",
}

register(Mechanism(
    name="delta_net", mixer=DeltaNetMixer, op="delta_rule", title="DeltaNet",
    equation="S_t = S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, β_t = σ(w_β·x_t); o_t = S_t q_t",
    source="Schlag et al. 2021; Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=DELTA_KERNELS, option_docs=DELTA_OPTION_DOCS,
))

register(Mechanism(
    name="gated_delta_net", mixer=GatedDeltaNetMixer, op="gated_delta_rule", title="Gated DeltaNet",
    equation="S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ; o_t = S_t q_t",
    source="Yang, Kautz, Hatamizadeh 2025, Gated Delta Networks: Improving Mamba2 with Delta Rule",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=DELTA_KERNELS, option_docs=DELTA_OPTION_DOCS,
))

register(Mechanism(
    name="delta_product", mixer=DeltaProductMixer, op="delta_product", title="DeltaProduct",
    equation=(
        "S_t = S_{t−1} Π_j (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) + Σ_j β_{t,j} v_{t,j} k_{t,j}ᵀ (n_h Householder steps per "
        "token); o_t = S_t q_t"
    ),
    source="Siems et al. 2025, DeltaProduct: Improving State-Tracking in Linear RNNs via Householder Products",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"), kernels=DELTA_KERNELS,
))
