"""The gated delta rule against FlashQLA and fla, and the delta rule against fla, on a Gated DeltaNet layer's inputs.

Measured in the same run on the same inputs: lazoo's ``gated_delta_rule`` beside FlashQLA's
(``flash_qla.chunk_gated_delta_rule``, TileLang kernels) and fla's
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``), and lazoo's ``delta_rule`` beside fla's.

The inputs are those of a Gated DeltaNet layer: raw q and k (L2-normalised inside each op), v, β in q's dtype, the
log decay g in float32 (what the layers compute from ``A_log`` and ``dt_bias``), H query/key heads and HV value heads
(HV = H, or HV = 2H as Qwen3.5 and Qwen3-Next have them), D = 128, B·T = 32k tokens. Each row: forward and
forward + backward medians (``triton.testing.do_bench``), the error of the output against a float64 evaluation of
the same inputs (max |o − o₆₄| / max |o₆₄|, at the row's shape), the rates and the fraction of the card's roofline
(``lazoo.bench.roofline``), and the time over the fastest anchor's.

    python -m lazoo.bench.delta_frontier --out frontier.jsonl

Then one decode step per ``--decode`` shape B:H:HV (default 32:16:32, Qwen3-Next's layer at batch 32): lazoo's op
on one token against a float32 state beside fla's ``fused_recurrent_gated_delta_rule``, µs a step replayed from a
CUDA graph, with the share of the copy bandwidth that reading and writing the state takes. (vLLM publishes 13.6 µs
for its kernel at these shapes on an H200, with its state in the model's dtype: half these bytes.) The decode rows
alone: ``--ops '' --decode 32:16:32``.

FlashQLA and fla are optional: a missing one gives rows with its import error. Neither is a dependency of lazoo.
FlashQLA's TileLang kernels compile at the first call of each shape (about 2.5 minutes for its forward and backward
on an H200 with 16 cores) and are cached: ``--shapes`` runs a few at a time; ``--triton-cache DIR`` keeps fla's
autotuning, Triton's kernels and TileLang's (in DIR/tilelang, unless ``TILELANG_CACHE_DIR`` says otherwise) in DIR
for the next run, which may be on another machine of the same card and versions (copy DIR there).
"""

from __future__ import annotations

import importlib
import os
import time

import torch
import torch.nn.functional as F

from .delta_ops import delta_flops
from .report import JsonRows, command_line, error_text, gpu_environment, installed_versions
from .roofline import add_rates, card_ceilings, roofline
from .timing import require_cuda, time_fwd_bwd, use_triton_cache

D = 128
#: (T, B, H, HV): B·T = 32k tokens
SHAPES = [(1024, 32, 16, 16), (8192, 4, 16, 16), (32768, 1, 16, 16), (8192, 4, 16, 32)]


def make_inputs(T, B, H, HV, dtype, device, seed=0) -> dict:
    """Raw q, k ``[B, T, H, D]``, v ``[B, T, HV, D]`` and β ``[B, T, HV]`` in ``dtype``; g ``[B, T, HV]`` float32,
    most decays near 0.98 (``logsigmoid`` of N(4, 1))."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, device=device, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, D, device=device, generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, device=device, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device=device, generator=gen) + 4)
    return {"q": q, "k": k, "v": v, "beta": beta, "g": g}


def lazoo_op(gated: bool):
    """lazoo's Triton (gated) delta rule as a callable of the inputs (``make_inputs``) returning the output."""
    from lazoo import ops

    scale = D ** -0.5
    if gated:
        return lambda x: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                              backend="triton")[0]
    return lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], scale=scale, backend="triton")[0]


def implementations(gated: bool) -> dict:
    """impl name -> (callable of the inputs returning the output, or the error text of its import)."""
    scale = D ** -0.5
    impls = {"lazoo": lazoo_op(gated)}
    if gated:
        try:
            flash_qla = importlib.import_module("flash_qla")
            impls["flashqla"] = lambda x: flash_qla.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, use_qk_l2norm_in_kernel=True)[0]
        except Exception as e:  # noqa: BLE001 - not installed, or tilelang refuses this machine
            impls["flashqla"] = error_text(e)
    try:
        if gated:
            fn = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
            impls["fla"] = lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                        use_qk_l2norm_in_kernel=True)[0]
        else:
            fn = importlib.import_module("fla.ops.delta_rule").chunk_delta_rule
            impls["fla"] = lambda x: fn(x["q"], x["k"], x["v"], x["beta"], scale=scale,
                                        use_qk_l2norm_in_kernel=True)[0]
    except Exception as e:  # noqa: BLE001
        impls["fla"] = error_text(e)
    return impls


