"""Long in-context recall (ICR) and in-context learning (ICL) tasks of the OVQ paper (§8.4, §8.5).

Every sample is a plain token sequence for a causal LM: ``input_ids`` ``[B, T]`` and ``labels`` ``[B, T]``
in the **Hugging Face causal-LM convention**: ``labels[b, t] = input_ids[b, t]`` at the tokens the model
must produce and -100 elsewhere, so ``model(input_ids, labels=labels)`` (which shifts by one inside the
loss) scores exactly the answer tokens. (Unlike ``lazoo.data.mqar``, whose labels are position-aligned.)
Lengths are free: pick the number of pairs / examples per split (``icr_num_pairs`` finds how many fit a
length), e.g. train at 4k tokens and test at 16k-64k. Everything is deterministic given a CPU
``torch.Generator`` (batches) or ``seed`` (datasets).

Basic ICR (vocab 10 000; keys and values of 8 tokens; every key and every value unique in a sample)::

    K1 → V1 | K2 → V2 | ... | Kn → Vn | Q Kσ1 → Vσ1 | Kσ2 → Vσ2 | ...
    targets: the value tokens after the query marker Q

Positional ICR: n keys appear ``copies`` (4) times each in the context, each copy with its own value (all
values distinct), in a random order; the query section repeats one key ``copies`` times, and the targets
are its values in the order they appear in the context.

Ids (ICR): 0 = pad, 1 = "→", 2 = "|", 3 = query marker, 4 … V−1 = content tokens of keys and values.

Long ICL (§8.5): each sample binds ``n_functions`` random functions f(x) = b + a·P x (P a permutation of
the ``width`` = 12 input positions, integers 0 < a < 6 and 0 < b < 6) to distinct function-identifier
tokens (128 of them), then lists i.i.d. examples ``I →f O |`` where f is drawn uniformly among the
sample's functions and I is ``width`` random positive integers; the targets are every output O.

Ids (ICL): 0 = pad, 1 = "|", 2 … 129 = the 128 function identifiers, 130 + n = the integer n
(n = 0 … V − 131); inputs are drawn in 1 … (V − 131 − 5) // 5 so every output is a valid integer id.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

PAD, ARROW, SEP, QUERY = 0, 1, 2, 3
ICR_FIRST_CONTENT = 4
ICL_SEP = 1
ICL_NUM_FUNCTIONS = 128
ICL_FIRST_FUNCTION = 2
ICL_FIRST_INT = ICL_FIRST_FUNCTION + ICL_NUM_FUNCTIONS  # 130


def icr_vocab(vocab_size: int = 10_000) -> dict[str, object]:
    """The ICR id layout: special ids and the half-open content range."""
    if vocab_size <= ICR_FIRST_CONTENT + 1:
        raise ValueError(f"vocab_size must be larger than {ICR_FIRST_CONTENT + 1}, got {vocab_size}")
    return {"pad": PAD, "arrow": ARROW, "sep": SEP, "query": QUERY, "content": (ICR_FIRST_CONTENT, vocab_size)}


def icl_vocab(vocab_size: int = 10_000) -> dict[str, object]:
    """The ICL id layout: separator, function identifiers, integer ids and the input range."""
    n_ints = vocab_size - ICL_FIRST_INT
    x_max = (n_ints - 1 - 5) // 5
    if x_max < 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for integers: use at least {ICL_FIRST_INT + 11}")
    return {"pad": PAD, "sep": ICL_SEP, "functions": (ICL_FIRST_FUNCTION, ICL_FIRST_INT),
            "first_int": ICL_FIRST_INT, "input_range": (1, x_max + 1)}


def icr_pair_length(token_len: int = 8) -> int:
    """Tokens per ``K → V |`` pair."""
    return 2 * token_len + 2


def icr_num_pairs(seq_len: int, n_queries: int, token_len: int = 8, copies: int = 1) -> int:
    """How many context pairs fit ``seq_len`` tokens with ``n_queries`` queried keys (``copies`` = 4 for the
    positional task, where each queried key brings ``copies`` pairs)."""
    per = icr_pair_length(token_len)
    return (seq_len - 1 - n_queries * copies * per) // per


def _unique_rows(generator, b, m, token_len, lo, hi):
    """``[b, m, token_len]`` random content sequences, all rows of a sample distinct."""
    rows = torch.randint(lo, hi, (b, m, token_len), generator=generator)
    for i in range(b):
        while torch.unique(rows[i], dim=0).shape[0] != m:  # astronomically rare with 8 tokens of ~10^4 ids
            rows[i] = torch.randint(lo, hi, (m, token_len), generator=generator)
    return rows


def _pairs(keys, values):
    """``[b, n, L]`` keys and values -> ``[b, n * (2L + 2)]`` tokens ``K → V |`` and the value positions."""
    b, n, L = keys.shape
    arrow = torch.full((b, n, 1), ARROW, dtype=torch.long)
    sep = torch.full((b, n, 1), SEP, dtype=torch.long)
    tokens = torch.cat([keys, arrow, values, sep], dim=2).reshape(b, -1)
    is_value = torch.zeros(2 * L + 2, dtype=torch.bool)
    is_value[L + 1:2 * L + 1] = True
    return tokens, is_value.repeat(n)


def _finish(context, query_pairs, query_is_value):
    b = context.shape[0]
    marker = torch.full((b, 1), QUERY, dtype=torch.long)
    input_ids = torch.cat([context, marker, query_pairs], dim=1)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    start = context.shape[1] + 1
    labels[:, start:][:, query_is_value] = query_pairs[:, query_is_value]
    return {"input_ids": input_ids, "labels": labels}


def icr_batch(n_pairs: int, n_queries: int, batch_size: int, vocab_size: int = 10_000, *, token_len: int = 8,
              generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Basic ICR: ``n_pairs`` context pairs, then ``n_queries`` of them (distinct, random order) after the query
    marker. ``input_ids``/``labels`` ``[batch_size, (n_pairs + n_queries)·(2·token_len + 2) + 1]``."""
    if n_pairs < 1 or not 1 <= n_queries <= n_pairs:
        raise ValueError(f"need n_pairs >= 1 and 1 <= n_queries <= n_pairs, got n_pairs={n_pairs}, "
                         f"n_queries={n_queries}")
    lo, hi = icr_vocab(vocab_size)["content"]
    b = batch_size
    kv = _unique_rows(generator, b, 2 * n_pairs, token_len, lo, hi)
    keys, values = kv[:, :n_pairs], kv[:, n_pairs:]
    context, _ = _pairs(keys, values)
    pick = torch.rand(b, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]
    idx = pick[:, :, None].expand(-1, -1, token_len)
    query, is_value = _pairs(keys.gather(1, idx), values.gather(1, idx))
    return _finish(context, query, is_value)


