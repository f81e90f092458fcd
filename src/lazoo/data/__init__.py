"""Data for lazoo: corpora, a small BPE tokenizer, causal-LM blocks, synthetic tasks and detection data."""

from .corpus import kjv_verses_by_chapter, load_corpus, load_default_corpus, split_corpus
from .icr import (
                  icl_batch,
                  icl_dataset,
                  icr_batch,
                  icr_dataset,
                  icr_num_pairs,
                  positional_icr_batch,
                  positional_icr_dataset,
)
from .lm import LMData, build_lm_datasets, tokenize_and_chunk
from .mqar import mqar_batch, mqar_dataset
from .tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer
from .vision import deepforest_detection_dataset, deepforest_tiles, digits_dataset, shapes_detection_dataset, to_coco

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "LMData",
    "build_lm_datasets",
    "deepforest_detection_dataset",
    "deepforest_tiles",
    "digits_dataset",
    "icl_batch",
    "icl_dataset",
    "icr_batch",
    "icr_dataset",
    "icr_num_pairs",
    "kjv_verses_by_chapter",
    "load_corpus",
    "load_default_corpus",
    "mqar_batch",
    "mqar_dataset",
    "positional_icr_batch",
    "positional_icr_dataset",
    "shapes_detection_dataset",
    "split_corpus",
    "to_coco",
    "tokenize_and_chunk",
    "train_tokenizer",
]
