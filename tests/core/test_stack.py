"""TierStack: the waterfall, promotion, the bounded write queue, and faults that never escape."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from radixkv.backends import Blob, MemoryTier, Tier, current_max_blob_bytes, report_oversize
from radixkv.backends.cpu import CpuTier
from radixkv.core.format import encode_chunk
from radixkv.core.hashing import Namespace
from radixkv.core.pool import KVLayout
from radixkv.testing.contract import FaultyTier
from radixkv.core.stack import ChunkRef, TierStack

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=2)
CHUNK = 4
NS = Namespace(model="test").bind(LAYOUT)
TOKENS = list(range(100, 100 + 5 * CHUNK))  # five full chunks


def make_stack(tiers: list[Tier], **kw: object) -> TierStack:
    return TierStack(tiers, namespace=NS, layout=LAYOUT, chunk_size=CHUNK, **kw)  # type: ignore[arg-type]


def kv_for(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.chunk_shape(CHUNK), float(i), dtype=LAYOUT.dtype)


def blob_for(ref: ChunkRef, i: int) -> bytes:
    return encode_chunk(NS.id, ref.key, ref.parent, ref.tokens, kv_for(i))


def put(tier: Tier, refs: list[ChunkRef], which: list[int]) -> None:
    for i in which:
        assert tier.put(NS.id + refs[i].key, blob_for(refs[i], i))


@pytest.fixture
def refs() -> list[ChunkRef]:
    return make_stack([]).refs(TOKENS)


def test_refs_chain_from_the_namespace_root(refs: list[ChunkRef]) -> None:
    assert len(refs) == 5 and refs[0].parent == NS.root
    assert all(b.parent == a.key for a, b in zip(refs, refs[1:]))
    assert make_stack([]).refs(TOKENS + [1, 2]) == refs  # the partial tail gets no ref


def test_lookup_walks_down_and_stops_at_the_first_miss(refs: list[ChunkRef]) -> None:
    upper, lower = MemoryTier(), MemoryTier()
    put(upper, refs, [0, 1, 4])
    put(lower, refs, [0, 2, 4])  # chunk 3 is nowhere: chunk 4 must not count
    stack = make_stack([upper, lower])
    where = stack.lookup([r.key for r in refs])
    assert where == [0, 0, 1]
    loaded = stack.load(refs[:len(where)], where=where)
    assert [t[0, 0, 0, 0, 0].item() for t in loaded] == [0, 1, 2]
    stats = stack.stats()
    assert stats["hits"] == [2, 1] and stats["misses"] == 1 and stats["lookup_found"] == 3
    stack.flush()
    stack.check()
    stack.close()


def test_load_stops_at_a_chunk_no_tier_delivers(refs: list[ChunkRef]) -> None:
    tier = MemoryTier()
    put(tier, refs, [0, 2])
    stack = make_stack([tier])
    assert len(stack.load(refs)) == 1 and stack.stats()["load_misses"] == 1
    stack.close()


@pytest.mark.parametrize("promote", [True, False])
def test_a_lower_hit_is_promoted_when_asked(refs: list[ChunkRef], promote: bool) -> None:
    top, middle, bottom = MemoryTier(), MemoryTier(), MemoryTier()
    put(bottom, refs, [0, 1])
    stack = make_stack([top, middle, bottom], promote=promote)
    assert stack.lookup([r.key for r in refs]) == [2, 2]
    assert len(stack.load(refs[:2])) == 2
    assert stack.flush(timeout=10)
    held = 2 if promote else 0
    assert top.contains_prefix([NS.id + r.key for r in refs]) == held
    assert middle.contains_prefix([NS.id + r.key for r in refs]) == held
    assert stack.stats()["promoted"] == held
    if promote:
        assert stack.lookup([r.key for r in refs]) == [0, 0]
    stack.check()
    stack.close()


def test_store_writes_down_every_tier_and_loads_back(refs: list[ChunkRef], tmp_path: Path) -> None:
    from radixkv.backends.lmdb import LmdbTier

    cpu = CpuTier(max_bytes=1 << 16)
    disk = LmdbTier(tmp_path, max_bytes=1 << 20, sync=False)
    stack = make_stack([cpu, disk])
    assert stack.store([(ref, kv_for(i)) for i, ref in enumerate(refs)]) == 5
    assert stack.flush(timeout=10)
    assert stack.stats()["stored"] == [5, 5]
    assert stack.store([(refs[0], kv_for(0))]) == 1 and stack.flush(timeout=10)
    assert stack.stats()["stored"] == [5, 5], "a chunk a tier already holds is not written again"
    out = [torch.empty(LAYOUT.chunk_shape(CHUNK), dtype=LAYOUT.dtype) for _ in refs]
    loaded = stack.load(refs, out=out)
    assert all(a is b for a, b in zip(loaded, out))
    assert all(torch.equal(t, kv_for(i)) for i, t in enumerate(loaded))
    cpu.drop_namespace(NS.id)
    assert stack.lookup([r.key for r in refs]) == [1] * 5
    stack.check()
    stack.close()


def test_store_checks_the_tensor_on_the_callers_thread(refs: list[ChunkRef]) -> None:
    stack = make_stack([MemoryTier()])
    with pytest.raises(ValueError, match="kv must be a torch.float16 tensor of shape"):
        stack.store([(refs[0], torch.zeros(3))])
    with pytest.raises(ValueError, match="kv must be"):
        stack.store([(refs[0], kv_for(0).float())])
    assert stack.stats()["queued"] == 0
    stack.close()


class GatedTier(MemoryTier):
    """A tier whose writes wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put_many(self, items):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        return super().put_many(items)


