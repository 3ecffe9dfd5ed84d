"""What a cache holds, told as KV events: the observer-seam listener behind every event stream.

``KVEvents`` listens to a ``PrefixCache`` (or the vLLM connector's tier stack) through the
observer seam (``radixkv.core.observe``) and turns what each level now holds or dropped into vLLM's
events (``radixkv.fleet.events``): ``BlockStored`` / ``BlockRemoved`` with the level's *medium*,
``AllBlocksCleared`` (for the pool alone, as vLLM means it; a tier that is cleared is told as the
removal of every chunk it was told to hold).  ``publish(cache, endpoint)`` attaches one that sends them on a ZMQ
``Publisher`` (sequence numbers, replay), the stream a ``radixkv.fleet.Index`` or any consumer of
vLLM's events follows.

Contract:

* **Media.**  ``media`` maps a level to the medium its events carry; levels it leaves out are
  not told.  The default: the pool ``"GPU"`` (the engine's own KV pool, on whatever device: vLLM's
  CPU build names its pool so too), the CPU tier ``"CPU"``, LMDB ``"STORAGE"``.  Remote tiers (S3,
  Redis) are left out on purpose: every instance reads them alike, so they say nothing about
  where a request should go, and the instance that wrote a chunk would look like its only holder.
* **Granularity.**  The pool is told in whole chunks (``chunk_size`` tokens, the tiers' unit):
  a chunk is held once every page of it is, and dropped when an eviction cuts into it.  Pages
  past the last whole chunk are not told.  Sliding-window groups are not told (their pages come
  and go with the window; the full-attention pages decide what a prefix match can reuse).
* **Names** (the ``block_hashes`` of the events), chosen by the engine:

  - ``names="chunk"`` (the default): one block per chunk, named by the low 64 bits of its chunk
    key (``radixkv.core.hashing``), ``block_size = chunk_size``.  A router computes the same names with
    ``chunk_keys(tokens, chunk_size, namespace)``;
  - ``names="vllm"``: ``chunk_size // block_size`` blocks per chunk, named as vLLM names its own
    (``radixkv.fleet.hashing.vllm_block_hashes``, ``algo``/``seed`` as the engine's), for fleets
    that mix radixkv and vLLM instances in one index;
  - ``names=None``: the names come from outside, per chunk key (``Names.add``): the vLLM
    connector gives each chunk the hashes vLLM computed for its blocks.

  ``Names`` remembers the names of at most ``max_names`` chunks (least recently named forgotten
  first), to name a chunk's removal long after it was stored.  A tier store of a chunk whose
  names are not known (it never was whole in the pool since the listener started, e.g. a
  prefetch's promotion, or its names were forgotten; a *tail*, the pages past a prompt's last
  chunk boundary, is never named) is not told (counted in ``unnamed``): an index misses it rather
  than holds what no prompt's chain reaches.  With ``names="chunk"`` a removal is always told
  (the key is the name).
* **Token ids** go with the pool's ``BlockStored`` (the event has them at hand); tier events
  carry ``token_ids=[]``: a chunk's tokens are not kept once it left the pool.
* **Never into the engine.**  The sink (``Publisher.publish`` without waiting, for ``publish``)
  takes a batch per seam event; a full queue drops the batch (``dropped_batches``), which a
  consumer sees as a gap in the sequence numbers and repairs by replay or a reset.  Listener
  methods run on the thread of the seam event (the engine's or the stack's writer); the names and
  counters are locked.  Cost per event: one hash pass over the prefix for the pool's events
  (chunk keys; with ``names="vllm"`` also vLLM's hashes of the new chunks), O(keys) for a tier's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from radixkv.fleet.hashing import external_hash, vllm_block_hashes
from radixkv.core.hashing import keys_from_token_bytes
from radixkv.core.observe import Listener

if TYPE_CHECKING:
    from radixkv.core.cache import PrefixCache
    from radixkv.fleet.events import Publisher

__all__ = ["DEFAULT_MEDIA", "KVEvents", "Names", "publish"]

#: Levels and the media their events carry, unless ``media`` says otherwise ("pool" is decided by
#: the pool's device).
DEFAULT_MEDIA = {"cpu": "CPU", "memory": "CPU", "lmdb": "STORAGE"}

Hash = Any   # int (vLLM's default external form) or bytes


class Names:
    """Chunk key -> the names of its blocks (``hashes``) and of the block before them
    (``parent``), for at most ``max_names`` chunks, least recently added forgotten first.
    Thread-safe; O(1) per chunk."""

    def __init__(self, max_names: int = 1 << 18) -> None:
        if isinstance(max_names, bool) or not isinstance(max_names, int) or max_names < 1:
            raise ValueError(f"max_names must be a positive int, got {max_names!r}")
        self.max_names = max_names
        self._names: OrderedDict[bytes, tuple[tuple[Hash, ...], Hash | None, bytes | None]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: bytes, hashes: Sequence[Hash], parent: Hash | None, last: bytes | None = None) -> None:
        """Name chunk ``key``'s blocks ``hashes`` (external form), after the block ``parent``;
        ``last``: the full hash of its last block (bytes), to chain the next chunk's names."""
        with self._lock:
            self._names[key] = (tuple(hashes), parent, last)
            self._names.move_to_end(key)
            while len(self._names) > self.max_names:
                self._names.popitem(last=False)

    def get(self, key: bytes) -> tuple[tuple[Hash, ...], Hash | None, bytes | None] | None:
        """``(hashes, parent, last)`` of ``key``, or ``None`` when not known."""
        with self._lock:
            return self._names.get(key)

    def __len__(self) -> int:
        return len(self._names)

    def check(self) -> None:
        """Assert the bound and that every entry names at least one block."""
        with self._lock:
            assert len(self._names) <= self.max_names, "more names than max_names"
            assert all(len(h) > 0 for h, _, _ in self._names.values()), "a chunk with no block names"


