"""The tier interface: what a hash-keyed storage tier below the GPU pool promises, and a reference tier.

A tier is a bounded key-value store of encoded chunks (``radixkv.core.format``).  Keys are 24 bytes:
the 8-byte namespace id followed by the 16-byte chained chunk key, so a whole namespace can be
dropped at once.  Values ("blobs") are bytes-like.  A tier is a cache: it may evict anything at
any time, and a put it cannot honour is dropped — but it never returns a blob other than the last
one put under that key.

``Tier`` is the contract every backend implements (``radixkv.backends`` holds the backends and
re-exports these names); ``MemoryTier`` is the plain in-memory reference the differential tests
compare every backend with (``radixkv.testing.TierContract``).

    >>> tier = MemoryTier()
    >>> tier.put(bytes(24), b"blob"), bytes(tier.get(bytes(24)))
    (True, b'blob')
"""

from __future__ import annotations

import abc
import re
import threading
from typing import Any, Callable, Container, Iterable, Iterator, NamedTuple, Sequence, TypeVar, Union

__all__ = ["KEY_BYTES", "NAMESPACE_BYTES", "Blob", "Entry", "EvictionLog", "MemoryTier", "Tier", "blob_view",
           "check_key", "check_namespace_id", "count_leading", "redact"]

KEY_BYTES = 24
NAMESPACE_BYTES = 8
Blob = Union[bytes, bytearray, memoryview]
T = TypeVar("T")

class EvictionLog:
    """The keys a local tier dropped on its own, until ``take``n (``Tier.take_evicted``).  Bounded:
    past ``MAX`` untaken keys it forgets them and says it lost track.  Thread-safe; O(1) a key."""

    MAX = 65536

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._lost = False
        self._lock = threading.Lock()

    def note(self, keys: Iterable[bytes]) -> None:
        """Record dropped ``keys``."""
        with self._lock:
            self._keys.extend(keys)
            if len(self._keys) > self.MAX:
                self._keys, self._lost = [], True

    def lose_track(self) -> None:
        """Every key may be gone (the tier emptied itself)."""
        with self._lock:
            self._keys, self._lost = [], True

    def take(self) -> list[bytes] | None:
        """The keys recorded since the last call, or ``None`` after ``lose_track`` or an overflow."""
        with self._lock:
            keys, lost = self._keys, self._lost
            self._keys, self._lost = [], False
        return None if lost else keys


class Entry(NamedTuple):
    """One stored blob, as ``Tier.entries`` lists it: its 24-byte tier key, its size in bytes,
    ``stamp`` (wall-clock seconds of its last access or write, whichever the tier records; ``None``
    where it records neither) and whether it is pinned."""

    key: bytes
    size: int
    stamp: float | None = None
    pinned: bool = False


def check_key(key: Any, name: str = "key") -> bytes:
    """Return ``key`` if it is a 24-byte ``bytes`` tier key; raise ``TypeError``/``ValueError``."""
    if type(key) is not bytes:
        raise TypeError(f"{name} must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"{name} must be {KEY_BYTES} bytes (namespace id + chunk key), got {len(key)}")
    return key


def check_namespace_id(ns_id: Any) -> bytes:
    """Return ``ns_id`` if it is an 8-byte ``bytes`` namespace id; raise ``TypeError``/``ValueError``."""
    if type(ns_id) is not bytes or len(ns_id) != NAMESPACE_BYTES:
        raise ValueError(f"ns_id must be {NAMESPACE_BYTES} bytes (Namespace.id), got {ns_id!r}")
    return ns_id


def count_leading(keys: Sequence[bytes], held: Container[bytes]) -> int:
    """How many leading ``keys`` are in ``held`` (validating every key): ``contains_prefix`` for a
    tier whose index is a local container.  O(len(keys))."""
    for key in keys:
        check_key(key)
    for n, key in enumerate(keys):
        if key not in held:
            return n
    return len(keys)


_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]*@")


def redact(text: str) -> str:
    """``text`` with the user-info of every URL in it (``scheme://user:password@``) replaced by
    ``***@``: what every log line and error message about an endpoint goes through.  O(len).

    >>> redact("GET http://AK:secret@127.0.0.1:9000/bucket failed")
    'GET http://***@127.0.0.1:9000/bucket failed'
    """
    return _USERINFO.sub("***@", text)


