"""`YoloLatImageProcessor`: letterbox images (and boxes) to a square input, and map detections back.

Letterbox: scale by r = min(S / h, S / w) (aspect kept), resize with PIL to (round(w·r), round(h·r)),
centre on an S×S canvas filled with ``pad_value``. Pixels are then rescaled (``rescale_factor``) and
normalised with ``image_mean`` / ``image_std``. Boxes follow the same affine map: x' = x·r + pad_left,
y' = y·r + pad_top; ``post_process_object_detection`` inverts it using ``target_sizes``.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from ..models.field_checks import check_int, check_number
from ..models.saving import ExportsCode
from .box_ops import batched_nms, cxcywh_to_xyxy, xyxy_to_cxcywh
from .configuration_yolo_lat import YoloLatConfig


def letterbox_geometry(height: int, width: int, size: int) -> tuple[float, int, int, int, int]:
    """``(r, new_h, new_w, pad_top, pad_left)`` of the letterbox of an ``height``×``width`` image."""
    r = min(size / height, size / width)
    new_h, new_w = max(1, round(height * r)), max(1, round(width * r))
    return r, new_h, new_w, (size - new_h) // 2, (size - new_w) // 2


def _to_pil(image, index: int = 0) -> Image.Image:
    """PIL image, HWC/HW numpy array (uint8, or float in [0, 1]) or CHW torch tensor -> RGB PIL image of at
    least 1x1 pixels (`index`: the image's place in the batch, for the error message)."""
    pil = _any_to_pil(image)
    if pil.width < 1 or pil.height < 1:
        raise ValueError(f"images[{index}] is empty ({pil.width}x{pil.height} pixels): every image needs a width "
                         "and a height >= 1")
    return pil


def _any_to_pil(image) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
        if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4):
            image = image.transpose(1, 2, 0)
    if not isinstance(image, np.ndarray):
        raise TypeError(f"images must be PIL images, numpy arrays or torch tensors, got {type(image).__name__}")
    if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4):
        image = image.transpose(1, 2, 0)  # CHW -> HWC
    if image.dtype != np.uint8:
        image = np.clip(np.asarray(image, dtype=np.float64) * 255.0, 0, 255).round().astype(np.uint8)
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    if image.size == 0:  # Image.fromarray refuses empty arrays: `_to_pil` reports the empty image
        return Image.new("RGB", (image.shape[1], image.shape[0]) if image.ndim >= 2 else (0, 0))
    return Image.fromarray(image).convert("RGB")


#: keys transformers itself writes into (or passes from) a saved processor config; any other keyword argument
#: the processor does not know is an error
TRANSFORMERS_KEYS = frozenset({"image_processor_type", "feature_extractor_type", "processor_class",
                               "_processor_class", "auto_map"})
#: what to use instead of keyword arguments that other transformers image processors take
HINTS = {"size": "the letterbox side is `image_size`, one int (the input is image_size x image_size)",
         "do_resize": "every image is letterboxed to `image_size` x `image_size`",
         "do_pad": "every image is letterboxed (padded with `pad_value`) to `image_size` x `image_size`"}


def reject_unknown_kwargs(where: str, kwargs: dict) -> None:
    """A TypeError naming every keyword argument in `kwargs` (with a hint for the usual transformers names)."""
    if not kwargs:
        return
    hints = "; ".join(f"{k!r}: {HINTS[k]}" for k in kwargs if k in HINTS)
    raise TypeError(f"{where} got unknown keyword argument(s) {sorted(kwargs)}" + (f" ({hints})" if hints else ""))


