"""The routed MoE computes what transformers' Qwen3-Next and Qwen3.5-MoE sparse MoE blocks compute (router softmax
in float32, top-k, renormalised or not, experts SwiGLU, a shared expert scaled by a sigmoid gate), with their
weights copied in; the dense/MoE choice per layer (`moe_layers`, Qwen3-Next's `decoder_sparse_step` and
`mlp_only_layers`); the grouped-GEMM expert path equals the per-expert loop; folders saved with one module per expert
still load; pads stay out (CPU, float64 references; the bf16 grouped path on CUDA under `-m gpu`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_config, tiny_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lazoo.layers.mlp import GatedMLP
from lazoo.layers.moe import RoutedMoE, grouped_mm_supported, stack_legacy_experts
from lazoo.models.configuration_lazoo import moe_layers_from_sparse_step

pytestmark = pytest.mark.usefixtures("single_thread")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "moe_experts_per_module"
HIDDEN, EXPERTS, WIDTH, SHARED = 32, 8, 16, 24
#: lazoo's parameter names in the MoE block -> transformers' (Qwen3NextSparseMoeBlock, Qwen3_5MoeSparseMoeBlock)
QWEN_NAMES = {
    "router.weight": "gate.weight",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
    "shared_expert.gate_proj.weight": "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight": "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight": "shared_expert.down_proj.weight",
    "shared_expert_gate.weight": "shared_expert_gate.weight",
}


def rel_err(actual, expected, floor: float = 1e-30) -> float:
    """max |actual − expected| / max(max |expected|, floor): `floor` for a quantity that is 0 in exact arithmetic (the
    router's gradient when k = 1 and the single score is renormalised to 1)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all()
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(floor)).item()


# ----------------------------------------------------------------------------- transformers' blocks
def qwen_block(kind: str, top_k: int, norm: bool):
    """A float64 transformers sparse MoE block of `kind` ("qwen3_next", "qwen3_5_moe") with random weights."""
    if kind == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block

        config = Qwen3NextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
                                 moe_intermediate_size=WIDTH, shared_expert_intermediate_size=SHARED,
                                 norm_topk_prob=norm)
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block

        config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
                                      moe_intermediate_size=WIDTH, shared_expert_intermediate_size=SHARED)
        assert not hasattr(config, "norm_topk_prob") and norm  # Qwen3.5-MoE always renormalises
    assert config.hidden_act == "silu"
    block = Block(config).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (1.0 if name == "gate.weight" else 0.3))
    return block


def lazoo_copy(block, top_k: int, norm: bool, **kwargs) -> RoutedMoE:
    """lazoo's block with `block`'s weights: Qwen's options are bias=None and norm_top_k=norm_topk_prob."""
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, top_k, bias=None, norm_top_k=norm, shared_intermediate_size=SHARED,
                    **kwargs).double()
    theirs = dict(block.named_parameters())
    ours = dict(moe.named_parameters())
    assert set(ours) == set(QWEN_NAMES) and set(theirs) == set(QWEN_NAMES.values())
    with torch.no_grad():
        for name, p in ours.items():
            assert p.shape == theirs[QWEN_NAMES[name]].shape, name
            p.copy_(theirs[QWEN_NAMES[name]])
    return moe


def float64_router(self, hidden_states):
    """transformers' Qwen router with its softmax in the logits' dtype (float64 here) instead of float32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def run(module, x, grad_out):
    """Output and the gradients of x and of every parameter (by name) for the cotangent `grad_out`."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def reference(moe: RoutedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64, from lazoo's weights (with the ELA bias b_e = W_r[e])."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ moe.router.weight.T, -1)
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        top = probs[n].argsort(descending=True)[:moe.top_k]
        s = probs[n, top]
        if moe.norm_top_k or (moe.norm_top_k is None and moe.top_k > 1):
            s = s / s.sum()
        for e, score in zip(top.tolist(), s):
            gate_up = moe.experts.gate_up_proj[e] @ flat[n]
            f = moe.experts.down_proj[e] @ (F.silu(gate_up[:WIDTH]) * gate_up[WIDTH:])
            b = moe.router.weight[e]
            out[n] += {None: score * f, "eq14": score * f + b, "eq15": score * (f + b)}[moe.bias]
        if moe.shared_expert is not None:
            out[n] += torch.sigmoid(moe.shared_expert_gate.weight[0] @ flat[n]) * moe.shared_expert(flat[n])
    return out.view_as(x)


