"""transformers' models as references: on their own PyTorch forms, not the kernels they bind where fla or
causal-conv1d import (the suite puts fla on the path for the fla converter tests; transformers then binds fla's
Triton kernels, which need a GPU)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def unwrapped_kernels(module, names):
    """Inside the block, each function `names` of transformers' modeling `module` that transformers wrapped to take a
    kernel where one imports is its own PyTorch form (`__wrapped__`)."""
    saved = {name: getattr(module, name) for name in names if hasattr(module, name)}
    try:
        for name, fn in saved.items():
            setattr(module, name, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
