"""DeltaNet and Gated DeltaNet, and the generalised (gated) delta rule they share with VLA.

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, HV, dv]``, beta/g ``[B, T, HV]`` (in q's dtype or float32), state S
``[B, HV, dv, dk]``, mask ``[B, T]`` (1 = real token; a pad leaves the state untouched and outputs 0). HV = H, or
HV = m·H for grouped value heads: query/key head j serves value heads jm to jm + m − 1 (the Triton kernels read q
and k in place; the PyTorch forms repeat them). g is a log decay: g > 0 at a real token is refused.

    delta:        S_t = S_{t-1} (I - β_t k_t k_t^T) + β_t v_t k_t^T,            o_t = S_t (scale q_t)
    gated delta:  S_t = exp(g_t) S_{t-1} (I - β_t k_t k_t^T) + β_t v_t k_t^T,   o_t = S_t (scale q_t)

Both are the generalised gated delta rule with write key w_t = β_t k_t:
    S_t = a_t S_{t-1} + (v_t - a_t S_{t-1} k_t) w_t^T,   a_t = exp(g_t),   o_t = S_t q_t,
whose chunk form is ``chunk_generalized_delta`` (VLA uses it with w = α̂ and read key k̂).

Packed batches: ``cu_seqlens`` ``[N + 1]`` (ints from 0 to T, B = 1) holds the boundaries of N sequences
packed along time; states are then ``[N, H, dv, dk]``, one per sequence.
Backend "triton" (auto on CUDA) runs lazoo.kernels.delta: the chunk-parallel WY form with a hand-written
backward, and a fused recurrent kernel for decoding (at most 64 tokens per sequence, no autograd).
"""

from __future__ import annotations

import torch

from ..kernels.limits import DELTA_CHUNK_SIZES, DELTA_FP32_BACKWARD_MAX_HEAD_DIM, DELTA_MAX_HEAD_DIM, KERNEL_DTYPES
from .backend import resolve_backend, triton_unsupported
from .boundary import op_result, prepare_inputs, records_graph, zero_masked
from .checks import check_positive_int, check_scale, no_check, queue_log_decay_check, reported
from .chunks import merge_chunks, pad_time, split_chunks
from .dtypes import compute_dtype, without_autocast
from .norms import l2norm
from .packing import check_cu_seqlens, run_per_sequence
from .states import matrix_initial_state

__all__ = ["chunk_generalized_delta", "delta_rule", "gated_delta_rule"]


# ============================================================================ public ops
@without_autocast
def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float | None = None,
               use_qk_l2norm: bool = True, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
               output_final_state: bool = False, mask: torch.Tensor | None = None, backend: str | None = None,
               cu_seqlens: torch.Tensor | None = None):
    """DeltaNet: ``S_t = S_{t-1}(I - β_t k_t k_t^T) + β_t v_t k_t^T``, ``o_t = S_t (scale q_t)``."""
    return delta_rule_as("delta_rule", q, k, v, None, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                         chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                         mask=mask, backend=backend, cu_seqlens=cu_seqlens)


@without_autocast
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     mask: torch.Tensor | None = None, backend: str | None = None,
                     cu_seqlens: torch.Tensor | None = None, check_g: bool = True):
    """Gated DeltaNet: ``S_t = exp(g_t) S_{t-1}(I - β_t k_t k_t^T) + β_t v_t k_t^T``, g the log decay.
    ``check_g=False`` skips the g <= 0 check and its read-back to the host (which waits for the GPU to get there),
    for a caller whose g is <= 0 by construction (the Gated DeltaNet layer's −exp(·)·softplus(·))."""
    return delta_rule_as("gated_delta_rule", q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                         chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                         mask=mask, backend=backend, cu_seqlens=cu_seqlens, check_g=check_g)