QWEN_CASES = [("qwen3_next", k, norm) for k in (2, 1) for norm in (True, False)] + \
             [("qwen3_5_moe", k, True) for k in (2, 1)]


@pytest.mark.parametrize("kind, top_k, norm", QWEN_CASES)
def test_matches_transformers_qwen_block(kind, top_k, norm):
    """Outputs and all gradients: to float32 precision against transformers as it is (its router's softmax runs in
    float32), to 1e-10 against transformers with a float64 softmax, and lazoo to 1e-10 against a token-by-token
    float64 reference."""
    block = qwen_block(kind, top_k, norm)
    moe = lazoo_copy(block, top_k, norm)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, HIDDEN, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(3, 7, HIDDEN, generator=gen, dtype=torch.float64)
    ours = run(moe, x, grad_out)

    with torch.no_grad():
        assert rel_err(moe(x), reference(moe, x)) < 1e-10

    theirs = run(block, x, grad_out)
    assert rel_err(ours[0], theirs[0]) < 1e-5, "output vs transformers (float32 router)"
    assert rel_err(ours[1], theirs[1]) < 1e-5, "d x vs transformers (float32 router)"
    for name, grad in ours[2].items():
        assert rel_err(grad, theirs[2][QWEN_NAMES[name]], 0.1) < 1e-5, f"d {name} vs transformers (float32 router)"

    block.gate.forward = float64_router.__get__(block.gate)
    theirs = run(block, x, grad_out)
    assert rel_err(ours[0], theirs[0]) < 1e-10, "output vs transformers (float64 router)"
    assert rel_err(ours[1], theirs[1]) < 1e-10, "d x vs transformers (float64 router)"
    for name, grad in ours[2].items():
        assert rel_err(grad, theirs[2][QWEN_NAMES[name]], 0.1) < 1e-10, f"d {name} vs transformers (float64 router)"
    if top_k == 1 and norm:  # the one score is 1 whatever the router says: no gradient reaches it
        assert ours[2]["router.weight"].abs().max() < 1e-12


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_norm_top_k_none_keeps_the_original_rule(top_k):
    """None renormalises exactly when k > 1 (what lazoo always did); True and False are Qwen's norm_topk_prob."""
    torch.manual_seed(0)
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, top_k, bias="eq15").double()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    flat = x.reshape(-1, HIDDEN)
    with torch.no_grad():
        default = moe(x)
        moe.norm_top_k = top_k > 1
        assert torch.equal(moe(x), default)
        moe.norm_top_k = not moe.norm_top_k
        assert not torch.allclose(moe(x), default)
        for norm in (True, False):
            moe.norm_top_k = norm
            _, top_p, _ = moe.route(flat)
            assert torch.allclose(top_p.sum(-1), torch.ones(len(flat), dtype=torch.float64), atol=1e-14) == norm


# ----------------------------------------------------------------------------- expert backends
@pytest.mark.skipif(not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"), reason="no grouped_mm")
@pytest.mark.parametrize("bias", [None, "eq14", "eq15"])
def test_grouped_path_equals_the_loop_on_cpu(bias):
    """The grouped-GEMM path (forced; float32, which torch's CPU grouped_mm takes) against the loop and a float64
    reference: outputs and gradients. On the CPU the auto choice is the loop."""
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, 3, bias=bias, shared_intermediate_size=SHARED)
    x = torch.randn(4, 9, HIDDEN)
    grad_out = torch.randn(4, 9, HIDDEN)
    loop = run(moe, x, grad_out)
    moe.expert_backend = "grouped"
    grouped = run(moe, x, grad_out)
    with torch.no_grad():
        assert rel_err(grouped[0], reference(moe.double(), x.double())) < 1e-5
    assert rel_err(grouped[0], loop[0]) < 1e-5
    assert rel_err(grouped[1], loop[1]) < 1e-5
    for name, grad in loop[2].items():
        assert rel_err(grouped[2][name], grad) < 1e-5, name


