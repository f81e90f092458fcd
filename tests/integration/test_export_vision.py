"""`trust_remote_code` export of YOLO-LAT folders: a backbone's, a detector's and its image processor's folder carry
`auto_map` and a flat copy of the vision code, and load with trust_remote_code=True in a process where lazoo cannot
be imported, with the same outputs (CPU, fp32, tiny models). Also: the image processor of a ready config
(`configs/yolo-lat-*.json`), and no `use_cache` in a config saved after training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import perturb_
from export_helpers import OTHER_PYTHON, run_script

from lazoo import YoloLatBackbone, YoloLatConfig, YoloLatForObjectDetection, YoloLatImageProcessor
from lazoo.models.export import VISION_MODEL_ENTRIES, VISION_PROCESSOR_ENTRIES, exported_sources

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(widths=(8, 16, 32, 64, 64), depths=(1, 1, 1, 1), attention_heads=2, image_size=64, num_labels=3)
#: the models saved: the two variants, and the lat variant with ELA attention in every 3x3 convolution
VARIANTS = {"lat": dict(variant="lat"), "ela_all": dict(variant="lat", attention="ela", lat_scope="all"),
            "conv": dict(variant="conv")}
POST = dict(threshold=0.0, max_detections=20)  # a random head's scores are low: keep the best 20 boxes

# Runs in a fresh interpreter (lazoo hidden or never imported): loads the folders with trust_remote_code=True and
# prints their outputs as JSON. argv: the image (.npy), the backbones' input (.npy), JSON {"backbones": [...],
# "detectors": [...]} (each detector folder holds the image processor too).
LOADER = '''
    import os

    import numpy as np
    import torch
    import transformers.models.auto.auto_factory as auto_factory
    from transformers import AutoBackbone, AutoConfig, AutoImageProcessor, AutoModel, AutoModelForObjectDetection

    torch.set_num_threads(1)
    image, pixels = np.load(sys.argv[1]), torch.from_numpy(np.load(sys.argv[2]))
    folders = json.loads(sys.argv[3])
    post = json.loads(sys.argv[4])
    results = {}

    def auto_backbone(folder):
        """AutoBackbone.from_pretrained asks the Hub whether its argument is a repo before it reads anything, and
        fails on every local folder (transformers 5.17-5.24: an absolute path is no valid repo id): answered here
        for a local folder as the Hub answers for a pushed one, so the folder's AutoBackbone entry is what loads."""
        real = auto_factory.hf_api

        class LocalFolders:
            def repo_exists(self, repo_id, **kwargs):
                return os.path.isdir(repo_id) or real().repo_exists(repo_id, **kwargs)

        auto_factory.hf_api = LocalFolders
        try:
            return AutoBackbone.from_pretrained(folder, trust_remote_code=True)
        finally:
            auto_factory.hf_api = real

    def image_processor(folder):
        try:
            return AutoImageProcessor.from_pretrained(folder, trust_remote_code=True), "AutoImageProcessor"
        except ImportError as err:  # transformers 5.17 without torchvision: AutoImageProcessor is a placeholder
            if "Torchvision" not in str(err):
                raise
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            cls = get_class_from_dynamic_module("image_processing_yolo_lat.YoloLatImageProcessor", folder)
            return cls.from_pretrained(folder), "get_class_from_dynamic_module"

    def detections(found):
        return [{k: v.tolist() for k, v in d.items()} for d in found]

    with torch.no_grad():
        for folder in folders["backbones"]:
            got = results[folder] = {"config_module": type(AutoConfig.from_pretrained(
                folder, trust_remote_code=True)).__module__}
            for name, model in (("AutoModel", AutoModel.from_pretrained(folder, trust_remote_code=True)),
                                ("AutoBackbone", auto_backbone(folder))):
                got[name] = {"module": type(model).__module__, "class": type(model).__name__,
                             "feature_maps": [f.tolist() for f in model.eval()(pixels).feature_maps]}
        for folder in folders["detectors"]:
            processor, how = image_processor(folder)
            inputs = processor(image)
            model = AutoModelForObjectDetection.from_pretrained(folder, trust_remote_code=True).eval()
            out = model(inputs["pixel_values"])
            found = processor.post_process_object_detection(out, target_sizes=[image.shape[:2]], **post)
            results[folder] = {"module": type(model).__module__, "processor_module": type(processor).__module__,
                               "processor_loaded_by": how, "pixel_values": inputs["pixel_values"].tolist(),
                               "logits": out.logits.tolist(), "pred_boxes": out.pred_boxes.tolist(),
                               "detections": detections(found)}
            if folder == folders["detectors"][0]:  # re-save what was loaded, load that
                model.save_pretrained(folder + "-resaved")
                again = AutoModelForObjectDetection.from_pretrained(folder + "-resaved", trust_remote_code=True)
                results[folder]["resaved_logits"] = again.eval()(inputs["pixel_values"]).logits.tolist()
