"""Checks of what a user gives a command (numbers, text, files and folders), each refusing bad input before any
work with one `CLIError` line that names the option."""

from __future__ import annotations

import math
import os
from pathlib import Path

from lazoo_cli.parser import SIZE_LIMITS

from .runtime import cpu_count

__all__ = ["CLIError", "COUNT_LIMITS", "check_counts", "check_range", "check_not_negative", "check_positive_float",
           "check_text", "check_new_folder", "check_new_file", "check_input_path", "read_text_file", "listing"]


class CLIError(Exception):
    """A user error: printed as `lazoo <command>: error: <message>`, exit status 2."""


#: the largest value of each count option: beyond these a run cannot fit in memory or time, or a library it
#: calls overflows (numpy seeds are 32-bit, a tokenizer's vocabulary is allocated up front), so it is refused
#: before any work. Batch sizes are also checked against the training blocks the text gives.
COUNT_LIMITS = {"steps": 10**9, "seq_len": 2**20, "block_size": 2**20, "batch_size": 2**20, "grad_accum": 2**20,
                "eval_blocks": 2**20, "max_train_blocks": 2**40, "save_steps": 10**9, "save_total_limit": 10**6,
                "logging_steps": 10**9, "max_new_tokens": 2**20, "seed": 2**32 - 1}


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def check_counts(args, names, allow_none: bool = False) -> None:
    """Each option in `names` a whole number from 1 to its limit (COUNT_LIMITS, or the size limits)."""
    for name in names:
        value = getattr(args, name)
        if value is None and allow_none:
            continue
        check_range(_flag(name), value, 1, {**COUNT_LIMITS, **SIZE_LIMITS, "threads": cpu_count()}[name])


def check_range(flag: str, value, low: int, high: int) -> None:
    if value is None or value < low:
        raise CLIError(f"{flag} must be {'a positive number' if low == 1 else f'>= {low}'}, got {value}")
    if value > high:
        raise CLIError(f"{flag} must be at most {high}, got {value}")


def check_not_negative(name: str, value) -> None:
    if value < 0:
        raise CLIError(f"{name} must be >= 0, got {value}")


def check_positive_float(name: str, value) -> None:
    if not (math.isfinite(value) and value > 0):  # nan passes `value <= 0`
        raise CLIError(f"{name} must be a positive finite number, got {value}")


def check_text(flag: str, value: str | None) -> None:
    """Text that can be written as UTF-8: a command-line argument holding bytes that are not UTF-8 arrives
    with lone surrogates, which the tokenizer, a file write or the terminal would fail on later."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CLIError(f"{flag} is not UTF-8 text (it holds {value[err.start:err.end]!r} at character {err.start}, "
                       "a byte the terminal could not decode); give UTF-8 text") from err


def check_new_folder(flag: str, folder: str) -> None:
    """A folder that exists, or can be made (refused before any work, not after a training run)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CLIError(f"{flag} {folder!r} is a file; give a folder")
    _check_can_write_under(flag, folder, Path(folder).absolute())


def check_new_file(flag: str, file: str) -> None:
    """A file path that can be written: not a folder, under a folder that exists or can be made."""
    if os.path.isdir(file):
        raise CLIError(f"{flag} {file!r} is a folder; give the path of a file")
    _check_can_write_under(flag, file, Path(file).absolute().parent)


def _check_can_write_under(flag: str, given: str, folder: Path) -> None:
    """The nearest existing folder of `folder` (itself or a parent) is a folder this user can write in."""
    check_text(flag, given)
    parent = next(p for p in (folder, *folder.parents) if p.exists())
    if not parent.is_dir():
        raise CLIError(f"{flag} {given!r}: {str(parent)!r} is a file, so no folder can be made under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {given!r}: {str(parent)!r} is not writable (permission denied)")


def check_input_path(flag: str, path: str | None, what: str) -> None:
    """An input file or folder that exists and is readable (a clear line now, not a traceback later)."""
    if path is None:
        return
    check_text(flag, path)
    if not os.path.exists(path):
        raise CLIError(f"{flag}: no such file or folder {path!r}; give {what}")
    if not os.access(path, os.R_OK):
        raise CLIError(f"{flag}: {path!r} is not readable (permission denied)")


def read_text_file(flag: str, path: str) -> str:
    """The UTF-8 text of the file at `path`, or one line naming what is wrong with it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(f"{flag}: {path} is not UTF-8 text (an invalid byte at offset {err.start}); "
                       "give a UTF-8 file") from err
    except OSError as err:
        raise CLIError(f"{flag}: cannot read {path}: {err.strerror or err}") from err


def listing(names: list[str], limit: int = 5) -> str:
    """The first `limit` of `names`, comma-separated, and how many more there are (for an error message)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
