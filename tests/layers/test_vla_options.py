"""VLA's `feature_map` ("elu1" | "identity") and `readout` ("normalized" | "unit_query") options, in the op
(every backend) and the mixer.

The reference is Algorithm 1 written here token by token in float64 with both options; pads are skipped (they read
0 and change nothing), so matching it at ragged lengths with random values at the pads also shows that a pad
changes nothing. The ``interp_*`` tests run the Triton backend under the interpreter in a fresh process, as in
test_kernels_vla.py.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model
from op_helpers import assert_close, assert_state_close, forward_and_grads, rel_err
from transformers import AutoConfig, AutoModelForCausalLM

from lazoo import ops
from lazoo.layers.mixers import mixer_class

pytestmark = pytest.mark.usefixtures("single_thread")

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from lazoo.kernels._utils import interpreter_ready

INTERP = HAS_TRITON and interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")

F64 = torch.float64
B, T, H, DK, DV = 2, 23, 2, 6, 5
CHUNK = 8  # T = 23 is not a multiple of it
HP = dict(lambda0=0.1, refresh_period=5, refresh_eta=0.3, eps=1e-4)  # a strong refresh, crossed several times
DEFAULT = ("elu1", "normalized")
NEW_MODES = [("elu1", "unit_query"), ("identity", "unit_query")]
MODES = [DEFAULT, *NEW_MODES]
each_mode = pytest.mark.parametrize("feature_map,readout", MODES, ids=[f"{f}-{r}" for f, r in MODES])
each_new_mode = pytest.mark.parametrize("feature_map,readout", NEW_MODES, ids=[f"{f}-{r}" for f, r in NEW_MODES])


# ----------------------------------------------------------------------------- the reference
def phi(x, feature_map):
    return F.elu(x) + 1 if feature_map == "elu1" else x


def unit(x):
    return x / torch.linalg.norm(x)


def reference_head(q, k, v, u, real, S, A, z, t, feature_map, readout, *, lambda0, refresh_period, refresh_eta,
                   eps):
    """Algorithm 1 for one sample and head (q, k, u ``[T, dk]``, v ``[T, dv]``, real ``[T]``), token by token
    (λ0 enters through the state's A)."""
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    outs = []
    for i in range(k.shape[0]):
        if not real[i]:
            outs.append(torch.zeros_like(v[i]))
            continue
        k_feat = phi(k[i], feature_map)
        k_hat = unit(k_feat)
        u_hat = unit(u[i]) / math.sqrt(k.shape[-1])
        a_u = A @ u_hat  # Sherman–Morrison update of A, δ clamped
        delta = torch.clamp(1 + u_hat @ a_u, min=eps)
        A = A - torch.outer(a_u, a_u) / delta
        t += 1
        if refresh_period > 0 and t % refresh_period == 0:
            A = A + refresh_eta * eye
        alpha_hat = unit(A @ k_hat)  # from the updated A
        S = S + torch.outer(v[i] - S @ k_hat, alpha_hat)
        z = z + k_feat  # accumulated in every mode
        q_f = phi(q[i], feature_map)
        outs.append(S @ q_f / torch.clamp(z @ q_f, min=eps) if readout == "normalized" else S @ unit(q_f))
    return torch.stack(outs), {"S": S, "A": A, "z": z, "t": t}


def reference(x, mask, state, feature_map, readout):
    """``reference_head`` over every sample and head: (o ``[B, T, H, dv]``, final state dict)."""
    outs, finals = [], []  # per sample: [T, H, dv], and the heads' final states
    for b in range(B):
        runs = [reference_head(*(x[n][b, :, h] for n in "qkvu"), mask[b], state["S"][b, h], state["A"][b, h],
                               state["z"][b, h], int(state["t"][b]), feature_map, readout, **HP) for h in range(H)]
        outs.append(torch.stack([o for o, _ in runs], dim=1))
        finals.append([s for _, s in runs])
    final = {n: torch.stack([torch.stack([s[n] for s in heads]) for heads in finals]) for n in "SAz"}
    final["t"] = torch.tensor([heads[0]["t"] for heads in finals])
    return torch.stack(outs), final


# ----------------------------------------------------------------------------- inputs
def make_inputs(seed=0):
    """q, k, u, v (leaves) with random values at the pads too."""
    gen = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(B, T, H, DK, generator=gen, dtype=F64) for n in "qku"}
    x["v"] = torch.randn(B, T, H, DV, generator=gen, dtype=F64)
    return {n: x[n].requires_grad_(True) for n in "qkvu"}


