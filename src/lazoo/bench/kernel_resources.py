"""Shared memory, registers and spills of lazoo's Triton kernels on Hopper (sm_90), without a GPU.

Compiles a ``@triton.jit`` kernel for ``GPUTarget("cuda", 90, 32)`` with the installed Triton (its bundled
``ptxas``) and reads ``metadata.shared`` (what a launch checks against the 232 448 bytes a Hopper block may
use) and ``ptxas -v``'s registers and spill bytes. Resource use depends on the Triton version: to check what
a GPU machine will do, run with the same Triton as it has (e.g. ``pip install --target /tmp/t36 --no-deps
triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``); that reproduced a launch failure of the OVQ assignment kernel
(262 656 bytes asked) to the byte, and the 295 424 bytes a Kimi Delta Attention backward kernel asked for fp32
inputs. The report covers the short-convolution kernels at their launch settings; ``measure`` takes any kernel;
OVQ's, VLA's, GLA's, the (gated and normalised) linear-attention, the (gated) delta rule's (prefill and training)
and the Kimi Delta Attention kernels are reported too.

``measure`` also counts, in the compiled TTGIR, the asynchronous copies into a single-buffered shared tile issued
while Hopper matrix products (wgmma) may still be reading shared memory (``inflight_refills``): Triton's software
pipeliner can leave products in flight (``warp_group_dot_wait`` with ``pendings`` > 0) and then prefetch the next
loop iteration's tile into the one buffer they read, a race that silently corrupts the products (it cost the Kimi
Delta Attention backward a 6x larger bf16 error in dk, dg and dβ on an H200).

    python -m lazoo.bench.kernel_resources
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

#: bytes of shared memory one block may use on Hopper (H100 / H200)
SHARED_LIMIT = 232448


def measure(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
            maxnreg: int | None = None) -> dict:
    """``{"shared", "regs", "spill_stores"}`` of ``fn`` (a ``@triton.jit`` or a Gluon ``@gluon.jit`` kernel) compiled
    for sm_90 (pointers 16-byte aligned, as PyTorch allocations are). ``signature`` maps every argument to a Triton
    type ("*bf16", "i32", ...) or "constexpr"; ``constexprs`` gives the constexpr values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx) + ".o"],
                             capture_output=True, text=True, check=True).stderr

    def first_int(pattern):
        found = re.findall(pattern, log)
        return int(found[0]) if found else None

    return {"shared": kernel.metadata.shared, "regs": first_int(r"Used (\d+) registers"),
            "spill_stores": first_int(r"(\d+) bytes spill stores"),
            "inflight_refills": inflight_refills(kernel.asm["ttgir"])}


