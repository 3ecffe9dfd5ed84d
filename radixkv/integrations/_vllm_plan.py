"""The scheduler side of the vLLM connector: per-request bookkeeping and the plan of each step.

vLLM runs its scheduler in one process and its workers (one per tensor-parallel rank) in others;
the tiers, the CPU tier above all, live in the workers, next to the KV they fill.  So the
scheduler learns what the tiers hold by asking the workers, through the only channel vLLM gives a
connector (the step's metadata down, the workers' metadata back), and a lookup is a small state
machine per request:

1. ``matched(req, local)`` on a new request: the request asks for the chunks from the first one
   vLLM's own prefix cache does not cover, and the answer is "not yet" (``None``): vLLM keeps the
   request waiting while others run.
2. The step's ``Plan`` carries a ``Lookup``; each worker looks the chunks up in its tiers *and
   loads them* into chunk buffers in the background, and reports how many it holds.  Where the
   one worker runs in the scheduler's process, ``answer`` (its ``lookup_now``) may answer at once
   from the in-memory tiers instead: the request goes on to step 3 in the same call.
3. Once every rank answered (or ``timeout_s`` passed: then nothing), ``matched`` returns the
   tokens past vLLM's hit that the loaded chunks cover, at most ``num_tokens - 1`` (vLLM computes
   at least the last token).  A load that vLLM then commits (``allocated``) is a ``Load`` of the
   next plan: a copy from buffers the worker already holds, done before the forward, which cannot
   fail — a fault below vLLM can only make a lookup come back short, never a load.
4. Every step, the full prompt chunks that the step completes and the tiers did not hold become
   ``Store``s: the worker gathers their blocks after the forward and queues them to the tiers.

Preemption forgets the lookup (the request is looked up again when it resumes; what it stored
stays stored); a finished request's state is dropped here and, through ``Plan.drops`` and vLLM's
finished ids, in the workers.  Roles: a ``kv_producer`` only stores, a ``kv_consumer`` only
loads, ``kv_both`` does both.  Requests with multimodal inputs or without token ids are left
to vLLM (their token ids do not name their KV).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from radixkv.core._checks import check_int

__all__ = ["Load", "Lookup", "Plan", "Report", "SchedulerSide", "Store"]


@dataclass(frozen=True)
class Lookup:
    """Look up and load chunks ``start, start + 1, ...`` (at most ``max_chunks``) of a request's
    prompt; ``tokens`` (int32 bytes), ``salt`` and ``lora`` name them.  ``timeout_s`` bounds the
    tiers' work, counted from when the worker receives it."""

    req_id: str
    seq: int
    tokens: bytes
    salt: bytes
    lora: str
    start: int
    max_chunks: int
    timeout_s: float


@dataclass(frozen=True)
class Load:
    """Copy the chunks that lookup ``seq`` holds, ``start .. start + num_chunks - 1``, into the
    request's blocks ``block_ids`` (vLLM's block table from block 0, covering at least those
    chunks), leaving the first ``skip_blocks`` blocks of the request (vLLM's own hit) alone."""

    req_id: str
    seq: int
    start: int
    num_chunks: int
    block_ids: tuple[int, ...]
    skip_blocks: int


@dataclass(frozen=True)
class Store:
    """Gather chunks ``first .. first + len(block_ids) // blocks_per_chunk - 1`` of a request from
    its blocks ``block_ids`` (those chunks' blocks only) and queue them to the tiers.  ``tokens``
    is set when the worker has not seen the request's prompt yet (else empty)."""

    req_id: str
    first: int
    block_ids: tuple[int, ...]
    tokens: bytes = b""
    salt: bytes = b""
    lora: str = ""
    # With vLLM's KV events on: the names vLLM gave these blocks (its external block hashes), and
    # the name of the block before them (None for block 0), for the tiers' events.
    names: tuple[Any, ...] = ()
    parent: Any = None


@dataclass
class Plan:
    """What the workers do in one step (vLLM sends it down as the connector's metadata)."""

    lookups: list[Lookup] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)         # release the chunks a lookup holds
    finished: list[str] = field(default_factory=list)      # forget the request
    idle: bool = False            # the step runs no forward: a worker may wait for its lookups
    # The last lookup number given out when the plan was made (None: no bound).  A lookup answered
    # at once after it (``answer``) is newer than the plan's drops and lookups, which may reach the
    # worker later (vLLM may schedule the next step while this one runs): they leave it alone.
    upto: int | None = None

    def __bool__(self) -> bool:
        return bool(self.lookups or self.loads or self.stores or self.drops or self.finished)


@dataclass
class Report:
    """What one or more workers tell the scheduler after a step: ``found[req_id][rank] = (lookup
    seq, chunks held)``.  ``merge`` combines the reports of several ranks."""

    found: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)

    def merge(self, other: Report) -> Report:
        """Both reports in one (a new object).  O(entries)."""
        found = {r: dict(v) for r, v in self.found.items()}
        for req_id, ranks in other.found.items():
            found.setdefault(req_id, {}).update(ranks)
        return Report(found)


