"""Mamba-2's state space duality (SSD) layer ("Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", Dao and Gu, 2024), per head h:

    S_t = exp(dt_t · A_h) S_{t-1} + dt_t · x_t B_tᵀ,     y_t = S_t C_t + D_h · x_t

with x_t ``[P]`` (the head dim), B_t and C_t ``[N]`` (the state size), dt_t >= 0 (already softplus'ed) and A_h < 0,
so the state decays by exp(dt_t · A_h) in (0, 1]. B and C come in G groups: head h reads group h // (H / G).

Layout: x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``, B and C ``[B, T, G, N]``, D ``[H]`` or None; state S
``[B, H, P, N]`` (lazoo's ``[B, H, dv, dk]`` with dv = P, dk = N: the layout of transformers' Mamba-2 SSM cache);
mask ``[B, T]`` (a pad neither writes nor decays the state, and outputs 0); packed ``cu_seqlens`` ``[N + 1]`` (B = 1,
states one per sequence).

It is gated linear attention with a scalar decay per head (``gated_linear_attention``): q = C, k = B with their G
groups as grouped query/key heads (value head h reads group h // (H / G)), v = dt · x, log decay g = dt · A, scale
1. Every backend of that op serves it ("recurrent", "chunk" and the Triton kernels of lazoo.kernels.linear, which
read each group's B and C in place and sum their gradients over the group's heads); the skip D · x is added
outside. dt · A is formed in float32 (float64 stays) and handed to the kernels in float32 for half-precision inputs.
Where those kernels run, v = dt · x and the skip are ``lazoo.kernels.ssd_io``'s kernels (the same arithmetic, in
one launch each way each).
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .boundary import apply_mask, zero_masked
from .checks import check_float, check_same_device, queue_range_check
from .dtypes import compute_dtype, without_autocast
from .linear import gated_linear_attention_as, linear_kernel_unsupported

__all__ = ["mamba2"]


@without_autocast
def mamba2(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None = None, *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
           output_final_state: bool = False, mask: torch.Tensor | None = None, backend: str | None = None,
           cu_seqlens: torch.Tensor | None = None):
    """Mamba-2's SSD recurrence (module docstring). Returns ``(y [B, T, H, P] in x's dtype, final state
    [B, H, P, N] or None)``; the state in float32 (float64 for float64 inputs)."""
    op = "mamba2"
    _check_inputs(op, x, dt, A, B, C, D)
    mask, (x, dt, B, C) = apply_mask(op, mask, x, dt, B, C)  # a NaN at a pad never meets a real token
    report_dt = queue_range_check(op, "dt", dt, low=0.0, hint=" (a step size: softplus of its projection)")
    report_A = queue_range_check(op, "A", A, high=0.0, hint=" (the state decays by exp(dt·A))")
    cdt = compute_dtype(x.dtype)
    dt_c = dt.to(cdt)
    g = dt_c * A.to(cdt)  # the log decay dt·A <= 0, [B, T, H]
    io = _io_kernels(x, dt, C, D, backend)
    v = io.scale_by_dt(x, dt) if io else (dt_c[..., None] * x.to(cdt)).to(x.dtype)
    y, state = gated_linear_attention_as(
        op, C, B, v, g, scale=1.0, chunk_size=chunk_size,
        initial_state=initial_state, output_final_state=output_final_state, mask=mask, backend=backend,
        cu_seqlens=cu_seqlens, check_g=False, fp32_gate=True)
    report_dt()
    report_A()
    if D is not None and io:  # x and y are zero at the pads: so is y + D·x
        y = io.add_skip(y, x, D)
    elif D is not None:
        y = (y.to(cdt) + D.to(cdt)[:, None] * zero_masked(x, mask).to(cdt)).to(x.dtype)
    return y, state


def _io_kernels(x, dt, C, D, backend):
    """``lazoo.kernels.ssd_io`` where it computes v = dt·x and the D skip (one launch each way for each, where
    PyTorch runs chains of casts through float32 copies of x): where the Triton kernels run the op (the choice
    ``gated_linear_attention`` makes), not while torch.compile traces (it fuses the PyTorch form itself); else None."""
    if torch.compiler.is_compiling():
        return None
    if resolve_backend("mamba2", backend, x.device, linear_kernel_unsupported(C, x), log_fallback=False) != "triton":
        return None
    try:
        from ..kernels import ssd_io  # defines the kernels: only where they can run
    except ImportError:  # an exported model folder: no kernels there
        return None
    return ssd_io if ssd_io.check_supported(x, dt, D) is None else None


def _check_inputs(op, x, dt, A, B, C, D) -> None:
    """Shapes, dtypes and devices of the inputs (errors naming the argument)."""
    for name, t, dims in (("x", x, "[B, T, H, P]"), ("B", B, "[B, T, G, N]"), ("C", C, "[B, T, G, N]"),
                          ("dt", dt, "[B, T, H]"), ("A", A, "[H]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor {dims}, got {type(t).__name__}")
        if t.dim() != dims.count(",") + 1:
            raise ValueError(f"{op}: {name} must have shape {dims}, got {tuple(t.shape)}")
        check_float(op, name, t)
    batch, T, H, _ = x.shape
    if T == 0:
        raise ValueError(f"{op}: the sequence is empty (T = 0)")
    if B.shape[:2] != (batch, T) or B.shape[2] < 1 or H % B.shape[2]:
        raise ValueError(f"{op}: B must have shape [B, T, G, N] with [B, T] = {(batch, T)} and G dividing the "
                         f"H = {H} heads of x, got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"{op}: C must have the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")
    if tuple(dt.shape) != (batch, T, H):
        raise ValueError(f"{op}: dt must have shape [B, T, H] = {(batch, T, H)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"{op}: A must have shape [H] = {(H,)}, got {tuple(A.shape)}")
    if D is not None:
        if not isinstance(D, torch.Tensor) or tuple(D.shape) != (H,) or not D.is_floating_point():
            got = f"{D.dtype} {tuple(D.shape)}" if isinstance(D, torch.Tensor) else type(D).__name__
            raise ValueError(f"{op}: D must be None or a float tensor of shape [H] = {(H,)}, got {got}")
        check_same_device(op, x, D=D)
    for name, t in (("B", B), ("C", C)):
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but x has dtype {x.dtype}; x, B and C must share one "
                            "dtype")
    if dt.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{op}: dt must have x's dtype ({x.dtype}) or float32, got {dt.dtype}")
    check_same_device(op, x, B=B, C=C, dt=dt, A=A)
