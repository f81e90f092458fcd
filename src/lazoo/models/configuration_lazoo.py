"""Configurations: one `LazooConfig` base and one subclass per mechanism (`model_type = "lazoo_<name>"`).

A model is a stack of decoder layers whose token mixers are listed in `layer_types` (a hybrid is a mixed
list). Each mechanism's hyper-parameters have defaults in its mixer class (`lazoo.layers.mixers`); a
mechanism's own config class exposes them as typed fields, and any config can set them for any mechanism
it uses through `mixer_kwargs={"<name>": {...}}`.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from transformers import PreTrainedConfig

from ..layers.mixers import check_mixer_kwargs, mixer_class
from ..registry import Mechanism, mechanisms, on_register


#: the format of a saved config, written as `lazoo_format`. A config that `save_pretrained` wrote without the field
#: is format 1. Where a mechanism's default changed in a later format (its mixer's `defaults_before`), a config of
#: an older format gets the old value, so a saved model computes what it computed when it was saved.
CONFIG_FORMAT = 2

#: the layer pattern of a `lazoo_hybrid` config created without `layer_types`
DEFAULT_HYBRID_PATTERN = ("sliding_window", "vla")


MEMORY_LOBE_MODES = (None, "causal", "bidirectional")
MOE_BIAS_MODES = (None, "eq14", "eq15")


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(field: str, value, minimum: int = 1, allow_none: bool = False, note: str = "") -> None:
    """`value` is an int >= `minimum` (or None when `allow_none`), else a ValueError naming `field`."""
    if (allow_none and value is None) or (_is_int(value) and value >= minimum):
        return
    allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"{field} must be {allowed}{' or None' if allow_none else ''}{note}, got {value!r}")


def check_number(field: str, value, *, positive: bool) -> None:
    """`value` is a finite real number, > 0 when `positive` (else >= 0), else a ValueError naming `field`."""
    if _is_number(value) and (value > 0 if positive else value >= 0):
        return
    raise ValueError(f"{field} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def check_sizes(config) -> None:
    """Clear errors for the model's sizes and numeric fields (the values a config JSON or a user may get wrong)."""
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings"):
        check_int(field, getattr(config, field))
    check_int("intermediate_size", config.intermediate_size, minimum=0, note=" (0 = no MLP)")
    check_int("sliding_window", config.sliding_window, allow_none=True)
    check_number("rms_norm_eps", config.rms_norm_eps, positive=True)
    check_number("initializer_range", config.initializer_range, positive=False)
    if config.use_short_conv not in (None, True, False):
        raise ValueError(f"use_short_conv must be True, False or None (each mixer's default), "
                         f"got {config.use_short_conv!r}")


def check_layer_types(layer_types, num_hidden_layers) -> None:
    """`layer_types` is a list of known mechanism names, one per layer."""
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"layer_types must be a list of mechanism names, one per layer (e.g. "
                         f"['linear'] * num_hidden_layers), got {type(layer_types).__name__} {layer_types!r}")
    for name in layer_types:
        if not isinstance(name, str):
            raise ValueError(f"layer_types entries must be mechanism names (str), got {name!r}")
        mixer_class(name)  # raises ValueError listing the known names
    if len(layer_types) != num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers={num_hidden_layers}; "
                         "give one per layer")


def check_head_layout(config, layer_types) -> None:
    """hidden_size divides into the heads of every layer whose mixer derives its head dim from it: the config's
    `num_attention_heads`, or the mechanism's own `num_heads` option; a mechanism with its own `head_k_dim` sets
    its head dim freely (fla-style layouts). The Memory Lobe uses `num_attention_heads`."""
    for name in dict.fromkeys(layer_types):
        options = config.mixer_options(name)
        heads = options.get("num_heads") or config.num_attention_heads
        if options.get("head_k_dim") is None and config.hidden_size % heads:
            source = (f"the {name!r} option num_heads={heads}" if options.get("num_heads")
                      else f"num_attention_heads={heads}")
            raise ValueError(f"hidden_size={config.hidden_size} must be divisible by {source} (the heads of the "
                             f"{name!r} layers), or set the {name!r} option head_k_dim where the mechanism has it")
    if config.memory_lobe is not None and config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by num_attention_heads="
                         f"{config.num_attention_heads} (the Memory Lobe's heads)")


