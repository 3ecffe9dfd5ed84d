"""S3Tier against a real S3 server: moto's, in a subprocess on 127.0.0.1, spoken to over HTTP.

The session's server starts once (``s3_server``) and is stopped by its process handle at the end;
the fault tests start their own, since they pause and kill it.  Nothing here mocks boto3.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from radixkv import PrefixCache, backends  # noqa: E402
from radixkv.backends import Tier  # noqa: E402
from radixkv.backends.s3 import CircuitBreaker, S3Tier, parse_remote_url  # noqa: E402
from radixkv.tools.s3server import CREDENTIALS, MotoServer, moto_with_bucket  # noqa: E402
from radixkv.core.hashing import Namespace  # noqa: E402
from radixkv.core.pool import KVLayout  # noqa: E402
from radixkv.testing.contract import TierContract  # noqa: E402
from radixkv.core.stack import TierStack  # noqa: E402

pytestmark = pytest.mark.slow      # a real S3 server (moto) in a subprocess: `pytest -m "not slow"` leaves it out

BUCKET = "radixkv-test"
TIMEOUT_S = 1.0  # connect and read timeout of the fault tests: large beside a loaded machine's jitter


def key(i: int, ns: int = 0) -> bytes:
    return bytes([ns]) * 8 + i.to_bytes(16, "little")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """moto's S3 server for the session, with boto3's credential chain pointed at test values."""
    with moto_with_bucket(BUCKET) as server:
        yield server


@pytest.fixture(scope="session")
def raw(s3_server: MotoServer) -> Any:
    """A plain boto3 client on the session's server, for looking behind the tier's back."""
    return s3_server.client()


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tier(s3_server: MotoServer, prefix: str) -> Iterator[S3Tier]:
    with S3Tier(BUCKET, prefix, endpoint_url=s3_server.endpoint_url) as t:
        yield t
        t.check()


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("url, expected", [
    ("s3://my-bucket", ("my-bucket", "")),
    ("s3://my-bucket/", ("my-bucket", "")),
    ("s3://my.bucket-1/kv/", ("my.bucket-1", "kv")),
    ("s3://abc/a/b/c", ("abc", "a/b/c")),
])
def test_parse_remote_url(url: str, expected: tuple[str, str]) -> None:
    assert parse_remote_url(url) == expected


@pytest.mark.parametrize("url, match", [
    ("http://bucket/kv", "must start with 's3://'"),
    ("bucket/kv", "must start with 's3://'"),
    ("s3://", "not a valid S3 bucket name"),
    ("s3://ab/kv", "not a valid S3 bucket name"),
    ("s3://My_Bucket/kv", "not a valid S3 bucket name"),
    ("s3://bucket:9000/kv", "credentials or a port"),
    ("s3://bucket/kv?region=x", "query or fragment"),
    ("s3://bucket/a//b", "empty path segments"),
])
def test_parse_remote_url_rejects_malformed_urls(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_remote_url(url)
    with pytest.raises(TypeError, match="remote_url must be a str"):
        parse_remote_url(b"s3://bucket")  # type: ignore[arg-type]


def test_a_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError) as info:
        parse_remote_url("s3://AKIDSECRET:hunter2@bucket/kv")
    assert "hunter2" not in str(info.value) and "AKIDSECRET" not in str(info.value)


def test_from_url_and_the_registry_build_the_tier(s3_server: MotoServer, raw: Any) -> None:
    with S3Tier.from_url(f"s3://{BUCKET}/cfg/", endpoint_url=s3_server.endpoint_url, max_concurrency=4) as tier:
        assert (tier.bucket, tier.prefix, tier.max_concurrency) == (BUCKET, "cfg", 4)
        assert tier.object_key(key(1, ns=2)) == f"cfg/{'02' * 8}/{key(1)[8:].hex()}"
    with backends.create("s3", bucket=BUCKET, client=raw) as tier:
        assert isinstance(tier, S3Tier) and tier.object_key(key(0)).startswith("0000")


def test_a_missing_bucket_is_a_clear_error_at_construction(s3_server: MotoServer) -> None:
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' at http://127.0.0.1.*does not exist"):
        S3Tier("no-such-bucket", endpoint_url=s3_server.endpoint_url)
    S3Tier("no-such-bucket", endpoint_url=s3_server.endpoint_url, lazy=True).close()  # lazy: a warning, no error


def test_an_unreachable_endpoint_is_a_clear_error_unless_lazy(s3_server: MotoServer) -> None:
    from radixkv.tools.s3server import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match="unreachable.*lazy=True"):
        S3Tier(BUCKET, endpoint_url=dead, connect_timeout_s=TIMEOUT_S, max_attempts=1)
    with S3Tier(BUCKET, endpoint_url=dead, connect_timeout_s=TIMEOUT_S, max_attempts=1, lazy=True,
                failure_threshold=1) as tier:
        # Lazy: the failed check opened the breaker, so requests are skipped, never sent.
        assert tier.breaker.state != "closed"
        assert tier.get(key(0)) is None and tier.contains_prefix([key(0)]) == 0
        assert tier.put(key(0), b"x") is False
        assert tier.stats()["skipped"] == 1 and tier.stats()["skipped_puts"] == 1
        assert tier.stats()["get_errors"] == 0 and tier.stats()["put_errors"] == 0
        tier.check()


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket": "ab"}, "bucket"), ({"prefix": "a//b"}, "prefix"), ({"read_timeout_s": 0}, "read_timeout_s"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"multipart_threshold": 1 << 20}, "multipart_threshold"),
    ({"ttl_s": -1}, "ttl_s"), ({"namespace_ttl_s": {b"short": 1.0}}, "ns_id"),
    ({"endpoint_url": "http://127.0.0.1:1"}, "either client or endpoint_url"),
])
def test_bad_arguments_raise_naming_them(raw: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        S3Tier(**{"bucket": BUCKET, "client": raw, **kwargs})


def test_breaker_validates_its_arguments() -> None:
    for kwargs in ({"failure_threshold": 0}, {"backoff_s": 0}, {"backoff_s": 5, "max_backoff_s": 1},
                   {"probe": lambda: None, "probe_timeout_s": 0}):
        with pytest.raises(ValueError):
            CircuitBreaker(**kwargs)
    assert CircuitBreaker().max_backoff_s == 5.0 and CircuitBreaker(backoff_s=8).max_backoff_s == 8.0


def test_breaker_backs_off_twice_as_long_after_each_failed_probe_jittered_and_capped() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, backoff_s=1.0, max_backoff_s=5.0, clock=lambda: now[0],
                             probe=lambda: 1 / 0)
    breaker.record(False)
    waits = []
    for _ in range(8):
        assert breaker.state == "open"
        waits.append(breaker._retry_at - now[0])
        now[0] = breaker._retry_at - 1e-6
        assert breaker.allow() is False and breaker.state == "open", "probed before the back-off passed"
        now[0] = breaker._retry_at
        assert breaker.allow() is False, "a request was let through as the probe"
        assert breaker.wait_probe(30)
        breaker.check()
    for wait, nominal in zip(waits, [1, 2, 4, 5, 5, 5, 5, 5]):
        assert 0.8 * nominal <= wait <= min(5.0, 1.2 * nominal), (waits, nominal)
    assert all(w != n for w, n in zip(waits, [1, 2, 4, 5, 5, 5, 5, 5])), f"not jittered: {waits}"
    assert breaker.probes == 8 and breaker.opened == 9


def test_breaker_bounds_a_hung_probe_and_the_probe_calls_left_running() -> None:
    from radixkv.backends.remote import PROBE_CALLS as _PROBE_CALLS

    now, release, calls = [0.0], threading.Event(), []

    def hang() -> None:
        calls.append(1)
        release.wait(60)

    breaker = CircuitBreaker(failure_threshold=1, backoff_s=1.0, clock=lambda: now[0], probe=hang,
                             probe_timeout_s=0.05)
    try:
        breaker.record(False)
        for _ in range(_PROBE_CALLS + 2):
            now[0] += 10.0
            assert breaker.allow() is False and breaker.wait_probe(30)
            assert breaker.state == "open"  # no answer within its bound: a failed probe
            breaker.check()
        assert len(calls) == _PROBE_CALLS, "more hung probe calls than the bound"
        release.set()
        deadline = time.monotonic() + 30
        while breaker._calls and time.monotonic() < deadline:
            time.sleep(0.01)
        breaker.set_probe(hang, 30.0)  # an answer now comes at once: bound it generously
        now[0] += 10.0
        assert breaker.allow() is False and breaker.wait_probe(30) and len(calls) == _PROBE_CALLS + 1
        assert breaker.state == "closed" and breaker.allow() is True
        breaker.check()
    finally:
        release.set()


# -- the contract -----------------------------------------------------------------------------

def test_s3_tier_meets_the_tier_contract(s3_server: MotoServer, raw: Any) -> None:
    """The differential state machine: an S3 bucket never evicts (exact) and outlives the tier
    object (persistent).  Each example gets its own prefix; fewer steps than in-memory tiers,
    since every step is a few HTTP round trips."""

    class S3Contract(TierContract):
        exact = True
        persistent = True
        keys_per_namespace = 4

        def __init__(self) -> None:
            self.prefix = f"contract/{uuid.uuid4().hex[:12]}"
            super().__init__()

        def make_tier(self) -> Tier:
            return S3Tier(BUCKET, self.prefix, client=raw, max_concurrency=4)

        def teardown(self) -> None:
            super().teardown()
            for page in raw.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix + "/"):
                for obj in page.get("Contents", ()):
                    raw.delete_object(Bucket=BUCKET, Key=obj["Key"])

    run_state_machine_as_test(S3Contract, settings=settings(
        max_examples=min(settings().max_examples, 8), stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# -- layout, namespaces, TTL, large objects ---------------------------------------------------

def test_objects_live_under_prefix_namespace_key(tier: S3Tier, raw: Any, prefix: str) -> None:
    assert tier.put_many([(key(i, ns), b"blob%d" % i) for i in range(3) for ns in (1, 2)]) == 6
    names = sorted(o["Key"] for o in raw.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"])
    assert names == sorted(f"{prefix}/{bytes([ns]).hex() * 8}/{key(i)[8:].hex()}" for i in range(3) for ns in (1, 2))
    assert tier.drop_namespace(bytes([1]) * 8) == 3
    assert tier.contains_prefix([key(0, 1)]) == 0 and tier.contains_prefix([key(i, 2) for i in range(3)]) == 3
    got = tier.get_many([key(0, 2), key(9, 2), key(2, 2)])
    assert [None if b is None else bytes(b) for b in got] == [b"blob0", None, b"blob2"]


def test_an_empty_blob_round_trips(tier: S3Tier) -> None:
    assert tier.put(key(0), b"") and tier.get(key(0)) == b"" and tier.contains_prefix([key(0)]) == 1


def test_check_catches_counters_that_do_not_add_up(tier: S3Tier) -> None:
    tier.put(key(0), b"x")
    tier.get(key(0))
    tier.check()
    tier._counts["hits"] += 1
    with pytest.raises(AssertionError, match="outcomes != requests"):
        tier.check()
    tier._counts["hits"] -= 1


def test_contains_prefix_stops_at_the_first_missing_key_across_windows(s3_server: MotoServer, prefix: str) -> None:
    with S3Tier(BUCKET, prefix, endpoint_url=s3_server.endpoint_url, max_concurrency=3) as tier:
        tier.put_many((key(i), b"x") for i in range(10) if i != 7)
        keys = [key(i) for i in range(10)]
        assert tier.contains_prefix(keys) == 7
        assert tier.contains_prefix(keys[:7]) == 7 and tier.contains_prefix(keys[8:]) == 2
        assert tier.contains_prefix([]) == 0
        tier.check()


def test_objects_older_than_the_ttl_are_misses(s3_server: MotoServer, raw: Any, prefix: str) -> None:
    now = [time.time()]
    short, long = bytes([1]) * 8, bytes([2]) * 8
    with S3Tier(BUCKET, prefix, client=raw, ttl_s=3600, namespace_ttl_s={short: 60},
                clock=lambda: now[0]) as tier:
        tier.put(short + bytes(16), b"a")
        tier.put(long + bytes(16), b"b")
        assert tier.contains_prefix([short + bytes(16)]) == 1
        now[0] += 120  # past the short namespace's TTL, within the default
        assert tier.get(short + bytes(16)) is None and tier.contains_prefix([short + bytes(16)]) == 0
        assert tier.get(long + bytes(16)) == b"b"
        now[0] += 7200
        assert tier.get(long + bytes(16)) is None and tier.stats()["expired"] == 2
        tier.put(long + bytes(16), b"c")  # rewriting renews it (S3's LastModified is the server's clock)
        now[0] = time.time()
        assert tier.get(long + bytes(16)) == b"c"
        tier.check()


@pytest.mark.timeout(120)
def test_large_objects_go_multipart_and_come_back_in_ranges(s3_server: MotoServer, raw: Any, prefix: str) -> None:
    blobs = [os.urandom((11 << 20) + i) for i in range(3)]
    with S3Tier(BUCKET, prefix, client=raw, multipart_threshold=5 << 20, multipart_chunksize=5 << 20,
                max_concurrency=2) as tier:
        assert tier.put(key(0), memoryview(blobs[0]))
        head = raw.head_object(Bucket=BUCKET, Key=tier.object_key(key(0)))
        assert head["ContentLength"] == len(blobs[0]) and head["ETag"].endswith('-3"')  # three parts
        assert bytes(tier.get(key(0)) or b"") == blobs[0]
        # More large gets than pool threads: each fetches its ranges itself, never deadlocking the pool.
        assert tier.put_many((key(i), b) for i, b in enumerate(blobs)) == 3
        assert [bytes(b or b"") for b in tier.get_many([key(i) for i in range(3)])] == blobs
        tier.check()


def test_an_object_overwritten_during_a_ranged_read_is_a_miss(s3_server: MotoServer, prefix: str) -> None:
    real = s3_server.client()

    class OverwriteAfterFirstGet:
        """A real client that overwrites the object right after the first GET answered."""

        def __init__(self) -> None:
            self.gets = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def get_object(self, **kw: Any) -> Any:
            resp = real.get_object(**kw)
            self.gets += 1
            if self.gets == 1:
                real.put_object(Bucket=kw["Bucket"], Key=kw["Key"], Body=b"y" * ((6 << 20) + 1))
            return resp

    with S3Tier(BUCKET, prefix, client=OverwriteAfterFirstGet(), multipart_threshold=5 << 20,
                multipart_chunksize=5 << 20) as tier:
        real.put_object(Bucket=BUCKET, Key=tier.object_key(key(0)), Body=b"x" * ((6 << 20) + 1))
        assert tier.get(key(0)) is None and tier.stats()["misses"] == 1
        assert bytes(tier.get(key(0)) or b"") == b"y" * ((6 << 20) + 1)


# -- corrupt objects, end to end through the stack -------------------------------------------

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=2)


def _stack(tier: Tier) -> TierStack:
    return TierStack([tier], namespace=Namespace(model="s3-test").bind(LAYOUT), layout=LAYOUT, chunk_size=4)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bit flip"])
def test_a_damaged_object_is_detected_counted_and_deleted_never_served(tier: S3Tier, raw: Any, damage: str) -> None:
    with _stack(tier) as stack:
        refs = stack.refs(list(range(12)))
        kvs = [torch.randn(LAYOUT.chunk_shape(4)).half() for _ in refs]
        stack.store(zip(refs, kvs))
        assert stack.flush(10)
        assert stack.lookup([r.key for r in refs]) == [0, 0, 0]
        name = tier.object_key(stack.namespace.id + refs[1].key)
        good = raw.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        bad = {"garbage": os.urandom(len(good)), "truncated": good[:-9],
               "bit flip": good[:-1] + bytes([good[-1] ^ 1])}[damage]
        raw.put_object(Bucket=BUCKET, Key=name, Body=bad)
        loaded = stack.load(refs)
        assert len(loaded) == 1 and torch.equal(loaded[0], kvs[0])  # stops before the damaged chunk
        assert stack.stats()["corrupt"] == [1]
        assert stack.flush(10)  # a remote tier's bad blob is deleted by the writer thread
        assert tier.contains_prefix([stack.namespace.id + refs[1].key]) == 0  # deleted
        stack.check()


# -- faults -----------------------------------------------------------------------------------

@pytest.fixture
def own_server(s3_server: MotoServer) -> Iterator[MotoServer]:
    """A server of the test's own, to pause and kill (the credentials come from ``s3_server``)."""
    with MotoServer() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


