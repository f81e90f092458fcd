"""lazoo.bench.kernel_resources: lazoo's short-convolution kernels and Mamba-2's element-wise kernels compiled for
sm_90 without a GPU fit a Hopper block (shared memory) and do not spill at their launch settings; OVQ's, the gated
and the normalised linear-attention, GLA's and Kimi Delta Attention's kernels compile and fit; an oversized tile is
reported as over the limit, so the check can fail."""

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend")
from lazoo.bench import kernel_resources  # noqa: E402


def _assert_fits_without_spill(report: dict) -> None:
    """Every kernel of ``report`` fits a Hopper block's shared memory, within 255 registers, spilling nothing."""
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        assert r["spill_stores"] == 0, (name, r)


def test_short_conv_kernels_fit_hopper(single_thread):
    report = kernel_resources.short_conv_report()
    assert set(report) == {"forward", "backward", "forward (packed)", "backward (packed)"}
    _assert_fits_without_spill(report)


def test_ssd_io_kernels_fit_hopper(single_thread):
    """Mamba-2's element-wise kernels (dt·x and the D skip, both directions) compile for sm_90 without spilling."""
    report = kernel_resources.ssd_io_report()
    assert len(report) == 4, report
    _assert_fits_without_spill(report)


@pytest.mark.parametrize("rows", [1, 64])
def test_decode_linear_kernels_fit_hopper(single_thread, rows):
    """A decode step's one-launch products (six projections; a SwiGLU's gate and up) compile for sm_90 without
    spilling, at one row and at the most rows they take."""
    report = kernel_resources.decode_linear_report(rows=rows)
    assert len(report) == 2, report
    _assert_fits_without_spill(report)


def test_delta_gluon_kernels_fit_hopper(single_thread):
    """The gated delta rule's state walks in Triton's Gluon dialect compile for sm_90 with this Triton (the forward's
    for training, gated and not, without autograd and in narrow dv blocks; the backward's, gated and not and in narrow
    dv blocks), fit a Hopper block and do not spill."""
    from lazoo.kernels import delta_gluon

    if delta_gluon.GLUON_ERROR is not None:
        pytest.skip(f"this Triton has no Gluon: {delta_gluon.GLUON_ERROR}")
    report = kernel_resources.delta_gluon_report()
    assert set(report) == {"training walk", "training walk, ungated", "walk without autograd",
                           "training walk, dv blocks of 32", "backward walk", "backward walk, ungated",
                           "backward walk, dv blocks of 32"}, report
    _assert_fits_without_spill(report)


def test_delta_fused_forward_fits_hopper(single_thread):
    """The fused forward (three partitions) compiles for sm_90 with this Triton at both dv blocks, without autograd
    gated and not, with A in fp32 (as it runs) and in 16 bits, and for training, and fits a Hopper block (at
    128-wide blocks with 11 KB to spare); ptxas spills a few values at 128-wide blocks (Triton 3.6: 72 bytes, 132 for
    training; 3.9: none, 32), not a tile."""
    from lazoo.kernels import delta_fused

    if delta_fused.FUSED_ERROR is not None:
        pytest.skip(f"this Triton lacks what the fused forward needs: {delta_fused.FUSED_ERROR}")
    report = kernel_resources.delta_fused_report()
    assert len(report) == 6, report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] == delta_fused.MAX_REGS, (name, r)
        assert r["spill_stores"] <= 160, (name, r)


def test_delta_chunk_backward_fits_and_does_not_spill(single_thread):
    """The Gluon chunk backward's shared tiles fit a Hopper block and its registers hold every product at two
    warpgroups (a spill here cost the plain-Triton fused form of this backward its speed)."""
    from lazoo.kernels import delta_chunk_bwd

    if delta_chunk_bwd.CHUNK_BWD_ERROR is not None:
        pytest.skip(f"this Triton lacks what the chunk backward needs: {delta_chunk_bwd.CHUNK_BWD_ERROR}")
    report = kernel_resources.delta_chunk_bwd_report()
    assert len(report) == 3, report
    _assert_fits_without_spill(report)


def test_delta_solve_fits_and_does_not_spill(single_thread):
    """The Gluon solve's shared tiles fit a Hopper block with room for several programs a multiprocessor (what the
    one-warp Triton solve lacks) and its one warpgroup holds the products without spilling."""
    from lazoo.kernels import delta_solve

    if delta_solve.SOLVE_ERROR is not None:
        pytest.skip(f"this Triton lacks what the solve needs: {delta_solve.SOLVE_ERROR}")
    report = kernel_resources.delta_solve_report()
    assert len(report) == 3, report
    _assert_fits_without_spill(report)
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT // 3 and r["regs"] <= 168, (name, r)


