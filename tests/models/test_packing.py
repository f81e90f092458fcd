"""Packed sequences without padding (transformers' `DataCollatorWithFlattening`: one row, `position_ids`
restarting at 0 at every sequence): every mechanism gives the logits, the loss and the gradients of the
sequences run one by one, and a Trainer run with the flattening collator works (CPU, fp32, tiny models;
the delta rules and KDA on a GPU too, through their kernels)."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MODELS, random_ids, tiny_model
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from lazoo.ops.packing import cu_seqlens_from_position_ids

pytestmark = pytest.mark.usefixtures("single_thread")

#: three sequences of different lengths; longer than the tiny sliding window (6) and VLA's refresh period (7)
LENGTHS = (9, 5, 13)


def _features(seed: int = 0):
    return [{"input_ids": random_ids(n, seed=seed + i).tolist()} for i, n in enumerate(LENGTHS)]


def _packed(features):
    batch = DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": f["input_ids"], "labels": f["input_ids"]} for f in features])
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, sum(LENGTHS))
    return batch


def test_boundaries_from_position_ids():
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])).tolist() == [0, 3, 5, 9]
    assert cu_seqlens_from_position_ids(torch.arange(7)[None]) is None  # one sequence
    assert cu_seqlens_from_position_ids(torch.arange(7).repeat(2, 1)) is None  # B > 1: not packing


@pytest.mark.parametrize("name", ALL_MODELS)
def test_packed_batch_equals_the_sequences_one_by_one(name):
    model = tiny_model(name, eval=False)
    model.eval()  # no dropout; gradients still flow
    assert_packed_equals_separate(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed_kernel", [False, True])
@pytest.mark.parametrize("name", ["delta_net", "gated_delta_net", "kda"])
def test_gpu_packed_batch_equals_the_sequences_one_by_one(name, packed_kernel, monkeypatch):
    """On CUDA: the Triton kernels, and the short convolutions in the masked PyTorch form or the kernel's packed
    form (`lazoo.layers.short_conv.PACKED_KERNEL`), which must run there."""
    from lazoo.kernels import short_conv as kernel
    from lazoo.layers import short_conv as layer

    monkeypatch.delenv("LAZOO_BACKEND", raising=False)
    monkeypatch.setattr(layer, "PACKED_KERNEL", packed_kernel)
    packed_calls, run = [], kernel.short_conv

    def counted(*args, **kwargs):
        packed_calls.append(kwargs.get("starts") is not None)
        return run(*args, **kwargs)
    monkeypatch.setattr(kernel, "short_conv", counted)
    model = tiny_model(name, eval=False).cuda()
    model.eval()
    assert_packed_equals_separate(model, rtol=1e-3, atol=1e-4)
    assert any(packed_calls) is packed_kernel


def assert_packed_equals_separate(model, rtol: float = 1e-4, atol: float = 1e-6):
    """The packed batch's logits, loss and gradients are the sequences' run one by one (to ``rtol``, ``atol``
    for logits and gradients, a tenth of them for the loss); without the restarting positions they differ."""
    device = model.device
    features = _features()
    batch = {n: t.to(device) for n, t in _packed(features).items()}
    n_items = sum(n - 1 for n in LENGTHS)  # predicted tokens: the first of each sequence has label -100

    model.zero_grad()
    out = model(**batch, num_items_in_batch=n_items)  # use_cache defaults to True in eval: ignored when packed
    assert out.past_key_values is None
    out.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    logits, loss = [], 0.0
    for f in features:
        ids = torch.tensor([f["input_ids"]], device=device)
        o = model(ids, labels=ids, num_items_in_batch=n_items, use_cache=False)
        o.loss.backward()
        logits.append(o.logits.detach())
        loss = loss + o.loss.detach()
    separate = torch.cat(logits, dim=1)

    torch.testing.assert_close(out.logits.detach(), separate, rtol=rtol, atol=10 * atol)
    torch.testing.assert_close(out.loss.detach(), loss, rtol=rtol / 10, atol=atol)
    # the packed mean loss (no num_items_in_batch) is the mean over all predicted tokens
    with torch.no_grad():
        mean = model(**batch).loss
    torch.testing.assert_close(mean, loss, rtol=rtol / 10, atol=atol)
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads, "no parameter got a gradient"
    grads = dict(model.named_parameters())
    for n, g in packed_grads.items():
        torch.testing.assert_close(g, grads[n].grad, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
    # without the restarting positions (one long sequence) the logits differ: the test can see leaks
    with torch.no_grad():
        joined = model(batch["input_ids"], use_cache=False).logits
    assert not torch.allclose(joined[:, LENGTHS[0]:], separate[:, LENGTHS[0]:], atol=1e-4)


@pytest.mark.parametrize("name", ["gated_delta_net", "hybrid"])
def test_padded_batch_and_generation_are_unchanged(name):
    """B = 1 with left padding gets position_ids with a 0 after pads from `generate`: that is not packing."""
    model = tiny_model(name)
    ids = random_ids(1, 8, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        a = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        b = model(ids[:, 3:], use_cache=False).logits
    torch.testing.assert_close(a[:, 3:], b, rtol=1e-4, atol=1e-5)
    out = model.generate(ids[:, 3:], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("name", ["sliding_window", "gated_delta_net"])
def test_trainer_with_flattening_collator(name, tokenizer, lm_blocks, tmp_path):
    model = tiny_model(name, perturb=False, eval=False, vocab_size=len(tokenizer))
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    # documents of different lengths: cut the 32-token blocks at different places
    docs = [{"input_ids": ids[: 8 + (i * 7) % 25]} for i, ids in enumerate(lm_blocks["input_ids"])]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_pin_memory=False, remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    first = seen[0]
    assert first["input_ids"].shape[0] == 1 and "attention_mask" not in first
    assert cu_seqlens_from_position_ids(first["position_ids"]).numel() == 9  # 8 sequences in the row


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 4])
def test_softmax_attention_op_keeps_packed_sequences_apart(backend, window):
    from lazoo import ops

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, sum(LENGTHS), 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    o, state = ops.softmax_attention(q, k, v, window=window, cu_seqlens=cu, backend=backend)
    assert state is None
    ref = torch.cat([ops.softmax_attention(q[:, s:e], k[:, s:e], v[:, s:e], window=window, backend=backend)[0]
                     for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    torch.testing.assert_close(o, ref)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.softmax_attention(q, k, v, cu_seqlens=cu, output_final_state=True)


def test_short_convolution_stays_inside_each_packed_sequence():
    from lazoo.layers.short_conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel_size=4)
    x = torch.randn(1, sum(LENGTHS), 6)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    y, _ = conv(x, cu_seqlens=cu)
    ref = torch.cat([conv(x[:, s:e])[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    torch.testing.assert_close(y, ref)