def delta_rule_as(op: str, q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size, initial_state, output_final_state,
                  mask, backend, cu_seqlens=None, check_g: bool = True):
    """The (gated) delta rule with its errors naming ``op``: the body of ``delta_rule`` (g None) and
    ``gated_delta_rule``, and of DeltaProduct's interleaved steps. ``check_g=False``: g is already checked."""
    # β = 0 and g = 0 at a pad: S untouched
    (B, T, H, dk, dv), mask, (q, k, v, g, beta) = prepare_inputs(op, q, k, v, mask, {"g": g, "beta": beta},
                                                                 grouped_values=True, fp32_scalars=True)
    H = v.shape[2]  # the state's heads: the value heads (m per query/key head with grouped value heads)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = check_scale(op, scale, dk)
    chunk_size = check_positive_int(op, "chunk_size", chunk_size)
    backward = records_graph(q, k, v, g, beta, initial_state, scale)
    backend = resolve_backend(op, backend, q.device, delta_kernel_unsupported(q, v, chunk_size, backward))
    # the value check (a host sync) after the cheap ones, read back once the kernels are launched
    report_g = queue_log_decay_check(op, "g", g) if check_g else no_check
    cdt = compute_dtype(q.dtype)

    if backend == "triton":  # no zero state allocated when none is given
        S0 = None if initial_state is None else matrix_initial_state(op, initial_state, N, H, dk, dv,
                                                                     q.device, cdt)
        return reported(report_g, _delta_triton(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, S0,
                                                output_final_state, mask, cu_seqlens, backward))
    report_g()
    S0 = matrix_initial_state(op, initial_state, N, H, dk, dv, q.device, cdt)
    if cu_seqlens is not None:
        return run_per_sequence(
            lambda sl, st: delta_rule_as(
                op, q[:, sl], k[:, sl], v[:, sl], None if g is None else g[:, sl], beta[:, sl], scale=scale,
                use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, initial_state=st, output_final_state=True,
                mask=None if mask is None else mask[:, sl], backend=backend, check_g=False),
            cu_seqlens, S0, output_final_state, q, v)

    q_c, k_c = q.to(cdt), k.to(cdt)
    if use_qk_l2norm:
        q_c, k_c = l2norm(q_c), l2norm(k_c)
    if q_c.shape[2] != H:  # grouped value heads: the PyTorch forms read each query/key head once per value head
        q_c, k_c = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (q_c, k_c))
    q_c = q_c * scale
    v_c, beta_c = v.to(cdt), beta.to(cdt)
    g_c = None if g is None else g.to(cdt)

    if backend == "recurrent":
        o, S = _recurrent_delta(q_c, k_c, v_c, g_c, beta_c, S0)
    else:
        o, S = chunk_generalized_delta(q_c, k_c, v_c, beta_c[..., None] * k_c, g_c, S0, chunk_size)
    return op_result(o, mask, v.dtype, S, output_final_state)


# ============================================================================ Triton path
_DECODE_MAX_T = 64  # fused recurrent kernel up to this many tokens per sequence (no autograd)


def delta_kernel_unsupported(q: torch.Tensor, v: torch.Tensor, chunk_size: int, backward: bool = False) -> str | None:
    """None when lazoo.kernels.delta runs this case (``backward``: with its gradients), else why not (imports no
    kernel; VLA's S update runs it too)."""
    if chunk_size not in DELTA_CHUNK_SIZES:
        return f"the Triton kernel takes chunk_size in {DELTA_CHUNK_SIZES}, got {chunk_size}"
    if backward and q.device.type == "cuda":
        reason = backward_unsupported(q.dtype, q.shape[-1])
        if reason:
            return reason
    return triton_unsupported(q, v, DELTA_MAX_HEAD_DIM, KERNEL_DTYPES)


def backward_unsupported(dtype: torch.dtype, dk: int) -> str | None:
    """Why the GPU backward cannot run inputs of ``dtype`` with key head dim ``dk``, or None."""
    if dtype == torch.float32 and dk > DELTA_FP32_BACKWARD_MAX_HEAD_DIM:
        return (f"its backward takes float32 inputs with dk up to {DELTA_FP32_BACKWARD_MAX_HEAD_DIM} on a GPU (at dk = "
                f"{dk} the reverse state walk needs more shared memory than a block has), got dk={dk}; train in "
                "bfloat16 or float16")
    return None


