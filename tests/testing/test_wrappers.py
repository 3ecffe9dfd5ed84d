"""The test wrappers (``FaultyTier``, ``RecordingTier``, ``GatedTier``) forward every call of
``Tier``'s interface to the tier they wrap, with its answer, and the tier's kind: a user's backend
under the shipped machines keeps its pins, its listing and the evictions it reports."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.backends import MemoryTier, Tier
from radixkv.testing import FaultyTier, GatedTier, RecordingTier

WRAPPERS: dict[str, Callable[[Tier], Tier]] = {
    "faulty": FaultyTier, "recording": RecordingTier, "gated": lambda t: GatedTier(t, max_wait=1.0)}
KEY = bytes(range(24))
OTHER = bytes(range(1, 25))


class SpyTier(MemoryTier):
    """A ``MemoryTier`` that records the name of every call and answers ``take_evicted``, ``pin``
    and ``unpin`` with values of its own, so a wrapper that answers for itself is told apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.evicted: list[bytes] | None = [OTHER]

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if callable(value) and not name.startswith("_") and name in vars(Tier):
            object.__getattribute__(self, "calls").append(name)
        return value

    def take_evicted(self) -> list[bytes] | None:
        return self.evicted

    def pin(self, keys: Any) -> int:
        return 7

    def unpin(self, keys: Any) -> int:
        return 5


def _interface() -> list[str]:
    """``Tier``'s public methods and properties (what a wrapper must forward; its kind's flags are
    checked on instances below)."""
    return sorted(name for name, value in vars(Tier).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property)))


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_every_method_of_the_interface_is_forwarded(kind: str) -> None:
    """Each method and property of ``Tier`` is the wrapper's own (not ``Tier``'s default, which
    would answer for the wrapped tier without asking it): a method added to ``Tier`` and not
    forwarded fails here."""
    wrapper = WRAPPERS[kind](MemoryTier())
    kept = [name for name in _interface() if getattr(type(wrapper), name) is getattr(Tier, name)]
    assert kept == [], f"{type(wrapper).__name__} answers {kept} with Tier's defaults"


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_calls_reach_the_wrapped_tier_with_its_answers(kind: str) -> None:
    spy = SpyTier()
    wrapper = WRAPPERS[kind](spy)
    assert wrapper.put(KEY, b"abc") is True
    assert bytes(wrapper.get(KEY)) == b"abc"
    assert [None if b is None else bytes(b) for b in wrapper.get_many([KEY, OTHER])] == [b"abc", None]
    assert wrapper.read(KEY, bytes) == b"abc"
    assert wrapper.contains_prefix([KEY, OTHER]) == 1
    assert [e.key for e in wrapper.entries()] == [KEY]
    assert wrapper.pin([KEY]) == 7 and wrapper.unpin([KEY]) == 5
    assert wrapper.take_evicted() == [OTHER]
    spy.evicted = None                            # lost track: the wrapper says so too
    assert wrapper.take_evicted() is None
    assert wrapper.used_bytes == spy.used_bytes > 0 and wrapper.capacity_bytes == spy.capacity_bytes
    assert wrapper.stats() == spy.stats()
    assert wrapper.put_many([(OTHER, b"de")]) == 1
    assert wrapper.delete(OTHER) is True
    assert wrapper.drop_namespace(KEY[:8]) == 1
    wrapper.expect(64)
    wrapper.check()
    wrapper.close()
    for name in ("put", "get", "get_many", "read", "contains_prefix", "entries", "pin", "unpin",
                 "take_evicted", "stats", "put_many", "delete", "drop_namespace", "expect", "check", "close"):
        assert name in spy.calls, f"{kind}: {name} did not reach the wrapped tier"


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(WRAPPERS)), local=st.booleans(), victim=st.booleans(),
       in_memory=st.booleans(), peer=st.booleans())
def test_the_wrapped_tiers_kind_is_kept(kind: str, local: bool, victim: bool, in_memory: bool,
                                        peer: bool) -> None:
    inner = MemoryTier()
    inner.local, inner.victim, inner.in_memory, inner.peer = local, victim, in_memory, peer
    wrapper = WRAPPERS[kind](inner)
    assert (wrapper.local, wrapper.victim, wrapper.in_memory, wrapper.peer) == (local, victim, in_memory, peer)


def test_the_gate_holds_load_workers_only_and_close_opens_it() -> None:
    """A closed gate makes a read on a ``radixkv-load`` thread wait (and fail past ``max_wait``);
    reads on other threads and every write pass; ``close`` opens it."""
    gated = GatedTier(MemoryTier(), max_wait=0.2)
    gated.put(KEY, b"x")
    gated.gate.clear()
    assert bytes(gated.get(KEY)) == b"x"          # not a load worker: straight through
    assert gated.put(OTHER, b"y") is True
    outcome: list[Any] = []

    def load() -> None:
        try:
            outcome.append(gated.get(KEY))
        except TimeoutError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=load, name="radixkv-load-0")
    worker.start()
    worker.join(5)
    assert isinstance(outcome[0], TimeoutError)
    gated.close()
    assert gated.gate.is_set()


def test_the_request_machine_names_a_wrong_make_tiers() -> None:
    """``make_tiers`` must give one tier: two are refused at setup with a ``TypeError`` naming it,
    not passed on as a second argument of ``RecordingTier``."""
    from radixkv.testing.requests import RequestMachine

    class TwoTiers(RequestMachine):
        def make_tiers(self) -> list[Tier]:
            return [MemoryTier(), MemoryTier()]

    with pytest.raises(TypeError, match="make_tiers"):
        TwoTiers().setup(page_size=2, num_pages=8, data=_Draws())


class _Draws:
    """A stand-in for hypothesis's ``data`` that draws no sliding layers."""

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        return None
