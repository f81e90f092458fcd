"""Launch settings the kernel modules share: the first config that fits the GPU, block sizes, operand and state
dtypes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2, num_sms

#: key -> the index of the first config that fitted (``launch_first_fitting``)
_CONFIG_INDEX: dict = {}


def launch_first_fitting(kernel, grid, key, configs, *args, **meta):
    """Launch with the first of ``configs`` (meta-parameters) that fits the GPU's resources, remembering it per
    ``key`` (no benchmarking: device time is scarce, and shapes vary). ``grid(config)`` gives the grid; keys are
    shared by every module, so they name their kernel."""
    from triton.runtime.errors import OutOfResources

    if torch.compiler.is_compiling():  # traced: the config found eagerly (a traced launch cannot be retried)
        config = configs[_CONFIG_INDEX.get(key, 0)]
        kernel[grid(config)](*args, **meta, **config)
        return config
    for i in range(_CONFIG_INDEX.get(key, 0), len(configs)):
        try:
            kernel[grid(configs[i])](*args, **meta, **configs[i])
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _CONFIG_INDEX[key] = i
        return configs[i]


def dqkv_configs(BK: int, V: int, two_byte: bool, first_bv: int = 64) -> list[dict]:
    """Launch settings, best first, of a chunk kernel that holds a chunk's whole key rows (BK wide) and walks the
    values in blocks of BV (the dq, dk, dv kernels): smaller value blocks where the first does not fit."""
    warps = 8 if BK >= 128 else 4
    return [dict(BV=min(first_bv if two_byte or BK <= 64 else 32, next_pow2(V)), num_warps=warps, num_stages=1),
            dict(BV=min(32, next_pow2(V)), num_warps=warps, num_stages=1),
            dict(BV=16, num_warps=8, num_stages=1)]


def dot_types(x: torch.Tensor):
    """(Triton dot-operand dtype, precision of fp32 products) for inputs of x's dtype."""
    if x.dtype == torch.float32:
        return tl.float32, "tf32x3"  # three tf32 passes: about fp32 accuracy on the tensor cores
    return (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16), "tf32"


def chunk_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-chunk states' dtype for inputs of ``dtype``: bf16 states keep the fp32 range and halve their
    traffic; fp16 could overflow."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def state_blocks(K: int, V: int, max_block: int = 64):
    """(BK, BV) for the sequential state kernels. (Value blocks of 32 where the tiles of 64 gave an SM fewer than two
    programs made the walks slower on an H100: ELA sum_sq_euclid fwd + bwd at T = 8k 2.694 against 2.490 ms, linear
    attention at 32k 1.779 against 1.720; GLA within 1 % either way.)"""
    return min(max_block, next_pow2(K)), min(max_block, next_pow2(V))


def fill_device(BV: int, V: int, parallel: int, device: torch.device, per_sm: float = 2) -> int:
    """The value block BV of a kernel run by ``parallel * cdiv(V, BV)`` programs, halved (down to 16) until
    there are ``per_sm`` programs per multiprocessor: few sequences x heads would leave most of the GPU idle."""
    while BV > 16 and parallel * triton.cdiv(V, BV) < per_sm * num_sms(device):
        BV //= 2
    return BV
