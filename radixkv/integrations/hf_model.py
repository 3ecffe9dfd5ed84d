"""A Hugging Face causal LM described to radixkv: its KV layout, windows, namespace, the checks an
engine makes before serving it from the pool, and access to one layer of its own KV cache.

Nothing here touches a cache: the Hugging Face adapter (``radixkv.integrations.transformers``) and
the reference paged engine (``radixkv.integrations.paged``) both build on it.  ``random_model``
builds a small model of a supported family from a config with random weights and a seed (nothing
is downloaded)::

    >>> from radixkv.integrations.hf_model import FAMILIES
    >>> "llama" in FAMILIES
    True
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.core._checks import check_int
from radixkv.core.hashing import Namespace
from radixkv.core.pool import KVLayout

__all__ = ["FAMILIES", "check_blendable", "check_full_attention", "check_layout", "import_transformers", "layer_kv",
           "layer_windows", "layout_for", "namespace_for", "new_dynamic_cache", "random_model",
           "weights_fingerprint"]

#: Architectures ``random_model`` builds: full attention (Llama, Qwen2, GPT-NeoX), sliding-window
#: and hybrid (Gemma-2, Gemma-3, Mistral, Cohere2; Qwen2 with ``sliding_window``), and MLA (DeepSeek-V3).
FAMILIES = ("llama", "qwen2", "gpt_neox", "gemma2", "gemma3", "mistral", "cohere2", "deepseek_v3")
_WINDOWED = ("gemma2", "gemma3", "mistral", "cohere2")


#: RoPE variants whose frequencies change with the sequence length (positional recovery would not be exact).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def import_transformers() -> Any:
    """The ``transformers`` module; ``ImportError`` naming the extra to install (``radixkv[hf]``) when it
    is missing.  O(1) once imported (the first call imports it)."""
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
    tf = import_transformers()
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
    layers = getattr(new_dynamic_cache(model.config), "layers", None)
    sliding = any(getattr(layer, "is_sliding", False) for layer in layers) if layers else (
        bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True))
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if sliding or kinds != {"full_attention"}:
        raise ValueError("model: sliding-window or hybrid attention layers drop tokens from their cache; "
                         "only full-attention models can be served from a prefix cache")


def check_blendable(model: Any) -> None:
    """Raise ``ValueError`` unless blending can serve ``model`` (a Hugging Face causal LM): RoPE
    full attention without MLA or length-dependent RoPE (see ``radixkv.reuse.blend``).  O(layers)."""
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


def new_dynamic_cache(config: Any) -> Any:
    """An empty ``DynamicCache`` for a model of ``config``: built from the config where transformers takes
    one (5.x: a full or sliding layer per layer), else plain (4.x).  It holds no KV until the model's
    first forward.  O(layers)."""
    dynamic = import_transformers().DynamicCache
    try:
        return dynamic(config=config)
    except TypeError:  # transformers 4.x: no config argument
        return dynamic()


# ------------------------------------------------------------------------------- the adapter


def layer_kv(model_cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, tokens, head_dim]`` of one layer of a ``DynamicCache``
    (transformers 5: ``layers[i].keys``; 4.x: ``key_cache[i]``)."""
    layers = getattr(model_cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return model_cache.key_cache[layer], model_cache.value_cache[layer]
