"""Pictures of a cache: HTML for Jupyter's rich display, matplotlib figures for the notebooks.

The HTML functions (``tree_html``, ``cache_html``, ``stats_html``, ``table_html``) need nothing
beyond the core: they return self-contained HTML strings (no scripts, inline styles only, every
piece of text escaped) that read the same in Jupyter and in GitHub's notebook viewer; the colours
help, the words (``locked``, ``evictable``) carry the meaning.  ``RadixTree``, ``PrefixCache`` and
``PrefixCache.stats()`` show themselves through them.

The plotting functions import matplotlib when called (``pip install 'radixkv[notebooks]'``) and
draw into ``ax`` when given one, else into a new figure; they return what they drew into.

Colours, the same everywhere: a **locked** node (in use by a running request, never evicted) is
red, an **evictable** leaf (unlocked, no children: what ``evict`` frees next, oldest first) is
green, any other cached node is grey.

>>> from radixkv.core.tree import RadixTree
>>> tree = RadixTree(page_size=2)
>>> _ = tree.insert([1, 2, 3, 4], [0, 1])
>>> "evictable" in tree_html(tree)
True
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from radixkv.core.cache import PrefixCache
    from radixkv.core.tree import RadixNode, RadixTree

__all__ = ["COLORS", "cache_html", "draw_tree", "plot_hit_rate_vs_pool", "plot_level_breakdown",
           "plot_tier_traffic", "plot_ttft", "stats_html", "table_html", "tree_html"]

#: Node and level colours: strong ones for plots, light ones for HTML backgrounds.
COLORS = {
    "locked": "#d1495b", "evictable": "#3a9d5d", "cached": "#9aa5b1", "engine": "#4878a8", "free": "#ffffff",
    "locked_bg": "#f8d7dc", "evictable_bg": "#d9f0df", "cached_bg": "#eceff2",
    "pool": "#2f4b7c", "cpu": "#f28e2b", "lmdb": "#59a14f", "s3": "#8e6bb0", "memory": "#b07aa1",
    "miss": "#e6e6e6",
}
_LEVEL_FALLBACK = ("#e15759", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")
_SERIES = ("#4e79a7", "#e15759", "#76b7b2", "#edc948", "#9c755f")
_CELL = "padding:2px 8px;border:1px solid #ccc;text-align:"
_HEAD = "padding:2px 8px;border:1px solid #ccc;background:#f3f3f3;text-align:left"


# ------------------------------------------------------------------------------------ helpers


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt(key: str, value: Any) -> str:
    """A counter as display text (not yet escaped): thousands separators, rates as percentages,
    byte counts in binary units, lists joined."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(key, v) for v in value)
    if isinstance(value, (int, float)) and "bytes" in key:
        return _human_bytes(value)
    if isinstance(value, float) and key.endswith("rate"):
        return f"{value:.1%}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value)


def _td(key: str, value: Any) -> str:
    """One table cell: numbers right-aligned, text left-aligned, escaped."""
    number = isinstance(value, (int, float, list, tuple)) and not isinstance(value, bool)
    return f'<td style="{_CELL}{"right" if number else "left"}">{_esc(_fmt(key, value))}</td>'


def _eviction_order(tree: RadixTree) -> dict[int, int]:
    """``id(node) -> rank`` (1 = evicted first) for the evictable leaves, in LRU order."""
    leaves = [n for n in tree.nodes() if n.lock_ref == 0 and not n.children]
    leaves.sort(key=lambda n: (n.last_access, n.serial))
    return {id(n): rank for rank, n in enumerate(leaves, start=1)}


def _kind(node: RadixNode) -> str:
    if node.lock_ref > 0:
        return "locked"
    return "cached" if node.children else "evictable"


def _head_tokens(node: RadixNode, show: int) -> str:
    if show <= 0:
        return ""
    toks = node.token_ids
    return " ".join(map(str, toks[:show].tolist())) + (" …" if len(toks) > show else "")


def _sorted_children(node: RadixNode) -> list[RadixNode]:
    return sorted(node.children.values(), key=lambda c: c.key)


