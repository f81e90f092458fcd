"""When a mixer's decode step runs as one fused kernel (`lazoo.kernels.delta_step`, `lazoo.kernels.mamba2_step`).

A mixer with such a step has a class attribute `fused_decode`: None (the default) where its op would run its Triton
kernels (CUDA by default, or as the `backend` option and `LAZOO_BACKEND` say); True wherever the kernel can run (the
CPU under the Triton interpreter, float64 there too); False never. `LAZOO_FUSED_DECODE=0`, set before lazoo is
imported, makes False the default, so that benchmarks can time the unfused step."""

from __future__ import annotations

import logging
import os

import torch

from ...kernels.limits import DELTA_STEP_MAX_HEAD_DIM, KERNEL_DTYPES
from ...ops.backend import resolve_backend, triton_unsupported

logger = logging.getLogger(__name__)

#: the default of the mixers' `fused_decode` switch
FUSED_DECODE_DEFAULT: bool | None = False if os.environ.get("LAZOO_FUSED_DECODE") == "0" else None

_FALLBACK_LOGGED: set[str] = set()


def fused_decode_runs(switch: bool | None, kernel: str, x: torch.Tensor, backend: str | None) -> bool:
    """Whether the fused step `kernel` may run a decode step on `x` by the mixer's switch `fused_decode` (module
    docstring): never with autograd on; otherwise Triton's presence, `x`'s dtype and device. The caller checks the
    options its kernel computes."""
    if switch is False or torch.is_grad_enabled():
        return False
    one = x[..., :1]  # the dtype and device checks
    if switch:
        dtypes = KERNEL_DTYPES + ((torch.float64,) if x.device.type == "cpu" else ())
        return triton_unsupported(one, one, 1, dtypes) is None
    unsupported = triton_unsupported(one, one, 1, KERNEL_DTYPES)
    return resolve_backend(kernel, backend, x.device, unsupported, log_fallback=False) == "triton"


def delta_step_layout(mixer) -> bool:
    """Whether `lazoo.kernels.delta_step` computes a delta-rule mixer's layout: SiLU short convolutions on q, k and v
    (no activation after them), q and k with their own heads and value heads a multiple of them, head dims within
    the kernel's limit."""
    conv = mixer.short_conv
    return (conv is not None and set(conv.convs) == set("qkv") and not mixer._post_activation
            and mixer.options["conv_size"] >= 2 and all(c.activation == "silu" for c in conv.convs.values())
            and mixer.num_kv_heads == mixer.num_heads and mixer.num_state_heads == mixer.num_v_heads
            and max(mixer.head_dim, mixer.head_v_dim) <= DELTA_STEP_MAX_HEAD_DIM)


def delta_step_state(mixer, entry: dict, in_place: bool) -> tuple:
    """What `lazoo.kernels.delta_step` takes of a delta-rule mixer besides its projections: (the cached conv states,
    the conv weights, the conv biases or None, the state S (contiguous; the cached tensor itself in place))."""
    convs = mixer.short_conv.convs
    S = entry["op"] if in_place else entry["op"].contiguous()
    biases = {n: c.bias for n, c in convs.items()} if mixer.options["conv_bias"] else None
    return entry["conv"], {n: c.weight for n, c in convs.items()}, biases, S


def log_unfused_once(kernel: str, reason: str) -> None:
    """Say once per kernel why a layer that could have decoded with it keeps the unfused step."""
    if kernel not in _FALLBACK_LOGGED and not torch.compiler.is_compiling():
        _FALLBACK_LOGGED.add(kernel)
        logger.warning("%s: %s; decoding with the unfused step.", kernel, reason)
