"""The `Trainer` of `lazoo train` and the demo (`make_trainer`): `LazooTrainer`, which writes each checkpoint
atomically and resumes lazoo models, and the collator that packs documents in one row."""

from __future__ import annotations

import os
import shutil

import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments, default_data_collator
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoints import STAGING_PREFIX, publish_checkpoint, rotate_complete_checkpoints

__all__ = ["LazooTrainer", "PackedDocumentsCollator", "make_trainer"]


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
            publish_checkpoint(staging, name, run_dir)
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
    `save_steps`: a checkpoint every N steps in `output_dir` (resume with
    `trainer.train(resume_from_checkpoint=True)`)."""
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
