"""Hopper (sm_90) kernels for the (gated) delta rule in Triton's Gluon dialect: explicit shared-memory tiles,
asynchronous copies and warpgroup matrix products, where ``lazoo.kernels.delta``'s Triton kernels leave those choices
to the compiler.

``_fwd_walk_out``: the forward's state walk with its outputs. Per sequence, head and dv block it runs
over the chunks (C = 64 rows) holding Sᵀ ``[dk, BV]`` in fp32 registers and, per chunk,

    U  = U~ - W~ Sᵀ                         (the pseudo-values, stored for the backward)
    O  = scale (diag(γ) Q Sᵀ + P U),   P = tril(E ⊙ Q Kᵀ) diag(β)
    Sᵀ' = γ_C Sᵀ + Kᵀ diag(β D) U        (each chunk's start state stored for the backward)

which ``lazoo.kernels.delta`` splits into ``_fwd_h`` and ``_fwd_o`` (the fused form in plain Triton spilled on
sm_90). Here the chunk's q, k, W~ and U~ tiles arrive by ``cp.async`` into two shared-memory buffers (the next
chunk's copies in flight while this one computes), the start state enters its products from a bf16 copy in shared
memory, and the transposed operands (Kᵀ in P and in the state update) are views of the loaded tiles: no product
result is ever transposed.

``_bwd_walk``: the backward's reverse walk in the same form (dU with Pᵀ dO, the chunk states' gradients, the
initial state's), standing in for ``_bwd_dv_local`` and ``_bwd_dhu``.

These kernels run only on Hopper GPUs (Gluon has no interpreter): the Triton kernels they stand in for stay the
reference, on the CPU through the interpreter and on the GPU beside them (``tests/kernels/test_kernels_delta.py``).
``chunk_fwd`` and ``chunk_bwd`` take them where ``walk_supported`` holds and ``USE_GLUON_WALK`` /
``USE_GLUON_BWD_WALK`` let them: by default where the walk has programs enough for the GPU (see their comments).
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon is part of Triton from 3.4 on, as an experimental dialect: its absence only removes these kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    # the masked global-to-shared copy: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # a barrier of the program's threads: ``thread_barrier`` up to Triton 3.6, ``barrier`` after
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - an older or reorganised Triton
    gluon = gl = cp = _async_load = _barrier = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

#: chunk rows, the dv blocks of the walk and its warps (two warpgroups: at one, sm_90 spills 68-168 bytes at dk = 128;
#: at two, 254 registers and no spill with Triton 3.6 and 3.9 at 64-wide dv blocks, 196-209 at 32-wide; 128-wide
#: ones spill). 64-wide blocks wherever dv allows: narrower ones for more programs did not pay (H200, bf16, gated,
#: fwd + bwd with the forward walk, 32 against 64: T = 8k B = 4 (64 against 128 programs) 3.74 against 2.97 ms, 32k
#: B = 1 5.32 against 4.71; the backward walk 3.03 against 2.91 and 4.41 at 32k), since a program's chunk step is
#: bound by its chain of dependent products, not by its width
CHUNK = 64
WALK_BV = 64
WALK_NARROW_BV = 32
WALK_WARPS = 8


def walk_block(V: int) -> int:
    """The walk's dv block: ``WALK_BV``, or ``WALK_NARROW_BV`` where dv is no multiple of it."""
    return WALK_BV if V % WALK_BV == 0 else WALK_NARROW_BV


