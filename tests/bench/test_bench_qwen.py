"""lazoo.bench.qwen on the CPU at a tiny size: every row is measured (no error rows) for both implementations."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_qwen_benchmark_measures_every_row_on_the_cpu(tmp_path):
    import transformers

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3_5ForCausalLM")
    from lazoo.bench.qwen import main

    out = tmp_path / "bench.jsonl"
    main(["--device", "cpu", "--dtype", "float32", "--layers", "4", "--hidden-size", "32", "--vocab-size", "64",
          "--prefill", "16", "--train-length", "16", "--batch-sizes", "1", "--prompt", "4", "--new-tokens", "3",
          "--repeats", "1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["env"]["transformers"] == transformers.__version__
    assert rows[1]["row"] == "agreement" and rows[1]["relative_difference"] < 1e-4, rows[1]
    measured = {(r["implementation"], r["row"]) for r in rows[2:] if "error" not in r}
    assert measured == {(i, r) for i in ("lazoo", "transformers") for r in ("prefill", "train", "generate")} | {
        ("lazoo", "generate-eager")}, rows
