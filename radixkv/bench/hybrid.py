"""Hybrid benchmark: the pages sliding-window layers hold under multi-turn chat, against full attention.

    python -m radixkv.bench hybrid --out benchmarks/results/hybrid_cpu.txt

No model runs: this measures pages, not compute.  Two workloads, both with conversations that grow
to about 8K tokens under 8 system prompts of 1,024 tokens:

* ``chat``: ``radixkv.tools.workloads.ChatWorkload`` as it generates requests: a request is its system
  prompt, the first 1-13 turns (256-768 tokens each) of one of the prompt's 4 conversations (the
  turn pool's starting turn), then a fresh query of 32-256 tokens that no later request repeats.
  Requests of one conversation take a random number of turns, so they diverge at every turn
  boundary: every boundary is a branch point (a reuse point), about 512 tokens apart.
  Per request: ``open``, ``alloc`` of the uncached pages (with the tail), ``extend`` at once
  (prefill done); it stays in flight (its end held) until 8 requests later: ``free`` of the tail
  page, ``release``.
* ``sessions``: the same system prompts and sizes as conversations that really grow: 32
  conversations advanced one turn at a time in a seeded random order, 12 turns each; turn ``t``'s
  prompt is the previous prompt, its answer and a new message of 32-256 tokens; the answer
  (256-640 tokens) is decoded after the prefill and its full pages extended into the cache (as
  ``PrefixCachedLM.generate`` does), so the next turn starts with the whole previous request.

Layouts (tiny: 1 KV head of size 1, fp16, pages of 16 tokens, so pages, not bytes, are counted):

* Gemma-3's 5:1 pattern: 6 layers, windows ``(1024,) * 5 + (0,)``: one full group, one sliding group;
* Mistral-style: 6 layers, all with a window of 1024: one sliding group;
* the full-attention equivalent: the same 6 layers with ``windows=None``, whose pool holds a page of
  every layer for every cached or in-flight page.

Pages held = tree + in flight (engine-held), sampled after every ``alloc`` (before the ``extend``
that drops what falls outside the windows, so the peak includes a request's whole new suffix) and
after every request.  "Sliding pages" of a grouped cache are its sliding pool's handed-out pages;
their full-attention equivalent is the full-attention cache's pages held (a page there covers those
layers too).  "KV" counts layer-pages of the whole model.  Two pools: one that never evicts (what
the windows save on the same tree; the target is judged there) and one of 128K tokens that
evicts (LRU) in every cache alike (it holds the 8 requests in flight at 9K tokens each).

Below the pool, a tier (``MemoryTier``, ``write_through``, chunks of 256 tokens, the evicting
pool): the bytes it stores per cached token for each layout, against full attention.  Sliding
pages leave the pool when they leave every window, but go to the tiers first, so the tier holds
every chunk of every group (a hit at any chunk boundary finds its window there) at the bytes per
token of full attention, while the pool holds a window per reuse point.

The hit rate of a grouped cache can be lower: a match must end where every sliding group still has
the last ``w - 1`` tokens' pages (a leaf, a branch point or a live request's end), so a match that
would end inside a chain (a request that stops short of what is cached, or diverges inside a turn)
falls back to the reuse point before it.  Both hit rates are printed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from radixkv.backends import MemoryTier
from radixkv.bench import Report, out_file
from radixkv.core.cache import PrefixCache
from radixkv.core.pool import KVLayout
from radixkv.tools.workloads import ChatWorkload
from radixkv.tools._args import Parser

PAGE = 16
WINDOW = 1024
LAYERS = 6
TARGET_RATIO = 4.0
#: label -> per-layer windows (``None``: full attention everywhere).
LAYOUTS: dict[str, tuple[int, ...] | None] = {
    "full attention": None,
    "Gemma-3 5:1": (WINDOW,) * 5 + (0,),
    "Mistral (all sliding)": (WINDOW,) * LAYERS,
}


#: A request of a replay: its prompt, and the tokens decoded after it (cached as they fill pages).
Turn = tuple[np.ndarray, np.ndarray]
_NOTHING = np.zeros(0, dtype=np.int32)


def chat(n: int, seed: int = 0) -> list[Turn]:
    """``n`` ``ChatWorkload`` requests whose conversations reach about 8K tokens; nothing decoded."""
    return [(ids, _NOTHING) for ids in ChatWorkload(
        num_requests=n, num_system_prompts=8, system_prompt_tokens=1024, turns_per_prompt=4,
        turn_tokens=(256, 768), turns_per_request=(1, 13), query_tokens=(32, 256), seed=seed)]


def sessions(num_conversations: int = 32, turns: int = 12, seed: int = 0) -> list[Turn]:
    """Growing conversations (see the module docstring), interleaved in a seeded random order."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 32_000, (8, 1024), dtype=np.int32)
    history = [prompts[i % 8] for i in range(num_conversations)]
    order = rng.permutation(np.repeat(np.arange(num_conversations), turns))
    out = []
    for c in order:
        message = rng.integers(0, 32_000, int(rng.integers(32, 257)), dtype=np.int32)
        answer = rng.integers(0, 32_000, int(rng.integers(256, 641)), dtype=np.int32)
        prompt = np.concatenate([history[c], message])
        out.append((prompt, answer))
        history[c] = np.concatenate([prompt, answer])
    return out


