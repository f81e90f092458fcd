"""Token mixers, one per mechanism. Each mixer module declares its mechanisms (`lazoo.registry.register`);
importing this package imports every mixer module, listed below (a new module adds its name there;
`tests/test_registry.py` checks that none is missing)."""

from collections.abc import Iterator, Mapping

from ...registry import get, mechanisms
from . import attention, delta, kda, linear, local_linear, mamba2, mla, ovq, recurrent, rls, titans, ttt, vla  # noqa: F401 (they register)
from .base import TokenMixer


class _MixerTable(Mapping):
    """`{mechanism name: mixer class}`, read live from the registry (a mechanism registered later shows)."""

    def __getitem__(self, name: str) -> type[TokenMixer]:
        try:
            return mechanisms()[name].mixer
        except KeyError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(mechanisms())

    def __len__(self) -> int:
        return len(mechanisms())

    def __repr__(self) -> str:
        return f"MIXERS({', '.join(self)})"


MIXERS: Mapping[str, type[TokenMixer]] = _MixerTable()


def list_mechanisms() -> list[str]:
    """The mechanism names accepted in `config.layer_types`."""
    return list(mechanisms())


def mixer_class(name: str) -> type[TokenMixer]:
    """The mixer class of mechanism `name`; a ValueError listing the known names otherwise."""
    return get(name).mixer


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
