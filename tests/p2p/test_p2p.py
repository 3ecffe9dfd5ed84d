"""Peer-to-peer sharing: the signed wire, the controller, and instances in processes of their own
reading each other's CPU tiers over loopback (pyzmq and NIXL) — exact KV or a miss, never wrong KV."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from radixkv.p2p.controller import Controller, ControllerClient, snapshot_batch  # noqa: E402
from radixkv.fleet.events import BlockRemoved, BlockStored, EventBatch  # noqa: E402
from radixkv.p2p.wire import (Ack, Channel, Deregister, Fetch, Heartbeat, PeerLookup, Pin, Refused,  # noqa: E402
                                Register, Report, Signer)

HERE = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HERE))
from p2p_node import CHUNK, LAYOUT, chunk_kv, config, tokens  # noqa: E402

pytestmark = pytest.mark.slow      # instances in processes of their own: `pytest -m "not slow"` leaves it out

SECRET = "p2p test secret, 32 bytes long.."
CHUNKS = 6


def _have_nixl() -> bool:
    from radixkv.p2p.transport import available

    return available()


# ---- the wire --------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=20), st.lists(st.binary(min_size=24, max_size=24), max_size=8),
       st.integers(0, 2**40), st.data())
def test_a_signed_message_opens_only_with_its_secret_and_unaltered(instance: str, keys: list[bytes], rid: int,
                                                                    data: st.DataObject) -> None:
    signer = Signer(SECRET)
    frames = signer.seal(rid, PeerLookup(instance, keys))
    envelope = signer.open(frames)
    assert envelope.rid == rid and envelope.body == PeerLookup(instance, keys)
    with pytest.raises(Refused):
        Signer("some other secret, long enough").open(frames)
    payload = bytearray(frames[1])
    i = data.draw(st.integers(0, len(payload) - 1))
    payload[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(Refused):
        signer.open([frames[0], bytes(payload)])
    with pytest.raises(Refused):
        signer.open([b"", frames[1]])


def test_an_old_message_is_refused_and_a_short_secret_is_an_error() -> None:
    signer = Signer(SECRET, max_skew_s=0.05)
    frames = signer.seal(1, Heartbeat("a", "x"))
    time.sleep(0.1)
    with pytest.raises(Refused, match="too old"):
        signer.open(frames)
    with pytest.raises(ValueError, match="16 bytes"):
        Signer("short")


# ---- the controller --------------------------------------------------------------------------

def _stored(keys: list[bytes]) -> EventBatch:
    return snapshot_batch(keys)


def _removed(keys: list[bytes]) -> EventBatch:
    return EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=keys, medium="CPU")])


def test_controller_members_reports_lookups_timeouts_and_restarts() -> None:
    now = [0.0]
    c = Controller("tcp://127.0.0.1:0", SECRET, heartbeat_timeout_s=5.0, clock=lambda: now[0])
    k = [bytes([i]) * 24 for i in range(6)]
    for name in ("a", "b"):
        assert c.handle(Register(name, "1", f"tcp://127.0.0.1:{1000 + ord(name)}", "zmq")) == Ack("ok")
    assert c.handle(Report("a", "1", 0, True, _stored(k[:4]))) == Ack("ok")
    assert c.handle(Report("b", "1", 0, True, _stored(k[:2]))) == Ack("ok")
    best = c.handle(PeerLookup("b", k))
    assert (best.peer, best.count) == ("a", 4)
    assert c.handle(PeerLookup("a", k)).peer == "b"            # never the asker itself
    assert c.handle(Report("a", "1", 1, False, _removed([k[1]]))) == Ack("ok")
    assert c.handle(PeerLookup("c", k)).count == 2 and c.handle(PeerLookup("c", k)).peer == "b"
    assert c.handle(Report("a", "1", 5, False, _stored(k))) == Ack("resync")      # a gap: a snapshot, please
    assert c.handle(Report("a", "2", 2, False, _stored(k))) == Ack("unknown")     # another run of a
    assert c.handle(Register("a", "2", "tcp://127.0.0.1:2000", "zmq")) == Ack("ok")  # a restarted: its keys gone
    assert c.handle(PeerLookup("c", k)).peer == "b"
    c.check()
    now[0] = 3.0
    assert c.handle(Heartbeat("a", "2")) == Ack("ok")
    now[0] = 6.0
    assert c.expire() == 1 and c.members() == ["a"]              # b timed out with its holdings
    assert c.handle(PeerLookup("c", k)).count == 0
    assert c.handle(Heartbeat("b", "1")) == Ack("unknown")
    c.check()
    c.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.lists(st.integers(0, 7), max_size=5)),
                max_size=30), st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_peer_lookup_is_the_longest_run_a_live_other_instance_holds(ops: list[tuple[str, bool, list[int]]],
                                                                    query: list[int]) -> None:
    c = Controller("tcp://127.0.0.1:0", SECRET)
    held: dict[str, set[bytes]] = {}
    seq: dict[str, int] = {}
    key = [bytes([i]) * 24 for i in range(8)]
    for name, store, ids in ops:
        if name not in held:
            c.handle(Register(name, "1", "tcp://127.0.0.1:9", "zmq"))
            held[name], seq[name] = set(), 0
        keys = [key[i] for i in ids]
        batch = _stored(keys) if store else _removed(keys)
        assert c.handle(Report(name, "1", seq[name], seq[name] == 0, batch)) == Ack("ok")
        seq[name] += 1
        held[name] = held[name] | set(keys) if store else held[name] - set(keys)
    keys = [key[i] for i in query]
    for asker in "abcd":
        runs = {}
        for name, have in held.items():
            n = 0
            while n < len(keys) and keys[n] in have:
                n += 1
            if name != asker and n:
                runs[name] = n
        answers = [c.handle(PeerLookup(asker, keys)) for _ in range(4)]
        for answer in answers:
            assert answer.count == max(runs.values(), default=0)
            if runs:
                assert runs[answer.peer] == answer.count
        if runs:                                   # four turns cover up to four equal holders
            assert {a.peer for a in answers} == {name for name, n in runs.items() if n == answers[0].count}, \
                "equal holders take turns"
    assert c.handle(Report("x", "1", 0, True, _stored([]))) == Ack("unknown")
    c.check()
    c.close()


def test_the_controller_answers_only_signed_requests_over_the_socket() -> None:
    with Controller("tcp://127.0.0.1:0", SECRET) as c:
        good = ControllerClient(c.address, SECRET)
        assert good.call(Register("a", "1", "tcp://127.0.0.1:9", "zmq")) == Ack("ok")
        bad = Channel(c.address, Signer("not the deployment secret, no"))
        assert bad.ask(Register("evil", "1", "tcp://127.0.0.1:9", "zmq"), time.monotonic() + 0.3) is None
        assert c.refused >= 1 and c.members() == ["a"]
        good.close(), bad.close()
    down = ControllerClient(c.address, SECRET, timeout_s=0.2)        # nobody answers now: nothing, fast
    t0 = time.monotonic()
    assert down.peer_lookup("a", [bytes(24)]).count == 0 and down.lookup([bytes(24)]) == {}
    assert time.monotonic() - t0 < 1.0
    down.close()


# ---- instances in processes ------------------------------------------------------------------

class Fleet:
    """A controller here, instances in subprocesses (tests/p2p_node.py), B's stack here."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.controller = Controller("tcp://127.0.0.1:0", SECRET, heartbeat_timeout_s=3.0).start()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stacks: list[Any] = []

    def start(self, name: str, *, mode: str = "serve", seed: int = 1, transport: str = "zmq") -> dict[str, Any]:
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        spec = {"controller": self.controller.address, "secret": SECRET, "instance": name, "mode": mode,
                "seed": seed, "chunks": CHUNKS, "ready": str(ready), "transport": transport}
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps(spec))
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([sys.executable, str(HERE / "p2p_node.py"), str(path)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.procs[name].poll() is None, (self.tmp / f"{name}.log").read_text()
            assert time.monotonic() < deadline, "the instance did not start"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.wait_holds(name, seed)
        return info

    def names(self, seed: int) -> list[bytes]:
        stack = self.reader("probe", "zmq")
        return [stack.namespace.id + ref.key for ref in stack.refs(tokens(seed, CHUNKS))]

    def wait_holds(self, name: str, seed: int, count: int = CHUNKS) -> None:
        client = ControllerClient(self.controller.address, SECRET)
        names = self.names(seed)
        deadline = time.monotonic() + 15
        while client.lookup(names).get(name, 0) != count:
            assert time.monotonic() < deadline, f"the controller never saw {name} hold its chunks"
            time.sleep(0.05)
        client.close()

    def reader(self, name: str, transport: str, timeout: float = 2.0, peer_codec: str | None = None) -> Any:
        cfg = config({"controller": self.controller.address, "secret": SECRET, "transport": transport,
                      "timeout": timeout, "peer_codec": peer_codec}, name, None)
        stack = cfg.make_stack(LAYOUT, exclusive=False)
        self.stacks.append(stack)
        return stack

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for stack in self.stacks:
            stack.close()
        for name in list(self.procs):
            self.kill(name)
        self.controller.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def _load(stack: Any, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    refs = stack.refs(tokens(seed, CHUNKS))
    where = stack.lookup([r.key for r in refs])
    return where, stack.load(refs[:len(where)], where=where)


@pytest.mark.parametrize("transport", ["zmq", "nixl"])
def test_b_gets_as_chunks_exactly_and_a_forged_peer_is_a_miss(fleet: Fleet, transport: str) -> None:
    if transport == "nixl" and not _have_nixl():
        pytest.skip("NIXL does not load here")
    fleet.start("a", seed=1, transport=transport)
    fleet.start("f", seed=2, mode="forge", transport=transport)
    # Exactness, not the bound (test_a_stopped_peer_costs_a_request_at_most_remote_timeout): b's
    # first NIXL read starts its agent inside the read's deadline, which took over 2 s beside a
    # loaded test run.
    b = fleet.reader("b", transport, timeout=20.0)
    where, chunks = _load(b, 1)
    assert where == [1] * CHUNKS                         # the peer tier, below b's own CPU tier
    assert len(chunks) == CHUNKS, b.tiers[1].stats()
    for i, chunk in enumerate(chunks):
        assert torch.equal(chunk, chunk_kv(1, i))
    peer = b.tiers[1]
    assert peer.stats()[f"{transport}_reads"] >= 1
    b.flush(5.0)
    assert _load(b, 1)[0] == [0] * CHUNKS                # promoted into b's CPU tier
    where, chunks = _load(b, 2)                          # f's blobs were changed: every one is a miss
    assert chunks == [] and b.stats()["forged"][1] >= 1
    b.check()


def test_a_peer_killed_mid_transfer_or_restarted_or_stale_is_a_miss(fleet: Fleet) -> None:
    fleet.start("a", seed=1, mode="die_on_request")
    b = fleet.reader("b", "zmq", timeout=1.0)
    t0 = time.monotonic()
    where, chunks = _load(b, 1)
    assert where == [1] * CHUNKS and chunks == []         # the controller named a; a died answering
    assert time.monotonic() - t0 < 3.0
    # Stale: the controller still lists the dead a (no heartbeat timeout yet); a miss at once.
    assert _load(b, 1)[1] == []
    # a restarted with other chunks: its old holdings are gone, the new ones are served.
    fleet.start("a", seed=3)
    assert b.lookup([r.key for r in b.refs(tokens(1, CHUNKS))]) == []
    where, chunks = _load(b, 3)
    assert len(chunks) == CHUNKS and torch.equal(chunks[-1], chunk_kv(3, CHUNKS - 1))
    b.check()


def _agent_started(peer: Any) -> None:
    deadline = time.monotonic() + 60
    while True:
        with peer._agent_lock:
            if peer._agent is not None:
                return
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.05)


def test_a_nixl_reader_starts_its_agent_before_its_first_read(fleet: Fleet) -> None:
    """Starting NIXL takes most of a read's default bound: the tier starts it when it is built."""
    if not _have_nixl():
        pytest.skip("NIXL does not load here")
    peer = fleet.reader("b", "nixl").tiers[1]
    _agent_started(peer)
    assert peer.stats()["nixl_reads"] == 0
    peer.check()


def test_a_nixl_read_waits_for_the_agent_no_longer_than_its_bound(fleet: Fleet) -> None:
    """The agent is held (as by another read's transfer or the agent's start) far past the read's
    bound: the read is a miss by its bound, not a wait for the agent, and the peer is not blamed
    for it (its breaker stays closed); once the agent is free the same read is served."""
    if not _have_nixl():
        pytest.skip("NIXL does not load here")
    fleet.start("a", seed=1, transport="nixl")
    b = fleet.reader("b", "nixl", timeout=1.0)
    peer = b.tiers[1]
    _agent_started(peer)
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        with peer._agent_lock:
            held.set()
            free.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        t0 = time.monotonic()
        where, chunks = _load(b, 1)
        waited = time.monotonic() - t0
    finally:
        free.set()
        holder.join(10)
    assert where == [1] * CHUNKS and chunks == []
    assert waited < 30.0, waited                # the agent was held for up to 60 s
    stats = peer.stats()
    assert stats["agent_busy"] >= 1 and stats["failures"] == 0 and stats["breakers_open"] == 0, stats
    where, chunks = _load(b, 1)
    assert len(chunks) == CHUNKS, peer.stats()
    assert torch.equal(chunks[-1], chunk_kv(1, CHUNKS - 1))
    b.check()


def test_nixl_a_peer_killed_between_pin_and_read_is_a_miss(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _have_nixl():
        pytest.skip("NIXL does not load here")
    from radixkv.p2p import transport as _nixl

    fleet.start("a", seed=1, transport="nixl")
    b = fleet.reader("b", "nixl", timeout=1.5)
    read = _nixl.Agent.read

    def killed_first(self: Any, *args: Any) -> bool:
        if "a" in fleet.procs:
            fleet.kill("a")
        return read(self, *args)

    monkeypatch.setattr(_nixl.Agent, "read", killed_first)
    t0 = time.monotonic()
    where, chunks = _load(b, 1)
    assert where == [1] * CHUNKS and chunks == []
    assert time.monotonic() - t0 < 4.0
    b.check()


def test_an_unauthenticated_reader_gets_nothing(fleet: Fleet) -> None:
    info = fleet.start("a", seed=1)
    names = fleet.names(1)
    evil = Channel(info["address"], Signer("a guessed secret, 16+ bytes"))
    assert evil.ask(Fetch(names), time.monotonic() + 0.5) is None
    assert evil.ask(Pin("evil", names, 5.0), time.monotonic() + 0.5) is None
    evil.close()
    good = Channel(info["address"], Signer(SECRET))       # the control: the same request, signed
    answer = good.ask(Fetch(names), time.monotonic() + 5.0)
    assert answer is not None and len(answer[1]) == CHUNKS
    good.close()


def test_a_restarted_controller_is_rebuilt_by_the_instances(fleet: Fleet) -> None:
    fleet.start("a", seed=1)
    address = fleet.controller.address
    fleet.controller.close()
    b = fleet.reader("b", "zmq")
    assert _load(b, 1)[1] == []                              # no controller: no peers, no error
    fleet.controller = Controller(address, SECRET, heartbeat_timeout_s=3.0).start()
    fleet.wait_holds("a", 1)                                 # a re-registered and sent a snapshot
    deadline = time.monotonic() + 10
    while len(chunks := _load(b, 1)[1]) < CHUNKS and time.monotonic() < deadline:
        time.sleep(0.2)                                      # b's client backs off for a second
    assert len(chunks) == CHUNKS and torch.equal(chunks[0], chunk_kv(1, 0))
    fleet.controller.check()


def test_p2p_config_keys_are_checked_and_need_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.config import CacheConfig

    monkeypatch.delenv("RADIXKV_SECRET", raising=False)
    base = {"num_pages": 1, "namespace": {"model": "m"}, "secret": SECRET}
    on = {**base, "p2p_enabled": True, "p2p_controller": "tcp://127.0.0.1:5600"}
    assert CacheConfig.from_mapping(on).p2p_transport == "nixl"
    for bad, name in (({**base, "p2p_controller": "tcp://127.0.0.1:5600"}, "p2p_controller"),
                      ({**base, "p2p_enabled": True}, "p2p_controller"),
                      ({**on, "p2p_controller": "127.0.0.1:5600"}, "p2p_controller"),
                      ({**on, "p2p_address": "tcp://:5601"}, "p2p_address"),
                      ({**on, "p2p_transport": "rdma"}, "p2p_transport"),
                      ({**on, "secret": None}, "secret"),
                      ({**on, "p2p_enabled": "yes"}, "p2p_enabled")):
        with pytest.raises(ValueError, match=name):
            CacheConfig.from_mapping(bad)


def test_python_m_radixkv_controller_serves_signed_requests(tmp_path: Path) -> None:
    from radixkv.tools.s3server import free_port

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"secret": SECRET}))
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "radixkv", "controller", "--bind", address, "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = ControllerClient(address, SECRET, timeout_s=1.0)
        deadline = time.monotonic() + 30
        while client.call(Register("a", "1", "tcp://127.0.0.1:9", "zmq"), force=True) != Ack("ok"):
            assert proc.poll() is None and time.monotonic() < deadline
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


