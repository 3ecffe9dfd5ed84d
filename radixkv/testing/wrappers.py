"""Tier wrappers for tests: a tier that fails on demand (``FaultyTier``) and one that records what
is asked of it (``RecordingTier``), both forwarding every call to the tier they wrap (and its kind:
``local``, ``persistent``, ``victim``, ``in_memory``).  The cache and stack machines put them
between the cache and your backend; use them the same way in your own tests.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable, Sequence

from radixkv.backends import Blob, Tier

__all__ = ["FaultyTier", "RecordingTier", "TierFault"]


class TierFault(OSError):
    """The fault ``FaultyTier`` raises."""


class _Wrapper(Tier):
    """A tier that forwards every call to ``inner`` through ``_enter(method)``."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        for flag in ("local", "persistent", "victim", "in_memory"):     # what the stack reads of a tier's kind
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
        if method in ("contains_prefix", "drop_namespace", "close", "delete", "pin", "unpin"):
            return
        with self._lock:
            n = next(self._counter)
            target = self.written if method.startswith("put") else self.accessed
            for key in keys:
                target[key] = n
