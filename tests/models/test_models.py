"""Model-level tests: every mechanism, and a hybrid, through the transformers API (CPU, fp32, tiny).

Each test compares against an independent computation: a manual cross-entropy, a full forward pass
without cache, each sample run alone, a reloaded copy, a second attention implementation, float64.
`pytest -m slow` adds 128-token generations, wider beams and `torch.compile`.
"""

from __future__ import annotations

import copy
import io
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_MODELS, ATTENTION, MECHANISMS, VOCAB, random_ids, tiny_config, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, TextStreamer, pipeline

import lazoo
from lazoo.layers.mixers import MIXERS
from lazoo.layers.mixers.attention import AttentionMixer
from lazoo.models import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0  # pad id used in generate; padded positions themselves hold random "garbage" ids


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


# one shared, read-only (eval, no grad) model per mechanism; tests that change weights build their own
_MODELS: dict[str, torch.nn.Module] = {}


def shared_model(name):
    if name not in _MODELS:
        _MODELS[name] = tiny_model(name)
    return _MODELS[name]


def left_padded(prompts, seed):
    """Left-pad 1-D id tensors to one batch; pads hold random ids (the mask alone must hide them)."""
    T = max(len(p) for p in prompts)
    ids = random_ids(len(prompts), T, seed=seed)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = p
        mask[b, T - len(p):] = 1
    return ids, mask


def right_padded(prompts, seed):
    T = max(len(p) for p in prompts)
    ids = random_ids(len(prompts), T, seed=seed)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
        mask[b, : len(p)] = 1
    return ids, mask


def greedy(model, input_ids, max_new_tokens, **kwargs):
    return model.generate(
        input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD,
        return_dict_in_generate=True, output_logits=True, **kwargs,
    )


def assert_same_generation(a, b, prompt_len, atol=1e-4):
    """Same greedy tokens; step logits close up to (and at) the first step where the tokens differ."""
    steps = a.sequences.shape[1] - prompt_len
    differ = (a.sequences[:, prompt_len:] != b.sequences[:, prompt_len:]).any(0).nonzero()
    upto = int(differ[0]) + 1 if len(differ) else steps
    for s in range(upto):
        assert_close(a.logits[s], b.logits[s], atol, f"step {s} logits")
    assert torch.equal(a.sequences, b.sequences), f"tokens differ from step {upto - 1} on (a near tie?)"


def cache_tensors(cache: LazooCache):
    """(name, tensor) for every tensor in the cache, in a fixed order."""
    out = []

    def walk(prefix, x):
        if isinstance(x, torch.Tensor):
            out.append((prefix, x))
        elif isinstance(x, dict):
            for k in sorted(x):
                walk(f"{prefix}.{k}", x[k])

    for i, state in enumerate(cache.states):
        walk(f"layer{i}", state)
    return out


