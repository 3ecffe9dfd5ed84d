"""Tier wrappers for tests: a tier that fails on demand (``FaultyTier``), one that records what is
asked of it (``RecordingTier``) and one whose loads wait for a gate (``GatedTier``), each forwarding
every call of ``Tier``'s interface to the tier it wraps (``entries``, ``pin``, ``unpin`` and
``take_evicted`` included) and its kind (``local``, ``persistent``, ``victim``, ``in_memory``,
``peer``).  The cache, stack and request machines put them between the cache and your backend; use
them the same way in your own tests.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

from radixkv.backends import Blob, Entry, Tier

__all__ = ["FaultyTier", "GatedTier", "RecordingTier", "TierFault"]


class TierFault(OSError):
    """The fault ``FaultyTier`` raises."""


class _Wrapper(Tier):
    """A tier that forwards every call to ``inner`` through ``_enter(method)``."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        for flag in ("local", "persistent", "victim", "in_memory", "peer"):     # what the stack reads of a tier's kind
            if hasattr(inner, flag):
                setattr(self, flag, getattr(inner, flag))

    def _enter(self, method: str, keys: Sequence[bytes] = ()) -> None:
        raise NotImplementedError

    def get(self, key: bytes) -> Blob | None:
        self._enter("get", [key])
        return self.inner.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        self._enter("get_many", keys)
        return self.inner.get_many(keys)

    def read(self, key: bytes, consume: Callable[[memoryview], Any]) -> Any:
        self._enter("read", [key])
        return self.inner.read(key, consume)

    def put(self, key: bytes, blob: Blob) -> bool:
        self._enter("put", [key])
        return self.inner.put(key, blob)

    def put_many(self, items: Any) -> int:
        items = list(items)
        self._enter("put_many", [k for k, _ in items])
        return self.inner.put_many(items)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._enter("contains_prefix")
        return self.inner.contains_prefix(keys)

    def delete(self, key: bytes) -> bool:
        self._enter("delete", [key])
        return self.inner.delete(key)

    def drop_namespace(self, ns_id: bytes) -> int:
        self._enter("drop_namespace")
        return self.inner.drop_namespace(ns_id)

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        self._enter("entries")
        return self.inner.entries(ns_id)

    def pin(self, keys: Sequence[bytes]) -> int:
        self._enter("pin", keys)
        return self.inner.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        self._enter("unpin", keys)
        return self.inner.unpin(keys)

    def expect(self, blob_bytes: int) -> None:
        self.inner.expect(blob_bytes)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def capacity_bytes(self) -> int | None:
        return self.inner.capacity_bytes

    def take_evicted(self) -> list[bytes] | None:
        return self.inner.take_evicted()

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self._enter("close")
        self.inner.close()

    def check(self) -> None:
        self.inner.check()


class FaultyTier(_Wrapper):
    """Wraps a tier and raises ``TierFault`` from the methods named in ``failing`` (a set you may
    change at any time) — for testing what sits above a tier when it fails.  ``calls`` counts
    calls by method name, ``faults`` the faults raised.  Thread-safe if the wrapped tier is."""

    def __init__(self, inner: Tier, failing: Iterable[str] = ()) -> None:
        super().__init__(inner)
        self.failing = set(failing)
        self.calls: dict[str, int] = {}
        self.faults = 0
        self.name = f"faulty-{inner.name}"
        self._lock = threading.Lock()

    def _enter(self, method: str, keys: Sequence[bytes] = ()) -> None:
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            if method in self.failing:
                self.faults += 1
                raise TierFault(f"injected fault in {method}")


class RecordingTier(_Wrapper):
    """Wraps a tier and records, per key, the sequence number of its last access (``get``,
    ``get_many``, ``read``) and of its last write (``put``, ``put_many``), from one counter that
    ``mark()`` also reads — so a test can ask "was this key read or written after that moment?".
    ``contains_prefix`` is not recorded.  Thread-safe."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.name = inner.name
        self.accessed: dict[bytes, int] = {}
        self.written: dict[bytes, int] = {}
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def mark(self) -> int:
        """The current sequence number: every later access or write gets a larger one.  O(1)."""
        with self._lock:
            return next(self._counter)

    def _enter(self, method: str, keys: Sequence[bytes] = ()) -> None:
        if method in ("contains_prefix", "drop_namespace", "close", "delete", "pin", "unpin", "entries"):
            return
        with self._lock:
            n = next(self._counter)
            target = self.written if method.startswith("put") else self.accessed
            for key in keys:
                target[key] = n


class GatedTier(_Wrapper):
    """A tier whose reads from the cache's load workers wait for ``gate`` (a ``threading.Event``):
    clear it and a load stays pending; set it and the load goes on.  Reads (``get``, ``get_many``,
    ``read``, ``contains_prefix``) from any other thread (the stack's writer) pass straight through,
    as does every other call.  A read that waits more than ``max_wait`` seconds fails (a fault: the
    load is a miss), so nothing can hang.  ``close`` opens the gate first, so no load waits on it."""

    def __init__(self, inner: Tier, max_wait: float = 20.0) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.max_wait = max_wait
        self.name = f"gated({inner.name})"

    def _enter(self, method: str, keys: Sequence[bytes] = ()) -> None:
        if method == "close":
            self.gate.set()
        elif (method in ("get", "get_many", "read", "contains_prefix")
              and threading.current_thread().name.startswith("radixkv-load")
              and not self.gate.wait(self.max_wait)):
            raise TimeoutError(f"{self.name}: the gate stayed closed for {self.max_wait} s")
