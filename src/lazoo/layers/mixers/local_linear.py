"""Local-linear (p = 1) attention mixer (the test-time regression paper, eqs. 52–54): the output at t is the
intercept of a softmax-weighted local linear ridge regression of the values on `k_i − q_t`
(`lazoo.ops.local_linear_attention`).

Unit-norm q and k with a learned per-head scale β (QK-norm, which the paper shows makes softmax attention a
proper local constant regressor), no positional encoding (NoPE), optional causal sliding `window`, ridge ρ on
the slope (`ridge`). Quadratic in T like softmax attention; the cache entry is
`{"op": {"k", "v", "mask"}, "conv": None}`, a KV cache (the last `window − 1` positions with a window).

`slope_rank` r (None = the exact slope on all head_dim offset features): the slope acts on P(k_i − q_t) with a
learned per-head P `[H, r, head_dim]` (`slope_projection`), while the softmax weights keep the full q·k. The
op's fused Triton kernel keeps r×r moments per query and takes r ≤ 32, so at head dim 64 and up a model runs
it on CUDA only with a slope_rank of at most 32 (the exact slope falls back to the PyTorch chunk form).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .base import init_qk_scale, set_parameter, unit_norm
from .recurrent import RecurrentMixer


class LocalLinearMixer(RecurrentMixer):
    """o_t = M⁰ of min Σ_i w_i‖v_i − M⁰ − M¹ P(k_i − q_t)‖² + ρ‖M¹‖², w = softmax_i(β q_t·k_i) (P = I without
    `slope_rank`)."""

    mechanism = "local_linear"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,  # like softmax, the read-out is already a (corrected) average of values
        "ridge": 0.1,  # relative to unit-norm keys and unit total weight; fp32 rounding grows like eps/ρ
        "window": None,
        "chunk_size": 64,
        "slope_rank": None,  # None: the exact slope; r: a learned per-head slope projection [H, r, head_dim]
    }

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))
        rank = options.get("slope_rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.head_dim):
            raise ValueError(f"local_linear: slope_rank must be None (the exact slope) or an int in "
                             f"[1, head_dim = {self.head_dim}], got {rank!r}")
        self.slope_projection = None
        if rank is not None:
            self.slope_projection = nn.Parameter(torch.empty(self.num_heads, rank, self.head_dim))
            self._init_slope_projection(None)

    def _init_lazoo_parameters(self, init):
        init_qk_scale(self, init)
        if self.slope_projection is not None:
            self._init_slope_projection(init)

    def _init_slope_projection(self, init):
        """Random orthonormal rows per head, times √(head_dim / r).

        Orthonormal rows give r distinct, equally scaled slope features (a well-conditioned r×r covariance).
        The factor makes ‖P d‖ match ‖d‖ on average over directions d (E‖P d‖² = (r/dk)‖d‖² for orthonormal
        rows), so the ridge ρ, which is set for offsets of unit-norm keys, is as strong against the projected
        offsets as against the exact ones at any r (scaling P by c is the same fit as a ridge of ρ/c²). At
        r = head_dim, P is then an orthogonal matrix and the fit equals the exact slope (the regression and its
        Frobenius ridge do not change under a rotation of the features): such a model starts as the exact one.
        Built in a fresh tensor and copied in one call, so transformers' guarded init leaves a loaded P alone.
        """
        H, r, dk = self.slope_projection.shape
        columns, _ = torch.linalg.qr(torch.randn(H, dk, r, dtype=torch.float64))  # [H, dk, r], orthonormal columns
        set_parameter(self.slope_projection, columns.transpose(1, 2) * math.sqrt(dk / r), init)

    def keeps_every_position(self) -> bool:
        return self.options["window"] is None

    def kv_cache_length(self) -> int | None:
        window = self.options["window"]
        return None if window is None else window - 1

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        q, k = unit_norm(q), unit_norm(k)
        return ops.local_linear_attention(q, k, v, scale=self.qk_scale, ridge=o["ridge"], window=o["window"],
                                          chunk_size=o["chunk_size"], rank_projection=self.slope_projection,
                                          **self.op_kwargs(mask, state, want_state))


register(Mechanism(
    name="local_linear", mixer=LocalLinearMixer, op="local_linear_attention",
    title="Local-linear (p = 1) attention",
    equation=(
        "o_t = M⁰ of min Σ_{i≤t} w_i‖v_i − M⁰ − M¹(k_i − q_t)‖² + ρ‖M¹‖², w_i = softmax_i(β q_t·k_i) (KV cache, "
        "quadratic like softmax)"
    ),
    source="Wang, Shi, Fox 2025, Test-time regression (eqs. 52–54)",
    state='{"op": {"k", "v", "mask"}, a KV cache (the last window - 1 positions with a window), "conv": None}',
    backends=("recurrent", "chunk", "triton"), kernels=("lazoo.kernels.local_linear", "lazoo.kernels.slope_features"),
    tiny_options={"chunk_size": 16},
))