@settings(max_examples=60, deadline=None)
@example([("put", i, i) for i in range(6)] + [("pin", [0, 1], 5.0)]    # the pinned keys evicted, then expired
         + [("put", i, 99) for i in (6, 7, 8, 9, 2, 3)] + [("fetch", [2, 3]), ("time", 6.0), ("put", 4, 7)])
@given(st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 255)),
                          st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 255)),
                          st.tuples(st.just("pin"), st.lists(st.integers(0, 9), min_size=1, max_size=4),
                                    st.sampled_from([0.5, 5.0])),
                          st.tuples(st.just("release"), st.integers(0, 20)),
                          st.tuples(st.just("fetch"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
                          st.tuples(st.just("time"), st.floats(0.1, 3.0))), max_size=50))
def test_a_pinned_blob_stays_put_whatever_the_tier_does_until_released_or_expired(ops: list[tuple[Any, ...]]) -> None:
    """The serving side against a model: what a pin said lies at an offset stays there, unchanged,
    through puts, evictions and overwrites of its key, until released or expired; fetches answer the
    leading keys held, exactly; the lease budget holds."""
    from radixkv.backends.cpu import CpuTier
    from radixkv.p2p.wire import Blobs, Pinned, Release
    from radixkv.p2p.node import PeerServer

    now = [0.0]
    tier = CpuTier(6 * 64, slot_bytes=64)                    # 6 slots: puts evict all the time
    agent = SimpleNamespace(name="a", progress=lambda: None)  # pins answered as for NIXL, no transfer made
    server = PeerServer(tier, "tcp://127.0.0.1:0", Signer(SECRET), agent=agent, max_leases=4,  # type: ignore[arg-type]
                        clock=lambda: now[0])
    key = [bytes([i]) * 24 for i in range(10)]
    held: dict[bytes, bytes] = {}                            # the model: what the tier holds
    pins: dict[int, tuple[float, list[tuple[int, int, bytes]]]] = {}
    memory = tier.arena.numpy()
    for op in ops:
        if op[0] == "put":
            blob = bytes([op[2]]) * (20 + op[1])
            if tier.put(key[op[1]], blob):
                held[key[op[1]]] = blob
            else:
                held.pop(key[op[1]], None)
            for k in list(held):
                if tier.contains_prefix([k]) == 0:
                    del held[k]                              # evicted
        elif op[0] == "pin":
            answer = server.handle(Pin("b", [key[i] for i in op[1]], op[2]))
            assert answer is not None and isinstance(answer[0], Pinned)
            spans = answer[0].spans
            expect = [held.get(key[i]) for i in op[1]]
            lead = next((n for n, b in enumerate(expect) if b is None), len(expect))
            assert len(spans) <= lead
            assert [memory[o:o + n].tobytes() for o, n in spans] == expect[:len(spans)]
            if spans:
                pins[answer[0].pin] = (now[0] + op[2], [(o, n, memory[o:o + n].tobytes()) for o, n in spans])
        elif op[0] == "release":
            server.handle(Release(op[1]))
            pins.pop(op[1], None)
        elif op[0] == "fetch":
            answer = server.handle(Fetch([key[i] for i in op[1]]))
            assert answer is not None and isinstance(answer[0], Blobs)
            expect = [held.get(key[i]) for i in op[1]]
            lead = next((n for n, b in enumerate(expect) if b is None), len(expect))
            assert [bytes(b) for b in answer[1]] == expect[:len(answer[1])] and len(answer[1]) <= lead
        else:
            now[0] += op[1]
            server.tick()
            pins = {p: v for p, v in pins.items() if v[0] > now[0]}
        for _, spans in pins.values():                       # every live pin's bytes are still there
            for o, n, blob in spans:
                assert memory[o:o + n].tobytes() == blob
        assert server.pins() == len(pins)
        server.check()
        tier.check()
    server.close()
    tier.check()


