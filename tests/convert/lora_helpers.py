"""LoRA fine-tuning of a converted model with transformers' Trainer, as the worked paths of docs/pretrained.md and
docs/qwen.md do it (tiny, on the CPU)."""

from __future__ import annotations


def lora_fine_tune(model, blocks, run_folder, steps: int = 12):
    """`model` with LoRA adapters on the projections of both kinds of layer, trained `steps` steps on `blocks`;
    returns (the PEFT model, the logged losses)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"])
    peft_model = get_peft_model(model, lora)
    args = TrainingArguments(output_dir=str(run_folder), per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=3e-3, logging_steps=4, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=peft_model.train(), args=args, train_dataset=blocks)
    trainer.train()
    return peft_model, [e["loss"] for e in trainer.state.log_history if "loss" in e]
