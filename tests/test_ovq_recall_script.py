"""scripts/ovq_recall.py at toy size on the CPU: two models trained in separate --out folders (as parallel
processes would), merged into one JSON with plots; OVQ's state does not grow with the test length."""

import json

from conftest import load_script

ovq_recall = load_script("ovq_recall")

TOY = ["--device", "cpu", "--steps", "2", "--train-len", "256", "--test-lens", "256,512", "--n-queries", "4",
       "--batch", "2", "--eval-batch", "1", "--eval-batches", "1", "--hidden", "32", "--layers", "2", "--heads", "2",
       "--chunk-size", "16", "--window", "16", "--vocab", "128", "--ckpt-every", "1"]


def test_parallel_folders_merge(tmp_path, single_thread):
    ovq_recall.main([*TOY, "--models", "sw-ovq", "--test-dicts", "8,32", "--out", str(tmp_path / "a")])
    ovq_recall.main([*TOY, "--models", "sw-nope", "--out", str(tmp_path / "b")])
    merged = ovq_recall.main(["--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--out", str(tmp_path / "all")])
    on_disk = json.loads((tmp_path / "all" / "ovq_recall.json").read_text())
    assert set(on_disk["runs"]) == set(merged["runs"]) == {"sw-ovq", "sw-nope"}
    assert (tmp_path / "all" / "ovq_recall_accuracy.png").is_file()
    ovq = {(t["T"], t["N"]): t for t in on_disk["runs"]["sw-ovq"]["tests"]}
    assert set(ovq) == {(256, 8), (256, 32), (512, 8), (512, 32)}
    for n in (8, 32):  # constant in T for a fixed dictionary budget, larger for a larger one
        assert ovq[(256, n)]["state_bytes"] == ovq[(512, n)]["state_bytes"] > 0
    assert ovq[(256, 8)]["state_bytes"] < ovq[(256, 32)]["state_bytes"]
    nope = {t["T"]: t["state_bytes"] for t in on_disk["runs"]["sw-nope"]["tests"]}
    assert nope[512] > nope[256]  # a KV cache grows
    assert all(0.0 <= t["acc"] <= 1.0 for run in on_disk["runs"].values() for t in run["tests"])


def test_rerun_resumes_from_checkpoint(tmp_path, single_thread, capsys):
    args = [*TOY, "--models", "sw-nope", "--test-lens", "256", "--out", str(tmp_path)]
    ovq_recall.main(args)
    ovq_recall.main([*args[:args.index("--steps") + 1], "3", *args[args.index("--steps") + 2:]])
    assert "[sw-nope] resumed at step 2" in capsys.readouterr().out
    run = json.loads((tmp_path / "ovq_recall.json").read_text())["runs"]["sw-nope"]
    assert run["train"]["steps"] == 3 and len(run["tests"]) == 1