def test_offline_tools_do_not_join_the_fleet() -> None:
    from radixkv.config import CacheConfig

    cfg = CacheConfig.from_mapping({"num_pages": 1, "namespace": {"model": "m"}, "secret": SECRET,
                                    "p2p_enabled": True, "p2p_controller": "tcp://127.0.0.1:9",
                                    "p2p_instance": "a", "p2p_transport": "zmq"})
    off = cfg.without_p2p()
    assert not off.p2p_enabled and off.p2p_controller is None and off.secret == cfg.secret
    assert off.make_stack(LAYOUT) is None                    # no tier left: nothing built, nobody joined


def test_a_departed_readers_pins_end_when_the_controller_says_it_left() -> None:
    """The controller tells each member, in the answer to its next heartbeat or report, who left
    since its last message (deregistered, timed out, restarted); the serving side then ends those
    readers' pins at once, not at their time limit, and keeps the others'."""
    from radixkv.backends.cpu import CpuTier
    from radixkv.p2p.wire import Pin, Pinned
    from radixkv.p2p.node import PeerServer

    now = [0.0]
    c = Controller("tcp://127.0.0.1:0", SECRET, heartbeat_timeout_s=5.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        assert c.handle(Register(name, "1", f"tcp://127.0.0.1:{1000 + ord(name)}", "zmq")) == Ack("ok")
    assert c.handle(Heartbeat("a", "1")) == Ack("ok")
    now[0] = 1.0
    assert c.handle(Deregister("b", "1")) == Ack("ok")
    assert c.handle(Register("c", "2", "tcp://127.0.0.1:3000", "zmq")) == Ack("ok")     # c restarted
    now[0] = 2.0
    assert c.handle(Heartbeat("a", "1")) == Ack("ok", ("b", "c"))
    assert c.handle(Report("a", "1", 0, True, _stored([]))) == Ack("ok"), "told once"
    now[0] = 5.0
    assert c.handle(Heartbeat("a", "1")) == Ack("ok")
    now[0] = 8.0
    assert c.expire() == 1 and c.members() == ["a"]                # c's new run timed out
    assert c.handle(Heartbeat("a", "1")) == Ack("ok", ("c",))
    c.check()
    c.close()

    tier = CpuTier(4 * 64, slot_bytes=64)
    keys = [bytes([i]) * 24 for i in range(3)]
    for k in keys:
        assert tier.put(k, b"x" * 40)
    agent = SimpleNamespace(name="a", progress=lambda: None)
    server = PeerServer(tier, "tcp://127.0.0.1:0", Signer(SECRET), agent=agent, clock=lambda: now[0])  # type: ignore[arg-type]
    mine, other = server.handle(Pin("b", keys[:2], 10.0))[0], server.handle(Pin("d", keys[2:], 10.0))[0]
    assert isinstance(mine, Pinned) and len(mine.spans) == 2 and server.pins() == 2
    assert server.release_from(["b", "c"]) == 1 and server.pins() == 1 and server.counts["departed"] == 1
    server.check()
    server.close()
    assert other.pin != mine.pin


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of process ``pid`` is stopped (state T in /proc)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue                  # a thread that just ended
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)


