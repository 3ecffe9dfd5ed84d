"""One progress bar for the operator commands and the notebooks: tqdm where it is installed
(``tqdm.auto``: a widget in Jupyter, text on a terminal), else nothing, with the same calls."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress"]


class _Silent:
    """What ``progress`` gives when disabled or without tqdm: every call does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "chunk", enabled: bool = True) -> Any:
    """A progress bar of ``total`` steps (``None``: unknown) on stderr, or a silent stand-in
    (``enabled`` false, or tqdm missing).  Use as a context manager; ``update(n)`` per step.  O(1)
    a step (tqdm redraws at most a few times a second)."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
