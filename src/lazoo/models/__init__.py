"""Transformers glue: configurations, models, the cache, and Auto-class registration."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from ..registry import Mechanism, on_register
from . import configuration_mechanisms, modeling_mechanisms  # noqa: F401 (they fill the class tables)
from .cache import LazooCache
from .configuration_lazoo import MECHANISM_CONFIGS, LazooConfig
from .modeling_lazoo import (
    MODEL_CLASSES,
    SEQUENCE_CLASSIFICATION_CLASSES,
    LazooForCausalLM,
    LazooForSequenceClassification,
    LazooModel,
    LazooPreTrainedModel,
)


def _register_model_type(model_type: str) -> None:
    config_cls, base_cls, lm_cls = MODEL_CLASSES[model_type]
    AutoConfig.register(model_type, config_cls, exist_ok=True)
    AutoModel.register(config_cls, base_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)
    AutoModelForSequenceClassification.register(config_cls, SEQUENCE_CLASSIFICATION_CLASSES[model_type],
                                                exist_ok=True)


def _register_mechanism(mechanism: Mechanism) -> None:
    _register_model_type(mechanism.model_type)


_registered = False


def register_auto_classes() -> None:
    """Make every lazoo model type loadable through AutoConfig, AutoModel, AutoModelForCausalLM and
    AutoModelForSequenceClassification: `lazoo_hybrid` and every registered mechanism, including mechanisms
    registered later (`lazoo.registry.register`)."""
    global _registered
    if _registered:
        return
    _registered = True
    _register_model_type("lazoo_hybrid")
    on_register(_register_mechanism)


__all__ = [
    "LazooCache", "LazooConfig", "LazooForCausalLM", "LazooForSequenceClassification", "LazooModel",
    "LazooPreTrainedModel", "MECHANISM_CONFIGS", "MODEL_CLASSES", "SEQUENCE_CLASSIFICATION_CLASSES",
    "register_auto_classes",
]
