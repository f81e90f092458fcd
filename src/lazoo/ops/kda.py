"""Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel ("Kimi Linear: An Expressive,
Efficient Attention Architecture", Kimi Team, 2025).

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, HV, dv]``, g ``[B, T, HV, dk]`` (a log decay per key channel, <= 0),
beta ``[B, T, HV]``, state S ``[B, HV, dv, dk]``, mask ``[B, T]`` (1 = real token; a pad leaves the state untouched
and outputs 0). HV = H, or HV = m·H for grouped value heads: query/key head j serves value heads jm to jm + m − 1
(the Triton kernels read q and k in place; the PyTorch forms repeat them). g and beta may be float32 beside
half-precision q, k, v.

    S_t = S_{t-1} Diag(exp(g_t)) (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,      o_t = S_t (scale q_t)

(the decay first, then the delta-rule write against the decayed state: with S' = S_{t-1} Diag(exp(g_t)),
S_t = S' + β_t (v_t - S' k_t) k_tᵀ). It is Gated DeltaNet with GLA's gate: one decay per key dim in place of one
per head. ``use_qk_l2norm`` divides q and k by sqrt(|x|² + 1e-6) first (as Kimi Linear and fla do).

Chunk form (C rows, G the cumulative log decay inside the chunk ``[C, dk]``, S the chunk's start state):

    Aqk[t, i] = Σ_d q_td k_id exp(G_td - G_id)  (i <= t),      Mkk[t, i] = Σ_d k_td k_id exp(G_td - G_id)  (i < t)
    A = (I + diag(β) Mkk)^{-1},   W = A diag(β) (K ⊙ exp(G)),   U = A diag(β) V - W Sᵀ
    O = (Q ⊙ exp(G)) Sᵀ + Aqk U,  S_end = S Diag(exp(G_C)) + Uᵀ (K ⊙ exp(G_C - G))

(U holds the pseudo-values u_t = β_t (v_t - S'_t k_t)). The decays are formed per pair (exp(G_t - G_i) with
i <= t, never exp(G_t) exp(-G_i)), so any gate strength is stable; the ``[C, C, dk]`` decays make the PyTorch chunk
form memory-hungry, hence its small default chunk (the Triton kernels use their own chunks of 64).

Packed batches: ``cu_seqlens`` ``[N + 1]`` (ints from 0 to T, B = 1) holds the boundaries of N sequences packed along
time; states are then ``[N, HV, dv, dk]``, one per sequence.
Backend "triton" (auto on CUDA) runs lazoo.kernels.kda: the chunked form with a hand-written backward, and a fused
recurrent kernel for decoding (few tokens, no autograd).
"""

from __future__ import annotations

import torch

from ..kernels.limits import KDA_MAX_HEAD_DIM, KERNEL_DTYPES
from .backend import resolve_backend, triton_unsupported
from .boundary import op_result, prepare_inputs, records_graph, zero_masked, zero_pads
from .checks import (
    check_float,
    check_positive_int,
    check_same_device,
    check_scale,
    kernel_log_decay_check,
    no_check,
    queue_log_decay_check,
)
from .chunks import merge_chunks, pad_time, split_chunks
from .dtypes import compute_dtype, without_autocast
from .norms import l2norm
from .packing import check_cu_seqlens, run_per_sequence
from .states import matrix_initial_state

__all__ = ["chunk_kda", "kda"]

_OP = "kda"
#: the fused recurrent kernel runs sequences up to this many tokens (no autograd)
_DECODE_MAX_T = 64


