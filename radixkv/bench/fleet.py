"""Fleet benchmark: prefix-aware routing against round-robin and random, end to end.

Command that produced ``benchmarks/results/fleet_cpu.txt``::

    python -m radixkv.bench fleet --requests 144 --out benchmarks/results/fleet_cpu.txt

``--instances`` (2) ``vllm serve`` processes on vLLM's CPU build (a random-weight Llama, fp32,
block 128, a pool of ``--pool-blocks`` blocks each, radixkv's connector with a CPU tier of
``--cpu-tier-mb``, KV events on; each pinned to cores of its own, ``--pin``, and warmed up by one
request of a token id the workload never draws, its prefix cache emptied after), behind
``python -m radixkv route`` (its own process, following
every instance's events).  A multi-tenant workload: ``--tenants`` system prompts of
``--system-tokens`` tokens, each request one of them (uniformly) and a new ``--question-tokens``
question, ``--requests`` requests arriving as a Poisson process of ``--rate`` per second,
streamed with ``max_tokens=--max-tokens``.  The pools are too small for every tenant's prefix,
so where a tenant's requests go decides what stays cached.

Per policy (``--policies``, default ``cost`` (the router's default, with ``--cost-profile
vllm-cpu``), ``prefix``, ``cache_aware``, ``round_robin``; every policy on the same prompts, each on
fresh instances, so no run inherits another's cache; ``--burst N`` sends one tenant's requests N at once, each burst a
Poisson arrival): the **prefix hit rate** from vLLM's own counters summed over the
instances (``vllm:prefix_cache_hits`` / ``queries``: the GPU pool; ``+ tiers`` adds the
connector's, ``vllm:external_prefix_cache_hits``), TTFT p50/p95/p99 at the client (its first
streamed data event), requests/s, the requests each instance served, the router's decisions, and
the requests the instances preempted (``vllm:num_preemptions``: pool pages ran out while decoding, and
the request was recomputed; ``fleet_sim --preempt`` models it).  Then the
first policy again with the first instance
killed (SIGKILL) after half the requests were sent: every request is counted as served, answered
with an error, or lost (no answer at all); the claim is none lost.

Conversations (``--turns N``): each request opens a conversation of N turns; the next turn is sent
when the last one's answer ended, its prompt the last prompt, the token ids that answer generated
(``return_token_ids``; greedy and all ``--max-tokens`` of them, so every router is sent the same
prompts) and a new question of ``--question-tokens`` drawn from the seed, the request and the
turn.  vLLM caches the blocks an answer generated, so the next turn reuses them where the last one
ran; the reuse bound counts them (``reuse_bound`` with ``answers``).  Behind radixkv's router a
row ends with the later turns it *moved* (sent to another instance than the turn before, which
computes the conversation again there) by the router's reason (``moved_turns``).  Not with
``--trace``.  With ``--routers`` the answer's ids come back the same way through either router,
and the answer may not use id 0 (``logit_bias``: the word tokenizer's unknown word, which no text
prompt can say).

Side by side with sglang-router (commands that produced ``benchmarks/results/fleet_cpu_sglang_*.txt``)::

    python -m radixkv.bench fleet --requests 96 --burst 6 --seed 0,1,2 --routers radixkv:cost,sglang:cache_aware,\
        sglang:cache_aware_low,radixkv:round_robin --out benchmarks/results/fleet_cpu_sglang_bursty.txt
    python -m radixkv.bench fleet --requests 96 --seed 0,1,2 --routers radixkv:cost,sglang:cache_aware,\
        radixkv:round_robin --out benchmarks/results/fleet_cpu_sglang_spaced.txt
    python -m radixkv.bench fleet --requests 288 --seed 0,1 --routers radixkv:cost,radixkv:round_robin \
        --out benchmarks/results/fleet_cpu_spaced_288.txt

``--routers KIND:POLICY,...`` puts either radixkv's router (``radixkv:`` and one of its policies) or
sglang-router (``sglang:cache_aware``, ``cache_aware_low`` — its ``cache_aware`` with the balance
thresholds lowered to ``--balance-abs-threshold 2 --balance-rel-threshold 1.2`` —, ``round_robin``,
``random``, ``power_of_two``; ``pip install sglang-router``, run as its own process) in front; a
radixkv policy followed by ``+rebalance`` (``radixkv:cost+rebalance``) starts its router with
``--rebalance``, rule 9 of the cost policy (a waiting request moves to an instance that fell free).  Each
run starts fresh instances (in parallel) and sends every router the same prompts per seed
(``--seed`` takes a list).  A run on real instances does not repeat exactly (which instance a
request finds free, and when a prefill's events land, depend on timing), so ``--repeat N`` runs the
routers N times a seed, in turn, and gives every run, the means, and each router's hit rate less the
first router's, run by run.  sglang-router's ``/v1/completions`` takes text only, so the model
directory gets a word-per-id tokenizer (``radixkv.testing.word_tokenizer``), the instances start
with it, and every router is sent the prompts as words (radixkv's with ``--tokenizer``); each
served request's ``usage.prompt_tokens`` is checked to equal the drawn prompt's length.  The
requests each instance served are its own ``vllm:request_success`` counter.  A seed's table ends
with the hit rate no policy can pass on its prompts (every tenant's prefix computed once, on an
unbounded cache: the fleet-wide reuse the workload holds).

A production trace instead of the tenants (``--trace``, the Mooncake FAST'25 format that ``bench
fleet_sim`` reads: timestamps, ``input_length``, chained ``hash_ids``); the commands that produced
``benchmarks/results/fleet_cpu_conversation.txt`` and ``fleet_cpu_conversation_1gb.txt``, from a
folder holding Mooncake's conversation trace::

    python -m radixkv.bench fleet --trace conversation_trace.jsonl --requests 300 --rate 4 --seed 0,1 \
        --routers radixkv:cost,sglang:cache_aware,radixkv:round_robin --out .../fleet_cpu_conversation.txt
    python -m radixkv.bench fleet --trace conversation_trace.jsonl --requests 300 --rate 4 --seed 0,1 \
        --cpu-tier-mb 1024 --routers radixkv:cost,sglang:cache_aware,radixkv:round_robin \
        --out .../fleet_cpu_conversation_1gb.txt

Each seed takes another window of ``--requests`` consecutive rows (as ``fleet_sim`` does), each
hash id becomes one fixed block of ``--trace-tokens`` tokens (one vLLM block by default) drawn
from the id alone, so rows that share ids share those tokens as the trace's prefixes do; a prompt
is its ``input_length`` scaled by ``--trace-tokens`` over the trace's block (``--trace-block``, or
as its rows say), cut to the model's context less ``--max-tokens`` (the table's header counts the
prompts cut), and the trace's timestamps are scaled so that arrivals average ``--rate`` a second,
its bursts and lulls kept.  ``--tenants``, ``--system-tokens``, ``--question-tokens`` do not apply.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, NamedTuple

from radixkv.bench import Report, out_file
from radixkv.fleet.router import INSTANCE_HEADER, ROUTE_HEADER
from radixkv.fleet.routing import vllm_usable_blocks
from radixkv.tools._args import Parser, Refused

POLICIES = ("cost", "prefix", "cache_aware", "round_robin")
BLOCK = 128
#: The model every instance serves: its context, in tokens (a prompt and its answer fit in it).
CONTEXT = 4096
#: sglang-router's policies, each with the arguments it adds to ``launch_router``
SGLANG_POLICIES = {"cache_aware": (), "round_robin": (), "random": (), "power_of_two": (),
                   "cache_aware_low": ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2")}


#: A radixkv policy ending so starts its router with ``--rebalance`` (rule 9 of the cost policy).
REBALANCE = "+rebalance"


class RouterSpec(NamedTuple):
    """One router in front of the fleet: ``kind`` is ``radixkv`` or ``sglang``."""

    kind: str
    policy: str

    @property
    def name(self) -> str:
        """``kind:policy``, as ``--routers`` writes it and the tables label the router.  O(1)."""
        return f"{self.kind}:{self.policy}"


def parse_routers(text: str) -> list[RouterSpec]:
    """``--routers``: ``KIND:POLICY`` items, comma-separated; ``argparse.ArgumentTypeError`` names a bad one."""
    from radixkv.fleet.routing import POLICIES as RADIXKV_POLICIES

    known = {"radixkv": RADIXKV_POLICIES, "sglang": tuple(SGLANG_POLICIES)}
    out = []
    for item in text.split(","):
        kind, sep, policy = item.strip().partition(":")
        bare = policy.removesuffix(REBALANCE) if kind == "radixkv" else policy
        if not sep or kind not in known or bare not in known[kind]:
            raise argparse.ArgumentTypeError(
                f"--routers: {item!r} is not KIND:POLICY with " + "; ".join(
                    f"{k}: {', '.join(v)}" for k, v in known.items()) + f" (a radixkv policy may end {REBALANCE})")
        out.append(RouterSpec(kind, policy))
    return out


def parse_seeds(text: str) -> list[int]:
    """``--seed``: one seed or a comma-separated list of them."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed: give integers separated by commas, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m radixkv.bench fleet", description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1536)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--pool-blocks", type=int, default=72,
                   help="vLLM's KV pool per instance, in blocks of 128 (one of them vLLM's null block, which holds no "
                        "request's KV)")
    p.add_argument("--cpu-tier-mb", type=float, default=16.0)
    p.add_argument("--balance-abs", type=int, default=2, help="the router's --balance-abs (in flight per instance)")
    p.add_argument("--balance-rel", type=float, default=1.5, help="the router's --balance-rel")
    p.add_argument("--affinity", type=float, default=None,
                   help="radixkv's router's --affinity for its cost policy (default: by load)")
    p.add_argument("--seed", type=parse_seeds, default=[0], help="a seed, or several separated by commas")
    p.add_argument("--policies", default=",".join(POLICIES), help="the router policies to run, in order")
    p.add_argument("--routers", type=parse_routers, default=None,
                   help="KIND:POLICY,... (kind radixkv or sglang): each on fresh instances, the same text "
                        "prompts for all (instead of --policies; no run with an instance killed)")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --routers: run the routers this many times a seed, in turn (A, B, A, B, ...), each "
                        "run on fresh instances; the table gives every run, then the means with the comparisons "
                        "on them and each run's hit rate beside the same round's of the others")
    p.add_argument("--burst", type=int, default=1, help="requests of one tenant sent at once, per arrival")
    p.add_argument("--turns", type=int, default=1,
                   help="each request opens a conversation of this many turns: the next sent when the last "
                        "one's answer (all --max-tokens of it, greedy) ended, its prompt the last prompt, that "
                        "answer and a new --question-tokens question (not with --trace)")
    p.add_argument("--trace", default=None, help="a Mooncake-format trace (JSON lines) instead of the tenants")
    p.add_argument("--trace-block", type=int, default=None,
                   help="tokens a trace's hash id stands for in the trace (default: as its rows' lengths say)")
    p.add_argument("--trace-tokens", type=int, default=BLOCK,
                   help=f"tokens a trace's hash id becomes here (default {BLOCK}, one vLLM block)")
    p.add_argument("--no-kill", action="store_true", help="skip the run with an instance killed")
    p.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                   help="give each instance cores of its own (auto: when the machine has one per instance)")
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="write each run's requests (arrival, TTFT, outcome, instance and why: where radixkv's "
                        "router sent it and why; turn and conversation: the index of the request that opened it; "
                        "cached: the prompt tokens the instance served from cache) to DIR as JSON lines")
    p.add_argument("--out", type=out_file, default=None)
    return p


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples in ``text``."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _finished(text: str) -> float:
    """The requests an instance finished (``vllm:request_success``, neither aborted nor failed)."""
    return sum(float(m.group(2)) for m in re.finditer(
        r'^vllm:request_success_total\{[^}]*finished_reason="([^"]+)"[^}]*\} (\S+)$', text, re.M)
        if m.group(1) not in ("abort", "error"))


