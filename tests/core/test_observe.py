"""The observer seam: a listener attached to a cache hears exactly what ``stats()`` counts, a
failing listener is detached and never reaches the engine, and nobody listening costs nothing
but a truth test."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import radixkv as rk
from radixkv.backends import CpuTier
from radixkv.core.observe import Counts, Listener, Observers
from radixkv.tools.workloads import replay

LAYOUT = rk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)


def scripted(cache: rk.PrefixCache) -> None:
    """Requests that hit the pool, miss, evict, and hit the CPU tier after the pool let go."""
    a, b = list(range(1, 18)), list(range(100, 140))
    replay(cache, [a, a + [99], b, a, b[:21] + [7, 7, 7], a])
    cache.evict(cache.pool.num_pages)
    replay(cache, [a, b])


def test_a_listener_hears_what_stats_counts() -> None:
    with rk.PrefixCache(LAYOUT, num_pages=24, chunk_size=4, tiers=[CpuTier(1 << 20)]) as cache:
        counts = cache.observers.add(Counts())
        scripted(cache)
        cache.flush()
        stats = cache.stats()
        assert counts.requests == stats["matches"]
        assert counts.query_tokens == stats["query_tokens"]
        assert sum(counts.served_tokens.values()) == stats["hit_tokens"]
        assert counts.served_tokens["pool"] == stats["pool_hit_tokens"]
        assert counts.served_tokens["cpu"] == stats["tier_hit_tokens"] > 0
        assert counts.pages_dropped["pool"] == stats["evicted_pages"] > 0
        assert counts.pages_held["pool"] - counts.pages_dropped["pool"] == stats["pages_cached"]
        tiers = stats["stack"]
        assert counts.chunks_held["cpu"] == tiers["stored"][0] > 0
        assert counts.chunks_dropped["cpu"] == tiers["released"][0] + tiers["corrupt"][0] + tiers["forged"][0] > 0
        assert counts.io_bytes["cpu", "store"] == tiers["tier_bytes_stored"][0]
        assert counts.io_bytes["cpu", "load"] == tiers["tier_bytes_loaded"][0] > 0
        assert counts.io_items["cpu", "load", "ok"] == tiers["hits"][0]
        assert sum(n for (level, op, _), n in counts.ios.items() if (level, op) == ("cpu", "lookup")) == \
            tiers["tier_lookups"][0]
        assert not [k for k in counts.ios if k[2] in ("error", "timeout")]
        cache.check()


def test_a_failing_listener_is_logged_and_detached_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Listener):
        calls = 0

        def pages(self, level: str, held: int, dropped: int) -> None:
            Broken.calls += 1
            raise RuntimeError("listener bug")

    cache = rk.PrefixCache(LAYOUT, num_pages=24, chunk_size=4)
    broken, counts = cache.observers.add(Broken()), cache.observers.add(Counts())
    with caplog.at_level(logging.ERROR, logger="radixkv.core.observe"):
        scripted(cache)                                     # no exception reaches the engine
    assert Broken.calls == 1 and broken not in list(cache.observers) and len(cache.observers) == 1
    assert sum("detached" in r.getMessage() for r in caplog.records) == 1
    assert counts.pages_held["pool"] - counts.pages_dropped["pool"] == cache.stats()["pages_cached"]
    cache.check()


def test_listeners_are_checked_and_removable() -> None:
    obs = Observers()
    with pytest.raises(TypeError, match="listener"):
        obs.add(object())                                   # type: ignore[arg-type]
    counts = obs.add(Counts())
    assert obs.add(counts) is counts and len(obs) == 1     # once
    assert obs.remove(counts) and not obs.remove(counts) and not obs


def test_nobody_listening_builds_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no listener the call sites test the list and deliver nothing."""
    delivered: list[Any] = []
    monkeypatch.setattr(Observers, "_deliver", lambda self, *a: delivered.append(a))
    cache = rk.PrefixCache(LAYOUT, num_pages=24, chunk_size=4, tiers=[CpuTier(1 << 20)])
    scripted(cache)
    cache.close()
    assert delivered == []
