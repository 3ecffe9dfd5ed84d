"""``TierStack``: the ordered, hash-keyed tiers below the GPU pool, as one waterfall.

The stack belongs to one namespace, one KV layout and one chunk size, and speaks in 16-byte chunk
keys (``radixkv.core.hashing.chunk_keys``); it prefixes them with ``namespace.id`` to make the 24-byte
tier keys.  Tier 0 is the fastest (e.g. ``CpuTier``), the last the slowest (e.g. ``S3Tier``).

* ``lookup(keys)`` walks the keys top-down — tier 0 answers for the leading keys it holds, tier 1
  for the ones after that, and so on — and stops at the first key that no tier holds: after a miss
  nothing later can be reused (causal attention).  One ``contains_prefix`` round trip per tier.
* ``load(refs)`` fetches and verifies chunks (``radixkv.core.format``) for leading refs and stops at
  the first one no tier can deliver intact.  A hit below tier 0 is promoted into the tiers above
  it (``promote=True``), in the background.  A corrupt blob (or one a remote tier refuses as
  larger than a chunk) is a miss: counted, deleted from its tier, and the next tier down is tried.
* ``store(items)`` encodes and writes chunks down every tier from one background thread, through
  a bounded queue: when the queue is full the write is dropped and counted, never waited for
  (unless the caller says how long it may wait: an eviction's chunks exist nowhere else).
* ``touch(keys)`` refreshes the recency of chunks in the local tiers that hold them (a read, from
  the same background thread and queue as the writes), e.g. when the pool evicts them: a tier
  below the pool then acts as a victim cache under ``write_through`` too.
* **Chain order.**  A lookup stops at the first chunk no tier holds, so a tier that evicts the
  first chunk of a prefix loses all of it.  What the pool evicts is given as chains (a prefix's
  chunks, first first: ``store(..., chain=True)``, ``touch``) and written or touched deepest first,
  so that the first chunk is the most recent: an LRU tier then drops a prefix from its end, as the
  tree evicts leaves before their parents.  When the queue has no room for a whole chain, the
  chain's end is what is dropped.
* **Tails.**  A prefix that ends inside a chunk (where cached sequences part) has a *tail*: its
  tokens past the last chunk boundary, whole pages, stored like a chunk under a key over that
  shorter run (``tail_ref``).  ``find_tail`` finds the longest one a local tier holds after a given
  chunk, so a tier can serve a shared prefix to its last page, not only to its last chunk boundary.
* ``prefetch(tokens)`` runs lookup and load on a worker thread and returns a ``Future``.

No fault of a tier (any exception: disk full, network down, a closed tier) reaches the caller:
it is a miss, counted in ``stats()["errors"]`` and logged once per burst (with any credential in
a URL redacted).

**Deadlines.**  ``lookup`` and ``load`` take ``deadline``, an absolute ``time.monotonic()`` value
(default: ``timeout_s`` from the call); every remote wait of the call ends by it (``with
radixkv.backends.bounded(deadline)``), so an engine passes one deadline to both and a request never
waits longer on the network, however slowly an endpoint answers.  Chunks not delivered by then are
misses (a fault, counted in ``timeouts`` and ``errors``); ``load`` returns the leading chunks that
arrived intact.  A remote tier's chunks are fetched concurrently (``get_many``), and no stored
object larger than the chunk it should be is downloaded.

**Trust.**  Without a secret, blobs carry an unkeyed checksum: protection against accidents only
(anyone who can write to a shared store can forge a chunk that verifies).  With ``secret`` (or the
``RADIXKV_SECRET`` environment variable) every blob is sealed with an HMAC under a key derived
from it for this namespace, and a blob without a valid MAC is a miss counted in ``forged`` (and
deleted, so the next store rewrites it).  ``previous_secret`` (``RADIXKV_PREVIOUS_SECRET``) is a
second secret accepted on read, never used to write: for rotation.  ``encrypt=True`` seals the
blobs of remote tiers (``Tier.local`` false: S3, Redis) with AES-256-GCM instead, so nothing they
store reveals tokens or KV; local tiers keep the (cheaper) MAC.  See ``radixkv.core.format``.  The
secrets are never stored on the stack, logged or shown in a ``repr``.

**Codecs.**  ``codecs`` names, per tier, how its chunks' payloads are written
(``radixkv.core.codec``: ``none``, the default; lossless ``zstd``; lossy ``int8`` and
``cachegen``), encoded on the writer thread.  Every tier decodes every codec on the way up,
within the load's deadline, whatever it writes.  The CPU tier (a victim tier: ``Tier.victim``)
and peer tiers write nothing coded (a peer may send coded blobs: ``radixkv.p2p``'s ``peer_codec``).
A chunk decoded from a lossy codec is approximate: counted per tier in ``lossy_loaded``, told by
``approximate(chunk)``, and promoted only into tiers that write the codec the blob was written
with (its header's, not the tier's setting: a tier holds what any writer put there), as the same
blob, never into a raw tier, where it would pass for exact.

**Peers.**  A tier with ``Tier.peer`` set (``PeerTier``: other instances' CPU tiers) is read, never
written: stores and promotions skip it, and its blobs are verified with the local tiers' seal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from radixkv.core._checks import check_int
from radixkv.core.deadline import DeadlineExceeded, OversizeBlob, bounded
from radixkv.core.tier import Tier, redact
from radixkv.core.writer import WriteQueue
from radixkv.core.observe import Observers
from radixkv.core.codec import Codec, get_codec, lossy_code
from radixkv.core.format import (ChunkAuthError, ChunkFormatError, Seal, chunk_codec, chunk_codec_param, decode_chunk,
                                 encode_chunk, encoded_size)
from radixkv.core.hashing import Namespace, as_token_bytes, keys_from_token_bytes, tail_key
from radixkv.core.pool import KVLayout

__all__ = ["PREVIOUS_SECRET_ENV", "SECRET_ENV", "ChunkRef", "TierStack"]

log = logging.getLogger("radixkv.core.stack")

SECRET_ENV = "RADIXKV_SECRET"
PREVIOUS_SECRET_ENV = "RADIXKV_PREVIOUS_SECRET"
_FETCH_WINDOW = 8  # remote chunks requested at once by one load (bounds the blobs held in memory)


class ChunkRef(NamedTuple):
    """Everything that names and verifies one chunk: its key, its parent's key (the namespace root
    for the first chunk) and its token ids as little-endian int32 bytes."""

    key: bytes
    parent: bytes
    tokens: bytes


class _BurstLog:
    """Log a fault the first time, then at most once per ``interval`` seconds per (kind, tier),
    with the number of faults since the last line."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[tuple[str, int], float] = {}
        self._since: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, tier: int, name: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            key = (kind, tier)
            self._since[key] = self._since.get(key, 0) + 1
            if key in self._last and now - self._last[key] < self.interval:
                return
            self._last[key] = now
            count = self._since.pop(key)
        log.warning("radixkv tier %d (%s): %s x%d, treated as a miss; latest: %s: %s",
                    tier, name, kind, count, type(exc).__name__, redact(str(exc)))


