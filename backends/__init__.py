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

``CpuTier``, ``LmdbTier``, ``S3Tier`` and ``RedisTier`` are attributes of this package that import
their module (and its dependency) on first use.

**Bounds on remote waits.**  A caller bounds every tier call it makes inside ``with bounded(deadline,
max_blob_bytes):`` (a context variable, so it passes through wrappers unchanged): a remote tier
gives up when ``time.monotonic()`` passes ``deadline`` and raises ``DeadlineExceeded`` (with what it
had by then in ``partial``), and refuses to download a blob over ``max_blob_bytes``
(``OversizeBlob``).  Local tiers do not wait on other machines and ignore both.  A remote tier that
refuses a stored blob for its size (a miss: a bad entry, which it deletes) tells the caller through
``report_oversize``, so that a ``TierStack`` counts it like a corrupt blob.  ``BoundedPool`` is the
worker pool and deadline-bounded wait the remote backends share.
"""

from __future__ import annotations

import abc
import contextvars
import importlib
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from contextlib import contextmanager
from typing import Any, Callable, Container, Iterable, Iterator, NamedTuple, Sequence, TypeVar, Union

__all__ = ["KEY_BYTES", "NAMESPACE_BYTES", "Blob", "BoundedPool", "DeadlineExceeded", "Entry", "EvictionLog", "MemoryTier", "OversizeBlob",
           "Tier", "available", "blob_view", "bounded", "check_key", "check_namespace_id", "count_leading", "create",
           "current_deadline", "current_max_blob_bytes", "redact", "register", "report_oversize"]

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
    #: Peer: the tier reads other instances' local tiers (``radixkv.backends.peer.PeerTier``): remote,
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
        call, for the stack's ``chunks`` events (``radixkv.observe``); ``None`` when it lost track
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
        return len([check_key(k) for k in keys])

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
        return self._bytes

    def stats(self) -> dict[str, int | float]:
        return {**super().stats(), "entries": len(self._data)}

    def check(self) -> None:
        super().check()
        with self._lock:
            assert self._bytes == sum(map(len, self._data.values())), "memory tier byte count drifted"
            assert all(len(k) == KEY_BYTES for k in self._data), "memory tier holds a malformed key"


# -- bounds on remote waits -------------------------------------------------------------------

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


class BoundedPool:
    """The worker threads of a remote tier (made on first use, ``size`` of them), and a wait on
    them that ends at a deadline.

    ``submit`` runs each call in a copy of the caller's context (so ``current_deadline`` holds in
    the worker), or on the calling thread when that is one of the pool's own (a task that waited
    on tasks queued behind it could deadlock the pool).  ``gather`` waits for the futures until
    the deadline; what did not finish by then is abandoned — cancelled if it had not started, else
    left to end on its own (its socket timeouts bound it, but a trickling answer keeps every read
    short and can hold it for as long as it trickles) — and counted through ``on_abandon``.

    **Abandoned calls do not clog the pool.**  When a running call is abandoned, the pool retires
    its executor (shut down without waiting: its threads end as their calls do, and what was queued
    on it still runs there or is cancelled by its own caller) and later calls get a fresh one, so
    that a fault that ended leaves no stuck thread between the next request and the endpoint.  One
    retired executor at a time: while one still has unfinished calls (``stuck``), the pool keeps
    its executor, and later calls may wait behind abandoned ones (their own deadline still bounds
    them; a tier's breaker keeps requests away meanwhile).  So a pool never has more than
    ``2 * size`` threads, and at most ``size`` of them stuck.  Thread-safe.
    """

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        # Calls submitted and not yet finished (or cancelled), per executor: the current one's, and
        # the retired one's until they are all done.
        self._unfinished: dict[ThreadPoolExecutor, int] = {}
        self.retired = 0  # executors retired because abandoned calls held their threads (for stats)

    def _executor(self) -> ThreadPoolExecutor:
        # Lock held.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name,
                                            initializer=setattr, initargs=(self._local, "active", True))
        return self._pool

    def warm(self) -> None:
        """Start every worker thread now, from a background thread, so that the first calls do not
        pay for thread starts (slow on a loaded machine) out of their deadline.  Returns at once."""
        def start_all() -> None:
            with self._lock:
                if self._closed or self._pool is not None:
                    return
                pool = self._executor()
            gate = threading.Barrier(self.size)  # each start task holds its thread until all started

            def hold() -> None:
                try:
                    gate.wait(timeout=1.0)
                except threading.BrokenBarrierError:
                    pass

            for _ in range(self.size):
                try:
                    pool.submit(hold)
                except RuntimeError:  # closed or retired meanwhile
                    gate.abort()
                    return

        threading.Thread(target=start_all, name=f"{self.name}-warm", daemon=True).start()

    def on_worker(self) -> bool:
        """Whether the calling thread is one of the pool's workers."""
        return bool(getattr(self._local, "active", False))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on a worker (inline on a worker's own thread), in the caller's context."""
        if self.on_worker():
            done: Future[T] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                done.set_exception(e)
            return done
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            pool = self._executor()
            future = pool.submit(contextvars.copy_context().run, fn, *args)
            self._unfinished[pool] = self._unfinished.get(pool, 0) + 1
        future._radixkv_executor = pool  # type: ignore[attr-defined]  # which executor a late call holds
        future.add_done_callback(lambda _: self._finished(pool))  # runs at once if already done
        return future

    def _finished(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            left = self._unfinished.get(pool, 0) - 1
            if left > 0 or pool is self._pool:
                self._unfinished[pool] = max(0, left)
            else:
                self._unfinished.pop(pool, None)

    @property
    def stuck(self) -> int:
        """Calls not finished on retired executors (abandoned ones, and any queued behind them
        until their callers cancel them).  O(1)."""
        with self._lock:
            return sum(n for pool, n in self._unfinished.items() if pool is not self._pool)

    def gather(self, futures: Sequence[Future[T]], deadline: float,
               on_abandon: Callable[[int], None] | None = None) -> list[T]:
        """Every future's result, in order, waiting at most until ``deadline``.

        A fault raises (the first, once the others finished or the deadline passed).  At the
        deadline, ``DeadlineExceeded`` with ``partial`` = the results (``None`` where a call did
        not finish or failed), after ``on_abandon(number abandoned)``; a running call abandoned on
        the current executor retires it (see the class).  O(len(futures))."""
        _wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()))
        results: list[Any] = []
        error: BaseException | None = None
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is None:
                results.append(f.result())
                continue
            results.append(None)
            if f.done() and not f.cancelled():
                error = error or f.exception()
        late = [f for f in futures if not f.done()]
        if late:
            running = [f for f in late if not f.cancel()]
            self._retire({getattr(f, "_radixkv_executor", None) for f in running})
            if on_abandon is not None:
                on_abandon(len(late))
            raise DeadlineExceeded(f"{self.name}: {len(late)} of {len(futures)} requests did not finish "
                                   "by the deadline", partial=results)
        if error is not None:
            raise error
        return results

    def _retire(self, holding: set[Any]) -> None:
        """Retire the current executor if abandoned calls hold its threads and no retired one has
        unfinished calls left; start the fresh one's threads."""
        with self._lock:
            pool = self._pool
            if self._closed or pool is None or pool not in holding:
                return
            if any(n for other, n in self._unfinished.items() if other is not pool):
                return  # one retired executor at a time: at most ``size`` stuck threads
            self._pool = None
            self.retired += 1
        pool.shutdown(wait=False)
        self.warm()

    def check(self) -> None:
        """Assert the bound on retired executors: at most one has unfinished calls, none counts
        below zero.  O(1)."""
        with self._lock:
            retired = [n for pool, n in self._unfinished.items() if pool is not self._pool and n]
            assert len(retired) <= 1 or self._closed, \
                f"{self.name}: {len(retired)} retired executors still running calls"
            assert all(n >= 0 for n in self._unfinished.values()), f"{self.name}: negative call count"
            assert self._pool is None or not self._closed, f"{self.name}: an executor after close"

    def close(self) -> None:
        """Refuse new calls, cancel queued ones and let running ones end on their own (never waits
        on a hung request).  Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# name -> "module:attribute" (imported on first use) or a factory.
_REGISTRY: dict[str, str | Callable[..., Tier]] = {
    "memory": "radixkv.backends:MemoryTier",
    "cpu": "radixkv.backends.cpu:CpuTier",
    "lmdb": "radixkv.backends.lmdb:LmdbTier",
    "s3": "radixkv.backends.s3:S3Tier",
    "redis": "radixkv.backends.redis:RedisTier",
    "peer": "radixkv.backends.peer:PeerTier",
}
_LAZY_CLASSES = {"CpuTier": "radixkv.backends.cpu", "LmdbTier": "radixkv.backends.lmdb",
                 "S3Tier": "radixkv.backends.s3", "RedisTier": "radixkv.backends.redis",
                 "PeerTier": "radixkv.backends.peer"}


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
