"""The (gated) delta rule's per-chunk solve as one Hopper kernel (Triton's Gluon dialect).

For each chunk and value head it forms what ``lazoo.kernels.delta._fwd_solve`` forms: G, the within-chunk cumulative
sum of the log decays g, and A = (I + L)⁻¹ with L = strict_tril(E ⊙ K Kᵀ) diag(β), E_ij = exp(G_i - G_j). The Triton
kernel does it in one warp, whose registers then hold all of the chunk's keys and L's blocks (187 a thread on Hopper),
so few programs share a multiprocessor. Here one warpgroup does it:

- K's rows arrive by ``cp.async`` and K Kᵀ is one warpgroup product (16-bit operands, fp32 accumulator);
- the four 16 × 16 diagonal blocks of I + L are inverted side by side by forward substitution, each thread holding
  one column of one block in its registers and reading each row of L from shared memory, so a step is a row's
  products inside the thread;
- the blocks merge in two rounds, D - D (L₁ D) over 16-row blocks and then over 32-row ones (D the inverse so far,
  L₁ the blocks just below its diagonal ones), each two 64 × 64 tf32 warpgroup products (the Triton kernel merges in
  tf32 too).

It is exact to the Triton kernel's accuracy but slower (``USE_GLUON_SOLVE``'s comment has the times), so it runs only
where asked for: one chunk a program still leaves the loads' latency open, and the merges' operands go through shared
memory four times. Rows past a sequence's end load as zero keys with β = 0, so they reach no real row, and are not
stored. Runs only on Hopper GPUs with 16-bit inputs (no interpreter); the Triton kernel stays the reference
(``tests/kernels/test_kernels_delta.py``). A warpgroup a chunk with the diagonal inverses side by side, merged by
products, is how FlashQLA's kkt solve (the Qwen team's TileLang kernels, ``docs/references.md``) works.
"""
from __future__ import annotations

import functools

import torch

from . import delta_gluon as gw

SOLVE_ERROR = gw.GLUON_ERROR
if SOLVE_ERROR is None:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
        _barrier = gw._barrier
    except Exception as e:  # noqa: BLE001 - an older or reorganised Triton
        SOLVE_ERROR = f"{type(e).__name__}: {e}"

CHUNK = gw.CHUNK
WARPS = 4  # one warpgroup
BLOCK = 16  # the diagonal blocks inverted by substitution


def supported(q: torch.Tensor, K: int, V: int, C: int, given_write_keys: bool) -> str | None:
    """None where the kernel runs these inputs, else why not."""
    if SOLVE_ERROR is not None:
        return f"Triton's Gluon dialect lacks what the solve needs ({SOLVE_ERROR})"
    return gw.walk_supported(q, K, V, C, given_write_keys)


