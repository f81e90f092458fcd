"""Small helpers shared by the Triton kernels (keep this module tiny and stable)."""

from __future__ import annotations

import os

import triton


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_ready() -> bool:
    """True when the interpreter can run kernels in this process.

    The variable must have been set before ``triton`` was first imported: Triton's own helpers
    (``tl.sum``, ``tl.cdiv``, ...) are defined at that import, and a compiled-mode helper called
    from an interpreted kernel fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
    """
    if not is_interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard as std

    return isinstance(std.cdiv, InterpretedFunction)


def autotune(configs, key, **kwargs):
    """``triton.autotune`` on a GPU; under the interpreter, the first config without benchmarking."""
    if not is_interpreting():
        return triton.autotune(configs=configs, key=key, **kwargs)

    def decorator(fn):
        return _FirstConfig(fn, configs[0])

    return decorator


class _FirstConfig:
    """Launch ``fn`` with one fixed config's meta-parameters (what autotune would pass)."""

    def __init__(self, fn, config):
        self.fn, self.config = fn, config

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = {**self.config.kwargs, **kwargs}
            if callable(grid):
                g = grid(meta)
            else:
                g = grid
            return self.fn[g](*args, **meta)

        return launch


def next_pow2(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum) (tile sizes for ``tl.dot`` are at least 16)."""
    return max(triton.next_power_of_2(int(n)), minimum)
