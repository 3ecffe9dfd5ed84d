"""``python -m radixkv.bench fleet_sim``: routing policies on a simulated fleet, in virtual time.

Why a simulator: a 2-core machine runs two ``vllm serve`` of a core each (``bench fleet --pin``), at
one load, and no more: no committed run can show 16 instances at 95% load.
Here each instance is independent, with its own radixkv ``PrefixCache`` as the model of its KV
pool and CPU tier (real matches, real LRU evictions, the CPU tier filled by what the pool lets
go: prompts' blocks only, as a tier below vLLM keeps them, ``_PromptsOnly``), and the router's own
policy code (``radixkv.fleet.routing.Chooser``) chooses, fed by a real fleet ``Index`` that the
instances' KV events (``radixkv.fleet.publish.KVEvents``, through the observer seam) keep up to
date as each engine step ends.

The engine model (per instance, continuous batching as vLLM does it): a step takes the requests
waiting for their prefill in arrival order, up to ``budget`` prompt tokens (chunked prefill: a long
prompt takes several steps), and one decode token of every running request.  A step costs
``fixed_s`` (when it prefills) + ``prefill_s_per_token`` x the tokens it computes + the load of what
a request's match found below the pool (``load_s_per_token`` of the CPU tier, a peer, a shared
tier) + ``decode_step_s + decode_s_per_seq x running`` (when anything decodes).  Between prefills,
decodes advance fluidly at one token a decode step.  A request's prefix is matched when its prefill
starts; its full blocks enter the pool as a step schedules their tokens, as vLLM's V1 scheduler
caches them (``KVCacheManager.allocate_slots``), so a request scheduled after it in the same step
reuses them; their KV events reach the index when that step ends (vLLM publishes a step's events
in ``Scheduler.update_from_output``, after the model ran), and a peer (``--p2p``) can load them
only then, when their KV exists; it holds its pages until its last token.  Its pages are its
prompt's full blocks; with ``--output-pages`` (``output_pages``) also a page for its prompt's
partial last block and for every ``block_tokens`` tokens of its output, as vLLM allocates them,
taken when it is admitted (it waits for pages until they are all free); at its end the full blocks
of its prompt and of what it generated stay cached, unheld (each generated block an id of its own,
which no other request's prompt has), as vLLM keeps a finished request's full blocks cached until
their pages are taken, and the rest of its pages are freed.  With ``--preempt`` (``preempt``) the
pages are taken as vLLM's V1 scheduler takes them instead: at admission those of its prompt (and of the output a resumed request recomputes), then one
page each time a decode reaches a new block; a decode that finds no page free (after evicting what
no request holds) preempts the request admitted last (``Scheduler.schedule``: ``self.running.pop()``,
then ``_preempt_request``), which frees its pages (the full blocks of its prompt and of what it had
generated stay cached, unheld, as vLLM's do; each generated block an id of its own) and goes back to
the head of the queue, to recompute its prompt and the tokens it had generated past the blocks still
cached when it resumes (the token in flight is lost); a step that
preempted admits no new request (vLLM's scheduler admits none after a preemption); the router is
not told (a real one is not).  TTFT is the end of the request's first prefill step less its
arrival; a resumed prefill delays its later tokens, and the first tokens of the requests behind it.  Costs come from a ``CostModel``
profile (``radixkv.fleet.routing.PROFILES``: ``vllm-cpu`` fitted to this project's vLLM-CPU
measurements, ``h100-8b`` from published numbers).

Each block of ``block_tokens`` tokens is one token of the simulated cache (page and chunk of 1):
what is cached is counted in blocks, what costs time in tokens.  Virtual time is ``simpy``'s (the
well-kept discrete-event library).  Existing serving simulators do not fit: NVIDIA's
``aisimulate`` (Dynamo's GPU-free simulator: it predicts a deployment's performance and searches
its configuration, with Dynamo's own router) publishes its stable releases as a source archive of
metadata only (0.12-0.13: nothing to build here) and pins jax, flax and a nightly
tensorflow-probability; neither it nor LLMServingSim (cycle-level, per-hardware profiles, a C++
network backend) runs a router's Python policy unchanged against per-instance caches whose
evictions and KV events are radixkv's own, which is what the policies are judged on here.  Deterministic per seed: no thread runs behind the simulation (the CPU
tier's writer is flushed after each step), and ``--jobs`` (default: the CPUs) runs each policy on
each cell in a process of its own (``in_order``), which changes nothing in the table but its
timing line.

Load: ``--loads`` are fractions of the fleet's capacity for the workload, the work of every request
with the trace's infinite-cache hits (``ideal_hits``: with ``--output-pages`` they count the
answers later turns hold) over ``instances x`` the trace's span: a policy that loses hits is past
100% at a load of 95%.  A turn held back until its answer ends (``chat``) arrives later than the
workload says, so the load it meets is at most the load named.

Workloads: ``mooncake`` (a trace in the Mooncake FAST'25 format, ``--trace``: timestamps in any
unit (the load sets the time scale), ``input_length``, ``output_length``, chained ``hash_ids``, each
id one fixed block of 512 tokens as in that release, or of ``--trace-block`` tokens, or of the size
its rows' lengths say (``trace_block``: the 16-token blocks of other published traces); a seed takes
another window of ``--requests``), and four synthetic ones of 64-token blocks, each with
``TENANTS`` tenants: ``tenants`` (the fleet benchmark's shape: 1,536-token system prompts and a
64-token question, Poisson arrivals), ``hot`` (768-2,048-token prompts, one tenant with half the
requests, arriving in bursts of 6 at once), ``fleetwide`` (every request shares a 2,048-token
fleet-wide system prompt, then one of the tenants' 1,024-token documents, then a question: a
longest-match rule can send all of it to the first instance that holds the shared block), their
prefixes three times a ``SYNTHETIC_POOL`` pool, and ``chat`` (conversations on 512-2,048-token
system prompts: each turn's prompt is the last turn's prompt, its answer and a new question, token
for token, sent once that answer has ended, so that with ``--output-pages`` a turn reuses the
blocks the last one generated, which vLLM cached: ``_chat``, ``SimRequest.answer``,
``SimRequest.after``; a ``CHAT_POOL`` pool); and ``shapeK``, for any number K, a workload of a
shape drawn from K (``SHAPE_CHOICES``: tenants and their popularity, system prompts and their
spread, a fleet-wide prefix or none, question and output lengths, multi-turn sessions (a turn's
answer in the next prompt is a run of blocks of its own, not the blocks it generated), bursts,
arrivals switched on and off, the pool against the distinct prefix tokens), to test the policies on
shapes no one chose.  ``--like-fleet ARGS`` instead runs the requests ``python -m radixkv.bench fleet
ARGS`` sends (``like_fleet``: its arrivals in seconds, its prompts as 128-token blocks, its instances
and pool; every request generating its ``--max-tokens``), to set the simulator beside a real fleet.
Its instances cost the ``vllm-cpu-fleet`` profile by default (the fit of the model ``bench fleet``
serves), while its router estimates with ``vllm-cpu``, as ``bench fleet`` starts its router;
``--slower F`` makes the instances' every prefill and decode step F times the profile's
(``slower``), for a machine slower or faster than the one the profile was fit on.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence

from radixkv.bench import out_file
from radixkv.core.policy import LRU
from radixkv.fleet.routing import BALANCE_ABS, BALANCE_REL
from radixkv.tools._args import Parser, Refused

__all__ = ["Fleet", "SimRequest", "default_pool", "fit_vllm_cpu", "fit_vllm_cpu_decode", "ideal_hits", "ideal_work",
           "scale_to_load", "shape_number", "shape_params", "shape_pool", "simulate", "workload"]

WORKLOADS = ("mooncake", "tenants", "hot", "fleetwide", "chat")
#: Tenants (or documents) of the synthetic workloads: about 48K tokens of prefixes, three times
#: the synthetic workloads' default pool (``SYNTHETIC_POOL``): one instance cannot hold them all,
#: the fleet can.
TENANTS = 32
SYNTHETIC_POOL = 16_384
DEFAULT_POLICIES = ("cost", "prefix", "cache_aware", "dynamo", "least_loaded", "round_robin")
#: Tokens of slack when fluid decoding meets a page boundary (floating point).
_EPS = 1e-6


@dataclass
class SimRequest:
    """One request: arrival (s), its prompt as block ids (``tokens`` tokens, the last block maybe
    partial), ``output`` tokens to generate; ``answer``: the ids of its sequence's full blocks past
    its prompt's full ones, where a later turn's prompt holds what it generated (none: each such
    block an id of its own, ``Fleet.sequence_block``); ``after``: the request whose answer its
    prompt holds (-1: none), which it arrives no sooner than the end of, as a client sends the next
    turn once it has the answer.  Filled by the run: instance, TTFT, tokens reused, its end."""

    rid: int
    arrival: float
    blocks: list[int]
    tokens: int
    output: int
    answer: list[int] = field(default_factory=list)
    after: int = -1
    instance: str = ""
    ttft: float = math.nan
    hit_tokens: int = 0            # reused: the pool's, the CPU tier's, a peer's, a shared tier's
    below_tokens: int = 0          # of hit_tokens, loaded from below the pool
    why: str = ""
    # the run's bookkeeping
    remaining: int = 0
    started: bool = False
    left: float = 0.0
    charge: int = 0
    sent_at: float = 0.0
    names: list[Any] = field(default_factory=list)
    tier_keys: list[bytes] = field(default_factory=list)
    hold: Any = None
    pages: Any = None
    private: Any = None            # with ``output_pages``: its partial last block's and output's pages
    recompute: int = 0             # with ``preempt``: generated tokens its next prefill recomputes
    preempted: int = 0             # with ``preempt``: times it was preempted
    seq_held: int = 0              # with ``preempt``: blocks past its prompt's full ones its match holds (resumed)
    ended: float = math.nan        # when it decoded its last token
    deferred: float = 0.0          # how much later than the workload says it arrived (``after``)


def full_blocks(r: SimRequest, block_tokens: int) -> int:
    """The full blocks of ``r``'s prompt at ``block_tokens`` tokens a block (no more than its block ids).
    O(1)."""
    return min(r.tokens // block_tokens, len(r.blocks))


def check_pool(requests: Sequence[SimRequest], block_tokens: int, pool_blocks: int, output_pages: bool) -> None:
    """``ValueError`` naming ``pool_tokens`` when a request's pages (its prompt's full blocks, and
    with ``output_pages`` its private ones) outnumber a pool of ``pool_blocks``: it could never
    start.  O(requests)."""
    bt = block_tokens
    need = max((full_blocks(r, bt) + (private_blocks(r, bt) if output_pages else 0) for r in requests), default=0)
    if need > pool_blocks:
        what = "a prompt and its output" if output_pages else "a prompt"
        raise ValueError(f"pool_tokens: {what} of {need * bt} tokens does not fit a pool of {pool_blocks * bt} "
                         f"(raise --pool-tokens)")


def _computed(r: SimRequest) -> float:
    """Positions of running ``r`` whose KV exists: its prompt and every token it generated but the
    last (fractional between decode steps).  O(1)."""
    return r.tokens + r.output - r.left - 1


def private_blocks(r: SimRequest, block_tokens: int) -> int:
    """Pages ``r`` holds beyond its prompt's full blocks while it runs (``output_pages``): its
    prompt's partial last block and its output's tokens, as vLLM allocates a page for every
    ``block_tokens`` tokens of a sequence (``radixkv.fleet.routing.pages_alone``, as the router
    counts them).  O(1)."""
    from radixkv.fleet.routing import pages_alone

    return pages_alone(r.tokens, full_blocks(r, block_tokens), r.output, block_tokens)


def ideal_hits(requests: Sequence[SimRequest], block_tokens: int, outputs: bool = False) -> list[int]:
    """Each request's reused tokens with one unbounded cache that holds every full block of every
    earlier request's prompt (arrival order) and, with ``outputs`` (the engine caches what requests
    generate: ``output_pages``), of its ``answer`` whose KV exists (not the last token's): the
    trace's infinite-cache hits.  At least the last block of a prompt is always computed.
    O(blocks)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in sorted(requests, key=lambda r: (r.arrival, r.rid)):
        n = 0
        while n < len(r.blocks) - 1 and tuple(r.blocks[:n + 1]) in seen:
            n += 1
        out.append(n * block_tokens)
        full = full_blocks(r, block_tokens)
        sequence = r.blocks[:full]
        if outputs:
            sequence += r.answer[:max(0, (r.tokens + r.output - 1) // block_tokens - full)]
        for j in range(len(sequence)):
            seen.add(tuple(sequence[:j + 1]))
    order = {r.rid: i for i, r in enumerate(sorted(requests, key=lambda r: (r.arrival, r.rid)))}
    return [out[order[r.rid]] for r in requests]


# -- workloads ---------------------------------------------------------------------------------


#: Block sizes a trace's ``hash_ids`` may be counted in, the Mooncake release's first.
TRACE_BLOCKS = (512, 16, 32, 64, 128, 256, 1024, 2048, 4096)
_TRACE_FIELDS = "a Mooncake-format trace: one JSON object a line with timestamp, input_length, output_length, hash_ids"


def _read_text(flag: str, path: str) -> str:
    """The text of ``path``, or ``ValueError`` naming ``flag`` and why it cannot be read."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


def read_trace(path: str) -> list[dict[str, Any]]:
    """The rows of a Mooncake-format trace, checked: each a JSON object with a numeric
    ``timestamp``, an int ``input_length`` >= 1, an int ``output_length`` >= 0 and a list
    ``hash_ids`` (ids of any JSON scalar type), in the order of their timestamps (the file's order
    among equal ones).  ``ValueError`` naming the line and field otherwise.  O(trace)."""
    text = _read_text("--trace", path)
    rows = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"--trace: line {k} of {path} is not JSON ({_TRACE_FIELDS})") from None
        if not isinstance(row, dict):
            raise ValueError(f"--trace: line {k} of {path} is not a JSON object ({_TRACE_FIELDS})")
        for name, ok in (("timestamp", lambda v: isinstance(v, (int, float)) and math.isfinite(v)),
                         ("input_length", lambda v: isinstance(v, int) and v >= 1),
                         ("output_length", lambda v: isinstance(v, int) and v >= 0),
                         ("hash_ids", lambda v: isinstance(v, list) and all(
                             isinstance(h, (int, str, float)) and not isinstance(h, bool) for h in v))):
            if name not in row:
                raise ValueError(f"--trace: line {k} of {path} has no {name!r} ({_TRACE_FIELDS})")
            if isinstance(row[name], bool) or not ok(row[name]):
                raise ValueError(f"--trace: line {k} of {path}: {name} {row[name]!r} is not valid ({_TRACE_FIELDS})")
        rows.append(row)
    if not rows:
        raise ValueError(f"--trace: {path} holds no requests")
    return sorted(rows, key=lambda r: r["timestamp"])


def trace_block(rows: Sequence[dict[str, Any]]) -> int:
    """The tokens a ``hash_ids`` entry stands for: the size in ``TRACE_BLOCKS`` for which the
    most rows have ``ceil(input_length / size)`` ids (512, the Mooncake release's, on a tie).
    O(rows x sizes)."""
    def fits(size: int) -> int:
        return sum(1 for r in rows if len(r["hash_ids"]) == -(-r["input_length"] // size))

    return max(TRACE_BLOCKS, key=lambda size: (fits(size), size == 512))


def _mooncake(path: str, n: int, seed: int, block: int | None = None) -> tuple[list[SimRequest], int]:
    rows = read_trace(path)
    bt = block or trace_block(rows)
    n = min(n, len(rows))
    start = (seed * n) % max(1, len(rows) - n + 1)
    rows = rows[start:start + n]
    t0 = rows[0]["timestamp"]
    # each id one fixed block: int ids as they are, others (strings, floats) numbered in order seen
    ids: dict[Any, int] = {}
    plain = all(isinstance(h, int) for r in rows for h in r["hash_ids"])

    def block_of(h: Any) -> int:
        return h if plain else ids.setdefault(h, len(ids))

    reqs = [SimRequest(i, float(r["timestamp"] - t0), [block_of(h) for h in r["hash_ids"]],
                       r["input_length"], max(1, r["output_length"])) for i, r in enumerate(rows)]
    return reqs, bt


def _synthetic(kind: str, n: int, seed: int) -> tuple[list[SimRequest], int]:
    rng = random.Random(seed)
    bt = 64
    ids = iter(range(1, 1 << 40))

    def block_run(tokens: int) -> list[int]:
        return [next(ids) for _ in range(-(-tokens // bt))]

    reqs: list[SimRequest] = []
    t = 0.0
    if kind == "tenants":
        systems = [block_run(1536) for _ in range(TENANTS)]
        for i in range(n):
            t += rng.expovariate(1.0)
            reqs.append(SimRequest(i, t, systems[rng.randrange(TENANTS)] + block_run(64), 1536 + 64, 32))
    elif kind == "hot":
        sizes = [rng.choice((768, 1024, 1536, 2048)) for _ in range(TENANTS)]
        systems = [block_run(s) for s in sizes]
        while len(reqs) < n:
            t += rng.expovariate(1.0 / 6)
            tenant = 0 if rng.random() < 0.5 else rng.randrange(1, TENANTS)
            for _ in range(min(6, n - len(reqs))):
                q = rng.choice((64, 128, 256))
                reqs.append(SimRequest(len(reqs), t, systems[tenant] + block_run(q), sizes[tenant] + q, 32))
    elif kind == "fleetwide":
        shared = block_run(2048)
        docs = [block_run(1024) for _ in range(TENANTS)]
        for i in range(n):
            t += rng.expovariate(1.0)
            q = rng.choice((64, 128, 256))
            reqs.append(SimRequest(i, t, shared + docs[rng.randrange(TENANTS)] + block_run(q), 2048 + 1024 + q, 32))
    else:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    return reqs, bt


#: The longest prompt of the ``chat`` workload: a conversation ends before its next turn would pass it.
CHAT_MAX_TOKENS = 8192
#: The ``chat`` workload's default pool per instance: about a third of the 400K distinct tokens of
#: 1,000 of its requests (prompts and answers), as ``SYNTHETIC_POOL`` is of the other synthetic
#: workloads' prefixes; a smaller one (16K) leaves no room for the requests running at once.
CHAT_POOL = 131_072


def _chat(n: int, seed: int) -> tuple[list[SimRequest], int]:
    """The first ``n`` requests (by arrival) of conversations: each starts (Poisson, one a time
    unit) with one of ``TENANTS`` system prompts (512-2,048 tokens) and a question (16-256 tokens),
    and has 1 + a geometric number of turns (4 on average); each later turn's prompt is the last
    one's, its answer (64-512 tokens, drawn per conversation) and a new question, token for token,
    sent a pause (10 time units on average) after the last one was sent and no sooner than its
    answer ended (``after``).  Its blocks past the last prompt's full ones are that request's
    ``answer`` (the full blocks of its sequence), then the sequence's partial tail with the
    question.  64-token blocks.  O(n x prompt blocks)."""
    rng = random.Random(f"radixkv-chat:{seed}")
    bt = 64
    ids = iter(range(1, 1 << 40))

    def block_run(tokens: int) -> list[int]:
        return [next(ids) for _ in range(-(-tokens // bt))]

    sizes = [rng.choice((512, 1024, 1536, 2048)) for _ in range(TENANTS)]
    systems = [block_run(size) for size in sizes]
    reqs: list[SimRequest] = []
    start = 0.0
    earliest: list[float] = []          # the n earliest arrivals so far, negated (a max-heap)

    def enough() -> bool:
        # every conversation that sends one of the first ``n`` requests (by arrival) has started
        return len(earliest) == n and -earliest[0] < start

    while not enough():
        start += rng.expovariate(1.0)
        tenant, output = rng.randrange(TENANTS), rng.choice((64, 128, 256, 512))
        turns = 1 + int(rng.expovariate(1.0 / 3.0))
        q = rng.randint(16, 256)
        blocks, tokens, now, last = systems[tenant] + block_run(q), sizes[tenant] + q, start, -1
        for _ in range(turns):
            r = SimRequest(len(reqs), now, blocks, tokens, output, after=last)
            reqs.append(r)
            (heapq.heappush if len(earliest) < n else heapq.heappushpop)(earliest, -now)
            sequence = tokens + output
            full = tokens // bt
            r.answer = block_run(sequence // bt * bt - full * bt)
            q = rng.randint(16, 256)
            if sequence + q > CHAT_MAX_TOKENS:
                break
            blocks, tokens = blocks[:full] + r.answer + block_run(sequence % bt + q), sequence + q
            now, last = now + rng.expovariate(1.0 / 10.0), r.rid
    reqs.sort(key=lambda r: (r.arrival, r.rid))
    reqs = reqs[:n]
    rid = {r.rid: i for i, r in enumerate(reqs)}
    for r in reqs:
        r.rid, r.after = rid[r.rid], rid.get(r.after, -1)
    return reqs, bt


# -- shapes: workloads drawn from a number ------------------------------------------------------


#: What a shape draws (``shape_params``), each from these choices: tenants; their popularity's Zipf
#: exponent (0: uniform); a tenant's system prompt, median tokens and the spread (log-normal sigma)
#: of its length across tenants; a fleet-wide prefix before them (0: none); the question's tokens;
#: the output's; the mean turns of a session (each turn extends the last by its answer and a new
#: question); sessions that start at once (a burst); arrivals switched on and off (five times the
#: mean rate half the time, a fifth of it the other half); the pool, as a fraction of the distinct
#: prefix tokens (never below two of the longest prompts).
SHAPE_CHOICES: dict[str, tuple[Any, ...]] = {
    "tenants": (1, 2, 4, 8, 16, 32, 64, 128),
    "zipf": (0.0, 0.6, 1.0, 1.4),
    "system": (256, 512, 1024, 2048, 4096, 8192),
    "spread": (0.0, 0.5, 1.0),
    "fleetwide": (0, 0, 0, 512, 2048, 4096),
    "question": (32, 128, 512, 2048),
    "output": (1, 16, 64, 256),
    "turns": (1, 1, 2, 4, 8),
    "burst": (1, 1, 2, 4, 8, 16),
    "onoff": (False, False, True),
    "pool": (0.125, 0.33, 1.0),
}
#: The longest prompt a shape makes: a session ends before its next turn would pass it.
SHAPE_MAX_TOKENS = 32_768


def shape_params(k: int) -> dict[str, Any]:
    """Shape ``k``'s parameters (``SHAPE_CHOICES``), drawn from ``k`` alone.  O(1)."""
    rng = random.Random(f"radixkv-shape:{k}")
    return {name: rng.choice(choices) for name, choices in SHAPE_CHOICES.items()}


def _shape(k: int, n: int, seed: int) -> tuple[list[SimRequest], int]:
    """The first ``n`` requests (by arrival) of shape ``k`` (``shape_params``); the seed draws the
    tenants' prompt lengths, the arrivals, the tenants and the sessions.  64-token blocks; a shape's
    time unit is the mean gap between session starts (bursts) at the base rate.  O(n x prompt blocks)."""
    p = shape_params(k)
    rng = random.Random(f"radixkv-shape:{k}:{seed}")
    bt = 64
    ids = iter(range(1, 1 << 40))

    def run(tokens: int) -> tuple[list[int], int]:
        tokens = max(1, tokens)
        return [next(ids) for _ in range(-(-tokens // bt))], tokens

    def length(median: int, sigma: float, most: int) -> int:
        """A log-normal length about ``median``, in whole blocks, from one block to ``most``."""
        return min(most, max(bt, round(median * math.exp(rng.gauss(0.0, sigma)) / bt) * bt))

    fleetwide = run(p["fleetwide"]) if p["fleetwide"] else ([], 0)
    # a first turn always fits: fleet-wide prefix, system prompt and question at most 4K + 16K + 4K
    systems = [run(length(p["system"], p["spread"], SHAPE_MAX_TOKENS // 2)) for _ in range(p["tenants"])]
    weights = [1.0 / (t + 1) ** p["zipf"] for t in range(p["tenants"])]
    # sessions: (start, head blocks, head tokens, turns), bursts of ``burst`` of one tenant at once
    sessions: list[tuple[float, list[int], int, int]] = []
    t = 0.0
    while len(sessions) < n:
        rate = (5.0 if int(t / 20.0) % 2 == 0 else 0.2) if p["onoff"] else 1.0
        t += rng.expovariate(rate / p["burst"])
        tenant = rng.choices(range(p["tenants"]), weights)[0]
        for _ in range(p["burst"]):
            turns = 1 + (int(rng.expovariate(1.0 / (p["turns"] - 1))) if p["turns"] > 1 else 0)
            sessions.append((t, fleetwide[0] + systems[tenant][0], fleetwide[1] + systems[tenant][1], turns))
    # each session's turns, one after another: a question; after the answer and a pause (10 time
    # units on average) the next turn is the last one, its answer and a new question; every block
    # is whole but a turn's last (its answer's tokens are padded to a block before the next question)
    reqs: list[SimRequest] = []
    for start, head, tokens, turns in sessions:
        blocks, now = list(head), start
        for _ in range(turns):
            q, q_tokens = run(length(p["question"], 0.5, SHAPE_MAX_TOKENS // 8))
            padded = -(-tokens // bt) * bt
            if padded + q_tokens > SHAPE_MAX_TOKENS:
                break
            reqs.append(SimRequest(0, now, blocks + q, padded + q_tokens, p["output"]))
            answer, a_tokens = run(p["output"])
            blocks = blocks + q + answer
            tokens = padded + -(-q_tokens // bt) * bt + a_tokens
            now += rng.expovariate(1.0 / 10.0)
    reqs.sort(key=lambda r: r.arrival)             # stable: a burst's sessions in the order drawn
    reqs = reqs[:n]
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs, bt


def shape_pool(k: int, requests: Sequence[SimRequest], block_tokens: int) -> int:
    """Shape ``k``'s pool per instance, in tokens: its ``pool`` fraction of the distinct tokens of
    the requests' full blocks, and at least two of the longest prompt.  O(blocks)."""
    # a shape's block ids each follow one prefix (a run is only ever reused whole), so distinct
    # ids are distinct blocks
    distinct = {b for r in requests for b in r.blocks[:full_blocks(r, block_tokens)]}
    longest = max((r.tokens for r in requests), default=block_tokens)
    return max(2 * longest, round(shape_params(k)["pool"] * len(distinct)) * block_tokens)


def workload(kind: str, n: int, seed: int, trace: str | None = None,
             trace_block_tokens: int | None = None) -> tuple[list[SimRequest], int]:
    """``(requests, block_tokens)`` of workload ``kind`` (see the module docstring); arrival times
    are in the workload's own unit until ``scale_to_load`` sets them.  A trace's block size is
    ``trace_block_tokens``, or what its rows say (``trace_block``)."""
    if kind == "mooncake":
        if trace is None:
            raise ValueError("--trace: the mooncake workload needs the trace's path")
        return _mooncake(trace, n, seed, trace_block_tokens)
    k = shape_number(kind)
    if k is not None:
        return _shape(k, n, seed)
    if kind == "chat":
        return _chat(n, seed)
    return _synthetic(kind, n, seed)


def like_fleet(text: str) -> tuple[int, int, list[tuple[int, list[SimRequest]]]]:
    """``(instances, pool_tokens, [(seed, requests)])`` of the workload ``python -m radixkv.bench
    fleet TEXT`` sends: its instances, its pool (``--pool-blocks`` of vLLM's 128-token blocks less
    the one vLLM keeps as its null block, as the router reads it:
    ``radixkv.fleet.routing.vllm_usable_blocks``), and per seed its prompts and arrivals as it sends them
    (seconds; nothing rescales them), each request generating ``--max-tokens`` (the real requests
    may stop sooner).  With ``--turns``, each request opens a conversation, as ``bench fleet``
    sends it: its next turn arrives when the last
    one's answer ended (``SimRequest.after``), its prompt the last prompt, that answer (tokens of its
    own, which no prompt says: the real answer is greedy and its blocks its conversation's alone)
    and ``radixkv.bench.fleet.question``; the full blocks of the prompt and the answer but its last
    token are the request's ``answer``, which the engine caches as vLLM does.  Its flags are refused
    as that command refuses them (``radixkv.bench.fleet.refuse``), as ``ValueError``.  O(tokens)."""
    import shlex

    from radixkv.bench import fleet
    from radixkv.fleet.routing import vllm_usable_blocks

    try:
        args = fleet._parser().parse_args(shlex.split(text))
    except Refused as exc:
        raise ValueError(f"--like-fleet: {exc}") from None
    try:
        fleet.refuse(args)
    except ValueError as exc:
        raise ValueError(f"--like-fleet: {exc}") from None
    bt, out = fleet.BLOCK, []
    for seed in args.seed:
        work, _ = fleet._work(args, seed)
        ids: dict[tuple[Any, ...], int] = {}          # a block id per distinct prefix (chained, as vLLM hashes)

        def blocks(tokens: Sequence[Any], start: int = 0) -> list[int]:
            return [ids.setdefault(tuple(tokens[:(j + 1) * bt]), len(ids)) for j in range(start, -(-len(tokens) // bt))]

        turns: list[tuple[float, int, int, SimRequest]] = []     # (arrival, conversation, turn, request)
        for i, (at, first) in enumerate(work):
            tokens: list[Any] = list(first)
            for turn in range(args.turns):
                r = SimRequest(-1, at, blocks(tokens), len(tokens), args.max_tokens)
                turns.append((at, i, turn, r))
                if turn + 1 == args.turns:
                    break
                # the answer (its own tokens, as no prompt says them), cached as vLLM caches a
                # finished request's blocks: the full ones of the prompt and the answer but its
                # last token, whose KV is never computed
                sequence = tokens + [("answer", i, turn, k) for k in range(args.max_tokens)]
                r.answer = blocks(sequence[:(len(sequence) - 1) // bt * bt], len(tokens) // bt)
                tokens = sequence + fleet.question(args, seed, i, turn + 1)
        turns.sort(key=lambda t: t[:3])
        rid = {(i, turn): k for k, (_, i, turn, _) in enumerate(turns)}
        reqs = []
        for k, (_, i, turn, r) in enumerate(turns):
            r.rid, r.after = k, rid.get((i, turn - 1), -1)
            reqs.append(r)
        out.append((seed, reqs))
    return args.instances, vllm_usable_blocks(args.pool_blocks) * bt, out


def fleet_load(requests: Sequence[SimRequest], block_tokens: int, model: Any, instances: int,
               outputs: bool = False) -> float:
    """The load of ``requests`` as they arrive (``scale_to_load``'s measure: their work with the
    trace's infinite-cache hits over ``instances x`` their span).  O(blocks)."""
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    return ideal_work(requests, block_tokens, model, outputs) / (instances * span) if span > 0 else math.inf


def shape_number(kind: str) -> int | None:
    """``K`` of a workload named ``shapeK`` (K a non-negative int), else ``None``.  O(1)."""
    digits = kind[5:]
    ok = kind.startswith("shape") and digits.isascii() and digits.isdigit() and str(int(digits)) == digits
    return int(digits) if ok else None


def default_pool(kind: str, requests: Sequence[SimRequest], block_tokens: int) -> int:
    """The pool per instance a workload runs with unless ``--pool-tokens`` says: 470,000 tokens
    for a trace, ``shape_pool`` for a shape, ``CHAT_POOL`` for ``chat``, ``SYNTHETIC_POOL`` for the
    others.  O(blocks) for a shape, O(1) otherwise."""
    k = shape_number(kind)
    if k is not None:
        return shape_pool(k, requests, block_tokens)
    return {"mooncake": 470_000, "chat": CHAT_POOL}.get(kind, SYNTHETIC_POOL)


def ideal_work(requests: Sequence[SimRequest], block_tokens: int, model: Any, outputs: bool = False) -> float:
    """Seconds of engine work the requests need with their infinite-cache hits (``ideal_hits``,
    with ``outputs``).  O(blocks)."""
    hits = ideal_hits(requests, block_tokens, outputs)
    return sum(model.fixed_s + model.prefill(r.tokens - h) + (r.output - 1) * model.decode_s_per_seq
               for r, h in zip(requests, hits))


def scale_to_load(requests: list[SimRequest], block_tokens: int, model: Any, instances: int, load: float,
                  outputs: bool = False) -> float:
    """Stretch the arrival times so that the ideal work (``ideal_work``, with ``outputs``) is
    ``load`` of ``instances``' time over the span; returns the span (s).  O(blocks)."""
    span0 = max(r.arrival for r in requests) - min(r.arrival for r in requests) or 1.0
    span = ideal_work(requests, block_tokens, model, outputs) / (instances * load)
    t0 = min(r.arrival for r in requests)
    for r in requests:
        r.arrival = (r.arrival - t0) * span / span0
    return span


# -- the fleet ---------------------------------------------------------------------------------


class _PromptsOnly(LRU):
    """A CPU tier's policy (least recently used first) that declines the chunks of what requests
    generated (``declined``, which the fleet fills as it caches them) unless a prompt that arrived
    holds them (``held``: a later turn's, with its last turn's answer): a tier below vLLM keeps
    prompts, as radixkv's connector stores only a prompt's chunks and vLLM's own offloading
    (``offload_prompt_only``) does by default, while the pool caches generated blocks too."""

    name = "prompts_only"

    def __init__(self, declined: set[bytes], held: set[bytes]) -> None:
        super().__init__()
        self.declined, self.held = declined, held

    def admit(self, key: bytes) -> bool:
        """Whether ``key`` is not a generated chunk's, or is a prompt's too.  O(1)."""
        return key not in self.declined or key in self.held


class _Instance:
    def __init__(self, fleet: Fleet, name: str) -> None:
        import torch

        from radixkv.backends.cpu import CpuTier
        from radixkv.core.cache import PrefixCache
        from radixkv.core.pool import KVLayout
        from radixkv.fleet.publish import KVEvents

        self.fleet, self.name = fleet, name
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=1)
        # with outputs' pages the pool caches generated blocks, which the tier declines
        policy = _PromptsOnly(fleet.generated_keys, fleet.prompt_keys) if fleet.output_pages else None
        tiers = [CpuTier(fleet.cpu_blocks * fleet.blob_bytes, slot_bytes=fleet.blob_bytes, policy=policy)
                 ] if fleet.cpu_blocks else []
        self.cache = PrefixCache(layout, num_pages=fleet.pool_blocks, chunk_size=1, namespace=fleet.namespace,
                                 tiers=tiers)
        self.seq = 0
        # the events of the cache's changes, published when the step that made them ends (vLLM
        # takes a step's events in ``Scheduler.update_from_output``, after the model ran)
        self.events: list[Any] = []

        def sink(events: list[Any]) -> None:
            self.events.extend(events)

        # the namespace the cache makes its chunk keys in (as ``radixkv.fleet.publish`` takes it)
        self.namespace = self.cache.stack.namespace if self.cache.stack is not None else self.cache.namespace
        self.cache.observers.add(KVEvents(sink, namespace=self.namespace, chunk_size=1))
        self.waiting: deque[SimRequest] = deque()
        self.finishing: list[SimRequest] = []
        self.scheduling = False     # a step ended and the next is not scheduled yet (no rebalancing then)
        self.prefilling = False     # the step scheduled or in flight computes prompt tokens (one moved here waits for it)
        self.running: list[SimRequest] = []
        self.wake = fleet.env.event()
        self.busy_s = 0.0
        self.served = 0
        self.preemptions = 0
        # names of the blocks the step in flight computes or loads: in the pool (a request of this
        # instance scheduled after them reuses them) but not yet anything a peer can load
        self.computing: set[Any] = set()

    def publish(self) -> None:
        """Apply the events gathered since the last call to the fleet index, as one batch."""
        from radixkv.fleet.events import EventBatch

        if self.events:
            self.fleet.index.apply(self.name, self.seq, EventBatch(ts=self.fleet.env.now, events=self.events))
            self.seq += 1
            self.events = []

    def resident(self, r: SimRequest) -> int:
        """Leading full blocks of ``r`` in this instance's pool, without touching anything."""
        from radixkv.testing.machines import resident_tokens

        return resident_tokens(self.cache.tree, r.blocks[:full_blocks(r, self.fleet.block_tokens)])

    def held(self, r: SimRequest) -> int:
        """Leading full blocks of ``r`` in this instance's pool or, after them, its CPU tier: what
        a peer can load from it (a real instance serves its CPU tier, which under vLLM holds what
        the pool holds too; here the tier takes what the pool lets go).  Not the blocks its step
        in flight is still computing or loading: they are in its pool for its own requests, but
        their KV does not exist yet.  O(blocks)."""
        n = self.resident(r)
        if self.computing:
            n = next((j for j in range(n) if r.names[j] in self.computing), n)
        stack = self.cache.stack
        if stack is not None and n < len(r.tier_keys):
            n += stack.tiers[0].contains_prefix(r.tier_keys[n:])
        return n

    def start(self, r: SimRequest) -> float | None:
        """Begin ``r``'s prefill: match (loading from the CPU tier, a peer, a shared tier), hold its
        pages; seconds its loads cost, or ``None`` when the pool has no room yet."""
        with self._held_writer():
            return self._start(r)

    def _held_writer(self) -> Any:
        """Keep the CPU tier's writer off its queue until the step's cache calls are done, then
        let it write everything at once: the batches (and so the tier's evictions) are the same on
        every run, whatever the threads' timing."""
        import contextlib

        stack = self.cache.stack
        if stack is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def held() -> Any:
            with stack.writer.hold():
                yield
            self.cache.flush()

        return held()

    def _start(self, r: SimRequest) -> float | None:
        from radixkv.core.cache import PoolExhausted

        f, bt, model = self.fleet, self.fleet.block_tokens, self.fleet.model
        full = full_blocks(r, bt)
        m = self.cache.match(self._sequence(r) if r.preempted else r.blocks)
        hit, below = m.num_tokens, m.tier_tokens
        seq_held = max(0, hit - full)       # a resumed request's generated blocks, still cached
        own = self._admitted_private(r) - seq_held
        load_s = model.load("CPU", below * bt)
        extra = 0
        peer = max((inst.held(r) for inst in f.instances if inst is not self), default=0) if f.p2p else 0
        shared = f.shared_blocks(r) if f.shared else 0
        best, source = max((peer, "PEER"), (shared, "SHARED"), key=lambda o: (o[0], o[1] == "PEER"))
        best = min(best, len(r.blocks) - 1)
        if best > hit:
            extra = best - hit
        try:
            need = max(0, full - hit) + own         # pages for the prompt's blocks it did not find, its own
            pages = self.cache.alloc(need) if need > 0 else None
        except PoolExhausted:
            self.cache.release(m)
            return None
        if own:                 # taken at admission, never cached, freed at the end (``end``)
            assert pages is not None
            cut = len(pages) - own          # the prompt's pages first (none when the match covers it)
            r.private, pages = pages[cut:], (pages[:cut] if cut else None)
        if extra and pages is not None:             # the peer's or shared tier's blocks, loaded
            self.computing.update(r.names[hit:best])
            self.cache.insert(r.blocks[:best], [*m.pages.tolist(), *pages[:extra].tolist()])
            m, old = self.cache.match(r.blocks[:best], leave_last=False), m
            self.cache.release(old)
            pages = pages[extra:]
            load_s += model.load(source, extra * bt)
            hit, below = best, below + extra
        r.hold, r.pages, r.seq_held = m, pages, seq_held
        if r.preempted == 0:                # a resumed request's hits were counted once, at its first prefill
            r.hit_tokens, r.below_tokens = hit * bt, below * bt
        r.remaining = r.tokens + r.recompute - hit * bt
        r.started = True
        return load_s

    def _admitted_private(self, r: SimRequest) -> int:
        """Pages ``r`` takes at admission beyond its prompt's full blocks: none without
        ``output_pages``; with it, its whole output's (``private_blocks``), or with ``preempt`` those
        of the positions its prefill computes (its prompt's partial last block, the tokens a resumed
        request recomputes).  O(1)."""
        f, bt = self.fleet, self.fleet.block_tokens
        if not f.output_pages:
            return 0
        if not f.preempt:
            return private_blocks(r, bt)
        return max(0, -(-(r.tokens + r.recompute) // bt) - full_blocks(r, bt))

    def _pages(self, r: SimRequest) -> int:
        """Pages running ``r`` holds: its prompt's full blocks, the blocks of its sequence past them
        that its match found cached when it resumed (``seq_held``), and its private pages.  O(1)."""
        return full_blocks(r, self.fleet.block_tokens) + r.seq_held + (len(r.private) if r.private is not None else 0)

    def _sequence(self, r: SimRequest, positions: int | None = None) -> list[int]:
        """Block ids of ``r``'s sequence (its prompt, then what it generated) over ``positions``
        tokens (default: what a resumed prefill computes, its prompt and ``recompute``): its
        prompt's full blocks, then a block of its own (``Fleet.sequence_block``) for every block
        past them, the last one maybe partial.  O(blocks)."""
        bt = self.fleet.block_tokens
        n = r.tokens + r.recompute if positions is None else positions
        full = full_blocks(r, bt)
        return r.blocks[:full] + [self.fleet.sequence_block(r, j) for j in range(full, -(-n // bt))]

    def _grow(self) -> bool:
        """With ``preempt``, before a step: a page for every running request whose next position
        starts a block, in admission order, as vLLM's scheduler allocates its running requests'
        slots; when none is free, preempt the request admitted last (``_preempt``), perhaps the
        one asking.  Whether it preempted.  O(running) plus the pages taken."""
        import torch

        from radixkv.core.cache import PoolExhausted

        bt, preempted, i = self.fleet.block_tokens, False, 0
        while i < len(self.running):
            r = self.running[i]
            if _computed(r) < self._pages(r) * bt - _EPS:          # its pages cover its next position
                i += 1
                continue
            try:
                with self._held_writer():
                    page = self.cache.alloc(1)
            except PoolExhausted:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
                continue
            r.private = page if r.private is None else torch.cat([r.private, page])
        return preempted

    def _preempt(self, r: SimRequest) -> None:
        """Stop running ``r``: its pages go back, the token in flight is lost, and it waits at the
        head of the queue (behind a prefill already under way there) to recompute its prompt and
        what it generated.  Every full block of its sequence whose KV exists stays cached, unheld
        (its prompt's, and those of what it generated, as vLLM caches a request's full blocks as
        they fill), so its resumed prefill reuses what of them is still there.  O(pages)."""
        r.left = float(math.ceil(r.left - _EPS))
        generated = r.output - int(r.left)
        self.running.remove(r)
        self._let_go(r, generated)
        r.started = False
        r.recompute = generated
        r.preempted += 1
        self.preemptions += 1
        self.waiting.insert(1 if self.waiting and self.waiting[0].started else 0, r)

    def commit(self, r: SimRequest, upto: int) -> None:
        """``r``'s first ``upto`` full blocks enter the pool now that a step has scheduled their
        tokens (vLLM's scheduler caches a request's blocks when it schedules them, so a request
        scheduled after it, in the same step or later, reuses them); ``r`` holds them."""
        m = r.hold
        held = len(m.pages)
        if upto <= held or r.pages is None:
            return
        n = upto - held
        self.computing.update(r.names[held:upto])
        with self._held_writer():
            self.cache.insert(r.blocks[:upto], [*m.pages.tolist(), *r.pages[:n].tolist()])
            r.hold = self.cache.match(r.blocks[:upto], leave_last=False)
            self.cache.release(m)
        r.pages = r.pages[n:]

    def finish_prefill(self, r: SimRequest) -> None:
        """``r``'s prefill ended: its full blocks enter the pool (what another request put there
        meanwhile is freed), and it holds them until its last token."""
        full = full_blocks(r, self.fleet.block_tokens)
        m = r.hold
        with self._held_writer():
            if r.pages is not None and len(r.pages):
                self.cache.insert(r.blocks[:full], [*m.pages.tolist(), *r.pages.tolist()])
            if not r.seq_held:          # (resumed with more found: its match holds the prompt's blocks already)
                r.hold = self.cache.match(r.blocks[:full], leave_last=False)
                self.cache.release(m)
            r.pages = None
        if self.fleet.shared:                     # written through to the shared tier once computed
            self.fleet._shared.update(r.names)

    def _to_next_page(self, r: SimRequest) -> float:
        """Decode steps before running ``r`` reaches a position its pages do not cover.  O(1)."""
        return max(0.0, self._pages(r) * self.fleet.block_tokens - _computed(r))

    def _let_go(self, r: SimRequest, generated: int) -> None:
        """``r`` gives back its pages, having generated ``generated`` tokens (preempted, or at its
        end).  Every full block of its sequence whose KV exists (its prompt and what it generated
        but the last token) stays cached, unheld: its prompt's, and with ``output_pages`` those of
        what it generated, each an id of its own (``_sequence``), as vLLM caches a request's full
        blocks as they fill and keeps them after it ends until their pages are taken; its other
        private pages are freed.  Without ``output_pages`` the output has no pages, and nothing of
        it is cached.  The CPU tier declines the generated blocks when the pool lets them go
        (``Fleet.decline``).  O(pages)."""
        bt = self.fleet.block_tokens
        full = full_blocks(r, bt)
        # ``_pages`` counts the pages it holds: never more cached than it has
        kv_full = min((r.tokens + generated - 1) // bt, self._pages(r))
        with self._held_writer():
            private, cached = r.private, max(0, kv_full - full - r.seq_held)
            if cached:
                sequence = self._sequence(r, kv_full * bt)
                self.fleet.decline(sequence, full)
                self.cache.insert(sequence, [*r.hold.pages.tolist(), *private[:cached].tolist()])
                private = private[cached:]
            self.cache.release(r.hold)
            if private is not None and len(private):
                self.cache.free(private)
        r.hold, r.private, r.seq_held = None, None, 0

    def end(self, r: SimRequest) -> None:
        """``r`` decoded its last token: its blocks stay cached as it lets them go (``_let_go``),
        and the router hears that it ended.  O(pages)."""
        self._let_go(r, r.output)
        self.fleet.ended(r)
        self.fleet.chooser.ended(self.fleet.backend[self.name], r.tokens, r.names, self.fleet.told(r), self.fleet.env.now)
        self.served += 1

    def run(self) -> Generator[Any, Any, None]:
        env, model, f = self.fleet.env, self.fleet.model, self.fleet
        # The router hears a step's first tokens and ends after the engine has scheduled its next
        # step (vLLM admits the waiting requests the step's budget and pool allow before the
        # outputs reach the router): the rebalancing they set off comes after that admission, so
        # it cannot take a request the next step starts.
        heard = False
        while True:
            if not self.waiting and not self.running:
                self.scheduling = False
                if heard:
                    heard = False
                    f.rebalance()
                    continue
                self.wake = env.event()
                yield self.wake
                continue
            budget, tokens, load_s = f.budget, 0, 0.0
            done: list[SimRequest] = []
            self.finishing = done           # prefilled by the step in flight: no longer waiting, not yet running
            preempted = self._grow() if f.preempt else False
            while True:
                while self.waiting and budget > 0:
                    r = self.waiting[0]
                    if not r.started:
                        if preempted:           # vLLM admits no request in a step that preempted one
                            break
                        cost = self.start(r)
                        if cost is None:
                            break
                        load_s += cost
                    take = min(r.remaining, budget)
                    r.remaining -= take
                    budget -= take
                    tokens += take
                    computed = r.tokens + r.recompute - r.remaining
                    self.commit(r, min(computed // f.block_tokens, full_blocks(r, f.block_tokens)))
                    if r.remaining:
                        break
                    done.append(self.waiting.popleft())
                self.scheduling, self.prefilling = False, bool(tokens or done)
                if not heard:
                    break
                heard = False
                # A request moved here joins the next step; a step that only decodes is fluid here
                # (an arrival starts at once), so one moved here then starts now, as an arrival would.
                if self.name not in f.rebalance() or tokens or done:
                    break
            decoding = len(self.running)
            if tokens or done:
                dt = model.fixed_s + model.prefill(tokens) + load_s
                if decoding:
                    dt += model.decode_step_s + model.decode_s_per_seq * decoding
                start = env.now
                yield env.timeout(dt)
                self.prefilling = False
                self.computing.clear()
                self.busy_s += env.now - start
                for r in self.running:
                    r.left -= 1
            elif preempted and not self.running:    # everything running was preempted: admit again
                continue
            else:
                # decode only: advance to the next completion or the next arrival (with ``preempt``:
                # or a running request's next page), fluidly
                step = model.decode_step_s + model.decode_s_per_seq * decoding
                soonest = max(0.0, min(r.left for r in self.running)) * step
                if f.preempt:
                    soonest = min(soonest, min(self._to_next_page(r) for r in self.running) * step)
                start = env.now
                self.wake = env.event()
                yield env.any_of([self.wake, env.timeout(soonest)])
                spent = env.now - start
                self.busy_s += spent
                for r in self.running:
                    r.left -= spent / step if step > 0 else r.left
            for r in done:
                self.finish_prefill(r)
                if r.preempted:             # resumed: its prefill gave its next token
                    r.left -= 1
                    r.recompute = 0
                else:
                    r.ttft = env.now - r.arrival
                    f.chooser.prefilled(f.backend[self.name], r.charge, r.names, env.now, r.sent_at, r.tokens,
                                        f.told(r), key=r.rid)
                    r.left = r.output - 1
                self.running.append(r)
            self.finishing = []
            self.scheduling = True
            ends = [r for r in self.running if r.left <= 1e-9]
            for r in ends:
                self.running.remove(r)
                self.end(r)
            self.publish()
            heard = bool(done or ends)      # the router heard a first token or an end


class Fleet:
    """N simulated instances behind a ``Chooser`` of ``policy`` (see the module docstring)."""

    def __init__(self, instances: int, policy: str, model: Any, block_tokens: int, *, pool_tokens: int,
                 cpu_tokens: int, budget: int, p2p: bool = False, shared: bool = False, affinity: float | None = None,
                 seed: int = 0, output_pages: bool = False, preempt: bool = False, router_model: Any = None,
                 balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL, rebalance: bool = False) -> None:
        import simpy

        from radixkv.core.hashing import Namespace
        from radixkv.fleet.index import Index
        from radixkv.fleet.routing import Backend, Chooser

        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ValueError(f"instances must be a positive int, got {instances!r}")
        if preempt and not output_pages:
            raise ValueError("preempt: only with output_pages (without them a request takes no page as it decodes)")
        self.preempt = preempt
        self.rebalanced = 0         # requests moved while they waited (``rebalance``)
        self._by_rid: dict[Any, SimRequest] = {}
        self.env = simpy.Environment()
        self.model, self.block_tokens, self.budget = model, block_tokens, budget
        self.pool_blocks = max(2, pool_tokens // block_tokens)
        self.cpu_blocks = cpu_tokens // block_tokens
        self.p2p, self.shared, self.output_pages = p2p, shared, output_pages
        self.namespace = Namespace(model="fleet-sim")
        self.blob_bytes = self._blob_bytes()
        self.index = Index()
        self._shared: set[Any] = set()
        self.chooser = Chooser(policy, block_size=block_tokens, lookup=self.index.lookup,
                               spread=self.index.lookup_spread, model=router_model or model,
                               affinity=affinity, p2p=p2p, shared=self._shared_run if shared else None, seed=seed,
                               balance_abs=balance_abs, balance_rel=balance_rel, rebalance=rebalance)
        #: the CPU tiers' keys of the generated blocks cached so far, which the tiers decline
        self.generated_keys: set[bytes] = set()
        #: with ``output_pages`` and a CPU tier: the tier keys of the prompts that arrived, which the
        #: tiers keep even where they are generated blocks too (a later turn holds its last answer)
        self.prompt_keys: set[bytes] = set()
        self.instances = [_Instance(self, f"i{k}") for k in range(instances)]
        self.backends = [Backend(inst.name, inst.name, pool_blocks=self.pool_blocks) for inst in self.instances]
        self.backend = {b.name: b for b in self.backends}
        self.by_name = {inst.name: inst for inst in self.instances}
        # with ``output_pages``: the block ids of requests' sequences past their prompts' full blocks
        # (``sequence_block``), counted down from the largest token id the cache takes
        self._sequence_ids: dict[tuple[int, int], int] = {}
        self._highest_block = 0
        # a request's end, for the requests that arrive after it (``SimRequest.after``)
        self._ends: dict[int, Any] = {}

    def _blob_bytes(self) -> int:
        """Bytes of one stored chunk (one block), to size the CPU tier in blocks."""
        import torch

        from radixkv.backends import MemoryTier
        from radixkv.core.cache import PrefixCache
        from radixkv.core.format import encoded_size
        from radixkv.core.pool import KVLayout

        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=1)
        probe = PrefixCache(layout, num_pages=2, chunk_size=1, namespace=self.namespace, tiers=[MemoryTier()])
        try:
            assert probe.stack is not None
            return encoded_size(probe.stack.shape, layout.dtype)
        finally:
            probe.close()

    def sequence_block(self, r: SimRequest, j: int) -> int:
        """The block id of block ``j`` of ``r``'s sequence, past its prompt's full blocks: the
        workload's (``r.answer``: a later turn's prompt holds it), or else one of its own (its
        content is the prompt's tail and what ``r`` generated, which no other request has), counted
        down from ``2**31 - 1`` and above every workload block id.  O(1)."""
        i = j - full_blocks(r, self.block_tokens)
        if 0 <= i < len(r.answer):
            return r.answer[i]
        key = (r.rid, j)
        block = self._sequence_ids.get(key)
        if block is None:
            block = (1 << 31) - 1 - len(self._sequence_ids)
            if block <= self._highest_block:     # a workload's own block id
                raise ValueError("the workload's block ids leave no room for its requests' generated blocks")
            self._sequence_ids[key] = block
        return block

    def decline(self, sequence: Sequence[int], start: int) -> None:
        """The CPU tiers decline blocks ``start`` on of ``sequence`` (a request's prompt and what it
        generated, ``_Instance._sequence``): their keys join ``generated_keys`` (kept where a prompt
        holds them too, ``prompt_keys``).  O(len(sequence)) hashing (none without a CPU tier)."""
        from radixkv.core.hashing import chunk_keys

        if self.cpu_blocks and start < len(sequence):
            ns = self.instances[0].namespace
            self.generated_keys.update(ns.id + k for k in chunk_keys(sequence, 1, ns)[start:])

    def names(self, r: SimRequest) -> list[Any]:
        """The router's names of ``r``'s full blocks (what the instances' events name)."""
        from radixkv.core.hashing import chunk_keys
        from radixkv.fleet.hashing import external_hash

        full = r.blocks[:full_blocks(r, self.block_tokens)]
        keys = chunk_keys(full, 1, self.instances[0].namespace) if full else []
        r.tier_keys = [self.instances[0].namespace.id + k for k in keys]
        return [external_hash(k) for k in keys]

    def shared_blocks(self, r: SimRequest) -> int:
        """Leading blocks of ``r`` the shared tier holds (never its last block)."""
        return min(self._shared_run(r.names), len(r.blocks) - 1)

    def _shared_run(self, names: Sequence[Any]) -> int:
        n = 0
        for name in names:
            if name not in self._shared:
                break
            n += 1
        return n

    def told(self, r: SimRequest) -> int | None:
        """The output the router is told ``r`` may generate (as a real one reads ``max_tokens``):
        its output with ``output_pages``, else ``None``: the engine gives the output no pages, and
        the router counts none."""
        return r.output if self.output_pages else None

    def arrive(self, r: SimRequest) -> None:
        """``r`` arrives now: the router chooses its instance (``Chooser.choose``) and is told it was sent
        there, and the instance queues it (and wakes).  With ``output_pages`` and a CPU tier, its prompt's
        tier keys join ``prompt_keys``.  O(its blocks + instances): its full blocks hashed once, one index
        lookup."""
        now = self.env.now
        r.names = self.names(r)
        if self.output_pages and self.cpu_blocks:       # what it holds of an answer is a prompt's now
            self.prompt_keys.update(r.tier_keys)
        choice = self.chooser.choose(self.backends, r.tokens, r.names, now, output=self.told(r))
        backend = choice.order[0]
        r.instance, r.why = backend.name, choice.why
        r.charge, r.sent_at = self.chooser.sent(backend, r.tokens, choice.promised, r.names, now, self.told(r),
                                                key=r.rid), now
        inst = self.by_name[backend.name]
        inst.waiting.append(r)
        if not inst.wake.triggered:
            inst.wake.succeed()

    def rebalance(self) -> set[str]:
        """Move the requests the router takes from one instance's queue to another's
        (``Chooser.rebalance``), none that its engine has started (a real router cannot tell, and
        would drop one's work); the names of the instances that took one.  Called when the router
        hears a first token or an end, after the instance that made it has scheduled its next
        step, as vLLM does before its outputs reach the router (``scheduling`` is then false on
        every instance).  O(instances ** 2 x a choice) at most."""
        def movable(rid: int) -> bool:
            r = self._by_rid[rid]
            return not r.started and r in self.by_name[r.instance].waiting

        targets: set[str] = set()
        for m in self.chooser.rebalance(self.backends, self.env.now, movable):
            r = self._by_rid[m.key]
            self.by_name[m.source.name].waiting.remove(r)
            r.instance, r.why, r.charge, r.sent_at = m.target.name, "rebalance", m.charge, m.sent_at
            self.rebalanced += 1
            inst = self.by_name[m.target.name]
            inst.waiting.append(r)
            targets.add(inst.name)
            if not inst.wake.triggered:
                inst.wake.succeed()
        return targets

    def run(self, requests: Sequence[SimRequest]) -> None:
        """Serve ``requests`` (arrival order) to the end; one whose previous turn (``after``) has
        not ended arrives when it ends.  A prompt whose full blocks outnumber the pool's pages could
        never start, and a request after one that is not an earlier request of the run could never
        arrive: ``ValueError`` before anything runs."""
        check_pool(requests, self.block_tokens, self.pool_blocks, self.output_pages)
        by_rid = self._by_rid = {r.rid: r for r in requests}
        for r in requests:
            first = by_rid.get(r.after)
            if r.after != -1 and (first is None or (first.arrival, first.rid) >= (r.arrival, r.rid)):
                raise ValueError(f"after: request {r.rid} follows {r.after}, not an earlier request of the run")
        self._ends = {r.after: self.env.event() for r in requests if r.after != -1}
        self._highest_block = max((b for r in requests for b in (*r.blocks, *r.answer)), default=0)
        for inst in self.instances:
            self.env.process(inst.run())

        def deferred(r: SimRequest) -> Generator[Any, Any, None]:
            yield self._ends[r.after]
            r.deferred, r.arrival = self.env.now - r.arrival, self.env.now
            self.arrive(r)

        def arrivals() -> Generator[Any, Any, None]:
            for r in sorted(requests, key=lambda r: (r.arrival, r.rid)):
                if r.arrival > self.env.now:
                    yield self.env.timeout(r.arrival - self.env.now)
                if r.after != -1 and not self._ends[r.after].triggered:
                    self.env.process(deferred(r))
                else:
                    self.arrive(r)

        self.env.process(arrivals())
        self.env.run()

    def ended(self, r: SimRequest) -> None:
        """``r`` decoded its last token: the requests after it may arrive.  O(1)."""
        r.ended = self.env.now
        end = self._ends.get(r.rid)
        if end is not None:
            end.succeed()

    def close(self) -> None:
        """Close every instance's cache (its CPU tier's writer and loader threads stop): a fleet
        left open keeps its caches, their threads and every request alive.  O(instances)."""
        for inst in self.instances:
            inst.cache.close()

    def check(self) -> None:
        """Every instance's cache and the index pass their ``check()``; the router's counters; the
        pages each instance's requests took and have not given to the pool (a started prompt's
        blocks not yet scheduled, and with ``output_pages`` their private pages) are exactly the
        pages its cache counts as the engine's: none leaked, none counted twice; with ``preempt``,
        no running request has decoded past its pages (by less than the token in flight) nor holds
        more than its prompt and output need.  O(pages)."""
        for inst in self.instances:
            inst.cache.check()
            requests = [*inst.waiting, *inst.finishing, *inst.running]
            taken = sum(len(r.pages) for r in requests if r.started and r.pages is not None)
            taken += sum(len(r.private) for r in requests if r.private is not None)
            engine = inst.cache.stats()["pages_engine"]
            assert engine == taken, f"{inst.name}: {engine} pages held by the engine, its requests took {taken}"
            for r in inst.running if self.preempt else ():      # no decode past its pages, none beyond its sequence's
                bt, pages = self.block_tokens, inst._pages(r)
                assert _computed(r) < pages * bt + 1, f"{inst.name}: request {r.rid} past its pages"
                assert pages <= full_blocks(r, bt) + private_blocks(r, bt), f"{inst.name}: request {r.rid}: {pages} pages"
        self.index.check()
        self.chooser.check(self.backends)


def simulate(requests: list[SimRequest], block_tokens: int, *, instances: int, policy: str, model: Any,
             pool_tokens: int, cpu_tokens: int, budget: int, p2p: bool = False, shared: bool = False,
             affinity: float | None = None, seed: int = 0, check: bool = False,
             output_pages: bool = False, preempt: bool = False, router_model: Any = None,
             balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL,
             rebalance: bool = False) -> dict[str, Any]:
    """Run one fleet over ``requests`` (copied: the caller's are not changed); the summary (with
    ``deferred``, the requests that arrived later than the workload says because their previous
    turn had not ended, and ``met_load``, the load they met as they arrived, ``fleet_load``, when
    any did).  The instances cost ``model``; the router estimates with ``router_model`` (default:
    ``model``); ``balance_abs`` and ``balance_rel`` are the imbalance thresholds of ``prefix`` and
    ``cache_aware`` (``Chooser``'s, the HTTP router's defaults; sglang-router's are 64 and 1.5);
    ``rebalance``: the cost policy's rule 9 (``Chooser.rebalance``).
    Cost: the simulation's, about O(requests x (instances + prompt blocks)) events and lookups."""
    reqs = [SimRequest(r.rid, r.arrival, r.blocks, r.tokens, r.output, r.answer, r.after) for r in requests]
    fleet = Fleet(instances, policy, model, block_tokens, pool_tokens=pool_tokens, cpu_tokens=cpu_tokens,
                  budget=budget, p2p=p2p, shared=shared, affinity=affinity, seed=seed, output_pages=output_pages,
                  preempt=preempt, router_model=router_model, balance_abs=balance_abs, balance_rel=balance_rel,
                  rebalance=rebalance)
    try:
        fleet.run(reqs)
        if check:
            fleet.check()
    finally:
        fleet.close()
    out = summary(reqs, fleet)
    # the load the requests met as they arrived, when a turn waited for its answer (``after``)
    out["met_load"] = fleet_load(reqs, block_tokens, model, instances, output_pages) if out["deferred"] else None
    return out


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(reqs: Sequence[SimRequest], fleet: Fleet) -> dict[str, Any]:
    """The run's results over ``reqs``: the hit rate (reused tokens / prompt tokens), TTFT p50, p95, p99,
    mean and every request's, requests served and busy seconds per instance, preemptions, the
    requests that arrived later than the workload says (``deferred``), and ``moved``: the later
    turns of conversations (``after``) the router sent to another instance than the turn before,
    by its reason (``Choice.why``; ``None`` without later turns), as ``bench fleet`` counts them.
    O(n log n) in the requests (each percentile sorts them)."""
    from radixkv.bench.fleet import count_moves

    ttft = [r.ttft for r in reqs]
    served = [inst.served for inst in fleet.instances]
    by_rid = {r.rid: r for r in reqs}
    moved = count_moves((by_rid[r.after].instance, r.instance, r.why) for r in reqs if r.after in by_rid)
    return {"hit": sum(r.hit_tokens for r in reqs) / max(1, sum(r.tokens for r in reqs)),
            "p50": _pct(ttft, 0.50), "p95": _pct(ttft, 0.95), "p99": _pct(ttft, 0.99),
            "mean": statistics.fmean(ttft), "served": served, "ttft": ttft,
            "busy": [round(inst.busy_s, 3) for inst in fleet.instances],
            "preempted": sum(inst.preemptions for inst in fleet.instances),
            "deferred": sum(1 for r in reqs if r.deferred > 0), "moved": moved}


# -- calibration -------------------------------------------------------------------------------


def fit_vllm_cpu(path: str | Path) -> dict[str, Any]:
    """Fit ``TTFT = fixed + prefill x computed + load[medium] x loaded`` to ``bench vllm``'s table
    (no cache at each length; the resident prefix: only the question computed; the CPU tier, LMDB
    as ``STORAGE`` and S3 as ``SHARED``, each loading the prefix);
    least squares of the relative error, no constant below 0.  Returns the constants and each
    measurement with its fitted value."""
    import numpy as np

    lines = Path(path).read_text().splitlines()
    head = next(line for line in lines if line.startswith("TTFT, ms"))
    lengths = [int(tok.split("K")[0]) * 1024 for tok in head.split()[2:] if "K" in tok]
    question = 256

    def row(label: str) -> list[float]:
        line = next(line for line in lines if line.startswith(label))
        nums = [float(x) for x in line[len(label):].replace("x", " ").replace("%", " ").split()]
        step = len(nums) // len(lengths)
        return [nums[i * step] for i in range(len(lengths))]

    none, resident = row("no cache"), row("vllm prefix cache (resident)")
    below = {"CPU": row("radixkv cpu tier"), "STORAGE": row("radixkv lmdb (restart)"),
             "SHARED": row("radixkv s3 (second process)")}
    media = list(below)
    a, y, points = [], [], []

    def add(label: str, n: int, t: float, computed: int, medium: str | None) -> None:
        a.append([1.0, float(computed)] + [float(n) if m == medium else 0.0 for m in media])
        y.append(t / 1000)
        points.append((label, n, t / 1000))

    for n, t in zip(lengths, none):
        add("no cache", n, t, n + question, None)
    for n, t in zip(lengths, resident):
        add("resident", n, t, question, None)
    for medium, times in below.items():
        for n, t in zip(lengths, times):
            add(medium.lower(), n, t, question, medium)
    # relative least squares (each row weighed by 1/measured): the short TTFTs count as much as the long;
    # no constant may be negative (a negative fixed cost is attention's superlinear growth read as an
    # intercept): the most negative one is held at 0 and the rest refitted, until none is
    w = 1.0 / np.array(y)
    m_, b_ = np.array(a) * w[:, None], np.array(y) * w
    free = list(range(m_.shape[1]))
    coef = np.zeros(m_.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(m_[:, free], b_, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    fitted = np.array(a) @ coef
    rows = [(label, n, t, float(f)) for (label, n, t), f in zip(points, fitted)]
    return {"fixed_s": float(coef[0]), "prefill_s_per_token": float(coef[1]),
            "load_s_per_token": {m: float(c) for m, c in zip(media, coef[2:])},
            "rows": rows, "max_rel_error": max(abs(f - t) / t for _, _, t, f in rows)}


def fit_vllm_cpu_decode(path: str | Path) -> dict[str, Any]:
    """Fit ``step = decode_step + decode_per_seq x batch`` to ``bench vllm --decode``'s table (the
    median step at each batch size), least squares of the relative error, the slope at least 0.
    Returns the constants, each measurement with its fitted value and the largest relative error."""
    import numpy as np

    rows = [line.split() for line in Path(path).read_text().splitlines() if line.startswith("decode step ")]
    points = [(int(f[2]), float(f[3]) / 1000) for f in rows]
    if len(points) < 2:
        raise ValueError(f"{path}: fewer than two batch sizes measured")
    a = np.array([[1.0, float(b)] for b, _ in points])
    y = np.array([t for _, t in points])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    if coef[1] < 0:                 # a step cannot get cheaper with more sequences: the noise's slope, held at 0
        coef = np.array([float(np.sum(1 / y) / np.sum(1 / y ** 2)), 0.0])
    fitted = a @ coef
    out = [(b, t, float(f)) for (b, t), f in zip(points, fitted)]
    return {"decode_step_s": float(coef[0]), "decode_s_per_seq": float(coef[1]), "rows": out,
            "max_rel_error": max(abs(f - t) / t for _, t, f in out)}


# -- the command -------------------------------------------------------------------------------


def _grid(args: argparse.Namespace) -> Iterable[tuple[str, int, float, int]]:
    for kind in args.workloads:
        for n in args.instances:
            for load in args.loads:
                for seed in args.seeds:
                    yield kind, n, load, seed


def _numbers(flag: str, text: str, kind: type, low: float) -> list[Any]:
    """``--flag``'s comma-separated numbers, each at least ``low``; ``ValueError`` naming it."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: give {kind.__name__}s separated by commas, got {text!r}") from None
    if not all(v >= low for v in values):
        raise ValueError(f"{flag}: every value must be at least {low}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """The command (see the module docstring): bad input (a trace, an argument, a table) is one
    line on stderr and exit status 2."""
    import sys

    try:
        return _main(argv)
    except Refused as exc:                  # argparse's own complaint, already one line with the prog
        print(exc, file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"python -m radixkv.bench fleet_sim: {exc}", file=sys.stderr)
        return 2
    except WorkerDied as exc:
        print(f"python -m radixkv.bench fleet_sim: {exc}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None) -> int:
    from radixkv.fleet.routing import POLICIES, PROFILES

    ap = Parser(prog="python -m radixkv.bench fleet_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=None,
                    help="mooncake, tenants, hot, fleetwide, chat, or shapeK (K a number: a shape drawn from it); "
                         "default the first four with --trace, else tenants, hot and fleetwide")
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace (JSON lines) for the mooncake workload")
    ap.add_argument("--trace-block", type=int, default=None,
                    help="tokens a trace's hash id stands for (default: as its rows' lengths say; 512 in Mooncake's)")
    ap.add_argument("--instances", default=None, help="default 4,8,16")
    ap.add_argument("--loads", default=None, help="default 0.5,0.8,0.95")
    ap.add_argument("--seeds", default=None, help="default 0,1,2")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--profile", choices=sorted(PROFILES), default=None,
                    help="default h100-8b; with --like-fleet vllm-cpu-fleet (its router estimating with vllm-cpu, "
                         "as bench fleet's does)")
    ap.add_argument("--like-fleet", default=None, metavar="ARGS",
                    help="the workload 'python -m radixkv.bench fleet ARGS' sends, on its instances and pool: its "
                         "seeds, prompts and arrivals as sent, every request generating --max-tokens (instead of "
                         "--workloads, --instances, --loads, --seeds and --requests)")
    ap.add_argument("--router-profile", choices=sorted(PROFILES), default=None,
                    help="the profile the simulated router estimates with (default: --profile's; with --like-fleet "
                         "vllm-cpu, as bench fleet starts its router)")
    ap.add_argument("--slower", type=float, default=None, metavar="F",
                    help="with --like-fleet: every prefill and decode step of the instances F times the profile's (a "
                         "slower machine, F > 1, or a faster one; the router's estimates stay --router-profile's); "
                         "its arrivals are not rescaled")
    ap.add_argument("--pool-tokens", type=int, default=None,
                    help="KV pool per instance (default: SYNTHETIC_POOL for tenants, hot and fleetwide; CHAT_POOL for "
                         "chat; a shape's "
                         "fraction of its distinct prefix tokens, at least two of its longest prompt; for mooncake "
                         "470,000, an 8B model's KV in an H100 beside its weights, and above the trace's longest "
                         "prompt, 134K tokens)")
    ap.add_argument("--cpu-tokens", type=int, default=None, help="CPU tier per instance (default: as the pool)")
    ap.add_argument("--budget", type=int, default=None, help="prompt tokens a step computes (default: the profile's)")
    ap.add_argument("--affinity", type=float, default=None, help="the cost policy's affinity (default: by load)")
    ap.add_argument("--balance-abs", type=int, default=BALANCE_ABS,
                    help="prefix and cache_aware: imbalance past this many requests in flight between the most and "
                         "least loaded instances (and --balance-rel) sends a request to the least loaded (default "
                         f"{BALANCE_ABS}, as the router's; sglang-router's own default is 64)")
    ap.add_argument("--balance-rel", type=float, default=BALANCE_REL,
                    help="prefix and cache_aware: ... and the most loaded past this many times the least (default "
                         f"{BALANCE_REL:g}, as the router's and sglang-router's)")
    ap.add_argument("--rebalance", action="store_true",
                    help="the cost policy moves a request still waiting on one instance to one that fell free "
                         "(rule 9, Chooser.rebalance; as radixkv route --rebalance)")
    ap.add_argument("--p2p", action="store_true", help="an instance loads a prefix another's pool holds (PEER cost)")
    ap.add_argument("--shared", action="store_true",
                    help="a shared tier (S3-like, unbounded) holds every block once computed (SHARED cost)")
    ap.add_argument("--output-pages", action="store_true",
                    help="a request also holds pages for its prompt's partial last block and its output tokens "
                         "from its admission to its end (never cached); by default only its prompt's full blocks")
    ap.add_argument("--preempt", action="store_true",
                    help="with --output-pages: take output pages as decodes reach them, as vLLM does, and preempt "
                         "the request admitted last when none is free (it recomputes at the head of the queue)")
    ap.add_argument("--summarize", default=None, metavar="TABLE[,TABLE]",
                    help="read tables this command wrote and print the goals' check (also printed after a run); "
                         "a later table's rows replace an earlier one's of the same cell, seed and policy")
    ap.add_argument("--judge", default=None, metavar="POLICY",
                    help="with --summarize: check the goals for POLICY as if it were the default, against the "
                         "table's other policies (default cost)")
    ap.add_argument("--calibrate", default=None, metavar="VLLM_TABLE",
                    help="print the fit of bench vllm's table (benchmarks/results/vllm_cpu.txt) and exit")
    ap.add_argument("--decode-table", default=None, metavar="DECODE_TABLE",
                    help="with --calibrate: also fit bench vllm --decode's table (benchmarks/results/vllm_cpu_decode.txt)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes that simulate at once, each a policy on a cell (default: the CPUs this "
                         "process may use); the table is the same for any number, row for row")
    ap.add_argument("--out", type=out_file, default=None)
    args = ap.parse_args(argv)
    if args.balance_abs < 0:
        raise ValueError(f"--balance-abs must be at least 0 (requests in flight), got {args.balance_abs}")
    if not 1.0 <= args.balance_rel < math.inf:
        raise ValueError(f"--balance-rel must be a finite number at least 1 (a ratio), got {args.balance_rel}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.preempt and not args.output_pages:
        raise ValueError("--preempt: only with --output-pages")
    if args.decode_table is not None and not args.calibrate:
        raise ValueError("--decode-table: only with --calibrate")
    if args.slower is not None and not (0 < args.slower < math.inf):
        raise ValueError(f"--slower must be a positive finite number, got {args.slower}")
    if args.slower is not None and args.like_fleet is None:
        raise ValueError("--slower: only with --like-fleet (elsewhere arrivals are scaled to each load, "
                         "whatever the steps cost)")
    if args.judge is not None and not args.summarize:
        raise ValueError("--judge: only with --summarize")
    if args.judge is not None and args.judge not in POLICIES:
        raise ValueError(f"--judge: unknown policy {args.judge!r} (one of {', '.join(POLICIES)})")
    if args.summarize:
        print("\n".join(goals([line for table in args.summarize.split(",")
                                for line in _read_text("--summarize", table).splitlines()], args.judge or "cost")))
        return 0
    if args.calibrate:
        try:
            text = calibration_text(args.calibrate, args.decode_table)
        except (StopIteration, IndexError, KeyError, ValueError, ZeroDivisionError) as exc:
            files = args.calibrate + (f" with --decode-table {args.decode_table}" if args.decode_table else "")
            raise ValueError(f"--calibrate: cannot fit {files}: "
                             f"{str(exc) or 'not a table bench vllm wrote (no TTFT, ms header)'}") from None
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    for flag, value, least in (("--requests", args.requests, 1), ("--trace-block", args.trace_block, 1),
                               ("--budget", args.budget, 1), ("--pool-tokens", args.pool_tokens, 1),
                               ("--cpu-tokens", args.cpu_tokens, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r} (one of {', '.join(POLICIES)})")
    if args.like_fleet is not None:
        for flag in ("workloads", "instances", "loads", "seeds", "trace"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag}: not with --like-fleet (its command sets them)")
        return _run_like_fleet(args, argv, policies)
    # the trace is not shipped: without one, the default runs the synthetic workloads alone
    args.workloads = (args.workloads or ("mooncake," if args.trace else "") + "tenants,hot,fleetwide").split(",")
    for kind in args.workloads:
        if kind not in WORKLOADS and shape_number(kind) is None:
            raise ValueError(f"--workloads: unknown workload {kind!r} (one of {', '.join(WORKLOADS)}, or shapeK)")
    args.instances = _numbers("--instances", args.instances or "4,8,16", int, 1)
    args.loads = _numbers("--loads", args.loads or "0.5,0.8,0.95", float, 1e-6)
    args.seeds = _numbers("--seeds", args.seeds or "0,1,2", int, 0)
    for kind in args.workloads:             # a bad trace is refused before anything is printed
        workload(kind, 1, 0, args.trace, args.trace_block)
    args.profile = args.profile or "h100-8b"
    model = PROFILES[args.profile]
    budget = args.budget or (8192 if args.profile == "h100-8b" else 2048)
    for kind in args.workloads:             # so is a pool too small for a request (O(requests) a seed)
        for seed in args.seeds:
            reqs, bt = workload(kind, args.requests, seed, args.trace, args.trace_block)
            check_pool(reqs, bt, max(2, (args.pool_tokens or default_pool(kind, reqs, bt)) // bt), args.output_pages)

    def cells() -> Iterable[tuple[str, int, float, int, list[SimRequest], int, int]]:
        for kind, n, load, seed in _grid(args):
            reqs, bt = workload(kind, args.requests, seed, args.trace, args.trace_block)
            pool = args.pool_tokens or default_pool(kind, reqs, bt)
            scale_to_load(reqs, bt, model, n, load, args.output_pages)
            yield kind, n, load, seed, reqs, bt, pool

    return _report(args, argv, policies, budget, cells())


def slower(model: Any, factor: float) -> Any:
    """``model`` (a ``CostModel``) with its prefill and decode step costs ``factor`` times as much:
    a slower machine (``factor`` > 1) or a faster one.  Loads and the fixed cost unchanged.  O(1)."""
    import dataclasses

    return dataclasses.replace(model, prefill_s_per_token=model.prefill_s_per_token * factor,
                               decode_step_s=model.decode_step_s * factor,
                               decode_s_per_seq=model.decode_s_per_seq * factor,
                               source=f"{model.source}, every step x{factor:g}")


def _model(args: argparse.Namespace) -> Any:
    """The run's cost model: ``--profile``'s, ``--slower`` times where given."""
    from radixkv.fleet.routing import PROFILES

    model = PROFILES[args.profile]
    return slower(model, args.slower) if args.slower is not None else model


def _run_like_fleet(args: argparse.Namespace, argv: list[str] | None, policies: list[str]) -> int:
    """``--like-fleet``: ``bench fleet``'s workload, as it arrives, on its instances and pool."""
    from radixkv.bench.fleet import BLOCK as bt

    instances, pool, runs = like_fleet(args.like_fleet)
    args.profile = args.profile or "vllm-cpu-fleet"     # the fit of the model bench fleet serves
    args.router_profile = args.router_profile or "vllm-cpu"     # as bench fleet starts its router
    model = _model(args)
    budget = args.budget or (8192 if args.profile == "h100-8b" else 2048)
    pool = args.pool_tokens or pool
    for _, reqs in runs:
        check_pool(reqs, bt, max(2, pool // bt), args.output_pages)
    load = statistics.fmean(fleet_load(reqs, bt, model, instances, args.output_pages) for _, reqs in runs)   # one cell, its seeds
    cells = (("fleet", instances, load, seed, reqs, bt, pool) for seed, reqs in runs)
    return _report(args, argv, policies, budget, cells)


def cpus() -> int:
    """The CPUs this process may run on (its affinity where the system says, else every CPU).  O(1)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                  # not on Linux
        return max(1, os.cpu_count() or 1)


def _simulate(kw: dict[str, Any]) -> dict[str, Any]:
    """``simulate(**kw)``: what a worker process runs (a module-level function, so it pickles)."""
    return simulate(kw.pop("requests"), kw.pop("block_tokens"), **kw)


def in_order(fn: Callable[[Any], Any], items: Iterable[Any], argument: Callable[[Any], Any],
             jobs: int) -> Iterator[tuple[Any, Any]]:
    """``(item, fn(argument(item)))`` for each of ``items``, in their order, computed by ``jobs``
    processes at once (in this one when ``jobs`` is 1).  At most ``2 x jobs`` items are taken from
    ``items`` ahead of the one yielded, so a generator's items are built as they are needed, not all
    at once.  A worker that dies (killed, out of memory) is ``WorkerDied``; what ``fn`` raises is
    raised here.  Each item's cost is ``fn``'s, plus pickling its arguments and answer to and from
    a worker (and a worker's start, about 2 s of imports, once per process)."""
    if jobs <= 1:
        for item in items:
            yield item, fn(argument(item))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: a worker starts from a clean interpreter whatever threads this process runs
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        ahead: deque[tuple[Any, Any]] = deque()
        it = iter(items)
        try:
            while True:
                while len(ahead) < 2 * jobs and (item := next(it, _END)) is not _END:
                    ahead.append((item, pool.submit(fn, argument(item))))
                if not ahead:
                    return
                item, future = ahead.popleft()
                yield item, future.result()
        except BrokenProcessPool:
            raise WorkerDied("a simulating process died (killed, or out of memory?): rerun with fewer "
                             "--jobs") from None
        finally:
            for _, future in ahead:
                future.cancel()


_END = object()


class WorkerDied(RuntimeError):
    """A process of ``in_order`` died before it answered (killed, or out of memory)."""


def _report(args: argparse.Namespace, argv: list[str] | None, policies: list[str], budget: int,
            cells: Iterable[tuple[str, int, float, int, list[SimRequest], int, int]]) -> int:
    """Run every policy on every cell ``(workload, instances, load, seed, requests, block tokens,
    pool)``, print the table and the goals' check, write it to ``--out``."""
    from radixkv.bench import machine_line
    from radixkv.bench.fleet import moved_text
    from radixkv.fleet.routing import PROFILES

    model = _model(args)
    router = args.router_profile
    router_model = PROFILES[router] if router is not None else None
    out: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    import shlex
    import sys

    say(f"# python -m radixkv.bench fleet_sim {shlex.join(argv if argv is not None else sys.argv[1:])}")
    say(f"# machine: {machine_line()} (virtual time: the machine sets only how long the run takes)")
    say(f"# profile {args.profile} ({model.source}): prefill {model.prefill_s_per_token * 1e6:.1f} us/token, "
        f"fixed {model.fixed_s * 1000:.1f} ms, decode step {model.decode_step_s * 1000:.2f} ms + "
        f"{model.decode_s_per_seq * 1000:.3f} ms/seq; pool {args.pool_tokens or 'by workload'}, "
        f"CPU tier {args.cpu_tokens if args.cpu_tokens is not None else 'as the pool'}, budget {budget}"
        f"{', p2p' if args.p2p else ''}{', shared tier' if args.shared else ''}"
        f"{', output pages' if args.output_pages else ''}{' taken as decoded, preempting' if args.preempt else ''}"
        f", affinity {args.affinity}"
        f"{'' if (args.balance_abs, args.balance_rel) == (BALANCE_ABS, BALANCE_REL) else f', imbalance {args.balance_abs}/{args.balance_rel:g}'}"
        f"{', rebalancing' if args.rebalance else ''}"
        f"{f'; the router estimates with the {router} profile' if router_model not in (None, model) else ''}")
    started = time.perf_counter()
    say(f"{'workload':10} {'n':>3} {'load':>5} {'seed':>4} {'policy':13} {'hit':>6} {'p50 s':>8} {'p95 s':>8} "
        f"{'p99 s':>8}  served min/max")
    runs = ((kind, n, load, seed, policy, reqs, bt, pool) for kind, n, load, seed, reqs, bt, pool in cells
            for policy in policies)

    def kwargs(run: tuple[Any, ...]) -> dict[str, Any]:
        kind, n, load, seed, policy, reqs, bt, pool = run
        return dict(requests=reqs, block_tokens=bt, instances=n, policy=policy, model=model, pool_tokens=pool,
                    cpu_tokens=args.cpu_tokens if args.cpu_tokens is not None else pool, budget=budget,
                    p2p=args.p2p, shared=args.shared, affinity=args.affinity, seed=seed,
                    output_pages=args.output_pages, preempt=args.preempt, router_model=router_model,
                    balance_abs=args.balance_abs, balance_rel=args.balance_rel, rebalance=args.rebalance)

    jobs = args.jobs or cpus()
    for (kind, n, load, seed, policy, *_), s in in_order(_simulate, runs, kwargs, jobs):
        met = f"  deferred {s['deferred']}, met load {s['met_load']:.2f}" if s["deferred"] else ""
        met += moved_text(s["moved"])       # later turns sent to another instance than the turn before
        say(f"{kind:10} {n:>3} {load:>5.2f} {seed:>4} {policy:13} {s['hit']:6.1%} {s['p50']:8.3f} "
            f"{s['p95']:8.3f} {s['p99']:8.3f}  {min(s['served'])}/{max(s['served'])}"
            f"{'  preempted ' + str(s['preempted']) if args.preempt else ''}{met}")
    say(f"# {time.perf_counter() - started:.0f} s, {jobs} process{'es' if jobs > 1 else ''}")
    for line in goals(out):
        say(line)
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
    return 0


#: "Within noise" for the goals: the default's mean over seeds may exceed the reference's by this.
NOISE = 0.10


def goals(lines: Sequence[str], default: str = "cost") -> list[str]:
    """The goals' check over a table's rows (means over seeds per workload, size and load): the
    default policy's TTFT p50, p95 and p99 each at most the best reference policy's (every other
    policy in the table) plus ``NOISE``, never above round-robin's, and its hit rate at least 90%
    of ``prefix``'s.  One line per miss, each problem with the number of seeds on which the
    default did worse than that policy (a miss on every seed is not one seed's noise), and a count.  Rows are kept apart by the run's
    configuration (its ``# profile`` line: pool, CPU tier, budget, p2p, ...; and the ``--requests``
    its command line gave, also inside ``--like-fleet``: runs of 96 and 400 requests at one rate
    have the same load), so a table of several runs checks each; a row repeated (same
    configuration, workload, size, load, seed and policy) replaces the earlier one: tables
    concatenated, a rerun's rows win.  O(rows)."""
    rows: dict[tuple[str, str, int, float], dict[str, dict[int, tuple[float, float, float, float]]]] = {}
    config, requests = "", ""
    for line in lines:
        if line.startswith("# python -m radixkv.bench fleet_sim "):
            m = re.search(r"--requests[= ](\d+)", line)
            requests = f", {m.group(1)} requests" if m else ""
            continue
        if line.startswith("# profile "):
            config = line.split(";", 1)[-1].strip() + requests
            continue
        f = line.split()
        if len(f) < 9 or line.startswith("#") or f[0] in ("workload", "goals:", "MISSED") or not f[1].isdigit():
            continue                # the header, comments and a summary already there
        key = (config, f[0], int(f[1]), float(f[2]))
        rows.setdefault(key, {}).setdefault(f[4], {})[int(f[3])] = (
            float(f[5].rstrip("%")) / 100, float(f[6]), float(f[7]), float(f[8]))
    out, misses, checked = [], 0, 0
    several = len({key[0] for key in rows}) > 1
    for key, by_policy in sorted(rows.items()):
        if default not in by_policy or len(by_policy) < 2:
            continue
        mean = {p: [statistics.fmean(v[i] for v in seeds.values()) for i in range(4)] for p, seeds in by_policy.items()}
        mine = mean[default]
        refs = {p: m for p, m in mean.items() if p != default}
        checked += 1
        problems = []

        def seeds(ref: str, i: int, worse: Any) -> str:
            """On how many of the seeds both ran the default did worse than ``ref`` on column ``i``."""
            both = sorted(set(by_policy[default]) & set(by_policy[ref]))
            k = sum(1 for s in both if worse(by_policy[default][s][i], by_policy[ref][s][i]))
            return f"worse on {k} of {len(both)} seeds"

        for i, name in ((1, "p50"), (2, "p95"), (3, "p99")):
            best = min(refs, key=lambda p: refs[p][i])
            if mine[i] > refs[best][i] * (1 + NOISE):
                problems.append(f"{name} {mine[i]:.3f} s > {best}'s {refs[best][i]:.3f} s "
                                f"({seeds(best, i, lambda a, b: a > b)})")
            if "round_robin" in refs and mine[i] > refs["round_robin"][i]:
                problems.append(f"{name} above round_robin's ({seeds('round_robin', i, lambda a, b: a > b)})")
        if "prefix" in refs and mine[0] < 0.9 * refs["prefix"][0]:
            problems.append(f"hit {mine[0]:.1%} < 90% of prefix's {refs['prefix'][0]:.1%} "
                            f"({seeds('prefix', 0, lambda a, b: a < b)})")
        if problems:
            misses += 1
            where = f" [{key[0]}]" if several else ""
            out.append(f"MISSED {key[1]} n={key[2]} load={key[3]:.2f}{where}: " + "; ".join(problems))
    out.append(f"goals: {checked - misses} of {checked} ({'run, ' if several else ''}workload, size, load) cells met by {default} "
               f"(means over seeds; p50/p95/p99 within {NOISE:.0%} of the best other policy and not above "
               f"round_robin's, hit rate >= 90% of prefix's)")
    return out


def calibration_text(path: str, decode: str | None = None) -> str:
    """The fit of ``fit_vllm_cpu`` as a table, and of ``fit_vllm_cpu_decode`` when ``decode``
    names ``bench vllm --decode``'s table."""
    fit = fit_vllm_cpu(path)
    lines = [f"# python -m radixkv.bench fleet_sim --calibrate {path}" + (f" --decode-table {decode}" if decode else ""),
             f"fit: TTFT = {fit['fixed_s'] * 1000:.1f} ms + {fit['prefill_s_per_token'] * 1e6:.1f} us x computed "
             "tokens + per token loaded: " + ", ".join(f"{m} {v * 1e6:.2f} us" for m, v in fit["load_s_per_token"].items()),
             f"{'row':10} {'prefix':>7} {'measured ms':>12} {'fitted ms':>10} {'error':>7}"]
    for label, n, t, f in fit["rows"]:
        lines.append(f"{label:10} {n:>7} {t * 1000:12.1f} {f * 1000:10.1f} {(f - t) / t:7.1%}")
    lines.append(f"max relative error {fit['max_rel_error']:.1%}")
    if decode:
        d = fit_vllm_cpu_decode(decode)
        lines += ["", "# decode steps (bench vllm --decode)",
                  f"fit: decode step = {d['decode_step_s'] * 1000:.2f} ms + {d['decode_s_per_seq'] * 1000:.3f} ms x "
                  "sequences in the batch",
                  f"{'batch':>5} {'measured ms':>12} {'fitted ms':>10} {'error':>7}"]
        for b, t, f in d["rows"]:
            lines.append(f"{b:>5} {t * 1000:12.2f} {f * 1000:10.2f} {(f - t) / t:7.1%}")
        lines.append(f"max relative error {d['max_rel_error']:.1%}")
    return "\n".join(lines)
