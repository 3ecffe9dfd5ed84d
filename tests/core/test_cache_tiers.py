"""PrefixCache over a tier stack: loads continue the tree's match, bytes come back exact, faults
and corrupt data are misses, and both write policies store what they should."""

import subprocess
import sys

import pytest
import torch

import radixkv as rk
from radixkv.backends import CpuTier, LmdbTier, MemoryTier
from radixkv.core.format import encoded_size
from radixkv.testing import TieredPrefixCacheMachine

LAYOUT = rk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=4)
NS = rk.Namespace(model="tiers-test")
TOKENS = list(range(1, 38))            # 9 full pages, 4 full chunks of 8


class TestTieredWriteThrough(TieredPrefixCacheMachine.TestCase):
    pytestmark = pytest.mark.slow      # a machine over a tier stack (seconds): `make test` runs it


class WriteBackMachine(TieredPrefixCacheMachine):
    write_policy = "write_back"


class TestTieredWriteBack(WriteBackMachine.TestCase):
    pytestmark = pytest.mark.slow      # a machine over a tier stack (seconds): `make test` runs it


def make(tiers, **kw):
    """A cache over ``tiers``; inclusive unless told otherwise, since two caches here often share one
    tier (an exclusive CPU tier holds only what its own pool evicted)."""
    return rk.PrefixCache(LAYOUT, 64, namespace=NS, tiers=tiers, chunk_size=8, **{"exclusive": False, **kw})


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


@pytest.fixture(params=["memory", "cpu", "lmdb"])
def shared_tier(request, tmp_path):
    """One tier instance two caches share, of every local kind."""
    if request.param == "memory":
        yield MemoryTier()
    elif request.param == "cpu":
        yield CpuTier(1 << 20, slot_bytes=encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype))
    else:
        tier = LmdbTier(tmp_path / "lmdb", 4 << 20)
        yield tier
        tier.close()


def test_second_cache_loads_exact_bytes_from_the_tier(shared_tier):
    tier = shared_tier
    with make([tier]) as a, make([tier]) as b:
        kv = prefill(a, TOKENS)
        assert a.stats()["chunks_stored"] == 4
        m = b.match(TOKENS)
        assert m.num_tokens == 32 and m.tier_tokens == 32        # 4 whole chunks; the 9th page is no chunk
        assert torch.equal(b.pool.kv[:, :, m.pages.long()], kv[:, :, :8])
        b.release(m)
        assert b.stats()["tier_hit_tokens_by_tier"] == [32]
        b.check()


def test_unaligned_tree_match_loads_only_the_pages_past_it(shared_tier):
    tier = shared_tier
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


def test_write_back_stores_on_eviction_only(shared_tier):
    tier = shared_tier
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


@pytest.mark.parametrize("other", [rk.Namespace(model="tiers-test", revision="v2"),
                                   rk.Namespace(model="tiers-test", salt=b"tenant-b"),
                                   rk.Namespace(model="other-model")])
def test_other_namespace_gets_no_hit_and_drop_namespace_clears_one(other):
    tier = MemoryTier()
    a = make([tier])
    prefill(a, TOKENS)
    b = rk.PrefixCache(LAYOUT, 64, namespace=other, tiers=[tier], chunk_size=8)
    m = b.match(TOKENS)
    assert m.num_tokens == 0                                    # never a cross-namespace hit
    b.release(m)
    prefill(b, TOKENS, seed=1)
    assert len(tier.keys()) == 8
    assert a.drop_namespace() == 4                              # the first namespace's 4 chunks go
    assert all(k.startswith(b.namespace.id) for k in tier.keys())
    a.close(), b.close()


