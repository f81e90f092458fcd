"""The `lazoo` command line's parser, buildable without the model stack: this module imports only the standard
library, so `lazoo <command> --help` and argument errors answer at once. What the help texts name that lives in
the heavy modules (layout names, eval tasks) is a static list here that a test checks against the real one.

One vocabulary for the commands that train or evaluate (train, demo, eval; convert's output): `--config`,
`--text`, `--output`, `--seq-len`, `--steps`, `--batch-size`, `--lr`, `--eval-blocks`, `--threads`, `--seed`,
`--no-progress`, `--overwrite`. The demo's older names (`--mechanism`, `--corpus`, `--output-dir`,
`--block-size`) still work, hidden from `--help`, and say once that they are deprecated.
"""

from __future__ import annotations

import argparse
import sys

from .bench import BENCHMARKS

#: `lazoo.presets.known_layouts()`: the mechanisms, then the hybrid presets (tests/cli/test_cli_surface.py checks it)
LAYOUTS = ("softmax", "sliding_window", "delta_net", "gated_delta_net", "delta_product", "kda", "linear",
           "gated_linear", "ela", "gla", "local_linear", "mamba2", "mla", "ovq", "vq", "rls", "titans", "ttt_linear",
           "ttt_mlp", "vla",
           "sw-vla", "sw-gdn", "sw-softmax", "sw-ovq", "sw-nope", "sw-vq", "gdn-ovq", "kda-mla")
#: `lazoo.eval.local_tasks.TASKS`: lazoo eval's local tasks (checked by the same test)
EVAL_TASKS = ("lazoo_kjv_ppl", "lazoo_kjv_next_verse", "lazoo_mqar")

#: model sizes for a layout given by name; a config file's own sizes take their place
DEFAULT_SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 64,
                 "vocab_size": 4096}
#: command-line flag -> config field, for the size options shared by `lazoo demo` and `lazoo train`
SIZE_FLAGS = {"hidden_size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "sliding_window": "sliding_window", "vocab_size": "vocab_size"}
#: the largest size each option accepts (larger models than these do not fit a machine; a BPE vocabulary is
#: allocated up front)
SIZE_LIMITS = {"hidden_size": 16384, "layers": 1024, "heads": 1024, "sliding_window": 2**20, "vocab_size": 2**20}

#: the lowest --temperature: below it the scaled logits overflow to inf and sampling fails
MIN_TEMPERATURE = 0.01

#: the demo's former option names -> the names every command uses now
DEPRECATED_DEMO_OPTIONS = {"--mechanism": "--config", "--corpus": "--text", "--output-dir": "--output",
                           "--block-size": "--seq-len"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in one line, like lazoo's own (`--help` still shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class DeprecatedAlias(argparse.Action):
    """A former option name, hidden from `--help`: it sets the option that replaced it and says so on stderr,
    once per command line (each parse builds its parser anew)."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement
        self.told = False

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if not self.told:
            self.told = True
            print(f"{parser.prog}: {option_string} is deprecated; use {self.replacement} (the same option)",
                  file=sys.stderr)


# ============================================================================ option groups shared by commands
def add_size_arguments(p: argparse.ArgumentParser) -> None:
    """The model size options (`--hidden-size`, `--layers`, `--heads`, `--sliding-window`, `--vocab-size`)."""
    for flag, key in SIZE_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help=f"(default: the config file's, else {DEFAULT_SIZES[key]}; at most {SIZE_LIMITS[flag]})")


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch, at most this machine's cores (default: OMP_NUM_THREADS or "
                        "MKL_NUM_THREADS where set, else all cores)")


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (training, dataset preparation, model loading and saving)")


def add_text_arguments(p: argparse.ArgumentParser, seq_len: int) -> None:
    """What to train on: the text, the block length, the held-out blocks."""
    p.add_argument("--text", default=None, metavar="FILE",
                   help="a .txt (blank-line separated documents) or .jsonl ('text' field) file, or a folder of .txt "
                        "files (default: the King James Bible)")
    p.add_argument("--seq-len", type=int, default=seq_len,
                   help=f"tokens per training block (default: {seq_len}; at most 2^20)")
    p.add_argument("--eval-blocks", type=int, default=48, help="held-out blocks for the perplexity (default: 48)")


def add_optimizer_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default: {steps}; at most 10^9)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="blocks per step (default: 16), at most the training blocks the text gives (lazoo train: "
                        "batch size x --grad-accum x processes)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, cosine schedule (default: 2e-3)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """--seed, --threads, --no-progress: how a run goes, not what it computes."""
    p.add_argument("--seed", type=int, default=0, help="random seed, 0 to 2^32-1 (default: 0)")
    add_threads_argument(p)
    add_progress_argument(p)


def _layout_help() -> str:
    return f"a layout ({', '.join(LAYOUTS)}) or a config .json (see configs/)"


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options of longer runs (also what scripts/train_lm.py documents): precision, packing, accumulation,
    checkpoints and resume, activation checkpointing, logging."""
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (CUDA, or CPU autocast)")
    p.add_argument("--packing", action="store_true",
                   help="cut every block after each eos and train on the documents packed in one row with "
                        "restarting position_ids (DataCollatorWithFlattening): no document sees another")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: 1; at most 2^20)")
    p.add_argument("--save-steps", type=int, default=None,
                   help="save a checkpoint (model, optimizer, scheduler, RNG) to --output every N steps; each is "
                        "written under a temporary name and renamed to checkpoint-N when complete, so an interrupted "
                        "save never leaves a broken checkpoint")
    p.add_argument("--save-total-limit", type=int, default=None, help="keep at most this many checkpoints")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from the last complete checkpoint in --output, passing over (and naming) incomplete "
                        "ones, or from the given checkpoint folder")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer in backward (under FSDP set fsdp_activation_checkpointing instead)")
    p.add_argument("--logging-steps", type=int, default=None, help="log the loss every N steps (default: steps/10)")


