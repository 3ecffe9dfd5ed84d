"""More capacity must never mean fewer hits: a small replay of the policy benchmark's workloads.

The default tiering (exclusive, LRU in the CPU tier), for every workload and write policy, at every
pool size from 2K to 32K tokens that holds the workload's longest request (a smaller pool cannot
serve a request at all, and the replay then caches only its leading pages, which acts as an
admission filter for the most shared prefix): at least the pool-only hit rate, never more than one
point lower as the pool grows, and within two points of one LRU cache with the combined capacity
(or above it).  Inclusive LRU, what radixkv did before, fails the last (the checks are shown to
bite)."""

from __future__ import annotations

import pytest

import radixkv as rk
from radixkv.backends import CpuTier
from radixkv.bench.policy import CHUNK, CPU_TOKENS, LAYOUT, hit_rate, workloads
from radixkv.core.format import encoded_size
from radixkv.tools.workloads import pool_copies, replay

POOLS = (2048, 4096, 8192, 16384, 32768)
WORKLOADS = workloads(150)


def curve(requests, write_policy, exclusive, policy, pools=POOLS):
    return [hit_rate(requests, p, "cpu", write_policy, exclusive, policy) for p in pools]


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_default_tiering_never_loses_hits_as_capacity_grows(name, write_policy):
    requests = WORKLOADS[name]
    pools = tuple(p for p in POOLS if p >= max(len(r) for r in requests))   # pools that hold every request
    assert len(pools) >= 3
    alone = [hit_rate(requests, p) for p in pools]
    bound = [hit_rate(requests, p + CPU_TOKENS) for p in pools]
    got = curve(requests, write_policy, True, None, pools)
    assert all(g >= a for g, a in zip(got, alone)), f"{name}: tiers {got} below the pool alone {alone}"
    assert all(b >= a - 0.01 for a, b in zip(got, got[1:])), f"{name}: falls as the pool grows: {got}"
    assert all(g >= b - 0.02 for g, b in zip(got, bound)), f"{name}: {got} more than 2 points under {bound}"


@pytest.mark.slow                 # a replay at every pool size (seconds): `make test` runs it
def test_inclusive_lru_is_what_the_checks_catch():
    requests, pools = WORKLOADS["chat"], POOLS[2:]
    got = curve(requests, "write_through", False, None, pools)
    bound = [hit_rate(requests, p + CPU_TOKENS) for p in pools]
    assert not all(g >= b - 0.02 for g, b in zip(got, bound)), f"inclusive LRU {got} is within 2 points of {bound}"


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_the_replay_counts_the_tier_chunks_the_pool_holds_too():
    # The cause of the dip, counted: an inclusive CPU tier under write_through holds copies of what
    # the pool holds (more of them as the pool grows), an exclusive one none.
    slot = encoded_size(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype)
    copies = {}
    for exclusive in (False, True):
        for pool in (4096, 16384):
            tier = CpuTier(CPU_TOKENS // CHUNK * slot, slot_bytes=slot)
            with rk.PrefixCache(LAYOUT, num_pages=pool // LAYOUT.page_size, chunk_size=CHUNK, tiers=[tier],
                                exclusive=exclusive, write_queue=1 << 14) as cache:
                got = replay(cache, WORKLOADS["chat"])["levels"]["cpu"]
                assert got["chunks"] == tier.stats()["entries"] > 0
                assert pool_copies(cache) == [{"chunks": got["chunks"], "in_pool": got["in_pool"]}]
                copies[exclusive, pool] = got["in_pool"]
    assert copies[True, 4096] == copies[True, 16384] == 0
    assert 0 < copies[False, 4096] < copies[False, 16384]
