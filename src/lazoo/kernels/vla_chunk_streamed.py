"""The chunked VLA scan's forward with A kept in global memory (L2) and taken in column blocks, not held in
registers (``lazoo.kernels.vla_chunk``; ``vla_scan_chunked(..., streamed=True)``).

Why: the register-resident forward holds A (d × d fp32, 64 registers a thread at d = 128 and 8 warps) and, for the
tf32x3 products, two split copies of it, so every block step spills. On an H100 it issued an instruction a warp
every 7.1 cycles against the token scan's 3.4, with 8 M local-memory requests at T = 1024 (docs/vla.md). Here a
program holds one [d, BCOL] column block of A at a time.

Per segment of a block (rows U, X ``[BC, d]``; the same algebra as ``vla_chunk``), in column blocks of BCOL:

  1. W = U A and XA = X A from [BCOL, BCOL] tiles of A (stored to a small per-program buffer), and
     G = I + Σ_c U_c W_cᵀ;
  2. N, D from G's LDLᵀ; Aa = N W (stored); Zm = M ⊙ (Aa Xᵀ / D); Y = XA − Zmᵀ Aa, and each row's norm;
  3. α̂ = Y / |Y|, and A_c ← A_c − Sᵀ S_c (+ ηI at a flagged last token) with S = Aa / √D.

A segment reads A twice and writes it once (192 KB at d = 128). The program's own stores are read back in other
layouts, so by other threads: a barrier follows each pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._vla_blocks import block_start, ldl_inverse, rows, seg_end, store_rows

#: columns of A a step (tl.dot needs >= 16)
BCOL = 32


@triton.jit
def _copy_square(src, dst, D: tl.constexpr, BD: tl.constexpr, BCOL: tl.constexpr):
    """dst ← src, D × D fp32, a column block at a time."""
    o = tl.arange(0, BD)
    for c0 in range(0, BD, BCOL):
        oc = c0 + tl.arange(0, BCOL)
        at = o[:, None] * D + oc[None, :]
        m = (o < D)[:, None] & (oc < D)[None, :]
        tl.store(dst + at, tl.load(src + at, mask=m, other=0.0), mask=m)


@triton.jit
def _chunk_fwd_streamed_kernel(
    k, u, flags, A0, alpha, rnorm, A_out, ckpt, buf, T, NB, NCK, eta,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
    SAVE: tl.constexpr, PREC: tl.constexpr, BCOL: tl.constexpr,
):
    """As ``vla_chunk._chunk_fwd_kernel``; A lives in ``A_out`` (the final A when done), ``buf [B, H, 3, BC, D]``
    holds W (then Y), XA and Aa. Every product is of [BC, BCOL] or [BCOL, BCOL] tiles: a [BC, d] operand would be
    copied into every warp (64 registers a thread at d = 128, twice over for tf32x3)."""
    eta = tl.cast(eta, tl.float32)  # fp64 (or a constant) when launched under torch.compile
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    bh = i_b * H + i_h
    od = tl.arange(0, BD)
    ot = tl.arange(0, BCOL)
    A = A_out + bh * D * D
    b_w = buf + bh * 3 * BC * D  # W
    b_y = b_w + BC * D  # XA, then Y
    b_a = b_y + BC * D  # Aa
    _copy_square(A0 + bh * D * D, A, D, BD, BCOL)
    tl.debug_barrier()
    for j in range(0, NB):
        if SAVE and j % K == 0:
            _copy_square(A, ckpt + (bh * NCK + j // K) * D * D, D, BD, BCOL)
        r, pos, valid, fl = block_start(flags, i_b, j, T, BC)
        at_r = r[:, None] * D  # the block's rows in the buffer
        s0 = 0
        while s0 < BC:
            e = seg_end(fl, r, s0, BC)
            keep = (r >= s0) & (r <= e) & valid
            f = tl.sum(tl.where(r == e, fl, 0.0), 0) * eta
            # 1. W = U A and XA = X A in [BCOL, BCOL] tiles of A, and G = I + U Wᵀ
            G = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
            for c0 in range(0, BD, BCOL):
                oc = c0 + ot
                Wc = tl.zeros([BC, BCOL], tl.float32)
                Yc = tl.zeros([BC, BCOL], tl.float32)
                for k0 in range(0, BD, BCOL):
                    ok = k0 + ot
                    Akc = tl.load(A + ok[:, None] * D + oc[None, :], mask=(ok < D)[:, None] & (oc < D)[None, :],
                                  other=0.0)
                    Wc = tl.dot(rows(u, i_b, i_h, pos, keep, T, H, D, ok), Akc, Wc, input_precision=PREC)
                    Yc = tl.dot(rows(k, i_b, i_h, pos, keep, T, H, D, ok), Akc, Yc, input_precision=PREC)
                mc = (oc < D)[None, :]
                tl.store(b_w + at_r + oc[None, :], Wc, mask=mc)
                tl.store(b_y + at_r + oc[None, :], Yc, mask=mc)
                G += tl.dot(rows(u, i_b, i_h, pos, keep, T, H, D, oc), tl.trans(Wc), input_precision=PREC)
            tl.debug_barrier()
            # 2. the factor; Aa = N W; Zm = M ⊙ (Aa Xᵀ / D); Y = XA − Zmᵀ Aa (+ η k̂ at a flag); |Y| per row
            N, Dv = ldl_inverse(G, r, BC, PREC)
            Z = tl.zeros([BC, BC], tl.float32)
            for c0 in range(0, BD, BCOL):
                oc = c0 + ot
                mc = (oc < D)[None, :]
                Aac = tl.dot(N, tl.load(b_w + at_r + oc[None, :], mask=mc, other=0.0), input_precision=PREC)
                tl.store(b_a + at_r + oc[None, :], Aac, mask=mc)
                Z = tl.dot(Aac, tl.trans(rows(k, i_b, i_h, pos, keep, T, H, D, oc)), Z, input_precision=PREC)
            Zmt = tl.trans(tl.where(r[:, None] <= r[None, :], Z / Dv[:, None], 0.0))
            tl.debug_barrier()
            sq = tl.zeros([BC], tl.float32)
            last = tl.where(r == e, f, 0.0)[:, None]
            for c0 in range(0, BD, BCOL):
                oc = c0 + ot
                mc = (oc < D)[None, :]
                Yc = tl.load(b_y + at_r + oc[None, :], mask=mc, other=0.0) - tl.dot(
                    Zmt, tl.load(b_a + at_r + oc[None, :], mask=mc, other=0.0), input_precision=PREC)
                Yc += last * rows(k, i_b, i_h, pos, keep, T, H, D, oc)
                sq += tl.sum(Yc * Yc, 1)
                tl.store(b_w + at_r + oc[None, :], Yc, mask=mc)  # W's place: not read in place of XA
            rn = 1.0 / tl.maximum(tl.sqrt(sq), 1e-12)
            tl.store(rnorm + (i_b * T + pos) * H + i_h, rn, mask=keep)
            tl.debug_barrier()
            # 3. α̂ = Y / |Y|, and A ← A − Sᵀ S (+ ηI) with S = Aa / √D, a column block at a time
            rs = 1.0 / tl.sqrt(Dv)[:, None]
            St = tl.trans(tl.load(b_a + at_r + od[None, :], mask=(od < D)[None, :], other=0.0) * rs)  # Sᵀ
            for c0 in range(0, BD, BCOL):
                oc = c0 + ot
                mc = (oc < D)[None, :]
                Yc = tl.load(b_w + at_r + oc[None, :], mask=mc, other=0.0)
                store_rows(alpha, Yc * rn[:, None], i_b, i_h, pos, keep, T, H, D, oc)
                at = od[:, None] * D + oc[None, :]
                m2 = (od < D)[:, None] & mc
                Sc = tl.load(b_a + at_r + oc[None, :], mask=mc, other=0.0) * rs
                Ac = tl.load(A + at, mask=m2, other=0.0) - tl.dot(St, Sc, input_precision=PREC)
                tl.store(A + at, Ac + tl.where(od[:, None] == oc[None, :], f, 0.0), mask=m2)
            tl.debug_barrier()
            s0 = e + 1


def chunk_forward_streamed(k_hat, u_hat, flags, A0, alpha, rnorm, A_end, ckpt, T, NB, NCK, eta, *, H, D, BD, BC,
                           K, SAVE, PREC, launch):
    """Launch the streamed forward on grid (B, H): the arguments and outputs of ``vla_chunk._chunk_fwd_kernel``."""
    B = k_hat.shape[0]
    buf = torch.empty(B, H, 3, BC, D, device=k_hat.device, dtype=torch.float32)
    _chunk_fwd_streamed_kernel[(B, H)](k_hat, u_hat, flags, A0, alpha, rnorm, A_end, ckpt, buf, T, NB, NCK, eta,
                                       H=H, D=D, BD=BD, BC=BC, K=K, SAVE=SAVE, PREC=PREC, BCOL=min(BCOL, BD),
                                       **launch)
