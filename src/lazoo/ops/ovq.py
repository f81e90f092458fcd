"""Online Vector-Quantized attention (OVQ; the OVQ paper, §3.2, §8.3) and VQ-attention (its baseline, §2.2).

Layout: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, mask ``[B, T]`` (1 = real token).

OVQ, per head, chunks of L = ``chunk_size`` real tokens, N = ``max_dict_size``:

    chunk c:  O_c = softmax(β Q_c [D_k; K_c]ᵀ + [log c; 0] + causal mask) [D_v; V_c]
    then:     assign each key of the chunk to its most similar centroid (dot product with D_k);
              the n_new keys with the lowest best-similarity become new centroids (count 1);
              every other key moves its centroid, μ ← μ + Σ (x − μ) / (c_old + c_in_chunk), for
              k on D_k and v on D_v (the exact running mean, a Newton step on the k-means loss);
              counts add up.

The raw keys/values of the current chunk are attended to unquantised; gradients flow through D_k
and D_v (weighted means of keys and values), not through the discrete assignments or the counts.
q and k are expected unit-norm (the mixer normalises them); ``scale`` is β (a number or a per-head
tensor ``[H]``; None means dk ** -0.5 as in ``softmax_attention``) and multiplies q only: the
assignments compare raw keys with centroids.

Choices the paper leaves open, pinned here (docs/ovq.md says why):
  * growth: after the chunk that ends at the t-th real token (t = L·c) the dictionary holds
    ``ovq_dict_size(t, N) = max(floor(t·N / (t + N)), 1)`` centroids (integer arithmetic), so
    ``n_new = min(L, max(0, ovq_dict_size(t, N) − current size))``. floor(N_t) < N always; the
    max(…, 1) only matters for N = 1 or L = 1 (an empty dictionary would leave the first chunk's
    keys nowhere to go). If ``max_dict_size`` is lowered below the current size, no centroid is
    added or removed until N_t passes the current size.
  * the first chunk (empty dictionary): every best-similarity is −inf, ties go to the earliest
    position, so the first n_new keys of the chunk become the centroids and the remaining keys are
    merged (count-weighted) into their most similar new centroid. In later chunks the non-new keys
    merge into their most similar *old* centroid, as in the paper's pseudo-code. New centroids take the
    slots size, size+1, … in order of increasing best-similarity.
  * no re-normalisation of centroids (the paper lists it as optional): D_k holds exact means of unit
    keys, whose norm ≤ 1 lowers the logit of a spread-out cluster; D_v holds exact means of values.
  * a chunk is L *real* tokens of a sample: pads do not count, so a left-padded sample chunks exactly
    as it does alone, and the dictionary update happens once the L-th real token of a chunk is seen.
  * an update happens only for a complete chunk; the tokens of an incomplete last chunk are kept in
    the state (the partial chunk) and attended to raw until the chunk completes.

State: ``{"Dk": [B, H, M, dk], "Dv": [B, H, M, dv], "counts": [B, H, M] int64,
"k": [B, L, H, dk], "v": [B, L, H, dv] (the partial chunk, zeros past t % L), "t": [B] int64
(real tokens seen)}``. Active centroids are the prefix of slots with count > 0; the capacity
M = max(N, size) is fixed by ``max_dict_size`` (a state of another capacity is padded/cut to it),
so memory is O(N·d), independent of T. ``max_dict_size`` may change between calls.

Backends: ``"recurrent"`` is the literal per-token form (each token is written into the partial
chunk, attends over [dictionary; partial chunk], and the dictionary is updated when the chunk is
complete); ``"chunk"`` packs each sample's real tokens (after its partial chunk) and processes whole
chunks, L queries at a time. Both share the dictionary update (``_update_dictionary``), which is the
definition. ``"triton"`` (auto on CUDA; fp32/fp16/bf16, head dims <= 128) runs the chunk attention of all
chunks in one kernel launch (``lazoo.kernels.ovq.attention``): the assignments of every chunk come first (no gradient,
``_assign``'s rule: the kernels of ``lazoo.kernels.ovq.assign``, or with ``triton_assign=False`` a PyTorch loop),
then every value each slot takes in the call as differentiable running means (``_dictionary_versions``,
``lazoo.kernels.ovq.versions``), which
the kernel reads by each chunk's counts; decoding one token without autograd is the per-token form with its
attention in one kernel (``ovq_decode_attention``). The state returned also carries its token counts on the host
(``_returned_host_t``); given back as it is, unmasked, for one token, it is not checked again and the host knows when a
chunk completes, so such a step reads nothing back from the GPU between chunk ends (``_ovq_decode_step``).

VQ-attention (``vq_attention``): keys are replaced by their most similar entry of a learned codebook
C ``[H, N, dk]`` (dot product; the mixer normalises C and k), output = causal softmax attention over
the quantised keys, which equals ``softmax(β q Cᵀ + log c_t) D_v,t`` with per-code counts c_t and
value means D_v,t over the tokens up to t (Lingle 2023). State ``{"Dv": [B, H, N, dv], "counts":
[B, H, N] int64}``. "recurrent": per token; "chunk": codes (counts at the chunk start) plus the chunk's
quantised keys, causally. Gradients reach q, v and the codebook (through the logits); the assignment
is discrete and k gets no gradient from the op (the mixer trains k and C with a VQ-VAE commitment /
codebook loss, see ``lazoo.layers.mixers.ovq``).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from ..kernels.limits import KERNEL_DTYPES, OVQ_ASSIGN_MAX_CHUNK, OVQ_ASSIGN_MAX_HEAD_DIM, OVQ_MAX_HEAD_DIM
from .backend import host_sync_allowed, resolve_backend, triton_unsupported
from .boundary import empty_batch_result, op_result, prepare_inputs, records_graph
from .checks import check_choice, check_positive_int, check_same_device, check_same_dtype
from .dtypes import compute_dtype, without_autocast
from .states import check_state_dict, check_state_tensor

__all__ = ["ovq_attention", "ovq_dict_size", "vq_attention"]

_OP = "ovq_attention"
_VQ_OP = "vq_attention"
_STATE_KEYS = ("Dk", "Dv", "counts", "k", "v", "t")
_VQ_STATE_KEYS = ("Dv", "counts")


_PARTS = ("Dk", "Dv", "counts", "k", "v")


def _mark_returned(state: dict, host_t: torch.Tensor) -> None:
    """Mark ``state`` as this op returned it, with its real-token counts ``host_t`` ``[B]`` on the host: its ``t``
    tensor keeps them and weak references to the other parts (the state stays a plain dict, which the caches'
    batch edits map)."""
    state["t"]._lazoo_ovq_returned = (host_t, tuple(weakref.ref(state[n]) for n in _PARTS))


def _returned_host_t(state) -> torch.Tensor | None:
    """The host's token counts of a state as this op returned it (the same tensors in every part), else None.
    Such a state is trusted: its values were checked when they entered, and the op's updates keep them finite with
    empty slots zero, so a one-token step after it reads nothing back from the GPU (``_ovq_decode_step``); a host
    read in every layer would make the host wait for the GPU. A state with any part replaced (a cache's batch edit,
    a copy, a tensor of the user's) is checked as before; an edit in place of a returned tensor is not seen."""
    mark = getattr(state.get("t"), "_lazoo_ovq_returned", None) if isinstance(state, dict) else None
    if mark is None or any(ref() is not state.get(n) for ref, n in zip(mark[1], _PARTS)):
        return None
    return mark[0]


def ovq_dict_size(t, max_dict_size: int):
    """Dictionary size after the chunk ending at real token t: ``max(floor(t·N/(t+N)), 1)`` (0 at t = 0).
    Works on ints and on int64 tensors."""
    N = max_dict_size
    if isinstance(t, torch.Tensor):
        size = torch.div(t * N, t + N, rounding_mode="floor").clamp_min(1)
        return torch.where(t > 0, size, torch.zeros_like(size))
    return 0 if t <= 0 else max((t * N) // (t + N), 1)


# ============================================================================ OVQ
@without_autocast
def ovq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | torch.Tensor | None = None,
    chunk_size: int = 128,
    max_dict_size: int = 2048,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    triton_assign: bool = True,
):
    """OVQ attention; returns ``(o [B, T, H, dv], final_state)`` (see the module docstring).

    ``triton_assign``: when the Triton backend runs, take every chunk's slot assignments with the kernels of
    ``lazoo.kernels.ovq.assign`` (the default: the same slots as the PyTorch loop, 0.71-0.85× its time for the
    whole op on an H200) or, with False, a PyTorch loop over the chunks. The kernels apply where chunk_size <= 128
    and the compute dtype is float32; the PyTorch loop runs otherwise. The "recurrent" and "chunk" backends ignore
    it (they assign chunk by chunk as they go)."""
    # a NaN at a pad never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(_OP, q, k, v, mask)
    L = check_positive_int(_OP, "chunk_size", chunk_size)
    check_positive_int(_OP, "max_dict_size", max_dict_size)
    backend = resolve_backend(_OP, backend, q.device, _triton_unsupported(q, v))
    triton_assign = check_choice(_OP, "triton_assign", triton_assign, (False, True))  # the triton backend's choice
    cdt = compute_dtype(q.dtype)

    qs = _scaled(_OP, q.to(cdt), scale, H, dk)
    kc, vc = k.to(cdt), v.to(cdt)
    # sizes read back from the dictionaries (host syncs) only where allowed; else static bounds from shapes
    sync = host_sync_allowed()
    returned_t = _returned_host_t(initial_state) if sync else None
    trusted = returned_t is not None
    state = _ovq_initial_state(initial_state, B, H, dk, dv, L, max_dict_size, q.device, cdt, sync, trusted)
    if B == 0:
        return empty_batch_result(q, v, state, output_final_state)
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    needs_grad = records_graph(qs, kc, vc, state["Dk"], state["Dv"])
    if backend == "triton" and not sync:
        # compiled or captured: the Triton form sizes its launches from the dictionaries (host reads); the chunk
        # form has static bounds, and the compiler fuses its elementwise work
        backend = "chunk"
    host_t = None
    if backend == "triton" and T == 1 and not needs_grad and trusted and mask is None:
        # decoding after a state this op returned: no host read (the host knows when a chunk completes)
        o, final, host_t = _ovq_decode_step(qs, kc, vc, state, L, max_dict_size, returned_t)
    elif backend == "triton" and T == 1 and not needs_grad:  # decoding: the per-token form, attention in one kernel
        o, final = _ovq_recurrent(qs, kc, vc, real, state, L, max_dict_size, sync, attend=_attend_token_triton)
    elif backend == "triton":
        o, final = _ovq_triton(qs, kc, vc, real, state, L, max_dict_size, q.dtype, triton_assign,
                               fresh_unmasked=initial_state is None and mask is None, want_state=output_final_state)
    elif backend == "recurrent":
        o, final = _ovq_recurrent(qs, kc, vc, real, state, L, max_dict_size, sync)
    else:
        # a fresh state has no partial chunk: the packed rows need no room for one
        o, final = _ovq_chunk(qs, kc, vc, real, state, L, max_dict_size, sync, fresh=initial_state is None)
    if output_final_state and sync:
        _mark_returned(final, final["t"].cpu() if host_t is None else host_t)  # (a host read, outside decoding steps)
    return op_result(o, mask, v.dtype, final, output_final_state)


def _scaled(op, q, scale, H, dk):
    """q times β (None -> dk ** -0.5; a number; a tensor [H] or a 0-d tensor, kept differentiable)."""
    if scale is None:
        return q * dk ** -0.5
    if isinstance(scale, torch.Tensor):
        check_same_device(op, q, scale=scale)
        if scale.dim() == 0:
            return q * scale.to(q.dtype)
        if tuple(scale.shape) != (H,):
            raise ValueError(f"{op}: a tensor scale must have shape [H] = ({H},), got {tuple(scale.shape)}")
        return q * scale.to(q.dtype)[:, None]
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return q * float(scale)
    raise TypeError(f"{op}: scale must be None, a number or a tensor [H], got {type(scale).__name__}")


def _check_int_tensor(op, name, x, shape, device):
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape) or x.is_floating_point() \
            or x.is_complex() or x.dtype == torch.bool:
        got = f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: {name} must be an integer tensor of shape {tuple(shape)}, got {got}")
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device} but q is on {device}")


