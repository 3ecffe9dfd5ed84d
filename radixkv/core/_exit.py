"""Queued tier writes are flushed when the interpreter exits, within one bound.

A ``TierStack`` writes from a daemon thread, so without this an engine that exits without
``close()`` loses every write still queued (and may kill the writer inside a transaction).
``PrefixCache`` registers its stack here; at exit each registered stack gets what is left of one
total bound, ``RADIXKV_EXIT_FLUSH_S`` seconds (default 10), to finish its queue, and is closed; what
could not be written is logged as dropped.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.core.stack import TierStack

__all__ = ["flush_at_exit"]

log = logging.getLogger("radixkv.core.cache")

_exit_stacks: weakref.WeakSet[TierStack] = weakref.WeakSet()
_exit_lock = threading.Lock()
_registered = False


def flush_at_exit(stack: TierStack) -> None:
    """Register ``stack`` so that its queued writes are flushed when the interpreter exits."""
    global _registered
    with _exit_lock:
        if not _registered:
            atexit.register(_exit_flush)
            _registered = True
        _exit_stacks.add(stack)


def _exit_flush() -> None:
    """At interpreter exit: finish every open stack's queued writes within one total bound
    (``RADIXKV_EXIT_FLUSH_S`` seconds, default 10) and close it; log what could not be written."""
    try:
        bound = float(os.environ.get("RADIXKV_EXIT_FLUSH_S", "10"))
    except ValueError:
        bound = 10.0
    deadline = time.monotonic() + bound
    with _exit_lock:
        stacks = list(_exit_stacks)
        _exit_stacks.clear()
    for stack in stacks:
        if not stack.flush(max(0.0, deadline - time.monotonic())):
            lost = stack.stats()["queued"]
            log.warning("radixkv: %d queued tier writes not done within %.1f s at exit; dropped", lost, bound)
        stack.close(timeout=max(0.0, deadline - time.monotonic()))