def test_a_full_write_queue_drops_and_counts_without_blocking(refs: list[ChunkRef]) -> None:
    slow = GatedTier()
    stack = make_stack([slow], queue_size=2, write_batch=1)
    start = time.monotonic()
    queued = sum(stack.store([(ref, kv_for(i))]) for i, ref in enumerate(refs))
    assert time.monotonic() - start < 5, "store waited on the tier"
    # One write may be in the writer's hands, two in the queue; the rest are dropped.
    assert 2 <= queued <= 3
    assert stack.stats()["dropped_writes"] == 5 - queued
    stack.check()
    slow.gate.set()
    assert stack.flush(timeout=10)
    assert sum(slow.contains_prefix([NS.id + r.key]) for r in refs) == queued
    stack.close()


class OrderTier(GatedTier):
    """A gated tier that records the order its keys are written in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[bytes] = []

    def put_many(self, items):  # type: ignore[no-untyped-def]
        items = list(items)
        self.gate.wait(30)
        self.order += [k for k, _ in items]
        return super().put_many(items)


def test_a_chain_is_written_deepest_first_and_loses_its_end_not_its_head(refs: list[ChunkRef]) -> None:
    tier = OrderTier()
    stack = make_stack([tier], queue_size=3, write_batch=1)
    assert stack.store([(refs[0], kv_for(0))]) == 1           # the writer holds it at the gate
    deadline = time.monotonic() + 10
    while stack.stats()["queued"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stack.store([(ref, kv_for(i)) for i, ref in enumerate(refs)], chain=True) == 3
    assert stack.stats()["dropped_writes"] == 2               # refs 3 and 4: the end
    tier.gate.set()
    assert stack.flush(timeout=10)
    assert tier.order == [NS.id + refs[i].key for i in (0, 2, 1)]   # then 0, held: read instead
    assert stack.stats()["refreshed"] == [1]
    # With a wait, a chain longer than the queue waits for it to empty and goes in whole.
    other = make_stack([]).refs([t + 1000 for t in TOKENS])
    assert stack.store([(ref, kv_for(i)) for i, ref in enumerate(other)], chain=True, wait=10) == 5
    stack.check()
    assert stack.flush(timeout=10)
    assert tier.order[3:] == [NS.id + r.key for r in reversed(other)]
    stack.close()


def test_a_failing_tier_is_a_miss_counted_and_logged_once(refs: list[ChunkRef],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    broken = FaultyTier(MemoryTier(), failing={"contains_prefix", "get", "read", "put_many", "close"})
    healthy = MemoryTier()
    put(broken.inner, refs, [0, 1])
    put(healthy, refs, [0, 1])
    stack = make_stack([broken, healthy])
    with caplog.at_level(logging.WARNING, logger="radixkv.core.stack"):
        for _ in range(10):
            assert stack.lookup([r.key for r in refs]) == [1, 1]
            assert len(stack.load(refs[:2])) == 2  # tier 0 raises on read too: falls through
        stack.store([(refs[2], kv_for(2))])
        assert stack.flush(timeout=10)
    stats = stack.stats()
    assert stats["errors"][0] >= 30 and stats["errors"][1] == 0
    assert stats["hits"] == [0, 20]
    assert healthy.contains_prefix([NS.id + refs[2].key]) == 1
    assert len([r for r in caplog.records if "tier 0" in r.getMessage()]) == 1, "not logged once per burst"
    broken.failing.clear()
    stack.check()
    broken.failing.add("close")
    stack.close()  # a tier failing to close does not raise either


class WrongAnswerTier(MemoryTier):
    def contains_prefix(self, keys):  # type: ignore[no-untyped-def]
        return len(keys) + 3


def test_a_tier_answering_nonsense_counts_as_a_fault(refs: list[ChunkRef]) -> None:
    stack = make_stack([WrongAnswerTier()])
    assert stack.lookup([r.key for r in refs]) == []
    assert stack.stats()["errors"] == [1]
    stack.close()


@pytest.mark.parametrize("corruption", ["bitflip", "foreign", "garbage", "truncated"])
def test_a_corrupt_blob_below_is_a_miss_counted_and_deleted(refs: list[ChunkRef], corruption: str) -> None:
    top, bottom = MemoryTier(), MemoryTier()
    good = bytearray(blob_for(refs[0], 0))
    bad = {"bitflip": bytes(good[:-1]) + bytes([good[-1] ^ 4]),
           "foreign": blob_for(refs[1], 1),  # a valid chunk, but not this key's
           "garbage": b"\x00" * 17,
           "truncated": bytes(good[:100])}[corruption]
    bottom.put(NS.id + refs[0].key, bad)
    stack = make_stack([top, bottom])
    assert stack.lookup([refs[0].key]) == [1]
    out = torch.zeros(LAYOUT.chunk_shape(CHUNK), dtype=LAYOUT.dtype)
    assert stack.load(refs[:1], where=[1], out=[out]) == []
    assert not out.any()
    stats = stack.stats()
    assert stats["corrupt"] == [0, 1] and stats["load_misses"] == 1 and stats["errors"] == [0, 0]
    assert bottom.get(NS.id + refs[0].key) is None, "the corrupt blob was not deleted"
    assert stack.flush(timeout=10) and top.get(NS.id + refs[0].key) is None, "corrupt data was promoted"
    stack.close()


class RefusingRemoteTier(MemoryTier):
    """A remote tier that refuses a blob over the caller's size bound unread, deletes it and says so
    (``report_oversize``), as the S3 and Redis tiers do."""

    local = False

    def get_many(self, keys):  # type: ignore[no-untyped-def]
        bound = current_max_blob_bytes()
        blobs = []
        for key in keys:
            blob = self.get(key)
            if blob is not None and bound is not None and len(blob) > bound:
                self.delete(key)
                report_oversize(key)
                blob = None
            blobs.append(blob)
        return blobs


def test_a_blob_a_remote_tier_refuses_for_its_size_counts_as_corrupt(refs: list[ChunkRef]) -> None:
    tier = RefusingRemoteTier()
    put(tier, refs, [0])
    tier.put(NS.id + refs[1].key, bytes(1 << 16))  # far larger than any chunk of this layout
    stack = make_stack([tier])
    assert len(stack.load(refs[:2])) == 1
    stats = stack.stats()
    assert stats["corrupt"] == [1] and stats["errors"] == [0] and stats["load_misses"] == 1
    assert tier.get(NS.id + refs[1].key) is None
    report_oversize(NS.id + refs[1].key)  # outside a bounded call: told to no one
    assert stack.stats()["corrupt"] == [1]
    stack.check()
    stack.close()


def test_a_corrupt_blob_above_falls_back_to_a_good_one_below(refs: list[ChunkRef]) -> None:
    top, bottom = MemoryTier(), MemoryTier()
    top.put(NS.id + refs[0].key, b"RKVC" + bytes(200))
    put(bottom, refs, [0])
    stack = make_stack([top, bottom])
    loaded = stack.load(refs[:1])
    assert len(loaded) == 1 and torch.equal(loaded[0], kv_for(0))
    assert stack.stats()["corrupt"] == [1, 0] and stack.stats()["hits"] == [0, 1]
    stack.flush(timeout=10)
    assert top.get(NS.id + refs[0].key) == bottom.get(NS.id + refs[0].key), "the good blob was promoted"
    stack.close()


def test_prefetch_returns_a_future_of_the_leading_chunks(refs: list[ChunkRef]) -> None:
    tier = MemoryTier()
    put(tier, refs, [0, 1, 2, 4])
    stack = make_stack([tier])
    future = stack.prefetch(TOKENS, start=1)
    chunks = future.result(timeout=10)
    assert [t[0, 0, 0, 0, 0].item() for t in chunks] == [1, 2]
    with pytest.raises(TypeError):
        stack.prefetch([1.5] * CHUNK)  # bad tokens raise on the caller's thread
    stack.close()
    assert stack.prefetch(TOKENS).result(timeout=1) == []


def test_close_finishes_queued_writes_and_later_stores_are_dropped(refs: list[ChunkRef]) -> None:
    tier = MemoryTier()
    stack = make_stack([tier])
    stack.store([(ref, kv_for(i)) for i, ref in enumerate(refs)])
    stack.close()
    assert tier.contains_prefix([NS.id + r.key for r in refs]) == 5
    assert stack.store([(refs[0], kv_for(0))]) == 0 and stack.stats()["dropped_writes"] == 1
    stack.check()
    stack.close()


class RecordingTier(MemoryTier):
    """Counts round trips, to check that a lookup asks each tier once."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = 0

    def contains_prefix(self, keys):  # type: ignore[no-untyped-def]
        self.rounds += 1
        return super().contains_prefix(keys)

    def get(self, key: bytes) -> Blob | None:
        self.rounds += 1
        return super().get(key)


