"""The generation cache: per layer, whatever that layer's mixer needs (a dict of tensors; each mechanism's
registry entry, `lazoo.registry.Mechanism.state`, says what).

What a decoded token costs depends on the mixer. Softmax attention, and local-linear attention without a
window, keep the keys and values of every position seen: their cache, and the work per token, grow with the
sequence. Sliding-window attention, and local-linear attention with a window, keep the last `window - 1`
positions. The recurrent mixers keep a state whose size does not depend on the sequence length (S, z, A, the
VLA step counter, OVQ's dictionaries of at most `max_dict_size` entries, partial chunks and mini-batches,
short-convolution tails): O(1) memory and time per token in the sequence length. The cache also counts
positions processed and real tokens per sample (for RoPE positions under left padding).

It subclasses `transformers.Cache` so `generate` recognises it, but keeps its own storage: the base
class's layer objects change between transformers releases.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map
from transformers import Cache


def _map_batch(state, fn):
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, state)


class LazooCache(Cache):
    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        # no super().__init__(): the base constructor's arguments differ across transformers 5.x
        self.layers = []
        self.states: list[dict | None] = [None] * num_layers
        # per layer, the causal Memory Lobe's linear-attention state {"S", "z"} (lazoo.layers.memory_lobe)
        self.lobe_states: list[dict | None] = [None] * num_layers
        self.seen_positions = 0  # positions processed, pads included
        self.real_tokens: torch.Tensor | None = None  # [B] real tokens seen per sample

    def __len__(self):
        return len(self.states)

    def __repr__(self):
        return f"LazooCache(layers={len(self.states)}, seen_positions={self.seen_positions})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_positions

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seen_positions + query_length, 0

    @property
    def is_initialized(self) -> bool:
        return self.real_tokens is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.real_tokens is None else int(self.real_tokens.shape[0])

    def _apply(self, fn):
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
        self.states = [None] * len(self.states)
        self.lobe_states = [None] * len(self.states)
        self.seen_positions = 0
        self.real_tokens = None

    def crop(self, max_length: int):
        raise NotImplementedError("a recurrent state cannot be cropped; re-run the prompt instead")
