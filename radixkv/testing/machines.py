"""Hypothesis strategies and state machines for the radix tree and the prefix cache.

Run them as they are (``TestTree = RadixTreeMachine.TestCase``), or subclass and override
``make_cache`` (``PrefixCacheMachine``) or ``make_tiers`` (``TieredPrefixCacheMachine``) to drive
your own configuration or backend through the same protocol and checks.

The reference model is deliberately plain: a dict from every cached page-aligned prefix (a tuple
of tokens) to the page id holding its last page, with the op stamp that last touched it.  Tiny
alphabets, page sizes 1–4 and pools of 4–16 pages make splits, shared prefixes and evictions
happen in a handful of steps; rules that re-request sequences seen before make splits of locked
nodes and tier loads that start inside a chunk happen in every run.

What the cache machines check: every match's pages hold the KV of the tokens it claims (the
"engine" writes each token's id and position into its slot), before and after the request runs;
a match covers what the pool holds, whole pages, and leaves the last token when asked; an
``EvictionModel`` follows the cache call by call, as ``_PrefixModel`` follows the tree, and checks
every eviction (by ``alloc``, ``evict`` or a tier load): least recently used unlocked leaves
first (the tree's stamping rule, ties allowed), exactly as many pages as were short, and
``evictable_size`` / ``protected_size`` agree with what the requests in flight hold — none of it
through ``check()``, so it holds for a cache whose ``check()`` is weak; ``hit_tokens`` is the
pool's plus the tiers' and agrees with a tally of the matches; no node is locked when no request
is in flight; ``check()`` notices a corrupted lock count or page.  With tiers, every chunk the pool
lets go counts as just used in the tier below (refreshed under ``write_through``, stored under
``write_back``; over a faulty tier, in the steps without a fault); with an exact tier (the default
``MemoryTier``) it is held there, so is every chunk the pool holds under ``write_through``, and it
comes back byte for byte, also into a tree match that ends inside a chunk.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.core.cache import Match, PoolExhausted, PrefixCache
from radixkv.core.pool import KVLayout
from radixkv.core.tree import RadixNode, RadixTree

__all__ = ["EvictionModel", "FaultyPrefixCacheMachine", "PrefixCacheMachine", "RadixTreeMachine",
           "TieredPrefixCacheMachine", "resident_tokens", "token_lists", "token_sequences"]


def token_lists(alphabet: int = 3, max_len: int = 12) -> st.SearchStrategy[list[int]]:
    """Token id lists over a tiny alphabet, so that prefixes are shared often."""
    return st.lists(st.integers(0, alphabet - 1), max_size=max_len)


def token_sequences(alphabet: int = 3, max_len: int = 12) -> st.SearchStrategy[Any]:
    """Token ids in every form the API accepts: list, tuple, numpy array (int32/int64), tensor."""
    return token_lists(alphabet, max_len).flatmap(lambda toks: st.sampled_from([
        toks, tuple(toks), np.array(toks, dtype=np.int32), np.array(toks, dtype=np.int64),
        torch.tensor(toks, dtype=torch.int64)]))


def _fail(message: str) -> None:
    raise AssertionError(message)


def resident_tokens(tree: RadixTree, tokens: list[int]) -> int:
    """How many leading tokens of ``tokens`` the tree holds (page-aligned), found by walking the
    nodes without touching, splitting or locking anything.  O(tokens)."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    pb = 4 * tree.page_size
    node, pos = tree.root, 0
    while pos + pb <= len(data):
        child = node.children.get(data[pos:pos + pb])
        if child is None:
            break
        pages = 0
        while ((pages + 1) * pb <= len(child.key) and pos + (pages + 1) * pb <= len(data)
               and data[pos + pages * pb:pos + (pages + 1) * pb] == child.key[pages * pb:(pages + 1) * pb]):
            pages += 1
        pos += pages * pb
        if pages * pb < len(child.key):
            break
        node = child
    return pos // 4


def _expect_check_fails(check: Any, what: str) -> None:
    try:
        check()
    except AssertionError:
        return
    _fail(f"check() passed with {what}: it does not check that invariant")


