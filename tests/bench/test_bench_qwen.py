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


def test_prefill_and_train_rows_take_the_implementations_in_turns():
    """Round by round, one call of each implementation (the host's speed drifts between seconds): the order of the
    calls alternates and each row keeps its samples and their median."""
    import types

    from lazoo.bench import qwen

    order = []

    def fake(name):
        return lambda: order.append(name)

    rows = []
    args = types.SimpleNamespace(prefill="8", train_length=8, train_batch=2, repeats=3, device="cpu")
    models = {"lazoo": None, "transformers": None}
    original = qwen.prefill_call, qwen.train_call
    qwen.prefill_call = lambda model, args, n: fake(("prefill", id(model)))
    qwen.train_call = lambda model, args: fake(("train", id(model)))
    try:
        models = {"lazoo": types.SimpleNamespace(zero_grad=lambda **k: None),
                  "transformers": types.SimpleNamespace(zero_grad=lambda **k: None)}
        qwen.interleaved_rows(models, args, rows.append)
    finally:
        qwen.prefill_call, qwen.train_call = original
    ids = {id(m): n for n, m in models.items()}
    prefill = [ids[i] for kind, i in order if kind == "prefill"]
    # a check call and a warm-up each, then three rounds in turns
    assert prefill == ["lazoo", "transformers"] * 5
    assert [(r["implementation"], r["row"]) for r in rows] == [
        ("lazoo", "prefill"), ("transformers", "prefill"), ("lazoo", "train"), ("transformers", "train")]
    for r in rows:
        assert len(r["samples_ms"]) == 3 and r["ms"] == pytest.approx(sorted(r["samples_ms"])[1], abs=1e-3)
    assert rows[2]["tokens_per_s"] == pytest.approx(16 / (rows[2]["ms"] / 1000), rel=1e-6)
