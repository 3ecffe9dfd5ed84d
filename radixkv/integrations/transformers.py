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
  ``sliding_window``), ``layout_for`` makes one KV group per window (``radixkv.groups``), and the
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

from radixkv._checks import check_int
from radixkv import ops
from radixkv.cache import PoolExhausted, PrefixCache
from radixkv.hashing import Namespace, as_token_bytes
from radixkv.pool import KVLayout
from radixkv.request import Request

__all__ = ["FAMILIES", "PrefixCachedLM", "Result", "check_blendable", "check_full_attention", "check_layout",
           "layer_kv", "layer_windows", "layout_for", "namespace_for", "random_model", "weights_fingerprint"]

#: Architectures ``random_model`` builds: full attention (Llama, Qwen2, GPT-NeoX), sliding-window
#: and hybrid (Gemma-2, Gemma-3, Mistral, Cohere2; Qwen2 with ``sliding_window``), and MLA (DeepSeek-V3).
FAMILIES = ("llama", "qwen2", "gpt_neox", "gemma2", "gemma3", "mistral", "cohere2", "deepseek_v3")
_WINDOWED = ("gemma2", "gemma3", "mistral", "cohere2")


#: RoPE variants whose frequencies change with the sequence length (positional recovery would not be exact).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


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
                 sliding_window: int | None = None, dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM of ``family`` (see ``FAMILIES``) with random weights from ``seed``, in eval mode.

    Nothing is downloaded; the same arguments give the same weights in every process, and the
    caller's random state is left as it was.  ``num_kv_heads`` defaults to a quarter of the heads
    (at least 1) for the grouped-query families; ``gpt_neox`` is multi-head only (``num_kv_heads``
    must be ``None`` or ``num_heads``).  ``intermediate_size`` defaults to ``4 * hidden_size``.
    ``sliding_window`` (tokens; default 16 for the windowed families, none for the others) gives
    the layers their configs make sliding a window: Gemma-2 every other layer from layer 0, Gemma-3
    and Cohere2 all but every 6th / 4th layer (at least one full layer), Mistral every layer, Qwen2
    the upper half (``max_window_layers``).  ``deepseek_v3`` is MLA with dense MLPs (tiny ranks).
    The config's ``name_or_path`` names the family, sizes, window and seed, so ``namespace_for``
    keeps the KV of different random models apart.  Cost: one weight initialisation, O(parameters).
    """
    tf = _transformers()
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if sliding_window is not None:
        check_int(sliding_window, "sliding_window", 1)
        if family not in (*_WINDOWED, "qwen2"):
            raise ValueError(f"sliding_window: {family} has no sliding-window layers")
    elif family in _WINDOWED:
        sliding_window = 16
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
    head_dim = hidden_size // num_heads
    if family == "llama":
        config = tf.LlamaConfig(num_key_value_heads=num_kv_heads, **common)
    elif family == "qwen2":
        config = tf.Qwen2Config(num_key_value_heads=num_kv_heads, use_sliding_window=sliding_window is not None,
                                sliding_window=sliding_window, max_window_layers=num_layers // 2, **common)
    elif family == "gemma2":
        config = tf.Gemma2Config(num_key_value_heads=num_kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                 sliding_window=sliding_window, **common)
    elif family == "gemma3":
        config = tf.Gemma3TextConfig(num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                     query_pre_attn_scalar=head_dim, sliding_window=sliding_window,
                                     sliding_window_pattern=min(6, num_layers), **common)
    elif family == "mistral":
        config = tf.MistralConfig(num_key_value_heads=num_kv_heads, head_dim=head_dim, sliding_window=sliding_window,
                                  **common)
    elif family == "cohere2":
        config = tf.Cohere2Config(num_key_value_heads=num_kv_heads, sliding_window=sliding_window,
                                  sliding_window_pattern=min(4, num_layers), pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **common)
    elif family == "deepseek_v3":
        config = tf.DeepseekV3Config(num_key_value_heads=num_heads, q_lora_rank=32, kv_lora_rank=32,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                     first_k_dense_replace=num_layers, n_routed_experts=4, num_experts_per_tok=2,
                                     n_group=1, topk_group=1, moe_intermediate_size=32, n_shared_experts=1, **common)
    else:
        config = tf.GPTNeoXConfig(**common)
    window = f"-w{sliding_window}" if sliding_window is not None else ""
    config.name_or_path = (f"random/{family}-l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}"
                           f"-i{intermediate_size}-v{vocab_size}-init{initializer_range}{window}-seed{seed}")
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
    each layer's window (``layer_windows``; KV groups when some layer slides), and for MLA models
    (a ``kv_lora_rank`` in the config: DeepSeek-V3) the two sides transformers caches per layer,
    the latent (``kv_lora_rank`` wide) and the RoPE key (``qk_rope_head_dim``), as one head with
    ``v_head_dim`` of its own.  ``dtype`` defaults to the model's.  O(layers)."""
    config = _text_config(model)
    windows = layer_windows(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    v_head_dim = None
    if getattr(config, "kv_lora_rank", None):
        kv_heads, head_dim, v_head_dim = 1, config.kv_lora_rank, config.qk_rope_head_dim
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype or model.dtype, page_size=page_size, v_head_dim=v_head_dim,
                    windows=windows if any(windows) else None)