def test_stats_per_level():
    lower = MemoryTier()
    with make([MemoryTier(), lower]) as a:
        prefill(a, TOKENS)
        a.evict(100)
        m = a.match(TOKENS)
        a.release(m)
        levels = a.stats()["levels"]
        assert [lv["level"] for lv in levels] == ["pool", "memory", "memory"]
        assert levels[0]["evicted_pages"] == 9
        assert levels[1]["hit_tokens"] == 32 and levels[1]["bytes_out"] == 32 * LAYOUT.token_bytes
        assert levels[1]["bytes_in"] > 0 and levels[2]["bytes_in"] > 0     # written through to both
        assert levels[2]["hit_tokens"] == 0 and levels[1]["lookups"] == 2   # prefill's match, then this one


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_a_restarted_process_hits_lmdb(tmp_path):
    """Two processes on the same LMDB path: the second matches what the first inserted, byte for byte."""
    script = f"""
import sys, torch, radixkv as rk
from radixkv.backends import LmdbTier
layout = rk.KVLayout(2, 2, 4, torch.float32, page_size=4)
cache = rk.PrefixCache(layout, 64, namespace=rk.Namespace(model="restart"), chunk_size=8,
                       tiers=[LmdbTier({str(tmp_path / "db")!r}, 4 << 20)])
tokens = list(range(1, 38))
m = cache.match(tokens)
if sys.argv[1] == "write":
    new = cache.alloc(10)
    cache.pool.kv[:, :, new.long()] = torch.randn(2, 2, 10, 4, 2, 4, generator=torch.Generator().manual_seed(7))
    cache.insert(tokens, new)
    m2 = cache.match(tokens, leave_last=False)
    print(m2.num_tokens)
    cache.pool.kv[:, :, m2.pages[:8].long()].numpy().tofile({str(tmp_path / "want.bin")!r})
else:
    print(m.num_tokens, m.tier_tokens)
    got = cache.pool.kv[:, :, m.pages.long()]
    import numpy as np
    print(np.array_equal(got.numpy().ravel(), np.fromfile({str(tmp_path / "want.bin")!r}, dtype=np.float32)))
cache.close()
"""
    run = lambda arg: subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True,
                                     check=True, timeout=120).stdout.split()
    assert run("write") == ["36"]
    assert run("read") == ["32", "32", "True"]


def test_flipped_bytes_in_lmdb_are_a_miss_and_deleted(tmp_path):
    tier = LmdbTier(tmp_path / "db", 4 << 20)
    with make([tier]) as a:
        prefill(a, TOKENS)
        a.evict(100)
    import lmdb
    env = lmdb.open(str(tmp_path / "db"), subdir=True, max_dbs=8)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        victims = []
        for k, v in txn.cursor():
            if len(k) == 24 and len(v) > 1000:
                victims.append(k)
                blob = bytearray(v)
                blob[len(blob) // 2] ^= 0x01
                txn.put(k, bytes(blob))
    env.close()
    assert len(victims) == 4
    tier = LmdbTier(tmp_path / "db", 4 << 20)
    with make([tier]) as b:
        m = b.match(TOKENS)
        assert m.num_tokens == 0
        b.release(m)
        assert b.stats()["levels"][1]["corrupt"] == 1
        assert tier.get(tier_key := b.namespace.id + b.stack.refs(TOKENS)[0].key) is None, tier_key


@pytest.mark.parametrize("kw, error, words", [
    (dict(chunk_size=6), ValueError, "chunk_size"),
    (dict(chunk_size=8, tiers=["not a tier"]), TypeError, "tiers"),
])
def test_bad_tier_configuration(kw, error, words):
    with pytest.raises(error, match=words):
        rk.PrefixCache(LAYOUT, 8, **kw)


@pytest.mark.parametrize("factory, words", [
    (lambda p: CpuTier(-1), "max_bytes"), (lambda p: LmdbTier(p, -5), "max_bytes"),
    (lambda p: CpuTier(1 << 20, slot_bytes=0), "slot_bytes"),
])
def test_bad_budgets(factory, words, tmp_path):
    with pytest.raises(ValueError, match=words):
        factory(tmp_path / "x")


def test_store_rejects_kv_of_the_wrong_dtype_or_shape():
    with make([MemoryTier()]) as a:
        ref = a.stack.refs(TOKENS)[0]
        with pytest.raises(ValueError, match="kv"):
            a.stack.store([(ref, torch.zeros(LAYOUT.chunk_shape(8), dtype=torch.float16))])
        with pytest.raises(ValueError, match="kv"):
            a.stack.store([(ref, torch.zeros(LAYOUT.chunk_shape(4)))])


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


def _prefix(i):
    """Nine tokens: one full chunk of 8 (two pages) and a tail token; a different chunk per ``i``."""
    return [100 * (i + 1) + t for t in range(9)]


def test_write_through_pool_evictions_refresh_the_cpu_tier():
    """Under write_through the CPU tier is a victim cache: what the pool evicts becomes the most
    recent chunk there, however long ago it was written, so it outlives later writes."""
    slot = encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype)
    tier = CpuTier(3 * slot, slot_bytes=slot)                          # holds exactly 3 chunks
    a, b, c, d = (_prefix(i) for i in range(4))
    # 7 pages: A, B and C (two pages each) and one free; D's alloc (3 pages) evicts the LRU prefix.
    with rk.PrefixCache(LAYOUT, 7, namespace=NS, tiers=[tier], chunk_size=8, exclusive=False) as cache:
        for tokens in (a, b, c):
            prefill(cache, tokens)
            for _ in range(3):                                         # A stays hot in the pool
                cache.release(cache.match(a))
        for tokens in (b, c):                                          # ... until B and C are hotter
            cache.release(cache.match(tokens))
        cache.stack.flush()
        keys = [cache.namespace.id + cache.stack.refs(t)[0].key for t in (a, b, c, d)]
        assert tier.contains_prefix(keys[:3]) == 3                     # written A, B, C: A is the oldest
        prefill(cache, d)                                              # the pool evicts A; D is written
        assert cache.stats()["evicted_pages"] == 2
        assert [tier.contains_prefix([k]) for k in keys] == [1, 0, 1, 1]   # B, not A, left the tier
        assert cache.stack.stats()["touched"] == [1]
        cache.evict(cache.pool.num_pages)
        m = cache.match(a)
        assert (m.num_tokens, m.tier_tokens_by_tier) == (8, (8,))       # served by the CPU tier
        cache.release(m)
        cache.check()