def positional_icr_batch(n_keys: int, n_queries: int, batch_size: int, vocab_size: int = 10_000, *,
                         copies: int = 4, token_len: int = 8,
                         generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Positional ICR: ``n_keys`` keys × ``copies`` pairs (distinct values) shuffled in the context; each of the
    ``n_queries`` queried keys is shown ``copies`` times with its values in context order.
    Length ``(n_keys + n_queries)·copies·(2·token_len + 2) + 1``."""
    if n_keys < 1 or not 1 <= n_queries <= n_keys or copies < 1:
        raise ValueError(f"need n_keys >= 1, 1 <= n_queries <= n_keys and copies >= 1, got n_keys={n_keys}, "
                         f"n_queries={n_queries}, copies={copies}")
    lo, hi = icr_vocab(vocab_size)["content"]
    b, n, c = batch_size, n_keys, copies
    rows = _unique_rows(generator, b, n + n * c, token_len, lo, hi)
    keys, values = rows[:, :n], rows[:, n:]  # value j·c + r is copy r of key j
    order = torch.rand(b, n * c, generator=generator).argsort(dim=1)  # context slot -> pair id
    key_of = order // c
    gather = lambda x, i: x.gather(1, i[:, :, None].expand(-1, -1, token_len))  # noqa: E731
    context, _ = _pairs(gather(keys, key_of), gather(values, order))
    # queried keys, and each one's pair ids in context order
    qkeys = torch.rand(b, n, generator=generator).argsort(dim=1)[:, :n_queries]  # [b, nq]
    slot_of = order.argsort(dim=1)  # pair id -> context slot
    pair_ids = qkeys[:, :, None] * c + torch.arange(c)  # [b, nq, c]
    slots = slot_of.gather(1, pair_ids.reshape(b, -1)).reshape(b, n_queries, c)
    in_order = pair_ids.gather(2, slots.argsort(dim=2)).reshape(b, -1)  # by context position
    query, is_value = _pairs(gather(keys, in_order // c), gather(values, in_order))
    return _finish(context, query, is_value)


def random_functions(n: int, batch_size: int, width: int = 12, *, generator: torch.Generator | None = None):
    """``n`` random functions per sample: ``perm`` ``[B, n, width]``, ``a`` and ``b`` ``[B, n]`` in 1 … 5."""
    perm = torch.rand(batch_size, n, width, generator=generator).argsort(dim=2)
    a = torch.randint(1, 6, (batch_size, n), generator=generator)
    b = torch.randint(1, 6, (batch_size, n), generator=generator)
    return perm, a, b


def apply_function(x, perm, a, b):
    """f(x) = b + a·P x on integer vectors ``x`` ``[..., width]``: output i is ``b + a·x[perm[i]]``."""
    return b[..., None] + a[..., None] * x.gather(-1, perm)


def icl_batch(n_examples: int, batch_size: int, vocab_size: int = 10_000, *, n_functions: int = 16,
              width: int = 12, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Long ICL: ``n_examples`` i.i.d. examples ``I →f O |`` (``2·width + 2`` tokens each). Also returns
    ``function_ids`` ``[B, n_examples]`` (which of the sample's functions each example uses, 0 … n_functions−1)."""
    if not 1 <= n_functions <= ICL_NUM_FUNCTIONS:
        raise ValueError(f"n_functions must be in 1 … {ICL_NUM_FUNCTIONS}, got {n_functions}")
    if n_examples < 1:
        raise ValueError(f"n_examples must be >= 1, got {n_examples}")
    ids = icl_vocab(vocab_size)
    x_lo, x_hi = ids["input_range"]
    B, E = batch_size, n_examples
    perm, a, b = random_functions(n_functions, B, width, generator=generator)
    order = torch.rand(B, ICL_NUM_FUNCTIONS, generator=generator).argsort(dim=1)
    fn_token = order[:, :n_functions] + ICL_FIRST_FUNCTION
    which = torch.randint(0, n_functions, (B, E), generator=generator)
    x = torch.randint(x_lo, x_hi, (B, E, width), generator=generator)
    sel = lambda t: t.gather(1, which)  # noqa: E731
    y = apply_function(x, perm.gather(1, which[:, :, None].expand(-1, -1, width)), sel(a), sel(b))
    arrow = sel(fn_token)[:, :, None]
    sep = torch.full((B, E, 1), ICL_SEP, dtype=torch.long)
    input_ids = torch.cat([x + ICL_FIRST_INT, arrow, y + ICL_FIRST_INT, sep], dim=2).reshape(B, -1)
    is_out = torch.zeros(2 * width + 2, dtype=torch.bool)
    is_out[width + 1:2 * width + 1] = True
    is_out = is_out.repeat(E)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, is_out] = input_ids[:, is_out]
    return {"input_ids": input_ids, "labels": labels, "function_ids": which}


