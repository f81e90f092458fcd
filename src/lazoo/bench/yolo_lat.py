"""YOLO-LAT's detectors against the convolutional one: parameters and inference latency, eager and as CUDA graphs.

The three detectors of docs/yolo_lat.md (``conv``: dense 3×3 bottlenecks; ``lat``: depthwise-separable bottlenecks
with linear-attention branches at strides 16 and 32; ``lat_all``: every 3×3 convolution after the stem separable
too), random weights, 80 classes, 320 × 320 inputs, in inference mode. Per model and batch size: the parameters,
the floating-point operations of one image and the operations (ATen, views excluded) of one forward, both counted
on the CPU, and the median wall time of one forward pass (``--repeats`` after warm-up, synchronised); on a CUDA GPU
also the median of the same forward replayed from a CUDA graph, which takes the kernels' launches out and leaves
their work (the ELA paper's 4.3 × GPU speed-up is a claim about that work, or about launches, and the two columns
tell which).

    python -m lazoo.bench.yolo_lat --device cuda --out bench_yolo_lat.json
    python -m lazoo.bench.yolo_lat --device cpu --batch-sizes 1 --out bench_yolo_lat_cpu.json
    python -m lazoo.bench.yolo_lat --parameters-only --width-scales 1 0.75 0.5 --out yolo_lat_parameters.json

``--parameters-only`` counts where each detector's parameters sit instead (dense k×k convolutions, depthwise ones,
1×1 channel mixing, the rest), at the default widths times each ``--width-scales``: what a parameter ratio between
the detectors is made of.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lazoo_cli.bench import bench_parser

from .report import command_line, error_text, gpu_environment, write_json

#: the compared detectors: name -> YoloLatConfig fields ("lat_all" also makes the down-sampling and head
#: convolutions depthwise-separable, the closest to "every deep convolution reformulated"). Two ablations of
#: "lat": "lat_local" keeps its depthwise-separable bottlenecks but no attention branch (the deepest stride is 32,
#: so a minimum stride of 64 leaves none), "lat_attn8" adds the branch from stride 8 instead of 16.
VARIANTS = {"conv": {"variant": "conv"}, "lat": {"variant": "lat"},
            "lat_all": {"variant": "lat", "lat_scope": "all"},
            "lat_local": {"variant": "lat", "attention_min_stride": 64},
            "lat_attn8": {"variant": "lat", "attention_min_stride": 8}}


def build_detector(variant: str, num_labels: int, image_size: int, **config_kwargs):
    """A YOLO-LAT detector of one of ``VARIANTS`` with random weights."""
    from lazoo.vision import YoloLatConfig, YoloLatForObjectDetection

    config = YoloLatConfig(num_labels=num_labels, image_size=image_size, **{**VARIANTS[variant], **config_kwargs})
    return YoloLatForObjectDetection(config)


def count_parameters(model: torch.nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def parameters_by_kind(model: torch.nn.Module) -> dict:
    """Parameters (weights and biases) of the k×k convolutions with k > 1, dense and depthwise, of the 1×1 ones (channel
    mixing: pointwise convolutions and the attention projections), and of everything else (norms, stem aside)."""
    kinds = {"dense_kxk": 0, "depthwise_kxk": 0, "pointwise_1x1": 0}
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            size = sum(p.numel() for p in module.parameters(recurse=False))
            if max(module.kernel_size) == 1:
                kinds["pointwise_1x1"] += size
            elif module.groups > 1 and module.groups == module.in_channels:
                kinds["depthwise_kxk"] += size
            else:
                kinds["dense_kxk"] += size
    kinds["other"] = count_parameters(model) - sum(kinds.values())
    return kinds


def parameter_rows(variants, num_labels: int, image_size: int, scales) -> list[dict]:
    """Per width scale and variant: the widths, the parameters and ``parameters_by_kind``."""
    from lazoo.vision import YoloLatConfig

    rows = []
    for scale in scales:
        widths = [max(2, round(w * scale)) for w in YoloLatConfig().widths]
        for variant in variants:
            model = build_detector(variant, num_labels, image_size, widths=widths)
            rows.append({"variant": variant, "width_scale": scale, "widths": widths,
                         "parameters": count_parameters(model), **parameters_by_kind(model)})
    return rows


def parameter_table(rows: list[dict]) -> str:
    """Markdown: each detector's parameters by kind, and full-width conv's parameters over its own."""
    base = next((r["parameters"] for r in rows if r["variant"] == "conv" and r["width_scale"] == 1.0), None)
    lines = ["| widths × | variant | parameters | dense k×k | depthwise k×k | 1×1 | other | conv (× 1) / this |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{base / r['parameters']:.2f}" if base else "-"
        lines.append(f"| {r['width_scale']:g} | {r['variant']} | {r['parameters']:,} | {r['dense_kxk']:,} | "
                     f"{r['depthwise_kxk']:,} | {r['pointwise_1x1']:,} | {r['other']:,} | {ratio} |")
    return "\n".join(lines)


class _OperationCount(TorchDispatchMode):
    """Counts the ATen operations that compute (views excluded) while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@functools.cache  # the same for every batch size and device
