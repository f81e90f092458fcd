"""Linear attention (feature map, optional normaliser) and gated linear attention (scalar decay).

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, gates ``[B, T, H]``, state S ``[B, H, dv, dk]``,
normaliser z ``[B, H, dk]``, mask ``[B, T]`` (1 = real token; a pad leaves the state untouched
and outputs 0).

    linear:  S_t = S_{t-1} + v_t φ(k_t)^T,  z_t = z_{t-1} + φ(k_t),
             o_t = S_t φ(q_t) / max(φ(q_t)·z_t, eps)   (or S_t φ(q_t) without normaliser)
    gated:   S_t = exp(g_t) S_{t-1} + v_t k_t^T,  o_t = S_t (scale q_t),  g_t <= 0 (log decay; g > 0 at a real
             token is refused). Grouped heads: q/k ``[B, T, H, dk]`` with v ``[B, T, m·H, dv]``, g ``[B, T, m·H]``
             and the state ``[B, m·H, dv, dk]``: query/key head j serves value heads jm to jm + m − 1 (the Triton
             kernels read q and k in place; the PyTorch forms repeat them)
    gla:     S_t = S_{t-1} diag(exp(g_t)) + v_t k_t^T,  o_t = S_t (scale q_t),  g_t ``[B, T, H, dk]``
             (a decay per key dim, GLA)

Packed batches: ``cu_seqlens`` ``[N + 1]`` (int, starting at 0 and ending at T, B = 1) holds the
boundaries of N sequences packed along time; states are then ``[N, ...]``, one per sequence.
Backend "triton" (auto on CUDA) runs lazoo.kernels.linear (lazoo.kernels.gla for gla; lazoo.kernels.normalized
with the normaliser, which it forms inside the chunks): chunked forward and hand-written backward, and a fused
recurrent kernel for decoding (T <= 16 without autograd).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels.limits import KERNEL_DTYPES, LINEAR_MAX_HEAD_DIM
from .backend import resolve_backend, triton_unsupported
from .boundary import op_result, prepare_inputs, records_graph, zero_masked
from .checks import check_positive_int, check_scale, no_check, queue_log_decay_check, reported
from .chunks import merge_chunks, pad_time, split_chunks
from .dtypes import compute_dtype, without_autocast
from .packing import check_cu_seqlens, run_per_sequence
from .scan import time_cumsum
from .states import check_state_dict, check_state_tensor, matrix_initial_state

__all__ = ["FEATURE_MAPS", "chunk_gated_linear", "chunk_gla", "gated_linear_attention", "gla", "linear_attention"]

FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu1": lambda x: F.elu(x) + 1.0,
    "identity": lambda x: x,
    "relu": F.relu,
}


def get_feature_map(name: str | Callable, op: str = "linear_attention") -> Callable:
    """Look up a feature map by name (a callable is returned as is)."""
    if callable(name):
        return name
    if name not in FEATURE_MAPS:
        raise ValueError(f"{op}: unknown feature_map {name!r}; valid names are {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name]


# ============================================================================ public ops
@without_autocast
def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | Callable = "elu1",
    normalize: bool = True,
    eps: float = 1e-6,
    chunk_size: int = 64,
    initial_state: dict[str, torch.Tensor] | torch.Tensor | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Causal linear attention. State: ``{"S", "z"}`` if normalize else the tensor S."""
    return linear_attention_as("linear_attention", q, k, v, feature_map=feature_map, normalize=normalize, eps=eps,
                               chunk_size=chunk_size, initial_state=initial_state,
                               output_final_state=output_final_state, mask=mask, backend=backend,
                               cu_seqlens=cu_seqlens)


