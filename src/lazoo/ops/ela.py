"""Exact Linear Attention (ELA; the ELA paper, eqs. 3-13): kernel attention with an exactly decomposable kernel.

A kernel pair (φ on queries, ψ on keys) with ``k(a, b) = φ(a)·ψ(b)`` turns the quadratic form
``o_i = Σ_j k(q_i, k_j) v_j / Σ_j k(q_i, k_j)`` into linear attention, with no approximation:

    S = Σ_j v_j ψ(k_j)^T,   C = Σ_j ψ(k_j),   o_i = S φ(q_i) / max(φ(q_i)·C, eps)

over j <= i (``causal=True``: prefix sums, a recurrent state) or over the whole sequence
(``causal=False``: bidirectional, no state). Kernels (D = head dim of q/k; feature dim F):

    hadamard_exp         φ(a) = exp(a),               ψ(b) = exp(b)                  F = D
                         k = Σ_d exp(a_d + b_d)
    sum_sq_euclid        φ(a) = [a, ‖a‖², 1],         ψ(b) = [2b, 1, ‖b‖²]            F = D + 2
                         k = ‖a + b‖²
    sub_sq_euclid        φ(a) = [a, ‖a‖², 1],         ψ(b) = [-2b, 1, ‖b‖²]           F = D + 2
                         k = ‖a - b‖²
    magnitude_direction  φ(a) = (‖a‖²+1)[a; 1],       ψ(b) = (‖b‖²+1)[b; 1]           F = D + 1
                         k = (‖a‖²+1)(‖b‖²+1)(a·b + 1)

Layout: q/k ``[B, T, H, D]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token: a pad adds
nothing to the sums and outputs 0). Packed batches: ``cu_seqlens`` ``[N + 1]`` (ints from 0 to T, B = 1,
no mask) holds the boundaries of N sequences packed along time; no sequence sees another, and states are
``[N, ...]``, one per sequence. State (causal): ``{"S": [B, H, dv, F], "C": [B, H, F]}``, and
for ``hadamard_exp`` also ``"m": [B, H, D]`` (the running key maximum per feature, below). States are
in the compute dtype (float64 for float64 inputs, else float32); the features are formed in it too,
so exp and the cubic magnitude_direction features never overflow in half precision.

The denominator. ``max(φ(q)·C, eps)`` is the clamp in every form, the quadratic one included. For
``sum_sq_euclid`` and ``hadamard_exp`` the kernel is positive, so the clamp only acts on sums that
vanish. ``sub_sq_euclid`` is 0 at k = q (a query whose every visible key equals it has denominator
0), and ``magnitude_direction`` is negative where a·b < -1, so its sum can be 0 or negative: those
rows get the denominator eps (output ``S φ(q) / eps``: finite in the compute dtype, possibly large, so
it can round to ±inf in fp16 output, as its float64 value would; the sign of the numerator is kept).
No |·| is taken: a negative sum is not a valid normaliser, and clamping it to eps is the documented,
deterministic choice.

Keeping ``hadamard_exp`` finite, exactly. ``k(a, b) = Σ_d exp(a_d + c_d) exp(b_d - c_d)`` for any
per-feature constants c_d, and the ratio is invariant to a per-query factor on φ(q_i). The op uses
    ψ̃(k_j) = exp(k_j - m_i),           m_{i,d} = max(m_{0,d}, max_{j<=i} k_{j,d})   (running, per feature)
    φ̃(q_i) = exp(q_i + m_i - M_i),     M_i = max_d (q_{i,d} + m_{i,d})               (per query)
(per sample and head; m_0 comes from the state, or is the first real key). Every factor is <= 1 and
the largest term of φ̃(q_i)·C̃_i is exactly 1 (the key that set m_{i,d*} is visible to query i), so
the scaled denominator is >= 1: nothing overflows and nothing underflows to 0/0, for any input
range. Rescaling the prefix sums when the maximum grows is a decay per feature,
``S̃_i = S̃_{i-1} diag(exp(m_{i-1} - m_i)) + v_i ψ̃(k_i)^T``: GLA (``ops.gla``) with log decay
``m_{i-1} - m_i <= 0`` on the values v. The normaliser's sums need no decay: C̃_i = Σ_{j≤i} exp(k_j - m_i)
= exp(lse_i - m_i) with lse_i = logcumsumexp of the keys (plus the state's log(C̃_0) + m_0 as a first term), so
``φ̃(q_i)·C̃_i = Σ_d exp(q_id + lse_id - M_i)``, in fp32 whatever the GLA runs in (before, C̃ rode along as a
(dv+1)-th value column). The clamp is applied to the true (unscaled) denominator:
``o_i = num_i / max(den_i, eps · exp(-M_i))``. The state stores
S̃, C̃ and m (``S = S̃ diag(exp(m))``). The maxima carry no gradient (the output does not depend on
them). The bidirectional form uses the largest real key per feature over the whole sequence.

Backends: the causal forms run ``linear_attention`` (polynomial kernels, feature_map="identity",
normalize=True) or ``gla`` (hadamard_exp) on the feature tensors, with ``backend`` passed through, so
the chunk forms, the step-by-step references and the Triton kernels (auto on CUDA) are theirs. On the
Triton backend with fp32 or bf16 inputs (and more than a few tokens, or gradients), a polynomial kernel
splits its features as φ(q) = [q', a], ψ(k) = [k', c] (D scaled inputs and 1-2 scalars a token) and
runs ``lazoo.kernels.normalized``: the D-dim part in the inputs' precision, the scalar features in fp32,
and the normaliser inside the kernel's chunks (``_causal_poly_fused``): the same sums in another order.
hadamard_exp runs there too, with one shift per sequence and feature (its largest key) instead of the running
maximum, where every feature's keys spread by at most ``EXP_SPREAD_LIMIT`` (``_causal_exp_fused``; else the GLA
form, said once). The bidirectional form runs the same kernels without their score tiles on the Triton backend
(``causal=False``: each sequence's sums once, then every token's output from them; fp16 excepted), and is two matmuls
on "chunk" and token-by-token sums on "recurrent" (the reference).
"""

