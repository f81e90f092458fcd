"""lazoo.bench.delta_frontier on the CPU: its inputs, its float64 reference and its error measure (the timings need
a GPU)."""

import pytest
import torch

from lazoo import ops
from lazoo.bench import delta_frontier as frontier


def test_inputs_have_the_layers_layout_and_dtypes():
    x = frontier.make_inputs(T=5, B=2, H=2, HV=4, dtype=torch.bfloat16, device="cpu")
    assert x["q"].shape == x["k"].shape == (2, 5, 2, frontier.D) and x["v"].shape == (2, 5, 4, frontier.D)
    assert x["beta"].shape == x["g"].shape == (2, 5, 4)
    assert x["q"].dtype == x["beta"].dtype == torch.bfloat16 and x["g"].dtype == torch.float32
    assert (x["g"] < 0).all()


@pytest.mark.parametrize("gated", [True, False])
def test_the_reference_is_the_op_in_float64_and_the_error_sees_a_change(gated):
    x = frontier.make_inputs(T=9, B=1, H=2, HV=4 if gated else 2, dtype=torch.float32, device="cpu", seed=3)
    ref = frontier.reference(x, gated)
    assert ref.dtype == torch.float64
    op = ops.gated_delta_rule if gated else ops.delta_rule
    args = (x["q"], x["k"], x["v"]) + ((x["g"],) if gated else ()) + (x["beta"],)
    out = op(*args, scale=frontier.D ** -0.5, backend="recurrent")[0]
    assert frontier.relative_error(out, ref) < 1e-5
    assert frontier.relative_error(out * 1.01, ref) > 5e-3


def test_it_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        frontier.main(["--out", "unused.jsonl"])


def test_rows_are_written_as_they_are_measured(monkeypatch, tmp_path):
    """A run stopped part-way (a timeout while TileLang compiles) keeps the shapes it finished."""
    import json

    monkeypatch.setattr(frontier, "require_cuda", lambda name: None)
    monkeypatch.setattr(frontier, "gpu_environment", lambda: {"gpu": "test"})
    monkeypatch.setattr(frontier, "card_ceilings", lambda device: {})
    monkeypatch.setattr(frontier, "implementations", lambda gated: {})
    done = []

    def one_shape(op, gated, impls, T, B, H, HV, *rest):
        if done:
            raise KeyboardInterrupt
        done.append(T)
        return [{"op": op, "impl": "lazoo", "T": T, "B": B, "H": H, "HV": HV, "fwd_ms": 1.0}]

    monkeypatch.setattr(frontier, "bench_shape", one_shape)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        frontier.main(["--out", str(out), "--ops", "gated_delta_rule", "--shapes", "64:1:2:2,128:1:2:2"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["env"]["gpu"] == "test" and [r["T"] for r in lines[1:]] == [64]


def test_the_decode_reference_is_one_step_of_the_gated_delta_rule():
    """reference_step against the update written out in float64: S' = αS + β(v − αS k̂)k̂ᵀ, o = S' q̂ (q̂, k̂
    L2-normalised, q̂ scaled), value head j reading key head j // 2 (two value heads a key head)."""
    B, H, HV, D = 2, 2, 4, frontier.D
    x = frontier.make_inputs(1, B, H, HV, torch.float32, "cpu", seed=4)
    x["S"] = torch.randn(B, HV, D, D, generator=torch.Generator().manual_seed(5)) * 0.1
    got = frontier.reference_step(x)
    x64 = {n: t.double() for n, t in x.items()}
    def l2norm(t):  # lazoo's: t / sqrt(|t|² + 1e-6)
        return t / ((t * t).sum(-1, keepdim=True) + 1e-6).sqrt()

    q = l2norm(x64["q"][:, 0]) * D ** -0.5
    k = l2norm(x64["k"][:, 0])
    want = torch.empty(B, 1, HV, D, dtype=torch.float64)
    for b in range(B):
        for j in range(HV):
            S, kk, qq = x64["S"][b, j], k[b, j // 2], q[b, j // 2]
            alpha, beta = x64["g"][b, 0, j].exp(), x64["beta"][b, 0, j]
            S1 = alpha * S + beta * torch.outer(x64["v"][b, 0, j] - alpha * S @ kk, kk)
            want[b, 0, j] = S1 @ qq
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert frontier.relative_error(got.float(), want) < 1e-6


def test_decode_shapes_parse():
    assert frontier.decode_shapes(None) == frontier.DECODE_SHAPES == [(32, 16, 32)]
    assert frontier.decode_shapes("") == []
    assert frontier.decode_shapes("8:16:16,32:16:32") == [(8, 16, 16), (32, 16, 32)]


def test_the_cache_folder_keeps_tilelang_s_kernels_too(monkeypatch, tmp_path, kernel_cache_env):
    """--triton-cache DIR: Triton's cache and autotuning in DIR, TileLang's in DIR/tilelang unless already set."""
    cache = frontier.use_kernel_caches(tmp_path / "tc")
    assert cache["dir"] == str(tmp_path / "tc") and cache["tilelang"] == str(tmp_path / "tc" / "tilelang")
    import os

    assert os.environ["TRITON_CACHE_DIR"] == cache["dir"] and os.environ["TILELANG_CACHE_DIR"] == cache["tilelang"]
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "mine"))
    assert frontier.use_kernel_caches(tmp_path / "tc")["tilelang"] == str(tmp_path / "mine")