def linear_attention_as(op: str, q, k, v, *, feature_map, normalize, eps, chunk_size, initial_state,
                        output_final_state, mask, backend, cu_seqlens):
    """``linear_attention`` with its errors naming ``op`` (ELA runs it on its features)."""
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(op, q, k, v, mask)  # a NaN at a pad never meets a real token
    phi = get_feature_map(feature_map, op)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device, mask)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    chunk_size = check_positive_int(op, "chunk_size", chunk_size)
    backend = resolve_backend(op, backend, q.device, linear_kernel_unsupported(q, v))
    cdt = compute_dtype(q.dtype)

    if backend == "triton":
        return _linear_triton(op, q, k, v, phi, normalize, eps, chunk_size, initial_state,
                              output_final_state, mask, cu_seqlens, N)
    if cu_seqlens is not None:
        return run_per_sequence(
            lambda sl, st: linear_attention_as(
                op, q[:, sl], k[:, sl], v[:, sl], feature_map=feature_map, normalize=normalize, eps=eps,
                chunk_size=chunk_size, initial_state=st, output_final_state=True, mask=None, backend=backend,
                cu_seqlens=None),
            cu_seqlens, _as_state(_linear_initial_state(op, initial_state, normalize, N, H, dk, dv, q.device, cdt),
                                  normalize), output_final_state, q, v)

    S0, z0 = _linear_initial_state(op, initial_state, normalize, B, H, dk, dv, q.device, cdt)
    fq = phi(q.to(cdt))
    fk = zero_masked(phi(k.to(cdt)), mask)  # a pad adds nothing to S or z
    v_c = v.to(cdt)

    if backend == "recurrent":
        o, S, z = _recurrent_linear(fq, fk, v_c, S0, z0, mask, normalize, eps)
    else:
        o, S = chunk_gated_linear(fq, fk, v_c, None, S0, chunk_size)
        z = None
        if normalize:
            z_t = z0[:, None] + time_cumsum(fk)  # [B, T, H, dk]: z after each step
            o = o / _denominator(fq, z_t, eps)
            z = z_t[:, -1]
    return op_result(o, mask, v.dtype, _as_state((S, z), normalize), output_final_state)


@without_autocast
def gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                           scale: float | None = None, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, mask: torch.Tensor | None = None,
                           backend: str | None = None, cu_seqlens: torch.Tensor | None = None):
    """Linear attention with a scalar per-head decay exp(g_t), g ``[B, T, H]`` the log decay (<= 0). v and g may
    have m times q's and k's heads (grouped heads: module docstring)."""
    return _gated_linear("gated_linear_attention", q, k, v, g, _gated_triton, per_key=False, scale=scale,
                         chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                         mask=mask, backend=backend, cu_seqlens=cu_seqlens)


@without_autocast
def gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float | None = None,
        chunk_size: int = 16, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
        mask: torch.Tensor | None = None, backend: str | None = None, cu_seqlens: torch.Tensor | None = None):
    """Gated linear attention with a decay per key dim (GLA): g ``[B, T, H, dk]`` the log decay (<= 0).

    The chunk form materialises ``[C, C, dk]`` decays per chunk (hence the small default chunk);
    the Triton backend is lazoo.kernels.gla (chunks of 64 in 16-row sub-chunks, hand-written backward;
    chunk_size does not apply to it), or the fused recurrent kernel for decoding (T <= 16, no autograd).
    """
    return gla_as("gla", q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state,
                  output_final_state=output_final_state, mask=mask, backend=backend, cu_seqlens=cu_seqlens)


def gated_linear_attention_as(op: str, q, k, v, g, *, scale, chunk_size, initial_state, output_final_state, mask,
                              backend, cu_seqlens, check_g: bool = True, fp32_gate: bool = False):
    """``gated_linear_attention`` with its errors naming ``op`` (Mamba-2 runs it: ``lazoo.ops.mamba2``);
    ``check_g=False`` skips the g <= 0 check (a caller that checked its own inputs), ``fp32_gate=True`` takes g in
    float32 beside half-precision q, k, v (a log decay keeps its precision)."""
    return _gated_linear(op, q, k, v, g, _gated_triton, per_key=False, scale=scale, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=output_final_state, mask=mask,
                         backend=backend, cu_seqlens=cu_seqlens, check_g=check_g, fp32_gate=fp32_gate)


def gla_as(op: str, q, k, v, g, *, scale, chunk_size, initial_state, output_final_state, mask, backend, cu_seqlens,
           check_g: bool = True):
    """``gla`` with its errors naming ``op`` (ELA runs it on its features); ``check_g=False`` skips the g <= 0
    check (a caller's g that is <= 0 by construction: no host sync)."""
    return _gated_linear(op, q, k, v, g, _gla_triton, per_key=True, scale=scale, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=output_final_state, mask=mask,
                         backend=backend, cu_seqlens=cu_seqlens, check_g=check_g)