def held(cache: PrefixCache) -> tuple[int, int]:
    """(full-attention pages held, sliding pages held) now, tree and in flight; 0 where the cache
    has no such group."""
    groups = cache.groups
    sliding = sum(groups.held_pages()) if groups is not None else 0
    has_full = groups is None or groups.full is not None
    full = cache.pool.num_pages - cache.pool.num_free if has_full else 0
    return full, sliding


def replay(requests: list[Turn], windows: tuple[int, ...] | None, pool_tokens: int,
           in_flight: int, tier: Any = None, chunk_size: int = PAGE) -> dict[str, Any]:
    """Replay ``requests`` through a fresh cache of ``windows`` (over ``tier``, if given, with
    chunks of ``chunk_size`` tokens); return the pages held (end and peak, per kind), the hit rate
    and the counters."""
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=PAGE,
                      windows=windows)
    cache = PrefixCache(layout, num_pages=pool_tokens // PAGE, chunk_size=chunk_size,
                        tiers=[tier] if tier is not None else (), write_queue=1 << 16)
    flight: deque = deque()
    peak_full = peak_sliding = 0
    t0 = time.perf_counter()

    def sample() -> None:
        nonlocal peak_full, peak_sliding
        full, sliding = held(cache)
        peak_full, peak_sliding = max(peak_full, full), max(peak_sliding, sliding)

    def finish(req: Any, tail: torch.Tensor) -> None:
        if len(tail):
            cache.free(tail)
        req.release()

    for ids, answer in requests:
        req = cache.open(ids, load="none")
        need = -(-len(ids) // PAGE) - len(req.page_ids)
        new = cache.alloc(need)
        sample()                                  # the whole new suffix, before extend trims it
        full = len(ids) // PAGE - len(req.page_ids)
        req.extend(ids, new[:full])
        tail = new[full:]
        if len(answer):                           # decoded: the tail page fills, then new pages
            seq = np.concatenate([ids, answer])
            more = len(seq) // PAGE - len(req.page_ids) - len(tail)
            pages = torch.cat([tail, cache.alloc(max(0, more))])
            full = len(seq) // PAGE - len(req.page_ids)
            req.extend(seq, pages[:full])
            tail = pages[full:]
        flight.append((req, tail))
        if len(flight) > in_flight:
            finish(*flight.popleft())
        sample()
    while flight:
        finish(*flight.popleft())
    cache.check()
    end_full, end_sliding = held(cache)
    stats = cache.stats()
    stored = {}
    if tier is not None:
        cache.flush()
        stored = {"chunks_stored": stats["chunks_stored"], "not_queued": stats["chunks_not_queued"],
                  "tier_bytes": tier.used_bytes}
        cache.close()
    return dict(seconds=time.perf_counter() - t0, hit_rate=stats["hit_rate"], end_full=end_full,
                end_sliding=end_sliding, peak_full=peak_full, peak_sliding=peak_sliding,
                evicted=stats["evicted_pages"], nodes=stats["nodes"],
                dropped=stats.get("window_pages_dropped", 0),
                reuse_points=sum(len(node.children) != 1 for node in cache.tree.nodes()), **stored)


def tier_table(say: Report, requests: list[Turn], pool: int, in_flight: int, chunk_size: int = 256) -> dict[str, float]:
    """What a tier below the pool stores per layout (``write_through``, chunks of ``chunk_size``):
    bytes per cached token (distinct tokens whose whole chunks the tier holds), against full
    attention.  A sliding page that leaves every window is stored before the pool drops it, so
    every group's chunks reach the tier: the same bytes per token as full attention, while the pool
    holds O(window).  Returns each layout's ratio to full attention."""
    say()
    say(f"## a tier below a pool of {pool} tokens (write_through, chunks of {chunk_size} tokens): what it stores")
    say(f"{'layout':<29} {'chunks':>8} {'tier bytes':>11} {'cached tokens':>14} {'bytes/token':>12} "
        f"{'vs full attn':>13} {'sliding pages held':>19}")
    base = None
    ratios = {}
    for label, windows in LAYOUTS.items():
        tier = _NamespaceCounts()
        r = replay(requests, windows, pool, in_flight, tier=tier, chunk_size=chunk_size)
        chunks = [len(keys) for keys in tier.keys.values()]        # distinct chunks per group
        tokens = max(chunks, default=0) * chunk_size               # the tree's group stores them all
        per_token = r["tier_bytes"] / max(1, tokens)
        base = base if base is not None else per_token
        ratios[label] = per_token / base
        say(f"{label:<29} {'+'.join(map(str, chunks)):>8} {r['tier_bytes']:>11} {tokens:>14} {per_token:>12.1f} "
            f"{per_token / base:>12.2f}x {r['end_sliding']:>19}")
    return ratios


class _NamespaceCounts(MemoryTier):
    """A ``MemoryTier`` that also keeps the distinct keys it holds per namespace (a KV group's
    chunks have a namespace of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[bytes, set[bytes]] = {}

    def put(self, key: bytes, blob: Any) -> bool:
        self.keys.setdefault(key[:8], set()).add(key)
        return super().put(key, blob)

    def delete(self, key: bytes) -> bool:
        self.keys.get(key[:8], set()).discard(key)
        return super().delete(key)


def kv_pages(windows: tuple[int, ...] | None, full: int, sliding: int) -> int:
    """Layer-pages of KV the whole model holds (pages x layers of each kind)."""
    n_sliding = sum(1 for w in windows or () if w)
    return full * (LAYERS - n_sliding) + sliding * n_sliding


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench hybrid``: the pages each layout holds (Gemma-3's 5:1, all sliding, full
    attention) under the ``chat`` and ``sessions`` workloads for each pool of ``--pools``, a tier's
    bytes per token, and the target (see the module docstring); 0.  Cost: per workload, one replay per
    layout and pool, and one per layout over a tier at the last pool; no model runs."""
    ap = Parser(prog="python -m radixkv.bench hybrid", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="chat requests")
    ap.add_argument("--pools", default="4194304,131072", help="pool sizes in tokens (the first should not evict)")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)

    say = Report("hybrid", argv)
    t0 = time.perf_counter()
    keep = math.ceil((WINDOW - 1) / PAGE)
    say(f"# {args.in_flight} requests in flight; pages of {PAGE} tokens; window {WINDOW} tokens = {keep} pages "
        f"per reuse point; pages held = tree + in flight")
    verdicts = {}
    for name, requests in (("chat", chat(args.requests)), ("sessions", sessions())):
        lengths = np.array([len(ids) + len(answer) for ids, answer in requests])
        say()
        say(f"# {name}: {len(requests)} requests, {lengths.mean():.0f} tokens on average (prompt and decoded), "
            f"median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}")
        verdicts[name] = run_pools(say, requests, [int(p) for p in args.pools.split(",")], args.in_flight)
        tier_table(say, requests, [int(p) for p in args.pools.split(",")][-1], args.in_flight)
    say()
    for name, (pool, ratio) in verdicts.items():
        say(f"target: >= {TARGET_RATIO:.0f}x fewer sliding pages for Gemma-3's 5:1 pattern at 8K context, {name} "
            f"(end and peak, pool of {pool} tokens): {'PASS' if ratio >= TARGET_RATIO else 'FAIL'} ({ratio:.1f}x)")
    say(f"# {time.perf_counter() - t0:.0f} s")
    say.save(args.out)
    return 0


