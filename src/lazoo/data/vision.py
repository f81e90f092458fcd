"""Vision data that ships inside installed packages: nothing downloads at run time.

Detection: the aerial tree-crown images that the ``deepforest`` package carries as test data, with their
hand-drawn boxes (Pascal VOC ``.xml`` files beside the images), cut into tiles::

    OSBS_029.png                                   400 x  400,  61 boxes
    SOAP_061.png                                   400 x  400,  37 boxes (28 "Dead", 9 "Alive")
    2019_YELL_2_541000_4977000_image_crop.png     1249 x 1035, 279 boxes
    2019_YELL_2_528000_4978000_image_crop2.png    2299 x 2472, 574 boxes

Only the package's data files are read, so it installs without its (large) dependencies::

    pip install --no-deps deepforest==2.1.0

(or point ``LAZOO_DEEPFOREST_DATA`` at a copy of the package's ``data`` folder).

Every crown is one class, ``tree`` (id 0); SOAP_061's alive/dead labels are merged. Tiles lie on a grid
without overlap (a tile reaching past the image edge is padded with black), so a split by tile never shows
the same pixels twice. Boxes are clipped to their tile; a clipped box keeping less than ``min_visible`` of
its area or narrower than ``min_size`` pixels is dropped (slivers of crowns cut by the tile border).

Classification: scikit-learn's handwritten digits (``load_digits``: 1797 images of 8 x 8 pixels, 10
classes), upsampled to a small size for a convolutional backbone, with a fixed stratified split.

A procedural shapes detection set (``shapes_detection_dataset``) is a further, synthetic check.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

#: the package images that have annotations, with the number of boxes their VOC files hold
DEEPFOREST_IMAGES: dict[str, int] = {
    "OSBS_029": 61,
    "SOAP_061": 37,
    "2019_YELL_2_541000_4977000_image_crop": 279,
    "2019_YELL_2_528000_4978000_image_crop2": 574,
}
TREE_CLASSES = ["tree"]
INSTALL_HINT = ("the tree detection data comes from the `deepforest` package's data files; install it without "
                "its dependencies: pip install --no-deps deepforest==2.1.0 (or set LAZOO_DEEPFOREST_DATA to a copy "
                "of its data folder)")


# ----------------------------------------------------------------------------------------------------------
# deepforest: whole images and their boxes
# ----------------------------------------------------------------------------------------------------------
def deepforest_data_dir() -> Path:
    """The folder with deepforest's images and annotations; a clear error when the package is missing.

    ``LAZOO_DEEPFOREST_DATA`` names a copy of that folder instead (e.g. on a machine without the package).
    """
    override = os.environ.get("LAZOO_DEEPFOREST_DATA")
    if override:
        folder = Path(override)
        if not (folder / "OSBS_029.xml").is_file():
            raise FileNotFoundError(
                f"LAZOO_DEEPFOREST_DATA={override}: no deepforest data there (OSBS_029.xml missing)")
        return folder
    spec = importlib.util.find_spec("deepforest")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not folder.is_dir():
        raise ImportError(f"deepforest is installed but has no data folder at {folder}; " + INSTALL_HINT)
    return folder


def read_voc_boxes(xml_path: str | Path) -> tuple[np.ndarray, list[str], tuple[int, int]]:
    """Boxes ``[n, 4]`` (absolute xyxy pixels, float32), their names, and the image size (width, height)."""
    root = ET.parse(xml_path).getroot()
    size = root.find("size")
    width, height = int(size.findtext("width")), int(size.findtext("height"))
    boxes, names = [], []
    for obj in root.iter("object"):
        bb = obj.find("bndbox")
        boxes.append([float(bb.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")])
        names.append(obj.findtext("name"))
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4), names, (width, height)


@functools.cache
def _load_image(path: str):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def load_deepforest_images(names: list[str] | None = None) -> list[dict]:
    """The annotated images as dicts ``{name, image (PIL RGB), boxes [n,4] xyxy, names}``."""
    folder = deepforest_data_dir()
    records = []
    for name in names or list(DEEPFOREST_IMAGES):
        if name not in DEEPFOREST_IMAGES:
            raise ValueError(f"unknown deepforest image {name!r}; choose from {list(DEEPFOREST_IMAGES)}")
        boxes, labels, (width, height) = read_voc_boxes(folder / f"{name}.xml")
        image = _load_image(str(folder / f"{name}.png"))
        if image.size != (width, height):
            raise ValueError(f"{name}: image size {image.size} differs from its annotation {(width, height)}")
        records.append({"name": name, "image": image, "boxes": boxes, "names": labels})
    return records


# ----------------------------------------------------------------------------------------------------------
# tiling
# ----------------------------------------------------------------------------------------------------------
def clip_boxes_to_tile(boxes: np.ndarray, x0: int, y0: int, tile_size: int, *, min_visible: float = 0.4,
                       min_size: float = 4.0) -> tuple[np.ndarray, np.ndarray]:
    """Boxes moved into a tile's frame and clipped to it; returns (kept boxes, index of each kept box).

    A box keeps its place if the clipped part holds at least ``min_visible`` of its area and is at least
    ``min_size`` pixels wide and high.
    """
    if boxes.size == 0:
        return boxes.reshape(0, 4), np.zeros(0, dtype=np.int64)
    shifted = boxes - np.asarray([x0, y0, x0, y0], dtype=boxes.dtype)
    clipped = np.clip(shifted, 0, tile_size)
    w, h = clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1]
    full = np.maximum(shifted[:, 2] - shifted[:, 0], 1e-6) * np.maximum(shifted[:, 3] - shifted[:, 1], 1e-6)
    keep = (w >= min_size) & (h >= min_size) & (w * h >= min_visible * full)
    index = np.nonzero(keep)[0]
    return clipped[index].astype(np.float32), index


def tile_image(image, boxes: np.ndarray, tile_size: int, *, min_fill: float = 0.25, min_visible: float = 0.4,
               min_size: float = 4.0) -> list[dict]:
    """Cut an image into a grid of ``tile_size`` squares without overlap.

    Edge tiles reaching past the image are padded with black; those whose real part covers less than
    ``min_fill`` of the tile are left out. Returns dicts ``{image, boxes, index, x0, y0}``.
    """
    from PIL import Image

    if tile_size < 16:
        raise ValueError(f"tile_size must be at least 16 pixels, got {tile_size}")
    width, height = image.size
    tiles = []
    for y0 in range(0, height, tile_size):
        for x0 in range(0, width, tile_size):
            real_w, real_h = min(tile_size, width - x0), min(tile_size, height - y0)
            if real_w * real_h < min_fill * tile_size * tile_size:
                continue
            crop = image.crop((x0, y0, x0 + real_w, y0 + real_h))
            if (real_w, real_h) != (tile_size, tile_size):
                canvas = Image.new("RGB", (tile_size, tile_size))
                canvas.paste(crop, (0, 0))
                crop = canvas
            kept, index = clip_boxes_to_tile(boxes, x0, y0, tile_size, min_visible=min_visible,
                                             min_size=min_size)
            tiles.append({"image": crop, "boxes": kept, "index": index, "x0": x0, "y0": y0})
    return tiles


def _detection_features():
    from datasets import Features, Image, Sequence, Value

    return Features({
        "image": Image(),
        "image_id": Value("int64"),
        "source": Value("string"),
        "x0": Value("int64"),
        "y0": Value("int64"),
        "width": Value("int64"),
        "height": Value("int64"),
        "boxes": Sequence(Sequence(Value("float32"), length=4)),
        "class_labels": Sequence(Value("int64")),
    })


def _split_ids(n: int, val_fraction: float, seed: int) -> set[int]:
    """A fixed random choice of ``round(n * val_fraction)`` indices (at least one when n > 1)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n > 1:
        n_val = max(1, n_val)
    order = np.random.default_rng(seed).permutation(n)
    return set(order[:n_val].tolist())


