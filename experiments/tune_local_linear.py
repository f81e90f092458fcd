#!/usr/bin/env python
"""Launch sweep for the local-linear kernels (``lazoo.kernels.local_linear.LAUNCH``) on a GPU.

Each kernel (the forward's statistics and outputs, the backward prep without moments (r ≤ 8) or with them,
key-block dk/dv/df, dq) is tried under a few block sizes and pipeline depths while the others keep their
launch (a prep that the rank does not use shows no change); a candidate counts only if its outputs and
gradients stay within 2e-2 (relative) of the current launch's and are finite, and it replaces the current one
when fwd+bwd is at least 2 % faster. Prints the profile of the starting launches, every candidate, the chosen
table and SDPA's fwd+bwd on the same case; writes them to --out.

    PYTHONPATH=src python experiments/tune_local_linear.py --out tune_local_linear.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from lazoo.bench.local_linear import make_inputs  # the benchmark's inputs: unit q, k, P, β = √d
from lazoo.kernels import local_linear as kernel
from lazoo.ops import local_linear_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tuning import chosen_kernels, median_ms, rel  # noqa: E402

L = kernel.Launch
CANDIDATES = {
    "stats": [L(64, 64, 4, 2), L(64, 64, 4, 3), L(128, 32, 8, 3), L(128, 64, 8, 3), L(64, 128, 4, 2)],
    "out": [L(64, 64, 4, 3), L(128, 64, 8, 3), L(128, 32, 8, 3), L(64, 32, 4, 2)],
    "prep": [L(64, 32, 4, 2), L(128, 32, 8, 2), L(64, 128, 4, 2), L(128, 64, 8, 2)],
    "prep_moments": [L(64, 16, 4, 2), L(32, 64, 4, 2), L(64, 32, 4, 3), L(64, 64, 4, 2), L(128, 32, 8, 2)],
    "dkv": [L(32, 128, 8, 2), L(64, 64, 4, 2), L(32, 64, 4, 3), L(64, 128, 8, 2), L(16, 64, 4, 2)],
    "dq": [L(64, 64, 4, 3), L(128, 64, 8, 2), L(128, 32, 8, 2), L(64, 128, 4, 2), L(64, 32, 4, 2)],
}


def launch_table(name, rank):
    """The table that holds kernel ``name``'s launch at this rank (LAUNCH_RM8 overrides LAUNCH for r ≤ 8)."""
    return kernel.LAUNCH_RM8 if rank <= 8 and name in kernel.LAUNCH_RM8 else kernel.LAUNCH


def set_launches(table, rank):
    for name, cfg in table.items():
        launch_table(name, rank)[name] = cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch (B = tokens / T)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--kernels", default=",".join(CANDIDATES), help="comma-separated kernels to sweep")
    args = ap.parse_args(argv)
    kernels = chosen_kernels(ap, args.kernels, CANDIDATES)
    if not torch.cuda.is_available():
        raise SystemExit("tune_local_linear.py times the kernels on a CUDA GPU")
    T, H, D, R = args.seq, args.heads, args.head_dim, args.rank
    B = max(1, args.tokens // T)
    q, k, v, P, scale = make_inputs(B, T, H, D, R, torch.bfloat16, "cuda")
    for x in (q, k, v, P):
        x.requires_grad_()
    do = torch.randn_like(v)

    def run():
        o = local_linear_attention(q, k, v, scale=scale, ridge=0.1, rank_projection=P, backend="triton")[0]
        return o, torch.autograd.grad(o, [q, k, v, P], do)

    def forward():
        with torch.no_grad():
            return local_linear_attention(q, k, v, scale=scale, ridge=0.1, rank_projection=P, backend="triton")[0]

    chosen = {name: launch_table(name, R)[name] for name in kernel.LAUNCH}
    o0, g0 = run()
    start = (median_ms(forward), median_ms(run))
    print(f"starting launches: fwd {start[0]:.3f} ms, fwd+bwd {start[1]:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:4]:
        print(f"   {e.key[:50]:<50} {e.device_time_total / 1000:.3f} ms")
    rows = []
    for name in kernels:
        candidates = CANDIDATES[name]
        best_ms, best = start[1], chosen[name]
        for cand in candidates:
            set_launches(dict(chosen, **{name: cand}), R)
            try:
                o, g = run()
                err = max([rel(o, o0)] + [rel(a, b) for a, b in zip(g, g0)])
                ok = err < 2e-2 and all(torch.isfinite(x).all() for x in (o, *g))
                ms = median_ms(run)
            except Exception as e:  # a launch that does not compile or fit is a result too
                err, ok, ms = None, False, None
                print(f"{name} {tuple(cand)}: failed ({type(e).__name__}: {str(e)[:100]})")
            rows.append({"kernel": name, "launch": list(cand), "fwdbwd_ms": ms, "rel_vs_start": err, "ok": ok})
            if ms is not None:
                print(f"{name} {tuple(cand)}: fwd+bwd {ms:.3f} ms, rel {err:.1e}, ok {ok}")
            if ok and ms < best_ms * 0.98:
                best_ms, best = ms, cand
        chosen[name] = best
        print(f"-> {name}: {tuple(best)}")
    set_launches(chosen, R)
    run()
    final = (median_ms(forward), median_ms(run))
    sq, sk, sv = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

    def sdpa():
        o = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True)
        torch.autograd.grad(o, [sq, sk, sv], do.transpose(1, 2))

    sdpa_ms = median_ms(sdpa)
    table = {n: list(c) for n, c in chosen.items()}
    print(f"chosen {json.dumps(table)}: fwd {final[0]:.3f}, fwd+bwd {final[1]:.3f} ms "
          f"(started at {start[0]:.3f} / {start[1]:.3f}); SDPA fwd+bwd {sdpa_ms:.3f} ms -> {final[1] / sdpa_ms:.1f}x")
    with open(args.out, "w") as fh:
        json.dump({"case": {"B": B, "T": T, "H": H, "dk": D, "r": R, "dtype": "bfloat16"}, "rows": rows,
                   "chosen": table, "start_ms": start, "chosen_ms": final, "sdpa_fwdbwd_ms": sdpa_ms,
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__},
                  fh, indent=1)


if __name__ == "__main__":
    main()