from __future__ import annotations

import torch

from .backend import host_sync_allowed, logger, resolve_backend
from .boundary import op_result, prepare_inputs, zero_masked
from .checks import check_positive_int, check_positive_number, queue_readback
from .dtypes import compute_dtype, without_autocast
from .linear import decoding, gla_as, linear_attention_as, linear_kernel_unsupported
from .packing import check_cu_seqlens, packed_sequence_ids
from .scan import fast_scan
from .states import check_state_dict, check_state_tensor

__all__ = ["ELA_KERNELS", "ela", "ela_feature_dim", "ela_features", "ela_kernel"]

ELA_KERNELS = ("hadamard_exp", "sum_sq_euclid", "sub_sq_euclid", "magnitude_direction")


def ela_feature_dim(kernel: str, head_dim: int) -> int:
    """The feature dim F of a kernel's φ/ψ for q/k of head dim ``head_dim``."""
    _check_kernel("ela", kernel)
    return head_dim + {"hadamard_exp": 0, "sum_sq_euclid": 2, "sub_sq_euclid": 2, "magnitude_direction": 1}[kernel]


def ela_features(kernel: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(q), ψ(k))`` for a polynomial kernel, or the plain ``(exp(q), exp(k))`` for hadamard_exp
    (no shift: use it on small inputs only; the op shifts, see the module docstring)."""
    _check_kernel("ela", kernel)
    if kernel == "hadamard_exp":
        return q.exp(), k.exp()
    q1, k1, a, c = _poly_parts(kernel, q, k)
    return torch.cat([q1, a], -1), torch.cat([k1, c], -1)


def _poly_parts(kernel: str, q: torch.Tensor, k: torch.Tensor):
    """A polynomial kernel's features split as φ(q) = [q', a], ψ(k) = [k', c]: ``q'``, ``k'`` ``[..., D]`` (the
    scaled inputs) and ``a``, ``c`` ``[..., E]`` (E = 2 or 1 scalar features a token)."""
    qq = (q * q).sum(-1, keepdim=True)
    kk = (k * k).sum(-1, keepdim=True)
    if kernel == "magnitude_direction":  # (‖a‖²+1)[a; 1] · (‖b‖²+1)[b; 1]
        return (qq + 1) * q, (kk + 1) * k, qq + 1, kk + 1
    sign = 2.0 if kernel == "sum_sq_euclid" else -2.0  # [a, ‖a‖², 1] · [±2b, 1, ‖b‖²]
    return q, sign * k, torch.cat([qq, torch.ones_like(qq)], -1), torch.cat([torch.ones_like(kk), kk], -1)


def ela_kernel(kernel: str, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The kernel itself, pairwise: ``[B, T, H, D] x [B, S, H, D] -> [B, H, T, S]``, computed directly
    from its definition (not through the features), for checking the exactness claim."""
    _check_kernel("ela", kernel)
    if kernel == "hadamard_exp":  # Σ_d exp(a_d) exp(b_d)
        return torch.einsum("bthd,bshd->bhts", q.exp(), k.exp())
    if kernel in ("sum_sq_euclid", "sub_sq_euclid"):
        sign = 1.0 if kernel == "sum_sq_euclid" else -1.0
        diff = q.transpose(1, 2)[:, :, :, None, :] + sign * k.transpose(1, 2)[:, :, None, :, :]
        return (diff * diff).sum(-1)
    qq = (q * q).sum(-1).transpose(1, 2)  # [B, H, T]
    kk = (k * k).sum(-1).transpose(1, 2)
    dot = torch.einsum("bthd,bshd->bhts", q, k)
    return (qq[..., :, None] + 1) * (kk[..., None, :] + 1) * (dot + 1)


