"""Variational Linear Attention mixer (seed 000): q, k, v and the penalty direction u = W_u k_raw per head.

The op applies the feature maps and normalisations of Algorithm 1 itself; this module only projects.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from .recurrent import RecurrentMixer


class VLAMixer(RecurrentMixer):
    """Variational Linear Attention: Sherman–Morrison penalty geometry A_t, write direction α̂_t = A_t k̂ / ‖A_t k̂‖."""

    mechanism = "vla"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,  # the read-out S q / max(z·q, ε) is already normalised
        "lambda0": 0.1,
        "refresh_period": 20,
        "refresh_eta": 1e-3,
        "eps": 1e-4,
    }

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        # W_u: a learned dk×dk map per head, initialised to the identity (u starts along k_raw)
        self.u_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        eye = torch.eye(self.head_dim, dtype=self.u_weight.dtype, device=self.u_weight.device)
        value = eye.expand_as(self.u_weight)
        if init is None:
            with torch.no_grad():
                self.u_weight.copy_(value)
        else:
            init.copy_(self.u_weight, value)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        u = torch.einsum("bthd,hed->bthe", k, self.u_weight)
        o = self.options
        return ops.vla(
            q, k, v, u, lambda0=o["lambda0"], refresh_period=o["refresh_period"], refresh_eta=o["refresh_eta"],
            eps=o["eps"], **self.op_kwargs(mask, state, want_state),
        )