# --------------------------------------------------------------------------------------- HTML


def table_html(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
               caption: str | None = None) -> str:
    """An HTML table of ``rows`` (one mapping each), columns in first-seen order unless given.

    Numbers are formatted as ``stats_html`` does (rates as %, ``*bytes*`` in KiB/MiB, thousands
    separators); text is escaped; a missing value is an empty cell.  Cost: O(rows * columns).

    >>> table_html([{"level": "pool", "hit_tokens": 1234}])  # doctest: +ELLIPSIS
    '<table ...<th ...>level</th><th ...>hit_tokens</th>...<td ...>pool</td><td ...>1,234</td>...'
    """
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            seen.update(dict.fromkeys(row))
        columns = list(seen)
    out = ['<table style="border-collapse:collapse;font-size:12px;margin:4px 0">']
    if caption:
        out.append(f'<caption style="text-align:left;font-weight:bold">{_esc(caption)}</caption>')
    out.append("<tr>" + "".join(f'<th style="{_HEAD}">{_esc(c)}</th>' for c in columns) + "</tr>")
    for row in rows:
        cells = "".join(_td(c, row[c]) if c in row else f'<td style="{_CELL}left"></td>' for c in columns)
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "".join(out)


def _legend_html() -> str:
    items = [("locked", "locked (in use, never evicted)"), ("evictable", "evictable leaf (#n: eviction order)"),
             ("cached", "cached")]
    spans = "".join(f'<span style="background:{COLORS[k + "_bg"]};border-left:4px solid {COLORS[k]};'
                    f'padding:0 6px;margin-right:6px">{_esc(text)}</span>' for k, text in items)
    return f'<div style="margin:2px 0 4px 0">{spans}</div>'


def tree_html(tree: RadixTree, max_nodes: int = 100, show_tokens: int = 6) -> str:
    """The tree as nested lists: each node's first ``show_tokens`` token ids, its tokens and pages,
    ``locked ×N`` on nodes in use and ``evictable #k`` on the leaves ``evict`` would free, k-th.

    At most ``max_nodes`` nodes are listed (depth first, children in token order); a line says how
    many more there are.  Cost: O(n log n) for n nodes (the eviction order is sorted).
    """
    order = _eviction_order(tree)
    locked = tree.protected_size
    head = (f'<div><b>RadixTree</b> page_size={tree.page_size} · {tree.num_nodes:,} nodes · '
            f'{tree.total_size:,} tokens ({locked:,} locked, {tree.evictable_size:,} evictable)</div>')
    budget = [max_nodes]
    lines: list[str] = []

    def item(node: RadixNode) -> str:
        kind = _kind(node)
        mark = {"locked": f"locked ×{node.lock_ref}", "evictable": f"evictable #{order.get(id(node), '?')}",
                "cached": ""}[kind]
        toks = _head_tokens(node, show_tokens)
        text = (f"[{toks}] " if toks else "") + f"{node.num_tokens:,} tokens · {len(node.pages):,} pages"
        badge = f' <b>{_esc(mark)}</b>' if mark else ""
        return (f'<span style="background:{COLORS[kind + "_bg"]};border-left:4px solid {COLORS[kind]};'
                f'padding:0 6px">{_esc(text)}{badge}</span>')

    def walk(node: RadixNode) -> None:
        kids = _sorted_children(node)
        if not kids:
            return
        lines.append('<ul style="list-style:none;margin:0;padding-left:1.4em">')
        for child in kids:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            lines.append(f"<li>{item(child)}")
            walk(child)
            lines.append("</li>")
        lines.append("</ul>")

    walk(tree.root)
    shown = max_nodes - budget[0]
    more = (f'<div><i>… {tree.num_nodes - shown:,} more nodes not shown</i></div>'
            if tree.num_nodes > shown else "")
    body = "".join(lines) if lines else "<div><i>empty</i></div>"
    return (f'<div class="radixkv-tree" style="font-family:monospace;font-size:12px">{head}{_legend_html()}'
            f'<div>root</div>{body}{more}</div>')


