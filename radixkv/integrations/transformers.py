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
transformers' ``DynamicCache`` with full attention in every layer (Llama, Qwen2, GPT-NeoX, Mistral
without a sliding window, ...), one sequence at a time.  Sliding-window and hybrid models are
refused: their cache drops tokens, so a page would no longer hold the KV of the tokens it is filed
under.  Works with the ``cache=`` keyword of transformers 5 and the ``past_key_values=`` of 4.x
(chosen from ``forward``'s signature).  Put the model in eval mode (dropout breaks exactness).

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

from radixkv._checks import check_int
from radixkv import ops
from radixkv.cache import PoolExhausted, PrefixCache
from radixkv.hashing import Namespace, as_token_bytes
from radixkv.pool import KVLayout
from radixkv.request import Request

__all__ = ["FAMILIES", "PrefixCachedLM", "Result", "check_full_attention", "check_layout", "layer_kv",
           "layout_for", "namespace_for", "random_model", "weights_fingerprint"]

#: Architectures ``random_model`` builds: two grouped-query families and one multi-head one.
FAMILIES = ("llama", "qwen2", "gpt_neox")


def _transformers() -> Any:
    try:
        import transformers  # the real package: imports are absolute, this module is radixkv's
    except ImportError as exc:
        raise ImportError("radixkv.integrations.transformers needs transformers: "
                          "pip install radixkv[hf]") from exc
    return transformers


# ------------------------------------------------------------------------------ model helpers


def random_model(family: str = "llama", seed: int = 0, *, num_layers: int = 2, hidden_size: int = 64,
                 num_heads: int = 4, num_kv_heads: int | None = None, intermediate_size: int | None = None,
                 vocab_size: int = 256, max_positions: int = 4096, initializer_range: float = 0.02,
                 dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM of ``family`` (see ``FAMILIES``) with random weights from ``seed``, in eval mode.

    Nothing is downloaded; the same arguments give the same weights in every process, and the
    caller's random state is left as it was.  ``num_kv_heads`` defaults to a quarter of the heads
    (at least 1) for the grouped-query families; ``gpt_neox`` is multi-head only (``num_kv_heads``
    must be ``None`` or ``num_heads``).  ``intermediate_size`` defaults to ``4 * hidden_size``.
    The config's ``name_or_path`` names the family, sizes and seed, so ``namespace_for`` keeps
    the KV of different random models apart.  Cost: one weight initialisation, O(parameters).
    """
    tf = _transformers()
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if family == "gpt_neox":
        if num_kv_heads not in (None, num_heads):
            raise ValueError(f"gpt_neox is multi-head attention: num_kv_heads must be None or {num_heads}")
        num_kv_heads = num_heads
    elif num_kv_heads is None:
        num_kv_heads = max(1, num_heads // 4)
    intermediate_size = intermediate_size or 4 * hidden_size
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  max_position_embeddings=max_positions, initializer_range=initializer_range,
                  tie_word_embeddings=False)
    if family == "llama":
        config = tf.LlamaConfig(num_key_value_heads=num_kv_heads, **common)
    elif family == "qwen2":
        config = tf.Qwen2Config(num_key_value_heads=num_kv_heads, use_sliding_window=False, **common)
    else:
        config = tf.GPTNeoXConfig(**common)
    config.name_or_path = (f"random/{family}-l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}"
                           f"-i{intermediate_size}-v{vocab_size}-init{initializer_range}-seed{seed}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train(False)   # inference mode (dropout off)


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def layout_for(model: Any, page_size: int = 16, dtype: torch.dtype | None = None) -> KVLayout:
    """The ``KVLayout`` of ``model``'s KV cache: layers, KV heads and head size from its config,
    ``dtype`` (default: the model's).  O(1)."""
    config = _text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype or model.dtype, page_size=page_size)


def namespace_for(model: Any, *, name: str | None = None, revision: str = "main", salt: bytes = b"",
                  lora_id: str = "", fingerprint: bool = False) -> Namespace:
    """A ``Namespace`` for ``model``: its id with ``revision``, ``lora_id`` and the tenant ``salt``.

    The id is ``name``, else the config's ``name_or_path`` (what ``from_pretrained`` was given;
    ``random_model`` sets one from its arguments).  A model built from a bare config has no
    ``name_or_path`` and is refused with ``ValueError``: its ``model_type`` alone would let every
    model of that type read each other's KV.  Give it a ``name``, or pass ``fingerprint=True``
    to append a digest of the weights (``weights_fingerprint``) to the id — with or without a name,
    so that weights changed in place under the same path or name never meet the old KV.  Pass the
    ``revision`` of the weights you loaded: a namespace is what keeps KV of other weights out.
    Cost: O(1); with ``fingerprint``, one hash pass over every weight (a device-to-host copy per
    tensor for weights on an accelerator; about a second per few GB).
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not isinstance(fingerprint, bool):
        raise TypeError(f"fingerprint must be a bool, got {type(fingerprint).__name__}")
    model_id = name or getattr(model.config, "name_or_path", "") or ""
    if not model_id and not fingerprint:
        raise ValueError(f"model: its config has no name_or_path (built from a config?), so its "
                         f"{model.config.model_type!r} type is all that would tell it from other models; "
                         f"pass name=... or fingerprint=True")
    if fingerprint:
        model_id = f"{model_id or model.config.model_type}@weights:{weights_fingerprint(model)}"
    return Namespace(model=model_id, revision=revision, lora_id=lora_id, salt=salt)


def weights_fingerprint(model: Any) -> str:
    """Hex xxh3-128 digest of ``model``'s weights: the name, dtype, shape and bytes of every tensor
    in its ``state_dict``, in name order.  Equal weights give equal digests in every process.
    Raises ``ValueError`` for weights that are not materialised (meta device).  Cost: one hash
    pass over all weights, plus a device-to-host copy per tensor for weights on an accelerator.
    """
    import xxhash

    digest = xxhash.xxh3_128()
    for key, tensor in sorted(model.state_dict().items()):
        if tensor.is_meta:
            raise ValueError(f"model: weight {key!r} is on the meta device; load the weights first")
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def check_layout(model: Any, layout: KVLayout, name: str) -> None:
    """Raise ``ValueError`` (naming the argument ``name``) unless ``layout`` holds ``model``'s KV:
    the same layers, KV heads and head size (``layout_for``; dtype and page size are free).  O(1)."""
    want = layout_for(model, layout.page_size)
    if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (want.num_layers, want.num_kv_heads,
                                                                     want.head_dim):
        raise ValueError(f"{name}: its layout holds {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                         f"{layout.head_dim}, the model's KV is {want.num_layers} x {want.num_kv_heads} x "
                         f"{want.head_dim} (build it with layout_for(model))")


def check_full_attention(model: Any) -> None:
    """Raise ``ValueError`` unless every layer of ``model`` attends to every earlier token.

    Sliding-window and hybrid models drop tokens from their cache, so a page would no longer hold
    the KV of the tokens it is filed under.  O(layers).
    """
    config = _text_config(model)
    layers = getattr(_new_dynamic_cache(model.config), "layers", None)
    sliding = any(getattr(layer, "is_sliding", False) for layer in layers) if layers else (
        bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True))
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if sliding or kinds != {"full_attention"}:
        raise ValueError("model: sliding-window or hybrid attention layers drop tokens from their cache; "
                         "only full-attention models can be served from a prefix cache")


def _new_dynamic_cache(config: Any) -> Any:
    dynamic = _transformers().DynamicCache
    try:
        return dynamic(config=config)
    except TypeError:  # transformers 4.x: no config argument
        return dynamic()


# ------------------------------------------------------------------------------- the adapter


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

    ``cache.layout`` must match the model's KV (layers, KV heads, head size; ``layout_for``); its
    dtype and device may differ from the model's (KV is converted on the way in and out).  Raises
    ``ValueError`` for a mismatch or a model with sliding-window layers.  Used from one thread.
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
        check_full_attention(model)

    def __repr__(self) -> str:
        return f"PrefixCachedLM({type(self.model).__name__}, {self.cache!r})"

    # -- the model's side ----------------------------------------------------------------------

    def new_model_cache(self) -> Any:
        """An empty cache object of the model's kind (``DynamicCache``).  O(layers)."""
        return _new_dynamic_cache(self.config)

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
        """A model cache object holding the KV of ``req``'s pages (one gather, one copy per layer)."""
        model_cache = self.new_model_cache()
        if req.num_cached:
            kv = ops.gather_pages(self.cache.pool, req.pages).to(self.device, self.dtype)
            for layer in range(kv.shape[0]):   # [2, tokens, heads, dim] -> [1, heads, tokens, dim]
                model_cache.update(kv[layer, 0].transpose(0, 1).unsqueeze(0),
                                   kv[layer, 1].transpose(0, 1).unsqueeze(0), layer)
        return model_cache

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
        pool = self.cache.pool
        try:                                # from alloc to extend the pages are ours: free them on any error
            buf = torch.empty(self.cache.layout.chunk_shape(end - start), dtype=pool.kv.dtype, device=pool.device)
            for layer in range(buf.shape[0]):
                keys, values = layer_kv(model_cache, layer)   # [1, heads, tokens, dim]
                buf[layer, 0].copy_(keys[0, :, start:end].transpose(0, 1))
                buf[layer, 1].copy_(values[0, :, start:end].transpose(0, 1))
            ops.scatter_pages(buf, pool, new)
            table = req.extend(ids, new)
        except BaseException:
            self.cache.free(new)            # extend changes nothing when it raises
            raise
        return int((table[have:] == new).sum()) * ps    # pages another request cached first were swapped


def layer_kv(model_cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, tokens, head_dim]`` of one layer of a ``DynamicCache``
    (transformers 5: ``layers[i].keys``; 4.x: ``key_cache[i]``)."""
    layers = getattr(model_cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return model_cache.key_cache[layer], model_cache.value_cache[layer]


def _token_array(tokens: Any) -> np.ndarray:
    """Validated, non-empty token ids as an int32 numpy array (``as_token_bytes``' rules)."""
    data = as_token_bytes(tokens)
    if not data:
        raise ValueError("tokens must not be empty")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)
