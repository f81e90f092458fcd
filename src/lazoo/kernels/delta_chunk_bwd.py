"""The (gated) delta rule's chunk-parallel backward as one Hopper kernel (Triton's Gluon dialect).

After the reverse state walk (``delta_gluon.bwd_walk`` or ``_bwd_dhu``: each chunk's end-state gradient dh = dS'ᵀ
and dU), everything left of the backward is local to a chunk. ``lazoo.kernels.delta`` does it in two Triton kernels,
``_bwd_dqkw`` (dq, the output's and the state update's share of dW, dW~ = -dU S) and ``_bwd_wy`` (back through
W~ = A Γ K, U~ = A V and A = (I + L)⁻¹: dk, dv, dβ, dg), which pass dW, dW~ and dG's partial sums through memory and
form the transposed products (dPᵀ, dAᵀ, dLᵀ) as products of their own, since a product's result never turns cheaply
in Triton. Here one program a (chunk, value head) does both: the chunk's tiles arrive by ``cp.async`` in two groups
(what the first products read, then q, k, v and A) and every intermediate a later product reads as a transposed
operand (M, dW~, dL, A) goes to shared memory once, where a view turns it:

    dP = dO Uᵀ,  M = tril(E ⊙ dP) scale,  dq = diag(γ scale) dO S + M diag(β) K,  dW = Mᵀ Q + diag(D) U dS'
    dW~ = -dU S,  dA = strict_tril(dW~ (Γ K)ᵀ + dU Vᵀ),  dv = Aᵀ dU,  dL = E ⊙ strict_tril(-Aᵀ dA Aᵀ)
    dk = dL diag(β) K + diag(β)(dW + dLᵀ K) + diag(γ) Aᵀ dW~,  dβ = rowsum((dW + dLᵀ K) ⊙ K)

with S = hᵀ the chunk's start state and dS' = dhᵀ the gradient of its end state, and dg from the same terms as
``_bwd_dqkw`` and ``_bwd_wy`` take it (their docstrings). With the norms' backward inside (one value head a key
head), dq and dk come back through the L2 norms as there.

Rows past a sequence's end inside its last chunk load as zeros (β = 0, G = the last row's) and are not stored.
Runs only on Hopper GPUs (no interpreter): ``chunk_bwd`` takes it where ``supported`` holds and ``USE_CHUNK_BWD``
lets it; the Triton kernels stay the reference (``tests/kernels/test_kernels_delta.py``).
"""

from __future__ import annotations

import functools

import torch

from . import delta_gluon as gw

CHUNK_BWD_ERROR = gw.GLUON_ERROR
if CHUNK_BWD_ERROR is None:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        _barrier = gw._barrier
    except Exception as e:  # noqa: BLE001 - an older or reorganised Triton
        CHUNK_BWD_ERROR = f"{type(e).__name__}: {e}"

CHUNK = gw.CHUNK
#: two warpgroups: each product's [64, 128] accumulator 32 registers a thread
WARPS = 8


