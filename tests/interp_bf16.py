"""bf16 in the Triton interpreter as a GPU computes it, for kernel tests with bf16 inputs.

The interpreter keeps bf16 tensors as their raw 16 bits (numpy has no bf16): its matrix product multiplies those
bits as integers (garbage), and it converts float32 to bf16 by truncation where a GPU rounds to nearest even.
``gpu_like_bf16()`` patches both for the duration of a ``with`` block: a product's bf16 operands are widened to
float32 exactly (a GPU multiplies them exactly and accumulates in float32) and float32 -> bf16 rounds to nearest
even. tf32 products stay float32 (the interpreter ignores ``input_precision``)."""

from __future__ import annotations

import contextlib

import numpy as np


def _widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> the float32 values they hold (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (finite values)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)  # keeps the shape of a scalar (0-d)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@contextlib.contextmanager
def gpu_like_bf16():
    import triton.language as tl
    from triton.runtime import interpreter

    builder, handle = interpreter.InterpreterBuilder, interpreter.TensorHandle
    saved = {name: getattr(builder, name) for name in ("cast_impl", "create_dot")}
    cast, dot = saved["cast_impl"], saved["create_dot"]

    def cast_impl(self, src, dst_type):
        pair = (src.dtype.scalar, dst_type.scalar)
        if pair == (tl.bfloat16, tl.float32):
            return handle(_widen(src.data), tl.float32)
        if pair == (tl.float32, tl.bfloat16):
            return handle(_round(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    def create_dot(self, a, b, acc, *args):
        a, b = (handle(_widen(x.data), tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, acc, *args)

    builder.cast_impl, builder.create_dot = cast_impl, create_dot
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)
