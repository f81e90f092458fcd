"""lazoo's local lm-eval tasks: their data, built offline from installed packages, and their YAMLs.

The YAMLs ship in ``lazoo/eval/tasks/`` with the placeholder ``__LAZOO_DATA_DIR__`` where the data folder
goes (lm-eval resolves a relative ``data_files`` against the current directory, not the YAML's folder).
:func:`prepare_tasks` writes the data (jsonl) into a folder and a copy of each YAML with that folder's
absolute path; give the folder to ``lm_eval.tasks.TaskManager(include_path=...)`` (or ``lm_eval
--include_path``).

Tasks (all deterministic, nothing downloads):

``lazoo_kjv_ppl``
    ``loglikelihood_rolling`` over whole held-out chapters of the King James Bible (the chapters that
    :func:`lazoo.data.build_lm_datasets` holds out by default: ``split_corpus(..., 0.05, seed=0)``, so the
    demo's models never trained on them). Metrics: word and byte perplexity, bits per byte (comparable
    across tokenizers).
``lazoo_kjv_next_verse``
    ``multiple_choice``: a held-out verse as context; choices are the verse that follows it in its chapter
    and three verses drawn from other held-out chapters. Metrics: acc, acc_norm (chance: 0.25).
``lazoo_mqar``
    ``generate_until``: multi-query associative recall (:mod:`lazoo.data.mqar`) rendered as words, because
    lm-eval's interface is text, not token ids: key id ``i`` is ``k<i>``, value id ``j`` is
    ``v<j - V//2>``, the separator is ``|``. The prompt is a sample up to one of its query keys, the
    target that key's value. Metric: exact match of the first word generated (up to 5 tokens, so that a
    BPE tokenizer can spell ``v48`` in pieces). Documents are shuffled (deterministically), so ``--limit``
    spans many samples. With
    :func:`mqar_word_tokenizer` the words map back to exactly the MQAR token ids, so a model trained on
    :func:`lazoo.data.mqar_batch` (e.g. by ``experiments/mqar.py``) is evaluated on its own token stream.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

#: task name -> (YAML file in lazoo/eval/tasks/, data file it reads)
TASKS = {
    "lazoo_kjv_ppl": ("lazoo_kjv_ppl.yaml", "kjv_ppl.jsonl"),
    "lazoo_kjv_next_verse": ("lazoo_kjv_next_verse.yaml", "kjv_next_verse.jsonl"),
    "lazoo_mqar": ("lazoo_mqar.yaml", "mqar.jsonl"),
}
DATA_DIR_PLACEHOLDER = "__LAZOO_DATA_DIR__"

#: held-out chapters: the default split of lazoo.data.build_lm_datasets (and so of the demo)
EVAL_FRACTION = 0.05
SPLIT_SEED = 0


# ----------------------------------------------------------------------------- KJV
def held_out_chapter_ids(num_chapters: int) -> list[int]:
    """Indices (canonical order) of the chapters ``split_corpus(..., EVAL_FRACTION, SPLIT_SEED)`` holds out."""
    from datasets import Dataset

    from lazoo.data import split_corpus

    ids = Dataset.from_dict({"idx": list(range(num_chapters))})
    _, held_out = split_corpus(ids, eval_fraction=EVAL_FRACTION, seed=SPLIT_SEED)
    return sorted(held_out["idx"])


def kjv_ppl_docs(chapters: list[list[str]], held_out: list[int], num_docs: int = 16) -> list[dict]:
    """The first ``num_docs`` held-out chapters (canonical order), one document each."""
    return [{"text": " ".join(chapters[i]), "chapter": i} for i in held_out[:num_docs]]


def kjv_next_verse_docs(chapters: list[list[str]], held_out: list[int], num_docs: int = 200,
                        num_choices: int = 4, seed: int = 0) -> list[dict]:
    """``num_docs`` (context verse, choices, label) items from held-out chapters, deterministic in ``seed``.

    Distractors come from other held-out chapters; the gold position is drawn uniformly.
    """
    rng = random.Random(seed)
    pairs = [(c, v) for c in held_out for v in range(len(chapters[c]) - 1)]
    picked = sorted(rng.sample(pairs, min(num_docs, len(pairs))))
    docs = []
    for c, v in picked:
        gold = chapters[c][v + 1]
        distractors: list[str] = []
        while len(distractors) < num_choices - 1:
            other = rng.choice(held_out)
            if other == c:
                continue
            verse = rng.choice(chapters[other])
            if verse != gold and verse not in distractors:
                distractors.append(verse)
        label = rng.randrange(num_choices)
        choices = distractors[:label] + [gold] + distractors[label:]
        docs.append({"context": chapters[c][v], "choices": choices, "label": label, "chapter": c, "verse": v})
    return docs


# ----------------------------------------------------------------------------- MQAR
def mqar_word(token_id: int, vocab_size: int = 128) -> str:
    """The word for one MQAR token id: ``k<i>`` for keys, ``v<j - V//2>`` for values, ``|`` for the separator."""
    from lazoo.data.mqar import mqar_vocab

    ids = mqar_vocab(vocab_size)
    if token_id == ids["sep"]:
        return "|"
    if ids["keys"][0] <= token_id < ids["keys"][1]:
        return f"k{token_id}"
    if ids["values"][0] <= token_id < ids["values"][1]:
        return f"v{token_id - ids['values'][0]}"
    raise ValueError(f"token_id {token_id} is outside the MQAR vocabulary of size {vocab_size}")


