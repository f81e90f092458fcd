"""Multi-query associative recall (MQAR), the capacity task of the VLA paper (after Arora et al., Zoology).

Layout (the VLA paper, §5 and Figure 1): "the context contains n key-value pairs; the query section presents n keys
in shuffled order and the model must output the matching value for each", drawn as

    k1 v1 k2 v2 ... kn vn SEP kσ(1) kσ(2) ... kσ(n)        "context (2n tokens)", "queries (n tokens)"

with "fixed T = 3n+1" and "Loss is computed only at query positions". So a sample is 2n context tokens,
one separator, then the n keys again in a random permutation σ: T = 3n + 1.

Targets: at the position of the query key kσ(i) the model must emit vσ(i) ("the model must retrieve the
corresponding value at each position"). ``labels`` are therefore **aligned with the positions, not
shifted**: ``labels[b, t]`` is the target of the logits at position t (-100 everywhere but the n query
positions). Do not pass them to a Hugging Face causal LM's ``labels=`` (that would shift them by one);
compute ``cross_entropy(logits[labels != -100], labels[labels != -100])`` instead.

Vocabulary (the paper does not pin ids; its OOD experiment trains "with key tokens from {0,...,63}" and
tests "OOD, tokens {64,...,126}", which leaves 127 free; with vocab V = 128):

    keys    [0, V//2)          = 0..63    (drawn without replacement within a sample)
    values  [V//2, V-1)        = 64..126  (drawn uniformly, independently, i.e. with replacement)
    SEP     V - 1              = 127

Long-context variant (the VLA paper, §5 (b): "fixed n = 8, varying T ∈ {64, 128, 256, 512}"; the paper does not
say what fills the extra length): with ``seq_len = T > 3n + 1``, T − 3n − 1 filler tokens drawn uniformly from
the value ids go between the last pair and SEP, so the distance from every pair to its query grows with T
while the filler never looks like a key.

Keys and values never share ids. ``key_range=(lo, hi)`` restricts keys to [lo, hi) (a sub-range of the key
ids, e.g. for in/out-of-distribution key splits); n_pairs must not exceed the number of keys available.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def mqar_vocab(vocab_size: int = 128) -> dict[str, object]:
    """The id layout used for ``vocab_size``: key range, value range (half-open) and the separator id."""
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be at least 4, got {vocab_size}")
    half = vocab_size // 2
    return {"keys": (0, half), "values": (half, vocab_size - 1), "sep": vocab_size - 1}


def mqar_batch(
    n_pairs: int,
    batch_size: int,
    vocab_size: int = 128,
    *,
    generator: torch.Generator | None = None,
    key_range: tuple[int, int] | None = None,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """One batch of MQAR samples: ``input_ids`` and position-aligned ``labels``, both (batch_size, T) int64
    with T = ``seq_len`` or 3n + 1 (filler between the context and SEP): the layout of the module docstring.
    Deterministic given ``generator`` (a CPU ``torch.Generator``).
    """
    ids = mqar_vocab(vocab_size)
    k_lo, k_hi = ids["keys"] if key_range is None else key_range
    v_lo, v_hi = ids["values"]
    if not (ids["keys"][0] <= k_lo < k_hi <= ids["keys"][1]):
        raise ValueError(f"key_range {key_range} must lie within the key ids {ids['keys']}")
    if n_pairs < 1 or n_pairs > k_hi - k_lo:
        raise ValueError(f"n_pairs={n_pairs} needs 1 <= n_pairs <= {k_hi - k_lo} distinct keys")
    n, b = n_pairs, batch_size
    T = 3 * n + 1 if seq_len is None else seq_len
    if T < 3 * n + 1:
        raise ValueError(f"seq_len={seq_len} is shorter than the 3n+1 = {3 * n + 1} tokens of {n} pairs")
    # keys without replacement: the first n of a random permutation of the key ids, per sample
    keys = torch.rand(b, k_hi - k_lo, generator=generator).argsort(dim=1)[:, :n] + k_lo
    values = torch.randint(v_lo, v_hi, (b, n), generator=generator)
    perm = torch.rand(b, n, generator=generator).argsort(dim=1)
    queries, targets = keys.gather(1, perm), values.gather(1, perm)

    context = torch.stack([keys, values], dim=2).reshape(b, 2 * n)  # k1 v1 k2 v2 ...
    sep = torch.full((b, 1), ids["sep"], dtype=torch.long)
    filler = torch.randint(v_lo, v_hi, (b, T - 3 * n - 1), generator=generator)
    input_ids = torch.cat([context, filler, sep, queries], dim=1)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, T - n:] = targets
    return {"input_ids": input_ids, "labels": labels}


def mqar_dataset(n_pairs: int, num_samples: int, vocab_size: int = 128, seed: int = 0, *,
                 key_range: tuple[int, int] | None = None):
    """A fixed ``datasets.Dataset`` of ``num_samples`` MQAR samples (columns ``input_ids``, ``labels``),
    generated in chunks with a generator seeded by ``seed``."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    chunks = [mqar_batch(n_pairs, min(1024, num_samples - i), vocab_size, generator=gen, key_range=key_range)
              for i in range(0, num_samples, 1024)]
    cols = {k: torch.cat([c[k] for c in chunks]).tolist() for k in ("input_ids", "labels")}
    return Dataset.from_dict(cols)