def supported(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> str | None:
    """None where the kernel runs these inputs, else why not."""
    if CHUNK_BWD_ERROR is not None:
        return f"Triton's Gluon dialect lacks what the chunk backward needs ({CHUNK_BWD_ERROR})"
    why = gw.walk_supported(q, K, V, C, given_write_keys)
    if why is None and (K != 128 or V != 128):
        why = f"needs dk = dv = 128 (got {K}, {V})"
    return why


if CHUNK_BWD_ERROR is None:

    @gluon.jit
    def _vec(x, t0, eos, i_h, H: gl.constexpr, C: gl.constexpr, LAYOUT: gl.constexpr):
        """Column ``i_h`` of ``[TT, H]`` ``x`` at rows ``t0 + [0, C)`` as fp32 (zeros past ``eos``)."""
        return gw._rows(x, t0, eos, i_h, H, C, LAYOUT, 0.0)

    @gluon.jit
    def _issue_copies(do_s, u_s, du_s, h_s, dh_s, q_s, k_s, v_s, do, vnew, du, h, dh, q, k, v, i_h, i_k, t0, eos, hb,
                      H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
                      LD_K: gl.constexpr, LD_V: gl.constexpr):
        """Two groups of copies: the chunk's dO, U and dU rows with its state and the state's gradient (what the first
        products read), then its q, k and v rows."""
        gw._copy_rows(do_s, do, t0, eos, H * V, i_h * V, C, V, LD_V)
        gw._copy_rows(u_s, vnew, t0, eos, H * V, i_h * V, C, V, LD_V)
        gw._copy_rows(du_s, du, t0, eos, H * V, i_h * V, C, V, LD_V)
        gw._copy_rows(h_s, h + hb, 0, K, V, 0, K, V, LD_V)
        gw._copy_rows(dh_s, dh + hb, 0, K, V, 0, K, V, LD_V)
        cp.commit_group()
        gw._copy_rows(q_s, q, t0, eos, HK * K, i_k * K, C, K, LD_K)
        gw._copy_rows(k_s, k, t0, eos, HK * K, i_k * K, C, K, LD_K)
        gw._copy_rows(v_s, v, t0, eos, H * V, i_h * V, C, V, LD_V)
        cp.commit_group()

    @gluon.jit
    def _chunk_bwd_kernel(
        q, k, v, beta, Gc, A, h, dh, vnew, do, du, dq, dk, dv, dbeta, dg, rq, rk, chunks, cu, scale,
        H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
        HAS_G: gl.constexpr, NORM: gl.constexpr,
        LD_K: gl.constexpr, LD_V: gl.constexpr, LD_C: gl.constexpr, ACC_CK: gl.constexpr, ACC_CC: gl.constexpr,
        OP_K: gl.constexpr, SH_K: gl.constexpr, SH_V: gl.constexpr, SH_S: gl.constexpr, SH_C: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One program a (chunk, value head) of a grid of NT·H, the head fastest: see the module docstring. q, k
        ``[TT, HK, K]``, v, U (``vnew``), dO, dU ``[TT, H, V]`` and h, dh ``[NT, H, K, V]`` in the 16-bit type DT, β
        ``[TT, H]``, G ``[TT, H]`` and A ``[TT, H, C]`` in fp32. Writes dq, dk ``[TT, H, K]``, dv ``[TT, H, V]`` (DT),
        dβ and dg ``[TT, H]`` (fp32). With NORM, q and k are the L2-normalised ones and ``rq``, ``rk`` their rows'
        1/sqrt(|x|² + 1e-6)."""
        DT: gl.constexpr = q.dtype.element_ty
        f32: gl.constexpr = gl.float32
        scale = scale.to(f32)
        i_c, i_h, i_k, t0, eos = gw._chunk_program(gl.program_id(0), chunks, cu, H, HK)
        hb = (i_c.to(gl.int64) * H + i_h) * (K * V)  # the chunk's state in h and dh

        do_s = gl.allocate_shared_memory(DT, [C, V], SH_V)
        u_s = gl.allocate_shared_memory(DT, [C, V], SH_V)
        du_s = gl.allocate_shared_memory(DT, [C, V], SH_V)
        h_s = gl.allocate_shared_memory(DT, [K, V], SH_S)
        dh_s = gl.allocate_shared_memory(DT, [K, V], SH_S)
        q_s = gl.allocate_shared_memory(DT, [C, K], SH_K)
        k_s = gl.allocate_shared_memory(DT, [C, K], SH_K)
        v_s = gl.allocate_shared_memory(DT, [C, V], SH_V)
        m_s = gl.allocate_shared_memory(DT, [C, C], SH_C)  # M, for Mᵀ Q
        a_s = gl.allocate_shared_memory(DT, [C, C], SH_C)  # A, for Aᵀ dU, dA Aᵀ, Aᵀ (dA Aᵀ) and Aᵀ dW~
        t_s = gl.allocate_shared_memory(DT, [C, C], SH_C)  # dA Aᵀ, then E ⊙ dL (for dLᵀ K)
        wt_s = gl.allocate_shared_memory(DT, [C, K], SH_K)  # dW~
        _issue_copies(do_s, u_s, du_s, h_s, dh_s, q_s, k_s, v_s, do, vnew, du, h, dh, q, k, v, i_h, i_k, t0, eos, hb,
                      H, HK, K, V, C, LD_K, LD_V)

        ROW: gl.constexpr = gl.SliceLayout(1, ACC_CK)
        P_ROW: gl.constexpr = gl.SliceLayout(1, ACC_CC)
        P_COL: gl.constexpr = gl.SliceLayout(0, ACC_CC)
        rows = gl.arange(0, C, layout=ROW)
        beta_r = _vec(beta, t0, eos, i_h, H, C, ROW)
        beta_c = _vec(beta, t0, eos, i_h, H, C, P_COL)
        if HAS_G:
            g_last = gl.load(Gc + (gl.minimum(t0 + C, eos) - 1) * H + i_h)
            G_r = gw._rows(Gc, t0, eos, i_h, H, C, ROW, g_last)
            G_pr = gw._rows(Gc, t0, eos, i_h, H, C, P_ROW, g_last)
            G_pc = gw._rows(Gc, t0, eos, i_h, H, C, P_COL, g_last)
            gam_r = gl.exp(G_r)
            gam_c = gl.exp(G_pc)
        # A to shared memory in DT (rows past the end zero)
        ar = gl.arange(0, C, layout=gl.SliceLayout(1, LD_C))
        ac = gl.arange(0, C, layout=gl.SliceLayout(0, LD_C))
        a_t = gl.load(A + t0 * (H * C) + (ar[:, None] * (H * C) + (i_h * C + ac)[None, :]),
                      mask=(ar < eos - t0)[:, None], other=0.0)
        a_s.store(a_t.to(DT))

        cp.wait_group(1)  # the chunk's dO, U, dU, h and dh (its q, k and v may still be in flight)
        fence_async_shared()
        _barrier()
        zc = gl.zeros([C, K], f32, ACC_CK)
        dp = warpgroup_mma(do_s, u_s.permute((1, 0)), gl.zeros([C, C], f32, ACC_CC), use_acc=False, is_async=True)
        dos = warpgroup_mma(do_s, h_s.permute((1, 0)), zc, use_acc=False, is_async=True)
        uds = warpgroup_mma(u_s, dh_s.permute((1, 0)), zc, use_acc=False, is_async=True)
        dwt = warpgroup_mma(du_s, h_s.permute((1, 0)), zc, use_acc=False, is_async=True)
        if HAS_G:  # Σ S ⊙ dS' (the state update's decay γ_C), from the tiles as loaded, 32 rows at a time
            dgl = 0.0
            for r in gl.static_range(0, K, 32):
                dgl += gl.sum(gl.sum(h_s.slice(r, 32, dim=0).load(LD_V).to(f32)
                                     * dh_s.slice(r, 32, dim=0).load(LD_V).to(f32), 1), 0)
        dp, dos, uds, dwt = warpgroup_mma_wait(0, deps=(dp, dos, uds, dwt))

        # M = tril(E ⊙ dP) scale, to shared memory for Mᵀ Q; dW~ = -dU S likewise
        n_ok = (eos - t0).to(gl.int32)
        pr = gl.arange(0, C, layout=P_ROW)
        pc = gl.arange(0, C, layout=P_COL)
        keep = pr[:, None] >= pc[None, :]
        if HAS_G:
            m = gl.where(keep, dp * gl.exp(gl.where(keep, G_pr[:, None] - G_pc[None, :], 0.0)), 0.0) * scale
        else:
            m = gl.where(keep, dp, 0.0) * scale
        m_s.store(m.to(DT))
        wt_s.store((-dwt).to(DT))
        cp.wait_group(0)  # the chunk's q, k and v
        fence_async_shared()
        _barrier()

        # dq = diag(γ scale) dO S + M diag(β) K and dW = diag(D) U dS' + Mᵀ Q, each product accumulating onto its
        # first term; dA = dW~ (Γ K)ᵀ + dU Vᵀ, its first product (Γ on its columns once it is done)
        if HAS_G:
            dos = dos * (gam_r * scale)[:, None]
            uds = uds * gl.exp(g_last - G_r)[:, None]
            # dG's share of D and γ_C in the state update: at the chunk's last row
            x = gl.sum(beta_r * gl.sum(k_s.load(ACC_CK).to(f32) * uds, 1), 0) + gl.exp(g_last) * dgl
        else:
            dos = dos * scale
        mb = gl.convert_layout((m * beta_c[None, :]).to(DT), OP_K)
        dq_t = warpgroup_mma(mb, k_s, dos, is_async=True)
        dw = warpgroup_mma(m_s.permute((1, 0)), q_s, uds, is_async=True)
        da = warpgroup_mma(wt_s, k_s.permute((1, 0)), gl.zeros([C, C], f32, ACC_CC), use_acc=False, is_async=True)
        dq_t, dw, da = warpgroup_mma_wait(0, deps=(dq_t, dw, da))
        qf = q_s.load(ACC_CK).to(f32)
        if HAS_G:
            # dG from Γ in the inter-chunk output, E in M and in L and Γ K in W~ sums to q · dq + k · dk - 2 β (k ·
            # dW_total) per row (dq, dk before the norms); D and γ_C in the state update add x at the last row
            dgv = gl.sum(qf * dq_t, 1)
            last = gl.minimum(t0 + C, eos) - 1 - t0
            dgv += gl.where(rows == last, x, 0.0)
            da = da * gam_c[None, :]
        if NORM:  # dq_x = rstd (dq - q (q · dq))
            dq_t = (dq_t - qf * gl.sum(qf * dq_t, 1)[:, None]) * _vec(rq, t0, eos, i_h, H, C, ROW)[:, None]
        gw._store_rows(dq, dq_t, t0, eos, H * K, i_h * K, C, K, LD_K)

        # the rest of dA; dv = Aᵀ dU
        da = warpgroup_mma(du_s, v_s.permute((1, 0)), da, is_async=True)
        dv_t = warpgroup_mma(a_s.permute((1, 0)), du_s, gl.zeros([C, V], f32, ACC_CK), use_acc=False,
                             is_async=True)
        da, dv_t = warpgroup_mma_wait(0, deps=(da, dv_t))
        gw._store_rows(dv, dv_t, t0, eos, H * V, i_h * V, C, V, LD_V)
        strict = pr[:, None] > pc[None, :]
        da = gl.where(strict, da, 0.0)

        # dL = -Aᵀ (dA Aᵀ), strictly lower, then E
        t1 = warpgroup_mma(gl.convert_layout(da.to(DT), OP_K), a_s.permute((1, 0)), gl.zeros([C, C], f32, ACC_CC),
                           use_acc=False)
        t_s.store(t1.to(DT))
        fence_async_shared()
        _barrier()
        dl = warpgroup_mma(a_s.permute((1, 0)), t_s, gl.zeros([C, C], f32, ACC_CC), use_acc=False)
        if HAS_G:
            dl = gl.where(strict, -dl * gl.exp(gl.where(strict, G_pr[:, None] - G_pc[None, :], 0.0)), 0.0)
        else:
            dl = gl.where(strict, -dl, 0.0)
        _barrier()  # every warp has read dA Aᵀ
        t_s.store(dl.to(DT))
        fence_async_shared()
        _barrier()

        # dW_total = dW + dLᵀ K (the write key of L); Aᵀ dW~ (Γ K in W~); then
        # dk = dL diag(β) K (the read key of L) + diag(β) dW_total + diag(γ) Aᵀ dW~
        dw = warpgroup_mma(t_s.permute((1, 0)), k_s, dw, is_async=True)
        dkg = warpgroup_mma(a_s.permute((1, 0)), wt_s, gl.zeros([C, K], f32, ACC_CK), use_acc=False, is_async=True)
        dw, dkg = warpgroup_mma_wait(0, deps=(dw, dkg))
        kf = k_s.load(ACC_CK).to(f32)
        db = gl.sum(dw * kf, 1)
        if HAS_G:
            dkg = dkg * gam_r[:, None]
        dk_t = warpgroup_mma(gl.convert_layout((dl * beta_c[None, :]).to(DT), OP_K), k_s,
                             dkg + dw * beta_r[:, None])
        if HAS_G:
            dgv += gl.sum(kf * dk_t, 1) - 2.0 * beta_r * db
        if NORM:  # dk_x = rstd (dk - k (k · dk))
            dk_t = (dk_t - kf * gl.sum(kf * dk_t, 1)[:, None]) * _vec(rk, t0, eos, i_h, H, C, ROW)[:, None]
        gw._store_rows(dk, dk_t, t0, eos, H * K, i_h * K, C, K, LD_K)
        ok = rows < eos - t0
        gl.store(dbeta + (t0 + rows) * H + i_h, db, mask=ok)
        if HAS_G:  # g_t feeds G_s for every s >= t of its chunk: reverse cumulative sum
            dgc = gl.convert_layout(dgv, P_COL)
            rev = gl.sum(gl.where(pc[None, :] >= pr[:, None], dgc[None, :], 0.0), 1)
            gl.store(dg + (t0 + pr) * H + i_h, rev, mask=pr < n_ok)


@functools.cache
def layouts(K: int, V: int, dtype: torch.dtype) -> dict:
    """The kernel's layouts (constexpr arguments): tiles to and from memory (``LD_K``, ``LD_V``, ``LD_C``), the
    accumulators of ``[C, K]`` and ``[C, C]`` products, a ``[C, C]`` tile as a register operand (``OP_K``) and the
    shared tiles'."""
    DT = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    acc_ck = gw._mma_layout(CHUNK, K, WARPS)
    return dict(LD_K=gw._load_layout(K, WARPS), LD_V=gw._load_layout(V, WARPS),
                LD_C=gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0]),
                ACC_CK=acc_ck, ACC_CC=gw._mma_layout(CHUNK, CHUNK, WARPS),
                OP_K=gl.DotOperandLayout(operand_index=0, parent=acc_ck, k_width=2),
                SH_K=gl.NVMMASharedLayout.get_default_for([CHUNK, K], DT),
                SH_V=gl.NVMMASharedLayout.get_default_for([CHUNK, V], DT),
                SH_S=gl.NVMMASharedLayout.get_default_for([K, V], DT),
                SH_C=gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], DT))


