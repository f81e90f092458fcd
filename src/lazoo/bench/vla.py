"""VLA latency on a CUDA GPU: forward and forward+backward vs T, beside DeltaNet, Gated DeltaNet and SDPA.

Rows (bf16, H = 16, d = 128, median ms by triton.testing.do_bench):
  * B = 1, T from 1k to 32k (``--lengths``): VLA through Triton (the A scan kernel + the
    generalised delta rule kernel), the scan alone, DeltaNet / Gated DeltaNet kernels and causal SDPA;
    the PyTorch chunk form (Woodbury + WY, what CPUs run) up to ``--torch-max-t``; the crossover T
    where VLA's forward+backward gets below SDPA's.
  * 32k tokens per batch (T = 1k, 8k, 32k): VLA vs Gated DeltaNet (the "within 2x" target).
  * the per-token PyTorch loop (Algorithm 1, ``backend="recurrent"``) once at B = 4, T = 4096, forward
    only, against the Triton forward at the same shape.
  * decoding: one token against a state (B = 8), the whole op (A scan + fused recurrent S update,
    CUDA-graph replays when capture works, else plain launches), beside Gated DeltaNet's.

    python -m lazoo.bench.vla --out vla.json --plot vla.png
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from lazoo_cli.bench import bench_parser

from .inputs import causal_sdpa, head_decay
from .report import command_line, error_text, fmt, gpu_environment, write_json
from .timing import call_ms, cuda_graph_ms, median_ms, require_cuda, time_fwd_bwd

H, D = 16, 128


def make(B, T, dtype, gen, device="cuda"):
    q, k, u, v = (torch.randn(B, T, H, D, dtype=dtype, device=device, generator=gen) for _ in range(4))
    beta = torch.rand(B, T, H, device=device, generator=gen).to(dtype)
    g = head_decay(B, T, H, dtype, device, gen)
    return {"q": q, "k": k, "v": v, "u": u, "beta": beta, "g": g}


def impls():
    from lazoo import ops
    from lazoo.kernels.vla.token import vla_scan

    def scan_only(x):
        kf = F.elu(x["k"].float()) + 1
        k_hat = kf / kf.norm(dim=-1, keepdim=True)
        u_hat = F.normalize(x["u"].float(), dim=-1) / D ** 0.5
        B, T = x["q"].shape[:2]
        flags = torch.zeros(B, T, device=x["q"].device)
        flags[:, 19::20] = 1
        A0 = torch.eye(D, device=x["q"].device).repeat(B, H, 1, 1) * 10
        return vla_scan(k_hat, u_hat, flags, A0, eta=1e-3)[0]

    return {
        "vla_triton": (lambda x: ops.vla(x["q"], x["k"], x["v"], x["u"], backend="triton")[0], "qkvu"),
        "vla_scan_kernel": (scan_only, "ku"),
        "vla_torch_chunk": (lambda x: ops.vla(x["q"], x["k"], x["v"], x["u"], backend="chunk")[0], "qkvu"),
        "delta_net": (lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], backend="triton")[0], "qkv"),
        "gated_delta_net": (lambda x: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                           backend="triton")[0], "qkv"),
        "sdpa": (lambda x: causal_sdpa(x["q"], x["k"], x["v"]), "qkv"),
    }


def timed_row(fn, grads, x, **row) -> dict:
    """``row`` with the forward and forward+backward ms of ``fn(x)`` (and ``error`` where it failed)."""
    f, b, err = time_fwd_bwd(fn, x, tuple(grads))
    row.update(fwd_ms=f, fwd_bwd_ms=b)
    if err:
        row["error"] = err
    return row


def main(argv=None):
    args = bench_parser("vla").parse_args(argv)
    require_cuda("vla")
    dtype = torch.bfloat16
    env = {**gpu_environment(), "dtype": str(dtype), "H": H, "D": D, "command": command_line("vla", argv)}
    print(json.dumps(env), flush=True)
    table = impls()
    result = {"env": env, "by_length": [], "tokens_32k": [], "loop": None, "decode": None}

    def save():
        write_json(args.out, result)

    result["decode"] = bench_decode(dtype)
    print("decode", result["decode"], flush=True)
    save()
    if args.decode_only:
        return

    for T in map(int, args.lengths.split(",")):
        x = make(1, T, dtype, torch.Generator(device="cuda").manual_seed(0))
        for name, (fn, grads) in table.items():
            if name == "vla_torch_chunk" and T > args.torch_max_t:
                continue
            result["by_length"].append(timed_row(fn, grads, x, impl=name, B=1, T=T))
            print("progress", result["by_length"][-1], flush=True)
        save()
    for T in (1024, 8192, 32768):
        B = 32768 // T
        x = make(B, T, dtype, torch.Generator(device="cuda").manual_seed(1))
        for name in ("vla_triton", "gated_delta_net", "delta_net"):
            fn, grads = table[name]
            result["tokens_32k"].append(timed_row(fn, grads, x, impl=name, B=B, T=T))
            print("progress", result["tokens_32k"][-1], flush=True)
        save()
    if not args.no_loop:
        result["loop"] = loop_row(table["vla_triton"][0], dtype)
        print("progress", result["loop"], flush=True)
    save()
    report(result)
    if args.plot:
        plot(result, args.plot)


def loop_row(triton_fn, dtype) -> dict:
    """The per-token PyTorch loop's forward (one call, timed once) against the Triton forward, B = 4, T = 4096."""
    from lazoo import ops

    x = make(4, 4096, dtype, torch.Generator(device="cuda").manual_seed(2))
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ops.vla(x["q"], x["k"], x["v"], x["u"], backend="recurrent")
        torch.cuda.synchronize()
        loop_ms = (time.perf_counter() - t0) * 1e3
    tri_ms = call_ms(lambda: triton_fn(x))
    return {"B": 4, "T": 4096, "per_token_loop_fwd_ms": loop_ms, "triton_fwd_ms": tri_ms, "speedup": loop_ms / tri_ms}