class _PrefixModel:
    """Every cached page-aligned prefix -> (page id of its last page, stamp of the last touch)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.entries: dict[tuple[int, ...], list[int]] = {}
        self.clock = 0

    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[:k * ps]) for k in range(1, len(tokens) // ps + 1)]

    def match(self, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix, touching it."""
        self.clock += 1
        pages = []
        for p in self.prefixes(tokens):
            if p not in self.entries:
                break
            self.entries[p][1] = self.clock
            pages.append(self.entries[p][0])
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Add the prefixes not yet cached; return how many pages were cached already."""
        known = len(self.match(tokens))
        for p, page in list(zip(self.prefixes(tokens), pages))[known:]:
            self.entries[p] = [page, self.clock]
        return known

    def evict_pages(self, freed: set[int], locked: set[tuple[int, ...]], asked: int) -> None:
        """Drop the prefixes whose pages were freed; check the eviction was a legal, minimal LRU one."""
        gone = {p for p, (page, _) in self.entries.items() if page in freed}
        if len(gone) != len(freed):
            _fail(f"evict freed {len(freed)} pages, {len(freed) - len(gone)} of them not cached")
        if gone & locked:
            _fail(f"evict freed the locked prefix {min(gone & locked, key=len)}")
        survivors = {p: v for p, v in self.entries.items() if p not in gone}
        for p in survivors:
            if p[:-self.page_size] not in survivors and len(p) != self.page_size:
                _fail(f"evict left the prefix {p} whose parent {p[:-self.page_size]} is gone")
        has_child = {p[:-self.page_size] for p in survivors}
        leaves = [v[1] for p, v in survivors.items() if p not in has_child and p not in locked]
        if gone and leaves:
            newest = max(self.entries[p][1] for p in gone)
            if newest > min(leaves):
                _fail(f"evict freed a prefix last used at step {newest} but kept an evictable leaf last used "
                      f"at step {min(leaves)}")
        if gone:
            # Leaves go in stamp order and the last one evicted carries the newest stamp: without
            # the pages of that stamp, fewer than ``asked`` pages were freed.
            newest = max(self.entries[p][1] for p in gone)
            last = sum(self.entries[p][1] == newest for p in gone)
            if len(gone) - last >= asked:
                _fail(f"evict({asked}) freed {len(gone)} pages; {len(gone) - last} of them were already enough")
        self.entries = survivors


Prefix = tuple[int, ...]
#: Token sequences held by live requests and pins, each with how many of its tokens are held.
Held = Iterable[tuple[Sequence[int], int]]


def _shortest(prefixes: Iterable[Prefix]) -> Prefix:
    return sorted(prefixes, key=len)[0]


def _resident(tree: RadixTree) -> dict[Prefix, tuple[int, Prefix]]:
    """Every page-aligned prefix the tree holds -> (the page id of its last page, the prefix its
    node ends at), found by walking the nodes without touching anything.  O(pages x tokens)."""
    ps = tree.page_size
    out: dict[Prefix, tuple[int, Prefix]] = {}
    stack: list[tuple[RadixNode, Prefix]] = [(child, ()) for child in tree.root.children.values()]
    while stack:
        node, start = stack.pop()
        toks = tuple(node.token_ids.tolist())
        end = start + toks
        for i, page in enumerate(node.pages.tolist()):
            out[start + toks[:(i + 1) * ps]] = (int(page), end)
        stack.extend((child, end) for child in node.children.values())
    return out


class EvictionModel:
    """Which prefixes an eviction may take, for the machines that drive a whole ``PrefixCache``.

    It keeps every page-aligned prefix the tree holds with the cache call that last used it, as
    ``RadixTree`` stamps them: a lookup or an insert stamps every node on its path (split where
    the path ends inside a node: both halves keep the stamp they had, and the upper one is on the
    path), a node an insert creates gets the insert's stamp, and locks, releases and evictions
    stamp nothing.  Stamps are call numbers, not the tree's clock: what one
    call touches shares its stamp, so the order inside a call and the tree's tie-break (node age)
    are never assumed.  Where the machine cannot tell whether a call touched a prefix (a load that
    may or may not have landed), ``touch_maybe`` makes its stamp a range ``lo..hi``.

    After each call the machine says what it used (``touch``: the prefix a match, open or insert
    covers; prefixes new in the call need no word) and which prefixes live requests hold, and
    ``observe`` compares the tree with the last observation.  Prefixes that left must be whole
    unlocked leaves, least recently used first (a parent once its children went): none may have
    been used later than an unlocked leaf that stayed (ties allowed).  Given how many pages the
    call had to free (``asked``: an int, or a function of the pages it inserted, for a tier load
    that takes pages for what it inserts), leaves go until that many are free and no further:
    without the last leaf evicted, there must not have been enough.  ``check_sizes`` checks the
    tree's ``evictable_size`` and ``protected_size`` against the held prefixes.
    Cost: O(pages x tokens) per call (the trees here are a few pages).
    """

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.call = 1
        self.stamps: dict[Prefix, tuple[int, int]] = {}     # resident prefix -> (lo, hi) call stamps
        self.pages: dict[Prefix, int] = {}                  # resident prefix -> page id, as last observed
        self.node: dict[Prefix, Prefix] = {}                # resident prefix -> where its node ended
        self.born: dict[Prefix, int] = {}                   # resident prefix -> the call that cached it
        self._touched: set[Prefix] = set()
        self._maybe: set[Prefix] = set()

    def prefixes(self, tokens: Sequence[int], n: int) -> list[Prefix]:
        """The page-aligned prefixes of ``tokens[:n]``, shortest first."""
        t = tuple(int(x) for x in tokens[:n])
        return [t[:k] for k in range(self.ps, len(t) - len(t) % self.ps + 1, self.ps)]

    def touch(self, tokens: Sequence[int], n: int) -> None:
        """The call being observed used the cached prefixes of ``tokens[:n]``."""
        self._touched.update(self.prefixes(tokens, n))

    def touch_maybe(self, tokens: Sequence[int], n: int) -> None:
        """The call being observed may have used the cached prefixes of ``tokens[:n]``."""
        self._maybe.update(self.prefixes(tokens, n))

    def locked(self, held: Held) -> set[Prefix]:
        """The page-aligned prefixes ``held`` holds (each item: tokens and how many of them are held):
        what no eviction may take.  O(pages x tokens) of what is held."""
        out: set[Prefix] = set()
        for tokens, n in held:
            out.update(self.prefixes(tokens, n))
        return out

    def evictable(self, held: Held) -> int:
        """Pages the tree holds (as last observed) that no live request or pin holds."""
        return len(self.pages.keys() - self.locked(held))

    def observe(self, tree: RadixTree, held: Held, asked: int | Callable[[int], int] | None, what: str) -> int:
        """Record the call ``what`` that just ran and check what it evicted (see the class
        docstring); ``held``: what live requests hold now; ``asked``: the pages it had to free
        (``None``: not modelled).  Returns the pages it evicted."""
        ps, c = self.ps, self.call
        self.call += 1
        now = _resident(tree)
        gone = {p for p, page in self.pages.items() if now.get(p, (-1,))[0] != page}
        new = [p for p in now if p not in self.pages or p in gone]
        old = {p: self.stamps[p] for p in gone}
        for p in self._maybe:
            if p in now and p in self.stamps and p not in gone:
                self.stamps[p] = (self.stamps[p][0], c)
        for p in [*self._touched, *new]:
            if p in now:
                self.stamps[p] = (c, c)
        for p in new:
            self.born[p] = c
        for p in gone - now.keys():
            del self.stamps[p], self.born[p]
        self._touched.clear()
        self._maybe.clear()
        before, self.pages, nodes = self.pages, {p: v[0] for p, v in now.items()}, self.node
        self.node = {p: v[1] for p, v in now.items()}
        if not gone and not asked:
            return 0
        locked = self.locked(held)
        if gone & locked:
            _fail(f"{what} evicted {list(_shortest(gone & locked))}, which a live request holds")
        for p in before:
            if p not in gone and p[:-ps] in gone:
                _fail(f"{what} evicted {list(p[:-ps])} but kept {list(p)}, which continues it: not a leaf")
        parents = {p[:-ps] for p in now}
        leaves = [p for p in now if p not in parents and p not in locked]
        need = asked(len(new)) if callable(asked) else asked
        if need is not None and len(gone) < need and leaves:
            _fail(f"{what} had to free {need} pages and evicted {len(gone)}, yet unlocked leaves are left, "
                  f"e.g. {list(leaves[0])}: it evicted too little")
        if not gone:
            return 0
        newest = max(old[g][0] for g in gone)
        last = max(gone, key=lambda g: old[g][0])
        for p in leaves:
            if self.stamps[p][1] < newest:
                _fail(f"{what} evicted {list(last)} (last used by call {newest}) but kept the unlocked leaf "
                      f"{list(p)} (last used by call {self.stamps[p][1]}): not least recently used first")
        if need is not None:
            # The leaf evicted last: a whole leaf (the gone part of a node) whose parent stayed and
            # that no other evicted prefix was used after.  Without it, fewer than `need` pages.
            parts: dict[Prefix, list[Prefix]] = {}
            for g in gone:
                parts.setdefault(nodes[g], []).append(g)
            lasts = [len(part) for part in parts.values()
                     if _shortest(part)[:-ps] not in gone and max(old[g][1] for g in part) >= newest]
            if not lasts or len(gone) - max(lasts) >= need:
                _fail(f"{what} had to free {need} pages and evicted {len(gone)}: without its last leaf "
                      f"({max(lasts, default=0)} pages) it had freed enough; it evicted more than needed")
        return len(gone)

    def leaf(self, held: Held, made: bool = False) -> tuple[Prefix, int]:
        """An unheld leaf (as last observed) and where a prefix of it may end: the one cached first
        (``made``; the longest of those), used whole; or a least recently used one of those with an
        unheld page before their last, and the first page a prefix of it may end at (past what
        live requests hold, not before its node: a match there splits the node, or uses its
        parent).  ``((), 0)`` if there is none."""
        locked = self.locked(held)
        parents = {p[:-self.ps] for p in self.pages}
        leaves = self.pages.keys() - parents - locked
        if made:
            leaf = min(leaves, key=lambda p: (self.born[p], -len(p)), default=())
            return leaf, len(leaf) // self.ps
        cuts = {}
        for leaf in leaves:
            prefixes = self.prefixes(leaf, len(leaf))
            low = max(sum(p in locked for p in prefixes) + 1, sum(self.node[p] != leaf for p in prefixes))
            if low < len(prefixes):
                cuts[leaf] = low
        leaf = min(cuts, key=lambda p: (self.stamps[p][1], -len(p)), default=())
        return leaf, cuts.get(leaf, 0)

    def is_leaf(self, prefix: Prefix) -> bool:
        """Whether the tree holds ``prefix`` and nothing that continues it (as last observed)."""
        return prefix in self.pages and not any(len(p) > len(prefix) and p[:len(prefix)] == prefix for p in self.pages)

    def check_sizes(self, tree: RadixTree, held: Held) -> None:
        """The tree's ``evictable_size`` and ``protected_size`` agree with the prefixes it holds
        (as last observed) and those live requests hold."""
        locked = self.locked(held)
        if not locked <= self.pages.keys():
            _fail(f"the prefix {list(_shortest(locked - self.pages.keys()))} is held, but the tree lacks it")
        evictable, protected = (len(self.pages) - len(locked)) * self.ps, len(locked) * self.ps
        if (tree.evictable_size, tree.protected_size) != (evictable, protected):
            _fail(f"evictable_size {tree.evictable_size}, protected_size {tree.protected_size}: the tree holds "
                  f"{len(self.pages)} pages and live requests hold {len(locked)} of them, so {evictable} and "
                  f"{protected} tokens")


class RadixTreeMachine(RuleBasedStateMachine):
    """``RadixTree`` against ``_PrefixModel``, with ``check()`` after every step."""

    @initialize(page_size=st.integers(1, 4), start=st.lists(token_lists(), max_size=4))
    def setup(self, page_size: int, start: list[list[int]]) -> None:
        """A tree with a few sequences in it already: every run orders, touches and evicts
        leaves, whichever rules it draws after (an empty tree checks little of LRU order)."""
        self.tree = RadixTree(page_size)
        self.model = _PrefixModel(page_size)
        self.page_ids = itertools.count()
        self.locked: list[tuple[RadixNode, tuple[int, ...]]] = []
        self.seen: list[list[int]] = []
        for tokens in start:
            self.insert(tokens)

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        for _, prefix in self.locked:
            out.update(self.model.prefixes(list(prefix)))
        return out

    def _match(self, tokens: Any, lock: bool) -> None:
        toks = list(map(int, tokens))
        result = self.tree.match_prefix(tokens)
        expected = self.model.match(toks)
        if result.pages.tolist() != expected:
            _fail(f"match_prefix({toks}) gave pages {result.pages.tolist()}, the model {expected}")
        if result.num_tokens != len(expected) * self.tree.page_size:
            _fail(f"match_prefix({toks}) gave num_tokens {result.num_tokens} for {len(expected)} pages")
        if self.tree.prefix_tokens(result.node).tolist() != toks[:result.num_tokens]:
            _fail(f"match_prefix({toks}) returned a node that ends {self.tree.prefix_tokens(result.node).tolist()}")
        if self.tree.prefix_pages(result.node).tolist() != expected:
            _fail(f"prefix_pages of the node of {toks} is {self.tree.prefix_pages(result.node).tolist()}")
        if lock:
            self.tree.lock(result.node)
            self.locked.append((result.node, tuple(toks[:result.num_tokens])))

    @rule(tokens=token_sequences())
    def insert(self, tokens: Any) -> None:
        """Insert ``tokens`` with fresh page ids, in the tree and in the model: the tree says as many
        leading tokens were cached already as the model.  Cost: one ``insert``, and O(pages x tokens)
        in the model."""
        toks = list(map(int, tokens))
        pages = [next(self.page_ids) for _ in range(len(toks) // self.tree.page_size)]
        expected = self.model.insert(toks, pages) * self.tree.page_size
        got = self.tree.insert(tokens, pages).prefix_len
        if got != expected:
            _fail(f"insert({toks}) says {got} tokens were cached already, the model {expected}")
        if pages:
            self.seen.append(toks)

    @rule(tokens=token_sequences(), lock=st.booleans())
    def match(self, tokens: Any, lock: bool) -> None:
        """Match ``tokens`` (and maybe lock its node): the pages, the token count, the node's tokens
        and its path's pages are the model's longest cached prefix, which it touches.  Cost: one
        ``match_prefix``, and O(pages x tokens) in the model."""
        self._match(tokens, lock)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), lock=st.booleans())
    def match_seen_prefix(self, data: st.DataObject, lock: bool) -> None:
        """A prefix of a sequence inserted before, cut anywhere and maybe extended: splits nodes."""
        seq = data.draw(st.sampled_from(self.seen), label="seen")
        cut = data.draw(st.integers(0, len(seq)), label="cut")
        self._match(seq[:cut] + data.draw(token_lists(max_len=3), label="extra"), lock)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def split_a_locked_node(self, data: st.DataObject) -> None:
        """Lock a whole seen sequence, then match a shorter prefix of it: the split node is locked."""
        seq = data.draw(st.sampled_from(self.seen), label="seen")
        self._match(seq, lock=True)
        pages = len(seq) // self.tree.page_size
        if pages > 1:
            cut = data.draw(st.integers(1, pages - 1), label="pages") * self.tree.page_size
            self._match(seq[:cut], lock=data.draw(st.booleans(), label="lock"))
        self.tree.check()

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        """Unlock one of the nodes a match locked.  Cost: one ``unlock``, O(depth)."""
        i = data.draw(st.integers(0, len(self.locked) - 1))
        node, _ = self.locked.pop(i)
        self.tree.unlock(node)

    @rule(num_pages=st.integers(0, 6))
    def evict(self, num_pages: int) -> None:
        """Evict ``num_pages`` pages: at least as many as asked or every evictable one, no page twice,
        least recently used unlocked leaves first and no more than needed (the model checks).  Cost:
        one ``evict``, and O(pages x tokens) in the model."""
        evictable = self.tree.evictable_size // self.tree.page_size
        freed = self.tree.evict(num_pages)
        if not (freed.size >= min(num_pages, evictable) or freed.size == evictable):
            _fail(f"evict({num_pages}) freed {freed.size} pages with {evictable} evictable")
        if np.unique(freed).size != freed.size:
            _fail(f"evict({num_pages}) freed a page twice: {freed.tolist()}")
        self.model.evict_pages(set(freed.tolist()), self._locked_prefixes(), num_pages)

    @rule()
    def unlock_unlocked_is_an_error(self) -> None:
        """Unlock a child of the root that nobody holds: ``ValueError``, and the sizes unchanged.
        Cost: one ``unlock``, O(children of the root)."""
        node = self.tree.root
        for child in node.children.values():
            if child.lock_ref == 0:
                node = child
        if node is not self.tree.root:
            before = (self.tree.evictable_size, self.tree.protected_size)
            try:
                self.tree.unlock(node)
            except ValueError:
                pass
            else:
                _fail("unlock of an unlocked node did not raise")
            if (self.tree.evictable_size, self.tree.protected_size) != before:
                _fail("a failed unlock changed the sizes")

    @precondition(lambda self: self.tree.num_nodes > 0)
    @rule()
    def check_detects_corruption(self) -> None:
        """``check()`` must notice a wrong lock count and a page id held twice (restored after)."""
        nodes = self.tree.nodes()
        for node in [n for n in nodes if n.lock_ref == 0][:1]:   # a lock no size counter knows of
            node.lock_ref += 1
            try:
                _expect_check_fails(self.tree.check, f"lock_ref of {node!r} one too high")
            finally:
                node.lock_ref -= 1
        if len(nodes) > 1:
            other, pages = nodes[1], nodes[0].pages
            nodes[0].pages = np.concatenate([other.pages[:1], pages[1:]])
            try:
                _expect_check_fails(self.tree.check, "one page id in two nodes")
            finally:
                nodes[0].pages = pages

    @invariant()
    def consistent(self) -> None:
        """After every step: the tree's ``check()``; ``total_size`` is the model's pages; every node's
        lock count is the number of held paths through it; and the whole LRU order holds (a copy of the
        tree evicted a page at a time, each eviction checked by the model).  Cost: a copy of the tree
        and O(pages^2 x tokens) in the model (the trees here are a few pages)."""
        if hasattr(self, "tree"):
            self.tree.check()
            if self.tree.total_size != len(self.model.entries) * self.tree.page_size:
                _fail(f"total_size {self.tree.total_size}, the model caches {len(self.model.entries)} pages")
            self._locks_match_the_holds()
            self._evicts_in_lru_order()

    def _evicts_in_lru_order(self) -> None:
        """Evicting a copy of the tree one page at a time, down to what the holds protect, takes
        the least recently used evictable leaf each time: the whole LRU order, checked after every
        step without changing the tree (one ``evict`` rule sees only the pages it frees)."""
        tree, model = copy.deepcopy(self.tree), copy.deepcopy(self.model)
        locked = self._locked_prefixes()
        while tree.evictable_size:
            freed = tree.evict(1)
            if freed.size == 0:
                _fail(f"evict(1) of a copy freed nothing with {tree.evictable_size} tokens evictable")
            model.evict_pages(set(freed.tolist()), locked, 1)
        if set(model.entries) - locked:
            _fail(f"with everything evictable evicted the tree still holds the unheld prefix "
                  f"{_shortest(set(model.entries) - locked)}")

    def _locks_match_the_holds(self) -> None:
        """Every node's lock count is the number of held paths through it, and ``protected_size``
        the tokens on the union of those paths: what the machine holds, not what ``check()``
        accepts (a count at least its children's would let a lock left behind pass)."""
        through: dict[int, int] = {}
        nodes: dict[int, RadixNode] = {}
        for node, prefix in self.locked:
            path: RadixNode | None = node
            while path is not None and path is not self.tree.root:
                through[id(path)] = through.get(id(path), 0) + 1
                nodes[id(path)] = path
                path = path.parent
            if node is not self.tree.root and self.tree.prefix_tokens(node).tolist() != list(prefix):
                _fail(f"a held node ends {self.tree.prefix_tokens(node).tolist()}, held for {list(prefix)}")
        for node in self.tree.nodes():
            if node.lock_ref != through.get(id(node), 0):
                _fail(f"{node!r} has lock count {node.lock_ref}; {through.get(id(node), 0)} held paths run through it")
        protected = sum(len(n.pages) for n in nodes.values()) * self.tree.page_size
        if self.tree.protected_size != protected:
            _fail(f"protected_size {self.tree.protected_size}, but the held paths cover {protected} tokens")


class PrefixCacheMachine(RuleBasedStateMachine):
    """``PrefixCache`` driven through the engine protocol, with page accounting and content checks.

    The "engine" writes each token's id and position into its KV slot, so every match can check that
    the pages it returns really hold the tokens it claims.  An ``EvictionModel`` follows every call:
    each eviction (by ``alloc``, ``evict`` or a tier load) must take least recently used unlocked
    leaves and exactly as many pages as needed, and ``evictable_size`` must agree with what the
    requests in flight hold.  Override ``make_cache`` to test another configuration; ``max_len``
    bounds the token lists.
    """

    max_len = 14

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        """The cache under test: ``num_pages`` pages of ``page_size`` tokens, one layer with one KV
        head of two values (a token's id and position), chunks of two pages, no tiers.  Override it to
        drive another configuration.  O(num_pages)."""
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * 2)

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(4, 16))
    def setup(self, page_size: int, num_pages: int) -> None:
        """The run's cache (``make_cache``), with an empty ``EvictionModel`` and tally and no request in
        flight.  Cost: ``make_cache``'s."""
        self.cache = self.make_cache(page_size, num_pages)
        self.ps = page_size
        self.requests: list[tuple[list[int], Match, torch.Tensor]] = []   # in flight: tokens, match, new pages
        self.seen: list[list[int]] = []                                   # sequences inserted
        self.tally = {"matches": 0, "query_tokens": 0, "hit_tokens": 0, "pool_hit_tokens": 0}
        self.model = EvictionModel(page_size)
        self.holds: dict[int, tuple[list[int], int]] = {}                 # live match id -> its tokens, held

    # -- the engine's side ------------------------------------------------------------------------

    def _write_kv(self, tokens: list[int], start: int, pages: torch.Tensor) -> None:
        """The engine's prefill: KV of token t at position i is (t, i)."""
        kv = self.cache.pool.kv
        for j, page in enumerate(pages.tolist()):
            for k in range(self.ps):
                pos = start + j * self.ps + k
                if pos < len(tokens):
                    kv[:, :, page, k, :, 0] = tokens[pos]
                    kv[:, :, page, k, :, 1] = pos

    def _assert_holds(self, tokens: list[int], match: Match, when: str = "") -> None:
        kv = self.cache.pool.kv[0, 0, match.pages.long()]          # [pages, page_size, 1, 2]
        got = kv.reshape(-1, 2)
        want = torch.tensor([[t, i] for i, t in enumerate(tokens[:match.num_tokens])], dtype=torch.float32)
        if not torch.equal(got, want.reshape(-1, 2)):
            bad = next(i for i in range(len(got)) if not torch.equal(got[i], want.reshape(-1, 2)[i]))
            _fail(f"{match!r} of {tokens}{when}: token {bad} is {tokens[bad]} at position {bad}, but its page "
                  f"{match.pages[bad // self.ps].item()} holds KV of token {got[bad, 0].item():g} at position "
                  f"{got[bad, 1].item():g}")

    def _observe(self, what: str, asked: int | Callable[[int], int] | None = 0) -> int:
        """``EvictionModel.observe`` of the call ``what`` that just ran; the pages it evicted."""
        return self.model.observe(self.cache.tree, self.holds.values(), asked, what)

    def _loading(self) -> Callable[[int], int]:
        """What a match may evict: a tier load takes a page for each page it inserts, less the free ones."""
        free = self.cache.pool.num_free
        return lambda new: max(0, new - free)

    def _match(self, tokens: list[int], leave_last: bool = True) -> Match:
        limit = len(tokens) - (1 if leave_last and tokens else 0)
        resident = min(resident_tokens(self.cache.tree, tokens), limit // self.ps * self.ps)
        asked = self._loading()
        m = self.cache.match(tokens, leave_last=leave_last)
        self.holds[m.id] = (tokens, m.num_tokens)
        self.model.touch(tokens, m.num_tokens)
        self._observe(f"match({tokens}, leave_last={leave_last})", asked)
        if m.num_tokens % self.ps or m.num_tokens > limit:
            _fail(f"match({tokens}, leave_last={leave_last}) covers {m.num_tokens} tokens")
        if m.num_tokens < resident:
            _fail(f"match({tokens}, leave_last={leave_last}) covers {m.num_tokens} tokens; the pool held {resident}")
        if sum(m.tier_tokens_by_tier) != m.tier_tokens:
            _fail(f"{m!r}: tier_tokens_by_tier {m.tier_tokens_by_tier} do not add up to tier_tokens {m.tier_tokens}")
        self._assert_holds(tokens, m)
        t = self.tally
        t["matches"] += 1
        t["query_tokens"] += len(tokens)
        t["hit_tokens"] += m.num_tokens
        t["pool_hit_tokens"] += m.num_tokens - m.tier_tokens
        return m

    def _release(self, m: Match) -> None:
        self.cache.release(m)
        del self.holds[m.id]

    def _insert(self, tokens: list[int], pages: torch.Tensor) -> None:
        self.cache.insert(tokens, pages)
        self.model.touch(tokens, len(tokens))
        self._observe(f"insert({tokens})")

    def _evict(self, n: int) -> int:
        freed = self.cache.evict(n)
        gone = self._observe(f"evict({n})", n)
        if gone != freed:
            _fail(f"evict({n}) says it freed {freed} pages; the tree lost {gone}")
        return freed

    def _alloc(self, n: int) -> torch.Tensor:
        """``cache.alloc(n)``, checking that it evicts what it must and no more (``EvictionModel``)."""
        before = self.cache.stats()
        try:
            new = self.cache.alloc(n)
        except PoolExhausted:
            self._observe(f"a refused alloc({n})")
            after = self.cache.stats()
            if after["pages_free"] != before["pages_free"] or after["evicted_pages"] != before["evicted_pages"]:
                _fail(f"alloc({n}) raised PoolExhausted but evicted or took pages on the way")
            evictable = self.model.evictable(self.holds.values())
            if before["pages_free"] + evictable >= n:
                _fail(f"alloc({n}) raised PoolExhausted with {before['pages_free']} free pages and {evictable} "
                      "cached that no request holds")
            raise
        if len(new) != n:
            _fail(f"alloc({n}) returned {len(new)} pages")
        if self.cache.pool.is_free(new).any():
            _fail(f"alloc({n}) returned pages {new.tolist()}, some of which the pool says are free")
        gone = self._observe(f"alloc({n}) with {before['pages_free']} pages free", max(0, n - before["pages_free"]))
        evicted = self.cache.stats()["evicted_pages"] - before["evicted_pages"]
        if evicted != gone:
            _fail(f"alloc({n}): stats count {evicted} evicted pages, the tree lost {gone}")
        return new

    def _prefill(self, tokens: list[int]) -> bool:
        """One whole request: match, alloc, write, insert, release.  False if the pool is full."""
        m = self._match(tokens)
        try:
            new = self._alloc(-(-len(tokens) // self.ps) - len(m.pages))
        except PoolExhausted:
            self._release(m)
            return False
        self._write_kv(tokens, m.num_tokens, new)
        self._insert(tokens, torch.cat([m.pages, new]))
        self._release(m)
        self._saw(tokens)
        return True

    def _saw(self, tokens: list[int]) -> None:
        if len(tokens) >= self.ps and tokens not in self.seen:
            self.seen.append(tokens)

    def _tokens(self, data: st.DataObject) -> list[int]:
        """Fresh tokens, or (once there are some) a seen sequence cut anywhere and extended."""
        reuse: bool = bool(self.seen) and data.draw(st.booleans(), label="reuse a seen prefix")
        if reuse:
            seq = data.draw(st.sampled_from(self.seen), label="seen")
            return seq[:data.draw(st.integers(0, len(seq)), label="cut")] + data.draw(token_lists(max_len=4),
                                                                                     label="extra")
        return data.draw(token_lists(max_len=self.max_len), label="tokens")

    # -- rules ------------------------------------------------------------------------------------

    @rule(data=st.data(), leave_last=st.booleans())
    def start_request(self, data: st.DataObject, leave_last: bool) -> None:
        """Start a request on fresh tokens or on a seen sequence cut anywhere and extended: match
        (leaving the last token or not), allocate the pages it lacks and write their KV; it stays in
        flight, holding its pages, until ``finish_request``.  A refused ``alloc`` releases the match.
        Each call is checked against the ``EvictionModel``.  Cost: one ``match`` and one ``alloc``, and
        O(pages x tokens) in the model."""
        tokens = self._tokens(data)
        m = self._match(tokens, leave_last)
        need = -(-len(tokens) // self.ps) - len(m.pages)
        try:
            new = self._alloc(need)
        except PoolExhausted:
            self._release(m)
            return
        self._write_kv(tokens, m.num_tokens, new)
        self.requests.append((tokens, m, new))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), abort=st.booleans(), part_first=st.booleans())
    def finish_request(self, data: st.DataObject, abort: bool, part_first: bool) -> None:
        """Insert (or abort) a request in flight.  With ``part_first`` another request caches part
        of its tokens first, past what it holds: its insert then continues a leaf it does not hold
        (and frees its own pages for what the tree has meanwhile)."""
        tokens, m, new = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if part_first and len(tokens) >= m.num_tokens + self.ps:
            self._prefill(tokens[:data.draw(st.integers(m.num_tokens + self.ps, len(tokens)), label="part")])
        self._assert_holds(tokens, m, " while its request ran (its pages were evicted or reused)")
        if abort:
            self.cache.free(new)
        else:
            self._insert(tokens, torch.cat([m.pages, new]))
            self._saw(tokens)
        self._release(m)
        self.cache.flush()        # the writer is asynchronous; keep the test deterministic
        again = self._match(tokens, leave_last=False)
        if not abort and again.num_tokens != len(tokens) // self.ps * self.ps:
            _fail(f"right after insert({tokens}), match covers {again.num_tokens} tokens")
        self._release(again)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def rerun_a_seen_request(self, data: st.DataObject) -> None:
        """A prefix of a seen sequence as a whole request, while another seen one holds its match:
        splits nodes, locked ones included."""
        held = self._match(data.draw(st.sampled_from(self.seen), label="held"))
        seq = data.draw(st.sampled_from(self.seen), label="seen")
        self._prefill(seq[:data.draw(st.integers(1, len(seq)), label="cut")])
        self._release(held)

    @rule(data=st.data())
    def split_a_held_prefix(self, data: st.DataObject) -> None:
        """Cache a sequence of a few pages (or take a seen one), hold all of it, then run a request
        for a prefix that ends inside its node: the split node is held, its lock count must carry
        over (``check()`` runs right after)."""
        ps = self.ps
        long_enough = [s for s in self.seen if len(s) >= 2 * ps]
        reuse: bool = bool(long_enough) and data.draw(st.booleans(), label="a seen sequence")
        if reuse:
            seq = data.draw(st.sampled_from(long_enough), label="seen")
        else:
            seq = data.draw(st.lists(st.integers(0, 2), min_size=2 * ps, max_size=4 * ps), label="tokens")
            if not self._prefill(seq):
                return
        held = self._match(seq, leave_last=False)
        pages = held.num_tokens // ps
        if pages >= 2:
            cut = data.draw(st.integers(1, pages - 1), label="cut pages") * ps
            inner = self._match(seq[:cut], leave_last=False)
            self.cache.check()
            self._release(inner)
        self._release(held)

    @precondition(lambda self: self.cache.tree.num_nodes > 0)
    @rule(data=st.data(), made=st.booleans(), via_alloc=st.booleans())
    def use_a_leaf_then_evict(self, data: st.DataObject, made: bool, via_alloc: bool) -> None:
        """Recency decides what goes.  Cache a sequence on another branch (a leaf to outlive), use a
        prefix of a leaf's sequence, then free a page or two more than the rest of the leaf holds,
        by ``evict`` or by an ``alloc`` that is that short: the rest goes first, and what was used
        must outlive every leaf used before it (``EvictionModel``).  The leaf is a least recently
        used one and the prefix ends inside its node (which splits: the upper half, used now, has
        the lower as its child) or where its node starts (its parent is used); or (``made``) it is
        the leaf cached first, used whole."""
        ps, held = self.ps, self.holds.values()
        leaf, low = self.model.leaf(held, made)
        if not leaf:
            return
        self._prefill(self._elsewhere(leaf, data))
        if not self.model.is_leaf(leaf):                    # the other request evicted it
            return
        pages = len(leaf) // ps
        cut = pages if made else data.draw(st.integers(low, pages - 1), label="cut pages")
        self._release(self._match(list(leaf[:cut * ps]), leave_last=False))
        more = self.model.evictable(held) - (pages - cut)          # what may go after the rest
        if more <= 0:
            return
        n = pages - cut + data.draw(st.integers(1, min(2, more)), label="pages more")
        if via_alloc:
            self.cache.free(self._alloc(self.cache.pool.num_free + n))
        else:
            self._evict(n)
        self.cache.flush()

    def _elsewhere(self, prefix: Sequence[int], data: st.DataObject) -> list[int]:
        """A page or two of tokens that do not start like ``prefix`` (another branch of the tree)."""
        first = (prefix[0] + data.draw(st.integers(1, 2), label="first")) % 3
        return [first] + data.draw(st.lists(st.integers(0, 2), min_size=self.ps - 1, max_size=2 * self.ps - 1),
                                   label="another")

    @rule()
    def pool_double_free_is_an_error(self) -> None:
        """The pool itself refuses to free a free page (and changes nothing)."""
        pool = self.cache.pool
        free = np.flatnonzero(pool.is_free(np.arange(pool.num_pages)))
        if not free.size:
            return
        before = pool.num_free
        try:
            pool.free(free[:1])
        except ValueError:
            pass
        else:
            _fail(f"KVPool.free of the free page {int(free[0])} did not raise")
        if pool.num_free != before:
            _fail(f"a refused KVPool.free changed num_free from {before} to {pool.num_free}")

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        """Evict ``num_pages`` pages: it frees at least that many (or every evictable page) and no more
        than are evictable, least recently used unheld leaves first and no more than needed
        (``EvictionModel``), and its count is the pages the tree lost.  Cost: one ``evict`` and one
        ``flush``, and O(pages x tokens) in the model."""
        evictable = self.model.evictable(self.holds.values())
        freed = self._evict(num_pages)
        if not min(num_pages, evictable) <= freed <= evictable:
            _fail(f"evict({num_pages}) freed {freed} pages with {evictable} evictable")
        self.cache.flush()

    @rule(tokens=token_lists(max_len=14))
    def release_twice_is_an_error(self, tokens: list[int]) -> None:
        """Match ``tokens`` and release the match, then release it again: ``ValueError``, and ``stats()``
        unchanged.  Cost: one ``match``, two ``release`` calls and one ``flush``."""
        m = self._match(tokens)
        self._release(m)
        self.cache.flush()          # a match may evict, and evictions queue tier work: let it finish
        before = self.cache.stats()
        try:
            self.cache.release(m)
        except ValueError:
            pass
        else:
            _fail("a second release did not raise")
        if self.cache.stats() != before:
            _fail("a failed release changed the stats")

    @rule()
    def free_twice_is_an_error(self) -> None:
        """Allocate a page and free it, then free it again: ``ValueError``, and the free page count
        unchanged (nothing when the pool has no page to give).  Cost: one ``alloc`` and two ``free``
        calls."""
        try:
            new = self._alloc(1)
        except PoolExhausted:
            return
        self.cache.free(new)
        before = self.cache.stats()
        try:
            self.cache.free(new)
        except ValueError:
            pass
        else:
            _fail(f"a second free of page {new.tolist()} did not raise")
        if self.cache.stats()["pages_free"] != before["pages_free"]:
            _fail("a failed free changed the free page count")

    @precondition(lambda self: self.cache.tree.num_nodes > 0)
    @rule()
    def check_detects_corruption(self) -> None:
        """``check()`` must notice a lock count that no request explains (restored after), on a node
        a match holds: only the cache knows how many requests hold it."""
        node = self.cache.tree.nodes()[-1]
        held = self._match(self.cache.tree.prefix_tokens(node).tolist(), leave_last=False)
        node.lock_ref += 1
        try:
            _expect_check_fails(self.cache.check, f"lock_ref of a held {node!r} one too high")
        finally:
            node.lock_ref -= 1
            self._release(held)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        """After every step: the cache's ``check()``; nothing changed the tree since the step's last
        call, and ``evictable_size`` and ``protected_size`` agree with what the requests in flight hold
        (``EvictionModel``); free, cached and engine pages add up to the pool; the engine's pages and
        the live matches are the requests in flight's; the hit counters are the tally of the matches
        made and add up over the pool and the tiers.  Cost: ``check()``, one ``stats()``, and
        O(pages x tokens) in the model."""
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        self._observe("nothing (between steps)")
        self.model.check_sizes(self.cache.tree, self.holds.values())
        s = self.cache.stats()
        if s["pages_free"] + s["pages_cached"] + s["pages_engine"] != s["pages_total"]:
            _fail(f"pages free {s['pages_free']} + cached {s['pages_cached']} + engine {s['pages_engine']} != "
                  f"total {s['pages_total']}")
        engine = sum(len(new) for _, _, new in self.requests)
        if s["pages_engine"] != engine:
            _fail(f"stats say the engine holds {s['pages_engine']} pages; the requests in flight hold {engine}")
        if s["live_matches"] != len(self.requests):
            _fail(f"stats say {s['live_matches']} live matches; {len(self.requests)} requests are in flight")
        for name, value in self.tally.items():
            if s[name] != value:
                _fail(f"stats()[{name!r}] is {s[name]}; the matches made add up to {value}")
        if s["hit_tokens"] != s["pool_hit_tokens"] + s["tier_hit_tokens"]:
            _fail(f"hit_tokens {s['hit_tokens']} != pool {s['pool_hit_tokens']} + tiers {s['tier_hit_tokens']}")
        if s["levels"][0]["hit_tokens"] != s["pool_hit_tokens"]:
            _fail(f"levels[0] hit_tokens {s['levels'][0]['hit_tokens']} != pool_hit_tokens {s['pool_hit_tokens']}")
        if "tier_hit_tokens_by_tier" in s and sum(s["tier_hit_tokens_by_tier"]) != s["tier_hit_tokens"]:
            _fail(f"tier_hit_tokens_by_tier {s['tier_hit_tokens_by_tier']} do not add up to {s['tier_hit_tokens']}")

    @invariant()
    def nothing_locked_when_idle(self) -> None:
        """With no request in flight, no node is locked and ``protected_size`` is 0.  O(nodes)."""
        if not hasattr(self, "cache") or self.requests:
            return
        locked = [n for n in self.cache.tree.nodes() if n.lock_ref]
        if locked or self.cache.tree.protected_size:
            _fail(f"no request is in flight, yet {locked[:3]} are locked "
                  f"(protected_size {self.cache.tree.protected_size})")


class TieredPrefixCacheMachine(PrefixCacheMachine):
    """``PrefixCacheMachine`` with tiers below the pool (chunks of two or three pages), so that
    evicted prefixes come back through them: every match still checks, token by token, that the
    pages it returns hold the right KV, whether they were resident or loaded (tails included: the
    tokens past a prefix's last chunk boundary, stored when the pool evicts where prefixes part).

    Override ``make_tiers`` to put your own backend under the same checks.  With ``exact_tiers``
    (the default: ``MemoryTier`` never evicts), the machine also checks recall: every chunk the
    pool lets go reaches the tiers (refreshed or stored) and a later match brings back every chunk
    the pool has room for, also when the tree's match ends inside a chunk.  Set it ``False`` for a
    bounded or faulty tier.  ``exclusive = True`` builds the cache with ``exclusive=True`` (volatile
    local tiers hold only what the pool evicted); the same checks hold.
    """

    write_policy = "write_through"
    exclusive = False
    exact_tiers = True
    max_len = 20

    def make_tiers(self) -> list[Any]:
        """The tiers below the pool, top first: one ``MemoryTier`` (exact).  Override it to put your own
        backend under the same checks (``exact_tiers = False`` for a bounded or faulty one).  O(1)."""
        from radixkv.backends import MemoryTier

        return [MemoryTier()]

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        """``PrefixCacheMachine.make_cache``'s cache over ``make_tiers()``, each wrapped in a
        ``RecordingTier``: chunks of ``chunk_pages`` pages, the class's ``write_policy`` and
        ``exclusive``.  Cost: ``make_tiers`` and O(num_pages)."""
        from radixkv.testing.contract import RecordingTier

        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        self.recorders = [RecordingTier(t) for t in self.make_tiers()]
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * self.chunk_pages,
                           tiers=self.recorders, write_policy=self.write_policy, write_queue=4096,
                           exclusive=self.exclusive)

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(6, 16), chunk_pages=st.integers(2, 3))
    def setup(self, page_size: int, num_pages: int, chunk_pages: int) -> None:   # type: ignore[override]
        """``PrefixCacheMachine.setup`` with chunks of two or three pages; nothing resident yet, and
        the tier's access mark for ``evicted_chunks_reach_the_tiers``.  Cost: ``make_cache``'s."""
        self.chunk_pages = chunk_pages
        super().setup(page_size, num_pages)
        self.cs = page_size * chunk_pages
        self.resident: dict[bytes, str] = {}      # tier key of every resident full chunk -> its name
        self.mark = self.recorders[-1].mark()
        self.faults = 0                           # tier faults seen by the last step

    def teardown(self) -> None:
        """Close the cache (once set up): queued tier writes land, then the tiers close.  Cost: the
        queued writes."""
        if hasattr(self, "cache"):
            self.cache.close()

    def _resident_chunks(self) -> dict[bytes, str]:
        """Tier keys of the full chunks the pool holds (every chunk-aligned prefix the model saw in
        the tree), with a readable name each."""
        ns, stack = self.cache.namespace.id, self.cache.stack
        if stack is None:
            return {}
        return {ns + stack.refs(list(p))[-1].key: f"chunk {len(p) // self.cs - 1} of {list(p)}"
                for p in self.model.pages if len(p) % self.cs == 0}

    def _unlocked_pages(self, tokens: list[int], upto: int) -> int:
        """Pages of ``tokens[:upto]`` (resident) that no request holds: a match locks them."""
        return len(set(self.model.prefixes(tokens, upto)) - self.model.locked(self.holds.values()))

    def _tier_holds(self, key: bytes) -> bool:
        """Whether the tier below holds ``key`` (asked without faults and without counting an access)."""
        return self.recorders[-1].contains_prefix([key]) == 1

    def _tier_faults(self) -> int:
        """Faults the tier below raised so far (none: an exact tier does not fail)."""
        return 0

    def _long_sequence(self, data: st.DataObject) -> list[int] | None:
        """A seen sequence with a full chunk, or a fresh one (cached first); None if the pool is full."""
        long_enough = [s for s in self.seen if len(s) >= self.cs + self.ps]
        reuse: bool = bool(long_enough) and data.draw(st.booleans(), label="a seen sequence")
        if reuse:
            return data.draw(st.sampled_from(long_enough), label="seen")
        seq = data.draw(st.lists(st.integers(0, 2), min_size=self.cs + self.ps, max_size=2 * self.cs + self.ps),
                        label="tokens")
        return seq if self._prefill(seq) else None

    @rule(data=st.data(), add_page=st.booleans())
    def recall(self, data: st.DataObject, add_page: bool) -> None:
        """Evict everything, maybe cache one page into a chunk, then match a sequence seen before:
        with an exact tier every chunk from the tree's end on comes back (as far as the pool has
        room), byte for byte, starting inside a chunk when the tree ends inside one."""
        cache, ps, cs = self.cache, self.ps, self.cs
        seq = self._long_sequence(data)
        if seq is None:
            return
        cache.flush()
        self._evict(cache.pool.num_pages)
        cache.flush()
        tree_end = resident_tokens(cache.tree, seq)
        if add_page and tree_end % cs == 0 and tree_end + cs <= len(seq):
            if self._prefill(seq[:tree_end + ps]):   # loads nothing (no full chunk past the tree), adds a page
                tree_end = resident_tokens(cache.tree, seq)
        self.cache.flush()
        first, skip = tree_end // cs, tree_end % cs // ps
        room = (cache.pool.num_free + self.model.evictable(self.holds.values())
                - self._unlocked_pages(seq, tree_end))
        loadable = max(0, min(len(seq) // cs - first, (room + skip) // self.chunk_pages))
        m = self._match(seq, leave_last=False)
        want = (first + loadable) * cs if loadable else tree_end
        self._release(m)
        # A tail (fewer pages than a chunk, where cached prefixes parted) may follow the last chunk.
        if self.exact_tiers and not want <= m.num_tokens < want + cs:
            _fail(f"recall: the tree held {tree_end} tokens of {seq} (chunk {first}, {skip} pages in), the pool had "
                  f"room for {room} pages and the tiers hold every chunk, so match should cover {want} tokens "
                  f"(and at most a tail more); it covered {m.num_tokens}")

    @rule(data=st.data())
    def recall_where_prefixes_part(self, data: st.DataObject) -> None:
        """Two sequences part a page or more into a chunk (where they part is a branch point, whose
        tail — its pages past the last chunk boundary — an eviction stores under ``write_back``),
        the pool lets everything go, then a third sequence that parts from both at the same place
        comes: its chunks and then that tail come back from the tiers, with the right KV."""
        seq = self._long_sequence(data)
        if seq is None:
            return
        points = [k for k in range(self.ps, len(seq), self.ps) if k % self.cs]
        if not points:
            return
        k = data.draw(st.sampled_from(points), label="part")
        if not self._prefill(seq[:k] + [(seq[k] + 1) % 3] + data.draw(token_lists(max_len=self.ps), label="other")):
            return
        self.cache.flush()
        self._evict(self.cache.pool.num_pages)
        self.cache.flush()
        self._release(self._match(seq[:k] + [(seq[k] + 2) % 3], leave_last=False))
        self.cache.flush()

    @invariant()
    def evicted_chunks_reach_the_tiers(self) -> None:
        """Every full chunk the pool let go since the last step counts as just used in the tier
        below: refreshed (``write_through``: ``TierStack.touch`` reads it) or stored (``write_back``:
        written, or read where the tier held it).  With an exact tier the tier must hold it too,
        and under ``write_through`` (the tier not a victim tier) every chunk the pool holds (stored
        when it was inserted); over a faulty tier, recency is checked in a step without faults, for
        the chunks it holds."""
        if not hasattr(self, "cache"):
            return
        self.cache.flush()
        now = self._resident_chunks()
        tier = self.recorders[-1]
        faults = self._tier_faults()
        stack = self.cache.stack
        if self.exact_tiers and self.write_policy == "write_through" and stack is not None and not stack.victims:
            for key, name in now.items():
                if key not in self.resident and not self._tier_holds(key):
                    _fail(f"the pool holds {name}, but the tier below does not (write_through stores a chunk "
                          "when it is inserted)")
        for key, name in self.resident.items():
            if key in now:
                continue
            held = self._tier_holds(key)
            if self.exact_tiers and not held:
                _fail(f"the pool evicted {name}, and the tier does not hold it ({self.write_policy})")
            later = max(tier.accessed.get(key, 0), tier.written.get(key, 0)) > self.mark
            if not later and (self.exact_tiers or (held and faults == self.faults)):
                _fail(f"the pool evicted {name}, but the tier below did not count it as just used "
                      f"({self.write_policy}: {'refreshed' if self.write_policy == 'write_through' else 'stored'})")
        self.resident = now
        self.mark = tier.mark()
        self.faults = faults


class FaultyPrefixCacheMachine(TieredPrefixCacheMachine):
    """``TieredPrefixCacheMachine`` over a ``FaultyTier`` whose failing methods change as it runs:
    no fault reaches the engine, every match still holds the right KV, and every fault is counted
    in the stack's ``errors``."""

    exact_tiers = False

    def make_tiers(self) -> list[Any]:
        """One ``FaultyTier`` over a ``MemoryTier`` (kept as ``self.faulty``), failing nothing at
        first.  O(1)."""
        from radixkv.backends import MemoryTier
        from radixkv.testing.contract import FaultyTier

        self.faulty = FaultyTier(MemoryTier())
        return [self.faulty]

    def _tier_holds(self, key: bytes) -> bool:
        return self.faulty.inner.contains_prefix([key]) == 1

    def _tier_faults(self) -> int:
        return self.faulty.faults

    @rule(failing=st.sets(st.sampled_from(["get", "read", "put_many", "contains_prefix"])))
    def set_faults(self, failing: set[str]) -> None:
        """From now on the tier's methods in ``failing`` raise (an empty set: none); queued writes land
        first.  Cost: one ``flush``."""
        self.cache.flush()
        self.faulty.failing = set(failing)

    @rule(data=st.data(), failing=st.sets(st.sampled_from(["get", "read", "contains_prefix"]), min_size=1))
    def load_through_a_fault(self, data: st.DataObject, failing: set[str]) -> None:
        """A sequence goes down to the tier and out of the pool; its match then meets a fault: a miss
        (or a partial hit) with the right KV, and the fault counted."""
        seq = self._long_sequence(data)
        if seq is None:
            return
        self.cache.flush()
        self._evict(self.cache.pool.num_pages)
        self.cache.flush()
        self.faulty.failing = set(failing)
        self._release(self._match(seq, leave_last=False))
        self.cache.flush()
        self.faulty.failing = set()

    @invariant()
    def faults_are_counted(self) -> None:
        """After every step, once queued writes landed: the stack's ``errors`` count exactly the faults
        the tier raised.  Cost: one ``flush`` and one ``stats()``."""
        if not hasattr(self, "cache"):
            return
        self.cache.flush()
        errors = sum(self.cache.stats()["stack"]["errors"])
        if errors != self.faulty.faults:
            _fail(f"the tier raised {self.faulty.faults} faults, the stack counted {errors} errors")

    def teardown(self) -> None:
        """Stop the faults, so that the queued writes of the closing cache land, then close it as
        ``TieredPrefixCacheMachine.teardown`` does.  Cost: the queued writes."""
        self.faulty.failing = set()
        super().teardown()