@torch.inference_mode()
def work_per_image(variant: str, num_labels: int, image_size: int) -> tuple[int, int]:
    """(floating-point operations, ATen operations other than views) of one image's forward, counted on the CPU,
    where every layer is PyTorch operations (a Triton kernel is opaque to the counters). FLOPs by
    ``torch.utils.flop_counter``: convolutions and matrix products, two per multiply-add."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_detector(variant, num_labels, image_size).eval()
    x = torch.zeros(1, 3, image_size, image_size)
    with FlopCounterMode(display=False) as flops:
        model(pixel_values=x)
    with _OperationCount() as ops:
        model(pixel_values=x)
    return int(flops.get_total_flops()), ops.count


def wall_ms(fn, device: str, repeats: int, warmup: int = 5) -> float:
    """Median wall time (ms) of ``fn()``, the device synchronised around each call."""
    cuda = device.startswith("cuda")
    times = []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(times))


def graph_ms(fn, repeats: int) -> float:
    """Median ms of ``fn()`` replayed from a CUDA graph (captured after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return wall_ms(graph.replay, "cuda", repeats)


@torch.inference_mode()
def measure(variant: str, batch: int, args) -> dict:
    """One row: parameters, eager ms and (on CUDA) CUDA-graph ms of a forward at ``batch`` images."""
    row = {"variant": variant, "batch": batch, "image_size": args.image_size, "num_labels": args.num_labels}
    model = build_detector(variant, args.num_labels, args.image_size).eval().to(args.device)
    row["parameters"] = count_parameters(model)
    flops, operations = work_per_image(variant, args.num_labels, args.image_size)
    row["gflops_per_image"], row["operations_per_forward"] = flops / 1e9, operations
    x = torch.randn(batch, 3, args.image_size, args.image_size, device=args.device)
    cuda = args.device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and args.dtype == "bf16" else None

    def forward():
        if autocast is None:
            return model(pixel_values=x)
        with autocast:
            return model(pixel_values=x)

    try:
        row["eager_ms"] = wall_ms(forward, args.device, args.repeats)
        if cuda:
            row["cuda_graph_ms"] = graph_ms(forward, args.repeats)
    except Exception as err:  # noqa: BLE001 - recorded in the row
        row["error"] = error_text(err)
    return row


def table(rows: list[dict]) -> str:
    """Markdown: per batch size, each variant's parameters and times, and conv's over each variant's."""
    lines = ["| batch | variant | parameters | GFLOP an image | operations | eager ms | CUDA graph ms "
             "| conv / variant, eager | conv / variant, graph |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    conv = {r["batch"]: r for r in rows if r["variant"] == "conv"}

    def ratio(key, r):
        base = conv.get(r["batch"], {}).get(key)
        return f"{base / r[key]:.2f}" if base and r.get(key) else "-"

    for r in rows:
        graph = f"{r['cuda_graph_ms']:.3f}" if r.get("cuda_graph_ms") else "-"
        eager = f"{r['eager_ms']:.3f}" if r.get("eager_ms") else r.get("error", "-")
        lines.append(f"| {r['batch']} | {r['variant']} | {r['parameters']:,} | {r['gflops_per_image']:.2f} | "
                     f"{r['operations_per_forward']} | {eager} | {graph} | "
                     f"{ratio('eager_ms', r)} | {ratio('cuda_graph_ms', r)} |")
    return "\n".join(lines)


def main(argv=None):
    args = bench_parser("yolo_lat").parse_args(argv)
    if args.device.startswith("cuda") and not args.parameters_only and not torch.cuda.is_available():
        raise SystemExit("lazoo.bench.yolo_lat --device cuda: torch sees no CUDA device here; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    torch.manual_seed(args.seed)
    if args.parameters_only:
        rows = parameter_rows(variants, args.num_labels, args.image_size, args.width_scales)
        result = {"env": {"device": "cpu", "torch": torch.__version__, "command": command_line("yolo_lat", argv)},
                  "rows": rows}
        print(parameter_table(rows))
        if args.out:
            write_json(args.out, result)
            print(f"wrote {args.out}")
        return result
    rows = [measure(v, b, args) for b in args.batch_sizes for v in variants]
    env = gpu_environment() if args.device.startswith("cuda") else {"device": "cpu", "torch": torch.__version__,
                                                                     "threads": torch.get_num_threads()}
    result = {"env": {**env, "dtype": args.dtype if args.device.startswith("cuda") else "fp32",
                      "command": command_line("yolo_lat", argv)}, "rows": rows}
    print(table(rows))
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
