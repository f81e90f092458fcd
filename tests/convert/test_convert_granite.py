"""GraniteMoeHybrid folders (Granite 4.0-H: Mamba-2 and attention layers, an MoE with a shared MLP, Granite's
scaling of the embeddings, residual branches, attention scores and logits) saved by transformers' own
`GraniteMoeHybridForCausalLM`, converted with `lazoo convert`: the same logits as transformers' model (float64 with its
float32 casts lifted, and float32 as it runs) at every real position of left-padded prompts, the same greedy tokens
with the cache for 32 steps, the published names of the layer kinds and of the tensors, and refusals naming the
field that leave DST as it was. On a transformers release without the class the tests skip, saying so."""

from __future__ import annotations

import contextlib

import pytest
import torch
from convert_helpers import check_outcome, edit_config, edit_weights, run_convert, snapshot
from log_helpers import library_logs_to_a_live_stream  # noqa: F401  (autouse: live log streams)
from mamba_helpers import VOCAB, float64_faithful, greedy_tokens, groups, logits_of, require, save_tiny
from qwen_helpers import prompt_and_mask, relative_error
from transformers import AutoModelForCausalLM

import lazoo  # noqa: F401  (registers lazoo's model types)
from lazoo.convert import convert_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

KIND = "granitemoehybrid"
#: the tiny model's variants (mamba_helpers.config_fields: Mamba-2, attention, Mamba-2, attention; 4 experts, top 2,
#: a shared MLP; embeddings ×12, residual branches ×0.22, scores ×1/8, logits ÷6; no positions): RoPE with one
#: expert a token and a tied head; no experts (the shared MLP alone)
CASES = {"moe_nope": {}, "moe_rope_top1_tied": {"position_embedding_type": "rope", "num_experts_per_tok": 1,
                                                "tie": True},
         "dense_rope": {"position_embedding_type": "rope", "num_local_experts": 0}}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, transformers' model, the converted lazoo model, dst) for each case."""
    case = request.param
    require(KIND)
    root = tmp_path_factory.mktemp(case)
    reference = save_tiny(root / "src", KIND, **CASES[case])
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    return case, reference, ours, dst


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-8), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_logits_equal_transformers(converted, dtype, rtol):
    """Every real position of left-padded prompts: transformers' model in float64 with its float32 casts lifted (the
    norms, the Mamba-2 forms, the router) and its experts in its own loop, or in float32 as it runs."""
    case, reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    reference, ours = reference.to(dtype), ours.to(dtype)
    lifted = contextlib.nullcontext()
    if dtype == torch.float64:
        reference.config._attn_implementation = "sdpa"  # (the eager form takes its softmax in float32)
        reference.config._experts_implementation = "eager"
        lifted = float64_faithful(reference)
    with lifted:
        expected = logits_of(reference, ids, mask, use_cache=False)
    assert expected.dtype == dtype
    got = logits_of(ours, ids, mask)
    real = mask.bool()
    assert relative_error(got[real], expected[real]) < rtol


def test_greedy_tokens_equal_transformers_for_32_steps_with_the_cache(converted):
    case, reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    expected, got = greedy_tokens(reference, ours, ids, mask)
    assert torch.equal(got, expected)


def test_the_converted_config_says_what_it_computes(converted):
    case, reference, ours, dst = converted
    config = ours.config
    assert config.converted_from["model_type"] == KIND and f"model type `{KIND}`" in (dst / "README.md").read_text()
    assert config.layer_types == ["mamba2", "softmax", "mamba2", "softmax"]
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (12.0, 0.22, 6.0)
    assert config.tie_word_embeddings == ("tied" in case) and config.vocab_size == VOCAB
    attention = config.mixer_options("softmax")
    assert (attention["softmax_scale"], attention["num_kv_heads"], attention["use_rope"]) == (1 / 8, 2, "rope" in case)
    mamba = config.mixer_options("mamba2")
    assert (mamba["num_heads"], mamba["head_dim"], mamba["state_size"], mamba["n_groups"]) == (4, 16, 8, groups(KIND))
    if case.startswith("dense"):
        assert config.moe_num_experts == 0 and config.intermediate_size == 40
    else:
        assert (config.moe_num_experts, config.moe_top_k, config.moe_intermediate_size) == (4, 2 - ("top1" in case), 24)
        assert (config.moe_bias, config.moe_norm_top_k, config.moe_shared_expert_intermediate_size,
                config.moe_shared_expert_gate) == (None, True, 40, False)


#: fields as the published Granite 4.0-H folders write them (older layer names, also under the alias
#: `layers_block_type`; the rotary base at the top level; init and normalisation names)
PUBLISHED = {"layer_types": ["mamba", "attention", "mamba", "attention"],
             "layers_block_type": ["mamba", "attention", "mamba", "attention"], "rope_theta": 10000,
             "rope_scaling": None, "init_method": "mup", "normalization_function": "rmsnorm", "torch_dtype": "float32"}


