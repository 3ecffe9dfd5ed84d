"""Mutants of the engine's eviction, recency, one-call path and tier traffic, for the mutation
self-test (``tests/testing/test_mutations.py`` appends ``ROWS`` to its ``MUTANTS``), and the measurement
of how often each machine family catches them.

Each bug is what an engine author might get wrong in ``RadixTree`` or ``PrefixCache``; ``ROWS``
(the fields of ``test_mutations.Mutant``, in its order) runs each against the cache-level machines
that must catch it.  ``BUGS`` names, for each bug, every machine that must catch it, so that a
catch rate can be measured over seeds and machines rather than one run::

    python tests/helpers/mutants_engine.py [--seeds 3] [--check on|off|both] [--bugs name,...]

prints, per machine family (cache, tiered, request), the runs in which the bug was caught.
``--check off`` makes ``check()`` of the cache, the tree and the pool a no-op (and the rules that
test ``check()`` itself pass), so the machines must catch each bug by what they observe.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Callable, NamedTuple

import pytest

from radixkv import ops
from radixkv.core.cache import PrefixCache
from radixkv.core.stack import TierStack
from radixkv.core.tree import RadixTree

Patch = Callable[[pytest.MonkeyPatch], Any]


class Row(NamedTuple):
    """A row of the mutation table: the fields of ``test_mutations.Mutant``, in its order."""

    name: str
    target: str
    bug: str
    harness: str
    patch: Patch


def _wrap(mp: pytest.MonkeyPatch, cls: type, name: str,
          make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    mp.setattr(cls, name, make(getattr(cls, name)))


# -- the tree's recency -------------------------------------------------------------------------

def lru_pop_newest(self: RadixTree) -> Any:
    """The tree's LRU order, popped from the newest end."""
    live = [item for item in self._lru if item[3].lru_entry == item[2]]
    if not live:
        return None
    node = max(live)[3]
    self._lru_drop(node)
    return node