class TierStack:
    """Tiers ``tiers`` (fastest first) storing ``chunk_size``-token chunks of ``layout`` KV for
    ``namespace``; see the module docstring.  Thread-safe: every method may be called from any
    thread.  ``queue_bytes`` bounds the KV waiting to be written (stores and promotions, by their
    bytes; an empty queue takes a longer chain an eviction waits to store, whole), ``queue_size``
    (default: none) the number of writes waiting; ``write_batch`` is how many writes the writer
    takes per ``put_many`` (at most 64 MiB of them); faults are logged at most once
    per ``log_interval`` seconds per tier.  ``timeout_s``: the total bound of one
    ``lookup`` or ``load`` on remote waits (a caller's later deadline is cut to it); ``write_timeout_s``: the bound of one batch of writes
    to a tier.  ``secret``, ``previous_secret`` (bytes or str, 16 bytes or more; default: the
    ``RADIXKV_SECRET`` / ``RADIXKV_PREVIOUS_SECRET`` environment variables) and ``encrypt``: see
    the module docstring.

    >>> from radixkv.core.tier import MemoryTier
    >>> ns = Namespace(model="m")
    >>> stack = TierStack([MemoryTier()], namespace=ns,
    ...                   layout=KVLayout(1, 1, 4, torch.float32, page_size=2), chunk_size=2)
    >>> refs = stack.refs([5, 6, 7, 8, 9])                      # two full chunks
    >>> stack.store([(ref, torch.ones(1, 2, 2, 1, 4)) for ref in refs])
    2
    >>> stack.flush(); stack.lookup([ref.key for ref in refs])
    True
    [0, 0]
    >>> [t.sum().item() for t in stack.load(refs)]
    [16.0, 16.0]
    >>> stack.close()
    """

    def __init__(self, tiers: Sequence[Tier], *, namespace: Namespace, layout: KVLayout, chunk_size: int,
                 promote: bool = True, queue_size: int | None = None, queue_bytes: int = 1 << 30,
                 write_batch: int = 32,
                 log_interval: float = 60.0, timeout_s: float = 2.0, write_timeout_s: float = 30.0,
                 secret: bytes | str | None = None, previous_secret: bytes | str | None = None,
                 encrypt: bool = False, exclusive: bool = False,
                 codecs: Sequence[str | Codec | None] | None = None) -> None:
        if not all(isinstance(t, Tier) for t in tiers):
            raise TypeError("tiers must be radixkv.backends.Tier instances")
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        for name, value in (("chunk_size", chunk_size), ("queue_bytes", queue_bytes), ("write_batch", write_batch)):
            check_int(value, name, 1)
        if queue_size is not None:
            check_int(queue_size, "queue_size", 1)
        for name, seconds in (("timeout_s", timeout_s), ("write_timeout_s", write_timeout_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        if previous_secret is None:
            previous_secret = os.environ.get(PREVIOUS_SECRET_ENV) or None
        local_seal = Seal(secret, previous_secret, namespace_id=namespace.id)
        remote_seal = Seal(secret, previous_secret, namespace_id=namespace.id, encrypt=True) if encrypt else local_seal
        del secret, previous_secret  # only the derived keys are kept, inside the seals
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        #: Per tier, the codec its chunks are written with (``radixkv.core.codec``).
        self.codecs: tuple[Codec, ...] = _codecs(self.tiers, codecs)
        self.encrypt = bool(encrypt)
        self.timeout_s = float(timeout_s)
        self.write_timeout_s = float(write_timeout_s)
        #: Per tier, how its blobs are sealed (``radixkv.core.format.Seal``): remote tiers get the AEAD
        #: seal when ``encrypt``.
        self.seals: tuple[Seal, ...] = tuple(local_seal if t.local or t.peer else remote_seal for t in self.tiers)
        self.namespace = namespace
        self.layout = layout
        self.chunk_size = chunk_size
        self.promote = promote
        if not isinstance(exclusive, bool):
            raise TypeError(f"exclusive must be a bool, got {type(exclusive).__name__}")
        #: Tiers that hold only what the pool does not (``exclusive``): the local, volatile ones
        #: private to this cache (``Tier.victim``).  Nothing is promoted into them; the cache writes them when
        #: the pool evicts a chunk and ``release`` deletes what moved up into the pool.
        self.victims: frozenset[int] = frozenset(
            i for i, t in enumerate(self.tiers) if exclusive and t.local and t.victim)
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self.write_batch = write_batch
        self.shape = layout.chunk_shape(chunk_size)
        self._blob_bytes = tuple(encoded_size(self.shape, layout.dtype, seal) for seal in self.seals)
        self._prefix = namespace.id
        self._log = _BurstLog(log_interval)
        self._stats_lock = threading.Lock()
        self._pinned: set[bytes] = set()     # full keys pinned through this stack (see pin)
        n = len(self.tiers)
        self._per_tier = {k: [0] * n for k in ("tier_lookups", "hits", "corrupt", "forged", "errors", "timeouts",
                                               "stored", "touched", "refreshed", "refresh_misses", "released",
                                               "tier_bytes_loaded", "tier_bytes_stored", "lossy_loaded")}
        # The chunks last decoded from a lossy codec, by id (a tensor's == is elementwise, so no
        # WeakSet): each entry goes when its tensor does.
        self._lossy: dict[int, weakref.ref[torch.Tensor]] = {}
        self._lossy_lock = threading.RLock()     # a weakref callback may run inside it (a collection)
        self._counts = dict.fromkeys(("lookups", "lookup_keys", "lookup_found", "misses", "load_misses",
                                      "promoted", "dropped_writes", "bytes_loaded", "bytes_stored",
                                      "pending_hits"), 0)
        # The writes (radixkv.core.writer): ("store", ChunkRef, kv, tier indices), ("promote", tier
        # indices, ChunkRef, blob or None, kv or None), ("touch", tier key, tier indices), ("delete",
        # tier index, tier key) or ("release", tier key).
        # The chunks on their way down (queued, or in the writer's hands): full tier key -> [stores
        # in flight, the KV, the tiers they go to].  A lookup sees them as held by those tiers and
        # a load serves them from here, so what the pool just let go of is found at once.
        self._pending: dict[bytes, list[Any]] = {}
        self._pending_lock = threading.Lock()
        self.writer = WriteQueue(self._write_batch, size=queue_size, batch=write_batch, max_bytes=queue_bytes,
                                 cost=_write_cost, on_drop=lambda n: self._add("dropped_writes", n))
        self._prefetch_lock = threading.Lock()
        self._prefetcher: ThreadPoolExecutor | None = None
        #: The listeners of the tiers' events (``radixkv.core.observe``); a ``PrefixCache`` puts its own
        #: list here, so that one listener hears the pool and the tiers.
        self.observers = Observers()

    def __repr__(self) -> str:
        seal = {0: "checksum", 1: "mac", 2: "aead"}
        return (f"TierStack([{', '.join(f'{t.name}:{seal[s.mode]}' + (f':{c.name}' if c.code else '') for t, s, c in zip(self.tiers, self.seals, self.codecs))}], "
                f"chunk_size={self.chunk_size})")

    def approximate(self, chunk: torch.Tensor) -> bool:
        """Whether ``chunk``, as returned by the last ``load`` that returned it, was decoded from a
        lossy codec (its KV approximates the exact one).  O(1)."""
        with self._lossy_lock:
            ref = self._lossy.get(id(chunk))
        return ref is not None and ref() is chunk

    # -- bookkeeping --------------------------------------------------------------------------

    def _add(self, name: str, amount: int = 1, tier: int | None = None) -> None:
        with self._stats_lock:
            if tier is None:
                self._counts[name] += amount
            else:
                self._per_tier[name][tier] += amount

    def _call(self, i: int, default: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on tier ``i``; any exception is counted, logged once per burst, and
        turned into ``default``."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a tier's fault must never reach the engine
            self._add("errors", tier=i)
            self._log("error", i, self.tiers[i].name, exc)
            return default

    def _deadline(self, deadline: float | None) -> float:
        """The bound of one ``lookup``, ``load`` or ``find_tail``: the caller's ``deadline``, but
        never more than ``timeout_s`` from now (the configuration's ``remote_timeout``), whoever the
        caller is: one bound on every remote wait."""
        bound = time.monotonic() + self.timeout_s
        if deadline is None:
            return bound
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise TypeError(f"deadline must be a time.monotonic() value or None, got {type(deadline).__name__}")
        return min(float(deadline), bound)

    def _bounded_call(self, i: int, default: Any, deadline: float, fn: Callable[..., Any], *args: Any,
                      op: str = "lookup") -> Any:
        """``_call`` of a read within ``deadline``: past it, the tier's ``DeadlineExceeded`` is a
        fault counted in ``timeouts`` too, and its ``partial`` answer (if of ``default``'s type)
        is what the call returns.  A blob the tier refuses for its size is counted as corrupt.
        Listeners hear it as an ``io`` of ``op`` (``"ok"``, ``"timeout"`` or ``"error"``)."""
        t0, outcome = time.perf_counter(), "ok"
        try:
            with bounded(deadline, self._blob_bytes[i], lambda key: self._oversize(i, key)):
                return fn(*args)
        except DeadlineExceeded as exc:
            outcome = "timeout"
            with self._stats_lock:
                self._per_tier["errors"][i] += 1
                self._per_tier["timeouts"][i] += 1
            self._log("deadline passed", i, self.tiers[i].name, exc)
            return exc.partial if isinstance(exc.partial, type(default)) else default
        except Exception as exc:  # noqa: BLE001 - a tier's fault must never reach the engine
            outcome = "error"
            self._add("errors", tier=i)
            self._log("error", i, self.tiers[i].name, exc)
            return default
        finally:
            if self.observers:
                self.observers.io(self.tiers[i].name, op, time.perf_counter() - t0, 0, len(args[0]), outcome)

    # -- reads --------------------------------------------------------------------------------

    def refs(self, tokens: Any) -> list[ChunkRef]:
        """The ``ChunkRef`` of every full chunk of ``tokens`` (validated like ``chunk_keys``).
        O(len(tokens)): one hash pass.  Pure."""
        return self.refs_from_bytes(as_token_bytes(tokens))

    def refs_from_bytes(self, data: bytes) -> list[ChunkRef]:
        """``refs`` of tokens already validated into little-endian int32 bytes (``as_token_bytes``)."""
        keys = keys_from_token_bytes(data, self.chunk_size, self.namespace.root)
        step = 4 * self.chunk_size
        parents = [self.namespace.root, *keys[:-1]]
        return [ChunkRef(k, p, data[i * step:(i + 1) * step]) for i, (k, p) in enumerate(zip(keys, parents))]

    def _shape_of(self, ref: ChunkRef) -> tuple[int, ...]:
        """A chunk's KV shape: ``shape``, or a tail's shorter one."""
        n = len(ref.tokens) // 4
        return self.shape if n == self.chunk_size else self.layout.chunk_shape(n)

    def tail_ref(self, parent: bytes, data: bytes) -> ChunkRef:
        """The ``ChunkRef`` of a tail: ``data`` (int32 token bytes, a whole number of pages, fewer
        than a chunk) right after the chunk keyed ``parent`` (``namespace.root`` for the first).
        A tail is stored and loaded like a chunk, with ``layout.chunk_shape(len(data) // 4)`` KV.
        ``ValueError`` for another length.  O(len(data)): one hash."""
        page_bytes = 4 * self.layout.page_size
        if not 0 < len(data) < 4 * self.chunk_size or len(data) % page_bytes:
            raise ValueError(f"a tail is a whole number of pages ({self.layout.page_size} tokens) and fewer "
                             f"than a chunk ({self.chunk_size}), got {len(data) // 4} tokens")
        return ChunkRef(tail_key(parent, data), parent, data)

    def find_tail(self, parent: bytes, data: bytes, *, deadline: float | None = None) -> tuple[int, ChunkRef] | None:
        """The longest tail after the chunk keyed ``parent`` that a local tier holds, among the
        page-aligned prefixes of ``data`` shorter than a chunk: ``(tier index, ref)``, or ``None``.
        Remote tiers are not asked (a round trip per candidate).  Cost: per candidate length, one
        hash and one ``contains_prefix`` per local tier; at most ``chunk_size / page_size - 1``."""
        page_bytes = 4 * self.layout.page_size
        longest = min(len(data), 4 * self.chunk_size - 1) // page_bytes * page_bytes
        local = [i for i, t in enumerate(self.tiers) if t.local]
        if not local or longest <= 0:
            return None
        deadline = self._deadline(deadline)
        for end in range(longest, 0, -page_bytes):
            ref = self.tail_ref(parent, data[:end])
            for i in local:
                if self._pending_for(i, [self._prefix + ref.key]) == 1:     # on its way down to tier i
                    return i, ref
                if self._bounded_call(i, 0, deadline, self.tiers[i].contains_prefix, [self._prefix + ref.key],
                                      op="tail") == 1:
                    return i, ref
        return None

    def lookup(self, keys: Sequence[bytes], *, deadline: float | None = None,
               tiers: int | None = None) -> list[int]:
        """For each leading chunk key that some tier holds, the index of the tier to load it from;
        stops at the first key no tier holds.  Does not load or touch anything.

        Tier 0 answers for the leading keys it holds, tier 1 for the keys after those, and so on:
        one ``contains_prefix`` round trip per tier (a tier that fails counts as holding none; one
        that does not answer by ``deadline`` — absolute ``time.monotonic()``, default ``timeout_s``
        from now — as holding the leading keys it confirmed by then).  ``tiers``: ask only the
        first that many tiers.  Cost: O(len(keys)) local lookups plus one round trip per tier,
        within the deadline.
        """
        keys = _chunk_keys(keys)
        deadline = self._deadline(deadline)
        found: list[int] = []
        tier_keys = [self._prefix + k for k in keys]
        for i, tier in enumerate(self.tiers[:self._num_tiers(tiers)]):
            while len(found) < len(keys):
                self._add("tier_lookups", tier=i)
                n = self._bounded_call(i, 0, deadline, tier.contains_prefix, tier_keys[len(found):])
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(keys) - len(found):
                    self._call(i, 0, _bad_answer, tier, n)
                    n = 0
                found.extend([i] * n)
                # Chunks on their way down to this tier (the pool just let them go): held here too.
                m = self._pending_for(i, tier_keys[len(found):])
                found.extend([i] * m)
                if m == 0 or not tier.local:     # a remote tier is asked once per lookup
                    break
            if len(found) == len(keys):
                break
            if self.observers and len(found) < len(keys):
                self.observers.io(tier.name, "miss", 0.0, 0, len(keys) - len(found), "ok")
        with self._stats_lock:
            self._counts["lookups"] += 1
            self._counts["lookup_keys"] += len(keys)
            self._counts["lookup_found"] += len(found)
            self._counts["misses"] += len(found) < len(keys)
        return found

    def load(self, refs: Sequence[ChunkRef], *, where: Sequence[int] | None = None,
             deadline: float | None = None, out: Sequence[torch.Tensor] | None = None,
             tiers: int | None = None) -> list[torch.Tensor]:
        """Fetch, verify and decode the chunks of leading ``refs``; stop at the first chunk that
        no tier delivers intact by ``deadline`` (absolute ``time.monotonic()``; default
        ``timeout_s`` from now).  Returns one ``layout.chunk_shape(chunk_size)`` tensor per loaded
        chunk (``out[i]`` itself when given, else a new CPU tensor).

        ``where`` (e.g. ``lookup``'s answer) says which tier to try first for each ref; the tiers
        below it are tried next.  Each tier is asked once for all the chunks it should deliver: a
        local tier reads them one by one (zero-copy), a remote one fetches them concurrently
        (``get_many``, a window at a time), never past the deadline.  A blob that fails
        verification is deleted from its tier and counted in ``corrupt`` (``forged`` when its MAC
        is missing or wrong); ``out[i]`` is untouched unless chunk ``i`` is returned.  A hit below
        tier 0 is queued for promotion into the tiers above it (``promote``).  ``tiers``: read only
        the first that many tiers.  Cost: per chunk, one read per tier tried, one hash or MAC pass
        and one copy.
        """
        refs = list(refs)
        if out is not None and len(out) < len(refs):
            raise ValueError(f"out has {len(out)} tensors for {len(refs)} refs")
        for ref in refs:
            if not isinstance(ref, ChunkRef):
                raise TypeError(f"refs must be ChunkRef, got {type(ref).__name__}")
        deadline = self._deadline(deadline)
        first = [where[i] if where is not None and i < len(where) else 0 for i in range(len(refs))]
        chunks: list[torch.Tensor | None] = [None] * len(refs)
        for i, ref in enumerate(refs):       # on their way down: served from memory, no tier read
            chunks[i] = self._load_pending(min(first[i], len(self.tiers) - 1), ref, None if out is None else out[i])
        limit = len(refs)  # chunks from here on are of no use: an earlier one is lost everywhere
        used = self.tiers[:self._num_tiers(tiers)]
        for t, tier in enumerate(used):
            last = t == len(used) - 1
            todo = [i for i in range(limit) if chunks[i] is None and first[i] <= t]
            if tier.local:
                for i in todo:
                    chunks[i] = self._load_local(t, refs[i], None if out is None else out[i])
                    if chunks[i] is None and last:
                        limit = i
                        break
                continue
            for start in range(0, len(todo), _FETCH_WINDOW):
                window = [i for i in todo[start:start + _FETCH_WINDOW] if i < limit]
                if not window:
                    break
                keys = [self._prefix + refs[i].key for i in window]
                blobs = self._bounded_call(t, [None] * len(window), deadline, tier.get_many, keys, op="load")
                if not isinstance(blobs, list) or len(blobs) != len(window):
                    self._call(t, None, _bad_answer, tier, blobs)
                    blobs = [None] * len(window)
                for i, blob in zip(window, blobs):
                    if blob is not None:
                        chunks[i] = self._decode_fetched(t, refs[i], blob, None if out is None else out[i])
                    if chunks[i] is None and last:
                        limit = i
                        break
        loaded: list[torch.Tensor] = []
        for chunk in chunks:
            if chunk is None:
                break
            loaded.append(chunk)
        if len(loaded) < len(refs):
            self._add("load_misses")
        return loaded

    def _num_tiers(self, tiers: int | None) -> int:
        if tiers is None:
            return len(self.tiers)
        return min(check_int(tiers, "tiers"), len(self.tiers))

    def _decode(self, t: int, ref: ChunkRef, blob: Any, out: torch.Tensor | None) -> torch.Tensor:
        chunk = decode_chunk(blob, namespace_id=self._prefix, key=ref.key, parent_key=ref.parent,
                             tokens=ref.tokens, dtype=self.layout.dtype, shape=self._shape_of(ref), out=out,
                             seal=self.seals[t])
        self._mark(chunk, lossy_code(chunk_codec(blob)))
        return chunk

    def _mark(self, chunk: torch.Tensor, lossy: bool) -> None:
        """Remember whether ``chunk`` (just returned by a decode or a pending copy) is approximate."""
        key = id(chunk)
        with self._lossy_lock:
            if not lossy:
                self._lossy.pop(key, None)
                return
            lossy_map = self._lossy

            def gone(_: object, key: int = key) -> None:
                with self._lossy_lock:
                    entry = lossy_map.get(key)
                    if entry is not None and entry() is None:
                        del lossy_map[key]

            self._lossy[key] = weakref.ref(chunk, gone)

    def _bad_blob(self, t: int, ref: ChunkRef, exc: Exception) -> None:
        """A blob that did not verify (or was too large to read): counted, logged and deleted —
        from a local tier at once, from a remote one by the writer thread (not on the engine's)."""
        kind = "forged" if isinstance(exc, ChunkAuthError) else "corrupt"
        self._add(kind, tier=t)
        self._log(f"{kind} blob", t, self.tiers[t].name, exc)
        key = self._prefix + ref.key
        if self.observers:
            self.observers.io(self.tiers[t].name, "load", 0.0, 0, 1, kind)
            self.observers.chunks(self.tiers[t].name, self._prefix, (), (ref.key,))
        if self.tiers[t].local:
            self._call(t, None, self.tiers[t].delete, key)
        else:
            self._enqueue(("delete", t, key))

    def _oversize(self, t: int, key: bytes) -> None:
        """A remote tier refused the blob under ``key`` for its size (``report_oversize``): a bad
        blob, counted and logged like a corrupt one; the tier deletes it itself (it read nothing
        of it).  Any thread."""
        self._add("corrupt", tier=t)
        self._log("corrupt blob", t, self.tiers[t].name,
                  OversizeBlob(f"a stored blob under {key[len(self._prefix):].hex()} is larger than a chunk "
                               f"({self._blob_bytes[t]} bytes); not read"))

    def _loaded(self, t: int, ref: ChunkRef, chunk: torch.Tensor, blob: Any, seconds: float = 0.0) -> torch.Tensor:
        """Count a chunk delivered by tier ``t`` (read in ``seconds``: a local tier's read and
        decode; 0 for a remote one, whose fetch was told already) and queue its promotion."""
        nbytes = chunk.numel() * chunk.element_size()
        lossy = self.approximate(chunk)
        with self._stats_lock:
            self._per_tier["hits"][t] += 1
            self._per_tier["tier_bytes_loaded"][t] += nbytes
            self._per_tier["lossy_loaded"][t] += lossy
            self._counts["bytes_loaded"] += nbytes
        if self.observers:
            self.observers.io(self.tiers[t].name, "load", seconds, nbytes, 1, "ok")
        upper = [u for u in range(t) if u not in self.victims and not self.tiers[u].peer] if self.promote else []
        # the codec the blob was written with: a tier reads every codec, whatever its own (a peer
        # codes on request, another instance may write a shared tier with another setting)
        written = chunk_codec_param(blob) if blob is not None else (self.codecs[t].code, 0)

        def same(u: int) -> bool:       # tier u would store this very blob
            return self.seals[u] == self.seals[t] and self.codecs[u].wrote(*written)

        if lossy:     # approximate KV goes up only as the same coded blob, never re-encoded as if exact
            upper = [u for u in upper if same(u)]
        if upper:
            if all(same(u) for u in upper) and blob is not None:
                self._enqueue(("promote", upper, ref, bytes(blob), None))
            elif not lossy:  # sealed or coded differently above: re-encoded by the writer
                self._enqueue(("promote", upper, ref, None, chunk.detach().to("cpu", copy=True)))
        return chunk

    def _load_pending(self, t: int, ref: ChunkRef, out: torch.Tensor | None) -> torch.Tensor | None:
        """The chunk of ``ref`` if it is on its way down (the exact KV the pool let go of, kept in
        memory until written), counted as a hit of tier ``t`` (where the lookup placed it) and in
        ``pending_hits``; else ``None``.  One copy."""
        if not self.tiers:
            return None
        kv = self._pending_kv(ref)
        if kv is None or tuple(kv.shape) != self._shape_of(ref) or kv.dtype != self.layout.dtype:
            return None
        chunk = out.copy_(kv) if out is not None else kv.clone()
        self._mark(chunk, False)
        nbytes = chunk.numel() * chunk.element_size()
        with self._stats_lock:
            self._per_tier["hits"][t] += 1
            self._per_tier["tier_bytes_loaded"][t] += nbytes
            self._counts["bytes_loaded"] += nbytes
            self._counts["pending_hits"] += 1
        if self.observers:
            self.observers.io(self.tiers[t].name, "load", 0.0, nbytes, 1, "ok")
        return chunk

    def _load_local(self, t: int, ref: ChunkRef, out: torch.Tensor | None) -> torch.Tensor | None:
        tier = self.tiers[t]
        key = self._prefix + ref.key
        promote = self.promote and t > 0
        t0 = time.perf_counter()
        try:
            if promote:  # keep a copy of the blob to promote
                blob = tier.get(key)
                chunk = None if blob is None else self._decode(t, ref, blob, out)
            else:
                blob, chunk = None, tier.read(key, lambda view: self._decode(t, ref, view, out))
        except (ChunkFormatError, OversizeBlob) as exc:
            self._bad_blob(t, ref, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a tier's fault must never reach the engine
            self._add("errors", tier=t)
            self._log("error", t, tier.name, exc)
            return None
        return None if chunk is None else self._loaded(t, ref, chunk, blob, time.perf_counter() - t0)

    def _decode_fetched(self, t: int, ref: ChunkRef, blob: Any, out: torch.Tensor | None) -> torch.Tensor | None:
        try:
            chunk = self._decode(t, ref, blob, out)
        except ChunkFormatError as exc:
            self._bad_blob(t, ref, exc)
            return None
        return self._loaded(t, ref, chunk, blob)

    def prefetch(self, tokens: Any, start: int = 0) -> Future[list[torch.Tensor]]:
        """Look up and load the chunks of ``tokens`` from chunk ``start`` on, on a worker thread.

        The future's result is ``load``'s: the tensors of chunks ``start, start + 1, ...`` that the
        tiers hold, up to the first miss (``refs(tokens)[start:]`` names them).  Token validation
        happens here, on the caller's thread; the future itself never raises for a tier fault.
        Cost on the caller's thread: one hash pass over ``tokens``.
        """
        refs = self.refs(tokens)[start:]
        with self._prefetch_lock:
            if self.writer.closed:
                done: Future[list[torch.Tensor]] = Future()
                done.set_result([])
                return done
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-prefetch")
            return self._prefetcher.submit(self._lookup_and_load, refs)

    def _lookup_and_load(self, refs: list[ChunkRef]) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s  # one deadline for both
        where = self.lookup([ref.key for ref in refs], deadline=deadline)
        return self.load(refs[:len(where)], where=where, deadline=deadline)

    # -- writes -------------------------------------------------------------------------------

    def store(self, items: Iterable[tuple[ChunkRef, torch.Tensor]], *, tiers: Iterable[int] | None = None,
              wait: float = 0.0, chain: bool = False) -> int:
        """Queue chunks to be encoded and written to every tier (or only ``tiers``, indices) that
        does not hold them yet; a local tier that holds one already counts it as just used
        (``refreshed``), so a store always leaves the chunk recent.  The number queued.  What does
        not fit in the queue is dropped and counted; with ``wait`` seconds, the call first waits
        (at most that long in all) for the writer to make room: for chunks that exist nowhere else
        (the pool is letting them go).

        ``chain``: the items are consecutive chunks of one sequence, head first (what an eviction
        lets go).  They are written deepest first, so that the head ends up the most recent in
        every tier's LRU order: a tier then evicts a chain from its end, as the tree evicts leaves
        first, never its head, which would leave the rest unreachable (a lookup stops at the first
        miss).  They are queued together: with ``wait``, a chain longer than ``queue_size`` waits
        for an empty queue and goes in whole (its tensors exist already); what cannot be queued in
        time is the chain's end, never its head.

        Each ``kv`` must be ``layout.chunk_shape(chunk_size)`` (a tail's: ``chunk_shape`` of its
        tokens, see ``tail_ref``) of ``layout.dtype`` (``ValueError``
        otherwise, before anything is queued); the stack keeps a reference until it is written,
        so do not modify it afterwards.  Cost: O(1) per item on the caller's thread.
        """
        items = list(items)
        for ref, kv in items:
            if not isinstance(ref, ChunkRef):
                raise TypeError(f"store takes (ChunkRef, tensor) pairs, got {type(ref).__name__}")
            shape = self._shape_of(ref)
            if not isinstance(kv, torch.Tensor) or kv.dtype != self.layout.dtype or tuple(kv.shape) != shape:
                got = f"{kv.dtype} {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__
                raise ValueError(f"kv must be a {self.layout.dtype} tensor of shape {shape}, got {got}")
        mask = self._mask(tiers)
        if not mask:
            return 0
        until = time.monotonic() + wait if wait > 0 else None
        if chain:
            queued = self._enqueue_chain([("store", ref, kv, mask) for ref, kv in items], until, pending=True)
        else:
            queued = sum(self._enqueue(("store", ref, kv, mask), until, pending=True) for ref, kv in items)
        return queued

    def _mask(self, tiers: Iterable[int] | None) -> frozenset[int]:
        if tiers is None:
            return frozenset(i for i, t in enumerate(self.tiers) if not t.peer)   # a peer tier is read-only
        mask = frozenset(tiers)
        if not all(isinstance(i, int) and 0 <= i < len(self.tiers) for i in mask):
            raise ValueError(f"tiers must be indices into the stack's {len(self.tiers)} tiers, got {sorted(mask)!r}")
        return frozenset(i for i in mask if not self.tiers[i].peer)

    def tier_stats(self) -> list[dict[str, Any]]:
        """Each tier's own ``stats()``, in stack order (a tier's fault gives ``{}``).  O(tiers)."""
        return [self._call(i, {}, tier.stats) for i, tier in enumerate(self.tiers)]

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """Pin 16-byte chunk keys in every local tier (``Tier.pin``: never evicted, held now or
        stored later, until ``unpin``); per tier, how many leading keys it pinned (a tier bounds
        its pins; one that cannot pin says 0).  A fault counts as 0.  O(len(keys)) per tier."""
        keys = [self._prefix + k for k in _chunk_keys(keys)]
        with self._stats_lock:
            self._pinned.update(keys)    # re-pinned as the writer stores them (tiers that pin held keys only)
        return [self._call(i, 0, tier.pin, keys) if tier.local else 0 for i, tier in enumerate(self.tiers)]

    def unpin(self, keys: Sequence[bytes]) -> list[int]:
        """Undo ``pin``; per tier, how many of the keys were pinned.  O(len(keys)) per tier."""
        keys = [self._prefix + k for k in _chunk_keys(keys)]
        with self._stats_lock:
            self._pinned.difference_update(keys)
        return [self._call(i, 0, tier.unpin, keys) if tier.local else 0 for i, tier in enumerate(self.tiers)]

    def release(self, keys: Sequence[bytes]) -> int:
        """Queue the deletion of each 16-byte chunk key from the victim tiers (``victims``: with
        ``exclusive``, the local volatile tiers), after the chunk moved up into the pool; the number
        queued (0 without victim tiers).  Never blocks; a release that does not fit the queue is
        dropped and counted (the chunk then stays below as well: inclusive, never wrong).
        Cost: O(1) per key on the caller's thread."""
        keys = _chunk_keys(keys)
        if not self.victims:
            return 0
        return sum(self._enqueue(("release", self._prefix + key)) for key in keys)

    def touch(self, keys: Sequence[bytes], *, tiers: Iterable[int] | None = None) -> int:
        """Queue an access of each 16-byte chunk key in every local tier (``Tier.local``) that holds
        it, so that its LRU order counts the chunk as just used; the number queued.  For a tier
        below the pool to act as a victim cache: call it with the chunks the pool evicts, one
        chain at a time, head first (as ``store(chain=True)``: they are touched deepest first, so
        that the head is the most recent).

        Never blocks: what does not fit in the queue (the chain's end) is dropped and counted in
        ``dropped_writes``.
        The writer thread performs each as ``read(key, len)`` (after a ``contains_prefix`` probe) on
        the tiers that hold it, before the writes it takes in the same batch; a fault is counted like
        any other.  Remote tiers are never read.  Cost: O(1) per key on the caller's thread.
        """
        keys = _chunk_keys(keys)
        mask = frozenset(i for i in self._mask(tiers) if self.tiers[i].local)
        if not mask:
            return 0
        return self._enqueue_chain([("touch", self._prefix + key, mask) for key in keys])

    def _enqueue(self, item: tuple[Any, ...], until: float | None = None, pending: bool = False) -> bool:
        return self._enqueue_chain([item], until, pending, chain=False) == 1

    def _enqueue_chain(self, items: list[tuple[Any, ...]], until: float | None = None, pending: bool = False,
                       chain: bool = True) -> int:
        """Queue ``items`` (the longest head that fits); with ``pending``, the stores among them are
        visible to lookups and loads from before they enter the queue until they are written."""
        if pending:
            self._note_pending(items, +1)
        taken = self.writer.put(items, until=until, chain=chain)
        if pending and taken < len(items):
            self._note_pending(items[taken:], -1)
        return taken

    def _note_pending(self, items: Sequence[tuple[Any, ...]], step: int) -> None:
        """Count the store ``items`` in (+1) or out (-1) of the chunks on their way down."""
        with self._pending_lock:
            for item in items:
                if item[0] != "store":
                    continue
                key = self._prefix + item[1].key
                entry = self._pending.get(key)
                if step > 0:
                    if entry is None:
                        self._pending[key] = [1, item[2], item[3]]
                    else:
                        entry[0] += 1
                        entry[1] = item[2]
                        entry[2] = entry[2] | item[3]
                elif entry is not None:
                    entry[0] -= 1
                    if entry[0] <= 0:
                        del self._pending[key]

    def _pending_for(self, tier: int, keys: Sequence[bytes]) -> int:
        """How many leading tier ``keys`` are on their way down to ``tier``.  O(answer)."""
        if not self._pending:
            return 0
        n = 0
        with self._pending_lock:
            for key in keys:
                entry = self._pending.get(key)
                if entry is None or tier not in entry[2]:
                    break
                n += 1
        return n

    def _pending_kv(self, ref: ChunkRef) -> torch.Tensor | None:
        """The KV of a chunk on its way down, or ``None``.  O(1)."""
        if not self._pending:
            return None
        with self._pending_lock:
            entry = self._pending.get(self._prefix + ref.key)
            return None if entry is None else entry[1]

    def _write_batch(self, batch: list[tuple[Any, ...]]) -> None:
        try:
            self._write_items(batch)
        finally:     # written, refused or lost: from now on the tiers answer for these chunks
            self._note_pending(batch, -1)

    def _write_items(self, batch: list[tuple[Any, ...]]) -> None:
        per_tier: list[list[tuple[bytes, bytes]]] = [[] for _ in self.tiers]
        deletes: list[list[bytes]] = [[] for _ in self.tiers]
        stores: list[tuple[ChunkRef, torch.Tensor, frozenset[int]]] = []
        touches: list[tuple[bytes, frozenset[int]]] = []
        encoded: dict[tuple[bytes, Seal, Codec], bytes] = {}

        def blob_for(ref: ChunkRef, kv: torch.Tensor, i: int) -> bytes:
            seal, codec = self.seals[i], self.codecs[i]
            if (ref.key, seal, codec) not in encoded:  # once per seal and codec: tiers may differ
                encoded[(ref.key, seal, codec)] = encode_chunk(self._prefix, ref.key, ref.parent, ref.tokens, kv,
                                                               seal=seal, codec=codec)
            return encoded[(ref.key, seal, codec)]

        for item in batch:
            if item[0] == "touch":
                touches.append((item[1], item[2]))
            elif item[0] == "delete":
                deletes[item[1]].append(item[2])
            elif item[0] == "release":
                for i in self.victims:
                    deletes[i].append(item[1])
                    self._add("released", tier=i)
                    if self.observers:
                        self.observers.chunks(self.tiers[i].name, self._prefix, (), (item[1][len(self._prefix):],))
            elif item[0] == "promote":
                _, upper, ref, blob, kv = item
                for i in upper:
                    per_tier[i].append((self._prefix + ref.key, blob if blob is not None
                                        else blob_for(ref, kv, i)))
                self._add("promoted")
            else:
                stores.append((item[1], item[2], item[3]))
        for i, tier in enumerate(self.tiers):
            with bounded(time.monotonic() + self.write_timeout_s):
                for key in deletes[i]:
                    self._call(i, None, tier.delete, key)
                mine = [k for k, mask in touches if i in mask]
                if mine:
                    # Before the writes: a touch comes from an eviction that made room for what
                    # follows it, and a write puts its chunk first in LRU order anyway.
                    held = [k for k in mine if self._call(i, 0, tier.contains_prefix, [k]) == 1]
                    touched = sum(self._call(i, None, tier.read, k, len) is not None for k in held)
                    self._add("touched", touched, tier=i)
                    self._add("refresh_misses", len(mine) - len(held), tier=i)
                # A tier that already holds a chunk is not written again (one cheap probe each); a
                # local one reads it instead, so that it counts as just used (victim-cache refresh).
                fresh = []
                for ref, kv, mask in stores:
                    if i not in mask:
                        continue
                    key = self._prefix + ref.key
                    if self._call(i, 0, tier.contains_prefix, [key]) == 0:
                        fresh.append((key, blob_for(ref, kv, i)))
                    elif tier.local and self._call(i, None, tier.read, key, len) is not None:
                        self._add("refreshed", tier=i)
                writes = per_tier[i] + fresh
                if not writes:
                    continue
                t0 = time.perf_counter()
                stored = self._call(i, None, tier.put_many, writes)
                with self._stats_lock:
                    repin = [k for k, _ in writes if k in self._pinned] if tier.local else []
                if repin:
                    self._call(i, 0, tier.pin, repin)
            if stored is not None:
                nbytes = sum(len(b) for _, b in writes)
                with self._stats_lock:
                    self._per_tier["stored"][i] += int(stored)
                    self._per_tier["tier_bytes_stored"][i] += nbytes
                    self._counts["bytes_stored"] += nbytes
            if self.observers:
                self._heard_store(i, writes, stored, time.perf_counter() - t0)
                self._heard_evictions(i)

    def _heard_store(self, i: int, writes: list[tuple[bytes, bytes]], stored: Any, seconds: float) -> None:
        """Tell the listeners of tier ``i``'s ``put_many`` of ``writes`` (``stored``: how many it took,
        ``None`` after a fault).  Which ones it took is not said by the protocol: all, when it took as
        many as were written; when it took fewer (an admission policy declined some, or it had no
        room), a local tier is asked which it holds (one in-memory probe a write), and those are
        told held and the rest dropped; a remote one is not asked (a round trip a write), and
        nothing is told.  O(writes)."""
        tier = self.tiers[i]
        nbytes = sum(len(b) for _, b in writes)
        self.observers.io(tier.name, "store", seconds, nbytes if stored is not None else 0, len(writes),
                          "error" if stored is None else "ok")
        if stored is None:
            return
        n = len(self._prefix)
        if int(stored) == len(writes):
            self.observers.chunks(tier.name, self._prefix, tuple(k[n:] for k, _ in writes), ())
        elif tier.local:
            held = {k for k, _ in writes if self._call(i, 0, tier.contains_prefix, [k]) == 1}
            self.observers.chunks(tier.name, self._prefix, tuple(k[n:] for k, _ in writes if k in held),
                                  tuple(k[n:] for k, _ in writes if k not in held))

    def _heard_evictions(self, i: int) -> None:
        """Tell the listeners what tier ``i`` dropped on its own (``Tier.take_evicted``), per
        namespace; that it lost track, as ``cleared`` of every namespace."""
        evicted = self._call(i, [], self.tiers[i].take_evicted)
        name, n = self.tiers[i].name, len(self._prefix)
        if evicted is None:
            self.observers.cleared(name, None)
            return
        by_ns: dict[bytes, list[bytes]] = {}
        for key in evicted:
            by_ns.setdefault(key[:n], []).append(key[n:])
        for ns, keys in by_ns.items():
            self.observers.chunks(name, ns, (), keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; ``False`` if ``timeout`` seconds passed first.
        For tests and shutdown: the engine never needs to wait."""
        return self.writer.flush(timeout)

    # -- the rest -----------------------------------------------------------------------------

    def drop_namespace(self, ns_id: bytes | None = None) -> int:
        """Delete every entry of namespace ``ns_id`` (default: this stack's) from every tier, after
        the queued writes are done; the number of entries deleted (a tier's fault counts as 0).
        Cost: one ``drop_namespace`` per tier (a scan or a listing of that namespace)."""
        ns_id = self._prefix if ns_id is None else ns_id
        if type(ns_id) is not bytes or len(ns_id) != len(self._prefix):
            raise ValueError(f"ns_id must be {len(self._prefix)} bytes (Namespace.id), got {ns_id!r}")
        self.flush()
        dropped = sum(self._call(i, 0, tier.drop_namespace, ns_id) for i, tier in enumerate(self.tiers))
        for tier in self.tiers if self.observers else ():
            self.observers.cleared(tier.name, ns_id)
        return dropped

    def stats(self) -> dict[str, Any]:
        """Counters: per tier (lists in stack order) ``tier_lookups`` (``contains_prefix`` calls),
        ``hits`` (chunks loaded), ``corrupt`` (blobs that failed verification, or that a remote tier
        refused as larger than a chunk: its own ``oversize``), ``forged`` (blobs
        without a valid MAC or AEAD tag under this stack's secrets), ``errors`` (faults),
        ``timeouts`` (reads that did not finish by their deadline; also in ``errors``),
        ``stored`` (chunks written), ``touched`` (chunks whose recency ``touch`` refreshed),
        ``refresh_misses`` (touches of chunks the tier no longer held: under inclusive caching, a
        chunk the tier evicted while the pool still had it), ``refreshed`` (stores of chunks the
        tier held already, read instead to refresh their recency), ``released`` (chunks deleted from
        a victim tier after they moved up into the pool),
        ``tier_bytes_loaded`` (KV bytes decoded from it), ``lossy_loaded`` (chunks decoded from a
        lossy codec: approximate KV),
        ``tier_bytes_stored`` (blob bytes written to it); and
        ``lookups``, ``lookup_keys``, ``lookup_found``, ``misses`` (lookups that stopped on a key no
        tier holds), ``load_misses`` (loads that stopped early), ``promoted``, ``dropped_writes``,
        ``bytes_loaded`` (KV bytes decoded), ``bytes_stored`` (blob bytes handed to tiers' ``put_many``
        without a fault), ``pending_hits`` (chunks served while still on their way down, from the
        write queue; also in their tier's ``hits``), ``queued`` (writes waiting) and
        ``queued_bytes`` (their bytes).  A new dict each call.  O(tiers)."""
        with self._stats_lock:
            result: dict[str, Any] = {"tiers": [t.name for t in self.tiers]}
            result.update({k: list(v) for k, v in self._per_tier.items()})
            result.update(self._counts)
        result["queued"] = len(self.writer)
        result["queued_bytes"] = self.writer.queued_bytes
        return result

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to ``timeout`` seconds), stop the threads, close every tier
        (faults logged, not raised).  Idempotent; later stores are dropped and counted."""
        if self.writer.closed:
            return
        self.writer.close(timeout)
        with self._prefetch_lock:
            prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.shutdown(wait=True)
        for i, tier in enumerate(self.tiers):
            self._call(i, None, tier.close)

    def __enter__(self) -> TierStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> None:
        """Assert the stack's invariants and every tier's ``check()``.  Raises ``AssertionError``."""
        self.writer.check()
        with self._stats_lock:
            assert all(len(v) == len(self.tiers) for v in self._per_tier.values()), "per-tier counters misshapen"
            assert all(x >= 0 for v in self._per_tier.values() for x in v), "negative per-tier counter"
            assert all(v >= 0 for v in self._counts.values()), "negative counter"
            assert self._counts["lookup_found"] <= self._counts["lookup_keys"], "found more keys than asked"
            assert all(t <= e for t, e in zip(self._per_tier["timeouts"], self._per_tier["errors"])), \
                "a timeout not counted as an error"
        assert len(self.seals) == len(self.tiers), "one seal per tier"
        assert len(self.codecs) == len(self.tiers), "one codec per tier"
        for tier, codec in zip(self.tiers, self.codecs):
            assert not codec.code or not (tier.victim or tier.peer), f"{tier.name}: a CPU or peer tier coded"
        with self._stats_lock:
            assert all(x <= h for x, h in zip(self._per_tier["lossy_loaded"], self._per_tier["hits"])), \
                "more lossy chunks than chunks loaded"
        for tier, seal in zip(self.tiers, self.seals):
            assert (seal.mode == 2) == (self.encrypt and not tier.local and not tier.peer), \
                f"{tier.name}: sealed against `encrypt`"
            assert seal.keyed == self.seals[0].keyed, f"{tier.name}: keyed unlike the other tiers"
        for tier in self.tiers:
            tier.check()


def _write_cost(item: tuple[Any, ...]) -> int:
    """The bytes a queued write holds until it is written: a store's or a promotion's KV (or
    blob); a touch, a delete or a release, next to nothing."""
    if item[0] == "store":
        return int(item[2].numel() * item[2].element_size())
    if item[0] == "promote":
        blob, kv = item[3], item[4]
        return len(blob) if blob is not None else int(kv.numel() * kv.element_size())
    return 64


def _codecs(tiers: tuple[Tier, ...], codecs: Sequence[str | Codec | None] | None) -> tuple[Codec, ...]:
    """One codec per tier from the ``codecs`` argument (``None``: raw everywhere); ``ValueError``
    for a wrong count or a codec on the CPU tier (a victim tier) or a peer tier."""
    if codecs is None:
        return tuple(get_codec(None) for _ in tiers)
    if isinstance(codecs, (str, Codec)) or len(codecs) != len(tiers):
        raise ValueError(f"codecs must name one codec per tier ({len(tiers)}), got {codecs!r}")
    out = tuple(get_codec(c) for c in codecs)
    for codec in set(out):
        codec.ready()                 # a missing library fails here, naming the extra, not at the first write
    for i, (tier, codec) in enumerate(zip(tiers, out)):
        if codec.code and (tier.victim or tier.peer):
            raise ValueError(f"codecs: tier {i} ({tier.name}) is {'a peer' if tier.peer else 'the CPU'} tier, "
                             f"which stays raw; got {codec.name!r}")
    return out


def _chunk_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list, each checked to be a 16-byte chunk key (``ValueError`` otherwise)."""
    keys = list(keys)
    for key in keys:
        if type(key) is not bytes or len(key) != 16:
            raise ValueError(f"keys must be 16-byte chunk keys, got {key!r}")
    return keys


def _bad_answer(tier: Tier, n: object) -> None:
    raise TypeError(f"{type(tier).__name__}.contains_prefix returned {n!r}, not an int in range")
