"""Causal softmax attention, full or sliding-window, with a KV cache as state.

Layout: q ``[B, T, H, dk]``, k ``[B, T, Hkv, dk]``, v ``[B, T, Hkv, dv]``, mask ``[B, T]`` (1 = real token).
Grouped-query attention: Hkv (a divisor of H; Hkv = H is plain multi-head attention) key/value heads, query head
h reading key/value head h // (H // Hkv). The state keeps the Hkv heads; they are repeated only for the compute.
State (the KV cache): ``{"k": [B, Tc, Hkv, dk], "v": [B, Tc, Hkv, dv], "mask": [B, Tc] bool}``.

Positions are counted over the cache followed by the new tokens, pads included, so a window of
W lets the query at absolute position p see the keys at positions in (p - W, p]; pad keys never
take part. Packed sequences: ``cu_seqlens`` ``[N + 1]`` (B = 1, no mask, no state) holds the boundaries
of N sequences laid end to end along time; a query sees only keys of its own sequence (and, with a window,
the last W of them). The "recurrent" backend is eager math (QK^T, masked softmax; float64-capable), the
"chunk" backend is ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import host_sync_allowed, resolve_backend
from .boundary import op_result, prepare_inputs, zero_pads
from .checks import check_positive_int, check_same_device
from .dtypes import compute_dtype, without_autocast
from .packing import check_cu_seqlens, packed_sequence_ids
from .states import check_state_dict, check_state_tensor

__all__ = ["softmax_attention"]

_OP = "softmax_attention"


@without_autocast
def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | torch.Tensor | None = None,
    window: int | None = None,
    initial_state: dict[str, torch.Tensor] | None = None,
    output_final_state: bool = False,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_attentions: bool = False,
) -> tuple:
    """Causal (optionally sliding-window) softmax attention.

    scale: None -> dk ** -0.5; a number; or a tensor ``[H]`` (a learned per-head scale, as with
    QK-norm: q is multiplied by it and no further scale is applied).
    window: None -> full causal attention; W -> the query at position p sees keys in (p - W, p].
    k and v may have Hkv heads, a divisor of q's H (grouped-query attention, see the module docstring).
    Returns ``(o [B, T, H, dv], final_state)``; a final state with a window keeps only the last
    W - 1 positions. Padded queries give 0. ``cu_seqlens``: packed sequences (see the module docstring).
    ``output_attentions=True`` computes the explicit softmax (the "recurrent" backend's math, whatever
    ``backend`` says) and returns ``(o, final_state, weights)``, the weights ``[B, H, T, S]`` over the S = cached
    + new key positions that o is made of (0 where a key is not visible, a row of 0 for a padded query).
    """
    # a masked score times a NaN value is still NaN: the pads are zeroed
    (B, T, H, dk, dv), mask, (q, k, v) = prepare_inputs(_OP, q, k, v, mask, grouped_kv=True)
    Hkv = k.shape[2]
    cu_seqlens = check_cu_seqlens(_OP, cu_seqlens, B, T, q.device, mask)
    if cu_seqlens is not None and (initial_state is not None or output_final_state):
        raise ValueError(f"{_OP}: packed sequences (cu_seqlens) take no initial_state and give no final state")
    window = check_positive_int(_OP, "window", window, none_ok=True)
    # SDPA (the "chunk" backend) is the fast path on GPU: no fallback to report
    backend = resolve_backend(_OP, backend, q.device, "softmax attention runs on SDPA", log_fallback=False)
    # the reference computes in fp32/fp64; SDPA keeps the input dtype (and the cache in it) for its fast kernels
    cdt = compute_dtype(q.dtype) if backend == "recurrent" else q.dtype

    q = q.to(cdt)
    q, scale = _apply_scale(q, scale, H, dk)
    keys, values, key_mask = with_kv_cache(_OP, initial_state, k.to(cdt), v.to(cdt), mask, B, Hkv, dk, dv)
    Tc = keys.shape[1] - T
    query_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    # the state keeps Hkv heads; every backend computes on keys and values repeated to q's H heads
    k_all, v_all = repeat_kv_heads(keys, H // Hkv), repeat_kv_heads(values, H // Hkv)

    weights = None
    if output_attentions:
        allowed = visible_keys(query_mask, key_mask, Tc, window)
        if cu_seqlens is not None:
            seq = packed_sequence_ids(cu_seqlens, T)
            allowed = allowed & (seq[:, None] == seq[None, :])[None]
        weights = _probabilities(q, k_all, allowed, scale)
        o = torch.einsum("bhts,bshd->bthd", weights, v_all)
    elif backend != "recurrent" and Tc == 0 and mask is None and window is None and cu_seqlens is None:
        o = _sdpa(q, k_all, v_all, None, scale)  # plain causal: SDPA's flash/causal kernels
    elif backend != "recurrent" and Tc == 0 and mask is None and cu_seqlens is None and T > 2 * window:
        o = _sdpa_window_blocks(q, k_all, v_all, window, scale)  # O(T·W), not a [T, T] mask
    else:
        allowed = visible_keys(query_mask, key_mask, Tc, window)  # [B, T, S]
        if cu_seqlens is not None:  # Tc == 0: keys and queries are the same positions
            seq = packed_sequence_ids(cu_seqlens, T)
            allowed = allowed & (seq[:, None] == seq[None, :])[None]
        o = (_eager if backend == "recurrent" else _sdpa)(q, k_all, v_all, allowed, scale)
    final = kv_cache_state(keys, values, key_mask, window) if output_final_state else None
    result = op_result(o, mask, v.dtype, final, output_final_state)
    return result if weights is None else (*result, weights.to(v.dtype))


def repeat_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, S, Hkv, d]`` -> ``[B, S, Hkv·groups, d]``: query head h reads key/value head h // groups (grouped-query
    attention, as flash-attention, fla and transformers group them); ``x`` itself when ``groups`` is 1."""
    if groups == 1:
        return x
    B, S, Hkv, d = x.shape
    return x[:, :, :, None].expand(B, S, Hkv, groups, d).reshape(B, S, Hkv * groups, d)


