"""The local-linear mixer's learned low-rank slope (`slope_rank`, parameter `slope_projection` P [H, r, head_dim]).

Claims, each against an independent computation: with r = head_dim and P = I (or any orthogonal P, the init)
the model equals the exact-slope model in float64, and P = c·I equals the exact slope with ridge ρ/c² (which
fails if P never reaches the op); at r < head_dim the mixer equals a per-query least-squares fit on the
projected offsets, written out here; the init has orthonormal rows scaled by √(head_dim / r); through the Auto
classes a model with slope_rank trains, generates the same with and without cache, and round-trips P.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, random_ids, tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo
from lazoo.layers.mixers.base import unit_norm
from lazoo.layers.mixers.local_linear import LocalLinearMixer

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
HEAD_DIM = 16  # tiny configs: hidden 32, 2 heads


def max_err(a, b):
    assert a.shape == b.shape and torch.isfinite(a).all()
    return (a.double() - b.double()).abs().max().item()


def projections(model):
    return [layer.mixer.slope_projection for layer in model.model.layers]


def ranked_copy(exact, rank, **overrides):
    """A float64 model with `slope_rank` holding `exact`'s weights (P keeps its init until set)."""
    ranked = tiny_model("local_linear", perturb=False, slope_rank=rank, **overrides).double()
    missing, unexpected = ranked.load_state_dict(exact.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == [f"model.layers.{i}.mixer.slope_projection" for i in range(2)]
    return ranked


def logits_full_and_decoded(model, ids, prefill):
    """Logits of one full pass, and of a cached prefill followed by token-by-token decoding."""
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :prefill], use_cache=True)
        steps = [out.logits]
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    return full, torch.cat(steps, 1)


# ----------------------------------------------------------------------------- option and config
def test_slope_rank_is_a_typed_config_field_default_none():
    config = tiny_config("local_linear")
    assert config.slope_rank is None and config.mixer_options("local_linear")["slope_rank"] is None
    assert all(p is None for p in projections(tiny_model("local_linear", perturb=False)))
    assert not any("slope_projection" in n for n, _ in tiny_model("local_linear").named_parameters())
    typed = tiny_config("local_linear", slope_rank=4)
    assert type(typed) is lazoo.MODEL_CLASSES["lazoo_local_linear"][0] and typed.slope_rank == 4
    assert AutoConfig.for_model("lazoo_local_linear", slope_rank=4).mixer_options("local_linear")["slope_rank"] == 4
    # any config reaches the mixer through mixer_kwargs (here a hybrid)
    hybrid = tiny_config("hybrid", layer_types=["sliding_window", "local_linear"],
                         mixer_kwargs={"local_linear": {"slope_rank": 3}})
    model = AutoModelForCausalLM.from_config(hybrid)
    assert model.model.layers[1].mixer.slope_projection.shape == (2, 3, HEAD_DIM)


@pytest.mark.parametrize("bad", [0, -2, HEAD_DIM + 1, 2.0, True, "8"])
def test_bad_slope_rank_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match=r"slope_rank.*head_dim = 16"):
        AutoModelForCausalLM.from_config(tiny_config("local_linear", slope_rank=bad))


def test_init_has_orthonormal_rows_scaled_to_the_offsets():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("local_linear", slope_rank=4))
    for P in projections(model):
        assert P.shape == (2, 4, HEAD_DIM)
        gram = P.detach().double() @ P.detach().double().transpose(1, 2)
        assert max_err(gram, HEAD_DIM / 4 * torch.eye(4, dtype=F64).expand(2, 4, 4)) < 1e-5
        assert max_err(P[0], P[1]) > 0.1, "heads share one projection"
    # on average over directions d, ‖P d‖ = ‖d‖
    d = F.normalize(torch.randn(20000, HEAD_DIM, dtype=F64), dim=-1)
    mean_sq = (d @ projections(model)[0][0].detach().double().T).pow(2).sum(-1).mean().item()
    assert abs(mean_sq - 1) < 0.05, mean_sq


# ----------------------------------------------------------------------------- equivalences (float64)
def test_full_rank_identity_and_orthogonal_projections_equal_the_exact_slope():
    exact = tiny_model("local_linear").double()
    ids = random_ids(2, 30, seed=1)
    ref_full, ref_decoded = logits_full_and_decoded(exact, ids, prefill=20)
    assert max_err(ref_decoded, ref_full) < 1e-10

    ranked = ranked_copy(exact, HEAD_DIM)
    # any orthogonal P (the init is one, to float32 rounding) is the same fit in rotated features
    with torch.no_grad():
        for P in projections(ranked):
            P.copy_(torch.linalg.qr(P)[0])
    full, decoded = logits_full_and_decoded(ranked, ids, prefill=20)
    assert max_err(full, ref_full) < 1e-10 and max_err(decoded, ref_full) < 1e-10
    with torch.no_grad():
        for P in projections(ranked):
            P.copy_(torch.eye(HEAD_DIM, dtype=F64).expand_as(P))
    full, decoded = logits_full_and_decoded(ranked, ids, prefill=20)
    assert max_err(full, ref_full) < 1e-10, "P = I, full forward"
    assert max_err(decoded, ref_full) < 1e-10, "P = I, prefill + cached decoding"


