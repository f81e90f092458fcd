"""hadamard_exp's spread check: does its host wait cost GPU time?

``ops.ela(kernel="hadamard_exp")`` reads one number back (the keys' spread) after queuing its kernels. This times
the op's forward and forward + backward (``lazoo.bench.timing.time_fwd_bwd``) as it runs and with that read-back
answered at once (``lazoo.ops.ela.queue_readback`` patched), and the host's own time to queue 20 forward + backward
steps (no synchronisation) against the wall time of the same 20. Linear attention is timed beside it.

    PYTHONPATH=src python experiments/bench_host_wait.py
"""
import sys
import time
import unittest.mock

import torch

from lazoo import ops
from lazoo.bench.timing import time_fwd_bwd

ela_module = sys.modules["lazoo.ops.ela"]  # ops.ela is the function; its module holds queue_readback


def hadamard_exp(x):
    return ops.ela(x["q"], x["k"], x["v"], kernel="hadamard_exp", backend="triton")[0]


def linear(x):
    return ops.linear_attention(x["q"], x["k"], x["v"], feature_map="identity", normalize=False, backend="triton")[0]


def no_wait(x):
    return lambda: torch.zeros((), dtype=torch.bool)


def host_and_wall_ms(fn, x, steps=20):
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    do = torch.randn_like(x["v"])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(leaves).backward(do)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / steps, 1e3 * (time.perf_counter() - t0) / steps


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    H, D = 16, 128
    for T in (8192, 32768):
        x = {n: torch.randn(32768 // T, T, H, D, device="cuda", dtype=torch.bfloat16) for n in "qkv"}
        for label, readback in (("as run", ela_module.queue_readback), ("no wait", no_wait),
                                ("as run again", ela_module.queue_readback)):
            with unittest.mock.patch.object(ela_module, "queue_readback", readback):
                fwd, both, _ = time_fwd_bwd(hadamard_exp, x, ("q", "k", "v"))
                host, wall = host_and_wall_ms(hadamard_exp, x)
            print(f"T={T} hadamard_exp {label:13s} fwd {fwd:.3f} fwd+bwd {both:.3f} ms; "
                  f"host {host:.3f} ms a step, wall {wall:.3f}", flush=True)
        fwd, both, _ = time_fwd_bwd(linear, x, ("q", "k", "v"))
        host, wall = host_and_wall_ms(linear, x)
        print(f"T={T} linear attention fwd {fwd:.3f} fwd+bwd {both:.3f} ms; host {host:.3f} ms a step, "
              f"wall {wall:.3f}", flush=True)


if __name__ == "__main__":
    main()
