"""One decode step of a Mamba-2 layer, from its in_proj's output to its out_proj's input, in two Triton launches.

For one token, with ``[z, x, B, C, dt]`` the layer's projections (lazoo.layers.mixers.mamba2):

    [x, B, C] = silu(conv1d([x, B, C]) + bias)          (the conv state shifts by the new input)
    dt = softplus(dt + dt_bias),  A = −exp(A_log)
    S  = exp(dt·A) S + dt·x Bᵀ,   y = S C + D·x         (S ``[P, N]`` per head, fp32; B and C of the head's group)
    out = w · RMSNorm_G(y · silu(z))                     (the gate, then an RMSNorm over each group of heads)

The first kernel, one program per (sample, head, block of the head's P channels), does everything up to the gated
y and the sum of its squares; the second, one program per (sample, head), scales each head's gated y by its group's
RMS and shifts the conv state of B and C. Two things cross the programs of the first, so they wait for the second:

- the norm spans a group of heads (with one group, as in Bamba, all heads of a sample): each head's scale needs
  every head's y, so every state update first. One program per group would update its heads' states one after the
  other on one multiprocessor (128 states of 32 KB at batch 1); a handshake between programs through atomics
  would need a counter zeroed each step (a launch again) or kept across calls (unsafe beside other streams);
- the heads of a group all read the conv state of its B and C, so none may shift it in place while another
  may still read it.

Each conv-state channel and each state row has one writer, so both update in place (a static cache) with no race.
A pad (mask 0) keeps S, outputs 0 and shifts a zero into the conv state, as the unfused layer does. Values pass
through the input dtype where the unfused layer stores them (the convolution's output, dt·x, the SSD's output,
y), so both give the same numbers up to the order of the sums; fp64 inputs are computed in fp64 (the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._step_parts import TL_DTYPES, conv_rows, conv_silu, conv_silu_shift, rows, shift_conv_state
from ._utils import next_pow2
from .limits import MAMBA2_STEP_MAX_STATE_SIZE

OP = "mamba2_step"
#: elements of a program's block of the state (rows of the head dim P by the whole state size N)
STATE_TILE = 4096


@triton.jit
def _mamba2_state_kernel(
    z, sz, xbc, sx, dt, sdt,
    cs, cs_b, co, co_b, conv_w, conv_b,
    dt_bias, A_log, D, S, S_out, mask, gated, sums,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, NPB: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
):
    """Program (sample, head, block of P): the convolution of its x channels (shifting their state) and of its
    group's B and C (leaving their state), the state update and read-out of its rows, the gated y (``gated``, CT)
    and its sum of squares (``sums`` ``[B, H, NPB]``). DT: the inputs' dtype; CT: the compute dtype."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    i_g = i_h // (H // G)
    C = H * P + 2 * G * N  # channels of the convolution
    real = True
    if HAS_MASK:
        real = tl.load(mask + i_b) != 0
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    c_B = H * P + i_g * N + o_n
    c_C = c_B + G * N
    x = tl.where(real, tl.load(xbc + i_b * sx + c_B, mask=m_n, other=0).to(CT), 0.0)
    b_B = conv_silu(x, cs, conv_w, conv_b, i_b, c_B, m_n, cs_b, C, W, WP, HAS_BIAS, DT, CT)
    x = tl.where(real, tl.load(xbc + i_b * sx + c_C, mask=m_n, other=0).to(CT), 0.0)
    b_C = conv_silu(x, cs, conv_w, conv_b, i_b, c_C, m_n, cs_b, C, W, WP, HAS_BIAS, DT, CT)
    step = tl.load(dt + i_b * sdt + i_h).to(CT) + tl.load(dt_bias + i_h).to(CT)
    step = tl.where(step > 20.0, step, tl.log(1.0 + tl.exp(step)))  # softplus, as torch's (threshold 20)
    decay = tl.exp(-step * tl.exp(tl.load(A_log + i_h).to(CT)))
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    c_x = i_h * P + o_p
    x = tl.load(xbc + i_b * sx + c_x, mask=m_p, other=0).to(CT)
    b_x = conv_silu_shift(x, cs, conv_w, conv_b, i_b, c_x, m_p, real, cs_b, C, W, WP, HAS_BIAS, co, co_b, DT, CT)
    b_v = (step * b_x).to(DT).to(CT)
    p_s = ((i_b * H + i_h) * P + o_p[:, None]) * N + o_n[None, :]
    m_s = m_p[:, None] & m_n[None, :]
    s_old = tl.load(S + p_s, mask=m_s, other=0).to(CT)
    b_s = decay * s_old + b_v[:, None] * b_B[None, :]
    b_o = tl.sum(b_s * b_C[None, :], 1).to(DT).to(CT)
    b_y = (b_o + tl.load(D + i_h).to(CT) * b_x).to(DT).to(CT)
    b_s = tl.where(real, b_s, s_old)  # a pad keeps the state and outputs 0
    b_y = tl.where(real, b_y, 0.0)
    tl.debug_barrier()  # every copy of S read before any is written (S_out may be S)
    tl.store(S_out + p_s, b_s.to(S_out.dtype.element_ty), mask=m_s)
    gate = tl.load(z + i_b * sz + c_x, mask=m_p, other=0).to(CT)
    b_h = tl.where(m_p, b_y * (gate / (1.0 + tl.exp(-gate))), 0.0)
    tl.store(gated + i_b * (H * P) + c_x, b_h, mask=m_p)
    tl.store(sums + (i_b * H + i_h) * NPB + i_p, tl.sum(b_h * b_h, 0))


