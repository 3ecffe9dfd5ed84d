"""RedisTier against a real redis-server on 127.0.0.1 (Debian's package), never a mock: the tier
contract, the layout, TTL by server expiry, maxmemory eviction, two processes sharing a server,
the server killed mid-workload and restarted, and every match bounded by a deadline behind a slow
or trickling proxy.  Skipped only where redis-server is not installed and not in CI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("redis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from radixkv import PrefixCache  # noqa: E402
from radixkv.backends import Tier  # noqa: E402
from radixkv.backends.redis import RedisTier, parse_redis_url  # noqa: E402
from radixkv.core.hashing import Namespace  # noqa: E402
from radixkv.core.pool import KVLayout  # noqa: E402
from radixkv.testing.proxy import FaultyProxy, timed_requests  # noqa: E402
from radixkv.tools.redisserver import RedisServer, redis_server_binary  # noqa: E402
from radixkv.testing.contract import TierContract  # noqa: E402
from radixkv.core.stack import TierStack  # noqa: E402

pytestmark = pytest.mark.slow      # a real redis-server: `pytest -m "not slow"` leaves it out

if redis_server_binary() is None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise RuntimeError("redis-server is not installed, and CI must run the Redis tests: "
                           "apt-get install -y redis-server")
    pytest.skip("redis-server is not installed (apt-get install redis-server)", allow_module_level=True)

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=4)
SECRET = "a-deployment-secret-for-tests"


def key(i: int, ns: int = 0) -> bytes:
    return bytes([ns]) * 8 + i.to_bytes(16, "little")


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def tier(server: RedisServer) -> Iterator[RedisTier]:
    with RedisTier(server.url, prefix=f"t{uuid.uuid4().hex[:10]}") as t:
        yield t
        t.check()


# -- configuration and layout -----------------------------------------------------------------

def test_urls_parse_and_bad_ones_name_the_key_without_the_password() -> None:
    assert parse_redis_url("rediss://u:pw@cache:6380/3?prefix=kv") == {
        "host": "cache", "port": 6380, "db": 3, "ssl": True, "username": "u", "password": "pw", "prefix": "kv"}
    for bad in ("http://h", "redis://:hunter2-secret@h/x", "redis://h/0?db=1", "redis:///0", "redis://h/0?prefix=a*"):
        with pytest.raises(ValueError, match="remote_url") as info:
            parse_redis_url(bad)
        assert "hunter2-secret" not in str(info.value)


def test_values_live_under_prefix_namespace_key_and_drop_is_exact(server: RedisServer) -> None:
    import redis

    raw = redis.Redis.from_url(server.url)
    ns = bytes([7]) * 8
    outer = RedisTier(server.url, prefix="kvx")
    inner = RedisTier(server.url, prefix=f"kvx:{ns.hex()}")  # a prefix that looks like outer's namespace
    try:
        assert outer.put_many([(key(i, 7), b"o%d" % i) for i in range(3)]) == 3
        assert inner.put_many([(key(i, 1), b"i%d" % i) for i in range(3)]) == 3
        assert raw.get(f"kvx:{ns.hex()}:{key(1)[8:].hex()}") == b"o1"
        assert outer.drop_namespace(ns) == 3
        assert outer.contains_prefix([key(0, 7)]) == 0
        assert inner.contains_prefix([key(i, 1) for i in range(3)]) == 3, "drop_namespace reached another tier"
        assert "secret" not in repr(RedisTier(f"redis://:a-secret@127.0.0.1:{server.port}/0", lazy=True))
    finally:
        outer.close()
        inner.close()


def test_contract(server: RedisServer) -> None:
    """The differential state machine: without maxmemory the server never evicts (exact)."""
    import redis

    raw = redis.Redis.from_url(server.url)

    class RedisContract(TierContract):
        exact = True
        keys_per_namespace = 4

        def make_tier(self) -> Tier:
            raw.flushdb()
            return RedisTier(server.url, max_concurrency=2)

    run_state_machine_as_test(RedisContract, settings=settings(
        max_examples=min(settings().max_examples, 15), stateful_step_count=15, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_lookups_are_one_round_trip_and_oversize_values_are_never_read(tier: RedisTier) -> None:
    from radixkv.backends import bounded

    assert tier.put_many([(key(i), b"v" * 100) for i in range(5)]) == 5
    assert tier.contains_prefix([key(i) for i in range(8)]) == 5
    before = tier.stats()["bytes_read"]
    with bounded(max_blob_bytes=50):
        assert tier.get_many([key(0), key(1)]) == [None, None]
    stats = tier.stats()
    assert stats["oversize"] == 2 and stats["bytes_read"] == before
    assert tier.contains_prefix([key(0)]) == 0, "an oversize value under a caller's bound is deleted"
    # Through a stack: refused unread, deleted, and counted as corrupt by the stack too.
    stack = TierStack([tier], namespace=Namespace(model="oversize").bind(LAYOUT), layout=LAYOUT, chunk_size=4)
    refs = stack.refs(list(range(8)))
    assert stack.store([(r, torch.ones(LAYOUT.chunk_shape(4), dtype=torch.float16)) for r in refs]) == 2
    assert stack.flush(10)
    name = stack.namespace.id + refs[1].key
    tier._client.set(tier.redis_key(name), bytes(1 << 20))  # a 1 MiB value where a chunk should be
    before = tier.stats()["bytes_read"]
    assert len(stack.load(refs, where=[0, 0])) == 1
    assert tier.stats()["oversize"] == 3 and tier.stats()["bytes_read"] - before < 1 << 10
    assert stack.stats()["corrupt"] == [1], "the stack did not count the refused value as corrupt"
    assert tier.contains_prefix([name]) == 0, "the oversize value was not deleted"
    stack.close()  # closes the tier too (the fixture checks it after)


def test_ttl_is_the_servers_expiry(server: RedisServer) -> None:
    with RedisTier(server.url, prefix=f"ttl{uuid.uuid4().hex[:8]}", ttl_s=0.3) as t:
        assert t.put(key(0), b"x") and t.contains_prefix([key(0)]) == 1
        time.sleep(0.5)
        assert t.contains_prefix([key(0)]) == 0 and t.get(key(0)) is None


def test_maxmemory_eviction_by_the_server_is_a_miss_never_wrong_data() -> None:
    with RedisServer(maxmemory=2 << 20) as small:
        stack = TierStack([RedisTier(small.url)], namespace=Namespace(model="r").bind(LAYOUT), layout=LAYOUT,
                          chunk_size=4096, secret=SECRET)
        refs = stack.refs(list(range(4096 * 80)))
        kvs = [torch.full(LAYOUT.chunk_shape(4096), float(i), dtype=torch.float16) for i in range(len(refs))]
        for ref, kv in zip(refs, kvs):  # 80 chunks of 32 KiB through a 2 MiB server
            assert stack.store([(ref, kv)]) == 1
            stack.flush()
        held = stack.lookup([r.key for r in refs])
        info = stack.tiers[0]._client.info("stats")  # type: ignore[attr-defined]
        assert info["evicted_keys"] > 0 and len(held) < len(refs)
        # What is still there loads exactly; the evicted part is a miss.
        last = [i for i in range(len(refs)) if stack.tiers[0].contains_prefix([stack.namespace.id + refs[i].key])]
        assert last, "the server kept nothing"
        i = last[-1]
        got = stack.load([refs[i]], where=[0])
        assert len(got) == 1 and torch.equal(got[0], kvs[i])
        stack.check()
        stack.close()


# -- processes, crashes ----------------------------------------------------------------------

_WRITER = """
import sys, torch
from radixkv.backends.redis import RedisTier
from radixkv.core.hashing import Namespace
from radixkv.core.pool import KVLayout
from radixkv.core.stack import TierStack
layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=4)
stack = TierStack([RedisTier(sys.argv[1])], namespace=Namespace(model="shared").bind(layout), layout=layout,
                  chunk_size=4, secret=sys.argv[2])