@pytest.mark.parametrize("transport", ["zmq", "nixl"])
def test_a_stopped_peer_costs_a_request_at_most_remote_timeout(fleet: Fleet, transport: str) -> None:
    """A peer that is alive but stopped (SIGSTOP: its sockets open, nothing answers) costs a request
    at most ``remote_timeout``: through a cache built from the configuration (whose request deadline
    is that bound, not the cache's default 5 s), and through a stack whose caller passes a later
    deadline of its own (the vLLM connector's ``radixkv_timeout_s``).  The bound is the point, so it
    is asserted, with a wide margin."""
    from dataclasses import replace

    if transport == "nixl" and not _have_nixl():
        pytest.skip("NIXL does not load here")
    bound = 0.6
    fleet.start("a", seed=1, transport=transport)
    cfg = replace(config({"controller": fleet.controller.address, "secret": SECRET, "transport": transport,
                          "timeout": bound}, "b", None), num_pages=4 * CHUNKS * 2)
    cache = cfg.build(LAYOUT)
    b = fleet.reader("c", transport, timeout=bound)
    prompt = tokens(1, CHUNKS) + [1]
    refs = b.refs(prompt[:-1])
    # Read the first chunk from a while it answers: the connections are made, as in a fleet at work.
    req = cache.open(prompt[:CHUNK + 1])
    assert req.tier_tokens == CHUNK, req
    req.release()
    assert len(b.load(refs[:1], where=b.lookup([refs[0].key]))) == 1
    refs = refs[1:]
    pid = fleet.procs["a"].pid
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped(pid)            # kill() returns before the stop: a running thread could still answer
    try:
        t0 = time.monotonic()
        req = cache.open(prompt)                                    # the request's own deadline
        took_request = time.monotonic() - t0
        served = req.num_cached
        req.release()
        t0 = time.monotonic()
        where = b.lookup([r.key for r in refs], deadline=time.monotonic() + 10.0)   # a caller's later one
        chunks = b.load(refs[:len(where)], where=where, deadline=time.monotonic() + 10.0)
        took_stack = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        cache.close()
    # What came before the stop; over zmq no more (the stopped peer sends nothing).  NIXL's reads are
    # one-sided (UCX over shared memory here): chunks whose pins were taken before the stop can still
    # be read from a stopped peer's memory, sealed and verified as any load, so more may come.
    assert served >= CHUNK and served % CHUNK == 0
    if transport == "zmq":
        assert served == CHUNK and chunks == []
    assert took_request < bound + 2.5, f"a stopped peer held a request {took_request:.2f} s"
    assert took_stack < 2 * bound + 2.5, f"a stopped peer held a lookup and a load {took_stack:.2f} s"
    b.check()


