"""The model runner of the reference paged engine: a Hugging Face Llama-family model's weights run
with a forward of their own over the pool's pages (``radixkv.integrations.paged``).

``PagedLlama.forward`` takes a varlen batch of ``Chunk``s (each a request's new tokens, their
positions and its block table): every layer writes the new tokens' K/V into their slots of the
pool (``table[pos // page_size]``, ``pos % page_size``) and each request's queries attend, through
``attend``, to the K/V read from its pages.  No KV is kept anywhere but the pool.  Supported:
Llama, Qwen2 and Mistral (``MODEL_TYPES``), their sliding-window layers included (a sliding layer
reads and writes its KV group's pages).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from radixkv.core.cache import PrefixCache
from radixkv.core.pool import KVPool
from radixkv.integrations.hf_model import check_layout
from radixkv.reuse.rope import rotate_half

__all__ = ["MODEL_TYPES", "Chunk", "PagedLlama", "attend"]

#: ``model_type`` values whose decoder layers ``PagedLlama`` runs (all in the Llama layout).
MODEL_TYPES = ("llama", "mistral", "qwen2")

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
