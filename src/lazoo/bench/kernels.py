"""Benchmark lazoo's Triton kernels against SDPA and flash-linear-attention (fla), on a CUDA GPU.

Training: forward and forward+backward median ms (triton.testing.do_bench) at B·T = 32k tokens,
H = 16, D = 128, T in {1k, 8k, 32k}, plus D = 64 and 256 at T = 8k, bf16, for every op of ``kernel_ops``, side by
side with causal ``scaled_dot_product_attention`` and fla where installed and where it has the op.
Decoding: per-token latency (CUDA-graph replays) at B = 8, H = 16, D = 128 against a state, and SDPA
over a KV cache of 1k..64k tokens. Prints a table, writes JSON (--out) and a PNG plot (--plot).

Each row's roofline fraction is measured against the card's ceilings in the same run, and each lazoo row is marked
against the kernel targets (``lazoo.bench.roofline``: fla's speed, ELA against linear attention, the roofline at
32k) where the run has what they compare with.

fla autotunes for minutes on a fresh machine. ``--triton-cache DIR`` keeps Triton's compiled kernels and autotuning
choices (``TRITON_CACHE_AUTOTUNING``) in DIR across runs on one machine, and fla's ops run once at every shape
before any is timed (the warm-up's seconds are in the JSON's env), so fla's rows at every T come from one run.

    python -m lazoo.bench.kernels --out bench.json --plot bench.png

``--variant LABEL:module.ATTR=value[,...]`` (repeatable, ``lazoo.bench.variants``) times lazoo's ops again with
module settings changed, in the same run, as rows of impl ``lazoo:LABEL``.
"""

from __future__ import annotations

import json
import time
import traceback

import torch
import torch.nn.functional as F

from lazoo_cli.bench import bench_parser

from .inputs import causal_sdpa, head_decay
from .kernel_ops import CHUNK, SHAPES, TOKENS, H, io_bytes, kernel_ops, load_fla, qkv, qkv_g
from .report import command_line, fmt, gpu_environment, write_json
from .roofline import add_rates, card_ceilings, mark_targets, roofline
from .timing import OutOfTime, cuda_graph_ms, median_ms, require_cuda, time_budget, time_fwd_bwd, use_triton_cache
from .variants import parse_variant, variant_settings

DECODE_B, DECODE_CONTEXTS = 8, [1024, 8192, 32768, 65536]


def sdpa_fn(x):
    return causal_sdpa(x["q"], x["k"], x["v"])


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def timed_row(name, impl, op, run, x, B, T, D, dtype, ceilings) -> dict:
    """One training row: ``run(x)`` forward and forward + backward, its rates and its roofline."""
    f, b, err = time_fwd_bwd(run, x, op.grads)
    row = {"op": name, "impl": impl, "T": T, "D": D, "B": B, "fwd_ms": f, "fwd_bwd_ms": b, "error": err}
    f_tok, b_tok = op.flops(D)
    tokens_heads = B * T * H
    add_rates(row, (f_tok * tokens_heads, b_tok * tokens_heads), *io_bytes(B, T, H, D, dtype, *op.io))
    roofline(row, ceilings)
    return row


# ----------------------------------------------------------------------------- decoding
def bench_decode(device, dtype, fla=None, D=128):
    """Per-token decode rows at each context length: the linear family, SDPA over a KV cache, and the
    delta-rule family (a fixed-size state: the same at every context length)."""
    from lazoo import ops
    from lazoo.kernels.linear import fused_recurrent_linear_attention

    from .delta_ops import bench_decode_delta

    B = DECODE_B
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    q, k, v = (torch.randn(B, 1, H, D, dtype=dtype, device=device, generator=gen) * D ** -0.5 for _ in range(3))
    g = head_decay(B, 1, H, dtype, device, gen)
    S = torch.randn(B, H, D, D, device=device, generator=gen)
    state_bytes = 2 * S.numel() * 4
    with torch.no_grad():
        for L in DECODE_CONTEXTS:  # ours carries a fixed-size state: timed again at each context
            t_op = cuda_graph_ms(lambda: ops.gated_linear_attention(q, k, v, g, initial_state=S,
                                                                    output_final_state=True, backend="triton"))
            t_lin = cuda_graph_ms(lambda: ops.linear_attention(q, k, v, initial_state={"S": S, "z": S[..., 0, :].abs()},
                                                               output_final_state=True, backend="triton"))
            t_kernel = cuda_graph_ms(lambda: fused_recurrent_linear_attention(
                q, k, v, g.float(), scale=D ** -0.5, initial_state=S, output_final_state=True))
            kc, vc = (torch.randn(B, H, L, D, dtype=dtype, device=device, generator=gen) for _ in range(2))
            qs = q.transpose(1, 2)
            t_sdpa = cuda_graph_ms(lambda: F.scaled_dot_product_attention(qs, kc, vc))
            rows.append({"context": L, "ours_gated_op_ms": t_op, "ours_linear_normalised_op_ms": t_lin,
                         "ours_kernel_ms": t_kernel, "sdpa_kv_cache_ms": t_sdpa,
                         "ours_kernel_GBps": state_bytes / t_kernel / 1e6})
            print("progress", rows[-1], flush=True)
            kc = vc = None  # freed before the next context's cache is made
    delta = bench_decode_delta(device, dtype, fla)
    for r in rows:
        r.update(delta)
    return rows


