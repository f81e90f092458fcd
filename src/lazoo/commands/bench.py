"""`lazoo bench NAME ARGS`: a benchmark of `lazoo.bench`, run in this process."""

from __future__ import annotations

import importlib

__all__ = ["cmd_bench"]


def cmd_bench(args) -> int:
    """`lazoo.bench.NAME.main(ARGS)` in this process (a benchmark without a GPU exits saying so; its checks after
    parsing exit through argparse, and `lazoo.cli.run` turns either into the status)."""
    importlib.import_module(f"lazoo.bench.{args.which}").main(args.args)
    return 0
