"""Transformers glue: configurations, models, the cache, and Auto-class registration."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .cache import LazooCache
from .configuration_lazoo import MECHANISM_CONFIGS, LazooConfig
from .modeling_lazoo import (MODEL_CLASSES, SEQUENCE_CLASSIFICATION_CLASSES, LazooForCausalLM,
                             LazooForSequenceClassification, LazooModel, LazooPreTrainedModel)


def register_auto_classes() -> None:
    """Make every lazoo model type loadable through AutoConfig/AutoModel/AutoModelForCausalLM and
    AutoModelForSequenceClassification."""
    for model_type, (config_cls, base_cls, lm_cls) in MODEL_CLASSES.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, base_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)
    for model_type, seqcls_cls in SEQUENCE_CLASSIFICATION_CLASSES.items():
        AutoModelForSequenceClassification.register(MODEL_CLASSES[model_type][0], seqcls_cls, exist_ok=True)


__all__ = [
    "LazooCache", "LazooConfig", "LazooForCausalLM", "LazooForSequenceClassification", "LazooModel",
    "LazooPreTrainedModel", "MECHANISM_CONFIGS", "MODEL_CLASSES", "SEQUENCE_CLASSIFICATION_CLASSES",
    "register_auto_classes",
]
