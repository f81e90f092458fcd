"""ELA-GPT decoder options (§V of Ou 2026, "Exact Linear Attention"): Hyper-Link, the Memory Lobe (causal and
bidirectional, and the future-token leak of the bidirectional one in a causal LM), the routed MoE with
routing-score bias (eqs 14/15) and its load-balancing loss; on any mechanism (CPU, tiny models, float64
references)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from lazoo.layers.memory_lobe import MemoryLobe
from lazoo.layers.moe import RoutedMoE, load_balancing_loss
from lazoo.models.cache import LazooCache
from lazoo.ops.bidirectional import bidirectional_linear_attention

pytestmark = pytest.mark.usefixtures("single_thread")

ELA_GPT = dict(hyper_link=True, memory_lobe="causal", moe_num_experts=4, moe_top_k=2, moe_bias="eq14")


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("field, value, message", [
    ("memory_lobe", "future", "memory_lobe must be one of"),
    ("hyper_link_ffn_input", "norm", "hyper_link_ffn_input must be one of"),
    ("memory_lobe_feature_map", "identity", "positive feature map"),
    ("moe_num_experts", -1, "moe_num_experts must be an int >= 0"),
    ("moe_top_k", 5, r"moe_top_k must be an int in \[1, moe_num_experts=4\]"),
    ("moe_top_k", 0, "moe_top_k must be"),
    ("moe_bias", "eq16", "moe_bias must be one of"),
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be a number >= 0"),
    ("moe_intermediate_size", 0, "moe_intermediate_size must be a positive int"),
])
def test_bad_options_raise_clear_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("ela", **{**ELA_GPT, field: value})


def test_defaults_leave_the_decoder_unchanged():
    cfg = tiny_config("linear")
    assert (cfg.hyper_link, cfg.memory_lobe, cfg.moe_num_experts) == (False, None, 0)
    layer = tiny_model("linear").model.layers[0]
    assert layer.memory_lobe is None and hasattr(layer, "post_mixer_norm")
    assert not isinstance(layer.mlp, RoutedMoE)
    out = tiny_model("linear")(random_ids(1, 5, seed=0))
    assert out.aux_loss is None


# ----------------------------------------------------------------------------- the layer's formula
@pytest.mark.parametrize("hyper_link", [False, True])
@pytest.mark.parametrize("lobe", [None, "causal", "bidirectional"])
@pytest.mark.parametrize("experts", [0, 3])
def test_decoder_layer_formula(hyper_link, lobe, experts):
    model = tiny_model("softmax", hyper_link=hyper_link, memory_lobe=lobe, moe_num_experts=experts,
                       moe_top_k=min(2, max(experts, 1)))
    layer = model.model.layers[0]
    assert (layer.post_mixer_norm is None) == hyper_link  # Hyper-Link drops the mixer residual and its norm
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = layer(x, position_ids=torch.arange(7).expand(2, 7))
        mixed = layer.mixer(layer.input_norm(x), position_ids=torch.arange(7).expand(2, 7))
        if hyper_link:
            flow = layer.mlp(mixed)
        else:
            flow = mixed + layer.mlp(layer.post_mixer_norm(x + mixed))
        expected = x + flow + (layer.memory_lobe(flow) if lobe else 0)
    assert out.shape == (2, 7, 32)
    assert_close(out, expected, 1e-5, "decoder layer output")


@pytest.mark.parametrize("lobe", [None, "causal"])
@pytest.mark.parametrize("experts", [0, 3])
def test_hyper_link_reading_the_stream(lobe, experts):
    """`hyper_link_ffn_input="stream"`: out = x + f (+ lobe(f)), f = mlp(norm2(x + mixer(norm(x)))); still no mixer
    residual. It needs hyper_link=True, and a config saved without the field keeps the paper's reading."""
    model = tiny_model("softmax", hyper_link=True, hyper_link_ffn_input="stream", memory_lobe=lobe,
                       moe_num_experts=experts, moe_top_k=min(2, max(experts, 1)))
    layer = model.model.layers[0]
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = layer(x, position_ids=torch.arange(7).expand(2, 7))
        mixed = layer.mixer(layer.input_norm(x), position_ids=torch.arange(7).expand(2, 7))
        flow = layer.mlp(layer.post_mixer_norm(x + mixed))
        expected = x + flow + (layer.memory_lobe(flow) if lobe else 0)
    assert_close(out, expected, 1e-5, "decoder layer output")
    with pytest.raises(ValueError, match="needs hyper_link=True"):
        tiny_config("softmax", hyper_link_ffn_input="stream")
    saved = tiny_config("softmax", hyper_link=True).to_dict()
    del saved["hyper_link_ffn_input"]
    assert type(tiny_config("softmax")).from_dict(saved).hyper_link_ffn_input == "mixer"


