"""One decode step of a DeltaNet or Gated DeltaNet layer in one Triton kernel.

From the layer's projections of one token it does everything between them and the output projection:

    q, k, v  = silu(short_conv(projections, conv states))       (the conv states shift by the new input)
    q, k     = l2norm(q) · scale, l2norm(k)
    β        = sigmoid(b)   (× 2 with negative eigenvalues allowed; 1 without β)
    log α    = −exp(A_log) · softplus(a + dt_bias)              (Gated DeltaNet; 0 for DeltaNet)
    S        = α S + β (v − α S k) kᵀ,  o = S q                 (S ``[dv, dk]`` per value head, fp32)
    o        = RMSNorm(o) · act(gate)                            (the per-head output norm and output gate)

Kimi Delta Attention's step is the same with a decay per key channel: ``a`` holds f_proj's output, one value per
value head and key channel, ``dt_bias`` as many, and log α = −exp(A_log) · softplus(a + dt_bias) (or, with a lower
bound b, b · sigmoid(exp(A_log) · (a + dt_bias))) scales S's columns: S = S Diag(α) + β (v − S Diag(α) k) kᵀ. Its
β, output norm and gate stay in fp32 (Kimi Linear's gated norm), where (Gated) DeltaNet's pass through the input
dtype.

One program per (sample, query/key head) walks the m value heads that head serves, so each conv-state channel
and each state row has exactly one writer: the states are updated in place (or written to new tensors) with no
race. A pad (mask 0) keeps S, outputs 0, and shifts a zero into the conv states, as the unfused layer does. The
values pass through the input dtype where the unfused layer stores them (the convolution's output, β, the op's
output, the norm's output), so both give the same numbers up to the order of fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._step_parts import TL_DTYPES, conv_rows, conv_silu_shift, rows
from ._utils import next_pow2
from .limits import DELTA_STEP_MAX_HEAD_DIM

OP = "delta_step"
#: the output gate's activation, by the mixer's `gate_activation` (0: no gate)
GATES = {None: 0, "silu": 1, "sigmoid": 2}
#: the decay per key channel (Kimi Delta Attention), by its form (0: one decay per value head, or none)
KEY_GATES = {None: 0, "softplus": 1, "bounded": 2}


@triton.jit
def _delta_step_kernel(
    q, k, v, sq, sk, sv,
    cq, ck, cv, cq_b, ck_b, cv_b, oq, ok, ov, oq_b, ok_b, ov_b,
    wq, wk, wv, bq, bk, bv,
    a, sa, A_log, dt_bias, b, sb, gate, sg, norm_w,
    S, S_out, mask, out, so,
    SCALE: tl.constexpr, EPS: tl.constexpr,
    HK: tl.constexpr, M: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_G: tl.constexpr, HAS_BETA: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, GATE: tl.constexpr, HAS_MASK: tl.constexpr,
    KEY_GATE: tl.constexpr, BOUND: tl.constexpr, ROUND: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
):
    """DT: the inputs' dtype; CT: the compute dtype (fp32, fp64 for fp64 inputs). SCALE and EPS are constants of
    the layer, taken as such: a float argument would reach the kernel as fp32. ROUND: β, the norm's output and the
    gate pass through DT, as the unfused (Gated) DeltaNet layer stores them (KDA keeps them in fp32)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    real = True
    if HAS_MASK:
        real = tl.load(mask + i_b) != 0
    ck_q = i_h * K + o_k  # this head's channels of q and k
    x = tl.load(q + i_b * sq + ck_q, mask=m_k, other=0).to(CT)
    b_q = conv_silu_shift(x, cq, wq, bq, i_b, ck_q, m_k, real, cq_b, HK * K, W, WP, HAS_BIAS, oq, oq_b, DT, CT)
    x = tl.load(k + i_b * sk + ck_q, mask=m_k, other=0).to(CT)
    b_k = conv_silu_shift(x, ck, wk, bk, i_b, ck_q, m_k, real, ck_b, HK * K, W, WP, HAS_BIAS, ok, ok_b, DT, CT)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6) * SCALE
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    m_s = m_v[:, None] & m_k[None, :]
    for i in range(M):
        hv = i_h * M + i
        c_v = hv * V + o_v
        x = tl.load(v + i_b * sv + c_v, mask=m_v, other=0).to(CT)
        b_v = conv_silu_shift(x, cv, wv, bv, i_b, c_v, m_v, real, cv_b, HK * M * V, W, WP, HAS_BIAS, ov, ov_b, DT, CT)
        beta = 1.0
        if HAS_BETA:
            z = tl.load(b + i_b * sb + hv).to(CT)
            beta = 1.0 / (1.0 + tl.exp(-z))
            if ROUND:
                beta = beta.to(DT).to(CT)
        if NEG_EIGVAL:
            beta = 2.0 * beta
        p_s = (i_b * HK * M + hv) * V * K + o_v[:, None] * K + o_k[None, :]
        b_s = tl.load(S + p_s, mask=m_s, other=0).to(CT)
        if KEY_GATE != 0:  # a decay per key channel: S's columns
            c_k = hv * K + o_k
            z = (tl.load(a + i_b * sa + c_k, mask=m_k, other=0).to(CT)
                 + tl.load(dt_bias + c_k, mask=m_k, other=0).to(CT))
            rate = tl.exp(tl.load(A_log + hv).to(CT))
            if KEY_GATE == 1:
                log_a = -rate * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))
            else:
                log_a = BOUND / (1.0 + tl.exp(-rate * z))
            b_s = b_s * tl.exp(log_a)[None, :]
        elif HAS_G:
            z = tl.load(a + i_b * sa + hv).to(CT) + tl.load(dt_bias + hv).to(CT)
            softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))
            b_s = b_s * tl.exp(-tl.exp(tl.load(A_log + hv).to(CT)) * softplus)
        b_u = b_v - tl.sum(b_s * b_k[None, :], 1)
        b_s += (beta * b_u)[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1).to(DT).to(CT)
        if not real:  # a pad keeps the state
            b_s = tl.load(S + p_s, mask=m_s, other=0).to(CT)
            b_o = tl.zeros([BV], dtype=CT)
        tl.debug_barrier()  # every copy of S read before any is written (S_out may be S)
        tl.store(S_out + p_s, b_s.to(S_out.dtype.element_ty), mask=m_s)
        if NORM:
            b_o = b_o / tl.sqrt(tl.sum(b_o * b_o, 0) / V + EPS)
            if NORM_AFFINE:
                b_o = b_o * tl.load(norm_w + o_v, mask=m_v, other=0).to(CT)
            if ROUND:
                b_o = b_o.to(DT).to(CT)
        if GATE != 0:
            z = tl.load(gate + i_b * sg + c_v, mask=m_v, other=0).to(CT)
            if GATE == 1:
                act = z / (1.0 + tl.exp(-z))
            else:
                act = 1.0 / (1.0 + tl.exp(-z))
            if ROUND:
                act = act.to(DT).to(CT)
            b_o = b_o * act
        tl.store(out + i_b * so + c_v, b_o.to(out.dtype.element_ty), mask=m_v)


