"""No false alarms: the tier contract passes correct tiers that make the choices the ``Tier``
protocol leaves open in different ways — a SQLite tier (tests/helpers/sqlite_tier.py) with expired rows
purged when a put needs room, on every put, on read or never (left until evicted), counted as
evictions or apart, LRU by the clock or by a counter, with a TTL and without, in a file
(persistent, pins kept or lost across a reopen) and in memory.  The mutants of that tier the
contract must catch are rows of tests/testing/test_mutations.py (``sqlite-*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from radixkv.backends import Tier
from radixkv.testing import Clock, PersistentTierContract, TierContract
from sqlite_tier import SqliteTier

SMALL = settings(max_examples=10, stateful_step_count=25, deadline=None, database=None)
MAX_BYTES = 1000

# name -> SqliteTier knobs; "file": in the example's directory (persistent) or ":memory:".
VARIANTS: dict[str, dict[str, Any]] = {
    "ttl-purge-for-room-as-evictions": dict(file=True, ttl=5.0, purge="room", count_expired="evictions"),
    "ttl-purge-every-put-as-expired": dict(file=True, ttl=5.0, purge="put", count_expired="expired", lru="counter"),
    "ttl-purge-on-read-as-evictions": dict(file=False, ttl=5.0, purge="read", count_expired="evictions"),
    "ttl-purge-on-read-pins-in-memory": dict(file=True, ttl=5.0, purge="read", lru="counter", pins="memory"),
    "ttl-never-purged": dict(file=False, ttl=5.0, purge="never"),
    "ttl-never-purged-counter": dict(file=True, ttl=2.0, purge="never", lru="counter"),
    "no-ttl-file": dict(file=True, ttl=None),
    "no-ttl-memory-counter": dict(file=False, ttl=None, lru="counter"),
}


def contract_for(variant: str) -> type[TierContract]:
    """The contract class and knobs for ``variant``: LRU by bytes, ``used_bytes`` exact, the TTL of the
    tier, persistent for a file."""
    knobs = dict(VARIANTS[variant])
    in_file = knobs.pop("file")
    ttl = knobs["ttl"]

    def make_tier(self: TierContract) -> Tier:
        return SqliteTier(self.path if in_file else ":memory:", MAX_BYTES, clock=self.clock, **knobs)

    base = PersistentTierContract if in_file else TierContract
    return type(f"Sqlite_{variant.replace('-', '_')}", (base,),
                {"make_tier": make_tier, "lru": True, "used_bytes_exact": True, "ttl": ttl})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_contract_passes_a_correct_variant(variant: str, tmp_path: Path) -> None:
    contract_for(variant).check(tmp_path=tmp_path, settings=SMALL)


@pytest.mark.slow                 # a long contract run over SQLite (seconds): `make test` runs it
def test_the_reported_tier_passes(tmp_path: Path) -> None:
    """The tier of the report (expired rows purged first when a put needs room, counted as
    evictions), from the function form, on a run long enough that most such runs failed
    (``evictions grew by 6 during fill(ns0); the model counts 2``) before ``Tier.stats`` said that
    a tier may count an expired entry it drops as an eviction."""
    TierContract.check(lambda path, clock: SqliteTier(path, MAX_BYTES, ttl=5.0, clock=clock), tmp_path=tmp_path,
                       persistent=True, lru=True, used_bytes_exact=True, ttl=5.0,
                       settings=settings(SMALL, max_examples=40))


def test_the_variants_purge_and_count_as_their_knobs_say() -> None:
    """The variants differ where they are meant to: who purges expired rows, and in which counter."""
    key, other = bytes(24), b"k" * 24

    def run(**knobs: Any) -> dict[str, Any]:
        clock = Clock()
        tier = SqliteTier(":memory:", 100, ttl=1.0, clock=clock, **knobs)
        tier.put(key, b"x" * 60)
        clock.advance(2)
        entries = {"after expiry": tier.stats()["entries"]}
        tier.get(key)
        entries["after a read"] = tier.stats()["entries"]
        tier.put(other, b"y" * 60)
        tier.check()
        return {**entries, **{n: tier.stats()[n] for n in ("evictions", "expired", "entries")}}

    assert run(purge="room") == {"after expiry": 1, "after a read": 1, "evictions": 1, "expired": 0, "entries": 1}
    assert run(purge="read", count_expired="expired") == {"after expiry": 1, "after a read": 0, "evictions": 0,
                                                          "expired": 1, "entries": 1}
    assert run(purge="never") == {"after expiry": 1, "after a read": 1, "evictions": 1, "expired": 0, "entries": 1}
    assert run(purge="put", count_expired="expired")["expired"] == 1
