"""The options of lazoo's benchmarks (`lazoo.bench.<name>`), built with the standard library alone: `lazoo bench
NAME --help` and a bad option answer at once, before torch is imported, and `python -m lazoo.bench.<name>` parses
with the same parser. What needs torch (a CUDA device, a model's name) each benchmark checks in its own module."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

#: the ~125M model of the training and generation benchmarks (config fields; `lazoo.bench.models`)
MODEL_SIZES = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                   vocab_size=32000)
#: `lazoo.bench.generate.DTYPES`' names (tests/bench/test_bench_package.py checks it)
GENERATE_DTYPES = ("bfloat16", "float16", "float32")
GENERATE_MODES = ("default", "eager", "static", "compile", "graph")


class Benchmark(NamedTuple):
    summary: str                     # a line of `lazoo bench --help`
    description: str                 # the first line of the module's docstring
    add_options: Callable[[argparse.ArgumentParser], None]


# ============================================================================ one function per benchmark
def add_kernels_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    ap.add_argument("--quick", action="store_true", help="T = 1k only")
    ap.add_argument("--head-dims", default=None, help="comma-separated head dims to keep (default: every shape)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA training rows")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-launcher timings")
    ap.add_argument("--fla-budget", type=float, default=600.0,
                    help="seconds for the fla runs (its first calls autotune for minutes); 0 skips fla")
    ap.add_argument("--triton-cache", default=None,
                    help="a folder for Triton's kernels and autotuning choices, kept across runs on one machine")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:module.ATTR=value[,...]: time lazoo's ops again with these settings (repeatable)")


def add_vla_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_vla.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--torch-max-t", type=int, default=4096, help="longest T for the PyTorch chunk form")
    ap.add_argument("--no-loop", action="store_true", help="skip the per-token PyTorch loop")
    ap.add_argument("--decode-only", action="store_true", help="only the decoding rows")


def add_ovq_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--pytorch-assign", action="store_true",
                    help="also time the op with step 1 (the assignments) as the PyTorch loop "
                         "(ovq_attention(..., triton_assign=False)), and record how far its output is from the "
                         "default's (the Triton kernels of lazoo.kernels.ovq.assign)")


def add_local_linear_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch (B = tokens / T)")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--chunk", action="store_true", help="also time the PyTorch chunk form")


def add_ttt_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 8192, 32768])
    ap.add_argument("--no-chunk", action="store_true", help="skip the (slow) PyTorch chunk form")


def add_yolo_lat_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--variants", default="conv,lat,lat_all",
                    help="comma-separated, of conv, lat, lat_all, lat_local and lat_attn8")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--image-size", type=int, default=320)
    ap.add_argument("--num-labels", type=int, default=80)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="CUDA: bf16 autocast or fp32")
    ap.add_argument("--repeats", type=int, default=30, help="timed forwards per row (after 5 warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parameters-only", action="store_true",
                    help="count each detector's parameters by kind of layer instead of timing (no GPU needed)")
    ap.add_argument("--width-scales", type=float, nargs="+", default=[1.0],
                    help="with --parameters-only: the channel widths times each of these")


def add_training_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_training.json")
    ap.add_argument("--mechanisms", default="linear,gated_delta_net,vla,sw-ovq",
                    help="comma-separated lazoo mechanisms / hybrid presets / config .json paths")
    ap.add_argument("--lengths", default="2048,8192", help="comma-separated sequence lengths T")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per optimizer step, batch = tokens // T (default 16384; --tiny: 128)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny: 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 3; --tiny: 1)")
    ap.add_argument("--dtype", choices=("bf16", "bf16-weights", "fp32"), default=None,
                    help="bf16 = autocast with fp32 master weights (default on CUDA); fp32 default on CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models (hidden 64, 2 layers) for a CPU smoke test")
    ap.add_argument("--compile", action="store_true",
                    help="also a row of each lazoo and Llama model under torch.compile(model) (compiled in warm-up)")
    ap.add_argument("--no-llama", action="store_true", help="skip the LlamaForCausalLM (SDPA) rows")
    ap.add_argument("--no-fla", action="store_true", help="skip fla's models")
    ap.add_argument("--fla-budget", type=float, default=120.0,
                    help="seconds for all fla rows (its kernels autotune on first use); 0 skips fla")
    ap.add_argument("--row-budget", type=float, default=180.0, help="seconds per row before it is stopped; 0: none")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more step per row: its top operators by device time go into the row")
    ap.add_argument("--profile-top", type=int, default=15, help="how many operators --profile keeps")
    ap.add_argument("--parallel", choices=("none", "ddp", "fsdp"), default="none",
                    help="under `accelerate launch`: data-parallel rows, DDP or FSDP2 (each process --tokens a step)")


def add_generate_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default="llama,gated_delta_net,sw-gdn,sw-vla",
                    help="comma-separated: lazoo mechanisms / hybrid presets / config .json, llama, fla:<model_type>")
    ap.add_argument("--modes", default="eager", help=f"comma-separated, of {', '.join(GENERATE_MODES)}")
    ap.add_argument("--prompts", default="1024,16384,65536", help="prompt lengths (comma-separated)")
    ap.add_argument("--batch-sizes", default="1,64", help="batch sizes (comma-separated)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per timed run (at least 2)")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the untimed first generate (0: none)")
    ap.add_argument("--graph-steps", type=int, default=16,
                    help="the graph mode's decode steps per captured round (decode_steps_per_graph)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each kind; the median is reported")
    ap.add_argument("--other-prompt-offset", type=int, default=37,
                    help="one more generate with a prompt this much longer counts the recompiles it causes (0: none)")
    add_device_options(ap)
    ap.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompt ids")
    add_model_size_options(ap)
    ap.add_argument("--fla-site", default=None, help="a folder holding fla (needed by fla:<model_type> models)")
    ap.add_argument("--out", default="bench_generate.jsonl")


# ============================================================================ option groups shared with the profilers
def add_device_options(ap: argparse.ArgumentParser) -> None:
    """--dtype and --device of the generation benchmark and lazoo.bench.profile_decode."""
    ap.add_argument("--dtype", choices=GENERATE_DTYPES, default="bfloat16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="(default: cuda where torch sees a CUDA device, else cpu)")


def add_model_size_options(ap: argparse.ArgumentParser) -> None:
    """The model shape options (also lazoo.bench.profile_decode's): MODEL_SIZES at the defaults."""
    ap.add_argument("--hidden-size", type=int, default=MODEL_SIZES["hidden_size"])
    ap.add_argument("--layers", type=int, default=MODEL_SIZES["num_hidden_layers"])
    ap.add_argument("--heads", type=int, default=MODEL_SIZES["num_attention_heads"])
    ap.add_argument("--intermediate-size", type=int, default=MODEL_SIZES["intermediate_size"])
    ap.add_argument("--vocab-size", type=int, default=MODEL_SIZES["vocab_size"])


def model_sizes(args) -> dict:
    """`add_model_size_options`' options as config fields, what the model builders read."""
    return dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                intermediate_size=args.intermediate_size, vocab_size=args.vocab_size)


