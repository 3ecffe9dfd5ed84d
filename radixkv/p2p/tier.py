"""``PeerTier``: the CPU tiers of the other instances of the fleet, read directly (peer to peer).

A remote, read-only tier that a stack places between its local tiers and the shared remote ones
(``p2p_enabled: true``; ``radixkv.p2p.node`` builds it with the serving side).

Storage contract:

* **Reads only.**  ``put`` stores nothing (``False``), ``delete`` deletes nothing: what a peer
  holds is its own.  ``Tier.peer`` tells the stack so: it writes and promotes nothing into this
  tier, and verifies its blobs with the local tiers' seal (they are the peers' local blobs).
* **Lookup** (``contains_prefix``): one round trip to the controller (``radixkv.p2p.controller``),
  which names the live peer (never this instance) holding the longest leading run of the keys.
  The answer is remembered per key (at most ``max_remembered`` keys), so that ``get_many`` goes to
  that peer without asking again.
* **Load** (``get_many``): per run of keys one peer holds, with ``transport="nixl"`` a ``Pin``
  request (the peer leases the slots and says where they lie), one NIXL READ of them all into a
  registered staging buffer, and a ``Release``; with ``"zmq"`` (or a peer without NIXL) a
  ``Fetch`` whose answer carries the blobs.  With ``codec`` (``peer_codec``: ``int8``,
  ``cachegen``, ...), every load is a ``Fetch`` asking the peer to code its blobs
  (``radixkv.p2p.node.Recoder``): fewer bytes on the link for the peer's CPU time; what comes back
  coded lossily is approximate KV, counted apart by the stack as any lossy chunk
  (``radixkv.core.stack``), and the peer may answer raw.  Only the leading keys the peer still holds come
  back: a controller entry gone stale is a short answer (a miss), never an error.
* **Blobs over NIXL are views** (``radixkv.p2p.staging``): read-only ``memoryview`` slices of the
  staging buffer, which is not written again while any of them (or anything made from one) is
  alive.  Hold them only as long as needed: while all ``staging_buffers`` buffers are held, a
  read is copied out into new ``bytes`` instead.  What keeps a blob past the load copies it (the
  stack's promotion does).
* **Faults.**  Every wait ends at the caller's deadline (``radixkv.backends.bounded``, else
  ``timeout_s``): a peer that died or hangs mid-transfer is a miss, and so is a NIXL read that
  cannot have the agent by then (another read's transfer or the agent's start holds it; counted in
  ``agent_busy``, the peer's breaker not told).  A breaker per peer
  (``CircuitBreaker``: 2 failures in a row open it, for 1 s doubling to 5 s) keeps requests away
  from a failing peer; the next request after the back-off probes it.  A controller that does not
  answer means no peer (asked again after 1 s).
* **Trust.**  Every message is signed with the deployment secret (``radixkv.p2p.wire``); every
  blob is verified by the stack like any chunk (MAC, key, parent, tokens), so a peer that returns
  forged or stale bytes causes a miss (counted in ``forged``/``corrupt``), never wrong KV.
* Thread-safe (a lock per peer channel and one around the NIXL agent and its staging buffers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Iterator, Sequence

from radixkv.backends import register
from radixkv.core.codec import get_codec
from radixkv.core.deadline import current_max_blob_bytes
from radixkv.core.format import chunk_codec
from radixkv.core.tier import Blob, Entry, Tier, check_key, check_namespace_id
from radixkv.backends.remote import CircuitBreaker, call_deadline
from radixkv.p2p.controller import ControllerClient
from radixkv.p2p.staging import StagingRing
from radixkv.p2p.wire import Blobs, Channel, Fetch, PeerAnswer, Pin, Pinned, Release, Signer

__all__ = ["PeerTier"]

log = logging.getLogger(__name__)
_MAX_RETIRED = 4   # staging buffers left to an abandoned transfer before NIXL is given up for pyzmq
_WINDOW_BYTES = 1 << 20   # the smallest staging buffer
DEFAULT_TIMEOUT_S = 2.0   # the bound of a peer read without a caller's deadline


class _Peer:
    """What this tier keeps per peer run: its channel and breaker."""

    def __init__(self, answer: PeerAnswer, signer: Signer) -> None:
        self.answer = answer
        self.channel = Channel(answer.endpoint, signer)
        self.breaker = CircuitBreaker(failure_threshold=2, backoff_s=1.0, name=f"peer {answer.peer}")


class PeerTier(Tier):
    """Other instances' CPU tiers, through the controller at ``controller`` (see the module
    docstring).  ``instance``: this instance's id (excluded from lookups); ``transport``:
    ``"nixl"`` or ``"zmq"``; ``node``: the serving ``radixkv.p2p.Node`` closed with this tier;
    ``staging_buffers``: how many registered buffers of NIXL reads may be held by callers at once
    (each the size of the largest read, at least 1 MiB; one more is kept to copy out of);
    ``codec``: the codec to ask peers to send blobs in (``None``: raw; ``ValueError`` for an
    unknown name, ``ImportError`` naming the extra when its library is missing).  With NIXL, a
    thread starts the NIXL agent at once (1.7 s here, most of a read's default bound), so the
    first read does not; a read that comes while it starts waits for it."""

    name = "peer"
    local = False
    peer = True

    def __init__(self, controller: str, secret: bytes | str | None = None, *, instance: str,
                 transport: str = "zmq", node: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_remembered: int = 65536, staging_buffers: int = 4, codec: str | None = None) -> None:
        if transport not in ("nixl", "zmq"):
            raise ValueError(f"transport must be 'nixl' or 'zmq', got {transport!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if isinstance(staging_buffers, bool) or not isinstance(staging_buffers, int) or staging_buffers < 1:
            raise ValueError(f"staging_buffers must be a positive int, got {staging_buffers!r}")
        chosen = get_codec(codec)
        chosen.ready()
        #: The codec asked of peers ("" for raw).
        self.codec: str = codec if codec is not None and chosen.code else ""
        self.instance = instance
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.node = node
        self._signer = Signer(secret)
        self._controller = ControllerClient(controller, secret)
        self._holders: OrderedDict[bytes, PeerAnswer] = OrderedDict()
        self._max_remembered = max_remembered
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._lock = threading.Lock()
        self._agent: Any = None
        self._agent_lock = threading.Lock()
        self._staging_buffers = staging_buffers
        self._ring: StagingRing | None = None     # with the agent
        self._counts: Counter[str] = Counter(dict.fromkeys(
            ("lookups", "lookup_hits", "gets", "hits", "misses", "skipped", "failures", "nixl_reads", "zmq_reads",
             "coded_reads", "coded_blobs", "bytes_read", "oversize", "abandoned", "nixl_lent", "nixl_copied",
             "agent_busy"), 0))
        self._read_seconds = 0.0        # time in NIXL READs (the transfers alone)
        self._closed = False
        if transport == "nixl":
            # Importing NIXL and starting its agent takes 1.7 s here, most of the default 2-s bound
            # of the request whose read would start them: they start now, beside the engine.
            threading.Thread(target=self._start_agent, name="radixkv-nixl-start", daemon=True).start()

    # -- peers ----------------------------------------------------------------------------------

    def _remember(self, keys: Sequence[bytes], answer: PeerAnswer) -> None:
        with self._lock:
            for key in keys:
                self._holders[key] = answer
                self._holders.move_to_end(key)
            while len(self._holders) > self._max_remembered:
                self._holders.popitem(last=False)

    def _peer(self, answer: PeerAnswer) -> _Peer:
        """The channel and breaker of the peer run ``answer`` names (a new one when the peer
        restarted: a new incarnation, maybe a new address)."""
        with self._lock:
            peer = self._peers.get((answer.peer, answer.incarnation))
            if peer is None:
                for old in [k for k in self._peers if k[0] == answer.peer]:
                    self._peers.pop(old).channel.close()
                peer = self._peers[(answer.peer, answer.incarnation)] = _Peer(answer, self._signer)
            return peer

    # -- the Tier protocol ----------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys some live peer holds: one round trip to the controller, within the
        deadline (0 when it does not answer).  Remembers the peer for ``get_many``."""
        keys = [check_key(k) for k in keys]
        if not keys or self._closed:
            return 0
        answer = self._controller.peer_lookup(self.instance, keys, deadline=call_deadline(self.timeout_s))
        count = min(answer.count, len(keys))
        self._count(lookups=1, lookup_hits=int(count > 0))
        if count:
            self._remember(keys[:count], answer)
        return count

    def get(self, key: bytes) -> Blob | None:
        """The blob of ``key`` from the peer holding it, or ``None``.  See ``get_many``."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """The blobs of the leading ``keys`` peers deliver (``None`` from the first they do not on):
        per run of keys one peer holds, one pinned NIXL READ or one pyzmq fetch, all within one
        deadline.  A key no lookup named a peer for is asked of the controller first."""
        keys = [check_key(k) for k in keys]
        out: list[Blob | None] = [None] * len(keys)
        if self._closed:
            return out
        deadline = call_deadline(self.timeout_s)
        i = 0
        while i < len(keys):
            with self._lock:
                holder = self._holders.get(keys[i])
            if holder is None:
                holder = self._controller.peer_lookup(self.instance, keys[i:], deadline=deadline)
                if not holder.count:
                    break
                self._remember(keys[i:i + holder.count], holder)
            j = i + 1
            with self._lock:
                while j < len(keys) and self._holders.get(keys[j]) is holder:
                    j += 1
            blobs = self._read(holder, keys[i:j], deadline)
            out[i:i + len(blobs)] = blobs
            if not blobs:
                break
            i += len(blobs)      # a short answer (the peer's pin budget, or it lost a key): ask for the rest
        found = sum(b is not None for b in out)
        self._count(gets=len(keys), hits=found, misses=len(keys) - found)
        return out

    def _read(self, holder: PeerAnswer, keys: list[bytes], deadline: float) -> list[Blob]:
        """The leading blobs of ``keys`` that ``holder`` delivers by ``deadline``."""
        peer = self._peer(holder)
        epoch = peer.breaker.epoch
        if not peer.breaker.allow():
            self._count(skipped=len(keys))
            return []
        blobs: list[Blob] | None = None
        try:
            if not self.codec and self.transport == "nixl" and holder.transport == "nixl" and self._nixl_usable():
                blobs = self._read_nixl(peer, keys, deadline)
            else:
                blobs = self._fetch(peer, keys, deadline)
        finally:
            peer.breaker.record(blobs is not None, epoch)
            if blobs is None:
                self._count(failures=1)
        if blobs is None:
            return []
        limit = current_max_blob_bytes()
        for n, blob in enumerate(blobs):
            if limit is not None and len(blob) > limit:    # larger than a chunk: not one of ours
                self._count(oversize=1)
                return blobs[:n]
        return blobs

    def _fetch(self, peer: _Peer, keys: list[bytes], deadline: float) -> list[Blob] | None:
        answer = peer.channel.ask(Fetch(keys, self.codec), deadline)
        if answer is None or not isinstance(answer[0], Blobs):
            return None
        lengths, frames = answer[0].lengths, answer[1]
        if len(frames) != len(lengths) or len(frames) > len(keys) or \
                any(len(f) != n for f, n in zip(frames, lengths)):
            return None
        coded = sum(1 for f in frames if chunk_codec(f)) if self.codec else 0
        self._count(zmq_reads=1, bytes_read=sum(lengths), coded_reads=int(bool(self.codec)), coded_blobs=coded)
        return list(frames)

    def _read_nixl(self, peer: _Peer, keys: list[bytes], deadline: float) -> list[Blob] | None:
        answer = peer.channel.ask(Pin(self.instance, keys, max(0.0, deadline - time.monotonic()) + 1.0), deadline)
        if answer is None or not isinstance(answer[0], Pinned):
            return None
        pinned = answer[0]
        try:
            spans = pinned.spans[:len(keys)]
            if not spans:
                return []
            lengths = [n for _, n in spans]
            total = sum(lengths)
            # The agent lock is held by a read's transfer or by the agent's start (1.7 s here): a
            # read waits for it no longer than its own deadline, and is a miss if it must (not the
            # peer's fault: its breaker is not told).
            if not self._agent_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                self._count(agent_busy=1)
                return []
            try:
                agent, ring = self._nixl_agent()
                agent.add_peer(pinned.agent, peer.answer.metadata)
                staging = ring.take(total)
                lent = staging is not None
                if staging is None:                  # every lendable buffer is held: read, then copy out
                    staging = ring.scratch(total)
                base, local, at = staging.address(), [], 0
                for n in lengths:
                    local.append((base + at, n))
                    at += n
                t0 = time.perf_counter()
                done = agent.read(pinned.agent, local, [(pinned.base + o, n) for o, n in spans], deadline)
                self._read_seconds += time.perf_counter() - t0
                if not done:
                    self._retire(ring, staging)
                    return None
                blobs: list[Blob] = list(ring.lend(staging, lengths) if lent else ring.copy_out(staging, lengths))
            finally:
                self._agent_lock.release()
            self._count(nixl_reads=1, bytes_read=total, nixl_lent=int(lent), nixl_copied=int(not lent))
            return blobs
        finally:
            peer.channel.tell(Release(pinned.pin))

    def _start_agent(self) -> None:
        with self._agent_lock:
            if self._closed:
                return
            try:
                self._nixl_agent()
            except Exception as exc:     # noqa: BLE001 - the first read tries again and counts it
                log.debug("radixkv peer tier: the NIXL agent did not start ahead of the first read: %r", exc)

    def _nixl_usable(self) -> bool:
        """Whether NIXL is still used: fewer than ``_MAX_RETIRED`` transfers were abandoned (read
        without the agent lock, which a transfer holds: the count only grows)."""
        ring = self._ring
        return ring is None or ring.retired < _MAX_RETIRED

    def _nixl_agent(self) -> tuple[Any, StagingRing]:
        # Agent lock held.
        if self._agent is None:
            from radixkv.p2p.transport import Agent

            incarnation = getattr(self.node, "incarnation", "")
            self._agent = Agent(f"{self.instance}-{incarnation}-reader")
            self._ring = StagingRing(self._agent, max_buffers=self._staging_buffers, min_bytes=_WINDOW_BYTES)
        assert self._ring is not None
        return self._agent, self._ring

    def _retire(self, ring: StagingRing, staging: Any) -> None:
        # Agent lock held.  A transfer into ``staging`` was abandoned: it may still be written to.
        ring.retire(staging)
        self._count(abandoned=1)
        if ring.retired >= _MAX_RETIRED:
            log.warning("radixkv peer tier: %d NIXL transfers abandoned; reading over pyzmq from now on",
                        ring.retired)

    def put(self, key: bytes, blob: Blob) -> bool:
        """Stores nothing: ``False`` (a peer's tier is its own).  O(1)."""
        check_key(key)
        return False

    def put_many(self, items: Any) -> int:
        """Stores nothing: 0.  O(1)."""
        return 0

    def delete(self, key: bytes) -> bool:
        """Deletes nothing: ``False`` (the peer's own stack deletes a bad blob it reads).  O(1)."""
        check_key(key)
        with self._lock:
            self._holders.pop(key, None)     # not asked of that peer again without a new lookup
        return False

    def drop_namespace(self, ns_id: bytes) -> int:
        """Drops nothing of the peers': 0.  O(1)."""
        check_namespace_id(ns_id)
        return 0

    def entries(self, ns_id: bytes | None = None) -> Iterator[Entry]:
        """Nothing: the peers list their own.  O(1)."""
        return iter(())

    @property
    def used_bytes(self) -> int:
        """0: the tier holds nothing itself.  O(1)."""
        return 0

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def stats(self) -> dict[str, int | float]:
        """Counters (lookups, hits, misses, reads per transport, NIXL reads lent as views or copied
        out, failures, skipped by a breaker, abandoned transfers, reads that could not have the NIXL
        agent within their deadline), the time spent in NIXL READs,
        the staging buffers held by callers, and the peers known.  O(peers + staging buffers)."""
        with self._lock:
            counts = dict(self._counts)
            peers = len(self._peers)
            open_ = sum(p.breaker.state != "closed" for p in self._peers.values())
        with self._agent_lock:
            held = self._ring.held() if self._ring is not None else 0
        return {**counts, "used_bytes": 0, "peers": peers, "breakers_open": open_,
                "nixl_read_seconds": self._read_seconds, "staging_held": held}

    def close(self) -> None:
        """Close the channels, the controller client and the node (which leaves the fleet).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            peer.channel.close()
        self._controller.close()
        if self.node is not None:
            self.node.close()
        with self._agent_lock:
            if self._agent is not None:
                self._agent.deregister_all()
            if self._ring is not None:
                self._ring.close()

    def check(self) -> None:
        """Counters add up, the staging buffers check and as many are retired as transfers were
        abandoned, breakers and the node are consistent.  O(peers + staging buffers); waits for a
        NIXL read in flight."""
        super().check()
        with self._agent_lock:          # a read counts its outcome under it: counters and buffers agree
            with self._lock:
                c = dict(self._counts)
                peers = list(self._peers.values())
                assert len(self._holders) <= self._max_remembered, "remembers more keys than its bound"
            if self._ring is not None:
                self._ring.check()
                assert self._ring.retired == c["abandoned"], f"{self._ring.retired} retired buffers in {c}"
            else:
                assert c["abandoned"] == c["nixl_reads"] == 0, c
        assert all(v >= 0 for v in c.values()), f"negative counter in {c}"
        assert c["hits"] + c["misses"] == c["gets"], f"get outcomes != gets in {c}"
        assert c["lookup_hits"] <= c["lookups"]
        assert c["nixl_lent"] + c["nixl_copied"] == c["nixl_reads"], f"NIXL reads neither lent nor copied in {c}"
        for peer in peers:
            peer.breaker.check()
        if self.node is not None:
            self.node.check()

    def __repr__(self) -> str:
        return f"PeerTier({self.instance}, transport={self.transport})"


register("peer", PeerTier)
