"""Shared helpers of the ops: backend choice, input validation, masks, dtypes, padding.

Layout (all ops): q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, per-head scalars ``[B, T, H]``,
states ``[B, H, dv, dk]``, mask ``[B, T]`` (1 = real token).

An op's preamble is ``prepare_inputs`` (q, k, v and the other per-token inputs checked, the mask as bool, every
input zeroed at the pads), its own argument checks, ``resolve_backend`` and ``compute_dtype``; its result is
``op_result`` (pads zeroed, the input dtype, the final state if asked for).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger("lazoo")

#: the backends an op may run (``lazoo.registry.BACKENDS`` repeats it: the registry imports nothing of lazoo, and
#: this module imports nothing of lazoo either, so that an exported model folder can load it alone)
BACKENDS = ("recurrent", "chunk", "triton")
BACKEND_ENV = "LAZOO_BACKEND"

# Ops for which the "falling back to the chunk form" note was already logged.
_FALLBACK_LOGGED: set[str] = set()

#: the reason an op has no Triton path at all
NO_KERNEL = "no Triton kernel is available for this op yet"


def resolve_backend(op: str, backend: str | None, device: torch.device, triton_unsupported: str | None = NO_KERNEL,
                    log_fallback: bool = True) -> str:
    """Return "recurrent", "chunk" or "triton" for ``op``.

    ``backend`` wins over the ``LAZOO_BACKEND`` environment variable; None (or an empty variable)
    means auto. ``triton_unsupported`` is None when the op's Triton kernel can run this case, else
    the reason it cannot (head dim, dtype, no kernel). Auto picks Triton on CUDA tensors when it can
    run, else the PyTorch chunk form, saying once per op why on CUDA (unless ``log_fallback`` is
    False: an op whose chunk form is already the fast path); a forced "triton" that cannot
    run raises with the reason. (A forced "triton" on CPU tensors runs under ``TRITON_INTERPRET=1``.)
    """
    backend, source = requested_backend(backend)
    if backend is None:
        if device.type == "cuda":
            if triton_unsupported is None:
                return "triton"
            # (not while compiled: a log call breaks the graph; the eager run says it)
            if log_fallback and op not in _FALLBACK_LOGGED and not torch.compiler.is_compiling():
                _FALLBACK_LOGGED.add(op)
                logger.warning("%s: %s; using the PyTorch chunk form.", op, triton_unsupported)
        return "chunk"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"{op}: unknown backend {backend!r} (from {source}); valid backends are "
            f"{', '.join(repr(b) for b in BACKENDS)} or None for auto"
        )
    if backend == "triton" and triton_unsupported is not None:
        raise NotImplementedError(
            f"{op}: backend='triton' was requested (from {source}) but {triton_unsupported}; "
            "use backend='chunk', 'recurrent' or None (auto)"
        )
    return backend


def requested_backend(backend: str | None) -> tuple[str | None, str]:
    """The backend asked for and where the request comes from: the ``backend`` argument, else the
    ``LAZOO_BACKEND`` variable; None (or an empty variable) asks for auto."""
    if backend is not None:
        return backend, "backend"
    return os.environ.get(BACKEND_ENV) or None, f"the {BACKEND_ENV} environment variable"


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _find_triton() -> str | None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; the PyTorch forms run without it)"
    return None


#: looked up once at import: torch.compile cannot trace an import lookup inside a model's forward
_TRITON_MISSING = _find_triton()


def triton_missing() -> str | None:
    """Why the Triton kernels cannot load at all (Triton not installed, e.g. on macOS or Windows), or None."""
    return _TRITON_MISSING


def triton_unsupported(q: torch.Tensor, v: torch.Tensor, max_head_dim: int,
                       dtypes: tuple = KERNEL_DTYPES) -> str | None:
    """The checks every op's Triton path shares (Triton installed, input dtype, head dims, device, the
    interpreter on CPU): None when they pass, else why not. Ops add their own checks after these."""
    if triton_missing():
        return triton_missing()
    if q.dtype not in dtypes:
        names = "/".join(str(d).split(".")[-1] for d in dtypes)
        return f"the Triton kernels take {names} inputs, not {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > max_head_dim:
        return f"the Triton kernels take head dims up to {max_head_dim}, got dk={q.shape[-1]}, dv={v.shape[-1]}"
    if q.device.type not in ("cuda", "cpu"):
        return f"the Triton kernels run on CUDA tensors, not {q.device.type}"
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
    return None


# ----------------------------------------------------------------------------- dtypes
def without_autocast(op):
    """Run ``op`` with autocast off: an op chooses its own compute dtypes (fp32 states and
    accumulation, the kernels' operand types); autocast would re-cast its products to 16 bits
    (and CPU autocast makes ``solve_triangular`` fail in bf16)."""

    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return wrapper


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def op_result(o: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype, final_state,
              output_final_state: bool) -> tuple:
    """What an op returns: the output with its pads zeroed, in ``dtype`` (the input's), and the final state
    if it was asked for (else None)."""
    return zero_masked(o, mask).to(dtype), (final_state if output_final_state else None)


def empty_batch_result(q: torch.Tensor, v: torch.Tensor, state, output_final_state: bool) -> tuple:
    """An op's result for an empty batch (B = 0): nothing to read, the (empty) state passes through."""
    return v.new_zeros(*q.shape[:3], v.shape[-1]), (state if output_final_state else None)


# ----------------------------------------------------------------------------- validation
def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """Check q ``[B, T, H, dk]``, k like q, v ``[B, T, H, dv]``; return ``(B, T, H, dk, dv)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{op}: {name} must have 4 dimensions [B, T, H, D], got shape {tuple(x.shape)}"
            )
    check_float(op, "q", q)
    B, T, H, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(
            f"{op}: k must have shape [B, T, H, dk] = {tuple(q.shape)} like q, got {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{op}: v must have shape [B, T, H, dv] with [B, T, H] = {tuple(q.shape[:3])} like q, "
            f"got {tuple(v.shape)}"
        )
    if T == 0:
        raise ValueError(f"{op}: the sequence is empty (T = 0)")
    check_same_dtype(op, q, k=k, v=v)
    check_same_device(op, q, k=k, v=v)
    return B, T, H, dk, v.shape[-1]


def check_like_q(op: str, name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    """An input of q's shape ``[B, T, H, dk]`` (VLA's u, GLA's per-key gate), dtype and device."""
    if not isinstance(x, torch.Tensor) or x.shape != q.shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: {name} must have shape [B, T, H, dk] = {tuple(q.shape)} like q, got {got}")
    check_same_dtype(op, q, **{name: x})
    check_same_device(op, q, **{name: x})


def prepare_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scalars: Mapping[str, torch.Tensor | None] | None = None,
                   like_q: Mapping[str, torch.Tensor] | None = None) -> tuple:
    """The preamble the ops share: check q, k, v (``check_qkv``), the per-head scalars ``scalars`` (``[B, T, H]``;
    None entries are absent inputs) and the inputs ``like_q`` (q's shape), then the mask; zero every one of them
    at the pads (``apply_mask``). Returns ``((B, T, H, dk, dv), bool mask or None, (q, k, v, *scalars, *like_q))``
    with the inputs in that order."""
    scalars, like_q = scalars or {}, like_q or {}
    sizes = check_qkv(op, q, k, v)
    for name, x in scalars.items():
        if x is not None:
            check_head_scalar(op, name, x, q)
    for name, x in like_q.items():
        check_like_q(op, name, x, q)
    mask, inputs = apply_mask(op, mask, q, k, v, *scalars.values(), *like_q.values())
    return sizes, mask, inputs


def apply_mask(op: str, mask: torch.Tensor | None, q: torch.Tensor, *inputs: torch.Tensor | None) -> tuple:
    """Check ``mask`` against q's ``[B, T]`` and device (``check_mask``) and zero ``q`` and ``inputs`` (None
    passes) at the pads (``zero_pads``): ``(bool mask or None, (q, *inputs))``."""
    mask = check_mask(op, mask, q.shape[0], q.shape[1], q.device)
    return mask, zero_pads(mask, q, *inputs)


def check_positive_int(op: str, name: str, value, none_ok: bool = False):
    """An int >= 1 (chunk sizes, windows, counts), or None where ``none_ok``."""
    if value is None and none_ok:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        what = "None or a positive int" if none_ok else "a positive int"
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    return value


def check_positive_number(op: str, name: str, value, zero_ok: bool = False):
    """A real number > 0 (>= 0 where ``zero_ok``), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero_ok else value > 0):
        raise ValueError(f"{op}: {name} must be a number {'>=' if zero_ok else '>'} 0, got {value!r}")
    return value


def check_choice(op: str, name: str, value, allowed: Sequence):
    """One of ``allowed``, of the same type (1 is not True), else a ValueError naming the argument and the values."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(f"{op}: {name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_float(op: str, name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got dtype {x.dtype}")


def check_same_dtype(op: str, q: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.dtype != q.dtype:
            raise TypeError(f"{op}: {name} has dtype {x.dtype} but q has dtype {q.dtype}; "
                            "all inputs must share one dtype")


def check_same_device(op: str, q: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.device != q.device:
            raise ValueError(f"{op}: {name} is on {x.device} but q is on {q.device}")


def check_head_scalar(op: str, name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    """A per-head scalar (gate, beta) must be a float ``[B, T, H]`` tensor like q."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"{op}: {name} must have shape [B, T, H] = {tuple(q.shape[:3])}, got {tuple(x.shape)}"
        )
    check_float(op, name, x)
    check_same_dtype(op, q, **{name: x})
    check_same_device(op, q, **{name: x})


def host_sync_allowed() -> bool:
    """Whether a check may read tensor values back to the host: not while torch.compile traces or a CUDA graph
    is being captured (a host sync is an error there); value checks are skipped then."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def check_mask(op: str, mask: torch.Tensor | None, B: int, T: int,
               device: torch.device) -> torch.Tensor | None:
    """Validate a ``[B, T]`` mask (bool, or numbers that are exactly 0 or 1) and return it as bool (or None)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{op}: mask must be a torch.Tensor [B, T] or None, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"{op}: mask must have shape [B, T] = {(B, T)}, got {tuple(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"{op}: mask must be bool or real 0/1 numbers, got dtype {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{op}: mask is on {mask.device} but q is on {device}")
    if mask.dtype == torch.bool:
        return mask
    # a 2, -1, 0.5 or NaN is no token kind: refuse it rather than count it as real (one host sync)
    if host_sync_allowed() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ValueError(f"{op}: mask must be bool or hold only the numbers 0 (pad) and 1 (real token), "
                         f"got {bad!r}")
    return mask != 0


def check_range(op: str, name: str, x: torch.Tensor | None, low: float | None = None,
                high: float | None = None, hint: str = "") -> None:
    """Refuse values of ``x`` outside ``[low, high]`` (None: unbounded), naming ``name`` and the range.
    Pass ``x`` with its pads already zeroed (``zero_pads``): a pad is no input. NaN passes (it stays in its
    own sample, like a NaN in q). One host sync; skipped under torch.compile and CUDA-graph capture."""
    queue_range_check(op, name, x, low, high, hint)()


def queue_range_check(op: str, name: str, x: torch.Tensor | None, low: float | None = None,
                      high: float | None = None, hint: str = ""):
    """``check_range`` in two steps: the comparison is queued on x's device now, and the call returned reads its
    answer back and raises. An op queues it before its kernels and calls it once they are launched (``reported``):
    the read-back waits for the comparison only (``queue_readback``), not for the kernels queued after it."""
    if x is None or not host_sync_allowed():
        return no_check
    found = queue_readback(_outside(x, low, high).any())

    def report() -> None:
        if bool(found()):
            bad = x[_outside(x, low, high)].flatten()[0].item()
            lo, hi = ("-inf" if low is None else f"{low:g}"), ("inf" if high is None else f"{high:g}")
            raise ValueError(f"{op}: {name} must lie in [{lo}, {hi}] at real tokens{hint}, got {bad!r}")
    return report


def queue_readback(x: torch.Tensor):
    """Start copying a small tensor to the host now; the callable returned gives that copy (a CPU tensor). On a GPU
    it waits for the work queued before this call only: a plain read-back (``bool(x)``, ``.item()``) after an op's
    kernels waits for them all, so the host launches nothing while they run and the next call's host work is not
    overlapped with them."""
    if x.device.type != "cuda":
        return lambda: x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def value() -> torch.Tensor:
        copied.synchronize()
        return host
    return value


def _outside(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    if low is None:
        return x > high
    if high is None:
        return x < low
    return (x < low) | (x > high)


def no_check() -> None:
    """A queued check with nothing to check."""


def reported(report, result):
    """``result``, once the queued check ``report`` has passed."""
    report()
    return result


def queue_log_decay_check(op: str, name: str, g: torch.Tensor | None):
    """A log decay (pads zeroed) must be <= 0: g > 0 would grow the state by exp(g) and overflow. Queued
    (``queue_range_check``): call the result to read it back and raise."""
    return queue_range_check(op, name, g, high=0.0, hint=" (a log decay: the state is multiplied by exp(g) <= 1)")


def check_scale(op: str, scale, dk: int) -> float:
    """A scalar query scale; None means dk ** -0.5."""
    if scale is None:
        return dk ** -0.5
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        # Keep a 0-d tensor as is so that a learned scale stays differentiable.
        return scale
    if isinstance(scale, (int, float)):
        return float(scale)
    raise TypeError(f"{op}: scale must be None or a number, got {type(scale).__name__}")


def check_state_tensor(op: str, name: str, x, shape: Sequence[int], device: torch.device) -> None:
    """One part of an initial state: a float tensor of an exact shape."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of shape {tuple(shape)}, "
                        f"got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    check_float(op, name, x)
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device} but q is on {device}")


def check_state_dict(op: str, state, keys: Sequence[str]) -> None:
    """A state of several parts must be a mapping with exactly ``keys``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{op}: initial_state must be a dict with keys {sorted(keys)}, "
                        f"got {type(state).__name__}")
    if set(state.keys()) != set(keys):
        raise ValueError(f"{op}: initial_state must have keys {sorted(keys)}, "
                         f"got {sorted(state.keys())}")


def check_matrix_state(op: str, state, shape: Sequence[int], device: torch.device) -> None:
    """A one-part state ``S`` (a tensor)."""
    if isinstance(state, Mapping):
        raise TypeError(f"{op}: initial_state must be a tensor S of shape {tuple(shape)}, got a dict")
    check_state_tensor(op, "initial_state", state, shape, device)


# ----------------------------------------------------------------------------- tensors
def pad_time(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of ``x`` up to a multiple of ``multiple``."""
    T = x.shape[1]
    extra = (-T) % multiple
    if extra == 0:
        return x
    # F.pad pads the last dims first: zeros for every dim after time, then `extra` after time.
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra))


def time_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a ``[B, T]`` bool mask against a ``[B, T, ...]`` tensor (None -> ones)."""
    if mask is None:
        return torch.ones((), dtype=torch.bool, device=x.device)
    return mask.view(mask.shape + (1,) * (x.dim() - 2))


def fast_scan(scan, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``scan(x, dim)`` (``torch.cumsum``, ``torch.logcumsumexp``, ...), computed with ``dim`` as the last
    (contiguous) dim where that is faster. CUDA's scan along an outer dim walks it one step at a time per column: at
    T = 8k the linear-attention normaliser's cumsum took 72 of a 259 ms training step, OVQ's dictionary sums 9 of
    16 ms and ELA's logcumsumexp 12 of 35 ms (H200 profiles, docs/changelog.md). The innermost-dim scan is parallel
    but costs two transposing copies (the result is laid out like ``x`` again: elementwise ops on a transposed view
    took the slow strided path). With many short columns the outer scan wins: [B, T, 16, 128] fp32 fwd + bwd on an
    H200, logcumsumexp outer / innermost 4.8 / 7.6 ms at B = 32, T = 1k, 9.4 / 8.2 at 8 × 4k, 15.4 / 8.2 at
    4 × 8k, 50.9 / 8.9 at 1 × 32k (cumsum and cummax alike): the outer scan runs where there are at least 16 T
    columns."""
    n = x.shape[dim]
    if x.numel() >= 16 * n * n:
        return scan(x, dim)
    return scan(x.movedim(dim, -1).contiguous(), -1).movedim(-1, dim).contiguous()


def time_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(1)`` of a ``[B, T, ...]`` tensor (``fast_scan``)."""
    return fast_scan(torch.cumsum, x, 1)


def zero_masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero ``x`` ``[B, T, ...]`` at padded positions (autograd-safe, never NaN)."""
    if mask is None:
        return x
    return torch.where(time_mask(mask, x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_pads(mask: torch.Tensor | None, *xs: torch.Tensor | None) -> tuple:
    """Every ``[B, T, ...]`` input with its pads set to 0 (None passes through): done once at an op's boundary,
    so that a NaN or Inf at a pad never meets a real token (0 * NaN is NaN) in any backend or kernel, and the
    gradient at a pad is exactly 0."""
    return tuple(None if x is None else zero_masked(x, mask) for x in xs)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim: smooth at 0, so always differentiable. In x's dtype (CUDA autocast
    would return the float32 of its rsqrt, and the ops take inputs of one dtype)."""
    return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)).to(x.dtype)


def matrix_initial_state(op, state, B, H, dk, dv, device, cdt) -> torch.Tensor:
    """A one-part state S: zeros by default, else validated and cast to the compute dtype."""
    if state is None:
        return torch.zeros(B, H, dv, dk, dtype=cdt, device=device)
    check_matrix_state(op, state, (B, H, dv, dk), device)
    return state.to(cdt)


def split_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, N*C, H, d]`` -> ``[B, H, N, C, d]``."""
    B, Tp, H, d = x.shape
    return x.reshape(B, Tp // C, C, H, d).permute(0, 3, 1, 2, 4)


def merge_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, d]`` -> ``[B, T, H, d]`` (the padding dropped)."""
    B, H, N, C, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, d)[:, :T]


# ----------------------------------------------------------------------------- packed sequences
def check_cu_seqlens(op: str, cu_seqlens, B: int, T: int, device, mask=None):
    """Validate ``cu_seqlens`` (None passes): 1-D ints from 0 to T, non-decreasing, with B = 1.
    Ops that cannot combine it with a mask pass theirs to have that refused."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be an integer torch.Tensor [N + 1], "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must have shape [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{op}: cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the sequences are packed along time, so B must be 1, got B={B}")
    if mask is not None:
        raise ValueError(f"{op}: pass either mask or cu_seqlens, not both")
    bounds = cu_seqlens.detach().to("cpu", torch.int64)
    if bounds[0] != 0 or bounds[-1] != T or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must start at 0, end at T={T} and never decrease, "
                         f"got {bounds.tolist()}")
    return cu_seqlens.to(device=device, dtype=torch.int64)


def run_per_sequence(run, cu_seqlens, initial_state, output_final_state: bool, q, v):
    """The PyTorch backends on packed sequences: ``run(time_slice, state_n) -> (o, state_n)`` for each
    sequence, with ``initial_state`` (a tensor or a dict of tensors) holding one entry per sequence."""
    from torch.utils._pytree import tree_map

    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        state = tree_map(lambda x: x[n:n + 1], initial_state)
        if e > s:
            o, state = run(slice(s, e), state)
            outs.append(o)
        finals.append(state)
    o = torch.cat(outs, 1) if outs else q.new_zeros(1, 0, q.shape[2], v.shape[-1], dtype=v.dtype)
    if not output_final_state:
        return o, None
    return o, tree_map(lambda *parts: torch.cat(parts, 0), finals[0], *finals[1:])


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The boundaries ``[N + 1]`` (int64) of packed sequences whose ``position_ids`` ``[1, T]`` restart at 0
    at every sequence start (transformers' ``DataCollatorWithFlattening``), or None when they never restart
    (``position_ids[0, t] == 0`` for no ``t > 0``): a single sequence. The first token always starts one."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    starts = (position_ids[0, 1:] == 0).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    T = position_ids.shape[1]
    edge = torch.tensor([0], dtype=torch.int64, device=position_ids.device)
    return torch.cat([edge, starts.to(torch.int64), edge + T])


def packed_offsets(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64: the offset of every packed position within its own sequence (0 at each start)."""
    t = torch.arange(T, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:], t, right=True)  # the sequence each position belongs to
    return t - cu_seqlens[seq]


def packed_sequence_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64: the index of the packed sequence each position belongs to."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=cu_seqlens.device), right=True)
