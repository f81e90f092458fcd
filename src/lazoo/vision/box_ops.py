"""Box utilities in plain torch: format conversion, IoU family, greedy NMS.

Formats: ``xyxy`` = (x1, y1, x2, y2), ``cxcywh`` = (centre x, centre y, width, height); the last dim
holds the 4 coordinates. "Pairwise" functions take ``[N, 4]`` and ``[M, 4]`` and return ``[N, M]``;
"aligned" functions take two tensors of the same shape ``[..., 4]`` and return ``[...]``.
"""

from __future__ import annotations

import math

import torch


def cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def xyxy_to_cxcywh(boxes: torch.Tensor) -> torch.Tensor:
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1)


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    """Area of xyxy boxes (0 for degenerate ones)."""
    return (boxes[..., 2] - boxes[..., 0]).clamp_min(0) * (boxes[..., 3] - boxes[..., 1]).clamp_min(0)


# ============================================================================ pairwise
def box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Pairwise IoU of xyxy boxes: ``[N, 4] x [M, 4] -> [N, M]``."""
    return _aligned_iou_terms(boxes1[:, None, :], boxes2[None, :, :], eps)[0]


def generalized_box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Pairwise GIoU of xyxy boxes: ``[N, 4] x [M, 4] -> [N, M]``, in [-1, 1]."""
    return aligned_box_iou(boxes1[:, None, :], boxes2[None, :, :], kind="giou", eps=eps)


# ============================================================================ aligned
def _aligned_iou_terms(a: torch.Tensor, b: torch.Tensor, eps: float):
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp_min(0)
    inter = wh[..., 0] * wh[..., 1]
    union = box_area(a) + box_area(b) - inter
    return inter / (union + eps), union


def aligned_box_iou(a: torch.Tensor, b: torch.Tensor, kind: str = "iou", eps: float = 1e-9) -> torch.Tensor:
    """IoU / GIoU / CIoU of matching xyxy boxes (broadcasting ``[..., 4]``).

    GIoU = IoU - (|C| - |A∪B|) / |C| with C the smallest enclosing box.
    CIoU = IoU - ρ²/c² - α v, with ρ the centre distance, c the enclosing box diagonal,
    v = 4/π² (atan(w_b/h_b) - atan(w_a/h_a))², α = v / (1 - IoU + v) (α carries no gradient).
    """
    if kind not in ("iou", "giou", "ciou"):
        raise ValueError(f"aligned_box_iou: kind must be 'iou', 'giou' or 'ciou', got {kind!r}")
    iou, union = _aligned_iou_terms(a, b, eps)
    if kind == "iou":
        return iou
    enc_lt = torch.minimum(a[..., :2], b[..., :2])
    enc_rb = torch.maximum(a[..., 2:], b[..., 2:])
    enc_wh = (enc_rb - enc_lt).clamp_min(0)
    if kind == "giou":
        enc_area = enc_wh[..., 0] * enc_wh[..., 1]
        return iou - (enc_area - union) / (enc_area + eps)
    c2 = enc_wh[..., 0] ** 2 + enc_wh[..., 1] ** 2 + eps
    centre_a = (a[..., :2] + a[..., 2:]) / 2
    centre_b = (b[..., :2] + b[..., 2:]) / 2
    rho2 = ((centre_a - centre_b) ** 2).sum(-1)
    wa, ha = a[..., 2] - a[..., 0], (a[..., 3] - a[..., 1]).clamp_min(eps)
    wb, hb = b[..., 2] - b[..., 0], (b[..., 3] - b[..., 1]).clamp_min(eps)
    v = (4 / math.pi**2) * (torch.atan(wb / hb) - torch.atan(wa / ha)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return iou - rho2 / c2 - alpha * v


# ============================================================================ NMS
def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS on xyxy boxes ``[N, 4]`` with scores ``[N]``: indices of the kept boxes, by
    decreasing score. A box is dropped when its IoU with a kept, higher-scoring box is > iou_threshold."""
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    order = scores.argsort(descending=True)
    iou = box_iou(boxes[order], boxes[order])
    n = order.numel()
    # over[i, j]: j (lower score, j > i) would be suppressed if i is kept
    over = (iou > iou_threshold).triu(diagonal=1).cpu()
    suppressed = torch.zeros(n, dtype=torch.bool)
    keep = []
    for i in range(n):  # sequential by nature; one vector op per kept box
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= over[i]
    return order[torch.tensor(keep, dtype=torch.long, device=boxes.device)]


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """NMS within each category ``idxs`` ``[N]``: boxes of different categories never suppress each
    other (each category is shifted by an offset larger than every coordinate span)."""
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    span = (boxes.max() - boxes.min()).abs() + 1
    shifted = boxes - boxes.min() + idxs.to(boxes.dtype)[:, None] * span
    return nms(shifted, scores, iou_threshold)