def reference(x: dict, gated: bool) -> torch.Tensor:
    """The output in float64 (lazoo's chunked PyTorch form, checked against the token loop by the op tests)."""
    from lazoo import ops

    x64 = {n: t.double() for n, t in x.items()}
    if gated:
        return ops.gated_delta_rule(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], scale=D ** -0.5,
                                    backend="chunk")[0]
    return ops.delta_rule(x64["q"], x64["k"], x64["v"], x64["beta"], scale=D ** -0.5, backend="chunk")[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def io_bytes(T, B, H, HV, dtype) -> tuple[int, int]:
    """Bytes each input and output is read or written once: forward (q, k, v, β, g, o), forward + backward (that,
    dO read and the five gradients written)."""
    e = torch.finfo(dtype).bits // 8
    tensors = B * T * (2 * H * D * e + 2 * HV * D * e + HV * (e + 4))
    return tensors, 2 * tensors + B * T * HV * D * e


def bench_shape(op, gated, impls, T, B, H, HV, dtype, device, ceilings) -> list[dict]:
    x = make_inputs(T, B, H, HV, dtype, device)
    ref = reference(x, gated)
    grads = ("q", "k", "v", "beta") + (("g",) if gated else ())
    rows = []
    for impl, fn in impls.items():
        row = {"op": op, "impl": impl, "T": T, "B": B, "H": H, "HV": HV, "D": D}
        if isinstance(fn, str):
            rows.append({**row, "error": fn})
            continue
        try:
            with torch.no_grad():
                row["max_rel_err_vs_f64"] = relative_error(fn(x), ref)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the table
            rows.append({**row, "error": error_text(e)})
            continue
        start = time.perf_counter()
        row["fwd_ms"], row["fwd_bwd_ms"], row["error"] = time_fwd_bwd(fn, x, grads)
        row["first_call_and_timing_s"] = time.perf_counter() - start
        fwd, bwd = delta_flops(D)
        add_rates(row, (fwd * B * T * HV, bwd * B * T * HV), *io_bytes(T, B, H, HV, dtype))
        roofline(row, ceilings)
        rows.append(row)
    anchors = [r for r in rows if r["impl"] != "lazoo"]
    for key in ("fwd_ms", "fwd_bwd_ms"):
        best = min((r[key] for r in anchors if r.get(key)), default=None)
        for r in rows:
            if r["impl"] == "lazoo" and best and r.get(key):
                r[f"{key}_over_best_anchor"] = r[key] / best
    return rows


#: (B, H, HV) of the decode rows: Qwen3-Next's layer (16 key heads, 32 value heads of 128) at batch 32
DECODE_SHAPES = [(32, 16, 32)]


def decode_shapes(text: str | None) -> list[tuple[int, int, int]]:
    """``--decode``: None -> DECODE_SHAPES, "" -> none, else comma-separated B:H:HV."""
    if text is None:
        return DECODE_SHAPES
    return [tuple(int(n) for n in item.split(":")) for item in text.split(",") if item.strip()]


def decode_implementations() -> dict:
    """impl name -> (callable of the one-token inputs and state returning (o, new state)), or its import error."""
    from lazoo import ops

    scale = D ** -0.5
    impls = {"lazoo": lambda x: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                                     initial_state=x["S"], output_final_state=True,
                                                     backend="triton")}
    try:
        fn = importlib.import_module("fla.ops.gated_delta_rule").fused_recurrent_gated_delta_rule
        # fla's state is [B, HV, dk, dv], lazoo's [B, HV, dv, dk]: the same values, transposed
        impls["fla"] = lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                    initial_state=x["S"].transpose(-1, -2).contiguous(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    except Exception as e:  # noqa: BLE001
        impls["fla"] = error_text(e)
    return impls


def bench_decode(impls, B, H, HV, dtype, device, ceilings) -> list[dict]:
    """One token against a float32 state per (sample, value head) of D × D: µs per step replayed from a CUDA graph,
    the output's error against float64, and the share of the copy bandwidth that reading and writing the state
    takes (the step's floor: the state is most of its bytes)."""
    from .timing import cuda_graph_ms

    x = make_inputs(1, B, H, HV, dtype, device, seed=1)
    x["S"] = torch.randn(B, HV, D, D, device=device, generator=torch.Generator(device=device).manual_seed(2)) * 0.1
    ref = reference_step(x)
    state_bytes = 2 * x["S"].numel() * 4
    rows = []
    for impl, fn in impls.items():
        row = {"op": "gated_delta_rule decode", "impl": impl, "T": 1, "B": B, "H": H, "HV": HV, "D": D}
        if isinstance(fn, str):
            rows.append({**row, "error": fn})
            continue
        try:
            with torch.no_grad():
                row["max_rel_err_vs_f64"] = relative_error(fn(x)[0], ref)
                row["step_us"] = cuda_graph_ms(lambda: fn(x)) * 1e3
        except Exception as e:  # noqa: BLE001
            rows.append({**row, "error": error_text(e)})
            continue
        row["state_GBps"] = state_bytes / row["step_us"] / 1e3
        row["state_share_of_copy_bandwidth"] = row["state_GBps"] / ceilings["copy_GBps"]
        rows.append(row)
    return rows


def reference_step(x: dict) -> torch.Tensor:
    """The one-token output in float64 (lazoo's per-token PyTorch form)."""
    from lazoo import ops

    x64 = {n: t.double() for n, t in x.items()}
    return ops.gated_delta_rule(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], scale=D ** -0.5,
                                initial_state=x64["S"], backend="recurrent")[0]


