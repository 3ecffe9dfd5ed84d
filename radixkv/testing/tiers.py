"""A differential state machine for storage tiers, strategies for tier keys and blobs, and a
fault-injecting wrapper.

Run your own backend against the in-memory reference tier::

    from radixkv.testing import TierContract

    class MyTierContract(TierContract):
        def make_tier(self):
            return MyTier(max_bytes=4096)        # tiny, so that eviction happens

    TestMyTier = MyTierContract.TestCase          # collected by pytest / unittest

Every operation runs on both the tier under test and a ``MemoryTier``, with the tier's own
``check()`` after every step.  Eviction makes the tier a *subset* of the reference, so the machine
checks what a cache promises: every key the tier holds has the reference's blob (never an older or
foreign one), a rejected put leaves no old blob behind, a deleted or dropped key is gone at once,
and ``used_bytes`` stays within ``capacity_bytes``.  Set ``exact = True`` for a tier that never
evicts, ``persistent = True`` for one that keeps its entries across ``close()`` and a new
``make_tier()`` (the machine then also reopens it and checks nothing was lost).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.backends import Blob, MemoryTier, Tier

__all__ = ["FaultyTier", "TierContract", "TierFault", "blobs", "namespace_ids", "tier_keys"]


def namespace_ids(count: int = 3) -> list[bytes]:
    """``count`` fixed 8-byte namespace ids: a small universe, so that keys collide and
    ``drop_namespace`` has something to do."""
    return [xxhash.xxh3_64_digest(b"radixkv/testing/ns/%d" % i) for i in range(count)]


def _universe(namespaces: int, per_namespace: int) -> list[bytes]:
    return [ns + xxhash.xxh3_128_digest(b"radixkv/testing/key/%d" % i)
            for ns in namespace_ids(namespaces) for i in range(per_namespace)]


def tier_keys(namespaces: int = 3, per_namespace: int = 6) -> st.SearchStrategy[bytes]:
    """24-byte tier keys from a fixed universe of ``namespaces * per_namespace`` keys."""
    return st.sampled_from(_universe(namespaces, per_namespace))


def blobs(max_size: int = 300) -> st.SearchStrategy[bytes]:
    """Blobs of 0 to ``max_size`` bytes, each tagged with a hash of itself, so that two blobs put
    under one key almost surely differ even when hypothesis draws them small."""
    sizes = st.integers(0, max(0, max_size - 8))  # uniform sizes: st.binary alone rarely draws big ones
    return sizes.flatmap(lambda n: st.binary(min_size=n, max_size=n)).map(lambda b: xxhash.xxh3_64_digest(b) + b)


class TierContract(RuleBasedStateMachine):
    """Drive ``make_tier()`` and a ``MemoryTier`` reference with the same operations.

    Class knobs: ``namespaces`` and ``keys_per_namespace`` (the key universe), ``max_blob`` (bytes),
    ``exact`` (the tier never evicts: it must equal the reference), ``persistent`` (entries survive
    ``close()`` and a new ``make_tier()``).  Override ``make_tier`` (and ``teardown`` to clean up,
    calling ``super().teardown()``).
    """

    namespaces = 3
    keys_per_namespace = 6
    max_blob = 300
    exact = False
    persistent = False

    def __init__(self) -> None:
        super().__init__()
        self.reference = MemoryTier()
        self.tier = self.make_tier()
        self.universe = _universe(self.namespaces, self.keys_per_namespace)

    def make_tier(self) -> Tier:
        """The tier under test; the default is a ``MemoryTier``, which checks the machine itself."""
        return MemoryTier()

    def teardown(self) -> None:
        self.tier.close()

    # Strategies are built from the class knobs when rules run (``st.deferred``).
    _keys = st.deferred(lambda: st.runner().flatmap(
        lambda m: tier_keys(m.namespaces, m.keys_per_namespace)))
    _blobs = st.deferred(lambda: st.runner().flatmap(lambda m: blobs(m.max_blob)))
    _namespace_ids = st.deferred(lambda: st.runner().flatmap(
        lambda m: st.sampled_from(namespace_ids(m.namespaces))))

    def _agrees(self, key: bytes, got: Blob | None) -> None:
        want = self.reference.get(key)
        if got is None:
            assert not (self.exact and want is not None), f"exact tier lost key {key.hex()}"
        else:
            assert want is not None, f"tier returned a blob for key {key.hex()}, which was deleted or never put"
            assert bytes(got) == want, f"tier returned another blob for key {key.hex()} (stale or corrupt)"

    def _holds(self, key: bytes) -> bool:
        return self.tier.contains_prefix([key]) == 1

    @rule(key=_keys, blob=_blobs)
    def put(self, key: bytes, blob: bytes) -> None:
        stored = self.tier.put(key, bytearray(blob))  # the tier must copy: the caller's buffer changes next
        self.reference.put(key, blob)
        assert isinstance(stored, bool), f"put returned {stored!r}, not a bool"
        assert stored or not self.exact, "exact tier refused a put"
        if not stored:
            assert not self._holds(key), "a refused put left an older blob under its key"

    @rule(items=st.lists(st.tuples(_keys, _blobs), max_size=4))
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        stored = self.tier.put_many(items)
        self.reference.put_many(items)
        assert isinstance(stored, int) and 0 <= stored <= len(items), f"put_many returned {stored!r}"
        assert stored == len(items) or not self.exact, "exact tier refused a put"

    @rule(key=_keys)
    def get(self, key: bytes) -> None:
        self._agrees(key, self.tier.get(key))

    @rule(keys=st.lists(_keys, max_size=5))
    def get_many(self, keys: list[bytes]) -> None:
        got = self.tier.get_many(keys)
        assert len(got) == len(keys), "get_many returned the wrong number of results"
        for key, blob in zip(keys, got):
            self._agrees(key, blob)

    @rule(key=_keys)
    def read(self, key: bytes) -> None:
        self._agrees(key, self.tier.read(key, bytes))

    @rule(key=_keys)
    def get_is_stable(self, key: bytes) -> None:
        """A returned buffer must not change when the tier is written afterwards."""
        got = self.tier.get(key)
        if got is None:
            return
        before = bytes(got)
        for other in self.universe[:4]:
            self.tier.put(other, b"\xa5" * self.max_blob)
            self.reference.put(other, b"\xa5" * self.max_blob)
        self.tier.delete(key)
        self.reference.delete(key)
        assert bytes(got) == before, "a buffer returned by get changed under its holder"

    @rule(keys=st.lists(_keys, max_size=6, unique=True))
    def contains_prefix(self, keys: list[bytes]) -> None:
        n = self.tier.contains_prefix(keys)
        assert isinstance(n, int) and 0 <= n <= len(keys), f"contains_prefix returned {n!r}"
        for key in keys[:n]:
            assert self.reference.get(key) is not None, f"tier claims key {key.hex()} it should not have"
        if n < len(keys):
            assert not self._holds(keys[n]), "contains_prefix stopped on a key the tier holds"
            assert not (self.exact and self.reference.get(keys[n]) is not None), "exact tier lost a key"

    @rule(key=_keys)
    def delete(self, key: bytes) -> None:
        held = self._holds(key)
        removed = self.tier.delete(key)
        self.reference.delete(key)
        assert removed == held, f"delete returned {removed} for a key the tier {'held' if held else 'lacked'}"
        assert not self._holds(key) and self.tier.get(key) is None, "a deleted key is still there"

    @rule(ns_id=_namespace_ids)
    def drop_namespace(self, ns_id: bytes) -> None:
        held = sum(self._holds(k) for k in self.universe if k.startswith(ns_id))
        removed = self.tier.drop_namespace(ns_id)
        self.reference.drop_namespace(ns_id)
        allowed = (held,) if self.exact else (held, 0)  # a remote tier may not count
        assert removed in allowed, f"drop_namespace removed {removed} of {held} keys"
        assert not any(self._holds(k) for k in self.universe if k.startswith(ns_id)), "a dropped key survived"

    @precondition(lambda self: self.persistent)
    @rule()
    def reopen(self) -> None:
        held = [k for k in self.universe if self._holds(k)]
        self.tier.close()
        self.tier = self.make_tier()
        after = [k for k in self.universe if self._holds(k)]
        assert after == held, "entries were lost or appeared across close and reopen"

    @invariant()
    def tier_is_a_subset_of_the_reference(self) -> None:
        self.tier.check()
        self.reference.check()
        for key in self.universe:
            held = self._holds(key)
            assert not held or self.reference.get(key) is not None, f"tier holds key {key.hex()} it should not"
            assert held or not (self.exact and self.reference.get(key) is not None), "exact tier lost a key"

    @invariant()
    def accounting(self) -> None:
        used, cap = self.tier.used_bytes, self.tier.capacity_bytes
        assert isinstance(used, int) and used >= 0, f"used_bytes is {used!r}"
        assert cap is None or used <= cap, f"used_bytes {used} over capacity_bytes {cap}"
        stats = self.tier.stats()
        assert isinstance(stats, dict) and all(isinstance(k, str) for k in stats), "stats() is not a dict by name"


class TierFault(OSError):
    """The fault ``FaultyTier`` raises."""


class FaultyTier(Tier):
    """Wraps a tier and raises ``TierFault`` from the methods named in ``failing`` (a set you may
    change at any time) — for testing what sits above a tier when it fails.  ``calls`` counts
    calls by method name.  Thread-safe if the wrapped tier is."""

    def __init__(self, inner: Tier, failing: Iterable[str] = ()) -> None:
        self.inner = inner
        self.failing = set(failing)
        self.calls: dict[str, int] = {}
        self.name = f"faulty-{inner.name}"

    def _enter(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.failing:
            raise TierFault(f"injected fault in {method}")

    def get(self, key: bytes) -> Blob | None:
        self._enter("get")
        return self.inner.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        self._enter("get_many")
        return self.inner.get_many(keys)

    def read(self, key: bytes, consume: Callable[[memoryview], Any]) -> Any:
        self._enter("read")
        return self.inner.read(key, consume)

    def put(self, key: bytes, blob: Blob) -> bool:
        self._enter("put")
        return self.inner.put(key, blob)

    def put_many(self, items: Any) -> int:
        self._enter("put_many")
        return self.inner.put_many(items)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._enter("contains_prefix")
        return self.inner.contains_prefix(keys)

    def delete(self, key: bytes) -> bool:
        self._enter("delete")
        return self.inner.delete(key)

    def drop_namespace(self, ns_id: bytes) -> int:
        self._enter("drop_namespace")
        return self.inner.drop_namespace(ns_id)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def capacity_bytes(self) -> int | None:
        return self.inner.capacity_bytes

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self._enter("close")
        self.inner.close()

    def check(self) -> None:
        self.inner.check()
