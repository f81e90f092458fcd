"""fla's KDA folders (model type `kda`: "Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team,
2025, as fla's `KimiDeltaAttention` computes it) converted with `lazoo convert`: left-padded prompts give the logits
of fla's model (the float64 transcription of tests/fla_reference.py, which runs each sample's real tokens alone, as
fla's layer does when it unpads a masked batch) to 1e-8 relative in float64 and 1e-5 in float32; 32 greedy tokens
with the cache equal the transcription's, recomputed from scratch at each step; fla's options lazoo cannot express
are refused by name, leaving DST as it was. (tests/convert/test_convert_fla.py checks the same cases unpadded, and
folders saved by fla's own KDA classes.)"""

from __future__ import annotations

import pytest
import torch
from convert_helpers import check_refused
from kimi_reference import relative_error
from test_convert_fla import fla_config, fla_logits, random_fla_checkpoint, write_fla_folder
from transformers import AutoModelForCausalLM

from lazoo.convert import ConversionError, UnsupportedCheckpointError, convert_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

#: the padding of each prompt row (left padding)
PADS = (0, 4, 7)
PROMPT_LENGTH = 14


def prompt_and_mask() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of ids in [3, 101), left-padded with 0 by PADS."""
    ids = torch.randint(3, 101, (len(PADS), PROMPT_LENGTH), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    for row, pads in enumerate(PADS):
        ids[row, :pads], mask[row, :pads] = 0, 0
    return ids, mask


@pytest.fixture(scope="module", params=["kda", "kda+attn"])
def converted(request, tmp_path_factory):
    """(fla's config, its float64 weights, the converted lazoo model) of a test_convert_fla
    case: KDA with grouped value heads and doubled β, or KDA without short convolutions, with the bounded decay
    (lower_bound) and an attention layer."""
    root = tmp_path_factory.mktemp("kda")
    cfg = fla_config(request.param)
    weights = random_fla_checkpoint(cfg, seed=3)
    write_fla_folder(root / "src", cfg, weights)
    dst, left_out = convert_checkpoint(root / "src", root / "dst")
    assert left_out == []
    return cfg, weights, AutoModelForCausalLM.from_pretrained(dst).eval()


def _reference_rows(weights, cfg, ids, mask) -> list[torch.Tensor]:
    """fla's logits of each row's real tokens."""
    return [fla_logits(weights, cfg, ids[row, mask[row].bool()]) for row in range(ids.shape[0])]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-8), (torch.float32, 1e-5)])
def test_left_padded_logits_equal_fla_s(converted, dtype, tolerance):
    cfg, weights, model = converted
    ids, mask = prompt_and_mask()
    with torch.no_grad():
        got = model.to(dtype)(ids, attention_mask=mask).logits
    real = mask.bool()
    expected = torch.cat(_reference_rows(weights, cfg, ids, mask))
    assert relative_error(got[real], expected) < tolerance


def test_greedy_tokens_with_the_cache_equal_fla_s_for_32_steps(converted):
    cfg, weights, model = converted
    ids, mask = prompt_and_mask()
    with torch.no_grad():
        got = model.double().generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                       eos_token_id=None)[:, ids.shape[1]:]
    for row in range(ids.shape[0]):
        tokens = ids[row, mask[row].bool()]
        for _ in range(32):
            tokens = torch.cat([tokens, fla_logits(weights, cfg, tokens)[-1].argmax().view(1)])
        assert torch.equal(got[row], tokens[-32:]), row
    assert len(set(got.flatten().tolist())) > 3  # not one token repeated


def test_the_converted_config_says_what_it_computes(converted):
    cfg, _, model = converted
    options = model.config.mixer_options("kda")
    assert options["gate_bias"] is True and options["gate_low_rank_dim"] is None
    assert options["gate_lower_bound"] == cfg.get("lower_bound")
    assert options["use_short_conv"] == cfg.get("use_short_conv", True)
    assert model.config.converted_from == {"format": "fla", "model_type": "kda", "source": "src"}


REFUSED = {
    "hidden_act": (lambda c: c.update(hidden_act="gelu"), UnsupportedCheckpointError),
    "attnres_block_size": (lambda c: c.update(attnres_block_size=2), UnsupportedCheckpointError),
    "an_unknown_field": (lambda c: c.update(an_unknown_field=1), UnsupportedCheckpointError),
    "num_v_heads": (lambda c: c.update(num_v_heads=3), ConversionError),
    "lower_bound": (lambda c: c.update(lower_bound=0.5), ConversionError),
    "safe_gate": (lambda c: c.update(safe_gate=True, lower_bound=None), ConversionError),
    "expand_v": (lambda c: c.update(expand_v=1.1), ConversionError),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_lazoo_cannot_convert_is_refused_by_name_and_dst_is_untouched(field, tmp_path, capfd):
    edit, error = REFUSED[field]
    src = tmp_path / "src"
    cfg = fla_config("kda")
    write_fla_folder(src, cfg, random_fla_checkpoint(cfg, seed=0, dtype=torch.float32))
    check_refused(src, tmp_path / "dst", edit, error, field, capfd)


def test_the_bounded_decay_is_a_mixer_option_that_round_trips(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("lazoo_hybrid", vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, layer_types=["kda"],
                                  mixer_kwargs={"kda": {"head_k_dim": 8, "gate_lower_bound": -3.0}})
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    mixer = loaded.model.layers[0].mixer
    assert mixer.options["gate_lower_bound"] == -3.0
    with torch.no_grad():
        g = mixer.double().log_decay(torch.randn(1, 5, 16, dtype=torch.float64))
    assert bool((g > -3.0).all() and (g < 0).all())
    for bad in (0.0, 1.0, True, "low", float("-inf")):
        config.mixer_kwargs = {"kda": {"head_k_dim": 8, "gate_lower_bound": bad}}
        with pytest.raises(ValueError, match="gate_lower_bound"):
            AutoModelForCausalLM.from_config(config)