# ----------------------------------------------------------------------------- 1. acceptance
@pytest.mark.parametrize("name", ALL_MODELS)
def test_auto_classes_forward_loss_and_grads(name):
    config = tiny_config(name)
    assert type(config) is lazoo.MODEL_CLASSES[f"lazoo_{name}"][0]
    assert config.model_type == f"lazoo_{name}"
    expected_layers = ["sliding_window", "vla"] if name == "hybrid" else [name, name]
    assert config.layer_types == expected_layers
    model = tiny_model(name, eval=False)
    assert type(model) is lazoo.MODEL_CLASSES[f"lazoo_{name}"][2]
    assert [type(layer.mixer) for layer in model.model.layers] == [MIXERS[n] for n in expected_layers]

    ids = random_ids(2, 20, seed=1)
    out = model(ids, labels=ids)
    manual = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert out.logits.shape == (2, 20, VOCAB)
    assert torch.isfinite(out.loss)
    assert_close(out.loss, manual, 1e-5, "loss vs manual cross-entropy")
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname}: non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{pname}: gradient is all zero"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_save_load_round_trip(name, tmp_path):
    model = shared_model(name)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "pytorch_model.bin").exists()

    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is type(model.config)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(loaded) is type(model)
    drop = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}
    saved = {k: v for k, v in model.config.to_dict().items() if k not in drop}
    reloaded = {k: v for k, v in loaded.config.to_dict().items() if k not in drop}
    assert reloaded == saved
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(), "tie lost"

    ref_state = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, ref_state[key]), f"{key} differs after loading"
    ids = random_ids(2, 15, seed=2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        base = AutoModel.from_pretrained(tmp_path)  # the base model from the causal-LM checkpoint
        assert type(base) is lazoo.MODEL_CLASSES[f"lazoo_{name}"][1]
        assert torch.equal(base(ids).last_hidden_state, model.model(ids).last_hidden_state)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_generate_with_cache_equals_without(name):
    model = shared_model(name)
    ids = random_ids(2, 7, seed=3)
    cached = greedy(model, ids, 32, use_cache=True)
    full = greedy(model, ids, 32, use_cache=False)
    assert cached.sequences.shape == (2, 7 + 32)
    assert torch.equal(cached.sequences[:, :7], ids)
    assert isinstance(cached.past_key_values, LazooCache)
    assert_same_generation(cached, full, prompt_len=7)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_left_padded_batch_generation_equals_each_sample(name):
    model = shared_model(name)
    prompts = [random_ids(n, seed=10 + n) for n in (9, 4, 6)]
    ids, mask = left_padded(prompts, seed=4)
    batched = greedy(model, ids, 16, attention_mask=mask)
    T = ids.shape[1]
    for b, prompt in enumerate(prompts):
        alone = greedy(model, prompt[None], 16)
        assert torch.equal(batched.sequences[b, T:], alone.sequences[0, len(prompt):]), f"sample {b}"
        step_logits = torch.stack([s[b] for s in batched.logits])
        assert_close(step_logits, torch.stack(alone.logits)[:, 0], 1e-4, f"sample {b} logits")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_sampling_of_a_left_padded_batch_with_cache_equals_without(name):
    model = shared_model(name)
    ids, mask = left_padded([random_ids(n, seed=30 + n) for n in (7, 3)], seed=6)
    kwargs = dict(do_sample=True, top_k=20, temperature=1.5, max_new_tokens=12, pad_token_id=PAD,
                  attention_mask=mask)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(11)  # the same draws: the same tokens if and only if the distributions agree
        runs.append(model.generate(ids, use_cache=use_cache, **kwargs))
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(12)
    assert not torch.equal(model.generate(ids, **kwargs), runs[0]), "another seed should sample other tokens"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_beam_search_with_cache_equals_without(name):
    model = shared_model(name)
    ids, mask = left_padded([random_ids(n, seed=20 + n) for n in (6, 4)], seed=5)
    kwargs = dict(num_beams=3, max_new_tokens=10, do_sample=False, pad_token_id=PAD, attention_mask=mask,
                  return_dict_in_generate=True, output_scores=True)
    cached = model.generate(ids, use_cache=True, **kwargs)
    full = model.generate(ids, use_cache=False, **kwargs)
    assert cached.sequences.shape == (2, ids.shape[1] + 10)
    assert torch.equal(cached.sequences, full.sequences)
    assert_close(cached.sequences_scores, full.sequences_scores, 1e-4, "beam scores")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_generate_continues_from_a_cache_and_from_embeddings(name):
    model = shared_model(name)
    ids = random_ids(2, 12, seed=23)
    ref = greedy(model, ids, 10)
    with torch.no_grad():  # a cache prefilled by a forward pass over the first 8 tokens
        cache = model(ids[:, :8], use_cache=True).past_key_values
    assert_same_generation(greedy(model, ids, 10, past_key_values=cache), ref, prompt_len=12)
    first = greedy(model, ids, 4)  # continue a generation from the cache it returned
    more = greedy(model, first.sequences, 6, past_key_values=first.past_key_values)
    assert torch.equal(more.sequences, ref.sequences)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds, use_cache=False).logits, model(ids, use_cache=False).logits)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    assert torch.equal(from_embeds, ref.sequences[:, 12:])


