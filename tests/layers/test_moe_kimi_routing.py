"""The routed MoE with Kimi Linear's routing ("Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi
Team, 2025): sigmoid scores, a score-correction bias that only chooses the experts, group-limited top-k, the
renormalised weights (with Kimi's + 1e-20) times a routed scaling factor, and a shared expert without a gate. Each
option against a float64 token-by-token reference written here, the whole block against transformers'
`KimiLinearMoE` with its weights copied in (float64, its float32 router cast lifted), the config fields' errors, and
a model with the options saved and loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_config
from kimi_reference import float32_casts_lifted, kimi_module
from transformers import AutoModelForCausalLM

from lazoo.layers.moe import RoutedMoE

pytestmark = pytest.mark.usefixtures("single_thread")

HIDDEN, EXPERTS, WIDTH = 32, 8, 16
#: lazoo's names in the MoE block -> transformers' (KimiLinearMoE)
KIMI_NAMES = {
    "router.weight": "gate.weight",
    "e_score_correction_bias": "gate.e_score_correction_bias",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
    "shared_expert.gate_proj.weight": "shared_experts.gate_proj.weight",
    "shared_expert.up_proj.weight": "shared_experts.up_proj.weight",
    "shared_expert.down_proj.weight": "shared_experts.down_proj.weight",
}


def random_moe(seed: int = 0, **options) -> RoutedMoE:
    """A float64 RoutedMoE with random weights (the correction bias too, strong enough to change choices)."""
    torch.manual_seed(seed)
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, options.pop("top_k", 3), bias=None, **options).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.normal_(0, 0.3)
    return moe


def reference(moe: RoutedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token in float64, from the module's weights and options (the module docstring's formulas)."""
    flat = x.reshape(-1, HIDDEN)
    out = torch.zeros_like(flat)
    size = EXPERTS // moe.num_groups
    for n in range(flat.shape[0]):
        logits = moe.router.weight @ flat[n]
        s = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        c = s if moe.e_score_correction_bias is None else s + moe.e_score_correction_bias
        group_score = [sorted(c[g * size:(g + 1) * size].tolist())[-2:] for g in range(moe.num_groups)]
        groups = sorted(range(moe.num_groups), key=lambda g: -sum(group_score[g]))[:moe.top_k_groups]
        allowed = [e for e in range(EXPERTS) if e // size in groups]
        top = sorted(allowed, key=lambda e: -c[e].item())[:moe.top_k]
        w = s[top]
        if moe.norm_top_k or (moe.norm_top_k is None and moe.top_k > 1):
            w = w / (w.sum() + (1e-20 if moe.score == "sigmoid" else 0.0))
        w = w * moe.routed_scaling_factor
        for e, weight in zip(top, w):
            gate_up = moe.experts.gate_up_proj[e] @ flat[n]
            out[n] += weight * (moe.experts.down_proj[e] @ (F.silu(gate_up[:WIDTH]) * gate_up[WIDTH:]))
        if moe.shared_expert is not None:
            shared = moe.shared_expert(flat[n])
            gate = 1.0 if moe.shared_expert_gate is None else torch.sigmoid(moe.shared_expert_gate(flat[n]))
            out[n] += gate * shared
    return out.view_as(x)


def chosen(moe: RoutedMoE, x: torch.Tensor) -> set[tuple[int, int]]:
    """The (token, expert) pairs the module routes."""
    _, _, top_idx = moe.route(x.reshape(-1, HIDDEN))
    return {(n, e) for n, row in enumerate(top_idx.tolist()) for e in row}


OPTIONS = {
    "sigmoid scores": dict(score="sigmoid"),
    "sigmoid, renormalised, scaled": dict(score="sigmoid", norm_top_k=True, routed_scaling_factor=2.446),
    "a correction bias": dict(score="sigmoid", score_correction_bias=True, norm_top_k=True),
    "2 of 4 groups": dict(num_groups=4, top_k_groups=2, norm_top_k=False),
    "softmax, 1 of 2 groups, scaled": dict(num_groups=2, top_k_groups=1, routed_scaling_factor=0.5),
    "a shared expert without a gate": dict(shared_intermediate_size=24, shared_gate=False),
    "Kimi Linear's": dict(score="sigmoid", score_correction_bias=True, num_groups=4, top_k_groups=2, norm_top_k=True,
                          routed_scaling_factor=2.446, shared_intermediate_size=32, shared_gate=False),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_each_routing_option_equals_the_float64_reference(case):
    moe = random_moe(**OPTIONS[case], backend="loop")
    x = torch.randn(3, 7, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        expected = reference(moe, x)
        got = moe(x)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-12


def test_the_grouped_expert_backend_routes_as_the_loop_does():
    """Kimi Linear's options with the experts as grouped GEMMs (float32, the dtypes grouped_mm takes)."""
    from lazoo.layers.moe import _grouped_mm_function

    if _grouped_mm_function() is None:
        pytest.skip("this torch has no grouped_mm")
    moe = random_moe(**OPTIONS["Kimi Linear's"], backend="loop")
    x = torch.randn(3, 7, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        expected = reference(moe, x)
        moe = moe.float()
        moe.expert_backend = "grouped"
        got = moe(x.float())
    assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_the_options_change_the_routing_they_claim_to():
    """The correction bias changes which experts are chosen but not the weights' source; group limits exclude experts
    that plain top-k takes; the scaling factor scales the routed part only (the tests above would pass vacuously
    otherwise)."""
    x = torch.randn(4, 9, HIDDEN, dtype=torch.float64)
    plain = random_moe(score="sigmoid", score_correction_bias=True)
    unbiased = random_moe(score="sigmoid")
    assert chosen(plain, x) != chosen(unbiased, x)
    grouped = random_moe(num_groups=4, top_k_groups=1, top_k=2)
    size = EXPERTS // 4
    for n, row in enumerate(grouped.route(x.reshape(-1, HIDDEN))[2].tolist()):
        assert len({e // size for e in row}) == 1, (n, row)  # every expert from the one chosen group
    assert chosen(grouped, x) != chosen(random_moe(top_k=2), x)
    once, twice = random_moe(shared_intermediate_size=8, shared_gate=False), \
        random_moe(shared_intermediate_size=8, shared_gate=False, routed_scaling_factor=2.0)
    with torch.no_grad():
        shared = once.shared_expert(x)
        torch.testing.assert_close(twice(x) - shared, 2 * (once(x) - shared), rtol=1e-12, atol=1e-12)
    assert "shared_expert_gate.weight" not in once.state_dict()
    assert plain.state_dict()["e_score_correction_bias"].shape == (EXPERTS,)


def test_the_correction_bias_is_a_saved_buffer_without_gradient():
    moe = random_moe(score="sigmoid", score_correction_bias=True, norm_top_k=True)
    assert "e_score_correction_bias" not in dict(moe.named_parameters())
    assert "e_score_correction_bias" in moe.state_dict()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    moe(x).sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- against transformers
def kimi_block(top_k: int, groups: int, top_groups: int, norm: bool, shared: int):
    """transformers' KimiLinearMoE in float64 with random weights (and a random correction bias)."""
    kimi = kimi_module()
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_local_experts=EXPERTS,
                              num_experts_per_tok=top_k, n_group=groups, topk_group=top_groups,
                              n_shared_experts=shared, routed_scaling_factor=2.446, norm_topk_prob=norm)
    config._experts_implementation = "eager"
    block = kimi.KimiLinearMoE(config).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*block.named_parameters(), *block.named_buffers()]:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (1.0 if "gate." in name else 0.3))
    return block


@pytest.mark.parametrize("top_k, groups, top_groups, norm", [(3, 4, 2, True), (2, 2, 1, False), (4, 1, 1, True)])
def test_the_block_equals_transformers_kimi_linear_moe(top_k, groups, top_groups, norm):
    block = kimi_block(top_k, groups, top_groups, norm, shared=2)
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, top_k, bias=None, norm_top_k=norm, shared_intermediate_size=2 * WIDTH,
                    score="sigmoid", score_correction_bias=True, num_groups=groups, top_k_groups=top_groups,
                    routed_scaling_factor=2.446, shared_gate=False).double()
    theirs = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    assert set(theirs) == set(KIMI_NAMES.values())
    moe.load_state_dict({ours: theirs[name] for ours, name in KIMI_NAMES.items()}, strict=True)
    x = torch.randn(3, 11, HIDDEN, dtype=torch.float64)
    with torch.no_grad(), float32_casts_lifted():
        expected = block(x)
    assert expected.dtype == torch.float64
    got = moe(x)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-12
    if groups > top_groups:  # the group limit takes part: plain top-k over the biased scores differs somewhere
        plain = RoutedMoE(HIDDEN, WIDTH, EXPERTS, top_k, bias=None, score="sigmoid",
                          score_correction_bias=True).double()
        plain.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("shared")})
        assert chosen(plain, x) != chosen(moe, x)


