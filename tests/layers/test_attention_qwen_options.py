"""The attention mixer's Qwen3.5 / Qwen3-Next options: `head_dim` (a head dim independent of hidden_size),
`output_gate` (o · sigmoid(g_proj(x)) before o_proj), `rotary_dim` (partial RoPE), `qk_rmsnorm_zero_centered`
((1 + w) q/k norms) and grouped-query attention with a compact KV cache (num_kv_heads heads in the state).

Claims: the mixer equals a token-by-token float64 reference written here (softmax over the visible past per query,
partial rotary by hand, zero-centred norms, the gate, query head h reading key/value head h // groups) at ragged
left-padded lengths, outputs and gradients, on every backend and with a window; it equals transformers' own
`Qwen3_5Attention` with its weights copied over; the cache keeps num_kv_heads heads, decoding token by token with it
equals the full forward, the static cache (and a compiled decode step) gives the dynamic cache's tokens; each option
changes the output (so each test above would fail without it); bad values get clear errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import left_padded, tiny_model
from op_helpers import assert_close, left_pad_mask
from transformers import AutoConfig

from lazoo.layers.mixers import mixer_class
from lazoo.models.cache import LazooCache

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROTARY = 48, 4, 2, 10, 4  # head_dim · heads (40) is not hidden_size
WINDOW = 4
#: every Qwen option on (plus biases, so that g_proj's bias is exercised)
QWEN = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rotary_dim=ROTARY, qk_rmsnorm=True,
            qk_rmsnorm_eps=1e-6, qk_rmsnorm_zero_centered=True, output_gate=True, qkv_bias=True, rope_theta=500.0)
MECHANISMS = ("softmax", "sliding_window")


def make_mixer(name: str = "softmax", dtype=F64, seed: int = 0, hidden: int = HIDDEN, **options):
    """A mixer of mechanism `name` with `options`, every parameter drawn at random (norm weights included)."""
    config = AutoConfig.for_model(f"lazoo_{name}", hidden_size=hidden, num_attention_heads=HEADS,
                                  sliding_window=WINDOW, mixer_kwargs={name: options})
    mixer = mixer_class(name)(config, 0, config.mixer_options(name)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64).to(dtype) * (0.3 if p.dim() == 1 else 0.25))
    return mixer


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The model's position ids: real tokens counted from 0 (pads clamped to 0)."""
    return (mask.long().cumsum(1) - 1).clamp_min(0)


