"""Recursive least squares (RLS) / Mesa layer: exact (exponentially weighted) ridge regression of v on k.

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token). Per head, with t
counting real tokens (1-based) and the ridge λ not decaying:

    S_t = argmin_S Σ_{i≤t} γ^{t−i} ‖v_i − S k_i‖² + λ‖S‖_F²  =  VK_t (KK_t + λI)^{-1},   o_t = S_t q_t
    KK_t = γ KK_{t−1} + k_t k_tᵀ   [dk, dk],      VK_t = γ VK_{t−1} + v_t k_tᵀ   [dv, dk]

(the test-time regression paper, eq. 11, and its weighted version; the Mesa layer). q, k, v are used as given (the mixer
L2-normalises q and k). ``lam`` is λ, finite and > 0 in every head (else a ValueError): a number, a 0-d tensor
or a per-head tensor ``[H]`` (a learned λ stays differentiable); ``gamma`` is γ ∈ (0, 1], a number.

State: ``{"KK": [B, H, dk, dk], "VK": [B, H, dv, dk]}``, the weighted moments *without* the ridge, so
one state serves any λ (a learned λ may change between calls) and both backends hold exactly the same
thing. A pad leaves both untouched and does not count as a step of the decay.

Backends:
  * ``"recurrent"``, γ = 1: Sherman–Morrison per token on P_t = (KK_t + λI)^{-1} (P_0 = I/λ, or one solve
    from an initial state) with the RLS update S_t = S_{t−1} + (v_t − S_{t−1}k_t)(P_t k_t)ᵀ; the moments are
    accumulated alongside for the final state, and P, S re-factorised from them every ``REFACTOR_EVERY`` positions.
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
Both give the closed form at every t to rounding (tests/ops/test_ops_rls.py: 1e-6 relative in float64 is the
stated bound; measured far below it).

Precision (docs/rls.md, "Accuracy for poorly conditioned keys"). The ridge systems KK_t + λI can be very poorly
conditioned (keys close to linearly dependent, small λ, the first dk positions of a sequence, large inputs), and
z_t = (KK_t + λI)^{-1} q_t then has large components that cancel in the read-out. So:
  * the PyTorch forms factorise, solve and read out in float64 whatever the input dtype (``SOLVE_DTYPE``); the
    outputs come back in v's dtype and the state in the compute dtype. No factorisation raises (``cholesky_ex``,
    ``solve_ex``): a sample whose system is not finite gets NaN outputs (the other samples are bit-identical to a
    run without it), and a finite system that float64 cannot factorise gets a growing diagonal shift (jitter);
  * the recurrent form re-factorises P_t from the moments every ``REFACTOR_EVERY`` positions (no Sherman–Morrison
    drift beyond that);
  * the precision asked for is ``TOLERANCE[output dtype]``, a bound on the relative residual
    ρ_t = ‖q_t − (KK_t + λI) z_t‖ / ‖q_t‖, which bounds the output's error relative to ‖S_t‖‖q_t‖. The PyTorch forms
    measure ρ (in float64) whenever a cheap bound on the condition number says it could be missed (or a jitter was
    needed); the Triton path (fp32 solve) measures it at the last position of every chunk (and, for bf16/fp16
    inputs, whose z is handed on in 16 bits, at every sample's first dk/2 positions). A miss warns once
    (RuntimeWarning) with the measured residual; on the Triton path chosen automatically, the samples that miss it
    are recomputed with the float64 chunk form instead (logged once).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings

import torch

from ..kernels.limits import RLS_BLOCK, RLS_MAX_HEAD_DIM
from .backend import host_sync_allowed, requested_backend, resolve_backend
from .boundary import op_result, prepare_inputs
from .checks import check_positive_int, check_same_device
from .chunks import merge_chunks, pad_time, split_chunks
from .dtypes import compute_dtype, without_autocast
from .linear import chunk_gated_linear, linear_attention, linear_kernel_unsupported
from .states import check_state_dict, check_state_tensor

__all__ = ["rls"]

logger = logging.getLogger("lazoo")

_OP = "rls"
#: the PyTorch chunk forms' default chunk (the Triton path's is lazoo.kernels.rls.CHUNK)
CHUNK_SIZE = 64
_STATE_KEYS = ("KK", "VK")
#: the PyTorch forms factorise, solve and read out in this dtype whatever the input dtype (fp32 solves were off
#: by 0.2-0.3, the fp32 recurrent form by up to 71, from float64 for poorly conditioned keys: docs/rls.md)
SOLVE_DTYPE = torch.float64
#: the precision asked for, by output dtype: a bound on the relative residual ‖q_t − (KK_t + λI) z_t‖ / ‖q_t‖ of
#: every ridge system solved (it bounds the output's error relative to ‖S_t‖‖q_t‖). A miss warns once.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
#: the recurrent form (γ = 1) re-factorises P_t = (KK_t + λI)^{-1} from the moments every this many positions
REFACTOR_EVERY = 64
#: the PyTorch forms measure the residual when eps(SOLVE_DTYPE) · κ̂ · _CHECK_MARGIN exceeds the tolerance, with
#: κ̂ = 1 + (tr KK_0 + Σ_t ‖k_t‖²) / λ a bound on every ridge system's condition number
_CHECK_MARGIN = 100.0
#: the Triton path checks its fp32 solve (a sampled residual and one host sync a call: ~0.7 ms of 11.8 at 32k tokens,
#: bf16, H = 16, d = 128, forward + backward on an H200; docs/rls.md). Off: no check, no fallback, no sync.
CHECK_TRITON = True
#: what has been said once (warnings and fallback notes), by key
_SAID: set[str] = set()


@without_autocast
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
    # a pad is no input: a NaN there never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(_OP, q, k, v, mask)
    C = None if chunk_size is None else check_positive_int(_OP, "chunk_size", chunk_size)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (0.0 < float(gamma) <= 1.0):
        raise ValueError(f"{_OP}: gamma must be a number in (0, 1], got {gamma!r}")
    gamma = float(gamma)
    lam_h, lam_unchecked = _lambda(lam, H, q)  # [H], SOLVE_DTYPE
    if lam_unchecked and q.device.type != "cuda":  # (on CUDA the Triton path folds it into its one host sync)
        _check_lambda_values(lam, lam_h)
        lam_unchecked = False
    forced = requested_backend(backend)[0] is not None
    backend = resolve_backend(_OP, backend, q.device, _triton_unsupported(q, v, gamma, C))
    if lam_unchecked and backend != "triton":
        _check_lambda_values(lam, lam_h)
    if C is None:  # each path's own default
        C = _triton_chunk() if backend == "triton" else CHUNK_SIZE
    cdt = compute_dtype(q.dtype)
    tol = TOLERANCE.get(v.dtype, TOLERANCE[torch.float32])
    KK, VK = _initial_state(initial_state, B, H, dk, dv, q.device)

    if backend == "triton":
        o, KK1, VK1 = _rls_triton_checked(q, k, v, mask, lam_h, KK, VK, C, output_final_state, forced, tol,
                                          lam if lam_unchecked else None, initial_state is None)
    else:
        o, KK1, VK1 = _rls_torch(q, k, v, mask, lam_h, gamma, KK, VK, C, backend, tol)
    final = {"KK": KK1.to(cdt), "VK": VK1.to(cdt)} if output_final_state else None
    return op_result(o, mask, v.dtype, final, output_final_state)


# ----------------------------------------------------------------------------- saying things once
def _compiling() -> bool:
    """Whether the value checks must stay off the host: under torch.compile or CUDA-graph capture."""
    return not host_sync_allowed()


def _say_once(key: str, message: str, warn: bool) -> None:
    """A precision shortfall warns (RuntimeWarning), an automatic fallback logs (``lazoo`` logger); each once."""
    if key in _SAID:
        return
    _SAID.add(key)
    if warn:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_level())
    else:
        logger.warning(message)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside lazoo, seen from ``_say_once`` (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1  # _say_once
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _finite_samples(*xs: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: every entry of every ``[B, ...]`` tensor finite in that sample."""
    ok = None
    for x in xs:
        f = torch.isfinite(x).flatten(1).all(1)
        ok = f if ok is None else ok & f
    return ok


