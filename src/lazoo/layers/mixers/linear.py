"""Linear attention (feature map, normalised or with an output norm), gated linear attention
(scalar data-dependent decay per head), Exact Linear Attention (kernel pairs) and GLA (decay per key dim)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .recurrent import ACTIVATIONS, RECURRENT_OPTION_DOCS, RecurrentMixer

#: the `qk_prenorm` option's documentation (linear attention and ELA; VLA has its own, on by default there)
QK_PRENORM_DOC = "√d·x/‖x‖ per head on q and k before the feature map (VLA's default; measured on MQAR in docs/vla.md)"


class LinearAttentionMixer(RecurrentMixer):
    """`S_t = S_{t−1} + v_t φ(k_t)ᵀ`; normalised read-out `S_t φ(q_t) / φ(q_t)·z_t`, or an RMSNorm instead."""

    mechanism = "linear"
    head_layout = True
    defaults = {**RecurrentMixer.defaults, "feature_map": "elu1", "normalize": True, "output_norm": None,
                "qk_prenorm": False}

    def __init__(self, config, layer_idx, options):
        if options["output_norm"] is None:  # the denominator already normalises; otherwise use a norm
            options = {**options, "output_norm": not options["normalize"]}
        super().__init__(config, layer_idx, options)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        q, k = self.apply_qk_prenorm(q, k)
        return ops.linear_attention(
            q, k, v, feature_map=self.options["feature_map"], normalize=self.options["normalize"],
            **self.op_kwargs(mask, state, want_state, cu_seqlens),
        )


class GatedLinearAttentionMixer(RecurrentMixer):
    """`S_t = a_t S_{t−1} + v_t k_tᵀ` with `log a_t = logsigmoid(w·x_t) / gate_logit_normalizer` per head."""

    mechanism = "gated_linear"
    head_layout = True
    defaults = {**RecurrentMixer.defaults, "gate_logit_normalizer": 16.0}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.gk_proj = nn.Linear(config.hidden_size, self.num_state_heads, bias=True)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        g = F.logsigmoid(self.gk_proj(x)) / self.options["gate_logit_normalizer"]
        return ops.gated_linear_attention(q, k, v, g, **self.op_kwargs(mask, state, want_state, cu_seqlens))


class ELAMixer(RecurrentMixer):
    """Exact Linear Attention (the ELA paper): `Σ_s k(q_t,k_s) v_s / Σ_s k(q_t,k_s)`, s ≤ t, in linear form.

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
        "qk_prenorm": False,
    }

    def __init__(self, config, layer_idx, options):
        if options["kernel"] not in ops.ELA_KERNELS:
            raise ValueError(f"ela: unknown kernel {options['kernel']!r}; "
                             f"valid kernels are {', '.join(ops.ELA_KERNELS)}")
        super().__init__(config, layer_idx, options)

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        q, k = self.apply_qk_prenorm(q, k)
        return ops.ela(q, k, v, kernel=self.options["kernel"], eps=self.options["eps"],
                       **self.op_kwargs(mask, state, want_state, cu_seqlens))


class BidirectionalELAMixer(ELAMixer):
    """ELA's bidirectional form (`ops.ela(causal=False)`), for encoders: every real token attends to every real
    token of its sequence (pads excluded through the mask). Same parameters as `ELAMixer`; no state (an encoder
    reads whole sequences). The optional short convolution (`use_short_conv`) stays causal."""

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        q, k = self.apply_qk_prenorm(q, k)
        o, _ = ops.ela(q, k, v, kernel=self.options["kernel"], eps=self.options["eps"], causal=False,
                       mask=mask, backend=self.options.get("backend"), cu_seqlens=cu_seqlens)
        return o, None


