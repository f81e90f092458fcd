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
