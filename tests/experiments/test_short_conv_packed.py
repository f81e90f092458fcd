"""experiments/short_conv_packed.py: its batches are 16k tokens each, the batched kernel's comparison is made only
where the documents are of one length, and without a CUDA GPU the script says so."""

from __future__ import annotations

import pytest
import torch
from conftest import load_experiment


@pytest.fixture(scope="module")
def scp():
    return load_experiment("short_conv_packed")


def test_batches_are_16k_tokens(scp):
    assert all(sum(lens) == 16384 for lens in scp.BATCHES.values())
    assert any(len(set(lens)) > 1 for lens in scp.BATCHES.values())  # one batch of mixed lengths


def test_the_switch_is_restored(scp):
    before = scp.short_conv_layer.PACKED_KERNEL
    with scp.packed_form(not before):
        assert scp.short_conv_layer.PACKED_KERNEL is (not before)
    assert scp.short_conv_layer.PACKED_KERNEL is before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so(scp):
    with pytest.raises(SystemExit, match="CUDA GPU"):
        scp.main([])
