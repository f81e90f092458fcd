"""Facts about the process the Triton kernels run in (the interpreter, the device) and tile sizes; tests import
it without defining a kernel. The kernel machinery that modules share is listed in ``lazoo.kernels``."""

from __future__ import annotations

import os

import torch
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
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.cdiv, InterpretedFunction)


def device_unsupported(x) -> str | None:
    """Why a kernel cannot run on ``x``'s device in this process (None when it can): CUDA, or the CPU
    under an interpreter that was switched on before triton's import."""
    if x.device.type == "cpu":
        if not is_interpreting():
            return "CPU tensors need TRITON_INTERPRET=1 (set before triton is imported)"
        if not interpreter_ready():
            return "TRITON_INTERPRET=1 was set after triton was imported; set it before"
        return None
    if x.device.type != "cuda":
        return f"the Triton kernel runs on CUDA tensors, not {x.device.type}"
    return None


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum) (tile sizes for ``tl.dot`` are at least 16)."""
    return max(triton.next_power_of_2(int(n)), minimum)
