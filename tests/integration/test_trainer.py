"""Training through `transformers.Trainer` on real corpus blocks, gradient checkpointing, and the loss's
`num_items_in_batch` (CPU, fp32, tiny models)."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_MODELS, VOCAB, random_ids, tiny_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

pytestmark = pytest.mark.usefixtures("single_thread")

# transformers 5.23 renames the argument (5.17 has only the old name)
CHECKPOINTING_ARG = next(
    a for a in ("activation_checkpointing", "gradient_checkpointing") if a in TrainingArguments.__dataclass_fields__
)
STEPS = 25
BATCH = 8


def training_args(out_dir, **overrides):
    kwargs = dict(
        output_dir=str(out_dir), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, report_to=[],
        per_device_eval_batch_size=BATCH, use_cpu=True, save_strategy="no", seed=0, data_seed=0,
        disable_tqdm=True, dataloader_pin_memory=False,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def manual_loss(model, ids):
    """Mean next-token cross-entropy of a batch of full blocks, computed here (not by the model)."""
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("name", ALL_MODELS)
def test_trainer_lowers_the_loss_and_the_result_round_trips(name, tokenizer, lm_blocks, tmp_path):
    model = tiny_model(name, perturb=False, eval=False, vocab_size=len(tokenizer),
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    held_out_blocks = lm_blocks.select(range(len(lm_blocks) - 16, len(lm_blocks)))
    held_out = torch.tensor(held_out_blocks["input_ids"])
    train = lm_blocks.select(range(len(lm_blocks) - 16))
    before = manual_loss(model.eval(), held_out)

    trainer = Trainer(model=model.train(), args=training_args(tmp_path / "run"), train_dataset=train)
    assert trainer.model_accepts_loss_kwargs  # so Trainer passes num_items_in_batch
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    assert last < first - 0.5, f"training loss {first:.3f} -> {last:.3f}: did not fall"
    after = manual_loss(model.eval(), held_out)
    assert after < before - 0.5, f"held-out loss {before:.3f} -> {after:.3f}: did not fall"
    # Trainer's evaluation loop: 2 equal batches of full blocks, so its mean is the manual mean
    metrics = trainer.evaluate(eval_dataset=held_out_blocks)
    assert abs(metrics["eval_loss"] - after) < 1e-4, (metrics["eval_loss"], after)

    trainer.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(held_out).logits, model(held_out).logits)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_gradient_checkpointing_gives_the_same_gradients(name):
    model = tiny_model(name, eval=False)
    ids = random_ids(2, 24, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded sample, so the mask goes through the checkpointed layers too
    labels = ids.masked_fill(mask == 0, -100)
    calls = []
    hooks = [layer.mixer.register_forward_hook(lambda m, i, o: calls.append(1)) for layer in model.model.layers]

    def grads():
        model.zero_grad()
        calls.clear()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)

    loss, ref, n_plain = grads()
    # transformers 5.23 renames gradient_checkpointing_enable (5.17 has only the old name)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert model.model.gradient_checkpointing
    loss_ckpt, got, n_ckpt = grads()
    for h in hooks:
        h.remove()
    L = model.config.num_hidden_layers
    assert n_plain == L
    assert n_ckpt == 2 * L, "the layers were not recomputed in backward: checkpointing is not active"
    assert torch.allclose(loss_ckpt, loss, rtol=0, atol=1e-6)
    for n, g in ref.items():
        assert torch.allclose(got[n], g, rtol=1e-5, atol=1e-7), f"{n}: gradient differs with checkpointing"


@pytest.mark.parametrize("name", ["softmax", "hybrid"])
def test_num_items_in_batch_gives_sum_over_count(name):
    model = tiny_model(name)
    ids = random_ids(3, 17, seed=2)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 11:] = -100
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                ignore_index=-100, reduction="sum")
        count = int((labels[:, 1:] != -100).sum())
        for n in (37, 500):
            loss = model(ids, labels=labels, num_items_in_batch=n, use_cache=False).loss
            assert torch.allclose(loss, total / n, rtol=1e-5), (n, loss, total / n)
        mean = model(ids, labels=labels, use_cache=False).loss
        assert torch.allclose(mean, total / count, rtol=1e-5)


def test_trainer_passes_num_items_across_gradient_accumulation(tokenizer, lm_blocks, tmp_path):
    model = tiny_model("gated_delta_net", perturb=False, eval=False, vocab_size=len(tokenizer))
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("num_items_in_batch")),
                                    with_kwargs=True)
    args = training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3)
    Trainer(model=model, args=args, train_dataset=lm_blocks).train()
    assert len(seen) == 6
    # 2 micro-batches of 4 blocks of 32 tokens: 2 * 4 * 31 predicted tokens per optimizer step
    assert [int(n) for n in seen] == [2 * 4 * 31] * 6


@pytest.mark.parametrize("name", ALL_MODELS)
def test_trainer_with_gradient_checkpointing_follows_the_same_loss_curve(name, tokenizer, lm_blocks, tmp_path):
    curves = []
    for checkpointing in (False, True):
        model = tiny_model(name, perturb=False, eval=False, vocab_size=len(tokenizer))
        args = training_args(tmp_path / str(checkpointing), max_steps=8, **{CHECKPOINTING_ARG: checkpointing})
        trainer = Trainer(model=model, args=args, train_dataset=lm_blocks)
        trainer.train()
        assert model.model.gradient_checkpointing == checkpointing
        curves.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(curves[0]) == 8
    assert curves[1] == pytest.approx(curves[0], rel=1e-4, abs=1e-5)


@pytest.mark.slow  # inductor compiles the forward and backward to C++ on the CPU: about a minute
@pytest.mark.parametrize("name", ["gated_delta_net"])
def test_trainer_with_torch_compile_follows_the_same_loss_curve(name, tokenizer, lm_blocks, tmp_path):
    """`torch_compile=True`, with Trainer's default backend (inductor). (The aot_eager backend's backward fails on these
    models on the CPU with "view size is not compatible with input tensor's size and stride"; inductor's does not.)"""
    curves = []
    for compiled in (False, True):
        torch._dynamo.reset()  # every lazoo model compiles the same forward: start from no compiled code
        model = tiny_model(name, perturb=False, eval=False, vocab_size=len(tokenizer))
        extra = dict(torch_compile=True) if compiled else {}
        trainer = Trainer(model=model, args=training_args(tmp_path / str(compiled), max_steps=6, **extra),
                          train_dataset=lm_blocks)
        trainer.train()
        curves.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    torch._dynamo.reset()
    assert len(curves[0]) == 6
    assert curves[1] == pytest.approx(curves[0], rel=1e-4, abs=1e-5)