def _gated_linear(op, q, k, v, g, triton_path, *, per_key, scale, chunk_size, initial_state, output_final_state,
                  mask, backend, cu_seqlens, check_g=True, fp32_gate=False):
    """Linear attention with a log-decay gate, one per head (g ``[B, T, H]``) or, ``per_key``, one per key dim
    (g ``[B, T, H, dk]``, GLA). The caller names the Triton path: the two gates have different kernels.
    ``fp32_gate``: a per-head g may be float32 whatever the dtype of q, k, v."""
    gate = ({"like_q": {"g": g}} if per_key else
            {"scalars": {"g": g}, "fp32_scalars": fp32_gate, "grouped_values": True})
    # a pad writes nothing and does not decay the state
    (B, T, _, dk, dv), mask, (q, k, v, g) = prepare_inputs(op, q, k, v, mask, **gate)
    H = v.shape[2]  # the state's heads: the value heads (m per query/key head with grouped heads)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device, mask)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    scale = check_scale(op, scale, dk)
    chunk_size = check_positive_int(op, "chunk_size", chunk_size)
    backend = resolve_backend(op, backend, q.device, linear_kernel_unsupported(q, v))
    # the value check (a host sync) after the cheap ones, read back once the kernels are launched
    report_g = queue_log_decay_check(op, "g", g) if check_g else no_check
    cdt = compute_dtype(q.dtype)

    if backend == "triton":
        return reported(report_g, triton_path(op, q, k, v, g, scale, chunk_size, initial_state, output_final_state,
                                              mask, cu_seqlens, N))
    report_g()
    if cu_seqlens is not None:
        return run_per_sequence(
            lambda sl, st: _gated_linear(
                op, q[:, sl], k[:, sl], v[:, sl], g[:, sl], triton_path, per_key=per_key, scale=scale,
                chunk_size=chunk_size, initial_state=st, output_final_state=True, mask=None, backend=backend,
                cu_seqlens=None, check_g=False, fp32_gate=fp32_gate),
            cu_seqlens, matrix_initial_state(op, initial_state, N, H, dk, dv, q.device, cdt),
            output_final_state, q, v)

    S0 = matrix_initial_state(op, initial_state, B, H, dk, dv, q.device, cdt)
    q_c, k_c, v_c, g_c = (x.to(cdt) for x in (q, k, v, g))
    if q_c.shape[2] != H:  # grouped heads: the PyTorch forms read each query/key head once per value head
        q_c, k_c = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (q_c, k_c))
    q_c = q_c * scale
    if backend == "recurrent":
        o, S = (_recurrent_gla if per_key else _recurrent_gated_linear)(q_c, k_c, v_c, g_c, S0)
    else:
        o, S = (chunk_gla if per_key else chunk_gated_linear)(q_c, k_c, v_c, g_c, S0, chunk_size)
    return op_result(o, mask, v.dtype, S, output_final_state)


def chunk_gla(q, k, v, g, S0, chunk_size: int):
    """Chunk-parallel GLA ``S_t = S_{t-1} diag(exp(g_t)) + v_t k_t^T, o_t = S_t q_t`` (op layout,
    compute dtype). Per chunk, G the cumulative log decay ``[C, dk]``:
        O     = (Q ⊙ exp(G)) S0^T + A V,  A_ij = Σ_d q_id k_jd exp(G_id - G_jd)  (i >= j)
        S_end = S0 diag(exp(G_C)) + V^T (K ⊙ exp(G_C - G))
    The decays exp(G_i - G_j) are formed per pair (never split into exp(G_i) exp(-G_j)), so any gate
    strength is stable. Returns ``(o [B, T, H, dv], S_end [B, H, dv, dk])``.
    """
    T = q.shape[1]
    C = min(chunk_size, T)
    Q, K, V, G = (split_chunks(pad_time(x, C), C) for x in (q, k, v, g))  # [B, H, N, C, d]
    G = G.cumsum(-2)
    N = Q.shape[2]
    tril = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~tril[..., None], float("-inf")).exp()
    A = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", Q, K, D)
    Kd = K * (G[..., -1:, :] - G).exp()
    dS = V.transpose(-1, -2) @ Kd  # [B, H, N, dv, dk]
    starts, S = [], S0
    for n in range(N):
        starts.append(S)
        S = S * G[:, :, n, -1, None, :].exp() + dS[:, :, n]
    S_start = torch.stack(starts, dim=2)
    O = (Q * G.exp()) @ S_start.transpose(-1, -2) + A @ V
    return merge_chunks(O, T), S


