"""Local-linear (p = 1) attention of seed 004 (eqs 52–54): softmax attention is the local *constant*
regressor; this is the local *linear* one.

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token). Per head and query
q = q_t, over the visible keys i (causal: i ≤ t; with a window W: i ∈ (t − W, t]; pads never):

    s_i = exp(β q·k_i),  w_i = s_i / Σ_j s_j,  d_i = k_i − q
    (M⁰, M¹) = argmin Σ_i w_i ‖v_i − M⁰ − M¹ d_i‖² + ρ ‖M¹‖_F²,        o_t = M⁰
    ⇒  M⁰ = v̄ − M¹ d̄,  M¹ = C_vd (C_dd + ρI)^{-1},  v̄ = Σ w v, k̄ = Σ w k, d̄ = k̄ − q,
       C_dd = Σ w k kᵀ − k̄ k̄ᵀ,  C_vd = Σ w v kᵀ − v̄ k̄ᵀ

so o_t = v̄ − C_vd u with u = (C_dd + ρI)^{-1}(k̄ − q). The intercept is not penalised; the weights are
normalised (the ridge is relative to a unit total weight, and a shift of the logits changes nothing), so
ρ → ∞ gives M¹ → 0 and o_t → Σ w_i v_i, softmax attention. β is ``scale`` (a number, a 0-d tensor or a
per-head tensor ``[H]``) and multiplies the logits only; q enters d_i unscaled (the mixer applies QK-norm:
unit q and k, learned β). ``ridge`` is ρ > 0.

Low-rank slope (``rank_projection`` P, ``[r, dk]`` or per head ``[H, r, dk]``): the slope acts on the
projected offsets P(k_i − q) instead of k_i − q, i.e. the same regression with features P k (the logits keep
the full q·k). Then M¹ is dv×r, C_dd = P C_kk Pᵀ is r×r and o_t = v̄ − C_vk Pᵀ u with
u = (P C_kk Pᵀ + ρI)^{-1} P(k̄ − q). Without P (the default) the slope is exact (P = I). This is what
makes a fused kernel fit on chip at dk = 64…128: per query it keeps r×r moments, not dk×dk.

It is quadratic in T like softmax attention. State: a KV cache ``{"k": [B, Tc, H, dk], "v": [B, Tc, H, dv],
"mask": [B, Tc] bool}`` in the compute dtype (float32 for half inputs, float64 for float64); positions count
over the cache and the new tokens, pads included (as ``softmax_attention``); a final state with a window keeps
the last W − 1 positions.

Backends:
  * ``"recurrent"``: the definition, per query: the (1 + dk)-dimensional weighted normal equations
    (Xᵀ W X + diag(0, ρI)) [M⁰ M¹]ᵀ = Xᵀ W V with rows X_i = [1, (k_i − q)ᵀ], solved explicitly
    (float64-capable), one query at a time.
  * ``"chunk"``: all queries of a block of ``chunk_size`` at once from the per-query moments: v̄, k̄ (two
    matmuls with the softmax weights), Σ w k kᵀ (the weights times the per-key outer products k kᵀ,
    ``[S, dk²]``), one batched dk×dk solve per query, then C_vd u = Σ_i w_i v_i (k_i − k̄)·u as a second
    weighted sum over the keys (no per-query ``[dv, dk]`` matrix is formed).
Cost: O(T·S·dk²) flops (dk times softmax attention's) and O(B·H·S·dk² + B·H·chunk·dk²) memory for the outer
products, plus one dk×dk solve per query: practical for head dims up to about 64 (128 works but the
S·dk² outer products dominate memory: 64 KiB per key and head in float32). With P, read r for dk there.
  * ``"triton"`` (auto on CUDA when it can run the case): lazoo.kernels.local_linear, a flash-style fused
    kernel (two passes over the keys per query block, r×r moments on chip, an r-step solve per query) with a
    fused backward. It needs r ≤ 32 slope features: a ``rank_projection`` with r ≤ 32, or dk ≤ 32 for the
    exact slope; dk, dv ≤ 128; float32/float16/bfloat16 inputs.
"""

from __future__ import annotations


import torch

from ._common import (
    check_chunk_size,
    check_float,
    check_mask,
    check_qkv,
    check_same_device,
    compute_dtype,
    resolve_backend,
    zero_masked,
    triton_unsupported,
)
from .softmax import _allowed, kv_cache_state, with_kv_cache

_OP = "local_linear_attention"


