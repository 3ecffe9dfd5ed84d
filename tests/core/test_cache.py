"""PrefixCache, RadixTree and KVPool: the protocol, and a table of bad inputs that must raise a clear
error and leave everything as it was."""

import numpy as np
import pytest
import torch

import radixkv as rk

LAYOUT = rk.KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)


def filled_cache():
    """A cache holding [1..6] and [1, 2, 9, 9], one live match, one engine-held request."""
    cache = rk.PrefixCache(LAYOUT, num_pages=12, chunk_size=4)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9]):
        m = cache.match(tokens)
        new = cache.alloc(len(tokens) // 2 - len(m.pages))
        cache.insert(tokens, torch.cat([m.pages, new]))
        cache.release(m)
    live = cache.match([1, 2, 3, 4, 7])
    held = cache.alloc(2)
    return cache, live, held


def snapshot(cache):
    return cache.stats(), cache.tree.pretty(), cache.pool.num_free


def test_protocol_round_trip_shares_pages():
    cache, live, held = filled_cache()
    assert live.num_tokens == 4 and live.pages.tolist() == cache.match([1, 2, 3, 4], leave_last=False).pages.tolist()
    # a second request over the same prefix gets the same pages; the engine's duplicates go back
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.num_tokens == 6
    new = cache.alloc(1)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.cat([m.pages, new])) == 6
    cache.release(m)
    cache.check()


def test_concurrent_inserts_of_the_same_prefix_free_duplicates():
    cache = rk.PrefixCache(LAYOUT, num_pages=8, chunk_size=4)
    a, b = cache.match([5, 6, 7, 8]), cache.match([5, 6, 7, 8])
    pa, pb = cache.alloc(2), cache.alloc(2)
    assert cache.insert([5, 6, 7, 8], pa) == 0
    assert cache.insert([5, 6, 7, 8], pb) == 4      # b's pages were computed twice: freed
    cache.release(a), cache.release(b)
    assert cache.stats()["pages_free"] == 6 and cache.stats()["duplicate_pages"] == 2
    cache.check()


def test_leave_last_token():
    cache = rk.PrefixCache(LAYOUT, num_pages=8, chunk_size=4)
    cache.insert([1, 2, 3, 4], cache.alloc(2))
    m = cache.match([1, 2, 3, 4])
    assert m.num_tokens == 2                      # the last token must be computed for its logits
    cache.release(m)
    m = cache.match([1, 2, 3, 4], leave_last=False)
    assert m.num_tokens == 4
    cache.release(m)


def test_alloc_evicts_lru_and_never_locked_pages():
    cache = rk.PrefixCache(LAYOUT, num_pages=6, chunk_size=2)
    cache.insert([1, 1, 1, 1], cache.alloc(2))
    cache.insert([2, 2, 2, 2], cache.alloc(2))
    keep = cache.match([1, 1, 1, 1, 0])           # touches and locks [1 1 1 1]
    got = cache.alloc(4)                         # 2 free + must evict [2 2 2 2]
    assert len(got) == 4
    assert cache.match([2, 2, 2, 2], leave_last=False).num_tokens == 0
    with pytest.raises(rk.PoolExhausted, match="locked"):
        cache.alloc(1)
    cache.release(keep)
    cache.check()


def test_alloc_too_many_changes_nothing():
    cache, live, held = filled_cache()
    before = snapshot(cache)
    with pytest.raises(rk.PoolExhausted, match="cannot allocate 100 pages"):
        cache.alloc(100)
    assert snapshot(cache) == before
    cache.check()


