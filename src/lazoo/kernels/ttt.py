"""Triton kernels for TTT-Linear (``lazoo.ops.ttt_linear``), forward and hand-written backward.

TTT-Linear per head, W ``[dv, dk]``, mini-batches of b tokens, every gradient of a mini-batch taken at the
weights W_c the mini-batch started from (no LayerNorm or residual inside the inner model):

    E = K W_cᵀ − V,  Ẽ = diag(η) E,  O = Q W_cᵀ − tril(Q Kᵀ) Ẽ,  W_{c+1} = W_c − Ẽᵀ K

(TTT's dual form). Rows of W (value dims) never mix, so a program owns one (sample, head, dv block) and
keeps its rows of W, transposed (``Wᵀ [dk, BV]``), in registers while it walks the mini-batches.

* b = 1 is exactly the delta rule with β = η (W_t = W_{t−1} − η_t (W_{t−1} k_t − v_t) k_tᵀ, o_t = W_t q_t):
  ``ttt_linear_triton`` hands it to ``lazoo.kernels.delta.chunk_delta_rule`` instead of a kernel here.
* b > 1: the three kernels below. A mini-batch is one tile of ``BC = max(16, next_pow2(b))`` rows (rows
  ≥ b masked: tl.dot needs 16 rows); ragged T masks the last one.
  - ``_fwd_kernel`` (sequential over mini-batches): outputs, the per-mini-batch start weights ``h``
    ``[B, H, N, dk, dv]`` (kept for the backward, in the products' operand type: bf16/fp16 for 16-bit inputs,
    T/b · dk · dv · 2 bytes per sample and head) and the final weights (W_end, W_start) in fp32.
  - ``_bwd_dh_kernel`` (sequential, reverse): ``dh[c] = ∂L/∂W_{c+1}ᵀ`` and the gradient of the initial W,
    with  G_c = G_{c+1} + Qᵀ dO + Kᵀ dE,  dE = diag(η) (−tril(QKᵀ)ᵀ dO − K G_{c+1}).
  - ``_bwd_dqkv_kernel`` (parallel over mini-batches, a loop over dv blocks): dq, dk, dv, dη from h and dh.

Transposes are taken only of tiles loaded from memory, never of a ``tl.dot`` result (Triton 3.4–3.7 on
Hopper miscompiles that, see ``lazoo.kernels.delta``); products that need such a transpose are formed
directly from loaded tiles (Eᵀ = W_c Kᵀ − Vᵀ, dAᵀ = −Ẽ dOᵀ).

Inputs need not be padded or aligned by the caller beyond this: mini-batch c is tokens [c b, (c+1) b) of
every sample; the op places padded / resumed sequences on that grid (a slot with η = 0 and k = 0 changes
nothing), passes the weights mini-batch 0 takes its gradients at (``Wg0``, a resumed partial mini-batch) and
per sample the mini-batch whose start weights become the final ``W_start``.

Precision: products take the inputs' dtype as operands for 16-bit inputs (fp32 accumulation), tf32x3 for
fp32, plain fp64 for fp64 (interpreter tests only); W, the error E and every recurrence are fp32 (fp64).
Measured on an H100 against float64 at T = 1024, bf16: max relative error ≤ 5e-3 (outputs, all gradients).

Decoding does not use these kernels: ``lazoo.ops.ttt.ttt_linear_decode_step`` / ``ttt_mlp_decode_step`` are
fused single-token steps in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import fill_device
from ._tiles import dot
from ._utils import next_pow2
from .limits import TTT_MAX_HEAD_DIM as MAX_HEAD_DIM
from .limits import TTT_MAX_MINI_BATCH as MAX_MINI_BATCH


# ============================================================================ jit helpers
@triton.jit
def _rows(i_b, c, T, H: tl.constexpr, i_h, MB: tl.constexpr, BC: tl.constexpr):
    """Token-head row index (int64) and validity of the BC rows of mini-batch c of sample i_b."""
    rc = tl.arange(0, BC)
    t = c * MB + rc
    valid = (rc < MB) & (t < T)
    row = (i_b * T + t).to(tl.int64) * H + i_h
    return row, valid


@triton.jit
def _load(ptr, row, valid, D: tl.constexpr, col, mcol, CDT: tl.constexpr):
    return tl.load(ptr + row[:, None] * D + col[None, :], mask=valid[:, None] & mcol[None, :], other=0.0).to(CDT)


@triton.jit
def _fwd_chunk(c, wt, wg, q, k, v, eta, h, o, w_start, i_s, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MB: tl.constexpr, BC: tl.constexpr,
               DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """Mini-batch c from Wᵀ = wt with its gradients taken at wg (= wt except in a resumed mini-batch 0):
    store h[c] = wt (in the dot operand type: it only enters products) and the outputs, keep wt in full
    precision as the final W_start when c = i_s, return the next Wᵀ."""
    row, valid = _rows(i_b, c, T, H, i_h, MB, BC)
    tl.store(h + (bh * N + c) * K * V + rk[:, None] * V + rv[None, :], wt.to(h.dtype.element_ty), mask=mkv)
    if c == i_s:
        tl.store(w_start + bh * K * V + rk[:, None] * V + rv[None, :], wt, mask=mkv)
    b_k = _load(k, row, valid, K, rk, mk, CDT)
    b_v = _load(v, row, valid, V, rv, mv, CDT)
    b_eta = tl.load(eta + row, mask=valid, other=0.0).to(CDT)
    e = dot(b_k, wg, DT, PREC) - b_v  # errors at the mini-batch's start weights
    ee = e * b_eta[:, None]
    _out_tile(q, b_k, ee, wt, o, row, valid, rk, mk, rv, mv, K, V, BC, DT, CDT, PREC)
    return wt - dot(tl.trans(b_k), ee, DT, PREC)


@triton.jit
def _out_tile(q, b_k, ee, wt, o, row, valid, rk, mk, rv, mv, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
              DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """O = Q W_cᵀ − tril(Q Kᵀ) Ẽ for one mini-batch and dv block."""
    rc = tl.arange(0, BC)
    b_q = _load(q, row, valid, K, rk, mk, CDT)
    a = tl.where(rc[:, None] >= rc[None, :], dot(b_q, tl.trans(b_k), DT, PREC), 0.0)
    b_o = dot(b_q, wt, DT, PREC) - dot(a, ee, DT, PREC)
    tl.store(o + row[:, None] * V + rv[None, :], b_o.to(o.dtype.element_ty), mask=valid[:, None] & mv[None, :])


@triton.jit
def _weight_program(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A weight-carrying program on grid (NV, B * H): sample i_b, head i_h, its (sample, head) row bh, and its
    [BK, BV] tile of Wᵀ: rows rk (real: mk), columns rv (real: mv), both mkv."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    return i_bh // H, i_bh % H, i_bh.to(tl.int64), rk, mk, rv, mv, mk[:, None] & mv[None, :]


@triton.jit
def _fwd_kernel(q, k, v, eta, w0, wg0, h, o, w_end, w_start, idx, T, N,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MB: tl.constexpr, BC: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, HAS_WG: tl.constexpr,
                DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    i_b, i_h, bh, rk, mk, rv, mv, mkv = _weight_program(H, K, V, BK, BV)
    wptr = bh * V * K + rv[None, :] * K + rk[:, None]  # Wᵀ [BK, BV] read from W [dv, dk]
    wt = tl.load(w0 + wptr, mask=mkv, other=0.0).to(CDT)
    wg = wt
    if HAS_WG:
        wg = tl.load(wg0 + wptr, mask=mkv, other=0.0).to(CDT)
    i_s = tl.load(idx + i_b)
    wt = _fwd_chunk(0, wt, wg, q, k, v, eta, h, o, w_start, i_s, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
                    H, K, V, MB, BC, DT, CDT, PREC)
    for c in range(1, N):
        wt = _fwd_chunk(c, wt, wt, q, k, v, eta, h, o, w_start, i_s, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
                        H, K, V, MB, BC, DT, CDT, PREC)
    tl.store(w_end + bh * K * V + rk[:, None] * V + rv[None, :], wt, mask=mkv)


@triton.jit
def _dh_chunk(g, c, q, k, do, eta, dh, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MB: tl.constexpr, BC: tl.constexpr,
              DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """One mini-batch of the reverse pass: store G_{c+1} as dh[c]; return the two parts of G_c − G_{c+1}:
    through the outputs (Qᵀ dO, reaches W_c) and through the errors (Kᵀ dE, reaches where they were taken)."""
    rc = tl.arange(0, BC)
    row, valid = _rows(i_b, c, T, H, i_h, MB, BC)
    tl.store(dh + (bh * N + c) * K * V + rk[:, None] * V + rv[None, :], g.to(dh.dtype.element_ty), mask=mkv)
    b_q = _load(q, row, valid, K, rk, mk, CDT)
    b_k = _load(k, row, valid, K, rk, mk, CDT)
    b_do = _load(do, row, valid, V, rv, mv, CDT)
    b_eta = tl.load(eta + row, mask=valid, other=0.0).to(CDT)
    at = tl.where(rc[:, None] <= rc[None, :], dot(b_k, tl.trans(b_q), DT, PREC), 0.0)  # tril(QKᵀ)ᵀ
    dee = -dot(at, b_do, DT, PREC) - dot(b_k, g, DT, PREC)
    de = dee * b_eta[:, None]
    return dot(tl.trans(b_q), b_do, DT, PREC), dot(tl.trans(b_k), de, DT, PREC)


@triton.jit
def _bwd_dh_kernel(q, k, do, eta, dw_end, dw_start, idx, dh, dw0, dwg0, T, N,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MB: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, HAS_WG: tl.constexpr, HAS_DW_END: tl.constexpr,
                   HAS_DW_START: tl.constexpr, DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """Reverse pass. ``dw_start``: gradient of the final state's ``W_start``, the weights at the start of
    mini-batch ``idx[b]`` (N when the last mini-batch is full; 0: the initial W_start): added when the pass
    reaches that point. With HAS_WG, mini-batch 0's error gradient goes to ``dwg0`` (the initial W_start)."""
    i_b, i_h, bh, rk, mk, rv, mv, mkv = _weight_program(H, K, V, BK, BV)
    sptr = bh * K * V + rk[:, None] * V + rv[None, :]
    g = tl.zeros([BK, BV], dtype=CDT)
    if HAS_DW_END:
        g += tl.load(dw_end + sptr, mask=mkv, other=0.0).to(CDT)
    i_s = N
    if HAS_DW_START:
        i_s = tl.load(idx + i_b)
    i_a = tl.maximum(i_s, 1)
    for cc in range(N - i_a):  # mini-batches N-1 .. max(i_s, 1)
        g_o, g_e = _dh_chunk(g, N - 1 - cc, q, k, do, eta, dh, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
                             H, K, V, MB, BC, DT, CDT, PREC)
        g = g + g_o + g_e
    if HAS_DW_START:
        if i_s >= 1:
            g += tl.load(dw_start + sptr, mask=mkv, other=0.0).to(CDT)
    for cc in range(i_a - 1):  # mini-batches i_s-1 .. 1
        g_o, g_e = _dh_chunk(g, i_a - 1 - cc, q, k, do, eta, dh, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
                             H, K, V, MB, BC, DT, CDT, PREC)
        g = g + g_o + g_e
    g_o, g_e = _dh_chunk(g, 0, q, k, do, eta, dh, i_b, i_h, bh, T, N, rk, mk, rv, mv, mkv,
                         H, K, V, MB, BC, DT, CDT, PREC)
    if HAS_DW_START:
        if i_s == 0:
            g_e += tl.load(dw_start + sptr, mask=mkv, other=0.0).to(CDT)
    if HAS_WG:
        tl.store(dw0 + sptr, g + g_o, mask=mkv)
        tl.store(dwg0 + sptr, g_e, mask=mkv)
    else:
        tl.store(dw0 + sptr, g + g_o + g_e, mask=mkv)