def inflight_refills(ttgir: str) -> int:
    """Asynchronous global-to-shared copies into a single-buffered tile (a ``local_alloc`` of one ``1x...`` buffer,
    or a view of it) that follow, in program order, a wgmma wait leaving products in flight (``pendings`` > 0) with
    no full wait (``pendings = 0``) between them: the copy may overwrite an operand a product still reads."""
    single, in_flight, count = set(), False, 0
    for line in ttgir.splitlines():
        name = re.match(r"\s*(%[\w.]+)(?::\d+)? = ", line)
        if name and re.search(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<1x", line):
            single.add(name[1])
        elif name and "ttg.memdesc_index" in line and re.search(r"memdesc_index (%[\w.]+)\[", line)[1] in single:
            single.add(name[1])
        elif "warp_group_dot_wait" in line:
            in_flight = int(re.search(r"pendings = (\d+)", line)[1]) > 0
        elif in_flight and "async_copy_global_to_local" in line:
            count += re.search(r"async_copy_global_to_local %[\w.]+, (%[\w.]+)", line)[1] in single
    return count


def short_conv_report(dtype: str = "bf16", kernel_size: int = 4, channels: int = 768) -> dict:
    """The short-convolution kernels, forward and backward, for batches and for packed sequences (each row's
    sequence start read), at the block sizes their launchers pick for ``channels`` (the backward's run length L is
    a runtime argument and changes nothing compiled)."""
    from lazoo.kernels import short_conv as ksc

    BT, BC, warps = ksc._blocks(channels)
    _, R, BCb, warps_b = ksc._bwd_blocks(1, 4096, channels)
    x = f"*{dtype}"
    ints = {"T": "i32", "C": "i32", "SXB": "i64", "SX": "i32"}
    out = {}
    for packed in (False, True):
        suffix = " (packed)" if packed else ""
        fwd_sig = {"x": x, "w": "*fp32", "y": x, "starts": "*i32", **ints, "K": "constexpr", "SILU": "constexpr",
                   "BT": "constexpr", "BC": "constexpr", "PACKED": "constexpr"}
        bwd_sig = {"x": x, "w": "*fp32", "dy": x, "dx": x, "dw_part": "*fp32", "starts": "*i32", **ints, "L": "i32",
                   "K": "constexpr", "SILU": "constexpr", "R": "constexpr", "BC": "constexpr", "PACKED": "constexpr"}
        out["forward" + suffix] = measure(ksc._fwd_kernel, fwd_sig, {"K": kernel_size, "SILU": True, "BT": BT,
                                                                     "BC": BC, "PACKED": packed}, num_warps=warps)
        out["backward" + suffix] = measure(ksc._bwd_kernel, bwd_sig, {"K": kernel_size, "SILU": True, "R": R,
                                                                      "BC": BCb, "PACKED": packed}, num_warps=warps_b)
    return out


def ssd_io_report(dtype: str = "bf16", head_dim: int = 64, heads: int = 128) -> dict:
    """Mamba-2's element-wise kernels around its SSD (v = dt·x and the D skip, both directions) at the tile their
    launcher picks for ``heads`` heads of ``head_dim`` over 32k tokens."""
    import torch

    from lazoo.kernels import ssd_io

    # the launcher's tile for 32k tokens (many programs an SM, so the device's SM count does not enter)
    BR, BP, warps = ssd_io._blocks(32768 * heads, head_dim, torch.device("cpu"))
    x = f"*{dtype}"
    dims = {"R": "i32", "H": "i32", "P": "i32", "SX": "i64", "BR": "constexpr", "BP": "constexpr"}
    ce = {"BR": BR, "BP": BP}
    kernels = {
        "scale: forward": (ssd_io._scale_fwd_kernel, {"x": x, "dt": "*fp32", "v": x}),
        "scale: backward": (ssd_io._scale_bwd_kernel, {"x": x, "dt": "*fp32", "dv": x, "dx": x, "ddt": "*fp32"}),
        "skip: forward": (ssd_io._skip_fwd_kernel, {"y": x, "x": x, "D": "*fp32", "out": x}),
        "skip: backward": (ssd_io._skip_bwd_kernel, {"x": x, "D": "*fp32", "dout": x, "dx": x, "d_rows": "*fp32"}),
    }
    return {name: measure(fn, {**sig, **dims}, ce, num_warps=warps) for name, (fn, sig) in kernels.items()}


def decode_linear_report(dtype: str = "bf16", hidden: int = 768, rows: int = 1) -> dict:
    """A decode step's input products (``lazoo.kernels.decode_linear``) at the tiles their launchers pick for
    ``rows`` rows of ``hidden`` inputs: a Gated DeltaNet mixer's six projections (q, k, v and the output gate of
    ``hidden`` each, β (with its bias) and the decay's input of 12 heads: the ~145M model's) and a SwiGLU of width
    4 × hidden."""
    import torch

    from lazoo.kernels import decode_linear as dl

    x = torch.empty(rows, hidden, device="meta", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    widths = [hidden, hidden, hidden, 12, 12, hidden]  # q, k, v, beta, the decay's a, the output gate
    many = dl._tiles(x, dl.PROGRAMS_WANTED, sum(widths))
    unit = dl._tiles(x, dl.PROGRAMS_WANTED, 4 * hidden)
    p = f"*{dtype}"
    ints = {"sx": "i32", "so": "i32", "M": "i32", "K": "i32"}
    sizes = {f"N{i}": (widths[i] if i < len(widths) else 0) for i in range(dl.MAX_WEIGHTS)}
    tiles = ("BM", "BN", "BK", "CT", "PREC")
    sig_many = {"x": p, **{n: ints[n] for n in ("sx",)}, "out": p, "so": "i32", "M": "i32", "K": "i32",
                **{f"w{i}": p for i in range(dl.MAX_WEIGHTS)}, **{f"b{i}": p for i in range(dl.MAX_WEIGHTS)},
                **dict.fromkeys(sizes, "constexpr"), "NW": "constexpr", "HB": "constexpr",
                **dict.fromkeys(tiles, "constexpr")}
    sig_unit = {"x": p, "sx": "i32", "wg": p, "wu": p, "out": p, "so": "i32", "M": "i32", "K": "i32", "N": "i32",
                "ACT": "constexpr", **dict.fromkeys(tiles, "constexpr")}
    return {
        f"six projections (BN {many['BN']})": measure(
            dl._linear_many_kernel, sig_many, {**sizes, "NW": len(widths), "HB": 1 << 3,  # β's bias
                                               **{k: many[k] for k in tiles}}),
        f"SwiGLU's gate and up (BN {unit['BN']})": measure(
            dl._gated_unit_kernel, sig_unit, {"ACT": 0, **{k: unit[k] for k in tiles}}),
    }


def ovq_report(dk: int = 128, chunk: int = 128) -> dict:
    """OVQ's kernels at their GPU launch settings (``_blocks`` of ``lazoo.kernels.ovq.attention`` and ``.assign``):
    the assignments' search and merge (fp32), the version tables' two walks (``.versions``), the chunk attention's
    forward and backward (bf16) and the decode step."""
    from lazoo.kernels.ovq import assign as ovq_assign
    from lazoo.kernels.ovq import attention as ovq_attention
    from lazoo.kernels.ovq import versions as ovq_versions

    f32, i64 = "*fp32", "*i64"
    acfg = ovq_assign._blocks(dk)
    ints = dict.fromkeys(("B", "P", "H", "M", "L"), "i32")
    shapes = dict(DK=dk, BL=chunk, BD=dk, SIM_PRECISION=ovq_assign.SIM_PRECISION)
    cx = {n: "constexpr" for n in ("DK", "BL", "BD", "SIM_PRECISION")}
    sig_n = dict(k=f32, sums=f32, counts=i64, best=f32, arg="*i32", before=i64, slots=i64, n_full="*i32",
                 step="i32", **ints, **cx, BN="constexpr", SEARCH="constexpr", BDA="constexpr",
                 BDS="constexpr", BF16_PARTS="constexpr", ADD="constexpr", BK="constexpr")
    sig_m = dict(k=f32, best=f32, arg="*i32", slots=i64, size_of="*i32", n_full="*i32", t_base=i64, step="i32",
                 **ints, N="i32", NBLK="i32", **cx, BRK="constexpr", NBG="constexpr")
    nearest = dict(shapes, BN=acfg["BN"], BDA=acfg["BDA"], BDS=acfg["BDS"], BF16_PARTS=acfg["BF16_PARTS"])
    out = {
        "assign: add and search": measure(ovq_assign._nearest_kernel, sig_n,
                                          dict(nearest, ADD=True, SEARCH=True, BK=chunk), **_opts(acfg["nearest"])),
        "assign: add alone": measure(ovq_assign._nearest_kernel, sig_n,
                                     dict(nearest, ADD=True, SEARCH=False, BK=chunk), **_opts(acfg["nearest"])),
        **{f"assign: search alone, {keys} keys a program": measure(
            ovq_assign._nearest_kernel, sig_n, dict(nearest, ADD=False, SEARCH=True, BK=keys), **_opts(acfg["search"]))
           for keys in (chunk, chunk // 2, chunk // 4)},
        "assign: merge": measure(ovq_assign._merge_kernel, sig_m, dict(shapes, BRK=acfg["BRK"], NBG=acfg["NBG"]),
                                 **_opts(acfg["merge"])),
    }
    i64s = dict.fromkeys(("C0", "START", "N", "ORDER"), i64)
    sizes = dict.fromkeys(("P", "H", "M", "ROWS"), "i32")
    vcx = dict(D="constexpr", BD="constexpr")
    out["version table: forward"] = measure(
        ovq_versions._fwd_kernel, dict(X=f32, D0=f32, **i64s, OUT="*bf16", END=f32, **sizes, **vcx),
        dict(D=dk, BD=dk), num_warps=ovq_versions.NUM_WARPS)
    out["version table: backward"] = measure(
        ovq_versions._bwd_kernel, dict(DOUT="*bf16", DEND=f32, **i64s, DX=f32, DD0=f32, **sizes, **vcx),
        dict(D=dk, BD=dk), num_warps=ovq_versions.NUM_WARPS)
    def tiles(kernel):
        cfg = ovq_attention._blocks(kernel)
        return dict(DQK=dk, DV=dk, BDK=dk, BDV=dk, BM=cfg["BM"], BN=cfg["BN"]), _opts(cfg)

    tcx = dict.fromkeys(("DQK", "DV", "BDK", "BDV", "BM", "BN"), "constexpr")
    bf = "*bf16"
    common = dict(q=bf, k=bf, v=bf, dk=bf, dv=bf, counts=i64, base=i64, size="*i32", length="*i32")
    dims = dict.fromkeys(("B", "T", "H", "W", "R", "L"), "i32")
    grads = dict(do=bf, lse=f32, delta=f32)
    t, opts = tiles("fwd")
    out["attention: forward"] = measure(ovq_attention._fwd_kernel, dict(common, o=bf, lse=f32, **dims, **tcx), t,
                                        **opts)
    t, opts = tiles("dq")
    out["attention: dq"] = measure(ovq_attention._bwd_dq_kernel, dict(common, **grads, dq=bf, **dims, **tcx), t, **opts)
    for name, kernel, dict_rows, g in (("chunk keys", "dkv_chunk", False, bf), ("dictionary", "dkv_dict", True, f32)):
        t, opts = tiles(kernel)
        out[f"attention: dk, dv ({name})"] = measure(
            ovq_attention._bwd_dkv_kernel, dict(common, **grads, gk=g, gv=g, **dims, DICT="constexpr", **tcx),
            dict(t, DICT=dict_rows), **opts)
    sig_d = dict(q=f32, dk=f32, dv=f32, counts=i64, pk=f32, pv=f32, n_part="*i32", m_out=f32, l_out=f32,
                 acc_out=f32, H="i32", M="i32", L="i32", ROWS="i32", DQK="constexpr", DV="constexpr", BDK="constexpr",
                 BDV="constexpr", BN="constexpr", BL="constexpr")
    out["decode"] = measure(ovq_attention._decode_kernel, sig_d, dict(DQK=dk, DV=dk, BDK=dk, BDV=dk, BN=64, BL=chunk))
    return out


def vla_report(dk: int = 128, heads: int = 16) -> dict:
    """VLA's A scans at their launch settings: the token scan (``lazoo.kernels.vla.token``: forward, the two backward
    passes), the piece maps and the inverse of the split scan (``lazoo.kernels.vla.split``), the fused features and
    normaliser (``lazoo.kernels.vla.features``, bf16 inputs) and the chunked Woodbury scan
    (``lazoo.kernels.vla.chunk``, blocks of 16, tf32x3), fp32 state."""
    from lazoo.kernels.vla import chunk as vla_chunk
    from lazoo.kernels.vla import features as vla_features
    from lazoo.kernels.vla import split as vla_split
    from lazoo.kernels.vla import token as vla_token

    f32, dev = "*fp32", _FakeDevice()
    c = dict(H=heads, D=dk, BD=dk)
    cx = dict.fromkeys(c, "constexpr")
    tok = vla_token._launch_opts(dk, dev)
    out = {
        "token scan: forward": measure(vla_token._scan_fwd_kernel, dict(
            k=f32, u=f32, flags="*i8", A0=f32, alpha=f32, rnorm=f32, zbuf=f32, dbuf=f32, A_out=f32, ckpt=f32,
            T="i32", L="i32", eta="fp32", eps="fp32", **cx, CK="constexpr", SAVE="constexpr"),
            dict(c, CK=256, SAVE=True),
            **tok),
        "token scan: backward (gradient of A)": measure(vla_token._scan_bwd_gs_kernel, dict(
            k=f32, u=f32, alpha=f32, rnorm=f32, dalpha=f32, zbuf=f32, dbuf=f32, dA_end=f32, ga_out=f32, gz_out=f32,
            gd_out=f32, dA0=f32, T="i32", L="i32", **cx, STORE="constexpr"),
            dict(c, STORE=True), **tok),
        "token scan: backward (A rebuilt)": measure(vla_token._scan_bwd_a_kernel, dict(
            flags="*i8", zbuf=f32, dbuf=f32, A_end=f32, ckpt=f32, dk=f32, du=f32, gd=f32, T="i32", L="i32", eta="fp32",
            **cx,
            CK="constexpr"), dict(c, CK=256), **tok),
    }
    out["split scan: piece maps"] = measure(vla_split._piece_map_kernel, dict(
        u=f32, flags=f32, maps=f32, T="i32", L="i32", NM="i32", eta="fp32", **cx, BJ="constexpr", BC="constexpr",
        PREC="constexpr"), dict(c, BJ=vla_split.COLUMNS, BC=vla_split.BLOCK, PREC=vla_split.PRECISION),
        num_warps=vla_split.WARPS)
    out["split scan: inverse"] = measure(vla_split._inverse_kernel, dict(
        Y=f32, R=f32, E=f32, D="constexpr", BD="constexpr", TOL="constexpr", MAXIT="constexpr", PREC="constexpr"),
        dict(D=dk, BD=dk, TOL=vla_split.INVERSE_TOL, MAXIT=vla_split.INVERSE_MAXIT, PREC=vla_split.INVERSE_PRECISION),
        num_warps=vla_split.INVERSE_WARPS)
    b16 = "*bf16"
    cf = dict(D=dk, BD=dk, ROWS=vla_features.ROWS, ELU=True, UNIT_Q=False, NEPS=vla_features.NORM_EPS)
    cfx = dict.fromkeys(cf, "constexpr")
    out["features: forward"] = measure(vla_features._features_fwd_kernel, dict(
        q=b16, k=b16, u=b16, k_hat=f32, u_hat=f32, k_out=b16, q_out=b16, R="i32", scale_u="fp32", **cfx), cf)
    out["features: backward"] = measure(vla_features._features_bwd_kernel, dict(
        q=b16, k=b16, u=b16, g_kh=f32, g_uh=f32, g_kout=f32, g_qout=f32, dq=f32, dk=f32, du=f32, R="i32",
        scale_u="fp32", **cfx), cf)
    cn = dict(H=heads, D=dk, BD=dk, BT=vla_features.BT, ELU=True, HAS_MASK=True)
    cnx = dict.fromkeys(cn, "constexpr")
    warps = vla_features.NORMALISER_WARPS
    out["normaliser: forward"] = measure(vla_features._normaliser_fwd_kernel, dict(
        q=b16, k=b16, mask=f32, z_range=f32, den=f32, z_end=f32, z_starts=f32, T="i32", LS="i32", eps="fp32",
        **cnx, SAVE="constexpr"), dict(cn, SAVE=True), num_warps=warps)
    out["normaliser: backward"] = measure(vla_features._normaliser_bwd_kernel, dict(
        q=b16, k=b16, mask=f32, z_starts=f32, dden=f32, carry=f32, sums=f32, dq=f32, dk=f32, dz0=f32, T="i32",
        LS="i32", eps="fp32", **cnx, SUMS="constexpr"), dict(cn, SUMS=False), num_warps=warps)
    c2 = dict(c, BC=16, K=16, PREC="tf32x3")
    cx2 = dict.fromkeys(c2, "constexpr")
    chunk = vla_chunk._launch_opts(dk, dev)
    out["chunked scan: forward"] = measure(vla_chunk._chunk_fwd_kernel, dict(
        k=f32, u=f32, flags="*i8", A0=f32, alpha=f32, rnorm=f32, A_out=f32, ckpt=f32, T="i32", NB="i32", NCK="i32",
        eta="fp32", **cx2, SAVE="constexpr"), dict(c2, SAVE=True), **chunk)
    out["chunked scan: backward"] = measure(vla_chunk._chunk_bwd_kernel, dict(
        k=f32, u=f32, flags="*i8", alpha=f32, rnorm=f32, dalpha=f32, dA_end=f32, ckpt=f32, scratch=f32, dk=f32,
        du=f32, dA0=f32, T="i32", NB="i32", NCK="i32", eta="fp32", **cx2, USE_DA="constexpr"), dict(c2, USE_DA=True),
        **chunk)
    return out


def normalized_report(dk: int = 128, dv: int = 128, scalars: int = 2, causal: bool = True, state_bv: int = 64,
                      poly: int = 0) -> dict:
    """The normalised linear-attention kernels (``lazoo.kernels.normalized``), bf16, chunks of 64, with the scalar
    features (ELA's polynomial kernels), at their launch settings; causal, or the non-causal form. ``state_bv``: the
    state kernels' value block (32 where the tiles would not fill the GPU); ``poly``: the dq, dk, dv kernel's POLY."""
    import triton.language as tl

    from lazoo.kernels import normalized as kn

    b16, f32, i64 = "*bf16", "*fp32", "*i64"
    meta = dict(H=16, K=dk, V=dv, E=max(scalars, 1), BT=64, EXTRA=scalars > 0, IS_VARLEN=False, PREC="tf32")
    mx = dict.fromkeys(meta, "constexpr")
    state = dict(BK=64, BV=state_bv, SPREC="tf32", STORE_CHUNKS=causal, SDT=tl.bfloat16, SEG=0)
    sx = dict.fromkeys(state, "constexpr")
    out = {}
    end = dict(USE_H0=True, STORE_HT=True)
    out["forward: states"] = measure(kn._fwd_h_kernel, dict(
        k=b16, c=f32, v=b16, h=b16, he=f32, z=f32, ze=f32, h0=f32, he0=f32, z0=f32, ze0=f32, ht=f32, het=f32, zt=f32,
        zet=f32, cu_seqlens=i64, chunk_offsets=i64, T="i32", **mx, **sx, **dict.fromkeys(end, "constexpr")),
        {**meta, **state, **end}, num_stages=2)
    fo = dict(BK=64, BV=kn.FWD_BV, ROW_EPS=False, CAUSAL=causal)
    out["forward: outputs"] = measure(kn._fwd_o_kernel, dict(
        q=b16, k=b16, a=f32, c=f32, v=b16, h=b16, he=f32, z=f32, ze=f32, o=b16, den=f32, cu_seqlens=i64,
        chunk_indices=i64, eps="fp32", eps_rows=f32, T="i32", **mx, **dict.fromkeys(fo, "constexpr")), {**meta, **fo},
        num_stages=2)
    out["backward: 1/den, dden"] = measure(kn._bwd_prep_kernel, dict(
        o=b16, do=b16, den=f32, rden=f32, dden=f32, eps="fp32", eps_rows=f32, rows="i32", H="constexpr",
        V="constexpr", BR="constexpr", BV="constexpr", ROW_EPS="constexpr"),
        dict(H=16, V=dv, BR=32, BV=dv, ROW_EPS=False))
    end = dict(USE_DHT=True, STORE_DH0=True)
    out["backward: state gradients"] = measure(kn._bwd_dh_kernel, dict(
        q=b16, a=f32, do=b16, rden=f32, dden=f32, dh=b16, dhe=f32, dz=f32, dze=f32, dht=f32, dhet=f32, dzt=f32,
        dzet=f32, dh0=f32, dhe0=f32, dz0=f32, dze0=f32, cu_seqlens=i64, chunk_offsets=i64, T="i32", **mx, **sx,
        **dict.fromkeys(end, "constexpr")), {**meta, **state, **end}, num_stages=2)
    bq = dict(BK=dk, BV=kn.DQKV_BV, CAUSAL=causal, TIMES_FEATURES=False, POLY=poly, SIGN=2.0,
              DV=not scalars)
    out["backward: dq, dk, dv"] = measure(kn._bwd_dqkv_kernel, dict(
        q=b16, k=b16, a=f32, c=f32, v=b16, h=b16, he=f32, z=f32, ze=f32, do=b16, rden=f32, dden=f32, dh=b16,
        dhe=f32, dz=f32, dze=f32, dq=b16, dk=b16, da=f32, dc=f32, dv=b16, q_in=b16, k_in=b16, cu_seqlens=i64,
        chunk_indices=i64, T="i32", **mx, **dict.fromkeys(bq, "constexpr")), {**meta, **bq}, num_warps=8, num_stages=1)
    return out


def linear_report(dk: int = 128, dv: int = 128, dtype: str = "bf16", heads: int = 16, group: int = 1,
                  heads_per_program: int = 1, bwd_heads_per_program: int = 1) -> dict:
    """The chunked (gated) linear-attention kernels (``lazoo.kernels.linear``), chunks of 64, with the decay, at
    their first launch settings, for q, k, v in ``dtype``: ``heads`` value heads, ``group`` of them per key head
    (Mamba-2's groups), ``heads_per_program`` of them per program of the output kernel and
    ``bwd_heads_per_program`` of the gradient kernel (the launcher runs it at one)."""
    import torch

    from lazoo.kernels import linear as kl
    from lazoo.kernels._launch import chunk_state_dtype, dqkv_configs, state_blocks

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x, f32, i64 = f"*{dtype}", "*fp32", "*i64"
    hd = "*bf16" if chunk_state_dtype(torch_dtype) == torch.bfloat16 else f32
    two_byte = dtype != "fp32"
    meta = dict(H=heads, HK=heads // group, K=dk, V=dv, BT=64, USE_G=True, IS_VARLEN=False,
                PREC=kl._prec(torch_dtype))
    cx = lambda c: dict.fromkeys(c, "constexpr")  # noqa: E731
    BK, BV = state_blocks(dk, dv)
    walk = dict(meta, BK=BK, BV=BV, SEG=0, STORE_CHUNKS=True)
    out = {}
    c = dict(walk, USE_H0=True, STORE_HT=True)
    out["forward: states"] = measure(kl._fwd_h_kernel, dict(
        k=x, v=x, g=f32, h=hd, h0=f32, ht=f32, cu_seqlens=i64, chunk_offsets=i64, T="i32", **cx(c)), c, num_stages=2)
    c = dict(meta, BK=min(64, dk), BV=min(128 if two_byte else 64, dv), HB=heads_per_program)
    out["forward: outputs"] = measure(kl._fwd_o_kernel, dict(
        q=x, k=x, v=x, g=f32, h=hd, o=x, cu_seqlens=i64, chunk_indices=i64, scale="fp32", T="i32", **cx(c)), c,
        num_stages=2)
    c = dict(walk, USE_DHT=True, STORE_DH0=True)
    out["backward: state gradients"] = measure(kl._bwd_dh_kernel, dict(
        q=x, do=x, g=f32, dh=hd, dht=f32, dh0=f32, cu_seqlens=i64, chunk_offsets=i64, scale="fp32", T="i32",
        **cx(c)), c, num_stages=2)
    first = dqkv_configs(dk, dv, two_byte)[0]  # as kl._bwd picks (value blocks of 64)
    c = dict(meta, BK=dk, BV=first["BV"], HB=bwd_heads_per_program)
    out["backward: dq, dk, dv"] = measure(kl._bwd_dqkv_kernel, dict(  # dq and dk (or their parts) in q's dtype
        q=x, k=x, v=x, g=f32, h=hd, do=x, dh=hd, dq=x, dk=x, dv=x, dg=f32, cu_seqlens=i64, chunk_indices=i64,
        scale="fp32", T="i32", TT="i32", **cx(c)), c, num_warps=first["num_warps"], num_stages=first["num_stages"])
    c = dict(H=heads, HK=heads // group, K=dk, V=dv, BK=dk, BV=min(32, dv), USE_G=True, USE_S0=True, NORMALIZE=False,
             STORE_ST=True)
    out["decoding"] = measure(kl._fused_recurrent_kernel, dict(
        q=x, k=x, v=x, g=f32, s0=f32, z0=f32, o=x, st=f32, zt=f32, scale="fp32", eps="fp32", T="i32", **cx(c)), c,
        num_warps=4 if dk * min(32, dv) >= 4096 else 2)
    return out


def gla_report(dk: int = 128, dv: int = 128) -> dict:
    """GLA's sub-chunk kernels (``lazoo.kernels.gla``), bf16, chunks of 64 in sub-chunks of 16, at their launch
    settings (``INTRA_WARPS``, ``A_BK``, ``DIAG_BK``), and the inter-chunk backward kernel."""
    import triton.language as tl

    from lazoo.kernels import gla as kg

    b16, f32, i64 = "*bf16", "*fp32", "*i64"
    meta = dict(H=16, K=dk, BT=kg.CHUNK, BC=kg.SUB, IS_VARLEN=False, PREC="tf32")
    out = {}
    for diag, bk in ((False, kg.A_BK), (True, kg.DIAG_BK)):
        c = dict(meta, BK=min(bk, dk), DIAG=diag, DT=tl.bfloat16)
        out[f"forward: A, {'diagonal' if diag else 'off-diagonal'} blocks"] = measure(kg._fwd_A_kernel, dict(
            q=b16, k=b16, G=f32, A=f32, cu_seqlens=i64, chunk_indices=i64, T="i32", **dict.fromkeys(c, "constexpr")),
            c, num_warps=kg.INTRA_WARPS, num_stages=2)
    c = dict(meta, BK=min(kg.MAX_BLOCK, dk), DT=tl.bfloat16)
    out["backward: intra-chunk dq, dk"] = measure(kg._bwd_intra_kernel, dict(
        q=b16, k=b16, G=f32, dA=f32, dq=f32, dk=f32, cu_seqlens=i64, chunk_indices=i64, T="i32",
        **dict.fromkeys(c, "constexpr")), c, num_warps=kg.INTRA_WARPS, num_stages=2)
    c = dict(H=16, K=dk, V=dv, BT=kg.CHUNK, BK=min(kg.MAX_BLOCK, dk), BV=min(kg.MAX_BLOCK, dv), IS_VARLEN=False,
             PREC="tf32")
    out["backward: inter-chunk dq, dk, dg"] = measure(kg._bwd_inter_kernel, dict(
        q=b16, k=b16, v=b16, G=f32, h=b16, do=b16, dh=b16, dq=f32, dk=f32, dq_out=b16, dk_out=b16, dg=b16,
        cu_seqlens=i64, chunk_indices=i64, scale="fp32", T="i32", **dict.fromkeys(c, "constexpr")), c,
        num_warps=kg.INTER_WARPS, num_stages=2)
    return out


def kda_report(dk: int = 128, dv: int = 128, dtype: str = "bf16", gate: str = "fp32", heads: int = 16,
               group: int = 1, launch: dict | None = None) -> dict:
    """Every Kimi Delta Attention kernel (``lazoo.kernels.kda``) at its GPU launch settings (``launch_options``,
    the blocks of ``_blocks``, ``DECODE_BV``) for q, k, v in ``dtype`` ("bf16", "fp16", "fp32") with g and β in
    ``gate`` (float32, or q's dtype), ``heads`` value heads, ``group`` of them a key head. ``launch``: the kernels
    to compile (names of ``LAUNCH``), each with its options (default: all, at the options for ``dtype``)."""
    import torch
    import triton.language as tl

    from lazoo.kernels import kda as kk

    x, f32, i64, gt = f"*{dtype}", "*fp32", "*i64", f"*{gate}"
    DT, PREC = {"bf16": (tl.bfloat16, "tf32"), "fp16": (tl.float16, "tf32"), "fp32": (tl.float32, "tf32x3")}[dtype]
    hd = "bf16" if dtype == "bf16" else "fp32"  # the per-chunk states (kda's chunk_state_dtype)
    BK, BV, BVs = kk._blocks(dk, dv, interp=False)
    H, HK = heads, heads // group
    seq = dict(chunks=i64, cu=i64)
    c_k = dict(H=H, HK=HK, K=dk, BK=BK)
    c_kv = dict(c_k, V=dv, BV=BV)
    c_state = dict(c_k, V=dv, BV=BVs)
    cx = lambda c: dict.fromkeys(c, "constexpr")  # noqa: E731
    kernels = {
        "cumsum": (kk._cumsum_kernel, dict(g=gt, Gc=f32, positive="*i32", **seq), dict(H=H, K=dk, BK=BK, CHECK=True)),
        "fwd_intra": (kk._fwd_intra_kernel, dict(q=x, k=x, Gc=f32, Aqk=x, Mkk=f32, **seq),
                      dict(c_k, DT=DT, PREC=PREC)),
        "fwd_diag": (kk._fwd_diag_kernel, dict(q=x, k=x, Gc=f32, Aqk=x, Mkk=f32, **seq),
                     dict(H=H, HK=HK, K=dk, BK=BK, BKP=min(kk.DIAG_CHANNELS, BK), RANGE=kk.DIAG_PRODUCT_RANGE,
                          PREC=PREC)),
        "fwd_solve": (kk._fwd_solve_kernel, dict(Mkk=f32, beta=gt, A=f32, **seq), dict(H=H, PREC=PREC)),
        "fwd_wu": (kk._fwd_wu_kernel, dict(k=x, v=x, beta=gt, Gc=f32, A=f32, w=x, ut=x, **seq),
                   dict(c_kv, PREC=PREC)),
        "fwd_h": (kk._fwd_h_kernel, dict(k=x, Gc=f32, w=x, ut=x, h=f"*{hd}", vnew=x, s0=f32, sT=f32, cu=i64,
                                         coff=i64),
                  dict(c_state, USE_S0=True, STORE_S=True, DT=DT, PREC=PREC)),
        "fwd_o": (kk._fwd_o_kernel, dict(q=x, Gc=f32, h=f"*{hd}", Aqk=x, vnew=x, o=x, **seq, scale="fp32"),
                  dict(c_kv, DT=DT, PREC=PREC)),
        "bwd_du_local": (kk._bwd_du_local_kernel, dict(Aqk=x, vnew=x, do=x, dAqk=f32, du=f32, **seq,
                                                       scale="fp32"),
                         dict(H=H, V=dv, BV=BV, DT=DT, PREC=PREC)),
        "bwd_dhu": (kk._bwd_dhu_kernel, dict(q=x, k=x, Gc=f32, w=x, do=x, du=f32, dh=f"*{hd}", dsT=f32, ds0=f32,
                                             cu=i64, coff=i64, scale="fp32"),
                    dict(c_state, USE_DST=True, STORE_DS0=True, DT=DT, PREC=PREC)),
        "bwd_inter": (kk._bwd_inter_kernel, dict(k=x, Gc=f32, h=f"*{hd}", dh=f"*{hd}", vnew=x, do=x, du=f32,
                                                 dq=f32, dkn=f32, dw=f32, later=f32, **seq, scale="fp32"),
                      dict(c_kv, DT=DT, PREC=PREC)),
        "bwd_wy": (kk._bwd_wy_kernel, dict(k=x, v=x, beta=gt, Gc=f32, A=f32, Mkk=f32, dw=f32, du=f32, dkp=f32,
                                           dv=x, dbeta=f32, dMkk=f32, **seq),
                   dict(c_kv, PREC=PREC)),
        "bwd_intra": (kk._bwd_intra_kernel, dict(q=x, k=x, Gc=f32, dAqk=f32, dMkk=f32, dq=f32, dkn=f32, dkp=f32,
                                                 later=f32, dq_out=x if group == 1 else f32,
                                                 dk_out=x if group == 1 else f32, dg=gt, **seq),
                      dict(c_k, BK=min(BK, kk.INTRA_BWD_CHANNELS), NKS=-(-dk // min(BK, kk.INTRA_BWD_CHANNELS)),
                           PREC=PREC, RANGE=kk.DIAG_PRODUCT_RANGE, PAIRS=False)),
        "fused_recurrent": (kk._fused_recurrent_kernel, dict(q=x, k=x, v=x, g=gt, beta=gt, s0=f32, o=x, sT=f32,
                                                             cu=i64, scale="fp32"),
                            dict(c_k, V=dv, BV=min(kk.DECODE_BV, BVs), USE_S0=True, STORE_S=True)),
    }
    fn, sig, c = kernels["bwd_intra"]
    kernels["bwd_intra_pairs"] = (fn, sig, dict(c, PAIRS=True))  # its second launch, at the same options
    launch = kk.launch_options(torch.float32 if dtype == "fp32" else torch.float16) if launch is None else launch
    out = {}
    for name, (fn, sig, c) in kernels.items():
        entry = name.removesuffix("_pairs")
        if entry in launch:
            bv, opts = kk._with_bv(launch, entry, c.get("BV"), dv, interp=False)  # a value block set in the table
            c = dict(c, BV=bv) if "BV" in c else c
            out[name] = measure(fn, dict(sig, **cx(c)), c, **opts)
    return out


def delta_prefill_report(dk: int = 128, dv: int = 128, dtype: str = "bf16", chunk: int = 64) -> dict:
    """The (gated) delta rule's prefill kernels (``lazoo.kernels.delta._fwd_mix`` and ``_fwd_walk``, the forward
    without autograd) at their launch settings, g and β in float32, the walk at each dv block it launches with."""
    import triton.language as tl

    from lazoo.kernels import delta as kd

    x, f32, i32 = f"*{dtype}", "*fp32", "*i32"
    DT, PREC = {"bf16": (tl.bfloat16, "tf32"), "fp16": (tl.float16, "tf32"), "fp32": (tl.float32, "tf32x3")}[dtype]
    fp32 = dtype == "fp32"
    BKF, BK, _ = kd._blocks(dk, dv, interpret=False)
    cx = lambda c: dict.fromkeys(c, "constexpr")  # noqa: E731
    out = {}
    c = dict(H=16, HK=16, K=dk, C=chunk, BK=BK, HAS_G=True, HAS_W=False, DT=DT, PREC=PREC)
    out["mix"] = measure(kd._fwd_mix_kernel, dict(q=x, kw=x, beta=f32, Gc=f32, A=f32, M=x, Y=x, chunks=i32, cu=i32,
                                                 **cx(c)), c, **kd._opts("mix", False, fp32))
    for bv in sorted({min(32 if fp32 else 64, dv), 32, 16}, reverse=True):
        c = dict(H=16, HK=16, K=dk, V=dv, C=chunk, BKF=BKF, BV=bv, HAS_G=True, USE_S0=True, STORE_S=True, DT=DT,
                 PREC=PREC)
        out[f"walk, dv blocks of {bv}"] = measure(kd._fwd_walk_kernel, dict(
            q=x, k=x, v=x, Gc=f32, M=x, Y=x, o=x, s0=f32, sT=f32, cu=i32, coff=i32, scale="fp32", **cx(c)), c,
            **kd._opts("walk", False, fp32))
    return out


def delta_training_report(dk: int = 128, dv: int = 128, dtype: str = "bf16", chunk: int = 64) -> dict:
    """The gated delta rule's training kernels (``lazoo.kernels.delta``: the forward with autograd and the backward)
    at their GPU launch settings for q, k, v in ``dtype``, β in q's dtype and g in float32, dk = dv = 128 by default:
    the table's options (``CONFIGS``), the state walks also as they launch once their programs outnumber the SMs
    (``_fwd_h`` at ``H_STAGES_MANY_PROGRAMS``, ``_bwd_dhu`` with ``DHU_WIDE_DV``), the triangular products on the
    operand type ``_triangular_type`` gives."""
    import torch

    from lazoo.kernels import delta as kd
    from lazoo.kernels._launch import dot_types

    x, f32, i32 = f"*{dtype}", "*fp32", "*i32"
    like = torch.empty(0, dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
    DT, PREC = dot_types(like)
    fp32 = dtype == "fp32"
    TDT = kd._triangular_type(like, DT, given_write_keys=False)
    BKF, BK, BV = kd._blocks(dk, dv, interpret=False)
    BVs = min(32 if fp32 else 64, dv)  # the sequential kernels' dv block with programs to spare (``_seq_bv``)
    # every pointer argument of these kernels: 16-bit tensors of the inputs' type, else float32 or int32
    ptr = {**dict.fromkeys(["q", "k", "kw", "w", "v", "beta", "wt", "ut", "h", "vnew", "o", "do", "du", "dh", "dq",
                            "dw", "dwt", "dk", "dv"], x),
           **dict.fromkeys(["g", "Gc", "A", "s0", "sT", "dsT", "ds0", "dgp", "dbeta", "dg", "rq", "rk"], f32),
           "chunks": i32, "cu": i32, "coff": i32}
    norms = kd.NORM_BACKWARD_IN_KERNELS and BKF <= 128 and not fp32
    base = dict(H=16, HK=16, K=dk, V=dv, C=chunk, BK=BK, BKF=BKF, BV=BV, NK=1, HAS_G=True, HAS_W=False,
                USE_S0=True, STORE_S=True, USE_DST=True, STORE_DS0=True, LOCAL_DU=False, NORM_Q=norms,
                NORM_K=norms, STORE_U=True, DT=DT, TDT=TDT, PREC=PREC)

    def compile_one(fn, opts, **over):
        sig, c = {}, {}
        for name in fn.arg_names:
            if name in ptr:
                sig[name] = ptr[name]
            elif name == "scale":
                sig[name] = "fp32"
            elif name == "TT":
                sig[name] = "i32"
            else:
                sig[name], c[name] = "constexpr", over.get(name, base[name])
        return measure(fn, sig, c, **{k: v for k, v in opts.items() if k in ("num_warps", "num_stages")})

    opts = lambda name: kd._opts(name, False, fp32)  # noqa: E731
    wide = {k: v for k, v in kd.DHU_WIDE_DV.items() if k != "BV"}
    return {
        "solve": compile_one(kd._fwd_solve_kernel, opts("solve")),
        "wu": compile_one(kd._fwd_wu_kernel, opts("wu")),
        f"h, dv blocks of {BVs}": compile_one(kd._fwd_h_kernel, opts("h"), BV=BVs),
        f"h, dv blocks of {BVs}, {kd.H_STAGES_MANY_PROGRAMS} stages": compile_one(
            kd._fwd_h_kernel, dict(opts("h"), num_stages=kd.H_STAGES_MANY_PROGRAMS), BV=BVs),
        "o": compile_one(kd._fwd_o_kernel, opts("o")),
        "dv_local": compile_one(kd._bwd_dv_local_kernel, opts("dv_local")),
        f"dhu, dv blocks of {BVs}": compile_one(kd._bwd_dhu_kernel, opts("dhu"), BV=BVs),
        f"dhu, dv blocks of {BVs}, local dU": compile_one(kd._bwd_dhu_kernel, opts("dhu"), BV=BVs, LOCAL_DU=True),
        **({f"dhu, dv blocks of {kd.DHU_WIDE_DV['BV']}{local}": compile_one(
            kd._bwd_dhu_kernel, wide, BV=kd.DHU_WIDE_DV["BV"], LOCAL_DU=bool(local))
            for local in ("", ", local dU")} if not fp32 and dv >= kd.DHU_WIDE_DV["BV"] else {}),
        "dqkw": compile_one(kd._bwd_dqkw_kernel, opts("dqkw"), BK=BKF if BKF <= 128 and not fp32 else 64),
        "wy": compile_one(kd._bwd_wy_kernel, opts("wy"), NK=1 if BKF <= 128 and not fp32 else BKF // 64),
    }


def delta_gluon_report(dk: int = 128, dv: int = 128, dtype: str = "bf16") -> dict:
    """The gated delta rule's Hopper kernels in Triton's Gluon dialect (``lazoo.kernels.delta_gluon``: the forward's
    and the backward's state walks) at their launch settings, gated and not, for q, k, v in ``dtype`` (β in q's dtype,
    G float32); empty where this Triton has no Gluon."""
    import torch

    from lazoo.kernels import delta_gluon as kg

    if kg.GLUON_ERROR is not None:
        return {}
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    x = f"*{dtype}"
    ptr = {**dict.fromkeys(["q", "k", "beta", "wt", "ut", "h", "vnew", "o"], x),
           **dict.fromkeys(["Gc", "s0", "sT"], "*fp32"), "cu": "*i32", "coff": "*i32"}
    fn = kg._fwd_walk_out_kernel
    report = {}
    for gated in (True, False):
        c = dict(H=16, HK=16, K=dk, V=dv, C=kg.CHUNK, BV=kg.WALK_BV, HAS_G=gated, USE_S0=True, STORE_S=True,
                 SAVE=True, num_warps=kg.WALK_WARPS, **kg.walk_layouts(dk, kg.WALK_BV, torch_dtype))
        sig = {n: ptr.get(n, "fp32" if n == "scale" else "constexpr") for n in fn.arg_names}
        report["training walk" + ("" if gated else ", ungated")] = measure(fn, sig, c, num_warps=kg.WALK_WARPS)
    report["walk without autograd"] = measure(fn, sig, dict(c, HAS_G=True, SAVE=False), num_warps=kg.WALK_WARPS)
    narrow = dict(c, BV=kg.WALK_NARROW_BV, HAS_G=True, **kg.walk_layouts(dk, kg.WALK_NARROW_BV, torch_dtype))
    report[f"training walk, dv blocks of {kg.WALK_NARROW_BV}"] = measure(fn, sig, narrow, num_warps=kg.WALK_WARPS)
    fn = kg._bwd_walk_kernel
    ptr.update({"do": x, "du": x, "dh": x, "dsT": "*fp32", "ds0": "*fp32"})
    sig = {n: ptr.get(n, "fp32" if n == "scale" else "constexpr") for n in fn.arg_names}
    for gated, bv in ((True, kg.WALK_BV), (False, kg.WALK_BV), (True, kg.WALK_NARROW_BV)):
        c = dict(H=16, HK=16, K=dk, V=dv, C=kg.CHUNK, BV=bv, HAS_G=gated, USE_DST=True, STORE_DS0=True,
                 num_warps=kg.WALK_WARPS, **kg.walk_layouts(dk, bv, torch_dtype))
        name = "backward walk" + ("" if gated else ", ungated") + ("" if bv == kg.WALK_BV else f", dv blocks of {bv}")
        report[name] = measure(fn, sig, c, num_warps=kg.WALK_WARPS)
    return report


def delta_fused_report(dk: int = 128, dtype: str = "bf16") -> dict:
    """The (gated) delta rule's fused forward (``lazoo.kernels.delta_fused``: a loader, a state and an output
    partition) without autograd at dv blocks of 64 and 128, gated and not, A in the dtype it runs with (fp32: tf32 A X)
    and in 16 bits, and for training (storing the chunk states and pseudo-values) at both blocks; empty where this
    Triton lacks what it needs. The registers are the kernel's limit (each partition then takes its own share: the
    output partition ``OUT_REGS`` or ``OUT_REGS_SAVE``, the loader ``LOAD_REGS``, the state the rest)."""

    from lazoo.kernels import delta_fused as kf

    if kf.FUSED_ERROR is not None:
        return {}
    from triton.experimental.gluon import language as gl

    def desc(cols, gdt, name):
        return f"tensordesc<{name}[{kf.CHUNK},{cols}],{gl.NVMMASharedLayout.get_default_for([kf.CHUNK, cols], gdt)!r}>"

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    fn = kf._fused_fwd_kernel
    report = {}
    for bv, gated, a, save in ((64, True, "fp32", False), (128, True, "fp32", False), (128, False, "fp32", False),
                               (128, True, dtype, False), (64, True, "fp32", True), (128, True, "fp32", True)):
        a_desc = desc(kf.CHUNK, gl.float32 if a == "fp32" else gdt, a)
        sig = {"q_d": desc(dk, gdt, dtype), "k_d": desc(dk, gdt, dtype), "v_d": desc(bv, gdt, dtype), "a_d": a_desc,
               "beta": f"*{dtype}", "Gc": "*fp32", "o": f"*{dtype}", "h": f"*{dtype}", "vnew": f"*{dtype}",
               "s0": "*fp32", "sT": "*fp32", "cu": "*i32", "coff": "*i32", "scale": "fp32"}
        sig.update({n: "constexpr" for n in fn.arg_names if n not in sig})
        c = dict(H=16, HK=16, K=dk, V=128, C=kf.CHUNK, BV=bv, HAS_G=gated, USE_S0=True, STORE_S=True, SAVE=save,
                 OUT_REGS=kf.OUT_REGS_SAVE if save else kf.OUT_REGS, LOAD_REGS=kf.LOAD_REGS,
                 num_warps=kf.PART_WARPS)
        name = f"dv blocks of {bv}" + ("" if gated else ", ungated") + f", A in {a}" + (", training" if save else "")
        report[name] = measure(fn, sig, c, num_warps=kf.PART_WARPS, maxnreg=kf.MAX_REGS)
    return report


def delta_chunk_bwd_report(dtype: str = "bf16") -> dict:
    """The (gated) delta rule's chunk-parallel backward (``lazoo.kernels.delta_chunk_bwd``) at dk = dv = 128, gated with
    and without the norms' backward inside, and ungated; empty where this Triton lacks what it needs."""
    import torch

    from lazoo.kernels import delta_chunk_bwd as kb

    if kb.CHUNK_BWD_ERROR is not None:
        return {}
    fn = kb._chunk_bwd_kernel
    lay = kb.layouts(128, 128, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    sig = {n: f"*{dtype}" for n in ("q", "k", "v", "beta", "h", "dh", "vnew", "do", "du", "dq", "dk", "dv")}
    sig.update({n: "*fp32" for n in ("Gc", "A", "dbeta", "dg", "rq", "rk")})
    sig.update({"chunks": "*i32", "cu": "*i32", "scale": "fp32"})
    sig.update({n: "constexpr" for n in fn.arg_names if n not in sig})
    report = {}
    for gated, norm in ((True, True), (True, False), (False, True)):
        c = dict(H=16, HK=16, K=128, V=128, C=kb.CHUNK, HAS_G=gated, NORM=norm, num_warps=kb.WARPS, **lay)
        name = ("gated" if gated else "ungated") + (", norms inside" if norm else "")
        report[name] = measure(fn, sig, c, num_warps=kb.WARPS)
    return report


def delta_solve_report(dtype: str = "bf16") -> dict:
    """The (gated) delta rule's per-chunk solve on Hopper (``lazoo.kernels.delta_solve``) at dk = 128, gated and not,
    A in fp32 (as the training kernels read it) and in q's dtype; empty where this Triton lacks what it needs."""
    import torch

    from lazoo.kernels import delta_solve as ks

    if ks.SOLVE_ERROR is not None:
        return {}
    fn = ks._solve_kernel
    lay = ks.layouts(128, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    report = {}
    for gated, a in ((True, "fp32"), (False, "fp32"), (True, dtype)):
        sig = {"k": f"*{dtype}", "beta": f"*{dtype}", "g": "*fp32", "Gc": "*fp32", "A": f"*{a}", "chunks": "*i32",
               "cu": "*i32"}
        sig.update({n: "constexpr" for n in fn.arg_names if n not in sig})
        c = dict(H=16, HK=16, K=128, C=ks.CHUNK, HAS_G=gated, num_warps=ks.WARPS, **lay)
        report[("gated" if gated else "ungated") + f", A in {a}"] = measure(fn, sig, c, num_warps=ks.WARPS)
    return report


class _FakeDevice:
    """A CUDA device for the launchers' option tables (which give the interpreter no options)."""

    type = "cuda"


def _opts(cfg: dict) -> dict:
    """The launch options of a ``_blocks`` entry (num_warps, num_stages) as ``measure`` takes them."""
    return {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}


def _print(title: str, report: dict) -> None:
    print(title)
    for name, r in report.items():
        over = "  OVER THE LIMIT" if r["shared"] > SHARED_LIMIT else ""
        race = f"  {r['inflight_refills']} REFILLS UNDER PRODUCTS IN FLIGHT" if r["inflight_refills"] else ""
        print(f"  {name:38s} shared {r['shared']:6d} B  registers {r['regs']}  "
              f"spill stores {r['spill_stores']} B{over}{race}")


def main() -> None:
    import triton

    _print(f"Triton {triton.__version__}, sm_90, short convolution (bf16, K = 4, C = 768):", short_conv_report())
    _print("OVQ (d = 128, chunk 128; assignments fp32, attention bf16, decode fp32):", ovq_report())
    _print("VLA's A scans (d = 128, fp32):", vla_report())
    _print("Normalised linear attention with 2 scalar features (d = 128, bf16):", normalized_report())
    _print("The same, non-causal:", normalized_report(causal=False))
    _print("Gated linear attention (d = 128, bf16):", linear_report())
    _print("Mamba-2 as gated linear attention at Bamba's shapes (128 heads of 64, state 128, one group, bf16; the "
           "output kernel at 64 heads a program, the gradient kernel at one):",
           linear_report(128, 64, heads=128, group=128, heads_per_program=64))
    _print("Mamba-2's dt·x and D skip (heads of 64, bf16):", ssd_io_report())
    _print("A decode step's input products (hidden 768, one row, bf16):", decode_linear_report())
    _print("GLA (d = 128, bf16):", gla_report())
    for dtype in ("bf16", "fp32"):
        _print(f"(Gated) delta rule without autograd (dk = dv = 128, {dtype}):", delta_prefill_report(dtype=dtype))
    _print("Gated delta rule's training kernels (dk = dv = 128, bf16):", delta_training_report())
    _print("Gated delta rule's Gluon kernels (dk = dv = 128, bf16):", delta_gluon_report())
    _print("(Gated) delta rule's fused forward without autograd (dk = dv = 128, bf16):", delta_fused_report())
    _print("(Gated) delta rule's chunk-parallel backward (dk = dv = 128, bf16):", delta_chunk_bwd_report())
    _print("(Gated) delta rule's solve on Hopper (dk = 128, bf16):", delta_solve_report())
    for dtype in ("bf16", "fp32"):
        _print(f"Kimi Delta Attention (dk = dv = 128, {dtype}, g and beta fp32):", kda_report(dtype=dtype))


if __name__ == "__main__":
    main()