def test_a_dead_endpoint_costs_one_timeout_then_misses_until_it_comes_back(
        own_server: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    """Matches through a ``PrefixCache`` whose only tier is S3, while the server hangs (paused),
    comes back, dies (killed) and comes back again."""
    caplog.set_level(logging.DEBUG, logger="radixkv")
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, backoff_s=1.0, max_backoff_s=1.0, clock=lambda: now[0])
    tier = S3Tier(BUCKET, "kv", endpoint_url=own_server.endpoint_url, connect_timeout_s=TIMEOUT_S,
                  read_timeout_s=TIMEOUT_S, max_attempts=1, breaker=breaker)
    cache = PrefixCache(LAYOUT, num_pages=32, namespace=Namespace(model="s3-test"), chunk_size=4, tiers=[tier])
    stack = cache.stack
    assert stack is not None
    tokens = list(range(4 * 4 + 1))  # four chunks and the token left to compute
    m = cache.match(tokens)
    new = cache.alloc(9)
    cache.pool.kv[:, :, new] = torch.arange(9, dtype=torch.float16).view(1, 1, 9, 1, 1, 1)
    cache.insert(tokens, new)  # write-through: the four chunks go to the bucket
    cache.release(m)
    assert stack.flush(10)
    others = stack.refs(list(range(100, 132)))
    spare = torch.zeros(LAYOUT.chunk_shape(4), dtype=torch.float16)

    def workload(n: int) -> list[int]:
        """``n`` matches that must come from the bucket, and stores; none may raise."""
        matched = []
        for i in range(n):
            cache.evict(cache.pool.num_pages)  # the pool forgets: only the bucket can answer
            m = cache.match(tokens)
            matched.append(m.num_tokens)
            cache.release(m)
            stack.store([(others[i % len(others)], spare)])
        return matched

    assert workload(2) == [16, 16] and cache.stats()["tier_hit_tokens"] == 32

    own_server.pause()  # connections hang: every request waits for its read timeout
    try:
        t0 = time.perf_counter()
        matched = workload(20)
        lost = time.perf_counter() - t0
        assert matched == [0] * 20
        assert breaker.state == "open" and stack.flush(10)  # failed writes were dropped, not retried forever
        stats = tier.stats()
        assert stats["put_errors"] + stats["skipped_puts"] >= 1 and stats["breaker_opened"] == 1
        # The first match's HEADs (and the writer's put) time out together and open the breaker;
        # every later match is a miss at once.
        assert lost < 5 * TIMEOUT_S, f"lost {lost:.2f} s while the endpoint hung"
        errors = stack.stats()["errors"]
        now[0] += 1.0  # the back-off passed: the next request starts a background probe, and skips
        t0 = time.perf_counter()
        assert workload(2) == [0, 0]
        probe = time.perf_counter() - t0
        assert probe < 5 * TIMEOUT_S, f"the matches beside the probe cost {probe:.2f} s"
        assert breaker.wait_probe(30) and breaker.opened == 2 and breaker.state == "open"  # it timed out
        assert stack.stats()["errors"] == errors, "a request was the probe"
    finally:
        own_server.resume()
    own_server.client().head_bucket(Bucket=BUCKET)  # it answers again (after the requests it owed)
    now[0] += 1.0
    assert workload(1) == [0]  # this match starts the probe (skipped meanwhile) ...
    assert breaker.wait_probe(30) and breaker.state == "closed"  # ... which closes the breaker
    assert workload(1) == [16]  # recovered by itself
    m = cache.match(tokens)
    assert torch.equal(cache.pool.kv[0, 0, m.pages, 0, 0, 0], torch.arange(8, dtype=torch.float16))
    cache.release(m)

    own_server.stop()  # connection refused: fails fast, same breaker
    t0 = time.perf_counter()
    assert workload(10) == [0] * 10 and breaker.state == "open"
    refused = time.perf_counter() - t0
    assert refused < 5 * TIMEOUT_S, f"lost {refused:.2f} s while the endpoint refused connections"
    own_server.start()  # the same port; moto lost its objects, so the bucket comes back empty
    own_server.client().create_bucket(Bucket=BUCKET)
    now[0] += 1.0
    assert workload(1) == [0] and breaker.wait_probe(30) and breaker.state == "closed"
    stack.store(zip(stack.refs(tokens), [spare] * 4))
    assert stack.flush(10) and workload(1) == [16]
    cache.check()
    cache.close()
    assert stack.stats()["errors"][0] >= 2
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    assert secret not in caplog.text and CREDENTIALS["AWS_ACCESS_KEY_ID"] + ":" not in caplog.text


