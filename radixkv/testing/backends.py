"""The tier contract configured for each backend radixkv ships: what each one promises beyond the
base contract (exactness, LRU, byte accounting, slots, TTL, persistence), as knobs and overrides.

radixkv's own tests run them; subclass one to check a modified or wrapped backend against the same
promises (override ``make_tier``, keep the knobs)::

    from radixkv.testing.backends import CpuTierContract

    class MyCpuTierContract(CpuTierContract):
        def make_tier(self):
            return MyCpuTier(max_bytes=1024, slot_bytes=256)

    TestMyCpuTier = MyCpuTierContract.TestCase
"""

from __future__ import annotations

from radixkv.backends import MemoryTier, Tier
from radixkv.testing.contract import PersistentTierContract, TierContract

__all__ = ["CpuTierContract", "LmdbTierContract", "LmdbTtlTierContract", "MemoryTierContract"]


class MemoryTierContract(TierContract):
    """``MemoryTier``: exact (never evicts), ``used_bytes`` is the sum of the blobs."""

    exact = True
    used_bytes_exact = True

    def make_tier(self) -> Tier:
        """A new, empty ``MemoryTier``.  O(1)."""
        return MemoryTier()


class CpuTierContract(TierContract):
    """``CpuTier(max_bytes=1024, slot_bytes=256)``: 4 slots, LRU, one slot per entry, blobs over a
    slot refused (blobs go up to 300 bytes), ``consume`` may call back into the tier."""

    lru = True
    used_bytes_exact = True
    reentrant_consume = True

    def make_tier(self) -> Tier:
        """A new ``CpuTier(max_bytes=1024, slot_bytes=256)``: four slots.  Allocates its 1 KiB arena."""
        from radixkv.backends.cpu import CpuTier

        return CpuTier(max_bytes=1024, slot_bytes=256)

    def entry_bytes(self, size: int) -> int:
        """The tier's slot size, whatever ``size``: an entry takes a whole slot.  O(1) (builds the tier on
        first use)."""
        return int(getattr(self.tier, "slot_bytes"))

    def should_store(self, size: int) -> bool | None:
        """``size`` fits a slot; ``None`` before the slot size is set (a batch's later blobs may not fit),
        ``False`` when the slot is larger than the capacity (no slot was carved).  O(1)."""
        slot = int(getattr(self.tier, "slot_bytes"))
        if not slot:          # the first put sets the slot size when not given: later ones in a batch may not fit
            return None
        if slot > (self.capacity or 0):               # a first blob over max_bytes carved no slot at all
            return False
        return size <= slot


class LmdbTierContract(PersistentTierContract):
    """``LmdbTier(max_bytes=1000)`` in the example's directory, on the machine's clock: LRU by
    bytes (with batched access times), persistent across close and reopen."""

    lru = True
    used_bytes_exact = True

    def make_tier(self) -> Tier:
        """An ``LmdbTier`` in ``self.path`` (``max_bytes=1000``, a 1 MiB map, no fsync, access times
        written every 4 reads) on ``self.clock``, with the class's ``ttl``.  Opens the environment."""
        from radixkv.backends.lmdb import LmdbTier

        return LmdbTier(self.path, max_bytes=1000, map_size=1 << 20, sync=False, touch_every=4, clock=self.clock,
                        ttl=self.ttl)


class LmdbTtlTierContract(LmdbTierContract):
    """``LmdbTierContract`` with entries that expire 5 seconds (of the machine's clock) after they
    are written."""

    ttl = 5.0
