"""KV events in vLLM's wire format: byte-identical to vLLM's own structs both ways, and a
publisher/subscriber pair over loopback TCP that fills a forced gap from the replay socket."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, strategies as st

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

import msgspec  # noqa: E402

from radixkv.fleet.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,  # noqa: E402
                                  Publisher, Subscriber, decode_batch, encode_batch)

LOOPBACK = "tcp://127.0.0.1:*"


@pytest.fixture(scope="module")
def vllm_events() -> Any:
    return pytest.importorskip("vllm.distributed.kv_events")


hash_st = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32))
opt_str = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE", "x"]))
opt_int = st.one_of(st.none(), st.integers(0, 5))
stored_st = st.fixed_dictionaries(
    {"block_hashes": st.lists(hash_st, max_size=4), "parent_block_hash": st.one_of(st.none(), hash_st),
     "token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=8), "block_size": st.integers(1, 64),
     "lora_id": opt_int, "medium": opt_str, "lora_name": opt_str},
    optional={"extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=3))),
                                                          max_size=3)),
              "group_idx": opt_int, "kv_cache_spec_kind": opt_str, "kv_cache_spec_sliding_window": opt_int,
              "locality": opt_str, "ownership": opt_str, "session_id": opt_str})
removed_st = st.fixed_dictionaries(
    {"block_hashes": st.lists(hash_st, max_size=4), "medium": opt_str},
    optional={"group_idx": opt_int, "locality": opt_str, "ownership": opt_str})
event_st = st.one_of(st.tuples(st.just("BlockStored"), stored_st), st.tuples(st.just("BlockRemoved"), removed_st),
                     st.tuples(st.just("AllBlocksCleared"), st.just({})))
batch_st = st.tuples(st.floats(allow_nan=False), st.lists(event_st, max_size=4), opt_int)


def build(module: Any, spec: tuple) -> Any:
    ts, events, rank = spec
    made = [getattr(module, kind)(**fields) for kind, fields in events]
    cls = module.KVEventBatch if hasattr(module, "KVEventBatch") else module.EventBatch
    return cls(ts=ts, events=made, data_parallel_rank=rank)


OURS = __import__("radixkv.fleet.events", fromlist=["x"])


@given(spec=batch_st)
def test_byte_identical_both_ways(vllm_events: Any, spec: tuple) -> None:
    ours, theirs = build(OURS, spec), build(vllm_events, spec)
    mine = encode_batch(ours)
    assert mine == msgspec.msgpack.encode(theirs)
    # vLLM's structs read our bytes into the same values, and we read theirs
    back = msgspec.msgpack.decode(mine, type=vllm_events.KVEventBatch)
    assert msgspec.msgpack.encode(back) == mine
    assert decode_batch(msgspec.msgpack.encode(theirs)) == ours


@pytest.mark.parametrize("event", [
    BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2], block_size=1,
                lora_id=None, medium="GPU", lora_name=None),
    BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32, token_ids=[], block_size=16,
                lora_id=3, medium="CPU", lora_name="l", extra_keys=[("salt",)], group_idx=1),
    BlockRemoved(block_hashes=[5], medium="STORAGE"),
    AllBlocksCleared(),
])
def test_each_event_type_round_trips(vllm_events: Any, event: Any) -> None:
    batch = EventBatch(ts=12.5, events=[event], data_parallel_rank=2)
    payload = encode_batch(batch)
    theirs = msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)
    assert type(theirs.events[0]).__name__ == type(event).__name__
    assert msgspec.msgpack.encode(theirs) == payload
    assert decode_batch(msgspec.msgpack.encode(theirs)) == batch
    assert msgspec.msgpack.decode(payload)[1][0]["type"] == type(event).__name__


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="batch"):
        encode_batch([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EventBatch"):
        decode_batch(b"\x01")
    with pytest.raises(ValueError, match="buffer_steps"):
        Publisher(LOOPBACK, buffer_steps=0)


def batch(i: int) -> EventBatch:
    return EventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")])


def recv_until(sub: Subscriber, n: int, deadline_s: float = 5.0) -> list[tuple[int, EventBatch]]:
    got: list[tuple[int, EventBatch]] = []
    end = time.monotonic() + deadline_s
    while len(got) < n and time.monotonic() < end:
        got += sub.recv(timeout=0.1)
    return got


def joined(pub: Publisher, sub: Subscriber) -> None:
    """PUB/SUB drops what is sent before the subscription arrives: wait until a probe topic passes."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        seq = pub.publish(batch(-1))
        if sub.recv(timeout=0.05):
            assert sub.next_seq == seq + 1
            return
    raise AssertionError("the subscriber never joined")


def test_gap_is_filled_by_replay() -> None:
    with Publisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", buffer_steps=100) as pub, \
            Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv") as sub:
        joined(pub, sub)
        first = sub.next_seq
        assert first is not None
        for i in range(3):
            pub.publish(batch(i))
        got = recv_until(sub, 3)
        assert [s for s, _ in got] == [first, first + 1, first + 2]
        # force a gap: the subscriber "misses" the next two batches
        assert sub.next_seq == first + 3
        sub._sub.setsockopt(__import__("zmq").UNSUBSCRIBE, b"kv")
        time.sleep(0.2)
        pub.publish(batch(10))
        pub.publish(batch(11))
        time.sleep(0.2)
        sub._sub.setsockopt(__import__("zmq").SUBSCRIBE, b"kv")
        end = time.monotonic() + 5
        got = []
        while time.monotonic() < end and not got:      # the resubscription takes a moment to arrive
            pub.publish(batch(12))
            got = sub.recv(timeout=0.1)
        got += recv_until(sub, 0, 0.3)
        seqs = [s for s, _ in got]
        assert seqs[:3] == [first + 3, first + 4, first + 5], seqs
        assert seqs == list(range(first + 3, first + 3 + len(seqs)))
        assert [b.events[0].block_hashes[0] for _, b in got[:2]] == [10, 11]
        assert sub.replayed >= 2 and sub.lost == 0


def test_replay_buffer_is_bounded() -> None:
    with Publisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=8) as pub:
        for i in range(50):
            pub.publish(batch(i))
        end = time.monotonic() + 5
        while pub.last_sent != 49 and time.monotonic() < end:
            time.sleep(0.01)
        assert pub.last_sent == 49 and pub.buffered == 8
        with Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            got = sub._fill(0, 50)
            assert [s for s, _ in got] == list(range(42, 50))
            assert sub.lost == 42


def test_restart_starts_a_new_run() -> None:
    with Publisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub, \
            Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, from_start=False) as sub:
        joined(pub, sub)
        sub.next_seq = 10**6                          # as if the publisher had run long before
        pub.publish(batch(0))
        got = recv_until(sub, 1)
        assert sub.restarts == 1 and got and sub.next_seq == got[-1][0] + 1


def test_vllm_subscriber_protocol_reads_our_publisher(vllm_events: Any) -> None:
    """What a vLLM-side consumer does: a SUB socket and KVEventBatch decoding."""
    import zmq
    with Publisher(LOOPBACK, topic="t") as pub:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.SUB)
        s.connect(pub.endpoint)
        s.setsockopt(zmq.SUBSCRIBE, b"t")
        dec = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
        try:
            end = time.monotonic() + 5
            while time.monotonic() < end:
                pub.publish(batch(7))
                if s.poll(50):
                    topic, seq, payload = s.recv_multipart()
                    assert topic == b"t" and len(seq) == 8
                    assert dec.decode(payload).events[0].block_hashes == [7]
                    break
            else:
                raise AssertionError("nothing arrived")
        finally:
            s.close(linger=0)
