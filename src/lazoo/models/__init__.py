"""Transformers glue: configurations, models, the cache, and Auto-class registration."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import LazooCache
from .configuration_lazoo import MECHANISM_CONFIGS, LazooConfig
from .modeling_lazoo import MODEL_CLASSES, LazooForCausalLM, LazooModel, LazooPreTrainedModel


def register_auto_classes() -> None:
    """Make every lazoo model type loadable through AutoConfig/AutoModel/AutoModelForCausalLM."""
    for model_type, (config_cls, base_cls, lm_cls) in MODEL_CLASSES.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, base_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)


__all__ = [
    "LazooCache", "LazooConfig", "LazooForCausalLM", "LazooModel", "LazooPreTrainedModel",
    "MECHANISM_CONFIGS", "MODEL_CLASSES", "register_auto_classes",
]
