"""Vision data, detection metrics and the YOLO-LAT training script on real data (CPU, about a minute).

Needs the tree images of the `deepforest` package (``pip install --no-deps deepforest==2.1.0``) and, for COCO
mAP, ``pycocotools``; the tests that need them are skipped with that reason when they are missing.
"""

from __future__ import annotations

import csv
import importlib.util
import json

import numpy as np
import pytest
import torch
from conftest import load_experiment

from lazoo.data import vision
from lazoo.eval.detection import average_precision, box_iou, recall_at_iou

HAS_DEEPFOREST = importlib.util.find_spec("deepforest") is not None
HAS_PYCOCOTOOLS = importlib.util.find_spec("pycocotools") is not None
needs_deepforest = pytest.mark.skipif(not HAS_DEEPFOREST, reason="tree images: pip install --no-deps deepforest==2.1.0")
needs_pycocotools = pytest.mark.skipif(not HAS_PYCOCOTOOLS, reason="COCO mAP: pip install pycocotools")

TINY_WIDTHS = (8, 16, 32, 64, 128)


@pytest.fixture(scope="module")
def td():
    return load_experiment("train_detector")


# ------------------------------------------------------------------------------------------------ data
@needs_deepforest
def test_deepforest_boxes_match_the_package_files():
    records = {r["name"]: r for r in vision.load_deepforest_images()}
    assert {name: len(r["boxes"]) for name, r in records.items()} == {
        "OSBS_029": 61, "SOAP_061": 37, "2019_YELL_2_541000_4977000_image_crop": 279,
        "2019_YELL_2_528000_4978000_image_crop2": 574}
    # the package's CSV files for the two small images, read separately, hold the same boxes as the VOC files
    # (its example.csv for the YELL crop is another, older annotation: 77 of its 79 boxes are in the VOC file)
    folder = vision.deepforest_data_dir()
    for csv_name, image in (("OSBS_029.csv", "OSBS_029"), ("testfile_multi.csv", "SOAP_061")):
        with open(folder / csv_name) as f:
            rows = list(csv.DictReader(f))
        csv_boxes = {tuple(float(r[k]) for k in ("xmin", "ymin", "xmax", "ymax")) for r in rows}
        xml_boxes = {tuple(b) for b in records[image]["boxes"].tolist()}
        assert len(rows) == len(xml_boxes) and csv_boxes == xml_boxes, csv_name
    assert len(records["OSBS_029"]["boxes"]) == 61 and records["OSBS_029"]["image"].size == (400, 400)


@needs_deepforest
def test_tiles_keep_every_box_that_fits_and_clip_the_rest():
    record = vision.load_deepforest_images(["2019_YELL_2_541000_4977000_image_crop"])[0]
    tile = 300
    tiles = vision.deepforest_tiles(tile, images=[record["name"]], keep_empty=True)
    width, height = record["image"].size
    assert len(tiles) == sum(1 for y in range(0, height, tile) for x in range(0, width, tile)
                             if min(tile, width - x) * min(tile, height - y) >= 0.25 * tile * tile)
    boxes = record["boxes"].astype(np.float64)
    for row in tiles:
        got = np.asarray(row["boxes"], dtype=np.float64).reshape(-1, 4)
        assert (got >= 0).all() and (got <= tile).all()
        assert (got[:, 2] - got[:, 0] >= 4).all() and (got[:, 3] - got[:, 1] >= 4).all()
        x0, y0 = row["x0"], row["y0"]
        inside = ((boxes[:, 0] >= x0) & (boxes[:, 1] >= y0) & (boxes[:, 2] <= x0 + tile) & (boxes[:, 3] <= y0 + tile))
        expected = {tuple(b) for b in (boxes[inside] - [x0, y0, x0, y0]).round(3).tolist()}
        assert expected <= {tuple(b) for b in got.round(3).tolist()}
        # the tile's pixels are the image's pixels
        crop = np.asarray(record["image"].crop((x0, y0, x0 + 16, y0 + 16)))
        assert np.array_equal(np.asarray(row["image"])[:16, :16], crop)


