"""Benchmark the fused local-linear attention kernel (lazoo.kernels.local_linear) against causal SDPA.

Median milliseconds (triton.testing.do_bench) of the forward and of forward + backward, at a fixed number
of tokens per batch (B = tokens / T), bf16, unit-norm q and k (as the mixer feeds them), a rank-r slope
projection. Prints a table and writes JSON to ``--out``.

    python -m lazoo.bench.local_linear --out bench_local_linear.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lazoo_cli.bench import bench_parser

from .inputs import unit_qkv
from .report import gpu_environment, write_json
from .timing import call_ms, require_cuda


def make_inputs(B, T, H, D, r, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = unit_qkv(B, T, H, D, dtype, device, gen)
    P = torch.randn(r, D, device=device, generator=gen) / D ** 0.5
    scale = torch.full((H,), D ** 0.5, device=device)
    return x["q"], x["k"], x["v"], P, scale


def main(argv=None):
    args = bench_parser("local_linear").parse_args(argv)
    require_cuda("local_linear")
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
                try:  # (no leaves cleared: q, k, v's gradients accumulate step to step, as in the recorded rows)
                    row[f"{name}_{mode}_ms"] = call_ms(fn, backward)
                except torch.OutOfMemoryError:
                    row[f"{name}_{mode}_ms"] = None
                torch.cuda.empty_cache()
        del leaves
        rows.append(row)
        print(" ".join(f"{key}={val:.3f}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()),
              flush=True)

    meta = {**gpu_environment(), "dtype": "bfloat16", "tokens_per_batch": args.tokens, "ridge": args.ridge,
            "timer": "triton.testing.do_bench median",
            "sdpa": "torch.nn.functional.scaled_dot_product_attention(is_causal=True), [B, H, T, D] layout"}
    write_json(args.out, {"meta": meta, "rows": rows}, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
