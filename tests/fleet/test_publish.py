"""A cache's KV events tell the truth: an ``Index`` fed by them holds, after every step, exactly the
chunks the pool holds whole (``GPU``) and the chunks each local tier holds (``CPU``, ``STORAGE``),
whatever the requests, the evictions, the loads and the tiers' own evictions; the same stream
goes over ZMQ to a ``Subscriber``, and vLLM-compatible names match ``vllm_block_hashes``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("msgspec")

import radixkv as rk
from radixkv.backends import CpuTier, LmdbTier
from radixkv.fleet.events import EventBatch, Subscriber
from radixkv.fleet.hashing import external_hash, vllm_block_hashes
from radixkv.fleet.index import Index
from radixkv.fleet.publish import KVEvents, publish
from radixkv.core.hashing import keys_from_token_bytes
from radixkv.tools.workloads import replay

LAYOUT = rk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)
CHUNK = 4


class IndexSink:
    """Applies each batch to an Index as instance ``"a"`` (what a Subscriber would deliver)."""

    def __init__(self) -> None:
        self.index, self.seq = Index(), 0

    def __call__(self, events: list[Any]) -> None:
        self.index.apply("a", self.seq, EventBatch(ts=0.0, events=events))
        self.seq += 1


def held_by_medium(index: Index) -> dict[str, set[Any]]:
    out: dict[str, set[Any]] = {}
    if "a" not in index.instances():
        return out
    for h, (_, media) in index.held("a").items():
        for m in media:
            out.setdefault(m, set()).add(h)
    return out


def truth(cache: rk.PrefixCache, seen: set[bytes]) -> dict[str, set[Any]]:
    """What the cache holds, chunk by chunk, for every sequence it was asked for."""
    out: dict[str, set[Any]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    stack = cache.stack
    assert stack is not None
    media = {"cpu": "CPU", "lmdb": "STORAGE"}
    for data in seen:
        keys = keys_from_token_bytes(data, CHUNK, stack.namespace.root)
        node, pos, _, cut = cache.tree.walk(data, len(data) - len(data) % (4 * LAYOUT.page_size))
        matched = (pos + (cut[1] * 4 * LAYOUT.page_size if cut else 0)) // 4
        for c, key in enumerate(keys):
            if (c + 1) * CHUNK <= matched:
                out["GPU"].add(external_hash(key))
            for tier in stack.tiers:
                if tier.contains_prefix([stack.namespace.id + key]) == 1:
                    out[media[tier.name]].add(external_hash(key))
    return {m: s for m, s in out.items() if s}


family = st.lists(st.integers(0, 3), min_size=1, max_size=16).map(lambda xs: [x + 1 for x in xs])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(family, min_size=1, max_size=4),
       steps=st.lists(st.one_of(st.tuples(st.just("req"), st.integers(0, 3)), st.tuples(st.just("evict"), st.integers(1, 8)),
                                st.tuples(st.just("drop"), st.just(0))),
                      min_size=1, max_size=25),
       cpu_chunks=st.integers(1, 6), with_lmdb=st.booleans(), sliding=st.booleans(),
       policy=st.sampled_from([None, "second_hit", "s3fifo"]))
def test_the_index_fed_by_a_caches_events_holds_what_the_cache_holds(tmp_path: Path, prompts: list[list[int]],
                                                                      steps: list[Any],
                                                                      cpu_chunks: int, with_lmdb: bool,
                                                                      sliding: bool, policy: str | None) -> None:
    """Also with a sliding-window layer (KV groups: its chunks in a namespace of their own, loads
    landing through the groups' path); the full-attention group is the one told.  Also with a CPU
    tier whose policy declines some of what it is given (``second_hit`` admits a chunk the second
    time it comes): what it took of a write is told, what it declined is not."""
    layout = rk.KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2,
                         windows=(0, 4)) if sliding else LAYOUT
    sink = IndexSink()
    chunk_bytes = 4096
    tiers: list[Any] = [CpuTier(cpu_chunks * chunk_bytes, slot_bytes=chunk_bytes, policy=policy)]
    if with_lmdb:
        tiers.append(LmdbTier(str(tmp_path / f"db{time.monotonic_ns()}"), max_bytes=1 << 22))
    with rk.PrefixCache(layout, num_pages=12, chunk_size=CHUNK, tiers=tiers) as cache:
        events = cache.observers.add(KVEvents(sink, namespace=cache.stack.namespace, chunk_size=CHUNK))  # type: ignore[union-attr]
        seen: set[bytes] = set()
        for kind, arg in steps:
            if kind == "req":                    # prompts repeat: loads from the tiers
                prompt = prompts[arg % len(prompts)]
                replay(cache, [prompt])
                seen.add(np.asarray(prompt, dtype="<i4").tobytes())
            elif kind == "drop":                 # the tiers' chunks deleted: each tier told as cleared
                cache.drop_namespace()
            else:
                cache.evict(arg)
            cache.flush()
            assert held_by_medium(sink.index) == truth(cache, seen)
            sink.index.check()
            events.check()
            cache.check()


def test_what_a_tier_takes_of_a_write_it_partly_declines_is_told() -> None:
    """A CPU tier that admits a chunk the second time it comes (``second_hit``): prompt A spilled
    once is declined; spilled again together with prompt B, A's chunks are taken and B's declined.
    The index hears A's as held on the CPU (when any write of a batch was declined, nothing was
    told before), and B's not."""
    sink = IndexSink()
    tiers = [CpuTier(8 * 4096, slot_bytes=4096, policy="second_hit")]
    a, b = [1, 2, 3, 4, 1, 2, 3, 4, 9], [2, 2, 2, 2, 3, 3, 3, 3, 9]
    with rk.PrefixCache(LAYOUT, num_pages=12, chunk_size=CHUNK, tiers=tiers) as cache:
        events = cache.observers.add(KVEvents(sink, namespace=cache.stack.namespace, chunk_size=CHUNK))  # type: ignore[union-attr]
        seen = {np.asarray(p, dtype="<i4").tobytes() for p in (a, b)}
        for step in ("a", "evict", "a", "b", "evict"):
            if step == "evict":
                cache.evict(12)
            else:
                replay(cache, [a if step == "a" else b])
            cache.flush()
            assert held_by_medium(sink.index) == truth(cache, seen), step
        assert tiers[0].stats()["not_admitted"] == 4 and len(held_by_medium(sink.index)["CPU"]) == 2
        sink.index.check()
        events.check()
        cache.check()


