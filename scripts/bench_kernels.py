"""Benchmark lazoo's Triton kernels against SDPA and flash-linear-attention (fla), on a CUDA GPU.

Training: forward and forward+backward median ms (triton.testing.do_bench) at B·T = 32k tokens,
H = 16, D = 128, T in {1k, 8k, 32k}, plus D = 64 and 256 at T = 8k, bf16, for every op in ``OPS``, side by
side with causal ``scaled_dot_product_attention`` and fla where installed and where it has the op.
Decoding: per-token latency (CUDA-graph replays) at B = 8, H = 16, D = 128 against a state, and SDPA
over a KV cache of 1k..64k tokens. Prints a table, writes JSON (--out) and a PNG plot (--plot).

The roofline: the card's ceilings are measured in the same run (a bf16 8192³ matrix product and a device-to-device
copy); each row's bound is whichever of its FLOPs and its I/O floor (inputs and outputs read or written once) takes
longer at those ceilings, and ``roofline_frac`` is that bound's time over the measured time.

Each lazoo row is marked against the kernel targets (``mark_targets``: fla's speed, ELA against linear attention, the
roofline at 32k) where the run has what they compare with.

fla autotunes for minutes on a fresh machine. ``--triton-cache DIR`` keeps Triton's compiled kernels and autotuning
choices (``TRITON_CACHE_AUTOTUNING``) in DIR across runs on one machine, and fla's ops run once at every shape
before any is timed (the warm-up's seconds are in the JSON's env), so fla's rows at every T come from one run.

    PYTHONPATH=src python scripts/bench_kernels.py --out bench.json --plot bench.png

Adding an op is one entry in ``OPS``: how to make its inputs, how to call it (ours and fla's), and
its FLOP count per token and head.

``--variant LABEL:module.ATTR=value[,...]`` (repeatable) times lazoo's ops again with module settings changed,
in the same run, as rows of impl ``lazoo:LABEL``: alternative kernel forms side by side on one card, e.g.

    --variant bv:lazoo.kernels.normalized.FWD_BV=128
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import platform
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

TOKENS = 32 * 1024
SHAPES = [(1024, 128), (8192, 128), (32768, 128), (8192, 64), (8192, 256)]  # (T, D); B = TOKENS // T
H = 16
DECODE_B, DECODE_CONTEXTS = 8, [1024, 8192, 32768, 65536]
CHUNK = 64


# ----------------------------------------------------------------------------- inputs and FLOPs
def qkv(B, T, H, D, dtype, device, gen):
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype, device=device, generator=gen) for _ in range(3))
    return {"q": q * D ** -0.5, "k": k * D ** -0.5, "v": v}


def qkv_g(B, T, H, D, dtype, device, gen):
    x = qkv(B, T, H, D, dtype, device, gen)
    x["g"] = F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen) + 4).to(dtype)
    return x


def qkv_gk(B, T, H, D, dtype, device, gen):
    x = qkv(B, T, H, D, dtype, device, gen)
    x["g"] = (F.logsigmoid(torch.randn(B, T, H, D, device=device, generator=gen)) / 16).to(dtype)
    return x


def positive_qk(B, T, H, D, dtype, device, gen):
    """elu + 1 features of q, k (the normalised linear attention's default map), formed before the op."""
    x = qkv(B, T, H, D, torch.float32, device, gen)
    return {"q": (F.elu(x["q"]) + 1).to(dtype), "k": (F.elu(x["k"]) + 1).to(dtype), "v": x["v"].to(dtype)}


def unit_qk(B, T, H, D, dtype, device, gen):
    """Unit-norm q, k (RLS / MesaNet take them L2-normalised), a ridge λ = 1 per head and key dim."""
    x = qkv(B, T, H, D, torch.float32, device, gen)
    x = {"q": F.normalize(x["q"], dim=-1).to(dtype), "k": F.normalize(x["k"], dim=-1).to(dtype), "v": x["v"].to(dtype)}
    x["lam"] = torch.ones(H, D, device=device)
    return x


def qkv_householder(B, T, H, D, dtype, device, gen, n=2):
    """DeltaProduct inputs: n keys, values and betas per token ([B, T, H, n, D])."""
    x = qkv(B, T, H, D, dtype, device, gen)
    x["k"], x["v"] = (torch.randn(B, T, H, n, D, dtype=dtype, device=device, generator=gen) for _ in range(2))
    x["beta"] = torch.rand(B, T, H, n, device=device, generator=gen).to(dtype)
    return x


def recurrent_flops(D):
    """A fused recurrent pass with K = V = D: decay, outer product and read-out per token (~5 D²);
    backward: recompute, dq, dS update, dk, dv and its decay (~12 D²)."""
    return 5 * D * D, 12 * D * D


def chunk_flops(D, C=CHUNK):
    """(forward, backward) FLOPs per token and head of the chunked form with K = V = D, as executed
    (full C×C blocks): fwd QKᵀ, PV, QH, KᵀV; bwd dh, Aᵀ, dS, dSᵀ, three C×C products, four K×V."""
    fwd = 2 * C * (D + D) + 4 * D * D
    bwd = 6 * C * (D + D) + 8 * D * D
    return fwd, bwd


def bidirectional_flops(D):
    """The non-causal form's two products per token and head, Σ v ψ(k)ᵀ and S φ(q) (4 D²), and the backward's four."""
    return 4 * D * D, 8 * D * D


def io_bytes(B, T, H, D, dtype, n_fwd, n_bwd):
    """Bytes of the inputs and outputs, each read or written once (the floor, states excluded)."""
    size = B * T * H * D * torch.finfo(dtype).bits // 8
    return n_fwd * size, (n_fwd + n_bwd) * size


@dataclass
class Op:
    make: Callable                      # (B, T, H, D, dtype, device, gen) -> dict of inputs
    ours: Callable                      # inputs -> output tensor
    fla: Callable | None = None         # (fla module namespace, inputs) -> output tensor
    flops: Callable = chunk_flops       # D -> (fwd, bwd) FLOPs per token and head
    io: tuple = (4, 7)                  # tensors read/written by (fwd, bwd), for io_bytes
    grads: tuple = ("q", "k", "v")      # inputs that get gradients
    extra: dict = field(default_factory=dict)


def _ops():
    from _bench_delta import delta_ops  # the delta-rule family's entries live beside this script

    from lazoo import ops

    return {
        **delta_ops(Op),
        "linear_attention": Op(
            make=qkv,
            ours=lambda x: ops.linear_attention(x["q"], x["k"], x["v"], feature_map="identity",
                                                normalize=False, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_linear_attn(x["q"], x["k"], x["v"], scale=1.0, normalize=False)[0],
        ),
        "linear_attention_normalized": Op(  # the normaliser inside the chunks (lazoo.kernels.normalized)
            make=positive_qk,
            ours=lambda x: ops.linear_attention(x["q"], x["k"], x["v"], feature_map="identity",
                                                normalize=True, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_linear_attn(x["q"], x["k"], x["v"], scale=1.0, normalize=True)[0],
        ),
        "gated_linear_attention": Op(
            make=qkv_g,
            ours=lambda x: ops.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], scale=1.0,
                                                      backend="triton")[0],
            fla=lambda fla, x: fla.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=1.0)[0],
            io=(5, 9),
            grads=("q", "k", "v", "g"),
        ),
        # the polynomial kernels: D features in the inputs' dtype and 1-2 fp32 scalar features a token, on the
        # normalised kernel (ops.ela's split form)
        "ela_sum_sq_euclid": Op(
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="sum_sq_euclid", backend="triton")[0],
        ),
        "ela_magnitude_direction": Op(
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="magnitude_direction", backend="triton")[0],
        ),
        "ela_hadamard_exp": Op(  # a running max per feature: a per-feature decay, through gla's kernels
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="hadamard_exp", backend="triton")[0],
            flops=recurrent_flops,
        ),
        # the non-causal forms (vision, Memory Lobe, encoders): every token sees every token, no state
        "linear_attention_bidirectional": Op(
            make=qkv,
            ours=lambda x: ops.bidirectional_linear_attention(x["q"], x["k"], x["v"], feature_map="elu1")[0],
            flops=bidirectional_flops,
        ),
        **{f"ela_{kernel}_bidirectional": Op(
            make=qkv,
            ours=lambda x, kernel=kernel: ops.ela(x["q"], x["k"], x["v"], kernel=kernel, causal=False,
                                                  backend="triton")[0],
            flops=bidirectional_flops,
        ) for kernel in ("sum_sq_euclid", "magnitude_direction", "hadamard_exp")},
        "delta_product": Op(  # two Householder steps per token: the delta rule over 2T steps
            make=qkv_householder,
            ours=lambda x: ops.delta_product(x["q"], x["k"], x["v"], x["beta"], backend="triton")[0],
            flops=lambda D: tuple(2 * f for f in chunk_flops(D)),
            grads=("q", "k", "v", "beta"),
        ),
        "rls": Op(  # exact ridge regression (γ = 1) vs fla's MesaNet (conjugate gradient, 30 iterations)
            make=unit_qk,
            ours=lambda x: ops.rls(x["q"], x["k"], x["v"], lam=x["lam"][:, 0], backend="triton")[0],
            fla=lambda fla, x: fla.chunk_mesa_net(
                x["q"], x["k"], x["v"], torch.zeros(x["q"].shape[:3], device=x["q"].device),
                torch.ones(x["q"].shape[:3], device=x["q"].device), x["lam"])[0],
            flops=recurrent_flops,
        ),
        "gla": Op(  # a gate per key dim: the op's Triton backend runs lazoo.kernels.gla.chunk_gla here
            make=qkv_gk,
            ours=lambda x: ops.gla(x["q"], x["k"], x["v"], x["g"], scale=1.0, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_gla(x["q"], x["k"], x["v"], x["g"], scale=1.0)[0],
            io=(5, 9),
            grads=("q", "k", "v", "g"),
        ),
    }


