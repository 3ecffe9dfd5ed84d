"""S3 benchmark: ``S3Tier`` put/get MB/s beside raw boto3 on the same local server, and what a
lookup costs while the endpoint is down.

    python -m radixkv.bench s3 --out benchmarks/results/s3_cpu.txt

Starts moto's S3 server (``moto[server]``) on 127.0.0.1 in a subprocess.  For each object size,
the same bytes go through ``S3Tier.put``/``get`` and through raw ``put_object``/``get_object`` on a
client with the same settings, interleaved, medians of ``--repeat``; target: the tier keeps at
least 0.8 of raw boto3's MB/s (overhead under 20%).

Then ``contains_prefix`` of a request's keys by concurrent HEADs, beside one ``list_objects_v2``
page, in a namespace of just those keys and in one of ``--namespace-objects`` more.  Keys are
hashes, so a page of 1000 names covers a slice of the key space: in a large namespace it answers
only some of a request's keys, which is why the tier sends HEADs.  Finally the server is paused
(SIGSTOP: connections hang, as with a dead host) and a lookup is timed with the breaker closed
(it waits for the read timeout) and open (it answers "miss" at once).

Last, multi-chunk loads through ``TierStack``: ``--chunks`` chunks of 1 MiB loaded by one
``load`` (the tier fetches them concurrently) beside one ``load`` per chunk (what a sequential
fetch costs), on the server directly and behind ``radixkv.testing.proxy.FaultyProxy`` adding
``--rtt-ms`` to every piece of an answer (64 KiB at most: a slow link); and one lookup+load with a 0.5 s deadline
behind a proxy that trickles 16 bytes every 0.7 s (the deadline holds; the breaker opens).

The server is ``radixkv.tools.s3server.MotoServer``, which the tests use too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from radixkv.bench import Report, median_seconds, out_file
from radixkv.tools.s3server import CREDENTIALS, MotoServer
from radixkv.tools._args import Parser

__all__ = ["main", "run"]

TARGET = 0.8  # tier MB/s / raw boto3 MB/s


def _interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, run in turn (a, b, a, b, ...) so drift hits both alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(say: Callable[[str], None], *, sizes_kib: Sequence[int] = (256, 4096, 32768), repeat: int = 9,
        keys: int = 32, namespace_objects: int = 2000, chunks: int = 8, rtt_ms: float = 20.0) -> bool:
    """Run every measurement against a moto server of its own, reporting through ``say``; whether
    the throughput target held.  The tiers benchmark calls this for its S3 rows."""
    os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
    from radixkv.backends.s3 import CircuitBreaker, S3Tier

    with MotoServer() as server:
        raw = server.client(connect_timeout=1.0, read_timeout=5.0, max_pool_connections=16,
                            retries={"total_max_attempts": 2, "mode": "standard"})
        raw.create_bucket(Bucket="bench")
        tier = S3Tier("bench", "kv", endpoint_url=server.endpoint_url)
        say(f"moto server on {server.endpoint_url}; medians of {repeat}, tier and raw boto3 interleaved")
        worst = _throughput(say, tier, raw, sizes_kib, repeat)
        say(f"target: tier/raw MB/s >= {TARGET} for every size and op: "
            f"{'PASS' if worst >= TARGET else 'FAIL'} (worst {worst:.2f})")
        say("")
        _lookups(say, tier, raw, keys, namespace_objects, repeat)
        say("")
        _while_down(say, server, S3Tier, CircuitBreaker, repeat)
        say("")
        _multi_chunk(say, server, S3Tier, chunks, rtt_ms, repeat)
        tier.close()
    return worst >= TARGET


def _throughput(say: Callable[[str], None], tier: Any, raw: Any, sizes_kib: Sequence[int], repeat: int) -> float:
    say(f"{'size':>9} {'op':>4} {'tier MB/s':>10} {'raw MB/s':>10} {'ratio':>6}")
    worst = float("inf")
    for i, kib in enumerate(sizes_kib):
        blob = os.urandom(kib << 10)
        key = bytes([i]) * 24
        name = tier.object_key(key).replace("kv/", "raw/", 1)
        put = _interleaved({"tier": lambda: tier.put(key, blob),
                            "raw": lambda: raw.put_object(Bucket="bench", Key=name, Body=blob)}, repeat)
        get = _interleaved({"tier": lambda: tier.get(key),
                            "raw": lambda: raw.get_object(Bucket="bench", Key=name)["Body"].read()}, repeat)
        assert tier.get(key) == blob
        for op, t in (("put", put), ("get", get)):
            ratio = t["raw"] / t["tier"]
            worst = min(worst, ratio)
            say(f"{kib:>6}KiB {op:>4} {len(blob) / t['tier'] / 1e6:>10,.1f} "
                f"{len(blob) / t['raw'] / 1e6:>10,.1f} {ratio:>6.2f}")
    return worst


def _lookups(say: Callable[[str], None], tier: Any, raw: Any, keys: int, others: int, repeat: int) -> None:
    """contains_prefix by concurrent HEADs beside one listing page, in a small and a large namespace."""
    ns = bytes([200]) * 8
    request = [ns + os.urandom(16) for _ in range(keys)]
    tier.put_many((k, b"x" * 1024) for k in request)
    assert tier.contains_prefix(request) == keys
    prefix = tier.namespace_prefix(ns)

    def listing() -> int:
        """Request keys one list page (1000 names from the lowest one) answers."""
        first = min(tier.object_key(k) for k in request)
        page = raw.list_objects_v2(Bucket="bench", Prefix=prefix, StartAfter=first[:-1], MaxKeys=1000)
        names = [o["Key"] for o in page.get("Contents", ())]
        last = names[-1] if page.get("IsTruncated") else "~"
        return sum(tier.object_key(k) <= last for k in request)

    say(f"contains_prefix of {keys} held keys (concurrent HEADs) beside one list_objects_v2 page:")
    for label, extra in (("namespace of the request's keys only", 0), (f"namespace of {others} more objects", others)):
        if extra:
            tier.put_many((ns + os.urandom(16), b"x") for _ in range(extra))
        heads = median_seconds(lambda: tier.contains_prefix(request), repeat)
        page = median_seconds(listing, repeat)
        say(f"  {label}: HEADs {heads * 1e3:.1f} ms (all {keys} answered); one page {page * 1e3:.1f} ms "
            f"({listing()} of {keys} answered)")


def _while_down(say: Callable[[str], None], server: MotoServer, tier_cls: Any, breaker_cls: Any, repeat: int) -> None:
    """A one-key lookup with the endpoint up, hung with the breaker closed, and hung with it open."""
    tier = tier_cls("bench", "kv", endpoint_url=server.endpoint_url, connect_timeout_s=0.5, read_timeout_s=0.5,
                    max_attempts=1, breaker=breaker_cls(failure_threshold=1, backoff_s=3600))
    key = [bytes(24)]
    up = median_seconds(lambda: tier.contains_prefix(key), repeat)
    server.pause()
    try:
        t0 = time.perf_counter()
        try:
            tier.contains_prefix(key)
        except Exception:  # noqa: BLE001 - the timeout this measures
            pass
        closed = time.perf_counter() - t0
        opened = median_seconds(lambda: tier.contains_prefix(key), repeat)
    finally:
        server.resume()
    tier.close()
    say("a one-key lookup while the endpoint hangs (SIGSTOP; read timeout 0.5 s, 1 attempt):")
    say(f"  endpoint up: {up * 1e3:.2f} ms; down, breaker closed: {closed * 1e3:.0f} ms (one timeout, then it "
        f"opens); down, breaker open: {opened * 1e6:.1f} us (a miss at once)")


def _multi_chunk(say: Callable[[str], None], server: MotoServer, tier_cls: Any, chunks: int, rtt_ms: float,
                 repeat: int) -> None:
    """One concurrent ``load`` of ``chunks`` chunks beside one ``load`` per chunk, direct and behind
    a proxy adding ``rtt_ms``; then a lookup+load behind a trickling proxy, with a deadline."""
    import torch

    from radixkv.core.hashing import Namespace
    from radixkv.core.pool import KVLayout
    from radixkv.testing.proxy import FaultyProxy, timed_requests
    from radixkv.core.stack import TierStack

    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, page_size=16)
    ns = Namespace(model="bench-s3").bind(layout)
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    say(f"TierStack.load of {chunks} chunks of 1 MiB from S3: one load (concurrent GETs) beside one load per chunk")
    with FaultyProxy(("127.0.0.1", port), delay_s=rtt_ms / 1e3) as proxy:
        for label, endpoint, mode in (("direct", server.endpoint_url, "pass"),
                                      (f"+{rtt_ms:g} ms per 64 KiB answered", proxy.url, "slow")):
            proxy.mode = "pass"
            stack = TierStack([tier_cls("bench", "multi", endpoint_url=endpoint)], namespace=ns, layout=layout,
                              chunk_size=256, queue_size=chunks + 1, timeout_s=60)
            refs = stack.refs(list(range(256 * chunks)))
            stack.store((r, torch.randn(layout.chunk_shape(256)).to(layout.dtype)) for r in refs)
            stack.flush()
            proxy.mode = mode
            t = _interleaved({"one": lambda: stack.load(refs, where=[0] * len(refs)),
                              "each": lambda: [stack.load([r], where=[0]) for r in refs]}, repeat)
            assert len(stack.load(refs)) == len(refs)
            say(f"  {label}: one load {t['one'] * 1e3:.0f} ms, one load per chunk {t['each'] * 1e3:.0f} ms "
                f"({t['each'] / t['one']:.1f}x)")
            stack.close()
        proxy.mode = "pass"
        tier = tier_cls("bench", "multi", endpoint_url=proxy.url, failure_threshold=2, backoff_s=3600)
        stack = TierStack([tier], namespace=ns, layout=layout, chunk_size=256, timeout_s=60)
        refs = stack.refs(list(range(256 * chunks)))
        proxy.mode, proxy.trickle_bytes, proxy.trickle_interval_s = "trickle", 16, 0.7
        times = timed_requests(stack, refs, 0.5, rounds=3)
        say(f"  behind a trickle (16 B every 0.7 s), deadline 0.5 s: lookup+load took "
            f"{', '.join(f'{x * 1e3:.0f}' for x in times)} ms; breaker opened {tier.breaker.opened}x")
        stack.close(timeout=1)


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench s3``: ``S3Tier`` against raw boto3, lookups with the endpoint up and
    paused, and multi-chunk loads behind a slow proxy (see the module docstring); 0.  Cost: moto's S3
    server started in a subprocess; ``--repeat`` puts and gets per object size and path,
    ``--namespace-objects`` puts to fill the large namespace, and one read timeout waited out while
    the server is paused."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = Parser(prog="python -m radixkv.bench s3", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-kib", default="256,4096,32768", help="object sizes, comma-separated KiB")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--keys", type=int, default=32, help="keys per contains_prefix request")
    ap.add_argument("--namespace-objects", type=int, default=2000, help="objects of the large namespace")
    ap.add_argument("--chunks", type=int, default=8, help="chunks per multi-chunk load")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="delay the proxy adds to every answer")
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("s3", argv)
    say(f"# load average at the start (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    run(say, sizes_kib=[int(s) for s in args.sizes_kib.split(",")], repeat=args.repeat, keys=args.keys,
        namespace_objects=args.namespace_objects, chunks=args.chunks, rtt_ms=args.rtt_ms)
    say.save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
