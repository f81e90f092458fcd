"""An op's initial state: checked (a tensor of an exact shape, or a dict of such parts) and, for a one-part state,
zeros when none is given."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .checks import check_float


def check_state_tensor(op: str, name: str, x, shape: Sequence[int], device: torch.device) -> None:
    """One part of an initial state: a float tensor of an exact shape."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of shape {tuple(shape)}, "
                        f"got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    check_float(op, name, x)
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device} but q is on {device}")


def check_state_dict(op: str, state, keys: Sequence[str]) -> None:
    """A state of several parts must be a mapping with exactly ``keys``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{op}: initial_state must be a dict with keys {sorted(keys)}, "
                        f"got {type(state).__name__}")
    if set(state.keys()) != set(keys):
        raise ValueError(f"{op}: initial_state must have keys {sorted(keys)}, "
                         f"got {sorted(state.keys())}")


def check_matrix_state(op: str, state, shape: Sequence[int], device: torch.device) -> None:
    """A one-part state ``S`` (a tensor)."""
    if isinstance(state, Mapping):
        raise TypeError(f"{op}: initial_state must be a tensor S of shape {tuple(shape)}, got a dict")
    check_state_tensor(op, "initial_state", state, shape, device)


def matrix_initial_state(op, state, B, H, dk, dv, device, cdt) -> torch.Tensor:
    """A one-part state S: zeros by default, else validated and cast to the compute dtype."""
    if state is None:
        return torch.zeros(B, H, dv, dk, dtype=cdt, device=device)
    check_matrix_state(op, state, (B, H, dv, dk), device)
    return state.to(cdt)