def layer_windows(model: Any) -> tuple[int, ...]:
    """One entry per layer of ``model``: 0 for full attention, else its sliding window ``w`` (a
    query at position q sees the keys at q - w + 1 .. q, transformers' ``sliding_window_overlay``).
    Read from ``layer_types`` and ``sliding_window`` (Qwen2's ``use_sliding_window`` switch
    included); without ``layer_types`` a set ``sliding_window`` makes every layer slide (Mistral).
    A window of at least ``max_position_embeddings`` tokens is full attention.  Raises
    ``ValueError`` for layer kinds a prefix cache cannot serve this way (chunked or bidirectional
    attention, linear attention).  O(layers)."""
    config = _text_config(model)
    n = config.num_hidden_layers
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("model: bidirectional attention: a token's KV depends on later tokens")
    window = getattr(config, "sliding_window", None)
    if window is not None and not getattr(config, "use_sliding_window", True):
        window = None
    types = list(getattr(config, "layer_types", None) or
                 ["sliding_attention" if window is not None else "full_attention"] * n)[:n]
    if len(types) != n:
        raise ValueError(f"model: layer_types has {len(types)} entries for {n} layers")
    max_pos = getattr(config, "max_position_embeddings", None)
    out = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            out.append(0)
        elif kind == "sliding_attention":
            if not window or window < 1:
                raise ValueError(f"model: layer {i} is sliding_attention but sliding_window is {window!r}")
            out.append(0 if max_pos is not None and window >= max_pos else int(window))
        else:
            raise ValueError(f"model: layer {i} is {kind!r}; full and sliding-window attention are supported")
    return tuple(out)


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
    the same layers, KV heads, head sizes and windows (``layout_for``; dtype and page size are
    free).  O(layers)."""
    want = layout_for(model, layout.page_size)
    if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (want.num_layers, want.num_kv_heads,
                                                                     want.head_dim):
        raise ValueError(f"{name}: its layout holds {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                         f"{layout.head_dim}, the model's KV is {want.num_layers} x {want.num_kv_heads} x "
                         f"{want.head_dim} (build it with layout_for(model))")
    if (layout.v_head_dim, layout.windows) != (want.v_head_dim, want.windows):
        raise ValueError(f"{name}: its layout has v_head_dim={layout.v_head_dim}, windows={layout.windows}; the "
                         f"model's are {want.v_head_dim}, {want.windows} (build it with layout_for(model))")


def check_full_attention(model: Any) -> None:
    """Raise ``ValueError`` unless every layer of ``model`` attends to every earlier token (for
    engines that read the whole prefix from the pool, such as ``radixkv.integrations.paged``).
    O(layers).
    """
    config = _text_config(model)
    layers = getattr(_new_dynamic_cache(model.config), "layers", None)
    sliding = any(getattr(layer, "is_sliding", False) for layer in layers) if layers else (
        bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True))
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if sliding or kinds != {"full_attention"}:
        raise ValueError("model: sliding-window or hybrid attention layers drop tokens from their cache; "
                         "only full-attention models can be served from a prefix cache")


def check_blendable(model: Any) -> None:
    """Raise ``ValueError`` unless blending can serve ``model`` (a Hugging Face causal LM): RoPE
    full attention without MLA or length-dependent RoPE (see ``radixkv.blend``).  O(layers)."""
    config = model.config
    if getattr(config, "kv_lora_rank", None):
        raise ValueError("model: MLA (a compressed latent KV) cannot be blended: its cached latent is not a "
                         "rotated key, so positional recovery does not apply")
    if any(layer_windows(model)):
        raise ValueError("model: sliding-window layers cannot be blended: a window drops the reused KV that "
                         "selective recomputation builds on")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError("model: blending needs rotary position embeddings (model.model.rotary_emb)")
    if getattr(rotary, "rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"model: {rotary.rope_type!r} RoPE changes its frequencies with the sequence length; "
                         "positional recovery would not be exact")


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
            return _transformers().DynamicCache()
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


def layer_kv(model_cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, tokens, head_dim]`` of one layer of a ``DynamicCache``
    (transformers 5: ``layers[i].keys``; 4.x: ``key_cache[i]``)."""
    layers = getattr(model_cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return model_cache.key_cache[layer], model_cache.value_cache[layer]


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
