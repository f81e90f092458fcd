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

It subclasses `transformers.Cache` so `generate` recognises it, but keeps its own storage: the base
class's layer objects change between transformers releases.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from transformers import Cache

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


class LazooCache(Cache):
    is_croppable = False

    def __init__(self, num_layers: int, *, static: bool = False, max_cache_len: int | None = None):
        # no super().__init__(): the base constructor's arguments differ across transformers 5.x
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        self.layers = []
        self.static = bool(static)
        self._max_cache_len = max_cache_len
        self.states: list[dict | None] = [None] * num_layers
        # per layer, the causal Memory Lobe's linear-attention state {"S", "z"} (lazoo.layers.memory_lobe)
        self.lobe_states: list[dict | None] = [None] * num_layers
        self._filled = [False] * num_layers  # whether states[i] holds this sequence's state (after a reset, a
        self._lobe_filled = [False] * num_layers  # static cache keeps its buffers but they hold nothing yet)
        self._seen = 0  # positions processed, pads included (a 0-d device tensor once a static cache is filled)
        self.real_tokens: torch.Tensor | None = None  # [B] real tokens seen per sample

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
        write), with its KV-cache parts at `kv_length` positions (None: `max_cache_len`)."""
        self.states[layer_idx] = self._stored(self.states[layer_idx], state, kv_length, f"layer {layer_idx}")
        self._filled[layer_idx] = True

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

    # --- batch edits (beam search, expansion) ------------------------------------------------------
    def _apply(self, fn):
        if self.static:  # keep the buffers whose shape stays: compiled decode steps read their addresses
            fn = functools.partial(_in_place, fn)
        self.states = [_map_batch(s, fn) for s in self.states]
        self.lobe_states = [_map_batch(s, fn) for s in self.lobe_states]
        if self.real_tokens is not None:
            self.real_tokens = fn(self.real_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Select batch entries (beam search)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        self._apply(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int):
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        """Forget the sequence. A filled static cache keeps its buffers (compiled decode steps read their addresses)
        and refills them from the next prompt on; other caches drop their states."""
        self._filled = [False] * len(self.states)
        self._lobe_filled = [False] * len(self.states)
        if self.static and self.real_tokens is not None:
            self._seen.zero_()
            self.real_tokens.zero_()
            return
        self.states = [None] * len(self.states)
        self.lobe_states = [None] * len(self.states)
        self._seen = 0
        self.real_tokens = None

    def crop(self, max_length: int):
        raise NotImplementedError("a recurrent state cannot be cropped; re-run the prompt instead")
