"""The ``test_interp_*`` tests in a child process under ``TRITON_INTERPRET=1`` (started by ``tests/conftest.py``,
checked by ``tests/test_interpreter.py``)."""

from __future__ import annotations

from collections.abc import Sequence


class InterpreterRun:
    """The ``test_interp_*`` tests of some test files, in one pytest process under ``TRITON_INTERPRET=1``.

    The variable must be set before triton is first imported, which ``import lazoo`` in the test process has already
    done, so they run in a child process. It starts in the background when pytest's collection ends (see
    ``tests/conftest.py``) and runs beside the other tests on a second core; ``check(file)`` waits for it and
    asserts that the file's interpreter tests all passed (none skipped, none failed)."""

    def __init__(self, files: Sequence[str], markexpr: str, timeout: float = 3600.0):
        import os
        import subprocess
        import sys
        import tempfile

        self.timeout = timeout
        fd, self.report = tempfile.mkstemp(prefix="lazoo-interp-", suffix=".xml")
        os.close(fd)
        self.log = tempfile.TemporaryFile(mode="w+")
        # one thread: the parent process keeps the other core busy
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.pop("LAZOO_BACKEND", None)
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-m", markexpr,
               "-k", "interp", f"--junitxml={self.report}", "-o", "junit_family=xunit2"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self._results = None

    def _log_tail(self, n: int = 6000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def results(self) -> dict[str, list[tuple[str, str, str]]]:
        """``{module: [(test, outcome, message)]}`` once the run has ended (outcome: passed, failed, error,
        skipped); module is the test file's dotted path, e.g. ``tests.kernels.test_kernels_linear``."""
        import subprocess
        import xml.etree.ElementTree as ET

        if self._results is None:
            try:
                code = self.proc.wait(self.timeout)
            except subprocess.TimeoutExpired as err:
                self.proc.kill()
                raise AssertionError(
                    f"the interpreter run took over {self.timeout:.0f} s:\n{self._log_tail()}") from err
            if code not in (0, 1):  # 1: some tests failed (reported per file); else it could not run them
                raise AssertionError(f"the interpreter run exited with {code}:\n{self._log_tail()}")
            self._results = {}
            for case in ET.parse(self.report).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        text = (child.get("message") or "") + "\n...\n" + (child.text or "")[-1200:]
                        outcome, message = child.tag, text
                module = case.get("classname", "")
                self._results.setdefault(module, []).append((case.get("name", ""), outcome, message))
        return self._results

    def check(self, module: str, require_one: bool = True) -> None:
        """Assert that the interpreter tests of ``module`` passed (at least one ran, with ``require_one``)."""
        cases = [c for m, cs in self.results().items() if m == module or m.startswith(module + ".") for c in cs]
        bad = [f"{name}: {outcome}\n{message[-1500:]}" for name, outcome, message in cases if outcome != "passed"]
        assert not bad, f"{len(bad)} of {len(cases)} interpreter tests of {module} did not pass:\n" + "\n".join(bad)
        assert cases or not require_one, f"no interpreter test of {module} ran:\n{self._log_tail(3000)}"

    def stop(self) -> None:
        import os

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if os.path.exists(self.report):
            os.unlink(self.report)
