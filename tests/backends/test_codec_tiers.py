"""Coded chunks through every tier that may hold them: LMDB, S3 (moto's server) and Redis (Debian's
redis-server).  (Peers serve their CPU tiers, which stay raw.)  Each: a chunk written with each codec is read
back by an instance with another setting (exact for ``none``/``zstd``, within the bound and counted
as approximate for ``int8``/``cachegen``), and a coded blob altered in the store is a miss, deleted,
never an exception.  The codecs' own properties are in ``tests/core/test_codec.py``."""

from __future__ import annotations

import uuid
from typing import Any, Callable, Iterator

import pytest
import torch

pytest.importorskip("zstandard")

from radixkv.backends import LmdbTier  # noqa: E402
from radixkv.core.codec import get_codec  # noqa: E402
from radixkv.core.hashing import Namespace  # noqa: E402
from radixkv.core.pool import KVLayout  # noqa: E402
from radixkv.core.stack import TierStack  # noqa: E402
from radixkv.core.tier import Tier  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, page_size=4)
CHUNK = 32
CODECS = ("none", "zstd", "int8", "cachegen")


def roundtrip(make_tier: Callable[[], Tier], name: str) -> None:
    """Write three chunks with codec ``name``, read them back with every other setting, then
    corrupt one in the store: a miss, counted, deleted."""
    ns = Namespace(model=f"codec-{uuid.uuid4().hex[:8]}")
    kv = [torch.randn(LAYOUT.chunk_shape(CHUNK), generator=torch.Generator().manual_seed(i)).to(LAYOUT.dtype)
          for i in range(3)]
    writer = TierStack([make_tier()], namespace=ns, layout=LAYOUT, chunk_size=CHUNK, codecs=[name])
    refs = writer.refs(list(range(3 * CHUNK)))
    assert writer.store(list(zip(refs, kv))) == 3
    assert writer.flush(30)
    raw_bytes = 3 * kv[0].numel() * kv[0].element_size()
    stored = writer.stats()["tier_bytes_stored"][0]
    assert (stored < raw_bytes) == (name != "none"), f"{name}: {stored} bytes stored for {raw_bytes} of KV"
    writer.close()
    lossy = get_codec(name).lossy
    for own in CODECS:
        reader = TierStack([make_tier()], namespace=ns, layout=LAYOUT, chunk_size=CHUNK, codecs=[own])
        got = reader.load(refs, where=[0, 0, 0])
        assert len(got) == 3, f"{name} chunks read by a {own} reader: {len(got)} of 3"
        for g, k in zip(got, kv):
            assert reader.approximate(g) == lossy
            err = (g.float() - k.float()).abs().max().item()
            assert (err == 0) if not lossy else 0 < err < 2.0, f"{name}: error {err}"
        assert reader.stats()["lossy_loaded"] == [3 if lossy else 0]
        reader.check()
        reader.close()
    # A blob altered in the store (its payload's last byte): a miss, counted corrupt, deleted.
    tier = make_tier()
    key = ns.id + refs[2].key
    blob = bytearray(tier.get(key))           # type: ignore[arg-type]
    blob[-1] ^= 0x5A
    tier.put(key, bytes(blob))
    reader = TierStack([tier], namespace=ns, layout=LAYOUT, chunk_size=CHUNK, codecs=[name])
    assert len(reader.load(refs, where=[0, 0, 0])) == 2
    assert reader.flush(30)
    assert reader.stats()["corrupt"] == [1] and tier.contains_prefix([key]) == 0
    reader.close()


@pytest.mark.parametrize("name", CODECS)
def test_lmdb(name: str, tmp_path: Any) -> None:
    roundtrip(lambda: LmdbTier(str(tmp_path), 1 << 26), name)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    pytest.importorskip("redis")
    from radixkv.tools.redisserver import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.mark.parametrize("name", CODECS)
def test_redis(name: str, redis_url: str) -> None:
    from radixkv.backends.redis import RedisTier

    prefix = f"c{uuid.uuid4().hex[:8]}"
    roundtrip(lambda: RedisTier(redis_url, prefix=prefix), name)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from radixkv.tools.s3server import moto_with_bucket

    with moto_with_bucket("radixkv-codec") as server:
        yield server.endpoint_url


@pytest.mark.slow      # moto's S3 server in a subprocess
@pytest.mark.parametrize("name", CODECS)
def test_s3(name: str, s3_endpoint: str) -> None:
    from radixkv.backends.s3 import S3Tier

    prefix = f"c/{uuid.uuid4().hex[:8]}"
    roundtrip(lambda: S3Tier("radixkv-codec", prefix, endpoint_url=s3_endpoint), name)
