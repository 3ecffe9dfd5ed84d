"""Hypothesis strategies and state machines for the radix tree and the prefix cache.

Run them as they are (``TestTree = RadixTreeMachine.TestCase``), or subclass ``PrefixCacheMachine``
and override ``make_cache`` to drive your own configuration through the same protocol.

The reference model is deliberately plain: a dict from every cached page-aligned prefix (a tuple
of tokens) to the page id holding its last page, with the op stamp that last touched it.  Tiny
alphabets, page sizes 1–4 and pools of 4–16 pages make splits, shared prefixes and evictions
happen in a handful of steps.
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

__all__ = ["PrefixCacheMachine", "RadixTreeMachine", "TieredPrefixCacheMachine", "token_lists", "token_sequences"]


def token_lists(alphabet: int = 3, max_len: int = 12) -> st.SearchStrategy[list[int]]:
    """Token id lists over a tiny alphabet, so that prefixes are shared often."""
    return st.lists(st.integers(0, alphabet - 1), max_size=max_len)


def token_sequences(alphabet: int = 3, max_len: int = 12) -> st.SearchStrategy[Any]:
    """Token ids in every form the API accepts: list, tuple, numpy array (int32/int64), tensor."""
    return token_lists(alphabet, max_len).flatmap(lambda toks: st.sampled_from([
        toks, tuple(toks), np.array(toks, dtype=np.int32), np.array(toks, dtype=np.int64),
        torch.tensor(toks, dtype=torch.int64)]))


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

    def evict_pages(self, freed: set[int], locked: set[tuple[int, ...]]) -> None:
        """Drop the prefixes whose pages were freed; check the eviction was a legal LRU one."""
        gone = {p for p, (page, _) in self.entries.items() if page in freed}
        assert len(gone) == len(freed), "evict freed pages the model does not know as cached"
        assert not gone & locked, "a locked prefix was evicted"
        survivors = {p: v for p, v in self.entries.items() if p not in gone}
        for p in survivors:
            assert p[:-self.page_size] in survivors or len(p) == self.page_size, \
                "evict left a prefix whose parent is gone"
        has_child = {p[:-self.page_size] for p in survivors}
        leaves = [v[1] for p, v in survivors.items() if p not in has_child and p not in locked]
        if gone and leaves:
            assert max(self.entries[p][1] for p in gone) <= min(leaves), \
                "evicted a prefix more recently used than a surviving evictable leaf"
        self.entries = survivors


class RadixTreeMachine(RuleBasedStateMachine):
    """``RadixTree`` against ``_PrefixModel``, with ``check()`` after every step."""

    @initialize(page_size=st.integers(1, 4))
    def setup(self, page_size: int) -> None:
        self.tree = RadixTree(page_size)
        self.model = _PrefixModel(page_size)
        self.page_ids = itertools.count()
        self.locked: list[tuple[RadixNode, tuple[int, ...]]] = []

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        for _, prefix in self.locked:
            out.update(self.model.prefixes(list(prefix)))
        return out

    @rule(tokens=token_sequences())
    def insert(self, tokens: Any) -> None:
        toks = list(map(int, tokens))
        pages = [next(self.page_ids) for _ in range(len(toks) // self.tree.page_size)]
        expected = self.model.insert(toks, pages) * self.tree.page_size
        assert self.tree.insert(tokens, pages).prefix_len == expected

    @rule(tokens=token_sequences(), lock=st.booleans())
    def match(self, tokens: Any, lock: bool) -> None:
        toks = list(map(int, tokens))
        result = self.tree.match_prefix(tokens)
        expected = self.model.match(toks)
        assert result.pages.tolist() == expected
        assert result.num_tokens == len(expected) * self.tree.page_size
        assert self.tree.prefix_tokens(result.node).tolist() == toks[:result.num_tokens]
        assert self.tree.prefix_pages(result.node).tolist() == expected
        if lock:
            self.tree.lock(result.node)
            self.locked.append((result.node, tuple(toks[:result.num_tokens])))

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
        assert freed.size >= min(num_pages, evictable) or freed.size == evictable
        assert np.unique(freed).size == freed.size
        self.model.evict_pages(set(freed.tolist()), self._locked_prefixes())

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
                raise AssertionError("unlock of an unlocked node did not raise")
            assert (self.tree.evictable_size, self.tree.protected_size) == before

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "tree"):
            self.tree.check()
            assert self.tree.total_size == len(self.model.entries) * self.tree.page_size


class PrefixCacheMachine(RuleBasedStateMachine):
    """``PrefixCache`` driven through the engine protocol, with page accounting and content checks.

    The "engine" writes each token's id and position into its KV slot, so every match can check that
    the pages it returns really hold the tokens it claims.  Override ``make_cache`` to test another
    configuration.
    """

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * 2)

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(4, 16))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.cache = self.make_cache(page_size, num_pages)
        self.ps = page_size
        self.requests: list[tuple[list[int], Match, torch.Tensor]] = []   # in flight: tokens, match, new pages

    def _write_kv(self, tokens: list[int], start: int, pages: torch.Tensor) -> None:
        """The engine's prefill: KV of token t at position i is (t, i)."""
        kv = self.cache.pool.kv
        for j, page in enumerate(pages.tolist()):
            for k in range(self.ps):
                pos = start + j * self.ps + k
                if pos < len(tokens):
                    kv[:, :, page, k, :, 0] = tokens[pos]
                    kv[:, :, page, k, :, 1] = pos

    def _assert_holds(self, tokens: list[int], match: Match) -> None:
        kv = self.cache.pool.kv[0, 0, match.pages.long()]          # [pages, page_size, 1, 2]
        got = kv.reshape(-1, 2)
        want = torch.tensor([[t, i] for i, t in enumerate(tokens[:match.num_tokens])], dtype=torch.float32)
        assert torch.equal(got, want.reshape(-1, 2)), "matched pages do not hold the matched tokens"

    @rule(tokens=token_lists(max_len=14), leave_last=st.booleans())
    def start_request(self, tokens: list[int], leave_last: bool) -> None:
        m = self.cache.match(tokens, leave_last=leave_last)
        assert m.num_tokens % self.ps == 0 and m.num_tokens <= len(tokens) - (1 if leave_last and tokens else 0)
        self._assert_holds(tokens, m)
        need = -(-len(tokens) // self.ps) - len(m.pages)
        before = self.cache.stats()
        try:
            new = self.cache.alloc(need)
        except PoolExhausted:
            assert self.cache.stats()["pages_free"] == before["pages_free"]
            self.cache.release(m)
            return
        self._write_kv(tokens, m.num_tokens, new)
        self.requests.append((tokens, m, new))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), abort=st.booleans())
    def finish_request(self, data: st.DataObject, abort: bool) -> None:
        tokens, m, new = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if abort:
            self.cache.free(new)
        else:
            self.cache.insert(tokens, torch.cat([m.pages, new]))
        self.cache.release(m)
        if self.cache.stack is not None:
            self.cache.stack.flush()        # the writer is asynchronous; keep the test deterministic
        again = self.cache.match(tokens, leave_last=False)
        self._assert_holds(tokens, again)
        if not abort:
            assert again.num_tokens == len(tokens) // self.ps * self.ps
        self.cache.release(again)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.cache.evict(num_pages)
        if self.cache.stack is not None:
            self.cache.stack.flush()

    @rule(tokens=token_lists(max_len=14))
    def release_twice_is_an_error(self, tokens: list[int]) -> None:
        m = self.cache.match(tokens)
        self.cache.release(m)
        self.cache.flush()          # a match may evict, and evictions queue tier work: let it finish
        before = self.cache.stats()
        try:
            self.cache.release(m)
        except ValueError:
            pass
        else:
            raise AssertionError("a second release did not raise")
        assert self.cache.stats() == before

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        s = self.cache.stats()
        assert s["pages_free"] + s["pages_cached"] + s["pages_engine"] == s["pages_total"]
        assert s["pages_engine"] == sum(len(new) for _, _, new in self.requests)
        assert s["live_matches"] == len(self.requests)


class TieredPrefixCacheMachine(PrefixCacheMachine):
    """``PrefixCacheMachine`` with an in-memory tier below the pool (chunks of two pages), so that
    evicted prefixes come back through the tier: every match still checks, token by token, that
    the pages it returns hold the right KV, whether they were resident or loaded.  Override
    ``make_tiers`` to put your own backend under the same checks."""

    write_policy = "write_through"

    def make_tiers(self) -> list[Any]:
        from radixkv.backends import MemoryTier

        return [MemoryTier()]

    def make_cache(self, page_size: int, num_pages: int) -> PrefixCache:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        return PrefixCache(layout, num_pages=num_pages, chunk_size=page_size * 2, tiers=self.make_tiers(),
                           write_policy=self.write_policy)

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
