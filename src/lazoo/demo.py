"""The main job: train a small GPT-style model with `transformers.Trainer` on the embedded corpus,
report held-out perplexity before and after, save it, reload it through the Auto classes, and generate."""

from __future__ import annotations

import math
import os
import re
import shutil
import time

import torch
from lazoo_cli.parser import DEFAULT_SIZES, SIZE_FLAGS, SIZE_LIMITS, add_size_arguments, command_parser
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer,
                          TrainingArguments, default_data_collator, set_seed)
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from .data import build_lm_datasets
from .presets import build_config

# the size options live with the parser (lazoo_cli.parser, importable without torch); named here as before
__all__ = ["DEFAULT_SIZES", "SIZE_FLAGS", "SIZE_LIMITS", "add_size_arguments", "main", "run", "parse_args",
           "check_args", "model_sizes", "make_trainer", "sample_text"]


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


def parse_args(argv=None):
    """`lazoo demo`'s options (lazoo_cli.parser), checked."""
    args = command_parser("demo").parse_args(argv)
    check_args(args)
    return args


def check_args(args) -> None:
    """Refuse nonsense numbers, unreadable input, text that is not UTF-8, and a model folder with files in it
    (unless --overwrite), before any work (`CLIError`: one line, status 2)."""
    from . import cli

    cli.check_layout(args.config, "--config", args)
    cli.check_input_path("--text", args.text, "a .txt/.jsonl file or a folder of .txt files")
    cli.check_counts(args, ("seq_len", "batch_size", "steps", "eval_blocks", "max_new_tokens"))
    cli.check_counts(args, (*SIZE_FLAGS, "threads"), allow_none=True)
    cli.check_range("--seed", args.seed, 0, cli.COUNT_LIMITS["seed"])
    cli.check_positive_float("--lr", args.lr)
    cli.check_text("--prompt", args.prompt)
    save_dir = os.path.join(args.output, "model")
    cli.check_new_folder("--output", args.output)
    if not args.overwrite and os.path.isdir(save_dir) and os.listdir(save_dir):
        raise cli.CLIError(f"{save_dir!r} is not empty: the demo saves its model there and does not replace files "
                           "it did not write; choose another --output or pass --overwrite")


def perplexity(trainer: Trainer) -> float:
    return math.exp(trainer.evaluate()["eval_loss"])


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


