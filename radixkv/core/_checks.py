"""Argument checks shared by every module: one wording for one rule."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as an ``int`` if it is an integer (a bool is not) of at least ``minimum``;
    otherwise ``ValueError`` naming ``name``.  O(1).

    >>> check_int(3, "n"), check_int(np.int64(2), "n", 1)
    (3, 2)
    """
    if type(value) is int and value >= minimum:      # the common case, before the general checks
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