# ============================================================================ Triton paths
def linear_kernel_unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when lazoo.kernels.linear runs this case, else why not (imports no kernel on CPU; RLS's memory part
    runs it too)."""
    reason = triton_unsupported(q, v, LINEAR_MAX_HEAD_DIM, KERNEL_DTYPES)
    if reason:
        return reason
    try:
        from ..kernels.linear import check_supported
    except ImportError as e:  # a broken Triton, or a copy of the model code without the kernels
        return f"Triton is not available ({e})"
    return check_supported(q, v)


def decoding(T, cu_seqlens, *tensors) -> bool:
    """Few tokens, no packed batch and no autograd: the fused recurrent kernel."""
    if T > 16 or cu_seqlens is not None:
        return False
    return not records_graph(*tensors)


def _linear_triton(op, q, k, v, phi, normalize, eps, chunk_size, initial_state, output_final_state,
                   mask, cu_seqlens, N):
    from ..kernels import linear as kl

    B, T, H, dk = q.shape
    dv = v.shape[-1]
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = _linear_initial_state(op, initial_state, normalize, N, H, dk, dv, q.device, torch.float32)
    identity = phi is FEATURE_MAPS["identity"]
    fq = q if identity else phi(q)  # the feature map in the input dtype, before the kernel
    fk = zero_masked(k if identity else phi(k), mask)  # a pad adds nothing to S or z

    if decoding(T, cu_seqlens, q, k, v, S0, z0):
        if normalize and S0 is None:
            S0 = q.new_zeros(N, H, dv, dk, dtype=torch.float32)
            z0 = q.new_zeros(N, H, dk, dtype=torch.float32)
        o, S, z = kl.fused_recurrent_linear_attention(
            fq, fk, v, None, scale=1.0, initial_state=S0, z0=z0, normalize=normalize, eps=eps,
            output_final_state=output_final_state)
    elif normalize:  # the normaliser inside the chunks (lazoo.kernels.normalized)
        from ..kernels.normalized import chunk_normalized_linear_attention

        o, final = chunk_normalized_linear_attention(
            fq, fk, v, eps=eps, initial_state=None if S0 is None else (S0, None, z0, None),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
        S, z = (None, None) if final is None else (final[0], final[2])
    else:
        o, S = kl.chunk_linear_attention(fq, fk, v, None, scale=1.0, initial_state=S0,
                                         output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens, chunk_size=chunk_size)
        z = None
    return op_result(o, mask, v.dtype, _as_state((S, z), normalize), output_final_state)


def _gla_triton(op, q, k, v, g, scale, chunk_size, initial_state, output_final_state, mask, cu_seqlens, N):
    """GLA on lazoo.kernels.gla (its own chunks: ``chunk_size`` does not apply), or the fused recurrent kernel."""
    from ..kernels import linear as kl

    q, scale, S0 = _gated_kernel_inputs(op, q, v, scale, initial_state, N)
    if decoding(q.shape[1], cu_seqlens, q, k, v, g, S0):
        o, S = kl.fused_recurrent_gla(q, k, v, g, scale=scale, initial_state=S0,
                                      output_final_state=output_final_state)
    else:
        from ..kernels import gla as kg

        o, S = kg.chunk_gla(q, k, v, g, scale=scale, initial_state=S0, output_final_state=output_final_state,
                            cu_seqlens=cu_seqlens)
    return op_result(o, mask, v.dtype, S, output_final_state)


def _gated_triton(op, q, k, v, g, scale, chunk_size, initial_state, output_final_state, mask, cu_seqlens, N):
    """Gated linear attention on lazoo.kernels.linear (chunked, or the fused recurrent kernel for decoding)."""
    from ..kernels import linear as kl

    q, scale, S0 = _gated_kernel_inputs(op, q, v, scale, initial_state, N)
    if decoding(q.shape[1], cu_seqlens, q, k, v, g, S0):
        o, S, _ = kl.fused_recurrent_linear_attention(
            q, k, v, g.float(), scale=scale, initial_state=S0, output_final_state=output_final_state)
    else:
        o, S = kl.chunk_linear_attention(q, k, v, g, scale=scale, initial_state=S0,
                                         output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return op_result(o, mask, v.dtype, S, output_final_state)


def _gated_kernel_inputs(op, q, v, scale, initial_state, N):
    """(q, scale, S0) as the gated kernels take them: a learned (tensor) scale folded into q, so that it stays
    differentiable outside the kernel; the initial state checked and in float32 (None: none)."""
    dk, H = q.shape[-1], v.shape[2]  # the state's heads: v's
    S0 = None
    if initial_state is not None:
        S0 = matrix_initial_state(op, initial_state, N, H, dk, v.shape[-1], q.device, torch.float32)
    if isinstance(scale, torch.Tensor):
        q, scale = q * scale.to(q.dtype), 1.0
    return q, scale, S0


# ============================================================================ states
def _as_state(S0_z0, normalize):
    """(S0, z0) as the op's state: a dict {S, z} with the normaliser, else the tensor S."""
    S0, z0 = S0_z0
    return {"S": S0, "z": z0} if normalize else S0


