"""OVQ's step 1 (``lazoo.kernels.ovq_assign``) with one part changed at a time, to see what each part costs; or
three plain passes for Nsight Compute.

Default shape: a ~138M sw-ovq model's training step (B = 2, T = 8k, H = 12, d = 64; N = 2048, L = 128). Each
variant is timed (median of ``triton.testing.do_bench``) and its slots compared with the first row's. The tf32
similarity is for timing only: it picks other slots.

    PYTHONPATH=src:tests:scripts python scripts/profile_ovq_step1.py
    PYTHONPATH=src:tests:scripts ncu --clock-control none --kernel-name regex:"_nearest_kernel|_merge_kernel" \\
        --launch-skip 40 --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats python scripts/profile_ovq_step1.py --ncu
"""
import argparse

import torch
import triton.testing

from bench_ovq_search import CURRENT, use
from lazoo.kernels import ovq_assign
from test_kernels_ovq_assign import keys, packed

#: (label, the similarity's precision, overrides of ``ovq_assign._blocks()``)
VARIANTS = [
    ("now (fp32 similarity)", "ieee", {}),
    ("tf32 similarity (timing only)", "tf32", {}),
    ("tf32x3 similarity", "tf32x3", {}),
    ("the add in full fp32 (no bf16 parts)", "ieee", dict(BF16_PARTS=False)),
    ("merge at 4 warps", "ieee", dict(merge=dict(num_warps=4, num_stages=1))),
    ("merge at 16 warps", "ieee", dict(merge=dict(num_warps=16, num_stages=1))),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true", help="three passes of the current settings, nothing timed")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    L, N = 128, 2048
    Kp, valid, st, t0, nb = packed(keys(a.batch, a.length, a.heads, a.head_dim, seed=5, device="cuda"), L, N)
    args = (Kp, valid.sum(1) // L, t0 - nb, st["Dk"], st["counts"], L, N)
    precision, first = ovq_assign.SIM_PRECISION, None
    try:
        for label, prec, overrides in VARIANTS[:1] if a.ncu else VARIANTS:
            ovq_assign.SIM_PRECISION = prec
            use(overrides)
            out = ovq_assign.ovq_assign(*args)
            if a.ncu:
                for _ in range(2):
                    ovq_assign.ovq_assign(*args)
                torch.cuda.synchronize()
                return
            first = out if first is None else first
            same = all(torch.equal(x, y) for x, y in zip(out, first))
            ms = triton.testing.do_bench(lambda: ovq_assign.ovq_assign(*args), warmup=3, rep=100,
                                         return_mode="median")
            print(f"{label:40s} {ms:.3f} ms, slots as the first row's: {same}", flush=True)
    finally:
        ovq_assign.SIM_PRECISION = precision
        ovq_assign._blocks = CURRENT


if __name__ == "__main__":
    main()
