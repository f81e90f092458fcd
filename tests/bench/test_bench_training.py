"""lazoo.bench.training in its CPU smoke mode: tiny lazoo and Llama models train, the JSON has their rows."""

import importlib.util
import json

import pytest

from lazoo.bench import training as bench_training


def test_cpu_tiny_rows(tmp_path, single_thread):
    out = tmp_path / "bench_training.json"
    result = bench_training.main(["--device", "cpu", "--tiny", "--mechanisms", "linear,sw-ovq", "--lengths", "32",
                                  "--steps", "1", "--warmup", "0", "--no-fla", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    env = data["env"]
    assert env["device"] == "cpu" and env["dtype"] == "fp32" and env["tie_word_embeddings"] is True
    assert env["torch"] and env["transformers"] and env["lengths"] == [32]
    rows = {(r["impl"], r["model"]): r for r in data["rows"]}
    assert set(rows) == {("transformers", "llama_sdpa"), ("lazoo", "linear"), ("lazoo", "sw-ovq")}
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert r["T"] == 32 and r["B"] == r["tokens_per_step"] // 32 >= 1
        assert r["tokens_per_s"] > 0 and r["step_ms_median"] > 0, key
        assert r["params"] > r["params_non_embedding"] > 0, key
        assert r["loss"] == r["loss"], key  # finite, not NaN
    assert rows[("transformers", "llama_sdpa")]["attn_implementation"] == "sdpa"
    assert rows[("lazoo", "sw-ovq")]["layer_types"] == ["sliding_window", "ovq"]


def test_errors_are_rows_not_crashes(tmp_path, single_thread):
    """An unknown mechanism and a missing (or skipped) fla end up as error strings in their rows."""
    out = tmp_path / "bench_training.json"
    bench_training.main(["--device", "cpu", "--tiny", "--mechanisms", "no_such_mechanism,linear", "--lengths", "16",
                         "--steps", "1", "--warmup", "0", "--no-llama", "--fla-budget", "20", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    bad = [r for r in rows if r["model"] == "no_such_mechanism"]
    assert len(bad) == 1 and "unknown layout" in bad[0]["error"] and bad[0]["tokens_per_s"] is None
    assert [r["tokens_per_s"] > 0 for r in rows if r["impl"] == "lazoo" and r["model"] == "linear"] == [True]
    fla = [r for r in rows if r["impl"] == "fla"]
    assert [r["model"] for r in fla] == ["linear"]
    if importlib.util.find_spec("fla") is None:
        assert "fla" in fla[0]["error"]


@pytest.mark.slow  # 15 s: two processes (tests/integration/test_ddp.py keeps DDP in the default run)
def test_ddp_rows_count_every_process(tmp_path):
    """--parallel ddp under `accelerate launch` (2 CPU processes, gloo): one JSON from rank 0 whose rows time
    both processes and count both processes' tokens."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(port), "-m", "lazoo.bench.training", "--device", "cpu", "--tiny", "--parallel", "ddp",
           "--mechanisms", "linear", "--lengths", "32", "--steps", "2", "--warmup", "1", "--no-llama",
           "--out", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    data = json.loads(out.read_text())
    assert data["env"]["parallel"] == "ddp" and data["env"]["world_size"] == 2
    (row,) = data["rows"]
    assert row["error"] is None and row["world_size"] == 2 and row["wrapper"] == "DistributedDataParallel"
    assert len(row["step_ms_median_per_rank"]) == 2 and row["step_ms_median"] == max(row["step_ms_median_per_rank"])
    expected = 2 * row["tokens_per_step"] / (row["step_ms_median"] / 1e3)
    assert abs(row["tokens_per_s"] - expected) < 1e-6 * row["tokens_per_s"]