def _linear_initial_state(op, state, normalize, B, H, dk, dv, device, cdt):
    """Return (S0, z0); z0 is None without the normaliser."""
    if not normalize:
        return matrix_initial_state(op, state, B, H, dk, dv, device, cdt), None
    if state is None:
        return (torch.zeros(B, H, dv, dk, dtype=cdt, device=device),
                torch.zeros(B, H, dk, dtype=cdt, device=device))
    check_state_dict(op, state, ("S", "z"))
    check_state_tensor(op, "initial_state['S']", state["S"], (B, H, dv, dk), device)
    check_state_tensor(op, "initial_state['z']", state["z"], (B, H, dk), device)
    return state["S"].to(cdt), state["z"].to(cdt)


def _denominator(fq: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """max(φ(q)·z, eps), with a trailing singleton dim to divide [..., dv] outputs."""
    return (fq * z).sum(-1, keepdim=True).clamp_min(eps)


# ============================================================================ recurrent forms
def _recurrent_linear(fq, fk, v, S, z, mask, normalize, eps):
    """Step-by-step reference; fk is already zero at pads, the mask keeps pads out anyway."""
    outs = []
    for t in range(fq.shape[1]):
        m = None if mask is None else mask[:, t, None, None]  # [B, 1, 1]
        S_new = S + v[:, t, :, :, None] * fk[:, t, :, None, :]
        S = S_new if m is None else torch.where(m[..., None], S_new, S)
        o = torch.einsum("bhvk,bhk->bhv", S, fq[:, t])
        if normalize:
            z_new = z + fk[:, t]
            z = z_new if m is None else torch.where(m, z_new, z)
            o = o / _denominator(fq[:, t], z, eps)
        outs.append(o)
    return torch.stack(outs, dim=1), S, z


def _recurrent_gla(q, k, v, g, S):
    """Step-by-step reference of GLA (a decay per key dim); k and g are zero at pads, which leaves S untouched."""
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t, :, None, :].exp() + v[:, t, :, :, None] * k[:, t, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def _recurrent_gated_linear(q, k, v, g, S):
    """Step-by-step reference; k and g are zero at pads, which leaves S untouched."""
    outs = []
    for t in range(q.shape[1]):
        S = g[:, t, :, None, None].exp() * S + v[:, t, :, :, None] * k[:, t, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


# ============================================================================ chunk form
def chunk_gated_linear(q, k, v, g, S0, chunk_size: int):
    """Chunk-parallel ``S_t = exp(g_t) S_{t-1} + v_t k_t^T, o_t = S_t q_t`` (g None: no decay).

    Inputs in the op layout and compute dtype; positions with k = 0 and g = 0 leave the state
    untouched. Per chunk, with G the cumulative log decay inside it and S0 its start state:
        O     = exp(G)[:, None] * (Q S0^T) + (tril ⊙ exp(G_t - G_i) ⊙ Q K^T) V
        S_end = exp(G_C) S0 + V^T (exp(G_C - G)[:, None] * K)
    Returns ``(o [B, T, H, dv], S_end [B, H, dv, dk])``.
    """
    B, T, H, _ = q.shape
    C = min(chunk_size, T)
    Q, K, V = (split_chunks(pad_time(x, C), C) for x in (q, k, v))  # [B, H, N, C, d]
    N = Q.shape[2]
    tril = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    P = (Q @ K.transpose(-1, -2)).masked_fill(~tril, 0.0)  # causal scores inside each chunk
    if g is not None:
        G = split_chunks(pad_time(g, C)[..., None], C)[..., 0].cumsum(-1)  # [B, H, N, C]
        # exp only where i <= t, so that exp(G_t - G_i) never overflows above the diagonal.
        P = P * (G[..., :, None] - G[..., None, :]).masked_fill(~tril, 0.0).exp()
        K = K * (G[..., -1:] - G).exp()[..., None]  # exp(G_C - G_i) k_i
    dS = V.transpose(-1, -2) @ K  # [B, H, N, dv, dk]: each chunk's write, from a zero start

    # Sequential over chunks: the start state of each chunk.
    starts, S = [], S0
    for n in range(N):
        starts.append(S)
        decay = 1.0 if g is None else G[:, :, n, -1].exp()[..., None, None]
        S = decay * S + dS[:, :, n]
    S_start = torch.stack(starts, dim=2)  # [B, H, N, dv, dk]

    O_inter = Q @ S_start.transpose(-1, -2)
    if g is not None:
        O_inter = O_inter * G.exp()[..., None]
    O = O_inter + P @ V
    return merge_chunks(O, T), S
