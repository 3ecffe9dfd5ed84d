"""``LmdbTier``: chunks in one local LMDB environment, LRU by bytes, optional TTL, multi-process.

Storage contract:

* **One environment** at ``path`` (a directory), shared by every process and thread that opens it
  with the same ``max_bytes``.  Within a process, every ``LmdbTier`` of one path shares one open
  environment (LMDB forbids opening a path twice in a process): the first one's ``map_size``,
  ``max_readers`` and ``sync`` hold until the last of them closes.  The directory is created
  ``0700`` and the files ``0600`` (``dir_mode``/``file_mode``), since cached KV reveals prompts.  Writers are serialised by LMDB (one write transaction at a time,
  across processes); readers never block and never see a half-written chunk.  Entries survive a
  restart of the process (and, with ``sync=True``, of the machine).
* **Five named databases**: ``chunks`` (key → blob), ``meta`` (key → size, last access, expiry),
  ``lru`` (last access ‖ key, oldest first), ``expiry`` (expiry ‖ key) and ``pins`` (pinned key →
  its size); plus ``info``, which holds the byte total and the pinned byte total.  All of them
  change in the same transaction, so they always agree (``check``).
* **LRU by bytes**: a write evicts the least recently accessed entries until the blob fits in
  ``max_bytes`` (blob bytes; LMDB's page overhead comes on top, see ``map_size``).  Accesses are
  batched: ``get``/``read`` record them in memory and one write transaction applies every
  ``touch_every`` of them (or after ``touch_seconds``, or at the next write), never one write per
  read.  ``contains_prefix`` is not an access.
* **Pins** (``pin``/``unpin``) are stored in the environment, so they hold for every process that
  opens the path and survive a restart.  A pinned entry is never evicted — not to make room, not
  to free map pages after ``MDB_MAP_FULL`` — and keeps its pin when it is put again.  Only
  entries held now can be pinned (a pin is bounded in bytes, and an absent key has no size yet),
  and pinned bytes stay within ``max_pinned`` (default half of ``max_bytes``), so pins cannot fill
  the tier.  A pin is a mark, not a count: one ``unpin`` undoes any number of ``pin``.  It goes
  with its entry: ``delete``, ``drop_namespace``, a refused put, expiry and a map reset remove it.
* **Admission** (``admission="second_hit"``): a put of a key the tier does not hold is stored
  only the second time the key is seen by this tier object (as ``radixkv.core.policy.SecondHit``: the
  last ``admission_memory`` distinct keys seen once are remembered in memory, per object, not
  shared between processes; about 100 bytes a key).  Seen means offered to ``put`` or asked for
  by a read that missed (``get``/``get_many``/``read``: a reader wanted it, so the put that
  follows is its second sighting); ``contains_prefix`` is a probe and does not count.  Refused puts count as
  ``not_admitted`` and ``rejected``.  The default (``None``) admits every put.
* **TTL**: with ``ttl`` seconds, an entry expires ``ttl`` after it was written, however often it
  is read, pinned or not; an expired entry is a miss at once and is deleted by the next write,
  with its pin.  TTL wins over a pin on purpose: a TTL bounds how long cached KV (which reveals
  prompts) and possibly stale chunks live, a promise about the data; a pin only keeps an entry
  from capacity eviction, a hint about performance.  The expiry is stored with the entry, so it
  holds for every process, whatever ``ttl`` they opened with.  ``clock`` (seconds, wall time
  shared by the processes) is injectable for tests.
* **map_size is a ceiling** on the file (default ``2 * max_bytes + 8 MiB``, sparse), and the tier
  never stops caching when the map fills before ``max_bytes`` of blobs does (page overhead: a
  2 KiB blob takes a 4 KiB page; pages still held by old readers).  Every write keeps a quarter
  of the map free — it evicts least recently used entries while the pages in use would pass 3/4
  of it — so that a transaction that deletes (copy-on-write needs free pages too) can always
  commit.  A write that still hits ``MDB_MAP_FULL`` (a map filled by another process or an older
  version) evicts in small transactions that each commit, down to one entry at a time, then
  retries; a map so full that not even that commits is emptied (``map_resets``), which loses the
  cache and every pin, never its integrity.  Recovery evicts no pinned entry; if only pinned
  entries are left and the map stays full, the write raises (a fault) rather than drop a pin.
* **Durability, chosen deliberately**: ``sync=True`` (the default) fsyncs the data of every commit
  and ``metasync=False`` leaves the meta page to the next commit's sync, so a power cut loses at
  most the last committed write, and LMDB's copy-on-write B-tree comes back at a consistent
  transaction: never a torn chunk.  ``writemap`` stays off, so a stray write through a pointer
  cannot corrupt the map.  ``sync=False`` (a scratch cache that may lose its last seconds of
  writes on a power cut, not on a process crash) writes several times faster; see
  ``benchmarks/results/tiers_cpu.txt``.  The chunk checksum (``radixkv.core.format``) is the second
  line of defence: whatever the disk returns is verified before it is served.
* **Buffers are valid only inside their transaction**: ``read`` hands ``consume`` a view of the
  mapped page and must not keep it; ``get`` returns a copy.
* **Processes**: open the tier in each process, or let it reopen itself — after ``fork()`` the
  child closes the inherited environment and opens its own on first use.  ``fork()`` waits until
  no transaction of the tier is live (at most 10 s), because closing the inherited handle ends
  the transactions it knows of in the reader table both processes share.  Readers left behind by
  dead processes are cleared on open and when the map fills (``reader_check``).
"""