def _workload(args: argparse.Namespace, seed: int, run: int) -> list[tuple[float, list[int]]]:
    """(arrival time, prompt) per request: prompts of their own for each seed and run."""
    rng = random.Random(seed * 1000 + run)
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


def trace_workload(path: str, requests: int, seed: int, rate: float, block_tokens: int,
                   trace_block: int | None = None, limit: int = CONTEXT) -> tuple[list[tuple[float, list[int]]], int]:
    """``(work, cut)`` of a Mooncake-format trace (the module docstring): (arrival time, prompt) for
    ``requests`` consecutive rows, the window ``seed`` picks, and how many prompts were cut to
    ``limit`` tokens.  Each hash id is one block of ``block_tokens`` tokens drawn from the id alone
    (ids 1-998: the warm-up's id is never drawn); a row's prompt is its ids' blocks, as long as its
    ``input_length`` scaled by ``block_tokens / trace block`` (tokens past its ids' blocks, where a
    row's length says more than its ids, are drawn for that row alone); its arrival is the trace's
    timestamp scaled so that the rows average ``rate`` arrivals a second.  ``ValueError`` naming
    ``--trace`` for a file it cannot use.  O(prompt tokens)."""
    from radixkv.bench.fleet_sim import workload

    rows, trace_bt = workload("mooncake", requests, seed, path, trace_block)
    t0 = min(r.arrival for r in rows)
    span = max(r.arrival for r in rows) - t0
    scale = (len(rows) - 1) / (span * rate) if span > 0 else 0.0
    blocks: dict[Any, list[int]] = {}
    work, cut = [], 0
    for i, r in enumerate(rows):
        length = max(1, round(r.tokens * block_tokens / trace_bt))
        if length > limit:
            length, cut = limit, cut + 1
        prompt: list[int] = []
        for h in r.blocks:
            if len(prompt) >= length:
                break
            if h not in blocks:
                rng = random.Random(f"radixkv-trace-block:{h!r}")
                blocks[h] = [rng.randrange(1, 999) for _ in range(block_tokens)]
            prompt += blocks[h]
        own = random.Random(f"radixkv-trace-row:{seed}:{i}")
        prompt += [own.randrange(1, 999) for _ in range(length - len(prompt))]
        work.append(((r.arrival - t0) * scale, prompt[:length]))
    return work, cut


