"""Greedy generation speed (prefill ms, ms per new token, tokens/s, peak GPU memory) of ~125M causal LMs.

Models (``--models``, comma-separated; default ``llama,gated_delta_net,sw-gdn,sw-vla``), all of one shape
(``--hidden-size`` 768, ``--layers`` 12, ``--heads`` 12, ``--intermediate-size`` 3072, ``--vocab-size`` 32000,
tied input/output embeddings, random weights from ``--seed``):

  * a lazoo mechanism, hybrid preset or config .json that ``lazoo.presets.build_config`` takes (``gated_delta_net``;
    ``sw-gdn`` / ``sw-vla``: sliding-window attention alternating with Gated DeltaNet / VLA);
  * ``llama``: transformers' ``LlamaForCausalLM`` with SDPA attention;
  * ``fla:<model_type>`` (e.g. ``fla:gated_deltanet``): fla's model of that type, built from fla's config class with
    the same sizes (Gated DeltaNet with head_dim = hidden / heads and expand_v 1, as lazoo's); needs ``--fla-site``, a
    folder holding fla (``pip install --target DIR flash-linear-attention``). fla imports ``flash_attn`` only for its
    attention layers, so its pure recurrent models run without it.

For every model, mode (``--modes``), batch (``--batch-sizes``) and prompt length (``--prompts``), on the same random
prompt ids (seeded, equal for every model):

  * ``default``: ``model.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None)``, no cache argument,
    the sequences returned (for lazoo on CUDA: the static cache and rounds of 16 decode steps replayed as one CUDA
    graph, lazoo.models.graph_decode; for llama and fla: their dynamic cache);
  * ``eager``: ``max_new_tokens=N, min_new_tokens=N, return_dict_in_generate=True`` and
    ``cache_implementation="dynamic"`` (a growing cache, no compile);
  * ``static``: the same with ``cache_implementation="static"`` (transformers' static cache for llama, lazoo's
    static ``LazooCache``; on CUDA generate compiles the decode step for both and runs it in transformers' loop: the
    returned cache and ``min_new_tokens``'s logits processor keep lazoo's rounds out). A model whose generate ignores it
    gets an ``error`` row rather than eager's timings under the wrong name;
  * ``compile``: ``model.forward = torch.compile(model.forward, mode="reduce-overhead")``, then eager generate;
  * ``graph`` (lazoo models): the static cache and lazoo's greedy loop of ``--graph-steps`` decode steps per captured
    CUDA graph (``decode_steps_per_graph``, lazoo.models.graph_decode), without an end token (so that it makes N
    tokens without ``min_new_tokens``, whose logits processor that loop does not run) and returning the sequences
    only (a returned cache keeps transformers' loop).

A short generate of ``--warmup-tokens`` (default 8) runs first in every setting, so compilation and Triton
autotuning stay out of the timings; its time is the row's ``first_call_s``. After the timed runs one more generate
with a prompt ``--other-prompt-offset`` tokens longer (default 37) counts the graphs torch.compile made for it
(``recompiles_other_prompt``: 0 when the compiled step is reused). Then, ``--repeats`` times each (median taken): the
prefill =
``generate(..., max_new_tokens=1)`` (one forward over the prompt, filling the cache, plus one token), and the whole
``generate`` of N = ``--new-tokens`` tokens. ms per new token = (t_total - t_prefill) / (N - 1); tokens/s =
batch * (N - 1) / (t_total - t_prefill). Peak memory = ``torch.cuda.max_memory_allocated`` over the setting (weights
included; None on the CPU). A setting that runs out of GPU memory is recorded as ``"error": "out of memory"`` (and
the longer prompts at that batch are then skipped); any other failure is recorded as its error string. The run
never stops for one bad row.

Output: ``--out`` (default bench_generate.jsonl), one JSON object a line, written as each row finishes: first
``{"env": {gpu, torch, triton, transformers, fla, arguments, ...}}``, then one row per setting; at the end a
markdown table on stdout:

    python -m lazoo.bench.generate --out bench_generate.jsonl
    python -m lazoo.bench.generate --models llama,gated_delta_net,fla:gated_deltanet \\
        --fla-site /tmp/site --modes eager,static,compile --prompts 1024,16384 --batch-sizes 1,64

CPU smoke test: ``--device cpu --dtype float32 --hidden-size 64 --layers 2 --heads 2 --intermediate-size 128
--vocab-size 256 --prompts 16 --batch-sizes 1,2 --new-tokens 4 --repeats 1``.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time

import torch

import lazoo
from lazoo_cli.bench import GENERATE_MODES as MODES
from lazoo_cli.bench import bench_parser, model_sizes

from .models import TIE, config_fields, lazoo_model, llama_model
from .report import command_line, first_line, fmt, triton_version
from .timing import sync

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: fla config fields that differ from fla's defaults so its model matches lazoo's of the same sizes
FLA_EXTRA_FIELDS = {"gated_deltanet": lambda sizes: {"head_dim": sizes["hidden_size"] // sizes["num_attention_heads"],
                                                     "expand_v": 1}}

OUT_OF_MEMORY = "out of memory"


class ModeNotApplied(RuntimeError):
    """generate ran, but not in the mode asked for (e.g. it kept the model's own cache instead of a static one)."""


# ----------------------------------------------------------------------------- models
def model_kind(name: str) -> str:
    """'fla', 'llama' or 'lazoo' (a mechanism, hybrid preset or config .json)."""
    if name.startswith("fla:"):
        return "fla"
    return "llama" if name == "llama" else "lazoo"


def load_fla(site):
    """fla's version, or raise why it cannot be imported from ``site``."""
    import sys

    if site not in sys.path:
        sys.path.insert(0, site)
    import fla
    import fla.models  # noqa: F401  (registers fla's model types on the Auto classes)

    return getattr(fla, "__version__", "?")


def build_fla(model_type, sizes, max_len):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"fla registers no model type {model_type!r} with transformers' AutoConfig")
    config_cls = CONFIG_MAPPING[model_type]
    wanted = {"hidden_size": sizes["hidden_size"], "num_hidden_layers": sizes["num_hidden_layers"],
              "num_heads": sizes["num_attention_heads"], "num_attention_heads": sizes["num_attention_heads"],
              "intermediate_size": sizes["intermediate_size"], "vocab_size": sizes["vocab_size"],
              "max_position_embeddings": max(max_len, 2048),
              **FLA_EXTRA_FIELDS.get(model_type, lambda s: {})(sizes)}
    # `wanted` covers both head-count spellings: each config takes the one its __init__ names
    fields = config_fields(config_cls, wanted)
    return AutoModelForCausalLM.from_config(config_cls(**fields, tie_word_embeddings=TIE))