# ----------------------------------------------------------------------------- 2. cache = recompute
@pytest.mark.parametrize("name", ALL_MODELS)
def test_token_by_token_decoding_equals_full_forward(name):
    """Prefill 70 tokens (more than one 64-token chunk), then decode 10 one at a time."""
    model = shared_model(name)
    ids = random_ids(2, 80, seed=6)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :70], use_cache=True)
        assert_close(out.logits, full[:, :70], 1e-4, "prefill logits")
        cache = out.past_key_values
        assert isinstance(cache, LazooCache)
        for t in range(70, 80):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            assert_close(out.logits[:, 0], full[:, t], 1e-4, f"decode step {t}")
    assert cache.get_seq_length() == 80
    assert cache.real_tokens.tolist() == [80, 80]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_chunked_prefill_equals_one_piece(name):
    model = shared_model(name)
    ids = random_ids(2, 41, seed=7)
    nxt = random_ids(2, 1, seed=8)
    with torch.no_grad():
        one = model(ids, use_cache=True)
        first = model(ids[:, :17], use_cache=True)
        second = model(ids[:, 17:], past_key_values=first.past_key_values, use_cache=True)
        assert_close(torch.cat([first.logits, second.logits], 1), one.logits, 1e-4, "two-piece prefill logits")
        one_state, two_state = cache_tensors(one.past_key_values), cache_tensors(second.past_key_values)
        assert [n for n, _ in one_state] == [n for n, _ in two_state]
        assert one_state, "the cache holds no state"
        for (n, a), (_, b) in zip(two_state, one_state):
            if a.is_floating_point():
                assert_close(a, b, 1e-4 * max(1.0, b.abs().max().item()), f"cache {n}")
            else:
                assert torch.equal(a, b), f"cache {n}"
        a = model(nxt, past_key_values=one.past_key_values).logits
        b = model(nxt, past_key_values=second.past_key_values).logits
        assert_close(b, a, 1e-4, "decode after two-piece prefill")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_chunked_prefill_of_a_left_padded_batch(name):
    """Sample 1's first piece is all padding: its state must stay empty until its real tokens."""
    model = shared_model(name)
    prompts = [random_ids(n, seed=30 + n) for n in (14, 5)]
    ids, mask = left_padded(prompts, seed=9)
    with torch.no_grad():
        first = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        second = model(ids[:, 8:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
        logits = torch.cat([first.logits, second.logits], 1)
        for b, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits[0]
            assert_close(logits[b, -len(p):], alone, 1e-4, f"sample {b}")
        assert second.past_key_values.real_tokens.tolist() == [14, 5]


# ----------------------------------------------------------------------------- 3. padding
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_attention_mask_in_training_forward(name, side):
    model = shared_model(name)
    prompts = [random_ids(n, seed=40 + n) for n in (12, 7, 3)]
    pad = right_padded if side == "right" else left_padded
    ids, mask = pad(prompts, seed=11)
    ids2, _ = pad(prompts, seed=12)  # the same real tokens, other garbage in the pads
    assert not torch.equal(ids, ids2)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        out2 = model(ids2, attention_mask=mask, use_cache=False)
        real = mask.bool()
        assert torch.equal(out.logits[real], out2.logits[real]), "pad contents changed a real token's output"
        losses, count = [], 0
        for b, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits[0]
            assert_close(out.logits[b][real[b]], alone, 1e-5, f"sample {b} ({side} padded)")
            losses.append(F.cross_entropy(alone[:-1], p[1:], reduction="sum"))
            count += len(p) - 1
    if side == "right":  # left padding puts a pad position before each first token (HF's usual shift)
        assert_close(out.loss, sum(losses) / count, 1e-5, "padded loss vs per-sample losses")


# ----------------------------------------------------------------------------- 4. hidden states, attention impls
@pytest.mark.parametrize("name", ALL_MODELS)
def test_output_hidden_states(name):
    model = shared_model(name)
    ids = random_ids(2, 11, seed=13)
    captured = []
    hooks = [layer.register_forward_hook(lambda m, i, o: captured.append(o)) for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = out.hidden_states
    L = model.config.num_hidden_layers
    assert len(hs) == L + 1 and len(captured) == L
    assert torch.equal(hs[0], model.model.embed_tokens(ids))
    for i in range(1, L):
        assert torch.equal(hs[i], captured[i - 1]), f"hidden_states[{i}]"
    assert torch.equal(hs[L], model.model.norm(captured[-1]))  # the last one is after the final norm
    assert_close(out.logits, model.lm_head(hs[L]), 1e-6, "logits from the last hidden state")
    assert model(ids, use_cache=False).hidden_states is None


@pytest.mark.parametrize("name", list(ATTENTION) + ["hybrid"])
def test_eager_and_sdpa_give_the_same_logits(name, monkeypatch):
    seen = []
    real_op = lazoo.ops.softmax_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real_op(*args, **kwargs)

    monkeypatch.setattr(lazoo.ops, "softmax_attention", spy)
    eager = tiny_model(name, attn_implementation="eager")
    sdpa = tiny_model(name, seed=5, attn_implementation="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    ids, mask = left_padded([random_ids(n, seed=50 + n) for n in (13, 6)], seed=14)
    results = {}
    for impl, model in (("eager", eager), ("sdpa", sdpa)):
        seen.clear()
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            step = model(random_ids(2, 1, seed=15), attention_mask=F.pad(mask, (0, 1), value=1),
                         past_key_values=out.past_key_values)
        results[impl] = torch.cat([out.logits, step.logits], 1)
        # eager forces the step-by-step reference; sdpa leaves the choice to the op (auto, or LAZOO_BACKEND)
        assert set(seen) == {"recurrent" if impl == "eager" else None}, (impl, seen)
    real = F.pad(mask, (0, 1), value=1).bool()
    assert_close(results["eager"][real], results["sdpa"][real], 1e-5, "eager vs sdpa logits")


# ----------------------------------------------------------------------------- 5. pure VLA cache
def test_pure_vla_generates_and_caches_S_A_z_t():
    model = shared_model("vla")
    assert not any(isinstance(m, AttentionMixer) for m in model.modules()), "the VLA model has attention"
    prompts = [random_ids(n, seed=60 + n) for n in (7, 3)]
    ids, mask = left_padded(prompts, seed=16)
    new = 16
    # A is refreshed every 7 real tokens (conftest): sample 0 ends at t = 22 (3 refreshes), sample 1 at
    # t = 18 (2), so a counter that counted pads would refresh at the wrong steps and change S and A
    assert model.config.refresh_period == 7
    out = greedy(model, ids, new, attention_mask=mask)
    cache = out.past_key_values
    assert isinstance(cache, LazooCache)
    processed = mask.sum(1) + new - 1  # the last generated token is never fed back
    assert cache.real_tokens.tolist() == processed.tolist()
    B, H, D = 2, model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    for i, entry in enumerate(cache.states):
        state = entry["op"]
        assert set(state) == {"S", "A", "z", "t"}, f"layer {i}: {sorted(state)}"
        assert state["S"].shape == (B, H, D, D) and state["A"].shape == (B, H, D, D)
        assert state["z"].shape == (B, H, D) and state["t"].shape == (B,)
        assert state["t"].tolist() == processed.tolist(), f"layer {i}: t counts pads or misses tokens"
    # each sample's state equals the state after its real tokens alone, in one pass
    T = ids.shape[1]
    for b, p in enumerate(prompts):
        tokens = torch.cat([p, out.sequences[b, T:-1]])[None]
        with torch.no_grad():
            alone = model(tokens, use_cache=True).past_key_values
        for i in range(len(cache)):
            for key in ("S", "A", "z"):
                expected = alone.states[i]["op"][key][0]
                tol = 1e-4 * max(1.0, expected.abs().max().item())
                assert_close(cache.states[i]["op"][key][b], expected, tol, f"sample {b} layer {i} {key}")


# ----------------------------------------------------------------------------- 6. bad input, options
def test_unknown_mechanism_is_rejected_with_the_known_names():
    for model_type in ("lazoo_hybrid", "lazoo_vla"):
        with pytest.raises(ValueError, match="flash_thing") as err:
            AutoConfig.for_model(model_type, num_hidden_layers=2, layer_types=["vla", "flash_thing"])
        for name in MECHANISMS:
            assert name in str(err.value)
    # transformers builds configs with no arguments (defaults); a bare hybrid is the sliding-window/VLA one
    assert AutoConfig.for_model("lazoo_hybrid", num_hidden_layers=3).layer_types == ["sliding_window", "vla",
                                                                                    "sliding_window"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        AutoConfig.for_model("lazoo_hybrid", num_hidden_layers=3, layer_types=["vla", "softmax"])


def test_hidden_size_not_divisible_by_heads_is_rejected():
    with pytest.raises(ValueError, match="hidden_size=30") as err:
        AutoModelForCausalLM.from_config(tiny_config("vla", hidden_size=30, num_attention_heads=4))
    assert "num_attention_heads=4" in str(err.value)


def test_unknown_mixer_kwargs_are_rejected():
    with pytest.raises(ValueError, match="lambda_zero"):
        tiny_config("vla", mixer_kwargs={"vla": {"lambda_zero": 0.2}})
    with pytest.raises(ValueError, match="flash_thing"):
        tiny_config("hybrid", mixer_kwargs={"flash_thing": {}})


def test_mechanism_options_reach_the_op(monkeypatch, tmp_path):
    seen = []
    real_op = lazoo.ops.vla

    def spy(*args, **kwargs):
        seen.append(kwargs["lambda0"])
        return real_op(*args, **kwargs)

    monkeypatch.setattr(lazoo.ops, "vla", spy)
    default_lambda0 = MIXERS["vla"].defaults["lambda0"]
    typed = tiny_model("vla", lambda0=0.25)  # a typed field of the VLA config
    assert typed.config.lambda0 == 0.25 and typed.config.mixer_options("vla")["lambda0"] == 0.25
    kwargs_cfg = tiny_config("hybrid", mixer_kwargs={"vla": {"lambda0": 0.4}})
    assert kwargs_cfg.mixer_options("vla")["lambda0"] == 0.4
    both = tiny_config("vla", lambda0=0.25, mixer_kwargs={"vla": {"lambda0": 0.4}})
    assert both.mixer_options("vla")["lambda0"] == 0.4  # mixer_kwargs wins

    ids = random_ids(1, 12, seed=17)
    d = typed.model.layers[0].mixer.head_dim  # penalty_norm="unit": the op gets λ₀ / d
    with torch.no_grad():
        seen.clear()
        out = typed(ids).logits
        assert seen == [0.25 / d] * 2
        default = tiny_model("vla")  # same seed, same weights, default lambda0
        seen.clear()
        assert not torch.allclose(default(ids).logits, out, atol=1e-4), "lambda0 has no effect"
        assert seen == [default_lambda0 / d] * 2
        typed.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert loaded.config.lambda0 == 0.25
        seen.clear()
        assert torch.equal(loaded(ids).logits, out)
        assert seen == [0.25 / d] * 2


# ----------------------------------------------------------------------------- 7. pipeline, streamer
@pytest.fixture(scope="module", params=["vla", "hybrid"])
def text_model(tokenizer, request):
    tok = copy.deepcopy(tokenizer)  # the pipeline changes padding_side
    model = tiny_model(request.param, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return model, tok


def test_text_generation_pipeline(text_model):
    model, tok = text_model
    prompt = "In the beginning God created"
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    result = pipe(prompt, max_new_tokens=12, do_sample=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0]
    assert expected.shape[0] > ids.shape[1]
    assert result[0]["generated_text"] == tok.decode(expected, skip_special_tokens=True)
    assert result[0]["generated_text"].startswith(prompt)
    # a batch of prompts of different lengths (the pipeline pads on the left) gives the same texts
    prompts = [prompt, "Blessed are the meek: for they shall inherit the earth"]
    batched = pipe(prompts, max_new_tokens=12, do_sample=False, batch_size=2)
    for p, out in zip(prompts, batched):
        assert out[0]["generated_text"] == pipe(p, max_new_tokens=12, do_sample=False)[0]["generated_text"]


def test_text_streamer(text_model):
    model, tok = text_model
    ids = tok("And God said, Let there be light", return_tensors="pt").input_ids
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    assert buffer.getvalue() == tok.decode(out[0, ids.shape[1]:]) + "\n"


# ----------------------------------------------------------------------------- more configurations, backends
VARIANTS = {
    "softmax-qknorm-norope": ("softmax", dict(mixer_kwargs={"softmax": {"qk_norm": True, "use_rope": False}})),
    "linear-conv-unnormalised-untied": (
        "linear", dict(use_short_conv=True, tie_word_embeddings=False, mixer_kwargs={"linear": {"normalize": False}})
    ),
    "gated_linear-conv": ("gated_linear", dict(use_short_conv=True)),
    "delta_net-noconv": ("delta_net", dict(use_short_conv=False)),
    "vla-conv-refresh3": ("vla", dict(use_short_conv=True, refresh_period=3, lambda0=0.5)),
    "ela-sum_sq_euclid-conv": ("ela", dict(use_short_conv=True, kernel="sum_sq_euclid")),
    "ela-sub_sq_euclid": ("ela", dict(kernel="sub_sq_euclid")),
    "ela-magnitude_direction": ("ela", dict(kernel="magnitude_direction")),
    "delta_product-3-gated-negeig": ("delta_product", dict(num_householder=3, use_forget_gate=True,
                                                           allow_neg_eigval=True)),
    "hybrid-all": ("hybrid", dict(layer_types=list(MECHANISMS))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_cache_padding_and_round_trip(variant, tmp_path):
    name, overrides = VARIANTS[variant]
    model = tiny_model(name, **overrides)
    ids = random_ids(2, 90, seed=18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :70], use_cache=True)
        assert_close(out.logits, full[:, :70], 1e-4, "prefill")
        for t in range(70, 90):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
            assert_close(out.logits[:, 0], full[:, t], 1e-4, f"step {t}")
    prompts = [random_ids(n, seed=70 + n) for n in (21, 5, 13)]
    lp, mask = left_padded(prompts, seed=19)
    batched = greedy(model, lp, 24, attention_mask=mask)
    for b, p in enumerate(prompts):
        alone = greedy(model, p[None], 24)
        assert torch.equal(batched.sequences[b, lp.shape[1]:], alone.sequences[0, len(p):])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    tied = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert tied == model.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, full)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_recurrent_backend_matches_chunk_at_model_level(name, monkeypatch):
    """LAZOO_BACKEND=recurrent (step-by-step references) vs the default chunk forms: logits and grads."""
    model = tiny_model(name, eval=False)
    ids, mask = left_padded([random_ids(n, seed=80 + n) for n in (75, 40)], seed=20)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for backend in ("chunk", "recurrent"):
        monkeypatch.setenv("LAZOO_BACKEND", backend)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = results
    real = mask.bool()
    assert_close(la[real], lb[real], 1e-4, "logits")
    for n in ga:
        assert_close(ga[n], gb[n], 1e-4 * max(1.0, gb[n].abs().max().item()), f"grad {n}")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_float64_cache_padding_and_backends_agree_to_rounding(name, monkeypatch):
    """In float64 the chunk forms, token-by-token decoding, padded batches and the step-by-step reference
    agree to ~1e-15: no small error in the math (or silent cast to float32) can hide in an fp32 tolerance."""
    model = tiny_model(name).double()
    ids = random_ids(2, 75, seed=24)
    prompts = [random_ids(n, seed=100 + n) for n in (30, 9)]
    padded, mask = left_padded(prompts, seed=25)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        assert full.dtype == torch.float64
        out = model(ids[:, :66], use_cache=True)
        assert_close(out.logits, full[:, :66], 1e-10, "prefill")
        for t in range(66, 75):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
            assert_close(out.logits[:, 0], full[:, t], 1e-10, f"decode step {t}")
        for _, x in cache_tensors(out.past_key_values):
            assert not x.is_floating_point() or x.dtype == torch.float64
        batch = model(padded, attention_mask=mask, use_cache=False).logits
        for b, p in enumerate(prompts):
            assert_close(batch[b, -len(p):], model(p[None], use_cache=False).logits[0], 1e-10, f"sample {b}")
        # RoPE sees relative positions only: shifting them all changes nothing (float64 angles too)
        shifted = model(ids, position_ids=torch.arange(75).expand(2, -1) + 1000, use_cache=False).logits
        assert_close(shifted, full, 1e-10, "positions shifted by 1000")
        monkeypatch.setenv("LAZOO_BACKEND", "recurrent")
        assert_close(model(ids, use_cache=False).logits, full, 1e-10, "recurrent backend")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bfloat16_model_runs_near_fp32_with_fp32_states(name):
    model = shared_model(name)
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = random_ids(2, 20, seed=26)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = half(ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    assert_close(out.logits.float(), ref, 3e-2 * ref.abs().max().item(), "bf16 vs fp32 logits")
    for n, x in cache_tensors(out.past_key_values):
        if x.is_floating_point() and ".op" in n:  # recurrent states accumulate in fp32
            assert x.dtype == torch.float32, (n, x.dtype)
    generated = half.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert generated.shape == (2, 28)


# ----------------------------------------------------------------------------- slow: the full matrix
@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_MODELS)
def test_long_generation_and_beams(name):
    model = shared_model(name)
    ids = random_ids(3, 9, seed=21)
    cached = greedy(model, ids, 128, use_cache=True)
    full = greedy(model, ids, 128, use_cache=False)
    assert_same_generation(cached, full, prompt_len=9)
    kwargs = dict(num_beams=4, num_return_sequences=2, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                  return_dict_in_generate=True, output_scores=True)
    a = model.generate(ids, use_cache=True, **kwargs)
    b = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert_close(a.sequences_scores, b.sequences_scores, 1e-4, "beam scores")


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_MODELS)
def test_torch_compile_gives_the_same_logits(name):
    model = shared_model(name)
    ids, mask = left_padded([random_ids(n, seed=90 + n) for n in (20, 11)], seed=22)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    real = mask.bool()
    assert_close(got[real], expected[real], 1e-4, "compiled logits")


def test_grouped_value_heads_read_in_place_equal_repeated_heads(single_thread):
    # Gated DeltaNet with twice as many value heads as query/key heads: the op reads q and k in place; the same
    # model with q and k repeated head by head gives the same logits, and the cache gives what a full pass gives
    from lazoo.layers.mixers.delta import GatedDeltaNetMixer

    model = tiny_model("gated_delta_net", num_attention_heads=2, mixer_kwargs={"gated_delta_net": {"num_v_heads": 4}})
    ids = random_ids(2, 19, seed=3)
    with torch.no_grad():
        grouped = model(ids).logits
        GatedDeltaNetMixer.grouped_values = False
        try:
            repeated = model(ids).logits
        finally:
            GatedDeltaNetMixer.grouped_values = True
        first = model(ids[:, :12], use_cache=True)
        rest = model(ids[:, 12:], past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), grouped, rtol=1e-4, atol=1e-4)


def test_output_attentions_gives_the_softmax_layers_weights_and_none_for_recurrent_ones():
    """A hybrid (sliding window + VLA) asked for attentions: the window layer's softmax weights [B, H, T, T] (rows
    of real queries sum to 1, nothing beyond the window or on a pad), None for the VLA layer, the same logits."""
    model = shared_model("hybrid")
    ids, mask = left_padded([random_ids(9, seed=1), random_ids(5, seed=2)], seed=3)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        plain = model(ids, attention_mask=mask)
    assert_close(out.logits, plain.logits, 1e-5, "logits with attentions vs without")
    window, recurrent = out.attentions
    assert recurrent is None
    B, T = ids.shape
    assert window.shape == (B, model.config.num_attention_heads, T, T)
    sums = window.sum(-1)
    assert torch.allclose(sums, mask[:, None, :].to(sums.dtype).expand_as(sums), atol=1e-5)
    p = torch.arange(T)
    outside = (p[None, :] > p[:, None]) | (p[None, :] <= p[:, None] - model.config.sliding_window)
    assert window[..., outside].abs().max() == 0
    pad_keys = (mask == 0)[:, None, None, :].expand_as(window)
    assert pad_keys.any() and window[pad_keys].abs().max() == 0