def _apply_scale(q: torch.Tensor, scale, H: int, dk: int) -> tuple[torch.Tensor, float]:
    """Fold a per-head tensor scale into q; otherwise return the scalar scale."""
    if scale is None:
        return q, dk ** -0.5
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        if tuple(scale.shape) != (H,):
            raise ValueError(f"{_OP}: a tensor scale must have shape [H] = ({H},), got {tuple(scale.shape)}")
        check_same_device(_OP, q, scale=scale)
        return q * scale.to(q.dtype)[:, None], 1.0
    if isinstance(scale, torch.Tensor):
        return q * scale.to(q.dtype), 1.0
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return q, float(scale)
    raise TypeError(f"{_OP}: scale must be None, a number or a tensor [H], got {type(scale).__name__}")


def with_kv_cache(op: str, state, k, v, mask, B, H, dk, dv):
    """Concatenate the cached keys/values/mask (if any) in front of the new ones: the KV-cache state
    ``{"k", "v", "mask"}`` of the attention-like ops (softmax, sliding window, local-linear); errors name ``op``.
    ``H`` is the key/value heads the state must have (the op's Hkv under grouped-query attention)."""
    new_mask = mask if mask is not None else torch.ones(B, k.shape[1], dtype=torch.bool, device=k.device)
    if state is None:
        return k, v, new_mask
    check_state_dict(op, state, ("k", "v", "mask"))
    cached_k = state["k"]
    if not isinstance(cached_k, torch.Tensor) or cached_k.dim() != 4:
        got = tuple(cached_k.shape) if isinstance(cached_k, torch.Tensor) else type(cached_k).__name__
        raise ValueError(f"{op}: initial_state['k'] must have shape [B, Tc, H, dk] = ({B}, Tc, {H}, {dk}), "
                         f"got {got}")
    Tc = cached_k.shape[1]
    check_state_tensor(op, "initial_state['k']", state["k"], (B, Tc, H, dk), k.device)
    check_state_tensor(op, "initial_state['v']", state["v"], (B, Tc, H, dv), k.device)
    cache_mask = state["mask"]
    if not isinstance(cache_mask, torch.Tensor) or tuple(cache_mask.shape) != (B, Tc):
        got = tuple(cache_mask.shape) if isinstance(cache_mask, torch.Tensor) else type(cache_mask).__name__
        raise ValueError(f"{op}: initial_state['mask'] must have shape [B, Tc] = {(B, Tc)}, got {got}")
    cache_mask = (cache_mask if cache_mask.dtype == torch.bool else cache_mask != 0).to(k.device)
    # cached pads are zeroed like new ones (a state from elsewhere may hold anything there)
    cached_k, cached_v = zero_pads(cache_mask, state["k"].to(k.dtype), state["v"].to(v.dtype))
    return (
        torch.cat([cached_k, k], dim=1),
        torch.cat([cached_v, v], dim=1),
        torch.cat([cache_mask, new_mask], dim=1),
    )


def kv_cache_state(keys, values, key_mask, window: int | None) -> dict:
    """The state to hand on: all keys/values/mask, or the last ``window − 1`` with a window."""
    state = {"k": keys, "v": values, "mask": key_mask}
    if window is None:
        return state
    keep = window - 1
    return {name: x[:, x.shape[1] - min(keep, x.shape[1]):] for name, x in state.items()}


