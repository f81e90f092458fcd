"""What a registration may not do (`lazoo.registry`): take or remove the names lazoo uses, slip in a mixer class
that only borrows a built-in's name, leave a half-derived mechanism behind, or rebind another mechanism's classes.

`HARDENING` has one row per rule; `KEEPS_WORKING` the registrations that must go on working (a new mechanism of
one's own, a mixer module executed again). Every row runs in `isolated`, which puts the registry, the derived
class tables, the modules' names and transformers' Auto mappings back as they were.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedConfig,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import lazoo
from lazoo import registry
from lazoo.layers.mixers import delta
from lazoo.layers.mixers.linear import LinearAttentionMixer
from lazoo.models import configuration_lazoo, configuration_mechanisms, modeling_lazoo, modeling_mechanisms
from lazoo.registry import Mechanism

BUILTIN = "gated_delta_net"
AUTO_CLASSES = (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification)


# ----------------------------------------------------------------------------- isolation and helpers
def _containers(module) -> list:
    return [value for key, value in vars(module).items()
            if not key.startswith("__") and isinstance(value, (dict, list, set))]


@pytest.fixture
def isolated():
    """Everything a registration touches, saved before the row and put back after it (also when it fails)."""
    modules = (registry, configuration_lazoo, configuration_mechanisms, modeling_lazoo, modeling_mechanisms, delta)
    namespaces = {module: dict(vars(module)) for module in modules}
    containers = [(c, c.copy()) for module in modules for c in _containers(module)]
    containers += [(m, m.copy()) for m in (CONFIG_MAPPING._extra_content,
                                           *(auto._model_mapping._extra_content for auto in AUTO_CLASSES))]
    yield
    for module, saved in namespaces.items():
        for key in set(vars(module)) - set(saved):
            delattr(module, key)
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)
    for container, saved in containers:
        container.clear()
        container.extend(saved) if isinstance(container, list) else container.update(saved)


def toy_mixer(name: str, *, base: type = LinearAttentionMixer, module: str = __name__, qualname: str = "",
              namespace: dict | None = None) -> type:
    """A new mixer class for mechanism `name` (a fresh class object each call)."""
    qualname = qualname or f"Toy_{name}"
    body = {"mechanism": name, "__module__": module, "__qualname__": qualname, **(namespace or {})}
    return type(qualname.rpartition(".")[2], (base,), body)


def declaration(name: str, mixer: type | None = None, **fields) -> Mechanism:
    """A declaration of mechanism `name` running lazoo's linear attention op."""
    linear = registry.get("linear")
    return Mechanism(name=name, mixer=mixer or toy_mixer(name), op=linear.op, title=f"toy {name}", equation="e",
                     source="s", state="S", backends=linear.backends, kernels=linear.kernels, **fields)


def builtin_logits() -> torch.Tensor:
    with torch.no_grad():
        return tiny_model(BUILTIN)(random_ids(1, 12, seed=0)).logits


def assert_builtin_intact() -> None:
    m = registry.get(BUILTIN)
    assert m.mixer is delta.GatedDeltaNetMixer
    config_class = lazoo.MECHANISM_CONFIGS[BUILTIN]
    assert configuration_mechanisms.LazooGatedDeltaNetConfig is config_class
    assert lazoo.MODEL_CLASSES[m.model_type][0] is config_class and CONFIG_MAPPING[m.model_type] is config_class


def failing_listener(name: str, error: str = "bad options"):
    """A listener that raises while deriving `name` (as a config class with a bad option would), and a switch."""
    broken = [True]

    def derive(mechanism):
        if mechanism.name == name and broken[0]:
            raise RuntimeError(error)

    return derive, broken


# ----------------------------------------------------------------------------- the names lazoo uses
def row_hybrid_cannot_be_registered():
    with pytest.raises(ValueError, match=r"'hybrid' is reserved: lazoo_hybrid .*override_builtin=True"):
        registry.register(declaration("hybrid"))
    assert "hybrid" not in registry.mechanisms()
    assert lazoo.MODEL_CLASSES["lazoo_hybrid"] == (lazoo.LazooConfig, lazoo.LazooModel, lazoo.LazooForCausalLM)
    with torch.no_grad():
        assert tiny_model("hybrid")(random_ids(1, 8, seed=1)).logits.isfinite().all()


def row_hybrid_cannot_be_unregistered():
    with pytest.raises(ValueError, match=r"cannot unregister 'hybrid': it is not a mechanism"):
        registry.unregister("hybrid")
    assert lazoo.MODEL_CLASSES["lazoo_hybrid"][0] is lazoo.LazooConfig


