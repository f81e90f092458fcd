"""Kimi Linear folders ("Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team, 2025) saved by
transformers' own `KimiLinearForCausalLM`, converted with `lazoo convert`: the same logits as transformers' model in
float64 (its float32 casts lifted: `tests/kimi_reference.py`) and in float32 as it runs, the same greedy tokens with
the cache for 32 steps, left-padded prompts, the published config fields, and refusals naming the field that leave
DST as it was. The tiny model mixes KDA and MLA layers, a dense first layer and MoE layers with grouped routing, a
score-correction bias and a shared expert."""

from __future__ import annotations

import json

import pytest
import torch
from convert_helpers import check_refused, edit_config, run_convert, save_with_tokenizer_config
from kimi_reference import float32_casts_lifted, kimi_module, reference_forms, relative_error
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from qwen_helpers import VOCAB, prompt_and_mask  # left-padded rows of 0, 4 and 7 pads
from transformers import AutoModelForCausalLM

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.convert import ConversionError, UnsupportedCheckpointError, convert_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_fields(**overrides) -> dict:
    """KDA, MLA, KDA, MLA, KDA; a dense first layer, then MoE layers of 8 experts in 4 groups (top 3 from the best 2
    groups), renormalised and scaled, a shared expert of twice the expert width; MLA with a q LoRA rank."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                  q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=4, topk_group=2,
                  num_experts_per_tok=3, num_local_experts=8, n_shared_experts=2, routed_scaling_factor=2.446,
                  norm_topk_prob=True, linear_head_dim=8, linear_num_heads=2, layer_types=list(LAYERS),
                  mlp_layer_types=["dense"] + ["sparse"] * (len(LAYERS) - 1), rms_norm_eps=1e-5,
                  pad_token_id=0, bos_token_id=1, eos_token_id=VOCAB - 1)
    fields.update(overrides)
    return fields


def tiny_model(seed: int = 0, **overrides):
    """transformers' KimiLinearForCausalLM with random weights everywhere (norms, A_log, dt_bias and the correction
    bias too, so that a wrong norm, decay or choice of experts shows)."""
    kimi_module()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**tiny_fields(**overrides))).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.rand_like(p).mul(2).log())
            elif name.endswith(("dt_bias", "e_score_correction_bias")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # the router: scores spread enough to route differently per token
                p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, the converted lazoo model, the lazoo folder)."""
    root = tmp_path_factory.mktemp("kimi")
    reference = save_with_tokenizer_config(tiny_model(), root / "src")
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    return reference, ours, dst


def _logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def _error(reference, ours, context, dtype) -> float:
    """The relative error of our logits against transformers' (run inside `context`, without its cache) over every
    real position of left-padded prompts."""
    ids, mask = prompt_and_mask()
    with context:
        expected = _logits(reference, ids, mask, use_cache=False)
    assert expected.dtype == dtype
    real = mask.bool()
    return relative_error(_logits(ours, ids, mask)[real], expected[real])


def test_the_converted_config_says_what_it_computes(converted):
    _, ours, dst = converted
    config = ours.config
    assert config.layer_types == ["kda", "mla", "kda", "mla", "kda"]
    assert config.moe_layers == [1, 2, 3, 4] and config.moe_num_experts == 8 and config.moe_top_k == 3
    assert (config.moe_router_score, config.moe_score_correction_bias, config.moe_num_groups,
            config.moe_top_k_groups, config.moe_shared_expert_gate) == ("sigmoid", True, 4, 2, False)
    assert config.moe_routed_scaling_factor == 2.446 and config.moe_shared_expert_intermediate_size == 32
    assert config.converted_from["model_type"] == "kimi_linear"
    assert "model type `kimi_linear`" in (dst / "README.md").read_text()


def test_logits_equal_transformers_in_float64(converted):
    """Every real position of left-padded prompts; transformers' model in float64 with its float32 casts lifted
    (RMSNorms, the gated norm, the KDA functions, the forget gate, the router), its experts in its own loop."""
    reference, ours, _ = converted
    reference.config._attn_implementation = "sdpa"  # (the eager form takes its softmax in float32)
    reference.config._experts_implementation = "eager"
    assert _error(reference.double(), ours.double(), float32_casts_lifted(), torch.float64) < 1e-8


