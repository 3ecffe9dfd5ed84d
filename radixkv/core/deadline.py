"""Bounds on remote waits: one deadline and one blob size per request, carried to every tier call.

A caller bounds every tier call it makes inside ``with bounded(deadline, max_blob_bytes):`` (a
context variable, so it passes through wrappers and worker threads unchanged): a remote tier gives
up when ``time.monotonic()`` passes ``deadline`` and raises ``DeadlineExceeded`` (with what it had
by then in ``partial``), and refuses to download a blob over ``max_blob_bytes`` (``OversizeBlob``).
Local tiers do not wait on other machines and ignore both.  A remote tier that refuses a stored
blob for its size (a miss: a bad entry, which it deletes) tells the caller through
``report_oversize``, so that a ``TierStack`` counts it like a corrupt blob.

    >>> import time
    >>> with bounded(time.monotonic() + 1.5, 1 << 20):
    ...     current_max_blob_bytes()
    1048576
    >>> current_deadline() is None
    True
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["DeadlineExceeded", "OversizeBlob", "bounded", "current_deadline", "current_max_blob_bytes",
           "report_oversize"]


class DeadlineExceeded(TimeoutError):
    """A remote tier did not answer before the caller's deadline.  ``partial`` is what it had by
    then (``get_many``: a list with ``None`` for what did not arrive; ``contains_prefix``: the
    leading keys confirmed), so the caller can use the part that arrived intact."""

    def __init__(self, message: str, partial: Any = None) -> None:
        super().__init__(message)
        self.partial = partial


class OversizeBlob(ValueError):
    """A stored blob is larger than the caller can use; it was not downloaded (a miss, and a bad
    entry: the stack deletes it like a corrupt one)."""


_BOUNDS: contextvars.ContextVar[tuple[float | None, int | None, Callable[[bytes], None] | None]] = \
    contextvars.ContextVar("radixkv_tier_bounds", default=(None, None, None))


@contextmanager
def bounded(deadline: float | None = None, max_blob_bytes: int | None = None,
            on_oversize: Callable[[bytes], None] | None = None) -> Iterator[None]:
    """Bound every tier call in the block: remote tiers stop waiting at ``deadline`` (absolute
    ``time.monotonic()`` seconds) and download no blob over ``max_blob_bytes``; a blob refused for
    its size is reported to ``on_oversize(tier key)`` (``report_oversize``), from whichever thread
    the tier refused it on.  ``None`` keeps the enclosing bound (or the tier's own default).  O(1);
    per thread and per task (a tier's worker runs in a copy of its caller's context)."""
    old_deadline, old_max, old_report = _BOUNDS.get()
    token = _BOUNDS.set((old_deadline if deadline is None else deadline,
                         old_max if max_blob_bytes is None else max_blob_bytes,
                         old_report if on_oversize is None else on_oversize))
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def current_deadline() -> float | None:
    """The deadline ``bounded`` set for this thread or task, or ``None``.  O(1)."""
    return _BOUNDS.get()[0]


def current_max_blob_bytes() -> int | None:
    """The blob size bound ``bounded`` set for this thread or task, or ``None``.  O(1)."""
    return _BOUNDS.get()[1]


def report_oversize(key: bytes) -> None:
    """What a remote tier calls when it refused the blob under ``key`` for its size (a miss, and a
    bad entry it deletes): tells ``bounded``'s ``on_oversize``, if the caller gave one.  O(1) plus
    the callback."""
    report = _BOUNDS.get()[2]
    if report is not None:
        report(key)
