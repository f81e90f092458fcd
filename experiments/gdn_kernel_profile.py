"""Where the gated delta rule's forward + backward time goes, kernel by kernel, at the frontier's inputs.

    PYTHONPATH=src python experiments/gdn_kernel_profile.py [--out F] [--set LABEL:module.ATTR=value,...] [--no-grad]
        [--shapes T:B:H:HV,...] [--impl lazoo,fla,flashqla] [--triton-cache DIR]

On a CUDA GPU: for the frontier's shapes (T = 1k B = 32, 8k B = 4 with HV = H and 2H, 32k B = 1; H = 16), D = 128, bf16
(``lazoo.bench.delta_frontier.make_inputs``: raw q and k, normalised inside the op), five warm-up steps of
``gated_delta_rule(...).backward(do)`` (``--no-grad``: of the forward without autograd), then torch.profiler over
ten: each GPU kernel's time a step (ms) and their sum, one JSON line a shape, for the tree as it is and for each
``--set`` of module settings (``lazoo.bench.variants``, e.g. ``gluon:lazoo.kernels.delta.USE_GLUON_WALK=True``).
``--impl`` adds the anchors of ``lazoo.bench.delta_frontier`` (fla, FlashQLA; where installed), profiled the same
way on the same inputs, so that each of their kernels can be set beside lazoo's; the ``--set`` variants apply to
lazoo's rows alone.
"""
from __future__ import annotations

import argparse
import json

import torch

from lazoo.bench.delta_frontier import implementations, lazoo_op, make_inputs, use_kernel_caches
from lazoo.bench.report import error_text
from lazoo.bench.timing import kernel_ms
from lazoo.bench.variants import parse_variant, variant_settings

SHAPES = [(1024, 32, 16, 16), (8192, 4, 16, 16), (8192, 4, 16, 32), (32768, 1, 16, 16)]


def kernel_times(T, B, H, HV, fn, steps=10, grad=True) -> dict:
    x = make_inputs(T, B, H, HV, torch.bfloat16, "cuda", seed=0)
    leaves = [x[n].requires_grad_(grad) for n in ("q", "k", "v", "beta", "g")]
    do = torch.randn(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        o = fn(x)
        if grad:
            o.backward(do)
            for t in leaves:
                t.grad = None
    rows = kernel_ms(step, steps)
    return dict(kernels_ms=rows, total=round(sum(rows.values()), 4))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--set", action="append", default=[], metavar="LABEL:module.ATTR=value[,...]",
                   help="a variant of module settings to profile too (repeat for more)")
    p.add_argument("--no-grad", action="store_true", help="profile the forward without autograd")
    p.add_argument("--shapes", default="", help="T:B:H:HV,... in place of the frontier's four")
    p.add_argument("--impl", default="lazoo", help="implementations to profile, of lazoo, fla and flashqla")
    p.add_argument("--triton-cache", default="", help="keep Triton's and TileLang's compiled kernels in this folder")
    args = p.parse_args(argv)
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = sorted(set(impls) - {"lazoo", "fla", "flashqla"})
    if unknown or not impls:
        raise SystemExit(f"--impl {args.impl!r}: expected some of lazoo, fla, flashqla")
    if not torch.cuda.is_available():
        raise SystemExit("gdn_kernel_profile: needs a CUDA GPU")
    if args.triton_cache:
        use_kernel_caches(args.triton_cache)
    fns = implementations(gated=True) if set(impls) - {"lazoo"} else {"lazoo": lazoo_op(gated=True)}
    variants = [("default", [])] + [parse_variant(s) for s in args.set]
    runs = [(impl, label, settings) for impl in impls  # the --set variants are lazoo's
            for label, settings in (variants if impl == "lazoo" else variants[:1])]
    try:
        shapes = [tuple(int(n) for n in s.split(":")) for s in args.shapes.split(",") if s] or SHAPES
    except ValueError:
        shapes = [()]
    if any(len(s) != 4 for s in shapes):
        raise SystemExit(f"--shapes {args.shapes!r}: expected integers T:B:H:HV[,T:B:H:HV...]")
    with open(args.out, "a") if args.out else open("/dev/null", "w") as out:
        def record(row):
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")

        for impl, label, settings in runs:
            with variant_settings(settings):
                for T, B, H, HV in shapes:
                    row = dict(impl=impl, variant=label, grad=not args.no_grad, T=T, B=B, HV=HV)
                    if isinstance(fns[impl], str):  # the anchor's import error
                        record({**row, "error": fns[impl]})
                        continue
                    try:
                        record({**row, **kernel_times(T, B, H, HV, fns[impl], grad=not args.no_grad)})
                    except Exception as e:  # noqa: BLE001 - e.g. fla's backward refusing Triton 3.6 on Hopper
                        record({**row, "error": error_text(e)})

if __name__ == "__main__":
    main()
