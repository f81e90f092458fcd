"""Data for lazoo: corpora, a small BPE tokenizer, and causal-LM blocks."""

from .corpus import load_corpus, load_default_corpus, split_corpus
from .lm import LMData, build_lm_datasets, tokenize_and_chunk
from .mqar import mqar_batch, mqar_dataset
from .tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "LMData",
    "build_lm_datasets",
    "load_corpus",
    "load_default_corpus",
    "mqar_batch",
    "mqar_dataset",
    "split_corpus",
    "tokenize_and_chunk",
    "train_tokenizer",
]
