"""YOLO-LAT (the ELA paper, §VII): a light YOLO-style backbone/classifier/detector whose dense 3×3 block
convolutions give way to depthwise-separable local mixing plus non-causal linear attention over the
H×W positions ("lat"), next to a dense-conv baseline of the same layout ("conv")."""

from transformers import (
    AutoBackbone,
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
    AutoModelForObjectDetection,
)

from ..ops.bidirectional import bidirectional_linear_attention
from .attention import GLOBAL_ATTENTIONS, GlobalAttention2d
from .configuration_yolo_lat import YoloLatConfig
from .image_processing_yolo_lat import YoloLatImageProcessor
from .modeling_yolo_lat import (
    YoloLatBackbone,
    YoloLatForImageClassification,
    YoloLatForObjectDetection,
    YoloLatObjectDetectionOutput,
    YoloLatPreTrainedModel,
)


def register_vision_auto_classes() -> None:
    """Make `lazoo_yolo_lat` loadable through AutoConfig, AutoBackbone, AutoModel (the backbone),
    AutoModelForObjectDetection, AutoModelForImageClassification and AutoImageProcessor.

    AutoBackbone.from_pretrained of a local folder asks the Hub whether the path is a repo before reading it
    (transformers 5.17-5.24) and fails: load a saved backbone with AutoModel or YoloLatBackbone.from_pretrained.
    Saved folders also load without lazoo, with trust_remote_code=True (`lazoo.models.export`)."""
    AutoConfig.register(YoloLatConfig.model_type, YoloLatConfig, exist_ok=True)
    AutoBackbone.register(YoloLatConfig, YoloLatBackbone, exist_ok=True)
    AutoModel.register(YoloLatConfig, YoloLatBackbone, exist_ok=True)
    AutoModelForObjectDetection.register(YoloLatConfig, YoloLatForObjectDetection, exist_ok=True)
    AutoModelForImageClassification.register(YoloLatConfig, YoloLatForImageClassification, exist_ok=True)
    try:
        AutoImageProcessor.register(YoloLatConfig, slow_image_processor_class=YoloLatImageProcessor, exist_ok=True)
    except ImportError:
        # transformers 5.17 (not 5.24) makes AutoImageProcessor a placeholder without torchvision: it raises its own
        # "requires the Torchvision library" when a user calls it; lazoo.YoloLatImageProcessor works without it
        pass


__all__ = [
    "GLOBAL_ATTENTIONS", "GlobalAttention2d", "YoloLatBackbone", "YoloLatConfig", "YoloLatForImageClassification",
    "YoloLatForObjectDetection", "YoloLatImageProcessor", "YoloLatObjectDetectionOutput", "YoloLatPreTrainedModel",
    "bidirectional_linear_attention", "register_vision_auto_classes",
]
