"""nn.Modules: token mixers (one per mechanism), short convolution, MLP, routed MoE, Memory Lobe, RoPE."""

from .memory_lobe import MemoryLobe
from .mixers import MIXERS, TokenMixer, list_mechanisms, mixer_class
from .mlp import GatedMLP
from .moe import RoutedMoE
from .short_conv import ShortConvolution

__all__ = ["MIXERS", "TokenMixer", "list_mechanisms", "mixer_class", "GatedMLP", "MemoryLobe", "RoutedMoE",
           "ShortConvolution"]
