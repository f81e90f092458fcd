"""Detection metrics: COCO mAP with pycocotools (``pip install pycocotools``), and small helpers.

Predictions are a list with one dict per image::

    {"image_id": int, "boxes": [[x0, y0, x1, y1], ...] (absolute pixels), "scores": [...], "labels": [...]}

(what an image processor's ``post_process_object_detection`` returns, plus the image id); ground truth is
a COCO dict (``lazoo.data.vision.to_coco``). ``coco_map`` runs pycocotools' ``COCOeval`` with its printing
captured and returns mAP@0.5 and mAP@0.5:0.95 among its twelve numbers.

``average_precision`` is an independent NumPy version of COCO's AP at one IoU threshold (greedy matching
by score, 101-point interpolated precision), usable without pycocotools and as a cross-check.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np

#: names of COCOeval.stats, in order
COCO_STAT_NAMES = ["map_50_95", "map_50", "map_75", "map_small", "map_medium", "map_large",
                   "mar_1", "mar_10", "mar_max", "mar_small", "mar_medium", "mar_large"]
PYCOCOTOOLS_HINT = "COCO mAP needs pycocotools: pip install pycocotools"


def _tolist(value) -> list:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64).tolist()


def prediction_record(image_id: int, result: dict) -> dict:
    """One image's post-processed output (tensors or lists: boxes xyxy, scores, labels) as plain lists."""
    boxes = np.asarray(_tolist(result["boxes"]), dtype=np.float64).reshape(-1, 4)
    return {"image_id": int(image_id), "boxes": boxes.tolist(), "scores": _tolist(result["scores"]),
            "labels": [int(v) for v in _tolist(result["labels"])]}


def to_coco_results(predictions: list[dict]) -> list[dict]:
    """Per-image predictions (xyxy) as COCO result entries (one per box, bbox as [x, y, w, h])."""
    results = []
    for pred in predictions:
        boxes = np.asarray(pred["boxes"], dtype=np.float64).reshape(-1, 4)
        for (x0, y0, x1, y1), score, label in zip(boxes, pred["scores"], pred["labels"]):
            results.append({"image_id": int(pred["image_id"]), "category_id": int(label),
                            "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                            "score": float(score)})
    return results


def coco_map(predictions: list[dict], ground_truth: dict, *, max_dets: int = 100) -> dict[str, float]:
    """COCO box metrics of ``predictions`` against the COCO dict ``ground_truth``.

    Returns the twelve COCOeval numbers by name (``map_50_95``, ``map_50``, ... see ``COCO_STAT_NAMES``);
    ``max_dets`` is the number of detections per image that count (COCO's 100 by default). Images of the
    ground truth with no prediction count as misses. pycocotools' printing is captured, not shown.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as err:
        raise ImportError(PYCOCOTOOLS_HINT) from err
    known = {img["id"] for img in ground_truth["images"]}
    unknown = {int(p["image_id"]) for p in predictions} - known
    if unknown:
        raise ValueError(f"predictions name image ids not in the ground truth: {sorted(unknown)[:10]}")
    results = to_coco_results(predictions)
    if not results:  # loadRes refuses an empty list: nothing predicted, nothing found
        return {name: 0.0 for name in COCO_STAT_NAMES}
    gt = dict(ground_truth)
    gt.setdefault("info", {})
    gt.setdefault("licenses", [])
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
        evaluator = COCOeval(coco_gt, coco_dt, iouType="bbox")
        evaluator.params.maxDets = [1, 10, int(max_dets)]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {name: float(value) for name, value in zip(COCO_STAT_NAMES, evaluator.stats)}


# ----------------------------------------------------------------------------------------------------------
# NumPy helpers
# ----------------------------------------------------------------------------------------------------------
def box_iou(a, b) -> np.ndarray:
    """IoU matrix ``[len(a), len(b)]`` of xyxy boxes."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    area_a = (a[:, 2] - a[:, 0]).clip(0) * (a[:, 3] - a[:, 1]).clip(0)
    area_b = (b[:, 2] - b[:, 0]).clip(0) * (b[:, 3] - b[:, 1]).clip(0)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clip(0).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def recall_at_iou(pred_boxes, gt_boxes, iou: float = 0.5) -> float:
    """Fraction of ground-truth boxes that some predicted box overlaps with IoU >= ``iou`` (scores ignored)."""
    gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
    if len(gt_boxes) == 0:
        return 1.0
    pred_boxes = np.asarray(pred_boxes, dtype=np.float64).reshape(-1, 4)
    if len(pred_boxes) == 0:
        return 0.0
    return float((box_iou(gt_boxes, pred_boxes).max(axis=1) >= iou).mean())


def average_precision(predictions: list[dict], ground_truth: dict, *, iou: float = 0.5,
                      category_id: int = 0, max_dets: int = 100) -> float:
    """AP of one category at one IoU threshold, as COCO computes it (no crowd or area ranges).

    Each image's detections (at most ``max_dets``, best first) are matched greedily to the unmatched
    ground-truth box of highest IoU; precision is made monotone and read at 101 recall points.
    """
    gt_by_image: dict[int, list] = {img["id"]: [] for img in ground_truth["images"]}
    for ann in ground_truth["annotations"]:
        if ann["category_id"] == category_id:
            x, y, w, h = ann["bbox"]
            gt_by_image[ann["image_id"]].append([x, y, x + w, y + h])
    n_gt = sum(len(v) for v in gt_by_image.values())
    if n_gt == 0:
        return float("nan")
    scored = []  # (score, is true positive)
    for pred in predictions:
        boxes = np.asarray(pred["boxes"], dtype=np.float64).reshape(-1, 4)
        scores = np.asarray(pred["scores"], dtype=np.float64)
        labels = np.asarray(pred["labels"])
        keep = labels == category_id
        boxes, scores = boxes[keep], scores[keep]
        order = np.argsort(-scores, kind="stable")[:max_dets]
        gts = np.asarray(gt_by_image.get(int(pred["image_id"]), []), dtype=np.float64).reshape(-1, 4)
        ious = box_iou(boxes[order], gts)
        taken = np.zeros(len(gts), dtype=bool)
        for row, det in enumerate(order):
            best, best_iou = -1, iou
            for col in range(len(gts)):
                if not taken[col] and ious[row, col] >= best_iou:
                    best, best_iou = col, ious[row, col]
            if best >= 0:
                taken[best] = True
            scored.append((scores[det], best >= 0))
    if not scored:
        return 0.0
    scored.sort(key=lambda item: -item[0])
    tp = np.cumsum([hit for _, hit in scored])
    fp = np.cumsum([not hit for _, hit in scored])
    recall = tp / n_gt
    precision = tp / np.maximum(tp + fp, 1e-12)
    precision = np.maximum.accumulate(precision[::-1])[::-1]  # the best precision at this recall or beyond
    points = np.linspace(0.0, 1.0, 101)
    index = np.searchsorted(recall, points, side="left")
    return float(np.mean([precision[i] if i < len(precision) else 0.0 for i in index]))


def save_predictions(path: str | Path, predictions: list[dict], ground_truth: dict, **meta) -> Path:
    """Write predictions and their ground truth to one JSON file (to score it later, elsewhere)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "ground_truth": ground_truth, "predictions": predictions}))
    return path


def load_predictions(path: str | Path) -> tuple[list[dict], dict, dict]:
    """(predictions, ground_truth, meta) from a file written by ``save_predictions``."""
    data = json.loads(Path(path).read_text())
    return data["predictions"], data["ground_truth"], data.get("meta", {})
