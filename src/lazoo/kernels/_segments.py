"""State walks in segments. A state walk is sequential in its chunks. Where few sequences × heads × state tiles would
leave most SMs idle (long T, small batch), each sequence's walk is split into S segments that run side by side (grid
axis 2): the segments' sums first (``segment_bounds``' programs without per-chunk stores), their prefix sums
(``segment_starts``, ``segment_ends``), then the walks from each segment's start. Not for packed sequences (their
chunk counts are on the GPU), nor with a decay (the starts would carry the sums through the decays between: built
once, and slower on an H200 at T = 32k, 4.33 against 2.89 ms). A segmented walk is two walks of NT / S chunks in
place of one of NT: fewer than MIN_SEGMENTS segments barely shorten it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._chunk_layout import ChunkLayout
from ._utils import num_sms

SEGMENT_PROGRAMS_PER_SM = 4
SEGMENT_MIN_CHUNKS = 16
MIN_SEGMENTS = 4


@triton.jit
def segment_bounds(i_nh, NT, SEG: tl.constexpr):
    """(row of the program's start and end states ``[N, H, S, ...]``, first chunk, chunk past the last) of a state
    program on grid axis 2 (segments of SEG chunks; SEG = 0: one walk over the sequence, row i_nh)."""
    i_s = tl.program_id(2)
    lo = i_s * SEG
    hi = NT
    if SEG > 0:
        hi = tl.minimum(lo + SEG, NT)
    return i_nh * tl.num_programs(2) + i_s, lo, hi


def walk_segments(layout: ChunkLayout, programs: int, device, force: int | None = None,
                  min_segments: int = MIN_SEGMENTS) -> int:
    """Chunks per segment of a layout's state walks run by ``programs`` programs, or 0 for one walk per sequence
    (``force``: that many chunks per segment, for tests and benchmarks)."""
    if layout.varlen or programs == 0:
        return 0
    chunks = triton.cdiv(layout.T, layout.BT)
    if force:
        return force if force < chunks else 0
    segments = min(triton.cdiv(SEGMENT_PROGRAMS_PER_SM * num_sms(device), programs), chunks // SEGMENT_MIN_CHUNKS)
    return triton.cdiv(chunks, segments) if segments >= min_segments else 0


def segment_starts(sums: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    """Each segment's starting state ``[N, H, S, ...]`` from the segments' sums: the sums before it, plus ``first``
    (the initial state ``[N, H, ...]``, or None)."""
    starts = sums.cumsum(2) - sums
    return starts if first is None else starts + first.float()[:, :, None]


def segment_ends(sums: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """Each segment's end-state gradient ``[N, H, S, ...]`` from the segments' sums of gradients: the sums after it,
    plus ``last`` (the final state's gradient, or None)."""
    ends = sums.flip(2).cumsum(2).flip(2) - sums
    return ends if last is None else ends + last.float()[:, :, None]


def state_walks(launch, layout: ChunkLayout, seg: int, first, want_last: bool, end_states, reverse: bool,
                totals_only: bool = False):
    """A state kernel's walks over every sequence (or, ``reverse``, the gradients' walks back), one walk each or in
    segments of ``seg`` chunks (``walk_segments``). States are tuples of parts (one tensor, or several).

    ``launch(S, SEG, start, end, store_chunks)`` runs the kernel with S segments on grid axis 2, from the states
    ``start`` (None: zeros) to the states ``end`` (None: not stored); ``end_states(S)`` makes end-state buffers
    (``[N, H, ...]`` parts, or ``[N, H, S, ...]`` for S segments); ``first``: the walk's given start, or None.
    Returns the walk's last states where ``want_last``, else None. ``totals_only`` (the non-causal form): each
    sequence's sums alone, no chunk's state."""
    if not seg:
        last = end_states(None) if want_last else None
        launch(1, 0, first, last, not totals_only)
        return last
    S = triton.cdiv(triton.cdiv(layout.T, layout.BT), seg)
    sums = end_states(S)
    launch(S, seg, None, sums, False)
    if totals_only:
        return tuple(None if x is None else x.sum(2) for x in sums)
    carry = segment_ends if reverse else segment_starts
    first = first if first is not None else (None,) * len(sums)
    starts = tuple(None if x is None else carry(x, f) for x, f in zip(sums, first))
    launch(S, seg, starts, None, True)
    if not want_last:
        return None
    end = 0 if reverse else -1  # the walk's last segment: the sequence's end, or (reverse) its start
    return tuple(None if x is None else st[:, :, end] + x[:, :, end] for st, x in zip(starts, sums))
