"""RLS / Mesa layer (eq. 11 of Wang et al. 2025, "Test-time regression: a unifying framework for designing sequence
models with associative memory", weighted version): the closed form S_t = VK_t (KK_t + λI)^{-1} at every t in
float64 vs the Sherman–Morrison / per-token-solve reference and the Woodbury / batched-solve chunk form, for γ = 1
and γ < 1, ragged T; gradients (λ included); state carry-over; padding."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, assert_state_close, compare_backends, left_pad_mask

from lazoo.ops import rls

F64 = torch.float64
B, H, D, DV = 2, 2, 5, 4


def make(T, b=B, seed=0, dtype=F64, grad=False, normalize=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(b, T, H, D, generator=g, dtype=dtype)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(b, T, H, DV, generator=g, dtype=dtype)
    lam = torch.tensor([0.3, 1.7], dtype=dtype)
    if grad:
        for x in (q, k, v, lam):
            x.requires_grad_()
    return q, k, v, lam


def closed_form(q, k, v, lam, gamma, mask=None):
    """o_t = S_t q_t with S_t = argmin Σ_{i≤t} γ^{t−i}‖v_i − S k_i‖² + λ‖S‖², built from scratch at every real t
    (the normal equations S (Σ w k kᵀ + λI) = Σ w v kᵀ, one independent solve per t, t counting real tokens)."""
    b_, T = q.shape[:2]
    mask = torch.ones(b_, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for b in range(b_):
        idx = [t for t in range(T) if mask[b, t]]
        for n, t in enumerate(idx):
            w = torch.tensor([gamma ** (n - m) for m in range(n + 1)], dtype=q.dtype)
            K, V = k[b, idx[: n + 1]], v[b, idx[: n + 1]]  # [n+1, H, d]
            A = torch.einsum("i,iha,ihc->hac", w, K, K) + lam[:, None, None] * torch.eye(D, dtype=q.dtype)
            VK = torch.einsum("i,ihv,ihc->hvc", w, V, K)
            S = torch.linalg.solve(A, VK, left=False)  # S A = VK
            out[b, t] = (S @ q[b, t, :, :, None])[..., 0]
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.85])
@pytest.mark.parametrize("T,C", [(1, 4), (13, 4), (23, 8)])
def test_both_forms_equal_the_closed_form_at_every_t(gamma, T, C):
    q, k, v, lam = make(T, seed=T, normalize=False)  # raw (unnormalised) q, k: the op uses them as given
    ref = closed_form(q, k, v, lam, gamma)
    for backend in ("recurrent", "chunk"):
        o, _ = rls(q, k, v, lam=lam, gamma=gamma, chunk_size=C, backend=backend)
        assert_close(o, ref, 1e-6, f"{backend} γ={gamma} vs closed form")
        assert_close(o, ref, 1e-12, f"{backend} γ={gamma} vs closed form (measured bound)")


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_backends_agree_on_outputs_states_and_all_gradients(gamma):
    q, k, v, lam = make(19, seed=3, grad=True)
    leaves = {"q": q, "k": k, "v": v, "lam": lam}
    compare_backends(lambda be: rls(q, k, v, lam=lam, gamma=gamma, chunk_size=6, output_final_state=True,
                                    backend=be), leaves, 1e-10)


def test_gradients_match_finite_differences_in_lambda():
    q, k, v, lam = make(9, seed=4)
    w = torch.randn(B, 9, H, DV, dtype=F64, generator=torch.Generator().manual_seed(9))
    for backend, gamma in (("chunk", 1.0), ("recurrent", 1.0), ("chunk", 0.7)):
        lam_ = lam.clone().requires_grad_()
        (g,) = torch.autograd.grad((rls(q, k, v, lam=lam_, gamma=gamma, chunk_size=4, backend=backend)[0] * w).sum(),
                                   lam_)
        eps = 1e-6
        for h in range(H):
            d = torch.zeros(H, dtype=F64)
            d[h] = eps
            f = [(rls(q, k, v, lam=lam + s * d, gamma=gamma, chunk_size=4, backend=backend)[0] * w).sum()
                 for s in (1, -1)]
            assert abs((f[0] - f[1]).item() / (2 * eps) - g[h].item()) < 1e-6 * max(1.0, abs(g[h].item()))


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_state_carry_over_split_equals_whole(gamma):
    q, k, v, lam = make(21, seed=5)
    whole, s_whole = rls(q, k, v, lam=lam, gamma=gamma, chunk_size=4, output_final_state=True, backend="chunk")
    state, outs = None, []
    for (a, b), backend in zip(((0, 7), (7, 8), (8, 21)), ("chunk", "recurrent", "chunk")):
        o, state = rls(q[:, a:b], k[:, a:b], v[:, a:b], lam=lam, gamma=gamma, chunk_size=4, initial_state=state,
                       output_final_state=True, backend=backend)
        outs.append(o)
    assert_close(torch.cat(outs, 1), whole, 1e-12, "split vs whole")
    assert_state_close(state, s_whole, 1e-12, "final state")
    # the state is the ridge-free moments: a different λ continues exactly from the same state
    o2, _ = rls(q[:, 7:], k[:, 7:], v[:, 7:], lam=2 * lam, gamma=gamma, initial_state=rls(
        q[:, :7], k[:, :7], v[:, :7], lam=lam, gamma=gamma, output_final_state=True)[1], backend="recurrent")
    assert_close(o2, closed_form(q, k, v, 2 * lam, gamma)[:, 7:], 1e-10, "state reused with another λ")


@pytest.mark.parametrize("gamma", [1.0, 0.75])
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_pads_change_nothing(gamma, backend):
    T = 17
    q, k, v, lam = make(T, seed=6)
    mask = left_pad_mask([17, 11], T, holes=[(1, 9), (0, 3)])
    o, st = rls(q, k, v, lam=lam, gamma=gamma, chunk_size=5, mask=mask, output_final_state=True, backend=backend)
    assert_close(o, closed_form(q, k, v, lam, gamma, mask), 1e-10, "padded vs closed form")
    assert (o[~mask] == 0).all()
    for b in range(B):
        r = mask[b]
        alone, s_alone = rls(q[b:b + 1, r], k[b:b + 1, r], v[b:b + 1, r], lam=lam, gamma=gamma, chunk_size=5,
                             output_final_state=True, backend=backend)
        assert_close(o[b:b + 1, r], alone, 1e-12, f"sample {b} alone")
        assert_state_close({n: x[b:b + 1] for n, x in st.items()}, s_alone, 1e-12, f"sample {b} state")


def test_float32_chunk_is_close_to_the_float64_reference():
    q, k, v, lam = make(70, seed=7)
    ref, _ = rls(q, k, v, lam=lam, backend="recurrent")
    o, _ = rls(q.float(), k.float(), v.float(), lam=lam.float(), chunk_size=16, backend="chunk")
    assert o.dtype == torch.float32
    assert_close(o, ref, 1e-4, "fp32 chunk vs fp64")


def test_bad_arguments_are_named():
    q, k, v, lam = make(3)
    with pytest.raises(ValueError, match="lam"):
        rls(q, k, v, lam=0.0)
    with pytest.raises(ValueError, match="gamma"):
        rls(q, k, v, lam=1.0, gamma=1.5)
    with pytest.raises(ValueError, match=r"lam.*\[H\]"):
        rls(q, k, v, lam=torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match="keys"):
        rls(q, k, v, lam=1.0, initial_state={"S": torch.zeros(B, H, DV, D)})
    with pytest.raises(NotImplementedError, match="gamma"):
        rls(q, k, v, lam=1.0, gamma=0.5, backend="triton")