def print_table(rows: list[dict]) -> None:
    def cell(value, fmt):
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    print(f"{'op':18s} {'impl':9s} {'T':>6s} {'B':>3s} {'H/HV':>6s} {'fwd ms':>8s} {'f+b ms':>8s} {'err':>9s} "
          f"{'roof':>5s} {'f+b/best':>8s}")
    for r in rows:
        print(f"{r['op']:18s} {r['impl']:9s} {r['T']:6d} {r['B']:3d} {r['H']:>2d}/{r['HV']:<3d} "
              f"{cell(r.get('fwd_ms'), '.3f'):>8s} {cell(r.get('fwd_bwd_ms'), '.3f'):>8s} "
              f"{cell(r.get('max_rel_err_vs_f64'), '.2e'):>9s} {cell(r.get('roofline_frac'), '.0%'):>5s} "
              f"{cell(r.get('fwd_bwd_ms_over_best_anchor'), '.2f'):>8s}"
              + (f"  {r['error'][:90]}" if r.get("error") else ""))


def use_kernel_caches(path) -> dict:
    """Keep Triton's kernels and autotuning choices in ``path`` and TileLang's compiled kernels in ``path``/tilelang
    (unless ``TILELANG_CACHE_DIR`` is set): call before FlashQLA first imports TileLang, which reads it then."""
    cache = use_triton_cache(path)
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(cache["dir"], "tilelang"))
    return {**cache, "tilelang": os.environ["TILELANG_CACHE_DIR"]}


def main(argv=None) -> None:
    from lazoo_cli.bench import bench_parser

    args = bench_parser("delta_frontier", prog="python -m lazoo.bench.delta_frontier").parse_args(argv)
    require_cuda("delta_frontier")
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")]
    device, dtype = torch.device("cuda"), torch.bfloat16
    triton_cache = use_kernel_caches(args.triton_cache) if args.triton_cache else None
    env = {**gpu_environment(), **installed_versions("flash-qla", "flash-linear-attention", "fla-core", "tilelang"),
           "command": command_line("delta_frontier", argv), "triton_cache": triton_cache,
           "ceilings": card_ceilings(device)}
    with JsonRows(args.out) as rows:
        rows.record({"env": env})
        for op in [o for o in args.ops.split(",") if o.strip()]:  # --ops '': the decode rows alone
            gated = op == "gated_delta_rule"
            impls = implementations(gated)
            for T, B, H, HV in shapes:
                if HV != H and not gated:
                    continue
                for row in bench_shape(op, gated, impls, T, B, H, HV, dtype, device, env["ceilings"]):
                    rows.record(row)
        decode = decode_shapes(args.decode)
        impls = decode_implementations() if decode else {}
        for B, H, HV in decode:
            for row in bench_decode(impls, B, H, HV, dtype, device, env["ceilings"]):
                rows.record(row)
    print_table([r for r in rows[1:] if r["T"] > 1])
    for r in rows[1:]:
        if r["T"] == 1:
            print(f"decode B={r['B']} H/HV={r['H']}/{r['HV']} {r['impl']:6s} "
                  + (f"{r['step_us']:.2f} µs a step, error {r['max_rel_err_vs_f64']:.2e}, state at "
                     f"{r['state_share_of_copy_bandwidth']:.0%} of the copy bandwidth" if r.get("step_us")
                     else str(r.get("error"))[:120]))


if __name__ == "__main__":
    main()
