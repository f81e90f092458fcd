"""Feed-forward blocks: the gated MLP (SwiGLU by default) and the plain two-matrix MLP, with a choice of activation.

    gated   y = down(act(gate(x)) · up(x))        gate_proj, up_proj [I, D], down_proj [D, I]
    plain   y = down(act(up(x)))                  up_proj [I, D], down_proj [D, I]

`ACTIVATIONS` names the activations by transformers' names (`hidden_act`): "silu", "gelu" (exact), "gelu_pytorch_tanh"
(the tanh approximation), "relu" and "relu2" (relu squared, of "Primer: Searching for Efficient Transformers for
Language Modeling", So et al., 2021; Nemotron-H's MLPs).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.limits import DECODE_LINEAR_MAX_ROWS
from .mixers._fused_decode import FUSED_DECODE_DEFAULT, fused_decode_runs
from .projections import plain_weights


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: activation name -> function
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh, "relu": F.relu, "relu2": relu_squared}


class _SiluMul(torch.autograd.Function):
    """silu(gate) · up, keeping only gate and up for the backward (autograd would also keep silu(gate)): a quarter
    less of a SwiGLU's activations in training. The gradients are autograd's own, bit for bit: silu is recomputed
    and its backward is ATen's ``silu_backward``."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up; under autograd, through ``_SiluMul`` (same values and gradients, less memory kept)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


def activation(name: str):
    """The activation function called `name` (a ValueError listing the known names otherwise)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.act = act
        self.act_fn = activation(act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    #: whether a decode step's gate and up products and activation run as one kernel
    #: (`lazoo.kernels.decode_linear.gated_linear_unit`), as the mixers' fused steps: None (the default) where
    #: Triton's kernels run (CUDA), True wherever that kernel can run (the interpreter), False never
    #: (`LAZOO_FUSED_DECODE=0` at import)
    fused_decode: ClassVar[bool | None] = FUSED_DECODE_DEFAULT

    def forward(self, x):
        decode = x.numel() <= DECODE_LINEAR_MAX_ROWS * x.shape[-1]  # a decode step's few rows
        if decode and fused_decode_runs(self.fused_decode, "decode_linear", x, None):
            unit = self._one_launch(x)
            if unit is not None:
                return self.down_proj(unit)
        if self.act == "silu":
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def _one_launch(self, x):
        """act(gate(x)) · up(x) in one launch where the kernel takes these weights (plain, no bias), else None."""
        weights = plain_weights([self.gate_proj, self.up_proj])
        if weights is None:
            return None
        from ..kernels import decode_linear  # lazy: importing defines the kernels

        if decode_linear.check_supported(x, weights) is not None:
            return None
        return decode_linear.launch_gated_unit(x, *weights, self.act)

    def extra_repr(self) -> str:
        return "" if self.act == "silu" else f"act={self.act!r}"


class PlainMLP(nn.Module):
    """`down(act(up(x)))`: no gate (Nemotron-H's MLP with act="relu2")."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "relu2"):
        super().__init__()
        self.act = act
        self.act_fn = activation(act)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"act={self.act!r}"


def make_mlp(hidden_size: int, intermediate_size: int, gated: bool = True, act: str = "silu") -> nn.Module:
    """A gated or a plain MLP (module docstring)."""
    return GatedMLP(hidden_size, intermediate_size, act) if gated else PlainMLP(hidden_size, intermediate_size, act)
