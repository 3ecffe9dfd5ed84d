"""radixkv.from_config: dicts, YAML and JSON files, RADIXKV_CONFIG, and clear errors."""

import json

import pytest
import torch

import radixkv as rk
from radixkv.backends import CpuTier, LmdbTier

LAYOUT = rk.KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4)


def base(**kw):
    return {"chunk_size": 8, "page_size": 4, "num_pages": 32, "namespace": {"model": "m"}} | kw


def test_dict_with_local_tiers(tmp_path):
    cfg = base(local_cpu=True, max_local_cpu_size=0.001, local_disk=f"file://{tmp_path}/db",
               max_local_disk_size=0.01, local_disk_ttl=3600, write_policy="write_back",
               namespace={"model": "m", "revision": "r2", "salt": "tenant"})
    with rk.from_config(cfg, LAYOUT) as cache:
        assert [type(t) for t in cache.stack.tiers] == [CpuTier, LmdbTier]
        assert cache.chunk_size == 8 and cache.pool.num_pages == 32 and cache.write_policy == "write_back"
        assert cache.namespace.revision == "r2" and cache.namespace.salt == b"tenant"
        assert cache.stack.tiers[0].capacity_bytes == 1_000_000
        cache.check()


def test_yaml_file_via_environment(tmp_path, monkeypatch):
    path = tmp_path / "radixkv.yaml"
    path.write_text("chunk_size: 8\npage_size: 4\npool_tokens: 64\nlocal_cpu: true\nmax_local_cpu_size: 0.001\n"
                    "namespace:\n  model: m\nlayout: {num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype: float32}\n")
    monkeypatch.setenv("RADIXKV_CONFIG", str(path))
    with rk.from_config() as cache:
        assert cache.pool.num_pages == 16 and cache.layout == LAYOUT
        assert len(cache.stack.tiers) == 1


def test_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(base()))
    cache = rk.from_config(path, LAYOUT)
    assert cache.stack is None


@pytest.mark.parametrize("cfg, words", [
    (base(chunk_sise=8), "chunk_sise"),
    (base(chunk_size=6), "chunk_size"),
    (base(num_pages=None), "num_pages"),
    (base(pool_tokens=64), "exactly one"),
    (base(local_cpu=True), "max_local_cpu_size"),
    (base(max_local_cpu_size=1.0), "local_cpu is not true"),
    (base(local_disk="/tmp/x"), "max_local_disk_size"),
    (base(max_local_disk_size=1.0), "local_disk is not"),
    (base(max_local_cpu_size=-1, local_cpu=True), "max_local_cpu_size"),
    (base(remote_url="redis://host:6379/not-a-db"), "remote_url"),
    (base(remote_url="ftp://host/kv"), "remote_url"),
    (base(encrypt=True), "encrypt"),
    (base(secret="short"), "secret"),
    (base(remote_url="s3://"), "remote_url"),
    (base(remote_endpoint="http://127.0.0.1:1"), "remote_endpoint"),
    (base(write_policy="lazy"), "write_policy"),
    (base(namespace={"revision": "r"}), "namespace.model"),
    (base(namespace={"model": "m", "colour": "red"}), "colour"),
    (base(local_cpu="yes"), "local_cpu"),
])
def test_bad_configs_name_the_key(cfg, words):
    with pytest.raises(ValueError, match=words):
        rk.from_config(cfg, LAYOUT)


def test_missing_layout_and_mismatched_page_size(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="layout"):
        rk.from_config(base())
    with pytest.raises(ValueError, match="page_size"):
        rk.from_config(base(page_size=2), LAYOUT)
    monkeypatch.delenv("RADIXKV_CONFIG", raising=False)
    with pytest.raises(ValueError, match="RADIXKV_CONFIG"):
        rk.from_config()
    with pytest.raises(ValueError, match="no such file"):
        rk.from_config(tmp_path / "absent.yaml", LAYOUT)


