"""Checkpoint conversion into lazoo folders: `from_fla` (flash-linear-attention checkpoints), `lazoo convert`."""

from .fla import UnsupportedCheckpointError, fla_config_to_lazoo, from_fla

__all__ = ["UnsupportedCheckpointError", "fla_config_to_lazoo", "from_fla"]
