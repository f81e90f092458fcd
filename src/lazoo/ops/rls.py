"""Recursive least squares (RLS) / Mesa layer: exact (exponentially weighted) ridge regression of v on k.

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token). Per head, with t
counting real tokens (1-based) and the ridge λ not decaying:

    S_t = argmin_S Σ_{i≤t} γ^{t−i} ‖v_i − S k_i‖² + λ‖S‖_F²  =  VK_t (KK_t + λI)^{-1},   o_t = S_t q_t
    KK_t = γ KK_{t−1} + k_t k_tᵀ   [dk, dk],      VK_t = γ VK_{t−1} + v_t k_tᵀ   [dv, dk]

(seed 004 eq 11 and its weighted version; MesaNet in seed 001). q, k, v are used as given (the mixer
L2-normalises q and k). ``lam`` is λ > 0: a number, a 0-d tensor or a per-head tensor ``[H]`` (a learned
λ stays differentiable); ``gamma`` is γ ∈ (0, 1], a number.

State: ``{"KK": [B, H, dk, dk], "VK": [B, H, dv, dk]}``, the weighted moments *without* the ridge, so
one state serves any λ (a learned λ may change between calls) and both backends hold exactly the same
thing. A pad leaves both untouched and does not count as a step of the decay.

Backends:
  * ``"recurrent"``, γ = 1: Sherman–Morrison per token on P_t = (KK_t + λI)^{-1} (P_0 = I/λ, or one solve
    from an initial state) with the RLS update S_t = S_{t−1} + (v_t − S_{t−1}k_t)(P_t k_t)ᵀ; the moments are
    accumulated alongside for the final state.
    γ < 1: the isotropic ridge that does not decay makes KK_t + λI = γ(KK_{t−1} + λI) + k kᵀ + (1−γ)λI a
    full-rank update, so there is no rank-1 recursion; the reference keeps KK_t, VK_t and solves
    (KK_t + λI) z = q_t exactly per token (o_t = VK_t z), O(dk³) per token, float64-capable.
  * ``"chunk"`` (chunks of ``chunk_size`` positions), γ = 1: Woodbury per chunk, parallel over chunks.
    The moments at chunk starts are a prefix sum, so every chunk gets P_0 = (KK_0 + λI)^{-1} from its
    own Cholesky factor (no rounding carried across chunks); the C×C matrix M = I + K P_0 Kᵀ = L Lᵀ
    gives every position's leading principal inverse at once: R = K P_0 Qᵀ,
    X = N ⊙ L⁻ᵀ(N ⊙ L⁻¹(N ⊙ R)) with N[i, t] = 1 for i ≤ t, z_t = P_0 q_t − P_0 Kᵀ X[:, t]
    = (KK_t + λI)^{-1} q_t, and o_t = VK_0 z_t + Σ_{i≤t} v_i (k_i·z_t), unnormalised linear attention
    with queries z.
  * ``"triton"`` (γ = 1, dk <= 128): z_t = (KK_t + λI)^{-1} q_t on ``lazoo.kernels.rls`` (one program per chunk
    of ``lazoo.kernels.rls.CHUNK`` positions unless ``chunk_size`` is given: the chunk-start inverse on chip,
    then Woodbury BS = 16 positions at a time), then the memory part on lazoo's Triton linear-attention
    kernel (in bf16/fp16 for such inputs). The backward is analytic: one more solve with ∂L/∂z gives
    ∂q = y, ∂λ = −Σ y·z, ∂KK_0 = −sym(Σ y zᵀ) and ∂k_i = −Σ_{t≥i} [(z_t·k_i) y_t + (y_t·k_i) z_t] (two
    anti-causal linear attentions). γ < 1 has no Triton path (auto uses the chunk form and says so once).
    γ < 1: the exact per-position solve batched over the chunk: KK_t = γ^{n_t} KK_0 + Σ_{i≤t} γ^{n_t−n_i} k_i k_iᵀ
    (n = real tokens since the chunk start) for all t of the chunk at once, one batched dk×dk solve.
Both give the closed form at every t to rounding (tests/test_ops_rls.py: 1e-6 relative in float64 is the
stated bound; measured far below it).
"""

from __future__ import annotations

import torch

from ._common import (
    check_chunk_size,
    check_mask,
    check_qkv,
    check_same_device,
    check_state_dict,
    check_state_tensor,
    compute_dtype,
    pad_time,
    resolve_backend,
    split_chunks,
    merge_chunks,
    zero_masked,
)
from .linear import _triton_unsupported as _linear_triton_unsupported
from .linear import chunk_gated_linear, linear_attention