def build_model(layout: str, tokenizer, sizes: dict):
    """A fresh causal LM of `layout` sized by `sizes`, with the tokenizer's vocabulary and special tokens."""
    config = build_config(layout, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[lazoo] model: {config.model_type}, layers {config.layer_types}, {n_params / 1e6:.2f}M parameters")
    return model


class PackedDocumentsCollator:
    """Blocks -> their documents (each block cut after every eos) packed in one row with `position_ids` that
    restart at 0 per document and labels -100 at each document's first token (`DataCollatorWithFlattening`);
    lazoo models keep packed documents apart. Same tokens per batch as the padded blocks."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.flatten = DataCollatorWithFlattening(return_tensors="pt")

    def split(self, ids: list[int]) -> list[list[int]]:
        cuts = [i + 1 for i, t in enumerate(ids[:-1]) if t == self.eos_token_id]
        return [ids[s:e] for s, e in zip([0, *cuts], [*cuts, len(ids)])]

    def __call__(self, features):
        docs = [doc for f in features for doc in self.split(list(f["input_ids"]))]
        return self.flatten([{"input_ids": doc, "labels": doc} for doc in docs])


class _CheckpointConfigVersion:
    """Stands in for `PreTrainedConfig` in `Trainer._load_from_checkpoint`, which builds the base config class
    from the checkpoint's config.json only to compare `transformers_version`: the base class validates
    `layer_types` against transformers' own attention kinds and refuses lazoo's mechanism names."""

    @staticmethod
    def from_json_file(path):
        import json
        from types import SimpleNamespace

        with open(path, encoding="utf-8") as f:
            return SimpleNamespace(transformers_version=json.load(f).get("transformers_version"))


#: a checkpoint being written: `<output>/.lazoo-saving-checkpoint-N/checkpoint-N`, renamed to
#: `<output>/checkpoint-N` once complete. The name is not matched by Trainer's `checkpoint-*` (Trainer neither
#: resumes from it nor rotates it), and a leftover one is recognisably lazoo's: an interrupted save
STAGING_PREFIX = ".lazoo-saving-"
STAGING_NAME = re.compile(r"^\.lazoo-saving-checkpoint-[0-9]+$")
#: the checkpoint folders Trainer writes (and `get_last_checkpoint` reads)
CHECKPOINT_NAME = re.compile(r"^checkpoint-([0-9]+)$")


def is_complete_checkpoint(folder) -> bool:
    """Trainer writes trainer_state.json last: a checkpoint folder without it is an interrupted save (or not
    a checkpoint at all)."""
    return os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME))


def checkpoint_step(folder) -> int | None:
    """N of a folder named checkpoint-N, else None."""
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def staging_leftovers(folder) -> list[str]:
    """The staging folders of interrupted checkpoint saves in `folder` (lazoo's own, by their name)."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if STAGING_NAME.match(n) and os.path.isdir(os.path.join(folder, n)))


def _set_aside_incomplete(folder: str) -> None:
    """An incomplete checkpoint-N where this run saves step N (a save interrupted before checkpoints were
    written atomically): an empty one is removed (rmdir refuses any other); any other is kept, renamed
    incomplete-checkpoint-N (a name neither Trainer nor its rotation looks at)."""
    try:
        os.rmdir(folder)
        return
    except OSError:
        pass
    parent, name = os.path.split(os.path.normpath(folder))
    target, k = os.path.join(parent, f"incomplete-{name}"), 1
    while os.path.exists(target):
        k += 1
        target = os.path.join(parent, f"incomplete-{name}.{k}")
    os.replace(folder, target)
    print(f"[lazoo] {folder} had no trainer_state.json (an interrupted save); kept as {target}")


def _publish_checkpoint(staging: str, name: str, run_dir: str) -> None:
    """Rename the complete `staging/name` to `run_dir/name` in one step. A checkpoint of the same step already
    there (a resumed run saving a step again) is moved into the staging folder first, and goes with it."""
    final = os.path.join(run_dir, name)
    if os.path.isdir(final):
        if is_complete_checkpoint(final):
            os.replace(final, os.path.join(staging, "replaced"))
        else:
            _set_aside_incomplete(final)
    os.replace(os.path.join(staging, name), final)
    shutil.rmtree(staging)


def rotate_complete_checkpoints(run_dir: str, save_total_limit: int | None) -> None:
    """Trainer's rotation (keep the newest `save_total_limit`, oldest deleted first, by mtime as Trainer
    does) over complete checkpoints only: a checkpoint-N without trainer_state.json is never deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return
    complete = [c for c in sort_checkpoints(run_dir, use_mtime=True) if is_complete_checkpoint(c)]
    for old in complete[:-save_total_limit]:
        shutil.rmtree(old, ignore_errors=True)


class LazooTrainer(Trainer):
    """`Trainer` that can resume lazoo models from a checkpoint (`resume_from_checkpoint`) and writes each
    checkpoint atomically: an interrupt (Ctrl-C) during a save leaves a staging folder, never a checkpoint-N
    that resuming would trip on. It keeps no "best" checkpoint (lazoo sets no `metric_for_best_model`)."""

    _staging_dir: str | None = None

    def _get_output_dir(self, trial) -> str:
        # while a checkpoint is saved, Trainer's `run_dir` is the staging folder: it writes staging/checkpoint-N
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, STAGING_PREFIX + name)
        if self.args.should_save and os.path.isdir(staging):  # an earlier run's interrupted save of this step
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()  # every process (FSDP: each writes its shards) starts clean
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)  # its rotation sees only the staging folder's one checkpoint
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()  # every process has written its part
        if self.args.should_save:  # the main process (of each node with save_on_each_node) renames and rotates
            _publish_checkpoint(staging, name, run_dir)
            rotate_complete_checkpoints(run_dir, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        import transformers.trainer as trainer_module

        names = [n for n in ("PreTrainedConfig", "PretrainedConfig") if hasattr(trainer_module, n)]
        saved = {n: getattr(trainer_module, n) for n in names}
        for n in names:
            setattr(trainer_module, n, _CheckpointConfigVersion)
        try:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        finally:
            for n, cls in saved.items():
                setattr(trainer_module, n, cls)


def make_trainer(model, data, output_dir: str, steps: int, batch_size: int, lr: float, seed: int,
                 progress: bool = True, *, grad_accum: int = 1, bf16: bool = False, packing: bool = False,
                 save_steps: int | None = None, save_total_limit: int | None = None,
                 gradient_checkpointing: bool = False, logging_steps: int | None = None, callbacks=()) -> Trainer:
    """The `Trainer` of the demo and `lazoo train`: cosine schedule with 5% warm-up, AdamW; by default padded
    blocks, fp32, no checkpoints. `packing`: documents packed in one row (`PackedDocumentsCollator`);
    `save_steps`: a checkpoint every N steps in `output_dir` (resume with `trainer.train(resume_from_checkpoint=True)`)."""
    extra = {}
    if gradient_checkpointing:  # transformers 5.23 renames the argument (5.17 has only the old name)
        name = next(a for a in ("activation_checkpointing", "gradient_checkpointing")
                    if a in TrainingArguments.__dataclass_fields__)
        extra[name] = True
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, gradient_accumulation_steps=grad_accum, learning_rate=lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=logging_steps or max(1, steps // 10), bf16=bf16,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_total_limit=save_total_limit,
        report_to=[], use_cpu=not torch.cuda.is_available(), seed=seed,
        dataloader_num_workers=0, disable_tqdm=not progress, **extra,
    )
    collator = PackedDocumentsCollator(data.tokenizer.eos_token_id) if packing else default_data_collator
    return LazooTrainer(model=model, args=training_args, train_dataset=data.train, eval_dataset=data.eval,
                        data_collator=collator, callbacks=list(callbacks) or None)


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, greedy: bool = False,
                temperature: float = 0.8, top_k: int | None = 40, static: bool = False) -> str:
    """`prompt` and its continuation (sampled with temperature/top-k, or greedy), decoded. `static`: generate with
    the static cache (on CUDA, compiled decode steps replayed as CUDA graphs; the same tokens)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    if inputs["input_ids"].shape[1] == 0:  # an empty prompt starts from the bos token
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        inputs = {"input_ids": torch.tensor([[bos]], device=model.device),
                  "attention_mask": torch.ones(1, 1, dtype=torch.long, device=model.device)}
    set_seed(seed)
    options = {"do_sample": False} if greedy else {"do_sample": True, "top_k": top_k, "temperature": temperature}
    if static:
        options["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **options)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv=None) -> dict:
    """`lazoo demo` from a list of arguments: bad input raises `lazoo.cli.CLIError` (`lazoo demo` prints it in
    one line)."""
    return run(parse_args(argv))


def run(args) -> dict:
    """The demo on checked arguments (`parse_args`): train, evaluate, save, reload, sample."""
    from . import cli

    set_seed(args.seed)
    cli.set_cpu_threads(args.threads)
    with cli.progress_bars(not args.no_progress):
        return _train_save_reload_sample(args)


def _train_save_reload_sample(args) -> dict:
    from . import cli

    start = time.time()
    sizes = model_sizes(args)
    data = cli.load_blocks(args.text, args.config, sizes, args.seq_len, args.eval_blocks, args.seed)
    cli.check_batch_fits(args.batch_size, 1, len(data.train))
    tok = data.tokenizer
    model = cli.build_model(args.config, tok, sizes)

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