class YoloLatImageProcessor(ExportsCode, BaseImageProcessor):
    """Letterbox to a square ``image_size`` input (see the module docstring). The parameters are this
    class's own: an unknown keyword argument raises a TypeError, including transformers' usual ``size``
    (not mapped to ``image_size``, since other processors give it as a dict of height/width or edge
    lengths: write ``image_size=<side>``)."""

    model_input_names = ["pixel_values"]

    def __init__(self, image_size: int = 320, pad_value: int = 114, resample: int = Image.BILINEAR,
                 do_rescale: bool = True, rescale_factor: float = 1 / 255, do_normalize: bool = True,
                 image_mean: list[float] | None = None, image_std: list[float] | None = None,
                 min_box_size: float = 1.0, **kwargs):
        reject_unknown_kwargs("YoloLatImageProcessor", {k: v for k, v in kwargs.items() if k not in TRANSFORMERS_KEYS})
        super().__init__(**kwargs)
        self.image_size = image_size
        self.pad_value = pad_value
        self.resample = int(resample)
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = list(image_mean) if image_mean is not None else [0.485, 0.456, 0.406]
        self.image_std = list(image_std) if image_std is not None else [0.229, 0.224, 0.225]
        self.min_box_size = min_box_size
        self.check_fields()
        self.image_size, self.pad_value = int(image_size), int(pad_value)  # plain ints (numpy ones pass the check)

    def check_fields(self) -> None:
        """Clear errors naming the parameter and its allowed values."""
        check_int("image_size", self.image_size)
        check_int("pad_value", self.pad_value, minimum=0)
        if self.pad_value > 255:
            raise ValueError(f"pad_value must be an int in [0, 255], got {self.pad_value!r}")
        check_number("rescale_factor", self.rescale_factor, positive=True)
        check_number("min_box_size", self.min_box_size, positive=False)
        for field in ("image_mean", "image_std"):
            values = getattr(self, field)
            if len(values) != 3:
                raise ValueError(f"{field} must hold 3 numbers (one per RGB channel), got {values!r}")
            for value in values:
                check_number(f"every entry of {field}", value, positive=field == "image_std")

    @classmethod
    def from_dict(cls, image_processor_dict: dict, **kwargs):
        """transformers' `from_dict`; a YOLO-LAT model config (`model_type` "lazoo_yolo_lat", e.g. one of lazoo's
        `configs/yolo-lat-*.json` given to `AutoImageProcessor.from_pretrained` or to `from_pretrained`) gives the
        processor of that model: the default parameters with the config's `image_size`."""
        if image_processor_dict.get("model_type") == YoloLatConfig.model_type:
            size = image_processor_dict.get("image_size")
            image_processor_dict = {} if size is None else {"image_size": size}
        return super().from_dict(image_processor_dict, **kwargs)

    # ------------------------------------------------------------------------ preprocessing
    def __call__(self, images, annotations=None, return_tensors="pt", **kwargs) -> BatchFeature:
        return self.preprocess(images, annotations=annotations, return_tensors=return_tensors, **kwargs)

    def preprocess(self, images, annotations=None, return_tensors="pt", **kwargs) -> BatchFeature:
        """``images``: one image or a list, each at least 1x1. ``annotations``: None, or one dict per image
        with ``boxes`` (absolute xyxy pixels of the original image, [n, 4], finite, x2 >= x1 and y2 >= y1) and
        ``class_labels`` ([n] ints >= 0). Returns ``pixel_values [B, 3, S, S]`` and, with annotations,
        ``labels``: one dict per image with ``class_labels`` (LongTensor [n]) and ``boxes`` (FloatTensor [n, 4],
        normalised cxcywh of the letterboxed input; boxes smaller than ``min_box_size`` pixels after the
        letterbox are dropped). Unknown keyword arguments raise a TypeError."""
        reject_unknown_kwargs("YoloLatImageProcessor.preprocess", kwargs)
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' (or None for lists of numpy arrays), got {return_tensors!r}")
        single = not isinstance(images, (list, tuple))
        images = [images] if single else list(images)
        if annotations is not None:
            annotations = [annotations] if isinstance(annotations, dict) else list(annotations)
            if len(annotations) != len(images):
                raise ValueError(f"annotations must hold one dict per image: {len(annotations)} for "
                                 f"{len(images)} images")
        size = self.image_size
        pixels, labels = [], []
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        for i, image in enumerate(images):
            pil = _to_pil(image, i)
            w, h = pil.size
            r, nh, nw, top, left = letterbox_geometry(h, w, size)
            canvas = Image.new("RGB", (size, size), (self.pad_value,) * 3)
            canvas.paste(pil.resize((nw, nh), resample=self.resample), (left, top))
            arr = np.asarray(canvas, dtype=np.float32).transpose(2, 0, 1)
            if self.do_rescale:
                arr = arr * self.rescale_factor
            if self.do_normalize:
                arr = (arr - mean) / std
            pixels.append(arr)
            if annotations is not None:
                labels.append(self._letterbox_annotation(annotations[i], r, top, left, size, i))
        pixel_values = pixels if return_tensors is None else torch.from_numpy(np.stack(pixels))
        out = BatchFeature(data={"pixel_values": pixel_values})
        if annotations is not None:  # ragged: added after the BatchFeature conversion
            out["labels"] = labels
        return out

    def _letterbox_annotation(self, ann: dict, r: float, top: int, left: int, size: int, index: int) -> dict:
        """Annotation `index` (absolute xyxy boxes of the original image) checked, then moved by the letterbox."""
        if not isinstance(ann, dict) or "boxes" not in ann or "class_labels" not in ann:
            raise ValueError(f"annotations[{index}] must be a dict with 'boxes' (absolute xyxy) and 'class_labels'")
        boxes = torch.as_tensor(np.asarray(ann["boxes"], dtype=np.float32)).reshape(-1, 4)
        classes = torch.as_tensor(np.asarray(ann["class_labels"])).long().reshape(-1)
        if len(boxes) != len(classes):
            raise ValueError(f"annotations[{index}] has {len(boxes)} boxes but {len(classes)} class_labels")
        if not bool(torch.isfinite(boxes).all()):
            raise ValueError(f"annotations[{index}]['boxes'] contain NaN or Inf")
        if bool(((boxes[:, 2:] - boxes[:, :2]) < 0).any()):
            raise ValueError(f"annotations[{index}]['boxes'] must be absolute xyxy pixels (x1, y1, x2, y2) with "
                             "x2 >= x1 and y2 >= y1; a box has x2 < x1 or y2 < y1")
        if len(classes) and int(classes.min()) < 0:
            raise ValueError(f"annotations[{index}]['class_labels'] must be ints >= 0, got {int(classes.min())}")
        boxes = boxes * r + torch.tensor([left, top, left, top], dtype=torch.float32)
        boxes = boxes.clamp(0, size)
        keep = ((boxes[:, 2] - boxes[:, 0]) >= self.min_box_size) & ((boxes[:, 3] - boxes[:, 1]) >= self.min_box_size)
        return {"class_labels": classes[keep], "boxes": xyxy_to_cxcywh(boxes[keep] / size)}

    # ------------------------------------------------------------------------ post-processing
    def post_process_object_detection(self, outputs, threshold: float = 0.25, target_sizes=None,
                                      nms_iou: float = 0.5, max_detections: int = 300,
                                      max_candidates: int = 3000) -> list[dict]:
        """Per image: the best class of every anchor, kept when its probability is > ``threshold``,
        class-wise NMS at ``nms_iou``, at most ``max_detections``. Returns dicts with ``scores``,
        ``labels`` and ``boxes`` (xyxy): absolute pixels of the original image when ``target_sizes``
        ([B, 2] of (height, width), the sizes given to the processor) is set, else normalised to the
        letterboxed input."""
        logits, pred_boxes = outputs.logits, outputs.pred_boxes
        if target_sizes is not None and len(target_sizes) != len(logits):
            raise ValueError(f"target_sizes must have one (height, width) per image: {len(target_sizes)} "
                             f"for {len(logits)} images")
        results = []
        for b in range(len(logits)):
            probs = logits[b].detach().float().sigmoid()
            scores, classes = probs.max(-1)
            keep = scores > threshold
            scores, classes, boxes = scores[keep], classes[keep], cxcywh_to_xyxy(pred_boxes[b].detach().float()[keep])
            if len(scores) > max_candidates:
                top = scores.topk(max_candidates).indices
                scores, classes, boxes = scores[top], classes[top], boxes[top]
            kept = batched_nms(boxes, scores, classes, nms_iou)[:max_detections]
            scores, classes, boxes = scores[kept], classes[kept], boxes[kept]
            if target_sizes is not None:
                h, w = (int(v) for v in target_sizes[b])
                r, _, _, top, left = letterbox_geometry(h, w, self.image_size)
                offset = boxes.new_tensor([left, top, left, top])
                boxes = (boxes * self.image_size - offset) / r
                boxes = torch.stack([boxes[:, 0].clamp(0, w), boxes[:, 1].clamp(0, h),
                                     boxes[:, 2].clamp(0, w), boxes[:, 3].clamp(0, h)], -1)
            results.append({"scores": scores, "labels": classes, "boxes": boxes})
        return results
