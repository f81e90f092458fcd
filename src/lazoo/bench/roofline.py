"""The roofline of ``lazoo.bench.kernels``' rows and the kernel targets they are marked against.

The card's ceilings are measured in the same run (a bf16 8192³ matrix product and a device-to-device copy); each
row's bound is whichever of its FLOPs and its I/O floor (inputs and outputs read or written once) takes longer at
those ceilings, and ``roofline_frac`` is that bound's time over the measured time.
"""

from __future__ import annotations

import torch

from .timing import median_ms

#: the kernel targets: lazoo's fwd + bwd at least this many times faster than fla's (fla's forward where its
#: backward refuses), ELA's ops at most ELA_OVER_LINEAR × lazoo linear attention's time, and every op at
#: ROOFLINE_FRACTION of its roofline bound at ROOFLINE_T
FLA_SPEEDUP = {"linear_attention": 1.25, "gla": 1.1, "delta_rule": 1.1, "gated_delta_rule": 1.1}
ELA_OVER_LINEAR = 1.5
ROOFLINE_FRACTION, ROOFLINE_T = 0.5, 32768


def card_ceilings(device) -> dict:
    """This card's bf16 matrix-product TFLOP/s (8192³) and device-to-device copy GB/s (1 GiB, bytes read and
    written), medians, measured now."""
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = median_ms(lambda: a @ b)
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return {"matmul_TFLOPs": 2 * n ** 3 / matmul_ms / 1e9, "copy_GBps": 2 * src.numel() / copy_ms / 1e6}


def add_rates(row, flops, io_bytes_f, io_bytes_fb):
    """TFLOP/s and GB/s of a row's forward and forward+backward, where it has timings."""
    f, b = row.get("fwd_ms"), row.get("fwd_bwd_ms")
    if f and b:
        row.update(fwd_TFLOPs=flops[0] / f / 1e9, fwd_bwd_TFLOPs=(flops[0] + flops[1]) / b / 1e9,
                   fwd_GBps=io_bytes_f / f / 1e6, fwd_bwd_GBps=io_bytes_fb / b / 1e6)


def roofline(row, ceilings) -> None:
    """``bound`` (compute or memory) and ``roofline_frac`` of a row's forward+backward: achieved / ceiling of the
    bound that takes longer (rows without both rates are left alone)."""
    tf, gb = row.get("fwd_bwd_TFLOPs"), row.get("fwd_bwd_GBps")
    if tf is None or gb is None or not ceilings:
        return
    compute, memory = tf / ceilings["matmul_TFLOPs"], gb / ceilings["copy_GBps"]
    row["bound"] = "compute" if compute >= memory else "memory"
    row["roofline_frac"] = max(compute, memory)


def mark_targets(rows: list) -> None:
    """Add ``targets`` (a list of "what: met" / "what: NOT met") to lazoo's rows where the run has what a target
    compares against (fla's row, lazoo's linear attention at the same shape, the roofline)."""
    def same_shape(r, op, impl):
        return next((x for x in rows if x["op"] == op and x["impl"] == impl and x["T"] == r["T"] and x["D"] == r["D"]),
                    None)

    for r in rows:
        if r["impl"] != "lazoo":
            continue
        marks = []
        fla = same_shape(r, r["op"], "fla")
        if r["op"] in FLA_SPEEDUP and fla is not None:
            want = FLA_SPEEDUP[r["op"]]
            for key, what in (("fwd_bwd_ms", "fwd+bwd"), ("fwd_ms", "fwd")):
                if r.get(key) and fla.get(key):
                    ratio = fla[key] / r[key]
                    marks.append(f"fla/ours {what} {ratio:.2f} >= {want}: {'met' if ratio >= want else 'NOT met'}")
                    break
        linear = same_shape(r, "linear_attention", "lazoo")
        if r["op"].startswith("ela_") and not r["op"].endswith("_bidirectional") and linear is not None \
                and r.get("fwd_bwd_ms") and linear.get("fwd_bwd_ms"):
            ratio = r["fwd_bwd_ms"] / linear["fwd_bwd_ms"]
            met = ratio <= ELA_OVER_LINEAR
            marks.append(f"x linear {ratio:.2f} <= {ELA_OVER_LINEAR}: {'met' if met else 'NOT met'}")
        if r["T"] == ROOFLINE_T and "roofline_frac" in r:
            met = r["roofline_frac"] >= ROOFLINE_FRACTION
            marks.append(f"roofline {100 * r['roofline_frac']:.0f} % >= {100 * ROOFLINE_FRACTION:.0f} %: "
                         f"{'met' if met else 'NOT met'}")
        if marks:
            r["targets"] = marks
