"""What the benchmarks write beside their timings: the environment of a run, the command that repeats it, error
strings, JSON files and table cells."""

from __future__ import annotations

import json
import platform
import shlex
import sys


def installed_versions(*distributions: str) -> dict[str, str | None]:
    """The installed version of each distribution (its metadata's), None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in distributions:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def gpu_environment() -> dict:
    """The GPU's name and the torch, Triton and Python versions of a run on a CUDA GPU."""
    import torch

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version(),
            "python": platform.python_version()}


def command_line(name: str, argv: list[str] | None = None) -> str:
    """The command that repeats a run of ``lazoo.bench.<name>`` with ``argv`` (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"lazoo.bench.{name}", *map(str, args)])


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an error's message ("" for none), cut at ``limit`` characters."""
    return (str(err).splitlines() or [""])[0][:limit]


def error_text(err: BaseException, limit: int = 200) -> str:
    """``"<type>: <first line of the message>"``, the line cut at ``limit`` characters."""
    return f"{type(err).__name__}: {first_line(err, limit)}"


def write_json(path, data, indent: int = 1) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=indent)


def fmt(value, spec: str) -> str:
    """A table cell: ``value`` in ``spec``, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


class JsonRows(list):
    """The rows of a run, each written to a JSON-lines file and printed as it is recorded (a crash keeps what was
    measured). A context manager: the file closes at the end of the ``with`` block."""

    def __init__(self, path):
        super().__init__()
        self._file = open(path, "w")  # noqa: SIM115 - closed by __exit__

    def record(self, row: dict) -> None:
        self.append(row)
        line = json.dumps(row)
        self._file.write(line + "\n")
        self._file.flush()
        print(line, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
