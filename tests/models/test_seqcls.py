"""Sequence classification heads (`AutoModelForSequenceClassification`) for every mechanism and the hybrid,
and ELA's bidirectional encoder: Trainer lowers the loss on a tiny synthetic task, save/load round trip,
left padding, the three problem types (CPU, fp32, tiny models)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_MODELS, VOCAB, tiny_config
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from lazoo.models import SEQUENCE_CLASSIFICATION_CLASSES, LazooForSequenceClassification

pytestmark = pytest.mark.usefixtures("single_thread")

PAD, NEEDLE, T = 0, 5, 12
STEPS, BATCH = 60, 16


def needle_task(n: int, seed: int) -> Dataset:
    """Does the sequence contain token 5? T random tokens (never 0 or 5); in half of the sequences (label 1)
    about a quarter of the positions, and at least one, hold the needle 5."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(NEEDLE + 1, VOCAB, (n, T), generator=gen)
    labels = torch.arange(n) % 2
    put = (torch.rand(n, T, generator=gen) < 0.25) & (labels[:, None] == 1)
    positives = labels == 1
    put[positives, torch.randint(0, T, (int(positives.sum()),), generator=gen)] = True
    ids[put] = NEEDLE
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                              "labels": labels.tolist()})


def tiny_classifier(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("num_labels", 2)
    config = tiny_config(name, pad_token_id=PAD, **overrides)
    return AutoModelForSequenceClassification.from_config(config)


def training_args(out_dir):
    return TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=3e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, report_to=[],
        per_device_eval_batch_size=64,
        use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, dataloader_pin_memory=False,
    )


def left_padded(samples: list[torch.Tensor]):
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), PAD)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return ids, mask


def check_train_round_trip_and_padding(model, tmp_path):
    train, held_out = needle_task(BATCH * STEPS, seed=1), needle_task(64, seed=7)  # one epoch: no memorising
    trainer = Trainer(model=model.train(), args=training_args(tmp_path / "run"), train_dataset=train,
                      eval_dataset=held_out)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    after = trainer.evaluate()["eval_loss"]
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    print(f"{type(model).__name__}: held-out loss {before:.3f} -> {after:.3f}, training loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.1, f"training loss {first:.3f} -> {last:.3f}: did not fall"
    assert after < before - 0.1, f"held-out loss {before:.3f} -> {after:.3f}: did not fall"

    model.eval()
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    saved_config = json.loads((folder / "config.json").read_text())
    module = "modeling_lazoo" if type(model) is LazooForSequenceClassification else "modeling_mechanisms"
    assert saved_config["auto_map"]["AutoModelForSequenceClassification"] == f"{module}.{type(model).__name__}"
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert type(loaded) is type(model)
    probe = needle_task(4, seed=2)
    ids = torch.tensor(probe["input_ids"])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (T, 5, 9)]
    ids, mask = left_padded(samples)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for i, s in enumerate(samples):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(batched[i], alone, rtol=1e-4, atol=1e-5)
    return loaded


def test_every_model_type_has_a_registered_head():
    from lazoo import MODEL_CLASSES

    assert set(SEQUENCE_CLASSIFICATION_CLASSES) == set(MODEL_CLASSES)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_trainer_lowers_the_loss_round_trip_and_left_padding(name, tmp_path):
    model = tiny_classifier(name)
    assert type(model).__name__.endswith("ForSequenceClassification")
    assert type(model) is SEQUENCE_CLASSIFICATION_CLASSES[model.config.model_type]
    check_train_round_trip_and_padding(model, tmp_path)


def test_bidirectional_ela_encoder(tmp_path):
    model = tiny_classifier("ela", bidirectional=True)
    loaded = check_train_round_trip_and_padding(model, tmp_path)
    assert loaded.config.bidirectional and loaded.bidirectional
    # bidirectional: an early token's hidden state depends on a later token (a causal one cannot)
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % (VOCAB - 1)) + 1
    with torch.no_grad():
        h, h2 = (model.model(x).last_hidden_state[0, 0] for x in (ids, changed))
    assert not torch.allclose(h, h2)
    # mean pooling over real tokens: right padding gives the same logits as left padding
    s = ids[0, :5]
    right = torch.cat([s, torch.full((3,), PAD)])[None]
    mask = torch.tensor([[1] * 5 + [0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(right, attention_mask=mask).logits, model(s[None]).logits,
                                   rtol=1e-4, atol=1e-5)


def test_bidirectional_needs_ela_layers():
    with pytest.raises(ValueError, match=r"bidirectional=True needs every layer's mechanism to have a bidirectional "
                                         r"form \(ela\); layer_types also has \['sliding_window', 'vla'\]"):
        tiny_classifier("hybrid", bidirectional=True)


def test_problem_types_follow_transformers():
    model = tiny_classifier("gated_delta_net").eval()
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(ids, labels=torch.tensor([0, 1, 1]))
        assert model.config.problem_type == "single_label_classification"
        torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, torch.tensor([0, 1, 1])))

        model.config.problem_type = None
        multi = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
        out = model(ids, labels=multi)
        assert model.config.problem_type == "multi_label_classification"
        torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, multi))

    reg = tiny_classifier("vla", num_labels=1).eval()
    target = torch.tensor([0.5, -1.0, 2.0])
    with torch.no_grad():
        out = reg(ids, labels=target)
    assert reg.config.problem_type == "regression" and out.logits.shape == (3, 1)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), target))


def test_pooling_uses_pad_token_id_without_a_mask_and_refuses_batches_without_either():
    model = tiny_classifier("linear").eval()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    right = torch.cat([ids, torch.full((2, 2), PAD)], 1)  # right padding: pads come after the last real token
    with torch.no_grad():
        torch.testing.assert_close(model(right).logits, model(ids).logits)
    model.config.pad_token_id = None
    with pytest.raises(ValueError, match="pass attention_mask"):
        model(ids)


def test_a_causal_lm_checkpoint_loads_as_a_classifier(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config("gla", pad_token_id=PAD))
    lm.save_pretrained(tmp_path)
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert clf.score.out_features == 3
    for (name, p), (lm_name, q) in zip(clf.model.named_parameters(), lm.model.named_parameters()):
        assert name == lm_name and torch.equal(p, q), name


def test_trust_remote_code_loads_the_head_without_lazoo(tmp_path):
    """The exported code (see test_export.py) carries the heads, the bidirectional ELA one included."""
    import subprocess
    import sys

    expected = {}
    for name, extra in (("vla", {}), ("ela", {"bidirectional": True})):
        model = tiny_classifier(name, **extra).eval()
        model.save_pretrained(tmp_path / name)
        with torch.no_grad():
            expected[name] = model(torch.arange(1, 10)[None]).logits
    code = f"""
import json, sys, torch
from transformers import AutoModelForSequenceClassification
out = {{}}
for name in ("vla", "ela"):
    m = AutoModelForSequenceClassification.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True)
    with torch.no_grad():
        out[name] = [type(m).__module__, m.eval()(torch.arange(1, 10)[None]).logits.tolist()]
out["lazoo_imported"] = [k for k in sys.modules if k == "lazoo" or k.startswith("lazoo.")]
print(json.dumps(out))
"""
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got.pop("lazoo_imported") == []
    for name, (module, logits) in got.items():
        assert module.startswith("transformers_modules."), module
        torch.testing.assert_close(torch.tensor(logits), expected[name], rtol=1e-5, atol=1e-6)
