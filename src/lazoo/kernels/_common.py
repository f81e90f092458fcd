"""Machinery that several kernel modules share: the tile prologues of the chunked kernels (which sequence,
chunk and state tile a program owns), the chunk maps of packed sequences, operand types and block sizes.

Chunked kernels (lazoo.kernels.linear, lazoo.kernels.gla) split every sequence into chunks of ``BT``
tokens that never straddle a packed sequence. Without ``cu_seqlens`` a row is a sample (B rows of T
tokens); with it, B = 1 and row i_n is the packed sequence ``cu_seqlens[i_n]:cu_seqlens[i_n + 1]``.
Per-chunk state buffers are ``[total chunks, H, K, V]``; initial and final states ``[N, H, V, K]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2, num_sms


# ============================================================================ tile prologues
@triton.jit
def seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(bos, T_seq, NT, boh): first token, length, chunk count and first chunk of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T_seq = (eos - bos).to(tl.int32)
        NT = (T_seq + BT - 1) // BT
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_seq = T
        NT = (T + BT - 1) // BT
        boh = i_n.to(tl.int64) * NT
    return bos, T_seq, NT, boh


@triton.jit
def state_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A state kernel's program on grid (NK * NV, N * H): (i_nh, i_h), its sequence (bos, T_seq, NT, boh as in
    ``seq_bounds``) and its [BK, BV] tile of the state (o_k, o_v, m_kv)."""
    i_kv, i_nh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_k, i_v = i_kv // NV, i_kv % NV
    i_h = i_nh % H
    bos, T_seq, NT, boh = seq_bounds(cu_seqlens, chunk_offsets, i_nh // H, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    return i_nh, i_h, bos, T_seq, NT, boh, o_k, o_v, m_kv


@triton.jit
def end_state(ptr, i_nh, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Pointers to a program's [BK, BV] tile of an initial or final state ``[N, H, V, K]`` (element (k, v) of head
    i_nh at v * K + k: the layout the ops hand over)."""
    return ptr + i_nh.to(tl.int64) * (V * K) + o_v[None, :] * K + o_k[:, None]


@triton.jit
def load_end_state(ptr, i_nh, o_k, o_v, m_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, USE: tl.constexpr):
    """A state kernel's starting [BK, BV] tile in fp32: the program's tile of ``ptr`` (``end_state``) when USE,
    else zeros."""
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE:
        b_h += tl.load(end_state(ptr, i_nh, o_k, o_v, K, V), mask=m_kv, other=0.0).to(tl.float32)
    return b_h


@triton.jit
def store_chunk_state(ptr, b_h, i_tg, i_h, o_k, o_v, m_kv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Store a program's [BK, BV] tile of the state of global chunk i_tg (buffer ``[chunks, H, K, V]``)."""
    p_h = ptr + (i_tg * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    tl.store(p_h, b_h.to(ptr.dtype.element_ty), mask=m_kv)


@triton.jit
def chunk_bounds(cu_seqlens, chunk_indices, i_t, i_bh, T, H: tl.constexpr, BT: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """(i_h, bos, T_seq, i_c, i_tg) for program chunk i_t of row i_bh (sample or sequence, head): the head,
    sequence start and length, chunk index in the sequence, and global chunk index (into the state buffers)."""
    i_b, i_h = i_bh // H, i_bh % H
    NT_b = (T + BT - 1) // BT
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T_seq = (eos - bos).to(tl.int32)
        i_tg = i_t.to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        T_seq = T
        i_c = i_t
        i_tg = i_b.to(tl.int64) * NT_b + i_t
    return i_h, bos, T_seq, i_c, i_tg


@triton.jit
def dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with operands cast to DT (a no-op for tiles loaded raw) and fp32 (fp64) accumulation."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


# ============================================================================ chunk maps
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


class ChunkLayout:
    """Shapes and chunk maps of one call of a chunked kernel (q ``[B, T, H, K]``, v ``[B, T, H, V]``, chunks of
    ``BT`` tokens): N sequences, NT chunks in all, and with ``cu_seqlens`` the maps ``prepare_varlen`` builds
    (else None)."""

    def __init__(self, q, v, cu_seqlens, BT: int):
        B, T, H, K = q.shape
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, v.shape[-1]
        self.BT = BT
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.N = len(cu_seqlens) - 1
            self.chunk_offsets, self.chunk_indices, self.NT = prepare_varlen(cu_seqlens, BT)
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


# ============================================================================ launching
_CONFIG_INDEX: dict = {}


def launch_first_fitting(kernel, grid, key, configs, *args, **meta):
    """Launch with the first of ``configs`` (meta-parameters) that fits the GPU's resources, remembering it per
    ``key`` (no benchmarking: device time is scarce, and shapes vary). ``grid(config)`` gives the grid; keys are
    shared by every module, so they name their kernel."""
    from triton.runtime.errors import OutOfResources

    if torch.compiler.is_compiling():  # traced: the config found eagerly (a traced launch cannot be retried)
        config = configs[_CONFIG_INDEX.get(key, 0)]
        kernel[grid(config)](*args, **meta, **config)
        return config
    for i in range(_CONFIG_INDEX.get(key, 0), len(configs)):
        try:
            kernel[grid(configs[i])](*args, **meta, **configs[i])
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _CONFIG_INDEX[key] = i
        return configs[i]


def dqkv_configs(BK: int, V: int, two_byte: bool, first_bv: int = 64) -> list[dict]:
    """Launch settings, best first, of a chunk kernel that holds a chunk's whole key rows (BK wide) and walks the
    values in blocks of BV (the dq, dk, dv kernels): smaller value blocks where the first does not fit."""
    warps = 8 if BK >= 128 else 4
    return [dict(BV=min(first_bv if two_byte or BK <= 64 else 32, next_pow2(V)), num_warps=warps, num_stages=1),
            dict(BV=min(32, next_pow2(V)), num_warps=warps, num_stages=1),
            dict(BV=16, num_warps=8, num_stages=1)]


# ============================================================================ types and block sizes
def dot_types(x: torch.Tensor):
    """(Triton dot-operand dtype, precision of fp32 products) for inputs of x's dtype."""
    if x.dtype == torch.float32:
        return tl.float32, "tf32x3"  # three tf32 passes: about fp32 accuracy on the tensor cores
    return (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16), "tf32"


def chunk_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-chunk states' dtype for inputs of ``dtype``: bf16 states keep the fp32 range and halve their
    traffic; fp16 could overflow."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def state_blocks(K: int, V: int, max_block: int = 64):
    """(BK, BV) for the sequential state kernels. (Value blocks of 32 where the tiles of 64 gave an SM fewer than two
    programs made the walks slower on an H100: ELA sum_sq_euclid fwd + bwd at T = 8k 2.694 against 2.490 ms, linear
    attention at 32k 1.779 against 1.720; GLA within 1 % either way.)"""
    return min(max_block, next_pow2(K)), min(max_block, next_pow2(V))


# ============================================================================ state walks in segments
# A state walk is sequential in its chunks. Where few sequences × heads × state tiles would leave most SMs idle
# (long T, small batch), each sequence's walk is split into S segments that run side by side (grid axis 2): the
# segments' sums first (``segment_bounds``' programs without per-chunk stores), their prefix sums (``segment_starts``,
# ``segment_ends``), then the walks from each segment's start. Not for packed sequences (their chunk counts are on
# the GPU), nor with a decay (the starts would carry the sums through the decays between: built once, and slower on
# an H200 at T = 32k, 4.33 against 2.89 ms). A segmented walk is two walks of NT / S chunks in place of one of NT:
# fewer than MIN_SEGMENTS segments barely shorten it.
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
    Returns the walk's last states where ``want_last``, else None. ``totals_only`` (the non-causal form): each sequence's sums alone, no
    chunk's state."""
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


def fill_device(BV: int, V: int, parallel: int, device: torch.device, per_sm: float = 2) -> int:
    """The value block BV of a kernel run by ``parallel * cdiv(V, BV)`` programs, halved (down to 16) until
    there are ``per_sm`` programs per multiprocessor: few sequences x heads would leave most of the GPU idle."""
    while BV > 16 and parallel * triton.cdiv(V, BV) < per_sm * num_sms(device):
        BV //= 2
    return BV
