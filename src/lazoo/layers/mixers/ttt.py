"""Test-time training mixers (Sun et al. 2024): TTT-Linear and TTT-MLP.

Per head, the inner model f (a linear map, or a two-layer GELU MLP) starts from learned weights W₀ (mixer
parameters, passed to the op as its initial state) and takes one gradient step per token on
``½ ‖f(k_t) − v_t‖²`` with a learned per-token, per-head rate ``η_t = lr_scale · σ(w_η·x_t + b_η)``; the output is
``f(q_t; W_t)``. k_t (the corrupted view) and v_t (the target) are the usual key and value projections; q and k
are L2-normalised by default. Gradients within a mini-batch of ``mini_batch_size`` tokens are taken at the
mini-batch's start weights (TTT's mini-batch GD; 1 = per-token GD): see ``lazoo.ops.ttt``. The cache entry is
``{"op": {W…, W…_start, n}, "conv": …}``; a one-token call against it (decoding) takes the fused step
``lazoo.ops.ttt.ttt_*_decode_step``. No LayerNorm/residual inside f.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from ...ops.norms import l2norm
from ...ops.ttt import ttt_linear_decode_step, ttt_mlp_decode_step
from ...registry import Mechanism, register
from .base import normal_parameter
from .delta import DELTA_KERNELS
from .recurrent import RecurrentMixer


def _needs_grad(*xs) -> bool:
    return any(x.requires_grad for x in xs)


class TTTLinearMixer(RecurrentMixer):
    """TTT-Linear: f(x; W) = W x per head, W ``[head_dim, head_dim]`` starting from a learned W₀."""

    mechanism = "ttt_linear"
    defaults = {**RecurrentMixer.defaults, "mini_batch_size": 16, "lr_scale": 1.0, "use_qk_l2norm": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.check_positive_int("mini_batch_size")
        self.lr_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)
        self._make_inner_weights()
        self._init_lazoo_parameters(None)

    def _make_inner_weights(self):
        d = self.head_dim
        self.W0 = nn.Parameter(torch.empty(self.num_heads, d, d))

    def _init_lazoo_parameters(self, init):
        normal_parameter(self.W0, 0.02, init)

    def inner_rate(self, x, q):
        cdt = torch.promote_types(x.dtype, torch.float32)
        return (self.options["lr_scale"] * torch.sigmoid(self.lr_proj(x).to(cdt))).to(q.dtype)

    def initial_weights(self, batch):
        return {"W": self.W0[None].expand(batch, *self.W0.shape)}

    def mix(self, q, k, v, x, *, mask, state, want_state):
        if self.options["use_qk_l2norm"]:
            q, k = l2norm(q), l2norm(k)
        eta = self.inner_rate(x, q)
        if state is None:
            state = self.initial_weights(q.shape[0])
        elif q.shape[1] == 1 and "n" in state and not (torch.is_grad_enabled() and _needs_grad(q, k, v, eta)):
            # generation with the cache: one fused step (same function as the op, none of its chunk set-up)
            step = ttt_linear_decode_step if self.mechanism == "ttt_linear" else ttt_mlp_decode_step
            real = None if mask is None else mask[:, 0].bool()
            o, new_state = step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state,
                                mini_batch_size=self.options["mini_batch_size"], real=real)
            return o[:, None], (new_state if want_state else None)
        op = getattr(ops, self.mechanism)  # ops.ttt_linear / ops.ttt_mlp
        return op(q, k, v, eta, mini_batch_size=self.options["mini_batch_size"],
                  **self.op_kwargs(mask, state, want_state))


class TTTMLPMixer(TTTLinearMixer):
    """TTT-MLP: f(x) = W2 gelu(W1 x) per head, hidden width ``mlp_expansion · head_dim``, learned W1₀, W2₀."""

    mechanism = "ttt_mlp"
    defaults = {**RecurrentMixer.defaults, "mini_batch_size": 16, "lr_scale": 0.1, "use_qk_l2norm": True,
                "mlp_expansion": 4}

    def _make_inner_weights(self):
        e = self.check_positive_int("mlp_expansion")
        d = self.head_dim
        self.W1 = nn.Parameter(torch.empty(self.num_heads, e * d, d))
        self.W2 = nn.Parameter(torch.empty(self.num_heads, d, e * d))

    def _init_lazoo_parameters(self, init):
        d = self.head_dim
        normal_parameter(self.W1, d ** -0.5, init)
        normal_parameter(self.W2, 0.02, init)

    def initial_weights(self, batch):
        return {"W1": self.W1[None].expand(batch, *self.W1.shape), "W2": self.W2[None].expand(batch, *self.W2.shape)}


register(Mechanism(
    name="ttt_linear", mixer=TTTLinearMixer, op="ttt_linear", title="TTT-Linear (test-time training)",
    equation=(
        "W_t = W_{t'} − Σ_{t'<s≤t} η_s (W_{t'} k_s − v_s) k_sᵀ (mini-batch GD on ½‖W k_s − v_s‖² from a learned W₀; "
        "t' = end of the previous mini-batch); o_t = W_t q_t"
    ),
    source="Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
    state='{"op": {"W", "W_start", "n"} (inner weights now and at the mini-batch start), "conv": short-conv tails}',
    backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.ttt", *DELTA_KERNELS),
    tiny_options={"mini_batch_size": 4},
    class_prefix="LazooTTTLinear",
))

register(Mechanism(
    name="ttt_mlp", mixer=TTTMLPMixer, op="ttt_mlp", title="TTT-MLP (test-time training)",
    equation=(
        "f(x) = W2 gelu(W1 x); W_t = W_{t'} − Σ_{t'<s≤t} η_s ∇ℓ_s(W_{t'}), ℓ_s = ½‖f(k_s) − v_s‖², from learned W₀; "
        "o_t = f(q_t; W_t)"
    ),
    source="Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
    state='{"op": {"W1", "W2", their mini-batch-start copies, "n"}, "conv": short-conv tails}',
    tiny_options={"mini_batch_size": 4, "mlp_expansion": 2}, class_prefix="LazooTTTMLP",
))
