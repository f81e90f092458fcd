"""Packed boundaries read back once: ``check_cu_seqlens`` validates a ``cu_seqlens`` tensor on the host once and the
chunk tables (the delta rule's, KDA's, the other chunked kernels' ``ChunkLayout`` maps) are built once for it (a
model hands every layer the same tensor), until the tensor is changed in place; inference-mode tensors (no version
counter) are checked every call."""

from __future__ import annotations

import pytest
import torch

from lazoo.ops import packing

pytest.importorskip("triton")


@pytest.fixture
def reads(monkeypatch):
    """How many times the bounds were read back to the host."""
    count = []
    check = packing._check_bounds

    def counted(*args):
        count.append(1)
        return check(*args)
    monkeypatch.setattr(packing, "_check_bounds", counted)
    return count


def test_a_tensor_is_checked_once_until_it_changes(reads):
    cu = torch.tensor([0, 3, 8, 10])
    for _ in range(3):
        assert packing.check_cu_seqlens("op", cu, 1, 10, cu.device) is cu
    assert len(reads) == 1
    with pytest.raises(ValueError, match="end at T=12"):  # another length is checked again
        packing.check_cu_seqlens("op", cu, 1, 12, cu.device)
    cu[1] = 9  # in place: now decreasing
    with pytest.raises(ValueError, match="never decrease"):
        packing.check_cu_seqlens("op", cu, 1, 10, cu.device)
    assert len(reads) == 3


def test_other_integer_types_come_back_as_one_int64_tensor(reads):
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    first = packing.check_cu_seqlens("op", cu, 1, 10, cu.device)
    assert first.dtype == torch.int64 and first.tolist() == [0, 4, 10]
    assert packing.check_cu_seqlens("op", cu, 1, 10, cu.device) is first and len(reads) == 1
    cu[1] = 5
    assert packing.check_cu_seqlens("op", cu, 1, 10, cu.device).tolist() == [0, 5, 10]


def test_inference_tensors_are_checked_every_call(reads):
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 10])
        for _ in range(2):
            packing.check_cu_seqlens("op", cu, 1, 10, cu.device)
    assert len(reads) == 2


def _tables(family):
    from lazoo.kernels import _chunk_layout, delta, kda

    cpu = torch.device("cpu")
    q = torch.empty(1, 300, 2, 16)
    return {"delta": lambda cu: delta.seqs_for(1, 300, cu, 64, cpu),
            "kda": lambda cu: kda.seqs_for(1, 300, cu, cpu),
            "chunk_layout": lambda cu: _chunk_layout.ChunkLayout(q, q, cu, 64).chunk_indices}[family]


@pytest.mark.parametrize("family", ["delta", "kda", "chunk_layout"])
def test_chunk_tables_are_built_once_per_tensor(family):
    build = _tables(family)
    cu = torch.tensor([0, 100, 300])
    first = build(cu)
    assert build(cu) is first
    assert build(torch.tensor([0, 100, 300])) is not first  # another tensor, its own table
    cu[1] = 200
    again = build(cu)
    assert again is not first
    if family != "chunk_layout":
        assert again.cu.tolist() == [0, 200, 300]
