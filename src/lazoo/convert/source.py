"""A checkpoint folder read as untrusted input.

Every file is named relative to the folder and must resolve inside it: no absolute names, no `..`, no symbolic
link that leads out (a link inside the folder is followed). JSON files are read with a size cap and must be UTF-8
objects; a safetensors header is parsed here, with a size cap, and checked against the file's length before any
tensor data is read, so that what a file claims can be compared with what a config claims before memory is spent.
Operating-system failures (permission denied, no space left, read-only file system) become a `ConversionError`
that says what failed on which path. Every message is one line.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import torch

#: JSON files larger than this are refused unread (configs and indexes are kilobytes; tokenizers tens of MB)
MAX_JSON_BYTES = 256 << 20
#: safetensors' own limit on a header
MAX_HEADER_BYTES = 100_000_000
#: the safetensors dtypes a fla checkpoint's weights may have, with their torch dtype
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
#: a tensor of more dimensions than this is no weight of a language model
MAX_DIMS = 8

#: errno -> the words a message uses for it (others: the system's own text)
OS_FAILURES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "read-only file system", errno.ENOENT: "no such file or folder",
               errno.ENOTDIR: "not a folder on the way", errno.EISDIR: "a folder where a file was expected",
               errno.ELOOP: "a loop of symbolic links", errno.EIO: "input/output error"}


class ConversionError(ValueError):
    """A checkpoint folder that cannot be converted: the one-line message names the file and, where there is one,
    the field (malformed input, a failed read or write). Nothing is left in the destination."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class UnsupportedCheckpointError(ConversionError):
    """A fla checkpoint uses something lazoo cannot express exactly (the message names the field)."""


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped (names in a checkpoint may hold them), so that
    a message prints as one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def shown(value, limit: int = 160) -> str:
    """`repr(value)`, its middle cut to keep `limit` characters (a config value may be megabytes long)."""
    text = repr(value)
    half = (limit - 3) // 2
    return text if len(text) <= limit else text[:half] + "..." + text[-half:]


# ============================================================================ failures of the operating system
def os_errno(err: BaseException) -> int | None:
    """The errno of an OSError, or of the `(os error N)` that safetensors' writer puts in its messages."""
    if isinstance(err, OSError):
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    return int(found.group(1)) if found else None


def os_failure(err: BaseException, action: str, path) -> ConversionError:
    """A ConversionError saying what failed doing `action` ("reading", "writing") on `path`."""
    code = os_errno(err)
    reason = OS_FAILURES.get(code) or (os.strerror(code).lower() if code else type(err).__name__)
    return ConversionError(f"{reason} {action} {path}")


@contextmanager
def reporting_os_errors(action: str, path):
    """Turn an OSError inside the block into a ConversionError naming `action` and `path`."""
    try:
        yield
    except OSError as err:
        raise os_failure(err, action, path) from err


