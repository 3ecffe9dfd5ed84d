"""Eviction and admission policies, in a CpuTier: pins hold, S3-FIFO resists scans, second-hit
admission admits on the second offer, and the tier stays consistent after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.backends import CpuTier, Tier
from radixkv.core.policy import LRU, S3FIFO, SecondHit, make_policy
from radixkv.testing.backends import CpuTierContract

POLICIES = [None, "s3fifo", "second_hit"]


def key(i: int) -> bytes:
    return i.to_bytes(24, "big")


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "pin", "unpin"]), st.integers(0, 11)),
               max_size=80)


@pytest.mark.parametrize("policy", POLICIES)
@given(steps=ops)
def test_pinned_keys_are_never_evicted_and_the_tier_stays_consistent(policy, steps):
    tier = CpuTier(4 * 128, slot_bytes=128, policy=policy)       # 4 slots, at most 2 pins
    pinned: set[bytes] = set()
    kept: set[bytes] = set()           # pinned keys stored after the last step: they must stay
    for op, i in steps:
        k = key(i)
        if op == "put":
            tier.put(k, bytes([i]) * 100)
        elif op == "get":
            blob = tier.get(k)
            assert blob is None or blob == bytes([i]) * 100, f"{k.hex()} read back {blob!r}"
        elif op == "delete":
            tier.delete(k)
            kept.discard(k)
        elif op == "pin":
            if tier.pin([k]):
                pinned.add(k)
        else:
            tier.unpin([k])
            pinned.discard(k)
            kept.discard(k)
        tier.check()
        assert len(pinned) <= 2 and tier.stats()["pinned"] == len(pinned), f"pinned {tier.stats()['pinned']} != {pinned}"
        assert tier.stats()["entries"] <= 4
        lost = [x.hex() for x in kept if not tier.contains_prefix([x])]
        assert not lost, f"pinned keys evicted by {op} {i}: {lost}"
        kept = {x for x in pinned if tier.contains_prefix([x])}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pinned_key_survives_a_stream_of_puts(policy):
    tier = CpuTier(4 * 128, slot_bytes=128, policy=policy)
    if policy == "second_hit":
        tier.put(key(0), b"p" * 100)                              # first offer: remembered only
    tier.pin([key(0)])
    assert tier.put(key(0), b"p" * 100)
    for i in range(1, 60):
        tier.put(key(i), b"x" * 100)
        tier.put(key(i), b"x" * 100)
    assert tier.get(key(0)) == b"p" * 100
    tier.unpin([key(0)])
    for i in range(60, 160):       # keys used more than once: they displace an unpinned idle one
        tier.put(key(i), b"x" * 100)
        tier.put(key(i), b"x" * 100)
        tier.get(key(i))
    assert tier.get(key(0)) is None
    tier.check()


def test_s3fifo_keeps_hot_keys_through_a_scan_and_lru_does_not():
    def survivors(policy):
        tier = CpuTier(20 * 128, slot_bytes=128, policy=policy)
        hot = [key(i) for i in range(10)]
        for k in hot:
            tier.put(k, b"h" * 100)
        for _ in range(3):
            for k in hot:
                tier.get(k)
        for i in range(100, 140):                                 # a scan of one-time keys
            tier.put(key(i), b"s" * 100)
        tier.check()
        return sum(tier.contains_prefix([k]) for k in hot)
    assert survivors("s3fifo") == 10
    assert survivors(None) == 0


def test_second_hit_admits_a_key_the_second_time_it_is_offered():
    tier = CpuTier(4 * 128, slot_bytes=128, policy="second_hit")
    assert not tier.put(key(1), b"a" * 100)
    assert tier.contains_prefix([key(1)]) == 0 and tier.stats()["not_admitted"] == 1
    assert tier.put(key(1), b"a" * 100)
    assert tier.get(key(1)) == b"a" * 100


def test_policy_objects_and_names():
    assert isinstance(make_policy(None), LRU) and isinstance(make_policy("s3fifo", 10), S3FIFO)
    assert isinstance(make_policy("second_hit"), SecondHit)
    with pytest.raises(ValueError, match="policy"):
        make_policy("lfu")
    with pytest.raises(ValueError, match="policy"):
        CpuTier(1024, policy="mru")
    with pytest.raises(ValueError, match="max_pinned"):
        CpuTier(1024, max_pinned=-1)
    p = LRU(max_pinned=1)
    assert p.pin(b"a") and not p.pin(b"b") and p.unpin(b"a") and not p.unpin(b"a")


class S3FifoCpuContract(CpuTierContract):
    """The tier contract on a CpuTier ordered by S3-FIFO (not LRU: ``lru`` off).  No threaded
    burst: which keys S3-FIFO keeps after racing puts depends on their order, which varies between
    replays of an example (hypothesis then reports the rules drawn from what is held as flaky, as
    it did on a loaded machine); the LRU tier's contract runs the burst on the same locking code."""

    lru = False
    threads = 0

    def make_tier(self) -> Tier:
        return CpuTier(max_bytes=1024, slot_bytes=256, policy="s3fifo")


class SecondHitCpuContract(CpuTierContract):
    """The tier contract on a CpuTier with second-hit admission: a first put may be refused.
    No threaded burst: which of racing puts is admitted would vary between replays of an example."""

    lru = False
    threads = 0

    def make_tier(self) -> Tier:
        return CpuTier(max_bytes=1024, slot_bytes=256, policy="second_hit")

    def should_store(self, size: int) -> bool | None:
        return False if super().should_store(size) is False else None


TestS3FifoCpuContract = S3FifoCpuContract.TestCase
TestSecondHitCpuContract = SecondHitCpuContract.TestCase
# The LRU tier's contract runs at the full profile (tests/backends/test_backends.py); these, at a third.
TestS3FifoCpuContract.settings = TestSecondHitCpuContract.settings = settings(
    settings(), max_examples=max(10, settings().max_examples // 3))