def _work(args: argparse.Namespace, seed: int) -> tuple[list[tuple[float, list[int]]], int]:
    """``(work, prompts cut)`` of a seed: the trace's (``trace_workload``) or the tenants'."""
    if args.trace is not None:
        return trace_workload(args.trace, args.requests, seed, args.rate, args.trace_tokens, args.trace_block,
                              limit=CONTEXT - args.max_tokens)
    return _workload(args, seed, 0), 0


def reuse_bound(work: list[tuple[float, list[int]]], block: int = BLOCK,
                answers: list[list[int]] | None = None) -> float:
    """The prefix hit rate no router can pass on ``work``: each request hits at most the whole
    blocks it shares with an earlier prompt (or, given each request's ``answers``, with an earlier
    prompt and what it generated, but the last token: vLLM caches the blocks a request generated),
    short of its last token (vLLM computes that one always), as one unbounded cache shared by the
    fleet would give.  ``O(total tokens x blocks)``."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for k, (_, prompt) in sorted(enumerate(work), key=lambda item: item[1][0]):
        total += len(prompt)
        shared = 0
        for end in range(block, len(prompt) + 1, block):
            if tuple(prompt[:end]) in seen and end < len(prompt):
                shared = end
        hits += shared
        sequence = prompt + (answers[k][:-1] if answers is not None else [])
        seen.update(tuple(sequence[:end]) for end in range(block, len(sequence) + 1, block))
    return hits / total if total else 0.0


def question(args: argparse.Namespace, seed: int, i: int, turn: int) -> list[int]:
    """The question of turn ``turn`` of request ``i``'s conversation (``--turns``): ``--question-tokens``
    ids drawn from the seed, the request and the turn alone, the same for every router.  O(tokens)."""
    rng = random.Random(f"radixkv-fleet-turn:{seed}:{i}:{turn}")
    return [rng.randrange(1, 999) for _ in range(args.question_tokens)]


def dump_record(res: dict[str, Any], k: int) -> dict[str, Any]:
    """Request ``k``'s line of ``--dump``, from its result ``res`` (``_drive``'s): its arrival (s
    after the start), prompt length, outcome, TTFT, the instance that served it and ``why`` the
    router sent it there (radixkv's router names both, ``ROUTE_HEADER``; ``None`` behind another
    router), its turn and conversation (a request without turns is conversation ``k``, turn 0),
    and ``cached``: the prompt tokens the instance reported it served from cache
    (``usage.prompt_tokens_details.cached_tokens``; ``None`` where the request got no answer or
    the instance did not say).  O(1)."""
    usage = res.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"arrival": res.get("arrival"), "tokens": res.get("tokens"), "outcome": res.get("outcome"),
            "ttft": res.get("ttft"), "instance": res.get("instance"), "why": res.get("why"),
            "turn": res.get("turn", 0), "conversation": res.get("conversation", k),
            "cached": cached if isinstance(cached, int) else None}


def moved_turns(results: list[dict[str, Any]]) -> dict[str, int] | None:
    """The later turns of ``results``' conversations (``_drive``'s, turn > 0) that went to another
    instance than the turn before them, counted by why the router sent them there (its
    ``ROUTE_HEADER``; ``count_moves``).  A moved turn computes its conversation again where it
    lands.  O(results)."""
    where = {(res.get("conversation", k), res.get("turn", 0)): (res.get("instance"), res.get("why"))
             for k, res in enumerate(results)}
    return count_moves((where[(c, t - 1)][0], inst, why) for (c, t), (inst, why) in where.items()
                       if t and (c, t - 1) in where)


def count_moves(turns: Iterable[tuple[Any, Any, str | None]]) -> dict[str, int] | None:
    """``(instance of the turn before, instance, why)`` for each later turn of a conversation: the
    turns whose instance differs from the turn before's, by ``why`` (``"unknown"`` where the router
    gave none); turns where either instance is unknown (``None``) are left out, and ``None`` when
    no turn is left (another router names no instance, or there are no later turns).  What
    ``bench fleet`` and ``fleet_sim`` both count.  O(turns)."""
    moved: dict[str, int] | None = None
    for before, inst, why in turns:
        if before is None or inst is None:
            continue
        moved = {} if moved is None else moved
        if inst != before:
            moved[why or "unknown"] = moved.get(why or "unknown", 0) + 1
    return moved


def moved_text(moved: dict[str, int] | None) -> str:
    """A row's ending for ``count_moves``'s answer: ``"  moved 4 (fit 3, cost 1)"``, ``"  moved
    0"``, or ``""`` for ``None``.  O(reasons)."""
    if moved is None:
        return ""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(moved.items()))
    return f"  moved {sum(moved.values())}" + (f" ({reasons})" if reasons else "")


