"""The packages that list their modules by hand (`lazoo.ops`, `lazoo.layers.mixers`) list them all: a new op or
mixer module that is not imported there would be missing from `lazoo.ops` or would never register its mechanism."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

from lazoo import ops
from lazoo.layers import mixers

#: the modules of lazoo.ops that hold no op (what the op modules share); they have no ``__all__``
OPS_HELPER_MODULES = {"backend", "boundary", "checks", "chunks", "dtypes", "norms", "packing", "scan", "states"}


def public_modules(package) -> set[str]:
    """The names of the package's modules that do not start with "_"."""
    return {info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")}


def imported_modules(package) -> set[str]:
    """The package's own modules its ``__init__`` imports (``from .x import y``, ``from . import x``)."""
    found = set()
    for node in ast.parse(Path(package.__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
    return found


def op_module_names() -> list[str]:
    return sorted(public_modules(ops) - OPS_HELPER_MODULES)


@pytest.mark.parametrize("package", [ops, mixers], ids=lambda p: p.__name__)
def test_every_public_module_is_imported_by_its_package(package):
    helpers = OPS_HELPER_MODULES if package is ops else set()
    missing = public_modules(package) - helpers - imported_modules(package)
    assert not missing, f"{package.__name__}/__init__.py does not import {sorted(missing)}"


def test_the_ops_helper_modules_hold_no_op():
    import importlib

    for name in OPS_HELPER_MODULES:
        assert not hasattr(importlib.import_module(f"lazoo.ops.{name}"), "__all__"), name
