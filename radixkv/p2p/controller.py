"""The cache controller: which live instance holds which chunks in its CPU tier, for peer-to-peer
sharing (``radixkv.p2p.node``, ``radixkv.p2p.tier``) and for routers.

``python -m radixkv controller --bind tcp://127.0.0.1:5600 --config FILE`` runs one (``--config``
names a radixkv config file whose ``secret`` it takes; else ``RADIXKV_SECRET``).  It binds only the
address given, and answers only messages signed with the deployment secret (``radixkv.p2p.wire``).

Contract:

* **Members.**  An instance ``Register``s (id, a random incarnation per start, the address of its
  request channel, its transport and NIXL agent metadata), then sends a ``Heartbeat`` every second
  or so.  An instance not heard from for ``heartbeat_timeout_s`` (default 5 s) is dropped with its
  holdings, as on ``Deregister``.  A ``Register`` with a new incarnation (the instance restarted)
  drops what the old one held.  Every departure (the last 4,096) is told to each member in the
  answer to its next heartbeat or report (``Ack.departed``), so that it ends the departed
  instance's pins on it at once instead of at their time limit.
* **Holdings** are an ``Index`` (``radixkv.fleet.index``) fed by the instances' ``Report``s: KV
  events in vLLM's format (``BlockStored`` / ``BlockRemoved``, medium ``"CPU"``) naming the full
  24-byte tier keys, numbered; a ``snapshot`` replaces everything the instance held.  A report out
  of sequence is answered ``"resync"`` (the instance sends a snapshot); one from an instance the
  controller does not know (a restarted controller, a timed-out instance) ``"unknown"`` (the
  instance registers again and sends a snapshot).  So no data lives only in the controller: a
  restarted controller is rebuilt by the instances within a heartbeat or two, and until then
  answers "no peer" (misses, never errors).
* **Lookups.**  ``PeerLookup(keys, instance)``: the live instance other than the asker that holds
  the longest leading run of ``keys``, with its address, transport, metadata and that count
  (equal holders take turns, so that their reads spread).  ``Lookup(names)``: how many leading names every live instance holds (for
  routers).  Both O(matched keys + instances).
* **Bounds.**  At most ``max_blocks`` keys per instance (``Index``); what the index forgets is a
  miss, never a false hit the peer cannot serve (a peer that no longer holds a key pins nothing).

The controller is one thread over one ROUTER socket; ``ControllerClient`` is what instances and
routers use to ask it, each call bounded by a deadline, answering "nothing" while it is down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from radixkv.fleet.events import BlockStored, EventBatch
from radixkv.fleet.index import Index
from radixkv.p2p.wire import (Ack, Channel, Deregister, Heartbeat, Holdings, Lookup, PeerAnswer, PeerLookup,
                                Register, Report, Server, Signer)

__all__ = ["Controller", "ControllerClient", "add_arguments", "main"]

log = logging.getLogger(__name__)
NO_PEER = PeerAnswer(peer="", incarnation="", endpoint="", transport="", metadata=b"", count=0)


@dataclass
class _Member:
    """A registered instance."""

    incarnation: str
    endpoint: str
    transport: str
    metadata: bytes
    seen: float


class Controller:
    """The controller at ``bind``, authenticating with ``secret`` (see the module docstring).
    ``start()`` serves on a thread; ``close()`` stops.  ``clock`` (monotonic seconds) is injectable
    for tests.  All state is guarded by one lock; each request costs O(its keys + instances)."""

    def __init__(self, bind: str, secret: bytes | str | None = None, *, heartbeat_timeout_s: float = 5.0,
                 max_blocks: int = 4_000_000, clock: Any = time.monotonic) -> None:
        if isinstance(heartbeat_timeout_s, bool) or not isinstance(heartbeat_timeout_s, (int, float)) \
                or heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be a positive number, got {heartbeat_timeout_s!r}")
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.index = Index(max_blocks=max_blocks)
        self._members: dict[str, _Member] = {}
        self._departed: deque[tuple[float, str]] = deque(maxlen=4096)   # (when, instance), for members' pins
        self._turn = 0                                  # spreads peer lookups over equal holders
        self._clock = clock
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("registered", "timed_out", "deregistered", "reports", "resyncs", "unknown",
                                     "peer_lookups", "peer_hits", "lookups"), 0)
        self._server = Server(bind, Signer(secret), self._answer, tick=self.expire, tick_s=0.2,
                              name="radixkv-controller")
        #: The address bound (the real port when ``bind`` said 0).
        self.address = self._server.address

    def start(self) -> Controller:
        """Serve on a thread of its own.  Returns ``self``."""
        self._server.start()
        return self

    def close(self) -> None:
        """Stop serving (bounded: a few seconds at most).  Idempotent."""
        self._server.close()

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def refused(self) -> int:
        """Messages refused: unsigned, signed with another secret, or too old."""
        return self._server.refused

    def members(self) -> list[str]:
        """The live instances, by name.  O(instances)."""
        with self._lock:
            return sorted(self._members)

    def _answer(self, body: Any, blobs: list[memoryview]) -> tuple[Any, Sequence[Any]] | None:
        with self._lock:
            return self.handle(body), ()

    def handle(self, body: Any) -> Any:
        """The answer to one request ``body`` (the caller holds no lock; the server calls it under
        the controller's).  Public for tests and for a controller run inside another process."""
        now = self._clock()
        if isinstance(body, PeerLookup):
            self.counts["peer_lookups"] += 1
            best = self._best_peer(body.instance, body.keys)
            self.counts["peer_hits"] += best.count > 0
            return best
        if isinstance(body, Lookup):
            self.counts["lookups"] += 1
            live = self.index.lookup(body.names)
            return Holdings({name: m.blocks for name, m in live.items() if name in self._members})
        if isinstance(body, Register):
            old = self._members.get(body.instance)
            if old is not None and old.incarnation != body.incarnation:
                self._departed.append((now, body.instance))     # the old run left: its pins may end
                if body.instance in self.index.instances():
                    self.index.remove(body.instance)   # a restart: what the old run held is gone
            self._members[body.instance] = _Member(body.incarnation, body.endpoint, body.transport,
                                                   bytes(body.metadata), now)
            self.counts["registered"] += 1
            return Ack("ok")
        member = self._members.get(getattr(body, "instance", ""))
        if member is None or member.incarnation != getattr(body, "incarnation", None):
            self.counts["unknown"] += 1
            return Ack("unknown")
        since, member.seen = member.seen, now
        gone = tuple(sorted({name for when, name in self._departed if when >= since and name != body.instance}))
        if isinstance(body, Heartbeat):
            return Ack("ok", gone)
        if isinstance(body, Deregister):
            self._drop(body.instance)
            self.counts["deregistered"] += 1
            return Ack("ok")
        if isinstance(body, Report):
            return Ack(self._report(body).status, gone)
        return None

    def _report(self, report: Report) -> Ack:
        known = report.instance in self.index.instances()
        if report.snapshot:
            if known:
                self.index.remove(report.instance)
        elif not known or self.index.next_seq(report.instance) != report.seq:
            self.counts["resyncs"] += 1
            return Ack("resync")
        self.index.apply(report.instance, report.seq, report.batch)
        self.counts["reports"] += 1
        return Ack("ok")

    def _best_peer(self, asker: str, keys: list[bytes]) -> PeerAnswer:
        live = [(-m.blocks, name) for name, m in self.index.lookup(keys).items()
                if name != asker and name in self._members and self._members[name].endpoint]
        if not live:
            return NO_PEER
        longest = min(live)[0]
        ties = sorted(name for blocks, name in live if blocks == longest)
        name = ties[self._turn % len(ties)]            # the longest run; equal holders take turns
        self._turn += 1
        member = self._members[name]
        return PeerAnswer(name, member.incarnation, member.endpoint, member.transport, member.metadata, -longest)

    def _drop(self, instance: str) -> None:
        # Lock held.
        if self._members.pop(instance, None) is not None:
            self._departed.append((self._clock(), instance))
        if instance in self.index.instances():
            self.index.remove(instance)

    def expire(self) -> int:
        """Drop the instances not heard from for ``heartbeat_timeout_s``; how many.  Runs on the
        server's thread every 0.2 s.  O(instances)."""
        with self._lock:
            limit = self._clock() - self.heartbeat_timeout_s
            gone = [name for name, m in self._members.items() if m.seen < limit]
            for name in gone:
                self._drop(name)
                log.info("radixkv controller: %s timed out; its holdings are dropped", name)
            self.counts["timed_out"] += len(gone)
            return len(gone)

    def check(self) -> None:
        """Assert the invariants: the index's own, and every instance it holds keys of is a member
        (what a departed instance held is gone with it).  O(instances + keys)."""
        with self._lock:
            self.index.check()
            stray = set(self.index.instances()) - set(self._members)
            assert not stray, f"holdings of instances that are not members: {sorted(stray)}"
            assert all(v >= 0 for v in self.counts.values()), f"negative counter in {self.counts}"


class ControllerClient:
    """Asks the controller at ``address``: each call waits at most ``timeout_s`` (or until the
    caller's deadline) and answers "nothing" (``None``, no peer, no holdings) when the controller
    does not answer in time — the cache then misses, it never fails.  After a call went unanswered,
    calls answer "nothing" at once for ``backoff_s`` (the controller is down: lookups must not each
    wait for it), except those made with ``force`` (heartbeats).  Thread-safe."""

    def __init__(self, address: str, secret: bytes | str | None = None, *, timeout_s: float = 0.5,
                 backoff_s: float = 1.0) -> None:
        self.channel = Channel(address, Signer(secret))
        self.timeout_s = float(timeout_s)
        self.backoff_s = float(backoff_s)
        self._down_until = 0.0
        self.unanswered = 0

    def call(self, body: Any, *, deadline: float | None = None, force: bool = False) -> Any:
        """The controller's answer to ``body``, or ``None``.  Waits at most until ``deadline``
        (``time.monotonic()``) or ``timeout_s``, whichever is sooner; at once while backing off."""
        now = time.monotonic()
        if not force and now < self._down_until:
            return None
        until = now + self.timeout_s if deadline is None else min(deadline, now + self.timeout_s)
        answer = self.channel.ask(body, until)
        if answer is None:
            self.unanswered += 1
            self._down_until = time.monotonic() + self.backoff_s
            return None
        self._down_until = 0.0
        return answer[0]

    def peer_lookup(self, instance: str, keys: Sequence[bytes], *, deadline: float | None = None) -> PeerAnswer:
        """The peer (other than ``instance``) holding the longest leading run of the 24-byte
        ``keys``; ``count`` 0 when none or the controller does not answer.  One round trip."""
        answer = self.call(PeerLookup(instance, list(keys)), deadline=deadline)
        return answer if isinstance(answer, PeerAnswer) else NO_PEER

    def lookup(self, names: Sequence[bytes], *, deadline: float | None = None) -> dict[str, int]:
        """How many leading ``names`` each live instance holds (``{}`` when the controller does not
        answer).  One round trip."""
        answer = self.call(Lookup(list(names)), deadline=deadline)
        return dict(answer.counts) if isinstance(answer, Holdings) else {}

    def close(self) -> None:
        """Close the channel.  Idempotent."""
        self.channel.close()


def snapshot_batch(keys: Sequence[bytes]) -> EventBatch:
    """A batch saying that the CPU tier holds ``keys`` (24-byte tier keys).  O(len(keys))."""
    return EventBatch(ts=time.time(), events=[BlockStored(block_hashes=list(keys), parent_block_hash=None,
                                                          token_ids=[], block_size=0, lora_id=None, medium="CPU",
                                                          lora_name=None)] if keys else [])


# ---- the command --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m radixkv controller``."""
    parser.add_argument("--bind", required=True, help="the address to answer on, e.g. tcp://10.0.0.5:5600 "
                        "(only this address is bound)")
    parser.add_argument("--config", help="a radixkv config file (YAML/JSON) whose secret is used; "
                        "default: RADIXKV_SECRET")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat before an instance is dropped (default 5)")


def serve(bind: str, secret: bytes | str | None, *, heartbeat_timeout_s: float = 5.0) -> int:
    """Run a controller on ``bind`` until SIGINT or SIGTERM (``python -m radixkv controller``)."""
    controller = Controller(bind, secret, heartbeat_timeout_s=heartbeat_timeout_s).start()
    print(f"radixkv controller on {controller.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        while not done.wait(5.0):
            pass
    finally:
        controller.close()
    return 0