class GLAMixer(RecurrentMixer):
    """Gated Linear Attention (GLA): a decay per key dim, `S_t = S_{t−1} diag(a_t) + v_t k_tᵀ`.

    `log a_t = max(logsigmoid(W_g x_t) / gate_logit_normalizer, clamp_min)` with a low-rank gate projection
    (hidden → `gate_low_rank_dim` → the key heads' dims; repeated with the keys under `num_kv_heads`), an
    optional `feature_map` on q and k, then a per-head RMSNorm and an output gate."""

    mechanism = "gla"
    head_layout = True
    defaults = {**RecurrentMixer.defaults, "output_gate": True, "gate_logit_normalizer": 16.0,
                "gate_low_rank_dim": 16, "clamp_min": None, "feature_map": None}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        if options["feature_map"] is not None and options["feature_map"] not in ACTIVATIONS:
            raise ValueError(f"gla: feature_map must be None or one of {sorted(ACTIVATIONS)}, "
                             f"got {options['feature_map']!r}")
        clamp_min = options["clamp_min"]
        if clamp_min is not None and (isinstance(clamp_min, bool) or not isinstance(clamp_min, (int, float))
                                      or not clamp_min <= 0):
            raise ValueError(f"gla: clamp_min must be None or a number <= 0 (a floor on the log decay), "
                             f"got {clamp_min!r}")
        d, r = config.hidden_size, self.check_positive_int("gate_low_rank_dim")
        self.gk_proj = nn.Sequential(nn.Linear(d, r, bias=False), nn.Linear(r, self.k_proj.out_features, bias=True))

    def mix(self, q, k, v, x, *, mask, state, want_state, cu_seqlens=None):
        o = self.options
        g = F.logsigmoid(self.repeat_heads(self.gk_proj(x), self.num_kv_heads)) / o["gate_logit_normalizer"]
        if o["clamp_min"] is not None:
            g = torch.clamp_min(g, o["clamp_min"])
        feature_map = ACTIVATIONS[o["feature_map"]] if o["feature_map"] is not None else None
        if feature_map is not None:
            q, k = feature_map(q), feature_map(k)
        return ops.gla(q, k, v, g.to(q.dtype), **self.op_kwargs(mask, state, want_state, cu_seqlens))


register(Mechanism(
    name="linear", mixer=LinearAttentionMixer, op="linear_attention", title="Linear attention",
    equation="S_t = S_{t−1} + v_t φ(k_t)ᵀ, z_t = z_{t−1} + φ(k_t); o_t = S_t φ(q_t) / φ(q_t)·z_t",
    source="Katharopoulos et al. 2020, Transformers are RNNs",
    state='{"op": {"S" [B, H, dv, dk], "z" [B, H, dk]} (or S alone without normalize), "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"), kernels=("lazoo.kernels.linear", "lazoo.kernels.normalized"),
    option_docs={**RECURRENT_OPTION_DOCS, "qk_prenorm": QK_PRENORM_DOC},
))

register(Mechanism(
    name="gated_linear", mixer=GatedLinearAttentionMixer, op="gated_linear_attention",
    title="Gated linear attention (scalar decay)",
    equation="S_t = a_t S_{t−1} + v_t k_tᵀ, a_t ∈ (0, 1) per head; o_t = S_t q_t",
    source="Sun et al. 2023, Retentive Network; Dao, Gu 2024, Transformers are SSMs (Mamba-2)",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.linear",), option_docs=RECURRENT_OPTION_DOCS,
))

register(Mechanism(
    name="ela", mixer=ELAMixer, bidirectional_mixer=BidirectionalELAMixer, op="ela", title="Exact Linear Attention",
    equation="S_t = S_{t−1} + v_t ψ(k_t)ᵀ, C_t = C_{t−1} + ψ(k_t); o_t = S_t φ(q_t) / φ(q_t)·C_t",
    source="Ou 2026, Exact Linear Attention, arXiv:2605.18848",
    state='{"op": {"S" [B, H, dv, F], "C" [B, H, F] (+ "m" [B, H, D] for hadamard_exp)}, "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.ela_features", "lazoo.kernels.gla", "lazoo.kernels.linear", "lazoo.kernels.normalized"),
    option_docs={**RECURRENT_OPTION_DOCS, "qk_prenorm": QK_PRENORM_DOC}, class_prefix="LazooELA",
))

register(Mechanism(
    name="gla", mixer=GLAMixer, op="gla", title="Gated Linear Attention (GLA)",
    equation="S_t = S_{t−1} diag(a_t) + v_t k_tᵀ, a_t ∈ (0, 1)^dk; o_t = S_t q_t",
    source="Yang et al. 2023, Gated Linear Attention Transformers with Hardware-Efficient Training",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}', backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.gla", "lazoo.kernels.linear"), class_prefix="LazooGLA",
    option_docs={
        **RECURRENT_OPTION_DOCS,
        "gate_logit_normalizer": "the log decay logsigmoid(gk_proj(x)) is divided by it",
        "gate_low_rank_dim": "inner width of the low-rank decay projection gk_proj",
        "clamp_min": "None, or a floor (<= 0) on the log decay",
        "feature_map": "None, or an activation applied to q and k after the short convolution, one of "
                       + ", ".join(sorted(k for k in ACTIVATIONS)),
    },
))
