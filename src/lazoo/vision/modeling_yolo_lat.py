"""YOLO-LAT models: backbone, image classifier and anchor-free detector (see the config module for
the layout and where the two variants differ)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BackboneOutput, ImageClassifierOutput
from transformers.utils import ModelOutput, can_return_tuple

try:
    from transformers.backbone_utils import BackboneMixin
except ImportError:  # older transformers
    from transformers.utils.backbone_utils import BackboneMixin

from .attention import GlobalAttention2d
from .box_ops import xyxy_to_cxcywh
from .configuration_yolo_lat import YoloLatConfig
from .loss_yolo_lat import check_detection_labels, yolo_lat_loss


# ============================================================================ building blocks
class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm -> SiLU; ``groups=c_in`` makes it depthwise."""

    def __init__(self, c_in, c_out, kernel=1, stride=1, groups=1, config=None, act=True):
        eps = config.batch_norm_eps if config is not None else 1e-3
        momentum = config.batch_norm_momentum if config is not None else 0.03
        super().__init__(
            nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out, eps=eps, momentum=momentum),
            nn.SiLU() if act else nn.Identity(),
        )


def conv3x3(c_in, c_out, stride, config):
    """A 3×3 convolution outside the C2f blocks (down-sampling, head): dense, or depthwise 3×3 +
    pointwise 1×1 when the "lat" variant's ``lat_scope`` is "all"."""
    if config.variant == "lat" and config.lat_scope == "all":
        return nn.Sequential(ConvBNAct(c_in, c_in, 3, stride, groups=c_in, config=config),
                             ConvBNAct(c_in, c_out, 1, config=config))
    return ConvBNAct(c_in, c_out, 3, stride, config=config)


class ConvBottleneck(nn.Module):
    """Two dense 3×3 convolutions (+ residual): the "conv" variant's block."""

    def __init__(self, c, config, shortcut=True):
        super().__init__()
        self.cv1 = ConvBNAct(c, c, 3, config=config)
        self.cv2 = ConvBNAct(c, c, 3, config=config)
        self.shortcut = shortcut

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.shortcut else y


class LatBottleneck(nn.Module):
    """The "lat" variant's block: depthwise 3×3 + pointwise 1×1 (local mixing), then, where enabled,
    a residual branch of non-causal attention over all H×W positions (global mixing). Weights: about
    c² + 9c, plus 4c² with attention, against 18c² for the two dense 3×3 convolutions it replaces."""

    def __init__(self, c, config, shortcut=True, use_attention=False):
        super().__init__()
        self.dw = ConvBNAct(c, c, 3, groups=c, config=config)
        self.pw = ConvBNAct(c, c, 1, config=config)
        self.shortcut = shortcut
        self.attn = None
        if use_attention:
            self.attn_norm = nn.BatchNorm2d(c, eps=config.batch_norm_eps, momentum=config.batch_norm_momentum)
            self.attn = GlobalAttention2d(c, config.attention_heads, config.attention, config.attention_kwargs)

    def forward(self, x):
        y = self.pw(self.dw(x))
        y = x + y if self.shortcut else y
        if self.attn is not None:
            y = y + self.attn(self.attn_norm(y))
        return y


