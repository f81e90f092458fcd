"""What every op does at its boundary. Its preamble, ``prepare_inputs``: q, k, v and the other per-token inputs
checked, the mask as bool, and every input zeroed at the pads (a NaN at a pad never meets a real token). Its result,
``op_result``: the output with its pads zeroed, in the input dtype, and the final state if it was asked for."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .checks import check_head_scalar, check_like_q, check_mask, check_qkv


def prepare_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scalars: Mapping[str, torch.Tensor | None] | None = None,
                   like_q: Mapping[str, torch.Tensor] | None = None, grouped_values: bool = False,
                   grouped_kv: bool = False, fp32_scalars: bool = False) -> tuple:
    """The preamble the ops share: check q, k, v (``check_qkv``), the per-head scalars ``scalars`` (``[B, T, H]``;
    None entries are absent inputs) and the inputs ``like_q`` (q's shape), then the mask; zero every one of them
    at the pads (``apply_mask``). Returns ``((B, T, H, dk, dv), bool mask or None, (q, k, v, *scalars, *like_q))``
    with the inputs in that order. ``grouped_values``: v may have m·H heads, the scalars then v's heads.
    ``grouped_kv``: k and v may have fewer heads than q, a divisor of them
    (grouped-query attention). ``fp32_scalars``: the scalars may be float32 whatever q's dtype."""
    scalars, like_q = scalars or {}, like_q or {}
    sizes = check_qkv(op, q, k, v, grouped_values=grouped_values, grouped_kv=grouped_kv)
    for name, x in scalars.items():
        if x is not None:
            check_head_scalar(op, name, x, q, heads=v if grouped_values else None,
                              fp32_ok=fp32_scalars)
    for name, x in like_q.items():
        check_like_q(op, name, x, q)
    mask, inputs = apply_mask(op, mask, q, k, v, *scalars.values(), *like_q.values())
    return sizes, mask, inputs


def apply_mask(op: str, mask: torch.Tensor | None, q: torch.Tensor, *inputs: torch.Tensor | None) -> tuple:
    """Check ``mask`` against q's ``[B, T]`` and device (``check_mask``) and zero ``q`` and ``inputs`` (None
    passes) at the pads (``zero_pads``): ``(bool mask or None, (q, *inputs))``."""
    mask = check_mask(op, mask, q.shape[0], q.shape[1], q.device)
    return mask, zero_pads(mask, q, *inputs)


def op_result(o: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype, final_state,
              output_final_state: bool) -> tuple:
    """What an op returns: the output with its pads zeroed, in ``dtype`` (the input's), and the final state
    if it was asked for (else None)."""
    return zero_masked(o, mask).to(dtype), (final_state if output_final_state else None)


def empty_batch_result(q: torch.Tensor, v: torch.Tensor, state, output_final_state: bool) -> tuple:
    """An op's result for an empty batch (B = 0): nothing to read, the (empty) state passes through."""
    return v.new_zeros(*q.shape[:3], v.shape[-1]), (state if output_final_state else None)


def time_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a ``[B, T]`` bool mask against a ``[B, T, ...]`` tensor (None -> ones)."""
    if mask is None:
        return torch.ones((), dtype=torch.bool, device=x.device)
    return mask.view(mask.shape + (1,) * (x.dim() - 2))


def zero_masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero ``x`` ``[B, T, ...]`` at padded positions (autograd-safe, never NaN)."""
    if mask is None:
        return x
    return torch.where(time_mask(mask, x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def records_graph(*inputs) -> bool:
    """Whether autograd records an op called on ``inputs``: grad mode is on and one of them (None and non-tensors
    skipped) wants a gradient. Ops pick their kernels by it (a decode kernel, a forward that saves nothing)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def zero_pads(mask: torch.Tensor | None, *xs: torch.Tensor | None) -> tuple:
    """Every ``[B, T, ...]`` input with its pads set to 0 (None passes through): done once at an op's boundary,
    so that a NaN or Inf at a pad never meets a real token (0 * NaN is NaN) in any backend or kernel, and the
    gradient at a pad is exactly 0."""
    return tuple(None if x is None else zero_masked(x, mask) for x in xs)
