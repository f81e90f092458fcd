"""Chunk-parallel Triton kernels for VLA's precision scan (same interface and results as ``lazoo.kernels.vla.token``),
run by ``lazoo.ops.vla(..., backend="triton", triton_scan="chunk")`` (the mixer option ``triton_scan``).

Per head the scan is (û, k̂ normalised by the caller, û = 0 at pads)

    z = A û;  δ = 1 + û·z;  A ← A - z zᵀ/δ;  if flag_t: A ← A + ηI;  a_t = A k̂_t;  α̂_t = a_t / |a_t|

Instead of one token at a time, a chunk of C tokens (rows U = û's, X = k̂'s, ``[C, d]``) is taken at once from
its start A0 by the Woodbury identity, as matrix products (tl.dot; row layout: one token a row):

    W = U A0;  G = I + U Wᵀ = L D Lᵀ (LDLᵀ, L unit lower);  N = L⁻¹;  Aa = N W      (row i: aa_i)
    Zm = M ⊙ (Aa Xᵀ / D[:, None])  with M[i, t] = [i ≤ t];   Y' = X A0 - Zmᵀ Aa       (row t: (A_t k̂_t)ᵀ)
    A_C = A0 - Aaᵀ diag(1/D) Aa;  at a flagged last token: A_end = A_C + ηI, y_last += η k̂_last

D_i is the δ of the token scan (δ_i = 1 + û_iᵀ A_{i-1} û_i ≥ 1 while A is positive definite, which the
downdates and +ηI preserve), so the scan's clip δ ≥ eps never binds and ``eps`` is unused here.
The +ηI refresh is full rank and cannot enter the Woodbury form, so a chunk ends at every flagged token:
the sequence is cut in fixed blocks of ``BC`` tokens, and a block into segments that end at its flagged
tokens (positions outside the segment are masked to û = k̂ = 0, an exact no-op, and not stored).

Backward of one segment, given Ȳ (rows: the gradient of y_t = A_t k̂_t) and Ā (the symmetrised gradient of
the segment's end A, unchanged through the refresh), with Q = M ⊙ (Aa Ȳᵀ / D[:, None]), Ũ = N U, Ud = Ũ / D:

    X̄' = Ȳ A0 - Qᵀ Aa;   k̂̄ = X̄' (+ η ȳ_last at a flagged last token)
    ū  = -2 [ (U A_C) Ā A_C + ½ ( (M' ⊙ Y' Uᵀ)ᵀ X̄' + (M' ⊙ X̄' Uᵀ)ᵀ Y' ) ],  M'[s, t] = [s ≥ t]
    Ā0 = Φᵀ Ā Φ + ½ (P̄ᵀ Px + Pxᵀ P̄),  Φ = I - Aaᵀ Ud,  P̄ = Ȳ - Qᵀ Ũ,  Px = X - Zmᵀ Ũ

A_C is never formed in the backward (U A_C = W - (U Aaᵀ / D) Aa, likewise for the right factor), and
Φᵀ Ā Φ is expanded in the rank-C factors, so Ā0 = Ā - K - Kᵀ with two d×C×d products for K.
The LDLᵀ is a C-step loop on C×C register tiles (symmetric elimination, two reductions a step); N = L⁻¹ then
follows from products of C×C tiles, L being I plus a nilpotent part.

Kernels: ``_chunk_fwd_kernel`` (one program per sample and head, A ``[d, d]`` fp32 in registers; for training
it stores A at the start of every ``K``-th block); ``_chunk_bwd_kernel`` walks the checkpoint intervals in
reverse, recomputes the A at each block start of the interval into a scratch buffer, then walks the blocks
and their segments in reverse (the A at a segment start inside a block is recomputed from the block start:
one extra segment step per earlier segment, nothing when a block holds no flag) and applies the formulas
above. Memory: B·H·(T/(K·BC) + K)·d² fp32 besides the α̂ and 1/|a| of the forward. The block algebra is in
``lazoo.kernels.vla._blocks``. (A forward that took A from global memory in column blocks removed the spills of
this one but reloaded A for every product, and was slower: docs/vla.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..limits import VLA_MAX_HEAD_DIM as MAX_HEAD_DIM
from ._blocks import block_start, ldl_inverse, rows, seg_end, seg_start, store_rows

#: tokens per block (the chunk length of the Woodbury step; tl.dot needs >= 16)
BLOCK = 16
#: blocks between checkpoints of A (BLOCK * CKPT_BLOCKS = 256 tokens)
CKPT_BLOCKS = 16
#: tl.dot input precision. A accumulates over the whole sequence, so its products need fp32 accuracy:
#: "tf32x3" (three tf32 tensor-core products) matched "ieee" (fp32 FMA, 8x slower) on an H100 at d = 128,
#: T = 1000 (~1e-6 from float64, as the token scan); one-pass "tf32" was 2.3x faster but off by ~1e-3.
PRECISION = "tf32x3"


@triton.jit
def _factor(A0, U, r, BC: tl.constexpr, PREC: tl.constexpr):
    """W = U A0, N = L⁻¹ and D of G = I + U Wᵀ, and Aa = N W (A0 symmetric)."""
    W = tl.dot(U, A0, input_precision=PREC)
    G = tl.dot(U, tl.trans(W), input_precision=PREC) + tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    N, Dv = ldl_inverse(G, r, BC, PREC)
    Aa = tl.dot(N, W, input_precision=PREC)
    return W, N, Dv, Aa


@triton.jit
def _downdate(A0, Aa, Dv, f, eye, PREC: tl.constexpr):
    """A_C + f I with A_C = A0 - Aaᵀ diag(1/D) Aa, written as Sᵀ S (S = Aa / √D) to stay symmetric."""
    S = Aa / tl.sqrt(Dv)[:, None]
    return A0 - tl.dot(tl.trans(S), S, input_precision=PREC) + f * eye


@triton.jit
def _outputs(A0, X, Aa, Dv, r, PREC: tl.constexpr):
    """Zm and Y' (rows (A_t k̂_t)ᵀ before the refresh)."""
    Z = tl.dot(Aa, tl.trans(X), input_precision=PREC)
    Zm = tl.where(r[:, None] <= r[None, :], Z / Dv[:, None], 0.0)
    Yp = tl.dot(X, A0, input_precision=PREC) - tl.dot(tl.trans(Zm), Aa, input_precision=PREC)
    return Zm, Yp


