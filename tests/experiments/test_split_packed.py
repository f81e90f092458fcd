"""experiments/split_packed.py: its packed batch specs give the lengths they name, the default ones 32k tokens each,
and without a CUDA GPU the script says so."""

from __future__ import annotations

import pytest
import torch
from conftest import load_experiment

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def sp():
    return load_experiment("split_packed")


def test_packed_specs_name_every_document(sp):
    assert sp.lengths("24576+16x512") == [24576] + [512] * 16
    assert sp.lengths("3x100+7") == [100, 100, 100, 7]
    packed = [spec for spec in sp.BATCHES.split(",") if not spec.startswith("u")]
    assert packed and all(sum(sp.lengths(spec)) == 32768 for spec in packed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so(sp):
    with pytest.raises(SystemExit, match="CUDA GPU"):
        sp.main(["--batches", "u1x1024"])
