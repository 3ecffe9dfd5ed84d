"""PrefixCache over a tier stack: loads continue the tree's match, bytes come back exact, faults
and corrupt data are misses, and both write policies store what they should."""

import torch

import radixkv as rk
from radixkv.backends import MemoryTier
from radixkv.testing import TieredPrefixCacheMachine

LAYOUT = rk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=4)
NS = rk.Namespace(model="tiers-test")
TOKENS = list(range(1, 38))            # 9 full pages, 4 full chunks of 8


class TestTieredWriteThrough(TieredPrefixCacheMachine.TestCase):
    pass


class WriteBackMachine(TieredPrefixCacheMachine):
    write_policy = "write_back"


TestTieredWriteBack = WriteBackMachine.TestCase


def make(tiers, **kw):
    return rk.PrefixCache(LAYOUT, 64, namespace=NS, tiers=tiers, chunk_size=8, **kw)


def prefill(cache, tokens, seed=0):
    """Insert ``tokens`` with random KV; return the KV of their full pages ``[L, 2, pages, ...]``."""
    m = cache.match(tokens)
    new = cache.alloc(-(-len(tokens) // 4) - len(m.pages))
    g = torch.Generator().manual_seed(seed)
    cache.pool.kv[:, :, new.long()] = torch.randn(cache.pool.kv[:, :, new.long()].shape, generator=g)
    cache.insert(tokens, torch.cat([m.pages, new]))
    cache.release(m)
    full = cache.match(tokens, leave_last=False)
    kv = cache.pool.kv[:, :, full.pages.long()].clone()
    cache.release(full)
    if cache.stack is not None:
        cache.stack.flush()
    return kv


def test_second_cache_loads_exact_bytes_from_the_tier():
    tier = MemoryTier()
    with make([tier]) as a, make([tier]) as b:
        kv = prefill(a, TOKENS)
        assert a.stats()["chunks_stored"] == 4
        m = b.match(TOKENS)
        assert m.num_tokens == 32 and m.tier_tokens == 32        # 4 whole chunks; the 9th page is no chunk
        assert torch.equal(b.pool.kv[:, :, m.pages.long()], kv[:, :, :8])
        b.release(m)
        assert b.stats()["tier_hit_tokens_by_tier"] == [32]
        b.check()


def test_unaligned_tree_match_loads_only_the_pages_past_it():
    tier = MemoryTier()
    with make([tier]) as a, make([tier]) as b:
        kv = prefill(a, TOKENS)
        # b holds the first 3 pages (12 tokens, inside chunk 1) with the same KV
        new = b.alloc(3)
        b.pool.kv[:, :, new.long()] = kv[:, :, :3]
        b.insert(TOKENS[:12], new)
        m = b.match(TOKENS)
        assert (m.num_tokens, m.tier_tokens) == (32, 20)
        assert m.pages[:3].tolist() == new.tolist()
        assert torch.equal(b.pool.kv[:, :, m.pages.long()], kv[:, :, :8])
        b.release(m)
        b.check()


def test_write_back_stores_on_eviction_only():
    tier = MemoryTier()
    with make([tier], write_policy="write_back") as a, make([tier]) as b:
        kv = prefill(a, TOKENS)
        assert tier.used_bytes == 0
        a.evict(100)
        a.stack.flush()
        m = b.match(TOKENS)
        assert m.num_tokens == 32 and torch.equal(b.pool.kv[:, :, m.pages.long()], kv[:, :, :8])
        b.release(m)


class BrokenTier(MemoryTier):
    name = "broken"

    def contains_prefix(self, keys):
        raise ConnectionError("endpoint down")

    def get(self, key):
        raise ConnectionError("endpoint down")


def test_a_failing_tier_is_a_miss_and_counted():
    with make([BrokenTier()]) as a:
        prefill(a, TOKENS)
        a.evict(100)
        m = a.match(TOKENS)
        assert m.num_tokens == 0
        a.release(m)
        assert sum(a.stats()["stack"]["errors"]) >= 1
        a.check()


def test_corrupt_blob_is_never_served():
    tier = MemoryTier()
    with make([tier]) as a, make([tier]) as b:
        prefill(a, TOKENS)
        keys = sorted(tier.keys())
        victim = keys[0]
        blob = bytearray(tier.get(victim))
        blob[-1] ^= 0xFF                                        # one flipped payload bit
        tier.put(victim, bytes(blob))
        m = b.match(TOKENS)
        # whichever chunk was hit, nothing at or after it is served
        assert m.num_tokens < 32
        assert b.stats()["stack"]["corrupt"] == [1]
        assert tier.get(victim) is None                        # deleted
        b.release(m)
        b.check()


def test_small_pool_loads_what_fits():
    tier = MemoryTier()
    with make([tier]) as a:
        prefill(a, TOKENS)
    small = rk.PrefixCache(LAYOUT, 5, namespace=NS, tiers=[tier], chunk_size=8)
    m = small.match(TOKENS)
    assert m.num_tokens == 16                                   # 2 chunks of 2 pages fit in 5 pages
    small.release(m)
    small.check()
    small.close()


def test_other_namespace_gets_no_hit():
    tier = MemoryTier()
    with make([tier]) as a:
        prefill(a, TOKENS)
    other = rk.PrefixCache(LAYOUT, 64, namespace=rk.Namespace(model="tiers-test", revision="v2"),
                           tiers=[tier], chunk_size=8)
    m = other.match(TOKENS)
    assert m.num_tokens == 0
    other.release(m)
    other.close()


def test_prefetch_warms_the_top_tier():
    lower = MemoryTier()
    with make([lower]) as a:
        prefill(a, TOKENS)
    top = MemoryTier()
    with make([top, lower]) as b:
        chunks = b.prefetch(TOKENS).result(timeout=30)
        assert len(chunks) == 4
        b.stack.flush()
        assert len(top.keys()) == 4                             # promoted
        m = b.match(TOKENS)
        assert m.num_tokens == 32
        assert b.stats()["tier_hit_tokens_by_tier"] == [32, 0]
        b.release(m)