from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from radixkv.core._checks import check_int
from radixkv.backends import Blob, Entry, EvictionLog, Tier, blob_view, check_key, check_namespace_id

__all__ = ["LmdbTier"]

T = TypeVar("T")
_META = struct.Struct("<QQQ")  # blob size, last access (µs), expiry (µs, 0: never)
_STAMP = struct.Struct(">Q")  # big-endian, so that index keys sort by time
_TOTAL = b"total"
_PINNED = b"pinned"  # info: bytes of the pinned entries
_SIZE = struct.Struct("<Q")  # pins: the pinned entry's size
_PURGE_PER_WRITE = 256  # expired entries deleted per write transaction, at most
_WRITE_ATTEMPTS = 4

_OPEN_TIERS: weakref.WeakSet[LmdbTier] = weakref.WeakSet()
_HEADROOM = 0.75  # fraction of the map's pages that entries may take; the rest is for copy-on-write
_EVICT_BATCH = 16  # entries per transaction when recovering from a full map


class _SharedEnv:
    """One open environment and its databases, shared by every tier of its path in this process."""

    def __init__(self, env: Any, dbs: tuple[Any, ...]) -> None:
        self.env = env
        self.dbs = dbs
        self.users = 0


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()
_envs_pid = os.getpid()  # the process whose environments _ENVS holds


def _import_lmdb() -> Any:
    try:
        import lmdb  # the real package: this module is radixkv.backends.lmdb and imports are absolute
    except ImportError as exc:
        raise ImportError("LmdbTier needs the lmdb package: pip install radixkv[lmdb]") from exc
    if not hasattr(lmdb, "Environment"):
        raise ImportError(f"'import lmdb' found {getattr(lmdb, '__file__', lmdb)!r}, not the lmdb "
                          "package: pip install radixkv[lmdb]")
    return lmdb


# fork() waits (up to _FORK_WAIT seconds) until no transaction of any LmdbTier is live in this
# process: the child must close the environment it inherits before it can open its own, and
# closing it ends the transactions the handle knows of — in the reader table the processes share,
# which would unprotect a parent's live read.  With none live at the fork, there is nothing to end.
_FORK_WAIT = 10.0
_gate = threading.Condition()
_live = 0


def _enter_txn() -> None:
    global _live
    with _gate:
        _live += 1


def _leave_txn() -> None:
    global _live
    with _gate:
        _live -= 1
        if not _live:
            _gate.notify_all()


def _before_fork() -> None:
    _gate.acquire()  # held across the fork: no transaction starts meanwhile
    _gate.wait_for(lambda: _live == 0, _FORK_WAIT)


def _after_fork_in_parent() -> None:
    _gate.release()


def _drop_inherited_environments() -> None:
    """In a forked child: close every environment inherited from the parent (closing it in the
    child does not touch the parent's locks or readers), so that tiers open their own."""
    global _ENVS_LOCK, _envs_pid
    _ENVS_LOCK = threading.Lock()
    _envs_pid = os.getpid()
    inherited = list(_ENVS.values())
    _ENVS.clear()
    for shared in inherited:
        try:
            shared.env.close()
        except Exception:  # noqa: BLE001 - the parent's handle is unusable here anyway
            pass


def _after_fork_in_child() -> None:
    global _gate, _live
    _gate, _live = threading.Condition(), 0
    _drop_inherited_environments()
    for tier in list(_OPEN_TIERS):
        tier._forget_parent_environment()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


