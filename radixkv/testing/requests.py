"""A state machine for the engine contract: many requests in flight, each holding its pages.

``RequestMachine`` plays a paged, continuous-batching engine against ``PrefixCache.open``: requests
are opened (loads from a tier waited for, or left pending), prefilled into pages from ``alloc``,
cached with ``extend`` as decoding fills pages, polled, released — in any order, with eviction
pressure and tier loads held back by a gate (``GatedTier``) so that loads stay pending across
steps.  The "engine" writes each token's id and position into its KV slot, so after every step
the machine checks that every page a live request holds still holds that request's tokens: a held
page that was freed, reused or overwritten fails the run, as does a wrong ``check()``.

Run it as it is (``TestRequests = RequestMachine.TestCase``) or subclass it and override
``make_tiers`` to put your own backend below the same checks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.backends import Blob, MemoryTier, Tier
from radixkv.cache import PoolExhausted, PrefixCache
from radixkv.pool import KVLayout
from radixkv.request import Request

__all__ = ["GatedTier", "RequestMachine"]


class GatedTier(Tier):
    """A tier whose reads from the cache's load workers wait for ``gate`` (a ``threading.Event``):
    clear it and a load stays pending; set it and the load goes on.  Reads from any other thread
    (the stack's writer) pass straight through.  A read that waits more than ``max_wait`` seconds
    fails (a fault: the load is a miss), so nothing can hang."""

    def __init__(self, inner: Tier, max_wait: float = 20.0) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.max_wait = max_wait
        self.name = f"gated({inner.name})"
        self.local, self.victim = inner.local, inner.victim

    def _wait(self) -> None:
        if threading.current_thread().name.startswith("radixkv-load") and not self.gate.wait(self.max_wait):
            raise TimeoutError(f"{self.name}: the gate stayed closed for {self.max_wait} s")

    def get(self, key: bytes) -> Blob | None:
        self._wait()
        return self.inner.get(key)

    def read(self, key: bytes, consume: Callable[[memoryview], Any]) -> Any:
        self._wait()
        return self.inner.read(key, consume)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._wait()
        return self.inner.contains_prefix(keys)

    def put(self, key: bytes, blob: Blob) -> bool:
        return self.inner.put(key, blob)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def drop_namespace(self, ns_id: bytes) -> int:
        return self.inner.drop_namespace(ns_id)

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self.gate.set()
        self.inner.close()

    def check(self) -> None:
        self.inner.check()


class _Live:
    """The engine's side of one request: its tokens, the pages it computed and not yet cached
    (``tail``: the partial last page), and the request."""

    def __init__(self, tokens: list[int], req: Request) -> None:
        self.tokens = tokens
        self.req = req
        self.tail: int | None = None        # an engine page holding the partial last page
        self.prefilled = False


class RequestMachine(RuleBasedStateMachine):
    """Requests in flight through ``open`` / ``alloc`` / ``extend`` / ``poll`` / ``release``.

    Override ``make_tiers`` (the backends below the pool; wrapped in a ``GatedTier``) to test your
    own.  Pools of 6–16 pages of 1–3 tokens and chunks of two pages keep evictions, splits of held
    nodes and unaligned tier loads in every run.
    """

    #: The tier below keeps every chunk stored in it (the default ``MemoryTier`` never evicts and,
    #: not being a victim tier, gets every chunk at insert): then a load that is waited for must bring
    #: back every stored chunk the pool has room for (recall).  Set ``False`` for a bounded tier.
    exact_tier = True

    def make_tiers(self) -> list[Tier]:
        return [MemoryTier()]

    @initialize(page_size=st.integers(1, 3), num_pages=st.integers(6, 16))
    def setup(self, page_size: int, num_pages: int) -> None:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=page_size)
        self.gated = GatedTier(*self.make_tiers())
        self.cache = PrefixCache(layout, num_pages=num_pages, chunk_size=2 * page_size, tiers=[self.gated],
                                 load_timeout=30.0)
        self.ps = page_size
        self.live: list[_Live] = []
        self.seen: list[list[int]] = []     # sequences cached before: re-requested with new suffixes
        self.pinned: dict[tuple[int, ...], list[int]] = {}
        self.stored: set[tuple[int, ...]] = set()   # chunk-aligned prefixes cached so far
        self.pin_held: dict[tuple[int, ...], int] = {}

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.gated.gate.set()
            self.cache.close()

    # ---------------------------------------------------------------- the engine's KV

    def _write(self, page: int, slot: int, token: int, pos: int) -> None:
        self.cache.pool.kv[:, :, page, slot, :, 0] = token
        self.cache.pool.kv[:, :, page, slot, :, 1] = pos

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
        room = self.cache.pool.num_free + self.cache.tree.evictable_size // ps
        return n * cs if room >= n * cs // ps else 0

    # ---------------------------------------------------------------- rules

    @rule(fresh=st.lists(st.integers(0, 2), max_size=10), reuse=st.booleans(), wait=st.booleans(),
          data=st.data())
    def open(self, fresh: list[int], reuse: bool, wait: bool, data: st.DataObject) -> None:
        tokens = fresh
        if reuse and self.seen:              # a seen prefix, cut anywhere, and a new suffix
            old = data.draw(st.sampled_from(self.seen))
            tokens = old[:data.draw(st.integers(0, len(old)))] + fresh
        if not tokens:
            return
        if wait:
            self.gated.gate.set()            # an engine that waits gets its answer
        expect = self._recallable(tokens) if wait and self.exact_tier else 0
        req = self.cache.open(tokens, load="wait" if wait else "async")
        if wait:
            assert not req.pending, f"{req!r}: load='wait' returned with a load pending"
            assert req.num_cached >= expect, \
                f"{req!r}: {expect} tokens were stored below and fit in the pool, only {req.num_cached} came back"
        self.live.append(_Live(tokens, req))

    @rule(open_gate=st.booleans())
    def gate(self, open_gate: bool) -> None:
        if open_gate:
            self.gated.gate.set()
        else:
            self.gated.gate.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        live = data.draw(st.sampled_from(self.live))
        before = live.req.num_cached
        done = live.req.poll()
        assert done == (not live.req.pending), f"{live.req!r}: poll said {done}"
        assert live.req.num_cached >= before, f"{live.req!r}: poll shrank the held prefix from {before}"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """Compute the rest of a request's prompt (after its load landed) and ``extend``."""
        todo = [x for x in self.live if not x.prefilled]
        if not todo:
            return
        live = data.draw(st.sampled_from(todo))
        req = live.req
        if req.pending:
            self.gated.gate.set()
            assert req.wait(), f"{req!r}: wait returned with the load still pending"
        n, held = len(live.tokens), len(req.page_ids)
        try:
            new = self.cache.alloc(-(-n // self.ps) - held).tolist()
        except PoolExhausted:
            return
        self._fill(live.tokens, req.num_cached, new)
        full = n // self.ps - held
        table = req.extend(live.tokens, new[:full]).tolist()
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
            try:
                live.tail = int(self.cache.alloc(1)[0])
            except PoolExhausted:
                return
        live.tokens.append(token)
        self._write(live.tail, pos % self.ps, token, pos)
        if len(live.tokens) % self.ps == 0:
            table = live.req.extend(live.tokens, [live.tail])
            assert len(table) == len(live.tokens) // self.ps, f"{live.req!r}: table of {len(table)} pages"
            live.tail = None
            self._cached(live.tokens, live.req.num_cached)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        live.req.release()
        if live.tail is not None:
            self.cache.free([live.tail])
        if live.prefilled:
            self.seen.append(list(live.tokens))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def one_call(self, tokens: list[int]) -> None:
        """A request through the one-call path (``match``, ``insert``, ``release``) in between."""
        self.gated.gate.set()
        m = self.cache.match(tokens)
        try:
            new = self.cache.alloc(-(-len(tokens) // self.ps) - len(m.pages))
        except PoolExhausted:
            self.cache.release(m)
            return
        self._fill(tokens, m.num_tokens, new.tolist())
        self.cache.insert(tokens, torch.cat([m.pages, new]))
        self.cache.release(m)
        self.seen.append(tokens)
        self._cached(tokens, len(tokens) // self.ps * self.ps)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        """Pin a prefix of a cached sequence (a system prompt): it must stay whatever happens."""
        old = data.draw(st.sampled_from(self.seen))
        tokens = old[:data.draw(st.integers(1, len(old)))]
        self.gated.gate.set()
        before = self.cache.stats()
        try:
            self.cache.pin(tokens)
        except ValueError:
            after = self.cache.stats()
            assert (after["pins"], after["locked_tokens"]) == (before["pins"], before["locked_tokens"]), \
                "a refused pin changed the holds"
            return
        self.pinned[tuple(tokens)] = tokens

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        assert self.cache.unpin(self.pinned.pop(key)), f"unpin of pinned {list(key)} said it was not pinned"

    @rule(num_pages=st.integers(1, 8))
    def pressure(self, num_pages: int) -> None:
        """Another request wants pages: evict what may be evicted, then give them back."""
        try:
            pages = self.cache.alloc(num_pages)
        except PoolExhausted:
            return
        self.cache.pool.kv[:, :, pages] = -1.0       # what a reused page would be overwritten with
        self.cache.free(pages)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def held_pages_hold_their_tokens(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        kv = self.cache.pool.kv
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
            got = kv[0, 0, torch.from_numpy(pages.copy())].reshape(-1, 2)
            want = torch.tensor([[t, i] for i, t in enumerate(live.tokens[:req.num_cached])],
                                dtype=torch.float32).reshape(-1, 2)
            if not torch.equal(got, want):
                raise AssertionError(f"{req!r}: held pages {pages.tolist()} hold {got.tolist()}, "
                                     f"want {want.tolist()}")
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
        assert s["pages_engine"] == tails, f"engine pages {s['pages_engine']} != {tails} tail pages in flight"
        assert s["live_matches"] == len(self.live), f"live {s['live_matches']} != {len(self.live)} requests"
        assert s["hit_tokens"] == s["pool_hit_tokens"] + s["tier_hit_tokens"], f"hit tokens do not add up: {s}"
        pinned = sum(live.req.num_cached for live in lives)
        if not self.live:
            assert self.cache.tree.protected_size <= pinned, \
                f"{self.cache.tree.protected_size} tokens locked with no request in flight and {pinned} pinned"
            if not self.pinned:
                assert self.cache.tree.protected_size == 0, \
                    f"{self.cache.tree.protected_size} tokens locked with no request in flight"
