"""Launch options (warps, pipeline stages) of the gated delta rule's and KDA's Triton kernels, measured on a CUDA GPU.

    python experiments/launch_options.py sweep gdn --budget-s 290 > sweep_gdn.jsonl
    python experiments/launch_options.py sweep kda --budget-s 120 > sweep_kda.jsonl
    python experiments/launch_options.py sweep gdn --kernels dqkw,wy    # only these kernels' options
    python experiments/launch_options.py check > check.jsonl
    python experiments/launch_options.py time kda --tag NAME >> versions.jsonl    # the tree as it is
    python experiments/launch_options.py variants gdn --set tf32:lazoo.kernels.delta.TRIANGULAR_16BIT=False
    python experiments/launch_options.py variants gdn --shapes 32768:1:16:16 \
        --set nosplit:lazoo.kernels.delta_split.SPLIT_LONG_SEQUENCES=False

``sweep`` changes one kernel's options at a time (the others at their defaults) and times the op's forward without
autograd and its forward + backward (``triton.testing.do_bench`` medians, bf16, H = 16, D = 128, 32k tokens a batch:
T = 1k with HV = H and T = 8k with HV = 2H for the gated delta rule, T = 8k for KDA). Options that make both shapes
1.5 % faster on average are then timed together against the defaults, with a float64 check (T = 1000) of the output
and every gradient. ``check`` times one candidate per op against its default at T = 1k, 8k and 32k; ``time`` times
the op as the tree has it at those lengths (HV = H) with the float64 check, to compare versions of the kernels, each
run in its own process; ``variants`` times the tree and each ``--set`` of module attributes in turns, two rounds,
at T = 1k, 8k and 32k and at 8k with HV = 2H (or ``--shapes``), each with its float64 check. Each line printed is
one JSON record. The option tables are ``lazoo.kernels.delta.CONFIGS`` and ``lazoo.kernels.kda.LAUNCH``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F

from lazoo import ops
from lazoo.bench.timing import time_fwd_bwd
from lazoo.bench.variants import parse_variant, variant_settings

D = 128
GRADS = ("q", "k", "v", "beta", "g")
WIDE = [dict(num_warps=w, num_stages=s) for w, s in [(4, 1), (4, 2), (4, 3), (8, 2), (8, 3)]]
NARROW = [dict(num_warps=w, num_stages=s) for w, s in [(4, 1), (4, 2), (8, 1), (8, 2)]]


def gdn_inputs(T, B, H, HV, seed=0):
    from lazoo.bench.delta_frontier import make_inputs
    return make_inputs(T, B, H, HV, torch.bfloat16, "cuda", seed=seed)


def kda_inputs(T, B, H, HV, seed=0):
    """Unit-norm q, k; a log decay per key channel −A·softplus(x − 2), A in [1, 16] a head (HV = H)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, D, device="cuda", generator=g).bfloat16()
    beta = torch.rand(B, T, H, device="cuda", generator=g).bfloat16()
    A = torch.empty(H, device="cuda").uniform_(1, 16)
    gate = -A[:, None] * F.softplus(torch.randn(B, T, H, D, device="cuda", generator=g) - 2)
    return dict(q=q, k=k, v=v, beta=beta, g=gate)


def gdn_call(x, backend="triton"):
    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, backend=backend)[0]


def kda_call(x, backend="triton"):
    return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, use_qk_l2norm=False,
                   backend=backend)[0]


