"""Peer-to-peer sharing, the serving side: an instance's CPU tier, read by other instances.

With ``p2p_enabled: true`` (``radixkv.config``) every instance joins the fleet of its controller
(``radixkv.p2p.controller``) as a ``Node``:

* **Membership.**  It registers (its id, a random incarnation, the address of its request channel,
  its transport and NIXL agent metadata), heartbeats every ``heartbeat_s`` (1 s), and deregisters
  when closed.  Told ``"unknown"`` (the controller restarted, or timed it out) it registers again.
* **Holdings.**  A listener of the observer seam (``radixkv.core.observe``) hears what the CPU tier
  stores and drops (evictions included) and reports it to the controller directly over the
  control channel, in batches (``Report``: vLLM-format KV events, medium ``"CPU"``, block names the
  24-byte tier keys), every heartbeat.  After a ``"resync"``/``"unknown"``, or when more than
  65536 events piled up while the controller was away, it sends a snapshot of what the tier holds
  (``CpuTier.entries``) instead, so the controller is rebuilt from the instances.
* **Serving** (``PeerServer``; with a CPU tier and ``p2p_address``): a ROUTER socket bound to that
  address answers signed requests only (``radixkv.p2p.wire``).  ``Pin(keys)`` leases the slots of
  the leading keys the tier holds (``CpuTier.lease``: a leased slot is never reused, even if its key
  is evicted meanwhile) and answers where they lie in the arena, which is registered with NIXL once
  at start; the peer reads them with one NIXL READ and sends ``Release``.  A pin ends on
  ``Release``; when the controller says its reader left the fleet (``Ack.departed``, on the
  node's next heartbeat or report: ``release_from``); else at its ``ttl_s`` (at most
  ``max_ttl_s``, 10 s), when the reader died and the controller has not timed it out yet.
  At most ``max_leases`` slots (a quarter of the tier's, at least 16) are leased at once; a pin past
  that gets fewer keys (the peer asks again for the rest).  ``Fetch(keys)`` (the pyzmq transport,
  for machines without NIXL) answers the blobs themselves, copied out of leased slots.
* **Coded reads** (``Fetch(keys, codec)``: a reader with ``peer_codec`` set): the CPU tier stays
  raw, so the server codes each blob on its own thread (``Recoder``: verified under the CPU tier's
  seal, encoded by ``radixkv.core.codec``, sealed again as the tier seals), never on the engine's;
  the coded blobs are kept in a bounded LRU (``coded_cache_bytes``, 64 MiB) so a hot prefix is
  coded once for every reader.  A codec the server does not know, cannot run, or that would not
  make the blob smaller answers it raw: a reader accepts any codec.  Coding costs the server's
  CPU (``int8`` about 180 MB/s a core, ``cachegen`` about 85, on this project's machine): it pays
  on links slower than that (see ``docs/pages/codecs.md``); NIXL's one-sided READs stay raw.

**What a peer can read.**  Only members that hold the deployment secret get answers, and with the
pyzmq transport they get exactly the keys they asked for.  With NIXL, the agent metadata a member
gets from the controller lets its transfer engine address the whole registered arena: the pins
keep the slots a peer reads stable, but the secret, not the pin, is what keeps others out.  Either
way every blob a peer reads is verified by its stack (the chunk's MAC, key, parent and tokens), so
bytes that changed under a read, or that a peer forged, are a miss, never KV.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Sequence

from radixkv.p2p.controller import ControllerClient, snapshot_batch
from radixkv.fleet.events import BlockRemoved, BlockStored, EventBatch
from radixkv.p2p.wire import (Ack, Blobs, Deregister, Fetch, Heartbeat, Pin, Pinned, Register, Release, Report,
                                Server, Signer)
from radixkv.core.codec import get_codec
from radixkv.core.format import Seal, chunk_codec, encode_chunk, verify_chunk
from radixkv.core.observe import Listener

if TYPE_CHECKING:
    from radixkv.p2p.transport import Agent
    from radixkv.core.tier import Tier
    from radixkv.backends.cpu import CpuTier, Lease
    from radixkv.core.hashing import Namespace
    from radixkv.core.stack import TierStack

__all__ = ["TRANSPORTS", "Node", "PeerServer", "Recoder", "join"]

log = logging.getLogger(__name__)
TRANSPORTS = ("nixl", "zmq")
_MAX_EVENTS = 65536       # events waiting for the controller before a snapshot replaces them
_REPORT_BATCH = 4096      # keys per report message


class Recoder:
    """Codes the CPU tier's raw blobs for readers that ask for a codec (see the module docstring):
    ``recode(key, blob, codec)`` is the blob of tier key ``key`` (namespace id and chunk key)
    verified under ``seal``, coded by ``codec`` and sealed by ``seal``, or ``None`` where it stays
    raw.  Coded blobs are kept, least recently used dropped first, up to ``max_bytes``: a key names
    one chunk's exact KV, so a kept blob is the blob of that key whatever the tier did since.
    Cost: O(size) to verify and encode, O(1) when kept.  Thread-safe (one lock)."""

    def __init__(self, seal: Seal | None, max_bytes: int = 64 << 20) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.seal, self.max_bytes = seal, max_bytes
        self._kept: OrderedDict[tuple[bytes, tuple[int, int]], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("coded", "kept_hits", "raw", "refused", "coded_bytes", "raw_bytes"), 0)

    def recode(self, key: bytes, blob: Any, codec: str) -> bytes | None:
        """``key``'s blob coded by ``codec``, or ``None`` (send it raw).  See the class docstring."""
        try:
            chosen = get_codec(codec)
            chosen.ready()
        except (ValueError, TypeError, ImportError):
            with self._lock:
                self.counts["refused"] += 1
            return None
        if not chosen.code:
            return None
        kept_key = (bytes(key), chosen.key)
        with self._lock:
            kept = self._kept.get(kept_key)
            if kept is not None:
                self._kept.move_to_end(kept_key)
                self.counts["kept_hits"] += 1
                return kept
        try:
            found = verify_chunk(blob, namespace_id=key[:8], key=key[8:], seal=self.seal)
            coded = encode_chunk(key[:8], key[8:], found.parent, found.tokens, found.kv, seal=self.seal,
                                 codec=chosen)
        except Exception as e:  # noqa: BLE001 - a blob that cannot be coded is sent raw; the reader verifies it
            log.debug("radixkv p2p: blob %s not coded (%s: %s)", key.hex(), type(e).__name__, e)
            coded = None
        with self._lock:
            if coded is None or not chunk_codec(coded):     # not smaller, or not a chunk: raw
                self.counts["raw"] += 1
                self.counts["raw_bytes"] += len(blob)
                return None
            self.counts["coded"] += 1
            self.counts["coded_bytes"] += len(coded)
            if len(coded) <= self.max_bytes:
                old = self._kept.pop(kept_key, None)
                self._bytes += len(coded) - (len(old) if old is not None else 0)
                self._kept[kept_key] = coded
                while self._bytes > self.max_bytes:
                    self._bytes -= len(self._kept.popitem(last=False)[1])
        return coded

    def clear(self) -> None:
        """Drop every kept coded blob (the next read of each codes it again).  O(kept)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def check(self) -> None:
        """Assert: the kept bytes are counted right and within ``max_bytes``."""
        with self._lock:
            assert self._bytes == sum(map(len, self._kept.values())), "kept bytes miscounted"
            assert self._bytes <= self.max_bytes, "more kept than max_bytes"


class PeerServer:
    """Serves ``tier``'s blobs to signed peers on ``bind`` (see the module docstring).  ``agent``:
    a NIXL agent with ``tier.arena`` registered (``None``: pyzmq only).  Requests are answered on the
    server's thread, one at a time; each costs O(keys) plus, for ``Fetch``, a copy of the blobs."""

    def __init__(self, tier: CpuTier, bind: str, signer: Signer, *, agent: Agent | None = None,
                 max_leases: int | None = None, max_ttl_s: float = 10.0, clock: Any = time.monotonic) -> None:
        self.tier = tier
        self.agent = agent
        #: Codes blobs for coded reads (``Node.watch`` sets it, knowing the tier's seal); ``None``:
        #: every blob is answered raw.
        self.recoder: Recoder | None = None
        slots = int(tier.stats().get("slots", 0))
        self.max_leases = max_leases if max_leases is not None else max(min(slots, 16), slots // 4, 1)
        self.max_ttl_s = float(max_ttl_s)
        self._clock = clock
        self._pins: dict[int, tuple[float, list[Lease], str]] = {}  # pin id -> (expiry, leases, requester)
        self._ids = itertools.count(1)
        self._leased = 0
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("pins", "pinned_keys", "released", "expired", "departed", "fetches",
                                     "fetched_keys", "fetched_bytes", "over_budget"), 0)
        self._server = Server(bind, signer, self.handle, tick=self.tick, tick_s=0.01 if agent else 0.1,
                              name="radixkv-peer-server")
        #: The address bound (the real port when ``bind`` said 0).
        self.address = self._server.address

    def start(self) -> PeerServer:
        """Start answering.  Returns ``self``."""
        self._server.start()
        return self

    @property
    def refused(self) -> int:
        """Requests refused: unsigned, signed with another secret, or too old."""
        return self._server.refused

    def _lease_leading(self, keys: Sequence[bytes]) -> list[Lease]:
        """Leases of the leading ``keys`` held, within the lease budget.  Lock held."""
        leases: list[Lease] = []
        for key in keys:
            if self._leased + len(leases) >= self.max_leases:
                self.counts["over_budget"] += 1
                break
            if not isinstance(key, bytes) or len(key) != 24:
                break
            lease = self.tier.lease(key)
            if lease is None:
                break
            leases.append(lease)
        return leases

    def handle(self, body: Any, blobs: Sequence[memoryview] = ()) -> tuple[Any, Sequence[Any]] | None:
        """The answer to one request ``body`` and its blobs (``None``: no answer), as the server's
        thread gives it; public for tests.  O(keys), plus the copies of a ``Fetch`` (and, for a coded
        one, the coding of each blob not kept coded already)."""
        if isinstance(body, Pin):
            with self._lock:
                leases = self._lease_leading(body.keys) if self.agent is not None else []
                pin = next(self._ids)
                if leases:
                    ttl = min(max(float(body.ttl_s), 0.0), self.max_ttl_s)
                    self._pins[pin] = (self._clock() + ttl, leases, body.requester)
                    self._leased += len(leases)
                self.counts["pins"] += 1
                self.counts["pinned_keys"] += len(leases)
            base = self.tier.arena.data_ptr()
            name = self.agent.name if self.agent is not None else ""
            return Pinned(pin, name, base, [(lease.offset, lease.length) for lease in leases]), ()
        if isinstance(body, Release):
            with self._lock:
                if self._end(body.pin):
                    self.counts["released"] += 1
            return Ack("ok"), ()
        if isinstance(body, Fetch):
            memory = self.tier.arena.numpy()
            with self._lock:
                leases = self._lease_leading(body.keys)
                self._leased += len(leases)
            recoder = self.recoder if body.codec else None
            out: list[bytes] = []
            try:
                out = [self._blob(memory, key, x, recoder, body.codec) for key, x in zip(body.keys, leases)]
            finally:
                with self._lock:
                    for lease in leases:
                        self.tier.unlease(lease)
                    self._leased -= len(leases)
                    self.counts["fetches"] += 1
                    self.counts["fetched_keys"] += len(out)
                    self.counts["fetched_bytes"] += sum(map(len, out))
            return Blobs([len(b) for b in out]), out
        return None

    @staticmethod
    def _blob(memory: Any, key: bytes, lease: Lease, recoder: Recoder | None, codec: str) -> bytes:
        """The blob of ``key`` in a leased slot: coded by ``recoder`` when asked and it can, else
        copied raw."""
        view = memory[lease.offset:lease.offset + lease.length]
        if recoder is not None:
            coded = recoder.recode(key, memoryview(view), codec)
            if coded is not None:
                return coded
        return view.tobytes()

    def _end(self, pin: int) -> bool:
        # Lock held.  End pin ``pin``'s leases; whether it was held.
        held = self._pins.pop(pin, None)
        if held is None:
            return False
        for lease in held[1]:
            self.tier.unlease(lease)
        self._leased -= len(held[1])
        return True

    def tick(self) -> None:
        """Expire pins past their time (a peer that died or forgot to release) and drive NIXL; the
        server's thread calls it every 10 ms (NIXL) or 100 ms.  O(pins)."""
        now = self._clock()
        with self._lock:
            for pin in [p for p, (expiry, _, _) in self._pins.items() if expiry <= now]:
                self._end(pin)
                self.counts["expired"] += 1
        if self.agent is not None:
            self.agent.progress()

    def release_from(self, requesters: Sequence[str]) -> int:
        """End the pins of ``requesters`` (instances that left the fleet: the controller says so);
        how many ended.  O(pins)."""
        gone = set(requesters)
        with self._lock:
            ended = [p for p, (_, _, who) in self._pins.items() if who in gone]
            for pin in ended:
                self._end(pin)
            self.counts["departed"] += len(ended)
        return len(ended)

    def pins(self) -> int:
        """Pins held now.  O(1)."""
        with self._lock:
            return len(self._pins)

    def close(self) -> None:
        """Stop answering and end every pin.  Idempotent."""
        self._server.close()
        with self._lock:
            for pin in list(self._pins):
                self._end(pin)

    def check(self) -> None:
        """The leases counted are the leases held, within the budget.  O(pins)."""
        with self._lock:
            held = sum(len(leases) for _, leases, _ in self._pins.values())
            assert held == self._leased, f"{self._leased} leases counted, {held} held"
            assert 0 <= self._leased <= self.max_leases, f"{self._leased} leases over the budget {self.max_leases}"