def _ovq_initial_state(state, B, H, dk, dv, L, N, device, cdt, sync=True, trusted=False):
    """The state to start from, at capacity max(N, size); with ``sync`` False (no host reads) at capacity
    max(N, M0), the given capacity M0 kept (equal to the former for a state this op returned with the same N).
    ``trusted`` (a state as this op returned it, ``_returned_host_t``): its shapes are checked, not its values, and
    a capacity M0 <= N is padded to N (no host read; the same capacity as the checked path, max(N, size) = N)."""
    if state is None:
        return {
            "Dk": torch.zeros(B, H, N, dk, dtype=cdt, device=device),
            "Dv": torch.zeros(B, H, N, dv, dtype=cdt, device=device),
            "counts": torch.zeros(B, H, N, dtype=torch.int64, device=device),
            "k": torch.zeros(B, L, H, dk, dtype=cdt, device=device),
            "v": torch.zeros(B, L, H, dv, dtype=cdt, device=device),
            "t": torch.zeros(B, dtype=torch.int64, device=device),
        }
    check_state_dict(_OP, state, _STATE_KEYS)
    Dk = state["Dk"]
    if not isinstance(Dk, torch.Tensor) or Dk.dim() != 4:
        got = tuple(Dk.shape) if isinstance(Dk, torch.Tensor) else type(Dk).__name__
        raise ValueError(f"{_OP}: initial_state['Dk'] must have shape [B, H, M, dk] = ({B}, {H}, M, {dk}), got {got}")
    M0 = Dk.shape[2]
    check_state_tensor(_OP, "initial_state['Dk']", Dk, (B, H, M0, dk), device)
    check_state_tensor(_OP, "initial_state['Dv']", state["Dv"], (B, H, M0, dv), device)
    _check_int_tensor(_OP, "initial_state['counts']", state["counts"], (B, H, M0), device)
    buf_k = state["k"]
    if isinstance(buf_k, torch.Tensor) and buf_k.dim() == 4 and buf_k.shape[1] != L:
        raise ValueError(f"{_OP}: initial_state['k'] holds a partial chunk of length {buf_k.shape[1]}, but "
                         f"chunk_size={L}; the chunk size is part of the state's definition and cannot change")
    check_state_tensor(_OP, "initial_state['k']", buf_k, (B, L, H, dk), device)
    check_state_tensor(_OP, "initial_state['v']", state["v"], (B, L, H, dv), device)
    _check_int_tensor(_OP, "initial_state['t']", state["t"], (B,), device)
    counts = state["counts"].to(torch.int64)
    Dk, Dv = Dk.to(cdt), state["Dv"].to(cdt)
    if trusted and M0 <= N:  # (a capacity past N is cut to max(N, size): that needs the size, a host read)
        if M0 < N:
            Dk, Dv, counts = F.pad(Dk, (0, 0, 0, N - M0)), F.pad(Dv, (0, 0, 0, N - M0)), F.pad(counts, (0, N - M0))
        return {"Dk": Dk, "Dv": Dv, "counts": counts, "k": buf_k.to(cdt), "v": state["v"].to(cdt),
                "t": state["t"].to(torch.int64)}
    size = None
    if sync:  # the value checks and the size in one read-back (a host sync: not while compiled or captured)
        negative, bad_k, bad_v, size = torch.stack([
            (counts < 0).any().long(), (~torch.isfinite(Dk).all()).long(), (~torch.isfinite(Dv).all()).long(),
            _max_size_tensor(counts)]).tolist()
        if negative:
            raise ValueError(f"{_OP}: initial_state['counts'] must be >= 0")
        for name, bad in (("Dk", bad_k), ("Dv", bad_v)):
            if bad:
                raise ValueError(f"{_OP}: initial_state[{name!r}] holds NaN or inf")
    # an empty slot holds nothing (a new centroid placed there is its key alone, whatever the slot held)
    empty = (counts == 0)[..., None]
    Dk, Dv = Dk.masked_fill(empty, 0.0), Dv.masked_fill(empty, 0.0)
    # capacity M = max(N, current size): pad with empty slots or drop empty ones
    M = max(N, size) if sync else max(N, M0)
    if M0 < M:
        Dk = F.pad(Dk, (0, 0, 0, M - M0))
        Dv = F.pad(Dv, (0, 0, 0, M - M0))
        counts = F.pad(counts, (0, M - M0))
    elif M0 > M:
        Dk, Dv, counts = Dk[:, :, :M], Dv[:, :, :M], counts[:, :, :M]
    return {"Dk": Dk, "Dv": Dv, "counts": counts, "k": buf_k.to(cdt), "v": state["v"].to(cdt),
            "t": state["t"].to(torch.int64)}


