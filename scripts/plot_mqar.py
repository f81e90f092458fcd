#!/usr/bin/env python
"""Plot MQAR accuracy vs number of pairs from ``scripts/mqar.py`` result JSONs (one line per mechanism
and file label).

    python scripts/plot_mqar.py docs/results/mqar/overload_*.json --out docs/figures/mqar_overload.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSON files written by scripts/mqar.py")
    p.add_argument("--out", type=Path, required=True, help="PNG path")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    settings = None
    for path in args.results:
        report = json.loads(path.read_text())
        settings = report["settings"]
        for mech, row in report["summary"].items():
            ns = sorted(int(n) for n in row)
            ax.errorbar(ns, [row[str(n)]["acc_mean"] for n in ns], yerr=[row[str(n)]["acc_std"] for n in ns],
                        marker="o", capsize=3, label=mech)
    ax.set(xscale="log", xlabel="key-value pairs n (T = 3n + 1)", ylabel="exact-match accuracy per query",
           ylim=(0, 1.02))
    ax.set_xticks(sorted({int(n) for path in args.results
                          for row in json.loads(path.read_text())["summary"].values() for n in row}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    if settings:
        ax.set_title(args.title or f"MQAR, {settings['steps']} steps, lr {settings['lr']}, "
                     f"short conv {settings['short_conv']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
