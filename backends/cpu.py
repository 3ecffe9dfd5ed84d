"""``CpuTier``: chunks in host memory, LRU by bytes, from one preallocated arena of fixed slots.

Storage contract:

* One arena of ``max_bytes`` is allocated when the tier is built, carved into equal slots of
  ``slot_bytes``; a blob takes one slot.  With an accelerator (``torch.accelerator``) the arena is
  pinned, so loads into device memory are DMA copies — pinning once, not per chunk, because
  pinning is slow.  Without one it is plain memory; the code is the same.
* ``slot_bytes`` defaults to the first blob's size rounded up to 64 bytes.  All chunks of one
  layout and chunk size have the same size (``radixkv.core.format.encoded_size``), so pass that when
  several layouts share a tier.  A blob larger than a slot is not stored (``put`` returns
  ``False``, counted as ``rejected``).
* LRU over whole slots by default, or another ``policy`` (``radixkv.core.policy``: ``"s3fifo"``, the
  admission filter ``"second_hit"``, or a ``Policy`` object): every operation is O(1)
  (``drop_namespace`` scans the keys).  ``get`` and ``read`` count as accesses; ``contains_prefix``
  does not.  ``pin(keys)`` keeps keys from eviction (now or once stored) until ``unpin``; at most
  ``max_pinned`` keys (default half the slots) can be pinned, so pins cannot fill the tier.
* Thread-safe.  Copies run outside the lock: a put reserves its slot first, and a read leases its
  slot, so a slot being read is never reused until the read is done (an evicted or overwritten
  leased slot is retired and freed when its last lease ends).  ``get`` returns its own copy.
* Not shared between processes and not durable: the arena dies with the process.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from radixkv.core._checks import check_int
from radixkv.backends import Blob, Entry, EvictionLog, Tier, blob_view, check_key, check_namespace_id, count_leading
from radixkv.core.policy import Policy, make_policy

__all__ = ["CpuTier", "Lease"]

T = TypeVar("T")
_ALIGN = 64  # slot starts stay aligned for any dtype view of a payload


class Lease(NamedTuple):
    """A hold on one blob in place (``CpuTier.lease``): its slot, and where the blob lies in the
    tier's ``arena`` (byte ``offset``, ``length``)."""

    slot: int
    offset: int
    length: int


