"""radixkv.fleet.metrics: scraped over HTTP while a workload runs, the series say what ``stats()`` says;
faults, gauges and bad arguments; the exposition text the fleet router renders."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import pytest
import torch

import radixkv as rk
from radixkv.backends import CpuTier, LmdbTier
from radixkv.fleet.metrics import SERIES, Exporter, exposition, serve, snapshot
from radixkv.tools.workloads import ChatWorkload, replay

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

LAYOUT = rk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4)


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` of an exposition text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def scrape(url: str) -> dict[Any, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


@pytest.mark.slow                 # a workload scraped over HTTP (seconds): `make test` runs it
def test_the_exporter_scraped_over_http_during_a_workload_matches_stats(tmp_path: Any) -> None:
    tiers = [CpuTier(64 << 10), LmdbTier(tmp_path / "disk", 8 << 20, sync=False)]
    with rk.PrefixCache(LAYOUT, num_pages=48, chunk_size=8, tiers=tiers) as cache, \
            serve(0, cache, instance="engine-0") as server:
        requests = list(ChatWorkload(num_requests=120, num_system_prompts=4, system_prompt_tokens=48,
                                     turn_tokens=(8, 24), query_tokens=(4, 12), seed=3))
        scrapes: list[dict[Any, float]] = []
        done = threading.Event()

        def scraper() -> None:
            while not done.is_set():
                scrapes.append(scrape(server.url))
                done.wait(0.02)

        thread = threading.Thread(target=scraper)
        thread.start()
        try:
            replay(cache, requests)
        finally:
            done.set()
            thread.join()
        cache.flush()
        got = scrape(server.url)
        stats = cache.stats()
        st = stats["stack"]
        assert len(scrapes) >= 2
        # counters only grow between scrapes
        seen = [value(s, "radixkv_query_tokens_total") for s in scrapes] + [value(got, "radixkv_query_tokens_total")]
        assert seen == sorted(seen)
        base = {"namespace": "unnamed", "instance": "engine-0"}
        assert value(got, "radixkv_requests_total", **base) == stats["matches"] == len(requests)
        assert value(got, "radixkv_query_tokens_total", **base) == stats["query_tokens"]
        assert value(got, "radixkv_saved_tokens_total") == stats["hit_tokens"] > 0
        assert value(got, "radixkv_hit_tokens_total", level="pool") == stats["pool_hit_tokens"] > 0
        assert value(got, "radixkv_miss_tokens_total", level="pool") == stats["query_tokens"] - stats["pool_hit_tokens"]
        for i, name in enumerate(st["tiers"]):
            assert value(got, "radixkv_hit_tokens_total", level=name) == stats["tier_hit_tokens_by_tier"][i]
            assert value(got, "radixkv_hit_chunks_total", tier=name) == st["hits"][i]
            assert value(got, "radixkv_read_bytes_total", tier=name) == st["tier_bytes_loaded"][i]
            assert value(got, "radixkv_written_bytes_total", tier=name) == st["tier_bytes_stored"][i]
            assert value(got, "radixkv_lookup_seconds_count", tier=name) == st["tier_lookups"][i]
            assert value(got, "radixkv_store_seconds_count", tier=name) > 0
            assert value(got, "radixkv_faults_total", tier=name) == 0
        assert value(got, "radixkv_hit_tokens_total", level="cpu") > 0
        # every local load is timed; chunk misses: what a lookup asked and no tier above held
        assert value(got, "radixkv_load_seconds_count", tier="cpu") == st["hits"][0]
        assert value(got, "radixkv_miss_chunks_total", tier="lmdb") == st["lookup_keys"] - st["lookup_found"]
        assert value(got, "radixkv_evicted_pages_total", level="pool") == stats["evicted_pages"] > 0
        assert value(got, "radixkv_dropped_writes_total") == st["dropped_writes"]
        # gauges read at scrape time
        page_bytes = LAYOUT.token_bytes * LAYOUT.page_size
        assert value(got, "radixkv_used_bytes", level="pool") == stats["pages_cached"] * page_bytes
        assert value(got, "radixkv_capacity_bytes", level="pool") == 48 * page_bytes
        assert value(got, "radixkv_used_bytes", level="lmdb") == tiers[1].used_bytes > 0
        assert value(got, "radixkv_capacity_bytes", level="cpu") == 64 << 10
        assert value(got, "radixkv_pool_pages", state="free") == stats["pages_free"]
        assert value(got, "radixkv_entries", tier="lmdb") == tiers[1].stats()["entries"]
        assert value(got, "radixkv_hit_rate") == pytest.approx(stats["hit_rate"])
        assert value(got, "radixkv_write_queue_depth") == 0
        server.exporter.check()
        # every series of SERIES that this cache has is exposed (no remote tier: no breaker, no oversize)
        names = {n.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket") for n, _ in got}
        expected = {s.name for s in SERIES} - {"radixkv_breaker_open", "radixkv_oversize_total",
                                                "radixkv_faults_total"}
        assert expected <= names, expected - names
        cache.check()
    assert not server.exporter.attached and not cache.observers      # closing the server detaches


def test_corrupt_and_forged_chunks_are_counted_as_faults(tmp_path: Any) -> None:
    disk = LmdbTier(tmp_path / "disk", 8 << 20, sync=False)
    tokens = list(range(1, 42))
    with rk.PrefixCache(LAYOUT, num_pages=48, chunk_size=8, tiers=[disk]) as cache:
        replay(cache, [tokens])
        cache.flush()
        keys = [cache.namespace.id + ref.key for ref in cache.stack.refs(tokens)]
    disk = LmdbTier(tmp_path / "disk", 8 << 20, sync=False)
    blob = bytearray(disk.get(keys[0]))
    blob[-1] ^= 0xFF                                     # a flipped payload bit: corrupt
    disk.put(keys[0], bytes(blob))
    with rk.PrefixCache(LAYOUT, num_pages=48, chunk_size=8, tiers=[disk]) as cache:
        exporter = Exporter()
        exporter.attach(cache, instance="i")
        replay(cache, [tokens])
        got = parse(exporter.render().decode())
        assert value(got, "radixkv_faults_total", tier="lmdb", kind="corrupt") == 1
        assert value(got, "radixkv_faults_total", kind="forged") == 0
    # the same chunks under a secret the reader does not have: forged
    stack_args = dict(namespace=rk.Namespace(model="m"), layout=LAYOUT, chunk_size=8)
    disk = LmdbTier(tmp_path / "disk2", 8 << 20, sync=False)
    with rk.TierStack([disk], secret="s" * 32, **stack_args) as writer:
        refs = writer.refs(tokens)
        writer.store([(r, torch.ones(LAYOUT.chunk_shape(8))) for r in refs])
        writer.flush()
    disk = LmdbTier(tmp_path / "disk2", 8 << 20, sync=False)
    with rk.TierStack([disk], secret="t" * 32, **stack_args) as reader:
        exporter = Exporter()
        exporter.attach(reader, instance="r")
        assert reader.load(refs) == []
        got = parse(exporter.render().decode())
        assert value(got, "radixkv_faults_total", tier="lmdb", kind="forged") == 1
        assert value(got, "radixkv_used_bytes", level="lmdb") > 0
        assert ("radixkv_requests_total", frozenset()) not in got     # a stack has no pool series


def test_two_caches_share_one_registry_and_the_router_renders_it() -> None:
    registry = prometheus_client.CollectorRegistry()
    exporter = Exporter(registry)
    a = rk.PrefixCache(LAYOUT, num_pages=16, namespace=rk.Namespace(model="m1", salt=b"tenant-a"))
    b = rk.PrefixCache(LAYOUT, num_pages=16, namespace=rk.Namespace(model="m1", salt=b"tenant-b"))
    exporter.attach(a, instance="a")
    exporter.attach(b, instance="b")
    with pytest.raises(ValueError, match="instance"):
        exporter.attach(a, instance="a")
    replay(a, [list(range(1, 30))] * 2)
    body, content_type = exposition(registry)
    assert content_type.startswith("text/plain")
    got = parse(body.decode())
    assert value(got, "radixkv_query_tokens_total", instance="a", namespace="m1") == 58
    assert value(got, "radixkv_query_tokens_total", instance="b") == 0
    assert not any("tenant" in str(labels) for _, labels in got)      # the salt is never a label
    flat = snapshot(registry)
    assert flat["radixkv_query_tokens_total|instance=a,namespace=m1"] == 58
    assert exporter.detach(exporter.attached[0]) and len(exporter.attached) == 1


def test_bad_arguments_name_themselves() -> None:
    cache = rk.PrefixCache(LAYOUT, num_pages=8)
    with pytest.raises(TypeError, match="registry"):
        Exporter(registry=object())
    with pytest.raises(ValueError, match="buckets"):
        Exporter(buckets=(1.0, 0.5))
    with pytest.raises(TypeError, match="target"):
        Exporter().attach(object())                     # type: ignore[arg-type]
    with pytest.raises(TypeError, match="instance"):
        Exporter().attach(cache, instance=3)            # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        serve(-1, cache)
    with pytest.raises(TypeError, match="host"):
        serve(0, cache, host="")


def test_requests_served_from_lossy_chunks_are_their_own_series(tmp_path: Any) -> None:
    pytest.importorskip("zstandard")
    layout = rk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4)
    tokens = list(range(64))
    with rk.PrefixCache(layout, num_pages=32, chunk_size=32, tiers=[LmdbTier(tmp_path / "d", 8 << 20)],
                        codecs=["int8"]) as cache:
        exporter = Exporter()
        exporter.attach(cache, instance="i")
        pages = cache.alloc(16)
        cache.pool.kv[:, :, pages] = torch.randn_like(cache.pool.kv[:, :, pages])
        cache.insert(tokens, pages)
        cache.flush()
        cache.evict(32)
        cache.open(tokens + [1], load="wait").release()          # loaded from int8 chunks
        cache.open([500, 501, 502, 503, 504]).release()           # nothing cached: not approximate
        got = parse(exporter.render().decode())
        assert value(got, "radixkv_approximate_requests_total") == 1 == cache.stats()["requests_approximate"]
        assert value(got, "radixkv_lossy_chunks_total", tier="lmdb") == 2
