"""The synthetic long-context tasks of "Online Vector Quantized Attention" (§8.4-8.5): basic ICR, positional ICR
and long ICL."""

import torch

from lazoo.data import (
    icl_batch,
    icl_dataset,
    icr_batch,
    icr_dataset,
    icr_num_pairs,
    positional_icr_batch,
    positional_icr_dataset,
)
from lazoo.data.icr import (
    ARROW,
    ICL_FIRST_FUNCTION,
    ICL_FIRST_INT,
    ICL_SEP,
    IGNORE_INDEX,
    QUERY,
    SEP,
    apply_function,
    icl_vocab,
    random_functions,
)

L = 8  # tokens per key / value


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def split_pairs(tokens, token_len=L):
    """``K → V |`` blocks -> list of (key tuple, value tuple)."""
    per = 2 * token_len + 2
    assert len(tokens) % per == 0
    out = []
    for i in range(0, len(tokens), per):
        blk = tokens[i:i + per]
        assert blk[token_len] == ARROW and blk[-1] == SEP
        out.append((tuple(blk[:token_len]), tuple(blk[token_len + 1:2 * token_len + 1])))
    return out


def test_basic_icr_layout_and_targets():
    n, nq = 12, 5
    batch = icr_batch(n, nq, 4, generator=gen())
    ids, labels = batch["input_ids"], batch["labels"]
    per = 2 * L + 2
    assert ids.shape == labels.shape == (4, (n + nq) * per + 1)
    assert int(ids.max()) < 10_000
    for b in range(4):
        row = ids[b].tolist()
        context, query = row[:n * per], row[n * per + 1:]
        assert row[n * per] == QUERY
        pairs = dict(split_pairs(context))
        assert len(pairs) == n and len(set(pairs.values())) == n  # unique keys and values
        assert not set(pairs) & set(pairs.values())
        asked = split_pairs(query)
        assert len({k for k, _ in asked}) == nq
        for key, value in asked:
            assert pairs[key] == value
        # labels: exactly the value tokens of the query section (HF convention: the model shifts)
        lab = labels[b]
        target_pos = (lab != IGNORE_INDEX).nonzero().flatten()
        assert len(target_pos) == nq * L and int(target_pos.min()) > n * per
        assert torch.equal(lab[target_pos], ids[b, target_pos])
        assert sum(lab[n * per + 1:].ne(IGNORE_INDEX).tolist()) == nq * L


def test_positional_icr_values_in_context_order():
    n, nq, c = 6, 3, 4
    ids = positional_icr_batch(n, nq, 3, copies=c, generator=gen(1))["input_ids"]
    per = 2 * L + 2
    assert ids.shape[1] == (n + nq) * c * per + 1
    for b in range(3):
        row = ids[b].tolist()
        context = split_pairs(row[:n * c * per])
        query = split_pairs(row[n * c * per + 1:])
        keys = [k for k, _ in context]
        assert len(set(keys)) == n and all(keys.count(x) == c for x in set(keys))
        assert len({v for _, v in context}) == n * c
        for j in range(nq):
            block = query[j * c:(j + 1) * c]
            key = block[0][0]
            assert all(k == key for k, _ in block)
            assert [v for _, v in block] == [v for k, v in context if k == key]


def test_icl_outputs_follow_the_bound_functions():
    width, E = 12, 30
    batch = icl_batch(E, 2, n_functions=4, generator=gen(2))
    ids, labels, which = batch["input_ids"], batch["labels"], batch["function_ids"]
    per = 2 * width + 2
    assert ids.shape == (2, E * per) and which.shape == (2, E)
    lo, hi = icl_vocab()["input_range"]
    perm, a, bias = random_functions(4, 2, width, generator=gen(2))  # the generator's first draws: the functions
    for b in range(2):
        blocks = ids[b].view(E, per)
        assert (blocks[:, -1] == ICL_SEP).all()
        fn_tok = blocks[:, width]
        assert ((fn_tok >= ICL_FIRST_FUNCTION) & (fn_tok < ICL_FIRST_INT)).all()
        x, y = blocks[:, :width] - ICL_FIRST_INT, blocks[:, width + 1:2 * width + 1] - ICL_FIRST_INT
        assert ((x >= lo) & (x < hi)).all() and int(ids.max()) < 10_000
        # one identifier per function, and every output is f(x) = bias + a·P x of its example's function
        for f in which[b].unique():
            assert len(fn_tok[which[b] == f].unique()) == 1
        assert len(fn_tok.unique()) == len(which[b].unique())
        f = which[b]
        expect = apply_function(x, perm[b, f], a[b, f], bias[b, f])
        assert torch.equal(y, expect)
        assert ((a >= 1) & (a <= 5) & (bias >= 1) & (bias <= 5)).all()
        assert torch.equal(labels[b].view(E, per)[:, width + 1:2 * width + 1], blocks[:, width + 1:2 * width + 1])
        assert (labels[b].view(E, per)[:, :width + 1] == IGNORE_INDEX).all()


def test_determinism_and_dataset_builders():
    a, b = icr_batch(5, 2, 3, generator=gen(7)), icr_batch(5, 2, 3, generator=gen(7))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], icr_batch(5, 2, 3, generator=gen(8))["input_ids"])
    ds = icr_dataset(5, 2, 300, seed=3)  # more than one generation chunk
    assert len(ds) == 300 and set(ds.column_names) == {"input_ids", "labels"}
    assert ds[0] == icr_dataset(5, 2, 300, seed=3)[0] and ds[299]["input_ids"] != ds[0]["input_ids"]
    assert len(ds[0]["input_ids"]) == 7 * 18 + 1
    pos = positional_icr_dataset(3, 1, 4, seed=0)
    assert len(pos[0]["input_ids"]) == 4 * 4 * 18 + 1
    icl = icl_dataset(5, 3, seed=0)
    assert set(icl.column_names) == {"input_ids", "labels", "function_ids"} and len(icl[0]["input_ids"]) == 5 * 26
    # lengths are free: as many pairs as fit a train length and a longer test length
    n_train, n_test = icr_num_pairs(4096, 8), icr_num_pairs(16384, 8)
    assert icr_batch(n_train, 8, 1, generator=gen())["input_ids"].shape[1] <= 4096 < (n_train + 9) * 18 + 1
    assert n_test > 3 * n_train
