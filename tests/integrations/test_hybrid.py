"""Sliding-window and hybrid models through the cache: exact logits, and the window rule's memory.

A sliding layer's KV is kept only for the last ``w - 1`` tokens before each reuse point (a leaf, a
branch point, a live request's end; ``radixkv.core.groups``).  Checked here:

* exactness: ``PrefixCachedLM.prefill`` with reused KV gives the logits of one plain forward at every
  computed position (fp32, max abs difference <= 1e-4) for every hybrid family (Gemma-2, Gemma-3,
  Mistral, Cohere2, Qwen2 with sliding layers) and for MLA (DeepSeek-V3, packed KV), with a window
  of 8 tokens, pages of 4 and chunks of 8, so that prefixes run far past the window;
* memory: a long conversation holds ``ceil((w - 1) / page_size)`` sliding pages per reuse point, a
  branch point keeps its window, an evicted branch gives its window back;
* ``layer_windows`` per family, the layout checks, pool pressure on a small sliding pool, and that
  ``check()`` catches a window page dropped behind the cache's back and a page kept outside every
  window (the harness is not vacuous).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from radixkv import KVLayout, PoolExhausted, PrefixCache, ops  # noqa: E402
from hf_cases import TOL, assert_tolerance_catches_wrong_kv, full_logits, prefill_exact  # noqa: E402
from radixkv.integrations.transformers import (  # noqa: E402
    PrefixCachedLM,
    Result,
    layer_windows,
    layout_for,
    namespace_for,
    random_model,
)
from radixkv.core.groups import KVGroups  # noqa: E402
from radixkv.core.pool import KVGroup, KVPool  # noqa: E402

WINDOW, PAGE, CHUNK, LAYERS = 8, 4, 8, 4
NEED = -(-(WINDOW - 1) // PAGE)          # sliding pages a match needs: the last w - 1 tokens
KEEP = -(-(WINDOW - 1 + PAGE) // PAGE)   # kept per reuse point: a page more (a repeat stops a page short)
WINDOW_PAGES = 4 * KEEP + 4
VOCAB = 256
FAMILIES = ("gemma2", "gemma3", "mistral", "cohere2", "qwen2", "deepseek_v3")
#: ``layer_windows`` of each family's ``random_model`` with 4 layers and a window of 8.
WINDOWS = {"gemma2": (8, 0, 8, 0), "gemma3": (8, 8, 8, 0), "mistral": (8, 8, 8, 8), "cohere2": (8, 8, 8, 0),
           "qwen2": (0, 0, 8, 8), "deepseek_v3": (0, 0, 0, 0)}

pytestmark = pytest.mark.usefixtures("one_thread")


def build(family: str, **kw: Any) -> Any:
    if family != "deepseek_v3":
        kw.setdefault("sliding_window", WINDOW)
    return random_model(family, seed=0, num_layers=LAYERS, num_kv_heads=2, vocab_size=VOCAB, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, build(request.param)


@pytest.fixture(scope="module")
def gemma3() -> Any:
    return build("gemma3")


def make_lm(model: Any, num_pages: int = 256, **kw: Any) -> PrefixCachedLM:
    cache = PrefixCache(layout_for(model, page_size=PAGE), num_pages=num_pages, chunk_size=CHUNK,
                        namespace=namespace_for(model), **kw)
    return PrefixCachedLM(model, cache)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def kv_groups(cache: PrefixCache) -> KVGroups:
    assert cache.groups is not None, "the layout has no sliding-window layers"
    return cache.groups


def reuse_points(cache: PrefixCache) -> int:
    """Leaves and branch points of the tree (no request is live when this is asked)."""
    return sum(len(node.children) != 1 for node in cache.tree.nodes())


def serve(cache: PrefixCache, ids: np.ndarray) -> int:
    """One request with no model: open, alloc the rest, extend with the full pages, free the tail
    page, release (the index benchmark's per-request path); the matched tokens."""
    req = cache.open(ids)
    matched = req.num_cached
    need = -(-len(ids) // PAGE) - len(req.page_ids)
    new = cache.alloc(need)
    full = len(ids) // PAGE - len(req.page_ids)
    req.extend(ids, new[:full])
    if len(new) > full:
        cache.free(new[full:])
    req.release()
    cache.check()
    return matched


# -- exact logits, every family ------------------------------------------------------------------

def test_the_families_have_their_windows(family_model: tuple[str, Any]) -> None:
    family, model = family_model
    assert layer_windows(model) == WINDOWS[family]
    layout = layout_for(model, page_size=PAGE)
    assert layout.grouped == (family != "deepseek_v3")
    if layout.grouped:
        assert layout.windows == WINDOWS[family]
        assert [g.window for g in layout.groups] == sorted(set(WINDOWS[family]))
    else:
        assert layout.windows is None and layout.packed          # MLA: one packed side


def test_the_tolerance_tells_right_kv_from_wrong(family_model: tuple[str, Any]) -> None:
    """The control of ``TOL`` for every family: another prefix's KV, the prefix's KV shifted by a
    page, or one layer zeroed, each moves the logits past the prefix by over 100x ``TOL``."""
    _, model = family_model
    assert_tolerance_catches_wrong_kv(make_lm(model), tokens(60, seed=31), 40, page=PAGE)


def test_prefixes_past_the_window_ending_mid_page_and_mid_chunk(family_model: tuple[str, Any]) -> None:
    _, model = family_model
    lm = make_lm(model)
    grouped = lm.cache.groups is not None          # DeepSeek-V3 is full attention: it keeps every page
    system = tokens(37, seed=1)                    # 9 full pages + 1 token; 37 is mid-chunk too
    a = np.concatenate([system, tokens(11, seed=2)])
    b = np.concatenate([system, tokens(6, seed=3)])
    c = np.concatenate([system, tokens(9, seed=4)])
    assert prefill_exact(lm, a).match_tokens == 0
    # b diverges from a at token 37; with sliding layers only a's last window was kept: a miss.
    # Its insert makes 36 a branch point, which keeps the window before it.
    assert prefill_exact(lm, b).match_tokens == (0 if grouped else 36)
    assert prefill_exact(lm, c).match_tokens == 36    # the system prompt's full pages, past the window
    assert prefill_exact(lm, b).match_tokens == 40    # b's leaf ends mid-page: its window serves a repeat
    # a is page-aligned (48): a repeat matches 44 at most (the last token is left to compute), and
    # the window before 44 is kept too (a page more than the window before each reuse point)
    assert prefill_exact(lm, a).match_tokens == 44
    longer = np.concatenate([a, tokens(13, seed=5)])
    assert prefill_exact(lm, longer).match_tokens == 48    # a continuation matches the whole leaf
    assert prefill_exact(lm, np.concatenate([longer, tokens(2, seed=6)])).match_tokens == 60


def test_a_conversation_continues_from_prompt_and_answer(family_model: tuple[str, Any]) -> None:
    _, model = family_model
    lm = make_lm(model)
    ids = tokens(29, seed=7)
    for turn in range(3):
        out = lm.generate(ids, 9)
        lm.cache.check()
        assert len(out) == 9
        reference = full_logits(model, np.concatenate([ids, out[:-1]]))[len(ids) - 1:].argmax(-1)
        assert out == reference.tolist(), f"turn {turn}: greedy tokens differ from a full forward's"
        ids = np.concatenate([ids, out, tokens(5 + turn, seed=8 + turn)])
        result = prefill_exact(lm, ids)
        assert result.match_tokens > 0
        # generate cached the prompt and the answer but its last token: all their full pages
        assert result.match_tokens == (len(ids) - 5 - turn - 1) // PAGE * PAGE


# -- the memory rule -------------------------------------------------------------------------------

def test_a_long_conversation_holds_one_window_of_sliding_pages(gemma3: Any) -> None:
    lm = make_lm(gemma3, num_pages=512)
    cache = lm.cache
    ids = tokens(21, seed=20)
    for turn in range(10):
        out = lm.generate(ids, 7)
        ids = np.concatenate([ids, out, tokens(10, seed=21 + turn)])
        cache.check()
        (held,) = cache.stats()["window_pages_held"]
        assert held <= KEEP * reuse_points(cache)
    stats = cache.stats()
    (held,) = stats["window_pages_held"]
    assert reuse_points(cache) == 1 and held == KEEP           # one chain, one window
    assert stats["pages_cached"] >= 40 and stats["pages_cached"] >= 15 * held
    assert stats["window_pages_dropped"] > 0
    assert prefill_exact(lm, ids).match_tokens > 0             # and the next turn still hits


def test_a_branch_point_keeps_its_window_and_an_evicted_branch_gives_it_back() -> None:
    layout = KVLayout(2, 1, 4, torch.float32, page_size=PAGE, windows=(WINDOW, 0))
    cache = PrefixCache(layout, num_pages=64, chunk_size=CHUNK)
    sliding = kv_groups(cache).pools[0]
    system = tokens(36, seed=30)                               # 9 pages
    a = np.concatenate([system, tokens(17, seed=31)])
    b = np.concatenate([system, tokens(21, seed=32)])
    assert serve(cache, a) == 0
    assert cache.stats()["window_pages_held"] == [KEEP]
    assert serve(cache, b) == 0                                # the window before 36 was dropped
    # a branch point and two leaves, each with a window of its own (the suffixes are longer than one)
    assert reuse_points(cache) == 3 and cache.stats()["window_pages_held"] == [3 * KEEP]
    assert serve(cache, np.concatenate([system, tokens(5, seed=33)])) == 36   # the branch point hits
    assert cache.stats()["window_pages_held"] == [3 * KEEP + 1]   # c's one page; its window ends in system's
    free_before = sliding.num_free
    while reuse_points(cache) > 1:                             # evict branches, LRU first
        assert cache.evict(1) > 0
        cache.check()
    # one leaf left: its window only, the branch point's window went with its branches
    assert cache.stats()["window_pages_held"] == [KEEP]
    assert sliding.num_free == free_before + 2 * KEEP + 1
    cache.evict(cache.pool.num_pages)
    cache.check()
    assert cache.stats()["window_pages_held"] == [0] and sliding.num_free == sliding.num_pages
    assert cache.pool.num_free == cache.pool.num_pages


def test_a_live_request_keeps_its_window_until_released() -> None:
    layout = KVLayout(2, 1, 4, torch.float32, page_size=PAGE, windows=(WINDOW, 0))
    cache = PrefixCache(layout, num_pages=64, chunk_size=CHUNK)
    ids = tokens(42, seed=35)                                   # 10 full pages and a tail
    serve(cache, ids)
    x = cache.open(ids)                                         # holds the leaf's end, 40
    assert x.num_cached == 40
    longer = np.concatenate([ids, tokens(10, seed=36)])
    y = cache.open(longer)
    assert y.num_cached == 40
    y.extend(longer, cache.alloc(3))                            # y moves on to 52: 40 is no leaf now
    cache.check()
    assert cache.stats()["window_pages_held"] == [2 * KEEP]     # x's window, and y's end's
    x.release()
    cache.check()
    assert cache.stats()["window_pages_held"] == [KEEP]         # x's went with it
    other = cache.open(np.concatenate([ids[:41], tokens(3, seed=37)]))
    assert other.num_cached == 0                                # no window ends at 40 any more
    other.release()
    y.release()
    cache.check()
    assert serve(cache, np.concatenate([longer, tokens(3, seed=38)])) == 52


# -- layer_windows -------------------------------------------------------------------------------

def with_config(model: Any, **changes: Any) -> Any:
    """A stand-in with a changed copy of ``model``'s config (the fixture's model is left alone)."""
    config = copy.deepcopy(model.config)
    for key, value in changes.items():
        setattr(config, key, value)
    return types.SimpleNamespace(config=config)


def test_a_window_as_long_as_the_context_is_full_attention() -> None:
    model = random_model("mistral", seed=0, num_layers=2, vocab_size=VOCAB, max_positions=64, sliding_window=64)
    assert layer_windows(model) == (0, 0)
    layout = layout_for(model, page_size=PAGE)
    assert layout.windows is None and not layout.grouped
    short = random_model("mistral", seed=0, num_layers=2, vocab_size=VOCAB, max_positions=64, sliding_window=63)
    assert layer_windows(short) == (63, 63)


@pytest.mark.parametrize("kind", ["chunked_attention", "linear_attention"])
def test_an_unknown_layer_kind_is_refused(gemma3: Any, kind: str) -> None:
    stand_in = with_config(gemma3, layer_types=["sliding_attention", kind, "sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match=kind):
        layer_windows(stand_in)
    with pytest.raises(ValueError, match="4 layers"):
        layer_windows(with_config(gemma3, layer_types=["full_attention"] * 3))


def test_qwen2_without_use_sliding_window_is_full_attention() -> None:
    import transformers

    config = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=False, sliding_window=8,
                                      max_window_layers=2)
    assert layer_windows(types.SimpleNamespace(config=config)) == (0, 0, 0, 0)
    bare = copy.deepcopy(config)                 # the switch alone, without layer_types to say so
    bare.layer_types, bare.sliding_window = None, 8
    assert layer_windows(types.SimpleNamespace(config=bare)) == (0, 0, 0, 0)
    bare.use_sliding_window = True
    assert layer_windows(types.SimpleNamespace(config=bare)) == (8, 8, 8, 8)
    assert layer_windows(random_model("qwen2", seed=0, num_layers=4, vocab_size=VOCAB)) == (0, 0, 0, 0)


# -- layouts, groups and pools ---------------------------------------------------------------------

def test_layout_windows_are_checked() -> None:
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        KVLayout(2, 1, 4, windows=(4, 0, 4))
    with pytest.raises(TypeError, match="tuple"):
        KVLayout(2, 1, 4, windows=[4, 0])           # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"windows\[1\]"):
        KVLayout(2, 1, 4, windows=(4, -1))
    with pytest.raises(ValueError, match=r"windows\[0\]"):
        KVLayout(2, 1, 4, windows=(4.0, 0))         # type: ignore[arg-type]
    assert not KVLayout(2, 1, 4, windows=(0, 0)).grouped
    assert not KVLayout(2, 1, 4).grouped


def test_groups_come_full_first_then_by_window() -> None:
    layout = KVLayout(5, 1, 4, windows=(4, 0, 8, 4, 0))
    assert layout.groups == (KVGroup(0, (1, 4)), KVGroup(4, (0, 3)), KVGroup(8, (2,)))
    assert [g.sliding for g in layout.groups] == [False, True, True]
    assert layout.groups[1].tag() == "w=4;layers=0,3"
    sub = layout.group_layout(layout.groups[1])
    assert (sub.num_layers, sub.windows, sub.grouped) == (2, None, False)
    assert KVLayout(2, 1, 4, windows=(4, 4)).groups == (KVGroup(4, (0, 1)),)   # all sliding: no full group


def test_a_grouped_layout_needs_a_cache_not_a_pool() -> None:
    grouped = KVLayout(2, 1, 4, windows=(4, 0))
    with pytest.raises(ValueError, match="sliding"):
        KVPool(grouped, num_pages=4)
    KVPool(grouped.group_layout(grouped.groups[0]), num_pages=4).check()
    with pytest.raises(ValueError, match="window_pages"):
        PrefixCache(KVLayout(2, 1, 4), num_pages=8, window_pages=4)
    with pytest.raises(ValueError, match="window_pages"):
        PrefixCache(grouped, num_pages=8, window_pages=0)
    cache = PrefixCache(grouped, num_pages=8, window_pages=3)
    assert cache.groups is not None and kv_groups(cache).pools[0].num_pages == 3
    assert PrefixCache(KVLayout(2, 1, 4), num_pages=8).groups is None


def test_an_mla_layout_is_one_packed_side() -> None:
    mla = KVLayout(2, 1, 32, torch.float32, page_size=PAGE, v_head_dim=8)
    assert (mla.packed, mla.num_sides, mla.side_heads, mla.side_dim) == (True, 1, 1, 40)
    assert mla.token_bytes == 2 * 40 * 4
    latent = KVLayout(2, 1, 32, torch.float32, page_size=PAGE, v_head_dim=0)
    assert (latent.packed, latent.num_sides, latent.side_dim) == (True, 1, 32)
    heads = KVLayout(2, 2, 16, torch.float32, page_size=PAGE, v_head_dim=8)
    assert (heads.num_sides, heads.side_heads, heads.side_dim) == (1, 1, 2 * (16 + 8))
    same = KVLayout(2, 2, 16, torch.float32, page_size=PAGE, v_head_dim=16)
    assert (same.packed, same.num_sides, same.side_heads, same.side_dim) == (False, 2, 2, 16)
    pool = KVPool(mla, num_pages=6)
    assert tuple(pool.kv.shape) == (2, 1, 6, PAGE, 1, 40)
    src = torch.randn(mla.chunk_shape(3 * PAGE))
    ops.scatter_pages(src, pool, [4, 0, 2])
    assert torch.equal(ops.gather_pages(pool, [4, 0, 2]), src)
    assert torch.equal(ops.gather_pages(pool, [2]), src[:, :, 2 * PAGE:])
    assert mla.chunk_shape(8) == (2, 1, 8, 1, 40)


# -- pool pressure on a small sliding pool ---------------------------------------------------------

def pressure_cache() -> PrefixCache:
    layout = KVLayout(2, 1, 4, torch.float32, page_size=PAGE, windows=(WINDOW, 0))
    return PrefixCache(layout, num_pages=64, chunk_size=CHUNK, window_pages=WINDOW_PAGES)


def snapshot(cache: PrefixCache) -> tuple[Any, ...]:
    stats = cache.stats()
    return (stats["pages_free"], stats["pages_cached"], stats["pages_engine"], stats["nodes"],
            stats["evicted_pages"], tuple(stats["window_pages_held"]), cache.tree.total_size,
            kv_groups(cache).maps[0].copy().tobytes(), kv_groups(cache).pools[0].num_free)


def test_allocations_evict_leaves_to_free_sliding_pages() -> None:
    cache = pressure_cache()
    for seed in range(4):                                # 4 disjoint leaves of 5 pages, a window each
        serve(cache, tokens(22, seed=40 + seed))
    stats = cache.stats()
    assert stats["window_pages_held"] == [4 * KEEP] and stats["pages_cached"] == 20
    assert stats["evicted_pages"] == 0
    assert stats["pages_free"] == 44                      # the full pool has room; the sliding pool has 4
    new = cache.alloc(8)                                  # needs 4 more sliding pages: 2 leaves go
    cache.check()
    stats = cache.stats()
    assert stats["evicted_pages"] == 10 and stats["pages_cached"] == 10
    assert stats["window_pages_held"] == [2 * KEEP + 8]
    assert kv_groups(cache).pools[0].num_free == WINDOW_PAGES - 2 * KEEP - 8
    cache.free(new)
    cache.check()
    assert cache.stats()["window_pages_held"] == [2 * KEEP]
    for seed, hit in ((40, 0), (41, 0), (42, 20), (43, 20)):    # LRU: the newest leaves survived
        req = cache.open(tokens(22, seed=seed))
        assert req.num_cached == hit
        req.release()
        cache.check()


def test_an_allocation_eviction_cannot_serve_changes_nothing() -> None:
    cache = pressure_cache()
    for seed in range(3):
        serve(cache, tokens(22, seed=50 + seed))
    held = [cache.open(tokens(22, seed=50 + seed)) for seed in range(2)]     # 2 windows locked
    assert [req.num_cached for req in held] == [20, 20]
    engine = cache.alloc(4)
    cache.check()
    free = kv_groups(cache).pools[0].num_free
    assert free == WINDOW_PAGES - 3 * KEEP - 4
    before = snapshot(cache)
    with pytest.raises(PoolExhausted, match="sliding"):
        cache.alloc(WINDOW_PAGES + 1)                     # more than the sliding pool has at all
    with pytest.raises(PoolExhausted, match="sliding"):
        cache.alloc(free + KEEP + 1)                      # the free ones and the unlocked leaf's: 1 short
    assert snapshot(cache) == before
    cache.check()
    more = cache.alloc(free + KEEP)                       # the free ones + the unlocked leaf's
    cache.check()
    assert kv_groups(cache).pools[0].num_free == 0 and cache.stats()["evicted_pages"] == 5
    with pytest.raises(PoolExhausted):
        cache.alloc(1)
    cache.check()
    for req in held:
        req.release()
    cache.free(engine)
    cache.free(more)
    cache.check()
    assert cache.stats()["window_pages_held"] == [2 * KEEP]


# -- the harness: check() sees what the window rule forbids ----------------------------------------

def test_check_fails_when_a_live_requests_window_page_is_dropped() -> None:
    cache = pressure_cache()
    ids = tokens(30, seed=60)
    serve(cache, ids)
    req = cache.open(ids)
    cache.check()
    page = req.page_ids[-1]                               # inside the request's window
    table, pool = kv_groups(cache).maps[0], kv_groups(cache).pools[0]
    pool.free([table[page]])
    table[page] = -1
    with pytest.raises(AssertionError, match="window was dropped"):
        cache.check()


def test_check_fails_when_a_page_outside_every_window_is_kept() -> None:
    cache = pressure_cache()
    ids = tokens(30, seed=61)
    serve(cache, ids)
    cache.check()
    table, pool = kv_groups(cache).maps[0], kv_groups(cache).pools[0]
    pages = cache.tree.all_pages()
    dropped = pages[table[pages] < 0]
    assert dropped.size == len(pages) - KEEP
    table[dropped[0]] = pool.alloc(1)[0]                  # a dropped mapping restored by hand
    with pytest.raises(AssertionError, match="outside every window"):
        cache.check()


def test_extending_over_a_dropped_window_keeps_the_requests_window() -> None:
    layout = KVLayout(2, 1, 2, torch.float32, page_size=PAGE, windows=(4, 0))
    cache = PrefixCache(layout, num_pages=16, chunk_size=CHUNK)
    seq = np.arange(20)
    serve(cache, seq)                                     # 5 pages; only the last keeps its sliding page
    req = cache.open(seq[:6])
    assert req.num_cached == 0                            # page 0's window was dropped: a miss
    req.extend(seq[:6], cache.alloc(1))                   # the engine computed page 0: a duplicate
    assert kv_groups(cache).maps[0][req.page_ids[-1]] >= 0    # the request decodes on from page 0
    cache.check()