def reference(mixer, x: torch.Tensor, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """The mixer's output token by token, from its parameters, written independently of lazoo's code: per query,
    softmax over the real keys of the last `window` positions (pads included in the count) of its own sample."""
    opt = mixer.options
    H, Hkv, D = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    R = opt["rotary_dim"] or D
    groups = H // Hkv

    def linear(layer, v):
        return layer.weight @ v + (layer.bias if layer.bias is not None else 0.0)

    def norm(layer, v):  # v [heads, D]
        w = layer.weight
        scale = (1.0 + w) if opt["qk_rmsnorm_zero_centered"] else w
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + layer.eps) * scale

    def rotate(v, pos):  # v [heads, D]: pairs (i, i + R/2) of the first R channels turn by pos · θ^(−2i/R)
        out = v.clone()
        for i in range(R // 2):
            angle = pos * opt["rope_theta"] ** (-2.0 * i / R)
            c, s = math.cos(angle), math.sin(angle)
            a, b = v[:, i], v[:, i + R // 2]
            out[:, i], out[:, i + R // 2] = a * c - b * s, b * c + a * s
        return out

    Bn, T, _ = x.shape
    rows = []
    for b in range(Bn):
        keys, values, seen_at, out = [], [], [], []
        pos = 0
        for t in range(T):
            if not mask[b, t]:
                out.append(torch.zeros(mixer.hidden_size, dtype=x.dtype))
                continue
            xt = x[b, t]
            q = linear(mixer.q_proj, xt).view(H, D)
            k = linear(mixer.k_proj, xt).view(Hkv, D)
            v = linear(mixer.v_proj, xt).view(Hkv, D)
            if opt["qk_rmsnorm"]:
                q, k = norm(mixer.q_norm, q), norm(mixer.k_norm, k)
            if opt["use_rope"]:
                q, k = rotate(q, pos), rotate(k, pos)
            keys.append(k)
            values.append(v)
            seen_at.append(t)
            visible = [i for i, s in enumerate(seen_at) if window is None or s > t - window]
            heads = []
            for h in range(H):
                g = h // groups
                logits = torch.stack([q[h] @ keys[i][g] for i in visible]) / math.sqrt(D)
                p = torch.softmax(logits, 0)
                heads.append(sum(pi * values[i][g] for pi, i in zip(p, visible)))
            o = torch.cat(heads)
            if opt["output_gate"]:
                o = o * torch.sigmoid(linear(mixer.g_proj, xt))
            out.append(mixer.o_proj.weight @ o)
            pos += 1
        rows.append(torch.stack(out))
    return torch.stack(rows)


def run_with_grads(fn, leaves):
    out = fn()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return out.detach(), grads


# ----------------------------------------------------------------------------------------- float64 reference
@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("options", [QWEN, dict(num_kv_heads=1, head_dim=6, rotary_dim=2, output_gate=True),
                                     dict(qk_rmsnorm=True, rotary_dim=6, qk_rmsnorm_zero_centered=True)],
                         ids=["qwen", "gqa_gate_partial", "mha_zero_centred"])
def test_mixer_matches_token_by_token_reference_with_grads(name, backend, options):
    mixer = make_mixer(name, **options, backend=backend)
    T, lengths = 9, [9, 6, 2]
    mask = left_pad_mask(lengths, T)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, T, HIDDEN, generator=gen, dtype=F64)
    x[~mask] = 1e3 * torch.randn(int((~mask).sum()), HIDDEN, generator=gen, dtype=F64)  # pads change nothing
    x.requires_grad_(True)
    leaves = [x, *mixer.parameters()]
    window = WINDOW if name == "sliding_window" else None
    out, grads = run_with_grads(lambda: mixer(x, mask=mask, position_ids=positions(mask)), leaves)
    ref, ref_grads = run_with_grads(lambda: reference(mixer, x, mask, window), leaves)
    assert_close(out, ref, 1e-10, "output vs token-by-token reference")
    names = ["x", *(n for n, _ in mixer.named_parameters())]
    assert "g_proj.bias" in names or not options.get("qkv_bias")
    for n, g, r in zip(names, grads, ref_grads):
        assert_close(g, r, 1e-9, f"grad {n}")


def test_shapes_of_the_projections_and_the_norms():
    mixer = make_mixer(**QWEN)
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters()}
    assert shapes["q_proj.weight"] == shapes["g_proj.weight"] == (HEADS * HEAD_DIM, HIDDEN)
    assert shapes["k_proj.weight"] == shapes["v_proj.weight"] == (KV_HEADS * HEAD_DIM, HIDDEN)
    assert shapes["o_proj.weight"] == (HIDDEN, HEADS * HEAD_DIM) and "o_proj.bias" not in shapes
    assert shapes["q_norm.weight"] == shapes["k_norm.weight"] == (HEAD_DIM,)
    fresh = mixer_class("softmax")(mixer._config, 0, mixer._config.mixer_options("softmax"))
    assert torch.equal(fresh.q_norm.weight, torch.zeros(HEAD_DIM))  # zero-centred: w starts at 0, a scale of 1


def test_a_model_initialises_the_zero_centred_norms_to_zero():
    model = tiny_model("softmax", perturb=False, num_kv_heads=1, head_dim=24, rotary_dim=8, qk_rmsnorm=True,
                       qk_rmsnorm_zero_centered=True, output_gate=True)
    mixer = model.model.layers[0].mixer
    assert torch.equal(mixer.q_norm.weight, torch.zeros(24)) and torch.equal(mixer.k_norm.weight, torch.zeros(24))
    assert mixer.g_proj.weight.std() > 0


def test_half_types_compute_the_norms_in_float32():
    mixer = make_mixer(**QWEN, dtype=torch.float32)
    x = torch.randn(2, 5, HEAD_DIM) * 30
    want = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + mixer.q_norm.weight)).to(torch.bfloat16)
    got = mixer.q_norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    # from a bf16 input: one rounding of the input, one of the result
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


