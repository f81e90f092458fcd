"""Checks of a config's (or an image processor's) numeric fields, each raising a ValueError that names the field.

A module of its own, importing nothing of lazoo, so that the configurations and processors of every kind (language,
vision) share it, and a saved folder's exported code (`lazoo.models.export`) carries it without the rest of the
language-model stack."""

from __future__ import annotations

import math
from numbers import Integral, Real


def is_int(value) -> bool:
    """An int (or numpy integer), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite real number, not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(field: str, value, minimum: int = 1, allow_none: bool = False, note: str = "") -> None:
    """`value` is an int >= `minimum` (or None when `allow_none`), else a ValueError naming `field`."""
    if (allow_none and value is None) or (is_int(value) and value >= minimum):
        return
    allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"{field} must be {allowed}{' or None' if allow_none else ''}{note}, got {value!r}")


def check_number(field: str, value, *, positive: bool) -> None:
    """`value` is a finite real number, > 0 when `positive` (else >= 0), else a ValueError naming `field`."""
    if is_number(value) and (value > 0 if positive else value >= 0):
        return
    raise ValueError(f"{field} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
