"""The library loggers of the command-line and converter tests: an autouse fixture that a test module takes in by
importing it (``from log_helpers import library_logs_to_a_live_stream  # noqa: F401``)."""

from __future__ import annotations

import logging
import sys

import pytest


@pytest.fixture(autouse=True)
def library_logs_to_a_live_stream():
    """datasets and transformers give their loggers a handler on the sys.stderr of their first use; when that was an
    earlier test's captured stream (closed since), a log call here prints "--- Logging error ---" into the output
    these tests read. Their records go to the process's own stderr instead (not setStream: it flushes the old,
    closed stream first)."""
    for name in ("datasets", "transformers"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.__stderr__