def test_the_published_fields_and_tensor_names_convert(tmp_path):
    """A config written as the published folders write it (PUBLISHED) and the names transformers holds the MoE's
    tensors under in memory (`router.weight`, `experts.gate_up_proj`, `experts.down_proj`) give the same model."""
    require(KIND)
    reference = save_tiny(tmp_path / "src", KIND)
    edit_config(tmp_path / "src", lambda c: [c.pop("rope_parameters"), c.update(PUBLISHED)])
    in_memory = {"block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
                 "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
                 "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj"}

    def rename(tensors):
        for name in [n for n in tensors if n.endswith(tuple(in_memory))]:
            saved = next(s for s in in_memory if name.endswith(s))
            tensors[name.replace(saved, in_memory[saved])] = tensors.pop(name)

    edit_weights(tmp_path / "src", rename)
    dst, _ = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.layer_types == ["mamba2", "softmax", "mamba2", "softmax"]
    ids, mask = prompt_and_mask()
    real = mask.bool()
    assert relative_error(logits_of(ours, ids, mask)[real], logits_of(reference, ids, mask)[real]) < 1e-5


# ----------------------------------------------------------------------------- refusals
ROPE = {"position_embedding_type": "rope"}
REFUSED_CONFIGS = {
    "a gelu MLP": (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    "attention biases": (lambda c: c.update(attention_bias=True), "attention_bias"),
    "attention dropout": (lambda c: c.update(attention_dropout=0.1), "attention_dropout"),
    "a layer norm": (lambda c: c.update(normalization_function="layernorm"), "normalization_function"),
    "another position embedding": (lambda c: c.update(position_embedding_type="alibi"), "position_embedding_type"),
    "scaled rope": (lambda c: c.update(**ROPE, rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                "factor": 2.0}), "rope_parameters"),
    "rope on half a head": (lambda c: c.update(**ROPE, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.5}),
                            "partial_rotary_factor"),
    "a clamp on dt": (lambda c: c.update(time_step_limit=[0.0, 0.5]), "time_step_limit"),
    "a shared MLP of width 0 beside the experts": (lambda c: c.update(shared_intermediate_size=0),
                                                   "shared_intermediate_size"),
    "more experts a token than there are": (lambda c: c.update(num_experts_per_tok=5), "num_experts_per_tok"),
    "a negative embedding multiplier": (lambda c: c.update(embedding_multiplier=-1.0), "embedding_multiplier"),
    "a logits divisor of 0": (lambda c: c.update(logits_scaling=0), "logits_scaling"),
    "an attention multiplier that is a string": (lambda c: c.update(attention_multiplier="0.125"),
                                                 "attention_multiplier"),
    "an unknown layer kind": (lambda c: c.update(layer_types=["mamba", "mlp", "mamba", "attention"]), "layer_types"),
    "two layer lists that differ": (lambda c: c.update(layers_block_type=["mamba"] * 4), "layers_block_type"),
    "an unknown field": (lambda c: c.update(mixer_type="mamba3"), "mixer_type"),
}


def _refusal(tmp_path, capfd, edit_folder, edit, existing_dst: bool) -> str:
    """The one error line of `lazoo convert` on the tiny folder edited by `edit_folder(src, edit)`, after checking
    that DST (an existing folder with a file in it, or none) is as it was."""
    require(KIND)
    save_tiny(tmp_path / "src", KIND)
    edit_folder(tmp_path / "src", edit)
    if existing_dst:
        (tmp_path / "dst").mkdir()
        (tmp_path / "dst" / "keep.txt").write_text("kept")
    before = snapshot(tmp_path / "dst")
    status, err, _ = run_convert(tmp_path / "src", tmp_path / "dst", capfd)
    check_outcome(status, err, tmp_path / "dst", before)
    assert status == 2, err
    return err[0]


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_a_config_lazoo_cannot_express_is_refused_by_field_and_dst_is_untouched(case, tmp_path, capfd):
    edit, field = REFUSED_CONFIGS[case]
    error = _refusal(tmp_path, capfd, edit_config, edit, existing_dst=True)
    assert field in error and "config.json" in error, error


REFUSED_WEIGHTS = {
    "a missing router": (lambda t: t.pop("model.layers.0.block_sparse_moe.router.layer.weight"), "router"),
    "experts of the wrong width": (
        lambda t: t.update({"model.layers.2.block_sparse_moe.input_linear.weight":
                            t["model.layers.2.block_sparse_moe.input_linear.weight"][:, :-2].contiguous()}),
        "input_linear"),
    "a NaN in the shared MLP": (lambda t: t["model.layers.1.shared_mlp.output_linear.weight"].fill_(float("nan")),
                                "shared_mlp"),
    "a tensor no Granite model writes": (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
                                         "extra.weight"),
}


@pytest.mark.parametrize("case", list(REFUSED_WEIGHTS))
def test_weights_that_do_not_fit_are_refused_by_name_and_dst_is_untouched(case, tmp_path, capfd):
    edit, name = REFUSED_WEIGHTS[case]
    error = _refusal(tmp_path, capfd, edit_weights, edit, existing_dst=False)
    assert name in error, error
