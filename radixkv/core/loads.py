"""The way up, tiers -> pool: a request's chunks found below the pool, fetched and landed.

``Loads`` is made by a ``PrefixCache`` that has tiers, and does the tier half of ``open``:

* **start** (``start``, on the engine's thread): the chunks past the request's pool match, up to
  what the pool has room for, are handed to a load worker (``radixkv.core.request.fetch_chunks``;
  with KV groups ``radixkv.core.groups.fetch_group_chunks``, which also finds each sliding group's
  window chunks), which looks them up and loads them by the request's deadline; without groups a
  *tail* (the request's pages past its last whole chunk, stored where cached prefixes part) may
  follow the chunks.  The request's ``_pending`` holds the future.
* **land** (``resolve``, on the engine's thread, from ``PrefixCache.poll``/``wait``): the chunks
  that arrived go into new pool pages and the tree — only what the tree still lacks (another
  request may have cached some meanwhile), only what the pool has room for — and the request's
  hold moves to the end of them; with groups the sliding groups' window chunks fill their pages
  and the hold moves to the longest usable prefix.  What the tiers served is counted per tier.
  A fault or a late load is a miss, never an exception.  Chunks that came from an exclusive
  (victim) tier are released there: moved up, not copied.

A landing changes the pool and the tree only through what the cache hands over at construction
(``take_pages``, ``free_pages``, ``cached``, ``move_hold``, ``usable_match``, ``trim``): this
module knows the tree's and the pools' public calls, and not the cache.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from radixkv.core import ops
from radixkv.core.groups import GroupLoad, fetch_group_chunks
from radixkv.core.pool import PoolExhausted
from radixkv.core.request import PendingLoad, Request, fetch_chunks

if TYPE_CHECKING:
    from radixkv.core.groups import KVGroups
    from radixkv.core.pool import KVLayout, KVPool
    from radixkv.core.stack import ChunkRef, TierStack
    from radixkv.core.tree import MatchResult, RadixNode, RadixTree

__all__ = ["LoadHost", "Loads"]


class LoadHost(Protocol):
    """What a load asks of the cache it lands in: pages, and the bookkeeping of the tree and the
    pool that the cache alone does.  ``PrefixCache`` implements it privately; every call runs on
    the engine's thread."""

    def take_pages(self, num_pages: int) -> np.ndarray:
        """Free pages for the chunks that arrived, evicting LRU prefixes if needed (``PoolExhausted``
        when the pool cannot give them)."""
        ...

    def free_pages(self, ids: np.ndarray) -> None:
        """Give back pages taken for chunks that were not inserted."""
        ...

    def cached(self, ids: np.ndarray, data: bytes, start: int) -> None:
        """Mark ``ids`` as the tree's (they now hold ``data``'s tokens from ``start`` on)."""
        ...

    def move_hold(self, req: Request, node: RadixNode) -> None:
        """Move ``req``'s hold down to ``node``, the new end of its prefix."""
        ...

    def usable_match(self, data: bytes, size: int) -> MatchResult:
        """The tree's match of ``data`` cut to what a request may use (``size`` bytes)."""
        ...

    def trim(self, node: RadixNode) -> None:
        """Free the sliding-window pages above ``node`` that no held prefix needs any more."""
        ...

    def approximate(self, req: Request, ids: np.ndarray) -> None:
        """Pages ``ids`` now hold, for ``req``, KV a lossy codec approximated (mark and count)."""
        ...

log = logging.getLogger("radixkv.core.cache")
_NO_PAGES = np.empty(0, dtype=np.int64)


