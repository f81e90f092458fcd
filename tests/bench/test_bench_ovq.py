"""lazoo.bench.ovq's cases on the CPU at toy sizes, through the Triton interpreter (its timings need a CUDA
GPU): every case of a row runs (the op, the op with the PyTorch assignments, the kernel alone on version tables,
SDPA, the decode step three ways) and the row holds a number for each."""

import pytest
import torch

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
def test_interp_every_case_of_a_row_runs(monkeypatch):
    import triton.testing

    from lazoo.bench import ovq as bench
    for name, value in (("H", 2), ("D", 16), ("N", 24), ("L", 8)):
        monkeypatch.setattr(bench, name, value)
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(fn()) or 1.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    row = bench.bench_length(1, 40, torch.float32, "cpu", pytorch_assign=True)
    timed = ["ovq", "ovq_pytorch_assign", "ovq_kernel", "sdpa"]
    for key in [f"{c}_{m}_ms" for c in timed for m in ("fwd", "fwdbwd")] + \
            ["ovq_decode_ms", "ovq_decode_chunk_form_ms", "sdpa_decode_ms"]:
        assert row[key] == 1.0, (key, row.get(key))
    assert row["pytorch_assign_rel_diff"] < 1e-6 and "pytorch_assign_error" not in row
    assert row["ovq_dict_size"] > 0 and len(calls) == 11