def build_model(name, args):
    """The model ``name`` on ``args.device`` in ``args.dtype``, eval mode, seeded weights (the same every mode)."""
    max_len = max(args.prompts) + args.new_tokens
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialise on the device: faster than on the host at 125M
        kind = model_kind(name)
        if kind == "llama":
            model = llama_model(args.sizes, max_len)
        elif kind == "fla":
            if args.fla_error:
                raise RuntimeError(f"fla could not be imported from --fla-site {args.fla_site}: {args.fla_error}")
            model = build_fla(name.removeprefix("fla:"), args.sizes, max_len)
        else:
            model = lazoo_model(name, args.sizes)
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def prepare_mode(model, mode):
    """What a mode changes on the model itself (compile); the generate arguments are in ``generate_kwargs``."""
    if mode == "compile":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    return model


# ----------------------------------------------------------------------------- timing
def prompt_ids(batch, prompt, vocab, seed):
    """The same random ids for every model: drawn on the host from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt), generator=gen)


def generate_kwargs(mode, new_tokens, cache_length=None, graph_steps=16):
    """``cache_length``: the static cache's size for every call of a setting (prompt + N). Without it transformers
    sizes each call's cache to that call, so the warm-up's and the prefill's shorter caches would be new caches to
    compile for, inside the timed runs."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True)
    if mode == "default":  # what a user writes: the sequences back; no end token, so N tokens without min_new_tokens
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    if mode == "graph":
        del kwargs["min_new_tokens"]
        kwargs.update(return_dict_in_generate=False, eos_token_id=None, cache_implementation="static",
                      decode_steps_per_graph=graph_steps)
    if mode == "eager":
        kwargs["cache_implementation"] = "dynamic"
    if mode == "static":
        kwargs["cache_implementation"] = "static"
        if cache_length:
            kwargs["max_cache_len"] = cache_length
    return kwargs


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def output_cache(out):
    """The cache generate returned (named ``cache`` from transformers 5.24, ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def generate_once(model, ids, mode, new_tokens, cache_length=None, graph_steps=16):
    """One generate call: (seconds, output). Synchronised on CUDA so the time covers the device work."""
    mask = torch.ones_like(ids)
    kwargs = generate_kwargs(mode, new_tokens, cache_length, graph_steps)
    sync(ids.device.type)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kwargs)
    sync(ids.device.type)
    return time.perf_counter() - start, out


def check_output(out, mode, prompt, new_tokens):
    """The cache's class name; fails when generate made another number of tokens, or ignored
    ``cache_implementation="static"``."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    made = sequences.shape[1] - prompt
    if made != new_tokens:
        raise RuntimeError(f"generate made {made} new tokens, not {new_tokens}")
    if isinstance(out, torch.Tensor):  # only the sequences come back
        return "sequences"
    cache_object = output_cache(out)
    cache = type(cache_object).__name__
    if getattr(cache_object, "static", False):  # lazoo's cache in its static form
        cache = f"{cache}(static)"
    if mode == "static" and not cache.endswith(("StaticCache", "(static)")):
        raise ModeNotApplied(f"static cache not supported: generate kept {cache} "
                             "(transformers ignored cache_implementation='static')")
    return cache