# ----------------------------------------------------------------------------------------- against transformers
def _qwen_attention(window: int | None):
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                               reason="this transformers has no Qwen3.5 (Qwen3_5Attention)")
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6,
                               num_hidden_layers=1, layer_types=["full_attention"], vocab_size=11,
                               intermediate_size=32)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    attn = qwen.Qwen3_5Attention(config, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.2))
    return qwen, config, attn


@pytest.mark.parametrize("name", MECHANISMS)
def test_mixer_equals_transformers_qwen3_5_attention(name):
    qwen, config, attn = _qwen_attention(None)
    H, D = config.num_attention_heads, config.head_dim
    window = 5 if name == "sliding_window" else None
    lazoo_config = AutoConfig.for_model(
        f"lazoo_{name}", hidden_size=64, num_attention_heads=H, sliding_window=window or 4,
        mixer_kwargs={name: dict(num_kv_heads=2, head_dim=D, rotary_dim=int(D * 0.25), rope_theta=10000.0,
                                 qk_rmsnorm=True, qk_rmsnorm_eps=1e-6, qk_rmsnorm_zero_centered=True,
                                 output_gate=True)})
    mixer = mixer_class(name)(lazoo_config, 0, lazoo_config.mixer_options(name)).eval()
    with torch.no_grad():
        # transformers views q_proj's output as [..., H, 2·D] and chunks it into (query, gate)
        rows = attn.q_proj.weight.view(H, 2 * D, -1)
        mixer.q_proj.weight.copy_(rows[:, :D].reshape(H * D, -1))
        mixer.g_proj.weight.copy_(rows[:, D:].reshape(H * D, -1))
        for part in ("k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(mixer, part).weight.copy_(getattr(attn, part).weight)

    T, lengths = 11, [11, 7, 3]
    mask = left_pad_mask(lengths, T)
    x = torch.randn(3, T, 64, generator=torch.Generator().manual_seed(4))
    pos = positions(mask)
    cos, sin = qwen.Qwen3_5TextRotaryEmbedding(config)(x, pos)
    i = torch.arange(T)
    allowed = (i[None, :] <= i[:, None])[None] & mask[:, None, :]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)[None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
    with torch.no_grad():
        want, _ = attn(x, position_embeddings=(cos, sin), attention_mask=additive)
        for backend in ("recurrent", "chunk"):
            mixer.options["backend"] = backend
            got = mixer(x, mask=mask, position_ids=pos)
            assert_close(got[mask], want[mask], 1e-5, f"{name} ({backend}) vs Qwen3_5Attention")
            assert torch.all(got[~mask] == 0)


# ----------------------------------------------------------------------------------------- grouped-query cache
@pytest.mark.parametrize("name", MECHANISMS)
def test_cache_keeps_kv_heads_and_decoding_equals_the_full_forward(name):
    mixer = make_mixer(name, **QWEN)
    T, prompt, lengths = 12, 7, [12, 9, 5]
    mask = left_pad_mask(lengths, T)
    x = torch.randn(3, T, HIDDEN, generator=torch.Generator().manual_seed(6), dtype=F64)
    pos = positions(mask)
    with torch.no_grad():
        full = mixer(x, mask=mask, position_ids=pos)
        cache = LazooCache(1)
        steps = [mixer(x[:, :prompt], mask=mask[:, :prompt], position_ids=pos[:, :prompt], cache=cache)]
        state = cache.states[0]
        kept = prompt if name == "softmax" else WINDOW - 1
        assert state["k"].shape == (3, kept, KV_HEADS, HEAD_DIM) and state["v"].shape == (3, kept, KV_HEADS, HEAD_DIM)
        for t in range(prompt, T):
            steps.append(mixer(x[:, t:t + 1], mask=mask[:, t:t + 1], position_ids=pos[:, t:t + 1], cache=cache))
        assert cache.states[0]["k"].shape[1:] == ((T if name == "softmax" else WINDOW - 1), KV_HEADS, HEAD_DIM)
    assert_close(torch.cat(steps, 1), full, 1e-12, "decoded token by token vs full forward")


def test_gqa_state_equals_the_repeated_heads_of_a_plain_mha_layer():
    """A grouped layer computes what the multi-head layer with each key/value head repeated computes; its cache
    holds the unrepeated heads."""
    gqa = make_mixer(**QWEN)
    mha = make_mixer(**{**QWEN, "num_kv_heads": None})
    groups = HEADS // KV_HEADS
    with torch.no_grad():
        for n, p in gqa.named_parameters():
            if n.startswith(("k_proj", "v_proj")):
                p_mha = dict(mha.named_parameters())[n]
                p_mha.copy_(p.view(KV_HEADS, HEAD_DIM, *p.shape[1:]).repeat_interleave(groups, 0).reshape(p_mha.shape))
            else:
                dict(mha.named_parameters())[n].copy_(p)
    mask = left_pad_mask([8, 3], 8)
    x = torch.randn(2, 8, HIDDEN, dtype=F64)
    caches = LazooCache(1), LazooCache(1)
    with torch.no_grad():
        a = gqa(x, mask=mask, position_ids=positions(mask), cache=caches[0])
        b = mha(x, mask=mask, position_ids=positions(mask), cache=caches[1])
    assert_close(a, b, 1e-12, "grouped vs repeated heads")
    assert caches[0].states[0]["k"].shape[2] == KV_HEADS and caches[1].states[0]["k"].shape[2] == HEADS
    # the same keys to float64 rounding (products of other widths may round differently)
    assert_close(caches[0].states[0]["k"].repeat_interleave(groups, 2), caches[1].states[0]["k"], 1e-12, "cached keys")


QWEN_TINY = dict(num_kv_heads=1, head_dim=24, rotary_dim=8, qk_rmsnorm=True, qk_rmsnorm_zero_centered=True,
                 output_gate=True)  # tiny models: hidden 32, 2 heads (2 · 24 ≠ 32)


@pytest.mark.parametrize("name", MECHANISMS)
def test_static_cache_is_compact_and_generates_the_dynamic_tokens(name):
    model = tiny_model(name, seed=1, **QWEN_TINY)
    ids, mask = left_padded()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kwargs)
        full = model(input_ids=static.sequences[:, :-1], attention_mask=torch.cat(
            [mask, torch.ones(3, 7, dtype=mask.dtype)], 1), use_cache=False).logits
    assert torch.equal(dynamic, static.sequences)
    # greedy decoding with the cache picks the tokens a full recompute picks
    assert torch.equal(full[:, 8:].argmax(-1), static.sequences[:, 9:])
    cache = static.past_key_values
    assert cache.static
    for state in cache.states:
        assert state["k"].shape[2:] == (1, 24) and state["v"].shape[2:] == (1, 24)
        if name == "sliding_window":
            assert state["k"].shape[1] == model.config.sliding_window - 1