def test_logits_equal_transformers_in_float32(converted):
    """transformers' model as it runs by default (its float32 casts, its default experts implementation)."""
    reference, ours, _ = converted
    assert _error(reference.float(), ours.float(), reference_forms(), torch.float32) < 1e-5


def test_greedy_tokens_equal_transformers_for_32_steps_with_the_cache(converted):
    reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    reference, ours = reference.float(), ours.float()
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), reference_forms():
        expected = reference.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
        no_cache = ours.generate(ids, use_cache=False, **kwargs)
    assert expected.shape[1] == ids.shape[1] + 32
    assert len(set(expected[:, ids.shape[1]:].flatten().tolist())) > 3  # not one token repeated
    assert torch.equal(got, expected)
    assert torch.equal(no_cache, expected)


# ----------------------------------------------------------------------------- other layouts and folders
def test_the_in_memory_names_and_the_published_config_fields_convert(tmp_path):
    """A folder holding transformers' in-memory tensor names (`mlp.experts.gate_up_proj`, `self_attn.conv1d`,
    `forget_gate.*`), no q LoRA rank, and a config in the published form (`linear_attn_config` with 1-based layer
    numbers, `first_k_dense_replace`, `num_experts`, `moe_renormalize` ...): the same logits."""
    from safetensors.torch import save_file

    reference = tiny_model(seed=1, q_lora_rank=None, norm_topk_prob=False, n_group=2, topk_group=1)
    src = tmp_path / "src"
    save_with_tokenizer_config(reference, src)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})

    def published(cfg):
        for field in ("layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                      "mlp_layer_types"):
            cfg.pop(field)
        cfg.update(linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3, 5], "head_dim": 8,
                                       "num_heads": 2, "short_conv_kernel_size": 4},
                   first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True,
                   moe_router_activation_func="sigmoid", mla_use_nope=True, num_nextn_predict_layers=0,
                   rope_theta=10000.0, rope_scaling=None)

    edit_config(src, published)
    dst, _ = convert_checkpoint(src, tmp_path / "dst")
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.layer_types == ["kda", "mla", "kda", "mla", "kda"] and ours.config.moe_layers == [1, 2, 3, 4]
    assert _error(reference, ours, reference_forms(), torch.float32) < 1e-5


REFUSED = {
    "hidden_act": (lambda c: c.update(hidden_act="gelu"), UnsupportedCheckpointError),
    "num_key_value_heads": (lambda c: c.update(num_key_value_heads=2), UnsupportedCheckpointError),
    "moe_router_activation_func": (lambda c: c.update(moe_router_activation_func="softmax"),
                                   UnsupportedCheckpointError),
    "mla_use_nope": (lambda c: c.update(mla_use_nope=False), UnsupportedCheckpointError),
    "num_nextn_predict_layers": (lambda c: c.update(num_nextn_predict_layers=1), UnsupportedCheckpointError),
    "attention_dropout": (lambda c: c.update(attention_dropout=0.1), UnsupportedCheckpointError),
    "an_unknown_field": (lambda c: c.update(an_unknown_field=1), UnsupportedCheckpointError),
    "num_expert_group": (lambda c: c.update(num_expert_group=3), ConversionError),
    "n_group": (lambda c: c.update(n_group=2), ConversionError),  # beside num_expert_group = 4
    "mlp_layer_types": (lambda c: c.update(mlp_layer_types=["dense"]), ConversionError),
    "head_dim": (lambda c: c.update(head_dim=5), ConversionError),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_lazoo_cannot_convert_is_refused_by_name_and_dst_is_untouched(field, converted, tmp_path, capfd):
    import shutil

    edit, error = REFUSED[field]
    src = tmp_path / "src"
    shutil.copytree(converted[2].parent / "src", src)
    check_refused(src, tmp_path / "dst", edit, error, field, capfd)


def test_the_command_line_lists_kimi_linear_and_converts_it(converted, tmp_path, capfd):
    from lazoo_cli import main

    assert main(["convert", "--help"]) == 0
    assert "Kimi Linear (kimi_linear)" in " ".join(capfd.readouterr().out.split())
    status, err, _ = run_convert(converted[2].parent / "src", tmp_path / "dst", capfd)
    assert status == 0, err
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["moe_router_score"] == "sigmoid"
