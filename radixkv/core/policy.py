"""Eviction and admission policies: the small strategy objects a tier asks what to keep.

A tier owns its entries and its storage; a policy only orders the keys.  The tier tells it what
happened (``inserted``, ``accessed``, ``removed``), asks it before storing a new key (``admit``) and
when it needs room (``victim``: the key to evict next — the tier then removes it and says so).
Pinned keys (``pin``) are never a victim; at most ``max_pinned`` keys can be pinned, so pins cannot
fill a tier.  Every method is O(1) amortised unless it says otherwise; a policy is not thread-safe
(the tier calls it under its own lock).

* ``LRU``: least recently used first (what every tier did before policies).
* ``S3FIFO``: the scan-resistant policy of Yang et al. (SOSP '23): new keys enter a small FIFO
  (10% of the entries); a key accessed there moves to the main FIFO when it reaches the small
  FIFO's end, the others leave and are remembered in a ghost FIFO, and a remembered key comes back
  straight into the main FIFO.  One-time chunks (a long unique turn, a scan) never push out the
  hot ones (a shared system prompt).
* ``SecondHit(inner)``: an admission filter (NVIDIA Dynamo's KVBM stores a block on disk only once
  it has been seen twice): a key is admitted the second time it is offered within the last
  ``memory`` distinct keys; ordering is ``inner``'s.

>>> p = LRU()
>>> for k in (b"a", b"b", b"c"):
...     p.inserted(k)
>>> p.accessed(b"a"); p.victim()
b'b'
>>> p.pin(b"b"), p.victim()
(True, b'c')
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from radixkv.core._checks import check_int

__all__ = ["LRU", "POLICY_NAMES", "Policy", "S3FIFO", "SecondHit", "make_policy"]


class Policy:
    """The interface (and the pin bookkeeping every policy shares).  ``max_pinned`` bounds how many
    keys may be pinned at once (``None``: no bound)."""

    name = "policy"

    def __init__(self, max_pinned: int | None = None) -> None:
        if max_pinned is not None:
            check_int(max_pinned, "max_pinned")
        self.max_pinned = max_pinned
        self.pinned: set[bytes] = set()

    # -- what the tier reports -----------------------------------------------------------------

    def admit(self, key: bytes) -> bool:
        """Whether a new ``key`` may be stored (``False``: the put is refused).  Does not insert."""
        return True

    def inserted(self, key: bytes) -> None:
        """``key`` is now stored (it was not)."""
        raise NotImplementedError

    def accessed(self, key: bytes) -> None:
        """``key`` (stored) was read."""
        raise NotImplementedError

    def removed(self, key: bytes) -> None:
        """``key`` is gone (deleted, evicted, replaced).  A key the policy does not hold is ignored."""
        raise NotImplementedError

    def victim(self) -> bytes | None:
        """The stored, unpinned key to evict next (the tier removes it and calls ``removed``), or
        ``None`` when every stored key is pinned."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        """Never evict ``key`` (stored now or later) until ``unpin``; ``False`` when ``max_pinned``
        keys are pinned already (nothing changes then)."""
        if key in self.pinned:
            return True
        if self.max_pinned is not None and len(self.pinned) >= self.max_pinned:
            return False
        self.pinned.add(key)
        return True

    def unpin(self, key: bytes) -> bool:
        """Let ``key`` be evicted again; whether it was pinned."""
        if key in self.pinned:
            self.pinned.discard(key)
            return True
        return False

    def check(self, stored: set[bytes] | None = None) -> None:
        """Assert the policy's invariants (and, given the tier's keys, that it orders exactly them)."""
        assert self.max_pinned is None or len(self.pinned) <= self.max_pinned, \
            f"{len(self.pinned)} keys pinned, over the bound {self.max_pinned}"


class LRU(Policy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, max_pinned: int | None = None) -> None:
        super().__init__(max_pinned)
        self._order: OrderedDict[bytes, None] = OrderedDict()    # oldest first

    def inserted(self, key: bytes) -> None:
        """Put ``key`` at the most recently used end.  O(1)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: bytes) -> None:
        """Move ``key`` to the most recently used end; a key not ordered is ignored.  O(1)."""
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        """Drop ``key`` from the order.  O(1)."""
        self._order.pop(key, None)

    def victim(self) -> bytes | None:
        """O(1), plus one step per pinned key in front (pins are bounded)."""
        for key in self._order:
            if key not in self.pinned:
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def check(self, stored: set[bytes] | None = None) -> None:
        """The base's pin bound and, given ``stored``, that the order holds exactly those keys.  O(1), or
        O(entries) with ``stored``."""
        super().check(stored)
        if stored is not None:
            assert set(self._order) == stored, "LRU order differs from the tier's keys"


