"""Titans neural memory (Behrouz, Zhong, Mirrokni 2024, "Titans: Learning to Memorize at Test Time").

Memory: a linear map per head, M ``[dv, dk]`` (the 2-layer MLP memory of the paper is not built here), trained
while reading by gradient steps with momentum ("surprise") and forgetting on ``ℓ_t(M) = ½ ‖M k_t − v_t‖²``:

    S_t = η_t S_{t−1} − θ_t ∇ℓ_t(M_g),     M_t = (1 − α_t) M_{t−1} + S_t,     o_t = M_t q_t

with data-dependent η_t (momentum) and α_t (forgetting) in [0, 1], θ_t (inner learning rate) ≥ 0, each
``[B, T, H]`` (the op does not squash them, the mixer does; η and α outside [0, 1] at a real token are refused:
the chunk form takes their logs), and ∇ℓ_t(M) = (M k_t − v_t) k_tᵀ.

Mini-batch form (as in the paper's parallel training, §3.2): the real tokens are split into consecutive
mini-batches of b = ``mini_batch_size`` tokens, and every gradient of a mini-batch is taken at the memory
M_g = M_{t'} the mini-batch started from (t' = last token of the previous mini-batch). The momentum and decay
recurrences themselves are exact, token by token, inside the mini-batch. With b = 1, M_g = M_{t−1}: the
per-token recurrence above. Both backends compute the same function for the same b:

  * "recurrent": a literal per-token loop (float64-capable reference) keeping M, S and M_{t'}.
  * "chunk": one mini-batch per chunk, the two linear recurrences solved in closed form inside it with
    cumulative log-products (a_t = Π η, d_t = Π (1 − α)); with e_r = M_g k_r − v_r:
        S_t = a_t S_0 − Σ_{r≤t} (a_t/a_r) θ_r e_r k_rᵀ,
        M_t = d_t M_0 + c_t S_0 − Σ_{r≤t} K_{tr} θ_r e_r k_rᵀ,   c_t = Σ_{s≤t} (d_t/d_s) a_s,
        K_{tr} = Σ_{r≤s≤t} (d_t/d_s)(a_s/a_r)   (a product of two causal decay matrices),
    so o_t = d_t M_0 q_t + c_t S_0 q_t − Σ_{r≤t} K_{tr} θ_r (k_r·q_t) e_r.

State: ``{"M", "S", "M_start", "n"}`` (memory, momentum, the memory the current mini-batch started from, real
tokens already in it ``[B]`` int64). An initial state may hold only M (and S): a fresh mini-batch, S = 0 if
absent. Default: M = 0, S = 0. A pad (mask ``[B, T]``) changes nothing and outputs 0. No Triton kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .backend import resolve_backend
from .boundary import op_result, prepare_inputs
from .checks import check_positive_int, check_range
from .dtypes import compute_dtype, without_autocast
from .ttt import mini_batch_chunked, mini_batch_recurrent, mini_batch_state

__all__ = ["titans"]


@without_autocast
def titans(q, k, v, theta, eta, alpha, *, mini_batch_size: int = 16, initial_state=None,
           output_final_state: bool = False, mask=None, backend: str | None = None):
    """Titans' linear neural memory with momentum and forgetting (see the module docstring).

    q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``; theta (learning rate), eta (momentum), alpha (forgetting)
    ``[B, T, H]``. Returns ``(o [B, T, H, dv], state or None)``."""
    op = "titans"
    # a NaN at a pad meets no real token
    (B, T, H, dk, dv), mask, (q, k, v, theta, eta, alpha) = prepare_inputs(
        op, q, k, v, mask, {"theta": theta, "eta": eta, "alpha": alpha})
    b = check_positive_int(op, "mini_batch_size", mini_batch_size)
    cdt = compute_dtype(q.dtype)
    zeros = torch.zeros(B, H, dv, dk, dtype=cdt, device=q.device)
    if initial_state is None:
        initial_state = {"M": zeros}
    if isinstance(initial_state, Mapping) and "S" not in initial_state:
        initial_state = {**initial_state, "S": zeros}
    shapes = {"M": (B, H, dv, dk), "S": (B, H, dv, dk)}
    state = mini_batch_state(op, initial_state, shapes, B, q.device, cdt, b, extra=("S",))
    mode = resolve_backend(op, backend, q.device)
    check_range(op, "eta", eta, 0.0, 1.0)  # the value checks (a host sync each) after the cheap ones
    check_range(op, "alpha", alpha, 0.0, 1.0)
    out_dtype = v.dtype
    q, k, v, theta, eta, alpha = (x.to(cdt) for x in (q, k, v, theta, eta, alpha))
    scalars = (theta, eta, alpha)
    if mode == "recurrent":
        o, final = mini_batch_recurrent(_titans_step, q, k, v, scalars, state, ("M", "S"), mask, b, n_grad=1)
    else:
        o, final = mini_batch_chunked(_titans_chunk, q, k, v, scalars, (0.0, 1.0, 0.0), state, ("M", "S"), mask,
                                      b, output_final_state, n_grad=1)
    return op_result(o, mask, out_dtype, final, output_final_state)


def _titans_step(W, Wg, q_t, k_t, v_t, scalars):
    theta, eta, alpha = (s[..., None, None] for s in scalars)
    (M, S), (Mg,) = W, Wg
    e = torch.einsum("bhvk,bhk->bhv", Mg, k_t) - v_t
    S = eta * S - theta * e[..., :, None] * k_t[..., None, :]
    M = (1 - alpha) * M + S
    return (M, S), torch.einsum("bhvk,bhk->bhv", M, q_t)


def _decay_matrix(lg):
    """``D[t, s] = exp(lg_t − lg_s)`` for s ≤ t, else 0 (lg ``[..., C]`` cumulative log products)."""
    C = lg.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=lg.device).tril()
    diff = (lg[..., :, None] - lg[..., None, :]).masked_fill(~causal, float("-inf"))
    return diff.exp()


def _titans_chunk(W0, Wg, q, k, v, scalars, valid):
    """One mini-batch in closed form (see the module docstring); ``valid`` ``[B, H, C]`` marks real slots (an
    empty slot has θ = 0, η = 1, α = 0 and adds no S to M)."""
    theta, eta, alpha = scalars
    (M0, S0), (Mg,) = W0, Wg
    u = valid.to(q.dtype)
    fi = torch.finfo(q.dtype)  # the clamps keep the logs finite (η = 0 or α = 1 underflowed), nothing else
    la = torch.log(eta.clamp_min(fi.tiny)).cumsum(-1)  # log a_t
    ld = torch.log1p(-alpha.clamp_max(1 - fi.eps)).cumsum(-1)  # log d_t
    Da, Dd = _decay_matrix(la), _decay_matrix(ld)  # [B, H, C, C]
    a = la.exp()
    K = (Dd * u[..., None, :]) @ Da  # K[t, r] = Σ_{r≤s≤t} (d_t/d_s) u_s (a_s/a_r)
    c = ((Dd * u[..., None, :]) @ a[..., None]).squeeze(-1)  # c_t = Σ_{s≤t} (d_t/d_s) u_s a_s
    e = k @ Mg.transpose(-1, -2) - v  # [B, H, C, dv]
    te = theta[..., None] * e  # θ_r e_r
    QK = q @ k.transpose(-1, -2)
    o = (ld.exp()[..., None] * (q @ M0.transpose(-1, -2)) + c[..., None] * (q @ S0.transpose(-1, -2))
         - (K * QK) @ te)
    M = (ld[..., -1].exp()[..., None, None] * M0 + c[..., -1, None, None] * S0
         - (K[..., -1, :, None] * te).transpose(-1, -2) @ k)
    S = a[..., -1, None, None] * S0 - (Da[..., -1, :, None] * te).transpose(-1, -2) @ k
    return (M, S), o