class KVEvents(Listener):
    """Turns seam events into KV events (see the module docstring) and gives each seam event's
    batch to ``sink`` (a callable taking a list of events).

    ``namespace``: the ``Namespace`` the cache's chunk keys are made in (its first tier stack's;
    ``None`` with ``names=None``: chunks of every namespace, named from outside);
    ``chunk_size``: tokens per chunk; ``names``: ``"chunk"``, ``"vllm"`` or ``None`` (see the
    module docstring); ``block_size``: vLLM's block size for ``names="vllm"`` (a divisor of
    ``chunk_size``); ``media``: level -> medium (``DEFAULT_MEDIA`` plus ``"pool": "GPU"``).
    """

    def __init__(self, sink: Callable[[list[Any]], None], *, namespace: Any, chunk_size: int,
                 names: str | None = "chunk", block_size: int | None = None,
                 media: Mapping[str, str] | None = None, algo: str = "sha256", seed: str | None = None,
                 max_names: int = 1 << 18) -> None:
        from radixkv.fleet import events

        if names not in ("chunk", "vllm", None):
            raise ValueError(f"names must be 'chunk', 'vllm' or None, got {names!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if block_size is None:
            block_size = chunk_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or chunk_size % block_size:
            raise ValueError(f"block_size must be a positive divisor of chunk_size {chunk_size}, got {block_size!r}")
        if names == "chunk" and block_size != chunk_size:
            raise ValueError("block_size: with names='chunk' a block is a chunk (leave block_size out)")
        if names == "vllm":
            vllm_block_hashes([0] * block_size, block_size, algo=algo, seed=seed)  # type: ignore[call-overload]  # checks algo/seed now
        self._ev = events
        self.sink = sink
        if namespace is None and names is not None:
            raise ValueError(f"namespace: names={names!r} names chunks from their keys, which need the namespace")
        self.root: bytes | None = None if namespace is None else namespace.root
        self.ns_id: bytes | None = None if namespace is None else namespace.id
        self.chunk_size, self.block_size, self.naming = chunk_size, block_size, names
        self.media = dict({"pool": "GPU", **DEFAULT_MEDIA} if media is None else media)
        self.algo, self.seed = algo, seed
        self.names = Names(max_names)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        #: Per medium below the pool, the chunk keys told stored there and not removed since: what a
        #: clear of that level removes (``AllBlocksCleared`` means vLLM's GPU pool alone).
        self._told: dict[str, set[bytes]] = {}
        self._told_lock = threading.Lock()

    # -- the seam ------------------------------------------------------------------------------

    def span(self, level: str, data: bytes, start: int, stop: int, held: bool) -> None:
        """Publish the whole chunks that end in tokens ``(start, stop]`` of ``data`` at a level with a
        medium: ``BlockStored`` for each (and its parent) when held, one ``BlockRemoved`` when not.
        O(stop) hashing of the chunk keys, and O(chunks) events."""
        medium = self.media.get(level)
        cs = self.chunk_size
        first, last = start // cs, stop // cs            # chunks ending in (start, stop]
        if medium is None or first >= last or self.root is None:
            return
        keys = keys_from_token_bytes(data[:last * cs * 4], cs, self.root)
        if held:
            self._name_chunks(data, keys, first, last)
            out = [self._stored(keys[c], medium, data[c * cs * 4:(c + 1) * cs * 4]) for c in range(first, last)]
        else:
            out = [self._removed(keys[first:last], medium)]
        self._emit([e for e in out if e is not None])

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        """Publish a tier's stores (those it can name: a ``BlockStored`` each) and removals (one
        ``BlockRemoved``) of this cache's namespace, and remember what each medium was told, for
        ``cleared``.  O(len(held) + len(dropped))."""
        medium = self.media.get(level)
        if medium is None or self.ns_id not in (None, namespace):
            return
        out, named = [], []
        for key in held:
            event = self._stored(key, medium, None)
            if event is not None:
                out.append(event)
                named.append(key)
        with self._told_lock:
            told = self._told.setdefault(medium, set())
            told.update(named)
            told.difference_update(dropped)
        out.append(self._removed(dropped, medium))
        self._emit([e for e in out if e is not None])

    def cleared(self, level: str, namespace: bytes | None) -> None:
        """The pool's clear as vLLM's ``AllBlocksCleared`` (an index clears that medium alone); a
        tier's as a ``BlockRemoved`` of every chunk told stored there.  O(k log k) in the k chunks told
        there (sorted)."""
        medium = self.media.get(level)
        if medium is None or not (namespace is None or self.ns_id in (None, namespace)):
            return
        if medium == "GPU":
            # vLLM's own event for a reset of the GPU pool; an index clears that medium alone.
            self._emit([self._ev.AllBlocksCleared()])
            return
        with self._told_lock:        # a tier below: every chunk told stored there is removed
            keys = self._told.pop(medium, set())
        event = self._removed(sorted(keys), medium)
        if event is not None:
            self._emit([event])

    # -- names ---------------------------------------------------------------------------------

    def _name_chunks(self, data: bytes, keys: list[bytes], first: int, last: int) -> None:
        """Name chunks ``first..last-1`` of ``data`` (whose chunk keys are ``keys``), chained from
        the names of the chunk before (computed from token 0 when it is not known)."""
        cs, bs = self.chunk_size, self.block_size
        if self.naming == "chunk":
            for c in range(first, last):
                self.names.add(keys[c], (external_hash(keys[c]),),
                               external_hash(keys[c - 1]) if c else None)
            return
        if self.naming is None:
            return
        known = self.names.get(keys[first - 1]) if first else None
        begin = first if first == 0 or (known is not None and known[2] is not None) else 0
        parent = known[2] if begin and known is not None else None
        tokens = np.frombuffer(data[begin * cs * 4:last * cs * 4], dtype="<i4").tolist()
        full = vllm_block_hashes(tokens, bs, parent, algo=self.algo, seed=self.seed)  # type: ignore[call-overload]
        per = cs // bs
        for c in range(begin, last):
            blocks = full[(c - begin) * per:(c - begin + 1) * per]
            before = full[(c - begin) * per - 1] if c > begin else parent
            if c >= first:
                self.names.add(keys[c], [external_hash(b) for b in blocks],
                               None if before is None else external_hash(before), blocks[-1])

    def _stored(self, key: bytes, medium: str, tokens: bytes | None) -> Any:
        named = self.names.get(key)
        if named is None:
            self._count("unnamed")
            return None
        hashes, parent, _ = named
        return self._ev.BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent,
            token_ids=[] if tokens is None else np.frombuffer(tokens, dtype="<i4").tolist(),
            block_size=self.block_size, lora_id=None, medium=medium, lora_name=None)

    def _removed(self, keys: Iterable[bytes], medium: str) -> Any:
        hashes: list[Hash] = []
        for key in keys:
            named = self.names.get(key)
            if named is not None:
                hashes.extend(named[0])
            elif self.naming == "chunk":
                hashes.append(external_hash(key))
            else:
                self._count("unnamed")
        return self._ev.BlockRemoved(block_hashes=hashes, medium=medium) if hashes else None

    def _emit(self, events: list[Any]) -> None:
        if events:
            self._count("events", len(events))
            self.sink(events)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def check(self) -> None:
        """Assert the names' invariants and that no counter went negative."""
        self.names.check()
        assert all(v >= 0 for v in self.counts.values()), "a negative counter"


