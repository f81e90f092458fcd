"""What `lazoo train` and the demo build before training, each problem one `CLIError` line naming the option:
the model's sizes from the command line, the tokenizer and the training and held-out blocks of a text, and a
fresh model of a layout."""

from __future__ import annotations

import os

from transformers import AutoModelForCausalLM

from lazoo_cli.parser import DEFAULT_SIZES, SIZE_FLAGS

from .data import build_lm_datasets
from .presets import build_config
from .user_input import CLIError

__all__ = ["model_sizes", "load_lm_data", "load_blocks", "check_batch_fits", "build_model"]


def model_sizes(args, layout: str | None = None) -> dict:
    """Sizes given on the command line, completed by DEFAULT_SIZES unless the layout is a config file
    (`layout` defaults to `args.config`)."""
    layout = args.config if layout is None else layout
    given = {key: getattr(args, flag) for flag, key in SIZE_FLAGS.items()}
    from_file = layout.endswith(".json")
    sizes = {} if from_file else dict(DEFAULT_SIZES)
    sizes.update({k: v for k, v in given.items() if v is not None})
    if "hidden_size" in sizes and not from_file:
        sizes["intermediate_size"] = 2 * sizes["hidden_size"]
    return sizes


def load_lm_data(corpus, layout: str, sizes: dict, block_size: int, eval_blocks: int, seed: int,
                 max_train_blocks: int | None = None, tokenizer=None):
    """Corpus -> BPE tokenizer (vocab from `sizes`, else the layout's config; or `tokenizer`, a tokenizer or a
    folder, when given) -> train/held-out blocks. Pops "vocab_size" from `sizes` (the model takes the tokenizer's)."""
    vocab_size = sizes.pop("vocab_size", None) or build_config(layout).vocab_size
    data = build_lm_datasets(corpus, tokenizer, block_size=block_size, vocab_size=vocab_size,
                             max_eval_blocks=eval_blocks, max_train_blocks=max_train_blocks, seed=seed)
    print(f"[lazoo] corpus: {len(data.train)} train / {len(data.eval)} held-out blocks of {block_size} tokens, "
          f"vocab {len(data.tokenizer)}")
    return data


def load_blocks(text, layout, sizes, seq_len, eval_blocks, seed, flags=("--text", "--seq-len"), **options):
    """load_lm_data, with a problem of the text (missing, empty, not UTF-8, too short for one training and one
    held-out block) as one line naming the option."""
    from .data.lm import CorpusTooSmallError

    text_flag, len_flag = flags
    try:
        data = load_lm_data(text, layout, sizes, seq_len, eval_blocks, seed, **options)
    except CorpusTooSmallError as err:
        raise CLIError(f"{text_flag}: {err}; give a longer text or a smaller {len_flag}") from err
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(f"{text_flag}: {err}") from err
    if len(data.train) == 0 or len(data.eval) == 0:
        raise CLIError(f"the text gives {len(data.train)} training and {len(data.eval)} held-out blocks of "
                       f"{len_flag} {seq_len} tokens (5% of the documents are held out); give a longer text "
                       f"or a smaller {len_flag}")
    return data


def check_batch_fits(batch_size: int, grad_accum: int, train_blocks: int) -> None:
    """An optimizer step reads batch size x accumulation blocks on each process: more than the text gives
    would silently train on smaller batches than asked (and say the asked size in the card)."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = batch_size * grad_accum * processes
    if per_step > train_blocks:
        times = "".join(f" x {n} {what}" for n, what in ((grad_accum, "accumulation steps"), (processes, "processes"))
                        if n > 1)
        raise CLIError(f"--batch-size {batch_size}{times} asks for {per_step} blocks per step, more than the "
                       f"{train_blocks} training blocks the text gives; give a smaller --batch-size or a longer text")


def _new_model(layout: str, tokenizer, sizes: dict):
    """A fresh causal LM of `layout` sized by `sizes`, with the tokenizer's vocabulary and special tokens."""
    config = build_config(layout, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[lazoo] model: {config.model_type}, layers {config.layer_types}, {n_params / 1e6:.2f}M parameters")
    return model


def build_model(layout: str, tokenizer, sizes: dict, flag: str = "--config"):
    """A fresh causal LM of `layout` sized by `sizes`, with the tokenizer's vocabulary and special tokens; a
    config the sizes make invalid, or a model too large for this machine's memory, is one line."""
    try:
        return _new_model(layout, tokenizer, sizes)
    except ValueError as err:
        raise CLIError(f"{flag} {layout}: {err}") from err
    except (MemoryError, RuntimeError) as err:
        if not isinstance(err, MemoryError) and "alloc" not in str(err):  # torch's allocator failing
            raise
        raise CLIError(f"{flag} {layout}: the model of sizes {sizes} does not fit in memory ({str(err)[:120]}); "
                       "give smaller --hidden-size, --layers or --vocab-size") from err
