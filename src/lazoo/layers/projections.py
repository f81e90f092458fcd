"""Several linear projections of one input in one matrix product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _plain(m: nn.Module) -> bool:
    """A plain `nn.Linear` without forward hooks: its product is F.linear of its weight and bias (not an adapter
    such as LoRA, a quantized weight or a hooked module, which must run as themselves)."""
    return type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks)


def plain_weights(linears: list[nn.Module]) -> list[torch.Tensor] | None:
    """The weights of ``linears`` where every one is plain (``_plain``) and has no bias (what a one-launch product may
    read in their place), else None."""
    if all(_plain(m) and m.bias is None for m in linears):
        return [m.weight for m in linears]
    return None


def project_together(x: torch.Tensor, linears: list[nn.Module], one_launch: bool = False) -> list[torch.Tensor]:
    """`[m(x) for m in linears]`, as one product with their weights stacked when every one is a plain `nn.Linear`
    without forward hooks (an adapter such as LoRA, a quantized weight or a hook: those run one by one). A decode
    step is a handful of tiny products whose launch latency, not their work, sets the time, and a training step of
    a few thousand tokens is paced by the host's time per op: one product in place of several saves most of it,
    for the cost of stacking the weights (one copy, since they may change between steps). The outputs are views of
    one tensor (rows of stride = the summed widths).

    ``one_launch`` (a decode step whose fused kernel runs, so Triton does): the products in one launch of
    `lazoo.kernels.decode_linear` with every weight and bias read where it is, no copy, where that kernel takes them
    (a few rows, plain modules). Not while torch.compile traces: inductor copies every weight this launch reads
    (104 µs of a ~145M model's compiled step on an H200, against 66 µs for its fused copy of the stacked weights)."""
    plain = all(_plain(m) for m in linears)
    if one_launch and plain and not torch.compiler.is_compiling():
        from ..kernels import decode_linear  # lazy: importing defines the kernels

        weights, biases = [m.weight for m in linears], [m.bias for m in linears]
        if decode_linear.check_supported(x, weights, biases) is None:
            return decode_linear.launch_many(x, weights, biases)
    if not plain:
        return [m(x) for m in linears]  # an adapter, a quantized weight or a hook: each module as it is
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    return list(F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1))