# ----------------------------------------------------------------------------- Memory Lobe vs float64 quadratic
def quadratic_linear_attention(q, k, v, causal: bool, mask=None):
    """`Σ_s φ(q_t)·φ(k_s) v_s / Σ_s φ(q_t)·φ(k_s)` over s <= t (or all s), pads excluded, in float64."""
    fq, fk, v = F.elu(q.double()) + 1, F.elu(k.double()) + 1, v.double()
    scores = torch.einsum("bthd,bshd->bhts", fq, fk)
    T = q.shape[1]
    keep = torch.ones(T, T, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    keep = keep[None, None].expand_as(scores).clone()
    if mask is not None:
        keep &= mask.bool()[:, None, None, :]
    scores = scores * keep
    o = torch.einsum("bhts,bshd->bthd", scores, v) / scores.sum(-1).transpose(1, 2)[..., None].clamp_min(1e-6)
    if mask is not None:
        o = o * mask[:, :, None, None]
    return o


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_memory_lobe_matches_the_quadratic_form(mode):
    torch.manual_seed(0)
    lobe = MemoryLobe(16, 2, 0, mode=mode)
    flow = torch.randn(2, 13, 16)
    mask = torch.ones(2, 13)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        out = lobe(flow, mask=mask.bool())
        q, k, v = (p(flow).view(2, 13, 2, 8) for p in (lobe.q_proj, lobe.k_proj, lobe.v_proj))
    expected = quadratic_linear_attention(q, k, v, causal=mode == "causal", mask=mask).reshape(2, 13, 16)
    assert_close(out, expected, 1e-5, f"{mode} lobe")
    o64, _ = bidirectional_linear_attention(q.double(), k.double(), v.double(), mask=mask.bool())
    assert_close(o64, quadratic_linear_attention(q, k, v, causal=False, mask=mask), 1e-12, "float64 bidirectional")


def test_causal_lobe_state_is_cached_per_layer():
    torch.manual_seed(0)
    lobe = MemoryLobe(16, 2, 1, mode="causal")
    flow = torch.randn(1, 9, 16)
    cache = LazooCache(2)
    with torch.no_grad():
        full = lobe(flow)
        first = lobe(flow[:, :5], cache=cache)
        assert cache.lobe_states[0] is None and set(cache.lobe_states[1]) == {"S", "z"}
        rest = [lobe(flow[:, t:t + 1], cache=cache) for t in range(5, 9)]
    assert_close(torch.cat([first, *rest], 1), full, 1e-5, "lobe step by step with its cached state")


def test_beam_reorder_moves_the_lobe_state():
    cache = LazooCache(1)
    cache.lobe_states[0] = {"S": torch.arange(3.0)[:, None, None, None].expand(3, 2, 4, 4).clone(),
                            "z": torch.arange(3.0)[:, None, None].expand(3, 2, 4).clone()}
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.lobe_states[0]["S"][:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert cache.lobe_states[0]["z"][:, 0, 0].tolist() == [2.0, 2.0, 0.0]
    cache.reset()
    assert cache.lobe_states == [None]


# ----------------------------------------------------------------------------- MoE vs a dense float64 reference
@pytest.mark.parametrize("bias", [None, "eq14", "eq15"])
def test_moe_matches_a_dense_reference(bias):
    torch.manual_seed(0)
    moe = RoutedMoE(8, 12, num_experts=4, top_k=2, bias=bias).double()
    with torch.no_grad():
        moe.router.weight.mul_(20)  # a bias large enough to matter
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    out = moe(x)
    flat = x.reshape(-1, 8)
    probs = torch.softmax(flat @ moe.router.weight.T, -1)
    expected = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        top = probs[n].argsort(descending=True)[:2]
        s = probs[n, top] / probs[n, top].sum()
        for e, score in zip(top.tolist(), s):
            f = moe.experts[e](flat[n:n + 1])[0]
            b = moe.router.weight[e]
            expected[n] += {None: score * f, "eq14": score * f + b, "eq15": score * (f + b)}[bias]
    assert_close(out, expected.view_as(out), 1e-10, f"MoE ({bias})")


def test_eq14_and_eq15_differ_by_the_unscaled_bias():
    torch.manual_seed(0)
    moe = RoutedMoE(8, 12, num_experts=4, top_k=2, bias="eq14").double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    y14 = moe(x)
    moe.bias = "eq15"
    y15 = moe(x)
    flat = x.reshape(-1, 8)
    probs = torch.softmax(flat @ moe.router.weight.T, -1)
    top_p, top_i = probs.topk(2, -1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    diff = ((1 - top_p)[..., None] * moe.router.weight[top_i]).sum(1)  # Σ (1 − s_e) b_e
    assert_close((y14 - y15).reshape(-1, 8), diff, 1e-12, "eq14 − eq15")


def test_load_balancing_loss():
    E, N = 4, 8
    balanced = torch.full((N, E), 1 / E, dtype=torch.float64)
    idx = torch.arange(N)[:, None] % E
    assert abs(load_balancing_loss(balanced, idx, E).item() - 1.0) < 1e-12
    collapsed = torch.zeros(N, E, dtype=torch.float64)
    collapsed[:, 0] = 1
    assert abs(load_balancing_loss(collapsed, torch.zeros(N, 1, dtype=torch.long), E).item() - E) < 1e-12
    mask = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])
    half = torch.cat([balanced[:4], collapsed[4:]])
    idx2 = torch.cat([idx[:4], torch.zeros(4, 1, dtype=torch.long)])
    assert abs(load_balancing_loss(half, idx2, E, mask).item() - 1.0) < 1e-12  # pads left out


# ----------------------------------------------------------------------------- model outputs and loss
@pytest.mark.parametrize("name", ["ela", "softmax", "gated_delta_net"])
def test_aux_loss_is_in_the_output_and_in_the_loss(name):
    model = tiny_model(name, **ELA_GPT, router_aux_loss_coef=0.5)
    ids = random_ids(2, 12, seed=3)
    out = model(ids, labels=ids, use_cache=False)
    assert out.aux_loss is not None and out.aux_loss.ndim == 0 and out.aux_loss.item() >= 1.0 - 1e-6
    per_layer = torch.stack([layer.mlp.aux_loss for layer in model.model.layers]).mean()
    assert torch.allclose(out.aux_loss, per_layer)
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert_close(out.loss, lm + 0.5 * out.aux_loss, 1e-5, "loss = lm + coef · aux")
    out.loss.backward()
    router = model.model.layers[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_aux_loss_under_gradient_checkpointing():
    model = tiny_model("ela", eval=False, **ELA_GPT)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = random_ids(2, 10, seed=4)
    out = model(ids, labels=ids)
    assert out.aux_loss.requires_grad
    out.aux_loss.backward()
    assert model.model.layers[1].mlp.router.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- the leak
@pytest.mark.parametrize("name", ["ela", "softmax"])
def test_bidirectional_lobe_leaks_future_tokens_and_the_causal_one_does_not(name):
    ids = random_ids(1, 12, seed=5)
    changed = ids.clone()
    t = 6
    changed[0, t + 1] = (ids[0, t + 1] % 100) + 1  # another token at t + 1
    for lobe, leaks in (("bidirectional", True), ("causal", False)):
        model = tiny_model(name, **{**ELA_GPT, "memory_lobe": lobe})
        with torch.no_grad():
            a = model(ids, use_cache=False).logits
            b = model(changed, use_cache=False).logits
        diff = (a[0, :t + 1] - b[0, :t + 1]).abs().amax(-1)  # positions 0..t, which must not see t + 1
        # the causal side only differs by float rounding (other matmul shapes), the leak by far more
        if leaks:
            assert diff.min() > 1e-3, f"{lobe}: output at positions <= t should change with token t+1: {diff}"
        else:
            assert diff.max() < 1e-5, f"{lobe}: output at positions <= t changed with token t+1: {diff}"


def test_bidirectional_lobe_refuses_a_cached_continuation():
    model = tiny_model("ela", **{**ELA_GPT, "memory_lobe": "bidirectional"})
    with pytest.raises(ValueError, match="bidirectional.*cannot continue a cached sequence"):
        model.generate(random_ids(1, 5, seed=0), max_new_tokens=3, do_sample=False)


# ----------------------------------------------------------------------------- generation, padding, packing
@pytest.mark.parametrize("name", ["ela", "softmax", "gated_delta_net"])
def test_generate_with_cache_equals_without(name):
    model = tiny_model(name, **ELA_GPT)
    prompt = random_ids(2, 6, seed=7)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        full = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
        assert torch.equal(cached, full)
        # logits of the cached path, token by token, against one full forward
        cache = LazooCache(model.config.num_hidden_layers)
        steps = [model(cached[:, :6], past_key_values=cache, use_cache=True).logits]
        steps += [model(cached[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(6, 12)]
        assert_close(torch.cat(steps, 1), model(cached, use_cache=False).logits, 1e-4, "cached vs full logits")


def test_left_padding_and_packing_keep_samples_apart():
    model = tiny_model("ela", **ELA_GPT)
    a, b = random_ids(1, 9, seed=8), random_ids(1, 5, seed=9)
    with torch.no_grad():
        alone = [model(s, use_cache=False).logits[0] for s in (a, b)]
        padded = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
        mask = (torch.arange(9) >= torch.tensor([[0], [4]])).long()
        out = model(padded, attention_mask=mask, use_cache=False).logits
        packed = model(torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(9), torch.arange(5)])[None],
                       use_cache=False).logits[0]
    assert_close(out[0], alone[0], 1e-5, "unpadded sample")
    assert_close(out[1, 4:], alone[1], 1e-5, "left-padded sample")
    assert_close(packed, torch.cat(alone), 1e-5, "packed samples")


# ----------------------------------------------------------------------------- training and saving
def test_ela_gpt_trains_with_trainer_and_round_trips(tokenizer, lm_blocks, tmp_path):
    model = tiny_model("ela", perturb=False, eval=False, vocab_size=len(tokenizer),
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **ELA_GPT)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=20, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    trainer = Trainer(model=model, args=args, train_dataset=lm_blocks.select(range(160)))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    assert last < first - 0.5, f"training loss {first:.3f} -> {last:.3f}: did not fall"

    folder = tmp_path / "saved"
    model.eval().save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    for key, value in ELA_GPT.items():
        assert getattr(loaded.config, key) == value, key
    ids = torch.tensor(lm_blocks[200:202]["input_ids"])
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    exported = {p.name for p in folder.iterdir()}
    assert {"lazoo_layers_moe.py", "lazoo_layers_memory_lobe.py"} <= exported, sorted(exported)


@pytest.mark.slow  # a fresh interpreter (~20 s on a shared CPU); test_export covers the mechanism in general
def test_trust_remote_code_copy_loads_without_lazoo(tmp_path):
    model = tiny_model("ela", **ELA_GPT)
    model.save_pretrained(tmp_path)
    ids = random_ids(1, 8, seed=11)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits[0, -1]
    script = textwrap.dedent('''
        import importlib.abc, json, sys
        class HideLazoo(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "lazoo" or name.startswith("lazoo."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, HideLazoo())
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        with torch.no_grad():
            print(json.dumps(model(torch.tensor(json.loads(sys.argv[2])), use_cache=False).logits[0, -1].tolist()))
    ''')
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), json.dumps(ids.tolist())],
                         capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                                              "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    assert_close(got, expected, 1e-5, "trust_remote_code logits")