def add_qwen_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_qwen.jsonl")
    ap.add_argument("--implementations", default="lazoo,transformers",
                    help="comma-separated: lazoo (the converted model), transformers (its own Qwen3_5ForCausalLM, "
                         "with whatever fla / FlashQLA the environment has)")
    ap.add_argument("--prefill", default="8192,32768", help="comma-separated prompt lengths of the prefill rows")
    ap.add_argument("--train-length", type=int, default=4096)
    ap.add_argument("--train-batch", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes of the generate rows")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length of the generate rows")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than Qwen3.5-0.8B's 24 (smoke tests)")
    ap.add_argument("--hidden-size", type=int, default=None, help="a smaller width (smoke tests)")
    ap.add_argument("--vocab-size", type=int, default=None, help="a smaller vocabulary (smoke tests)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=GENERATE_DTYPES)
    ap.add_argument("--seed", type=int, default=0)



def add_gdn_training_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_gdn_training.jsonl")
    ap.add_argument("--implementations", default="fla,lazoo",
                    help="comma-separated: fla (its GatedDeltaNetForCausalLM), lazoo (the converted model)")
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--distinct-batches", type=int, default=4, help="batches drawn, taken in turn")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)


def add_mamba2_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_mamba2.jsonl",
                    help="JSON-lines rows; the markdown table goes beside it (.md)")
    ap.add_argument("--parts", default="op,model", help="comma-separated, of op (the SSD op) and model (~370M Bamba)")
    ap.add_argument("--quick", action="store_true",
                    help="the op at T = 8k only; the model rows with one repeat and 16 new tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=GENERATE_DTYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each model row (and of a CPU op row)")
    op = ap.add_argument_group("the op (Bamba-9B's Mamba-2 shapes by default)")
    op.add_argument("--lengths", default="1024,8192,32768", help="comma-separated sequence lengths T")
    op.add_argument("--tokens", type=int, default=32768, help="tokens per batch: B = tokens / T")
    op.add_argument("--heads", type=int, default=128, help="SSM heads H of the op rows")
    op.add_argument("--head-dim", type=int, default=64, help="channels P of a head (op and model)")
    op.add_argument("--state-size", type=int, default=128, help="state size N (op and model)")
    op.add_argument("--groups", type=int, default=1, help="groups G of B and C of the op rows")
    op.add_argument("--chunk-size", type=int, default=64, help="chunk length of lazoo's op and transformers' SSD")
    op.add_argument("--anchors", default="fla,transformers", help="comma-separated, of fla and transformers")
    op.add_argument("--hf-tokens", type=int, default=8192,
                    help="tokens per batch of transformers' PyTorch SSD rows (at least one sequence)")
    op.add_argument("--ref-length", type=int, default=1024, help="tokens of the float64 check (of one sequence)")
    op.add_argument("--fla-budget", type=float, default=180.0,
                    help="seconds for fla's rows, its autotuning included (0: no limit)")
    model = ap.add_argument_group("the model (a ~370M Bamba; smaller sizes for smoke tests)")
    model.add_argument("--implementations", default="lazoo,transformers",
                       help="comma-separated, of lazoo and transformers")
    model.add_argument("--layers", type=int, default=24)
    model.add_argument("--hidden-size", type=int, default=1024)
    model.add_argument("--intermediate-size", type=int, default=2048)
    model.add_argument("--vocab-size", type=int, default=32000)
    model.add_argument("--attention-every", type=int, default=9,
                       help="attention at layers k, 2k, ... (Bamba-9B: 9, 18, 27 of 32)")
    model.add_argument("--prefill", default="8192", help="comma-separated prompt lengths of the prefill rows")
    model.add_argument("--train-length", type=int, default=4096)
    model.add_argument("--train-batch", type=int, default=1)
    model.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes of the generate rows")
    model.add_argument("--prompt", type=int, default=128, help="prompt length of the generate rows")
    model.add_argument("--new-tokens", type=int, default=64)