def deepforest_tiles(tile_size: int = 400, *, images: list[str] | None = None, min_fill: float = 0.25,
                     min_visible: float = 0.4, min_size: float = 4.0, keep_empty: bool = False):
    """All tiles of the annotated deepforest images as one ``datasets.Dataset`` (no split).

    Columns: ``image`` (PIL, tile_size square), ``image_id`` (0..N-1, stable for the same arguments),
    ``source`` (image name), ``x0``/``y0`` (the tile's place in its image), ``width``/``height``,
    ``boxes`` (absolute xyxy pixels in the tile), ``class_labels`` (all 0: tree).
    """
    return _cached_tiles(tile_size, tuple(images or DEEPFOREST_IMAGES), min_fill, min_visible, min_size, keep_empty)


@functools.lru_cache(maxsize=8)
def _cached_tiles(tile_size, images, min_fill, min_visible, min_size, keep_empty):
    # datasets are immutable (every transform returns a new one), so sharing one is safe
    from datasets import Dataset

    rows = {k: [] for k in _detection_features()}
    for record in load_deepforest_images(list(images)):
        for tile in tile_image(record["image"], record["boxes"], tile_size, min_fill=min_fill,
                               min_visible=min_visible, min_size=min_size):
            if len(tile["boxes"]) == 0 and not keep_empty:
                continue
            rows["image"].append(tile["image"])
            rows["image_id"].append(len(rows["image_id"]))
            rows["source"].append(record["name"])
            rows["x0"].append(tile["x0"])
            rows["y0"].append(tile["y0"])
            rows["width"].append(tile_size)
            rows["height"].append(tile_size)
            rows["boxes"].append(tile["boxes"].tolist())
            rows["class_labels"].append([0] * len(tile["boxes"]))
    return Dataset.from_dict(rows, features=_detection_features())


