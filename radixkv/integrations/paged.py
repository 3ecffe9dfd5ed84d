"""A reference paged engine loop: continuous batching in miniature, with the KV in the pool pages.

This module is the worked example for engine authors.  ``PagedEngine`` serves several requests at
once from a ``PrefixCache``, the way vLLM and SGLang do, at toy scale: every request's KV lives in
pool pages that the cache hands out, attention reads them through a per-request *block table*
(page ids in token order), and the cache is told about each page as soon as it is full.  The
model is a Hugging Face Llama-family model whose weights ``PagedLlama`` runs with its own forward;
no KV is kept anywhere but the cache's pools (``cache.pool.kv``; a KV group's pool for sliding-window layers).

One engine step, as ``PagedEngine.step`` does it:

1. **Admit** waiting requests (up to ``max_running``): ``req = cache.open(tokens, load="async")``
   returns at once holding the pool's longest cached prefix, ``req.page_ids`` for
   ``tokens[:req.num_cached]``.  Chunks the tiers (CPU, LMDB, S3) hold are fetched on a worker.
2. **Poll** every request with a pending load: ``req.poll()`` lands the load (new pool pages,
   held for the request) once it has arrived; until then the request sits out and the others
   keep decoding.  A load past its deadline is a miss: the request computes those tokens.
3. **Schedule**: each runnable request feeds the tokens whose KV is not computed yet — the
   uncached part of the prompt on its first step (prefill), one token afterwards (decode) — and
   needs pages for them: ``cache.alloc(n)``.  Its block table is ``[*held pages, *own pages]``.
4. **Forward** over all scheduled tokens at once (a varlen batch): each layer writes the new
   tokens' K/V into their slots (``table[pos // page_size]``, ``pos % page_size``) and each
   request's queries attend to the K/V read from its pages.  The last token's logits give the
   next token (greedy).
5. **Cache full pages**: when a request's computed tokens fill a page,
   ``table = req.extend(tokens, full_pages)`` caches them and returns the canonical page ids:
   where another request cached the same tokens first, its pages replace ours (ours are freed),
   and the block table is rewritten from ``table``.  The partial tail page stays the engine's.
6. **Finish**: a request that hit ``max_new_tokens`` or EOS calls ``req.release()`` and frees
   its tail page with ``cache.free``.  Everything it extended stays cached (unlocked), so a
   conversation's next turn, opened with the whole history, starts from those pages.

**Pool pressure** (``PoolExhausted`` from ``alloc``): requests have priority by admission order.
An older request that needs a page preempts the newest ones not yet scheduled in the step
(recompute preemption, as vLLM does): the victim releases its request, frees its own pages and
goes back to the front of the queue with every token it has, so when it is admitted again its
extended pages are matched (if the pool kept them) and only the rest is recomputed; its next
token comes out the same.  A request with nothing newer to preempt waits (it is preempted
itself).  Only when the oldest request alone cannot get its pages does ``step`` raise
``PoolExhausted``: the pool is too small for it (``abort`` it, or give the pool more pages).

**Failures leak nothing**: if ``alloc`` (other than ``PoolExhausted``) or the forward raises,
the pages this step allocated are freed and every request is as it was before the step, so the
step can be retried; ``abort``/``close`` release everything.  ``check()`` asserts it.

Supported models: Llama, Qwen2 and Mistral (the Llama decoder layout: RMSNorm, q/k/v/o
projections with rotary embeddings, grouped-query attention, gated MLP), including their
sliding-window layers (Mistral's window, Qwen2's sliding layers): a sliding layer writes and reads
its KV group's pages (``cache.groups``), whose pages outside the window the cache drops as the
request moves on, and its queries see only the last ``window`` positions.  The pool may hold
another dtype than the model (K/V are converted on the way in and out).

The model runner is ``radixkv.integrations.paged_model`` (``PagedLlama``: a Hugging Face Llama's
weights run over the pool's pages); the blended prefill is ``radixkv.integrations.paged_blend``.

**Blending** (opt-in, ``PagedEngine(..., blend=Blend(ratio=0.15))``; see ``radixkv.reuse.blend``): a prompt
added with ``segments=[(start, end), ...]`` (its documents) reuses each document's KV from the
segment cache (``radixkv.reuse.segments``, in the cache's tiers) wherever it sits in the prompt: at
admission, after the prefix match, each document past the matched prefix is loaded (bounded by
``Blend.deadline_s``; one not held is computed on its own and stored when ``store_missing``),
its keys moved to their positions, and the request's prefill runs alone through
``blend_prefill``, recomputing only a share of the reused tokens.  Its KV is then approximate:
the request is marked ``approximate``, nothing past its exact part (the tokens before its first
reused document, e.g. a system prompt, whose KV depends on no reused KV) is cached in the tree, and
``stats()`` counts it apart.  Decoding batches with the other requests as usual.

Example (random weights, nothing downloaded)::

    import radixkv as rk
    from radixkv.integrations.paged import PagedEngine
    from radixkv.integrations.transformers import layout_for, namespace_for, random_model

    model = random_model("llama", seed=0)
    cache = rk.PrefixCache(layout_for(model, page_size=16), num_pages=1024, namespace=namespace_for(model))
    engine = PagedEngine(model, cache)
    a = engine.add(system_prompt + question, max_new_tokens=32)
    b = engine.add(system_prompt + other_question, max_new_tokens=32)
    engine.run()                               # a.output, b.output: the generated tokens
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from radixkv.core._checks import check_int
from radixkv.core.cache import PoolExhausted, PrefixCache
from radixkv.core.hashing import as_token_bytes
from radixkv.core.request import LOAD_MODES, Request
from radixkv.integrations.hf_model import check_blendable
from radixkv.integrations.paged_blend import BlendPlan, blend_prefill, segment_kv
from radixkv.integrations.paged_model import Chunk, PagedLlama
from radixkv.reuse.blend import Blend, BlendInfo, recover_positions
from radixkv.reuse.segments import SegmentCache, Span, check_spans

__all__ = ["EngineRequest", "PagedEngine"]

_NO_PAGES = np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------ the engine

_request_ids = itertools.count(1)


@dataclass(eq=False)
class EngineRequest:
    """One prompt to complete, from ``PagedEngine.add`` to its end.

    ``tokens`` is the prompt followed by the generated tokens (``output``).  ``state`` is
    ``"waiting"`` (queued, or preempted), ``"loading"`` (its tier load is pending), ``"running"``,
    ``"finished"`` or ``"aborted"``.  While admitted, ``request`` is the cache's ``Request``,
    ``held`` the canonical pages of ``tokens[:request.num_cached]`` and ``own`` the engine's pages
    after them; the KV of ``tokens[:kv_len]`` is in those pages.  ``logits`` (with
    ``keep_logits``) holds the last-token logits of each step: ``logits[i]`` chose ``output[i]``.
    ``cached_at_start`` records, per admission, how many prompt tokens came from the cache (pool
    and tiers); ``tier_tokens`` counts those loaded from the tiers; ``preemptions`` counts how
    often it was sent back to the queue.  ``segments``: the prompt's document spans (used when the
    engine blends); ``approximate``: its prefill was blended (its KV, and so its output, may differ
    from a full prefill's) and nothing past ``exact_len`` is cached; ``exact_len``: the tokens whose
    KV is exact (a blended request's, up to its first reused token: the prefix before its first
    document, e.g. a system prompt, is cached as any exact prefix); ``blend``: what the last
    blended prefill did (``BlendInfo``).
    """

    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    eos_token_id: int | None = None
    id: int = field(default_factory=lambda: next(_request_ids))
    state: str = "waiting"
    request: Request | None = field(default=None, repr=False)
    held: np.ndarray = field(default_factory=lambda: _NO_PAGES, repr=False)
    own: list[int] = field(default_factory=list, repr=False)
    kv_len: int = 0
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    cached_at_start: list[int] = field(default_factory=list)
    tier_tokens: int = 0
    preemptions: int = 0
    segments: tuple[Span, ...] = ()
    approximate: bool = False
    exact_len: int | None = None                                  # set by a blended prefill
    blend: BlendInfo | None = None
    plan: BlendPlan | None = field(default=None, repr=False)      # set from admission to the prefill

    @property
    def output(self) -> list[int]:
        """The generated tokens so far."""
        return self.tokens[self.prompt_len:]

    @property
    def done(self) -> bool:
        """Whether it has all its tokens (``max_new_tokens`` of them, or EOS last)."""
        out = len(self.tokens) - self.prompt_len
        return out >= self.max_new_tokens or (out > 0 and self.tokens[-1] == self.eos_token_id)

    @property
    def block_table(self) -> torch.Tensor:
        """The page ids of its computed tokens, in order: held pages, then its own (int64)."""
        return torch.from_numpy(np.concatenate([self.held, np.asarray(self.own, dtype=np.int64)]))


class PagedEngine:
    """Continuous batching over a ``PrefixCache`` with a Llama-family model: see the module docstring.

    ``max_running`` bounds the requests admitted at once (loading or running); ``load`` is how
    ``cache.open`` treats the tiers (``"async"``: poll each step, ``"wait"``, ``"none"``);
    ``deadline_s`` the load deadline (default the cache's ``load_timeout``); ``keep_logits``
    keeps each step's last-token logits on the request (for tests).  The engine assumes it is
    the cache's only user of ``alloc`` while it runs (``check`` counts engine-held pages).
    ``blend`` (a ``Blend``; default ``None``, off) turns blending on, with document KV in
    ``segments`` (default: a ``SegmentCache`` over the cache's own tiers; ``ValueError`` when the
    cache has none, or when the model cannot be blended).  Used from one thread.
    """

    def __init__(self, model: Any, cache: PrefixCache, *, max_running: int = 8, load: str = "async",
                 deadline_s: float | None = None, keep_logits: bool = False, blend: Blend | None = None,
                 segments: SegmentCache | None = None) -> None:
        if not isinstance(cache, PrefixCache):
            raise TypeError(f"cache must be a PrefixCache, got {type(cache).__name__}")
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {LOAD_MODES}, got {load!r}")
        if blend is not None and not isinstance(blend, Blend):
            raise TypeError(f"blend must be a radixkv.reuse.blend.Blend or None, got {type(blend).__name__}")
        if segments is not None and not isinstance(segments, SegmentCache):
            raise TypeError(f"segments must be a SegmentCache or None, got {type(segments).__name__}")
        if blend is not None:
            check_blendable(model)
            if segments is None and cache.stack is None:
                raise ValueError("segments: blending keeps documents' KV in tiers and the cache has none; "
                                 "pass segments=SegmentCache(TierStack([...]))")
            segments = segments if segments is not None else SegmentCache(cache.stack)   # type: ignore[arg-type]
        self.blend = blend
        self.segments = segments
        self.max_running = check_int(max_running, "max_running", 1)
        self.model = PagedLlama(model, cache)
        self.cache = cache
        self.page_size = cache.page_size
        self.load = load
        self.deadline_s = deadline_s
        if type(keep_logits) is not bool:
            raise TypeError(f"keep_logits must be a bool, got {type(keep_logits).__name__}")
        self.keep_logits = keep_logits
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []      # admitted (loading or running), oldest first
        self.finished: list[EngineRequest] = []
        self.steps = 0
        self._counts = dict.fromkeys(("requests_exact", "requests_blended", "segments_reused",
                                      "segments_computed", "segments_fresh", "blend_reused_tokens",
                                      "blend_computed_rows", "full_rows"), 0)

    def __repr__(self) -> str:
        return (f"PagedEngine({len(self.running)} admitted, {len(self.waiting)} waiting, "
                f"{len(self.finished)} finished, {self.steps} steps)")

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or admitted."""
        return bool(self.waiting or self.running)

    def add(self, tokens: Any, max_new_tokens: int, *, eos_token_id: int | None = None,
            segments: Any = ()) -> EngineRequest:
        """Queue a prompt (1-D token ids, not empty) to generate up to ``max_new_tokens`` (>= 1)
        tokens greedily after; return its ``EngineRequest``.  ``segments``: the prompt's documents
        as ``(start, end)`` spans (not overlapping), reused by blending when the engine blends and
        ignored otherwise.  O(len(tokens))."""
        check_int(max_new_tokens, "max_new_tokens", 1)
        if eos_token_id is not None:
            check_int(eos_token_id, "eos_token_id")
        data = as_token_bytes(tokens)
        if not data:
            raise ValueError("tokens must not be empty")
        ids = np.frombuffer(data, dtype="<i4").tolist()
        req = EngineRequest(ids, len(ids), max_new_tokens, eos_token_id, segments=check_spans(segments, len(ids),
                                                                                            "segments"))
        self.waiting.append(req)
        return req

    def run(self, max_steps: int = 100_000) -> list[EngineRequest]:
        """Step until every request is finished (at most ``max_steps`` steps); return those that
        finished, in order.  Cost: ``step``'s, per step."""
        check_int(max_steps, "max_steps", 1)
        done: list[EngineRequest] = []
        for _ in range(max_steps):
            if not self.busy:
                break
            done += self.step()
        return done

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[EngineRequest]:
        """One engine iteration (admit, poll, schedule, forward, cache full pages, finish); return
        the requests that finished in it.  When nothing could run because every admitted request
        is loading, waits for the oldest load (bounded by its deadline) instead of spinning.
        Raises ``PoolExhausted`` when the oldest request alone cannot get its pages.
        Cost: one forward over the batch's tokens plus the cache calls above."""
        self.steps += 1
        finished = [r for r in self.running if r.done]     # done but not finished: an earlier step raised
        for r in finished:
            self._finish(r)
        self._admit()
        ready = [r for r in self.running if self._ready(r)]
        batch = self._schedule(ready)
        if not batch:
            loading = [r for r in self.running if r.state == "loading"]
            if loading and loading[0].request is not None:
                loading[0].request.wait(timeout=1.0)
            return finished
        try:
            logits = self._forward([r for r, _ in batch])
        except BaseException:
            self._undo(batch)
            raise
        for (r, _), row in zip(batch, logits):            # nothing here can fail: bookkeeping only
            r.kv_len = len(r.tokens)
            if self.keep_logits:
                r.logits.append(row.detach().clone())
            r.tokens.append(int(row.argmax()))
        for r, _ in batch:
            self._cache_full_pages(r)
            if r.done:
                self._finish(r)
                finished.append(r)
        return finished

    def _forward(self, batch: list[EngineRequest]) -> list[torch.Tensor]:
        """The last-token logits of each request's scheduled tokens: one varlen forward for the
        plain ones, one ``blend_prefill`` each for those with a blend plan.  Counts the rows."""
        plain = [r for r in batch if r.plan is None]
        rows: dict[int, torch.Tensor] = {}
        if plain:
            out = self.model.forward([Chunk(torch.tensor(r.tokens[r.kv_len:]), r.kv_len, r.block_table)
                                      for r in plain])
            rows.update((id(r), row) for r, row in zip(plain, out))
        infos = []
        for r in batch:
            if r.plan is not None:
                assert self.blend is not None
                row, info = blend_prefill(self.model, torch.tensor(r.tokens[r.kv_len:]), r.kv_len, r.block_table,
                                          r.plan.cached, r.plan.reused, self.blend.ratio)
                rows[id(r)] = row
                infos.append((r, info))
        for r, info in infos:                      # bookkeeping once nothing can fail any more
            assert r.plan is not None
            first_reused = int(torch.nonzero(r.plan.reused)[0, 0])  # a plan reuses at least one token
            r.exact_len = r.kv_len + first_reused if r.exact_len is None else min(r.exact_len, r.kv_len + first_reused)
            r.plan, r.blend, r.approximate = None, info, True
            self._counts["blend_reused_tokens"] += info.reused
            self._counts["blend_computed_rows"] += sum(info.computed)
        self._counts["full_rows"] += sum(len(r.tokens) - r.kv_len for r in plain) * len(self.model.inner.layers)
        return [rows[id(r)] for r in batch]

    def _admit(self) -> None:
        """Open waiting requests while there is room; ``open`` returns at once with ``async``."""
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            req = self.cache.open(r.tokens, load=self.load, deadline_s=self.deadline_s)
            self.waiting.popleft()
            r.request = req
            self.running.append(r)
            if req.pending:
                r.state = "loading"
            else:
                self._start(r)

    def _ready(self, r: EngineRequest) -> bool:
        """Poll a loading request (non-blocking); whether it can be scheduled now."""
        if r.state == "loading":
            assert r.request is not None
            if not r.request.poll():
                return False
            self._start(r)
        return r.state == "running"

    def _start(self, r: EngineRequest) -> None:
        assert r.request is not None
        r.state = "running"
        r.held = r.request.page_ids.copy()
        r.kv_len = r.request.num_cached
        r.cached_at_start.append(r.request.num_cached)
        r.tier_tokens += r.request.tier_tokens
        if self.blend is not None and r.segments:
            r.plan = self._plan(r)

    def _plan(self, r: EngineRequest) -> BlendPlan | None:
        """The documents of ``r`` past its cached prefix, each loaded from the segment cache (or
        computed on its own and stored, with ``store_missing``) and moved to its position; ``None``
        when none can be reused.  Cost per document: a segment load (bounded by the deadline) or
        one forward over it, and one rotation of its keys."""
        assert self.blend is not None and self.segments is not None
        layers, kvh, dim = len(self.model.inner.layers), self.model.num_kv_heads, self.model.head_dim
        count = len(r.tokens) - r.kv_len
        cached = torch.zeros(layers, 2, count, kvh, dim, dtype=self.cache.layout.dtype)
        reused = torch.zeros(count, dtype=torch.bool)
        inv_freq = self.model.inner.rotary_emb.inv_freq
        for span in r.segments:
            if span.start < r.kv_len:            # (part of) it is in the exact prefix already
                continue
            doc = r.tokens[span.start:span.end]
            deadline = None if self.blend.deadline_s is None else time.monotonic() + self.blend.deadline_s
            kv = self.segments.load(doc, deadline=deadline)
            if kv is None and self.blend.store_missing:
                kv = segment_kv(self.model.model, doc, self.cache.layout.dtype)
                self.segments.store(doc, kv)
                self._counts["segments_computed"] += 1
            elif kv is None:
                self._counts["segments_fresh"] += 1
                continue
            else:
                self._counts["segments_reused"] += 1
            lo, hi = span.start - r.kv_len, min(span.end, len(r.tokens) - 1) - r.kv_len   # never the last token
            if hi <= lo:
                continue
            cached[:, :, lo:hi] = recover_positions(kv[:, :, :hi - lo], span.start, inv_freq)
            reused[lo:hi] = True
        return BlendPlan(cached, reused) if bool(reused.any()) else None

    def _schedule(self, ready: list[EngineRequest]) -> list[tuple[EngineRequest, list[int]]]:
        """Pages for each ready request's tokens this step, oldest first, preempting the newest
        requests when the pool is short; the scheduled requests and the pages each got."""
        batch: list[tuple[EngineRequest, list[int]]] = []
        try:
            for r in ready:
                if r.state != "running":                     # preempted for an older one meanwhile
                    continue
                need = -(-len(r.tokens) // self.page_size) - len(r.held) - len(r.own)
                fresh = self._alloc(r, need, {id(s) for s, _ in batch}) if need > 0 else []
                if fresh is None:
                    continue
                r.own += fresh
                batch.append((r, fresh))
        except BaseException:
            self._undo(batch)
            raise
        return batch

    def _alloc(self, r: EngineRequest, n: int, scheduled: set[int]) -> list[int] | None:
        """``n`` pages for ``r``, preempting newer unscheduled requests while the pool is short;
        ``None`` when ``r`` had to wait (it was preempted itself)."""
        while True:
            try:
                return self.cache.alloc(n).tolist()
            except PoolExhausted:
                newer = self.running[self.running.index(r) + 1:]
                victims = [s for s in newer if id(s) not in scheduled]
                if victims:
                    self._preempt(victims[-1])
                elif len(self.running) > 1:
                    self._preempt(r)
                    return None
                else:
                    raise

    def _undo(self, batch: list[tuple[EngineRequest, list[int]]]) -> None:
        """Give back the pages a failed step allocated: every request is as before the step."""
        for r, fresh in batch:
            if fresh:
                del r.own[-len(fresh):]
                self.cache.free(fresh)

    def _cache_full_pages(self, r: EngineRequest) -> None:
        """Cache the pages ``r``'s computed tokens have filled; adopt the canonical page table."""
        assert r.request is not None
        exact = r.kv_len if not r.approximate or r.exact_len is None else min(r.kv_len, r.exact_len)
        new = exact // self.page_size - len(r.held)
        if new <= 0:                               # blended KV is never cached: only what is exact before it
            return
        upto = exact if exact < r.kv_len else r.kv_len          # a blended request: its exact prefix only
        table = r.request.extend(r.tokens[:upto], r.own[:new])
        r.held = table.numpy()
        del r.own[:new]

    def _finish(self, r: EngineRequest) -> None:
        self._drop(r)
        self._counts["requests_blended" if r.approximate else "requests_exact"] += 1
        r.state = "finished"
        self.finished.append(r)

    def _preempt(self, r: EngineRequest) -> None:
        """Send ``r`` back to the front of the queue, holding nothing (recompute preemption)."""
        self._drop(r)
        r.state = "waiting"
        r.preemptions += 1
        self.waiting.appendleft(r)

    def _drop(self, r: EngineRequest) -> None:
        """Release ``r``'s request and free its own pages (the tail page: never cached)."""
        if r.request is not None:
            r.request.release()
            r.request = None
        if r.own:
            self.cache.free(r.own)
        r.own, r.held, r.kv_len, r.plan = [], _NO_PAGES, 0, None
        if r in self.running:
            self.running.remove(r)

    def abort(self, r: EngineRequest) -> None:
        """Stop ``r`` wherever it is: release its request and free its pages.  O(pages)."""
        if r.state in ("finished", "aborted"):
            raise ValueError(f"r: request {r.id} is {r.state} already")
        if r in self.waiting:
            self.waiting.remove(r)
        self._drop(r)
        r.state = "aborted"

    def close(self) -> None:
        """Abort every request still waiting or admitted.  Idempotent."""
        for r in [*self.running, *self.waiting]:
            self.abort(r)

    def stats(self) -> dict[str, Any]:
        """The engine's counters, blended requests apart from exact ones: ``requests_exact`` and
        ``requests_blended`` (finished), ``segments_reused`` (loaded from the segment cache),
        ``segments_computed`` (computed on their own and stored), ``segments_fresh`` (not held,
        computed in the prompt), ``blend_reused_tokens``, ``blend_computed_rows`` (token-layers
        recomputed by blended prefills), ``full_rows`` (token-layers of plain forwards); with
        blending, ``segments`` (the ``SegmentCache``'s counters).  A new dict.  O(1)."""
        out: dict[str, Any] = dict(self._counts)
        if self.segments is not None:
            out["segments"] = self.segments.stats()
        return out

    def check(self) -> None:
        """Assert the engine's invariants and the cache's (``cache.check``).  O(pages + requests).

        Every admitted running request holds exactly its ``Request``'s pages and owns the pages
        of its computed tokens past them (an approximate one: nothing past its exact prefix is in
        the tree); the engine-held pages of the cache are exactly the requests' own pages; waiting
        requests hold nothing; a blend plan waits only for its request's prefill.
        """
        self.cache.check()
        ps = self.page_size
        owned: list[int] = []
        for r in self.running:
            assert r.request is not None and not r.request.released, f"{r}: admitted without a request"
            owned += r.own
            if r.state == "loading":
                assert not r.own, f"{r}: owns pages while loading"
                continue
            assert r.state == "running", f"{r}: state {r.state} among the admitted"
            assert np.array_equal(r.held, r.request.page_ids), f"{r}: block table differs from the held pages"
            assert len(r.held) * ps == r.request.num_cached <= r.kv_len < len(r.tokens), f"{r}: token counts"
            assert len(r.held) + len(r.own) == -(-r.kv_len // ps), f"{r}: pages for {r.kv_len} tokens"
            assert r.plan is None or (r.kv_len == r.request.num_cached and len(r.plan.reused) ==
                                      len(r.tokens) - r.kv_len), f"{r}: a blend plan after its prefill"
            assert not r.approximate or (r.blend is not None and r.request.num_cached == r.cached_at_start[-1]), \
                f"{r}: approximate KV cached"
        for r in self.waiting:
            assert r.request is None and not r.own and r.state == "waiting" and r.plan is None, \
                f"{r}: waiting but holding"
        assert len(set(owned)) == len(owned), "a page is owned by two requests"
        assert self.cache.stats()["pages_engine"] == len(owned), "engine-held pages != the requests' own pages"
