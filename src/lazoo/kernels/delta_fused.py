"""The (gated) delta rule's chunked forward as one warp-specialised Hopper kernel (Triton's Gluon dialect).

After ``_fwd_solve`` (G and A = (I + L)⁻¹ per chunk, with the decay and β inside), one program a (dv block, sequence,
value head) walks the sequence's chunks, with Sᵀ ``[dk, BV]`` in fp32 registers, in three partitions that hand
tiles to each other through shared memory and mbarriers:

- the loader (one warp): each chunk's q, k, v block and A by TMA into two buffers, a chunk ahead;
- the state (four warps, the chain): X = V - Γ K Sᵀ, U = A X, Sᵀ' = γ_C Sᵀ + Kᵀ diag(β D) U, handing Sᵀ and U
  through shared memory to
- the outputs (four warps): P = tril(E ⊙ Q Kᵀ) diag(β) (formed before the state arrives), then
  O = scale (diag(γ) Q Sᵀ + P U); for training also each chunk's start state (``h``) and U (``vnew``), what
  ``lazoo.kernels.delta.chunk_bwd`` reads.

The chain holds three products a chunk (K Sᵀ, A X, Kᵀ U) and never waits for the outputs' three, which the output
partition forms beside it; no W~, U~, M or Y passes through memory (training still takes W~ from ``_fwd_wu``, for the
backward). U = A X takes A and X in fp32 (tf32 products; Hopper reads tf32 operands K-major only, so X goes to shared
memory as Xᵀ); the other products 16-bit operands. A whole head of 128 a program where the (sequence, value head)
pairs fill the GPU (``block``), else halves. The split into a loader, a state and an output partition follows
FlashQLA's fused forward (the Qwen team's TileLang kernels, ``docs/references.md``); the products are the rule's X
form (``lazoo.kernels.delta``'s docstring).

Rows past a sequence's end inside its last chunk are those of the next sequence (or TMA's zeros past the tensor):
β = 0 there and X, U are set to zero on those rows, so they reach neither the state nor a real row's output.
Runs only on Hopper GPUs (no interpreter); ``lazoo.kernels.delta`` takes it where ``supported`` holds and
``USE_FUSED_PREFILL`` / ``USE_FUSED_TRAINING`` let it; its Triton kernels stay the reference
(``tests/kernels/test_kernels_delta.py``).
"""

from __future__ import annotations

import functools

import torch
import triton

from . import delta_gluon as dg
from ._utils import num_sms

FUSED_ERROR = dg.GLUON_ERROR
if FUSED_ERROR is None:
    try:  # Hopper's TMA, mbarriers and warp specialisation in Gluon: their absence only removes this kernel
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language._core import shared_memory_descriptor
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        _barrier = dg._barrier
        # a shared tile viewed as another: ``reinterpret`` from Triton 3.7 on, ``_reinterpret`` before
        _PUBLIC_REINTERPRET = gl.constexpr(hasattr(shared_memory_descriptor, "reinterpret"))
        # TMA's global-to-shared copy: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    except Exception as e:  # noqa: BLE001 - an older or reorganised Triton
        FUSED_ERROR = f"{type(e).__name__}: {e}"

CHUNK = dg.CHUNK

#: warps of the state and the output partitions (one warpgroup each; the loader has one warp, the kernel's
#: ``gl.warp_specialize`` call says so, as a Gluon kernel reads no plain global); the output partition's registers
#: (the state partition takes what the kernel's limit leaves)
PART_WARPS = 4
OUT_REGS = 152
#: the output partition's registers where it also stores the chunk states and pseudo-values (H200, bf16, fwd + bwd
#: against 152: T = 1k B = 32 2.71 -> 2.58 ms, 8k B = 4 with HV = 2H 5.40 -> 5.06)
OUT_REGS_SAVE = 200
LOAD_REGS = 24
MAX_REGS = 168
#: the dv block (None: ``block``)
DV_BLOCK: int | None = None
#: U = A X with fp32 A and X (tf32 products) rather than 16-bit ones
AX_TF32 = True