def test_lookup_costs_one_round_trip_per_tier(refs: list[ChunkRef]) -> None:
    tiers = [RecordingTier(), RecordingTier(), RecordingTier()]
    put(tiers[0], refs, [0])
    put(tiers[1], refs, [1, 2])
    stack = make_stack(tiers)  # type: ignore[arg-type]
    assert stack.lookup([r.key for r in refs]) == [0, 1, 1]
    assert [t.rounds for t in tiers] == [1, 1, 1]
    stack.close()


def test_a_tail_is_stored_found_and_loaded_like_a_chunk(refs: list[ChunkRef]) -> None:
    from radixkv.core.hashing import as_token_bytes

    data = as_token_bytes(TOKENS)
    tier = MemoryTier()
    stack = make_stack([tier])
    tail = stack.tail_ref(refs[0].key, data[16:24])                 # one page (2 tokens) after chunk 0
    assert tail.key not in {r.key for r in refs} and tail.parent == refs[0].key
    kv = torch.full(LAYOUT.chunk_shape(2), 7.0, dtype=LAYOUT.dtype)
    with pytest.raises(ValueError, match="shape"):
        stack.store([(tail, kv_for(0))])                            # a full chunk's KV for a tail
    assert stack.store([(tail, kv)]) == 1 and stack.flush(timeout=10)
    assert stack.find_tail(refs[0].key, data[16:]) == (0, tail)      # longest first, up to a chunk
    assert stack.find_tail(refs[1].key, data[16:]) is None           # another parent: another key
    assert torch.equal(stack.load([tail])[0], kv)
    for bad in (data[16:32], data[16:20], b""):                     # a whole chunk, half a page, nothing
        with pytest.raises(ValueError, match="a tail is"):
            stack.tail_ref(refs[0].key, bad)
    stack.close()


