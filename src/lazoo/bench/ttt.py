"""Benchmark TTT-Linear on a CUDA GPU: lazoo's Triton kernel vs its PyTorch chunk form, beside Gated DeltaNet and fla.

Forward and forward+backward median ms (triton.testing.do_bench) at B·T = 32k tokens, T in {1k, 8k, 32k},
H = 16, D = 128, bf16, mini-batch b = 16 (and b = 1, the delta-rule path) of lazoo's ``ttt_linear`` through its
Triton kernel and its PyTorch chunk (dual) form, beside lazoo's gated delta rule and, when flash-linear-attention
(fla) is installed and has them, fla's TTT-Linear ops. Prints a table, writes JSON (--out).

    python -m lazoo.bench.ttt --out bench_ttt.json

fla's ``chunk_ttt_linear`` / ``fused_chunk_ttt_linear`` put a LayerNorm (and residual) inside the inner model,
so they compute a different function from lazoo's ttt_linear (no LayerNorm): the timings are side by side,
the outputs are not compared.
"""

from __future__ import annotations

import torch

from lazoo_cli.bench import bench_parser

from .inputs import head_decay, unit_qkv
from .report import gpu_environment, write_json
from .timing import require_cuda, time_fwd_bwd

TOKENS = 32 * 1024
H, D = 16, 128
CHUNK_FORM_MAX_T = 8192  # the PyTorch chunk form loops over T/b mini-batches in Python: skipped beyond this


def inputs(B, T, dtype, device, gen):
    x = unit_qkv(B, T, H, D, dtype, device, gen)
    x["eta"] = (0.1 * torch.sigmoid(torch.randn(B, T, H, device=device, generator=gen))).to(dtype)
    x["W0"] = 0.02 * torch.randn(B, H, D, D, device=device, generator=gen)
    x["g"] = head_decay(B, T, H, dtype, device, gen)
    return x


def lazoo_ttt(backend, b):
    from lazoo import ops

    return lambda x: ops.ttt_linear(x["q"], x["k"], x["v"], x["eta"], mini_batch_size=b,
                                    initial_state={"W": x["W0"]}, backend=backend)[0]


def lazoo_gated_delta(x):
    from lazoo import ops

    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["eta"], backend="triton")[0]


def load_fla():
    """fla's TTT-Linear ops (name -> fn(inputs) -> output), or {} and why not."""
    try:
        import fla
        from fla.ops import ttt as fla_ttt
    except Exception as err:
        return {}, f"fla.ops.ttt not importable: {type(err).__name__}: {err}", None
    found = {}
    for name in ("chunk_ttt_linear", "fused_chunk_ttt_linear"):
        fn = getattr(fla_ttt, name, None)
        if fn is None:
            continue

        def call(x, fn=fn):
            Hh, V = x["q"].shape[2], x["v"].shape[-1]
            w = torch.ones(Hh, V, device=x["q"].device, dtype=x["q"].dtype)
            bias = torch.zeros(Hh, V, device=x["q"].device, dtype=x["q"].dtype)
            out = fn(x["q"], x["k"], x["v"], w, bias, x["eta"][..., None], scale=1.0, chunk_size=16,
                     initial_state=x["W0"].transpose(-1, -2).contiguous())
            return out[0] if isinstance(out, tuple) else out

        found[f"fla {name} (LN in f)"] = call
    return found, None, getattr(fla, "__version__", "?")


def main(argv=None):
    args = bench_parser("ttt").parse_args(argv)
    require_cuda("ttt")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    fla_ops, fla_why, fla_version = load_fla()
    if fla_why:
        print(fla_why)
    cands = {"lazoo ttt_linear triton b=16": (lazoo_ttt("triton", 16), ["q", "k", "v", "eta", "W0"]),
             "lazoo ttt_linear triton b=1 (delta rule)": (lazoo_ttt("triton", 1), ["q", "k", "v", "eta", "W0"]),
             "lazoo ttt_linear chunk (PyTorch) b=16": (lazoo_ttt("chunk", 16), ["q", "k", "v", "eta", "W0"]),
             "lazoo gated_delta_rule triton": (lazoo_gated_delta, ["q", "k", "v", "g", "eta"])}
    cands.update({n: (fn, ["q", "k", "v", "eta"]) for n, fn in fla_ops.items()})
    rows = []
    for T in args.lengths:
        B = max(1, TOKENS // T)
        gen = torch.Generator(device=dev).manual_seed(0)
        x = inputs(B, T, dtype, dev, gen)
        for name, (fn, grads) in cands.items():
            if "chunk (PyTorch)" in name and (args.no_chunk or T > CHUNK_FORM_MAX_T):
                rows.append({"op": name, "B": B, "T": T, "fwd_ms": None, "fwd_bwd_ms": None, "error": "skipped"})
                continue
            fwd, both, err = time_fwd_bwd(fn, x, grads)
            rows.append({"op": name, "B": B, "T": T, "fwd_ms": fwd, "fwd_bwd_ms": both, "error": err})
            f = "-" if fwd is None else f"{fwd:8.2f}"
            bb = "-" if both is None else f"{both:8.2f}"
            print(f"T={T:6d} B={B:3d} {name:44s} fwd {f:>8s} ms  fwd+bwd {bb:>8s} ms  {err or ''}", flush=True)
            torch.cuda.empty_cache()
    # accuracy of the kernel at one shape, against the float64 chunk form
    gen = torch.Generator(device=dev).manual_seed(1)
    x = inputs(1, 2048, dtype, dev, gen)
    o = lazoo_ttt("triton", 16)(x)
    x64 = {n: t.double() for n, t in x.items()}
    r = lazoo_ttt("chunk", 16)(x64)
    acc = ((o.double() - r).abs().max() / r.abs().max()).item()
    print(f"ttt_linear triton b=16 bf16 output rel err vs float64 (T=2048): {acc:.2e}")
    meta = {**gpu_environment(), "fla": fla_version, "fla_note": fla_why, "dtype": "bfloat16",
            "H": H, "D": D, "tokens": TOKENS, "bf16_rel_err_T2048": acc}
    if args.out:
        write_json(args.out, {"meta": meta, "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
