"""Checks of an op's arguments, each raising an error that names the op and the argument: q, k, v and the per-token
inputs (shapes, dtypes, devices), the mask, scalar options, and value ranges at real tokens (read back from the device:
``queue_range_check`` queues the comparison before the op's kernels and reads its answer after them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import host_sync_allowed


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              grouped_values: bool = False, grouped_kv: bool = False) -> tuple[int, ...]:
    """Check q ``[B, T, H, dk]``, k like q, v ``[B, T, H, dv]`` (``grouped_values``: ``[B, T, m·H, dv]``, each
    query/key head serving m consecutive value heads; ``grouped_kv``: k ``[B, T, Hkv, dk]`` and v ``[B, T, Hkv, dv]``
    with Hkv dividing H, grouped-query attention); return ``(B, T, H, dk, dv)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{op}: {name} must have 4 dimensions [B, T, H, D], got shape {tuple(x.shape)}"
            )
    check_float(op, "q", q)
    B, T, H, dk = q.shape
    kv_heads = H
    if grouped_kv and k.shape[:2] == q.shape[:2] and k.shape[3] == dk and 0 < k.shape[2] <= H \
            and H % k.shape[2] == 0:
        kv_heads = k.shape[2]  # grouped-query attention: query head h reads key/value head h // (H // Hkv)
    elif k.shape != q.shape:
        grouped = " (or [B, T, Hkv, dk] with Hkv dividing H: grouped key/value heads)" if grouped_kv else ""
        raise ValueError(
            f"{op}: k must have shape [B, T, H, dk] = {tuple(q.shape)} like q, got {tuple(k.shape)}{grouped}"
        )
    if grouped_values and v.shape[:2] == q.shape[:2] and v.shape[2] >= H and v.shape[2] % H == 0:
        pass  # m·H value heads
    elif v.shape[:3] != (B, T, kv_heads):
        heads = f" (or a multiple of H = {H} heads: grouped value heads)" if grouped_values else ""
        like = f"like k ({kv_heads} key/value heads)" if kv_heads != H else "like q"
        raise ValueError(
            f"{op}: v must have shape [B, T, H, dv] with [B, T, H] = {(B, T, kv_heads)} {like}{heads}, "
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


def check_head_scalar(op: str, name: str, x: torch.Tensor, q: torch.Tensor, heads: torch.Tensor | None = None,
                      fp32_ok: bool = False) -> None:
    """A per-head scalar (gate, beta) must be a float ``[B, T, H]`` tensor like q (H of ``heads``' dim 2 when given:
    the value heads), in q's dtype (or float32 with ``fp32_ok``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    shape = tuple(q.shape[:3]) if heads is None else (*q.shape[:2], heads.shape[2])
    if tuple(x.shape) != shape:
        raise ValueError(
            f"{op}: {name} must have shape [B, T, H] = {shape}, got {tuple(x.shape)}"
        )
    check_float(op, name, x)
    if not (fp32_ok and x.dtype == torch.float32):
        check_same_dtype(op, q, **{name: x})
    check_same_device(op, q, **{name: x})


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
            _refuse_outside(op, name, x, low, high, hint)
    return report


def _refuse_outside(op: str, name: str, x: torch.Tensor, low: float | None, high: float | None, hint: str):
    bad = x[_outside(x, low, high)].flatten()[0].item()
    lo, hi = ("-inf" if low is None else f"{low:g}"), ("inf" if high is None else f"{high:g}")
    raise ValueError(f"{op}: {name} must lie in [{lo}, {hi}] at real tokens{hint}, got {bad!r}")


class KernelRangeCheck:
    """``queue_range_check`` with the comparison made by a kernel that reads x anyway (no extra pass over x): the
    kernel sets ``flag`` (int32 ``[1]``, zeros) to 1 where it meets a value outside the range; call ``queued()``
    right after that kernel's launch (the read-back then waits for it only), then the object itself, which raises as
    the queued check does. A check never queued falls back to comparing x itself."""

    def __init__(self, op: str, name: str, x: torch.Tensor, low: float | None = None, high: float | None = None,
                 hint: str = ""):
        self.args = (op, name, x, low, high, hint)
        self.flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.found = None

    def queued(self) -> None:
        self.found = queue_readback(self.flag)

    def __call__(self) -> None:
        if self.found is None:
            queue_range_check(*self.args)()
        elif bool(self.found()[0]):
            _refuse_outside(*self.args)


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


#: what a log decay's range check adds to its message
LOG_DECAY_HINT = " (a log decay: the state is multiplied by exp(g) <= 1)"


def queue_log_decay_check(op: str, name: str, g: torch.Tensor | None):
    """A log decay (pads zeroed) must be <= 0: g > 0 would grow the state by exp(g) and overflow. Queued
    (``queue_range_check``): call the result to read it back and raise."""
    return queue_range_check(op, name, g, high=0.0, hint=LOG_DECAY_HINT)


def kernel_log_decay_check(op: str, name: str, g: torch.Tensor | None) -> KernelRangeCheck | None:
    """``queue_log_decay_check`` made by the kernel that first reads g (``KernelRangeCheck``), or None where no check
    is made (no g; under torch.compile or CUDA-graph capture)."""
    if g is None or not host_sync_allowed():
        return None
    return KernelRangeCheck(op, name, g, high=0.0, hint=LOG_DECAY_HINT)
