"""Pieces the launch sweeps share (``tune_local_linear.py``, ``tune_ovq_attention.py``)."""

from __future__ import annotations

from lazoo.bench import timing


def median_ms(fn):
    """Median ms of ``fn()`` (``triton.testing.do_bench``, a shorter warm-up and run than the benchmarks')."""
    return timing.median_ms(fn, warmup=5, rep=50)


def rel(a, b):
    """‖a − b‖ / ‖b‖ in fp32 (a candidate launch's output against the starting launch's)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def chosen_kernels(ap, text: str, candidates: dict) -> list[str]:
    """The kernels of ``--kernels`` (comma-separated), refused through ``ap`` when one has no candidates."""
    kernels = text.split(",")
    unknown = [k for k in kernels if k not in candidates]
    if unknown:
        ap.error(f"--kernels: unknown {unknown}; choose from {list(candidates)}")
    return kernels
