"""`lazoo` command line: `lazoo list` (mechanisms and their backends), `lazoo demo` (the main job)."""

from __future__ import annotations

import argparse
import sys


def _list(_args) -> int:
    from .layers.mixers import MIXERS
    from .presets import HYBRIDS

    print("mechanisms (config.layer_types names; model_type lazoo_<name>):")
    for name, cls in MIXERS.items():
        print(f"  {name:<16} {cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ''}")
    print("hybrid presets (model_type lazoo_hybrid):")
    for name, pattern in HYBRIDS.items():
        print(f"  {name:<16} {' / '.join(pattern)} repeated")
    print("backends: recurrent (float64 reference), chunk (PyTorch), triton (CUDA, where the op has a kernel)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lazoo", description="lazoo: linear-time and hybrid attention models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list mechanisms and hybrid presets").set_defaults(func=_list)
    sub.add_parser("demo", help="train, evaluate, save, reload and sample a small model (see `lazoo demo --help`)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
