"""The MQAR task (lazoo.data.mqar) and its driver experiments/mqar.py at tiny scale."""

import json

import pytest
import torch
from conftest import load_experiment

from lazoo.data import mqar_batch, mqar_dataset
from lazoo.data.mqar import IGNORE_INDEX, mqar_vocab


@pytest.mark.parametrize("n", [1, 4, 24, 63])
def test_batch_layout(n):
    b = 16
    batch = mqar_batch(n, b, 128, generator=torch.Generator().manual_seed(n))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (b, 3 * n + 1)
    assert ids.dtype == labels.dtype == torch.long
    vocab = mqar_vocab(128)
    keys, values = ids[:, 0:2 * n:2], ids[:, 1:2 * n:2]
    assert ((keys >= 0) & (keys < 64)).all() and ((values >= 64) & (values < 127)).all()
    assert (ids[:, 2 * n] == vocab["sep"]).all()
    assert (labels[:, :2 * n + 1] == IGNORE_INDEX).all() and (labels[:, 2 * n + 1:] != IGNORE_INDEX).all()
    queries, targets = ids[:, 2 * n + 1:], labels[:, 2 * n + 1:]
    for i in range(b):
        assert len(set(keys[i].tolist())) == n  # keys unique within a sample
        assert sorted(queries[i].tolist()) == sorted(keys[i].tolist())  # every key queried once
        kv = dict(zip(keys[i].tolist(), values[i].tolist()))
        assert [kv[q] for q in queries[i].tolist()] == targets[i].tolist()


def test_batch_determinism_key_range_and_errors():
    a = mqar_batch(8, 4, generator=torch.Generator().manual_seed(1))
    b = mqar_batch(8, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a["input_ids"], b["input_ids"])
    c = mqar_batch(8, 64, generator=torch.Generator().manual_seed(1), key_range=(32, 64))
    keys = c["input_ids"][:, 0:16:2]
    assert ((keys >= 32) & (keys < 64)).all()
    with pytest.raises(ValueError):
        mqar_batch(65, 2, generator=torch.Generator())
    with pytest.raises(ValueError):
        mqar_batch(4, 2, key_range=(60, 70))


def test_dataset():
    ds = mqar_dataset(4, 10, seed=3)
    assert len(ds) == 10 and set(ds.column_names) == {"input_ids", "labels"}
    assert all(len(x) == 13 for x in ds["input_ids"])
    assert ds["input_ids"] == mqar_dataset(4, 10, seed=3)["input_ids"]


def test_script_end_to_end(tmp_path, single_thread):
    mqar = load_experiment("mqar")
    out = tmp_path / "r.json"
    report = mqar.main(["--mechanisms", "softmax,vla", "--n-pairs", "4", "--steps", "3", "--batch-size", "8",
                        "--eval-batches", "1", "--eval-batch-size", "8", "--seeds", "0,1", "--device", "cpu",
                        "--short-conv", "off", "--out", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 4 and data["settings"]["steps"] == 3
    for run in data["runs"]:
        assert 0.0 <= run["acc"] <= 1.0 and 0.0 <= run["sample_acc"] <= run["acc"] + 1e-9
        assert run["seq_len"] == 13 and run["eval_queries"] == 8 * 4
    assert set(data["summary"]) == {"softmax", "vla"} and "4" in data["summary"]["vla"]
    assert data["versions"]["torch"] == torch.__version__ and report["wall_seconds"] > 0


@pytest.mark.slow  # 23 s: worker processes each import torch and lazoo
def test_script_runs_variants_in_worker_processes(tmp_path):
    # --jobs spawns workers that import the script as a file: run it as users do, in a subprocess
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(root / "experiments" / "mqar.py"), "--mechanisms", "vla_fixed_a,vla_signed",
                    "--n-pairs", "4", "--steps", "2", "--batch-size", "4", "--eval-batches", "1",
                    "--eval-batch-size", "4", "--device", "cpu", "--jobs", "2", "--out", str(out), "--no-progress"],
                   check=True, capture_output=True, env={**__import__("os").environ,
                                                         "PYTHONPATH": str(root / "src")})
    runs = {r["mechanism"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"vla_fixed_a", "vla_signed"}
    assert runs["vla_fixed_a"]["variant"] == {"mechanism": "vla", "precision_update": False}
    assert runs["vla_signed"]["variant"]["feature_map"] == "identity"


@pytest.mark.slow
def test_delta_net_learns_tiny_mqar(tmp_path):
    # softmax (and linear, VLA) sit on the 1/n plateau (acc ~0.27 at n=4) for hundreds of steps at this size;
    # DeltaNet, with its default short conv, solves n=4 in ~200 steps (0.96 at lr 1e-3, batch 32; ~10 s)
    mqar = load_experiment("mqar")
    report = mqar.main(["--mechanisms", "delta_net", "--n-pairs", "4", "--steps", "200", "--batch-size", "32",
                        "--lr", "1e-3", "--eval-batches", "4", "--device", "cpu",
                        "--out", str(tmp_path / "r.json"), "--no-progress"])
    assert report["runs"][0]["acc"] > 0.5, report["runs"][0]


def test_long_context_layout_puts_filler_between_pairs_and_separator():
    n, T = 8, 64
    b = mqar_batch(n, 16, 128, generator=torch.Generator().manual_seed(3), seq_len=T)
    ids, labels = b["input_ids"], b["labels"]
    assert ids.shape == labels.shape == (16, T)
    assert (ids[:, T - n - 1] == 127).all() and (ids[:, : T - n - 1] != 127).all()
    filler = ids[:, 2 * n: T - n - 1]
    assert filler.shape[1] == T - 3 * n - 1 and ((filler >= 64) & (filler < 127)).all()  # values only
    assert (labels[:, : T - n] == -100).all()
    for s in range(16):  # every query's label is the value that followed that key in the context
        pairs = dict(zip(ids[s, 0:2 * n:2].tolist(), ids[s, 1:2 * n:2].tolist()))
        assert labels[s, T - n:].tolist() == [pairs[k] for k in ids[s, T - n:].tolist()]
    with pytest.raises(ValueError, match="seq_len"):
        mqar_batch(n, 2, 128, seq_len=3 * n)
