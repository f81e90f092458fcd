"""The (gated) delta rule's Triton path on a GPU, on a Gated DeltaNet layer's inputs (``lazoo.bench.delta_frontier``:
raw q and k normalised inside the op, β bf16, g float32, D = 128, 32k tokens a batch, H = 16 query/key heads and
16 or 32 value heads): forward without autograd (a prefill) and forward + backward medians
(``triton.testing.do_bench``), and the forward's max relative error against the float64 chunk form on the first 2048
tokens of the first sequence.

    PYTHONPATH=src python experiments/delta_prefill_timing.py TAG     # writes $OUT/TAG_table.json (or ./)
"""
import json
import os
import sys

import torch
import triton

from lazoo.bench.delta_frontier import SHAPES, D, lazoo_op, make_inputs, reference, relative_error


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(tag):
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for gated in (True, False):
        run = lazoo_op(gated)  # lazoo's op on the Triton kernels, as the frontier benchmark runs it
        for T, B, H, HV in SHAPES:
            if not gated and HV != H:
                continue
            x = make_inputs(T, B, H, HV, torch.bfloat16, "cuda")
            fwd = bench(lambda: run(x))
            leaves = {n: t.clone().requires_grad_(n != "g" or gated) for n, t in x.items()}
            do = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)
            names = ["q", "k", "v", "beta"] + (["g"] if gated else [])
            both = bench(lambda: torch.autograd.grad(run(leaves), [leaves[n] for n in names], do))
            head = {n: t[:1, :2048] for n, t in x.items()}
            with torch.no_grad():
                err = relative_error(run(head), reference(head, gated))
            key = f"{'gated' if gated else 'delta'} T{T} HV{HV}"
            res[key] = {"fwd": fwd, "fwdbwd": both, "err_fwd_2k": err}
            print(tag, key, f"fwd {fwd:.3f} fwd+bwd {both:.3f} err {err:.2e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"{tag}_table.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