def local_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | torch.Tensor,
    ridge: float = 1e-3,
    window: int | None = None,
    chunk_size: int = 64,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    rank_projection: torch.Tensor | None = None,
):
    """Causal local-linear attention; returns ``(o [B, T, H, dv], final_state)`` (see the module docstring).

    rank_projection: None (exact slope on k − q) or P ``[r, dk]`` / ``[H, r, dk]`` (slope on P(k − q));
    differentiable, so it can be a learned parameter."""
    B, T, H, dk, dv = check_qkv(_OP, q, k, v)
    mask = check_mask(_OP, mask, B, T, q.device)
    C = check_chunk_size(_OP, chunk_size)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{_OP}: window must be None or a positive int, got {window!r}")
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge > 0:
        raise ValueError(f"{_OP}: ridge must be a number > 0, got {ridge!r}")
    P = _projection(rank_projection, H, dk, q)
    backend = resolve_backend(_OP, backend, q.device, _triton_unsupported(q, v, P))
    cdt = compute_dtype(q.dtype)
    beta = _scale(scale, H, q, cdt)  # [H]

    # the training path (no cache, no pads) hands the inputs to the kernel as they are: no fp32 copies, no
    # [T, S] mask
    plain_triton = backend == "triton" and initial_state is None and mask is None
    if plain_triton:
        o = _triton(q, k, v, None, beta, P, float(ridge), window)
    if not plain_triton or output_final_state:
        keys, values, key_mask = with_kv_cache(_OP, initial_state, zero_masked(k.to(cdt), mask),
                                             zero_masked(v.to(cdt), mask), mask, B, H, dk, dv)
        Tc = keys.shape[1] - T
    if backend == "triton" and not plain_triton:
        o = _triton(q, keys.to(q.dtype), values.to(q.dtype), key_mask, beta, P, float(ridge), window)
    elif backend != "triton":
        query_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
        allowed = _allowed(query_mask, key_mask, Tc, window)[:, None]  # [B, 1, T, S]
        qc = q.to(cdt)
        Qh, Kh, Vh = qc.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # [B, H, *, d]
        Fq, Fk = (Qh, Kh) if P is None else (_features(Qh, P.to(cdt)), _features(Kh, P.to(cdt)))
        run = _recurrent if backend == "recurrent" else _chunk
        o = run(Qh, Kh, Vh, Fq, Fk, allowed, beta, float(ridge), C).transpose(1, 2)
    o = zero_masked(o, mask).to(v.dtype)

    return o, (kv_cache_state(keys, values, key_mask, window) if output_final_state else None)


def _scale(scale, H, q, cdt) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        check_same_device(_OP, q, scale=scale)
        if scale.dim() == 0:
            return scale.to(cdt).expand(H)
        if tuple(scale.shape) != (H,):
            raise ValueError(f"{_OP}: a tensor scale must be 0-d or have shape [H] = ({H},), got {tuple(scale.shape)}")
        return scale.to(cdt)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{_OP}: scale must be a number or a tensor [H], got {type(scale).__name__}")
    return torch.full((H,), float(scale), dtype=cdt, device=q.device)


def _projection(P, H, dk, q):
    """The low-rank slope projection: None, or a float tensor ``[r, dk]`` / ``[H, r, dk]``."""
    if P is None:
        return None
    if not isinstance(P, torch.Tensor):
        raise TypeError(f"{_OP}: rank_projection must be None or a tensor [r, dk] or [H, r, dk], "
                        f"got {type(P).__name__}")
    check_float(_OP, "rank_projection", P)
    check_same_device(_OP, q, rank_projection=P)
    ok = (P.dim() == 2 and P.shape[1] == dk) or (P.dim() == 3 and P.shape[0] == H and P.shape[2] == dk)
    if not ok or P.shape[-2] < 1:
        raise ValueError(f"{_OP}: rank_projection must have shape [r, dk] = (r, {dk}) or [H, r, dk] = "
                         f"({H}, r, {dk}) with r >= 1, got {tuple(P.shape)}")
    return P


def _features(X, P):
    """P x for every row of X ``[B, H, T, dk]`` → ``[B, H, T, r]`` (P ``[r, dk]`` or ``[H, r, dk]``)."""
    if P.dim() == 2:
        return X @ P.transpose(0, 1)
    return torch.einsum("bhtd,hrd->bhtr", X, P)


