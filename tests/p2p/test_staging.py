"""The staging ring of NIXL reads (``radixkv.p2p.staging``) against a model of what callers hold:
a view lent stays intact whatever is read after it, a buffer is reused once its views are gone,
the copy fallback when every buffer is held, and a buffer an abandoned transfer may write into is
never handed out again.  No NIXL here: the agent only counts registrations."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.p2p.staging import StagingRing


class FakeAgent:
    """Registers and deregisters memory, and says which is registered."""

    def __init__(self) -> None:
        self.registered: dict[int, Any] = {}
        self.registrations = 0

    def register(self, tensor: Any) -> object:
        handle = object()
        self.registered[id(handle)] = (handle, tensor.data_ptr(), tensor.numel())
        self.registrations += 1
        return handle

    def deregister(self, handle: object) -> None:
        assert id(handle) in self.registered, "deregistered twice, or never registered"
        del self.registered[id(handle)]


def _span(view: Any) -> tuple[int, int]:
    array = np.frombuffer(view, dtype=np.uint8)
    return array.ctypes.data, len(array)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _read(ring: StagingRing, lengths: list[int], fill: int) -> tuple[list[Any], bool]:
    """What a peer read does: a buffer, its bytes written, then lent (or copied out of the scratch)."""
    buf = ring.take(sum(lengths))
    lent = buf is not None
    if buf is None:
        buf = ring.scratch(sum(lengths))
    buf.array[:sum(lengths)] = fill
    return (ring.lend(buf, lengths) if lent else ring.copy_out(buf, lengths)), lent


def test_views_stay_intact_while_held_and_the_buffer_is_reused_once_released() -> None:
    agent = FakeAgent()
    ring = StagingRing(agent, max_buffers=2, min_bytes=64)
    first, lent = _read(ring, [10, 20], 1)
    assert lent and all(isinstance(v, memoryview) and v.readonly for v in first)
    second, lent = _read(ring, [30], 2)            # the first is held: another buffer
    assert lent and ring.held() == 2 and agent.registrations == 2
    assert [bytes(v) for v in first] == [b"\x01" * 10, b"\x01" * 20] and bytes(second[0]) == b"\x02" * 30
    third, lent = _read(ring, [5], 3)              # both held: copied out of the scratch buffer
    assert not lent and third == [b"\x03" * 5] and agent.registrations == 3
    assert bytes(first[1]) == b"\x01" * 20 and bytes(second[0]) == b"\x02" * 30
    kept = np.frombuffer(first[0], dtype=np.uint8)  # made from a view: holds the buffer too
    del first
    assert ring.held() == 2
    del kept, second
    assert ring.held() == 0
    again, lent = _read(ring, [64], 4)
    assert lent and agent.registrations == 3       # reused: nothing registered
    ring.check()
    del again


def test_a_larger_read_replaces_free_buffers_and_a_held_one_when_returned() -> None:
    agent = FakeAgent()
    ring = StagingRing(agent, max_buffers=2, min_bytes=64)
    held, _ = _read(ring, [64], 1)
    _read(ring, [64], 2)                           # lent, dropped at once: free
    big, lent = _read(ring, [100], 3)
    assert lent and bytes(held[0]) == b"\x01" * 64  # the small free one went, the held one stays
    assert len(agent.registered) == 2
    del held
    _read(ring, [100], 4)                          # the small one, returned, is deregistered now
    assert all(n >= 128 for _, _, n in agent.registered.values())
    ring.check()
    del big


def test_an_abandoned_buffer_is_never_handed_out_again() -> None:
    agent = FakeAgent()
    ring = StagingRing(agent, max_buffers=1, min_bytes=64)
    buf = ring.take(64)
    assert buf is not None
    gone = (buf.address(), buf.nbytes)
    ring.retire(buf)
    scratch = ring.scratch(64)
    ring.retire(scratch)
    retired = [gone, (scratch.address(), scratch.nbytes)]
    assert ring.retired == 2
    for fill in range(6):
        views, lent = _read(ring, [64], fill)
        assert lent and not any(_overlaps(_span(views[0]), r) for r in retired)
        del views                                  # released: the one lendable buffer is lent again
    assert len(agent.registered) == 2 + 1          # the retired stay registered (a transfer may write)
    ring.check()


def test_bad_bounds_are_refused() -> None:
    bads: list[Any] = [0, -1, True, 1.5]
    for bad in bads:
        with pytest.raises(ValueError):
            StagingRing(FakeAgent(), max_buffers=bad)
        with pytest.raises(ValueError):
            StagingRing(FakeAgent(), min_bytes=bad)


class StagingMachine(RuleBasedStateMachine):
    """Reads, drops, derived arrays and abandoned transfers in any order; after every step each
    held blob still holds what was read into it, no buffer handed out overlaps a held view or a
    retired buffer, and the ring checks."""

    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.max_buffers = 3
        self.ring = StagingRing(self.agent, max_buffers=self.max_buffers, min_bytes=32)
        self.held: list[tuple[Any, bytes]] = []     # (a view, an array made from one, or bytes; its content)
        self.retired: list[tuple[int, int]] = []
        self.fill = 0

    def _fresh(self, buf: Any) -> None:
        span = (buf.address(), buf.nbytes)
        for blob, _ in self.held:
            if not isinstance(blob, bytes):
                assert not _overlaps(_span(blob), span), "a buffer handed out while a view of it is held"
        assert not any(_overlaps(span, r) for r in self.retired), "a retired buffer handed out"

    @rule(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=4))
    def read(self, lengths: list[int]) -> None:
        self.fill = (self.fill + 1) % 251
        held_before = self.ring.held()
        buf = self.ring.take(sum(lengths))
        assert (buf is None) == (held_before == self.max_buffers), (held_before, buf)
        lent = buf is not None
        if buf is None:
            buf = self.ring.scratch(sum(lengths))
        self._fresh(buf)
        content = bytes(b % 256 for b in range(self.fill, self.fill + sum(lengths)))
        buf.array[:sum(lengths)] = np.frombuffer(content, dtype=np.uint8)
        blobs = self.ring.lend(buf, lengths) if lent else self.ring.copy_out(buf, lengths)
        assert all(isinstance(b, memoryview) for b in blobs) == lent
        at = 0
        for blob, n in zip(blobs, lengths):
            self.held.append((blob, content[at:at + n]))
            at += n

    @rule(nbytes=st.integers(1, 200))
    def abandon(self, nbytes: int) -> None:
        buf = self.ring.take(nbytes) or self.ring.scratch(nbytes)
        self._fresh(buf)
        self.ring.retire(buf)
        self.retired.append((buf.address(), buf.nbytes))
        buf.array[:] = 0xEE                          # the abandoned transfer writes on, late

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def derive(self, data: st.DataObject) -> None:   # keep an array made from the view, not the view
        i = data.draw(st.integers(0, len(self.held) - 1))
        blob, content = self.held[i]
        if isinstance(blob, memoryview) and len(blob) > 1:
            self.held[i] = (np.frombuffer(blob[1:], dtype=np.uint8), content[1:])

    @invariant()
    def held_blobs_are_intact(self) -> None:
        for blob, content in self.held:
            assert bytes(blob) == content, "a held blob changed"

    @invariant()
    def ring_checks(self) -> None:
        self.ring.check()
        assert self.ring.retired == len(self.retired)
        assert len(self.agent.registered) <= self.max_buffers + 1 + len(self.retired)


StagingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStaging = StagingMachine.TestCase