def row_a_reserved_name_is_taken_and_given_back_only_with_the_override():
    registry.register(declaration("hybrid"), override_builtin=True)
    with pytest.raises(ValueError, match=r"'hybrid' is reserved.*pass override_builtin=True"):
        registry.unregister("hybrid")
    registry.unregister("hybrid", override_builtin=True)
    assert "hybrid" not in registry.mechanisms()


def row_the_vision_model_type_cannot_be_taken():
    vision_config = CONFIG_MAPPING["lazoo_yolo_lat"]
    with pytest.raises(ValueError, match=r"'yolo_lat' is reserved: lazoo_yolo_lat is lazoo's vision model type"):
        registry.register(declaration("yolo_lat"))
    assert CONFIG_MAPPING["lazoo_yolo_lat"] is vision_config and "yolo_lat" not in registry.mechanisms()


def row_a_model_type_transformers_maps_elsewhere_cannot_be_taken():
    class ForeignConfig(PreTrainedConfig):
        model_type = "lazoo_foreign"

    AutoConfig.register("lazoo_foreign", ForeignConfig)
    with pytest.raises(ValueError, match=r"'foreign': transformers already maps its model type lazoo_foreign to "
                                         r".*ForeignConfig; choose another name"):
        registry.register(declaration("foreign"))
    assert CONFIG_MAPPING["lazoo_foreign"] is ForeignConfig and "foreign" not in registry.mechanisms()


# ----------------------------------------------------------------------------- built-in mechanisms
def row_replacing_a_builtin_needs_the_override():
    variant = dataclasses.replace(registry.get(BUILTIN), mixer=toy_mixer(BUILTIN, base=delta.GatedDeltaNetMixer))
    with pytest.raises(ValueError, match=rf"'{BUILTIN}' is built into lazoo .*override_builtin=True"):
        registry.register(variant, replace=True)
    assert_builtin_intact()


def row_a_class_from_another_module_with_a_builtins_name_is_refused():
    before = builtin_logits()

    def mix(self, *args, **kwargs):
        out, state = delta.GatedDeltaNetMixer.mix(self, *args, **kwargs)
        return 2 * out, state

    impostor = toy_mixer(BUILTIN, base=delta.GatedDeltaNetMixer, module="user_mixers", qualname="GatedDeltaNetMixer",
                         namespace={"mix": mix})
    with pytest.raises(ValueError, match=rf"'{BUILTIN}' is built into lazoo"):
        registry.register(dataclasses.replace(registry.get(BUILTIN), mixer=impostor))
    assert_builtin_intact()
    torch.testing.assert_close(builtin_logits(), before, rtol=0, atol=0)


def row_a_class_claiming_a_builtins_module_and_name_is_refused():
    impostor = toy_mixer(BUILTIN, base=delta.GatedDeltaNetMixer, module=delta.__name__,
                         qualname="GatedDeltaNetMixer")
    with pytest.raises(ValueError, match=rf"'{BUILTIN}' is built into lazoo"):
        registry.register(dataclasses.replace(registry.get(BUILTIN), mixer=impostor))
    assert_builtin_intact()


def row_a_builtins_mixer_with_other_fields_is_refused():
    with pytest.raises(ValueError, match=rf"'{BUILTIN}' is built into lazoo"):
        registry.register(dataclasses.replace(registry.get(BUILTIN), title="mine"))
    assert registry.get(BUILTIN).title != "mine"


def row_unregistering_a_builtin_needs_the_override():
    with pytest.raises(ValueError, match=rf"'{BUILTIN}' is built into lazoo.*pass override_builtin=True"):
        registry.unregister(BUILTIN)
    assert_builtin_intact()


def row_with_the_override_a_builtin_is_swapped_removed_and_restored():
    original = registry.get(BUILTIN)
    variant = dataclasses.replace(original, mixer=toy_mixer(BUILTIN, base=delta.GatedDeltaNetMixer))
    registry.register(variant, replace=True, override_builtin=True)
    assert lazoo.MECHANISM_CONFIGS[BUILTIN] is configuration_mechanisms.LazooGatedDeltaNetConfig
    assert type(tiny_model(BUILTIN).model.layers[0].mixer) is variant.mixer
    registry.register(original, replace=True)  # lazoo's own declaration needs no override
    assert registry.get(BUILTIN) is original
    registry.unregister(BUILTIN, override_builtin=True)
    assert BUILTIN not in registry.mechanisms() and "lazoo_gated_delta_net" not in lazoo.MODEL_CLASSES
    registry.register(original)
    assert_builtin_intact()