def _max_size(counts) -> int:
    """The largest number of active centroids over samples and heads (one host sync)."""
    return int(_max_size_tensor(counts))


def _max_size_tensor(counts) -> torch.Tensor:
    """``_max_size`` as a 0-d int64 tensor on counts' device, not read back."""
    if counts.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=counts.device)
    return (counts > 0).sum(-1).max()


def _read_width(counts, sync: bool) -> int:
    """How many leading slots the attention reads: the active prefix (one host sync), or without ``sync`` the
    whole capacity (a size from the shape; the empty slots are masked out as inactive)."""
    return _max_size(counts) if sync else counts.shape[-1]


def _update_dictionary(Dk, Dv, counts, K, V, t_end, N, sync=True):
    """One complete chunk's update. Dk ``[B, H, W, dk]``, Dv ``[B, H, W, dv]``, counts ``[B, H, W]``
    (active slots first, W >= size + L or the capacity), K ``[B, H, L, dk]``, V ``[B, H, L, dv]``,
    t_end ``[B]`` the real-token count at the chunk's end. Returns the updated (Dk, Dv, counts)."""
    W = Dk.shape[2]
    dt = Dk.dtype
    slot, is_new = _assign(Dk, counts, K, t_end, N, sync)
    place = F.one_hot(slot, W).to(dt) * is_new[..., None].to(dt)
    merge = F.one_hot(slot, W).to(dt) * (~is_new)[..., None].to(dt)  # [B, H, L, W]
    place_t, merge_t = place.transpose(-1, -2), merge.transpose(-1, -2)
    Dk0, Dv0 = Dk + place_t @ K, Dv + place_t @ V  # new centroids = their key / value, count 1
    c0 = counts + place.sum(-2).round().to(torch.int64)
    m = merge.sum(-2)  # keys merged into each slot
    denom = (c0.to(dt) + m).clamp_min(1.0)[..., None]
    Dk1 = Dk0 + (merge_t @ K - m[..., None] * Dk0) / denom
    Dv1 = Dv0 + (merge_t @ V - m[..., None] * Dv0) / denom
    return Dk1, Dv1, c0 + m.round().to(torch.int64)


