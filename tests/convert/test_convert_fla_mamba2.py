"""fla's Mamba-2 folders (model type `mamba2`, as fla 0.6.0's own `Mamba2ForCausalLM` saves them; "Transformers are
SSMs: Generalized Models and Efficient Algorithms Through Structured State Space Duality", Dao and Gu, 2024)
converted with `lazoo convert`. The reference is fla's model itself on the CPU: its layer's PyTorch form
(`Mamba2.torch_forward`, which fla takes wherever the mamba_ssm kernels are absent), with its Triton-only pieces on
fla's own PyTorch references (`rms_norm_ref` of fla/modules/norm for the RMSNorms and the gated RMSNorm, torch's
silu for fla's Triton swish), and in float64 with its float32 casts kept in float64 (tests/kimi_reference.py).

fla's PyTorch form has two paths: the decode step (one token on a cached state) and the prompt's chunked form. With
several groups of B and C (n_groups > 1) they disagree: the decode step, like fla's CUDA path (mamba_ssm's kernels),
gives head h the group h // (heads / n_groups), the chunked form the group h % n_groups (it tiles B and C with
`repeat`). lazoo follows the kernels. So every model is checked against fla's decode step run token by token from a
zero state (every prompt position, then 32 greedy tokens, with fla's cache), and the model of one group also
against fla's chunked form on a left-padded batch (its attention_mask) followed by its decode steps: the logits equal
fla's to 1e-8 relative in float64 and 1e-5 in float32, the greedy tokens are the same. fla's options lazoo cannot
express are refused by name, leaving DST as it was. A `mamba2` folder is fla's when its config holds a field only
fla writes."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import check_refused, edit_config, save_with_tokenizer_config
from kimi_reference import float64_kept, relative_error
from test_convert_fla import fla_models  # noqa: F401  (the fixture: fla's model classes)
from test_convert_fla_kda import prompt_and_mask  # left-padded rows of 0, 4 and 7 pads
from transformers import AutoModelForCausalLM

from lazoo.convert import ConversionError, UnsupportedCheckpointError, convert_checkpoint, from_fla

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 101
#: two tiny fla Mamba-2 configs: grouped B/C (2 groups), and one group with biases on in_proj / out_proj and none on
#: the convolution, tied embeddings and the residual kept in the model's dtype
CASES = {
    "groups": dict(vocab_size=VOCAB, hidden_size=32, head_dim=8, state_size=8, n_groups=2, num_hidden_layers=2,
                   chunk_size=8, pad_token_id=0),
    "biases": dict(vocab_size=VOCAB, hidden_size=24, head_dim=6, state_size=12, n_groups=1, expand=1,
                   num_hidden_layers=3, conv_kernel=3, use_bias=True, use_conv_bias=False, tie_word_embeddings=True,
                   residual_in_fp32=False, chunk_size=4, pad_token_id=0, dt_min=0.01, A_init_range=[2, 8]),
}


@contextlib.contextmanager
def fla_torch_forms():
    """fla's RMSNorm and gated RMSNorm (Triton kernels) on fla's own PyTorch references, inside the block."""
    from fla.modules.norm import layernorm, layernorm_gated

    def rms_norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layernorm.rms_norm_ref(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm)

    def gated_rms_norm(self, x, z=None):
        return layernorm_gated.rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps,
                                            group_size=self.group_size, norm_before_gate=self.norm_before_gate)

    real = layernorm.RMSNorm.forward, layernorm_gated.RMSNormGated.forward
    layernorm.RMSNorm.forward, layernorm_gated.RMSNormGated.forward = rms_norm, gated_rms_norm
    try:
        yield
    finally:
        layernorm.RMSNorm.forward, layernorm_gated.RMSNormGated.forward = real


def fla_model(fla_models, case: str, seed: int = 0):  # noqa: F811
    """fla's Mamba2ForCausalLM of `case`, every parameter random (A_log, dt_bias, D and the norms too)."""
    config_cls, model_cls = fla_models["mamba2"]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**CASES[case])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.rand_like(p).mul(2).log())
            elif name.endswith(("dt_bias", "bias")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
            elif p.dim() >= 2:  # projections, convolutions and embeddings at unit scale (fla's 0.02 lets one
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # token repeat itself in greedy decoding)
    for module in model.modules():
        if hasattr(module, "A_log"):
            module.act = F.silu  # fla's ACT2FN["silu"] is a Triton kernel; this is the function it computes
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, fla_models, tmp_path_factory):  # noqa: F811
    """(fla's model, the converted lazoo model, the source folder)."""
    root = tmp_path_factory.mktemp("fla_mamba2")
    reference = save_with_tokenizer_config(fla_model(fla_models, request.param), root / "src")
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    return reference, AutoModelForCausalLM.from_pretrained(dst).eval(), root / "src"


