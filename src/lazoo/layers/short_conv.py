"""Depthwise causal short convolution over time, with a cache of the last K-1 inputs."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common import packed_offsets, triton_missing

logger = logging.getLogger(__name__)

#: "auto": the Triton kernel (lazoo.kernels.short_conv) for CUDA inputs without a state, conv1d otherwise;
#: "triton": the kernel wherever it runs (CPU under TRITON_INTERPRET=1, for tests); "torch": always conv1d
KERNEL = "auto"
_kernel_failed = False


class ShortConvolution(nn.Conv1d):
    """`y_t = act(Σ_{i<K} w_i ⊙ x_{t−i})`, channels last: input and output `[B, T, C]`.

    Padded positions are zeroed before the convolution, so a left-padded sample sees the same
    zeros before its first token as it would unpadded. `state` holds the last K−1 inputs `[B, K−1, C]`.
    Packed sequences (`cu_seqlens` `[N + 1]`, B = 1): a position sees only the inputs of its own sequence,
    as if each sequence ran alone from a zero state (no state in or out).
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__(channels, channels, kernel_size, groups=channels, padding=0, bias=False)
        self.activation = activation

    def forward(self, x, mask=None, state=None, output_state=False, cu_seqlens=None):
        if cu_seqlens is not None:
            if state is not None or output_state or mask is not None:
                raise ValueError("ShortConvolution: packed sequences (cu_seqlens) take no mask and no state")
            return self._packed(x, cu_seqlens), None
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        K = self.kernel_size[0]
        if state is None and self._kernel_wanted(x):
            y = self._kernel(x)
            if y is not None:
                new_state = None
                if output_state:  # the last K − 1 inputs, zeros before a short sequence
                    new_state = F.pad(x[:, max(0, x.shape[1] - (K - 1)):], (0, 0, max(0, K - 1 - x.shape[1]), 0))
                return y, new_state
        if state is None:
            state = x.new_zeros(x.shape[0], K - 1, x.shape[2])
        padded = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        y = F.conv1d(padded.transpose(1, 2), self.weight, groups=self.groups).transpose(1, 2)
        if self.activation == "silu":
            y = F.silu(y)
        new_state = padded[:, padded.shape[1] - (K - 1):] if output_state else None
        return y, new_state

    @staticmethod
    def _kernel_wanted(x) -> bool:
        if _kernel_failed or KERNEL == "torch":
            return False
        if triton_missing():
            if KERNEL == "triton":
                raise RuntimeError(f"lazoo.layers.short_conv.KERNEL = 'triton', but {triton_missing()}")
            return False
        return KERNEL == "triton" or x.is_cuda

    def _kernel(self, x):
        """The Triton kernel's output, or None (and conv1d from then on, said once) if it cannot run here."""
        global _kernel_failed
        from ..kernels import short_conv as ksc

        if ksc.check_supported(x, self.kernel_size[0]) is not None:  # e.g. float64: conv1d, as on the CPU
            return None
        try:
            return ksc.short_conv(x, self.weight, self.activation)
        except Exception as err:  # noqa: BLE001  (a compile or launch failure on this GPU / Triton)
            why = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            logger.warning("ShortConvolution: the Triton kernel failed (%s); using conv1d from now on", why)
            _kernel_failed = True
            return None

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
        if self.activation == "silu":
            y = F.silu(y)
        return y
