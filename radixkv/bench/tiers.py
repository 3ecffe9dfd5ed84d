"""Tier benchmark: put/get MB/s per tier for 256-token chunks, beside raw baselines in the same run.

    python -m radixkv.bench tiers --s3 --out benchmarks/results/tiers_cpu.txt

Chunks of a small layout (4 layers, 4 KV heads, head_dim 64, fp16: 1 MiB of KV per 256-token
chunk).  Each tier is measured against the raw operation it is built on: ``CpuTier`` against a
numpy copy into / out of a preallocated arena, ``LmdbTier`` against bare LMDB transactions putting
and getting the same bytes (one transaction per chunk, the same flags), the chunk format against
a plain tensor copy.  ``read`` is the zero-copy path (``consume`` sees the tier's memory); the
``TierStack`` rows load through the format (verify + decode into a preallocated tensor).

Trust: the format sealed with a keyed MAC (HMAC-SHA256) and with AEAD (AES-256-GCM) beside the
plain (checksum) format, and ``TierStack`` loads with a secret beside one without: what a
deployment secret and encryption cost per MB.  With ``--redis``, ``RedisTier`` against raw
redis-py (the same pipelined ``SET``/``GET``) on a ``redis-server`` the benchmark starts; target
>= 0.8 of raw.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Iterable

import numpy as np
import torch

from radixkv.backends import Tier
from radixkv.backends.cpu import CpuTier
from radixkv.bench import Report, median_seconds, out_file
from radixkv.core.format import decode_chunk, encode_chunk, encoded_size
from radixkv.core.hashing import Namespace
from radixkv.core.pool import KVLayout
from radixkv.core.stack import TierStack
from radixkv.tools._args import Parser

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, page_size=16)
CHUNK = 256


def _each(fn: Callable[[Any], object], items: Iterable[Any]) -> None:
    for item in items:
        fn(item)


def _rate(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    return nbytes / median_seconds(fn, repeat) / 1e6


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench tiers``: put/get MB/s of every tier and of the chunk format beside their
    raw baselines in the same run, and the targets (see the module docstring); 0.  Cost: each row moves
    ``--chunks`` chunks of 1 MiB, ``--repeat`` times (medians); the LMDB rows without and with fsync in
    a temporary directory; ``--redis`` starts a ``redis-server``, ``--s3`` moto's server (the rows of
    ``python -m radixkv.bench s3``)."""
    ap = Parser(prog="python -m radixkv.bench tiers", description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32, help="chunks per measurement (1 MiB of KV each)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--s3", action="store_true",
                    help="also S3Tier against raw boto3 on a local S3 server (as python -m radixkv.bench s3)")
    ap.add_argument("--redis", action="store_true",
                    help="also RedisTier against raw redis-py on a local redis-server")
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("tiers", argv)
    say(f"# load average at the start (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    ns = Namespace(model="bench").bind(LAYOUT)
    stack_for_refs = TierStack([], namespace=ns, layout=LAYOUT, chunk_size=CHUNK)
    refs = stack_for_refs.refs(np.arange(args.chunks * CHUNK, dtype=np.int32))
    stack_for_refs.close()
    shape = LAYOUT.chunk_shape(CHUNK)
    kvs = [torch.randn(shape).to(LAYOUT.dtype) for _ in refs]
    blobs = [encode_chunk(ns.id, r.key, r.parent, r.tokens, kv) for r, kv in zip(refs, kvs)]
    keys = [ns.id + r.key for r in refs]
    total = sum(map(len, blobs))
    say(f"{args.chunks} chunks of {CHUNK} tokens, {len(blobs[0]) / 2**20:.2f} MiB each "
        f"({LAYOUT.num_layers} layers, {LAYOUT.num_kv_heads} KV heads, head_dim {LAYOUT.head_dim}, fp16)")
    say(f"{'what':<42} {'MB/s':>8}  {'baseline':<26} {'MB/s':>8} {'ratio':>6}")

    def row(name: str, rate: float, base_name: str, base: float) -> None:
        say(f"{name:<42} {rate:>8,.0f}  {base_name:<26} {base:>8,.0f} {rate / base:>6.2f}")

    # The chunk format against the copies it cannot avoid: a tensor to new bytes (encode), bytes
    # into a preallocated tensor (decode).  Results are dropped at once everywhere, so that every
    # row reuses memory the same way.
    dst = torch.empty(shape, dtype=LAYOUT.dtype)
    to_bytes = _rate(total, lambda: _each(lambda kv: kv.numpy().tobytes(), kvs), args.repeat)
    dst_bytes = dst.view(-1).view(torch.uint8).numpy()
    from_bytes = _rate(total, lambda: _each(lambda b: np.copyto(dst_bytes, np.frombuffer(
        b, dtype=np.uint8, offset=len(b) - dst_bytes.size)), blobs), args.repeat)
    row("format encode", _rate(total, lambda: _each(
        lambda i: encode_chunk(ns.id, refs[i].key, refs[i].parent, refs[i].tokens, kvs[i]), range(len(refs))),
        args.repeat), "tensor to bytes", to_bytes)
    row("format decode (verify) into out", _rate(total, lambda: _each(
        lambda i: decode_chunk(blobs[i], namespace_id=ns.id, key=refs[i].key, parent_key=refs[i].parent,
                               tokens=refs[i].tokens, dtype=LAYOUT.dtype, shape=shape, out=dst),
        range(len(refs))), args.repeat), "bytes to tensor", from_bytes)

    targets: list[tuple[str, float, float]] = []
    _seal_rows(row, ns, refs, kvs, blobs, total, args.repeat, dst)

    # CpuTier against numpy copies into and out of a preallocated arena.
    slot = encoded_size(shape, LAYOUT.dtype)
    arena = np.empty(slot * len(blobs), dtype=np.uint8)

    def raw_put() -> None:
        for i, b in enumerate(blobs):
            arena[i * slot:i * slot + len(b)] = np.frombuffer(b, dtype=np.uint8)

    raw_put_rate = _rate(total, raw_put, args.repeat)
    raw_get_rate = _rate(total, lambda: _each(lambda i: arena[i * slot:i * slot + len(blobs[i])].tobytes(),
                                              range(len(blobs))), args.repeat)
    cpu = CpuTier(max_bytes=slot * len(blobs), slot_bytes=slot)
    cpu_rates = _tier_rows(row, "CpuTier", cpu, keys, blobs, total, args.repeat,
               ("arena copy in", raw_put_rate), ("arena copy out", raw_get_rate))
    _stack_rows(row, cpu, ns, refs, kvs, total, args.repeat, from_bytes)
    _stack_rows(row, CpuTier(max_bytes=slot * len(blobs), slot_bytes=slot), ns, refs, kvs, total, args.repeat,
                from_bytes, secret="bench-deployment-secret")

    file_write, file_read = _file_rates(blobs, total, args.repeat)
    row("plain files (no fsync) write", file_write, "(the issue's baseline)", file_write)
    row("plain files read", file_read, "(the issue's baseline)", file_read)
    targets.append(("CpuTier get >= 70% of a memory copy", cpu_rates["get"] / raw_get_rate, 0.7))

    # LmdbTier against bare LMDB transactions, without and with fsync at every commit.
    try:
        import lmdb
    except ImportError:
        say("LmdbTier: skipped (pip install radixkv[lmdb])")
    else:
        from radixkv.backends.lmdb import LmdbTier

        for sync in (False, True):
            tmp = tempfile.mkdtemp(prefix="radixkv-bench-")
            try:
                env = lmdb.open(f"{tmp}/raw", map_size=4 * total + (64 << 20), sync=sync, metasync=False,
                                readahead=False, meminit=False)

                def lmdb_put() -> None:
                    for k, b in zip(keys, blobs):
                        with env.begin(write=True) as txn:
                            txn.put(k, b)

                def lmdb_get() -> None:
                    for k in keys:
                        with env.begin() as txn:
                            txn.get(k)  # dropped at once, like every get row

                def lmdb_put_batch() -> None:
                    with env.begin(write=True) as txn:
                        for k, b in zip(keys, blobs):
                            txn.put(k, b)

                raw_batch = _rate(total, lmdb_put_batch, args.repeat)
                raw_puts = _rate(total, lmdb_put, args.repeat)
                raw_gets = _rate(total, lmdb_get, args.repeat)
                env.close()
                disk = LmdbTier(f"{tmp}/tier", max_bytes=2 * total, sync=sync)
                rates = _tier_rows(row, f"LmdbTier sync={sync}", disk, keys, blobs, total, args.repeat,
                                   ("lmdb txn put", raw_puts), ("lmdb txn get", raw_gets),
                                   ("lmdb one txn, all puts", raw_batch))
                label = "(the default)" if sync == LmdbTier.__init__.__kwdefaults__["sync"] else ""
                targets += [(f"LmdbTier sync={sync} get >= 70% of plain file reads {label}",
                             rates["get"] / file_read, 0.7),
                            (f"LmdbTier sync={sync} put >= 50% of plain file writes {label}",
                             rates["put"] / file_write, 0.5)]
                if sync:
                    disk.close()
                else:
                    _stack_rows(row, disk, ns, refs, kvs, total, args.repeat, from_bytes)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    if args.redis:
        targets += _redis_rows(row, say, keys, blobs, total, args.repeat)
    _sustained_rows(say, ns, refs, kvs, total, args.repeat, redis=args.redis)
    say()
    for name, ratio, target in targets:
        say(f"target: {name}: {'PASS' if ratio >= target else 'FAIL'} ({ratio:.2f})")
    if args.s3:
        from radixkv.bench import s3

        say()
        s3.run(say, repeat=args.repeat)
    say.save(args.out)
    return 0


def _tier_rows(row: Callable[..., None], name: str, tier: Tier, keys: list[bytes], blobs: list[bytes],
               total: int, repeat: int, put_base: tuple[str, float], get_base: tuple[str, float],
               batch_base: tuple[str, float] | None = None) -> dict[str, float]:
    rates = {
        "put": _rate(total, lambda: _each(lambda i: tier.put(keys[i], blobs[i]), range(len(keys))), repeat),
        "put_many": _rate(total, lambda: tier.put_many(zip(keys, blobs)), repeat),
        "get": _rate(total, lambda: _each(tier.get, keys), repeat),
        "read": _rate(total, lambda: _each(lambda k: tier.read(k, len), keys), repeat)}
    row(f"{name} put", rates["put"], *put_base)
    row(f"{name} put_many", rates["put_many"], *(batch_base or put_base))
    row(f"{name} get (copy)", rates["get"], *get_base)
    row(f"{name} read (zero-copy, len)", rates["read"], *get_base)
    return rates


def _file_rates(blobs: list[bytes], total: int, repeat: int) -> tuple[float, float]:
    """Plain files, one per chunk, not fsynced: (write MB/s, read MB/s)."""
    tmp = tempfile.mkdtemp(prefix="radixkv-bench-files-")
    try:
        paths = [f"{tmp}/{i}" for i in range(len(blobs))]

        def write() -> None:
            for path, blob in zip(paths, blobs):
                with open(path, "wb") as f:
                    f.write(blob)

        def read() -> None:
            for path in paths:
                with open(path, "rb") as f:
                    f.read()

        return _rate(total, write, repeat), _rate(total, read, repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _seal_rows(row: Callable[..., None], ns: Namespace, refs: list[Any], kvs: list[torch.Tensor],
               blobs: list[bytes], total: int, repeat: int, dst: torch.Tensor) -> None:
    """Encode and decode under the MAC and the AEAD seals beside the checksum seal."""
    from radixkv.core.format import Seal

    shape = LAYOUT.chunk_shape(CHUNK)

    def encode(seal: Any) -> Callable[[], None]:
        return lambda: _each(lambda i: encode_chunk(ns.id, refs[i].key, refs[i].parent, refs[i].tokens, kvs[i],
                                                    seal=seal), range(len(refs)))

    def decode(seal: Any, sealed: list[bytes]) -> Callable[[], None]:
        return lambda: _each(lambda i: decode_chunk(sealed[i], namespace_id=ns.id, key=refs[i].key,
                                                    parent_key=refs[i].parent, tokens=refs[i].tokens,
                                                    dtype=LAYOUT.dtype, shape=shape, out=dst, seal=seal),
                             range(len(refs)))

    plain_enc = _rate(total, encode(None), repeat)
    plain_dec = _rate(total, decode(None, blobs), repeat)
    seals = [("MAC", Seal("bench-deployment-secret", namespace_id=ns.id))]
    try:
        seals.append(("AEAD", Seal("bench-deployment-secret", namespace_id=ns.id, encrypt=True)))
    except ImportError:
        pass
    for name, seal in seals:
        sealed = [encode_chunk(ns.id, r.key, r.parent, r.tokens, kv, seal=seal) for r, kv in zip(refs, kvs)]
        row(f"format encode, {name} seal", _rate(total, encode(seal), repeat), "format encode (checksum)", plain_enc)
        row(f"format decode, {name} seal", _rate(total, decode(seal, sealed), repeat),
            "format decode (checksum)", plain_dec)


def _redis_rows(row: Callable[..., None], say: Callable[[str], None], keys: list[bytes], blobs: list[bytes],
                total: int, repeat: int) -> list[tuple[str, float, float]]:
    """RedisTier put_many/get_many/get/contains_prefix beside raw redis-py doing the same."""
    try:
        import redis

        from radixkv.backends.redis import RedisTier
        from radixkv.tools.redisserver import RedisServer
    except ImportError:
        say("RedisTier: skipped (pip install radixkv[redis])")
        return []
    try:
        server = RedisServer().start()
    except FileNotFoundError:
        say("RedisTier: skipped (redis-server is not installed)")
        return []
    try:
        raw = redis.Redis.from_url(server.url)
        tier = RedisTier(server.url, prefix="bench")
        names = [tier.redis_key(k).replace(b"bench:", b"raw:", 1) for k in keys]

        def raw_put_many() -> None:
            pipe = raw.pipeline(transaction=False)
            for n, b in zip(names, blobs):
                pipe.set(n, b)
            pipe.execute()

        def raw_get_many() -> None:
            pipe = raw.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            pipe.execute()

        def raw_exists() -> None:
            pipe = raw.pipeline(transaction=False)
            for n in names:
                pipe.exists(n)
            pipe.execute()

        raw_put_many()
        tier.put_many(zip(keys, blobs))
        rates = {"put_many": (_rate(total, lambda: tier.put_many(zip(keys, blobs)), repeat),
                              _rate(total, raw_put_many, repeat)),
                 "get_many": (_rate(total, lambda: tier.get_many(keys), repeat), _rate(total, raw_get_many, repeat)),
                 "get": (_rate(total, lambda: _each(tier.get, keys), repeat),
                         _rate(total, lambda: _each(raw.get, names), repeat))}
        row("RedisTier put_many (one pipeline)", *rates["put_many"][:1], "redis-py pipeline SET", rates["put_many"][1])
        row("RedisTier get_many (concurrent pipelines)", rates["get_many"][0], "redis-py pipeline GET",
            rates["get_many"][1])
        row("RedisTier get", rates["get"][0], "redis-py GET", rates["get"][1])
        lookup = median_seconds(lambda: tier.contains_prefix(keys), repeat)
        raw_lookup = median_seconds(raw_exists, repeat)
        say(f"{'RedisTier contains_prefix (%d keys)' % len(keys):<42} {lookup * 1e3:>6.2f}ms  "
            f"{'redis-py pipeline EXISTS':<26} {raw_lookup * 1e3:>6.2f}ms {raw_lookup / lookup:>6.2f}")
        tier.close()
        return [(f"RedisTier {op} >= 80% of raw redis-py", tier_rate / raw_rate, 0.8)
                for op, (tier_rate, raw_rate) in rates.items()]
    finally:
        server.stop()


def _sustained_rows(say: Callable[[str], None], ns: Namespace, refs: list[Any], kvs: list[torch.Tensor],
                    total: int, repeat: int, redis: bool) -> None:
    """The sustained store rate of a whole stack (CPU + LMDB, + Redis with ``--redis``): every chunk
    queued at once as an engine's burst of evictions would, then written; MB/s and chunks/s from
    the first store to the last write, with the default queue (bounded in bytes) and batches, beside
    one write per batch, and how many writes the default queue dropped (the goal: none)."""
    from radixkv.backends.lmdb import LmdbTier

    server = None
    if redis:
        try:
            from radixkv.tools.redisserver import RedisServer

            server = RedisServer().start()
        except (ImportError, FileNotFoundError):
            server = None
    say("")
    say("sustained store rate of a stack, a burst of every chunk at once (default queue: bounded in bytes)")
    say(f"{'stack':<28} {'batch':>5} {'MB/s':>8} {'chunks/s':>9} {'dropped':>8}")
    try:
        for batch in (32, 1):
            tmp = tempfile.mkdtemp(prefix="radixkv-bench-")
            tiers: list[Tier] = [CpuTier(max_bytes=4 * total), LmdbTier(f"{tmp}/kv", max_bytes=4 * total, sync=False)]
            if server is not None:
                from radixkv.backends.redis import RedisTier

                tiers.append(RedisTier(server.url, prefix=f"sustained{batch}"))
            stack = TierStack(tiers, namespace=ns, layout=LAYOUT, chunk_size=CHUNK, write_batch=batch)
            name = "+".join(t.name for t in tiers)
            dropped = 0

            def burst() -> None:
                nonlocal dropped
                for t in stack.tiers:
                    t.drop_namespace(ns.id)
                before = stack.stats()["dropped_writes"]
                stack.store(zip(refs, kvs))
                stack.flush()
                dropped += stack.stats()["dropped_writes"] - before

            seconds = median_seconds(burst, repeat)
            say(f"{name:<28} {batch:>5} {total / seconds / 1e6:>8,.0f} {len(refs) / seconds:>9,.0f} {dropped:>8}")
            stack.close()
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()


def _stack_rows(row: Callable[..., None], tier: Tier, ns: Namespace, refs: list[Any], kvs: list[torch.Tensor],
                total: int, repeat: int, copy: float, secret: str | None = None) -> None:
    stack = TierStack([tier], namespace=ns, layout=LAYOUT, chunk_size=CHUNK, queue_size=len(refs) + 1,
                      secret=secret)
    label = f"TierStack({tier.name}{', MAC' if secret else ''})"
    out = [torch.empty(LAYOUT.chunk_shape(CHUNK), dtype=LAYOUT.dtype) for _ in refs]

    def load() -> None:
        where = stack.lookup([r.key for r in refs])
        assert len(stack.load(refs, where=where, out=out)) == len(refs)

    def store() -> None:
        tier.drop_namespace(ns.id)
        stack.store(zip(refs, kvs))
        stack.flush()

    row(f"{label} store+flush", _rate(total, store, repeat), "bytes to tensor", copy)
    row(f"{label} lookup+load", _rate(total, load, repeat), "bytes to tensor", copy)
    stack.close()  # closes the tier too
