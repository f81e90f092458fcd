"""nn.Modules: token mixers (one per mechanism), short convolution, MLP, RoPE."""

from .mixers import MIXERS, TokenMixer, list_mechanisms, mixer_class
from .mlp import GatedMLP
from .short_conv import ShortConvolution

__all__ = ["MIXERS", "TokenMixer", "list_mechanisms", "mixer_class", "GatedMLP", "ShortConvolution"]