def _delta_triton(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, S0, output_final_state, mask,
                  cu_seqlens, grad: bool):
    """``grad``: autograd records the call (the caller's ``backward``)."""
    from ..kernels import delta as kd  # lazy: importing defines the kernels

    B, T = q.shape[:2]
    if cu_seqlens is None:
        longest = T
    else:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    if not grad and longest <= _DECODE_MAX_T:
        o, S = kd.fused_recurrent_delta_rule(
            q, k, v, beta, g, scale=float(scale), initial_state=S0, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    else:
        l2_inside = use_qk_l2norm and not isinstance(scale, torch.Tensor)  # the kernels' own pass (same formula)
        if use_qk_l2norm and not l2_inside:  # a learned scale multiplies the normalised q: keep it in autograd
            q, k = kd.l2norm(q), kd.l2norm(k)
        if isinstance(scale, torch.Tensor):
            q, scale = (q * scale).to(q.dtype), 1.0
        o, S = kd.chunk_delta_rule(q, k, v, beta, g, scale=scale, initial_state=S0,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                   chunk_size=chunk_size, use_qk_l2norm=l2_inside)
    o = zero_masked(o, mask)
    return o, (S if output_final_state else None)


# ============================================================================ recurrent form
def _recurrent_delta(q, k, v, g, beta, S):
    """Literal step-by-step reference (β = 0 and g = 0 at pads leave S unchanged)."""
    outs = []
    for t in range(q.shape[1]):
        k_t, b_t = k[:, t], beta[:, t, :, None]  # [B, H, dk], [B, H, 1]
        if g is not None:
            S = g[:, t, :, None, None].exp() * S
        Sk = torch.einsum("bhvk,bhk->bhv", S, k_t)
        # S (I - β k k^T) + β v k^T = S + β (v - S k) k^T
        S = S + (b_t * (v[:, t] - Sk))[..., None] * k_t[:, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


# ============================================================================ chunk form
def chunk_generalized_delta(q, k, v, w, g, S0, chunk_size: int):
    """Chunk-parallel generalised gated delta rule.

        S_t = a_t S_{t-1} + (v_t - a_t S_{t-1} k_t) w_t^T,   a_t = exp(g_t),   o_t = S_t q_t

    q, k, w ``[B, T, H, dk]``, v ``[B, T, H, dv]``, g ``[B, T, H]`` or None (no gate), S0
    ``[B, H, dv, dk]``, all in the compute dtype; any T. A position with w = 0 and g = 0 leaves
    the state untouched. Per chunk (rows = time, G = cumsum of g inside the chunk, γ = exp(G)):
        L[t, i] = exp(G_t - G_i) (k_t · w_i) for i < t,   U = (I + L)^{-1} (V - diag(γ) K S0^T)
        O       = diag(γ) Q S0^T + (tril ⊙ exp(G_t - G_i) ⊙ Q W^T) U
        S_end   = γ_C S0 + U^T (exp(G_C - G) ⊙ W)
    (U holds the pseudo-values u_t = v_t - a_t S_{t-1} k_t.) Returns ``(o [B, T, H, dv], S_end)``.
    """
    T = q.shape[1]
    C = min(chunk_size, T)
    Q, K, V, Wr = (split_chunks(pad_time(x, C), C) for x in (q, k, v, w))  # [B, H, N, C, d]
    N = Q.shape[2]
    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    tril, strict = ones.tril(), ones.tril(-1)

    L = (K @ Wr.transpose(-1, -2)).masked_fill(~strict, 0.0)
    P = (Q @ Wr.transpose(-1, -2)).masked_fill(~tril, 0.0)
    if g is not None:
        G = split_chunks(pad_time(g, C)[..., None], C)[..., 0].cumsum(-1)  # [B, H, N, C]
        # exp only where i <= t, so exp(G_t - G_i) <= 1 and never overflows.
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~tril, 0.0).exp()
        L, P = L * D, P * D
        gamma = G.exp()[..., None]  # [B, H, N, C, 1]
        K = K * gamma
        Wr = Wr * (G[..., -1:] - G).exp()[..., None]  # exp(G_C - G_i) w_i

    # (I + L)^{-1} applied to V and to γK, in parallel over all chunks.
    I_L = L + torch.eye(C, dtype=L.dtype, device=L.device)
    U_v = torch.linalg.solve_triangular(I_L, V, upper=False, unitriangular=True)
    U_k = torch.linalg.solve_triangular(I_L, K, upper=False, unitriangular=True)

    # Sequential over chunks: each chunk's pseudo-values depend on its start state.
    starts, pseudo, S = [], [], S0
    for n in range(N):
        starts.append(S)
        U = U_v[:, :, n] - U_k[:, :, n] @ S.transpose(-1, -2)  # [B, H, C, dv]
        pseudo.append(U)
        decay = 1.0 if g is None else G[:, :, n, -1].exp()[..., None, None]
        S = decay * S + U.transpose(-1, -2) @ Wr[:, :, n]
    S_start = torch.stack(starts, dim=2)  # [B, H, N, dv, dk]
    U = torch.stack(pseudo, dim=2)  # [B, H, N, C, dv]

    O_inter = Q @ S_start.transpose(-1, -2)
    if g is not None:
        O_inter = O_inter * gamma
    return merge_chunks(O_inter + P @ U, T), S