def test_compiled_decode_step_with_grouped_heads_traces_once_and_equals_eager():
    torch._dynamo.reset()
    try:
        model = tiny_model("softmax", seed=1, **QWEN_TINY)
        ids, mask = left_padded()
        compiles = []

        def backend(graph, example_inputs):
            compiles.append(graph)
            return graph.forward

        step = torch.compile(model, fullgraph=True, backend=backend)
        caches = [LazooCache(model.config.num_hidden_layers, static=True, max_cache_len=20) for _ in range(2)]
        per_step, worst = [], 0.0
        with torch.no_grad():
            for cache in caches:
                model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            token, pos = ids[:, -1:].clone(), mask.sum(1, keepdim=True) - 1
            for _ in range(4):
                pos = pos + 1
                kw = dict(input_ids=token, attention_mask=torch.ones_like(token), position_ids=pos, use_cache=True)
                eager = model(cache=caches[0], **kw).logits
                before = len(compiles)
                compiled = step(cache=caches[1], **kw).logits
                per_step.append(len(compiles) - before)
                worst = max(worst, (eager - compiled).abs().max().item())
                token = eager[:, -1:].argmax(-1)
        assert per_step == [1, 0, 0, 0], per_step
        assert worst < 1e-5
        assert caches[1].states[0]["k"].shape == (3, 20, 1, 24)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- each option matters
