"""Helpers to compare op backends in tests (forward, final state and all gradients).

Kept in the package (not in a conftest) so that op tests and, later, kernel tests share them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest
import torch


def interpreted() -> bool:
    """Whether the Triton interpreter is on from the start (``TRITON_INTERPRET=1``; False without Triton)."""
    try:
        from ..kernels._utils import interpreter_ready
    except ImportError:  # no triton
        return False
    return interpreter_ready()


#: the mark of an op test that runs Triton kernels through the interpreter (tests/test_interpreter.py runs them)
needs_interpreter = pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1 from the start "
                                                                  "(tests/test_interpreter.py runs it)")


def record_launches(monkeypatch, module, *names: str) -> list:
    """Replace the Triton kernels ``module.<name>`` by ones that record each launch's grid, then launch it; returns
    the list the grids go to."""
    grids = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, type("Recording", (), {
            "__getitem__": lambda self, grid, real=real: (grids.append(grid), real[grid])[1]})())
    return grids


def left_pad_mask(lengths: Sequence[int], T: int, holes: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """``[B, T]`` bool mask with ``lengths[b]`` real tokens at the right end of each row,
    plus optional interior pads ``(b, t)``."""
    t = torch.arange(T)
    mask = t[None, :] >= (T - torch.tensor(lengths))[:, None]
    for b, i in holes:
        mask[b, i] = False
    return mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (absolute error where b is all zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if a.dtype in (torch.bool, torch.int64, torch.int32):
        assert torch.equal(a, b), f"{what}: {a} != {b}"
        return
    e = rel_err(a, b)
    assert e <= rtol, f"{what}: relative error {e:.3e} > {rtol:.1e}"


def state_parts(state) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every part of a state (tensor, dict or None), in a fixed order."""
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [("state", state)]
    return [(f"state[{k!r}]", state[k]) for k in sorted(state)]


def assert_state_close(a, b, rtol: float, what: str) -> None:
    pa, pb = state_parts(a), state_parts(b)
    assert [n for n, _ in pa] == [n for n, _ in pb], f"{what}: state parts differ"
    for (name, x), (_, y) in zip(pa, pb):
        assert_close(x, y, rtol, f"{what} {name}")


def forward_and_grads(fn: Callable, leaves: Mapping[str, torch.Tensor], seed: int = 1234):
    """Run ``fn() -> (o, state)`` and take the gradients of a random projection of the output
    and of every float part of the final state w.r.t. ``leaves``."""
    o, state = fn()
    parts = [o] + [x for _, x in state_parts(state) if x.is_floating_point()]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype)).sum()
               for p in parts)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o, state, dict(zip(leaves, grads))


def compare_backends(fn: Callable, leaves: Mapping[str, torch.Tensor], rtol: float,
                     backends: tuple[str, str] = ("chunk", "recurrent")) -> None:
    """``fn(backend)`` under two backends: outputs, final states and gradients must agree."""
    test, ref = backends
    o1, s1, g1 = forward_and_grads(lambda: fn(test), leaves)
    o2, s2, g2 = forward_and_grads(lambda: fn(ref), leaves)
    assert_close(o1, o2, rtol, f"output {test} vs {ref}")
    assert_state_close(s1, s2, rtol, f"final {test} vs {ref}")
    for name in leaves:
        assert g2[name] is not None, f"no gradient reaches {name} ({ref})"
        assert g1[name] is not None, f"no gradient reaches {name} ({test})"
        assert_close(g1[name], g2[name], rtol, f"grad {name} {test} vs {ref}")


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
        skipped); module is the test file's dotted path, e.g. ``tests.test_kernels_linear``."""
        import subprocess
        import xml.etree.ElementTree as ET

        if self._results is None:
            try:
                code = self.proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise AssertionError(f"the interpreter run took over {self.timeout:.0f} s:\n{self._log_tail()}")
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
