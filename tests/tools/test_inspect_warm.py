"""Operations on the tiers: ``python -m radixkv inspect`` lists, verifies (planted corrupt and forged
chunks are found) and drops; ``cache.warm`` brings chunks up so that the first request hits the CPU
tier; ``python -m radixkv warm`` pulls a remote tier onto the local disk; ``precompute`` makes a
system prompt hit before any user asks."""

from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import radixkv as rk
from radixkv.__main__ import main
from radixkv.backends import CpuTier, LmdbTier, MemoryTier
from radixkv.tools.inspection import holdings, verify
from radixkv.tools.redisserver import RedisServer, redis_server_binary
from radixkv.tools.warm import warm
from radixkv.tools.workloads import replay

LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"}
SECRET = "a deployment secret of 32 bytes!"
CHUNK = 8


def config(tmp_path: Any, **extra: Any) -> dict[str, Any]:
    return {"chunk_size": CHUNK, "page_size": 4, "num_pages": 64, "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 0.01, "namespace": {"model": "tiny-model"}, "layout": LAYOUT, **extra}


def write(tmp_path: Any, cfg: dict[str, Any], name: str = "radixkv.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def prompts(n: int, length: int = 41) -> list[list[int]]:
    return [np.random.default_rng(i).integers(0, 1000, length).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server


def test_inspect_lists_verifies_planted_corrupt_and_forged_chunks_and_drops(tmp_path: Any, capsys: Any) -> None:
    cfg = config(tmp_path, secret=SECRET)
    path = write(tmp_path, cfg)
    with rk.from_config(cfg) as cache:
        replay(cache, prompts(3))                          # 3 x 5 chunks, sealed with the secret
        cache.flush()
        ns = cache.namespace.id
        keys = [ns + r.key for r in cache.stack.refs(prompts(3)[0])]
        stranger = rk.Namespace(model="another-model").bind(cache.layout)
    disk = LmdbTier(tmp_path / "disk", 10**7)
    disk.put(keys[1], disk.get(keys[1])[:-16])             # a torn write: corrupt (under a MAC, a flipped bit is
                                                           # indistinguishable from forgery: forged)
    # a chunk written without the secret (by anyone who can write to the store): forged
    with rk.TierStack([MemoryTier()], namespace=cache.namespace, layout=cache.layout, chunk_size=CHUNK) as plain:
        ref = plain.refs(list(range(500, 508)))[0]
        plain.store([(ref, torch.zeros(cache.layout.chunk_shape(CHUNK)))])
        plain.flush()
        disk.put(ns + ref.key, plain.tiers[0].get(ns + ref.key))
    # another namespace's chunk, to be left alone by --drop
    with rk.TierStack([disk], namespace=stranger, layout=cache.layout, chunk_size=CHUNK, secret=SECRET) as other:
        other.store([(r, torch.ones(cache.layout.chunk_shape(CHUNK))) for r in other.refs(list(range(16)))])
        other.flush()
    disk = LmdbTier(tmp_path / "disk", 10**7)
    rows = {r.namespace: r for r in holdings([disk], names={ns: "tiny-model"})}
    assert rows[ns.hex()].chunks == 16 and rows[ns.hex()].label == "tiny-model"
    assert rows[stranger.id.hex()].chunks == 2 and rows[stranger.id.hex()].label == ""
    assert rows[ns.hex()].oldest is not None and rows[ns.hex()].oldest <= rows[ns.hex()].newest
    assert rows[ns.hex()].bytes == sum(e.size for e in disk.entries(ns))
    report = verify(disk, secret=SECRET, concurrency=3)
    assert (report.checked, report.ok, report.corrupt, report.forged, report.missing) == (18, 16, 1, 1, 0)
    assert {kind for _, kind, _ in report.bad} == {"corrupt", "forged"}
    disk.close()

    assert main(["inspect", "--config", path, "--verify", "--json", "--no-progress"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert {r["namespace"]: r["chunks"] for r in out["holdings"]} == {ns.hex(): 16, stranger.id.hex(): 2}
    assert out["verify"][0]["corrupt"] == 1 and out["verify"][0]["forged"] == 1
    assert main(["inspect", "--config", path, "--verify", "--delete-bad", "--yes", "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert "tiny-model" in text and "corrupt" in text and "forged" in text and "deleted" in text
    assert main(["inspect", "--config", path, "--verify", "--no-progress"]) == 0     # the bad ones are gone
    capsys.readouterr()
    assert main(["inspect", "--config", path, "--drop", "tiny-model"]) == 2          # not confirmed: nothing
    assert main(["inspect", "--config", path, "--drop", "tiny-model", "--yes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dropped"] == {"lmdb": 14}
    assert [r["namespace"] for r in out["holdings"]] == [stranger.id.hex()]
    assert main(["inspect", "--config", path, "--drop", "nonsense"]) == 2        # one line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "namespace" in err[0], err


def test_warm_up_then_the_first_request_hits_the_cpu_tier(tmp_path: Any) -> None:
    cfg = config(tmp_path, local_cpu=True, max_local_cpu_size=0.001)
    system, other = prompts(2, length=57)
    with rk.from_config(cfg) as cache:          # an earlier run left chunks on disk
        replay(cache, [system, other])
        cache.flush()
    with rk.from_config(cfg) as cache:
        assert cache.stack.tiers[0].stats()["entries"] == 0
        report, = warm(cache, prompts=[system], show_progress=True)
        assert (report.tier, report.warmed, report.stopped) == ("cpu", 7, "done")
        assert cache.stack.tiers[0].stats()["entries"] == 7
        m = cache.match(system + [1, 2, 3])
        stats = cache.stats()
        assert m.num_tokens == 56 and stats["tier_hit_tokens_by_tier"] == [56, 0]   # from the CPU tier
        cache.release(m)
        report, = warm(cache, max_bytes=cache.layout.token_bytes * CHUNK * 3)   # the rest, within a budget
        assert report.stopped == "budget" and report.warmed == 3 and report.left > 0
        cache.check()
    with rk.from_config(cfg) as cache:
        report, = warm(cache, deadline_s=30.0)             # the whole namespace, newest first
        assert report.warmed == 14 and report.stopped == "done" and report.bad == 0
        with pytest.raises(ValueError, match="into"):
            warm(cache, into="s3")
        with pytest.raises(ValueError, match="deadline_s"):
            warm(cache, deadline_s=0)
        with pytest.raises(TypeError, match="target"):
            warm(object())                                   # type: ignore[arg-type]


def test_the_warm_command_pulls_a_remote_tier_onto_the_local_disk(tmp_path: Any, redis: RedisServer,
                                                                    capsys: Any) -> None:
    remote = f"{redis.url}?prefix=warm{tmp_path.name[-8:]}"
    writer_cfg = config(tmp_path, local_disk=str(tmp_path / "writer"), remote_url=remote)
    with rk.from_config(writer_cfg) as cache:   # another machine filled the shared tier
        replay(cache, prompts(2))
        cache.flush()
        ns = cache.namespace.id
    cfg = config(tmp_path, remote_url=remote)
    path = write(tmp_path, cfg)
    assert main(["inspect", "--config", path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["holdings"]
    assert {(r["tier"], r["chunks"]) for r in rows} == {("redis", 10)}
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"tokens": prompts(1)[0]}) + "\n")
    assert main(["warm", "--config", path, "--prompts", str(prompt_file), "--no-progress"]) == 0
    assert "5 chunks" in capsys.readouterr().out
    assert main(["warm", "--config", path, "--deadline", "30", "--no-progress"]) == 0
    assert "5 chunks" in capsys.readouterr().out            # the other prompt's
    disk = LmdbTier(tmp_path / "disk", 10**7)
    assert sum(1 for _ in disk.entries(ns)) == 10
    disk.close()


def test_entries_of_every_backend_and_bad_arguments(tmp_path: Any, redis: RedisServer) -> None:
    from radixkv.backends import RedisTier

    ns_a, ns_b = b"A" * 8, b"B" * 8
    tiers = [MemoryTier(), CpuTier(4096, slot_bytes=64), LmdbTier(tmp_path / "e", 1 << 20),
             RedisTier(redis.url, prefix=f"e{tmp_path.name[-8:]}")]
    for tier in tiers:
        tier.put_many([(ns_a + bytes(15) + b"\x01", b"x" * 10), (ns_b + bytes(16), b"y" * 20)])
        tier.pin([ns_a + bytes(15) + b"\x01"])
        got = {e.key: e for e in tier.entries()}
        assert {k: e.size for k, e in got.items()} == {ns_a + bytes(15) + b"\x01": 10, ns_b + bytes(16): 20}, tier
        assert [e.key[:8] for e in tier.entries(ns_b)] == [ns_b]
        if tier.name in ("cpu", "lmdb"):
            assert got[ns_a + bytes(15) + b"\x01"].pinned and not got[ns_b + bytes(16)].pinned
        if tier.name in ("lmdb", "redis"):
            assert all(e.stamp is not None and abs(e.stamp - __import__("time").time()) < 60 for e in got.values())
        with pytest.raises(ValueError, match="ns_id"):
            list(tier.entries(b"short"))
        tier.close()
    with pytest.raises(ValueError, match="concurrency"):
        verify(MemoryTier(), concurrency=0)


def test_precompute_makes_a_system_prompt_hit_in_the_paged_engine() -> None:
    pytest.importorskip("transformers")
    from radixkv.integrations.paged import PagedEngine
    from radixkv.integrations.transformers import layout_for, namespace_for, random_model
    from radixkv.tools.warm import precompute

    model = random_model("llama", seed=0, num_kv_heads=2, vocab_size=128)
    cache = rk.PrefixCache(layout_for(model, page_size=4), num_pages=64, chunk_size=CHUNK,
                           namespace=namespace_for(model), tiers=[CpuTier(1 << 20)])
    engine = PagedEngine(model, cache)
    system = np.random.default_rng(0).integers(0, 128, 26).tolist()
    assert precompute(engine, [system], pin=True) == 24
    engine.add(system + [5, 6, 7], max_new_tokens=1)
    engine.run()
    assert cache.stats()["pool_hit_tokens"] >= 24
    with pytest.raises(TypeError, match="engine"):
        precompute(object(), [system])
    engine.close()
    cache.close()


@pytest.mark.parametrize("codec", ["zstd", "int8", "cachegen"])
def test_inspect_verifies_coded_chunks_and_finds_a_corrupt_one(tmp_path: Any, capsys: Any, codec: str) -> None:
    pytest.importorskip("zstandard")
    layout = {**LAYOUT, "head_dim": 32, "dtype": "float16"}
    cfg = config(tmp_path, secret=SECRET, codec=codec, layout=layout, chunk_size=32)
    path = write(tmp_path, cfg)
    with rk.from_config(cfg) as cache:
        replay(cache, prompts(2, length=161))              # 2 x 5 chunks of 32 tokens, coded
        cache.flush()
        keys = [cache.namespace.id + r.key for r in cache.stack.refs(prompts(2, length=161)[0])]
        assert cache.stack.codecs[0].name == codec
    disk = LmdbTier(tmp_path / "disk", 10**7)
    assert all(disk.get(k)[85] == rk.core.codec.get_codec(codec).code for k in keys)  # coded, all of them
    assert main(["inspect", "--config", path, "--verify", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verify"][0]["ok"] == 10 and out["verify"][0]["corrupt"] == 0
    blob = bytearray(disk.get(keys[2]))                    # a flipped bit in a coded payload
    blob[-3] ^= 0x10
    disk.put(keys[2], bytes(blob))
    disk.close()
    assert main(["inspect", "--config", path, "--verify", "--json", "--no-progress"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verify"][0]["ok"] == 9 and out["verify"][0]["forged"] + out["verify"][0]["corrupt"] == 1
