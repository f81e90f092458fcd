"""Shared scaffolding of the recurrent (linear-time) mixers: projections, optional short convolution,
activations, head layout, per-head output norm and gate, and the cache entry `{"op": <op state>, "conv": <conv
tails>}`."""

from __future__ import annotations

import functools
import inspect
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..mlp import silu_mul
from ..norms import RMSNorm, norm_keeping_only_input, norm_then_silu_gate
from ..projections import project_together
from .base import ShortConvProjections, TokenMixer


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """`elu(x) + 1`, written as `x + 1` / `exp(x)` so that it is exact on both sides."""
    return torch.where(x >= 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


#: activations the options `qk_activation`, `v_activation` (and GLA's `feature_map`) name; "identity" is none
ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid,
               "sqrelu": squared_relu, "elu1": elu_plus_one, "identity": None}
#: activations of the output gate `o * act(g_proj(x))` (option `gate_activation`)
GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}
#: options that change the head layout; a mixer takes them only where its class sets `head_layout = True`
HEAD_LAYOUT_OPTIONS = ("num_heads", "head_k_dim", "expand_v", "num_kv_heads", "num_v_heads")

#: the options RecurrentMixer reads, with their meaning (mechanisms add them to their `option_docs`)
RECURRENT_OPTION_DOCS = {
    "use_short_conv": "causal depthwise short convolutions on the projections named by short_conv_targets",
    "conv_size": "taps of each short convolution",
    "short_conv_targets": "which of q, k, v are convolved ('qkv', 'k', ...)",
    "conv_activation": "'silu' or None: the activation inside the short convolutions",
    "output_norm": "a per-head RMSNorm of the op's output (over the value head dim)",
    "output_gate": "an output gate o * act(g_proj(x)) after the norm",
    "norm_eps": "epsilon of the output RMSNorm",
    "conv_bias": "a learned bias in each short convolution (added before its activation)",
    "qk_activation": ("activation of q and k after the projection and optional short convolution: "
                      f"None (the convolution's `conv_activation` only) or one of {sorted(ACTIVATIONS)}"),
    "v_activation": "as `qk_activation`, for v",
    "output_norm_affine": "the per-head output RMSNorm has a learned weight (False: none)",
    "gate_activation": f"activation of the output gate `o * act(g_proj(x))`: one of {sorted(GATE_ACTIVATIONS)}",
    "num_heads": "query heads of this mixer (None: the config's num_attention_heads)",
    "head_k_dim": "query/key head dim (None: hidden_size / query heads), free of hidden_size",
    "expand_v": "value head dim = head_k_dim * expand_v (an integer); the output norm and gate act on it",
    "num_kv_heads": ("key/value heads, fewer than query heads (grouped-query layout); each serves "
                     "num_heads / num_kv_heads consecutive query heads (None: as many as query heads)"),
    "num_v_heads": ("value heads, more than query/key heads (grouped-value layout); each query/key head serves "
                    "num_v_heads / num_heads consecutive value heads (None: as many as key heads)"),
}


