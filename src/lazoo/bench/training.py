"""Training throughput (tokens/s) and peak GPU memory of ~125M-size causal LMs: lazoo vs Llama (SDPA) and fla.

Every model has the same shape: hidden 768, 12 layers, 12 heads (head dim 64), a SwiGLU FFN of 3072
(lazoo's default 4 x hidden; Llama given the same), vocab 32000, **tied** input/output embeddings (lazoo's
default; Llama and fla set to tie too), so ~138M parameters for Llama (row ``params``; the mechanisms'
own gates/convs/norms add or remove a few million). Rows, at each T of ``--lengths`` (default 2048, 8192)
with a fixed ``--tokens`` per optimizer step (default 16384: batch = tokens // T):

  * lazoo, one row per name of ``--mechanisms`` (default ``linear,gated_delta_net,vla,sw-ovq``): any
    mechanism, hybrid preset or config .json that ``lazoo.presets.build_config`` takes (a preset's layer
    pattern repeats over the 12 layers);
  * ``llama_sdpa``: transformers' ``LlamaForCausalLM`` with ``attn_implementation="sdpa"``;
  * fla's model for the same mechanism where ``fla.models`` has one (linear -> LinearAttentionForCausalLM,
    gated_delta_net -> GatedDeltaNetForCausalLM, delta_net -> DeltaNetForCausalLM, gla -> GLAForCausalLM),
    with the same sizes (fla's other defaults kept; GDN with head_dim 64 and expand_v 1 to match), last and
    under ``--fla-budget`` seconds (its kernels autotune on first use); a missing or refusing fla is recorded
    as the error string of its rows.

Precision (``--dtype``): ``bf16`` (default on CUDA) = fp32 master weights, forward/backward under
``torch.autocast(bfloat16)``, fused AdamW on the fp32 weights; ``bf16-weights`` = the model cast to bf16,
no autocast, AdamW on bf16 weights; ``fp32`` (default on CPU). One step = forward with ``labels`` (the
models' own shifted cross-entropy), backward, ``AdamW.step()``, ``zero_grad``. Per row: build on the device,
``--warmup`` steps (Triton compilation happens here), then ``--steps`` timed steps (CUDA events around each
step, synchronised at the end); tokens/s = B*T / median step time; peak memory =
``torch.cuda.max_memory_allocated`` since the build (weights + AdamW state + activations). An OOM or any
other error (or a row past ``--row-budget`` = 180 seconds, SIGALRM) is recorded in the row as ``error`` and the
run goes on; the JSON (``--out``) is rewritten after every row: ``{"env": {GPU, torch, triton, transformers,
fla versions, precision, sizes, command, ...}, "rows": [{impl, model, T, B, params, params_non_embedding,
tokens_per_s, step_ms_median/min/max, peak_mem_GiB, loss, error, ...}]}``.

    python -m lazoo.bench.training --out bench_training.json

On an H100 the default set (5 models x 2 lengths + up to 4 fla rows) should take about 4-6 minutes
(lazoo's Triton kernels compile in the warm-up steps, sw-ovq assigns its dictionary chunk by chunk, fla autotunes
for up to ``--fla-budget`` = 120 s). To shrink it: ``--fla-budget 0`` (or ``--no-fla``), ``--steps 5``,
``--lengths 2048``, or drop ``sw-ovq``/``vla`` from ``--mechanisms``; ``--row-budget`` caps any one row.

CPU smoke test (tiny sizes, 2 steps): ``--device cpu --tiny --mechanisms linear,sw-ovq --lengths 32 --no-fla``.

Several GPUs (``--parallel ddp`` or ``fsdp``, started by ``accelerate launch``): each process trains on its own
``--tokens`` per step (so one process is the one-GPU baseline of the same command), through
``accelerate.Accelerator(mixed_precision="bf16")``: ``ddp`` = DistributedDataParallel, ``fsdp`` = FSDP2 with one
unit per decoder layer (``_no_split_modules``: ``LazooDecoderLayer``, ``LlamaDecoderLayer``). tokens/s counts
every process (world size x B x T over the slowest process's median step); fla rows and ``--row-budget`` are
off (a stopped process would leave the others waiting in a collective); rank 0 writes the JSON:

    accelerate launch --multi_gpu --num_processes 2 -m lazoo.bench.training --parallel ddp --out ddp2.json
    accelerate launch --num_processes 1 -m lazoo.bench.training --parallel ddp --out ddp1.json   # baseline
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
import traceback

import torch

import lazoo
from lazoo_cli.bench import bench_parser

from .models import MODEL_SIZES, TIE, TINY_SIZES, config_fields, count_params, lazoo_model, llama_model
from .report import command_line, error_text, first_line, fmt, triton_version, write_json
from .timing import OutOfTime, sync, time_budget

#: lazoo mechanism -> (fla.models config class, fla-specific config fields); other fields are set from the sizes
FLA_MODELS = {
    "linear": ("LinearAttentionConfig", {}),
    "gated_delta_net": ("GatedDeltaNetConfig", {"head_dim": None, "expand_v": 1}),  # head_dim: hidden // heads
    "delta_net": ("DeltaNetConfig", {}),
    "gla": ("GLAConfig", {}),
}


# ----------------------------------------------------------------------------- models
def lazoo_row_model(name, sizes):
    model = lazoo_model(name, sizes)
    return model, {"model_type": model.config.model_type, "layer_types": list(model.config.layer_types)}


def llama_row_model(sizes, max_len):
    model = llama_model(sizes, max_len, use_cache=False)
    return model, {"model_type": "llama", "attn_implementation": model.config._attn_implementation}


def load_fla():
    """(fla.models module, version) or (None, error string)."""
    try:
        import fla
        import fla.models
    except Exception as e:  # not installed, or it refuses this GPU/Triton
        return None, error_text(e)
    return fla.models, getattr(fla, "__version__", "?")


def fla_model(fla_models, mechanism, sizes, max_len):
    cls_name, extra = FLA_MODELS[mechanism]
    config_cls = getattr(fla_models, cls_name)
    model_cls = getattr(fla_models, cls_name.replace("Config", "ForCausalLM"))
    wanted = {"hidden_size": sizes["hidden_size"], "num_hidden_layers": sizes["num_hidden_layers"],
              "num_heads": sizes["num_attention_heads"], "intermediate_size": sizes["intermediate_size"],
              "vocab_size": sizes["vocab_size"], "tie_word_embeddings": TIE, "use_cache": False,
              "max_position_embeddings": max(max_len, 2048), **extra}
    if "head_dim" in wanted and wanted["head_dim"] is None:
        wanted["head_dim"] = sizes["hidden_size"] // sizes["num_attention_heads"]
    fields = config_fields(config_cls, wanted, always=("tie_word_embeddings", "use_cache"))
    config = config_cls(**fields)
    return model_cls(config), {"model_type": getattr(config, "model_type", cls_name), "fla_config": fields}


# ----------------------------------------------------------------------------- one row
def measure(build, T, args, row):
    """Fill ``row`` with params, step times, tokens/s and peak memory of the model ``build()`` returns."""
    device = args.device
    accelerator = args.accelerator
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.device(device):  # initialise on the device (faster than on the CPU); .to() below moves any rest
        model, info = build()
    row.update(info)
    row["params"], row["params_non_embedding"] = count_params(model)
    if args.dtype == "bf16-weights":
        model.to(torch.bfloat16)
    model.to(device).train()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    vocab = model.get_input_embeddings().weight.shape[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device == "cuda")
    rank = 0
    if accelerator is not None:  # DDP / FSDP2 wrapping, and bf16 autocast (mixed_precision) inside the model
        if args.parallel == "fsdp":  # accelerate resolves the wrapped layer class once per plugin: every row
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # is a new model class

            plugin = accelerator.state.fsdp_plugin
            plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap = transformer_auto_wrap_policy, None
        model, opt = accelerator.prepare(model, opt)
        rank = accelerator.process_index
    row["wrapper"] = type(model).__name__
    gen = torch.Generator(device=device).manual_seed(rank)  # each process its own batch
    ids = torch.randint(0, vocab, (row["B"], T), device=device, generator=gen)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16,
                              enabled=args.dtype == "bf16" and accelerator is None)

    forward = torch.compile(model) if row["compiled"] else model

    def step():
        with autocast:
            loss = forward(input_ids=ids, labels=ids).loss
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync(device)
    row["build_warmup_s"] = round(time.perf_counter() - t0, 2)
    times_ms = []
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for start, end in events:
            start.record()
            loss = step()
            end.record()
        torch.cuda.synchronize()
        times_ms = [s.elapsed_time(e) for s, e in events]
        row["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        for _ in range(args.steps):
            t = time.perf_counter()
            loss = step()
            times_ms.append((time.perf_counter() - t) * 1e3)
        row["peak_mem_GiB"] = None
    if args.profile:
        row["profile_top"], row["profile_device_ms"] = profile_step(step, device, args.profile_top)
    med = statistics.median(times_ms)
    world = 1
    if accelerator is not None:  # the slowest process sets the pace; tokens/s counts every process
        world = accelerator.num_processes
        per_rank = accelerator.gather(torch.tensor([med, row["peak_mem_GiB"] or 0.0], device=device)).view(world, 2)
        row["step_ms_median_per_rank"] = per_rank[:, 0].tolist()
        med, row["peak_mem_GiB"] = per_rank[:, 0].max().item(), per_rank[:, 1].max().item()
        loss = accelerator.reduce(loss, reduction="mean")
    row.update(step_ms_median=med, step_ms_min=min(times_ms), step_ms_max=max(times_ms), world_size=world,
               tokens_per_s=world * row["B"] * T / (med / 1e3), loss=float(loss))
    if not math.isfinite(row["loss"]):
        row["note"] = "non-finite loss"


def profile_step(step, device, top=15):
    """The ``top`` operators of one more step by self time on the device (CUDA kernels; CPU ops on the CPU):
    [name, calls, ms], and the sum over all of them in ms (below the step's time: the device waited). Where the
    time goes when tokens/s changes with T."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        sync(device)
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total_ms = sum(getattr(e, attr) for e in events) / 1e3
    return [[e.key[:120], e.count, round(getattr(e, attr) / 1e3, 3)] for e in events[:top]], round(total_ms, 3)


def empty_row(impl, name, T, args, **extra) -> dict:
    B = max(1, args.tokens // T)
    return {"impl": impl, "model": name, "T": T, "B": B, "tokens_per_step": B * T, "dtype": args.dtype, **extra,
            "params": None, "tokens_per_s": None, "step_ms_median": None, "peak_mem_GiB": None, "error": None}


def run_row(impl, name, build, T, args, budget=None, compiled=False):
    """One row; errors (OOM included) and timeouts are recorded, memory is freed either way."""
    row = empty_row(impl, name, T, args, parallel=args.parallel, compiled=compiled)
    budget = args.row_budget if budget is None else min(budget, args.row_budget)
    try:
        with time_budget(budget):
            measure(build, T, args, row)
    except OutOfTime:
        row["error"] = f"timeout: stopped after {budget:.0f} s"
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"OOM: {first_line(e, limit=160)}"
        if args.device == "cuda":
            row["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    except Exception as e:
        traceback.print_exc(limit=3)
        row["error"] = error_text(e)
    finally:
        if args.accelerator is not None:
            args.accelerator.free_memory()  # drop the prepared model and optimizer before the next row
    gc.collect()  # the failed step's frames went with the exception
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if args.main_process:
        print("progress", json.dumps(row), flush=True)
    return row


def make_accelerator(args):
    """The Accelerator of ``--parallel`` (None without): DDP, or FSDP2 wrapping each decoder layer."""
    if args.parallel == "none":
        return None
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = None
    if args.parallel == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    # cpu=True: gloo between the processes torchrun started (the CPU smoke test of this mode)
    return Accelerator(mixed_precision="bf16" if args.dtype == "bf16" else "no", fsdp_plugin=plugin,
                       cpu=args.device == "cpu")


# ----------------------------------------------------------------------------- main
def env_block(args, fla_info):
    import transformers

    env = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
           "lazoo": getattr(lazoo, "__version__", "?"), "dtype": args.dtype,
           "precision": {"bf16": "bf16 autocast, fp32 master weights, AdamW (fused on CUDA)",
                         "bf16-weights": "bf16 weights, no autocast, AdamW on bf16",
                         "fp32": "fp32 weights and compute, AdamW"}[args.dtype],
           "sizes": args.sizes, "tie_word_embeddings": TIE, "tokens_per_step": args.tokens,
           "lengths": args.lengths, "warmup": args.warmup, "steps": args.steps,
           "LAZOO_BACKEND": os.environ.get("LAZOO_BACKEND"), "command": command_line("training", args.argv),
           "parallel": args.parallel,
           "world_size": args.accelerator.num_processes if args.accelerator is not None else 1,
           "transformers": transformers.__version__, "triton": triton_version()}
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus_visible"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    env["fla"], env["fla_error"] = fla_info
    return env


def parse_args(argv=None):
    ap = bench_parser("training")
    args = ap.parse_args(argv)
    args.argv = argv
    args.mechanisms = [m for m in args.mechanisms.split(",") if m]
    args.lengths = [int(t) for t in str(args.lengths).split(",") if t]
    args.tokens = args.tokens if args.tokens is not None else (128 if args.tiny else 16384)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.sizes = dict(TINY_SIZES if args.tiny else MODEL_SIZES)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu (with --tiny)")
    if args.parallel == "fsdp" and args.device != "cuda":
        ap.error("--parallel fsdp needs CUDA (accelerate turns FSDP on for GPU processes only)")
    if args.compile and args.parallel != "none":
        ap.error("--compile runs on one process (--parallel none): compiling a wrapped model is not measured here")
    if args.parallel != "none":
        args.no_fla, args.row_budget = True, 0.0
    return args


def report(rows):
    # each row against Llama run the same way (eager or compiled)
    llama = {(r["T"], r.get("compiled", False)): r["tokens_per_s"] for r in rows
             if r["impl"] == "transformers" and r["tokens_per_s"]}
    print()
    print(f"{'impl':12s} {'model':18s} {'T':>6s} {'B':>3s} {'params':>8s} {'tokens/s':>10s} {'step ms':>9s}"
          f" {'peak GiB':>8s} {'vs llama':>8s}  note")
    for r in sorted(rows, key=lambda r: (r["T"], r.get("compiled", False), r["impl"] != "transformers",
                                         r["impl"] != "lazoo", r["model"])):
        key = (r["T"], r.get("compiled", False))
        rel = r["tokens_per_s"] / llama[key] if r["tokens_per_s"] and key in llama else None
        params = "-" if r["params"] is None else f"{r['params'] / 1e6:.1f}M"
        model = r["model"] + (" +compile" if r.get("compiled") else "")
        print(f"{r['impl']:12s} {model:18s} {r['T']:6d} {r['B']:3d} {params:>8s}"
              f" {fmt(r['tokens_per_s'], ',.0f'):>10s} {fmt(r['step_ms_median'], '.1f'):>9s}"
              f" {fmt(r['peak_mem_GiB'], '.2f'):>8s} {fmt(rel, '.2f'):>8s}  {r['error'] or r.get('note', '')}")


def main(argv=None):
    args = parse_args(argv)
    args.accelerator = make_accelerator(args)
    args.main_process = args.accelerator is None or args.accelerator.is_main_process
    if args.device == "cuda":
        if args.accelerator is not None and args.accelerator.device.index is not None:
            torch.cuda.set_device(args.accelerator.device)
        torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in fp32
    want_fla = not args.no_fla and args.fla_budget > 0 and any(m in FLA_MODELS for m in args.mechanisms)
    if want_fla:
        fla_models, fla_info = load_fla()
        fla_info = (fla_info, None) if fla_models is not None else (None, fla_info)
    else:
        fla_models, fla_info = None, (None, "skipped (--no-fla / --fla-budget 0 / no mechanism fla has)")
    env = env_block(args, fla_info)
    if args.main_process:
        print(json.dumps(env), flush=True)
    result = {"env": env, "rows": []}
    rows = result["rows"]
    max_len = max(args.lengths)

    def save():
        if args.main_process:
            write_json(args.out, result)

    for T in args.lengths:
        for compiled in (False, True) if args.compile else (False,):
            if not args.no_llama:
                rows.append(run_row("transformers", "llama_sdpa", lambda: llama_row_model(args.sizes, max_len), T,
                                    args, compiled=compiled))
                save()
            for name in args.mechanisms:
                rows.append(run_row("lazoo", name, lambda name=name: lazoo_row_model(name, args.sizes), T, args,
                                    compiled=compiled))
                save()

    if want_fla:  # last, under one time budget (autotuning)
        deadline = time.perf_counter() + args.fla_budget
        for T in args.lengths:
            for name in args.mechanisms:
                if name not in FLA_MODELS:
                    continue
                left = deadline - time.perf_counter()
                if fla_models is None or left < 1:
                    error = env["fla_error"] if fla_models is None else f"fla budget ({args.fla_budget:.0f} s) spent"
                    rows.append({**empty_row("fla", name, T, args), "error": error})
                    print("progress", json.dumps(rows[-1]), flush=True)
                else:
                    rows.append(run_row("fla", name, lambda name=name: fla_model(fla_models, name, args.sizes, max_len),
                                        T, args, budget=left))
                save()
    save()
    if args.main_process:
        report(rows)
        print(f"\nwrote {args.out}")
    if args.accelerator is not None:
        args.accelerator.end_training()  # destroys the process group
    return result


if __name__ == "__main__":
    main()
