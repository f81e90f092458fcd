"""A small byte-level BPE tokenizer, trained offline on the corpus itself."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # also bos and unk, as in GPT-2
PAD_TOKEN = "<|pad|>"
# effectively unlimited: sequence length is set by chunking, never by truncation
MODEL_MAX_LENGTH = 1_000_000_000


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE on `texts` and wrap it for transformers.

    Byte-level means every string is encodable (no unknown tokens) and
    decode(encode(text)) == text.
    """
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps the round trip exact
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # all 256 bytes, so unseen characters still encode
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        # transformers' clean-up would rewrite " ," as "," and break the round trip
        clean_up_tokenization_spaces=False,
    )