def _missed(rho: torch.Tensor, tol: float, inputs) -> torch.Tensor:
    """``[B]`` bool: the samples with finite inputs whose measured residual ``rho [B]`` is not within ``tol``
    (a sample with a NaN or Inf input has NaN outputs and is nobody else's business)."""
    bad = rho > tol
    nonfinite = ~torch.isfinite(rho)
    if bool(nonfinite.any()):
        bad = bad | (nonfinite & _finite_samples(*inputs))
    return bad


def _shortfall_message(where: str, rho: torch.Tensor, bad: torch.Tensor, tol: float, dtype, lam_h,
                       shift: float) -> str:
    worst = rho[bad]
    worst = worst.max().item() if bool(torch.isfinite(worst).all()) else float("nan")
    jitter = (f"; factorising needed a diagonal shift of up to {shift:.0e} × the mean diagonal" if shift else "")
    return (f"{_OP}: {where} solved the ridge systems (KK_t + λI) z_t = q_t of {int(bad.sum())} sample(s) only to a "
            f"relative residual ‖q_t − (KK_t + λI) z_t‖/‖q_t‖ of {worst:.1e}, above the {tol:.0e} asked for "
            f"{str(dtype).replace('torch.', '')} outputs (lazoo.ops.rls.TOLERANCE){jitter}: the keys are too close "
            f"to linearly dependent, or too large, for lam = {lam_h.min().item():.1e}. Those samples' outputs may be "
            f"off by that fraction of ‖S_t‖‖q_t‖; raise lam or scale the keys down. (Said once.)")