def mqar_docs(n_pairs: int = 8, num_samples: int = 32, vocab_size: int = 128, seed: int = 0) -> list[dict]:
    """One document per query: ``num_samples`` MQAR samples × ``n_pairs`` queries each, shuffled with ``seed``.

    The prompt of query i is the sample up to and including its i-th query key, as words; the target is
    the value bound to that key.
    """
    import torch

    from lazoo.data.mqar import IGNORE_INDEX, mqar_batch

    gen = torch.Generator().manual_seed(seed)
    batch = mqar_batch(n_pairs, num_samples, vocab_size, generator=gen)
    docs = []
    for sample, (ids, labels) in enumerate(zip(batch["input_ids"].tolist(), batch["labels"].tolist())):
        words = [mqar_word(t, vocab_size) for t in ids]
        for pos, label in enumerate(labels):
            if label == IGNORE_INDEX:
                continue
            docs.append({"prompt": " ".join(words[: pos + 1]), "target": mqar_word(label, vocab_size),
                         "sample": sample, "query": pos - 2 * n_pairs - 1, "n_pairs": n_pairs})
    random.Random(seed).shuffle(docs)
    return docs


def mqar_word_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer whose ids are exactly the MQAR ids of ``vocab_size`` (words as in the task).

    Save it next to a model trained on :func:`lazoo.data.mqar_batch` to evaluate that model on
    ``lazoo_mqar``. The separator ``|`` doubles as bos/eos/pad/unk, since MQAR uses every id of the
    vocabulary (padding is masked, and the separator never follows a query key).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {mqar_word(i, vocab_size): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="|"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="|", eos_token="|", unk_token="|",
                                   pad_token="|", padding_side="left", clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- files
def _write_jsonl(path: Path, docs: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")


def task_yaml(name: str) -> str:
    """The shipped YAML text of a local task (with the data-folder placeholder)."""
    if name not in TASKS:
        raise ValueError(f"unknown lazoo task {name!r}; the local tasks are {', '.join(TASKS)}")
    return (resources.files("lazoo.eval") / "tasks" / TASKS[name][0]).read_text(encoding="utf-8")


def prepare_tasks(folder: str | Path, tasks: list[str] | None = None, *, mqar_n_pairs: int = 8,
                  mqar_samples: int = 32, mqar_vocab_size: int = 128, ppl_chapters: int = 16,
                  next_verse_docs: int = 200) -> Path:
    """Write the data and rendered YAMLs of ``tasks`` (default: all) into ``folder``; return its absolute path.

    The result is an lm-eval ``include_path``. Everything is deterministic, so an existing folder is simply
    rewritten.
    """
    tasks = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown lazoo task(s) {', '.join(unknown)}; the local tasks are {', '.join(TASKS)}")
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)

    if {"lazoo_kjv_ppl", "lazoo_kjv_next_verse"} & set(tasks):
        from lazoo.data.corpus import kjv_verses_by_chapter

        chapters = kjv_verses_by_chapter()
        held_out = held_out_chapter_ids(len(chapters))
    for name in tasks:
        if name == "lazoo_kjv_ppl":
            docs = kjv_ppl_docs(chapters, held_out, ppl_chapters)
        elif name == "lazoo_kjv_next_verse":
            docs = kjv_next_verse_docs(chapters, held_out, next_verse_docs)
        else:
            docs = mqar_docs(mqar_n_pairs, mqar_samples, mqar_vocab_size)
        yaml_file, data_file = TASKS[name]
        _write_jsonl(folder / data_file, docs)
        # the placeholder sits inside a double-quoted YAML string: JSON escaping is valid there
        quoted = json.dumps(folder.as_posix())[1:-1]
        (folder / yaml_file).write_text(task_yaml(name).replace(DATA_DIR_PLACEHOLDER, quoted), encoding="utf-8")
    return folder
