"""experiments/ovq_recall.py at toy size on the CPU: two models trained in separate --out folders (as parallel
processes would), merged into one JSON with plots; OVQ's state does not grow with the test length."""

import json
from types import SimpleNamespace

import torch
from conftest import load_experiment
from transformers import AutoModelForCausalLM

from lazoo.data.icr import IGNORE_INDEX, QUERY, icr_num_pairs

ovq_recall = load_experiment("ovq_recall")

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


class CopyOracle(torch.nn.Module):
    """A perfect recall model: the logits at position t are one-hot on the token that followed the same
    ``token_len + 1`` tokens (the key, "→" and the value tokens so far) in the context before the query
    marker. ``shift=1`` reads the logits one position late, as a wrong label shift would."""

    def __init__(self, vocab, shift=0, token_len=8):
        super().__init__()
        self.vocab, self.shift, self.span = vocab, shift, token_len + 1

    def forward(self, input_ids, logits_to_keep=0, use_cache=False):
        T = input_ids.shape[1]
        keep = torch.arange(T)[-logits_to_keep:] if isinstance(logits_to_keep, int) else logits_to_keep
        logits = torch.zeros(input_ids.shape[0], len(keep), self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            end = row.index(QUERY)
            for i, t in enumerate((keep + self.shift).tolist()):
                window = row[t + 1 - self.span:t + 1]
                match = next((j for j in range(self.span - 1, end) if row[j + 1 - self.span:j + 1] == window), None)
                if match is not None:
                    logits[b, i, row[match + 1]] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=None)


def test_copy_oracle_scores_one(single_thread):
    """The answer positions and labels line up: copying from the context is scored 1.0, the same copy read
    one position off is near chance."""
    args = ovq_recall.parse_args(["--device", "cpu", "--vocab", "64", "--n-queries", "4", "--eval-batch", "3",
                                  "--eval-batches", "2"])
    scored = ovq_recall.test(CopyOracle(64), 256, args)
    assert scored["acc"] == scored["acc_first_token"] == 1.0
    assert ovq_recall.test(CopyOracle(64, shift=1), 256, args)["acc"] < 0.2


def test_first_token_accuracy_separates_lookup_from_copying(single_thread):
    """A model that only copies the token that followed the previous token in the context (an induction head,
    no key look-up) gets most of the last 7 tokens of a value under teacher forcing (not all: single tokens
    repeat in the context) and misses the first one."""
    args = ovq_recall.parse_args(["--device", "cpu", "--vocab", "1024", "--n-queries", "4", "--eval-batch", "3",
                                  "--eval-batches", "2"])
    scored = ovq_recall.test(CopyOracle(1024, token_len=0), 512, args)
    rest = (8 * scored["acc"] - scored["acc_first_token"]) / 7  # the other 7 tokens of each value
    assert scored["acc_first_token"] < 0.2 and rest > 0.6, scored


def test_answer_logits_are_the_full_logits_at_answer_positions(single_thread):
    """``logits_to_keep`` with a tensor of positions returns the same logits as the full forward there, and
    the targets are the next tokens of those positions."""
    args = ovq_recall.parse_args(TOY)
    model = AutoModelForCausalLM.from_config(ovq_recall.make_config("sw-nope", args)).eval()
    b = ovq_recall.batch(256, 2, args, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, target = ovq_recall.answer_logits(model, b["input_ids"], b["labels"])
        full = model(input_ids=b["input_ids"]).logits
    pos = (b["labels"][0] != IGNORE_INDEX).nonzero().squeeze(1)
    torch.testing.assert_close(logits, full[:, pos - 1].float())
    assert torch.equal(target, b["input_ids"][:, pos])


def test_stage_queries_fit_the_length():
    args = ovq_recall.parse_args(["--n-queries", "32"])
    for T, expected in ((256, 7), (512, 14), (2048, 32)):
        n = ovq_recall.stage_queries(T, args)
        assert n == expected and icr_num_pairs(T, n) >= n
    assert icr_num_pairs(256, 8) < 8  # one more query than stage_queries gives no longer fits


def _stages(tmp_path, *extra):
    args = [*TOY, "--models", "sw-nope", "--test-lens", "256", "--curriculum", "64,128,512", *extra,
            "--out", str(tmp_path)]
    return ovq_recall.main(args)["runs"]["sw-nope"]["train"]["stages"]


def test_curriculum_advances_and_resumes(tmp_path, single_thread):
    """With --advance-acc 0 every stage ends after its first 20 steps (lengths >= --train-len are skipped);
    a rerun from a checkpoint taken inside the 128-token stage goes on from there."""
    common = ["--advance-acc", "0", "--curriculum-share", "1"]
    steps = lambda n: ["--steps", str(n)]  # noqa: E731  (later flags win in argparse)
    assert _stages(tmp_path / "a", *common, *steps(45)) == [[64, 0], [128, 20], [256, 40]]
    assert _stages(tmp_path / "b", *common, *steps(25)) == [[64, 0], [128, 20]]
    assert _stages(tmp_path / "b", *common, *steps(45)) == [[64, 0], [128, 20], [256, 40]]


def test_curriculum_share_ends_an_unsolved_curriculum(tmp_path, single_thread):
    assert _stages(tmp_path, "--advance-acc", "2", "--curriculum-share", "0.5", "--steps", "30") == [[64, 0], [256, 15]]


def test_time_budget_stops_training_and_anneals(tmp_path, single_thread):
    """A budget that the first step already spends: training stops after one step, marked as stopped by the
    clock; the schedule warms up linearly, then decays by a cosine to 0 at the end of the budget."""
    args = [*TOY, "--models", "sw-nope", "--test-lens", "256", "--steps", "50", "--time-budget", "1e-9",
            "--out", str(tmp_path)]
    run = ovq_recall.main(args)["runs"]["sw-nope"]
    assert run["train"]["steps"] == 1 and run["train"]["stopped_by_time_budget"]
    factors = [ovq_recall.warmup_cosine(p) for p in (0.0, 0.05, 0.1, 0.55, 1.0, 1.5)]
    assert factors[:3] == [0.0, 0.5, 1.0]
    assert abs(factors[3] - 0.5) < 1e-12 and abs(factors[4]) < 1e-12 and abs(factors[5]) < 1e-12