def deepforest_detection_dataset(tile_size: int = 400, *, val_fraction: float = 0.2, seed: int = 0,
                                 val_images: list[str] | None = None, **tile_kwargs):
    """Tree-crown tiles split into ``{"train", "validation"}`` (a ``datasets.DatasetDict``).

    By default a fixed random ``val_fraction`` of the tiles (``seed``) is held out; tiles do not overlap, so
    no pixel is in both. ``val_images`` instead holds out whole images by name (e.g. the smaller YELL crop),
    a harder test of generalisation.
    """
    from datasets import DatasetDict

    tiles = deepforest_tiles(tile_size, **tile_kwargs)
    if val_images is not None:
        unknown = set(val_images) - set(DEEPFOREST_IMAGES)
        if unknown:
            raise ValueError(f"val_images: unknown names {sorted(unknown)}; choose from {list(DEEPFOREST_IMAGES)}")
        is_val = [s in set(val_images) for s in tiles["source"]]
    else:
        held = _split_ids(len(tiles), val_fraction, seed)
        is_val = [i in held for i in range(len(tiles))]
    train = tiles.select([i for i, v in enumerate(is_val) if not v])
    val = tiles.select([i for i, v in enumerate(is_val) if v])
    return DatasetDict({"train": train, "validation": val})