def row_executing_a_builtin_module_again_keeps_it_builtin():
    importlib.reload(delta)
    assert registry.get(BUILTIN).mixer is delta.GatedDeltaNetMixer
    assert type(tiny_model(BUILTIN).model.layers[0].mixer) is delta.GatedDeltaNetMixer
    with pytest.raises(ValueError, match="override_builtin=True"):
        registry.unregister(BUILTIN)


# ----------------------------------------------------------------------------- one's own mechanisms
def row_a_same_named_class_from_another_module_needs_replace():
    first = declaration("toy_twin", toy_mixer("toy_twin", module="package_a", qualname="TwinMixer"))
    registry.register(first)
    impostor = declaration("toy_twin", toy_mixer("toy_twin", module="package_b", qualname="TwinMixer"))
    with pytest.raises(ValueError, match=r"'toy_twin' is already registered \(by package_a.TwinMixer\); pass "
                                         r"replace=True"):
        registry.register(impostor)
    assert registry.get("toy_twin") is first


def row_the_same_declaration_twice_changes_nothing():
    toy = registry.register(declaration("toy_again"))
    config_class = lazoo.MECHANISM_CONFIGS["toy_again"]
    assert registry.register(toy) is toy and registry.register(dataclasses.replace(toy)) is toy
    builtin_config = lazoo.MECHANISM_CONFIGS[BUILTIN]
    registry.register(registry.get(BUILTIN))
    assert lazoo.MECHANISM_CONFIGS["toy_again"] is config_class and lazoo.MECHANISM_CONFIGS[BUILTIN] is builtin_config


def row_unregistering_an_unknown_name_is_an_error():
    with pytest.raises(ValueError, match=r"cannot unregister 'no_such_mechanism': no mechanism of that name .*"
                                         r"missing_ok=True"):
        registry.unregister("no_such_mechanism")
    registry.unregister("no_such_mechanism", missing_ok=True)


# ----------------------------------------------------------------------------- failures leave nothing behind
def row_a_failed_registration_leaves_nothing_and_the_corrected_one_registers():
    undone = []
    registry.on_register(lambda m: None, removal=undone.append)
    derive, broken = failing_listener("toy_broken")
    registry.on_register(derive)
    with pytest.raises(RuntimeError, match="bad options"):
        registry.register(declaration("toy_broken"))
    assert "toy_broken" not in registry.mechanisms() and "toy_broken" not in lazoo.MECHANISM_CONFIGS
    assert "lazoo_toy_broken" not in lazoo.MODEL_CLASSES and [m.name for m in undone] == ["toy_broken"]
    assert not hasattr(configuration_mechanisms, "LazooToyBrokenConfig")
    assert not hasattr(modeling_mechanisms, "LazooToyBrokenForCausalLM")
    broken[0] = False
    corrected = registry.register(declaration("toy_broken"))
    assert registry.get("toy_broken") is corrected and "toy_broken" in lazoo.MECHANISM_CONFIGS


def row_a_failed_replacement_puts_the_previous_declaration_back():
    first = registry.register(declaration("toy_swap"))
    derive, _ = failing_listener("toy_swap", "the variant's config fails")
    registry.on_register(lambda m: None if m is first else derive(m))
    with pytest.raises(RuntimeError, match="config fails"):
        registry.register(declaration("toy_swap"), replace=True)
    assert registry.get("toy_swap") is first
    config = AutoConfig.for_model("lazoo_toy_swap", hidden_size=16, num_attention_heads=2)
    assert type(config) is lazoo.MECHANISM_CONFIGS["toy_swap"] is configuration_mechanisms.LazooToySwapConfig
    assert lazoo.MODEL_CLASSES["lazoo_toy_swap"][0] is type(config)


def fail_to_remove(mechanism):
    raise RuntimeError("removal fails")


def row_a_removal_that_fails_does_not_stop_the_others():
    removed = []
    registry.on_register(lambda m: None, removal=lambda m: removed.append("before"))
    registry.on_register(lambda m: None, removal=fail_to_remove)
    registry.on_register(lambda m: None, removal=lambda m: removed.append("after"))
    registry.register(declaration("toy_removal"))
    with pytest.raises(RuntimeError, match="removal fails"):
        registry.unregister("toy_removal")
    assert sorted(removed) == ["after", "before"]
    assert "toy_removal" not in registry.mechanisms() and "toy_removal" not in lazoo.MECHANISM_CONFIGS


# ----------------------------------------------------------------------------- derived class names
def row_a_builtins_class_prefix_is_refused():
    with pytest.raises(ValueError, match=r"class_prefix 'LazooGatedDeltaNet' names the classes of mechanism "
                                         rf"'{BUILTIN}'"):
        registry.register(declaration("my_gdn", class_prefix="LazooGatedDeltaNet"))
    assert "my_gdn" not in registry.mechanisms()
    assert_builtin_intact()