def run_pools(say: Report, requests: list[Turn], pools: list[int], in_flight: int) -> tuple[int, float]:
    """Replay ``requests`` per pool size and layout, print the table; return the first pool and the
    Gemma-3 ratio there (the smaller of end and peak)."""
    verdict = None
    for pool in pools:
        runs = {label: replay(requests, windows, pool, in_flight) for label, windows in LAYOUTS.items()}
        base = runs["full attention"]
        say()
        say(f"## pool of {pool} tokens ({pool // PAGE} pages per group)")
        say(f"{'layout':<29} {'hit rate':>8} {'full pages':>11} {'sliding pages':>14} {'vs full attn':>13} "
            f"{'KV (layer-pages)':>17} {'vs full attn':>13} {'evicted':>8} {'nodes':>6} {'s':>5}")
        for label, r in runs.items():
            for when in ("end", "peak"):
                full, sliding = r[f"{when}_full"], r[f"{when}_sliding"]
                windows = LAYOUTS[label]
                kv = kv_pages(windows, full, sliding)
                base_kv = kv_pages(None, base[f"{when}_full"], 0)
                ratio = f"{base[f'{when}_full'] / sliding:.1f}x fewer" if sliding else "-"
                hit = f"{r['hit_rate']:.4f}" if when == "end" else ""
                say(f"{label + ' (' + when + ')':<29} {hit:>8} {full:>11} "
                    f"{sliding:>14} {ratio:>13} {kv:>17} {base_kv / kv:>12.1f}x {r['evicted']:>8} "
                    f"{r['nodes']:>6} {r['seconds']:>5.1f}")
        gemma = runs["Gemma-3 5:1"]
        if verdict is None:                      # the target is judged on the first pool (no eviction)
            verdict = (pool, min(base["end_full"] / gemma["end_sliding"], base["peak_full"] / gemma["peak_sliding"]))
        mistral = runs["Mistral (all sliding)"]
        per_point = gemma["nodes"] / max(1, gemma["reuse_points"])
        say(f"hit rate: full attention {base['hit_rate']:.4f}, Gemma-3 5:1 {gemma['hit_rate']:.4f} "
            f"({gemma['hit_rate'] - base['hit_rate']:+.4f}), Mistral {mistral['hit_rate']:.4f} "
            f"({mistral['hit_rate'] - base['hit_rate']:+.4f}); sliding pages dropped outside the windows: "
            f"Gemma-3 {gemma['dropped']}, Mistral {mistral['dropped']}; reuse points (leaves and branch points) "
            f"at the end: {gemma['reuse_points']}, {per_point:.1f} nodes each")
    assert verdict is not None
    return verdict


if __name__ == "__main__":
    raise SystemExit(main())