def _assign(Dk, counts, K, t_end, N, sync=True):
    """The slot each key of a complete chunk ends in (``[B, H, L]``, in [0, W)) and whether it opens a
    new centroid, from the dictionary before the chunk (Dk, counts as in ``_update_dictionary``).
    ``sync=False`` skips the host check for an empty dictionary (always computing the first-chunk rule)."""
    W = Dk.shape[2]
    L = K.shape[2]
    active = counts > 0
    size = active.sum(-1)  # [B, H]
    n_new = (ovq_dict_size(t_end, N)[:, None] - size).clamp(0, L)  # [B, H]

    # nearest old centroid of each key (assignments are discrete: no gradient)
    Kd = K.detach()
    sim = (Kd @ Dk.detach().transpose(-1, -2)).masked_fill(~active[:, :, None, :], -math.inf)
    best_sim, best_idx = sim.max(-1)  # [B, H, L]; -inf with an empty dictionary
    # the n_new lowest best-similarities become new centroids (ties: earliest position first)
    order = torch.sort(best_sim, dim=-1, stable=True).indices
    ar = torch.arange(L, device=K.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ar)
    is_new = rank < n_new[..., None]
    new_slot = size[..., None] + rank
    no_old = size == 0
    if not sync or bool(no_old.any()):  # first chunk: the other keys merge into their most similar new centroid
        s2 = (Kd @ Kd.transpose(-1, -2)).masked_fill(~is_new[:, :, None, :], -math.inf)
        nearest_new = new_slot.gather(-1, s2.max(-1).indices)
        best_idx = torch.where(no_old[..., None], nearest_new, best_idx)
    slot = torch.where(is_new, new_slot.clamp_max(W - 1), best_idx.clamp(0, W - 1))
    return slot, is_new


def _apply_update(state_dict, K, V, t_end, full, N, sync=True):
    """Update the dictionaries of the samples in ``full`` ``[B]`` with chunk K, V ``[B, H, L, d]``,
    working on the active prefix of the slots (plus room for L new ones); without ``sync`` on every slot
    (new centroids never go past slot N - 1 < M, so the result is the same)."""
    Dk, Dv, counts = state_dict["Dk"], state_dict["Dv"], state_dict["counts"]
    M, L = Dk.shape[2], K.shape[2]
    W = min(M, _max_size(counts) + L) if sync else M
    Dk1, Dv1, c1 = _update_dictionary(Dk[:, :, :W], Dv[:, :, :W], counts[:, :, :W], K, V, t_end, N, sync)
    if W < M:
        Dk1 = torch.cat([Dk1, Dk[:, :, W:]], 2)
        Dv1 = torch.cat([Dv1, Dv[:, :, W:]], 2)
        c1 = torch.cat([c1, counts[:, :, W:]], 2)
    f = full[:, None, None]
    state_dict["Dk"] = torch.where(f[..., None], Dk1, Dk)
    state_dict["Dv"] = torch.where(f[..., None], Dv1, Dv)
    state_dict["counts"] = torch.where(f, c1, counts)


def _dict_logits(Q, Dk, counts):
    """Logits β q·μ + log c over the dictionary prefix and which slots are active."""
    active = counts > 0
    logc = torch.where(active, counts.clamp_min(1).to(Q.dtype).log(), torch.zeros((), dtype=Q.dtype, device=Q.device))
    return Q @ Dk.transpose(-1, -2) + logc[:, :, None, :], active


def _masked_softmax(scores, allowed):
    """softmax over the allowed entries (a row with none gives zeros, never NaN)."""
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * allowed


def _attend_token(qi, st, bk, bv, nb, sync):
    """One token's output ``[B, H, dv]``: qi ``[B, H, dk]`` over [dictionary (log counts); partial chunk rows
    0..nb] (bk, bv ``[B, L, H, d]``, the token already written at row nb)."""
    B, L, H, _ = bk.shape
    S = _read_width(st["counts"], sync)
    qi = qi[:, :, None, :]  # [B, H, 1, dk]
    ld, active = _dict_logits(qi, st["Dk"][:, :, :S], st["counts"][:, :, :S])
    lb = qi @ bk.permute(0, 2, 3, 1)  # [B, H, 1, L]
    seen = (torch.arange(L, device=bk.device)[None] <= nb[:, None])[:, None, None, :].expand(B, H, 1, L)
    p = _masked_softmax(torch.cat([ld, lb], -1), torch.cat([active[:, :, None, :], seen], -1))
    return (p[..., :S] @ st["Dv"][:, :, :S] + p[..., S:] @ bv.transpose(1, 2))[:, :, 0]


def _attend_token_triton(qi, st, bk, bv, nb, sync):
    """``_attend_token`` as one kernel (``lazoo.kernels.ovq.attention.ovq_decode_attention``): decoding without
    autograd."""
    from ..kernels.ovq.attention import ovq_decode_attention  # lazy: importing defines the kernels

    return ovq_decode_attention(qi, st["Dk"], st["Dv"], st["counts"], bk, bv, nb + 1).to(qi.dtype)


