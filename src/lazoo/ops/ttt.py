"""Test-time training layers (Sun et al. 2024, "Learning to (Learn at Test Time)"): TTT-Linear, TTT-MLP.

The state is the weights W of an inner model f, trained while the sequence is read by gradient steps on
the per-token loss ``ℓ_t(W) = ½ ‖f(k_t; W) − v_t‖²`` (k_t is the "corrupted view" x̃_t, v_t the target;
both come from learned projections in the mixer), with a learned per-token, per-head inner learning rate
η_t ``[B, T, H]``. The output is ``o_t = f(q_t; W_t)``, read with the weights *after* token t's update.

Inner models (per head):
  * ``ttt_linear``: ``f(x; W) = W x``, W ``[dv, dk]``; ∇ℓ = (W k − v) kᵀ.
  * ``ttt_mlp``: ``f(x; W1, W2) = W2 gelu(W1 x)`` (exact, erf GELU), W1 ``[dh, dk]``, W2 ``[dv, dh]``.
    No biases and no LayerNorm / residual inside f (TTT's optional "LN in f" is not built here).

Mini-batch gradient descent (TTT's "mini-batch TTT", size b = ``mini_batch_size``): the real tokens of a
sequence are split into consecutive mini-batches of b tokens (counted per sample from the sequence start;
pads do not count), and every gradient of a mini-batch is taken at the weights the mini-batch started from:

    W_t = W_{t'} − Σ_{s = t'+1..t} η_s ∇ℓ_s(W_{t'})      (t' = last token of the previous mini-batch)

So the output of token t sees the updates of all earlier tokens of its own mini-batch (and its own), but
their gradients were taken at W_{t'}. With b = 1 this is plain per-token gradient descent
``W_t = W_{t−1} − η_t ∇ℓ_t(W_{t−1})``; for b > 1 it is a *different function*, not an approximation of it.
Both backends compute this same function for the same b:

  * "recurrent": a literal per-token loop (float64-capable reference) that keeps W_{t'} and W_t.
  * "chunk": one mini-batch per chunk, in parallel with TTT's *dual form* (causal masked matrix products of
    q, k and the errors at W_{t'}; for the MLP two such products, one per layer), a loop over mini-batches.

State (a dict): ttt_linear ``{"W", "W_start", "n"}``, ttt_mlp ``{"W1", "W2", "W1_start", "W2_start", "n"}``:
current weights, the weights the current mini-batch started from (where its gradients are taken) and
``n`` ``[B]`` int64, the number of real tokens already in the current mini-batch (0 ≤ n < b). An initial
state may omit the ``*_start`` parts and ``n`` (= the start of a mini-batch): that is how the mixer passes its
learned initial weights W₀. ttt_linear's default initial state is W = 0; ttt_mlp needs one.
Padding (mask ``[B, T]``): a pad changes no part of the state and outputs 0, so a left-padded batch equals its
samples one by one. While torch.compile traces or a CUDA graph is captured (no host sync), the slot grid of the
real tokens is sized from shapes alone (``slot_grid``): its extra mini-batches are empty and change nothing.

Triton (``backend="triton"``, auto on CUDA): ``ttt_linear`` runs ``lazoo.kernels.ttt`` (the dual form per
mini-batch with a hand-written backward; b = 1 is the delta rule with β = η and runs the delta-rule kernels), with
masks and partial-mini-batch states through the same slot grid as the chunk form (``mini_batch_chunked``);
``ttt_mlp`` has no kernel. Titans (``lazoo.ops.titans``) runs the same two backends, ``mini_batch_recurrent`` and
``mini_batch_chunked``, on its own state (``mini_batch_state``).
Decoding: ``ttt_linear_decode_step`` / ``ttt_mlp_decode_step`` below, fused single-token steps in PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels.limits import KERNEL_DTYPES, TTT_MAX_HEAD_DIM, TTT_MAX_MINI_BATCH
from .backend import host_sync_allowed, resolve_backend, triton_unsupported
from .boundary import op_result, prepare_inputs, zero_masked
from .checks import check_float, check_positive_int
from .dtypes import compute_dtype, without_autocast
from .states import check_state_tensor

__all__ = ["ttt_linear", "ttt_linear_decode_step", "ttt_mlp", "ttt_mlp_decode_step"]


# ============================================================================ public ops
@without_autocast
def ttt_linear(q, k, v, eta, *, mini_batch_size: int = 16, initial_state=None, output_final_state: bool = False,
               mask=None, backend: str | None = None):
    """TTT-Linear (see the module docstring): ``f(x; W) = W x``, mini-batch GD with per-token rates ``eta``.

    q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, eta ``[B, T, H]``. Returns ``(o [B, T, H, dv], state or None)``."""
    op = "ttt_linear"
    # a NaN at a pad never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v, eta) = prepare_inputs(op, q, k, v, mask, {"eta": eta})
    b = check_positive_int(op, "mini_batch_size", mini_batch_size)
    cdt = compute_dtype(q.dtype)
    shapes = {"W": (B, H, dv, dk)}
    if initial_state is None:
        initial_state = {"W": torch.zeros(B, H, dv, dk, dtype=cdt, device=q.device)}
    state = mini_batch_state(op, initial_state, shapes, B, q.device, cdt, b)
    mode = resolve_backend(op, backend, q.device, _linear_triton_unsupported(q, v, b, state))
    if mode == "triton":
        return _linear_triton(q, k, v, eta, state, b, mask, output_final_state)
    out_dtype = v.dtype
    q, k, v, eta = (x.to(cdt) for x in (q, k, v, eta))
    if mode == "recurrent":
        o, final = mini_batch_recurrent(_linear_step, q, k, v, (eta,), state, ("W",), mask, b)
    else:
        o, final = mini_batch_chunked(_linear_chunk, q, k, v, (eta,), (0.0,), state, ("W",), mask, b,
                                      output_final_state)
    return op_result(o, mask, out_dtype, final, output_final_state)


@without_autocast
def ttt_mlp(q, k, v, eta, *, mini_batch_size: int = 16, initial_state=None, output_final_state: bool = False,
            mask=None, backend: str | None = None):
    """TTT-MLP (see the module docstring): ``f(x) = W2 gelu(W1 x)``, mini-batch GD with per-token rates ``eta``.

    ``initial_state`` is required: a dict with ``W1 [B, H, dh, dk]`` and ``W2 [B, H, dv, dh]`` (optionally the
    ``*_start`` parts and ``n``). Returns ``(o [B, T, H, dv], state or None)``."""
    op = "ttt_mlp"
    # a NaN at a pad never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v, eta) = prepare_inputs(op, q, k, v, mask, {"eta": eta})
    b = check_positive_int(op, "mini_batch_size", mini_batch_size)
    cdt = compute_dtype(q.dtype)
    if not isinstance(initial_state, Mapping) or "W1" not in initial_state:
        raise ValueError(f"{op}: initial_state must be a dict with the inner MLP's weights W1 [B, H, dh, dk] and "
                         f"W2 [B, H, dv, dh] (there is no default: all-zero weights get no gradient)")
    W1 = initial_state["W1"]
    if not isinstance(W1, torch.Tensor) or W1.dim() != 4:
        raise TypeError(f"{op}: initial_state['W1'] must be a tensor [B, H, dh, dk]")
    dh = W1.shape[2]
    shapes = {"W1": (B, H, dh, dk), "W2": (B, H, dv, dh)}
    state = mini_batch_state(op, initial_state, shapes, B, q.device, cdt, b)
    mode = resolve_backend(op, backend, q.device)
    out_dtype = v.dtype
    q, k, v, eta = (x.to(cdt) for x in (q, k, v, eta))
    if mode == "recurrent":
        o, final = mini_batch_recurrent(_mlp_step, q, k, v, (eta,), state, ("W1", "W2"), mask, b)
    else:
        o, final = mini_batch_chunked(_mlp_chunk, q, k, v, (eta,), (0.0,), state, ("W1", "W2"), mask, b,
                                      output_final_state)
    return op_result(o, mask, out_dtype, final, output_final_state)


# ============================================================================ decode (one token, fused PyTorch)
def _advance(n, real, b):
    """Token count after one step: (new n, whether the mini-batch just filled)."""
    n = n + real.long()
    full = n == b
    return torch.where(full, torch.zeros_like(n), n), full


@torch.no_grad()
def ttt_linear_decode_step(q, k, v, eta, state, *, mini_batch_size: int, real=None):
    """One token of ``ttt_linear`` against a full state ``{"W", "W_start", "n"}`` (compute dtype): q/k
    ``[B, H, dk]``, v ``[B, H, dv]``, eta ``[B, H]``, ``real`` ``[B]`` bool (False = pad) or None.
    Returns ``(o [B, H, dv] in v's dtype, new state)``; no autograd (generation).

    A few batched products, no torch.compile: e = W_start k − v, W ← W − η e kᵀ, o = W q, and W_start ← W when
    the mini-batch fills. A pad changes nothing and outputs 0 (as the op)."""
    W, Wg, n = state["W"], state["W_start"], state["n"]
    out_dtype = v.dtype
    q, k, v, eta = (x.to(W.dtype) for x in (q, k, v, eta))
    e = torch.matmul(Wg, k.unsqueeze(-1)).squeeze(-1) - v
    W_new = torch.addcmul(W, (eta.unsqueeze(-1) * e).unsqueeze(-1), k.unsqueeze(-2), value=-1.0)
    o = torch.matmul(W_new, q.unsqueeze(-1)).squeeze(-1)
    if real is not None:
        W_new = _where(real, W_new, W)
        o = o * real.view(-1, 1, 1).to(o.dtype)
    else:
        real = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    n, full = _advance(n, real, mini_batch_size)
    return o.to(out_dtype), {"W": W_new, "W_start": _where(full, W_new, Wg), "n": n}


@torch.no_grad()
def ttt_mlp_decode_step(q, k, v, eta, state, *, mini_batch_size: int, real=None):
    """One token of ``ttt_mlp`` against a full state ``{"W1", "W2", "W1_start", "W2_start", "n"}``, as
    ``ttt_linear_decode_step`` (gradients at the start weights; exact GELU)."""
    W1, W2, W1g, W2g, n = state["W1"], state["W2"], state["W1_start"], state["W2_start"], state["n"]
    out_dtype = v.dtype
    q, k, v, eta = (x.to(W1.dtype) for x in (q, k, v, eta))
    z = torch.matmul(W1g, k.unsqueeze(-1)).squeeze(-1)  # [B, H, dh]
    a, da = gelu_and_grad(z)
    e = torch.matmul(W2g, a.unsqueeze(-1)).squeeze(-1) - v  # [B, H, dv]
    g = torch.matmul(e.unsqueeze(-2), W2g).squeeze(-2) * da  # dℓ/dz
    et = eta.unsqueeze(-1)
    W2n = torch.addcmul(W2, (et * e).unsqueeze(-1), a.unsqueeze(-2), value=-1.0)
    W1n = torch.addcmul(W1, (et * g).unsqueeze(-1), k.unsqueeze(-2), value=-1.0)
    hq = F.gelu(torch.matmul(W1n, q.unsqueeze(-1)).squeeze(-1))
    o = torch.matmul(W2n, hq.unsqueeze(-1)).squeeze(-1)
    if real is not None:
        W1n, W2n = _where(real, W1n, W1), _where(real, W2n, W2)
        o = o * real.view(-1, 1, 1).to(o.dtype)
    else:
        real = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    n, full = _advance(n, real, mini_batch_size)
    return o.to(out_dtype), {"W1": W1n, "W2": W2n, "W1_start": _where(full, W1n, W1g),
                             "W2_start": _where(full, W2n, W2g), "n": n}


# ============================================================================ Triton path (ttt_linear)
def _linear_triton_unsupported(q, v, b, state) -> str | None:
    """None when lazoo.kernels.ttt runs this case, else why not (imports no kernel)."""
    # float64: the interpreter only (the tests' exact check of the hand-written backward)
    ok = KERNEL_DTYPES + ((torch.float64,) if b > 1 and q.device.type == "cpu" else ())
    if b > TTT_MAX_MINI_BATCH:
        return f"the Triton kernel takes mini_batch_size up to {TTT_MAX_MINI_BATCH}, got {b}"
    if b == 1 and not state.get("_fresh", False) and not torch.equal(state["W_start"], state["W"]):
        return "with mini_batch_size=1 the Triton kernel (the delta rule) needs W_start = W in the initial state"
    return triton_unsupported(q, v, TTT_MAX_HEAD_DIM, ok)


def _linear_triton(q, k, v, eta, state, b, mask, output_final_state):
    """The op on lazoo.kernels.ttt. b = 1 (the delta rule): a pad is η = 0. b > 1 without padding from a fresh
    mini-batch: the inputs as they are; otherwise the real tokens go to the mini-batch-aligned slot grid of
    ``mini_batch_chunked`` (empty slots: η = 0, k = 0, no update) and mini-batch 0 takes its gradients at W_start."""
    from ..kernels.ttt import ttt_linear_triton  # lazy: importing defines the kernels

    B, T = q.shape[:2]
    dev = q.device
    if b == 1 or (mask is None and state.get("_fresh", False)):
        o, W, W_start = ttt_linear_triton(q, k, v, eta, state["W"], b)
        o = zero_masked(o, mask)
        n = torch.full((B,), 0 if b == 1 else T % b, dtype=torch.long, device=dev)
    else:
        real = torch.ones(B, T, dtype=torch.bool, device=dev) if mask is None else mask
        fresh = state.get("_fresh", False)
        grid = slot_grid(real, state["n"], b, fresh)
        idx = torch.div(grid.total, b, rounding_mode="floor")
        o, W, W_start = ttt_linear_triton(*(grid.to_slots(x) for x in (q, k, v, eta)), state["W"], b,
                                          W_start=None if fresh else state["W_start"], idx=idx)
        o = grid.from_slots(o)
        n = grid.total - idx * b
    if not output_final_state:
        return o, None
    return o, {"W": W, "W_start": W_start, "n": n}


# ============================================================================ inner models
def gelu_and_grad(z):
    """Exact (erf) GELU and its derivative Φ(z) + z φ(z)."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return z * cdf, cdf + z * pdf


def _linear_step(W, Wg, q_t, k_t, v_t, scalars):
    """One token of TTT-Linear: gradient at the mini-batch start Wg, applied to W; output f(q_t; W_new)."""
    (eta,) = scalars
    (W,), (Wg,) = W, Wg
    e = torch.einsum("bhvk,bhk->bhv", Wg, k_t) - v_t
    W = W - eta[..., None, None] * e[..., :, None] * k_t[..., None, :]
    return (W,), torch.einsum("bhvk,bhk->bhv", W, q_t)


def _mlp_step(W, Wg, q_t, k_t, v_t, scalars):
    (eta,) = scalars
    (W1, W2), (W1g, W2g) = W, Wg
    z = torch.einsum("bhnk,bhk->bhn", W1g, k_t)
    a, da = gelu_and_grad(z)
    e = torch.einsum("bhvn,bhn->bhv", W2g, a) - v_t
    g = torch.einsum("bhvn,bhv->bhn", W2g, e) * da  # dℓ/dz
    et = eta[..., None, None]
    W2 = W2 - et * e[..., :, None] * a[..., None, :]
    W1 = W1 - et * g[..., :, None] * k_t[..., None, :]
    h = F.gelu(torch.einsum("bhnk,bhk->bhn", W1, q_t))
    return (W1, W2), torch.einsum("bhvn,bhn->bhv", W2, h)


def _linear_chunk(W0, Wg, q, k, v, scalars, valid):
    """One mini-batch in the dual form. q/k ``[B, H, C, dk]``, v ``[B, H, C, dv]``, eta ``[B, H, C]``.

    W_t = W_0 − Σ_{s≤t} η_s e_s k_sᵀ with e_s = Wg k_s − v_s, so o_t = W_0 q_t − Σ_{s≤t} η_s (k_s·q_t) e_s."""
    (eta,) = scalars
    (W0,), (Wg,) = W0, Wg
    C = q.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    e = torch.einsum("bhvk,bhck->bhcv", Wg, k) - v
    ee = eta[..., None] * e  # η_s e_s
    A = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)
    o = q @ W0.transpose(-1, -2) - A @ ee
    W = W0 - ee.transpose(-1, -2) @ k
    return (W,), o


