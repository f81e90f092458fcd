"""The one interface every token mixer implements.

A mixer maps hidden states `[B, T, hidden]` to `[B, T, hidden]`. It reads and writes its own entry of
the cache (`cache.states[layer_idx]`, a dict of tensors whose content only the mixer knows: a KV window,
S/A/z/t for VLA, a short-convolution tail, ...). `mask` `[B, T]` marks real tokens (None = all real);
`position_ids` `[B, T]` count real tokens per sample (used by RoPE).

Packed sequences (B = 1, `cu_seqlens` `[N + 1]` the sequence boundaries, positions restarting at 0 in each):
the model calls `mixer.forward_packed(x, position_ids=..., cu_seqlens=...)`. A mixer whose class sets
`packing = "native"` gets `cu_seqlens` in `forward` (attention and the recurrent mixers: their ops take
it or run per sequence); any other mixer (`packing = "split"`, the default) is run once per sequence,
which is always correct, only slower. Packed inputs have no padding mask and no cache.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, ClassVar

import torch
from torch import nn

from ...ops.checks import check_positive_int
from ..short_conv import ShortConvolution


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dim, computed in fp32 (float64 stays float64) and returned in x's dtype: under CUDA
    autocast `F.normalize` returns fp32, and the ops want q, k and v in one dtype."""
    return torch.nn.functional.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1).to(x.dtype)


