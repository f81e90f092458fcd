"""Linear attention (feature map, optional normaliser) and gated linear attention (scalar decay).

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, gates ``[B, T, H]``, state S ``[B, H, dv, dk]``,
normaliser z ``[B, H, dk]``, mask ``[B, T]`` (1 = real token; a pad leaves the state untouched
and outputs 0).

    linear:  S_t = S_{t-1} + v_t φ(k_t)^T,  z_t = z_{t-1} + φ(k_t),
             o_t = S_t φ(q_t) / max(φ(q_t)·z_t, eps)   (or S_t φ(q_t) without normaliser)
    gated:   S_t = exp(g_t) S_{t-1} + v_t k_t^T,  o_t = S_t (scale q_t),  g_t <= 0 (log decay)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._common import (
    check_chunk_size,
    check_head_scalar,
    check_mask,
    check_qkv,
    check_scale,
    check_state_dict,
    check_state_tensor,
    compute_dtype,
    matrix_initial_state,
    merge_chunks,
    pad_time,
    resolve_backend,
    split_chunks,
    zero_masked,
)

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
):
    """Causal linear attention. State: ``{"S", "z"}`` if normalize else the tensor S."""
    op = "linear_attention"
    B, T, H, dk, dv = check_qkv(op, q, k, v)
    phi = get_feature_map(feature_map, op)
    mask = check_mask(op, mask, B, T, q.device)
    chunk_size = check_chunk_size(op, chunk_size)
    backend = resolve_backend(op, backend, q.device)
    cdt = compute_dtype(q.dtype)

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
            z_t = z0[:, None] + fk.cumsum(1)  # [B, T, H, dk]: z after each step
            o = o / _denominator(fq, z_t, eps)
            z = z_t[:, -1]
    o = zero_masked(o, mask).to(v.dtype)

    final_state = None
    if output_final_state:
        final_state = {"S": S, "z": z} if normalize else S
    return o, final_state


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Linear attention with a scalar per-head decay exp(g_t), g ``[B, T, H]`` the log decay (<= 0)."""
    op = "gated_linear_attention"
    B, T, H, dk, dv = check_qkv(op, q, k, v)
    check_head_scalar(op, "g", g, q)
    mask = check_mask(op, mask, B, T, q.device)
    scale = check_scale(op, scale, dk)
    chunk_size = check_chunk_size(op, chunk_size)
    backend = resolve_backend(op, backend, q.device)
    cdt = compute_dtype(q.dtype)

    S0 = matrix_initial_state(op, initial_state, B, H, dk, dv, q.device, cdt)
    q_c = q.to(cdt) * scale
    k_c = zero_masked(k.to(cdt), mask)  # a pad writes nothing ...
    g_c = zero_masked(g.to(cdt), mask)  # ... and does not decay the state
    v_c = v.to(cdt)

    if backend == "recurrent":
        o, S = _recurrent_gated_linear(q_c, k_c, v_c, g_c, S0)
    else:
        o, S = chunk_gated_linear(q_c, k_c, v_c, g_c, S0, chunk_size)
    o = zero_masked(o, mask).to(v.dtype)
    return o, (S if output_final_state else None)


# ============================================================================ states
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