def test_scaled_identity_projection_equals_the_exact_slope_with_a_rescaled_ridge():
    """P = c·I is the exact slope with ridge ρ/c²: fails if the mixer drops P (or passes a fixed one)."""
    c, ridge = 3.0, 0.1
    exact = tiny_model("local_linear", ridge=ridge / c ** 2).double()
    ranked = ranked_copy(exact, HEAD_DIM, ridge=ridge)
    with torch.no_grad():
        for P in projections(ranked):
            P.copy_(c * torch.eye(HEAD_DIM, dtype=F64).expand_as(P))
    ids = random_ids(2, 30, seed=2)
    ref, _ = logits_full_and_decoded(exact, ids, prefill=20)
    full, decoded = logits_full_and_decoded(ranked, ids, prefill=20)
    assert max_err(full, ref) < 1e-10 and max_err(decoded, ref) < 1e-10
    unscaled = tiny_model("local_linear", ridge=ridge).double()
    with torch.no_grad():
        assert max_err(unscaled(ids).logits, ref) > 1e-4, "the ridge makes no difference: the test cannot fail"


def lstsq_low_rank(q, k, v, beta, P, ridge):
    """o_t = M⁰ of min Σ_{i≤t} w_i‖v_i − M⁰ − M¹ P_h(k_i − q_t)‖² + ρ‖M¹‖², w = softmax(β_h q_t·k_i), solved as
    one least-squares problem per query and head on the √w-weighted design stacked on [0, √ρ I]."""
    B, T, H, _ = q.shape
    r = P.shape[1]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                K, V, qt = k[b, :t + 1, h], v[b, :t + 1, h], q[b, t, h]
                sw = torch.softmax(beta[h] * (K @ qt), 0).sqrt()[:, None]
                X = torch.cat([torch.ones(t + 1, 1, dtype=F64), (K - qt) @ P[h].T], 1) * sw
                prior = torch.cat([torch.zeros(r, 1, dtype=F64), math.sqrt(ridge) * torch.eye(r, dtype=F64)], 1)
                X = torch.cat([X, prior])
                Y = torch.cat([V * sw, torch.zeros(r, V.shape[1], dtype=F64)])
                out[b, t, h] = torch.linalg.lstsq(X, Y).solution[0]
    return out


def test_low_rank_mixer_equals_an_explicit_projected_regression():
    torch.manual_seed(3)
    config = tiny_config("local_linear", slope_rank=3, chunk_size=4)
    mixer = LocalLinearMixer(config, 0, config.mixer_options("local_linear")).double()
    with torch.no_grad():
        mixer.slope_projection.add_(0.3 * torch.randn_like(mixer.slope_projection))  # not orthonormal any more
        mixer.qk_scale.copy_(torch.tensor([2.0, 5.0]))
    x = torch.randn(2, 9, 32, dtype=F64)
    q, k, v = (mixer.split_heads(proj(x)) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    with torch.no_grad():
        o, _ = mixer.mix(q, k, v, x, mask=None, state=None, want_state=False)
    ref = lstsq_low_rank(unit_norm(q), unit_norm(k), v, mixer.qk_scale, mixer.slope_projection, 0.1)
    assert max_err(o, ref) < 1e-10
    with torch.no_grad():  # and the projection matters: the exact slope gives another output
        exact, _ = lazoo.ops.local_linear_attention(unit_norm(q), unit_norm(k), v, scale=mixer.qk_scale, ridge=0.1)
    assert max_err(exact, ref) > 1e-3


# ----------------------------------------------------------------------------- through the Auto classes
def test_auto_model_with_slope_rank_trains_generates_and_round_trips(tmp_path):
    config = AutoConfig.for_model("lazoo_local_linear", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, chunk_size=16, slope_rank=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    assert isinstance(model, lazoo.LazooForCausalLM)
    start = [P.detach().clone() for P in projections(model)]
    ids = random_ids(4, 24, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        for P in projections(model):
            assert P.grad is not None and P.grad.abs().sum() > 0, "no gradient reaches P"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(max_err(P, P0) > 1e-3 for P, P0 in zip(projections(model), start)), "P did not train"

    model.eval()
    prompt = random_ids(2, 7, seed=5)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kwargs)
        recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape == (2, 27) and torch.equal(cached, recomputed)

    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.slope_rank == 4
    for P, Q in zip(projections(model), projections(loaded)):
        assert torch.equal(P, Q), "slope_projection changed on loading"
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, model(prompt).logits)


# ----------------------------------------------------------------------------- CUDA: the fused kernel
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slope_rank_runs_the_triton_kernel_at_head_dim_64(monkeypatch):
    """Head dim 64, r = 16: training, prefill and cached decoding go through the fused kernel (counted), and
    agree with the PyTorch chunk form (logits, every gradient including P's) and with generation without cache."""
    import lazoo.kernels.local_linear as kernels

    calls = []
    real_kernel = kernels.local_linear_attention

    def counting_kernel(*args, **kwargs):
        calls.append(kwargs["rank_projection"].shape)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(kernels, "local_linear_attention", counting_kernel)
    config = AutoConfig.for_model("lazoo_local_linear", vocab_size=211, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=256, pad_token_id=0, slope_rank=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).cuda()
    x = torch.randint(1, 211, (2, 150), device="cuda")
    out = model(x, labels=x)
    out.loss.backward()
    assert calls == [(2, 16, 64)] * 2, calls
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setenv("LAZOO_BACKEND", "chunk")
    ref = model(x, labels=x)
    ref.loss.backward()
    assert len(calls) == 2, "the chunk run used the kernel"
    monkeypatch.delenv("LAZOO_BACKEND")
    err = (out.logits - ref.logits).norm() / ref.logits.norm()
    assert err < 1e-3, f"logits relative error {err:.2e}"
    for n, p in model.named_parameters():
        g_err = (grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert g_err < 2e-2, f"grad {n} relative error {g_err:.2e}"

    model.eval()
    calls.clear()
    prompt = torch.randint(1, 211, (2, 37), device="cuda")
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=True)
        assert len(calls) == 2 * 24, "prefill and decoding steps did not all run the kernel"
        recomputed = model.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=False)
    assert torch.equal(cached, recomputed)
