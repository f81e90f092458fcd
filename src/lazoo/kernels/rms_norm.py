"""A Triton kernel for the RMSNorm, optionally zero-centred and optionally followed by a SiLU gate:

    y = x̂ · (offset + w) [· silu(gate)],   x̂ = x / sqrt(mean(x², last dim) + eps)

over the last dim D of ``x [..., D]``; ``offset`` 0 is torch's ``nn.RMSNorm`` (``w·x̂``), 1 the zero-centred form
(``(1 + w)·x̂``, Qwen3.5's); no weight means a scale of 1. Arithmetic in fp32 (the weight and gate are read in
their own dtypes and converted in the kernel), y rounded once to x's dtype.

Why: a training step at ~4k tokens is host-bound (each small op costs ~40-60 µs of Python and dispatch), and the
PyTorch form of a norm is five ops a direction (casts, ``1 + w``, ``F.rms_norm``, the cast back; the gate adds
more). Here it is one launch forward and one backward (plus one ``torch.sum`` of the weight-gradient partials).

Saved for the backward: x, the weight, the gate and the fp32 per-row rstd = 1 / sqrt(mean(x²) + eps). With
s = offset + w, n = x̂ · s, y = n · silu(gate):
    dn = dy · silu(gate),   dgate = dy · n · silu'(gate),   dw = Σ_rows dn · x̂,
    dx = rstd · (dn·s − x̂ · mean(dn·s·x̂))
dw is summed per program over the row blocks it walks and the partials [programs, D] by one ``torch.sum`` (no
atomics: deterministic). dx in x's dtype, dw in the weight's, dgate in the gate's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._utils import device_unsupported, is_interpreting, next_pow2, num_sms
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES
from .limits import RMS_NORM_MAX_DIM as MAX_DIM


@triton.jit
def _fwd_kernel(x, w, g, y, rstd, R, D, sx, sg, eps, offset, HAS_W: tl.constexpr, HAS_G: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    r_ok, d_ok = r < R, d < D
    m = r_ok[:, None] & d_ok[None, :]
    r64 = r.to(tl.int64)[:, None]  # R·D may pass 2³¹
    xv = tl.load(x + r64 * sx + d[None, :], mask=m, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xv * xv, 1) / D + eps)  # masked columns are 0: the sum is over D
    n = xv * inv[:, None]
    if HAS_W:
        n = n * (tl.load(w + d, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
    if HAS_G:
        gv = tl.load(g + r64 * sg + d[None, :], mask=m, other=0.0).to(tl.float32)
        n = n * gv * tl.sigmoid(gv)
    tl.store(y + r64 * D + d[None, :], n.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + r, inv, mask=r_ok)


@triton.jit
def _bwd_kernel(x, w, g, dy, rstd, dx, dg, dw_part, R, D, sx, sg, sdy, offset, n_blocks, HAS_W: tl.constexpr,
                HAS_G: tl.constexpr, STORE_DG: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if HAS_W:
        s = (tl.load(w + d, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # a fixed number of programs walks the row blocks, so dw has one partial row per program, not per block
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        r = blk * ROWS + tl.arange(0, ROWS)
        r_ok = r < R
        m = r_ok[:, None] & d_ok[None, :]
        r64 = r.to(tl.int64)[:, None]
        inv = tl.load(rstd + r, mask=r_ok, other=0.0)
        xh = tl.load(x + r64 * sx + d[None, :], mask=m, other=0.0).to(tl.float32) * inv[:, None]
        dn = tl.load(dy + r64 * sdy + d[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_G:
            gv = tl.load(g + r64 * sg + d[None, :], mask=m, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gv)
            if STORE_DG:
                n = xh
                if HAS_W:
                    n = xh * s
                dgv = dn * n * sig * (1.0 + gv * (1.0 - sig))  # silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
                tl.store(dg + r64 * D + d[None, :], dgv.to(dg.dtype.element_ty), mask=m)
            dn = dn * gv * sig
        if HAS_W:
            dw_acc += tl.sum(dn * xh, 0)
            dn = dn * s
        c = tl.sum(dn * xh, 1) / D
        dxv = inv[:, None] * (dn - xh * c[:, None])
        tl.store(dx + r64 * D + d[None, :], dxv.to(dx.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dw_part + pid * D + d, dw_acc, mask=d_ok)


def _tiles(D: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_D, warps): whole rows (BLOCK_D = next power of two ≥ D), and several rows a program while a
    row is short (per-head norms, D = 64-128), for tiles of ≥ 4096 elements; warps grow with the tile, ~16 fp32
    elements a thread per tensor. The interpreter, whose cost is per program, takes tiles of ≥ 1024 elements (small
    tests still span several programs)."""
    block_d = next_pow2(D)
    rows = max(1, (1024 if is_interpreting() else 4096) // block_d)
    return rows, block_d, min(16, max(4, rows * block_d // 512))


def _programs(n_blocks: int, warps: int, device) -> int:
    """Programs of the backward: enough for ~32 resident warps an SM (3 under the interpreter, so that the walk
    over the blocks is ragged), never more than the blocks."""
    if is_interpreting():
        return min(n_blocks, 3)
    return min(n_blocks, num_sms(device) * max(1, 32 // warps))


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """``t`` as rows ``[R, D]`` with unit column stride, a view where the leading dims collapse into one stride
    (a gate sliced out of a wider projection), else a contiguous copy."""
    try:
        v = t.view(-1, D)
    except RuntimeError:
        return t.reshape(-1, D).contiguous()
    return v if D == 1 or v.stride(1) == 1 else v.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, offset):
        D = x.shape[-1]
        x2 = _rows(x, D)
        g2 = None if gate is None else _rows(gate, D)
        if weight is not None and weight.stride(0) != 1 and D > 1:
            weight = weight.contiguous()  # read at unit stride (a copy only for a strided view)
        R = x2.shape[0]
        rows, block_d, warps = _tiles(D)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(R, dtype=torch.float32, device=x.device)
        if R > 0:
            _fwd_kernel[(triton.cdiv(R, rows),)](
                x2, x2 if weight is None else weight, x2 if g2 is None else g2, y, rstd, R, D, x2.stride(0),
                0 if g2 is None else g2.stride(0), eps, offset, HAS_W=weight is not None, HAS_G=g2 is not None,
                ROWS=rows, BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.x_shape, ctx.gate_shape, ctx.offset = x.shape, None if gate is None else gate.shape, offset
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, weight, g2, rstd = ctx.saved_tensors
        R, D = x2.shape
        rows, block_d, warps = _tiles(D)
        dy2 = _rows(dy, D)
        dx = torch.empty(R, D, dtype=x2.dtype, device=x2.device)
        store_dg = g2 is not None and ctx.needs_input_grad[2]
        dg = torch.empty(R, D, dtype=g2.dtype, device=x2.device) if store_dg else None
        n_blocks = triton.cdiv(R, rows)
        programs = _programs(n_blocks, warps, x2.device)
        dw_part = torch.empty(programs, D, dtype=torch.float32, device=x2.device) if weight is not None else None
        if R > 0:
            _bwd_kernel[(programs,)](
                x2, x2 if weight is None else weight, x2 if g2 is None else g2, dy2, rstd, dx,
                dx if dg is None else dg, dx if dw_part is None else dw_part, R, D, x2.stride(0),
                0 if g2 is None else g2.stride(0), dy2.stride(0), ctx.offset, n_blocks, HAS_W=weight is not None,
                HAS_G=g2 is not None, STORE_DG=store_dg, ROWS=rows, BLOCK_D=block_d, num_warps=warps)
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = dw_part.sum(0).to(weight.dtype)
        dgate = None if dg is None else dg.view(ctx.gate_shape)
        return dx.view(ctx.x_shape), dw, dgate, None, None


def check_supported(x: torch.Tensor, weight: torch.Tensor | None = None,
                    gate: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take these inputs (None if it can)."""
    if x.dim() == 0:
        return "the Triton kernel takes x of shape [..., D], got a scalar"
    D = x.shape[-1]
    if D == 0:
        return "the Triton kernel takes a normalised dim of at least 1, got 0"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes dtype float32, float16 or bfloat16, not {x.dtype}"
    if D > MAX_DIM:
        return f"the Triton kernel takes a normalised dim up to {MAX_DIM}, got {D}"
    if weight is not None:
        if weight.dtype not in SUPPORTED_DTYPES:
            return f"the Triton kernel takes a weight of dtype float32, float16 or bfloat16, not {weight.dtype}"
        if tuple(weight.shape) != (D,):
            return f"the Triton kernel takes a weight of shape ({D},), got {tuple(weight.shape)}"
        if weight.device != x.device:
            return f"the weight is on {weight.device}, x on {x.device}"
    if gate is not None:
        if gate.dtype not in SUPPORTED_DTYPES:
            return f"the Triton kernel takes a gate of dtype float32, float16 or bfloat16, not {gate.dtype}"
        if gate.shape != x.shape:
            return f"the Triton kernel takes a gate of x's shape {tuple(x.shape)}, got {tuple(gate.shape)}"
        if gate.device != x.device:
            return f"the gate is on {gate.device}, x on {x.device}"
    return device_unsupported(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, offset: float = 0.0,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """``x̂ · (offset + weight) [· silu(gate)]`` over the last dim of ``x [..., D]`` (``x̂ = x / sqrt(mean(x²) +
    eps)``), in fp32, returned in x's dtype. ``weight [D]`` of any kernel dtype or None (a scale of 1; offset is
    then unused); ``offset`` 0 for ``nn.RMSNorm``, 1 for the zero-centred norm; ``gate`` of x's shape or None;
    ``eps`` a number (``nn.RMSNorm``'s None is the caller's to resolve). Differentiable in x, weight and gate."""
    why = check_supported(x, weight, gate)
    if why is not None:
        raise ValueError(f"rms_norm: {why}")
    return _RMSNorm.apply(x, weight, gate, float(eps), float(offset))
