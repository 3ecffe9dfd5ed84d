"""``PrefixCache``: the engine-facing cache that keeps the radix tree and the page pool consistent.

The protocol for one request (every call validates its arguments and leaves the cache as it was
when it raises):

    m = cache.match(tokens)            # cached prefix: m.num_tokens tokens in pages m.pages, locked
    new = cache.alloc(n)               # pages for the rest (evicts LRU prefixes when short)
    ...                                # the engine writes KV for tokens[m.num_tokens:] into `new`
    cache.insert(tokens, torch.cat([m.pages, new]))   # the cache takes ownership of these pages
    cache.release(m)

Every page is in exactly one place at any moment: free in the pool, held by the tree, or held by
the engine (allocated and not yet inserted).  ``check()`` verifies it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixkv.hashing import Namespace, as_token_bytes
from radixkv.pool import KVLayout, KVPool, as_page_ids, has_duplicates
from radixkv.tree import RadixNode, RadixTree

__all__ = ["Match", "PoolExhausted", "PrefixCache"]

_FREE, _ENGINE, _TREE = 0, 1, 2
_match_ids = itertools.count(1)  # global, so a Match from another cache is never mistaken for ours


class PoolExhausted(RuntimeError):
    """``alloc`` cannot find enough pages even after evicting every unlocked prefix."""


@dataclass(frozen=True, slots=True)
class Match:
    """A cached prefix, locked against eviction until ``PrefixCache.release``.

    ``pages`` (int64, CPU) holds the KV of ``tokens[:num_tokens]``; ``num_tokens`` is a multiple
    of the page size.
    """

    num_tokens: int
    pages: torch.Tensor
    id: int

    def __repr__(self) -> str:
        return f"Match({self.num_tokens} tokens in {len(self.pages)} pages, id={self.id})"


class PrefixCache:
    """Prefix cache over a paged KV pool.  See the module docstring for the protocol.

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
                 namespace: Namespace | None = None, tiers: Any = (), chunk_size: int = 256,
                 write_policy: str = "write_through") -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 \
                or chunk_size % layout.page_size:
            raise ValueError(f"chunk_size must be a positive multiple of page_size={layout.page_size}, "
                             f"got {chunk_size!r}")
        if write_policy not in ("write_through", "write_back"):
            raise ValueError(f"write_policy must be 'write_through' or 'write_back', got {write_policy!r}")
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if list(tiers):
            raise NotImplementedError("tiers: lower tiers are not wired into PrefixCache yet; pass tiers=[]")
        self.layout = layout
        self.page_size = layout.page_size
        self.chunk_size = chunk_size
        self.write_policy = write_policy
        self.namespace = (namespace or Namespace(model="unnamed")).bind(layout)
        self.pool = KVPool(layout, num_pages, device)
        self.tree = RadixTree(layout.page_size)
        self._state = np.zeros(num_pages, dtype=np.uint8)   # _FREE / _ENGINE / _TREE per page
        self._live: dict[int, RadixNode] = {}
        self._counters = dict.fromkeys(
            ("matches", "query_tokens", "hit_tokens", "inserts", "inserted_tokens", "duplicate_pages",
             "allocs", "allocated_pages", "evicted_pages", "evictions"), 0)

    def __repr__(self) -> str:
        return (f"PrefixCache({self.pool.num_pages} pages x {self.page_size} tokens, "
                f"{self.tree.total_size} tokens cached, {len(self._live)} live matches)")

    # ---------------------------------------------------------------- the protocol

    def match(self, tokens: Any, *, leave_last: bool = True) -> Match:
        """Find and lock the longest cached page-aligned prefix of ``tokens``.

        With ``leave_last`` (the default) the match never covers the last token, since the engine
        needs its logits; pass ``False`` for a pure lookup.  The match holds a reference until
        ``release``.  Cost: O(d + L/page_size + log n), as ``RadixTree.match_prefix``.
        """
        data = as_token_bytes(tokens)
        usable = data[:-4] if leave_last and data else data
        result = self.tree._match(usable)
        self.tree.lock(result.node)
        match = Match(result.num_tokens, torch.from_numpy(result.pages), next(_match_ids))
        self._live[match.id] = result.node
        c = self._counters
        c["matches"] += 1
        c["query_tokens"] += len(data) // 4
        c["hit_tokens"] += result.num_tokens
        return match

    def release(self, match: Match) -> None:
        """Drop the reference ``match`` holds, so its pages may be evicted again.  O(depth).

        Raises ``ValueError`` for a match released twice or not made by this cache.
        """
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match, got {type(match).__name__}")
        node = self._live.pop(match.id, None)
        if node is None:
            raise ValueError("match: already released, or not made by this cache")
        self.tree.unlock(node)

    def alloc(self, num_pages: int) -> torch.Tensor:
        """Take ``num_pages`` free pages (int64 ids), evicting LRU prefixes when the pool is short.

        The engine owns them until it passes them to ``insert`` (or ``free``).  Raises
        ``PoolExhausted`` without evicting anything when free + evictable pages are not enough.
        Cost: O(num_pages) plus O(log n) per evicted node.
        """
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        short = num_pages - self.pool.num_free
        if short > 0:
            evictable = self.tree.evictable_size // self.page_size
            if short > evictable:
                raise PoolExhausted(
                    f"cannot allocate {num_pages} pages: {self.pool.num_free} free, {evictable} evictable, "
                    f"{self.tree.protected_size // self.page_size} locked by running requests, "
                    f"{int((self._state == _ENGINE).sum())} held by the engine")
            self.evict(short)
        ids = self.pool.alloc(num_pages)
        self._state[ids] = _ENGINE
        self._counters["allocs"] += 1
        self._counters["allocated_pages"] += num_pages
        return torch.from_numpy(ids)

    def free(self, pages: Any) -> None:
        """Give back pages from ``alloc`` that the engine will not insert (an aborted request).  O(n)."""
        ids = self._engine_pages(pages, "pages")
        self.pool.free(ids)
        self._state[ids] = _FREE

    def insert(self, tokens: Any, pages: Any) -> int:
        """Cache ``tokens`` with the KV in ``pages`` and take ownership of the pages.

        ``pages`` has one id per full page of ``tokens`` (plus optionally one for a partial tail
        page, which is freed): the pages of a match, then pages from ``alloc``.  Pages of tokens
        that are cached already (another request inserted them meanwhile) are freed, as is the
        tail page.  Returns how many leading tokens were already cached.  Raises
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
        if has_duplicates(ids):
            raise ValueError("pages: the same page id is given more than once")
        state = self._state[ids]
        if (state == _FREE).any():
            raise ValueError(f"pages: page {int(ids[state == _FREE][0])} is free; pass pages from "
                             "alloc() or a match")
        if len(ids) > full and state[-1] != _ENGINE:
            raise ValueError("pages: the partial tail page must be one from alloc()")
        body = ids[:full]
        in_tree = state[:full] == _TREE

        def validate(prefix_bytes: int, path: list[RadixNode]) -> None:
            known = prefix_bytes // (4 * self.page_size)
            if in_tree[known:].any():
                raise ValueError("pages: a cached page is passed for tokens it does not hold")
            if known and in_tree[:known].any():
                cached = np.concatenate([n.pages for n in path])
                if (in_tree[:known] & (body[:known] != cached)).any():
                    raise ValueError("pages: a cached page is passed for tokens it does not hold")

        result = self.tree._insert(data, body, validate)
        known = result.prefix_len // self.page_size
        duplicates = body[:known][~in_tree[:known]]
        if len(ids) > full:
            duplicates = np.append(duplicates, ids[-1])
        if duplicates.size:
            self.pool.free(duplicates)
            self._state[duplicates] = _FREE
        self._state[body[known:]] = _TREE
        c = self._counters
        c["inserts"] += 1
        c["inserted_tokens"] += (full - known) * self.page_size
        c["duplicate_pages"] += int(duplicates.size)
        return result.prefix_len

    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked prefixes until ``num_pages`` pages are freed (or
        nothing more is evictable); return how many were freed.  O(log n) per evicted node."""
        freed = self.tree.evict(num_pages)
        if freed.size:
            self.pool.free(freed)
            self._state[freed] = _FREE
            self._counters["evicted_pages"] += int(freed.size)
            self._counters["evictions"] += 1
        return int(freed.size)

    # ---------------------------------------------------------------- inspection

    def _engine_pages(self, pages: Any, name: str) -> np.ndarray:
        ids = as_page_ids(pages, self.pool.num_pages, name)
        if has_duplicates(ids):
            raise ValueError(f"{name}: the same page id is given more than once")
        if (self._state[ids] != _ENGINE).any():
            raise ValueError(f"{name}: page {int(ids[self._state[ids] != _ENGINE][0])} is not held by the engine")
        return ids

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy: matches, query and hit tokens, hit rate, pages free / cached /
        held by the engine, evictions.  O(num_pages) (counts the page states)."""
        c: dict[str, Any] = dict(self._counters)
        counts = np.bincount(self._state, minlength=3)
        c.update(
            hit_rate=c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0,
            pages_free=int(counts[_FREE]), pages_cached=int(counts[_TREE]),
            pages_engine=int(counts[_ENGINE]), pages_total=self.pool.num_pages,
            nodes=self.tree.num_nodes, live_matches=len(self._live),
            cached_tokens=self.tree.total_size, locked_tokens=self.tree.protected_size)
        return c

    def check(self) -> None:
        """Assert every invariant of the cache, its tree and its pool (O(n + num_pages)).

        Each page is free, cached or engine-held, never two of these; the pool's free list is
        exactly the free pages; the tree holds exactly the cached pages; every node's lock_ref
        equals the number of live matches at or below it.
        """
        self.pool.check()
        self.tree.check()
        state = self._state
        assert np.array_equal(self.pool._is_free, state == _FREE), "pool free list != pages marked free"
        tree_pages = np.sort(self.tree.all_pages())
        assert np.array_equal(tree_pages, np.flatnonzero(state == _TREE)), "tree pages != pages marked cached"
        expected: dict[int, int] = {}
        for node in self._live.values():
            while node.parent is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self.tree.nodes():
            assert node.lock_ref == expected.get(id(node), 0), \
                f"{node!r}: lock_ref {node.lock_ref} but {expected.get(id(node), 0)} live matches use it"