def row_a_class_prefix_differing_from_a_builtins_only_in_case_is_refused():
    with pytest.raises(ValueError, match=rf"names the classes of mechanism '{BUILTIN}'"):
        registry.register(declaration("my_gdn", class_prefix="LazooGatedDeltanet"))
    assert "my_gdn" not in registry.mechanisms()


def row_a_class_prefix_that_would_rebind_lazoos_base_classes_is_refused():
    bases = {(module, name): getattr(module, name) for module, names in (
        (configuration_lazoo, ("LazooConfig", "PreTrainedConfig")),
        (modeling_lazoo, ("LazooModel", "LazooForCausalLM", "LazooPreTrainedModel", "PreTrainedModel")))
        for name in names}
    for prefix in ("Lazoo", "LazooPreTrained", "PreTrained"):
        with pytest.raises(ValueError, match=rf"class_prefix '{prefix}' would rebind .*; choose another class_prefix"):
            registry.register(declaration("toy_prefix", class_prefix=prefix))
        assert "toy_prefix" not in registry.mechanisms() and "toy_prefix" not in lazoo.MECHANISM_CONFIGS
    assert all(getattr(module, name) is cls for (module, name), cls in bases.items())
    assert not hasattr(configuration_mechanisms, "LazooPreTrainedConfig")  # derived, then undone


HARDENING = [pytest.param(row, id=row.__name__.removeprefix("row_")) for row in (
    row_hybrid_cannot_be_registered,
    row_hybrid_cannot_be_unregistered,
    row_a_reserved_name_is_taken_and_given_back_only_with_the_override,
    row_the_vision_model_type_cannot_be_taken,
    row_a_model_type_transformers_maps_elsewhere_cannot_be_taken,
    row_replacing_a_builtin_needs_the_override,
    row_a_class_from_another_module_with_a_builtins_name_is_refused,
    row_a_class_claiming_a_builtins_module_and_name_is_refused,
    row_a_builtins_mixer_with_other_fields_is_refused,
    row_unregistering_a_builtin_needs_the_override,
    row_with_the_override_a_builtin_is_swapped_removed_and_restored,
    row_executing_a_builtin_module_again_keeps_it_builtin,
    row_a_same_named_class_from_another_module_needs_replace,
    row_the_same_declaration_twice_changes_nothing,
    row_unregistering_an_unknown_name_is_an_error,
    row_a_failed_registration_leaves_nothing_and_the_corrected_one_registers,
    row_a_failed_replacement_puts_the_previous_declaration_back,
    row_a_removal_that_fails_does_not_stop_the_others,
    row_a_builtins_class_prefix_is_refused,
    row_a_class_prefix_differing_from_a_builtins_only_in_case_is_refused,
    row_a_class_prefix_that_would_rebind_lazoos_base_classes_is_refused,
)]


@pytest.mark.parametrize("row", HARDENING)
def test_hardening(row, isolated, single_thread):
    row()


# ----------------------------------------------------------------------------- what keeps working
def keeps_a_new_mechanism_registering_and_unregistering_without_keywords(tmp_path):
    toy = registry.register(declaration("toy_plain"))
    config = AutoConfig.for_model("lazoo_toy_plain", hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                  vocab_size=50)
    assert type(AutoModelForCausalLM.from_config(config).model.layers[0].mixer) is toy.mixer
    registry.unregister("toy_plain")
    assert "toy_plain" not in registry.mechanisms()


def keeps_executing_ones_own_mixer_module_again(tmp_path):
    (tmp_path / "own_mixer_module.py").write_text(textwrap.dedent("""
        from lazoo.layers.mixers.linear import LinearAttentionMixer
        from lazoo.registry import Mechanism, get, register

        class OwnMixer(LinearAttentionMixer):
            mechanism = "toy_own"

        linear = get("linear")
        register(Mechanism(name="toy_own", mixer=OwnMixer, op=linear.op, title="t", equation="e", source="s",
                           state="S", backends=linear.backends, kernels=linear.kernels))
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("own_mixer_module")
        first = module.OwnMixer
        importlib.reload(module)
        assert module.OwnMixer is not first and registry.get("toy_own").mixer is module.OwnMixer
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("own_mixer_module", None)


KEEPS_WORKING = [pytest.param(row, id=row.__name__.removeprefix("keeps_")) for row in (
    keeps_a_new_mechanism_registering_and_unregistering_without_keywords,
    keeps_executing_ones_own_mixer_module_again,
)]


@pytest.mark.parametrize("row", KEEPS_WORKING)
def test_keeps_working(row, isolated, tmp_path, single_thread):
    row(tmp_path)