class _Holdings(Listener):
    """Hears the CPU tier's ``chunks`` events and queues them as 24-byte names for the node."""

    def __init__(self, node: Node, level: str) -> None:
        self.node = node
        self.level = level

    def chunks(self, level: str, namespace: bytes, held: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        if level == self.level:
            self.node.note([namespace + k for k in held], [namespace + k for k in dropped])

    def cleared(self, level: str, namespace: bytes | None) -> None:
        if level == self.level:
            self.node.resync()


class Node:
    """This instance in the peer-to-peer fleet (see the module docstring): membership, reports of
    the CPU tier ``cpu`` (``None``: it reads from peers and serves nothing), and its ``server`` when
    ``address`` is given.  ``start()`` begins; ``close()`` leaves.  The controller being down is
    never an error: reports wait (bounded), heartbeats retry every ``heartbeat_s``."""

    def __init__(self, *, controller: str, secret: bytes | str | None, instance: str, address: str | None = None,
                 transport: str = "zmq", cpu: CpuTier | None = None, heartbeat_s: float = 1.0) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(instance, str) or not instance:
            raise ValueError(f"instance must be a non-empty str, got {instance!r}")
        self.instance = instance
        self.incarnation = secrets.token_hex(8)
        self.transport = transport
        self.cpu = cpu
        self.heartbeat_s = float(heartbeat_s)
        self.client = ControllerClient(controller, secret, timeout_s=max(0.5, self.heartbeat_s / 2))
        self.agent: Agent | None = None
        self.server: PeerServer | None = None
        if cpu is not None and address is not None:
            # Serving is an extra: an address in use or a NIXL that fails leaves the instance
            # reading from peers (or serving over pyzmq), never unable to start.
            if transport == "nixl":
                try:
                    from radixkv.p2p.transport import Agent

                    self.agent = Agent(f"{instance}-{self.incarnation}")
                    self.agent.register(cpu.arena)
                except Exception as e:  # noqa: BLE001 - see above
                    log.warning("radixkv p2p: NIXL failed (%s: %s); serving over pyzmq", type(e).__name__, e)
                    self.agent, self.transport = None, "zmq"
            try:
                self.server = PeerServer(cpu, address, Signer(secret), agent=self.agent)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("radixkv p2p: cannot serve on %s (%s: %s); this instance only reads from peers",
                            address, type(e).__name__, e)
        self.endpoint = self.server.address if self.server is not None else ""
        self.listener = _Holdings(self, cpu.name if cpu is not None else "cpu")
        self._lock = threading.Lock()
        self._events: deque[tuple[bool, list[bytes]]] = deque()     # (stored?, names)
        self._pending = 0
        self._seq = 0
        self._registered = False
        self._snapshot = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-p2p-node", daemon=True)
        self.counts = dict.fromkeys(("registers", "reports", "snapshots", "heartbeats", "unanswered"), 0)

    def start(self) -> Node:
        """Serve, and join the controller's fleet from a background thread.  Returns ``self``."""
        if self.server is not None:
            self.server.start()
        self._thread.start()
        return self

    def watch(self, stack: TierStack, *, coded_cache_bytes: int = 64 << 20) -> None:
        """Report what ``stack``'s CPU tier stores and drops (a listener on its observers), and code
        blobs for coded reads under that tier's seal (``Recoder``, keeping ``coded_cache_bytes``).
        O(1)."""
        stack.observers.add(self.listener)
        if self.server is not None and self.cpu is not None and self.cpu in stack.tiers:
            self.server.recoder = Recoder(stack.seals[stack.tiers.index(self.cpu)], coded_cache_bytes)

    def note(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Queue holdings changes for the next report.  O(keys)."""
        with self._lock:
            if self._snapshot:
                return               # the snapshot to come says it all
            if stored:
                self._events.append((True, list(stored)))
            if removed:
                self._events.append((False, list(removed)))
            self._pending += len(stored) + len(removed)
            if self._pending > _MAX_EVENTS:
                self._snapshot = True
                self._events.clear()
                self._pending = 0

    def resync(self) -> None:
        """Send a snapshot of the CPU tier instead of the queued changes (it lost track).  O(1)."""
        with self._lock:
            self._snapshot = True
            self._events.clear()
            self._pending = 0
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - the node goes on; the next round retries
                log.warning("radixkv p2p: %s: %s", type(e).__name__, e)
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()

    def _round(self) -> None:
        """One heartbeat round: register if needed, then a snapshot or the queued reports, or a
        heartbeat.  Each call waits at most the client's timeout."""
        if not self._registered:
            answer = self.client.call(Register(self.instance, self.incarnation, self.endpoint, self.transport,
                                               self.agent.metadata if self.agent is not None else b""), force=True)
            if not isinstance(answer, Ack) or answer.status != "ok":
                self.counts["unanswered"] += answer is None
                return
            self.counts["registers"] += 1
            self._registered = True
            self.resync()
        sent = False
        with self._lock:
            snapshot = self._snapshot
            if snapshot:
                self._snapshot = False
            batches = self._take()
        if snapshot:
            keys = [e.key for e in self.cpu.entries()] if self.cpu is not None else []
            chunks = [keys[i:i + _REPORT_BATCH] for i in range(0, len(keys), _REPORT_BATCH)] or [[]]
            for i, part in enumerate(chunks):
                if not self._send(Report(self.instance, self.incarnation, self._seq, i == 0, snapshot_batch(part))):
                    self.resync()       # sent in part, or not at all: the next round starts over
                    return
            self.counts["snapshots"] += 1
            sent = True
        for k, batch in enumerate(batches):
            if not self._send(Report(self.instance, self.incarnation, self._seq, False, batch)):
                self._requeue(batches[k:])
                return
            sent = True
        if not sent:
            answer = self.client.call(Heartbeat(self.instance, self.incarnation), force=True)
            self.counts["heartbeats"] += 1
            self._after(answer)

    def _take(self) -> list[EventBatch]:
        # Lock held.  The queued changes as report batches, oldest first.
        events: list[Any] = []
        while self._events:
            stored, names = self._events.popleft()
            for i in range(0, len(names), _REPORT_BATCH):
                part: list[Any] = names[i:i + _REPORT_BATCH]
                events.append(BlockStored(block_hashes=part, parent_block_hash=None, token_ids=[], block_size=0,
                                          lora_id=None, medium="CPU", lora_name=None) if stored
                              else BlockRemoved(block_hashes=part, medium="CPU"))
        self._pending = 0
        return [EventBatch(ts=time.time(), events=events[i:i + 64]) for i in range(0, len(events), 64)]

    def _send(self, report: Report) -> bool:
        """Send one report; whether the controller took it (else the state is set for the next round)."""
        answer = self.client.call(report, force=True)
        if isinstance(answer, Ack) and answer.status == "ok":
            self._seq += 1
            self.counts["reports"] += 1
            self._departures(answer)
            return True
        self._after(answer)
        return False

    def _departures(self, answer: Ack) -> None:
        """End the pins of the instances the controller says left."""
        if answer.departed and self.server is not None:
            self.server.release_from(answer.departed)

    def _requeue(self, batches: list[EventBatch]) -> None:
        """Put unsent batches back in front of the queue (the controller did not answer: the same
        ``seq`` goes again; had it applied one, it answers ``"resync"`` and a snapshot follows)."""
        with self._lock:
            if self._snapshot:
                return
            for batch in reversed(batches):
                for ev in reversed(batch.events):
                    if isinstance(ev, (BlockStored, BlockRemoved)):
                        self._events.appendleft((isinstance(ev, BlockStored), [bytes(h) for h in ev.block_hashes
                                                                               if isinstance(h, bytes)]))
                        self._pending += len(ev.block_hashes)

    def _after(self, answer: Any) -> None:
        if isinstance(answer, Ack):
            self._departures(answer)
        if answer is None:
            self.counts["unanswered"] += 1
        elif isinstance(answer, Ack) and answer.status == "unknown":
            self._registered = False
            self._wake.set()
        elif isinstance(answer, Ack) and answer.status == "resync":
            self.resync()

    def close(self) -> None:
        """Leave the fleet (a ``Deregister`` sent without waiting), stop serving.  Bounded."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.client.channel.tell(Deregister(self.instance, self.incarnation))
        time.sleep(0.01)          # let the message leave before the socket closes
        self.client.close()
        if self.server is not None:
            self.server.close()
        if self.agent is not None:
            self.agent.deregister_all()

    def check(self) -> None:
        """The server's invariants, and the queue's count.  O(queued + pins)."""
        if self.server is not None:
            self.server.check()
            if self.server.recoder is not None:
                self.server.recoder.check()
        with self._lock:
            assert self._pending <= _MAX_EVENTS, "report queue over its bound"


def join(tiers: list[Tier], namespace: Namespace, *, controller: str, secret: bytes | str | None,
         instance: str | None = None, address: str | None = None, transport: str = "nixl",
         timeout_s: float | None = None, codec: str | None = None) -> tuple[list[Tier], Node]:
    """``tiers`` with a ``PeerTier`` placed after the local ones (before S3, Redis), and the
    ``Node`` serving the first ``CpuTier`` among them, not started (the configuration factory starts
    it once the stack is built and watches it).  ``controller`` is the controller's endpoint,
    ``secret`` the deployment secret that signs every message, ``address`` where this node serves,
    ``timeout_s`` the bound on a peer read (the configuration's ``remote_timeout``).  The instance
    id is ``instance`` (default: host name and process id), with ``/tp<rank>`` appended under
    tensor parallelism.  ``transport="nixl"`` without NIXL installed falls back to pyzmq, with a
    warning.  ``codec``: what the peer tier asks peers to code their blobs with (``PeerTier``'s).
    Cost: a socket bind and, with NIXL, one registration of the CPU tier's arena."""
    from radixkv.backends.cpu import CpuTier
    from radixkv.p2p.tier import DEFAULT_TIMEOUT_S, PeerTier
    from radixkv.p2p.transport import available

    instance = instance or f"{socket.gethostname()}-{os.getpid()}"
    if namespace.tp_size > 1:
        instance = f"{instance}/tp{namespace.tp_rank}"
    if transport == "nixl" and not available():
        log.warning("radixkv p2p: p2p_transport is nixl but NIXL does not load here; using pyzmq")
        transport = "zmq"
    cpu = next((t for t in tiers if isinstance(t, CpuTier)), None)
    node = Node(controller=controller, secret=secret, instance=instance,
                address=address, transport=transport, cpu=cpu)
    peer = PeerTier(controller, secret, instance=instance, transport=transport, node=node, codec=codec,
                    timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    at = next((i for i, t in enumerate(tiers) if not t.local), len(tiers))
    return [*tiers[:at], peer, *tiers[at:]], node
