"""Hypothesis strategies and state machines for the radix tree and the prefix cache.

Run them as they are (``TestTree = RadixTreeMachine.TestCase``), or subclass and override
``make_cache`` (``PrefixCacheMachine``) or ``make_tiers`` (``TieredPrefixCacheMachine``) to drive
your own configuration or backend through the same protocol and checks.

The reference model is deliberately plain: a dict from every cached page-aligned prefix (a tuple
of tokens) to the page id holding its last page, with the op stamp that last touched it.  Tiny
alphabets, page sizes 1–4 and pools of 4–16 pages make splits, shared prefixes and evictions
happen in a handful of steps; rules that re-request sequences seen before make splits of locked
nodes and tier loads that start inside a chunk happen in every run.

What the cache machines check besides the tree's model: every match's pages hold the KV of the
tokens it claims (the "engine" writes each token's id and position into its slot), before and
after the request runs; ``alloc`` evicts no more than it needs; ``hit_tokens`` is the pool's plus
the tiers' and agrees with a tally of the matches; no node is locked when no request is in
flight; ``check()`` notices a corrupted lock count or page; with an exact tier (the default
``MemoryTier``), every chunk the pool lets go reaches the tier (stored, or refreshed under
``write_through``) and comes back byte for byte, also into a tree match that ends inside a chunk.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import Match, PoolExhausted, PrefixCache
from radixkv.pool import KVLayout
from radixkv.tree import RadixNode, RadixTree

__all__ = ["FaultyPrefixCacheMachine", "PrefixCacheMachine", "RadixTreeMachine", "TieredPrefixCacheMachine",
           "resident_tokens", "token_lists", "token_sequences"]


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


class RadixTreeMachine(RuleBasedStateMachine):
    """``RadixTree`` against ``_PrefixModel``, with ``check()`` after every step."""

    @initialize(page_size=st.integers(1, 4))
    def setup(self, page_size: int) -> None:
        self.tree = RadixTree(page_size)
        self.model = _PrefixModel(page_size)
        self.page_ids = itertools.count()
        self.locked: list[tuple[RadixNode, tuple[int, ...]]] = []
        self.seen: list[list[int]] = []

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
        i = data.draw(st.integers(0, len(self.locked) - 1))
        node, _ = self.locked.pop(i)
        self.tree.unlock(node)

    @rule(num_pages=st.integers(0, 6))
    def evict(self, num_pages: int) -> None:
        evictable = self.tree.evictable_size // self.tree.page_size
        freed = self.tree.evict(num_pages)
        if not (freed.size >= min(num_pages, evictable) or freed.size == evictable):
            _fail(f"evict({num_pages}) freed {freed.size} pages with {evictable} evictable")
        if np.unique(freed).size != freed.size:
            _fail(f"evict({num_pages}) freed a page twice: {freed.tolist()}")
        self.model.evict_pages(set(freed.tolist()), self._locked_prefixes(), num_pages)

    @rule()
    def unlock_unlocked_is_an_error(self) -> None:
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
        if hasattr(self, "tree"):
            self.tree.check()
            if self.tree.total_size != len(self.model.entries) * self.tree.page_size:
                _fail(f"total_size {self.tree.total_size}, the model caches {len(self.model.entries)} pages")


class PrefixCacheMachine(RuleBasedStateMachine):
    """``PrefixCache`` driven through the engine protocol, with page accounting and content checks.

    The "engine" writes each token's id and position into its KV slot, so every match can check that
    the pages it returns really hold the tokens it claims.  Override ``make_cache`` to test another
    configuration; ``max_len`` bounds the token lists.
    """

    max_len = 14

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * 2)

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(4, 16))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.cache = self.make_cache(page_size, num_pages)
        self.ps = page_size
        self.requests: list[tuple[list[int], Match, torch.Tensor]] = []   # in flight: tokens, match, new pages
        self.seen: list[list[int]] = []                                   # sequences inserted
        self.tally = {"matches": 0, "query_tokens": 0, "hit_tokens": 0, "pool_hit_tokens": 0}

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

    def _match(self, tokens: list[int], leave_last: bool = True) -> Match:
        m = self.cache.match(tokens, leave_last=leave_last)
        limit = len(tokens) - (1 if leave_last and tokens else 0)
        if m.num_tokens % self.ps or m.num_tokens > limit:
            _fail(f"match({tokens}, leave_last={leave_last}) covers {m.num_tokens} tokens")
        if sum(m.tier_tokens_by_tier) != m.tier_tokens:
            _fail(f"{m!r}: tier_tokens_by_tier {m.tier_tokens_by_tier} do not add up to tier_tokens {m.tier_tokens}")
        self._assert_holds(tokens, m)
        t = self.tally
        t["matches"] += 1
        t["query_tokens"] += len(tokens)
        t["hit_tokens"] += m.num_tokens
        t["pool_hit_tokens"] += m.num_tokens - m.tier_tokens
        return m

    def _alloc(self, n: int) -> torch.Tensor:
        """``cache.alloc(n)``, checking that it evicts what it must and no more."""
        before = self.cache.stats()
        largest = max((len(node.pages) for node in self.cache.tree.nodes()), default=0)
        try:
            new = self.cache.alloc(n)
        except PoolExhausted:
            after = self.cache.stats()
            if after["pages_free"] != before["pages_free"] or after["evicted_pages"] != before["evicted_pages"]:
                _fail(f"alloc({n}) raised PoolExhausted but evicted or took pages on the way")
            if before["pages_free"] + self.cache.tree.evictable_size // self.ps >= n:
                _fail(f"alloc({n}) raised PoolExhausted with {before['pages_free']} free and "
                      f"{self.cache.tree.evictable_size // self.ps} evictable pages")
            raise
        if len(new) != n:
            _fail(f"alloc({n}) returned {len(new)} pages")
        evicted = self.cache.stats()["evicted_pages"] - before["evicted_pages"]
        short = max(0, n - before["pages_free"])
        if evicted < short or (evicted and evicted - short >= largest):
            _fail(f"alloc({n}) with {before['pages_free']} pages free evicted {evicted} pages: it needed {short}, "
                  f"and no node holds more than {largest}")
        return new

    def _prefill(self, tokens: list[int]) -> bool:
        """One whole request: match, alloc, write, insert, release.  False if the pool is full."""
        m = self._match(tokens)
        try:
            new = self._alloc(-(-len(tokens) // self.ps) - len(m.pages))
        except PoolExhausted:
            self.cache.release(m)
            return False
        self._write_kv(tokens, m.num_tokens, new)
        self.cache.insert(tokens, torch.cat([m.pages, new]))
        self.cache.release(m)
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
        tokens = self._tokens(data)
        m = self._match(tokens, leave_last)
        need = -(-len(tokens) // self.ps) - len(m.pages)
        try:
            new = self._alloc(need)
        except PoolExhausted:
            self.cache.release(m)
            return
        self._write_kv(tokens, m.num_tokens, new)
        self.requests.append((tokens, m, new))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), abort=st.booleans())
    def finish_request(self, data: st.DataObject, abort: bool) -> None:
        tokens, m, new = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self._assert_holds(tokens, m, " while its request ran (its pages were evicted or reused)")
        if abort:
            self.cache.free(new)
        else:
            self.cache.insert(tokens, torch.cat([m.pages, new]))
            self._saw(tokens)
        self.cache.release(m)
        self.cache.flush()        # the writer is asynchronous; keep the test deterministic
        again = self._match(tokens, leave_last=False)
        if not abort and again.num_tokens != len(tokens) // self.ps * self.ps:
            _fail(f"right after insert({tokens}), match covers {again.num_tokens} tokens")
        self.cache.release(again)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def rerun_a_seen_request(self, data: st.DataObject) -> None:
        """A prefix of a seen sequence as a whole request, while another seen one holds its match:
        splits nodes, locked ones included."""
        held = self._match(data.draw(st.sampled_from(self.seen), label="held"))
        seq = data.draw(st.sampled_from(self.seen), label="seen")
        self._prefill(seq[:data.draw(st.integers(1, len(seq)), label="cut")])
        self.cache.release(held)

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
            self.cache.release(inner)
        self.cache.release(held)

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
        evictable = self.cache.tree.evictable_size // self.ps
        freed = self.cache.evict(num_pages)
        if not min(num_pages, evictable) <= freed <= evictable:
            _fail(f"evict({num_pages}) freed {freed} pages with {evictable} evictable")
        self.cache.flush()

    @rule(tokens=token_lists(max_len=14))
    def release_twice_is_an_error(self, tokens: list[int]) -> None:
        m = self._match(tokens)
        self.cache.release(m)
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
            self.cache.release(held)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check()
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
        from radixkv.backends import MemoryTier

        return [MemoryTier()]

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        from radixkv.testing.tiers import RecordingTier

        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        self.recorders = [RecordingTier(t) for t in self.make_tiers()]
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * self.chunk_pages,
                           tiers=self.recorders, write_policy=self.write_policy, write_queue=4096,
                           exclusive=self.exclusive)

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(6, 16), chunk_pages=st.integers(2, 3))
    def setup(self, page_size: int, num_pages: int, chunk_pages: int) -> None:   # type: ignore[override]
        self.chunk_pages = chunk_pages
        super().setup(page_size, num_pages)
        self.cs = page_size * chunk_pages
        self.resident: dict[bytes, str] = {}      # tier key of every resident full chunk -> its name
        self.mark = self.recorders[-1].mark()

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()

    def _chunks(self, tokens: list[int], upto: int) -> dict[bytes, str]:
        """Tier keys of the full chunks in ``tokens[:upto]``, with a readable name each."""
        ns = self.cache.namespace.id
        refs = self.cache.stack.refs(tokens[:upto]) if self.cache.stack is not None else []
        return {ns + ref.key: f"chunk {i} of {tokens}" for i, ref in enumerate(refs)}

    def _resident_chunks(self) -> dict[bytes, str]:
        out: dict[bytes, str] = {}
        for seq in self.seen:
            out.update(self._chunks(seq, resident_tokens(self.cache.tree, seq)))
        return out

    def _unlocked_pages(self, tokens: list[int], upto: int) -> int:
        """Pages of ``tokens[:upto]`` (resident) in unlocked nodes: a match locks them."""
        data = np.asarray(tokens[:upto], dtype="<i4").tobytes()
        pb, node, pos, count = 4 * self.ps, self.cache.tree.root, 0, 0
        while pos < len(data):
            node = node.children[data[pos:pos + pb]]
            take = min(len(node.key), len(data) - pos)
            count += take // pb if node.lock_ref == 0 else 0
            pos += take
        return count

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
        cache.evict(cache.pool.num_pages)
        cache.flush()
        tree_end = resident_tokens(cache.tree, seq)
        if add_page and tree_end % cs == 0 and tree_end + cs <= len(seq):
            if self._prefill(seq[:tree_end + ps]):   # loads nothing (no full chunk past the tree), adds a page
                tree_end = resident_tokens(cache.tree, seq)
        self.cache.flush()
        first, skip = tree_end // cs, tree_end % cs // ps
        room = cache.pool.num_free + cache.tree.evictable_size // ps - self._unlocked_pages(seq, tree_end)
        loadable = max(0, min(len(seq) // cs - first, (room + skip) // self.chunk_pages))
        m = self._match(seq, leave_last=False)
        want = (first + loadable) * cs if loadable else tree_end
        cache.release(m)
        # A tail (fewer pages than a chunk, where cached prefixes parted) may follow the last chunk.
        if self.exact_tiers and not want <= m.num_tokens < want + cs:
            _fail(f"recall: the tree held {tree_end} tokens of {seq} (chunk {first}, {skip} pages in), the pool had "
                  f"room for {room} pages and the tiers hold every chunk, so match should cover {want} tokens "
                  f"(and at most a tail more); it covered {m.num_tokens}")

    @invariant()
    def evicted_chunks_reach_the_tiers(self) -> None:
        """Every full chunk the pool let go since the last step was refreshed in the tier below
        (``write_through``) or is stored there (``write_back``)."""
        if not hasattr(self, "cache") or not self.exact_tiers:
            return
        self.cache.flush()
        now = self._resident_chunks()
        tier = self.recorders[-1]
        for key, name in self.resident.items():
            if key in now:
                continue
            later = max(tier.accessed.get(key, 0), tier.written.get(key, 0)) > self.mark
            if self.write_policy == "write_through" and not later:
                _fail(f"the pool evicted {name}, but its recency in the tier was not refreshed (write_through)")
            if tier.contains_prefix([key]) != 1:
                _fail(f"the pool evicted {name}, and the tier does not hold it ({self.write_policy})")
        self.resident = now
        self.mark = tier.mark()


class FaultyPrefixCacheMachine(TieredPrefixCacheMachine):
    """``TieredPrefixCacheMachine`` over a ``FaultyTier`` whose failing methods change as it runs:
    no fault reaches the engine, every match still holds the right KV, and every fault is counted
    in the stack's ``errors``."""

    exact_tiers = False

    def make_tiers(self) -> list[Any]:
        from radixkv.backends import MemoryTier
        from radixkv.testing.tiers import FaultyTier

        self.faulty = FaultyTier(MemoryTier())
        return [self.faulty]

    @rule(failing=st.sets(st.sampled_from(["get", "read", "put_many", "contains_prefix"])))
    def set_faults(self, failing: set[str]) -> None:
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
        self.cache.evict(self.cache.pool.num_pages)
        self.cache.flush()
        self.faulty.failing = set(failing)
        self.cache.release(self._match(seq, leave_last=False))
        self.cache.flush()
        self.faulty.failing = set()

    @invariant()
    def faults_are_counted(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.flush()
        errors = sum(self.cache.stats()["stack"]["errors"])
        if errors != self.faulty.faults:
            _fail(f"the tier raised {self.faulty.faults} faults, the stack counted {errors} errors")

    def teardown(self) -> None:
        self.faulty.failing = set()
        super().teardown()