# ============================================================================ the folder
class TensorEntry(NamedTuple):
    """One tensor of a safetensors header: its file, dtype (safetensors' name), shape and byte range (from the
    start of the file)."""
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SourceFolder:
    """A checkpoint folder whose files are read only where they resolve inside it."""

    def __init__(self, path):
        with reporting_os_errors("reading", path):
            try:
                self.root = Path(path).resolve(strict=True)
            except RuntimeError as err:  # a loop of symbolic links (Python 3.11)
                raise ConversionError(f"{path} cannot be resolved ({err})") from err
            if not self.root.is_dir():
                raise ConversionError(f"{path} is not a folder; give a checkpoint folder")

    def inside(self, name, field: str | None = None) -> Path:
        """The resolved path of `name` (relative to the folder), refused unless it stays inside the folder; `field`
        says where the name came from (None: a file the folder must have by that name)."""
        subject = f"{field}: {shown(name)}" if field else str(self.root / str(name))
        if not isinstance(name, str) or not name or "\0" in name:
            raise ConversionError(f"{subject} is not a file name")
        parts = PurePosixPath(name)
        if parts.is_absolute() or ".." in parts.parts:
            raise ConversionError(f"{subject} points outside the checkpoint folder {self.root}; files must lie "
                                  "inside it")
        try:
            path = (self.root / name).resolve()
        except (OSError, RuntimeError) as err:  # RuntimeError: a loop of symbolic links (Python 3.11)
            raise ConversionError(f"{subject} cannot be resolved ({err})") from err
        if not path.is_relative_to(self.root):
            raise ConversionError(f"{subject} is a symbolic link to {path}, outside the checkpoint folder "
                                  f"{self.root}; files must lie inside it")
        return path

    def file(self, name, field: str | None = None, required: bool = True) -> Path | None:
        """The resolved path of regular file `name` inside the folder (`field`: as for `inside`); None when it is
        absent and not `required`. Anything else by that name (a folder, a pipe, a device) is refused: reading it
        could block or mean anything."""
        path = self.inside(name, field)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            mode = None
        except OSError as err:
            raise os_failure(err, "reading", path) from err
        if mode is not None and stat.S_ISREG(mode):
            return path
        if required or mode is not None:
            what = "no such file" if mode is None else "not a regular file"
            raise ConversionError(f"{field + ': ' if field else ''}{self.root / name}: {what}")
        return None

    def read_json(self, path: Path, limit: int = MAX_JSON_BYTES) -> dict:
        """The JSON object in `path` (a file from `file`), refused in one line when it is too large, not UTF-8, not
        JSON, nested too deeply or not an object."""
        with reporting_os_errors("reading", path):
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        if len(data) > limit:
            raise ConversionError(f"{path}: larger than {limit} bytes; not read")
        try:
            value = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ConversionError(f"{path}: not UTF-8 text (byte {err.start})") from err
        except RecursionError as err:
            raise ConversionError(f"{path}: JSON nested too deeply") from err
        except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python converts
            raise ConversionError(f"{path}: not valid JSON ({err})") from err
        if not isinstance(value, dict):
            raise ConversionError(f"{path}: expected a JSON object, found {type(value).__name__}")
        return value

    def safetensors_header(self, path: Path) -> dict[str, TensorEntry]:
        """The tensors of safetensors file `path`, from its header alone, checked against the file's length."""
        with reporting_os_errors("reading", path):
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise ConversionError(f"{path}: {size} bytes, too short for a safetensors file")
                length = int.from_bytes(f.read(8), "little")
                if length > MAX_HEADER_BYTES or 8 + length > size:
                    raise ConversionError(f"{path}: not a safetensors file (the header length {length} does not "
                                          f"fit its {size} bytes)")
                raw = f.read(length)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConversionError(f"{path}: the safetensors header is not valid JSON ({type(err).__name__}: "
                                  f"{shown(str(err))})") from err
        if not isinstance(header, dict):
            raise ConversionError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        entries = {name: _tensor_entry(path, name, info, data_start=8 + length) for name, info in header.items()}
        _check_contiguous(path, entries, data_start=8 + length, size=size)
        return entries

    def read_tensor(self, entry: TensorEntry, name: str) -> torch.Tensor:
        """The tensor `name` described by `entry`, read from its byte range."""
        with reporting_os_errors("reading", entry.file):
            with open(entry.file, "rb") as f:
                f.seek(entry.start)
                data = bytearray(f.read(entry.end - entry.start))
        if len(data) != entry.end - entry.start:
            raise ConversionError(f"{entry.file}: tensor {name!r} is cut short (the file shrank while read)")
        dtype = FLOAT_DTYPES[entry.dtype]
        if not data:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)


def _tensor_entry(path: Path, name: str, info, data_start: int) -> TensorEntry:
    """One header entry as a TensorEntry: a float dtype, a shape of non-negative ints, a byte range whose length is
    the shape's size."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise ConversionError(f"{path}: header entry {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in FLOAT_DTYPES:
        raise ConversionError(f"{path}: tensor {name!r} has dtype {shown(dtype)}; a checkpoint's weights are "
                              f"floating point ({', '.join(FLOAT_DTYPES)})")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_count(d, 0) for d in shape)):
        raise ConversionError(f"{path}: tensor {name!r} has shape {shown(shape)}; expected a list of at most "
                              f"{MAX_DIMS} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o, 0) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise ConversionError(f"{path}: tensor {name!r} has data_offsets {shown(offsets)}; expected [begin, end]")
    numel = 1
    for d in shape:
        numel *= d
    if numel * FLOAT_DTYPES[dtype].itemsize != offsets[1] - offsets[0]:
        raise ConversionError(f"{path}: tensor {name!r} of dtype {dtype} and shape {shape} takes "
                              f"{numel * FLOAT_DTYPES[dtype].itemsize} bytes, its data_offsets {offsets} hold "
                              f"{offsets[1] - offsets[0]}")
    return TensorEntry(path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_contiguous(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """The tensors' byte ranges tile the data after the header exactly, as safetensors requires: no overlap (one
    byte range read as two tensors), no gap, nothing past the end of the file."""
    at = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != at:
            raise ConversionError(f"{path}: tensor {name!r} starts at byte {entry.start - data_start} of the data, "
                                  f"expected {at - data_start} (tensors overlap or leave a gap)")
        at = entry.end
    if at != size:
        raise ConversionError(f"{path}: the header describes {at} bytes, the file has {size} (truncated or padded)")


def _is_count(value, minimum: int) -> bool:
    """An int (not a bool) at or above `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
