"""Kimi Delta Attention on a GPU: lazoo's Triton kernels (lazoo.kernels.kda through ops.kda) against fla's chunk_kda
on the same inputs. fwd and fwd + bwd medians (triton.testing.do_bench) at T = 1k / 8k / 32k with 32k tokens a batch,
H = 16, dk = dv = 128, bf16 q/k/v/β (q and k unit-norm, normalised outside both kernels), a float32 log decay per key
channel shaped as Kimi Linear's (−exp(A_log)·softplus(x + dt_bias), A in [1, 16]); the relative error (Frobenius) of
outputs and every gradient against the float64 chunk form at T = 1000; the decode step (one token against a state,
B = 32) of both. Usage: python experiments/kda_vs_fla.py OUT.json (fla from the path, e.g. PYTHONPATH=$SITE:src)."""
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton

from lazoo import ops
from lazoo.kernels import kda as lk

H, D = 16, 128
dev = "cuda"
out = {"shape": {"H": H, "D": D, "dtype": "bfloat16", "tokens_per_batch": 32768},
       "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
try:
    import fla
    from fla.ops.kda import chunk_kda as fla_chunk
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    out["fla"] = fla.__version__
except Exception as e:  # noqa: BLE001
    fla_chunk = fla_recurrent = None
    out["fla"] = f"not importable: {e!r}"


def make(B, T, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, generator=g).to(dtype)
    A = torch.empty(H, device=dev).uniform_(1, 16, generator=g)
    dt = torch.exp(torch.empty(H, D, device=dev).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    gate = -A[:, None] * F.softplus(torch.randn(B, T, H, D, device=dev, generator=g) + dt_bias)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    return dict(q=q, k=k, v=v, g=gate.float(), beta=beta)


def ours(x):
    return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=False, backend="triton")[0]


def theirs(x):
    return fla_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5)[0]


def timed(fn, x):
    fwd = triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    do = torch.randn_like(x["v"])

    def fb():
        torch.autograd.grad(fn(xs), list(xs.values()), do)
    return {"fwd_ms": fwd, "fwdbwd_ms": triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")}


def rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


for B, T in ((32, 1024), (4, 8192), (1, 32768)):
    x = make(B, T)
    row = {"lazoo": timed(ours, x)}
    if fla_chunk is not None:
        try:
            row["fla"] = timed(theirs, x)
            row["speedup_fwdbwd"] = row["fla"]["fwdbwd_ms"] / row["lazoo"]["fwdbwd_ms"]
        except Exception as e:  # noqa: BLE001
            row["fla"] = f"failed: {e!r}"
    out[f"T{T}"] = row
    print(T, json.dumps(row), flush=True)
    del x
    torch.cuda.empty_cache()

# errors against float64 (the PyTorch chunk form on the GPU), T = 1000, B = 2
x = make(2, 1000, seed=1)
do = torch.randn_like(x["v"])
x64 = {n: t.double().requires_grad_(True) for n, t in x.items()}
o64 = ops.kda(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], use_qk_l2norm=False, backend="chunk",
              chunk_size=16)[0]
g64 = torch.autograd.grad(o64, list(x64.values()), do.double())
out["err"] = {}
for name, fn in (("lazoo", ours), ("fla", theirs if fla_chunk is not None else None)):
    if fn is None:
        continue
    try:
        xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o = fn(xs)
        grads = torch.autograd.grad(o, list(xs.values()), do)
        out["err"][name] = {"o": rel(o, o64), **{n: rel(a, b) for n, a, b in zip(xs, grads, g64)}}
    except Exception as e:  # noqa: BLE001
        out["err"][name] = f"failed: {e!r}"
    print("rel err", name, out["err"][name], flush=True)

# the decode step: one token against a state, B = 32
x = make(32, 1, seed=2)
S0 = torch.randn(32, H, D, D, device=dev) * 0.1
dec = {"lazoo_op_ms": triton.testing.do_bench(lambda: ops.kda(
    x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=False, initial_state=S0, output_final_state=True,
    backend="triton"), return_mode="median"),
    "lazoo_kernel_ms": triton.testing.do_bench(lambda: lk.fused_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, initial_state=S0, output_final_state=True),
        return_mode="median")}
if fla_recurrent is not None:
    S0t = S0.transpose(-1, -2).contiguous()  # fla's state is [N, H, K, V]
    try:
        dec["fla_ms"] = triton.testing.do_bench(lambda: fla_recurrent(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, initial_state=S0t, output_final_state=True),
            return_mode="median")
    except Exception as e:  # noqa: BLE001
        dec["fla_ms"] = f"failed: {e!r}"
out["decode_B32"] = dec
print("decode", dec, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=2)
