"""`lazoo demo`: `lazoo.demo.run` on checked arguments (train, evaluate, save, reload, sample)."""

from __future__ import annotations

__all__ = ["cmd_demo"]


def cmd_demo(args) -> int:
    from ..demo import check_args
    from ..demo import run as run_demo

    check_args(args)
    run_demo(args)
    return 0