_OP = "rls"
#: the PyTorch chunk forms' default chunk (the Triton path's is lazoo.kernels.rls.CHUNK)
CHUNK_SIZE = 64
_STATE_KEYS = ("KK", "VK")


def rls(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lam: float | torch.Tensor,
    gamma: float = 1.0,
    chunk_size: int | None = None,  # None: 64 for the chunk form, lazoo.kernels.rls.CHUNK for Triton
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Exact (γ-weighted) ridge regression memory; returns ``(o [B, T, H, dv], final_state)``
    (see the module docstring)."""
    B, T, H, dk, dv = check_qkv(_OP, q, k, v)
    mask = check_mask(_OP, mask, B, T, q.device)
    C = None if chunk_size is None else check_chunk_size(_OP, chunk_size)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (0.0 < float(gamma) <= 1.0):
        raise ValueError(f"{_OP}: gamma must be a number in (0, 1], got {gamma!r}")
    gamma = float(gamma)
    backend = resolve_backend(_OP, backend, q.device, _triton_unsupported(q, v, gamma, C))
    if C is None:  # each path's own default
        C = _triton_chunk() if backend == "triton" else CHUNK_SIZE
    cdt = compute_dtype(q.dtype)
    lam_h = _lambda(lam, H, q, cdt)  # [H]

    KK, VK = _initial_state(initial_state, B, H, dk, dv, q.device, cdt)
    if backend == "triton":
        o, KK, VK = _rls_triton(q, k, v, mask, lam_h, KK, VK, C, output_final_state)
        return zero_masked(o, mask).to(v.dtype), ({"KK": KK, "VK": VK} if output_final_state else None)
    qc, kc, vc = q.to(cdt), zero_masked(k.to(cdt), mask), zero_masked(v.to(cdt), mask)
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    if backend == "recurrent":
        run = _recurrent_sherman_morrison if gamma == 1.0 else _recurrent_solve
        o, KK, VK = run(qc, kc, vc, real, lam_h, gamma, KK, VK)
    elif gamma < 1.0:
        o, KK, VK = _chunk_solve(qc, kc, vc, real, lam_h, gamma, KK, VK, C)
    else:
        o, KK, VK = _chunk_woodbury(qc, kc, vc, real, lam_h, gamma, KK, VK, C)
    o = zero_masked(o, mask).to(v.dtype)
    return o, ({"KK": KK, "VK": VK} if output_final_state else None)


# ----------------------------------------------------------------------------- triton
def _triton_unsupported(q, v, gamma, chunk_size) -> str | None:
    """None when the Triton path runs this case."""
    try:
        from ..kernels.rls import BS, MAX_HEAD_DIM
    except ImportError as e:  # no Triton here, or a copy of the model code without the kernels
        return f"lazoo.kernels.rls cannot be imported ({e})"

    if gamma != 1.0:
        return "the Triton path covers gamma = 1 only (gamma < 1 is solved exactly per position)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"the Triton path takes head dims up to {MAX_HEAD_DIM} (got {q.shape[-1]})"
    if chunk_size is not None and chunk_size % BS:
        return f"the Triton path needs chunk_size to be a multiple of {BS} (got {chunk_size})"
    return _linear_triton_unsupported(q, v)


def _triton_chunk() -> int:
    from ..kernels.rls import CHUNK

    return CHUNK


def _rls_triton(q, k, v, mask, lam_h, KK, VK, C, output_final_state):
    """z = (KK_t + λI)^{-1} q_t by lazoo.kernels.rls (fp32), then o_t = VK_0 z_t + Σ_{i≤t} v_i (k_i·z_t) on the
    Triton linear-attention kernel in the input's precision (bf16/fp16 inputs: z is rounded to it)."""
    from ..kernels.rls import memory_dtype, rls_precision

    k = zero_masked(k, mask)
    mem = memory_dtype(v.dtype)
    z = rls_precision(q, k, lam_h, KK, C, out_dtype=mem)
    o, VK_end = linear_attention(z, k.to(mem), v.to(mem), feature_map="identity", normalize=False,
                                 initial_state=VK.float(), output_final_state=output_final_state, mask=mask,
                                 backend="triton")
    if not output_final_state:
        return o, None, None
    kf = k.float()
    return o, KK + torch.einsum("bthd,bthe->bhde", kf, kf), VK_end


# ----------------------------------------------------------------------------- inputs
def _lambda(lam, H, q, cdt) -> torch.Tensor:
    """λ as a ``[H]`` tensor in the compute dtype (differentiable when given as a tensor)."""
    if isinstance(lam, torch.Tensor):
        check_same_device(_OP, q, lam=lam)
        if not lam.is_floating_point():
            raise TypeError(f"{_OP}: lam must be a floating-point tensor, got dtype {lam.dtype}")
        if lam.dim() == 0:
            return lam.to(cdt).expand(H)
        if tuple(lam.shape) != (H,):
            raise ValueError(f"{_OP}: a tensor lam must be 0-d or have shape [H] = ({H},), got {tuple(lam.shape)}")
        return lam.to(cdt)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise TypeError(f"{_OP}: lam must be a positive number or a tensor [H], got {type(lam).__name__}")
    if not lam > 0:
        raise ValueError(f"{_OP}: lam (the ridge λ) must be > 0, got {lam!r}")
    return torch.full((H,), float(lam), dtype=cdt, device=q.device)


def _initial_state(state, B, H, dk, dv, device, cdt):
    if state is None:
        return (torch.zeros(B, H, dk, dk, dtype=cdt, device=device),
                torch.zeros(B, H, dv, dk, dtype=cdt, device=device))
    check_state_dict(_OP, state, _STATE_KEYS)
    check_state_tensor(_OP, "initial_state['KK']", state["KK"], (B, H, dk, dk), device)
    check_state_tensor(_OP, "initial_state['VK']", state["VK"], (B, H, dv, dk), device)
    return state["KK"].to(cdt), state["VK"].to(cdt)


def _ridged(KK, lam_h):
    """KK + λI (λ per head)."""
    eye = torch.eye(KK.shape[-1], dtype=KK.dtype, device=KK.device)
    return KK + lam_h[:, None, None] * eye


def _inverse(KK, lam_h):
    """(KK + λI)^{-1}; exactly I/λ when KK is zero (no initial state), so λ's gradient is exact too."""
    return torch.linalg.solve(_ridged(KK, lam_h), torch.eye(KK.shape[-1], dtype=KK.dtype, device=KK.device)
                              .expand_as(KK))


# ----------------------------------------------------------------------------- recurrent
def _recurrent_sherman_morrison(q, k, v, real, lam_h, gamma, KK, VK):
    """γ = 1: P_t = P − P k kᵀ P / (1 + kᵀ P k), S_t = S_{t−1} + (v − S_{t−1} k)(P_t k)ᵀ, o_t = S_t q_t.
    Pads have k = v = 0 (zeroed by the caller): P and S stay as they are."""
    T = q.shape[1]
    if bool((KK != 0).any()):
        P = _inverse(KK, lam_h)
    else:  # P_0 = I/λ (the common case, no solve)
        eye = torch.eye(KK.shape[-1], dtype=KK.dtype, device=KK.device)
        P = (eye / lam_h[:, None, None]).expand_as(KK)
    S = VK @ P
    outs = []
    for t in range(T):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # [B, H, d]
        Pk = (P @ kt[..., None])[..., 0]  # [B, H, dk]
        denom = 1.0 + (kt * Pk).sum(-1, keepdim=True)
        gain = Pk / denom  # P_t k_t
        P = P - Pk[..., :, None] * gain[..., None, :]
        err = vt - (S @ kt[..., None])[..., 0]
        S = S + err[..., :, None] * gain[..., None, :]
        KK = KK + kt[..., :, None] * kt[..., None, :]
        VK = VK + vt[..., :, None] * kt[..., None, :]
        outs.append((S @ qt[..., None])[..., 0])
    return torch.stack(outs, 1), KK, VK


def _recurrent_solve(q, k, v, real, lam_h, gamma, KK, VK):
    """γ < 1: KK ← γ KK + k kᵀ, VK ← γ VK + v kᵀ at real tokens only, then (KK + λI) z = q_t, o_t = VK z."""
    T = q.shape[1]
    g, one = (torch.tensor(x, dtype=KK.dtype, device=KK.device) for x in (gamma, 1.0))  # γ in the compute dtype
    outs = []
    for t in range(T):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        decay = torch.where(real[:, t], g, one)[:, None, None, None]  # no decay at pads
        KK = decay * KK + kt[..., :, None] * kt[..., None, :]
        VK = decay * VK + vt[..., :, None] * kt[..., None, :]
        z = torch.linalg.solve(_ridged(KK, lam_h), qt[..., None])  # [B, H, dk, 1]
        outs.append((VK @ z)[..., 0])
    return torch.stack(outs, 1), KK, VK


# ----------------------------------------------------------------------------- chunk
def _chunks(x, C):
    return split_chunks(pad_time(x, C), C)  # [B, H, N, C, d]


def _chunk_woodbury(q, k, v, real, lam_h, gamma, KK, VK, C):
    """γ = 1: z_t = (KK_t + λI)^{-1} q_t for every position at once, then o_t = VK_t z_t.

    The moments at every chunk start are a prefix sum (KK_c = KK_0 + Σ_{chunks before} KᵀK), so each
    chunk's P_0 = (KK_c + λI)^{-1} comes from its own Cholesky factor, in parallel over chunks and
    with no rounding carried from chunk to chunk. Inside a chunk, Woodbury around P_0: the C×C matrix
    M = I + K P_0 Kᵀ = L Lᵀ gives every position's leading principal inverse at once,
    R = K P_0 Qᵀ, X = N ⊙ L⁻ᵀ(N ⊙ L⁻¹(N ⊙ R)) with N[i, t] = 1 for i ≤ t, z_t = P_0 q_t − P_0 Kᵀ X[:, t].
    o_t = VK_0 z_t + Σ_{i≤t} v_i (k_i·z_t) is unnormalised linear attention with queries z."""
    T = q.shape[1]
    Q, K = _chunks(q, C), _chunks(k, C)  # [B, H, N, C, d]; padded positions have k = 0
    gram = K.transpose(-1, -2) @ K  # [B, H, N, dk, dk]
    starts = KK[:, :, None] + gram.cumsum(2) - gram  # the moments before each chunk
    KK_end = KK + gram.sum(2)
    chol = torch.linalg.cholesky(_ridged(starts, lam_h[:, None]))
    PK, PQ = torch.cholesky_solve(torch.cat([K, Q], -2).transpose(-1, -2), chol).split(C, -1)  # P_0 Kᵀ, P_0 Qᵀ
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).triu()  # [i, t]: i ≤ t
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    L = torch.linalg.cholesky(torch.eye(C, dtype=q.dtype, device=q.device) + K @ PK)
    R = torch.where(causal, K @ PQ, zero)  # [i, t] = k_iᵀ P_0 q_t, i ≤ t
    Y = torch.where(causal, torch.linalg.solve_triangular(L, R, upper=False), zero)
    X = torch.where(causal, torch.linalg.solve_triangular(L.transpose(-1, -2), Y, upper=True), zero)
    z = merge_chunks((PQ - PK @ X).transpose(-1, -2), T)  # rows z_tᵀ, [B, T, H, dk]
    o, VK_end = chunk_gated_linear(z, k, v, None, VK, C)
    return o, KK_end, VK_end


