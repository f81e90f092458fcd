"""Triton kernels for the depthwise causal short convolution (lazoo.layers.short_conv), channels last.

    pre_t = Σ_{j<K} w_j ⊙ x_{t−(K−1−j)}  (x_s = 0 for s < 0),   y_t = act(pre_t),   act = SiLU or identity

on ``x [B, T, C]`` with ``w [C, K]``; for packed sequences (B = 1) x_s = 0 also for s before the start of row t's
own sequence (``starts[t]``), as if each sequence ran alone.

PyTorch's ``conv1d`` wants ``[B, C, T]``: in a Gated DeltaNet training step (three convolutions per layer; H200
profile in docs/changelog.md) its depthwise kernels took 12 of 106 ms and the layout copies around them up to 14 ms
more. Here each program reads its time block and the K − 1 rows before it in place.

Backward, with dpre = dy ⊙ act'(pre) (pre recomputed from x):
    dx_s = Σ_j w_j ⊙ dpre_{s+(K−1−j)}  (dpre_t = 0 for t ≥ T),   dw_j = Σ_{b,t} dpre_t ⊙ x_{t−(K−1−j)}
in one kernel, ``_bwd_kernel``: each program walks a run of rows in time order for a block of channels, keeping
the last K − 1 rows of x and dpre in registers, so dpre never goes through memory; it writes dx and one row of dw
partial sums, which PyTorch adds up (deterministic, no atomics). Arithmetic in fp32; x, y, dx in the input dtype;
w read in its own dtype (no cast op before the launch), dw summed in fp32 and returned in w's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import is_interpreting, next_pow2
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES
from .limits import SHORT_CONV_MAX_KERNEL_SIZE as MAX_KERNEL_SIZE


@triton.jit
def _pre(x, w, t, c, C, SX, t_ok, c_ok, lo, K: tl.constexpr):
    """pre at rows ``t`` (``[BT]``) and channels ``c`` (``[BC]``) of one sample (``x`` points at its row 0, rows
    ``SX`` apart), reading no row before ``lo`` (each row's first, ``[BT]``), fp32 ``[BT, BC]``."""
    acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1 - j)
        ok = (src >= lo) & t_ok
        xv = tl.load(x + src[:, None] * SX + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        wj = tl.load(w + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wj[None, :]
    return acc


@triton.jit
def _fwd_kernel(x, w, y, starts, T, C, SXB, SX, K: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, PACKED: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += b * SXB  # this sample (x's rows may be SX > C apart: a slice of a wider projection)
    SX = tl.cast(SX, tl.int64)  # row offsets in 64 bits
    y += b * T * C  # (64-bit once; offsets inside y's sample stay 32-bit)
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    if PACKED:  # each row's window starts at its sequence's first row
        pre = _pre(x, w, t, c, C, SX, t_ok, c_ok, tl.load(starts + t, mask=t_ok, other=0), K)
    else:
        pre = _pre(x, w, t, c, C, SX, t_ok, c_ok, 0, K)
    out = pre * tl.sigmoid(pre) if SILU else pre
    tl.store(y + t[:, None] * C + c[None, :], out.to(y.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _cols(c, C, ok):
    """The channels ``c < C`` of one row, none where the scalar ``ok`` is false (one vector compare)."""
    return c < tl.where(ok, C, 0)


@triton.jit
def _rows(p, t0, c, T, S, C, R: tl.constexpr):
    """Rows t0 … t0 + R − 1 (``S`` apart) at channels ``c`` (zeros past T), in the stored dtype."""
    out = ()
    for i in tl.static_range(R):
        out = out + (tl.load(p + (t0 + i) * S + c, mask=_cols(c, C, t0 + i < T), other=0.0),)
    return out


@triton.jit
def _bwd_kernel(x, w, dy, dx, dw_part, starts, T, C, SXB, SX, L, K: tl.constexpr, SILU: tl.constexpr,
                R: tl.constexpr, BC: tl.constexpr, PACKED: tl.constexpr):
    """dx and dw for the rows [r0, r0 + L) of one sample at ``BC`` channels, walking time in order with the last
    K − 1 rows of x and of dpre in registers: each row of x and dy is loaded once and pre, dpre formed once (a
    2D tile would recompute pre at K shifted rows, K² products an element, which made the kernel issue-bound).
    Rows are loaded R at a time to keep loads in flight. The run also reads the K − 1 rows of x before it, and
    x and dy at the K − 1 rows after it (dx_s needs dpre_{s+K−1}); those feed dx only. PACKED: a row's window
    holds no row before its sequence's start, and dpre_t reaches dx_s only within one sequence."""
    i_r, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += b * SXB  # this sample (x's rows SX apart; dy's and dx's C apart)
    SX = tl.cast(SX, tl.int64)  # row offsets in 64 bits: x's rows may be several times C apart
    dy += b * T * C
    dx += b * T * C
    c = i_c * BC + tl.arange(0, BC)
    c_ok = c < C
    ws = ()  # the K taps, loaded once
    for j in tl.static_range(K):
        ws = ws + (tl.load(w + c * K + j, mask=c_ok, other=0.0).to(tl.float32),)
    r0 = i_r * L
    r1 = tl.minimum(r0 + L, T)
    zero = tl.zeros([BC], dtype=tl.float32)
    xs = ()  # x_{t−(K−1)} … x_{t−1}
    gs = ()  # dpre_{t−(K−1)} … dpre_{t−1}
    ls = ()  # the sequence starts of rows t−(K−1) … t−1 (PACKED; empty otherwise)
    for j in tl.static_range(K - 1):
        row = r0 - (K - 1) + j
        xs = xs + (tl.load(x + row * SX + c, mask=_cols(c, C, row >= 0), other=0.0).to(tl.float32),)
        gs = gs + (zero,)
        if PACKED:
            ls = ls + (r0 * 0,)
    dws = ()  # dw over this run, fp32
    for _ in tl.static_range(K):
        dws = dws + (zero,)
    for t0 in range(r0, r1 + K - 1, R):
        xr = _rows(x, t0, c, T, SX, C, R)
        gr = _rows(dy, t0, c, T, C, C, R)
        for i in tl.static_range(R):
            t = t0 + i
            win = xs + (xr[i].to(tl.float32),)  # win[j] = x_{t−(K−1−j)}
            pwin = win  # the window row t reads: zeros before its sequence's start
            if PACKED:
                lo = tl.load(starts + t, mask=t < T, other=0)  # the first row of row t's sequence
                pwin = ()
                for j in tl.static_range(K):
                    pwin = pwin + (tl.where(t - (K - 1 - j) >= lo, win[j], 0.0),)
            g = gr[i].to(tl.float32)  # 0 past T
            if SILU:
                pre = ws[0] * pwin[0]
                for j in tl.static_range(1, K):
                    pre += ws[j] * pwin[j]
                sg = tl.sigmoid(pre)
                g = g * sg * (1 + pre * (1 - sg))
            gw = tl.where(t < r1, g, 0.0)  # rows past the run only feed dx
            nxt = ()
            for j in tl.static_range(K):
                nxt = nxt + (dws[j] + gw * pwin[j],)
            dws = nxt
            gwin = gs + (g,)  # gwin[d] = dpre_{u+d}, u = t − (K − 1)
            lwin = ls
            if PACKED:
                lwin = ls + (lo,)
            u = t - (K - 1)
            acc = ws[K - 1] * gwin[0]
            for d in tl.static_range(1, K):
                if PACKED:  # dpre_{u+d} reaches x_u only where u is in row u + d's sequence
                    acc += ws[K - 1 - d] * tl.where(u >= lwin[d], gwin[d], 0.0)
                else:
                    acc += ws[K - 1 - d] * gwin[d]
            tl.store(dx + u * C + c, acc.to(dx.dtype.element_ty), mask=_cols(c, C, (u >= r0) & (u < r1)))
            xs = ()
            gs = ()
            ls = ()
            for j in tl.static_range(1, K):
                xs = xs + (win[j],)
                gs = gs + (gwin[j],)
                if PACKED:
                    ls = ls + (lwin[j],)
    row = (b * tl.num_programs(0) + i_r) * C  # one row of partial sums a program: dw_part [B, runs, C, K]
    for j in tl.static_range(K):
        tl.store(dw_part + (row + c) * K + j, dws[j], mask=c_ok)


def _blocks(C: int) -> tuple[int, int, int]:
    """(BT, BC, warps) of the forward kernel. 16 × 128 tiles with 4 warps compile for sm_90 (Triton 3.6) with no
    spills (72 registers)."""
    if is_interpreting():
        return 16, min(32, next_pow2(C)), 1
    return 16, min(128, next_pow2(C)), 4


def _bwd_blocks(B: int, T: int, C: int) -> tuple[int, int, int, int]:
    """(L, R, BC, warps) of the backward kernel: runs of L rows, loaded R at a time, BC channels a program.

    4 channels a thread (BC = 256 on 2 warps). L aims at about 1024 programs: each program walks its rows one
    after another, so with few programs the GPU idles on memory latency, and with many the K − 1 rows re-read at
    each end of a run and the partial rows of dw cost more. H200, bf16, C = 2048, K = 4, kernel and dw sum: at
    B·T = 4096, 28 µs at L = 32, 31 at L = 64, 68 at L = 256; at B·T = 32768, 142 µs at L = 128, 160 at L = 64.
    L ≥ 8 still gives 192 programs at B·T = 512, C = 768."""
    if is_interpreting():
        return 7, 3, min(16, next_pow2(C, 1)), 1  # runs and load groups that end mid-way at small test shapes
    BC = min(256, next_pow2(C, 128))
    L = max(8, min(128, triton.next_power_of_2(max(1, B * T * triton.cdiv(C, BC) // 1024))))
    return L, 8, BC, BC // 128


def _grid(B, T, C, BT, BC):
    return (triton.cdiv(T, BT), triton.cdiv(C, BC), B)


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, silu, starts):
        B, T, C = x.shape
        K = w.shape[1]
        BT, BC, warps = _blocks(C)
        y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        packed = starts is not None
        _fwd_kernel[_grid(B, T, C, BT, BC)](x, w, y, starts if packed else x, T, C, x.stride(0), x.stride(1), K=K,
                                            SILU=silu, BT=BT, BC=BC, PACKED=packed, num_warps=warps)
        ctx.save_for_backward(x, w, starts)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, starts = ctx.saved_tensors
        B, T, C = x.shape
        K = w.shape[1]
        L, R, BC, warps = _bwd_blocks(B, T, C)
        grid = (triton.cdiv(T, L), triton.cdiv(C, BC), B)
        dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        dw_part = torch.empty(B, grid[0], C, K, dtype=torch.float32, device=x.device)
        packed = starts is not None
        _bwd_kernel[grid](x, w, dy.contiguous(), dx, dw_part, starts if packed else x, T, C, x.stride(0), x.stride(1),
                          L, K=K, SILU=ctx.silu, R=R, BC=BC, PACKED=packed, num_warps=warps)
        return dx, dw_part.sum((0, 1)).to(w.dtype), None, None


def check_supported(x: torch.Tensor, kernel_size: int, activation: str | None = "silu") -> str | None:
    """Why the kernels cannot take this input (None if they can)."""
    if activation not in ("silu", None):
        return f"the Triton kernel applies activation 'silu' or None, not {activation!r}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes dtype float32, float16 or bfloat16, not {x.dtype}"
    if kernel_size > MAX_KERNEL_SIZE:
        return f"the Triton kernel takes kernel_size up to {MAX_KERNEL_SIZE}, got {kernel_size}"
    if x.dim() != 3:
        return f"the Triton kernel takes x of shape [B, T, C], got {tuple(x.shape)}"
    return None


def short_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None = "silu",
               starts: torch.Tensor | None = None) -> torch.Tensor:
    """``act(causal depthwise conv(x))`` for ``x [B, T, C]`` from a zero state; ``weight [C, K]`` (conv1d's
    ``[C, 1, K]`` squeezed: tap j multiplies x_{t−(K−1−j)}), read in its own dtype (other than float16, bfloat16
    or float32: cast to float32) with fp32 arithmetic. Differentiable in x and weight. ``starts``: packed sequences
    (B = 1), ``[T]`` int32, the first row of each row's sequence (``lazoo.ops.packing.packed_row_starts``)."""
    why = check_supported(x, weight.shape[-1], activation)
    if why is None and starts is not None and (x.dim() != 3 or x.shape[0] != 1 or starts.shape != (x.shape[1],)
                                               or starts.dtype != torch.int32):
        why = f"packed sequences take x [1, T, C] and starts [T] int32, got {tuple(x.shape)} and " \
              f"{tuple(starts.shape)} {starts.dtype}"
    if why is not None:
        raise ValueError(f"short_conv: {why}")
    w = weight.reshape(weight.shape[0], -1).contiguous()  # read in its own dtype: no cast op a call
    if w.dtype not in SUPPORTED_DTYPES:
        w = w.float()
    if x.stride(-1) != 1:  # the kernels read rows of unit channel stride, any row and sample strides
        x = x.contiguous()
    return _ShortConv.apply(x, w, activation == "silu", starts)
