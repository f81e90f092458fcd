"""Packed batches with one long document: the gated delta rule with its walks split (the default plan) against whole
sequences, on a CUDA GPU.

The walks are sequential over a sequence's chunks, so in a batch of 32k tokens packed from one long document and
many short ones the long one's walk outlasts the rest however many programs the short ones give the card.
``lazoo.kernels.delta_split.plan`` cuts a sequence whose walk is 1.5 times its fair share of the walk work or more;
this times that against ``SPLIT_LONG_SEQUENCES=False`` (and each ``--set``) in turns, two rounds, bf16, H = HV = 16,
D = 128: wall time (``triton.testing.do_bench`` medians, ``lazoo.bench.timing``; a packed call reads ``cu_seqlens``
back to the host, so the GPU waits for the host each call) and GPU time (the sum of the kernels' times of one
forward + backward, torch.profiler over ten), and prints the split's largest relative difference from the unsplit
output and gradients (both bf16 kernels).

    PYTHONPATH=src python experiments/split_packed.py [--set LABEL:module.ATTR=value,...] > split_packed.jsonl

Batches (``--batches``, each ``LONG+COUNTxSHORT`` tokens packed, or ``uBxT`` for a uniform batch without
``cu_seqlens``): 24576+16x512, 16384+32x512, 12288+40x512, u2x16384 and u1x32768 by default.
"""
from __future__ import annotations

import argparse
import json

import torch

from lazoo import ops
from lazoo.bench.delta_frontier import make_inputs
from lazoo.bench.timing import kernel_ms, time_fwd_bwd
from lazoo.bench.variants import parse_variant, variant_settings
from lazoo.kernels import delta, delta_split

D = 128
GRADS = ("q", "k", "v", "beta", "g")
BATCHES = "24576+16x512,16384+32x512,12288+40x512,u2x16384,u1x32768"


def lengths(spec: str) -> list[int]:
    out = []
    for part in spec.split("+"):
        count, x, length = part.partition("x")
        out += [int(length)] * int(count) if x else [int(count)]
    return out


def batch(spec: str, H: int = 16):
    """(inputs, cu_seqlens or None)."""
    if spec.startswith("u"):
        B, _, T = spec[1:].partition("x")
        B, T = int(B), int(T)
        return make_inputs(T, B, H, H, torch.bfloat16, "cuda"), None
    lens = lengths(spec)
    x = make_inputs(sum(lens), 1, H, H, torch.bfloat16, "cuda")
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    return x, cu


def call(x, cu):
    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, cu_seqlens=cu,
                                backend="triton")[0]


def segments(spec: str, H: int = 16) -> int | None:
    """How many segments the plan walks (None: whole sequences)."""
    x, cu = batch(spec, H)
    B, T = x["q"].shape[:2]
    segs = delta_split.plan(delta.seqs_for(B, T, cu, 64, x["q"].device), H, D, x["q"].device, 64)
    return segs.N if segs is not None else None


def outputs(x, cu):
    leaves = {n: t.detach().requires_grad_(n in GRADS) for n, t in x.items()}
    o = call(leaves, cu)
    o.backward(torch.randn_like(o, generator=torch.Generator(device="cuda").manual_seed(1)))
    return [o.float()] + [leaves[n].grad.float() for n in GRADS]


def largest_difference(x, cu, setting) -> float:
    with variant_settings(setting):
        a = outputs(x, cu)
    with variant_settings([(delta_split, "SPLIT_LONG_SEQUENCES", False)]):
        b = outputs(x, cu)
    return max(((s - u).abs().max() / u.abs().max().clamp_min(1e-12)).item() for s, u in zip(a, b))


def gpu_ms(x, cu, steps: int = 10) -> float:
    """The sum of the GPU kernels' times of one forward + backward."""
    leaves = {n: t.detach().requires_grad_(n in GRADS) for n, t in x.items()}

    def step():
        call(leaves, cu).backward(do)
    do = torch.ones_like(call(leaves, cu))
    return sum(kernel_ms(step, steps, warmup=3).values())


def emit(**record):
    print(json.dumps(record), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default=BATCHES)
    p.add_argument("--set", action="append", default=[], metavar="LABEL:module.ATTR=value[,...]")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"split_packed.py times Triton kernels on a CUDA GPU; torch {torch.__version__} sees none")
    runs = [("default", []), ("whole", [(delta_split, "SPLIT_LONG_SEQUENCES", False)])]
    runs += [parse_variant(s) for s in args.set]
    specs = args.batches.split(",")
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    for spec in specs:
        x, cu = batch(spec)
        for tag, setting in runs:
            with variant_settings(setting):
                n = segments(spec)
            emit(batch=spec, variant=tag, walked_sequences=n, sequences=x["q"].shape[0] if cu is None else len(cu) - 1,
                 split_vs_whole=largest_difference(x, cu, setting) if tag != "whole" else None)
    for r in range(2):
        for spec in specs:
            x, cu = batch(spec)
            for tag, setting in runs:
                with variant_settings(setting):
                    fwd, both, err = time_fwd_bwd(lambda t: call(t, cu), x, GRADS, rep=200)
                    gpu = gpu_ms(x, cu)
                emit(batch=spec, variant=tag, round=r, fwd_ms=fwd, fwd_bwd_ms=both, gpu_fwd_bwd_ms=round(gpu, 4),
                     error=err)


if __name__ == "__main__":
    main()
