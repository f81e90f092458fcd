"""OVQ's step 1 (``lazoo.kernels.ovq.assign``) under other launch settings of its search kernel, and the op with them.

Each setting overrides ``ovq_assign._blocks()`` (BN slots a block, BDA features a step of the add, BDS of the
similarity product, the search's warps and stages); the captured CUDA graphs are dropped between settings. Step 1
is timed at --lengths (default T = 4k and 16k, B = 1, H = 8, d = 128; N = 2048, L = 128, unit-norm random keys),
its slots compared with PyTorch's ``_chunk_slots`` at the first length and with the first setting's at the others.
The shape of a ~138M sw-ovq model's training step: ``--lengths 8192 --batch 2 --heads 12 --head-dim 64``.
``--parts`` times step 1 with one part changed at a time instead (``PARTS``); ``--ncu`` makes three untimed passes
for Nsight Compute:

    ncu --clock-control none --kernel-name regex:"_nearest_kernel|_merge_kernel" --launch-skip 40 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats python experiments/bench_ovq_search.py --ncu --lengths 8192 --batch 2 --heads 12 \\
        --head-dim 64

``--op`` then times the op forward and
forward + backward (``lazoo.bench.ovq``'s inputs, bf16) with the previous default and the current one,
alternately, three times each.

    PYTHONPATH=src:tests python experiments/bench_ovq_search.py [--op] [--lengths ...] [--batch B] ...
"""
import argparse
import math

import torch
import triton.testing
from test_kernels_ovq_assign import keys, packed

import lazoo.ops.ovq as ovq_mod
from lazoo.bench.ovq import D, L, N, inputs
from lazoo.bench.timing import time_fwd_bwd
from lazoo.kernels._graphs import GraphCache
from lazoo.kernels.ovq import assign as ovq_assign
from lazoo.ops import ovq_attention

CURRENT = ovq_assign._blocks


def warps(n, stages=1):
    return dict(nearest=dict(num_warps=n, num_stages=stages))


#: (label, overrides of the current defaults); the first row is the previous default
SETTINGS = [
    ("BDA 128, BDS 128, 8 warps (before)", dict(BDA=128, BDS=128, **warps(8))),
    ("BDA 128, BDS 64, 8 warps", dict(BDA=128, BDS=64, **warps(8))),
    ("BDA 128, BDS 32, 8 warps", dict(BDA=128, BDS=32, **warps(8))),
    ("BDA 32, BDS 32, 4 warps (now)", {}),
    ("BDA 16, BDS 16, 4 warps", dict(BDA=16, BDS=16)),
    ("BDA 32, BDS 16, 4 warps", dict(BDS=16)),
    ("BDA 16, BDS 32, 4 warps", dict(BDA=16)),
    ("BDA 32, BDS 64, 4 warps", dict(BDS=64)),
    ("BDA 32, BDS 32, 8 warps", warps(8)),
    ("BDA 32, BDS 32, 2 warps", warps(2)),
    ("BDA 32, BDS 32, 4 warps, 2 stages", warps(4, 2)),
    ("BN 32, 4 warps", dict(BN=32)),
    ("BN 128, 4 warps", dict(BN=128)),
    ("BN 128, 16 warps", dict(BN=128, **warps(16))),
    ("BN 128, 8 warps", dict(BN=128, **warps(8))),  # half the programs of BN 64 (no spill offline, sm_90)
    # three programs an SM instead of two (offline, sm_90: 312 bytes spilled at d = 64, 244 at d = 128)
    ("BDA 32, BDS 32, 4 warps, 168 registers", dict(nearest=dict(num_warps=4, num_stages=1, maxnreg=168))),
    # the addition in a launch of its own, then the search on programs of BK keys (offline, sm_90: 128 registers at
    # 64 keys and 4 warps, 214-218 at 32); the default at d <= 64 is 64 keys at 2 warps
    ("one launch: the addition and the search on the whole chunk", dict(BK=128, **warps(4))),
    *((f"split: search of {keys} keys, {n} warps", dict(BK=keys, search=dict(num_warps=n, num_stages=1)))
      for keys, n in ((64, 4), (64, 2), (64, 8), (32, 4), (32, 2))),
]


