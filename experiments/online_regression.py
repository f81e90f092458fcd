#!/usr/bin/env python
"""The test-time regression paper, §5 (Figure 2): online regression with sequence layers and no learned parameters.

Keys follow a switching autoregressive process (the paper's eq. 55), D_k = 64, T = 256:

    k_{t+1} = 0.9 k_t + 0.02 ε_t      for t < T/4      (fast, less predictable regime)
    k_{t+1} = 0.999 k_t + 0.02 ε_t    for t ≥ T/4      (slow, nearly a random walk)
    ε_t ~ N(0, Σ), Σ with unit diagonal and non-zero off-diagonals (so Kᵀ K ≠ I)

values v_t = k_{t+1} / ‖k_{t+1}‖ and queries q_t = k_{t+1}: a layer's output at t, o_t = m_t(k_{t+1}), is the
out-of-sample prediction of the next value from the prefix {(k_i, v_i)}_{i≤t}, and the plotted loss is
‖v_{t+1} − o_t‖² per t, averaged over many independent sequences. One forward pass of each lazoo op does
the regression; nothing is trained.

Choices the paper leaves open (all arguments of this script; the defaults are ours):
  * Σ: a random correlation matrix per sequence, Σ = D^{-1/2} W D^{-1/2} with W = A Aᵀ, A a D_k × 2D_k standard
    Gaussian matrix (a Wishart draw; eigenvalues roughly in [0.1, 3], off-diagonals about ±0.1 to ±0.3).
  * k_1 is drawn from the stationary law of the first regime, N(0, 0.02² Σ / (1 − 0.9²)), so the first
    regime is stationary and the only change is the switch at t = T/4 (1-based t).
  * linear attention: identity feature map, S_t = Σ v_i k_iᵀ, o_t = S_t q_t, then the output normalisation
    the paper cites (Qin et al. 2022) without parameters: o_t / ‖o_t‖ (unit norm, the scale of the targets).
    The elu+1 feature map with the usual denominator is reported too ("linear_elu1").
  * RLS (the paper's eq. 11 and its γ-weighted form): `lazoo.ops.rls` on the raw keys, ridge λ = 1e-3; the
    weighted variant uses γ = 0.95 (effective memory ~20 steps).
  * softmax (p = 0) and local-linear (p = 1): QK-norm (unit q and k, the form under which the paper derives
    softmax as a local-constant regressor) with inverse temperature β = 16; local-linear ridge ρ = 1e-2
    (`lazoo.ops.local_linear_attention`, which normalises the weights to sum to one).
  * naive: o_t = v_t (the last value), the paper's "naive one-step forecaster".
A small sensitivity sweep over γ, β, λ and ρ is written to the JSON as well (`--no-sweep` skips it).

Usage:
    python experiments/online_regression.py                       # writes docs/results + docs/figures
    python experiments/online_regression.py --num-seqs 32 --out /tmp/o.json --plot /tmp/o.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lazoo import ops

ROOT = Path(__file__).resolve().parents[1]
DTYPE = torch.float64  # exact references: no rounding question in a figure about regression quality


# ----------------------------------------------------------------------------- the data (the paper's eq. 55)
def random_correlation(num: int, dim: int, generator: torch.Generator, dtype=DTYPE) -> torch.Tensor:
    """`num` random correlation matrices `[num, dim, dim]`: unit diagonal, non-zero off-diagonals."""
    a = torch.randn(num, dim, 2 * dim, generator=generator, dtype=dtype)
    w = a @ a.transpose(1, 2)
    d = w.diagonal(dim1=1, dim2=2).rsqrt()
    return w * d[:, :, None] * d[:, None, :]


def switching_ar_keys(num: int, seq_len: int, dim: int, *, generator: torch.Generator, fast: float = 0.9,
                      slow: float = 0.999, noise: float = 0.02, switch: int | None = None,
                      steps: int | None = None, dtype=DTYPE) -> torch.Tensor:
    """Keys k_1 .. k_steps `[num, steps, dim]` of the switching AR process (default steps = seq_len + 2, what
    T one-step predictions need). Time is 1-based: k_{t+1} uses `fast` for t < switch (default T/4)."""
    switch = seq_len // 4 if switch is None else switch
    steps = seq_len + 2 if steps is None else steps
    chol = torch.linalg.cholesky(random_correlation(num, dim, generator, dtype))  # ε = L z ~ N(0, Σ)

    def eps():
        return (chol @ torch.randn(num, dim, 1, generator=generator, dtype=dtype))[..., 0]

    keys = [noise / math.sqrt(1.0 - fast ** 2) * eps()]  # k_1 from the first regime's stationary law
    for t in range(1, steps):  # builds k_{t+1}
        a = fast if t < switch else slow
        keys.append(a * keys[-1] + noise * eps())
    return torch.stack(keys, dim=1)


def regression_sequences(keys: torch.Tensor):
    """(q, k, v, target) for T = steps − 2 positions, as `[N, T, 1, D]` (one head): pairs (k_t, v_t) with
    v_t = k_{t+1}/‖k_{t+1}‖, query q_t = k_{t+1}, target v_{t+1}."""
    unit = F.normalize(keys, dim=-1)
    k, q = keys[:, :-2], keys[:, 1:-1]
    v, target = unit[:, 1:-1], unit[:, 2:]
    return tuple(x[:, :, None] for x in (q, k, v, target))


# ----------------------------------------------------------------------------- the regressors
def predict(method: str, q, k, v, *, lam=1e-3, gamma=0.95, beta=16.0, ridge=1e-2) -> torch.Tensor:
    """One forward pass of a lazoo op (no parameters): predictions `[N, T, 1, D]`."""
    if method == "naive":
        return v
    if method == "linear":
        o, _ = ops.linear_attention(q, k, v, feature_map="identity", normalize=False)
        return F.normalize(o, dim=-1)
    if method == "linear_elu1":
        return ops.linear_attention(q, k, v, feature_map="elu1", normalize=True)[0]
    if method == "rls":
        return ops.rls(q, k, v, lam=lam, gamma=1.0)[0]
    if method == "rls_weighted":
        return ops.rls(q, k, v, lam=lam, gamma=gamma)[0]
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if method == "softmax":
        return ops.softmax_attention(qn, kn, v, scale=beta)[0]
    if method == "local_linear":
        return ops.local_linear_attention(qn, kn, v, scale=beta, ridge=ridge)[0]
    raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")


METHODS = ("linear", "linear_elu1", "rls", "rls_weighted", "softmax", "local_linear", "naive")
LABELS = {"linear": "linear attention (identity φ, unit-norm output)",
          "linear_elu1": "linear attention (elu+1, normalised)",
          "rls": "RLS, unweighted (γ = 1)", "rls_weighted": "RLS, weighted (γ < 1)",
          "softmax": "softmax attention (p = 0, QK-norm)", "local_linear": "local-linear attention (p = 1)",
          "naive": "naive: last value"}


def losses(method, data, batch: int = 64, **hp) -> torch.Tensor:
    """Per-sequence, per-step loss ‖v_{t+1} − m_t(k_{t+1})‖² `[N, T]` (in batches: local-linear's memory)."""
    q, k, v, target = data
    out = []
    for s in range(0, q.shape[0], batch):
        sl = slice(s, s + batch)
        pred = predict(method, q[sl], k[sl], v[sl], **hp)
        out.append((pred - target[sl]).pow(2).sum(-1)[:, :, 0])
    return torch.cat(out)


def phase_means(curve: torch.Tensor, switch: int) -> dict[str, float]:
    """Mean loss over the first regime, the 32 steps after the switch, and the last half of the sequence.
    `curve[i]` is the loss at t = i + 1; the switch acts on k_{switch+1}, first seen by the target at t = switch."""
    T = curve.shape[0]
    return {"fast_regime": curve[: switch - 1].mean().item(),
            "after_switch_32": curve[switch - 1: switch + 31].mean().item(),
            "last_half": curve[T // 2:].mean().item(), "all": curve.mean().item()}


# ----------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lam", type=float, default=1e-3, help="RLS ridge λ")
    p.add_argument("--gamma", type=float, default=0.95, help="weighted RLS forgetting factor γ")
    p.add_argument("--beta", type=float, default=16.0, help="softmax / local-linear inverse temperature on unit q, k")
    p.add_argument("--ridge", type=float, default=1e-2, help="local-linear ridge ρ")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--no-sweep", action="store_true", help="skip the hyper-parameter sensitivity sweep")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "online_regression.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "online_regression.png")
    return p.parse_args(argv)


SWEEP = {"rls_weighted": ("gamma", [0.8, 0.9, 0.95, 0.98, 0.99]), "softmax": ("beta", [4.0, 8.0, 16.0, 32.0, 64.0]),
         "local_linear": ("beta", [4.0, 8.0, 16.0, 32.0]), "rls": ("lam", [1e-4, 1e-3, 1e-2, 1e-1])}


def plot(report, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    t = list(range(1, report["settings"]["seq_len"] + 1))
    for method, res in report["curves"].items():
        style = {"linewidth": 1.0, "linestyle": "--"} if method in ("naive", "linear_elu1") else {"linewidth": 1.6}
        ax.plot(t, res["mean"], label=LABELS[method], **style)
    ax.axvline(report["settings"]["switch"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("t")
    ax.set_ylabel(r"$\|v_{t+1} - m_t(k_{t+1})\|^2$ (mean over sequences)")
    s = report["settings"]
    ax.set_title(f"Online regression, switching AR keys (D_k={s['dim']}, T={s['seq_len']}, {s['num_seqs']} seqs)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    methods = [m for m in args.methods.split(",") if m]
    gen = torch.Generator().manual_seed(args.seed)
    keys = switching_ar_keys(args.num_seqs, args.seq_len, args.dim, generator=gen)
    data = regression_sequences(keys)
    switch = args.seq_len // 4
    hp = {"lam": args.lam, "gamma": args.gamma, "beta": args.beta, "ridge": args.ridge}

    curves, summary = {}, {}
    for method in methods:
        per_seq = losses(method, data, **hp)
        mean = per_seq.mean(0)
        sem = per_seq.std(0) / math.sqrt(per_seq.shape[0])
        curves[method] = {"mean": mean.tolist(), "sem": sem.tolist()}
        summary[method] = phase_means(mean, switch)

    sweep = {}
    if not args.no_sweep:
        for method, (name, values) in SWEEP.items():
            if method in methods:
                sweep[method] = {name: {str(x): phase_means(losses(method, data, **{**hp, name: x}).mean(0), switch)
                                        for x in values}}

    report = {
        "experiment": ("the test-time regression paper, §5, Figure 2: online regression of a switching AR process, "
                       "no learned parameters"),
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "switch": switch,
                     "generator": "k_{t+1} = 0.9 k_t + 0.02 ε_t (t < T/4), 0.999 k_t + 0.02 ε_t (t ≥ T/4); "
                                  "ε ~ N(0, Σ), Σ a random correlation matrix per sequence (Wishart, 2D dof); "
                                  "k_1 from the first regime's stationary law; v_t = k_{t+1}/|k_{t+1}|, q_t = k_{t+1}",
                     "loss": "|v_{t+1} - o_t|^2 at t = 1..T (o_t = m_t(k_{t+1})), mean over sequences"},
        "summary": summary,
        "sweep": sweep,
        "curves": curves,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "wall_seconds": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.plot is not None and str(args.plot) != "none":
        plot(report, args.plot)
    width = max(len(m) for m in methods)
    print(f"{'method':<{width}}  fast regime  32 after switch  last half   (mean one-step loss)")
    for m in methods:
        s = summary[m]
        print(f"{m:<{width}}  {s['fast_regime']:11.4f}  {s['after_switch_32']:15.4f}  {s['last_half']:9.4f}")
    for method, by in sweep.items():
        for name, rows in by.items():
            print(f"sweep {method} {name}: " + ", ".join(
                f"{x}: {r['fast_regime']:.3f}/{r['after_switch_32']:.3f}/{r['last_half']:.3f}"
                for x, r in rows.items()))
    print(f"wrote {args.out} ({report['wall_seconds']:.1f}s)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
