"""Where an op's forward + backward time goes, on a CUDA GPU: torch.profiler's table of GPU kernels and host ops.

    python -m lazoo.bench.profile_op --op ela_hadamard_exp --T 8192     # an op of lazoo.bench.kernel_ops
    python -m lazoo.bench.profile_op --op ovq --T 4096                  # lazoo.bench.ovq's shape (B=1, H=8, d=128)
    python -m lazoo.bench.profile_op --op ovq_pytorch_assign --T 4096   # the same with the PyTorch assignments
    python -m lazoo.bench.profile_op --op vla --T 32768 --B 1           # lazoo.bench.vla's shape (H=16, d=128)
    python -m lazoo.bench.profile_op --op gla --T 8192 --fla            # fla's chunk_gla at the same shape
    python -m lazoo.bench.profile_op --op mamba2 --T 8192 [--fla]       # lazoo.bench.mamba2's op (Bamba-9B's shapes)

The kernels benchmark's ops run at its shape (32k tokens a batch, H = 16, bf16). Prints the wall time of one step
(median of --repeats after warm-up), the GPU-busy time inside it, and the top --rows entries by GPU time and by host
time.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def kernel_op_step(name: str, T: int, D: int, fla: bool = False):
    """One forward + backward of an op of ``kernel_ops``: lazoo's, or (``fla``) fla's where it has the op."""
    from . import kernel_ops

    op = kernel_ops.kernel_ops()[name]
    run = op.ours
    if fla:
        module, version = kernel_ops.load_fla()
        if module is None or op.fla is None:
            sys.exit(f"fla has no {name} here ({version})")
        run = lambda t: op.fla(module, t)  # noqa: E731
    B = max(1, kernel_ops.TOKENS // T)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = op.make(B, T, kernel_ops.H, D, torch.bfloat16, "cuda", gen)
    leaves = [x[n].requires_grad_() for n in op.grads]
    do = torch.randn_like(run(x))  # the output gradient as the kernels benchmark gives it: no cast or copy in the step

    def step():
        run(x).backward(do)
        for t in leaves:
            t.grad = None
    return step


def ovq_step(T: int, triton_assign: bool = True):
    from lazoo.ops import ovq_attention

    from . import ovq

    q, k, v = (t.requires_grad_() for t in ovq.inputs(1, T, torch.bfloat16, "cuda"))

    def run():
        return ovq_attention(q, k, v, scale=math.sqrt(ovq.D), chunk_size=ovq.L, max_dict_size=ovq.N,
                             backend="triton", triton_assign=triton_assign)[0]
    do = torch.randn_like(run())  # a ready output gradient, as the benches give it

    def step():
        run().backward(do)
        for t in (q, k, v):
            t.grad = None
    return step


def vla_step(T: int, B: int):
    from lazoo.ops import vla

    from . import vla as bench_vla

    x = bench_vla.make(B, T, torch.bfloat16, torch.Generator(device="cuda").manual_seed(0))
    q, k, v, u = (x[n].requires_grad_() for n in "qkvu")

    do = torch.randn_like(vla(q, k, v, u, backend="triton")[0])  # a ready output gradient, as lazoo.bench.vla gives it

    def step():
        vla(q, k, v, u, backend="triton")[0].backward(do)
        for t in (q, k, v, u):
            t.grad = None
    return step


def mamba2_step(T: int, fla: bool = False, argv=()):
    """One forward + backward of ``lazoo.bench.mamba2``'s op at its shapes (``argv``: that benchmark's options, its
    defaults Bamba-9B's), lazoo's ``ops.mamba2`` or (``fla``) fla's ``chunk_simple_gla`` on the same mapped inputs."""
    from lazoo_cli.bench import bench_parser

    from . import mamba2

    args = bench_parser("mamba2").parse_args(list(argv))
    run = mamba2.lazoo_op(args)
    if fla:
        chunk_simple_gla, version = mamba2.load_fla_simple_gla(args.device)
        if chunk_simple_gla is None:
            sys.exit(f"fla's chunk_simple_gla cannot run here ({version})")
        run = mamba2.fla_op(chunk_simple_gla)
    x = {n: t.requires_grad_() for n, t in mamba2.op_inputs(max(1, args.tokens // T), T, args).items()}
    do = torch.randn_like(run(x))  # a ready output gradient

    def step():
        run(x).backward(do)
        for t in x.values():
            t.grad = None
    step.inputs = x
    return step


def device_busy_ms(events) -> float:
    """The GPU's busy time in a profile: its kernels' and copies' own times. A host-side event (an autograd node,
    an aten op) also carries the device time of what it launched, so summing every event counts that twice."""
    return sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e3


def op_names() -> list[str]:
    from .kernel_ops import kernel_ops

    return sorted(kernel_ops()) + ["mamba2", "ovq", "ovq_pytorch_assign", "vla"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lazoo.bench.profile_op", description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True,
                    help="an op of lazoo.bench.kernel_ops, or mamba2 / ovq / ovq_pytorch_assign / vla")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--B", type=int, default=1, help="batch size of the vla op")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fla", action="store_true",
                    help="profile fla's form of a kernels-benchmark op (or of mamba2) instead of lazoo's")
    args = ap.parse_args(argv)
    known = op_names()
    if args.op not in known:
        ap.error(f"--op must be one of {', '.join(known)}, got {args.op!r}")
    if not torch.cuda.is_available():
        sys.exit("lazoo.bench.profile_op needs a CUDA GPU")
    if args.op.startswith("ovq"):
        step = ovq_step(args.T, triton_assign=args.op != "ovq_pytorch_assign")
    elif args.op == "vla":
        step = vla_step(args.T, args.B)
    elif args.op == "mamba2":
        step = mamba2_step(args.T, fla=args.fla)
    else:
        step = kernel_op_step(args.op, args.T, args.D, fla=args.fla)
    for _ in range(2):  # compile and autotune outside the profile
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    walls.sort()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = device_busy_ms(events)
    print(f"{args.op}{' (fla)' if args.fla else ''} T={args.T} D={args.D} on {torch.cuda.get_device_name()}: "
          f"wall {1e3 * walls[len(walls) // 2]:.3f} ms (median of {args.repeats}), GPU busy {gpu:.3f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
