"""Packed batches through several layers: the gated delta rule handed the same ``cu_seqlens`` tensor by every layer
(its bounds checked on the host and its chunk tables built once, ``lazoo.kernels._tensor_cache``) against a fresh
copy of it each layer (checked and built every call, as before that cache), on a CUDA GPU.

    PYTHONPATH=src python experiments/packed_host_reads.py [--layers 4] > packed_host_reads.jsonl

A stack of ``--layers`` calls (bf16, H = HV = 16, D = 128, ``check_g=False`` as the Gated DeltaNet layer calls it),
forward + backward, wall medians (``triton.testing.do_bench``) and the sum of the GPU kernels' times, in turns, two
rounds, for 32k tokens packed as one 24k document and 16 of 512 tokens, and as 64 of 512.
"""
from __future__ import annotations

import argparse
import json

import torch

from lazoo import ops
from lazoo.bench.delta_frontier import make_inputs
from lazoo.bench.timing import call_ms, kernel_ms

D = 128
BATCHES = {"24576+16x512": [24576] + [512] * 16, "64x512": [512] * 64}


def stack(x, cu, layers: int, fresh: bool):
    """``layers`` calls, each on the previous one's output (as values), summed."""
    v, out = x["v"], 0
    for _ in range(layers):
        c = cu.clone() if fresh else cu
        o = ops.gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"], scale=D ** -0.5, cu_seqlens=c,
                                 backend="triton", check_g=False)[0]
        v, out = o, out + o.float().mean()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"packed_host_reads.py times kernels on a CUDA GPU; torch {torch.__version__} sees none")
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=__import__("triton").__version__, layers=args.layers)), flush=True)
    for r in range(2):
        for name, lens in BATCHES.items():
            x = make_inputs(sum(lens), 1, 16, 16, torch.bfloat16, "cuda")
            leaves = {n: t.detach().requires_grad_(True) for n, t in x.items()}
            cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
            for fresh in (True, False):
                wall = call_ms(lambda: stack(leaves, cu, args.layers, fresh), backward=True,
                               leaves=list(leaves.values()), rep=200)
                gpu = sum(kernel_ms(lambda: stack(leaves, cu, args.layers, fresh).backward(), warmup=3).values())
                print(json.dumps(dict(round=r, batch=name, cu_seqlens="fresh each layer" if fresh else "shared",
                                      fwd_bwd_ms=round(wall, 4), gpu_fwd_bwd_ms=round(gpu, 4))), flush=True)


if __name__ == "__main__":
    main()
