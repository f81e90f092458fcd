"""Tiny Mamba-2 and Bamba checkpoints made with transformers' own classes (no downloads), and transformers' models run
in float64 with their float32 casts lifted, for the conversion tests."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from convert_helpers import save_with_tokenizer_config

VOCAB = 97

#: kind -> (transformers config class, model class)
KINDS = {"mamba2": ("Mamba2Config", "Mamba2ForCausalLM"), "bamba": ("BambaConfig", "BambaForCausalLM"),
         "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
         "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM")}
#: the kinds tests/convert/test_convert_mamba.py converts (GraniteMoeHybrid: test_convert_granite.py; Nemotron-H is
#: refused by field)
CONVERTED = ("mamba2", "bamba")


def require(kind: str):
    """The transformers classes of `kind`, or a skip saying which release lacks them."""
    import transformers

    config_name, model_name = KINDS[kind]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return getattr(transformers, config_name), getattr(transformers, model_name)


def grouped_norm(kind: str = "mamba2") -> bool:
    """Whether transformers' Mamba-2 output norm (of `kind`'s Mamba-2 layers) normalises each of the n_groups
    groups, as Mamba-2 does (5.17's normalises all H·P channels at once: it then computes Mamba-2 only for
    n_groups = 1)."""
    import inspect

    if kind == "granitemoehybrid":
        from transformers.models.granitemoehybrid import modeling_granitemoehybrid

        norm = modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated
    else:
        from transformers.models.mamba2 import modeling_mamba2

        norm = modeling_mamba2.MambaRMSNormGated
    return "group_size" in inspect.signature(norm).parameters


def groups(kind: str = "mamba2") -> int:
    """The groups of B and C of the tiny models: 2 where transformers computes them as Mamba-2, else 1."""
    return 2 if grouped_norm(kind) else 1


def config_fields(kind: str, **overrides) -> dict:
    """A tiny config: 4 heads of 16 channels reading 2 groups of B and C (`groups()`; state size 8), chunks of 8 (the
    prompts cross them); Bamba with an attention layer (4 query heads, 2 key/value heads) between Mamba-2 layers."""
    if kind == "mamba2":
        fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, expand=2,
                      state_size=8, n_groups=groups(), conv_kernel=4, chunk_size=8)
    elif kind == "bamba":
        fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=48, attn_layer_indices=[1], mamba_n_heads=4,
                      mamba_d_head=16, mamba_n_groups=groups(), mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
                      max_position_embeddings=512)
    elif kind == "granitemoehybrid":  # Granite 4.0-H's scaling (attention scores by 1/head_dim), no positions
        fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=24, shared_intermediate_size=40, num_local_experts=4,
                      num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "attention"],
                      mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=groups(kind), mamba_d_state=8,
                      mamba_chunk_size=8, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
                      attention_multiplier=1 / 8, position_embedding_type="nope", rms_norm_eps=1e-5)
    else:
        fields = dict(vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "mlp", "attention", "mlp"],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8)
    fields.update(pad_token_id=0, eos_token_id=VOCAB - 1, bos_token_id=1)
    fields.update(overrides)
    return fields


def tiny_model(kind: str, seed: int = 0, tie: bool = False, **overrides):
    """transformers' own model of `kind`, with random weights everywhere (norm weights, A_log, dt_bias, D and the
    convolution's bias too, so that a parameter read at the wrong place shows); Granite's router, experts, shared MLP
    and attention drawn large enough to weigh in the logits (the router's scores spread enough to route differently
    per token)."""
    config_cls, model_cls = require(kind)
    config = config_cls(**config_fields(kind, **overrides), tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "norm_f.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias", "D", "conv1d.bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif kind == "granitemoehybrid" and name.endswith("router.weight"):
                p.copy_(torch.randn_like(p))
            elif kind == "granitemoehybrid" and any(part in name for part in GRANITE_LARGE):
                p.copy_(0.2 * torch.randn_like(p))
    return model


#: the parts of Granite's layers drawn larger than transformers' init (std 0.02)
GRANITE_LARGE = ("block_sparse_moe.experts.", "shared_mlp.", "self_attn.")


def save_tiny(folder: Path, kind: str, seed: int = 0, tie: bool = False, **overrides):
    """`tiny_model(...)` saved with save_pretrained into `folder` (with a tokenizer_config.json); returns the model."""
    return save_with_tokenizer_config(tiny_model(kind, seed=seed, tie=tie, **overrides), folder)


@contextlib.contextmanager
def float64_faithful(model):
    """transformers' model computing in float64 throughout: its float32 casts lifted (`Tensor.float()`,
    `Tensor.to(torch.float32)` and `Tensor.type(torch.float32)` keep float64, integers become float64 under
    `.float()`), the rotary frequencies recomputed in float64. Everything else is transformers' own code."""
    to_float, to, as_type = torch.Tensor.float, torch.Tensor.to, torch.Tensor.type

    def lifted_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def lifted_type(self, *args, **kwargs):
        if self.dtype == torch.float64 and args and args[0] is torch.float32:
            args = (torch.float64, *args[1:])
        return as_type(self, *args, **kwargs)

    for rotary in (m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")):
        dim = 2 * rotary.inv_freq.numel()
        theta = rotary.config.rope_parameters["rope_theta"]
        rotary.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    try:
        torch.Tensor.float = lambda self, *a, **kw: (self if self.dtype == torch.float64 else self.double()
                                                     if not self.is_floating_point() else to_float(self, *a, **kw))
        torch.Tensor.to, torch.Tensor.type = lifted_to, lifted_type
        yield model
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = to_float, to, as_type


def logits_of(model, ids, mask, **kwargs):
    """`model`'s logits on `ids` with the attention mask, without autograd."""
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def reference_logits(reference, ids, mask, dtype):
    """transformers' `reference` in `dtype` on left-padded `ids` (no cache): in float64 with its float32 casts lifted
    and attention through sdpa (the eager form takes its softmax in float32), in float32 as it runs."""
    reference = reference.to(dtype)
    lifted = contextlib.nullcontext()
    if dtype == torch.float64:
        reference.config._attn_implementation = "sdpa"
        lifted = float64_faithful(reference)
    with lifted, torch.no_grad():
        return reference(ids, attention_mask=mask, use_cache=False).logits


def greedy_tokens(reference, ours, ids, mask, steps: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The `steps` greedy tokens (after the prompt) of transformers' model and of ours in float32, with the cache."""
    kwargs = dict(attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        expected = reference.float().generate(ids, **kwargs)
        got = ours.float().generate(ids, **kwargs)
    assert expected.shape[1] == ids.shape[1] + steps
    return expected, got