# ============================================================================ one function per command
def _add_list(sub) -> None:
    p = sub.add_parser("list", help="mechanisms, their backends and Triton kernels, hybrid presets",
                       description="List every mechanism (config.layer_types name, model type), the backends its "
                       "op has (recurrent, chunk, triton) and the Triton kernel modules, read from the code.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-v", "--verbose", action="store_true", help="also print one line about each mechanism")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a causal LM with Trainer on a text file or the KJV corpus",
                       description="Train a lazoo causal LM with transformers.Trainer on a text file (or the King "
                       "James Bible shipped with lazoo), with a byte-level BPE tokenizer trained on the text; save "
                       "model, tokenizer and model card to --output and print the held-out perplexity.")
    p.add_argument("--config", required=True, metavar="LAYOUT", help=_layout_help())
    p.add_argument("--output", required=True, metavar="DIR", help="folder for model, tokenizer and README.md")
    add_text_arguments(p, seq_len=128)
    add_optimizer_arguments(p, steps=200)
    add_size_arguments(p)
    p.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training blocks")
    add_run_arguments(p)
    p.add_argument("--overwrite", action="store_true",
                   help="train into a non-empty --output, replacing the files lazoo train writes there (model, "
                        "tokenizer, README.md; Trainer may delete older checkpoint-N folders). Without it a new "
                        "run needs a new or empty folder")
    add_training_arguments(p)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a saved model",
                       description="Load a saved lazoo causal LM and its tokenizer and print the prompt with its "
                       "continuation (sampled with temperature and top-k, or greedy).")
    p.add_argument("model_dir", metavar="DIR", help="a folder written by `lazoo train` (or save_pretrained)")
    p.add_argument("--prompt", default="", help="the text to continue (default: start from the bos token)")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate, 1 to 2^20 (default: 50)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic)")
    mode.add_argument("--temperature", type=float, default=None,
                      help=f"sampling temperature, at least {MIN_TEMPERATURE} (default: 1.0)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 = all (default: 40)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--static", dest="static", action="store_const", const=True, default=None,
                       help="the static cache also off CUDA (on CUDA it is the default: the decode steps are compiled "
                       "and replayed as CUDA graphs); the same tokens")
    cache.add_argument("--eager", dest="static", action="store_const", const=False,
                       help="the dynamic cache and no compile, also on CUDA; the same tokens")
    add_run_arguments(p)


def _add_card(sub) -> None:
    p = sub.add_parser("card", help="(re)write the model card README.md of a saved model",
                       description="Write DIR/README.md, the model card (mechanisms, equations, sources, config), "
                       "from the saved config, with measured metrics if given. Replaces a card lazoo wrote; any "
                       "other README.md only with --overwrite.")
    p.add_argument("model_dir", metavar="DIR", help="a saved lazoo model folder")
    p.add_argument("--metrics", default=None, metavar="JSON",
                   help="metrics as a JSON object ('{\"eval_perplexity\": 12.3}') or a path to a .json file")
    p.add_argument("--training-data", default=None, metavar="TEXT", help="a sentence about the training data")
    p.add_argument("--overwrite", action="store_true", help="replace a README.md that lazoo did not write")


