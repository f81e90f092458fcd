#!/usr/bin/env python
"""Plot MQAR accuracy vs number of pairs (or vs T for the long-context runs, ``--seq-lens``) from
``experiments/mqar.py`` result JSONs (one line per mechanism and file; files with different learning rates or
short-conv settings get them in their labels).

    python experiments/plot_mqar.py docs/results/mqar/overload_*.json --out docs/figures/mqar_overload.png
    python experiments/plot_mqar.py docs/results/mqar/long_*.json --out docs/figures/mqar_long.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSON files written by experiments/mqar.py")
    p.add_argument("--out", type=Path, required=True, help="PNG path")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    reports = [json.loads(path.read_text()) for path in args.results]
    settings = reports[-1]["settings"]
    varied = len({(r["settings"]["lr"], r["settings"]["short_conv"]) for r in reports}) > 1
    for report in reports:
        s = report["settings"]
        suffix = f" (lr {s['lr']}, conv {s['short_conv']})" if varied else ""
        for mech, row in report["summary"].items():
            ns = sorted(int(n) for n in row)
            ax.errorbar(ns, [row[str(n)]["acc_mean"] for n in ns], yerr=[row[str(n)]["acc_std"] for n in ns],
                        marker="o", capsize=3, label=mech + suffix, linestyle="--" if suffix and s["lr"] !=
                        reports[0]["settings"]["lr"] else "-")
    xlabel = (f"sequence length T (n = {settings['n_pairs'][0]} pairs)" if settings.get("seq_lens")
              else "key-value pairs n (T = 3n + 1)")
    ax.set(xscale="log", xlabel=xlabel, ylabel="exact-match accuracy per query", ylim=(0, 1.02))
    ax.set_xticks(sorted({int(n) for report in reports for row in report["summary"].values() for n in row}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    default_title = (f"MQAR, {settings['steps']} steps" if varied else
                     f"MQAR, {settings['steps']} steps, lr {settings['lr']}, short conv {settings['short_conv']}")
    ax.set_title(args.title or default_title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
