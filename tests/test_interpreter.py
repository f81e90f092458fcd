"""The Triton kernels on the CPU: every ``test_interp_*`` test of the test files (in every folder below tests/),
through the interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported, and importing lazoo has already done that here, so
those tests run in one child process that conftest starts when collection ends (it runs beside the other tests).
One test per file below waits for it and reports that file's results: its default interpreter tests, and under
``-m slow`` its slow ones. Running a file with ``TRITON_INTERPRET=1`` runs its interpreter tests in-process instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

HERE = Path(__file__).parent
#: the test files, in every folder below tests/, that define interpreter tests (``def test_interp_...`` at the start
#: of a line), as paths relative to tests/ (``kernels/test_kernels_linear.py``); their names are unique, so a case's
#: id is the file's stem
FILES = sorted(p.relative_to(HERE).as_posix() for p in HERE.rglob("test_*.py")
               if p.name != Path(__file__).name and re.search(r"^def test_interp_", p.read_text(), re.M))
CASES = ([pytest.param(str(HERE / name), "default", id=Path(name).stem) for name in FILES]
         + [pytest.param(str(HERE / name), "slow", id=f"{Path(name).stem}-slow", marks=pytest.mark.slow)
            for name in FILES])


def module_name(path: str) -> str:
    """The dotted name pytest's report gives the tests of a file: its path from the repository root
    (``tests.kernels.test_kernels_linear``)."""
    return ".".join(Path(path).resolve().relative_to(HERE.parent).with_suffix("").parts)


def test_the_files_are_found():
    assert len(FILES) >= 20 and "kernels/test_kernels_linear.py" in FILES, FILES
    assert {Path(name).parts[0] for name in FILES} >= {"kernels", "ops", "models", "bench"}, FILES
    assert module_name(str(HERE / "kernels" / "test_kernels_linear.py")) == "tests.kernels.test_kernels_linear"


@pytest.mark.skipif(interpreter_ready(), reason="already interpreting: the interpreter tests run in this process")
@pytest.mark.parametrize("path,kind", CASES)
def test_kernels_in_interpreter(path, kind, interpreter_run):
    assert interpreter_run is not None, "conftest did not start the interpreter run"
    # a file's slow tests may be none; its default ones never are
    interpreter_run.check(module_name(path), require_one=kind == "default")