@dataclass
class _Request:
    """One request as the scheduler side tracks it."""

    tokens: bytes
    num_prompt_tokens: int
    salt: bytes
    lora: str
    eligible: bool
    asked: int | None = None                 # start chunk of the outstanding or answered lookup
    seq: int = 0                             # that lookup's number
    deadline: float = 0.0
    answers: dict[int, tuple[int, int]] = field(default_factory=dict)
    held: int | None = None                  # chunks every rank holds from ``asked`` (None: no answer yet)
    local: int = 0                           # vLLM's own hit when last asked (tokens)
    load: Load | None = None                 # committed, to send with the next plan
    loaded_tokens: int = 0
    next_store: int = 0                      # first prompt chunk not known to be in the tiers
    sent_tokens: bool = False                # the workers have this prompt
    names: list[Any] = field(default_factory=list)    # vLLM's block hashes (external), with events on


class SchedulerSide:
    """Bookkeeping of the scheduler-side connector (see the module docstring).

    ``chunk_size`` and ``block_size`` are in tokens (the first a multiple of the second);
    ``tp_size`` is how many workers answer each lookup; ``loads``/``stores`` follow the KV role;
    ``timeout_s`` bounds how long a request waits for the tiers; ``clock`` is ``time.monotonic``
    unless a test gives another.  ``answer(lookup)``, when given, is tried before a lookup is
    sent: a number is the chunks the (one) worker holds for it already, ``None`` sends it.  Not
    thread-safe: vLLM calls it from its scheduler thread.  ``names``, when given, converts vLLM's
    block hashes to the form its KV events carry: stores then carry the names of their blocks.
    """

    def __init__(self, *, chunk_size: int, block_size: int, tp_size: int = 1, loads: bool = True,
                 stores: bool = True, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 answer: Callable[[Lookup], int | None] | None = None,
                 names: Callable[[bytes], Any] | None = None) -> None:
        check_int(chunk_size, "chunk_size", 1)
        check_int(block_size, "block_size", 1)
        check_int(tp_size, "tp_size", 1)
        if chunk_size % block_size:
            raise ValueError(f"chunk_size: {chunk_size} is not a multiple of vLLM's block size {block_size}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.tp_size = tp_size
        self.loads = loads
        self.stores = stores
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.answer = answer
        self.names = names
        self._requests: dict[str, _Request] = {}
        self._plan = Plan()
        self._seq = 0
        # Named apart from the workers' counters: vLLM sums both sides' stats into one line.
        self.counters = dict.fromkeys(("lookup_requests", "lookup_timeouts", "hit_requests", "hit_tokens",
                                       "store_chunks_planned", "answered_at_once"), 0)

    # -- vLLM's scheduler-side calls ---------------------------------------------------------

    def matched(self, req_id: str, request: Any, local: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens past vLLM's ``local`` hit that the tiers deliver,
        ``None`` while the workers are still looking; never asynchronous (the second value).
        O(prompt) once per request (tokens to bytes), O(1) after."""
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _new_request(request)
            if self.names is not None:
                req.names = [self.names(h) for h in getattr(request, "block_hashes", ())]
        start = local // self.chunk_size
        req.next_store = max(req.next_store, start)
        if not (self.loads and req.eligible) or (start + 1) * self.chunk_size > req.num_prompt_tokens:
            return 0, False
        if req.asked is None or (req.held is None and req.asked != start) or \
                (req.held is not None and req.asked > start):
            # A first lookup, or vLLM's own hit moved away from the chunks asked for: ask (again).
            self._seq += 1
            lookup = Lookup(req_id, self._seq, req.tokens, req.salt, req.lora, start,
                            req.num_prompt_tokens // self.chunk_size - start, self.timeout_s)
            held = self.answer(lookup) if self.answer is not None and self.tp_size == 1 else None
            if held is not None:
                # Answered at once (the worker released any older lookup of it): drop nothing later.
                self._plan.drops = [d for d in self._plan.drops if d != req_id]
                self.counters["answered_at_once"] += 1
            elif req.asked is not None:
                self._plan.drops.append(req_id)
            req.asked, req.seq, req.answers, req.held, req.local = start, self._seq, {}, None, local
            req.deadline = self.clock() + self.timeout_s
            req.sent_tokens = True
            self.counters["lookup_requests"] += 1
            if held is None:
                self._plan.lookups.append(lookup)
                return None, False
            req.answers, req.held = {0: (req.seq, held)}, held
        if req.held is None:
            if self.clock() < req.deadline:
                return None, False
            req.held = 0                         # the workers did not answer in time: a miss
            self.counters["lookup_timeouts"] += 1
        req.local = local
        end = min((req.asked + req.held) * self.chunk_size, _num_tokens(request, req) - 1)
        if end <= local:
            self._plan.drops.append(req_id)      # nothing to load: release what the workers hold
            return 0, False
        return end - local, False

    def allocated(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: commit the load of ``num_external_tokens`` tokens into the
        request's blocks ``block_ids`` (vLLM's table from block 0).  O(blocks)."""
        req = self._requests.get(req_id)
        if req is None or req.asked is None or req.held is None:
            return
        req.next_store = max(req.next_store, req.asked + req.held)
        if num_external_tokens <= 0:
            self._plan.drops.append(req_id)
            return
        end = req.local + num_external_tokens
        num_chunks = -(-end // self.chunk_size) - req.asked
        if not 0 < num_chunks <= req.held:
            raise AssertionError(f"load of {num_external_tokens} tokens past {req.local} does not fit "
                                 f"the {req.held} chunks held from chunk {req.asked}")
        blocks = (req.asked + num_chunks) * self.blocks_per_chunk
        req.load = Load(req_id, req.seq, req.asked, num_chunks, tuple(block_ids[:blocks]),
                        req.local // self.block_size)
        req.loaded_tokens = num_external_tokens
        self.counters["hit_requests"] += 1
        self.counters["hit_tokens"] += num_external_tokens

    def plan(self, scheduled: list[tuple[str, int, int]], block_ids: Callable[[str], list[int]],
             preempted: set[str], idle: bool) -> Plan:
        """``build_connector_meta``: the step's plan.  ``scheduled`` is (request id, tokens computed
        before the step, tokens scheduled in it) per scheduled request; ``block_ids(req_id)`` its
        block table.  Resets the plan being built.  O(requests + blocks stored)."""
        plan, self._plan = self._plan, Plan()
        plan.idle, plan.upto = idle, self._seq
        for req_id in preempted:
            req = self._requests.get(req_id)
            if req is not None:
                if req.asked is not None:
                    plan.drops.append(req_id)
                req.asked, req.answers, req.held, req.load = None, {}, None, None
        bpc = self.blocks_per_chunk
        for req_id, before, count in scheduled:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if req.load is not None:
                plan.loads.append(req.load)
                req.load = None
                req.asked, req.held = None, None     # the worker's buffers are used up by the load
            if not (self.stores and req.eligible):
                continue
            done = min(before + count, req.num_prompt_tokens) // self.chunk_size
            if done <= req.next_store:
                continue
            table = block_ids(req_id)
            if len(table) < done * bpc:
                continue                            # not every block is there (vLLM allocates them all)
            first = req.next_store
            names = tuple(req.names[first * bpc:done * bpc])
            plan.stores.append(Store(req_id, first, tuple(table[first * bpc:done * bpc]),
                                     b"" if req.sent_tokens else req.tokens, req.salt, req.lora,
                                     names, req.names[first * bpc - 1] if first and names else None))
            req.sent_tokens = True
            self.counters["store_chunks_planned"] += done - first
            req.next_store = done
        return plan

    def reported(self, report: Report) -> None:
        """``update_connector_output``: record the workers' answers.  O(entries)."""
        for req_id, ranks in report.found.items():
            req = self._requests.get(req_id)
            if req is None or req.held is not None:
                continue
            for rank, (seq, held) in ranks.items():
                if seq == req.seq:
                    req.answers[rank] = (seq, held)
            if len(req.answers) >= self.tp_size:
                req.held = min(h for _, h in req.answers.values())

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """``request_finished``: forget the request (here, and in the workers with the next plan);
        what to put in its ``kv_transfer_params``.  O(1)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return None
        self._plan.finished.append(req_id)
        return {"radixkv_loaded_tokens": req.loaded_tokens}

    def check(self) -> None:
        """Assert the bookkeeping's invariants.  Raises ``AssertionError``.  O(requests)."""
        for req_id, req in self._requests.items():
            assert req.held is None or req.asked is not None, f"{req_id}: an answer without a lookup"
            assert req.load is None or req.load.num_chunks <= (req.held or 0), f"{req_id}: load past held"
            assert req.next_store * self.chunk_size <= max(req.num_prompt_tokens, 0) + self.chunk_size, \
                f"{req_id}: stores past the prompt"
        assert all(v >= 0 for v in self.counters.values()), "negative counter"

    def __len__(self) -> int:
        return len(self._requests)


def _new_request(request: Any) -> _Request:
    import numpy as np

    prompt = getattr(request, "prompt_token_ids", None)
    mm = getattr(request, "mm_features", None)
    eligible = prompt is not None and not mm
    tokens = np.asarray(prompt if prompt is not None else [], dtype="<i4").tobytes()
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    return _Request(tokens=tokens, num_prompt_tokens=len(tokens) // 4,
                    salt=salt.encode() if isinstance(salt, str) else bytes(salt),
                    lora="" if lora is None else f"{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_path', '')}",
                    eligible=eligible)


def _num_tokens(request: Any, req: _Request) -> int:
    n = getattr(request, "num_tokens", None)
    return int(n) if isinstance(n, int) else req.num_prompt_tokens
