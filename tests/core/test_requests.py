"""The engine contract: requests hold their pages, extend while decoding, and load from the tiers
without blocking the engine beyond a deadline."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import radixkv as rk
from radixkv.backends import MemoryTier
from radixkv.core.request import Request
from radixkv.testing.requests import GatedTier, RequestMachine, SlidingRequestMachine

LAYOUT = rk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)


class TestRequestMachine(RequestMachine.TestCase):
    pytestmark = pytest.mark.slow      # the whole machine (seconds; a short run stays in the loop)


class TestSlidingRequestMachine(SlidingRequestMachine.TestCase):      # sliding-window layers in every run
    pytestmark = pytest.mark.slow      # the whole machine (seconds): `make test` runs it


def test_the_machine_loads_into_a_chunk_and_reloads_a_stores_first_chunk(monkeypatch):
    """A short run of the request machine lands a tier load that starts inside a chunk (its tree
    match ends a page into it) and loads back the first chunk of a store: the cases a mutant of
    either must meet."""
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from radixkv import ops
    from radixkv.testing.settings import MUTATION
    from radixkv.core.stack import TierStack

    skips, firsts, reloaded = [], set(), []
    scatter, store, load = ops.scatter_pages, TierStack.store, TierStack.load

    def scatter_pages(src, pool, ids, skip_pages=0):
        skips.append(skip_pages)
        return scatter(src, pool, ids, skip_pages=skip_pages)

    def store_chunks(self, items, **kw):
        items = list(items)
        firsts.update(ref.key for ref, _ in items[:1])
        return store(self, items, **kw)

    def load_chunks(self, refs, **kw):
        chunks = load(self, refs, **kw)
        reloaded.extend(ref.key in firsts for ref in list(refs)[:len(chunks)])
        return chunks

    monkeypatch.setattr(ops, "scatter_pages", scatter_pages)
    monkeypatch.setattr(TierStack, "store", store_chunks)
    monkeypatch.setattr(TierStack, "load", load_chunks)
    run_state_machine_as_test(RequestMachine, settings=settings(MUTATION, max_examples=10))
    assert any(skips) and any(reloaded)


class ExclusiveCpuRequestMachine(RequestMachine):
    """The same engine over an exclusive CPU tier ordered by S3-FIFO: chunks move between the pool
    and the tier (stored when evicted, deleted when loaded back) while requests hold their pages."""

    exact_tier = False          # a bounded tier that holds only what the pool evicted

    def make_tiers(self) -> list:
        from radixkv.backends import CpuTier

        return [CpuTier(1 << 14, policy="s3fifo")]


class TestExclusiveCpuRequestMachine(ExclusiveCpuRequestMachine.TestCase):
    pytestmark = pytest.mark.slow      # the whole machine over a CPU tier (seconds): `make test` runs it


def make(num_pages: int = 16, tiers: list | None = None, **kw) -> rk.PrefixCache:
    return rk.PrefixCache(LAYOUT, num_pages=num_pages, chunk_size=4, tiers=tiers or [], **kw)


def fill(cache: rk.PrefixCache, tokens: list[int], start: int, pages) -> None:
    """The engine's prefill: KV of token t at position i is (t, i)."""
    ps = cache.page_size
    for j, page in enumerate(torch.as_tensor(pages).tolist()):
        for k in range(ps):
            pos = start + j * ps + k
            if pos < len(tokens):
                cache.pool.kv[:, :, page, k, :, 0] = tokens[pos]
                cache.pool.kv[:, :, page, k, :, 1] = pos


def holds(cache: rk.PrefixCache, tokens: list[int], req: Request) -> bool:
    got = cache.pool.kv[0, 0, req.pages].reshape(-1, 2)
    want = torch.tensor([[t, i] for i, t in enumerate(tokens[:req.num_cached])], dtype=torch.float32)
    return torch.equal(got, want.reshape(-1, 2))