def _ovq_recurrent(q, k, v, real, state, L, N, sync=True, attend=_attend_token):
    """Literal per-token form: write the token into the partial chunk, attend over [dictionary (log
    counts); partial chunk up to this token] (``attend``), update the dictionary when the chunk is complete."""
    B, T, H, dk = q.shape
    st = dict(state)
    bk, bv, t = st.pop("k"), st.pop("v"), st.pop("t")
    slots = torch.arange(L, device=q.device)
    outs = []
    for i in range(T):
        m = real[:, i]
        nb = t % L
        sel = (m[:, None] & (slots[None] == nb[:, None]))[:, :, None, None]  # [B, L, 1, 1]
        bk = torch.where(sel, k[:, i, None], bk)
        bv = torch.where(sel, v[:, i, None], bv)
        outs.append(attend(q[:, i], st, bk, bv, nb, sync))
        t = t + m.long()
        full = m & (t % L == 0)
        if not sync or bool(full.any()):  # without sync always: the update leaves samples not full unchanged
            _apply_update(st, bk.transpose(1, 2), bv.transpose(1, 2), t, full, N, sync)
    keep = (slots[None] < (t % L)[:, None])[:, :, None, None]
    zero = torch.zeros((), dtype=bk.dtype, device=bk.device)
    st.update(k=torch.where(keep, bk, zero), v=torch.where(keep, bv, zero), t=t)
    return torch.stack(outs, 1), st


def _ovq_decode_step(q, k, v, state, L, N, host_t):
    """``_ovq_recurrent`` for one real token per sample (no mask) after a trusted state whose counts the host knows
    (``host_t`` ``[B]``): the token written at its partial chunk's row t % L, the attention in one kernel, and the
    dictionary update only when a sample's chunk completes, which the host counts tell (once every L tokens).
    Nothing is read back from the GPU otherwise. Returns ``(o [B, 1, H, dv], state, host_t)``."""
    B = q.shape[0]
    st = dict(state)
    bk, bv, t = st.pop("k"), st.pop("v"), st.pop("t")
    row = t % L  # the partial chunk's rows past t % L are zero (the op's invariant)
    at = (torch.arange(B, device=q.device), row)
    bk, bv = bk.index_put(at, k[:, 0]), bv.index_put(at, v[:, 0])
    o = _attend_token_triton(q[:, 0], st, bk, bv, row, True)
    t, host_t = t + 1, host_t + 1
    full_host = host_t % L == 0  # on the host: no read-back
    if bool(full_host.any()):
        full = full_host.to(q.device, non_blocking=True)
        _apply_update(st, bk.transpose(1, 2), bv.transpose(1, 2), t, full, N, sync=True)
        zero = torch.zeros((), dtype=bk.dtype, device=bk.device)
        bk, bv = (torch.where(full[:, None, None, None], zero, x) for x in (bk, bv))
    st.update(k=bk, v=bv, t=t)
    return o[:, None], st, host_t