def stats_html(stats: Mapping[str, Any]) -> str:
    """``PrefixCache.stats()`` as tables: a one-line summary, the counters (three per row), one row
    per level (pool, then each tier) and the tier stack's own counters.  Cost: O(counters)."""
    scalars = [(k, v) for k, v in stats.items() if not isinstance(v, (dict, list, tuple))]
    lists = [(k, v) for k, v in stats.items() if isinstance(v, (list, tuple)) and k != "levels"]
    out = ['<div class="radixkv-stats" style="font-size:12px">']
    if "hit_rate" in stats and "query_tokens" in stats:
        out.append(f'<div><b>hit rate {_esc(_fmt("hit_rate", stats["hit_rate"]))}</b> of '
                   f'{_esc(_fmt("query_tokens", stats["query_tokens"]))} query tokens</div>')
    per_row = 3
    cells = [f'<th style="{_HEAD}">{_esc(k)}</th>{_td(k, v)}' for k, v in scalars + lists]
    rows = ["<tr>" + "".join(cells[i:i + per_row]) + "</tr>" for i in range(0, len(cells), per_row)]
    out.append('<table style="border-collapse:collapse;font-size:12px;margin:4px 0">'
               '<caption style="text-align:left;font-weight:bold">counters</caption>' + "".join(rows) + "</table>")
    levels = stats.get("levels")
    if levels:
        out.append(table_html(levels, caption="levels"))
    stack = stats.get("stack")
    if isinstance(stack, Mapping):
        tiers = list(stack.get("tiers", []))
        per_tier = [{"counter": k, **dict(zip(tiers, v))} for k, v in stack.items()
                    if isinstance(v, (list, tuple)) and k != "tiers" and len(v) == len(tiers)]
        others = {k: v for k, v in stack.items() if not isinstance(v, (list, tuple, dict))}
        if per_tier:
            out.append(table_html(per_tier, ["counter", *tiers], caption="tier stack, per tier"))
        if others:
            out.append(table_html([others], caption="tier stack"))
    out.append("</div>")
    return "".join(out)


def cache_html(cache: PrefixCache, max_nodes: int = 50) -> str:
    """A ``PrefixCache`` at a glance: its shape, a bar of the pool's pages (locked, evictable,
    held by the engine, free), one row per level, and the tree (folded, at most ``max_nodes``
    nodes).  Cost: one ``stats()`` (O(num_pages)) and ``tree_html``."""
    st = cache.stats()
    total = st["pages_total"]
    locked = st["locked_tokens"] // cache.page_size
    parts = [("locked", locked, COLORS["locked"]), ("evictable", st["pages_cached"] - locked, COLORS["evictable"]),
             ("engine", st["pages_engine"], COLORS["engine"]), ("free", st["pages_free"], COLORS["free"])]
    bar = "".join(f'<td title="{_esc(name)}" style="width:{100 * n / total:.2f}%;background:{color};'
                  f'height:14px;padding:0;border:0"></td>' for name, n, color in parts if n)
    legend = " · ".join(f"{_esc(name)} {n:,} ({n / total:.0%})" for name, n, _ in parts)
    tiers = ", ".join(t.name for t in cache.stack.tiers) if cache.stack is not None else "none"
    head = (f'<div><b>PrefixCache</b> {total:,} pages × {cache.page_size} tokens on {_esc(cache.pool.device)} · '
            f'chunk {cache.chunk_size} · tiers: {_esc(tiers)} · {_esc(cache.write_policy)} · '
            f'namespace {_esc(cache.namespace.model)}</div>')
    summary = (f'<div>hit rate {_esc(_fmt("hit_rate", st["hit_rate"]))} of {st["query_tokens"]:,} query tokens · '
               f'{st["cached_tokens"]:,} tokens cached in {st["nodes"]:,} nodes · {st["live_matches"]} live matches'
               f'</div>')
    pool = (f'<div>pool pages: {legend}</div><table style="width:100%;border-collapse:collapse;'
            f'border:1px solid #999;margin:2px 0"><tr>{bar}</tr></table>')
    levels = table_html(st["levels"], caption="levels")
    tree = (f'<details><summary>tree ({cache.tree.num_nodes:,} nodes)</summary>'
            f'{tree_html(cache.tree, max_nodes=max_nodes)}</details>')
    return f'<div class="radixkv-cache" style="font-size:12px">{head}{summary}{pool}{levels}{tree}</div>'


