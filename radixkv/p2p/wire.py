"""The signed messages of peer-to-peer sharing: instances <-> controller, instance <-> instance.

Every message is an ``Envelope`` (a request id, the sender's wall-clock time and one body) encoded
with msgspec's msgpack, preceded by an HMAC-SHA256 of the encoding under a key derived from the
deployment secret (``radixkv.config``'s ``secret`` / ``RADIXKV_SECRET``).  ``Signer.open`` refuses
(``Refused``) a message whose MAC is missing or wrong, that does not decode, or whose time is more
than ``max_skew_s`` (60 s) from the receiver's clock, so a captured message cannot be replayed
much later.  The receivers drop refused messages without an answer.

``Channel`` asks one endpoint (a DEALER socket: one request at a time, each wait bounded by a
deadline, late answers told apart by their request id and dropped); ``Server`` answers on a ROUTER
socket bound to the one address it is given, on a thread of its own.

Frames on the wire: ``[mac, envelope, *blobs]``.  The blobs after the envelope (the chunk bytes a
``Fetch`` answers with) are not covered by the MAC: each is a sealed chunk that the reading stack
verifies against its own key, parent and tokens (``radixkv.core.format``), so a changed blob is a miss;
the envelope says how many there are and how long each is.

Bodies: to the controller ``Register``, ``Heartbeat``, ``Deregister``, ``Report`` (a batch of the
sender's CPU-tier holdings as vLLM-format KV events, block names the 24-byte tier keys),
``PeerLookup`` and ``Lookup``; to a peer ``Pin``, ``Release`` and ``Fetch``.  Answers: ``Ack``,
``PeerAnswer``, ``Holdings``, ``Pinned`` and ``Blobs``.

>>> s = Signer("a deployment secret of 16+ bytes")
>>> frames = s.seal(7, Heartbeat(instance="a", incarnation="x"))
>>> s.open(frames).body
Heartbeat(instance='a', incarnation='x')
>>> Signer("another secret, 16+ bytes long").open(frames)
Traceback (most recent call last):
radixkv.p2p.wire.Refused: wrong MAC
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence, Union

import msgspec

from radixkv.fleet.events import EventBatch

__all__ = ["Ack", "Blobs", "Channel", "Deregister", "Envelope", "Fetch", "Heartbeat", "Holdings", "Lookup",
           "PeerAnswer", "PeerLookup", "Pin", "Pinned", "Refused", "Register", "Release", "Report", "Server", "Signer",
           "check_endpoint", "secret_of"]

log = logging.getLogger(__name__)

_CONTEXT = b"radixkv p2p control v1"
_CONNECT_WAIT_S = 0.25   # how long a request waits for its endpoint's connection (a dead one never comes)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - exercised where pyzmq is missing
        raise ImportError("peer-to-peer sharing needs pyzmq: pip install 'radixkv[p2p]'") from e
    return zmq


class Register(msgspec.Struct, tag=True, frozen=True):
    """An instance joins (or rejoins): its id, this run's ``incarnation`` (random per start), the
    address of its request channel (``""``: it serves nothing), its transport and NIXL metadata."""

    instance: str
    incarnation: str
    endpoint: str
    transport: str
    metadata: bytes = b""


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """An instance is alive."""

    instance: str
    incarnation: str


class Deregister(msgspec.Struct, tag=True, frozen=True):
    """An instance leaves: its holdings are dropped."""

    instance: str
    incarnation: str


class Report(msgspec.Struct, tag=True, frozen=True):
    """Batch ``seq`` of an instance's CPU-tier holdings; ``snapshot``: all it holds (replaces)."""

    instance: str
    incarnation: str
    seq: int
    snapshot: bool
    batch: EventBatch


class PeerLookup(msgspec.Struct, tag=True, frozen=True):
    """Which live instance other than ``instance`` holds the longest leading run of ``keys``."""

    instance: str
    keys: list[bytes]