@pytest.mark.slow                 # a whole replay through LMDB (seconds): `make test` runs it
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_default_write_queue_keeps_up_with_a_replay_at_full_speed(tmp_path: Path, policy: str) -> None:
    """A replay as fast as this machine serves it (no flush between requests), through the default
    write queue (bounded in bytes, batched) of a CPU tier over LMDB: nothing is dropped.  The same
    replay through a queue of four entries drops writes, so the replay does press the writer."""
    from radixkv import PrefixCache
    from radixkv.backends import LmdbTier
    from radixkv.tools.workloads import ChatWorkload, replay

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4)
    workload = list(ChatWorkload(num_requests=300, num_system_prompts=6, system_prompt_tokens=96,
                                 turn_tokens=(16, 64), query_tokens=(8, 24), seed=1))
    dropped = {}
    for name, bound in (("default", {}), ("four entries", {"write_queue": 4})):
        with PrefixCache(layout, num_pages=256, chunk_size=16, write_policy=policy, **bound,
                         tiers=[CpuTier(256 << 10), LmdbTier(str(tmp_path / name), 16 << 20, sync=False)]) as cache:
            result = replay(cache, workload, flush=False)
            assert cache.flush(60)
            dropped[name] = result["dropped_writes"] + cache.stats()["chunks_not_queued"]
            cache.check()
    assert dropped["default"] == 0, dropped
    assert dropped["four entries"] > 0, dropped
