"""VLA's `qk_prenorm` option: per head √d·q/‖q‖ and √d·k/‖k‖ before the op's ELU+1, u still from the raw k (on by
default, with `output_norm`); off, with `output_norm` off, the mixer runs Algorithm 1 as written."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import AutoConfig

from lazoo import ops
from lazoo.layers.mixers import mixer_class

pytestmark = pytest.mark.usefixtures("single_thread")


def vla_mixer(**options):
    config = AutoConfig.for_model("lazoo_vla", hidden_size=16, num_attention_heads=2, **options)
    torch.manual_seed(0)
    mixer = mixer_class("vla")(config, 0, {**config.mixer_options("vla"), "backend": "recurrent"}).double()
    with torch.no_grad():
        mixer.u_weight.add_(0.1 * torch.randn_like(mixer.u_weight))
    return mixer


@pytest.mark.parametrize("prenorm", [False, True])
def test_the_mixer_feeds_the_op_prenormalised_queries_and_keys(prenorm):
    mixer = vla_mixer(qk_prenorm=prenorm, refresh_period=5)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (0.2 * torch.randn(2, 13, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False
    got, _ = mixer.mix(q, k, v, None, mask=mask, state=None, want_state=False)
    u = torch.einsum("bthd,hed->bthe", k, mixer.u_weight)  # from the raw k, with or without the prenorm
    if prenorm:
        q, k = (math.sqrt(8) * x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    d = mixer.head_dim  # penalty_norm="unit" (the default): λ₀ / d and η · d
    expected, _ = ops.vla(q, k, v, u, lambda0=0.1 / d, refresh_period=5, refresh_eta=1e-3 * d, eps=1e-4, mask=mask,
                          backend="recurrent")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_prenorm_changes_the_output_and_generates_the_same_with_its_cache():
    ids = random_ids(2, 17, seed=5)
    plain = tiny_model("vla", seed=1, qk_prenorm=False, output_norm=False)
    normed = tiny_model("vla", seed=1)
    assert (normed.config.qk_prenorm, normed.config.output_norm) == (True, True)  # the defaults
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, normed(ids).logits)
        cached = normed.generate(ids, max_new_tokens=6, do_sample=False)
        uncached = normed.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("mechanism", ["linear", "ela"])
def test_linear_and_ela_take_the_same_prenorm(mechanism):
    # the option VLA has on by default, off by default here: q and k reach the op at length √d per head
    config = AutoConfig.for_model(f"lazoo_{mechanism}", hidden_size=16, num_attention_heads=2, qk_prenorm=True)
    mixer = mixer_class(mechanism)(config, 0, {**config.mixer_options(mechanism), "backend": "recurrent"}).double()
    gen = torch.Generator().manual_seed(4)
    q, k, v = (0.2 * torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got, _ = mixer.mix(q, k, v, None, mask=None, state=None, want_state=False)
    qn, kn = (math.sqrt(8) * x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    op = {"linear": lambda *a: ops.linear_attention(*a, backend="recurrent"),
          "ela": lambda *a: ops.ela(*a, kernel="hadamard_exp", eps=1e-6, backend="recurrent")}[mechanism]
    torch.testing.assert_close(got, op(qn, kn, v)[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, op(q, k, v)[0])
