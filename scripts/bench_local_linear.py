"""Benchmark the fused local-linear attention kernel (lazoo.kernels.local_linear) against causal SDPA.

Median milliseconds (triton.testing.do_bench) of the forward and of forward + backward, at a fixed number
of tokens per batch (B = tokens / T), bf16, unit-norm q and k (as the mixer feeds them), a rank-r slope
projection. Prints a table and writes JSON to ``--out``.

    PYTHONPATH=src python scripts/bench_local_linear.py --out bench_local_linear.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F


def make_inputs(B, T, H, D, r, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=device, generator=gen).to(dtype)
    P = torch.randn(r, D, device=device, generator=gen) / D ** 0.5
    scale = torch.full((H,), D ** 0.5, device=device)
    return q, k, v, P, scale


def bench(fn, backward: bool):
    import triton

    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(fn, return_mode="median")

    def step():
        out = fn()
        out.backward(grad)

    out = fn()
    grad = torch.randn_like(out)
    return triton.testing.do_bench(step, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch (B = tokens / T)")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--chunk", action="store_true", help="also time the PyTorch chunk form")
    args = ap.parse_args()

    import triton

    from lazoo.ops import local_linear_attention

    device, dtype = "cuda", torch.bfloat16
    rows = []
    for T in args.seq:
        B = max(1, args.tokens // T)
        q, k, v, P, scale = make_inputs(B, T, args.heads, args.head_dim, args.rank, dtype, device)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        qh, kh, vh = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def sdpa():
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

        def local_linear(backend="triton"):
            return lambda: local_linear_attention(q, k, v, scale=scale, ridge=args.ridge, rank_projection=P,
                                                  backend=backend)[0]

        row = dict(T=T, B=B, H=args.heads, D=args.head_dim, r=args.rank)
        for name, fn in (("sdpa", sdpa), ("local_linear_triton", local_linear())) + (
                (("local_linear_chunk", local_linear("chunk")),) if args.chunk else ()):
            for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                try:
                    row[f"{name}_{mode}_ms"] = bench(fn, backward)
                except torch.OutOfMemoryError:
                    row[f"{name}_{mode}_ms"] = None
                torch.cuda.empty_cache()
        del leaves
        rows.append(row)
        print(" ".join(f"{key}={val:.3f}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()),
              flush=True)

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), dtype="bfloat16", tokens_per_batch=args.tokens,
                ridge=args.ridge, timer="triton.testing.do_bench median",
                sdpa="torch.nn.functional.scaled_dot_product_attention(is_causal=True), [B, H, T, D] layout")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
