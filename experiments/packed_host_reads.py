"""Packed batches through several layers: the gated delta rule handed the same ``cu_seqlens`` tensor by every layer
(its bounds checked on the host and its chunk tables built once, ``lazoo.kernels._tensor_cache``) against a fresh
copy of it each layer (checked and built every call, as before that cache), on a CUDA GPU.

    PYTHONPATH=src python experiments/packed_host_reads.py [--layers 4] [--models gated_delta_net,...] > out.jsonl

A stack of ``--layers`` calls (bf16, H = HV = 16, D = 128, ``check_g=False`` as the Gated DeltaNet layer calls it),
forward + backward, wall medians (``triton.testing.do_bench``) and the sum of the GPU kernels' times, in turns, two
rounds, for 32k tokens packed as one 24k document and 16 of 512 tokens, and as 64 of 512. Then, for each of
``--models`` (``lazoo.presets`` names; the benchmarks' ~125M shape, ``lazoo.bench.models``), a training step's
forward + backward under bf16 autocast on 16k tokens packed as 32 documents of 512 (``position_ids`` restarting at
each, as transformers' ``DataCollatorWithFlattening`` makes them), with the tables kept and with
``lazoo.kernels._tensor_cache.KEEP_TABLES = False`` (built every layer), in turns, two rounds.
"""
from __future__ import annotations

import argparse
import json

import torch

from lazoo import ops
from lazoo.bench.delta_frontier import make_inputs
from lazoo.bench.report import gpu_environment
from lazoo.bench.timing import call_ms, kernel_ms, median_ms
from lazoo.bench.variants import variant_settings
from lazoo.kernels import _tensor_cache

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


def model_step_ms(name: str, documents: int = 32, length: int = 512) -> dict:
    """Median ms of a packed training step's forward + backward, tables kept and built every layer."""
    from lazoo.bench.models import MODEL_SIZES, lazoo_model, packed_training_step

    step = packed_training_step(lazoo_model(name, MODEL_SIZES).cuda(), documents, length)
    out = {}
    for r in range(2):
        for keep in (True, False):
            with variant_settings([(_tensor_cache, "KEEP_TABLES", keep)]):
                out[f"{'kept' if keep else 'built every layer'} {r}"] = round(median_ms(step, warmup=3, rep=300), 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--models", default="gated_delta_net")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"packed_host_reads.py times kernels on a CUDA GPU; torch {torch.__version__} sees none")
    print(json.dumps(dict(gpu_environment(), layers=args.layers)), flush=True)
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
    for name in filter(None, args.models.split(",")):
        print(json.dumps(dict(model=name, tokens="32 x 512 packed", fwd_bwd_ms=model_step_ms(name))), flush=True)


if __name__ == "__main__":
    main()
