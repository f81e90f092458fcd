"""Pads are isolated at the model level: whatever a pad position holds never reaches a real token.

Property, for every mechanism and the hybrids, in float32 and bfloat16, on the chunk and recurrent backends (and
the Triton kernels under the interpreter, ``test_interp_*``): a batch with left pads, a hole and right pads, run
once with finite pad embeddings and once with NaN / +Inf / -Inf written into every pad position's embedding and
into the pad rows of every decoder layer's input (a forward pre-hook), gives bit-identical outputs at every real
position, and bit-identical gradients of every parameter and of the real positions' embeddings. The short
convolutions that run before the ops (delta_net, gated_delta_net, delta_product, rls) once let a NaN at a pad
into its neighbours.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_MODELS, MECHANISMS, tiny_config
from transformers import AutoModelForCausalLM

import lazoo
from lazoo.kernels._utils import interpreter_ready

B, T = 3, 11
POISON = (math.nan, math.inf, -math.inf)
#: extra model shapes beside the mechanisms and the sliding-window/VLA hybrid: the decoder options that see every
#: position (a routed MoE and its load-balancing loss, the causal Memory Lobe) and a short-conv hybrid
EXTRA_MODELS = {
    "hybrid-gdn-moe-lobe": dict(layer_types=["sliding_window", "gated_delta_net"], moe_num_experts=3, moe_top_k=2,
                                memory_lobe="causal"),
    "hybrid-softmax-rls": dict(layer_types=["softmax", "rls"]),
}
MODELS = ALL_MODELS + list(EXTRA_MODELS)
#: the recurrent references that take seconds per run: in the full matrix (-m slow) only
SLOW_RECURRENT = {"local_linear", "ttt_mlp"}


def pad_mask() -> torch.Tensor:
    """``[B, T]`` bool: sample 0 has left pads, sample 1 a hole and right pads, sample 2 none."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 5] = False
    mask[1, -3:] = False
    return mask


def build(name: str, dtype: torch.dtype, backend: str | None = None):
    """A seeded tiny model of `name` in `dtype`; `backend` forced on every mixer that runs an op."""
    overrides = dict(EXTRA_MODELS.get(name, {}))
    kind = "hybrid" if name not in MECHANISMS else name
    if "layer_types" in overrides:
        overrides["num_hidden_layers"] = len(overrides["layer_types"])
    config = tiny_config(kind, **overrides)
    if backend is not None:
        config.mixer_kwargs = {n: {**config.mixer_kwargs.get(n, {}), "backend": backend}
                               for n in dict.fromkeys(config.layer_types)}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # no weight at its init value (norms at 1, zero biases)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(dtype))
    return model.eval()


def poison(x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """`x` `[B, T, C]` with NaN, +Inf and -Inf (cycling over the pad positions) in the pad rows."""
    values = torch.tensor(POISON, dtype=x.dtype)[torch.arange(int(pads.sum())) % len(POISON)]
    filled = torch.zeros(B, T, dtype=x.dtype)
    filled[pads.cpu()] = values
    return torch.where(pads[..., None], filled[..., None].to(x.device), x)


def run(model, embeds: torch.Tensor, mask: torch.Tensor, dirty: bool):
    """Logits and the gradients (every parameter, the embeddings) of a fixed random projection of the real
    positions' logits; `dirty`: pads poisoned in the embeddings and at every decoder layer's input."""
    pads = ~mask
    hooks = []
    if dirty:
        embeds = poison(embeds, pads)
        for layer in model.model.layers:
            hooks.append(layer.register_forward_pre_hook(
                lambda module, args: (poison(args[0], pads), *args[1:])))
    leaf = embeds.detach().requires_grad_(True)
    try:
        logits = model(inputs_embeds=leaf, attention_mask=mask.long()).logits
    finally:
        for hook in hooks:
            hook.remove()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)).to(logits.device, logits.dtype)
    loss = (logits * weights)[mask].float().sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[mask], leaf.grad[mask], grads


