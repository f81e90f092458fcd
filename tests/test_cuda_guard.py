"""tests/cuda_guard.py: a CUDA context that an earlier kernel broke is found and stops the test process, under
pytest-xdist (the worker exits) and without it (the session ends), naming the test."""

from __future__ import annotations

import pytest
import torch
from cuda_guard import lost_cuda_context, stop_process


def test_no_context_no_loss(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lost_cuda_context() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert lost_cuda_context() is None  # never touched: nothing to check, nothing made


def test_a_working_context_is_not_lost(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert lost_cuda_context() is None


def test_a_faulted_context_is_named(monkeypatch):
    def fault():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", fault)
    assert lost_cuda_context() == "CUDA error: an illegal memory access was encountered"


def test_an_xdist_worker_exits(monkeypatch, capsys):
    exits = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw4")
    monkeypatch.setattr("os._exit", exits.append)
    stop_process("tests/x.py::test_a", "illegal memory access")
    assert exits == [3]
    assert "lost during tests/x.py::test_a: illegal memory access" in capsys.readouterr().err


def test_a_plain_session_ends(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with pytest.raises(pytest.exit.Exception, match="lost during tests/x.py::test_a"):
        stop_process("tests/x.py::test_a", "illegal memory access")
