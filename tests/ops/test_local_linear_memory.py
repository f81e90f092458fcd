"""Memory of local-linear attention's PyTorch (chunk) form: linear in T, within 2× of softmax attention's.

Peak memory is counted from torch.profiler's allocation events (every allocation and free through torch's CPU
allocator, op workspaces and the tensors autograd keeps included), summed in time order over one training step
(forward + backward): deterministic, unlike the process's resident size, which depends on the allocator's caching.
The claim: a hidden-32 model training at T = 8192 on the CPU peaks within 2× of the softmax model (the earlier,
quadratic chunk form took 5.5 GiB there; softmax 51 MiB). The default run checks T = 2048, `-m slow` 8192.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model
from torch.profiler import ProfilerActivity, profile

from lazoo.ops import local_linear_attention

pytestmark = pytest.mark.usefixtures("single_thread")

MiB = 2 ** 20


def peak_bytes(fn) -> int:
    """The most bytes held at once by what ``fn()`` allocates, counted from its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def test_peak_bytes_sees_temporaries():
    """The measure counts a temporary that is freed before the end (so the ratios below cannot pass on zeros)."""
    def fn():
        x = torch.ones(4 * MiB // 4)
        return (x * 2).sum()

    assert 8 * MiB <= peak_bytes(fn) < 9 * MiB


def training_step(mechanism: str, T: int) -> tuple[int, float]:
    """Peak bytes of one forward + backward of a tiny model (hidden 32, 2 layers, 2 heads) on one sequence of T,
    and the seconds of one such step without the profiler."""
    overrides = {"chunk_size": 64} if mechanism == "local_linear" else {}  # the mixer's default block
    model = tiny_model(mechanism, perturb=False, eval=False, **overrides)
    ids = random_ids(1, T, seed=T)
    model(ids[:, :64], labels=ids[:, :64]).loss.backward()  # first-call allocations (gradients) out of the count

    def step():
        model(ids, labels=ids).loss.backward()

    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return peak_bytes(step), seconds


def check_within_twice_softmax(T: int) -> None:
    (local_linear, ll_s), (softmax, sm_s) = training_step("local_linear", T), training_step("softmax", T)
    print(f"T = {T}: local_linear {local_linear / MiB:.1f} MiB ({ll_s:.2f} s a step), "
          f"softmax {softmax / MiB:.1f} MiB ({sm_s:.2f} s)")
    assert softmax > 0
    assert local_linear <= 2 * softmax, (f"T = {T}: local_linear peaks at {local_linear / MiB:.1f} MiB, "
                                         f"softmax at {softmax / MiB:.1f} MiB")


def test_training_memory_within_twice_softmax():
    check_within_twice_softmax(2048)


@pytest.mark.slow
def test_training_memory_within_twice_softmax_at_8192():
    check_within_twice_softmax(8192)


def test_op_memory_is_linear_in_T():
    """The op alone (B = 1, H = 2, dk = dv = 16), forward + backward: each doubling of T adds about twice the memory
    of the one before (a quadratic form: four times), and a fraction of one [B, H, T, T] float tensor in all."""
    def peak(T):
        g = torch.Generator().manual_seed(T)
        q, k = (F.normalize(torch.randn(1, T, 2, 16, generator=g), dim=-1).requires_grad_() for _ in range(2))
        v = torch.randn(1, T, 2, 16, generator=g, requires_grad=True)
        beta = torch.full((2,), 4.0, requires_grad=True)
        return peak_bytes(lambda: local_linear_attention(q, k, v, scale=beta, ridge=0.1, backend="chunk")[0]
                          .square().sum().backward())

    peaks = [peak(T) for T in (1024, 2048, 4096)]
    first, second = peaks[1] - peaks[0], peaks[2] - peaks[1]
    assert 0 < second < 2.5 * first, [f"{p / MiB:.2f} MiB" for p in peaks]
    assert peaks[2] < 2 * 4096 ** 2 * 4 / 4, f"{peaks[2] / MiB:.2f} MiB at T = 4096"
