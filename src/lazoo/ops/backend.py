"""Which backend an op runs: the ``backend=`` argument or the ``LAZOO_BACKEND`` variable, else auto (Triton on
CUDA tensors where the kernel takes the case, the PyTorch chunk form otherwise); whether Triton can run at all; and
whether a check may read tensor values back to the host."""

from __future__ import annotations

import logging
import os

import torch

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


def triton_unsupported(q: torch.Tensor, v: torch.Tensor, max_head_dim: int, dtypes: tuple) -> str | None:
    """The checks every op's Triton path shares (Triton installed, input dtype, head dims, device, the
    interpreter on CPU): None when they pass, else why not. The op passes its kernel's limits (``max_head_dim``,
    ``dtypes``: ``lazoo.kernels.limits``) and adds its own checks after these."""
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


def host_sync_allowed() -> bool:
    """Whether a check may read tensor values back to the host: not while torch.compile traces or a CUDA graph
    is being captured (a host sync is an error there); value checks are skipped then."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
