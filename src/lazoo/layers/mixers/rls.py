"""Recursive least squares (RLS / Mesa layer; the test-time regression paper) mixer: the exact ridge-regression memory
`S_t = argmin_S Σ_{i≤t} γ^{t−i}‖v_i − S k_i‖² + λ‖S‖_F²`, `o_t = S_t q_t`.

Short convolution on q, k, v (default on), L2-normalised q and k, a learned per-head ridge λ = exp(log_lambda)
(initialised to `lambda_init`), a fixed forgetting factor `gamma` (1 = the unweighted RLS of that paper's eq. 11),
no output norm by default (the read-out is already on the scale of v). The cache entry is
`{"op": {"KK", "VK"}, "conv": <conv tails>}`: the weighted moments Σγ k kᵀ and Σγ v kᵀ, without the ridge, so the
cache stays exact for any λ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .base import set_parameter
from .recurrent import RecurrentMixer


class RLSMixer(RecurrentMixer):
    """Exact (γ-weighted) online ridge regression of v on k, read out at q (`lazoo.ops.rls`)."""

    mechanism = "rls"
    defaults = {**RecurrentMixer.defaults, "use_short_conv": True, "lambda_init": 1.0, "gamma": 1.0,
                "chunk_size": None,  # the op's default for the backend that runs
                # the read-out S_t q_t is a regression prediction of v (value scale), not a sum growing with t:
                # no output norm (an RMSNorm would blow up the small early-token outputs and their rounding)
                "output_norm": False}

    def __init__(self, config, layer_idx, options):
        lam = options["lambda_init"]
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam > 0:
            raise ValueError(f"rls: lambda_init must be a number > 0, got {lam!r}")
        super().__init__(config, layer_idx, options)
        self.log_lambda = nn.Parameter(torch.full((self.num_heads,), math.log(lam)))

    def _init_lazoo_parameters(self, init):
        set_parameter(self.log_lambda, math.log(self.options["lambda_init"]), init)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        cdt = torch.promote_types(q.dtype, torch.float32)  # normalise in fp32 (bf16 norms add avoidable error)
        q, k = (F.normalize(x.to(cdt), dim=-1).to(x.dtype) for x in (q, k))
        lam = self.log_lambda.to(torch.promote_types(self.log_lambda.dtype, torch.float32)).exp()
        return ops.rls(q, k, v, lam=lam, gamma=o["gamma"], chunk_size=o["chunk_size"],
                       **self.op_kwargs(mask, state, want_state))


register(Mechanism(
    name="rls", mixer=RLSMixer, op="rls", title="Recursive least squares (Mesa layer)",
    equation=(
        "S_t = argmin_S Σ_{i≤t} γ^{t−i}‖v_i − S k_i‖² + λ‖S‖_F² = VK_t (KK_t + λI)^{-1} (exact ridge regression; "
        "Sherman–Morrison per token for γ = 1); o_t = S_t q_t"
    ),
    source=("Wang, Shi, Fox 2025, Test-time regression (eq. 11); "
            "von Oswald et al. 2023/2025, the Mesa layer and MesaNet"),
    state=(
        '{"op": {"KK" [B, H, dk, dk], "VK" [B, H, dv, dk]} (weighted moments, no ridge), "conv": short-conv tails}'
    ),
    backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.linear", "lazoo.kernels.normalized", "lazoo.kernels.rls"),
    tiny_options={"chunk_size": 16}, class_prefix="LazooRLS",
))
