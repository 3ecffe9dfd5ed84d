"""``PrefixCache``: the engine-facing cache that keeps the radix tree and the page pool consistent.

The protocol of a paged engine (every call validates its arguments and leaves the cache as it was
when it raises; ``radixkv.core.request`` has the per-request state and the load behaviours):

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

With ``tiers`` (a ``TierStack`` per KV group over the same backends) the two directions of data
have modules of their own: ``radixkv.core.loads`` (tiers -> pool: ``open`` continues the pool's match
from the first chunk the tree does not fully cover; a worker looks the chunks up and loads them by
a deadline; ``poll``/``wait`` land them into new pages and the tree) and ``radixkv.core.stores`` (pool
-> tiers: ``write_through`` stores every chunk an insert completes in the tiers that keep copies;
an eviction stores what the pool lets go where it is not kept already; ``exclusive``, the default,
makes the local volatile tiers hold only what the pool evicted).  Writes are queued, never waited
for, and take no lock on the tree.  What happens at each level is told to ``observers``
(``radixkv.core.observe``).

A ``PrefixCache`` is used from one engine thread; the tier stack does its writes on its own thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np
import torch

from radixkv.core._checks import check_int
from radixkv.core._exit import flush_at_exit
from radixkv.core.hashing import Namespace, as_token_bytes, keys_from_token_bytes
from radixkv.core.observe import Observers
from radixkv.core.groups import KVGroups
from radixkv.core.pool import KVLayout, KVPool, PagePool, PoolExhausted, as_page_ids, check_device, has_duplicates
from radixkv.core.loads import Loads
from radixkv.core.request import LOAD_MODES, Request
from radixkv.core.stores import Stores
from radixkv.core.tree import MatchResult, RadixNode, RadixTree

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixkv.core.tier import Tier
    from radixkv.core.stack import ChunkRef, TierStack

__all__ = ["Match", "PoolExhausted", "PrefixCache", "Request"]

log = logging.getLogger("radixkv.core.cache")

_FREE, _ENGINE, _TREE = 0, 1, 2
_NO_PAGES = np.empty(0, dtype=np.int64)


class CacheStats(dict):  # type: ignore[type-arg]
    """``PrefixCache.stats()``: a plain dict of counters that Jupyter shows as tables."""

    def _repr_html_(self) -> str:
        from radixkv.tools.viz import stats_html

        return stats_html(self)


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


class _Host:
    """What a cache does for the objects it hands work to: the verbs an engine calls on a
    ``Request`` (``radixkv.core.request.RequestHost``) and the pool and tree bookkeeping a tier load
    needs (``radixkv.core.loads.LoadHost``).  Nothing else reaches into the cache."""

    __slots__ = ("_cache",)

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache

    def poll(self, req: Request) -> bool:
        return self._cache._poll(req)

    def wait(self, req: Request, timeout: float | None) -> bool:
        return self._cache._wait(req, timeout)

    def extend(self, req: Request, tokens: Any, pages: Any) -> torch.Tensor:
        return self._cache._extend(req, tokens, pages)

    def release(self, req: Request) -> None:
        if not isinstance(req, Request):
            raise TypeError(f"req must be a Request, got {type(req).__name__}")
        self._cache._release(req)

    def take_pages(self, num_pages: int) -> np.ndarray:
        return self._cache._take_pages(num_pages)

    def free_pages(self, ids: np.ndarray) -> None:
        self._cache._free_pages(ids)

    def cached(self, ids: np.ndarray, data: bytes, start: int) -> None:
        self._cache._cached(ids, data, start)

    def move_hold(self, req: Request, node: RadixNode) -> None:
        self._cache._move_hold(req, node)

    def approximate(self, req: Request, ids: np.ndarray) -> None:
        self._cache._approximate(req, ids)

    def usable_match(self, data: bytes, size: int) -> MatchResult:
        return self._cache._usable_match(data, size)

    def trim(self, node: RadixNode) -> None:
        self._cache._trim(node)


class PrefixCache:
    """Prefix cache over a paged KV pool.  See the module docstring for the protocol.

    ``tiers`` (fastest first, or a ready ``TierStack``) go below the pool; ``promote`` copies lower-tier
    hits into the tiers above; ``write_queue_bytes`` (default 1 GiB) bounds the KV waiting to be
    written, ``write_queue`` (default: no bound) the number of chunks (a chunk that does not fit is
    dropped and counted: with ``write_back``, one eviction may spill many chunks at once, so give
    it room).

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
                 write_queue: int | None = None, load_timeout: float = 5.0, load_workers: int = 4,
                 exclusive: bool = True, window_pages: int | None = None, write_queue_bytes: int = 1 << 30,
                 codecs: Sequence[Any] | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if check_int(chunk_size, "chunk_size", 1) % layout.page_size:
            raise ValueError(f"chunk_size must be a positive multiple of page_size={layout.page_size}, "
                             f"got {chunk_size!r}")
        if write_policy not in ("write_through", "write_back"):
            raise ValueError(f"write_policy must be 'write_through' or 'write_back', got {write_policy!r}")
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if write_queue is not None:
            check_int(write_queue, "write_queue", 1)
        check_int(write_queue_bytes, "write_queue_bytes", 1)
        check_int(load_workers, "load_workers", 1)
        if isinstance(load_timeout, bool) or not isinstance(load_timeout, (int, float)) or not load_timeout >= 0:
            raise ValueError(f"load_timeout must be a number of seconds >= 0, got {load_timeout!r}")
        self.layout = layout
        self.load_timeout = float(load_timeout)
        self.load_workers = load_workers
        self.page_size = layout.page_size
        self.chunk_size = chunk_size
        self.write_policy = write_policy
        self.namespace = (namespace or Namespace(model="unnamed")).bind(layout)
        self.device = check_device(device)
        #: The KV groups of a layout with sliding-window layers (``radixkv.core.groups``), else ``None``.
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
        # Pages whose KV a lossy codec approximated (a load from a coded tier): never stored down as
        # exact, and a request that reuses one is counted in ``requests_approximate``.
        self._approx = np.zeros(num_pages, dtype=bool)
        self._num_approx = 0
        self._live: dict[int, Request] = {}
        self._host = _Host(self)             # what each Request and the loads call back
        self._pins: dict[bytes, Request] = {}       # pinned token prefixes, held like requests
        #: The most tokens ``pin`` may hold in the pool (half of it).
        self.pin_budget = num_pages * layout.page_size // 2
        #: The listeners of this cache's events (``radixkv.core.observe``): the pool's here, the tiers'
        #: through the stacks, which share the list.
        self.observers = Observers()
        self._counters = dict.fromkeys(
            ("matches", "query_tokens", "hit_tokens", "pool_hit_tokens", "tier_hit_tokens", "inserts",
             "inserted_tokens", "duplicate_pages", "allocs", "allocated_pages", "evicted_pages", "evictions",
             "chunks_stored", "chunks_not_queued", "tails_stored", "late_loads", "load_errors",
             "requests_approximate", "approximate_not_stored"), 0)
        #: One ``TierStack`` per KV group over the same tiers (``layout.groups`` order; each group's
        #: chunks have keys of their own namespace); ``stack`` is the first (the only one without groups).
        self.stacks: list[TierStack] = self._make_stacks(tiers, namespace, promote, write_queue, write_queue_bytes,
                                                         exclusive, codecs)
        self.stack = self.stacks[0] if self.stacks else None
        #: The way down (pool -> tiers, ``radixkv.core.stores``); ``None`` without tiers.
        self._stores: Stores | None = None
        if self.stack is not None:
            self._stores = Stores(tree=self.tree, pool=self.pool, groups=self.groups, stacks=self.stacks,
                                  layout=layout, chunk_size=chunk_size, write_policy=write_policy,
                                  counters=self._counters, approximate=self._approx)
            for stack in self.stacks:
                flush_at_exit(stack)
                for listener in stack.observers:       # what listened to the stack goes on listening
                    self.observers.add(listener)
                stack.observers = self.observers       # one list hears the pool and the tiers
            # Blobs of several sizes (tails; with groups, each group's chunks): tell fixed-slot tiers
            # the largest before a smaller one comes first and sizes their slots.
            from radixkv.core.format import encoded_size

            for i, tier in enumerate(self.stack.tiers):
                tier.expect(max(encoded_size(st.shape, layout.dtype, st.seals[i]) for st in self.stacks))
            if self.groups is not None:
                # The tiers hold whole chunks: keep a chunk more of each window, and match only
                # where each sliding group holds the chunk a match ends in (``use_chunks``).
                self.groups.use_chunks(chunk_size)
        self._tier_hit_tokens = [0] * (len(self.stack.tiers) if self.stack else 0)
        #: The way up (tiers -> pool, ``radixkv.core.loads``); ``None`` without tiers.
        self._loads: Loads | None = None
        if self.stack is not None:
            self._loads = Loads(tree=self.tree, pool=self.pool, groups=self.groups, stacks=self.stacks,
                                layout=layout, chunk_size=chunk_size, load_workers=load_workers,
                                counters=self._counters, tier_hits=self._tier_hit_tokens, host=self._host)

    def _make_stacks(self, tiers: Any, namespace: Namespace | None, promote: bool, write_queue: int | None,
                     write_queue_bytes: int, exclusive: bool, codecs: Sequence[Any] | None) -> list[TierStack]:
        from radixkv.core.stack import TierStack   # here, so that a cache without tiers needs no backend

        if isinstance(tiers, TierStack):
            if self.groups is not None:
                raise ValueError("tiers: a layout with sliding-window layers needs a stack per KV group; "
                                 "pass the tiers themselves")
            if (tiers.namespace, tiers.layout, tiers.chunk_size) != (self.namespace, self.layout, self.chunk_size):
                raise ValueError("tiers: the TierStack's namespace, layout or chunk_size differ from the cache's")
            if codecs is not None:
                raise ValueError("codecs: give them to the TierStack passed as tiers")
            return [tiers]
        tiers = list(tiers)
        if not tiers:
            return []
        if self.groups is None:
            return [TierStack(tiers, namespace=self.namespace, layout=self.layout, chunk_size=self.chunk_size,
                              promote=promote, queue_size=write_queue, queue_bytes=write_queue_bytes,
                              exclusive=exclusive, codecs=codecs)]
        base = namespace or Namespace(model="unnamed")
        return [TierStack(tiers, namespace=base.bind(self.layout, group), layout=self.layout.group_layout(group),
                          chunk_size=self.chunk_size, promote=promote, queue_size=write_queue,
                          queue_bytes=write_queue_bytes, exclusive=exclusive, codecs=codecs)
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
        if self._loads is not None:
            self._loads.close()
        for stack in self.stacks:
            stack.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """Jupyter's rich display: occupancy, levels and the tree (``radixkv.tools.viz.cache_html``)."""
        from radixkv.tools.viz import cache_html

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
        self.tree.lock(result.node, trusted=True)
        if self.groups is not None:
            self.groups.hold(result.node, 1)
        req = Request(self._host, data, usable, result.node, result.pages, result.num_tokens)
        if self._num_approx and self._approx[result.pages].any():
            req.approximate = True
            if count:
                self._counters["requests_approximate"] += 1
        self._live[req.id] = req
        if count:
            c = self._counters
            c["matches"] += 1
            c["query_tokens"] += len(data) // 4
            c["hit_tokens"] += result.num_tokens
            c["pool_hit_tokens"] += result.num_tokens
        if load != "none" and self._loads is not None:
            self._loads.start(req, deadline)
            if req._pending is not None:      # the load reports the request when it resolves
                if load == "wait":
                    self._wait(req)
                return req
        if count and self.observers:
            self._served(req)
        return req

    def _served(self, req: Request) -> None:
        """Tell the listeners what ``req`` found cached, per level (once its load resolved)."""
        by_level = {"pool": req.num_cached - req.tier_tokens}
        if self.stack is not None:
            by_level.update((t.name, n) for t, n in zip(self.stack.tiers, req.tier_tokens_by_tier) if n)
        self.observers.served(len(req._data) // 4, {k: v for k, v in by_level.items() if v})

    def _usable_match(self, data: bytes, size: int) -> MatchResult:
        """The tree's match of ``data[:size]``, cut (with groups) to the longest prefix whose every
        sliding group holds its window (``KVGroups.usable``)."""
        if self.groups is None:
            return self.tree.match_bytes(data, size)
        node, pos, path, cut = self.tree.walk(data, size - size % (4 * self.page_size))
        parts = [n.pages for n in path] + ([cut[0].pages[:cut[1]]] if cut is not None else [])
        pages = np.concatenate(parts) if parts else _NO_PAGES
        return self.tree.match_bytes(data[:self.groups.usable(pages) * self.page_size * 4])

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
        start = self.tree.match_bytes(data).num_tokens // self.chunk_size
        return self.stack.prefetch(tokens, start)

    def _deadline(self, deadline_s: float | None) -> float:
        if deadline_s is None:
            deadline_s = self.load_timeout
        elif isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s >= 0:
            raise ValueError(f"deadline_s must be a number of seconds >= 0, got {deadline_s!r}")
        return time.monotonic() + deadline_s

    def _poll(self, req: Request) -> bool:
        """``Request.poll``: its chunks go into new pool pages and the tree, and ``req.num_cached`` /
        ``req.pages`` grow; past the deadline the load is dropped (a miss)."""
        self._held(req)
        pending = req._pending
        if pending is None:
            return True
        if pending.future.done():
            req._pending = None
            self._loads.resolve(req, pending)   # type: ignore[union-attr]
        elif time.monotonic() < pending.deadline:
            return False
        else:
            req._pending = None
            pending.future.cancel()
            self._counters["late_loads"] += 1
        if self.observers:
            self._served(req)
        return True

    def _wait(self, req: Request, timeout: float | None = None) -> bool:
        """``Request.wait`` (its contract and cost)."""
        self._held(req)
        pending = req._pending
        if pending is not None:
            limit = pending.remaining() if timeout is None else min(timeout, pending.remaining())
            futures_wait([pending.future], timeout=limit)
        return self._poll(req)

    def _extend(self, req: Request, tokens: Any, pages: Any) -> torch.Tensor:
        """``Request.extend`` (its contract and cost)."""
        self._held(req)
        data, upto = req._grow_or_prefix(tokens)
        ids = as_page_ids(pages, self.pool.num_pages, "pages")
        full = upto // self.page_size
        held = len(req._pages)
        if len(ids) != full - held:
            raise ValueError(f"pages: {upto} tokens have {full} full pages, {held} of them held "
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

    def release(self, match: Match) -> None:
        """Drop the hold of ``match`` (from ``match``), so its pages may be evicted again.  Pages
        the engine still has from ``alloc`` stay the engine's (``free`` or ``insert`` them).  A
        ``Request`` (from ``open``) is released with ``req.release()``.  O(depth).  Raises
        ``ValueError`` for a match released twice or not made by this cache, ``TypeError`` for
        anything but a ``Match``."""
        if isinstance(match, Request):
            raise TypeError("match: a Request is released with its own release() (req.release())")
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match, got {type(match).__name__}")
        self._release(match)

    def _release(self, request: Request | Match) -> None:
        """``Request.release`` and ``release``: drop every hold and the pending load."""
        req = self._live.pop(request.id, None)
        if req is None:
            raise ValueError("match: already released, or not made by this cache")
        if req._pending is not None:
            req._pending.future.cancel()
            req._pending = None
        req.released = True
        self.tree.unlock(req.node, trusted=True)
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

    def _cached(self, ids: np.ndarray, data: bytes, start: int) -> None:
        """Engine pages ``ids`` are the tree's now, inserted for the tokens of ``data`` from token
        ``start`` on (a load landed), with their events."""
        self._state[ids] = _TREE
        if self.observers:
            self._heard_pages(data, start, start + int(ids.size) * self.page_size, int(ids.size))

    def _heard_pages(self, data: bytes, start: int, stop: int, held: int) -> None:
        """Tell the listeners the pool holds ``held`` more pages: tokens ``start..stop-1`` of ``data``
        (``held < 0``: let ``-held`` go)."""
        self.observers.pages("pool", max(held, 0), max(-held, 0))
        if self.observers.wants("span"):
            self.observers.span("pool", data, start, stop, held > 0)

    def _approximate(self, req: Request, ids: np.ndarray) -> None:
        """Pages ``ids`` (just filled for ``req`` by a load) hold KV a lossy codec approximated:
        marked, and ``req`` counted once in ``requests_approximate``."""
        fresh = ids[~self._approx[ids]]
        self._approx[fresh] = True
        self._num_approx += int(fresh.size)
        if not req.approximate:
            req.approximate = True
            self._counters["requests_approximate"] += 1

    def _free_pages(self, ids: np.ndarray) -> None:
        """Give pages (validated, not free) back to the pool, with their sliding groups' pages."""
        if ids.size:
            self.pool._give_back(ids)
            self._state[ids] = _FREE
            if self._num_approx:
                self._num_approx -= int(np.count_nonzero(self._approx[ids]))
                self._approx[ids] = False
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
            result = self.tree.insert_bytes(data, ids, collect)
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

            result = self.tree.insert_bytes(data, ids, validate)
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
        if self.observers and len(ids) > known:
            self._heard_pages(data, known * self.page_size, len(ids) * self.page_size, len(ids) - known)
        c = self._counters
        c["inserts"] += 1
        c["inserted_tokens"] += (len(ids) - known) * self.page_size
        c["duplicate_pages"] += int(duplicates.size)
        # Stored before the window rule runs: a sliding group's chunks are stored whole, as full
        # attention's are (the pages the rule drops later went to the tiers here or go in _trim).
        if self._stores is not None:
            first = result.prefix_len // self.chunk_size             # chunks not complete before
            last = len(ids) * self.page_size // self.chunk_size
            if first < last:
                self._stores.inserted(data, np.concatenate([*cached, ids[known:]]), first, last)
        if hold is not None:
            self._move_hold(hold, result.node)
        self._trim(result.node)
        return result.node, result.prefix_len

    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked prefixes until ``num_pages`` pages are freed (or
        nothing more is evictable); return how many were freed.  With tiers, the evicted chunks are
        stored (``write_back``) or refreshed in the tiers' LRU order (``write_through``): the tiers
        keep what the pool lets go.  O(log n) per evicted node, plus a hash pass over each evicted
        node's prefix with tiers."""
        parents: list[RadixNode] = []
        spans = self.observers.wants("span")
        on_evict = None if self.stack is None and self.groups is None and not spans else (
            lambda node: self._on_evict(node, parents, spans))
        freed = self.tree.evict(num_pages, on_evict)
        if freed.size:
            self._free_pages(freed)
            if self.observers and not spans:
                self.observers.pages("pool", 0, int(freed.size))
            self._counters["evicted_pages"] += int(freed.size)
            self._counters["evictions"] += 1
        for parent in parents:         # a parent left with one child may drop its window
            if parent.parent is not None and self.tree.contains(parent):
                self._trim(parent)
        return int(freed.size)

    def _on_evict(self, node: RadixNode, parents: list[RadixNode], spans: bool) -> None:
        if self._stores is not None:
            self._stores.evicting(node)
        if spans:
            data = self.tree.prefix_tokens(node).tobytes()
            stop = len(data) // 4
            self._heard_pages(data, stop - node.num_tokens, stop, -(node.num_tokens // self.page_size))
        if self.groups is not None and node.parent is not None:
            parents.append(node.parent)

    def _trim(self, node: RadixNode) -> None:
        """The window rule after ``node`` changed (``KVGroups.trim``); nothing without groups.
        With tiers, a sliding page leaving every window is spilled like an evicted one first."""
        if self.groups is not None:
            spill = self._stores.leaving_window if self._stores is not None and self._stores.spills_windows else None
            before = self.groups.dropped_pages
            self.groups.trim(self.tree, node, spill)
            if self.observers and self.groups.dropped_pages > before:
                self.observers.pages("pool:sliding", 0, self.groups.dropped_pages - before)

    def _move_hold(self, req: Request, node: RadixNode) -> None:
        """Move ``req``'s hold (lock and, with groups, its end) to ``node``."""
        self.tree.move_lock(req.node, node)
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
            self._wait(req)
        held = sum(p.num_cached for p in self._pins.values())
        if held + req.num_cached > self.pin_budget:
            self._release(req)
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
        self._release(req)
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
        assert not self._approx[state == _FREE].any(), "a free page marked approximate"
        assert self._num_approx == int(np.count_nonzero(self._approx)), "approximate page count off"
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

