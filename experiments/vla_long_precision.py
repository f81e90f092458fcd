#!/usr/bin/env python
"""VLA numerics at long T on a CUDA GPU: the Triton path (fp32 scan of A, bf16/fp32 delta-rule kernel)
against the float64 PyTorch chunk form (itself equal to Algorithm 1 to ~1e-15): relative error of the
outputs and of the final S and A, and the smallest eigenvalue of the final A in each (A must stay
positive definite). Writes JSON.

    PYTHONPATH=src python experiments/vla_long_precision.py --T 65536 --out vla_long.json
"""

from __future__ import annotations

import argparse
import json

import torch

from lazoo import ops


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--out", default="vla_long.json")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(0)
    q, k, v, u = (torch.randn(1, args.T, args.H, args.D, device=args.device, generator=gen, dtype=torch.float64)
                  for _ in range(4))
    ref_o, ref_s = ops.vla(q, k, v, u, backend="chunk", output_final_state=True)
    eig = lambda A: torch.linalg.eigvalsh(A.double()).min().item()  # noqa: E731
    rows = [{"impl": "float64 chunk", "A_min_eig": eig(ref_s["A"]), "A_max_eig":
             torch.linalg.eigvalsh(ref_s["A"]).max().item()}]
    for dtype in (torch.float32, torch.bfloat16):
        o, s = ops.vla(q.to(dtype), k.to(dtype), v.to(dtype), u.to(dtype), backend="triton",
                       output_final_state=True)
        # the same rounded inputs for the reference error (bf16 rounding is not the kernel's error)
        r_o, r_s = ops.vla(*(x.to(dtype).double() for x in (q, k, v, u)), backend="chunk", output_final_state=True)
        rows.append({"impl": f"triton {dtype}", "o_rel_err": rel(o, r_o), "S_rel_err": rel(s["S"], r_s["S"]),
                     "A_rel_err": rel(s["A"], r_s["A"]), "A_min_eig": eig(s["A"]),
                     "A_min_eig_ref": eig(r_s["A"])})
        print(rows[-1], flush=True)
    print(rows[0])
    with open(args.out, "w") as fh:
        json.dump({"T": args.T, "H": args.H, "D": args.D,
                   "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