@without_autocast
def ela(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: str = "hadamard_exp",
    causal: bool = True,
    eps: float = 1e-6,
    chunk_size: int = 64,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Exact Linear Attention with kernel pair ``kernel`` (see the module docstring).

    Returns ``(o [B, T, H, dv] in v's dtype, final_state or None)``. ``causal=False`` is the
    bidirectional form: every real token attends to every real token; it has no state, so
    ``initial_state``/``output_final_state`` must be left unset.
    """
    op = "ela"
    (B, T, H, D, dv), mask, (q, k, v) = prepare_inputs(op, q, k, v, mask)  # a NaN at a pad never meets a real token
    _check_kernel(op, kernel)
    chunk_size = check_positive_int(op, "chunk_size", chunk_size)
    check_positive_number(op, "eps", eps)
    resolve_backend(op, backend, q.device, None)  # validates backend / LAZOO_BACKEND; the inner op picks
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device, mask)
    cdt = compute_dtype(q.dtype)
    F_ = ela_feature_dim(kernel, D)
    if not causal:
        if initial_state is not None or output_final_state:
            raise ValueError(f"{op}: the bidirectional form (causal=False) has no state; "
                             "leave initial_state=None and output_final_state=False")
        kernels = resolve_backend(op, backend, q.device, linear_kernel_unsupported(q, v)) == "triton"
        if kernels and q.dtype != torch.float16:
            return op_result(_bidirectional_fused(kernel, q, k, v, eps, mask, cu_seqlens), mask, v.dtype, None, False)
        if cu_seqlens is not None:  # each sequence attends to itself only
            bounds = cu_seqlens.tolist()
            parts = [_bidirectional(q[:, s:e], k[:, s:e], v[:, s:e], kernel, eps, None, backend, cdt)
                     for s, e in zip(bounds[:-1], bounds[1:])]
            return torch.cat(parts, 1), None
        return _bidirectional(q, k, v, kernel, eps, mask, backend, cdt), None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    state = _initial_state(op, initial_state, kernel, N, H, F_, dv, q.device, cdt)
    # (hadamard_exp's fallback, the GLA form, resolves its own backend and says why if it cannot run Triton)
    fused = (q.dtype != torch.float16 and not decoding(T, cu_seqlens, q, k, v)
             and resolve_backend(op, backend, q.device, linear_kernel_unsupported(q, v),
                                 log_fallback=kernel != "hadamard_exp") == "triton")
    if kernel == "hadamard_exp":
        out = None
        if fused:  # None where the keys spread too far for one shift per sequence
            out = _causal_exp_fused(q, k, v, eps, chunk_size, state, output_final_state, mask, cu_seqlens)
        if out is None:
            out = _causal_exp(q.to(cdt), k.to(cdt), v.to(cdt), eps, chunk_size, state, output_final_state, mask,
                              backend, cu_seqlens)
        o, final = out
    elif fused:
        # the kernel's score tiles are in the inputs' dtype: fp16's range (6.5e4) would not hold them
        # (magnitude_direction is cubic), so fp16 keeps the fp32 feature path below, as decoding does (a few
        # tokens against the state, through the fused recurrent kernel)
        o, final = _causal_poly_fused(kernel, q, k, v, eps, chunk_size, state, output_final_state, mask, cdt,
                                      cu_seqlens)
    else:
        fq, fk = ela_features(kernel, q.to(cdt), k.to(cdt))
        inner = None if state is None else {"S": state["S"], "z": state["C"]}
        o, st = linear_attention_as(op, fq, fk, v.to(cdt), feature_map="identity", normalize=True, eps=eps,
                                    chunk_size=chunk_size, initial_state=inner, output_final_state=output_final_state,
                                    mask=mask, backend=backend, cu_seqlens=cu_seqlens)
        final = None if st is None else {"S": st["S"], "C": st["z"]}
    return op_result(o, mask, v.dtype, final, output_final_state)


# ============================================================================ causal polynomial kernels, Triton
def _causal_poly_fused(kernel, q, k, v, eps, chunk_size, state, output_final_state, mask, cdt, cu_seqlens=None):
    """φ(q)·ψ(k) = q'·k' + a·c on ``lazoo.kernels.normalized``: the D features q', k' in the inputs' precision (no
    D + 2 features padded to 2D), the 1-2 scalar features a, c in fp32 (both formed by ``lazoo.kernels.ela_features``
    in one pass, without gradient: the kernel's backward carries theirs to q and k), and the normaliser formed inside
    the kernel's chunks. The state keeps the feature layout
    (S = [S', Σ v cᵀ], C = [Σ k', Σ c]): decoding and caches are unchanged. (magnitude_direction: q', k' are
    rounded to the inputs' precision, a and c are not.)"""
    D = q.shape[-1]
    s0 = None
    if state is not None:
        s0 = (state["S"][..., :D], state["S"][..., D:], state["C"][..., :D], state["C"][..., D:])
    o, final = _on_poly_features(kernel, q, k, v, eps, mask, initial_state=s0, output_final_state=output_final_state,
                                 cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if final is not None:
        h, he, z, ze = final
        final = {"S": torch.cat([h, he], -1).to(cdt), "C": torch.cat([z, ze], -1).to(cdt)}
    return o, final


def _on_poly_features(kernel, q, k, v, eps, mask, **run):
    """``chunk_normalized_linear_attention`` (``run``: its other arguments) on a polynomial kernel's split features:
    q', k' and the scalar features a, c, formed without gradient (the kernel's backward carries theirs to q, k)."""
    from ..kernels.ela_features import KERNELS, poly_features
    from ..kernels.normalized import chunk_normalized_linear_attention

    q1, k1, a, c = poly_features(q, k, kernel, mask)  # q, k are zero at pads; c is made so
    return chunk_normalized_linear_attention(q1, k1, v, a, c, eps=eps, poly_of=(q, k, *KERNELS[kernel]), **run)


# ============================================================================ causal hadamard_exp
#: the largest spread (max - min) of a feature's keys over a sequence for which hadamard_exp runs on the normalised
#: kernel with one shift per sequence: every scaled key feature exp(k - c) stays above e^-60, far from underflow
EXP_SPREAD_LIMIT = 60.0
_EXP_FALLBACK_SAID: set[str] = set()


def _causal_exp_fused(q, k, v, eps, chunk_size, state, output_final_state, mask, cu_seqlens):
    """hadamard_exp on ``lazoo.kernels.normalized`` (no scalar features): one shift per sequence and feature, its
    largest real key c (with the state's m), in place of the running maximum. ψ̃(k) = exp(k - c) <= 1 and
    φ̃(q_i) = exp(q_i + c - M_i) <= 1 with M_i = max_d (q_id + c_d); the clamp is eps·exp(-M_i) per query, the true
    max(den, eps). The ratio is the same for any shift; a shift from later keys is exact but can underflow the early
    ones, so this result is kept only where every feature's keys (and the state's m) spread by at most
    ``EXP_SPREAD_LIMIT``, and None is returned otherwise (the running-max form then runs; said once). The spread is
    read back once the kernels are queued, and waits for the check only (``queue_readback``): a read-back before
    them left the GPU idle while the host launched them.
    The state is the running-max form's: S̃ and C̃ relative to m = c."""
    from ..kernels.ela_features import exp_features
    from ..kernels.normalized import chunk_normalized_linear_attention

    if not host_sync_allowed():  # the spread check reads back one number
        return None
    seq = None if cu_seqlens is None else packed_sequence_ids(cu_seqlens, q.shape[1])  # [T]: each token's sequence
    with torch.no_grad():
        lo, hi = (x.float() for x in _key_extremes(k, mask, cu_seqlens, seq, smallest=True))
        if state is not None:
            hi, lo = torch.maximum(hi, state["m"]), torch.minimum(lo, state["m"])
        keys = torch.isfinite(hi)  # a sequence with no real key (and no state): shift 0
        c = torch.where(keys, hi, 0.0)
        too_wide = queue_readback(((hi - lo) > EXP_SPREAD_LIMIT).logical_and_(keys).any())  # read back below
    fq, fk, eps_rows = exp_features(q, k, c, eps, mask, seq)
    s0 = None
    if state is not None:  # S̃, C̃ relative to the state's m, rescaled to c (>= m)
        r = (state["m"] - c).exp()
        s0 = (state["S"] * r[:, :, None, :], None, state["C"] * r, None)
    o, final = chunk_normalized_linear_attention(fq, fk, v, eps=eps_rows, initial_state=s0,
                                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                                 chunk_size=chunk_size, exp_of=(q, k))
    if bool(too_wide()):  # every value computed is finite (each factor <= 1), only possibly underflowed: dropped
        if "spread" not in _EXP_FALLBACK_SAID:
            _EXP_FALLBACK_SAID.add("spread")
            logger.warning("ela: hadamard_exp keys spread by more than %g along a sequence; using the running-max "
                           "form (GLA kernels), exact for any range and slower.", EXP_SPREAD_LIMIT)
        return None
    if final is not None:
        final = {"S": final[0], "C": final[2], "m": c}
    return o, final


def _key_extremes(k, mask, cu_seqlens, seq, smallest: bool = False):
    """``(smallest or None, largest)`` real key per sample (or packed sequence: ``cu_seqlens``, and ``seq`` ``[T]``
    each token's), head and feature ``[N, H, D]`` in k's dtype (exact), -inf / inf where there is none."""
    if seq is not None:
        T, H, D = k.shape[1:]
        N = cu_seqlens.numel() - 1
        idx = seq[:, None, None].expand(T, H, D)
        hi = k.new_full((N, H, D), float("-inf")).scatter_reduce_(0, idx, k[0], "amax")
        lo = k.new_full((N, H, D), float("inf")).scatter_reduce_(0, idx, k[0], "amin") if smallest else None
    elif mask is None:
        lo, hi = torch.aminmax(k, dim=1) if smallest else (None, k.amax(1))  # (one pass for both)
    else:
        real = mask[..., None, None]
        hi = k.masked_fill(~real, float("-inf")).amax(1)
        lo = k.masked_fill(~real, float("inf")).amin(1) if smallest else None
    return lo, hi


def _causal_exp(q, k, v, eps, chunk_size, state, output_final_state, mask, backend, cu_seqlens=None):
    """Running-max-shifted hadamard_exp (module docstring): the numerator as GLA (a decay per feature) on v, the
    normaliser from log-space prefix sums of the keys."""
    m_init, c_init = (None, None) if state is None else (state["m"], state["C"])
    if cu_seqlens is None:
        (m, prev, m_last), lse = _shifts(k, mask, m_init, c_init)
    else:  # each sequence from its own state (few sequences: a loop of elementwise ops)
        bounds = cu_seqlens.tolist()
        parts = [_shifts(k[:, s:e], None, *(None if x is None else x[n:n + 1] for x in (m_init, c_init)))
                 for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        m, prev = (torch.cat([p[0][i] for p in parts], 1) for i in (0, 1))
        m_last = torch.cat([p[0][2] for p in parts], 0)
        lse = torch.cat([p[1] for p in parts], 1)
    with torch.no_grad():
        g = prev - m  # log decay <= 0; 0 at pads (m moves at real keys)
        M = (q + m).amax(-1, keepdim=True)  # per-query scale: the largest term of φ̃·ψ̃ is exactly 1
    fq = (q + m - M).exp()  # <= 1
    fk = (k - m).exp()  # <= 1
    # g <= 0 by construction (m never decreases): no check, no host sync
    num, S1 = gla_as("ela", fq, fk, v, g, scale=1.0, chunk_size=min(chunk_size, 16),
                     initial_state=None if state is None else state["S"], output_final_state=output_final_state,
                     mask=mask, backend=backend, cu_seqlens=cu_seqlens, check_g=False)
    # φ̃(q_i)·C̃_i = Σ_d exp(q_id + m_id - M_i) exp(lse_id - m_id), C̃_i = Σ_{j≤i} exp(k_j - m_i) (+ the state's)
    den = (q + lse - M).exp().sum(-1, keepdim=True)
    floor = torch.exp(torch.log(torch.full((), eps, dtype=q.dtype, device=q.device)) - M)
    o = num.to(q.dtype) / torch.maximum(den, floor)  # max(true denominator, eps), in the scaled units
    final = None
    if output_final_state:
        final = {"S": S1, "C": _last(lse, cu_seqlens, c_init, m_last).sub(m_last).exp(), "m": m_last}
    return o, final


#: log of nothing in the key sums: finite, so that logcumsumexp's backward stays finite before the first key
_LOG_ZERO = -1.0e30


def _shifts(k, mask, m0, c0):
    """``(m, m before each token, last m)`` of ``_running_max`` (no gradient) and the log of the key sums
    ``lse [B, T, H, D]`` = log(Σ_{j≤t} exp(k_j) + C̃_0 exp(m_0)) (pads add nothing; differentiable in k and C̃_0)."""
    with torch.no_grad():
        shifts = _running_max(k, mask, m0)
    kk = k if mask is None else k.masked_fill(~mask[..., None, None], _LOG_ZERO)
    if c0 is None:
        return shifts, fast_scan(torch.logcumsumexp, kk, 1)
    first = _log_sums(c0, m0)  # the state's sums as a first term
    return shifts, fast_scan(torch.logcumsumexp, torch.cat([first[:, None], kk], 1), 1)[:, 1:]


def _log_sums(c, m):
    """log(C̃ exp(m)), the state's key sums in log space (log 0 -> _LOG_ZERO, and no NaN gradient there)."""
    has = c > 0
    return torch.where(has, torch.where(has, c, 1.0).log() + m, _LOG_ZERO)


def _last(lse, cu_seqlens, c0, m_last):
    """log C̃ after each sample's (or packed sequence's) last token ``[N, H, D]``; with no token, the state's."""
    bounds = [0, lse.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    parts = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e > s:
            parts.append(lse[:, e - 1])
        else:
            rows = slice(None) if cu_seqlens is None else slice(n, n + 1)
            c = torch.zeros_like(m_last[rows]) if c0 is None else c0[rows]
            parts.append(_log_sums(c, m_last[rows]))
    return torch.cat(parts, 0)


def _cummax(x, dim):
    return x.cummax(dim).values


def _running_max(k, mask, m0):
    """The per-feature shift of every query ``m [B, T, H, D]``, the one before it (``m0`` at the first token) and
    the last one ``[B, H, D]``. m0: from the state, or the first real key (0 for a sample with no real token)."""
    kk = k if mask is None else k.masked_fill(~mask[..., None, None], float("-inf"))
    run = fast_scan(_cummax, kk, 1)  # [B, T, H, D]: -inf until the first real token
    if m0 is None and k.shape[1] == 0:
        m0 = k.new_zeros(k.shape[0], *k.shape[2:])
    elif m0 is None:
        m0 = run.masked_fill(torch.isinf(run), float("inf")).amin(1)
        m0 = torch.where(torch.isinf(m0), torch.zeros_like(m0), m0)
    m = torch.maximum(run, m0[:, None])
    prev = torch.cat([m0[:, None], m[:, :-1]], 1)[:, :m.shape[1]]  # (no token: empty)
    return m, prev, (m[:, -1] if m.shape[1] else m0)


# ============================================================================ bidirectional
def _bidirectional_fused(kernel, q, k, v, eps, mask, cu_seqlens):
    """The bidirectional form on the causal form's kernels (``lazoo.kernels.normalized`` with ``causal=False``: each
    sequence's sums once, then every token's output from them), with the same features: a polynomial kernel's split
    form, or hadamard_exp's exp(k - c), exp(q + c - M) with c the largest real key per sequence and feature. One
    shift needs no spread check here: every query sees the key that sets c, so the largest term of its denominator is
    exactly 1, and a key that underflows would add under e^-87 of it. (fp16 keeps the matmul form: the kernel's
    score tiles are in the inputs' dtype, as in the causal form.)"""
    from ..kernels.ela_features import exp_features
    from ..kernels.normalized import chunk_normalized_linear_attention

    run = dict(causal=False, cu_seqlens=cu_seqlens)
    if kernel != "hadamard_exp":
        return _on_poly_features(kernel, q, k, v, eps, mask, **run)[0]
    seq = None if cu_seqlens is None else packed_sequence_ids(cu_seqlens, q.shape[1])
    with torch.no_grad():  # the largest real key per sequence, head and feature (0 where there is none)
        hi = _key_extremes(k, mask, cu_seqlens, seq)[1].float()
        shift = torch.where(torch.isfinite(hi), hi, 0.0)
    fq, fk, eps_rows = exp_features(q, k, shift, eps, mask, seq)
    return chunk_normalized_linear_attention(fq, fk, v, eps=eps_rows, exp_of=(q, k), **run)[0]


def _bidirectional(q, k, v, kernel, eps, mask, backend, cdt):
    backend = resolve_backend("ela", backend, q.device, None)  # any backend runs the matmuls
    out_dtype = v.dtype
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if kernel == "hadamard_exp":
        with torch.no_grad():
            m = _key_extremes(k, mask, None, None)[1][:, None]  # [B, 1, H, D]: the largest real key per feature
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            M = (q + m).amax(-1, keepdim=True)  # [B, T, H, 1]
        fq, fk = (q + m - M).exp(), (k - m).exp()
        floor = torch.exp(torch.log(torch.full((), eps, dtype=cdt, device=q.device)) - M)
    else:
        fq, fk = ela_features(kernel, q, k)
        floor = eps
    fk = zero_masked(fk, mask)
    if backend == "recurrent":  # token-by-token sums (the reference)
        S = torch.zeros(q.shape[0], q.shape[2], v.shape[-1], fk.shape[-1], dtype=cdt, device=q.device)
        C = torch.zeros(q.shape[0], q.shape[2], fk.shape[-1], dtype=cdt, device=q.device)
        for t in range(q.shape[1]):
            S = S + v[:, t, :, :, None] * fk[:, t, :, None, :]
            C = C + fk[:, t]
    else:
        S = torch.einsum("bthv,bthf->bhvf", v, fk)
        C = fk.sum(1)
    num = torch.einsum("bhvf,bthf->bthv", S, fq)
    den = (fq * C[:, None]).sum(-1, keepdim=True)
    if isinstance(floor, torch.Tensor):
        den = torch.maximum(den, floor)
    else:
        den = den.clamp_min(floor)
    return zero_masked(num / den, mask).to(out_dtype)


# ============================================================================ checks
def _check_kernel(op, kernel):
    if kernel not in ELA_KERNELS:
        raise ValueError(f"{op}: unknown kernel {kernel!r}; valid kernels are {', '.join(ELA_KERNELS)}")


def _initial_state(op, state, kernel, B, H, F_, dv, device, cdt):
    """Validated state cast to the compute dtype, or None."""
    if state is None:
        return None
    keys = ("S", "C", "m") if kernel == "hadamard_exp" else ("S", "C")
    check_state_dict(op, state, keys)
    check_state_tensor(op, "initial_state['S']", state["S"], (B, H, dv, F_), device)
    check_state_tensor(op, "initial_state['C']", state["C"], (B, H, F_), device)
    out = {"S": state["S"].to(cdt), "C": state["C"].to(cdt)}
    if kernel == "hadamard_exp":
        check_state_tensor(op, "initial_state['m']", state["m"], (B, H, F_), device)
        m = state["m"].to(cdt)
        if host_sync_allowed() and not torch.isfinite(m).all():  # a value check: not while compiled
            raise ValueError(f"{op}: initial_state['m'] holds non-finite values")
        out["m"] = m.detach()
    return out