def _pack(q, k, v, real, bk, bv, t0, L, sync=True, max_partial=None):
    """Per sample, the partial chunk of the state followed by the real tokens, packed to the left into
    whole chunks: (Qp, Kp, Vp ``[B, P, ...]``, valid ``[B, P]``, dest ``[B, L + T]`` where each input
    row went (P = dropped), total ``[B]`` packed length, nb ``[B]`` tokens of the partial chunk).
    P covers the longest sample (one host sync); without ``sync`` it covers ``max_partial`` (default L - 1)
    + T tokens, an upper bound from the shapes (the rows past a sample's total are not ``valid``)."""
    B, T, H, _ = q.shape
    dev = q.device
    nb = t0 % L
    total = nb + real.long().sum(1)  # packed length per sample
    longest = int(total.max()) if sync else (L - 1 if max_partial is None else max_partial) + T
    P = max(1, -(-longest // L)) * L
    slots = torch.arange(L, device=dev)
    dest = torch.cat([torch.where(slots[None] < nb[:, None], slots[None], P),
                      torch.where(real, nb[:, None] + real.long().cumsum(1) - 1, P)], 1)  # [B, L + T]

    def pack(buf, x):
        d = x.shape[-1]
        idx = dest[:, :, None, None].expand(-1, -1, H, d)
        out = torch.zeros(B, P + 1, H, d, dtype=x.dtype, device=dev)
        return out.scatter(1, idx, torch.cat([buf, x], 1))[:, :P]

    Qp, Kp, Vp = pack(torch.zeros(B, L, H, q.shape[-1], dtype=q.dtype, device=dev), q), pack(bk, k), pack(bv, v)
    valid = torch.arange(P, device=dev)[None] < total[:, None]  # [B, P]
    return Qp, Kp, Vp, valid, dest, total, nb


def _unpack(Op, dest, L):
    """The packed outputs ``[B, P, H, dv]`` back at the input positions ``[B, T, H, dv]``."""
    pos = dest[:, L:].clamp_max(Op.shape[1] - 1)
    return Op.gather(1, pos[:, :, None, None].expand(-1, -1, Op.shape[2], Op.shape[-1]))


def _pad_to_chunks(q, k, v, L):
    """``_pack``'s outputs (but ``dest``) when there is no partial chunk before the tokens and no pad among them:
    packing is then padding to whole chunks (a pad of 0 copies nothing), and the output is sliced back."""
    B, T = q.shape[:2]
    P = max(1, -(-T // L)) * L
    Qp, Kp, Vp = (F.pad(x, (0, 0, 0, 0, 0, P - T)) if P > T else x for x in (q, k, v))
    total = torch.full((B,), T, dtype=torch.int64, device=q.device)
    valid = (torch.arange(P, device=q.device) < T)[None].expand(B, P)
    return Qp, Kp, Vp, valid, total, torch.zeros_like(total)


def _partial_chunk(x, total, L):
    """The partial chunk left at the end of packed rows x ``[B, P, H, d]`` (P >= 1): rows [total // L * L, total),
    zeros past them."""
    _, P, H, d = x.shape
    slots = torch.arange(L, device=x.device)
    idx = ((total // L) * L)[:, None] + slots[None]  # [B, L], at most P + L - 1: rows past P are masked below
    rem = (slots[None] < (total % L)[:, None])[:, :, None, None]
    part = x.gather(1, idx.clamp_max(P - 1)[:, :, None, None].expand(-1, -1, H, d))
    return torch.where(rem, part, torch.zeros((), dtype=x.dtype, device=x.device))


def _ovq_chunk(q, k, v, real, state, L, N, sync=True, fresh=False):
    """Chunk form: per sample, the partial chunk of the state followed by the real tokens, packed to
    the left; then whole chunks: L queries against [dictionary; chunk (causal)], update when full.
    ``fresh``: the state is the empty one (no partial chunk), which tightens the bound on P without sync."""
    B, T, H, dk = q.shape
    dev = q.device
    st = dict(state)
    bk, bv, t0 = st.pop("k"), st.pop("v"), st.pop("t")
    Qp, Kp, Vp, valid, dest, total, nb = _pack(q, k, v, real, bk, bv, t0, L, sync, 0 if fresh else None)
    P = Qp.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    outs = []
    for c in range(P // L):
        s = c * L
        Qc, Kc, Vc = (x[:, s:s + L].transpose(1, 2) for x in (Qp, Kp, Vp))  # [B, H, L, d]
        vc = valid[:, s:s + L]
        S = _read_width(st["counts"], sync)
        ld, active = _dict_logits(Qc, st["Dk"][:, :, :S], st["counts"][:, :, :S])
        lc = Qc @ Kc.transpose(-1, -2)
        allowed = torch.cat([active[:, :, None, :].expand(-1, -1, L, -1),
                             (causal[None] & vc[:, None, :])[:, None].expand(-1, H, -1, -1)], -1)
        p = _masked_softmax(torch.cat([ld, lc], -1), allowed)
        outs.append(p[..., :S] @ st["Dv"][:, :, :S] + p[..., S:] @ Vc)
        full = vc.all(1)
        if not sync or bool(full.any()):  # without sync always: the update leaves samples not full unchanged
            _apply_update(st, Kc, Vc, t0 - nb + s + L, full, N, sync)
    o = _unpack(torch.cat(outs, 2).transpose(1, 2), dest, L)
    st.update(k=_partial_chunk(Kp, total, L), v=_partial_chunk(Vp, total, L), t=t0 + real.long().sum(1))
    return o, st


# ============================================================================ Triton path
def _triton_unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when lazoo.kernels.ovq.attention runs this case, else why not (imports no kernel)."""
    reason = triton_unsupported(q, v, OVQ_MAX_HEAD_DIM, KERNEL_DTYPES)
    if reason:
        return reason
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not available ({e})"
    return None


def _slot_step(Sk, counts, Kc, t_end, full, N):
    """One complete chunk's assignments against the running sums ``Sk`` and ``counts`` (both updated in
    place; samples with ``full`` False are left unchanged); returns the slots (-1 where not full)."""
    dk = Sk.shape[-1]
    Dk = Sk / counts.clamp_min(1)[..., None].to(Sk.dtype)
    slot, _ = _assign(Dk, counts, Kc, t_end, N, sync=False)
    add = full[:, None, None].expand_as(slot)
    Sk.scatter_add_(2, slot[..., None].expand(-1, -1, -1, dk), Kc * add[..., None].to(Kc.dtype))
    counts.scatter_add_(2, slot, add.long())
    return torch.where(add, slot, -1)


class _SlotGraph:
    """``STEPS`` chunk steps (``_slot_step``) captured in one CUDA graph. The loop over chunks is bound by
    kernel launches (about 40 small ops per chunk); a replay costs one launch for ``STEPS`` chunks."""

    STEPS = 16
    cache = None  # a lazoo.kernels._graphs.GraphCache, made on first use (ops import kernels lazily)

    def __init__(self, B, H, L, M, dk, dtype, N, device):
        from ..kernels._graphs import capture

        S = self.STEPS
        self.Sk = torch.zeros(B, H, M, dk, dtype=dtype, device=device)
        self.counts = torch.zeros(B, H, M, dtype=torch.int64, device=device)
        self.K = torch.zeros(S, B, H, L, dk, dtype=dtype, device=device)
        self.t_end = torch.zeros(S, B, dtype=torch.int64, device=device)
        self.full = torch.zeros(S, B, dtype=torch.bool, device=device)
        self.N = N
        self.graph, (self.before, self.slots) = capture(self._run, device)

    def _run(self):
        before, slots = [], []
        for i in range(self.STEPS):
            before.append(self.counts.clone())
            slots.append(_slot_step(self.Sk, self.counts, self.K[i], self.t_end[i], self.full[i], self.N))
        return torch.stack(before), torch.stack(slots)

    @classmethod
    def get(cls, B, H, L, M, dk, dtype, N, device):
        """The graph for this shape (built on first use), or None where it cannot be captured (run eagerly)."""
        if cls.cache is None:
            from ..kernels._graphs import GraphCache

            cls.cache = GraphCache()
        return cls.cache.get((B, H, L, M, dk, dtype, N, device), lambda: cls(B, H, L, M, dk, dtype, N, device))


@torch.no_grad()
def _chunk_slots(Kp, valid, state, t0, nb, L, N):
    """The discrete part of the update for every chunk, without gradients: the slot each key ends in
    (``[C, B, H, L]``, -1 for keys of an incomplete chunk) and the counts before each chunk
    (``[C, B, H, M]``) and after the last. The dictionary is tracked as sums / counts (its running
    means, equal to the chunk form's up to rounding). On CUDA the steps run as CUDA-graph replays."""
    B, P, H, dk = Kp.shape
    C = P // L
    counts = state["counts"].clone()
    Sk = state["Dk"].detach() * counts[..., None].to(Kp.dtype)
    Kd = Kp.detach().reshape(B, C, L, H, dk).permute(1, 0, 3, 2, 4)  # [C, B, H, L, dk]
    full = valid[:, L - 1::L].transpose(0, 1)  # [C, B]: chunk c is complete
    t_end = (t0 - nb)[None] + L * torch.arange(1, C + 1, device=Kp.device)[:, None]  # [C, B]
    graph = None
    if Kp.is_cuda and C > 1:
        graph = _SlotGraph.get(B, H, L, Sk.shape[2], dk, Kp.dtype, N, Kp.device)
    if graph is None:
        slots, before = [], []
        for c in range(C):
            before.append(counts.clone())
            slots.append(_slot_step(Sk, counts, Kd[c], t_end[c], full[c], N))
        return torch.stack(slots), torch.stack(before), counts
    S = graph.STEPS
    graph.Sk.copy_(Sk)
    graph.counts.copy_(counts)
    slots, before = [], []
    for c0 in range(0, C, S):
        n = min(S, C - c0)
        graph.K[:n].copy_(Kd[c0:c0 + n])
        graph.t_end[:n].copy_(t_end[c0:c0 + n])
        graph.full.zero_()  # steps past the last chunk change nothing
        graph.full[:n].copy_(full[c0:c0 + n])
        graph.graph.replay()
        slots.append(graph.slots[:n].clone())
        before.append(graph.before[:n].clone())
    return torch.cat(slots), torch.cat(before), graph.counts.clone()


def _dictionary_versions(Kp, Vp, slots, Dk0, Dv0, counts0, counts_end, kdt):
    """Every value each slot takes during the call, as differentiable running means in one table per
    (sample, head), instead of one dictionary per chunk.

    A slot's centroid changes only when a key joins it. Rows are grouped by slot: slot s's group is its
    initial value followed by its value after each key that joins it, in order (n_s = counts_end − counts0
    keys, so n_s + 1 rows starting at ``start[s]``). A chunk whose count of slot s is c before it reads the
    row ``start[s] + c − counts0[s]``, i.e. ``base[s] + c`` with ``base = start − counts0``.

    Kp ``[B, P, H, dk]``, Vp ``[B, P, H, dv]`` (packed), slots ``[C, B, H, L]`` (−1: the key joins nothing),
    Dk0/Dv0 ``[B, H, M, d]`` and counts0 the dictionary before the call, counts_end after it. Returns the
    tables of means ``[B, H, M + P, d]`` in ``kdt`` (rows past the groups are zero), base ``[B, H, M]`` and the
    final dictionaries ``[B, H, M, d]`` in Dk0's dtype. The means are built by ``lazoo.kernels.ovq.versions``:
    one program per slot sums its keys in fp32 in the order of the step-by-step update."""
    from ..kernels.ovq.versions import version_table  # lazy: importing defines the kernels

    B, P, H, _ = Kp.shape
    M = counts0.shape[-1]
    n = counts_end - counts0
    start = torch.arange(M, device=Kp.device) + (n.cumsum(-1) - n)  # [B, H, M]
    tok_slot = slots.permute(1, 2, 0, 3).reshape(B, H, P)  # packed order: p = c·L + i
    # the keys sorted by (slot, position); keys that join nothing sort last
    t = torch.arange(P, device=Kp.device)
    order = (torch.where(tok_slot >= 0, tok_slot, M) * P + t).argsort(-1)
    means_k, Dk_end = version_table(Kp, Dk0, counts0, start, n, order, M + P, kdt)
    means_v, Dv_end = version_table(Vp, Dv0, counts0, start, n, order, M + P, kdt)
    return means_k, means_v, start - counts0, Dk_end, Dv_end


def _ovq_triton(q, k, v, real, state, L, N, kdt, triton_assign, fresh_unmasked=False, want_state=True):
    """The chunk form with the chunk attention in lazoo.kernels.ovq.attention: (1) the assignments of every chunk
    (sequential, no gradient: lazoo.kernels.ovq.assign with ``triton_assign``, else a PyTorch loop over the chunks);
    (2) every value each slot takes, as differentiable running means (``_dictionary_versions``); (3) one kernel
    launch for the attention of all chunks, each reading its dictionary from (2) by the counts before it.
    Gradients reach q, k, v and the initial dictionaries through (2). ``kdt``: the dtype the kernel computes
    in. ``fresh_unmasked`` (no initial state, no mask: training): the packed length and the dictionary's width are
    known on the host, so nothing is read back (otherwise two reads: the host would wait for the GPU in every
    layer, and the GPU for the host after it). Without ``want_state`` the returned state lacks the partial chunk's
    keys and values (two gathers fewer: the op then returns no state)."""
    from ..kernels.ovq.attention import ovq_chunk_attention  # lazy: importing defines the kernels

    st = dict(state)
    bk, bv, t0 = st.pop("k"), st.pop("v"), st.pop("t")
    cdt = k.dtype
    q = q.to(kdt)  # the kernel's dtype before packing (q is only read there): the same values, fewer bytes
    if fresh_unmasked:
        Qp, Kp, Vp, valid, total, nb = _pad_to_chunks(q, k, v, L)
    else:
        Qp, Kp, Vp, valid, dest, total, nb = _pack(q, k, v, real, bk, bv, t0, L)
    assign_fits = L <= OVQ_ASSIGN_MAX_CHUNK and Kp.shape[-1] <= OVQ_ASSIGN_MAX_HEAD_DIM
    if triton_assign and assign_fits and Kp.dtype == torch.float32:
        from ..kernels.ovq.assign import ovq_assign

        slots, before, counts_end = ovq_assign(Kp.detach(), valid.sum(1) // L, t0 - nb, st["Dk"].detach(),
                                               st["counts"], L, N)
    else:
        slots, before, counts_end = _chunk_slots(Kp, valid, st, t0, nb, L, N)
    means_k, means_v, base, Dk_end, Dv_end = _dictionary_versions(Kp, Vp, slots, st["Dk"], st["Dv"],
                                                                  st["counts"], counts_end, kdt)
    # the slots any chunk reads: up to the last active slot before the last chunk (one host sync, or from the host
    # when the dictionary started empty and every chunk before the last is complete)
    M = before.shape[-1]
    if fresh_unmasked:
        # an empty dictionary opens clamp(ovq_dict_size(t_end) - size, 0, L) slots a chunk (``_assign``), whatever
        # the keys; ovq_dict_size grows by at most L a chunk, so after c whole chunks it holds ovq_dict_size(c·L)
        W = ovq_dict_size((before.shape[0] - 1) * L, N) if before.numel() else 0
    else:
        W = int((torch.arange(1, M + 1, device=before.device) * (before[-1] > 0)).amax()) if before.numel() else 0
    o = ovq_chunk_attention(Qp, Kp.to(kdt), Vp.to(kdt), means_k, means_v, before[..., :W], base[..., :W], L,
                            length=total).to(cdt)
    o = o[:, :q.shape[1]] if fresh_unmasked else _unpack(o, dest, L)
    partial = dict(k=_partial_chunk(Kp, total, L), v=_partial_chunk(Vp, total, L)) if want_state else {}
    # the keys in the order of every other form's state
    st.update(Dk=Dk_end, Dv=Dv_end, counts=counts_end, **partial, t=t0 + real.long().sum(1))
    return o, st


# ============================================================================ VQ
@without_autocast
def vq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    scale: float | torch.Tensor | None = None,
    chunk_size: int = 64,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
):
    """VQ-attention with a learned codebook ``[H, N, dk]``; returns ``(o, final_state)`` (Dv, counts)."""
    # a NaN at a pad never meets a real token
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(_VQ_OP, q, k, v, mask)
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 3 or codebook.shape[0] != H \
            or codebook.shape[2] != dk or codebook.shape[1] < 1:
        got = tuple(codebook.shape) if isinstance(codebook, torch.Tensor) else type(codebook).__name__
        raise ValueError(f"{_VQ_OP}: codebook must have shape [H, N, dk] = ({H}, N, {dk}), got {got}")
    check_same_dtype(_VQ_OP, q, codebook=codebook)
    check_same_device(_VQ_OP, q, codebook=codebook)
    C = check_positive_int(_VQ_OP, "chunk_size", chunk_size)
    backend = resolve_backend(_VQ_OP, backend, q.device)
    cdt = compute_dtype(q.dtype)
    N = codebook.shape[1]
    cb = codebook.to(cdt)
    qs = _scaled(_VQ_OP, q.to(cdt), scale, H, dk)
    vc = v.to(cdt)
    idx = torch.einsum("bthd,hnd->bthn", k.detach().to(cdt), cb.detach()).argmax(-1)  # [B, T, H]
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    if initial_state is None:
        state = {"Dv": torch.zeros(B, H, N, dv, dtype=cdt, device=q.device),
                 "counts": torch.zeros(B, H, N, dtype=torch.int64, device=q.device)}
    else:
        check_state_dict(_VQ_OP, initial_state, _VQ_STATE_KEYS)
        check_state_tensor(_VQ_OP, "initial_state['Dv']", initial_state["Dv"], (B, H, N, dv), q.device)
        _check_int_tensor(_VQ_OP, "initial_state['counts']", initial_state["counts"], (B, H, N), q.device)
        state = {"Dv": initial_state["Dv"].to(cdt), "counts": initial_state["counts"].to(torch.int64)}
    run = _vq_recurrent if backend == "recurrent" else _vq_chunk
    o, final = run(qs, vc, idx, cb, real, state, C)
    return op_result(o, mask, v.dtype, final, output_final_state)


def _vq_add(Dv, counts, onehot, V):
    """Add values to their codes: onehot ``[B, H, n, N]`` (0 rows for pads), V ``[B, H, n, dv]``."""
    m = onehot.sum(-2)
    c1 = counts + m.round().to(torch.int64)
    Dv1 = Dv + (onehot.transpose(-1, -2) @ V - m[..., None] * Dv) / c1.clamp_min(1).to(Dv.dtype)[..., None]
    return Dv1, c1


def _vq_recurrent(q, v, idx, cb, real, state, C):
    """Per token: add (code, v) to the counts and value means, then attend over the codes."""
    Dv, counts = state["Dv"], state["counts"]
    N = cb.shape[1]
    logits_all = torch.einsum("bthd,hnd->bhtn", q, cb)  # [B, H, T, N]
    outs = []
    for i in range(q.shape[1]):
        oh = F.one_hot(idx[:, i], N).to(q.dtype) * real[:, i, None, None].to(q.dtype)  # [B, H, N]
        Dv, counts = _vq_add(Dv, counts, oh[:, :, None], v[:, i, :, None])
        ld, active = _dict_logits_from(logits_all[:, :, i:i + 1], counts)
        p = _masked_softmax(ld, active[:, :, None, :])
        outs.append((p @ Dv)[:, :, 0])
    return torch.stack(outs, 1), {"Dv": Dv, "counts": counts}


def _dict_logits_from(logits, counts):
    active = counts > 0
    logc = torch.where(active, counts.clamp_min(1).to(logits.dtype).log(),
                       torch.zeros((), dtype=logits.dtype, device=logits.device))
    return logits + logc[:, :, None, :], active


def _vq_chunk(q, v, idx, cb, real, state, C):
    """Per chunk: the codes with the counts/value means at the chunk start, plus the chunk's own
    quantised keys (causal, real only); then the chunk is added to the counts and means."""
    B, T, H, dk = q.shape
    N = cb.shape[1]
    Dv, counts = state["Dv"], state["counts"]
    k_hat = cb[torch.arange(H, device=q.device)[None, None], idx]  # [B, T, H, dk], differentiable in cb
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    outs = []
    for s in range(0, T, C):
        Qc, Kc, Vc = (x[:, s:s + C].transpose(1, 2) for x in (q, k_hat, v))
        n = Qc.shape[2]
        m = real[:, s:s + C]
        ld, active = _dict_logits_from(torch.einsum("bhtd,hnd->bhtn", Qc, cb), counts)
        lc = Qc @ Kc.transpose(-1, -2)
        allowed = torch.cat([active[:, :, None, :].expand(-1, -1, n, -1),
                             (causal[:n, :n][None] & m[:, None, :])[:, None].expand(-1, H, -1, -1)], -1)
        p = _masked_softmax(torch.cat([ld, lc], -1), allowed)
        outs.append(p[..., :N] @ Dv + p[..., N:] @ Vc)
        oh = F.one_hot(idx[:, s:s + C].transpose(1, 2), N).to(q.dtype) * m[:, None, :, None].to(q.dtype)
        Dv, counts = _vq_add(Dv, counts, oh, Vc)
    return torch.cat(outs, 2).transpose(1, 2), {"Dv": Dv, "counts": counts}