def test_nixl_blobs_are_views_kept_intact_while_held_reused_once_released_and_copied_when_all_are_held(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NIXL read lends read-only views of a staging buffer: they keep their bytes while later
    reads land in other buffers, the buffer is read into again (not registered anew) once they are
    gone, a read while every buffer is held is copied out into ``bytes``, and a buffer an abandoned
    transfer may still write into is never read into again nor lent."""
    if not _have_nixl():
        pytest.skip("NIXL does not load here")
    import numpy as np

    from radixkv.p2p import transport as _nixl
    from radixkv.p2p.tier import PeerTier

    fleet.start("a", seed=1, transport="nixl")
    names = fleet.names(1)
    over_zmq = PeerTier(fleet.controller.address, SECRET, instance="z", transport="zmq")
    want = [bytes(b) for b in over_zmq.get_many(names)]
    over_zmq.close()
    assert len(want) == CHUNKS and all(want)
    reads: list[list[tuple[int, int]]] = []
    registered: list[int] = []
    abandon = [False]
    read, register = _nixl.Agent.read, _nixl.Agent.register

    def recorded_read(self: Any, peer: str, local: Any, remote: Any, deadline: float) -> bool:
        reads.append(list(local))
        done = read(self, peer, local, remote, deadline)
        return done and not abandon[0]            # abandoned: the bytes came, but it is not known

    def counted_register(self: Any, tensor: torch.Tensor) -> Any:
        registered.append(tensor.numel())
        return register(self, tensor)

    monkeypatch.setattr(_nixl.Agent, "read", recorded_read)
    monkeypatch.setattr(_nixl.Agent, "register", counted_register)
    b = PeerTier(fleet.controller.address, SECRET, instance="b", transport="nixl", staging_buffers=2)

    def span(blob: Any) -> tuple[int, int]:
        array = np.frombuffer(blob, dtype=np.uint8)
        return array.ctypes.data, len(array)

    try:
        first = b.get_many(names[:3])
        second = b.get_many(names[3:])
        assert all(isinstance(v, memoryview) and v.readonly for v in first + second)
        assert b.stats()["staging_held"] == 2 and len(registered) == 2
        third = b.get_many(names[:2])                  # both held: copied out of the scratch buffer
        assert all(isinstance(v, bytes) for v in third) and b.stats()["nixl_copied"] == 1
        assert [bytes(v) for v in first + second] == want and third == want[:2]
        kept = np.frombuffer(first[0], dtype=np.uint8)  # made from a view: it holds the buffer
        del first, third
        assert b.stats()["staging_held"] == 2
        del kept
        assert b.stats()["staging_held"] == 1
        before = len(registered)
        again = b.get_many(names[:3])
        assert [bytes(v) for v in again] == want[:3] and len(registered) == before   # reused
        del second
        # Abandoned: the buffer it went into is retired; the next read, and what is lent, lie elsewhere.
        abandon[0] = True
        assert b.get_many(names[3:]) == [None] * (CHUNKS - 3)
        abandon[0] = False
        assert b.stats()["nixl_copied"] == 1                # it went into the buffer second had
        gone = reads[-1][0][0], sum(n for _, n in reads[-1])
        for _ in range(3):
            blobs = b.get_many(names)
            assert [bytes(v) for v in blobs] == want
            for start, n in reads[-1] + [span(v) for v in blobs + again if isinstance(v, memoryview)]:
                assert start + n <= gone[0] or gone[0] + gone[1] <= start, "read into an abandoned buffer"
            del blobs
        assert [bytes(v) for v in again] == want[:3]
        stats = b.stats()
        assert stats["abandoned"] == 1 and stats["nixl_lent"] >= 6, stats
        b.check()
    finally:
        b.close()


# ---- coded reads -----------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["zmq", "nixl"])
@pytest.mark.parametrize("codec", ["int8", "cachegen", "zstd"])
def test_a_reader_with_peer_codec_gets_coded_chunks_counted_apart_and_never_stored_as_exact(
        fleet: Fleet, transport: str, codec: str) -> None:
    """B asks A (a raw CPU tier) for coded blobs: A codes them on its server thread, B decodes
    them (within the codec's bound; exactly for the lossless one), counts the lossy ones apart and
    does not promote approximate KV into its own raw CPU tier; a forged peer is still a miss; a
    raw reader of the same peer still gets the exact chunks."""
    pytest.importorskip("zstandard")
    if transport == "nixl" and not _have_nixl():
        pytest.skip("NIXL does not load here")
    from radixkv.core.codec import get_codec

    fleet.start("a", seed=1, transport=transport)
    fleet.start("f", seed=2, mode="forge", transport=transport)
    b = fleet.reader("b", transport, peer_codec=codec)
    lossy = get_codec(codec).lossy
    for round_ in range(2):                      # the second time A sends what it kept coded
        before = b.tiers[1].stats()["coded_blobs"], b.stats()["lossy_loaded"][1]
        where, chunks = _load(b, 1)
        assert where == [1] * CHUNKS and len(chunks) == CHUNKS, f"round {round_}"
        for i, chunk in enumerate(chunks):
            exact = chunk_kv(1, i)
            if lossy:
                assert b.approximate(chunk)
                span = (exact.amax() - exact.amin()).item()
                assert (chunk - exact).abs().max().item() <= span / 4, f"chunk {i} beyond the codec's bound"
            else:
                assert torch.equal(chunk, exact) and not b.approximate(chunk)
        peer = b.tiers[1].stats()
        assert peer["coded_reads"] >= round_ + 1 and peer["coded_blobs"] == before[0] + CHUNKS
        assert peer["nixl_reads"] == 0, "a coded read is a Fetch"
        assert b.stats()["lossy_loaded"][1] == before[1] + (CHUNKS if lossy else 0)
        b.flush(5.0)
        # approximate KV is never stored into the raw CPU tier; exact KV is
        assert _load(b, 1)[0] == ([1] * CHUNKS if lossy else [0] * CHUNKS)
        if not lossy:
            break
    where, chunks = _load(b, 2)                  # f's blobs were changed: A cannot code them, B refuses them
    assert chunks == [] and b.stats()["forged"][1] >= 1
    raw = fleet.reader("r", transport)
    where, chunks = _load(raw, 1)
    assert len(chunks) == CHUNKS and all(torch.equal(c, chunk_kv(1, i)) for i, c in enumerate(chunks))
    assert not any(raw.approximate(c) for c in chunks)
    b.check()


def test_the_recoder_codes_what_verifies_keeps_a_bounded_lru_and_answers_raw_otherwise() -> None:
    """In process: a blob that verifies comes back coded and sealed as the tier seals it (a reader
    decodes it); a forged blob, an unknown or raw codec, or a blob not made smaller is ``None``
    (sent raw); the kept coded blobs stay within ``max_bytes``, the least recently used dropped."""
    pytest.importorskip("zstandard")
    from radixkv.core.format import Seal, chunk_codec, decode_chunk, encode_chunk
    from radixkv.core.hashing import as_token_bytes
    from radixkv.p2p.node import Recoder

    seal = Seal(SECRET)
    ns = bytes(range(8))
    blobs = {}
    for i in range(6):
        kv = chunk_kv(3, i)
        toks = as_token_bytes(list(range(i * CHUNK, (i + 1) * CHUNK)))
        import xxhash

        key = xxhash.xxh3_128_digest(bytes(16) + toks)
        blobs[ns + key] = (encode_chunk(ns, key, bytes(16), toks, kv, seal=seal), kv, toks)
    one = next(iter(blobs.values()))[0]
    recoder = Recoder(seal, max_bytes=2 * len(one) // 3)       # room for about one int8 blob
    for tier_key, (blob, kv, toks) in blobs.items():
        coded = recoder.recode(tier_key, memoryview(blob), "int8")
        assert coded is not None and chunk_codec(coded) == 2 and len(coded) < len(blob)
        back = decode_chunk(coded, namespace_id=tier_key[:8], key=tier_key[8:], parent_key=bytes(16), tokens=toks,
                            dtype=kv.dtype, shape=tuple(kv.shape), seal=seal)
        assert (back - kv).abs().max().item() <= (kv.amax() - kv.amin()).item() / 200
        with pytest.raises(Exception):          # sealed by the tier's secret: another one refuses it
            decode_chunk(coded, namespace_id=tier_key[:8], key=tier_key[8:], parent_key=bytes(16), tokens=toks,
                         dtype=kv.dtype, shape=tuple(kv.shape), seal=Seal("another secret of 32 bytes......"))
        recoder.check()
    assert recoder.counts["coded"] == len(blobs) and recoder.counts["kept_hits"] == 0
    last = list(blobs)[-1]
    assert recoder.recode(last, blobs[last][0], "int8") is not None and recoder.counts["kept_hits"] == 1
    first = list(blobs)[0]
    recoder.recode(first, blobs[first][0], "int8")            # dropped from the LRU: coded again
    assert recoder.counts["coded"] == len(blobs) + 1
    forged = bytearray(blobs[first][0])
    forged[-3] ^= 0xFF
    assert recoder.recode(first + b"", bytes(forged), "cachegen") is None
    assert recoder.recode(first, blobs[first][0], "no-such-codec") is None
    assert recoder.recode(first, blobs[first][0], "none") is None
    tiny = encode_chunk(ns, bytes(16), bytes(16), bytes(4), torch.randn(1, 2, 1, 1, 2), seal=seal)
    assert recoder.recode(ns + bytes(16), tiny, "int8") is None          # not smaller: raw
    recoder.check()
    with pytest.raises(ValueError):
        Recoder(seal, max_bytes=-1)


def test_peer_codec_is_checked_and_needs_p2p() -> None:
    base = {"local_cpu": True, "max_local_cpu_size": 0.001, "secret": SECRET, "num_pages": 1,
            "namespace": {"model": "p2p-test"}}
    from radixkv.config import CacheConfig

    with pytest.raises(ValueError, match="peer_codec"):
        CacheConfig.from_mapping({**base, "peer_codec": "int8"})
    with pytest.raises(ValueError, match="peer_codec"):
        CacheConfig.from_mapping({**base, "p2p_enabled": True, "p2p_controller": "tcp://127.0.0.1:5600",
                                  "peer_codec": "jpeg"})
    ok = CacheConfig.from_mapping({**base, "p2p_enabled": True, "p2p_controller": "tcp://127.0.0.1:5600",
                                   "peer_codec": "cachegen:4"})
    assert ok.peer_codec == "cachegen:4"


@pytest.mark.parametrize("endpoint", ["foo", "tcp://127.0.0.1", "tcp://:5601", "tcp://127.0.0.1:99999",
                                      "tcp://127.0.0.1:x", "udp://127.0.0.1:5601", "ipc://"])
def test_an_endpoint_zmq_would_misread_is_refused_by_name(endpoint: str) -> None:
    """A port past 65535 had been taken, and zmq bound some other port."""
    from radixkv.p2p.wire import check_endpoint

    with pytest.raises(ValueError, match="controller"):
        check_endpoint(endpoint, "controller")
    assert check_endpoint("tcp://127.0.0.1:5601", "controller") == "tcp://127.0.0.1:5601"
    assert check_endpoint("ipc:///tmp/radixkv.sock", "controller") == "ipc:///tmp/radixkv.sock"