def ragged_mask():
    """Left pads, right pads and an interior pad."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = mask[0, -3:] = False
    mask[1, 0] = mask[1, 10] = mask[1, -1] = False
    return mask


def default_state():
    return {"S": torch.zeros(B, H, DV, DK, dtype=F64), "A": torch.eye(DK, dtype=F64).repeat(B, H, 1, 1) / HP["lambda0"],
            "z": torch.zeros(B, H, DK, dtype=F64), "t": torch.zeros(B, dtype=torch.int64)}


def random_state(seed=1):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(B, H, DK, DK, generator=gen, dtype=F64)
    return {"S": torch.randn(B, H, DV, DK, generator=gen, dtype=F64),
            "A": torch.eye(DK, dtype=F64) / HP["lambda0"] + 0.3 * M @ M.transpose(-1, -2) / DK,
            "z": 3 * torch.rand(B, H, DK, generator=gen, dtype=F64), "t": torch.tensor([3, 0])}


def run_op(x, mask, state, feature_map, readout, backend, chunk_size=CHUNK):
    return ops.vla(x["q"], x["k"], x["v"], x["u"], mask=mask, initial_state=state, output_final_state=True,
                   backend=backend, chunk_size=chunk_size, feature_map=feature_map, readout=readout, **HP)


def assert_matches(got, want, rtol):
    """(o, state, grads) of ``forward_and_grads`` against the reference's."""
    assert_close(got[0], want[0], rtol, "output")
    assert_state_close(got[1], want[1], rtol, "final state")
    for n, g in want[2].items():
        assert_close(got[2][n], g, rtol, f"grad {n}")


# ----------------------------------------------------------------------------- op: recurrent and chunk
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@each_mode
def test_the_op_matches_the_reference(backend, feature_map, readout):
    x, mask, state = make_inputs(), ragged_mask(), random_state()
    want = forward_and_grads(lambda: reference(x, mask, state, feature_map, readout), x)
    got = forward_and_grads(lambda: run_op(x, mask, state, feature_map, readout, backend), x)
    assert_matches(got, want, 1e-10)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@each_mode
def test_a_split_sequence_carries_the_state(backend, feature_map, readout):
    # cut mid-chunk; the second call starts from the first one's state, refreshes fall in both parts
    x, mask, cut = make_inputs(seed=2), ragged_mask(), 11
    want = forward_and_grads(lambda: reference(x, mask, default_state(), feature_map, readout), x)

    def two_calls():
        first, second = ({n: t[:, part] for n, t in x.items()} for part in (slice(None, cut), slice(cut, None)))
        o1, s1 = run_op(first, mask[:, :cut], None, feature_map, readout, backend)
        o2, s2 = run_op(second, mask[:, cut:], s1, feature_map, readout, backend)
        return torch.cat([o1, o2], dim=1), s2

    assert_matches(forward_and_grads(two_calls, x), want, 1e-10)