def a_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype ``_fwd_solve`` writes A in for this kernel."""
    return torch.float32 if AX_TF32 else q.dtype


#: 128-wide dv blocks (a whole head of 128 a program) once the (sequence, value head) pairs number this many a
#: multiprocessor, else 64-wide ones for twice the programs. H200, bf16, gated, the kernel's time (torch.profiler) in
#: 64-wide blocks (tf32 A X) against 128-wide ones (16-bit A X): T = 1k B = 32 (512 pairs) 0.356 -> 0.243 ms, 8k B = 4
#: with HV = 2H (128 pairs) 0.720 -> 0.461, but 8k B = 4 (64 pairs) 0.353 -> 0.441
WIDE_PAIRS_PER_SM = 0.75


def block(V: int, pairs: int, device) -> int:
    """The dv block for ``pairs`` (sequence, value head) pairs: 128 where dv allows and the pairs fill the GPU
    (``WIDE_PAIRS_PER_SM``), else 64 (``supported`` asks dv to be a multiple of 64)."""
    if V % 128 == 0 and pairs >= WIDE_PAIRS_PER_SM * num_sms(device):
        return 128
    return 64


def supported(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> str | None:
    """None where the fused forward runs these inputs, else why not."""
    if FUSED_ERROR is not None:
        return f"Triton's Gluon dialect lacks what the fused forward needs ({FUSED_ERROR})"
    why = dg.walk_supported(q, K, V, C, given_write_keys)
    if why is None and (K != 128 or V % 64):
        why = f"needs dk = 128 and dv a multiple of 64 (got {K}, {V})"
    return why


if FUSED_ERROR is None:

    # the partitions' layouts, computed inside them from their constexpr shapes
    @gluon.constexpr_function
    def _shared_layout(rows, cols, dtype):
        """The NVMMA shared layout of a ``[rows, cols]`` tile."""
        return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)

    @gluon.constexpr_function
    def _acc(rows, cols, k=16):
        """A 4-warp partition's accumulator layout of a ``[rows, cols]`` product (of ``k``-deep instructions: 16 for
        16-bit operands, 8 for tf32)."""
        layout = dg._mma_layout(rows, cols, 4)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=layout.warps_per_cta,
                                         instr_shape=layout.instr_shape[:2] + [k])

    @gluon.constexpr_function
    def _rows_layout(cols):
        """A 4-warp partition's layout of ``[C, cols]`` tiles to and from memory."""
        return dg._load_layout(cols, 4)

    @gluon.jit
    def _loader(bufs, bars, descs, o, h, vnew, beta, Gc, scale, bos, eos, n_chunks, c0, i_h, i_k, v0,
                H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
                BV: gl.constexpr, HAS_G: gl.constexpr, SAVE: gl.constexpr):
        """Each chunk's q, k, v block and A into buffer j % 2, once both partitions have freed it. (The worker
        partitions take one argument list, so this one receives the output partition's too.)"""
        q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s = bufs
        ready, free, s_ready, s_free, u_ready, u_free = bars
        q_d, k_d, v_d, a_d = descs
        nbytes: gl.constexpr = (2 * C * K + C * BV) * 2 + C * C * a_d.dtype.primitive_bitwidth // 8
        for j in range(n_chunks):
            b = j % 2
            mbarrier.wait(free.index(b), ((j // 2) & 1) ^ 1)
            t0 = (bos + j * C).to(gl.int32)
            mbarrier.expect(ready.index(b), nbytes)
            _tma_load(q_d, [t0, i_k * K], ready.index(b), q_s.index(b))
            _tma_load(k_d, [t0, i_k * K], ready.index(b), k_s.index(b))
            _tma_load(v_d, [t0, i_h * V + v0], ready.index(b), v_s.index(b))
            _tma_load(a_d, [t0, i_h * C], ready.index(b), a_s.index(b))

    @gluon.jit
    def _outputs(bufs, bars, descs, o, h, vnew, beta, Gc, scale, bos, eos, n_chunks, c0, i_h, i_k, v0,
                 H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
                 BV: gl.constexpr, HAS_G: gl.constexpr, SAVE: gl.constexpr):
        """Per chunk P = tril(E ⊙ Q Kᵀ) diag(β scale) from the loaded tiles, then O = diag(γ) scale Q Sᵀ + P U as the
        state partition hands over Sᵀ and U; where SAVE, Sᵀ to ``h`` and U to ``vnew`` for the backward."""
        q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s = bufs
        ready, free, s_ready, s_free, u_ready, u_free = bars
        q_d, k_d, v_d, a_d = descs
        LD_V: gl.constexpr = _rows_layout(BV)
        ACC_CV: gl.constexpr = _acc(C, BV)
        ACC_CC: gl.constexpr = _acc(C, C)
        ROW: gl.constexpr = gl.SliceLayout(1, ACC_CV)
        P_ROW: gl.constexpr = gl.SliceLayout(1, ACC_CC)
        P_COL: gl.constexpr = gl.SliceLayout(0, ACC_CC)
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_CV, k_width=2)
        DT: gl.constexpr = q_d.dtype
        f32: gl.constexpr = gl.float32
        scale = scale.to(f32)
        orow = gl.arange(0, C, layout=gl.SliceLayout(1, LD_V))
        ocol = gl.arange(0, BV, layout=gl.SliceLayout(0, LD_V))
        p_cv = orow[:, None] * (H * V) + (v0 + ocol)[None, :]
        srow = gl.arange(0, 32, layout=gl.SliceLayout(1, LD_V))
        p_h = srow[:, None] * V + (v0 + ocol)[None, :]  # 32 rows of the program's [K, BV] tile of a state [K, V]
        for j in range(n_chunks):
            b = j % 2
            t0 = bos + j * C
            beta_r, beta_c, G_r, G_pr, G_pc, g_last = dg._gates(beta, Gc, t0, eos, i_h, H, C, HAS_G, ROW, P_ROW,
                                                                 P_COL, P_COL)
            mbarrier.wait(ready.index(b), (j // 2) & 1)
            qk = warpgroup_mma(q_s.index(b), k_s.index(b).permute((1, 0)), gl.zeros([C, C], f32, ACC_CC),
                               use_acc=False)
            keep = gl.arange(0, C, layout=P_ROW)[:, None] >= gl.arange(0, C, layout=P_COL)[None, :]
            if HAS_G:
                P = gl.where(keep, qk * gl.exp(gl.where(keep, G_pr[:, None] - G_pc[None, :], 0.0)), 0.0)
                fq = gl.exp(G_r) * scale
            else:
                P = gl.where(keep, qk, 0.0)
                fq = gl.full([C], 1.0, f32, ROW) * scale
            P16 = gl.convert_layout((P * (beta_c * scale)[None, :]).to(DT), P_OP)

            mbarrier.wait(s_ready, j & 1)
            out = warpgroup_mma(q_s.index(b), s_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False)
            if SAVE:  # in slices of 32 rows, which the partition's registers hold beside its accumulators
                hj = h + ((c0 + j) * H + i_h) * (K * V)
                for r in gl.static_range(0, K, 32):
                    gl.store(hj + r * V + p_h, s_s.slice(r, 32, dim=0).load(LD_V))
            mbarrier.arrive(s_free, count=1)
            mbarrier.arrive(free.index(b), count=1)  # q and k read (the state partition frees the buffer too)
            out = out * fq[:, None]

            mbarrier.wait(u_ready, j & 1)
            out = warpgroup_mma(P16, u_s, out)
            rows_ok = (orow < eos - t0)[:, None]
            if SAVE:
                gl.store(vnew + t0 * (H * V) + i_h * V + p_cv, u_s.load(LD_V), mask=rows_ok)
            mbarrier.arrive(u_free, count=1)
            gl.store(o + t0 * (H * V) + i_h * V + p_cv, gl.convert_layout(out.to(DT), LD_V), mask=rows_ok)

    @gluon.jit
    def _state(bufs, bars, s0, sT, beta, Gc, bos, eos, n_chunks, i_n, i_h, v0,
               H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BV: gl.constexpr,
               HAS_G: gl.constexpr, USE_S0: gl.constexpr, STORE_S: gl.constexpr, AX_TF32: gl.constexpr):
        """The chain: per chunk X = V - Γ K Sᵀ, U = A X, Sᵀ' = γ_C Sᵀ + Kᵀ diag(β D) U, handing Sᵀ (start) and U to
        the output partition; the final state to ``sT`` where STORE_S."""
        q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s = bufs
        ready, free, s_ready, s_free, u_ready, u_free = bars
        ACC_CV: gl.constexpr = _acc(C, BV)
        ACC_CC: gl.constexpr = _acc(C, C)
        ACC_KV: gl.constexpr = _acc(K, BV)
        ROW: gl.constexpr = gl.SliceLayout(1, ACC_CV)
        P_ROW: gl.constexpr = gl.SliceLayout(1, ACC_CC)
        P_COL: gl.constexpr = gl.SliceLayout(0, ACC_CC)
        DT: gl.constexpr = q_s.dtype
        f32: gl.constexpr = gl.float32
        kr = gl.arange(0, K, layout=gl.SliceLayout(1, ACC_KV))
        kc = gl.arange(0, BV, layout=gl.SliceLayout(0, ACC_KV))
        p_state = (v0 + kc)[None, :] * K + kr[:, None]
        S = dg._walk_state(s0, i_n, i_h, p_state, USE_S0, H, K, V, BV, ACC_KV)
        rows = gl.arange(0, C, layout=ROW)
        for j in range(n_chunks):
            b = j % 2
            t0 = bos + j * C
            beta_r, beta_c, G_r, G_pr, G_pc, g_last = dg._gates(beta, Gc, t0, eos, i_h, H, C, HAS_G, ROW,
                                                                 P_ROW, P_COL, P_COL)
            rows_ok = (rows < eos - t0)[:, None]
            mbarrier.wait(ready.index(b), (j // 2) & 1)
            mbarrier.wait(s_free, (j & 1) ^ 1)  # the outputs have read the last chunk's start state
            s_s.store(S.to(DT))
            fence_async_shared()
            _barrier()
            mbarrier.arrive(s_ready, count=1)

            ks = warpgroup_mma(k_s.index(b), s_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False)
            if HAS_G:
                ks = ks * gl.exp(G_r)[:, None]
                f = beta_r * gl.exp(g_last - G_r)
            else:
                f = beta_r
            X = gl.where(rows_ok, v_s.index(b).load(ACC_CV).to(f32) - ks, 0.0)
            if AX_TF32:  # fp32 A and X: tf32 operands, which Hopper takes K-major only (X as Xᵀ)
                x_s.store(gl.permute(X, [1, 0]))
                fence_async_shared()
                _barrier()
                U = warpgroup_mma(a_s.index(b), x_s.permute((1, 0)), gl.zeros([C, BV], f32, _acc(C, BV, 8)),
                                  use_acc=False)
                U = gl.convert_layout(U, ACC_CV)  # the same registers: only the instruction's k differs
            else:
                x_s.store(X.to(DT))
                fence_async_shared()
                _barrier()
                U = warpgroup_mma(a_s.index(b), x_s, gl.zeros([C, BV], f32, ACC_CV), use_acc=False)
            U = gl.where(rows_ok, U, 0.0)

            mbarrier.wait(u_free, (j & 1) ^ 1)  # the outputs are done with the last chunk's U
            u_s.store(U.to(DT))
            uf_s.store((U * f[:, None]).to(DT))
            fence_async_shared()
            _barrier()
            mbarrier.arrive(u_ready, count=1)
            if HAS_G:
                S = S * gl.exp(g_last)
            S = warpgroup_mma(k_s.index(b).permute((1, 0)), uf_s, S)
            mbarrier.arrive(free.index(b), count=1)
        if STORE_S:
            gl.store(sT + (i_n * H + i_h).to(gl.int64) * V * K + p_state, S)

    @gluon.jit
    def _fused_fwd_kernel(q_d, k_d, v_d, a_d, beta, Gc, o, h, vnew, s0, sT, cu, coff, scale,
                          H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
                          BV: gl.constexpr, HAS_G: gl.constexpr, USE_S0: gl.constexpr, STORE_S: gl.constexpr,
                          SAVE: gl.constexpr,
                          OUT_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
        """One program a (dv block, sequence, value head) of grid (V / BV, N, H): see the module docstring."""
        i_v, i_n, i_h, i_k, bos, eos, c0, n_chunks = dg._walk_program(cu, coff, H, HK, C)
        v0 = i_v * BV
        DT: gl.constexpr = q_d.dtype
        q_s = gl.allocate_shared_memory(DT, [2, C, K], q_d.layout)
        k_s = gl.allocate_shared_memory(DT, [2, C, K], k_d.layout)
        v_s = gl.allocate_shared_memory(DT, [2, C, BV], v_d.layout)
        AX_TF32: gl.constexpr = a_d.dtype == gl.float32  # A X in tf32 where A comes in fp32
        a_s = gl.allocate_shared_memory(a_d.dtype, [2, C, C], a_d.layout)
        s_s = gl.allocate_shared_memory(DT, [K, BV], _shared_layout(K, BV, DT))
        if AX_TF32:
            x_s = gl.allocate_shared_memory(gl.float32, [BV, C], _shared_layout(BV, C, gl.float32))
        else:
            x_s = gl.allocate_shared_memory(DT, [C, BV], v_d.layout)
        u_s = gl.allocate_shared_memory(DT, [C, BV], v_d.layout)
        if AX_TF32:  # diag(β D) U in Xᵀ's fp32 tile, dead once U = A X is formed (so 128-wide dv blocks fit)
            if _PUBLIC_REINTERPRET:
                uf_s = x_s.reinterpret(DT, [C, BV], v_d.layout)
            else:
                uf_s = x_s._reinterpret(DT, [C, BV], v_d.layout)
        else:
            uf_s = gl.allocate_shared_memory(DT, [C, BV], v_d.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        s_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        s_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        u_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        u_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)  # the state and the output partitions
        mbarrier.init(s_ready, count=1)
        mbarrier.init(s_free, count=1)
        mbarrier.init(u_ready, count=1)
        mbarrier.init(u_free, count=1)
        # the partitions' arguments as literal tuples: a tuple assigned to a name would turn its constexprs to tensors
        gl.warp_specialize([
            (_state, ((q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s), (ready, free, s_ready, s_free, u_ready, u_free),
                      s0, sT, beta, Gc, bos, eos, n_chunks, i_n, i_h, v0, H, K, V, C, BV, HAS_G, USE_S0, STORE_S,
                      AX_TF32)),
            (_outputs, ((q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s), (ready, free, s_ready, s_free, u_ready, u_free),
                        (q_d, k_d, v_d, a_d), o, h, vnew, beta, Gc, scale, bos, eos, n_chunks, c0, i_h, i_k, v0,
                        H, HK, K, V, C, BV, HAS_G, SAVE)),
            (_loader, ((q_s, k_s, v_s, a_s, s_s, x_s, u_s, uf_s), (ready, free, s_ready, s_free, u_ready, u_free),
                       (q_d, k_d, v_d, a_d), o, h, vnew, beta, Gc, scale, bos, eos, n_chunks, c0, i_h, i_k, v0,
                       H, HK, K, V, C, BV, HAS_G, SAVE)),
        ], [4, 1], [OUT_REGS, LOAD_REGS])


@functools.cache
def _tile_layout(BC: int, dtype: torch.dtype):
    """The shared layout of a ``[CHUNK, BC]`` TMA tile (made once: 7 µs of host time a call otherwise)."""
    DT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([CHUNK, BC], DT)


def _desc(x: torch.Tensor, cols: int, BC: int):
    """A TMA descriptor of ``x`` as ``[rows, cols]`` with ``[CHUNK, BC]`` tiles."""
    return TensorDescriptor.from_tensor(x.reshape(-1, cols), [CHUNK, BC], _tile_layout(BC, x.dtype))


def fused_fwd(q, k, v, beta, Gc, A, S0, sT, seqs, scale: float, output_final_state: bool, save: bool = False,
              BV: int | None = None):
    """``(o, h, vnew)`` of the forward from ``_fwd_solve``'s G and A (A ``[TT, H, C]`` in ``a_dtype``), on flattened
    inputs as ``lazoo.kernels.delta.chunk_fwd`` holds them; the final state to ``sT`` where ``output_final_state``.
    With ``save`` also what the backward reads: each chunk's start state ``h [NT, H, K, V]`` and the pseudo-values
    ``vnew [TT, H, V]`` (else None)."""
    TT, HK, K = q.shape
    H, V = v.shape[1:]
    BV = BV or DV_BLOCK or block(V, seqs.N * H, q.device)
    o = torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
    h = torch.empty(seqs.NT, H, K, V, device=q.device, dtype=q.dtype) if save else o
    vnew = torch.empty(TT, H, V, device=q.device, dtype=q.dtype) if save else o
    has_g = Gc is not None
    _fused_fwd_kernel[(triton.cdiv(V, BV), seqs.N, H)](
        _desc(q, HK * K, K), _desc(k, HK * K, K), _desc(v, H * V, BV), _desc(A, H * CHUNK, CHUNK),
        beta, Gc if has_g else beta, o, h, vnew, S0 if S0 is not None else sT, sT, seqs.cu, seqs.coff, scale,
        H=H, HK=HK, K=K, V=V, C=CHUNK, BV=BV, HAS_G=has_g, USE_S0=S0 is not None, STORE_S=output_final_state,
        SAVE=save, OUT_REGS=OUT_REGS_SAVE if save else OUT_REGS, LOAD_REGS=LOAD_REGS, num_warps=PART_WARPS,
        maxnreg=MAX_REGS)
    return (o, h, vnew) if save else (o, None, None)
