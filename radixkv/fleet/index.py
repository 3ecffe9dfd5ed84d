"""The fleet index: which engine instance holds which prefix, from their KV events.

Each instance (a vLLM engine, a radixkv cache) publishes what it stores and drops as KV events
(``radixkv.fleet.events``).  ``Index`` applies the batches of any number of instances and answers,
for a prompt's chain of block hashes (``radixkv.fleet.hashing``), how many leading blocks each
instance holds and on which medium: what a router needs to send the request where its prefix is.

Contract:

* **Holdings.**  Per instance and medium (``"GPU"``, ``"CPU"``, ``"STORAGE"``, any other name,
  upper-cased, or ``None``) the set of block hashes it holds, each with its parent (the block
  before it in the chain that stored it).  ``BlockStored`` adds its chain; ``BlockRemoved`` drops
  its blocks from that medium (blocks the index never saw stored are ignored);
  ``AllBlocksCleared`` drops what the instance holds on the GPU medium (``"GPU"``, or an event
  that names no medium): vLLM sends it when it resets its prefix cache, which empties its GPU
  pool, not what radixkv's tiers below it (``CPU``, ``STORAGE``) still hold.  The events of
  every KV-cache group are applied alike (``group_idx`` is not looked at).
* **Sequence numbers.**  ``apply(instance, seq, batch)`` expects each batch of an instance once,
  in order (``Subscriber`` delivers them so).  The first batch of an instance starts its run at
  its ``seq``.  A batch past the next expected one is a *gap*: the batch waits (at most
  ``max_pending`` per instance) and the instance is *stale* until the missing batches arrive (a
  replay), when the waiting ones are applied in order.  ``skip_gap(instance)``, or more than
  ``max_pending`` waiting batches, gives up on the gap: the instance's holdings are dropped and it
  goes on from the first waiting batch, so that the index holds a *subset* of what the instance
  holds (misses, never false hits: the gap may have hidden removals, never hides blocks that stay).
  A ``seq`` below the next expected one is a *restart* (vLLM counts from 0 after every start):
  the instance's holdings are dropped and a new run starts at ``seq``.
* **Memory.**  At most ``max_blocks`` distinct block hashes per instance (a block on two media
  counts once): past that the instance's oldest stored blocks go first (a block stored again
  counts as new).  Chains are stored root first, so eviction cuts the oldest chains at their root;
  the rest of a cut chain can no longer match (``lookup`` walks from the root) and is next in line.
  Plus ``max_pending`` waiting batches per instance.  ``bench fleet_index`` measures the bytes a
  block costs.
* **Lookup.**  ``lookup(block_hashes)`` -> ``{instance: Match(blocks, medium)}``: for each instance
  the longest leading run of ``block_hashes`` it holds on one medium, and that medium; where two
  media hold runs of the same length, the faster (GPU, CPU, STORAGE, others by name, ``None``).
  Instances matching nothing are left out; stale instances too unless ``include_stale=True``.
  Cost: O(matched blocks + instances): one dict probe a block for the whole fleet (holders are
  bitmasks), not one per instance.
* Hashes are compared as given (ints or bytes): feed the index the form your engines publish.

>>> from radixkv.fleet.events import BlockStored, EventBatch
>>> idx = Index()
>>> idx.apply("a", 0, EventBatch(ts=0.0, events=[BlockStored(block_hashes=[1, 2, 3],
...     parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="GPU",
...     lora_name=None)]))
>>> idx.lookup([1, 2, 9])
{'a': Match(blocks=2, medium='GPU')}
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterable, NamedTuple, Sequence

__all__ = ["MEDIA", "Index", "Match", "Spread"]

#: The media vLLM names, fastest first.
MEDIA = ("GPU", "CPU", "STORAGE")
_RANK = {m: i for i, m in enumerate(MEDIA)}

Medium = str | None
BlockHash = Hashable                                      # int (the default) or bytes


class Match(NamedTuple):
    """An instance's answer to ``Index.lookup``: ``blocks`` leading blocks held on ``medium``."""

    blocks: int
    medium: Medium


