"""The way down, pool -> tiers: what a ``PrefixCache`` stores below its pool, and when.

``Stores`` is made by the cache and called at three moments; it reads the tree and the pools
(never changes them) and queues copies to the tier stacks (one ``TierStack`` per KV group):

* **on insert** (``inserted``): under ``write_through``, every chunk an insert completes goes to
  every tier that keeps copies of the pool (``kept``: all but the stack's victim tiers);
* **on evict** (``evicting``): the chunks that end inside a node the tree is about to evict are
  stored where they are not kept already (``write_back``: every tier; ``write_through``: the victim
  tiers, exclusive of the pool) — a tier that holds one counts it as just used — deepest first,
  after the prefix's *tail* where cached prefixes part inside a chunk (its pages past the last
  chunk boundary, into the local tiers); under ``write_through`` the kept tiers refresh them in
  their LRU order (``TierStack.touch``);
* **as a sliding page leaves every window** (``leaving_window``, ``KVGroups.trim``'s hook): the
  whole chunks that hold it are stored into the tiers an eviction writes, before the pool frees
  it, so the tiers hold every chunk of every KV group.

A chunk's pages are copied out synchronously and the copy is queued (``TierStack.store``), so a
write takes no lock on the tree and nothing is left locked by a write that fails or is dropped.
Stores from an eviction wait up to ``SPILL_WAIT_S`` in all for room in the write queue (those
chunks exist nowhere else); others never wait.  Counters (``chunks_stored``, ``chunks_not_queued``,
``tails_stored``, ``approximate_not_stored``: chunks left out because a lossy codec approximated
their KV) go into the cache's counter dict.  Everything runs on the engine's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.core import ops

if TYPE_CHECKING:
    from radixkv.core.groups import KVGroups
    from radixkv.core.pool import KVLayout, KVPool
    from radixkv.core.stack import ChunkRef, TierStack
    from radixkv.core.tree import RadixNode, RadixTree

__all__ = ["SPILL_WAIT_S", "Stores"]

#: An eviction's write-back (write_back, or the victim tiers of an exclusive stack) waits at most
#: this long in all for room in the tier write queue: those chunks exist nowhere else, and one
#: eviction can free more of them than the queue holds.  Past it they are dropped and counted.
SPILL_WAIT_S = 1.0


class Stores:
    """Pool -> tiers for one cache (see the module docstring).  ``stacks`` is non-empty."""

    def __init__(self, *, tree: RadixTree, pool: KVPool, groups: KVGroups | None, stacks: list[TierStack],
                 layout: KVLayout, chunk_size: int, write_policy: str, counters: dict[str, int],
                 approximate: np.ndarray | None = None) -> None:
        self.tree, self.pool, self.groups, self.stacks = tree, pool, groups, stacks
        #: Per token page, whether its KV is approximate (a lossy codec's): such pages are never
        #: stored down, where they would pass for exact (the coded tier they came from has them).
        self.approximate = np.zeros(pool.num_pages, dtype=bool) if approximate is None else approximate
        self.layout, self.chunk_size, self.page_size = layout, chunk_size, layout.page_size
        self.write_policy = write_policy
        self._counters = counters
        stack = stacks[0]
        #: The tiers that keep copies of what the pool holds (written at insert under
        #: ``write_through``): all but the stack's victim tiers.
        self.kept: frozenset[int] = frozenset(range(len(stack.tiers))) - stack.victims
        #: The tiers a chunk leaving the pool goes into (``None``: all): under ``write_back`` every
        #: tier; under ``write_through`` the victim tiers (the others got it at insert).
        self.into: frozenset[int] | None = None if write_policy == "write_back" else stack.victims

    # ---------------------------------------------------------------- the three moments

    def inserted(self, data: bytes, pages: np.ndarray, first: int, last: int) -> None:
        """An insert completed chunks ``first..last-1`` of the sequence ``data`` held in tree pages
        ``pages`` (from token 0): under ``write_through`` they go to the kept tiers.  A hash pass
        over ``data`` and one gather per chunk and group."""
        if self.write_policy == "write_through" and self.kept and first < last:
            self.store_chunks(data, pages, first, last, self.kept)

    def evicting(self, node: RadixNode) -> None:
        """``node`` is about to be evicted: its chunks (and tail) go where the pool's evictions go
        (see the module docstring).  A hash pass over the node's prefix and one gather per chunk."""
        data, first, last = self._chunks_ending_in(node)
        into = self.into
        with_tail = self.groups is None and node.branched and (into is None or bool(into))
        if first >= last and not with_tail:
            return
        refs = self.refs(data[:last * self.chunk_size * 4])    # one hash pass for all
        if with_tail:
            self._tail(node, data, refs[0], into)
        if first >= last:
            return
        if into is None or into:     # these chunks exist nowhere else: wait (bounded) for queue room
            self.store_chunks(data, self.tree.prefix_pages(node), first, last, into, refs, wait=SPILL_WAIT_S)
        if into is not None and len(into) < len(self.stacks[0].tiers):
            for stack, stack_refs in zip(self.stacks, refs):
                stack.touch([ref.key for ref in stack_refs[first:]], tiers=self.kept)

    def leaving_window(self, i: int, reuse: RadixNode, lo: int, hi: int) -> None:
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
        self.store_chunks(data, pages, first, last, self.into, wait=SPILL_WAIT_S, group=group)

    @property
    def spills_windows(self) -> bool:
        """Whether a page leaving a window has a tier to go to (not under an inclusive
        ``write_through``, where the insert stored it everywhere)."""
        return self.into != frozenset()

    # ---------------------------------------------------------------- copies

    def refs(self, data: bytes) -> list[list[ChunkRef]]:
        """The chunk refs of ``data`` in every stack (one hash pass per KV group)."""
        return [stack.refs_from_bytes(data) for stack in self.stacks]

    def store_chunks(self, data: bytes, pages: np.ndarray, first: int, last: int,
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
            pool: Any = self.pool
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
                if self.approximate[pages[i * per_chunk:(i + 1) * per_chunk]].any():
                    self._counters["approximate_not_stored"] += 1
                    continue
                buf = torch.empty(stack.shape, dtype=self.layout.dtype)
                items.append((ref, ops.gather_pages(pool, chunk_ids, buf)))
            queued = stack.store(items, tiers=tiers, wait=wait, chain=True)
            self._counters["chunks_stored"] += queued
            self._counters["chunks_not_queued"] += len(items) - queued

    def _chunks_ending_in(self, node: RadixNode) -> tuple[bytes, int, int]:
        """The tokens from the root to the end of ``node`` (int32 bytes) and the range
        ``first..last-1`` of the chunks that end inside ``node``.  O(depth + tokens)."""
        tokens = self.tree.prefix_tokens(node)
        start = len(tokens) - node.num_tokens
        return tokens.tobytes(), start // self.chunk_size, len(tokens) // self.chunk_size

    def _tail(self, node: RadixNode, data: bytes, refs: list[ChunkRef], into: frozenset[int] | None) -> None:
        """Store the tail of ``node``'s prefix (``data``): its tokens past the last chunk boundary,
        if any, into the local tiers among ``into`` (``None``: every tier), before the chunks (it is
        the deepest).  Only for a node that other cached sequences continued (``branched``): where
        prefixes part, the next request is likely to stop too — a request's own end would only take
        a slot.  ``refs``: the prefix's full chunks."""
        cs, ps = self.chunk_size, self.page_size
        start, end = len(refs) * cs, len(data) // 4
        stack = self.stacks[0]
        tiers = [i for i in (range(len(stack.tiers)) if into is None else into) if stack.tiers[i].local]
        if end == start or not tiers:
            return
        if self.approximate[self.tree.prefix_pages(node)[start // ps:]].any():
            self._counters["approximate_not_stored"] += 1
            return
        ref = stack.tail_ref(refs[-1].key if refs else stack.namespace.root, data[start * 4:])
        buf = torch.empty(self.layout.chunk_shape(end - start), dtype=self.layout.dtype)
        kv = ops.gather_pages(self.pool, self.tree.prefix_pages(node)[start // ps:], buf)
        self._counters["tails_stored"] += stack.store([(ref, kv)], tiers=tiers, wait=SPILL_WAIT_S, chain=True)
