"""Local-linear (p = 1) attention of the test-time regression paper (eqs. 52–54): softmax attention is the
local *constant* regressor; this is the local *linear* one.

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

Time is quadratic in T like softmax attention; memory is linear in T (not in the recurrent reference). State:
a KV cache ``{"k": [B, Tc, H, dk], "v": [B, Tc, H, dv], "mask": [B, Tc] bool}`` in the compute dtype (float32
for half inputs, float64 for float64); positions count over the cache and the new tokens, pads included (as
``softmax_attention``); a final state with a window keeps the last W − 1 positions.

Backends:
  * ``"recurrent"``: the definition, per query: the (1 + dk)-dimensional weighted normal equations
    (Xᵀ W X + diag(0, ρI)) [M⁰ M¹]ᵀ = Xᵀ W V with rows X_i = [1, (k_i − q)ᵀ], solved explicitly
    (float64-capable), one query at a time.
  * ``"chunk"``: flash-style in PyTorch: query blocks of ``chunk_size`` against key blocks of ``_KEY_BLOCK``
    (512) keys, only those a query can see (causal, window). Pass 1 keeps a running maximum of the logits and
    sums Σ p, Σ p f and Σ p f fᵀ (the weights times the key block's outer products f fᵀ, ``[512, r²]``), then
    one batched r×r solve per query gives u = C⁻¹(f̄ − f(q)); pass 2 reweights the values,
    o = Σ_i w_i (1 + f̄·u − f_i·u) v_i (no per-query ``[dv, r]`` matrix). An autograd Function keeps only lse,
    f̄ and u per query (2r + 1 numbers) and its hand-written backward recomputes the weights and moments block
    by block: memory is linear in T (nothing [T, S]); no double backward.
Cost: O(T·S·r²) flops with S the keys a query sees (about T/2 causal, W with a window; r² = dk² for the exact
slope: dk times softmax attention's), plus one r×r solve per query (two in training). Practical for slope
features up to about 64; the temporaries are [B, H, chunk_size, 512 + r²] whatever T is.
  * ``"triton"`` (auto on CUDA when it can run the case): lazoo.kernels.local_linear, a flash-style fused
    kernel (two passes over the keys per query block, r×r moments on chip, an r-step solve per query) with a
    fused backward. It needs r ≤ 32 slope features: a ``rank_projection`` with r ≤ 32, or dk ≤ 32 for the
    exact slope; dk, dv ≤ 128; float32/float16/bfloat16 inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..kernels.limits import KERNEL_DTYPES, LOCAL_LINEAR_MAX_HEAD_DIM, LOCAL_LINEAR_MAX_RANK
from .backend import host_sync_allowed, resolve_backend, triton_unsupported
from .boundary import op_result, prepare_inputs, zero_masked
from .checks import check_float, check_positive_int, check_positive_number, check_same_device
from .dtypes import compute_dtype, without_autocast
from .softmax import kv_cache_state, visible_keys, with_kv_cache

__all__ = ["local_linear_attention"]

_OP = "local_linear_attention"


@without_autocast
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
    # a NaN at a pad never meets a real token, in any backend
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(_OP, q, k, v, mask)
    C = check_positive_int(_OP, "chunk_size", chunk_size)
    window = check_positive_int(_OP, "window", window, none_ok=True)
    check_positive_number(_OP, "ridge", ridge)
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
        o = _torch_form(backend, q.to(cdt), keys, values, mask, key_mask, Tc, window, beta, P, float(ridge), C)
    final = kv_cache_state(keys, values, key_mask, window) if output_final_state else None
    return op_result(o, mask, v.dtype, final, output_final_state)


def _torch_form(backend, q, keys, values, mask, key_mask, Tc, window, beta, P, ridge, C):
    """The recurrent or chunk form on q ``[B, T, H, dk]`` and keys/values ``[B, S, H, d]`` in the compute dtype."""
    q = zero_masked(q, mask)  # a pad's query sees no key; zeroing keeps a NaN there out of P q
    Qh, Kh, Vh = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # [B, H, *, d]
    Fq, Fk = (Qh, Kh) if P is None else (_features(Qh, P.to(q.dtype)), _features(Kh, P.to(q.dtype)))
    if backend == "recurrent":
        B, T = q.shape[:2]
        query_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
        allowed = visible_keys(query_mask, key_mask, Tc, window)[:, None]  # [B, 1, T, S]
        o = _recurrent(Qh, Kh, Vh, Fq, Fk, allowed, beta, ridge)
    else:
        seen = _Visibility(mask, key_mask, Tc, window)
        o = _BlockedLocalLinear.apply(Qh, Kh, Vh, Fq, Fk, beta, seen, ridge, C, _KEY_BLOCK)
    return o.transpose(1, 2)


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


def _triton_unsupported(q, v, P) -> str | None:
    """None when lazoo.kernels.local_linear runs this case, else why not (imports no kernel on CPU)."""
    dk = q.shape[-1]
    r = dk if P is None else P.shape[-2]
    if r > LOCAL_LINEAR_MAX_RANK:
        what = f"the exact slope has r = dk = {dk} features" if P is None else f"rank_projection has r = {r}"
        return (f"the Triton kernel keeps r×r moments per query and takes r <= {LOCAL_LINEAR_MAX_RANK} slope "
                f"features, but {what}; pass rank_projection [r, dk] with r <= {LOCAL_LINEAR_MAX_RANK}")
    reason = triton_unsupported(q, v, LOCAL_LINEAR_MAX_HEAD_DIM, KERNEL_DTYPES)
    if reason:
        return reason
    try:
        from ..kernels.local_linear import check_supported
    except ImportError as e:  # a broken Triton, or a copy of the model code without the kernels
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


#: keys per block of the chunk form: its temporaries are [B, H, chunk_size, _KEY_BLOCK] (and the block's
#: [_KEY_BLOCK, r²] outer products f fᵀ), whatever T is
_KEY_BLOCK = 512


class _Visibility:
    """Which keys each query sees (causal over absolute positions, Tc cached keys in front, an optional window,
    real keys and queries only), built per (query block, key block): never a [T, S] mask."""

    def __init__(self, query_mask, key_mask, Tc: int, window: int | None):
        self.query_mask, self.key_mask, self.Tc, self.window = query_mask, key_mask, Tc, window
        # the unmasked fast path needs a host sync to know there are no pads: not while compiled or captured
        self.no_pads = query_mask is None and host_sync_allowed() and bool(key_mask.all())

    def key_blocks(self, q0: int, q1: int, size: int):
        """(k0, k1) ranges of at most ``size`` keys covering every key that a query in [q0, q1) may see."""
        first = 0 if self.window is None else max(0, q0 + self.Tc - self.window + 1)
        last = q1 + self.Tc
        return [(k0, min(k0 + size, last)) for k0 in range(first, last, size)]

    def mask(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """``[B, 1, q1 − q0, k1 − k0]`` bool, or None where every query of the block sees every key."""
        p0, p1 = q0 + self.Tc, q1 - 1 + self.Tc  # first and last query position
        if self.no_pads and k1 - 1 <= p0 and (self.window is None or k0 > p1 - self.window):
            return None
        device = self.key_mask.device
        p = torch.arange(p0, p1 + 1, device=device)[:, None]
        j = torch.arange(k0, k1, device=device)[None, :]
        seen = j <= p
        if self.window is not None:
            seen = seen & (j > p - self.window)
        seen = seen[None] & self.key_mask[:, None, k0:k1]
        if self.query_mask is not None:
            seen = seen & self.query_mask[:, q0:q1, None]
        return seen[:, None]


class _Pair(NamedTuple):
    """One (query block, key block) of the chunk form: the keys' slices and the logits."""

    keys: slice  # the block's key positions
    K: torch.Tensor  # [B, H, kb, dk]
    V: torch.Tensor  # [B, H, kb, dv]
    F: torch.Tensor  # [B, H, kb, r]
    z: torch.Tensor  # β q·k [B, H, c, kb], −inf where not visible