# -- two processes, one bucket ----------------------------------------------------------------

_CHILD = Path(__file__).resolve()
_TOKENS = list(range(1000, 1000 + 6 * 8 + 3))  # six full chunks of 8 tokens and a tail


def _child(role: str, endpoint: str, prefix: str, workdir: str) -> dict[str, Any]:
    """One engine process: its own pool, CPU tier and LMDB path, and the shared bucket."""
    from radixkv.backends.cpu import CpuTier
    from radixkv.backends.lmdb import LmdbTier

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    s3 = S3Tier(BUCKET, prefix, endpoint_url=endpoint)
    cache = PrefixCache(layout, num_pages=64, namespace=Namespace(model="cross-instance"), chunk_size=8,
                        tiers=[CpuTier(max_bytes=1 << 20), LmdbTier(os.path.join(workdir, role), max_bytes=1 << 20),
                               s3], write_policy="write_through")
    m = cache.match(_TOKENS)
    expected_path = os.path.join(workdir, "kv.bin")
    if role == "writer":
        new = cache.alloc(13)  # twelve full pages of 4 tokens and the tail's
        g = torch.Generator().manual_seed(0)
        cache.pool.kv[:, :, new] = torch.randn(cache.pool.kv[:, :, new].shape, generator=g).half()
        cache.insert(_TOKENS, torch.cat([m.pages, new]))
        cache.release(m)
        written = cache.pool.kv[:, :, new[:12]].contiguous()  # the six chunks' pages
        with open(expected_path, "wb") as f:
            f.write(written.numpy().tobytes())
        result = {"matched": m.num_tokens}
    else:
        got = cache.pool.kv[:, :, m.pages].contiguous().numpy().tobytes()
        with open(expected_path, "rb") as f:
            result = {"matched": m.num_tokens, "identical": got == f.read()}
        cache.release(m)
    result["tier_hit_tokens"] = cache.stats()["tier_hit_tokens_by_tier"]
    cache.close()  # finishes the queued writes
    result["s3"] = s3.stats()
    return result


def test_two_processes_share_a_prefix_through_the_bucket(s3_server: MotoServer, prefix: str, tmp_path: Path) -> None:
    out = {}
    for role in ("writer", "reader"):
        proc = subprocess.run([sys.executable, str(_CHILD), role, s3_server.endpoint_url, prefix, str(tmp_path)],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **CREDENTIALS})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[role] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["writer"]["matched"] == 0 and out["writer"]["s3"]["stored"] >= 6
    assert out["reader"]["matched"] == 48 and out["reader"]["identical"]
    assert out["reader"]["tier_hit_tokens"] == [0, 0, 48]  # cpu, lmdb, s3: all from the bucket
    assert out["reader"]["s3"]["hits"] == 6


if __name__ == "__main__":  # the child process of the cross-instance test
    print(json.dumps(_child(*sys.argv[1:5])))
