"""KV groups: the pages of sliding-window layers, held only where a match can still use them.

A hybrid model (Gemma-2/3, Cohere2, Qwen2 with sliding layers) mixes full-attention layers, whose
queries see every earlier token, with sliding-window layers, whose queries see only the last
``w`` tokens; a model like Mistral may have sliding windows in every layer.  ``KVLayout.windows``
says which layer is which, and layers of one window form a ``KVGroup`` with a pool of its own.

The radix tree stays a tree of *token pages*: a tree page id names ``page_size`` tokens of a
prefix.  When the layout has a full-attention group, that group's pool is the cache's ``pool``
and a tree page id is its page id.  Every sliding group maps a tree page to a page of its own pool,
or to ``-1``: a *tombstone*, the group's KV of those tokens dropped.  The rule that decides what
is dropped (vLLM's hybrid KV cache manager frees sliding blocks outside the window the same way):

* A *reuse point* is where a later match can end: the end of a leaf, of a node with two or more
  children (where cached sequences diverge: a shared system prompt), and of a prefix a live
  request holds (it decodes on from there).
* A sliding group with a window of ``w`` tokens (a query sees itself and the ``w - 1`` tokens
  before it) keeps, before each reuse point, the pages that cover its last ``w - 1`` tokens and
  one page more (a match stops a page short of a prefix it repeats, to compute its last token); every other page of the group is freed as soon as it is outside
  every such window.  A conversation that grows turn by turn is one chain of nodes with one reuse
  point at its end, so it holds ``ceil((w - 1) / page_size) + 1`` pages per sliding group, not
  one per page.
* A match of ``n`` tokens is a hit when the full groups hold the prefix (the tree) and each sliding
  group holds the pages of its last ``w - 1`` tokens; the cache serves the longest such ``n``.
  With tiers each sliding group must also hold the pages from the last chunk boundary at or
  before ``n`` (``use_chunks``): the request completes that chunk with tokens of its own, a chunk
  no tier holds yet, and a chunk is stored whole or not at all.  (A match may end where no reuse
  point was, inside a run of pages that a reuse point further on let go: its window may be
  there, but not the rest of its chunk.)
* A request that computes tokens whose KV the tree has dropped gives the dropped pages back:
  ``fill`` moves its pages into the tombstones instead of freeing them as duplicates.
* With tiers, a sliding page that leaves every window goes the way an evicted page goes: before it
  is freed, the chunk that holds it is stored (``trim``'s ``spill`` hook, which ``PrefixCache``
  sets), so the tiers hold every chunk of every group, as for full attention, while the pool
  holds O(window) pages per reuse point.  A hit from the tiers at any chunk boundary the full
  groups can serve then finds the sliding groups' window chunks too.

A dropped page is never one a live request needs: ``check`` asserts that each held request's
window is present, and that nothing outside every window is kept.  Chunks go to the tiers per
group, under keys of the group's own namespace (``Namespace.bind(layout, group)``); a sliding
group's chunk is stored while its pages are held (inside a window) or as they leave it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from radixkv.core import ops
from radixkv.core.pool import KVGroup, KVLayout, KVPool

if TYPE_CHECKING:
    from radixkv.core.stack import ChunkRef, TierStack
    from radixkv.core.tree import RadixNode, RadixTree

__all__ = ["GroupLoad", "KVGroups", "fetch_group_chunks", "gather_present", "scatter_present"]

#: ``KVGroups.trim``'s hook: (sliding group index, reuse point node, first page position, end).
Spill = Callable[[int, "RadixNode", int, int], None]

_PROBES = 3      # window probes of one tier load before it gives up (each is a lookup round trip)


class KVGroups:
    """The sliding groups of one cache: their pools, the tree-page -> group-page maps and the
    requests' ends.  Made and driven by ``PrefixCache``; every method runs on its engine thread.

    ``full`` is the full-attention group's pool (the cache's ``pool``) or ``None`` when every
    layer slides; ``sliding[i]`` is the ``i``-th sliding group, ``pools[i]`` its pool of
    ``window_pages`` pages, ``maps[i]`` the int64 map from tree page ids to its page ids (``-1``:
    none), ``need[i]`` the pages of its window a match needs, ``keep[i]`` those kept.
    """

    def __init__(self, layout: KVLayout, num_pages: int, window_pages: int, device: torch.device,
                 full: KVPool | None) -> None:
        self.layout = layout
        self.full = full
        self.sliding: tuple[KVGroup, ...] = tuple(g for g in layout.groups if g.sliding)
        self.pools = [KVPool(layout.group_layout(g), window_pages, device) for g in self.sliding]
        self.maps = [np.full(num_pages, -1, dtype=np.int64) for _ in self.sliding]
        ps = layout.page_size
        #: Pages of the last ``w - 1`` tokens, per sliding group: what a match needs.
        self.need = [-(-(g.window - 1) // ps) for g in self.sliding]
        #: Pages kept before each reuse point: a page more than ``need``, so that a match that stops
        #: a page short of it (one that leaves the last token to compute) finds its window; with
        #: tiers a chunk more instead (``use_chunks``).
        self.keep = self.keep_for(ps)
        #: Pages per chunk of the tiers below (1: no tiers): a match must find the pages of the
        #: chunk it ends in whole, from the chunk's start, in every sliding group (``use_chunks``).
        self.chunk_pages = 1
        self.ends: dict[RadixNode, int] = {}      # requests whose held prefix ends at the node
        self.dropped_pages = 0                    # pages freed outside every window (a counter)

    def keep_for(self, margin: int) -> list[int]:
        """Pages to keep before a reuse point so that a match ending up to ``margin`` tokens
        before it still finds its window: ``ceil((w - 1 + margin) / page_size)`` per group."""
        ps = self.layout.page_size
        return [-(-(g.window - 1 + margin) // ps) for g in self.sliding]

    def use_chunks(self, chunk_size: int) -> None:
        """Tiers below store every group's KV in chunks of ``chunk_size`` tokens (each group's
        chunk whole, or not at all).  Keep a chunk more of each window (a tier match ends on a chunk
        boundary: the chunks it needs are then whole in the pool when they are stored), and serve
        a match only where every sliding group holds its pages from the last chunk boundary
        (``usable``), so that the chunk the request completes can be stored whole.  O(groups)."""
        self.keep = self.keep_for(chunk_size)
        self.chunk_pages = chunk_size // self.layout.page_size

    # ------------------------------------------------------------- pages

    def short(self, n: int) -> int:
        """How many more pages the fullest sliding pool needs before ``n`` can be taken."""
        return max((n - pool.num_free for pool in self.pools), default=0)

    def attach(self, ids: np.ndarray) -> None:
        """Give new tree-page ids ``ids`` a page in every sliding pool (the caller checked room)."""
        for pool, table in zip(self.pools, self.maps):
            table[ids] = pool.alloc(len(ids))

    def detach(self, ids: np.ndarray) -> None:
        """Free the sliding pages of tree-page ids ``ids`` (being freed themselves)."""
        for pool, table in zip(self.pools, self.maps):
            held = table[ids]
            held = held[held >= 0]
            if held.size:
                pool.free(held)
            table[ids] = -1

    def fill(self, tree_pages: np.ndarray, engine_pages: np.ndarray) -> None:
        """Where ``tree_pages`` have tombstones and the engine's duplicates ``engine_pages`` (the
        same tokens) have pages, move those pages to the tree's ids (before the duplicates go)."""
        for table in self.maps:
            move = (table[tree_pages] < 0) & (table[engine_pages] >= 0)
            if move.any():
                table[tree_pages[move]] = table[engine_pages[move]]
                table[engine_pages[move]] = -1

    def unreachable(self, tree: RadixTree, n: int) -> bool:
        """Whether some sliding pool stays short of ``n`` free pages even after evicting every
        unlocked node (whose sliding pages eviction frees).  O(nodes); only asked when short."""
        nodes = [node for node in tree.nodes() if node.lock_ref == 0]
        pages = np.concatenate([node.pages for node in nodes]) if nodes else np.empty(0, dtype=np.int64)
        return any(n - pool.num_free > int((table[pages] >= 0).sum()) for pool, table in zip(self.pools, self.maps))

    # ------------------------------------------------------------- matching

    def usable(self, pages: np.ndarray) -> int:
        """The longest ``n <= len(pages)`` such that every sliding group holds the pages of the
        last ``w - 1`` tokens of ``pages[:n]`` (all of them when ``n`` pages are fewer): how many of
        a tree match's pages (from the root) can be served.  With tiers (``use_chunks``) each also
        holds the pages of ``pages[:n]`` from the last chunk boundary at or before ``n``.
        O(len(pages)), vectorised."""
        m = len(pages)
        if m == 0:
            return 0
        ok = np.ones(m + 1, dtype=bool)
        ends = np.arange(m + 1)
        chunk_starts = ends - ends % self.chunk_pages
        for table, need in zip(self.maps, self.need):
            absent = np.concatenate(([0], np.cumsum(table[pages] < 0)))
            ok &= absent[ends] == absent[np.minimum(np.maximum(0, ends - need), chunk_starts)]
        return int(np.flatnonzero(ok)[-1])

    # ------------------------------------------------------------- holds and the window rule

    def hold(self, node: RadixNode, delta: int) -> None:
        """A request's held prefix starts (``+1``) or stops (``-1``) ending at ``node``."""
        if node.parent is None:          # the root: nothing held
            return
        count = self.ends.get(node, 0) + delta
        if count:
            self.ends[node] = count
        else:
            self.ends.pop(node, None)

    def _reuse(self, node: RadixNode) -> bool:
        return len(node.children) != 1 or node in self.ends

    def trim(self, tree: RadixTree, node: RadixNode, spill: Spill | None = None) -> None:
        """Apply the window rule on the path of ``node`` after it changed (a child more or less, a
        hold more or less, pages filled): free every sliding page of ``node`` and its ancestors that
        is outside the window of its nearest reuse point.  ``spill(i, reuse, lo, hi)`` is called
        first for each run of pages about to go that still has one (sliding group ``i``, page
        positions ``lo..hi-1`` on the path from the root to ``reuse``, the nearest reuse point at
        or below ``node``), so that their chunks reach the tiers before the pool lets them go.
        O(depth + pages trimmed)."""
        if node.parent is None:
            return
        end = 0
        up = node
        while up is not tree.root:
            end += len(up.pages)
            up = up.parent               # type: ignore[assignment]
        near, down = end, node
        while not self._reuse(down):     # the nearest reuse point at or below node
            (down,) = down.children.values()
            near += len(down.pages)
        cur = node
        while cur is not tree.root:
            if self._reuse(cur):
                near, down = end, cur
            start = end - len(cur.pages)
            for i, (pool, table, keep) in enumerate(zip(self.pools, self.maps, self.keep)):
                cut = min(near - keep, end) - start
                if cut > 0:
                    if spill is not None and (table[cur.pages[:cut]] >= 0).any():
                        spill(i, down, start, start + cut)
                    self.drop(pool, table, cur.pages[:cut])
            end, cur = start, cur.parent     # type: ignore[assignment]

    def drop(self, pool: KVPool, table: np.ndarray, ids: np.ndarray) -> None:
        """Free the pages that tree pages ``ids`` map to in one sliding group (``pool``, its map
        ``table``), leaving tombstones; counted in ``dropped_pages``.  O(len(ids))."""
        held = table[ids]
        mask = held >= 0
        if mask.any():
            pool.free(held[mask])
            table[ids[mask]] = -1
            self.dropped_pages += int(mask.sum())

    def pages_of(self, group: KVGroup, pages: Any) -> np.ndarray:
        """The page ids in ``group``'s pool of tree pages ``pages`` (``-1``: dropped); a full
        group's are the tree pages themselves.  O(len(pages))."""
        ids = np.array(pages, dtype=np.int64)       # a copy: callers may pass a read-only view
        if not group.sliding:
            return ids
        return self.maps[self.sliding.index(group)][ids]

    def pool_of(self, group: KVGroup) -> KVPool:
        """The pool that holds ``group``'s KV."""
        if not group.sliding:
            assert self.full is not None
            return self.full
        return self.pools[self.sliding.index(group)]

    def gather(self, pages: Any) -> list[torch.Tensor]:
        """The KV of tree pages ``pages``, one ``[group layers, sides, tokens, heads, dim]`` buffer
        per group of ``layout.groups`` (zeros where a sliding group dropped a page: outside its
        window, so masked).  Cost: one gather per group."""
        return [gather_present(self.pool_of(g), self.pages_of(g, pages)) for g in self.layout.groups]

    def scatter(self, bufs: list[torch.Tensor], pages: Any) -> None:
        """Copy one buffer per group (``gather``'s shapes) into tree pages ``pages`` of every group
        (dropped sliding pages are skipped).  Cost: one scatter per group."""
        for group, buf in zip(self.layout.groups, bufs):
            scatter_present(buf, self.pool_of(group), self.pages_of(group, pages))

    def held_pages(self) -> list[int]:
        """Pages each sliding pool has handed out (tree and engine).  O(1) per group."""
        return [pool.num_pages - pool.num_free for pool in self.pools]

    # ------------------------------------------------------------- invariants

    def check(self, tree: RadixTree, live_pages: np.ndarray, held: list[tuple[RadixNode, np.ndarray]]) -> None:
        """Assert the groups' invariants: each sliding pool's handed-out pages are exactly the
        mapped ones, once each, and only for live tree pages (``live_pages``: not free); ``ends``
        counts exactly the live requests' held nodes and each one's window (``held``: node and
        held pages per request) is present, with tiers from its last chunk boundary; no tree page
        outside every reuse point's window keeps a sliding page.  O(nodes + num_pages)."""
        free = np.ones(len(self.maps[0]) if self.maps else 0, dtype=bool)
        free[live_pages] = False
        for group, pool, table in zip(self.sliding, self.pools, self.maps):
            pool.check()
            assert (table[free] < 0).all(), f"group {group.tag()}: a free tree page keeps a sliding page"
            mapped = table[table >= 0]
            assert np.unique(mapped).size == mapped.size, f"group {group.tag()}: two tree pages share a page"
            assert not pool._is_free[mapped].any(), f"group {group.tag()}: a mapped page is free in its pool"
            assert mapped.size == pool.num_pages - pool.num_free, \
                f"group {group.tag()}: {pool.num_pages - pool.num_free} pages handed out, {mapped.size} mapped"
        counts: dict[RadixNode, int] = {}
        for node, _ in held:
            if node is not tree.root:
                counts[node] = counts.get(node, 0) + 1
        assert counts == self.ends, "the requests' ends differ from the held prefixes"
        for _, pages in held:
            chunk_start = len(pages) - len(pages) % self.chunk_pages
            for group, table, need in zip(self.sliding, self.maps, self.need):
                window = pages[min(max(0, len(pages) - need), chunk_start):]
                assert (table[window] >= 0).all(), \
                    f"group {group.tag()}: a page a live request holds in its window was dropped (with tiers, " \
                    "its window runs from the last chunk boundary)"
        # Nothing kept outside every window: walk the tree, nearest reuse point below each node.
        stack: list[tuple[RadixNode, int]] = [(c, 0) for c in tree.root.children.values()]
        order: list[tuple[RadixNode, int]] = []
        while stack:
            node, start = stack.pop()
            order.append((node, start))
            stack.extend((c, start + len(node.pages)) for c in node.children.values())
        near: dict[RadixNode, int] = {}
        for node, start in reversed(order):            # children before parents
            end = start + len(node.pages)
            near[node] = end if self._reuse(node) else near[next(iter(node.children.values()))]
            for group, table, keep in zip(self.sliding, self.maps, self.keep):
                cut = min(near[node] - keep, end) - start
                if cut > 0:
                    assert (table[node.pages[:cut]] < 0).all(), \
                        f"group {group.tag()}: {node!r} keeps sliding pages outside every window"


