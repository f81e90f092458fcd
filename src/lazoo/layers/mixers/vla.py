"""Variational Linear Attention mixer (the VLA paper): q, k, v and the penalty direction u = W_u k_raw per head.

The op applies the feature maps and normalisations of Algorithm 1 itself. By default this module also scales q and k
to length √d per head before the op and normalises the read-out (RMSNorm): Algorithm 1 as written does not learn
associative recall, and with these two it does (docs/vla.md, "MQAR").
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .base import set_parameter
from .delta import DELTA_KERNELS
from .recurrent import RecurrentMixer, check_option_choice

#: the lengths of the penalty directions û (the option `penalty_norm`)
PENALTY_NORMS = ("unit", "algorithm1")


class VLAMixer(RecurrentMixer):
    """Variational Linear Attention: Sherman–Morrison penalty geometry A_t, write direction α̂_t = A_t k̂ / ‖A_t k̂‖."""

    mechanism = "vla"
    defaults = {
        **RecurrentMixer.defaults,
        # an RMSNorm on the read-out and q, k normalised per head (below): the default because VLA learns recall
        # with them and does not without (MQAR, the VLA paper's protocol: docs/vla.md); False, False = Algorithm 1
        "output_norm": True,
        "lambda0": 0.1,
        "refresh_period": 20,
        "refresh_eta": 1e-3,
        "eps": 1e-4,
        "triton_scan": "token",  # the Triton backend's A-scan kernel: "token" or "chunk" (lazoo.ops.vla)
        # per head √d·q/‖q‖ and √d·k/‖k‖ before the op's ELU+1 (u still from the raw k): small raw keys sit in
        # ELU+1's linear regime, where every key's features point the same way
        "qk_prenorm": True,
        # "identity": signed keys can be orthogonal, whereas ELU+1 features are all positive and so always overlap
        "feature_map": "elu1",
        # "unit_query": q read with the keys' normalisation; z·φ(q) > 0, which the z division needs, fails for signed φ
        "readout": "normalized",
        # False: u is zeroed, so A stays A₀ ∝ I and α̂ = k̂ (the delta rule with β = 1): the ablation of what A adds
        "precision_update": True,
        # the penalty directions' length: "unit" as the VLA paper's eq. (8) writes them (a key adds 1 to A⁻¹ against
        # the prior λ₀), or "algorithm1": / √d as its Algorithm 1 does (a key adds 1/d, so λ₀ = 0.1 outweighs the
        # first few keys and A steers a repeated filler's writes into the stored keys: recall fails at T = 512)
        "penalty_norm": "unit",
    }
    # folders saved before format 2 ran Algorithm 1 as written, those before format 3 its u / √d: they keep doing so
    defaults_before = {2: {"output_norm": False, "qk_prenorm": False}, 3: {"penalty_norm": "algorithm1"}}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        check_option_choice(self.mechanism, "penalty_norm", options["penalty_norm"], PENALTY_NORMS)
        # W_u: a learned dk×dk map per head, initialised to the identity (u starts along k_raw)
        self.u_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        eye = torch.eye(self.head_dim, dtype=self.u_weight.dtype, device=self.u_weight.device)
        set_parameter(self.u_weight, eye.expand_as(self.u_weight), init)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        u = torch.einsum("bthd,hed->bthe", k, self.u_weight)
        if not o["precision_update"]:
            u = torch.zeros_like(u)
        q, k = self.apply_qk_prenorm(q, k)  # after u: u comes from the raw k
        # the op runs Algorithm 1 (û = u / ‖u‖ / √d); unit û is the same recurrence with λ₀ / d and η · d (A scales by
        # d, which α̂ = A k̂ / ‖A k̂‖ and δ do not see)
        scale = self.head_dim if o["penalty_norm"] == "unit" else 1
        return ops.vla(
            q, k, v, u, lambda0=o["lambda0"] / scale, refresh_period=o["refresh_period"],
            refresh_eta=o["refresh_eta"] * scale,
            eps=o["eps"], triton_scan=o["triton_scan"], feature_map=o["feature_map"], readout=o["readout"],
            **self.op_kwargs(mask, state, want_state),
        )


register(Mechanism(
    name="vla", mixer=VLAMixer, op="vla", title="Variational Linear Attention",
    equation=(
        "S_t = S_{t−1} + (v_t − S_{t−1} k̂_t) α̂_tᵀ, α̂_t = A_t k̂_t / ‖A_t k̂_t‖ (A_t: Sherman–Morrison penalty "
        "geometry, refreshed every P steps); o_t = S_t q_t / max(z_t·q_t, ε); by default q, k scaled to √d per "
        "head before ELU+1 and an RMSNorm on o_t"
    ),
    source="Pandey, Singh 2026, Variational Linear Attention: Stable Associative Memory for Long-Context Transformers",
    state='{"op": {"S" [B, H, dv, dk], "A" [B, H, dk, dk], "z" [B, H, dk], "t" [B]}, "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"),
    kernels=(*DELTA_KERNELS, "lazoo.kernels.vla.token", "lazoo.kernels.vla.split", "lazoo.kernels.vla.chunk",
             "lazoo.kernels.vla.features"),
    option_docs={
        "lambda0": "λ₀, A's initial scale (A_0 = λ₀⁻¹ I)",
        "refresh_period": "P: A is refreshed towards I every P real tokens",
        "refresh_eta": "η: the refresh's step towards I",
        "eps": "ε: the clamps of the normalisations",
        "triton_scan": "the Triton backend's A scan: 'token' (default) or 'chunk' (exact, not faster yet)",
        "qk_prenorm": "√d·x/‖x‖ per head on q and k before ELU+1 (u from the raw k); off = Algorithm 1 as written",
        "feature_map": "φ of k and q in the op: 'elu1' (elu + 1, Algorithm 1) or 'identity' (signed keys, k̂ = k/‖k‖)",
        "readout": ("'normalized' (S φ(q) / max(z·φ(q), ε), Algorithm 1) or 'unit_query' (S φ(q)/‖φ(q)‖, no z); "
                    "feature_map='identity' needs 'unit_query'"),
        "precision_update": "False: A stays A₀ (no Sherman–Morrison updates; α̂ = k̂): an ablation, not a model",
        "penalty_norm": ("'unit' (u / ‖u‖, the paper's eq. (8)) or 'algorithm1' (u / ‖u‖ / √d, its Algorithm 1): "
                         "how much one key counts in A against λ₀"),
    },
    tiny_options={"refresh_period": 7, "refresh_eta": 0.3}, class_prefix="LazooVLA",
))
