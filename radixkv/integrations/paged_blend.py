"""The blended prefill of the reference paged engine (CacheBlend; opt-in, approximate): a prompt's
reused document KV, positionally recovered, with a share of its rows recomputed per layer
(``radixkv.reuse.blend`` holds the engine-independent parts: recovery, shares, selection).

``segment_kv`` computes a document's KV on its own (positions ``0 ..``), as a segment is stored;
``blend_prefill`` runs a request's prefill through ``PagedLlama``'s layers, reusing that KV where
it may and recomputing what ``keep_rows`` selects.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from radixkv.integrations.hf_model import layer_kv
from radixkv.integrations.paged_model import PagedLlama, attend
from radixkv.reuse.blend import BlendInfo, keep_rows, layer_ratios

__all__ = ["BlendPlan", "blend_prefill", "segment_kv"]


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


class BlendPlan(NamedTuple):
    """A request's reusable KV for its prefill: ``cached`` (``[layers, 2, T, kv_heads, dim]``, at
    the tokens' positions) where ``reused`` (bool, ``[T]``) is set."""

    cached: torch.Tensor
    reused: torch.Tensor


@torch.no_grad()
def segment_kv(model: Any, tokens: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The KV of ``tokens`` computed on their own (positions ``0 ..``), as a segment is stored:
    ``[layers, 2, n, kv_heads, head_dim]`` of ``dtype`` on the CPU.  One forward of ``model`` (a
    Hugging Face causal LM) over the tokens."""
    out = model(input_ids=torch.as_tensor(list(tokens), device=next(model.parameters()).device)[None],
                use_cache=True)
    sides = [torch.stack([s[0].transpose(0, 1) for s in layer_kv(out.past_key_values, i)])
             for i in range(model.config.num_hidden_layers)]
    return torch.stack(sides).to("cpu", dtype)