def test_bad_backend_is_refused():
    moe = RoutedMoE(HIDDEN, WIDTH, EXPERTS, 2).double()
    with pytest.raises(ValueError, match="backend must be one of"):
        RoutedMoE(HIDDEN, WIDTH, EXPERTS, 2, backend="fast")
    moe.expert_backend = "grouped"
    with pytest.raises(ValueError, match="grouped.*float64|use backend 'loop'"):
        moe(torch.randn(2, 3, HIDDEN, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bias, shared", [(None, 64), ("eq14", None)])
def test_grouped_path_equals_the_loop_in_bf16_on_cuda(bias, shared):
    """bf16 on CUDA: the auto choice (grouped GEMMs where the device has them, as on an H100/H200) against the sorted
    per-expert loop, the whole block (same routing: outputs and all gradients), and the experts alone on fixed
    routing against a float32 computation of the same bf16 weights (bf16 routing would pick other experts on near
    ties, so the whole block is not compared with float32)."""
    torch.manual_seed(0)
    H, I, E, k = 256, 128, 16, 4
    moe = RoutedMoE(H, I, E, k, bias=bias, shared_intermediate_size=shared).cuda().to(torch.bfloat16)
    if torch.cuda.get_device_capability()[0] == 9:
        assert grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    x = torch.randn(4, 300, H, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    auto = run(moe, x, grad_out)
    moe.expert_backend = "loop"
    loop = run(moe, x, grad_out)
    for what, a, b in [("output", auto[0], loop[0]), ("d x", auto[1], loop[1])] + \
            [(f"d {n}", auto[2][n], loop[2][n]) for n in loop[2]]:
        assert rel_err(a, b) < 3e-2, f"{what}: grouped vs loop"

    flat = x.reshape(-1, H)
    with torch.no_grad():
        _, top_p, top_idx = moe.route(flat)
    top_w = top_p.to(flat.dtype)
    results = {}
    for name, dtype, backend in [("auto", torch.bfloat16, None), ("loop", torch.bfloat16, "loop"),
                                 ("float32", torch.float32, "loop")]:
        experts = moe.experts.to(dtype)
        rows = flat.detach().to(dtype).requires_grad_(True)
        experts.zero_grad()
        out = experts(rows, top_idx, top_w.to(dtype), backend=backend)
        out.backward(grad_out.reshape(-1, H).to(dtype))
        results[name] = [out.detach(), rows.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for what, a, b, c in zip(("output", "d x", "d gate_up_proj", "d down_proj"), *results.values()):
        assert rel_err(a, c) < 2 * rel_err(b, c) + 5e-3, f"experts {what}: grouped further from float32 than the loop"
        assert rel_err(a, c) < 2e-2, f"experts {what}: grouped vs float32"


# ----------------------------------------------------------------------------- config and model
@pytest.mark.parametrize("field, value, message", [
    ("moe_shared_expert_intermediate_size", -1, "moe_shared_expert_intermediate_size must be an int >= 0"),
    ("moe_shared_expert_intermediate_size", 2.5, "moe_shared_expert_intermediate_size must be"),
    ("moe_shared_expert_intermediate_size", True, "moe_shared_expert_intermediate_size must be"),
    ("moe_norm_top_k", 1, "moe_norm_top_k must be None"),
    ("moe_norm_top_k", "yes", "moe_norm_top_k must be None"),
    ("moe_layers", 1, "moe_layers must be None"),
    ("moe_layers", [0, 4], r"moe_layers entries must be layer indices in \[0, num_hidden_layers=4\)"),
    ("moe_layers", [-1], "moe_layers entries must be layer indices"),
    ("moe_layers", [True], "moe_layers entries must be layer indices"),
    ("moe_layers", [1, 1], "moe_layers lists a layer twice"),
])
def test_bad_moe_options_raise_clear_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("softmax", num_hidden_layers=4, moe_num_experts=4, **{field: value})


def test_defaults_are_the_original_moe():
    config = tiny_config("softmax", moe_num_experts=4)
    assert (config.moe_norm_top_k, config.moe_shared_expert_intermediate_size, config.moe_layers) == (None, None, None)
    model = tiny_model("softmax", moe_num_experts=4)
    for layer in model.model.layers:
        assert isinstance(layer.mlp, RoutedMoE) and layer.mlp.shared_expert is None and layer.mlp.norm_top_k is None


@pytest.mark.parametrize("step, mlp_only", [(1, []), (2, []), (1, [0, 3]), (2, [3]), (3, [2])])
def test_moe_layers_follow_qwen3_next(step, mlp_only, tmp_path):
    """`moe_layers_from_sparse_step` picks the layers Qwen3NextDecoderLayer makes MoE; a lazoo model puts a routed
    MoE (with the shared expert) exactly there and the dense MLP of intermediate_size elsewhere; the aux loss is the
    mean over the MoE layers; the config round-trips through save/load."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextSparseMoeBlock

    L = 6
    qwen = Qwen3NextConfig(hidden_size=32, num_hidden_layers=L, num_experts=4, num_experts_per_tok=2,
                           decoder_sparse_step=step, mlp_only_layers=mlp_only, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                           linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=40,
                           moe_intermediate_size=16, shared_expert_intermediate_size=24)
    expected = [i for i in range(L) if isinstance(Qwen3NextDecoderLayer(qwen, i).mlp, Qwen3NextSparseMoeBlock)]
    moe_layers = moe_layers_from_sparse_step(L, step, mlp_only, qwen.num_experts)
    assert (list(range(L)) if moe_layers is None else moe_layers) == expected
    assert moe_layers_from_sparse_step(L, step, mlp_only, num_experts=0) == []

    model = tiny_model("softmax", num_hidden_layers=L, moe_num_experts=4, moe_top_k=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=24, moe_layers=moe_layers, moe_bias=None,
                       moe_norm_top_k=True)
    for i, layer in enumerate(model.model.layers):
        if i in expected:
            assert isinstance(layer.mlp, RoutedMoE) and layer.mlp.norm_top_k is True
            assert layer.mlp.shared_expert.up_proj.weight.shape == (24, 32)
            assert layer.mlp.experts.gate_up_proj.shape == (4, 32, 32)
        else:
            assert type(layer.mlp) is GatedMLP and layer.mlp.up_proj.weight.shape == (64, 32)
    ids = random_ids(2, 9, seed=0)
    out = model(ids, labels=ids)
    with torch.no_grad():
        losses = [layer.aux_loss for layer in model.model.layers if layer.aux_loss is not None]
    assert len(losses) == len(expected)
    assert torch.allclose(out.aux_loss, torch.stack(losses).mean())

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["moe_layers"] == moe_layers and saved["moe_shared_expert_intermediate_size"] == 24
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.moe_layers == moe_layers and loaded.config.moe_norm_top_k is True
    with torch.no_grad():
        # equal to float32 rounding (a BLAS may round other allocations of the same weights differently)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-7)


def test_pads_change_no_real_token_and_stay_out_of_the_aux_loss():
    """With shared experts and dense layers between MoE layers: whatever the pads hold, the real tokens' logits and the
    aux loss are the same bits; a left-padded sample gives its logits and aux loss alone."""
    model = tiny_model("softmax", num_hidden_layers=3, moe_num_experts=4, moe_top_k=2, moe_layers=[0, 2],
                       moe_shared_expert_intermediate_size=16)
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 9, 32, generator=gen)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        first = model(inputs_embeds=embeds, attention_mask=mask)
        other = embeds.clone()
        other[:, :3] = 100 * torch.randn(1, 3, 32, generator=gen)
        second = model(inputs_embeds=other, attention_mask=mask)
        alone = model(inputs_embeds=embeds[:, 3:])
    assert torch.equal(first.logits[:, 3:], second.logits[:, 3:]) and torch.equal(first.aux_loss, second.aux_loss)
    assert rel_err(first.logits[:, 3:], alone.logits) < 1e-5
    assert abs(first.aux_loss.item() - alone.aux_loss.item()) < 1e-6


# ----------------------------------------------------------------------------- folders of the first layout
@pytest.mark.parametrize("name", ["softmax_moe_top2_eq15", "ela_gpt_moe_top1"])
def test_a_folder_with_one_module_per_expert_loads(name, tmp_path):
    """Saved by the code of commit 4f192d1 (`mlp.experts.{e}.gate_proj.weight` ...): loads with no missing or
    unexpected weight and gives the logits it gave then; saved again, it holds the stacked experts and loads back."""
    expected = torch.load(FIXTURES / "expected_logits.pt")
    with safe_open(FIXTURES / name / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in f.keys()
    model, info = AutoModelForCausalLM.from_pretrained(FIXTURES / name, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.name_or_path == str(FIXTURES / name)
    with torch.no_grad():
        logits = model.eval()(expected["input_ids"]).logits
    assert rel_err(logits, expected["logits"][name]) < 1e-5

    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(expected["input_ids"]).logits, logits)


def test_load_state_dict_stacks_the_first_layout():
    """`load_state_dict` (Trainer's resume) of a state dict with one module per expert."""
    name = "softmax_moe_top2_eq15"
    with safe_open(FIXTURES / name / "model.safetensors", framework="pt") as f:
        legacy = {k: f.get_tensor(k) for k in f.keys()}
    stacked = stack_legacy_experts(legacy)
    gate = torch.cat([legacy["model.layers.1.mlp.experts.2.gate_proj.weight"],
                      legacy["model.layers.1.mlp.experts.2.up_proj.weight"]])
    assert torch.equal(stacked["model.layers.1.mlp.experts.gate_up_proj"][2], gate)
    assert stacked["model.layers.1.mlp.experts.down_proj"].shape == (3, 16, 24)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name).eval()
    fresh = AutoModelForCausalLM.from_config(model.config).eval()
    result = fresh.load_state_dict(legacy, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    ids = random_ids(1, 8, seed=0)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert torch.equal(model.model.layers[0].mlp.experts[1](torch.ones(2, 16)),
                       model.model.layers[0].mlp.experts.expert_forward(1, torch.ones(2, 16)))


def test_lora_reaches_the_stacked_experts():
    """PEFT: `target_parameters` adapts the stacked experts (in the loop and the grouped path), `target_modules` the
    shared expert and router."""
    peft = pytest.importorskip("peft")
    model = tiny_model("softmax", moe_num_experts=4, moe_top_k=2, moe_shared_expert_intermediate_size=8,
                       moe_bias=None)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["shared_expert.down_proj", "router"],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(model, config)
    ids = random_ids(2, 7, seed=1)
    with torch.no_grad():
        before = model(ids).logits
        bs = {n: p for n, p in model.named_parameters() if "lora_B" in n}
        kinds = {n.split(".mlp.")[1].split(".lora_B")[0] for n in bs}
        assert kinds == {"experts", "experts.base_layer", "shared_expert.down_proj", "router"}, kinds
        for p in bs.values():
            p.normal_(0, 0.5)
        changed = model(ids).logits
        assert (changed - before).abs().max() > 1e-3
        if hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm"):
            for layer in model.base_model.model.model.layers:
                layer.mlp.expert_backend = "grouped"
            assert rel_err(model(ids).logits, changed) < 1e-5
