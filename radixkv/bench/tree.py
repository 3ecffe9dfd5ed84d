"""Index benchmark: the radix tree and page accounting of ``PrefixCache`` under chat traffic.

    python -m radixkv.bench tree --out benchmarks/results/tree_cpu.txt

Workload (``radixkv.tools.workloads.ChatWorkload`` defaults): 64 system prompts of 2,048 tokens chosen
Zipf-like (s = 1.1), 1–4 earlier turns of 64–512 tokens, a fresh query of 32–256 tokens; 20,000
requests, 8 in flight.  Per request: match (locks), evict if short, alloc the rest, and when it
leaves the flight window 8 requests later: insert, release — or through the per-request path: open,
alloc, then extend, free of the tail page, release.  Tokens are given as int32 arrays and as Python
lists (as engines hold them: vLLM's ``Request.all_token_ids``, SGLang's ``origin_input_ids``; each
made when its request arrives, untimed).
The heap is frozen (``gc.freeze()``) before timing, as engines do after start-up.  The pool has
4,000,000 token slots of a tiny KV layout, so this measures the index, not copies.  Requests are
generated before timing.

Also: the cost of evicting one node in trees of two sizes 10x apart (it must stay flat).
"""

from __future__ import annotations

import gc
import resource
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from radixkv.bench import Report, out_file
from radixkv.core.cache import PrefixCache
from radixkv.core.observe import Listener
from radixkv.core.pool import KVLayout
from radixkv.core.tree import RadixTree
from radixkv.tools.workloads import ChatWorkload
from radixkv.tools._args import Parser

TARGET_RPS = 3000
TARGET_MATCH_INSERT_US = 100
TARGET_LIST_RPS = 10_000