@without_autocast
def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
        scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 16,
        initial_state: torch.Tensor | None = None, output_final_state: bool = False,
        mask: torch.Tensor | None = None, backend: str | None = None, cu_seqlens: torch.Tensor | None = None):
    """Kimi Delta Attention (module docstring). Returns ``(o [B, T, HV, dv] in v's dtype, final state
    [B, HV, dv, dk] or None)``; the state in float32 (float64 for float64 inputs). ``chunk_size`` is the PyTorch
    chunk form's (the Triton kernels have their own)."""
    (B, T, H, dk, dv), mask, (q, k, v, beta) = prepare_inputs(_OP, q, k, v, mask, {"beta": beta},
                                                              grouped_values=True, fp32_scalars=True)
    HV = v.shape[2]
    _check_gate(g, q, v)
    (g,) = zero_pads(mask, g)  # a pad neither decays nor writes (β = 0 there too)
    cu_seqlens = check_cu_seqlens(_OP, cu_seqlens, B, T, q.device, mask)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = check_scale(_OP, scale, dk)
    chunk_size = check_positive_int(_OP, "chunk_size", chunk_size)
    backend = resolve_backend(_OP, backend, q.device, kda_kernel_unsupported(q, v))
    cdt = compute_dtype(q.dtype)

    if backend == "triton":
        S0 = None if initial_state is None else matrix_initial_state(_OP, initial_state, N, HV, dk, dv,
                                                                     q.device, torch.float32)
        return _kda_triton(q, k, v, g, beta, scale, use_qk_l2norm, S0, output_final_state, mask, cu_seqlens)
    queue_log_decay_check(_OP, "g", g)()
    S0 = matrix_initial_state(_OP, initial_state, N, HV, dk, dv, q.device, cdt)
    if cu_seqlens is not None:
        return run_per_sequence(
            lambda sl, st: kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale,
                               use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, initial_state=st,
                               output_final_state=True, backend=backend),
            cu_seqlens, S0, output_final_state, q, v)

    q_c, k_c = q.to(cdt), k.to(cdt)
    if use_qk_l2norm:
        q_c, k_c = l2norm(q_c), l2norm(k_c)
    if H != HV:  # grouped value heads: the PyTorch forms read each query/key head once per value head
        q_c, k_c = (x.repeat_interleave(HV // H, dim=2) for x in (q_c, k_c))
    q_c = q_c * scale
    v_c, g_c, beta_c = v.to(cdt), g.to(cdt), beta.to(cdt)
    if backend == "recurrent":
        o, S = _recurrent_kda(q_c, k_c, v_c, g_c, beta_c, S0)
    else:
        o, S = chunk_kda(q_c, k_c, v_c, g_c, beta_c, S0, chunk_size)
    return op_result(o, mask, v.dtype, S, output_final_state)


def _check_gate(g, q, v) -> None:
    """g ``[B, T, HV, dk]`` (v's heads, q's key dim), float, in q's dtype or float32, on q's device."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{_OP}: g must be a torch.Tensor [B, T, HV, dk], got {type(g).__name__}")
    shape = (*v.shape[:3], q.shape[-1])
    if tuple(g.shape) != shape:
        raise ValueError(f"{_OP}: g must have shape [B, T, HV, dk] = {shape} (a log decay per value head and key "
                         f"dim), got {tuple(g.shape)}")
    check_float(_OP, "g", g)
    if g.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"{_OP}: g must have q's dtype ({q.dtype}) or float32, got {g.dtype}")
    check_same_device(_OP, q, g=g)


# ============================================================================ Triton path
def kda_kernel_unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when lazoo.kernels.kda runs this case, else why not (imports no kernel)."""
    reason = triton_unsupported(q, v, KDA_MAX_HEAD_DIM, KERNEL_DTYPES)
    if reason is None and min(q.shape[-1], v.shape[-1]) < 16:
        reason = f"the Triton kernels take head dims of at least 16, got dk={q.shape[-1]}, dv={v.shape[-1]}"
    return reason


def _kda_triton(q, k, v, g, beta, scale, use_qk_l2norm, S0, output_final_state, mask, cu_seqlens):
    from ..kernels import kda as kk  # lazy: importing defines the kernels

    grad = records_graph(q, k, v, g, beta, S0, scale)
    T = q.shape[1]
    longest = T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if isinstance(scale, torch.Tensor):  # a learned scale: kept in autograd
        q, scale = (q * scale).to(q.dtype), 1.0
    if not grad and longest <= _DECODE_MAX_T:
        report_g = queue_log_decay_check(_OP, "g", g)  # read back once the kernel is launched
        o, S = kk.fused_recurrent_kda(q, k, v, g, beta, scale=float(scale), initial_state=S0,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    else:  # the forward's first kernel, which reads g anyway, compares it
        gate_check = kernel_log_decay_check(_OP, "g", g)
        o, S = kk.chunk_kda(q, k, v, g, beta, scale=float(scale), initial_state=S0,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, gate_check=gate_check)
        report_g = gate_check or no_check
    report_g()
    return zero_masked(o, mask), (S if output_final_state else None)


# ============================================================================ recurrent form
def _recurrent_kda(q, k, v, g, beta, S):
    """Literal step-by-step reference (g = 0 and β = 0 at pads leave S unchanged); q is already scaled."""
    outs = []
    for t in range(q.shape[1]):
        k_t = k[:, t]  # [B, H, dk]
        S = S * g[:, t, :, None, :].exp()  # the decay of every key dim
        Sk = torch.einsum("bhvk,bhk->bhv", S, k_t)
        S = S + (beta[:, t, :, None] * (v[:, t] - Sk))[..., None] * k_t[:, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


# ============================================================================ chunk form
def chunk_kda(q, k, v, g, beta, S0, chunk_size: int):
    """The chunk form of the module docstring, in the op layout and compute dtype (q scaled, heads repeated), any
    T: ``(o [B, T, H, dv], S_end [B, H, dv, dk])``. A position with k = 0, β = 0 and g = 0 leaves the state
    untouched (the padding of the last chunk)."""
    T = q.shape[1]
    C = min(chunk_size, T)
    Q, K, V, Gd = (split_chunks(pad_time(x, C), C) for x in (q, k, v, g))  # [B, H, N, C, d]
    b = split_chunks(pad_time(beta, C)[..., None], C)  # [B, H, N, C, 1]
    G = Gd.cumsum(-2)
    N = Q.shape[2]
    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    tril, strict = ones.tril(), ones.tril(-1)
    # exp(G_t - G_i) for i <= t only (<= 1: never overflows)
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~tril[..., None], float("-inf")).exp()
    Aqk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", Q, K, D)
    Mkk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", K, K, D).masked_fill(~strict, 0.0)
    I_L = torch.eye(C, dtype=q.dtype, device=q.device) + b * Mkk
    U_v = torch.linalg.solve_triangular(I_L, b * V, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(I_L, b * K * G.exp(), upper=False, unitriangular=True)
    Qg = Q * G.exp()
    Kd = K * (G[..., -1:, :] - G).exp()  # decayed to the chunk's end
    outs, S = [], S0
    for n in range(N):
        U = U_v[:, :, n] - W[:, :, n] @ S.transpose(-1, -2)  # [B, H, C, dv]
        outs.append(Qg[:, :, n] @ S.transpose(-1, -2) + Aqk[:, :, n] @ U)
        S = S * G[:, :, n, -1, None, :].exp() + U.transpose(-1, -2) @ Kd[:, :, n]
    return merge_chunks(torch.stack(outs, dim=2), T), S
