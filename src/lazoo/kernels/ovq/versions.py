"""Triton kernels for step 2 of OVQ attention's Triton path: every value each dictionary slot takes during a call, as
running means in one table per (sample, head) (``lazoo.ops.ovq._dictionary_versions``).

Slot s's group of rows starts at ``start[s]``: its value before the call (the mean ``D0[s]`` of ``c0 = counts0[s]``
keys), then its value after each of the ``n[s]`` keys that join it, in order of position:

    mean_0 = c0 D0 / max(c0, 1),    mean_r = (c0 D0 + x_1 + ... + x_r) / (c0 + r),    end = mean_n (0 if c0 + n = 0)

The keys of slot s are ``order[start[s] − s + j]`` (token indices into the packed keys, sorted by slot and position).
One program per (slot, sample·head) walks its group, summing in fp32 in the step-by-step order of the reference
update; the backward walks it in reverse: ∂x_j = Σ_{r > j} ∂mean_r / (c0 + r) + ∂end / (c0 + n), and ∂D0 = c0 (that
sum from r = 1, plus ∂mean_0 / max(c0, 1)). Rows past the groups are zero. (In PyTorch this was a float64 prefix sum
over the whole table with a scatter, a gather and a division around it: with these kernels the op at T = 64k went
from 83 to 65 ms fwd + bwd on an H200.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import next_pow2

#: one warp a slot: a program handles one row of d values at a time (4 per thread at d = 128), and B·H·M of them
#: keep the GPU busy
NUM_WARPS = 1


@triton.jit
def _program(START, N, C0, H, M, D: tl.constexpr, BD: tl.constexpr):
    """This program's slot s and sample·head (int64), its sample and head, the dim offsets and mask, and slot s's
    first row, number of joining keys, count before the call (int64) and where its keys start in ``order``."""
    s = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    od = tl.arange(0, BD)
    start = tl.load(START + bh * M + s)
    return s, bh, bh // H, bh % H, od, od < D, start, tl.load(N + bh * M + s), tl.load(C0 + bh * M + s), start - s


@triton.jit
def _fwd_kernel(X, D0, C0, START, N, ORDER, OUT, END, P, H, M, ROWS, D: tl.constexpr, BD: tl.constexpr):
    s, bh, b, h, od, md, start, n, c0, first = _program(START, N, C0, H, M, D, BD)
    acc = tl.load(D0 + (bh * M + s) * D + od, mask=md, other=0.0).to(tl.float32) * c0.to(tl.float32)
    out = OUT + (bh * ROWS + start) * D
    tl.store(out + od, (acc / tl.maximum(c0, 1).to(tl.float32)).to(OUT.dtype.element_ty), mask=md)
    for j in range(0, n):
        p = tl.load(ORDER + bh * P + first + j)
        acc += tl.load(X + ((b * P + p) * H + h) * D + od, mask=md, other=0.0).to(tl.float32)
        tl.store(out + (j + 1) * D + od, (acc / (c0 + j + 1).to(tl.float32)).to(OUT.dtype.element_ty), mask=md)
    total = c0 + n
    end = tl.where(total > 0, acc / tl.maximum(total, 1).to(tl.float32), 0.0)
    tl.store(END + (bh * M + s) * D + od, end.to(END.dtype.element_ty), mask=md)


@triton.jit
def _bwd_kernel(DOUT, DEND, C0, START, N, ORDER, DX, DD0, P, H, M, ROWS, D: tl.constexpr, BD: tl.constexpr):
    s, bh, b, h, od, md, start, n, c0, first = _program(START, N, C0, H, M, D, BD)
    total = c0 + n
    g = tl.load(DEND + (bh * M + s) * D + od, mask=md, other=0.0).to(tl.float32)
    g = tl.where(total > 0, g / tl.maximum(total, 1).to(tl.float32), 0.0)
    dout = DOUT + (bh * ROWS + start) * D
    for i in range(0, n):
        j = n - 1 - i
        g += tl.load(dout + (j + 1) * D + od, mask=md, other=0.0).to(tl.float32) / (c0 + j + 1).to(tl.float32)
        p = tl.load(ORDER + bh * P + first + j)
        tl.store(DX + ((b * P + p) * H + h) * D + od, g.to(DX.dtype.element_ty), mask=md)
    g0 = tl.load(dout + od, mask=md, other=0.0).to(tl.float32) / tl.maximum(c0, 1).to(tl.float32)
    tl.store(DD0 + (bh * M + s) * D + od, ((g + g0) * c0.to(tl.float32)).to(DD0.dtype.element_ty), mask=md)


class _VersionTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, d0, counts0, start, n, order, rows, out_dtype):
        B, P, H, D = x.shape
        M = d0.shape[2]
        out = torch.zeros(B, H, rows, D, dtype=out_dtype, device=x.device)
        end = torch.empty_like(d0)
        if M:
            _fwd_kernel[(M, B * H)](x, d0, counts0, start, n, order, out, end, P, H, M, rows, D=D, BD=next_pow2(D),
                                    num_warps=NUM_WARPS)
        ctx.save_for_backward(counts0, start, n, order)
        ctx.shapes = (x.shape, x.dtype, d0.dtype)
        return out, end

    @staticmethod
    def backward(ctx, dout, dend):
        counts0, start, n, order = ctx.saved_tensors
        (B, P, H, D), x_dtype, d0_dtype = ctx.shapes
        M = counts0.shape[2]
        rows = dout.shape[2] if dout is not None else 0
        dout = torch.zeros(B, H, rows, D, device=counts0.device) if dout is None else dout.contiguous()
        dend = torch.zeros(B, H, M, D, device=counts0.device) if dend is None else dend.contiguous()
        dx = torch.zeros(B, P, H, D, dtype=x_dtype, device=counts0.device)  # keys that join nothing: 0
        dd0 = torch.empty(B, H, M, D, dtype=d0_dtype, device=counts0.device)
        if M:
            _bwd_kernel[(M, B * H)](dout, dend, counts0, start, n, order, dx, dd0, P, H, M, rows, D=D,
                                    BD=next_pow2(D), num_warps=NUM_WARPS)
        return dx, dd0, None, None, None, None, None, None


def version_table(x, d0, counts0, start, n, order, rows: int, out_dtype):
    """``(table [B, H, rows, d] in out_dtype, end [B, H, M, d] in d0's dtype)`` (module docstring), differentiable
    in ``x`` (the packed keys or values ``[B, P, H, d]``) and ``d0`` (the dictionary before the call
    ``[B, H, M, d]``). counts0, start, n ``[B, H, M]`` int64; order ``[B, H, P]`` int64: token indices sorted by
    (slot, position), the keys that join no slot last."""
    x, d0 = x.contiguous(), d0.contiguous()
    counts0, start, n, order = (t.to(torch.int64).contiguous() for t in (counts0, start, n, order))
    return _VersionTable.apply(x, d0, counts0, start, n, order, rows, out_dtype)
