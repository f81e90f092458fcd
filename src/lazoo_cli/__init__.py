"""`lazoo` command line: the console script's entry point.

    lazoo list                                    mechanisms, their backends and kernels, hybrid presets
    lazoo train --config sw-vla --output DIR      train a causal LM with Trainer (text file or the KJV corpus)
    lazoo generate DIR --prompt "..."             sample (or --greedy) from a saved model
    lazoo card DIR [--metrics JSON]               (re)write the model card README.md of a saved model
    lazoo cards [--check]                         (re)write model_cards/ from configs/ (--check: report stale ones)
    lazoo convert SRC DST                         a fla, Qwen3.5/Qwen3-Next or Mamba-2 checkpoint -> a lazoo folder
    lazoo bench NAME [args...]                    a benchmark of lazoo.bench (kernels, vla, ovq, local_linear, ttt,
                                                  training, generate, qwen, mamba2)
    lazoo eval MODEL...                           lm-eval bridge and local tasks (pip install 'lazoo[eval]')
    lazoo demo [options]                          the demo: train, evaluate, save, reload, sample

This package is apart from `lazoo` because `import lazoo` registers every model with transformers, which
imports torch (seconds): here the arguments are parsed with the standard library alone, so `--help` and
argument errors answer at once, and only then does `lazoo.cli` run the command (`lazoo.commands`).
"""

from __future__ import annotations

import os
import sys

from .bench import bench_parser
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv=None) -> int:
    """Parse `argv` (default: the process's arguments), then run the command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "bench":  # the benchmark's own options: --help and a bad one answer here too
            bench_parser(args.which).parse_args(args.args)
    except SystemExit as exit_:  # --help, or bad arguments (argparse has printed them)
        return exit_status(exit_)
    except BrokenPipeError:  # `lazoo --help | head -1`
        silence_stdout()
        return 141
    from lazoo.cli import run  # the model stack: only now that there is a command to run

    return run(args, argv)


def exit_status(exit_: SystemExit) -> int:
    """The status of a SystemExit: its number, 0 for None; a message is printed to stderr, status 1."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)
    return 1


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush into a closed pipe stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a file descriptor (captured): nothing to flush there
        pass
