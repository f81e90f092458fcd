"""Detection loss for YOLO-LAT: task-aligned assignment, IoU-aware BCE, CIoU/GIoU box loss.

Assignment (per image, in pixels of the model input; no gradient):
  1. candidates of gt g: the anchor points strictly inside g's box (for a box too small to hold
     one, the anchor point nearest its centre);
  2. alignment t(a, g) = s(a, c_g)^α · IoU(pred_a, g)^β, s = predicted probability of g's class;
  3. each gt keeps its top-k candidates by t; an anchor claimed by several gts goes to the one its
     predicted box overlaps most (one gt per anchor);
  4. soft target of a positive anchor: t(a, g) / max_a' t(a', g) · max_a' IoU(pred_a', g), so the best
     anchor of every gt aims at the IoU it actually reaches, the others at proportionally less.
Losses: BCE with logits against the soft one-hot targets over every anchor and class, plus
(1 - CIoU) (or 1 - GIoU) on positives weighted by their soft target, both divided by the sum of the
soft targets (at least 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .box_ops import aligned_box_iou, cxcywh_to_xyxy


def check_detection_labels(labels, batch: int, num_labels: int) -> None:
    """Clear errors for detection ``labels``: a list of one dict per image with ``class_labels`` (ints in
    [0, num_labels), [n]) and ``boxes`` ([n, 4] normalised cxcywh: finite, centres in [0, 1], widths and
    heights in (0, 1])."""
    if not isinstance(labels, (list, tuple)) or len(labels) != batch:
        got = f"{len(labels)} entries" if isinstance(labels, (list, tuple)) else type(labels).__name__
        raise ValueError(f"labels must hold one dict per image: got {got} for a batch of {batch}")
    for i, t in enumerate(labels):
        if not isinstance(t, dict) or "class_labels" not in t or "boxes" not in t:
            raise ValueError(f"labels[{i}] must be a dict with 'class_labels' and 'boxes' (normalised cxcywh)")
        classes, boxes = torch.as_tensor(t["class_labels"]), torch.as_tensor(t["boxes"])
        if classes.is_floating_point() or classes.is_complex() or classes.dim() != 1:
            raise ValueError(f"labels[{i}]['class_labels'] must be a 1-D integer tensor, got {classes.dtype} "
                             f"of shape {tuple(classes.shape)}")
        n = len(classes)
        if boxes.numel() != 4 * n:
            raise ValueError(f"labels[{i}]['boxes'] must have shape [{n}, 4] (one box per class label), "
                             f"got {tuple(boxes.shape)}")
        if n == 0:
            continue
        if int(classes.min()) < 0 or int(classes.max()) >= num_labels:
            bad = classes[(classes < 0) | (classes >= num_labels)][0]
            raise ValueError(f"labels[{i}]['class_labels'] must be in [0, num_labels={num_labels}), got {int(bad)}")
        _check_normalised_cxcywh(f"labels[{i}]['boxes']", boxes.double().reshape(n, 4))


def _check_normalised_cxcywh(field: str, boxes: torch.Tensor) -> None:
    if not bool(torch.isfinite(boxes).all()):
        raise ValueError(f"{field} contains NaN or Inf")
    if not bool(((boxes >= 0) & (boxes <= 1)).all()):
        raise ValueError(f"{field} must be normalised cxcywh (every value in [0, 1], relative to the image), got "
                         f"values in [{boxes.min().item():g}, {boxes.max().item():g}]; the image processor "
                         "turns absolute xyxy pixels into this form")
    if not bool((boxes[:, 2:] > 0).all()):
        raise ValueError(f"{field}: every box needs a width and a height > 0 (cxcywh), got "
                         f"{boxes[:, 2:].min().item():g}")


def pad_targets(labels: list[dict], image_hw: tuple[int, int], device, dtype):
    """List of {class_labels [n], boxes [n, 4] normalised cxcywh} -> padded ``gt_boxes [B, M, 4]``
    (xyxy pixels), ``gt_classes [B, M]``, ``gt_valid [B, M]``."""
    H, W = image_hw
    M = max((len(t["class_labels"]) for t in labels), default=0)
    B = len(labels)
    gt_boxes = torch.zeros(B, max(M, 1), 4, device=device, dtype=dtype)
    gt_classes = torch.zeros(B, max(M, 1), dtype=torch.long, device=device)
    gt_valid = torch.zeros(B, max(M, 1), dtype=torch.bool, device=device)
    scale = torch.tensor([W, H, W, H], device=device, dtype=dtype)
    for b, t in enumerate(labels):
        n = len(t["class_labels"])
        if n == 0:
            continue
        boxes = torch.as_tensor(t["boxes"], device=device, dtype=dtype).reshape(n, 4)
        gt_boxes[b, :n] = cxcywh_to_xyxy(boxes) * scale
        gt_classes[b, :n] = torch.as_tensor(t["class_labels"], device=device).long()
        gt_valid[b, :n] = True
    return gt_boxes, gt_classes, gt_valid


@torch.no_grad()
def task_aligned_assign(scores, pred_boxes, anchors, gt_boxes, gt_classes, gt_valid,
                        topk: int = 10, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9):
    """scores ``[B, A, C]`` (probabilities), pred_boxes ``[B, A, 4]`` and gt_boxes ``[B, M, 4]`` (xyxy),
    anchors ``[A, 2]``. Returns ``target_boxes [B, A, 4]``, ``target_scores [B, A, C]``, ``fg [B, A]``."""
    B, A, C = scores.shape
    M = gt_boxes.shape[1]
    ax, ay = anchors[:, 0], anchors[:, 1]
    x1, y1, x2, y2 = (gt_boxes[..., i, None] for i in range(4))  # [B, M, 1]
    inside = (ax > x1) & (ax < x2) & (ay > y1) & (ay < y2) & gt_valid[..., None]  # [B, M, A]
    # a box too small to contain an anchor point takes the anchor nearest its centre instead
    missed = gt_valid & ~inside.any(-1)  # [B, M]
    if missed.any():
        centre = (gt_boxes[..., :2] + gt_boxes[..., 2:]) / 2
        nearest = ((centre[:, :, None, :] - anchors[None, None]) ** 2).sum(-1).argmin(-1)  # [B, M]
        inside = inside | (F.one_hot(nearest, A).bool() & missed[..., None])

    iou = aligned_box_iou(gt_boxes[:, :, None, :], pred_boxes[:, None, :, :]).clamp_min(0) * inside
    cls_idx = gt_classes[:, :, None].expand(B, M, A)
    s = scores.transpose(1, 2).gather(1, cls_idx)  # [B, M, A]: score of each gt's class
    align = s.pow(alpha) * iou.pow(beta) * inside

    k = min(topk, A)
    # rank by alignment; a tiny IoU/inside tie-breaker keeps candidates ahead of outside anchors
    # when every alignment underflows to 0 early in training
    rank = align + eps * (iou + inside.to(align.dtype))
    top = rank.topk(k, dim=-1).indices
    in_topk = torch.zeros_like(inside).scatter_(-1, top, True) & inside  # [B, M, A]

    # one gt per anchor: the one whose box the anchor's prediction overlaps most
    claimed = in_topk.sum(1) > 1  # [B, A]
    best_gt = (iou * in_topk).argmax(1)  # [B, A]
    only_best = F.one_hot(best_gt, M).transpose(1, 2).bool()  # [B, M, A]
    pos = torch.where(claimed[:, None, :], in_topk & only_best, in_topk)

    fg = pos.any(1)  # [B, A]
    gt_idx = pos.to(torch.uint8).argmax(1)  # [B, A]
    target_boxes = gt_boxes.gather(1, gt_idx[..., None].expand(B, A, 4))
    target_classes = gt_classes.gather(1, gt_idx)

    align = align * pos
    norm = align / (align.amax(-1, keepdim=True) + eps) * (iou * pos).amax(-1, keepdim=True)
    weight = norm.amax(1)  # [B, A]
    target_scores = F.one_hot(target_classes, C).to(scores.dtype) * (weight * fg)[..., None]
    return target_boxes, target_scores, fg


def yolo_lat_loss(logits, pred_boxes_xyxy, anchors, labels, image_hw, config):
    """Total loss and its parts. logits ``[B, A, C]`` (pre-sigmoid), pred_boxes_xyxy ``[B, A, 4]``
    in pixels of the input, anchors ``[A, 2]`` pixels, labels: list of {class_labels, boxes (normalised
    cxcywh)}, already checked by the model's forward (`check_detection_labels`)."""
    logits_f, boxes_f = logits.float(), pred_boxes_xyxy.float()
    gt_boxes, gt_classes, gt_valid = pad_targets(labels, image_hw, logits.device, torch.float32)
    target_boxes, target_scores, fg = task_aligned_assign(
        logits_f.sigmoid(), boxes_f, anchors.float(), gt_boxes, gt_classes, gt_valid,
        topk=config.assigner_topk, alpha=config.assigner_alpha, beta=config.assigner_beta)
    norm = target_scores.sum().clamp_min(1.0)
    loss_cls = F.binary_cross_entropy_with_logits(logits_f, target_scores, reduction="sum") / norm
    if fg.any():
        iou = aligned_box_iou(boxes_f[fg], target_boxes[fg], kind=config.box_loss)
        loss_box = ((1.0 - iou) * target_scores.sum(-1)[fg]).sum() / norm
    else:  # keep the box branch in the graph so every parameter gets a (zero) gradient
        loss_box = boxes_f.sum() * 0.0
    loss = config.cls_loss_weight * loss_cls + config.box_loss_weight * loss_box
    return loss, {"loss_cls": loss_cls.detach(), "loss_box": loss_box.detach(), "num_fg": fg.sum().detach()}
