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

**Blending** (opt-in, ``PagedEngine(..., blend=Blend(ratio=0.15))``; see ``radixkv.reuse.blend``): a prompt
added with ``segments=[(start, end), ...]`` (its documents) reuses each document's KV from the
segment cache (``radixkv.reuse.segments``, in the cache's tiers) wherever it sits in the prompt: at
admission, after the prefix match, each document past the matched prefix is loaded (bounded by
``Blend.deadline_s``; one not held is computed on its own and stored when ``store_missing``),
its keys moved to their positions, and the request's prefill runs alone through
``blend_prefill``, recomputing only a share of the reused tokens.  Its KV is then approximate:
the request is marked ``approximate``, nothing past the prefix it matched is cached in the tree
(the prefix before the documents, e.g. a system prompt, comes from the tree when an exact request
or ``cache.pin`` cached it), and ``stats()`` counts it apart.  Decoding batches with the other requests as usual.

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
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from radixkv.core._checks import check_int
from radixkv.reuse.blend import Blend, BlendInfo, keep_rows, layer_ratios, recover_positions
from radixkv.core.cache import PoolExhausted, PrefixCache
from radixkv.core.hashing import as_token_bytes
from radixkv.integrations.hf_model import check_blendable, check_layout
from radixkv.core.pool import KVPool
from radixkv.core.request import LOAD_MODES, Request
from radixkv.reuse.rope import rotate_half
from radixkv.reuse.segments import SegmentCache, Span, check_spans

__all__ = ["MODEL_TYPES", "Chunk", "EngineRequest", "PagedEngine", "PagedLlama", "attend", "blend_prefill", "rotate_half"]

#: ``model_type`` values whose decoder layers ``PagedLlama`` runs (all in the Llama layout).
MODEL_TYPES = ("llama", "mistral", "qwen2")

_NO_PAGES = np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------ the model


class Chunk(NamedTuple):
    """One request's part of a batch: ``tokens`` (int64, 1-D) at positions ``start, start + 1,
    ...``; ``table`` (int64) holds the page ids of positions ``0 .. start + len(tokens) - 1``
    in order (the pages of the earlier tokens hold their KV already)."""

    tokens: torch.Tensor
    start: int
    table: torch.Tensor


class PagedLlama:
    """The forward of a Llama-family model over a paged KV pool: K/V are written into and read
    from ``pool`` pages through each chunk's block table.

    Uses the model's own modules for the embedding, norms, projections, rotary embedding, MLP and
    head, and does the attention itself.  ``pool`` is a ``KVPool`` (full attention) or the
    ``PrefixCache`` whose pools hold the KV (required for a model with sliding-window layers: each
    KV group's pages, ``cache.groups``).  Raises ``ValueError`` for a model of another family, or
    a pool whose layout is not the model's (``layout_for``).
    """

    def __init__(self, model: Any, pool: KVPool | PrefixCache) -> None:
        groups = pool.groups if isinstance(pool, PrefixCache) else None
        layout = pool.layout
        if isinstance(pool, PrefixCache):
            pool = pool.pool                                        # type: ignore[assignment]
        elif not isinstance(pool, KVPool):
            raise TypeError(f"pool must be a KVPool or a PrefixCache, got {type(pool).__name__}")
        model_type = getattr(model.config, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model: PagedLlama runs {', '.join(MODEL_TYPES)} models, got {model_type!r}")
        check_layout(model, layout, "pool")
        self.model = model
        self.pool = pool
        self.groups = groups
        self.inner = model.model
        self.page_size = layout.page_size
        self.num_kv_heads, self.head_dim = layout.num_kv_heads, layout.head_dim
        self.device = next(model.parameters()).device
        # Per layer: the pool tensor holding it, its window (0: full), the tree -> group page map.
        self._layers: list[tuple[torch.Tensor, int, np.ndarray | None]] = []
        for i in range(layout.num_layers):
            if groups is None:
                self._layers.append((pool.layer(i), 0, None))       # type: ignore[union-attr]
                continue
            group = next(g for g in layout.groups if i in g.layers)
            table = groups.maps[groups.sliding.index(group)] if group.sliding else None
            self._layers.append((groups.pool_of(group).layer(group.layers.index(i)), group.window, table))

    @torch.no_grad()
    def forward(self, batch: Sequence[Chunk]) -> torch.Tensor:
        """Run ``batch`` (one ``Chunk`` per request) through the model; return the logits of
        each chunk's last token, ``[len(batch), vocab]``.

        Writes the K/V of every token of the batch into its page slot first, then attends: a query
        at position ``p`` of a request sees its keys ``0 .. p``, read from its pages.  The pages of
        the new tokens must be the caller's own (from ``alloc``): cached pages are shared by every
        request on that prefix and are only ever read.  Cost: one pass of the weights over all the
        batch's tokens, plus per request and layer one read of its ``start + len(tokens)`` keys and
        values from the pool.
        """
        if not batch:
            raise ValueError("batch must not be empty")
        ps, kvh, dim = self.page_size, self.num_kv_heads, self.head_dim
        lengths = [len(c.tokens) for c in batch]
        if min(lengths) == 0:
            raise ValueError("batch: every chunk needs at least one token")
        if any(c.tokens.is_floating_point() or c.tokens.dtype == torch.bool for c in batch):
            raise TypeError("batch: chunk tokens must be integer token ids")
        ids = torch.cat([c.tokens for c in batch]).to(self.device, torch.long)
        positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(batch, lengths)])
        tables = [c.table.to(torch.long).cpu() for c in batch]
        for c, table, n in zip(batch, tables, lengths):
            if len(table) < -(-(c.start + n) // ps):
                raise ValueError(f"batch: a table of {len(table)} pages for {c.start + n} tokens")
        split = torch.split(positions, lengths)
        slots = {}                            # per page map (None: the tree's ids): the new tokens' slots
        for _, _, mapping in self._layers:
            key = id(mapping)
            if key not in slots:
                mapped = tables if mapping is None else [torch.from_numpy(mapping[t.numpy()]) for t in tables]
                slots[key] = torch.cat([t[p // ps] * ps + p % ps for t, p in zip(mapped, split)])
                if mapping is not None and bool((slots[key] < 0).any()):
                    raise ValueError("batch: a new token's page has no page in a sliding group (not from alloc)")
        positions = positions.to(self.device)
        offsets = list(itertools.accumulate(lengths, initial=0))

        hidden, cos, sin = self.embed(ids, positions)
        total = len(ids)
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self.qkv(layer, hidden, cos, sin)
            kv, window, mapping = self._layers[i]                        # [2, pages, page_size, kvh, dim]
            flat = kv.view(2, -1, kvh, dim)                              # [2, pages * page_size, kvh, dim]
            where = slots[id(mapping)].to(flat.device)
            flat[0, where] = k.to(flat.device, flat.dtype)
            flat[1, where] = v.to(flat.device, flat.dtype)
            out = torch.empty_like(q)
            for c, table, lo, hi in zip(batch, tables, offsets, offsets[1:]):
                end = c.start + hi - lo
                pages = table[:-(-end // ps)]
                if mapping is not None:      # a sliding group: pages outside the window may be dropped
                    pages = torch.from_numpy(mapping[pages.numpy()])
                dropped = (pages < 0).to(kv.device)
                pages = pages.clamp(min=0).to(kv.device)
                keys = kv[0, pages].masked_fill(dropped[:, None, None, None], 0)
                values = kv[1, pages].masked_fill(dropped[:, None, None, None], 0)
                keys = keys.reshape(-1, kvh, dim)[:end].to(self.device, q.dtype)
                values = values.reshape(-1, kvh, dim)[:end].to(self.device, q.dtype)
                out[lo:hi] = attend(q[lo:hi], keys, values, torch.arange(c.start, end, device=q.device),
                                    attn.scaling, window)
            hidden = self.residual(layer, hidden, out)
        last = torch.tensor([hi - 1 for hi in offsets[1:]], device=self.device)
        return self.logits(hidden[0, last])

    # The pieces of a decoder layer, shared with selective recomputation (``radixkv.reuse.blend``).

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embeddings of token ``ids`` (``[1, n, hidden]``) and the rotary ``cos``/``sin`` of
        their ``positions`` (``[n, 1, head_dim]`` each).  O(n)."""
        hidden = self.inner.embed_tokens(ids)[None]                      # [1, n, hidden]
        cos, sin = self.inner.rotary_emb(hidden, positions[None])        # [1, n, head_dim]
        return hidden, cos[0, :, None], sin[0, :, None]

    def qkv(self, layer: Any, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s queries ``[n, heads, dim]``, keys and values ``[n, kv_heads, dim]`` of
        ``hidden`` (``[1, n, hidden]``), queries and keys rotated by ``cos``/``sin``.  One pass of
        the layer's norm and projections over the ``n`` rows."""
        attn = layer.self_attn
        n, kvh, dim = hidden.shape[1], self.num_kv_heads, self.head_dim
        x = layer.input_layernorm(hidden)[0]
        q = attn.q_proj(x).view(n, -1, dim)
        k = attn.k_proj(x).view(n, kvh, dim)
        v = attn.v_proj(x).view(n, kvh, dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def residual(self, layer: Any, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``hidden`` (``[1, n, hidden]``) after ``layer``'s output projection of the attention
        ``out`` (``[n, heads, dim]``) and its MLP.  One pass over the ``n`` rows."""
        hidden = hidden + layer.self_attn.o_proj(out.reshape(1, hidden.shape[1], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of final hidden states ``[n, hidden]``: the final norm and the head."""
        return self.model.lm_head(self.inner.norm(hidden))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
           window: int = 0) -> torch.Tensor:
    """Causal grouped-query attention of queries ``q`` ``[n, heads, dim]`` at ``positions``
    (``[n]``, int) over ``keys``/``values`` ``[max(positions) + 1, kv_heads, dim]`` (the keys of
    positions ``0, 1, ...``); with a ``window``, a query at ``p`` sees only the keys at
    ``p - window + 1 .. p``.  O(n x keys x heads x dim)."""
    n, heads, dim = q.shape
    kvh = keys.shape[1]
    grouped = q.view(n, kvh, heads // kvh, dim)                # query head h reads KV head h // group
    scores = torch.einsum("nhgd,lhd->hgnl", grouped, keys) * scale
    key_pos = torch.arange(keys.shape[0], device=q.device)
    query_pos = positions.to(q.device)[:, None]
    visible = key_pos[None, :] <= query_pos                    # [n, keys]
    if window:
        visible &= key_pos[None, :] > query_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hgnl,lhd->nhgd", probs, values).reshape(n, heads, dim)


@torch.no_grad()
def blend_prefill(model: PagedLlama, tokens: torch.Tensor, start: int, table: torch.Tensor,
                  cached: torch.Tensor, reused: torch.Tensor, ratio: float) -> tuple[torch.Tensor, BlendInfo]:
    """Prefill ``tokens`` (int64, ``[T]``, at positions ``start ..``) into the pool pages of
    ``table`` (page ids of positions ``0 .. start + T - 1``; the first ``start`` tokens' KV is in
    its pages already, the rest are the caller's own pages), reusing ``cached``
    (``[layers, 2, T, kv_heads, head_dim]``, positionally recovered) where ``reused`` (bool,
    ``[T]``; never the last token) is set and recomputing ``ratio`` of those per layer (see the
    ``radixkv.reuse.blend`` docstring).  Returns the last token's logits (``[vocab]``) and a
    ``BlendInfo``.

    The pages end up holding the blended KV: recomputed rows' fresh KV, the others' cached KV.
    ``model`` is a ``PagedLlama`` over a full-attention pool.  Cost: ``radixkv.reuse.blend``'s docstring's.
    """
    layout_shape = (len(model.inner.layers), 2, len(tokens), model.num_kv_heads, model.head_dim)
    if tokens.dim() != 1 or not len(tokens) or tokens.is_floating_point():
        raise ValueError(f"tokens must be a non-empty 1-D tensor of token ids, got {tuple(tokens.shape)}")
    if tuple(cached.shape) != layout_shape:
        raise ValueError(f"cached must be {layout_shape} (the KV of the {len(tokens)} tokens), got {tuple(cached.shape)}")
    if reused.dtype != torch.bool or tuple(reused.shape) != (len(tokens),):
        raise ValueError(f"reused must be a bool tensor of shape ({len(tokens)},)")
    if bool(reused[-1]):
        raise ValueError("reused: the last token is always computed (its logits are the answer)")
    if model.groups is not None:
        raise ValueError("model: blending needs a full-attention pool (no KV groups)")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio!r}")
    ps, device = model.page_size, model.device
    total, end = len(tokens), start + len(tokens)
    positions = torch.arange(start, end)
    table = table.to(torch.long).cpu()
    if len(table) < -(-end // ps):
        raise ValueError(f"table: {len(table)} pages for {end} tokens")
    slots = table[positions // ps] * ps + positions % ps
    pages = table[:-(-end // ps)]
    reused = reused.cpu()
    num_reused = int(reused.sum())
    shares = layer_ratios(ratio, len(model.inner.layers))
    fresh = torch.nonzero(~reused).flatten()
    rows = torch.arange(total) if shares[0] > 0 else fresh          # the candidates of the first layer
    hidden, cos, sin = model.embed(tokens.to(device), positions.to(device))
    computed = []
    for i, layer in enumerate(model.inner.layers):
        pool = model.pool.layer(i)                                  # [2, pages, page_size, kvh, dim]
        flat = pool.view(2, -1, model.num_kv_heads, model.head_dim)
        flat[:, slots[reused].to(flat.device)] = cached[i][:, reused].to(flat.device, flat.dtype)
        q, k, v = model.qkv(layer, hidden[:, rows.to(device)], cos[rows], sin[rows])
        # Of the candidates (the rows the layer before recomputed), this layer recomputes those
        # whose fresh KV here deviates most from the cached: a layer's KV reflects the context
        # only through the layers below it, so the first layer's never deviates and the choice
        # is made on each layer's own deviation, before its attention.
        keep = keep_rows(rows, reused, shares[i], num_reused, k, v, cached[i].to(device))
        if len(keep) < len(rows):
            rows, q, k, v = rows[keep], q[keep.to(device)], k[keep.to(device)], v[keep.to(device)]
        where = slots[rows].to(flat.device)
        flat[0, where] = k.to(flat.device, flat.dtype)
        flat[1, where] = v.to(flat.device, flat.dtype)
        keys = pool[0, pages.to(pool.device)].reshape(-1, model.num_kv_heads, model.head_dim)[:end]
        values = pool[1, pages.to(pool.device)].reshape(-1, model.num_kv_heads, model.head_dim)[:end]
        out = attend(q, keys.to(device, q.dtype), values.to(device, q.dtype), positions[rows],
                     layer.self_attn.scaling)
        new = model.residual(layer, hidden[:, rows.to(device)], out)
        hidden = hidden.clone()
        hidden[:, rows.to(device)] = new
        computed.append(len(rows))
    logits = model.logits(hidden[0, -1:])[0]
    return logits, BlendInfo(num_reused, tuple(computed), float(ratio))


class _BlendPlan(NamedTuple):
    """A request's reusable KV for its prefill: ``cached`` (``[layers, 2, T, kv_heads, dim]``, at
    the tokens' positions) where ``reused`` (bool, ``[T]``) is set."""

    cached: torch.Tensor
    reused: torch.Tensor


@torch.no_grad()
def segment_kv(model: Any, tokens: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The KV of ``tokens`` computed on their own (positions ``0 ..``), as a segment is stored:
    ``[layers, 2, n, kv_heads, head_dim]`` of ``dtype`` on the CPU.  One forward of ``model`` (a
    Hugging Face causal LM) over the tokens."""
    from radixkv.integrations.hf_model import layer_kv

    out = model(input_ids=torch.as_tensor(list(tokens), device=next(model.parameters()).device)[None],
                use_cache=True)
    sides = [torch.stack([s[0].transpose(0, 1) for s in layer_kv(out.past_key_values, i)])
             for i in range(model.config.num_hidden_layers)]
    return torch.stack(sides).to("cpu", dtype)


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
    from a full prefill's) and nothing past the prefix it matched is cached; ``blend``: what the last
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
    blend: BlendInfo | None = None
    plan: _BlendPlan | None = field(default=None, repr=False)      # set from admission to the prefill

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

    def _plan(self, r: EngineRequest) -> _BlendPlan | None:
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
        return _BlendPlan(cached, reused) if bool(reused.any()) else None

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
        new = r.kv_len // self.page_size - len(r.held)
        if new <= 0 or r.approximate:             # blended KV is never cached as a prefix
            return
        table = r.request.extend(r.tokens[:r.kv_len], r.own[:new])
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
