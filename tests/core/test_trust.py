"""Shared tiers you can trust: forged chunks are never served, secrets rotate, encrypted chunks
reveal no token, every remote wait ends by its deadline (slow and trickling endpoints, in front of a
real S3 server), a failing endpoint (slow, trickling or paused; S3 and Redis) costs matches nothing
once its breaker opens and is used again soon after the fault ends, a tier built while its endpoint
is down starts as misses and is taken into use when it comes up, oversize objects are never
downloaded (and count as corrupt), credentials never reach a log, and drop_namespace drops exactly
one namespace."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import threading
import time
import uuid
from contextlib import ExitStack
from typing import Any, Iterator

import pytest
import torch

from radixkv.backends import MemoryTier, Tier
from radixkv.core.format import ChunkAuthError, Seal, decode_chunk, encode_chunk, hkdf_sha256
from radixkv.core.hashing import Namespace, as_token_bytes
from radixkv.core.pool import KVLayout
from radixkv.core.stack import TierStack

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=4)
NS = Namespace(model="trust").bind(LAYOUT)
SECRET, OTHER = "the-deployment-secret-1", "the-next-secret-000002"
# Token ids whose int32 bytes are distinctive, so that finding one in stored bytes means a leak.
TOKENS = [0x5A17C0DE + 7919 * i for i in range(16)]


class RemoteMemoryTier(MemoryTier):
    """A MemoryTier that says it leaves the machine (as S3 and Redis do)."""

    name = "remote-memory"
    local = False


def stack_of(*tiers: Tier, **kw: Any) -> TierStack:
    return TierStack(list(tiers), namespace=NS, layout=LAYOUT, chunk_size=4, **kw)


def chunks(n: int = 4) -> list[torch.Tensor]:
    return [torch.full(LAYOUT.chunk_shape(4), float(i + 1), dtype=torch.float16) for i in range(n)]


def stored(stack: TierStack, kvs: list[torch.Tensor]) -> list[Any]:
    refs = stack.refs(TOKENS)
    assert stack.store(zip(refs, kvs)) == len(kvs) and stack.flush(30)
    return refs


# -- keyed MAC ---------------------------------------------------------------------------------

def test_hkdf_is_rfc_5869() -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    for info in (b"mac", b"aead" + NS.id):
        want = HKDF(hashes.SHA256(), 32, b"radixkv chunk v2", info).derive(SECRET.encode())
        assert hkdf_sha256(SECRET.encode(), info) == want


@pytest.mark.parametrize("forgery", ["unkeyed checksum", "another secret", "flipped MAC byte", "altered payload"])
def test_a_forged_blob_is_never_served_and_is_counted(forgery: str) -> None:
    tier = MemoryTier()
    with stack_of(tier, secret=SECRET) as stack:
        refs = stored(stack, chunks(2))
        name = NS.id + refs[1].key
        evil = torch.full(LAYOUT.chunk_shape(4), 666.0, dtype=torch.float16)
        if forgery == "unkeyed checksum":  # what anyone who can write to the store could do
            blob = bytearray(encode_chunk(NS.id, refs[1].key, refs[1].parent, refs[1].tokens, evil))
        elif forgery == "another secret":
            blob = bytearray(encode_chunk(NS.id, refs[1].key, refs[1].parent, refs[1].tokens, evil,
                                          seal=Seal(OTHER, namespace_id=NS.id)))
        else:
            blob = bytearray(tier.get(name))  # type: ignore[arg-type]
            blob[100 if forgery == "flipped MAC byte" else -1] ^= 1
        tier.put(name, blob)
        loaded = stack.load(refs)
        assert len(loaded) == 1 and torch.equal(loaded[0], chunks(2)[0]), "forged KV was served"
        assert stack.stats()["forged"] == [1] and stack.stats()["corrupt"] == [0]
        assert tier.get(name) is None, "the forged blob was not deleted"
        stack.check()


def test_without_a_secret_keyed_blobs_are_misses_and_unkeyed_ones_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXKV_SECRET", raising=False)
    tier = MemoryTier()
    with stack_of(tier, secret=SECRET) as keyed:
        refs = stored(keyed, chunks(1))
    with stack_of(tier) as plain:
        assert plain.load(refs) == [] and plain.stats()["forged"] == [1]
        stored(plain, chunks(1))
        assert len(plain.load(refs)) == 1  # accidents-only protection: today's format, still verified


def test_rotation_accepts_the_previous_secret_on_read_and_writes_with_the_current() -> None:
    tier = MemoryTier()
    with stack_of(tier, secret=SECRET) as old:
        refs = stored(old, chunks(2))
    with stack_of(tier, secret=OTHER, previous_secret=SECRET) as rotated:
        assert len(rotated.load(refs)) == 2 and rotated.stats()["forged"] == [0]
        rotated.drop_namespace()
        stored(rotated, chunks(2))  # written under OTHER now
    with stack_of(tier, secret=SECRET) as stale:  # an instance that never got the new secret
        assert stale.load(refs) == [] and stale.stats()["forged"] == [1]


def test_the_secret_comes_from_the_environment_and_is_never_shown(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RADIXKV_SECRET", SECRET)
    monkeypatch.setenv("RADIXKV_PREVIOUS_SECRET", OTHER)
    tier = MemoryTier()
    caplog.set_level(logging.DEBUG)
    with stack_of(tier) as stack:
        assert all(seal.keyed for seal in stack.seals)
        refs = stored(stack, chunks(1))
        tier.put(NS.id + refs[0].key, b"garbage")
        assert stack.load(refs) == []
        shown = " ".join([repr(stack), repr(stack.seals), repr(stack.stats()), caplog.text])
        assert SECRET not in shown and OTHER not in shown
    monkeypatch.setenv("RADIXKV_SECRET", "short")
    with pytest.raises(ValueError, match="secret must be at least 16 bytes") as info:
        stack_of(MemoryTier())
    assert "short" not in str(info.value)


def test_seal_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="encrypt: needs a secret"):
        Seal(encrypt=True)
    with pytest.raises(ValueError, match="previous_secret"):
        Seal(previous=SECRET)
    with pytest.raises(TypeError, match="secret must be bytes or str"):
        Seal(12345)  # type: ignore[arg-type]
    blob = encode_chunk(NS.id, b"k" * 16, b"p" * 16, as_token_bytes(TOKENS[:4]), chunks(1)[0],
                        seal=Seal(SECRET, namespace_id=NS.id))
    with pytest.raises(ChunkAuthError, match="has none"):
        decode_chunk(blob, namespace_id=NS.id, key=b"k" * 16, parent_key=b"p" * 16,
                     tokens=as_token_bytes(TOKENS[:4]), dtype=LAYOUT.dtype, shape=LAYOUT.chunk_shape(4))


# -- encryption at rest ------------------------------------------------------------------------

def _leaks(blobs: list[bytes]) -> list[str]:
    found = []
    for t in TOKENS:
        needle = as_token_bytes([t])
        if any(needle in b for b in blobs):
            found.append(hex(t))
    return found


def test_with_encryption_no_token_id_appears_in_any_stored_byte() -> None:
    local, remote = MemoryTier(), RemoteMemoryTier()
    with stack_of(local, remote, secret=SECRET, encrypt=True) as stack:
        refs = stored(stack, chunks(4))
        remote_blobs = [remote.get(k) for k in remote.keys()]
        assert len(remote_blobs) == 4 and not _leaks(remote_blobs)  # type: ignore[arg-type]
        payload = chunks(4)[2].numpy().tobytes()
        assert not any(payload in b for b in remote_blobs)  # type: ignore[operator]
        assert _leaks([local.get(k) for k in local.keys()])  # type: ignore[misc]  # the MAC'd local copy is plain
        # An encrypted hit below is promoted, re-sealed with the MAC, into the tier above.
        local.drop_namespace(NS.id)
        loaded = stack.load(refs, where=[1] * 4)
        assert [t[0, 0, 0, 0, 0].item() for t in loaded] == [1.0, 2.0, 3.0, 4.0]
        assert stack.flush(10) and len(local.keys()) == 4 and len(stack.load(refs)) == 4
        assert stack.stats()["hits"] == [4, 4]
        stack.check()
    with stack_of(RemoteMemoryTier(), secret=SECRET, encrypt=True) as stack:
        tier = stack.tiers[0]
        refs = stored(stack, chunks(1))
        blob = bytearray(tier.get(NS.id + refs[0].key))  # type: ignore[arg-type]
        blob[200] ^= 1
        tier.put(NS.id + refs[0].key, blob)
        assert stack.load(refs) == [] and stack.stats()["forged"] == [1]


# -- S3: deadlines, sizes, logs, namespaces ----------------------------------------------------

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from radixkv.backends.s3 import S3Tier  # noqa: E402
from radixkv.testing.proxy import FaultyProxy, timed_requests  # noqa: E402
from radixkv.tools.s3server import CREDENTIALS, MotoServer, moto_with_bucket  # noqa: E402

BUCKET = "radixkv-trust"


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_with_bucket(BUCKET) as server:
        yield server


def test_s3_encrypted_objects_reveal_no_token(s3: MotoServer) -> None:
    prefix = f"enc/{uuid.uuid4().hex[:8]}"
    with stack_of(S3Tier(BUCKET, prefix, endpoint_url=s3.endpoint_url), secret=SECRET, encrypt=True) as stack:
        refs = stored(stack, chunks(4))
        assert len(stack.load(refs)) == 4
    raw = s3.client()
    bodies = [raw.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
              for o in raw.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"]]
    assert len(bodies) == 4 and not _leaks(bodies)


def test_drop_namespace_deletes_exactly_one_namespace_whatever_the_prefixes(s3: MotoServer) -> None:
    base = f"kv{uuid.uuid4().hex[:6]}"
    x = bytes([9]) * 8
    outer = S3Tier(BUCKET, base, endpoint_url=s3.endpoint_url)
    inner = S3Tier(BUCKET, f"{base}/{x.hex()}", endpoint_url=s3.endpoint_url)
    try:
        assert outer.put_many([(x + bytes([i]) * 16, b"o") for i in range(3)]) == 3
        assert inner.put_many([(bytes([1]) * 8 + bytes([i]) * 16, b"i") for i in range(3)]) == 3
        assert outer.drop_namespace(x) == 3
        assert inner.contains_prefix([bytes([1]) * 8 + bytes([i]) * 16 for i in range(3)]) == 3
    finally:
        outer.close()
        inner.close()


def test_an_oversize_object_under_a_chunk_key_is_never_downloaded(s3: MotoServer) -> None:
    prefix = f"big/{uuid.uuid4().hex[:8]}"
    tier = S3Tier(BUCKET, prefix, endpoint_url=s3.endpoint_url)
    with stack_of(tier, secret=SECRET) as stack:
        refs = stored(stack, chunks(2))
        s3.client().put_object(Bucket=BUCKET, Key=tier.object_key(NS.id + refs[1].key), Body=bytes(24 << 20))
        before = tier.stats()["bytes_read"]
        loaded = stack.load(refs, where=[0, 0])
        assert len(loaded) == 1
        stats = tier.stats()
        assert stats["oversize"] == 1 and stats["bytes_read"] - before < 1 << 20, "the 24 MiB body was read"
        assert stack.stats()["corrupt"] == [1], "the stack did not count the refused object as corrupt"
        assert tier.contains_prefix([NS.id + refs[1].key]) == 0, "the oversize object was not deleted"
        tier.check()


# the slow endpoint waits out its deadlines (seconds): `make test` runs it; the trickling one stays in the loop
@pytest.mark.parametrize("mode", [pytest.param("slow", marks=pytest.mark.slow), "trickle"])
def test_a_slow_or_trickling_s3_endpoint_costs_at_most_the_deadline_and_opens_the_breaker(
        s3: MotoServer, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    deadline_s = 1.0
    key_id, secret_key = CREDENTIALS["AWS_ACCESS_KEY_ID"], "url-held-secret-key-123"
    caplog.set_level(logging.DEBUG)
    with FaultyProxy(("127.0.0.1", s3.port), delay_s=0.4, trickle_bytes=16, trickle_interval_s=0.7) as proxy:
        # Credentials in the endpoint URL, as the report wrote them: used, never logged.
        endpoint = f"http://{key_id}:{secret_key}@127.0.0.1:{proxy.port}"
        tier = S3Tier(BUCKET, f"slow/{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, read_timeout_s=5.0,
                      failure_threshold=2, backoff_s=30)
        stack = stack_of(tier, secret=SECRET, timeout_s=deadline_s)
        refs = stack.refs(list(range(4 * 8)))
        assert stack.store([(r, chunks(1)[0]) for r in refs]) == 8 and stack.flush(60)
        if mode == "slow":  # concurrent fetches: eight chunks cost about one round trip, not eight
            proxy.mode = "slow"
            stack.timeout_s = 3.0     # the stack clamps every deadline to its own bound: 3 s here
            t0 = time.monotonic()
            got = stack.load(refs, where=[0] * 8, deadline=t0 + 3.0)
            assert len(got) == 8 and time.monotonic() - t0 < 4 * 0.4 * 2, "multi-chunk loads are not concurrent"
            stack.timeout_s = deadline_s
        proxy.mode = mode
        proxy.delay_s = 1.5  # now slower than the deadline
        worst = max(timed_requests(stack, refs, deadline_s, rounds=3))
        assert worst < 2 * deadline_s, f"a lookup+load took {worst:.2f} s with a {deadline_s} s deadline"
        assert tier.breaker.opened >= 1 and tier.stats()["timeouts"] >= 1 and stack.stats()["timeouts"][0] >= 1
        stack.close(timeout=1)
    assert secret_key not in caplog.text and f"{key_id}:" not in caplog.text


def test_credentials_in_the_endpoint_url_never_reach_a_log_when_it_is_dead(caplog: pytest.LogCaptureFixture) -> None:
    from radixkv.tools.s3server import free_port

    caplog.set_level(logging.DEBUG)
    secret_key = "dead-endpoint-secret-456"
    tier = S3Tier(BUCKET, "dead", endpoint_url=f"http://AKDEAD:{secret_key}@127.0.0.1:{free_port()}", lazy=True,
                  connect_timeout_s=0.2, read_timeout_s=0.2, max_attempts=1)
    with stack_of(tier, secret=SECRET, timeout_s=1.0) as stack:
        refs = stack.refs(TOKENS)
        assert stack.lookup([r.key for r in refs]) == []
        assert stack.load(refs, where=[0] * len(refs)) == []
        stack.store([(refs[0], chunks(1)[0])])
        stack.flush(10)
        # Built lazily while dead: one warning, then misses (skipped at once, not errors).
        assert caplog.text.count("starts as misses") == 1
        assert tier.stats()["skipped_puts"] == 1 and tier.stats()["breaker_open"] == 1
        shown = caplog.text + repr(tier) + repr(stack) + str(tier.stats())
    assert secret_key not in shown and "AKDEAD:" not in shown
    with pytest.raises(ValueError, match="credentials in the URL"):
        S3Tier(BUCKET, endpoint_url=f"http://AK:{secret_key}@127.0.0.1:1", client=object(), lazy=True)
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != secret_key


# -- a failing endpoint costs matches nothing once its breaker opens, and is used again after --

FAULT_DEADLINE_S = 1.0  # each match's deadline: lookup and load together


def _redis_available() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    from radixkv.tools.redisserver import redis_server_binary

    return redis_server_binary() is not None


class _Endpoint:
    """A real server (moto's S3 or redis-server) behind a ``FaultyProxy``, and a tier on the proxy:
    ``fault(kind)`` makes it slow, trickling or paused (SIGSTOP of the server), ``heal()`` undoes it."""

    def __init__(self, kind: str, stack: ExitStack, s3: MotoServer | None) -> None:
        self.kind = kind
        if kind == "s3":
            assert s3 is not None
            self.server: Any = stack.enter_context(MotoServer())  # its own: the paused one is SIGSTOPped
            self.server.client().create_bucket(Bucket=BUCKET)
        else:
            if not _redis_available():
                pytest.skip("redis-py or redis-server is not installed")
            from radixkv.tools.redisserver import RedisServer

            self.server = stack.enter_context(RedisServer())
        self.proxy = stack.enter_context(FaultyProxy(("127.0.0.1", self.server.port), delay_s=3.0,
                                                     trickle_bytes=16, trickle_interval_s=0.5))
        self.paused = False
        stack.callback(self.heal)

    def tier(self, **kw: Any) -> Tier:
        if self.kind == "s3":
            return S3Tier(BUCKET, f"fault/{uuid.uuid4().hex[:8]}", endpoint_url=self.proxy.url, read_timeout_s=5.0,
                          **kw)
        from radixkv.backends.redis import RedisTier

        return RedisTier(f"redis://127.0.0.1:{self.proxy.port}/0", prefix=f"f{uuid.uuid4().hex[:8]}",
                         read_timeout_s=5.0, **kw)

    def fault(self, mode: str) -> None:
        if mode == "paused":
            os.kill(self.server.process.pid, signal.SIGSTOP)  # connections hang, as with a dead host
            self.paused = True
        else:
            self.proxy.mode = mode  # slower than any deadline (3 s a piece), or 16 bytes per 0.5 s

    def heal(self) -> None:
        self.proxy.mode = "pass"  # new data passes; what already trickles goes on
        if self.paused:
            os.kill(self.server.process.pid, signal.SIGCONT)
            self.paused = False


def _match(stack: TierStack, refs: list[Any]) -> tuple[float, int]:
    """One request's lookup and load under one deadline, as an engine does: (seconds, chunks loaded)."""
    t0 = time.monotonic()
    deadline = t0 + FAULT_DEADLINE_S
    where = stack.lookup([r.key for r in refs], deadline=deadline)
    loaded = stack.load(refs[:len(where)], where=where, deadline=deadline)
    return time.monotonic() - t0, len(loaded)


def _until(condition: Any, timeout_s: float, what: str, step_s: float = 0.1) -> float:
    """Poll ``condition()`` until it holds (bounded); the seconds it took."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(step_s)
    return time.monotonic() - t0


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
@pytest.mark.parametrize("fault", ["slow", "trickle", "paused"])
@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_once_the_breaker_opens_a_failing_endpoint_costs_matches_nothing_and_is_used_again_after_it(
        s3: MotoServer, kind: str, fault: str) -> None:
    with ExitStack() as resources:
        endpoint = _Endpoint(kind, resources, s3)
        tier = endpoint.tier()
        stack = stack_of(tier, secret=SECRET, timeout_s=FAULT_DEADLINE_S)
        resources.callback(stack.close, 1)
        refs = stack.refs(list(range(4 * 16)))  # 16 chunks: a window of concurrent requests
        kv = chunks(1)[0]
        assert stack.store([(r, kv) for r in refs]) == len(refs) and stack.flush(60)
        # Healthy: every chunk within the deadline (polled: a loaded machine's first reads, with
        # their connections to make, may take longer than one deadline).
        _until(lambda: _match(stack, refs)[1] == len(refs), 30, "every chunk from the healthy endpoint")

        endpoint.fault(fault)
        # The first matches each cost at most their deadline, and open the breaker.
        _until(lambda: _match(stack, refs)[0] >= 0 and tier.breaker.state != "closed", 30, "the breaker opened")
        others = stack.refs(list(range(10_000, 10_000 + 4 * 20)))
        errors = stack.stats()["errors"]
        times = []
        for i in range(20):  # spaced, so that background probes fail while requests go on
            times.append(_match(stack, refs)[0])
            stack.store([(others[i], kv)])  # the writer's puts are skipped too
            time.sleep(0.1)
        median = statistics.median(times)
        assert median < 0.05, f"median match {median * 1e3:.0f} ms during the {fault} fault (max {max(times):.2f} s)"
        assert tier.breaker.probes >= 1, "the breaker never probed during the fault"
        assert stack.stats()["errors"] == errors, "a request waited on the endpoint (it was made a probe)"

        endpoint.heal()
        # Back in use by itself (a background probe closes the breaker): hits again, polled.
        _until(lambda: _match(stack, refs)[1] == len(refs), 30, f"hits after the {fault} fault ended")
        assert tier.breaker.state == "closed"
        stats = tier.stats()
        assert stats["breaker_opened"] >= 1 and stats["skipped_puts"] >= 1
        tier.check()


# S3 is slow here (seconds against a stopped endpoint): `make test` runs it; Redis stays in the loop
@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.slow), "redis"])
def test_a_tier_built_lazily_while_its_endpoint_is_down_starts_as_misses_and_is_used_once_it_answers(
        s3: MotoServer, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    from radixkv.tools.s3server import free_port

    if kind == "redis" and not _redis_available():
        pytest.skip("redis-py or redis-server is not installed")
    caplog.set_level(logging.WARNING)
    port = free_port()  # nothing listens there yet
    with ExitStack() as resources:
        if kind == "s3":
            tier: Tier = S3Tier(BUCKET, "lazy", endpoint_url=f"http://127.0.0.1:{port}", lazy=True)
        else:
            from radixkv.backends.redis import RedisTier

            tier = RedisTier(f"redis://127.0.0.1:{port}/0", prefix="lazy", lazy=True)
        stack = stack_of(tier, secret=SECRET, timeout_s=FAULT_DEADLINE_S)
        resources.callback(stack.close, 1)
        assert caplog.text.count("starts as misses") == 1 and f"127.0.0.1:{port}" in caplog.text
        refs = stack.refs(TOKENS)
        kv = chunks(1)[0]
        times = []
        for _ in range(10):  # misses at once, never an exception
            times.append(_match(stack, refs)[0])
            stack.store([(r, kv) for r in refs])
        assert stack.flush(10) and max(times) < FAULT_DEADLINE_S / 2, f"misses took up to {max(times):.2f} s"
        assert stack.stats()["errors"] == [0] and tier.stats()["hits"] == 0 and tier.stats()["stored"] == 0

        if kind == "s3":
            server: Any = resources.enter_context(MotoServer(port))
            _match(stack, refs)  # up, but the bucket does not exist yet: still misses
            server.client().create_bucket(Bucket=BUCKET)
        else:
            from radixkv.tools.redisserver import RedisServer

            resources.enter_context(RedisServer(port=port))

        def serves() -> bool:
            stack.store([(r, kv) for r in refs])
            stack.flush(10)
            return _match(stack, refs)[1] == len(refs)

        _until(serves, 30, "the lazily built tier stores and serves hits", step_s=0.2)
        assert tier.stats()["stored"] >= len(refs) and tier.breaker.state == "closed"
        tier.check()


def test_a_pool_retires_threads_stuck_on_abandoned_calls_and_bounds_them() -> None:
    from radixkv.backends import BoundedPool, DeadlineExceeded

    pool = BoundedPool(2, "radixkv-test-pool")
    release, started = threading.Event(), threading.Semaphore(0)
    abandoned: list[int] = []

    def hold() -> None:  # a call whose socket trickles: it holds its thread
        started.release()
        release.wait(60)

    def running(futures: list[Any]) -> list[Any]:
        assert all(started.acquire(timeout=30) for _ in futures), "the calls did not start"
        return futures

    try:
        stuck = running([pool.submit(hold) for _ in range(2)])  # every thread held
        with pytest.raises(DeadlineExceeded):
            pool.gather(stuck, time.monotonic() + 0.05, abandoned.append)
        assert abandoned == [2] and pool.retired == 1 and pool.stuck == 2
        # The next call runs on a fresh executor, not behind the stuck ones.
        assert pool.gather([pool.submit(lambda: 7)], time.monotonic() + 30) == [7]
        # Stuck again while the first retired executor still holds its calls: kept (bounded threads).
        more = running([pool.submit(hold) for _ in range(2)])
        with pytest.raises(DeadlineExceeded):
            pool.gather(more, time.monotonic() + 0.05)
        assert pool.retired == 1
        pool.check()
        release.set()
        _until(lambda: pool.stuck == 0, 30, "the retired executor's calls ended")
        pool.check()
    finally:
        release.set()
        pool.close()