class Loads:
    """Tiers -> pool for one cache (see the module docstring).  ``stacks`` is non-empty;
    ``counters`` and ``tier_hits`` (tokens served per tier) are the cache's, added to here."""

    def __init__(self, *, tree: RadixTree, pool: KVPool, groups: KVGroups | None, stacks: list[TierStack],
                 layout: KVLayout, chunk_size: int, load_workers: int, counters: dict[str, int],
                 tier_hits: list[int], host: LoadHost) -> None:
        self.tree, self.pool, self.groups, self.stacks = tree, pool, groups, stacks
        self.layout, self.chunk_size, self.page_size = layout, chunk_size, layout.page_size
        self.load_workers = load_workers
        self.tier_hits = tier_hits
        self._counters = counters
        self._host = host
        self._loader: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the load workers (a load in flight ends on its own; its request is a miss)."""
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def _refs(self, data: bytes) -> list[list[ChunkRef]]:
        """The chunk refs of ``data`` in every stack (one hash pass per KV group)."""
        return [stack.refs_from_bytes(data) for stack in self.stacks]

    def start(self, req: Request, deadline: float) -> None:
        """Hand the chunks past ``req``'s pool match to a worker, if the tiers may hold any (sets
        ``req._pending``).  Cost on the caller's thread: one hash pass over the chunks past the pool."""
        cs, ps = self.chunk_size, self.page_size
        first, last = req.num_cached // cs, req._usable // 4 // cs
        if first >= last:
            return          # not even one chunk past the pool: no worker round trip for a tail's pages
        every = self.stacks[0].refs_from_bytes(req._data[:last * cs * 4])     # keys chain from token 0
        refs = every[first:]
        # Fetch no more chunks than the pool could take without touching held or engine pages.
        room = self.pool.num_free + self.tree.evictable_size // ps + (req.num_cached - first * cs) // ps
        limit = min(len(refs), room // (cs // ps))
        if limit == 0:
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=self.load_workers, thread_name_prefix="radixkv-load")
        if self.groups is not None:
            self._start_groups(req, first, first + limit, deadline)
            return
        tail = None             # without groups, a tail (fewer tokens than a chunk) may follow the chunks
        if self.groups is None:
            parent = every[first - 1].key if first else self.stacks[0].namespace.root
            tail = (parent, req._data[first * cs * 4:req._usable])
        req._pending = PendingLoad(self._loader.submit(fetch_chunks, self.stacks[0], refs, limit, deadline, tail),
                                   first, deadline, [ref.key for ref in refs])

    def _start_groups(self, req: Request, first: int, last: int, deadline: float) -> None:
        """``start`` of a grouped cache: refs per group, and which chunks before ``first``
        each sliding group holds whole in the pool (``fetch_group_chunks`` plans the rest)."""
        assert self.groups is not None and self._loader is not None
        cs, per_chunk = self.chunk_size, self.chunk_size // self.page_size
        refs = self._refs(req._data[:last * cs * 4])
        window: list[int] = []
        extra: list[int] = []
        pool_ok: list[np.ndarray] = []
        for group in self.layout.groups:
            ids = self.groups.pages_of(group, req._pages[:first * per_chunk]).reshape(first, per_chunk)
            pool_ok.append(np.asarray((ids >= 0).all(axis=1)))
            window.append(-(-(group.window - 1) // cs) if group.sliding else 0)
            # and the page beyond the window that a match stopping a page short of the end needs
            extra.append(-(-(group.window - 1 + self.page_size) // cs) - window[-1] if group.sliding else 0)
        future = self._loader.submit(fetch_group_chunks, self.stacks, self.layout.groups, refs, first, last,
                                     window, pool_ok, deadline, extra)
        req._pending = PendingLoad(future, first, deadline, [])   # type: ignore[arg-type]

    def resolve(self, req: Request, pending: PendingLoad) -> None:
        """Land the finished load ``pending`` of ``req`` (a fault is a miss)."""
        try:
            result = pending.future.result()
        except Exception as exc:   # noqa: BLE001 - a fault below the pool is a miss
            self._counters["load_errors"] += 1
            _log_load_error(exc)
            return
        if isinstance(result, GroupLoad):
            if result.end > pending.first:
                self.land_groups(req, pending.first, result)
            return
        where, chunks, tail = result
        if chunks:
            landed = self.land(req, pending.first, where, chunks)
            if self.stacks[0].victims:     # exclusive: moved up, not copied
                keys = pending.keys[:len(chunks) - (tail is not None)] + ([tail] if tail is not None else [])
                self.stacks[0].release(keys[:landed])

    def land(self, req: Request, first: int, where: list[int], chunks: list[torch.Tensor]) -> int:
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
        result = self._host.usable_match(req._data, end * 4)
        self._host.move_hold(req, result.node)
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
            new = self._host.take_pages(need)
            try:
                start = 0
                for i, chunk in enumerate(chunks):
                    k = sizes[i] // ps - (skip if i == 0 else 0)
                    ops.scatter_pages(chunk.to(self.pool.device), self.pool, new[start:start + k],
                                      skip_pages=skip if i == 0 else 0)
                    if self.stacks[0].approximate(chunk):
                        self._host.approximate(req, new[start:start + k])
                    start += k
            except BaseException:
                self._host.free_pages(new)
                raise
            stop = result.num_tokens + len(new) * ps
            pages = np.concatenate([result.pages, new])
            inserted = self.tree.insert_bytes(req._data[:stop * 4], pages)
            assert inserted.prefix_len == result.num_tokens, "the held tree match changed under a load"
            self._host.cached(new, req._data, result.num_tokens)
            self._host.move_hold(req, inserted.node)
            req._pages, req.num_cached = pages, stop
        # Count what the tiers served (tokens resident meanwhile count as pool hits).
        by_tier = [0] * len(self.stacks[0].tiers)
        for i, tier in enumerate(where):
            by_tier[tier] += sizes[i] - (skip * ps if i == 0 else 0)
        for tier, n in enumerate(by_tier):
            self.tier_hits[tier] += n
        tier_tokens = sum(by_tier)
        c = self._counters
        c["hit_tokens"] += req.num_cached - held
        c["pool_hit_tokens"] += req.num_cached - held - tier_tokens
        c["tier_hit_tokens"] += tier_tokens
        req.tier_tokens += tier_tokens
        req.tier_tokens_by_tier = tuple(by_tier)
        return done + len(chunks)

    def land_groups(self, req: Request, first: int, load: GroupLoad) -> None:
        """``land`` of a grouped cache: the full groups' chunks ``first..load.end-1`` go into new
        tree pages past what the tree holds, each sliding group's window chunks into its pages
        (filling pages the tree had dropped), sliding pages no chunk covers are dropped, and the
        request's hold moves to the longest usable prefix.  What the pools have no room for is a
        miss."""
        assert self.groups is not None
        cs, ps, per_chunk = self.chunk_size, self.page_size, self.chunk_size // self.page_size
        data = req._data[:load.end * cs * 4]
        held = req.num_cached
        result = self.tree.match_bytes(data)
        self.tree.lock(result.node)                     # what the tree has stays while pages are taken
        try:
            end = self._land_group_chunks(data, result, load, req)
        finally:
            self.tree.unlock(result.node)
        self._settle(req, held, load)
        self._host.trim(end)                   # after the hold moved: the window it needs stays

    def _land_group_chunks(self, data: bytes, result: MatchResult, load: GroupLoad, req: Request) -> RadixNode:
        """``land_groups``' copies; returns the node that ends what the tree now holds of ``data``."""
        assert self.groups is not None
        ps, per_chunk = self.page_size, self.chunk_size // self.page_size
        total = load.end * per_chunk
        new = _NO_PAGES
        if total > len(result.pages):
            if total - len(result.pages) > self.pool.num_free + self.tree.evictable_size // ps:
                return result.node
            try:
                new = self._host.take_pages(total - len(result.pages))
            except PoolExhausted:
                return result.node
        pages = np.concatenate([result.pages, new])
        covered = [np.zeros(total, dtype=bool) for _ in self.groups.sliding]
        try:
            for g, (group, (need, _, chunks)) in enumerate(zip(self.layout.groups, load.parts)):
                for j, chunk in zip(need, chunks):
                    if self.stacks[g].approximate(chunk):        # the token pages of an approximate chunk
                        self._host.approximate(req, pages[j * per_chunk:(j + 1) * per_chunk])
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
                    self.groups.drop(self.groups.pools[s], table, junk)
        except BaseException:
            self._host.free_pages(new)
            raise
        if not new.size:
            return result.node
        inserted = self.tree.insert_bytes(data[:total * ps * 4], pages)
        assert inserted.prefix_len == len(result.pages) * ps, "the held tree match changed under a load"
        self._host.cached(new, data, len(result.pages) * ps)
        return inserted.node

    def _settle(self, req: Request, held: int, load: GroupLoad) -> None:
        """Move ``req``'s hold to the longest usable prefix of what ``load`` brought (never less
        than the ``held`` tokens) and count the tokens the tiers served beyond them."""
        usable = self._host.usable_match(req._data, load.end * self.chunk_size * 4)
        if usable.num_tokens <= held:
            return
        self._host.move_hold(req, usable.node)
        req._pages, req.num_cached = usable.pages, usable.num_tokens
        gained = req.num_cached - held
        if gained > 0:
            c = self._counters
            tier = next((where[0] for _, where, _ in load.parts if where), 0)
            c["hit_tokens"] += gained
            c["tier_hit_tokens"] += gained
            self.tier_hits[tier] += gained
            req.tier_tokens += gained
            by_tier = [0] * len(self.stacks[0].tiers)
            by_tier[tier] = gained
            req.tier_tokens_by_tier = tuple(by_tier)
        if self.stacks[0].victims:
            for stack, (need, _, _), refs in zip(self.stacks, load.parts, self._refs(req._data[:load.end * self.chunk_size * 4])):
                stack.release([refs[j].key for j in need])      # exclusive: moved up, not copied


def _log_load_error(exc: BaseException, _last: list[float] = [0.0]) -> None:
    """Log a failed tier load once per minute (it is a miss)."""
    now = time.monotonic()
    if now - _last[0] >= 60.0:
        _last[0] = now
        log.warning("radixkv: a tier load failed and was treated as a miss: %s: %s", type(exc).__name__, exc)