# ----------------------------------------------------------------------------- triton
def _triton_unsupported(q, v, gamma, chunk_size) -> str | None:
    """None when the Triton path runs this case (Triton installed, and the kernels importable: checked by
    ``linear_kernel_unsupported``)."""
    if gamma != 1.0:
        return "the Triton path covers gamma = 1 only (gamma < 1 is solved exactly per position)"
    if q.shape[-1] > RLS_MAX_HEAD_DIM:
        return f"the Triton path takes head dims up to {RLS_MAX_HEAD_DIM} (got {q.shape[-1]})"
    if chunk_size is not None and chunk_size % RLS_BLOCK:
        return f"the Triton path needs chunk_size to be a multiple of {RLS_BLOCK} (got {chunk_size})"
    return linear_kernel_unsupported(q, v)


def _triton_chunk() -> int:
    from ..kernels.rls import CHUNK

    return CHUNK


def _rls_triton_checked(q, k, v, mask, lam_h, KK, VK, C, output_final_state, forced, tol, lam_unchecked=None,
                        no_state=False):
    """The Triton path: z = (KK_t + λI)^{-1} q_t by lazoo.kernels.rls (fp32), then
    o_t = VK_0 z_t + Σ_{i≤t} v_i (k_i·z_t) on the Triton linear-attention kernel in the input's precision (bf16/fp16
    inputs: z is rounded to it).

    The fp32 solve is checked (unless ``CHECK_TRITON`` is off or under torch.compile): its relative residual at the
    chunks' last positions (``lazoo.kernels.rls.chunk_end_residual``) and, for bf16/fp16 inputs (z handed on in 16
    bits), at the first dk/2 positions of every sample (``_start_residual``). Samples that miss ``tol`` are
    recomputed with the float64 chunk form when the backend was chosen automatically (logged once), or kept with a
    warning (once) when "triton" was asked for. One host sync, between the solve and the memory part (the CPU
    queues the rest while the GPU runs the memory part); it also checks the values of a tensor λ
    (``lam_unchecked``), so that a learned λ costs no sync of its own."""
    from ..kernels.rls import memory_dtype, rls_precision

    check = CHECK_TRITON and not _compiling()
    mem = memory_dtype(v.dtype)
    KK32, VK32 = KK.float(), VK.float()
    z = rls_precision(q, k, lam_h, KK32, C, out_dtype=mem, check=check)
    bad = None
    if check:
        z, rho = z
        rho = rho.amax((1, 2)) if rho.numel() else rho.new_zeros(q.shape[0])
        if z.dtype in (torch.float16, torch.bfloat16):  # z rounded to 16 bits: check where that costs most
            rho = torch.maximum(rho.double(), _start_residual(q, k, z, lam_h, None if no_state else KK32, mask))
        flags = [(~(rho <= tol)).any()]  # a NaN residual too (a non-finite sample, or a breakdown: told apart below)
        if lam_unchecked is not None:
            flags.append(_lambda_invalid(lam_h))
        flags = torch.stack(flags).tolist()
        if lam_unchecked is not None:
            _check_lambda_values(lam_unchecked, lam_h, invalid=flags[1])
        if flags[0]:
            bad = _missed(rho, tol, (q, k, v, KK, VK))
            if not bool(bad.any()):
                bad = None
    elif lam_unchecked is not None:
        _check_lambda_values(lam_unchecked, lam_h)
    o, VK1 = linear_attention(z, k.to(mem), v.to(mem), feature_map="identity", normalize=False,
                              initial_state=VK32, output_final_state=output_final_state, mask=mask, backend="triton")
    KK1 = None
    if output_final_state:
        kf = k.float()
        KK1 = KK32 + torch.einsum("bthd,bthe->bhde", kf, kf)
    if bad is None:
        return o, KK1, VK1
    if forced:
        what = "the Triton path (fp32 solve" + (f", z handed on in {str(z.dtype)[6:]})" if z.dtype != torch.float32
                                                else ")")
        _say_once("triton-precision", _shortfall_message(what, rho, bad, tol, v.dtype, lam_h, 0.0), warn=True)
        return o, KK1, VK1
    idx = bad.nonzero().flatten()
    _say_once("triton-fallback", f"{_OP}: the Triton path missed the precision asked for "
              f"({tol:.0e} relative residual for {str(v.dtype).replace('torch.', '')} outputs; measured "
              f"{rho[bad].max().item():.1e} on {idx.numel()} sample(s)): those samples were recomputed with the "
              f"float64 chunk form. (Logged once; later such samples are recomputed silently.)", warn=False)
    m = None if mask is None else mask[idx]
    o_b, KK_b, VK_b = _rls_torch(q[idx], k[idx], v[idx], m, lam_h, 1.0, KK[idx], VK[idx], CHUNK_SIZE, "chunk",
                                 tol)
    o = o.index_put((idx,), o_b.to(o.dtype))
    if output_final_state:
        KK1 = KK1.index_put((idx,), KK_b.to(KK1.dtype))
        VK1 = VK1.index_put((idx,), VK_b.to(VK1.dtype))
    return o, KK1, VK1