async def _drive(router_url: str, model: str, work: list[tuple[float, list[int]]], max_tokens: int,
                 kill_at: int | None, kill: Any, as_text: bool = False, turns: int = 1,
                 question: Any = None) -> list[dict[str, Any]]:
    """Send every request at its arrival time (as words of ``radixkv.testing.word_tokenizer`` when
    ``as_text``); per request its outcome, TTFT, usage, arrival (s after the start) and prompt
    length.  With ``turns`` > 1 each request opens a conversation (``conversation``): its next
    turns' results follow the first turns' in the order they were sent."""
    import aiohttp

    from radixkv.testing.word_tokenizer import words

    results: list[dict[str, Any]] = [{} for _ in work]
    start = time.perf_counter()
    talk = turns > 1

    async def one(res: dict[str, Any], prompt: list[int], session: aiohttp.ClientSession) -> list[int]:
        """Send ``prompt``, fill ``res``; the token ids it generated (asked for in a conversation)."""
        t0 = time.perf_counter()
        res.update(arrival=t0 - start, tokens=len(prompt))
        if talk:
            res["_prompt"] = prompt
        body: dict[str, Any] = {"model": model, "prompt": words(prompt) if as_text else prompt,
                                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if talk:        # the answer's ids, all max_tokens of them, the same for every router (greedy)
            body.update(return_token_ids=True, ignore_eos=True, temperature=0.0)
            if as_text:     # id 0 is the word tokenizer's unknown word, which no prompt can say
                body["logit_bias"] = {"0": -100}
        generated: list[int] = []
        try:
            async with session.post(f"{router_url}/v1/completions", json=body) as r:
                res["instance"] = r.headers.get(INSTANCE_HEADER)     # radixkv's router names it
                res["why"] = r.headers.get(ROUTE_HEADER)             # and why it went there
                if r.status != 200:
                    res.update(outcome="error", status=r.status)
                    await r.read()
                    return generated
                text, first = "", None
                async for piece in r.content.iter_any():
                    text += piece.decode(errors="replace")
                    # the first event that carries data, not the first bytes: a router that sent
                    # headers' worth of padding or a keep-alive comment early would not count
                    if first is None and "data: {" in text:
                        first = time.perf_counter() - t0
                lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: {")]
                events = [json.loads(x) for x in lines]
                usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
                bad = any("error" in e for e in events) or not text.rstrip().endswith("[DONE]")
                res.update(outcome="error" if bad else "served", ttft=first, usage=usage)
                if not bad:             # an answer cut short by an error ends its conversation
                    generated = [t for e in events for c in e.get("choices") or () for t in c.get("token_ids") or ()]
                if talk:
                    res["_answer"] = generated
        except Exception as exc:  # noqa: BLE001 - a lost request is what this run counts
            res.update(outcome="lost", error=type(exc).__name__)
        return generated

    later: list[dict[str, Any]] = []        # the later turns' results, as they are sent

    async def conversation(i: int, prompt: list[int], session: aiohttp.ClientSession) -> None:
        """Request ``i``'s turns: each next one sent when the last one's answer ended, its prompt
        the last prompt, that answer and ``question(i, turn)``; a turn that failed ends it."""
        answer = await one(results[i], prompt, session)
        for turn in range(1, turns):
            if len(answer) != max_tokens or (as_text and 0 in answer):
                return
            prompt = prompt + answer + question(i, turn)
            res = {"conversation": i, "turn": turn}
            later.append(res)
            answer = await one(res, prompt, session)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        for i, (at, prompt) in enumerate(work):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if kill_at is not None and i == kill_at:
                kill()
            tasks.append(asyncio.create_task(conversation(i, prompt, session)))
        await asyncio.gather(*tasks)
    results += sorted(later, key=lambda r: r["arrival"])
    results[0]["_wall"] = time.perf_counter() - start
    return results


def _start_router(args: argparse.Namespace, urls: list[str], events: list[str], spec: RouterSpec,
                  port: int, log_path: str, tokenizer: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``spec``'s router on 127.0.0.1:``port`` and wait until it answers."""
    from radixkv.tools.s3server import free_port, stop_process

    if spec.kind == "sglang":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", spec.policy.removesuffix("_low"),
               *SGLANG_POLICIES[spec.policy], "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1", "--log-level", "warn"]
        ready = f"http://127.0.0.1:{port}/v1/models"
    else:
        cmd = [sys.executable, "-m", "radixkv", "route", "--port", str(port),
               "--policy", spec.policy.removesuffix(REBALANCE), "--cost-profile", "vllm-cpu",
               "--block-size", str(BLOCK), "--balance-abs", str(args.balance_abs),
               "--balance-rel", str(args.balance_rel)]
        if spec.policy.endswith(REBALANCE):
            cmd.append("--rebalance")
        if args.affinity is not None:
            cmd += ["--affinity", str(args.affinity)]
        for url, ep in zip(urls, events):
            cmd += ["--backend", url, "--events", ep]
        if tokenizer is not None:
            cmd += ["--tokenizer", tokenizer]
        ready = f"http://127.0.0.1:{port}/health"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                answer = _get(ready, 1.0)
                if spec.kind == "sglang" or "healthy" in answer:
                    return proc
            except OSError:
                time.sleep(0.2)
            if proc.poll() is not None:
                break
    except BaseException:                   # a SIGTERM or Ctrl-C while it starts: it is not left running
        stop_process(proc)
        raise
    stop_process(proc)
    raise RuntimeError(f"the router did not start; see {log_path}")


def cores(instances: int, pin: str, available: list[int] | None = None) -> list[list[int]] | None:
    """Each instance's cores (``--pin``): the machine's cores split into ``instances`` runs of equal
    size (the rest left to the router and the client); ``None`` to leave them unpinned (``off``,
    or ``auto`` on a machine with fewer cores than instances).  ``on`` with too few cores:
    ``ValueError``.  O(cores)."""
    cpus = sorted(os.sched_getaffinity(0)) if available is None else sorted(available)
    if pin == "off" or (pin == "auto" and len(cpus) < instances):
        return None
    if len(cpus) < instances:
        raise ValueError(f"--pin on: {instances} instances need a core each, this machine has {len(cpus)}")
    each = len(cpus) // instances
    return [cpus[k * each:(k + 1) * each] for k in range(instances)]


def _servers(args: argparse.Namespace, model: str, events: list[str], tokenizer: bool) -> list[Any]:
    from radixkv.testing.vllm_server import VllmServer

    given = cores(len(events), args.pin)
    pinned: list[list[int] | None] = list(given) if given is not None else [None] * len(events)
    return [VllmServer(model, connector={"chunk_size": 256, "local_cpu": True,
                                         "max_local_cpu_size": args.cpu_tier_mb / 1024},
                       kv_events=ep, block_size=BLOCK, max_model_len=CONTEXT, skip_tokenizer_init=not tokenizer,
                       extra_args=("--num-gpu-blocks-override", str(args.pool_blocks)), cpus=cpus)
            for ep, cpus in zip(events, pinned)]


def _start_all(servers: list[Any], text: bool = False) -> float:
    """Start ``servers`` in parallel (all stopped if one fails) and warm each up; the seconds it took."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        try:
            for f in futures:
                f.result()
            for f in [pool.submit(_warm, s, text) for s in servers]:
                f.result()
        except BaseException:
            _stop_all(servers)
            raise
    return time.perf_counter() - t0


def _stop_all(servers: list[Any]) -> None:
    """Stop ``servers`` at once (each gets 5 s to end before a SIGKILL): at most about 5 s."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda s: s.stop(), servers))


#: The warm-up prompt: a token id the workload never draws (its ids are 1-998), as long as a request.
WARM_ID, WARM_TOKENS = 999, 1600


def _warm(server: Any, text: bool) -> None:
    """One request straight to ``server`` (a fresh engine's first prefill pays for its first-time
    allocations: without it the slowest request of a run was one of its first), then its prefix
    cache emptied; before the router starts and before the counters are read, so neither sees it."""
    from radixkv.testing.word_tokenizer import words

    prompt: Any = [WARM_ID] * WARM_TOKENS
    body = json.dumps({"model": server.model, "prompt": words(prompt) if text else prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    server.reset_prefix_cache()


def _measure(args: argparse.Namespace, model: str, servers: list[Any], events: list[str], spec: RouterSpec,
             work: list[tuple[float, list[int]]], log: str, kill: bool = False, text: bool = False,
             seed: int = 0, run: int | None = None) -> dict[str, Any]:
    """One run of ``work`` through ``spec``'s router in front of ``servers``: its table row (and,
    with ``--dump``, its requests in ``DIR/<router>-seed<seed>.jsonl``, or with ``run`` (``--repeat``)
    ``DIR/<router>-seed<seed>-run<run>.jsonl``)."""
    from radixkv.tools.s3server import free_port, stop_process

    port = free_port()
    router = _start_router(args, [s.url for s in servers], events, spec, port, log,
                           tokenizer=model if text else None)
    try:
        time.sleep(1.0)                          # subscriptions joined
        live = [s for s in servers if s.process is not None and s.process.poll() is None]
        before = {s.url: s.metrics() for s in live}
        results = asyncio.run(_drive(f"http://127.0.0.1:{port}", model, work, args.max_tokens,
                                     len(work) // 2 if kill else None, servers[0].kill, as_text=text,
                                     turns=args.turns, question=lambda i, turn: question(args, seed, i, turn)))
        after = {s.url: s.metrics() for s in live if s.process is not None and s.process.poll() is None}
        routed = _get(f"http://127.0.0.1:{port}/metrics") if spec.kind == "radixkv" else ""
    finally:
        stop_process(router)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        name = spec.name.replace(":", "_") + ("-killed" if kill else "")
        with open(os.path.join(args.dump, f"{name}-seed{seed}{'' if run is None else f'-run{run}'}.jsonl"), "w") as f:
            for k, res in enumerate(results):       # the first turns in the order sent, then the later ones
                f.write(json.dumps(dump_record(res, k)) + "\n")
    if text:
        _check_prompt_tokens(results)
    row = _row(spec.name if text else spec.policy + (" (instance killed)" if kill else ""),
               results, before, after, routed)
    if args.turns > 1:          # what these conversations sent, with the answers they were sent after
        row["bound"] = reuse_bound([(r["arrival"], r["_prompt"]) for r in results if "_prompt" in r],
                                   answers=[r.get("_answer", []) for r in results if "_prompt" in r])
    print(f"[{row['name']}: GPU hit {row['gpu_hit']:.1%}, per instance {row['served_by']}, "
          f"outcomes {row['outcomes']}]", file=sys.stderr, flush=True)
    return row


def _check_prompt_tokens(results: list[dict[str, Any]]) -> None:
    """Every served request's ``usage.prompt_tokens`` is its prompt's length (a conversation's
    later turns included): the text reached the instance as exactly the tokens sent."""
    for i, res in enumerate(results):
        if res.get("outcome") == "served":
            got = (res.get("usage") or {}).get("prompt_tokens")
            if got != res["tokens"]:
                raise AssertionError(f"request {i}: the instance counted {got} prompt tokens, sent {res['tokens']}")


def refuse(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first flag whose value the run cannot use, before anything starts
    (no server, no file).  O(flags)."""
    from radixkv.fleet.routing import Chooser

    for flag, value, least in (("--instances", args.instances, 1), ("--tenants", args.tenants, 1),
                               ("--system-tokens", args.system_tokens, 1), ("--question-tokens", args.question_tokens, 1),
                               ("--requests", args.requests, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--pool-blocks", args.pool_blocks, 1), ("--burst", args.burst, 1),
                               ("--turns", args.turns, 1), ("--repeat", args.repeat, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if args.pool_blocks * BLOCK <= CONTEXT:          # vLLM refuses to start a pool that holds no whole context
        raise ValueError(f"--pool-blocks must be at least {CONTEXT // BLOCK + 1} (vLLM needs a pool that holds one "
                         f"request of the model's {CONTEXT}-token context and a block more, its null block), got {args.pool_blocks}")
    if args.repeat > 1 and args.routers is None:
        raise ValueError(f"--repeat: only with --routers (each run of --policies starts its own instances "
                         f"too, but its rows are not averaged), got --repeat {args.repeat}")
    if args.turns > 1 and args.trace is not None:
        raise ValueError("--turns: a trace's rows are not conversations, so not with --trace")
    if not 0.0 < args.rate < float("inf"):
        raise ValueError(f"--rate must be a finite number above 0, got {args.rate}")
    if not 0.0 <= args.cpu_tier_mb < float("inf"):
        raise ValueError(f"--cpu-tier-mb must be a finite number at least 0, got {args.cpu_tier_mb}")
    if args.trace is not None:
        if args.burst != 1:
            raise ValueError(f"--burst: a trace brings its own arrivals, got --burst {args.burst} with --trace")
        for flag, value in (("--trace-tokens", args.trace_tokens), ("--trace-block", args.trace_block)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if args.trace_tokens + args.max_tokens > CONTEXT:
            raise ValueError(f"--trace-tokens + --max-tokens must fit the model's context of {CONTEXT} tokens, "
                             f"got {args.trace_tokens + args.max_tokens}")
        from radixkv.bench.fleet_sim import read_trace

        read_trace(args.trace)                  # a file it cannot use is refused before any server starts
    elif args.system_tokens + args.turns * (args.question_tokens + args.max_tokens) > CONTEXT:
        raise ValueError(f"--system-tokens + --turns x (--question-tokens + --max-tokens) must fit the model's "
                         f"context of {CONTEXT} tokens, got "
                         f"{args.system_tokens + args.turns * (args.question_tokens + args.max_tokens)}")
    if any(seed < 0 for seed in args.seed):
        raise ValueError(f"--seed: seeds are at least 0, got {args.seed}")
    # the router's own checks (the one it will run), named by this command's flags
    flags = {"policy": "--policies", "balance_abs": "--balance-abs", "balance_rel": "--balance-rel",
             "affinity": "--affinity"}
    for policy in args.policies.split(","):
        try:
            Chooser(policy, balance_abs=args.balance_abs, balance_rel=args.balance_rel, affinity=args.affinity)
        except ValueError as exc:
            name = str(exc).split()[0]
            raise ValueError(f"{flags.get(name, name)}: {exc}") from None
    if args.dump is not None and os.path.exists(args.dump) and not os.path.isdir(args.dump):
        raise ValueError(f"--dump: {args.dump!r} is not a folder")


def main(argv: list[str] | None = None) -> int:
    """The command (the module docstring): a refused flag or value is one line on stderr and exit
    status 2, before any server starts; a server that fails to start is one line naming the first
    exception in its log and the log's path, exit status 1; a SIGTERM stops the servers it
    started."""
    try:
        args = _parser().parse_args(argv)
        refuse(args)
        pinned = cores(args.instances, args.pin)
    except Refused as exc:
        print(exc, file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"python -m radixkv.bench fleet: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, argv, pinned)
    except RuntimeError as exc:
        if not str(exc).startswith("vllm serve"):
            raise
        print(f"python -m radixkv.bench fleet: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, argv: list[str] | None, pinned: list[list[int]] | None) -> int:
    """The runs of ``main``, its arguments checked.  ``RuntimeError`` when a server fails to start."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # a SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so every started server is stopped
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from radixkv.integrations.transformers import random_model
    from radixkv.tools.s3server import listen_port
    from radixkv.testing.word_tokenizer import save_word_tokenizer

    report = Report("fleet", argv)
    tmp = tempfile.mkdtemp(prefix="radixkv-fleet-")
    model = os.path.join(tmp, "model")
    random_model("llama", seed=0, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=1000, max_positions=CONTEXT).save_pretrained(model)
    pinning = ("unpinned: the instances share the machine's cores" if pinned is None else
               "each pinned to cores of its own: " + " | ".join(",".join(map(str, c)) for c in pinned))
    front = ("python -m radixkv route (--balance-abs {a} --balance-rel {r:g})" if args.routers is None else
             "each router in turn (radixkv's: --balance-abs {a} --balance-rel {r:g}, --tokenizer; fresh "
             "instances per run, started in parallel; prompts sent as text of a word-per-id tokenizer)")
    report(f"# {args.instances} vllm serve (vllm-cpu, random Llama 2x256, fp32, block {BLOCK}, pool "
           f"{args.pool_blocks} blocks = {args.pool_blocks * BLOCK} tokens each ({vllm_usable_blocks(args.pool_blocks)} for requests: "
           f"vLLM keeps a null block), radixkv CPU tier "
           f"{args.cpu_tier_mb:g} MB each, KV events on; {pinning}) behind "
           + front.format(a=args.balance_abs, r=args.balance_rel))
    works = {seed: _work(args, seed) for seed in args.seed}
    if args.trace is None:
        report(f"# workload: {args.tenants} tenants x {args.system_tokens}-token system prompt + "
               f"{args.question_tokens}-token question, {args.requests} requests, Poisson {args.rate:g}/s"
               f"{f' in bursts of {args.burst}' if args.burst > 1 else ''}, "
               f"max_tokens {args.max_tokens}, streamed"
               + (f"; each request opens a conversation of {args.turns} turns, the next sent when the last "
                  f"one's answer ended: the last prompt, that answer (greedy, all max_tokens) and a new "
                  f"{args.question_tokens}-token question" if args.turns > 1 else ""))
    else:
        import hashlib

        with open(args.trace, "rb") as f:
            md5 = hashlib.md5(f.read()).hexdigest()
        lengths = sorted(len(p) for w, _ in works.values() for _, p in w)
        report(f"# workload: trace {os.path.basename(args.trace)} (md5 {md5}), {args.requests} consecutive rows "
               f"a seed, each hash id {args.trace_tokens} tokens, arrivals scaled to {args.rate:g}/s; prompts of "
               f"{lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
               + ", ".join(f"{cut} cut to the context on seed {seed}" for seed, (_, cut) in works.items())
               + f"; max_tokens {args.max_tokens}, streamed")
    log = os.path.join(tmp, "router.log")
    if args.routers is not None:
        save_word_tokenizer(model, 1000)
        for seed in args.seed:
            work = works[seed][0]
            rows: list[dict[str, Any]] = []
            for run in range(args.repeat):          # in turn, so that a slow spell of the machine hits each
                for spec in args.routers:
                    events = [f"tcp://127.0.0.1:{listen_port()}" for _ in range(args.instances)]
                    servers = _servers(args, model, events, tokenizer=True)
                    up = _start_all(servers, text=True)
                    try:
                        row = _measure(args, model, servers, events, spec, work, log, text=True, seed=seed,
                                       run=run + 1 if args.repeat > 1 else None)
                        rows.append({**row, "up": up, "run": run + 1})
                    finally:
                        _stop_all(servers)
            report()
            ups = ", ".join(f"{r['up']:.0f}" for r in rows)
            report(f"## seed {seed}: servers up in {ups} s")
            bound = _bound(report, rows, work)
            if args.repeat == 1:
                _table(report, rows, bound)
                continue
            _table(report, [{**r, "name": f"{r['name']} (run {r['run']})"} for r in rows])
            report()
            report(f"### seed {seed}: means over {args.repeat} runs (outcomes and routed summed; per instance: "
                   f"each run's busiest first, summed)")
            _table(report, means(rows), bound)
            report()
            for line in paired(rows):
                report(line)
        report.save(args.out)
        return 0
    for seed in args.seed:
        # every policy on the same prompts, each on fresh instances (the same cold state)
        work = works[seed][0]
        rows = []
        times: list[float] = []
        policies = args.policies.split(",")
        runs = [(p, False) for p in policies] + ([] if args.no_kill or args.instances < 2 else [(policies[0], True)])
        for policy, kill in runs:
            events = [f"tcp://127.0.0.1:{listen_port()}" for _ in range(args.instances)]
            servers = _servers(args, model, events, tokenizer=False)
            times.append(_start_all(servers))
            try:
                rows.append(_measure(args, model, servers, events, RouterSpec("radixkv", policy), work, log, kill=kill,
                                     seed=seed))
            finally:
                _stop_all(servers)
        report()
        report(f"## seed {seed}: servers up in {', '.join(f'{u:.0f}' for u in times)} s")
        _table(report, rows, _bound(report, rows, work))
    report.save(args.out)
    return 0


def means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per router (in the order of its first run) with the means of its runs' hit rates,
    TTFTs, requests a second and preemptions, and the sums of their outcomes, routing reasons and
    requests per instance, the busiest of each run first (``_table``'s fields).  O(rows)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["name"], []).append(r)
    out = []
    for name, runs in by.items():
        row: dict[str, Any] = {"name": name, "partial": any(r["partial"] for r in runs)}
        for key in ("gpu_hit", "all_hit", "p50", "p95", "p99", "rps"):
            row[key] = statistics.fmean(r[key] for r in runs)
        row["preempted"] = round(statistics.fmean(r["preempted"] for r in runs))
        row["outcomes"] = {k: sum(r["outcomes"][k] for r in runs) for k in runs[0]["outcomes"]}
        # each run's instances are fresh ones: their order means nothing, so the busiest first
        row["served_by"] = [sum(col) for col in zip(*(sorted(r["served_by"], reverse=True) for r in runs))]
        reasons: dict[str, float] = {}
        for r in runs:
            for k, v in r["reasons"].items():
                reasons[k] = reasons.get(k, 0.0) + v
        row["reasons"] = reasons
        moves: list[dict[str, int]] = [r["moved"] for r in runs if r.get("moved") is not None]
        if moves:
            row["moved"] = {k: sum(m.get(k, 0) for m in moves) for k in sorted({k for m in moves for k in m})}
        out.append(row)
    return out


def paired(rows: list[dict[str, Any]]) -> list[str]:
    """For each router after the first, its GPU hit rate less the first router's, run by run (the
    runs of one round went one after the other), with their mean and range: a difference that
    holds across the machine's slow and fast spells.  O(rows)."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    rounds: dict[int, dict[str, float]] = {}
    for r in rows:
        rounds.setdefault(r["run"], {})[r["name"]] = r["gpu_hit"]
    lines = []
    for name in names[1:]:
        diffs = [100 * (hits[names[0]] - hits[name]) for _, hits in sorted(rounds.items())
                 if name in hits and names[0] in hits]
        if diffs:
            lines.append(f"{names[0]} - {name}, GPU hit rate run by run: "
                         + " / ".join(f"{d:+.1f}" for d in diffs)
                         + f" points (mean {statistics.fmean(diffs):+.1f}, {min(diffs):+.1f} to {max(diffs):+.1f})")
    return lines


def _bound(report: Report, rows: list[dict[str, Any]], work: list[tuple[float, list[int]]]) -> float:
    """The seed's reuse bound: the prompts' (``reuse_bound``), or with ``--turns`` what the runs'
    conversations sent (the largest where greedy answers differed between runs, which is said).
    O(rows)."""
    bounds = sorted({round(r["bound"], 4) for r in rows if "bound" in r})
    if len(bounds) > 1:
        report("# the runs' conversations differed: reuse bounds " + ", ".join(f"{b:.1%}" for b in bounds))
    return max(bounds) if bounds else reuse_bound(work)


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
    served_by = [round(_finished(after[u]) - _finished(before[u])) for u in after]
    return {"name": name, "gpu_hit": hits / queries if queries else 0.0,
            "preempted": round(delta("vllm:num_preemptions_total")),
            "all_hit": (hits + external) / queries if queries else 0.0,
            "p50": statistics.median(ttfts) if ttfts else float("nan"),
            "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan"),
            "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
            "served_by": served_by,
            "rps": len(results) / results[0]["_wall"], "outcomes": outcomes, "reasons": reasons,
            "moved": moved_turns(results), "partial": bool(set(before) - set(after))}


def _table(report: Report, rows: list[dict[str, Any]], bound: float | None = None) -> None:
    report()
    report(f"{'router':<28} {'GPU hit':>8} {'+ tiers':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'TTFT p99':>9} "
           f"{'req/s':>6}  served/error/lost  per instance  routed")
    for r in rows:
        o = r["outcomes"]
        reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["reasons"].items())) or "-"
        # later turns sent to another instance than the turn before, by reason
        note = moved_text(r.get("moved")) + (" (hit rates: the surviving instance)" if r["partial"] else "")
        report(f"{r['name']:<28} {r['gpu_hit']:>8.1%} {r['all_hit']:>8.1%} {r['p50'] * 1e3:>7.0f}ms "
               f"{r['p95'] * 1e3:>7.0f}ms {r['p99'] * 1e3:>7.0f}ms {r['rps']:>6.2f}  "
               f"{o['served']}/{o['error']}/{o['lost']}  {'/'.join(map(str, r['served_by']))}  {reasons}  "
               f"preempted {r['preempted']}{note}")
    base = {r["name"]: r for r in rows}
    for ref in ("round_robin", "radixkv:round_robin", "sglang:round_robin", "sglang:cache_aware"):
        if ref not in base:
            continue
        rr = base[ref]
        report()
        for r in rows:
            if r is rr or r["name"].endswith("round_robin") or (ref.startswith("sglang") and not r["name"].startswith("radixkv")):
                continue
            report(f"{r['name']} vs {ref}: GPU hit rate {r['gpu_hit']:.1%} vs {rr['gpu_hit']:.1%} "
                   f"({r['gpu_hit'] / rr['gpu_hit'] if rr['gpu_hit'] else float('inf'):.2f}x), TTFT p50 "
                   f"{rr['p50'] / r['p50']:.2f}x lower, p95 {rr['p95'] / r['p95']:.2f}x lower, "
                   f"p99 {rr['p99'] / r['p99']:.2f}x lower")
    if bound is not None:
        report()
        report(f"the prompts' reuse bound (one unbounded cache for the fleet): {bound:.1%}")