def _allocate_arena(nbytes: int, pinned: bool) -> torch.Tensor:
    """The one allocation that differs between the pinned and the plain path."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class CpuTier(Tier):
    """Host-memory tier of ``max_bytes``; see the module docstring for the storage contract.

    >>> tier = CpuTier(max_bytes=256, slot_bytes=128)      # two slots
    >>> for i in range(3):
    ...     _ = tier.put(bytes([i]) * 24, b"x" * 100)
    >>> tier.contains_prefix([bytes([1]) * 24, bytes([2]) * 24, bytes([0]) * 24])   # 0 evicted
    2
    """

    name = "cpu"
    victim = True
    in_memory = True

    def __init__(self, max_bytes: int, *, slot_bytes: int | None = None, pinned: bool | None = None,
                 policy: str | Policy | None = None, max_pinned: int | None = None) -> None:
        check_int(max_bytes, "max_bytes")
        if slot_bytes is not None and (isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int)
                                       or slot_bytes < 1):
            raise ValueError(f"slot_bytes must be a positive int or None, got {slot_bytes!r}")
        self.pinned = torch.accelerator.is_available() if pinned is None else bool(pinned)
        self._arena = _allocate_arena(max_bytes, self.pinned)
        self._memory = self._arena.numpy()  # shares the arena's memory
        self._max_bytes = max_bytes
        self._slot_bytes = 0
        self._num_slots = 0
        self._free: list[int] = []
        if slot_bytes is not None:
            self._carve(slot_bytes)
        self._lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (slot, length); oldest first
        # Another policy than LRU orders the keys itself (then _lru's order is not used).
        self._policy: Policy | None = None if policy in (None, "lru") else make_policy(policy)
        self._pins: set[bytes] = set() if self._policy is None else self._policy.pinned
        if max_pinned is not None:
            check_int(max_pinned, "max_pinned")
        self._max_pinned = max_pinned
        self._reserved: set[int] = set()  # slots being filled by a put
        self._leases: Counter[int] = Counter()  # slot -> reads in progress
        self._retired: set[int] = set()  # leased slots whose key is gone; freed by the last release
        self._lock = threading.Lock()
        self._counts = Counter({"hits": 0, "misses": 0, "puts": 0, "evictions": 0, "rejected": 0,
                                "not_admitted": 0})
        self._evicted = EvictionLog()

    def expect(self, blob_bytes: int) -> None:
        """Size the slots for blobs of up to ``blob_bytes`` if no slot size is set yet (given or
        taken from a first blob); later hints are ignored.  O(slots) once."""
        with self._lock:
            if not self._slot_bytes and blob_bytes > 0:
                self._carve(blob_bytes)

    def _carve(self, slot_bytes: int) -> None:
        self._slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self._num_slots = self._max_bytes // self._slot_bytes
        self._free = list(range(self._num_slots - 1, -1, -1))

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (0 until the first put when not given)."""
        return self._slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots not free (held, being filled, or retired while read).  O(1)."""
        return (self._num_slots - len(self._free)) * self._slot_bytes

    @property
    def capacity_bytes(self) -> int:
        """``max_bytes``, the arena's size (only whole slots of it are used).  O(1)."""
        return self._max_bytes

    def _release_slot(self, slot: int) -> None:
        # Lock held.  A slot that lost its key goes back to the free list unless a read has it.
        if self._leases[slot]:
            self._retired.add(slot)
        else:
            self._free.append(slot)

    def _acquire(self, key: bytes) -> tuple[int, int] | None:
        """Lease the slot of ``key`` (marking it most recently used); ``None`` on a miss."""
        check_key(key)
        with self._lock:
            entry = self._lru.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            if self._policy is None:
                self._lru.move_to_end(key)
            else:
                self._policy.accessed(key)
            self._leases[entry[0]] += 1
            self._counts["hits"] += 1
            return entry

    def _unlease(self, slot: int) -> None:
        with self._lock:
            self._leases[slot] -= 1
            if not self._leases[slot]:
                del self._leases[slot]
                if slot in self._retired:
                    self._retired.discard(slot)
                    self._free.append(slot)

    @property
    def arena(self) -> torch.Tensor:
        """The one uint8 tensor every slot is carved from (registered once with a transfer engine
        such as NIXL, so that peers read leased blobs in place).  O(1)."""
        return self._arena

    def lease(self, key: bytes) -> Lease | None:
        """Hold the blob of ``key`` in place for a reader outside the tier (a peer's read of
        ``arena``): its slot is not reused, whatever happens to ``key``, until ``unlease``; ``None``
        on a miss.  Counts as an access.  Every lease must be ended exactly once.  O(1)."""
        entry = self._acquire(key)
        if entry is None:
            return None
        slot, length = entry
        return Lease(slot, slot * self._slot_bytes, length)

    def unlease(self, lease: Lease) -> None:
        """End ``lease``: its slot may be reused (freed now if its key is gone).  O(1)."""
        self._unlease(lease.slot)

    def read(self, key: bytes, consume: Callable[[memoryview], T]) -> T | None:
        """``consume`` on the blob in its arena slot, without a copy; the slot is leased (never
        reused) until ``consume`` returns.  O(1) plus ``consume``.  ``consume`` may call back into
        the tier."""
        entry = self._acquire(key)
        if entry is None:
            return None
        slot, length = entry
        start = slot * self._slot_bytes
        try:
            return consume(self._memory[start:start + length].data)
        finally:
            self._unlease(slot)

    def get(self, key: bytes) -> bytes | None:
        """A copy of the blob (copied outside the lock, from a leased slot).  O(1) plus the copy."""
        return self.read(key, bytes)

    def put(self, key: bytes, blob: Blob) -> bool:
        """Copy ``blob`` into a slot, evicting least recently used keys if none is free.  O(1)
        amortised plus the copy, which runs outside the lock into a reserved slot."""
        check_key(key)
        view = blob_view(blob)
        with self._lock:
            self._counts["puts"] += 1
            if not self._slot_bytes:
                self._carve(max(len(view), 1))
            if len(view) > self._slot_bytes:
                self._counts["rejected"] += 1
                self._forget(key)
                return False
            if key not in self._lru and self._policy is not None and not self._policy.admit(key):
                self._counts["rejected"] += 1          # every refused put; not_admitted: the policy's
                self._counts["not_admitted"] += 1
                return False
            self._forget(key)
            while not self._free and self._lru:
                victim = self._victim()
                if victim is None:
                    break                      # every entry is pinned
                self._counts["evictions"] += 1
                self._forget(victim)
                self._evicted.note((victim,))
            if not self._free:  # every slot is being read or filled right now
                self._counts["rejected"] += 1
                return False
            slot = self._free.pop()
            self._reserved.add(slot)
        start = slot * self._slot_bytes
        self._memory[start:start + len(view)] = np.frombuffer(view, dtype=np.uint8)
        with self._lock:
            self._reserved.discard(slot)
            self._forget(key)  # a concurrent put of the same key finished first
            self._lru[key] = (slot, len(view))
            if self._policy is not None:
                self._policy.inserted(key)
        return True

    def _forget(self, key: bytes) -> bool:
        # Lock held.  Drop key's entry (its slot freed once no read holds it); whether it had one.
        entry = self._lru.pop(key, None)
        if entry is None:
            return False
        if self._policy is not None:
            self._policy.removed(key)
        self._release_slot(entry[0])
        return True

    def _victim(self) -> bytes | None:
        # Lock held.  The next key to evict: the policy's, or the least recently used unpinned one.
        if self._policy is not None:
            return self._policy.victim()
        return next((k for k in self._lru if k not in self._pins), None)

    def take_evicted(self) -> list[bytes] | None:
        """The keys evicted to make room since the last call (``Tier.take_evicted``).  O(keys)."""
        return self._evicted.take()

    def pin(self, keys: Sequence[bytes]) -> int:
        """Keep ``keys`` from eviction, held now or stored later, until ``unpin``; the number pinned
        (they stop at ``max_pinned``, default half the slots).  O(len(keys))."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            bound = self._max_pinned if self._max_pinned is not None else max(self._num_slots // 2, 1)
            count = 0
            for key in keys:
                if key not in self._pins and len(self._pins) >= bound:
                    break
                self._pins.add(key)
                count += 1
            return count

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Let ``keys`` be evicted again; the number that were pinned.  O(len(keys))."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            held = [k for k in keys if k in self._pins]
            self._pins.difference_update(held)
            return len(held)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys held; does not touch LRU order.  O(len(keys))."""
        with self._lock:
            return count_leading(keys, self._lru)

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; its slot is free once no read holds it.  O(1)."""
        check_key(key)
        with self._lock:
            return self._forget(key)

    def drop_namespace(self, ns_id: bytes) -> int:
        """Remove every key of the namespace.  O(entries held)."""
        check_namespace_id(ns_id)
        with self._lock:
            doomed = [k for k in self._lru if k.startswith(ns_id)]
            for k in doomed:
                self._forget(k)
            self._pins.difference_update([k for k in self._pins if k.startswith(ns_id)])
        return len(doomed)

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """A snapshot of the entries, least recently used first (no stamps: the tier keeps an
        order, not times), with their pins.  O(entries) under the lock."""
        if ns_id is not None:
            check_namespace_id(ns_id)
        with self._lock:
            held = [Entry(k, n, None, k in self._pins) for k, (_, n) in self._lru.items()
                    if ns_id is None or k.startswith(ns_id)]
        return iter(held)

    def stats(self) -> dict[str, int | float]:
        """The counters (``hits``, ``misses``, ``puts``, ``evictions``, ``rejected``; ``not_admitted``: puts
        the policy refused) and ``entries``, ``slots``, ``pinned`` (keys pinned, held now or
        stored later: ``pin``), ``slot_bytes``, ``used_bytes``, ``capacity_bytes`` and
        ``pinned_memory`` (1 if the arena is in page-locked memory).  O(1) under the lock."""
        with self._lock:
            return {**self._counts, "entries": len(self._lru), "slots": self._num_slots, "pinned": len(self._pins),
                    "slot_bytes": self._slot_bytes, "used_bytes": self.used_bytes,
                    "capacity_bytes": self._max_bytes, "pinned_memory": int(self.pinned)}

    def close(self) -> None:
        """Forget every entry.  The arena is freed when the tier is garbage collected."""
        with self._lock:
            for key in list(self._lru):
                self._forget(key)

    def check(self) -> None:
        """Every slot is in exactly one state: free, held by a key, reserved or retired."""
        super().check()
        with self._lock:
            held = [slot for slot, _ in self._lru.values()]
            states = [*self._free, *held, *self._reserved, *self._retired]
            assert sorted(states) == list(range(self._num_slots)), "a slot is lost or in two states"
            assert all(0 <= n <= self._slot_bytes for _, n in self._lru.values()), "entry larger than its slot"
            assert all(self._leases[s] > 0 for s in self._retired), "retired slot without a lease"
            assert set(self._leases) <= set(held) | self._retired, "lease on a free or reserved slot"
            assert self._arena.numel() == self._max_bytes and self._arena.is_pinned() == self.pinned
            if self._policy is not None:
                self._policy.check(set(self._lru))
