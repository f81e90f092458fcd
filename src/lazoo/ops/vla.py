"""Variational Linear Attention (the VLA paper, Algorithm 1), per head.

Layout: q/k/u ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token).
State: ``{"S": [B, H, dv, dk], "A": [B, H, dk, dk], "z": [B, H, dk], "t": [B] int64}``;
default S = 0, A = I / lambda0, z = 0, t = 0. q, k, v, u are the raw projections
(u = W_u k_raw already applied). Per real token (a pad changes nothing, t included):

    k_feat = elu(k) + 1;  k̂ = k_feat / |k_feat|;  û = normalize(u) / sqrt(dk)
    z_sm = A û;  δ = max(1 + û·z_sm, eps);  A ← A - z_sm z_smᵀ / δ
    t ← t + 1;  if refresh_period > 0 and t % refresh_period == 0:  A ← A + refresh_eta I
    α̂ = A k̂ / |A k̂|                     (post-update A)
    S ← S + (v - S k̂) α̂ᵀ
    q_f = elu(q) + 1;  z ← z + k_feat;  o = S q_f / max(z·q_f, eps)

Options (defaults: Algorithm 1 as above): ``feature_map="identity"`` takes φ(x) = x instead of elu(x) + 1 for
k_feat and q_f (signed keys, k̂ = k / |k|); ``readout="unit_query"`` reads o = S q̂ with q̂ = q_f / |q_f| (the
key's normalisation, no z division). "identity" needs "unit_query": z·q can be zero or negative. z accumulates
k_feat in every mode, so the state keeps one layout.

Chunk form: the α̂ of a whole A-chunk follow from its start A by Woodbury (``_woodbury_alphas``);
S then runs as the generalised delta rule (read key k̂, write key α̂, query q_f or q̂).
Triton (auto on CUDA): the features and the normaliser z·q_f in fused kernels (``lazoo.kernels.vla.features``), the
α̂ from the scan kernel that the ``triton_scan`` argument names: "token"
(``lazoo.kernels.vla.token``: token by token, A in registers, hand-written backward; the default and the reference, and
always for a few tokens; where B·H programs leave the GPU idle it splits time into pieces whose start A come from
``lazoo.kernels.vla.split``, exact algebra, and runs them at once) or "chunk" (``lazoo.kernels.vla.chunk``:
Woodbury per block of 16 tokens as matrix products), then S by the chunk-parallel generalised delta rule kernel.
The other backends have no scan kernel and ignore ``triton_scan``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.limits import VLA_MAX_HEAD_DIM
from .backend import host_sync_allowed, resolve_backend
from .boundary import empty_batch_result, op_result, prepare_inputs, records_graph, zero_masked
from .checks import check_choice, check_positive_int, check_positive_number
from .chunks import pad_time
from .delta import chunk_generalized_delta, delta_kernel_unsupported
from .dtypes import compute_dtype, without_autocast
from .linear import FEATURE_MAPS
from .scan import time_cumsum
from .states import check_state_dict, check_state_tensor

__all__ = ["vla"]

_OP = "vla"
_STATE_KEYS = ("S", "A", "z", "t")
#: the Triton kernels of the A scan (``triton_scan``): "token" (lazoo.kernels.vla.token, the reference) or "chunk"
#: (lazoo.kernels.vla.chunk). "token" is the default while the chunked scan is slower (H100, d = 128, T = 1k:
#: 3.0 / 14.1 ms forward / +backward vs 2.2 / 8.0).
TRITON_SCANS = ("token", "chunk")
#: φ of the keys and queries (``feature_map``, linear attention's maps of these names): Algorithm 1's elu(x) + 1
#: (> 0), or the identity (signed keys)
VLA_FEATURE_MAPS = ("elu1", "identity")
#: the read-out (``readout``): Algorithm 1's S q_f / max(z·q_f, ε), or S q̂ with the key's normalisation
READOUTS = ("normalized", "unit_query")


@without_autocast
def vla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    *,
    lambda0: float = 0.1,
    refresh_period: int = 20,
    refresh_eta: float = 1e-3,
    eps: float = 1e-4,
    chunk_size: int = 64,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    triton_scan: str = "token",
    feature_map: str = "elu1",
    readout: str = "normalized",
):
    """VLA attention; returns ``(o [B, T, H, dv], final_state)`` (state dict S, A, z, t).

    ``triton_scan``: the kernel of the A scan when the Triton backend runs, "token" (``lazoo.kernels.vla.token``, the
    default) or "chunk" (``lazoo.kernels.vla.chunk``, Woodbury per block of 16 tokens); a call of at most 16 tokens
    (decoding) uses the token scan either way. The "recurrent" and "chunk" backends ignore it (they have no scan
    kernel), so a model that asks for the chunked scan also runs where Triton does not.

    ``feature_map``: φ of k and q, "elu1" (elu(x) + 1, the default) or "identity" (signed keys, k̂ = k / |k|).
    ``readout``: "normalized" (S φ(q) / max(z·φ(q), ε), the default) or "unit_query" (S φ(q) / |φ(q)|, no z).
    "identity" needs "unit_query"."""
    # a NaN at a pad never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v, u) = prepare_inputs(_OP, q, k, v, mask, like_q={"u": u})
    chunk_size = check_positive_int(_OP, "chunk_size", chunk_size)
    if not isinstance(refresh_period, int) or isinstance(refresh_period, bool):
        raise ValueError(f"{_OP}: refresh_period must be an int (<= 0: no refresh), got {refresh_period!r}")
    if not lambda0 > 0:
        raise ValueError(f"{_OP}: lambda0 must be > 0, got {lambda0!r}")
    # A stays positive definite only with a non-negative refresh (the chunk form's Cholesky needs it)
    check_positive_number(_OP, "refresh_eta", refresh_eta, zero_ok=True)
    check_positive_number(_OP, "eps", eps)
    backend = resolve_backend(_OP, backend, q.device, _triton_unsupported(q, v, chunk_size))
    triton_scan = check_choice(_OP, "triton_scan", triton_scan, TRITON_SCANS)  # the triton backend's choice
    normalized = _check_map_and_readout(feature_map, readout)
    cdt = compute_dtype(q.dtype)

    state = _initial_state(initial_state, lambda0, B, H, dk, dv, q.device, cdt)
    if B == 0:
        return empty_batch_result(q, v, state, output_final_state)
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    hp = dict(refresh_period=refresh_period, refresh_eta=refresh_eta, eps=eps, normalized=normalized)
    if backend == "triton":  # the features in fused kernels (lazoo.kernels.vla.features)
        o, final = _triton_vla(q, k, u, v, real, mask, state, chunk_size, triton_scan,
                               elu=feature_map == "elu1", **hp)
        return op_result(o, mask, v.dtype, final, output_final_state)

    phi = FEATURE_MAPS[feature_map]  # linear attention's map of that name
    k_feat, k_hat, u_hat = _key_features(k.to(cdt), u.to(cdt), phi)
    q_r = _query_features(q.to(cdt), phi, normalized)
    v_c = v.to(cdt)
    if backend == "recurrent":
        o, final = _recurrent_vla(q_r, k_feat, k_hat, u_hat, v_c, real, state, **hp)
    else:
        o, final = _chunk_vla(q_r, k_feat, k_hat, u_hat, v_c, real, mask, state, chunk_size, **hp)
    return op_result(o, mask, v.dtype, final, output_final_state)


# ============================================================================ shared pieces
def _check_map_and_readout(feature_map, readout) -> bool:
    """Check the two options; True for the z-normalised read-out."""
    check_choice(_OP, "feature_map", feature_map, VLA_FEATURE_MAPS)
    check_choice(_OP, "readout", readout, READOUTS)
    if feature_map == "identity" and readout == "normalized":
        raise ValueError(f"{_OP}: feature_map='identity' needs readout='unit_query', not readout='normalized': "
                         "with signed features z·q can be zero or negative, a divisor that clamping cannot fix")
    return readout == "normalized"


def _key_features(k, u, phi):
    """k_feat = φ(k), k̂ = k_feat / |k_feat|, û = normalize(u) / sqrt(dk)."""
    k_feat = phi(k)
    # ε-safe: a signed key (φ = identity) can be 0, as every pad is; elu(k) + 1 > 0 never meets the floor
    k_hat = F.normalize(k_feat, dim=-1)
    u_hat = F.normalize(u, dim=-1) / k.shape[-1] ** 0.5
    return k_feat, k_hat, u_hat


def _query_features(q, phi, normalized):
    """The query that reads S: q_f = φ(q) for the normalized read-out, else q̂ = q_f / |q_f| (as k̂ is made)."""
    q_f = phi(q)
    return q_f if normalized else F.normalize(q_f, dim=-1)


def _read_out(num, z, q_r, eps, normalized):
    """o from num = S q_r: num / max(z·q_f, ε) for the normalized read-out (q_r = q_f), num for "unit_query"."""
    if not normalized:
        return num
    return num / (z * q_r).sum(-1, keepdim=True).clamp_min(eps)


def _initial_state(state, lambda0, B, H, dk, dv, device, cdt) -> dict[str, torch.Tensor]:
    if state is None:
        return {
            "S": torch.zeros(B, H, dv, dk, dtype=cdt, device=device),
            "A": torch.eye(dk, dtype=cdt, device=device).repeat(B, H, 1, 1) / lambda0,
            "z": torch.zeros(B, H, dk, dtype=cdt, device=device),
            "t": torch.zeros(B, dtype=torch.int64, device=device),
        }
    check_state_dict(_OP, state, _STATE_KEYS)
    check_state_tensor(_OP, "initial_state['S']", state["S"], (B, H, dv, dk), device)
    check_state_tensor(_OP, "initial_state['A']", state["A"], (B, H, dk, dk), device)
    check_state_tensor(_OP, "initial_state['z']", state["z"], (B, H, dk), device)
    t = state["t"]
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B,) or t.is_floating_point() or t.is_complex():
        got = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{_OP}: initial_state['t'] must be an integer tensor of shape [B] = ({B},), got {got}")
    A = state["A"].to(cdt)
    return {
        "S": state["S"].to(cdt),
        # A is symmetric; symmetrising makes both forms the same function of A (and gradient).
        "A": 0.5 * (A + A.transpose(-1, -2)),
        "z": state["z"].to(cdt),
        "t": t.to(device=device, dtype=torch.int64),
    }


def _refresh_flags(real, t0, refresh_period):
    """``[B, T]`` bool: the A update at this (real) token is followed by the +ηI refresh."""
    counts = t0[:, None] + real.long().cumsum(1)  # 1-based step count after each token
    if refresh_period <= 0:
        return torch.zeros_like(real)
    return real & (counts % refresh_period == 0)


# ============================================================================ recurrent form
def _recurrent_vla(q_r, k_feat, k_hat, u_hat, v, real, state, *, refresh_period, refresh_eta, eps, normalized):
    """Algorithm 1, batched over samples and heads, one token at a time."""
    S, A, z, t = state["S"], state["A"], state["z"], state["t"]
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    outs = []
    for i in range(q_r.shape[1]):
        m = real[:, i]  # [B]
        mb = m[:, None, None]  # broadcast over [B, H, d]

        # Sherman-Morrison update of A (δ >= 1 while A is positive definite; eps is a floor).
        z_sm = torch.einsum("bhij,bhj->bhi", A, u_hat[:, i])
        delta = (1.0 + (u_hat[:, i] * z_sm).sum(-1)).clamp_min(eps)
        A_new = A - z_sm[..., :, None] * z_sm[..., None, :] / delta[..., None, None]
        t = t + m.long()
        if refresh_period > 0:
            refresh = (m & (t % refresh_period == 0)).to(A.dtype)[:, None, None, None]
            A_new = A_new + refresh * refresh_eta * eye
        A = torch.where(mb[..., None], A_new, A)

        # Residual S update along the normalised post-update direction α̂ = A k̂ / |A k̂|.
        alpha = F.normalize(torch.einsum("bhij,bhj->bhi", A, k_hat[:, i]), dim=-1)
        e = v[:, i] - torch.einsum("bhvk,bhk->bhv", S, k_hat[:, i])
        S = torch.where(mb[..., None], S + e[..., :, None] * alpha[..., None, :], S)

        # Read-out (z accumulates in every mode: the state keeps one layout).
        z = torch.where(mb, z + k_feat[:, i], z)
        num = torch.einsum("bhvk,bhk->bhv", S, q_r[:, i])
        outs.append(_read_out(num, z, q_r[:, i], eps, normalized))
    return torch.stack(outs, dim=1), {"S": S, "A": A, "z": z, "t": t}


# ============================================================================ Triton path
_DECODE_MAX_T = 16  # fused recurrent S update up to this many tokens without autograd


def _triton_unsupported(q, v, chunk_size) -> str | None:
    if q.shape[-1] > VLA_MAX_HEAD_DIM:
        return f"the Triton VLA scan holds A in registers: dk up to {VLA_MAX_HEAD_DIM}, got {q.shape[-1]}"
    return delta_kernel_unsupported(q, v, chunk_size)


def _triton_vla(q, k, u, v, real, mask, state, chunk_size, triton_scan, *, elu, refresh_period, refresh_eta, eps,
                normalized):
    """The features and the normaliser by ``lazoo.kernels.vla.features``, α̂ by the scan kernel ``triton_scan``
    names, S by the generalised delta rule kernel (operands in v's dtype). ``real`` is ``mask`` or all ones;
    zeroing the pads takes ``mask`` (None: nothing to zero, no pass over the data)."""
    from ..kernels import delta as kd
    from ..kernels.vla.features import vla_features, vla_normaliser

    dt = v.dtype
    k_hat, u_hat, k_d, q_d = vla_features(q, k, u, dt, elu=elu, unit_query=not normalized)
    flags = _refresh_flags(real, state["t"], refresh_period)
    # a few tokens (decoding) fill less than one block of the chunked scan: the token scan is cheaper there
    if triton_scan == "chunk" and q.shape[1] > _DECODE_MAX_T:
        from ..kernels.vla.chunk import vla_scan_chunked as scan
    else:
        from ..kernels.vla.token import vla_scan as scan
    alpha_hat, A = scan(k_hat, zero_masked(u_hat, mask), flags, state["A"], eta=refresh_eta, eps=eps)
    w = zero_masked(alpha_hat, mask)  # a pad writes nothing
    args = (q_d, k_d, v, w.to(dt))  # the kernels read S with q_f or q̂ alike
    decoding = q.shape[1] <= _DECODE_MAX_T and not records_graph(*args, state["S"])
    if decoding:  # one or a few tokens against the cache: token by token, no chunk machinery
        num, S = kd.fused_recurrent_generalized_delta_rule(*args, initial_state=state["S"].contiguous(),
                                                           output_final_state=True)
    else:
        num, S = kd.chunk_generalized_delta_rule(*args, initial_state=state["S"], output_final_state=True,
                                                 chunk_size=chunk_size)
    den, z = vla_normaliser(q, k, state["z"], mask, eps, elu=elu)
    o = num.float() / den[..., None] if normalized else num.float()
    t = state["t"] + real.long().sum(1)
    return o, {"S": S, "A": A, "z": z.to(state["z"].dtype), "t": t}


# ============================================================================ chunk form
def _chunk_vla(q_r, k_feat, k_hat, u_hat, v, real, mask, state, chunk_size, *, refresh_period,
               refresh_eta, eps, normalized):
    """(a) α̂ for all tokens chunk-wise by Woodbury; (b) S by the generalised delta rule."""
    alpha_hat, A = _chunk_alphas(k_hat, u_hat, real, state["A"], state["t"], chunk_size,
                                 refresh_period, refresh_eta)
    w = zero_masked(alpha_hat, mask)  # a pad writes nothing
    num, S = chunk_generalized_delta(q_r, k_hat, v, w, None, state["S"], chunk_size)
    z_t = state["z"][:, None] + time_cumsum(zero_masked(k_feat, mask))  # z after each token
    o = _read_out(num, z_t, q_r, eps, normalized)
    t = state["t"] + real.long().sum(1)
    return o, {"S": S, "A": A, "z": z_t[:, -1], "t": t}


def _chunk_alphas(k_hat, u_hat, real, A0, t0, chunk_size, refresh_period, refresh_eta):
    """α̂ ``[B, T, H, dk]`` of every token and the final A, one A-chunk at a time.

    The +ηI refresh is full rank and cannot enter a Woodbury update, so A-chunks have at most
    ``refresh_period`` positions: then each sample refreshes at most once per A-chunk, at its
    own position r_b (step counts differ per sample). Pass 1 takes the directions up to r_b
    (all, if b does not refresh) and gives α before r_b and the A after r_b's update; ηI is
    added; pass 2 takes the directions after r_b and gives α from r_b on (at r_b it is
    (A + ηI) k̂, since pass 2 has no direction before then).
    """
    C = min(chunk_size, refresh_period) if refresh_period > 0 else chunk_size
    refresh = _refresh_flags(real, t0, refresh_period)  # [B, T]
    has_refresh, has_later = _chunk_flags(refresh, real, C)
    eye = torch.eye(A0.shape[-1], dtype=A0.dtype, device=A0.device)

    alphas, A = [], A0
    for n, s in enumerate(range(0, real.shape[1], C)):
        kh = k_hat[:, s:s + C].transpose(1, 2)  # [B, H, c, dk]
        uh = u_hat[:, s:s + C].transpose(1, 2)
        m, rf = real[:, s:s + C], refresh[:, s:s + C]
        c = m.shape[1]
        pos = torch.arange(c, device=m.device)
        # r_b: the refresh position of sample b in this chunk, c if none.
        r = torch.where(rf.any(1), rf.long().argmax(1), torch.full_like(t0, c))
        first = m & (pos[None] <= r[:, None])  # [B, c]
        alpha, A = _woodbury_alphas(A, uh * first[:, None, :, None], kh)
        if has_refresh[n]:
            bump = (rf.any(1).to(A.dtype) * refresh_eta)[:, None, None, None]  # η for refreshing samples
            A = A + bump * eye
            if has_later[n]:
                second = m & (pos[None] > r[:, None])
                alpha2, A = _woodbury_alphas(A, uh * second[:, None, :, None], kh)
            else:  # no direction after any r_b: α = (A + ηI) k̂ from r_b on
                alpha2 = alpha + bump * kh
            after = (pos[None] >= r[:, None])[:, None, :, None]  # [B, 1, c, 1]
            alpha = torch.where(after, alpha2, alpha)
        alphas.append(alpha)
    alpha = torch.cat(alphas, dim=2).transpose(1, 2)  # [B, T, H, dk]
    return F.normalize(alpha, dim=-1), A


def _chunk_flags(refresh, real, C):
    """Per A-chunk of length C: does any sample refresh in it, and does any sample have a real
    token after its refresh (i.e. is pass 2 needed)? One host sync for the whole sequence; where none may be made
    (compiled or captured), every chunk takes both passes, which gives the same α and A (a pass with no refresh or
    no later direction changes nothing)."""
    B, T = refresh.shape
    if not host_sync_allowed():
        every = [True] * -(-T // C)
        return every, every
    rf = pad_time(refresh.long(), C).view(B, -1, C)
    m = pad_time(real.long(), C).view(B, -1, C)
    later = ((rf.cumsum(-1) - rf) > 0) & (m > 0)  # a refresh strictly earlier in the chunk
    flags = torch.stack([(rf > 0).any(-1).any(0), later.any(-1).any(0)]).tolist()
    return flags[0], flags[1]


def _woodbury_alphas(A0, U, K):
    """α_t = A_t k̂_t for every t of a chunk, with A_t = A0 after the directions U_{≤t}.

    A0 ``[B, H, d, d]`` (symmetric positive definite), U and K ``[B, H, C, d]`` with one
    direction / key per row (a zero row is no update). With W = A0 Û, G = I + Ûᵀ W = R Rᵀ
    (Cholesky, R lower) and B = Ûᵀ A0 K̂, the leading block G_{≤t} = R_{≤t} R_{≤t}ᵀ, so
        X = triu(R^{-T} triu(R^{-1} triu(B))),   α_t = A0 k̂_t - W X[:, t],
    and the chunk's final A = A0 - W G^{-1} Wᵀ. This equals the sequential Sherman-Morrison
    recursion exactly: its clamp δ >= eps never binds, since δ = 1 + ûᵀ A û >= 1 while A is
    positive definite, and A stays positive definite (rank-one downdates of an SPD inverse,
    plus ηI). Returns (α unnormalised ``[B, H, C, d]``, final A).
    """
    C = U.shape[-2]
    W = U @ A0.transpose(-1, -2)  # rows (A0 û_i)ᵀ
    AK = K @ A0.transpose(-1, -2)  # rows (A0 k̂_t)ᵀ
    G = torch.eye(C, dtype=A0.dtype, device=A0.device) + U @ W.transpose(-1, -2)
    Bm = U @ AK.transpose(-1, -2)  # [i, t] = û_i · A0 k̂_t
    R, _ = torch.linalg.cholesky_ex(G)  # G is SPD (>= I); _ex avoids a host sync on CUDA
    upper = torch.ones(C, C, dtype=torch.bool, device=A0.device).triu()  # rows i <= column t
    # Only the middle triu is needed: R^{-1} is lower triangular, so rows i <= t of R^{-1} B
    # use rows <= t of B only, and R^{-T} (upper) keeps rows i > t of a triu matrix at zero.
    Y = torch.linalg.solve_triangular(R, Bm, upper=False).masked_fill(~upper, 0.0)
    X = torch.linalg.solve_triangular(R.transpose(-1, -2), Y, upper=True)
    alpha = AK - X.transpose(-1, -2) @ W
    A_end = A0 - W.transpose(-1, -2) @ torch.cholesky_solve(W, R)
    return alpha, A_end
