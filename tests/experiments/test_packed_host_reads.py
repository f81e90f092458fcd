"""experiments/packed_host_reads.py: the default batches are 32k tokens each, and without a CUDA GPU the script says
so."""

from __future__ import annotations

import pytest
import torch
from conftest import load_experiment

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def ph():
    return load_experiment("packed_host_reads")


def test_batches_are_32k_tokens(ph):
    assert all(sum(lens) == 32768 for lens in ph.BATCHES.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so(ph):
    with pytest.raises(SystemExit, match="CUDA GPU"):
        ph.main(["--layers", "1"])
