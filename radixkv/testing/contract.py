"""The tier contract: a differential state machine every storage tier must pass, its strategies,
a manual clock, and wrappers that inject faults into a tier or record what reached it.

Run your own backend against it, inside a pytest test (``tmp_path`` works)::

    from radixkv.testing import TierContract

    def test_my_tier(tmp_path):
        TierContract.check(lambda path: MyTier(path, max_bytes=1200), tmp_path=tmp_path, lru=True)

or as a class, collected by pytest or unittest (``make_tier`` runs lazily, at the first step)::

    class MyTierContract(TierContract):
        lru = True                                # knobs: see the class docstring
        def make_tier(self):
            return MyTier(self.path, max_bytes=1200)   # self.path: a fresh directory per example

    TestMyTier = MyTierContract.TestCase

Keep the tier small (a few times ``max_blob``, 300 bytes by default) so that eviction happens:
the ``fill`` rule writes a whole namespace of ``max_blob`` blobs, more than such a tier holds.

What the machine checks, against a model of every key it put (every blob is unique: its first
bytes name its key and version, so a failure says *which* older or foreign blob came back):

* **Values**: a key the tier holds reads back (``get``, ``get_many``, ``read``) as the last blob put
  under it, byte for byte — never an older, foreign or torn one; reads are biased toward held keys.
* **Read-back**: a put that returns ``True`` is held right after; a put that returns ``False``
  leaves no older blob behind.  ``should_store(size)`` says which puts must succeed or fail.
* **Nothing vanishes without a reason**: a key disappears only by ``delete``/``drop_namespace``,
  by TTL expiry, or by eviction during a put (never during a read or a lookup).  With
  ``used_bytes_exact``, a put evicts no more than it needs; with ``lru``, the evicted keys are the
  least recently used (``get``/``read``/``put`` are accesses, ``contains_prefix`` is not).
* **TTL** (``ttl`` seconds): the tier must read time from ``self.clock`` (pass it to the tier);
  the machine advances it.  An entry is held until ``ttl`` after it was written (reads do not
  extend it) and is a miss from then on.
* **Stats**: counters the model can predict — ``hits``, ``misses``, ``puts``, ``rejected``,
  ``evictions`` (when the tier reports them), ``entries``, ``used_bytes`` — agree with it, as
  ``Tier.stats`` defines them.  ``evictions`` counts the live entries a put removed to make room;
  whether an expired entry the tier drops counts too is the tier's choice, so while entries that
  may have expired may still be stored, ``evictions`` may grow by up to one more for each of them
  (each counted once at most over the run), and ``entries`` and ``used_bytes`` (with
  ``used_bytes_exact``) may include them.  Without a ``ttl`` all three are exact.
* **Namespaces** share all but one byte (and chunk keys come in pairs that differ in their last
  byte), so a tier that compares part of a key or of a namespace id is caught.
* **Buffers**: the caller's buffer is overwritten right after ``put`` (the tier must have copied
  it); a buffer from ``get`` stays unchanged while the tier is written; ``read``'s ``consume``
  result and exceptions pass through; with ``reentrant_consume``, ``consume`` writes to the tier
  and its buffer must not change meanwhile.
* **Threads**: a burst of ``threads`` threads of put/get/read/lookup/delete, then every read must
  have returned a blob put under its key, and ``check()`` and the model must hold.
* **Pins**: ``pin(keys)`` answers how many leading keys it pinned (a tier that cannot pin says
  0); a key pinned while held is never evicted until ``unpin`` (or its delete, ``drop_namespace``
  or TTL expiry, after which a tier may or may not keep the mark), and ``unpin`` counts at least
  those.  A tier may drop the pin of an entry that a put makes larger (it bounds pinned bytes),
  and pins may or may not outlive ``close`` (``reopen``).  The ``lru`` order is checked among the
  keys that may not be pinned.  Pins must not fill the tier: ``should_store``'s puts still succeed
  while keys are pinned.
* ``close()`` twice is fine; the tier's own ``check()`` runs after every step.

Persistent tiers subclass ``PersistentTierContract`` (or set ``persistent = True``): it adds a
``reopen`` rule — close, build a new tier on the same ``path``, nothing lost or resurrected.
"""

from __future__ import annotations

import inspect
import itertools
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Sequence

import hypothesis
import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from radixkv.backends import Blob, Tier

__all__ = ["Clock", "FaultyTier", "PersistentTierContract", "RecordingTier", "TierContract", "TierFault",
           "blobs", "key_universe", "make_blob", "namespace_ids", "tier_keys"]

_FLIPS = (None, 7, 0, 3, 1, 6, 2, 5, 4)   # byte flipped in the i-th namespace id (None: the base id)
_HEAD = 12                                 # blob header: 8-byte tag of (key, version), 4-byte version


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def namespace_ids(count: int = 3) -> list[bytes]:
    """``count`` fixed 8-byte namespace ids that share all but one byte with the first (the byte
    that differs moves: the last, the first, a middle one, ...), so that a tier comparing only
    part of an id is caught.  Beyond nine, ids are hashes."""
    base = xxhash.xxh3_64_digest(b"radixkv/testing/ns")
    out = []
    for i in range(count):
        flip = _FLIPS[i] if i < len(_FLIPS) else None
        out.append(base if i == 0 else _flip(base, flip) if flip is not None
                   else xxhash.xxh3_64_digest(b"radixkv/testing/ns/%d" % i))
    return out