def _mlp_chunk(W0, Wg, q, k, v, scalars, valid):
    """One mini-batch of TTT-MLP in the dual form (two causal masked products, one per layer):

    z1_t = W1_0 q_t − Σ_{s≤t} η_s (k_s·q_t) g_s,   o_t = W2_0 a_t − Σ_{s≤t} η_s (h_s·a_t) e_s,   a_t = gelu(z1_t),
    with h_s = gelu(W1g k_s), e_s = W2g h_s − v_s, g_s = (W2gᵀ e_s) ⊙ gelu'(W1g k_s) (all at the start weights)."""
    (eta,) = scalars
    (W1_0, W2_0), (W1g, W2g) = W0, Wg
    C = q.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    z = k @ W1g.transpose(-1, -2)  # [B, H, C, dh]
    h, dh = gelu_and_grad(z)
    e = h @ W2g.transpose(-1, -2) - v  # [B, H, C, dv]
    g = (e @ W2g) * dh  # [B, H, C, dh]
    et = eta[..., None]
    A1 = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)
    a = F.gelu(q @ W1_0.transpose(-1, -2) - A1 @ (et * g))
    A2 = (a @ h.transpose(-1, -2)).masked_fill(~causal, 0)
    o = a @ W2_0.transpose(-1, -2) - A2 @ (et * e)
    W1 = W1_0 - (et * g).transpose(-1, -2) @ k
    W2 = W2_0 - (et * e).transpose(-1, -2) @ h
    return (W1, W2), o


