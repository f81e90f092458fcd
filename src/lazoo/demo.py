"""`lazoo demo`: train a small GPT-style model with `transformers.Trainer` on the embedded corpus, report
held-out perplexity before and after, save it, reload it through the Auto classes, and generate."""

from __future__ import annotations

import math
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, set_seed

from lazoo_cli.parser import DEFAULT_SIZES, SIZE_FLAGS, SIZE_LIMITS, add_size_arguments, command_parser

from .config_checks import check_layout
from .runtime import progress_bars, set_cpu_threads
from .sampling import sample_text
from .trainer import make_trainer
from .training import build_model, check_batch_fits, load_blocks, model_sizes
from .user_input import (
    COUNT_LIMITS,
    CLIError,
    check_counts,
    check_input_path,
    check_new_folder,
    check_positive_float,
    check_range,
    check_text,
)

# the size options live with the parser (lazoo_cli.parser, importable without torch), the sizes, the Trainer and
# sampling in their own modules; named here as before
__all__ = ["DEFAULT_SIZES", "SIZE_FLAGS", "SIZE_LIMITS", "add_size_arguments", "main", "run", "parse_args",
           "check_args", "model_sizes", "make_trainer", "sample_text"]


def parse_args(argv=None):
    """`lazoo demo`'s options (lazoo_cli.parser), checked."""
    args = command_parser("demo").parse_args(argv)
    check_args(args)
    return args


def check_args(args) -> None:
    """Refuse nonsense numbers, unreadable input, text that is not UTF-8, and a model folder with files in it
    (unless --overwrite), before any work (`CLIError`: one line, status 2)."""
    check_layout(args.config, "--config", args)
    check_input_path("--text", args.text, "a .txt/.jsonl file or a folder of .txt files")
    check_counts(args, ("seq_len", "batch_size", "steps", "eval_blocks", "max_new_tokens"))
    check_counts(args, (*SIZE_FLAGS, "threads"), allow_none=True)
    check_range("--seed", args.seed, 0, COUNT_LIMITS["seed"])
    check_positive_float("--lr", args.lr)
    check_text("--prompt", args.prompt)
    save_dir = os.path.join(args.output, "model")
    check_new_folder("--output", args.output)
    if not args.overwrite and os.path.isdir(save_dir) and os.listdir(save_dir):
        raise CLIError(f"{save_dir!r} is not empty: the demo saves its model there and does not replace files "
                       "it did not write; choose another --output or pass --overwrite")


def perplexity(trainer: Trainer) -> float:
    return math.exp(trainer.evaluate()["eval_loss"])


def main(argv=None) -> dict:
    """`lazoo demo` from a list of arguments: bad input raises `CLIError` (`lazoo demo` prints it in one line)."""
    return run(parse_args(argv))


def run(args) -> dict:
    """The demo on checked arguments (`parse_args`): train, evaluate, save, reload, sample."""
    set_seed(args.seed)
    set_cpu_threads(args.threads)
    with progress_bars(not args.no_progress):
        return _train_save_reload_sample(args)


def _train_save_reload_sample(args) -> dict:
    start = time.time()
    sizes = model_sizes(args)
    data = load_blocks(args.text, args.config, sizes, args.seq_len, args.eval_blocks, args.seed)
    check_batch_fits(args.batch_size, 1, len(data.train))
    tok = data.tokenizer
    model = build_model(args.config, tok, sizes)

    trainer = make_trainer(model, data, args.output, args.steps, args.batch_size, args.lr, args.seed,
                           progress=not args.no_progress)
    ppl_before = perplexity(trainer)
    print(f"[lazoo] held-out perplexity before training: {ppl_before:.1f}")
    trainer.train()
    ppl_after = perplexity(trainer)
    print(f"[lazoo] held-out perplexity after {args.steps} steps: {ppl_after:.1f} (was {ppl_before:.1f})")

    save_dir = os.path.join(args.output, "model")
    trainer.save_model(save_dir)
    tok.save_pretrained(save_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(save_dir)
    probe = torch.tensor([data.eval[0]["input_ids"][:32]], device=reloaded.device)
    model.eval()
    with torch.no_grad():
        same = torch.equal(model(probe.to(model.device)).logits.cpu(), reloaded(probe).logits.cpu())
    print(f"[lazoo] saved to {save_dir}; reloaded with AutoModelForCausalLM/AutoTokenizer; identical logits: {same}")

    sample = sample_text(reloaded, reloaded_tok, args.prompt, args.max_new_tokens, args.seed)
    print(f"[lazoo] sample: {sample}")
    print(f"[lazoo] done in {time.time() - start:.0f} s")
    return {"perplexity_before": ppl_before, "perplexity_after": ppl_after, "identical_logits": same,
            "sample": sample, "save_dir": save_dir}


if __name__ == "__main__":
    import sys

    from lazoo_cli import main as cli_main

    sys.exit(cli_main(["demo", *sys.argv[1:]]))