def op_spec(name):
    """(option table, inputs, call, sweep shapes (T, B, H, HV), candidates per kernel, kernels of the prefill only)."""
    if name == "gdn":
        from lazoo.kernels import delta
        staged = [c for c in WIDE if c["num_stages"] > 1]
        wide_dv = [dict(num_warps=8, num_stages=s, BV=128) for s in (2, 3)]  # half the programs (HV = 2H: one wave)
        whole_dv = [dict(num_warps=w, num_stages=2, BV=128) for w in (4, 8)]  # Q K^T once a chunk, not per block
        cands = {"solve": [dict(num_warps=w) for w in (2, 4)], "wu": WIDE, "h": staged + wide_dv, "o": WIDE + whole_dv,
                 "dv_local": WIDE + whole_dv, "dhu": [dict(c, BV=64) for c in staged if c["num_warps"] > 2] + wide_dv,
                 "dqkw": [dict(num_warps=w, num_stages=s) for w, s in [(4, 2), (8, 1), (8, 2), (4, 3)]]
                 + [dict(num_warps=w, BK=64) for w in (4, 8)],  # dk in two programs of 64
                 "wy": NARROW, "mix": WIDE, "walk": staged}
        return delta.CONFIGS, gdn_inputs, gdn_call, [(1024, 32, 16, 16), (8192, 4, 16, 32)], cands, {"mix", "walk"}
    from lazoo.kernels import kda
    cands = {n: NARROW for n in ("fwd_intra", "fwd_diag", "bwd_intra")}
    whole_dv = [dict(num_warps=8, num_stages=2, BV=128)]  # one value block a chunk: q, G and A read once
    cands.update({n: NARROW + whole_dv for n in ("fwd_o", "bwd_du_local", "fwd_wu")})
    deep = [dict(num_warps=w, num_stages=s) for w, s in [(4, 2), (8, 1), (8, 3), (4, 3)]]
    narrow_dv = [dict(num_warps=w, num_stages=s, BV=32) for w, s in [(8, 3), (4, 3), (8, 2)]]  # twice the programs
    cands.update({"fwd_solve": [dict(num_warps=w, num_stages=1) for w in (2, 4)], "fwd_h": deep + narrow_dv,
                  "bwd_dhu": deep + narrow_dv,
                  "bwd_inter": [dict(num_warps=4, num_stages=1)],  # unpipelined: two stages race (kernels.kda)
                  "bwd_wy": [dict(num_warps=w, num_stages=s) for w, s in [(4, 2), (8, 1), (4, 1), (8, 3)]]})
    return kda.LAUNCH, kda_inputs, kda_call, [(8192, 4, 16, 16)], cands, set()


@contextlib.contextmanager
def options(table, kernel, cfg):
    """``table[kernel]`` set to ``cfg`` inside the block, put back after."""
    old = table[kernel]
    table[kernel] = dict(cfg)
    try:
        yield
    finally:
        table[kernel] = old


def measure(inputs, call, shapes, rep):
    """"T:HV" -> [fwd ms, fwd + bwd ms], or the error's text where the launch fails (shared memory)."""
    out = {}
    for s in shapes:
        fwd, both, err = time_fwd_bwd(call, inputs(*s), GRADS, rep=rep)
        out[f"{s[0]}:{s[3]}"] = err or [round(fwd, 4), round(both, 4)]
    return out


def float64_errors(inputs, call, HV):
    """Max relative error of the bf16 kernels' output and gradients against the float64 chunk form, T = 1000."""
    x = inputs(1000, 2, 16, HV)
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    low = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o64 = call(ref, "chunk")
    w = torch.randn_like(o64)
    (o64 * w).sum().backward()
    o = call(low, "triton")
    (o.double() * w).sum().backward()
    err = {n: ((low[n].grad.double() - ref[n].grad).abs().max() / ref[n].grad.abs().max()).item() for n in x}
    err["o"] = ((o.double() - o64).abs().max() / o64.abs().max()).item()
    return {k: float(f"{v:.3g}") for k, v in err.items()}


def emit(**record):
    print(json.dumps(record), flush=True)


def sweep(name, budget_s, kernels=None):
    t0 = time.time()
    table, inputs, call, shapes, cands, prefill_only = op_spec(name)
    if kernels:
        unknown = sorted(set(kernels) - set(cands))
        if unknown:
            raise SystemExit(f"--kernels: {', '.join(unknown)} not among {', '.join(cands)}")
        cands = {k: cands[k] for k in kernels}
    rep = 100 if name == "gdn" else 200  # ms of timed runs: KDA's step is ~3x longer
    HV = shapes[-1][3]
    emit(op=name, check_default=float64_errors(inputs, call, HV))
    base = measure(inputs, call, shapes, rep)
    emit(op=name, kernel="default", cfg=None, t=base)
    best = {}
    todo = [(kernel, cfg) for kernel, configs in cands.items() for cfg in configs if cfg != table[kernel]]
    for kernel, cfg in todo:
        if time.time() - t0 > budget_s:
            emit(op=name, stop="budget", at=kernel, cfg=cfg)
            break
        with options(table, kernel, cfg):
            t = measure(inputs, call, shapes, rep)
        emit(op=name, kernel=kernel, cfg=cfg, t=t)
        if all(isinstance(v, list) for v in t.values()):
            col = 0 if kernel in prefill_only else 1
            ratio = sum(t[k][col] / base[k][col] for k in t) / len(t)
            if ratio < 0.985 and ratio < best.get(kernel, (None, 1.0))[1]:
                best[kernel] = (cfg, ratio)
    emit(op=name, winners={k: [c, round(r, 4)] for k, (c, r) in best.items()})
    with contextlib.ExitStack() as stack:
        for kernel, (cfg, _) in best.items():
            stack.enter_context(options(table, kernel, cfg))
        combined = measure(inputs, call, shapes, 200)
        emit(op=name, check_combined=float64_errors(inputs, call, HV))
    emit(op=name, combined=combined, default_again=measure(inputs, call, shapes, 200),
         elapsed=round(time.time() - t0))