def fla_decode_steps(reference, tokens: torch.Tensor, new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's decode step on one sequence `tokens` [T], token by token from zero states in fla's cache, then
    `new_tokens` greedy tokens: (the logits at each of the T positions, the greedy tokens)."""
    from fla.models.cache_utils import Cache

    cache, dtype = Cache(), reference.lm_head.weight.dtype
    for i, block in enumerate(reference.backbone.layers):
        mixer = block.mixer
        cache.update(layer_idx=i, offset=0,
                     recurrent_state=torch.zeros(1, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size,
                                                 dtype=dtype),
                     conv_state=torch.zeros(1, mixer.conv_dim, mixer.conv_kernel_size, dtype=dtype))

    def step(token: torch.Tensor) -> torch.Tensor:
        return reference(token.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1]

    logits = torch.stack([step(token) for token in tokens])
    generated, last = [], logits[-1]
    for _ in range(new_tokens):
        generated.append(last.argmax())
        last = step(generated[-1])
    return logits, torch.stack(generated) if generated else tokens[:0]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-8), (torch.float32, 1e-5)])
def test_left_padded_logits_equal_fla_s_decode_step(converted, dtype, tolerance):
    reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    real = mask.bool()
    reference, ours = reference.to(dtype), ours.to(dtype)  # (outside float64_kept, which keeps float64 tensors)
    with torch.no_grad(), fla_torch_forms(), float64_kept():
        expected = torch.cat([fla_decode_steps(reference, ids[row, real[row]])[0] for row in range(ids.shape[0])])
        got = ours(ids, attention_mask=mask).logits
    assert expected.dtype == dtype
    assert relative_error(got[real], expected) < tolerance


def test_greedy_tokens_with_the_cache_equal_fla_s_decode_step_for_32_steps(converted):
    reference, ours, _ = converted
    ids, mask = prompt_and_mask()
    with torch.no_grad(), fla_torch_forms():
        got = ours.float().generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                    eos_token_id=None)[:, ids.shape[1]:]
        for row in range(ids.shape[0]):
            expected = fla_decode_steps(reference.float(), ids[row, mask[row].bool()], new_tokens=32)[1]
            assert torch.equal(got[row], expected), row
    assert len(set(got.flatten().tolist())) > 3  # not one token repeated


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-8), (torch.float32, 1e-5)])
def test_with_one_group_fla_s_masked_chunked_form_and_its_generate_agree(fla_models, tmp_path, dtype,  # noqa: F811
                                                                        tolerance):
    reference = save_with_tokenizer_config(fla_model(fla_models, "biases"), tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    ids, mask = prompt_and_mask()
    reference, ours = reference.to(dtype), ours.to(dtype)
    with torch.no_grad(), fla_torch_forms(), float64_kept():
        expected = reference(ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert expected.dtype == dtype
    assert relative_error(got[real], expected[real]) < tolerance
    if dtype == torch.float32:  # greedy: fla's masked prompt, then its decode steps on the cache the prompt left
        with torch.no_grad(), fla_torch_forms():
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[:, ids.shape[1]:]
            assert torch.equal(got, fla_greedy(reference, ids, mask, 32))


def fla_greedy(reference, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` greedy tokens of fla's model: the prompt through its chunked form with `mask`, then its decode step
    on the cache the prompt left (fla's own generate is not used: on transformers 5.24 it passes the cache as
    `cache`, which fla's forward does not read)."""
    out = reference(ids, attention_mask=mask, use_cache=True)
    cache, tokens = out.past_key_values, [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(steps - 1):
        tokens.append(reference(tokens[-1], past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1,
                                                                                                       keepdim=True))
    return torch.cat(tokens, dim=1)


def test_the_converted_config_says_what_it_computes(converted):
    reference, ours, src = converted
    options = ours.config.mixer_options("mamba2")
    fla_config = reference.config
    assert (options["num_heads"], options["head_dim"], options["n_groups"]) == (
        fla_config.num_heads, fla_config.head_dim, fla_config.n_groups)
    assert (options["time_step_min"], options["A_init_min"]) == (fla_config.dt_min, fla_config.A_init_range[0])
    assert ours.config.converted_from == {"format": "fla", "model_type": "mamba2", "source": "src", "left_out": []}
    assert "fla checkpoint `src`" in (src.parent / "dst" / "README.md").read_text()


def test_from_fla_points_fla_s_mamba2_to_lazoo_convert(converted, tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match="'model_type'.*lazoo convert"):
        from_fla(converted[2], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_mamba2_folder_without_fla_s_fields_is_read_as_transformers(converted, tmp_path):
    """fla's folder with every field only fla writes removed is transformers' layout: it converts as transformers'
    Mamba-2, to the same model (transformers' defaults: eps 1e-5, as this fla config's)."""
    from lazoo.convert.mamba import FLA_MAMBA2_MARKERS

    _, ours, src = converted
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    edit_config(plain, lambda c: [c.pop(field, None) for field in FLA_MAMBA2_MARKERS])
    out, _ = convert_checkpoint(plain, tmp_path / "out")
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert config.converted_from["format"] == "transformers" and config.layer_types == ours.config.layer_types


REFUSED = {
    "D_has_hdim": (lambda c: c.update(D_has_hdim=True), UnsupportedCheckpointError),
    "rmsnorm": (lambda c: c.update(rmsnorm=False), UnsupportedCheckpointError),
    "norm_before_gate": (lambda c: c.update(norm_before_gate=True), UnsupportedCheckpointError),
    "dt_limit": (lambda c: c.update(dt_limit=[0.0, 5.0]), UnsupportedCheckpointError),
    "hidden_act": (lambda c: c.update(hidden_act="gelu"), UnsupportedCheckpointError),
    "layer_norm_epsilon": (lambda c: c.update(layer_norm_epsilon=1e-5), UnsupportedCheckpointError),
    "an_unknown_field": (lambda c: c.update(an_unknown_field=1), UnsupportedCheckpointError),
    "num_heads": (lambda c: c.update(num_heads=3), ConversionError),
    "A_init_range": (lambda c: c.update(A_init_range=[16, 1]), ConversionError),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_lazoo_cannot_convert_is_refused_by_name_and_dst_is_untouched(field, fla_models, tmp_path,  # noqa: F811
                                                                           capfd):
    edit, error = REFUSED[field]
    src = tmp_path / "src"
    save_with_tokenizer_config(fla_model(fla_models, "groups"), src)
    check_refused(src, tmp_path / "dst", edit, error, field, capfd)
    assert json.loads((src / "config.json").read_text())["model_type"] == "mamba2"
