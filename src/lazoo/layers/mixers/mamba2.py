"""Mamba-2 ("Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space
Duality", Dao and Gu, 2024): the layer transformers' `Mamba2Mixer` computes, on `lazoo.ops.mamba2`.

    [z, x, B, C, dt] = in_proj(h)                      (widths H·P, H·P, G·N, G·N, H, in that order)
    [x, B, C] = silu(conv1d([x, B, C]))                 (depthwise causal, `conv_kernel` taps, with a bias)
    dt = softplus(dt + dt_bias),  A = −exp(A_log)          (at least `dt_clamp_min`, where set)
    y = SSD(x, dt, A, B, C) + D·x                       (lazoo.ops.mamba2)
    out = out_proj(RMSNorm_groups(y · silu(z)))         (the gate first, then an RMSNorm over each of G groups)

The parameter names are transformers' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`), so a
converted checkpoint keeps them. The cache entry is `{"op": S [B, H, P, N], "conv": the last conv_kernel − 1
inputs of the convolution [B, conv_kernel − 1, H·P + 2·G·N]}`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...kernels.limits import MAMBA2_STEP_MAX_STATE_SIZE
from ...registry import Mechanism, register
from ..short_conv import ShortConvolution
from ._fused_decode import FUSED_DECODE_DEFAULT, fused_decode_runs, log_unfused_once
from .base import TokenMixer, set_parameter


class GroupedGatedRMSNorm(nn.Module):
    """`w · RMSNorm_g(x · silu(z))`: the gate first, then an RMSNorm over each group of `group_size` channels
    (Mamba-2's norm with norm_before_gate=False; transformers' `MambaRMSNormGated`). Computed in float32 for half
    types (float64 stays), returned in x's dtype."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        h = (x.to(cdt) * F.silu(gate.to(cdt))).unflatten(-1, (-1, self.group_size))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(cdt) * h.flatten(-2)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}"


