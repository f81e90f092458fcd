"""A mechanism declared outside lazoo, the way a user adds one: an op, a mixer and its declaration in one file.

`S_t = γ S_{t−1} + v_t k_tᵀ`, `o_t = S_t q_t` (linear attention with a fixed decay γ, option `decay`), run step
by step. tests/test_registry.py registers it by importing this file and runs it through the Auto classes,
`generate`, Trainer and the `trust_remote_code` export. It imports lazoo absolutely, so the export can copy it.
"""

from __future__ import annotations

import torch

from lazoo.layers.mixers.recurrent import RecurrentMixer
from lazoo.registry import Mechanism, register


def toy_decay(q, k, v, *, decay: float, initial_state=None, output_final_state=False, mask=None, backend=None):
    """The op: q, k `[B, T, H, dk]`, v `[B, T, H, dv]`, state `[B, H, dv, dk]` in fp32 (float64 for float64
    inputs); a pad (mask 0) leaves the state untouched and outputs 0."""
    if backend not in (None, "recurrent"):
        raise NotImplementedError(f"toy_decay: backend {backend!r}; it has only the 'recurrent' form")
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, dk = q.shape
    S = q.new_zeros(B, H, v.shape[-1], dk, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    outputs = []
    for t in range(T):
        written = decay * S + torch.einsum("bhv,bhk->bhvk", v[:, t].to(cdt), k[:, t].to(cdt))
        real = torch.ones(B, dtype=torch.bool, device=q.device) if mask is None else mask[:, t].bool()
        S = torch.where(real[:, None, None, None], written, S)
        o = torch.einsum("bhvk,bhk->bhv", S, q[:, t].to(cdt))
        outputs.append(o * real[:, None, None])
    return torch.stack(outputs, 1).to(q.dtype), (S if output_final_state else None)


class ToyDecayMixer(RecurrentMixer):
    """Linear attention with a fixed decay γ per token (`decay`)."""

    mechanism = "toy_decay"
    defaults = {**RecurrentMixer.defaults, "decay": 0.9}

    def mix(self, q, k, v, x, *, mask, state, want_state):
        return toy_decay(q, k, v, decay=self.options["decay"], **self.op_kwargs(mask, state, want_state))


register(Mechanism(
    name="toy_decay",
    mixer=ToyDecayMixer,
    op="toy_decay",
    title="Toy decayed linear attention",
    equation="S_t = γ S_{t−1} + v_t k_tᵀ; o_t = S_t q_t",
    source="lazoo's registry tests",
    state='{"op": S [B, H, dv, dk], "conv": short-conv tails}',
    backends=("recurrent",),
    option_docs={"decay": "γ, the state's decay per token"},
    tiny_options={"decay": 0.8},
), replace=True)
