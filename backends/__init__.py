"""Hash-keyed storage tiers below the GPU pool: the ``Tier`` protocol, a registry, a reference tier.

A tier is a bounded key-value store of encoded chunks (``radixkv.format``).  Keys are 24 bytes:
the 8-byte namespace id followed by the 16-byte chained chunk key, so a whole namespace can be
dropped at once.  Values ("blobs") are bytes-like.  A tier is a cache: it may evict anything at
any time, and a put it cannot honour is dropped — but it never returns a blob other than the last
one put under that key.

Backends register by name and load lazily, so ``import radixkv.backends`` needs no optional
dependency::

    >>> from radixkv import backends
    >>> tier = backends.create("memory")
    >>> tier.put(bytes(24), b"blob"), bytes(tier.get(bytes(24)))
    (True, b'blob')

``CpuTier``, ``LmdbTier`` and ``S3Tier`` are attributes of this package that import their module
(and its dependency) on first use.
"""

from __future__ import annotations

import abc
import importlib
import threading
from typing import Any, Callable, Container, Iterable, Sequence, TypeVar, Union

__all__ = ["KEY_BYTES", "NAMESPACE_BYTES", "Blob", "MemoryTier", "Tier", "available", "blob_view", "check_key",
           "check_namespace_id", "count_leading", "create", "register"]

KEY_BYTES = 24
NAMESPACE_BYTES = 8
Blob = Union[bytes, bytearray, memoryview]
T = TypeVar("T")


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

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier's entries take now, by its own accounting.  Cheap, may be approximate
        under concurrent writers."""

    @property
    def capacity_bytes(self) -> int | None:
        """The byte budget the tier keeps ``used_bytes`` within, or ``None`` for unbounded."""
        return None

    def stats(self) -> dict[str, int | float]:
        """Counters (hits, misses, evictions, ...) and sizes; a new dict each call.  Cheap."""
        cap = self.capacity_bytes
        result: dict[str, int | float] = {"used_bytes": self.used_bytes}
        if cap is not None:
            result["capacity_bytes"] = cap
        return result

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

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        check_key(key)
        with self._lock:
            return self._data.get(key)

    def put(self, key: bytes, blob: Blob) -> bool:
        check_key(key)
        value = bytes(blob_view(blob))
        with self._lock:
            old = self._data.get(key)
            self._bytes += len(value) - (0 if old is None else len(old))
            self._data[key] = value
        return True

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return count_leading(keys, self._data)

    def delete(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
        return old is not None

    def drop_namespace(self, ns_id: bytes) -> int:
        check_namespace_id(ns_id)
        with self._lock:
            doomed = [k for k in self._data if k.startswith(ns_id)]
            for k in doomed:
                self._bytes -= len(self._data.pop(k))
        return len(doomed)

    def keys(self) -> list[bytes]:
        """Every key held, in insertion order.  O(n)."""
        with self._lock:
            return list(self._data)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int | float]:
        return {**super().stats(), "entries": len(self._data)}

    def check(self) -> None:
        super().check()
        with self._lock:
            assert self._bytes == sum(map(len, self._data.values())), "memory tier byte count drifted"
            assert all(len(k) == KEY_BYTES for k in self._data), "memory tier holds a malformed key"


# name -> "module:attribute" (imported on first use) or a factory.
_REGISTRY: dict[str, str | Callable[..., Tier]] = {
    "memory": "radixkv.backends:MemoryTier",
    "cpu": "radixkv.backends.cpu:CpuTier",
    "lmdb": "radixkv.backends.lmdb:LmdbTier",
    "s3": "radixkv.backends.s3:S3Tier",
}
_LAZY_CLASSES = {"CpuTier": "radixkv.backends.cpu", "LmdbTier": "radixkv.backends.lmdb",
                 "S3Tier": "radixkv.backends.s3"}


def register(name: str, factory: str | Callable[..., Tier]) -> None:
    """Make ``create(name, ...)`` build a tier with ``factory``: a callable, or ``"module:attr"``
    imported on first use (so registering costs no import).  Replaces an earlier registration."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"factory must be a callable or 'module:attribute', got {factory!r}")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Registered tier names (their dependencies may still be missing)."""
    return sorted(_REGISTRY)


def create(name: str, **kwargs: Any) -> Tier:
    """Build the tier registered as ``name`` with ``kwargs``; imports its backend on first use.

    >>> create("memory").used_bytes
    0
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r}; registered: {', '.join(available())}") from None
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(**kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        value = getattr(importlib.import_module(_LAZY_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixkv.backends' has no attribute {name!r}")
