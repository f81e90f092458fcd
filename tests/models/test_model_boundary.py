"""The model's entry refuses what is not an input, by name (table-driven, one row per case).

Masks: `attention_mask` values other than 0 and 1 (2, 0.5, -1, NaN) once changed the softmax, sliding-window and
hybrid logits silently (the model passed `mask.bool()` to the layers and `mask.long()` to the positions); a mask of
0/1 as bool, int or float is accepted and gives the same logits. A cache built for another number of layers was an
IndexError. Pads at the short convolution: see tests/models/test_pad_isolation_models.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_MODELS, random_ids, tiny_model

from lazoo.models.cache import LazooCache

B, T = 2, 9


def _mask(value) -> torch.Tensor:
    mask = torch.ones(B, T)
    mask[1, :3] = 0
    mask[0, 4] = value
    return mask


BAD_MASKS = {
    "two": _mask(2.0),
    "half": _mask(0.5),
    "negative": _mask(-1.0),
    "nan": _mask(math.nan),
    "long two": _mask(2.0).long(),
    "negative long": _mask(-1.0).long(),
    "complex": torch.ones(B, T, dtype=torch.complex64),
    "a list": [[1] * T] * B,
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
@pytest.mark.parametrize("name", ["softmax", "sliding_window", "gated_delta_net", "hybrid"])
def test_a_mask_that_is_not_0_or_1_is_refused(name, case, single_thread):
    model = tiny_model(name)
    with pytest.raises(ValueError, match="attention_mask"):
        model(random_ids(B, T, seed=0), attention_mask=BAD_MASKS[case])


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_model_refuses_a_negative_mask(name, single_thread):
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        tiny_model(name)(random_ids(B, T, seed=0), attention_mask=_mask(-1.0))


@pytest.mark.parametrize("name", ["softmax", "hybrid", "gated_delta_net"])
def test_bool_int_and_float_masks_of_0_and_1_agree(name, single_thread):
    model, ids = tiny_model(name), random_ids(B, T, seed=1)
    mask = _mask(1.0)
    with torch.no_grad():
        logits = [model(ids, attention_mask=m).logits for m in (mask.bool(), mask.long(), mask, mask.double())]
    for other in logits[1:]:
        assert torch.equal(logits[0], other)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_cache_of_another_model_is_refused(layers, single_thread):
    model = tiny_model("gated_delta_net")
    with pytest.raises(ValueError, match=f"the cache has {layers} layers but the model has 2"):
        model(random_ids(B, T, seed=0), past_key_values=LazooCache(layers), use_cache=True)


def test_a_mask_is_checked_in_generate_too(single_thread):
    model = tiny_model("hybrid")
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(random_ids(B, T, seed=0), attention_mask=_mask(2.0).long(), max_new_tokens=2)
