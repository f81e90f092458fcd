"""lazoo.bench.mamba2 at tiny sizes on the CPU: its float64 reference is the SSD, every op row (fla's through a
stand-in with fla's call signature, since fla's kernels need a GPU) is timed and within float32 error of that
reference, and every model row is measured; on a CUDA device (``-m gpu``), the op rows with Triton's timer."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("single_thread")

TINY_OP = ["--lengths", "32", "--tokens", "64", "--heads", "4", "--head-dim", "8", "--state-size", "8", "--groups",
           "2", "--chunk-size", "8", "--ref-length", "16", "--hf-tokens", "32"]
TINY_MODEL = ["--layers", "2", "--attention-every", "1", "--hidden-size", "32", "--intermediate-size", "48",
              "--vocab-size", "64", "--prefill", "16", "--train-length", "16", "--prompt", "4", "--new-tokens", "3"]


def fla_stand_in(q, k, v, g, scale):
    """fla's ``chunk_simple_gla(q, k, v, g, scale=...)`` computed by lazoo's gated linear attention."""
    from lazoo import ops

    return ops.gated_linear_attention(q, k, v, g, scale=scale, backend="chunk")


def test_the_float64_reference_is_the_ssd_recurrence():
    from lazoo import ops
    from lazoo.bench.mamba2 import ssd_quadratic

    torch.manual_seed(0)
    x = torch.randn(2, 13, 4, 3, dtype=torch.float64)
    B, C = (torch.randn(2, 13, 2, 5, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(2, 13, 4, dtype=torch.float64)
    A, D = -torch.rand(4, dtype=torch.float64) * 3, torch.randn(4, dtype=torch.float64)
    expected, _ = ops.mamba2(x, dt, A, B, C, D, backend="recurrent")
    assert torch.allclose(ssd_quadratic(x, dt, A, B, C, D), expected, rtol=1e-12, atol=1e-12)


def test_fla_rows_need_a_cuda_device():
    from lazoo.bench.mamba2 import load_fla_simple_gla

    assert load_fla_simple_gla("cpu") == (None, "fla's kernels need a CUDA device")


def test_the_mamba2_benchmark_measures_every_row_on_the_cpu(tmp_path, monkeypatch):
    import transformers

    from lazoo.bench import mamba2

    if not hasattr(transformers, "BambaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no BambaForCausalLM")
    monkeypatch.setattr(mamba2, "load_fla_simple_gla", lambda device: (fla_stand_in, "stand-in"))
    out = tmp_path / "bench.jsonl"
    mamba2.main(["--device", "cpu", "--dtype", "float32", *TINY_OP, *TINY_MODEL, "--repeats", "1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["env"]["transformers"] == transformers.__version__

    op = {r["impl"]: r for r in rows if r.get("part") == "op"}
    assert set(op) == {"lazoo", "transformers", "fla"}, rows
    for row in op.values():
        assert row["error"] is None and row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0, row
        assert row["rel_err_f64"] < 1e-5 and row["ref_tokens"] == 16, row
    assert (op["lazoo"]["B"], op["transformers"]["B"], op["fla"]["B"]) == (2, 1, 2)
    assert all(op[a]["lazoo_speedup_fwd"] > 0 and op[a]["lazoo_speedup_fwd_bwd"] > 0 for a in ("transformers", "fla"))

    model = [r for r in rows if r.get("part") == "model"]
    agreement = next(r for r in model if r["row"] == "agreement")
    assert agreement["relative_difference"] < 1e-4, agreement
    measured = {(r["implementation"], r["row"]) for r in model if "implementation" in r and "error" not in r}
    assert measured == {(i, r) for i in ("lazoo", "transformers") for r in ("prefill", "train", "generate")} | {
        ("lazoo", "generate-eager")}, rows

    table = out.with_suffix(".md").read_text()
    assert "| 32 | fla | 2 |" in table and "| train | 16 | tokens_per_s |" in table, table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_op_rows_on_a_cuda_device(tmp_path):
    from lazoo.bench import mamba2

    out = tmp_path / "bench.jsonl"
    mamba2.main(["--parts", "op", "--anchors", "transformers", *TINY_OP, "--lengths", "128", "--tokens", "256",
                 "--head-dim", "16", "--state-size", "16", "--chunk-size", "64", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert {r["impl"] for r in rows} == {"lazoo", "transformers"}
    for row in rows:
        assert row["error"] is None and row["fwd_bwd_ms"] > 0 and row["rel_err_f64"] < 3e-2, row