@pytest.mark.parametrize("option,off", [("rotary_dim", None), ("output_gate", False),
                                        ("qk_rmsnorm_zero_centered", False)])
def test_each_option_changes_the_output(option, off):
    """Without the option (same weights otherwise) the layer computes something else: the reference and
    transformers tests above pin each one."""
    mask = left_pad_mask([7, 4], 7)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(8), dtype=F64)
    on = make_mixer(**QWEN)
    other = make_mixer(**{**QWEN, option: off})
    with torch.no_grad():
        params = dict(on.named_parameters())
        for n, p in other.named_parameters():
            p.copy_(params[n])
        a = on(x, mask=mask, position_ids=positions(mask))
        b = other(x, mask=mask, position_ids=positions(mask))
    diff = (a - b)[mask].abs().max() / a[mask].abs().max()
    assert diff > 1e-3, f"{option}: no effect ({diff:.2e})"


def test_partial_rotary_leaves_the_other_channels_and_matches_full_rotary_on_its_part():
    from lazoo.layers.rope import apply_rotary, rotary_cos_sin

    x = torch.randn(2, 5, 3, 10, dtype=F64)
    pos = torch.arange(5).expand(2, -1) + 3
    cos, sin = rotary_cos_sin(pos, 4, 500.0, F64)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert torch.equal(y[..., :4], apply_rotary(x[..., :4], cos, sin))
    assert not torch.allclose(y[..., :4], x[..., :4])
    # inv_freq over rotary_dim: pair 1 of 4 channels turns by pos · θ^(−2/4)
    assert torch.allclose(cos[..., 1], torch.cos(pos * 500.0 ** -0.5).to(F64)[..., None])


# ----------------------------------------------------------------------------------------- errors and old layouts
@pytest.mark.parametrize("options,match", [
    (dict(rotary_dim=3), "rotary_dim must be an even number"),
    (dict(head_dim=8, rotary_dim=10), "at most head_dim=8"),
    (dict(rotary_dim=4, use_rope=False), "use_rope is False"),
    (dict(head_dim=7), "even head_dim"),
    (dict(head_dim=0), r"head_dim.*None or a positive int"),
    (dict(head_dim=True), r"head_dim.*None or a positive int"),
    (dict(rotary_dim=2.0), r"rotary_dim.*None or a positive int"),
    (dict(qk_rmsnorm_zero_centered=True), "set qk_rmsnorm=True"),
    (dict(output_gate=1), "output_gate.*True or False"),
    (dict(num_kv_heads=3), "must divide num_heads"),
])
def test_bad_options_get_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        config = AutoConfig.for_model("lazoo_softmax", hidden_size=HIDDEN, num_attention_heads=HEADS,
                                      mixer_kwargs={"softmax": options})
        mixer_class("softmax")(config, 0, config.mixer_options("softmax"))


def test_head_dim_frees_hidden_size_from_the_head_count():
    with pytest.raises(ValueError, match="must be divisible by num_attention_heads=8"):
        AutoConfig.for_model("lazoo_softmax", hidden_size=60, num_attention_heads=8, num_hidden_layers=1)
    config = AutoConfig.for_model("lazoo_softmax", hidden_size=60, num_attention_heads=8, num_kv_heads=2, head_dim=16,
                                  num_hidden_layers=1)
    mixer = mixer_class("softmax")(config, 0, config.mixer_options("softmax"))
    assert (mixer.head_dim, mixer.q_proj.out_features, mixer.o_proj.in_features) == (16, 128, 128)
    out = mixer(torch.randn(2, 5, 60), position_ids=torch.arange(5).expand(2, -1))
    assert out.shape == (2, 5, 60)


def test_default_layout_is_unchanged():
    """No new option set: the same parameters as before (no g_proj, plain norms, [H·D, hidden] projections)."""
    mixer = make_mixer(qk_rmsnorm=True)
    names = {n for n, _ in mixer.named_parameters()}
    assert names == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                     "k_norm.weight"}
    assert isinstance(mixer.q_norm, torch.nn.RMSNorm) and mixer.rotary_dim == mixer.head_dim == HIDDEN // HEADS