def _evicts_mru(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(RadixTree, "_lru_pop", lru_pop_newest)


def _touch_leaves_only(self: RadixTree, path: list[Any]) -> None:
    """``RadixTree._touch`` that stamps only the leaves on the path: an inner node keeps the stamp it
    had, so once its children go it is evicted as if unused since then."""
    self._clock += 1
    stamp = self._clock
    for node in path:
        if node.children:
            continue
        if node.lock_ref == 0:
            self._lru_drop(node)
            node.last_access = stamp
            self._lru_add(node)
        else:
            node.last_access = stamp


# -- the one-call path ----------------------------------------------------------------------------

def _match_covers_last_token(mp: pytest.MonkeyPatch) -> None:
    _wrap(mp, PrefixCache, "match",
          lambda match: lambda self, tokens, **kw: match(self, tokens, **{**kw, "leave_last": False}))


def _evicting(delta: int) -> Patch:
    """``_take_pages`` (``alloc`` and tier loads) whose first eviction asks ``delta`` pages more than short."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        def make(take: Callable[..., Any]) -> Callable[..., Any]:
            def bad(self: PrefixCache, num_pages: int) -> Any:
                evict, calls = type(self).evict, []

                def off(n: int) -> int:
                    calls.append(n)
                    return evict(self, max(0, n + delta) if len(calls) == 1 else n)
                self.evict = off                                 # type: ignore[method-assign]
                try:
                    return take(self, num_pages)
                finally:
                    del self.evict
            return bad
        _wrap(mp, PrefixCache, "_take_pages", make)
    return patch


def _evictable_one_page_short(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(RadixTree, "evictable_size", property(lambda self: max(0, self._evictable - self.page_size)))


# -- the tiers --------------------------------------------------------------------------------------

# The refresh of what a write_through eviction lets go is ``TierStack.touch`` (its only caller), the
# store of an insert's chunks ``TierStack.store``: patched there, the rows outlive a move of the
# cache's own code between methods.

def _no_refresh(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(TierStack, "touch", lambda self, keys, **kw: len(list(keys)))


def _refresh_skips_first(mp: pytest.MonkeyPatch) -> None:
    """An eviction refreshes the chunks that end in the node but the first of them (an off-by-one)."""
    _wrap(mp, TierStack, "touch", lambda touch: lambda self, keys, **kw: touch(self, list(keys)[1:], **kw) + 1)


def _load_skip_one_short(mp: pytest.MonkeyPatch) -> None:
    """A load into the middle of a chunk copies from one page too early in the chunk."""
    scatter = ops.scatter_pages
    mp.setattr(ops, "scatter_pages",
               lambda src, pool, ids, skip_pages=0: scatter(src, pool, ids, skip_pages=max(0, skip_pages - 1)))


def _store_skips_first_chunk(mp: pytest.MonkeyPatch) -> None:
    def make(store: Callable[..., int]) -> Callable[..., int]:
        def bad(self: TierStack, items: Any, **kw: Any) -> int:
            items = list(items)                      # the first chunk is lost, and not counted
            return store(self, items[1:], **kw) + bool(items)
        return bad
    _wrap(mp, TierStack, "store", make)


class Bug(NamedTuple):
    name: str
    target: str
    bug: str
    patch: Patch
    machines: tuple[str, ...]      # every machine that must catch it (measured over seeds)
    rows: tuple[str, ...]          # those it is run against in the mutation table


CACHE = ("PrefixCacheMachine",)
TIERED = ("TieredPrefixCacheMachine", "WriteBackMachine", "FaultyPrefixCacheMachine")
REQUEST = ("RequestMachine", "SlidingRequestMachine")
ALL = CACHE + TIERED + REQUEST
WRITE_THROUGH = ("TieredPrefixCacheMachine", "FaultyPrefixCacheMachine") + REQUEST

BUGS = [
    Bug("evicts-mru-leaf", "RadixTree._lru_pop", "evicts the most recently used leaf", _evicts_mru, ALL,
        ("PrefixCacheMachine", "RequestMachine")),
    Bug("touch-stamps-leaves-only", "RadixTree._touch", "an access stamps only the leaves on its path",
        lambda mp: mp.setattr(RadixTree, "_touch", _touch_leaves_only), ALL, ("PrefixCacheMachine", "RequestMachine")),
    Bug("match-covers-last-token", "PrefixCache.match", "the one-call match ignores leave_last",
        _match_covers_last_token, ALL, ("RequestMachine",)),
    Bug("alloc-evicts-one-more", "PrefixCache._take_pages", "alloc evicts a page more than it is short",
        _evicting(+1), ALL, ("PrefixCacheMachine", "RequestMachine")),
    Bug("alloc-evicts-one-less", "PrefixCache._take_pages", "alloc evicts a page less than it is short",
        _evicting(-1), ALL, ("RequestMachine",)),
    Bug("evictable-size-one-page-short", "RadixTree.evictable_size", "evictable_size is a page short",
        _evictable_one_page_short, ALL, ("PrefixCacheMachine", "RequestMachine")),
    Bug("evict-no-refresh", "TierStack.touch (an eviction's refresh)",
        "a write_through eviction does not refresh tier recency", _no_refresh, WRITE_THROUGH,
        ("FaultyPrefixCacheMachine", "RequestMachine")),
    Bug("evict-refresh-skips-first", "TierStack.touch (an eviction's refresh)",
        "a write_through eviction refreshes all but the first chunk ending in the node", _refresh_skips_first,
        WRITE_THROUGH, ("TieredPrefixCacheMachine",)),
    Bug("load-into-chunk-a-page-early", "ops.scatter_pages (a tier load's copy into the pool)",
        "a load into the middle of a chunk copies from a page too early", _load_skip_one_short,
        TIERED + REQUEST, ("RequestMachine",)),
    Bug("store-skips-first-chunk", "TierStack.store", "the first chunk of every store is lost uncounted",
        _store_skips_first_chunk, ("TieredPrefixCacheMachine", "WriteBackMachine", "RequestMachine"),
        ("WriteBackMachine", "RequestMachine")),
]

_PREFIX = {"PrefixCacheMachine": "cache", "TieredPrefixCacheMachine": "tiered", "WriteBackMachine": "writeback",
           "FaultyPrefixCacheMachine": "faulty", "RequestMachine": "request", "SlidingRequestMachine": "sliding"}

ROWS = [Row(f"{_PREFIX[harness]}-{bug.name}", bug.target, bug.bug, harness, bug.patch)
        for bug in BUGS for harness in bug.rows]

FAMILIES = {"cache": CACHE, "tiered": TIERED, "request": REQUEST}


# -- measurement ----------------------------------------------------------------------------------

def machines() -> dict[str, type]:
    from radixkv.testing import FaultyPrefixCacheMachine, PrefixCacheMachine, TieredPrefixCacheMachine
    from radixkv.testing.requests import RequestMachine, SlidingRequestMachine

    class WriteBackMachine(TieredPrefixCacheMachine):
        write_policy = "write_back"

    return {"PrefixCacheMachine": PrefixCacheMachine, "TieredPrefixCacheMachine": TieredPrefixCacheMachine,
            "WriteBackMachine": WriteBackMachine, "FaultyPrefixCacheMachine": FaultyPrefixCacheMachine,
            "RequestMachine": RequestMachine, "SlidingRequestMachine": SlidingRequestMachine}


def _checks_off(mp: pytest.MonkeyPatch) -> None:
    """No ``check()``: the cache's, the tree's and the pool's pass, and so do the rules that test them."""
    import radixkv.testing.machines as index
    from radixkv.core.pool import KVPool

    for cls in (PrefixCache, RadixTree, KVPool):
        mp.setattr(cls, "check", lambda self, *a, **kw: None)
    mp.setattr(index, "_expect_check_fails", lambda check, what: None)


def run(bug: Bug | None, machine: type, seed: int | None, checks: bool = True) -> str:
    """One run of ``machine`` (``MUTATION`` settings; with ``seed``, randomised from it) with ``bug``
    applied: '' if nothing failed, else the first line of the failure."""
    from hypothesis import seed as with_seed
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from radixkv.testing.settings import MUTATION

    factory = type(machine.__name__, (machine,), {})
    if seed is not None:
        factory = with_seed(seed)(factory)
    with pytest.MonkeyPatch.context() as mp:
        if bug is not None:
            bug.patch(mp)
        if not checks:
            _checks_off(mp)
        try:
            run_state_machine_as_test(factory, settings=settings(MUTATION, derandomize=seed is None))
        except Exception as exc:  # noqa: BLE001 - any failure is a catch
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--check", choices=["on", "off", "both"], default="both")
    parser.add_argument("--bugs", default="")
    parser.add_argument("--machines", default="")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    table = machines()
    bugs = [b for b in BUGS if not args.bugs or b.name in args.bugs.split(",")]
    only = set(args.machines.split(",")) if args.machines else set(table)
    for checks in {"on": [True], "off": [False], "both": [True, False]}[args.check]:
        caught: dict[str, list[int]] = {family: [0, 0] for family in FAMILIES}
        start = time.perf_counter()
        for bug in bugs:
            for name in bug.machines:
                if name not in only:
                    continue
                family = next(f for f, names in FAMILIES.items() if name in names)
                for seed in range(args.seeds):
                    how = run(bug, table[name], seed, checks)
                    caught[family][0] += bool(how)
                    caught[family][1] += 1
                    if args.verbose or not how:
                        print(f"  check {'on ' if checks else 'off'} {bug.name:32} {name:26} seed {seed}: "
                              f"{how[:110] if how else 'SURVIVED'}", flush=True)
        total = [sum(c[0] for c in caught.values()), sum(c[1] for c in caught.values())]
        rates = [f"{family} {c[0]}/{c[1]} ({100 * c[0] / max(1, c[1]):.0f}%)"
                 for family, c in [*caught.items(), ("all", total)]]
        print(f"check() {'on' if checks else 'off'}: {', '.join(rates)}  [{time.perf_counter() - start:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
