"""A state machine for the engine contract: many requests in flight, each holding its pages.

``RequestMachine`` plays a paged, continuous-batching engine against ``PrefixCache.open``: requests
are opened (loads from a tier waited for, or left pending), prefilled into pages from ``alloc``,
cached with ``extend`` as decoding fills pages, polled, released — in any order, with eviction
pressure and tier loads held back by a gate (``GatedTier``) so that loads stay pending across
steps.  The "engine" writes each token's id and position into its KV slot, so after every step
the machine checks that every page a live request holds still holds that request's tokens: a held
page that was freed, reused or overwritten fails the run, as does a wrong ``check()``.

Whether or not ``check()`` runs, an ``EvictionModel`` (``radixkv.testing.machines``) follows every call
and checks what it evicts: least recently used unheld leaves first, and (where no sliding pool
smaller than the main one is short) exactly as many pages as ``alloc`` or a load was short;
``evictable_size`` and ``protected_size`` agree with what live requests and pins hold; ``open``
and the one-call ``match`` hold whole pages, leave the last token when asked and cover at least
what the pool held.  With an exact tier below (the default ``MemoryTier``), every chunk of a
full-attention group the pool takes in is stored there (``write_through``), and every chunk the
pool lets go that the tier holds counts as just used there (``TierStack.touch``).  Rules aim at
the cases a random walk rarely meets: a sequence reloaded after the pool let it go, the load
starting a page into a chunk or at the first chunk of a store; and a prefix of a least recently
used leaf (or all of the leaf cached first) used just before an eviction, which must then outlive
the leaves used before it.

Two runs in three use a layout with sliding-window layers (``layer_windows``: a full layer and one or
two sliding ones, or every layer sliding, windows of 2–8 tokens; sometimes a small
``window_pages``), so the KV groups are covered too: the engine writes every group's pages (a
sliding group's through ``cache.groups``), and each live request must hold, in every sliding group,
the pages of its window (the last ``cache.groups.need[i]`` of its pages) with the right KV; its
pages outside the window may be dropped, and those that are not still hold the right KV.  No
sliding page is kept outside the window of every reuse point the engine knows of (a leaf, a branch
point, the end of a live request or a pin), and no sliding pool hands out more pages than the tree
and the engine hold.  A request whose pages end at a leaf or a branch point that comes straight
back (a retry) gets all of them but its last token's page from the pool: the window of a match that
stops a page short of a reuse point is kept.

Run it as it is (``TestRequests = RequestMachine.TestCase``) or subclass it and override
``make_tiers`` to put your own backend below the same checks.
"""

from __future__ import annotations

from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Sequence

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.backends import MemoryTier, Tier
from radixkv.core.cache import Match, PoolExhausted, PrefixCache
from radixkv.core.pool import KVGroup, KVLayout
from radixkv.core.request import Request
from radixkv.testing.machines import EvictionModel, Held, resident_tokens
from radixkv.testing.wrappers import GatedTier, RecordingTier

__all__ = ["GatedTier", "RequestMachine", "SlidingRequestMachine", "layer_windows"]


def layer_windows(max_window: int = 8, plain: bool = True) -> st.SearchStrategy[tuple[int, ...] | None]:
    """``KVLayout.windows`` for a tiny model: ``None`` (full attention only) a third of the time
    (never without ``plain``), else 2 or 3 layers with a full-attention layer and sliding ones of
    2..``max_window`` tokens (one or two windows), or every layer sliding (Mistral)."""
    w = st.integers(2, max_window)
    grouped = st.one_of(st.tuples(st.just(0), w), st.tuples(w, st.just(0), w), st.tuples(w, w))
    return st.integers(0 if plain else 1, 2).flatmap(lambda g: grouped if g else st.none())


class _Live:
    """The engine's side of one request: its tokens, the pages it computed and not yet cached
    (``tail``: the partial last page), and the request."""

    def __init__(self, tokens: list[int], req: Request) -> None:
        self.tokens = tokens
        self.req = req
        self.tail: int | None = None        # an engine page holding the partial last page
        self.prefilled = False
        #: Positions of the pages it matched whose sliding page a trim had dropped already.
        self.tombs: frozenset[int] = frozenset()


