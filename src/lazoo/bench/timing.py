"""How the benchmarks time: Triton's median timer over an op's forward or forward + backward, CUDA-graph replays,
device synchronisation, and a wall-clock budget for runs that may autotune for minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from .report import error_text


def require_cuda(name: str) -> None:
    """Exit with a one-line message where torch sees no CUDA device (``lazoo.bench.<name>`` times GPU kernels)."""
    if not torch.cuda.is_available():
        sys.exit(f"lazoo.bench.{name} times Triton kernels on a CUDA GPU, and torch sees none here "
                 f"(torch {torch.__version__}); run it on a machine with a CUDA GPU and a CUDA build of torch")


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def kernel_ms(step, steps: int = 10, warmup: int = 5) -> dict:
    """Each GPU kernel's time a call of ``step`` (ms, largest first): torch.profiler over ``steps`` calls after
    ``warmup``; kernels only, not the autograd nodes around them."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = {e.key: round(e.device_time_total / steps / 1000, 4) for e in prof.key_averages()
            if e.device_time_total > 0 and "Function" not in e.key}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn()`` (``triton.testing.do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def cuda_graph_ms(fn, rep: int = 100) -> float:
    """Median ms of ``fn()`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``): a decode step
    without its launch overhead."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def call_ms(fn, backward: bool = False, leaves=(), warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn()`` without autograd or, with ``backward``, of ``fn()`` and its backward from one random
    output gradient, the gradients of ``leaves`` cleared after each step (none accumulate)."""
    if not backward:
        with torch.no_grad():
            return median_ms(fn, warmup, rep)
    with torch.no_grad():
        grad = torch.randn_like(fn())

    def step():
        fn().backward(grad)
        for leaf in leaves:
            leaf.grad = None

    return median_ms(step, warmup, rep)


def time_fwd_bwd(fn, x: dict, grads, rep: int = 100) -> tuple:
    """(forward ms, forward+backward ms, error or None) of ``fn(x)``, ``x`` a dict of input tensors of which the
    names in ``grads`` get gradients, each timed over ``rep`` ms; a failure is printed and returned as its error
    string."""
    fwd = None
    try:
        fwd = call_ms(lambda: fn(x), rep=rep)
        leaves = {n: t.detach().requires_grad_(n in grads) for n, t in x.items()}
        both = call_ms(lambda: fn(leaves), backward=True, leaves=[leaves[n] for n in grads], rep=rep)
        return fwd, both, None
    except Exception as e:  # noqa: BLE001 - one failing op must not stop the table
        traceback.print_exc(limit=2)
        return fwd, None, error_text(e)


class OutOfTime(BaseException):
    """Raised by ``time_budget`` when the time is spent (a BaseException: ``except Exception`` lets it through)."""


def _raise_out_of_time(signum, frame):
    raise OutOfTime()


@contextlib.contextmanager
def time_budget(seconds):
    """Raise ``OutOfTime`` inside the block after ``seconds`` (SIGALRM; none for 0, None, or where there is no
    SIGALRM), then put the previous handler back."""
    if not seconds or seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_out_of_time)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def use_triton_cache(path) -> dict:
    """Keep Triton's kernels and autotuning choices in ``path`` (created if missing) from here on; says how many
    files it held already (0: a cold cache, fla will autotune)."""
    folder = Path(path).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    return {"dir": str(folder), "files_at_start": sum(1 for p in folder.rglob("*") if p.is_file())}
