"""lazoo.bench.yolo_lat on the CPU: every row at a tiny size, the table, the JSON, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from lazoo.bench import yolo_lat


def test_rows_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = yolo_lat.main(["--device", "cpu", "--variants", "conv,lat_all", "--batch-sizes", "1", "2",
                            "--image-size", "64", "--num-labels", "2", "--repeats", "1", "--threads", "1",
                            "--out", str(out)])
    rows = result["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("conv", 1), ("lat_all", 1), ("conv", 2), ("lat_all", 2)]
    params = {r["variant"]: r["parameters"] for r in rows}
    assert params["lat_all"] < params["conv"]  # the separable convolutions are the point
    by_variant = {r["variant"]: r for r in rows if r["batch"] == 1}
    # fewer multiply-adds, more (smaller) operations: what the GPU's launch-bound times follow
    assert 0 < by_variant["lat_all"]["gflops_per_image"] < by_variant["conv"]["gflops_per_image"]
    assert by_variant["lat_all"]["operations_per_forward"] > by_variant["conv"]["operations_per_forward"] > 0
    assert all(r["eager_ms"] > 0 and "cuda_graph_ms" not in r and "error" not in r for r in rows)
    assert json.loads(out.read_text())["env"]["device"] == "cpu"
    assert "lazoo.bench.yolo_lat" in result["env"]["command"]
    printed = capsys.readouterr().out
    assert "| 1 | lat_all |" in printed and "| 2 | conv |" in printed


def test_refusals():
    with pytest.raises(SystemExit, match="unknown yolo"):
        yolo_lat.main(["--device", "cpu", "--variants", "yolo"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            yolo_lat.main(["--device", "cuda"])


def test_parameters_by_kind_add_up_and_follow_the_variant(tmp_path, capsys):
    """--parameters-only: the kinds sum to the total; conv has no depthwise convolutions, lat_all no dense k×k but
    the stem's; halving the widths takes conv's parameters below half (most are c²)."""
    out = tmp_path / "params.json"
    result = yolo_lat.main(["--parameters-only", "--variants", "conv,lat_all", "--width-scales", "1", "0.5",
                            "--num-labels", "2", "--out", str(out)])
    rows = {(r["variant"], r["width_scale"]): r for r in result["rows"]}
    for r in rows.values():
        assert r["dense_kxk"] + r["depthwise_kxk"] + r["pointwise_1x1"] + r["other"] == r["parameters"]
    conv, lat_all = rows[("conv", 1.0)], rows[("lat_all", 1.0)]
    assert conv["depthwise_kxk"] == 0 and conv["dense_kxk"] > conv["pointwise_1x1"]
    stem = 3 * 3 * 3 * lat_all["widths"][0]
    assert lat_all["dense_kxk"] == stem and lat_all["pointwise_1x1"] > 0.9 * lat_all["parameters"]
    assert rows[("conv", 0.5)]["widths"] == [8, 16, 32, 64, 128]
    assert rows[("conv", 0.5)]["parameters"] < conv["parameters"] / 2
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert "| 0.5 | lat_all |" in capsys.readouterr().out


def test_ablation_variants_change_only_where_the_attention_branch_sits():
    """lat_local: lat's separable bottlenecks with no attention branch; lat_attn8: the branch from stride 8 as well
    as 16 and 32. Their other weights are lat's, so lat_local < lat < lat_attn8 in parameters."""
    from lazoo.vision.modeling_yolo_lat import GlobalAttention2d, LatBottleneck

    def attention_blocks(model):
        return sum(isinstance(m, GlobalAttention2d) for m in model.modules())

    models = {v: yolo_lat.build_detector(v, 1, 64) for v in ("lat", "lat_local", "lat_attn8")}
    counts = {v: attention_blocks(m) for v, m in models.items()}
    assert counts["lat_local"] == 0 < counts["lat"] < counts["lat_attn8"]
    separable = {v: sum(isinstance(m, LatBottleneck) for m in model.modules()) for v, model in models.items()}
    assert len(set(separable.values())) == 1  # the same bottlenecks, with or without the branch
    params = {v: yolo_lat.count_parameters(m) for v, m in models.items()}
    assert params["lat_local"] < params["lat"] < params["lat_attn8"]
