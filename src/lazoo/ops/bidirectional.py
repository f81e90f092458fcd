"""Non-causal normalised linear attention: every position sees every position (no prefix sums).

With φ the feature map, per sample and head:

    S = Σ_j v_j φ(k_j)^T   [dv, dk],   z = Σ_j φ(k_j)   [dk],   o_i = S φ(q_i) / max(φ(q_i)·z, eps)

two matmuls, O(T·dk·dv) time and O(dk·dv) extra memory; the T×T score matrix of the quadratic form
``o_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j)`` is never formed. The sums run over the real positions
of ``mask`` only. Used by the vision models' global mixing (``lazoo.vision.attention``) and the
bidirectional Memory Lobe (``lazoo.layers.memory_lobe``).

Backends: "triton" (auto on CUDA) runs the causal form's kernels without their score tiles
(``lazoo.kernels.normalized`` with ``causal=False``: each sample's sums once, then every token's output from them),
with the features formed in the inputs' dtype; "chunk" and "recurrent" (auto on CPU) are the two matmuls in float32.

Unlike the causal ops, this one is not wrapped in ``without_autocast``: it follows the caller's autocast, as it
always has in those two modules (the einsums run in its dtype, and the kernels take their inputs in it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backend import resolve_backend
from .boundary import zero_masked, zero_pads
from .checks import check_mask, check_qkv
from .dtypes import compute_dtype
from .linear import get_feature_map, linear_kernel_unsupported

__all__ = ["bidirectional_linear_attention"]


def bidirectional_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | Callable = "elu1",
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, None]:
    """Non-causal normalised linear attention. q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask
    ``[B, T]`` (1 = real position; a pad contributes nothing and outputs 0). ``backend``: "triton", "chunk",
    "recurrent" or None (auto; module docstring). The matmul forms compute in float32 (float64 for float64 inputs).
    Returns ``(o [B, T, H, dv] in v's dtype, None)`` (no state: the whole sequence is summed at once)."""
    op = "bidirectional_linear_attention"
    B, T, H, dk, dv = check_qkv(op, q, k, v)
    mask = check_mask(op, mask, B, T, q.device)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"{op}: eps must be a positive number, got {eps!r}")
    phi = get_feature_map(feature_map, op)
    cdt = compute_dtype(q.dtype)
    out_dtype = v.dtype
    q, k, v = zero_pads(mask, q, k, v)  # a NaN at a pad never meets a real position
    if resolve_backend(op, backend, q.device, linear_kernel_unsupported(q, v)) == "triton":
        return _bidirectional_triton(q, k, v, phi, eps, mask).to(out_dtype), None
    fq = phi(q.to(cdt))
    fk = zero_masked(phi(k.to(cdt)), mask)  # φ(0) need not be 0 (elu+1 gives 1)
    S = torch.einsum("bthv,bthk->bhvk", v.to(cdt), fk)
    z = fk.sum(1)  # [B, H, dk]
    num = torch.einsum("bhvk,bthk->bthv", S, fq)
    den = torch.einsum("bhk,bthk->bth", z, fq)[..., None].clamp_min(eps)
    return zero_masked(num / den, mask).to(v.dtype), None


def _bidirectional_triton(q, k, v, phi, eps, mask):
    """The non-causal kernels on φ(q), φ(k) formed in the inputs' dtype (the autocast dtype where autocast is on,
    as the einsums would run)."""
    from ..kernels.normalized import chunk_normalized_linear_attention

    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    fk = zero_masked(phi(k), mask)  # φ(0) need not be 0 (elu+1 gives 1)
    o, _ = chunk_normalized_linear_attention(phi(q), fk, v, eps=eps, causal=False)
    return zero_masked(o, mask)