# ----------------------------------------------------------------------------------- matplotlib


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("radixkv.tools.viz plots need matplotlib: pip install 'radixkv[notebooks]'") from None
    return plt


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=figsize, layout="constrained")
    return ax


def _level_color(name: str, i: int) -> str:
    return COLORS.get(name.split("#")[0], _LEVEL_FALLBACK[i % len(_LEVEL_FALLBACK)])


def draw_tree(tree: RadixTree, ax: Axes | None = None, *, max_nodes: int = 60, show_tokens: int = 0,
              title: str | None = None) -> Axes:
    """Draw ``tree`` top-down: one box per node with its token count (and first ``show_tokens``
    token ids), ``ref N`` on locked nodes and ``evict #k`` on evictable leaves (k-th to go), edges
    to the children, and a legend of the three colours.  At most ``max_nodes`` nodes, breadth
    first (the title says how many were left out).

    Artists: one text per node drawn plus one for the root, one line collection for the edges
    (none for an empty tree), one legend.  Cost: O(n log n).
    """
    _pyplot()
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Patch

    order = _eviction_order(tree)
    # Breadth first, so that a cut keeps the top of the tree.
    keep: dict[int, RadixNode] = {}
    frontier = [tree.root]
    while frontier and len(keep) < max_nodes:
        nxt = []
        for node in frontier:
            for child in _sorted_children(node):
                if len(keep) < max_nodes:
                    keep[id(child)] = child
                    nxt.append(child)
        frontier = nxt
    pos: dict[int, tuple[float, float]] = {}
    leaves = [0]

    def place(node: RadixNode, depth: int) -> float:
        kids = [c for c in _sorted_children(node) if id(c) in keep]
        if kids:
            xs = [place(c, depth + 1) for c in kids]
            x = (xs[0] + xs[-1]) / 2
        else:
            x = float(leaves[0])
            leaves[0] += 1
        pos[id(node)] = (x, -depth)
        return x

    place(tree.root, 0)
    width = max(leaves[0], 1)
    depth = -min(y for _, y in pos.values())
    ax = _axes(ax, (min(16.0, max(6.0, 1.3 * width)), min(10.0, max(2.5, 1.2 * depth + 1.5))))
    edges = [(pos[id(n)], pos[id(n.parent)]) for n in keep.values() if n.parent is not None]
    if edges:
        ax.add_collection(LineCollection(edges, colors="#888888", linewidths=1.0, zorder=1))
    ax.text(*pos[id(tree.root)], "root", ha="center", va="center", fontsize=8, color="white", zorder=2,
            bbox=dict(boxstyle="round,pad=0.3", fc="#333333", ec="#333333"))
    for node in keep.values():
        kind = _kind(node)
        label = f"{node.num_tokens} tok"
        toks = _head_tokens(node, show_tokens)
        if toks:
            label = f"[{toks}]\n{label}"
        if kind == "locked":
            label += f"\nref {node.lock_ref}"
        elif kind == "evictable":
            label += f"\nevict #{order[id(node)]}"
        ax.text(*pos[id(node)], label, ha="center", va="center", fontsize=8, zorder=2,
                color="white" if kind != "cached" else "black",
                bbox=dict(boxstyle="round,pad=0.3", fc=COLORS[kind], ec=COLORS[kind]))
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-depth - 0.6, 0.6)
    ax.axis("off")
    handles = [Patch(color=COLORS["locked"], label="locked (in use)"),
               Patch(color=COLORS["evictable"], label="evictable leaf"),
               Patch(color=COLORS["cached"], label="cached")]
    ax.legend(handles=handles, loc="lower left", fontsize=8, frameon=False, bbox_to_anchor=(0, -0.02))
    cut = tree.num_nodes - len(keep)
    text = title if title is not None else (f"{tree.num_nodes} nodes, {tree.total_size} tokens, "
                                            f"{tree.protected_size} locked")
    ax.set_title(text + (f" ({cut} nodes not drawn)" if cut else ""), fontsize=10)
    return ax