def serve(cache: rk.PrefixCache, tokens: list[int], **kw) -> Request:
    """Open, prefill the rest and extend; the request stays open (its tail page, if any, freed)."""
    req = cache.open(tokens, **kw)
    req.wait()
    held = len(req.page_ids)
    new = cache.alloc(-(-len(tokens) // cache.page_size) - held)
    fill(cache, tokens, req.num_cached, new)
    full = len(tokens) // cache.page_size - held
    req.extend(tokens, new[:full])
    if len(new) > full:
        cache.free(new[full:])
    return req


def stored_below(tokens: list[int]) -> MemoryTier:
    """A memory tier that holds ``tokens``' chunks, served through another cache first."""
    lower = MemoryTier()
    with make(tiers=[lower]) as first:
        serve(first, tokens).release()
        first.flush()
    return lower


def closed_gate_over(tokens: list[int], **kw) -> tuple[rk.PrefixCache, GatedTier]:
    """A cache over a tier that holds ``tokens``' chunks, its reads held back (the gate closed)."""
    gated = GatedTier(stored_below(tokens), max_wait=30)
    gated.gate.clear()
    return make(tiers=[gated], **kw), gated


def test_the_gated_tier_reports_its_inner_tiers_sizes():
    """``GatedTier`` passes ``used_bytes`` and ``capacity_bytes`` through as ``Tier``'s properties
    (``used_bytes`` was a method that called the inner tier's property, and ``repr`` recursed)."""
    inner = stored_below(list(range(8)))
    gated = GatedTier(inner, max_wait=1)
    assert gated.used_bytes == inner.used_bytes > 0
    assert gated.capacity_bytes == inner.capacity_bytes
    assert "GatedTier" in repr(gated)


def test_extended_pages_are_held_under_pool_pressure():
    cache = make(num_pages=10)
    tokens = list(range(16))
    req = serve(cache, tokens)                           # 8 pages, all held
    assert req.num_cached == 16 and holds(cache, tokens, req)
    with pytest.raises(rk.PoolExhausted):
        cache.alloc(3)                                   # 2 free; the held 8 cannot be taken
    got = cache.alloc(2)
    cache.pool.kv[:, :, got] = -1
    assert holds(cache, tokens, req)
    cache.free(got)
    req.release()
    assert len(cache.alloc(10)) == 10                    # released: evictable now
    cache.check()


def test_a_second_request_learns_the_canonical_pages():
    cache = make()
    tokens = list(range(1, 9))
    a = cache.open(tokens)
    b = cache.open(tokens)                               # both miss: computed twice
    pa, pb = cache.alloc(4), cache.alloc(4)
    fill(cache, tokens, 0, pa)
    fill(cache, tokens, 0, pb)
    assert a.extend(tokens, pa).tolist() == pa.tolist()
    free_before = cache.stats()["pages_free"]
    table = b.extend(tokens, pb)
    assert table.tolist() == pa.tolist() and b.pages.tolist() == pa.tolist()
    assert cache.stats()["pages_free"] == free_before + 4          # b's duplicates went back
    a.release()
    cache.evict(100)
    assert holds(cache, tokens, b) and cache.stats()["pages_cached"] == 4   # b still holds them
    b.release()
    cache.check()


def test_decoding_caches_generated_tokens_for_the_next_turn():
    cache = make(num_pages=32)
    prompt = [5, 6, 7, 8, 9]
    req = cache.open(prompt)
    pages = cache.alloc(3)
    fill(cache, prompt, 0, pages)
    req.extend(prompt, pages[:2])
    tail, seq = int(pages[2]), list(prompt)
    for token in [10, 11, 12, 13, 14]:                   # generate; cache each page as it fills
        seq.append(token)
        fill(cache, seq, len(seq) - 1 - (len(seq) - 1) % 2, [tail])
        if len(seq) % 2 == 0:
            table = req.extend(seq, [tail])
            assert len(table) == len(seq) // 2
            tail = int(cache.alloc(1)[0])
    assert req.num_cached == 10 and holds(cache, seq, req)
    req.release()
    cache.free([tail])
    turn2 = seq + [20, 21, 22]
    nxt = cache.open(turn2)
    assert nxt.num_cached == 10 and holds(cache, turn2, nxt)      # the generated tokens are reused
    nxt.release()
    cache.check()


def test_async_load_lands_while_the_engine_goes_on():
    tokens = list(range(1, 18))
    cache, gated = closed_gate_over(tokens)
    req = cache.open(tokens, load="async", deadline_s=60)
    assert req.pending and req.num_cached == 0
    assert not req.poll()
    other = serve(cache, [9, 9, 9, 9, 9], load="async", deadline_s=0.1)   # others are served meanwhile
    other.release()
    cache.check()
    gated.gate.set()
    assert req.wait(timeout=30)
    assert not req.pending and req.num_cached == 16 and req.tier_tokens == 16
    assert holds(cache, tokens, req)
    s = cache.stats()
    assert s["tier_hit_tokens"] == 16 and s["hit_tokens"] == s["pool_hit_tokens"] + 16
    req.release()
    cache.check()
    cache.close()


@pytest.mark.parametrize("load", ["wait", "async"])
def test_a_stalled_tier_costs_at_most_the_deadline(load):
    tokens = list(range(1, 18))
    cache, gated = closed_gate_over(tokens, load_timeout=0.3)
    t0 = time.monotonic()
    req = cache.open(tokens, load=load)
    if load == "async":
        assert req.pending
        req.wait()
    elapsed = time.monotonic() - t0
    assert elapsed < 0.6, f"the engine thread waited {elapsed:.2f} s for a 0.3 s deadline"
    assert not req.pending and req.num_cached == 0 and cache.stats()["late_loads"] == 1
    gated.gate.set()                                     # the late answer arrives: ignored
    time.sleep(0.1)
    assert req.poll() and req.num_cached == 0
    req.release()
    cache.check()
    m = cache.match(tokens, deadline_s=30)               # a later request with time gets it
    assert m.num_tokens == 16 and m.tier_tokens == 16
    cache.release(m)
    cache.close()


def test_release_with_a_load_pending_leaves_nothing_behind():
    tokens = list(range(1, 18))
    cache, gated = closed_gate_over(tokens)
    req = cache.open(tokens, load="async")
    req.release()
    gated.gate.set()
    time.sleep(0.1)
    cache.check()
    assert cache.stats()["pages_free"] == 16 and cache.tree.protected_size == 0
    with pytest.raises(ValueError, match="released"):
        req.poll()
    cache.close()


def test_the_one_call_path_is_unchanged():
    cache = make()
    tokens = [1, 2, 3, 4, 5]
    m = cache.match(tokens)
    new = cache.alloc(3)
    assert cache.insert(tokens, torch.cat([m.pages, new])) == 0
    cache.release(m)
    m = cache.match(tokens)
    assert m.num_tokens == 4
    cache.release(m)
    cache.check()


def bad_calls():
    def opened(c):
        return c.open([1, 2, 3, 4, 5])
    return [
        ("leave_last not a bool", lambda c: c.open([1, 2], leave_last=1), TypeError, "leave_last"),
        ("match leave_last not a bool", lambda c: c.match([1, 2], leave_last="no"), TypeError, "leave_last"),
        ("unknown load mode", lambda c: c.open([1, 2], load="later"), ValueError, "load"),
        ("negative deadline", lambda c: c.open([1, 2], deadline_s=-1), ValueError, "deadline_s"),
        ("extend: too few pages", lambda c: opened(c).extend([1, 2, 3, 4, 5], c.alloc(1)), ValueError, "pages"),
        ("extend: pages not from alloc", lambda c: opened(c).extend([1, 2, 3, 4, 5], [0, 1]), ValueError, "pages"),
        ("extend: repeated pages", lambda c: opened(c).extend([1, 2, 3, 4, 5], [c.alloc(1)[0]] * 2),
         ValueError, "pages"),
        ("extend: fewer tokens than before", lambda c: opened(c).extend([1, 2], []), ValueError, "tokens"),
        ("extend: float tokens", lambda c: opened(c).extend([1, 2, 3, 4, 5, 6.0], []), TypeError, "tokens"),
        ("extend after release", lambda c: (lambda r: (r.release(), r.extend([1, 2, 3, 4, 5], [])))(opened(c)),
         ValueError, "released"),
        ("release twice", lambda c: (lambda r: (r.release(), r.release()))(opened(c)), ValueError, "released"),
        ("release of a stranger", lambda c: c.release(make().match([1, 2])), ValueError, "not made by this cache"),
        ("release of a Request through the cache", lambda c: c.release(opened(c)), TypeError, "req.release()"),
        ("release of a non-request", lambda c: c.release(3), TypeError, "Match"),
    ]


@pytest.mark.parametrize("name,call,exc,text", bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_input_changes_nothing(name, call, exc, text):
    cache = make()
    serve(cache, [7, 7, 7, 7, 7, 7]).release()
    before = cache.stats()
    with pytest.raises(exc, match=text):
        call(cache)
    after = cache.stats()
    for key in ("pages_cached", "nodes", "cached_tokens", "inserts", "inserted_tokens"):
        assert after[key] == before[key], key
    cache.check()


@pytest.mark.parametrize("kwargs,exc,text", [
    ({"device": "cuda"} if not torch.cuda.is_available() else {"device": "cuda:4096"}, ValueError, "device"),
    ({"device": "bogus"}, ValueError, "device"),
    ({"device": 3.5}, TypeError, "device"),
    ({"write_queue": 0}, ValueError, "write_queue"),
    ({"load_timeout": -1}, ValueError, "load_timeout"),
    ({"load_workers": 0}, ValueError, "load_workers"),
])
def test_bad_construction(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        rk.PrefixCache(LAYOUT, num_pages=4, chunk_size=4, tiers=[MemoryTier()], **kwargs)


def test_tree_insert_refuses_repeated_pages():
    tree = rk.RadixTree(page_size=1)
    with pytest.raises(ValueError, match="pages"):
        tree.insert([1, 2, 3], [4, 4, 5])
    assert tree.num_nodes == 0


def test_a_failed_insert_leaves_no_split_node():
    cache = make()
    serve(cache, [1, 2, 3, 4, 5, 6, 7, 8]).release()
    assert cache.tree.num_nodes == 1
    pages = cache.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages      # ends on the node: no split
    with pytest.raises(ValueError, match="cached page"):
        # diverges inside the node after 2 pages, and passes a cached page for a position it
        # does not hold: refused before the node is split
        cache.insert([1, 2, 3, 4, 9, 9], [pages[0], pages[1], pages[3]])
    assert cache.tree.num_nodes == 1
    cache.check()


@pytest.mark.slow                 # a process or a server of its own: `make test` runs it
def test_queued_writes_reach_lmdb_at_a_normal_exit(tmp_path):
    """No close(): the interpreter's exit flushes the queue (within a bound)."""
    pytest.importorskip("lmdb")
    script = f"""
import torch, radixkv as rk
from radixkv.backends import LmdbTier
layout = rk.KVLayout(1, 1, 64, torch.float32, page_size=4)
cache = rk.PrefixCache(layout, 256, chunk_size=4, tiers=[LmdbTier({str(tmp_path / "db")!r}, 64 << 20)],
                       write_queue=128)
tokens = list(range(1, 242))
m = cache.match(tokens)
cache.insert(tokens, cache.alloc(61))
print(cache.stats()["chunks_stored"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["60"]
    check = f"""
from radixkv.backends import LmdbTier
tier = LmdbTier({str(tmp_path / "db")!r}, 64 << 20)
print(tier.stats().get("entries", len(list(tier.keys())) if hasattr(tier, "keys") else -1))
"""
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True)
    assert got.stdout.split() == ["60"], got.stdout + got.stderr


def test_exclusive_tiering_moves_chunks_between_the_pool_and_a_volatile_tier(tmp_path):
    """exclusive: the CPU tier gets a chunk when the pool evicts it and gives it up when it moves
    back up; a persistent tier below keeps every chunk from insert on (crash safety)."""
    from radixkv.backends import CpuTier, LmdbTier

    cpu = CpuTier(1 << 20)
    disk = LmdbTier(str(tmp_path / "db"), 1 << 20)
    cache = make(num_pages=16, tiers=[cpu, disk], exclusive=True)
    assert cache.stack.victims == {0}
    tokens = list(range(1, 18))
    serve(cache, tokens).release()
    cache.flush()
    keys = [cache.namespace.id + k for k in rk.chunk_keys(tokens, 4, cache.namespace)]
    assert cpu.contains_prefix(keys) == 0 and disk.contains_prefix(keys) == 4
    cache.evict(100)
    cache.flush()
    assert cpu.contains_prefix(keys) == 4                       # the victim tier has what the pool let go
    req = cache.open(tokens)
    assert req.num_cached == 16 and req.tier_tokens_by_tier == (16, 0) and holds(cache, tokens, req)
    cache.flush()
    assert cpu.contains_prefix(keys) == 0 and disk.contains_prefix(keys) == 4   # moved up, not copied
    req.release()
    st = cache.stats()["stack"]
    assert st["released"] == [4, 0] and st["promoted"] == 0
    cache.check()
    cache.close()


def test_a_store_of_a_held_chunk_refreshes_it_under_write_back():
    """write_back: when the pool evicts a chunk the tier holds already, the tier counts it as just
    used (victim-cache refresh) instead of letting it age."""
    lower = MemoryTier()
    cache = make(num_pages=8, tiers=[lower], write_policy="write_back")
    tokens = list(range(1, 10))
    serve(cache, tokens).release()
    cache.evict(100)
    cache.flush()
    assert cache.stats()["stack"]["stored"] == [2]
    cache.open(tokens).release()                                # loaded back (inclusive: still below)
    cache.evict(100)
    cache.flush()
    st = cache.stats()["stack"]
    assert st["stored"] == [2] and st["refreshed"] == [2]
    cache.close()
