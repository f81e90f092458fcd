"""`generate`'s stopping check without a wait for the device at every token, for lazoo's caches on CUDA.

transformers' decoding loop decides whether to stop by reading `unfinished_sequences.max() == 0` back to the host
after each token, so the host cannot queue the next step while the device runs this one: a step costs the host's
work plus the device's, in series. Its `DeferredStopCheck` reads that flag one step late instead (the loop then runs
one step too many once every sequence has stopped, and `generate` removes that step's token), which transformers
allows on `mps` only, since the extra step must be taken back from a cache that `generate` hands back.

lazoo allows it on CUDA too where nothing needs taking back: a lazoo cache that `generate` made and drops (the user
passed no cache and asked for no `return_dict_in_generate`); the extra step then changes only a state nobody reads.
A cache the user passed or gets back keeps the check of every token, since a recurrent state cannot go back.
transformers releases without `DeferredStopCheck` keep their own loop unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.generation import utils as generation_utils

from .cache import LazooCache

#: the devices where a lazoo cache's stopping check is read one step late (the CPU gains nothing: it waits anyway)
DEFERRED_STOP_DEVICES = ("cuda",)

_TRANSFORMERS_CHECK = getattr(generation_utils, "DeferredStopCheck", None)


def lazoo_cache_defers(device: torch.device, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
    """Whether the stopping check of a `generate` on `device` with `cache` may be read one step late by lazoo's
    rule: a lazoo cache that `generate` drops, on a device of `DEFERRED_STOP_DEVICES`, outside assisted decoding."""
    return (isinstance(cache, LazooCache) and not cache_is_returned and not is_assistant
            and torch.device(device).type in DEFERRED_STOP_DEVICES)


if _TRANSFORMERS_CHECK is not None:
    class LazooDeferredStopCheck(_TRANSFORMERS_CHECK):
        """transformers' deferred check, allowed also where `lazoo_cache_defers` says so; transformers' own rule
        for every other cache."""

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant) -> bool:
            return (lazoo_cache_defers(device, cache, cache_is_returned, is_assistant)
                    or _TRANSFORMERS_CHECK.is_supported(device, cache, cache_is_returned, is_assistant))
else:
    LazooDeferredStopCheck = None


@contextlib.contextmanager
def deferred_stop_for_lazoo_caches():
    """Within: transformers' decoding loop reads a lazoo cache's stopping check one step late where
    `lazoo_cache_defers` allows it. It names `DeferredStopCheck` from its module, so the class is swapped there for
    the call and put back after; any other cache gets transformers' rule, also from a call running alongside."""
    swap = LazooDeferredStopCheck is not None and generation_utils.DeferredStopCheck is _TRANSFORMERS_CHECK
    if swap:
        generation_utils.DeferredStopCheck = LazooDeferredStopCheck
    try:
        yield
    finally:
        if swap:
            generation_utils.DeferredStopCheck = _TRANSFORMERS_CHECK
