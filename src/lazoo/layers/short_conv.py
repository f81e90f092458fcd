"""Depthwise causal short convolution over time, with a cache of the last K-1 inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Conv1d):
    """`y_t = act(Σ_{i<K} w_i ⊙ x_{t−i})`, channels last: input and output `[B, T, C]`.

    Padded positions are zeroed before the convolution, so a left-padded sample sees the same
    zeros before its first token as it would unpadded. `state` holds the last K−1 inputs `[B, K−1, C]`.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__(channels, channels, kernel_size, groups=channels, padding=0, bias=False)
        self.activation = activation

    def forward(self, x, mask=None, state=None, output_state=False):
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        K = self.kernel_size[0]
        if state is None:
            state = x.new_zeros(x.shape[0], K - 1, x.shape[2])
        padded = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        y = F.conv1d(padded.transpose(1, 2), self.weight, groups=self.groups).transpose(1, 2)
        if self.activation == "silu":
            y = F.silu(y)
        new_state = padded[:, padded.shape[1] - (K - 1):] if output_state else None
        return y, new_state
