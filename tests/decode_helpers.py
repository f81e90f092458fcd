"""Checks the tests of the fused decode steps share (tests/kernels/test_kernels_delta_step.py and
test_kernels_mamba2_step.py): a tiny model's `generate` with the fused step and without it."""

from __future__ import annotations

import itertools

import torch
from conftest import left_padded, tiny_model

from lazoo.layers.mlp import GatedMLP


def fused_and_unfused_generate(name, options, mixer_cls, kernel_module, kernel_name, device="cpu",
                               dtype=torch.float64, tokens=6):
    """`generate` of a tiny model of mechanism `name` with the fused step and without it (`mixer_cls.fused_decode`
    True, then False), greedy, left-padded, the dynamic cache and the static one: `{(fused, cache): (tokens,
    logits)}`. Each run counts the calls of `kernel_module.kernel_name`: one per layer and decode step where the
    step is on, none where it is off."""
    model = tiny_model(name, seed=2, **options).to(device=device, dtype=dtype)
    ids, mask = (t.to(device) for t in left_padded())
    results, calls = {}, []
    kernel = getattr(kernel_module, kernel_name)
    default = mixer_cls.fused_decode  # the class's switch, put back after each run
    mlp_default = GatedMLP.fused_decode
    for fused_decode, implementation in itertools.product((True, False), ("dynamic", "static")):
        mixer_cls.fused_decode = GatedMLP.fused_decode = fused_decode  # True: also the CPU's interpreter (float64)
        setattr(kernel_module, kernel_name, lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
        calls.clear()
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                     output_logits=True, return_dict_in_generate=True,
                                     cache_implementation=implementation)
        finally:
            mixer_cls.fused_decode, GatedMLP.fused_decode = default, mlp_default
            setattr(kernel_module, kernel_name, kernel)
        assert len(calls) == (model.config.num_hidden_layers * (tokens - 1) if fused_decode else 0)
        results[fused_decode, implementation] = out.sequences, torch.stack(out.logits)
    return results


def assert_all_equal(results, tol=1e-10):
    """Every run's tokens equal the unfused dynamic-cache run's, its logits within `tol` (float64)."""
    ids, logits = results[False, "dynamic"]
    for key, (other_ids, other_logits) in results.items():
        assert torch.equal(other_ids, ids), key
        torch.testing.assert_close(other_logits, logits, rtol=tol, atol=tol, msg=str(key))


def assert_close_on_gpu(run):
    """`run(dtype, tokens)` -> `fused_and_unfused_generate`'s results: in float32 every run's tokens equal the
    unfused dynamic-cache run's and its logits are within 1e-4 of their largest; in bf16 within 5e-2 up to the first
    step whose token differs, if one does (a near tie that rounding flips; later steps read other tokens)."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        results = run(dtype, 12)
        ids, logits = results[False, "dynamic"]
        for key, (other_ids, other_logits) in results.items():
            if dtype == torch.float32:
                assert torch.equal(other_ids, ids), key
            steps = logits.shape[0]
            differ = (other_ids[:, -steps:] != ids[:, -steps:]).any(0).nonzero()
            same_inputs = steps if len(differ) == 0 else int(differ[0]) + 1  # logits of step i read tokens < i
            scale = logits.float().abs().max()
            gap = (other_logits[:same_inputs].float() - logits[:same_inputs].float()).abs().max()
            assert gap <= tol * scale, (key, dtype, float(gap / scale))
