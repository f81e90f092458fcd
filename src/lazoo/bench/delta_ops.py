"""The delta-rule entries of ``lazoo.bench.kernels`` (lazoo.kernels.delta vs fla 0.6.0).

Training ops: ``delta_rule`` and ``gated_delta_rule`` on unit-norm q, k (so ours and fla both run the
kernel alone: ``use_qk_l2norm=False`` / ``use_qk_l2norm_in_kernel=False``), and ``delta_rule_l2norm``
with the L2 normalisation of q and k inside the timed region (ours in PyTorch, fla in its own kernel).
Decoding: one token against a state, B = 8, H = 16, D = 128, through CUDA-graph replays.
"""

from __future__ import annotations

import torch

from .inputs import head_decay, unit_qkv, with_head_decay
from .report import error_text
from .timing import cuda_graph_ms

CHUNK = 64


def qk_beta(B, T, H, D, dtype, device, gen):
    x = unit_qkv(B, T, H, D, dtype, device, gen)
    x["beta"] = torch.rand(B, T, H, device=device, generator=gen).to(dtype)
    return x


qk_beta_g = with_head_decay(qk_beta)


def raw_qk_beta(B, T, H, D, dtype, device, gen):
    x = qk_beta(B, T, H, D, dtype, device, gen)
    x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5  # not unit norm: the l2norm does work
    return x


def delta_flops(D, C=CHUNK):
    """(forward, backward) FLOPs per token and head of the WY chunk form as executed (K = V = D):
    fwd K Kᵀ, A K, A V, W~ Sᵀ, Kᵀ U, Q Sᵀ, Q Kᵀ, P U; bwd Pᵀ dO (2), dS (3), dP, dPᵀ, dO S, U dS',
    dU S, dq/dw intra (2), dA, dAᵀ (4), Aᵀ dU, Aᵀ dW~, the C³ triangle products, dk/dw through L."""
    fwd = 10 * C * D + 6 * D * D
    bwd = 28 * C * D + 12 * D * D + 8 * C * C
    return fwd, bwd


def delta_ops(Op):
    from lazoo import ops

    return {
        "delta_rule": Op(
            make=qk_beta,
            ours=lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], use_qk_l2norm=False,
                                          backend="triton")[0],
            fla=lambda fla, x: fla.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])[0],
            flops=delta_flops, io=(4, 7), grads=("q", "k", "v", "beta"),
        ),
        "gated_delta_rule": Op(
            make=qk_beta_g,
            ours=lambda x: ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=False,
                                                backend="triton")[0],
            fla=lambda fla, x: fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0],
            flops=delta_flops, io=(4, 7), grads=("q", "k", "v", "beta", "g"),
        ),
        "delta_rule_l2norm": Op(
            make=raw_qk_beta,
            ours=lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], backend="triton")[0],
            fla=lambda fla, x: fla.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"],
                                                    use_qk_l2norm_in_kernel=True)[0],
            flops=delta_flops, io=(4, 7), grads=("q", "k", "v", "beta"),
        ),
    }


def add_fla_delta(ns):
    """Add fla's delta-rule functions to the namespace ``kernel_ops.load_fla`` returns (if fla imports)."""
    if ns is None:
        return ns
    try:
        from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"fla delta rule unavailable: {type(e).__name__}: {e}")
        return ns
    ns.chunk_delta_rule, ns.chunk_gated_delta_rule = chunk_delta_rule, chunk_gated_delta_rule
    ns.fused_recurrent_delta_rule = fused_recurrent_delta_rule
    ns.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    return ns


def bench_decode_delta(device, dtype, fla=None, D=128, B=8, H=16):
    """ms per decoding step (one token against the state), CUDA-graph replays: our ops (l2norm of q, k
    and the state update in one kernel), our kernel, fla's fused recurrent kernels."""
    from lazoo import ops
    from lazoo.kernels.delta import fused_recurrent_delta_rule

    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(B, 1, H, D, dtype=dtype, device=device, generator=gen) for _ in range(3))
    beta = torch.rand(B, 1, H, device=device, generator=gen).to(dtype)
    g = head_decay(B, 1, H, dtype, device, gen)
    S = torch.randn(B, H, D, D, device=device, generator=gen)
    state_bytes = 2 * S.numel() * 4
    out = {}
    with torch.no_grad():
        out["ours_delta_op_ms"] = cuda_graph_ms(lambda: ops.delta_rule(q, k, v, beta, initial_state=S,
                                                                       output_final_state=True, backend="triton"))
        out["ours_gated_delta_op_ms"] = cuda_graph_ms(lambda: ops.gated_delta_rule(
            q, k, v, g, beta, initial_state=S, output_final_state=True, backend="triton"))
        out["ours_gated_delta_kernel_ms"] = cuda_graph_ms(lambda: fused_recurrent_delta_rule(
            q, k, v, beta, g, scale=D ** -0.5, initial_state=S, output_final_state=True, use_qk_l2norm=True))
        out["ours_gated_delta_kernel_GBps"] = state_bytes / out["ours_gated_delta_kernel_ms"] / 1e6
        if fla is not None and hasattr(fla, "fused_recurrent_delta_rule"):
            for name, fn in [
                ("fla_delta_fused_recurrent_ms", lambda: fla.fused_recurrent_delta_rule(
                    q, k, v, beta, initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True)),
                ("fla_gated_delta_fused_recurrent_ms", lambda: fla.fused_recurrent_gated_delta_rule(
                    q, k, v, g, beta, initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True)),
            ]:
                try:
                    out[name] = cuda_graph_ms(fn)
                except Exception as e:  # noqa: BLE001
                    out[name] = error_text(e, limit=160)
    print(f"decode, delta rule: B={B} H={H} D={D}, one token against the state (independent of the context "
          "length), CUDA graph, ms per step:")
    for key, val in out.items():
        print(f"  {key:36s} {val if isinstance(val, str) else f'{val:.4f}'}")
    return out