class Spread(NamedTuple):
    """An instance's answer to ``Index.lookup_spread``: ``blocks`` leading blocks each held on some
    medium, and how many of them each medium is the fastest holder of (``by_medium``)."""

    blocks: int
    by_medium: tuple[tuple[Medium, int], ...]


def medium_key(medium: object) -> Medium:
    """The index's name for an event's ``medium``: upper-cased; ``None`` stays ``None``."""
    if medium is None:
        return None
    if not isinstance(medium, str):
        raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
    return medium.upper()


def medium_rank(medium: Medium) -> tuple[int, str]:
    """Sort key of media, fastest first: GPU, CPU, STORAGE, others by name, ``None``."""
    if medium is None:
        return (len(MEDIA) + 1, "")
    return (_RANK.get(medium, len(MEDIA)), medium)


class _Instance:
    """One instance's state: its blocks (hash -> parent, oldest first), media bits, sequence."""

    __slots__ = ("name", "blocks", "bits", "media", "next_seq", "pending")

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocks: OrderedDict[BlockHash, BlockHash | None] = OrderedDict()
        self.bits = 0                                  # OR of this instance's medium bits
        self.media: dict[Medium, int] = {}             # medium -> its bit
        self.next_seq: int | None = None
        self.pending: dict[int, Any] = {}              # seq -> batch waiting for a gap