def test_the_new_modes_change_the_output_and_keep_the_state_layout():
    # guards the comparisons above: each option changes the reference, so an op ignoring it would fail them
    x, mask, state = make_inputs(), ragged_mask(), random_state()
    with torch.no_grad():
        runs = {mode: reference(x, mask, state, *mode) for mode in MODES}
    (o_default, s_default), (o_unit, s_unit), (o_signed, s_signed) = (runs[m] for m in MODES)
    assert rel_err(o_unit, o_default) > 0.1
    assert rel_err(o_signed, o_unit) > 0.1
    assert rel_err(s_signed["z"], s_unit["z"]) > 0.1  # z accumulates φ(k): signed keys in "identity"
    assert_close(s_unit["z"], s_default["z"], 1e-12, "z does not depend on the read-out")
    for s in (s_unit, s_signed):
        assert {n: t.shape for n, t in s.items()} == {n: t.shape for n, t in s_default.items()}


def test_signed_keys_with_the_normalized_readout_are_refused():
    x = make_inputs()
    with pytest.raises(ValueError, match=r"feature_map='identity'.*readout='normalized'"):
        ops.vla(*x.values(), feature_map="identity", readout="normalized")
    with pytest.raises(ValueError, match="feature_map must be one of"):
        ops.vla(*x.values(), feature_map="relu")
    with pytest.raises(ValueError, match="readout must be one of"):
        ops.vla(*x.values(), readout="plain")


# ----------------------------------------------------------------------------- op: Triton (interpreter)


def as_float32(x, state):
    x32 = {n: t.detach().float().requires_grad_(True) for n, t in x.items()}
    return x32, {n: (t.float() if t.is_floating_point() else t) for n, t in state.items()}


@needs_interp
@each_new_mode
def test_interp_triton_matches_the_reference(feature_map, readout):
    x, mask, state = make_inputs(), ragged_mask(), random_state()
    want = forward_and_grads(lambda: reference(x, mask, state, feature_map, readout), x)
    x32, state32 = as_float32(x, state)
    got = forward_and_grads(lambda: run_op(x32, mask, state32, feature_map, readout, "triton", chunk_size=16), x32)
    assert got[0].dtype == torch.float32
    assert_matches(got, want, 1e-4)


@needs_interp
@each_new_mode
def test_interp_triton_decode_matches_the_reference(feature_map, readout):
    # a few tokens, no autograd, against a carried state: the fused recurrent S update reads with q̂
    x, state = make_inputs(seed=3), random_state()
    x = {n: t.detach()[:, :3] for n, t in x.items()}
    mask = torch.tensor([[True, True, True], [False, True, True]])
    with torch.no_grad():
        want_o, want_s = reference(x, mask, state, feature_map, readout)
        x32, state32 = as_float32(x, state)
        o, s = run_op(x32, mask, state32, feature_map, readout, "triton", chunk_size=16)
    assert_close(o, want_o.float(), 1e-5, "decode output")
    assert_state_close({n: t.double() if t.is_floating_point() else t for n, t in s.items()}, want_s, 1e-5,
                       "decode state")


# ----------------------------------------------------------------------------- mixer and model
def test_the_mixer_passes_the_options_to_the_op():
    config = AutoConfig.for_model("lazoo_vla", hidden_size=16, num_attention_heads=2, feature_map="identity",
                                  readout="unit_query", refresh_period=5)
    torch.manual_seed(0)
    mixer = mixer_class("vla")(config, 0, {**config.mixer_options("vla"), "backend": "recurrent"}).double()
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 13, 2, 8, generator=gen, dtype=F64) for _ in range(3))
    got, _ = mixer.mix(q, k, v, None, mask=None, state=None, want_state=False)
    u = torch.einsum("bthd,hed->bthe", k, mixer.u_weight)
    d = mixer.head_dim  # penalty_norm="unit": λ₀ / d and η · d (the test below)
    kw = dict(lambda0=0.1 / d, refresh_period=5, refresh_eta=1e-3 * d, eps=1e-4, backend="recurrent")
    expected, _ = ops.vla(q, k, v, u, feature_map="identity", readout="unit_query", **kw)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert rel_err(got, ops.vla(q, k, v, u, **kw)[0]) > 0.1