def check_decoder_options(config) -> None:
    """Clear errors for the ELA-GPT decoder options (Hyper-Link, Memory Lobe, routed MoE)."""
    from ..ops.linear import FEATURE_MAPS

    if config.memory_lobe not in MEMORY_LOBE_MODES:
        raise ValueError(f"memory_lobe must be one of {MEMORY_LOBE_MODES}, got {config.memory_lobe!r}")
    if config.memory_lobe_feature_map not in FEATURE_MAPS or config.memory_lobe_feature_map == "identity":
        raise ValueError(f"memory_lobe_feature_map must be a positive feature map ('elu1' or 'relu'), "
                         f"got {config.memory_lobe_feature_map!r}")
    E, k = config.moe_num_experts, config.moe_top_k
    if not isinstance(E, int) or isinstance(E, bool) or E < 0:
        raise ValueError(f"moe_num_experts must be an int >= 0 (0 = a dense MLP), got {E!r}")
    if E and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E):
        raise ValueError(f"moe_top_k must be an int in [1, moe_num_experts={E}], got {k!r}")
    if config.moe_intermediate_size is not None and (
            not isinstance(config.moe_intermediate_size, int) or config.moe_intermediate_size < 1):
        raise ValueError(f"moe_intermediate_size must be a positive int or None, got {config.moe_intermediate_size!r}")
    if config.moe_bias not in MOE_BIAS_MODES:
        raise ValueError(f"moe_bias must be one of {MOE_BIAS_MODES} (the ELA paper, eqs. 14/15; None = no bias), "
                         f"got {config.moe_bias!r}")
    coef = config.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be a number >= 0, got {coef!r}")


def _defaults_before(saved_format, layer_types) -> dict[str, dict[str, Any]]:
    """`{mechanism: {option: old value}}` for the mechanisms of `layer_types` whose defaults changed after
    `saved_format` (each mixer's `defaults_before`); empty for a config of the current format."""
    if not _is_int(saved_format) or saved_format >= CONFIG_FORMAT or not isinstance(layer_types, (list, tuple)):
        return {}
    old: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(layer_types):
        try:
            changes = mixer_class(name).defaults_before
        except ValueError:  # an unknown name: check_layer_types says so
            continue
        for fmt in sorted(changes, reverse=True):  # the oldest change wins: it holds the value saved then
            if fmt > saved_format:
                old.setdefault(name, {}).update(changes[fmt])
    return old


#: the model classes derived for every lazoo model type (`<class_prefix><suffix>`; a hybrid's prefix is "Lazoo")
MODEL_CLASS_SUFFIXES = ("Model", "ForCausalLM", "ForSequenceClassification")


def _model_type_of_class(name: str) -> str | None:
    """The lazoo model type whose derived classes include `name` (as saved in a config's `architectures`), or None
    for a class lazoo did not derive (a user's own subclass)."""
    prefixes = {"Lazoo": "lazoo_hybrid", **{m.class_prefix: m.model_type for m in mechanisms().values()}}
    for prefix, model_type in prefixes.items():
        if name in {prefix + suffix for suffix in MODEL_CLASS_SUFFIXES}:
            return model_type
    return None


def check_architectures(model_type: str, architectures) -> None:
    """A saved config's `architectures` (the classes that saved it) belong to its `model_type`: a folder whose
    `model_type` was changed afterwards would read its layers' options differently and compute other numbers."""
    for name in architectures or ():
        saved_as = _model_type_of_class(name) if isinstance(name, str) else None
        if saved_as is not None and saved_as != model_type:
            raise ValueError(f"config.json has model_type {model_type!r} but was saved by {name}, a class of "
                             f"{saved_as!r}: a changed model_type reads the layers' options differently. Restore "
                             f"model_type {saved_as!r} (or, for a deliberate change, update 'architectures' too)")


def check_no_foreign_options(model_type: str, mechanism: str | None, layer_types, fields) -> None:
    """No top-level field of the config is an option of another mechanism of `layer_types`: only the primary
    mechanism's options are typed fields, so such a field would be left unread (it belongs in `mixer_kwargs`)."""
    if not isinstance(layer_types, (list, tuple)):
        return  # check_layer_types says what is wrong
    standard = _standard_config_fields()
    for name in dict.fromkeys(layer_types):
        if name == mechanism or not isinstance(name, str):
            continue
        try:
            options = mixer_class(name).defaults
        except ValueError:  # an unknown name: check_layer_types says so
            continue
        stray = sorted(k for k in fields if k in options and k not in standard)
        if stray:
            raise ValueError(f"config field {stray[0]!r} is an option of the {name!r} layers, which a {model_type} "
                             f"config reads only from mixer_kwargs[{name!r}] (top-level option fields belong to "
                             f"model_type lazoo_{name}); move it there, or restore the model_type it was saved with")


