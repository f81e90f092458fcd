"""Packed sequences: ``cu_seqlens`` ``[N + 1]`` (B = 1, N sequences one after another along time) checked, made
from ``position_ids`` that restart at 0, and each position's sequence and offset in it; the PyTorch backends run
one sequence at a time."""

from __future__ import annotations

import torch

from ..kernels._tensor_cache import cached_on


def check_cu_seqlens(op: str, cu_seqlens, B: int, T: int, device, mask=None):
    """Validate ``cu_seqlens`` (None passes): 1-D ints from 0 to T, non-decreasing, with B = 1.
    Ops that cannot combine it with a mask pass theirs to have that refused."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be an integer torch.Tensor [N + 1], "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must have shape [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{op}: cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the sequences are packed along time, so B must be 1, got B={B}")
    if mask is not None:
        raise ValueError(f"{op}: pass either mask or cu_seqlens, not both")
    cached_on(cu_seqlens, ("checked", T), lambda: _check_bounds(op, cu_seqlens, T))
    if cu_seqlens.device == torch.device(device) and cu_seqlens.dtype == torch.int64:
        return cu_seqlens
    return cached_on(cu_seqlens, ("int64", str(device)), lambda: cu_seqlens.to(device=device, dtype=torch.int64))


def _check_bounds(op: str, cu_seqlens: torch.Tensor, T: int) -> bool:
    bounds = cu_seqlens.detach().to("cpu", torch.int64)  # a read-back: once for a tensor every layer is handed
    if bounds[0] != 0 or bounds[-1] != T or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must start at 0, end at T={T} and never decrease, "
                         f"got {bounds.tolist()}")
    return True


def run_per_sequence(run, cu_seqlens, initial_state, output_final_state: bool, q, v):
    """The PyTorch backends on packed sequences: ``run(time_slice, state_n) -> (o, state_n)`` for each
    sequence, with ``initial_state`` (a tensor or a dict of tensors) holding one entry per sequence."""
    from torch.utils._pytree import tree_map

    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        state = tree_map(lambda x: x[n:n + 1], initial_state)
        if e > s:
            o, state = run(slice(s, e), state)
            outs.append(o)
        finals.append(state)
    o = torch.cat(outs, 1) if outs else q.new_zeros(1, 0, q.shape[2], v.shape[-1], dtype=v.dtype)
    if not output_final_state:
        return o, None
    return o, tree_map(lambda *parts: torch.cat(parts, 0), finals[0], *finals[1:])


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The boundaries ``[N + 1]`` (int64) of packed sequences whose ``position_ids`` ``[1, T]`` restart at 0
    at every sequence start (transformers' ``DataCollatorWithFlattening``), or None when they never restart
    (``position_ids[0, t] == 0`` for no ``t > 0``): a single sequence. The first token always starts one."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    starts = (position_ids[0, 1:] == 0).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    T = position_ids.shape[1]
    edge = torch.tensor([0], dtype=torch.int64, device=position_ids.device)
    return torch.cat([edge, starts.to(torch.int64), edge + T])


def packed_row_starts(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """``[T]`` int32 on ``device``: the first position of every packed position's sequence (the short convolution
    kernel's packed form), kept on ``cu_seqlens`` for the layers after the first."""
    def build():
        cu = cu_seqlens.to(device)
        return cu[packed_sequence_ids(cu, T)].to(torch.int32)
    return cached_on(cu_seqlens, ("row_starts", T, str(device)), build)


def packed_offsets(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64: the offset of every packed position within its own sequence (0 at each start)."""
    return torch.arange(T, device=cu_seqlens.device) - cu_seqlens[packed_sequence_ids(cu_seqlens, T)]


def packed_sequence_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64: the index of the packed sequence each position belongs to."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=cu_seqlens.device), right=True)
