"""The gated delta rule's Triton path on a GPU: fwd and fwd + bwd medians at T = 1k / 8k / 32k (32k tokens, H = 16,
D = 128, bf16, unit-norm q and k), the relative error of outputs and gradients against the float64 chunk form, and
(with PROFILE=1) the per-kernel device time at 8k, and (with GVA=1) grouped value heads (32 value heads beside 16
query/key heads at T = 8k, read in place against repeated q and k). Usage: python experiments/gated_delta_timing.py
TAG (writes $OUT/gdn_TAG.json, or ./gdn_TAG.json)."""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from lazoo import ops

tag = sys.argv[1]
out = {"tag": tag}
H, D = 16, 128
dev = "cuda"

def make(B, T, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, generator=g).to(dtype)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    gg = F.logsigmoid(torch.randn(B, T, H, device=dev, generator=g) + 4).to(dtype)
    return dict(q=q, k=k, v=v, g=gg, beta=beta)

def run(x):
    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=False, backend="triton")[0]

for B, T in ((32, 1024), (4, 8192), (1, 32768)):
    x = make(B, T, torch.bfloat16)
    fwd = triton.testing.do_bench(lambda: run(x), warmup=25, rep=100, return_mode="median")
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    def fb():
        o = run(xs)
        torch.autograd.grad(o, list(xs.values()), do)
    fb_ms = triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")
    out[f"T{T}"] = {"fwd": fwd, "fwdbwd": fb_ms}
    print(tag, T, f"fwd {fwd:.3f} fwd+bwd {fb_ms:.3f}", flush=True)

# accuracy vs float64 chunk reference at T=1000, B=2
x = make(2, 1000, torch.bfloat16, seed=1)
xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
o = run(xs)
do = torch.randn_like(o)
gr = torch.autograd.grad(o, list(xs.values()), do)
x64 = {n: t.double().requires_grad_(True) for n, t in x.items()}
o64 = ops.gated_delta_rule(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], use_qk_l2norm=False, backend="chunk")[0]
gr64 = torch.autograd.grad(o64, list(x64.values()), do.double())
def rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())



out["err"] = {"o": rel(o, o64), **{n: rel(a, b) for n, a, b in zip(xs, gr, gr64)}}
print(tag, "rel err", {k: f"{v:.2e}" for k, v in out["err"].items()}, flush=True)

if os.environ.get("PROFILE"):
    x = make(4, 8192, torch.bfloat16)
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    do = torch.randn(4, 8192, H, D, device=dev, dtype=torch.bfloat16)
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        torch.autograd.grad(run(xs), list(xs.values()), do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            torch.autograd.grad(run(xs), list(xs.values()), do)
        torch.cuda.synchronize()
    rows = {}
    for e in p.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
            rows[e.key] = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 5 / 1000
    top = sorted(rows.items(), key=lambda kv: -kv[1])[:14]
    out["profile_8k_ms"] = top
    for k, v in top:
        print(tag, f"  {v:.3f} ms  {k[:80]}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"gdn_{tag}.json"), "w"), indent=1)

if os.environ.get("GVA"):
    # grouped value heads (Qwen3.5's layout, twice as many value heads): H = 16 query/key heads, 32 value heads, T = 8k,
    # B = 4; read in place against q and k repeated to 32 heads, fwd and fwd + bwd
    B, T, HV = 4, 8192, 2 * H
    gen = torch.Generator(device=dev).manual_seed(5)
    q = F.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device=dev, generator=gen).bfloat16()
    beta = torch.rand(B, T, HV, device=dev, generator=gen)
    gg = F.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen) + 4)
    do = torch.randn(B, T, HV, D, device=dev, dtype=torch.bfloat16)
    for name, rep in (("grouped", False), ("repeated", True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gg, beta)]

        def fwd(leaves=leaves, rep=rep):
            qq, kk = ((t.repeat_interleave(2, 2) for t in leaves[:2]) if rep else leaves[:2])
            return ops.gated_delta_rule(qq, kk, *leaves[2:], use_qk_l2norm=False, backend="triton")[0]

        f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
        fb = triton.testing.do_bench(lambda: torch.autograd.grad(fwd(), leaves, do), warmup=25, rep=100,
                                     return_mode="median")
        out[f"gva_{name}"] = {"fwd": f, "fwdbwd": fb}
        print(tag, f"HV = 2H, T 8192, {name}: fwd {f:.3f} fwd+bwd {fb:.3f}", flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"gdn_{tag}.json"), "w"), indent=1)