def chunk_bwd(q, k, v, beta, Gc, A, h, dh, vnew, do, du, seqs, scale: float, norms=None):
    """``(dq, dk, dv, dbeta, dg)`` of the backward's chunk-parallel part on ``lazoo.kernels.delta.chunk_bwd``'s
    flattened inputs (dq and dk per value head; dg None for the ungated rule); ``norms`` ``(rstd_q, rstd_k)`` where q
    and k are L2-normalised inside the op and their norms' backward runs here (one value head a key head)."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    dev = q.device
    f32 = torch.float32
    dq = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dk = torch.empty(TT, H, K, device=dev, dtype=q.dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(TT, H, device=dev, dtype=f32)
    has_g = Gc is not None
    dg_ = torch.empty(TT, H, device=dev, dtype=f32) if has_g else None
    rq, rk = norms if norms is not None else (dbeta, dbeta)
    _chunk_bwd_kernel[(seqs.NT * H,)](
        q, k, v, beta, Gc if has_g else beta, A, h, dh, vnew, do, du, dq, dk, dv, dbeta, dg_ if has_g else dbeta,
        rq, rk, seqs.chunks, seqs.cu, scale, H=H, HK=HK, K=K, V=V, C=CHUNK, HAS_G=has_g,
        NORM=norms is not None,
        **layouts(K, V, q.dtype), num_warps=WARPS)
    return dq, dk, dv, dbeta, dg_