def add_delta_frontier_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="delta_frontier.jsonl",
                    help="JSON-lines rows, each written as it is measured")
    ap.add_argument("--ops", default="gated_delta_rule,delta_rule",
                    help="comma-separated, of gated_delta_rule and delta_rule")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated T:B:H:HV (default 1024:32:16:16,8192:4:16:16,32768:1:16:16,8192:4:16:32); "
                         "delta_rule takes those with HV = H")
    ap.add_argument("--decode", default=None,
                    help="comma-separated B:H:HV of the one-token decode rows (default 32:16:32, Qwen3-Next's layer "
                         "at batch 32; '' for none)")
    ap.add_argument("--triton-cache", default=None,
                    help="a folder for Triton's kernels and autotuning choices and TileLang's compiled kernels "
                         "(FlashQLA's; in DIR/tilelang unless TILELANG_CACHE_DIR is set), kept across runs and "
                         "machines (fla autotunes and TileLang compiles at the first call of each shape)")


#: `lazoo bench NAME` -> lazoo.bench.NAME
BENCHMARKS = {
    "kernels": Benchmark(
        "every op against SDPA and fla",
        "Benchmark lazoo's Triton kernels against SDPA and flash-linear-attention (fla), on a CUDA GPU.",
        add_kernels_options),
    "vla": Benchmark(
        "VLA's Triton, chunk and per-token forms",
        "VLA latency on a CUDA GPU: forward and forward+backward vs T, beside DeltaNet, Gated DeltaNet and SDPA.",
        add_vla_options),
    "ovq": Benchmark(
        "OVQ attention against SDPA, and its state size",
        "Benchmark OVQ attention (Triton) against causal SDPA on a CUDA GPU, and OVQ's state size vs length.",
        add_ovq_options),
    "local_linear": Benchmark(
        "the local-linear kernel against SDPA",
        "Benchmark the fused local-linear attention kernel (lazoo.kernels.local_linear) against causal SDPA.",
        add_local_linear_options),
    "ttt": Benchmark(
        "TTT-Linear's kernel against its chunk form and Gated DeltaNet",
        "Benchmark TTT-Linear on a CUDA GPU: lazoo's Triton kernel vs its PyTorch chunk form, beside Gated DeltaNet "
        "and fla.",
        add_ttt_options),
    "training": Benchmark(
        "tokens/s of ~125M models (also on the CPU: --device cpu --tiny)",
        "Training throughput (tokens/s) and peak GPU memory of ~125M-size causal LMs: lazoo vs Llama (SDPA) and fla.",
        add_training_options),
    "generate": Benchmark(
        "ms per new token of ~125M models (also on the CPU: --device cpu)",
        "Greedy generation speed (prefill ms, ms per new token, tokens/s, peak GPU memory) of ~125M causal LMs.",
        add_generate_options),
    "qwen": Benchmark(
        "a Qwen3.5-0.8B-shaped model: lazoo's conversion against transformers' own class",
        "Prefill, training and generation speed of a model of Qwen3.5-0.8B's shape: lazoo against transformers.",
        add_qwen_options),
    "gdn_training": Benchmark(
        "a ~350M Gated DeltaNet LM trained by lazoo and by fla's layers from the same weights",
        "Training a Gated DeltaNet language model: lazoo against the same model built from fla's layers.",
        add_gdn_training_options),
    "mamba2": Benchmark(
        "Mamba-2 at Bamba's shapes: the op against fla and transformers, a ~370M Bamba against transformers",
        "Mamba-2 at Bamba's shapes: lazoo's op against fla and transformers, and a Bamba-shaped model against "
        "transformers.",
        add_mamba2_options),
    "yolo_lat": Benchmark(
        "YOLO-LAT's detectors against the convolutional one: parameters, eager and CUDA-graph latency",
        "YOLO-LAT's detectors against the convolutional one: parameters and inference latency, eager and as CUDA "
        "graphs.",
        add_yolo_lat_options),
    "delta_frontier": Benchmark(
        "the (gated) delta rule against FlashQLA and fla, grouped value heads included",
        "The gated delta rule against FlashQLA and fla, and the delta rule against fla, on a Gated DeltaNet layer's "
        "inputs.",
        add_delta_frontier_options),
}


def bench_parser(name: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of the benchmark `name` (a key of BENCHMARKS)."""
    from .parser import ArgumentParser

    bench = BENCHMARKS[name]
    ap = ArgumentParser(prog=prog or f"lazoo bench {name}", description=bench.description,
                        epilog=f"The same as python -m lazoo.bench.{name}.")
    bench.add_options(ap)
    return ap
