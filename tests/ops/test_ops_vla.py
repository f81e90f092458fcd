"""VLA op: Algorithm 1 of "Variational Linear Attention: Stable Associative Memory for Long-Context Transformers"
(Pandey and Singh 2026) transcribed per token, recurrent vs chunk (Woodbury + WY)."""

import math

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, compare_backends, left_pad_mask

from lazoo.ops import vla

F64 = torch.float64
B, H, DK, DV = 3, 2, 6, 5


def make_inputs(T, dtype=F64, b=B, seed=0):
    torch.manual_seed(seed)
    q, k, u = (torch.randn(b, T, H, DK, dtype=dtype) for _ in range(3))
    v = torch.randn(b, T, H, DV, dtype=dtype)
    return q, k, v, u


def random_state(b=B, t0=(7, 19, 0), dtype=F64, lambda0=0.1):
    """S, z random; A = I/λ0 + a small random SPD part; per-sample step counts t0."""
    M = torch.randn(b, H, DK, DK, dtype=dtype)
    return {
        "S": torch.randn(b, H, DV, DK, dtype=dtype),
        "A": torch.eye(DK, dtype=dtype) / lambda0 + 0.3 * M @ M.transpose(-1, -2) / DK,
        "z": torch.rand(b, H, DK, dtype=dtype) * 3,
        "t": torch.tensor(list(t0)[:b], dtype=torch.int64),
    }


# ----------------------------------------------------------------------------- Algorithm 1
def algorithm1(q, k, v, u, S, A, z, t, lambda0=0.1, eps=1e-4, period=20, eta=1e-3, unit_u=False):
    """The VLA paper's Algorithm 1 for one head, batch 1, token by token (q, k, u [T, dh], v [T, dv]); with
    ``unit_u`` the penalty directions are unit vectors as the paper's eq. (8) writes them, not / √dh (line 10)."""
    dh = k.shape[-1]
    outs = []
    for i in range(k.shape[0]):
        k_raw = k[i]
        k_feat = F.elu(k_raw) + 1
        k_hat = k_feat / torch.linalg.norm(k_feat)
        wu = u[i]  # W_u k_raw, already projected
        uu = wu / torch.linalg.norm(wu) / (1 if unit_u else math.sqrt(dh))
        # Sherman-Morrison update for A_t
        z_sm = A @ uu
        delta = max(1 + uu @ z_sm, eps)
        A = A - torch.outer(z_sm, z_sm) / delta
        t = t + 1
        if t % period == 0:
            A = A + eta * torch.eye(dh, dtype=A.dtype)
        # residual S update
        alpha = A @ k_hat
        alpha_hat = alpha / torch.linalg.norm(alpha)
        e = v[i] - S @ k_hat
        S = S + torch.outer(e, alpha_hat)
        # output
        qf = F.elu(q[i]) + 1
        z = z + k_feat
        outs.append(S @ qf / max(z @ qf, eps))
    return torch.stack(outs), S, A, z, t