def walk_supported(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> str | None:
    """None where the walks (``fwd_walk``, ``bwd_walk``) run these inputs, else why not."""
    if GLUON_ERROR is not None:
        return f"Triton's Gluon dialect is not importable ({GLUON_ERROR})"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs a Hopper GPU (sm_90)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"needs 16-bit inputs, not {q.dtype}"
    if given_write_keys:
        return "takes β k write keys, not given ones"
    if C != CHUNK or K not in (64, 128) or V % WALK_NARROW_BV:
        return f"needs chunks of {CHUNK}, dk of 64 or 128 and dv a multiple of {WALK_NARROW_BV} (got {C}, {K}, {V})"
    return None


if gluon is not None:

    @gluon.constexpr_function
    def _load_layout(cols, num_warps):
        """Rows of ``cols`` 16-bit values copied 16 bytes a thread, a warp's threads along a row first."""
        across = min(32, cols // 8)
        return gl.BlockedLayout([1, 8], [32 // across, across], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _mma_layout(rows, cols, num_warps):
        """Accumulator layout of a ``[rows, cols]`` warpgroup product (``rows`` >= 64) over ``num_warps`` warps."""
        warps = [4, 1]
        while warps[0] * warps[1] != num_warps:
            if rows > 16 * warps[0]:
                warps[0] *= 2
            else:
                warps[1] *= 2
        n = min(256, cols // warps[1])
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])

    @gluon.jit
    def _copy_rows(smem, ptr, row0, eos, stride, col0, R: gl.constexpr, BC: gl.constexpr, LAYOUT: gl.constexpr):
        """Issue the copy of rows ``row0 + [0, R)`` (those ``< eos``; zeros past it), columns ``col0 + [0, BC)``, of a
        row-major tensor into ``smem`` (the caller commits the group)."""
        r = gl.arange(0, R, layout=gl.SliceLayout(1, LAYOUT))
        c = gl.arange(0, BC, layout=gl.SliceLayout(0, LAYOUT))
        offs = r[:, None] * stride + (col0 + c)[None, :]
        _async_load(smem, ptr + row0 * stride + offs, mask=(r < eos - row0)[:, None])

    @gluon.jit
    def _copy_chunk(q_s, k_s, w_s, x_s, q, k, w, x, row0, end, i_k, i_h, v0, H: gl.constexpr, HK: gl.constexpr,
                    K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr, LD_K: gl.constexpr,
                    LD_V: gl.constexpr):
        """Issue, as one group, the copies of a chunk's q and k rows (key head ``i_k``), its W~ rows and its
        ``[C, BV]`` block of ``x`` (U~ or dO) at value head ``i_h``: rows ``row0 + [0, C)``, those before ``end``."""
        _copy_rows(q_s, q + i_k * K, row0, end, HK * K, 0, C, K, LD_K)
        _copy_rows(k_s, k + i_k * K, row0, end, HK * K, 0, C, K, LD_K)
        _copy_rows(w_s, w + i_h * K, row0, end, H * K, 0, C, K, LD_K)
        _copy_rows(x_s, x + i_h * V, row0, end, H * V, v0, C, BV, LD_V)
        cp.commit_group()

    @gluon.jit
    def _walk_program(cu, coff, H: gl.constexpr, HK: gl.constexpr, C: gl.constexpr):
        """A walk program of grid (V / BV, N, H), the dv block fastest (a head's blocks run side by side and share its
        rows in L2): (dv block, sequence, value head, its key head, the sequence's [bos, eos), its first chunk and its
        chunk count)."""
        i_n = gl.program_id(1)
        i_h = gl.program_id(2)
        bos = gl.load(cu + i_n).to(gl.int64)
        eos = gl.load(cu + i_n + 1).to(gl.int64)
        c0 = gl.load(coff + i_n).to(gl.int64)
        n_chunks = ((eos - bos + C - 1) // C).to(gl.int32)
        return gl.program_id(0), i_n, i_h, i_h // (H // HK), bos, eos, c0, n_chunks

    @gluon.jit
    def _walk_offsets(v0, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr,
                      ACC_KV: gl.constexpr, LD_V: gl.constexpr):
        """Offsets of the program's ``[K, BV]`` tile in a ``[V, K]`` state (ACC_KV) and in a ``[K, V]`` chunk state
        (LD_V), and of a chunk's ``[C, BV]`` rows in a ``[TT, H, V]`` tensor from its first row (LD_V), with those
        rows' indices."""
        kr = gl.arange(0, K, layout=gl.SliceLayout(1, ACC_KV))
        kc = gl.arange(0, BV, layout=gl.SliceLayout(0, ACC_KV))
        sr = gl.arange(0, K, layout=gl.SliceLayout(1, LD_V))
        sc = gl.arange(0, BV, layout=gl.SliceLayout(0, LD_V))
        orow = gl.arange(0, C, layout=gl.SliceLayout(1, LD_V))
        ocol = gl.arange(0, BV, layout=gl.SliceLayout(0, LD_V))
        return ((v0 + kc)[None, :] * K + kr[:, None], sr[:, None] * V + (v0 + sc)[None, :],
                orow[:, None] * (H * V) + (v0 + ocol)[None, :], orow)

    @gluon.jit
    def _walk_buffers(DT: gl.constexpr, C: gl.constexpr, K: gl.constexpr, BV: gl.constexpr, SH_K: gl.constexpr,
                      SH_V: gl.constexpr, SH_S: gl.constexpr):
        """A walk's shared memory: two buffers each of a chunk's q, k and W~ rows and of its ``[C, BV]`` block of U~ or
        dO (chunk j's in buffer j % 2), the state (or its gradient) as the products' bf16 operand, and two ``[C, BV]``
        tiles the chunk forms for its products."""
        return (gl.allocate_shared_memory(DT, [2, C, K], SH_K), gl.allocate_shared_memory(DT, [2, C, K], SH_K),
                gl.allocate_shared_memory(DT, [2, C, K], SH_K), gl.allocate_shared_memory(DT, [2, C, BV], SH_V),
                gl.allocate_shared_memory(DT, [K, BV], SH_S), gl.allocate_shared_memory(DT, [C, BV], SH_V),
                gl.allocate_shared_memory(DT, [C, BV], SH_V))

    @gluon.jit
    def _walk_state(x, i_n, i_h, p_state, USE: gl.constexpr, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                    BV: gl.constexpr, ACC_KV: gl.constexpr):
        """The walk's fp32 ``[K, BV]`` start (a state, or a final state's gradient): the program's tile of head
        ``(i_n, i_h)`` of ``[N, H, V, K]`` ``x`` where USE, else zeros."""
        st = gl.zeros([K, BV], gl.float32, ACC_KV)
        if USE:
            st += gl.load(x + (i_n * H + i_h).to(gl.int64) * V * K + p_state)
        return st

    @gluon.jit
    def _chunk_program(pid, chunks, cu, H: gl.constexpr, HK: gl.constexpr):
        """(chunk, value head, its key head, first row, end of its sequence) of program ``pid`` of a grid over
        (chunk, value head): chunk ``pid // H``, value head ``pid % H``."""
        i_c = pid // H
        i_h = pid % H
        i_n = gl.load(chunks + i_c * 2).to(gl.int64)
        t0 = gl.load(chunks + i_c * 2 + 1).to(gl.int64)
        eos = gl.load(cu + i_n + 1).to(gl.int64)
        return i_c, i_h, i_h // (H // HK), t0, eos

    @gluon.jit
    def _store_rows(ptr, x, t0, eos, stride, col0, R: gl.constexpr, BC: gl.constexpr, LD: gl.constexpr):
        """Rows ``t0 + [0, R)`` before ``eos``, columns ``col0 + [0, BC)``, of ``x`` (any layout) into a row-major
        tensor (row stride ``stride``) at ``ptr``, in its dtype."""
        r = gl.arange(0, R, layout=gl.SliceLayout(1, LD))
        c = gl.arange(0, BC, layout=gl.SliceLayout(0, LD))
        gl.store(ptr + t0 * stride + (r[:, None] * stride + (col0 + c)[None, :]),
                 gl.convert_layout(x.to(ptr.dtype.element_ty), LD), mask=(r < eos - t0)[:, None])

    @gluon.jit
    def _rows(x, t0, eos, i_h, H: gl.constexpr, C: gl.constexpr, LAYOUT: gl.constexpr, pad):
        """Column ``i_h`` of ``[TT, H]`` ``x`` at rows ``t0 + [0, C)`` as fp32, in ``LAYOUT``; ``pad`` past ``eos``."""
        r = gl.arange(0, C, layout=LAYOUT)
        return gl.where(r < eos - t0, gl.load(x + (t0 + r) * H + i_h, mask=r < eos - t0, other=0).to(gl.float32), pad)

    @gluon.jit
    def _gates(beta, Gc, t0, eos, i_h, H: gl.constexpr, C: gl.constexpr, HAS_G: gl.constexpr, ROW: gl.constexpr,
               P_ROW: gl.constexpr, P_COL: gl.constexpr, BETA_P: gl.constexpr):
        """A chunk's β by rows and in ``BETA_P`` (P's columns in the forward, Pᵀ's rows in the backward), and (gated)
        G by rows, by P's rows and columns, and at its last row (rows past the sequence take that G, as if their g
        were 0, and β = 0)."""
        beta_r = _rows(beta, t0, eos, i_h, H, C, ROW, 0.0)
        beta_p = _rows(beta, t0, eos, i_h, H, C, BETA_P, 0.0)
        if HAS_G:
            g_last = gl.load(Gc + gl.maximum(gl.minimum(t0 + C, eos) - 1, 0) * H + i_h)  # row 0 for an empty sequence
            G_r = _rows(Gc, t0, eos, i_h, H, C, ROW, g_last)
            G_pr = _rows(Gc, t0, eos, i_h, H, C, P_ROW, g_last)
            G_pc = _rows(Gc, t0, eos, i_h, H, C, P_COL, g_last)
        else:
            g_last = 0.0
            G_r = beta_r
            G_pr = beta_p
            G_pc = beta_p
        return beta_r, beta_p, G_r, G_pr, G_pc, g_last

    @gluon.jit
    def _fwd_walk_out_kernel(
        q, k, beta, Gc, wt, ut, h, vnew, o, s0, sT, cu, coff, scale,
        H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr,
        HAS_G: gl.constexpr, USE_S0: gl.constexpr, STORE_S: gl.constexpr, SAVE: gl.constexpr,
        LD_K: gl.constexpr, LD_V: gl.constexpr, ACC_CV: gl.constexpr, ACC_CC: gl.constexpr, ACC_KV: gl.constexpr,
        ROW: gl.constexpr, P_ROW: gl.constexpr, P_COL: gl.constexpr, P_OP: gl.constexpr, SH_K: gl.constexpr,
        SH_V: gl.constexpr, SH_S: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One program a (dv block, sequence, value head) of grid (V / BV, N, H): see the module docstring. q, k
        ``[TT, HK, K]``, W~ ``[TT, H, K]``, U~ ``[TT, H, V]`` (the 16-bit type DT), β and G (the chunk-local cumulative
        log decay) ``[TT, H]``; writes the chunk start states Sᵀ ``h [NT, H, K, V]`` (DT), U ``vnew [TT, H, V]`` and
        O ``o [TT, H, V]`` (DT), and the final state ``sT [N, H, V, K]`` (fp32) where STORE_S; without SAVE (a forward
        without autograd) neither h nor U."""
        DT: gl.constexpr = q.dtype.element_ty
        f32: gl.constexpr = gl.float32
        scale = scale.to(f32)
        i_v, i_n, i_h, i_k, bos, eos, c0, n_chunks = _walk_program(cu, coff, H, HK, C)
        v0 = i_v * BV

        # x_s: U; xf_s: diag(β D) U
        q_s, k_s, w_s, u_s, s_s, x_s, xf_s = _walk_buffers(DT, C, K, BV, SH_K, SH_V, SH_S)

        # the state in the accumulator's layout (Sᵀ[k, v] at p_state of a [V, K] state); the stores' offsets
        p_state, p_h, p_cv, orow = _walk_offsets(v0, H, K, V, C, BV, ACC_KV, LD_V)
        S = _walk_state(s0, i_n, i_h, p_state, USE_S0, H, K, V, BV, ACC_KV)
        hb = h + (c0 * H + i_h) * K * V

        # chunk 0's copies and gates
        _copy_chunk(q_s.index(0), k_s.index(0), w_s.index(0), u_s.index(0), q, k, wt, ut, bos, eos, i_k, i_h, v0,
                    H, HK, K, V, C, BV, LD_K, LD_V)
        gates = _gates(beta, Gc, bos, eos, i_h, H, C, HAS_G, ROW, P_ROW, P_COL, P_COL)
        for j in range(0, n_chunks):
            buf = j % 2
            t0 = bos + j * C
            t1 = t0 + C
            beta_r, beta_c, G_r, G_pr, G_pc, g_last = gates
            # every warp is past the last chunk's products: their tiles may be overwritten
            _barrier()
            # the next chunk's copies into the other buffer; past the last chunk they copy nothing (t1 >= eos masks
            # every row) and keep one group a chunk. Its gates, into registers
            _copy_chunk(q_s.index(1 - buf), k_s.index(1 - buf), w_s.index(1 - buf), u_s.index(1 - buf), q, k, wt, ut,
                        t1, eos, i_k, i_h, v0, H, HK, K, V, C, BV, LD_K, LD_V)
            gates = _gates(beta, Gc, gl.minimum(t1, eos - 1), eos, i_h, H, C, HAS_G, ROW, P_ROW, P_COL, P_COL)

            # the start state to shared memory, the products' operand
            s_s.store(S.to(DT))
            cp.wait_group(1)  # this chunk's tiles have landed (the next chunk's may still be in flight)
            fence_async_shared()  # each thread's stores and copies ordered before the products' reads...
            _barrier()  # ...and every thread's done

            # W~ Sᵀ, Q Kᵀ and Q Sᵀ from shared memory, together; the start state to h for the backward meanwhile
            wS = warpgroup_mma(w_s.index(buf), s_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False, is_async=True)
            qk = warpgroup_mma(q_s.index(buf), k_s.index(buf).permute((1, 0)), gl.zeros([C, C], f32, ACC_CC),
                               use_acc=False, is_async=True)
            qS = warpgroup_mma(q_s.index(buf), s_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False, is_async=True)
            if SAVE:
                gl.store(hb + j.to(gl.int64) * (H * K * V) + p_h, s_s.load(LD_V))
            wS, qk, qS = warpgroup_mma_wait(0, deps=(wS, qk, qS))

            # U = U~ - W~ Sᵀ; P = tril(E ⊙ Q Kᵀ) diag(β) scale
            X = u_s.index(buf).load(ACC_CV).to(f32) - wS
            x_s.store(X.to(DT))
            if HAS_G:
                f = beta_r * gl.exp(g_last - G_r)
                keep = (gl.arange(0, C, layout=P_ROW)[:, None] >= gl.arange(0, C, layout=P_COL)[None, :])
                P = gl.where(keep, qk * gl.exp(gl.where(keep, G_pr[:, None] - G_pc[None, :], 0.0)), 0.0)
                qS = qS * (gl.exp(G_r) * scale)[:, None]
                S = S * gl.exp(g_last)
            else:
                f = beta_r
                P = gl.where(gl.arange(0, C, layout=P_ROW)[:, None] >= gl.arange(0, C, layout=P_COL)[None, :], qk, 0.0)
                qS = qS * scale
            xf_s.store((X * f[:, None]).to(DT))
            P16 = gl.convert_layout((P * (beta_c * scale)[None, :]).to(DT), P_OP)
            fence_async_shared()
            _barrier()  # U and diag(β D) U whole in shared memory (each warp wrote part of them)

            # O = diag(γ) scale Q Sᵀ + P U and the state update, together; U to vnew for the backward meanwhile
            out = warpgroup_mma(P16, x_s, qS, is_async=True)
            S = warpgroup_mma(k_s.index(buf).permute((1, 0)), xf_s, S, is_async=True)
            rows_ok = (orow < eos - t0)[:, None]
            if SAVE:
                gl.store(vnew + t0 * (H * V) + i_h * V + p_cv, x_s.load(LD_V), mask=rows_ok)
            out, S = warpgroup_mma_wait(0, deps=(out, S))
            gl.store(o + t0 * (H * V) + i_h * V + p_cv, gl.convert_layout(out.to(DT), LD_V), mask=rows_ok)
        cp.wait_group(0)
        if STORE_S:
            gl.store(sT + (i_n * H + i_h).to(gl.int64) * V * K + p_state, S)

    @gluon.jit
    def _bwd_walk_kernel(
        q, k, beta, Gc, wt, do, du, dh, dsT, ds0, cu, coff, scale,
        H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr,
        HAS_G: gl.constexpr, USE_DST: gl.constexpr, STORE_DS0: gl.constexpr,
        LD_K: gl.constexpr, LD_V: gl.constexpr, ACC_CV: gl.constexpr, ACC_CC: gl.constexpr, ACC_KV: gl.constexpr,
        ROW: gl.constexpr, P_ROW: gl.constexpr, P_COL: gl.constexpr, P_OP: gl.constexpr, SH_K: gl.constexpr,
        SH_V: gl.constexpr, SH_S: gl.constexpr, num_warps: gl.constexpr,
    ):
        """The backward's reverse state walk, one program a (dv block, sequence, value head) of grid (V / BV, N, H):
        per chunk, last to first, with dSᵀ ``[K, BV]`` (the gradient of the chunk's end state) in fp32 registers,

            dh  = dSᵀ                                          (stored for ``_bwd_dqkw``)
            dU  = diag(β scale) Pᵀ dO + diag(β D) K dSᵀ,   Pᵀ = triu(Eᵀ ⊙ K Qᵀ)   (stored)
            dSᵀ = γ_C dSᵀ + Qᵀ diag(γ scale) dO - W~ᵀ dU

        as ``lazoo.kernels.delta._bwd_dhu`` with Pᵀ dO formed here; Qᵀ, W~ᵀ and the Pᵀ product's Qᵀ are views of
        the loaded tiles. dsT ``[N, H, V, K]`` (fp32) seeds dS where USE_DST; ds0 ``[N, H, V, K]`` gets the start
        state's gradient where STORE_DS0."""
        DT: gl.constexpr = q.dtype.element_ty
        f32: gl.constexpr = gl.float32
        scale = scale.to(f32)
        i_v, i_n, i_h, i_k, bos, eos, c0, n_chunks = _walk_program(cu, coff, H, HK, C)
        v0 = i_v * BV

        # ds_s: dSᵀ; dof_s: diag(γ scale) dO; ndu_s: -dU
        q_s, k_s, w_s, do_s, ds_s, dof_s, ndu_s = _walk_buffers(DT, C, K, BV, SH_K, SH_V, SH_S)

        p_state, p_h, p_cv, orow = _walk_offsets(v0, H, K, V, C, BV, ACC_KV, LD_V)
        dS = _walk_state(dsT, i_n, i_h, p_state, USE_DST, H, K, V, BV, ACC_KV)
        dhb = dh + (c0 * H + i_h) * K * V

        # the last chunk's copies and gates (a sequence of no chunk copies nothing: its end is its start)
        t_last = bos + gl.maximum(n_chunks - 1, 0) * C
        _copy_chunk(q_s.index(0), k_s.index(0), w_s.index(0), do_s.index(0), q, k, wt, do, t_last, eos, i_k, i_h, v0,
                    H, HK, K, V, C, BV, LD_K, LD_V)
        gates = _gates(beta, Gc, t_last, eos, i_h, H, C, HAS_G, ROW, P_ROW, P_COL, P_ROW)
        for jj in range(0, n_chunks):
            j = n_chunks - 1 - jj
            buf = jj % 2
            t0 = bos + j * C
            beta_r, beta_pr, G_r, G_pr, G_pc, g_last = gates
            _barrier()  # every warp is past the last chunk's products
            # the previous chunk's copies into the other buffer (none before the first: its end masks every row)
            tp = gl.maximum(t0 - C, bos)
            endp = gl.where(j > 0, eos, tp)
            _copy_chunk(q_s.index(1 - buf), k_s.index(1 - buf), w_s.index(1 - buf), do_s.index(1 - buf), q, k, wt, do,
                        tp, endp, i_k, i_h, v0, H, HK, K, V, C, BV, LD_K, LD_V)
            gates = _gates(beta, Gc, tp, eos, i_h, H, C, HAS_G, ROW, P_ROW, P_COL, P_ROW)

            ds_s.store(dS.to(DT))
            cp.wait_group(1)
            fence_async_shared()
            _barrier()

            # K dSᵀ and Pᵀ = K Qᵀ together; dSᵀ to dh meanwhile
            kdS = warpgroup_mma(k_s.index(buf), ds_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False, is_async=True)
            pt = warpgroup_mma(k_s.index(buf), q_s.index(buf).permute((1, 0)), gl.zeros([C, C], f32, ACC_CC),
                               use_acc=False, is_async=True)
            gl.store(dhb + j.to(gl.int64) * (H * K * V) + p_h, ds_s.load(LD_V))
            kdS, pt = warpgroup_mma_wait(0, deps=(kdS, pt))

            keep = gl.arange(0, C, layout=P_ROW)[:, None] <= gl.arange(0, C, layout=P_COL)[None, :]
            if HAS_G:
                f = beta_r * gl.exp(g_last - G_r)
                fq = gl.exp(G_r) * scale
                pt = gl.where(keep, pt * gl.exp(gl.where(keep, G_pc[None, :] - G_pr[:, None], 0.0)), 0.0)
            else:
                f = beta_r
                fq = gl.full([C], 1.0, f32, ROW) * scale
                pt = gl.where(keep, pt, 0.0)
            pt16 = gl.convert_layout((pt * (beta_pr * scale)[:, None]).to(DT), P_OP)
            dof_s.store((do_s.index(buf).load(ACC_CV).to(f32) * fq[:, None]).to(DT))
            dU = warpgroup_mma(pt16, do_s.index(buf), kdS * f[:, None])
            ndu_s.store((-dU).to(DT))
            rows_ok = (orow < eos - t0)[:, None]
            gl.store(du + t0 * (H * V) + i_h * V + p_cv, gl.convert_layout(dU.to(DT), LD_V), mask=rows_ok)
            fence_async_shared()
            _barrier()  # diag(γ scale) dO and -dU whole in shared memory

            if HAS_G:
                dS = dS * gl.exp(g_last)
            dS = warpgroup_mma(q_s.index(buf).permute((1, 0)), dof_s, dS, is_async=True)
            dS = warpgroup_mma(w_s.index(buf).permute((1, 0)), ndu_s, dS, is_async=True)
            dS = warpgroup_mma_wait(0, deps=(dS,))
        cp.wait_group(0)
        if STORE_DS0:
            gl.store(ds0 + (i_n * H + i_h).to(gl.int64) * V * K + p_state, dS)


@functools.cache
def walk_layouts(K: int, BV: int, dtype: torch.dtype) -> dict:
    """The walks' layouts (constexpr arguments of both kernels): ``LD_K`` / ``LD_V`` for ``[C, K]`` and ``[C, BV]``
    (or ``[K, BV]``) tiles to and from memory, the accumulators' ``ACC_CV`` (``[C, BV]``), ``ACC_CC`` (``[C, C]``)
    and ``ACC_KV`` (``[K, BV]``: the state), per-row vectors of the first (``ROW``) and the second (``P_ROW``,
    ``P_COL``), the ``[C, C]`` product as a register operand (``P_OP``), and the shared tiles' ``SH_K``, ``SH_V`` and
    ``SH_S``."""
    DT = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    w = WALK_WARPS
    acc_cv, acc_cc = _mma_layout(CHUNK, BV, w), _mma_layout(CHUNK, CHUNK, w)
    return dict(LD_K=_load_layout(K, w), LD_V=_load_layout(BV, w), ACC_CV=acc_cv, ACC_CC=acc_cc,
                ACC_KV=_mma_layout(K, BV, w), ROW=gl.SliceLayout(1, acc_cv), P_ROW=gl.SliceLayout(1, acc_cc),
                P_COL=gl.SliceLayout(0, acc_cc), P_OP=gl.DotOperandLayout(operand_index=0, parent=acc_cv, k_width=2),
                SH_K=gl.NVMMASharedLayout.get_default_for([CHUNK, K], DT),
                SH_V=gl.NVMMASharedLayout.get_default_for([CHUNK, BV], DT),
                SH_S=gl.NVMMASharedLayout.get_default_for([K, BV], DT))


def fwd_walk(q, k, beta, Gc, wt, ut, S0, sT, seqs, scale: float, output_final_state: bool, save: bool = True,
             BV: int = WALK_BV):
    """``(h, vnew, o)`` of the forward from ``_fwd_solve``'s G and ``_fwd_wu``'s W~ and U~ (flattened ``[TT, heads, d]``
    inputs as ``lazoo.kernels.delta.chunk_fwd`` holds them), in dv blocks of ``BV`` (``walk_block``); the final state
    goes to ``sT`` where ``output_final_state``. ``Gc`` None for the ungated rule. Without ``save`` h and vnew are None
    (not computed)."""
    TT, HK, K = q.shape
    H, V = ut.shape[1:]
    h = torch.empty(seqs.NT, H, K, V, device=q.device, dtype=q.dtype) if save else ut
    vnew = torch.empty(TT, H, V, device=q.device, dtype=q.dtype) if save else ut
    o = torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
    has_g = Gc is not None
    _fwd_walk_out_kernel[(triton.cdiv(V, BV), seqs.N, H)](
        q, k, beta, Gc if has_g else beta, wt, ut, h, vnew, o, S0 if S0 is not None else sT, sT, seqs.cu, seqs.coff,
        scale, H=H, HK=HK, K=K, V=V, C=CHUNK, BV=BV, HAS_G=has_g, USE_S0=S0 is not None,
        STORE_S=output_final_state, SAVE=save, **walk_layouts(K, BV, q.dtype), num_warps=WALK_WARPS)
    return (h, vnew, o) if save else (None, None, o)


def bwd_walk(q, k, beta, Gc, wt, do, dsT, seqs, scale: float, need_ds0: bool, BV: int = WALK_BV):
    """``(du, dh, ds0 or None)`` of the backward's reverse walk (``_bwd_walk_kernel``) on ``chunk_bwd``'s flattened
    inputs, in dv blocks of ``BV`` (``walk_block``); ``Gc`` None for the ungated rule, ``dsT`` None for no final-state
    gradient."""
    TT, HK, K = q.shape
    H, V = do.shape[1:]
    du = torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
    dh = torch.empty(seqs.NT, H, K, V, device=q.device, dtype=q.dtype)
    ds0 = torch.empty(seqs.N, H, V, K, device=q.device, dtype=torch.float32) if need_ds0 else None
    has_g = Gc is not None
    _bwd_walk_kernel[(triton.cdiv(V, BV), seqs.N, H)](
        q, k, beta, Gc if has_g else beta, wt, do, du, dh, dsT if dsT is not None else dh,
        ds0 if need_ds0 else dh, seqs.cu, seqs.coff, scale, H=H, HK=HK, K=K, V=V, C=CHUNK, BV=BV, HAS_G=has_g,
        USE_DST=dsT is not None, STORE_DS0=need_ds0, **walk_layouts(K, BV, q.dtype), num_warps=WALK_WARPS)
    return du, dh, ds0