def _standard_config_fields() -> set[str]:
    """The fields every transformers config has (never a mechanism option, whatever a mixer names its own)."""
    global _STANDARD_FIELDS
    if _STANDARD_FIELDS is None:
        _STANDARD_FIELDS = set(PreTrainedConfig().to_dict())
    return _STANDARD_FIELDS


_STANDARD_FIELDS: set[str] | None = None


class LazooConfig(PreTrainedConfig):
    model_type = "lazoo_hybrid"
    #: the primary mechanism (None for hybrids with no primary mechanism); no annotation on purpose:
    #: transformers turns annotated config attributes into dataclass fields
    mechanism = None
    #: output keys Trainer's evaluation leaves out of the predictions: the cache under both of its names
    #: (`cache` from transformers 5.24, `past_key_values` before)
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = 64,
        use_short_conv: bool | None = None,
        mixer_kwargs: dict[str, dict[str, Any]] | None = None,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 1 << 20,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        hyper_link: bool = False,
        memory_lobe: str | None = None,
        memory_lobe_feature_map: str = "elu1",
        moe_num_experts: int = 0,
        moe_top_k: int = 2,
        moe_intermediate_size: int | None = None,
        moe_bias: str | None = "eq14",
        router_aux_loss_coef: float = 0.01,
        **kwargs,
    ):
        # `transformers_version` is in every config that save_pretrained wrote: one without `lazoo_format` is format 1
        saved_format = kwargs.pop("lazoo_format", 1 if "transformers_version" in kwargs else CONFIG_FORMAT)
        old_defaults = _defaults_before(saved_format, layer_types or [self.mechanism])
        # typed fields of the primary mechanism (e.g. `lambda0` on LazooVLAConfig)
        if self.mechanism is not None:
            own_old = old_defaults.pop(self.mechanism, {})
            for key, default in self._own_fields().items():
                setattr(self, key, kwargs.pop(key, own_old.get(key, default)))
        check_architectures(self.model_type, kwargs.get("architectures"))
        check_no_foreign_options(self.model_type, self.mechanism, layer_types, kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        if intermediate_size is None and _is_int(hidden_size):
            self.intermediate_size = 4 * hidden_size
        if layer_types is None and _is_int(num_hidden_layers):
            # a hybrid with no layer list is the sliding-window/VLA hybrid of the demo (transformers builds
            # default configs with no arguments, e.g. to find the non-default fields when saving)
            pattern = [self.mechanism] if self.mechanism is not None else list(DEFAULT_HYBRID_PATTERN)
            layer_types = [pattern[i % len(pattern)] for i in range(num_hidden_layers)]
        self.sliding_window = sliding_window
        self.use_short_conv = use_short_conv
        # a copy (the caller's dicts stay untouched); anything but a dict of dicts is refused by `check_fields`
        self.mixer_kwargs = {} if mixer_kwargs is None else mixer_kwargs
        if isinstance(mixer_kwargs, dict):
            self.mixer_kwargs = {name: dict(opts) if isinstance(opts, dict) else opts
                                 for name, opts in mixer_kwargs.items()}
        for name, old in old_defaults.items():  # written out, so the next save keeps them
            if isinstance(self.mixer_kwargs, dict) and isinstance(self.mixer_kwargs.get(name, {}), dict):
                self.mixer_kwargs[name] = {**old, **self.mixer_kwargs.get(name, {})}
        self.lazoo_format = CONFIG_FORMAT
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        # decoder options of ELA-GPT (the ELA paper, §V), usable with any mechanism: see lazoo.layers.moe/memory_lobe
        self.hyper_link = bool(hyper_link)
        self.memory_lobe = memory_lobe
        self.memory_lobe_feature_map = memory_lobe_feature_map
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_bias = moe_bias
        self.router_aux_loss_coef = router_aux_loss_coef
        self.check_fields(layer_types)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
        # set after the base __init__, whose validation only knows transformers' own attention kinds
        self.layer_types = list(layer_types)

    def check_fields(self, layer_types) -> None:
        """lazoo's checks of every field, with messages that name the field and the allowed values: sizes and
        numeric fields, `layer_types`, the primary mechanism's typed fields, `mixer_kwargs` (known mechanisms
        that `layer_types` uses, known option names and value types) and the decoder options. Run by
        `__init__` and by `validate` (which transformers calls when saving)."""
        check_sizes(self)
        check_layer_types(layer_types, self.num_hidden_layers)
        if self.mechanism is not None:
            mixer_class(self.mechanism).check_options({k: getattr(self, k) for k in self._own_fields()})
        check_mixer_kwargs(self.mixer_kwargs, layer_types)
        check_head_layout(self, layer_types)
        check_decoder_options(self)

    def validate(self):
        """transformers' validators, except its `layer_types` check (which knows only its own attention
        kinds): lazoo's entries are mechanism names, checked here with the other fields (`check_fields`)."""
        for validator in getattr(PreTrainedConfig, "__class_validators__", []):
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self.check_fields(self.layer_types)

    @classmethod
    def _own_fields(cls) -> dict[str, Any]:
        """The primary mechanism's hyper-parameters that are not already standard config fields."""
        return {k: v for k, v in mixer_class(cls.mechanism).defaults.items() if k != "use_short_conv"}

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """`PreTrainedConfig.save_pretrained` plus the `trust_remote_code` export (`lazoo.models.export`):
        `auto_map` (AutoConfig, AutoModel, AutoModelForCausalLM; also kept on this config, as transformers'
        `register_for_auto_class` does) and a flat copy of the model code next to config.json, so the folder
        loads where lazoo is not installed. A model's `save_pretrained` (and so `push_to_hub`) saves its
        config through this method."""
        try:
            from .export import auto_map_for, export_remote_code
        except ImportError:  # the exported copy itself: transformers' remote-code saving copies its files
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        auto_map = auto_map_for(self)
        if auto_map is not None:  # None: not one of lazoo's model types (a user's subclass), saved as is
            self.auto_map = {**(getattr(self, "auto_map", None) or {}), **auto_map}
            export_remote_code(save_directory, mechanism_names=self.layer_types)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def mixer_options(self, name: str) -> dict[str, Any]:
        """Resolved hyper-parameters for mechanism `name`: its defaults, then the typed fields (if `name` is
        this config's mechanism), then `use_short_conv`, then `mixer_kwargs[name]`."""
        options = dict(mixer_class(name).defaults)
        options["backend"] = None
        if name == self.mechanism:
            options.update({k: getattr(self, k) for k in self._own_fields()})
        if self.use_short_conv is not None and "use_short_conv" in options:
            options["use_short_conv"] = self.use_short_conv
        options.update(self.mixer_kwargs.get(name, {}))
        return options


#: mechanism name -> its config class (`lazoo_<name>`); `lazoo_hybrid` is `LazooConfig` itself. Filled from the
#: registry (`lazoo.registry`): every registered mechanism gets a class, also one registered after import.
MECHANISM_CONFIGS: dict[str, type[LazooConfig]] = {}


def _config_docstring(mechanism: Mechanism) -> str:
    lines = [f"Configuration of a lazoo `{mechanism.name}` model ({mechanism.title}): model type "
             f"`{mechanism.model_type}`, every layer `{mechanism.name}` unless `layer_types` says otherwise.",
             "", f"{mechanism.name} options (typed fields here; `mixer_kwargs[{mechanism.name!r}]` in any config):"]
    for key, default in mechanism.defaults.items():
        doc = mechanism.option_docs.get(key, "")
        lines.append(f"    {key} = {default!r}" + (f": {doc}" if doc else ""))
    return "\n".join(lines)


def make_config_class(mechanism: Mechanism) -> type[LazooConfig]:
    """The config class of `mechanism` (`<class_prefix>Config`), bound in this module and in
    `MECHANISM_CONFIGS`: a `LazooConfig` whose primary mechanism is `mechanism.name`."""

    def __init__(self, **kwargs):
        LazooConfig.__init__(self, **kwargs)

    # an explicit __init__ keeps transformers from generating a dataclass one for the subclass
    name = f"{mechanism.class_prefix}Config"
    existing = globals().get(name)
    if existing is not None and getattr(existing, "mechanism", None) != mechanism.name:  # LazooConfig, or another's
        raise ValueError(f"mechanism {mechanism.name!r}: class_prefix {mechanism.class_prefix!r} would rebind "
                         f"{__name__}.{name}; choose another class_prefix")
    namespace = {"model_type": mechanism.model_type, "mechanism": mechanism.name, "__init__": __init__,
                 "__module__": __name__, "__qualname__": name, "__doc__": _config_docstring(mechanism)}
    cls = type(name, (LazooConfig,), namespace)
    MECHANISM_CONFIGS[mechanism.name] = cls
    globals()[name] = cls
    return cls


def _forget_config_class(mechanism: Mechanism) -> None:
    cls = MECHANISM_CONFIGS.pop(mechanism.name, None)
    name = f"{mechanism.class_prefix}Config"
    if cls is not None and globals().get(name) is cls:
        del globals()[name]


on_register(make_config_class, removal=_forget_config_class)
