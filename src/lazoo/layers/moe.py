"""Routed mixture-of-experts feed-forward with the routing-score bias of the ELA paper (§V-A, eqs. 14-15).

Router: `p = softmax(W_r x)` over E experts (`W_r ∈ R^{E×D}`), the top-k experts per token, their scores
`s_e` renormalised to sum to 1 (k > 1). Each expert is a gated MLP f_e. The paper gives each expert a
"label vector" — the router's weight row `w_e = W_r[e]`, the key the token's query is matched against —
and uses it as the expert's bias, tying what the router looks for to what the expert adds:

    eq 14   y = Σ_{e∈topk} (s_e · f_e(x) + b_e)        b_e = w_e   (the bias does not pass through s_e)
    eq 15   y = Σ_{e∈topk}  s_e · (f_e(x) + b_e)                    (it does)
    None    y = Σ_{e∈topk}  s_e · f_e(x)                            (the usual MoE)

Load balancing (as in Switch/Mixtral): `aux = E · Σ_e f_e P_e`, f_e the fraction of the N·k routing
slots that went to expert e and P_e the mean router probability of e, over real tokens (1 when balanced).
The last forward's value is kept in `aux_loss` for the model to collect.
"""

from __future__ import annotations

import torch
from torch import nn

from .mlp import GatedMLP

BIAS_MODES = (None, "eq14", "eq15")


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, num_experts: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """`E · Σ_e f_e P_e` from router probabilities `[N, E]` and chosen experts `[N, k]`; `mask` `[N]`
    (1 = real token) leaves pads out. Returns a scalar in probs' dtype."""
    chosen = torch.zeros_like(probs).scatter_(1, top_idx, 1.0)  # [N, E]: 1 where e is among the top k
    if mask is None:
        weights = probs.new_ones(probs.shape[0])
    else:  # pads selected out, not multiplied by 0 (which keeps a NaN)
        real = mask.reshape(-1).bool()[:, None]
        probs = probs.masked_fill(~real, 0)
        chosen = chosen.masked_fill(~real, 0)
        weights = real[:, 0].to(probs.dtype)
    count = weights.sum().clamp_min(1.0)
    fraction = chosen.sum(0) / (count * top_idx.shape[1])
    mean_prob = probs.sum(0) / count
    return num_experts * (fraction * mean_prob).sum()


class RoutedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 bias: str | None = "eq14"):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"RoutedMoE: num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"RoutedMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if bias not in BIAS_MODES:
            raise ValueError(f"RoutedMoE: bias must be one of {BIAS_MODES}, got {bias!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.bias = bias
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        # routed in float32 at least (float64 stays float64)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)  # [N, E]
        top_p, top_idx = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (top_idx == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat[token])
            s = top_p[token, slot, None].to(y.dtype)
            b = self.router.weight[e].to(y.dtype)  # the expert's label vector (eqs 14/15)
            if self.bias == "eq14":
                y = s * y + b
            elif self.bias == "eq15":
                y = s * (y + b)
            else:
                y = s * y
            out.index_add_(0, token, y.to(out.dtype))
        self.aux_loss = load_balancing_loss(probs, top_idx, self.num_experts, mask)
        return out.view(shape)
