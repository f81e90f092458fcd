"""The mechanism registry: each mechanism is declared once, next to its mixer, and everything else is derived.

A mixer module declares its mechanism with `register(Mechanism(...))` after the mixer class. From the
declarations lazoo derives the config classes (`lazoo_<name>` model types with the mechanism's options as
typed fields), the model and head classes, their Auto registration, the model cards, `lazoo list`, the
`trust_remote_code` export's class list and the tests' parametrisation. `docs/adding_a_mechanism.md` walks
through adding one.

The names lazoo uses are protected: its built-in mechanisms (declared by the modules of `BUILTIN_PACKAGE`) and
`RESERVED_NAMES` are replaced or removed only with `override_builtin=True`, and a registration that fails leaves
nothing behind (see `register`).

This module is a leaf: it imports nothing of lazoo, so every layer may read it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

#: the backends an op may run (see `lazoo.ops.backend.resolve_backend`)
BACKENDS = ("recurrent", "chunk", "triton")


@dataclass(frozen=True)
class Mechanism:
    """What lazoo knows of one mechanism.

    `name` is the entry in `config.layer_types` and the model type `lazoo_<name>`; `mixer` the TokenMixer
    class (its `defaults` are the mechanism's options); `op` the name of the op function the mixer runs (in
    `lazoo.ops`; for a mechanism declared outside lazoo, in the mixer's module). `backends` lists the backends the
    op has and `kernels` the modules of its Triton kernels (empty when it has none). `state` says what the cache
    keeps per layer. `title`, `equation` and `source` are the model card's row. `option_docs` documents options
    (shown in the config class's docstring).
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
        if not self.class_prefix.isidentifier():
            raise ValueError(f"mechanism {self.name!r}: class_prefix {self.class_prefix!r} must be a Python "
                             f"identifier (it begins the derived class names)")

    @property
    def model_type(self) -> str:
        return f"lazoo_{self.name}"

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.mixer.defaults)


#: names lazoo uses for model types that are not mechanisms: a mechanism of one of these names would take over
#: the model type `lazoo_<name>`
RESERVED_NAMES = {
    "hybrid": "lazoo's hybrid model type (LazooConfig, and every converted checkpoint)",
    "yolo_lat": "lazoo's vision model type (YoloLatConfig)",
}

#: the package whose modules declare lazoo's built-in mechanisms
BUILTIN_PACKAGE = __name__.rpartition(".")[0] + ".layers.mixers"

_REGISTRY: dict[str, Mechanism] = {}
#: name -> lazoo's own declaration of each built-in mechanism; kept after an unregister, as the name stays lazoo's
_BUILTINS: dict[str, Mechanism] = {}
#: (listener, removal or None), in the order `on_register` added them
_LISTENERS: list[tuple] = []


def register(mechanism: Mechanism, *, replace: bool = False, override_builtin: bool = False) -> Mechanism:
    """Add `mechanism`, then derive its classes (every `on_register` listener).

    Registering the registered declaration again (the same object, or an equal one) does nothing, and the module
    that declares a mechanism may run again (a re-import, `importlib.reload`). Any other declaration of a
    registered name needs `replace=True`. The names lazoo uses itself need `override_builtin=True` too: its
    built-in mechanisms, `RESERVED_NAMES`, and a name whose model type transformers already maps to another
    config. A class_prefix whose classes another mechanism has is refused. A registration that raises (a
    listener failing) leaves nothing behind: what it derived is removed and the previous declaration restored."""
    if not isinstance(mechanism, Mechanism):
        raise TypeError(f"register() takes a Mechanism, got {type(mechanism).__name__}")
    old = _REGISTRY.get(mechanism.name)
    if old is not None and (old is mechanism or old == mechanism):
        return old
    if not override_builtin:
        _refuse_lazoos_names(mechanism)
    if old is not None and not replace and not _is_redeclaration(old, mechanism):
        raise ValueError(f"mechanism {mechanism.name!r} is already registered (by {_where(old.mixer)}); "
                         f"pass replace=True to replace it")
    _refuse_shared_class_prefix(mechanism)
    _install(mechanism, previous=old)
    _remember_builtin(mechanism)
    return mechanism


def unregister(name: str, *, override_builtin: bool = False, missing_ok: bool = False) -> None:
    """Remove a mechanism (a test that registers a toy one cleans up with this): it leaves `list_mechanisms()`
    and the class tables (`MECHANISM_CONFIGS`, `MODEL_CLASSES`); new configs can no longer name it. transformers'
    Auto mappings have no removal: its model type stays known to them.

    A built-in mechanism, or one on a reserved name, needs `override_builtin=True` (every model using it stops
    building). An unknown name is an error unless `missing_ok=True`. Every removal listener runs even if one
    raises; the first error is raised afterwards, with the mechanism unregistered."""
    mechanism = _REGISTRY.get(name)
    if mechanism is None:
        if missing_ok:
            return
        raise ValueError(f"cannot unregister {name!r}: {_why_not_registered(name)}")
    if not override_builtin and _is_lazoos_name(name):
        raise ValueError(f"mechanism {name!r} is {_whose(name)}: unregistering it breaks every model that uses it; "
                         f"pass override_builtin=True to unregister it anyway")
    del _REGISTRY[name]
    errors = _call_removals(mechanism, [removal for _, removal in _LISTENERS])
    if errors:
        errors[0].add_note(f"mechanism {name!r} is unregistered; its other removal steps ran")
        raise errors[0]


# ----------------------------------------------------------------------------- what a registration may do
def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_lazoos_name(name: str) -> bool:
    return name in _BUILTINS or name in RESERVED_NAMES


def _whose(name: str) -> str:
    if name in RESERVED_NAMES:
        return f"reserved: lazoo_{name} is {RESERVED_NAMES[name]}"
    return f"built into lazoo ({_where(_BUILTINS[name].mixer)})"


def _why_not_registered(name: str) -> str:
    if name in RESERVED_NAMES:
        return f"it is not a mechanism (lazoo_{name} is {RESERVED_NAMES[name]})"
    return (f"no mechanism of that name is registered (known: {', '.join(_REGISTRY)}); "
            f"pass missing_ok=True to allow that")


def _refuse_lazoos_names(mechanism: Mechanism) -> None:
    """Refuse a declaration that would take a name lazoo or transformers uses (see `register`)."""
    name, builtin = mechanism.name, _BUILTINS.get(mechanism.name)
    if name in RESERVED_NAMES:
        raise ValueError(f"mechanism name {name!r} is {_whose(name)}; choose another name "
                         f"(or pass override_builtin=True to take it over)")
    if builtin is not None and not (mechanism == builtin or _is_redeclaration(builtin, mechanism)):
        raise ValueError(f"mechanism {name!r} is {_whose(name)}; pass replace=True, override_builtin=True to "
                         f"replace it, or choose another name")
    mapped = _config_mapped_elsewhere(mechanism)
    if mapped is not None:
        raise ValueError(f"mechanism {name!r}: transformers already maps its model type {mechanism.model_type} to "
                         f"{mapped}; choose another name (or pass override_builtin=True to take it over)")


def _is_redeclaration(old: Mechanism, new: Mechanism) -> bool:
    """Whether `new` comes from the module that declared `old` running again (a re-import, `importlib.reload`):
    a new mixer class of the same module and qualified name, which that module now binds. A class that only
    borrows the name (another module, or a `__module__` set by hand) is not one."""
    return (new.mixer is not old.mixer
            and (new.mixer.__module__, new.mixer.__qualname__) == (old.mixer.__module__, old.mixer.__qualname__)
            and _bound_by_its_module(new.mixer))


def _bound_by_its_module(cls: type) -> bool:
    """Whether the module `cls` names binds `cls` under its qualified name (false for a class made in a function)."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _config_mapped_elsewhere(mechanism: Mechanism) -> str | None:
    """The config class transformers maps `mechanism`'s model type to, when that is not a config of this
    mechanism (one derived for it before: by lazoo, or by a `trust_remote_code` copy of lazoo); else None."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:  # without transformers nothing is mapped
        return None
    if mechanism.model_type not in CONFIG_MAPPING:
        return None
    config_class = CONFIG_MAPPING[mechanism.model_type]
    return None if getattr(config_class, "mechanism", None) == mechanism.name else _where(config_class)


def _refuse_shared_class_prefix(mechanism: Mechanism) -> None:
    """Two mechanisms whose class names differ at most in case would rebind (or be confused with) each other's
    derived classes; a built-in's class names stay its own after it is unregistered."""
    prefix = mechanism.class_prefix.casefold()
    for other in (*_REGISTRY.values(), *_BUILTINS.values()):
        if other.name != mechanism.name and other.class_prefix.casefold() == prefix:
            raise ValueError(f"mechanism {mechanism.name!r}: class_prefix {mechanism.class_prefix!r} names the "
                             f"classes of mechanism {other.name!r} ({other.class_prefix}Config, ...); choose "
                             f"another class_prefix")


def _remember_builtin(mechanism: Mechanism) -> None:
    """Record `mechanism` as built in when one of lazoo's mixer modules declares it (or declares it again)."""
    known = _BUILTINS.get(mechanism.name)
    declared_by_lazoo = (mechanism.mixer.__module__.startswith(BUILTIN_PACKAGE + ".")
                         and _bound_by_its_module(mechanism.mixer))
    if (known is None and declared_by_lazoo) or (known is not None and _is_redeclaration(known, mechanism)):
        _BUILTINS[mechanism.name] = mechanism


# ----------------------------------------------------------------------------- deriving, and undoing it
def _install(mechanism: Mechanism, previous: Mechanism | None) -> None:
    """Enter `mechanism` and run every listener. If one raises, undo the listeners that ran (their removals) and
    put `previous` back, deriving its classes again, before the error propagates."""
    _REGISTRY[mechanism.name] = mechanism
    ran = []
    try:
        for listener, removal in list(_LISTENERS):
            ran.append(removal)  # before the call: a listener that raises may have done part of its work
            listener(mechanism)
    except BaseException as error:
        for failure in _call_removals(mechanism, ran):
            error.add_note(f"undoing the registration of {mechanism.name!r} also failed: {failure!r}")
        _restore(mechanism.name, previous, error)
        raise


def _restore(name: str, previous: Mechanism | None, error: BaseException) -> None:
    if previous is None:
        _REGISTRY.pop(name, None)
        return
    _REGISTRY[name] = previous
    try:
        for listener, _ in list(_LISTENERS):
            listener(previous)
    except Exception as failure:
        error.add_note(f"restoring the previous declaration of {name!r} failed: {failure!r}")


def _call_removals(mechanism: Mechanism, removals: list) -> list[Exception]:
    """Call each removal on `mechanism`, the last added first, and return the errors they raised."""
    errors = []
    for removal in reversed(removals):
        if removal is None:
            continue
        try:
            removal(mechanism)
        except Exception as error:
            errors.append(error)
    return errors


def get(name: str) -> Mechanism:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r} in layer_types; known mechanisms: {', '.join(_REGISTRY)}") \
            from None


def mechanisms() -> dict[str, Mechanism]:
    """The registered mechanisms, by name, in registration order."""
    return dict(_REGISTRY)


def builtin_mechanisms() -> dict[str, Mechanism]:
    """lazoo's own declaration of each of its built-in mechanisms, by name, in registration order (also of one
    unregistered or replaced since)."""
    return dict(_BUILTINS)


def on_register(listener, removal=None) -> None:
    """Call `listener(mechanism)` for every mechanism registered so far and from now on (the models package
    derives its classes this way, so a mechanism registered after `import lazoo` gets them too), and
    `removal(mechanism)`, if given, for every mechanism unregistered from now on, and to undo `listener`'s work
    when a registration fails (so it must accept a mechanism whose derivation stopped half-way)."""
    _LISTENERS.append((listener, removal))
    for mechanism in list(_REGISTRY.values()):
        listener(mechanism)

