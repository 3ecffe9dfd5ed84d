"""``StagingRing``: the registered buffers NIXL READs land in, lent to the caller as views.

A peer read moves a window of blobs into local registered memory.  Copying them out again into
new ``bytes`` cost as much as the READ itself, so the ring lends the buffer instead: the blobs are
read-only ``memoryview`` slices of it, and the buffer is not written again while any of them is
alive.  Each lend makes one fresh numpy view (the *exporter*) that every slice refers to; the ring
keeps only a weak reference to it, so the buffer is free again once the last slice (or anything
made from one: ``np.frombuffer``, ``torch.frombuffer``, a sub-slice) is gone.

Each buffer is in one state:

* **free**: registered, no transfer, no view alive;
* **writing**: a transfer into it is under way (between ``take`` and ``lend``/``copy_out``/``retire``);
* **lent**: views of it are alive (``lend``);
* **retired**: a transfer into it was abandoned and may still write: never read, never reused, and
  kept alive so that the memory stays valid for it.

At most ``max_buffers`` buffers are free, writing or lent at once; when all of them are lent,
``take`` answers ``None`` and the caller reads into the ``scratch`` buffer, which is never lent:
its blobs are copied out (``copy_out``) before the next transfer.  Buffers all have the current
size (at least ``min_bytes``, doubled past a larger request); a smaller one is deregistered when
it is next seen free.

Not thread-safe: its owner calls it under the lock it drives the agent under.  A view may be
dropped on any thread; its buffer is seen free at the next ``take``.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["StagingRing"]

_FREE, _WRITING, _LENT, _RETIRED = "free", "writing", "lent", "retired"


class _Buffer:
    """One registered buffer, its registration handle and its state."""

    __slots__ = ("tensor", "array", "handle", "state", "lent", "lendable")

    def __init__(self, nbytes: int, agent: Any, lendable: bool) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.handle = agent.register(self.tensor)
        self.state = _FREE
        self.lent: weakref.ref[np.ndarray] | None = None   # the exporter of the views, while lent
        self.lendable = lendable

    @property
    def nbytes(self) -> int:
        return len(self.array)

    def address(self) -> int:
        """The buffer's address (for the transfer's local descriptors)."""
        return self.tensor.data_ptr()

    def returned(self) -> bool:
        """Whether every view lent of this buffer is gone (a lent buffer's exporter was collected)."""
        return self.state == _LENT and self.lent is not None and self.lent() is None


class StagingRing:
    """Registered staging buffers for ``agent`` (``register(tensor) -> handle``,
    ``deregister(handle)``): at most ``max_buffers`` lendable ones, plus one scratch buffer for
    copies.  See the module docstring."""

    def __init__(self, agent: Any, *, max_buffers: int = 4, min_bytes: int = 1 << 20) -> None:
        if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
            raise ValueError(f"max_buffers must be a positive int, got {max_buffers!r}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 1:
            raise ValueError(f"min_bytes must be a positive int, got {min_bytes!r}")
        self.agent = agent
        self.max_buffers = max_buffers
        self.size = min_bytes
        self._buffers: list[_Buffer] = []      # lendable, not retired
        self._scratch: _Buffer | None = None
        self._retired: list[_Buffer] = []

    @property
    def retired(self) -> int:
        """Buffers an abandoned transfer may still write into.  O(1)."""
        return len(self._retired)

    def held(self) -> int:
        """Lendable buffers whose views are still alive.  O(buffers)."""
        return sum(b.state == _LENT and not b.returned() for b in self._buffers)

    def _grow(self, nbytes: int) -> None:
        if nbytes > self.size:
            self.size = max(nbytes, 2 * self.size)

    def take(self, nbytes: int) -> _Buffer | None:
        """A lendable buffer of at least ``nbytes``, now *writing*: a free one, else a newly
        registered one while fewer than ``max_buffers`` exist; ``None`` when they are all lent.
        O(buffers), plus a registration when one is made."""
        self._grow(nbytes)
        kept: list[_Buffer] = []
        found: _Buffer | None = None
        for buf in self._buffers:
            if buf.returned():
                buf.state, buf.lent = _FREE, None
            if buf.state == _FREE and buf.nbytes < self.size:
                self.agent.deregister(buf.handle)        # free and too small: registered no longer
                continue
            if found is None and buf.state == _FREE:
                found = buf
            kept.append(buf)
        self._buffers = kept
        if found is None and len(self._buffers) < self.max_buffers:
            found = _Buffer(self.size, self.agent, lendable=True)
            self._buffers.append(found)
        if found is not None:
            found.state = _WRITING
        return found

    def scratch(self, nbytes: int) -> _Buffer:
        """The buffer that is never lent, of at least ``nbytes``, now *writing*: read into it when
        ``take`` has none, and ``copy_out`` of it.  O(1), plus a registration when it grows."""
        self._grow(nbytes)
        buf = self._scratch
        if buf is not None and buf.nbytes < nbytes:
            self.agent.deregister(buf.handle)
            buf = None
        if buf is None:
            buf = self._scratch = _Buffer(self.size, self.agent, lendable=False)
        assert buf.state == _FREE, f"the scratch buffer is {buf.state}: a transfer left it unfinished"
        buf.state = _WRITING
        return buf

    def lend(self, buf: _Buffer, spans: Sequence[int]) -> list[memoryview]:
        """The read-only views of the ``spans`` (lengths, back to back from the start) of a
        lendable ``buf`` whose transfer is done; ``buf`` is *lent* until every view is gone.  O(spans)."""
        assert buf.state == _WRITING and buf.lendable, buf.state
        exporter = buf.array[:sum(spans)]              # a fresh ndarray: the views' one owner
        exporter.flags.writeable = False
        whole = exporter.data                         # a memoryview whose every slice holds the exporter
        views, at = [], 0
        for n in spans:
            views.append(whole[at:at + n])
            at += n
        buf.state, buf.lent = _LENT, weakref.ref(exporter)
        return views

    def copy_out(self, buf: _Buffer, spans: Sequence[int]) -> list[bytes]:
        """New ``bytes`` of the ``spans`` of ``buf`` whose transfer is done; ``buf`` is *free*
        again (the scratch buffer, or a lendable one lent to nobody).  O(bytes)."""
        assert buf.state == _WRITING, buf.state
        out, at = [], 0
        for n in spans:
            out.append(buf.array[at:at + n].tobytes())
            at += n
        buf.state = _FREE
        return out

    def retire(self, buf: _Buffer) -> None:
        """A transfer into ``buf`` was abandoned: it may still be written, so it is never read,
        lent nor reused (nor deregistered).  O(buffers)."""
        assert buf.state == _WRITING, buf.state
        buf.state = _RETIRED
        if buf is self._scratch:
            self._scratch = None
        else:
            self._buffers.remove(buf)
        self._retired.append(buf)

    def close(self) -> None:
        """Forget the buffers (the owner deregisters them all with the agent); the memory of lent
        views stays valid while they live.  O(1)."""
        self._buffers, self._scratch = [], None

    def check(self) -> None:
        """Every buffer in one state and where that state belongs; at most ``max_buffers``
        lendable; a lent one has its exporter's reference, no other does; the scratch buffer is
        never lent; no buffer is listed twice.  O(buffers)."""
        assert len(self._buffers) <= self.max_buffers, f"{len(self._buffers)} lendable buffers > {self.max_buffers}"
        everyone = self._buffers + self._retired + ([self._scratch] if self._scratch is not None else [])
        assert len({id(b) for b in everyone}) == len(everyone), "a buffer listed twice"
        for buf in self._buffers:
            assert buf.lendable and buf.state in (_FREE, _WRITING, _LENT), buf.state
            assert (buf.state == _LENT) == (buf.lent is not None), f"{buf.state} with lent={buf.lent}"
            assert buf.nbytes == len(buf.tensor) and buf.array.ctypes.data == buf.tensor.data_ptr()
        if self._scratch is not None:
            assert not self._scratch.lendable and self._scratch.state in (_FREE, _WRITING), self._scratch.state
            assert self._scratch.lent is None
        for buf in self._retired:
            assert buf.state == _RETIRED and buf.lent is None, buf.state
