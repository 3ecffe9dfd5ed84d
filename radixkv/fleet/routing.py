"""How a router chooses an instance: the policies, what it has just sent where, the cost model.

This module is the router's decision and nothing else (no sockets, no clock of its own), so
that the HTTP proxy (``radixkv.fleet.router``) and the fleet simulator (``python -m radixkv.bench
fleet_sim``) run the same code.  The caller keeps one ``Backend`` per instance and tells the
``Chooser`` what happens to each request: ``choose`` (where to send it), ``sent`` (it went),
``prefilled`` (its first token came back), ``ended`` (its last one did).

Contract:

* **Holdings.**  An instance holds a prompt's leading blocks on a *medium* as the fleet index says
  (``radixkv.fleet.Index``: ``GPU``, ``CPU``, ``STORAGE``), or because the router sent it a prompt
  with those blocks lately (``Recent``): a prompt counts as arriving at its instance at routing
  time, as the GPU medium, until the instance's KV events can confirm it (``settle_s`` after its
  first token) or ``ttl_s`` passes.  KV events come after a prefill, so without this every
  request of a burst would look like a miss and scatter.
* **Policies.**

  - ``cost`` (the default): the instance where the request's expected time to first token is
    least.  Each instance's cost is ``queue + decode + weight x own + dup``, and then three rules
    (5 to 7) may put another instance first, each in turn.  In order:

    1. **Queue and decode.**  ``queue`` is the prefill time (``CostModel.prefill``) of the tokens
       the router sent the instance that have not had their first token yet (their uncached
       tokens, as estimated at routing).  ``decode`` is what its decoding requests add to each
       engine step (``budget`` prompt tokens a step) until this prefill ends.
    2. **Own.**  ``own`` is the request's own prefill there: loading the prefix from the fastest
       place it is (the instance's own medium; with ``p2p``, any peer's that the index says holds
       it, not one the router only sent it to; with ``shared``, a tier every instance reads), plus
       computing the rest.
    3. **Weight.**  ``affinity`` >= 1 weighs the work a choice adds to the fleet above the queue it
       waits in (1 is plain expected TTFT).  By default it follows the load: ``Chooser.load`` is
       the fraction of instances with prefill queued, averaged over the last ``LOAD_ARRIVALS``
       arrivals an instance (sampled at arrivals, so on Poisson arrivals the time average; under
       bursts more, as a burst's later requests see the fleet its first ones made busy: 0.8-0.9
       where the time average was 0.3-0.5 on three workload shapes with bursts of 8 and 16 at 4
       instances and half load, and a load averaged over time met fewer shapes' cells,
       docs/pages/fleet-rules.md), and
       ``auto_affinity`` maps it from 1 on an idle fleet to ``AUTO_MAX`` when every instance always
       has a queue, and past two thirds of the load to the queue's own growth, ``1 / (1 -
       load)``, at most ``AUTO_CAP``.  On a lightly loaded fleet a request goes where it starts
       soonest; on a busy one the work it adds, which every later request waits behind, counts
       more, so a prefix is computed once rather than on every instance.  Why the average, not the
       fraction at this moment: on two instances that fraction is 1/2 whenever one of them works,
       so at 10% load a request waited behind another tenant's cold prefill on its prefix's holder
       rather than compute the prefix on the idle instance.  Why the ``1 / (1 - load)`` part: a
       linear rule alone kept diverting a production chat trace's long follow-up turns from their
       holders at 95% load, losing hits the saturated fleet then queued behind.
       An instance with nothing in flight weighs its work at ``weight = (1 + affinity) / 2``:
       work on an idle instance delays only what arrives there while it runs, not a queue, so a
       hot prefix spreads to idle instances instead of queueing on its holder.  Not 1: at high
       load an idle instance does not stay idle, and at weight 1, 16 instances at 95% load copied
       tenants onto whichever instance fell idle and queued more than ``cache_aware``.
    4. **Work under way.**  ``dup`` charges computing what another instance is computing for this
       prompt right now (the router sent it there; the index does not show it yet, as KV events
       come after the engine step that computes it): that prefill times the load at this moment
       (``auto_affinity`` of the fraction busy now) less the instance's weight, divided by 1 + the
       instances idle beside the candidate.  Computing it again doubles work already under way,
       so a burst follows its first request on a lightly loaded fleet too, unless idle instances
       are there to absorb the copy.  Not charged when the prompt's requests are a *stream*
       (``Chooser._stream``): the router began sending it there at least ``STREAM_AFTER`` of its
       expected prefill ago, requests for it still arrive, and its share of the arrivals calls
       for another holder (``Demand``, rule 6).  A burst's requests arrive at once; a stream's
       keep coming while the first prefill runs, and on workload shapes drawn at random, a prompt
       every request shared queued behind that prefill on one instance while others stood idle.
    5. **Sooner when idle** (``why`` is ``"idle"``).  When a busy instance has the least cost, an
       idle instance that gives the request its first token sooner than every instance with
       requests in flight (the expected TTFT unweighted, with ``dup``) goes first, unless that
       gives up a prefix fewer than two healthy instances hold.  The weight is for work later
       requests wait behind, and while busy instances queue, an idle one's work delays no one.
       Without it, on workload shapes drawn at random (``fleet_sim`` ``shapeK``), a prompt every
       request shares stayed on the instances that first held it: half of 16 instances idle at
       50% load, p50 7x round-robin's (their pools full and their decodes long, which the queue
       of prefill tokens does not show).  The exception keeps a session's follow-up turn, held by one instance,
       there: without it a production-style trace at 30% load lost hits.
    6. **Copy** (``why`` is ``"copy"``).  When the first choice holds the prompt's prefix, the
       index shows it computed, and fewer instances hold it than its share of the arrivals calls
       for, the instance that does not hold it and gives the first token soonest, among those
       that wait less than the first, goes first.  The share (``Demand``) is that of the last
       ``LOAD_ARRIVALS`` arrivals an instance, decayed, whose prompt held the prefix; times the
       instances, rounded up once two instances hold it, it is the holders the prefix calls for
       (``_calls_for_another``).  Each length of the prefix that an instance holds is asked,
       longest first: a fleet-wide system prompt before a tenant's, which instances hold alone,
       is shared by more arrivals than the whole, and calls for more holders.  The cost of
       computing a prefix again is paid once and repaid by every later request that the new
       holder takes off the others: a prompt nearly every request shares belongs on every
       instance, one tenant's among sixteen on one.  Without it, on workload shapes drawn at
       random, one system prompt that nearly every request shared stayed on the instances that
       first held it while others served nothing (their pools filled with requests in flight,
       which no queue of prefill tokens shows).  Asking the whole prefix alone, with the share's
       instances rounded down, left one of 4, 8 or 16 instances serving nothing in 24 of 648
       workload-shape runs (a fleet-wide prompt before two tenants, 98% of arrivals on one, held
       by three of four).  What the router has only sent is not copied (a burst still follows its
       first request), and a fresh router's first arrivals each have a share of 1, so it copies
       freely until ``LOAD_ARRIVALS`` arrivals an instance have come.
    7. **Fit** (``why`` is ``"fit"``).  When the prompt does not fit in the first choice's KV pool
       beside what its requests in flight hold (the blocks they pin, and, with their ``output``
       given, the pages they hold alone, ``pages``; the prompt's other blocks and its own pages
       more than ``Backend.pool_blocks``; the HTTP router reads each pool from the instance's
       metrics, the simulator knows it), the instance of least cost among those where it fits and
       that reuse as much of it goes first.  A full pool makes the request wait for pages, which
       no queue of prefill tokens shows: on a workload shape with a 5,312-token prompt at 80%
       load, five of eight instances had no free page while three had, and the router kept
       sending them requests.  A request's output takes pages too, as many as its tokens fill:
       with their ``max_tokens`` counted the rule met 2 more cells where the simulator gives
       outputs pages (``fleet_sim --output-pages``) and none fewer.

       - Where none that reuses as much has room, the one of least cost where it fits goes first
         if that cost is below the first's with its wait for pages in place of its queue where
         longer (``page_wait``: when enough of its requests decoding a known ``max_tokens`` are
         expected to end, at the seconds a decode step their ends there showed, or what those
         still decoding show, if longer; past all of them, where those are every request decoding
         there and the rest wait for their first token, a decode more: on a real fleet whose
         pools filled with such requests the wait read as unknown and nothing moved).  A pool full
         of prompts is soon waited out, one full of long outputs is not: moving to any instance
         with room, without the wait, met 2 fewer cells on the 36 workload shapes; with it, 6
         more of the 135 where pools fill with outputs and none fewer.
       - Where no instance that reuses as much has room and the wait moves nothing, the one of
         those whose pool falls short by the fewest pages (``overcommit``) goes first, if fewer
         than the first's.  An engine that reserves a request's output makes the prompt wait
         while the excess drains, and vLLM, which takes a decode's pages as it grows, preempts
         running requests and recomputes them ahead of new ones in proportion to it.  In the
         simulator with vLLM's preemption (``fleet_sim --preempt``), on the real fleet benchmark's
         workload of long outputs, the default's p95 and p99 fell by a third and a quarter with
         the instances on the ``vllm-cpu`` profile, and its p99 by half on the fleet model's own
         profile, but rose by a fifth with every step 1.5x, where the preemptions come nearest
         vLLM's count; the grids' cells met stayed the same, but for 2 of 135 lost where outputs
         are reserved.  (All measured while the simulator cached only a preempted request's
         prompt.  With a request's generated blocks cached when it is preempted or ends, as vLLM
         caches them, and its CPU tier keeping prompts, the default's p95 and p99 on that workload
         on ``vllm-cpu`` are the least of every policy, and at 1.5x within a tenth of the best and
         below round-robin's: docs/pages/fleet-pages.md.)
    8. **Ties** go to the longer prefix, then fewer requests in flight, then the instance whose
       oldest request still waiting for its first token was sent earliest (the queue counts
       tokens, not how far along they are: on the real fleet two instances each with one cold
       prompt queued tied, and the tie went to the one that had just been sent its prompt, 100
       ms behind the other), then round-robin: a turn that moves on only when it broke a tie (one
       that moved with every request gave every tie to the same instance when bursts were a
       multiple of the instances: on two instances with bursts of 6, every new tenant).
    9. **Rebalancing** (``Chooser.rebalance``; ``why`` is ``"rebalance"``; off unless asked for:
       ``Chooser(rebalance=True)``, ``radixkv route --rebalance``, ``fleet_sim --rebalance``).
       When the router hears a first token or an end, an instance with no request waiting for its
       first token may take the request sent last to an instance where two or more wait: if, chosen
       for again as if it arrived now (rules 1 to 8, with the queue it would leave ahead of it and
       the work its move would copy), the instance with nothing waiting comes before the one it
       waits on.  It is the last of two or more, so the engine has most likely not started it (the
       HTTP router drops the upstream request, which vLLM aborts, and sends it on; the simulator
       moves none an engine started); and it stays when less than a step's ``budget`` of prompt
       tokens waits ahead of it and it fits the pool there: the engine admits waiting requests
       while a step's budget lasts, so it is in the step under way or the next (on the real fleet
       a burst's last request moved cold to an idle instance as its prefix's prefill ended, and
       came out later there than where it was).  A choice is made with what the router knows
       when the request arrives; a queue built by a burst, or behind a prefill that ran longer
       than its estimate, shows only when an instance falls free.  On workload shapes drawn at
       random it met 12 more of 1,026 cells (9 more of the 432 held out, none fewer) and lowered
       TTFT at p95 and p99 by 1-2%, but lost a cell of the real fleet's bursty conversations in
       the simulator by the median (docs/pages/fleet-rules.md): off by default.

  - ``prefix``: the longest prefix wins (a faster medium, then fewer in flight break ties);
    imbalance first (``balance_abs``/``balance_rel``, on requests in flight); no match goes to
    the least loaded.
  - ``cache_aware``: sglang-router's rule as its documentation states it: imbalance
    (``max - min > balance_abs`` and ``max > balance_rel x min`` requests in flight) sends the
    request to the least loaded; else the best match wins when it covers more than
    ``cache_threshold`` of the prompt, and otherwise the instance whose tree is smallest.  Its
    tree is the router's own record of what it sent where (``Recent``), never the events.
  - ``dynamo``: NVIDIA Dynamo's KV router cost: ``overlap_weight x prefill blocks + decode
    blocks``, prefill blocks being the prompt's blocks less the overlap credited by medium
    (GPU 1.0, CPU 0.75, STORAGE 0.25) and decode blocks those of its requests in flight;
    the least cost wins.
  - ``least_loaded``, ``round_robin``, ``random``: the references.

* **Cost.**  ``choose`` is O(instances + matched blocks) plus one index lookup, and O(blocks)
  for the cost policy's ``Demand`` (and O(instances x blocks) when the prompt may not fit in the
  first choice's pool, O(instances) more for each instance computing the prompt's prefix, and
  O(instances ** 2) at most for a copy, over the lengths of the prefix instances hold);
  ``Recent`` and ``Demand`` each hold at most ``max_names`` block names (the least recently seen
  dropped first), ``Recent`` with one expiry and one start per instance.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

from radixkv.core._checks import check_int
from radixkv.fleet.index import Match, medium_rank

__all__ = ["AUTO_CAP", "AUTO_MAX", "BALANCE_ABS", "BALANCE_REL", "Backend", "Chooser", "CostModel", "Demand",
           "MOVES_AT_ONCE", "Move", "POLICIES", "PROFILES", "Recent", "STREAM_AFTER", "Waiting", "auto_affinity",
           "pages_alone", "vllm_usable_blocks"]

POLICIES = ("cost", "prefix", "cache_aware", "dynamo", "least_loaded", "round_robin", "random")

#: The cost policy's affinity by load (``affinity=None``, ``auto_affinity``): linear from 1 on an
#: idle fleet to ``AUTO_MAX`` on one where every instance always has prefill queued, raised past two
#: thirds of the load to the queue's own growth, ``1 / (1 - load)``, at most ``AUTO_CAP``.
AUTO_MAX = 4.0
AUTO_CAP = 20.0

#: The fraction of a prefix's expected prefill after which requests for it that still arrive while
#: an instance computes it are a stream, not a burst: computing it again elsewhere is then not
#: charged as duplicated work when its share of the arrivals calls for another holder
#: (``Chooser._stream``).  A burst's requests arrive at once; on workload shapes drawn at random, a
#: prompt every request shared queued behind its first prefill on one instance while others idled.
STREAM_AFTER = 0.1

#: Arrivals per instance over which the cost policy averages the fleet's load (``Chooser.load``:
#: each arrival moves it ``1 / (LOAD_ARRIVALS x instances)`` of the way to the fraction busy now).
LOAD_ARRIVALS = 8

#: ``prefix``'s and ``cache_aware``'s imbalance: past this many more requests in flight on the most
#: loaded instance than on the least (``BALANCE_ABS``) and this many times as many (``BALANCE_REL``),
#: a request goes to the least loaded.  sglang-router 0.3.2's own defaults are 64 and 1.5.
BALANCE_ABS = 16
BALANCE_REL = 1.5

#: The most requests one instance with nothing waiting takes from others each time the router
#: rebalances (``Chooser.rebalance``): each move is weighed with those before it counted, so this
#: bounds only the work of one call.
MOVES_AT_ONCE = 64

#: Dynamo's published overlap credit per medium (its KV router documentation).
DYNAMO_CREDIT = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}


def pages_alone(tokens: int, full_blocks: int, output: int, block_size: int) -> int:
    """The pages a sequence of ``tokens`` prompt tokens (``full_blocks`` of them whole blocks of
    ``block_size``) and ``output`` generated tokens holds beyond its prompt's full blocks: its
    prompt's partial last block and its output's, a page for every ``block_size`` tokens, as
    vLLM allocates them.  O(1)."""
    return max(0, -(-(tokens + output) // block_size) - full_blocks)


def vllm_usable_blocks(num_gpu_blocks: int) -> int:
    """The blocks of a vLLM pool of ``num_gpu_blocks`` that requests can hold: all but the null
    block its ``BlockPool`` keeps as a placeholder (vLLM's ``kv_cache_usage_perc`` leaves it out
    too).  O(1)."""
    return max(0, num_gpu_blocks - 1)


def auto_affinity(load: float) -> float:
    """The cost policy's affinity at ``load`` (a fraction of instances busy, 0 to 1): ``1 +
    (AUTO_MAX - 1) x load``, or, where it is more, ``1 / (1 - load)``, at most ``AUTO_CAP``.
    The second is how much work an instance holds, in units of the work it is given, when it is
    busy ``load`` of the time (an M/M/1 queue's mean number in the system, plus 1): past two
    thirds, work added to a busy fleet is waited behind by more and more of the requests after it,
    so what a choice adds to the fleet weighs more than the queue it joins.  O(1)."""
    linear = 1.0 + (AUTO_MAX - 1.0) * load
    return min(AUTO_CAP, max(linear, 1.0 / (1.0 - load) if load < 1.0 else AUTO_CAP))


@dataclass
class Backend:
    """One instance behind the router: its base URL, its name in the fleet index, its state
    (``queued_tokens``: the uncached prompt tokens of its requests still waiting for their first
    token, as estimated at routing; ``waiting``: how many requests those are; ``active_tokens``:
    the prompt tokens of its requests in flight; ``in_flight - waiting`` of them are decoding;
    ``pool_blocks``: its KV pool in the router's blocks, ``None`` while unknown)."""

    url: str
    name: str
    healthy: bool = True
    in_flight: int = 0
    queued_tokens: int = 0
    active_tokens: int = 0
    waiting: int = 0
    pool_blocks: int | None = None

    @property
    def decoding(self) -> int:
        """Requests in flight past their first token."""
        return self.in_flight - self.waiting


@dataclass(frozen=True)
class CostModel:
    """Seconds to get a prompt's first token on an idle instance: ``fixed_s`` plus
    ``prefill_s_per_token`` a computed token plus ``load_s_per_token[medium]`` a loaded one
    (``"GPU"``: already in the pool, ``"PEER"``: another instance's, ``"SHARED"``: a tier every
    instance reads, ``"CPU"``, ``"STORAGE"``).  An engine step that also decodes costs
    ``decode_step_s`` more, plus ``decode_s_per_seq`` a decoding sequence (``decode_s``)."""

    prefill_s_per_token: float
    fixed_s: float
    load_s_per_token: Mapping[str, float] = field(default_factory=dict)
    decode_step_s: float = 0.0
    decode_s_per_seq: float = 0.0
    source: str = ""

    def load(self, medium: str | None, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens from ``medium`` (unknown media: as CPU)."""
        per = self.load_s_per_token.get(medium or "GPU", self.load_s_per_token.get("CPU", 0.0))
        return per * tokens

    def prefill(self, tokens: int) -> float:
        """Seconds of prefill for ``tokens`` computed tokens (without ``fixed_s``)."""
        return self.prefill_s_per_token * tokens

    def decode_s(self, sequences: int) -> float:
        """Seconds ``sequences`` decoding sequences add to an engine step (0 when none)."""
        return self.decode_step_s + self.decode_s_per_seq * sequences if sequences > 0 else 0.0


#: Cost profiles.  ``vllm-cpu``: the fit of the TTFTs ``python -m radixkv.bench vllm`` measured on
#: this project's CI machine (``benchmarks/results/vllm_cpu.txt``, a 2-layer random Llama: no cache
#: at 2K/4K/8K + 256 tokens; the resident prefix; loads from the CPU tier, LMDB as ``STORAGE`` and
#: S3 as ``SHARED``), relative least squares with no constant below 0 (``python -m radixkv.bench
#: fleet_sim --calibrate``): 249 us a computed token and no fixed cost (a free intercept came out
#: negative: attention's superlinear growth), every row within 25% but one CPU-tier row (43%: the
#: 4K row of that medium took 142 ms where 2K and 8K took 79 and 84); a peer is taken as costing
#: what S3 does (not measured through vLLM); the decode step is the fit of ``bench vllm --decode``
#: (``benchmarks/results/vllm_cpu_decode.txt``: 3.66 ms + 0.169 ms a sequence, batches of
#: 1/2/4/8 within 1.4% of their medians).  Both measured on one quiet machine (load average below
#: 2); an earlier decode fit under a load average of 9-13 read 177 ms + 18.5 ms: on 2 shared cores
#: a decode step measured the machine's other work.
#: ``vllm-cpu-fleet``: the same fit for the model ``python -m radixkv.bench fleet`` serves (2 layers,
#: hidden 256, 4 query / 2 KV heads, MLP 512, vocab 1000; ``benchmarks/results/vllm_cpu_fleet_model.txt``
#: at 1K/2K/3K + 256 tokens and ``vllm_cpu_fleet_model_decode.txt``): 8.3 ms + 23.8 us a computed
#: token, a tenth of ``vllm-cpu``'s per token; every row within 17% but the CPU tier at 1K (162 ms
#: where 2K and 3K took 41 and 52, the run's first load); a decode step 2.59 ms + 0.116 ms a
#: sequence (batches of 1/2/4/8 within 1.3%).  ``fleet_sim --like-fleet`` runs its instances on it.
#: ``h100-8b``: derived from published numbers for Llama-3-8B (8.0e9 parameters: 16 GFLOP a token;
#: 128 KiB of KV a token in bf16) on one H100 SXM (989 TFLOPS dense bf16 at an assumed 50%
#: utilisation -> 32 us a token; 3.35 TB/s HBM -> a decode step reads the 16 GB of weights in
#: 4.8 ms; PCIe 5 x16 at ~50 GB/s -> 2.6 us a token from the CPU tier; 200 Gbit/s RDMA -> 5.2 us
#: from a peer; local NVMe at ~10 GB/s -> 13 us; S3 at 1 GB/s -> 131 us, slower than computing it).
PROFILES: dict[str, CostModel] = {
    "vllm-cpu": CostModel(prefill_s_per_token=249.4e-6, fixed_s=0.0,
                          load_s_per_token={"GPU": 0.0, "CPU": 3.98e-6, "STORAGE": 0.73e-6, "SHARED": 22.20e-6,
                                            "PEER": 22.20e-6},
                          decode_step_s=3.66e-3, decode_s_per_seq=0.169e-3, source="fit of bench vllm on vLLM-CPU"),
    "vllm-cpu-fleet": CostModel(prefill_s_per_token=23.79e-6, fixed_s=8.342e-3,
                                load_s_per_token={"GPU": 0.0, "CPU": 13.43e-6, "STORAGE": 10.48e-6, "SHARED": 59.35e-6,
                                                  "PEER": 59.35e-6},
                                decode_step_s=2.593e-3, decode_s_per_seq=0.1164e-3,
                                source="fit of bench vllm on bench fleet's model, vLLM-CPU"),
    "h100-8b": CostModel(prefill_s_per_token=32e-6, fixed_s=0.004,
                         load_s_per_token={"GPU": 0.0, "CPU": 2.6e-6, "PEER": 5.2e-6, "SHARED": 131e-6,
                                           "STORAGE": 13e-6},
                         decode_step_s=0.0048, decode_s_per_seq=0.00005, source="published H100 numbers"),
}


class Recent:
    """Block names the router sent each instance lately, with an expiry each (see the module
    docstring).  ``max_names`` bounds the names kept (least recently sent dropped first).
    Not thread-safe (the router's event loop owns it)."""

    def __init__(self, ttl_s: float = 30.0, settle_s: float = 2.0, max_names: int = 1 << 20) -> None:
        if not ttl_s > 0 or not settle_s >= 0:
            raise ValueError(f"ttl_s must be > 0 and settle_s >= 0, got {ttl_s!r}, {settle_s!r}")
        self.ttl_s, self.settle_s, self.max_names = float(ttl_s), float(settle_s), int(max_names)
        # name -> {instance: (expiry, when its record began: the first send since it last expired)}
        self._names: OrderedDict[Hashable, dict[str, tuple[float, float]]] = OrderedDict()
        self._sizes: dict[str, int] = {}           # instance -> names it is among the holders of
        self._expired_at = float("-inf")

    def add(self, instance: str, names: Sequence[Hashable], now: float) -> None:
        """``instance`` was sent a prompt of ``names``.  O(names)."""
        until = now + self.ttl_s
        for name in names:
            holders = self._names.get(name)
            if holders is None:
                holders = self._names[name] = {}
            else:
                self._names.move_to_end(name)
            was = holders.get(instance)
            if was is None:
                self._sizes[instance] = self._sizes.get(instance, 0) + 1
            holders[instance] = (until, was[1] if was is not None and was[0] > now else now)
        while len(self._names) > self.max_names:
            self._forget(self._names.popitem(last=False)[1])

    def take(self, instance: str, names: Sequence[Hashable],
             since: float) -> list[tuple[Hashable, tuple[float, float]]]:
        """Drop ``instance``'s records of ``names`` that began at ``since`` or later (a request
        sent then, taken back: what it alone began is not held there), returning them for
        ``put_back``.  O(names)."""
        taken = []
        for name in names:
            holders = self._names.get(name)
            record = holders.get(instance) if holders else None
            if holders is not None and record is not None and record[1] >= since:
                taken.append((name, holders.pop(instance)))
                self._sizes[instance] -= 1
                if not holders:
                    del self._names[name]
        return taken

    def put_back(self, instance: str, taken: list[tuple[Hashable, tuple[float, float]]]) -> None:
        """Undo ``take``.  O(names)."""
        for name, record in taken:
            self._names.setdefault(name, {})[instance] = record
            self._sizes[instance] = self._sizes.get(instance, 0) + 1

    def _forget(self, holders: dict[str, tuple[float, float]]) -> None:
        for inst in holders:
            self._sizes[inst] -= 1

    def settle(self, instance: str, names: Sequence[Hashable], now: float) -> None:
        """The prompt's first token came back: its events follow within ``settle_s``, after which
        the index alone says whether ``instance`` holds it.  O(names)."""
        until = now + self.settle_s
        for name in names:
            holders = self._names.get(name)
            if holders is not None and instance in holders:
                expiry, since = holders[instance]
                holders[instance] = (min(expiry, until), since)

    def lookup(self, names: Sequence[Hashable], now: float) -> dict[str, int]:
        """``{instance: leading blocks of names it was sent and that have not expired}``, for
        the instances with at least one.  O(matched blocks x instances)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, name in enumerate(names):
            holders = self._names.get(name)
            here = {inst for inst, (until, _) in holders.items() if until > now} if holders else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for inst in alive:
                out[inst] = i + 1
        return out

    def since(self, name: Hashable, instance: str, now: float) -> float | None:
        """When the router began sending ``instance`` prompts with ``name`` (the first send since
        its record last expired), ``None`` when it holds no unexpired record of it.  O(1)."""
        holders = self._names.get(name)
        record = holders.get(instance) if holders else None
        return record[1] if record is not None and record[0] > now else None

    def size(self, instance: str, now: float) -> int:
        """How many names ``instance`` holds here (sglang's "tree size"), expired ones dropped at
        most once a second.  O(1), O(names) once a second."""
        if now - self._expired_at >= 1.0:
            self.expire(now)
        return self._sizes.get(instance, 0)

    def expire(self, now: float) -> None:
        """Drop what has expired.  O(names)."""
        self._expired_at = now
        for name in list(self._names):
            holders = self._names[name]
            gone = [inst for inst, (until, _) in holders.items() if until <= now]
            for inst in gone:
                del holders[inst]
                self._sizes[inst] -= 1
            if not holders:
                del self._names[name]

    def __len__(self) -> int:
        return len(self._names)

    def check(self) -> None:
        """Assert: at most ``max_names`` names, each held by some instance, no record begun after
        it expires."""
        assert len(self._names) <= self.max_names, "more names than max_names"
        assert all(self._names.values()), "a name with no holder"
        assert all(since <= until for holders in self._names.values() for until, since in holders.values()), \
            "a record begun after its expiry"
        counted: dict[str, int] = {}
        for holders in self._names.values():
            for inst in holders:
                counted[inst] = counted.get(inst, 0) + 1
        assert {k: v for k, v in self._sizes.items() if v} == counted, "instance sizes miscounted"


class Demand:
    """How many of the last arrivals (``window`` of them, decayed: each arrival weighs
    ``1 - 1/window`` of the one after it) each block name was part of, and so the share of the
    arrivals a prefix has (the name of its last block: names are chained).  ``max_names`` bounds the
    names kept (least recently seen dropped first).  Not thread-safe."""

    def __init__(self, max_names: int = 1 << 20) -> None:
        self.max_names = int(max_names)
        self._seen: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()     # name -> (count, at arrival)
        self.arrivals = 0
        self._total = (0.0, 0)

    def add(self, names: Sequence[Hashable], window: float) -> None:
        """One arrival of a prompt of ``names``.  O(names)."""
        decay = 1.0 - 1.0 / max(1.0, window)
        self.arrivals += 1
        now = self.arrivals
        count, at = self._total
        self._total = (count * decay ** (now - at) + 1.0, now)
        for name in names:
            count, at = self._seen.pop(name, (0.0, now))
            self._seen[name] = (count * decay ** (now - at) + 1.0, now)
        while len(self._seen) > self.max_names:
            self._seen.popitem(last=False)

    def share(self, name: Hashable, window: float) -> float:
        """The share of the last arrivals (``window`` of them, decayed) whose prompt held ``name``,
        0 to 1 (0 before any arrival).  O(1)."""
        decay = 1.0 - 1.0 / max(1.0, window)
        total, at_total = self._total
        count, at = self._seen.get(name, (0.0, at_total))
        weight = total * decay ** (self.arrivals - at_total)
        return min(1.0, count * decay ** (self.arrivals - at) / weight) if weight > 0 else 0.0

    def __len__(self) -> int:
        return len(self._seen)

    def check(self) -> None:
        """Assert: at most ``max_names`` names, every count positive and none from the future."""
        assert len(self._seen) <= self.max_names, "more names than max_names"
        assert all(c > 0 and 0 < at <= self.arrivals for c, at in self._seen.values()), "a count out of range"


@dataclass
class Waiting:
    """A request sent to an instance and not yet given its first token, as ``Chooser.sent`` was
    told it (with a ``key``): what ``Chooser.rebalance`` needs to send it elsewhere."""

    key: Hashable
    tokens: int
    names: Sequence[Hashable]
    output: int | None
    charge: int
    sent_at: float


@dataclass(frozen=True)
class Move:
    """``Chooser.rebalance``' answer: the request ``key`` waiting on ``source`` goes to ``target``
    instead; its new ``charge`` and send time ``sent_at`` are what ``prefilled`` is then given."""

    key: Hashable
    source: Backend
    target: Backend
    charge: int
    sent_at: float


@dataclass
class Choice:
    """``Chooser.choose``'s answer: instances in the order to try, why the first, the prefix
    tokens it holds (as the router believes), and the prompt's block names (for ``sent``)."""

    order: list[Backend]
    why: str
    promised: int
    names: list[Hashable]


class Chooser:
    """The policies of the module docstring over a list of ``Backend``.  ``lookup(names)`` is the
    fleet index's lookup (``{instance: Match}``), ``block_size`` tokens a name; ``model`` the
    ``CostModel`` of ``cost``; ``spread(names)``: the index's ``lookup_spread`` (``cost`` then
    credits a prefix split across an instance's media, e.g. its head in the pool and its tail in
    the CPU tier, at each medium's cost); ``p2p``: a prefix any instance holds can be loaded by
    every other (``PEER`` cost); ``shared``: ``names -> blocks`` held by a tier every instance reads.
    """

    def __init__(self, policy: str = "cost", *, block_size: int = 16, lookup: Any = None, spread: Any = None,
                 model: CostModel | None = None, affinity: float | None = None, p2p: bool = False,
                 shared: Any = None, balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL,
                 cache_threshold: float = 0.3, overlap_weight: float = 1.0, recent: Recent | None = None,
                 budget: int = 2048, seed: int = 0, rebalance: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        balance_abs = check_int(balance_abs, "balance_abs", 0)      # requests in flight
        if isinstance(balance_rel, bool) or not isinstance(balance_rel, (int, float)) or not 1.0 <= balance_rel < float("inf"):
            raise ValueError(f"balance_rel must be a finite number >= 1 (a ratio of requests in flight), got {balance_rel!r}")
        if affinity is not None and not 1.0 <= affinity < float("inf"):
            raise ValueError(f"affinity must be a finite number >= 1 or None (by load), got {affinity!r}")
        self.policy, self.block_size, self.lookup, self.spread = policy, block_size, lookup, spread
        self.budget = budget
        self.model = model or PROFILES["h100-8b"]
        self.affinity, self.p2p, self.shared = (None if affinity is None else float(affinity)), p2p, shared
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        #: Rule 9 of the cost policy (``rebalance``): off unless asked for.
        self.rebalancing = bool(rebalance)
        self.cache_threshold, self.overlap_weight = cache_threshold, overlap_weight
        # sglang's tree has no events: it is the router's record alone, kept as long as its own
        # eviction interval; the others settle once events can confirm.
        self.recent = recent if recent is not None else (
            Recent(ttl_s=60.0, settle_s=60.0) if policy == "cache_aware" else Recent())
        self._rr = itertools.count()
        self._tie_turn = 0
        self.load = 0.0             # the fraction of instances with prefill queued, averaged over arrivals
        self.demand = Demand()
        self._sent_at: dict[str, deque[float]] = {}     # instance -> when its requests waiting were sent
        # instance -> its requests waiting that were sent with a key, the one sent last last
        self._waiting: dict[str, dict[Hashable, Waiting]] = {}
        self._pinned: dict[str, Counter[Hashable]] = {}  # instance -> block names its requests in flight hold
        self._private: dict[str, int] = {}          # instance -> pages its requests in flight hold alone (``pages``)
        # instance -> (first token, decode steps, pages held alone, block names) of its requests
        # decoding whose output is known, and its seconds a decode step as its requests' ends
        # showed: when their pages come free (``page_wait``)
        self._decodes: dict[str, list[tuple[float, int, int, Sequence[Hashable]]]] = {}
        self._step_s: dict[str, float] = {}
        self._random = random.Random(seed)

    # -- what happens to a request -------------------------------------------------------------

    def pages(self, tokens: int, names: Sequence[Hashable], output: int | None) -> int:
        """The pages a request holds alone besides its prompt's full blocks (``names``): its
        prompt's partial last block and a page for every ``block_size`` tokens of the ``output``
        it may generate (its ``max_tokens``), as vLLM allocates them; 0 when ``output`` is ``None``
        (unknown).  O(1)."""
        return 0 if output is None else pages_alone(tokens, len(names), output, self.block_size)

    def sent(self, backend: Backend, tokens: int, promised: int, names: Sequence[Hashable], now: float,
             output: int | None = None, key: Hashable | None = None) -> int:
        """``backend`` got a request of ``tokens`` prompt tokens of which it holds ``promised``
        (as estimated), that may generate ``output`` tokens (``None``: unknown); returns its
        charge, to give back to ``prefilled``.  With a ``key`` (unique among requests in flight)
        the request may be moved while it waits (``rebalance``; give ``prefilled`` the key too).
        O(names)."""
        charge = max(0, tokens - promised)
        if key is not None:
            self._waiting.setdefault(backend.name, {})[key] = Waiting(key, tokens, names, output, charge, now)
        self._sent_at.setdefault(backend.name, deque()).append(now)
        self._pinned.setdefault(backend.name, Counter()).update(names)
        self._private[backend.name] = self._private.get(backend.name, 0) + self.pages(tokens, names, output)
        backend.in_flight += 1
        backend.waiting += 1
        backend.queued_tokens += charge
        backend.active_tokens += tokens
        self.recent.add(backend.name, names, now)
        return charge

    def prefilled(self, backend: Backend, charge: int, names: Sequence[Hashable], now: float,
                  sent_at: float | None = None, tokens: int | None = None, output: int | None = None,
                  key: Hashable | None = None) -> None:
        """The request's first token came back (or it failed before it): its prefill no longer
        queues.  ``sent_at``: when it was sent (``sent``'s ``now``), whose send time then goes;
        without it the oldest goes, as if the engine prefilled in the order it got them.
        ``tokens`` and ``output`` (as given to ``sent``): with both, the router expects the
        request to end after ``output - 1`` more decode steps and to free the pages it holds alone
        then (``page_wait``).  ``key``: as given to ``sent``.  O(names + requests waiting there)."""
        if key is not None:
            self._waiting.get(backend.name, {}).pop(key, None)
        backend.queued_tokens -= charge
        backend.waiting -= 1
        if tokens is not None and output is not None:
            self._decodes.setdefault(backend.name, []).append(
                (now, max(0, output - 1), self.pages(tokens, names, output), names))
        times = self._sent_at.get(backend.name)
        if times:
            if sent_at is not None and sent_at in times:
                times.remove(sent_at)
            else:
                times.popleft()
        self.recent.settle(backend.name, names, now)

    def ended(self, backend: Backend, tokens: int, names: Sequence[Hashable], output: int | None = None,
              now: float | None = None) -> None:
        """The request of ``tokens`` tokens, block names ``names`` and ``output`` (as given to
        ``sent``) ended (after ``prefilled``, or failed before it: then call ``prefilled`` first)
        at ``now``: with it, the time from its first token over its decode steps updates the
        instance's seconds a step (an average over about ``LOAD_ARRIVALS`` ends).  O(names +
        requests decoding there)."""
        backend.in_flight -= 1
        backend.active_tokens -= tokens
        alone = self.pages(tokens, names, output)
        self._private[backend.name] = self._private.get(backend.name, 0) - alone
        decodes = self._decodes.get(backend.name)
        if decodes and output is not None:
            # its own entry (the same names), else one alike: interchangeable for ``page_wait``
            entry = next((e for e in decodes if e[3] is names), None) or next(
                (e for e in decodes if e[2] == alone and list(e[3]) == list(names)), None)
            if entry is not None:
                decodes.remove(entry)
                first, steps = entry[0], entry[1]
                if now is not None and steps > 0 and now >= first:
                    seen, step = (now - first) / steps, self._step_s.get(backend.name)
                    self._step_s[backend.name] = seen if step is None else step + (seen - step) / LOAD_ARRIVALS
        self._unpin(backend, names)

    def _unpin(self, backend: Backend, names: Sequence[Hashable]) -> None:
        """A request of block names ``names`` on ``backend`` no longer pins them.  O(names)."""
        pinned = self._pinned.get(backend.name)
        if pinned is not None:
            for name in names:
                left = pinned.get(name, 0) - 1
                if left > 0:
                    pinned[name] = left
                else:
                    pinned.pop(name, None)

    def _withdraw(self, backend: Backend, w: Waiting) -> None:
        """Undo ``sent`` of the waiting request ``w`` on ``backend`` but for ``Recent`` (what
        ``rebalance`` does with that record is its own).  O(names + requests waiting there)."""
        self._waiting[backend.name].pop(w.key)
        backend.in_flight -= 1
        backend.waiting -= 1
        backend.queued_tokens -= w.charge
        backend.active_tokens -= w.tokens
        self._private[backend.name] -= self.pages(w.tokens, w.names, w.output)
        self._sent_at[backend.name].remove(w.sent_at)
        self._unpin(backend, w.names)

    def _restore(self, backend: Backend, w: Waiting) -> None:
        """Undo ``_withdraw``: ``w`` waits on ``backend`` as before, sent last.  O(names)."""
        self._waiting.setdefault(backend.name, {})[w.key] = w
        backend.in_flight += 1
        backend.waiting += 1
        backend.queued_tokens += w.charge
        backend.active_tokens += w.tokens
        self._private[backend.name] = self._private.get(backend.name, 0) + self.pages(w.tokens, w.names, w.output)
        self._sent_at.setdefault(backend.name, deque()).append(w.sent_at)
        self._pinned.setdefault(backend.name, Counter()).update(w.names)

    def rebalance(self, backends: Sequence[Backend], now: float, movable: Any = None) -> list[Move]:
        """Rule 9 of the cost policy (the module docstring): for each healthy instance with no
        request waiting, while the request sent last to another healthy instance where two or
        more wait would, chosen again now, go to it before the one it waits on, that request
        moves (``MOVES_AT_ONCE`` at most an instance), unless less than ``budget`` prompt tokens
        wait ahead of it and it ``fits`` there (the engine is starting it).  Only requests sent
        with a ``key`` move, and only those ``movable(key)`` allows (default: all).  The router's
        counts are updated as if each had been sent to its new instance now; the caller sends it
        there and gives ``prefilled`` the ``Move``'s charge and send time.  Nothing moves unless
        the ``Chooser`` was made with ``rebalance=True``, nor under any other policy.
        O(instances ** 2 x a choice) at most a call, O(instances) when no instance is free."""
        if self.policy != "cost" or not self.rebalancing:
            return []
        up = [b for b in backends if b.healthy]
        out: list[Move] = []
        for thief in [b for b in up if not b.waiting]:
            for _ in range(MOVES_AT_ONCE):
                victims = sorted((b for b in up if b is not thief and b.waiting >= 2 and self._waiting.get(b.name)),
                                 key=lambda b: -b.queued_tokens)
                move = None
                for source in victims:
                    w = next(reversed(self._waiting[source.name].values()))
                    if movable is not None and not movable(w.key):
                        continue
                    # less than a step's prompt tokens ahead of it, with room in the pool: the
                    # engine has it in the step under way or the next (it admits waiting requests
                    # while the step's budget lasts), which a move would only repeat.  (The pool
                    # counts it already: it fits there as the pool's requests in flight fit.)
                    if source.queued_tokens - w.charge < self.budget and self.fits(source, (), 0):
                        continue
                    self._withdraw(source, w)
                    # what its own send began there is not held there (other requests' sends are)
                    pinned: Mapping[Hashable, int] = self._pinned.get(source.name) or {}
                    taken = self.recent.take(source.name, [n for n in w.names if n not in pinned], w.sent_at)
                    choice = self.choose(backends, w.tokens, w.names, now, w.output, again=True)
                    if choice.order.index(thief) < choice.order.index(source):
                        charge = self.sent(thief, w.tokens, choice.promised, w.names, now, w.output, key=w.key)
                        move = Move(w.key, source, thief, charge, now)
                        break
                    self.recent.put_back(source.name, taken)
                    self._restore(source, w)
                if move is None:
                    break
                out.append(move)
        return out

    def fits(self, backend: Backend, names: Sequence[Hashable], own: int = 0) -> bool:
        """Whether a prompt of block names ``names``, and ``own`` pages it holds alone (``pages``),
        fit in ``backend``'s pool beside the blocks and pages its requests in flight hold (true
        while the pool's size is unknown).  O(1) when it clearly does, else O(names)."""
        pool = backend.pool_blocks
        if pool is None:
            return True
        pinned: Mapping[Hashable, int] = self._pinned.get(backend.name) or {}
        if len(pinned) + self._private.get(backend.name, 0) + own + len(names) <= pool:
            return True
        return self.overcommit(backend, names, own) <= 0

    def overcommit(self, backend: Backend, names: Sequence[Hashable], own: int = 0) -> int:
        """Pages by which ``backend``'s pool falls short of its requests in flight and a prompt of
        block names ``names`` with ``own`` pages it holds alone (``pages``): at most 0 when it
        ``fits``; 0 while the pool's size is unknown.  O(names)."""
        if backend.pool_blocks is None:
            return 0
        pinned: Mapping[Hashable, int] = self._pinned.get(backend.name) or {}
        return (len(pinned) + self._private.get(backend.name, 0) + own
                + sum(1 for n in names if n not in pinned) - backend.pool_blocks)

    def page_wait(self, backend: Backend, names: Sequence[Hashable], own: int, now: float) -> float | None:
        """Seconds until a prompt of block names ``names`` and ``own`` pages it holds alone
        (``pages``) fits in ``backend``'s pool (``fits``): 0 when it fits now, else when enough of
        the instance's requests decoding an output it was told (``prefilled``'s ``output``) are
        expected to end, each freeing the pages it holds alone and the blocks no other request
        there pins (but the prompt's own: those it reuses).  When those requests cannot free
        enough and every request decoding there is one of them, the rest is held by requests
        waiting for their first token, which free nothing before they have decoded: the last of
        those ends plus a decode of their mean output.  ``None`` otherwise (the rest may end at
        times the router does not know), or when the prompt would not fit an empty pool.  A
        request is expected to end its decode steps after its first token, at the instance's
        seconds a step as its requests' ends showed (``ended``; before any, ``CostModel.decode_s``
        of its decodes now: steps without prefill, the shortest), or more: a request still
        decoding ``e`` seconds after its first token shows a step of at least ``e`` over its steps.
        O(1) when it fits, else O(names + blocks of the requests decoding there)."""
        pool = backend.pool_blocks
        if pool is None:
            return 0.0
        pinned: Mapping[Hashable, int] = self._pinned.get(backend.name) or {}
        need = self.overcommit(backend, names, own)
        if need <= 0:
            return 0.0
        mine = set(names)
        step = self._step_s.get(backend.name)
        if step is None:
            step = self.model.decode_s(max(1, backend.decoding))
        decodes = self._decodes.get(backend.name, ())
        # a request still decoding after e seconds of its s steps shows a step of at least e / s
        step = max([step] + [(now - first) / steps for first, steps, _, _ in decodes if steps > 0])
        freed, ended, end = 0, Counter[Hashable](), now
        for first, steps, alone, held in sorted(decodes, key=lambda e: e[0] + e[1] * step):
            end = first + steps * step
            freed += alone
            for n in held:
                ended[n] += 1
                if ended[n] == pinned.get(n) and n not in mine:
                    freed += 1
            if freed >= need:
                return max(0.0, end - now)
        # Even all of them cannot free enough.  Where every request decoding there is timed, the rest
        # is held by requests waiting for their first token: they start as those end and free
        # nothing before their own outputs are decoded, so the wait is at least the last of those
        # ends, and is taken as that plus one decode of the mean output decoding there (the router
        # does not time a waiting request).  ``None`` where a decode it cannot time could end first,
        # or where the prompt would not fit an empty pool.
        if decodes and backend.waiting and len(decodes) == backend.decoding and own + len(mine) <= pool:
            return max(0.0, end + step * sum(e[1] for e in decodes) / len(decodes) - now)
        return None

    # -- choosing ------------------------------------------------------------------------------

    def holdings(self, names: Sequence[Hashable], now: float,
                 indexed: Mapping[str, Match] | None = None) -> dict[str, Match]:
        """``{instance: Match}``: the index's answer (``indexed`` when the caller has it),
        raised to what the router sent lately (as the GPU medium).  O(matched blocks x instances)."""
        if indexed is None:
            indexed = self.lookup(names) if self.lookup is not None and names else {}
        held = dict(indexed)
        for inst, blocks in self.recent.lookup(names, now).items():
            m = held.get(inst)
            if m is None or blocks > m.blocks:
                held[inst] = Match(blocks, "GPU")
        return held

    def choose(self, backends: Sequence[Backend], tokens: int, names: Sequence[Hashable], now: float,
               output: int | None = None, again: bool = False) -> Choice:
        """Where to send a prompt of ``tokens`` tokens whose block names are ``names``, that may
        generate ``output`` tokens (its ``max_tokens``; ``None``: unknown): the healthy instances in
        the order to try them (all of them when none is healthy).  ``again``: a request that
        arrived before, chosen for again (``rebalance``): the load, the prefixes' shares and the
        ties' turn are left as they are."""
        up = [b for b in backends if b.healthy] or list(backends)
        names = list(names)
        if self.policy == "round_robin":
            i = next(self._rr) % len(up)
            return Choice(up[i:] + up[:i], "round_robin", 0, names)
        if self.policy == "random":
            order = list(up)
            self._random.shuffle(order)
            return Choice(order, "random", 0, names)
        by_load = sorted(up, key=lambda b: (b.in_flight, b.queued_tokens))
        if self.policy == "least_loaded":
            least = [b for b in by_load if (b.in_flight, b.queued_tokens) == (by_load[0].in_flight, by_load[0].queued_tokens)]
            first = least[next(self._rr) % len(least)]
            return Choice([first] + [b for b in by_load if b is not first], "least_loaded", 0, names)
        lo, hi = by_load[0].in_flight, by_load[-1].in_flight
        imbalanced = hi - lo > self.balance_abs and hi > self.balance_rel * lo
        if self.policy == "cache_aware":
            return self._cache_aware(up, by_load, tokens, names, now, imbalanced)
        indexed = dict(self.lookup(names)) if self.lookup is not None and names else {}
        held = self.holdings(names, now, indexed)
        bs = self.block_size

        def tok(m: Match | None) -> int:
            return 0 if m is None else min(m.blocks * bs, tokens)

        if self.policy == "dynamo":
            credit = {b.name: (held[b.name].blocks * DYNAMO_CREDIT.get(held[b.name].medium or "GPU", 0.25)
                               if b.name in held else 0.0) for b in up}
            blocks = -(-tokens // bs)

            def dcost(b: Backend) -> tuple[float, int, int]:
                return (self.overlap_weight * (blocks - credit[b.name]) + b.active_tokens / bs,
                        b.in_flight, up.index(b))

            order = sorted(up, key=dcost)
            return Choice(order, "dynamo", tok(held.get(order[0].name)), names)
        if self.policy == "prefix":
            if imbalanced:
                return Choice(by_load, "balance", 0, names)

            def score(b: Backend) -> tuple[int, int, int]:
                m = held.get(b.name)
                return (m.blocks, -medium_rank(m.medium)[0], -b.in_flight) if m else (0, 0, -b.in_flight)

            best = max(up, key=score)
            if best.name not in held:
                least = [b for b in up if b.in_flight == lo]
                first = least[next(self._rr) % len(least)]
                return Choice([first] + [b for b in by_load if b is not first], "no_match", 0, names)
            return Choice([best] + [b for b in by_load if b is not best], "prefix", tok(held[best.name]), names)
        return self._cost(up, tokens, names, held, indexed, now, self.pages(tokens, names, output), again)

    def own(self, tokens: int, offers: Sequence[tuple[int, float]]) -> tuple[float, int]:
        """(seconds of the request's own prefill on an instance, the prefix tokens it reuses), the
        fastest of computing everything and of each offer ``(tokens reused, seconds to load
        them)``.  O(offers)."""
        m = self.model
        options = [(m.fixed_s + m.prefill(tokens), 0)]
        options += [(m.fixed_s + load + m.prefill(tokens - h), h) for h, load in offers if h > 0]
        return min(options, key=lambda o: (o[0], -o[1]))

    def _spread_cost(self, spread: Any, tokens: int) -> tuple[int, float]:
        """(tokens reused, seconds to load them) of an instance's ``Spread``: each medium's blocks at
        its cost, fastest first, never past the prompt."""
        left, load = tokens, 0.0
        for medium, blocks in spread.by_medium:
            n = min(blocks * self.block_size, left)
            load += self.model.load(medium, n)
            left -= n
        return tokens - left, load

    def _cost(self, up: list[Backend], tokens: int, names: list[Hashable], held: dict[str, Match],
              indexed: dict[str, Match], now: float, own: int, again: bool = False) -> Choice:
        bs, m = self.block_size, self.model
        spreads = self.spread(names) if self.spread is not None and names else {}
        # what each instance holds by the index, on any medium: what a peer can load from it (what
        # the router sent lately counts for that instance alone: until its prefill ends, no peer
        # can load it, and a peer that tried would compute it again)
        reach = {inst: min(match.blocks * bs, tokens) for inst, match in indexed.items()}
        offers: dict[str, list[tuple[int, float]]] = {}
        for inst, match in held.items():
            h = min(match.blocks * bs, tokens)
            offers.setdefault(inst, []).append((h, m.load(match.medium, h)))
        for inst, spread in spreads.items():
            h, load = self._spread_cost(spread, tokens)
            offers.setdefault(inst, []).append((h, load))
            reach[inst] = max(reach.get(inst, 0), h)
        shared = min(self.shared(names) * bs, tokens) if self.shared is not None and names else 0
        peers = sorted(((h, inst) for inst, h in reach.items()), reverse=True)
        # what an instance is computing for this prompt right now: sent to it, not yet in the index
        # (tokens from, to: what the index shows it holds is done, not under way)
        shown = {inst: match.blocks for inst, match in indexed.items()}
        pending = {inst: (min(shown.get(inst, 0) * bs, tokens), min(match.blocks * bs, tokens))
                   for inst, match in held.items() if match.blocks > shown.get(inst, 0)}
        scored = []
        ttft: dict[str, float] = {}     # expected TTFT unweighted (an idle instance's with the copy's charge)
        wait: dict[str, float] = {}     # what the prompt waits for before its own prefill starts
        if not again:
            self.demand.add(names, LOAD_ARRIVALS * len(up))
        for inst in [inst for inst in pending if self._stream(inst, held, names, pending[inst], up, now)]:
            del pending[inst]       # a stream's prefix: computing it again is a copy it calls for
        turn = self._tie_turn
        idle = sum(1 for b in up if not b.queued_tokens)
        if self.affinity is not None:
            affinity = now_affinity = self.affinity
        else:                       # by load: 1 on an idle fleet, AUTO_MAX when every instance has a queue
            busy = 1.0 - idle / len(up)
            if not again:
                self.load += (busy - self.load) / (LOAD_ARRIVALS * len(up))
            affinity = auto_affinity(self.load)
            now_affinity = auto_affinity(busy)
        for i, b in enumerate(up):
            mine = list(offers.get(b.name, ()))
            if self.p2p:
                best_peer = next((h for h, inst in peers if inst != b.name), 0)
                mine.append((best_peer, m.load("PEER", best_peer)))
            if shared:
                mine.append((shared, m.load("SHARED", shared)))
            own_s, reused = self.own(tokens, mine)
            queue_s = m.prefill(b.queued_tokens)
            # every step until this prefill ends also decodes what the instance is decoding
            steps = max(1, -(-(b.queued_tokens + tokens - reused) // self.budget))
            decode_s = steps * m.decode_s(b.decoding)
            # an idle instance's work delays only what arrives there while it runs, not a queue
            weight = affinity if b.in_flight else (1.0 + affinity) / 2
            # computing what another instance is computing for this prompt right now doubles work
            # already under way: weighed by the load at this moment, not the average (a burst on a
            # lightly loaded fleet follows its first request rather than compute it on every
            # instance), and divided by 1 + the instances idle beside this one: the fleet's spare
            # capacity absorbs a copy (without it, on 16 instances every request of a fleet-wide
            # prompt's first steps was held on the few instances computing it)
            dup = max((to - max(done, reused) for inst, (done, to) in pending.items() if inst != b.name), default=0)
            spare = idle - (0 if b.queued_tokens else 1)
            dup_s = max(0.0, now_affinity - weight) * m.prefill(dup) / (1 + spare) if dup > 0 else 0.0
            ttft[b.name] = queue_s + decode_s + own_s + (0.0 if b.in_flight else dup_s)
            wait[b.name] = queue_s + decode_s
            # among equals, fewer in flight, then the queue sent earliest (furthest along: the cost
            # counts a queue's tokens, not how long they have run)
            sent_at = self._sent_at.get(b.name)
            oldest = sent_at[0] if sent_at else float("-inf")
            scored.append((queue_s + decode_s + weight * own_s + dup_s, -reused, (b.in_flight, oldest),
                           (i - turn) % len(up), b, reused))
        scored.sort(key=lambda s: s[:4])
        idled = self._sooner_when_idle(scored, ttft, held, tokens)
        copied = self._replicate(scored, ttft, wait, held, indexed, names, len(up))
        fitted = self._fit(scored, names, own, wait, now)
        if not again and len(scored) > 1 and scored[0][:3] == scored[1][:3]:   # the turn broke a tie: it moves on
            self._tie_turn += 1
        why = "fit" if fitted else "copy" if copied else "idle" if idled else "cost"
        return Choice([s[4] for s in scored], why, scored[0][5], names)

    def _stream(self, inst: str, held: dict[str, Match], names: list[Hashable], under_way: tuple[int, int],
                up: list[Backend], now: float) -> bool:
        """Whether the prefix ``inst`` is computing for this prompt (tokens ``under_way``: from,
        to; sent, not yet in the index) is a stream's rather than a burst's: the router began
        sending it there at least ``STREAM_AFTER`` of its expected prefill ago, and fewer instances
        hold it than its share of the arrivals calls for (``_calls_for_another``).  Requests for
        it that keep arriving while it is computed are a stream, which more instances should
        hold; a burst arrives at once.  O(instances)."""
        blocks = min(held[inst].blocks, len(names))
        since = self.recent.since(names[blocks - 1], inst, now) if blocks else None
        m = self.model
        if since is None or now - since < STREAM_AFTER * (m.fixed_s + m.prefill(under_way[1] - under_way[0])):
            return False
        holding = sum(1 for b in up if b.name in held and held[b.name].blocks >= blocks)
        return self._calls_for_another(names[blocks - 1], holding, len(up))

    def _calls_for_another(self, name: Hashable, holding: int, instances: int) -> bool:
        """Whether the prefix whose last block is ``name`` calls for another holder (``holding``
        instances hold it): its share of the arrivals (``Demand``) times the instances is its
        *worth*; one more holder is at most its worth, or two or more hold it and fewer than its
        worth.  The worth is rounded up once two instances hold it (a prompt 98% of the arrivals
        share belongs on all of four instances, not three), not before: a second holder doubles a
        prefix's copies, and a tenant worth 1.2 instances, or on two instances a fresh router's
        second tenant, would be computed twice for a fifth of an instance's work.  O(1)."""
        worth = self.demand.share(name, LOAD_ARRIVALS * instances) * instances
        return holding + 1 <= worth + 1e-9 or (holding >= 2 and holding < worth - 1e-9)

    def _fit(self, scored: list[Any], names: list[Hashable], own: int, wait: dict[str, float], now: float) -> bool:
        """Put first (in place), when the prompt and its ``own`` pages (``pages``) do not fit
        (``fits``) in the first's pool, the instance of least cost among those where they fit and
        that reuse as much of it; or, with none, the one of least cost where they fit, if that
        cost is below the first's with its wait for pages (``page_wait``) in place of its queue
        (``wait``) where longer; or else, among those that reuse as much, the one whose pool falls
        short by the fewest pages (``overcommit``), if fewer than the first's; whether it did.  An engine whose pool is full makes a new request
        wait for pages, which no queue of prefill tokens shows; a pool full of prompts is soon
        waited out, one full of long outputs is not.  O(instances) when the first fits, else
        O(instances x names + blocks decoding on the first)."""
        first = scored[0]
        if self.fits(first[4], names, own):
            return False
        room = [s for s in scored[1:] if self.fits(s[4], names, own)]
        same = [s for s in room if s[5] >= first[5]]
        best = min(same, key=lambda s: s[:4]) if same else None
        if best is None and room:
            pages_s = self.page_wait(first[4], names, own, now)
            cheapest = min(room, key=lambda s: s[:4])
            if pages_s is not None and cheapest[0] < first[0] + max(0.0, pages_s - wait[first[4].name]):
                best = cheapest
        if best is None:
            # fits nowhere that reuses as much: the least overcommitted of those pools, if less
            # than the first's (an engine that reserves makes the prompt wait while the excess
            # drains; one that takes pages as decodes grow, as vLLM does, preempts and recomputes
            # in proportion to it)
            over = self.overcommit(first[4], names, own)
            less = [(o, s) for s in scored[1:] if s[5] >= first[5]
                    and (o := self.overcommit(s[4], names, own)) < over]
            if not less:
                return False
            best = min(less, key=lambda os: (os[0], os[1][:4]))[1]
        scored.remove(best)
        scored.insert(0, best)
        return True

    def _replicate(self, scored: list[Any], ttft: dict[str, float], wait: dict[str, float], held: dict[str, Match],
                   indexed: dict[str, Match], names: list[Hashable], instances: int) -> bool:
        """Put first (in place) the instance that does not hold the first's prefix and gives the
        prompt its first token soonest among those that wait less than the first (``wait``: queue
        and decode steps before its own prefill), when the first holds that prefix, the index shows
        it computed somewhere, and fewer instances hold it than its share of the arrivals calls for
        (``_calls_for_another``); whether it did.  Each length of the first's prefix that an
        instance holds is asked, longest first: a fleet-wide prompt before a tenant's, which
        instances hold alone, calls for more holders than the whole.  O(instances x distinct
        lengths held), at most O(instances ** 2)."""
        first = scored[0]
        h = min(first[5] // self.block_size, len(names))
        if h < 1 or first[4].name not in held or held[first[4].name].blocks < h:
            return False
        # the lengths of the first's prefix that instances hold, longest first: a prompt's part that
        # every request shares (a fleet-wide system prompt), held alone by instances that do not
        # hold its tenant's, calls for holders the tenant's does not
        levels = sorted({min(held[s[4].name].blocks, h) for s in scored if s[4].name in held}, reverse=True)
        for level in levels:
            if level < 1 or not any(m.blocks >= level for m in indexed.values()):
                continue            # not computed anywhere yet: a copy now would compute it again
            holding = {s[4].name for s in scored if s[4].name in held and held[s[4].name].blocks >= level}
            if not self._calls_for_another(names[level - 1], len(holding), instances):
                continue
            others = [s for s in scored if s[4].name not in holding and wait[s[4].name] < wait[first[4].name]]
            if not others:
                return False        # a shorter prefix's non-holders are fewer still
            best = min(others, key=lambda s: ttft[s[4].name])
            scored.remove(best)
            scored.insert(0, best)
            return True
        return False

    def _sooner_when_idle(self, scored: list[Any], ttft: dict[str, float], held: dict[str, Match], tokens: int) -> bool:
        """Put first (in place) the idle instance that gives the prompt its first token soonest, when
        that is sooner than every instance with requests in flight and the best cost is a busy one's,
        unless it gives up a prefix that fewer than two healthy instances hold; whether it did.
        ``scored``: the cost policy's rows, sorted; ``ttft``: each instance's expected TTFT,
        unweighted, an idle one's with the charge for copying work under way.  O(instances)."""
        idle = [s for s in scored if not s[4].in_flight]
        if not idle or not scored[0][4].in_flight:
            return False
        fastest = min(idle, key=lambda s: ttft[s[4].name])
        best_reuse = max(s[5] for s in scored)
        # the candidates that hold that prefix (an instance that is down does not count)
        holders = sum(1 for s in scored if s[4].name in held
                      and min(held[s[4].name].blocks * self.block_size, tokens) >= best_reuse)
        if (fastest[5] >= best_reuse or holders >= 2) and ttft[fastest[4].name] < min(
                ttft[s[4].name] for s in scored if s[4].in_flight):
            scored.remove(fastest)
            scored.insert(0, fastest)
            return True
        return False

    def _cache_aware(self, up: list[Backend], by_load: list[Backend], tokens: int, names: list[Hashable],
                     now: float, imbalanced: bool) -> Choice:
        if imbalanced:
            return Choice(by_load, "balance", 0, names)
        runs = self.recent.lookup(names, now)
        best = max(up, key=lambda b: (runs.get(b.name, 0), -b.in_flight, -up.index(b)))
        matched = min(runs.get(best.name, 0) * self.block_size, tokens)
        if tokens and matched / tokens > self.cache_threshold:
            return Choice([best] + [b for b in by_load if b is not best], "prefix", matched, names)
        smallest = min(up, key=lambda b: (self.recent.size(b.name, now), up.index(b)))
        return Choice([smallest] + [b for b in by_load if b is not smallest], "no_match",
                      min(runs.get(smallest.name, 0) * self.block_size, tokens), names)

    def check(self, backends: Sequence[Backend]) -> None:
        """Assert the counters' invariants, the load's range, ``Recent``'s and ``Demand``'s.  O(instances +
        names)."""
        assert len({b.name for b in backends}) == len(backends), "an instance named twice"
        assert 0.0 <= self.load <= 1.0, f"the load {self.load} is not a fraction"
        for b in backends:
            assert b.in_flight >= 0 and b.queued_tokens >= 0 and b.active_tokens >= 0, f"a negative count on {b.name}"
            assert b.in_flight or not (b.queued_tokens or b.active_tokens), f"tokens counted on idle {b.name}"
            assert 0 <= b.waiting <= b.in_flight, f"{b.waiting} waiting of {b.in_flight} in flight on {b.name}"
            assert b.waiting or not b.queued_tokens, f"queued tokens with no request waiting on {b.name}"
            sent_at = self._sent_at.get(b.name, ())
            assert len(sent_at) == b.waiting, f"{len(sent_at)} send times for {b.waiting} waiting on {b.name}"
            keyed = self._waiting.get(b.name, {})
            assert len(keyed) <= b.waiting and all(w.sent_at in sent_at for w in keyed.values()), \
                f"{len(keyed)} keyed requests waiting, {b.waiting} waiting on {b.name}"
            assert all(a <= b_ for a, b_ in zip(sent_at, itertools.islice(sent_at, 1, None))), \
                f"send times out of order on {b.name}"
            pinned: Mapping[Hashable, int] = self._pinned.get(b.name, {})
            assert b.in_flight or not pinned, f"blocks pinned on idle {b.name}"
            private = self._private.get(b.name, 0)
            assert private >= 0 and (b.in_flight or not private), f"{private} pages held alone on {b.name}"
            assert all(c > 0 for c in pinned.values()), f"a pinned count below 1 on {b.name}"
            decodes = self._decodes.get(b.name, ())
            assert len(decodes) <= b.decoding, f"{len(decodes)} decodes expected to end, {b.decoding} decoding on {b.name}"
            assert sum(e[2] for e in decodes) <= private and all(
                all(pinned.get(n, 0) > 0 for n in e[3]) for e in decodes), \
                f"a decode's pages not held on {b.name}"
        self.recent.check()
        self.demand.check()