if SOLVE_ERROR is None:

    @gluon.jit
    def _merge(D, L1, a_op, b_op, ACC_T: gl.constexpr):
        """D - D (L1 D) by two tf32 warpgroup products, their operands through ``a_op`` and ``b_op`` (fp32 operands
        are read K-major only: the right-hand one goes in transposed)."""
        C: gl.constexpr = D.shape[0]
        _barrier()  # every warp is done with the last products' operands
        a_op.store(L1)
        b_op.store(gl.permute(D, [1, 0]))
        fence_async_shared()
        _barrier()
        P = warpgroup_mma(a_op, b_op.permute((1, 0)), gl.zeros([C, C], gl.float32, ACC_T), use_acc=False)
        _barrier()
        a_op.store(D)
        b_op.store(gl.permute(P, [1, 0]))
        fence_async_shared()
        _barrier()
        return D - warpgroup_mma(a_op, b_op.permute((1, 0)), gl.zeros([C, C], gl.float32, ACC_T), use_acc=False)

    @gluon.jit
    def _solve_kernel(k, beta, g, Gc, A, chunks, cu,
                      H: gl.constexpr, HK: gl.constexpr, K: gl.constexpr, C: gl.constexpr, HAS_G: gl.constexpr,
                      LD_K: gl.constexpr, LD_C: gl.constexpr, ACC: gl.constexpr, ACC_T: gl.constexpr,
                      COL3: gl.constexpr, ROW3: gl.constexpr, BLK3: gl.constexpr, SH_K: gl.constexpr,
                      SH_OP: gl.constexpr, SH_2: gl.constexpr, SH_3: gl.constexpr, num_warps: gl.constexpr):
        """One program a (chunk, value head): chunk ``pid // H``, value head ``pid % H``; see the module docstring."""
        _, i_h, i_k, t0, eos = gw._chunk_program(gl.program_id(0), chunks, cu, H, HK)
        n_ok = (eos - t0).to(gl.int32)
        DT: gl.constexpr = k.dtype.element_ty
        f32: gl.constexpr = gl.float32
        NB: gl.constexpr = C // 16

        k_s = gl.allocate_shared_memory(DT, [C, K], SH_K)
        gw._copy_rows(k_s, k, t0, eos, HK * K, i_k * K, C, K, LD_K)
        cp.commit_group()

        # β by columns; G = the within-chunk cumulative sum of g (rows past the end add nothing)
        P_ROW: gl.constexpr = gl.SliceLayout(1, ACC)
        P_COL: gl.constexpr = gl.SliceLayout(0, ACC)
        pr = gl.arange(0, C, layout=P_ROW)
        pc = gl.arange(0, C, layout=P_COL)
        beta_c = gw._rows(beta, t0, eos, i_h, H, C, P_COL, 0.0)
        strict = pr[:, None] > pc[None, :]
        if HAS_G:
            g_c = gw._rows(g, t0, eos, i_h, H, C, P_COL, 0.0)
            G_r = gl.sum(gl.where(pc[None, :] <= pr[:, None], g_c[None, :], 0.0), 1)
            gl.store(Gc + (t0 + pr) * H + i_h, G_r, mask=pr < n_ok)
            G_c = gl.convert_layout(G_r, P_COL)
            E = gl.exp(gl.where(strict, G_r[:, None] - G_c[None, :], 0.0))

        cp.wait_group(0)
        fence_async_shared()
        _barrier()
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([C, C], f32, ACC), use_acc=False)
        if HAS_G:
            kk = kk * E
        L = gl.where(strict, kk * beta_c[None, :], 0.0)

        # L's diagonal blocks: d_s[b, r, t] = L[16 b + r, 16 b + t]
        l_s = gl.allocate_shared_memory(f32, [C, C], SH_2)
        d_s = gl.allocate_shared_memory(f32, [NB, 16, 16], SH_3)
        l_s.store(L)
        _barrier()
        for b in gl.static_range(NB):
            blk = l_s.slice(16 * b, 16, dim=0).slice(16 * b, 16, dim=1).load(gl.SliceLayout(0, BLK3))
            d_s.slice(b, 1, dim=0).store(gl.expand_dims(blk, 0))
        _barrier()

        # forward substitution in all blocks at once: X[b, r, t] (the inverse's strictly lower part; a thread holds
        # column t of block b) starts as -L; row s becomes -L[s, t] - Σ_{r<s} L[s, r] X[r, t] (L[s, r] = 0 for r >= s)
        X = -d_s.load(COL3)
        R2: gl.constexpr = gl.SliceLayout(2, COL3)
        rsel = gl.arange(0, 16, layout=gl.SliceLayout(0, R2))[None, :, None]
        for s in gl.static_range(2, 16):
            row = gl.convert_layout(gl.sum(d_s.slice(s, 1, dim=1).load(ROW3), 1), R2)  # L[b, s, :], no data moved
            X = gl.where(rsel == s, X - gl.sum(row[:, :, None] * X, 1)[:, None, :], X)
        _barrier()  # every warp has read L's rows: d_s takes the inverted blocks
        d_s.store(X)
        _barrier()

        # D = the block-diagonal inverse (ones on the diagonal), as a [C, C] tile
        l_s.store(gl.zeros([C, C], f32, ACC))
        _barrier()
        for b in gl.static_range(NB):
            blk = gl.sum(d_s.slice(b, 1, dim=0).load(BLK3), 0)
            l_s.slice(16 * b, 16, dim=0).slice(16 * b, 16, dim=1).store(blk)
        _barrier()
        tr = gl.arange(0, C, layout=gl.SliceLayout(1, ACC_T))
        tc = gl.arange(0, C, layout=gl.SliceLayout(0, ACC_T))
        D = l_s.load(ACC_T) + gl.where(tr[:, None] == tc[None, :], 1.0, 0.0)

        # merge: over 16-row blocks (L's blocks (1, 0), (3, 2)), then over 32-row ones (rows 32.., columns ..32)
        a_op = gl.allocate_shared_memory(f32, [C, C], SH_OP)
        b_op = gl.allocate_shared_memory(f32, [C, C], SH_OP)
        Lt = gl.convert_layout(L, ACC_T)  # the same registers: only the instruction's k differs
        bi = (tr // 16)[:, None]
        bj = (tc // 16)[None, :]
        D = _merge(D, gl.where((bi == bj + 1) & (bi % 2 == 1), Lt, 0.0), a_op, b_op, ACC_T)
        if NB >= 4:
            D = _merge(D, gl.where((bi >= 2) & (bj < 2), Lt, 0.0), a_op, b_op, ACC_T)

        gw._store_rows(A, D, t0, eos, H * C, i_h * C, C, C, LD_C)


@functools.cache
def layouts(K: int, dtype: torch.dtype) -> dict:
    """The kernel's layouts (constexpr arguments): the key rows' and A's tiles to and from memory, the accumulators of
    K Kᵀ (16-bit operands) and of the merges (tf32), the substitution's [block, row, column] tiles (a column of a block
    a thread) and the shared tiles'."""
    DT = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    acc = gw._mma_layout(CHUNK, CHUNK, WARPS)
    plain = [1, 1, 1]
    return dict(LD_K=gw._load_layout(K, WARPS), LD_C=gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0]),
                ACC=acc, ACC_T=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=acc.warps_per_cta,
                                                         instr_shape=acc.instr_shape[:2] + [8]),
                COL3=gl.BlockedLayout([1, BLOCK, 1], [1, 1, 32], [WARPS, 1, 1], [2, 1, 0]),
                ROW3=gl.BlockedLayout([1, 1, BLOCK], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0]),
                BLK3=gl.BlockedLayout([1, 1, 2], [1, 4, 8], [1, WARPS, 1], [2, 1, 0]),
                SH_K=gl.NVMMASharedLayout.get_default_for([CHUNK, K], DT),
                SH_OP=gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], gl.float32),
                SH_2=gl.SwizzledSharedLayout(*plain, order=[1, 0]),
                SH_3=gl.SwizzledSharedLayout(*plain, order=[2, 1, 0]))


def solve(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, seqs, H: int, a_dtype: torch.dtype):
    """``(G, A)`` of every chunk on ``lazoo.kernels.delta.fwd_solve``'s flattened inputs: G ``[TT, H]`` fp32 (None
    without g), A ``[TT, H, CHUNK]`` in ``a_dtype``."""
    TT, HK, K = k.shape
    has_g = g is not None
    Gc = torch.empty(TT, H, device=k.device, dtype=torch.float32) if has_g else None
    A = torch.empty(TT, H, CHUNK, device=k.device, dtype=a_dtype)
    _solve_kernel[(seqs.NT * H,)](
        k, beta, g if has_g else beta, Gc if has_g else beta, A, seqs.chunks, seqs.cu,
        H=H, HK=HK, K=K, C=CHUNK, HAS_G=has_g, **layouts(K, k.dtype), num_warps=WARPS)
    return Gc, A
