"""Model-based tests of the radix tree and the prefix cache (machines live in radixkv.testing), and
the eviction model the cache machines share, on hand-made cases."""

from __future__ import annotations

from typing import Any

import pytest

from radixkv.testing import PrefixCacheMachine, RadixTreeMachine
from radixkv.testing.machines import EvictionModel
from radixkv.core.tree import RadixTree

from mutants_engine import lru_pop_newest

TestRadixTree = RadixTreeMachine.TestCase
TestPrefixCache = PrefixCacheMachine.TestCase


class Tree:
    """A ``RadixTree`` of one-token pages with an ``EvictionModel`` told about every call."""

    def __init__(self) -> None:
        self.tree = RadixTree(page_size=1)
        self.model = EvictionModel(page_size=1)
        self.pages = iter(range(100))

    def insert(self, tokens: list[int]) -> None:
        self.tree.insert(tokens, [next(self.pages) for _ in tokens])
        self.model.touch(tokens, len(tokens))
        self.model.observe(self.tree, [], 0, f"insert({tokens})")

    def match(self, tokens: list[int]) -> None:
        n = self.tree.match_prefix(tokens).num_tokens
        self.model.touch(tokens, n)
        self.model.observe(self.tree, [], 0, f"match({tokens})")

    def evict(self, n: int) -> int:
        freed = self.tree.evict(n).size
        assert self.model.observe(self.tree, [], n, f"evict({n})") == freed
        return freed




def test_the_model_follows_a_correct_tree_through_splits_and_evictions() -> None:
    t = Tree()
    t.insert([5, 6])
    t.insert([7])
    t.match([5])                 # splits [5 6]: [5] is used now, [6] keeps its old stamp
    assert t.evict(2) == 2       # [6] first, then [7] (older than [5])
    assert set(t.model.pages) == {(5,)}
    assert t.evict(5) == 1


def test_the_model_catches_an_eviction_of_the_most_recent_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Tree()
    t.insert([1, 2])
    t.insert([3])
    t.match([1, 2])
    monkeypatch.setattr(RadixTree, "_lru_pop", lru_pop_newest)
    with pytest.raises(AssertionError, match="not least recently used first"):
        t.evict(1)


def test_the_model_catches_an_inner_node_that_kept_its_old_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Tree()
    t.insert([5, 6])
    t.insert([7])
    touch = RadixTree._touch
    monkeypatch.setattr(RadixTree, "_touch", lambda self, path: touch(self, [n for n in path if not n.children]))
    t.match([5])                 # the split's upper half [5] is an inner node: not stamped
    with pytest.raises(AssertionError, match=r"evicted \[5\] .* kept the unlocked leaf \[7\]"):
        t.evict(2)               # [6], then [5] before [7]


def test_the_model_catches_an_eviction_of_more_than_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Tree()
    t.insert([1])
    t.insert([2])
    t.insert([3])
    evict = RadixTree.evict
    monkeypatch.setattr(RadixTree, "evict", lambda self, n, on_evict=None: evict(self, n + 1, on_evict))
    with pytest.raises(AssertionError, match="evicted more than needed"):
        t.evict(1)


def test_the_model_catches_an_eviction_of_too_little(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Tree()
    t.insert([1])
    t.insert([2])
    evict = RadixTree.evict
    monkeypatch.setattr(RadixTree, "evict", lambda self, n, on_evict=None: evict(self, n - 1, on_evict))
    with pytest.raises(AssertionError, match="evicted too little"):
        t.evict(2)


def test_held_prefixes_and_sizes() -> None:
    t = Tree()
    t.insert([1, 2, 3])
    node = t.tree.match_prefix([1, 2]).node
    t.model.touch([1, 2], 2)
    t.model.observe(t.tree, [], 0, "match([1, 2])")
    t.tree.lock(node)
    held = [([1, 2, 3], 2)]
    t.model.check_sizes(t.tree, held)
    assert t.model.evictable(held) == 1 and t.model.leaf(held, made=True) == ((1, 2, 3), 3)
    assert t.model.leaf(held) == ((), 0)       # its node starts where the hold ends: no prefix to use
    with pytest.raises(AssertionError, match="evictable_size 1, protected_size 2: .* so 3 and 0"):
        t.model.check_sizes(t.tree, [])
    t.tree.evict(3)
    with pytest.raises(AssertionError, match="a live request holds"):
        t.model.observe(t.tree, [([1, 2, 3], 3)], 3, "evict(3)")