class C2fBlock(nn.Module):
    """C2f-like block: a 1×1 conv splits the input into two halves; n bottlenecks run one after the
    other on the second half, and every intermediate output is concatenated and fused by a 1×1 conv."""

    def __init__(self, c_in, c_out, n, config, stride, shortcut=True):
        super().__init__()
        c = c_out // 2
        self.cv1 = ConvBNAct(c_in, 2 * c, 1, config=config)
        self.cv2 = ConvBNAct((2 + n) * c, c_out, 1, config=config)
        if config.variant == "conv":
            blocks = [ConvBottleneck(c, config, shortcut) for _ in range(n)]
        else:
            use_attention = stride >= config.attention_min_stride
            blocks = [LatBottleneck(c, config, shortcut, use_attention) for _ in range(n)]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        parts = list(self.cv1(x).chunk(2, 1))
        for block in self.blocks:
            parts.append(block(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling (fast): three chained 5×5 max-pools, concatenated."""

    def __init__(self, c_in, c_out, config):
        super().__init__()
        c = c_in // 2
        self.cv1 = ConvBNAct(c_in, c, 1, config=config)
        self.cv2 = ConvBNAct(4 * c, c_out, 1, config=config)

    def forward(self, x):
        x = self.cv1(x)
        p1 = F.max_pool2d(x, 5, 1, 2)
        p2 = F.max_pool2d(p1, 5, 1, 2)
        p3 = F.max_pool2d(p2, 5, 1, 2)
        return self.cv2(torch.cat([x, p1, p2, p3], 1))


class YoloLatStage(nn.Module):
    def __init__(self, c_in, c_out, n, config, stride, sppf=False):
        super().__init__()
        self.down = conv3x3(c_in, c_out, 2, config)
        self.block = C2fBlock(c_out, c_out, n, config, stride, shortcut=True)
        self.sppf = SPPF(c_out, c_out, config) if sppf else None

    def forward(self, x):
        x = self.block(self.down(x))
        return self.sppf(x) if self.sppf is not None else x


class YoloLatEncoder(nn.Module):
    """Stem + 4 stages; returns the output of each (``stage_names`` order)."""

    def __init__(self, config):
        super().__init__()
        w, d = config.widths, config.depths
        self.stem = ConvBNAct(config.num_channels, w[0], 3, 2, config=config)
        self.stages = nn.ModuleList(
            YoloLatStage(w[i], w[i + 1], d[i], config, stride=2 ** (i + 2), sppf=(i == 3)) for i in range(4))

    def forward(self, pixel_values):
        x = self.stem(pixel_values)
        outs = [x]
        for stage in self.stages:
            x = stage(x)
            outs.append(x)
        return outs


# ============================================================================ input checks
def check_pixel_values(pixel_values, num_channels: int, multiple: int = 1) -> None:
    """``pixel_values`` is a float tensor ``[batch, num_channels, height, width]`` with batch, height and width
    >= 1 (height and width multiples of ``multiple``), else a ValueError naming the problem."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or not pixel_values.is_floating_point():
        got = (f"a {pixel_values.dtype} tensor of shape {tuple(pixel_values.shape)}"
               if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__)
        raise ValueError(f"pixel_values must be a float tensor [batch, {num_channels}, height, width], got {got}")
    B, C, H, W = pixel_values.shape
    if C != num_channels:
        raise ValueError(f"pixel_values has {C} channels, the config's num_channels={num_channels}")
    if B == 0 or H == 0 or W == 0:
        raise ValueError(f"pixel_values is empty (shape {tuple(pixel_values.shape)}): batch, height and width "
                         "must be >= 1")
    if H % multiple or W % multiple:
        raise ValueError(f"pixel_values height and width must be multiples of {multiple}, got {H}x{W}")


def check_class_labels(labels, batch: int, num_labels: int) -> torch.Tensor:
    """Image classification ``labels``: ``[batch]`` class ids in [0, num_labels), or finite regression
    targets when ``num_labels == 1``."""
    labels = torch.as_tensor(labels)
    if labels.dim() != 1 or len(labels) != batch:
        raise ValueError(f"labels must have shape [batch] = [{batch}], got {tuple(labels.shape)}")
    if num_labels == 1:
        if not bool(torch.isfinite(labels.float()).all()):
            raise ValueError("labels (regression targets, num_labels=1) contain NaN or Inf")
        return labels
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be integer class ids in [0, num_labels={num_labels}), got {labels.dtype}")
    bad = (labels < 0) | (labels >= num_labels)
    if bool(bad.any()):
        raise ValueError(f"labels must be class ids in [0, num_labels={num_labels}), got {int(labels[bad][0])}")
    return labels


# ============================================================================ pretrained base
class YoloLatPreTrainedModel(PreTrainedModel):
    config_class = YoloLatConfig
    config: YoloLatConfig
    base_model_prefix = "yolo_lat"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = False
    accepts_loss_kwargs = False  # the losses are per-image means: no `num_items_in_batch`

    def _wants_hidden_states(self, output_hidden_states: bool | None) -> bool:
        """The forward argument, or the config's `output_hidden_states` when it is None (transformers' rule)."""
        return bool(self.config.output_hidden_states if output_hidden_states is None else output_hidden_states)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # torch's default conv init
            if module.bias is not None:
                fan_in = module.weight[0].numel()
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(module.bias, -bound, bound)
                prior = getattr(module, "prior_bias", None)  # the head's output convs
                if prior is not None:
                    nn.init.constant_(module.bias, prior)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
            module.running_mean.zero_()
            module.running_var.fill_(1.0)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.01)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


# ============================================================================ backbone
class YoloLatBackbone(BackboneMixin, YoloLatPreTrainedModel):
    has_attentions = False

    def __init__(self, config: YoloLatConfig):
        super().__init__(config)
        self.num_features = list(config.widths)
        self.encoder = YoloLatEncoder(config)
        self.post_init()

    @can_return_tuple
    def forward(self, pixel_values, output_hidden_states=None, **kwargs) -> BackboneOutput:
        check_pixel_values(pixel_values, self.config.num_channels)
        hidden_states = tuple(self.encoder(pixel_values))
        feature_maps = tuple(h for name, h in zip(self.stage_names, hidden_states) if name in self.out_features)
        return BackboneOutput(feature_maps=feature_maps,
                              hidden_states=hidden_states if self._wants_hidden_states(output_hidden_states) else None,
                              attentions=None)


# ============================================================================ classification
class YoloLatForImageClassification(YoloLatPreTrainedModel):
    """Backbone -> global average pool of the last stage -> linear. Loss: cross-entropy on integer
    ``labels`` (mean squared error when ``num_labels == 1``)."""

    def __init__(self, config: YoloLatConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = YoloLatEncoder(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.widths[-1], config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, pixel_values, labels=None, output_hidden_states=None, **kwargs) -> ImageClassifierOutput:
        check_pixel_values(pixel_values, self.config.num_channels)
        if labels is not None:
            labels = check_class_labels(labels, len(pixel_values), self.num_labels)
        hidden_states = self.encoder(pixel_values)
        pooled = hidden_states[-1].mean((2, 3))
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        hs = tuple(hidden_states) if self._wants_hidden_states(output_hidden_states) else None
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hs)


# ============================================================================ detection
@dataclass
class YoloLatObjectDetectionOutput(ModelOutput):
    """``logits [B, A, num_labels]`` (pre-sigmoid) and ``pred_boxes [B, A, 4]`` (normalised cxcywh)
    for the A anchor points of strides 8/16/32, in that order, row-major within each level."""

    loss: torch.Tensor | None = None
    loss_dict: dict | None = None
    logits: torch.Tensor | None = None
    pred_boxes: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class YoloLatNeck(nn.Module):
    """PAN: top-down (stride 32 -> 16 -> 8) then bottom-up (8 -> 16 -> 32) fusion with C2f-like blocks."""

    def __init__(self, config):
        super().__init__()
        c3, c4, c5 = config.widths[2], config.widths[3], config.widths[4]
        n = max(1, config.depths[-1])
        self.top4 = C2fBlock(c5 + c4, c4, n, config, stride=16, shortcut=False)
        self.top3 = C2fBlock(c4 + c3, c3, n, config, stride=8, shortcut=False)
        self.down3 = conv3x3(c3, c3, 2, config)
        self.bottom4 = C2fBlock(c3 + c4, c4, n, config, stride=16, shortcut=False)
        self.down4 = conv3x3(c4, c4, 2, config)
        self.bottom5 = C2fBlock(c4 + c5, c5, n, config, stride=32, shortcut=False)

    def forward(self, p3, p4, p5):
        t4 = self.top4(torch.cat([F.interpolate(p5, size=p4.shape[-2:], mode="nearest"), p4], 1))
        o3 = self.top3(torch.cat([F.interpolate(t4, size=p3.shape[-2:], mode="nearest"), p3], 1))
        o4 = self.bottom4(torch.cat([self.down3(o3), t4], 1))
        o5 = self.bottom5(torch.cat([self.down4(o4), p5], 1))
        return [o3, o4, o5]


class YoloLatDetectionHead(nn.Module):
    """Anchor-free decoupled head: per level, a box branch predicting the distances (left, top,
    right, bottom) from the anchor point in units of the stride, and a class branch."""

    strides = (8, 16, 32)

    def __init__(self, config):
        super().__init__()
        in_ch = config.widths[2:]
        hb = config.head_width or max(16, in_ch[0] // 2)
        hc = config.head_width or max(in_ch[0], min(config.num_labels, 128))
        self.num_labels = config.num_labels
        self.box = nn.ModuleList(nn.Sequential(conv3x3(c, hb, 1, config), conv3x3(hb, hb, 1, config),
                                               nn.Conv2d(hb, 4, 1)) for c in in_ch)
        self.cls = nn.ModuleList(nn.Sequential(conv3x3(c, hc, 1, config), conv3x3(hc, hc, 1, config),
                                               nn.Conv2d(hc, config.num_labels, 1)) for c in in_ch)

        for box, cls, stride in zip(self.box, self.cls, self.strides):
            # initial biases (set in `_init_weights`): a class probability of about 5 objects per
            # image spread over the classes and anchor points (at most 1%), so that the many
            # negatives do not swamp the first steps; boxes reach one stride from the anchor on
            # every side (softplus(log(e - 1)) = 1)
            p = min(0.01, 5.0 / config.num_labels / (config.image_size / stride) ** 2)
            cls[-1].prior_bias = -math.log((1 - p) / p)
            box[-1].prior_bias = math.log(math.e - 1.0)

    def forward(self, features):
        logits, dists, anchors, strides = [], [], [], []
        for feat, box, cls, stride in zip(features, self.box, self.cls, self.strides):
            B, _, H, W = feat.shape
            logits.append(cls(feat).flatten(2).transpose(1, 2))
            dists.append(F.softplus(box(feat).float()).flatten(2).transpose(1, 2) * stride)
            ys, xs = torch.meshgrid(torch.arange(H, device=feat.device), torch.arange(W, device=feat.device),
                                    indexing="ij")
            anchors.append((torch.stack([xs, ys], -1).reshape(-1, 2).float() + 0.5) * stride)
            strides.append(torch.full((H * W,), float(stride), device=feat.device))
        return torch.cat(logits, 1), torch.cat(dists, 1), torch.cat(anchors, 0), torch.cat(strides, 0)


class YoloLatForObjectDetection(YoloLatPreTrainedModel):
    """Backbone (stages 2-4) -> PAN neck -> anchor-free head at strides 8/16/32. ``labels``: one dict
    per image with ``class_labels`` LongTensor [n] and ``boxes`` FloatTensor [n, 4] (normalised cxcywh)."""

    def __init__(self, config: YoloLatConfig):
        super().__init__(config)
        self.encoder = YoloLatEncoder(config)
        self.neck = YoloLatNeck(config)
        self.head = YoloLatDetectionHead(config)
        self.post_init()

    @can_return_tuple
    def forward(self, pixel_values, labels=None, output_hidden_states=None, **kwargs) -> YoloLatObjectDetectionOutput:
        check_pixel_values(pixel_values, self.config.num_channels, multiple=32)
        H, W = pixel_values.shape[-2:]
        if labels is not None:
            check_detection_labels(labels, len(pixel_values), self.config.num_labels)
        hidden_states = self.encoder(pixel_values)
        features = self.neck(*hidden_states[2:])
        logits, dists, anchors, _ = self.head(features)
        boxes_xyxy = torch.cat([anchors - dists[..., :2], anchors + dists[..., 2:]], -1)  # pixels
        # x by the width, y by the height, as Python numbers: no host-to-device copy (a CUDA graph can capture it)
        corners = boxes_xyxy.unflatten(-1, (2, 2))
        pred_boxes = xyxy_to_cxcywh(torch.stack([corners[..., 0] / W, corners[..., 1] / H], -1).flatten(-2))

        loss = loss_dict = None
        if labels is not None:
            loss, loss_dict = yolo_lat_loss(logits, boxes_xyxy, anchors, labels, (H, W), self.config)
        hs = tuple(hidden_states) if self._wants_hidden_states(output_hidden_states) else None
        return YoloLatObjectDetectionOutput(loss=loss, loss_dict=loss_dict, logits=logits, pred_boxes=pred_boxes,
                                            hidden_states=hs)
