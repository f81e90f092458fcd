"""Pieces the one-kernel decode steps share (lazoo.kernels.delta_step, lazoo.kernels.mamba2_step): a causal
depthwise convolution at one new input, the shift of its state by that input, and the host-side views of their
inputs. A conv state is ``[B, W − 1, C]``: the last W − 1 inputs of C channels, the newest last."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Triton's name of each input dtype the steps take
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
             torch.float64: tl.float64}


@triton.jit
def conv_silu(x, st, w, bias, b, c, m_c, st_b, C, W: tl.constexpr, WP: tl.constexpr, HAS_BIAS: tl.constexpr,
              DT: tl.constexpr, CT: tl.constexpr):
    """The causal depthwise convolution of channels ``c`` at the new input ``x`` (in CT; zero at a pad) against
    the last W − 1 inputs (``st`` ``[B, W − 1, C]``, batch stride ``st_b``; WP = W − 1 rounded up to a power of
    two), plus the bias, SiLU, rounded to DT as an unfused layer stores it."""
    r = tl.arange(0, WP)
    m_r = (r < W - 1)[:, None] & m_c[None, :]
    rows = tl.load(st + b * st_b + r[:, None] * C + c[None, :], mask=m_r, other=0)
    taps = tl.load(w + c[None, :] * W + r[:, None], mask=m_r, other=0).to(CT)
    acc = tl.sum(taps * rows.to(CT), 0) + tl.load(w + c * W + (W - 1), mask=m_c, other=0).to(CT) * x
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=m_c, other=0).to(CT)
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(DT).to(CT)


@triton.jit
def shift_conv_state(x, st, b, c, m_c, st_b, C, W: tl.constexpr, WP: tl.constexpr, st_out, so_b):
    """Channels ``c`` of the conv state shifted by one, the new input ``x`` last, written to ``st_out`` (may be
    ``st``: the caller owns these channels, and a barrier keeps every read before the first write, since threads
    that hold copies of one element would otherwise race)."""
    r = tl.arange(0, WP)
    m_next = (r < W - 2)[:, None] & m_c[None, :]
    later = tl.load(st + b * st_b + (r[:, None] + 1) * C + c[None, :], mask=m_next, other=0)
    tl.debug_barrier()
    tl.store(st_out + b * so_b + r[:, None] * C + c[None, :], later, mask=m_next)
    tl.store(st_out + b * so_b + (W - 2) * C + c, x.to(st_out.dtype.element_ty), mask=m_c)


@triton.jit
def conv_silu_shift(x, st, w, bias, b, c, m_c, real, st_b, C, W: tl.constexpr, WP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, st_out, so_b, DT: tl.constexpr, CT: tl.constexpr):
    """``conv_silu`` of channels ``c`` this program owns, then their state shifted (``shift_conv_state``); a pad
    (``real`` False) enters as a zero input."""
    x = tl.where(real, x, 0.0)
    y = conv_silu(x, st, w, bias, b, c, m_c, st_b, C, W, WP, HAS_BIAS, DT, CT)
    shift_conv_state(x, st, b, c, m_c, st_b, C, W, WP, st_out, so_b)
    return y


def rows(op: str, x: torch.Tensor, width: int, name: str) -> tuple[torch.Tensor, int]:
    """``x`` ``[B, 1, width]`` or ``[B, width]`` as rows of unit channel stride, and its row stride."""
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] != width:
        raise ValueError(f"{op}: {name} has {x.shape[1]} features per token, expected {width}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, x.stride(0)


def conv_rows(op: str, state: torch.Tensor, name: str) -> torch.Tensor:
    """A conv state ``[B, W − 1, C]`` whose rows and channels are contiguous (its batch stride is free)."""
    if state.stride(2) != 1 or state.stride(1) != state.shape[2]:
        raise ValueError(f"{op}: the conv state of {name} must have contiguous rows, got strides "
                         f"{tuple(state.stride())}")
    return state
