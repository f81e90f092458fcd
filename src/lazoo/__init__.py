"""lazoo: a Transformers model zoo of linear-time and hybrid attention mechanisms.

`import lazoo` registers every model type (`lazoo_<mechanism>`, `lazoo_hybrid`) on AutoConfig, AutoModel
and AutoModelForCausalLM, and `lazoo_yolo_lat` (vision) on AutoConfig, AutoBackbone, AutoModelForObjectDetection,
AutoModelForImageClassification and AutoImageProcessor.
"""

from . import ops, registry
from .layers.mixers import list_mechanisms
from .models import MECHANISM_CONFIGS, MODEL_CLASSES, LazooCache, LazooConfig, LazooForCausalLM, LazooModel
from .models import register_auto_classes as _register
from .vision import (
                     YoloLatBackbone,
                     YoloLatConfig,
                     YoloLatForImageClassification,
                     YoloLatForObjectDetection,
                     YoloLatImageProcessor,
)
from .vision import register_vision_auto_classes as _register_vision

_register()
_register_vision()

__version__ = "0.1.0"
__all__ = ["ops", "registry", "list_mechanisms", "LazooCache", "LazooConfig", "LazooForCausalLM", "LazooModel",
           "MECHANISM_CONFIGS", "MODEL_CLASSES", "YoloLatBackbone", "YoloLatConfig", "YoloLatForImageClassification",
           "YoloLatForObjectDetection", "YoloLatImageProcessor"]