def algorithm1_batch(q, k, v, u, state, lambda0=0.1, **hp):
    """Run ``algorithm1`` on every sample and head separately; returns (o, final state)."""
    b_, T = q.shape[:2]
    o = torch.zeros(b_, T, H, DV, dtype=q.dtype)
    final = {"S": torch.zeros(b_, H, DV, DK, dtype=q.dtype), "A": torch.zeros(b_, H, DK, DK, dtype=q.dtype),
             "z": torch.zeros(b_, H, DK, dtype=q.dtype), "t": torch.zeros(b_, dtype=torch.int64)}
    for b in range(b_):
        for h in range(H):
            if state is None:
                S0, A0 = torch.zeros(DV, DK, dtype=q.dtype), torch.eye(DK, dtype=q.dtype) / lambda0
                z0, t0 = torch.zeros(DK, dtype=q.dtype), 0
            else:
                S0, A0, z0, t0 = state["S"][b, h], state["A"][b, h], state["z"][b, h], int(state["t"][b])
            ob, S, A, z, t = algorithm1(q[b, :, h], k[b, :, h], v[b, :, h], u[b, :, h], S0, A0, z0, t0,
                                        lambda0=lambda0, **hp)
            o[b, :, h], final["S"][b, h], final["A"][b, h], final["z"][b, h] = ob, S, A, z
            final["t"][b] = t
    return o, final


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_unit_penalty_directions_are_the_op_with_lambda0_over_dh_and_eta_times_dh(backend):
    """eq. (8)'s unit u (M = λ0 I + Σ û ûᵀ) is Algorithm 1's û / √dh with λ0 / dh and η · dh: A scales by dh, and
    α̂ = A k̂ / |A k̂| and δ do not see the scale (experiments/mqar.py's ``vla_eq8`` runs it so)."""
    q, k, v, u = make_inputs(45, b=1)
    lambda0, eta = 0.1, 1e-3
    o_ref, s_ref = algorithm1_batch(q, k, v, u, None, lambda0=lambda0, eta=eta, unit_u=True)
    o, s = vla(q, k, v, u, lambda0=lambda0 / DK, refresh_eta=eta * DK, output_final_state=True, backend=backend,
               chunk_size=16)
    assert_close(o, o_ref, 1e-10, "output vs Algorithm 1 with unit u")
    assert_close(s["A"], DK * s_ref["A"], 1e-10, "A vs dh · A of Algorithm 1 with unit u")
    o_literal = vla(q, k, v, u, backend=backend, chunk_size=16)[0]
    assert (o_literal - o).abs().max() > 1e-3  # the two readings differ


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("with_state", [False, True])
def test_vla_equals_paper_algorithm1_step_by_step(backend, with_state):
    # T = 45 crosses the refreshes at steps 20 and 40 (from t0 = 7: at tokens 13 and 33).
    q, k, v, u = make_inputs(45, b=2)
    state = random_state(b=2, t0=(7, 0)) if with_state else None
    o_ref, s_ref = algorithm1_batch(q, k, v, u, state)
    o, s = vla(q, k, v, u, initial_state=state, output_final_state=True, backend=backend, chunk_size=16)
    assert_close(o, o_ref, 1e-10, "output vs Algorithm 1")
    assert_state_close(s, s_ref, 1e-10, "final state vs Algorithm 1")


def test_vla_refresh_changes_the_result():
    # Guards the transcription test: without the refresh the outputs must differ.
    q, k, v, u = make_inputs(45, b=1)
    o_ref, _ = algorithm1_batch(q, k, v, u, None)
    o_norefresh, _ = vla(q, k, v, u, refresh_period=0, backend="recurrent")
    # Time is 1-based: the first refresh follows the 20th token (index 19).
    assert (o_ref - o_norefresh)[:, 19].abs().min() > 1e-9
    assert_close(o_norefresh[:, :19], o_ref[:, :19], 1e-12, "before the first refresh")


