"""Depthwise causal short convolution over time, with a cache of the last K-1 inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.backend import resolve_backend, triton_missing
from ..ops.packing import packed_offsets, packed_row_starts

#: packed sequences take the kernel's packed form (where the Triton backend runs), else the masked PyTorch form.
#: H200, bf16, C = 2048, 16k tokens packed as 32 x 512, 4 x 4096 or 12k + 8 x 512: forward + backward GPU time 0.23 ms
#: against 2.43 for the PyTorch form (the batched kernel on the same tokens: 0.17); the ~125M Gated DeltaNet's packed
#: training step (32 x 512) 116-126 -> 79-80 ms (``experiments/short_conv_packed.py``)
PACKED_KERNEL = True


class ShortConvolution(nn.Conv1d):
    """`y_t = act(Σ_{i<K} w_i ⊙ x_{t−i} + b)`, channels last: input and output `[B, T, C]`; the bias `b` only
    with `bias=True` (the Triton kernel has none: a convolution with a bias runs `conv1d`).

    Padded positions are set to zero before the convolution, whatever they hold (NaN and inf included), so a
    left-padded sample sees the same zeros before its first token as it would unpadded. `state` holds the last K−1
    inputs `[B, K−1, C]`.
    Packed sequences (`cu_seqlens` `[N + 1]`, B = 1): a position sees only the inputs of its own sequence,
    as if each sequence ran alone from a zero state (no state in or out): the kernel's packed form (it reads each
    position's sequence start) where the Triton backend runs, else the masked PyTorch form.

    Backends (`backend=` of `forward`, resolved like every op's by `lazoo.ops.backend.resolve_backend`, so
    `LAZOO_BACKEND` reaches it): "triton" runs the kernel of `lazoo.kernels.short_conv` (CUDA, or the CPU
    under `TRITON_INTERPRET=1`), "recurrent" and "chunk" PyTorch's `conv1d`; None (auto) takes the kernel
    on CUDA tensors whenever it can run the call (`triton_unsupported`), `conv1d` otherwise. With a cached
    state (decoding), the kernel runs over the K−1 cached inputs followed by the new ones.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu", bias: bool = False):
        super().__init__(channels, channels, kernel_size, groups=channels, padding=0, bias=bias)
        self.activation = activation

    def forward(self, x, mask=None, state=None, output_state=False, cu_seqlens=None, backend=None):
        if cu_seqlens is not None:
            if state is not None or output_state or mask is not None:
                raise ValueError("ShortConvolution: packed sequences (cu_seqlens) take no mask and no state")
            if PACKED_KERNEL and x.shape[0] == 1 and resolve_backend(
                    "ShortConvolution", backend, x.device, self.triton_unsupported(x), log_fallback=False) == "triton":
                from ..kernels.short_conv import short_conv

                starts = packed_row_starts(cu_seqlens, x.shape[1], x.device)
                return short_conv(x, self.weight, self.activation, starts=starts), None
            return self._packed(x, cu_seqlens), None
        # conv1d is as good a path as the kernel wherever the kernel cannot run: nothing worth a warning
        backend = resolve_backend("ShortConvolution", backend, x.device, self.triton_unsupported(x),
                                  log_fallback=False)
        if mask is not None:  # a select, not a product: 0 · NaN at a pad would be NaN in its neighbours
            x = x.masked_fill(~mask[..., None].bool(), 0)
        K = self.kernel_size[0]
        if state is None and backend == "triton":  # the kernel starts from zeros: no inputs to prepend
            from ..kernels.short_conv import short_conv

            return short_conv(x, self.weight, self.activation), (self._last_inputs(x) if output_state else None)
        if state is None:
            state = x.new_zeros(x.shape[0], K - 1, x.shape[2])
        padded = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        new_state = padded[:, padded.shape[1] - (K - 1):] if output_state else None
        if backend == "triton":  # a cached state: the kernel over the K-1 cached inputs and the new ones
            from ..kernels.short_conv import short_conv

            return short_conv(padded, self.weight, self.activation)[:, K - 1:], new_state
        y = F.conv1d(padded.transpose(1, 2), self.weight, self.bias, groups=self.groups).transpose(1, 2)
        if self.activation == "silu":
            y = F.silu(y)
        return y, new_state

    def triton_unsupported(self, x) -> str | None:
        """Why the Triton kernel cannot run on `x` (None when it can), known before any launch: Triton
        missing, the device, then the kernel's own checks (activation, dtype, kernel size, shape)."""
        if triton_missing():
            return triton_missing()
        try:
            from ..kernels._utils import device_unsupported
        except ImportError as err:  # a broken Triton install, or an exported model folder (no kernels there)
            return str(err)
        reason = device_unsupported(x)
        if reason:
            return reason
        if self.bias is not None:
            return "the short-convolution kernel has no bias"
        from ..kernels.short_conv import check_supported  # defines the kernels: only where they can run

        return check_supported(x, self.kernel_size[0], self.activation)

    def _last_inputs(self, x):
        """The state to hand on: the last K − 1 inputs, zeros before a short sequence."""
        K, T = self.kernel_size[0], x.shape[1]
        return F.pad(x[:, max(0, T - (K - 1)):], (0, 0, max(0, K - 1 - T), 0))

    def _packed(self, x, cu_seqlens):
        """`y_t = act(Σ_{s<K} w_{K−1−s} ⊙ x_{t−s})` over the `s` that stay inside t's own sequence."""
        K, T = self.kernel_size[0], x.shape[1]
        offsets = packed_offsets(cu_seqlens.to(x.device), T)  # [T]: position within its sequence
        w = self.weight[:, 0, :].to(x.dtype)  # [C, K]; conv1d's tap j multiplies x_{t−(K−1−j)}
        y = x * w[:, K - 1]
        for s in range(1, min(K, T)):
            shifted = F.pad(x[:, : T - s], (0, 0, s, 0))  # x_{t−s}, zeros before the start
            keep = (offsets >= s).to(x.dtype)[None, :, None]
            y = y + shifted * keep * w[:, K - 1 - s]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.activation == "silu":
            y = F.silu(y)
        return y
