"""Prefill, training and generation speed of a model of Qwen3.5-0.8B's shape: lazoo against transformers.

The model: Qwen3.5-0.8B's published text configuration (24 layers, three Gated DeltaNet layers to one gated
attention layer, hidden 1024, 16 key and 16 value heads of 128 in the DeltaNet layers, 8 query and 2 key/value heads
of 256 with a quarter of each rotated in the attention layers, SwiGLU 3584, vocabulary 248320, tied embeddings),
random weights from ``--seed``, built with transformers' ``Qwen3_5ForCausalLM``, saved, and converted with
``lazoo.convert.convert_checkpoint``: both implementations hold the same weights.

First an ``agreement`` row: the relative difference of the two models' logits on two 512-token prompts, and the
share of positions with the same greedy token. Then rows, each the median of ``--repeats`` after one warm-up (CUDA
synchronised, wall clock). The prefill and train rows take the implementations in turns, one call each a round:
at these sizes the host's Python and dispatch, not the GPU, set the time, and the host's speed drifts between
seconds on a shared machine (the same prefill read 42-67 ms in one process), so rounds side by side compare what
one after the other would not; each row keeps its samples (``samples_ms``) beside the median.

  * ``prefill``: the base model over one prompt of each ``--prefill`` length, filling its cache (ms, tokens/s);
  * ``train``: one AdamW step (forward with the loss, backward, step) on ``--train-batch`` × ``--train-length``
    tokens (tokens/s);
  * ``generate``: greedy ``generate`` of ``--new-tokens`` after a ``--prompt``-token prompt at each batch size,
    every implementation on its default path (lazoo's on CUDA: the static cache and the compiled decode step);
    ms per new token = (t(N) − t(1)) / (N − 1);
  * ``generate-eager``: lazoo's the same with ``cache_implementation="dynamic"`` (no compile).

transformers runs its Gated DeltaNet with fla's kernels when fla is importable, and with FlashQLA's when that is,
else with its PyTorch reference forms: the environment decides, and the ``env`` row records which. Run it once as
is and once with fla (and FlashQLA) on ``PYTHONPATH`` for the two transformers columns.

    python -m lazoo.bench.qwen --out bench_qwen.jsonl
    PYTHONPATH=/tmp/fla-site python -m lazoo.bench.qwen --implementations transformers --out bench_qwen_fla.jsonl

CPU smoke test: ``--device cpu --dtype float32 --layers 4 --hidden-size 64 --vocab-size 256 --prefill 32
--train-length 32 --batch-sizes 1,2 --prompt 8 --new-tokens 4 --repeats 1``.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lazoo_cli.bench import bench_parser

from .report import JsonRows, command_line, error_text, triton_version
from .timing import sync

#: Qwen3.5-0.8B's text configuration as published (transformers' Qwen3_5TextConfig fields)
QWEN3_5_0_8B = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                               "partial_rotary_factor": 0.25})


def text_config(args):
    """The transformers config of the run: Qwen3.5-0.8B's, or a smaller one for smoke tests."""
    from transformers import Qwen3_5TextConfig

    fields = dict(QWEN3_5_0_8B)
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    if args.hidden_size is not None:
        h = args.hidden_size
        fields.update(hidden_size=h, intermediate_size=4 * h, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=h // 2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=h // 4,
                      linear_value_head_dim=h // 4)
    if args.vocab_size is not None:
        fields["vocab_size"] = args.vocab_size
    n = fields["num_hidden_layers"]
    fields["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5TextConfig(**fields)


def build_models(args, folder: Path) -> dict:
    """{"transformers": its model, "lazoo": the converted one}, both on the device in the run's dtype."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialised where it runs (minutes on a CPU at the full size)
        reference = Qwen3_5ForCausalLM(text_config(args)).to(getattr(torch, args.dtype))
    return converted_pair(reference, args, folder)


def converted_pair(reference, args, folder: Path) -> dict:
    """transformers' model `reference` saved in `folder` and converted with ``lazoo.convert``: {"transformers":
    `reference`, "lazoo": the converted model}, those of ``--implementations``, on the device in the run's dtype."""
    from transformers import AutoModelForCausalLM

    import lazoo  # noqa: F401  (registers lazoo's model types)
    from lazoo.convert import convert_checkpoint

    reference.save_pretrained(folder / "transformers")
    convert_checkpoint(folder / "transformers", folder / "lazoo")
    wanted = args.implementations.split(",")
    models = {}
    if "transformers" in wanted:
        models["transformers"] = reference.to(args.device).eval()
    if "lazoo" in wanted:
        models["lazoo"] = AutoModelForCausalLM.from_pretrained(
            folder / "lazoo", dtype=getattr(torch, args.dtype)).to(args.device).eval()
    return models


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_call(model, args, length: int):
    """One prefill of `length` tokens (the base model filling its cache), as a callable."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)

    def call():
        with torch.no_grad():
            model.model(ids, use_cache=True)
    return call


def train_call(model, args):
    """One AdamW training step on ``--train-batch`` × ``--train-length`` tokens, as a callable (the model in train
    mode for the step only)."""
    ids = torch.randint(0, model.config.vocab_size, (args.train_batch, args.train_length), device=args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=str(args.device).startswith("cuda"))

    def call():
        model.train()
        try:
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            model.eval()
    return call


def interleaved(calls: dict, device, repeats: int) -> tuple[dict, dict]:
    """({name: seconds of each of `repeats` rounds}, {name: peak GiB of its warm-up call, on CUDA}) of the
    callables in `calls`, each warmed up once, then called in turns, one call each a round."""
    cuda = str(device).startswith("cuda")
    peaks = {}
    for name, call in calls.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        call()
        sync(device)
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples, peaks


def interleaved_rows(models: dict, args, record) -> None:
    """The prefill and train rows, the implementations in turns (``interleaved``); a row whose call fails records
    its error and leaves the others to go on."""
    kinds = [("prefill", n) for n in map(int, args.prefill.split(","))] + [("train", args.train_length)]
    for kind, size in kinds:
        calls, failed = {}, {}
        for name, model in models.items():
            try:
                calls[name] = prefill_call(model, args, size) if kind == "prefill" else train_call(model, args)
                calls[name]()  # a call that fails here is left out of the rounds
            except Exception as err:  # noqa: BLE001 - recorded; the other implementation goes on
                failed[name] = error_text(err)
                calls.pop(name, None)
        samples, peaks = interleaved(calls, args.device, args.repeats) if calls else ({}, {})
        tokens = size * (args.train_batch if kind == "train" else 1)
        for name in models:
            row = {"implementation": name, "row": kind, "size": size}
            if name in failed:
                row["error"] = failed[name]
            else:
                seconds = statistics.median(samples[name])
                row.update(ms=1000 * seconds, tokens_per_s=tokens / seconds,
                           samples_ms=[round(1000 * t, 3) for t in samples[name]])
                if name in peaks:
                    row["peak_gb"] = peaks[name]
            record(row)
        for model in models.values():
            model.zero_grad(set_to_none=True)
        calls.clear()
        gc.collect()
        if str(args.device).startswith("cuda"):
            torch.cuda.empty_cache()


def generate_row(model, args, batch: int, **options) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), device=args.device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, **options)
    n = args.new_tokens
    with torch.no_grad():
        first = timed(lambda: model.generate(ids, max_new_tokens=1, **kwargs), args.device, args.repeats)
        whole = timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs), args.device,
                      args.repeats)
    per_token = (whole - first) / (n - 1)
    return {"prefill_ms": 1000 * first, "ms_per_token": 1000 * per_token, "tokens_per_s": batch / per_token}


def agreement_row(models: dict, args, length: int = 512) -> dict:
    """How far lazoo's logits are from transformers' on one prompt (same weights, the run's dtype): the relative
    difference, and the share of positions whose greedy next token is the same."""
    ids = torch.randint(0, models["lazoo"].config.vocab_size, (2, length), device=args.device)
    with torch.no_grad():
        ours, theirs = (models[name](ids, use_cache=False).logits.float() for name in ("lazoo", "transformers"))
    return {"relative_difference": ((ours - theirs).norm() / theirs.norm()).item(),
            "same_argmax": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


def environment(args) -> dict:
    import transformers

    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
            "triton": triton_version(), "transformers": transformers.__version__,
            "fla": importlib.util.find_spec("fla") is not None,
            "flash_qla": importlib.util.find_spec("flash_qla") is not None,
            "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
            "command": command_line("qwen")}


def run(args) -> list[dict]:
    with JsonRows(args.out) as rows:
        rows.record({"env": environment(args)})
        with tempfile.TemporaryDirectory() as folder:
            models = build_models(args, Path(folder))
        measure_models(models, args, rows.record)
    return rows


def measure_models(models: dict, args, record) -> None:
    """The ``agreement`` row (both implementations there), the prefill and train rows (``interleaved_rows``), then
    each implementation's generate rows (lazoo's eager generation too), each passed to ``record`` as it is measured;
    a failed row records its error."""
    if len(models) == 2:
        try:
            record({"row": "agreement", "size": 512, **agreement_row(models, args)})
        except Exception as err:  # noqa: BLE001 - recorded; the timings go on
            record({"row": "agreement", "error": error_text(err)})
    interleaved_rows(models, args, record)
    for name, model in models.items():
        batches = list(map(int, args.batch_sizes.split(",")))
        steps = [("generate", batch, lambda m, b: generate_row(m, args, b)) for batch in batches]
        if name == "lazoo":  # lazoo's eager path, beside its default (on CUDA, compiled)
            steps += [("generate-eager", batch, lambda m, b: generate_row(m, args, b, cache_implementation="dynamic"))
                      for batch in batches]
        for kind, size, measure in steps:
            row = {"implementation": name, "row": kind, "size": size}
            try:
                row.update(measure(model, size))
            except Exception as err:  # noqa: BLE001 - a failed row is recorded; the run goes on
                row["error"] = error_text(err)
            if str(args.device).startswith("cuda"):
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            record(row)
            gc.collect()


def main(argv=None) -> None:
    args = bench_parser("qwen", prog="python -m lazoo.bench.qwen").parse_args(argv)
    run(args)


if __name__ == "__main__":
    main()
