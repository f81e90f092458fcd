"""Where the chunked VLA A scan's block step goes (``lazoo.kernels.vla.chunk``): the forward timed at each product
precision beside the token scan, or one forward of each for Nsight Compute.

B = 1, H = 16, d = 128, T = 1024 (64 blocks of 16 tokens), refresh every 20 tokens, bf16 k̂ and û, no gradient.

    PYTHONPATH=src:tests python experiments/profile_vla_chunk.py
    PYTHONPATH=src:tests ncu --clock-control none --kernel-name regex:"_chunk_fwd|_scan_fwd_kernel" \\
        --launch-count 3 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \\
        --section LaunchStats --section Occupancy python experiments/profile_vla_chunk.py --ncu
"""
import argparse

import torch
import triton.testing
from test_kernels_vla_chunk import scan_inputs

from lazoo.kernels.vla.chunk import vla_scan_chunked
from lazoo.kernels.vla.token import vla_scan


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true", help="one forward of the token scan and the tf32x3 form")
    ap.add_argument("--length", type=int, default=1024)
    a = ap.parse_args()
    k, u, flags, A0 = scan_inputs(1, a.length, 16, 128)
    k, u = (x.to("cuda", torch.bfloat16) for x in (k, u))
    flags, A0 = flags.cuda(), A0.to("cuda", torch.float32)
    runs = {"token scan": lambda: vla_scan(k, u, flags, A0, eta=1e-3, pieces=1)}
    for prec in ("tf32x3", "tf32", "ieee"):
        runs[f"chunked, {prec}"] = lambda prec=prec: vla_scan_chunked(k, u, flags, A0, eta=1e-3, precision=prec)
    with torch.no_grad():
        for name, fn in runs.items():
            if a.ncu and "tf32x3" not in name and "token" not in name:  # the token scan and the tf32x3 form
                continue
            fn()
            if a.ncu:
                continue
            ms = triton.testing.do_bench(fn, warmup=3, rep=50, return_mode="median")
            blocks = -(-a.length // 16)
            print(f"{name:18s} {ms:.3f} ms, {1000 * ms / blocks:.1f} µs a block of 16 tokens", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
