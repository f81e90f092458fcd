"""Per-kernel CUDA time (torch.profiler) and fwd+bwd medians of linear attention, normalised linear attention and
ELA's polynomial kernels at T = 8k (bf16, B·T = 32k, H = 16, D = 128). Writes $OUT/prof_norm.json (or /tmp).

    PYTHONPATH=src python docs/results/normalized/profile_normalized.py

The ELA cases scale q and k by 0.1 in PyTorch before the op: those two multiplications and their backward show
in the profile as elementwise kernels that the op itself does not have."""
import collections
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lazoo import ops

H, D, TOK = 16, 128, 32768
dev = "cuda"


def inputs(T, positive):
    g = torch.Generator(device=dev).manual_seed(0)
    B = TOK // T
    x = [torch.randn(B, T, H, D, device=dev, generator=g) for _ in range(3)]
    if positive:
        x[0], x[1] = F.elu(x[0]) + 1, F.elu(x[1]) + 1
    return [t.to(torch.bfloat16).requires_grad_(True) for t in x]


CASES = {
    "linear": (False, lambda q, k, v: ops.linear_attention(q, k, v, feature_map="identity", normalize=False,
                                                           backend="triton")[0]),
    "normalised": (True, lambda q, k, v: ops.linear_attention(q, k, v, feature_map="identity", normalize=True,
                                                              backend="triton")[0]),
    "ela_sum_sq": (False, lambda q, k, v: ops.ela(q * 0.1, k * 0.1, v, kernel="sum_sq_euclid", backend="triton")[0]),
    "ela_mag_dir": (False, lambda q, k, v: ops.ela(q * 0.1, k * 0.1, v, kernel="magnitude_direction",
                                                   backend="triton")[0]),
}
out = {}
T = 8192
for name, (pos, fn) in CASES.items():
    q, k, v = inputs(T, pos)
    do = torch.randn_like(v)

    def step():
        o = fn(q, k, v)
        torch.autograd.grad(o, (q, k, v), do)

    step()
    step()
    row = {"fwd_bwd_ms": round(do_bench(step, warmup=5, rep=60, return_mode="median"), 3),
           "fwd_ms": round(do_bench(lambda: fn(q, k, v), warmup=5, rep=40, return_mode="median"), 3)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    agg = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:60]] += e.device_time / 5 / 1000
    row["kernels_ms"] = {k_: round(v_, 3) for k_, v_ in agg.most_common(14)}
    out[f"{name}[-] T={T}"] = row
    print(name, json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prof_norm.json"), "w"), indent=1)
