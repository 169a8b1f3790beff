"""The rules for parameters that every layer's validation shares.

bool is an int subclass, so `isinstance(True, int)` holds; a flag passed as a size
or a count is always a caller bug, and every check here rejects it.
"""
from __future__ import annotations

import json
from collections.abc import Collection


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value: object, lo: int) -> None:
    """ValueError naming `name` unless `value` is an integer >= lo."""
    if not is_int(value) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def config_object(name: str, value: dict | str, known: Collection[str]) -> dict:
    """An option given as a JSON string (the CLI) or a dict (the Python API), holding only
    `known` keys; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return value
