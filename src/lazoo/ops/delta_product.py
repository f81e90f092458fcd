"""DeltaProduct (Siems et al. 2025): n_h generalised Householder steps per token.

Per token t, with keys k_{t,j}, values v_{t,j}, step sizes β_{t,j} (j = 1..n_h) and an optional
log decay g_t (one per token):

    S ← exp(g_t) S                                            (once, before the first step)
    S ← S (I - β_{t,j} k_{t,j} k_{t,j}^T) + β_{t,j} v_{t,j} k_{t,j}^T     for j = 1..n_h
    o_t = S (scale q_t)                                         (after the last step)

i.e. ``S_t = exp(g_t) S_{t-1} Π_j (I - β_{t,j} k_{t,j} k_{t,j}^T) + Σ_j (β_{t,j} v_{t,j} k_{t,j}^T)
Π_{i>j} (I - β_{t,i} k_{t,i} k_{t,i}^T)``. With n_h = 1 it is DeltaNet (Gated DeltaNet with g).

Layout: q ``[B, T, H, dk]``; k ``[B, T, H, n_h, dk]``, v ``[B, T, H, n_h, dv]``, beta
``[B, T, H, n_h]`` (or the interleaved time-major form ``[B, T·n_h, H, d]`` / ``[B, T·n_h, H]``,
step j of token t at index t·n_h + j, as flash-linear-attention takes them); g ``[B, T, H]`` or
None; state S ``[B, H, dv, dk]``; mask ``[B, T]`` (a pad leaves S untouched and outputs 0).
``use_qk_l2norm`` L2-normalises q and every k_{t,j} (as the delta rule op does).

Backends: "recurrent" is a literal per-token, per-step loop (float64-capable reference). "chunk" and
"triton" (auto on CUDA) interleave the steps into one sequence of length T·n_h and run the public
``delta_rule``/``gated_delta_rule`` op on it with the backend passed through (the gate sits on each
token's first step, the output is read at its last step), so whatever kernel that op has serves
DeltaProduct too. ``chunk_size`` counts steps of that sequence.
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .boundary import apply_mask, op_result
from .checks import (
    check_float,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_scale,
    queue_log_decay_check,
)
from .delta import delta_rule_as
from .dtypes import compute_dtype, without_autocast
from .norms import l2norm
from .states import matrix_initial_state

__all__ = ["delta_product"]


@without_autocast
def delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    num_householder: int | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
):
    """DeltaProduct with n_h Householder steps per token (see the module docstring).

    ``num_householder`` is read from the shapes (k's 4th dim, or ``k.shape[1] // T`` for the
    interleaved form); if given it must match. Returns ``(o [B, T, H, dv], final S or None)``.
    """
    op = "delta_product"
    q, k, v, beta, n = _check_inputs(op, q, k, v, beta, g, num_householder)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    mask, (q, k, v, beta, g) = apply_mask(op, mask, q, k, v, beta, g)  # a NaN at a pad never meets a real token
    scale = check_scale(op, scale, dk)
    chunk_size = check_positive_int(op, "chunk_size", chunk_size)
    cdt = compute_dtype(q.dtype)

    # validates backend / LAZOO_BACKEND; the chunk and triton choices are left to the delta rule op
    mode = resolve_backend(op, backend, q.device, None)
    # the value check (a host sync) after the cheap ones, read back once the kernels are launched
    report_g = queue_log_decay_check(op, "g", g)
    if mode == "recurrent":
        report_g()
        S0 = matrix_initial_state(op, initial_state, B, H, dk, dv, q.device, cdt)
        o, S = _recurrent_delta_product(q.to(cdt), k.to(cdt), v.to(cdt), beta.to(cdt),
                                        None if g is None else g.to(cdt), S0, scale, use_qk_l2norm, mask)
        return op_result(o, mask, v.dtype, S, output_final_state)

    # interleave: step j of token t -> position t * n + j of a sequence of length T * n
    k_x = k.transpose(2, 3).reshape(B, T * n, H, dk)
    v_x = v.transpose(2, 3).reshape(B, T * n, H, dv)
    b_x = beta.transpose(2, 3).reshape(B, T * n, H)
    q_x = q[:, :, None].expand(B, T, n, H, dk).reshape(B, T * n, H, dk)
    m_x = None if mask is None else mask[:, :, None].expand(B, T, n).reshape(B, T * n)
    g_x = None if g is None else torch.cat([g[:, :, None], g.new_zeros(B, T, n - 1, H)], 2).reshape(B, T * n, H)
    # the delta rule under this op's name, so that its errors say "delta_product:"
    o_x, S = delta_rule_as(op, q_x, k_x, v_x, g_x, b_x, scale=scale, use_qk_l2norm=use_qk_l2norm,
                           chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                           mask=m_x, backend=backend, check_g=False)
    report_g()
    o = o_x.view(B, T, n, H, dv)[:, :, -1]  # each token's output after its last step
    return op_result(o, mask, v.dtype, S, output_final_state)


# ============================================================================ recurrent form
def _recurrent_delta_product(q, k, v, beta, g, S, scale, use_qk_l2norm, mask):
    """Literal per-token loop over the n_h steps (k ``[B, T, H, n, dk]``; compute dtype)."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    outs = []
    for t in range(q.shape[1]):
        S_prev = S
        if g is not None:
            S = g[:, t, :, None, None].exp() * S
        for j in range(k.shape[3]):
            k_j, b_j = k[:, t, :, j], beta[:, t, :, j, None]  # [B, H, dk], [B, H, 1]
            Sk = torch.einsum("bhvk,bhk->bhv", S, k_j)
            # S (I - β k k^T) + β v k^T = S + β (v - S k) k^T
            S = S + (b_j * (v[:, t, :, j] - Sk))[..., None] * k_j[:, :, None, :]
        if mask is not None:
            S = torch.where(mask[:, t, None, None, None], S, S_prev)
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


