"""The generation cache: per layer, whatever that layer's mixer needs (a dict of tensors; each mechanism's
registry entry, `lazoo.registry.Mechanism.state`, says what).

What a decoded token costs depends on the mixer. Softmax attention, and local-linear attention without a
window, keep the keys and values of every position seen: their cache, and the work per token, grow with the
sequence. Sliding-window attention, and local-linear attention with a window, keep the last `window - 1`
positions. The recurrent mixers keep a state whose size does not depend on the sequence length (S, z, A, the
VLA step counter, OVQ's dictionaries of at most `max_dict_size` entries, partial chunks and mini-batches,
short-convolution tails): O(1) memory and time per token in the sequence length. The cache also counts
positions processed and real tokens per sample (for RoPE positions under left padding).

A static cache (`LazooCache(n, static=True, max_cache_len=L)`, or `generate(..., cache_implementation="static")`)
keeps every tensor at one shape and one address from the first forward on: later forwards copy their new states
into the same buffers, key-value caches are kept at a fixed length (the window, or `max_cache_len` positions for
layers that keep every position, with masked slots in front), and the position count is a device tensor. So a
decode step reads no Python number that changes, and can be compiled and captured in a CUDA graph
(`is_compileable`: `generate` then compiles its decode steps on CUDA). The tokens are those of the dynamic cache.

It is a `transformers.Cache` made of per-layer cache objects (`cache.layers`), one per model layer, so transformers'
own code paths (beam reordering, batch expansion and selection, cropping, `get_seq_length`, reset) run on it layer by
layer. A layer whose mixer keeps keys and values (softmax, sliding-window and local-linear attention) is a
`LazooAttentionLayer`, a `transformers.cache_utils.CacheLayerMixin` whose `keys` and `values` read
`[B, heads, positions, head_dim]` as transformers' attention layers do; any other is a `LazooStateLayer`, a
`LinearAttentionCacheLayerMixin` (transformers' kind for linear-attention and Mamba layers) whose `recurrent_states`
and `conv_states` number the state's tensors. A layer takes its kind from the first state written to it. The layer
objects keep no tensors of their own: they read and edit the layer's entry of `cache.states` (and
`cache.lobe_states`), the dicts the mixers write, so a state's layout and a decode step's work are the same as
without them. A layer without a token mixer (a `layer_types` entry None) never writes a state: its entry stays empty,
and it neither blocks nor takes part in a crop.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ..ops.softmax import fit_kv_cache

_KV_KEYS = {"k", "v", "mask"}


def _map_batch(state, fn):
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, state)


def _fit_kv_nodes(state, length: int | None, where: str):
    """`state` with every KV-cache node (a dict of exactly k, v and mask) at `length` positions."""
    if isinstance(state, dict):
        if set(state) == _KV_KEYS and isinstance(state["k"], torch.Tensor):
            if length is None:
                raise ValueError(f"{where} keeps every position it sees: a static cache needs max_cache_len "
                                 "(LazooCache(..., static=True, max_cache_len=L); generate sets it to max_length)")
            return fit_kv_cache(state, length)
        return {key: _fit_kv_nodes(value, length, where) for key, value in state.items()}
    return state


def _in_place(fn, t: torch.Tensor) -> torch.Tensor:
    new = fn(t)
    return t.copy_(new) if new.shape == t.shape else new


def _static_buffers(state):
    """Contiguous copies of the tensors of `state`, marked as static addresses for torch.compile."""
    def own(t):
        t = t.clone(memory_format=torch.contiguous_format)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(t)
        return t

    return _map_batch(state, own)


def _ordered_like(ref, x):
    """`x` with each dict's keys in the order of `ref`'s dict at the same place (where both hold the same keys): a
    state is the same state whatever order a form built its dict in."""
    if isinstance(ref, dict) and isinstance(x, dict) and set(ref) == set(x):
        return {key: _ordered_like(ref[key], x[key]) for key in ref}
    if isinstance(ref, (list, tuple)) and isinstance(x, (list, tuple)) and len(ref) == len(x):
        return type(x)(_ordered_like(r, y) for r, y in zip(ref, x))
    return x


def _copy_into(old, new, where: str):
    """Copy the tensors of `new` into those of `old` (same structure, dicts matched by key, and same shapes);
    returns `old`."""
    old_leaves, old_spec = tree_flatten(old)
    new_leaves, new_spec = tree_flatten(_ordered_like(old, new))
    if old_spec != new_spec:
        raise ValueError(f"static cache, {where}: the new state has a different structure from the cached one")
    for a, b in zip(old_leaves, new_leaves):
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape:
                raise ValueError(f"static cache, {where}: a state tensor of shape {tuple(a.shape)} would become "
                                 f"{tuple(b.shape)}; a static cache keeps its shapes (batch size, max_cache_len): "
                                 "start a new cache")
            if a is not b:
                a.copy_(b)
    return tree_unflatten(old_leaves, old_spec)


def _kv_node(state):
    """The KV-cache dict {k, v, mask} of a layer's state (the state itself, or its "op" part with no convolution
    tail: local-linear attention), or None for any other state."""
    for node in (state, state.get("op") if isinstance(state, dict) and state.get("conv") is None else None):
        if isinstance(node, dict) and set(node) == _KV_KEYS and isinstance(node["k"], torch.Tensor):
            return node
    return None


class _LayerEntry:
    """What both kinds of layer object share: they stand for entry `layer_idx` of their cache, and edit it there."""

    def __init__(self, cache: LazooCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx

    def __repr__(self):
        return f"{type(self).__name__}(layer_idx={self.layer_idx})"

    @property
    def state(self):
        """The layer's state as its mixer wrote it (None before the first write)."""
        return self.cache.read_state(self.layer_idx)

    @property
    def is_initialized(self) -> bool:
        return self.cache._filled[self.layer_idx]

    @property
    def is_compileable(self) -> bool:
        return self.cache.static

    def _edit(self, fn) -> None:
        """Apply `fn` to every tensor of the layer's state and Memory Lobe state (in place where a static cache keeps
        the shape: compiled decode steps read the buffers' addresses)."""
        if self.cache.static:
            fn = functools.partial(_in_place, fn)
        i = self.layer_idx
        self.cache.states[i] = _map_batch(self.cache.states[i], fn)
        self.cache.lobe_states[i] = _map_batch(self.cache.lobe_states[i], fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._edit(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._edit(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._edit(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        """Forget this layer's sequence (a filled static cache keeps the buffers, to refill them)."""
        i = self.layer_idx
        self.cache._filled[i] = self.cache._lobe_filled[i] = False
        if not self.cache.static or self.cache.real_tokens is None:
            self.cache.states[i] = self.cache.lobe_states[i] = None

    def get_seq_length(self) -> int:
        """Positions the cache has seen, pads included (as transformers' sliding-window layers count them)."""
        return self.cache.seen_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen_positions + query_length, 0

    def offload(self):
        raise NotImplementedError("lazoo's cache is not offloaded: it keeps every layer on the model's device")

    prefetch = offload


class LazooAttentionLayer(_LayerEntry, CacheLayerMixin):
    """A layer that keeps the keys and values of the positions it sees (softmax, sliding-window and local-linear
    attention): `keys` and `values` read them as `[B, kv_heads, positions, head_dim]` (a view of the mixer's
    `[B, positions, kv_heads, head_dim]` state) and writing them stores them back there; `mask` marks the real
    positions. A layer that keeps every position, in a dynamic cache, can be cropped."""

    def __init__(self, cache: LazooCache, layer_idx: int, kept_positions: int | None = None):
        _LayerEntry.__init__(self, cache, layer_idx)
        self.kept_positions = kept_positions  # None: every position; else the window - 1 last ones

    @property
    def is_sliding(self) -> bool:
        return self.kept_positions is not None

    def _node(self):
        return _kv_node(self.state)

    def _part(self, name):
        node = self._node()
        return None if node is None else node[name].transpose(1, 2)

    def _set_part(self, name, value):
        node = self._node()
        if node is None:
            raise ValueError(f"layer {self.layer_idx} holds no keys and values yet")
        node[name] = value.transpose(1, 2)

    keys = property(lambda self: self._part("k"), lambda self, value: self._set_part("k", value))
    values = property(lambda self: self._part("v"), lambda self, value: self._set_part("v", value))

    @property
    def mask(self) -> torch.Tensor | None:
        """`[B, positions]` bool: which kept positions are real tokens (False: a pad, or an empty slot)."""
        node = self._node()
        return None if node is None else node["mask"]

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # the state is made by the layer's first write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append keys and values `[B, kv_heads, T, head_dim]` of T real positions (transformers' layer interface;
        lazoo's mixers write their whole state through `LazooCache.write_state`); returns all keys and values."""
        new = {"k": key_states.transpose(1, 2), "v": value_states.transpose(1, 2),
               "mask": torch.ones(key_states.shape[0], key_states.shape[2], dtype=torch.bool,
                                  device=key_states.device)}
        node = self._node()
        if node is not None:
            new = {name: torch.cat([node[name], x], dim=1) for name, x in new.items()}
        if self.kept_positions is not None:
            new = {name: x[:, max(0, x.shape[1] - self.kept_positions):] for name, x in new.items()}
        self.cache.write_state(self.layer_idx, new, kv_length=self.kept_positions)
        return self.keys, self.values

    def get_max_length(self) -> int:
        node = self._node()
        return node["k"].shape[1] if self.cache.static and node is not None else -1

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can take positions back: every position is kept (no window), in a dynamic cache."""
        return self.kept_positions is None and not self.cache.static

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (a negative count, as transformers' layers take it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        node = self._node()
        if not tokens_to_remove or node is None:
            return
        if not self.is_croppable:
            raise ValueError(f"layer {self.layer_idx} keeps only the last {self.kept_positions} positions, or a static "
                             "cache's fixed length: it cannot be cropped")
        for name in _KV_KEYS:
            node[name] = node[name][:, :tokens_to_remove]


class LazooStateLayer(_LayerEntry, LinearAttentionCacheLayerMixin):
    """A layer whose mixer keeps a state of fixed size (the recurrent mixers: S, z, A, counters, dictionaries, short
    convolution tails, ...). `recurrent_states` numbers the tensors of the state, `conv_states` those of its short
    convolution tails (`conv`), in a fixed order; both read the cache's tensors. A state cannot go back: no crop."""

    record_past = False
    is_croppable = False

    def __init__(self, cache: LazooCache, layer_idx: int):
        _LayerEntry.__init__(self, cache, layer_idx)

    def _numbered(self, conv: bool) -> dict[int, torch.Tensor]:
        state = self.state
        if not isinstance(state, dict):
            part = None if conv else state
        else:
            part = state.get("conv") if conv else {k: v for k, v in state.items() if k != "conv"}
        leaves = [t for t in tree_leaves(part) if isinstance(t, torch.Tensor)]
        return dict(enumerate(leaves))

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:
        return self._numbered(conv=False)

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        return self._numbered(conv=True)

    @property
    def number_of_states(self) -> int:
        return max(len(self.recurrent_states), 1)

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return dict.fromkeys(range(self.number_of_states), self.is_initialized)

    is_recurrent_states_initialized = has_previous_state

    @property
    def is_conv_states_initialized(self) -> dict[int, bool]:
        return dict.fromkeys(range(self.number_of_states), self.is_initialized and bool(self.conv_states))

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass  # the state is made by the layer's first write

    def _whole_state_only(self, *args, **kwargs):
        raise NotImplementedError("a lazoo layer's state is written whole, by its mixer, through "
                                  "LazooCache.write_state")

    update_conv_state = update_recurrent_state = _whole_state_only

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove and self.is_initialized:  # (a layer without a token mixer holds nothing to crop)
            raise ValueError(f"layer {self.layer_idx} keeps a recurrent state, which cannot be cropped (it does not "
                             "keep the positions it has seen); re-run the prompt instead")

    def activate_past_recording(self):
        raise NotImplementedError("a recurrent lazoo state keeps no past states to go back to")


class LazooCache(Cache):
    def __init__(self, num_layers: int, *, static: bool = False, max_cache_len: int | None = None):
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        self.static = bool(static)
        self._max_cache_len = max_cache_len
        self.states: list[dict | None] = [None] * num_layers
        # per layer, the causal Memory Lobe's linear-attention state {"S", "z"} (lazoo.layers.memory_lobe)
        self.lobe_states: list[dict | None] = [None] * num_layers
        self._filled = [False] * num_layers  # whether states[i] holds this sequence's state (after a reset, a
        self._lobe_filled = [False] * num_layers  # static cache keeps its buffers but they hold nothing yet)
        self._seen = 0  # positions processed, pads included (a 0-d device tensor once a static cache is filled)
        self.real_tokens: torch.Tensor | None = None  # [B] real tokens seen per sample
        self._kinds_set: set[int] = set()  # the layers whose object has the kind of their state
        super().__init__(layers=[LazooStateLayer(self, i) for i in range(num_layers)])

    @property
    def max_cache_len(self) -> int | None:
        """Positions a static cache keeps for layers that keep every position (None: not set)."""
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        return self.static

    @property
    def is_linear(self) -> list[bool]:
        # transformers turns the attention mask of a compileable cache into 4-D masks unless every layer is
        # "linear"; lazoo models read the 2-D mask of the new tokens themselves
        return [True] * len(self.states)

    def __len__(self):
        return len(self.states)

    def __repr__(self):
        kind = f", static=True, max_cache_len={self.max_cache_len}" if self.static else ""
        return f"LazooCache(layers={len(self.states)}{kind}, seen_positions={self.seen_positions})"

    @property
    def seen_positions(self) -> int:
        """Positions processed so far, pads included (a host read of the device count for a static cache)."""
        return int(self._seen)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_positions

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len if self.static and self.max_cache_len else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seen_positions + query_length, 0

    @property
    def is_initialized(self) -> bool:
        return self.real_tokens is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.real_tokens is None else int(self.real_tokens.shape[0])

    # --- reads and writes (the mixers and the model) ------------------------------------------------
    def read_state(self, layer_idx: int):
        """A layer's state, or None before its first write (since the last `reset`)."""
        return self.states[layer_idx] if self._filled[layer_idx] else None

    def read_lobe_state(self, layer_idx: int):
        return self.lobe_states[layer_idx] if self._lobe_filled[layer_idx] else None

    def write_state(self, layer_idx: int, state, kv_length: int | None = None) -> None:
        """Store a layer's new state. A static cache copies it into the layer's buffers (made on the first
        write), with its KV-cache parts at `kv_length` positions (None: `max_cache_len`). The first state a layer
        gets sets the kind of its layer object (`LazooAttentionLayer` for keys and values, else `LazooStateLayer`)."""
        self.states[layer_idx] = self._stored(self.states[layer_idx], state, kv_length, f"layer {layer_idx}")
        self._filled[layer_idx] = True
        if layer_idx not in self._kinds_set:
            self._set_kind(layer_idx, kv_length)

    def _set_kind(self, layer_idx: int, kv_length: int | None) -> None:
        if _kv_node(self.states[layer_idx]) is not None:
            self.layers[layer_idx] = LazooAttentionLayer(self, layer_idx, kv_length)
        self._kinds_set.add(layer_idx)

    def write_lobe_state(self, layer_idx: int, state) -> None:
        """Store a layer's Memory Lobe state (in place for a static cache)."""
        where = f"layer {layer_idx} (memory lobe)"
        self.lobe_states[layer_idx] = self._stored(self.lobe_states[layer_idx], state, None, where)
        self._lobe_filled[layer_idx] = True

    def _stored(self, old, state, kv_length, where: str):
        if not self.static:
            return state
        state = _fit_kv_nodes(state, self.max_cache_len if kv_length is None else kv_length, where)
        return _static_buffers(state) if old is None else _copy_into(old, state, where)

    def advance(self, length: int, real_counts: torch.Tensor) -> None:
        """Count a forward of `length` positions with `real_counts` `[B]` real tokens per sample."""
        if not self.static:
            self._seen += length
            self.real_tokens = real_counts if self.real_tokens is None else self.real_tokens + real_counts
        elif self.real_tokens is None:
            self.real_tokens = _static_buffers(real_counts)
            self._seen = _static_buffers(torch.full((), self._seen + length, dtype=torch.long,
                                                    device=real_counts.device))
        else:
            self.real_tokens.add_(real_counts)
            self._seen.add_(length)

    # --- batch edits (beam search, expansion), through transformers' per-layer code paths -------------
    def _edit_counts(self, fn) -> None:
        if self.real_tokens is not None:
            self.real_tokens = _in_place(fn, self.real_tokens) if self.static else fn(self.real_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Select batch entries (beam search)."""
        super().reorder_cache(beam_idx)
        self._edit_counts(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._edit_counts(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._edit_counts(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        """Forget the sequence. A filled static cache keeps its buffers (compiled decode steps read their addresses)
        and refills them from the next prompt on; other caches drop their states."""
        super().reset()
        if self.static and self.real_tokens is not None:
            self._seen.zero_()
            self.real_tokens.zero_()
            return
        self._seen = 0
        self.real_tokens = None

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can take positions back: a dynamic cache whose every layer keeps all the positions it has
        seen (full softmax attention, local-linear attention without a window) and no Memory Lobe state. A layer
        that holds no state (one without a token mixer) has nothing to crop."""
        stateless = (lambda layer: self.real_tokens is not None and not layer.is_initialized)  # after a forward
        return not self.static and not any(self._lobe_filled) and all(
            layer.is_croppable or stateless(layer) for layer in self.layers)

    def crop(self, max_length: int):
        """Keep the first `max_length` positions (a negative value: remove `-max_length` positions), through each
        layer's `crop`. Only a cache whose every layer keeps its positions can do it (`is_croppable`); a recurrent
        state, a window that dropped positions or a static cache's fixed length cannot go back."""
        remove = -max_length if max_length < 0 else self.seen_positions - max_length
        if remove <= 0:
            return
        if remove > self.seen_positions:
            raise ValueError(f"crop: the cache has seen {self.seen_positions} positions, cannot remove {remove}")
        if not self.is_croppable:
            raise ValueError("this cache cannot be cropped: a recurrent state (or a window, a Memory Lobe, a static "
                             "cache's fixed length) does not keep the positions it has seen; re-run the prompt instead")
        masks = [layer.mask for layer in self.layers if layer.is_initialized]
        super().crop(-remove)
        self._seen -= remove
        if self.real_tokens is not None and masks:
            self.real_tokens = self.real_tokens - masks[0][:, -remove:].sum(1).to(self.real_tokens.dtype)