def breakdown(device, dtype, T, D=128):
    """ms of lazoo's forward (states + outputs) and backward (state grads + dq/dk/dv) launchers."""
    from lazoo.kernels import linear as kl

    B = TOKENS // T
    gen = torch.Generator(device=device).manual_seed(2)
    x = qkv_g(B, T, H, D, dtype, device, gen)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"].float()
    c = kl._Ctx(q, v, None, CHUNK)
    out = {"T": T, "D": D}
    for name, gg in (("linear", None), ("gated", g)):
        o, h, _ = kl._fwd(c, q, k, v, gg, 1.0, None, False)
        do = torch.randn_like(o)
        out[f"{name}_fwd_ms"] = median_ms(lambda: kl._fwd(c, q, k, v, gg, 1.0, None, False))
        out[f"{name}_bwd_ms"] = median_ms(lambda: kl._bwd(c, q, k, v, gg, 1.0, h, do, None, False))
    return out


# ----------------------------------------------------------------------------- fla
def warm_fla(fla, ops_table, shapes, device, dtype) -> float:
    """Run every fla op forward and backward once at every shape (its autotuning happens here, not in the timed
    runs); the seconds it took."""
    start = time.perf_counter()
    for T, D in shapes:
        for op in ops_table.values():
            if op.fla is None:
                continue
            gen = torch.Generator(device=device).manual_seed(0)
            x = {n: t.detach().requires_grad_(n in op.grads) for n, t in
                 op.make(TOKENS // T, T, H, D, dtype, device, gen).items()}
            try:
                op.fla(fla, x).float().sum().backward()
            except Exception:  # noqa: BLE001 - the timed run records the error in its row
                traceback.print_exc(limit=1)
            del x
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fla_rows(fla, ops_table, shapes, rows, device, dtype, ceilings, save) -> None:
    """fla's rows (after lazoo's, whose rows get fla's speed over theirs), with fla's output's distance to ours."""
    for T, D in shapes:
        B = TOKENS // T
        for name, op in ops_table.items():
            if op.fla is None:
                continue
            gen = torch.Generator(device=device).manual_seed(0)
            x = op.make(B, T, H, D, dtype, device, gen)
            frow = timed_row(name, "fla", op, lambda t, op=op: op.fla(fla, t), x, B, T, D, dtype, ceilings)
            if frow["error"] is None:
                with torch.no_grad():
                    frow["rel_err_ours_vs_fla"] = rel_err(op.ours(x), op.fla(fla, x))
                ours = [r for r in rows if r["impl"] == "lazoo" and r["op"] == name and r["T"] == T
                        and r["D"] == D and r["fwd_bwd_ms"]]
                if ours:
                    ours[0]["fla_over_ours_fwd_bwd"] = frow["fwd_bwd_ms"] / ours[0]["fwd_bwd_ms"]
            rows.append(frow)
            print("progress", frow, flush=True)
            save()
            del x


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = bench_parser("kernels").parse_args(argv)
    require_cuda("kernels")
    variants = [parse_variant(v) for v in args.variant]
    triton_cache = use_triton_cache(args.triton_cache) if args.triton_cache else None

    device, dtype = "cuda", torch.bfloat16
    ops_table = kernel_ops()
    if args.ops:
        ops_table = {n: ops_table[n] for n in args.ops.split(",")}
    fla, fla_version = load_fla() if args.fla_budget > 0 else (None, "skipped (--fla-budget 0)")
    env = {**gpu_environment(), "fla": fla_version if fla else None,
           "fla_error": None if fla else fla_version, "dtype": str(dtype), "H": H, "tokens": TOKENS,
           "command": command_line("kernels", argv), "triton_cache": triton_cache, "ceilings": card_ceilings(device)}
    print(json.dumps(env))
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.head_dims:
        shapes = [(T, D) for T, D in shapes if D in {int(d) for d in args.head_dims.split(",")}]
    result = {"env": env, "training": [], "decode": [], "breakdown": []}
    rows = result["training"]

    def save():
        write_json(args.out, result)

    for T, D in shapes:  # ours and SDPA first
        B = TOKENS // T
        gen = torch.Generator(device=device).manual_seed(0)
        if not args.no_sdpa:
            rows.append(sdpa_row(qkv(B, T, H, D, dtype, device, gen), B, T, D))
            print("progress", rows[-1], flush=True)
        for name, op in ops_table.items():
            x = op.make(B, T, H, D, dtype, device, gen)
            for impl, settings in [("lazoo", [])] + [(f"lazoo:{label}", st) for label, st in variants]:
                with variant_settings(settings):
                    row = timed_row(name, impl, op, op.ours, x, B, T, D, dtype, env["ceilings"])
                rows.append(row)
                print("progress", row, flush=True)
            del x
            torch.cuda.empty_cache()
        save()
    result["decode"] = bench_decode(device, dtype, fla)
    save()
    for T in () if args.no_breakdown else (1024, 32768):
        result["breakdown"].append(breakdown(device, dtype, T))
        print("progress", result["breakdown"][-1], flush=True)
    save()

    if fla is not None:  # fla last, under a time budget: its autotuning first, then the timed runs
        try:
            with time_budget(args.fla_budget):
                env["fla_warmup_s"] = warm_fla(fla, ops_table, shapes, device, dtype)
                print("fla warm-up (autotuning) took", round(env["fla_warmup_s"], 1), "s", flush=True)
                save()
                fla_rows(fla, ops_table, shapes, rows, device, dtype, env["ceilings"], save)
        except OutOfTime:
            env["fla_note"] = f"fla runs stopped after the {args.fla_budget:.0f} s budget (autotuning)"
            print(env["fla_note"], flush=True)
        save()

    mark_targets(rows)
    save()
    print_tables(env, result)
    if args.plot:
        plot(rows, result["decode"], args.plot)


def sdpa_row(x, B, T, D) -> dict:
    """Causal SDPA's training row, its TFLOP/s from the causal half of QKᵀ and PV."""
    f, b, err = time_fwd_bwd(sdpa_fn, x, ("q", "k", "v"))
    causal_flops = 4 * B * H * T * T * D / 2
    return {"op": "sdpa_causal", "impl": "torch", "T": T, "D": D, "B": B, "fwd_ms": f, "fwd_bwd_ms": b, "error": err,
            "fwd_TFLOPs": causal_flops / f / 1e9 if f else None,
            "fwd_bwd_TFLOPs": 3.5 * causal_flops / b / 1e9 if b else None}


def print_tables(env, result) -> None:
    rows = result["training"]
    print()
    ceil = env["ceilings"]
    print(f"card: {env['gpu']}; ceilings measured in this run: {ceil['matmul_TFLOPs']:.0f} TFLOP/s (bf16 matrix "
          f"product), {ceil['copy_GBps']:.0f} GB/s (copy)")
    print(f"{'op':24s} {'impl':12s} {'T':>6s} {'D':>4s} {'fwd ms':>8s} {'f+b ms':>8s} {'TFLOP/s f+b':>11s}"
          f" {'GB/s f+b':>9s} {'roofline':>14s}  note")
    for r in sorted(rows, key=lambda r: (r["D"] != 128, r["T"], r["op"], r["impl"])):
        note = r.get("error") or ""
        if "fla_over_ours_fwd_bwd" in r:
            note = f"fla/ours = {r['fla_over_ours_fwd_bwd']:.2f}"
        if "rel_err_ours_vs_fla" in r:
            note = f"max rel diff vs ours {r['rel_err_ours_vs_fla']:.1e}"
        roof = f"{100 * r['roofline_frac']:.0f} % {r['bound']}" if "roofline_frac" in r else "-"
        note = "; ".join([note] * bool(note) + r.get("targets", []))
        print(f"{r['op']:24s} {r['impl']:12s} {r['T']:6d} {r['D']:4d} {fmt(r['fwd_ms'], '.3f'):>8s}"
              f" {fmt(r['fwd_bwd_ms'], '.3f'):>8s} {fmt(r.get('fwd_bwd_TFLOPs'), '.1f'):>11s}"
              f" {fmt(r.get('fwd_bwd_GBps'), '.0f'):>9s} {roof:>14s}  {note}")
    print()
    print(f"decode B={DECODE_B} H={H} D=128 (CUDA graph, ms per token):")
    print(f"{'context':>8s} {'gated op':>9s} {'linear op':>9s} {'kernel':>8s} {'kernel GB/s':>11s} {'SDPA KV':>8s}")
    for r in result["decode"]:
        print(f"{r['context']:8d} {r['ours_gated_op_ms']:9.4f} {r['ours_linear_normalised_op_ms']:9.4f} "
              f"{r['ours_kernel_ms']:8.4f} {r['ours_kernel_GBps']:11.0f} {r['sdpa_kv_cache_ms']:8.4f}")
    print()
    for r in result["breakdown"]:
        print("lazoo launchers, ms:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


def plot(rows, decode, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {}
    for r in rows:
        if r["D"] == 128 and r["fwd_bwd_ms"]:
            series.setdefault(f"{r['op']} ({r['impl']})", []).append((r["T"], r["fwd_bwd_ms"]))
    for label, pts in series.items():
        a1.plot(*zip(*pts), marker="o", label=label)
    a1.set(xscale="log", yscale="log", xlabel="T (B·T = 32k tokens, H=16, D=128, bf16)",
           ylabel="forward+backward ms", title="training")
    a1.legend(fontsize=7)
    ctx = [r["context"] for r in decode]
    for key, label in [("ours_kernel_ms", "lazoo fused recurrent kernel"), ("ours_gated_op_ms", "lazoo gated op"),
                       ("sdpa_kv_cache_ms", "SDPA over KV cache")]:
        a2.plot(ctx, [r[key] for r in decode], marker="o", label=label)
    a2.set(xscale="log", yscale="log", xlabel="context", ylabel="ms per token", title="decoding B=8, H=16, D=128")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