def delta_step(q, k, v, conv_states: dict, conv_weights: dict, conv_biases: dict | None, state, *,
               heads: int, value_heads: int, scale: float, a=None, A_log=None, dt_bias=None, b=None,
               neg_eigval: bool = False, norm_weight=None, norm_eps: float | None = None, gate=None,
               gate_activation: str | None = None, mask=None, in_place: bool = False, key_gate: str | None = None,
               gate_lower_bound: float | None = None, round_to_dtype: bool = True):
    """One token of a (Gated) DeltaNet layer after its projections; see the module docstring.

    q, k ``[B, 1, H·dk]``, v ``[B, 1, HV·dv]`` (the projections, before the convolution); ``conv_states``
    ``{"q", "k", "v"}`` of ``[B, W − 1, C]`` and ``conv_weights`` of ``[C, 1, W]`` (``conv_biases`` the same or
    None); ``state`` S ``[B, HV, dv, dk]`` (fp32). Gated DeltaNet passes ``a`` ``[B, 1, HV]`` with ``A_log`` and
    ``dt_bias`` ``[HV]``; ``b`` ``[B, 1, HV]`` (None: β = 1); ``norm_weight`` ``[dv]`` or None with ``norm_eps``
    (None: no output norm); ``gate`` ``[B, 1, HV·dv]`` with ``gate_activation`` "silu" or "sigmoid"; ``mask``
    ``[B]`` or ``[B, 1]`` (1 = real). ``in_place``: the conv states and S are updated where they are, else new
    tensors hold them. Kimi Delta Attention: ``key_gate`` "softplus" (or "bounded" with ``gate_lower_bound``) with
    ``a`` ``[B, 1, HV·dk]`` (f_proj's output) and ``dt_bias`` ``[HV·dk]``. ``round_to_dtype``: β, the norm's output
    and the gate pass through q's dtype, as the (Gated) DeltaNet layer stores them (KDA's layer keeps them in fp32:
    False). Returns ``(o [B, 1, HV·dv], new S, new
    conv states)``."""
    B = q.shape[0]
    HV, V, K = state.shape[1:]
    H = heads
    if HV != value_heads or HV % H:
        raise ValueError(f"delta_step: the state has {HV} value heads; expected {value_heads}, a multiple of {H}")
    if max(K, V) > DELTA_STEP_MAX_HEAD_DIM:
        raise ValueError(f"delta_step: head dims up to {DELTA_STEP_MAX_HEAD_DIM}, got dk = {K}, dv = {V}")
    dt = q.dtype
    q2, sq = rows(OP, q, H * K, "q")
    k2, sk = rows(OP, k, H * K, "k")
    v2, sv = rows(OP, v, HV * V, "v")
    W = conv_weights["q"].shape[-1]
    if W < 2:
        raise ValueError(f"delta_step: short convolutions of at least 2 taps, got {W}")
    cin = {n: conv_rows(OP, conv_states[n], n) for n in "qkv"}
    cout = cin if in_place else {n: torch.empty_like(cin[n], memory_format=torch.contiguous_format) for n in "qkv"}
    weights = {n: conv_weights[n].reshape(conv_weights[n].shape[0], W).contiguous() for n in "qkv"}
    if not state.is_contiguous():
        raise ValueError("delta_step: the state S must be contiguous")
    S_out = state if in_place else torch.empty_like(state)
    out = torch.empty(B, HV * V, device=q.device, dtype=dt)
    dummy = out
    if key_gate not in KEY_GATES or (key_gate == "bounded") != (gate_lower_bound is not None):
        raise ValueError(f"delta_step: key_gate must be one of {list(KEY_GATES)} (a lower bound with 'bounded' only), "
                         f"got {key_gate!r} with gate_lower_bound={gate_lower_bound!r}")
    a2, sa = rows(OP, a, HV * K if key_gate else HV, "a") if a is not None else (dummy, 0)
    b2, sb = rows(OP, b, HV, "b") if b is not None else (dummy, 0)
    g2, sg = rows(OP, gate, HV * V, "gate") if gate is not None else (dummy, 0)
    m = mask.reshape(B).contiguous() if mask is not None else dummy
    biases = conv_biases or {}
    _delta_step_kernel[(B, H)](
        q2, k2, v2, sq, sk, sv,
        cin["q"], cin["k"], cin["v"], cin["q"].stride(0), cin["k"].stride(0), cin["v"].stride(0),
        cout["q"], cout["k"], cout["v"], cout["q"].stride(0), cout["k"].stride(0), cout["v"].stride(0),
        weights["q"], weights["k"], weights["v"],
        biases.get("q", dummy), biases.get("k", dummy), biases.get("v", dummy),
        a2, sa, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, b2, sb, g2, sg,
        norm_weight if norm_weight is not None else dummy,
        state, S_out, m, out, out.stride(0),
        SCALE=float(scale), EPS=float(norm_eps or 0.0), HK=H, M=HV // H, K=K, V=V, W=W,
        WP=triton.next_power_of_2(max(W - 1, 1)), BK=next_pow2(K), BV=next_pow2(V),
        HAS_BIAS=bool(biases), HAS_G=a is not None, HAS_BETA=b is not None, NEG_EIGVAL=neg_eigval,
        NORM=norm_eps is not None, NORM_AFFINE=norm_weight is not None,
        GATE=GATES[gate_activation if gate is not None else None],
        HAS_MASK=mask is not None, KEY_GATE=KEY_GATES[key_gate], BOUND=float(gate_lower_bound or 0.0),
        ROUND=round_to_dtype, DT=TL_DTYPES[dt], CT=tl.float64 if dt == torch.float64 else tl.float32,
        num_warps=4 if max(K, V) <= 64 else 8,
    )
    return out.view(B, 1, HV * V), S_out, cout
