"""Capacity benchmark: "more capacity never fewer hits", searched over drawn workloads.

    python -m radixkv.bench capacity --cases 60 --out benchmarks/results/capacity_cpu.txt

The policy benchmark measures three workloads; this one draws many (seeded): chat with 1-32
system prompts of 256-4,096 tokens, RAG over 10-500 documents, few-shot with 1-16 tasks, each of
200-600 requests; for each, two neighbouring pool sizes (powers of two from the smallest that
holds the workload's longest request up to 64K tokens) and a mode (write policy, exclusive or
inclusive CPU tier, its policy), over the policy benchmark's 16K-token CPU tier.  A case checks
the two claims of the tiering:

* **not below the pool alone**: the hit rate with the CPU tier is at most one point below the
  pool alone at the same pool size;
* **monotone**: it falls by at most one point when the pool doubles.

The default configuration (exclusive LRU, either write policy) must pass every case; the other
documented modes are reported with their failures and the mechanism behind them:

* an *inclusive* CPU tier holds copies of what the pool holds, so a growing pool takes room the
  tier had for what the pool let go (``radixkv.tools.workloads.pool_copies`` counts the copies);
* an *exclusive S3-FIFO* (or second-hit) CPU tier is scan-resistant while the pool is plain LRU:
  moving capacity from the tier to the pool moves it to the worse policy, and the hit rate can fall.

Pools smaller than the longest request are outside the claims: an engine cannot serve such a
request, and the replay then caches only its leading pages, an admission filter for the most
shared prefix that beats every policy (e.g. chat with 16 prompts of 1,024 tokens: 52% at a 1K
pool over a 16K CPU tier, 38% at 2K, where whole requests first fit).  ``tests/core/test_capacity.py``
checks the same property with hypothesis (a CI-sized budget; ``HYPOTHESIS_PROFILE=thorough`` for
a longer run).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from radixkv.bench import Report, out_file
from radixkv.bench.policy import hit_rate
from radixkv.tools.workloads import ChatWorkload, few_shot_workload, rag_workload
from radixkv.tools._args import Parser

POOLS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
TOLERANCE = 0.01            # one point of hit rate
#: label -> (write policy, exclusive, CPU-tier policy); the first two are the default configuration.
MODES: dict[str, tuple[str, bool, str | None]] = {
    "exclusive lru, write_through (default)": ("write_through", True, None),
    "exclusive lru, write_back": ("write_back", True, None),
    "inclusive lru, write_through": ("write_through", False, None),
    "exclusive s3fifo, write_through": ("write_through", True, "s3fifo"),
    "exclusive 2nd-hit, write_through": ("write_through", True, "second_hit"),
}
DEFAULT_MODES = tuple(MODES)[:2]


@dataclass(frozen=True)
class Workload:
    """A drawn workload: ``kind`` ("chat", "rag" or "few-shot"), its size knobs and seed."""

    kind: str
    requests: int
    seed: int
    prompts: int = 1            # chat: system prompts; rag: documents; few-shot: tasks
    prompt_tokens: int = 1024   # chat: tokens per system prompt
    turns: int = 40             # chat: turns per prompt

    def make(self) -> list[Any]:
        """The request stream (seeded: the same each time).  O(tokens)."""
        if self.kind == "chat":
            return list(ChatWorkload(num_requests=self.requests, num_system_prompts=self.prompts,
                                     system_prompt_tokens=self.prompt_tokens, turns_per_prompt=self.turns,
                                     seed=self.seed))
        if self.kind == "rag":
            return list(rag_workload(self.requests, num_documents=self.prompts, seed=self.seed))
        return list(few_shot_workload(self.requests, num_tasks=self.prompts, seed=self.seed))


def pools_for(requests: list[Any]) -> list[int]:
    """The pool sizes the claims cover: from the smallest power of two holding the longest request."""
    longest = max(len(r) for r in requests)
    return [p for p in POOLS if p >= longest]


@dataclass(frozen=True)
class Case:
    """One checked case: the hit rates of the pool alone at ``small``, and with the CPU tier at
    ``small`` and at ``large`` (the next pool size)."""

    small: int
    large: int
    pool_only: float
    tiered_small: float
    tiered_large: float

    @property
    def below(self) -> float:
        """How far the tiered hit rate is under the pool alone's (negative: above)."""
        return self.pool_only - self.tiered_small

    @property
    def fall(self) -> float:
        """How far it falls when the pool grows (negative: it rises)."""
        return self.tiered_small - self.tiered_large

    @property
    def ok(self) -> bool:
        """Whether the tiers kept their promise: neither under the pool alone nor falling as the pool
        grows by more than ``TOLERANCE``.  O(1)."""
        return self.below <= TOLERANCE and self.fall <= TOLERANCE


