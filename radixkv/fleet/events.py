"""KV events in vLLM's wire format, and the ZMQ publisher and subscriber that carry them.

What a prefix cache holds, told as events, so that a router (``radixkv.fleet.Index``) can send a
request to the engine that already holds its prefix.  The format is vLLM's own
(``vllm/distributed/kv_events.py``, v0.32): any consumer of vLLM's events reads ours, and ours read
vLLM's.

Contract:

* **Structs.**  ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` are msgspec structs with
  vLLM's names, field order and settings: a msgpack *map* per event, tagged ``"type": "<class
  name>"``, default-valued trailing fields left out (``omit_defaults``).  ``EventBatch`` is a
  msgpack *array* ``[ts, events, data_parallel_rank]`` (``array_like``; the rank left out when
  ``None``).  ``encode_batch`` of an ``EventBatch`` is byte-identical to vLLM's encoder on vLLM's
  struct with the same values, and ``decode_batch`` reads vLLM's bytes (fields a newer vLLM adds
  are skipped).  Block hashes are ints (the low 64 bits, vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or bytes; see ``radixkv.fleet.hashing``.
* **Transport** (vLLM's ``ZmqEventPublisher``).  A PUB socket sends each batch as three frames:
  topic, the sequence number as 8 bytes big-endian, the payload.  Sequence numbers count from
  ``start_seq`` (0, as vLLM's do after every start).  The last ``buffer_steps`` payloads stay in a
  replay buffer; an optional ROUTER socket answers a request ``[b"", start_seq as 8 bytes]`` with
  ``[b"", topic, seq, payload]`` for each buffered batch ``>= start_seq``, then ``[b"", b"", -1 as
  8 bytes signed, b""]``.
* **Bounded waits.**  ``Publisher.publish`` waits at most ``timeout`` for room in its queue
  (``TimeoutError``), ``close`` at most ``timeout`` for the sender thread; ``Subscriber.recv`` at
  most ``timeout`` for a message and ``replay_timeout`` for a replay.
* **Order.**  ``Subscriber.recv`` returns batches in sequence order: on a gap it asks the replay
  socket for the missing ones and returns those it got before the one that revealed the gap; the
  ones the publisher no longer buffers are counted in ``lost`` (a consumer such as ``Index`` sees
  the hole in the sequence numbers).  A sequence number below the expected one is a publisher
  restart (``restarts``): it starts a new run.  A subscriber's first message, or a restart's, with
  a sequence number above 0 asks for the ones before it (``from_start=True``).

pyzmq and msgspec are the ``fleet`` extra (``pip install 'radixkv[fleet]'``); pyzmq is imported
when a socket is made.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Sequence, Union

try:
    import msgspec
except ImportError as e:  # pragma: no cover - exercised where msgspec is missing
    raise ImportError("radixkv.fleet.events needs msgspec and pyzmq: pip install 'radixkv[fleet]'") from e

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent",
           "Publisher", "Subscriber", "decode_batch", "encode_batch"]

log = logging.getLogger(__name__)

#: A block hash as events carry it: the low 64 bits of vLLM's hash (the default), or its bytes.
ExternalBlockHash = Union[bytes, int]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - exercised where pyzmq is missing
        raise ImportError("radixkv.fleet's publisher and subscriber need pyzmq: "
                          "pip install 'radixkv[fleet]'") from e
    return zmq


# The structs below mirror vLLM's field for field: the order of the fields is the order on the
# wire, and which have defaults decides what omit_defaults leaves out.  Change neither.

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (a msgpack map tagged ``"type"`` with the class name)."""