def gather_present(pool: KVPool, ids: np.ndarray) -> torch.Tensor:
    """The KV of group pages ``ids`` as one ``[layers, sides, len(ids) * page_size, heads, dim]``
    buffer, zeros where an id is ``-1`` (a dropped page: outside the window, so masked by the
    model).  Cost: one gather of the present pages."""
    ps = pool.layout.page_size
    out = torch.zeros(pool.layout.chunk_shape(len(ids) * ps), dtype=pool.kv.dtype, device=pool.device)
    present = np.flatnonzero(ids >= 0)
    if present.size == len(ids):
        return ops.gather_pages(pool, ids, out)
    if present.size:
        part = ops.gather_pages(pool, ids[present])
        rows = torch.from_numpy((present[:, None] * ps + np.arange(ps)).reshape(-1)).to(pool.device)
        out.index_copy_(2, rows, part)
    return out


def scatter_present(src: torch.Tensor, pool: KVPool, ids: np.ndarray) -> None:
    """Copy the pages of ``src`` (``[layers, sides, len(ids) * page_size, heads, dim]``) into group
    pages ``ids``, skipping ``-1``.  Cost: one scatter of the present pages."""
    ps = pool.layout.page_size
    present = np.flatnonzero(ids >= 0)
    if present.size == len(ids):
        ops.scatter_pages(src.contiguous(), pool, ids)
    elif present.size:
        rows = torch.from_numpy((present[:, None] * ps + np.arange(ps)).reshape(-1)).to(src.device)
        ops.scatter_pages(src.index_select(2, rows).contiguous(), pool, ids[present])