@triton.jit
def _mamba2_norm_kernel(
    gated, sums, norm_w, out, so, xbc, sx, cs, cs_b, co, co_b, mask,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    NPB: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr, BCH: tl.constexpr,
    EPS: tl.constexpr, HAS_MASK: tl.constexpr, CT: tl.constexpr,
):
    """Program (sample, head): the head's gated y times its group's 1 / RMS and the norm's weight, into ``out``;
    and the conv-state shift of its share (CH channels) of B's and C's channels. EPS is taken as a constant (a
    float argument would reach the kernel as fp32)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    HG = H // G  # heads per group
    C = H * P + 2 * G * N
    o_s = tl.arange(0, BS)
    parts = tl.load(sums + (i_b * H + (i_h // HG) * HG) * NPB + o_s, mask=o_s < HG * NPB, other=0)
    rstd = 1.0 / tl.sqrt(tl.sum(parts, 0) / (HG * P) + EPS)
    for p0 in range(0, P, BP):
        c = i_h * P + p0 + tl.arange(0, BP)
        m_p = c < (i_h + 1) * P
        b_h = tl.load(gated + i_b * (H * P) + c, mask=m_p, other=0)
        w = tl.load(norm_w + c, mask=m_p, other=0).to(CT)
        tl.store(out + i_b * so + c, (w * (b_h * rstd)).to(out.dtype.element_ty), mask=m_p)
    o_c = tl.arange(0, BCH)
    c = H * P + i_h * CH + o_c
    m_c = (o_c < CH) & (c < C)
    x = tl.load(xbc + i_b * sx + c, mask=m_c, other=0).to(CT)
    if HAS_MASK:
        x = tl.where(tl.load(mask + i_b) != 0, x, 0.0)
    shift_conv_state(x, cs, i_b, c, m_c, cs_b, C, W, WP, co, co_b)


def mamba2_step(z, xBC, dt, conv_state, conv_weight, conv_bias, state, *, dt_bias, A_log, D, norm_weight,
                norm_eps: float, groups: int, mask=None, in_place: bool = False):
    """One token of a Mamba-2 layer after its in_proj; see the module docstring.

    z ``[B, 1, H·P]``, xBC ``[B, 1, H·P + 2·G·N]`` (before the convolution), dt ``[B, 1, H]`` (before the softplus),
    all of one dtype, each with unit channel stride or copied to it (views of in_proj's output are read in place);
    ``conv_state`` ``[B, W − 1, H·P + 2·G·N]`` with contiguous rows, ``conv_weight`` ``[C, 1, W]``, ``conv_bias``
    ``[C]`` or None; ``state`` S ``[B, H, P, N]`` contiguous (fp32; fp64 for fp64 inputs); ``dt_bias``, ``A_log``,
    ``D`` ``[H]``; ``norm_weight`` ``[H·P]`` with ``norm_eps``; ``groups`` G; ``mask`` ``[B]`` or ``[B, 1]``
    (1 = real). ``in_place``: the conv state and S are updated where they are, else new tensors hold them.
    Returns ``(out [B, 1, H·P] in the inputs' dtype, new S, new conv state)``."""
    B, H, P, N = state.shape
    G = groups
    if G < 1 or H % G:
        raise ValueError(f"{OP}: groups = {G} must divide the {H} heads of the state")
    if N > MAMBA2_STEP_MAX_STATE_SIZE:
        raise ValueError(f"{OP}: state sizes up to {MAMBA2_STEP_MAX_STATE_SIZE}, got N = {N}")
    if not state.is_contiguous():
        raise ValueError(f"{OP}: the state S must be contiguous")
    dtype = z.dtype
    if xBC.dtype != dtype or dt.dtype != dtype:
        raise TypeError(f"{OP}: z, xBC and dt must share one dtype, got {z.dtype}, {xBC.dtype} and {dt.dtype}")
    channels = H * P + 2 * G * N
    z2, sz = rows(OP, z, H * P, "z")
    x2, sx = rows(OP, xBC, channels, "xBC")
    d2, sd = rows(OP, dt, H, "dt")
    W = conv_weight.shape[-1]
    if W < 2 or tuple(conv_state.shape) != (B, W - 1, channels):
        raise ValueError(f"{OP}: the conv state must have shape [B, W − 1, C] = {(B, W - 1, channels)} for a "
                         f"convolution of W >= 2 taps, got {tuple(conv_state.shape)} and W = {W}")
    conv_in = conv_rows(OP, conv_state, "xBC")
    conv_out = conv_in if in_place else torch.empty_like(conv_in, memory_format=torch.contiguous_format)
    S_out = state if in_place else torch.empty_like(state)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    BN = next_pow2(N)
    BP = min(next_pow2(P), max(16, STATE_TILE // BN))
    NPB = triton.cdiv(P, BP)
    gated = torch.empty(B, H * P, device=z.device, dtype=compute)
    sums = torch.empty(B, H, NPB, device=z.device, dtype=compute)
    out = torch.empty(B, H * P, device=z.device, dtype=dtype)
    m = mask.reshape(B).contiguous() if mask is not None else out
    common = dict(H=H, P=P, G=G, N=N, W=W, WP=triton.next_power_of_2(W - 1), HAS_MASK=mask is not None,
                  CT=tl.float64 if compute == torch.float64 else tl.float32)
    _mamba2_state_kernel[(B, H, NPB)](
        z2, sz, x2, sx, d2, sd, conv_in, conv_in.stride(0), conv_out, conv_out.stride(0),
        conv_weight.reshape(channels, W).contiguous(), conv_bias if conv_bias is not None else out,
        dt_bias, A_log, D, state, S_out, m, gated, sums,
        BP=BP, BN=BN, NPB=NPB, HAS_BIAS=conv_bias is not None, DT=TL_DTYPES[dtype], **common,
        num_warps=4,
    )
    share = triton.cdiv(2 * G * N, H)  # B's and C's channels each program of the second kernel shifts
    _mamba2_norm_kernel[(B, H)](
        gated, sums, norm_weight, out, out.stride(0), x2, sx, conv_in, conv_in.stride(0), conv_out,
        conv_out.stride(0), m,
        NPB=NPB, BS=next_pow2(H // G * NPB), BP=min(next_pow2(P), 1024), CH=share, BCH=next_pow2(share),
        EPS=float(norm_eps), **common,
        num_warps=4,
    )
    return out.view(B, 1, H * P), S_out, conv_out
