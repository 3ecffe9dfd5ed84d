"""LmdbTier pins (stored in the environment: every process, across restarts, never evicted,
bounded in bytes, gone with their entry) and its second-hit admission filter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lmdb")

from radixkv.backends import lmdb as backend  # noqa: E402
from radixkv.backends.lmdb import LmdbTier  # noqa: E402

BLOB = 100


def key(i: int) -> bytes:
    return bytes(8) + i.to_bytes(16, "little")


def blob(i: int, size: int = BLOB) -> bytes:
    return bytes([i % 251]) * size


def tier_at(path: Path, **kwargs: object) -> LmdbTier:
    return LmdbTier(path, **{"max_bytes": 1000, "map_size": 1 << 20, "sync": False, **kwargs})  # type: ignore[arg-type]


@pytest.mark.slow                 # a process of its own: `make test` runs it
def test_pins_survive_a_restart_and_eviction_in_another_process(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    for i in range(4):
        assert tier.put(key(i), blob(i))
    assert tier.pin([key(0), key(1)]) == 2
    assert tier.pin([key(0)]) == 1                 # pinned already: still counts
    stats = tier.stats()
    assert stats["pinned"] == 2 and stats["pinned_bytes"] == 2 * BLOB
    tier.check()
    tier.close()
    # A fresh process sees the pins and evicts around them: 30 puts of 100 bytes through 1000.
    code = textwrap.dedent("""
        import sys
        from radixkv.backends.lmdb import LmdbTier
        def key(i): return bytes(8) + i.to_bytes(16, "little")
        tier = LmdbTier(sys.argv[1], max_bytes=1000, map_size=1 << 20, sync=False)
        assert tier.stats()["pinned"] == 2, tier.stats()
        for i in range(100, 130):
            assert tier.put(key(i), bytes([i % 251]) * 100)
            tier.check()
        assert tier.contains_prefix([key(0), key(1)]) == 2, "a pinned entry was evicted"
        assert tier.contains_prefix([key(2)]) == 0 and tier.contains_prefix([key(3)]) == 0
        print(tier.stats()["evictions"])
        tier.close()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 22               # 2 unpinned old entries + 20 of the new ones
    with tier_at(tmp_path) as again:           # and here again, after that process ended
        assert again.get(key(0)) == blob(0) and again.get(key(1)) == blob(1)
        assert again.unpin([key(0), key(1), key(5)]) == 2
        assert again.stats()["pinned"] == 0 and again.stats()["pinned_bytes"] == 0
        again.check()
        for i in range(200, 210):
            assert again.put(key(i), blob(i))
        assert again.contains_prefix([key(0)]) == 0 and again.contains_prefix([key(1)]) == 0  # evictable again
        again.check()


def test_pins_are_bounded_in_bytes(tmp_path: Path) -> None:
    with tier_at(tmp_path) as tier:                 # default bound: half of 1000 bytes
        for i in range(8):
            assert tier.put(key(i), blob(i))
        assert tier.pin([key(i) for i in range(8)]) == 5          # 500 bytes, then the bound
        stats = tier.stats()
        assert stats["pinned"] == 5 and stats["pinned_bytes"] == 500 and stats["pins_refused"] == 1
        assert tier.pin([key(6)]) == 0
        tier.check()
        assert tier.pin([key(0), key(99), key(6)]) == 1            # stops at a key it does not hold
        assert tier.pin([]) == 0
        for i in range(100, 120):                   # pressure: the pinned half stays
            assert tier.put(key(i), blob(i))
        assert tier.contains_prefix([key(i) for i in range(5)]) == 5
        assert tier.used_bytes <= 1000
        tier.check()
        # A put of a pinned key keeps it pinned; at a size past the bound it is stored, unpinned.
        assert tier.put(key(0), blob(7)) and tier.stats()["pinned"] == 5
        assert tier.put(key(1), blob(1, 150)) and tier.stats()["pinned"] == 4
        assert tier.stats()["pins_dropped"] == 1 and tier.stats()["pinned_bytes"] == 400
        tier.check()
    with tier_at(tmp_path / "bytes", max_pinned=250) as small, tier_at(tmp_path / "none", max_pinned=0.0) as none:
        for t in (small, none):
            for i in range(4):
                assert t.put(key(i), blob(i))
        assert small.pin([key(i) for i in range(4)]) == 2 and none.pin([key(0)]) == 0
        small.check()
        none.check()
    for bad in (1.5, -1, True, "half"):
        with pytest.raises(ValueError, match="max_pinned"):
            tier_at(tmp_path / "bad", max_pinned=bad)


def test_delete_drop_namespace_and_expiry_take_the_pin_with_the_entry(tmp_path: Path) -> None:
    now = [1000.0]
    with tier_at(tmp_path, ttl=10, clock=lambda: now[0]) as tier:
        other = b"\1" * 8 + bytes(16)
        for k in (key(0), key(1), other):
            assert tier.put(k, b"x" * 50)
        assert tier.pin([key(0), key(1), other]) == 3
        assert tier.delete(key(0)) and tier.stats()["pinned"] == 2
        tier.check()
        assert tier.put(key(0), b"y" * 50) and tier.stats()["pinned"] == 2       # stored again: not pinned
        assert tier.drop_namespace(b"\1" * 8) == 1 and tier.stats()["pinned"] == 1
        tier.check()
        assert tier.unpin([other, key(0)]) == 0
        now[0] += 11                                # TTL wins over a pin: a miss, purged with its pin
        assert tier.get(key(1)) is None and tier.pin([key(1)]) == 0
        stats = tier.stats()
        assert stats["pinned"] == 0 and stats["pinned_bytes"] == 0 and stats["entries"] == 0
        tier.check()


