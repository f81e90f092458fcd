"""Memory Lobe (the ELA paper, §V-C): linear attention over a decoder layer's "flow".

The flow of layer k is what the layer adds to the residual stream, `ΔX = X_k − X_{k−1}` (with Hyper-Link:
the feed-forward output f). The lobe projects it to queries, keys and values (`Q, K, V ∈ R^{D×D}`, split
into the model's heads), applies a positive feature map φ and reads out normalised linear attention:

    causal:         m_t = Σ_{s≤t} v_s φ(k_s)ᵀ φ(q_t) / Σ_{s≤t} φ(k_s)·φ(q_t)     (ops.linear_attention)
    bidirectional:  the same sums over every real token of the sequence   (ops.bidirectional_linear_attention)

The ELA paper describes the bidirectional form inside a causal LM. There, position t reads the flow of
positions s > t, which carries the tokens it is asked to predict: future-token leakage (the "abrupt
loss drop" it reports vanishes with a causal mask). A causal LM must use "causal"; "bidirectional" is for
encoders and vision. The causal form keeps `{"S", "z"}` per layer in `cache.lobe_states`, so decoding
with a cache equals a full recompute; the bidirectional form has no state and refuses a cached
continuation.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops.bidirectional import bidirectional_linear_attention
from ..ops.linear import get_feature_map

MODES = ("causal", "bidirectional")


class MemoryLobe(nn.Module):
    """q/k/v projections of the flow and normalised linear attention over it (no output projection,
    as in the paper's pseudocode). `mode`: "causal" or "bidirectional"."""

    def __init__(self, hidden_size: int, num_heads: int, layer_idx: int, *, mode: str = "causal",
                 feature_map: str = "elu1", eps: float = 1e-6, backend: str | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"memory_lobe: mode must be one of {MODES}, got {mode!r}")
        if hidden_size % num_heads:
            raise ValueError(f"memory_lobe: hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        get_feature_map(feature_map, "memory_lobe")  # raises on an unknown name
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.mode = mode
        self.feature_map = feature_map
        self.eps = eps
        self.backend = backend
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, flow: torch.Tensor, *, mask=None, cache=None, cu_seqlens=None) -> torch.Tensor:
        B, T, D = flow.shape
        q, k, v = (p(flow).view(B, T, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.mode == "bidirectional":
            o = self._bidirectional(q, k, v, mask, cache, cu_seqlens)
        else:
            state = None if cache is None else cache.read_lobe_state(self.layer_idx)
            o, new_state = ops.linear_attention(
                q, k, v, feature_map=self.feature_map, normalize=True, eps=self.eps, initial_state=state,
                output_final_state=cache is not None, mask=mask, backend=self.backend, cu_seqlens=cu_seqlens)
            if cache is not None:
                cache.write_lobe_state(self.layer_idx, new_state)
        return o.reshape(B, T, D)

    def _bidirectional(self, q, k, v, mask, cache, cu_seqlens):
        if cache is not None and cache.seen_positions:
            raise ValueError(
                "memory_lobe='bidirectional' has no recurrent state: it cannot continue a cached sequence "
                "(and in a causal LM it reads future tokens). Use memory_lobe='causal' to generate")
        if cu_seqlens is None:
            return self._attend_all(q, k, v, mask)
        bounds = cu_seqlens.tolist()  # packed sequences: one sequence never reads another
        return torch.cat([self._attend_all(q[:, s:e], k[:, s:e], v[:, s:e], None)
                          for s, e in zip(bounds[:-1], bounds[1:]) if e > s], dim=1)

    def _attend_all(self, q, k, v, mask):
        o, _ = bidirectional_linear_attention(q, k, v, feature_map=self.feature_map, eps=self.eps, mask=mask)
        return o
