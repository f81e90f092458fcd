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



def test_the_mamba2_step_runs_the_op_forward_and_backward_on_the_cpu():
    step = profile_op.mamba2_step(16, argv=["--device", "cpu", "--dtype", "float32", "--tokens", "32", "--heads", "4",
                                            "--head-dim", "8", "--state-size", "8", "--chunk-size", "8"])
    grads = {}
    for name, t in step.inputs.items():
        t.register_hook(lambda g, name=name: grads.setdefault(name, g))
    step()
    assert set(grads) == {"x", "dt", "A", "B", "C", "D"}  # every input of the op gets its gradient
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert all(t.grad is None for t in step.inputs.values())  # and the step leaves none behind for the next


def test_device_busy_counts_device_events_once():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    events = [SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=900.0),  # a node: its kernels' time
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=600.0),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=300.0)]
    assert profile_op.device_busy_ms(events) == 0.9
