"""The radix tree: which page-aligned token prefixes are resident in the pool, and in which pages.

A node holds a run of whole pages of tokens (``key``, little-endian int32 bytes) and the pool
page ids holding their KV (``pages``); its children are keyed by the bytes of their first page, so
one dict lookup picks the branch and one ``bytes`` comparison (``memcmp``) checks a whole node.
No Python code runs per token.

Reference counts: ``lock(node)`` adds one to every node on the path to the root, ``unlock``
takes it back.  A node with ``lock_ref > 0`` is in use by a running request and is never evicted.

Eviction: unlocked leaves sit in a binary heap ordered by last access, so ``evict`` pops the
least recently used one in O(log n) and a parent joins the order the moment it becomes a
childless unlocked node.  Leaving the order (a lock, a new child, a new access stamp) only marks
the node's heap entry dead (O(1)); dead entries are skipped when popped and dropped all at once
when they outnumber the live ones (amortised O(1)).  Nothing is rebuilt per call.

>>> tree = RadixTree(page_size=2)
>>> tree.insert([1, 2, 3, 4, 5], [7, 8]).prefix_len      # the tail token 5 is not a full page
0
>>> r = tree.match_prefix([1, 2, 3, 9])
>>> r.num_tokens, r.pages.tolist()
(2, [7])
>>> print(tree.pretty())
root
└── [1 2] 2 tokens, pages [7]
    └── [3 4] 2 tokens, pages [8]
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, NamedTuple

import numpy as np

from radixkv.core._checks import check_int
from radixkv.core.hashing import as_token_bytes
from radixkv.core.pool import as_page_ids, has_duplicates

__all__ = ["InsertResult", "MatchResult", "RadixNode", "RadixTree"]

_EMPTY_PAGES = np.empty(0, dtype=np.int64)
_serials = itertools.count()


class RadixNode:
    """One node of a ``RadixTree``: a run of whole pages of tokens and the pool pages holding them.

    Engines treat it as an opaque handle (``lock``/``unlock`` it); ``num_tokens``, ``lock_ref``
    and ``token_ids`` are there for inspection.
    """

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "serial", "lru_entry", "branched")

    def __init__(self, key: bytes, pages: np.ndarray, parent: RadixNode | None, last_access: int) -> None:
        self.key = key                      # int32 LE bytes, a whole number of pages
        self.pages = pages                  # int64 page ids, one per page of key
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.serial = next(_serials)        # breaks ties in the LRU order
        self.lru_entry = -1                 # the id of its live entry in the tree's LRU heap, -1: none
        self.branched = False               # ever had a child: its end is where cached sequences part

    @property
    def num_tokens(self) -> int:
        """Tokens this node holds (not counting its ancestors)."""
        return len(self.key) // 4

    @property
    def token_ids(self) -> np.ndarray:
        """This node's token ids (a read-only int32 view)."""
        return np.frombuffer(self.key, dtype="<i4")

    def __repr__(self) -> str:
        return f"RadixNode({self.num_tokens} tokens, {len(self.pages)} pages, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """Result of ``RadixTree.match_prefix``: the cached page-aligned prefix."""

    num_tokens: int
    pages: np.ndarray   # int64 page ids of the prefix, in order
    node: RadixNode     # deepest node of the prefix (the root if nothing matched): lock this


class InsertResult(NamedTuple):
    """Result of ``RadixTree.insert``."""

    prefix_len: int     # leading tokens that were already cached: their pages are duplicates
    node: RadixNode     # the node that ends the inserted sequence


class RadixTree:
    """A token trie at page granularity with LRU eviction and reference counts.

    ``evictable_size``, ``protected_size`` and ``total_size`` are in tokens.
    """

    def __init__(self, page_size: int) -> None:
        check_int(page_size, "page_size", 1)
        self.page_size = page_size
        self._page_bytes = 4 * page_size
        self._clock = 0
        self._root = RadixNode(b"", _EMPTY_PAGES, None, 0)
        self._root.lock_ref = 1  # the root is never evicted and never in the LRU order
        # The LRU order of the evictable (unlocked, childless) nodes: a heap of (last_access, serial,
        # entry, node), live where node.lru_entry == entry; _lru_live of them are.
        self._lru: list[tuple[int, int, int, RadixNode]] = []
        self._lru_live = 0
        self._lru_next = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0

    # ---------------------------------------------------------------- sizes

    @property
    def root(self) -> RadixNode:
        """The root node (holds no tokens; matching nothing returns it)."""
        return self._root

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (they may be evicted once they are leaves).  O(1)."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes (in use by running requests).  O(1)."""
        return self._protected

    @property
    def total_size(self) -> int:
        """Tokens in the tree.  O(1)."""
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root.  O(1)."""
        return self._num_nodes

    # ---------------------------------------------------------------- lookups

    def match_prefix(self, tokens: Any) -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens``.

        Splits the node where the match ends inside it, so that the returned node covers exactly
        the prefix (the set of cached sequences does not change), and marks the path as used.
        Runtime complexity: O(d + L/page_size) for d nodes on the path and L tokens, plus
        O(log n) to reorder the LRU; the token comparisons are memcmp.

        >>> tree = RadixTree(page_size=1)
        >>> _ = tree.insert([5, 6, 7], [0, 1, 2])
        >>> tree.match_prefix([5, 6, 8]).pages.tolist()
        [0, 1]
        """
        return self.match_bytes(as_token_bytes(tokens))

    def match_bytes(self, data: bytes, size: int | None = None) -> MatchResult:
        """``match_prefix``'s fast path: of token bytes already validated (``as_token_bytes``), of
        their first ``size`` bytes when given (no copy is made).  Same cost, without the conversion."""
        size = len(data) if size is None else size
        node, pos, path, cut = self.walk(data, size - size % self._page_bytes)
        if cut is not None:
            node = self._split(*cut)
            pos += cut[1] * self._page_bytes
            path.append(node)
        self._touch(path)
        pages = np.concatenate([n.pages for n in path]) if len(path) > 1 else (
            path[0].pages if path else _EMPTY_PAGES)
        return MatchResult(pos // 4, pages, node)

    def walk(self, data: bytes, end: int | None = None
             ) -> tuple[RadixNode, int, list[RadixNode], tuple[RadixNode, int] | None]:
        """Follow validated token bytes ``data[:end]`` (page-aligned; ``end`` defaults to all of
        it) down the tree without changing it (not even recency).  O(d + L/page_size).  Returns the deepest node matched whole, the bytes matched up to its end, the
        path without the root, and, when the match goes on inside a child, ``(child, pages)``: the
        split ``_split(child, pages)`` that makes the match end on a node (the caller decides
        whether to make it)."""
        pb = self._page_bytes
        node, pos, end = self._root, 0, len(data) if end is None else end
        path: list[RadixNode] = []
        while pos < end:
            child = node.children.get(data[pos:pos + pb])
            if child is None:
                break
            klen = len(child.key)
            if klen <= end - pos and data.startswith(child.key, pos):     # memcmp in place, no copy
                node, pos = child, pos + klen
                path.append(node)
                continue
            # The match ends inside child: find how many whole pages agree (binary search of
            # memcmp'd prefixes, views not copies; the first page agrees, the whole run does not).
            key = memoryview(child.key)
            lo, hi = 1, min(klen, end - pos) // pb
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if data.startswith(key[:mid * pb], pos):
                    lo = mid
                else:
                    hi = mid - 1
            return node, pos, path, (child, lo)
        return node, pos, path, None

    def _split(self, child: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``child`` after ``num_pages`` pages; return the new upper part."""
        cut = num_pages * self._page_bytes
        parent = child.parent
        assert parent is not None
        upper = RadixNode(child.key[:cut], child.pages[:num_pages], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.branched = True
        parent.children[child.key[:self._page_bytes]] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[num_pages:], upper
        upper.children[child.key[:self._page_bytes]] = child
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[RadixNode]) -> None:
        self._clock += 1
        stamp = self._clock
        for node in path:
            if node.lock_ref == 0 and not node.children:   # an evictable leaf: reorder it
                self._lru_drop(node)
                node.last_access = stamp
                self._lru_add(node)
            else:
                node.last_access = stamp

    def _lru_add(self, node: RadixNode) -> None:
        """Enter ``node`` (an evictable leaf, under its current stamp) in the LRU order.  O(log n)."""
        entry = self._lru_next
        self._lru_next = entry + 1
        node.lru_entry = entry
        heapq.heappush(self._lru, (node.last_access, node.serial, entry, node))
        self._lru_live += 1

    def _lru_drop(self, node: RadixNode) -> None:
        """Take ``node`` out of the LRU order: its entry dies where it is.  Amortised O(1)."""
        node.lru_entry = -1
        self._lru_live -= 1
        if len(self._lru) > 2 * self._lru_live + 64:
            self._lru = [item for item in self._lru if item[3].lru_entry == item[2]]
            heapq.heapify(self._lru)

    def _lru_pop(self) -> RadixNode | None:
        """Take the least recently used evictable leaf out of the order (``None``: there is none).
        O(log n) amortised."""
        heap = self._lru
        while heap:
            _, _, entry, node = heapq.heappop(heap)
            if node.lru_entry == entry:
                node.lru_entry = -1
                self._lru_live -= 1
                return node
        return None

    # ---------------------------------------------------------------- insert

    def insert(self, tokens: Any, pages: Any) -> InsertResult:
        """Cache ``tokens`` with their KV in ``pages`` (one page id per full page of tokens).

        A partial tail page is never cached: ``pages`` may have one more id for it, which is
        ignored.  Returns how many leading tokens were already cached: the caller owns ``pages``
        for those and must give them back (the tree keeps its own).  The caller must not pass a
        page that the tree already holds for another position.
        Runtime complexity: O(d + L/page_size + log n).

        >>> tree = RadixTree(page_size=1)
        >>> tree.insert([1, 2], [0, 1]).prefix_len, tree.insert([1, 2, 3], [5, 6, 2]).prefix_len
        (0, 2)
        """
        data = as_token_bytes(tokens)
        full = len(data) // self._page_bytes
        ids = as_page_ids(pages, np.iinfo(np.int64).max, "pages")
        if len(ids) not in (full, full + (len(data) % self._page_bytes > 0)):
            raise ValueError(f"pages: {len(data) // 4} tokens need {full} page ids "
                             f"(one more for a partial tail is allowed), got {len(ids)}")
        if has_duplicates(ids):
            raise ValueError("pages: the same page id is given more than once")
        return self.insert_bytes(data, ids[:full])

    def insert_bytes(self, data: bytes, pages: np.ndarray,
                     validate: Callable[[int, list[np.ndarray]], None] | None = None) -> InsertResult:
        """``insert``'s fast path: validated token bytes (``as_token_bytes``; they may go on past the
        pages) and exactly one page id per full page, none the tree holds for another position.
        Same cost.

        ``validate(prefix_bytes, path_pages)`` sees how many bytes are cached already and the page
        arrays of the nodes (or node parts) holding them, before anything changes, and may raise
        to abort: the tree is then exactly as it was (no split made).
        """
        pb = self._page_bytes
        end = len(pages) * pb                # data may go on past the pages: no copy is made
        node, pos, path, cut = self.walk(data, end)
        if validate is not None:
            path_pages = [n.pages for n in path]
            if cut is not None:
                path_pages.append(cut[0].pages[:cut[1]])
            validate(pos + (cut[1] * pb if cut is not None else 0), path_pages)
        if cut is not None:
            node = self._split(*cut)
            pos += cut[1] * pb
            path.append(node)
        self._touch(path)
        if pos < end:
            leaf = RadixNode(data[pos:end], pages[pos // pb:], node, self._clock)
            if node is not self._root and node.lock_ref == 0 and not node.children:
                self._lru_drop(node)                             # node stops being a leaf
            node.children[data[pos:pos + pb]] = leaf
            node.branched = True
            self._lru_add(leaf)
            self._evictable += len(leaf.key) >> 2
            self._num_nodes += 1
            node = leaf
        return InsertResult(pos // 4, node)

    # ---------------------------------------------------------------- locks

    def lock(self, node: RadixNode, *, trusted: bool = False) -> None:
        """Protect ``node`` and its ancestors from eviction (one reference each).  O(depth).

        Locking the root is a no-op.  ``trusted``: the caller got ``node`` from this tree and it
        is still in it, so the O(depth) check that it is (``contains``) is skipped.
        """
        if not trusted:
            self._check_handle(node, "node")
        self._lock(node)

    def unlock(self, node: RadixNode, *, trusted: bool = False) -> None:
        """Take back one reference from ``node`` and its ancestors.  O(depth).

        Raises ``ValueError`` (and changes nothing) if ``node`` is not locked.  ``trusted``: the
        caller holds a lock on ``node``, from this tree; the checks are skipped.
        """
        if not trusted:
            self._check_handle(node, "node")
            if node is not self._root and node.lock_ref <= 0:
                raise ValueError("node: unlock of a node that is not locked")
        self._unlock(node)

    def _lock(self, node: RadixNode, upto: RadixNode | None = None) -> RadixNode:
        """``lock`` of a node known to be in this tree (the caller got it from the tree), of it and
        its ancestors up to ``upto`` (not included) or the root; returns where it stopped."""
        root = self._root
        while node is not root and node is not upto:
            if node.lock_ref == 0:
                size = len(node.key) >> 2
                self._evictable -= size
                self._protected += size
                if not node.children:
                    self._lru_drop(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        return node

    def move_lock(self, old: RadixNode, new: RadixNode) -> None:
        """``lock(new)`` then ``unlock(old)``, trusted (both from this tree, ``old`` locked by the
        caller): where ``new`` is at or below ``old`` (a held prefix that grew) only the nodes in
        between change.  O(distance) then, O(depth) otherwise."""
        if self._lock(new, upto=old) is not old:     # new is not below old: its whole path is locked
            self._unlock(old)

    def _unlock(self, node: RadixNode) -> None:
        """``unlock`` of a locked node known to be in this tree."""
        root = self._root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.key) >> 2
                self._protected -= size
                self._evictable += size
                if not node.children:
                    self._lru_add(node)
            node = node.parent  # type: ignore[assignment]

    def _check_handle(self, node: Any, name: str) -> None:
        if not isinstance(node, RadixNode):
            raise TypeError(f"{name} must be a RadixNode, got {type(node).__name__}")
        if not self.contains(node):
            raise ValueError(f"{name} is not in this tree (evicted, or from another tree)")

    def contains(self, node: RadixNode) -> bool:
        """Whether ``node`` is in this tree (not evicted, not another tree's).  O(depth)."""
        top = node
        while top.parent is not None:
            top = top.parent
        return top is self._root

    # ---------------------------------------------------------------- eviction

    def evict(self, num_pages: int,
              on_evict: Callable[[RadixNode], None] | None = None) -> np.ndarray:
        """Free least-recently-used unlocked leaves until ``num_pages`` pages are free.

        Whole leaves are evicted, so a little more than ``num_pages`` may be freed; fewer only when
        nothing more is evictable.  ``on_evict(node)`` sees each node just before it is detached
        (its ``parent`` still set).  Returns the freed page ids; the caller gives them back to the
        pool.  Runtime complexity: O(log n) per evicted node.
        """
        check_int(num_pages, "num_pages")
        freed: list[np.ndarray] = []
        count = 0
        while count < num_pages:
            node = self._lru_pop()
            if node is None:
                break
            if on_evict is not None:
                on_evict(node)
            parent = node.parent
            assert parent is not None              # a leaf in the LRU order is in the tree
            del parent.children[node.key[:self._page_bytes]]
            node.parent = None
            freed.append(node.pages)
            count += len(node.pages)
            self._evictable -= len(node.key) >> 2
            self._num_nodes -= 1
            if parent is not self._root and parent.lock_ref == 0 and not parent.children:
                self._lru_add(parent)
        return np.concatenate(freed) if freed else _EMPTY_PAGES

    # ---------------------------------------------------------------- inspection

    def prefix_tokens(self, node: RadixNode) -> np.ndarray:
        """All token ids from the root to the end of ``node`` (int32).  O(depth + tokens)."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.frombuffer(b"".join(reversed(parts)), dtype="<i4")

    def prefix_pages(self, node: RadixNode) -> np.ndarray:
        """All page ids from the root to the end of ``node`` (int64).  O(depth + pages)."""
        parts = []
        while node.parent is not None:
            parts.append(node.pages)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else _EMPTY_PAGES

    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children.  O(n)."""
        out: list[RadixNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> np.ndarray:
        """Every page id the tree holds.  O(pages)."""
        parts = [n.pages for n in self.nodes()]
        return np.concatenate(parts) if parts else _EMPTY_PAGES

    def pretty(self, max_tokens: int = 6, max_pages: int = 4) -> str:
        """A text drawing of the tree: tokens, pages, and ``locked=N`` on nodes in use.  O(n)."""
        lines = ["root"]

        def show(node: RadixNode, indent: str) -> None:
            kids = sorted(node.children.values(), key=lambda c: c.key)
            for i, child in enumerate(kids):
                last = i == len(kids) - 1
                toks = child.token_ids
                head = " ".join(map(str, toks[:max_tokens].tolist())) + (" ..." if len(toks) > max_tokens else "")
                pages = " ".join(map(str, child.pages[:max_pages].tolist())) + (
                    " ..." if len(child.pages) > max_pages else "")
                lock = f", locked={child.lock_ref}" if child.lock_ref else ""
                lines.append(f"{indent}{'└── ' if last else '├── '}[{head}] {child.num_tokens} tokens, "
                             f"pages [{pages}]{lock}")
                show(child, indent + ("    " if last else "│   "))

        show(self._root, "")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the tree drawn as nested boxes (``radixkv.tools.viz.tree_html``)."""
        from radixkv.tools.viz import tree_html

        return tree_html(self)

    def __repr__(self) -> str:
        return (f"RadixTree(page_size={self.page_size}, {self._num_nodes} nodes, {self.total_size} tokens, "
                f"{self._protected} locked)")

    def check(self) -> None:
        """Assert every invariant (O(n + pages)); raises ``AssertionError`` naming the broken one.

        Keys are non-empty whole pages with one page id each; children are keyed by their first
        page and point back at their parent; a node's lock_ref is at least the sum of its
        children's; the size counters, the node count and the LRU order agree with a full walk;
        the LRU holds exactly the unlocked leaves, under their current access stamps; a node with
        children is marked ``branched``; no page id appears twice.
        """
        pb = self._page_bytes
        root = self._root
        assert root.parent is None and root.key == b"" and root.lock_ref == 1, "root altered"
        evictable = protected = count = 0
        leaves = {}
        pages = []
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, "child does not point back at its parent"
                assert len(child.key) >= pb and len(child.key) % pb == 0, "key is not whole pages"
                assert child.key[:pb] == first, "child filed under the wrong first page"
                assert len(child.pages) == len(child.key) // pb, "page count differs from key pages"
                assert child.lock_ref >= 0, "negative lock_ref"
                child_locks += child.lock_ref
                stack.append(child)
            if node is root:
                continue
            assert node.lock_ref >= child_locks, "lock_ref below the sum of the children's"
            assert node.branched or not node.children, "a node with children is not marked branched"
            count += 1
            pages.append(node.pages)
            if node.lock_ref:
                protected += node.num_tokens
            else:
                evictable += node.num_tokens
                if not node.children:
                    leaves[(node.last_access, node.serial)] = node
            assert (node.lru_entry >= 0) == (not node.lock_ref and not node.children), \
                "a node is in the LRU order but is not an unlocked leaf, or the other way round"
        assert count == self._num_nodes, f"node count {self._num_nodes} != {count}"
        assert evictable == self._evictable, f"evictable_size {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected_size {self._protected} != {protected}"
        live = {(stamp, serial): node for stamp, serial, entry, node in self._lru if node.lru_entry == entry}
        assert len(live) == self._lru_live, f"{self._lru_live} live LRU entries counted, {len(live)} found"
        assert leaves.keys() == live.keys(), "LRU order differs from the unlocked leaves"
        assert all(live[k] is v for k, v in leaves.items()), "LRU entry points at another node"
        assert len(self._lru) <= 2 * self._lru_live + 64, "dead LRU entries were not dropped"
        heap = self._lru
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "the LRU heap is out of order"
        flat = np.concatenate(pages) if pages else _EMPTY_PAGES
        assert np.unique(flat).size == flat.size, "a page id appears twice in the tree"