refs = stack.refs(list(range(40)))
stack.store([(r, torch.full(layout.chunk_shape(4), float(i), dtype=torch.float16)) for i, r in enumerate(refs)])
stack.close()
print("stored", len(refs))
"""


def test_two_processes_share_it(server: RedisServer) -> None:
    out = subprocess.run([sys.executable, "-c", _WRITER, server.url, SECRET], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "stored 10" in out.stdout, out.stderr
    with TierStack([RedisTier(server.url)], namespace=Namespace(model="shared").bind(LAYOUT), layout=LAYOUT,
                   chunk_size=4, secret=SECRET) as stack:
        refs = stack.refs(list(range(40)))
        where = stack.lookup([r.key for r in refs])
        got = stack.load(refs, where=where)
        assert len(got) == 10 and all(torch.equal(t, torch.full_like(t, float(i))) for i, t in enumerate(got))
    with TierStack([RedisTier(server.url)], namespace=Namespace(model="shared").bind(LAYOUT), layout=LAYOUT,
                   chunk_size=4, secret="another-deployment-secret") as other:
        assert other.load(refs) == [] and other.stats()["forged"] == [1], "a foreign secret's chunk was served"


def test_server_killed_mid_workload_then_restarted(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer() as own:
        tier = RedisTier(own.url, read_timeout_s=0.5, connect_timeout_s=0.5, failure_threshold=2, backoff_s=0.2)
        cache = PrefixCache(LAYOUT, num_pages=32, namespace=Namespace(model="kill"), chunk_size=4, tiers=[tier])
        assert cache.stack is not None
        tokens = list(range(17))
        chunks = [torch.full(LAYOUT.chunk_shape(4), float(i), dtype=torch.float16) for i in range(4)]
        cache.stack.store(zip(cache.stack.refs(tokens), chunks))
        assert cache.stack.flush(10)

        def match() -> int:
            cache.evict(cache.pool.num_pages)
            m = cache.match(tokens)
            cache.release(m)
            return m.num_tokens

        assert match() == 16
        own.kill()
        t0 = time.perf_counter()
        assert [match() for _ in range(10)] == [0] * 10  # misses, never an exception
        assert time.perf_counter() - t0 < 10 and tier.breaker.opened >= 1
        own.start()  # same port, empty
        # A match after the back-off starts a background probe (and is a miss meanwhile); the probe
        # closes the breaker.
        deadline = time.monotonic() + 30
        while tier.breaker.state != "closed":
            assert time.monotonic() < deadline, "the breaker did not close after the server came back"
            assert match() == 0
            time.sleep(0.05)
        assert match() == 0
        cache.stack.store(zip(cache.stack.refs(tokens), chunks))
        assert cache.stack.flush(10) and match() == 16
        assert sum(cache.stack.stats()["errors"]) >= 1
        cache.check()
        cache.close()


# -- deadlines --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["slow", "trickle"])
def test_a_slow_or_trickling_server_costs_at_most_the_deadline_and_opens_the_breaker(
        server: RedisServer, mode: str) -> None:
    deadline_s = 0.5
    with FaultyProxy(("127.0.0.1", server.port), delay_s=0.8, trickle_bytes=16, trickle_interval_s=0.3) as proxy:
        tier = RedisTier(f"redis://127.0.0.1:{proxy.port}/0", prefix=f"d{uuid.uuid4().hex[:8]}",
                         read_timeout_s=5.0, failure_threshold=2, backoff_s=30)
        stack = TierStack([tier], namespace=Namespace(model="deadline").bind(LAYOUT), layout=LAYOUT,
                          chunk_size=4, timeout_s=deadline_s)
        refs = stack.refs(list(range(64)))
        stack.store([(r, torch.ones(LAYOUT.chunk_shape(4), dtype=torch.float16)) for r in refs])
        assert stack.flush(30)
        assert len(stack.load(refs, where=stack.lookup([r.key for r in refs]))) == len(refs)
        proxy.mode = mode
        worst = max(timed_requests(stack, refs, deadline_s, rounds=4))
        assert worst < 2 * deadline_s, f"a lookup+load took {worst:.2f} s with a {deadline_s} s deadline"
        assert tier.breaker.opened >= 1 and stack.stats()["timeouts"][0] >= 1
        stack.close(timeout=1)
