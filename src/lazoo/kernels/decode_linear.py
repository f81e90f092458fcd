"""The input products of a decode step in one Triton launch each, the weights read where they are.

A decode step multiplies a few rows (the batch) by several weight matrices: a mixer's q, k, v and gate projections,
a gated MLP's gate and up. Launch latency, not work, sets their time at these sizes, so one launch should do them
all; stacking the weights into one matrix for one cuBLAS product copies them every step (their values may change
between steps), and keeping a stacked copy doubles their memory. Here the programs of one launch split the output
columns of every weight among them, each reading its own weight's rows in place:

    linear_many(x, [W_1, ..., W_n], [b_1, ..., b_n])  -> [x W_1ᵀ + b_1, ..., x W_nᵀ + b_n]
                                                         (views of one [M, Σ N_i] output; any b_i may be None)
    gated_linear_unit(x, W_g, W_u, act)    -> act(x W_gᵀ) · (x W_uᵀ)   (a gated MLP before its down projection)

Each product accumulates in float32 (float64 for float64 inputs, the interpreter's tests), adds its bias there and
is rounded to the input dtype once, as cuBLAS rounds ``F.linear``'s output (its bias added in the epilogue); the
gated unit rounds its two products, the activation and the result to the input dtype where the unfused module stores
them, so both agree up to the order of the sums. Meant for the few rows of a decode step (``MAX_ROWS``); larger
inputs keep cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2
from .limits import DECODE_LINEAR_MAX_ROWS as MAX_ROWS
from .limits import DECODE_LINEAR_MAX_WEIGHTS as MAX_WEIGHTS

OP = "decode_linear"
#: programs a launch aims at (about a Hopper card's multiprocessors), so every one reads its share of the weights; a
#: constant rather than the device's count, which a compiled decode step would have to trace
PROGRAMS_WANTED = 128
#: activations of ``gated_linear_unit``, by transformers' names, and their codes in the kernel
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "relu": 3, "relu2": 4}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _product_tile(x, sx, w, M, K, N, i_m, i_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  CT: tl.constexpr, PREC: tl.constexpr):
    """Rows ``i_m`` and columns ``i_n`` (blocks of BM and BN) of x Wᵀ, x ``[M, K]`` with row stride ``sx``, W
    ``[N, K]`` contiguous: the [BM, BN] tile, accumulated in CT."""
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m = o_m < M
    m_n = o_n < N
    acc = tl.zeros([BM, BN], dtype=CT)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(x + o_m[:, None].to(tl.int64) * sx + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
        b_w = tl.load(w + o_n[None, :].to(tl.int64) * K + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0)
        acc = tl.dot(b_x, b_w, acc, input_precision=PREC)
    return acc


@triton.jit
def _pick(here, w, b, hb, n, col, first, w_i, b_i, hb_i, n_i, col_i, first_i):
    """The weight, bias, has-a-bias flag, width, first column and first column block of weight i where ``here``,
    else those given."""
    return (tl.where(here, w_i, w), tl.where(here, b_i, b), tl.where(here, hb_i, hb), tl.where(here, n_i, n),
            tl.where(here, col_i, col), tl.where(here, first_i, first))


@triton.jit
def _linear_many_kernel(
    x, sx, out, so, M, K,
    w0, w1, w2, w3, w4, w5, w6, w7,
    b0, b1, b2, b3, b4, b5, b6, b7,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr,
    N4: tl.constexpr, N5: tl.constexpr, N6: tl.constexpr, N7: tl.constexpr,
    NW: tl.constexpr, HB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid (column blocks of all NW weights, row blocks): program (j, i) computes one [BM, BN] tile of the weight
    whose column blocks j falls in (weight i's blocks follow weight i − 1's), into its columns of ``out``. The
    weight, its bias, its width and its first column are picked by comparisons, so the product is compiled once.
    Bit i of HB: weight i has a bias (b_i; otherwise b_i points to at least N_i values, read and not used)."""
    j = tl.program_id(0)
    i_m = tl.program_id(1)
    w, b, hb, n, col, first = w0, b0, j * 0 + (HB & 1), j * 0 + N0, j * 0, j * 0
    start = (N0 + BN - 1) // BN  # weight i's first column block
    offset = N0  # and its first output column
    for i in tl.static_range(1, NW):  # unrolled: i is known when the weight and its width are picked
        w_i = w1 if i == 1 else w2 if i == 2 else w3 if i == 3 else w4 if i == 4 else w5 if i == 5 else w6 if i == 6 \
            else w7
        b_i = b1 if i == 1 else b2 if i == 2 else b3 if i == 3 else b4 if i == 4 else b5 if i == 5 else b6 if i == 6 \
            else b7
        n_i = N1 if i == 1 else N2 if i == 2 else N3 if i == 3 else N4 if i == 4 else N5 if i == 5 else N6 if i == 6 \
            else N7
        w, b, hb, n, col, first = _pick(j >= start, w, b, hb, n, col, first, w_i, b_i, (HB >> i) & 1, n_i, offset,
                                        start)
        start = start + (n_i + BN - 1) // BN
        offset = offset + n_i
    i_n = j - first
    acc = _product_tile(x, sx, w, M, K, n, i_m, i_n, BM, BN, BK, CT, PREC)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    if HB != 0:  # the bias added before the one rounding (a weight without one reads its own first row, unused)
        bias = tl.load(b + o_n, mask=o_n < n, other=0).to(CT)
        acc += tl.where(hb != 0, bias, 0.0)[None, :]
    m = (o_m < M)[:, None] & (o_n < n)[None, :]
    tl.store(out + o_m[:, None].to(tl.int64) * so + col + o_n[None, :], acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """``ACTIVATION_CODES``' activation of g (in its compute dtype)."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))  # tanh(inner)
    elif ACT == 3:
        return tl.maximum(g, 0.0)
    else:
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _gated_unit_kernel(x, sx, wg, wu, out, so, M, K, N, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, CT: tl.constexpr, PREC: tl.constexpr):
    """Grid (column blocks, row blocks): one [BM, BN] tile of act(x W_gᵀ) · (x W_uᵀ), each value rounded to the
    output dtype where the unfused module stores it."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    DT = out.dtype.element_ty
    g = _product_tile(x, sx, wg, M, K, N, i_m, i_n, BM, BN, BK, CT, PREC).to(DT).to(CT)
    u = _product_tile(x, sx, wu, M, K, N, i_m, i_n, BM, BN, BK, CT, PREC).to(DT).to(CT)
    y = _activation(g, ACT).to(DT).to(CT) * u
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m = (o_m < M)[:, None] & (o_n < N)[None, :]
    tl.store(out + o_m[:, None].to(tl.int64) * so + o_n[None, :], y.to(DT), mask=m)


# ============================================================================ launchers
def check_supported(x: torch.Tensor, weights: list[torch.Tensor], biases: list | None = None) -> str | None:
    """None when these kernels compute x's products with ``weights`` (a decode step's few rows, weights read in
    place) and ``biases`` (None, or one per weight, each None or ``[N_i]``), else why not."""
    if x.dtype not in _DTYPES:
        return f"{OP}: takes float16/bfloat16/float32 inputs (float64 in the interpreter), not {x.dtype}"
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        return f"{OP}: takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}"
    K = x.shape[-1]
    rows = x.numel() // max(K, 1)
    if rows > MAX_ROWS or rows == 0:
        return f"{OP}: takes 1 to {MAX_ROWS} rows (a decode step's batch), got {rows}"
    for w in weights:
        if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
            return (f"{OP}: every weight must be a contiguous [N, {K}] matrix of x's dtype and device, got "
                    f"{w.dtype} {tuple(w.shape)} on {w.device}")
    if biases is not None:
        if len(biases) != len(weights):
            return f"{OP}: {len(biases)} biases for {len(weights)} weights"
        for w, b in zip(weights, biases):
            if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device
                                  or not b.is_contiguous()):
                return (f"{OP}: a bias must be a contiguous [{w.shape[0]}] vector of x's dtype and device, got "
                        f"{b.dtype} {tuple(b.shape)} on {b.device}")
    return None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as ``[M, K]`` rows with unit column stride, read in place where its rows are evenly strided."""
    K = x.shape[-1]
    flat = x.reshape(-1, K) if x.dim() != 2 else x
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.stride(0)


def _tiles(x: torch.Tensor, blocks_wanted: int, columns: int) -> dict:
    """Block sizes: one block of rows (at most MAX_ROWS; tl.dot's smallest is 16), and column blocks narrow enough
    that the launch has about ``blocks_wanted`` programs (every multiprocessor reading its share of the weights)."""
    M, K = x.shape
    BN = 64
    while BN > 16 and triton.cdiv(columns, BN) < blocks_wanted:
        BN //= 2
    CT = tl.float64 if x.dtype == torch.float64 else tl.float32
    return dict(BM=max(16, next_pow2(M)), BN=BN, BK=min(128, max(16, next_pow2(K))), CT=CT,
                PREC="ieee" if x.dtype in (torch.float32, torch.float64) else "tf32")


def linear_many(x: torch.Tensor, weights: list[torch.Tensor], biases: list | None = None) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` in one launch (module docstring): views of one
    ``[..., Σ N]`` tensor. x ``[..., K]`` with at most ``MAX_ROWS`` rows; weights ``[N_i, K]`` contiguous, of x's
    dtype and device; ``biases`` None or one per weight, each None or ``[N_i]``."""
    reason = check_supported(x, weights, biases)
    if reason is not None:
        raise ValueError(reason)
    return launch_many(x, weights, biases)


def launch_many(x: torch.Tensor, weights: list[torch.Tensor], biases: list | None = None) -> list[torch.Tensor]:
    """``linear_many`` for inputs that ``check_supported`` has passed (a decode step's caller checks once)."""
    widths = [w.shape[0] for w in weights]
    biases = list(biases) if biases is not None else [None] * len(weights)
    has_bias = sum(1 << i for i, b in enumerate(biases) if b is not None)
    x2, sx = _rows(x)
    M, K = x2.shape
    out = torch.empty(M, sum(widths), device=x.device, dtype=x.dtype)
    cfg = _tiles(x2, PROGRAMS_WANTED, sum(widths))
    blocks = sum(triton.cdiv(n, cfg["BN"]) for n in widths)
    padded = list(weights) + [weights[0]] * (MAX_WEIGHTS - len(weights))
    # a weight without a bias passes itself (its first row: as many values as a bias, never used)
    bias_args = [b if b is not None else w for w, b in zip(weights, biases)]
    bias_args += [weights[0]] * (MAX_WEIGHTS - len(weights))
    sizes = {f"N{i}": (widths[i] if i < len(widths) else 0) for i in range(MAX_WEIGHTS)}
    _linear_many_kernel[(blocks, triton.cdiv(M, cfg["BM"]))](
        x2, sx, out, out.stride(0), M, K, *padded, *bias_args, **sizes, NW=len(weights), HB=has_bias, **cfg,
        num_warps=4)
    return list(out.view(*x.shape[:-1], -1).split(widths, dim=-1))


def gated_linear_unit(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(F.linear(x, w_gate)) · F.linear(x, w_up)`` in one launch (module docstring). x ``[..., K]`` with at most
    ``MAX_ROWS`` rows; the weights ``[N, K]`` contiguous, of x's dtype and device; ``act`` one of
    ``ACTIVATION_CODES``."""
    if act not in ACTIVATION_CODES:
        raise ValueError(f"{OP}: unknown activation {act!r}; known: {', '.join(ACTIVATION_CODES)}")
    reason = check_supported(x, [w_gate, w_up])
    if reason is None and w_gate.shape != w_up.shape:
        reason = f"{OP}: the gate and up weights must have one shape, got {tuple(w_gate.shape)} and {tuple(w_up.shape)}"
    if reason is not None:
        raise ValueError(reason)
    return launch_gated_unit(x, w_gate, w_up, act)


def launch_gated_unit(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str) -> torch.Tensor:
    """``gated_linear_unit`` for inputs that ``check_supported`` has passed, the weights of one shape and ``act`` a
    known activation (a gated MLP's own)."""
    N = w_gate.shape[0]
    x2, sx = _rows(x)
    M, K = x2.shape
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    cfg = _tiles(x2, PROGRAMS_WANTED, N)
    _gated_unit_kernel[(triton.cdiv(N, cfg["BN"]), triton.cdiv(M, cfg["BM"]))](
        x2, sx, w_gate, w_up, out, out.stride(0), M, K, N, ACT=ACTIVATION_CODES[act], **cfg, num_warps=4)
    return out.view(*x.shape[:-1], N)