def timed_generate(model, ids, mode, new_tokens, cache_length=None, graph_steps=16):
    """(seconds, the cache class generate used) of one checked generate call."""
    before = rounds_run(model)
    seconds, out = generate_once(model, ids, mode, new_tokens, cache_length, graph_steps)
    found = check_output(out, mode, ids.shape[1], new_tokens)
    return seconds, rounds_taken(model, before) if found == "sequences" else found


def rounds_run(model) -> tuple:
    """(the model's last loop of lazoo's rounds, the rounds it has run) (`lazoo.models.graph_decode` keeps it)."""
    from lazoo.models import graph_decode

    loop = graph_decode.LOOPS.get(model)
    return loop, loop.rounds if loop is not None else 0


def rounds_taken(model, before: tuple) -> str:
    """How a generate that returned only its sequences decoded: lazoo's rounds of decode steps (captured as a CUDA
    graph or not), if it ran any since `before` (`rounds_run`), else transformers' loop."""
    loop, rounds = rounds_run(model)
    if loop is None or (loop, rounds) == before:
        return "transformers' loop"
    captured = isinstance(loop.graph, torch.cuda.CUDAGraph)
    return f"LazooCache(static), rounds of {loop.steps}{' (CUDA graph)' if captured else ' (uncaptured)'}"


def measure_setting(model, ids, args, mode):
    """prefill_ms, total_ms, ms_per_token, tokens_per_s of generating ``args.new_tokens`` after ``ids``."""
    batch, prompt = ids.shape
    N = args.new_tokens
    length = prompt + N
    fixed = None if mode == "default" else length  # the default sizes its own cache (in buckets)
    steps = getattr(args, "graph_steps", 16)
    first = timed_generate(model, ids, mode, args.warmup_tokens, fixed, steps)[0] if args.warmup_tokens else None
    prefill = [timed_generate(model, ids, mode, 1, fixed, steps)[0] for _ in range(args.repeats)]
    runs = [timed_generate(model, ids, mode, N, fixed, steps) for _ in range(args.repeats)]
    total = [seconds for seconds, _ in runs]
    t_prefill, t_total = statistics.median(prefill), statistics.median(total)
    decode = t_total - t_prefill
    result = {"cache": runs[-1][1], "prefill_ms": t_prefill * 1e3, "total_ms": t_total * 1e3,
              "prefill_ms_all": [t * 1e3 for t in prefill], "total_ms_all": [t * 1e3 for t in total],
              "first_call_s": first}
    if getattr(args, "other_prompt_offset", 0):  # (the decode profiler passes none)
        longer = torch.cat([ids, ids[:, :args.other_prompt_offset]], dim=1)
        graphs = compiled_graphs()
        result["other_prompt_s"] = timed_generate(model, longer, mode, N, fixed and fixed + args.other_prompt_offset,
                                                  steps)[0]
        result["recompiles_other_prompt"] = compiled_graphs() - graphs
    if decode > 0:
        result.update(ms_per_token=decode * 1e3 / (N - 1), tokens_per_s=batch * (N - 1) / decode)
    else:  # timer noise larger than the decode itself (tiny CPU models): no rate rather than a negative one
        result["note"] = "decode time not above the prefill time"
    return result


# ----------------------------------------------------------------------------- rows
def empty_row(name, mode, batch, prompt, args):
    return {"model": name, "impl": {"lazoo": "lazoo", "llama": "transformers", "fla": "fla"}[model_kind(name)],
            "mode": mode, "batch": batch, "prompt": prompt, "new_tokens": args.new_tokens, "dtype": args.dtype,
            "device": args.device, "params": None, "cache": None, "prefill_ms": None, "total_ms": None,
            "ms_per_token": None, "tokens_per_s": None, "peak_mem_GiB": None, "error": None}


def is_out_of_memory(err):
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def error_text(err):
    if is_out_of_memory(err):
        return OUT_OF_MEMORY
    return f"{type(err).__name__}: {first_line(err, limit=300)}"


def free_memory(device):
    gc.collect()  # a failed call's frames (and their tensors) went with the exception
    if device == "cuda":
        torch.cuda.empty_cache()


