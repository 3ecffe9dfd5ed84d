"""Argument checks shared by every module: one wording for one rule."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(value: Any, name: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (a bool is not) of at least ``minimum`` (and at
    most ``maximum``, when given); otherwise ``ValueError`` naming ``name``.  O(1).

    >>> check_int(3, "n"), check_int(np.int64(2), "n", 1), check_int(8080, "port", 0, 65535)
    (3, 2, 8080)
    """
    if type(value) is int and value >= minimum and (maximum is None or value <= maximum):   # the common case
        return value
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return int(value)
