"""Tables derived from a tensor kept on that tensor: a model hands every layer the same ``cu_seqlens``, so the
host reads the boundaries back (a wait for the GPU) and builds the chunk tables once a step, not once a layer.
Imports no Triton (the ops' checks use it)."""

from __future__ import annotations

import torch

#: False: build every call (as before the tables were kept; ``experiments/packed_host_reads.py`` times both)
KEEP_TABLES = True


def cached_on(t: torch.Tensor, key, build):
    """``build()``, kept on ``t`` under ``key`` until ``t`` is changed in place (its version counter moves). Not
    kept while torch.compile traces or a CUDA graph is captured (what is built there belongs to that graph), nor on
    an inference-mode tensor (it has no version counter)."""
    if (not KEEP_TABLES or torch.compiler.is_compiling() or t.is_inference()
            or (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return build()
    store = t.__dict__.setdefault("_lazoo_derived", {})
    version, value = store.get(key, (None, None))
    if version != t._version:
        value = build()
        store[key] = (t._version, value)
    return value
