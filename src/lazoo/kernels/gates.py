"""Triton kernels for a Gated DeltaNet layer's gates (lazoo.layers.mixers.delta: ``mamba2_log_decay`` and
``DeltaNetMixer.beta``), per row of ``a = a_proj(x)``, ``b = b_proj(x)`` ``[..., H]``:

    z = a + dt_bias,   g = −exp(A_log) · softplus(z)   (fp32),   beta = sigmoid(b)   (×2 with neg_eigval; b's dtype)

softplus as torch's (z for z > 20, else log(1 + e^z)). In PyTorch that is about 9 small ops forward and 12 backward,
each costing tens of µs of host time in a host-bound training step; here one launch forward and one backward (and a
sum of the parameter gradients' per-program partials).

Backward, with r = exp(A_log) and beta_f32 the un-doubled sigmoid(b) in fp32:
    da = dg · (−r) · sigmoid(z),   d dt_bias = Σ_rows da,   dA_log = Σ_rows dg · g   (∂g/∂A_log = g),
    db = dbeta · beta_f32 · (1 − beta_f32)   (· 2 with neg_eigval)
Saved: the inputs a, b, A_log, dt_bias; g and beta are recomputed in the backward (a few flops in a kernel bound by
memory, and from b rather than the rounded beta: db in fp32 accuracy). The parameter gradients are summed from
fp32 partials ``[programs, 2, H]`` by one ``torch.sum`` (deterministic: no atomics). Arithmetic in fp32; A_log
and dt_bias are read in their own dtype; da, db and the parameter gradients come back in their inputs' dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import rounded_for
from ._utils import device_unsupported, next_pow2, num_sms
from .limits import GATES_MAX_HEADS as MAX_HEADS
from .limits import KERNEL_DTYPES as SUPPORTED_DTYPES


@triton.jit
def _softplus(z):
    """torch's softplus of fp32 ``z``: max(z, 0) + log1p(e^−|z|). The interpreter has no libdevice (no log1p), and
    log(1 + u) keeps only u's digits above fp32's epsilon (relative error ~6e-8 / u, e.g. 1e-3 at z = −10), so
    log1p(u) = 2·atanh(s), s = u / (2 + u) ∈ (0, 1/3], by its series to s¹⁵ (next term < 2e-9 relative)."""
    u = tl.exp(-tl.abs(z))
    s = u / (2.0 + u)
    s2 = s * s
    p = 1.0 / 13.0 + s2 * (1.0 / 15.0)
    p = 1.0 / 11.0 + s2 * p
    p = 1.0 / 9.0 + s2 * p
    p = 1.0 / 7.0 + s2 * p
    p = 1.0 / 5.0 + s2 * p
    p = 1.0 / 3.0 + s2 * p
    log1p = 2.0 * s * (1.0 + s2 * p)
    return tl.where(z > 20.0, z,  # torch's threshold
                     tl.maximum(z, 0.0) + log1p)


@triton.jit
def _tile(R, H, BR: tl.constexpr, BH: tl.constexpr):
    """This program's rows' element offsets ``[BR, BH]``, their mask, the heads ``[BH]`` and their mask."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    h = tl.arange(0, BH)
    h_ok = h < H
    return rows[:, None] * H + h[None, :], (rows < R)[:, None] & h_ok[None, :], h, h_ok


@triton.jit
def _fwd_kernel(a, b, A_log, dt_bias, g, beta, R, H, HAS_B: tl.constexpr, NEG_EIGVAL: tl.constexpr,
                BR: tl.constexpr, BH: tl.constexpr):
    offs, ok, h, h_ok = _tile(R, H, BR, BH)
    r = tl.exp(tl.load(A_log + h, mask=h_ok, other=0).to(tl.float32))
    z = tl.load(a + offs, mask=ok, other=0).to(tl.float32) + tl.load(dt_bias + h, mask=h_ok, other=0).to(tl.float32)
    tl.store(g + offs, -r[None, :] * _softplus(z), mask=ok)
    if HAS_B:
        s = tl.sigmoid(tl.load(b + offs, mask=ok, other=0).to(tl.float32))
        if NEG_EIGVAL:
            # doubled before the rounding: torch's 2 * sigmoid(b), except for fp16 betas below 2^-14 (b < −9.7),
            # which are subnormal there (their rounding does not commute with the doubling)
            s = 2.0 * s
        tl.store(beta + offs, rounded_for(s, beta), mask=ok)