def run_setting(model, name, mode, batch, prompt, args):
    row = empty_row(name, mode, batch, prompt, args)
    row["params"] = sum(p.numel() for p in model.parameters())
    free_memory(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = prompt_ids(batch, prompt, args.sizes["vocab_size"], args.seed).to(args.device)
    try:
        row.update(measure_setting(model, ids, args, mode))
    except Exception as err:  # noqa: BLE001 - record the failure, go on with the other settings
        row["error"] = error_text(err)
    finally:
        del ids
        free_memory(args.device)
    if args.device == "cuda":
        row["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return row


def model_rows(name, mode, args, emit):
    """Every (batch, prompt) row of one model in one mode; a fresh model per mode, so no compiled forward or
    static-cache state carries over from one mode to the next."""
    try:
        model = prepare_mode(build_model(name, args), mode)
    except Exception as err:  # noqa: BLE001 - an unknown name, a missing fla, a refused compile: every row says so
        free_memory(args.device)
        for batch in args.batch_sizes:
            for prompt in args.prompts:
                emit({**empty_row(name, mode, batch, prompt, args), "error": error_text(err)})
        return
    for batch in args.batch_sizes:
        ran_out_at = None  # a longer prompt at the same batch needs more memory still: not worth trying
        for prompt in sorted(args.prompts):
            if ran_out_at is not None:
                emit({**empty_row(name, mode, batch, prompt, args),
                      "error": f"{OUT_OF_MEMORY} (skipped: prompt {ran_out_at} at this batch already ran out)"})
                continue
            row = run_setting(model, name, mode, batch, prompt, args)
            if row["error"] == OUT_OF_MEMORY:
                ran_out_at = prompt
            emit(row)
    del model
    free_memory(args.device)


# ----------------------------------------------------------------------------- output
def environment(args):
    import transformers

    return {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "lazoo": getattr(lazoo, "__version__", "?"),
            "fla": args.fla_version, "fla_error": args.fla_error, "sizes": args.sizes, "tie_word_embeddings": TIE,
            "command": command_line("generate", args.argv), "arguments": args.arguments,
            "triton": triton_version()}


def markdown_table(rows):
    lines = ["| model | mode | batch | prompt | prefill ms | ms/token | tokens/s | peak GiB | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        note = (r["error"] or r.get("note", ""))[:120].replace("|", "/")  # keep the table one line a row
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['prompt']} | {fmt(r['prefill_ms'], '.1f')}"
                     f" | {fmt(r['ms_per_token'], '.2f')} | {fmt(r['tokens_per_s'], ',.0f')}"
                     f" | {fmt(r['peak_mem_GiB'], '.2f')} | {note} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def int_list(text):
    return [int(v) for v in str(text).split(",") if v.strip()]


def parse_args(argv=None):
    ap = bench_parser("generate")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.arguments = dict(vars(args))  # as given, for the env record
    args.argv = argv
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.prompts, args.batch_sizes = int_list(args.prompts), int_list(args.batch_sizes)
    args.sizes = model_sizes(args)
    check_args(ap, args)
    return args


def check_args(ap, args):
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    if not args.models or not args.modes or not args.prompts or not args.batch_sizes:
        ap.error("--models, --modes, --prompts and --batch-sizes each need at least one value")
    if min(args.prompts) < 1 or min(args.batch_sizes) < 1:
        ap.error("prompt lengths and batch sizes must be positive")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the decode time is the run past the first token)")
    if args.repeats < 1 or args.warmup_tokens < 0:
        ap.error("--repeats must be at least 1 and --warmup-tokens at least 0")
    fla_models = [m for m in args.models if model_kind(m) == "fla"]
    if fla_models and args.fla_site is None:
        ap.error(f"{', '.join(fla_models)}: fla models need --fla-site DIR, a folder holding fla "
                 "(pip install --target DIR flash-linear-attention)")
    if any(m == "fla:" for m in fla_models):
        ap.error("fla: needs a model type, e.g. fla:gated_deltanet")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu (with small sizes)")


def main(argv=None):
    args = parse_args(argv)
    args.fla_version = args.fla_error = None
    if any(model_kind(m) == "fla" for m in args.models):
        try:
            args.fla_version = load_fla(args.fla_site)
        except Exception as err:  # noqa: BLE001 - recorded in the env and in every fla row
            args.fla_error = error_text(err)
    env = environment(args)
    print(json.dumps({"env": env}), flush=True)
    rows = []
    with open(args.out, "w") as out:
        out.write(json.dumps({"env": env}) + "\n")
        out.flush()

        def emit(row):
            rows.append(row)
            line = json.dumps(row)
            out.write(line + "\n")
            out.flush()  # a run stopped part-way keeps every finished row
            print("row", line, flush=True)

        for name in args.models:
            for mode in args.modes:
                model_rows(name, mode, args, emit)
    print()
    print(markdown_table(rows))
    print(f"\nwrote {args.out}")
    return {"env": env, "rows": rows}


if __name__ == "__main__":
    main()
