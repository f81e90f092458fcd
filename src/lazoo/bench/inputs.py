"""Inputs and references several benchmarks use: unit-norm queries and keys with standard normal values (as the
normalised mixers feed their ops), a scalar decay a head, and causal SDPA on lazoo's ``[B, T, H, D]`` layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unit_qkv(B, T, H, D, dtype, device, gen) -> dict:
    """``{"q", "k", "v"}`` ``[B, T, H, D]`` in ``dtype``: q and k L2-normalised, v standard normal, drawn in fp32
    from ``gen`` in that order."""
    q, k, v = (torch.randn(B, T, H, D, device=device, generator=gen) for _ in range(3))
    return {"q": F.normalize(q, dim=-1).to(dtype), "k": F.normalize(k, dim=-1).to(dtype), "v": v.to(dtype)}


def head_decay(B, T, H, dtype, device, gen):
    """A log decay ``[B, T, H]`` a token and head, close to 0 (``logsigmoid`` of N(4, 1): most gates near 0.98),
    the gated mechanisms' scalar gate."""
    return F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen) + 4).to(dtype)


def with_head_decay(make):
    """The input maker ``make`` (``(B, T, H, D, dtype, device, gen) -> dict``) with a ``head_decay`` ``g`` added,
    drawn after ``make``'s inputs."""
    def make_with_decay(B, T, H, D, dtype, device, gen):
        x = make(B, T, H, D, dtype, device, gen)
        x["g"] = head_decay(B, T, H, dtype, device, gen)
        return x

    return make_with_decay


def causal_sdpa(q, k, v):
    """Causal ``scaled_dot_product_attention`` of ``[B, T, H, D]`` tensors, the output in the same layout."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