def to_coco(dataset, categories: list[str] | None = None) -> dict:
    """COCO-format ground truth of a detection dataset (columns image_id, width, height, boxes xyxy,
    class_labels): ``{"images", "annotations", "categories"}`` with bbox as [x, y, w, h]."""
    categories = categories or TREE_CLASSES
    images, annotations = [], []
    columns = dataset.select_columns(["image_id", "width", "height", "boxes", "class_labels"])
    for row in columns:
        images.append({"id": int(row["image_id"]), "width": int(row["width"]), "height": int(row["height"])})
        for box, label in zip(row["boxes"], row["class_labels"]):
            x0, y0, x1, y1 = (float(v) for v in box)
            annotations.append({"id": len(annotations) + 1, "image_id": int(row["image_id"]),
                                "category_id": int(label), "bbox": [x0, y0, x1 - x0, y1 - y0],
                                "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
    return {"images": images, "annotations": annotations,
            "categories": [{"id": i, "name": name} for i, name in enumerate(categories)]}


# ----------------------------------------------------------------------------------------------------------
# digits (classification)
# ----------------------------------------------------------------------------------------------------------
def digits_dataset(image_size: int = 32, *, test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 8x8 digits as ``{"train", "test"}`` (a ``datasets.DatasetDict``): ``image`` (PIL RGB,
    ``image_size`` square, upsampled bilinearly, ink bright on black) and ``label`` (0..9).

    The split is stratified and fixed by ``seed`` (1437 / 360 images with the defaults).
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
    from PIL import Image as PILImage

    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise ImportError("the digits set ships with scikit-learn: pip install 'lazoo[vision]' "
                          "(or pip install scikit-learn)") from err

    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 (the digits are 8x8), got {image_size}")
    digits = load_digits()
    pixels = (digits.images / 16.0 * 255.0).clip(0, 255).astype(np.uint8)
    images = [PILImage.fromarray(p, mode="L").resize((image_size, image_size), PILImage.BILINEAR).convert("RGB")
              for p in pixels]
    index = np.arange(len(images))
    train_idx, test_idx = train_test_split(index, test_size=test_fraction, random_state=seed,
                                           stratify=digits.target)
    features = Features({"image": Image(), "label": ClassLabel(names=[str(d) for d in range(10)]),
                         "index": Value("int64")})

    def part(idx):
        idx = sorted(int(i) for i in idx)
        return Dataset.from_dict({"image": [images[i] for i in idx], "label": [int(digits.target[i]) for i in idx],
                                  "index": idx}, features=features)

    return DatasetDict({"train": part(train_idx), "test": part(test_idx)})


# ----------------------------------------------------------------------------------------------------------
# procedural shapes (an extra, synthetic detection set)
# ----------------------------------------------------------------------------------------------------------
SHAPE_CLASSES = ["square", "disc", "triangle"]


def shapes_detection_dataset(num_images: int = 64, image_size: int = 320, *, max_shapes: int = 4,
                             min_side: int = 24, max_side: int = 96, seed: int = 0):
    """Coloured squares, discs and triangles on a noisy background, with exact boxes (a synthetic sanity
    check beside the real trees; same columns as ``deepforest_tiles``, classes ``SHAPE_CLASSES``)."""
    from datasets import Dataset
    from PIL import Image, ImageDraw

    if not 0 < min_side <= max_side < image_size:
        raise ValueError(f"need 0 < min_side <= max_side < image_size, got {min_side}, {max_side}, {image_size}")
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in _detection_features()}
    for image_id in range(num_images):
        background = rng.integers(0, 60, size=(image_size, image_size, 3), dtype=np.uint8)
        image = Image.fromarray(background)
        draw = ImageDraw.Draw(image)
        boxes, labels = [], []
        for _ in range(int(rng.integers(1, max_shapes + 1))):
            side = int(rng.integers(min_side, max_side + 1))
            x0, y0 = (int(v) for v in rng.integers(0, image_size - side, size=2))
            x1, y1 = x0 + side, y0 + side
            # shapes may overlap; a later one hides part of an earlier one, as in real scenes
            kind = int(rng.integers(0, len(SHAPE_CLASSES)))
            colour = tuple(int(c) for c in rng.integers(100, 256, size=3))
            if kind == 0:
                draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=colour)
            elif kind == 1:
                draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=colour)
            else:
                draw.polygon([(x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1) / 2, y0)], fill=colour)
            boxes.append([float(x0), float(y0), float(x1), float(y1)])
            labels.append(kind)
        rows["image"].append(image)
        rows["image_id"].append(image_id)
        rows["source"].append("shapes")
        rows["x0"].append(0)
        rows["y0"].append(0)
        rows["width"].append(image_size)
        rows["height"].append(image_size)
        rows["boxes"].append(boxes)
        rows["class_labels"].append(labels)
    return Dataset.from_dict(rows, features=_detection_features())


def box_count(dataset) -> int:
    """Number of boxes in a detection dataset."""
    return int(sum(len(c) for c in dataset["class_labels"]))
