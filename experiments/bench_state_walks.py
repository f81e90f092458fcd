"""Time the normalised linear-attention kernel's state walks alone (``lazoo.kernels.normalized``: the forward walk
``_fwd_h`` and the reverse walk ``_bwd_dh``), without and with two scalar features (ELA's polynomial kernels), on a
CUDA GPU: what the scalar features' programs cost, and the state tiles' value block.

Rows: E = 0 and E = 2 as the kernels run; E = 2 with the he and ze programs left out of the grid (their sums not
formed: timing only); both with value blocks of 32. bf16, B·T = 32k tokens, H = 16, D = 128, median ms.

    PYTHONPATH=src python experiments/bench_state_walks.py --out walks.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from unittest import mock

import torch
import triton
import triton.testing

from lazoo.kernels import normalized as kn

TOKENS, H, D = 32768, 16, 128


def _without_scalar_programs(self, BK, BV):
    """``_Ctx.state_grid`` less the he and ze programs."""
    return (triton.cdiv(self.K, BK) * triton.cdiv(self.V, BV) + triton.cdiv(self.K, BK), self.N * self.H)


def time_walks(T: int, E: int, variant: str, device: str = "cuda") -> dict:
    B = max(1, TOKENS // T)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.rand(B, T, H, D, device=device, generator=gen).to(torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(B, T, H, D, device=device, generator=gen).to(torch.bfloat16) for _ in range(2))
    a, c = (torch.rand(B, T, H, E, device=device, generator=gen) for _ in range(2)) if E else (None, None)
    rden, dden = (torch.rand(B, T, H, device=device, generator=gen) for _ in range(2))
    ctx = kn._Ctx(q, v, a, None, 64, 1e-6)
    fwd_chunks, bwd_chunks = ctx.buffers(device), ctx.buffers(device)
    with contextlib.ExitStack() as stack:
        if variant == "no scalar programs":
            stack.enter_context(mock.patch.object(kn._Ctx, "state_grid", _without_scalar_programs))
        if variant == "value blocks of 32":
            stack.enter_context(mock.patch.object(kn, "state_blocks", lambda K, V: (64, 32)))
        fwd = triton.testing.do_bench(lambda: kn._state_walks(kn._fwd_h_kernel, ctx, (k, c, v), fwd_chunks, None,
                                                              False, reverse=False), return_mode="median")
        bwd = triton.testing.do_bench(lambda: kn._state_walks(kn._bwd_dh_kernel, ctx, (q, a, do, rden, dden),
                                                              bwd_chunks, None, False, reverse=True),
                                      return_mode="median")
    return {"T": T, "E": E, "variant": variant, "fwd_h_ms": round(fwd, 4), "bwd_dh_ms": round(bwd, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--out", default="bench_state_walks.json")
    args = ap.parse_args()
    rows = []
    for T in args.lengths:
        for E, variant in ((0, "as run"), (2, "as run"), (2, "no scalar programs"), (0, "value blocks of 32"),
                           (2, "value blocks of 32")):
            rows.append(time_walks(T, E, variant))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