@pytest.mark.slow  # shows once that the check can fail; the default run keeps the checks themselves
def test_a_tile_too_large_for_shared_memory_is_seen(single_thread):
    """A matrix product over 256 × 256 fp32 tiles in 3 pipeline stages needs far more than a Hopper block has."""
    import triton
    import triton.language as tl

    @triton.jit
    def matmul_tile(a, b, c, N: tl.constexpr):
        r = tl.arange(0, N)
        acc = tl.zeros([N, N], dtype=tl.float32)
        for k in range(0, 4):
            x = tl.load(a + k * N * N + r[:, None] * N + r[None, :])
            y = tl.load(b + k * N * N + r[:, None] * N + r[None, :])
            acc += tl.dot(x, y)
        tl.store(c + r[:, None] * N + r[None, :], acc)

    r = kernel_resources.measure(matmul_tile, {"a": "*fp32", "b": "*fp32", "c": "*fp32", "N": "constexpr"},
                                 {"N": 256}, num_warps=8, num_stages=3)
    assert r["shared"] > kernel_resources.SHARED_LIMIT, r


@pytest.mark.slow  # 34 s of offline compiles on 2 cores
def test_ovq_kernels_fit_hopper(single_thread):
    """OVQ's kernels at their launch settings (d = 128, chunk 128) fit a Hopper block. (Spills are allowed: several
    of them hold a 128 × 128 fp32 accumulator or a chunk's keys; the report prints them.)"""
    report = kernel_resources.ovq_report()
    assert {"assign: add and search", "assign: merge", "attention: forward", "attention: dq", "decode"} <= set(report)
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)


@pytest.mark.slow
def test_normalized_kernels_fit_hopper(single_thread):
    """The normalised linear-attention kernels (bf16, d = 128, two scalar features) fit a Hopper block. (Spills are
    allowed, and depend on the Triton version: with 3.9 only the dq, dk, dv kernel spills, 180 bytes.)"""
    report = kernel_resources.normalized_report()
    assert len(report) == 5, report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)


def test_gla_kernels_fit_hopper(single_thread):
    """GLA's kernels (bf16, d = 128) fit a Hopper block, and its sub-chunk kernels keep their tiles in registers at
    one warp. (_bwd_inter spills 36 bytes at its 4 warps with
    Triton 3.9: allowed; it was the faster on an H200.)"""
    report = kernel_resources.gla_report()
    assert len(report) == 4, report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        if "inter-chunk" not in name:
            assert r["spill_stores"] == 0, (name, r)


LINEAR_KERNELS = {"forward: states", "forward: outputs", "backward: state gradients", "backward: dq, dk, dv",
                  "decoding"}


def check_linear(report):
    assert set(report) == LINEAR_KERNELS, report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)


def test_linear_kernels_fit_hopper_at_bamba_shapes(single_thread):
    """The gated linear-attention kernels as Mamba-2 runs them at Bamba-9B's shapes (128 value heads of 64 reading
    one group of B and C, state 128, bf16, 64 heads a program in the output kernel, one in the gradient kernel, as
    the launcher runs it) fit a Hopper block. (Spills are allowed: the gradient kernel holds a chunk's dq and dk in
    float32; with Triton 3.9 one head a program at value blocks of 64 spills 480 bytes.)"""
    check_linear(kernel_resources.linear_report(128, 64, heads=128, group=128, heads_per_program=64))


@pytest.mark.slow
@pytest.mark.parametrize("dk,dv,dtype,group,per_program", [
    (128, 128, "bf16", 1, 1), (128, 128, "fp32", 1, 1), (256, 64, "bf16", 8, 2), (64, 64, "fp16", 4, 4)])
def test_linear_kernels_fit_hopper_matrix(single_thread, dk, dv, dtype, group, per_program):
    """The same without grouped heads, with fp32 inputs, a head dim of 256 and fp16 (fp32 per-chunk states)."""
    check_linear(kernel_resources.linear_report(dk, dv, dtype, heads=16, group=group, heads_per_program=per_program))


KDA_KERNELS = {"cumsum", "fwd_intra", "fwd_diag", "fwd_solve", "fwd_wu", "fwd_h", "fwd_o", "bwd_du_local", "bwd_dhu",
               "bwd_inter", "bwd_wy", "bwd_intra", "bwd_intra_pairs", "fused_recurrent"}


def check_kda(report, no_spills=False):
    assert set(report) == KDA_KERNELS, report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        if no_spills:
            assert r["spill_stores"] == 0, (name, r)
        assert r["inflight_refills"] == 0, (name, r)


