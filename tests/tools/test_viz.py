"""``radixkv.tools.viz``: the HTML displays escape and mark what they show; the plots draw one artist per
thing they are said to draw.  Also the workloads and ``replay`` that feed the plots.

Plots use matplotlib's Agg backend and are skipped without matplotlib; the HTML functions must work
without it (checked in a subprocess that cannot import it).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from radixkv import KVLayout, Namespace, PrefixCache, RadixTree
from radixkv.tools import viz
from radixkv.backends import MemoryTier
from radixkv.tools.workloads import ChatWorkload, few_shot_workload, rag_workload, replay

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=2)
SYSTEM = [100, 101, 102, 103]


def small_cache(tiers: Any = (), num_pages: int = 32, **kwargs: Any) -> PrefixCache:
    return PrefixCache(LAYOUT, num_pages=num_pages, chunk_size=4, tiers=tiers, **kwargs)


def served(cache: PrefixCache) -> PrefixCache:
    """Three requests sharing a system prompt, two of them diverging after a shared turn."""
    replay(cache, [SYSTEM + [1, 2, 3, 4, 5], SYSTEM + [1, 2, 7, 8, 9], SYSTEM + [20, 21, 22]])
    return cache


@pytest.fixture
def plt() -> Iterator[Any]:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    yield pyplot
    pyplot.close("all")


# -- HTML ------------------------------------------------------------------------------------------


def test_tree_html_marks_locked_nodes_and_eviction_order() -> None:
    cache = served(small_cache())
    m = cache.match(SYSTEM + [1, 2, 3, 4, 5])
    page = viz.tree_html(cache.tree)
    locked = [n for n in cache.tree.nodes() if n.lock_ref]
    evictable = [n for n in cache.tree.nodes() if not n.lock_ref and not n.children]
    assert locked and evictable
    assert page.count("locked ×1") == len(locked)
    for rank in range(1, len(evictable) + 1):
        assert f"evictable #{rank}" in page
    assert page.count(viz.COLORS["locked_bg"]) == len(locked) + 1      # each locked node and the legend
    assert "<script" not in page
    assert cache.tree._repr_html_() == page
    cache.release(m)
    assert "locked ×" not in viz.tree_html(cache.tree)


def test_tree_html_limits_nodes() -> None:
    tree = RadixTree(page_size=1)
    for i in range(30):
        tree.insert([i, i + 1], [2 * i, 2 * i + 1])
    page = viz.tree_html(tree, max_nodes=10)
    assert page.count("<li>") == 10
    assert "20 more nodes not shown" in page
    assert "empty" in viz.tree_html(RadixTree(page_size=4))


def test_html_escapes_text() -> None:
    table = viz.table_html([{"<b>name</b>": "<script>alert(1)</script>", "rate": 0.5, "bytes_in": 3 << 20}])
    assert "<script>" not in table and "&lt;script&gt;" in table and "&lt;b&gt;name" in table
    assert "50.0%" in table and "3.0 MiB" in table
    cache = served(small_cache(namespace=Namespace(model='<img src=x onerror="x">')))
    page = cache._repr_html_()
    assert "<img" not in page and "&lt;img src=x onerror=&quot;x&quot;&gt;" in page
    assert page == viz.cache_html(cache)


def test_stats_html_shows_levels_and_stack() -> None:
    with served(small_cache(tiers=[MemoryTier()])) as cache:
        stats = cache.stats()
        page = stats._repr_html_()
        assert page == viz.stats_html(stats)
        assert "levels" in page and "tier stack" in page and ">memory<" in page
        assert f"hit rate {stats['hit_rate']:.1%}" in page
        for key in ("hit_tokens", "pages_free", "evicted_pages"):
            assert f">{key}<" in page


def test_cache_html_pool_bar_adds_up() -> None:
    cache = served(small_cache())
    m = cache.match(SYSTEM + [20, 21, 22])
    held = cache.alloc(3)
    page = viz.cache_html(cache)
    st = cache.stats()
    locked = st["locked_tokens"] // cache.page_size
    for name, n in (("locked", locked), ("evictable", st["pages_cached"] - locked), ("engine", 3),
                    ("free", st["pages_free"])):
        assert f"{name} {n:,} (" in page
    assert "<details>" in page and "RadixTree" in page
    cache.free(held)
    cache.release(m)


@pytest.mark.slow                 # a Python process that imports torch: `make test` runs it
def test_html_needs_no_matplotlib_and_plots_name_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["matplotlib"] = None          # importing it raises ImportError
        import torch
        from radixkv import KVLayout, PrefixCache
        from radixkv.tools import viz
        cache = PrefixCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                     page_size=2), num_pages=8)
        viz.cache_html(cache), viz.stats_html(cache.stats()), viz.tree_html(cache.tree)
        plots = [lambda: viz.draw_tree(cache.tree), lambda: viz.plot_hit_rate_vs_pool({}),
                 lambda: viz.plot_level_breakdown({}), lambda: viz.plot_tier_traffic({}),
                 lambda: viz.plot_ttft([1], {"a": [1.0]}, query_tokens=1)]
        for plot in plots:
            try:
                plot()
            except ImportError as exc:
                assert "radixkv[notebooks]" in str(exc), exc
            else:
                raise AssertionError("a plot without matplotlib did not raise")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- plots -----------------------------------------------------------------------------------------


def test_draw_tree_one_box_per_node(plt: Any) -> None:
    cache = served(small_cache())
    m = cache.match(SYSTEM + [1, 2, 7, 8, 9])
    ax = viz.draw_tree(cache.tree, show_tokens=2)
    nodes = cache.tree.nodes()
    assert len(ax.texts) == len(nodes) + 1                      # and the root
    assert len(ax.collections) == 1                             # the edges
    assert len(ax.get_legend().get_texts()) == 3
    colours = [t.get_bbox_patch().get_facecolor() for t in ax.texts[1:]]
    locked = plt.matplotlib.colors.to_rgba(viz.COLORS["locked"])
    assert sum(c == locked for c in colours) == sum(1 for n in nodes if n.lock_ref)
    assert any("ref 1" in t.get_text() for t in ax.texts) and any("evict #1" in t.get_text() for t in ax.texts)
    cache.release(m)
    ax = viz.draw_tree(cache.tree, max_nodes=2)
    assert len(ax.texts) == 3 and "not drawn" in ax.get_title()
    ax = viz.draw_tree(RadixTree(page_size=2))
    assert len(ax.texts) == 1 and not ax.collections


def test_plot_hit_rate_vs_pool(plt: Any) -> None:
    wl = list(ChatWorkload(num_requests=30, num_system_prompts=3, system_prompt_tokens=16, turns_per_prompt=4,
                           turn_tokens=(2, 6), query_tokens=(1, 4), vocab_size=50))
    results = {"replayed": {p: replay(small_cache(num_pages=p), wl) for p in (8, 32, 128)},
               "numbers": {8: 0.1, 64: 0.5}}
    ax = viz.plot_hit_rate_vs_pool(results)
    assert len(ax.lines) == 2
    assert list(ax.lines[0].get_ydata()) == [results["replayed"][p]["hit_rate"] for p in (8, 32, 128)]
    assert ax.get_xscale() == "log"


def test_plot_level_breakdown_stacks_to_one(plt: Any) -> None:
    with small_cache(tiers=[MemoryTier()], num_pages=8) as cache:
        result = replay(cache, [SYSTEM + [i, i + 1, 9, 9] for i in range(6)] * 2)
    assert set(result["levels"]) == {"pool", "memory"}
    ax = viz.plot_level_breakdown({"tiered": result, "plain": {"pool": 0.25}})
    assert len(ax.containers) == 3                                 # pool, memory, miss
    assert all(len(c) == 2 for c in ax.containers)
    tops = [sum(c[i].get_height() for c in ax.containers) for i in range(2)]
    assert tops == pytest.approx([1.0, 1.0])
    assert ax.containers[0][0].get_height() == pytest.approx(result["levels"]["pool"]["hit_rate"])


def test_plot_tier_traffic(plt: Any) -> None:
    results = {}
    for policy in ("write_through", "write_back"):
        with small_cache(tiers=[MemoryTier()], num_pages=8, write_policy=policy) as cache:
            results[policy] = replay(cache, [SYSTEM + [i] * 6 for i in range(8)])
    ax = viz.plot_tier_traffic(results)
    assert len(ax.containers) == 2 and all(len(c) == 1 for c in ax.containers)
    written = results["write_through"]["levels"]["memory"]["bytes_in"]
    assert 1024 <= written < 1 << 20 and ax.get_ylabel().startswith("KiB")
    assert ax.containers[0][0].get_height() == pytest.approx(written / 1024)


def test_plot_ttft(plt: Any) -> None:
    left, right = viz.plot_ttft([256, 512, 1024], {"no cache": [1.0, 2.5, 7.0], "pool hit": [0.5, 0.6, 0.8],
                                                  "cpu": [0.6, 0.7, 0.9]}, query_tokens=64)
    assert len(left.lines) == 3
    assert len(right.lines) == 5                                   # three model curves and two measured
    theory = right.lines[0]
    assert theory.get_ydata()[-1] == pytest.approx((1024 + 64) / 128)
    assert right.lines[2].get_ydata()[-1] == pytest.approx((1024 + 64) / 64)
    assert list(right.lines[3].get_ydata()) == pytest.approx([2.0, 2.5 / 0.6, 7.0 / 0.8])
    assert right.lines[3].get_color() == left.lines[1].get_color()
    assert left.figure is right.figure


# -- the workloads behind the pictures -------------------------------------------------------------


def test_workloads_are_deterministic_and_shaped_as_documented() -> None:
    shape: dict[str, Any] = dict(num_tasks=1, num_examples=3, instruction_tokens=16, example_tokens=(5, 9),
                                 question_tokens=(2, 2))
    a = list(few_shot_workload(20, seed=3, **shape))
    b = list(few_shot_workload(20, seed=3, **shape))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    header = len(a[0]) - 2
    assert all(len(x) == header + 2 and np.array_equal(x[:header], a[0][:header]) for x in a)   # one shared header
    shuffled = list(few_shot_workload(20, shuffle=True, seed=3, **shape))
    assert any(not np.array_equal(x[:header], a[0][:header]) for x in shuffled)
    assert all(np.array_equal(x[:16], a[0][:16]) for x in shuffled)    # the instruction is still shared
    assert sorted(shuffled[0][:header].tolist()) == sorted(a[0][:header].tolist())   # the same examples
    docs: dict[str, Any] = dict(num_documents=6, docs_per_request=3, system_prompt_tokens=8, document_tokens=(4, 4),
                question_tokens=(2, 2))
    rag = list(rag_workload(30, seed=1, **docs))
    assert all(len(r) == 8 + 3 * 4 + 2 for r in rag) and all(np.array_equal(r[:8], rag[0][:8]) for r in rag)
    ordered = list(rag_workload(30, seed=1, sort_documents=True, **docs))
    assert [sorted(map(bytes, np.split(r[8:20], 3))) for r in rag] == \
        [sorted(map(bytes, np.split(r[8:20], 3))) for r in ordered]   # same documents, another order
    with pytest.raises(ValueError, match="docs_per_request"):
        next(rag_workload(1, num_documents=2, docs_per_request=3))
    with pytest.raises(ValueError, match="example_tokens"):
        next(few_shot_workload(1, example_tokens=(5, 1)))


def test_replay_counts_only_its_own_requests_and_survives_a_tiny_pool() -> None:
    cache = small_cache(num_pages=4)
    long = list(range(1, 20))                                     # 10 pages: more than the pool
    first = replay(cache, [long])
    assert first["hit_tokens"] == 0 and cache.stats()["cached_tokens"] == 8   # the leading pages that fit
    second = replay(cache, [long])
    assert second["requests"] == 1 and second["query_tokens"] == 19 and second["hit_tokens"] == 8
    assert second["levels"]["pool"]["hit_rate"] == second["hit_rate"] == 8 / 19
    cache.check()
    assert cache.stats()["live_matches"] == 0