def key_universe(namespaces: int = 3, per_namespace: int = 6) -> dict[str, bytes]:
    """Readable names (``"ns1/k3"``) of a fixed universe of 24-byte tier keys.  Every namespace
    has the same 16-byte chunk keys, and keys ``k2i`` and ``k2i+1`` differ only in their last byte."""
    out = {}
    for n, ns in enumerate(namespace_ids(namespaces)):
        for j in range(per_namespace):
            chunk = xxhash.xxh3_128_digest(b"radixkv/testing/key/%d" % (j // 2))
            out[f"ns{n}/k{j}"] = ns + (_flip(chunk, 15) if j % 2 else chunk)
    return out


def tier_keys(namespaces: int = 3, per_namespace: int = 6) -> st.SearchStrategy[bytes]:
    """24-byte tier keys from ``key_universe(namespaces, per_namespace)``."""
    return st.sampled_from(list(key_universe(namespaces, per_namespace).values()))


def blobs(max_size: int = 300) -> st.SearchStrategy[bytes]:
    """Blobs of 0 to ``max_size`` bytes, each tagged with a hash of itself, so that two blobs put
    under one key almost surely differ even when hypothesis draws them small."""
    sizes = st.integers(0, max(0, max_size - 8))  # uniform sizes: st.binary alone rarely draws big ones
    return sizes.flatmap(lambda n: st.binary(min_size=n, max_size=n)).map(lambda b: xxhash.xxh3_64_digest(b) + b)


def make_blob(key: bytes, version: int, size: int) -> bytes:
    """A ``size``-byte blob that names its key and version in its first 12 bytes (a tag and the
    version), then filler; distinct for every (key, version) while ``size >= 4``.  O(size)."""
    tag = xxhash.xxh3_64_digest(key + version.to_bytes(8, "little"))
    head = tag + (version & 0xFFFFFFFF).to_bytes(4, "little")
    fill = xxhash.xxh3_128_digest(head) * (size // 16 + 1)
    return (head + fill)[:size]


class Clock:
    """A manual clock for tiers with a TTL or time-stamped LRU: call it for the time in seconds.

    ``tick()`` moves it by ``step`` seconds (the machine ticks before every call it makes, so no two
    accesses share a time stamp); ``advance(seconds)`` jumps.  Kept in whole microseconds, so the
    time never goes back by a rounding error.  Thread-safe to read.
    """

    def __init__(self, start: float = 1_000_000.0, step: float = 0.001) -> None:
        self._us = int(start * 1e6)
        self.step_us = max(1, int(step * 1e6))

    def __call__(self) -> float:
        return self._us / 1e6

    def tick(self) -> None:
        """Move on by one ``step``.  O(1)."""
        self._us += self.step_us

    def advance(self, seconds: float) -> None:
        """Move on by ``seconds`` (``ValueError`` if negative).  O(1)."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self._us += int(seconds * 1e6)

    def __repr__(self) -> str:
        return f"Clock({self():.6f})"


_NOT_TRACED = (sysconfig.get_paths()["stdlib"], os.path.dirname(hypothesis.__file__), os.path.dirname(__file__))


def _preempter(seed: int) -> Callable[..., Any]:
    """A trace function for the burst's threads that yields the interpreter (``time.sleep(0)``) at
    random lines of code outside the standard library, hypothesis and this package: the GIL
    otherwise hides most races of a pure-Python tier that forgot its lock."""
    rng = random.Random(seed)

    def line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and rng.random() < 0.1:
            time.sleep(0)
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return None if frame.f_code.co_filename.startswith(_NOT_TRACED) else line

    return call


class _Boom(Exception):
    """Raised by a ``consume`` to check that ``read`` lets it through."""


def _fail(message: str) -> None:
    raise AssertionError(message)


def _bytes_form(blob: bytes, form: str) -> Blob:
    if form == "bytearray":
        return bytearray(blob)
    if form == "memoryview":
        return memoryview(bytearray(blob))
    return blob


def _scribble(buf: Blob) -> None:
    """Overwrite a caller's mutable buffer, as an engine reusing it would."""
    if isinstance(buf, (bytearray, memoryview)) and not memoryview(buf).readonly:
        view = memoryview(buf).cast("B")
        view[:] = b"\x5a" * len(view)


_KNOBS = ("namespaces", "keys_per_namespace", "max_blob", "min_blob", "exact", "persistent", "lru", "ttl",
          "used_bytes_exact", "reentrant_consume", "threads", "burst_ops", "base_dir")


class TierContract(RuleBasedStateMachine):
    """Drive ``make_tier()`` with every ``Tier`` operation and check it against a model of what
    was put (see the module docstring for what is checked).

    Class knobs (or keyword arguments of ``check``):

    * ``namespaces``, ``keys_per_namespace`` — the key universe (3 x 6); ``min_blob``/``max_blob`` —
      blob sizes in bytes (8..300).
    * ``exact`` — the tier never evicts or expires: it must hold every key put and not deleted.
    * ``lru`` — the tier evicts least recently used keys first (reads and writes are accesses).
    * ``used_bytes_exact`` — ``used_bytes`` is the sum of ``entry_bytes(len(blob))`` over the keys
      held (then a put must not evict more than it needs).
    * ``ttl`` — entries expire ``ttl`` seconds after they are written, by ``self.clock``.
    * ``reentrant_consume`` — ``read``'s ``consume`` may call back into the tier.
    * ``threads``, ``burst_ops`` — the concurrent burst (0 threads: none).
    * ``persistent`` — see ``PersistentTierContract``.
    * ``base_dir`` — where ``self.path`` directories are made (default: the system's temp dir).

    Methods to override: ``make_tier`` (required: the tier under test; use ``self.path`` and
    ``self.clock`` as needed), ``should_store``, ``entry_bytes``, ``teardown`` (call ``super()``).
    Nothing runs in ``__init__`` but the model's setup: the tier is built at the first step.
    """

    namespaces: ClassVar[int] = 3
    keys_per_namespace: ClassVar[int] = 6
    max_blob: ClassVar[int] = 300
    min_blob: ClassVar[int] = 8
    exact: ClassVar[bool] = False
    persistent: ClassVar[bool] = False
    lru: ClassVar[bool] = False
    ttl: ClassVar[float | None] = None
    used_bytes_exact: ClassVar[bool] = False
    reentrant_consume: ClassVar[bool] = False
    threads: ClassVar[int] = 4
    burst_ops: ClassVar[int] = 24
    base_dir: ClassVar[str | Path | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.persistent and not hasattr(cls, "reopen"):   # ``persistent = True`` on a plain subclass
            cls.reopen = PersistentTierContract.reopen  # type: ignore[attr-defined]

    def __init__(self) -> None:
        super().__init__()
        self._tier: Tier | None = None
        self._capacity: int | None = None
        self._path: Path | None = None
        self.clock = Clock()
        self.names = key_universe(self.namespaces, self.keys_per_namespace)
        self.universe = list(self.names.values())
        self.name_of = {key: name for name, key in self.names.items()}
        self.ns_ids = namespace_ids(self.namespaces)
        self.values: dict[bytes, bytes] = {}          # key -> the last blob put under it (held or not)
        self.written: dict[bytes, tuple[int, int]] = {}   # key -> (earliest, latest) write time, µs
        self.stamps: dict[bytes, int] = {}            # key -> last access, µs (for lru)
        self.maybe_older: dict[bytes, int] = {}       # key -> earlier stamp, when the last access may not count
        self.held: set[bytes] = set()                 # keys the tier holds, as last observed
        self.pinned: set[bytes] = set()               # held keys pinned since, never deleted: must stay
        self.pin_marks: set[bytes] = set()            # keys a pin covered, until unpin (may be pinned)
        self.stale: dict[bytes, tuple[int, int]] = {}  # key -> (write µs, bytes): may have expired, may be stored
        self.stale_now: set[tuple[bytes, int]] = set()  # (key, write µs) of the entries stale during this step
        self.expired_entries = 0                      # entries that may have expired so far, each counted once
        self.extra_evictions = 0                      # evictions counted beyond the live entries evicted, so far
        self.blob_names: dict[bytes, str] = {}        # blob tag -> "version 3 of ns0/k1"
        self.versions = itertools.count(1)
        self.expected: Counter[str] = Counter()       # stats deltas the model predicts since the baseline
        self.unknown: set[str] = set()                # stats the model cannot predict this step
        self.baseline: dict[str, Any] | None = None
        self.relaxed = 0                              # > 0 inside a re-entrant consume
        self.observed_at = -1                         # clock time of the last observation, if still current
        self.step = "setup"

    # -- the tier and its resources ------------------------------------------------------------

    def make_tier(self) -> Tier:
        """The tier under test (override it).  Called at the first step, and again by ``reopen``."""
        raise NotImplementedError(f"{type(self).__name__}.make_tier: return the tier under test")

    @property
    def tier(self) -> Tier:
        """The tier under test, built by ``make_tier`` on first use."""
        if self._tier is None:
            self._tier = self._build()
            self._capacity = self._tier.capacity_bytes
            self.baseline = self._stats()
            observed = self._observe()
            if observed:
                _fail(f"a new tier already holds {self._names(observed)}: make_tier must give every example "
                      "fresh storage (use self.path, a new directory per example)")
        return self._tier

    @tier.setter
    def tier(self, value: Tier) -> None:
        self._tier = value
        self._capacity = value.capacity_bytes

    @property
    def capacity(self) -> int | None:
        """The tier's ``capacity_bytes`` (read once; builds the tier if needed)."""
        if self._tier is None:
            return self.tier.capacity_bytes
        return self._capacity

    def _build(self) -> Tier:
        tier = self.make_tier()
        if not isinstance(tier, Tier):
            _fail(f"make_tier returned {type(tier).__name__}, not a radixkv.backends.Tier")
        return tier

    @property
    def path(self) -> Path:
        """A fresh directory for this example's tier (the same one on ``reopen``), under
        ``base_dir``; removed by ``teardown``."""
        if self._path is None:
            base = None if self.base_dir is None else Path(self.base_dir)
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            self._path = Path(tempfile.mkdtemp(prefix="tier-contract-", dir=base))
        return self._path

    def should_store(self, size: int) -> bool | None:
        """Whether a put of a ``size``-byte blob must succeed (``True``), must be refused
        (``False``) or may go either way (``None``).  Default: unbounded tiers store everything;
        a bounded one stores blobs up to a quarter of its capacity and refuses those over it."""
        if self.capacity is None:
            return True
        if size > self.capacity:
            return False
        return True if size <= self.capacity // 4 else None

    def _fitting_size(self) -> int:
        """The largest blob size up to ``max_blob`` that ``should_store`` says must be stored."""
        for size in range(self.max_blob, self.min_blob - 1, -1):
            if self.should_store(size) is True:
                return size
        return self.min_blob

    def entry_bytes(self, size: int) -> int:
        """Bytes of ``used_bytes`` one entry of a ``size``-byte blob takes (for ``used_bytes_exact``);
        default ``size``.  A slotted tier returns its slot size."""
        return size

    def teardown(self) -> None:
        """Close the tier twice (``close`` must be idempotent) and remove ``self.path``."""
        try:
            if self._tier is not None:
                self._tier.close()
                try:
                    self._tier.close()
                except Exception as exc:  # noqa: BLE001 - reported as the contract's failure
                    raise AssertionError(f"a second close() raised {exc!r}: close must be idempotent") from exc
        finally:
            if self._path is not None:
                shutil.rmtree(self._path, ignore_errors=True)

    @classmethod
    def check(cls, factory: Callable[..., Tier] | None = None, *, tmp_path: str | Path | None = None,
              settings: Any = None, **knobs: Any) -> None:
        """Run the contract now, e.g. inside a pytest test.  ``factory`` builds the tier: it may take
        ``path`` (a fresh directory per example, under ``tmp_path``) and ``clock`` (the machine's
        ``Clock``), by those names or the path as its one positional argument.  ``knobs`` set
        class knobs (``lru=True``, ``ttl=5``, ...); ``settings`` are hypothesis settings (default:
        the loaded profile).  Raises what the first failing example raised."""
        unknown = sorted(set(knobs) - set(_KNOBS))
        if unknown:
            raise ValueError(f"knobs: {', '.join(unknown)} not among {', '.join(_KNOBS)}")
        attrs: dict[str, Any] = dict(knobs)
        if tmp_path is not None:
            attrs["base_dir"] = Path(tmp_path)
        if factory is not None:
            attrs["make_tier"] = _factory_method(factory)
        machine = type(cls.__name__, (cls,), attrs)
        run_state_machine_as_test(machine, settings=settings)

    # -- naming -----------------------------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        return self.name_of.get(key) or key.hex()

    def _names(self, keys: Iterable[bytes]) -> str:
        return "[" + ", ".join(sorted(self._name(k) for k in keys)) + "]"

    def _describe(self, blob: Any) -> str:
        data = bytes(blob)
        known = self.blob_names.get(data[:8]) if len(data) >= 8 else None
        return f"{len(data)} bytes ({known or 'never put: corrupt or torn'})"

    def _new_blob(self, key: bytes, size: int) -> bytes:
        version = next(self.versions)
        blob = make_blob(key, version, size)
        if len(blob) >= 8:
            self.blob_names[blob[:8]] = f"version {version} of {self._name(key)}"
        return blob

    # -- the model --------------------------------------------------------------------------------

    def _now(self) -> int:
        """Tick the clock before a call to the tier; the new time, µs."""
        self.clock.tick()
        self.observed_at = -1
        self._mark_stale()
        return self.clock._us

    def _mark_stale(self) -> None:
        """Note the held entries that may have expired by now: from here on the tier may drop them
        at any call, and count that in ``evictions`` or not (see ``Tier.stats``).  O(held)."""
        if self.ttl is None:
            return
        for key in self.held:
            if self._expiry(key) == "live":
                continue
            written = self.written[key][1]
            if self.stale.get(key, (None,))[0] != written:
                self.stale[key] = (written, self.entry_bytes(len(self.values[key])))
                self.expired_entries += 1
            self.stale_now.add((key, written))

    def _bytes_held(self) -> tuple[int, int]:
        """The bounds on ``used_bytes`` (with ``used_bytes_exact``): the entries held that are surely
        live take the lower; the upper adds those that may have expired, held or still stored."""
        sizes = {k: self.entry_bytes(len(self.values[k])) for k in self.held}
        lo = sum(size for k, size in sizes.items() if self._expiry(k) == "live")
        hi = sum(sizes.values()) + sum(size for k, (written, size) in self.stale.items()
                                       if not (k in sizes and self.written[k][1] == written))
        return lo, hi

    def _observe(self) -> set[bytes]:
        """The keys of the universe the tier holds, by one-key ``contains_prefix`` each (not an access)."""
        tier, out = self.tier, set()
        for key in self.universe:
            n = tier.contains_prefix([key])
            if type(n) is not int or n not in (0, 1):
                _fail(f"contains_prefix([{self._name(key)}]) returned {n!r}, not 0 or 1")
            if n:
                out.add(key)
        self.observed_at = self.clock._us      # nothing called the tier since: the invariant may reuse it
        return out

    def _expiry(self, key: bytes) -> str:
        """"live", "expired", or "either" (within a clock step of its expiry, or written at an
        uncertain time during a burst)."""
        if self.ttl is None or key not in self.written:
            return "live"
        lo, hi = self.written[key]
        ttl, now, eps = int(self.ttl * 1e6), self.clock._us, self.clock.step_us
        if now >= hi + ttl + eps:
            return "expired"
        return "live" if now < lo + ttl - eps else "either"

    def _reconcile(self, observed: set[bytes], may_evict: bool) -> set[bytes]:
        """Compare what the tier holds now with the model; return the keys it evicted."""
        self._mark_stale()                  # the clock may have jumped since the last call
        appeared = observed - self.held
        if appeared:
            _fail(f"after {self.step} the tier holds {self._names(appeared)}, which it did not hold before "
                  "and nobody put (deleted, dropped, refused or evicted keys must stay gone)")
        evicted = set()
        for key in self.held - observed:
            if self._expiry(key) != "live":
                continue
            if key in self.pinned:
                _fail(f"{self._name(key)}, pinned, vanished during {self.step}: a pinned key is never evicted")
            if not may_evict:
                _fail(f"{self._name(key)} vanished during {self.step}, which neither writes nor deletes it "
                      f"(written at {self.written.get(key)} µs, now {self.clock._us} µs, ttl {self.ttl})")
            if self.exact:
                _fail(f"exact tier lost {self._name(key)} during {self.step}")
            evicted.add(key)
        expired = [k for k in observed if self._expiry(k) == "expired"]
        if expired:
            _fail(f"after {self.step} the tier still holds {self._names(expired)}, expired by its ttl of "
                  f"{self.ttl} s (clock {self.clock()})")
        self.held = set(observed)
        self.pinned &= self.held
        return evicted

    def _check_eviction(self, evicted: set[bytes], fresh: set[bytes], exact_size: bool) -> None:
        """``evicted`` went during a put of ``fresh``: were they the least recently used, and no
        more than needed?"""
        if not evicted:
            return
        survivors = self.held - fresh

        def lo(k: bytes) -> int:
            return self.maybe_older.get(k, self.stamps.get(k, 0))

        newest = max(lo(k) for k in evicted)
        survivors -= self.pin_marks         # a pinned key is not in the LRU order
        if self.lru and survivors:
            oldest = min(survivors, key=lambda k: self.stamps.get(k, 0))
            if newest > self.stamps.get(oldest, 0):
                young = max(evicted, key=lo)
                _fail(f"lru: {self.step} evicted {self._name(young)} (last used at {newest} µs) but kept "
                      f"{self._name(oldest)} (last used at {self.stamps.get(oldest, 0)} µs, earlier)")
        if exact_size and self.used_bytes_exact and self.capacity is not None and not self.relaxed:
            used = self._bytes_held()[1]    # expired entries the tier still stores may take room too
            last = [k for k in evicted if not self.lru or self.stamps.get(k, 0) >= newest]
            room = max(self.entry_bytes(len(self.values[k])) for k in last)
            if used + room <= self.capacity:
                _fail(f"{self.step} evicted {self._names(evicted)}, more than it needed: {used} bytes are used "
                      f"now{' at most' if self.stale else ''} and {room} more would still fit in capacity "
                      f"{self.capacity}")

    def _expect_read(self, key: bytes, got: Any, how: str, stamp: int) -> None:
        """Check one read's answer against the model and count it."""
        if got is None:
            if key in self.held and self._expiry(key) == "live":
                _fail(f"{how} returned None for {self._name(key)}, which the tier holds (contains_prefix says so)")
            self.expected["misses"] += 1
            return
        if key not in self.held:
            _fail(f"{how} returned {self._describe(got)} for {self._name(key)}, which the tier does not hold "
                  "(deleted, evicted, refused or never put)")
        want = self.values[key]
        if bytes(got) != want:
            _fail(f"{how} returned {self._describe(got)} for {self._name(key)}, not its last blob "
                  f"({self._describe(want)}): stale or corrupt")
        self.expected["hits"] += 1
        self._touch(key, stamp)

    def _unpin_if_grown(self, key: bytes, size: int) -> None:
        """A put of ``size`` bytes under pinned ``key``: a tier that bounds its pinned bytes may drop
        the pin of an entry that grows, so it is only maybe pinned from now on (``pin_marks``)."""
        if key in self.pinned and self.entry_bytes(size) > self.entry_bytes(len(self.values[key])):
            self.pinned.discard(key)

    def _touch(self, key: bytes, stamp: int) -> None:
        self.maybe_older.pop(key, None)
        self.stamps[key] = stamp

    # -- operations through the model -----------------------------------------------------------

    def _put(self, key: bytes, size: int, form: str = "bytes") -> bool:
        tier = self.tier
        blob = self._new_blob(key, size)
        buf = _bytes_form(blob, form)
        want = None if self.relaxed else self.should_store(size)     # asked before: a put may change it
        now = self._now()
        stored = tier.put(key, buf)
        _scribble(buf)                      # the tier must have copied it
        how = f"put({self._name(key)}, {size} bytes as {form})"
        if not isinstance(stored, bool):
            _fail(f"{how} returned {stored!r}, not a bool")
        if want is not None and stored != want:
            _fail(f"{how} returned {stored}; a tier of capacity {self.capacity} must "
                  f"{'store' if want else 'refuse'} a {size}-byte blob (see should_store)")
        self.expected["puts"] += 1
        self.expected["rejected"] += not stored
        self._unpin_if_grown(key, size)
        self.held.discard(key)              # the old blob is gone either way
        if stored:
            self.values[key], self.written[key] = blob, (now, now)
            self._touch(key, now)
            self.held.add(key)
            self.stale.pop(key, None)       # replaced (a tier may keep an expired entry a delete or refusal missed)
        observed = self._observe()
        if stored and key not in observed:
            _fail(f"{how} returned True but the tier does not hold the key right after (contains_prefix is 0)")
        if not stored and key in observed:
            _fail(f"{how} was refused but left an older blob under {self._name(key)}")
        evicted = self._reconcile(observed, may_evict=True)
        self.expected["evictions"] += len(evicted)
        self._check_eviction(evicted, {key}, exact_size=True)
        return stored

    def _get(self, key: bytes) -> Any:
        now = self._now()
        got = self.tier.get(key)
        self._expect_read(key, got, f"get({self._name(key)})", now)
        return got

    def _delete(self, key: bytes) -> None:
        held = key in self.held and self._expiry(key) == "live"
        self._now()
        removed = self.tier.delete(key)
        if not isinstance(removed, bool) or (removed != held and self._expiry(key) == "live"):
            _fail(f"delete({self._name(key)}) returned {removed!r} for a key the tier "
                  f"{'held' if held else 'did not hold'}")
        self.held.discard(key)
        self.pinned.discard(key)
        if self._observe() & {key}:
            _fail(f"{self._name(key)} is still held right after delete")

    # -- rules ------------------------------------------------------------------------------------

    _key_names = st.deferred(lambda: st.runner().flatmap(lambda m: st.sampled_from(sorted(m.names))))
    _held_names = st.deferred(lambda: st.runner().flatmap(
        lambda m: st.sampled_from(sorted(m._name(k) for k in m.held) or sorted(m.names))))
    _sizes = st.deferred(lambda: st.runner().flatmap(lambda m: st.integers(m.min_blob, m.max_blob)))
    _forms = st.sampled_from(["bytes", "bytearray", "memoryview"])

    @rule(name=_key_names, size=_sizes, form=_forms)
    def put(self, name: str, size: int, form: str) -> None:
        """Put a blob of ``size`` bytes under ``name``, passed as ``form`` (``bytes``, ``bytearray`` or
        ``memoryview``, overwritten right after): a put that returns ``True`` is held right after and
        evicts only least recently used keys (``lru``) and no more than it needs
        (``used_bytes_exact``); one that returns ``False`` leaves no older blob.  Cost: one ``put``,
        then a one-key ``contains_prefix`` per key of the universe."""
        self.step = f"put({name})"
        self._put(self.names[name], size, form)

    @rule(items=st.lists(st.tuples(_key_names, _sizes, _forms), max_size=4, unique_by=lambda t: t[0]),
          oversize=st.booleans())
    def put_many(self, items: list[tuple[str, int, str]], oversize: bool) -> None:
        """``oversize``: the last blob is over the tier's capacity (it must be refused)."""
        tier = self.tier
        if oversize and items and self.capacity is not None:
            items = [*items[:-1], (items[-1][0], self.capacity + 1, items[-1][2])]
        self.step = f"put_many({[(n, size) for n, size, _ in items]})"
        keys = [self.names[n] for n, _, _ in items]
        made = [self._new_blob(k, size) for k, (_, size, _) in zip(keys, items)]
        bufs = [_bytes_form(b, form) for b, (_, _, form) in zip(made, items)]
        must = [self.should_store(size) for _, size, _ in items]
        now = self._now()
        stored = tier.put_many(list(zip(keys, bufs)))
        for buf in bufs:
            _scribble(buf)
        if type(stored) is not int or not 0 <= stored <= len(items):
            _fail(f"{self.step} returned {stored!r}, not an int in [0, {len(items)}]")
        if stored < sum(m is True for m in must) or stored > len(items) - sum(m is False for m in must):
            _fail(f"{self.step} stored {stored} of {len(items)} blobs of sizes {[s for _, s, _ in items]}, "
                  f"but should_store says {must}")
        self.expected["puts"] += len(items)
        self.expected["rejected"] += len(items) - stored
        self.unknown.add("evictions")       # a batch may evict its own earlier items: not visible
        for key, (_, size, _) in zip(keys, items):
            self._unpin_if_grown(key, size)
        self.held -= set(keys)
        observed = self._observe()
        for key, blob in zip(keys, made):
            if key in observed:
                self.values[key], self.written[key] = blob, (now, now)
                self._touch(key, now)
                self.held.add(key)
                self.stale.pop(key, None)
        if stored == len(items) and items and keys[-1] not in observed:
            _fail(f"{self.step} stored every blob but does not hold the last one, {self._name(keys[-1])}")
        evicted = self._reconcile(observed, may_evict=True)
        self._check_eviction(evicted, set(keys), exact_size=False)

    @rule(name=_held_names)
    def get(self, name: str) -> None:
        """Get ``name`` (biased toward held keys): a held key reads back as its last blob, byte for
        byte, any other is a miss.  Cost: one ``get``."""
        self.step = f"get({name})"
        self._get(self.names[name])

    @rule(names=st.lists(st.one_of(_held_names, _key_names), max_size=5))
    def get_many(self, names: list[str]) -> None:
        """Get up to five keys in one call: one answer per key, in order, each what ``get`` must answer.
        Cost: one ``get_many``."""
        self.step = f"get_many({names})"
        keys = [self.names[n] for n in names]
        now = self._now()
        got = self.tier.get_many(keys)
        if len(got) != len(keys):
            _fail(f"{self.step} returned {len(got)} results for {len(keys)} keys")
        for key, blob in zip(keys, got):
            self._expect_read(key, blob, f"{self.step} (at {self._name(key)})", now)

    @rule(name=_held_names)
    def read(self, name: str) -> None:
        """Read ``name`` through ``consume``: ``read`` returns what ``consume`` returned, and the bytes
        it saw are the key's last blob (a miss: ``None``).  Cost: one ``read``."""
        self.step = f"read({name})"
        key, marker = self.names[name], object()
        now = self._now()
        got = self.tier.read(key, lambda view: (bytes(view), marker))
        if got is not None and (not isinstance(got, tuple) or got[1] is not marker):
            _fail(f"read({name}) returned {got!r}, not what consume returned")
        self._expect_read(key, None if got is None else got[0], self.step, now)

    @rule(name=_held_names)
    def read_lets_exceptions_through(self, name: str) -> None:
        """Read ``name`` with a ``consume`` that raises: the exception reaches the caller when the tier
        holds the key, and a miss returns ``None``.  Hits and misses are not checked in this step (a
        tier may count the read before or after ``consume``).  Cost: one ``read``."""
        self.step = f"read({name}) with a consume that raises"
        key = self.names[name]
        held = key in self.held and self._expiry(key) == "live"

        def consume(view: memoryview) -> None:
            raise _Boom

        now = self._now()
        self.unknown |= {"hits", "misses"}     # a tier may count the read before or after consume
        try:
            got = self.tier.read(key, consume)
        except _Boom:
            earlier = self.stamps.get(key, 0)
            self._expect_read(key, self.values.get(key), self.step, now)   # it found the blob
            self.maybe_older[key] = earlier                                  # an access, or not
            return
        if got is not None or held:
            _fail(f"{self.step}: read returned {got!r} instead of letting consume's exception through")
        self._expect_read(key, None, self.step, now)

    @rule(name=_held_names)
    def get_is_stable(self, name: str) -> None:
        """A buffer from get must not change when the tier is written afterwards."""
        self.step = f"get({name}), then writes"
        key = self.names[name]
        got = self._get(key)
        if got is None:
            return
        before = bytes(got)
        for other in [k for k in self.universe if k != key][:3]:
            self._put(other, self._fitting_size())
        self._delete(key)
        self._put(key, self._fitting_size())
        if bytes(got) != before:
            _fail(f"a buffer get({name}) returned changed under its holder when the tier was written")

    @rule(name=_key_names, first=_sizes, second=_sizes)
    def overwrite_then_read(self, name: str, first: int, second: int) -> None:
        """Put, read, put again, read, delete, read: a read cache or an index that is not kept
        up to date answers with the old blob."""
        self.step = f"overwrite then read({name})"
        key = self.names[name]
        if self._put(key, first):
            self._get(key)
        self._put(key, second)
        self._get(key)
        self._delete(key)
        self._get(key)

    @rule(n=st.integers(0, 8))
    def fill(self, n: int) -> None:
        """Write a whole namespace of the largest blobs the tier must store: more than a small
        tier holds."""
        ns = self.ns_ids[n % len(self.ns_ids)]
        self.step = f"fill(ns{n % len(self.ns_ids)})"
        for key in [k for k in self.universe if k.startswith(ns)]:
            self._put(key, self._fitting_size())

    @precondition(lambda self: self._tier is not None and self.capacity is not None)
    @rule(name=_key_names)
    def refused_put_drops_the_old_blob(self, name: str) -> None:
        """Put a ``min_blob`` blob under ``name``, then, where ``should_store`` says it must be
        refused, one of ``capacity + 1`` bytes: refused, and the first blob gone too.  Only for a
        bounded tier.  Cost: two ``put`` calls, each followed by a one-key ``contains_prefix`` per key
        of the universe."""
        self.step = f"refused put({name})"
        key = self.names[name]
        self._put(key, self.min_blob)
        if self.should_store(self.capacity + 1) is False:   # type: ignore[operator]
            self._put(key, self.capacity + 1)                 # type: ignore[operator]

    def _count(self, n: Any, most: int) -> int:
        """``n``, the step's answer, checked to be an int in [0, ``most``]."""
        if type(n) is not int or not 0 <= n <= most:
            _fail(f"{self.step} returned {n!r}, not an int in [0, {most}]")
        return n

    @rule(names=st.lists(st.one_of(_held_names, _key_names), max_size=6, unique=True))
    def contains_prefix(self, names: list[str]) -> None:
        """Look up up to six keys: the answer is the leading run of them the tier holds (a range where
        some may have expired); not an access.  Cost: one ``contains_prefix``."""
        self.step = f"contains_prefix({names})"
        keys = [self.names[n] for n in names]
        self._now()
        n = self._count(self.tier.contains_prefix(keys), len(keys))
        sure = [k in self.held and self._expiry(k) == "live" for k in keys]
        maybe = [k in self.held for k in keys]
        lo = next((i for i, s in enumerate(sure) if not s), len(keys))
        hi = next((i for i, s in enumerate(maybe) if not s), len(keys))
        if not lo <= n <= hi:
            _fail(f"{self.step} returned {n}; the tier holds {self._names(set(keys) & self.held)} of them, "
                  f"so the leading run is {lo}")

    @rule(name=_held_names)
    def delete(self, name: str) -> None:
        """Delete ``name``: returns whether the tier held it, which it no longer does.  Cost: one
        ``delete``, then a one-key ``contains_prefix`` per key of the universe."""
        self.step = f"delete({name})"
        self._delete(self.names[name])

    @rule(n=st.integers(0, 8))
    def drop_namespace(self, n: int) -> None:
        """Drop one namespace: returns how many of its keys the tier held (a remote tier may answer 0),
        and none is left; the other namespaces, whose ids differ in one byte, keep theirs.  Cost: one
        ``drop_namespace``, then a one-key ``contains_prefix`` per key of the universe."""
        ns_id = self.ns_ids[n % len(self.ns_ids)]
        self.step = f"drop_namespace(ns{n % len(self.ns_ids)})"
        tier = self.tier
        doomed = {k for k in self.held if k.startswith(ns_id)}
        sure = {k for k in doomed if self._expiry(k) == "live"}
        expired = {k for k in self.written if k.startswith(ns_id) and self._expiry(k) != "live"}  # may count
        self._now()
        removed = tier.drop_namespace(ns_id)
        exact_count = self.exact or getattr(tier, "local", True)
        ok = len(sure) <= removed <= len(doomed | expired) if type(removed) is int else False
        if not ok and not (removed == 0 and not exact_count):
            _fail(f"{self.step} returned {removed!r}; the tier held {len(doomed)} keys of it {self._names(doomed)}")
        self.held -= doomed
        self.pinned -= doomed
        left = {k for k in self._observe() if k.startswith(ns_id)}
        if left:
            _fail(f"{self.step} left {self._names(left)}")

    @rule(names=st.lists(st.one_of(_held_names, _key_names), min_size=1, max_size=4, unique=True))
    def pin(self, names: list[str]) -> None:
        """Pin some keys (held ones or not): the held ones it covered must stay until unpinned."""
        self.step = f"pin({names})"
        keys = [self.names[n] for n in names]
        self._now()
        n = self._count(self.tier.pin(keys), len(keys))
        self.pin_marks.update(keys[:n])
        self.pinned.update(k for k in keys[:n] if k in self.held and self._expiry(k) == "live")
        self._reconcile(self._observe(), may_evict=False)

    @rule(names=st.lists(st.one_of(_held_names, _key_names), min_size=1, max_size=6, unique=True))
    def unpin(self, names: list[str]) -> None:
        """Unpin up to six keys (held ones or not): returns an int between the keys surely pinned
        among them and their count; from then on they may be evicted.  Cost: one ``unpin``, then a
        one-key ``contains_prefix`` per key of the universe."""
        self.step = f"unpin({names})"
        keys = [self.names[n] for n in names]
        surely = len(self.pinned & set(keys))
        self._now()
        n = self.tier.unpin(keys)
        if type(n) is not int or not surely <= n <= len(keys):
            _fail(f"{self.step} returned {n!r}; {surely} of the keys are pinned for sure (of {len(keys)})")
        self.pinned.difference_update(keys)
        self.pin_marks.difference_update(keys)
        self._reconcile(self._observe(), may_evict=False)

    @precondition(lambda self: self.ttl is not None)
    @rule(fraction=st.sampled_from([0.25, 0.5, 0.99, 1.0, 1.01, 1.5]))
    def advance_clock(self, fraction: float) -> None:
        """Let time pass: entries older than ``ttl`` must be gone, younger ones stay."""
        self.step = f"advance_clock({fraction} ttl)"
        self.clock.advance(fraction * self.ttl)    # type: ignore[operator]

    @precondition(lambda self: self.ttl is not None)
    @rule(name=_key_names)
    def ttl_counts_from_the_write(self, name: str) -> None:
        """Put, read it 0.6 ``ttl`` later, wait 0.6 ``ttl`` more: it has expired (a read that renews
        the expiry is caught), whoever else expired meanwhile."""
        self.step = f"put, read and wait ({name})"
        key = self.names[name]
        if not self._put(key, self._fitting_size()):
            return
        self.clock.advance(0.6 * self.ttl)         # type: ignore[operator]
        self._get(key)
        self.clock.advance(0.6 * self.ttl)         # type: ignore[operator]
        self._reconcile(self._observe(), may_evict=False)

    @precondition(lambda self: self.reentrant_consume)
    @rule(name=_held_names)
    def reentrant_read(self, name: str) -> None:
        """``consume`` writes, evicts and deletes the very key it reads: its buffer must not change."""
        self.step = f"re-entrant read({name})"
        key = self.names[name]
        want = self.values.get(key)
        others = [k for k in self.universe if k != key][:3]

        def consume(view: memoryview) -> tuple[bytes, bytes]:
            first = bytes(view)
            self.relaxed += 1
            try:
                for other in others:
                    self._put(other, self._fitting_size())
                self._delete(key)
                self._put(key, self._fitting_size())
            finally:
                self.relaxed -= 1
            return first, bytes(view)

        now = self._now()
        self._touch(key, now)
        got = self.tier.read(key, consume)
        if got is None:
            self.expected["misses"] += 1
            return
        self.expected["hits"] += 1
        first, last = got
        if first != want:
            _fail(f"{self.step} saw {self._describe(first)}, not its last blob ({self._describe(want or b'')})")
        if last != first:
            _fail(f"{self.step}: the buffer changed while consume ran (now {self._describe(last)}): "
                  "its memory was reused before consume returned")

    @precondition(lambda self: self.threads > 0)
    @rule(seed=st.integers(0, 1 << 16))
    def threaded_burst(self, seed: int) -> None:
        """``threads`` threads of put/get/read/lookup/delete at once; afterwards every read must have
        returned a blob put under its key, and the tier's check() and the model must hold."""
        self.step = f"threaded_burst(seed={seed})"
        tier = self.tier
        # One write from this thread first: a tier that sets itself up on its first write (a slot
        # size, a schema) does so the same way in every run, not as the race decides.
        self._put(self.universe[0], self._fitting_size())
        allowed = {k: {self.values[k]} if k in self.held else set() for k in self.universe}
        plans = []
        rng = random.Random(seed)
        ops = self.burst_ops if getattr(tier, "local", True) else max(4, self.burst_ops // 3)  # round trips
        for _ in range(self.threads):
            plan = []
            for _ in range(ops):
                op, key = rng.choice("pppggrcd"), rng.choice(self.universe)
                blob = self._new_blob(key, rng.randint(self.min_blob, self.max_blob)) if op == "p" else b""
                if op == "p":
                    allowed[key].add(blob)
                plan.append((op, key, blob))
            plans.append(plan)
        reads: list[list[tuple[bytes, bytes]]] = [[] for _ in plans]
        errors: list[str] = []
        start = self._now()

        def worker(t: int) -> None:
            try:
                for op, key, blob in plans[t]:
                    if op == "p":
                        tier.put(key, blob)
                    elif op == "g":
                        got = tier.get(key)
                        if got is not None:
                            reads[t].append((key, bytes(got)))
                    elif op == "r":
                        got = tier.read(key, bytes)
                        if got is not None:
                            reads[t].append((key, got))
                    elif op == "c":
                        n = tier.contains_prefix([key, *self.universe[:3]])
                        if type(n) is not int or not 0 <= n <= 4:
                            errors.append(f"contains_prefix returned {n!r} in thread {t}")
                    else:
                        tier.delete(key)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(f"thread {t} raised {exc!r}")

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)        # interleave as finely as the interpreter allows
        if getattr(tier, "local", True):   # and yield at random lines of the tier's Python code
            threading.settrace(_preempter(seed))
        try:
            workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(len(plans))]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
        finally:
            threading.settrace(None)       # type: ignore[arg-type]
            sys.setswitchinterval(old)
        if any(w.is_alive() for w in workers):
            _fail(f"{self.step}: threads still running after 60 s (a deadlock?)")
        if errors:
            _fail(f"{self.step}: {errors[0]}")
        for key, got in itertools.chain.from_iterable(reads):
            if got not in allowed[key]:
                _fail(f"{self.step}: a concurrent read of {self._name(key)} returned {self._describe(got)}, "
                      "neither its blob before the burst nor one put during it (torn, stale or foreign)")
        tier.check()
        observed = self._observe()
        for key in observed:
            now = self._now()
            got = tier.get(key)
            if got is None or bytes(got) not in allowed[key]:
                _fail(f"after {self.step}, get({self._name(key)}) returned "
                      f"{None if got is None else self._describe(got)}, not a blob put under it")
            self.values[key] = bytes(got)
            self._touch(key, now)
            if any(op == "p" and k == key for plan in plans for op, k, _ in plan):
                self.written[key] = (start, now)
        self.held = observed
        self.pinned &= observed
        for key in sorted(observed):       # start over empty: what survived a race is not reproducible,
            self._delete(key)              # and the next steps' draws must not depend on it
        settled = start + (2 * len(self.universe) + 2) * self.clock.step_us   # nor the clock
        self.clock._us = max(self.clock._us, settled)
        self.baseline = self._stats()     # counters under concurrency are not the model's to predict
        self.expected.clear()
        self.unknown.clear()

    # -- invariants -------------------------------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        stats = self.tier.stats()
        if not isinstance(stats, dict) or not all(isinstance(k, str) for k in stats):
            _fail(f"stats() returned {stats!r}, not a dict by name")
        return stats

    @invariant()
    def agrees_with_the_model(self) -> None:
        """After every step (once the tier is built): the tier's ``check()`` passes; it holds what the
        model says (observed again unless the step ended by observing); ``used_bytes`` is an int within
        ``capacity_bytes`` (with ``used_bytes_exact``, the bytes of the entries held); the counters of
        ``stats()`` grew as the model counts, and ``entries`` and ``used_bytes`` agree.  Cost: the
        tier's ``check()``, one ``stats()`` and at most a one-key ``contains_prefix`` per key of the
        universe."""
        if self._tier is None:
            return
        tier = self._tier
        tier.check()
        if self.observed_at != self.clock._us:      # held is current when the step ended by observing
            self._reconcile(self._observe(), may_evict=False)
        used, cap = tier.used_bytes, tier.capacity_bytes
        if type(used) is not int or used < 0:
            _fail(f"used_bytes is {used!r}, not an int >= 0")
        if cap is not None and used > cap:
            _fail(f"used_bytes {used} over capacity_bytes {cap} after {self.step}")
        if self.used_bytes_exact:
            lo, hi = self._bytes_held()
            if not lo <= used <= hi:
                _fail(f"used_bytes is {used} after {self.step}; the {len(self.held)} entries held take "
                      + (f"{lo}" if lo == hi else f"{lo} to {hi} (with the entries that may have expired and may "
                         "still be stored)"))
        stats = self._stats()
        if self.baseline is not None:
            for name in ("hits", "misses", "puts", "rejected", "evictions"):
                if name in stats and name in self.baseline and name not in self.unknown:
                    self._check_count(name, stats[name] - self.baseline[name])
        if "entries" in stats:
            sure = sum(self._expiry(k) == "live" for k in self.held)
            most = len(self.held | self.stale.keys())
            if not sure <= stats["entries"] <= most:
                _fail(f"stats()['entries'] is {stats['entries']} after {self.step}, but the tier holds "
                      + (f"{sure}" if sure == most else f"{sure} live entries, and up to {most} with those that "
                         "may have expired and may still be stored"))
        if "used_bytes" in stats and stats["used_bytes"] != used:
            _fail(f"stats()['used_bytes'] is {stats['used_bytes']}, used_bytes is {used}")
        self.baseline = stats
        self.expected.clear()
        self.unknown.clear()
        self.stale_now = {(k, written) for k, (written, _) in self.stale.items()}

    def _check_count(self, name: str, grew: int) -> None:
        """Check that the counter ``name`` grew by what the model counts during this step.  With a
        ``ttl``, ``evictions`` is a range: a tier may count the expired entries it drops there or
        not (``Tier.stats``), so it may grow by up to one more per entry that may have expired and
        may still be stored, and by no more over the whole run than the entries that expired."""
        want = self.expected[name]
        slack = len(self.stale_now) if name == "evictions" else 0
        if not want <= grew <= want + slack:
            if not slack:
                _fail(f"stats()[{name!r}] grew by {grew} during {self.step}; the model counts {want}")
            _fail(f"stats()[{name!r}] grew by {grew} during {self.step}; the model counts {want} live entries "
                  f"evicted, plus up to {slack} entries that may have expired and may still be stored (whether a "
                  "tier counts an expired entry it drops as an eviction is its choice: see Tier.stats)")
        if name == "evictions":
            self.extra_evictions += grew - want
            if self.extra_evictions > self.expired_entries:
                _fail(f"stats()['evictions'] has counted {self.extra_evictions} entries beyond the live ones "
                      f"evicted, by {self.step}, but only {self.expired_entries} entries have expired: each expired "
                      "entry counts once at most")


class PersistentTierContract(TierContract):
    """``TierContract`` for a tier whose entries outlive the object (LMDB, S3, a database): adds a
    ``reopen`` rule.  ``make_tier`` must open the same storage every time it is called in one
    example (``self.path`` is the same directory)."""

    persistent = True

    @precondition(lambda self: self._tier is not None)
    @rule()
    def reopen(self) -> None:
        """Close the tier (twice) and build a new one on the same storage: nothing lost or resurrected."""
        self.step = "reopen"
        held = self._observe()
        self._reconcile(held, may_evict=False)
        tier = self.tier
        tier.close()
        tier.close()
        self.tier = self._build()
        self.pinned.clear()                 # pins may or may not outlive the tier object (pin_marks keeps them)
        self.baseline = self._stats()
        observed = self._observe()
        lost = {k for k in held - observed if self._expiry(k) == "live"}
        if lost:
            _fail(f"{self._names(lost)} were lost across close() and reopen")
        self._reconcile(observed, may_evict=False)
        for key in sorted(observed):
            self._get(key)


def _factory_method(factory: Callable[..., Tier]) -> Callable[[TierContract], Tier]:
    """A ``make_tier`` that calls ``factory`` with the ``path`` and ``clock`` it asks for."""
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    params = inspect.signature(factory).parameters
    named = [n for n in ("path", "clock") if n in params]
    positional = not named and any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                                   for p in params.values())

    def make_tier(self: TierContract) -> Tier:
        if positional:
            return factory(self.path)
        return factory(**{n: (self.path if n == "path" else self.clock) for n in named})

    return make_tier


# The wrappers moved to their own module; importable from here as before.
from radixkv.testing.wrappers import FaultyTier, RecordingTier, TierFault  # noqa: E402,F401
