"""transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`), taken from the installed
release at test time and never copied here.

Where they come from, first found first:
  1. `LAZOO_TRANSFORMERS_TESTS`: a folder holding transformers' `tests/` of the installed release (a checkout of its
     tag: the whole tree, `tests/generation` and `tests/exporters` included).
  2. A cache (`LAZOO_TRANSFORMERS_TESTS_CACHE`, default `~/.cache/lazoo/transformers-tests/<version>`) filled once from
     the installed release's source distribution (`pip download --no-deps --no-binary :all: transformers==<version>`).
     That distribution ships the files at the top of `tests/` only: `test_modeling_common.py` is there, but the
     modules it imports from `tests/generation` (`GenerationTesterMixin`) and `tests/exporters` (`ExportTesterMixin`)
     are not. They are then stood in for by empty classes: the `ModelTesterMixin` tests run, the generation tests
     are skipped with a reason that says how to get them (1.).

`load()` returns a `Suite` (the mixins, and whether the generation mixin is the real one) or the reason they cannot be
had, for a module-level skip.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers

PACKAGE = "transformers_release_tests"  # the name transformers' `tests/` is imported under (lazoo has `tests/` too)
STUB = "_lazoo_stand_in"


@dataclass
class Suite:
    ModelTesterMixin: type
    GenerationTesterMixin: type
    has_generation_tests: bool
    source: Path
    common: types.ModuleType


def _cache_folder() -> Path:
    root = os.environ.get("LAZOO_TRANSFORMERS_TESTS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "lazoo", "transformers-tests")
    return Path(root) / transformers.__version__


def _from_source_distribution(folder: Path) -> Path:
    """`folder/tests`, extracted from the installed release's source distribution (downloaded once)."""
    tests = folder / "tests"
    if (tests / "test_modeling_common.py").is_file():
        return tests
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"transformers=={transformers.__version__}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        archives = sorted(Path(tmp).glob("transformers-*.tar.gz"))
        if done.returncode or not archives:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed: {(done.stderr or done.stdout).strip()[-500:]}")
        staging = Path(tmp) / "tests"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.split("/")[1:2] == ["tests"]]
            for member in members:
                member.name = "/".join(member.name.split("/")[2:])
            tar.extractall(staging, members=members, filter="data")
        if not (staging / "test_modeling_common.py").is_file():
            raise RuntimeError(f"the source distribution of transformers {transformers.__version__} has no "
                               "tests/test_modeling_common.py")
        staging.rename(tests)  # whole or not at all: a second run never sees half a folder
    return tests


def _stand_in(name: str, attribute: str) -> None:
    """An importable module `name` holding an empty class `attribute` (marked as a stand-in)."""
    parts = name.split(".")
    for i in range(2, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            module = types.ModuleType(sub)
            module.__path__ = []
            sys.modules[sub] = module
    setattr(sys.modules[name], attribute, type(attribute, (), {STUB: True}))


def tests_folder() -> Path:
    given = os.environ.get("LAZOO_TRANSFORMERS_TESTS")
    if given:
        path = Path(given)
        if not (path / "test_modeling_common.py").is_file():
            raise RuntimeError(f"LAZOO_TRANSFORMERS_TESTS={given} holds no test_modeling_common.py")
        return path
    return _from_source_distribution(_cache_folder())


def load() -> Suite | str:
    """The mixins of the installed transformers release, or why they cannot be had."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE].suite
    try:
        folder = tests_folder()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return (f"transformers {transformers.__version__}'s own tests could not be had ({error}); set "
                "LAZOO_TRANSFORMERS_TESTS to the tests/ folder of a checkout of its release tag")
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    real_generation = (folder / "generation" / "test_utils.py").is_file()
    if not real_generation:
        _stand_in(f"{PACKAGE}.generation.test_utils", "GenerationTesterMixin")
    if not (folder / "exporters" / "test_export.py").is_file():
        _stand_in(f"{PACKAGE}.exporters.test_export", "ExportTesterMixin")
    try:
        with warnings.catch_warnings():  # its marks (flash_attn_test, generate, ...) are registered in its own setup
            warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
            common = importlib.import_module(f"{PACKAGE}.test_modeling_common")
            generation = importlib.import_module(f"{PACKAGE}.generation.test_utils")
    except ImportError as error:
        del sys.modules[PACKAGE]
        return f"transformers {transformers.__version__}'s test_modeling_common.py does not import here: {error}"
    package.suite = Suite(common.ModelTesterMixin, generation.GenerationTesterMixin, real_generation, folder, common)
    return package.suite