# ============================================================================ checks
def _check_inputs(op, q, k, v, beta, g, num_householder):
    """Return (q, k [B,T,H,n,dk], v [B,T,H,n,dv], beta [B,T,H,n], n) after validation."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must have 4 dimensions [B, T, H, dk], got shape {tuple(q.shape)}")
    check_float(op, "q", q)
    B, T, H, dk = q.shape
    if T == 0:
        raise ValueError(f"{op}: the sequence is empty (T = 0)")
    if k.dim() == 5:
        n = k.shape[3]
        want_k, want_b = (B, T, H, n, dk), (B, T, H, n)
        if tuple(k.shape) != want_k:
            raise ValueError(f"{op}: k must have shape [B, T, H, n_h, dk] = {want_k}, got {tuple(k.shape)}")
        if v.dim() != 5 or tuple(v.shape[:4]) != want_b:
            raise ValueError(f"{op}: v must have shape [B, T, H, n_h, dv] with [B, T, H, n_h] = {want_b}, "
                             f"got {tuple(v.shape)}")
        if tuple(beta.shape) != want_b:
            raise ValueError(f"{op}: beta must have shape [B, T, H, n_h] = {want_b}, got {tuple(beta.shape)}")
    elif k.dim() == 4:
        if k.shape[1] % T or k.shape[1] == 0:
            raise ValueError(f"{op}: interleaved k must have shape [B, T*n_h, H, dk] with T={T}, got {tuple(k.shape)}")
        n = k.shape[1] // T
        if tuple(k.shape) != (B, T * n, H, dk):
            raise ValueError(f"{op}: interleaved k must have shape {(B, T * n, H, dk)}, got {tuple(k.shape)}")
        if v.dim() != 4 or tuple(v.shape[:3]) != (B, T * n, H):
            raise ValueError(f"{op}: interleaved v must have shape [B, T*n_h, H, dv] = {(B, T * n, H)} + (dv,), "
                             f"got {tuple(v.shape)}")
        if tuple(beta.shape) != (B, T * n, H):
            raise ValueError(f"{op}: interleaved beta must have shape {(B, T * n, H)}, got {tuple(beta.shape)}")
        k = k.view(B, T, n, H, dk).transpose(2, 3)
        v = v.view(B, T, n, H, v.shape[-1]).transpose(2, 3)
        beta = beta.view(B, T, n, H).transpose(2, 3)
    else:
        raise ValueError(f"{op}: k must have shape [B, T, H, n_h, dk] or [B, T*n_h, H, dk], got {tuple(k.shape)}")
    if num_householder is not None and num_householder != n:
        raise ValueError(f"{op}: num_householder={num_householder} but k holds {n} steps per token")
    check_float(op, "beta", beta)
    check_same_dtype(op, q, k=k, v=v, beta=beta)
    check_same_device(op, q, k=k, v=v, beta=beta)
    if g is not None:
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (B, T, H):
            raise ValueError(f"{op}: g must be None or a tensor of shape [B, T, H] = {(B, T, H)}, got "
                             f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        check_float(op, "g", g)
        check_same_dtype(op, q, g=g)
        check_same_device(op, q, g=g)
    return q, k, v, beta, n