def test_a_map_reset_leaves_no_pins(tmp_path: Path) -> None:
    with tier_at(tmp_path) as tier:
        for i in range(4):
            assert tier.put(key(i), blob(i))
        assert tier.pin([key(0), key(1)]) == 2
        tier._reset_map()                           # the last resort of map-full recovery
        stats = tier.stats()
        assert stats["map_resets"] == 1 and stats["entries"] == 0
        assert stats["pinned"] == 0 and stats["pinned_bytes"] == 0 and tier.used_bytes == 0
        tier.check()
        assert tier.put(key(0), blob(0)) and tier.pin([key(0)]) == 1
        tier.check()
        with tier._begin(write=True) as txn:       # a dangling pin (as a reset that kept pins would leave)
            txn.put(key(9), (100).to_bytes(8, "little"), db=tier._pins)
        with pytest.raises(AssertionError, match="pin without an entry"):
            tier.check()


def test_map_full_recovery_evicts_around_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No headroom: writes hit MDB_MAP_FULL and recovery evicts in small transactions, never a pin;
    # a map so full that it is emptied (map_resets; at this size it happens pinned or not) loses them.
    monkeypatch.setattr(backend, "_HEADROOM", 1.0)
    pinned = [key(i) for i in range(4)]
    recovered = 0
    with LmdbTier(tmp_path, 10 << 20, map_size=1 << 20, sync=False) as tier:
        for i in range(4):
            assert tier.put(key(i), blob(i, 2240))
        assert tier.pin(pinned) == 4
        for i in range(100, 500):
            assert tier.put(key(i), blob(i, 2240))
            stats = tier.stats()
            if not stats.get("map_resets"):
                assert tier.contains_prefix(pinned) == 4 and stats["pinned"] == 4, f"a pin evicted at put {i}"
                recovered = stats.get("map_full", 0)
            else:
                assert stats["pinned"] == 0 and stats["pinned_bytes"] == 0
        tier.check()
    assert recovered >= 1      # at least one recovery from a full map kept every pin


def test_reopening_with_a_budget_below_the_pins_unpins(tmp_path: Path) -> None:
    with tier_at(tmp_path, max_pinned=1.0) as tier:
        for i in range(8):
            assert tier.put(key(i), blob(i))
        assert tier.pin([key(i) for i in range(8)]) == 8
    with tier_at(tmp_path, max_bytes=300) as small:
        assert small.used_bytes <= 300 and small.stats()["pinned"] == 0
        small.check()


def test_second_hit_admission(tmp_path: Path) -> None:
    with tier_at(tmp_path, admission="second_hit", admission_memory=3) as tier:
        assert not tier.put(key(0), blob(0))                    # first sighting: remembered only
        assert tier.contains_prefix([key(0)]) == 0
        stats = tier.stats()
        assert stats["not_admitted"] == 1 and stats["rejected"] == 1 and stats["entries"] == 0
        tier.check()
        assert tier.put(key(0), blob(0)) and tier.get(key(0)) == blob(0)   # second: stored
        assert tier.put(key(0), blob(1))                        # held: no filter
        assert tier.get(key(1)) is None                         # a read miss is a sighting
        assert tier.put(key(1), blob(1))
        assert tier.contains_prefix([key(2)]) == 0 and not tier.put(key(2), blob(2))  # a probe is not
        for i in (3, 4, 5):                                     # 3 newer sightings push key(2) out
            assert not tier.put(key(i), blob(i))
        assert not tier.put(key(2), blob(2))
        assert tier.put_many([(key(6), blob(6)), (key(6), blob(6))]) == 1     # twice in one batch
        stats = tier.stats()
        assert stats["not_admitted"] == 7 and stats["rejected"] == 7 and stats["entries"] == 3
        tier.check()
        assert len(tier._admission.seen) <= 3
    with pytest.raises(ValueError, match="admission"):
        tier_at(tmp_path / "bad", admission="s3fifo")
    with tier_at(tmp_path / "all") as plain:                    # the default admits every put
        assert plain.put(key(0), blob(0)) and plain.stats().get("not_admitted", 0) == 0


def test_a_prefix_pinned_before_its_chunks_reach_lmdb_is_pinned_there_when_they_land(tmp_path: Path) -> None:
    """``PrefixCache.pin`` pins the chunks in every local tier, also those the writer stores later:
    the stack re-pins them in LMDB (which pins held entries only) once they are written."""
    import torch

    from radixkv import KVLayout, PrefixCache

    tier = LmdbTier(tmp_path / "db", max_bytes=1 << 22)
    cache = PrefixCache(KVLayout(1, 1, 2, torch.float32, page_size=4), num_pages=64, chunk_size=8, tiers=[tier])
    tokens = list(range(40))
    with cache.open(tokens) as req:
        req.extend(tokens, cache.alloc(10))
    assert cache.pin(tokens) == 40
    assert cache.flush(10)
    assert tier.stats()["pinned"] == 5
    tier.check()
    cache.unpin(tokens)
    assert tier.stats()["pinned"] == 0
    cache.close()