@needs_deepforest
def test_split_is_fixed_and_disjoint():
    a = vision.deepforest_detection_dataset(400)
    b = vision.deepforest_detection_dataset(400)
    assert a["validation"]["image_id"] == b["validation"]["image_id"]
    assert not set(a["train"]["image_id"]) & set(a["validation"]["image_id"])
    assert len(a["train"]) + len(a["validation"]) == len(vision.deepforest_tiles(400))
    by_image = vision.deepforest_detection_dataset(400, val_images=["2019_YELL_2_541000_4977000_image_crop"])
    assert set(by_image["validation"]["source"]) == {"2019_YELL_2_541000_4977000_image_crop"}
    coco = vision.to_coco(a["validation"])
    assert len(coco["annotations"]) == vision.box_count(a["validation"])
    assert all(ann["bbox"][2] > 0 and ann["bbox"][3] > 0 for ann in coco["annotations"])


def test_digits_split():
    data = vision.digits_dataset(32)
    assert (len(data["train"]), len(data["test"])) == (1437, 360)
    assert not set(data["train"]["index"]) & set(data["test"]["index"])
    assert data["train"][0]["image"].size == (32, 32)
    assert sorted(set(data["test"]["label"])) == list(range(10))


def test_flip_rotate_moves_boxes_with_the_pixels(td):
    from PIL import Image

    rng = np.random.default_rng(0)
    for _ in range(8):
        canvas = np.zeros((64, 64, 3), dtype=np.uint8)
        canvas[10:20, 30:50] = 255  # the box x in [30, 50), y in [10, 20)
        image, boxes = td.flip_rotate(Image.fromarray(canvas), [[30, 10, 50, 20]], rng)
        ys, xs = np.nonzero(np.asarray(image)[..., 0])
        assert boxes[0] == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


# ------------------------------------------------------------------------------------------------ metrics
def _random_detection_problem(seed=0, images=6):
    rng = np.random.default_rng(seed)
    gt = {"images": [], "annotations": [], "categories": [{"id": 0, "name": "tree"}]}
    preds = []
    for i in range(images):
        gt["images"].append({"id": i, "width": 400, "height": 400})
        n = int(rng.integers(2, 25))
        xy = rng.uniform(0, 350, (n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(8, 50, (n, 2))], 1)
        for b in boxes:
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": i, "category_id": 0,
                                      "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
                                      "area": float((b[2] - b[0]) * (b[3] - b[1])), "iscrowd": 0})
        found = boxes[rng.random(n) < 0.8]  # 80% found, a little off; 3 false alarms per image
        noisy = found + rng.normal(0, 3, found.shape)
        false = np.concatenate([rng.uniform(0, 350, (3, 2))] * 2, 1) + [0, 0, 30, 30]
        pb = np.concatenate([noisy, false])
        preds.append({"image_id": i, "boxes": pb.tolist(), "scores": rng.random(len(pb)).tolist(),
                      "labels": [0] * len(pb)})
    return preds, gt


@needs_pycocotools
def test_coco_map_agrees_with_an_independent_average_precision():
    from lazoo.eval.detection import coco_map

    preds, gt = _random_detection_problem()
    stats = coco_map(preds, gt)
    assert 0.2 < stats["map_50"] < 0.95
    assert stats["map_50"] == pytest.approx(average_precision(preds, gt, iou=0.5), abs=1e-6)
    ap_range = np.mean([average_precision(preds, gt, iou=t) for t in np.linspace(0.5, 0.95, 10)])
    assert stats["map_50_95"] == pytest.approx(ap_range, abs=1e-6)
    # perfect predictions score 1; none score 0
    perfect = [{"image_id": img["id"], "boxes": [], "scores": [], "labels": []} for img in gt["images"]]
    for ann in gt["annotations"]:
        x, y, w, h = ann["bbox"]
        perfect[ann["image_id"]]["boxes"].append([x, y, x + w, y + h])
        perfect[ann["image_id"]]["scores"].append(0.9)
        perfect[ann["image_id"]]["labels"].append(0)
    assert coco_map(perfect, gt)["map_50_95"] == pytest.approx(1.0)
    assert coco_map([], gt)["map_50"] == 0.0