class Index:
    """Block-hash holdings of a fleet of instances, fed by their KV events (see the module docstring)."""

    def __init__(self, max_blocks: int = 4_000_000, max_pending: int = 1024) -> None:
        for name, value in (("max_blocks", max_blocks), ("max_pending", max_pending)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self._instances: dict[str, _Instance] = {}
        self._holders: dict[BlockHash, int] = {}       # hash -> bits of the (instance, medium) holding it
        self._owner: dict[int, tuple[_Instance, Medium]] = {}   # bit index -> (instance, medium)
        self._free_bits: list[int] = []
        self._next_bit = 0

    # ---- events -------------------------------------------------------------------------------

    def apply(self, instance: str, seq: int, batch: Any) -> None:
        """Apply ``batch`` (an ``EventBatch``, ours or vLLM's) of ``instance`` numbered ``seq``.
        Cost: O(blocks in the batch), plus the waiting batches a filled gap releases; a restart
        or a clear O(blocks the instance held)."""
        if not isinstance(instance, str):
            raise TypeError(f"instance must be a str, got {type(instance).__name__}")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int, got {type(seq).__name__}")
        events = getattr(batch, "events", None)
        if not isinstance(events, list):
            raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
        inst = self._instances.get(instance)
        if inst is None:
            inst = self._instances[instance] = _Instance(instance)
        if inst.next_seq is None or seq < inst.next_seq:
            if inst.next_seq is not None:             # a restart
                self._drop_all(inst)
                inst.pending.clear()
            inst.next_seq = seq
        if seq > inst.next_seq:
            inst.pending[seq] = batch
            if len(inst.pending) > self.max_pending:
                self.skip_gap(instance)
            return
        self._apply_events(inst, events)
        inst.next_seq = seq + 1
        self._drain(inst)

    def skip_gap(self, instance: str) -> None:
        """Give up waiting for the batches ``instance`` is missing: drop its holdings and go on
        from its first waiting batch (a no-op when it is not stale).  O(blocks it held)."""
        inst = self._get(instance)
        if not inst.pending:
            return
        self._drop_all(inst)
        inst.next_seq = min(inst.pending)
        self._drain(inst)

    def remove(self, instance: str) -> None:
        """Forget ``instance`` (it left the fleet).  O(blocks it held)."""
        inst = self._get(instance)
        self._drop_all(inst)
        for bit in inst.media.values():
            del self._owner[bit]
            self._free_bits.append(bit)
        del self._instances[instance]

    def _drain(self, inst: _Instance) -> None:
        while inst.next_seq in inst.pending:
            batch = inst.pending.pop(inst.next_seq)
            self._apply_events(inst, batch.events)
            inst.next_seq += 1

    def _bit(self, inst: _Instance, medium: Medium) -> int:
        bit = inst.media.get(medium)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit + 1
            inst.media[medium] = bit
            inst.bits |= 1 << bit
            self._owner[bit] = (inst, medium)
        return bit

    def _apply_events(self, inst: _Instance, events: Iterable[Any]) -> None:
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(inst, ev.block_hashes, ev.parent_block_hash, medium_key(ev.medium))
            elif kind == "BlockRemoved":
                self._removed(inst, ev.block_hashes, medium_key(ev.medium))
            elif kind == "AllBlocksCleared":
                self._cleared(inst)
            else:
                raise TypeError(f"batch holds an unknown event {kind}")

    def _stored(self, inst: _Instance, hashes: Sequence[BlockHash], parent: BlockHash | None,
                medium: Medium) -> None:
        mask = 1 << self._bit(inst, medium)
        blocks, holders = inst.blocks, self._holders
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            blocks[h] = parent
            holders[h] = holders.get(h, 0) | mask
            parent = h
        over = len(blocks) - self.max_blocks
        if over > 0:
            keep = ~inst.bits
            for _ in range(over):
                h, _parent = blocks.popitem(last=False)
                left = holders[h] & keep
                if left:
                    holders[h] = left
                else:
                    del holders[h]

    def _removed(self, inst: _Instance, hashes: Sequence[BlockHash], medium: Medium) -> None:
        bit = inst.media.get(medium)
        if bit is None:
            return
        mask, holders = 1 << bit, self._holders
        for h in hashes:
            held = holders.get(h, 0)
            if not held & mask:
                continue
            held &= ~mask
            if held:
                holders[h] = held
            else:
                del holders[h]
            if not held & inst.bits:
                del inst.blocks[h]

    def _cleared(self, inst: _Instance) -> None:
        """``AllBlocksCleared``: the instance's GPU medium (named ``GPU`` or not named) is empty."""
        bits = [inst.media[m] for m in ("GPU", None) if m in inst.media]
        if not bits:
            return
        drop = 0
        for bit in bits:
            drop |= 1 << bit
        holders, gone = self._holders, []
        for h in inst.blocks:
            held = holders[h]
            if not held & drop:
                continue
            held &= ~drop
            if held:
                holders[h] = held
            else:
                del holders[h]
            if not held & inst.bits:
                gone.append(h)
        for h in gone:
            del inst.blocks[h]

    def _drop_all(self, inst: _Instance) -> None:
        keep, holders = ~inst.bits, self._holders
        for h in inst.blocks:
            left = holders[h] & keep
            if left:
                holders[h] = left
            else:
                del holders[h]
        inst.blocks.clear()

    # ---- queries ------------------------------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash], include_stale: bool = False) -> dict[str, Match]:
        """For each instance, the longest leading run of ``block_hashes`` it holds on one medium
        (see the module docstring).  O(matched blocks + instances)."""
        active = 0
        for inst in self._instances.values():
            if include_stale or not inst.pending:
                active |= inst.bits
        runs: dict[int, int] = {}
        get = self._holders.get
        n = 0
        for h in block_hashes:
            if not active:
                break
            held = get(h, 0) & active
            if held != active:
                gone = active & ~held
                while gone:
                    low = gone & -gone
                    runs[low.bit_length() - 1] = n
                    gone ^= low
                active = held
            n += 1
        while active:
            low = active & -active
            runs[low.bit_length() - 1] = n
            active ^= low
        best: dict[str, Match] = {}
        for bit, blocks in runs.items():
            if not blocks:
                continue
            inst, medium = self._owner[bit]
            now = best.get(inst.name)
            if now is None or blocks > now.blocks or (
                    blocks == now.blocks and medium_rank(medium) < medium_rank(now.medium)):
                best[inst.name] = Match(blocks, medium)
        return best

    def lookup_spread(self, block_hashes: Iterable[BlockHash], include_stale: bool = False) -> dict[str, Spread]:
        """For each instance, the longest leading run of ``block_hashes`` it holds on *any* of its
        media (a prefix whose head is in the GPU pool and whose tail went down to the CPU tier is
        one run, as the instance's cache would match it), with how many blocks each medium is the
        fastest holder of: what it costs that instance to serve the prefix.  Instances matching
        nothing are left out.  O(matched blocks x instances)."""
        alive = [(inst, inst.bits) for inst in self._instances.values()
                 if inst.bits and (include_stale or not inst.pending)]
        counts: dict[str, dict[Medium, int]] = {}
        get = self._holders.get
        for h in block_hashes:
            held = get(h, 0)
            if not held:
                break
            still = []
            for inst, mask in alive:
                bits = held & mask
                if not bits:
                    continue
                fastest: Medium = None
                first = True
                while bits:
                    low = bits & -bits
                    medium = self._owner[low.bit_length() - 1][1]
                    if first or medium_rank(medium) < medium_rank(fastest):
                        fastest, first = medium, False
                    bits ^= low
                c = counts.setdefault(inst.name, {})
                c[fastest] = c.get(fastest, 0) + 1
                still.append((inst, mask))
            alive = still
            if not alive:
                break
        return {name: Spread(sum(c.values()), tuple(sorted(c.items(), key=lambda kv: medium_rank(kv[0]))))
                for name, c in counts.items()}

    def instances(self) -> list[str]:
        """The instances the index knows, in the order it first heard of them."""
        return list(self._instances)

    def stale(self, instance: str) -> bool:
        """Whether ``instance`` has batches waiting for a gap to be filled."""
        return bool(self._get(instance).pending)

    def next_seq(self, instance: str) -> int | None:
        """The sequence number ``instance``'s next batch should have."""
        return self._get(instance).next_seq

    def blocks(self, instance: str) -> int:
        """How many distinct block hashes ``instance`` holds (on any medium).  O(1)."""
        return len(self._get(instance).blocks)

    def held(self, instance: str) -> dict[BlockHash, tuple[BlockHash | None, list[Medium]]]:
        """Every block ``instance`` holds: ``hash -> (parent, media fastest first)``, oldest first.
        O(blocks it holds); for tests and inspection."""
        inst = self._get(instance)
        out = {}
        for h, parent in inst.blocks.items():
            bits = self._holders[h]
            media = sorted((m for m, b in inst.media.items() if bits >> b & 1), key=medium_rank)
            out[h] = (parent, media)
        return out

    def __len__(self) -> int:
        """Distinct block hashes held anywhere in the fleet."""
        return len(self._holders)

    def _get(self, instance: str) -> _Instance:
        try:
            return self._instances[instance]
        except KeyError:
            raise KeyError(f"instance {instance!r} is not in the index") from None

    def check(self) -> None:
        """Verify every invariant (raises ``AssertionError``).  O(blocks held + instances)."""
        all_bits = 0
        for name, inst in self._instances.items():
            assert inst.name == name
            assert len(inst.blocks) <= self.max_blocks, (name, len(inst.blocks))
            assert len(inst.pending) <= self.max_pending, (name, len(inst.pending))
            if inst.pending:
                assert inst.next_seq is not None and min(inst.pending) > inst.next_seq, name
            bits = 0
            for medium, bit in inst.media.items():
                assert self._owner.get(bit) == (inst, medium), (name, medium)
                assert not bits & (1 << bit)
                bits |= 1 << bit
            assert bits == inst.bits, name
            assert not all_bits & bits, "an (instance, medium) bit is shared"
            all_bits |= bits
            for h in inst.blocks:
                assert self._holders.get(h, 0) & inst.bits, (name, h)
        assert set(self._owner) == {b for b in range(self._next_bit) if all_bits >> b & 1}
        assert not set(self._free_bits) & set(self._owner)
        counts = dict.fromkeys(self._instances, 0)
        for h, bits in self._holders.items():
            assert bits and not bits & ~all_bits, (h, bits)
            for name, inst in self._instances.items():
                if bits & inst.bits:
                    assert h in inst.blocks, (name, h)
                    counts[name] += 1
        for name, inst in self._instances.items():
            assert counts[name] == len(inst.blocks), name

