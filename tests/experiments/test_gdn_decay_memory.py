"""experiments/gdn_decay_memory.py: the share of a key's write that survives to the query, read from the Gated
DeltaNet layers' own gates, against the decay computed by hand; the slow-decay start of experiments/mqar.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import load_experiment


@pytest.fixture(scope="module")
def gdm():
    load_experiment("mqar")  # imported by name from the script
    return load_experiment("gdn_decay_memory")


def gdn_mixers(model):
    return [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "gates")]


@pytest.mark.parametrize("mechanism", ["gated_delta_net", "gated_delta_net_slow_decay"])
def test_retained_is_the_product_of_the_decays(gdm, mechanism):
    """With the decay's input projection zeroed, log α = −exp(A_log)·softplus(dt_bias) at every token: the share
    left after `distance` tokens is its exp(distance ·), head by head (float64)."""
    model = gdm.build_model(mechanism, seed=3).double()
    mixers = gdn_mixers(model)
    assert len(mixers) == 2
    for m in mixers:
        torch.nn.init.zeros_(m.a_proj.weight)
    mqar = load_experiment("mqar")
    batch = mqar.mqar_batch(2, 3, 128, generator=torch.Generator().manual_seed(0), seq_len=48)
    got = gdm.retained(model, batch, distance=40)
    want = [math.exp(-40 * math.exp(a) * F.softplus(torch.tensor(d, dtype=torch.float64)).item())
            for m in mixers for a, d in zip(m.A_log.tolist(), m.dt_bias.tolist())]
    assert got == pytest.approx(want, rel=1e-9)
    if mechanism.endswith("slow_decay"):  # A = 1, softplus(dt_bias) = 1e-3
        assert got == pytest.approx([math.exp(-40e-3)] * len(got), rel=1e-6)  # set in float32


def test_grad_ratio_is_finite_and_positive(gdm):
    model = gdm.build_model("delta_net", seed=1)
    mqar = load_experiment("mqar")
    batch = mqar.mqar_batch(2, 2, 128, generator=torch.Generator().manual_seed(1), seq_len=32)
    ratio = gdm.grad_ratio(model, batch, 2)
    assert 0 < ratio < math.inf
