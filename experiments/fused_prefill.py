"""The (gated) delta rule's forward through the fused warp-specialised kernel (``lazoo.kernels.delta_fused``) against
the Triton kernels it stands in for, and each ``--set`` of module settings, in turns in one process on the frontier's
inputs (``lazoo.bench.delta_frontier``): without autograd (``_fwd_mix`` + ``_fwd_walk``), or with ``--grad`` forward
+ backward (the state walk and U~); medians of ``triton.testing.do_bench`` and, without autograd, the max relative
error against the float64 chunk form on the first 2048 tokens; one JSON line a run.

    PYTHONPATH=src python experiments/fused_prefill.py [--rounds 2] [--shapes T:B:H:HV,...] [--no-split] [--grad]
        [--set LABEL:module.ATTR=value,...] > rows.jsonl
"""
import argparse
import json

import torch
import triton

from lazoo.bench import timing
from lazoo.bench.delta_frontier import SHAPES, lazoo_op, make_inputs, reference, relative_error
from lazoo.bench.variants import parse_variant, variant_settings
from lazoo.kernels import delta, delta_split

DEVICE = "cuda"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", default=",".join(":".join(map(str, s)) for s in SHAPES))
    p.add_argument("--ops", default="gated,delta")
    p.add_argument("--no-split", action="store_true", help="run long single sequences unsplit (so the fused "
                   "kernel takes them too)")
    p.add_argument("--grad", action="store_true", help="time forward + backward (the fused training forward)")
    p.add_argument("--set", action="append", default=[], metavar="LABEL:module.ATTR=value[,...]",
                   help="a variant of module settings for the fused kernel's runs (repeat for more)")
    args = p.parse_args(argv)
    variants = [parse_variant(text) for text in args.set]
    if not torch.cuda.is_available():
        raise SystemExit("fused_prefill: needs a CUDA GPU")
    if args.no_split:
        delta_split.SPLIT_LONG_SEQUENCES = False
    switch = "USE_FUSED_TRAINING" if args.grad else "USE_FUSED_PREFILL"
    runs = [("triton", [(delta, switch, False)]), ("fused", [(delta, switch, True)])]
    runs += [(label, [(delta, switch, True)] + settings) for label, settings in variants]
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for op in args.ops.split(","):
        gated = op == "gated"
        run = lazoo_op(gated)
        for shape in args.shapes.split(","):
            T, B, H, HV = map(int, shape.split(":"))
            if not gated and HV != H:
                continue
            x = make_inputs(T, B, H, HV, torch.bfloat16, DEVICE)
            first = {n: t[:1, :2048] for n, t in x.items()}
            names = ["q", "k", "v", "beta"] + (["g"] if gated else [])
            leaves = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
            do = torch.randn_like(x["v"])

            def step():
                if args.grad:
                    return torch.autograd.grad(run(leaves), [leaves[n] for n in names], do)
                with torch.no_grad():
                    return run(x)

            for r in range(args.rounds):
                for label, settings in runs:
                    with variant_settings(settings):
                        try:
                            ms = timing.median_ms(step)
                            with torch.no_grad():
                                err = None if args.grad else relative_error(run(first), reference(first, gated))
                        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                            ms, err = None, f"{type(e).__name__}: {e}"[:300]
                    print(json.dumps({**head, "op": op, "T": T, "B": B, "H": H, "HV": HV, "split": not args.no_split,
                                      "round": r, "variant": label, "grad": args.grad,
                                      "ms": ms, "err_2k": err}), flush=True)


if __name__ == "__main__":
    main()