def check_case(requests: list[Any], small: int, large: int, mode: str) -> Case:
    """Replay ``requests`` three times (pool alone at ``small``; ``mode``'s tiers at ``small`` and
    ``large``).  Cost: three replays."""
    write_policy, exclusive, policy = MODES[mode]
    return Case(small, large, hit_rate(requests, small),
                hit_rate(requests, small, "cpu", write_policy, exclusive, policy),
                hit_rate(requests, large, "cpu", write_policy, exclusive, policy))


def draw(rng: random.Random) -> Workload:
    """A workload from the benchmark's space (see the module docstring)."""
    kind = rng.choice(["chat", "rag", "few-shot"])
    requests, seed = rng.randint(200, 600), rng.randint(0, 10_000)
    if kind == "chat":
        return Workload(kind, requests, seed, prompts=rng.randint(1, 32),
                        prompt_tokens=rng.choice([256, 512, 1024, 2048, 4096]), turns=rng.randint(2, 60))
    return Workload(kind, requests, seed, prompts=rng.randint(10, 500) if kind == "rag" else rng.randint(1, 16))


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench capacity``: the two claims (not below the pool alone, monotone) checked on
    ``--cases`` drawn workloads in every mode, with the table of failures (see the module docstring);
    0 when the default modes pass every case, else 1.  Cost: three replays per workload and mode
    (``check_case``), fifteen per workload."""
    ap = Parser(prog="python -m radixkv.bench capacity", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=60, help="drawn workloads (each checked in every mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("capacity", argv)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    failures: dict[str, list[str]] = {mode: [] for mode in MODES}
    worst: dict[str, tuple[float, float]] = {mode: (-1.0, -1.0) for mode in MODES}
    checked = 0
    say(f"# {args.cases} drawn workloads x {len(MODES)} modes; CPU tier of 16K tokens; tolerance {TOLERANCE:.2f}")
    say(f"{'workload':<58} {'pools':>13} {'mode':<40} {'alone':>6} {'tiered':>6} {'grown':>6}")
    while checked < args.cases:
        workload = draw(rng)
        requests = workload.make()
        pools = pools_for(requests)
        if len(pools) < 2:
            continue
        checked += 1
        i = rng.randrange(len(pools) - 1)
        for mode in MODES:
            case = check_case(requests, pools[i], pools[i + 1], mode)
            worst[mode] = (max(worst[mode][0], case.below), max(worst[mode][1], case.fall))
            mark = "" if case.ok else "  FAIL"
            desc = f"{workload.kind} n={workload.requests} seed={workload.seed} prompts={workload.prompts}" + (
                f"x{workload.prompt_tokens} turns={workload.turns}" if workload.kind == "chat" else "")
            say(f"{desc:<58} {case.small:>6}>{case.large:<6} {mode:<40} {case.pool_only:>6.3f} "
                f"{case.tiered_small:>6.3f} {case.tiered_large:>6.3f}{mark}")
            if not case.ok:
                failures[mode].append(desc)
    say()
    say("mode                                     failed  worst below pool alone  worst fall as the pool grows")
    for mode in MODES:
        below, fall = worst[mode]
        say(f"{mode:<40} {len(failures[mode]):>3}/{checked:<3} {below:>+22.3f} {fall:>+29.3f}")
    say(f"# {time.perf_counter() - t0:.0f} s")
    say.save(args.out)
    return 0 if not any(failures[m] for m in DEFAULT_MODES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