@triton.jit
def _bwd_dqkv_kernel(q, k, v, eta, do, h, dh, wg0, dq, dk, dv, deta, T, N,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MB: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_WG: tl.constexpr,
                     DT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """Per (mini-batch, sample·head): dq, dk, dv, dη, looping over dv blocks (dq, dk, dη sum over them)."""
    c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    rk = tl.arange(0, BK)
    mk = rk < K
    rc = tl.arange(0, BC)
    causal = rc[:, None] >= rc[None, :]
    bh = i_bh.to(tl.int64)
    row, valid = _rows(i_b, c, T, H, i_h, MB, BC)
    b_q = _load(q, row, valid, K, rk, mk, CDT)
    b_k = _load(k, row, valid, K, rk, mk, CDT)
    b_eta = tl.load(eta + row, mask=valid, other=0.0).to(CDT)
    at = tl.where(rc[:, None] <= rc[None, :], dot(b_k, tl.trans(b_q), DT, PREC), 0.0)  # tril(QKᵀ)ᵀ
    b_dq = tl.zeros([BC, BK], dtype=CDT)
    b_dk = tl.zeros([BC, BK], dtype=CDT)
    da = tl.zeros([BC, BC], dtype=CDT)
    dat = tl.zeros([BC, BC], dtype=CDT)
    b_deta = tl.zeros([BC], dtype=CDT)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        mkv = mk[:, None] & mv[None, :]
        sptr = (bh * N + c) * K * V + rk[:, None] * V + rv[None, :]
        wt = tl.load(h + sptr, mask=mkv, other=0.0).to(CDT)  # W_cᵀ [BK, BV]
        g = tl.load(dh + sptr, mask=mkv, other=0.0).to(CDT)  # ∂L/∂W_{c+1}ᵀ
        wg = wt  # where the errors are taken
        if HAS_WG:
            if c == 0:
                wg = tl.load(wg0 + bh * V * K + rv[None, :] * K + rk[:, None], mask=mkv, other=0.0).to(CDT)
        b_v = _load(v, row, valid, V, rv, mv, CDT)
        b_do = _load(do, row, valid, V, rv, mv, CDT)
        e = dot(b_k, wg, DT, PREC) - b_v
        ee = e * b_eta[:, None]
        eet = (dot(tl.trans(wg), tl.trans(b_k), DT, PREC) - tl.trans(b_v)) * b_eta[None, :]  # Ẽᵀ, loaded tiles
        dee = -dot(at, b_do, DT, PREC) - dot(b_k, g, DT, PREC)
        de = dee * b_eta[:, None]
        b_deta += tl.sum(dee * e, axis=1)
        da -= dot(b_do, eet, DT, PREC)  # dA = −tril(dO Ẽᵀ) (masked below)
        dat -= dot(ee, tl.trans(b_do), DT, PREC)  # dAᵀ
        # W_{c+1}ᵀ = W_cᵀ − Kᵀ Ẽ gives dK −= Ẽ Gᵀ; E = K W_gᵀ − V gives dK += dE W_g; O gives dQ += dO W_c
        b_dq += dot(b_do, tl.trans(wt), DT, PREC)
        b_dk += dot(de, tl.trans(wg), DT, PREC) - dot(ee, tl.trans(g), DT, PREC)
        tl.store(dv + row[:, None] * V + rv[None, :], (-de).to(dv.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])
    da = tl.where(causal, da, 0.0)
    dat = tl.where(rc[:, None] <= rc[None, :], dat, 0.0)
    b_dq += dot(da, b_k, DT, PREC)
    b_dk += dot(dat, b_q, DT, PREC)
    mout = valid[:, None] & mk[None, :]
    tl.store(dq + row[:, None] * K + rk[None, :], b_dq.to(dq.dtype.element_ty), mask=mout)
    tl.store(dk + row[:, None] * K + rk[None, :], b_dk.to(dk.dtype.element_ty), mask=mout)
    tl.store(deta + row, b_deta.to(deta.dtype.element_ty), mask=valid)


# ============================================================================ launch
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _types(x: torch.Tensor):
    """(dot operand dtype, compute dtype, dot precision) for inputs of x's dtype."""
    if x.dtype == torch.float64:
        return tl.float64, tl.float64, "ieee"
    if x.dtype == torch.float32:
        return tl.float32, tl.float32, "tf32x3"
    return _TL[x.dtype], tl.float32, "tf32"


def _blocks(K: int, V: int, MB: int, parallel: int, device, interpret: bool):
    BK = next_pow2(K)
    BC = next_pow2(MB)
    if interpret:
        return BK, BC, next_pow2(V)
    BV = min(64, next_pow2(V), max(16, 8192 // BK))
    return BK, BC, fill_device(BV, V, parallel, device)  # enough programs for the sequential kernels


#: launch options per kernel on the GPU (fixed: no autotuning, the interpreter cannot autotune). Measured on
#: an H100 (Triton 3.6, bf16, D = 128, b = 16, 32k tokens): 4 warps everywhere beat 8 (dqkv: 3.8 vs 4.7 ms
#: fwd+bwd at T = 1k); 2 warps with 64-wide dv blocks spill (20x slower).
CONFIGS = {"fwd": {"num_warps": 4, "num_stages": 2}, "dh": {"num_warps": 4, "num_stages": 2},
           "dqkv": {"num_warps": 4, "num_stages": 2}}


def _opts(interpret: bool, name: str) -> dict:
    return {} if interpret else dict(CONFIGS[name])


class TTTLinearFunction(torch.autograd.Function):
    """Mini-batch TTT-Linear (b ≥ 2), differentiable in q, k, v, η, W0 and Wg0.

    q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, eta ``[B, T, H]`` with mini-batch c = tokens [c b, (c+1) b);
    W0 ``[B, H, dv, dk]`` the initial weights, Wg0 (or None = W0) the weights mini-batch 0's gradients are
    taken at (a resumed partial mini-batch); idx ``[B]`` int (or None = T // b): the mini-batch whose start
    weights are returned as the final ``W_start`` (0 → Wg0, N → W_end). Weights fp32 (fp64 for fp64 inputs).
    Returns ``(o, W_end, W_start)``."""

    @staticmethod
    def forward(ctx, q, k, v, eta, W0, Wg0, idx, mini_batch_size):
        B, T, H, K = q.shape
        V = v.shape[-1]
        MB = mini_batch_size
        N = triton.cdiv(T, MB)
        dev = q.device
        interp = dev.type == "cpu"
        q, k, v, eta = (x.contiguous() for x in (q, k, v, eta))
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        W0 = W0.to(sdt).contiguous()
        has_wg = Wg0 is not None
        Wg0 = Wg0.to(sdt).contiguous() if has_wg else None
        if idx is None:
            idx = torch.full((B,), T // MB, device=dev, dtype=torch.int32)
        idx = idx.to(device=dev, dtype=torch.int32).contiguous()
        DT, CDT, PREC = _types(q)
        BK, BC, BV = _blocks(K, V, MB, B * H, dev, interp)
        h = torch.empty(B, H, N, K, V, device=dev, dtype=sdt if q.dtype in (torch.float32, torch.float64) else q.dtype)
        o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
        wt_end = torch.empty(B, H, K, V, device=dev, dtype=sdt)
        wt_start = torch.empty_like(wt_end)
        _fwd_kernel[(triton.cdiv(V, BV), B * H)](
            q, k, v, eta, W0, Wg0 if has_wg else W0, h, o, wt_end, wt_start, idx, T, N, H=H, K=K, V=V, MB=MB,
            BC=BC, BK=BK, BV=BV, HAS_WG=has_wg, DT=DT, CDT=CDT, PREC=PREC, **_opts(interp, "fwd"))
        w_end = wt_end.transpose(-1, -2)
        il = idx.long()
        w_start = torch.where((il == N).view(B, 1, 1, 1), w_end, wt_start.transpose(-1, -2))
        if has_wg:
            w_start = torch.where((il == 0).view(B, 1, 1, 1), Wg0, w_start)
        ctx.save_for_backward(q, k, v, eta, h, Wg0, idx)
        ctx.dims = (B, T, H, K, V, MB, N)
        ctx.w_dtypes = (W0.dtype, None if not has_wg else Wg0.dtype)
        return o, w_end.contiguous(), w_start.contiguous()

    @staticmethod
    def backward(ctx, do, dw_end, dw_start):
        q, k, v, eta, h, Wg0, idx = ctx.saved_tensors
        B, T, H, K, V, MB, N = ctx.dims
        has_wg = Wg0 is not None
        dev = q.device
        interp = dev.type == "cpu"
        DT, CDT, PREC = _types(q)
        BK, BC, BV = _blocks(K, V, MB, B * H, dev, interp)
        NV = triton.cdiv(V, BV)
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dwt_end = None if dw_end is None else dw_end.to(sdt).transpose(-1, -2).contiguous()
        dwt_start = None if dw_start is None else dw_start.to(sdt).transpose(-1, -2).contiguous()
        dh = torch.empty_like(h)  # like h: only enters products
        dw0t = torch.empty(B, H, K, V, device=dev, dtype=sdt)
        dwg0t = torch.empty_like(dw0t) if has_wg else dw0t
        _bwd_dh_kernel[(NV, B * H)](
            q, k, do, eta, dwt_end if dwt_end is not None else dw0t, dwt_start if dwt_start is not None else dw0t,
            idx, dh, dw0t, dwg0t, T, N, H=H, K=K, V=V, MB=MB, BC=BC, BK=BK, BV=BV, HAS_WG=has_wg,
            HAS_DW_END=dwt_end is not None, HAS_DW_START=dwt_start is not None, DT=DT, CDT=CDT, PREC=PREC,
            **_opts(interp, "dh"))
        dq, dk, deta, dv = (torch.empty_like(x) for x in (q, k, eta, v))
        BVq = BK if interp else min(64, max(16, 8192 // BK), next_pow2(V))
        _bwd_dqkv_kernel[(N, B * H)](
            q, k, v, eta, do, h, dh, Wg0 if has_wg else h, dq, dk, dv, deta, T, N, H=H, K=K, V=V, MB=MB,
            BC=BC, BK=BK, BV=BVq, HAS_WG=has_wg, DT=DT, CDT=CDT, PREC=PREC, **_opts(interp, "dqkv"))
        w_dt, wg_dt = ctx.w_dtypes
        return (dq, dk, dv, deta, dw0t.transpose(-1, -2).to(w_dt),
                dwg0t.transpose(-1, -2).to(wg_dt) if has_wg else None, None, None)


def _check(q: torch.Tensor, v: torch.Tensor, mini_batch_size: int) -> None:
    if q.dtype not in _TL:
        raise TypeError(f"ttt_linear: the Triton kernel takes float16/bfloat16/float32/float64 inputs, not {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"ttt_linear: the Triton kernel takes head dims up to {MAX_HEAD_DIM}, "
                         f"got dk={q.shape[-1]}, dv={v.shape[-1]}")
    if not 1 <= mini_batch_size <= MAX_MINI_BATCH:
        raise ValueError(f"ttt_linear: the Triton kernel takes mini_batch_size in [1, {MAX_MINI_BATCH}], "
                         f"got {mini_batch_size}")


def ttt_linear_triton(q, k, v, eta, W0, mini_batch_size: int, W_start=None, idx=None):
    """TTT-Linear on mini-batch-aligned inputs: mini-batch c is tokens [c b, (c+1) b) of every sample (a token
    with η = 0 and k = 0 is an empty slot: it changes nothing).

    ``W0`` the initial weights, ``W_start`` (None = W0) where mini-batch 0's gradients are taken, ``idx``
    ``[B]`` (None = T // b) the mini-batch whose start weights are returned as the final W_start. Returns
    ``(o [B, T, H, dv], W_end, W_start)``, weights ``[B, H, dv, dk]`` fp32 (fp64 for fp64 inputs).
    b = 1 runs the delta-rule kernels (β = η; there W_start = W always)."""
    _check(q, v, mini_batch_size)
    if mini_batch_size == 1:
        from .delta import chunk_delta_rule

        if q.dtype == torch.float64:
            raise TypeError("ttt_linear: mini_batch_size=1 runs the delta-rule kernels, which take "
                            "float16/bfloat16/float32 inputs, not float64")
        o, S = chunk_delta_rule(q, k, v, eta, scale=1.0, initial_state=W0.float(), output_final_state=True)
        return o, S, S
    return TTTLinearFunction.apply(q, k, v, eta, W0, W_start, idx, mini_batch_size)