class _Writer:
    """The work of one write transaction: keeps the byte total and the four databases in step."""

    def __init__(self, tier: LmdbTier, txn: Any) -> None:
        self.tier = tier
        self.txn = txn
        raw = txn.get(_TOTAL, db=tier._info)
        self.total = 0 if raw is None else int.from_bytes(raw, "little")
        raw = txn.get(_PINNED, db=tier._info)
        self.pinned = 0 if raw is None else int.from_bytes(raw, "little")
        self.now = tier._now_us()
        self.counts: Counter[str] = Counter()
        self.evicted: list[bytes] = []          # dropped to make room or expired, for take_evicted

    def remove(self, key: bytes) -> int | None:
        """Delete ``key`` from every database, its pin included; its size, or ``None`` if absent."""
        tier, txn = self.tier, self.txn
        self.drop_pin(key)
        raw = txn.get(key, db=tier._meta)
        if raw is None:
            return None
        size, access, expiry = _META.unpack(raw)
        txn.delete(key, db=tier._data)
        txn.delete(key, db=tier._meta)
        txn.delete(_STAMP.pack(access) + key, db=tier._lru)
        if expiry:
            txn.delete(_STAMP.pack(expiry) + key, db=tier._expiry)
        self.total -= size
        return int(size)

    def insert(self, key: bytes, view: memoryview) -> None:
        """Store a blob under a key that is not present (``remove`` it first)."""
        tier, txn = self.tier, self.txn
        expiry = self.now + tier._ttl_us if tier._ttl_us is not None else 0
        txn.put(key, view, db=tier._data)
        txn.put(key, _META.pack(len(view), self.now, expiry), db=tier._meta)
        txn.put(_STAMP.pack(self.now) + key, b"", db=tier._lru)
        if expiry:
            txn.put(_STAMP.pack(expiry) + key, b"", db=tier._expiry)
        self.total += len(view)

    # -- pins ---------------------------------------------------------------------------------

    def pinned_live(self, key: bytes) -> bool:
        """Whether ``key`` is pinned and held unexpired."""
        tier, txn = self.tier, self.txn
        return txn.get(key, db=tier._pins) is not None and tier._live(txn.get(key, db=tier._meta), self.now)

    def add_pin(self, key: bytes, size: int) -> None:
        """Pin held ``key`` of ``size`` bytes (not pinned yet)."""
        self.txn.put(key, _SIZE.pack(size), db=self.tier._pins)
        self.pinned += size

    def drop_pin(self, key: bytes) -> bool:
        """Unpin ``key``; whether it was pinned."""
        raw = self.txn.pop(key, db=self.tier._pins)
        if raw is None:
            return False
        self.pinned -= _SIZE.unpack(raw)[0]
        return True

    def drop_all_pins(self) -> None:
        self.txn.drop(self.tier._pins, delete=False)
        self.pinned = 0

    # -- eviction ------------------------------------------------------------------------------

    def victims(self) -> Iterator[bytes]:
        """Unpinned keys, least recently accessed first; the caller removes each one it is given
        before asking for the next.  Skips each pinned key once per call (pins are bounded)."""
        cursor = self.txn.cursor(db=self.tier._lru)
        start = b""
        while cursor.set_range(start):
            stamp = bytes(cursor.key())
            key = stamp[_STAMP.size:]
            if self.txn.get(key, db=self.tier._pins) is not None:
                start = stamp + b"\0"  # the next record after this one (records are fixed-length)
                continue
            yield key
            start = stamp

    def make_room(self, need: int, limit: int, need_pages: int = 0) -> bool:
        """Evict least recently accessed unpinned entries until ``need`` more bytes fit in ``limit``
        and ``need_pages`` more pages in the map's headroom limit."""
        if need + self.pinned > limit or need_pages > self.tier._page_limit:
            return False
        victims = self.victims()
        while self.total + need > limit or self.pages() + need_pages > self.tier._page_limit:
            key = next(victims, None)
            if key is None:
                break
            self.remove(key)
            self.evicted.append(key)
            self.counts["evictions"] += 1
        return self.total + need <= limit and self.pages() + need_pages <= self.tier._page_limit

    def pages(self) -> int:
        """Pages the databases take now (B-tree and overflow pages).  O(databases)."""
        total = 0
        for db in self.tier._dbs:
            st = self.txn.stat(db)
            total += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return total

    def evict_some(self, count: int) -> int:
        """Evict up to ``count`` least recently accessed unpinned entries; how many."""
        done = 0
        for key in self.victims():
            if done >= count:
                break
            self.remove(key)
            self.evicted.append(key)
            done += 1
        self.counts["evictions"] += done
        return done

    def purge_expired(self, limit: int | None = _PURGE_PER_WRITE) -> int:
        """Delete up to ``limit`` expired entries (all with ``None``), oldest expiry first."""
        cursor = self.txn.cursor(db=self.tier._expiry)
        removed = 0
        while (limit is None or removed < limit) and cursor.first():
            stamp = bytes(cursor.key())
            if _STAMP.unpack_from(stamp)[0] > self.now:
                break
            self.remove(stamp[_STAMP.size:])
            self.evicted.append(stamp[_STAMP.size:])
            removed += 1
        self.counts["expired"] += removed
        return removed

    def apply_touches(self, touches: dict[bytes, int]) -> None:
        tier, txn = self.tier, self.txn
        for key, stamp in touches.items():
            raw = txn.get(key, db=tier._meta)
            if raw is None:
                continue
            size, access, expiry = _META.unpack(raw)
            if stamp <= access:
                continue
            txn.delete(_STAMP.pack(access) + key, db=tier._lru)
            txn.put(_STAMP.pack(stamp) + key, b"", db=tier._lru)
            txn.put(key, _META.pack(size, stamp, expiry), db=tier._meta)

    def finish(self) -> None:
        self.txn.put(_TOTAL, self.total.to_bytes(8, "little"), db=self.tier._info)
        self.txn.put(_PINNED, self.pinned.to_bytes(8, "little"), db=self.tier._info)


