"""lazoo.bench.kernel_ops on the CPU: every op's inputs hold what it differentiates, and the KDA entry's inputs
are Kimi Linear's (unit q, k; a decay per key channel below 0; β in (0, 1)) and its call is the op."""

from __future__ import annotations

import torch
from op_helpers import needs_interpreter

from lazoo import ops
from lazoo.bench import kernel_ops


def test_every_op_makes_the_inputs_it_differentiates():
    for name, op in kernel_ops.kernel_ops().items():
        x = op.make(1, 32, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
        assert set(op.grads) <= set(x), name
        assert all(torch.isfinite(t).all() for t in x.values()), name


def test_kda_inputs_are_kimi_linears():
    x = kernel_ops.kda_inputs(2, 40, 3, 16, torch.bfloat16, "cpu", torch.Generator().manual_seed(1))
    assert x["g"].dtype == torch.float32 and x["g"].shape == (2, 40, 3, 16) and (x["g"] < 0).all()
    assert x["q"].dtype == x["beta"].dtype == torch.bfloat16 and x["beta"].shape == (2, 40, 3)
    torch.testing.assert_close(x["q"].float().norm(dim=-1), torch.ones(2, 40, 3), rtol=1e-2, atol=1e-2)
    assert ((x["beta"] > 0) & (x["beta"] < 1)).all()


@needs_interpreter
def test_interp_the_kda_entry_runs_the_op():
    op = kernel_ops.kernel_ops()["kda"]
    x = op.make(1, 40, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(2))
    want = ops.kda(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), use_qk_l2norm=False, backend="chunk")[0]
    assert ((op.ours(x).double() - want).abs().max() / want.abs().max()) < 1e-4
