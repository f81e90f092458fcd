"""The chunks of one call of a chunked kernel: N sequences (B samples, or the packed sequences of ``cu_seqlens``),
NT chunks of ``BT`` tokens in all, and for packed sequences the maps from a program's chunk to its sequence."""

from __future__ import annotations

import torch
import triton

from ._tensor_cache import cached_on


def prepare_varlen(cu_seqlens: torch.Tensor, BT: int):
    """(chunk_offsets [N+1], chunk_indices [NT, 2] of (sequence, chunk in sequence), NT)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    nchunks = (lens + BT - 1) // BT
    chunk_offsets = torch.zeros(len(lens) + 1, dtype=torch.int64, device=cu_seqlens.device)
    chunk_offsets[1:] = nchunks.cumsum(0)
    counts = nchunks.tolist()
    NT = int(sum(counts))
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), nchunks, output_size=NT)
    within = torch.arange(NT, device=cu_seqlens.device) - chunk_offsets[:-1][seq]
    chunk_indices = torch.stack([seq, within], 1).contiguous()
    return chunk_offsets, chunk_indices, NT


def cached_uniform(cache: dict, key: tuple, device, build):
    """``build()``'s chunk table for a uniform batch, built once per ``key``: every layer of a training step or a
    prefill needs the same one, and building it is a handful of small tensor ops whose host time counts where the
    host sets the pace. Not cached while torch.compile traces or a CUDA graph is captured (a table made there belongs
    to that graph). Bounded: a run over many shapes keeps the newest 64."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return build()
    table = cache.get(key)
    if table is None:
        if len(cache) >= 64:
            cache.clear()
        table = cache[key] = build()
    return table


class ChunkLayout:
    """Shapes and chunk maps of one call of a chunked kernel (q ``[B, T, H, K]``, v ``[B, T, H, V]``, chunks of
    ``BT`` tokens): N sequences, NT chunks in all, and with ``cu_seqlens`` the maps ``prepare_varlen`` builds
    (else None), once per ``cu_seqlens`` tensor (``_tensor_cache``)."""

    def __init__(self, q, v, cu_seqlens, BT: int):
        B, T, H, K = q.shape
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, v.shape[-1]
        self.BT = BT
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.N = len(cu_seqlens) - 1
            self.chunk_offsets, self.chunk_indices, self.NT = cached_on(
                cu_seqlens, ("chunk_maps", BT), lambda: prepare_varlen(cu_seqlens, BT))
            self.cu = cu_seqlens
        else:
            self.N = B
            self.NT = B * triton.cdiv(T, BT)
            self.chunk_offsets = self.chunk_indices = self.cu = None

    def grid(self, *lead):
        """A chunk kernel's grid: (lead..., chunks, B * H), or (lead..., total chunks, H) with cu_seqlens."""
        if self.varlen:
            return (*lead, self.NT, self.H)
        return (*lead, triton.cdiv(self.T, self.BT), self.B * self.H)