@triton.jit
def _bwd_kernel(a, b, A_log, dt_bias, dg, dbeta, da, db, part, R, H, HAS_DG: tl.constexpr, HAS_DB: tl.constexpr,
                NEG_EIGVAL: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    offs, ok, h, h_ok = _tile(R, H, BR, BH)
    if HAS_DG:
        r = tl.exp(tl.load(A_log + h, mask=h_ok, other=0).to(tl.float32))
        z = (tl.load(a + offs, mask=ok, other=0).to(tl.float32)
             + tl.load(dt_bias + h, mask=h_ok, other=0).to(tl.float32))
        d = tl.load(dg + offs, mask=ok, other=0).to(tl.float32)  # 0 outside the tile: no contribution below
        # softplus' = sigmoid(z) (= 1 in fp32 above the threshold, as torch's backward there)
        d_z = d * -r[None, :] * tl.sigmoid(z)
        tl.store(da + offs, rounded_for(d_z, da), mask=ok)
        # this program's partial sums: row 0 dA_log (Σ dg · g), row 1 d dt_bias (Σ da)
        p = part + tl.program_id(0).to(tl.int64) * 2 * H + h
        tl.store(p, tl.sum(d * (-r[None, :] * _softplus(z)), 0), mask=h_ok)
        tl.store(p + H, tl.sum(d_z, 0), mask=h_ok)
    if HAS_DB:
        s = tl.sigmoid(tl.load(b + offs, mask=ok, other=0).to(tl.float32))
        d_b = tl.load(dbeta + offs, mask=ok, other=0).to(tl.float32) * s * (1.0 - s)
        if NEG_EIGVAL:
            d_b = 2.0 * d_b
        tl.store(db + offs, rounded_for(d_b, db), mask=ok)


def _blocks(R: int, H: int, device) -> tuple[int, int, int]:
    """(BR, BH, warps): a program's tile of BR rows × BH ≥ H heads, ~8 elements a thread (a warp per 256). Tiles
    of 2048 elements, their rows halved (down to 256 elements) while the grid has fewer than two programs an SM: at
    4k–32k rows of 16–64 heads that is 256 to 1024 programs on an H200's 132 SMs. The kernels are bound by memory
    (~10 bytes an element), so the tile only has to keep every SM busy with enough loads in flight."""
    BH = next_pow2(H, 1)
    BR = max(1, 2048 // BH)
    while BR > 1 and BR * BH > 256 and triton.cdiv(R, BR) < 2 * num_sms(device):
        BR //= 2
    return BR, BH, min(8, max(1, BR * BH // 256))


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, neg_eigval):
        H = a.shape[-1]
        R = a.numel() // H
        g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        beta = torch.empty_like(b) if b is not None else None
        if R > 0:
            BR, BH, warps = _blocks(R, H, a.device)
            _fwd_kernel[(triton.cdiv(R, BR),)](a, b if b is not None else a, A_log, dt_bias, g,
                                               beta if beta is not None else g, R, H, HAS_B=b is not None,
                                               NEG_EIGVAL=neg_eigval, BR=BR, BH=BH, num_warps=warps)
        ctx.save_for_backward(a, b, A_log, dt_bias)
        ctx.neg_eigval = neg_eigval
        ctx.set_materialize_grads(False)  # an unused g or beta comes back as None: its part is skipped
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a, b, A_log, dt_bias = ctx.saved_tensors
        H = a.shape[-1]
        R = a.numel() // H
        has_dg = dg is not None and any(ctx.needs_input_grad[i] for i in (0, 2, 3))
        has_db = dbeta is not None and b is not None and ctx.needs_input_grad[1]
        if not (has_dg or has_db):
            return None, None, None, None, None
        BR, BH, warps = _blocks(max(R, 1), H, a.device)
        n = triton.cdiv(R, BR)
        da = torch.empty_like(a) if has_dg else None
        db = torch.empty_like(b) if has_db else None
        # every program writes its whole rows of the partials; no rows at all: zero gradients
        part = (torch.empty if n > 0 else torch.zeros)(max(n, 1), 2, H, dtype=torch.float32, device=a.device) \
            if has_dg else a
        if n > 0:
            _bwd_kernel[(n,)](a, b if b is not None else a, A_log, dt_bias,
                              dg.contiguous() if has_dg else a, dbeta.contiguous() if has_db else a,
                              da if has_dg else a, db if has_db else a, part, R, H, HAS_DG=has_dg, HAS_DB=has_db,
                              NEG_EIGVAL=ctx.neg_eigval, BR=BR, BH=BH, num_warps=warps)
        dA_log = ddt = None
        if has_dg:
            dA_log, ddt = part.sum(0)
            dA_log, ddt = dA_log.to(A_log.dtype), ddt.to(dt_bias.dtype)
        need = ctx.needs_input_grad
        return (da if need[0] else None, db, dA_log if need[2] else None, ddt if need[3] else None, None)


def check_supported(a: torch.Tensor, b: torch.Tensor | None, A_log: torch.Tensor,
                    dt_bias: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs (None if they can)."""
    named = [("a", a), ("A_log", A_log), ("dt_bias", dt_bias)] + ([("b", b)] if b is not None else [])
    for name, x in named:
        if x.dtype not in SUPPORTED_DTYPES:
            return f"the Triton kernel takes {name} of dtype float32, float16 or bfloat16, not {x.dtype}"
        if x.device != a.device:
            return f"{name} is on {x.device}, a on {a.device}"
    if a.dim() == 0:
        return "the Triton kernel takes a of shape [..., H], got a scalar"
    H = a.shape[-1]
    if not 1 <= H <= MAX_HEADS:
        return f"the Triton kernel takes 1 to {MAX_HEADS} heads, got {H}"
    if A_log.shape != (H,) or dt_bias.shape != (H,):
        return (f"the Triton kernel takes A_log and dt_bias of shape [{H}], got {tuple(A_log.shape)} and "
                f"{tuple(dt_bias.shape)}")
    if b is not None and b.shape != a.shape:
        return f"the Triton kernel takes b of a's shape {tuple(a.shape)}, got {tuple(b.shape)}"
    return device_unsupported(a)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor | None, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                      neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g, beta) of a Gated DeltaNet layer: g = −exp(A_log) · softplus(a + dt_bias) in fp32 ``[..., H]``, beta =
    sigmoid(b) (doubled with ``neg_eigval``) in b's dtype, or None without ``b``. a, b ``[..., H]``; A_log, dt_bias
    ``[H]``. Differentiable in a, b, A_log and dt_bias; see the module docstring."""
    why = check_supported(a, b, A_log, dt_bias)
    if why is not None:
        raise ValueError(f"gated_delta_gates: {why}")
    return _Gates.apply(a.contiguous(), b.contiguous() if b is not None else None, A_log.contiguous(),
                        dt_bias.contiguous(), bool(neg_eigval))