def test_a_model_with_signed_keys_and_unit_query_trains_and_generates_with_its_cache():
    ids = random_ids(2, 17, seed=5)
    model = tiny_model("vla", seed=1, eval=False, feature_map="identity", readout="unit_query")
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().max() > 0 for n, g in grads.items() if "u_weight" in n)
    with torch.no_grad():
        default_logits = tiny_model("vla", seed=1)(ids).logits
        model.eval()
        assert rel_err(model(ids).logits, default_logits) > 1e-3
        cached = model.generate(ids, max_new_tokens=5, do_sample=False)
        uncached = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_the_options_survive_save_and_load(tmp_path):
    ids = random_ids(2, 15, seed=6)
    model = tiny_model("vla", seed=2, feature_map="identity", readout="unit_query")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.feature_map, loaded.config.readout) == ("identity", "unit_query")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_without_precision_updates_vla_is_the_delta_rule_with_unit_beta():
    # precision_update=False zeroes u: A stays A₀ ∝ I, so α̂ = k̂ and S ← S + (v − S k̂) k̂ᵀ (β = 1)
    config = AutoConfig.for_model("lazoo_vla", hidden_size=16, num_attention_heads=2, feature_map="identity",
                                  readout="unit_query", refresh_period=5, refresh_eta=0.3, precision_update=False)
    torch.manual_seed(0)
    mixer = mixer_class("vla")(config, 0, {**config.mixer_options("vla"), "backend": "recurrent"}).double()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 13, 2, 8, generator=gen, dtype=F64) for _ in range(3))
    got, _ = mixer.mix(q, k, v, None, mask=None, state=None, want_state=False)
    beta = torch.ones(2, 13, 2, dtype=F64)
    expected, _ = ops.delta_rule(q, k, v, beta, scale=1.0, use_qk_l2norm=True, backend="recurrent")
    # (the delta rule's l2 norm has its own ε inside the root: 1e-6 relative here, not rounding)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    mixer.options["precision_update"] = True  # the A geometry does change the output
    assert rel_err(mixer.mix(q, k, v, None, mask=None, state=None, want_state=False)[0], expected) > 1e-3


def test_penalty_norm_unit_is_algorithm1_with_lambda0_over_d_and_eta_times_d():
    """The mixer's `penalty_norm="unit"` (the paper's eq. (8), the default) runs the op with λ₀ / d and η · d, the
    same recurrence as unit û (tests/ops/test_ops_vla.py checks that against the token loop); "algorithm1" runs
    Algorithm 1's û = u / ‖u‖ / √d as it is; they differ, and an unknown value is refused by name."""
    torch.manual_seed(0)
    kwargs = dict(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=50, intermediate_size=32,
                  refresh_period=5, refresh_eta=0.01)
    unit = AutoModelForCausalLM.from_config(AutoConfig.for_model("lazoo_vla", **kwargs)).double().eval()
    assert unit.config.penalty_norm == "unit"
    d = unit.model.layers[0].mixer.head_dim
    literal = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "lazoo_vla", **{**kwargs, "refresh_eta": 0.01 * d}, lambda0=0.1 / d, penalty_norm="algorithm1")).double().eval()
    literal.load_state_dict(unit.state_dict())
    paper = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "lazoo_vla", **kwargs, penalty_norm="algorithm1")).double().eval()
    paper.load_state_dict(unit.state_dict())
    ids = random_ids(2, 30, seed=0, high=50)
    with torch.no_grad():
        a, b, c = (m(ids).logits for m in (unit, literal, paper))
    assert_close(a, b, 1e-10, "unit penalty directions vs Algorithm 1 with lambda0 / d, eta * d")
    assert rel_err(a, c) > 1e-4
    with pytest.raises(ValueError, match="penalty_norm"):
        AutoModelForCausalLM.from_config(AutoConfig.for_model("lazoo_vla", **kwargs, penalty_norm="sqrt"))
