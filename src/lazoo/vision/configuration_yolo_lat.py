"""`YoloLatConfig`: one layout for a light YOLO-style detector / backbone, in two variants.

Layout (strides in brackets): stem 3×3/2 conv [2] -> 4 stages, each a 3×3/2 conv then a C2f-like
block of ``depths[i]`` bottlenecks [4, 8, 16, 32]; the last stage ends with SPPF. The detector adds a
PAN neck (top-down then bottom-up, C2f-like blocks) over stages 2-4 and an anchor-free decoupled head
at strides 8/16/32.

``variant="conv"``: every bottleneck is two dense 3×3 convolutions (the YOLOv8 bottleneck).
``variant="lat"``: every bottleneck replaces them by depthwise-separable local mixing (depthwise 3×3
+ pointwise 1×1), and the bottlenecks working at stride >= ``attention_min_stride`` (default 16:
backbone stages 3-4 and the neck blocks at strides 16 and 32) add non-causal global mixing over the
H×W positions with the mechanism ``attention`` ("linear": elu+1, normalised; "ela"; "softmax"), as a
residual branch. With ``lat_scope="blocks"`` (default) the stride-2 down-sampling convolutions, SPPF
and the head are the same in both variants, so the comparison isolates the blocks; ``lat_scope="all"``
also makes every other 3×3 convolution but the stem's depthwise-separable (down-sampling, head).
"""

from __future__ import annotations

from transformers import PreTrainedConfig

try:
    from transformers.backbone_utils import BackboneConfigMixin
except ImportError:  # older transformers
    from transformers.utils.backbone_utils import BackboneConfigMixin

VARIANTS = ("lat", "conv")


class YoloLatConfig(BackboneConfigMixin, PreTrainedConfig):
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
        widths, depths = list(widths), list(depths)
        if len(widths) != 5 or len(depths) != 4:
            raise ValueError(f"widths needs 5 entries (stem + 4 stages) and depths 4, got {widths} and {depths}")
        if attention not in GLOBAL_ATTENTIONS:
            raise ValueError(f"attention must be one of {GLOBAL_ATTENTIONS}, got {attention!r}")
        if lat_scope not in ("blocks", "all"):
            raise ValueError(f"lat_scope must be 'blocks' or 'all', got {lat_scope!r}")
        if box_loss not in ("ciou", "giou"):
            raise ValueError(f"box_loss must be 'ciou' or 'giou', got {box_loss!r}")
        if variant == "lat":
            for stride, width in zip((16, 32), (widths[3], widths[4])):
                if stride >= attention_min_stride and (width // 2) % attention_heads:
                    raise ValueError(f"attention_heads={attention_heads} must divide the block width {width // 2} "
                                     f"at stride {stride}")
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
        super().__init__(**kwargs)

    @property
    def strides(self) -> list[int]:
        """Stride of each stage in ``stage_names``."""
        return [2, 4, 8, 16, 32]