def check_option_choice(mechanism: str, option: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{mechanism}: {option} must be one of {sorted(allowed, key=str)}, got {value!r}")


class RecurrentMixer(TokenMixer):
    """Subclasses implement `mix(q, k, v, x, mask, state) -> (o, new_state)` on `[B, T, H, D]` tensors.

    Options used here: `use_short_conv`, `conv_size`, `short_conv_targets` (which of q, k, v get the short
    convolution: "qkv" by default, "k" for keys only as in the test-time regression paper, §6),
    `conv_activation` ("silu" or None for the plain linear filter of its eq. 56), `conv_bias`, `qk_activation` /
    `v_activation` (an activation after the projection and optional convolution, `RECURRENT_OPTION_DOCS`),
    `output_norm`, `output_norm_affine`, `output_gate`, `gate_activation`, `norm_eps`, and, where the class sets
    `head_layout = True`, the head layout: `num_heads`, `head_k_dim`, `expand_v`, `num_kv_heads`, `num_v_heads`.

    Head layout: q has `num_heads` heads, k `num_kv_heads`, v `num_v_heads`, of dims `head_k_dim` (q, k) and
    `head_v_dim` (v). The op runs on `num_state_heads` = max(query heads, value heads) heads: each of q, k, v is
    repeated head by head (`repeat_interleave`) to that count, so state head j reads query head
    j // (num_state_heads / num_heads), and so on; a mixer whose op reads grouped value heads itself
    (`grouped_values`) passes q and k unrepeated when only the value heads are more. The output norm, gate and
    `o_proj` act on `num_state_heads * head_v_dim` features.

    Packed sequences (`cu_seqlens`): the short convolution stays inside each sequence; a `mix` that takes a
    `cu_seqlens` keyword (its op handles packing natively) gets it, any other `mix` runs once per sequence.
    """

    packing = "native"
    optional_int_options = ("num_heads", "head_k_dim", "num_kv_heads", "num_v_heads")
    #: whether this mixer takes the head layout options (its per-head parameters use `num_state_heads`)
    head_layout: ClassVar[bool] = False
    #: whether the op reads grouped value heads itself (v with m·H heads beside q and k with H): then q and k are
    #: not repeated when there are more value heads than query/key heads
    grouped_values: ClassVar[bool] = False

    defaults = {"use_short_conv": False, "conv_size": 4, "short_conv_targets": "qkv", "conv_activation": "silu",
                "output_norm": True, "output_gate": False, "norm_eps": 1e-6,
                "conv_bias": False, "qk_activation": None, "v_activation": None, "output_norm_affine": True,
                "gate_activation": "silu", "num_heads": None, "head_k_dim": None, "expand_v": 1.0,
                "num_kv_heads": None, "num_v_heads": None}

    def __init__(self, config, layer_idx, options):
        options = {**RecurrentMixer.defaults, **options}  # mixers declared outside lazoo may predate an option
        self.check_options({k: options[k] for k in self.optional_int_options})
        num_heads = options["num_heads"] or config.num_attention_heads
        super().__init__(config, layer_idx, options, num_heads=num_heads, head_dim=options["head_k_dim"])
        self._set_head_layout(options)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_v_heads * self.head_v_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.short_conv = self._make_short_conv(options)
        self.o_norm = (RMSNorm(self.head_v_dim, eps=options["norm_eps"],
                               elementwise_affine=options["output_norm_affine"])
                       if options["output_norm"] else None)
        check_option_choice(self.mechanism, "gate_activation", options["gate_activation"], GATE_ACTIVATIONS)
        self.gate_fn = GATE_ACTIVATIONS[options["gate_activation"]]
        self.g_proj = nn.Linear(d, self.value_dim, bias=False) if options["output_gate"] else None

    def _set_head_layout(self, options) -> None:
        """Head counts and dims from the layout options (`HEAD_LAYOUT_OPTIONS`), checked."""
        name = self.mechanism
        changed = [k for k in HEAD_LAYOUT_OPTIONS if options[k] != RecurrentMixer.defaults[k]]
        if changed and not self.head_layout:
            raise ValueError(f"{name}: options {changed} are not supported by this mechanism "
                             f"(its mixer {type(self).__name__} keeps one head layout); remove them")
        expand_v = options["expand_v"]
        head_v_dim = self.head_dim * expand_v
        if not expand_v > 0 or not math.isclose(head_v_dim, round(head_v_dim), abs_tol=1e-6) or round(head_v_dim) < 1:
            raise ValueError(f"{name}: expand_v={expand_v!r} times head_k_dim={self.head_dim} must be a positive "
                             f"integer (the value head dim), got {head_v_dim}")
        self.head_v_dim = round(head_v_dim)
        self.num_kv_heads = options["num_kv_heads"] or self.num_heads
        self.num_v_heads = options["num_v_heads"] or self.num_kv_heads
        self.num_state_heads = max(self.num_heads, self.num_v_heads)
        for key, heads in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                           ("num_v_heads", self.num_v_heads)):
            if self.num_state_heads % heads:
                raise ValueError(f"{name}: the {heads} heads of {key} must divide the {self.num_state_heads} state "
                                 f"heads (max of query and value heads: num_heads={self.num_heads}, "
                                 f"num_v_heads={self.num_v_heads})")
        self.value_dim = self.num_state_heads * self.head_v_dim

    def _make_short_conv(self, options) -> ShortConvProjections | None:
        """The short convolutions of `short_conv_targets`; where `qk_activation`/`v_activation` names an
        activation, the convolution of that stream is linear (SiLU excepted: it is fused into the convolution,
        the same function) and `activate` applies it afterwards."""
        targets = options["short_conv_targets"]
        if (not targets or not isinstance(targets, str) or set(targets) - set("qkv")
                or len(set(targets)) != len(targets)):
            raise ValueError(f"short_conv_targets must be a non-empty subset of 'qkv' (e.g. 'qkv', 'k'), "
                             f"got {targets!r}")
        if options["conv_activation"] not in ("silu", None):
            raise ValueError(f"conv_activation must be 'silu' or None, got {options['conv_activation']!r}")
        for key in ("qk_activation", "v_activation"):
            check_option_choice(self.mechanism, key, options[key], {None, *ACTIVATIONS})
        convolved = [n for n in "qkv" if n in targets] if options["use_short_conv"] else []
        self._post_activation, conv_activation = {}, {}
        for n in "qkv":
            act = options["qk_activation" if n in "qk" else "v_activation"]
            if act is None:  # today's behaviour: the convolution's own activation, nothing without one
                conv_activation[n] = options["conv_activation"]
                continue
            fused = n in convolved and act == "silu"
            conv_activation[n] = "silu" if fused else None
            if not fused and ACTIVATIONS[act] is not None:
                self._post_activation[n] = ACTIVATIONS[act]
        if not convolved:
            return None
        widths = {"q": self.q_proj.out_features, "k": self.k_proj.out_features, "v": self.v_proj.out_features}
        return ShortConvProjections({n: widths[n] for n in convolved}, options["conv_size"],
                                    {n: conv_activation[n] for n in convolved}, bias=options["conv_bias"])

    def mix(self, q, k, v, x, *, mask, state, want_state: bool):
        """Run the op; return `(o [B, T, H, dv], new op state or None)`."""
        raise NotImplementedError

    def fused_step_applies(self, x: torch.Tensor) -> bool:
        """Whether `fused_step` runs this decode step (one token, a cached state): a mixer with a one-kernel
        decode step says so (no autograd, its kernel's device, dtype and options)."""
        return False

    def fused_step(self, x: torch.Tensor, entry: dict, mask, in_place: bool):
        """One decode step from `x` to the input of `o_proj`: `(o [B, 1, value_dim], new op state, new conv
        states)`; `in_place`: the cached tensors are updated where they are (a static cache)."""
        raise NotImplementedError

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        x = hidden_states
        if cu_seqlens is not None and (mask is not None or cache is not None):
            raise ValueError(f"{type(self).__name__}: packed sequences (cu_seqlens) take no mask and no cache")
        entry = self.read_state(cache) or {}
        if cache is not None and x.shape[1] == 1 and entry and self.fused_step_applies(x):
            o, op_state, conv_state = self.fused_step(x, entry, mask, in_place=cache.static)
            self.write_state(cache, {"op": op_state, "conv": conv_state})
            return self.o_proj(o)
        if x.shape[1] > 1 and self.short_conv is not None and set(self.short_conv.convs) == set("qkv"):
            # q, k and v in one product (at a few thousand tokens the host's time per op sets a layer's cost); their
            # short convolutions read the three slices where they are
            qkv = dict(zip("qkv", project_together(x, [self.q_proj, self.k_proj, self.v_proj])))
        else:
            qkv = {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}
        conv_state = None
        if self.short_conv is not None:
            convolved, conv_state = self.short_conv({n: qkv[n] for n in self.short_conv.convs}, mask,
                                                    entry.get("conv"), output_state=cache is not None,
                                                    cu_seqlens=cu_seqlens, backend=self.options.get("backend"))
            qkv = {**qkv, **convolved}  # projections not in `short_conv_targets` pass through unchanged
        q, k, v = self.state_heads(self.activate(qkv))
        if cu_seqlens is not None:
            o, op_state = self._mix_packed(q, k, v, x, cu_seqlens)
        else:
            o, op_state = self.mix(q, k, v, x, mask=mask, state=entry.get("op"), want_state=cache is not None)
        if cache is not None:
            self.write_state(cache, {"op": op_state, "conv": conv_state})
        return self.o_proj(self.read_out(o, x))

    def activate(self, qkv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The activations that come after the projections and short convolutions (`qk_activation`,
        `v_activation`), where the convolution did not already apply them."""
        return {n: self._post_activation[n](t) if n in self._post_activation else t for n, t in qkv.items()}

    def state_heads(self, qkv: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[B, T, hidden]` as `[B, T, num_state_heads, D]`, each repeated head by head as needed (q and k
        keep their `num_heads` heads where the op reads grouped value heads itself)."""
        heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_v_heads}
        if self.grouped_values and self.num_kv_heads == self.num_heads and self.num_v_heads > self.num_heads:
            return (*(qkv[n].view(*qkv[n].shape[:2], self.num_heads, -1) for n in "qk"),
                    self.repeat_heads(qkv["v"], self.num_v_heads))
        return tuple(self.repeat_heads(qkv[n], heads[n]) for n in "qkv")

    def repeat_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """`[B, T, heads * D]` -> `[B, T, num_state_heads, D]`: head i serves state heads i*r ... i*r + r − 1."""
        x = x.view(*x.shape[:2], heads, -1)
        repeats = self.num_state_heads // heads
        return x if repeats == 1 else x.repeat_interleave(repeats, dim=2)

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head output norm, heads merged, output gate: `[B, T, H, dv]` -> `[B, T, H * dv]` (before `o_proj`)."""
        if self.o_norm is not None and self.g_proj is not None and self.gate_fn is F.silu:
            return self.merge_heads(norm_then_silu_gate(self.o_norm, o, self.g_proj(x).view(o.shape)))
        if self.o_norm is not None:
            o = norm_keeping_only_input(self.o_norm, o)
        o = self.merge_heads(o)
        if self.g_proj is not None:
            gate = self.g_proj(x)
            # silu(gate) · o through silu_mul keeps gate and o for the backward, not silu(gate) as well
            o = silu_mul(gate, o) if self.gate_fn is F.silu else o * self.gate_fn(gate)
        return o

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