@dataclass(slots=True)
class GroupLoad:
    """What a tier load of a grouped cache fetched: chunks up to ``end`` (exclusive) are served.
    ``parts[g]`` for each group of ``layout.groups``: ``(chunk indices, serving tiers, tensors)``."""

    end: int
    parts: list[tuple[list[int], list[int], list[torch.Tensor]]]


def fetch_group_chunks(stacks: Sequence[TierStack], groups: Sequence[KVGroup], refs: Sequence[Sequence[ChunkRef]],
                       first: int, last: int, window: Sequence[int], pool_ok: Sequence[np.ndarray],
                       deadline: float, extra: Sequence[int] | None = None) -> GroupLoad:
    """The worker's half of a grouped load (``request.fetch_chunks``' counterpart): find the
    longest ``end <= last`` such that the full groups' chunks ``first..end-1`` are in the tiers and
    every sliding group has the ``window[g]`` chunks before ``end`` in the pool (``pool_ok[g][j]``,
    for ``j < first``) or in the tiers; fetch those, all by ``deadline``.  A sliding chunk missing
    moves ``end`` back to it (at most ``_PROBES`` times).  Then, best effort, the ``extra[g]``
    chunks before those (what a later match that stops a page short of ``end`` needs of its window:
    the page ``KVGroups.keep`` keeps beyond the window), where the tiers hold them; one missing
    shortens nothing.  ``refs[g]`` are group ``g``'s refs from chunk 0.  Touches neither the pool
    nor the tree; a fault is a miss.  Cost: one lookup per group per probe, one more per group
    with ``extra``, then the loads."""
    miss = GroupLoad(first, [])
    end = last
    full_where: list[int] = []
    for g, group in enumerate(groups):
        if not group.sliding:
            full_where = stacks[g].lookup([r.key for r in refs[g][first:last]], deadline=deadline)
            end = first + len(full_where)
    plans: dict[int, tuple[list[int], list[int]]] = {}
    for _ in range(_PROBES):
        if end <= first or time.monotonic() >= deadline:
            return miss
        plans, back = {}, end
        for g, group in enumerate(groups):
            if not group.sliding:
                continue
            need = [j for j in range(max(0, end - window[g]), end) if j >= first or not pool_ok[g][j]]
            found = stacks[g].lookup([refs[g][j].key for j in need], deadline=deadline) if need else []
            if len(found) < len(need):
                back = min(back, need[len(found)])      # the window must end before the missing chunk
            plans[g] = (need, found)
        if back == end:
            break
        end = back
    else:
        return miss
    if end <= first:
        return miss
    for g, group in enumerate(groups):
        if group.sliding and extra is not None and extra[g] > 0:
            lo = max(0, end - window[g])
            more = [j for j in range(max(0, lo - extra[g]), lo) if j >= first or not pool_ok[g][j]]
            if more:     # the nearest first: a later match stops just short of end
                found = stacks[g].lookup([refs[g][j].key for j in reversed(more)], deadline=deadline)
                got = list(reversed(more))[:len(found)]
                need, where = plans[g]
                plans[g] = ([*reversed(got), *need], [*reversed(found), *where])
    parts = []
    for g, group in enumerate(groups):
        if group.sliding:
            need, where = plans[g]
        else:
            need, where = list(range(first, end)), full_where[:end - first]
        chunks = stacks[g].load([refs[g][j] for j in need], where=where, deadline=deadline) if need else []
        if len(chunks) < len(need):
            return miss                                   # a fault or the deadline: all or nothing
        parts.append((need, list(where), chunks))
    return GroupLoad(end, parts)
