"""Tile helpers of the (gated) delta rule's Triton kernels (``delta``, ``delta_split``): masked loads of a chunk's
rows, β and the cumulative log decay, and the chunk-parallel kernels' program ids."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_acc(a, b, acc, DT: tl.constexpr, PREC: tl.constexpr):
    """``acc + a @ b`` accumulated in place."""
    return tl.dot(a.to(DT), b.to(DT), acc, input_precision=PREC)


@triton.jit
def load_raw(ptr, row0, eos, stride, col0, ncols, R: tl.constexpr, BC: tl.constexpr):
    """Rows ``row0 + [0, R)`` (masked to ``< eos``), columns ``col0 + [0, BC)`` (masked to ``< ncols``)
    of a row-major tensor with row stride ``stride``, in its storage dtype (zeros outside): only for
    dot operands. The (int64) row offset goes into the scalar base pointer; tile offsets stay int32."""
    r = tl.arange(0, R)
    c = col0 + tl.arange(0, BC)
    if ncols % BC == 0:  # no column mask: keeps the mask constant along rows, so loads vectorise
        m = (r < eos - row0)[:, None]
    else:
        m = (r < eos - row0)[:, None] & (c < ncols)[None, :]
    return tl.load(ptr + row0 * stride + (r[:, None] * stride + c[None, :]), mask=m, other=0)


@triton.jit
def load_tile(ptr, row0, eos, stride, col0, ncols, R: tl.constexpr, BC: tl.constexpr):
    """``load_raw`` cast to fp32 (for elementwise arithmetic)."""
    return load_raw(ptr, row0, eos, stride, col0, ncols, R, BC).to(tl.float32)


@triton.jit
def load_vec(ptr, row0, eos, stride, R: tl.constexpr):
    r = tl.arange(0, R)
    return tl.load(ptr + row0 * stride + r * stride, mask=r < eos - row0, other=0).to(tl.float32)


@triton.jit
def load_factor(beta, row0, eos, H: tl.constexpr, R: tl.constexpr, HAS_W: tl.constexpr):
    """β of R rows (ones when the write keys are given)."""
    if HAS_W:
        return tl.full([R], 1.0, tl.float32)
    else:
        return load_vec(beta, row0, eos, H, R)


@triton.jit
def chunk_info(chunks, cu, i_c):
    """(start token, end of its sequence) of global chunk ``i_c``."""
    i_n = tl.load(chunks + i_c * 2).to(tl.int64)
    t0 = tl.load(chunks + i_c * 2 + 1).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    return t0, eos


@triton.jit
def parallel_ids(NB: tl.constexpr, H: tl.constexpr):
    """(chunk, block, head) of a program of the chunk-parallel kernels' one-axis grid of NT·NB·H programs. The head
    varies fastest: the programs of one chunk run together, so they read one contiguous stretch of every ``[TT, H,
    d]`` tensor, and the value heads of one key head (grouped value heads) find its q and k rows in L2."""
    pid = tl.program_id(0)
    return pid // (NB * H), (pid // H) % NB, pid % H


@triton.jit
def gate(Gc, i_h, t0, eos, H: tl.constexpr, C: tl.constexpr):
    """(G of the chunk's rows, G of its last valid row). Rows past the end of the sequence take the
    last valid row's G (as if their g were 0): with a fast decay G reaches -100s inside one chunk, and
    a pad row with G = 0 would make exp(G_pad - G_i) overflow (inf * 0 = NaN in the products)."""
    r = tl.arange(0, C)
    last = tl.minimum(t0 + C, eos) - 1
    g_last = tl.load(Gc + last * H + i_h).to(tl.float32)
    b_G = tl.load(Gc + i_h + t0 * H + r * H, mask=r < eos - t0, other=0).to(tl.float32)
    return tl.where(r < eos - t0, b_G, g_last), g_last