class RequestMachine(RuleBasedStateMachine):
    """Requests in flight through ``open`` / ``alloc`` / ``extend`` / ``poll`` / ``release``.

    Override ``make_tiers`` (the backends below the pool; wrapped in a ``GatedTier``) to test your
    own.  Pools of 6–16 pages of 1–3 tokens and chunks of two pages (one or two with sliding
    layers) keep evictions, splits of held nodes and unaligned tier loads in every run.  ``layouts``
    draws each run's layer windows (``layer_windows``); ``SlidingRequestMachine`` always slides.
    """

    #: The tier below keeps every chunk stored in it (the default ``MemoryTier`` never evicts and,
    #: not being a victim tier, gets every chunk at insert): then a load that is waited for must bring
    #: back every stored chunk the pool has room for (recall).  Set ``False`` for a bounded tier.
    exact_tier = True

    def make_tiers(self) -> list[Tier]:
        """The backend below the pool, as a list of exactly one tier (the machine wraps it in a
        ``RecordingTier`` and a ``GatedTier``; any other length is a ``TypeError`` at setup): a
        ``MemoryTier``.  Override it to put your own under the same checks (``exact_tier = False``
        for a bounded one).  O(1)."""
        return [MemoryTier()]

    #: ``KVLayout.windows`` of each run (``None``: full attention only).
    layouts: st.SearchStrategy[tuple[int, ...] | None] = layer_windows()

    @initialize(page_size=st.integers(1, 3), num_pages=st.integers(6, 16), data=st.data())
    def setup(self, page_size: int, num_pages: int, data: st.DataObject) -> None:
        """The run's cache: ``num_pages`` pages of ``page_size`` tokens and a layout drawn from
        ``layouts``; chunks of two pages, or with sliding layers one or two and maybe a smaller
        ``window_pages``; over ``make_tiers()`` behind a ``RecordingTier`` and a ``GatedTier`` whose
        gate is open.  No request in flight.  Cost: O(num_pages x groups)."""
        windows = data.draw(self.layouts, label="windows")
        layout = KVLayout(num_layers=len(windows) if windows else 1, num_kv_heads=1, head_dim=2,
                          dtype=torch.float32, page_size=page_size, windows=windows)
        window_pages, chunk_pages = None, 2
        if layout.grouped:        # sliding pools short of the main one; chunks of one page: keep == need
            window_pages = data.draw(st.one_of(st.none(), st.integers(max(2, num_pages // 3), num_pages)),
                                     label="window_pages")
            chunk_pages = data.draw(st.integers(1, 2), label="chunk_pages")
        #: Every access and write of the tier below, for the recency check of evictions.
        tiers = self.make_tiers()
        if not isinstance(tiers, (list, tuple)) or len(tiers) != 1 or not isinstance(tiers[0], Tier):
            raise TypeError(f"make_tiers must return a list of exactly one Tier (the machine checks one "
                            f"backend below the pool), got {tiers!r}")
        self.recorder = RecordingTier(tiers[0])
        self.gated = GatedTier(self.recorder)
        self.cache = PrefixCache(layout, num_pages=num_pages, chunk_size=chunk_pages * page_size,
                                 tiers=[self.gated], load_timeout=30.0, window_pages=window_pages)
        self.ps = page_size
        groups = self.cache.groups
        #: Every KV group and the pool that holds its KV (``None``: the layout has no groups).
        self.parts = ([(g, groups.pool_of(g)) for g in layout.groups] if groups is not None
                      else [(None, self.cache.pool)])
        self.live: list[_Live] = []
        self.seen: list[list[int]] = []     # sequences cached before: re-requested with new suffixes
        self.pinned: dict[tuple[int, ...], list[int]] = {}
        self.stored: set[tuple[int, ...]] = set()   # chunk-aligned prefixes cached so far
        self.pin_held: dict[tuple[int, ...], int] = {}
        self.model = EvictionModel(page_size)
        self.matched: list[tuple[list[int], int]] = []   # one-call matches held during a step
        self.resident: dict[bytes, str] = {}        # tier key of each chunk the pool held -> its name
        self.mark = self.recorder.mark()

    def teardown(self) -> None:
        """Open the gate, so that pending loads finish, and close the cache (once set up): queued tier
        writes land, then the tiers close.  Cost: the pending loads and queued writes."""
        if hasattr(self, "cache"):
            self.gated.gate.set()
            self.cache.close()

    # ---------------------------------------------------------------- the engine's KV

    def _ids(self, group: KVGroup | None, pages: Any) -> np.ndarray:
        """The page ids in ``group``'s pool of tree (or engine) pages ``pages``; ``-1``: dropped."""
        if group is None:
            return np.array(pages, dtype=np.int64)
        return self.cache.groups.pages_of(group, pages)   # type: ignore[union-attr]

    def _write(self, page: int, slot: int, token: int, pos: int) -> None:
        """The KV of ``token`` at ``pos`` into slot ``slot`` of ``page``, in every group's pool."""
        for group, pool in self.parts:
            (gid,) = self._ids(group, [page])
            assert gid >= 0, f"engine page {page} has no page in group {group.tag()}"   # type: ignore[union-attr]
            pool.kv[:, :, gid, slot, :, 0] = token
            pool.kv[:, :, gid, slot, :, 1] = pos

    def _fill(self, tokens: list[int], start: int, pages: list[int]) -> None:
        """Prefill: the KV of token t at position i is (t, i)."""
        for j, page in enumerate(pages):
            for k in range(self.ps):
                pos = start + j * self.ps + k
                if pos < len(tokens):
                    self._write(page, k, tokens[pos], pos)

    def _cached(self, tokens: list[int], num_cached: int) -> None:
        """Remember the chunk-aligned prefixes of ``tokens[:num_cached]``: they went down to the tier."""
        cs = self.cache.chunk_size
        self.stored.update(tuple(tokens[:k * cs]) for k in range(1, num_cached // cs + 1))

    def _recallable(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` (less the last) that a waited-for load must bring back: the leading
        stored chunks, when the pool has room for all of them without touching held pages."""
        self.cache.flush()
        cs, ps = self.cache.chunk_size, self.ps
        n = 0
        while (n + 1) * cs <= len(tokens) - 1 and tuple(tokens[:(n + 1) * cs]) in self.stored:
            n += 1
        room = self.cache.pool.num_free + self.model.evictable(self._held())
        return n * cs if room >= n * cs // ps else 0

    def _recallable_grouped(self, tokens: list[int]) -> int:
        """``_recallable`` of a grouped cache, a weaker property: a sliding group's chunks are stored
        only while inside a window, and a load probes a few ends only, so exact recall is not
        modelled.  When the tier holds every chunk of every group of ``tokens`` (less the last) and
        every pool has that many pages free (no eviction needed), a waited-for load must bring all
        of it back; otherwise nothing is required."""
        self.cache.flush()
        cs, ps = self.cache.chunk_size, self.ps
        n = (len(tokens) - 1) // cs
        if n == 0:
            return 0
        for stack in self.cache.stacks:
            keys = [stack.namespace.id + ref.key for ref in stack.refs(tokens[:n * cs])]
            if self.gated.inner.contains_prefix(keys) < n:
                return 0
        pools = [self.cache.pool, *self.cache.groups.pools]          # type: ignore[union-attr]
        return n * cs if min(pool.num_free for pool in pools) >= n * cs // ps else 0

    # ---------------------------------------------------------------- the eviction model

    def _held(self) -> Held:
        """What live requests, pins and one-call matches hold: (tokens, tokens held) each."""
        pins = self.cache.pins
        return ([(x.tokens, x.req.num_cached) for x in self.live] + self.matched
                + [(t, pins[np.asarray(t, dtype="<i4").tobytes()].num_cached) for t in self.pinned.values()])

    def _observe(self, what: str, asked: int | Callable[[int], int] | None = 0) -> int:
        """``EvictionModel.observe`` of the call ``what`` that just ran; the pages it evicted."""
        return self.model.observe(self.cache.tree, self._held(), asked, what)

    def _taking(self, pages: int | None = None) -> int | Callable[[int], int] | None:
        """What the next call may evict: ``pages`` it takes (``None``: a tier load, a page for each
        page it inserts), less the free ones.  ``None`` (not modelled) where a sliding pool smaller
        than the main one may be short of them: ``alloc`` then evicts leaf by leaf until it has
        room.  (A sliding pool as large as the main one never is: each of its pages belongs to a
        main pool page.)"""
        free, groups = self.cache.pool.num_free, self.cache.groups
        if groups is not None and any(pool.num_pages < self.cache.pool.num_pages for pool in groups.pools) and \
                (pages is None or min(pool.num_free for pool in groups.pools) < pages):
            return None
        return (lambda new: max(0, new - free)) if pages is None else max(0, pages - free)

    def _used(self, tokens: list[int], num_cached: int, landed: bool = True) -> None:
        """Tell the model what a lookup of ``tokens`` used: what it holds now, when it matched
        (``open``, ``match``) or a load of it landed (``landed``).  A load may also have used more of
        what the tree holds of ``tokens`` (with groups, all it fetched; without, the tree's match of
        a load that brought nothing new): that is marked as maybe used."""
        if landed:
            self.model.touch(tokens, num_cached)
        if not landed or self.cache.groups is not None:
            self.model.touch_maybe(tokens, len(tokens))

    def _alloc(self, n: int) -> list[int] | None:
        """``cache.alloc(n)`` (``None``: ``PoolExhausted``): it refuses only when free and unheld
        pages are too few, and evicts least recently used leaves, just as many as it is short."""
        asked, free = self._taking(n), self.cache.pool.num_free
        try:
            new = self.cache.alloc(n)
        except PoolExhausted:
            self._observe(f"a refused alloc({n})", None if asked is None else 0)
            if asked is not None and free + self.model.evictable(self._held()) >= n:
                raise AssertionError(f"alloc({n}) raised PoolExhausted with {free} pages free and "
                                     f"{self.model.evictable(self._held())} cached that no request holds") from None
            return None
        assert len(new) == n, f"alloc({n}) returned {len(new)} pages"
        assert not self.cache.pool.is_free(new).any(), f"alloc({n}) returned {new.tolist()}: the pool says free"
        self._observe(f"alloc({n}) with {free} pages free", asked)
        return new.tolist()

    def _matched(self, tokens: list[int], num_cached: int, leave_last: bool, resident: int, what: str) -> None:
        """A lookup of ``tokens`` (``match``, ``open``) held ``num_cached`` tokens: whole pages, the last
        token left when asked, and (without groups, where a window may be missing) at least the
        ``resident`` tokens the tree held before, as far as that limit allows."""
        limit = len(tokens) - (1 if leave_last else 0)
        assert num_cached % self.ps == 0 and num_cached <= limit, \
            f"{what}({tokens}, leave_last={leave_last}) holds {num_cached} tokens"
        if self.cache.groups is None:
            want = min(resident, limit // self.ps * self.ps)
            assert num_cached >= want, f"{what}({tokens}, leave_last={leave_last}) holds {num_cached} tokens; " \
                                       f"the pool held {want} of them"

    # ---------------------------------------------------------------- rules

    @rule(fresh=st.lists(st.integers(0, 2), max_size=10), reuse=st.booleans(), wait=st.booleans(),
          data=st.data())
    def open(self, fresh: list[int], reuse: bool, wait: bool, data: st.DataObject) -> None:
        """Open a request for fresh tokens, or for a seen sequence cut anywhere (or whole: the next
        turn) and followed by them; with ``wait`` its load is waited for (the gate opened), else it
        may stay pending.  It holds whole pages, leaves the last token, covers at least what the pool
        held and evicts as the ``EvictionModel`` allows; a waited-for load over an exact tier brings
        back every stored chunk the pool has room for.  Cost: one ``open`` (with ``wait``, its load),
        and O(pages x tokens) in the model."""
        tokens = fresh
        if reuse and self.seen:              # a seen prefix, cut anywhere or whole (the next turn), and a new suffix
            old = data.draw(st.sampled_from(self.seen))
            tokens = old[:data.draw(st.one_of(st.just(len(old)), st.integers(0, len(old))))] + fresh
        if tokens:
            self._open(tokens, wait)

    def _open(self, tokens: list[int], wait: bool) -> None:
        """``open`` a request (loads waited for, or left pending): with an exact tier, a load waited
        for brings back every stored chunk the pool has room for."""
        if wait:
            self.gated.gate.set()            # an engine that waits gets its answer
        expect = 0
        if wait and self.exact_tier:
            expect = self._recallable(tokens) if self.cache.groups is None else self._recallable_grouped(tokens)
        resident, asked = resident_tokens(self.cache.tree, tokens), self._taking()
        req = self.cache.open(tokens, load="wait" if wait else "async")
        self.live.append(_Live(tokens, req))
        self.live[-1].tombs = self._tombstones(req)
        self._used(tokens, req.num_cached)
        self._observe(f"open({tokens}, load={'wait' if wait else 'async'})", asked)
        self._matched(tokens, req.num_cached, True, resident, "open")
        if wait:
            assert not req.pending, f"{req!r}: load='wait' returned with a load pending"
            assert req.num_cached >= expect, \
                f"{req!r}: {expect} tokens were stored below and fit in the pool, only {req.num_cached} came back"

    @rule(open_gate=st.booleans())
    def gate(self, open_gate: bool) -> None:
        """Open or close the gate of the tier below: while it is closed, loads stay pending (at most
        ``GatedTier.max_wait`` seconds).  O(1)."""
        if open_gate:
            self.gated.gate.set()
        else:
            self.gated.gate.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        """Poll a live request (its load waited for first when the gate is open, so that the run does
        not depend on thread timing): ``True`` exactly when nothing is pending, the held prefix never
        shrinks, and what it evicts follows the ``EvictionModel``.  Cost: one ``poll`` (landing the
        load if it arrived), and O(pages x tokens) in the model."""
        live = data.draw(st.sampled_from(self.live))
        before = live.req.num_cached
        pending = live.req._pending
        if pending is not None and self.gated.gate.is_set():
            # The gate is open: let the worker finish first, so that what poll finds (and so the
            # rest of the run) does not depend on thread timing; a closed gate holds it pending.
            futures_wait([pending.future], timeout=self.gated.max_wait)
        asked = self._taking()
        done = live.req.poll()
        self._used(live.tokens, live.req.num_cached, live.req.num_cached > before)
        self._observe(f"poll of {live.req!r}", asked)
        assert done == (not live.req.pending), f"{live.req!r}: poll said {done}"
        assert live.req.num_cached >= before, f"{live.req!r}: poll shrank the held prefix from {before}"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """Compute the rest of a request's prompt (after its load landed) and ``extend``."""
        todo = [x for x in self.live if not x.prefilled]
        if not todo:
            return
        self._prefill(data.draw(st.sampled_from(todo)))

    def _prefill(self, live: _Live) -> None:
        req = live.req
        if req.pending:
            self.gated.gate.set()
            before, asked = req.num_cached, self._taking()
            assert req.wait(), f"{req!r}: wait returned with the load still pending"
            self._used(live.tokens, req.num_cached, req.num_cached > before)
            self._observe(f"wait for {req!r}", asked)
        n, held = len(live.tokens), len(req.page_ids)
        new = self._alloc(-(-n // self.ps) - held)
        if new is None:
            return
        self._fill(live.tokens, req.num_cached, new)
        full = n // self.ps - held
        table = self._extend(live, new[:full]).tolist()
        assert len(table) == n // self.ps and req.num_cached == len(table) * self.ps, \
            f"{req!r}: extend returned {len(table)} pages for {n} tokens"
        live.tail = new[full] if len(new) > full else None
        live.prefilled = True
        self._cached(live.tokens, req.num_cached)

    @precondition(lambda self: any(x.prefilled for x in self.live))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        """Generate one token: write its KV into the tail page; when the page fills, ``extend``."""
        live = data.draw(st.sampled_from([x for x in self.live if x.prefilled]))
        pos = len(live.tokens)
        if live.tail is None:
            new = self._alloc(1)
            if new is None:
                return
            live.tail = new[0]
        live.tokens.append(token)
        self._write(live.tail, pos % self.ps, token, pos)
        if len(live.tokens) % self.ps == 0:
            table = self._extend(live, [live.tail])
            assert len(table) == len(live.tokens) // self.ps, f"{live.req!r}: table of {len(table)} pages"
            live.tail = None
            self._cached(live.tokens, live.req.num_cached)

    def _extend(self, live: _Live, pages: list[int]) -> torch.Tensor:
        """``extend`` the request of ``live`` with ``pages``; its canonical page table."""
        table = live.req.extend(live.tokens, pages)
        if pages:                            # an insert: every full page of the tokens is used
            self.model.touch(live.tokens, len(live.tokens))
        self._observe(f"extend of {live.req!r}")
        return table

    @precondition(lambda self: self.live)
    @rule(data=st.data(), again=st.booleans())
    def release(self, data: st.DataObject, again: bool) -> None:
        """Finish a request; with ``again`` the same tokens come straight back (a retry): where its
        held prefix ends at a leaf or a branch point, the pool alone must serve all of it but the
        page of the last token (with sliding groups: the window of a match that stops a page short
        of a reuse point is kept too, where the pool computed the request's pages: a tier load
        brings a sliding group's window of its end only, not the page more that ``KVGroups.keep``
        keeps, so a retry a page short of a loaded end may miss its window; and a request that
        matched pages whose window an earlier trim had already dropped holds them as they are: a
        hold keeps what is there, it does not bring dropped pages back)."""
        live = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        req = live.req
        intact = self._window_intact(live)
        req.release()
        if live.tail is not None:
            self.cache.free([live.tail])
        if live.prefilled:
            self.seen.append(list(live.tokens))
        loaded = self.cache.groups is not None and req.tier_tokens > 0
        if again and live.prefilled and req.num_cached and len(req.node.children) != 1 and not loaded and intact:
            tokens = live.tokens[:data.draw(st.sampled_from([req.num_cached, len(live.tokens)]), label="retry")]
            want = min(req.num_cached, (len(tokens) - 1) // self.ps * self.ps)
            resident = resident_tokens(self.cache.tree, tokens)
            retry = self.cache.open(tokens, load="none")
            self.live.append(_Live(list(tokens), retry))
            self.model.touch(tokens, retry.num_cached)
            self._observe(f"open({tokens}, load='none')")
            self._matched(tokens, retry.num_cached, True, resident, "open")
            assert retry.num_cached >= want, \
                f"{retry!r}: {req!r} ended at a reuse point and was released; the same tokens again got " \
                f"{retry.num_cached} tokens from the pool, not {want}"

    def _tombstones(self, req: Request) -> frozenset[int]:
        """Positions of ``req``'s held pages whose page in some sliding group is dropped."""
        groups = self.cache.groups
        if groups is None or not req.num_cached:
            return frozenset()
        pages = np.asarray(req.pages, dtype=np.int64)
        gone = np.zeros(len(pages), dtype=bool)
        for table in groups.maps:
            gone |= table[pages] < 0
        return frozenset(int(i) for i in np.flatnonzero(gone))

    def _window_intact(self, live: _Live) -> bool:
        """Whether the pages ``KVGroups.keep`` keeps before the end of the request's held prefix
        were all there when it matched them (or it computed them): what a retry may count on.  A
        page dropped while it held them is not excused: the hold must keep it."""
        groups = self.cache.groups
        if groups is None or not live.tombs:
            return True
        n = len(live.req.pages)
        return not any(i in live.tombs for i in range(max(0, n - max(groups.keep)), n))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10), again=st.booleans(),
          leave_last=st.booleans())
    def one_call(self, tokens: list[int], again: bool, leave_last: bool) -> None:
        """A request through the one-call path (``match``, ``insert``, ``release``) in between; with
        ``again`` the same request comes straight back and, where its pages end at a leaf or a branch
        point, must get all of them but the page of its last token from the pool (all of them
        without ``leave_last``)."""
        if not self._one_call(tokens, leave_last) or not again:
            return
        full = len(tokens) // self.ps * self.ps
        node = self._node_ending(tokens, full)
        if full and node is not None and len(node.children) != 1:
            m = self._match(tokens, leave_last)
            self.cache.release(m)
            self.matched.pop()
            want = (len(tokens) - (1 if leave_last else 0)) // self.ps * self.ps
            assert m.num_tokens >= want, \
                f"{tokens} was just cached up to a reuse point; the same request again got {m.num_tokens} tokens, not {want}"

    def _match(self, tokens: list[int], leave_last: bool = True) -> Match:
        """``cache.match``, held in ``matched`` until the caller releases it."""
        resident, asked = resident_tokens(self.cache.tree, tokens), self._taking()
        m = self.cache.match(tokens, leave_last=leave_last)
        self.matched.append((tokens, m.num_tokens))
        self._used(tokens, m.num_tokens)
        self._observe(f"match({tokens}, leave_last={leave_last})", asked)
        self._matched(tokens, m.num_tokens, leave_last, resident, "match")
        return m

    def _node_ending(self, tokens: list[int], n: int) -> Any:
        """The tree node that ends exactly at ``tokens[:n]`` (page-aligned), or ``None``; walks the
        tree without touching it.  O(n)."""
        data = np.asarray(tokens[:n], dtype="<i4").tobytes()
        pb, node, pos = 4 * self.ps, self.cache.tree.root, 0
        while pos < len(data):
            child = node.children.get(data[pos:pos + pb])
            if child is None or data[pos:pos + len(child.key)] != child.key:
                return None
            node, pos = child, pos + len(child.key)
        return node if pos == len(data) else None

    @precondition(lambda self: any(not x.prefilled for x in self.live))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def share_a_prompt(self, data: st.DataObject, extra: list[int]) -> None:
        """Another request with the prompt of a live one that has not run yet, and more, runs first
        (one call), then the live one prefills: its pages duplicate pages the tree has, and with
        sliding groups must give the tree back the window pages it had dropped (``KVGroups.fill``)."""
        live = data.draw(st.sampled_from([x for x in self.live if not x.prefilled]))
        self._one_call(live.tokens + extra)
        self._prefill(live)

    @precondition(lambda self: any(not x.prefilled for x in self.live))
    @rule(data=st.data())
    def share_part_of_a_prompt(self, data: st.DataObject) -> None:
        """Another request with a part of the prompt of a live one that has not run yet, past what
        the live one holds, runs first (one call), then the live one prefills: its ``extend``
        continues a leaf it does not hold."""
        live = data.draw(st.sampled_from([x for x in self.live if not x.prefilled]))
        # drawn before ``num_cached`` is read and whatever it is: what a tier's background load has
        # brought in by now is timing, and a draw whose bounds followed it made hypothesis's replay
        # of a run draw differently (FlakyStrategyDefinition)
        pick = data.draw(st.integers(0, 1 << 16), label="part")
        held = live.req.num_cached
        room = len(live.tokens) - held - self.ps
        if room > 0:
            self._one_call(live.tokens[:held + self.ps + 1 + pick % room])
        self._prefill(live)

    def _one_call(self, tokens: list[int], leave_last: bool = True) -> bool:
        """One request through ``match``, ``insert``, ``release``; ``False`` if the pool was full."""
        self.gated.gate.set()
        m = self._match(tokens, leave_last)
        new = self._alloc(-(-len(tokens) // self.ps) - len(m.pages))
        if new is not None:
            self._fill(tokens, m.num_tokens, new)
            self.cache.insert(tokens, torch.cat([m.pages, torch.tensor(new, dtype=torch.int64)]))
            self.model.touch(tokens, len(tokens))
            self._observe(f"insert({tokens})")
        self.cache.release(m)
        self.matched.pop()
        if new is None:
            return False
        self.seen.append(tokens)
        self._cached(tokens, len(tokens) // self.ps * self.ps)
        return True

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        """Pin a prefix of a cached sequence (a system prompt): it must stay whatever happens."""
        old = data.draw(st.sampled_from(self.seen))
        tokens = old[:data.draw(st.integers(1, len(old)))]
        self.gated.gate.set()
        before, again, asked = self.cache.stats(), tuple(tokens) in self.pinned, self._taking()
        try:
            self.cache.pin(tokens)
        except ValueError:
            self._used(tokens, 0, landed=False)
            self._observe(f"a refused pin({tokens})", asked)
            after = self.cache.stats()
            assert (after["pins"], after["locked_tokens"]) == (before["pins"], before["locked_tokens"]), \
                "a refused pin changed the holds"
            return
        self.pinned[tuple(tokens)] = tokens
        if not again:                        # pinning the same tokens again looks nothing up
            self._used(tokens, self.cache.pins[np.asarray(tokens, dtype="<i4").tobytes()].num_cached)
        self._observe(f"pin({tokens})", 0 if again else asked)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        """Unpin a pinned prefix: ``unpin`` says it was pinned.  Cost: one ``unpin``, O(depth) and a
        hash pass."""
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        assert self.cache.unpin(self.pinned.pop(key)), f"unpin of pinned {list(key)} said it was not pinned"

    @rule(num_pages=st.integers(1, 8))
    def pressure(self, num_pages: int) -> None:
        """Another request wants pages: evict what may be evicted, then give them back."""
        pages = self._alloc(num_pages)
        if pages is None:
            return
        for group, pool in self.parts:               # what a reused page would be overwritten with
            ids = self._ids(group, np.array(pages, dtype=np.int64))
            pool.kv[:, :, torch.from_numpy(ids[ids >= 0])] = -1.0
        self.cache.free(pages)

    @precondition(lambda self: self.cache.tree.num_nodes > 0)
    @rule(data=st.data(), made=st.booleans())
    def use_a_leaf(self, data: st.DataObject, made: bool) -> None:
        """Recency decides what goes.  The one-call path caches a sequence on another branch (a
        leaf to outlive), then looks up a prefix of a leaf's sequence; another request then takes a
        page or two more than are free and the rest of the leaf holds: the rest goes first, and
        what was used must outlive every leaf used before it (``EvictionModel``).  The leaf is a least
        recently used one and the prefix ends inside its node (which splits: the upper half, used
        now, has the lower as its child) or where its node starts (its parent is used); or
        (``made``) it is the leaf cached first, used whole."""
        leaf, low = self.model.leaf(self._held(), made)
        if not leaf:
            return
        first = (leaf[0] + data.draw(st.integers(1, 2), label="first")) % 3     # another branch of the tree
        self._one_call([first] + data.draw(st.lists(st.integers(0, 2), min_size=self.ps, max_size=2 * self.ps),
                                           label="another"))
        if not self.model.is_leaf(leaf):                    # the other request evicted it
            return
        pages = len(leaf) // self.ps
        cut = pages if made else data.draw(st.integers(low, pages - 1), label="cut pages")
        self.gated.gate.set()
        self.cache.release(self._match(list(leaf[:cut * self.ps]), leave_last=False))
        self.matched.pop()
        more = self.model.evictable(self._held()) - (pages - cut)     # what may go after the rest
        if more > 0:
            self.pressure(self.cache.pool.num_free + pages - cut + data.draw(st.integers(1, min(2, more)),
                                                                            label="pages more"))

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), into_chunk=st.booleans())
    def reload(self, data: st.DataObject, into_chunk: bool) -> None:
        """A sequence cached before comes back after the pool let it go: everything unheld is
        evicted, then (``into_chunk``) the one-call path caches it up to a page past a chunk
        boundary, and a request for all of it waits for its load: every chunk stored below that
        the pool has room for comes back (the first chunk of each store included), the first of
        them into the middle of a chunk, with the right KV."""
        cs, ps = self.cache.chunk_size, self.ps
        held = self.model.locked(self._held())
        seqs = [s for s in self.seen if len(s) > cs and tuple(s[:ps]) not in held]    # all of it is evicted
        if not seqs:
            return
        seq = data.draw(st.sampled_from(seqs), label="seq")
        self.gated.gate.set()
        self.cache.flush()
        freed = self.cache.evict(self.cache.pool.num_pages)
        assert self._observe("evict(all)", self.cache.pool.num_pages) == freed, f"evict freed {freed} pages"
        self.cache.flush()
        if into_chunk and cs > ps:
            chunks = data.draw(st.integers(0, (len(seq) - 1) // cs - 1), label="chunks before") if len(seq) > 2 * cs \
                else 0
            self._one_call(seq[:chunks * cs + ps], leave_last=False)
            self.cache.flush()
        self._open(list(seq), wait=True)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def evictions_follow_the_model(self) -> None:
        """Nothing changed the tree between steps; ``evictable_size`` and ``protected_size`` agree
        with what requests and pins hold (whether or not ``check()`` runs); with an exact tier below,
        every full-attention chunk the pool took in during the step is stored there, and every chunk
        it let go counts as just used there (``write_through``: refreshed by ``TierStack.touch``),
        where the tier holds it."""
        if not hasattr(self, "cache"):
            return
        assert self.cache.flush(30.0), "the tier writes did not land within 30 s"
        self._observe("nothing (between steps)")
        self.model.check_sizes(self.cache.tree, self._held())
        now: dict[bytes, str] = {}
        cs, rec = self.cache.chunk_size, self.recorder
        groups = self.cache.layout.groups if self.cache.groups is not None else [None]
        for p in self.model.pages:
            if len(p) % cs:
                continue
            for group, stack in zip(groups, self.cache.stacks):
                key = stack.namespace.id + stack.refs(list(p))[-1].key
                now[key] = f"chunk {len(p) // cs - 1} of {list(p)}"
                # write_through stores a chunk when it is inserted (a sliding group's: while in a window)
                if self.exact_tier and key not in self.resident and (group is None or not group.sliding) \
                        and rec.contains_prefix([key]) != 1:
                    raise AssertionError(f"the pool holds {now[key]}, but the tier below does not "
                                         "(write_through stores a chunk when it is inserted)")
        if self.exact_tier:
            for key, name in self.resident.items():
                if key not in now and rec.contains_prefix([key]) == 1 and \
                        max(rec.accessed.get(key, 0), rec.written.get(key, 0)) < self.mark:
                    raise AssertionError(f"the pool evicted {name} and the tier below holds it, but did not count it "
                                         f"as just used (write_through: TierStack.touch)")
        self.resident = now
        self.mark = self.recorder.mark()

    @invariant()
    def held_pages_hold_their_tokens(self) -> None:
        """After every step, once queued tier writes landed: the cache's ``check()``; every live
        request and pin holds pages with its tokens' KV (in a sliding group, at least its window's),
        its tokens are the engine's and its node's, and a pin keeps every page it held; the engine's
        pages are the tails in flight, the live matches the requests, and the hit counters add up; with
        no request in flight only pins hold tokens; with sliding groups, no sliding page outside every
        reuse point's window.  Cost: ``check()``, one ``stats()``, O(tokens) per live request and pin,
        and O(nodes + pages) with groups."""
        if not hasattr(self, "cache"):
            return
        # Queued tier writes land after every step, so that what the tier holds at the next step
        # (and so the run's path) does not depend on the writer thread's timing.
        assert self.cache.flush(30.0), "the tier writes did not land within 30 s"
        self.cache.check()
        pins = self.cache.pins
        assert len(pins) == len(self.pinned), f"{len(pins)} pins, {len(self.pinned)} pinned"
        lives = [_Live(tokens, pins[torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()])
                 for tokens in self.pinned.values()]
        for live in lives:                  # a pinned prefix keeps every page it held
            held = self.pin_held.setdefault(tuple(live.tokens), live.req.num_cached)
            assert live.req.num_cached == held, f"pinned {live.tokens}: {held} tokens held, now {live.req.num_cached}"
        self.pin_held = {k: v for k, v in self.pin_held.items() if k in self.pinned}
        for live in self.live + lives:
            req = live.req
            pages = req.page_ids
            self._holds(live.tokens, req, pages)
            if live.tail is not None:
                assert live.tail not in set(pages.tolist()), f"{req!r}: its tail page {live.tail} is cached"
            mine = np.frombuffer(req.token_bytes(), dtype="<i4").tolist()
            if mine != live.tokens[:len(mine)] or len(mine) > len(live.tokens):
                raise AssertionError(f"{req!r}: the request's tokens {mine} are not the engine's {live.tokens}")
            cached = self.cache.tree.prefix_tokens(req.node).tolist()
            if cached != live.tokens[:req.num_cached]:
                raise AssertionError(f"{req!r}: the tree caches {cached} for the engine's {live.tokens[:req.num_cached]}")
        s = self.cache.stats()
        tails = sum(live.tail is not None for live in self.live)
        if self.cache.groups is not None:
            self._windows_only([live.req for live in self.live + lives])
            for group, held in zip(self.cache.groups.sliding, s["window_pages_held"]):
                assert held <= s["pages_cached"] + s["pages_engine"], \
                    f"group {group.tag()}: {held} pages handed out for {s['pages_cached']} tree and " \
                    f"{s['pages_engine']} engine pages (a page lost)"
        assert s["pages_engine"] == tails, f"engine pages {s['pages_engine']} != {tails} tail pages in flight"
        assert s["live_matches"] == len(self.live), f"live {s['live_matches']} != {len(self.live)} requests"
        assert s["hit_tokens"] == s["pool_hit_tokens"] + s["tier_hit_tokens"], f"hit tokens do not add up: {s}"
        assert sum(s["tier_hit_tokens_by_tier"]) == s["tier_hit_tokens"] == s["levels"][1]["hit_tokens"], \
            f"tier_hit_tokens {s['tier_hit_tokens']}, by tier {s['tier_hit_tokens_by_tier']}, level {s['levels'][1]}"
        assert s["levels"][0]["hit_tokens"] == s["pool_hit_tokens"], f"pool hit tokens do not add up: {s['levels']}"
        pinned = sum(live.req.num_cached for live in lives)
        if not self.live:
            assert self.cache.tree.protected_size <= pinned, \
                f"{self.cache.tree.protected_size} tokens locked with no request in flight and {pinned} pinned"
            if not self.pinned:
                assert self.cache.tree.protected_size == 0, \
                    f"{self.cache.tree.protected_size} tokens locked with no request in flight"

    def _holds(self, tokens: list[int], req: Request, pages: np.ndarray) -> None:
        """``req``'s pages hold the KV of ``tokens[:req.num_cached]``: all of them in a full group;
        in a sliding group those of its window (the last ``need`` pages) are present and every
        present one holds the right KV."""
        ps = self.ps
        want = torch.tensor([[t, i] for i, t in enumerate(tokens[:req.num_cached])],
                            dtype=torch.float32).reshape(-1, ps, 2)
        groups = self.cache.groups
        for group, pool in self.parts:
            ids = self._ids(group, pages)
            name = "" if group is None else f"group {group.tag()}: "
            if group is not None and group.sliding:
                need = min(len(pages), groups.need[groups.sliding.index(group)])   # type: ignore[union-attr]
                if (ids[len(pages) - need:] < 0).any():
                    raise AssertionError(f"{req!r}: {name}tree pages {pages.tolist()} map to {ids.tolist()}: a page "
                                         f"of the window (the last {need}) was dropped while the request holds it")
            present = np.flatnonzero(ids >= 0)
            if group is not None and not group.sliding and present.size != len(pages):
                raise AssertionError(f"{req!r}: {name}a held page is missing: {ids.tolist()}")
            got = pool.kv[0, 0, torch.from_numpy(ids[present])].reshape(-1, ps, 2)
            if not torch.equal(got, want[torch.from_numpy(present)]):
                raise AssertionError(f"{req!r}: {name}held pages {pages.tolist()} (pool pages {ids.tolist()}) hold "
                                     f"{got.reshape(-1, 2).tolist()}, want {want.reshape(-1, 2).tolist()} "
                                     f"in pages {present.tolist()}")

    def _windows_only(self, held: list[Request]) -> None:
        """No sliding page of a tree page is kept outside the window (``keep`` pages) of every reuse
        point the engine knows of: a leaf, a node with two or more children, the end of a live
        request or a pin (``held``).  O(nodes + pages)."""
        groups = self.cache.groups
        assert groups is not None
        ends = {id(req.node) for req in held}
        tree = self.cache.tree
        order, stack = [], [(c, 0) for c in tree.root.children.values()]
        while stack:
            node, start = stack.pop()
            order.append((node, start))
            stack.extend((c, start + len(node.pages)) for c in node.children.values())
        near: dict[int, int] = {}
        for node, start in reversed(order):           # children before parents
            end = start + len(node.pages)
            reuse = len(node.children) != 1 or id(node) in ends
            near[id(node)] = end if reuse else near[id(next(iter(node.children.values())))]
            for group, table, keep in zip(groups.sliding, groups.maps, groups.keep):
                cut = min(near[id(node)] - keep, end) - start
                if cut > 0 and (table[node.pages[:cut]] >= 0).any():
                    raise AssertionError(f"group {group.tag()}: {node!r} (tokens {tree.prefix_tokens(node).tolist()}) "
                                         f"keeps sliding pages {table[node.pages[:cut]].tolist()} outside the window "
                                         f"of every leaf, branch point and live request's end")


class SlidingRequestMachine(RequestMachine):
    """``RequestMachine`` with sliding-window layers in every run (``layer_windows(plain=False)``)."""

    layouts = layer_windows(plain=False)