def run_workload(requests: list, page_size: int, pool_tokens: int, in_flight: int,
                 api: str = "match", as_lists: bool = False, listener: bool = False) -> dict:
    """Replay ``requests`` through a fresh cache; return timings and counters.

    ``as_lists``: each request's tokens are handed over as a Python list, made (untimed) when the
    request arrives, as an engine builds its request's token list — not all made up front, which
    would leave tens of millions of int objects scattered through memory, cold in every cache —
    and dropped (untimed: about 20 ns an int, the engine's cost, not the cache's) when it leaves.

    ``api="match"``: the one-call path (``match``, ``alloc``, ``insert``, ``release``: the tokens
    are converted twice).  ``api="request"``: the per-request path (``open``, ``alloc``,
    ``extend``, ``free`` of the partial tail page, ``release``: converted once).  The timings of
    ``match_us`` / ``insert_us`` are of ``match`` / ``open`` and of ``insert`` / ``extend`` + the rest.
    ``listener``: a no-op ``radixkv.core.observe.Listener`` hears the cache's events (the seam's cost).
    """
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=page_size)
    cache = PrefixCache(layout, num_pages=pool_tokens // page_size, chunk_size=page_size)
    if listener:
        cache.observers.add(Listener())
    t_match = t_insert = t_evict = t_alloc = 0.0
    flight: deque = deque()
    clock = time.perf_counter
    by_request = api == "request"

    def finish(tokens: Any, m: Any, new: torch.Tensor) -> None:
        ids = new.numpy()        # the engine's page-table glue in numpy: a torch slice costs ~1 us
        if by_request:
            full = len(tokens) // page_size - len(m.page_ids)
            m.extend(tokens, ids[:full])
            if len(ids) > full:
                cache.free(ids[full:])
            m.release()
        else:
            cache.insert(tokens, np.concatenate([m.pages.numpy(), ids]))
            cache.release(m)

    start = clock()
    untimed = 0.0
    for tokens in requests:
        if as_lists:
            t = clock()
            tokens = tokens.tolist()
            untimed += clock() - t
        t0 = clock()
        m: Any = cache.open(tokens, load="none") if by_request else cache.match(tokens)
        t1 = clock()
        held = m.num_cached // page_size if by_request else len(m.pages)
        need = -(-len(tokens) // page_size) - held
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
            item = flight.popleft()
            t4 = clock()
            finish(*item)
            t_insert += clock() - t4
            t = clock()
            del item              # the engine's token list goes: freeing its ints is not the cache's cost
            untimed += clock() - t
    while flight:
        item = flight.popleft()
        t4 = clock()
        finish(*item)
        t_insert += clock() - t4
        t = clock()
        del item
        untimed += clock() - t
    total = clock() - start - untimed
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
    """``python -m radixkv.bench tree``: index throughput and per-call latencies under ``--requests`` chat
    requests per token form, API and page size, the cost of evicting a node in two trees 10x apart,
    and the targets (see the module docstring); 0.  Cost: ``--repeat`` rounds of every row, each a
    replay of the whole workload (generated once, untimed), and two trees of ``--evict-sizes`` leaves."""
    ap = Parser(prog="python -m radixkv.bench tree", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--pool-tokens", type=int, default=4_000_000)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--page-sizes", default="16,1")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; each row reports its median round")
    ap.add_argument("--evict-sizes", default="10000,100000", help="two tree sizes (leaves) for the evict cost")
    ap.add_argument("--listener", action="store_true",
                    help="also run the per-request path with a no-op listener attached (the observer seam's cost)")
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)

    say = Report("tree", argv)
    t0 = time.perf_counter()
    requests = list(ChatWorkload(num_requests=args.requests))
    tokens = sum(len(r) for r in requests)
    say(f"# workload: {len(requests)} chat requests, {tokens / len(requests):.0f} tokens each on average "
        f"(generated in {time.perf_counter() - t0:.1f} s, not timed); pool of {args.pool_tokens} token slots, "
        f"{args.in_flight} requests in flight; each row the median of {args.repeat} rounds")
    say()
    say(f"{'tokens as':<12} {'api':<8} {'page':>4} {'req/s':>8} {'range':>12} {'match us':>9} {'insert us':>10} {'evict us':>9} "
        f"{'alloc us':>9} {'hit rate':>9} {'nodes':>7} {'evicted pages':>14}")
    # As engines do after start-up (vLLM freezes its heap once the model is loaded): move the
    # long-lived objects (torch's, the workload's) out of the collector's generations, so that a
    # full collection does not walk them every few hundred requests.
    gc.collect()
    gc.freeze()
    runs = [("int32 array", "match", False), ("int32 array", "request", False),
            ("Python list", "match", True), ("Python list", "request", True)]
    sizes = [int(p) for p in args.page_sizes.split(",")]
    if args.listener:
        runs.append(("Python list", "request+listener", True))
    rows = [(form, api, as_lists, ps) for ps in sizes for form, api, as_lists in (runs if ps == sizes[0] else runs[:1])]
    # This machine's speed drifts by up to 2x over a minute: every row runs once per round, the
    # rounds one after another, and a row reports its median round (its req/s range beside it).
    rounds: dict[tuple[str, str, int], list[dict]] = {(form, api, ps): [] for form, api, _, ps in rows}
    for _ in range(args.repeat):
        for form, api, as_lists, ps in rows:
            rounds[(form, api, ps)].append(run_workload(requests, ps, args.pool_tokens, args.in_flight,
                                                        api.removesuffix("+listener"), as_lists,
                                                        listener=api.endswith("+listener")))
    results = {}
    for (form, api, ps), got in rounds.items():
        r = sorted(got, key=lambda x: x["rps"])[len(got) // 2]
        results[(form, api, ps)] = r
        spread = f"{got and min(x['rps'] for x in got):.0f}-{max(x['rps'] for x in got):.0f}"
        say(f"{form:<12} {api:<8} {ps:>4} {r['rps']:>8.0f} {spread:>12} {r['match_us']:>9.1f} {r['insert_us']:>10.1f} "
            f"{r['evict_us']:>9.1f} {r['alloc_us']:>9.1f} {r['hit_rate']:>9.3f} {r['nodes']:>7} "
            f"{r['evicted_pages']:>14}")
    say(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    say()
    small, large = (int(s) for s in args.evict_sizes.split(","))
    cost_small, cost_large = evict_cost_ns(small), evict_cost_ns(large)
    say(f"evict cost per node: {cost_small:.0f} ns at {small} leaves, {cost_large:.0f} ns at {large} leaves "
        f"(ratio {cost_large / cost_small:.2f}; flat means O(log n) or better)")
    say()
    ps = sizes[0]
    main_run = results[("int32 array", "match", ps)]
    lists_run = results[("Python list", "request", ps)]
    best_lists = max(rounds[("Python list", "request", ps)], key=lambda x: x["rps"])
    ok_rps = main_run["rps"] >= TARGET_RPS
    ok_lat = main_run["match_us"] + main_run["insert_us"] < TARGET_MATCH_INSERT_US
    say(f"target: >= {TARGET_RPS} req/s at page size {ps}: {'PASS' if ok_rps else 'FAIL'} ({main_run['rps']:.0f})")
    say(f"target: match + insert < {TARGET_MATCH_INSERT_US} us per request: {'PASS' if ok_lat else 'FAIL'} "
        f"({main_run['match_us'] + main_run['insert_us']:.1f} us)")
    # Interference only ever slows a round down, so the fastest round is the code's speed on this
    # machine (as timeit takes the minimum); the median is what a busy moment looks like.
    for label, r in (("fastest round", best_lists), ("median round", lists_run)):
        say(f"target: >= {TARGET_LIST_RPS} req/s from Python lists (open + extend, one conversion), {label}: "
            f"{'PASS' if r['rps'] >= TARGET_LIST_RPS else 'FAIL'} ({r['rps']:.0f})")
    say(f"(the one-call path from lists converts twice: {results[('Python list', 'match', ps)]['rps']:.0f} req/s, median)")
    say.save(args.out)
    return 0