# ============================================================================ the two backends (shared with titans)
def mini_batch_recurrent(step, q, k, v, scalars, state, names, mask, b, n_grad=None):
    """The "recurrent" backend of mini-batch gradient descent (TTT and Titans): a literal per-token loop.
    ``state``: a dict from ``mini_batch_state`` with ``names`` (current), ``<name>_start`` and n.
    ``step(W, Wg, q_t, k_t, v_t, scalars_t) -> (W_new, o_t)``; extra state parts (Titans' S) live in ``names``.
    Returns ``(o [B, T, H, dv], final state)``."""
    n_grad = len(names) if n_grad is None else n_grad  # the first n_grad parts have a mini-batch start
    W = tuple(state[n] for n in names)
    Wg = tuple(state[n + "_start"] for n in names[:n_grad])
    n = state["n"]
    outs = []
    for t in range(q.shape[1]):
        W_new, o_t = step(W, Wg, q[:, t], k[:, t], v[:, t], tuple(s[:, t] for s in scalars))
        real = torch.ones(q.shape[0], dtype=torch.bool, device=q.device) if mask is None else mask[:, t]
        W = tuple(_where(real, a, c) for a, c in zip(W_new, W))
        n = n + real.long()
        full = n == b
        Wg = tuple(_where(full, a, c) for a, c in zip(W[:n_grad], Wg))
        n = torch.where(full, torch.zeros_like(n), n)
        outs.append(o_t)
    final = {**{nm: x for nm, x in zip(names, W)}, **{nm + "_start": x for nm, x in zip(names, Wg)}, "n": n}
    return torch.stack(outs, 1), final