def test_box_iou_and_recall():
    a = [[0, 0, 10, 10]]
    b = [[5, 0, 15, 10], [0, 0, 10, 10], [20, 20, 30, 30]]
    assert box_iou(a, b).tolist() == [[pytest.approx(50 / 150), 1.0, 0.0]]
    assert recall_at_iou([[5, 0, 15, 10]], a, 0.5) == 0.0
    assert recall_at_iou([[1, 0, 11, 10]], a, 0.5) == 1.0


# ------------------------------------------------------------------------------------------------ training
@needs_deepforest
@pytest.mark.parametrize("variant", [pytest.param("conv", marks=pytest.mark.slow), "lat"])  # conv: 13 s, the baseline
def test_detector_overfits_two_tree_tiles(td, variant, tmp_path):
    """Trainer + the image-processor collator on two real tiles (98 crowns): the loss falls at least 3-fold and
    the post-processed predictions (score >= 0.25) find at least 60% of the crowns at IoU 0.5."""
    torch.manual_seed(0)
    tiles = vision.deepforest_tiles(400, images=["OSBS_029", "SOAP_061"])
    assert vision.box_count(tiles) == 98
    processor = td.build_processor(256)
    model = td.build_detector(variant, 1, 256, widths=TINY_WIDTHS)
    history = td.train(model, tiles, td.DetectionCollator(processor), device="cpu", steps=40, epochs=None,
                       batch_size=2, lr=1e-2, seed=0, output_dir=str(tmp_path), weight_decay=0.0, log_every=1)
    losses = [h["loss"] for h in history]
    assert len(losses) == 40 and np.mean(losses[-4:]) < losses[0] / 3, losses
    td.recalibrate_batch_norm(model, tiles, td.DetectionCollator(processor), device="cpu")
    predictions = td.predict(model, processor, tiles, device="cpu", threshold=0.25, nms_iou=0.5)
    found = total = 0
    for pred, row in zip(predictions, tiles):
        found += recall_at_iou(pred["boxes"], row["boxes"], 0.5) * len(row["boxes"])
        total += len(row["boxes"])
    assert found / total >= 0.6, found / total


def test_digits_classifier_learns(td, tmp_path):
    """The "lat" backbone as a classifier on held-out sklearn digits: accuracy >= 0.8 after 100 steps."""
    torch.manual_seed(0)
    data = vision.digits_dataset(32)
    processor = td.build_processor(32)
    model = td.build_classifier("lat", 32, widths=TINY_WIDTHS)
    collator = td.ClassificationCollator(processor)
    td.train(model, data["train"], collator, device="cpu", steps=100, epochs=None, batch_size=64, lr=3e-3,
             seed=0, output_dir=str(tmp_path))
    td.recalibrate_batch_norm(model, data["train"], collator, device="cpu", batch_size=256)
    accuracy = td.classification_accuracy(model, processor, data["test"], device="cpu")
    assert accuracy >= 0.8, accuracy


@needs_pycocotools
def test_eval_only_scores_saved_predictions(td, tmp_path):
    from lazoo.eval.detection import save_predictions

    preds, gt = _random_detection_problem(seed=1)
    path = save_predictions(tmp_path / "pred_lat.json", preds, gt, variant="lat")
    out = tmp_path / "results.json"
    td.main(["--eval-only", str(path), "--out", str(out)])
    saved = json.loads(out.read_text())["variants"]["lat"]
    assert saved["map_50"] == pytest.approx(average_precision(preds, gt, iou=0.5), abs=1e-6)
    assert saved["metric_source"] == "pycocotools"
    assert "| mAP@0.5 |" in out.with_suffix(".md").read_text()


def test_missing_deepforest_says_how_to_install(monkeypatch):
    monkeypatch.delenv("LAZOO_DEEPFOREST_DATA", raising=False)
    monkeypatch.setattr(vision.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps deepforest"):
        vision.deepforest_data_dir()


def test_metrics_without_pycocotools_fall_back_to_numpy(td, monkeypatch):
    def missing(*args, **kwargs):
        raise ImportError("no pycocotools")

    preds, gt = _random_detection_problem(seed=2)
    monkeypatch.setattr(td, "coco_map", missing)
    stats = td.detection_metrics(preds, gt)
    assert "pycocotools missing" in stats["metric_source"]
    assert stats["map_50"] == pytest.approx(average_precision(preds, gt, iou=0.5))
    assert 0 < stats["map_50_95"] < stats["map_50"]
