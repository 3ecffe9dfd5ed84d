"""Sliding-window KV through the tiers at every chunk boundary, as a property over the space.

Hypothesis draws the layout (full attention only; a full-attention layer with sliding ones of one
or two windows; every layer sliding), page and chunk sizes, the prompts (a shared prefix cut at
drawn branch points, with suffixes, in a drawn order), the pool's size (pressure: evictions while
the requests run), the write policy, exclusive mode and which tiers exist (a CPU tier, LMDB).
The engine writes synthetic KV (token id and position in each slot) into every group's pages.
After the pool is emptied, each prompt is asked for again: its hit from the tiers must be every
whole chunk of it (less the last token), which is the longest prefix whose full-attention chunks
are stored (full attention alone may add a tail: the pages past the last chunk boundary where
cached prefixes part), and the KV it lands must be exact: every position for full attention, the last
``w - 1`` positions before the hit for a sliding group of window ``w``.  With LMDB, the same holds
for a new cache over the same directory (a restart).
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv import KVLayout, PrefixCache
from radixkv.backends import CpuTier, LmdbTier
from radixkv.testing.requests import layer_windows

VOCAB = 50


def serve(cache: PrefixCache, tokens: list[int]) -> int:
    """One request: open (waiting for tier loads), prefill the rest with synthetic KV, cache its
    full pages, release.  The tokens it found cached."""
    ps = cache.page_size
    req = cache.open(tokens, load="wait")
    hit = req.num_cached
    need = -(-len(tokens) // ps) - len(req.page_ids)
    new = cache.alloc(need)
    start = len(req.page_ids) * ps
    for j, page in enumerate(new.tolist()):
        for k in range(ps):
            pos = start + j * ps + k
            if pos < len(tokens):
                write(cache, page, k, tokens[pos], pos)
    full = len(tokens) // ps - len(req.page_ids)
    req.extend(tokens, new[:full])
    if len(new) > full:
        cache.free(new[full:])
    req.release()
    cache.check()
    return hit


def parts(cache: PrefixCache) -> list[tuple[Any, Any]]:
    """(group, pool) for each KV group (``(None, pool)`` without groups)."""
    if cache.groups is None:
        return [(None, cache.pool)]
    return [(g, cache.groups.pool_of(g)) for g in cache.layout.groups]


def page_of(cache: PrefixCache, group: Any, page: int) -> int:
    return page if group is None else int(cache.groups.pages_of(group, [page])[0])   # type: ignore[union-attr]


def write(cache: PrefixCache, page: int, slot: int, token: int, pos: int) -> None:
    for group, pool in parts(cache):
        gid = page_of(cache, group, page)
        pool.kv[:, :, gid, slot, :, 0] = token
        pool.kv[:, :, gid, slot, :, 1] = pos


def assert_exact(cache: PrefixCache, tokens: list[int], pages: list[int], n: int) -> None:
    """The KV of ``tokens[:n]`` in ``pages``: every position of a full group, the last ``w - 1``
    positions of a sliding group of window ``w``."""
    ps = cache.page_size
    for group, pool in parts(cache):
        lo = 0 if group is None or not group.sliding else max(0, n - (group.window - 1))
        for pos in range(lo, n):
            gid = page_of(cache, group, pages[pos // ps])
            assert gid >= 0, f"group {group}: position {pos} of a {n}-token hit has no page"
            kv = pool.kv[:, :, gid, pos % ps]
            assert (kv[..., 0] == tokens[pos]).all() and (kv[..., 1] == pos).all(), \
                f"group {group}: wrong KV at position {pos} of a {n}-token hit"


def stored_prefix(cache: PrefixCache, tokens: list[int]) -> int:
    """The longest chunk-aligned prefix of ``tokens`` (less the last) whose chunks the first stack
    (the full-attention group's, or the tree's when every layer slides) finds in the tiers."""
    cs = cache.chunk_size
    n = (len(tokens) - 1) // cs
    stack = cache.stacks[0]
    return len(stack.lookup([r.key for r in stack.refs(tokens[:n * cs])])) * cs if n else 0


def probe(cache: PrefixCache, prompts: list[list[int]]) -> None:
    """With the pool empty, each prompt hits every whole chunk of it from the tiers, exactly."""
    for tokens in prompts:
        cache.flush()
        cache.evict(cache.pool.num_pages)
        cache.flush()
        whole = (len(tokens) - 1) // cache.chunk_size * cache.chunk_size
        assert stored_prefix(cache, tokens) == whole, "a full-attention chunk is missing from the tiers"
        req = cache.open(tokens, load="wait")
        try:
            # Full attention may get a few pages more: a tail stored where cached prefixes part.
            assert req.num_cached == whole or (cache.groups is None and whole < req.num_cached < len(tokens)), \
                f"{len(tokens)}-token prompt: {req.num_cached} tokens from the tiers, {whole} stored"
            assert_exact(cache, tokens, req.page_ids.tolist(), req.num_cached)
        finally:
            req.release()
        cache.check()


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    page = draw(st.integers(1, 4), label="page")
    chunk = page * draw(st.integers(1, 3), label="chunk pages")
    prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40), label="shared prefix")
    prompts = []
    for _ in range(draw(st.integers(2, 6), label="requests")):
        cut = draw(st.integers(0, len(prefix)), label="branch point")
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), label="suffix")
        prompts.append(prefix[:cut] + suffix)
    longest = max(len(p) for p in prompts)
    return {
        "windows": draw(layer_windows(max_window=12), label="windows"),
        "page": page, "chunk": chunk, "prompts": prompts,
        "num_pages": draw(st.integers(-(-longest // page) + 1, 4 * (-(-longest // page)) + 4), label="pool pages"),
        "write_policy": draw(st.sampled_from(["write_through", "write_back"]), label="write policy"),
        "exclusive": draw(st.booleans(), label="exclusive"),
        "tiers": draw(st.sampled_from(["cpu", "lmdb", "cpu+lmdb"]), label="tiers"),
    }


@pytest.mark.slow                 # a property over tier stacks on disk, restarted (seconds): `make test` runs it
@given(workloads())
def test_every_chunk_boundary_is_served_exactly_from_the_tiers(w: dict[str, Any]) -> None:
    serve_and_probe(w)


@pytest.mark.parametrize("windows", [(2, 2), (0, 2)], ids=["every layer sliding", "full and sliding"])
def test_a_match_ends_where_the_chunk_it_completes_can_be_stored(windows: tuple[int, ...]) -> None:
    """Two of the property's examples, checked in every run.  22 tokens are cached first (a leaf:
    a sliding group of window 2 keeps its last 4 pages, tokens 14-21), then a prompt that parts
    from them at token 17 would match 16: its window (token 15) is there, but not the start of the
    chunk it completes (tokens 12-13).  Served from there, that chunk (tokens 12-17, new) could not
    be stored whole in the sliding group and the tiers missed it; the match must end where each
    sliding group holds its pages from the last chunk boundary (here: 12 tokens, from the tiers)."""
    serve_and_probe({"windows": windows, "page": 2, "chunk": 6, "prompts": [[0], [0] * 17 + [1, 0], [0] * 22],
                     "num_pages": 12, "write_policy": "write_through", "exclusive": False, "tiers": "cpu"})


def serve_and_probe(w: dict[str, Any]) -> None:
    """Serve a workload's prompts (``workloads``) in a fixed order, then ``probe`` them; with LMDB
    again from a cache restarted over the same directory."""
    layout = KVLayout(num_layers=len(w["windows"]) if w["windows"] else 1, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32, page_size=w["page"], windows=w["windows"])
    with tempfile.TemporaryDirectory() as tmp:
        def tiers(restart: bool = False) -> list[Any]:
            out: list[Any] = []
            if "cpu" in w["tiers"] and not restart:
                out.append(CpuTier(1 << 24))
            if "lmdb" in w["tiers"]:
                out.append(LmdbTier(f"{tmp}/kv", 1 << 26))
            return out

        def make(restart: bool = False) -> PrefixCache:
            return PrefixCache(layout, num_pages=w["num_pages"], chunk_size=w["chunk"], tiers=tiers(restart),
                               write_policy=w["write_policy"], exclusive=w["exclusive"], write_queue=1 << 14)

        cache = make()
        order = np.random.default_rng(len(w["prompts"])).permutation(len(w["prompts"]))
        for i in order:
            serve(cache, w["prompts"][i])
        assert cache.stats()["chunks_not_queued"] == 0
        probe(cache, w["prompts"])
        cache.close()
        if "lmdb" in w["tiers"]:
            restarted = make(restart=True)
            probe(restarted, w["prompts"])
            restarted.close()


@st.composite
def evictions(draw: st.DrawFn) -> dict[str, Any]:
    """A layout (full attention, every layer sliding, mixed windows, or MLA's packed sides), page
    and chunk sizes, prompts, a tier stack (the CPU tier alone, or over LMDB) and an order of
    evictions: the whole pool at once, or the pool's pages taken by ``alloc`` for other work."""
    page = draw(st.integers(1, 4), label="page")
    chunk = page * draw(st.integers(1, 3), label="chunk pages")
    kind = draw(st.sampled_from(["full", "windows", "mla"]), label="layout kind")
    windows = draw(layer_windows(max_window=12, plain=False), label="windows") if kind == "windows" else None
    prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=chunk + 1, max_size=48), label="shared prefix")
    prompts = [prefix[:draw(st.integers(chunk + 1, len(prefix)), label="cut")]
               + draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), label="suffix")
               for _ in range(draw(st.integers(1, 4), label="requests"))]
    longest = max(len(p) for p in prompts)
    return {
        "kind": kind, "windows": windows, "page": page, "chunk": chunk, "prompts": prompts,
        "num_pages": draw(st.integers(-(-longest // page) + 2, 3 * (-(-longest // page)) + 4), label="pool pages"),
        "write_policy": draw(st.sampled_from(["write_through", "write_back"]), label="write policy"),
        "tiers": draw(st.sampled_from(["cpu", "cpu+lmdb"]), label="tiers"),
        "by_alloc": draw(st.booleans(), label="evicted by alloc"),
        "order": draw(st.permutations(range(len(prompts))), label="order"),
    }


@given(evictions())
def test_what_the_pool_lets_go_of_is_found_at_once_in_the_cpu_tier(w: dict[str, Any]) -> None:
    """No flush and no pause between an eviction and the lookup after it (the lookup an engine
    under memory pressure makes): every whole chunk of each prompt comes back, exactly, from the
    CPU tier (the fastest tier, which holds the chunk or is about to: it may still be in the write
    queue); then a request that stops a page short of the loaded end finds its window in the pool."""
    if w["kind"] == "mla":
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float32, page_size=w["page"],
                          v_head_dim=0)
    else:
        layout = KVLayout(num_layers=len(w["windows"]) if w["windows"] else 1, num_kv_heads=1, head_dim=2,
                          dtype=torch.float32, page_size=w["page"], windows=w["windows"])
    ps, cs = w["page"], w["chunk"]
    with tempfile.TemporaryDirectory() as tmp:
        tiers: list[Any] = [CpuTier(1 << 24)]
        if w["tiers"] == "cpu+lmdb":
            tiers.append(LmdbTier(f"{tmp}/kv", 1 << 26))
        with PrefixCache(layout, num_pages=w["num_pages"], chunk_size=cs, tiers=tiers, write_queue=1 << 14,
                         write_policy=w["write_policy"]) as cache:
            for i in w["order"]:
                tokens = w["prompts"][i]
                serve(cache, tokens)
                if w["by_alloc"]:              # the engine takes the whole pool for other work
                    taken = cache.alloc(cache.pool.num_pages)
                    cache.free(taken)
                else:
                    cache.evict(cache.pool.num_pages)
                whole = (len(tokens) - 1) // cs * cs
                req = cache.open(tokens, load="wait")          # at once: nothing flushed, no pause
                try:
                    assert req.num_cached == whole or (cache.groups is None and whole < req.num_cached < len(tokens)), \
                        f"{len(tokens)}-token prompt after an eviction: {req.num_cached} tokens back, {whole} evicted"
                    assert req.tier_tokens == req.num_cached and req.tier_tokens_by_tier[0] == req.num_cached, \
                        f"served by {req.tier_tokens_by_tier}, not all by the CPU tier"
                    assert_exact(cache, tokens, req.page_ids.tolist(), req.num_cached)
                    loaded = req.num_cached
                finally:
                    req.release()
                if loaded > ps:                # one page short of the loaded end: its window is in the pool
                    shorter = tokens[:loaded - ps + 1]
                    req = cache.open(shorter, load="wait")
                    try:
                        assert req.num_cached == loaded - ps and req.tier_tokens == 0, \
                            f"a match a page short of a loaded end: {req.num_cached} tokens, " \
                            f"{req.tier_tokens} from the tiers (want {loaded - ps} from the pool)"
                        assert_exact(cache, shorter, req.page_ids.tolist(), req.num_cached)
                    finally:
                        req.release()
                cache.check()
