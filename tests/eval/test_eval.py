"""lazoo.eval: lm-evaluation-harness on lazoo models, with the local offline tasks."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from conftest import tiny_model  # noqa: E402

from lazoo.eval import TASKS, evaluate, main, make_lm, metrics_of, mqar_word_tokenizer, prepare_tasks  # noqa: E402
from lazoo.eval.local_tasks import mqar_word  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _save(tmp_path, name, tokenizer, mechanism, seed):
    folder = tmp_path / name
    model = tiny_model(mechanism, seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return prepare_tasks(tmp_path_factory.mktemp("lazoo_tasks"))


def test_prepare_tasks_writes_absolute_paths_and_deterministic_data(task_dir, tmp_path):
    for name, (yaml_file, data_file) in TASKS.items():
        text = (task_dir / yaml_file).read_text()
        assert f'test: "{task_dir.as_posix()}/{data_file}"' in text, name
        assert "__LAZOO_DATA_DIR__" not in text
    again = prepare_tasks(tmp_path / "again")
    for _, data_file in TASKS.values():
        assert (again / data_file).read_text() == (task_dir / data_file).read_text()
    # next verse: the gold choice follows the context in one chapter; four distinct choices
    for doc in _read_jsonl(task_dir / "kjv_next_verse.jsonl"):
        assert len(set(doc["choices"])) == 4 and 0 <= doc["label"] < 4
    ppl = _read_jsonl(task_dir / "kjv_ppl.jsonl")
    assert len(ppl) == 16 and all(len(d["text"]) > 500 for d in ppl)


def test_mqar_words_map_back_to_the_token_ids():
    from lazoo.data import mqar_batch

    batch = mqar_batch(6, 3, 128, generator=torch.Generator().manual_seed(1))
    tok = mqar_word_tokenizer(128)
    for ids in batch["input_ids"].tolist():
        text = " ".join(mqar_word(i) for i in ids)
        assert tok(text)["input_ids"] == ids
        assert tok.decode(ids) == text


class _Oracle:
    """An lm-eval LM that knows the answers: it reads the MQAR value from the prompt itself and the next
    verse from the task data, so the tasks' prompts, targets and metrics are checked end to end."""

    def __new__(cls, next_verse: dict[str, str]):
        from lm_eval.api.model import LM

        class Oracle(LM):
            def loglikelihood(self, requests):
                return [(0.0 if next_verse.get(ctx) == cont.strip() else -10.0, True)
                        for ctx, cont in (r.args for r in requests)]

            def loglikelihood_rolling(self, requests):
                return [-float(len(r.args[0])) for r in requests]

            def generate_until(self, requests):
                out = []
                for r in requests:
                    context, query = r.args[0].split(" | ")
                    key = query.split()[-1]
                    words = context.split()
                    out.append(" " + words[words.index(key) + 1] + " k0")
                return out

        return Oracle()


def test_local_tasks_score_an_oracle_perfectly(task_dir):
    docs = _read_jsonl(task_dir / "kjv_next_verse.jsonl")
    oracle = _Oracle({d["context"]: d["choices"][d["label"]] for d in docs})
    metrics = metrics_of(evaluate(oracle, ["lazoo_kjv_next_verse", "lazoo_mqar"], task_dir, limit=20))
    assert metrics["lazoo_kjv_next_verse"]["acc"] == 1.0
    assert metrics["lazoo_mqar"]["exact_match"] == 1.0


def test_simple_evaluate_on_a_model_instance_matches_the_model(task_dir, tokenizer):
    """HFLM around a lazoo model instance: lm-eval's rolling word perplexity equals the model's own NLL."""
    model = tiny_model("hybrid", seed=3, vocab_size=len(tokenizer))
    results = evaluate(make_lm(model, tokenizer, batch_size=2), ["lazoo_kjv_ppl", "lazoo_mqar"], task_dir, limit=1)
    metrics = metrics_of(results)
    text = _read_jsonl(task_dir / "kjv_ppl.jsonl")[0]["text"]
    ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer(text)["input_ids"]])
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().item()
    words = len(re.split(r"\s+", text))
    assert metrics["lazoo_kjv_ppl"]["word_perplexity"] == pytest.approx(math.exp(-logp / words), rel=1e-4)
    assert 0.0 <= metrics["lazoo_mqar"]["exact_match"] <= 1.0


def test_main_evaluates_two_saved_models_into_one_table(tmp_path, tokenizer, capsys):
    a = _save(tmp_path, "hybrid_model", tokenizer, "hybrid", seed=0)
    b = _save(tmp_path, "delta_model", tokenizer, "delta_net", seed=1)
    out = tmp_path / "results.json"
    assert main([str(a), str(b), "--limit", "2", "--batch-size", "2", "--device", "cpu", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and "kjv_ppl word_perplexity" in rows[0] and "mqar exact_match" in rows[0]
    assert str(a) in rows[1] and str(b) in rows[2]
    metrics = json.loads(out.read_text())["metrics"]
    assert list(metrics) == [str(a), str(b)]
    for per_task in metrics.values():
        assert set(per_task) == set(TASKS)
        assert {"word_perplexity", "bits_per_byte"} <= set(per_task["lazoo_kjv_ppl"])
        assert {"acc", "acc_norm"} <= set(per_task["lazoo_kjv_next_verse"])
        assert "exact_match" in per_task["lazoo_mqar"]
        assert all(math.isfinite(v) for row in per_task.values() for v in row.values())
    # different models, different perplexities
    assert metrics[str(a)]["lazoo_kjv_ppl"]["word_perplexity"] != metrics[str(b)]["lazoo_kjv_ppl"]["word_perplexity"]


def test_main_errors_are_clear(tmp_path, tokenizer, capsys):
    no_tok = tmp_path / "no_tokenizer"
    tiny_model("linear", vocab_size=len(tokenizer)).save_pretrained(no_tok)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        main([str(no_tok)])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main([str(tmp_path / "missing")])
    ok = _save(tmp_path, "ok", tokenizer, "linear", seed=0)
    with pytest.raises(SystemExit) as err:
        main([str(ok), "--tasks", "lazoo_kjv_ppl,hellaswag"])
    assert err.value.code == 2
    assert "unknown task(s) hellaswag" in capsys.readouterr().err


def test_mqar_with_the_word_tokenizer_generates_the_models_greedy_recall(tmp_path, task_dir):
    """A vocab-128 model with mqar_word_tokenizer: lm-eval's batched, left-padded generation answers each query
    with the model's own argmax at the query position (what experiments/mqar.py scores)."""
    tok = mqar_word_tokenizer(128)
    model = tiny_model("delta_net", seed=5, vocab_size=128, pad_token_id=127, eos_token_id=127, bos_token_id=127)
    results = evaluate(make_lm(model, tok, batch_size=3), ["lazoo_mqar"], task_dir, limit=6, log_samples=True)
    samples = results["samples"]["lazoo_mqar"]
    assert len(samples) == 6
    for sample in samples:
        ids = torch.tensor([tok(sample["doc"]["prompt"])["input_ids"]])
        with torch.no_grad():
            greedy = model(ids).logits[0, -1].argmax().item()
        assert sample["filtered_resps"][0] == tok.decode([greedy])
        assert sample["exact_match"] == float(tok.decode([greedy]) == sample["doc"]["target"])
