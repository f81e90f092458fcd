"""experiments/fused_prefill_walk.py: the walk that reads A and forms a chunk's products itself gives the float64
recurrence's outputs and final state (gated and plain rule, grouped value heads, packed sequences of ragged lengths,
a carried state, fp32 and fp16 inputs, both operand types of U = A X), so a GPU run of the script times a correct
candidate; without a CUDA GPU the script says so. The kernel runs under the Triton interpreter
(``tests/test_interpreter.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import load_experiment
from op_helpers import assert_close

from lazoo import ops

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

needs_interp = pytest.mark.skipif(
    not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start (tests/test_interpreter.py runs it)")
F64 = torch.float64


@needs_interp
@pytest.mark.parametrize("gated,dtype,a_operand,rtol", [(True, torch.float32, "fp32", 1e-4),
                                                        (False, torch.float32, "fp32", 1e-4),
                                                        (True, torch.float16, "16bit", 3e-3),
                                                        (True, torch.float16, "fp32", 3e-3)])
def test_interp_fused_walk_matches_the_recurrence(gated, dtype, a_operand, rtol):
    fw = load_experiment("fused_prefill_walk")
    H, HV, dk, dv = 2, 4, 16, 12
    cu = torch.tensor([0, 70, 71, 200])
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 200, H, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, 200, HV, dv, generator=gen, dtype=F64)
    beta = torch.rand(1, 200, HV, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(1, 200, HV, generator=gen, dtype=F64) + 2) if gated else None
    S0 = torch.randn(3, HV, dv, dk, generator=gen, dtype=F64)
    if gated:
        ro, rs = ops.gated_delta_rule(q, k, v, g, beta, scale=0.4, initial_state=S0, output_final_state=True,
                                      cu_seqlens=cu, backend="recurrent")
    else:
        ro, rs = ops.delta_rule(q, k, v, beta, scale=0.4, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                                backend="recurrent")
    f = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    f = {n: None if t is None else t.to(dtype) for n, t in f.items()}
    o, s = fw.fused_prefill(f["q"], f["k"], f["v"], f["beta"], f["g"], scale=0.4, initial_state=S0.float(),
                            output_final_state=True, cu_seqlens=cu, a_operand=a_operand)
    assert o.dtype == dtype
    assert_close(o.float(), ro, rtol, "fused walk output")
    assert_close(s, rs, rtol, "fused walk final state")


def test_script_needs_a_gpu(monkeypatch):
    fw = load_experiment("fused_prefill_walk")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fw.main([])