class S3FIFO(Policy):
    """S3-FIFO over ``capacity`` entries (the tier's slots; learned from the entries when 0)."""

    name = "s3fifo"

    def __init__(self, capacity: int = 0, max_pinned: int | None = None, small_fraction: float = 0.1) -> None:
        super().__init__(max_pinned)
        check_int(capacity, "capacity")
        if not 0 < small_fraction < 1:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        self.capacity = capacity
        self.small_fraction = small_fraction
        self._small: OrderedDict[bytes, None] = OrderedDict()    # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._evicting: set[bytes] = set()          # victims handed out, not yet removed

    def _size(self) -> int:
        return max(self.capacity, len(self._small) + len(self._main), 1)

    def inserted(self, key: bytes) -> None:
        """Queue ``key`` with frequency 0 in the small FIFO, or in the main FIFO when the ghost FIFO
        remembers it (it leaves the ghost).  O(1)."""
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def accessed(self, key: bytes) -> None:
        """Raise ``key``'s frequency by one, up to 3; nothing moves until ``victim`` reads it.  A key not
        queued is ignored.  O(1)."""
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def removed(self, key: bytes) -> None:
        """A key deleted while held (not evicted: ``victim`` remembers those itself) is remembered
        in the ghost FIFO too, so that it comes back into the main FIFO: under exclusive tiering a
        delete means the chunk moved up into the pool — it is hot, not cold."""
        if key in self._freq:
            del self._freq[key]
            self._small.pop(key, None)
            self._main.pop(key, None)
            if key not in self._evicting:
                self._ghost[key] = None
                while len(self._ghost) > self._size():
                    self._ghost.popitem(last=False)
        self._evicting.discard(key)

    def victim(self) -> bytes | None:
        """Amortised O(1): each key moves from small to main at most once per insertion, and is
        re-queued in main at most 3 times per access burst; pinned keys are re-queued."""
        budget = 4 * (len(self._small) + len(self._main)) + 1
        while budget > 0 and (self._small or self._main):
            budget -= 1
            if self._small and (len(self._small) >= self.small_fraction * self._size() or not self._main):
                key = next(iter(self._small))
                del self._small[key]
                if self._freq[key] > 0 or key in self.pinned:
                    self._freq[key] = 0
                    self._main[key] = None            # accessed while new: worth keeping
                    continue
                self._small[key] = None               # back in place; the tier removes it
                self._small.move_to_end(key, last=False)
                self._ghost[key] = None
                while len(self._ghost) > self._size():
                    self._ghost.popitem(last=False)
                self._evicting.add(key)
                return key
            key = next(iter(self._main))
            if self._freq[key] > 0 or key in self.pinned:
                self._freq[key] = max(0, self._freq[key] - 1)
                self._main.move_to_end(key)
                continue
            self._evicting.add(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def check(self, stored: set[bytes] | None = None) -> None:
        """The base's pin bound; no key in both FIFOs; a frequency in [0, 3] for exactly the queued keys;
        given ``stored``, that they are those keys.  O(entries)."""
        super().check(stored)
        assert not set(self._small) & set(self._main), "a key in both FIFOs"
        assert set(self._freq) == set(self._small) | set(self._main), "frequencies for keys not queued"
        assert all(0 <= f <= 3 for f in self._freq.values()), "frequency out of [0, 3]"
        if stored is not None:
            assert set(self._freq) == stored, "S3-FIFO queues differ from the tier's keys"


class SecondHit(Policy):
    """Admit a key the second time it is offered within the last ``memory`` offered keys; order
    by ``inner`` (default ``LRU``).  Pins go to ``inner`` and admit at once."""

    name = "second_hit"

    def __init__(self, inner: Policy | None = None, memory: int = 4096) -> None:
        self.inner = inner if inner is not None else LRU()
        super().__init__(self.inner.max_pinned)
        check_int(memory, "memory", 1)
        self.memory = memory
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.pinned = self.inner.pinned

    def admit(self, key: bytes) -> bool:
        """A key offered before (among the last ``memory`` refused keys) or pinned is forgotten and goes to
        ``inner.admit``; any other is remembered (the oldest past ``memory`` forgotten) and refused.
        O(1) amortised plus ``inner.admit``."""
        if key in self._seen or key in self.pinned:
            self._seen.pop(key, None)
            return self.inner.admit(key)
        self._seen[key] = None
        while len(self._seen) > self.memory:
            self._seen.popitem(last=False)
        return False

    def inserted(self, key: bytes) -> None:
        """``inner.inserted``: the filter orders nothing itself.  ``inner``'s cost."""
        self.inner.inserted(key)

    def accessed(self, key: bytes) -> None:
        """``inner.accessed``.  ``inner``'s cost."""
        self.inner.accessed(key)

    def removed(self, key: bytes) -> None:
        """``inner.removed``; the admission memory is left as it is.  ``inner``'s cost."""
        self.inner.removed(key)

    def victim(self) -> bytes | None:
        """``inner.victim``.  ``inner``'s cost."""
        return self.inner.victim()

    def pin(self, key: bytes) -> bool:
        """``inner.pin``: the filter shares ``inner``'s pinned set and ``max_pinned``.  ``inner``'s cost."""
        return self.inner.pin(key)

    def unpin(self, key: bytes) -> bool:
        """``inner.unpin`` (the pinned set is ``inner``'s).  ``inner``'s cost."""
        return self.inner.unpin(key)

    def __len__(self) -> int:
        return len(self.inner)

    def check(self, stored: set[bytes] | None = None) -> None:
        """``inner.check`` (the pin bound, and the keys given ``stored``), then the admission memory's
        bound.  ``inner``'s cost plus O(1)."""
        self.inner.check(stored)
        assert len(self._seen) <= self.memory, "admission memory over its bound"


_POLICIES: dict[str, Callable[[int, int | None], Policy]] = {
    "lru": lambda capacity, max_pinned: LRU(max_pinned),
    "s3fifo": lambda capacity, max_pinned: S3FIFO(capacity, max_pinned),
    "second_hit": lambda capacity, max_pinned: SecondHit(LRU(max_pinned), memory=max(capacity, 64)),
}


#: The names ``make_policy`` (and the ``cache_policy`` configuration key) accept.
POLICY_NAMES = frozenset(_POLICIES)


def make_policy(policy: str | Policy | None, capacity: int = 0, max_pinned: int | None = None) -> Policy:
    """A policy from a name (``"lru"``, ``"s3fifo"``, ``"second_hit"``), a ready ``Policy``, or
    ``None`` (LRU).  ``ValueError`` names an unknown one.  O(1)."""
    if policy is None:
        policy = "lru"
    if isinstance(policy, Policy):
        return policy
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)} or a radixkv.core.policy.Policy, got {policy!r}")
    return _POLICIES[policy](capacity, max_pinned)