'''


def randomise_(model, seed: int = 0):
    """Perturbed weights and non-trivial batch-norm statistics, so a loader that re-initialises anything shows."""
    perturb_(model, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Backbone and detector folders of every variant (each detector's with the image processor) and the outputs
    of the saved objects, in this process."""
    root = tmp_path_factory.mktemp("export_vision")
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)  # letterboxed: padded rows
    processor = YoloLatImageProcessor(image_size=TINY["image_size"])
    pixels = processor(image)["pixel_values"]
    np.save(root / "image.npy", image)
    np.save(root / "pixels.npy", pixels.numpy())
    out = {"root": root, "image": image, "pixels": pixels, "backbones": {}, "detectors": {}}
    with torch.no_grad():
        for i, (name, options) in enumerate(VARIANTS.items()):
            config = YoloLatConfig(**TINY, **options, out_features=["stage2", "stage3", "stage4"])
            torch.manual_seed(i)
            backbone = randomise_(YoloLatBackbone(config), seed=i)
            folder = str(root / f"backbone-{name}")
            backbone.save_pretrained(folder)
            out["backbones"][name] = (folder, [f.tolist() for f in backbone(pixels).feature_maps])
            detector = randomise_(YoloLatForObjectDetection(config), seed=10 + i)
            folder = str(root / f"detector-{name}")
            detector.save_pretrained(folder)
            processor.save_pretrained(folder)
            result = detector(pixels)
            found = processor.post_process_object_detection(result, target_sizes=[image.shape[:2]], **POST)
            out["detectors"][name] = (folder, result, [{k: v.tolist() for k, v in d.items()} for d in found])
    return out


def run_loader(saved, tmp_path, python: str | None = None) -> dict:
    folders = {kind: [folder for folder, *_ in saved[kind].values()] for kind in ("backbones", "detectors")}
    args = [str(saved["root"] / "image.npy"), str(saved["root"] / "pixels.npy"), json.dumps(folders), json.dumps(POST)]
    return run_script(LOADER, args, tmp_path, **({"python": python} if python else {}))


def check_results(results, saved, mode: str) -> None:
    assert results.pop("lazoo_imported") == [], f"{mode}: lazoo was imported"
    results.pop("transformers")
    for name, (folder, feature_maps) in saved["backbones"].items():
        got = results[folder]
        assert got["config_module"].startswith("transformers_modules."), got["config_module"]
        for how in ("AutoModel", "AutoBackbone"):
            assert got[how]["module"].startswith("transformers_modules.") and got[how]["class"] == "YoloLatBackbone"
            for mine, theirs in zip(feature_maps, got[how]["feature_maps"], strict=True):
                torch.testing.assert_close(torch.tensor(theirs), torch.tensor(mine), rtol=1e-5, atol=1e-5,
                                           msg=f"{mode} backbone {name} ({how}): other feature maps")
    for name, (folder, result, found) in saved["detectors"].items():
        got = results[folder]
        assert got["module"].startswith("transformers_modules."), got["module"]
        assert got["processor_module"].startswith("transformers_modules."), got["processor_module"]
        torch.testing.assert_close(torch.tensor(got["pixel_values"]), saved["pixels"], rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["logits"]), result.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["pred_boxes"]), result.pred_boxes, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(found, got["detections"], strict=True):
            assert theirs["labels"] == mine["labels"], f"{mode} detector {name}: other detections"
            torch.testing.assert_close(torch.tensor(theirs["boxes"]), torch.tensor(mine["boxes"]), rtol=1e-4,
                                       atol=1e-3)
            torch.testing.assert_close(torch.tensor(theirs["scores"]), torch.tensor(mine["scores"]), rtol=1e-5,
                                       atol=1e-6)


def test_save_pretrained_writes_the_auto_map_and_the_code(saved):
    model_files = set(exported_sources(entries=tuple(VISION_MODEL_ENTRIES)))
    processor_files = set(exported_sources(entries=tuple(VISION_PROCESSOR_ENTRIES)))
    assert {"configuration_yolo_lat.py", "modeling_yolo_lat.py"} <= model_files
    assert "image_processing_yolo_lat.py" in processor_files
    # the vision code only: no language-model module, and of the kernels only the table of their limits and the
    # tables kept on cu_seqlens (neither imports Triton)
    assert not [f for f in model_files | processor_files if "mixers" in f or "modeling_lazoo" in f]
    assert sorted(f for f in model_files | processor_files if "kernels" in f) == [
        "lazoo_kernels__tensor_cache.py", "lazoo_kernels_limits.py"]
    for kind, expected_files in (("backbones", model_files), ("detectors", model_files | processor_files)):
        for folder, *_ in saved[kind].values():
            config = json.loads(Path(folder, "config.json").read_text())
            assert config["auto_map"] == {
                "AutoConfig": "configuration_yolo_lat.YoloLatConfig",
                "AutoBackbone": "modeling_yolo_lat.YoloLatBackbone",
                "AutoModel": "modeling_yolo_lat.YoloLatBackbone",
                "AutoModelForObjectDetection": "modeling_yolo_lat.YoloLatForObjectDetection",
                "AutoModelForImageClassification": "modeling_yolo_lat.YoloLatForImageClassification"}
            assert expected_files <= set(os.listdir(folder))
    for folder, *_ in saved["detectors"].values():
        processor = json.loads(Path(folder, "preprocessor_config.json").read_text())
        assert processor["auto_map"] == {"AutoImageProcessor": "image_processing_yolo_lat.YoloLatImageProcessor"}
    # with lazoo imported, the folders load through lazoo's own classes unless trust_remote_code=True is passed
    from transformers import AutoImageProcessor, AutoModelForObjectDetection

    folder = saved["detectors"]["lat"][0]
    assert type(AutoModelForObjectDetection.from_pretrained(folder)) is YoloLatForObjectDetection
    try:
        assert type(AutoImageProcessor.from_pretrained(folder)) is YoloLatImageProcessor
    except ImportError as err:  # transformers 5.17 without torchvision
        assert "Torchvision" in str(err)


def test_vision_folders_load_where_lazoo_cannot_be_imported(saved, tmp_path):
    results = run_loader(saved, tmp_path)
    first = saved["detectors"]["lat"]
    torch.testing.assert_close(torch.tensor(results[first[0]]["resaved_logits"]), first[1].logits, rtol=1e-5,
                               atol=1e-5, msg="the re-saved remote-code detector differs")
    check_results(results, saved, "hidden")


@pytest.mark.skipif(not OTHER_PYTHON, reason="LAZOO_OTHER_PYTHON names no other virtualenv (scripts/test_range.sh "
                                             "sets it to the other end of the supported transformers range)")
def test_a_vision_folder_saved_here_loads_on_the_other_end_of_the_range(saved, tmp_path):
    results = run_loader(saved, tmp_path, python=OTHER_PYTHON)
    assert results["transformers"] != transformers.__version__, "the other python has the same transformers"
    check_results(results, saved, f"transformers {results['transformers']}")


# ----------------------------------------------------------------------------- the ready configs' image processor
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("yolo-lat-*.json")), ids=lambda p: p.name)
def test_the_image_processor_of_a_ready_config(path, tmp_path):
    """`AutoImageProcessor.from_pretrained` (and `YoloLatImageProcessor.from_pretrained`) of a model config file
    give the processor of that model: the defaults with the config's image_size."""
    from transformers import AutoImageProcessor

    size = json.loads(path.read_text()).get("image_size", YoloLatConfig().image_size)
    processor = YoloLatImageProcessor.from_pretrained(str(path))
    assert processor.to_dict() == YoloLatImageProcessor(image_size=size).to_dict()
    try:
        auto = AutoImageProcessor.from_pretrained(str(path))
    except ImportError as err:  # transformers 5.17 without torchvision: AutoImageProcessor is a placeholder
        assert "Torchvision" in str(err)
    else:
        assert type(auto) is YoloLatImageProcessor and auto.to_dict() == processor.to_dict()
    # another image size in the config gives it to the processor
    other = tmp_path / "config.json"
    other.write_text(json.dumps({**json.loads(path.read_text()), "image_size": 96}))
    assert YoloLatImageProcessor.from_pretrained(str(other)).image_size == 96


def test_a_vision_config_saved_after_training_has_no_use_cache(tmp_path):
    """transformers' Trainer sets `config.use_cache = False` for training; a YOLO-LAT model keeps no cache, and its
    saved config says nothing about one."""
    from transformers import Trainer, TrainingArguments

    model = YoloLatForObjectDetection(YoloLatConfig(**TINY))
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                                                remove_unused_columns=False))
    assert model.config.use_cache is False
    model.save_pretrained(tmp_path / "trained")
    assert "use_cache" not in json.loads((tmp_path / "trained" / "config.json").read_text())