_TRITON_MAX_HEAD_DIM = 128  # = lazoo.kernels.local_linear.MAX_HEAD_DIM (not imported here: lazy kernels)
_TRITON_MAX_RANK = 32  # = lazoo.kernels.local_linear.MAX_RANK


def _triton_unsupported(q, v, P) -> str | None:
    """None when lazoo.kernels.local_linear runs this case, else why not (imports no kernel on CPU)."""
    dk = q.shape[-1]
    r = dk if P is None else P.shape[-2]
    if r > _TRITON_MAX_RANK:
        what = f"the exact slope has r = dk = {dk} features" if P is None else f"rank_projection has r = {r}"
        return (f"the Triton kernel keeps r×r moments per query and takes r <= {_TRITON_MAX_RANK} slope "
                f"features, but {what}; pass rank_projection [r, dk] with r <= {_TRITON_MAX_RANK}")
    reason = triton_unsupported(q, v, _TRITON_MAX_HEAD_DIM)
    if reason:
        return reason
    try:
        from ..kernels.local_linear import check_supported
    except ImportError as e:  # no triton installed
        return f"Triton is not available ({e})"
    return check_supported(q, v, r)


def _triton(q, keys, values, key_mask, beta, P, ridge, window):
    """The fused kernel on q ``[B, T, H, dk]`` and keys/values ``[B, S, H, d]`` (S − T cached) of q's dtype."""
    from ..kernels.local_linear import local_linear_attention as kernel

    return kernel(q, keys, values, scale=beta, ridge=ridge, window=window, key_mask=key_mask, rank_projection=P)


def _weights(Qh, Kh, allowed, beta):
    """Normalised weights w ``[B, H, Tq, S]`` (0 where not allowed; a row with no visible key is all 0)."""
    logits = torch.einsum("bhtd,bhsd->bhts", Qh, Kh) * beta[:, None, None]
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, -1) * allowed


def _chunk(Qh, Kh, Vh, Fq, Fk, allowed, beta, ridge, C):
    """Fq/Fk: the slope's features of the queries/keys (Qh/Kh themselves for the exact slope)."""
    B, H, T, dk = Qh.shape
    r = Fk.shape[-1]
    outer = (Fk[..., :, None] * Fk[..., None, :]).flatten(-2)  # [B, H, S, r²]
    eye = torch.eye(r, dtype=Qh.dtype, device=Qh.device)
    outs = []
    for s in range(0, T, C):
        q = Qh[:, :, s:s + C]
        w = _weights(q, Kh, allowed[:, :, s:s + C], beta)  # [B, H, c, S]
        kbar, vbar = w @ Fk, w @ Vh
        Ekk = (w @ outer).unflatten(-1, (r, r))
        cov = Ekk - kbar[..., :, None] * kbar[..., None, :] + ridge * eye
        u = torch.linalg.solve(cov, (kbar - Fq[:, :, s:s + C])[..., None])[..., 0]  # [B, H, c, r]
        a = w * (u @ Fk.transpose(-1, -2) - (kbar * u).sum(-1, keepdim=True))  # w_i (f_i − f̄)·u
        outs.append(vbar - a @ Vh)
    return torch.cat(outs, 2)


def _recurrent(Qh, Kh, Vh, Fq, Fk, allowed, beta, ridge, C):
    """Per query: the weighted ridge regression on [1, f_i − f(q)] (f = id or P) in its explicit normal
    equations."""
    B, H, T, dk = Qh.shape
    r = Fk.shape[-1]
    pen = torch.zeros(r + 1, dtype=Qh.dtype, device=Qh.device)
    pen[1:] = ridge  # the intercept is not penalised
    outs = []
    for t in range(T):
        q = Qh[:, :, t]  # [B, H, dk]
        w = _weights(q[:, :, None], Kh, allowed[:, :, t:t + 1], beta)[:, :, 0]  # [B, H, S]
        ones = torch.ones_like(Kh[..., :1])
        X = torch.cat([ones, Fk - Fq[:, :, t, None]], -1)  # [B, H, S, 1 + r]
        XtW = (X * w[..., None]).transpose(-1, -2)
        A = XtW @ X + torch.diag_embed(pen.expand(B, H, -1))
        A[..., 0, 0] += 1 - w.sum(-1)  # only a query with no visible key (a pad) has Σw = 0: keeps A invertible
        coef = torch.linalg.solve(A, XtW @ Vh)  # [B, H, 1 + r, dv]
        outs.append(coef[..., 0, :])
    return torch.stack(outs, 2)
