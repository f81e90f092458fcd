"""The ops ``lazoo.bench.kernels`` times (``kernel_ops()``): for each, how to make its inputs, how to call it (ours
and fla's), its FLOPs per token and head and the tensors it reads and writes. Adding an op is one entry.

The shapes: B·T = 32k tokens, H = 16, D = 128 at T = 1k, 8k and 32k, and D = 64 and 256 at T = 8k.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .delta_ops import delta_flops
from .inputs import with_head_decay

TOKENS = 32 * 1024
SHAPES = [(1024, 128), (8192, 128), (32768, 128), (8192, 64), (8192, 256)]  # (T, D); B = TOKENS // T
H = 16
CHUNK = 64


# ----------------------------------------------------------------------------- inputs
def qkv(B, T, H, D, dtype, device, gen):
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype, device=device, generator=gen) for _ in range(3))
    return {"q": q * D ** -0.5, "k": k * D ** -0.5, "v": v}


qkv_g = with_head_decay(qkv)


def qkv_gk(B, T, H, D, dtype, device, gen):
    x = qkv(B, T, H, D, dtype, device, gen)
    x["g"] = (F.logsigmoid(torch.randn(B, T, H, D, device=device, generator=gen)) / 16).to(dtype)
    return x


def kda_inputs(B, T, H, D, dtype, device, gen):
    """Kimi Delta Attention's: unit-norm q, k (the op's l2norm left out), β in (0, 1), and Kimi Linear's gate per key
    channel, −A·softplus(x + dt_bias) with A in [1, 16] a head and dt in [1e-3, 1e-1] log-uniform a channel, fp32."""
    x = qkv(B, T, H, D, torch.float32, device, gen)
    x = {"q": F.normalize(x["q"], dim=-1).to(dtype), "k": F.normalize(x["k"], dim=-1).to(dtype), "v": x["v"].to(dtype)}
    A = torch.empty(H, device=device).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(H, D, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    x["g"] = -A[:, None] * F.softplus(torch.randn(B, T, H, D, device=device, generator=gen) + dt_bias)
    x["beta"] = torch.rand(B, T, H, device=device, generator=gen).to(dtype)
    return x


def positive_qk(B, T, H, D, dtype, device, gen):
    """elu + 1 features of q, k (the normalised linear attention's default map), formed before the op."""
    x = qkv(B, T, H, D, torch.float32, device, gen)
    return {"q": (F.elu(x["q"]) + 1).to(dtype), "k": (F.elu(x["k"]) + 1).to(dtype), "v": x["v"].to(dtype)}


def unit_qk(B, T, H, D, dtype, device, gen):
    """Unit-norm q, k (RLS / MesaNet take them L2-normalised), a ridge λ = 1 per head and key dim."""
    x = qkv(B, T, H, D, torch.float32, device, gen)
    x = {"q": F.normalize(x["q"], dim=-1).to(dtype), "k": F.normalize(x["k"], dim=-1).to(dtype), "v": x["v"].to(dtype)}
    x["lam"] = torch.ones(H, D, device=device)
    return x


def qkv_householder(B, T, H, D, dtype, device, gen, n=2):
    """DeltaProduct inputs: n keys, values and betas per token ([B, T, H, n, D])."""
    x = qkv(B, T, H, D, dtype, device, gen)
    x["k"], x["v"] = (torch.randn(B, T, H, n, D, dtype=dtype, device=device, generator=gen) for _ in range(2))
    x["beta"] = torch.rand(B, T, H, n, device=device, generator=gen).to(dtype)
    return x


# ----------------------------------------------------------------------------- FLOPs and bytes
def recurrent_flops(D):
    """A fused recurrent pass with K = V = D: decay, outer product and read-out per token (~5 D²);
    backward: recompute, dq, dS update, dk, dv and its decay (~12 D²)."""
    return 5 * D * D, 12 * D * D


def chunk_flops(D, C=CHUNK):
    """(forward, backward) FLOPs per token and head of the chunked form with K = V = D, as executed
    (full C×C blocks): fwd QKᵀ, PV, QH, KᵀV; bwd dh, Aᵀ, dS, dSᵀ, three C×C products, four K×V."""
    fwd = 2 * C * (D + D) + 4 * D * D
    bwd = 6 * C * (D + D) + 8 * D * D
    return fwd, bwd


def bidirectional_flops(D):
    """The non-causal form's two products per token and head, Σ v ψ(k)ᵀ and S φ(q) (4 D²), and the backward's
    four."""
    return 4 * D * D, 8 * D * D


def io_bytes(B, T, H, D, dtype, n_fwd, n_bwd):
    """Bytes of the inputs and outputs, each read or written once (the floor, states excluded)."""
    size = B * T * H * D * torch.finfo(dtype).bits // 8
    return n_fwd * size, (n_fwd + n_bwd) * size


# ----------------------------------------------------------------------------- the ops
@dataclass
class Op:
    make: Callable                      # (B, T, H, D, dtype, device, gen) -> dict of inputs
    ours: Callable                      # inputs -> output tensor
    fla: Callable | None = None         # (fla module namespace, inputs) -> output tensor
    flops: Callable = chunk_flops       # D -> (fwd, bwd) FLOPs per token and head
    io: tuple = (4, 7)                  # tensors read/written by (fwd, bwd), for io_bytes
    grads: tuple = ("q", "k", "v")      # inputs that get gradients
    extra: dict = field(default_factory=dict)


def kernel_ops() -> dict[str, Op]:
    from lazoo import ops

    from .delta_ops import delta_ops

    return {
        **delta_ops(Op),
        "linear_attention": Op(
            make=qkv,
            ours=lambda x: ops.linear_attention(x["q"], x["k"], x["v"], feature_map="identity",
                                                normalize=False, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_linear_attn(x["q"], x["k"], x["v"], scale=1.0, normalize=False)[0],
        ),
        "linear_attention_normalized": Op(  # the normaliser inside the chunks (lazoo.kernels.normalized)
            make=positive_qk,
            ours=lambda x: ops.linear_attention(x["q"], x["k"], x["v"], feature_map="identity",
                                                normalize=True, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_linear_attn(x["q"], x["k"], x["v"], scale=1.0, normalize=True)[0],
        ),
        "gated_linear_attention": Op(
            make=qkv_g,
            ours=lambda x: ops.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], scale=1.0,
                                                      backend="triton")[0],
            fla=lambda fla, x: fla.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=1.0)[0],
            io=(5, 9),
            grads=("q", "k", "v", "g"),
        ),
        # the polynomial kernels: D features in the inputs' dtype and 1-2 fp32 scalar features a token, on the
        # normalised kernel (ops.ela's split form)
        "ela_sum_sq_euclid": Op(
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="sum_sq_euclid", backend="triton")[0],
        ),
        "ela_magnitude_direction": Op(
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="magnitude_direction", backend="triton")[0],
        ),
        "ela_hadamard_exp": Op(  # a running max per feature: a per-feature decay, through gla's kernels
            make=qkv,
            ours=lambda x: ops.ela(x["q"], x["k"], x["v"], kernel="hadamard_exp", backend="triton")[0],
            flops=recurrent_flops,
        ),
        # the non-causal forms (vision, Memory Lobe, encoders): every token sees every token, no state
        "linear_attention_bidirectional": Op(
            make=qkv,
            ours=lambda x: ops.bidirectional_linear_attention(x["q"], x["k"], x["v"], feature_map="elu1")[0],
            flops=bidirectional_flops,
        ),
        **{f"ela_{kernel}_bidirectional": Op(
            make=qkv,
            ours=lambda x, kernel=kernel: ops.ela(x["q"], x["k"], x["v"], kernel=kernel, causal=False,
                                                  backend="triton")[0],
            flops=bidirectional_flops,
        ) for kernel in ("sum_sq_euclid", "magnitude_direction", "hadamard_exp")},
        "delta_product": Op(  # two Householder steps per token: the delta rule over 2T steps
            make=qkv_householder,
            ours=lambda x: ops.delta_product(x["q"], x["k"], x["v"], x["beta"], backend="triton")[0],
            flops=lambda D: tuple(2 * f for f in chunk_flops(D)),
            grads=("q", "k", "v", "beta"),
        ),
        "rls": Op(  # exact ridge regression (γ = 1) vs fla's MesaNet (conjugate gradient, 30 iterations)
            make=unit_qk,
            ours=lambda x: ops.rls(x["q"], x["k"], x["v"], lam=x["lam"][:, 0], backend="triton")[0],
            fla=lambda fla, x: fla.chunk_mesa_net(
                x["q"], x["k"], x["v"], torch.zeros(x["q"].shape[:3], device=x["q"].device),
                torch.ones(x["q"].shape[:3], device=x["q"].device), x["lam"])[0],
            flops=recurrent_flops,
        ),
        "kda": Op(  # the gated delta rule with a decay per key channel (lazoo.kernels.kda; fla's chunk_kda)
            make=kda_inputs,
            ours=lambda x: ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=False,
                                   backend="triton")[0],
            fla=lambda fla, x: fla.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                             scale=x["q"].shape[-1] ** -0.5)[0],
            flops=delta_flops, io=(5, 9), grads=("q", "k", "v", "g", "beta"),
        ),
        "gla": Op(  # a gate per key dim: the op's Triton backend runs lazoo.kernels.gla.chunk_gla here
            make=qkv_gk,
            ours=lambda x: ops.gla(x["q"], x["k"], x["v"], x["g"], scale=1.0, backend="triton")[0],
            fla=lambda fla, x: fla.chunk_gla(x["q"], x["k"], x["v"], x["g"], scale=1.0)[0],
            io=(5, 9),
            grads=("q", "k", "v", "g"),
        ),
    }


def load_fla():
    """(a namespace of fla's functions for the ops, fla's version), or (None, why fla cannot be used here)."""
    try:
        import fla  # noqa: F401
        from fla.ops.gla import chunk_gla
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # not installed, or it refuses this GPU/Triton
        return None, f"{type(e).__name__}: {e}"
    from .delta_ops import add_fla_delta

    ns = argparse.Namespace(chunk_linear_attn=chunk_linear_attn, chunk_simple_gla=chunk_simple_gla,
                            chunk_gla=chunk_gla, chunk_mesa_net=None, chunk_kda=None)
    try:
        from fla.ops.mesa_net import chunk_mesa_net

        ns.chunk_mesa_net = chunk_mesa_net
    except Exception:  # older fla: no MesaNet
        pass
    try:
        from fla.ops.kda import chunk_kda

        ns.chunk_kda = chunk_kda
    except Exception:  # older fla: no KDA
        pass
    return add_fla_delta(ns), getattr(sys.modules["fla"], "__version__", "?")
