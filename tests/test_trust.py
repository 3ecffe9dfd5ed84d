"""Shared tiers you can trust: forged chunks are never served, secrets rotate, encrypted chunks
reveal no token, every remote wait ends by its deadline (slow and trickling endpoints, in front of a
real S3 server), oversize objects are never downloaded, credentials never reach a log, and
drop_namespace drops exactly one namespace."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Iterator

import pytest
import torch

from radixkv.backends import MemoryTier, Tier
from radixkv.format import ChunkAuthError, Seal, decode_chunk, encode_chunk, hkdf_sha256
from radixkv.hashing import Namespace, as_token_bytes
from radixkv.pool import KVLayout
from radixkv.tiers import TierStack

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
from radixkv.testing.s3server import CREDENTIALS, MotoServer, moto_with_bucket  # noqa: E402

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
        assert tier.contains_prefix([NS.id + refs[1].key]) == 0, "the oversize object was not deleted"
        tier.check()


@pytest.mark.parametrize("mode", ["slow", "trickle"])
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
            t0 = time.monotonic()
            got = stack.load(refs, where=[0] * 8, deadline=t0 + 3.0)
            assert len(got) == 8 and time.monotonic() - t0 < 4 * 0.4 * 2, "multi-chunk loads are not concurrent"
        proxy.mode = mode
        proxy.delay_s = 1.5  # now slower than the deadline
        worst = max(timed_requests(stack, refs, deadline_s, rounds=3))
        assert worst < 2 * deadline_s, f"a lookup+load took {worst:.2f} s with a {deadline_s} s deadline"
        assert tier.breaker.opened >= 1 and tier.stats()["timeouts"] >= 1 and stack.stats()["timeouts"][0] >= 1
        stack.close(timeout=1)
    assert secret_key not in caplog.text and f"{key_id}:" not in caplog.text


def test_credentials_in_the_endpoint_url_never_reach_a_log_when_it_is_dead(caplog: pytest.LogCaptureFixture) -> None:
    from radixkv.testing.s3server import free_port

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
        assert sum(stack.stats()["errors"]) >= 1
        shown = caplog.text + repr(tier) + repr(stack) + str(tier.stats())
    assert secret_key not in shown and "AKDEAD:" not in shown
    with pytest.raises(ValueError, match="credentials in the URL"):
        S3Tier(BUCKET, endpoint_url=f"http://AK:{secret_key}@127.0.0.1:1", client=object(), lazy=True)
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != secret_key
