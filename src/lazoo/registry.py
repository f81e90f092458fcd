"""The mechanism registry: each mechanism is declared once, next to its mixer, and everything else is derived.

A mixer module declares its mechanism with `register(Mechanism(...))` after the mixer class. From the
declarations lazoo derives the config classes (`lazoo_<name>` model types with the mechanism's options as
typed fields), the model and head classes, their Auto registration, the model cards, `lazoo list`, the
`trust_remote_code` export's class list and the tests' parametrisation. `docs/adding_a_mechanism.md` walks
through adding one.

This module is a leaf: it imports nothing of lazoo, so every layer may read it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: the backends an op may run (see `lazoo.ops._common.resolve_backend`)
BACKENDS = ("recurrent", "chunk", "triton")


@dataclass(frozen=True)
class Mechanism:
    """What lazoo knows of one mechanism.

    `name` is the entry in `config.layer_types` and the model type `lazoo_<name>`; `mixer` the TokenMixer
    class (its `defaults` are the mechanism's options); `op` the name of the op function the mixer runs (in
    `lazoo.ops`; for a mechanism declared outside lazoo, in the mixer's module). `backends` lists the backends the op has and `kernels` the modules of its Triton kernels
    (empty when it has none). `state` says what the cache keeps per layer. `title`, `equation` and `source`
    are the model card's row. `option_docs` documents options (shown in the config class's docstring).
    `tiny_options` are option values for tiny models (tests, examples): small enough that short sequences
    cross the mechanism's internal boundaries (chunks, refreshes, mini-batches). `bidirectional_mixer`: a
    mixer class with the same parameters running the mechanism's non-causal form, for encoders.
    `class_prefix` names the derived classes (`<prefix>Config`, `<prefix>Model`, `<prefix>ForCausalLM`,
    `<prefix>ForSequenceClassification`)."""

    name: str
    mixer: type
    op: str
    title: str
    equation: str
    source: str
    state: str
    backends: tuple[str, ...] = ("recurrent", "chunk")
    kernels: tuple[str, ...] = ()
    option_docs: dict[str, str] = field(default_factory=dict)
    tiny_options: dict[str, Any] = field(default_factory=dict)
    bidirectional_mixer: type | None = None
    class_prefix: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"mechanism name {self.name!r} must be lower_snake_case (it becomes lazoo_{self.name})")
        unknown = set(self.backends) - set(BACKENDS)
        if unknown or not self.backends:
            raise ValueError(f"mechanism {self.name!r}: backends must be a non-empty subset of {BACKENDS}, "
                             f"got {self.backends!r}")
        if ("triton" in self.backends) != bool(self.kernels):
            raise ValueError(f"mechanism {self.name!r}: name the kernel modules (kernels=...) exactly when "
                             f"'triton' is one of the backends")
        if getattr(self.mixer, "mechanism", self.name) != self.name:
            raise ValueError(f"mechanism {self.name!r}: its mixer {self.mixer.__name__} says "
                             f"mechanism = {self.mixer.mechanism!r}")
        defaults = getattr(self.mixer, "defaults", {})
        for where, keys in (("option_docs", self.option_docs), ("tiny_options", self.tiny_options)):
            if set(keys) - set(defaults):
                raise ValueError(f"mechanism {self.name!r}: {where} names unknown options "
                                 f"{sorted(set(keys) - set(defaults))}; the mixer's options are {sorted(defaults)}")
        if not self.class_prefix:
            object.__setattr__(self, "class_prefix", "Lazoo" + "".join(p.title() for p in self.name.split("_")))

    @property
    def model_type(self) -> str:
        return f"lazoo_{self.name}"

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.mixer.defaults)


_REGISTRY: dict[str, Mechanism] = {}


def register(mechanism: Mechanism, *, replace: bool = False) -> Mechanism:
    """Add `mechanism`. A second declaration of a name is an error unless `replace` (re-importing a module,
    or a test swapping in a variant)."""
    if not isinstance(mechanism, Mechanism):
        raise TypeError(f"register() takes a Mechanism, got {type(mechanism).__name__}")
    old = _REGISTRY.get(mechanism.name)
    if old is not None and not replace and old.mixer.__qualname__ != mechanism.mixer.__qualname__:
        raise ValueError(f"mechanism {mechanism.name!r} is already registered (by {old.mixer.__module__}."
                         f"{old.mixer.__qualname__}); pass replace=True to replace it")
    _REGISTRY[mechanism.name] = mechanism
    for listener in _LISTENERS:
        listener(mechanism)
    return mechanism


def unregister(name: str) -> None:
    """Remove a mechanism (a test that registers a toy one cleans up with this): it leaves `list_mechanisms()`
    and the class tables (`MECHANISM_CONFIGS`, `MODEL_CLASSES`); new configs can no longer name it. transformers'
    Auto mappings have no removal: its model type stays known to them."""
    mechanism = _REGISTRY.pop(name, None)
    if mechanism is not None:
        for listener in _REMOVAL_LISTENERS:
            listener(mechanism)


def get(name: str) -> Mechanism:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r} in layer_types; known mechanisms: {', '.join(_REGISTRY)}") \
            from None


def mechanisms() -> dict[str, Mechanism]:
    """The registered mechanisms, by name, in registration order."""
    return dict(_REGISTRY)


_LISTENERS: list = []
_REMOVAL_LISTENERS: list = []


def on_register(listener, removal=None) -> None:
    """Call `listener(mechanism)` for every mechanism registered so far and from now on (the models package
    derives its classes this way, so a mechanism registered after `import lazoo` gets them too), and
    `removal(mechanism)`, if given, for every mechanism unregistered from now on."""
    _LISTENERS.append(listener)
    if removal is not None:
        _REMOVAL_LISTENERS.append(removal)
    for mechanism in list(_REGISTRY.values()):
        listener(mechanism)


def import_submodules(package: str, path) -> list[ModuleType]:
    """Import every module of `package` whose name does not start with "_", in name order, and return them.

    A package whose `__init__` calls this (`import_submodules(__name__, __path__)`) picks up a new module
    without an edit: lazoo's ops and mixers are found this way. The `trust_remote_code` export replaces the
    call with explicit imports of the same modules (`lazoo.models.export`)."""
    return [importlib.import_module(f"{package}.{name}") for name in public_submodule_names(path)]


def public_submodule_names(path) -> list[str]:
    """The names of the modules in package folder(s) `path` that do not start with "_", sorted."""
    return sorted(info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_"))