def test_vllm_names_chain_across_chunks_and_match_vllm_block_hashes() -> None:
    sink = IndexSink()
    with rk.PrefixCache(LAYOUT, num_pages=64, chunk_size=CHUNK) as cache:
        cache.observers.add(KVEvents(sink, namespace=cache.namespace, chunk_size=CHUNK, names="vllm",
                                     block_size=2, seed="s"))
        prompt = list(range(1, 18))
        replay(cache, [prompt[:9], prompt])          # two inserts: the second chains from the first
        expected = vllm_block_hashes(prompt, 2, seed="s", as_int=True)[:16 // 2]
        assert sink.index.lookup(expected) == {"a": (8, "GPU")}
        parents = {h: p for h, (p, _) in sink.index.held("a").items()}
        assert [parents[h] for h in expected] == [None, *expected[:-1]]


def test_a_cache_publishes_over_zmq_and_a_subscriber_reads_it() -> None:
    with rk.PrefixCache(LAYOUT, num_pages=64, chunk_size=CHUNK, tiers=[CpuTier(1 << 20)]) as cache:
        pub = publish(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        try:
            with Subscriber(pub.publisher.endpoint, replay_endpoint=pub.publisher.replay_endpoint) as sub:
                time.sleep(0.2)                      # the slow joiner: replay covers it anyway
                prompt = list(range(1, 13))
                replay(cache, [prompt])
                cache.flush()
                index = Index()
                deadline = time.monotonic() + 10
                keys = keys_from_token_bytes(np.asarray(prompt, dtype="<i4").tobytes(), CHUNK, cache.stack.namespace.root)  # type: ignore[union-attr]
                names = [external_hash(k) for k in keys]


                def until(match: Any) -> None:
                    while time.monotonic() < deadline and index.lookup(names) != match:
                        for seq, batch in sub.recv(timeout=0.2):
                            index.apply("a", seq, batch)
                    assert index.lookup(names) == match

                until({"a": (3, "GPU")})
                cache.evict(cache.pool.num_pages)           # write_back: the pool's chunks go to the tier
                cache.flush()
                until({"a": (3, "CPU")})
                assert {m for _, ms in index.held("a").values() for m in ms} == {"CPU"}
        finally:
            pub.close()
        assert not cache.observers


def test_bad_arguments_are_refused() -> None:
    ns = rk.Namespace(model="m")
    with pytest.raises(ValueError, match="names"):
        KVEvents(list.append, namespace=ns, chunk_size=4, names="md5")
    with pytest.raises(ValueError, match="block_size"):
        KVEvents(list.append, namespace=ns, chunk_size=4, names="vllm", block_size=3)
    with pytest.raises(ValueError, match="chunk_size"):
        KVEvents(list.append, namespace=ns, chunk_size=0)