def test_secrets_reach_the_stack_and_never_the_repr(monkeypatch):
    monkeypatch.delenv("RADIXKV_SECRET", raising=False)
    secret, old = "config-secret-0123456789", "config-previous-0123456789"
    cfg = rk.config.CacheConfig.from_mapping(base(local_cpu=True, max_local_cpu_size=0.001, secret=secret,
                                                  previous_secret=old, remote_timeout=0.5))
    assert secret not in repr(cfg) and old not in repr(cfg)
    with cfg.build(LAYOUT) as cache:
        assert cache.stack.seals[0].keyed and cache.stack.timeout_s == 0.5
        assert secret not in repr(cache.stack) and old not in repr(cache.stack.seals)
        cache.check()


def test_redis_url_builds_a_redis_tier():
    cfg = rk.config.CacheConfig.from_mapping(base(remote_url="redis://127.0.0.1:1/0?prefix=kv"))
    assert cfg.remote_url.startswith("redis://")
    with pytest.raises(ValueError, match="remote_endpoint"):
        rk.config.CacheConfig.from_mapping(base(remote_url="redis://h:1/0", remote_endpoint="http://x"))


def test_cache_policy_and_exclusive_reach_the_cpu_tier_and_the_stack():
    layout = rk.KVLayout(1, 1, 2, torch.float32, page_size=4)
    base = {"num_pages": 8, "chunk_size": 8, "page_size": 4, "local_cpu": True, "max_local_cpu_size": 0.001,
            "namespace": {"model": "m"}}
    with rk.from_config({**base, "cache_policy": "s3fifo"}, layout) as cache:
        assert cache.stack.victims == {0} and cache.stack.tiers[0].stats()["pinned"] == 0
        assert type(cache.stack.tiers[0]._policy).__name__ == "S3FIFO"
    with rk.from_config({**base, "exclusive": False}, layout) as cache:
        assert cache.stack.victims == frozenset()
    with pytest.raises(ValueError, match="cache_policy"):
        rk.from_config({**base, "cache_policy": "lfu"}, layout)
    with pytest.raises(ValueError, match="exclusive"):
        rk.from_config({**base, "exclusive": "yes"}, layout)


def test_local_disk_admission_builds_a_second_hit_lmdb_tier(tmp_path):
    disk = {"local_disk": str(tmp_path / "db"), "max_local_disk_size": 0.01}
    cache = rk.from_config(base(**disk, local_disk_admission="second_hit"), layout=LAYOUT)
    assert cache.stack.tiers[0]._admission is not None      # a new chunk is remembered, not stored
    cache.close()
    with pytest.raises(ValueError, match="local_disk_admission"):
        rk.from_config(base(**disk, local_disk_admission="lfu"), layout=LAYOUT)
    with pytest.raises(ValueError, match="local_disk_admission"):
        rk.from_config(base(local_disk_admission="second_hit"), layout=LAYOUT)