BAD_CALLS = [
    ("match float tokens", lambda c, m, h: c.match([1.0, 2.0]), TypeError, "tokens"),
    ("match negative tokens", lambda c, m, h: c.match([1, -2]), ValueError, "tokens"),
    ("match bool tokens", lambda c, m, h: c.match([True, False]), TypeError, "tokens"),
    ("match huge token", lambda c, m, h: c.match([2**31]), ValueError, "tokens"),
    ("insert too few pages", lambda c, m, h: c.insert([7, 7, 7, 7, 7, 7], h), ValueError, "pages"),
    ("insert too many pages", lambda c, m, h: c.insert([7, 7], h), ValueError, "pages"),
    ("insert page out of range", lambda c, m, h: c.insert([7, 7, 7, 7], [0, 99]), ValueError, "pages"),
    ("insert negative page", lambda c, m, h: c.insert([7, 7, 7, 7], [-1, int(h[0])]), ValueError, "pages"),
    ("insert float pages", lambda c, m, h: c.insert([7, 7, 7, 7], torch.tensor([1.0, 2.0])), TypeError, "pages"),
    ("insert repeated page", lambda c, m, h: c.insert([7, 7, 7, 7], [int(h[0])] * 2), ValueError, "pages"),
    ("insert a free page", lambda c, m, h: c.insert([7, 7, 7, 7], [int(h[0]), int(np.flatnonzero(c.pool._is_free)[0])]),
     ValueError, "free"),
    ("insert a cached page at another prefix", lambda c, m, h: c.insert([7, 7, 7, 7], torch.cat([m.pages[:1], h[:1]])),
     ValueError, "cached page"),
    ("insert float tokens", lambda c, m, h: c.insert([7.0, 7.0, 7.0, 7.0], h), TypeError, "tokens"),
    ("release twice", lambda c, m, h: (c.release(m), c.release(m)), ValueError, "already released"),
    ("release a foreign match", lambda c, m, h: c.release(rk.Match(0, torch.empty(0), -5)), ValueError, "match"),
    ("release not a match", lambda c, m, h: c.release("m"), TypeError, "match"),
    ("alloc negative", lambda c, m, h: c.alloc(-1), ValueError, "num_pages"),
    ("alloc float", lambda c, m, h: c.alloc(1.5), ValueError, "num_pages"),
    ("free a cached page", lambda c, m, h: c.free(m.pages), ValueError, "not held by the engine"),
    ("evict negative", lambda c, m, h: c.evict(-1), ValueError, "num_pages"),
]


@pytest.mark.parametrize("name, call, error, words", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(name, call, error, words):
    cache, live, held = filled_cache()
    if name == "release twice":
        cache.release(live)
        before = snapshot(cache)
        with pytest.raises(error, match=words):
            cache.release(live)
    else:
        before = snapshot(cache)
        with pytest.raises(error, match=words):
            call(cache, live, held)
    assert snapshot(cache) == before
    cache.check()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(chunk_size=3), ValueError, "chunk_size"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(write_policy="sometimes"), ValueError, "write_policy"),
    (dict(num_pages=0), ValueError, "num_pages"),
    (dict(namespace="ns"), TypeError, "namespace"),
])
def test_bad_construction(kwargs, error, words):
    args = dict(layout=LAYOUT, num_pages=4, chunk_size=4) | kwargs
    with pytest.raises(error, match=words):
        rk.PrefixCache(**args)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_layers=0), "num_layers"), (dict(page_size=-1), "page_size"), (dict(head_dim=1.5), "head_dim"),
])
def test_bad_layout(kwargs, words):
    with pytest.raises(ValueError, match=words):
        rk.KVLayout(**(dict(num_layers=1, num_kv_heads=1, head_dim=1) | kwargs))
    with pytest.raises(TypeError, match="dtype"):
        rk.KVLayout(1, 1, 1, dtype=torch.int64)


def test_tree_unlock_unlocked_and_foreign_nodes():
    tree = rk.RadixTree(page_size=1)
    tree.insert([1, 2], [0, 1])
    node = tree.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)
    other = rk.RadixTree(page_size=1)
    with pytest.raises(ValueError, match="not in this tree"):
        other.lock(node)
    with pytest.raises(TypeError, match="RadixNode"):
        tree.lock("node")
    tree.check()


def test_tree_evicts_parents_once_childless_and_reports_sizes():
    tree = rk.RadixTree(page_size=1)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [0, 1, 3])
    assert tree.num_nodes == 3 and tree.total_size == 4
    node = tree.match_prefix([1, 2, 3]).node
    tree.lock(node)
    assert tree.protected_size == 3 and tree.evictable_size == 1
    assert sorted(tree.evict(10).tolist()) == [3]      # only the unlocked leaf [4]
    tree.unlock(node)
    assert sorted(tree.evict(10).tolist()) == [0, 1, 2]
    assert tree.total_size == 0 and tree.num_nodes == 0
    tree.check()


def test_pool_double_free_and_foreign_ids():
    pool = rk.KVPool(LAYOUT, num_pages=4)
    ids = pool.alloc(2)
    pool.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([7])
    with pytest.raises(ValueError, match="only 3 of 4"):
        pool.alloc(5)
    pool.check()
    assert pool.layer(1).shape == (2, 4, 2, 1, 2)


def test_check_catches_corruption():
    cache, live, held = filled_cache()
    cache._state[int(held[0])] = 0                    # a page marked free that the pool hands out
    with pytest.raises(AssertionError):
        cache.check()
    cache, live, held = filled_cache()
    next(iter(cache.tree.root.children.values())).lock_ref += 1
    with pytest.raises(AssertionError):
        cache.check()
