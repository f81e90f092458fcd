"""lazoo.data: corpora, tokenizer and causal-LM blocks (CPU, offline, fast)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the Hub

import pytest

pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer

from lazoo.data import (
    EOS_TOKEN,
    PAD_TOKEN,
    build_lm_datasets,
    load_corpus,
    load_default_corpus,
    split_corpus,
    tokenize_and_chunk,
    train_tokenizer,
)

ENGLISH = "In the beginning, the Word was spoken -- plainly; and they said: \"Let's go!\"  Twice.\nNew line."


@pytest.fixture(scope="module")
def chapters():
    return load_default_corpus()


@pytest.fixture(scope="module")
def small_corpus(chapters):
    return Dataset.from_dict({"text": chapters[:200]})


@pytest.fixture(scope="module")
def tokenizer(chapters):
    return train_tokenizer(chapters[:200], vocab_size=512)


def test_default_corpus_is_the_kjv_by_chapter(chapters):
    assert len(chapters) == 1189
    assert chapters[0].startswith("In the beginning God created")
    assert chapters[-1].endswith("Amen.")
    assert not any(chapter[:1].isdigit() for chapter in chapters)
    assert not any("1:1 " in chapter for chapter in chapters)


def test_load_corpus_default(chapters):
    for name in (None, "kjv"):
        dataset = load_corpus(name)
        assert dataset.column_names == ["text"]
        assert dataset["text"][:3] == chapters[:3]


def test_load_txt_file_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph\nstill first.\n\nSecond one.\n\n\n")
    (tmp_path / "b.txt").write_text("Third.\n")
    single = load_corpus(tmp_path / "a.txt")
    assert list(single["text"]) == ["First paragraph\nstill first.", "Second one."]
    assert list(load_corpus(str(tmp_path))["text"]) == list(single["text"]) + ["Third."]


def test_load_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["one", "two"])))
    dataset = load_corpus(path)
    assert dataset.column_names == ["text"]
    assert list(dataset["text"]) == ["one", "two"]


def test_jsonl_without_text_names_the_columns(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(ValueError, match="body"):
        load_corpus(path)


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(tmp_path / "nope.txt")
    odd = tmp_path / "data.csv"
    odd.write_text("text\nhi\n")
    with pytest.raises(ValueError, match="data.csv"):
        load_corpus(odd)


def test_split_is_disjoint_and_deterministic(small_corpus):
    train, eval_ = split_corpus(small_corpus, eval_fraction=0.1, seed=0)
    assert len(train) + len(eval_) == len(small_corpus) and len(eval_) == 20
    assert not set(train["text"]) & set(eval_["text"])
    again_train, again_eval = split_corpus(small_corpus, eval_fraction=0.1, seed=0)
    assert list(again_eval["text"]) == list(eval_["text"])
    assert list(again_train["text"]) == list(train["text"])


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.unk_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.padding_side == "right"
    assert tokenizer.model_max_length >= 1_000_000


def test_tokenizer_round_trips_text(tokenizer, chapters):
    for text in (ENGLISH, chapters[500], "unseen: naïve café ☃ 123"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_save_and_auto_load(tokenizer, chapters, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.is_fast
    assert loaded.special_tokens_map == tokenizer.special_tokens_map
    assert loaded.pad_token_id == tokenizer.pad_token_id and loaded.eos_token_id == tokenizer.eos_token_id
    for text in (ENGLISH, chapters[300], chapters[1000]):
        ids = tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == text


def test_blocks_are_full_and_labelled(small_corpus, tokenizer):
    blocks = tokenize_and_chunk(small_corpus.select(range(20)), tokenizer, block_size=64)
    assert set(blocks.column_names) == {"input_ids", "labels"}
    assert len(blocks) > 10
    inputs = list(blocks["input_ids"])
    assert all(len(ids) == 64 for ids in inputs)
    assert list(blocks["labels"]) == inputs
    # documents are separated by eos, and nothing is padded
    stream = [t for ids in inputs for t in ids]
    assert tokenizer.eos_token_id in stream and tokenizer.pad_token_id not in stream


def test_build_lm_datasets(small_corpus):
    data = build_lm_datasets(
        small_corpus, block_size=32, vocab_size=512, eval_fraction=0.1,
        max_train_blocks=100, max_eval_blocks=10,
    )
    assert len(data.train) == 100 and len(data.eval) == 10
    assert len(data.tokenizer) == 512
    assert all(len(ids) == 32 for ids in list(data.train["input_ids"]) + list(data.eval["input_ids"]))
    again = build_lm_datasets(
        small_corpus, data.tokenizer, block_size=32, eval_fraction=0.1,
        max_train_blocks=100, max_eval_blocks=10,
    )
    assert list(again.train["input_ids"]) == list(data.train["input_ids"])