class Published(KVEvents):
    """A ``KVEvents`` of one cache whose batches go out on a ``Publisher`` (``publish``)."""

    cache: PrefixCache
    publisher: Publisher

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening to the cache and close the publisher (bounded by ``timeout``)."""
        self.cache.observers.remove(self)
        self.publisher.close(timeout)


def publish(cache: PrefixCache, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
            names: str = "chunk", block_size: int | None = None, media: Mapping[str, str] | None = None,
            buffer_steps: int = 10_000, algo: str = "sha256", seed: str | None = None,
            max_names: int = 1 << 18) -> Published:
    """Publish what ``cache`` holds as KV events in vLLM's wire format on a ZMQ PUB socket bound to
    ``endpoint`` (e.g. ``"tcp://127.0.0.1:5557"``), with a replay socket on ``replay_endpoint``;
    returns the attached listener (``.close()`` detaches it and closes the socket).  Only what
    happens from now on is told (start it before the cache fills).  ``media`` defaults to the pool
    as ``"GPU"`` and ``DEFAULT_MEDIA`` for the tiers.  Cost: a
    socket and a sender thread; per seam event see the module docstring."""
    from radixkv.fleet.events import EventBatch, Publisher

    publisher = Publisher(endpoint, replay_endpoint=replay_endpoint, topic=topic, buffer_steps=buffer_steps)
    namespace = cache.stack.namespace if cache.stack is not None else cache.namespace
    listener: Published

    def sink(events: list[Any]) -> None:
        try:
            publisher.publish(EventBatch(ts=time.time(), events=events), timeout=0.0)
        except (TimeoutError, RuntimeError):           # a full queue; a closed publisher
            listener._count("dropped_batches")

    try:
        listener = Published(sink, namespace=namespace, chunk_size=cache.chunk_size, names=names,
                             block_size=block_size or (cache.page_size if names == "vllm" else None),
                             media=media, algo=algo, seed=seed, max_names=max_names)
    except BaseException:
        publisher.close()
        raise
    listener.cache, listener.publisher = cache, publisher
    cache.observers.add(listener)
    return listener