# ----------------------------------------------------------------------------- chunk vs recurrent
@pytest.mark.parametrize("T", [37, 1])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("period", [20, 7, 0])
def test_vla_chunk_matches_recurrent_with_grads(T, padded, period):
    q, k, v, u = make_inputs(T)
    state = random_state()
    mask = left_pad_mask([T, max(T - 5, 0), max(T - 11, 0)], T, holes=[(0, T // 2)]) if padded else None
    leaves = {"q": q, "k": k, "v": v, "u": u, "S0": state["S"], "A0": state["A"], "z0": state["z"]}
    for x in leaves.values():
        x.requires_grad_(True)

    def run(backend):
        return vla(q, k, v, u, initial_state=state, output_final_state=True, mask=mask,
                   refresh_period=period, chunk_size=16, backend=backend)

    compare_backends(run, leaves, rtol=1e-10)


def test_vla_chunk_size_larger_than_period_and_sequence():
    q, k, v, u = make_inputs(37)
    state = random_state()
    o1, s1 = vla(q, k, v, u, initial_state=state, output_final_state=True, chunk_size=64, backend="chunk")
    o2, s2 = vla(q, k, v, u, initial_state=state, output_final_state=True, backend="recurrent")
    assert_close(o1, o2, 1e-10, "output")
    assert_state_close(s1, s2, 1e-10, "state")


@pytest.mark.parametrize("period", [16, 8])
def test_vla_refresh_at_chunk_ends(period):
    # From t = 0 without pads every refresh falls on the last token of an A-chunk (no pass 2).
    q, k, v, u = make_inputs(37)
    kw = dict(output_final_state=True, chunk_size=16, refresh_period=period)
    o1, s1 = vla(q, k, v, u, backend="chunk", **kw)
    o2, s2 = vla(q, k, v, u, backend="recurrent", **kw)
    assert_close(o1, o2, 1e-10, "output")
    assert_state_close(s1, s2, 1e-10, "state")


def test_vla_default_state_and_step_count():
    q, k, v, u = make_inputs(9)
    mask = left_pad_mask([9, 4, 0], 9)
    _, s = vla(q, k, v, u, mask=mask, output_final_state=True)
    assert s["t"].tolist() == [9, 4, 0]
    # A fully padded sample keeps the default state: S = 0, A = I / λ0, z = 0.
    assert torch.equal(s["S"][2], torch.zeros(H, DV, DK, dtype=F64))
    assert torch.equal(s["A"][2], (torch.eye(DK, dtype=F64) / 0.1).expand(H, DK, DK))
    assert s["S"][0].abs().max() > 0


# ----------------------------------------------------------------------------- padding, splitting
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_vla_left_padded_batch_equals_samples_one_by_one(backend):
    T, lengths = 30, [30, 22, 9]
    q, k, v, u = make_inputs(T)
    state = random_state()
    mask = left_pad_mask(lengths, T)
    o, s = vla(q, k, v, u, mask=mask, initial_state=state, output_final_state=True,
               backend=backend, chunk_size=8)
    assert torch.all(o[~mask] == 0)
    for b, n in enumerate(lengths):
        one = {key: x[b:b + 1] for key, x in state.items()}
        ob, sb = vla(q[b:b + 1, T - n:], k[b:b + 1, T - n:], v[b:b + 1, T - n:], u[b:b + 1, T - n:],
                     initial_state=one, output_final_state=True, backend=backend, chunk_size=8)
        assert_close(o[b:b + 1, T - n:], ob, 1e-10, f"sample {b} output")
        assert_state_close({key: x[b:b + 1] for key, x in s.items()}, sb, 1e-10, f"sample {b} state")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_vla_split_sequence_equals_one_pass(backend):
    T, cut = 41, 13  # the refresh at step 20 falls in the second part
    q, k, v, u = make_inputs(T)
    mask = left_pad_mask([T, T - 3, T - 17], T)
    kw = dict(output_final_state=True, backend=backend, chunk_size=16)
    o, s = vla(q, k, v, u, mask=mask, **kw)
    o1, s1 = vla(q[:, :cut], k[:, :cut], v[:, :cut], u[:, :cut], mask=mask[:, :cut], **kw)
    o2, s2 = vla(q[:, cut:], k[:, cut:], v[:, cut:], u[:, cut:], mask=mask[:, cut:], initial_state=s1, **kw)
    assert_close(torch.cat([o1, o2], 1), o, 1e-10, "split output")
    assert_state_close(s2, s, 1e-10, "split final state")


# ----------------------------------------------------------------------------- dtypes
def test_vla_float32_close_to_float64():
    q, k, v, u = make_inputs(37)
    state = random_state()
    mask = left_pad_mask([37, 30, 20], 37)
    ref, s_ref = vla(q, k, v, u, initial_state=state, mask=mask, output_final_state=True, backend="recurrent")
    st32 = {key: (x.float() if x.is_floating_point() else x) for key, x in state.items()}
    for backend in ("chunk", "recurrent"):
        o, s = vla(q.float(), k.float(), v.float(), u.float(), initial_state=st32, mask=mask,
                   output_final_state=True, backend=backend, chunk_size=16)
        assert o.dtype == torch.float32 and s["S"].dtype == torch.float32
        assert_close(o, ref, 1e-4, f"fp32 {backend} output")
        assert_state_close(s, s_ref, 1e-4, f"fp32 {backend} state")


def test_vla_bfloat16_output_dtype_and_fp32_state():
    q, k, v, u = make_inputs(10, dtype=torch.bfloat16)
    o, s = vla(q, k, v, u, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s["A"].dtype == torch.float32 and s["t"].dtype == torch.int64
    assert torch.isfinite(o.float()).all()


def test_vla_bad_inputs():
    q, k, v, u = make_inputs(5)
    with pytest.raises(ValueError, match="u must have shape"):
        vla(q, k, v, u[..., :-1])
    with pytest.raises(ValueError, match=r"initial_state\['A'\]"):
        bad = random_state()
        bad["A"] = bad["A"][..., :-1]
        vla(q, k, v, u, initial_state=bad)
    with pytest.raises(ValueError, match=r"initial_state\['t'\]"):
        bad = random_state()
        bad["t"] = bad["t"].double()
        vla(q, k, v, u, initial_state=bad)
    with pytest.raises(ValueError, match="keys"):
        vla(q, k, v, u, initial_state={"S": random_state()["S"]})