class _RemoteTier(MemoryTier):
    """A tier that says it is remote and records its reads."""

    local = False

    def __init__(self):
        super().__init__()
        self.reads = []

    def get(self, key):
        self.reads.append(key)
        return super().get(key)


def test_touch_refreshes_lru_order_in_local_tiers_only():
    slot = encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype)
    cpu, remote = CpuTier(2 * slot, slot_bytes=slot), _RemoteTier()
    with make([cpu, remote]) as cache:
        stack = cache.stack
        refs = stack.refs(TOKENS)
        stack.store((ref, torch.zeros(LAYOUT.chunk_shape(8))) for ref in refs[:2])
        stack.flush()
        keys = [ref.key for ref in refs]
        assert stack.touch([keys[0], keys[3]]) == 2                    # keys[3] is held by no tier
        stack.flush()
        assert remote.reads == []                                      # a remote tier is never read
        assert stack.stats()["touched"] == [1, 0]
        stack.store([(refs[2], torch.zeros(LAYOUT.chunk_shape(8)))])   # evicts the LRU chunk: 1, not 0
        stack.flush()
        held = [cpu.contains_prefix([cache.namespace.id + k]) for k in keys[:3]]
        assert held == [1, 0, 1]
        with pytest.raises(ValueError, match="16-byte"):
            stack.touch([b"short"])
        cache.check()


def test_touch_is_dropped_and_counted_when_the_queue_is_full():
    with make([MemoryTier()], write_queue=1) as cache:
        keys = [ref.key for ref in cache.stack.refs(TOKENS)]
        with cache.stack.writer.hold():                                # hold the writer off the queue
            queued = cache.stack.touch(keys)
        assert queued <= 1 and cache.stack.stats()["dropped_writes"] == len(keys) - queued


def test_touch_without_a_local_tier_queues_nothing():
    remote = _RemoteTier()
    with make([remote]) as cache:
        assert cache.stack.touch([ref.key for ref in cache.stack.refs(TOKENS)]) == 0
        cache.stack.flush()
        assert remote.reads == []


def test_with_a_secret_a_forged_chunk_is_never_served_and_counted_per_level(monkeypatch):
    """A cache that has the deployment secret (here from RADIXKV_SECRET) serves nothing written
    without it: a chunk an attacker wrote with a valid unkeyed checksum is a miss, counted as forged."""
    from radixkv.core.format import encode_chunk

    monkeypatch.setenv("RADIXKV_SECRET", "cache-tiers-test-secret-01")
    tier = MemoryTier()
    with make([tier]) as a:
        kv = prefill(a, TOKENS)
        refs = a.stack.refs(TOKENS)
    fake = torch.full(LAYOUT.chunk_shape(8), 7.0, dtype=LAYOUT.dtype)
    tier.put(NS.bind(LAYOUT).id + refs[1].key,
             encode_chunk(NS.bind(LAYOUT).id, refs[1].key, refs[1].parent, refs[1].tokens, fake))
    with make([tier]) as b:
        m = b.match(TOKENS)
        assert m.num_tokens == 8, "the forged chunk (or what follows it) was served"
        assert torch.equal(b.pool.kv[:, :, m.pages.long()], kv[:, :, :2])
        b.release(m)
        assert b.stats()["stack"]["forged"] == [1] and b.stats()["levels"][1]["forged"] == 1
        b.check()
    monkeypatch.delenv("RADIXKV_SECRET")
    with make([tier]) as c:  # without the secret, the keyed chunks are misses too (never served unverified)
        m = c.match(TOKENS)
        assert m.num_tokens == 0 and c.stats()["stack"]["forged"] == [1]
        c.release(m)


