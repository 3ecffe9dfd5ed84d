"""Mutation self-test of ``radixkv.testing``: realistic bugs injected into the reference backends and
into the tree, the pool, the cache, the per-request API and the tier stack; the harness must catch
every one.

Each mutant is one row of ``MUTANTS``: a name, what it patches, the bug in words, the harness that
must catch it, and a small patch (a monkeypatch of one method, or a tier built with one part
swapped).  The patches wrap or replace single methods by name, so when a method is renamed the row
is re-pointed, not rewritten.  The harness runs with ``radixkv.testing.settings.MUTATION``: a fixed
seed, no shrinking, 40 examples of up to 40 steps.  ``test_every_mutant_is_caught`` runs them all
and prints the table; it fails naming every survivor.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from radixkv import ops
from radixkv.backends import MemoryTier, blob_view, check_key, count_leading
from radixkv.backends.cpu import CpuTier
from radixkv.backends.lmdb import LmdbTier, _Writer
from radixkv.core.cache import PrefixCache
from radixkv.core.groups import KVGroups
from radixkv.core.pool import KVPool, as_page_ids
from radixkv.testing import (FaultyPrefixCacheMachine, PrefixCacheMachine, RadixTreeMachine,
                             TieredPrefixCacheMachine)
from radixkv.testing.backends import CpuTierContract, LmdbTierContract, LmdbTtlTierContract, MemoryTierContract
from radixkv.testing.requests import RequestMachine, SlidingRequestMachine
from radixkv.testing.settings import MUTATION
from radixkv.core.loads import Loads
from radixkv.core.stores import Stores
from radixkv.core.stack import TierStack
from radixkv.core.tree import RadixTree
from mutants_engine import ROWS as ENGINE_ROWS, lru_pop_newest
from sqlite_tier import SqliteTier

pytestmark = pytest.mark.slow      # every mutant against its harness: `pytest -m "not slow"` leaves it out


Patch = Callable[[pytest.MonkeyPatch], Any]


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str            # the method or part it changes
    bug: str               # what a backend or engine author got wrong
    harness: str           # the contract or machine that must catch it
    patch: Patch           # applies it; for tier mutants, returns the factory of the broken tier


class WriteBackMachine(TieredPrefixCacheMachine):
    write_policy = "write_back"


HARNESSES: dict[str, Any] = {
    "MemoryContract": MemoryTierContract, "CpuContract": CpuTierContract, "LmdbContract": LmdbTierContract,
    "LmdbTtlContract": LmdbTtlTierContract, "RadixTreeMachine": RadixTreeMachine,
    "PrefixCacheMachine": PrefixCacheMachine, "TieredPrefixCacheMachine": TieredPrefixCacheMachine,
    "WriteBackMachine": WriteBackMachine, "FaultyPrefixCacheMachine": FaultyPrefixCacheMachine,
    "RequestMachine": RequestMachine, "SlidingRequestMachine": SlidingRequestMachine,
}


# -- small parts to swap in ---------------------------------------------------------------------

def wrap(mp: pytest.MonkeyPatch, cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)``."""
    mp.setattr(cls, name, make(getattr(cls, name)))


class NoLock:
    """A lock that locks nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class MruDict(OrderedDict):  # type: ignore[type-arg]
    """An LRU list whose "oldest" end is the newest."""

    def popitem(self, last: bool = True) -> Any:
        return super().popitem(last=not last)


class NoTouchDict(OrderedDict):  # type: ignore[type-arg]
    """An LRU list that never moves a key to the front."""

    def move_to_end(self, key: Any, last: bool = True) -> None:
        return None


class KeyedBy(dict):  # type: ignore[type-arg]
    """A dict that files every key under ``part(key)``."""

    def __init__(self, part: slice) -> None:
        super().__init__()
        self.part = part

    def __getitem__(self, k: Any) -> Any:
        return super().__getitem__(k[self.part])

    def __setitem__(self, k: Any, v: Any) -> None:
        super().__setitem__(k[self.part], v)

    def __contains__(self, k: object) -> bool:
        return super().__contains__(k[self.part])  # type: ignore[index]

    def get(self, k: Any, default: Any = None) -> Any:
        return super().get(k[self.part], default)

    def pop(self, k: Any, *default: Any) -> Any:
        return super().pop(k[self.part], *default)


def cpu(**swap: Any) -> Callable[[], CpuTier]:
    """A factory of ``CpuTier(1024, slot_bytes=256)`` with attributes swapped."""
    def make() -> CpuTier:
        tier = CpuTier(max_bytes=1024, slot_bytes=256)
        for name, value in swap.items():
            setattr(tier, name, value() if callable(value) else value)
        return tier
    return make


def memory(**swap: Any) -> Callable[[], MemoryTier]:
    def make() -> MemoryTier:
        tier = MemoryTier()
        for name, value in swap.items():
            setattr(tier, name, value() if callable(value) else value)
        return tier
    return make


def lmdb(ttl: float | None = None, sub: Callable[[Path], Path] = lambda p: p,
         after: Callable[[LmdbTier], None] = lambda t: None) -> Callable[..., LmdbTier]:
    """A factory of the contract's ``LmdbTier`` (in ``sub(path)``), then ``after(tier)``."""
    def make(path: Path, clock: Any) -> LmdbTier:
        tier = LmdbTier(sub(path), max_bytes=1000, map_size=1 << 20, sync=False, touch_every=4, clock=clock, ttl=ttl)
        after(tier)
        return tier
    return make


def factory(make: Callable[..., Any]) -> Patch:
    return lambda mp: make


# -- tier mutants -------------------------------------------------------------------------------

