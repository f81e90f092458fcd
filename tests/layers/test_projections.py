"""`project_together`: several projections of one input in one product, equal to each on its own (float64), with
biases where some have them, and one by one where a projection is not a plain `nn.Linear` (an adapter)."""

from __future__ import annotations

import torch
from torch import nn

from lazoo.layers.projections import project_together


def linears(seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(12, 7, bias=False).double(), nn.Linear(12, 3, bias=True).double(),
            nn.Linear(12, 5, bias=False).double()]


def test_one_product_equals_each_projection():
    mods = linears()
    x = torch.randn(4, 1, 12, dtype=torch.float64)
    got = project_together(x, mods)
    assert [g.shape for g in got] == [(4, 1, 7), (4, 1, 3), (4, 1, 5)]
    assert got[0].stride(-2) == 15  # views of one product
    for g, m in zip(got, mods):
        torch.testing.assert_close(g, m(x), rtol=1e-13, atol=1e-13)
    without_bias = [mods[0], mods[2]]
    for g, m in zip(project_together(x, without_bias), without_bias):
        torch.testing.assert_close(g, m(x), rtol=1e-13, atol=1e-13)


class Adapted(nn.Module):
    """A projection with an extra low-rank term, as a LoRA wrapper has."""

    def __init__(self, base):
        super().__init__()
        self.base, self.delta = base, nn.Linear(base.in_features, base.out_features, bias=False).double()
        self.weight = base.weight

    def forward(self, x):
        return self.base(x) + self.delta(x)


def test_adapted_projections_run_one_by_one():
    mods = linears(1)
    mods[1] = Adapted(mods[1])
    x = torch.randn(2, 1, 12, dtype=torch.float64)
    got = project_together(x, mods)
    for g, m in zip(got, mods):
        torch.testing.assert_close(g, m(x), rtol=0, atol=0)


def test_a_projection_with_a_forward_hook_runs_as_itself():
    mods = linears()
    seen = []
    mods[1].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(4, 2, 12, dtype=torch.float64)
    got = project_together(x, mods)
    assert seen == [(4, 2, 3)]  # the hook saw its module's call
    for g, m in zip(got, mods):
        torch.testing.assert_close(g, m(x), rtol=1e-13, atol=1e-13)


def test_a_recurrent_layer_projects_q_k_and_v_together_for_a_prompt_but_not_for_a_decode_step(monkeypatch):
    """A layer whose short convolutions take q, k and v: one product for T > 1 (the same output as three), the
    three projections one by one for a single token."""
    from transformers import AutoConfig

    from lazoo.layers.mixers import mixer_class, recurrent

    calls = []
    monkeypatch.setattr(recurrent, "project_together", lambda x, mods: calls.append(len(mods)) or
                        project_together(x, mods))
    config = AutoConfig.for_model("lazoo_gated_delta_net", hidden_size=32, num_attention_heads=4)
    torch.manual_seed(0)
    layer = mixer_class("gated_delta_net")(config, 0, config.mixer_options("gated_delta_net")).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    together = layer(x)
    assert calls == [3]
    monkeypatch.setattr(recurrent, "project_together", lambda x, mods: [m(x) for m in mods])
    torch.testing.assert_close(together, layer(x), rtol=1e-12, atol=1e-12)
    calls.clear()
    monkeypatch.setattr(recurrent, "project_together", lambda x, mods: calls.append(len(mods)) or
                        project_together(x, mods))
    layer(x[:, :1])
    assert calls == []