def bench_decode(dtype, B=8):
    """ms per decoded token (one token against a state) for VLA and Gated DeltaNet."""
    from lazoo import ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = make(B, 1, dtype, gen)
    M = torch.randn(B, H, D, D, device="cuda", generator=gen)
    state = {"S": torch.randn(B, H, D, D, device="cuda", generator=gen),
             "A": torch.eye(D, device="cuda") * 10 + M @ M.transpose(-1, -2) / D,
             "z": torch.rand(B, H, D, device="cuda", generator=gen), "t": torch.full((B,), 5, device="cuda")}
    S = state["S"].clone()
    fns = {"vla": lambda: ops.vla(x["q"], x["k"], x["v"], x["u"], initial_state=state, output_final_state=True),
           "gated_delta_net": lambda: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                           initial_state=S, output_final_state=True)}
    out = {"B": B}
    with torch.no_grad():
        for name, fn in fns.items():
            try:
                out[f"{name}_graph_ms"] = cuda_graph_ms(fn)
            except Exception as e:  # capture needs no host syncs
                out[f"{name}_graph_error"] = error_text(e, limit=120)
            out[f"{name}_ms"] = median_ms(fn)
    return out


def crossover(rows):
    """The smallest T from which VLA (Triton) forward+backward stays below SDPA's."""
    get = lambda impl: {r["T"]: r["fwd_bwd_ms"] for r in rows if r["impl"] == impl}  # noqa: E731
    vla, sdpa = get("vla_triton"), get("sdpa")
    Ts = sorted(set(vla) & set(sdpa))
    for i, T in enumerate(Ts):
        if all(vla[t] < sdpa[t] for t in Ts[i:]):
            return T
    return None


def report(result):
    print(f"\n{'impl':18s} {'B':>3s} {'T':>6s} {'fwd ms':>9s} {'f+b ms':>9s}")
    for r in result["by_length"] + result["tokens_32k"]:
        print(f"{r['impl']:18s} {r['B']:3d} {r['T']:6d} {fmt(r['fwd_ms'], '.3f'):>9s}"
              f" {fmt(r['fwd_bwd_ms'], '.3f'):>9s}")
    print("crossover with SDPA (fwd+bwd, B=1):", crossover(result["by_length"]))
    if result["loop"]:
        print("per-token loop vs Triton (fwd, B=4, T=4096):", result["loop"])


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwd_bwd_ms", "forward+backward")):
        for impl in dict.fromkeys(r["impl"] for r in result["by_length"]):
            pts = [(r["T"], r[key]) for r in result["by_length"] if r["impl"] == impl and r[key]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="T (B=1, H=16, d=128, bf16)", ylabel="ms", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
