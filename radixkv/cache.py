"""``PrefixCache``: the engine-facing cache that keeps the radix tree and the page pool consistent.

The protocol of a paged engine (every call validates its arguments and leaves the cache as it was
when it raises; ``radixkv.request`` has the per-request state and the load behaviours):

    req = cache.open(tokens)           # holds the cached prefix: req.num_cached tokens in req.pages
    new = cache.alloc(n)               # pages for the rest (evicts LRU unheld prefixes when short)
    ...                                # the engine writes KV for tokens[req.num_cached:] into `new`
    table = req.extend(tokens, new[:full])   # cached and still held; the canonical page table
    req.release()                      # and cache.free() the pages never cached (a partial tail)

and the one-call path, for engines that copy KV out of the pool:

    m = cache.match(tokens)            # cached prefix: m.num_tokens tokens in pages m.pages, held
    cache.insert(tokens, torch.cat([m.pages, new]))   # the cache takes ownership of these pages
    cache.release(m)

Every page is in exactly one place at any moment: free in the pool, held by the tree, or held by
the engine (allocated and not yet cached).  ``check()`` verifies it, and that every live request's
pages are in the tree, locked, and hold its tokens' prefix.

With ``tiers``, lookups are a waterfall: ``open``/``match`` continue from the first chunk the tree
does not fully cover, ask the ``TierStack`` which of the following chunks the tiers hold, load and
verify them on a worker by a deadline, scatter them into new pool pages (only the pages past the
tree's match when that match ends inside a chunk) and insert them into the tree.  Writes go down
asynchronously.  ``write_through`` stores every new full chunk when it is inserted, in every tier
that keeps copies of the pool; ``write_back`` stores nothing then.  When the tree evicts the node a
chunk ends in, the chunk is stored below where it is not kept already (``write_back``: every tier;
``write_through``: the victim tiers) and refreshed in the other local tiers' LRU order, so the tiers
keep what the pool lets go.

``exclusive`` (the default: measured better or equal at every pool size, ``python -m radixkv.bench
policy``) makes the local volatile tiers private to the cache (a ``CpuTier``: ``Tier.victim``)
exclusive of the pool: they hold only what the pool evicted, a chunk loaded from them moves up (it
is deleted below), and nothing is promoted into them — so the pool and such a tier together hold
as much as their sizes add up to, instead of the tier holding copies of what the pool has.
Persistent tiers (LMDB, S3, Redis) stay inclusive: under ``write_through`` they get every chunk at
insert, so a crash loses nothing that was cached.  Either way the chunk's pages are copied out
synchronously and the copy is queued, so a write takes no lock on the tree: nothing can be left
locked by a write that fails or is dropped.

A ``PrefixCache`` is used from one engine thread; the tier stack does its writes on its own thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np
import torch

from radixkv._checks import check_int
from radixkv._exit import flush_at_exit
from radixkv import ops
from radixkv.hashing import Namespace, as_token_bytes, keys_from_token_bytes
from radixkv.groups import GroupLoad, KVGroups, fetch_group_chunks
from radixkv.pool import KVLayout, KVPool, PagePool, as_page_ids, check_device, has_duplicates
from radixkv.request import LOAD_MODES, PendingLoad, Request, fetch_chunks
from radixkv.tree import MatchResult, RadixNode, RadixTree

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixkv.backends import Tier
    from radixkv.tiers import ChunkRef, TierStack

__all__ = ["Match", "PoolExhausted", "PrefixCache", "Request"]

log = logging.getLogger("radixkv.cache")

_FREE, _ENGINE, _TREE = 0, 1, 2
# An eviction's write-back (write_back, or the victim tiers of an exclusive stack) waits at most this
# long in all for room in the tier write queue: those chunks exist nowhere else, and one eviction
# can free more of them than the queue holds.  Past it they are dropped and counted.
SPILL_WAIT_S = 1.0
_NO_PAGES = np.empty(0, dtype=np.int64)


class CacheStats(dict):  # type: ignore[type-arg]
    """``PrefixCache.stats()``: a plain dict of counters that Jupyter shows as tables."""

    def _repr_html_(self) -> str:
        from radixkv.viz import stats_html

        return stats_html(self)


class PoolExhausted(RuntimeError):
    """``alloc`` cannot find enough pages even after evicting every unlocked prefix."""


@dataclass(frozen=True, slots=True)
class Match:
    """A cached prefix, locked against eviction until ``PrefixCache.release``.

    ``pages`` (int64, CPU) holds the KV of ``tokens[:num_tokens]``; ``num_tokens`` is a multiple
    of the page size.  ``tier_tokens`` of them were loaded from the tiers by this match (the rest
    were resident in the pool already); ``tier_tokens_by_tier`` splits them by tier.
    """

    num_tokens: int
    pages: torch.Tensor
    id: int
    tier_tokens: int = 0
    tier_tokens_by_tier: tuple[int, ...] = ()    # of tier_tokens, how many each tier served (stack order)

    def __repr__(self) -> str:
        return f"Match({self.num_tokens} tokens in {len(self.pages)} pages, id={self.id})"


class PrefixCache:
    """Prefix cache over a paged KV pool.  See the module docstring for the protocol.

    ``tiers`` (fastest first, or a ready ``TierStack``) go below the pool; ``promote`` copies lower-tier
    hits into the tiers above; ``write_queue`` bounds the chunks waiting to be written (a chunk that
    does not fit is dropped and counted: with ``write_back``, one eviction may spill many chunks at
    once, so give it room).

    >>> layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)
    >>> cache = PrefixCache(layout, num_pages=8)
    >>> tokens = [1, 2, 3, 4, 5]
    >>> m = cache.match(tokens); m.num_tokens
    0
    >>> new = cache.alloc(3)                 # 2 full pages and the tail page
    >>> cache.insert(tokens, torch.cat([m.pages, new])); cache.release(m)
    0
    >>> m = cache.match(tokens); m.num_tokens  # the last token is always left to compute
    4
    >>> cache.release(m); cache.check()
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu",
                 namespace: Namespace | None = None, tiers: Sequence[Tier] | TierStack = (),
                 chunk_size: int = 256, write_policy: str = "write_through", promote: bool = True,
                 write_queue: int = 64, load_timeout: float = 5.0, load_workers: int = 4,
                 exclusive: bool = True, window_pages: int | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if check_int(chunk_size, "chunk_size", 1) % layout.page_size:
            raise ValueError(f"chunk_size must be a positive multiple of page_size={layout.page_size}, "
                             f"got {chunk_size!r}")
        if write_policy not in ("write_through", "write_back"):
            raise ValueError(f"write_policy must be 'write_through' or 'write_back', got {write_policy!r}")
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        check_int(write_queue, "write_queue", 1)
        check_int(load_workers, "load_workers", 1)
        if isinstance(load_timeout, bool) or not isinstance(load_timeout, (int, float)) or not load_timeout >= 0:
            raise ValueError(f"load_timeout must be a number of seconds >= 0, got {load_timeout!r}")
        self.layout = layout
        self.load_timeout = float(load_timeout)
        self.load_workers = load_workers
        self._loader: ThreadPoolExecutor | None = None
        self.page_size = layout.page_size
        self.chunk_size = chunk_size
        self.write_policy = write_policy
        self.namespace = (namespace or Namespace(model="unnamed")).bind(layout)
        self.device = check_device(device)
        #: The KV groups of a layout with sliding-window layers (``radixkv.groups``), else ``None``.
        self.groups: KVGroups | None = None
        if window_pages is not None:
            check_int(window_pages, "window_pages", 1)
            if not layout.grouped:
                raise ValueError("window_pages: the layout has no sliding-window layers")
        if layout.grouped:
            full = [g for g in layout.groups if not g.sliding]
            # The token pages: the full-attention group's pool, or, when every layer slides, a free
            # list with no KV of its own (its ``kv`` is never read then: only full groups are).
            self.pool: KVPool = (KVPool(layout.group_layout(full[0]), num_pages, device) if full
                                 else cast(KVPool, PagePool(num_pages)))
            self.groups = KVGroups(layout, num_pages, window_pages or num_pages, self.device,
                                   self.pool if full else None)
        else:
            self.pool = KVPool(layout, num_pages, device)
        self.tree = RadixTree(layout.page_size)
        self._state = np.zeros(num_pages, dtype=np.uint8)   # _FREE / _ENGINE / _TREE per page
        self._live: dict[int, Request] = {}
        self._pins: dict[bytes, Request] = {}       # pinned token prefixes, held like requests
        #: The most tokens ``pin`` may hold in the pool (half of it).
        self.pin_budget = num_pages * layout.page_size // 2
        self._counters = dict.fromkeys(
            ("matches", "query_tokens", "hit_tokens", "pool_hit_tokens", "tier_hit_tokens", "inserts",
             "inserted_tokens", "duplicate_pages", "allocs", "allocated_pages", "evicted_pages", "evictions",
             "chunks_stored", "chunks_not_queued", "tails_stored", "late_loads", "load_errors"), 0)
        #: One ``TierStack`` per KV group over the same tiers (``layout.groups`` order; each group's
        #: chunks have keys of their own namespace); ``stack`` is the first (the only one without groups).
        self.stacks: list[TierStack] = self._make_stacks(tiers, namespace, promote, write_queue, exclusive)
        self.stack = self.stacks[0] if self.stacks else None
        #: The tiers that keep copies of what the pool holds (written at insert under
        #: ``write_through``): all but the stack's victim tiers.
        self._kept_tiers: frozenset[int] = frozenset()
        if self.stack is not None:
            self._kept_tiers = frozenset(range(len(self.stack.tiers))) - self.stack.victims
            for stack in self.stacks:
                flush_at_exit(stack)
            # Blobs of several sizes (tails; with groups, each group's chunks): tell fixed-slot tiers
            # the largest before a smaller one comes first and sizes their slots.
            from radixkv.format import encoded_size

            for i, tier in enumerate(self.stack.tiers):
                tier.expect(max(encoded_size(st.shape, layout.dtype, st.seals[i]) for st in self.stacks))
            if self.groups is not None:
                # A tier match ends on a chunk boundary: keep up to a chunk more of each window, so
                # that the chunks a tier match needs are whole in the pool when they are stored.
                self.groups.keep = self.groups.keep_for(chunk_size)
        self._tier_hit_tokens = [0] * (len(self.stack.tiers) if self.stack else 0)

    @classmethod
    def from_config(cls, config: Any = None, layout: KVLayout | None = None) -> PrefixCache:
        """Build a cache and its tiers from a dict, a YAML/JSON file, or (``None``) the file named by
        ``RADIXKV_CONFIG``; see ``radixkv.config`` for the keys.  ``layout`` comes from the model
        (or a ``layout`` mapping in the config).  A bad or unknown key raises ``ValueError`` naming it.
        """
        from radixkv.config import load_config

        return load_config(config).build(layout)

    def _make_stacks(self, tiers: Any, namespace: Namespace | None, promote: bool, write_queue: int,
                     exclusive: bool) -> list[TierStack]:
        from radixkv.tiers import TierStack   # here, so that a cache without tiers needs no backend

        if isinstance(tiers, TierStack):
            if self.groups is not None:
                raise ValueError("tiers: a layout with sliding-window layers needs a stack per KV group; "
                                 "pass the tiers themselves")
            if (tiers.namespace, tiers.layout, tiers.chunk_size) != (self.namespace, self.layout, self.chunk_size):
                raise ValueError("tiers: the TierStack's namespace, layout or chunk_size differ from the cache's")
            return [tiers]
        tiers = list(tiers)
        if not tiers:
            return []
        if self.groups is None:
            return [TierStack(tiers, namespace=self.namespace, layout=self.layout, chunk_size=self.chunk_size,
                              promote=promote, queue_size=write_queue, exclusive=exclusive)]
        base = namespace or Namespace(model="unnamed")
        return [TierStack(tiers, namespace=base.bind(self.layout, group), layout=self.layout.group_layout(group),
                          chunk_size=self.chunk_size, promote=promote, queue_size=write_queue, exclusive=exclusive)
                for group in self.layout.groups]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued tier write is done (``False`` if ``timeout`` seconds passed
        first).  For tests, benchmarks and shutdown: an engine never needs to wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(stack.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for stack in self.stacks)

    def close(self) -> None:
        """Finish queued tier writes and close the tiers.  Idempotent.  Without it, queued writes
        are flushed at interpreter exit, for at most ``RADIXKV_EXIT_FLUSH_S`` seconds (10)."""
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        for stack in self.stacks:
            stack.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """Jupyter's rich display: occupancy, levels and the tree (``radixkv.viz.cache_html``)."""
        from radixkv.viz import cache_html

        return cache_html(self)

    def __repr__(self) -> str:
        return (f"PrefixCache({self.pool.num_pages} pages x {self.page_size} tokens, "
                f"{self.tree.total_size} tokens cached, {len(self._live)} live matches)")

    # ---------------------------------------------------------------- the protocol

    def open(self, tokens: Any, *, leave_last: bool = True, load: str = "wait",
             deadline_s: float | None = None) -> Request:
        """Start a request: find and hold the longest cached page-aligned prefix of ``tokens``.

        Returns a ``Request`` that holds every page of ``tokens[:req.num_cached]`` until
        ``release``.  ``tokens`` is converted once, here.  With ``leave_last`` (the default) the
        match never covers the last token, whose logits the engine needs.  With tiers, the chunks
        past the pool's match are looked up and fetched on a worker thread by a deadline
        (``deadline_s`` seconds from now, default ``load_timeout``): ``load="wait"`` lands them
        before returning (the engine thread waits at most until the deadline), ``"async"`` returns
        at once with what the pool holds and a pending load (``poll``/``wait`` land it),
        ``"none"`` asks the pool only.  A tier fault or a late load is a miss, never an exception.
        Cost on the engine thread: one conversion, O(d + L/page_size + log n) for the tree, plus
        with tiers one hash pass over the uncovered chunks and, when they land, one scatter per
        chunk.
        """
        if type(leave_last) is not bool:
            raise TypeError(f"leave_last must be a bool, got {type(leave_last).__name__}")
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {LOAD_MODES}, got {load!r}")
        deadline = self._deadline(deadline_s) if load != "none" or deadline_s is not None else 0.0
        data = as_token_bytes(tokens)
        return self._open(data, len(data) - 4 if leave_last and data else len(data), load, deadline)

    def _open(self, data: bytes, usable: int, load: str, deadline: float, count: bool = True) -> Request:
        result = self._usable_match(data, usable)
        self.tree._lock(result.node)
        if self.groups is not None:
            self.groups.hold(result.node, 1)
        req = Request(self, data, usable, result.node, result.pages, result.num_tokens)
        self._live[req.id] = req
        if count:
            c = self._counters
            c["matches"] += 1
            c["query_tokens"] += len(data) // 4
            c["hit_tokens"] += result.num_tokens
            c["pool_hit_tokens"] += result.num_tokens
        if load != "none" and self.stack is not None:
            self._start_load(req, deadline)
            if load == "wait":
                self.wait(req)
        return req

    def _usable_match(self, data: bytes, size: int) -> MatchResult:
        """The tree's match of ``data[:size]``, cut (with groups) to the longest prefix whose every
        sliding group holds its window (``KVGroups.usable``)."""
        if self.groups is None:
            return self.tree._match(data, size)
        node, pos, path, cut = self.tree._walk(data, size - size % (4 * self.page_size))
        parts = [n.pages for n in path] + ([cut[0].pages[:cut[1]]] if cut is not None else [])
        pages = np.concatenate(parts) if parts else _NO_PAGES
        return self.tree._match(data[:self.groups.usable(pages) * self.page_size * 4])

    def match(self, tokens: Any, *, leave_last: bool = True, deadline_s: float | None = None) -> Match:
        """The one-call path: ``open(tokens, load="wait")`` as a ``Match`` (see ``open``).

        The match holds its pages until ``release``; pages passed to ``insert`` afterwards are the
        tree's, not held for the caller (use ``open`` and ``Request.extend`` for that).
        """
        req = self.open(tokens, leave_last=leave_last, deadline_s=deadline_s)
        return Match(req.num_cached, req.pages, req.id, req.tier_tokens, req.tier_tokens_by_tier)

    def prefetch(self, tokens: Any) -> Future[list[torch.Tensor]]:
        """Start loading what the tiers hold of ``tokens`` past what the pool holds, on a worker
        thread, and return its future (see ``TierStack.prefetch``).  Chunks found below the top tier
        are promoted into the tiers above, so a ``match`` a moment later loads them from the fastest
        tier.  Without tiers the future is already done, with no chunks.  Cost on the caller's
        thread: one tree walk and one hash pass.
        """
        from concurrent.futures import Future

        data = as_token_bytes(tokens)
        if self.stack is None:
            done: Future[list[torch.Tensor]] = Future()
            done.set_result([])
            return done
        start = self.tree._match(data).num_tokens // self.chunk_size
        return self.stack.prefetch(tokens, start)

    def _deadline(self, deadline_s: float | None) -> float:
        if deadline_s is None:
            deadline_s = self.load_timeout
        elif isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s >= 0:
            raise ValueError(f"deadline_s must be a number of seconds >= 0, got {deadline_s!r}")
        return time.monotonic() + deadline_s

    def _start_load(self, req: Request, deadline: float) -> None:
        """Hand the chunks past ``req``'s pool match to a worker, if the tiers may hold any."""
        assert self.stack is not None
        cs, ps = self.chunk_size, self.page_size
        first, last = req.num_cached // cs, req._usable // 4 // cs
        if first >= last:
            return          # not even one chunk past the pool: no worker round trip for a tail's pages
        every = self.stack.refs_from_bytes(req._data[:last * cs * 4])     # keys chain from token 0
        refs = every[first:]
        # Fetch no more chunks than the pool could take without touching held or engine pages.
        room = self.pool.num_free + self.tree.evictable_size // ps + (req.num_cached - first * cs) // ps
        limit = min(len(refs), room // (cs // ps))
        if limit == 0:
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=self.load_workers, thread_name_prefix="radixkv-load")
        if self.groups is not None:
            self._start_group_load(req, first, first + limit, deadline)
            return
        tail = None             # without groups, a tail (fewer tokens than a chunk) may follow the chunks
        if self.groups is None:
            parent = every[first - 1].key if first else self.stack.namespace.root
            tail = (parent, req._data[first * cs * 4:req._usable])
        req._pending = PendingLoad(self._loader.submit(fetch_chunks, self.stack, refs, limit, deadline, tail),
                                   first, deadline, [ref.key for ref in refs])

    def _start_group_load(self, req: Request, first: int, last: int, deadline: float) -> None:
        """``_start_load`` of a grouped cache: refs per group, and which chunks before ``first``
        each sliding group holds whole in the pool (``fetch_group_chunks`` plans the rest)."""
        assert self.groups is not None and self._loader is not None
        cs, per_chunk = self.chunk_size, self.chunk_size // self.page_size
        refs = self._refs(req._data[:last * cs * 4])
        window: list[int] = []
        pool_ok: list[np.ndarray] = []
        for group in self.layout.groups:
            ids = self.groups.pages_of(group, req._pages[:first * per_chunk]).reshape(first, per_chunk)
            pool_ok.append(np.asarray((ids >= 0).all(axis=1)))
            window.append(-(-(group.window - 1) // cs) if group.sliding else 0)
        future = self._loader.submit(fetch_group_chunks, self.stacks, self.layout.groups, refs, first, last,
                                     window, pool_ok, deadline)
        req._pending = PendingLoad(future, first, deadline, [])   # type: ignore[arg-type]

    def poll(self, req: Request) -> bool:
        """Land ``req``'s pending load if it has arrived: its chunks go into new pool pages and the
        tree, and ``req.num_cached`` / ``req.pages`` grow.  Past the deadline the load is dropped (a
        miss).  ``True`` when nothing is pending any more.  Never blocks.  Cost: O(1) while in
        flight; when it lands, a tree walk and one scatter per chunk."""
        self._held(req)
        pending = req._pending
        if pending is None:
            return True
        if pending.future.done():
            req._pending = None
            try:
                result = pending.future.result()
            except Exception as exc:   # noqa: BLE001 - a fault below the pool is a miss
                self._counters["load_errors"] += 1
                _log_load_error(exc)
                return True
            if isinstance(result, GroupLoad):
                if result.end > pending.first:
                    self._land_groups(req, pending.first, result)
                return True
            where, chunks, tail = result
            if chunks:
                landed = self._land(req, pending.first, where, chunks)
                if self.stack is not None and self.stack.victims:     # exclusive: moved up, not copied
                    keys = pending.keys[:len(chunks) - (tail is not None)] + ([tail] if tail is not None else [])
                    self.stack.release(keys[:landed])
            return True
        if time.monotonic() < pending.deadline:
            return False
        req._pending = None
        pending.future.cancel()
        self._counters["late_loads"] += 1
        return True

    def wait(self, req: Request, timeout: float | None = None) -> bool:
        """Block until ``req``'s pending load lands or its deadline passes, or ``timeout`` seconds;
        ``True`` when nothing is pending any more.  The wait never outlasts the deadline.  Cost:
        ``poll``'s plus the wait."""
        self._held(req)
        pending = req._pending
        if pending is not None:
            limit = pending.remaining() if timeout is None else min(timeout, pending.remaining())
            futures_wait([pending.future], timeout=limit)
        return self.poll(req)

    def _land(self, req: Request, first: int, where: list[int], chunks: list[torch.Tensor]) -> int:
        """Put loaded chunks ``first, first + 1, ...`` of ``req`` (the last may be a tail, of fewer
        tokens) into pool pages and the tree and move ``req``'s hold to the end of them; return how
        many of them the pool now holds whole.  The tree may have grown meanwhile (another request
        cached some of these tokens): only what it still lacks is copied in; what the pool has no
        room for is left out."""
        cs, ps = self.chunk_size, self.page_size
        sizes = [int(chunk.shape[2]) for chunk in chunks]          # tokens: cs, or a tail's fewer
        end = first * cs + sum(sizes)
        if end <= req.num_cached:
            return 0                                # a tail that ends inside what the pool holds
        result = self._usable_match(req._data, end * 4)
        self._move_hold(req, result.node)
        req._pages, held = result.pages, req.num_cached
        req.num_cached = result.num_tokens
        have, done = result.num_tokens - first * cs, 0               # whole chunks the tree has, then
        while done < len(sizes) and have >= sizes[done]:              # pages into the next
            have -= sizes[done]
            done += 1
        skip = have // ps
        chunks, where, sizes = chunks[done:], where[done:], sizes[done:]
        room = self.pool.num_free + self.tree.evictable_size // ps
        need, keep = 0, 0
        for i, size in enumerate(sizes):
            k = size // ps - (skip if i == 0 else 0)
            if need + k > room:
                break
            need, keep = need + k, keep + 1
        chunks, where, sizes = chunks[:keep], where[:keep], sizes[:keep]
        if chunks:
            new = self._take_pages(need)
            try:
                start = 0
                for i, chunk in enumerate(chunks):
                    k = sizes[i] // ps - (skip if i == 0 else 0)
                    ops.scatter_pages(chunk.to(self.pool.device), self.pool, new[start:start + k],
                                      skip_pages=skip if i == 0 else 0)
                    start += k
            except BaseException:
                self._free_pages(new)
                raise
            stop = result.num_tokens + len(new) * ps
            pages = np.concatenate([result.pages, new])
            inserted = self.tree._insert(req._data[:stop * 4], pages)
            assert inserted.prefix_len == result.num_tokens, "the held tree match changed under a load"
            self._state[new] = _TREE
            self._move_hold(req, inserted.node)
            req._pages, req.num_cached = pages, stop
        # Count what the tiers served (tokens resident meanwhile count as pool hits).
        by_tier = [0] * len(self.stack.tiers)     # type: ignore[union-attr]
        for i, tier in enumerate(where):
            by_tier[tier] += sizes[i] - (skip * ps if i == 0 else 0)
        for tier, n in enumerate(by_tier):
            self._tier_hit_tokens[tier] += n
        tier_tokens = sum(by_tier)
        c = self._counters
        c["hit_tokens"] += req.num_cached - held
        c["pool_hit_tokens"] += req.num_cached - held - tier_tokens
        c["tier_hit_tokens"] += tier_tokens
        req.tier_tokens += tier_tokens
        req.tier_tokens_by_tier = tuple(by_tier)
        return done + len(chunks)

    def _land_groups(self, req: Request, first: int, load: GroupLoad) -> None:
        """``_land`` of a grouped cache: the full groups' chunks ``first..load.end-1`` go into new
        tree pages past what the tree holds, each sliding group's window chunks into its pages
        (filling pages the tree had dropped), sliding pages no chunk covers are dropped, and the
        request's hold moves to the longest usable prefix.  What the pools have no room for is a
        miss."""
        assert self.groups is not None and self.stack is not None
        cs, ps, per_chunk = self.chunk_size, self.page_size, self.chunk_size // self.page_size
        data = req._data[:load.end * cs * 4]
        held = req.num_cached
        result = self.tree._match(data)
        self.tree.lock(result.node)                     # what the tree has stays while pages are taken
        try:
            end = self._land_group_chunks(data, result, load)
        finally:
            self.tree.unlock(result.node)
        self._settle(req, held, load)
        self._trim(end)                   # after the hold moved: the window it needs stays

    def _land_group_chunks(self, data: bytes, result: MatchResult, load: GroupLoad) -> RadixNode:
        """``_land_groups``' copies; returns the node that ends what the tree now holds of ``data``."""
        assert self.groups is not None
        ps, per_chunk = self.page_size, self.chunk_size // self.page_size
        total = load.end * per_chunk
        new = _NO_PAGES
        if total > len(result.pages):
            if total - len(result.pages) > self.pool.num_free + self.tree.evictable_size // ps:
                return result.node
            try:
                new = self._take_pages(total - len(result.pages))
            except PoolExhausted:
                return result.node
        pages = np.concatenate([result.pages, new])
        covered = [np.zeros(total, dtype=bool) for _ in self.groups.sliding]
        try:
            for group, (need, _, chunks) in zip(self.layout.groups, load.parts):
                if group.sliding:
                    s = self.groups.sliding.index(group)
                    pool, table = self.groups.pools[s], self.groups.maps[s]
                else:
                    pool, table = self.pool, None         # type: ignore[assignment]
                for j, chunk in zip(need, chunks):
                    ids = pages[j * per_chunk:(j + 1) * per_chunk]
                    if table is not None:
                        gone = ids[table[ids] < 0]
                        if gone.size > pool.num_free:
                            continue                      # no room in the group's pool: a shorter match
                        table[gone] = pool.alloc(gone.size)
                        covered[s][j * per_chunk:(j + 1) * per_chunk] = True
                        ops.scatter_pages(chunk.to(pool.device), pool, table[ids])
                    else:
                        skip = max(0, len(result.pages) - j * per_chunk)
                        if skip < per_chunk:
                            ops.scatter_pages(chunk.to(pool.device), pool, ids[skip:], skip_pages=skip)
            for s, table in enumerate(self.groups.maps):  # new pages no sliding chunk wrote hold nothing
                junk = new[~covered[s][len(result.pages):]]
                if junk.size:
                    self.groups._drop(self.groups.pools[s], table, junk)
        except BaseException:
            self._free_pages(new)
            raise
        if not new.size:
            return result.node
        inserted = self.tree._insert(data[:total * ps * 4], pages)
        assert inserted.prefix_len == len(result.pages) * ps, "the held tree match changed under a load"
        self._state[new] = _TREE
        return inserted.node

    def _settle(self, req: Request, held: int, load: GroupLoad) -> None:
        """Move ``req``'s hold to the longest usable prefix of what ``load`` brought (never less
        than the ``held`` tokens) and count the tokens the tiers served beyond them."""
        usable = self._usable_match(req._data, load.end * self.chunk_size * 4)
        if usable.num_tokens <= held:
            return
        self._move_hold(req, usable.node)
        req._pages, req.num_cached = usable.pages, usable.num_tokens
        gained = req.num_cached - held
        if gained > 0:
            c = self._counters
            tier = next((where[0] for _, where, _ in load.parts if where), 0)
            c["hit_tokens"] += gained
            c["tier_hit_tokens"] += gained
            self._tier_hit_tokens[tier] += gained
            req.tier_tokens += gained
            by_tier = [0] * len(self.stack.tiers)     # type: ignore[union-attr]
            by_tier[tier] = gained
            req.tier_tokens_by_tier = tuple(by_tier)
        if self.stack is not None and self.stack.victims:
            for stack, (need, _, _), refs in zip(self.stacks, load.parts, self._refs(req._data[:load.end * self.chunk_size * 4])):
                stack.release([refs[j].key for j in need])      # exclusive: moved up, not copied

    def extend(self, req: Request, tokens: Any, pages: Any) -> torch.Tensor:
        """Cache the KV the engine computed for ``req`` and keep holding it (SGLang's
        ``cache_unfinished_req``): call it after prefill and whenever decoding fills a page.

        ``tokens`` is the request's whole sequence so far (prompt and generated tokens; only those
        past what the request already has are converted); ``pages`` has one id from ``alloc`` per
        full page of ``tokens`` past ``req.num_cached`` (a partial tail page is not passed: it stays
        the engine's).  Returns the canonical page table of ``tokens[:req.num_cached]``: where
        another request cached the same tokens first, the tree's pages replace the engine's, which
        are freed — the engine must use the returned ids from now on.  Raises ``ValueError`` /
        ``TypeError`` and changes nothing for a wrong page count or a page not from ``alloc``.
        A pending load is dropped first (the engine computed those tokens itself).
        Cost: O(new tokens) to convert, O(d + L/page_size + log n) to insert, plus with
        ``write_through`` one gather per newly completed chunk.
        """
        self._held(req)
        data = req._grow(tokens)
        ids = as_page_ids(pages, self.pool.num_pages, "pages")
        full = len(data) // (4 * self.page_size)
        held = len(req._pages)
        if len(ids) != full - held:
            raise ValueError(f"pages: {len(data) // 4} tokens have {full} full pages, {held} of them held "
                             f"already: {full - held} page ids needed, got {len(ids)}")
        if has_duplicates(ids):
            raise ValueError("pages: the same page id is given more than once")
        if not self._all_engine(ids):
            raise ValueError(f"pages: page {int(ids[self._state[ids] != _ENGINE][0])} is not one from alloc()")
        req._data = data
        if ids.size:
            if req._pending is not None:       # the engine computed those tokens itself
                req._pending.future.cancel()
                req._pending = None
            held_tokens = req.num_cached
            table = np.concatenate([req._pages, ids])
            node, known = self._insert_pages(data, table, hold=req)     # (inserts as many pages as ids)
            # The engine's pages are the canonical ones unless the tree had some of those tokens.
            req._pages = table if known == held_tokens else self.tree.prefix_pages(node)
            req.num_cached = full * self.page_size
        return req.pages

    def release(self, request: Request | Match) -> None:
        """Drop every hold of ``request`` (a ``Request`` or a ``Match``), so its pages may be evicted
        again, and drop its pending load (SGLang's ``cache_finished_req``, after ``extend``).
        Pages the engine still has from ``alloc`` stay the engine's (``free`` or ``insert`` them).
        O(depth).  Raises ``ValueError`` for a request released twice or not made by this cache.
        """
        if not isinstance(request, (Request, Match)):
            raise TypeError(f"match must be a Match or a Request, got {type(request).__name__}")
        req = self._live.pop(request.id, None)
        if req is None:
            raise ValueError("match: already released, or not made by this cache")
        if req._pending is not None:
            req._pending.future.cancel()
            req._pending = None
        req.released = True
        self.tree._unlock(req.node)
        if self.groups is not None:
            self.groups.hold(req.node, -1)
            self._trim(req.node)

    def _held(self, req: Request) -> None:
        if not isinstance(req, Request):
            raise TypeError(f"req must be a Request, got {type(req).__name__}")
        if self._live.get(req.id) is not req:
            raise ValueError("req: already released, or not made by this cache")

    def alloc(self, num_pages: int) -> torch.Tensor:
        """Take ``num_pages`` free pages (int64 ids), evicting LRU prefixes when the pool is short.

        The engine owns them until it passes them to ``insert``/``extend`` (or ``free``).  Raises
        ``PoolExhausted`` without evicting anything when free + evictable pages are not enough
        (pages held by requests and by the engine are never taken).  Evicts only as many pages as
        are missing (rounded up to whole leaves).  Cost: O(num_pages) plus O(log n) per evicted node.
        """
        check_int(num_pages, "num_pages")
        ids = self._take_pages(num_pages)
        self._counters["allocs"] += 1
        self._counters["allocated_pages"] += num_pages
        return torch.from_numpy(ids)

    def _take_pages(self, num_pages: int) -> np.ndarray:
        """Free pages, evicting LRU prefixes when short; marked engine-held (with a page in every
        sliding group's pool)."""
        short = num_pages - self.pool.num_free
        groups_short = self.groups.short(num_pages) if self.groups is not None else 0
        if short > 0 or groups_short > 0:
            evictable = self.tree.evictable_size // self.page_size
            if short > evictable:
                raise PoolExhausted(
                    f"cannot allocate {num_pages} pages: {self.pool.num_free} free, {evictable} evictable, "
                    f"{self.tree.protected_size // self.page_size} locked by running requests, "
                    f"{int((self._state == _ENGINE).sum())} held by the engine")
            if groups_short > 0 and self.groups.unreachable(self.tree, num_pages):   # type: ignore[union-attr]
                raise PoolExhausted(
                    f"cannot allocate {num_pages} pages: a sliding group's pool is {groups_short} pages short "
                    f"and eviction cannot free as many (window_pages={self.groups.pools[0].num_pages})")  # type: ignore[union-attr]
            if short > 0:
                self.evict(short)
            while self.groups is not None and self.groups.short(num_pages) > 0:
                if not self.evict(1):    # leaf by leaf until the sliding pools have room
                    raise PoolExhausted(f"cannot allocate {num_pages} pages: a sliding group's pool is short "
                                        "and nothing more is evictable")
        ids = self.pool._take(num_pages)
        self._state[ids] = _ENGINE
        if self.groups is not None:
            self.groups.attach(ids)
        return ids

    def _free_pages(self, ids: np.ndarray) -> None:
        """Give pages (validated, not free) back to the pool, with their sliding groups' pages."""
        if ids.size:
            self.pool._give_back(ids)
            self._state[ids] = _FREE
            if self.groups is not None:
                self.groups.detach(ids)

    def free(self, pages: Any) -> None:
        """Give back pages from ``alloc`` that the engine will not insert (an aborted request, a
        finished request's partial tail page).  O(n)."""
        self._free_pages(self._engine_pages(pages, "pages"))

    def insert(self, tokens: Any, pages: Any) -> int:
        """Cache ``tokens`` with the KV in ``pages`` and take ownership of the pages.

        ``pages`` has one id per full page of ``tokens`` (plus optionally one for a partial tail
        page, which is freed): the pages of a match, then pages from ``alloc``.  Pages of tokens
        that are cached already (another request inserted them meanwhile) are freed, as is the
        tail page.  Returns how many leading tokens were already cached.  The pages are not held
        for the caller afterwards (``Request.extend`` holds them).  Raises
        ``ValueError``/``TypeError`` and changes nothing for a wrong page count, a page id out of
        range, repeated or free, or a cached page passed for a position it does not hold.
        Cost: O(d + L/page_size + log n).
        """
        data = as_token_bytes(tokens)
        ids = as_page_ids(pages, self.pool.num_pages, "pages")
        full, tail = divmod(len(data) // 4, self.page_size)
        if len(ids) not in (full, full + (tail > 0)):
            raise ValueError(f"pages: {len(data) // 4} tokens need {full} page ids"
                             f"{' (or one more for the partial tail page)' if tail else ''}, got {len(ids)}")
        if len(ids) > full and self._state[ids[-1]] != _ENGINE:
            raise ValueError("pages: the partial tail page must be one from alloc()")
        if has_duplicates(ids):
            raise ValueError("pages: the same page id is given more than once")
        return self._insert_pages(data[:full * self.page_size * 4], ids[:full], ids[full:])[1]

    def _insert_pages(self, data: bytes, ids: np.ndarray, tail: np.ndarray = _NO_PAGES,
                      hold: Request | None = None) -> tuple[RadixNode, int]:
        """Insert whole pages ``ids`` for the first ``len(ids)`` pages of ``data``, freeing
        duplicates and ``tail``; return the node that ends the sequence and how many tokens were
        cached already.  ``hold``: the request whose hold moves to that node (before the window
        rule runs, so the window it needs stays); its held pages lead ``ids`` and the rest are
        checked engine pages, so there is nothing to validate.  Otherwise validates before
        changing anything."""
        cached: list[np.ndarray] = []
        mine: slice | np.ndarray                 # of the first `known` pages, those that are not the tree's
        if hold is not None:
            collect = None if self.groups is None and self.stack is None else (
                lambda _, path_pages: cached.extend(path_pages))
            result = self.tree._insert(data, ids, collect)
            known = result.prefix_len // self.page_size
            mine = slice(len(hold._pages), known)     # the held pages lead ids and are the tree's
        else:
            state = self._state[ids]
            if (state == _FREE).any():
                raise ValueError(f"pages: page {int(ids[state == _FREE][0])} is free; pass pages from "
                                 "alloc() or a match")
            in_tree = state == _TREE

            def validate(prefix_bytes: int, path_pages: list[np.ndarray]) -> None:
                known = prefix_bytes // (4 * self.page_size)
                if in_tree[known:].any():
                    raise ValueError("pages: a cached page is passed for tokens it does not hold")
                cached.extend(path_pages)
                if known and in_tree[:known].any() and \
                        (in_tree[:known] & (ids[:known] != np.concatenate(path_pages))).any():
                    raise ValueError("pages: a cached page is passed for tokens it does not hold")

            result = self.tree._insert(data, ids, validate)
            known = result.prefix_len // self.page_size
            mine = ~in_tree[:known]
        if self.groups is not None and known:       # the engine's pages fill the tree's tombstones
            self.groups.fill(np.concatenate(cached)[:known][mine], ids[:known][mine])
        duplicates = ids[:known][mine] if hold is None or known > len(hold._pages) else _NO_PAGES
        if tail.size:
            duplicates = np.concatenate([duplicates, tail])
        if duplicates.size:
            self._free_pages(duplicates)
        self._state[ids[known:]] = _TREE
        c = self._counters
        c["inserts"] += 1
        c["inserted_tokens"] += (len(ids) - known) * self.page_size
        c["duplicate_pages"] += int(duplicates.size)
        # Stored before the window rule runs: a sliding group's chunks are stored whole, as full
        # attention's are (the pages the rule drops later went to the tiers here or go in _trim).
        if self.stack is not None and self.write_policy == "write_through" and self._kept_tiers:
            first = result.prefix_len // self.chunk_size             # chunks not complete before
            last = len(ids) * self.page_size // self.chunk_size
            if first < last:
                self._store_chunks(data, np.concatenate([*cached, ids[known:]]), first, last, self._kept_tiers)
        if hold is not None:
            self._move_hold(hold, result.node)
        self._trim(result.node)
        return result.node, result.prefix_len

    def _store_chunks(self, data: bytes, pages: np.ndarray, first: int, last: int,
                      tiers: frozenset[int] | None = None, refs: list[list[ChunkRef]] | None = None,
                      wait: float = 0.0, group: int | None = None) -> None:
        """Copy chunks ``first..last-1`` of a cached sequence out of the pool and queue them for
        the tiers (all, or ``tiers``; the copy is synchronous: the pages may be reused right after),
        per KV group (only ``layout.groups[group]``'s, when given): a sliding group's chunk only
        where its pages are held, and for every group but the one given, the sliding groups' chunks
        of the window before ``first`` too (pages an insert filled, a new branch point's).
        ``refs``: the sequence's chunk refs from chunk 0 per stack, when the caller has them."""
        per_chunk = self.chunk_size // self.page_size
        for g, stack in enumerate(self.stacks):
            if group is not None and g != group:
                continue
            pool: KVPool = self.pool               # type: ignore[assignment]
            ids, lo = pages[:last * per_chunk], first
            if self.groups is not None:
                kind = self.layout.groups[g]
                pool, ids = self.groups.pool_of(kind), self.groups.pages_of(kind, ids)
                if kind.sliding and group is None:
                    lo = max(0, first - (kind.window - 1 + self.chunk_size - 1) // self.chunk_size)
            stack_refs = refs[g] if refs is not None else stack.refs_from_bytes(data[:last * self.chunk_size * 4])
            items = []
            for i, ref in enumerate(stack_refs[lo:last], start=lo):
                chunk_ids = ids[i * per_chunk:(i + 1) * per_chunk]
                if chunk_ids.size and chunk_ids.min() < 0:
                    continue                       # dropped: outside every window
                buf = torch.empty(stack.shape, dtype=self.layout.dtype)
                items.append((ref, ops.gather_pages(pool, chunk_ids, buf)))
            queued = stack.store(items, tiers=tiers, wait=wait, chain=True)
            self._counters["chunks_stored"] += queued
            self._counters["chunks_not_queued"] += len(items) - queued

    def _refs(self, data: bytes) -> list[list[ChunkRef]]:
        """The chunk refs of ``data`` in every stack (one hash pass per KV group)."""
        return [stack.refs_from_bytes(data) for stack in self.stacks]

    def _chunks_ending_in(self, node: RadixNode) -> tuple[bytes, int, int]:
        """The tokens from the root to the end of ``node`` (int32 bytes) and the range
        ``first..last-1`` of the chunks that end inside ``node``.  O(depth + tokens)."""
        tokens = self.tree.prefix_tokens(node)
        start = len(tokens) - node.num_tokens
        return tokens.tobytes(), start // self.chunk_size, len(tokens) // self.chunk_size

    def _spill(self, node: RadixNode) -> None:
        """The tiers keep what the pool lets go: the chunks that end inside ``node``, about to be
        evicted, are stored where they are not kept already (``write_back``: every tier; with
        victim tiers, those) — a tier that holds one counts it as just used — deepest first, after
        the prefix's tail where prefixes part inside a chunk (``_spill_tail``); under
        ``write_through`` they are refreshed in the other local tiers' LRU order (``TierStack.touch``)."""
        assert self.stack is not None
        data, first, last = self._chunks_ending_in(node)
        into = None if self.write_policy == "write_back" else self.stack.victims
        with_tail = self.groups is None and node.branched and (into is None or bool(into))
        if first >= last and not with_tail:
            return
        refs = self._refs(data[:last * self.chunk_size * 4])    # one hash pass for all
        if with_tail:
            self._spill_tail(node, data, refs[0], into)
        if first >= last:
            return
        if into is None or into:     # these chunks exist nowhere else: wait (bounded) for queue room
            self._store_chunks(data, self.tree.prefix_pages(node), first, last, into, refs, wait=SPILL_WAIT_S)
        if into is not None and len(into) < len(self.stack.tiers):
            for stack, stack_refs in zip(self.stacks, refs):
                stack.touch([ref.key for ref in stack_refs[first:]], tiers=self._kept_tiers)

    def _spill_tail(self, node: RadixNode, data: bytes, refs: list[ChunkRef], into: frozenset[int] | None) -> None:
        """Store the tail of ``node``'s prefix (``data``): its tokens past the last chunk boundary,
        if any, into the local tiers among ``into`` (``None``: every tier), before the chunks (it is
        the deepest).  Only for a node that other cached sequences continued (``branched``): where
        prefixes part, the next request is likely to stop too — a request's own end would only take
        a slot.  ``refs``: the prefix's full chunks."""
        assert self.stack is not None
        cs, ps = self.chunk_size, self.page_size
        start, end = len(refs) * cs, len(data) // 4
        stack = self.stack
        tiers = [i for i in (range(len(stack.tiers)) if into is None else into) if stack.tiers[i].local]
        if end == start or not tiers:
            return
        ref = stack.tail_ref(refs[-1].key if refs else stack.namespace.root, data[start * 4:])
        buf = torch.empty(self.layout.chunk_shape(end - start), dtype=self.layout.dtype)
        kv = ops.gather_pages(self.pool, self.tree.prefix_pages(node)[start // ps:], buf)
        self._counters["tails_stored"] += stack.store([(ref, kv)], tiers=tiers, wait=SPILL_WAIT_S, chain=True)

    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked prefixes until ``num_pages`` pages are freed (or
        nothing more is evictable); return how many were freed.  With tiers, the evicted chunks are
        stored (``write_back``) or refreshed in the tiers' LRU order (``write_through``): the tiers
        keep what the pool lets go.  O(log n) per evicted node, plus a hash pass over each evicted
        node's prefix with tiers."""
        parents: list[RadixNode] = []
        on_evict = None if self.stack is None and self.groups is None else (
            lambda node: self._on_evict(node, parents))
        freed = self.tree.evict(num_pages, on_evict)
        if freed.size:
            self._free_pages(freed)
            self._counters["evicted_pages"] += int(freed.size)
            self._counters["evictions"] += 1
        for parent in parents:         # a parent left with one child may drop its window
            if parent.parent is not None and self.tree._attached(parent):
                self._trim(parent)
        return int(freed.size)

    def _on_evict(self, node: RadixNode, parents: list[RadixNode]) -> None:
        if self.stack is not None:
            self._spill(node)
        if self.groups is not None and node.parent is not None:
            parents.append(node.parent)

    def _trim(self, node: RadixNode) -> None:
        """The window rule after ``node`` changed (``KVGroups.trim``); nothing without groups.
        With tiers, a sliding page leaving every window is spilled like an evicted one first."""
        if self.groups is not None:
            spill = self._spill_window if self.stack is not None and self._window_into() != frozenset() else None
            self.groups.trim(self.tree, node, spill)

    def _window_into(self) -> frozenset[int] | None:
        """The tiers a page leaving the pool is stored into (``None``: all): under ``write_back``
        every tier; under ``write_through`` the victim tiers (exclusive of the pool: the others
        got the chunk at insert).  O(1)."""
        assert self.stack is not None
        return None if self.write_policy == "write_back" else self.stack.victims

    def _spill_window(self, i: int, reuse: RadixNode, lo: int, hi: int) -> None:
        """``KVGroups.trim``'s spill: sliding group ``i``'s pages at positions ``lo..hi-1`` on the
        path to ``reuse`` leave every window; store the whole chunks that hold them (where all
        their pages are still there) into the tiers an eviction writes.  A hash pass over the
        prefix and one gather per chunk."""
        assert self.groups is not None
        per_chunk = self.chunk_size // self.page_size
        pages = self.tree.prefix_pages(reuse)
        first, last = lo // per_chunk, min(-(-hi // per_chunk), len(pages) // per_chunk)
        if first >= last:
            return
        data = self.tree.prefix_tokens(reuse).tobytes()
        group = self.layout.groups.index(self.groups.sliding[i])
        self._store_chunks(data, pages, first, last, self._window_into(), wait=SPILL_WAIT_S, group=group)

    def _move_hold(self, req: Request, node: RadixNode) -> None:
        """Move ``req``'s hold (lock and, with groups, its end) to ``node``."""
        self.tree._move_lock(req.node, node)
        if self.groups is not None:
            self.groups.hold(node, 1)
            self.groups.hold(req.node, -1)
            old, req.node = req.node, node
            self._trim(old)
        else:
            req.node = node

    # ---------------------------------------------------------------- inspection

    def _all_engine(self, ids: np.ndarray) -> bool:
        """Whether every page of ``ids`` is the engine's (from ``alloc``).  O(n), in C."""
        states = self._state[ids].tolist()       # list.count beats numpy's != and any() here
        return states.count(_ENGINE) == len(states)

    def _engine_pages(self, pages: Any, name: str) -> np.ndarray:
        ids = as_page_ids(pages, self.pool.num_pages, name)
        if has_duplicates(ids):
            raise ValueError(f"{name}: the same page id is given more than once")
        if not self._all_engine(ids):
            raise ValueError(f"{name}: page {int(ids[self._state[ids] != _ENGINE][0])} is not held by the engine")
        return ids

    def stats(self) -> CacheStats:
        """Counters and occupancy: matches, query and hit tokens (from the pool and from the tiers),
        hit rate, pages free / cached / held by the engine, evictions, chunks stored; ``levels``, one
        dict per level (the pool, then each tier: lookups, hit tokens, bytes in and out, evictions,
        corrupt entries found, faults, victim-cache refreshes and refresh misses, chunks released
        after moving up, dropped writes); and ``stack``, the ``TierStack``'s own
        counters.  O(num_pages) (counts the page states) plus one ``stats()`` call per tier."""
        c = CacheStats(self._counters)
        counts = np.bincount(self._state, minlength=3)
        c.update(
            hit_rate=c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0,
            pages_free=int(counts[_FREE]), pages_cached=int(counts[_TREE]),
            pages_engine=int(counts[_ENGINE]), pages_total=self.pool.num_pages,
            nodes=self.tree.num_nodes, live_matches=len(self._live) - len(self._pins), pins=len(self._pins),
            cached_tokens=self.tree.total_size, locked_tokens=self.tree.protected_size)
        if self.groups is not None:
            c["window_pages_held"] = self.groups.held_pages()        # per sliding group, tree and engine
            c["window_pages_dropped"] = self.groups.dropped_pages
        levels = [{"level": "pool", "hit_tokens": c["pool_hit_tokens"], "evicted_pages": c["evicted_pages"],
                   "bytes_in": c["tier_hit_tokens"] * self.layout.token_bytes}]
        if self.stack is not None:
            st = self.stack.stats()
            c["stack"] = st
            c["tier_hit_tokens_by_tier"] = list(self._tier_hit_tokens)     # in stack order
            for i, (tier, own) in enumerate(zip(self.stack.tiers, self.stack.tier_stats())):
                levels.append({
                    "level": tier.name, "lookups": st["tier_lookups"][i], "hit_tokens": self._tier_hit_tokens[i],
                    "bytes_in": st["tier_bytes_stored"][i], "bytes_out": st["tier_bytes_loaded"][i],
                    "evictions": int(own.get("evictions", 0)), "corrupt": st["corrupt"][i],
                    "forged": st["forged"][i], "errors": st["errors"][i], "timeouts": st["timeouts"][i],
                    "refreshed": st["refreshed"][i], "refresh_misses": st["refresh_misses"][i],
                    "released": st["released"][i], "dropped_writes": st["dropped_writes"]})
        c["levels"] = levels
        return c

    def pin(self, tokens: Any) -> int:
        """Keep the cached prefix of ``tokens`` (a system prompt, say) from eviction until
        ``unpin``: what the pool holds of it (loading what the tiers hold) stays held like a running
        request's pages, and its chunks are pinned in every local tier that holds them or stores
        them later (``Tier.pin``; each tier bounds its own pins).  Returns the tokens held in the
        pool.  Pinned pool tokens are bounded by ``pin_budget`` (half the pool): a pin past it
        raises ``ValueError`` and changes nothing.  Pinning the same tokens again returns the held
        count.  Pins do not count as requests in ``stats()``.  Cost: as ``open`` plus a hash pass.
        """
        data = as_token_bytes(tokens)
        if data in self._pins:
            return self._pins[data].num_cached
        req = self._open(data, len(data), "wait", self._deadline(None), count=False)
        if req.pending:
            self.wait(req)
        held = sum(p.num_cached for p in self._pins.values())
        if held + req.num_cached > self.pin_budget:
            self.release(req)
            raise ValueError(f"tokens: pinning {req.num_cached} more tokens would hold {held + req.num_cached} "
                             f"in the pool, over pin_budget={self.pin_budget}")
        self._pins[data] = req
        for stack in self.stacks:
            stack.pin(keys_from_token_bytes(data, self.chunk_size, stack.namespace.root))
        return req.num_cached

    @property
    def pins(self) -> Mapping[bytes, Request]:
        """The pinned prefixes (int32 token bytes) and the requests that hold them (read-only)."""
        return MappingProxyType(self._pins)

    def unpin(self, tokens: Any) -> bool:
        """Undo ``pin(tokens)`` (in the pool and in the tiers); whether ``tokens`` were pinned.
        O(depth) plus a hash pass."""
        data = as_token_bytes(tokens)
        req = self._pins.pop(data, None)
        if req is None:
            return False
        self.release(req)
        for stack in self.stacks:
            stack.unpin(keys_from_token_bytes(data, self.chunk_size, stack.namespace.root))
        return True

    def drop_namespace(self, namespace: Namespace | None = None) -> int:
        """Delete every stored chunk of ``namespace`` (default: this cache's) from every tier, e.g.
        an old model revision's.  Entries resident in the pool are not affected.  Returns the
        number of entries deleted.  Cost: one namespace scan or listing per tier."""
        if self.stack is None:
            return 0
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if namespace is None:
            return sum(stack.drop_namespace(None) for stack in self.stacks)
        return self.stack.drop_namespace(namespace.id)

    def check(self) -> None:
        """Assert every invariant of the cache, its tree and its pool (O(n + num_pages)).

        Each page is free, cached or engine-held, never two of these; the pool's free list is
        exactly the free pages; the tree holds exactly the cached pages; every node's lock_ref
        equals the number of live matches at or below it.
        """
        self.pool.check()
        self.tree.check()
        if self.groups is not None:
            self.groups.check(self.tree, np.flatnonzero(self._state != _FREE),
                              [(req.node, req._pages) for req in self._live.values()])
        for stack in self.stacks:
            stack.check()
        state = self._state
        assert np.array_equal(self.pool._is_free, state == _FREE), "pool free list != pages marked free"
        tree_pages = np.sort(self.tree.all_pages())
        assert np.array_equal(tree_pages, np.flatnonzero(state == _TREE)), "tree pages != pages marked cached"
        expected: dict[int, int] = {}
        for req in self._live.values():
            assert not req.released, f"{req!r}: released but still live"
            assert len(req._pages) * self.page_size == req.num_cached, \
                f"{req!r}: {len(req._pages)} held pages for {req.num_cached} tokens"
            assert req.num_cached <= req.num_tokens, f"{req!r}: holds more tokens than it has"
            held = self.tree.prefix_pages(req.node)
            assert np.array_equal(held, req._pages), f"{req!r}: held pages {req._pages} != the tree's {held}"
            assert np.array_equal(self.tree.prefix_tokens(req.node).view(np.uint8),
                                  np.frombuffer(req._data[:req.num_cached * 4], dtype=np.uint8)), \
                f"{req!r}: the tree holds other tokens than the request's"
            assert (state[req._pages] == _TREE).all(), f"{req!r}: a held page is not in the tree"
            node = req.node
            while node.parent is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
            assert node is self.tree.root, f"{req!r}: its held node is not in the tree any more"
        for node in self.tree.nodes():
            assert node.lock_ref == expected.get(id(node), 0), \
                f"{node!r}: lock_ref {node.lock_ref} but {expected.get(id(node), 0)} live requests hold it"


def _log_load_error(exc: BaseException, _last: list[float] = [0.0]) -> None:
    """Log a failed tier load once per minute (it is a miss)."""
    now = time.monotonic()
    if now - _last[0] >= 60.0:
        _last[0] = now
        log.warning("radixkv: a tier load failed and was treated as a miss: %s: %s", type(exc).__name__, exc)