def load_fla():
    try:
        import fla  # noqa: F401
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # not installed, or it refuses this GPU/Triton
        return None, f"{type(e).__name__}: {e}"
    from _bench_delta import add_fla_delta

    ns = argparse.Namespace(chunk_linear_attn=chunk_linear_attn, chunk_simple_gla=chunk_simple_gla,
                            chunk_gla=chunk_gla, chunk_mesa_net=None)
    try:
        from fla.ops.mesa_net import chunk_mesa_net

        ns.chunk_mesa_net = chunk_mesa_net
    except Exception:  # older fla: no MesaNet
        pass
    return add_fla_delta(ns), getattr(sys.modules["fla"], "__version__", "?")


# ----------------------------------------------------------------------------- timing
def bench(fn, warmup=25, rep=100):
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_fwd_bwd(fn, x, grads):
    """(forward ms, forward+backward ms, error or None)."""
    fwd = None
    try:
        with torch.no_grad():
            fwd = bench(lambda: fn(x))
        leaves = {n: t.detach().requires_grad_(n in grads) for n, t in x.items()}
        o = fn(leaves)
        do = torch.randn_like(o)

        def step():
            for n in grads:
                leaves[n].grad = None
            fn(leaves).backward(do)

        both = bench(step)
        return fwd, both, None
    except Exception as e:
        traceback.print_exc(limit=2)
        return fwd, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def sdpa_fn(x):
    q, k, v = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- decoding