def _where(cond, a, b):
    return torch.where(cond.view(-1, *([1] * (a.dim() - 1))), a, b)


def mini_batch_chunked(chunk_fn, q, k, v, scalars, identity, state, names, mask, b, output_final_state,
                       n_grad=None):
    """The "chunk" backend of mini-batch gradient descent (TTT and Titans): one chunk (= mini-batch) at a time,
    each chunk by ``chunk_fn`` in parallel.

    The real tokens of each sample are placed at slots ``n_0 + (their rank among the real tokens)`` of a
    ``[B, L]`` grid (L a multiple of b), so chunk c of the grid is exactly mini-batch c of every sample, whatever
    its padding and its initial partial mini-batch n_0; empty slots get the ``identity`` scalars (no update).
    ``chunk_fn(W0, Wg, q, k, v, scalars, valid) -> (W_end, o)`` on ``[B, H, C, d]`` chunks: W0 = the state the
    chunk's recurrence starts from, Wg = the weights its gradients are taken at (the same except in chunk 0
    when the initial state holds a partial mini-batch)."""
    B, T, H, _ = q.shape
    n0 = state["n"]
    plain = mask is None and state.get("_fresh", False)
    if plain:  # no padding and a fresh mini-batch: slots = positions
        L = -(-T // b) * b
        valid = torch.zeros(B, L, dtype=torch.bool, device=q.device)
        valid[:, :T] = True

        def to_slots(x, fill=0.0):
            if L == T:
                return x
            pad = x.new_full((B, L - T) + x.shape[2:], fill)
            return torch.cat([x, pad], 1)

        def from_slots(x):
            return x[:, :T]

        total = torch.full((B,), T, dtype=torch.long, device=q.device)  # n0 = 0
    else:
        real = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
        grid = slot_grid(real, n0, b, state.get("_fresh", False))
        L, valid, to_slots, from_slots = grid.L, grid.valid, grid.to_slots, grid.from_slots
        total = grid.total

    N = L // b

    def chunks(x):  # [B, L, H, ...] -> [B, H, N, b, ...]
        x = x.reshape(B, N, b, H, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    qs, ks, vs = (chunks(to_slots(x)) for x in (q, k, v))
    ss = [chunks(to_slots(s, fill)) for s, fill in zip(scalars, identity)]
    vs_valid = valid.view(B, N, b)[:, None].expand(B, H, N, b)
    n_grad = len(names) if n_grad is None else n_grad
    W = tuple(state[n] for n in names)
    Wg = tuple(state[n + "_start"] for n in names[:n_grad])
    starts, outs = [Wg], []
    for c in range(N):
        W, o = chunk_fn(W, Wg, qs[:, :, c], ks[:, :, c], vs[:, :, c], tuple(s[:, :, c] for s in ss),
                        vs_valid[:, :, c])
        Wg = W[:n_grad]
        starts.append(Wg)
        outs.append(o)
    o = torch.stack(outs, 2)  # [B, H, N, b, dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, L, H, o.shape[-1])
    o = from_slots(o)
    if not output_final_state:
        return o, None
    idx = torch.div(total, b, rounding_mode="floor")  # the chunk whose start is the final mini-batch start
    final = {nm: x for nm, x in zip(names, W)}
    ar = torch.arange(B, device=q.device)
    for j, nm in enumerate(names[:n_grad]):
        final[nm + "_start"] = torch.stack([s[j] for s in starts], 0)[idx, ar]
    final["n"] = total - idx * b
    return o, final


# ============================================================================ the slot grid
class SlotGrid(NamedTuple):
    """The mini-batch-aligned ``[B, L]`` slot grid of ``mini_batch_chunked``: the real tokens of sample i at slots
    ``n0_i + (their rank among its real tokens)`` (L a multiple of b), so chunk c of b slots is mini-batch c of
    every sample. Built by ``slot_grid``."""

    L: int
    valid: torch.Tensor  # [B, L] bool: the slots that hold a new token
    total: torch.Tensor  # [B] int64: n0 + real tokens
    filled_chunks: int | torch.Tensor  # chunks up to the last one holding a token (a 0-dim tensor when static)
    to_slots: Callable  # (x [B, T, ...], fill=0.0) -> [B, L, ...], empty slots = fill
    from_slots: Callable  # x [B, L, ...] -> [B, T, ...], pads = 0


def slot_grid(real, n0, b, fresh=False) -> SlotGrid:
    """The slot grid for the real tokens ``real`` ``[B, T]`` (bool) after ``n0`` ``[B]`` tokens of a partial
    mini-batch of size b (``fresh``: n0 is known to be 0). Eager: as long as the fullest sample needs (one host
    sync). While compiled or captured (no host sync): as long as any n0 and T can need, from shapes only."""
    if host_sync_allowed():
        return _tight_slot_grid(real, n0, b)
    return _static_slot_grid(real, n0, b, fresh)


def _tight_slot_grid(real, n0, b) -> SlotGrid:
    B, T = real.shape
    slot = n0[:, None] + real.long().cumsum(1) - 1
    total = n0 + real.long().sum(1)
    L = max(1, -(-int(total.max().item()) // b)) * b
    bi, ti = real.nonzero(as_tuple=True)
    si = slot[bi, ti]
    valid = torch.zeros(B, L, dtype=torch.bool, device=real.device)
    valid[bi, si] = True

    def to_slots(x, fill=0.0):
        out = x.new_full((B, L) + x.shape[2:], fill)
        return out.index_put((bi, si), x[bi, ti])

    def from_slots(x):
        out = x.new_zeros((B, T) + x.shape[2:])
        return out.index_put((bi, ti), x[bi, si])

    return SlotGrid(L, valid, total, L // b, to_slots, from_slots)


def _static_slot_grid(real, n0, b, fresh) -> SlotGrid:
    """Sizes from shapes only: n0 ≤ b − 1 (0 when fresh) tokens already in the partial mini-batch and at most T
    new ones. The slack slots stay empty (an empty mini-batch leaves the state as it is); pads are written to a
    dump slot L, cut off after the scatter, and read back as 0."""
    B, T = real.shape
    dev = real.device
    L = max(1, -(-((0 if fresh else b - 1) + T) // b)) * b
    rank = real.long().cumsum(1)
    total = n0 + real.long().sum(1)
    slot = torch.where(real, n0[:, None] + rank - 1, L)
    rows = torch.arange(B, device=dev)[:, None].expand(B, T)
    pos = torch.arange(L, device=dev)
    valid = (pos >= n0[:, None]) & (pos < total[:, None])
    filled_chunks = torch.div(total.max() + b - 1, b, rounding_mode="floor").clamp_min(1)

    def to_slots(x, fill=0.0):
        out = x.new_full((B, L + 1) + x.shape[2:], fill)
        return out.index_put((rows, slot), x)[:, :L]

    def from_slots(x):
        out = x[rows, slot.clamp_max(L - 1)]
        keep = real.view(B, T, *([1] * (x.dim() - 2)))
        return torch.where(keep, out, torch.zeros((), dtype=x.dtype, device=dev))

    return SlotGrid(L, valid, total, filled_chunks, to_slots, from_slots)


# ============================================================================ states
def mini_batch_state(op, state, shapes, B, device, cdt, b, extra=()):
    """The state of mini-batch gradient descent (TTT and Titans) from an initial state dict: the parts ``shapes``
    (name -> shape) validated, ``<name>_start`` (= current) and ``n`` (= 0, marked ``_fresh``) filled in when
    absent, cast to ``cdt``. The parts in ``extra`` (Titans' momentum S) have no mini-batch start."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{op}: initial_state must be a dict with keys {sorted(shapes)} (optionally the "
                        f"'<name>_start' parts and 'n'), got {type(state).__name__}")
    allowed = set(shapes) | {f"{n}_start" for n in shapes if n not in extra} | {"n"}
    unknown = set(state) - allowed
    missing = set(shapes) - set(state)
    if unknown or missing:
        raise ValueError(f"{op}: initial_state has keys {sorted(state)}; it needs {sorted(shapes)} and may have "
                         f"{sorted(allowed - set(shapes))}")
    out = {}
    for name, shape in shapes.items():
        check_state_tensor(op, f"initial_state[{name!r}]", state[name], shape, device)
        out[name] = state[name].to(cdt)
        check_float(op, name, state[name])
        if name in extra:
            continue
        start = state.get(f"{name}_start")
        if start is None:
            out[f"{name}_start"] = out[name]
        else:
            check_state_tensor(op, f"initial_state['{name}_start']", start, shape, device)
            out[f"{name}_start"] = start.to(cdt)
    n = state.get("n")
    if n is None:
        out["n"] = torch.zeros(B, dtype=torch.long, device=device)
        out["_fresh"] = True
    else:
        if not isinstance(n, torch.Tensor) or tuple(n.shape) != (B,) or n.is_floating_point():
            raise ValueError(f"{op}: initial_state['n'] must be an integer tensor [B] = [{B}]")
        if host_sync_allowed() and bool(((n < 0) | (n >= b)).any()):  # not while compiled or captured
            raise ValueError(f"{op}: initial_state['n'] (tokens in the current mini-batch) must lie in "
                             f"[0, mini_batch_size={b}), got {n.tolist()}; was the state made with another "
                             "mini_batch_size?")
        out["n"] = n.to(device=device, dtype=torch.long)
    return out