def check_pads_isolated(name: str, dtype: torch.dtype, backend: str | None, device: str = "cpu") -> None:
    model = build(name, dtype, backend).to(device)
    mask = pad_mask().to(device)
    ids = torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    embeds = model.get_input_embeddings()(ids.to(device)).detach()
    clean = run(model, embeds, mask, dirty=False)
    dirty = run(model, embeds, mask, dirty=True)
    what = f"{name}/{dtype}/{backend}"
    for label, a, b in (("logits", clean[0], dirty[0]), ("embedding grads", clean[1], dirty[1])):
        assert torch.isfinite(b).all(), f"{what}: non-finite {label} at real positions"
        assert torch.equal(a, b), f"{what}: {label} at real positions changed by {(a - b).abs().max()}"
    assert clean[2].keys() == dirty[2].keys()
    for param, g in dirty[2].items():
        assert torch.isfinite(g).all(), f"{what}: non-finite gradient of {param}"
        assert torch.equal(clean[2][param], g), f"{what}: gradient of {param} changed"


CPU_CASES = [pytest.param(name, dtype, backend, marks=[pytest.mark.slow] if backend == "recurrent" and (
                 name in SLOW_RECURRENT or dtype == torch.bfloat16) else [])
             for name in MODELS for dtype in (torch.float32, torch.bfloat16) for backend in ("chunk", "recurrent")]


@pytest.mark.parametrize("name,dtype,backend", CPU_CASES)
def test_pads_never_reach_real_tokens(name, dtype, backend, single_thread):
    check_pads_isolated(name, dtype, backend)


#: the mechanisms with Triton kernels; the interpreter takes 3-45 s a model, so the default run takes four (a
#: short-convolution one among them) and the full matrix (-m slow) the rest
TRITON_MODELS = [n for n in MECHANISMS if "triton" in lazoo.registry.get(n).backends]
TRITON_DEFAULT = {("linear", torch.float32), ("gated_linear", torch.bfloat16), ("ela", torch.float32),
                  ("gated_delta_net", torch.float32)}
TRITON_CASES = [pytest.param(name, dtype, marks=[] if (name, dtype) in TRITON_DEFAULT else [pytest.mark.slow])
                for name in TRITON_MODELS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.skipif(not interpreter_ready(),
                    reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
@pytest.mark.parametrize("name,dtype", TRITON_CASES)
def test_interp_pads_never_reach_real_tokens(name, dtype):
    check_pads_isolated(name, dtype, "triton")


def decode_after(model, embeds: torch.Tensor, mask: torch.Tensor, dirty: bool, steps: int = 3) -> torch.Tensor:
    """The logits of `steps` greedy decode steps after a padded prompt (poisoned as in `run` when `dirty`)."""
    pads = ~mask
    hooks = []
    if dirty:
        embeds = poison(embeds, pads)
        hooks = [layer.register_forward_pre_hook(lambda module, args: (poison(args[0], pads), *args[1:]))
                 for layer in model.model.layers]
    try:
        out = model(inputs_embeds=embeds, attention_mask=mask.long(), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    cache, full_mask, logits = out.past_key_values, mask.long(), []
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        full_mask = torch.cat([full_mask, full_mask.new_ones(B, 1)], dim=1)
        out = model(input_ids=token, attention_mask=full_mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def check_cache_isolated(name: str, device: str = "cpu") -> None:
    model = build(name, torch.float32).to(device)
    mask = pad_mask().to(device)
    ids = torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    embeds = model.get_input_embeddings()(ids.to(device)).detach()
    with torch.no_grad():
        clean, dirty = (decode_after(model, embeds, mask, d) for d in (False, True))
    assert torch.isfinite(dirty).all(), f"{name}: non-finite decode logits after a poisoned prompt"
    assert torch.equal(clean, dirty), f"{name}: decode logits changed by {(clean - dirty).abs().max()}"


@pytest.mark.parametrize("name", MODELS)
def test_pads_never_reach_the_cache(name, single_thread):
    check_cache_isolated(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODELS)
def test_pads_never_reach_real_tokens_on_cuda(name, dtype):
    check_pads_isolated(name, dtype, None, device="cuda")  # auto: the Triton kernels wherever they run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_pads_never_reach_the_cache_on_cuda(name):
    check_cache_isolated(name, device="cuda")