def bench_decode(device, dtype, fla=None, D=128):
    """Per-token decode rows at each context length: the linear family, SDPA over a KV cache, and the
    delta-rule family (a fixed-size state: the same at every context length)."""
    import triton
    from _bench_delta import bench_decode_delta
    from lazoo import ops
    from lazoo.kernels.linear import fused_recurrent_linear_attention

    B = DECODE_B
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    q, k, v = (torch.randn(B, 1, H, D, dtype=dtype, device=device, generator=gen) * D ** -0.5 for _ in range(3))
    g = F.logsigmoid(torch.randn(B, 1, H, device=device, generator=gen) + 4).to(dtype)
    S = torch.randn(B, H, D, D, device=device, generator=gen)
    state_bytes = 2 * S.numel() * 4
    graph = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")  # noqa: E731
    with torch.no_grad():
        for L in DECODE_CONTEXTS:  # ours carries a fixed-size state: timed again at each context
            t_op = graph(lambda: ops.gated_linear_attention(q, k, v, g, initial_state=S, output_final_state=True,
                                                            backend="triton"))
            t_lin = graph(lambda: ops.linear_attention(q, k, v, initial_state={"S": S, "z": S[..., 0, :].abs()},
                                                       output_final_state=True, backend="triton"))
            t_kernel = graph(lambda: fused_recurrent_linear_attention(q, k, v, g.float(), scale=D ** -0.5,
                                                                      initial_state=S, output_final_state=True))
            kc, vc = (torch.randn(B, H, L, D, dtype=dtype, device=device, generator=gen) for _ in range(2))
            qs = q.transpose(1, 2)
            t_sdpa = graph(lambda: F.scaled_dot_product_attention(qs, kc, vc))
            rows.append({"context": L, "ours_gated_op_ms": t_op, "ours_linear_normalised_op_ms": t_lin,
                         "ours_kernel_ms": t_kernel, "sdpa_kv_cache_ms": t_sdpa,
                         "ours_kernel_GBps": state_bytes / t_kernel / 1e6})
            print("progress", rows[-1], flush=True)
            del kc, vc
    delta = bench_decode_delta(device, dtype, fla)
    for r in rows:
        r.update(delta)
    return rows


