"""`YoloLatConfig`: one layout for a light YOLO-style detector / backbone, in two variants.

Layout (strides in brackets): stem 3×3/2 conv [2] -> 4 stages, each a 3×3/2 conv then a C2f-like
block of ``depths[i]`` bottlenecks [4, 8, 16, 32]; the last stage ends with SPPF. The detector adds a
PAN neck (top-down then bottom-up, C2f-like blocks) over stages 2-4 and an anchor-free decoupled head
at strides 8/16/32.

``variant="conv"``: every bottleneck is two dense 3×3 convolutions (the YOLOv8 bottleneck).
``variant="lat"``: every bottleneck replaces them by depthwise-separable local mixing (depthwise 3×3
+ pointwise 1×1), and the bottlenecks working at stride >= ``attention_min_stride`` (default 16:
backbone stages 3-4 and the neck blocks at strides 16 and 32; above 32: none) add non-causal global mixing over the
H×W positions with the mechanism ``attention`` ("linear": elu+1, normalised; "ela"; "softmax"), as a
residual branch. With ``lat_scope="blocks"`` (default) the stride-2 down-sampling convolutions, SPPF
and the head are the same in both variants, so the comparison isolates the blocks; ``lat_scope="all"``
also makes every other 3×3 convolution but the stem's depthwise-separable (down-sampling, head).
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..models.field_checks import check_int, check_number
from ..models.saving import ExportsCode

try:
    from transformers.backbone_utils import BackboneConfigMixin
except ImportError:  # older transformers
    from transformers.utils.backbone_utils import BackboneConfigMixin

VARIANTS = ("lat", "conv")
#: what the entries of the per-stage lists size
_PER_STAGE = {"widths": "channels of the stem and the 4 stages", "depths": "bottlenecks of each of the 4 stages"}


def _int_list(field: str, values, length: int, minimum: int) -> list[int]:
    """`values` as a list of `length` ints >= `minimum`, else a ValueError naming `field`."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != length:
        raise ValueError(f"{field} must be a list of {length} ints ({_PER_STAGE[field]}), got {values!r}")
    for value in values:
        check_int(f"every entry of {field}", value, minimum=minimum, note=f" ({field}={list(values)})")
    return list(values)


class YoloLatConfig(ExportsCode, BackboneConfigMixin, PreTrainedConfig):
    model_type = "lazoo_yolo_lat"
    # Trainer's evaluation loop gathers every output but these (loss_dict holds per-batch scalars)
    keys_to_ignore_at_inference = ["loss_dict", "hidden_states"]

    def __init__(
        self,
        variant: str = "lat",
        num_labels: int | None = None,
        num_channels: int = 3,
        image_size: int = 320,
        widths: list[int] | tuple[int, ...] = (16, 32, 64, 128, 256),
        depths: list[int] | tuple[int, ...] = (1, 2, 2, 1),
        attention: str = "linear",
        attention_kwargs: dict | None = None,
        attention_heads: int = 4,
        attention_min_stride: int = 16,
        lat_scope: str = "blocks",
        head_width: int | None = None,
        cls_loss_weight: float = 1.0,
        box_loss_weight: float = 5.0,
        assigner_topk: int = 10,
        assigner_alpha: float = 0.5,
        assigner_beta: float = 6.0,
        box_loss: str = "ciou",
        classifier_dropout: float = 0.0,
        batch_norm_eps: float = 1e-3,
        batch_norm_momentum: float = 0.03,
        out_features: list[str] | None = None,
        out_indices: list[int] | None = None,
        **kwargs,
    ):
        from .attention import GLOBAL_ATTENTIONS

        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if attention not in GLOBAL_ATTENTIONS:
            raise ValueError(f"attention must be one of {GLOBAL_ATTENTIONS}, got {attention!r}")
        if lat_scope not in ("blocks", "all"):
            raise ValueError(f"lat_scope must be 'blocks' or 'all', got {lat_scope!r}")
        if box_loss not in ("ciou", "giou"):
            raise ValueError(f"box_loss must be 'ciou' or 'giou', got {box_loss!r}")
        widths, depths = _int_list("widths", widths, 5, 2), _int_list("depths", depths, 4, 0)
        self.variant = variant
        self.num_channels = num_channels
        self.image_size = image_size
        self.widths = widths
        self.depths = depths
        self.attention = attention
        self.attention_kwargs = dict(attention_kwargs or {})
        self.attention_heads = attention_heads
        self.attention_min_stride = attention_min_stride
        self.lat_scope = lat_scope
        self.head_width = head_width
        self.cls_loss_weight = cls_loss_weight
        self.box_loss_weight = box_loss_weight
        self.assigner_topk = assigner_topk
        self.assigner_alpha = assigner_alpha
        self.assigner_beta = assigner_beta
        self.box_loss = box_loss
        self.classifier_dropout = classifier_dropout
        self.batch_norm_eps = batch_norm_eps
        self.batch_norm_momentum = batch_norm_momentum
        self.stage_names = ["stem"] + [f"stage{i}" for i in range(1, 5)]
        self.set_output_features_output_indices(out_features=out_features, out_indices=out_indices)
        if num_labels is not None:
            kwargs["num_labels"] = num_labels
        check_int("num_labels", 2 if num_labels is None else num_labels)  # before transformers builds id2label
        self.check_fields()
        super().__init__(**kwargs)
        self.check_num_labels()

    def check_fields(self) -> None:
        """Clear errors, naming the field and its allowed values, for the sizes and numeric fields (run by
        `__init__` and `validate`)."""
        _int_list("widths", self.widths, 5, 2)
        _int_list("depths", self.depths, 4, 0)
        for field in ("num_channels", "image_size", "attention_heads", "attention_min_stride", "assigner_topk"):
            check_int(field, getattr(self, field))
        check_int("head_width", self.head_width, allow_none=True)
        for field in ("cls_loss_weight", "box_loss_weight", "assigner_alpha", "assigner_beta"):
            check_number(field, getattr(self, field), positive=False)
        check_number("batch_norm_eps", self.batch_norm_eps, positive=True)
        for field in ("classifier_dropout", "batch_norm_momentum"):
            value = getattr(self, field)
            check_number(field, value, positive=False)
            if value > 1 or (field == "classifier_dropout" and value == 1):
                raise ValueError(f"{field} must be in [0, 1{')' if field == 'classifier_dropout' else ']'}, "
                                 f"got {value!r}")
        if self.variant == "lat":
            for stride, width in zip((16, 32), (self.widths[3], self.widths[4])):
                if stride >= self.attention_min_stride and (width // 2) % self.attention_heads:
                    raise ValueError(f"attention_heads={self.attention_heads} must divide the block width "
                                     f"{width // 2} at stride {stride}")

    def check_num_labels(self) -> None:
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be a positive int (the number of classes; 1 = one class for "
                             f"detection, a regression target for classification), got {self.num_labels}")

    def validate(self):
        """transformers' validators, then `check_fields` and `check_num_labels`."""
        super().validate()
        self.check_fields()
        self.check_num_labels()

    def to_dict(self) -> dict:
        """`PreTrainedConfig.to_dict` (what `save_pretrained` writes) without `use_cache`: a YOLO-LAT model keeps no
        cache, and the False that transformers' Trainer assigns for training would otherwise be saved."""
        output = super().to_dict()
        output.pop("use_cache", None)
        return output

    @property
    def strides(self) -> list[int]:
        """Stride of each stage in ``stage_names``."""
        return [2, 4, 8, 16, 32]