def _start_residual(q, k, z, lam_h, KK0, mask) -> torch.Tensor:
    """ρ ``[B]`` (float64): the largest ‖q_t − (KK_t + λI) z_t‖ / ‖q_t‖ over the first dk/2 positions from each
    sample's first real token, with z as handed to the memory part in bf16/fp16. There the ridge systems are
    rank-deficient but for λ (KK_t has rank ≤ t), z_t is largest and its rounding to 16 bits costs most (the
    chunk-end check sees the fp32 solve only): at λ = 1e-2, dk = 128, bf16 inputs, the residual there was 0.15 and
    the output 5.4e-2 from float64, against 3e-3 at the chunks' ends (the peak sat near t = dk/2; at λ = 0.1 nearer
    dk, where it stays below bf16's tolerance). No real key precedes the window, so KK_t = KK_0 + Σ_{window, i≤t}
    k_i k_iᵀ: a small causal product per head. ``KK0`` None: no initial state."""
    B, T, H, dk = q.shape
    W = min(T, max(16, dk // 2))
    if mask is None:
        qw, kw, zw = (x[:, :W].double() for x in (q, k, z))  # [B, W, H, dk]
    else:
        start = mask.long().argmax(1).clamp(max=T - W)  # the first real token (argmax: the first maximum)
        t = start[:, None] + torch.arange(W, device=q.device)
        b = torch.arange(B, device=q.device)[:, None]
        qw, kw, zw = (x[b, t].double() for x in (q, k, z))
    causal = torch.ones(W, W, dtype=torch.bool, device=q.device).tril()  # [t, i]: i ≤ t
    scores = torch.einsum("bthd,bihd->bhti", zw, kw).masked_fill(~causal, 0.0)
    Az = torch.einsum("bhti,bihd->bthd", scores, kw) + lam_h[:, None] * zw
    if KK0 is not None:
        Az = Az + torch.einsum("bhde,bthe->bthd", KK0.double(), zw)
    r = (qw - Az).norm(dim=-1)
    qn = qw.norm(dim=-1)
    return torch.where(qn > 0, r / qn.clamp_min(torch.finfo(torch.float64).tiny), r).amax((1, 2))


# ----------------------------------------------------------------------------- inputs
_LAM_ALLOWED = "a finite number > 0 (the ridge λ, in (0, inf))"


def _lambda(lam, H, q):
    """λ as a ``[H]`` tensor in SOLVE_DTYPE (differentiable when given as a tensor) and whether its values are still
    to be checked (a tensor λ: ``_check_lambda_values``, one host sync; a number is checked here)."""
    if isinstance(lam, torch.Tensor):
        check_same_device(_OP, q, lam=lam)
        if not lam.is_floating_point():
            raise TypeError(f"{_OP}: lam must be a floating-point tensor, got dtype {lam.dtype}")
        if lam.dim() == 0:
            return lam.to(SOLVE_DTYPE).expand(H), True
        if tuple(lam.shape) != (H,):
            raise ValueError(f"{_OP}: a tensor lam must be 0-d or have shape [H] = ({H},), got {tuple(lam.shape)}")
        return lam.to(SOLVE_DTYPE), True
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise TypeError(f"{_OP}: lam must be a positive number or a tensor [H], got {type(lam).__name__}")
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"{_OP}: lam must be {_LAM_ALLOWED}, got {lam!r}")
    return torch.full((H,), float(lam), dtype=SOLVE_DTYPE, device=q.device), False


def _lambda_invalid(lam_h) -> torch.Tensor:
    """0-d bool on λ's device: some head's λ is not finite and > 0 (no host sync)."""
    return (~(torch.isfinite(lam_h) & (lam_h > 0))).any()


def _check_lambda_values(lam, lam_h, invalid: bool | None = None) -> None:
    """Raise, naming ``lam`` and the allowed range, when a tensor λ is not finite and > 0 in every head."""
    if _compiling():
        return
    if invalid is None:
        invalid = bool(_lambda_invalid(lam_h))
    if invalid:
        bad = ~(torch.isfinite(lam_h) & (lam_h > 0))
        h = int(bad.nonzero()[0, 0])
        where = "" if lam.dim() == 0 else f" (head {h})"
        raise ValueError(f"{_OP}: lam must be {_LAM_ALLOWED} in every head, got {lam_h[h].item()!r}{where}")


def _initial_state(state, B, H, dk, dv, device):
    """The moments ``(KK, VK)`` as given (zeros by default, in SOLVE_DTYPE); each backend casts them."""
    if state is None:
        return (torch.zeros(B, H, dk, dk, dtype=SOLVE_DTYPE, device=device),
                torch.zeros(B, H, dv, dk, dtype=SOLVE_DTYPE, device=device))
    check_state_dict(_OP, state, _STATE_KEYS)
    check_state_tensor(_OP, "initial_state['KK']", state["KK"], (B, H, dk, dk), device)
    check_state_tensor(_OP, "initial_state['VK']", state["VK"], (B, H, dv, dk), device)
    return state["KK"], state["VK"]


def _ridged(KK, lam_h):
    """KK + λI (λ per head)."""
    eye = torch.eye(KK.shape[-1], dtype=KK.dtype, device=KK.device)
    return KK + lam_h[:, None, None] * eye


def _cholesky(A, notes: dict):
    """The lower Cholesky factor of the symmetric positive definite ``A [..., n, n]``, never raising a
    LinAlgError: a matrix with a NaN or Inf gets a NaN factor (its sample's outputs are NaN, the others
    untouched), and a finite one that does not factorise in its precision (KK + λI indefinite by rounding: λ below
    ~eps·‖KK‖, or a rounded state) is factorised with a diagonal shift of eps·10^j times its mean diagonal, the
    smallest j that works; ``notes["shift"]`` keeps the largest shift used (the residual check then runs)."""
    L, info = torch.linalg.cholesky_ex(A)
    if _compiling():
        return L
    finite = torch.isfinite(A).flatten(-2).all(-1)  # (Cholesky reads one triangle: a NaN in the other counts too)
    failed = (info != 0) | ~finite
    if not bool(failed.any()):
        return L
    retry = failed & finite
    if bool(retry.any()):
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        scale = A.diagonal(dim1=-2, dim2=-1).abs().mean(-1)[..., None, None]
        shift = torch.finfo(A.dtype).eps
        while True:
            Ls, info_s = torch.linalg.cholesky_ex(A + (shift * scale) * eye)
            ok = retry & (info_s == 0)
            if bool(ok.any()):
                L = torch.where(ok[..., None, None], Ls, L)
                notes["shift"] = max(notes.get("shift", 0.0), shift)
                retry = retry & ~ok
                if not bool(retry.any()):
                    break
            shift *= 10.0
            if shift > 1.0:
                raise ValueError(
                    f"{_OP}: KK + λI is not positive definite, even shifted by its mean diagonal: is "
                    "initial_state['KK'] a sum of outer products k kᵀ (symmetric, positive semi-definite)?")
    nan = torch.full((), float("nan"), dtype=L.dtype, device=L.device)
    return torch.where((failed & ~finite)[..., None, None], nan, L)


def _solve(A, b, notes):
    """A^{-1} b for the symmetric positive definite ``A [..., n, n]`` (``b [..., n, m]``) by LU (``solve_ex``: its
    backward is a third of a Cholesky solve's, measured on the γ < 1 chunk form), never raising: a singular
    finite A is solved through ``_cholesky`` (its jitter), a non-finite one gives NaN."""
    x, info = torch.linalg.solve_ex(A, b)
    if _compiling():
        return x
    finite = torch.isfinite(A).flatten(-2).all(-1)
    failed = (info != 0) | ~finite
    if not bool(failed.any()):
        return x
    retry = (failed & finite)[..., None, None]
    if bool(retry.any()):
        x = torch.where(retry, torch.cholesky_solve(b, _cholesky(torch.where(retry, A, torch.eye(
            A.shape[-1], dtype=A.dtype, device=A.device)), notes)), x)
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    return torch.where(finite[..., None, None], x, nan)


def _inverse(KK, lam_h, notes):
    """(KK + λI)^{-1}; exactly I/λ where KK is zero (no initial state), so λ's gradient is exact too."""
    eye = torch.eye(KK.shape[-1], dtype=KK.dtype, device=KK.device)
    P = torch.cholesky_solve(eye.expand_as(KK), _cholesky(_ridged(KK, lam_h), notes))
    empty = (KK == 0).flatten(-2).all(-1)[..., None, None]
    return torch.where(empty, eye / lam_h[:, None, None], P)


# ----------------------------------------------------------------------------- PyTorch forms and their check
def _rls_torch(q, k, v, mask, lam_h, gamma, KK, VK, C, backend, tol):
    """The recurrent and chunk forms in SOLVE_DTYPE (inputs with pads zeroed), their residual checked when it could
    miss ``tol``; returns ``(o, KK_end, VK_end)`` in SOLVE_DTYPE."""
    sdt = SOLVE_DTYPE
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, KK, VK = (x.to(sdt) for x in (q, k, v, KK, VK))
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    check = _could_miss(k, KK, lam_h, tol)
    notes: dict = {}
    KK0 = KK
    if backend == "recurrent":
        run = _recurrent_sherman_morrison if gamma == 1.0 else _recurrent_solve
        o, KK, VK, z = run(q, k, v, real, lam_h, gamma, KK, VK, notes, check)
    elif gamma < 1.0:
        o, KK, VK, z = _chunk_solve(q, k, v, real, lam_h, gamma, KK, VK, C, notes)
    else:
        o, KK, VK, z = _chunk_woodbury(q, k, v, lam_h, KK, VK, C, notes)
    if (check or notes) and not _compiling():
        rho = _residual(q, k, z, KK0, lam_h, gamma, real, C)
        bad = _missed(rho, tol, (q, k, v, KK0))
        if bool(bad.any()):
            form = f"the {backend} form (float64 solve)"
            _say_once(f"{backend}-precision", _shortfall_message(form, rho, bad, tol, out_dtype, lam_h,
                                                                 notes.get("shift", 0.0)), warn=True)
    return o, KK, VK


def _could_miss(k, KK0, lam_h, tol) -> bool:
    """Whether a solve in SOLVE_DTYPE could miss ``tol``: eps · κ̂ · margin > tol for some sample with finite
    inputs, κ̂ = 1 + (tr KK_0 + Σ_t ‖k_t‖²)/λ ≥ the condition number of every KK_t + λI (γ ≤ 1 only shrinks KK_t)."""
    if _compiling():
        return False
    with torch.no_grad():
        kappa = 1.0 + (KK0.diagonal(dim1=-2, dim2=-1).sum(-1).abs() + k.square().sum((1, 3))) / lam_h
        kappa = kappa[torch.isfinite(kappa)]
        if kappa.numel() == 0:
            return False
        return bool(kappa.max() * (torch.finfo(SOLVE_DTYPE).eps * _CHECK_MARGIN) > tol)


def _residual(q, k, z, KK0, lam_h, gamma, real, C) -> torch.Tensor:
    """ρ ``[B]``: the largest ‖q_t − (KK_t + λI) z_t‖ / ‖q_t‖ over real positions and heads (0 where q_t = 0), with
    KK_t z_t = γ^{n_t} KK_0 z_t + Σ_{i≤t} γ^{n_t − n_i} k_i (k_i·z_t) one more linear attention (values k)."""
    with torch.no_grad():
        g = None
        if gamma < 1.0:
            g = torch.where(real, math.log(gamma), 0.0).to(q.dtype)[..., None].expand(*q.shape[:3]).contiguous()
        Az, _ = chunk_gated_linear(z, k, k, g, KK0, C)
        r = (q - Az - lam_h[:, None] * z).norm(dim=-1)  # [B, T, H]
        qn = q.norm(dim=-1)
        rho = torch.where(qn > 0, r / qn.clamp_min(torch.finfo(q.dtype).tiny), r)
        rho = torch.where(real[..., None], rho, torch.zeros((), dtype=rho.dtype, device=rho.device))
        return rho.amax((1, 2))


# ----------------------------------------------------------------------------- recurrent
def _recurrent_sherman_morrison(q, k, v, real, lam_h, gamma, KK, VK, notes, keep_z):
    """γ = 1: P_t = P − P k kᵀ P / (1 + kᵀ P k), S_t = S_{t−1} + (v − S_{t−1} k)(P_t k)ᵀ, o_t = S_t q_t, with P and
    S re-factorised from the moments (P = (KK + λI)^{-1}, S = VK P) every REFACTOR_EVERY positions, so that no
    rounding drifts for longer. Pads have k = v = 0 (zeroed by the caller): P and S stay as they are.
    ``keep_z``: also z_t = P_t q_t (for the residual check)."""
    T = q.shape[1]
    outs, zs = [], []
    for t in range(T):
        if t % REFACTOR_EVERY == 0:
            P = _inverse(KK, lam_h, notes)
            S = VK @ P
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
        if keep_z:
            zs.append((P @ qt[..., None])[..., 0])
    return torch.stack(outs, 1), KK, VK, (torch.stack(zs, 1) if keep_z else None)


def _recurrent_solve(q, k, v, real, lam_h, gamma, KK, VK, notes, keep_z):
    """γ < 1: KK ← γ KK + k kᵀ, VK ← γ VK + v kᵀ at real tokens only, then (KK + λI) z = q_t, o_t = VK z."""
    T = q.shape[1]
    g, one = (torch.tensor(x, dtype=KK.dtype, device=KK.device) for x in (gamma, 1.0))  # γ in the compute dtype
    outs, zs = [], []
    for t in range(T):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        decay = torch.where(real[:, t], g, one)[:, None, None, None]  # no decay at pads
        KK = decay * KK + kt[..., :, None] * kt[..., None, :]
        VK = decay * VK + vt[..., :, None] * kt[..., None, :]
        z = _solve(_ridged(KK, lam_h), qt[..., None], notes)  # [B, H, dk, 1]
        outs.append((VK @ z)[..., 0])
        zs.append(z[..., 0])
    return torch.stack(outs, 1), KK, VK, torch.stack(zs, 1)


# ----------------------------------------------------------------------------- chunk
def _chunks(x, C):
    return split_chunks(pad_time(x, C), C)  # [B, H, N, C, d]


def _chunk_woodbury(q, k, v, lam_h, KK, VK, C, notes):
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
    chol = _cholesky(_ridged(starts, lam_h[:, None]), notes)
    PK, PQ = torch.cholesky_solve(torch.cat([K, Q], -2).transpose(-1, -2), chol).split(C, -1)  # P_0 Kᵀ, P_0 Qᵀ
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).triu()  # [i, t]: i ≤ t
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    L = _cholesky(torch.eye(C, dtype=q.dtype, device=q.device) + K @ PK, notes)
    R = torch.where(causal, K @ PQ, zero)  # [i, t] = k_iᵀ P_0 q_t, i ≤ t
    Y = torch.where(causal, torch.linalg.solve_triangular(L, R, upper=False), zero)
    X = torch.where(causal, torch.linalg.solve_triangular(L.transpose(-1, -2), Y, upper=True), zero)
    z = merge_chunks((PQ - PK @ X).transpose(-1, -2), T)  # rows z_tᵀ, [B, T, H, dk]
    o, VK_end = chunk_gated_linear(z, k, v, None, VK, C)
    return o, KK_end, VK_end, z


