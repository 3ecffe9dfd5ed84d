"""A tier as a user writes one from the ``Tier`` protocol's docstrings: a SQLite table (stdlib
``sqlite3``), with the choices the protocol leaves open as knobs, so that the tier contract can be
shown to pass each correct variant (tests/testing/test_contract_variants.py) and to catch bugs in it
(the ``sqlite-*`` rows of tests/testing/test_mutations.py).

One table, ``entries(key, blob, size, access, expires, pinned)``.  ``max_bytes`` bounds the sum of
the blob sizes (``used_bytes``, kept as a running total that ``check`` compares with the table).
A put removes the key's old row, then evicts the least recently accessed unpinned rows until the
blob fits.  Knobs:

* ``path``: a file (persistent: reopening it finds every entry, pins included) or ``":memory:"``.
* ``ttl``: seconds an entry lives after it is written, by ``clock`` (reads do not extend it); an
  expired row is a miss at once.
* ``purge``, where expired rows are deleted: ``"room"`` (all of them, first, when a put needs room),
  ``"put"`` (all of them on every put), ``"read"`` (the row a read finds expired), ``"never"`` (left
  until evicted, delete or drop_namespace).
* ``count_expired``: the counter a purged expired row goes to, ``"evictions"`` or ``"expired"``.
* ``lru``: access order by ``"time"`` (the clock) or by ``"counter"`` (a monotonic sequence number).
* ``pins``: kept in the table (``"table"``, so they survive a reopen) or in this object
  (``"memory"``, lost on close); pinned bytes stay within half of ``max_bytes``.

Thread-safe: one lock around one connection.  Every operation is O(log entries) plus its
evictions (the victim and the expired rows are found by index).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from radixkv.backends import Blob, Tier, blob_view, check_key, check_namespace_id

__all__ = ["SqliteTier"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, blob BLOB NOT NULL, size INTEGER NOT NULL,
                                    access REAL NOT NULL, expires REAL, pinned INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS entries_access ON entries (pinned, access);
CREATE INDEX IF NOT EXISTS entries_expires ON entries (expires);
"""


