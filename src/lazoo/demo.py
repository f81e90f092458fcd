"""The main job: train a small GPT-style model with `transformers.Trainer` on the embedded corpus,
report held-out perplexity before and after, save it, reload it through the Auto classes, and generate."""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments,
                          default_data_collator, set_seed)

from .data import build_lm_datasets
from .presets import build_config, known_layouts


#: model sizes for a layout given by name; a config file's own sizes take their place
DEFAULT_SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 64,
                 "vocab_size": 4096}


def model_sizes(args) -> dict:
    """Sizes given on the command line, completed by DEFAULT_SIZES unless the layout is a config file."""
    given = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "sliding_window": args.sliding_window, "vocab_size": args.vocab_size}
    sizes = {} if args.mechanism.endswith(".json") else dict(DEFAULT_SIZES)
    sizes.update({k: v for k, v in given.items() if v is not None})
    if "hidden_size" in sizes and not args.mechanism.endswith(".json"):
        sizes["intermediate_size"] = 2 * sizes["hidden_size"]
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="lazoo demo", description=__doc__)
    p.add_argument("--mechanism", default="sw-vla",
                   help=f"layout: one of {', '.join(known_layouts())}, or a config .json (see configs/)")
    p.add_argument("--corpus", default=None, help="a .txt/.jsonl file or folder (default: the embedded King James Bible)")
    def size_help(key):
        return f"(default: the config file's, else {DEFAULT_SIZES[key]})"

    p.add_argument("--hidden-size", type=int, default=None, help=size_help("hidden_size"))
    p.add_argument("--layers", type=int, default=None, help=size_help("num_hidden_layers"))
    p.add_argument("--heads", type=int, default=None, help=size_help("num_attention_heads"))
    p.add_argument("--sliding-window", type=int, default=None, help=size_help("sliding_window"))
    p.add_argument("--vocab-size", type=int, default=None, help=size_help("vocab_size"))
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-blocks", type=int, default=48, help="held-out blocks for perplexity")
    p.add_argument("--output-dir", default="outputs/demo")
    p.add_argument("--prompt", default="And God said,")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def perplexity(trainer: Trainer) -> float:
    return math.exp(trainer.evaluate()["eval_loss"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_seed(args.seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    start = time.time()

    sizes = model_sizes(args)
    vocab_size = sizes.pop("vocab_size", None) or build_config(args.mechanism).vocab_size
    data = build_lm_datasets(args.corpus, block_size=args.block_size, vocab_size=vocab_size,
                             max_eval_blocks=args.eval_blocks, seed=args.seed)
    tok = data.tokenizer
    print(f"[lazoo] corpus: {len(data.train)} train / {len(data.eval)} held-out blocks of {args.block_size} tokens, "
          f"vocab {len(tok)}")

    config = build_config(args.mechanism, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sizes)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[lazoo] model: {config.model_type}, layers {config.layer_types}, {n_params / 1e6:.2f}M parameters")

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20), weight_decay=0.01, max_grad_norm=1.0, logging_steps=max(1, args.steps // 10),
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data.train, eval_dataset=data.eval,
                      data_collator=default_data_collator)
    ppl_before = perplexity(trainer)
    print(f"[lazoo] held-out perplexity before training: {ppl_before:.1f}")
    trainer.train()
    ppl_after = perplexity(trainer)
    print(f"[lazoo] held-out perplexity after {args.steps} steps: {ppl_after:.1f} (was {ppl_before:.1f})")

    save_dir = os.path.join(args.output_dir, "model")
    trainer.save_model(save_dir)
    tok.save_pretrained(save_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(save_dir)
    probe = torch.tensor([data.eval[0]["input_ids"][:32]], device=reloaded.device)
    model.eval()
    with torch.no_grad():
        same = torch.equal(model(probe.to(model.device)).logits.cpu(), reloaded(probe).logits.cpu())
    print(f"[lazoo] saved to {save_dir}; reloaded with AutoModelForCausalLM/AutoTokenizer; identical logits: {same}")

    inputs = reloaded_tok(args.prompt, return_tensors="pt")
    set_seed(args.seed)
    with torch.no_grad():
        out = reloaded.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=40,
                                temperature=0.8, pad_token_id=reloaded_tok.pad_token_id)
    sample = reloaded_tok.decode(out[0], skip_special_tokens=True)
    print(f"[lazoo] sample: {sample}")
    print(f"[lazoo] done in {time.time() - start:.0f} s")
    return {"perplexity_before": ppl_before, "perplexity_after": ppl_after, "identical_logits": same,
            "sample": sample, "save_dir": save_dir}


if __name__ == "__main__":
    main()
