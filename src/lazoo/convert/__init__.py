"""Checkpoint conversion into lazoo folders: `from_fla` (flash-linear-attention checkpoints), `lazoo convert`."""

from .fla import ConversionError, UnsupportedCheckpointError, fla_config_to_lazoo, from_fla

__all__ = ["ConversionError", "UnsupportedCheckpointError", "fla_config_to_lazoo", "from_fla"]
