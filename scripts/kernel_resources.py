#!/usr/bin/env python
"""Shared memory, registers and spills of lazoo's Triton kernels on Hopper (sm_90), without a GPU.

Compiles a ``@triton.jit`` kernel for ``GPUTarget("cuda", 90, 32)`` with the installed Triton (its bundled
``ptxas``) and reads ``metadata.shared`` (what a launch checks against the 232 448 bytes a Hopper block may
use) and ``ptxas -v``'s registers and spill bytes. Resource use depends on the Triton version: to check what
a GPU machine will do, run with the same Triton as it has (e.g. ``pip install --target /tmp/t36 --no-deps
triton==3.6.0`` and ``PYTHONPATH=/tmp/t36:src``); that reproduced a launch failure of the OVQ assignment kernel
(262 656 bytes asked) to the byte. The report covers the short-convolution kernels at their launch settings;
``measure`` takes any kernel.

    PYTHONPATH=src python scripts/kernel_resources.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: bytes of shared memory one block may use on Hopper (H100 / H200)
SHARED_LIMIT = 232448


def measure(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> dict:
    """``{"shared", "regs", "spill_stores"}`` of ``fn`` compiled for sm_90 (pointers 16-byte aligned, as
    PyTorch allocations are). ``signature`` maps every argument to a Triton type ("*bf16", "i32", ...) or
    "constexpr"; ``constexprs`` gives the constexpr values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx) + ".o"],
                             capture_output=True, text=True, check=True).stderr

    def first_int(pattern):
        found = re.findall(pattern, log)
        return int(found[0]) if found else None

    return {"shared": kernel.metadata.shared, "regs": first_int(r"Used (\d+) registers"),
            "spill_stores": first_int(r"(\d+) bytes spill stores")}


def short_conv_report(dtype: str = "bf16", kernel_size: int = 4, channels: int = 768) -> dict:
    """The three short-convolution kernels at the block sizes their launcher picks for ``channels``."""
    from lazoo.kernels import short_conv as ksc

    BT, BC, warps = ksc._blocks(channels)
    common = {"T": "i32", "C": "i32", "K": "constexpr", "BT": "constexpr", "BC": "constexpr"}
    consts = {"K": kernel_size, "BT": BT, "BC": BC}
    kernels = {
        "forward": (ksc._fwd_kernel, {"x": f"*{dtype}", "w": "*fp32", "y": f"*{dtype}", **common,
                                      "SILU": "constexpr"}, {**consts, "SILU": True}),
        "backward dpre, dw": (ksc._bwd_dpre_kernel, {"x": f"*{dtype}", "w": "*fp32", "dy": f"*{dtype}",
                                                     "dpre": "*fp32", "dw_part": "*fp32", **common,
                                                     "SILU": "constexpr"}, {**consts, "SILU": True}),
        "backward dx": (ksc._bwd_dx_kernel, {"dpre": "*fp32", "w": "*fp32", "dx": f"*{dtype}", **common}, consts),
    }
    return {name: measure(fn, sig, ce, num_warps=warps) for name, (fn, sig, ce) in kernels.items()}


def main() -> None:
    import triton

    print(f"Triton {triton.__version__}, sm_90, short convolution (bf16, K = 4, C = 768):")
    for name, r in short_conv_report().items():
        over = "  OVER THE LIMIT" if r["shared"] > SHARED_LIMIT else ""
        print(f"  {name:18s} shared {r['shared']:6d} B  registers {r['regs']}  spill stores {r['spill_stores']} B{over}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