def blob_view(blob: Any) -> memoryview:
    """A flat byte view of a bytes-like ``blob``; ``TypeError`` for anything else."""
    try:
        return memoryview(blob).cast("B")
    except TypeError:
        raise TypeError(f"blob must be a contiguous bytes-like object, got {type(blob).__name__}") from None


class Tier(abc.ABC):
    """The protocol every storage tier implements.

    Contract, for every method unless it says otherwise:

    * **Keys** are 24-byte ``bytes`` (``check_key``); a wrong key raises ``TypeError``/``ValueError``.
    * **Thread-safe**: any method may be called from any thread at any time (a stack loads on the
      engine's thread and writes from a background thread).
    * **A cache, not a store**: a tier may evict or expire any entry at any time.  What it must
      never do is return a blob other than the last one put under that key.
    * **Faults raise**: an I/O error, a timeout or a closed tier raises; ``TierStack`` turns that
      into a miss and counts it.  A tier never swallows a fault into a wrong answer.
    * **Local or not** (``local``): a local tier's read costs no network round trip, so the stack
      may read it for bookkeeping (to refresh a chunk's recency); a remote tier is read only to load.

    Subclasses implement ``get``, ``put``, ``contains_prefix``, ``delete``, ``drop_namespace`` and
    ``used_bytes``; the batch methods and ``read`` have correct (if unbatched) defaults.
    """

    #: Short name used in logs and ``TierStack.stats()``.
    name: str = "tier"
    #: Local: a read costs no network round trip, so the stack may read it for bookkeeping (e.g.
    #: ``TierStack.touch`` reads a chunk to refresh its LRU position).  A remote tier sets ``False``.
    local: bool = True
    #: Victim: a volatile tier private to one cache (host memory) that an exclusive stack
    #: (``TierStack(exclusive=True)``) uses as a victim cache of the pool: it holds only what the pool
    #: evicted, so a crash loses nothing that was not lost anyway.  Persistent or shared tiers (a file,
    #: a server, a store several caches read) keep ``False``: they stay inclusive.
    victim: bool = False
    #: In memory: every read is a copy out of this process's memory (no disk, no network), so a
    #: caller may read it on a latency-critical thread (the vLLM connector answers a lookup that
    #: such tiers cover at once, on its scheduler's thread).  ``False`` unless a tier says so.
    in_memory: bool = False
    #: Peer: the tier reads other instances' local tiers (``radixkv.p2p.tier.PeerTier``): remote,
    #: read-only — a stack writes and promotes nothing into it — and its blobs are sealed as the
    #: local tiers seal theirs (never encrypted: they are the peers' local blobs).
    peer: bool = False

    @abc.abstractmethod
    def get(self, key: bytes) -> Blob | None:
        """The blob stored under ``key``, or ``None``.

        The returned buffer stays valid and unchanged for as long as the caller holds it (a tier
        never hands out memory it later reuses).  Counts as an access for LRU.  Cost: one lookup
        and one copy of the blob, or one round trip for a remote tier.
        """

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """``[get(k) for k in keys]``; backends batch it into one transaction or round trip."""
        return [self.get(k) for k in keys]

    def read(self, key: bytes, consume: Callable[[memoryview], T]) -> T | None:
        """``consume(buffer)`` on the blob under ``key`` and its result, or ``None`` if absent.

        The zero-copy read: the buffer may be the tier's own memory (an arena slot, an LMDB page)
        and is valid only until ``consume`` returns — keep nothing that refers to it.  ``consume``
        must not write to it.  Exceptions from ``consume`` propagate.  Counts as an access.
        Default: ``consume`` on ``get``'s copy.
        """
        blob = self.get(key)
        return None if blob is None else consume(memoryview(blob).cast("B"))

    @abc.abstractmethod
    def put(self, key: bytes, blob: Blob) -> bool:
        """Store a copy of ``blob`` under ``key``, replacing any older blob; evicts as needed.

        Returns ``True`` if stored.  ``False`` means the tier chose not to keep it (too large, no
        room it may free) — and then it does not hold ``key`` at all, old blob included.  The
        caller may reuse ``blob``'s memory once this returns.  Cost: one copy of the blob plus
        amortised O(1) eviction work (local tiers), or one round trip (remote).
        """

    def put_many(self, items: Iterable[tuple[bytes, Blob]]) -> int:
        """``put`` each ``(key, blob)`` in order; the number stored.  Backends batch it."""
        return sum(self.put(k, b) for k, b in items)

    @abc.abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` this tier holds: ``n`` such that it holds ``keys[:n]`` and not
        ``keys[n]``.  Does not modify the tier, not even LRU order.  Cost: one round trip for the
        whole list (the point: a request asks each tier once), O(n) local lookups.
        """

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; ``True`` if it was there.  Cost: one lookup / round trip."""

    @abc.abstractmethod
    def drop_namespace(self, ns_id: bytes) -> int:
        """Remove every key starting with the 8-byte ``ns_id``; how many were removed (a remote tier
        may return 0 when it cannot count).  Cost: O(entries of that namespace), or a scan.
        """

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """Every entry held (of namespace ``ns_id`` only, when given), as ``Entry``: for operators
        (``python -m radixkv inspect``), never on a request's path.  Does not count as an access.
        A snapshot or a scan: entries written meanwhile may or may not appear.  Cost: O(entries) —
        a listing of the store for a remote tier.  The default raises ``NotImplementedError``: a
        tier that cannot list says so."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its entries")

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier's entries take now, by its own accounting.  Cheap, may be approximate
        under concurrent writers."""

    @property
    def capacity_bytes(self) -> int | None:
        """The byte budget the tier keeps ``used_bytes`` within, or ``None`` for unbounded."""
        return None

    def take_evicted(self) -> list[bytes] | None:
        """The keys this tier dropped on its own (evicted to make room, or expired) since the last
        call, for the stack's ``chunks`` events (``radixkv.core.observe``); ``None`` when it lost track
        (more than ``EvictionLog.MAX`` keys untaken, or the tier emptied itself): any key may be
        gone.  The default, for tiers whose server evicts out of sight (S3, Redis): ``[]``.  O(keys)."""
        return []

    def stats(self) -> dict[str, int | float]:
        """Counters and sizes by name; a new dict each call.  Cheap.

        A tier reports the counters it keeps.  These names mean the same in every tier (the tier
        contract, ``radixkv.testing.TierContract``, checks the ones present):

        * ``hits``, ``misses``: reads (``get``, each key of ``get_many``, ``read``) that found a
          blob, and that did not.
        * ``puts``: blobs offered to ``put``/``put_many``; ``rejected``: those not stored.
        * ``evictions``: entries removed to make room for a put.  **Expired entries:** a tier may
          count here an entry it drops because its TTL passed (an eviction by time), or not
          (``LmdbTier`` counts them apart, as ``expired``), but once at most.  So with a TTL,
          ``evictions`` is known only within a range: at least the live entries evicted, at most
          one more per expired entry dropped meanwhile.
        * ``entries``: the entries stored; ``used_bytes``: the property's value.  With a TTL both
          may include expired entries not dropped yet.

        Other names (``expired``, errors, timeouts, ...) are the tier's own, documented with it.
        """
        cap = self.capacity_bytes
        result: dict[str, int | float] = {"used_bytes": self.used_bytes}
        if cap is not None:
            result["capacity_bytes"] = cap
        return result

    def pin(self, keys: Sequence[bytes]) -> int:
        """Keep ``keys`` (held now or stored later) from eviction until ``unpin``; the number of
        leading keys pinned (a tier bounds its pins, so they cannot fill it).  The default pins
        nothing and returns 0: a tier that cannot pin says so.  Does not store anything."""
        return 0

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Let pinned ``keys`` be evicted again; the number that were pinned.  Default: 0."""
        return 0

    def expect(self, blob_bytes: int) -> None:
        """A hint before the first ``put``: blobs of up to ``blob_bytes`` will come (a cache whose
        KV groups store chunks of several sizes gives its largest).  Tiers of fixed slots size
        them by it; the default ignores it.  O(1)."""

    def close(self) -> None:
        """Release resources (files, memory, connections).  Idempotent; other methods may raise
        afterwards.  Durable tiers keep their entries for the next open."""

    def check(self) -> None:
        """Assert the tier's internal invariants (for tests; may be O(entries)).  Raises
        ``AssertionError``.  The base checks the byte budget."""
        cap = self.capacity_bytes
        used = self.used_bytes
        assert used >= 0, f"{self.name}: negative used_bytes {used}"
        assert cap is None or used <= cap, f"{self.name}: used_bytes {used} over capacity {cap}"

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cap = self.capacity_bytes
        return f"{type(self).__name__}(used={self.used_bytes}, capacity={'unbounded' if cap is None else cap})"


class MemoryTier(Tier):
    """The reference tier: an unbounded dict of immutable ``bytes``, behind one lock.

    Exact (never evicts), so the differential tests in ``radixkv.testing`` compare every tier with
    it.  Also handy in examples and for tests of the stack.  Every operation is O(1) (``put``
    copies the blob; ``drop_namespace`` scans all keys).

    >>> tier = MemoryTier()
    >>> tier.put(bytes(24), b"x"); tier.contains_prefix([bytes(24), b"k" * 24])
    True
    1
    """

    name = "memory"
    in_memory = True

    def pin(self, keys: Sequence[bytes]) -> int:
        """A memory tier never evicts: every key stays anyway.  O(len(keys))."""
        return len([check_key(k) for k in keys])

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Pins are not kept (nothing is ever evicted): checks each key and returns ``len(keys)``, as
        ``pin`` does.  O(len(keys))."""
        return len([check_key(k) for k in keys])

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        """The stored ``bytes`` object itself (immutable, so no copy), or ``None``.  Not an access: there
        is no order to refresh.  O(1) under the lock."""
        check_key(key)
        with self._lock:
            return self._data.get(key)

    def put(self, key: bytes, blob: Blob) -> bool:
        """Always stores (``True``): copies ``blob`` into a new ``bytes``, replacing any older one; never
        evicts.  O(len(blob)), the copy outside the lock."""
        check_key(key)
        value = bytes(blob_view(blob))
        with self._lock:
            old = self._data.get(key)
            self._bytes += len(value) - (0 if old is None else len(old))
            self._data[key] = value
        return True

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """``count_leading`` over the dict, under the lock (every key is checked).  O(len(keys))."""
        with self._lock:
            return count_leading(keys, self._data)

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` and its bytes from the count; ``True`` if it was there.  O(1)."""
        check_key(key)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
        return old is not None

    def drop_namespace(self, ns_id: bytes) -> int:
        """Remove every key of ``ns_id``; how many.  Scans every key held: O(entries), not only the
        namespace's."""
        check_namespace_id(ns_id)
        with self._lock:
            doomed = [k for k in self._data if k.startswith(ns_id)]
            for k in doomed:
                self._bytes -= len(self._data.pop(k))
        return len(doomed)

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """A snapshot of the entries (no stamps: nothing is recorded).  O(n)."""
        if ns_id is not None:
            check_namespace_id(ns_id)
        with self._lock:
            held = [Entry(k, len(v)) for k, v in self._data.items() if ns_id is None or k.startswith(ns_id)]
        return iter(held)

    def keys(self) -> list[bytes]:
        """Every key held, in insertion order.  O(n)."""
        with self._lock:
            return list(self._data)

    @property
    def used_bytes(self) -> int:
        """The exact sum of the blobs' lengths, kept up to date by every write.  O(1)."""
        return self._bytes

    def stats(self) -> dict[str, int | float]:
        """``used_bytes`` and ``entries`` only: no hit, miss or put counters, no ``capacity_bytes``
        (unbounded).  O(1)."""
        return {**super().stats(), "entries": len(self._data)}

    def check(self) -> None:
        """The base's byte check, then: the byte count is the sum of the blobs' lengths and every key is
        24 bytes.  O(entries) under the lock."""
        super().check()
        with self._lock:
            assert self._bytes == sum(map(len, self._data.values())), "memory tier byte count drifted"
            assert all(len(k) == KEY_BYTES for k in self._data), "memory tier holds a malformed key"
