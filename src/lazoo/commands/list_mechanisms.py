"""`lazoo list`: the registered mechanisms (model type, backends, op, Triton kernels), the hybrid presets, and
whether this machine has CUDA and Triton."""

from __future__ import annotations

import importlib.util
import json

__all__ = ["cmd_list"]


def cmd_list(args) -> int:
    from ..layers.mixers import list_mechanisms  # imports every mixer module, so every mechanism is registered
    from ..presets import HYBRIDS
    from ..registry import get

    rows = []
    for name in list_mechanisms():
        m = get(name)
        kernels = ", ".join(_kernel_file(k) for k in m.kernels) or "none (PyTorch forms only)"
        rows.append((name, m.model_type, ", ".join(m.backends), f"ops.{m.op}", kernels, m.title))
    if args.json:
        print(json.dumps({"mechanisms": [dict(zip(("name", "model_type", "backends", "ops", "triton_kernels",
                                                   "description"), r)) for r in rows],
                          "hybrids": {k: list(v) for k, v in HYBRIDS.items()}}, indent=2))
        return 0
    header = ("mechanism", "model type", "backends", "op", "Triton kernels")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("mechanisms (config.layer_types names):")
    print(("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))).rstrip())
    for r in rows:
        print(("  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths))).rstrip())
    if args.verbose:
        print("descriptions:")
        for r in rows:
            print(f"  {r[0]:<16} {r[5]}")
    print("hybrid presets (model_type lazoo_hybrid):")
    for name, pattern in HYBRIDS.items():
        print(f"  {name:<16} {' / '.join(pattern)} repeated")
    print("backends: recurrent (step-by-step float64-capable reference), chunk (PyTorch parallel form; SDPA for "
          "softmax/sliding_window), triton (CUDA; auto picks it where the kernel supports the case)")
    import torch

    triton = importlib.util.find_spec("triton") is not None
    print(f"this machine: CUDA {'available' if torch.cuda.is_available() else 'not available'}, "
          f"triton {'installed' if triton else 'not installed'}")
    return 0


def _kernel_file(module: str) -> str:
    """`lazoo.kernels.vla.token` -> `kernels/vla/token.py` (the file under the package, subfolders kept)."""
    return "kernels/" + module.split(".kernels.", 1)[-1].replace(".", "/") + ".py"
