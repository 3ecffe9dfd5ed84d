"""Replay benchmark: hit rate against pool size for every tiering mode and CPU-tier policy.

    python -m radixkv.bench policy --out benchmarks/results/policy_cpu.txt

Workloads (``radixkv.tools.workloads``, as in notebook 02): multi-turn chat (16 system prompts of 1,024
tokens, 40 turns each), few-shot (8 tasks) and RAG (200 documents, 4 per request).  Pools of
1K–128K tokens; below them a CPU tier of 16K tokens, alone or above an LMDB tier of 1M tokens
(LRU); ``write_through`` and ``write_back``; the CPU tier inclusive (a copy of what the pool holds,
LRU — what radixkv did before exclusive tiering) or exclusive (it holds only what the pool evicted)
with the LRU, S3-FIFO or second-hit policy.  Beside them: the pool alone, and the bound — one
pool-only LRU cache with the combined capacity (pool + CPU, + LMDB).  No model runs
(``radixkv.tools.workloads.replay``: hit rates do not depend on the KV).

The checks printed at the end are the ones the tiering must meet, per workload and write policy:
with tiers at least the pool-only hit rate at the same pool size; never more than one point lower
as the pool grows; within two points of the combined-capacity bound (or above).  The last two are
checked among the pools that hold the workload's longest request: a smaller pool cannot serve a
request at all, and the replay then caches only its leading pages (which acts as an admission
filter for the most shared prefix, and beats every policy at 1K tokens).  The replays are seeded:
a rerun prints the same numbers.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from radixkv.bench import Report, out_file
from radixkv.core.cache import PrefixCache
from radixkv.core.format import encoded_size
from radixkv.core.pool import KVLayout
from radixkv.tools.workloads import ChatWorkload, few_shot_workload, rag_workload, replay
from radixkv.tools._args import Parser

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, page_size=16)
CHUNK = 64
CPU_TOKENS, LMDB_TOKENS = 16_384, 1 << 20
#: Room for every chunk one request stores (write-through puts a whole prompt's chunks in the queue
#: at once): the writer's speed must not decide what is dropped, or a rerun would differ.
WRITE_QUEUE = 1 << 14
POOLS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: label -> (exclusive, CPU-tier policy)
MODES = {"inclusive lru": (False, None), "exclusive lru": (True, None), "exclusive s3fifo": (True, "s3fifo"),
         "inclusive s3fifo": (False, "s3fifo"), "exclusive 2nd-hit": (True, "second_hit")}


def workloads(n: int) -> dict[str, list[Any]]:
    """The three request streams of ``n`` requests each (seeded)."""
    return {
        "chat": list(ChatWorkload(num_requests=n, num_system_prompts=16, system_prompt_tokens=1024,
                                  turns_per_prompt=40, seed=0)),
        "few-shot": list(few_shot_workload(n, num_tasks=8, seed=0)),
        "RAG": list(rag_workload(n, num_documents=200, seed=0)),
    }


def hit_rate(requests: list[Any], pool_tokens: int, tiers: str = "", write_policy: str = "write_through",
             exclusive: bool = False, policy: str | None = None) -> float:
    """``replay`` through a fresh cache of ``pool_tokens`` over ``tiers`` ("cpu", "cpu+lmdb" or "")."""
    from radixkv.backends import CpuTier, LmdbTier

    chunk_bytes = encoded_size(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype)
    with tempfile.TemporaryDirectory(prefix="radixkv-policy-") as tmp:
        made: list[Any] = []
        if tiers:
            made.append(CpuTier(CPU_TOKENS // CHUNK * chunk_bytes, slot_bytes=chunk_bytes, policy=policy))
        if tiers == "cpu+lmdb":
            made.append(LmdbTier(tmp, LMDB_TOKENS // CHUNK * chunk_bytes, sync=False))
        with PrefixCache(LAYOUT, num_pages=pool_tokens // LAYOUT.page_size, chunk_size=CHUNK, tiers=made,
                         write_policy=write_policy, exclusive=exclusive, write_queue=WRITE_QUEUE) as cache:
            result = replay(cache, requests)
            assert result["dropped_writes"] == 0, "the replay dropped tier writes: its numbers would depend on timing"
            return float(result["hit_rate"])


def sweep(requests: list[Any], pools: tuple[int, ...], tiers: str, write_policy: str) -> dict[str, list[float]]:
    """Hit rate per pool size for the pool alone, every mode, and the combined-capacity bound."""
    extra = CPU_TOKENS + (LMDB_TOKENS if tiers == "cpu+lmdb" else 0)
    rows = {"pool only": [hit_rate(requests, p) for p in pools]}
    for label, (exclusive, policy) in MODES.items():
        rows[label] = [hit_rate(requests, p, tiers, write_policy, exclusive, policy) for p in pools]
    rows["bound: one LRU"] = [hit_rate(requests, p + extra) for p in pools]
    return rows


def checks(rows: dict[str, list[float]], pools: tuple[int, ...], longest: int) -> dict[str, tuple[bool, bool, bool]]:
    """Per mode: (>= pool only everywhere; never more than 1 point lower as the pool grows, and
    within 2 points of the bound, both among the pools of at least ``longest`` tokens)."""
    first = next((i for i, p in enumerate(pools) if p >= longest), len(pools))
    out = {}
    for label in MODES:
        r = rows[label]
        fit = r[first:]
        out[label] = (all(a >= b - 1e-9 for a, b in zip(r, rows["pool only"])),
                      all(b >= a - 0.01 for a, b in zip(fit, fit[1:])),
                      all(a >= b - 0.02 for a, b in zip(fit, rows["bound: one LRU"][first:])))
    return out


def _sweep_job(job: tuple[str, int, tuple[int, ...], str, str]) -> dict[str, list[float]]:
    """One sweep in a worker process (the workloads are rebuilt there: they are seeded)."""
    name, n, pools, tiers, write_policy = job
    return sweep(workloads(n)[name], pools, tiers, write_policy)


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench policy``: hit rate against pool size for every tiering mode and CPU-tier
    policy on three workloads, then the checks (see the module docstring); 0.  Cost: per workload, tier
    set and write policy, one replay of ``--requests`` requests per pool size for the pool alone, each
    mode and the bound, in ``--jobs`` processes side by side; no model runs."""
    ap = Parser(prog="python -m radixkv.bench policy", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per workload")
    ap.add_argument("--pools", default=",".join(map(str, POOLS)), help="pool sizes in tokens")
    ap.add_argument("--tiers", default="cpu,cpu+lmdb")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="sweeps replayed side by side, one process each (hit rates do not depend on timing)")
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    pools = tuple(int(p) for p in args.pools.split(","))
    say = Report("policy", argv)
    say(f"# {args.requests} requests per workload; CPU tier {CPU_TOKENS} tokens, LMDB {LMDB_TOKENS} tokens, "
        f"chunks of {CHUNK} tokens, pages of {LAYOUT.page_size}; hit rate = hit tokens / prompt tokens")
    t0 = time.perf_counter()
    streams = workloads(args.requests)
    jobs = [(name, args.requests, pools, tiers, write_policy) for name in streams
            for tiers in args.tiers.split(",") for write_policy in ("write_through", "write_back")]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as workers:
            swept = list(workers.map(_sweep_job, jobs))
    else:
        swept = [sweep(streams[name], pools, tiers, wp) for name, _, _, tiers, wp in jobs]
    results = iter(swept)
    verdicts = []
    for name, requests in streams.items():
        longest = max(len(r) for r in requests)
        say()
        say(f"# {name}: longest request {longest} tokens")
        for tiers in args.tiers.split(","):
            for write_policy in ("write_through", "write_back"):
                rows = next(results)
                say()
                say(f"## {name}, pool + {tiers}, {write_policy}")
                say(f"{'pool tokens':<20}" + "".join(f"{p:>8}" for p in pools))
                for label, r in rows.items():
                    say(f"{label:<20}" + "".join(f"{x:>8.3f}" for x in r))
                for label, ok in checks(rows, pools, longest).items():
                    verdicts.append((name, tiers, write_policy, label, ok))
    say()
    say("checks: >= pool only | never falls > 1 point as the pool grows | within 2 points of the bound "
        "(the last two where the pool holds the longest request)")
    for label in MODES:
        mine = [v for v in verdicts if v[3] == label]
        passed = [sum(v[4][i] for v in mine) for i in range(3)]
        say(f"{label:<20} " + " | ".join(f"{p}/{len(mine)}" for p in passed))
        for name, tiers, wp, _, ok in mine:
            if not all(ok):
                say(f"    fails in {name}, {tiers}, {wp}: " + ", ".join(
                    what for what, good in zip(("pool only", "monotone", "bound"), ok) if not good))
    say(f"# {time.perf_counter() - t0:.0f} s")
    say.save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