class Mamba2Mixer(TokenMixer):
    """The Mamba-2 layer (module docstring). Heads: `num_heads` (None: the config's `num_attention_heads`) of
    `head_dim` channels (None: 2·hidden_size / num_heads, transformers' expand = 2); B and C in `n_groups` groups of
    `state_size`, head h reading group h // (num_heads / n_groups)."""

    mechanism = "mamba2"
    packing = "native"
    optional_int_options = ("num_heads", "head_dim")
    defaults = {"num_heads": None, "head_dim": None, "state_size": 128, "n_groups": 1, "conv_kernel": 4,
                "use_conv_bias": True, "use_bias": False, "norm_eps": 1e-5, "chunk_size": 64,
                "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
                "A_init_min": 1.0, "A_init_max": 16.0, "dt_clamp_min": 0.0}

    def __init__(self, config, layer_idx, options):
        self.check_options({k: options[k] for k in self.optional_int_options})
        heads = options["num_heads"] or config.num_attention_heads
        head_dim = options["head_dim"]
        if head_dim is None:
            if (2 * config.hidden_size) % heads:
                raise ValueError(f"mamba2: 2·hidden_size = {2 * config.hidden_size} must be divisible by the {heads} "
                                 "heads (num_heads, or num_attention_heads), or set the option head_dim")
            head_dim = 2 * config.hidden_size // heads
        super().__init__(config, layer_idx, options, num_heads=heads, head_dim=head_dim)
        groups, state = self.check_positive_int("n_groups"), self.check_positive_int("state_size")
        kernel = self.check_positive_int("conv_kernel")
        self.check_positive_int("chunk_size")
        if heads % groups:
            raise ValueError(f"mamba2: n_groups = {groups} must divide the {heads} heads (num_heads)")
        self._check_init_ranges(options)
        self.num_groups, self.state_size = groups, state
        self.inner_size = heads * head_dim
        self.conv_dim = self.inner_size + 2 * groups * state
        d = config.hidden_size
        self.in_proj = nn.Linear(d, self.inner_size + self.conv_dim + heads, bias=options["use_bias"])
        self.conv1d = ShortConvolution(self.conv_dim, kernel, "silu", bias=options["use_conv_bias"])
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GroupedGatedRMSNorm(self.inner_size, self.inner_size // groups, eps=options["norm_eps"])
        self.out_proj = nn.Linear(self.inner_size, d, bias=options["use_bias"])
        self._init_lazoo_parameters(None)
        self._fused_step_unsupported = self.fused_step_unsupported()

    @staticmethod
    def _check_init_ranges(options) -> None:
        lo, hi, floor = options["time_step_min"], options["time_step_max"], options["time_step_floor"]
        if not 0 < lo <= hi:
            raise ValueError(f"mamba2: time_step_min and time_step_max must satisfy 0 < min <= max, got {lo!r} and "
                             f"{hi!r}")
        if not floor >= 0:
            raise ValueError(f"mamba2: time_step_floor must be >= 0, got {floor!r}")
        if not 0 <= options["dt_clamp_min"] < math.inf:
            raise ValueError(f"mamba2: dt_clamp_min must be a finite number >= 0, got {options['dt_clamp_min']!r}")
        if not 0 < options["A_init_min"] <= options["A_init_max"]:
            raise ValueError(f"mamba2: A_init_min and A_init_max must satisfy 0 < min <= max, got "
                             f"{options['A_init_min']!r} and {options['A_init_max']!r}")

    def _init_lazoo_parameters(self, init):
        # as Mamba-2: A uniform in [A_init_min, A_init_max], dt log-uniform in [time_step_min, time_step_max]
        # (at least time_step_floor) through the inverse softplus of dt_bias, D = 1, the norm's weight 1
        o, n = self.options, self.A_log.numel()
        with torch.no_grad():
            a = torch.empty(n).uniform_(o["A_init_min"], o["A_init_max"]).log()
            dt = torch.exp(torch.empty(n).uniform_(math.log(o["time_step_min"]), math.log(o["time_step_max"])))
            dt = dt.clamp_min(o["time_step_floor"])
            dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        set_parameter(self.A_log, a.to(self.A_log.device, self.A_log.dtype), init)
        set_parameter(self.dt_bias, dt_bias.to(self.dt_bias.device, self.dt_bias.dtype), init)
        set_parameter(self.D, 1.0, init)
        set_parameter(self.norm.weight, 1.0, init)

    #: whether a decode step runs fused (`lazoo.kernels.mamba2_step`): None where the op would run its Triton kernels
    #: (CUDA by default); True wherever that kernel can run (the CPU under the interpreter, float64 there
    #: too); False never (also the default with LAZOO_FUSED_DECODE=0 at import: benchmarks compare the unfused step)
    fused_decode: ClassVar[bool | None] = FUSED_DECODE_DEFAULT

    def fused_step_unsupported(self) -> str | None:
        """Why the fused decode step cannot compute this layer's options (None: it can). Known at construction."""
        if self.conv1d.kernel_size[0] < 2:
            return f"it takes convolutions of at least 2 taps, got conv_kernel = {self.conv1d.kernel_size[0]}"
        if self.state_size > MAMBA2_STEP_MAX_STATE_SIZE:
            return f"it takes state sizes up to {MAMBA2_STEP_MAX_STATE_SIZE}, got state_size = {self.state_size}"
        return None

    def fused_step_applies(self, x: torch.Tensor) -> bool:
        """Whether `fused_step` runs this decode step: the switch `fused_decode`, no autograd, the kernel's device
        and dtype, the layer's options, and the modules the kernel reads as they were built (an adapter such as
        LoRA on the convolution keeps the unfused step; one on in_proj or out_proj runs as it is)."""
        if not fused_decode_runs(self.fused_decode, "mamba2_step", x, self.options.get("backend")):
            return False
        if self._fused_step_unsupported is not None:
            log_unfused_once("mamba2_step", self._fused_step_unsupported)
            return False
        return type(self.conv1d) is ShortConvolution and type(self.norm) is GroupedGatedRMSNorm

    def fused_step(self, hidden_states, entry, mask, in_place: bool):
        """One decode step from the layer's input to out_proj's input: `(y [B, 1, H·P], new S, new conv state)`;
        `in_place`: the cached tensors are updated where they are (a static cache)."""
        from ...kernels.mamba2_step import mamba2_step  # lazy: importing defines the kernels

        z, xBC, dt = self.in_proj(hidden_states).split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        S, conv = entry["op"], entry["conv"]
        if not in_place:  # new tensors take the result: any layout of the cached ones is read as a copy
            S = S.contiguous()
            if conv.stride(2) != 1 or conv.stride(1) != conv.shape[2]:
                conv = conv.contiguous()
        return mamba2_step(z, xBC, dt, conv, self.conv1d.weight, self.conv1d.bias, S, dt_bias=self.dt_bias,
                           A_log=self.A_log, D=self.D, norm_weight=self.norm.weight, norm_eps=self.norm.eps,
                           groups=self.num_groups, mask=mask, in_place=in_place)

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        if cu_seqlens is not None and (mask is not None or cache is not None):
            raise ValueError("Mamba2Mixer: packed sequences (cu_seqlens) take no mask and no cache")
        batch, T, _ = hidden_states.shape
        entry = self.read_state(cache) or {}
        if cache is not None and T == 1 and entry and self.fused_step_applies(hidden_states):
            y, op_state, conv_state = self.fused_step(hidden_states, entry, mask, in_place=cache.static)
            self.write_state(cache, {"op": op_state, "conv": conv_state})
            return self.out_proj(y)
        backend = self.options.get("backend")
        z, xBC, dt = self.in_proj(hidden_states).split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        # the short-convolution kernel has no bias: a convolution with one runs conv1d whatever the backend (a forced
        # "triton", from the option or LAZOO_BACKEND, then runs the op's kernels and conv1d)
        conv_backend = "chunk" if self.conv1d.bias is not None else backend
        xBC, conv_state = self.conv1d(xBC, mask=mask, state=entry.get("conv"), output_state=cache is not None,
                                      cu_seqlens=cu_seqlens, backend=conv_backend)
        x, B, C = xBC.split([self.inner_size, self.num_groups * self.state_size,
                             self.num_groups * self.state_size], dim=-1)
        cdt = torch.promote_types(hidden_states.dtype, torch.float32)  # the step sizes in float32 (float64 stays)
        dt = F.softplus(dt.to(cdt) + self.dt_bias.to(cdt))
        if self.options["dt_clamp_min"]:  # in every form alike: the prompt's chunks and each decoded token
            dt = dt.clamp_min(self.options["dt_clamp_min"])
        A = -torch.exp(self.A_log.to(cdt))
        groups = (batch, T, self.num_groups, self.state_size)
        y, state = ops.mamba2(x.view(batch, T, self.num_heads, self.head_dim), dt, A, B.view(groups),
                              C.view(groups), self.D, chunk_size=self.options["chunk_size"],
                              initial_state=entry.get("op"), output_final_state=cache is not None, mask=mask,
                              backend=backend, cu_seqlens=cu_seqlens)
        if cache is not None:
            self.write_state(cache, {"op": state, "conv": conv_state})
        return self.out_proj(self.norm(y.reshape(batch, T, self.inner_size), z))


register(Mechanism(
    name="mamba2", mixer=Mamba2Mixer, op="mamba2", title="Mamba-2 (SSD)",
    equation="S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ; y_t = S_t C_t + D x_t; out = W_o RMSNorm(y_t ⊙ silu(z_t))",
    source=("Dao, Gu 2024, Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured "
            "State Space Duality"),
    state='{"op": S [B, H, P, N], "conv": the convolution tail [B, conv_kernel − 1, H·P + 2·G·N]}',
    backends=("recurrent", "chunk", "triton"), kernels=("lazoo.kernels.linear", "lazoo.kernels.ssd_io"),
    option_docs={
        "num_heads": "SSM heads H (None: num_attention_heads)",
        "head_dim": "channels P of each head (None: 2·hidden_size / num_heads, i.e. expand = 2)",
        "state_size": "the state size N of each head (the width of B and C per group)",
        "n_groups": "groups G of B and C (dividing num_heads); head h reads group h // (H / G); also the groups of "
                    "the output RMSNorm",
        "conv_kernel": "taps of the depthwise causal convolution over x, B and C (SiLU after it)",
        "use_conv_bias": "the convolution has a bias",
        "use_bias": "in_proj and out_proj have biases",
        "norm_eps": "epsilon of the gated grouped RMSNorm",
        "chunk_size": "chunk length of the chunked forms (changes no result)",
        "time_step_min": "initialisation: dt = softplus(dt_bias) drawn log-uniform in [time_step_min, time_step_max]",
        "time_step_max": "initialisation: the upper end of dt's range",
        "time_step_floor": "initialisation: dt at least this",
        "A_init_min": "initialisation: A = exp(A_log) drawn uniform in [A_init_min, A_init_max]",
        "A_init_max": "initialisation: the upper end of A's range",
        "dt_clamp_min": "the step sizes clamped from below, dt = max(softplus(dt + dt_bias), dt_clamp_min), in every "
                        "form (0: no clamp; Nemotron-H clamps at its time_step_min)",
    },
    tiny_options={"state_size": 16, "chunk_size": 8},
))