class _SecondHit:
    """The keys seen once, the last ``memory`` of them: ``radixkv.core.policy.SecondHit``'s filter
    without its ordering (the databases keep the order), plus a sighting that admits nothing (a
    read miss).  Not thread-safe.  O(1) per call."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.seen: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def saw(self, key: bytes) -> None:
        """Remember a sighting of ``key``."""
        self.seen[key] = None
        self.seen.move_to_end(key)
        while len(self.seen) > self.memory:
            self.seen.popitem(last=False)

    def admit(self, key: bytes) -> bool:
        """Whether ``key`` was seen before (then it is forgotten); otherwise remember it."""
        if self.seen.pop(key, False) is None:
            return True
        self.saw(key)
        return False


def _pages_of(size: int) -> int:
    """Map pages a blob of ``size`` bytes takes, about: its overflow pages (or its share of a leaf)
    and the share of its index records."""
    return -(-(size + 64) // 4096) + 1


class LmdbTier(Tier):
    """Local-disk tier in one LMDB environment; see the module docstring for the storage contract.

    ``max_bytes``: byte budget of the blobs.  ``ttl``: seconds an entry lives after it is written
    (``None``: forever).  ``map_size``: LMDB's map ceiling (default ``2 * max_bytes + 8 MiB``).
    ``max_readers``: concurrent read transactions over all processes.  ``sync``: fsync at every
    commit (durable across power loss; ``False`` keeps integrity across process crashes only).
    ``clock``: wall-clock seconds.  ``touch_every``/``touch_seconds``: access-time batching.
    ``file_mode``/``dir_mode``: permissions of the files and of the directory when this creates it.
    ``max_pinned``: bound on pinned bytes, a fraction of ``max_bytes`` (a float in ``[0, 1]``,
    default ``0.5``) or bytes (an int); each process enforces its own when it pins.
    ``admission``: ``None`` (store every put) or ``"second_hit"`` (store a new key the second time
    it is seen, remembering the last ``admission_memory`` keys seen; see the module docstring).
    """

    name = "lmdb"

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, *, ttl: float | None = None,
                 map_size: int | None = None, max_readers: int = 512, sync: bool = True,
                 clock: Callable[[], float] = time.time, touch_every: int = 64,
                 touch_seconds: float = 1.0, file_mode: int = 0o600, dir_mode: int = 0o700,
                 max_pinned: float | int | None = None, admission: str | None = None,
                 admission_memory: int = 4096) -> None:
        self._lmdb = _import_lmdb()
        check_int(max_bytes, "max_bytes")
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be positive seconds or None, got {ttl!r}")
        if map_size is None:
            map_size = 2 * max_bytes + (8 << 20)
        check_int(map_size, "map_size", 64 << 10)
        if not isinstance(touch_every, int) or touch_every < 1:
            raise ValueError(f"touch_every must be a positive int, got {touch_every!r}")
        for name, mode in (("file_mode", file_mode), ("dir_mode", dir_mode)):
            if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
                raise ValueError(f"{name} must be permission bits like 0o600, got {mode!r}")
        if max_pinned is None:
            max_pinned = 0.5
        if isinstance(max_pinned, float) and 0.0 <= max_pinned <= 1.0:
            self._max_pinned = int(max_pinned * max_bytes)
        elif isinstance(max_pinned, float):
            raise ValueError(f"max_pinned must be a fraction in [0, 1] or an int of bytes, got {max_pinned!r}")
        else:
            self._max_pinned = min(check_int(max_pinned, "max_pinned"), max_bytes)
        if admission not in (None, "second_hit"):
            raise ValueError(f"admission must be None or 'second_hit', got {admission!r}")
        check_int(admission_memory, "admission_memory", 1)
        self._admission = None if admission is None else _SecondHit(admission_memory)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a directory path (str or os.PathLike), got {type(path).__name__}")
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path: {self.path!r} is a file, not a directory (LMDB keeps data.mdb and lock.mdb "
                             f"in a directory)")
        if not os.path.isdir(self.path):
            os.makedirs(self.path, mode=dir_mode, exist_ok=True)     # a fault of the disk: OSError
            os.chmod(self.path, dir_mode)  # makedirs' mode is filtered by the umask
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._max_bytes = max_bytes
        self._ttl_us = None if ttl is None else int(ttl * 1e6)
        self._map_size = -(-map_size // 4096) * 4096
        self._page_limit = int(self._map_size // 4096 * _HEADROOM)  # refined from the page size at open
        self._max_readers = max_readers
        self._sync = sync
        self._clock = clock
        self._touch_every = touch_every
        self._touch_seconds = touch_seconds
        self._counts: Counter[str] = Counter()
        self._evicted = EvictionLog()
        self._closed = False
        self._env: Any = None
        self._forget_parent_environment()
        self._environment()
        _OPEN_TIERS.add(self)
        if self.used_bytes > max_bytes:  # reopened with a smaller budget
            self._write(self._shrink)

    def _shrink(self, writer: _Writer) -> None:
        """Fit the entries in ``max_bytes``, unpinning them all if the pins alone do not fit."""
        if not writer.make_room(0, self._max_bytes):
            writer.drop_all_pins()
            writer.make_room(0, self._max_bytes)

    # -- environment --------------------------------------------------------------------------

    def _forget_parent_environment(self) -> None:
        """Fresh per-process state; in a forked child the inherited environment was closed by the
        at-fork hook (or is dropped here), and the tier opens its own on first use."""
        self._lock = threading.Lock()
        self._admit_lock = threading.Lock()  # _SecondHit is not thread-safe
        self._pending: dict[bytes, int] = {}
        self._last_flush = time.monotonic()
        self._env = None
        self._pid = os.getpid()

    def _environment(self) -> Any:
        if self._closed:
            raise RuntimeError(f"LmdbTier({self.path!r}) is closed")
        if self._pid != os.getpid():  # forked without the at-fork hook (e.g. from C)
            if _envs_pid != os.getpid():
                _drop_inherited_environments()
            self._forget_parent_environment()
        env = self._env
        if env is not None:
            return env
        with self._lock:
            if self._env is None:
                shared = self._acquire()
                self._data, self._meta, self._lru, self._expiry, self._info, self._pins = shared.dbs
                self._dbs = shared.dbs
                psize = shared.env.stat()["psize"]
                self._page_limit = int(shared.env.info()["map_size"] // psize * _HEADROOM)
                self._env = shared.env
            return self._env

    def _acquire(self) -> _SharedEnv:
        """This process's environment of ``path`` (opened by the first tier that asks), with one
        more user."""
        real = os.path.realpath(self.path)
        with _ENVS_LOCK:
            shared = _ENVS.get(real)
            if shared is None:
                old_umask = os.umask(0o777 & ~self._file_mode)  # LMDB creates its files with this mask
                try:
                    env = self._lmdb.open(self.path, map_size=self._map_size, max_readers=self._max_readers,
                                          max_dbs=6, subdir=True, lock=True, readahead=False, meminit=False,
                                          sync=self._sync, metasync=False, mode=self._file_mode)
                finally:
                    os.umask(old_umask)
                self._counts["stale_readers_cleared"] += env.reader_check()
                with env.begin(write=True) as txn:
                    dbs = tuple(env.open_db(name, txn=txn) for name in (b"chunks", b"meta", b"lru", b"expiry", b"info",
                                                                          b"pins"))
                shared = _ENVS[real] = _SharedEnv(env, dbs)
            shared.users += 1
            return shared

    def _release(self) -> None:
        """One user less of the shared environment; the last one closes it."""
        real = os.path.realpath(self.path)
        with _ENVS_LOCK:
            shared = _ENVS.get(real)
            if shared is None or shared.env is not self._env:
                return
            shared.users -= 1
            if shared.users <= 0:
                del _ENVS[real]
                shared.env.close()

    @contextmanager
    def _begin(self, write: bool = False, buffers: bool = False) -> Iterator[Any]:
        """A transaction, counted as live for the fork gate; committed if the block succeeds."""
        _enter_txn()
        try:
            env = self._environment()
            try:
                txn = env.begin(write=write, buffers=buffers)
            except self._lmdb.MapResizedError:  # another process grew the map: adopt its size
                env.set_mapsize(0)
                txn = env.begin(write=write, buffers=buffers)
            with txn:
                yield txn
        finally:
            _leave_txn()

    def _now_us(self) -> int:
        return int(self._clock() * 1e6)

    def _live(self, meta: Any, now: int) -> bool:
        if meta is None:
            return False
        expiry = _META.unpack(meta)[2]
        return not expiry or expiry > now

    # -- writes -------------------------------------------------------------------------------

    def _write(self, body: Callable[[_Writer], T], need: int = 0) -> T:
        """Run ``body`` in one write transaction, with pending touches and expiry purging.  On a
        full map: clear stale readers, evict in small committed transactions, and retry."""
        for attempt in range(_WRITE_ATTEMPTS):
            with self._lock:
                touches, self._pending = self._pending, {}
                self._last_flush = time.monotonic()
            try:
                with self._begin(write=True) as txn:
                    writer = _Writer(self, txn)
                    writer.apply_touches(touches)
                    writer.purge_expired()
                    result = body(writer)
                    writer.finish()
            except self._lmdb.MapFullError:
                with self._lock:
                    self._counts["map_full"] += 1
                    for key, stamp in touches.items():  # not applied: keep them for the retry
                        self._pending.setdefault(key, stamp)
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                self._make_map_room(need)
                continue
            with self._lock:
                self._counts.update(writer.counts)
            self._evicted.note(writer.evicted)
            return result
        raise AssertionError("unreachable")

    def _make_map_room(self, need: int) -> None:
        """Free map pages after ``MDB_MAP_FULL``: evict LRU entries (about a quarter of them, and at
        least ``need`` bytes) in transactions small enough to commit in a full map — halving the
        batch down to one entry when even that is too much — and empty the map as a last resort."""
        env = self._environment()
        with self._lock:
            self._counts["stale_readers_cleared"] += env.reader_check()
        with self._begin() as txn:
            entries = txn.stat(self._meta)["entries"]
        goal, freed, batch = max(1, entries // 4), 0, _EVICT_BATCH
        while freed < goal:
            try:
                with self._begin(write=True) as txn:
                    writer = _Writer(self, txn)
                    done = writer.evict_some(min(batch, goal - freed))
                    writer.finish()
            except self._lmdb.MapFullError:
                if batch > 1:
                    batch //= 2
                    continue
                self._reset_map()
                return
            with self._lock:
                self._counts.update(writer.counts)
            self._evicted.note(writer.evicted)
            if not done:
                break
            freed += done

    def _reset_map(self) -> None:
        """Empty every database in one transaction (dropping a database needs almost no pages),
        ``pins`` and the totals in ``info`` included: no pin outlives its entry."""
        with self._begin(write=True) as txn:
            for db in self._dbs:
                txn.drop(db, delete=False)
        with self._lock:
            self._counts["map_resets"] += 1
        self._evicted.lose_track()

    def put(self, key: bytes, blob: Blob) -> bool:
        """Store ``blob`` (one write transaction; evicts unpinned LRU entries to fit).  A blob over
        the budget (or refused by ``admission``) is not stored and any older blob under ``key`` is
        removed.  A pinned key stays pinned (unless its new size would pass ``max_pinned``:
        ``pins_dropped``).  Raises on a map that stays full after evicting."""
        return self.put_many([(key, blob)]) == 1

    def put_many(self, items: Iterable[tuple[bytes, Blob]]) -> int:
        """Store every item in one write transaction; the number stored.  O(items + evictions)
        B-tree updates and one commit (one fsync when ``sync``)."""
        prepared = [(check_key(key), blob_view(blob)) for key, blob in items]
        if not prepared:
            return 0
        admitted: dict[int, bool] = {}  # decided once, so that a retried transaction decides alike

        def body(writer: _Writer) -> int:
            stored = 0
            for i, (key, view) in enumerate(prepared):
                if self._admission is not None and not self._live(writer.txn.get(key, db=self._meta), writer.now):
                    if i not in admitted:
                        with self._admit_lock:
                            admitted[i] = self._admission.admit(key)
                    if not admitted[i]:
                        writer.remove(key)  # an expired entry
                        writer.counts["rejected"] += 1
                        writer.counts["not_admitted"] += 1
                        continue
                pinned = writer.pinned_live(key)
                writer.remove(key)
                if not writer.make_room(len(view), self._max_bytes, _pages_of(len(view))):
                    writer.counts["rejected"] += 1
                    continue
                writer.insert(key, view)
                if pinned:
                    if writer.pinned + len(view) <= self._max_pinned:
                        writer.add_pin(key, len(view))
                    else:
                        writer.counts["pins_dropped"] += 1
                stored += 1
            writer.counts["puts"] += len(prepared)
            return stored

        return self._write(body, need=sum(len(v) for _, v in prepared))

    def delete(self, key: bytes) -> bool:
        """Remove ``key``.  One write transaction."""
        check_key(key)
        return self._write(lambda writer: writer.remove(key) is not None)

    def drop_namespace(self, ns_id: bytes) -> int:
        """Remove every key of the namespace in one write transaction.  O(entries of it)."""
        check_namespace_id(ns_id)

        def body(writer: _Writer) -> int:
            cursor = writer.txn.cursor(db=self._data)
            doomed = []
            if cursor.set_range(ns_id):
                for key in cursor.iternext(values=False):
                    if not bytes(key).startswith(ns_id):
                        break
                    doomed.append(bytes(key))
            for key in doomed:
                writer.remove(key)
            return len(doomed)

        return self._write(body)

    def take_evicted(self) -> list[bytes] | None:
        """The keys this process's writes evicted or purged as expired since the last call
        (``Tier.take_evicted``; other processes' evictions are theirs to tell).  O(keys)."""
        return self._evicted.take()

    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin the leading ``keys`` the tier holds (unexpired), in the ``pins`` database: never
        evicted, for every process, until ``unpin``; the number of leading keys pinned now
        (already pinned ones count).  It stops at the first key not held, or whose bytes would take
        the pinned bytes past ``max_pinned`` (counted in ``pins_refused``) — fewer than
        ``len(keys)`` says so.  Not an access.  One write transaction (none for no keys);
        O(len(keys)) lookups."""
        keys = [check_key(k) for k in keys]
        if not keys:
            return 0

        def body(writer: _Writer) -> int:
            for n, key in enumerate(keys):
                meta = writer.txn.get(key, db=self._meta)
                if not self._live(meta, writer.now):
                    return n
                if writer.txn.get(key, db=self._pins) is not None:
                    continue
                size = _META.unpack(meta)[0]
                if writer.pinned + size > self._max_pinned:
                    writer.counts["pins_refused"] += 1
                    return n
                writer.add_pin(key, size)
            return len(keys)

        return self._write(body)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Let ``keys`` be evicted again; how many of them were pinned.  One read transaction, and
        one write transaction if any was.  O(len(keys))."""
        keys = [check_key(k) for k in keys]
        with self._begin() as txn:
            if not any(txn.get(key, db=self._pins) is not None for key in keys):
                return 0
        return self._write(lambda writer: sum(writer.drop_pin(key) for key in dict.fromkeys(keys)))

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """The live entries (of ``ns_id``), in key order, each with its last access time (as
        recorded: accesses are batched) and its pin; a snapshot from one read transaction.
        O(entries)."""
        if ns_id is not None:
            check_namespace_id(ns_id)
        now = self._now_us()
        held: list[Entry] = []
        with self._begin() as txn:
            cursor = txn.cursor(db=self._meta)
            if cursor.set_range(ns_id or b""):
                for key, meta in cursor:
                    key = bytes(key)
                    if ns_id is not None and not key.startswith(ns_id):
                        break
                    if self._live(meta, now):
                        size, access, _ = _META.unpack(meta)
                        held.append(Entry(key, size, access / 1e6, txn.get(key, db=self._pins) is not None))
        return iter(held)

    def purge_expired(self) -> int:
        """Delete every expired entry now, in one write transaction; how many (besides those
        every write deletes anyway, a bounded number at a time)."""
        return self._write(lambda writer: writer.purge_expired(limit=None))

    # -- reads --------------------------------------------------------------------------------

    def _touched(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        now = self._now_us()
        with self._lock:
            for key in keys:
                self._pending[key] = now
            due = (len(self._pending) >= self._touch_every
                   or time.monotonic() - self._last_flush >= self._touch_seconds)
        if due:
            try:
                self._write(lambda writer: None)
            except self._lmdb.Error:  # access times are hints: a failed flush must not fail a read
                with self._lock:
                    self._counts["touch_errors"] += 1

    def _count(self, hits: int, misses: int) -> None:
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += misses

    def get(self, key: bytes) -> bytes | None:
        """A copy of the blob, or ``None`` if absent or expired.  One read transaction."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """Copies of the blobs, in one read transaction."""
        for key in keys:
            check_key(key)
        now = self._now_us()
        with self._begin() as txn:
            blobs: list[Blob | None] = [txn.get(key, db=self._data) if self._live(txn.get(key, db=self._meta), now)
                                        else None for key in keys]
        found = [key for key, blob in zip(keys, blobs) if blob is not None]
        self._count(len(found), len(keys) - len(found))
        self._seen([key for key, blob in zip(keys, blobs) if blob is None])
        self._touched(found)
        return blobs

    def _seen(self, missed: Sequence[bytes]) -> None:
        """Reads missed ``missed``: with ``admission``, their next put is their second sighting."""
        if self._admission is not None and missed:
            with self._admit_lock:
                for key in missed:
                    self._admission.saw(key)

    def read(self, key: bytes, consume: Callable[[memoryview], T]) -> T | None:
        """``consume`` on the mapped page itself (no copy), inside one read transaction.  Keep it
        short: a long read transaction holds old pages from reuse.  ``consume`` must not call
        back into the tier."""
        check_key(key)
        now = self._now_us()
        found = False
        try:
            with self._begin(buffers=True) as txn:
                blob = txn.get(key, db=self._data) if self._live(txn.get(key, db=self._meta), now) else None
                found = blob is not None
                result = None if blob is None else consume(blob)
        finally:  # an access even when ``consume`` raises: the blob was read
            self._count(found, not found)
            if found:
                self._touched([key])
            else:
                self._seen([key])
        return result

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading live keys held, in one read transaction; not an access."""
        for key in keys:
            check_key(key)
        now = self._now_us()
        with self._begin() as txn:
            for n, key in enumerate(keys):
                if not self._live(txn.get(key, db=self._meta), now):
                    return n
        return len(keys)

    @property
    def used_bytes(self) -> int:
        """Blob bytes stored, by the shared total.  One read transaction."""
        with self._begin() as txn:
            raw = txn.get(_TOTAL, db=self._info)
        return 0 if raw is None else int.from_bytes(raw, "little")

    @property
    def capacity_bytes(self) -> int:
        """``max_bytes``: the budget of blob bytes (LMDB's page overhead comes on top, within
        ``map_size``).  O(1)."""
        return self._max_bytes

    def stats(self) -> dict[str, int | float]:
        """This object's counters (those that happened: ``hits``, ``misses``, ``evictions``, ``expired``,
        ``map_full``, ...) with the environment's shared ``entries``, ``pinned`` (entries pinned),
        ``pinned_bytes`` and ``used_bytes``, the limits (``max_pinned_bytes``, ``capacity_bytes``,
        ``page_limit``, ``limit_bytes``, ``map_size``) and ``pending_touches`` (accesses not written
        yet).  Two read transactions."""
        used = self.used_bytes
        with self._begin() as txn:
            entries = txn.stat(self._meta)["entries"]
            pinned = txn.stat(self._pins)["entries"]
            raw = txn.get(_PINNED, db=self._info)
        with self._lock:
            return {**self._counts, "entries": entries, "pinned": pinned,
                    "pinned_bytes": 0 if raw is None else int.from_bytes(raw, "little"),
                    "max_pinned_bytes": self._max_pinned, "used_bytes": used, "capacity_bytes": self._max_bytes,
                    "page_limit": self._page_limit,
                    "limit_bytes": min(self._max_bytes, self._page_limit * 4096), "map_size": self._map_size, "pending_touches": len(self._pending)}

    def close(self) -> None:
        """Apply pending access times and let go of the environment (closed with its last tier
        in this process).  Idempotent."""
        if self._closed:
            return
        try:
            if self._pending and self._pid == os.getpid():
                self._write(lambda writer: None)
        finally:
            self._closed = True
            _OPEN_TIERS.discard(self)
            if self._env is not None and self._pid == os.getpid():
                self._release()
            self._env = None

    def check(self) -> None:
        """Every entry has its blob, size, LRU and expiry records, and the total adds up; every
        pin is of an entry, of its size, and the pinned total adds up.  O(entries), one read
        transaction."""
        super().check()
        with self._begin() as txn:
            raw = txn.get(_TOTAL, db=self._info)
            total = 0 if raw is None else int.from_bytes(raw, "little")
            entries = expiring = size_sum = 0
            for key, value in txn.cursor(db=self._meta):
                size, access, expiry = _META.unpack(value)
                blob = txn.get(key, db=self._data)
                name = key.hex()
                assert len(key) == 24 and blob is not None and len(blob) == size, f"{name}: no blob of its size"
                assert txn.get(_STAMP.pack(access) + key, db=self._lru) is not None, f"{name}: not in the LRU index"
                assert not expiry or txn.get(_STAMP.pack(expiry) + key, db=self._expiry) is not None, \
                    f"{name}: not in the expiry index"
                entries += 1
                expiring += bool(expiry)
                size_sum += size
            assert size_sum == total, f"byte total {total} != sum of entry sizes {size_sum}"
            assert txn.stat(self._data)["entries"] == entries, "blobs without metadata"
            assert txn.stat(self._lru)["entries"] == entries, "stale LRU records"
            assert txn.stat(self._expiry)["entries"] == expiring, "stale expiry records"
            raw = txn.get(_PINNED, db=self._info)
            pinned_total = 0 if raw is None else int.from_bytes(raw, "little")
            pinned_sum = 0
            for key, value in txn.cursor(db=self._pins):
                meta = txn.get(key, db=self._meta)
                assert meta is not None, f"{key.hex()}: a pin without an entry"
                assert _SIZE.unpack(value)[0] == _META.unpack(meta)[0], f"{key.hex()}: pinned at another size"
                pinned_sum += _SIZE.unpack(value)[0]
            assert pinned_sum == pinned_total, f"pinned total {pinned_total} != sum of pinned sizes {pinned_sum}"
            assert pinned_total <= total, f"pinned bytes {pinned_total} over the byte total {total}"
