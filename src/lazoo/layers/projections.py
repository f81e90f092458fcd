"""Several linear projections of one input in one matrix product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def project_together(x: torch.Tensor, linears: list[nn.Module]) -> list[torch.Tensor]:
    """`[m(x) for m in linears]`, as one product with their weights stacked when every one is a plain `nn.Linear`
    (no adapter such as LoRA, no quantized weight: those run one by one). A decode step is a handful of tiny
    products whose launch latency, not their work, sets the time: one product in place of six saves most of it,
    for the cost of stacking the weights (one copy, since they may change between steps). The outputs are views of
    one tensor (rows of stride = the summed widths)."""
    if not all(type(m) is nn.Linear for m in linears):
        return [m(x) for m in linears]
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    return list(F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1))
