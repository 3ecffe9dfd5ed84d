"""The worker side of the vLLM connector: the tier stack, and copies between chunk buffers and
vLLM's own per-layer KV tensors.

One ``WorkerSide`` per worker process (tensor-parallel rank).  It carries out the scheduler's
``Plan`` (``radixkv.integrations._vllm_plan``):

* a ``Lookup`` runs on a background thread: ``TierStack.lookup`` then ``TierStack.load`` of the
  chunks found, within the lookup's timeout (passed to the stack as a deadline where it takes
  one), into chunk buffers held here until the scheduler commits or drops them.  Faults of the
  tiers come back as fewer chunks.  The held buffers are bounded by ``max_held_bytes``: a lookup
  that would pass the bound holds fewer chunks.
* ``lookup_now``: where the scheduler runs in this process (one worker, vLLM's in-process
  executor), it answers a lookup at once when the stack's leading in-memory tiers (``Tier.
  in_memory``: the CPU tier) hold at least as many leading chunks as every local tier does: it
  loads them then and there (memory copies) and holds them as a finished lookup would.  The
  request is scheduled in the same step, with no round trip through the step's metadata and no
  background thread; the remote tiers (S3) are not asked for what lies past the local tiers' chunks.
* a ``Load`` scatters held buffers into vLLM's blocks with ``radixkv.core.ops.scatter_blocks``, before
  the forward that reads them;
* a ``Store`` gathers a request's completed chunks from vLLM's blocks with
  ``radixkv.core.ops.gather_blocks`` after the forward, and queues them to the stack (encoding and
  writes happen on the stack's writer thread; a full queue drops, never waits).

Chunk keys are the stack's chained keys, seeded by the request's namespace: the engine's
(model, revision, KV dtype and layout, block size, TP rank and size) with the request's
``cache_salt`` and LoRA adapter on top, so that another tenant or adapter never hits.  All of a
request's chunks are stored under the engine namespace's id (``TierStack.drop_namespace`` drops
every tenant of the engine at once).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from radixkv.core import ops
from radixkv.core.hashing import Namespace, keys_from_token_bytes
from radixkv.integrations._vllm_plan import Load, Lookup, Plan, Report, Store
from radixkv.core.stack import ChunkRef, TierStack

__all__ = ["WorkerSide", "request_namespace"]

log = logging.getLogger("radixkv.integrations.vllm")


def request_namespace(base: Namespace, salt: bytes, lora: str) -> Namespace:
    """``base`` with a request's ``cache_salt`` appended to its salt (length-prefixed, so no two
    pairs collide) and its LoRA adapter as ``lora_id``.  O(1) (one hash of the namespace)."""
    if not salt and not lora:
        return base
    joined = len(base.salt).to_bytes(4, "little") + base.salt + salt if salt else base.salt
    return replace(base, salt=joined, lora_id=lora or base.lora_id)


@dataclass
class _Request:
    """A request as one worker knows it: its prompt, its chunk refs, the chunks a lookup holds."""

    tokens: bytes
    namespace: Namespace
    refs: list[ChunkRef] | None = None
    seq: int = 0
    start: int = 0
    future: Future[list[torch.Tensor]] | None = None
    held: list[torch.Tensor] = field(default_factory=list)
    reported: bool = True


class WorkerSide:
    """Carries out plans on ``layers`` (5-D block views of vLLM's KV tensors, ``radixkv.
    integrations._vllm_layout.block_views``) with ``stack`` (whose namespace is the engine's and
    whose ``layout.page_size`` is vLLM's block size, a multiple of the views' kernel block).

    ``rank`` is this worker's tensor-parallel rank (its answers are tagged with it).  ``events``:
    a ``radixkv.integrations._vllm_events.WorkerEvents`` when vLLM's KV events are on (each
    stored chunk is named with the vLLM block hashes its store carries).  Thread-safe for vLLM's
    use: plans come from one thread; lookups run on one background thread.
    """

    def __init__(self, stack: TierStack, layers: Sequence[torch.Tensor], *, rank: int = 0,
                 max_held_bytes: int = 2 << 30, idle_wait_s: float = 0.05, events: Any = None) -> None:
        if not layers:
            raise ValueError("layers: vLLM registered no KV caches")
        self.stack = stack
        self.events = events
        self.layers = list(layers)
        self.rank = rank
        self.chunk_size = stack.chunk_size
        kernel_block = int(self.layers[0].shape[2])
        block = stack.layout.page_size
        if block % kernel_block or stack.chunk_size % block:
            raise ValueError(f"block sizes: vLLM's block {block} must be a multiple of the attention "
                             f"kernel's {kernel_block}, and chunk_size {stack.chunk_size} of {block}")
        self.split = block // kernel_block            # kernel blocks per vLLM block
        self.blocks_per_chunk = stack.chunk_size // block
        self.device = self.layers[0].device
        layout = stack.layout
        self.chunk_bytes = layout.token_bytes * stack.chunk_size
        self.max_held_bytes = max_held_bytes
        self.idle_wait_s = idle_wait_s
        self._takes_deadline = "deadline" in inspect.signature(stack.lookup).parameters and \
            "deadline" in inspect.signature(stack.load).parameters
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()            # the held-bytes count (the fetch thread changes it)
        self._calls = threading.RLock()          # the request table: plans, and lookup_now from the scheduler
        tiers = stack.tiers if "tiers" in inspect.signature(stack.lookup).parameters and \
            "tiers" in inspect.signature(stack.load).parameters else []
        self._memory_tiers = next((i for i, t in enumerate(tiers) if not getattr(t, "in_memory", False)), len(tiers))
        self._local_tiers = next((i for i, t in enumerate(tiers) if not getattr(t, "local", True)), len(tiers))
        self._held_bytes = 0
        self.load_errors: set[int] = set()        # vLLM block ids a load could not write
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-vllm-fetch")
        self.counters = dict.fromkeys(("lookups", "lookup_chunks", "held_chunks", "loads", "loaded_chunks",
                                       "loaded_tokens", "stored_chunks", "dropped_lookups", "lookups_at_once",
                                       "approximate_loads", "approximate_chunks"), 0)
        self.counters_f = {"fetch_seconds": 0.0, "load_seconds": 0.0, "store_seconds": 0.0}

    # -- plans ---------------------------------------------------------------------------------

    def begin(self, plan: Plan) -> None:
        """Forget, release and start what the plan says (before the step's forward).  O(plan)."""
        with self._calls:
            self._begin(plan)

    def _begin(self, plan: Plan) -> None:
        for req_id in plan.finished:
            self._release(self._requests.pop(req_id, None))
        for req_id in plan.drops:
            req = self._requests.get(req_id)
            if req is not None and (plan.upto is None or req.seq <= plan.upto):   # not a newer lookup_now's
                self._release(req)
        for lookup in plan.lookups:
            req = self._requests.get(lookup.req_id)
            if req is None or req.seq <= lookup.seq:
                self._lookup(lookup)

    def load(self, loads: Sequence[Load]) -> None:
        """Scatter held chunks into vLLM's blocks (synchronously: before the forward reads them).
        O(bytes loaded)."""
        with self._calls:
            self._load(loads)

    def _load(self, loads: Sequence[Load]) -> None:
        t0 = time.perf_counter()
        for load in loads:
            req = self._requests.get(load.req_id)
            if req is not None:
                self._held(req)
            if req is None or req.seq != load.seq or req.start != load.start or len(req.held) < load.num_chunks:
                # The scheduler commits only what this worker reported holding, so this is a bug:
                # report the blocks as not loaded (vLLM recomputes or fails the request), never
                # leave them unwritten silently.
                log.error("radixkv: request %s has no held chunks for load %d", load.req_id, load.seq)
                self.load_errors.update(load.block_ids[load.skip_blocks:])
                continue
            bpc = self.blocks_per_chunk
            lossy = sum(self.stack.approximate(c) for c in req.held[:load.num_chunks])
            if lossy:           # KV a lossy codec approximated (radixkv.core.codec): counted apart
                self.counters["approximate_loads"] += 1
                self.counters["approximate_chunks"] += lossy
            for i in range(load.num_chunks):
                chunk = load.start + i
                skip = min(max(load.skip_blocks - chunk * bpc, 0), bpc)
                if skip == bpc:
                    continue
                ids = load.block_ids[chunk * bpc + skip:(chunk + 1) * bpc]
                src = req.held[i]
                if src.device != self.device:
                    src = src.to(self.device)
                ops.scatter_blocks(src, self.layers, self._kernel_ids(ids), skip_blocks=skip * self.split)
                self.counters["loaded_tokens"] += len(ids) * self.stack.layout.page_size
            self.counters["loads"] += 1
            self.counters["loaded_chunks"] += load.num_chunks
            self._release(req)
        if self.device.type == "cuda" and loads:
            torch.cuda.current_stream(self.device).synchronize()
        self.counters_f["load_seconds"] += time.perf_counter() - t0

    def store(self, stores: Sequence[Store]) -> None:
        """Gather the chunks the step completed and queue them to the tiers (after the forward).
        O(bytes stored) copies; encoding and writes happen on the stack's thread."""
        if not stores:
            return
        with self._calls:
            self._store(stores)

    def _store(self, stores: Sequence[Store]) -> None:
        t0 = time.perf_counter()
        items: list[tuple[ChunkRef, torch.Tensor]] = []
        shape = self.stack.shape
        pin = self.device.type == "cuda"
        for st in stores:
            req = self._requests.get(st.req_id)
            if req is None:
                if not st.tokens:
                    continue                       # the prompt never reached this worker: skip
                req = self._requests[st.req_id] = _Request(st.tokens, request_namespace(self.stack.namespace,
                                                                                      st.salt, st.lora))
            refs = self._refs(req)
            bpc = self.blocks_per_chunk
            for i in range(len(st.block_ids) // bpc):
                chunk = st.first + i
                if chunk >= len(refs):
                    break
                if self.events is not None and len(st.names) >= (i + 1) * bpc:
                    self.events.name(refs[chunk].key, st.names[i * bpc:(i + 1) * bpc],
                                     st.names[i * bpc - 1] if i else st.parent)
                out = torch.empty(shape, dtype=self.stack.layout.dtype, pin_memory=pin)
                ops.gather_blocks(self.layers, self._kernel_ids(st.block_ids[i * bpc:(i + 1) * bpc]), out)
                items.append((refs[chunk], out))
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        self.counters["stored_chunks"] += self.stack.store(items)
        self.counters_f["store_seconds"] += time.perf_counter() - t0

    def report(self, idle: bool) -> Report | None:
        """The lookups finished since the last report; on an idle step (no forward), wait up to
        ``idle_wait_s`` for pending ones first, so that vLLM's loop does not spin.  O(requests)."""
        if idle:
            pending = [r.future for r in self._requests.values() if r.future is not None and not r.reported]
            deadline = time.monotonic() + self.idle_wait_s
            for fut in pending:
                try:
                    fut.result(timeout=max(deadline - time.monotonic(), 0.0))
                except Exception:  # noqa: BLE001 - a timeout, or a fault already turned into a miss
                    pass
        found: dict[str, dict[int, tuple[int, int]]] = {}
        with self._calls:
            for req_id, req in self._requests.items():
                if req.reported or req.future is None or not req.future.done():
                    continue
                req.reported = True
                found[req_id] = {self.rank: (req.seq, len(self._held(req)))}
        return Report(found) if found else None

    def lookup_now(self, lookup: Lookup) -> int | None:
        """Answer ``lookup`` at once from the leading in-memory tiers (see the module docstring):
        how many chunks from ``lookup.start`` this worker now holds for it, or ``None`` (nothing
        held, nothing changed but a released older lookup) when those tiers hold none, or fewer
        than the local tiers below them: the caller then sends the lookup the usual way.  Called
        from the scheduler's thread.  Cost: one ``contains_prefix`` per local tier (at most), then
        memory copies of the chunks."""
        if self._memory_tiers == 0:
            return None
        with self._calls:
            req, refs = self._prepare(lookup)
            if not refs:
                return None
            t0 = time.perf_counter()
            keys = [r.key for r in refs]
            deadline = time.monotonic() + lookup.timeout_s
            # One waterfall over the local tiers: the in-memory ones answer first, so a chunk that
            # only a tier below them holds shows up as a larger tier index.
            where = self.stack.lookup(keys, deadline=deadline, tiers=self._local_tiers)
            if not where or where[-1] >= self._memory_tiers:
                return None
            chunks = self.stack.load(refs[:len(where)], where=where, deadline=deadline, tiers=self._memory_tiers)
            self.counters_f["fetch_seconds"] += time.perf_counter() - t0
            if not chunks:
                return None
            with self._lock:
                self._held_bytes += len(chunks) * self.chunk_bytes
            req.held, req.reported = chunks, True
            for name, n in (("lookups", 1), ("lookups_at_once", 1), ("lookup_chunks", len(where)),
                            ("held_chunks", len(chunks))):
                self.counters[name] += n
            return len(chunks)

    # -- lookups -------------------------------------------------------------------------------

    def _lookup(self, lookup: Lookup) -> None:
        req, refs = self._prepare(lookup)
        req.reported = False
        self.counters["lookups"] += 1
        req.future = self._fetcher.submit(self._fetch, refs, lookup.timeout_s)

    def _prepare(self, lookup: Lookup) -> tuple[_Request, list[ChunkRef]]:
        """The request of ``lookup`` with any older lookup of it released, now numbered as this
        one, and the refs to look up (as many as the held-bytes bound leaves room for)."""
        req = self._requests.get(lookup.req_id)
        if req is None or req.tokens != lookup.tokens:
            self._release(req)
            req = self._requests[lookup.req_id] = _Request(
                lookup.tokens, request_namespace(self.stack.namespace, lookup.salt, lookup.lora))
        self._release(req)
        refs = self._refs(req)[lookup.start:lookup.start + lookup.max_chunks]
        with self._lock:
            room = max((self.max_held_bytes - self._held_bytes) // self.chunk_bytes, 0)
        req.seq, req.start = lookup.seq, lookup.start
        return req, refs[:room]

    def _fetch(self, refs: list[ChunkRef], timeout_s: float) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            if not refs:
                return []
            kw: dict[str, Any] = {"deadline": time.monotonic() + timeout_s} if self._takes_deadline else {}
            where = self.stack.lookup([r.key for r in refs], **kw)
            self.counters["lookup_chunks"] += len(where)
            chunks = self.stack.load(refs[:len(where)], where=where, **kw) if where else []
            with self._lock:
                self._held_bytes += len(chunks) * self.chunk_bytes
            self.counters["held_chunks"] += len(chunks)
            return chunks
        finally:
            self.counters_f["fetch_seconds"] += time.perf_counter() - t0

    def _held(self, req: _Request) -> list[torch.Tensor]:
        """The chunks a finished lookup holds (moved out of its future once)."""
        if req.future is not None and req.future.done():
            try:
                req.held = req.future.result()
            except Exception:  # noqa: BLE001 - the stack never raises for a tier fault; anything else is a miss
                req.held = []
            req.future = None
        return req.held

    def _release(self, req: _Request | None) -> None:
        if req is None:
            return
        fut, req.future = req.future, None
        if fut is not None:
            if not fut.cancel():
                # Running: its buffers are released when it ends.
                fut.add_done_callback(self._release_result)
            self.counters["dropped_lookups"] += 1
        if req.held:
            with self._lock:
                self._held_bytes -= len(req.held) * self.chunk_bytes
            req.held = []
        req.reported = True

    def _release_result(self, fut: Future[list[torch.Tensor]]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            with self._lock:
                self._held_bytes -= len(fut.result()) * self.chunk_bytes

    # -- the rest ------------------------------------------------------------------------------

    def _refs(self, req: _Request) -> list[ChunkRef]:
        if req.refs is None:
            keys = keys_from_token_bytes(req.tokens, self.chunk_size, req.namespace.root)
            step = 4 * self.chunk_size
            parents = [req.namespace.root, *keys[:-1]]
            req.refs = [ChunkRef(k, p, req.tokens[i * step:(i + 1) * step])
                        for i, (k, p) in enumerate(zip(keys, parents))]
        return req.refs

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        if self.split == 1:
            return list(block_ids)
        return [b * self.split + j for b in block_ids for j in range(self.split)]

    def held_bytes(self) -> int:
        """Bytes of chunk buffers held for lookups not committed yet.  O(1)."""
        with self._lock:
            return self._held_bytes

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the lookups, release what they hold, finish the queued writes (up to ``timeout``
        seconds) and close the tiers.  Idempotent."""
        log.info("radixkv connector closing: %d chunks loaded, %d stored, %d lookups",
                 self.counters["loaded_chunks"], self.counters["stored_chunks"], self.counters["lookups"])
        with self._calls:
            for req in list(self._requests.values()):
                self._release(req)
            self._requests.clear()
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        self.stack.close(timeout)

    def check(self) -> None:
        """Assert the worker side's invariants and the stack's.  Raises ``AssertionError``."""
        with self._lock:
            assert self._held_bytes >= 0, "negative held bytes"
        held = sum(len(r.held) for r in self._requests.values()) * self.chunk_bytes
        assert held <= self.held_bytes() or any(r.future for r in self._requests.values()), \
            "held chunks not accounted for"
        self.stack.check()
