"""PEFT/LoRA on every lazoo model: the documented target modules exist, every adapted projection changes
the output (no kernel bypasses an adapter), Trainer trains the adapters only, and the adapter round-trips
through save/load and merge_and_unload (CPU, fp32, tiny models)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import ALL_MODELS, MECHANISMS, random_ids, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "peft.md"


def documented_targets() -> dict[str, list[str]]:
    """mechanism -> its LoRA target module names, from the table in docs/peft.md."""
    table = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`\w+`", cells[0]) and cells[0].strip("`") in MECHANISMS:
            table[cells[0].strip("`")] = re.findall(r"`([\w.]+)`", cells[1])
    return table


TARGETS = documented_targets()


def targets_for(name: str) -> list[str]:
    if name == "hybrid":
        from conftest import HYBRID_LAYERS

        return sorted({t for layer in HYBRID_LAYERS for t in TARGETS[layer]})
    return TARGETS[name]


def lora(model, name: str):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets_for(name), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def test_the_documented_targets_are_every_linear_projection_of_each_mixer():
    assert set(TARGETS) == set(MECHANISMS), f"docs/peft.md lists {sorted(TARGETS)}, the registry {MECHANISMS}"
    for name in MECHANISMS:
        mixer = tiny_model(name, num_hidden_layers=1).model.layers[0].mixer
        linears = sorted(n for n, m in mixer.named_modules() if isinstance(m, nn.Linear))
        assert sorted(TARGETS[name]) == linears, f"{name}: docs list {TARGETS[name]}, the mixer has {linears}"


@pytest.mark.parametrize("name", MECHANISMS)
@torch.no_grad()
def test_every_adapted_projection_changes_the_output(name):
    """LoRA starts with B = 0 (no change); a nonzero B on any single adapted projection must change the
    logits, so no op or kernel reads a projection's weight directly and skips its adapter."""
    ids = random_ids(2, 9, seed=3)
    model = lora(tiny_model(name), name).eval()
    reference = model(ids).logits
    lora_bs = {n: m for n, m in model.named_modules() if n.endswith("lora_B.default")}
    assert lora_bs, f"{name}: no LoRA module was created"
    assert torch.equal(model(ids).logits, reference)
    adapted = {n.rsplit(".lora_B", 1)[0].rsplit(".", 1)[-1] for n in lora_bs}
    assert adapted >= {t.rsplit(".", 1)[-1] for t in TARGETS[name]}
    gen = torch.Generator().manual_seed(0)
    for module_name, module in lora_bs.items():
        module.weight.copy_(0.5 * torch.randn(module.weight.shape, generator=gen))
        changed = (model(ids).logits - reference).abs().max().item()
        module.weight.zero_()
        assert changed > 1e-4, f"{name}: a nonzero LoRA B on {module_name} left the output unchanged"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_trainer_trains_the_adapter_only_and_it_round_trips(name, tmp_path):
    torch.manual_seed(0)
    tiny_model(name).save_pretrained(tmp_path / "base")  # fine-tune a saved model, as users do
    model = lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:5]

    ids = random_ids(8, 12, seed=1)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-2,
        lr_scheduler_type="constant", warmup_steps=0, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, dataloader_pin_memory=False, remove_unused_columns=False, logging_steps=1,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed, f"{name}: training changed no parameter"
    assert changed <= trainable, f"{name}: training changed base weights {sorted(changed - trainable)[:5]}"
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed), sorted(changed)

    model.eval()
    x = random_ids(2, 10, seed=2)
    with torch.no_grad():
        adapted = model(x).logits
        base = model.get_base_model()
        with model.disable_adapter():
            plain = model(x).logits
    assert not torch.allclose(adapted, plain), f"{name}: the trained adapter does not change the logits"

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, adapted), f"{name}: the reloaded adapter gives other logits"
        merged = loaded.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert type(merged) is type(base)
        torch.testing.assert_close(merged(x).logits, adapted, rtol=1e-4, atol=1e-5)
