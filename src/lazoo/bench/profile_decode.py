"""Where one decode step's time goes: ``generate``'s loop, the host, or the GPU kernels.

For one lazoo model (a mechanism or hybrid preset; the sizes of ``lazoo.bench.generate``), one
batch and one prompt length, after the prompt has filled a static cache, prints and writes (``--out``, JSON lines):

  * ``generate``: ms per new token of ``model.generate(..., cache_implementation="static")`` in transformers' loop
    (bench_generate's ``static`` mode), the compiled step;
  * ``loop_synced``: a bare greedy loop over the decode step compiled the way generate compiles it
    (``torch.compile(mode="reduce-overhead")``, CUDA graphs), argmax, the host waiting for each token as generate
    does (its stopping check reads the device every step);
  * ``loop_queued``: the same loop, the host never waiting: the steps queue, so the time is the larger of the
    host's and the GPU's per step;
  * ``gpu_kernels``: the sum of the GPU kernel times of one step (torch.profiler over ``--steps`` steps), and the
    kernels launched per step, for the eager step and the compiled step;
  * ``rounds`` (CUDA): ``generate``'s default there, lazoo's rounds of decode steps replayed as one CUDA graph
    (lazoo.models.graph_decode): ms per new token, kernels and kernel ms per step, the host's ms per step
    (``rounds_profile``).

``generate - loop_synced`` is generate's own per-token work (logits processors, stopping criteria, input
preparation); ``loop_synced - gpu_kernels`` is the launch and host time a step pays while the GPU waits.

    python -m lazoo.bench.profile_decode --model gated_delta_net --prompt 1024 --out profile.jsonl

CPU smoke test: ``--device cpu --dtype float32 --hidden-size 64 --layers 2 --heads 2 --intermediate-size 128
--vocab-size 256 --prompt 16 --steps 4`` (no compile, no CUDA graphs: the step runs eagerly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lazoo import LazooCache
from lazoo_cli.bench import add_device_options, add_model_size_options, model_sizes

from . import generate as bench_generate  # the model builders and generate timing of the generation benchmark
from .timing import sync


class GreedyStepper:
    """The state of a bare greedy decode: the cache after the prompt, the last token and its position."""

    def __init__(self, model, ids, max_len, step):
        self.model, self.step = model, step
        batch, prompt = ids.shape
        self.cache = LazooCache(model.config.num_hidden_layers, static=True, max_cache_len=max_len)
        self.mask = torch.ones(batch, 1, dtype=torch.long, device=ids.device)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                        past_key_values=self.cache, logits_to_keep=1)
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.position = torch.full((batch, 1), prompt, dtype=torch.long, device=ids.device)

    def __call__(self):
        with torch.no_grad():
            logits = self.step(input_ids=self.token, attention_mask=self.mask, position_ids=self.position,
                               past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
            self.token = logits[:, -1].argmax(-1, keepdim=True)
            self.position = self.position + 1
        return self.token


def loop_ms(stepper, steps, device, wait_each):
    """Median over 3 runs of the ms per step of ``steps`` steps."""
    runs = []
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = stepper()
            if wait_each:
                token.cpu()
        sync(device)
        runs.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(runs)


def kernel_profile(stepper, steps, device):
    """(GPU kernel ms per step, kernels per step, the 8 costliest kernels) over ``steps`` steps."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            stepper()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in kernels) if kernels else None
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time
    top = sorted(by_name.items(), key=lambda item: -item[1])[:8]
    return {"kernel_ms_per_step": total_us / 1e3 / steps if total_us is not None else None,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels_us_per_step": [(name[:80], round(us / steps, 2)) for name, us in top]}


def rounds_profile(model, ids, args):
    """The default path on CUDA (lazoo's rounds of decode steps replayed as one CUDA graph,
    lazoo.models.graph_decode): its ms per new token as bench_generate measures it, and the kernels of its steps:
    a profile of ``generate`` over 1 + 4 rounds of new tokens less one of the same prompt's first token alone,
    per step. ``host_ms_per_step``: the host's time to launch one replay (no wait), per step, where replaying past
    the generated length is safe (no layer keeps a key-value cache of every position)."""
    from lazoo.models import graph_decode

    result = {"generate_ms": bench_generate.measure_setting(model, ids, args, "default").get("ms_per_token")}
    loop = graph_decode.LOOPS.get(model)
    if loop is None or not isinstance(loop.graph, torch.cuda.CUDAGraph):
        return {**result, "note": "generate did not replay a captured round"}
    steps = loop.steps

    def kernels(new_tokens):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench_generate.generate_once(model, ids, "default", new_tokens)
        found = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(found), sum(e.device_time for e in found)

    (n_all, us_all), (n_first, us_first) = kernels(1 + 4 * steps), kernels(1)
    result.update(steps_per_round=steps, kernels_per_step=(n_all - n_first) / (4 * steps),
                  kernel_ms_per_step=(us_all - us_first) / 1e3 / (4 * steps))
    if not model._keeps_every_position():
        launches = []
        for _ in range(5):
            sync(args.device)
            start = time.perf_counter()
            loop.graph.replay()
            launches.append(time.perf_counter() - start)
        sync(args.device)
        result["host_ms_per_step"] = statistics.median(launches) * 1e3 / steps
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lazoo.bench.profile_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gated_delta_net")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed in each loop")
    add_device_options(ap)
    add_model_size_options(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="append the result as one JSON line")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if bench_generate.model_kind(args.model) != "lazoo":
        ap.error(f"--model {args.model}: a lazoo mechanism or hybrid preset (the bare loop drives lazoo's cache)")
    if args.batch < 1 or args.prompt < 1 or args.steps < 2:
        ap.error("--batch and --prompt must be at least 1, --steps at least 2")
    args.sizes = model_sizes(args)
    # what bench_generate's builders and timing read
    args.prompts, args.new_tokens, args.fla_error, args.fla_site = [args.prompt], args.steps, None, None
    args.warmup_tokens, args.repeats = 8, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    model = bench_generate.build_model(args.model, args)
    ids = bench_generate.prompt_ids(args.batch, args.prompt, args.vocab_size, args.seed).to(args.device)
    max_len = args.prompt + 6 * args.steps + 16  # every step of the compiled stepper's warm-up, loops and profile
    result = {"model": args.model, "batch": args.batch, "prompt": args.prompt, "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__}
    on_cuda = args.device == "cuda"
    result["generate_ms"] = bench_generate.measure_setting(model, ids, args, "static" if on_cuda else "eager") \
        .get("ms_per_token")

    eager = GreedyStepper(model, ids, max_len, model)
    result["gpu_kernels_eager"] = kernel_profile(eager, 8, args.device)
    compiled_step = torch.compile(model, mode="reduce-overhead", fullgraph=True) if on_cuda else model
    compiled = GreedyStepper(model, ids, max_len, compiled_step)
    for _ in range(4):  # compile and record the CUDA graph outside the timings
        compiled()
    result["loop_synced_ms"] = loop_ms(compiled, args.steps, args.device, wait_each=True)
    result["loop_queued_ms"] = loop_ms(compiled, args.steps, args.device, wait_each=False)
    result["gpu_kernels_compiled"] = kernel_profile(compiled, 8, args.device)
    if on_cuda:
        result["rounds"] = rounds_profile(model, ids, args)
    print(json.dumps(result, indent=1))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
