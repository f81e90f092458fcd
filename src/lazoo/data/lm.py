"""Causal-LM datasets: documents -> tokens -> fixed-length training blocks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .corpus import load_corpus, split_corpus
from .tokenizer import train_tokenizer


def tokenize_and_chunk(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    num_proc: int | None = None,
) -> Dataset:
    """Blocks of exactly `block_size` tokens with `input_ids` and `labels` (a copy).

    Each document is followed by eos, so the model learns where texts end; the
    stream is cut into blocks and each map batch's short tail is dropped, as in
    transformers' run_clm example.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer needs an eos token to separate documents")
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], return_attention_mask=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    def group(batch):
        stream = [token for doc in batch["input_ids"] for token in doc]
        usable = len(stream) - len(stream) % block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        # the model shifts labels itself, so labels are just the inputs
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokens = dataset.map(
        tokenize,
        batched=True,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        desc="tokenizing",
    )
    return tokens.map(
        group, batched=True, num_proc=num_proc, desc=f"grouping into {block_size}-token blocks"
    )


class CorpusTooSmallError(ValueError):
    """The corpus has too few documents to hold some out for evaluation."""


def _check_documents(documents: Dataset, eval_fraction: float) -> None:
    needed = 2 if eval_fraction > 0 else 1  # at least one training and (if asked) one held-out document
    if len(documents) < needed:
        raise CorpusTooSmallError(
            f"the corpus has {len(documents)} document(s), and at least {needed} are needed: documents are "
            f"paragraphs separated by blank lines (or .jsonl records), and {eval_fraction:.0%} of them (at least "
            "one) are held out for evaluation")


@dataclass
class LMData:
    """Train and eval blocks, and the tokenizer that made them."""

    train: Dataset
    eval: Dataset
    tokenizer: PreTrainedTokenizerBase


def _first(dataset: Dataset, n: int | None) -> Dataset:
    return dataset if n is None else dataset.select(range(min(n, len(dataset))))


def build_lm_datasets(
    corpus: str | os.PathLike | Dataset | None = None,
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = None,
    *,
    block_size: int = 128,
    vocab_size: int = 2048,
    eval_fraction: float = 0.05,
    max_train_blocks: int | None = None,
    max_eval_blocks: int | None = None,
    seed: int = 0,
) -> LMData:
    """Corpus -> document-level split -> tokenizer (trained on train only) -> blocks.

    `corpus` is anything load_corpus accepts, or a ready Dataset with a "text"
    column; `tokenizer` is a tokenizer, a directory to load one from, or None to
    train a byte-level BPE of `vocab_size` on the train split.
    """
    documents = corpus if isinstance(corpus, Dataset) else load_corpus(corpus)
    _check_documents(documents, eval_fraction)
    train_docs, eval_docs = split_corpus(documents, eval_fraction=eval_fraction, seed=seed)

    if tokenizer is None:
        # eval text stays unseen, so eval loss is not flattered by the vocabulary
        tokenizer = train_tokenizer(train_docs["text"], vocab_size=vocab_size)
    elif not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)

    train = tokenize_and_chunk(train_docs, tokenizer, block_size)
    eval_ = tokenize_and_chunk(eval_docs, tokenizer, block_size)
    if max_train_blocks is not None:
        # shuffle before truncating, so a short run samples the whole corpus
        train = _first(train.shuffle(seed=seed), max_train_blocks)
    eval_ = _first(eval_, max_eval_blocks)
    return LMData(train=train, eval=eval_, tokenizer=tokenizer)