def _dataset(make, num_samples: int, seed: int, columns=("input_ids", "labels"), chunk: int = 256):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    parts = [make(min(chunk, num_samples - i), gen) for i in range(0, num_samples, chunk)]
    return Dataset.from_dict({c: torch.cat([p[c] for p in parts]).tolist() for c in columns})


def icr_dataset(n_pairs: int, n_queries: int, num_samples: int, vocab_size: int = 10_000, seed: int = 0, *,
                token_len: int = 8):
    """A fixed ``datasets.Dataset`` of basic ICR samples (columns ``input_ids``, ``labels``)."""
    return _dataset(lambda n, g: icr_batch(n_pairs, n_queries, n, vocab_size, token_len=token_len, generator=g),
                    num_samples, seed)


def positional_icr_dataset(n_keys: int, n_queries: int, num_samples: int, vocab_size: int = 10_000,
                           seed: int = 0, *, copies: int = 4, token_len: int = 8):
    """A fixed ``datasets.Dataset`` of positional ICR samples (columns ``input_ids``, ``labels``)."""
    return _dataset(lambda n, g: positional_icr_batch(n_keys, n_queries, n, vocab_size, copies=copies,
                                                      token_len=token_len, generator=g), num_samples, seed)


def icl_dataset(n_examples: int, num_samples: int, vocab_size: int = 10_000, seed: int = 0, *,
                n_functions: int = 16, width: int = 12):
    """A fixed ``datasets.Dataset`` of long-ICL samples (columns ``input_ids``, ``labels``, ``function_ids``)."""
    return _dataset(lambda n, g: icl_batch(n_examples, n, vocab_size, n_functions=n_functions, width=width,
                                           generator=g), num_samples, seed,
                    columns=("input_ids", "labels", "function_ids"))