def _chunk_solve(q, k, v, real, lam_h, gamma, KK, VK, C, notes):
    """γ < 1: the moments of every position of a chunk at once (decay counted in real tokens), one batched
    solve of the dk×dk systems (KK_t + λI) z_t = q_t."""
    T = q.shape[1]
    Q, K, V = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    R = split_chunks(pad_time(real[..., None, None].expand(-1, -1, 1, 1).to(q.dtype), C), C)[:, 0, :, :, 0]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [t, i]: i ≤ t
    log_g = torch.log(torch.tensor(gamma, dtype=q.dtype, device=q.device))
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    outs, zs = [], []
    for n in range(Q.shape[2]):
        Qn, Kn, Vn = Q[:, :, n], K[:, :, n], V[:, :, n]  # [B, H, C, d]
        cnt = R[:, n].cumsum(-1)  # [B, C]: real tokens of the chunk up to and including t
        start = torch.exp(cnt * log_g)[:, None, :]  # γ^{n_t}: decay of the chunk-start moments, [B, 1, C]
        D = torch.where(causal, torch.exp((cnt[:, :, None] - cnt[:, None, :]) * log_g), zero)[:, None]  # [B,1,t,i]
        KKt = start[..., None, None] * KK[:, :, None] + torch.einsum("bhti,bhia,bhic->bhtac", D.expand(
            -1, Kn.shape[1], -1, -1), Kn, Kn)  # [B, H, C, dk, dk]
        z = _solve(_ridged(KKt, lam_h[:, None]), Qn[..., None], notes)[..., 0]
        A = D * (z @ Kn.transpose(-1, -2))  # [t, i] = γ^{n_t−n_i} z_t·k_i
        outs.append(start[..., None] * (z @ VK.transpose(-1, -2)) + A @ Vn)
        zs.append(z)
        KK, VK = KKt[:, :, -1], start[..., -1, None, None] * VK + (D[..., -1, :, None] * Vn).transpose(-1, -2) @ Kn
    return merge_chunks(torch.stack(outs, 2), T), KK, VK, merge_chunks(torch.stack(zs, 2), T)