class SqliteTier(Tier):
    """A SQLite tier of ``max_bytes``; see the module docstring for the knobs.

    >>> tier = SqliteTier(":memory:", max_bytes=100)
    >>> tier.put(bytes(24), b"x" * 60), tier.put(b"k" * 24, b"y" * 60), tier.contains_prefix([bytes(24)])
    (True, True, 0)
    """

    name = "sqlite"

    def __init__(self, path: str | Path, max_bytes: int, *, ttl: float | None = None,
                 clock: Callable[[], float] = time.time, purge: str = "room", count_expired: str = "evictions",
                 lru: str = "time", pins: str = "table") -> None:
        if purge not in ("room", "put", "read", "never") or count_expired not in ("evictions", "expired") \
                or lru not in ("time", "counter") or pins not in ("table", "memory"):
            raise ValueError(f"unknown knob value in purge={purge!r}, count_expired={count_expired!r}, "
                             f"lru={lru!r}, pins={pins!r}")
        self.persistent = str(path) != ":memory:"
        target = Path(path) / "tier.sqlite3" if self.persistent and Path(path).is_dir() else path
        self._db = sqlite3.connect(str(target), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA synchronous = OFF")    # a cache: a write lost in a crash is a miss
        self._db.executescript(_SCHEMA)
        self._max_bytes = max_bytes
        self._max_pinned = max_bytes // 2
        self._ttl = ttl
        self._clock = clock
        self._purge, self._count_expired, self._lru, self._pin_store = purge, count_expired, lru, pins
        self._memory_pins: dict[bytes, int] = {}        # pins="memory": key -> size
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(
            ("hits", "misses", "puts", "rejected", "evictions", "expired"), 0))
        self._used = self._scalar("SELECT COALESCE(SUM(size), 0) FROM entries")
        self._seq = self._scalar("SELECT COALESCE(MAX(access), 0) FROM entries") if lru == "counter" else 0
        self._closed = False

    # -- helpers (called with the lock held) ----------------------------------------------------

    def _scalar(self, sql: str, *args: object) -> int:
        return int(self._db.execute(sql, args).fetchone()[0])

    def _stamp(self) -> float:
        """The access stamp of an access now."""
        if self._lru == "counter":
            self._seq += 1
            return self._seq
        return self._clock()

    def _live(self, expires: float | None) -> bool:
        return expires is None or self._clock() < expires

    def _is_pinned(self, key: bytes, flag: int) -> bool:
        return bool(flag) if self._pin_store == "table" else key in self._memory_pins

    def _pinned_bytes(self) -> int:
        if self._pin_store == "memory":
            return sum(self._memory_pins.values())
        return self._scalar("SELECT COALESCE(SUM(size), 0) FROM entries WHERE pinned = 1")

    def _remove(self, key: bytes) -> tuple[int, float | None, bool] | None:
        """Delete ``key``'s row; its (size, expires, pinned), or ``None`` if there was none."""
        row = self._db.execute("SELECT size, expires, pinned FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
        self._used -= row[0]
        pinned = self._is_pinned(key, row[2])
        self._memory_pins.pop(key, None)
        return row[0], row[1], pinned

    def _purge_expired(self) -> int:
        """Delete every expired row, counted in ``count_expired``; how many."""
        if self._ttl is None:
            return 0
        doomed = [bytes(k) for (k,) in self._db.execute(
            "SELECT key FROM entries WHERE expires IS NOT NULL AND expires <= ?", (self._clock(),))]
        for key in doomed:
            self._remove(key)
        self._counts[self._count_expired] += len(doomed)
        return len(doomed)

    def _victim(self) -> bytes | None:
        """The least recently accessed unpinned key."""
        if self._pin_store == "table":
            row = self._db.execute("SELECT key FROM entries WHERE pinned = 0 ORDER BY access LIMIT 1").fetchone()
            return None if row is None else bytes(row[0])
        for (key,) in self._db.execute("SELECT key FROM entries ORDER BY access"):
            if bytes(key) not in self._memory_pins:
                return bytes(key)
        return None

    def _make_room(self, need: int) -> bool:
        """Evict until ``need`` more bytes fit; whether they do."""
        if need + self._pinned_bytes() > self._max_bytes:
            return False
        if self._purge == "room" and self._used + need > self._max_bytes:
            self._purge_expired()
        while self._used + need > self._max_bytes:
            victim = self._victim()
            if victim is None:
                return False
            self._remove(victim)
            self._counts["evictions"] += 1
        return True

    # -- the protocol ---------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The blob, refreshing the row's access stamp.  One indexed lookup and one update."""
        check_key(key)
        with self._lock:
            row = self._db.execute("SELECT blob, expires FROM entries WHERE key = ?", (key,)).fetchone()
            if row is not None and not self._live(row[1]):
                if self._purge == "read":
                    self._remove(key)
                    self._counts[self._count_expired] += 1
                row = None
            if row is None:
                self._counts["misses"] += 1
                return None
            self._db.execute("UPDATE entries SET access = ? WHERE key = ?", (self._stamp(), key))
            self._counts["hits"] += 1
            return bytes(row[0])

    def put(self, key: bytes, blob: Blob) -> bool:
        """Replace ``key``'s row; evicts least recently accessed unpinned rows to fit.  A pinned key
        stays pinned if the pinned bytes stay within half of ``max_bytes``."""
        check_key(key)
        data = bytes(blob_view(blob))
        with self._lock:
            self._counts["puts"] += 1
            if self._purge == "put":
                self._purge_expired()
            old = self._remove(key)
            pinned = old is not None and old[2] and self._live(old[1])
            if len(data) > self._max_bytes or not self._make_room(len(data)):
                self._counts["rejected"] += 1
                return False
            pinned = pinned and self._pinned_bytes() + len(data) <= self._max_pinned
            expires = None if self._ttl is None else self._clock() + self._ttl
            self._db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                             (key, data, len(data), self._stamp(), expires,
                              int(pinned and self._pin_store == "table")))
            if pinned and self._pin_store == "memory":
                self._memory_pins[key] = len(data)
            self._used += len(data)
            return True

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys held unexpired; not an access.  One lookup per key."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            for n, key in enumerate(keys):
                row = self._db.execute("SELECT expires FROM entries WHERE key = ?", (key,)).fetchone()
                if row is None or not self._live(row[0]):
                    return n
            return len(keys)

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it was held (unexpired)."""
        check_key(key)
        with self._lock:
            old = self._remove(key)
            return old is not None and self._live(old[1])

    def drop_namespace(self, ns_id: bytes) -> int:
        """Remove the namespace's rows (expired ones included); how many.  A range scan."""
        check_namespace_id(ns_id)
        with self._lock:
            doomed = [bytes(k) for (k,) in self._db.execute(
                "SELECT key FROM entries WHERE substr(key, 1, 8) = ?", (ns_id,))]
            for key in doomed:
                self._remove(key)
            return len(doomed)

    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin the leading keys held unexpired, while the pinned bytes stay within half of
        ``max_bytes``; how many.  Not an access."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            for n, key in enumerate(keys):
                row = self._db.execute("SELECT size, expires, pinned FROM entries WHERE key = ?", (key,)).fetchone()
                if row is None or not self._live(row[1]):
                    return n
                if self._is_pinned(key, row[2]):
                    continue
                if self._pinned_bytes() + row[0] > self._max_pinned:
                    return n
                if self._pin_store == "table":
                    self._db.execute("UPDATE entries SET pinned = 1 WHERE key = ?", (key,))
                else:
                    self._memory_pins[key] = row[0]
            return len(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Let ``keys`` be evicted again; how many were pinned."""
        keys = list(dict.fromkeys(check_key(k) for k in keys))
        with self._lock:
            if self._pin_store == "memory":
                return sum(self._memory_pins.pop(k, None) is not None for k in keys)
            n = 0
            for key in keys:
                n += self._db.execute("UPDATE entries SET pinned = 0 WHERE key = ? AND pinned = 1", (key,)).rowcount
            return n

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._max_bytes

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {**self._counts, "entries": self._scalar("SELECT COUNT(*) FROM entries"),
                    "used_bytes": self._used, "capacity_bytes": self._max_bytes}

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def check(self) -> None:
        super().check()
        with self._lock:
            total = self._scalar("SELECT COALESCE(SUM(size), 0) FROM entries")
            assert self._used == total, f"sqlite tier: used_bytes {self._used}, rows take {total}"
            assert self._pinned_bytes() <= self._max_pinned, "sqlite tier: pinned bytes over the bound"
