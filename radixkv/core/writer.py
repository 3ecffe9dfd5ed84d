"""The way down to the tiers: a bounded queue of writes and the thread that carries them out.

A ``TierStack`` never writes to a tier on the engine's thread.  It hands ``WriteQueue.put`` the
writes of a store, a promotion, a touch or a release; the writer thread takes them in order, a
batch at a time, and gives each batch to the stack's ``write`` function (which encodes chunks and
calls each tier's ``put_many``).  The queue is bounded in bytes (the KV it holds until written;
optionally in entries too): what does not fit is dropped and counted (a cache loses nothing by
dropping a write), unless the caller asked to wait for room.  A batch is up to ``batch`` writes and
``batch_bytes`` bytes, so that each tier gets few large ``put_many`` calls (one LMDB transaction,
one Redis pipeline, concurrent S3 puts) however fast the writes come.

A chain (consecutive chunks of one sequence, head first: what an eviction lets go) is queued in
reverse, deepest first, so that every tier ends up holding the head as the most recent; with a
wait, a chain longer than the queue waits for an empty queue and goes in whole.

    >>> written = []
    >>> q = WriteQueue(written.extend, size=4, batch=2, on_drop=lambda n: None, max_bytes=1 << 20, cost=lambda _: 1)
    >>> q.put([("store", 1), ("store", 2)], chain=True), q.flush(5.0), written
    (2, True, [('store', 2), ('store', 1)])
    >>> q.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from radixkv.core._checks import check_int

__all__ = ["WriteQueue"]

log = logging.getLogger("radixkv.core.stack")


class WriteQueue:
    """Writes waiting for the tiers (at most ``size`` of them when given, and ``max_bytes`` by
    ``cost(item)``; an empty queue takes one chain whole) and the thread that hands them to
    ``write(items)``, at most ``batch`` writes and ``batch_bytes`` bytes at a time.
    ``on_drop(n)`` hears of every write dropped: for want of room, after ``close``, or lost in a
    batch that raised.  Thread-safe."""

    def __init__(self, write: Callable[[list[Any]], None], *, size: int | None, batch: int,
                 on_drop: Callable[[int], None], max_bytes: int, cost: Callable[[Any], int],
                 batch_bytes: int = 64 << 20, name: str = "radixkv-tier-writer") -> None:
        if size is not None:
            check_int(size, "size", 1)
        check_int(batch, "batch", 1)
        check_int(max_bytes, "max_bytes", 1)
        check_int(batch_bytes, "batch_bytes", 1)
        self.size = size
        self.max_bytes = max_bytes
        self.batch = batch
        self.batch_bytes = batch_bytes
        self._write = write
        self._cost = cost
        self._on_drop = on_drop
        self._queue: deque[tuple[Any, int]] = deque()     # (item, its cost in bytes)
        self._bytes = 0
        self._longest_chain = 1      # an empty queue takes one waiting chain whole
        self._chain_bytes = 0
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (later writes are dropped and counted).  O(1)."""
        return self._closed

    @property
    def queued_bytes(self) -> int:
        """The bytes waiting (by ``cost``).  O(1)."""
        return self._bytes

    def put(self, items: Sequence[Any], *, until: float | None = None, chain: bool = False) -> int:
        """Queue the longest head of ``items`` that fits (all of them as a chain when ``chain``:
        taken deepest first); the rest is dropped and counted.  With ``until``
        (``time.monotonic()`` seconds), first wait until then for room for all of them, where an
        empty queue is room for any number.  The number queued.  O(len(items)) plus the wait."""
        items = list(items)
        if not items:
            return 0
        costs = [max(0, int(self._cost(item))) for item in items]
        with self._cv:
            def room() -> int:
                """How many of the items fit now (a head of them)."""
                if until is not None and not self._queue:
                    return len(items)
                free_entries = len(items) if self.size is None else self.size - len(self._queue)
                free_bytes, n = self.max_bytes - self._bytes, 0
                while n < min(len(items), free_entries) and costs[n] <= free_bytes:
                    free_bytes -= costs[n]
                    n += 1
                return n
            while until is not None and not self._closed and room() < len(items):
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)             # the writer notifies after every batch
            take = 0 if self._closed else max(0, room())
            if take:
                pairs = list(zip(items[:take], costs[:take]))
                self._queue.extend(reversed(pairs) if chain else pairs)
                added = sum(costs[:take])
                self._bytes += added
                if take > self._longest_chain or added > self._chain_bytes:
                    self._longest_chain = max(self._longest_chain, take)
                    self._chain_bytes = max(self._chain_bytes, added)
                self._cv.notify_all()
        if take < len(items):
            self._on_drop(len(items) - take)
        return take

    def hold(self) -> Any:
        """A context manager that keeps the writer off the queue while it is held (for tests that
        need a full queue).  O(1)."""
        return self._cv

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch: list[Any] = []
                nbytes = 0
                while self._queue and len(batch) < self.batch and (not batch or nbytes < self.batch_bytes):
                    item, cost = self._queue.popleft()
                    batch.append(item)
                    nbytes += cost
                self._bytes -= nbytes
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the writer must survive anything (e.g. encoding a bad tensor)
                log.exception("radixkv tier writer: a batch of %d writes was lost", len(batch))
                self._on_drop(len(batch))
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; ``False`` if ``timeout`` seconds passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued writes (up to ``timeout`` seconds) and stop the thread.  Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def check(self) -> None:
        """Assert the queue's bounds, its byte count and that its thread runs until closed."""
        with self._cv:
            if self.size is not None:
                assert len(self._queue) <= max(self.size, self._longest_chain), "write queue over its bound"
            assert self._bytes == sum(cost for _, cost in self._queue), "write queue byte count drifted"
            assert self._bytes <= max(self.max_bytes, self._chain_bytes), "write queue over its byte bound"
            assert self._thread.is_alive() or self._closed, "the writer thread died"
