"""``radixkv.testing`` as a user meets it: settings profiles, lazy tiers, factories in ``tmp_path``,
readable failures, the knobs' rules, the faulty-tier cache machine, and no false positives on the
shipped backends over several seeds."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

import radixkv.testing as rt
from radixkv.backends import MemoryTier, Tier
from radixkv.backends.cpu import CpuTier
from radixkv.testing import (Clock, FaultyPrefixCacheMachine, PersistentTierContract, TierContract,
                             TieredPrefixCacheMachine)
from radixkv.testing.backends import CpuTierContract, LmdbTierContract, LmdbTtlTierContract, MemoryTierContract
from radixkv.testing.settings import MUTATION
from radixkv.testing.contract import key_universe, make_blob, namespace_ids

pytest.importorskip("lmdb")


class TestFaultyPrefixCache(FaultyPrefixCacheMachine.TestCase):
    pytestmark = pytest.mark.slow      # a machine over faulty tiers (seconds): `make test` runs it


class ExclusiveTiersMachine(TieredPrefixCacheMachine):
    """Recall and eviction checks hold when the tier keeps only what the pool evicted: a CpuTier
    (a victim tier; large enough never to evict here), so loads move chunks and tails up."""

    exclusive = True

    def make_tiers(self) -> list[Any]:
        return [CpuTier(4 << 20)]


class TestExclusiveTiers(ExclusiveTiersMachine.TestCase):
    pytestmark = pytest.mark.slow      # a machine over a tier stack (seconds): `make test` runs it


SMALL = settings(max_examples=10, stateful_step_count=25, deadline=None, database=None)


def test_settings_profiles_are_exported_and_load() -> None:
    from radixkv.testing import settings as profiles

    assert rt.settings is profiles and {"ci", "dev", "thorough", "mutation"} <= set(profiles.PROFILES)
    assert profiles.MUTATION.derandomize and profiles.MUTATION.database is None
    current = settings.default
    try:
        assert profiles.load_profile("mutation").max_examples == profiles.MUTATION.max_examples
        assert settings.default.derandomize
    finally:
        settings.load_profile("dev" if current.max_examples == 25 else "ci")
    with pytest.raises(ValueError, match="no hypothesis profile 'nope'"):
        profiles.load_profile("nope")


def test_make_tier_runs_lazily_not_in_init() -> None:
    built: list[Tier] = []

    class Counting(TierContract):
        def make_tier(self) -> Tier:
            built.append(MemoryTier())
            return built[-1]

    machine = Counting()
    assert not built, "make_tier must not run in __init__"
    assert machine.tier is built[0] and machine.tier is built[0]
    machine.teardown()


@pytest.mark.parametrize("form", ["no argument", "positional path", "path and clock"])
def test_check_takes_a_factory_in_tmp_path(tmp_path: Path, form: str) -> None:
    seen: list[Any] = []

    def no_argument() -> Tier:
        return MemoryTier()

    def positional(where: Path) -> Tier:
        seen.append(where)
        return MemoryTier()

    def path_and_clock(path: Path, clock: Clock) -> Tier:
        seen.append((path, clock))
        return MemoryTier()

    factory = {"no argument": no_argument, "positional path": positional, "path and clock": path_and_clock}[form]
    TierContract.check(factory, tmp_path=tmp_path, exact=True, threads=0, settings=SMALL)
    if form == "positional path":
        assert seen and all(p.parent == tmp_path for p in seen)
    if form == "path and clock":
        assert seen and all(isinstance(c, Clock) and p.parent == tmp_path for p, c in seen)
    assert not any(tmp_path.iterdir()), "each example's directory is removed at teardown"


def test_check_names_an_unknown_knob() -> None:
    with pytest.raises(ValueError, match="knobs: lur not among"):
        TierContract.check(MemoryTier, lur=True)


def test_reopen_is_a_rule_of_persistent_contracts_only() -> None:
    class Flagged(TierContract):
        persistent = True

    def rules(cls: type) -> set[str]:
        return {name for name in dir(cls) if hasattr(getattr(cls, name), "hypothesis_stateful_rule")}

    assert "reopen" not in rules(TierContract)
    assert "reopen" in rules(PersistentTierContract) and "reopen" in rules(Flagged)
    assert "put" in rules(Flagged)


def test_a_failure_names_keys_and_blobs_readably() -> None:
    """A tier that serves the first blob ever put under a key: the counterexample names the keys
    (``ns0/k3``), the step, and which version of which key came back."""

    class FirstBlobWins(MemoryTier):
        def put(self, key: bytes, blob: Any) -> bool:
            return True if key in self._data else super().put(key, blob)

    with pytest.raises(AssertionError) as failure:
        TierContract.check(FirstBlobWins, exact=True, threads=0, settings=settings(SMALL, phases=[Phase.generate]))
    text = str(failure.value)
    assert "not its last blob" in text and "version" in text, text
    assert "/k" in text and "ns" in text and "\\x" not in text.split("\n")[0], text


def test_the_contract_catches_a_tier_that_evicts_a_pinned_key() -> None:
    """A tier that says it pinned keys and evicts them anyway fails the contract (the shipped tiers,
    which pin, pass it: tests/backends/test_backends.py, tests/backends/test_policy.py)."""

    class PinsNothing(CpuTier):      # says it pinned every key, and unpinned them
        def pin(self, keys: Any) -> int:
            return len(keys)

        def unpin(self, keys: Any) -> int:
            return len(keys)

    with pytest.raises(AssertionError) as failure:
        CpuTierContract.check(lambda: PinsNothing(max_bytes=1024, slot_bytes=512), threads=0,
                              settings=settings(SMALL, max_examples=200, phases=[Phase.generate]))
    assert "pinned, vanished" in str(failure.value), str(failure.value)


def test_the_harness_states_its_failures_without_bare_asserts() -> None:
    """pytest does not rewrite asserts in an installed library, and ``python -O`` drops them."""
    for name in ("contract.py", "machines.py", "backends.py", "settings.py"):
        tree = ast.parse((Path(rt.__file__).parent / name).read_text())
        bare = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not bare, f"radixkv/testing/{name} has assert statements at lines {bare}"


def test_namespace_ids_share_all_but_one_byte_and_keys_pair_up() -> None:
    ids = namespace_ids(4)
    assert len(set(ids)) == 4 and all(len(i) == 8 for i in ids)
    assert all(sum(a != b for a, b in zip(ids[0], other)) == 1 for other in ids[1:])
    keys = key_universe(2, 4)
    assert sum(a != b for a, b in zip(keys["ns0/k0"], keys["ns0/k1"])) == 1
    assert keys["ns0/k0"][8:] == keys["ns1/k0"][8:]


def test_blobs_name_their_key_and_version() -> None:
    key = key_universe()["ns0/k0"]
    blobs = {make_blob(key, v, 40) for v in range(100)} | {make_blob(k, 1, 40) for k in key_universe().values()}
    assert len(blobs) == 100 + len(key_universe()) - 1
    assert len(make_blob(key, 1, 7)) == 7 and make_blob(key, 2, 300)[:12] == make_blob(key, 2, 12)


def test_clock_ticks_and_advances() -> None:
    clock = Clock(start=10.0, step=0.5)
    clock.tick()
    clock.advance(2)
    assert clock() == 12.5
    with pytest.raises(ValueError, match="seconds"):
        clock.advance(-1)


def test_the_contract_notices_a_tier_that_leaks_state_between_examples() -> None:
    shared = MemoryTier()
    # Left over from an earlier example before the first one runs: every example then fails at its
    # first use of the tier, and hypothesis's replays fail the same way (a tier that only fills up
    # during the run fails later in each example, which hypothesis reports as a flaky strategy).
    key = key_universe()["ns0/k0"]
    shared.put(key, make_blob(key, 1, 40))

    class Shared(TierContract):
        def make_tier(self) -> Tier:
            return shared

        def teardown(self) -> None:       # keeps the shared tier open and full
            pass

    with pytest.raises(AssertionError, match="fresh storage"):
        run_state_machine_as_test(Shared, settings=SMALL)


@pytest.mark.parametrize("contract", [MemoryTierContract, CpuTierContract, LmdbTierContract, LmdbTtlTierContract],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("which", [1, 2])
def test_shipped_backends_pass_under_several_seeds(contract: type[TierContract], which: int) -> None:
    """No false positives: the shipped backends pass the contract under fixed seeds."""
    machine = seed(which)(type(contract.__name__, (contract,), {}))
    run_state_machine_as_test(machine, settings=settings(SMALL, max_examples=8))


def test_cpu_tier_contract_covers_an_inferred_slot_size() -> None:
    class Inferred(CpuTierContract):
        def make_tier(self) -> Tier:
            return CpuTier(max_bytes=1200)

    run_state_machine_as_test(Inferred, settings=SMALL)


@pytest.mark.slow                 # every shipped contract over many examples (seconds): `make test` runs it
@pytest.mark.parametrize("contract", [CpuTierContract, LmdbTierContract], ids=lambda c: c.__name__)
def test_evictions_happen_in_many_examples(contract: type[TierContract]) -> None:
    """The shipped contracts' sizes make eviction (and so the LRU and minimality checks) happen."""
    evictions: list[int] = []

    class Counting(contract):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            evictions.append(0)

        def _check_eviction(self, evicted: set[bytes], fresh: set[bytes], exact_size: bool) -> None:
            evictions[-1] += len(evicted)
            super()._check_eviction(evicted, fresh, exact_size)

    run_state_machine_as_test(Counting, settings=settings(MUTATION, max_examples=25))
    assert sum(n > 0 for n in evictions) >= 3 and sum(evictions) >= 20, evictions