def _chunk_solve(q, k, v, real, lam_h, gamma, KK, VK, C):
    """γ < 1: the moments of every position of a chunk at once (decay counted in real tokens), one batched
    solve of the dk×dk systems (KK_t + λI) z_t = q_t."""
    T = q.shape[1]
    Q, K, V = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    R = split_chunks(pad_time(real[..., None, None].expand(-1, -1, 1, 1).to(q.dtype), C), C)[:, 0, :, :, 0]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [t, i]: i ≤ t
    log_g = torch.log(torch.tensor(gamma, dtype=q.dtype, device=q.device))
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    outs = []
    for n in range(Q.shape[2]):
        Qn, Kn, Vn = Q[:, :, n], K[:, :, n], V[:, :, n]  # [B, H, C, d]
        cnt = R[:, n].cumsum(-1)  # [B, C]: real tokens of the chunk up to and including t
        start = torch.exp(cnt * log_g)[:, None, :]  # γ^{n_t}: decay of the chunk-start moments, [B, 1, C]
        D = torch.where(causal, torch.exp((cnt[:, :, None] - cnt[:, None, :]) * log_g), zero)[:, None]  # [B,1,t,i]
        KKt = start[..., None, None] * KK[:, :, None] + torch.einsum("bhti,bhia,bhic->bhtac", D.expand(
            -1, Kn.shape[1], -1, -1), Kn, Kn)  # [B, H, C, dk, dk]
        z = torch.linalg.solve(_ridged(KKt, lam_h[:, None]), Qn[..., None])[..., 0]  # [B, H, C, dk]
        A = D * (z @ Kn.transpose(-1, -2))  # [t, i] = γ^{n_t−n_i} z_t·k_i
        outs.append(start[..., None] * (z @ VK.transpose(-1, -2)) + A @ Vn)
        KK, VK = KKt[:, :, -1], start[..., -1, None, None] * VK + (D[..., -1, :, None] * Vn).transpose(-1, -2) @ Kn
    return merge_chunks(torch.stack(outs, 2), T), KK, VK
