"""Token mixers, one per mechanism, and the registry that maps `layer_types` names to them."""

from .attention import SlidingWindowAttentionMixer, SoftmaxAttentionMixer
from .base import TokenMixer
from .delta import DeltaNetMixer, DeltaProductMixer, GatedDeltaNetMixer
from .linear import ELAMixer, GatedLinearAttentionMixer, GLAMixer, LinearAttentionMixer
from .local_linear import LocalLinearMixer
from .ovq import OVQMixer, VQMixer
from .titans import TitansMixer
from .ttt import TTTLinearMixer, TTTMLPMixer
from .rls import RLSMixer
from .vla import VLAMixer

MIXERS: dict[str, type[TokenMixer]] = {
    cls.mechanism: cls
    for cls in (
        SoftmaxAttentionMixer,
        SlidingWindowAttentionMixer,
        LinearAttentionMixer,
        GatedLinearAttentionMixer,
        DeltaNetMixer,
        GatedDeltaNetMixer,
        VLAMixer,
        ELAMixer,
        GLAMixer,
        DeltaProductMixer,
        OVQMixer,
        VQMixer,
        TTTLinearMixer,
        TTTMLPMixer,
        TitansMixer,
        RLSMixer,
        LocalLinearMixer,
    )
}


def list_mechanisms() -> list[str]:
    """The mechanism names accepted in `config.layer_types`."""
    return list(MIXERS)


def mixer_class(name: str) -> type[TokenMixer]:
    try:
        return MIXERS[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r} in layer_types; known mechanisms: {', '.join(MIXERS)}") from None


__all__ = ["MIXERS", "TokenMixer", "list_mechanisms", "mixer_class"]
