"""Test-time training mixers (seed 001; Sun et al. 2024): TTT-Linear and TTT-MLP.

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
from ...ops.ttt import ttt_linear_decode_step, ttt_mlp_decode_step
from .recurrent import RecurrentMixer


def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(|x|² + eps)`` over the last dim (as the delta-rule ops normalise q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _needs_grad(*xs) -> bool:
    return any(x.requires_grad for x in xs)


class TTTLinearMixer(RecurrentMixer):
    """TTT-Linear: f(x; W) = W x per head, W ``[head_dim, head_dim]`` starting from a learned W₀."""

    mechanism = "ttt_linear"
    defaults = {**RecurrentMixer.defaults, "mini_batch_size": 16, "lr_scale": 1.0, "use_qk_l2norm": True}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        n = options["mini_batch_size"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{self.mechanism}: mini_batch_size must be a positive int, got {n!r}")
        self.lr_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)
        self._make_inner_weights()
        self._init_lazoo_parameters(None)

    def _make_inner_weights(self):
        d = self.head_dim
        self.W0 = nn.Parameter(torch.empty(self.num_heads, d, d))

    def _init_lazoo_parameters(self, init):
        if init is None:
            with torch.no_grad():
                self.W0.normal_(0.0, 0.02)
        else:
            init.normal_(self.W0, std=0.02)

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
        return op(q, k, v, eta, mini_batch_size=self.options["mini_batch_size"], **self.op_kwargs(mask, state, want_state))


class TTTMLPMixer(TTTLinearMixer):
    """TTT-MLP: f(x) = W2 gelu(W1 x) per head, hidden width ``mlp_expansion · head_dim``, learned W1₀, W2₀."""

    mechanism = "ttt_mlp"
    defaults = {**RecurrentMixer.defaults, "mini_batch_size": 16, "lr_scale": 0.1, "use_qk_l2norm": True,
                "mlp_expansion": 4}

    def _make_inner_weights(self):
        e = self.options["mlp_expansion"]
        if not isinstance(e, int) or isinstance(e, bool) or e < 1:
            raise ValueError(f"ttt_mlp: mlp_expansion must be a positive int, got {e!r}")
        d = self.head_dim
        self.W1 = nn.Parameter(torch.empty(self.num_heads, e * d, d))
        self.W2 = nn.Parameter(torch.empty(self.num_heads, d, e * d))

    def _init_lazoo_parameters(self, init):
        d = self.head_dim
        if init is None:
            with torch.no_grad():
                self.W1.normal_(0.0, d ** -0.5)
                self.W2.normal_(0.0, 0.02)
        else:
            init.normal_(self.W1, std=d ** -0.5)
            init.normal_(self.W2, std=0.02)

    def initial_weights(self, batch):
        return {"W1": self.W1[None].expand(batch, *self.W1.shape), "W2": self.W2[None].expand(batch, *self.W2.shape)}

