"""Launch settings of ELA's prefix kernels (``lazoo.kernels.ela``): ``ops.ela`` forward + backward ms for each
(warps, tokens a block) pair, on one CUDA GPU, bf16, B·T = 32k tokens, H = 16, D = 128, unit-norm q and k.

    PYTHONPATH=src python scripts/tune_ela.py --kernel sum_sq_euclid --lengths 1024,32768 --configs 4x32,8x32,4x16,8x16 \
        --programs-per-sm 2,8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def time_ms(kernel, T, tokens=32768, heads=16, dim=128):
    from triton.testing import do_bench

    from lazoo import ops

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens // T, T, heads, dim, device="cuda", generator=gen) for _ in range(3))
    x = [t.bfloat16().requires_grad_() for t in (F.normalize(q, dim=-1), F.normalize(k, dim=-1), v)]
    do = torch.randn_like(x[2])

    def step():
        ops.ela(*x, kernel=kernel, backend="triton")[0].backward(do)

    return do_bench(step, warmup=5, rep=50)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="sum_sq_euclid")
    ap.add_argument("--lengths", default="1024,32768")
    ap.add_argument("--configs", default="4x32,8x32,4x16,8x16", help="warps x tokens a block, comma-separated")
    ap.add_argument("--programs-per-sm", default="2", help="programs per SM the segments aim at, comma-separated")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import lazoo.kernels.ela as kernels

    default, default_programs = kernels._launch_meta, kernels.PROGRAMS_PER_SM
    lengths = [int(t) for t in args.lengths.split(",")]
    try:
        for programs in (int(n) for n in args.programs_per_sm.split(",")):
            kernels.PROGRAMS_PER_SM = programs
            for config in args.configs.split(","):
                warps, block = (int(n) for n in config.split("x"))
                kernels._launch_meta = lambda D, V, w=warps, b=block: dict(default(D, V), num_warps=w, BT=b)
                print(f"{programs} programs an SM, {warps} warps, {block} tokens a block:",
                      [round(time_ms(args.kernel, T), 3) for T in lengths], flush=True)
    finally:
        kernels._launch_meta, kernels.PROGRAMS_PER_SM = default, default_programs


if __name__ == "__main__":
    main()