def _add_cards(sub) -> None:
    p = sub.add_parser("cards", help="(re)write model_cards/: the card of every ready config in configs/",
                       description="Write OUTPUT/<name>.md, the model card of each lazoo language-model config "
                       "CONFIGS/<name>.json (mechanisms from their declarations, the config's options), and "
                       "remove the cards it generated for configs that are gone. With --check, write nothing: "
                       "say whether every card is up to date, list the stale ones and exit 1 if there are any.")
    p.add_argument("--configs", default="configs", metavar="DIR", help="the config folder (default: configs)")
    p.add_argument("--output", default="model_cards", metavar="DIR", help="the card folder (default: model_cards)")
    p.add_argument("--check", action="store_true", help="only report: up to date (exit 0) or the stale cards (exit 1)")


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a fla, Qwen3.5, Qwen3-Next, Mamba-2, Bamba or Kimi Linear checkpoint "
                       "into a lazoo folder",
                       description="Read a checkpoint folder (config.json + safetensors weights, sharded or not) and "
                       "write the lazoo folder DST (or --output DST): config, weights, tokenizer files, a model card "
                       "naming the source, and the trust_remote_code code. Sources: fla (model_type transformer, "
                       "gla, delta_net, gated_deltanet, kda and their hybrids with attention layers, and mamba2) and "
                       "transformers' "
                       "Qwen3.5 (qwen3_5, qwen3_5_text), Qwen3.5-MoE (qwen3_5_moe, qwen3_5_moe_text), Qwen3-Next "
                       "(qwen3_next), Mamba-2 (mamba2), Bamba (bamba) and Kimi Linear (kimi_linear); of a "
                       "vision-language folder the language model is converted and the vision tower left out (said "
                       "on the command line and in the card). DST must be new or empty. A checkpoint that uses an "
                       "option lazoo cannot express exactly is refused, naming the field; nothing is written then.")
    p.add_argument("src", metavar="SRC", help="the checkpoint folder")
    p.add_argument("dst", metavar="DST", nargs="?", default=None, help="the lazoo folder to write (new or empty)")
    p.add_argument("--output", default=None, metavar="DST", help="the same as DST, in train's and eval's words")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on a CUDA GPU (lazoo.bench)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run a benchmark of lazoo.bench (the same as python -m lazoo.bench.NAME);\n"
                       "the arguments after the name are the benchmark's (`lazoo bench kernels --help`).",
                       epilog="benchmarks:\n" + "\n".join(f"  {name:14s}{bench.summary}"
                                                          for name, bench in BENCHMARKS.items()))
    p.add_argument("which", metavar="NAME", choices=list(BENCHMARKS), help="a benchmark (below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")


EVAL_DESCRIPTION = ("Evaluate saved lazoo models (each folder with its tokenizer) with lm-evaluation-harness on "
                    "lazoo's local, offline tasks; print one table (rows: models, columns: task metrics). Needs "
                    "pip install 'lazoo[eval]'.")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL", help="saved model folders (save_pretrained of model and "
                   "tokenizer)")
    p.add_argument("--tasks", default=",".join(EVAL_TASKS),
                   help=f"comma-separated local tasks (default: all: {','.join(EVAL_TASKS)})")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (an integer), or a fraction of each task if below 1")
    p.add_argument("--batch-size", type=int, default=1, help="requests per forward pass (default: 1)")
    p.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    p.add_argument("--max-length", type=int, default=None,
                   help="context window for lm-eval (default: the model config's max_position_embeddings)")
    p.add_argument("--bootstrap-iters", type=int, default=0,
                   help="lm-eval bootstrap iterations for standard errors (default 0: none, fast)")
    p.add_argument("--task-dir", default=None,
                   help="write the task data and YAMLs here and keep them (default: a temporary folder)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the metrics (and lm-eval's per-task configs) as JSON")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --output file, or task files in --task-dir, that lazoo eval did not write")
    add_threads_argument(p)
    add_progress_argument(p)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate saved models (lm-eval bridge; pip install 'lazoo[eval]')",
                       description=EVAL_DESCRIPTION)
    add_eval_arguments(p)


DEMO_DESCRIPTION = ("The main job: train a small GPT-style model with transformers.Trainer on the embedded corpus "
                    "(or --text), report held-out perplexity before and after, save it in OUTPUT/model, reload it "
                    "through the Auto classes, and generate.")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="sw-vla", metavar="LAYOUT", help=f"{_layout_help()} (default: sw-vla)")
    p.add_argument("--output", default="outputs/demo", metavar="DIR",
                   help="the run's folder; the model is saved in DIR/model (default: outputs/demo)")
    add_text_arguments(p, seq_len=128)
    add_optimizer_arguments(p, steps=250)
    add_size_arguments(p)
    p.add_argument("--prompt", default="And God said,", help="the text the sample continues")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens to sample (default: 40)")
    add_run_arguments(p)
    p.add_argument("--overwrite", action="store_true",
                   help="save into a non-empty DIR/model, replacing the files a save writes there")
    types = {"--block-size": int}
    for old, new in DEPRECATED_DEMO_OPTIONS.items():
        p.add_argument(old, dest=new[2:].replace("-", "_"), type=types.get(old), action=DeprecatedAlias,
                       replacement=new)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train, evaluate, save, reload and sample a small model",
                       description=DEMO_DESCRIPTION)
    add_demo_arguments(p)


COMMANDS = {"list": _add_list, "train": _add_train, "generate": _add_generate, "card": _add_card,
            "cards": _add_cards, "convert": _add_convert, "bench": _add_bench, "eval": _add_eval, "demo": _add_demo}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="lazoo", description="lazoo: linear-time and hybrid attention models for Hugging Face Transformers",
        epilog="Run `lazoo <command> --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for add in COMMANDS.values():
        add(sub)
    return parser


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command on its own (`lazoo.eval.main(argv)`, `lazoo.demo.main(argv)`)."""
    sub = ArgumentParser(prog="lazoo").add_subparsers(dest="command")
    COMMANDS[command](sub)
    return sub.choices[command]
