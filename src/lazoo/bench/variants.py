"""``lazoo.bench.kernels --variant LABEL:module.ATTR=value[,...]``: lazoo's ops timed again, in the same run, with
module settings changed (alternative kernel forms side by side on one card), e.g.

    --variant bv:lazoo.kernels.normalized.FWD_BV=128
"""

from __future__ import annotations

import ast
import contextlib
import importlib


def parse_variant(text: str) -> tuple[str, list]:
    """``"LABEL:module.ATTR=value,..."`` -> ``(LABEL, [(module, ATTR, value), ...])``; values are Python literals,
    and each ATTR must exist already (a misspelt setting would otherwise time the default twice)."""
    label, sep, settings = text.partition(":")
    if not sep or not label or not settings:
        raise ValueError(f"--variant {text!r}: expected LABEL:module.ATTR=value[,module.ATTR=value...]")
    parsed = []
    for item in settings.split(","):
        path, eq, value = item.partition("=")
        module_name, dot, attr = path.strip().rpartition(".")
        if not eq or not dot:
            raise ValueError(f"--variant {text!r}: {item!r} is not module.ATTR=value")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"--variant {text!r}: {module_name} has no setting {attr!r}")
        try:
            parsed.append((module, attr, ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--variant {text!r}: {value!r} is not a Python literal") from e
    return label, parsed


@contextlib.contextmanager
def variant_settings(settings: list):
    """Apply a variant's module settings inside the block, then restore the previous values."""
    before = [(module, attr, getattr(module, attr)) for module, attr, _ in settings]
    try:
        for module, attr, value in settings:
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in before:
            setattr(module, attr, value)
