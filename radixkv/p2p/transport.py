"""A thin face of NIXL (UCX) for peer-to-peer reads of host memory: one agent, memory registered
once, one READ per batch, progress driven by the caller (the progress thread is off: it made
transfers 2-3x slower on small machines).

An agent is used from one thread at a time (its owner's lock).  ``available()`` says whether the
``nixl`` package imports; without it the peers speak pyzmq only (``radixkv.p2p.node``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

__all__ = ["Agent", "available"]

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether NIXL can be imported here.  Cost: one import the first time."""
    try:
        import nixl._api  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load means no NIXL
        return False
    return True


class Agent:
    """A NIXL agent named ``name`` with the UCX backend and no progress thread.  Construction
    costs a UCX context (tens of ms); ``ImportError`` without the ``nixl`` package."""

    def __init__(self, name: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ImportError("the nixl transport needs NIXL: pip install 'radixkv[p2p]' (with torch pinned in "
                              "the same command)") from e
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._peers: dict[str, bytes] = {}       # remote agent name -> the metadata it was added with
        self._registered: list[Any] = []

    def register(self, tensor: torch.Tensor) -> Any:
        """Register ``tensor``'s memory (contiguous, host) so peers may read it / reads may land in
        it, and return its handle (for ``deregister``).  Once per buffer, never per request (it
        pins pages).  O(bytes) for the kernel."""
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        handle = self._agent.register_memory(tensor)
        self._registered.append(handle)
        return handle

    def deregister(self, handle: Any) -> None:
        """Deregister the buffer ``register`` returned ``handle`` for (no transfer may use it any
        more).  O(buffers)."""
        for i, descs in enumerate(self._registered):
            if descs is handle:
                del self._registered[i]
                self._agent.deregister_memory(descs)
                return

    def deregister_all(self) -> None:
        """Deregister every buffer registered (best effort).  O(buffers)."""
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001 - closing: nothing more to do
                pass
        self._registered.clear()

    @property
    def metadata(self) -> bytes:
        """What a peer needs to read this agent's registered memory (``add_peer``).  O(1)."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Know the remote agent ``name`` by its ``metadata`` (again when it changed).  O(1) when
        known already."""
        if self._peers.get(name) == metadata:
            return
        if name in self._peers:
            self.forget(name)
        self._agent.add_remote_agent(metadata)
        self._peers[name] = metadata

    def forget(self, name: str) -> None:
        """Drop the remote agent ``name`` (it restarted or left).  O(1)."""
        if self._peers.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def progress(self) -> None:
        """Drive the agent's progress (and drop notifications): a serving agent calls it often.  Cheap."""
        self._agent.get_new_notifs()

    def read(self, peer: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
             deadline: float) -> bool:
        """One READ of the ``remote`` ``(address, length)`` spans of ``peer`` into the ``local``
        ones (registered memory on both sides), polled until done or ``deadline``
        (``time.monotonic()``): for 1 ms without a pause, then every 0.1 ms.  ``True`` when every byte arrived; ``False`` on an error or the
        deadline (then the local spans may still be written: do not reuse them).  Cost: one
        transfer request plus the bytes."""
        local_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
        remote_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
        handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        done = False
        spin_until = time.monotonic() + 0.001     # poll hot for a millisecond, then let the cores go
        try:
            state = self._agent.transfer(handle)
            while state != "ERR":
                state = self._agent.check_xfer_state(handle)
                if state == "DONE":
                    done = True
                    break
                now = time.monotonic()
                if now > deadline:
                    break
                if now > spin_until:
                    time.sleep(0.0001)
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a transfer still in flight cannot be released; left to UCX
                log.debug("nixl: a transfer to %s could not be released", peer)
        return done
