"""Tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints made with transformers' own classes (no downloads), and
transformers' models run in float64 with their float32 casts lifted, for the conversion tests."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import save_with_tokenizer_config
from transformers_reference import unwrapped_kernels

VOCAB = 97

#: kind -> (transformers config class, model class, vision-language wrapper or not, MoE or not)
KINDS = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", False),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", False),
}
MOE_KINDS = ("qwen3_5_moe", "qwen3_next")
#: the transformers module of each kind's layers
MODULES = {"qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next"}


def require(kind: str):
    """The transformers classes of `kind`, or a skip saying which release lacks them."""
    import transformers

    config_name, model_name, _ = KINDS[kind]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name} (Qwen3.5 / Qwen3-Next arrived in "
                    "later releases)")
    return getattr(transformers, config_name), getattr(transformers, model_name)


def text_fields(kind: str, **overrides) -> dict:
    """A tiny text config: 4 layers (GDN, attention, GDN, GDN), grouped value heads (4 per 2 key heads), value head
    dim != key head dim, attention head dim != hidden / heads, 2 key/value heads for 4 query heads."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                  rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=VOCAB - 1, bos_token_id=1)
    if kind != "qwen3_5_moe":
        fields["intermediate_size"] = 48
    if kind in MOE_KINDS:
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24)
    if kind == "qwen3_next":
        fields["mlp_only_layers"] = [1]
    fields.update(overrides)
    return fields


def tiny_model(kind: str, seed: int = 0, tie: bool = False, **overrides):
    """transformers' own model of `kind`, with random weights everywhere (norm weights, A_log and dt_bias too, so
    that a zero-centred norm read as a plain one, or a decay off by a transpose, shows)."""
    config_cls, model_cls = require(kind)
    fields = text_fields(kind, **overrides)
    if KINDS[kind][2]:
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
        config = config_cls(text_config={**fields, "tie_word_embeddings": tie}, vision_config=vision,
                            tie_word_embeddings=tie)
    else:
        config = config_cls(**fields, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def save_tiny(folder: Path, kind: str, seed: int = 0, tie: bool = False, **overrides):
    """`tiny_model(...)` saved with save_pretrained into `folder` (with a tokenizer_config.json); returns the model."""
    return save_with_tokenizer_config(tiny_model(kind, seed=seed, tie=tie, **overrides), folder)


def prompt_and_mask(batch: int = 3, length: int = 13, seed: int = 5):
    """Token ids with rows left-padded by 0, 4 and 7 pads, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB - 1, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 4, 7)[:batch]):
        ids[row, :pads], mask[row, :pads] = 0, 0
    return ids, mask


def _gated_delta_float64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule token by token in the inputs' dtype (transformers' reference forms cast to float32):
    `S ← e^g S; S ← S + k (β (v − Sᵀk))ᵀ; o = Sᵀ q / √d`, q/k L2-normalised with ε = 1e-6."""
    B, T, Hk, dk = key.shape
    Hv, dv = value.shape[-2:]
    if Hv != Hk:
        query, key = (x.repeat_interleave(Hv // Hk, dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query / dk ** 0.5
    state = value.new_zeros(B, Hv, dk, dv) if initial_state is None else initial_state.to(value.dtype)
    out = torch.empty_like(value)
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (value[:, t] - torch.einsum("bhkv,bhk->bhv", state, key[:, t]))
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, query[:, t])
    return out, (state if output_final_state else None)


def _gated_norm_float64(self, hidden_states, gate):
    """Qwen's gated RMSNorm `w·x̂·silu(z)` in the input's dtype (transformers' form computes in float32)."""
    x̂ = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x̂ * F.silu(gate)


#: transformers' functions that take fla's or causal-conv1d's kernels where those are importable
KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")


def reference_forms(kind: str):
    """transformers' model of `kind` on its own PyTorch reference forms, also where fla is importable (the suite
    puts fla on the path for the fla converter tests; transformers then binds fla's Triton kernels, which need a
    GPU)."""
    module = importlib.import_module(f"transformers.models.{MODULES[kind]}.modeling_{MODULES[kind]}")
    return unwrapped_kernels(module, KERNEL_FUNCTIONS)


@contextlib.contextmanager
def float64_faithful(kind: str, model):
    """transformers' model of `kind` computing in float64 throughout: its float32 casts lifted (`Tensor.float()`
    keeps float64 and makes integers float64, the delta rule and the gated norm in the input's dtype, the rotary
    frequencies recomputed in float64). Everything else is transformers' own code."""
    module = importlib.import_module(f"transformers.models.{MODULES[kind]}.modeling_{MODULES[kind]}")
    to_float = torch.Tensor.float
    gated_norm = next(getattr(module, n) for n in dir(module) if n.endswith("RMSNormGated"))
    saved = {name: getattr(module, name) for name in ("torch_chunk_gated_delta_rule",
                                                      "torch_recurrent_gated_delta_rule")}
    saved_forward = gated_norm.forward
    conv = reference_forms(kind)
    for rotary in (m for m in model.modules() if type(m).__name__.endswith("TextRotaryEmbedding")
                   or type(m).__name__ == "Qwen3NextRotaryEmbedding"):
        dim = 2 * rotary.inv_freq.numel()
        theta = rotary.config.rope_parameters["rope_theta"]
        rotary.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    try:
        # (integer positions too become float64: the rotary frequencies multiply them)
        torch.Tensor.float = lambda self, *a, **kw: (self if self.dtype == torch.float64 else self.double()
                                                     if not self.is_floating_point() else to_float(self, *a, **kw))
        for name in saved:
            setattr(module, name, _gated_delta_float64)
        gated_norm.forward = _gated_norm_float64
        with conv:
            yield model
    finally:
        torch.Tensor.float = to_float
        for name, fn in saved.items():
            setattr(module, name, fn)
        gated_norm.forward = saved_forward


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()