@pytest.mark.parametrize("kw", [{"exclusive": True}, {"write_policy": "write_back"}], ids=["exclusive", "write_back"])
def test_an_eviction_larger_than_the_write_queue_reaches_the_tiers_whole(kw):
    # What an eviction writes back exists nowhere else: it waits (bounded) for the writer to make
    # room in a queue of 2 rather than dropping 14 of its 16 chunks.
    tier = CpuTier(1 << 20, slot_bytes=encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype))
    with make([tier], write_queue=2, **kw) as cache:
        tokens = list(range(1, 8 * 16 + 2))                   # 16 whole chunks and one token
        kv = prefill(cache, tokens)
        assert cache.evict(cache.pool.num_pages) == 32
        cache.stack.flush()
        assert cache.stack.stats()["dropped_writes"] == 0
        m = cache.match(tokens)
        assert m.num_tokens == 128 and m.tier_tokens == 128
        assert torch.equal(cache.pool.kv[:, :, m.pages.long()], kv)
        cache.release(m)
        cache.check()


@pytest.mark.parametrize("kw", [{"exclusive": True}, {"write_policy": "write_back"}, {}],
                         ids=["exclusive", "write_back", "write_through"])
def test_a_full_tier_evicts_an_evicted_chain_from_its_end_not_its_head(kw):
    # The pool lets go of a prefix of 4 chunks into a CPU tier of 4 slots, then of another chunk:
    # the tier must make room by dropping the prefix's last chunk (the tree, too, evicts leaves
    # first), not its first, which would leave the other three unreachable.
    tier = CpuTier(4 * encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype),
                   slot_bytes=encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype))
    with make([tier], **kw) as cache:
        kv = prefill(cache, TOKENS[:32])
        assert cache.evict(cache.pool.num_pages) == 8
        other = [t + 1000 for t in TOKENS[:8]]
        prefill(cache, other)
        assert cache.evict(cache.pool.num_pages) == 2
        cache.stack.flush()
        assert tier.stats()["evictions"] == 1
        m = cache.match(TOKENS[:32] + [0])
        assert m.num_tokens == 24 and m.tier_tokens == 24             # chunks 0-2 of 4
        assert torch.equal(cache.pool.kv[:, :, m.pages.long()], kv[:, :, :6])
        cache.release(m)
        cache.check()


@pytest.mark.parametrize("kw", [{"exclusive": True}, {"write_policy": "write_back"}], ids=["exclusive", "write_back"])
def test_a_prefix_that_ends_inside_a_chunk_comes_back_whole_through_its_tail(kw):
    # Two requests part after 12 tokens (a chunk and a page); when the pool lets them go, the tier
    # gets chunk 0 and the page past it as a tail, so a third request that shares the 12 tokens
    # gets all of them back, not only the 8 of the whole chunk.  A request's own end stores none.
    tier = CpuTier(1 << 20, slot_bytes=encoded_size(LAYOUT.chunk_shape(8), LAYOUT.dtype))
    shared = TOKENS[:12]
    with make([tier], **kw) as cache:
        kv = prefill(cache, shared + [900 + t for t in range(8)])
        prefill(cache, shared + [800 + t for t in range(8)], seed=1)
        cache.evict(cache.pool.num_pages)
        cache.stack.flush()
        assert cache.stats()["tails_stored"] == 1
        m = cache.match(shared + [700, 701, 702])
        assert m.num_tokens == 12 and m.tier_tokens == 12
        assert torch.equal(cache.pool.kv[:, :, m.pages.long()], kv[:, :, :3])
        cache.release(m)
        cache.stack.flush()
        if kw.get("exclusive"):
            assert tier.stats()["entries"] == 2       # chunk 0 and the tail moved up; each request's chunk 1 stays
        cache.check()


def test_a_cpu_tier_sized_by_its_first_blob_still_takes_whole_chunks_after_a_tail():
    # The first blob an exclusive CpuTier (slots sized by the first blob, unless told) gets may be
    # a tail, smaller than a chunk: the cache tells it the chunk size up front (Tier.expect), or
    # every whole chunk after it would be refused.
    tier = CpuTier(1 << 20)
    with rk.PrefixCache(LAYOUT, 64, namespace=NS, tiers=[tier], chunk_size=12, exclusive=True) as cache:
        shared = TOKENS[:4]                                   # one page, then the sequences part
        prefill(cache, shared + [900, 901, 902, 903])         # 8 tokens: no whole chunk of 12
        prefill(cache, shared + [800, 801, 802, 803])
        kv = prefill(cache, [500 + t for t in range(25)])     # two whole chunks, evicted last
        cache.evict(cache.pool.num_pages)
        cache.stack.flush()
        assert cache.stats()["tails_stored"] == 1 and tier.stats()["rejected"] == 0
        m = cache.match([500 + t for t in range(25)])
        assert m.num_tokens == 24 and torch.equal(cache.pool.kv[:, :, m.pages.long()], kv[:, :, :6])
        cache.release(m)
        cache.check()