# ----------------------------------------------------------------------------- the config fields
BAD_FIELDS = {
    "moe_router_score": ("tanh", "moe_router_score must be one of"),
    "moe_score_correction_bias": (1, "moe_score_correction_bias must be True or False"),
    "moe_num_groups": (3, "moe_num_groups must be an int >= 1 dividing the 4 experts"),
    "moe_top_k_groups": (5, r"moe_top_k_groups must be None \(every group\) or an int in \[1, moe_num_groups=2\]"),
    "moe_routed_scaling_factor": (0.0, "moe_routed_scaling_factor must be a finite number > 0"),
    "moe_shared_expert_gate": ("no", "moe_shared_expert_gate must be True or False"),
}


@pytest.mark.parametrize("field", list(BAD_FIELDS))
def test_a_bad_routing_field_is_refused_by_name(field):
    value, message = BAD_FIELDS[field]
    extra = {"moe_num_groups": 2} if field == "moe_top_k_groups" else {}
    with pytest.raises(ValueError, match=message):
        tiny_config("softmax", moe_num_experts=4, moe_top_k=2, **extra, **{field: value})


def test_groups_of_one_expert_and_too_few_chosen_experts_are_refused():
    with pytest.raises(ValueError, match="leaves 1 expert a group"):
        tiny_config("softmax", moe_num_experts=4, moe_top_k=2, moe_num_groups=4, moe_top_k_groups=2)
    with pytest.raises(ValueError, match="top_k=3 is more than the 2 experts of the moe_top_k_groups=1 groups"):
        tiny_config("softmax", moe_num_experts=4, moe_top_k=3, moe_num_groups=2, moe_top_k_groups=1)


def test_a_model_with_kimi_routing_saves_and_loads_with_its_numbers(tmp_path):
    config = tiny_config("softmax", moe_num_experts=4, moe_top_k=2, moe_bias=None, moe_router_score="sigmoid",
                         moe_score_correction_bias=True, moe_num_groups=2, moe_top_k_groups=1, moe_norm_top_k=True,
                         moe_routed_scaling_factor=2.0, moe_shared_expert_intermediate_size=16,
                         moe_shared_expert_gate=False, moe_layers=[1])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.e_score_correction_bias.normal_()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.model.layers[1].mlp.e_score_correction_bias,
                               model.model.layers[1].mlp.e_score_correction_bias, rtol=0, atol=0)
    assert loaded.model.layers[1].mlp.shared_expert_gate is None
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
