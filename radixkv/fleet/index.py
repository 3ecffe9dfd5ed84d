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
  block costs (about 60 a held block with 64-bit hashes, the per-id hash that lets a lookup skip
  most probes included; hashes of other types cost a Python dict entry more).
* **Queued events.**  ``apply`` checks a batch and queues its events; they are applied, runs of
  consecutive ``BlockStored`` (or ``BlockRemoved`` of one medium) events of an instance at once,
  by the next read (``lookup``, ``held``, ``blocks``, ``len``, ``check``) or once 64K blocks wait.
  What a read sees is what applying every batch in order gives; a read after many batches pays
  for applying them.  Cost: O(blocks) a run, vectorised; where the extension is loaded a run's
  hashes are gathered and checked for repeats, and probed and inserted in the table, in C
  (``cuda_ext/index_walk.cpp``); a run whose blocks are all new (the common case) gets a range
  of ids and is written with slices.  The next batch of a known instance is checked and queued
  in a few attribute reads and one pass over its events, so that a batch of 64 blocks costs a
  few microseconds (``bench fleet_index`` measures blocks/s).
* **Lookup.**  ``lookup(block_hashes)`` -> ``{instance: Match(blocks, medium)}``: for each instance
  the longest leading run of ``block_hashes`` it holds on one medium, and that medium; where two
  media hold runs of the same length, the faster (GPU, CPU, STORAGE, others by name, ``None``).
  Instances matching nothing are left out; stale instances too unless ``include_stale=True``.
  Cost: O(prompt blocks + instances): one probe of one fleet-wide table a block (holders are
  bitmasks), not one per instance, and a probe is one cache miss (a slot packs the hash and the
  block's id).  Where the extension is loaded (``radixkv.core.ops.native_index()``) and the hashes
  are 64-bit ints, the probes, the walk along the masks and each instance's pick are one call of a
  plain C function (``cuda_ext/index_walk.cpp``, about a microsecond to call, no torch dispatch)
  that stops where every instance's run has ended; else a few vectorised numpy passes.  The C walk
  probes only where a chain's ids stop being consecutive: a chain stored at once gets consecutive
  ids, so having found block i at id k it first checks whether id k + 1 holds block i + 1 (its
  hash is kept per id), a sequential read instead of a random one.  Both give
  the same answers (``Index.native = False`` forces numpy).  ``bench fleet_index`` measures both.
* Hashes are compared as given: ints in [0, 2**64) (vLLM's default external form) live in numpy
  arrays; anything else (bytes, other ints) in a dict beside them.  A ``numpy.uint64`` array is
  taken as is; the C walk reads a list or tuple of ints as far as it walks (a few ns a hash),
  the numpy path converts it whole.

Layout (every array grows by a factor, so appends are amortised O(1)):

* ``_Map``: an open-addressing table (linear probing, at most 70% full) from a 64-bit hash to a
  block *id*, each slot a packed (hash, id) pair of 12 bytes; lookups and inserts probe whole
  arrays of hashes at once (in C where the extension is loaded).
* Per id: ``_mask`` (which (instance, medium) pairs hold it, one bit each, in the narrowest
  unsigned dtype that fits the pairs allocated), the parent of the chain that first stored it
  (``_pk`` kind, ``_par`` value), its ``_hash`` (0 where the hash is not in the table: a hash that
  is not a 64-bit int, in the dict, or a free id; ``_pk`` has its ``_NOKEY`` bit then), and the
  log position of one holder, its
  *primary* (``_prim``, ``_stamp``).  Ids are handed out ascending (freed ones first, sorted), so
  that a run of new blocks gets consecutive ids where it can.
* Per instance: a log of ids in store order (a block stored again is appended again, its old
  entry dead), the log positions of the blocks it holds but is not primary of (``over``), and the
  parents that differ from the block's first one (``parents``).  An entry is live when its
  position is the holder's position of that block; dead entries are dropped when the log is
  rebuilt, which happens once appends fill it (amortised O(1)).

>>> from radixkv.fleet.events import BlockStored, EventBatch
>>> idx = Index()
>>> idx.apply("a", 0, EventBatch(ts=0.0, events=[BlockStored(block_hashes=[1, 2, 3],
...     parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="GPU",
...     lora_name=None)]))
>>> idx.lookup([1, 2, 9])
{'a': Match(blocks=2, medium='GPU')}
"""

from __future__ import annotations

from array import array
from typing import Any, Hashable, Iterable, NamedTuple, Sequence

import numpy as np

__all__ = ["MEDIA", "Index", "Match", "Spread"]

#: The media vLLM names, fastest first.
MEDIA = ("GPU", "CPU", "STORAGE")
_RANK = {m: i for i, m in enumerate(MEDIA)}

Medium = str | None
BlockHash = Hashable                                      # int (the default) or bytes

_MIX = np.uint64(0x9E3779B97F4A7C15)                      # Fibonacci hashing multiplier
_EMPTY, _TOMB = -1, -2                                    # table slot states (values are >= 0)
_NONE, _INT, _OBJ = 0, 1, 2                               # parent kinds: None, a uint64, a Python object
_KIND = 3                                                 # the parent kind's bits of _pk
_NOKEY = 4                                                # _pk flag: the id's hash is not in the table (in _obj, or free)
_MAX_INSTANCES = 32767                                    # _prim is int16
_QUEUE_BLOCKS = 1 << 16                                   # queued blocks that force a flush
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}   # mask words as the walk takes them
_SLOT = np.dtype([("key", np.uint64), ("val", np.int32)])   # a table slot: 12 bytes, packed
_NATIVE: list[Any] = []                                   # the extension's index functions (or None), once looked up


def _native() -> Any:
    """The extension's ``index_find``, ``index_put`` and ``index_walk`` (``cuda_ext/index_walk.cpp``)
    when the built extension is loaded (``radixkv.core.ops.native_index()``; asked once), else
    ``None``."""
    if not _NATIVE:
        from radixkv.core import ops

        _NATIVE.append(ops.native_index())
    return _NATIVE[0]


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
    """The index's name for an event's ``medium``: upper-cased; ``None`` stays ``None``.  O(1)."""
    if medium is None:
        return None
    if not isinstance(medium, str):
        raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
    return medium.upper()


def medium_rank(medium: Medium) -> tuple[int, str]:
    """Sort key of media, fastest first: GPU, CPU, STORAGE, others by name, ``None``.  O(1)."""
    if medium is None:
        return (len(MEDIA) + 1, "")
    return (_RANK.get(medium, len(MEDIA)), medium)


def _codes(hashes: Sequence[Any]) -> tuple[np.ndarray, list[tuple[int, Any]]]:
    """``hashes`` as a uint64 array, and the (position, hash) of those that are not ints in
    [0, 2**64) (their array entry is 0).  O(len(hashes)), in C when all are such ints."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == np.uint64:
        return hashes, []
    try:
        return np.frombuffer(array("Q", hashes), np.uint64), []
    except (TypeError, OverflowError):
        pass
    out = np.zeros(len(hashes), np.uint64)
    other = []
    for i, h in enumerate(hashes):
        if isinstance(h, int) and 0 <= h < 1 << 64:
            out[i] = h
        else:
            other.append((i, h))
    return out, other


class _Map:
    """Open addressing with linear probing from uint64 keys to int32 values >= 0, probed for whole
    arrays of keys at once.  A slot is a packed (key, value) pair, so a probe is one cache miss.
    Deleted slots become tombstones until the next rebuild; the table is rebuilt (amortised O(1) a
    key) once live and dead slots pass 70% of it.  With ``native`` set and the extension loaded,
    ``find``, ``locate`` and ``put`` run in C (``cuda_ext/index_walk.cpp``: one pass, prefetching
    ahead), else in numpy; both keep the same invariants (a key is reachable from its home slot
    without crossing an empty one), so either may follow the other."""

    __slots__ = ("table", "raw", "keys", "vals", "bits", "size", "used", "native")

    def __init__(self, native: bool = False) -> None:
        self.native = native
        self._alloc(4)

    def _alloc(self, bits: int) -> None:
        self.bits = bits
        self.table = np.zeros(1 << bits, _SLOT)
        self.raw = self.table.view(np.uint8)      # the same bytes, as the extension takes them
        self.keys = self.table["key"]             # views of the slots' fields
        self.vals = self.table["val"]
        self.vals[:] = _EMPTY
        self.size = self.used = 0                 # live slots; live and dead

    def __len__(self) -> int:
        return self.size

    def _fast(self) -> Any:
        return _native() if self.native else None

    def _probe(self, fns: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, slots) of ``keys`` through the extension, -1 where absent."""
        keys = np.ascontiguousarray(keys, np.uint64)
        vals, slots = np.empty(len(keys), np.int32), np.empty(len(keys), np.intp)
        fns.index_find(self.raw, self.bits, keys, vals, slots)
        return vals, slots

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MIX) >> np.uint64(64 - self.bits)).astype(np.intp)

    def _scan(self, keys: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each key, the first slot from ``slot`` on that holds it (hit) or is empty (miss):
        (slots, hits).  The first slot of every key is read at once, then windows of the next
        slots for the keys still unresolved (windows, not one step at a time: a batch's longest
        probe sets the number of rounds).  O(len(keys)) reads, expected."""
        last = len(self.vals) - 1
        v = self.vals[slot]
        hit = (self.keys[slot] == keys) & (v >= 0)
        out = slot.copy()
        rest = np.flatnonzero(~hit & (v != _EMPTY))
        width = 8
        while len(rest):
            win = (slot[rest, None] + np.arange(1, width + 1)) & last
            vv = self.vals[win]
            hh = (self.keys[win] == keys[rest, None]) & (vv >= 0)
            stop = hh | (vv == _EMPTY)
            first = stop.argmax(axis=1)
            found = stop[np.arange(len(rest)), first]
            done = rest[found]
            out[done] = win[found, first[found]]
            hit[done] = hh[found, first[found]]
            slot = slot.copy()
            slot[rest] = win[:, -1]
            rest = rest[~found]
            width *= 2
        return out, hit

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where absent.  O(len(keys)) reads, expected."""
        if not self.size or not len(keys):
            return np.full(len(keys), -1, np.intp)
        fns = self._fast()
        if fns is not None:
            return self._probe(fns, keys)[1]
        slots, hit = self._scan(keys, self._home(keys))
        return np.where(hit, slots, -1)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where absent.  O(len(keys)) reads, expected."""
        if not self.size or not len(keys):
            return np.full(len(keys), -1, np.int32)
        fns = self._fast()
        if fns is not None:
            return self._probe(fns, keys)[0]
        slots, hit = self._scan(keys, self._home(keys))
        return np.where(hit, self.vals[slots], -1)

    def put(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Set ``keys`` (distinct) to ``vals``; returns their slots.  O(len(keys)) reads,
        expected, plus a rebuild when the table is full (amortised)."""
        n = len(keys)
        if self.used + n > 0.7 * len(self.vals):
            self._rebuild(self.size + n)
        fns = self._fast()
        if fns is not None:
            out = np.empty(n, np.intp)
            won = fns.index_put(self.raw, self.bits, np.ascontiguousarray(keys, np.uint64),
                                np.ascontiguousarray(vals, np.int32), out)
            self.size += won
            self.used += won
            return out
        out = np.empty(n, np.intp)
        slot, todo, last = self._home(keys), np.arange(n), len(self.vals) - 1
        while len(todo):
            at, hit = self._scan(keys[todo], slot[todo])
            self.vals[at[hit]] = vals[todo[hit]]
            out[todo[hit]] = at[hit]
            miss, free = todo[~hit], at[~hit]     # claim the empty slot: its last writer wins it
            self.keys[free] = keys[miss]
            won = self.keys[free] == keys[miss]
            self.vals[free[won]] = vals[miss[won]]
            out[miss[won]] = free[won]
            self.size += int(won.sum())
            self.used += int(won.sum())
            todo = miss[~won]
            slot[todo] = (free[~won] + 1) & last
        return out

    def drop(self, slots: np.ndarray) -> None:
        """Delete the keys in ``slots`` (live, distinct).  O(len(slots))."""
        self.vals[slots] = _TOMB
        self.size -= len(slots)

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, keys, values) of the live entries.  O(table)."""
        live = np.flatnonzero(self.vals >= 0)
        return live, self.keys[live], self.vals[live]

    def _rebuild(self, n: int) -> None:
        _, keys, vals = self.items()
        bits = 4
        while n > 0.5 * (1 << bits):              # at most half full right after a rebuild
            bits += 1
        self._alloc(bits)
        self.put(keys, vals)

    def nbytes(self) -> int:
        return self.table.nbytes

    def check(self) -> None:
        """Sizes add up; every live key is found where it lives (no empty slot on its path)."""
        assert self.used <= 0.7 * len(self.vals) or self.used <= 1, (self.used, len(self.vals))
        slots, keys, _vals = self.items()
        assert len(slots) == self.size, (len(slots), self.size)
        assert int((self.vals == _TOMB).sum()) + self.size == self.used
        assert len(np.unique(keys)) == len(keys), "a key is in the table twice"
        assert np.array_equal(self.locate(keys), slots), "a live key is not on its probe path"


class _Instance:
    """One instance's state: its media bits, its store log, sequence numbers (see ``Index``)."""

    __slots__ = ("name", "ix", "bits", "media", "next_seq", "pending", "log", "head", "tail",
                 "count", "over", "parents", "queue", "bit_of")

    def __init__(self, name: str, ix: int, native: bool) -> None:
        self.name, self.ix = name, ix
        self.bits = 0                                  # OR of this instance's medium bits
        self.media: dict[Medium, int] = {}             # medium -> its bit
        self.next_seq: int | None = None
        self.pending: dict[int, Any] = {}              # seq -> batch waiting for a gap
        self.log = np.zeros(16, np.int32)              # ids in store order; live in [head, tail)
        self.head = self.tail = 0
        self.count = 0                                 # distinct blocks held
        self.over = _Map(native=native)                # id -> log position, where not primary
        self.parents: dict[int, Any] = {}              # id -> parent, where not the block's first
        self.queue: list[Any] = []                     # events not applied yet
        self.bit_of: dict[Any, int] = {}               # an event's medium, as given -> its bit


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
        self._native = True
        self._instances: dict[str, _Instance] = {}
        self._free_ix: list[int] = []
        self._owner: dict[int, tuple[_Instance, Medium]] = {}   # bit -> (instance, medium)
        self._free_bits: list[int] = []
        self._plans: dict[tuple[int, bool], Any] = {}          # the walk's groups, by (active bits, spread)
        self._actives: dict[bool, int] = {}                    # active bits by include_stale, until a change
        self._next_bit = 0
        self._map = _Map(native=True)                 # uint64 hash -> id
        self._obj: dict[Any, int] = {}                # any other hash -> id
        self._okey: dict[int, Any] = {}               # id -> that hash
        self._pobj: dict[int, Any] = {}               # id -> its parent, where a Python object
        self._wbits, self._words = 8, 1               # mask: words of wbits bits each
        self._top = 0                                 # ids below it have been handed out
        self._free = np.zeros(0, np.int32)            # ids freed, a stack of _nfree
        self._nfree = 0
        self._dirty: list[_Instance] = []             # instances with queued events
        self._queued = 0                              # blocks (and events) queued
        self._mask = np.zeros((0, 1), np.uint8)       # per id: the bits of the pairs holding it
        self._hash = np.zeros(0, np.uint64)           # per id: its hash, where in _map (else 0)
        self._par = np.zeros(0, np.uint64)            # per id: its first parent, where an int
        self._pk = np.zeros(0, np.int8)               # per id: that parent's kind, | _NOKEY
        self._prim = np.zeros(0, np.int16)            # per id: its primary holder's ix (-1: none)
        self._stamp = np.zeros(0, np.int32)           # per id: the primary's log position
        self._grow_ids(16)

    @property
    def native(self) -> bool:
        """Whether the index uses the extension (``cuda_ext/index_walk.cpp``) where it is loaded:
        its hash table's probes and inserts, and the lookups' walk.  ``False``: always the numpy
        path, which gives the same answers and keeps the same invariants (for comparisons); it may
        be switched at any time.  O(instances) to set."""
        return self._native

    @native.setter
    def native(self, on: bool) -> None:
        self._native = on = bool(on)
        self._map.native = on
        for inst in self._instances.values():
            inst.over.native = on

    # ---- storage ------------------------------------------------------------------------------

    def _grow_ids(self, need: int) -> None:
        """Room for ``need`` ids, and at least a quarter more than now.  O(ids)."""
        old = len(self._hash)
        cap = max(need, old + old // 4, 16)

        def grown(a: np.ndarray, fill: int) -> np.ndarray:
            new = np.full((cap, *a.shape[1:]), fill, a.dtype)
            new[:old] = a
            return new
        self._mask = grown(self._mask, 0)
        self._hash = grown(self._hash, 0)
        self._par = grown(self._par, 0)
        self._pk = grown(self._pk, _NOKEY)
        self._prim = grown(self._prim, -1)
        self._stamp = grown(self._stamp, 0)

    def _mask_dtype(self) -> Any:
        return {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[self._wbits]

    def _widen(self, bit: int) -> None:
        """Make room in the masks for ``bit``.  O(ids)."""
        while bit >= self._wbits * self._words:
            if self._wbits < 64:
                self._wbits *= 2
                self._mask = self._mask.astype(self._mask_dtype())
            else:
                self._words += 1
                self._mask = np.hstack([self._mask, np.zeros((len(self._mask), 1), np.uint64)])

    def _vec(self, bits: int) -> np.ndarray:
        """``bits`` as one mask row."""
        w, full = self._wbits, (1 << self._wbits) - 1
        return np.array([(bits >> (w * j)) & full for j in range(self._words)], self._mask_dtype())

    def _int(self, row: Any) -> int:
        """One mask row (a list of words) as an int."""
        out = 0
        for j, word in enumerate(row):
            out |= int(word) << (self._wbits * j)
        return out

    def _alloc(self, n: int) -> np.ndarray:
        """``n`` fresh ids (rows zeroed), ascending, so that a chain stored at once gets
        consecutive ids wherever the ids freed last allow it (the walk's fast path).  Amortised
        O(n log n) for reused ids, O(n) for new ones."""
        take = min(n, self._nfree)
        ids = np.sort(self._free[self._nfree - take:self._nfree])
        self._nfree -= take
        if take < n:
            if self._top + n - take > len(self._hash):
                self._grow_ids(self._top + n - take)
            ids = np.concatenate([ids, np.arange(self._top, self._top + n - take, dtype=np.int32)])
            self._top += n - take
        return ids

    def _release(self, ids: np.ndarray) -> None:
        """Forget ids no instance holds any more (their masks are 0).  O(len(ids))."""
        if not len(ids):
            return
        kinds = self._pk[ids]
        okey = (kinds & _NOKEY) != 0                  # in use: in _obj
        ints = ids[~okey]
        if len(ints):
            slots = self._map.locate(self._hash[ints])
            assert (slots >= 0).all(), "an id's hash is not in the table"
            self._map.drop(slots)
        for i in ids[okey].tolist():
            del self._obj[self._okey.pop(i)]
        if self._pobj:
            for i in ids[(kinds & _KIND) == _OBJ].tolist():
                del self._pobj[i]
        self._hash[ids] = 0
        self._pk[ids] = _NOKEY
        self._par[ids] = 0
        self._prim[ids] = -1
        if self._nfree + len(ids) > len(self._free):
            self._free = np.concatenate([self._free[:self._nfree], np.zeros(self._nfree + 2 * len(ids), np.int32)])
        self._free[self._nfree:self._nfree + len(ids)] = ids
        self._nfree += len(ids)

    def _find(self, hashes: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, Any]]]:
        """(ids or -1, the uint64 codes, the other hashes) of ``hashes``.  O(len(hashes))."""
        codes, other = _codes(hashes)
        ids = self._map.find(codes).astype(np.int32) if len(self._map) else np.full(len(codes), -1, np.int32)
        for i, h in other:
            ids[i] = self._obj.get(h, -1)
        return ids, codes, other

    # ---- the log ------------------------------------------------------------------------------

    def _stamps(self, inst: _Instance, ids: np.ndarray) -> np.ndarray:
        """``inst``'s log position of each id (-1 where it is not primary and has none)."""
        mine = self._prim[ids] == inst.ix
        if not len(inst.over):
            return np.where(mine, self._stamp[ids], -1)
        return np.where(mine, self._stamp[ids], inst.over.find(ids.astype(np.uint64)))

    def _holds(self, inst: _Instance, ids: np.ndarray) -> np.ndarray:
        if self._words == 1:                         # one word: no 2-D temporaries
            return (self._mask[ids, 0] & self._mask.dtype.type(inst.bits)) != 0
        return (self._mask[ids] & self._vec(inst.bits)).any(axis=1)

    def _live(self, inst: _Instance, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, ids) of the live log entries in [start, stop)."""
        ids = inst.log[start:stop]
        pos = np.arange(start, stop, dtype=np.int32)
        live = self._holds(inst, ids) & (self._stamps(inst, ids) == pos)
        return pos[live], ids[live]

    def _set_stamps(self, inst: _Instance, ids: np.ndarray, pos: np.ndarray) -> None:
        """Record ``pos`` as ``inst``'s log positions of ``ids`` (distinct; it holds them or is
        about to)."""
        prim = self._prim[ids]
        free = prim == -1
        if len(inst.over):
            back = free & self._holds(inst, ids)   # it held them as a secondary: now primary
            if back.any():
                inst.over.drop(inst.over.locate(ids[back].astype(np.uint64)))
        mine = free | (prim == inst.ix)
        if mine.all():                               # the common case: no secondaries among them
            self._prim[ids] = inst.ix
            self._stamp[ids] = pos
            return
        self._prim[ids[mine]] = inst.ix
        self._stamp[ids[mine]] = pos[mine]
        inst.over.put(ids[~mine].astype(np.uint64), pos[~mine])

    def _append(self, inst: _Instance, ids: np.ndarray) -> None:
        """Append ``ids`` (distinct) to ``inst``'s log as its newest holdings.  Amortised O(len(ids))."""
        n = len(ids)
        self._log_room(inst, n)
        inst.log[inst.tail:inst.tail + n] = ids
        self._set_stamps(inst, ids, np.arange(inst.tail, inst.tail + n, dtype=np.int32))
        inst.tail += n

    def _log_room(self, inst: _Instance, n: int) -> None:
        """Room for ``n`` more entries at the end of ``inst``'s log.  Amortised O(n)."""
        if inst.tail + n > len(inst.log):         # rebuild: live entries only, renumbered from 0
            pos, live = self._live(inst, inst.head, inst.tail)
            inst.log = np.zeros(max(16, (len(live) + n) * 3 // 2), np.int32)
            inst.log[:len(live)] = live
            inst.head, inst.tail = 0, len(live)
            self._set_stamps(inst, live, np.arange(len(live), dtype=np.int32))

    # ---- events -------------------------------------------------------------------------------

    def apply(self, instance: str, seq: int, batch: Any) -> None:
        """Apply ``batch`` (an ``EventBatch``, ours or vLLM's) of ``instance`` numbered ``seq``.
        Cost: O(blocks in the batch), vectorised, plus the waiting batches a filled gap releases;
        a restart or a clear O(blocks the instance held)."""
        inst = self._instances.get(instance) if type(instance) is str else None
        if inst is not None and type(seq) is int and seq == inst.next_seq and not inst.pending:
            events = getattr(batch, "events", None)     # the next batch of a known instance
            if type(events) is list:
                self._apply_events(inst, events)
                inst.next_seq = seq + 1
                return
        if not isinstance(instance, str):
            raise TypeError(f"instance must be a str, got {type(instance).__name__}")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int, got {type(seq).__name__}")
        events = getattr(batch, "events", None)
        if not isinstance(events, list):
            raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
        self._actives.clear()
        inst = self._instances.get(instance)
        if inst is None:
            if not self._free_ix and len(self._instances) >= _MAX_INSTANCES:
                raise ValueError(f"the index holds at most {_MAX_INSTANCES} instances")
            ix = self._free_ix.pop() if self._free_ix else len(self._instances)
            inst = self._instances[instance] = _Instance(instance, ix, self._native)
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
        self._actives.clear()
        self._drop_all(inst)
        inst.next_seq = min(inst.pending)
        self._drain(inst)

    def remove(self, instance: str) -> None:
        """Forget ``instance`` (it left the fleet).  O(blocks it held)."""
        inst = self._get(instance)
        self._actives.clear()
        self._drop_all(inst)
        for bit in inst.media.values():
            del self._owner[bit]
            self._free_bits.append(bit)
            self._plans.clear()
        self._free_ix.append(inst.ix)
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
                self._widen(bit)
            inst.media[medium] = bit
            inst.bits |= 1 << bit
            self._owner[bit] = (inst, medium)
            self._plans.clear()
            self._actives.clear()
        return bit

    def _apply_events(self, inst: _Instance, events: list[Any]) -> None:
        """Queue ``events`` for ``inst``: they are applied, consecutive ones of a kind together,
        before the next read or once ``_QUEUE_BLOCKS`` blocks wait."""
        queued = self._queued + len(events)
        for ev in events:                            # all checked before any is queued
            kind = type(ev).__name__
            if kind == "BlockStored" or kind == "BlockRemoved":
                queued += len(ev.block_hashes)
            elif kind != "AllBlocksCleared":
                raise TypeError(f"batch holds an unknown event {kind}")
        if not inst.queue:
            self._dirty.append(inst)
        inst.queue.extend(events)
        self._queued = queued
        if queued > _QUEUE_BLOCKS:
            self._flush()

    def _flush(self) -> None:
        """Apply every queued event.  O(their blocks), vectorised over runs of events."""
        dirty, self._dirty, self._queued = self._dirty, [], 0
        for inst in dirty:
            q, inst.queue = inst.queue, []
            i = 0
            while i < len(q):
                kind, j = type(q[i]).__name__, i + 1
                if kind == "BlockStored":
                    total = len(q[i].block_hashes)
                    while j < len(q) and type(q[j]).__name__ == kind:
                        total += len(q[j].block_hashes)
                        j += 1
                    if inst.count + total <= self.max_blocks:     # no eviction on the way: one run
                        self._stored(inst, q[i:j])
                    else:
                        for ev in q[i:j]:
                            self._stored(inst, [ev])
                elif kind == "BlockRemoved":
                    medium, hs = medium_key(q[i].medium), list(q[i].block_hashes)
                    while j < len(q) and type(q[j]).__name__ == kind and medium_key(q[j].medium) == medium:
                        hs.extend(q[j].block_hashes)
                        j += 1
                    self._removed(inst, hs, medium)
                else:
                    self._cleared(inst)
                i = j

    def _stored(self, inst: _Instance, events: list[Any]) -> None:
        """Apply consecutive ``BlockStored`` events of ``inst`` (during which it evicts nothing)
        as one: each block's last store sets its place and parent, every store adds its medium."""
        seqs: list[Any] = []
        heads: list[Any] = []                            # each event's parent
        runs: list[tuple[int, int]] = []                 # (medium bit, blocks), in order
        starts: list[int] = []
        n = 0
        bit_of = inst.bit_of
        for ev in events:
            try:
                bit = bit_of[ev.medium]
            except (KeyError, TypeError):
                bit = bit_of[ev.medium] = self._bit(inst, medium_key(ev.medium))
            h = ev.block_hashes
            if len(h):
                starts.append(n)
                seqs.append(h)
                heads.append(ev.parent_block_hash)
                runs.append((bit, len(h)))
                n += len(h)
        if not n:
            return
        where: np.ndarray | None = None                  # each store's place among the blocks kept
        fns = _native() if self._native else None
        codes = np.empty(n, np.uint64)
        if fns is not None and fns.index_gather(seqs, codes):   # 64-bit ints, none twice: in C
            hs: Any = codes
            ids = self._map.find(codes).astype(np.int32, copy=False) if len(self._map) else np.full(n, -1, np.int32)
            other: list[tuple[int, Any]] = []
            pk, pv, pobj = self._parent_codes(heads, codes, starts)
        else:
            hs = [x for h in seqs for x in h]
            pars = list(hs)
            pars[1:] = hs[:-1]
            for i, p in zip(starts, heads):
                pars[i] = p
            unique = len(set(hs)) == n
            if not unique:                               # a hash twice: its last place and parent count
                last = {h: i for i, h in enumerate(hs)}
                keep = sorted(last.values())
                rank = {k: r for r, k in enumerate(keep)}
                where = np.array([rank[last[h]] for h in hs], np.intp)
                hs, pars = [hs[i] for i in keep], [pars[i] for i in keep]
            ids, codes, other = self._find(hs)
            if unique and not other:
                pk, pv, pobj = self._parent_codes(heads, codes, starts)
            else:
                pk, pv, pobj = self._parent_codes(pars, None, range(len(pars)))
        new = np.flatnonzero(ids < 0)
        fresh = self._alloc(len(new)) if len(new) else new
        if len(new) == n and not other and where is None and int(fresh[-1]) - int(fresh[0]) == n - 1:
            self._store_fresh(inst, int(fresh[0]), codes, pk, pv, pobj, runs)
            return
        if len(new):
            ids[new] = fresh
            is_obj = np.zeros(len(hs), bool)
            for i, _h in other:
                is_obj[i] = True
            ints = new[~is_obj[new]]
            if len(ints):
                self._map.put(codes[ints], ids[ints])
                self._hash[ids[ints]] = codes[ints]
            for i in new[is_obj[new]].tolist():
                self._obj[hs[i]] = int(ids[i])
                self._okey[int(ids[i])] = hs[i]
            self._pk[fresh], self._par[fresh] = pk[new] | (is_obj[new] * _NOKEY).astype(np.int8), pv[new]
            for i in new[pk[new] == _OBJ].tolist():
                self._pobj[int(ids[i])] = pobj[i]
        old = np.ones(len(hs), bool)
        old[new] = False
        if old.any():                                # parents that differ from the block's first
            at = np.flatnonzero(old)
            oi = ids[at]
            okind = self._pk[oi] & _KIND
            differ = (okind != pk[at]) | ((pk[at] == _INT) & (self._par[oi] != pv[at]))
            for j in np.flatnonzero((pk[at] == _OBJ) & (okind == _OBJ)).tolist():
                differ[j] = self._pobj[int(oi[j])] != pobj[int(at[j])]
            if differ.any() or inst.parents:
                for j, d in zip(at.tolist(), differ.tolist()):
                    if d:
                        kind = pk[j]
                        inst.parents[int(ids[j])] = None if kind == _NONE else int(pv[j]) if kind == _INT else pobj[j]
                    else:
                        inst.parents.pop(int(ids[j]), None)
        held = self._holds(inst, ids)
        self._append(inst, ids)
        bits = {bit for bit, _n in runs}
        for bit in bits:
            w, b = divmod(bit, self._wbits)
            if len(bits) == 1 and where is None:
                these = ids
            else:
                per = np.repeat([r[0] for r in runs], [r[1] for r in runs]) == bit
                these = np.unique(ids[where[per] if where is not None else per])
            self._mask[these, w] |= self._mask.dtype.type(1 << b)
        inst.count += len(ids) - int(held.sum())
        if inst.count > self.max_blocks:
            self._evict(inst, inst.count - self.max_blocks)

    def _store_fresh(self, inst: _Instance, lo: int, codes: np.ndarray, pk: np.ndarray, pv: np.ndarray,
                     pobj: dict[int, Any], runs: list[tuple[int, int]]) -> None:
        """``_stored`` where every block is new and a 64-bit int, none twice, on the ids
        ``[lo, lo + n)``: what ``_stored`` does, with slices for its
        gathers and scatters (the common case: a fleet storing new chains).  O(n) plus O(changes
        of medium along ``runs``)."""
        n = len(codes)
        hi = lo + n
        ids = np.arange(lo, hi, dtype=np.int32)
        self._map.put(codes, ids)
        self._hash[lo:hi] = codes
        self._pk[lo:hi] = pk
        self._par[lo:hi] = pv
        for i, p in pobj.items():
            self._pobj[lo + i] = p
        self._log_room(inst, n)
        t = inst.tail
        inst.log[t:t + n] = ids
        self._prim[lo:hi] = inst.ix                  # new ids: the instance is their primary
        self._stamp[lo:hi] = np.arange(t, t + n, dtype=np.int32)
        inst.tail = t + n
        at, k = lo, 0
        while k < len(runs):                         # the runs' media, adjacent ones of a bit at once
            bit, count = runs[k]
            k += 1
            while k < len(runs) and runs[k][0] == bit:
                count += runs[k][1]
                k += 1
            w, b = divmod(bit, self._wbits)
            self._mask[at:at + count, w] |= self._mask.dtype.type(1 << b)
            at += count
        inst.count += n
        if inst.count > self.max_blocks:
            self._evict(inst, inst.count - self.max_blocks)

    @staticmethod
    def _parent_codes(pars: Sequence[Any], chain: np.ndarray | None,
                      starts: Iterable[int]) -> tuple[np.ndarray, np.ndarray, dict[int, Any]]:
        """Kinds, uint64 values and Python objects of the blocks' parents: ``pars[k]`` is the
        parent at ``starts[k]``; ``chain`` (the codes of the hashes, when each other block's parent
        is the hash before it) gives the rest (``None``: ``pars`` holds every block's)."""
        n = len(chain) if chain is not None else len(pars)
        pobj: dict[int, Any] = {}
        pk, pv = np.full(n, _INT, np.int8), np.zeros(n, np.uint64)
        if chain is not None:
            pv[1:] = chain[:-1]
            if isinstance(pars, list) and pars.count(None) == len(pars):    # every event a chain's root
                at = np.array(starts, np.intp)
                pk[at], pv[at] = _NONE, 0
                return pk, pv, pobj
        for i, p in zip(starts, pars):
            if p is None:
                pk[i], pv[i] = _NONE, 0
            elif isinstance(p, int) and 0 <= p < 1 << 64:
                pv[i] = p
            else:
                pk[i], pv[i], pobj[i] = _OBJ, 0, p
        return pk, pv, pobj

    def _drop(self, inst: _Instance, ids: np.ndarray, bits: int) -> None:
        """Clear ``bits`` (some of ``inst``'s) from ``ids`` (distinct); forget the blocks no
        one holds any more.  O(len(ids))."""
        if not len(ids):
            return
        mine = self._vec(inst.bits)
        m = self._mask[ids]
        had = (m & mine).any(axis=1)
        m &= ~self._vec(bits)
        self._mask[ids] = m
        gone = ids[had & ~(m & mine).any(axis=1)]
        if len(gone):
            inst.count -= len(gone)
            prim = self._prim[gone] == inst.ix
            self._prim[gone[prim]] = -1
            if not prim.all():
                inst.over.drop(inst.over.locate(gone[~prim].astype(np.uint64)))
            if inst.parents:
                for i in gone.tolist():
                    inst.parents.pop(i, None)
        self._release(ids[~m.any(axis=1)])

    def _evict(self, inst: _Instance, n: int) -> None:
        """Drop ``inst``'s ``n`` oldest holdings.  O(n + dead log entries passed)."""
        while n > 0 and inst.head < inst.tail:
            stop = min(inst.tail, inst.head + max(2 * n, 256))
            pos, ids = self._live(inst, inst.head, stop)
            pos, ids = pos[:n], ids[:n]
            self._drop(inst, ids, inst.bits)
            n -= len(ids)
            inst.head = int(pos[-1]) + 1 if n == 0 else stop

    def _removed(self, inst: _Instance, hashes: Sequence[BlockHash], medium: Medium) -> None:
        bit = inst.media.get(medium)
        if bit is None or not len(hashes):
            return
        ids = self._find(list(hashes))[0]
        ids = np.unique(ids[ids >= 0])
        w, b = divmod(bit, self._wbits)
        ids = ids[(self._mask[ids, w] >> b) & 1 == 1]
        self._drop(inst, ids, 1 << bit)

    def _cleared(self, inst: _Instance) -> None:
        """``AllBlocksCleared``: the instance's GPU medium (named ``GPU`` or not named) is empty."""
        drop = 0
        for m in ("GPU", None):
            if m in inst.media:
                drop |= 1 << inst.media[m]
        if drop:
            self._drop(inst, self._live(inst, inst.head, inst.tail)[1], drop)

    def _drop_all(self, inst: _Instance) -> None:
        if inst.queue:                                 # applying them would only be undone
            inst.queue.clear()
            self._dirty.remove(inst)
        self._drop(inst, self._live(inst, inst.head, inst.tail)[1], inst.bits)
        inst.head = inst.tail = 0

    # ---- queries ------------------------------------------------------------------------------

    def _rows(self, hs: Sequence[BlockHash]) -> np.ndarray:
        """The mask rows of the leading blocks that someone holds (up to the first no one does)."""
        if not len(hs):
            return self._mask[:0]
        ids = self._find(hs)[0]
        miss = np.flatnonzero(ids < 0)
        return self._mask[ids[:miss[0]] if len(miss) else ids]

    def _walk(self, hs: Sequence[BlockHash], active: int, spread: bool) -> tuple[Any, list[tuple[Any, ...]]] | None:
        """The extension's one-pass walk (``cuda_ext/index_walk.cpp``) over ``hs`` for the pairs
        in ``active``: ``lookup``'s answer, built in C (``spread=False``), or per pair, grouped by
        instance fastest first, how many leading blocks it is its instance's fastest holder of,
        within the instance's run on any medium (``spread=True``); and each pair's (instance,
        medium).  ``None`` where the
        extension is not loaded or the walk reaches a hash that is not an int in [0, 2**64): the
        numpy path answers.  O(blocks walked), in C, plus O(pairs) in Python."""
        fns = _native() if self._native else None
        if fns is None:
            return None
        if isinstance(hs, np.ndarray):
            if hs.dtype != np.uint64:
                return None
            if not hs.flags.c_contiguous:
                hs = np.ascontiguousarray(hs)
        elif not isinstance(hs, (list, tuple)):
            hs = list(hs)
        plan = self._plans.get((active, spread))
        if plan is None:
            plan = self._plan(active, spread)
        m = self._map
        out = fns.index_walk(m.raw, m.bits, hs, self._mask, plan[0], plan[1], plan[2], self._hash, self._pk, plan[4])
        return None if out is None else (out, plan[3])

    def _plan(self, active: int, spread: bool) -> tuple[Any, Any, Any, list[tuple[Any, ...]], Any]:
        """The walk's ``order``, ``starts`` and ``best`` arrays for the pairs in ``active`` (one
        group per instance for ``spread``, one per pair and each instance's longest run picked
        otherwise), each pair's (instance, medium), and for ``lookup`` the ``answer`` argument
        (``Match`` and the pairs' names and media), cached until a pair's bit is given or freed.
        O(pairs)."""
        order: list[int] = []
        starts, sets = [0], [0]
        owners: list[tuple[Any, ...]] = []
        by_inst: dict[str, list[tuple[Medium, int]]] = {}
        for bit, (inst, medium) in self._owner.items():
            if active >> bit & 1:
                by_inst.setdefault(inst.name, []).append((medium, bit))
        for name, pairs in by_inst.items():
            for medium, bit in sorted(pairs, key=lambda mb: medium_rank(mb[0])):
                order.append(bit)
                owners.append((name, medium))
                if not spread:
                    starts.append(len(order))
            if spread:
                starts.append(len(order))
            sets.append(len(order))
        if len(self._plans) > 64:
            self._plans.clear()
        answer = None if spread else (Match, tuple(o[0] for o in owners), tuple(o[1] for o in owners))
        plan = self._plans[(active, spread)] = (np.array(order, np.int64), np.array(starts, np.int64),
                                                None if spread else np.array(sets, np.int64), owners, answer)
        return plan

    def _active(self, include_stale: bool) -> int:
        """The bits of the pairs a lookup answers for, cached until the next batch or removal.  O(instances)."""
        active = self._actives.get(include_stale)
        if active is None:
            active = 0
            for inst in self._instances.values():
                if include_stale or not inst.pending:
                    active |= inst.bits
            self._actives[include_stale] = active
        return active

    @staticmethod
    def _hashes(block_hashes: Iterable[BlockHash]) -> Any:
        return block_hashes if isinstance(block_hashes, (list, tuple, np.ndarray)) else list(block_hashes)

    def lookup(self, block_hashes: Iterable[BlockHash], include_stale: bool = False) -> dict[str, Match]:
        """For each instance, the longest leading run of ``block_hashes`` it holds on one medium
        (see the module docstring).  This operation does not change the index.  O(prompt blocks
        + instances): with the extension loaded (``radixkv.core.ops.native_index()``) and 64-bit
        int hashes, one call of a C function that walks until every instance's run has ended; else
        vectorised numpy, one table probe a block and one pass over their holder masks."""
        if self._dirty:
            self._flush()
        active = self._active(include_stale)
        if not active:
            return {}
        hs = self._hashes(block_hashes)
        walked = self._walk(hs, active, False) if len(hs) else None
        if walked is not None:                      # the answer, built in C
            return walked[0]  # type: ignore[no-any-return]
        best: dict[str, Match] = {}
        rows = self._rows(hs)
        if not len(rows):
            return {}
        acc = np.bitwise_and.accumulate(rows & self._vec(active), axis=0)
        ends = np.flatnonzero((acc[1:] != acc[:-1]).any(axis=1))
        runs: dict[int, int] = {}
        cur = self._int(acc[0])
        for i, row in zip(ends.tolist(), acc[ends + 1].tolist()):
            nxt = self._int(row)
            gone = cur & ~nxt
            while gone:
                low = gone & -gone
                runs[low.bit_length() - 1] = i + 1
                gone ^= low
            cur = nxt
        while cur:
            low = cur & -cur
            runs[low.bit_length() - 1] = len(acc)
            cur ^= low
        for bit, blocks in runs.items():
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
        nothing are left out.  This operation does not change the index.  O(prompt blocks x
        instances): with the extension loaded and 64-bit int hashes, one pass in C (O(prompt
        blocks) plus O(pairs) where the holders change); else vectorised numpy per instance."""
        if self._dirty:
            self._flush()
        alive = [inst for inst in self._instances.values() if inst.bits and (include_stale or not inst.pending)]
        if not alive:
            return {}
        hs = self._hashes(block_hashes)
        out: dict[str, Spread] = {}
        active = 0
        for inst in alive:
            active |= inst.bits
        walked = self._walk(hs, active, True) if len(hs) else None
        if walked is not None:
            per: dict[str, list[tuple[Medium, int]]] = {}
            for blocks, (name, medium) in zip(*walked):     # fastest first within an instance
                if blocks:
                    per.setdefault(name, []).append((medium, blocks))
            return {name: Spread(sum(c for _m, c in counts), tuple(counts)) for name, counts in per.items()}
        rows = self._rows(hs)
        for inst in alive:
            held = (rows & self._vec(inst.bits)).any(axis=1)
            stop = np.flatnonzero(~held)
            run = int(stop[0]) if len(stop) else len(rows)
            if not run:
                continue
            left = np.ones(run, bool)
            counts = []
            for medium, bit in sorted(inst.media.items(), key=lambda mb: medium_rank(mb[0])):
                has = left & (rows[:run] & self._vec(1 << bit)).any(axis=1)
                if has.any():
                    counts.append((medium, int(has.sum())))
                    left &= ~has
            out[inst.name] = Spread(run, tuple(counts))
        return out

    def instances(self) -> list[str]:
        """The instances the index knows, in the order it first heard of them.  O(instances)."""
        return list(self._instances)

    def stale(self, instance: str) -> bool:
        """Whether ``instance`` has batches waiting for a gap to be filled.  O(1)."""
        return bool(self._get(instance).pending)

    def next_seq(self, instance: str) -> int | None:
        """The sequence number ``instance``'s next batch should have.  O(1)."""
        return self._get(instance).next_seq

    def blocks(self, instance: str) -> int:
        """How many distinct block hashes ``instance`` holds (on any medium).  O(1), after the
        queued events are applied."""
        if self._dirty:
            self._flush()
        return self._get(instance).count

    def held(self, instance: str) -> dict[BlockHash, tuple[BlockHash | None, list[Medium]]]:
        """Every block ``instance`` holds: ``hash -> (parent, media fastest first)``, oldest first.
        O(blocks it holds, and its log's dead entries); for tests and inspection."""
        if self._dirty:
            self._flush()
        inst = self._get(instance)
        _pos, ids = self._live(inst, inst.head, inst.tail)
        out: dict[BlockHash, tuple[BlockHash | None, list[Medium]]] = {}
        by_rank = sorted(inst.media.items(), key=lambda mb: medium_rank(mb[0]))
        for i, row in zip(ids.tolist(), self._mask[ids].tolist()):
            bits = self._int(row)
            media = [m for m, b in by_rank if bits >> b & 1]
            out[self._key(i)] = (inst.parents[i] if i in inst.parents else self._parent(i), media)
        return out

    def _key(self, i: int) -> BlockHash:
        return self._okey[i] if self._pk[i] & _NOKEY else int(self._hash[i])

    def _parent(self, i: int) -> BlockHash | None:
        kind = int(self._pk[i]) & _KIND
        return None if kind == _NONE else int(self._par[i]) if kind == _INT else self._pobj[i]

    def nbytes(self) -> int:
        """Bytes of the index's arrays (its dicts of non-integer hashes and odd parents not
        counted; ``bench fleet_index`` measures everything).  O(instances)."""
        if self._dirty:
            self._flush()
        arrays = (self._mask, self._hash, self._par, self._pk, self._prim, self._stamp, self._free)
        return (self._map.nbytes() + sum(a.nbytes for a in arrays)
                + sum(i.log.nbytes + i.over.nbytes() for i in self._instances.values()))

    def __len__(self) -> int:
        """Distinct block hashes held anywhere in the fleet.  O(1)."""
        if self._dirty:
            self._flush()
        return len(self._map) + len(self._obj)

    def _get(self, instance: str) -> _Instance:
        try:
            return self._instances[instance]
        except KeyError:
            raise KeyError(f"instance {instance!r} is not in the index") from None

    def check(self) -> None:
        """Verify every invariant (raises ``AssertionError``).  O(blocks held + log entries +
        table slots), vectorised, plus O(instances x held ids)."""
        if self._dirty:
            self._flush()
        self._map.check()
        for inst in self._instances.values():
            inst.over.check()
        # bits: each (instance, medium) pair owns one bit
        all_bits = 0
        for name, inst in self._instances.items():
            assert inst.name == name
            bits = 0
            for medium, bit in inst.media.items():
                assert self._owner.get(bit) == (inst, medium), (name, medium)
                assert not bits & (1 << bit)
                bits |= 1 << bit
            assert bits == inst.bits, name
            assert not all_bits & bits, "an (instance, medium) bit is shared"
            all_bits |= bits
        assert set(self._owner) == {b for b in range(self._next_bit) if all_bits >> b & 1}
        assert not set(self._free_bits) & set(self._owner)
        assert self._next_bit <= self._wbits * self._words
        ixs = [inst.ix for inst in self._instances.values()]
        assert len(set(ixs)) == len(ixs) and not set(ixs) & set(self._free_ix)
        # ids: each in use exactly once (table or dict), the rest free, rows of free ids cleared
        _slots, _keys, vals = self._map.items()
        obj_ids = np.array(sorted(self._obj.values()), np.int32)
        used = np.concatenate([vals, obj_ids])
        assert len(np.unique(used)) == len(used), "an id is used twice"
        free = self._free[:self._nfree]
        assert len(np.unique(free)) == len(free) and not np.isin(free, used).any()
        assert len(used) + len(free) == self._top, (len(used), len(free), self._top)
        assert np.array_equal(self._hash[vals], _keys), "an id's hash is wrong"
        assert not (self._pk[vals] & _NOKEY).any() and (self._pk[obj_ids] & _NOKEY).all()
        assert (self._hash[obj_ids] == 0).all() and {self._obj[k]: k for k in self._obj} == self._okey
        assert (self._mask[used] != 0).any(axis=1).all(), "an id in use has no holder"
        unused = np.setdiff1d(np.arange(len(self._hash)), used)
        assert not self._mask[unused].any() and (self._prim[unused] == -1).all()
        assert (self._pk[unused] == _NOKEY).all() and (self._hash[unused] == 0).all()
        assert set(self._pobj) == set(np.flatnonzero((self._pk & _KIND) == _OBJ).tolist())
        stray = self._vec(~all_bits & ((1 << (self._wbits * self._words)) - 1))
        assert not (self._mask & stray).any(), "a bit no pair owns is set"
        # instances: the live log entries are exactly the blocks held, each once
        prim = self._prim[used]
        for name, inst in self._instances.items():
            assert inst.count <= self.max_blocks, (name, inst.count)
            assert len(inst.pending) <= self.max_pending, (name, len(inst.pending))
            if inst.pending:
                assert inst.next_seq is not None and min(inst.pending) > inst.next_seq, name
            assert 0 <= inst.head <= inst.tail <= len(inst.log)
            pos, live = self._live(inst, inst.head, inst.tail)
            assert len(np.unique(live)) == len(live), (name, "a block is live twice in the log")
            held = used[self._holds(inst, used)]
            assert np.array_equal(np.sort(live), np.sort(held)), (name, "log and masks disagree")
            assert inst.count == len(held), (name, inst.count, len(held))
            _s, over_ids, over_pos = inst.over.items()
            secondary = np.sort(held[self._prim[held] != inst.ix])
            assert np.array_equal(np.sort(over_ids.astype(np.int32)), secondary), name
            assert np.array_equal(inst.log[over_pos], over_ids.astype(np.int32)), name
            assert set(inst.parents) <= set(held.tolist()), name
            assert not np.isin(used[prim == inst.ix], held, invert=True).any(), (name, "primary of a block it lacks")
        assert (prim == -1).sum() + sum((prim == i.ix).sum() for i in self._instances.values()) == len(used)