@triton.jit
def _advance_segment(A, U, fl, r, s0, eta, eye, BC: tl.constexpr, PREC: tl.constexpr):
    """(A after the segment starting at s0, its last position) -- the forward without outputs."""
    e = seg_end(fl, r, s0, BC)
    seg = (r >= s0) & (r <= e)
    f = tl.sum(tl.where(r == e, fl, 0.0), 0) * eta
    W, N, Dv, Aa = _factor(A, tl.where(seg[:, None], U, 0.0), r, BC, PREC)
    return _downdate(A, Aa, Dv, f, eye, PREC), e


@triton.jit
def _state_program(D: tl.constexpr, BD: tl.constexpr):
    """A program on grid (B, H): sample i_b, head i_h, and the [BD, BD] tile of a D×D matrix: mask m2, row-major
    offsets p2, the identity eye."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    od = tl.arange(0, BD)
    m2 = (od < D)[:, None] & (od < D)[None, :]
    eye = tl.where((od[:, None] == od[None, :]) & m2, 1.0, 0.0)
    return i_b, i_h, od, m2, od[:, None] * D + od[None, :], eye


@triton.jit
def _chunk_fwd_kernel(
    k, u, flags, A0, alpha, rnorm, A_out, ckpt, T, NB, NCK, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
    SAVE: tl.constexpr, PREC: tl.constexpr,
):
    """Blocks of BC tokens, each in segments that end at its flagged tokens; α̂ and 1/|a| of every token, the
    final A, and with SAVE the A at the start of every K-th block."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_b, i_h, od, m2, p2, eye = _state_program(D, BD)
    A = tl.load(A0 + (i_b * H + i_h) * D * D + p2, mask=m2, other=0.0)
    for j in range(0, NB):
        if SAVE and j % K == 0:
            tl.store(ckpt + ((i_b * H + i_h) * NCK + j // K) * D * D + p2, A, mask=m2)
        r, pos, valid, fl = block_start(flags, i_b, j, T, BC)
        U_blk = rows(u, i_b, i_h, pos, valid, T, H, D, od)
        X_blk = rows(k, i_b, i_h, pos, valid, T, H, D, od)
        s0 = 0
        while s0 < BC:
            e = seg_end(fl, r, s0, BC)
            seg = (r >= s0) & (r <= e)
            f = tl.sum(tl.where(r == e, fl, 0.0), 0) * eta
            X = tl.where(seg[:, None], X_blk, 0.0)
            W, N, Dv, Aa = _factor(A, tl.where(seg[:, None], U_blk, 0.0), r, BC, PREC)
            Zm, Y = _outputs(A, X, Aa, Dv, r, PREC)
            Y += tl.where(r == e, f, 0.0)[:, None] * X
            A = _downdate(A, Aa, Dv, f, eye, PREC)
            rn = 1.0 / tl.maximum(tl.sqrt(tl.sum(Y * Y, 1)), 1e-12)
            keep = seg & valid
            store_rows(alpha, Y * rn[:, None], i_b, i_h, pos, keep, T, H, D, od)
            tl.store(rnorm + (i_b * T + pos) * H + i_h, rn, mask=keep)
            s0 = e + 1
    tl.store(A_out + (i_b * H + i_h) * D * D + p2, A, mask=m2)


@triton.jit
def _segment_backward(A0, Ab, U, X, Yb, e, f, r, BC: tl.constexpr, PREC: tl.constexpr):
    """(dk̂ rows, dû rows, gradient of A0) of one segment from Ȳ (rows) and Ā (symmetric)."""
    W, N, Dv, Aa = _factor(A0, U, r, BC, PREC)
    Zm, Yp = _outputs(A0, X, Aa, Dv, r, PREC)
    upper = r[:, None] <= r[None, :]  # M[i, t] = [i <= t]
    lower = r[:, None] >= r[None, :]  # M'[s, t] = [s >= t]
    Q = tl.where(upper, tl.dot(Aa, tl.trans(Yb), input_precision=PREC) / Dv[:, None], 0.0)
    Xb = tl.dot(Yb, A0, input_precision=PREC) - tl.dot(tl.trans(Q), Aa, input_precision=PREC)
    dX = Xb + tl.where(r == e, f, 0.0)[:, None] * Yb
    # ū = -2 [ (U A_C) Ā A_C + ½ (...) ], A_C applied as A0 - Aaᵀ diag(1/D) Aa from the right
    UAc = W - tl.dot(tl.dot(U, tl.trans(Aa), input_precision=PREC) / Dv[None, :], Aa, input_precision=PREC)
    T1 = tl.dot(UAc, Ab, input_precision=PREC)
    T1Ac = tl.dot(T1, A0, input_precision=PREC) - tl.dot(
        tl.dot(T1, tl.trans(Aa), input_precision=PREC) / Dv[None, :], Aa, input_precision=PREC)
    P1 = tl.where(lower, tl.dot(Yp, tl.trans(U), input_precision=PREC), 0.0)
    P2 = tl.where(lower, tl.dot(Xb, tl.trans(U), input_precision=PREC), 0.0)
    dU = -2.0 * T1Ac - tl.dot(tl.trans(P1), Xb, input_precision=PREC) - tl.dot(tl.trans(P2), Yp,
                                                                              input_precision=PREC)
    # Ā0 = Ā - K - Kᵀ, K = V' Ud - ½ P̄ᵀ Px with V'ᵀ = Aa Ā - ½ S Ud, S = Aa Ā Aaᵀ
    Ut = tl.dot(N, U, input_precision=PREC)
    Ud = Ut / Dv[:, None]
    Vt = tl.dot(Aa, Ab, input_precision=PREC)
    S = tl.dot(Vt, tl.trans(Aa), input_precision=PREC)
    Vpt = Vt - 0.5 * tl.dot(S, Ud, input_precision=PREC)
    Pbar = Yb - tl.dot(tl.trans(Q), Ut, input_precision=PREC)
    Px = X - tl.dot(tl.trans(Zm), Ut, input_precision=PREC)
    Km = tl.dot(tl.trans(Vpt), Ud, input_precision=PREC) - 0.5 * tl.dot(tl.trans(Pbar), Px, input_precision=PREC)
    return dX, dU, Ab - Km - tl.trans(Km)


@triton.jit
def _chunk_bwd_kernel(
    k, u, flags, alpha, rnorm, dalpha, dA_end, ckpt, scratch, dk, du, dA0, T, NB, NCK, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
    USE_DA: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse over checkpoint intervals, their blocks and the blocks' segments; carries Ā (symmetric)."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_b, i_h, od, m2, p2, eye = _state_program(D, BD)
    bh = i_b * H + i_h
    Ab = tl.zeros([BD, BD], dtype=tl.float32)
    if USE_DA:  # only the symmetric part of dA_end acts on the symmetric A
        pt = od[None, :] * D + od[:, None]
        Ab += 0.5 * (tl.load(dA_end + bh * D * D + p2, mask=m2, other=0.0)
                     + tl.load(dA_end + bh * D * D + pt, mask=m2, other=0.0))
    for cc in range(0, NCK):
        c = NCK - 1 - cc
        # the A at every block start of this interval, into scratch
        A = tl.load(ckpt + (bh * NCK + c) * D * D + p2, mask=m2, other=0.0)
        for jj in range(0, K):
            j = c * K + jj
            if j < NB:
                tl.store(scratch + (bh * K + jj) * D * D + p2, A, mask=m2)
                if jj < K - 1 and j + 1 < NB:
                    r, pos, valid, fl = block_start(flags, i_b, j, T, BC)
                    U_blk = rows(u, i_b, i_h, pos, valid, T, H, D, od)
                    s0 = 0
                    while s0 < BC:
                        A, e = _advance_segment(A, U_blk, fl, r, s0, eta, eye, BC, PREC)
                        s0 = e + 1
        for jj in range(0, K):
            j = c * K + K - 1 - jj
            if j < NB:
                r, pos, valid, fl = block_start(flags, i_b, j, T, BC)
                U_blk = rows(u, i_b, i_h, pos, valid, T, H, D, od)
                X_blk = rows(k, i_b, i_h, pos, valid, T, H, D, od)
                al = rows(alpha, i_b, i_h, pos, valid, T, H, D, od)
                dal = rows(dalpha, i_b, i_h, pos, valid, T, H, D, od)
                rn = tl.load(rnorm + (i_b * T + pos) * H + i_h, mask=valid, other=0.0)
                Yb_blk = (dal - al * tl.sum(al * dal, 1)[:, None]) * rn[:, None]  # through α̂ = a / |a|
                e_end = BC - 1
                while e_end >= 0:
                    s = seg_start(fl, r, e_end)
                    A0 = tl.load(scratch + (bh * K + K - 1 - jj) * D * D + p2, mask=m2, other=0.0)
                    s0 = 0
                    while s0 < s:  # the A at this segment's start, from the block start
                        A0, e = _advance_segment(A0, U_blk, fl, r, s0, eta, eye, BC, PREC)
                        s0 = e + 1
                    seg = (r >= s) & (r <= e_end)
                    f = tl.sum(tl.where(r == e_end, fl, 0.0), 0) * eta
                    dX, dU, Ab = _segment_backward(
                        A0, Ab, tl.where(seg[:, None], U_blk, 0.0), tl.where(seg[:, None], X_blk, 0.0),
                        tl.where(seg[:, None], Yb_blk, 0.0), e_end, f, r, BC, PREC)
                    keep = seg & valid
                    store_rows(dk, dX, i_b, i_h, pos, keep, T, H, D, od)
                    store_rows(du, dU, i_b, i_h, pos, keep, T, H, D, od)
                    e_end = s - 1
    tl.store(dA0 + bh * D * D + p2, Ab, mask=m2)


#: num_warps by head dim (d = 128: 8 warps beat 4 by 20% on an H100; the others are guesses)
WARPS = {16: 4, 32: 4, 64: 4, 128: 8}


def _launch_opts(BD: int, device) -> dict:
    if device.type == "cpu":  # the interpreter
        return {}
    return {"num_warps": WARPS[BD]}


def _block_dim(D: int) -> int:
    return max(16, triton.next_power_of_2(D))  # tl.dot tiles are at least 16 wide


class VLAChunkScanFunction(torch.autograd.Function):
    """α̂ ``[B, T, H, dk]`` and the final A from k̂, û ``[B, T, H, dk]``, refresh flags ``[B, T]`` and the
    initial A ``[B, H, dk, dk]`` (symmetric); differentiable in k̂, û and A0 (A0's gradient symmetric)."""

    @staticmethod
    def forward(ctx, k_hat, u_hat, flags, A0, eta: float, block: int, ckpt_blocks: int, precision: str):
        B, T, H, D = k_hat.shape
        dev = k_hat.device
        BD = _block_dim(D)
        NB = triton.cdiv(T, block)
        NCK = triton.cdiv(NB, ckpt_blocks)
        save = any(ctx.needs_input_grad[i] for i in (0, 1, 3))
        k_hat, u_hat = k_hat.contiguous(), u_hat.contiguous()
        flags = flags.to(torch.float32).contiguous()
        a_dt = A0.dtype
        A0 = A0.to(torch.float32).contiguous()
        f32 = torch.float32
        alpha = torch.empty(B, T, H, D, device=dev, dtype=f32)
        rnorm = torch.empty(B, T, H, device=dev, dtype=f32)
        A_end = torch.empty(B, H, D, D, device=dev, dtype=f32)
        ckpt = torch.empty(B, H, NCK, D, D, device=dev, dtype=f32) if save else A_end
        _chunk_fwd_kernel[(B, H)](k_hat, u_hat, flags, A0, alpha, rnorm, A_end, ckpt, T, NB, NCK, float(eta),
                                  H=H, D=D, BD=BD, BC=block, K=ckpt_blocks, SAVE=save, PREC=precision,
                                  **_launch_opts(BD, dev))
        if save:
            ctx.save_for_backward(k_hat, u_hat, flags, alpha, rnorm, ckpt)
        ctx.hp = (float(eta), block, ckpt_blocks, precision)
        ctx.dtypes = (k_hat.dtype, u_hat.dtype, a_dt)
        return alpha, A_end

    @staticmethod
    def backward(ctx, dalpha, dA_end):
        k_hat, u_hat, flags, alpha, rnorm, ckpt = ctx.saved_tensors
        eta, block, ckpt_blocks, precision = ctx.hp
        B, T, H, D = k_hat.shape
        dev = k_hat.device
        BD = _block_dim(D)
        NB = triton.cdiv(T, block)
        NCK = ckpt.shape[2]
        f32 = torch.float32
        dalpha = torch.zeros_like(alpha) if dalpha is None else dalpha.to(f32).contiguous()
        use_da = dA_end is not None
        dA_end = dA_end.to(f32).contiguous() if use_da else alpha
        dk, du = torch.zeros_like(alpha), torch.zeros_like(alpha)
        dA0 = torch.empty(B, H, D, D, device=dev, dtype=f32)
        scratch = torch.empty(B, H, ckpt_blocks, D, D, device=dev, dtype=f32)
        _chunk_bwd_kernel[(B, H)](k_hat, u_hat, flags, alpha, rnorm, dalpha, dA_end, ckpt, scratch, dk, du, dA0,
                                  T, NB, NCK, eta, H=H, D=D, BD=BD, BC=block, K=ckpt_blocks, USE_DA=use_da,
                                  PREC=precision, **_launch_opts(BD, dev))
        k_dt, u_dt, a_dt = ctx.dtypes
        return dk.to(k_dt), du.to(u_dt), None, dA0.to(a_dt), None, None, None, None


def vla_scan_chunked(k_hat, u_hat, flags, A0, *, eta: float, eps: float = 1e-4, block: int | None = None,
                     ckpt_blocks: int | None = None, precision: str | None = None):
    """``(α̂ [B, T, H, dk] fp32, final A [B, H, dk, dk] fp32)``, as ``lazoo.kernels.vla.token.vla_scan``.

    ``eps`` is accepted for the same interface; the δ ≥ eps clip never binds (δ ≥ 1 while A is positive
    definite). ``block`` (tokens per chunk: 16, 32 or 64), ``ckpt_blocks`` (blocks between
    checkpoints of A) and ``precision`` (tl.dot input precision) default to the module constants."""
    D = k_hat.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"vla_scan_chunked: head dims up to {MAX_HEAD_DIM} (A is held in registers), got {D}")
    block = BLOCK if block is None else int(block)
    if block not in (16, 32, 64):
        raise ValueError(f"vla_scan_chunked: block must be 16, 32 or 64, got {block}")
    if k_hat.is_cuda and D > 64 and block > 16:  # measured on an H100: 256-270 KB of shared memory (max 227)
        raise ValueError(f"vla_scan_chunked: head dims above 64 need block = 16 (shared memory), got {block}")
    ckpt_blocks = CKPT_BLOCKS if ckpt_blocks is None else int(ckpt_blocks)
    if ckpt_blocks < 1:
        raise ValueError(f"vla_scan_chunked: ckpt_blocks must be >= 1, got {ckpt_blocks}")
    precision = PRECISION if precision is None else precision
    if precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"vla_scan_chunked: precision must be 'ieee', 'tf32' or 'tf32x3', got {precision!r}")
    return VLAChunkScanFunction.apply(k_hat, u_hat, flags, A0, eta, block, ckpt_blocks, precision)