class Lookup(msgspec.Struct, tag=True, frozen=True):
    """For a router: how many leading ``names`` each live instance holds."""

    names: list[bytes]


class Pin(msgspec.Struct, tag=True, frozen=True):
    """Hold the leading ``keys`` the peer holds for ``ttl_s`` seconds, for a NIXL read."""

    requester: str
    keys: list[bytes]
    ttl_s: float


class Release(msgspec.Struct, tag=True, frozen=True):
    """The read of pin ``pin`` is over."""

    pin: int


class Fetch(msgspec.Struct, tag=True, frozen=True):
    """The blobs of the leading ``keys`` the peer holds, in the answer (the pyzmq transport, and
    every coded read).  ``codec``: the codec (``radixkv.core.codec``) the reader asks the blobs to
    be coded with (``""``: raw); a peer that cannot code them sends them raw, which every reader
    accepts."""

    keys: list[bytes]
    codec: str = ""


class Ack(msgspec.Struct, tag=True, frozen=True):
    """``"ok"``; ``"unknown"`` (register again, then send a snapshot); ``"resync"`` (send a snapshot).
    ``departed``: to a member, the instances that left the fleet since its last message (their pins
    on it may end at once)."""

    status: str
    departed: tuple[str, ...] = ()


class PeerAnswer(msgspec.Struct, tag=True, frozen=True):
    """The peer holding the longest run (``count`` leading keys; 0 and ``peer=""`` for none)."""

    peer: str
    incarnation: str
    endpoint: str
    transport: str
    metadata: bytes
    count: int


class Holdings(msgspec.Struct, tag=True, frozen=True):
    """Leading names held, per live instance (instances holding none left out)."""

    counts: dict[str, int]


class Pinned(msgspec.Struct, tag=True, frozen=True):
    """Pin ``pin``: NIXL agent ``agent``'s arena at address ``base``; ``(offset, length)`` per
    leading key pinned (fewer than asked where the peer stopped holding them, or its pin budget ran out)."""

    pin: int
    agent: str
    base: int
    spans: list[tuple[int, int]]


class Blobs(msgspec.Struct, tag=True, frozen=True):
    """The lengths of the blobs that follow the envelope, one per leading key held."""

    lengths: list[int]


Body = Union[Register, Heartbeat, Deregister, Report, PeerLookup, Lookup, Pin, Release, Fetch, Ack, PeerAnswer,
             Holdings, Pinned, Blobs]


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """Request id (answers repeat it), the sender's ``time.time()``, the body."""

    rid: int
    ts: float
    body: Body


class Refused(ValueError):
    """A message that is not signed with the deployment secret, does not decode, or is too old."""


def secret_of(secret: bytes | str | None) -> bytes:
    """The deployment secret as bytes: ``secret``, else ``RADIXKV_SECRET``; ``ValueError`` when
    neither is set or it is shorter than 16 bytes (peers authenticate with it).  O(1)."""
    if secret is None:
        secret = os.environ.get("RADIXKV_SECRET") or None
    if secret is None:
        raise ValueError("secret: peer-to-peer sharing needs the deployment secret (secret: or RADIXKV_SECRET); "
                         "peers and the controller authenticate every message with it")
    value = secret.encode() if isinstance(secret, str) else secret
    if not isinstance(value, bytes) or len(value) < 16:
        raise ValueError("secret must be a string of at least 16 bytes (a random deployment secret)")
    return value


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