class BlockStored(KVCacheEvent):
    """The publisher now holds ``block_hashes`` (a chain: each block's parent is the one before
    it, the first's is ``parent_block_hash``) on ``medium`` (``"GPU"``, ``"CPU"``, ``"STORAGE"``)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """The publisher no longer holds ``block_hashes`` on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher dropped every block (vLLM: a prefix-cache reset)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``, as vLLM's publisher encodes it.  O(size of the batch).

    >>> b = EventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[7], medium="GPU")])
    >>> decode_batch(encode_batch(b)) == b
    True
    """
    if not isinstance(batch, EventBatch):
        raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The ``EventBatch`` in ``payload`` (ours or vLLM's); ``ValueError`` when it is not one.
    O(size of the payload)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"payload is not an EventBatch: {e}") from e


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class Publisher:
    """Publishes event batches on a ZMQ PUB socket, with a replay buffer and a ROUTER socket that
    serves it (see the module docstring).

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://127.0.0.1:*`` picks a free port; the
    bound addresses are ``self.endpoint`` and ``self.replay_endpoint``).  One sender thread owns
    both sockets; ``publish`` encodes in the caller's thread and queues.  Memory: the queue
    (``max_queue`` batches) and the replay buffer (``buffer_steps`` payloads).
    """

    #: How long the sender thread waits for a batch before it looks at the replay socket again.
    POLL_S = 0.02

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000,
                 data_parallel_rank: int | None = None, start_seq: int = 0) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if isinstance(start_seq, bool) or not isinstance(start_seq, int) or start_seq < 0:
            raise ValueError(f"start_seq must be an int >= 0, got {start_seq!r}")
        zmq = _zmq()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets()
            raise
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = start_seq
        self._running = True
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch | Sequence[KVCacheEvent], timeout: float = 1.0) -> int:
        """Queue ``batch`` (or a list of events, stamped now) and return its sequence number.
        ``TimeoutError`` if the queue stays full for ``timeout`` seconds (nothing is numbered
        then).  O(size of the batch): the encoding."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if not isinstance(batch, EventBatch):
            batch = EventBatch(ts=time.time(), events=list(batch))  # type: ignore[arg-type]
        if batch.data_parallel_rank is None and self._rank is not None:
            batch = EventBatch(ts=batch.ts, events=batch.events, data_parallel_rank=self._rank)
        payload = encode_batch(batch)
        with self._lock:
            seq = self._next_seq
            try:
                self._queue.put((seq, payload), timeout=timeout)
            except queue.Full:
                raise TimeoutError(f"publish: the queue stayed full for {timeout} s") from None
            self._next_seq = seq + 1
        return seq

    @property
    def buffered(self) -> int:
        """How many batches the replay buffer holds now (at most ``buffer_steps``)."""
        return len(self._buffer)

    @property
    def last_sent(self) -> int | None:
        """The sequence number of the last batch sent (``None`` before the first)."""
        buf = self._buffer
        return buf[-1][0] if buf else None

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad request never stops the publisher
                    log.exception("radixkv: KV-event replay failed")
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            seq, payload = item
            try:
                self._pub.send_multipart((self._topic, _seq_bytes(seq), payload))
            except Exception:  # noqa: BLE001 - the batch stays in the buffer for a replay
                log.exception("radixkv: sending KV events failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("radixkv: malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, _seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), stop, close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Reads a publisher's batches in sequence order and fills gaps from its replay socket (see
    the module docstring).  Not thread-safe: one thread calls ``recv``.

    ``bind=True`` binds the SUB socket at ``endpoint`` instead of connecting to it: vLLM's
    publisher *connects* to an endpoint without a wildcard (``tcp://127.0.0.1:5557``) and binds
    only wildcard ones (``tcp://*:5557``, every interface), so a consumer of a vLLM instance on
    loopback binds.  The replay socket is always the publisher's to bind.

    Counters: ``received`` (batches returned), ``replayed`` (of those, from a replay), ``lost``
    (sequence numbers a replay could not fill), ``restarts``, ``bad`` (payloads that were not an
    ``EventBatch``, skipped).
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 replay_timeout: float = 1.0, from_start: bool = True, bind: bool = False) -> None:
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be positive, got {replay_timeout}")
        zmq = _zmq()
        self._zmq = zmq
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self.replay_timeout = replay_timeout
        self.from_start = from_start
        #: The sequence number expected next (``None`` before the first message).
        self.next_seq: int | None = None
        self.received = self.replayed = self.lost = self.restarts = self.bad = 0

    def recv(self, timeout: float = 1.0) -> list[tuple[int, EventBatch]]:
        """Wait up to ``timeout`` seconds for the next message; return ``(seq, batch)`` pairs in
        order: the replayed batches a gap was missing, then the message's own ( ``[]`` on timeout).
        Cost: one decode per batch; a gap adds one replay round trip (at most ``replay_timeout``)."""
        if not self._sub.poll(int(timeout * 1000)):
            return []
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad += 1
            return []
        seq = int.from_bytes(frames[1], "big", signed=True)
        out: list[tuple[int, EventBatch]] = []
        start = self.next_seq
        if start is not None and seq < start:
            self.restarts += 1
            start = None
        if start is None:
            start = 0 if self.from_start else seq
        if seq > start:
            out = self._fill(start, seq)
        try:
            out.append((seq, decode_batch(frames[2])))
        except ValueError:
            self.bad += 1
        self.next_seq = seq + 1
        self.received += len(out)
        return out

    def _fill(self, start: int, stop: int) -> list[tuple[int, EventBatch]]:
        """The batches ``start <= seq < stop`` the replay socket still has; counts the rest lost."""
        got: dict[int, EventBatch] = {}
        if self._replay is not None:
            while self._replay.poll(0):               # leftovers of a replay that timed out
                self._replay.recv_multipart()
            self._replay.send_multipart((b"", _seq_bytes(start)))
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._replay.poll(max(1, int(left * 1000))):
                    log.warning("radixkv: KV-event replay from %d timed out", start)
                    break
                frames = self._replay.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.bad += 1
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == -1:
                    break
                if start <= seq < stop:
                    try:
                        got[seq] = decode_batch(frames[3])
                    except ValueError:
                        self.bad += 1
        self.replayed += len(got)
        self.lost += (stop - start) - len(got)
        return sorted(got.items())

    def close(self) -> None:
        """Close the sockets (nothing waits)."""
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