def test_a_layout_with_sliding_windows_from_a_mapping():
    cfg = base(layout={"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "windows": [8, 0]})
    cache = rk.from_config(cfg)
    assert cache.layout.windows == (8, 0) and cache.groups is not None
    cache.check()


# -- the cache never stops an engine from starting ------------------------------------------------

def _serve_until_hit(cache, tokens, timeout_s=30.0):
    """Insert ``tokens`` into a fresh pool page set, evict the pool, and poll until a match of the
    same tokens is loaded from the tiers (write-through stores); the tokens it loaded (0 if none
    by ``timeout_s``)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = cache.match(tokens, leave_last=False)
        got = m.num_tokens
        cache.release(m)
        if got:
            return got
        pages = cache.alloc(len(tokens) // 4)
        cache.insert(tokens, pages)
        cache.stack.flush(5)
        cache.evict(cache.pool.num_pages)
        time.sleep(0.2)
    return 0


def test_a_disk_path_that_cannot_be_opened_starts_without_the_disk_tier(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = base(local_cpu=True, max_local_cpu_size=0.001, local_disk=str(blocker / "db"), max_local_disk_size=0.01)
    with caplog.at_level("WARNING", logger="radixkv.config"):
        with rk.from_config(cfg, LAYOUT) as cache:
            assert [type(t) for t in cache.stack.tiers] == [CpuTier]          # started, disk left out
            cache.check()
    assert sum("cannot be opened" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="local_disk: .* cannot be opened .*NotADirectoryError"):
        rk.from_config(cfg | {"local_disk_required": True}, LAYOUT)
    with pytest.raises(ValueError, match="local_disk: .* is a file"):         # a configuration mistake
        rk.from_config(cfg | {"local_disk": str(blocker)}, LAYOUT)
    with pytest.raises(ValueError, match="local_disk_required"):
        rk.from_config(cfg | {"local_disk_required": "yes"}, LAYOUT)


# S3 is slow here (seconds against a stopped endpoint): `make test` runs it; Redis stays in the loop
@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.slow), "redis"])
def test_a_remote_tier_down_at_start_up_is_misses_then_used_once_it_answers(kind, caplog):
    """A cache built while its S3 or Redis endpoint does not answer starts (one warning), serves
    misses, and loads from the tier once a server answers on that port, without a restart;
    ``remote_required: true`` refuses to start instead."""
    from radixkv.tools.s3server import CREDENTIALS, MotoServer, free_port

    if kind == "redis":
        from radixkv.tools.redisserver import RedisServer, redis_server_binary

        if redis_server_binary() is None and __import__("os").environ.get("CI") != "true":
            pytest.skip("redis-server is not installed")
    port = free_port()
    remote = ({"remote_url": f"redis://127.0.0.1:{port}/0"} if kind == "redis" else
              {"remote_url": "s3://radixkv-late/kv", "remote_endpoint": f"http://127.0.0.1:{port}"})
    cfg = base(**remote)
    with pytest.MonkeyPatch.context() as env:
        for name, value in CREDENTIALS.items():
            env.setenv(name, value)
        with pytest.raises(ConnectionError):
            rk.from_config(cfg | {"remote_required": True}, LAYOUT)
        with caplog.at_level("WARNING"):
            cache = rk.from_config(cfg, LAYOUT)
        try:
            tokens = list(range(1, 33))
            assert _serve_until_hit(cache, tokens, timeout_s=1.0) == 0     # misses, never an error
            cache.check()
            server = RedisServer(port=port) if kind == "redis" else MotoServer(port=port)
            server.start()
            try:
                if kind == "s3":
                    server.client().create_bucket(Bucket="radixkv-late")
                assert _serve_until_hit(cache, tokens) == 32               # the tier in use, no restart
                cache.check()
            finally:
                server.stop()
        finally:
            cache.close()
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "127.0.0.1" in r.getMessage()]
    assert len(warnings) >= 1


def test_codecs_reach_the_disk_and_remote_tiers_and_never_the_cpu_tier(tmp_path):
    pytest.importorskip("zstandard")
    cfg = base(local_cpu=True, max_local_cpu_size=0.001, local_disk=str(tmp_path / "db"), max_local_disk_size=0.01,
               codec="cachegen:4")
    with rk.from_config(cfg, LAYOUT) as cache:
        assert [c.name for c in cache.stack.codecs] == ["none", "cachegen"]
        assert cache.stack.codecs[1].bits == 4
    with rk.from_config(base(local_disk=str(tmp_path / "db2"), max_local_disk_size=0.01, codec="int8",
                             local_disk_codec="zstd"), LAYOUT) as cache:
        assert [c.name for c in cache.stack.codecs] == ["zstd"]            # the tier's own key wins
    remote = rk.config.CacheConfig.from_mapping(base(remote_url="redis://127.0.0.1:1/0", remote_codec="int8"))
    assert remote.remote_codec == "int8"
    for bad, words in (({"codec": "lz4"}, "codec"), ({"codec": 3}, "codec"),
                       ({"local_disk_codec": "int8"}, "local_disk_codec: set, but local_disk"),
                       ({"remote_codec": "zstd"}, "remote_codec: set, but remote_url"),
                       ({"codec": "cachegen:9"}, "codec")):
        with pytest.raises(ValueError, match=words):
            rk.config.CacheConfig.from_mapping(base(**bad))
