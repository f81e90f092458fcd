"""The (gated) delta rule's forward without autograd with no ``_fwd_mix``: a walk over each sequence's chunks that reads
A (``lazoo.kernels.delta``'s solve) and forms the chunk's products itself, against lazoo's prefill (solve, mix, walk).

lazoo's prefill writes M = tril(E ⊙ Q Wᵀ) A and Y = Aᵀ diag(D) W for every chunk in a parallel kernel, then walks
(four products a chunk). This walk skips that round trip through memory and does six: with the start state S
(held as Sᵀ [dk, dv]) and W = β k,

    X = V − Γ K Sᵀ,   U = A X,   O = scale (Γ Q Sᵀ + (tril(E ⊙ Q Kᵀ) diag(β)) U),   Sᵀ' = γ_C Sᵀ + Kᵀ diag(β D) U

(the chunk form of ``lazoo.kernels.delta``'s docstring; FlashQLA's fused forward, too, reads A, not M and Y). The
two extra products (Q Kᵀ, which does not depend on the state, and A X) are the price of the mix kernel's reads and
writes. ``--a-operand`` sets U = A X's operands: 16bit (the inputs' type: A rounded as it enters, as FlashQLA stores
it in bf16) or fp32 (tf32).

    PYTHONPATH=src python experiments/fused_prefill_walk.py [--a-operand 16bit|fp32] [--launch W:S:BV,...] [--out F]

on a CUDA GPU prints (and writes) JSON lines: the forward's max relative error against the float64 chunk form
(T = 2048, B = 2, HV = H and 2H) of lazoo's op and of each walk launch, then forward medians at the frontier's shapes
(``lazoo.bench.delta_frontier.SHAPES``) for the gated and the plain rule, all timed in turns, two rounds. Compiled
offline for sm_90 by Triton 3.6 (``lazoo.bench.kernel_resources.measure``) the walk takes 255 registers a thread at
every launch and spills 44-324 bytes at dv blocks of 64 (4 or 8 warps, 2 or 3 stages: its state, U, P, O and the
chunk's q and k tiles live at once; 44 at 8 warps and 3 stages with fp32 A operands), 4-68 at blocks of 32.
``fused_prefill`` is the op (the CPU tests run it under the Triton interpreter against the float64 recurrence).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from lazoo.kernels import delta as kd
from lazoo.kernels._delta_tiles import dot_acc, gate, load_raw, load_tile, load_vec
from lazoo.kernels._launch import dot_types
from lazoo.kernels._tiles import dot
from lazoo.kernels.delta import _state_program, _store_tile

C = 64  # rows a chunk


@triton.jit
def _walk_from_a_kernel(
    q, k, v, beta, Gc, A, o, s0, sT, cu, coff, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, USE_S0: tl.constexpr, STORE_S: tl.constexpr,
    DT: tl.constexpr, ADT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (N, H, NV): one sequence, value head and dv block, its chunks in order (module docstring)."""
    scale = tl.cast(scale, tl.float32)
    i_nh, i_h, i_v, bos, eos, _, NTn, m_s, p_end, _ = _state_program(cu, coff, H, K, V, C, BKF, BV)
    i_hk = i_h // (H // HK)
    o_c = tl.arange(0, C)
    tril = o_c[:, None] >= o_c[None, :]
    b_s = tl.zeros([BKF, BV], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + i_nh * V * K + p_end, mask=m_s, other=0).to(tl.float32)
    for j in range(0, NTn):
        t0 = bos + j * C
        # in the order that keeps the fewest [C, BV] and [C, C] tiles live beside the state (registers: module
        # docstring): U first, then P, then O
        b_k = load_raw(k + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
        b_b = load_vec(beta + i_h, t0, eos, H, C)
        b_ks = dot(b_k, b_s, DT, PREC)
        if HAS_G:
            b_G, g_last = gate(Gc, i_h, t0, eos, H, C)
            e_G = tl.exp(b_G)[:, None]
            b_ks = b_ks * e_G
        b_x = load_tile(v + i_h * V, t0, eos, H * V, i_v * BV, V, C, BV) - b_ks
        b_u = dot(load_raw(A + i_h * C, t0, eos, H * C, 0, C, C, C), b_x, ADT, PREC)  # U = A X
        if HAS_G:
            b_d = b_b * tl.exp(g_last - b_G)
        else:
            b_d = b_b
        b_ud = (b_u * b_d[:, None]).to(DT)  # both of U's uses take it in DT: half the registers from here
        b_u = b_u.to(DT)
        b_q = load_raw(q + i_hk * K, t0, eos, HK * K, 0, K, C, BKF)
        b_p = dot(b_q, tl.trans(b_k), DT, PREC)
        if HAS_G:
            b_p = tl.where(tril, b_p * tl.exp(tl.where(tril, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        else:
            b_p = tl.where(tril, b_p, 0.0)
        b_o = dot(b_q, b_s, DT, PREC)
        if HAS_G:
            b_o = b_o * e_G
        b_o = dot_acc((b_p * b_b[None, :]).to(DT), b_u, b_o, DT, PREC) * scale
        _store_tile(o + i_h * V, b_o, t0, eos, H * V, i_v * BV, V, C, BV)
        if HAS_G:
            b_s = b_s * tl.exp(g_last)
        b_s = dot_acc(tl.trans(b_k), b_ud, b_s, DT, PREC)
    if STORE_S:
        tl.store(sT + i_nh * V * K + p_end, b_s, mask=m_s)


def fused_prefill(q, k, v, beta, g=None, *, scale: float, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm: bool = True, a_operand: str = "fp32", launch: dict | None = None):
    """The (gated) delta rule's forward, ``lazoo.ops.gated_delta_rule``'s layout (q, k ``[B, T, HK, dk]``, v
    ``[B, T, H, dv]`` with H = m·HK, β and g ``[B, T, H]``, states ``[N, H, dv, dk]`` float32), by A's solve and
    this file's walk. ``launch``: the walk's ``num_warps``, ``num_stages`` and dv block ``BV`` (each optional;
    default lazoo's walk's). Returns ``(o, final state or None)``."""
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    dev = q.device
    interp = dev.type == "cpu"
    TT = B * T
    seqs = kd.seqs_for(B, T, cu_seqlens, C, dev)
    qf, kf = q.reshape(TT, HK, K).contiguous(), k.reshape(TT, HK, K).contiguous()
    if use_qk_l2norm:
        qf, _, kf, _ = kd.l2norm_fwd(qf, kf)
    vf = v.reshape(TT, H, V).contiguous()
    bf = beta.reshape(TT, H).contiguous()
    gf = None if g is None else g.reshape(TT, H).contiguous()
    DT, PREC = dot_types(qf)
    FP32 = qf.dtype == torch.float32
    BKF = kd._blocks(K, V, interp)[0]
    f32 = torch.float32
    Gc, A = kd.fwd_solve(kf, bf, gf, seqs, C, H, V, f32)
    Gc = Gc if gf is not None else bf
    o = torch.empty(TT, H, V, device=dev, dtype=v.dtype)
    sT = torch.empty(seqs.N, H, V, K, device=dev, dtype=f32) if output_final_state else A
    S0 = None if initial_state is None else initial_state.contiguous()
    launch = dict(launch or {})
    BV = launch.pop("BV", None) or kd._walk_bv(V, seqs.N * H, dev, interp, FP32)
    opts = {} if interp else {**kd._opts("walk", interp, FP32), **launch}
    ADT = DT if a_operand == "16bit" and not FP32 else tl.float32
    _walk_from_a_kernel[(seqs.N, H, triton.cdiv(V, BV))](
        qf, kf, vf, bf, Gc, A, o, S0 if S0 is not None else A, sT, seqs.cu, seqs.coff, float(scale),
        H=H, HK=HK, K=K, V=V, C=C, BKF=BKF, BV=BV, HAS_G=gf is not None, USE_S0=S0 is not None,
        STORE_S=output_final_state, DT=DT, ADT=ADT, PREC=PREC, **opts)
    return o.view(B, T, H, V), (sT if output_final_state else None)


def main(argv=None):
    from lazoo import ops
    from lazoo.bench.delta_frontier import SHAPES, make_inputs
    from lazoo.bench.timing import call_ms

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a-operand", choices=["16bit", "fp32"], default="fp32")
    p.add_argument("--launch", default="4:3:auto,8:3:auto,4:3:32,8:3:32",
                   help="the walk's launches to time, comma-separated WARPS:STAGES:BV (BV 'auto': lazoo's walk's)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    launches = {}
    for item in args.launch.split(","):
        w, st, bv = item.split(":")
        launches[f"fused {item}"] = dict(num_warps=int(w), num_stages=int(st),
                                         **({} if bv == "auto" else {"BV": int(bv)}))
    if not torch.cuda.is_available():
        raise SystemExit("fused_prefill_walk: needs a CUDA GPU")
    out = open(args.out, "a") if args.out else None

    def emit(**rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, a_operand=args.a_operand)
    scale = 128 ** -0.5

    def run(impl, x, gated):
        g = x["g"] if gated else None
        if impl == "lazoo":
            if gated:
                return ops.gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], scale=scale, backend="triton")[0]
            return ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], scale=scale, backend="triton")[0]
        return fused_prefill(x["q"], x["k"], x["v"], x["beta"], g, scale=scale, a_operand=args.a_operand,
                             launch=launches[impl])[0]

    impls = ["lazoo", *launches]
    with torch.no_grad():
        for HV in (16, 32):
            x = make_inputs(2048, 2, 16, HV, torch.bfloat16, "cuda", seed=3)
            o64 = ops.gated_delta_rule(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), scale=scale,
                                       backend="chunk")[0]
            for impl in impls:
                try:
                    err = (run(impl, x, True).double() - o64).abs().max() / o64.abs().max()
                    err = float(f"{err.item():.3g}")
                except Exception as e:  # noqa: BLE001 - a launch that does not fit its shared memory
                    err = f"{type(e).__name__}: {e}"[:200]
                emit(check="forward error vs float64, gated, T = 2048, B = 2", HV=HV, impl=impl, err=err)
    for rnd in range(2):
        for gated in (True, False):
            for T, B, H, HV in SHAPES:
                if not gated and HV != H:
                    continue
                x = make_inputs(T, B, H, HV, torch.bfloat16, "cuda", seed=0)
                times = {}
                for impl in impls:
                    try:
                        times[impl] = round(call_ms(lambda: run(impl, x, gated), rep=200), 4)
                    except Exception as e:  # noqa: BLE001
                        times[impl] = f"{type(e).__name__}: {e}"[:200]
                emit(round=rnd, op="gated_delta_rule" if gated else "delta_rule", T=T, B=B, H=H, HV=HV, fwd_ms=times)
    if out:
        out.close()


if __name__ == "__main__":
    main()
