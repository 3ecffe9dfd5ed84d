"""Index benchmark: the radix tree and page accounting of ``PrefixCache`` under chat traffic.

    python -m radixkv.bench index --out benchmarks/results/index_cpu.txt

Workload (``radixkv.workloads.ChatWorkload`` defaults): 64 system prompts of 2,048 tokens chosen
Zipf-like (s = 1.1), 1–4 earlier turns of 64–512 tokens, a fresh query of 32–256 tokens; 20,000
requests, 8 in flight.  Per request: match (locks), evict if short, alloc the rest, and when it
leaves the flight window 8 requests later: insert, release.  The pool has 4,000,000 token slots of
a tiny KV layout, so this measures the index, not copies.  Requests are generated before timing.

Also: the cost of evicting one node in trees of two sizes 10x apart (it must stay flat).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections import deque

import numpy as np
import torch

from radixkv.bench import Report
from radixkv.cache import PrefixCache
from radixkv.pool import KVLayout
from radixkv.tree import RadixTree
from radixkv.workloads import ChatWorkload

TARGET_RPS = 3000
TARGET_MATCH_INSERT_US = 100


def run_workload(requests: list[np.ndarray], page_size: int, pool_tokens: int, in_flight: int) -> dict:
    """Replay ``requests`` through a fresh cache; return timings and counters."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=page_size)
    cache = PrefixCache(layout, num_pages=pool_tokens // page_size, chunk_size=page_size)
    t_match = t_insert = t_evict = t_alloc = 0.0
    flight: deque = deque()
    clock = time.perf_counter
    start = clock()
    for tokens in requests:
        t0 = clock()
        m = cache.match(tokens)
        t1 = clock()
        need = -(-len(tokens) // page_size) - len(m.pages)
        short = need - cache.pool.num_free
        if short > 0:
            cache.evict(short)
        t2 = clock()
        new = cache.alloc(need)
        t3 = clock()
        t_match += t1 - t0
        t_evict += t2 - t1
        t_alloc += t3 - t2
        flight.append((tokens, m, new))
        if len(flight) > in_flight:
            tokens, m, new = flight.popleft()
            t4 = clock()
            cache.insert(tokens, torch.cat([m.pages, new]))
            cache.release(m)
            t_insert += clock() - t4
    while flight:
        tokens, m, new = flight.popleft()
        t4 = clock()
        cache.insert(tokens, torch.cat([m.pages, new]))
        cache.release(m)
        t_insert += clock() - t4
    total = clock() - start
    cache.check()
    stats = cache.stats()
    n = len(requests)
    return dict(page_size=page_size, requests=n, seconds=total, rps=n / total,
                match_us=t_match / n * 1e6, insert_us=t_insert / n * 1e6, evict_us=t_evict / n * 1e6,
                alloc_us=t_alloc / n * 1e6, hit_rate=stats["hit_rate"], nodes=stats["nodes"],
                evicted_pages=stats["evicted_pages"])


def evict_cost_ns(num_leaves: int, evict_nodes: int = 2000, page_size: int = 16, seed: int = 0) -> float:
    """ns per evicted node in a tree of ``num_leaves`` leaves under 64 shared roots."""
    rng = np.random.default_rng(seed)
    tree = RadixTree(page_size)
    roots = rng.integers(0, 32_000, (64, 4 * page_size), dtype=np.int32)
    body = rng.integers(0, 32_000, (num_leaves, 2 * page_size), dtype=np.int32)
    page = 0
    for i in range(num_leaves):
        tokens = np.concatenate([roots[i % 64], body[i]])
        pages = np.arange(page, page + len(tokens) // page_size)
        page += len(pages)
        tree.insert(tokens, pages)
    for i in rng.permutation(num_leaves)[: num_leaves // 2]:   # scramble the LRU order
        tree.match_prefix(np.concatenate([roots[i % 64], body[i]]))
    t0 = time.perf_counter()
    for _ in range(evict_nodes):
        tree.evict(1)
    return (time.perf_counter() - t0) / evict_nodes * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench index", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--pool-tokens", type=int, default=4_000_000)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--page-sizes", default="16,1")
    ap.add_argument("--evict-sizes", default="10000,100000", help="two tree sizes (leaves) for the evict cost")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)

    say = Report("index", argv)
    t0 = time.perf_counter()
    requests = list(ChatWorkload(num_requests=args.requests))
    tokens = sum(len(r) for r in requests)
    say(f"# workload: {len(requests)} chat requests, {tokens / len(requests):.0f} tokens each on average "
        f"(generated in {time.perf_counter() - t0:.1f} s, not timed); pool of {args.pool_tokens} token slots, "
        f"{args.in_flight} requests in flight")
    say()
    say(f"{'page':>4} {'req/s':>8} {'match us':>9} {'insert us':>10} {'evict us':>9} {'alloc us':>9} "
        f"{'hit rate':>9} {'nodes':>7} {'evicted pages':>14}")
    results = []
    for ps in (int(p) for p in args.page_sizes.split(",")):
        r = run_workload(requests, ps, args.pool_tokens, args.in_flight)
        results.append(r)
        say(f"{ps:>4} {r['rps']:>8.0f} {r['match_us']:>9.1f} {r['insert_us']:>10.1f} {r['evict_us']:>9.1f} "
            f"{r['alloc_us']:>9.1f} {r['hit_rate']:>9.3f} {r['nodes']:>7} {r['evicted_pages']:>14}")
    say(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    say()
    small, large = (int(s) for s in args.evict_sizes.split(","))
    cost_small, cost_large = evict_cost_ns(small), evict_cost_ns(large)
    say(f"evict cost per node: {cost_small:.0f} ns at {small} leaves, {cost_large:.0f} ns at {large} leaves "
        f"(ratio {cost_large / cost_small:.2f}; flat means O(log n) or better)")
    say()
    main_run = results[0]
    ok_rps = main_run["rps"] >= TARGET_RPS
    ok_lat = main_run["match_us"] + main_run["insert_us"] < TARGET_MATCH_INSERT_US
    say(f"target: >= {TARGET_RPS} req/s at page size {main_run['page_size']}: "
        f"{'PASS' if ok_rps else 'FAIL'} ({main_run['rps']:.0f})")
    say(f"target: match + insert < {TARGET_MATCH_INSERT_US} us per request: {'PASS' if ok_lat else 'FAIL'} "
        f"({main_run['match_us'] + main_run['insert_us']:.1f} us)")
    say.save(args.out)
    return 0