def prenormalized(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k scaled to length √d per head (√d·x/‖x‖, d the head dim): the `qk_prenorm` option of the mixers whose
    feature maps (ELU+1, exp) would otherwise see raw projections, small at initialisation."""
    return tuple(q.shape[-1] ** 0.5 * unit_norm(x) for x in (q, k))


def set_parameter(param: nn.Parameter, value, init) -> None:
    """Set `param` to `value` (a tensor of its shape, or a number). `init` is transformers' guarded init module
    (the model's `_init_weights`: a weight that was loaded is left alone), or None at construction."""
    if not isinstance(value, torch.Tensor):
        value = torch.full_like(param, value)
    if init is None:
        with torch.no_grad():
            param.copy_(value)
    else:
        init.copy_(param, value)


def normal_parameter(param: nn.Parameter, std: float, init) -> None:
    """Draw `param` from N(0, std²); `init` as in `set_parameter`."""
    if init is None:
        with torch.no_grad():
            param.normal_(0.0, std)
    else:
        init.normal_(param, std=std)


def init_qk_scale(module: nn.Module, init) -> None:
    """(Re)initialise a QK-norm mixer's learned per-head scale `qk_scale` to √head_dim (`init`: the
    transformers init helper, or None at construction)."""
    set_parameter(module.qk_scale, math.sqrt(module.head_dim), init)


def _option_kind(default) -> tuple[str, Any] | None:
    """(description, test) of the values an option with this default takes; None: not checked here (an
    option whose default is None takes several kinds of value, checked by its mixer)."""
    if isinstance(default, bool):
        return "True or False", lambda v: isinstance(v, bool)
    if isinstance(default, Integral):
        return "an int", lambda v: isinstance(v, Integral) and not isinstance(v, bool)
    if isinstance(default, Real):
        return "a finite number", lambda v: (isinstance(v, Real) and not isinstance(v, bool)
                                             and math.isfinite(v))
    if isinstance(default, str):  # None switches some off (e.g. conv_activation): the mixer checks names
        return "a str or None", lambda v: v is None or isinstance(v, str)
    return None


class TokenMixer(nn.Module):
    #: the mechanism name used in `config.layer_types`
    mechanism: ClassVar[str] = ""
    #: hyper-parameters with their defaults; any config can override them via `mixer_kwargs`
    defaults: ClassVar[dict[str, Any]] = {}
    #: `{config format: {option: value}}`: options whose default changed in that format of the saved config
    #: (`lazoo.models.configuration_lazoo.CONFIG_FORMAT`), with the value configs saved before it were made with
    defaults_before: ClassVar[dict[int, dict[str, Any]]] = {}
    #: packed sequences: "native" = `forward` takes `cu_seqlens`; "split" = run once per sequence
    packing: ClassVar[str] = "split"
    #: options whose default is None and whose other values are positive ints (head counts, head dims)
    optional_int_options: ClassVar[tuple[str, ...]] = ()
    #: whether `forward` takes `output_attentions=True` and then returns `(output, weights [B, H, T, S])`: the
    #: softmax-type mixers; the others have no attention matrix (the model reports None for their layers)
    has_attention_weights: ClassVar[bool] = False

    def __init__(self, config, layer_idx: int, options: dict[str, Any], *, num_heads: int | None = None,
                 head_dim: int | None = None):
        """`num_heads` (None: the config's `num_attention_heads`) and `head_dim` (None: hidden_size / num_heads,
        which must then divide) let a mixer keep its own head layout."""
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads if num_heads is None else num_heads
        if head_dim is None:
            if config.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={config.hidden_size} must be divisible by the {self.num_heads} heads "
                                 f"(num_attention_heads, or the mixer's own head count)")
            head_dim = config.hidden_size // self.num_heads
        self.head_dim = head_dim
        self.options = options

    @classmethod
    def check_options(cls, options: dict[str, Any], prefix: str = "") -> None:
        """Clear errors for option names and value kinds, against `defaults` (plus `backend`: None or a
        name). `prefix` names where the options come from in the messages (e.g. "mixer_kwargs['vla']");
        empty for a mechanism config's typed fields, whose messages name the field alone. Value ranges are
        the mixer's own checks, at construction."""
        unknown = set(options) - set(cls.defaults) - {"backend"}
        if unknown:
            where = prefix or f"the {cls.mechanism!r} options"
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; "
                             f"known: {sorted(cls.defaults)} and 'backend'")
        for key, value in options.items():
            field = f"{prefix}[{key!r}]" if prefix else key
            if key == "backend":
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"{field} must be None or a backend name, got {value!r}")
                continue
            kind = _option_kind(cls.defaults[key])
            if key in cls.optional_int_options:
                kind = "None or a positive int", lambda v: v is None or (
                    isinstance(v, Integral) and not isinstance(v, bool) and v >= 1)
            if kind is not None and not kind[1](value):
                raise ValueError(f"{field} ({cls.mechanism} option) must be {kind[0]} "
                                 f"(default {cls.defaults[key]!r}), got {value!r}")

    def apply_qk_prenorm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as `prenormalized` makes them where the mixer's `qk_prenorm` option is on, else unchanged."""
        return prenormalized(q, k) if self.options.get("qk_prenorm") else (q, k)

    def check_positive_int(self, option: str, value=None) -> int:
        """Option `option` (or `value`) is a positive int, else a ValueError naming the mechanism and option."""
        return check_positive_int(self.mechanism, option, self.options[option] if value is None else value)

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None) -> torch.Tensor:
        raise NotImplementedError

    def forward_packed(self, hidden_states, *, position_ids, cu_seqlens) -> torch.Tensor:
        """Packed sequences `[1, T, hidden]` with boundaries `cu_seqlens` `[N + 1]`: no sequence sees another."""
        if self.packing == "native":
            return self(hidden_states, position_ids=position_ids, cu_seqlens=cu_seqlens)
        bounds = cu_seqlens.tolist()
        parts = [
            self(hidden_states[:, s:e], position_ids=None if position_ids is None else position_ids[:, s:e])
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s
        ]
        return torch.cat(parts, dim=1)

    # --- helpers shared by the mixers -------------------------------------------------------
    def add_qkvo_projections(self, hidden_size: int) -> None:
        """Bias-free q, k, v and output projections `hidden_size -> hidden_size`."""
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_heads, -1)

    @staticmethod
    def merge_heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:2], -1)

    def read_state(self, cache):
        return None if cache is None else cache.read_state(self.layer_idx)

    def write_state(self, cache, state):
        if cache is not None:
            cache.write_state(self.layer_idx, state, kv_length=self.kv_cache_length())

    def kv_cache_length(self) -> int | None:
        """Positions a KV-cache part of this mixer's state keeps (`window - 1`), or None when it keeps them all.
        A static cache holds such a part at this length (None: its max_cache_len)."""
        return None

    def keeps_every_position(self) -> bool:
        """Whether this mixer's cache holds a key-value part of every position seen (its size then grows with the
        length generated, and a static cache sizes it to `max_cache_len`)."""
        return False

    def _init_lazoo_parameters(self, init) -> None:
        """Initialise parameters that are not plain Linear/Embedding/Norm weights (called by the model's
        `_init_weights` with transformers' guarded init functions, so loaded weights are never overwritten)."""


class ShortConvProjections(nn.Module):
    """Optional short causal convolutions on q, k and v (one per projection), with their cache entries.
    `activation`: one for all, or a dict `{name: activation}`; `bias`: a learned bias in each."""

    def __init__(self, dims: dict[str, int], kernel_size: int, activation: str | None | dict = "silu",
                 bias: bool = False):
        super().__init__()
        acts = activation if isinstance(activation, dict) else dict.fromkeys(dims, activation)
        self.convs = nn.ModuleDict({name: ShortConvolution(d, kernel_size, acts[name], bias=bias)
                                    for name, d in dims.items()})

    def forward(self, tensors: dict[str, torch.Tensor], mask, state: dict | None, output_state: bool,
                cu_seqlens=None, backend=None):
        out, new_state = {}, {}
        for name, x in tensors.items():
            out[name], new_state[name] = self.convs[name](
                x, mask=mask, state=None if state is None else state[name], output_state=output_state,
                cu_seqlens=cu_seqlens, backend=backend,
            )
        return out, (new_state if output_state else None)