def _pairs(Qs, Kh, Vh, Fk, seen, q0, q1, size):
    """The key blocks that the scaled queries Qs = β q of rows [q0, q1) see, with their logits."""
    for k0, k1 in seen.key_blocks(q0, q1, size):
        K = Kh[:, :, k0:k1]
        z = Qs @ K.transpose(-1, -2)
        mask = seen.mask(q0, q1, k0, k1)
        if mask is not None:
            z = z.masked_fill(~mask, -torch.inf)
        yield _Pair(slice(k0, k1), K, Vh[:, :, k0:k1], Fk[:, :, k0:k1], z)


def _outer(F):
    """f fᵀ of every row of F ``[..., n, r]`` → ``[..., n, r²]``."""
    return (F[..., :, None] * F[..., None, :]).flatten(-2)


def _moments(Qs, Kh, Vh, Fk, seen, q0, q1, size):
    """Pass 1 over the key blocks with a running maximum: per query log Σ_i exp(z_i), f̄ = Σ w f and
    E = Σ w f fᵀ (w the normalised weights). A query that sees no key gets lse = finfo.min and zero moments."""
    B, H, c, _ = Qs.shape
    r = Fk.shape[-1]
    m = Qs.new_full((B, H, c, 1), torch.finfo(Qs.dtype).min)  # finite, so exp(z − m) is 0, never NaN, at −inf
    l, sf, sE = Qs.new_zeros(B, H, c, 1), Qs.new_zeros(B, H, c, r), Qs.new_zeros(B, H, c, r * r)
    for pair in _pairs(Qs, Kh, Vh, Fk, seen, q0, q1, size):
        m_new = torch.maximum(m, pair.z.amax(-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(pair.z - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        sf = sf * alpha + p @ pair.F
        sE = sE * alpha + p @ _outer(pair.F)
        m = m_new
    l = torch.where(l > 0, l, 1.0)
    return m + torch.log(l), sf / l, (sE / l).unflatten(-1, (r, r))


def _covariance(E, fbar, ridge):
    """C = E − f̄ f̄ᵀ + ρI, the slope's (ridged) weighted covariance of the features."""
    eye = torch.eye(E.shape[-1], dtype=E.dtype, device=E.device)
    return E - fbar[..., :, None] * fbar[..., None, :] + ridge * eye


def _scaled(Q, beta):
    return Q * beta[:, None, None]


class _BlockedLocalLinear(torch.autograd.Function):
    """The chunk form, flash-style: query blocks of ``C`` against key blocks of ``KB``, nothing [T, S] kept, so
    memory is linear in T.

    Per query: w_i = softmax_i(z), z_i = β q·k_i, f̄ = Σ w f, C = Σ w f fᵀ − f̄ f̄ᵀ + ρI, u = C⁻¹(f̄ − g) (g: the
    query's features), o = Σ_i w_i c_i v_i with c_i = 1 − (f_i − f̄)·u. The forward keeps lse, f̄ and u per
    query; the backward recomputes the weights and Σ w f fᵀ from them, block by block, and takes the gradient
    in closed form: with e_i = v_i·δ, D = Σ w e, λ = C⁻¹(D f̄ − Σ w e f) and h = ∂L/∂f̄ = D u + λ + λ(f̄·u) + u(λ·f̄),
        dv_i = w_i c_i δ,   df_i = w_i (h − e_i u − λ(f_i·u) − u(λ·f_i)),   dg = −λ,
        dz_i = w_i (dw_i − Σ_j w_j dw_j),   dw_i = c_i e_i + f_i·h − (f_i·λ)(f_i·u),
        Σ_j w_j dw_j = o·δ + f̄·h − λᵀ(Σ w f fᵀ)u."""

    @staticmethod
    def forward(ctx, Qh, Kh, Vh, Fq, Fk, beta, seen, ridge, C, KB):
        Qh, Kh, Vh, Fq, Fk = (x.contiguous() for x in (Qh, Kh, Vh, Fq, Fk))
        B, H, T, _ = Qh.shape
        r = Fk.shape[-1]
        o = Qh.new_zeros(B, H, T, Vh.shape[-1])
        lse, fbar, u = Qh.new_zeros(B, H, T, 1), Qh.new_zeros(B, H, T, r), Qh.new_zeros(B, H, T, r)
        for q0 in range(0, T, C):
            rows = slice(q0, min(q0 + C, T))
            Qs = _scaled(Qh[:, :, rows], beta)
            lse_b, fbar_b, E = _moments(Qs, Kh, Vh, Fk, seen, q0, rows.stop, KB)
            u_b = torch.linalg.solve(_covariance(E, fbar_b, ridge), fbar_b - Fq[:, :, rows])
            # pass 2: o = Σ_i w_i (1 + f̄·u − f_i·u) v_i
            base = 1 + (fbar_b * u_b).sum(-1, keepdim=True)
            for pair in _pairs(Qs, Kh, Vh, Fk, seen, q0, rows.stop, KB):
                w = torch.exp(pair.z - lse_b)
                o[:, :, rows] += (w * (base - u_b @ pair.F.transpose(-1, -2))) @ pair.V
            lse[:, :, rows], fbar[:, :, rows], u[:, :, rows] = lse_b, fbar_b, u_b
        ctx.save_for_backward(Qh, Kh, Vh, Fq, Fk, beta, o, lse, fbar, u)
        ctx.seen, ctx.ridge, ctx.C, ctx.KB = seen, ridge, C, KB
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        Qh, Kh, Vh, Fq, Fk, beta, o, lse, fbar, u = ctx.saved_tensors
        seen, ridge, C, KB = ctx.seen, ctx.ridge, ctx.C, ctx.KB
        do = do.contiguous()
        T = Qh.shape[2]
        dz_K, dK, dV = torch.zeros_like(Qh), torch.zeros_like(Kh), torch.zeros_like(Vh)  # dz_K = Σ_i dz_i k_i
        dFq, dFk = torch.zeros_like(Fq), torch.zeros_like(Fk)
        for q0 in range(0, T, C):
            rows = slice(q0, min(q0 + C, T))
            Qs, delta, lse_b, fbar_b, u_b = (_scaled(Qh[:, :, rows], beta), do[:, :, rows], lse[:, :, rows],
                                             fbar[:, :, rows], u[:, :, rows])
            lam, h, Delta = _query_grads(Qs, Kh, Vh, Fk, seen, q0, rows.stop, KB, delta, o[:, :, rows], lse_b,
                                         fbar_b, u_b, ridge)
            dFq[:, :, rows] = -lam
            base = 1 + (fbar_b * u_b).sum(-1, keepdim=True)
            for pair in _pairs(Qs, Kh, Vh, Fk, seen, q0, rows.stop, KB):
                w = torch.exp(pair.z - lse_b)
                e = delta @ pair.V.transpose(-1, -2)
                fu, fl, fh = (torch.stack([u_b, lam, h], 2) @ pair.F.transpose(-1, -2)[:, :, None]).unbind(2)
                c = base - fu
                dz = w * (c * e + fh - fl * fu - Delta)
                dV[:, :, pair.keys] += (w * c).transpose(-1, -2) @ delta
                dFk[:, :, pair.keys] += (torch.cat([w, -w * (e + fl), -w * fu], -2).transpose(-1, -2)
                                         @ torch.cat([h, u_b, lam], -2))
                dK[:, :, pair.keys] += dz.transpose(-1, -2) @ Qs
                dz_K[:, :, rows] += dz @ pair.K
        dbeta = (Qh * dz_K).sum((0, 2, 3))
        return _scaled(dz_K, beta), dK, dV, dFq, dFk, dbeta, None, None, None, None


def _query_grads(Qs, Kh, Vh, Fk, seen, q0, q1, KB, delta, o, lse, fbar, u, ridge):
    """Backward pass A over the key blocks: per query λ = C⁻¹(D f̄ − Σ w e f), h = ∂L/∂f̄ and Σ_j w_j dw_j."""
    B, H, c, r = fbar.shape
    D, Ef, E = Qs.new_zeros(B, H, c, 1), Qs.new_zeros(B, H, c, r), Qs.new_zeros(B, H, c, r * r)
    for pair in _pairs(Qs, Kh, Vh, Fk, seen, q0, q1, KB):
        w = torch.exp(pair.z - lse)
        we = w * (delta @ pair.V.transpose(-1, -2))
        D = D + we.sum(-1, keepdim=True)
        Ef = Ef + we @ pair.F
        E = E + w @ _outer(pair.F)
    E = E.unflatten(-1, (r, r))
    lam = torch.linalg.solve(_covariance(E, fbar, ridge), D * fbar - Ef)
    fu, lf = (fbar * u).sum(-1, keepdim=True), (lam * fbar).sum(-1, keepdim=True)
    h = D * u + lam * (1 + fu) + u * lf
    lEu = (lam[..., None, :] @ E @ u[..., :, None])[..., 0]
    Delta = (o * delta).sum(-1, keepdim=True) + (fbar * h).sum(-1, keepdim=True) - lEu
    return lam, h, Delta


def _recurrent(Qh, Kh, Vh, Fq, Fk, allowed, beta, ridge):
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
