"""lazoo.bench.profile_op on the CPU: it names the ops it knows when given another, and refuses to run without a
CUDA GPU (its profile needs one)."""

import pytest
import torch

from lazoo.bench import profile_op


def test_unknown_op_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        profile_op.main(["--op", "no_such_op"])
    err = capsys.readouterr().err
    assert "--op must be one of" in err and "ela_hadamard_exp" in err and "ovq_pytorch_assign" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_needs_a_cuda_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile_op.main(["--op", "ovq", "--T", "256"])