#: one part of step 1 changed at a time (``--parts``), to see what each costs; the tf32 similarity is for timing
#: only (it picks other slots)
PARTS = [
    ("now (fp32 similarity)", {}),
    ("tf32 similarity (timing only)", dict(SIM_PRECISION="tf32")),
    ("tf32x3 similarity", dict(SIM_PRECISION="tf32x3")),
    ("the add in full fp32 (no bf16 parts)", dict(BF16_PARTS=False)),
    ("merge at 4 warps", dict(merge=dict(num_warps=4, num_stages=1))),
    ("merge at 16 warps", dict(merge=dict(num_warps=16, num_stages=1))),
]
PRECISION = ovq_assign.SIM_PRECISION


def use(overrides: dict, head_dim: int) -> None:
    """``_blocks()`` with ``overrides`` (and the similarity's precision where they name ``SIM_PRECISION``)."""
    cfg = dict(CURRENT(head_dim), **overrides)
    ovq_assign.SIM_PRECISION = cfg.pop("SIM_PRECISION", PRECISION)
    ovq_assign._blocks = lambda dk: cfg
    ovq_assign._Graph.cache = GraphCache()


def sweep(lengths=(4096, 16384), batch=1, heads=8, head_dim=128, settings=SETTINGS, ncu=False) -> None:
    """Each of ``settings`` at each length, timed; with ``ncu``, three untimed passes of the current one."""
    for T in lengths:
        Kp, valid, st, t0, nb = packed(keys(batch, T, heads, head_dim, seed=5, device="cuda"), L, N)
        args = (Kp, valid.sum(1) // L, t0 - nb, st["Dk"], st["counts"], L, N)
        if ncu:
            for _ in range(3):
                ovq_assign.ovq_assign(*args)
            torch.cuda.synchronize()
            continue
        ref = ovq_mod._chunk_slots(Kp, valid, st, t0, nb, L, N) if T == lengths[0] else None
        for label, overrides in settings:
            use(overrides, head_dim)
            try:  # a setting that does not build or launch here is a result too
                out = ovq_assign.ovq_assign(*args)
            except Exception as e:  # noqa: BLE001
                print(f"T={T} {label:36s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            ref = out if ref is None else ref
            same = all(torch.equal(a, b) for a, b in zip(out, ref))
            ms = triton.testing.do_bench(lambda: ovq_assign.ovq_assign(*args), warmup=3, rep=100,
                                         return_mode="median")
            print(f"T={T} {label:36s} {ms:.3f} ms, slots as {'PyTorch' if T == lengths[0] else 'the first'}'s: "
                  f"{same}", flush=True)


def op() -> None:
    for T in (1024, 4096, 16384):
        q, k, v = inputs(1, T, torch.bfloat16, "cuda")
        x = {"q": q, "k": k, "v": v}

        def fn(x):
            return ovq_attention(x["q"], x["k"], x["v"], scale=math.sqrt(D), chunk_size=L, max_dict_size=N,
                                 backend="triton")[0]

        with torch.no_grad():
            first = fn(x)
        for i in range(3):
            for label, overrides in (SETTINGS[0], ("now", {})):
                use(overrides, D)
                with torch.no_grad():
                    same = torch.equal(fn(x), first)
                fwd, both, err = time_fwd_bwd(fn, x, ("q", "k", "v"))
                print(f"T={T} {label} ({i}): fwd {fwd} ms, fwd+bwd {both} ms, output as the first: {same}"
                      f"{'; ' + err if err else ''}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", action="store_true", help="also time the op with the previous and the current default")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384],
                    help="the first is also checked against PyTorch's step 1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--parts", action="store_true", help="time PARTS (one part of step 1 changed) instead of SETTINGS")
    ap.add_argument("--ncu", action="store_true", help="three untimed passes of the current setting (for ncu)")
    ap.add_argument("--match", nargs="+", default=None, help="only the settings whose label contains one of these")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    try:
        settings = PARTS if args.parts else SETTINGS
        if args.match:
            settings = [row for row in settings if any(m in row[0] for m in args.match)]
        sweep(tuple(args.lengths), args.batch, args.heads, args.head_dim, settings, args.ncu)
        if args.op:
            op()
    finally:
        ovq_assign._blocks = CURRENT
        ovq_assign.SIM_PRECISION = PRECISION


if __name__ == "__main__":
    main()
