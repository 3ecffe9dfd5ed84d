"""The observer seam: one way for everything that watches the cache to hear what happens.

The cache (``PrefixCache``), its tier stacks (``TierStack``) and the integrations report what
happens at the level where it happens — the pool (level ``"pool"``) or a tier (its name, e.g.
``"cpu"``, ``"lmdb"``, ``"s3"``) — to the listeners of an ``Observers`` list.  Metrics exporters,
KV-event publishers, the counters of ``stats()`` and the notebooks' pictures are listeners; none
of them is wired into the cache or the stack on its own.

Contract:

* **Events.**  A ``Listener`` has one method per kind of event; each is a no-op until overridden:

  - ``pages(level, held, dropped)``: the pool now holds ``held`` more pages of cached prefixes
    (an insert, a load landed) or let ``dropped`` go (an eviction; a sliding group's pages
    leaving every window count under the level ``"pool:<group tag>"``);
  - ``span(level, data, start, stop, held)``: which pages those are: the pool now holds
    (``held``) or no longer holds the tokens ``start..stop-1`` (whole pages) of the cached
    sequence ``data`` (little-endian int32 token bytes from token 0, at least ``stop`` tokens
    long), in the namespace of the cache's first tier stack (or the cache's own without tiers).
    An insert or a landed load tells what it added, an eviction what it cut off (a leaf: nothing
    past ``stop`` is held on that path).  Built only when a listener overrides ``span``
    (``Observers.wants``): an eviction's costs a walk to the root;
  - ``chunks(level, namespace, held, dropped)``: a tier now holds the chunks with these keys of
    namespace id ``namespace`` (a store it accepted), or no longer does (a bad entry deleted, a
    chunk moved up out of an exclusive tier, a delete, an eviction the tier made to make room:
    the CPU tier's and LMDB's, told after the write that caused it; a remote tier's expiry or
    eviction happens on its server and is not told);
  - ``cleared(level, namespace)``: a level dropped everything of ``namespace`` (``None``: of
    every namespace);
  - ``io(level, op, seconds, nbytes, items, outcome)``: a ``"lookup"`` (one call asking a tier
    for ``items`` keys; then a ``"miss"`` of the ``items`` of them it did not hold, asked of the
    next tier or where the lookup stopped), a ``"tail"`` probe (one key: a tail a local tier may
    hold), a ``"load"`` (a remote fetch of ``items`` blobs, with its time; then one event per chunk
    delivered, with its decoded bytes and, from a local tier, the time of its read and decode) or
    a ``"store"`` (one write of ``items`` blobs) at a level took ``seconds``,
    moved ``nbytes`` bytes, and ended in ``outcome``: ``"ok"``, ``"corrupt"``, ``"forged"``,
    ``"timeout"`` or ``"error"``;
  - ``served(query_tokens, by_level)``: a request of ``query_tokens`` tokens found
    ``by_level[level]`` of them cached at each level (the pool's, then the tiers' that a load
    brought; levels with none are left out).

* **Cost.**  With no listener an event costs the caller one truth test of the ``Observers``
  (``if observers:``), which is how every call site is written: nothing is built for nobody.
* **Never into the engine.**  A listener that raises is logged (once, with the exception) and
  detached; the event's other listeners still hear it, and the caller never sees the error.
* **Threads.**  Events are delivered on the thread where they happen, outside the cache's and
  the stack's locks: ``pages`` and ``served`` on the engine's thread (the one that calls
  ``open``/``match``/``insert``/``evict``/``poll``), ``chunks`` for stores and ``io`` for stores
  on the stack's writer thread, ``io`` for lookups and loads on the thread that runs them (the
  engine's, or a load worker's for ``load="async"``).  A listener that keeps state shared between
  them locks it (``Counts`` does).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Iterator, Mapping, Sequence

__all__ = ["Counts", "Listener", "Observers"]

log = logging.getLogger(__name__)

#: The ``io`` outcomes.
OUTCOMES = ("ok", "corrupt", "forged", "timeout", "error")


class Listener:
    """Hears the events of the observer seam (see the module docstring); override what you need.
    Every method is a no-op here, so a subclass pays only for what it handles."""

    def pages(self, level: str, held: int, dropped: int) -> None:
        """The pool holds ``held`` more pages of cached prefixes, or let ``dropped`` go."""

    def span(self, level: str, data: bytes, start: int, stop: int, held: bool) -> None:
        """The pool now holds (``held``) or no longer holds tokens ``start..stop-1`` of ``data``."""

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        """A tier now holds the chunks ``held`` (keys) of ``namespace``, and no longer ``dropped``."""

    def cleared(self, level: str, namespace: bytes | None) -> None:
        """A level dropped everything of ``namespace`` (``None``: everything)."""

    def io(self, level: str, op: str, seconds: float, nbytes: int, items: int, outcome: str) -> None:
        """A lookup, load or store at ``level``: its time, bytes, chunks and outcome."""

    def served(self, query_tokens: int, by_level: Mapping[str, int]) -> None:
        """A request found ``by_level[level]`` of its ``query_tokens`` tokens cached at each level."""


class Observers:
    """The listeners of one cache or stack, and the delivery of events to them.

    Falsy while empty (call sites test it before building an event).  ``add``/``remove`` may be
    called from any thread; delivery iterates over a snapshot, so a listener may detach itself.
    Each delivery is O(listeners).

    >>> obs = Observers()
    >>> bool(obs)
    False
    >>> counts = obs.add(Counts())
    >>> obs.pages("pool", 3, 0); counts.pages_held["pool"]
    3
    """

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._wanted: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def __len__(self) -> int:
        return len(self._listeners)

    def __iter__(self) -> Iterator[Listener]:
        return iter(self._listeners)

    def add(self, listener: Listener) -> Listener:
        """Attach ``listener`` (a ``Listener``, or any object with some of its methods); returns it.
        Raises ``TypeError`` for an object with none of them."""
        if not any(callable(getattr(listener, name, None)) for name in _EVENTS):
            raise TypeError(f"listener must have one of {', '.join(_EVENTS)}, got {type(listener).__name__}")
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)
                self._wanted = _wanted(self._listeners)
        return listener

    def remove(self, listener: Listener) -> bool:
        """Detach ``listener``; whether it was attached."""
        with self._lock:
            kept = tuple(x for x in self._listeners if x is not listener)
            found = len(kept) != len(self._listeners)
            self._listeners, self._wanted = kept, _wanted(kept)
        return found

    def wants(self, event: str) -> bool:
        """Whether a listener handles ``event`` (overrides ``Listener``'s no-op, or has the method):
        for call sites whose event costs more to build than a truth test.  O(1)."""
        return event in self._wanted

    def _deliver(self, event: str, *args: object) -> None:
        for listener in self._listeners:
            method = getattr(listener, event, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception:  # noqa: BLE001 - a listener never breaks the engine
                log.exception("radixkv: listener %r failed on %s; detached", listener, event)
                self.remove(listener)

    def pages(self, level: str, held: int, dropped: int) -> None:
        """Deliver ``Listener.pages``."""
        self._deliver("pages", level, held, dropped)

    def span(self, level: str, data: bytes, start: int, stop: int, held: bool) -> None:
        """Deliver ``Listener.span``."""
        self._deliver("span", level, data, start, stop, held)

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes] = ()) -> None:
        """Deliver ``Listener.chunks``."""
        self._deliver("chunks", level, namespace, held, dropped)

    def cleared(self, level: str, namespace: bytes | None) -> None:
        """Deliver ``Listener.cleared``."""
        self._deliver("cleared", level, namespace)

    def io(self, level: str, op: str, seconds: float, nbytes: int, items: int, outcome: str) -> None:
        """Deliver ``Listener.io``."""
        self._deliver("io", level, op, seconds, nbytes, items, outcome)

    def served(self, query_tokens: int, by_level: Mapping[str, int]) -> None:
        """Deliver ``Listener.served``."""
        self._deliver("served", query_tokens, by_level)


_EVENTS = tuple(name for name in vars(Listener) if not name.startswith("_"))


def _wanted(listeners: tuple[Listener, ...]) -> frozenset[str]:
    """The events some listener handles: a method that is not ``Listener``'s own no-op."""
    return frozenset(name for name in _EVENTS for x in listeners
                     if callable(m := getattr(x, name, None)) and getattr(m, "__func__", m) is not getattr(Listener, name))


class Counts(Listener):
    """A listener that adds events up: pages held and dropped per level, chunks held and dropped
    per tier, io per (level, op, outcome) — count, seconds, bytes, chunks — and tokens served per
    level.  Thread-safe; each event O(1) (O(levels) for ``served``).  The counters of ``stats()``
    agree with it (``tests/core/test_observe.py``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pages_held: Counter[str] = Counter()
        self.pages_dropped: Counter[str] = Counter()
        self.chunks_held: Counter[str] = Counter()
        self.chunks_dropped: Counter[str] = Counter()
        self.clears: Counter[str] = Counter()
        self.ios: Counter[tuple[str, str, str]] = Counter()
        self.io_seconds: dict[tuple[str, str], float] = {}
        self.io_bytes: Counter[tuple[str, str]] = Counter()
        self.io_items: Counter[tuple[str, str, str]] = Counter()
        self.requests = 0
        self.query_tokens = 0
        self.served_tokens: Counter[str] = Counter()

    def pages(self, level: str, held: int, dropped: int) -> None:
        """Add ``held`` and ``dropped`` to ``pages_held[level]`` and ``pages_dropped[level]``.  O(1)."""
        with self._lock:
            self.pages_held[level] += held
            self.pages_dropped[level] += dropped

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        """Count the keys in ``held`` and ``dropped`` per level (``chunks_held``, ``chunks_dropped``), all
        namespaces together; no key is kept.  O(1)."""
        with self._lock:
            self.chunks_held[level] += len(held)
            self.chunks_dropped[level] += len(dropped)

    def cleared(self, level: str, namespace: bytes | None) -> None:
        """Count one clear in ``clears[level]``, whatever the namespace.  O(1)."""
        with self._lock:
            self.clears[level] += 1

    def io(self, level: str, op: str, seconds: float, nbytes: int, items: int, outcome: str) -> None:
        """Count the event (``ios``) and its chunks (``io_items``) per (level, op, outcome), and its
        seconds and bytes (``io_seconds``, ``io_bytes``) per (level, op), every outcome together.  O(1)."""
        with self._lock:
            self.ios[level, op, outcome] += 1
            self.io_seconds[level, op] = self.io_seconds.get((level, op), 0.0) + seconds
            self.io_bytes[level, op] += nbytes
            self.io_items[level, op, outcome] += items

    def served(self, query_tokens: int, by_level: Mapping[str, int]) -> None:
        """Count the request (``requests``), its ``query_tokens`` and the tokens each level served
        (``served_tokens``).  O(levels)."""
        with self._lock:
            self.requests += 1
            self.query_tokens += query_tokens
            self.served_tokens.update(by_level)