class Signer:
    """Seals and opens messages under a key derived from the deployment ``secret`` (see the module
    docstring).  Immutable, thread-safe; the secret is not kept.  Each call: one HMAC-SHA256 of the
    envelope (not of the blobs) and one msgpack encode or decode."""

    __slots__ = ("_key", "max_skew_s")

    def __init__(self, secret: bytes | str | None, *, max_skew_s: float = 60.0) -> None:
        self._key = hmac.new(secret_of(secret), _CONTEXT, hashlib.sha256).digest()
        if isinstance(max_skew_s, bool) or not isinstance(max_skew_s, (int, float)) or max_skew_s <= 0:
            raise ValueError(f"max_skew_s must be a positive number, got {max_skew_s!r}")
        self.max_skew_s = float(max_skew_s)

    def __repr__(self) -> str:
        return "Signer(<secret>)"

    def seal(self, rid: int, body: Any, blobs: Sequence[Any] = ()) -> list[Any]:
        """The frames of a message: ``[mac, envelope, *blobs]``."""
        payload = _encoder.encode(Envelope(rid, time.time(), body))
        return [hmac.new(self._key, payload, hashlib.sha256).digest(), payload, *blobs]

    def open(self, frames: Sequence[Any]) -> Envelope:
        """The envelope of ``frames`` (``[mac, envelope, *blobs]``); ``Refused`` unless it is signed
        with this secret, decodes, and was sent within ``max_skew_s`` of now."""
        if len(frames) < 2:
            raise Refused("not a signed message")
        mac, payload = bytes(frames[0]), bytes(frames[1])
        if not hmac.compare_digest(mac, hmac.new(self._key, payload, hashlib.sha256).digest()):
            raise Refused("wrong MAC")
        try:
            envelope = _decoder.decode(payload)
        except msgspec.DecodeError as e:
            raise Refused(f"undecodable message: {e}") from None
        if abs(time.time() - envelope.ts) > self.max_skew_s:
            raise Refused("message too old (or the clocks disagree)")
        return envelope


