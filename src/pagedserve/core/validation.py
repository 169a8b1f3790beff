"""The one rule for integer parameters, shared by every layer's validation.

bool is an int subclass, so `isinstance(True, int)` holds; a flag passed as a size
or a count is always a caller bug, and every check here rejects it.
"""
from __future__ import annotations


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value: object, lo: int) -> None:
    """ValueError naming `name` unless `value` is an integer >= lo."""
    if not is_int(value) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
