"""Folders saved by lazoo 0.1.0 (tests/data/release_0_1_0, see its README) load with the current code and
give the logits they gave then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import lazoo  # noqa: F401  (registers the model types)

RELEASE = Path(__file__).parent / "data" / "release_0_1_0"
EXPECTED = torch.load(RELEASE / "expected_logits.pt")
FOLDERS = sorted(EXPECTED["logits"])


@pytest.mark.parametrize("name", FOLDERS)
def test_folder_of_0_1_0_gives_the_same_logits(name, single_thread):
    auto = AutoModelForSequenceClassification if "seqcls" in name else AutoModelForCausalLM
    model = auto.from_pretrained(RELEASE / name).eval()
    with torch.no_grad():
        logits = model(EXPECTED["input_ids"]).logits.double()
    torch.testing.assert_close(logits, EXPECTED["logits"][name], rtol=0, atol=1e-6)


def test_every_model_type_has_a_saved_folder():
    missing = set(lazoo.list_mechanisms()) - set(FOLDERS)
    assert not missing, f"no 0.1.0 folder for {sorted(missing)}"