# ----------------------------------------------------------------------------- main
class _OutOfTime(BaseException):  # not caught by time_fwd_bwd's `except Exception`
    pass


def _alarm(seconds):
    """Raise _OutOfTime after ``seconds`` (fla autotunes dozens of configs per kernel on first use)."""
    import signal

    def handler(signum, frame):
        raise _OutOfTime()

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(int(seconds))


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
        out[f"{name}_fwd_ms"] = bench(lambda: kl._fwd(c, q, k, v, gg, 1.0, None, False))
        out[f"{name}_bwd_ms"] = bench(lambda: kl._bwd(c, q, k, v, gg, 1.0, h, do, None, False))
    return out


def parse_variant(text: str) -> tuple[str, list]:
    """``"LABEL:module.ATTR=value,..."`` -> ``(LABEL, [(module, ATTR, value), ...])``; values are Python literals,
    and each ATTR must exist already (a misspelt setting would otherwise time the default twice)."""
    label, sep, settings = text.partition(":")
    if not sep or not label or not settings:
        raise ValueError(f"--variant {text!r}: expected LABEL:module.ATTR=value[,module.ATTR=value...]")
    parsed = []
    for item in settings.split(","):
        path, eq, value = item.partition("=")
        module_name, dot, attr = path.strip().rpartition(".")
        if not eq or not dot:
            raise ValueError(f"--variant {text!r}: {item!r} is not module.ATTR=value")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"--variant {text!r}: {module_name} has no setting {attr!r}")
        try:
            parsed.append((module, attr, ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--variant {text!r}: {value!r} is not a Python literal") from e
    return label, parsed


@contextlib.contextmanager
def variant_settings(settings: list):
    """Apply a variant's module settings inside the block, then restore the previous values."""
    before = [(module, attr, getattr(module, attr)) for module, attr, _ in settings]
    try:
        for module, attr, value in settings:
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in before:
            setattr(module, attr, value)


def use_triton_cache(path) -> dict:
    """Keep Triton's kernels and autotuning choices in ``path`` (created if missing) from here on; says how many
    files it held already (0: a cold cache, fla will autotune)."""
    import os
    from pathlib import Path

    folder = Path(path).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    return {"dir": str(folder), "files_at_start": sum(1 for p in folder.rglob("*") if p.is_file())}


def card_ceilings(device) -> dict:
    """This card's bf16 matrix-product TFLOP/s (8192³) and device-to-device copy GB/s (1 GiB, bytes read and
    written), medians, measured now."""
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = bench(lambda: a @ b)
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    return {"matmul_TFLOPs": 2 * n ** 3 / matmul_ms / 1e9, "copy_GBps": 2 * src.numel() / copy_ms / 1e6}


def add_rates(row, flops, io_bytes_f, io_bytes_fb):
    """TFLOP/s and GB/s of a row's forward and forward+backward, where it has timings."""
    f, b = row.get("fwd_ms"), row.get("fwd_bwd_ms")
    if f and b:
        row.update(fwd_TFLOPs=flops[0] / f / 1e9, fwd_bwd_TFLOPs=(flops[0] + flops[1]) / b / 1e9,
                   fwd_GBps=io_bytes_f / f / 1e6, fwd_bwd_GBps=io_bytes_fb / b / 1e6)


def roofline(row, ceilings) -> None:
    """``bound`` (compute or memory) and ``roofline_frac`` of a row's forward+backward: achieved / ceiling of the
    bound that takes longer (rows without both rates are left alone)."""
    tf, gb = row.get("fwd_bwd_TFLOPs"), row.get("fwd_bwd_GBps")
    if tf is None or gb is None or not ceilings:
        return
    compute, memory = tf / ceilings["matmul_TFLOPs"], gb / ceilings["copy_GBps"]
    row["bound"] = "compute" if compute >= memory else "memory"
    row["roofline_frac"] = max(compute, memory)


#: the kernel targets: lazoo's fwd + bwd at least this many times faster than fla's (fla's forward where its
#: backward refuses), ELA's ops at most ELA_OVER_LINEAR × lazoo linear attention's time, and every op at
#: ROOFLINE_FRACTION of its roofline bound at ROOFLINE_T
FLA_SPEEDUP = {"linear_attention": 1.25, "gla": 1.1, "delta_rule": 1.1, "gated_delta_rule": 1.1}
ELA_OVER_LINEAR = 1.5
ROOFLINE_FRACTION, ROOFLINE_T = 0.5, 32768


def mark_targets(rows: list) -> None:
    """Add ``targets`` (a list of "what: met" / "what: NOT met") to lazoo's rows where the run has what a target
    compares against (fla's row, lazoo's linear attention at the same shape, the roofline)."""
    def same_shape(r, op, impl):
        return next((x for x in rows if x["op"] == op and x["impl"] == impl and x["T"] == r["T"] and x["D"] == r["D"]),
                    None)

    for r in rows:
        if r["impl"] != "lazoo":
            continue
        marks = []
        fla = same_shape(r, r["op"], "fla")
        if r["op"] in FLA_SPEEDUP and fla is not None:
            want = FLA_SPEEDUP[r["op"]]
            for key, what in (("fwd_bwd_ms", "fwd+bwd"), ("fwd_ms", "fwd")):
                if r.get(key) and fla.get(key):
                    ratio = fla[key] / r[key]
                    marks.append(f"fla/ours {what} {ratio:.2f} >= {want}: {'met' if ratio >= want else 'NOT met'}")
                    break
        linear = same_shape(r, "linear_attention", "lazoo")
        if r["op"].startswith("ela_") and not r["op"].endswith("_bidirectional") and linear is not None \
                and r.get("fwd_bwd_ms") and linear.get("fwd_bwd_ms"):
            ratio = r["fwd_bwd_ms"] / linear["fwd_bwd_ms"]
            met = ratio <= ELA_OVER_LINEAR
            marks.append(f"x linear {ratio:.2f} <= {ELA_OVER_LINEAR}: {'met' if met else 'NOT met'}")
        if r["T"] == ROOFLINE_T and "roofline_frac" in r:
            met = r["roofline_frac"] >= ROOFLINE_FRACTION
            marks.append(f"roofline {100 * r['roofline_frac']:.0f} % >= {100 * ROOFLINE_FRACTION:.0f} %: "
                         f"{'met' if met else 'NOT met'}")
        if marks:
            r["targets"] = marks


def warm_fla(fla, ops_table, shapes, device, dtype) -> float:
    """Run every fla op forward and backward once at every shape (its autotuning happens here, not in the timed
    runs); the seconds it took."""
    import time

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    ap.add_argument("--quick", action="store_true", help="T = 1k only")
    ap.add_argument("--head-dims", default=None, help="comma-separated head dims to keep (default: every shape)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA training rows")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-launcher timings")
    ap.add_argument("--fla-budget", type=float, default=600.0,
                    help="seconds for the fla runs (its first calls autotune for minutes); 0 skips fla")
    ap.add_argument("--triton-cache", default=None,
                    help="a folder for Triton's kernels and autotuning choices, kept across runs on one machine")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:module.ATTR=value[,...]: time lazoo's ops again with these settings (repeatable)")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    triton_cache = use_triton_cache(args.triton_cache) if args.triton_cache else None

    import triton

    device, dtype = "cuda", torch.bfloat16
    ops_table = _ops()
    if args.ops:
        ops_table = {n: ops_table[n] for n in args.ops.split(",")}
    fla, fla_version = load_fla() if args.fla_budget > 0 else (None, "skipped (--fla-budget 0)")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "fla": fla_version if fla else None,
           "fla_error": None if fla else fla_version, "dtype": str(dtype), "H": H, "tokens": TOKENS,
           "command": " ".join(sys.argv), "triton_cache": triton_cache, "ceilings": card_ceilings(device)}
    print(json.dumps(env))
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.head_dims:
        shapes = [(T, D) for T, D in shapes if D in {int(d) for d in args.head_dims.split(",")}]
    result = {"env": env, "training": [], "decode": [], "breakdown": []}
    rows = result["training"]

    def save():
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    for T, D in shapes:  # ours and SDPA first
        B = TOKENS // T
        gen = torch.Generator(device=device).manual_seed(0)
        if not args.no_sdpa:
            base = qkv(B, T, H, D, dtype, device, gen)
            f, b, err = time_fwd_bwd(sdpa_fn, base, ("q", "k", "v"))
            causal_flops = 4 * B * H * T * T * D / 2  # QKᵀ and PV, causal half
            rows.append({"op": "sdpa_causal", "impl": "torch", "T": T, "D": D, "B": B, "fwd_ms": f,
                         "fwd_bwd_ms": b, "error": err, "fwd_TFLOPs": causal_flops / f / 1e9 if f else None,
                         "fwd_bwd_TFLOPs": 3.5 * causal_flops / b / 1e9 if b else None})
            print("progress", rows[-1], flush=True)
            del base
        for name, op in ops_table.items():
            x = op.make(B, T, H, D, dtype, device, gen)
            f_tok, b_tok = op.flops(D)
            n_th = B * T * H
            io_f, io_fb = io_bytes(B, T, H, D, dtype, *op.io)
            for impl, settings in [("lazoo", [])] + [(f"lazoo:{label}", st) for label, st in variants]:
                with variant_settings(settings):
                    f, b, err = time_fwd_bwd(op.ours, x, op.grads)
                row = {"op": name, "impl": impl, "T": T, "D": D, "B": B, "fwd_ms": f, "fwd_bwd_ms": b, "error": err}
                add_rates(row, (f_tok * n_th, b_tok * n_th), io_f, io_fb)
                roofline(row, env["ceilings"])
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
        _alarm(args.fla_budget)
        try:
            env["fla_warmup_s"] = warm_fla(fla, ops_table, shapes, device, dtype)
            print("fla warm-up (autotuning) took", round(env["fla_warmup_s"], 1), "s", flush=True)
            save()
            for T, D in shapes:
                B = TOKENS // T
                for name, op in ops_table.items():
                    if op.fla is None:
                        continue
                    gen = torch.Generator(device=device).manual_seed(0)
                    x = op.make(B, T, H, D, dtype, device, gen)
                    ff, fb, ferr = time_fwd_bwd(lambda t: op.fla(fla, t), x, op.grads)
                    frow = {"op": name, "impl": "fla", "T": T, "D": D, "B": B, "fwd_ms": ff, "fwd_bwd_ms": fb,
                            "error": ferr}
                    f_tok, b_tok = op.flops(D)
                    io_f, io_fb = io_bytes(B, T, H, D, dtype, *op.io)
                    add_rates(frow, (f_tok * B * T * H, b_tok * B * T * H), io_f, io_fb)
                    roofline(frow, env["ceilings"])
                    if ferr is None:
                        with torch.no_grad():
                            frow["rel_err_ours_vs_fla"] = rel_err(op.ours(x), op.fla(fla, x))
                        ours = [r for r in rows if r["impl"] == "lazoo" and r["op"] == name and r["T"] == T
                                and r["D"] == D and r["fwd_bwd_ms"]]
                        if ours:
                            ours[0]["fla_over_ours_fwd_bwd"] = fb / ours[0]["fwd_bwd_ms"]
                    rows.append(frow)
                    print("progress", frow, flush=True)
                    save()
                    del x
        except _OutOfTime:
            env["fla_note"] = f"fla runs stopped after the {args.fla_budget:.0f} s budget (autotuning)"
            print(env["fla_note"], flush=True)
        finally:
            import signal

            signal.alarm(0)
        save()

    mark_targets(rows)
    save()
    print()
    ceil = env["ceilings"]
    print(f"card: {env['gpu']}; ceilings measured in this run: {ceil['matmul_TFLOPs']:.0f} TFLOP/s (bf16 matrix "
          f"product), {ceil['copy_GBps']:.0f} GB/s (copy)")
    print(f"{'op':24s} {'impl':12s} {'T':>6s} {'D':>4s} {'fwd ms':>8s} {'f+b ms':>8s} {'TFLOP/s f+b':>11s}"
          f" {'GB/s f+b':>9s} {'roofline':>14s}  note")
    for r in sorted(rows, key=lambda r: (r["D"] != 128, r["T"], r["op"], r["impl"])):
        fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        note = r.get("error") or ""
        if "fla_over_ours_fwd_bwd" in r:
            note = f"fla/ours = {r['fla_over_ours_fwd_bwd']:.2f}"
        if "rel_err_ours_vs_fla" in r:
            note = f"max rel diff vs ours {r['rel_err_ours_vs_fla']:.1e}"
        roof = f"{100 * r['roofline_frac']:.0f} % {r['bound']}" if "roofline_frac" in r else "-"
        note = "; ".join([note] * bool(note) + r.get("targets", []))
        print(f"{r['op']:24s} {r['impl']:12s} {r['T']:6d} {r['D']:4d} {fmt(r['fwd_ms']):>8s} {fmt(r['fwd_bwd_ms']):>8s}"
              f" {fmt(r.get('fwd_bwd_TFLOPs'), 1):>11s} {fmt(r.get('fwd_bwd_GBps'), 0):>9s} {roof:>14s}  {note}")
    print()
    print(f"decode B={DECODE_B} H={H} D=128 (CUDA graph, ms per token):")
    print(f"{'context':>8s} {'gated op':>9s} {'linear op':>9s} {'kernel':>8s} {'kernel GB/s':>11s} {'SDPA KV':>8s}")
    for r in result["decode"]:
        print(f"{r['context']:8d} {r['ours_gated_op_ms']:9.4f} {r['ours_linear_normalised_op_ms']:9.4f} "
              f"{r['ours_kernel_ms']:8.4f} {r['ours_kernel_GBps']:11.0f} {r['sdpa_kv_cache_ms']:8.4f}")
    print()
    for r in result["breakdown"]:
        print("lazoo launchers, ms:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    if args.plot:
        plot(rows, result["decode"], args.plot)


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