def test_inflight_refills_finds_a_copy_under_products_in_flight():
    """The scan counts a copy into a single-buffered tile after a wgmma wait that leaves products in flight, and
    neither one after a full wait nor one into a double-buffered tile."""
    ir = """
    %a = ttg.local_alloc : () -> !ttg.memdesc<1x64x128xbf16, #shared, #smem, mutable>
    %b = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared1, #smem, mutable>
    %a_0 = ttg.memdesc_index %a[%c0_i32] : !ttg.memdesc<1x64x128xbf16> -> !ttg.memdesc<64x128xbf16>
    %b_0 = ttg.memdesc_index %b[%i] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
    %c = ttg.async_copy_global_to_local %p, %a_0 mask %m : tensor<64x128x!tt.ptr<bf16>> -> <64x128xbf16>
    %w:2 = ttng.warp_group_dot_wait %d, %a_0 {pendings = 5 : i32} : tensor<64x128xf32, #mma>
    %e = ttg.async_copy_global_to_local %p, %b_0 mask %m : tensor<64x64x!tt.ptr<bf16>> -> <64x64xbf16>
    %f = ttg.async_copy_global_to_local %p, %a_0 mask %m : tensor<64x128x!tt.ptr<bf16>> -> <64x128xbf16>
    %v:3 = ttng.warp_group_dot_wait %d, %g, %h {pendings = 0 : i32} : tensor<64x128xf32, #mma>
    %k = ttg.async_copy_global_to_local %p, %a_0 mask %m : tensor<64x128x!tt.ptr<bf16>> -> <64x128xbf16>
    """
    assert kernel_resources.inflight_refills(ir) == 1


@pytest.mark.slow  # 39 s (bf16) and 69 s (fp32) of offline compiles on 2 cores
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kda_kernels_compile_and_fit_hopper(single_thread, dtype):
    """Every Kimi Delta Attention kernel compiles for sm_90 at its launch settings with dk = dv = 128 (the largest
    head dim it takes) and fits a Hopper block: a static loop over a bound that is not a constexpr compiled in the
    interpreter but not for the GPU, and three pipeline stages made _bwd_dhu ask for 295 424 bytes with fp32
    inputs. bf16 keeps every tile in registers; fp32 inputs spill (tf32x3 products split each [64, 128] fp32 tile in
    three), allowed. No kernel refills a shared tile that products in flight still read (two pipeline stages in
    _bwd_inter did: wrong bf16 dk, dg and dβ on an H200)."""
    check_kda(kernel_resources.kda_report(128, 128, dtype), no_spills=dtype == "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("dk,dv,dtype,gate,group", [
    (128, 128, "fp16", "fp16", 1), (128, 128, "bf16", "fp32", 4), (128, 48, "bf16", "bf16", 2),
    (64, 64, "bf16", "fp32", 1), (64, 64, "fp32", "fp32", 1), (16, 16, "fp16", "fp32", 1), (16, 16, "fp32", "fp32", 1)])
def test_kda_kernels_compile_and_fit_hopper_matrix(single_thread, dk, dv, dtype, gate, group):
    """The same at smaller and mixed head dims, fp16 (fp32 per-chunk states), a 16-bit gate and grouped values."""
    check_kda(kernel_resources.kda_report(dk, dv, dtype, gate=gate, group=group))


@pytest.mark.slow  # about a minute of offline compiles per dtype on 2 cores
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_delta_prefill_kernels_fit_hopper(single_thread, dtype):
    """The delta rule's prefill kernels compile for sm_90 at their launch settings with dk = dv = 128 (the widest the
    walk takes) and fit a Hopper block at every dv block the walk launches with; no shared tile is refilled under
    products in flight. bf16 keeps its tiles in registers but for a few bytes at blocks of 64 (4 with Triton 3.6);
    fp32 spills (tf32x3 products), allowed."""
    report = kernel_resources.delta_prefill_report(dtype=dtype)
    assert {"mix", "walk, dv blocks of 32", "walk, dv blocks of 16"} <= set(report), report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        assert r["inflight_refills"] == 0, (name, r)
        if dtype == "bf16":
            assert r["spill_stores"] <= 64, (name, r)


@pytest.mark.slow  # about half a minute of offline compiles on 2 cores
def test_delta_training_kernels_fit_hopper(single_thread):
    """The gated delta rule's training kernels compile for sm_90 at their launch settings (dk = dv = 128, bf16, the
    triangular products on bf16 operands) and fit a Hopper block, with no shared tile refilled under products in
    flight; the register-bound ones (the WY backward, the state-gradient walk at whole dv blocks) may spill a few
    bytes (88 and 92 with Triton 3.6)."""
    report = kernel_resources.delta_training_report()
    assert {"solve", "wu", "o", "dv_local", "dqkw", "wy"} <= set(report), report
    for name, r in report.items():
        assert r["shared"] <= kernel_resources.SHARED_LIMIT, (name, r)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        assert r["inflight_refills"] == 0, (name, r)
        assert r["spill_stores"] <= 256, (name, r)
