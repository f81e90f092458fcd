"""Train and compare the YOLO-LAT detector variants ("conv" and "lat") on real aerial tree crowns.

    PYTHONPATH=src python experiments/train_detector.py --steps 2000 --device cuda          # both variants
    PYTHONPATH=src python experiments/train_detector.py --steps 300 --device cpu --out docs/results/yolo_lat_cpu.json
    PYTHONPATH=src python experiments/train_detector.py --eval-only runs/yolo_lat/pred_conv.json \\
        runs/yolo_lat/pred_lat.json --out docs/results/yolo_lat.json      # score saved predictions (needs pycocotools)
    PYTHONPATH=src python experiments/train_detector.py --task digits --steps 400             # classification accuracy

Data: the deepforest package's annotated images (``pip install --no-deps deepforest==2.1.0``) cut into tiles
(``lazoo.data.vision``), a fixed split by tile. Each variant is trained with ``transformers.Trainer`` (a collator
that runs the image processor and keeps ``labels`` as a list of dicts), then:

* mAP@0.5 and mAP@0.5:0.95 on the validation tiles with pycocotools' COCOeval; without pycocotools the same
  numbers come from ``lazoo.eval.detection.average_precision`` (a NumPy re-implementation, marked in the JSON).
  The predictions are always saved (``--pred-dir``) so they can be scored again with ``--eval-only``;
* parameter count; inference latency (batch 1, ``--image-size``, median of ``--latency-runs``) on the CPU and on
  CUDA when present;
* a JSON file (``--out``), a Markdown table beside it, and a figure of predicted boxes on one validation tile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from lazoo.bench.yolo_lat import VARIANTS, build_detector, count_parameters, wall_ms  # noqa: E402
from lazoo.data.vision import (  # noqa: E402
    SHAPE_CLASSES,
    TREE_CLASSES,
    box_count,
    deepforest_detection_dataset,
    digits_dataset,
    shapes_detection_dataset,
    to_coco,
)
from lazoo.eval.detection import (  # noqa: E402
    average_precision,
    coco_map,
    load_predictions,
    prediction_record,
    recall_at_iou,
    save_predictions,
)

#: the published comparison this script sets beside its own numbers (YOLO-LAT vs its convolutional baseline)
PAPER = {"param_ratio": 7.9, "cpu_speedup": 2.2, "gpu_speedup": 4.3,
         "map_50": {"lat": 0.962, "conv": 0.998}, "map_50_95": {"lat": 0.515, "conv": 0.951}}


# ----------------------------------------------------------------------------------------------------------
# model construction
# ----------------------------------------------------------------------------------------------------------
def build_processor(image_size: int):
    from lazoo.vision import YoloLatImageProcessor

    return YoloLatImageProcessor(image_size=image_size)


def build_classifier(variant: str, image_size: int, **config_kwargs):
    from lazoo.vision import YoloLatConfig, YoloLatForImageClassification

    fields = {**VARIANTS[variant], **config_kwargs}
    config = YoloLatConfig(num_labels=10, image_size=image_size, **fields)
    return YoloLatForImageClassification(config)




# ----------------------------------------------------------------------------------------------------------
# collation (list labels) and augmentation
# ----------------------------------------------------------------------------------------------------------
def flip_rotate(image, boxes: list, rng: np.random.Generator):
    """A random one of the 8 flips/quarter turns of a square aerial tile, boxes (xyxy) moved with it."""
    from PIL import Image

    size = image.size[0]
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
        b = np.stack([size - b[:, 2], b[:, 1], size - b[:, 0], b[:, 3]], axis=1)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_TOP_BOTTOM)
        b = np.stack([b[:, 0], size - b[:, 3], b[:, 2], size - b[:, 1]], axis=1)
    if rng.random() < 0.5:  # transpose: (x, y) -> (y, x)
        image = image.transpose(Image.TRANSPOSE)
        b = b[:, [1, 0, 3, 2]]
    return image, b.tolist()


class DetectionCollator:
    """Rows ``{image, boxes (xyxy), class_labels}`` -> ``{pixel_values, labels}`` through the image processor;
    ``labels`` stays a list of per-image dicts (Trainer moves it to the device as it is)."""

    def __init__(self, processor, augment: bool = False, seed: int = 0):
        self.processor = processor
        self.augment = augment
        self.rng = np.random.default_rng(seed)

    def __call__(self, rows: list[dict]) -> dict:
        images, annotations = [], []
        for row in rows:
            image, boxes = row["image"].convert("RGB"), row["boxes"]
            if self.augment:
                image, boxes = flip_rotate(image, boxes, self.rng)
            images.append(image)
            annotations.append({"boxes": boxes, "class_labels": list(row["class_labels"])})
        batch = self.processor(images, annotations=annotations, return_tensors="pt")
        return {"pixel_values": batch["pixel_values"], "labels": list(batch["labels"])}


class ClassificationCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.processor([row["image"].convert("RGB") for row in rows], return_tensors="pt")
        return {"pixel_values": batch["pixel_values"], "labels": torch.tensor([row["label"] for row in rows])}


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------
def train(model, dataset, collator, *, device: str, steps: int, epochs: float | None, batch_size: int, lr: float,
          seed: int, output_dir: str, weight_decay: float = 0.05, warmup_ratio: float = 0.05,
          log_every: int = 10) -> list[dict]:
    """Trainer run with AdamW and a cosine schedule; returns the logged history."""
    from transformers import Trainer, TrainingArguments

    steps_per_epoch = max(1, math.ceil(len(dataset) / batch_size))
    max_steps = int(math.ceil(epochs * steps_per_epoch)) if epochs else steps
    args = TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
        learning_rate=lr, weight_decay=weight_decay, lr_scheduler_type="cosine",
        warmup_steps=int(warmup_ratio * max_steps), max_grad_norm=10.0,
        logging_steps=max(1, min(log_every, max_steps // 10)),
        save_strategy="no", report_to=[], remove_unused_columns=False, label_names=["labels"], seed=seed,
        dataloader_num_workers=0, use_cpu=(device == "cpu"), disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "step" in h]


@torch.no_grad()
def recalibrate_batch_norm(model, dataset, collator, *, device: str, batch_size: int = 8) -> None:
    """Recompute every BatchNorm's running mean/variance as the plain average over ``dataset``.

    With the small BN momentum of YOLO-style models (0.03) the running statistics lag far behind the
    weights in a short run, and eval mode then scores nothing; one pass in train mode without gradients
    fixes that (batch statistics, weights untouched).
    """
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    model.train().to(device)
    for start in range(0, len(dataset), batch_size):
        batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        model(pixel_values=batch["pixel_values"].to(device))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()


# ----------------------------------------------------------------------------------------------------------
# inference, metrics, latency
# ----------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def predict(model, processor, dataset, *, device: str, threshold: float, nms_iou: float,
            batch_size: int = 8) -> list[dict]:
    """Post-processed predictions (absolute xyxy in tile pixels) of every row, with its image id."""
    model.eval().to(device)
    records = []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        images = [im.convert("RGB") for im in rows["image"]]
        pixel_values = processor(images, return_tensors="pt")["pixel_values"].to(device)
        outputs = model(pixel_values=pixel_values)
        sizes = [(im.size[1], im.size[0]) for im in images]  # (height, width)
        results = processor.post_process_object_detection(outputs, threshold=threshold, target_sizes=sizes,
                                                          nms_iou=nms_iou)
        for image_id, result in zip(rows["image_id"], results):
            records.append(prediction_record(image_id, result))
    return records


def detection_metrics(predictions: list[dict], ground_truth: dict, max_dets: int = 100) -> dict:
    """mAP@0.5 and mAP@0.5:0.95 (COCOeval when pycocotools is installed, else the NumPy version)."""
    try:
        stats = coco_map(predictions, ground_truth, max_dets=max_dets)
        stats["metric_source"] = "pycocotools"
        return stats
    except ImportError:
        thresholds = np.linspace(0.5, 0.95, 10)
        aps = [average_precision(predictions, ground_truth, iou=t, max_dets=max_dets) for t in thresholds]
        return {"map_50": aps[0], "map_50_95": float(np.mean(aps)), "map_75": aps[5],
                "metric_source": "lazoo.eval.detection.average_precision (pycocotools missing)"}


def mean_recall(predictions: list[dict], ground_truth: dict, score: float = 0.25, iou: float = 0.5) -> float:
    """Share of ground-truth boxes found (IoU >= iou) by predictions scoring >= score."""
    gt = {img["id"]: [] for img in ground_truth["images"]}
    for ann in ground_truth["annotations"]:
        x, y, w, h = ann["bbox"]
        gt[ann["image_id"]].append([x, y, x + w, y + h])
    found = total = 0
    for pred in predictions:
        boxes = [b for b, s in zip(pred["boxes"], pred["scores"]) if s >= score]
        n = len(gt[pred["image_id"]])
        found += recall_at_iou(boxes, gt[pred["image_id"]], iou) * n
        total += n
    return found / max(total, 1)


@torch.inference_mode()
def latency_ms(model, image_size: int, device: str, runs: int = 30, warmup: int = 5) -> float:
    """Median wall time (ms) of one forward pass, batch 1, ``image_size`` square, on ``device``."""
    model.eval().to(device)
    x = torch.randn(1, 3, image_size, image_size, device=device)
    return wall_ms(lambda: model(pixel_values=x), device, runs, warmup)


# ----------------------------------------------------------------------------------------------------------
# figure and table
# ----------------------------------------------------------------------------------------------------------
def draw_predictions(path: Path, row: dict, predictions: dict[str, dict]) -> None:
    """One panel per variant: the tile, its ground-truth boxes (white, dashed) and the variant's top-N
    predictions (N = number of true boxes; after NMS), so panels compare at equal counts whatever the
    score calibration of a short run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    names = list(predictions)
    n_true = len(row["boxes"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 5.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        ax.imshow(row["image"])
        for x0, y0, x1, y1 in row["boxes"]:
            ax.add_patch(patches.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec="white", lw=1.0, ls="--"))
        pred = predictions[name]
        order = np.argsort(pred["scores"])[::-1][:n_true]
        boxes = [pred["boxes"][i] for i in order]
        scores = [pred["scores"][i] for i in order]
        for x0, y0, x1, y1 in boxes:
            ax.add_patch(patches.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec="orangered", lw=1.3))
        found = recall_at_iou(boxes, row["boxes"], 0.5)
        score_range = f"scores {min(scores):.2f}–{max(scores):.2f}" if scores else "no predictions"
        ax.set_title(f"{name}: top {len(boxes)} boxes ({score_range}),\n{found:.0%} of {n_true} trees found at IoU 0.5",
                     fontsize=10)
        ax.axis("off")
    fig.suptitle(f"validation tile {row['image_id']} ({row['source']}); white dashed: ground truth", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def results_table(results: dict) -> str:
    """Markdown table: each variant's numbers, each other variant against "conv", and the paper's claims."""
    rows = results["variants"]
    names = [n for n in VARIANTS if n in rows] + [n for n in rows if n not in VARIANTS]
    others = [n for n in names if n != "conv"] if "conv" in rows else []
    ratios = results.get("ratios", {})
    header = ("| | " + " | ".join(names) + " | " + " | ".join(f"{n} vs conv" for n in others)
              + " | paper (LAT vs conv) |")
    lines = [header, "|---" * (2 + len(names) + len(others)) + "|"]

    def line(label, key, digits, ratio_key=None, ratio_word="", paper=""):
        cells = [fmt(rows[n].get(key), digits) for n in names]
        vs = []
        for n in others:
            r = ratios.get(n, {}).get(ratio_key) if ratio_key else None
            vs.append(f"{r:.2f}× {ratio_word}" if r else ("–" if ratio_key else ""))
        lines.append(f"| {label} | " + " | ".join(cells + vs) + f" | {paper} |")

    line("parameters", "parameters", 0, "param_ratio", "fewer", f"{PAPER['param_ratio']}× fewer")
    line("CPU latency (ms, batch 1)", "latency_cpu_ms", 1, "cpu_speedup", "faster", f"{PAPER['cpu_speedup']}× faster")
    line("GPU latency (ms, batch 1)", "latency_cuda_ms", 2, "gpu_speedup", "faster", f"{PAPER['gpu_speedup']}× faster")
    for key, label in (("map_50", "mAP@0.5"), ("map_50_95", "mAP@0.5:0.95")):
        line(label, key, 3, paper=f"{PAPER[key]['lat']} vs {PAPER[key]['conv']}")
    line("recall@0.5 (score ≥ 0.25)", "recall_50", 3)
    return "\n".join(lines)


def update_ratios(results: dict) -> None:
    """Per variant: conv's parameters / its parameters and conv's latency / its latency (> 1: smaller, faster)."""
    conv = results["variants"].get("conv", {})
    ratios = {}
    for name, entry in results["variants"].items():
        if name == "conv":
            continue
        mine = {}
        for ratio, key in (("param_ratio", "parameters"), ("cpu_speedup", "latency_cpu_ms"),
                           ("gpu_speedup", "latency_cuda_ms")):
            if conv.get(key) and entry.get(key):
                mine[ratio] = conv[key] / entry[key]
        ratios[name] = mine
    results["ratios"] = ratios


def write_results(results: dict, out: Path) -> None:
    update_ratios(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    table = results_table(results)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")


# ----------------------------------------------------------------------------------------------------------
# the tasks
# ----------------------------------------------------------------------------------------------------------
def model_source_digest() -> str:
    """sha256 (first 12 hex digits) of the model package's source, to tell which model a result is of."""
    import hashlib

    import lazoo.vision

    digest = hashlib.sha256()
    for path in sorted(Path(lazoo.vision.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def model_config_summary(model) -> dict:
    """The config fields that differ from the defaults, plus the variant (always)."""
    diff = model.config.to_diff_dict()
    for key in ("transformers_version", "architectures", "id2label", "label2id", "stage_names", "out_features",
                "out_indices"):
        diff.pop(key, None)
    return {"variant": model.config.variant, **diff}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(),
           "device": device, "model_source_sha256": model_source_digest()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return device


def run_detection(args) -> dict:
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    if args.data == "trees":
        data = deepforest_detection_dataset(args.tile_size, val_fraction=args.val_fraction, seed=args.seed,
                                            val_images=args.val_images)
        classes = TREE_CLASSES
    else:
        full = shapes_detection_dataset(160, args.tile_size, seed=args.seed).train_test_split(0.2, seed=args.seed)
        data = {"train": full["train"], "validation": full["test"]}
        classes = SHAPE_CLASSES
    num_labels = len(classes)
    train_set, val_set = data["train"], data["validation"]
    ground_truth = to_coco(val_set, classes)
    print(f"{args.data}: {len(train_set)} train tiles ({box_count(train_set)} boxes), {len(val_set)} validation "
          f"tiles ({box_count(val_set)} boxes), tile {args.tile_size} px -> {args.image_size} px")
    processor = build_processor(args.image_size)
    config_kwargs = json.loads(args.config_kwargs) if args.config_kwargs else {}
    out = Path(args.out)
    results = json.loads(out.read_text()) if args.append and out.exists() else {"variants": {}}
    results["setup"] = {
        "data": args.data, "tile_size": args.tile_size, "image_size": args.image_size,
        "train_tiles": len(train_set), "train_boxes": box_count(train_set), "val_tiles": len(val_set),
        "val_boxes": box_count(val_set), "steps": args.steps, "epochs": args.epochs, "batch_size": args.batch_size,
        "lr": args.lr, "seed": args.seed, "score_threshold": args.threshold, "nms_iou": args.nms_iou,
        "config_kwargs": config_kwargs, "environment": environment(device),
    }
    pred_dir = Path(args.pred_dir)
    predictions_by_variant = {}
    for variant in args.variants:
        torch.manual_seed(args.seed)
        model = build_detector(variant, num_labels, args.image_size, **config_kwargs)
        entry = {"parameters": count_parameters(model), "config": model_config_summary(model)}
        start = time.perf_counter()
        history = train(model, train_set, DetectionCollator(processor, augment=not args.no_augment, seed=args.seed),
                        device=device, steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                        seed=args.seed, output_dir=str(pred_dir / f"trainer_{variant}"))
        entry["train_seconds"] = time.perf_counter() - start
        entry["train_steps"] = history[-1]["step"] if history else None
        entry["loss_first"] = history[0]["loss"] if history else None
        entry["loss_last"] = history[-1]["loss"] if history else None
        if not args.no_bn_recalibrate:
            recalibrate_batch_norm(model, train_set, DetectionCollator(processor), device=device)
        predictions = predict(model, processor, val_set, device=device, threshold=args.threshold,
                              nms_iou=args.nms_iou)
        predictions_by_variant[variant] = predictions
        save_predictions(pred_dir / f"pred_{variant}.json", predictions, ground_truth, variant=variant,
                         setup=results["setup"])
        entry.update(detection_metrics(predictions, ground_truth))
        entry["recall_50"] = mean_recall(predictions, ground_truth)
        if not args.no_latency:
            entry["latency_cpu_ms"] = latency_ms(model, args.image_size, "cpu", runs=args.latency_runs)
            if torch.cuda.is_available():
                entry["latency_cuda_ms"] = latency_ms(model, args.image_size, "cuda", runs=args.latency_runs)
            entry["latency_runs"] = args.latency_runs
        results["variants"][variant] = entry
        print(variant, {k: v for k, v in entry.items() if not isinstance(v, dict)})
        if args.save_models:
            model.save_pretrained(pred_dir / f"model_{variant}")
    write_results(results, out)
    if args.figure and predictions_by_variant:
        # the validation tile with the most trees among images the training tiles also come from
        seen = set(train_set["source"])
        counts = [len(b) if src in seen else -1 for b, src in zip(val_set["class_labels"], val_set["source"])]
        best = int(np.argmax(counts))
        row = val_set[best]
        by_id = {name: next(p for p in preds if p["image_id"] == row["image_id"])
                 for name, preds in predictions_by_variant.items()}
        draw_predictions(Path(args.figure), row, by_id)
        print(f"wrote {args.figure}")
    return results


def run_eval_only(args) -> dict:
    """Score saved prediction files (pred_<variant>.json) and merge the numbers into --out."""
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"variants": {}}
    for path in args.eval_only:
        predictions, ground_truth, meta = load_predictions(path)
        variant = meta.get("variant", Path(path).stem)
        entry = results["variants"].setdefault(variant, {})
        entry.update(detection_metrics(predictions, ground_truth))
        entry["recall_50"] = mean_recall(predictions, ground_truth)
        print(variant, f"mAP@0.5 {entry['map_50']:.4f}  mAP@0.5:0.95 {entry['map_50_95']:.4f}  "
                       f"({entry['metric_source']})")
    write_results(results, out)
    return results


def run_digits(args) -> dict:
    device = resolve_device(args.device)
    data = digits_dataset(args.digits_size, seed=args.seed)
    processor = build_processor(args.digits_size)
    config_kwargs = json.loads(args.config_kwargs) if args.config_kwargs else {}
    results = {"setup": {"task": "digits", "image_size": args.digits_size, "train": len(data["train"]),
                         "test": len(data["test"]), "steps": args.steps, "epochs": args.epochs,
                         "batch_size": args.batch_size, "lr": args.lr, "environment": environment(device)},
               "variants": {}}
    for variant in args.variants:
        torch.manual_seed(args.seed)
        model = build_classifier(variant, args.digits_size, **config_kwargs)
        history = train(model, data["train"], ClassificationCollator(processor), device=device, steps=args.steps,
                        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        output_dir=str(Path(args.pred_dir) / f"digits_{variant}"))
        if not args.no_bn_recalibrate:
            recalibrate_batch_norm(model, data["train"], ClassificationCollator(processor), device=device,
                                   batch_size=128)
        accuracy = classification_accuracy(model, processor, data["test"], device=device)
        results["variants"][variant] = {"parameters": count_parameters(model), "accuracy": accuracy,
                                        "loss_first": history[0]["loss"] if history else None,
                                        "loss_last": history[-1]["loss"] if history else None}
        print(variant, results["variants"][variant])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return results


@torch.inference_mode()
def classification_accuracy(model, processor, dataset, *, device: str, batch_size: int = 128) -> float:
    model.eval().to(device)
    correct = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        pixel_values = processor([im.convert("RGB") for im in rows["image"]], return_tensors="pt")["pixel_values"]
        logits = model(pixel_values=pixel_values.to(device)).logits
        correct += int((logits.argmax(-1).cpu() == torch.tensor(rows["label"])).sum())
    return correct / len(dataset)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["detect", "digits"], default="detect")
    p.add_argument("--data", choices=["trees", "shapes"], default="trees",
                   help="detection data: deepforest tree tiles (default) or procedural shapes")
    p.add_argument("--variants", nargs="+", default=["conv", "lat"], choices=list(VARIANTS),
                   help="lat_all: lat with lat_scope='all' (down-sampling and head convolutions separable too); "
                        "lat_local: lat without the attention branch; lat_attn8: lat with it from stride 8")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (training and mAP inference)")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (ignored when --epochs is given)")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--image-size", type=int, default=320, help="model input size (tiles are resized to it)")
    p.add_argument("--tile-size", type=int, default=400, help="tile size in source pixels")
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--val-images", nargs="*", default=None, help="hold out whole deepforest images by name instead")
    p.add_argument("--threshold", type=float, default=0.01, help="score threshold of the kept predictions (mAP)")
    p.add_argument("--nms-iou", type=float, default=0.6)
    p.add_argument("--latency-runs", type=int, default=30)
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--no-bn-recalibrate", action="store_true",
                   help="keep BatchNorm's running statistics from training (default: recompute them on the train set)")
    p.add_argument("--no-augment", action="store_true", help="no random flips / quarter turns in training")
    p.add_argument("--config-kwargs", default=None,
                   help='extra YoloLatConfig fields as JSON, e.g. \'{"widths": [...]}\'')
    p.add_argument("--digits-size", type=int, default=32, help="--task digits: image size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default docs/results/yolo_lat.json, "
                                               "docs/results/yolo_lat_digits.json for --task digits)")
    p.add_argument("--append", action="store_true", help="keep the other variants already in --out")
    p.add_argument("--figure", default="docs/figures/yolo_lat_pred.png", help="'' for none")
    p.add_argument("--pred-dir", default="runs/yolo_lat", help="where predictions (and trainer files) go")
    p.add_argument("--save-models", action="store_true")
    p.add_argument("--eval-only", nargs="+", default=None, metavar="PRED_JSON",
                   help="score saved prediction files and merge the numbers into --out; no training")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = "docs/results/yolo_lat_digits.json" if args.task == "digits" else "docs/results/yolo_lat.json"
    return args


def main(argv=None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    if args.eval_only:
        return run_eval_only(args)
    if args.task == "digits":
        return run_digits(args)
    return run_detection(args)


if __name__ == "__main__":
    main()