def _hit_rate(value: Any) -> float:
    """A hit rate from a number or a ``replay`` result."""
    return float(value["hit_rate"]) if isinstance(value, Mapping) else float(value)


def plot_hit_rate_vs_pool(results: Mapping[str, Mapping[float, Any]], ax: Axes | None = None, *,
                          xlabel: str = "pool size (tokens)", title: str | None = None,
                          logx: bool | None = None) -> Axes:
    """One line per label: token hit rate against pool size.

    ``results`` maps a label to ``{pool_size: hit_rate}``, where a hit rate is a number in [0, 1] or
    a ``radixkv.tools.workloads.replay`` result.  ``logx`` (default: when sizes span over 10x) puts the
    x axis on a log scale.  Artists: one line per label, one legend.  Cost: O(points).
    """
    _pyplot()
    from matplotlib.ticker import PercentFormatter

    ax = _axes(ax, (6.5, 4.0))
    sizes: list[float] = []
    for label, curve in results.items():
        xs = sorted(curve)
        sizes.extend(xs)
        ax.plot(xs, [_hit_rate(curve[x]) for x in xs], marker="o", markersize=4, label=label)
    if logx is None:
        logx = bool(sizes) and min(sizes) > 0 and max(sizes) / min(sizes) > 10
    if logx:
        ax.set_xscale("log", base=2)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("token hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _levels_of(value: Any) -> dict[str, float]:
    """``{level: hit_rate}`` from a ``replay`` result or a plain mapping of rates."""
    levels = value.get("levels", value)
    return {name: _hit_rate(v) for name, v in levels.items()}


def plot_level_breakdown(results: Mapping[str, Any], ax: Axes | None = None, *,
                         title: str | None = None) -> Axes:
    """One stacked bar per label: the share of query tokens each level served (pool first, then
    the tiers in stack order) and, on top, the share missed, with the total hit rate written above.

    ``results`` maps a label to a ``replay`` result, or to ``{level: hit_rate}``.  Artists: one bar
    container per level seen plus one for the misses, each with one bar per label; one legend.
    Cost: O(labels * levels).
    """
    _pyplot()
    from matplotlib.ticker import PercentFormatter

    labels = list(results)
    rates = [_levels_of(results[label]) for label in labels]
    names: dict[str, None] = {}
    for r in rates:
        names.update(dict.fromkeys(r))
    ax = _axes(ax, (max(4.0, 1.1 * len(labels) + 2.5), 4.0))
    xs = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for i, name in enumerate(names):
        heights = [r.get(name, 0.0) for r in rates]
        ax.bar(xs, heights, bottom=bottom, color=_level_color(name, i), label=name, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar(xs, [max(0.0, 1 - b) for b in bottom], bottom=bottom, color=COLORS["miss"], label="miss", width=0.6,
           hatch="//", edgecolor="#bbbbbb", linewidth=0)
    for x, total in zip(xs, bottom):
        ax.text(x, 1.01, f"{total:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, labels, fontsize=8, rotation=20 if max(map(len, labels), default=0) > 10 else 0)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("share of query tokens")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_tier_traffic(results: Mapping[str, Mapping[str, Any]], ax: Axes | None = None, *,
                      key: str = "bytes_in", title: str | None = None) -> Axes:
    """Grouped bars: for each tier, ``key`` of its ``levels`` entry in each ``replay`` result
    (default ``bytes_in``: bytes written into the tier; ``bytes_out``: bytes loaded from it).

    ``results`` maps a label (e.g. a write policy) to a ``replay`` result.  The pool is left out.
    Bars are in the binary unit (B, KiB, MiB, GiB) of the largest one, which the y label names.
    Artists: one bar container per label, with one bar per tier; one legend.  Cost: O(labels * tiers).
    """
    _pyplot()
    labels = list(results)
    tiers: dict[str, None] = {}
    for label in labels:
        tiers.update(dict.fromkeys(n for n in results[label]["levels"] if n != "pool"))
    values = {label: [results[label]["levels"].get(name, {}).get(key, 0) for name in tiers] for label in labels}
    top = max((v for vs in values.values() for v in vs), default=0)
    scale, unit = next(((1 << s, u) for s, u in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if top >= 1 << s), (1, "B"))
    ax = _axes(ax, (max(4.0, 1.4 * len(tiers) + 2.5), 3.6))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs = [t + (i - (len(labels) - 1) / 2) * width for t in range(len(tiers))]
        ax.bar(xs, [v / scale for v in values[label]], width=width * 0.95, label=label, color=_SERIES[i % len(_SERIES)])
    ax.set_xticks(range(len(tiers)), list(tiers))
    what = {"bytes_in": "written to the tier", "bytes_out": "loaded from the tier"}.get(key, key)
    ax.set_ylabel(f"{unit} {what}")
    ax.set_ylim(0, top / scale * 1.3 or 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=max(1, len(labels)), frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_ttft(prefix_tokens: Sequence[int], ttft_s: Mapping[str, Sequence[float]], *, query_tokens: int,
              baseline: str | None = None, axes: Sequence[Axes] | None = None,
              title: str | None = None) -> tuple[Axes, Axes]:
    """Time to first token against prefix length (left) and the speedup it gives (right).

    ``ttft_s`` maps a series label (``"no cache"``, ``"pool hit"``, ...) to seconds, one per entry
    of ``prefix_tokens``; ``baseline`` (default: the first series) is the uncached one, and every
    other series' speedup is ``baseline / series``, drawn beside the theoretical (P+Q)/(2Q) for
    ``query_tokens`` = Q, the exact attention-only ratio ((P+Q)^2/2) / (QP + Q^2/2), and (P+Q)/Q,
    the ratio of work that costs the same per token (projections, MLP): a real model's speedup lies
    between the last two.  A series keeps its colour in both panels.  ``axes``: two axes to draw
    into (default: a new 1x2 figure).  Artists: one line per series on the left; the three model
    curves, then one line per cached series, on the right.  Cost: O(points).
    """
    plt = _pyplot()
    from radixkv.tools.workloads import modelled_prefill_saving

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    left, right = axes[0], axes[1]
    base = baseline if baseline is not None else next(iter(ttft_s))
    colors = {label: _SERIES[i % len(_SERIES)] for i, label in enumerate(ttft_s)}
    ps = list(prefix_tokens)
    for label, seconds in ttft_s.items():
        left.plot(ps, [s * 1e3 for s in seconds], marker="o", markersize=4, label=label, color=colors[label])
    left.set_xlabel(f"prefix P (tokens), question Q = {query_tokens}")
    left.set_ylabel("TTFT (ms)")
    left.set_yscale("log")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    q = query_tokens
    dense = [ps[0] + (ps[-1] - ps[0]) * i // 100 for i in range(101)] if ps else []
    right.plot(dense, [(p + q) / (2 * q) for p in dense], color="black", label="theory (P+Q)/(2Q)")
    exact = [modelled_prefill_saving(p + q, p) for p in dense]
    right.plot(dense, [f / c for f, c in exact], color="black", linestyle=":", label="attention only, exact")
    right.plot(dense, [(p + q) / q for p in dense], color="#999999", linestyle="--",
               label="per-token work only, (P+Q)/Q")
    for label, seconds in ttft_s.items():
        if label != base:
            right.plot(ps, [b / s for b, s in zip(ttft_s[base], seconds)], marker="o", markersize=4,
                       label=f"measured: {label}", color=colors[label])
    right.set_xlabel("prefix P (tokens)")
    right.set_ylabel(f"speedup over {base}")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    if title:
        left.figure.suptitle(title, fontsize=11)
    return left, right

