"""Same-run comparison used for the benchmark page (normalised kernel, 2026-11-27): the ops against the previous paths,
rebuilt here from the kernels of the tree before b9908e8 (lazoo.kernels.ela is not in later trees). fwd+bwd ms, bf16."""
import json
import os

import torch
import triton

from lazoo import ops
from lazoo.kernels import linear as kl
from lazoo.kernels.ela import ela_prefix

dev = "cuda"
torch.manual_seed(0)

def old_linear_norm(q, k, v, eps=1e-6):
    o, _ = kl.chunk_linear_attention(q, k, v, None, scale=1.0, chunk_size=64)
    z = k.float().cumsum(1)
    den = (q.float() * z).sum(-1, keepdim=True).clamp_min(eps)
    return (o.float() / den).to(v.dtype)

def _linear_operands(kernel, q, k):
    if kernel != "magnitude_direction":
        return q, (2.0 if kernel == "sum_sq_euclid" else -2.0) * k
    qq = torch.linalg.vector_norm(q, dim=-1, keepdim=True, dtype=torch.float32).square()
    kk = torch.linalg.vector_norm(k, dim=-1, keepdim=True, dtype=torch.float32).square()
    return ((qq + 1) * q).to(q.dtype), ((kk + 1) * k).to(k.dtype)

def old_ela(kernel, q, k, v, eps=1e-6):
    q1, k1 = _linear_operands(kernel, q, k)
    om, _ = kl.chunk_linear_attention(q1, k1, v, None, scale=1.0, chunk_size=64)
    o, _, _ = ela_prefix(q, k, v, om, kernel=kernel, eps=eps, mask=None, initial_state=None, output_final_state=False)
    return o

def bench(fn, x):
    def step():
        for t in x.values():
            t.grad = None
        o = fn(x)
        o.backward(g)
    o = fn(x)
    global g
    g = torch.randn_like(o)
    f = triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")
    fb = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return f, fb, o.detach()

rows = []
H, D = 16, 128
for T in [int(x) for x in os.environ.get("LENGTHS", "1024,8192,32768").split(",")]:
    B = 32768 // T
    gen = torch.Generator(device=dev).manual_seed(T)
    q = torch.randn(B, T, H, D, device=dev, generator=gen)
    k = torch.randn(B, T, H, D, device=dev, generator=gen)
    v = torch.randn(B, T, H, D, device=dev, generator=gen).bfloat16()
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1).bfloat16()
    pos = lambda x: (torch.nn.functional.elu(x) + 1).bfloat16()
    cases = {
        "linear (no normaliser)": (
            lambda x: ops.linear_attention(
                x["q"], x["k"], x["v"], feature_map="identity", normalize=False, backend="triton"
            )[0],
            dict(q=q.bfloat16(), k=k.bfloat16(), v=v),
        ),
        "linear normalised, new": (
            lambda x: ops.linear_attention(
                x["q"], x["k"], x["v"], feature_map="identity", normalize=True, backend="triton"
            )[0],
            dict(q=pos(q), k=pos(k), v=v),
        ),
        "linear normalised, old": (lambda x: old_linear_norm(x["q"], x["k"], x["v"]), dict(q=pos(q), k=pos(k), v=v)),
    }
    for kern in ["sum_sq_euclid", "magnitude_direction"]:
        cases[f"ela {kern}, new"] = (
            lambda x, kern=kern: ops.ela(x["q"], x["k"], x["v"], kernel=kern, backend="triton")[0],
            dict(q=unit(q), k=unit(k), v=v),
        )
        cases[f"ela {kern}, old"] = (
            lambda x, kern=kern: old_ela(kern, x["q"], x["k"], x["v"]),
            dict(q=unit(q), k=unit(k), v=v),
        )
    outs = {}
    for name, (fn, x) in cases.items():
        x = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        try:
            f, fb, o = bench(fn, x)
        except Exception as e:
            print(name, T, "FAILED", repr(e)[:300])
            continue
        outs[name] = o
        rows.append(dict(op=name, T=T, B=B, fwd_ms=f, fwd_bwd_ms=fb))
        print(f"{name:34s} T={T:6d}  fwd {f:7.3f}  fwd+bwd {fb:7.3f}", flush=True)
    for base in ["linear normalised", "ela sum_sq_euclid", "ela magnitude_direction"]:
        a, b = outs.get(base + ", new"), outs.get(base + ", old")
        if a is not None and b is not None:
            d = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            print(f"  {base}: new vs old max rel diff {d:.2e}")
            rows.append(dict(op=base, T=T, new_vs_old=d))
out = os.environ.get("OUT", ".")
json.dump(
    dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
    open(f"{out}/bench_norm.json", "w"),
    indent=1,
)