def fit_kv_cache(state: dict, length: int) -> dict:
    """A KV-cache state ``{"k", "v", "mask"}`` of exactly ``length`` positions, for a cache whose tensors keep one
    shape (``LazooCache(static=True)``): the last ``length`` positions, after masked zero slots when fewer were seen.
    Masked slots take no part in attention, and only relative positions matter, so the outputs do not change.
    Dropping a real position raises (where host syncs are allowed: not while compiled or captured)."""
    n = state["k"].shape[1]
    if n > length:
        if host_sync_allowed() and bool(state["mask"][:, :n - length].any()):
            raise ValueError(f"the static cache keeps {length} positions (max_cache_len) and this forward goes past "
                             "them: use a cache with a larger max_cache_len (generate sizes it to max_length)")
        return {name: x[:, n - length:] for name, x in state.items()}
    if n < length:
        return {name: torch.cat([x.new_zeros(x.shape[0], length - n, *x.shape[2:]), x], dim=1)
                for name, x in state.items()}
    return state


def visible_keys(query_mask, key_mask, Tc: int, window: int | None) -> torch.Tensor:
    """``[B, T, S]`` bool: which keys each query may see (causal over the positions of the ``Tc`` cached keys and
    the new ones, inside the window, real tokens only), for the attention-like ops with a KV cache."""
    T, S = query_mask.shape[1], key_mask.shape[1]
    device = key_mask.device
    p = torch.arange(T, device=device)[:, None] + Tc  # absolute query positions
    j = torch.arange(S, device=device)[None, :]
    visible = j <= p
    if window is not None:
        visible = visible & (j > p - window)
    return visible[None] & key_mask[:, None, :] & query_mask[:, :, None]


def _probabilities(q, k, allowed, scale):
    """softmax(QK^T) ``[B, H, T, S]`` over the visible keys; a row with no visible key is 0 (finite min fill, no
    NaN)."""
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    allowed = allowed[:, None]  # [B, 1, T, S]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * allowed  # zeros a row that had no visible key


def _eager(q, k, v, allowed, scale):
    """Explicit softmax(QK^T) V; a row with no visible key gives 0."""
    return torch.einsum("bhts,bshd->bthd", _probabilities(q, k, allowed, scale), v)


def _sdpa_window_blocks(q, k, v, window: int, scale):
    """Causal sliding-window attention in blocks of W = window queries: the queries of block j see keys in
    blocks j − 1 and j only, so SDPA runs on [B·T/W, H, W, 2W] tiles under one relative mask (block 0's
    left neighbour is padding and is masked out). Time and memory O(T·W) instead of a [T, T] mask."""
    B, T, H, dk = q.shape
    W = window
    nb = -(-T // W)
    pad = nb * W - T

    def blocks(x):  # [B, T, H, d] -> [B, nb, W, H, d], zero-padded at the end
        return F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, x.shape[-1])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    # keys of block j: block j − 1 (zeros before block 0) then block j
    k2 = torch.cat([F.pad(kb, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1], kb], dim=2)
    v2 = torch.cat([F.pad(vb, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1], vb], dim=2)
    i = torch.arange(W, device=q.device)[:, None]  # query offset in its block
    j = torch.arange(2 * W, device=q.device)[None, :] - W  # key offset relative to the block start
    rel = (j <= i) & (j > i - W)  # [W, 2W]: causal, inside the window
    first = rel & (j >= 0)  # block 0 has no left neighbour
    attn_mask = torch.stack([first, rel]) if nb > 1 else first[None]
    attn_mask = attn_mask[torch.clamp(torch.arange(nb, device=q.device), max=1)]  # [nb, W, 2W]
    attn_mask = attn_mask[None, :, None].expand(B, nb, 1, W, 2 * W).reshape(B * nb, 1, W, 2 * W)

    def heads_first(x):  # [B, nb, L, H, d] -> [B·nb, H, L, d]
        return x.reshape(B * nb, x.shape[2], H, x.shape[-1]).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads_first(qb), heads_first(k2), heads_first(v2), attn_mask=attn_mask,
                                       scale=scale)
    return o.transpose(1, 2).reshape(B, nb * W, H, v.shape[-1])[:, :T]


def _sdpa(q, k, v, allowed, scale):
    """SDPA with a boolean mask (None = plain causal). A row with no visible key (only a pad query has none, as a
    real query sees itself) is opened to all keys so that SDPA stays finite; the caller zeroes it."""
    if allowed is None:
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        ).transpose(1, 2)
    attn_mask = (allowed | ~allowed.any(-1, keepdim=True))[:, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale
    ).transpose(1, 2)
