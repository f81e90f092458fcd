"""What the GPU tests do when a kernel faults: an illegal memory access (or a device-side assert) leaves the process's
CUDA context unusable, and every later test in that process would fail with the same error, naming the wrong test.
After each test marked ``gpu`` the context is checked; where it is gone, the process stops, saying which test lost
it: under pytest-xdist the worker exits (xdist reports the test as crashed and starts a fresh worker for the rest),
else the session ends."""

from __future__ import annotations

import os
import sys

import pytest
import torch


def lost_cuda_context() -> str | None:
    """None while this process's CUDA context works (or none was made), else the first line of the error it gives."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any error here means the context is unusable
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__
    return None


def stop_process(test: str, why: str) -> None:
    """End this test process after ``test`` lost the CUDA context (``why``)."""
    message = f"the CUDA context was lost during {test}: {why}"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        print(message, file=sys.stderr, flush=True)
        os._exit(3)  # xdist replaces the worker; the rest of its tests run in a fresh process
    else:
        pytest.exit(message, returncode=3)