CHECKS = [("gdn", "h", dict(num_warps=4, num_stages=2),
           [(1024, 32, 16, 16), (8192, 4, 16, 16), (32768, 1, 16, 16), (8192, 4, 16, 32)]),
          ("kda", "fwd_h", dict(num_warps=8, num_stages=3),
           [(1024, 32, 16, 16), (8192, 4, 16, 16), (32768, 1, 16, 16)])]


def check(base_options):
    """Each candidate of ``CHECKS`` between two runs of ``base_options`` (the options it is compared with), at every
    shape: the gated delta rule's rule of fewer stages for many programs is off here, so the table alone decides."""
    from lazoo.kernels import delta
    rule, delta.H_STAGES_MANY_PROGRAMS = delta.H_STAGES_MANY_PROGRAMS, 3
    try:
        for name, kernel, new, shapes in CHECKS:
            table, inputs, call, *_ = op_spec(name)
            old = base_options.get((name, kernel), table[kernel])
            for tag, cfg in [("default", old), ("new", new), ("default_again", old)]:
                with options(table, kernel, cfg):
                    emit(op=name, kernel=kernel, tag=tag, cfg=cfg, t=measure(inputs, call, shapes, 200),
                         check=float64_errors(inputs, call, shapes[-1][3]) if tag == "new" else None)
    finally:
        delta.H_STAGES_MANY_PROGRAMS = rule


FRONTIER = [(1024, 32, 16, 16), (8192, 4, 16, 16), (32768, 1, 16, 16), (8192, 4, 16, 32)]


def variants(name, settings, rounds=2, shapes=None):
    """The tree's defaults and each setting in turns, ``rounds`` times, at ``shapes`` (the frontier's four)."""
    _, inputs, call, *_ = op_spec(name)
    shapes = shapes or FRONTIER
    runs = [("default", [])] + [parse_variant(s) for s in settings]
    for tag, setting in runs:
        with variant_settings(setting):
            emit(op=name, variant=tag, check_hv16=float64_errors(inputs, call, 16),
                 check_hv32=float64_errors(inputs, call, 32))
    for r in range(rounds):
        for tag, setting in runs:
            with variant_settings(setting):
                emit(op=name, variant=tag, round=r, t=measure(inputs, call, shapes, 200))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["sweep", "check", "time", "variants"])
    p.add_argument("op", nargs="?", choices=["gdn", "kda"], default="gdn")
    p.add_argument("--budget-s", type=float, default=250, help="stop starting new options after this many seconds")
    p.add_argument("--kernels", default="", help="sweep: only these kernels (comma-separated names of the table)")
    p.add_argument("--tag", default="", help="time: a name for the version timed, copied into its records")
    p.add_argument("--set", action="append", default=[], metavar="LABEL:module.ATTR=value[,...]",
                   help="variants: module attributes to set for one variant (repeat for more variants)")
    p.add_argument("--shapes", default="", help="variants: T:B:H:HV,... in place of the frontier's four")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"launch_options.py times Triton kernels on a CUDA GPU; torch {torch.__version__} sees none")
    if args.what == "sweep":
        sweep(args.op, args.budget_s, [k for k in args.kernels.split(",") if k])
    elif args.what == "variants":
        variants(args.op, args.set, shapes=[tuple(int(n) for n in s.split(":")) for s in args.shapes.split(",") if s])
    elif args.what == "time":
        _, inputs, call, *_ = op_spec(args.op)
        emit(op=args.op, tag=args.tag, check=float64_errors(inputs, call, 16))
        emit(op=args.op, tag=args.tag, t=measure(inputs, call, [(1024, 32, 16, 16), (8192, 4, 16, 16),
                                                                 (32768, 1, 16, 16)], 200))
    else:  # the options the check ran against (the defaults before the change it measured)
        check({("gdn", "h"): dict(num_warps=4, num_stages=3), ("kda", "fwd_h"): dict(num_warps=8, num_stages=2)})


if __name__ == "__main__":
    main()