def check_endpoint(endpoint: Any, name: str) -> str:
    """``endpoint`` if it is a ZMQ address with a host (``tcp://host:port``, ``ipc://path``);
    ``TypeError``/``ValueError`` naming ``name`` otherwise.  O(len)."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a str like 'tcp://127.0.0.1:5601', got {type(endpoint).__name__}")
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "ipc" and rest:
        return endpoint
    if scheme != "tcp" or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{name} must be tcp://HOST:PORT with a port up to 65535 (or ipc://PATH), got {endpoint!r}")
    return endpoint


class Channel:
    """Requests to one endpoint over a DEALER socket, signed by ``signer``.  ``ask`` sends one
    request and waits for its answer until a deadline; one request at a time (a lock), answers of
    earlier requests that came late are dropped by request id, unsigned ones are dropped and counted
    in ``refused``.  A request waits at most 0.25 s for its endpoint's connection (``IMMEDIATE``:
    nothing is queued for an endpoint not connected), so a dead peer or controller costs little to
    ask.  Thread-safe."""

    def __init__(self, endpoint: str, signer: Signer) -> None:
        zmq = _zmq()
        self.endpoint = check_endpoint(endpoint, "endpoint")
        self._signer = signer
        self._zmq = zmq
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 16), (zmq.RECONNECT_IVL, 100),
                              (zmq.RECONNECT_IVL_MAX, 1000)):
            self._sock.setsockopt(option, value)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._rid = 0
        self.refused = 0
        self._closed = False

    def ask(self, body: Any, deadline: float, blobs: Sequence[Any] = ()) -> tuple[Any, list[memoryview]] | None:
        """Send ``body`` (and ``blobs``) and return the answer's body and blobs, or ``None`` when no
        signed answer came by ``deadline`` (``time.monotonic()``) or the endpoint is not connected.
        Cost: one round trip, waited for at most until the deadline."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        try:
            if self._closed:
                return None
            self._rid += 1
            rid = self._rid
            # Not connected (yet, or any more): wait a little for the connection, never past the deadline.
            ready = min(deadline - time.monotonic(), _CONNECT_WAIT_S)
            if ready <= 0 or not self._sock.poll(max(1, int(ready * 1000)), self._zmq.POLLOUT):
                return None
            try:
                self._sock.send_multipart(self._signer.seal(rid, body, blobs), flags=self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                return None
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                    return None
                frames = self._sock.recv_multipart(copy=False)
                try:
                    envelope = self._signer.open([f.bytes for f in frames[:2]])
                except Refused:
                    self.refused += 1
                    continue
                if envelope.rid == rid:
                    return envelope.body, [f.buffer for f in frames[2:]]
        finally:
            self._lock.release()

    def tell(self, body: Any) -> bool:
        """Send ``body`` without waiting for an answer (its answer is dropped as late); whether it
        went out.  Never blocks.  O(1)."""
        with self._lock:
            if self._closed:
                return False
            self._rid += 1
            try:
                self._sock.send_multipart(self._signer.seal(self._rid, body), flags=self._zmq.NOBLOCK)
                return True
            except self._zmq.Again:
                return False

    def close(self) -> None:
        """Close the socket (pending messages are dropped).  Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(linger=0)


Handler = Callable[[Any, list[memoryview]], "tuple[Any, Sequence[Any]] | None"]


class Server:
    """Answers signed requests on a ROUTER socket bound to ``bind`` (that address only; a port 0
    is replaced by the one bound, see ``address``), on a thread of its own.  ``handle(body, blobs)``
    returns ``(answer body, answer blobs)`` or ``None`` (no answer); unsigned, wrongly signed or
    stale messages get no answer and are counted in ``refused`` (logged once per minute).
    ``tick()`` runs on the same thread at least every ``tick_s`` seconds (expiry, progress of
    transfers).  A handler that raises is logged once per minute and the request gets no answer:
    the thread never dies of it."""

    def __init__(self, bind: str, signer: Signer, handle: Handler, *, tick: Callable[[], object] | None = None,
                 tick_s: float = 0.05, name: str = "radixkv-server") -> None:
        zmq = _zmq()
        check_endpoint(bind, "bind")
        self._zmq = zmq
        self._signer = signer
        self._handle = handle
        self._tick = tick
        self.tick_s = float(tick_s)
        self.name = name
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(bind)
        #: The address bound (with the real port when ``bind`` said 0).
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.refused = 0
        self.errors = 0
        self._last_log = {"refused": 0.0, "error": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Server:
        """Start answering.  Returns ``self``."""
        self._thread.start()
        return self

    def _burst(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log[kind] >= 60.0:
            self._last_log[kind] = now
            log.warning(message, *args)

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                ready = self._sock.poll(int(self.tick_s * 1000))
            except self._zmq.ZMQError:
                break
            if ready:
                self._serve_one()
            if self._tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.tick_s
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - the server goes on
                    self.errors += 1
                    self._burst("error", "%s: %s: %s", self.name, type(e).__name__, e)
        self._sock.close(linger=0)

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(copy=False)
        if len(frames) < 3:
            self.refused += 1
            return
        try:
            envelope = self._signer.open([frames[1].bytes, frames[2].bytes])
        except Refused as e:
            self.refused += 1
            self._burst("refused", "%s: refused a message (%s); unsigned or signed with another secret", self.name, e)
            return
        try:
            answer = self._handle(envelope.body, [f.buffer for f in frames[3:]])
        except Exception as e:  # noqa: BLE001 - a bad request must not end the server
            self.errors += 1
            self._burst("error", "%s: %s: %s", self.name, type(e).__name__, e)
            return
        if answer is not None:
            body, blobs = answer
            try:
                self._sock.send_multipart([frames[0], *self._signer.seal(envelope.rid, body, blobs)],
                                          flags=self._zmq.NOBLOCK, copy=False)
            except self._zmq.ZMQError:
                pass                 # the asker is gone: its answer is dropped

    def close(self, timeout: float = 2.0) -> None:
        """Stop answering and close the socket (within ``timeout`` seconds).  Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._thread.ident:
            self._sock.close(linger=0)
