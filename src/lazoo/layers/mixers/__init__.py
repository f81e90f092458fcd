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


def check_mixer_kwargs(mixer_kwargs: dict, layer_types) -> None:
    """`mixer_kwargs` (`{mechanism: {option: value}}`) names only mechanisms that `layer_types` uses (options
    of a mechanism no layer runs would be ignored without a word), each with known options of the right kind."""
    if not isinstance(mixer_kwargs, dict):
        raise ValueError(f"mixer_kwargs must be a dict {{mechanism: {{option: value}}}}, got {mixer_kwargs!r}")
    for name, options in mixer_kwargs.items():
        if name not in MIXERS:
            raise ValueError(f"mixer_kwargs has options for an unknown mechanism {name!r}; known mechanisms: "
                             f"{', '.join(MIXERS)}")
        if name not in layer_types:
            raise ValueError(f"mixer_kwargs[{name!r}]: no layer uses the mechanism {name!r} "
                             f"(layer_types={list(layer_types)}); remove it, or add {name!r} to layer_types")
        if not isinstance(options, dict):
            raise ValueError(f"mixer_kwargs[{name!r}] must be a dict of {name} options, got {options!r}")
        MIXERS[name].check_options(options, prefix=f"mixer_kwargs[{name!r}]")


__all__ = ["MIXERS", "TokenMixer", "check_mixer_kwargs", "list_mechanisms", "mixer_class"]
