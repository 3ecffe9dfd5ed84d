"""Serve a Hugging Face causal LM through a ``PrefixCache``: prefill only what is not cached.

This module is also a worked example of an engine built on radixkv that keeps KV in the model's
own cache object (see ``radixkv.integrations.paged`` for one that decodes from the pool pages).
``PrefixCachedLM.prefill`` uses only the public engine API, in this order, for one prompt:

1. ``req = cache.open(tokens)``: the longest cached page-aligned prefix, held for the request.
   Chunks that only the tiers hold (CPU, LMDB, S3) are loaded into pool pages by this call.
2. ``ops.gather_pages(cache.pool, req.pages)``: the prefix's KV, ``[layers, 2, req.num_cached,
   kv_heads, head_dim]``, handed to the model's own cache object (``DynamicCache``) layer by layer.
3. The model runs on ``tokens[req.num_cached:]`` only, at positions ``req.num_cached, ...``.
   Cached keys are post-RoPE; they are right because every cached prefix starts at token 0, so
   a token's position is the same whenever its KV is computed.
4. ``new = cache.alloc(n)``; ``ops.scatter_pages`` copies the new KV of the full pages past the
   held ones into ``new``; ``req.extend(tokens, new)`` caches them; ``req.release()``.

The first token is known after step 3; step 4 is bookkeeping an engine can do after sending it.
``Result.timings`` times each step.  ``generate`` keeps the request open while it decodes and
calls ``req.extend`` whenever the generated tokens fill a page.  Any failure (the model's
forward, a copy, the cache) leaves every page where it was: pages from ``alloc`` are freed unless
``extend`` took them, and the request is released.

Supported: decoder-only models whose per-layer KV is ``[batch, kv_heads, seq, head_dim]`` in
transformers' ``DynamicCache`` (Llama, Qwen2, GPT-NeoX, ...), one sequence at a time, including

* sliding-window and hybrid models (Gemma-2, Gemma-3, Mistral, Cohere2, Qwen2 with sliding
  layers): ``layer_windows`` reads each layer's window from the config (``layer_types``,
  ``sliding_window``), ``layout_for`` makes one KV group per window (``radixkv.core.groups``), and the
  cache keeps a sliding layer's pages only for the last ``w - 1`` tokens before each point a match
  can end at.  The prefix is handed to the model in a ``DynamicCache()`` of plain layers with the
  dropped positions zero-filled: the model's own sliding masks exclude them, so the logits are
  exact (checked against a full forward for every family), and the new tokens' KV stays readable;
* MLA models (DeepSeek-V3), whose cache holds two sides of different widths per layer (the
  compressed latent and the RoPE key): stored packed, one side per token (``KVLayout.v_head_dim``).

A window at least as long as the model's ``max_position_embeddings`` is full attention.  Works with
the ``cache=`` keyword of transformers 5 and the ``past_key_values=`` of 4.x (chosen from
``forward``'s signature).  Put the model in eval mode (dropout breaks exactness).

Example (random weights, nothing downloaded)::

    import radixkv as rk
    from radixkv.integrations.transformers import PrefixCachedLM, layout_for, namespace_for, random_model

    model = random_model("llama", seed=0)
    cache = rk.PrefixCache(layout_for(model, page_size=16), num_pages=4096, namespace=namespace_for(model))
    lm = PrefixCachedLM(model, cache)
    lm.prefill(system_prompt + question).logits      # computes everything, caches the full pages
    lm.prefill(system_prompt + other_question)       # .match_tokens: the system prompt's full pages
    lm.generate(system_prompt + question, max_new_tokens=32)
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixkv.core._checks import check_int
from radixkv.core import ops
from radixkv.core.cache import PoolExhausted, PrefixCache
from radixkv.core.hashing import Namespace, as_token_bytes
from radixkv.core.pool import KVLayout
from radixkv.core.request import Request
from radixkv.integrations.hf_model import (FAMILIES, check_blendable, check_full_attention, check_layout,
                                           import_transformers, layer_kv, layer_windows, layout_for, namespace_for,
                                           new_dynamic_cache, random_model, weights_fingerprint)

__all__ = ["FAMILIES", "PrefixCachedLM", "Result", "check_blendable", "check_full_attention", "check_layout",
           "layer_kv", "layer_windows", "layout_for", "namespace_for", "random_model", "weights_fingerprint"]

@dataclass(frozen=True)
class Result:
    """What ``PrefixCachedLM.prefill`` did for one prompt.

    ``logits`` is ``[k, vocab]``: the last ``k`` positions of the prompt (``logits_to_keep``; all
    computed positions, i.e. ``num_tokens - match_tokens``, with 0).  ``match_tokens`` had their KV
    from the cache, ``tier_tokens`` of them loaded from the tiers by this request; ``levels`` says
    how many tokens each level served (``"pool"`` and the tier names, only those that served any).
    ``inserted_tokens`` were newly cached.  ``timings`` holds seconds: ``match`` (tier loads
    included), ``gather`` (pool pages into the model's cache object), ``forward`` (the suffix),
    ``ttft`` (the three: the first token is known then) and ``store`` (alloc, scatter, insert,
    release: after the first token).  ``model_cache`` is the model's cache object, holding the KV
    of the whole prompt, to decode from.
    """

    logits: torch.Tensor
    num_tokens: int
    match_tokens: int
    tier_tokens: int
    levels: dict[str, int]
    inserted_tokens: int
    timings: dict[str, float]
    model_cache: Any = field(repr=False, compare=False)

    @property
    def next_token(self) -> int:
        """The greedy next token: the argmax of the last position's logits."""
        return int(self.logits[-1].argmax())


class PrefixCachedLM:
    """A Hugging Face causal LM served through ``cache``: see the module docstring.

    ``cache.layout`` must match the model's KV (layers, KV heads, head sizes, windows;
    ``layout_for``); its dtype and device may differ from the model's (KV is converted on the way
    in and out).  Raises ``ValueError`` for a mismatch or a layer kind it cannot serve
    (``layer_windows``).  Used from one thread.
    """

    def __init__(self, model: Any, cache: PrefixCache) -> None:
        if not isinstance(cache, PrefixCache):
            raise TypeError(f"cache must be a PrefixCache, got {type(cache).__name__}")
        check_layout(model, cache.layout, "cache")
        self.model = model
        self.cache = cache
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._cache_position = "cache_position" in params

    def __repr__(self) -> str:
        return f"PrefixCachedLM({type(self.model).__name__}, {self.cache!r})"

    # -- the model's side ----------------------------------------------------------------------

    def new_model_cache(self) -> Any:
        """An empty cache object of the model's kind (``DynamicCache``).  O(layers).

        With sliding-window layers, one of plain layers (``DynamicCache()``): a config-built one
        would crop a sliding layer to its window, losing the new tokens' KV before it is cached;
        the masks come from the model's config either way."""
        if self.cache.layout.grouped:
            return import_transformers().DynamicCache()
        return new_dynamic_cache(self.config)

    def forward(self, input_ids: torch.Tensor, model_cache: Any, *, start: int,
                logits_to_keep: int = 1) -> torch.Tensor:
        """Run the model on ``input_ids`` (1-D) at positions ``start, start + 1, ...`` over
        ``model_cache``, which holds the KV of ``start`` tokens and receives theirs; return the
        logits of the last ``logits_to_keep`` positions (0: all), ``[k, vocab]``.

        No radixkv involved: this is the model's own cached forward, which the benchmarks time as
        the compute-only limit.  Cost: one forward over ``len(input_ids)`` tokens attending to
        ``start + len(input_ids)``.
        """
        n = input_ids.shape[-1]
        positions = torch.arange(start, start + n, device=self.device)
        kwargs: dict[str, Any] = {self._cache_kw: model_cache, "use_cache": True,
                                  "position_ids": positions.unsqueeze(0)}
        if self._cache_position:
            kwargs["cache_position"] = positions
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = logits_to_keep
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(self.device, torch.long).view(1, n), **kwargs).logits[0]
        return logits if self._logits_kw is not None or not logits_to_keep else logits[-logits_to_keep:]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one request ---------------------------------------------------------------------------

    def prefill(self, tokens: Any, *, logits_to_keep: int = 1) -> Result:
        """Compute the logits of ``tokens`` (1-D ids), reusing the KV of their cached prefix, and
        cache the KV of the rest.  See the module docstring for the steps.

        ``logits_to_keep`` as in ``forward``.  The new KV is cached only when the pool has room
        (``PoolExhausted`` from ``alloc`` is not an error: nothing is cached then).  Raises
        ``ValueError``/``TypeError`` for empty or invalid token ids.  A failure anywhere (the
        model's forward included) leaves every page as it was.  Cost: ``cache.open`` (with tier
        loads), one copy of the prefix's KV into the model's cache object, a forward over the
        uncached tokens, and one copy of their KV into the pool.
        """
        ids = _token_array(tokens)
        self._sync()
        t0 = time.perf_counter()
        with self.cache.open(ids) as req:
            return self._prefill(req, ids, logits_to_keep, t0)

    def _prefill(self, req: Request, ids: np.ndarray, logits_to_keep: int, t0: float) -> Result:
        """``prefill``'s steps after ``open`` (``req`` stays held: the caller releases it)."""
        t1 = time.perf_counter()
        matched = req.num_cached
        model_cache = self._model_cache_from(req)
        self._sync()
        t2 = time.perf_counter()
        logits = self.forward(torch.from_numpy(ids[matched:]).long(), model_cache, start=matched,
                              logits_to_keep=logits_to_keep)
        self._sync()
        t3 = time.perf_counter()
        inserted = self._extend(req, ids, model_cache)
        self._sync()
        t4 = time.perf_counter()
        timings = dict(match=t1 - t0, gather=t2 - t1, forward=t3 - t2, ttft=t3 - t0, store=t4 - t3)
        levels = {"pool": matched - req.tier_tokens}
        if req.tier_tokens:
            names = [tier.name for tier in self.cache.stack.tiers] if self.cache.stack else []
            for i, (name, served) in enumerate(zip(names, req.tier_tokens_by_tier)):
                levels[name if names.count(name) == 1 else f"{name}#{i}"] = served
        return Result(logits, len(ids), matched, req.tier_tokens, {k: v for k, v in levels.items() if v},
                      inserted, timings, model_cache)

    def generate(self, tokens: Any, max_new_tokens: int, *, eos_token_id: int | None = None) -> list[int]:
        """Greedily generate up to ``max_new_tokens`` tokens after ``tokens`` (stopping after
        ``eos_token_id``); return them.

        The prompt goes through ``prefill``'s steps and decoding continues on the model's cache
        object, while the request holds its pages.  Each page the generated tokens fill is cached
        at once (``Request.extend``), so a conversation's next turn starts from the prompt and
        the answer (all but its last token, whose KV was never computed).  A failure leaves what
        was cached before it cached and nothing held.  Cost: ``prefill``, one single-token
        forward per generated token, and one page copy into the pool per filled page.
        """
        check_int(max_new_tokens, "max_new_tokens")
        ids = _token_array(tokens)
        self._sync()
        t0 = time.perf_counter()
        with self.cache.open(ids) as req:
            result = self._prefill(req, ids, 1, t0)
            if max_new_tokens == 0:
                return []
            model_cache, token = result.model_cache, result.next_token
            seq, out = ids.tolist(), [token]
            while len(out) < max_new_tokens and token != eos_token_id:
                logits = self.forward(torch.tensor([token]), model_cache, start=len(seq))
                seq.append(token)                         # its KV is in model_cache now
                if len(seq) % self.cache.page_size == 0:
                    self._extend(req, seq, model_cache)
                token = int(logits[-1].argmax())
                out.append(token)
        return out

    def cache_sequence(self, tokens: Any, model_cache: Any) -> int:
        """Cache the KV of ``tokens`` that ``model_cache`` holds (it must hold at least their
        full pages, computed at positions 0, 1, ...); return how many tokens were newly cached.

        For an engine that computed KV outside ``prefill`` (decoding).  The tiers are not asked
        (the KV is at hand).  Cost: one ``open`` of the pool only and one copy of the KV past it
        into the pool.
        """
        ids = _token_array(tokens)
        with self.cache.open(ids, leave_last=False, load="none") as req:
            return self._extend(req, ids, model_cache)

    # -- pages <-> the model's cache object ----------------------------------------------------

    def _model_cache_from(self, req: Request) -> Any:
        """A model cache object holding the KV of ``req``'s pages (one gather per KV group, one
        copy per layer; a sliding group's dropped pages come back as zeros, which its mask hides)."""
        model_cache = self.new_model_cache()
        if req.num_cached:
            layout = self.cache.layout
            per_layer: list[torch.Tensor] = [torch.empty(0)] * layout.num_layers
            for group, kv in self._group_buffers(req):
                for j, layer in enumerate(group):
                    per_layer[layer] = kv[j]
            for layer, sides in enumerate(per_layer):
                keys, values = _unpack(sides.to(self.device, self.dtype), layout)
                model_cache.update(keys, values, layer)
        return model_cache

    def _group_buffers(self, req: Request) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(layers, kv)`` per KV group: the group's model layers and the KV of ``req``'s pages,
        ``[group layers, sides, tokens, heads, dim]``."""
        cache = self.cache
        if cache.groups is None:
            return [(tuple(range(cache.layout.num_layers)), ops.gather_pages(cache.pool, req.pages))]
        return [(g.layers, kv) for g, kv in zip(cache.layout.groups, cache.groups.gather(req.page_ids))]

    def _extend(self, req: Request, ids: Any, model_cache: Any) -> int:
        """Copy the KV of the full pages of ``ids`` (the request's sequence so far) past what
        ``req`` holds from ``model_cache`` into new pool pages and cache them with
        ``req.extend``; the number of tokens newly cached (not cached by another request first)."""
        ps = self.cache.page_size
        have, full = len(req.page_ids), len(ids) // ps
        if full <= have:
            return 0
        try:
            new = self.cache.alloc(full - have)
        except PoolExhausted:
            return 0
        start, end = have * ps, full * ps
        cache, layout = self.cache, self.cache.layout
        try:                                # from alloc to extend the pages are ours: free them on any error
            groups = layout.groups if cache.groups is not None else (None,)
            bufs = []
            for group in groups:
                layers = group.layers if group is not None else range(layout.num_layers)
                sub = layout.group_layout(group) if group is not None else layout
                buf = torch.empty(sub.chunk_shape(end - start), dtype=layout.dtype, device=cache.device)
                for j, layer in enumerate(layers):
                    keys, values = layer_kv(model_cache, layer)   # [1, heads, tokens, dim]
                    _pack(buf[j], keys[0, :, start:end], values[0, :, start:end], layout)
                bufs.append(buf)
            if cache.groups is None:
                ops.scatter_pages(bufs[0], cache.pool, new)        # type: ignore[arg-type]
            else:
                cache.groups.scatter(bufs, new.numpy())
            table = req.extend(ids, new)
        except BaseException:
            self.cache.free(new)            # extend changes nothing when it raises
            raise
        return int((table[have:] == new).sum()) * ps    # pages another request cached first were swapped


def _pack(out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: KVLayout) -> None:
    """Write one layer's ``keys`` / ``values`` (``[heads, tokens, dim]``) into ``out``, its pool
    form ``[sides, tokens, side_heads, side_dim]`` (``KVLayout``: K and V apart, or packed)."""
    if not layout.packed:
        out[0].copy_(keys.transpose(0, 1))
        out[1].copy_(values.transpose(0, 1))
        return
    k = keys.transpose(0, 1).reshape(keys.shape[1], -1)            # [tokens, heads * dim]
    out[0, :, 0, :k.shape[1]].copy_(k)
    if layout.v_head_dim:
        out[0, :, 0, k.shape[1]:].copy_(values.transpose(0, 1).reshape(values.shape[1], -1))


def _unpack(sides: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pool form ``[sides, tokens, side_heads, side_dim]`` as the model's ``keys``,
    ``values`` (``[1, heads, tokens, dim]``; an empty V for a single latent side)."""
    if not layout.packed:
        return sides[0].transpose(0, 1).unsqueeze(0), sides[1].transpose(0, 1).unsqueeze(0)
    tokens, heads = sides.shape[1], layout.num_kv_heads
    k_width = heads * layout.head_dim
    keys = sides[0, :, 0, :k_width].reshape(tokens, heads, layout.head_dim)
    values = sides[0, :, 0, k_width:].reshape(tokens, heads, layout.v_head_dim or 0)
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def _token_array(tokens: Any) -> np.ndarray:
    """Validated, non-empty token ids as an int32 numpy array (``as_token_bytes``' rules)."""
    data = as_token_bytes(tokens)
    if not data:
        raise ValueError("tokens must not be empty")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)
