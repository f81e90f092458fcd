"""Shared scaffolding of the recurrent (linear-time) mixers: projections, optional short convolution,
per-head output norm and gate, and the cache entry `{"op": <op state>, "conv": <conv tails>}`."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .base import ShortConvProjections, TokenMixer


class RecurrentMixer(TokenMixer):
    """Subclasses implement `mix(q, k, v, x, mask, state) -> (o, new_state)` on `[B, T, H, D]` tensors.

    Options used here: `use_short_conv`, `conv_size`, `short_conv_targets` (which of q, k, v get the short
    convolution: "qkv" by default, "k" for keys only as in seed 004 §6), `conv_activation` ("silu" or None for
    the plain linear filter of seed 004 eq 56), `output_norm`, `output_gate`, `norm_eps`.

    Packed sequences (`cu_seqlens`): the short convolution stays inside each sequence; a `mix` that takes a
    `cu_seqlens` keyword (its op handles packing natively) gets it, any other `mix` runs once per sequence.
    """

    packing = "native"

    defaults = {"use_short_conv": False, "conv_size": 4, "short_conv_targets": "qkv", "conv_activation": "silu",
                "output_norm": True, "output_gate": False, "norm_eps": 1e-6}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        d = config.hidden_size
        self.add_qkvo_projections(d)
        targets = options.get("short_conv_targets", "qkv")
        if not targets or not isinstance(targets, str) or set(targets) - set("qkv") or len(set(targets)) != len(targets):
            raise ValueError(f"short_conv_targets must be a non-empty subset of 'qkv' (e.g. 'qkv', 'k'), got {targets!r}")
        activation = options.get("conv_activation", "silu")
        if activation not in ("silu", None):
            raise ValueError(f"conv_activation must be 'silu' or None, got {activation!r}")
        self.short_conv = (
            ShortConvProjections({n: d for n in "qkv" if n in targets}, options["conv_size"], activation)
            if options["use_short_conv"] else None
        )
        self.o_norm = nn.RMSNorm(self.head_dim, eps=options["norm_eps"]) if options["output_norm"] else None
        self.g_proj = nn.Linear(d, d, bias=False) if options["output_gate"] else None

    def mix(self, q, k, v, x, *, mask, state, want_state: bool):
        """Run the op; return `(o [B, T, H, dv], new op state or None)`."""
        raise NotImplementedError

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        x = hidden_states
        if cu_seqlens is not None and (mask is not None or cache is not None):
            raise ValueError(f"{type(self).__name__}: packed sequences (cu_seqlens) take no mask and no cache")
        entry = self.read_state(cache) or {}
        qkv = {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}
        conv_state = None
        if self.short_conv is not None:
            convolved, conv_state = self.short_conv({n: qkv[n] for n in self.short_conv.convs}, mask,
                                                    entry.get("conv"), output_state=cache is not None,
                                                    cu_seqlens=cu_seqlens, backend=self.options.get("backend"))
            qkv = {**qkv, **convolved}  # projections not in `short_conv_targets` pass through unchanged
        q, k, v = (self.split_heads(qkv[n]) for n in "qkv")
        if cu_seqlens is not None:
            o, op_state = self._mix_packed(q, k, v, x, cu_seqlens)
        else:
            o, op_state = self.mix(q, k, v, x, mask=mask, state=entry.get("op"), want_state=cache is not None)
        if cache is not None:
            self.write_state(cache, {"op": op_state, "conv": conv_state})
        if self.o_norm is not None:
            o = self.o_norm(o)
        o = self.merge_heads(o)
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x))
        return self.o_proj(o)

    def _mix_packed(self, q, k, v, x, cu_seqlens):
        if _takes_cu_seqlens(type(self)):
            return self.mix(q, k, v, x, mask=None, state=None, want_state=False, cu_seqlens=cu_seqlens)
        bounds = cu_seqlens.tolist()
        outs = [self.mix(q[:, s:e], k[:, s:e], v[:, s:e], x[:, s:e], mask=None, state=None, want_state=False)[0]
                for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        return torch.cat(outs, dim=1), None

    def op_kwargs(self, mask, state, want_state: bool, cu_seqlens=None) -> dict:
        kwargs = {"initial_state": state, "output_final_state": want_state, "mask": mask,
                  "backend": self.options.get("backend")}
        if cu_seqlens is not None:  # only ops that take it natively get it
            kwargs["cu_seqlens"] = cu_seqlens
        return kwargs


@functools.cache
def _takes_cu_seqlens(cls) -> bool:
    """Whether `cls.mix` has a `cu_seqlens` parameter (its op handles packed sequences natively)."""
    return "cu_seqlens" in inspect.signature(cls.mix).parameters