def _stores_nothing(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(CpuTier, "put", lambda self, key, blob: bool(check_key(key)))
    return cpu()


def _evicts_mru(mp: pytest.MonkeyPatch) -> Any:
    if not hasattr(CpuTier, "_victim"):               # an LRU list popped from its oldest end
        return cpu(_lru=MruDict)
    mp.setattr(CpuTier, "_victim", lambda self: next(reversed(self._lru), None))
    return cpu()


def _refused_put_keeps_old(mp: pytest.MonkeyPatch) -> Any:
    def make(put: Callable[..., bool]) -> Callable[..., bool]:
        def bad(self: CpuTier, key: bytes, blob: Any) -> bool:
            if self._slot_bytes and len(blob_view(blob)) > self._slot_bytes:
                self._counts.update(puts=1, rejected=1)
                return False                       # returns before dropping the old blob
            return put(self, key, blob)
        return bad
    wrap(mp, CpuTier, "put", make)
    return cpu()


def _refused_put_returns_true(mp: pytest.MonkeyPatch) -> Any:
    wrap(mp, CpuTier, "put", lambda put: lambda self, key, blob: put(self, key, blob) or True)
    return cpu()


def _evicts_everything(mp: pytest.MonkeyPatch) -> Any:
    def make(put: Callable[..., bool]) -> Callable[..., bool]:
        def bad(self: CpuTier, key: bytes, blob: Any) -> bool:
            with self._lock:
                if not self._free and key not in self._lru and len(blob_view(blob)) <= self._slot_bytes:
                    while self._lru:                # "make room": all of it
                        _, (slot, _) = self._lru.popitem(last=False)
                        self._counts["evictions"] += 1
                        self._release_slot(slot)
            return put(self, key, blob)
        return bad
    wrap(mp, CpuTier, "put", make)
    return cpu()


def _overwrite_leaks_slot(mp: pytest.MonkeyPatch) -> Any:
    def make(put: Callable[..., bool]) -> Callable[..., bool]:
        def bad(self: CpuTier, key: bytes, blob: Any) -> bool:
            with self._lock:
                self._lru.pop(key, None)            # forgets to release the old slot
            return put(self, key, blob)
        return bad
    wrap(mp, CpuTier, "put", make)
    return cpu()


def _stale_read_cache(mp: pytest.MonkeyPatch) -> Any:
    def make(get: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: CpuTier, key: bytes) -> Any:
            cache = self.__dict__.setdefault("_read_cache", {})
            if key not in cache:
                cache[key] = get(self, key)
            return cache[key]                      # never invalidated by put or delete
        return bad
    wrap(mp, CpuTier, "get", make)
    return cpu()


def _hits_count_misses(mp: pytest.MonkeyPatch) -> Any:
    def make(acquire: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: CpuTier, key: bytes) -> Any:
            entry = acquire(self, key)
            if entry is None:
                self._counts.update(hits=1, misses=-1)
            return entry
        return bad
    wrap(mp, CpuTier, "_acquire", make)
    return cpu()


def _contains_touches(mp: pytest.MonkeyPatch) -> Any:
    def contains(self: CpuTier, keys: Any) -> int:
        with self._lock:
            n = count_leading(keys, self._lru)
            for key in list(keys)[:n]:
                self._lru.move_to_end(key)          # a lookup counted as an access
            return n
    mp.setattr(CpuTier, "contains_prefix", contains)
    return cpu()


def _put_many_first_only(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(CpuTier, "put_many", lambda self, items: sum(self.put(k, b) for k, b in list(items)[:1]))
    return cpu()


def _memory_keeps_buffer(mp: pytest.MonkeyPatch) -> Any:
    def put(self: MemoryTier, key: bytes, blob: Any) -> bool:
        check_key(key)
        value = blob_view(blob)                    # no copy: the caller's buffer
        with self._lock:
            old = self._data.get(key)
            self._bytes += len(value) - (0 if old is None else len(old))
            self._data[key] = value                # type: ignore[assignment]
        return True
    mp.setattr(MemoryTier, "put", put)
    return memory()


def _memory_drop_first_byte(mp: pytest.MonkeyPatch) -> Any:
    def drop(self: MemoryTier, ns_id: bytes) -> int:
        with self._lock:
            doomed = [k for k in self._data if k[:1] == ns_id[:1]]
            for k in doomed:
                self._bytes -= len(self._data.pop(k))
        return len(doomed)
    mp.setattr(MemoryTier, "drop_namespace", drop)
    return memory()


def _memory_close_twice(mp: pytest.MonkeyPatch) -> Any:
    def close(self: MemoryTier) -> None:
        self._data.clear()
        self._data = None                          # type: ignore[assignment]
    mp.setattr(MemoryTier, "close", close)
    return memory()


def _memory_contains_anywhere(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(MemoryTier, "contains_prefix", lambda self, keys: sum(k in self._data for k in keys))
    return memory()


def _memory_get_many_found_only(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(MemoryTier, "get_many", lambda self, keys: [b for b in map(self.get, keys) if b is not None])
    return memory()


def _memory_delete_true(mp: pytest.MonkeyPatch) -> Any:
    wrap(mp, MemoryTier, "delete", lambda delete: lambda self, key: delete(self, key) or True)
    return memory()


def _lmdb_delete_noop(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(LmdbTier, "delete", lambda self, key: bool(check_key(key)))
    return lmdb()


def _lmdb_touches_dropped(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(_Writer, "apply_touches", lambda self, touches: None)
    return lmdb()


def _lmdb_no_eviction(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(_Writer, "make_room", lambda self, *args, **kw: True)
    return lmdb()


def _lmdb_evicts_one_extra(mp: pytest.MonkeyPatch) -> Any:
    def make(make_room: Callable[..., bool]) -> Callable[..., bool]:
        def bad(self: _Writer, *args: Any, **kw: Any) -> bool:
            before = self.counts["evictions"]
            ok = make_room(self, *args, **kw)
            cursor = self.txn.cursor(db=self.tier._lru)
            if self.counts["evictions"] > before and cursor.first():     # "one more, to be safe"
                self.remove(bytes(cursor.key()[8:]))
                self.counts["evictions"] += 1
            return ok
        return bad
    wrap(mp, _Writer, "make_room", make)
    return lmdb()


def _lmdb_total_ignores_removal(mp: pytest.MonkeyPatch) -> Any:
    def make(remove: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: _Writer, key: bytes) -> Any:
            size = remove(self, key)
            if size:
                self.total += size                 # the byte total never goes down
            return size
        return bad
    wrap(mp, _Writer, "remove", make)
    return lmdb()


def _lmdb_put_many_counts_attempts(mp: pytest.MonkeyPatch) -> Any:
    def make(put_many: Callable[..., int]) -> Callable[..., int]:
        def bad(self: LmdbTier, items: Any) -> int:
            items = list(items)
            put_many(self, items)
            return len(items)
        return bad
    wrap(mp, LmdbTier, "put_many", make)
    return lmdb()


def _lmdb_stats_hits(mp: pytest.MonkeyPatch) -> Any:
    wrap(mp, LmdbTier, "_count", lambda count: lambda self, hits, misses: count(self, hits + misses, 0))
    return lmdb()


def _lmdb_ignores_ttl(mp: pytest.MonkeyPatch) -> Any:
    mp.setattr(LmdbTier, "_live", lambda self, meta, now: meta is not None)
    return lmdb(ttl=5.0)


def _set(name: str, value: Callable[[LmdbTier], Any]) -> Callable[[LmdbTier], None]:
    return lambda tier: setattr(tier, name, value(tier))


# A user's tier (tests/helpers/sqlite_tier.py), checked with the LMDB contracts' knobs: LRU by bytes, exact
# used_bytes, persistent, and a TTL of 5 seconds for LmdbTtlContract.

def sqlite(**knobs: Any) -> Callable[..., SqliteTier]:
    """A factory of ``SqliteTier(path, 1000, **knobs)`` on the contract's clock."""
    return lambda path, clock: SqliteTier(path, 1000, clock=clock, **knobs)


def _sqlite_victim(order: str) -> Callable[[SqliteTier], bytes | None]:
    def victim(self: SqliteTier) -> bytes | None:
        row = self._db.execute(f"SELECT key FROM entries {order} LIMIT 1").fetchone()
        return None if row is None else bytes(row[0])
    return victim


def _sqlite_get(where: str, live: bool) -> Callable[[SqliteTier, bytes], bytes | None]:
    """A ``get`` that finds its row by ``where`` and checks its expiry or not."""
    def get(self: SqliteTier, key: bytes) -> bytes | None:
        check_key(key)
        with self._lock:
            row = self._db.execute(f"SELECT key, blob, expires FROM entries WHERE {where}", (key,)).fetchone()
            if row is None or (live and not self._live(row[2])):
                self._counts["misses"] += 1
                return None
            self._db.execute("UPDATE entries SET access = ? WHERE key = ?", (self._stamp(), row[0]))
            self._counts["hits"] += 1
            return bytes(row[1])
    return get


def _sqlite_delete_keeps_bytes(self: SqliteTier, key: bytes) -> bool:
    check_key(key)
    with self._lock:                               # a delete of its own: forgets the byte total
        return self._db.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount > 0


def _sqlite_reads_extend_ttl(mp: pytest.MonkeyPatch) -> Any:
    def make(get: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: SqliteTier, key: bytes) -> Any:
            got = get(self, key)
            if got is not None:                    # an access renews the expiry
                with self._lock:
                    self._db.execute("UPDATE entries SET expires = ? WHERE key = ?", (self._clock() + self._ttl, key))
            return got
        return bad
    wrap(mp, SqliteTier, "get", make)
    return sqlite(ttl=5.0)


def _sqlite_refused_put_keeps_old(mp: pytest.MonkeyPatch) -> Any:
    def make(put: Callable[..., bool]) -> Callable[..., bool]:
        def bad(self: SqliteTier, key: bytes, blob: Any) -> bool:
            if len(blob_view(blob)) > self._max_bytes:
                with self._lock:
                    self._counts.update(puts=1, rejected=1)
                return False                       # returns before removing the old row
            return put(self, key, blob)
        return bad
    wrap(mp, SqliteTier, "put", make)
    return sqlite(ttl=5.0)


def _sqlite_purge_inverted(self: SqliteTier) -> int:
    if self._ttl is None:
        return 0
    doomed = [bytes(k) for (k,) in self._db.execute(       # ">" for "<=": purges the live rows
        "SELECT key FROM entries WHERE expires IS NOT NULL AND expires > ?", (self._clock(),))]
    for key in doomed:
        self._remove(key)
    self._counts[self._count_expired] += len(doomed)
    return len(doomed)


def _sqlite_counts_expired_twice(mp: pytest.MonkeyPatch) -> Any:
    def make(purge: Callable[..., int]) -> Callable[..., int]:
        def bad(self: SqliteTier) -> int:
            n = purge(self)
            self._counts["evictions"] += n         # counted again, on top of count_expired
            return n
        return bad
    wrap(mp, SqliteTier, "_purge_expired", make)
    return sqlite(ttl=5.0)


TIER_MUTANTS = [
    Mutant("cpu-stores-nothing", "CpuTier.put", "put returns True and stores nothing", "CpuContract",
           _stores_nothing),
    Mutant("cpu-evicts-mru", "CpuTier._victim (or _lru)", "evicts the most recently used entry", "CpuContract",
           _evicts_mru),
    Mutant("cpu-get-not-an-access", "CpuTier._lru", "reads do not refresh recency", "CpuContract",
           factory(cpu(_lru=NoTouchDict))),
    Mutant("cpu-contains-is-an-access", "CpuTier.contains_prefix", "a lookup refreshes recency", "CpuContract",
           _contains_touches),
    Mutant("cpu-no-lock", "CpuTier._lock", "no locking", "CpuContract", factory(cpu(_lock=NoLock))),
    Mutant("cpu-refused-put-keeps-old", "CpuTier.put", "a refused put keeps the old blob", "CpuContract",
           _refused_put_keeps_old),
    Mutant("cpu-refused-put-returns-true", "CpuTier.put", "a refused put says it stored", "CpuContract",
           _refused_put_returns_true),
    Mutant("cpu-evicts-everything", "CpuTier.put", "a full tier evicts every entry", "CpuContract",
           _evicts_everything),
    Mutant("cpu-overwrite-leaks-slot", "CpuTier.put", "an overwrite leaks the old slot", "CpuContract",
           _overwrite_leaks_slot),
    Mutant("cpu-stale-read-cache", "CpuTier.get", "a read cache that writes do not invalidate", "CpuContract",
           _stale_read_cache),
    Mutant("cpu-hits-count-misses", "CpuTier._acquire", "stats count misses as hits", "CpuContract",
           _hits_count_misses),
    Mutant("cpu-no-read-lease", "CpuTier._release_slot", "a slot being read is reused", "CpuContract",
           lambda mp: (mp.setattr(CpuTier, "_release_slot", lambda self, slot: self._free.append(slot)), cpu())[1]),
    Mutant("cpu-get-returns-arena-view", "CpuTier.get", "get hands out the tier's own memory", "CpuContract",
           lambda mp: (mp.setattr(CpuTier, "get", lambda self, key: self.read(key, lambda v: v)), cpu())[1]),
    Mutant("cpu-read-ignores-consume-result", "CpuTier.read", "read returns the blob, not consume's result",
           "CpuContract",
           lambda mp: (wrap(mp, CpuTier, "read", lambda read: lambda self, key, consume: read(self, key, bytes)),
                       cpu())[1]),
    Mutant("cpu-put-many-first-only", "CpuTier.put_many", "put_many stores only the first item", "CpuContract",
           _put_many_first_only),
    Mutant("cpu-drop-counts-zero", "CpuTier.drop_namespace", "drop_namespace reports 0", "CpuContract",
           lambda mp: (wrap(mp, CpuTier, "drop_namespace", lambda drop: lambda self, ns: drop(self, ns) * 0),
                       cpu())[1]),
    Mutant("memory-keeps-caller-buffer", "MemoryTier.put", "keeps a reference to the caller's buffer",
           "MemoryContract", _memory_keeps_buffer),
    Mutant("memory-drop-first-byte", "MemoryTier.drop_namespace", "compares only the first byte of the id",
           "MemoryContract", _memory_drop_first_byte),
    Mutant("memory-close-not-idempotent", "MemoryTier.close", "a second close raises", "MemoryContract",
           _memory_close_twice),
    Mutant("memory-no-lock", "MemoryTier._lock", "no locking", "MemoryContract", factory(memory(_lock=NoLock))),
    Mutant("memory-key-truncated", "MemoryTier._data", "indexes only the first 16 bytes of a key",
           "MemoryContract", factory(memory(_data=lambda: KeyedBy(slice(0, 16))))),
    Mutant("memory-ignores-namespace", "MemoryTier._data", "indexes keys without their namespace",
           "MemoryContract", factory(memory(_data=lambda: KeyedBy(slice(8, 24))))),
    Mutant("memory-contains-anywhere", "MemoryTier.contains_prefix", "counts held keys, not the leading run",
           "MemoryContract", _memory_contains_anywhere),
    Mutant("memory-get-many-found-only", "MemoryTier.get_many", "get_many leaves out the misses",
           "MemoryContract", _memory_get_many_found_only),
    Mutant("memory-delete-always-true", "MemoryTier.delete", "delete says True for an absent key",
           "MemoryContract", _memory_delete_true),
    Mutant("lmdb-delete-noop", "LmdbTier.delete", "delete does nothing", "LmdbContract", _lmdb_delete_noop),
    Mutant("lmdb-touches-dropped", "_Writer.apply_touches", "batched accesses are never applied (FIFO, not LRU)",
           "LmdbContract", _lmdb_touches_dropped),
    Mutant("lmdb-no-eviction", "_Writer.make_room", "never evicts: over its budget", "LmdbContract",
           _lmdb_no_eviction),
    Mutant("lmdb-evicts-one-extra", "_Writer.make_room", "evicts one entry more than needed", "LmdbContract",
           _lmdb_evicts_one_extra),
    Mutant("lmdb-total-ignores-removal", "_Writer.remove", "the byte total never goes down", "LmdbContract",
           _lmdb_total_ignores_removal),
    Mutant("lmdb-put-many-counts-attempts", "LmdbTier.put_many", "put_many returns the items tried",
           "LmdbContract", _lmdb_put_many_counts_attempts),
    Mutant("lmdb-stats-all-hits", "LmdbTier._count", "stats count every read as a hit", "LmdbContract",
           _lmdb_stats_hits),
    Mutant("lmdb-fresh-db-on-open", "LmdbTier(path)", "opens a new database each time: persists nothing",
           "LmdbContract", factory(lmdb(sub=lambda p: p / uuid.uuid4().hex))),
    Mutant("lmdb-ignores-ttl", "LmdbTier._live", "entries never expire", "LmdbTtlContract", _lmdb_ignores_ttl),
    Mutant("lmdb-born-expired", "LmdbTier._ttl_us", "the expiry is written in the past (sign error)",
           "LmdbTtlContract", factory(lmdb(ttl=5.0, after=_set("_ttl_us", lambda t: -t._ttl_us)))),
    Mutant("lmdb-ttl-in-ms", "LmdbTier._ttl_us", "ttl seconds read as milliseconds", "LmdbTtlContract",
           factory(lmdb(ttl=5.0, after=_set("_ttl_us", lambda t: t._ttl_us // 1000)))),
    Mutant("sqlite-serves-expired", "SqliteTier.get", "get serves a row past its expiry", "LmdbTtlContract",
           lambda mp: (mp.setattr(SqliteTier, "get", _sqlite_get("key = ?", live=False)), sqlite(ttl=5.0))[1]),
    Mutant("sqlite-evicts-mru", "SqliteTier._victim", "evicts the most recently accessed row (ORDER BY ... DESC)",
           "LmdbTtlContract",
           lambda mp: (mp.setattr(SqliteTier, "_victim", _sqlite_victim("WHERE pinned = 0 ORDER BY access DESC")),
                       sqlite(ttl=5.0))[1]),
    Mutant("sqlite-evicts-pinned", "SqliteTier._victim", "the victim query forgets the pinned rows",
           "LmdbContract",
           lambda mp: (mp.setattr(SqliteTier, "_victim", _sqlite_victim("ORDER BY access")), sqlite())[1]),
    Mutant("sqlite-delete-keeps-bytes", "SqliteTier.delete", "delete leaves used_bytes as it was",
           "LmdbTtlContract",
           lambda mp: (mp.setattr(SqliteTier, "delete", _sqlite_delete_keeps_bytes), sqlite(ttl=5.0))[1]),
    Mutant("sqlite-get-ignores-namespace", "SqliteTier.get", "get matches the chunk key only: another key's blob",
           "LmdbContract",
           lambda mp: (mp.setattr(SqliteTier, "get", _sqlite_get("substr(key, 9) = substr(?, 9)", live=True)),
                       sqlite())[1]),
    Mutant("sqlite-reads-extend-ttl", "SqliteTier.get", "a read renews the expiry", "LmdbTtlContract",
           _sqlite_reads_extend_ttl),
    Mutant("sqlite-refused-put-keeps-old", "SqliteTier.put", "a put over max_bytes keeps the old row",
           "LmdbTtlContract", _sqlite_refused_put_keeps_old),
    Mutant("sqlite-purges-live-rows", "SqliteTier._purge_expired", "the expiry comparison is inverted",
           "LmdbTtlContract",
           lambda mp: (mp.setattr(SqliteTier, "_purge_expired", _sqlite_purge_inverted), sqlite(ttl=5.0))[1]),
    Mutant("sqlite-counts-expired-twice", "SqliteTier._purge_expired",
           "each expired row purged counts as two evictions", "LmdbTtlContract",
           _sqlite_counts_expired_twice),
]


# -- tree, pool, cache and stack mutants ---------------------------------------------------------

def _split_forgets_lock(mp: pytest.MonkeyPatch) -> None:
    def make(split: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: RadixTree, child: Any, num_pages: int) -> Any:
            upper = split(self, child, num_pages)
            upper.lock_ref = 0
            return upper
        return bad
    wrap(mp, RadixTree, "_split", make)


def _split_swaps_boundary_page(mp: pytest.MonkeyPatch) -> None:
    def make(split: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: RadixTree, child: Any, num_pages: int) -> Any:
            upper = split(self, child, num_pages)
            upper.pages, child.pages = upper.pages.copy(), child.pages.copy()
            upper.pages[-1], child.pages[0] = child.pages[0], upper.pages[-1]
            return upper
        return bad
    wrap(mp, RadixTree, "_split", make)


def _tree_lru_newest_first(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(RadixTree, "_lru_pop", lru_pop_newest)


def _lock_leaves_leaf_evictable(mp: pytest.MonkeyPatch) -> None:
    def make(lock: Callable[..., None]) -> Callable[..., None]:
        def bad(self: RadixTree, node: Any, upto: Any = None) -> Any:
            stop = lock(self, node, upto)
            if node is not self.root and not node.children and node.lru_entry < 0:
                self._lru_add(node)
            return stop
        return bad
    wrap(mp, RadixTree, "_lock", make)


def _unlock_forgets_lru(mp: pytest.MonkeyPatch) -> None:
    def make(unlock: Callable[..., None]) -> Callable[..., None]:
        def bad(self: RadixTree, node: Any) -> None:
            unlock(self, node)
            if node.lru_entry >= 0:
                self._lru_drop(node)
        return bad
    wrap(mp, RadixTree, "_unlock", make)


def _lock_only_the_node(mp: pytest.MonkeyPatch) -> None:
    def lock(self: RadixTree, node: Any, upto: Any = None) -> Any:
        if node is self.root or node is upto:
            return node
        if node.lock_ref == 0:
            self._evictable -= node.num_tokens
            self._protected += node.num_tokens
            if not node.children:
                self._lru_drop(node)
        node.lock_ref += 1                     # the ancestors stay unlocked
        return node.parent

    def unlock(self: RadixTree, node: Any) -> None:
        if node is self.root:
            return
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self._protected -= node.num_tokens
            self._evictable += node.num_tokens
            if not node.children:
                self._lru_add(node)
    mp.setattr(RadixTree, "_lock", lock)       # the public lock/unlock check, then call these
    mp.setattr(RadixTree, "_unlock", unlock)


def _unlock_only_the_node(mp: pytest.MonkeyPatch) -> None:
    def unlock(self: RadixTree, node: Any) -> None:
        node.lock_ref -= 1                     # the node is released, its ancestors stay locked
        if node.lock_ref == 0:
            self._protected -= node.num_tokens
            self._evictable += node.num_tokens
            if not node.children:
                self._lru_add(node)
    mp.setattr(RadixTree, "_unlock", unlock)


def _insert_keeps_parent_in_lru(mp: pytest.MonkeyPatch) -> None:
    def make(insert: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: RadixTree, *args: Any, **kw: Any) -> Any:
            result = insert(self, *args, **kw)
            parent = result.node.parent
            if parent is not None and parent is not self.root and parent.lock_ref == 0 and parent.lru_entry < 0:
                self._lru_add(parent)
            return result
        return bad
    wrap(mp, RadixTree, "insert_bytes", make)


def _evict_one_leaf_more(mp: pytest.MonkeyPatch) -> None:
    def make(evict: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: RadixTree, num_pages: int, *args: Any, **kw: Any) -> Any:
            freed = evict(self, num_pages, *args, **kw)
            if freed.size and num_pages:
                freed = np.concatenate([freed, evict(self, 1, *args, **kw)])
            return freed
        return bad
    wrap(mp, RadixTree, "evict", make)


def _check_returns_early(cls: type, keep: Callable[[Any], None]) -> Patch:
    return lambda mp: mp.setattr(cls, "check", keep)


def _cache_check_skips_locks(self: PrefixCache) -> None:
    self.pool.check()
    self.tree.check()
    if self.stack is not None:
        self.stack.check()                     # returns before comparing page states and lock counts


def _pool_free_no_checks(self: KVPool, pages: Any) -> None:
    ids = as_page_ids(pages, self.num_pages)
    self._stack[self._top:self._top + ids.size] = ids
    self._top += ids.size
    self._is_free[ids] = True


def _pool_take_from_bottom(self: KVPool, n: int) -> Any:
    ids = self._stack[:n].copy()
    self._top -= n
    self._is_free[ids] = False
    return ids


def _alloc_evicts_everything(mp: pytest.MonkeyPatch) -> None:
    def make(alloc: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: PrefixCache, num_pages: int) -> Any:
            if num_pages > self.pool.num_free:
                self.evict(self.pool.num_pages)
            return alloc(self, num_pages)
        return bad
    wrap(mp, PrefixCache, "alloc", make)


def _hit_tokens_pool_only(mp: pytest.MonkeyPatch) -> None:
    def make(match: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: PrefixCache, tokens: Any, **kw: Any) -> Any:
            m = match(self, tokens, **kw)
            self._counters["hit_tokens"] -= m.tier_tokens
            return m
        return bad
    wrap(mp, PrefixCache, "match", make)


def _match_covers_last_token(mp: pytest.MonkeyPatch) -> None:
    wrap(mp, PrefixCache, "match", lambda match: lambda self, tokens, **kw: match(self, tokens, leave_last=False))


def _release_keeps_lock(mp: pytest.MonkeyPatch) -> None:
    def release(self: PrefixCache, request: Any) -> None:
        req = self._live.pop(request.id, None)
        if req is None:
            raise ValueError("match: already released")
        req.released = True                        # forgets tree.unlock(req.node)
    mp.setattr(PrefixCache, "_release", release)     # what cache.release and req.release() run


def _load_ignores_skip(mp: pytest.MonkeyPatch) -> None:
    scatter = ops.scatter_pages
    mp.setattr(ops, "scatter_pages", lambda src, pool, ids, skip_pages=0: scatter(src, pool, ids))


def _first_chunk_not_stored(mp: pytest.MonkeyPatch) -> None:
    def make(store: Callable[..., None]) -> Callable[..., None]:
        def bad(self: Stores, data: bytes, pages: Any, first: int, last: int, *rest: Any, **kw: Any) -> None:
            if first == 0:
                first = 1
            if first < last:
                store(self, data, pages, first, last, *rest, **kw)
        return bad
    wrap(mp, Stores, "store_chunks", make)


def _tail_one_page_early(mp: pytest.MonkeyPatch) -> None:
    """A tail is copied from the pages one page before its tokens (an off-by-one in the offset)."""
    real = RadixTree.prefix_pages

    def make(spill_tail: Callable[..., None]) -> Callable[..., None]:
        def bad(self: Stores, *args: Any) -> None:
            mp.setattr(RadixTree, "prefix_pages", lambda tree, node: np.roll(real(tree, node), 1))
            try:
                spill_tail(self, *args)
            finally:
                mp.setattr(RadixTree, "prefix_pages", real)
        return bad
    wrap(mp, Stores, "_tail", make)


def _land_counts_whole_first_chunk(mp: pytest.MonkeyPatch) -> None:
    def make(land: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: Loads, req: Any, *args: Any, **kw: Any) -> Any:
            held, before = req.num_cached, sum(self.tier_hits)
            out = land(self, req, *args, **kw)
            if sum(self.tier_hits) > before and held % self.chunk_size:
                self.tier_hits[0] += held % self.chunk_size     # counts pages the tree had
            return out
        return bad
    wrap(mp, Loads, "land", make)


def _land_leaves_old_node_locked(mp: pytest.MonkeyPatch) -> None:
    def make(land: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: Loads, req: Any, *args: Any, **kw: Any) -> Any:
            old = req.node
            out = land(self, req, *args, **kw)
            if req.node is not old:
                self.tree.lock(old)                # the shorter match stays locked as well
            return out
        return bad
    wrap(mp, Loads, "land", make)


def _no_refresh(mp: pytest.MonkeyPatch) -> None:
    def make(spill: Callable[..., None]) -> Callable[..., None]:
        def bad(self: Stores, node: Any) -> None:
            if self.write_policy != "write_through":
                spill(self, node)
        return bad
    wrap(mp, Stores, "evicting", make)


def _store_drops_last(mp: pytest.MonkeyPatch) -> None:
    def make(store: Callable[..., int]) -> Callable[..., int]:
        def bad(self: TierStack, items: Any, **kw: Any) -> int:
            items = list(items)
            return store(self, items[:-1], **kw) + bool(items)     # the last chunk is lost, and not counted
        return bad
    wrap(mp, TierStack, "store", make)


ENGINE_MUTANTS = [
    Mutant("tree-split-forgets-lock", "RadixTree._split", "a split drops the lock count", "RadixTreeMachine",
           _split_forgets_lock),
    Mutant("cache-split-forgets-lock", "RadixTree._split", "a split drops the lock count", "PrefixCacheMachine",
           _split_forgets_lock),
    Mutant("tree-split-swaps-page", "RadixTree._split", "the boundary page goes to the wrong half",
           "RadixTreeMachine", _split_swaps_boundary_page),
    Mutant("tree-evicts-mru", "RadixTree._lru", "evicts the most recently used leaf", "RadixTreeMachine",
           _tree_lru_newest_first),
    Mutant("tree-lock-leaves-leaf-evictable", "RadixTree.lock", "a locked leaf stays in the LRU order",
           "RadixTreeMachine", _lock_leaves_leaf_evictable),
    Mutant("tree-unlock-forgets-lru", "RadixTree.unlock", "an unlocked leaf never becomes evictable",
           "RadixTreeMachine", _unlock_forgets_lru),
    Mutant("tree-lock-only-the-node", "RadixTree.lock/unlock", "ancestors are not locked", "RadixTreeMachine",
           _lock_only_the_node),
    Mutant("tree-unlock-leaves-ancestors-locked", "RadixTree.unlock", "unlock releases the node, not its ancestors",
           "RadixTreeMachine", _unlock_only_the_node),
    Mutant("tree-insert-keeps-parent-in-lru", "RadixTree.insert_bytes", "a parent that gains a child stays evictable",
           "RadixTreeMachine", _insert_keeps_parent_in_lru),
    Mutant("tree-touch-ignores-recency", "RadixTree._touch", "matches do not refresh recency",
           "RadixTreeMachine", lambda mp: mp.setattr(RadixTree, "_touch", lambda self, path: None)),
    Mutant("tree-evicts-one-leaf-more", "RadixTree.evict", "evicts one leaf more than needed",
           "RadixTreeMachine", _evict_one_leaf_more),
    Mutant("tree-check-returns-early", "RadixTree.check", "check() returns early", "RadixTreeMachine",
           _check_returns_early(RadixTree, lambda self: None)),
    Mutant("pool-alloc-keeps-free-mark", "KVPool._take", "allocated pages stay marked free",
           "PrefixCacheMachine",
           lambda mp: wrap(mp, KVPool, "_take", lambda take: lambda self, n: _mark_free(self, take(self, n)))),
    Mutant("pool-free-no-checks", "KVPool.free", "a double free is not detected", "PrefixCacheMachine",
           lambda mp: mp.setattr(KVPool, "free", _pool_free_no_checks)),
    Mutant("pool-alloc-from-bottom", "KVPool._take", "hands out pages from the wrong end of the free list",
           "PrefixCacheMachine", lambda mp: mp.setattr(KVPool, "_take", _pool_take_from_bottom)),
    Mutant("cache-alloc-evicts-everything", "PrefixCache.alloc", "alloc evicts every unlocked prefix",
           "PrefixCacheMachine", _alloc_evicts_everything),
    Mutant("cache-check-returns-early", "PrefixCache.check", "check() skips page states and lock counts",
           "PrefixCacheMachine", _check_returns_early(PrefixCache, _cache_check_skips_locks)),
    Mutant("cache-release-keeps-lock", "PrefixCache.release", "release forgets to unlock", "PrefixCacheMachine",
           _release_keeps_lock),
    Mutant("cache-match-covers-last-token", "PrefixCache.match", "leave_last is ignored", "PrefixCacheMachine",
           _match_covers_last_token),
    Mutant("cache-hit-tokens-pool-only", "PrefixCache.match", "hit_tokens leaves out tier hits",
           "TieredPrefixCacheMachine", _hit_tokens_pool_only),
    Mutant("cache-load-ignores-skip", "ops.scatter_pages (Loads.land)",
           "a load into a chunk ignores skip_pages", "TieredPrefixCacheMachine", _load_ignores_skip),
    Mutant("cache-load-counts-whole-chunk", "Loads.land",
           "tier hit tokens count the pages the tree already had", "TieredPrefixCacheMachine",
           _land_counts_whole_first_chunk),
    Mutant("cache-load-leaves-old-lock", "Loads.land", "a load leaves the tree match locked",
           "TieredPrefixCacheMachine", _land_leaves_old_node_locked),
    Mutant("cache-first-chunk-not-stored", "Stores.store_chunks", "the first chunk never reaches the tiers",
           "TieredPrefixCacheMachine", _first_chunk_not_stored),
    Mutant("cache-evict-no-refresh", "Stores.evicting", "write_through eviction does not refresh tier recency",
           "TieredPrefixCacheMachine", _no_refresh),
    Mutant("cache-evict-no-spill", "Stores.evicting", "write_back does not store what it evicts",
           "WriteBackMachine", lambda mp: mp.setattr(Stores, "evicting", lambda self, node: None)),
    Mutant("cache-tail-one-page-early", "Stores._tail", "a tail holds the KV of the page before it",
           "WriteBackMachine", _tail_one_page_early),
    Mutant("stack-store-drops-last", "TierStack.store", "the last chunk of a store is lost uncounted",
           "TieredPrefixCacheMachine", _store_drops_last),
    Mutant("stack-touch-noop", "TierStack.touch", "touch refreshes nothing", "TieredPrefixCacheMachine",
           lambda mp: mp.setattr(TierStack, "touch", lambda self, keys, **kw: len(list(keys)))),
    Mutant("stack-load-errors-uncounted", "TierStack.load", "a fault while loading is not counted",
           "FaultyPrefixCacheMachine", lambda mp: _uncounted_load_errors(mp)),
]


def _mark_free(pool: KVPool, ids: Any) -> Any:
    pool._is_free[ids] = True
    return ids


def _uncounted_load_errors(mp: pytest.MonkeyPatch) -> None:
    def make(load: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: TierStack, refs: Any, **kw: Any) -> Any:
            before = list(self._per_tier["errors"])
            chunks = load(self, refs, **kw)
            self._per_tier["errors"] = before      # the faults are swallowed without a count
            return chunks
        return bad
    wrap(mp, TierStack, "load", make)


def _extend_keeps_old_hold(mp: pytest.MonkeyPatch) -> None:
    def make(extend: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: PrefixCache, req: Any, *args: Any, **kw: Any) -> Any:
            old = req.node
            table = extend(self, req, *args, **kw)
            if req.node is not old:
                self.tree.lock(old)                # the hold on the shorter prefix is never dropped
            return table
        return bad
    wrap(mp, PrefixCache, "_extend", make)           # what req.extend() runs


def _extend_drops_its_hold(mp: pytest.MonkeyPatch) -> None:
    def make(extend: Callable[..., Any]) -> Callable[..., Any]:
        def bad(self: PrefixCache, req: Any, *args: Any, **kw: Any) -> Any:
            old = req.node
            table = extend(self, req, *args, **kw)
            if req.node is not old:                # holds the old prefix, not the extended one
                self.tree.lock(old)
                self.tree.unlock(req.node)
                req.node = old
            return table
        return bad
    wrap(mp, PrefixCache, "_extend", make)           # what req.extend() runs


def _wait_does_not_wait(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(PrefixCache, "_wait", lambda self, req, timeout=None: self._poll(req))   # req.wait()


def _grow_repeats_a_token(mp: pytest.MonkeyPatch) -> None:
    from radixkv.core.hashing import as_token_bytes
    from radixkv.core.request import Request

    def grow(self: Request, tokens: Any) -> bytes:
        known = len(self._data) // 4
        if len(tokens) <= known:
            return self._data
        return self._data + as_token_bytes(tokens[max(0, known - 1):])    # off by one: repeats a token
    mp.setattr(Request, "_grow", grow)


def _land_drops_the_load(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(Loads, "land", lambda self, req, *args, **kw: 0)


def _trim_one_page_too_many(mp: pytest.MonkeyPatch) -> None:
    def make(trim: Callable[..., None]) -> Callable[..., None]:
        def bad(self: KVGroups, tree: Any, node: Any, spill: Any = None) -> None:
            keep = self.keep
            self.keep = [k - 1 for k in keep]      # the window starts one page late
            try:
                trim(self, tree, node, spill)
            finally:
                self.keep = keep
        return bad
    wrap(mp, KVGroups, "trim", make)


def _release_keeps_window(mp: pytest.MonkeyPatch) -> None:
    def release(self: PrefixCache, request: Any) -> None:
        req = self._live.pop(request.id, None)
        if req is None:
            raise ValueError("match: already released")
        if req._pending is not None:
            req._pending.future.cancel()
            req._pending = None
        req.released = True
        self.tree.unlock(req.node)
        self._trim(req.node)                       # forgets groups.hold(req.node, -1)
    mp.setattr(PrefixCache, "_release", release)     # what cache.release and req.release() run


def _detach_keeps_pages(self: KVGroups, ids: Any) -> None:
    for table in self.maps:
        table[ids] = -1                            # forgets to give the pages back to the pool


GROUP_MUTANTS = [
    Mutant("groups-trim-one-page-too-many", "KVGroups.trim", "the window starts one page late (keep - 1)",
           "SlidingRequestMachine", _trim_one_page_too_many),
    Mutant("groups-usable-ignores-window", "KVGroups.usable", "a match is served without its window",
           "SlidingRequestMachine", lambda mp: mp.setattr(KVGroups, "usable", lambda self, pages: len(pages))),
    Mutant("groups-fill-noop", "KVGroups.fill", "dropped window pages are never refilled by an engine's duplicates",
           "SlidingRequestMachine", lambda mp: mp.setattr(KVGroups, "fill", lambda self, tree_pages, engine_pages: None)),
    Mutant("groups-release-keeps-window", "PrefixCache.release", "release forgets groups.hold(node, -1)",
           "SlidingRequestMachine", _release_keeps_window),
    Mutant("groups-detach-keeps-pages", "KVGroups.detach", "freed tree pages leak their sliding pages",
           "SlidingRequestMachine", lambda mp: mp.setattr(KVGroups, "detach", _detach_keeps_pages)),
]

REQUEST_MUTANTS = [
    Mutant("request-extend-keeps-old-hold", "PrefixCache.extend", "extend never drops the hold on the old prefix",
           "RequestMachine", _extend_keeps_old_hold),
    Mutant("request-extend-drops-its-hold", "PrefixCache.extend", "extend holds the old prefix, not the new pages",
           "RequestMachine", _extend_drops_its_hold),
    Mutant("request-wait-does-not-wait", "PrefixCache.wait", "wait returns with the load still pending",
           "RequestMachine", _wait_does_not_wait),
    Mutant("request-grow-repeats-a-token", "Request._grow", "extend converts from one token too early",
           "RequestMachine", _grow_repeats_a_token),
    Mutant("cache-land-drops-the-load", "Loads.land", "a load that arrived is dropped (a silent miss)",
           "TieredPrefixCacheMachine", _land_drops_the_load),
]

MUTANTS = TIER_MUTANTS + ENGINE_MUTANTS + REQUEST_MUTANTS + GROUP_MUTANTS
MUTANTS += [Mutant(*row) for row in ENGINE_ROWS]      # tests/helpers/mutants_engine.py


# The request machines' rows get three times the examples.  The sliding-window rows' catches hang on
# a retry landing a page short of a reuse point, which the fixed seed reaches on a loaded machine
# only sometimes (the tier writer's and loads' timing changes which pages are resident); and
# RequestMachine caught ``touch-stamps-leaves-only`` in 18 of 20 runs of 40 examples at random
# seeds, before and after ``GatedTier`` came to forward ``get_many`` and ``put_many`` whole, but that
# change made the fixed seed miss it.  Caught rows stop early anyway.
_REQUESTS = settings(MUTATION, max_examples=3 * MUTATION.max_examples)
# The sliding-window rows get eight times: ``groups-trim-one-page-too-many`` survived 1 of 4 runs of
# 120 examples on a quiet machine and a CI run; 16 runs of 320 caught it (8 of them beside two
# CPU-bound processes, one of those at a later example than the others, its usual catch missed).
_SLIDING = settings(MUTATION, max_examples=8 * MUTATION.max_examples)
# ... and a CI run of 320 missed it again (its examples are the same each run: only the timing
# differs), so a sliding-window row that survives runs twice more on examples drawn afresh.
_SLIDING_RETRIES = 2
_SLIDING_AGAIN = settings(_SLIDING, derandomize=False)


def _settings_for(mutant: Mutant) -> settings:
    if mutant.harness == "SlidingRequestMachine":
        return _SLIDING
    return _REQUESTS if mutant.harness == "RequestMachine" else MUTATION


def run_mutant(mutant: Mutant, tmp_path: Path) -> tuple[bool, str]:
    """Apply ``mutant``, run its harness (a sliding-window row that survives: again, up to
    ``_SLIDING_RETRIES`` times, on fresh examples); (caught, the first line of what caught it)."""
    harness = HARNESSES[mutant.harness]
    runs = [_settings_for(mutant)]
    if mutant.harness == "SlidingRequestMachine":
        runs += [_SLIDING_AGAIN] * _SLIDING_RETRIES
    for attempt, chosen in enumerate(runs):
        with pytest.MonkeyPatch.context() as mp:
            made = mutant.patch(mp)
            try:
                if mutant in TIER_MUTANTS:
                    harness.check(made, tmp_path=tmp_path, settings=MUTATION)
                else:
                    run_state_machine_as_test(harness, settings=chosen)
            except Exception as exc:  # noqa: BLE001 - any failure of the harness is a catch
                text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if isinstance(exc, TypeError) and "argument" in str(exc):
                    raise AssertionError(f"{mutant.name}: the patch no longer fits its target ({text}); "
                                         "re-point it") from exc
                return True, (f"(run {attempt + 1}) " if attempt else "") + text
    return False, "survived"


def test_mutant_names_are_unique_and_harnesses_known() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(m.harness in HARNESSES for m in MUTANTS), [m.harness for m in MUTANTS if m.harness not in HARNESSES]


def test_every_mutant_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, survivors = [], []
    start = time.perf_counter()
    for i, mutant in enumerate(MUTANTS):
        t0 = time.perf_counter()
        caught, how = run_mutant(mutant, tmp_path / str(i))
        rows.append(f"{'caught ' if caught else 'SURVIVED'} {mutant.name:34} {mutant.harness:26} "
                    f"{time.perf_counter() - t0:5.1f}s  {how[:90]}")
        if not caught:
            survivors.append(mutant.name)
    with capsys.disabled():
        print(f"\n{len(MUTANTS) - len(survivors)}/{len(MUTANTS)} mutants caught "
              f"in {time.perf_counter() - start:.0f}s\n" + "\n".join(rows))
    assert not survivors, f"mutants the harness did not catch: {survivors}"
