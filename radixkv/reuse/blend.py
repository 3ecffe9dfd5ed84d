"""CacheBlend: reuse the KV of documents wherever they appear in a prompt, then recompute the few
tokens whose KV matters most (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG
with Cached Knowledge Fusion", EuroSys 2025).

A prefix cache reuses KV only for the same tokens after the same prefix.  In RAG the retrieved
documents come in another order, after another system prompt, every time.  Each document's KV
computed on its own (``radixkv.reuse.segments``) is reused in two steps:

1. **Positional recovery** (exact for RoPE): a key cached at position ``p`` is the unrotated key
   rotated by ``p``; rotating it by ``Δ`` more gives the key at ``p + Δ`` (rotations compose:
   ``R(Δ) R(p) = R(p + Δ)``), to float rounding.  ``recover_positions`` does it; values carry no
   position.  What recovery cannot restore is the attention to what precedes the document in the
   prompt: the cached KV is that of the document alone.
2. **Selective recomputation** (an engine's blended forward, e.g. the reference engine's
   ``radixkv.integrations.paged_blend.blend_prefill``; ``keep_rows`` picks the rows): layer by layer,
   only a share of the reused tokens is recomputed (those whose KV deviates most from what a full
   prefill would give) and every other reused token keeps its cached KV.  A layer's K and V
   depend on the context only through the layers below it, so the first layer's cached KV is
   already exact (after recovery) and its deviation is zero: the first layer recomputes every
   token, which gives every token's fresh KV of the second layer.  From the second layer on,
   each layer computes the fresh K and V of its candidates (the tokens the layer before
   recomputed), measures their KV deviation (squared difference from the cached K and V) and
   recomputes, attention and MLP, only the highest-deviation ones (the paper's *gradual
   filtering*): a share going down linearly from ``ratio * (1 + g)`` to ``ratio * (1 - g)``
   (``g = min(1/2, (1 - ratio) / ratio)``), so that the layers after the first recompute
   ``ratio`` of the reused tokens on average.  Tokens not reused (the question, separators, a
   document not cached) are computed in every layer.

``ratio = 1`` recomputes every token in every layer: a full prefill.  ``ratio = 0`` recomputes
none: naive reuse (the positionally recovered KV as it is, with no cross-attention between
documents).  Cost per prompt of ``T`` tokens of which ``R`` reused, over ``L`` layers: the first
layer over all ``T``, then ``T - R + ratio * R`` rows per layer on average (against ``T`` per
layer for a full prefill) plus each layer's Q/K/V projections of its candidates, and one read of
every layer's keys per recomputed query.

This module is the engine-independent part (recovery, the per-layer shares, deviation and
selection): it depends on torch and ``radixkv.reuse.rope`` only.

What it is not: exact.  A blended request's KV differs from a full prefill's (by how much is what
``python -m radixkv.bench blend`` measures), so an engine marks its result approximate and never
caches its KV as a prefix (``radixkv.integrations.paged`` does both).  Supported: the RoPE models
of the reference paged engine (Llama, Qwen2, Mistral without a window) with grouped-query
attention; refused with ``ValueError`` (``radixkv.integrations.transformers.check_blendable``):
sliding windows (a window would drop the reused KV it is built on), MLA (its cached latent is
not a rotated key), and RoPE variants whose rotation depends on the sequence length
(``dynamic``, ``longrope``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixkv.reuse.rope import rotate_half

__all__ = ["Blend", "BlendInfo", "kv_deviation", "layer_ratios", "keep_rows", "recover_positions", "select_tokens"]


@dataclass(frozen=True, slots=True)
class Blend:
    """How an engine blends: ``ratio``, the share of reused tokens recomputed per layer (0 to 1;
    the paper's default, 15%); ``store_missing``, whether a document that no tier holds is
    computed on its own and stored (so that the next prompt reuses it; cost: one forward over
    the document), else computed in the prompt like any other token; ``deadline_s``, the bound
    of one document's load from the tiers (default the stack's ``timeout_s``)."""

    ratio: float = 0.15
    store_missing: bool = True
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise TypeError(f"ratio must be a number in [0, 1], got {type(self.ratio).__name__}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio!r}")
        if type(self.store_missing) is not bool:
            raise TypeError(f"store_missing must be a bool, got {type(self.store_missing).__name__}")
        if self.deadline_s is not None and (isinstance(self.deadline_s, bool)
                                            or not isinstance(self.deadline_s, (int, float))
                                            or not self.deadline_s > 0):
            raise ValueError(f"deadline_s must be a positive number of seconds or None, got {self.deadline_s!r}")


class BlendInfo(NamedTuple):
    """What one blended prefill did: ``reused`` tokens had cached KV, ``computed`` counts per layer
    the rows recomputed (reused ones and the others), ``ratio`` as asked."""

    reused: int
    computed: tuple[int, ...]
    ratio: float


def recover_positions(kv: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``kv`` (``[layers, 2, n, kv_heads, head_dim]``, K then V, computed at positions
    ``p .. p + n - 1``) moved to positions ``p + delta ..``: every key rotated by ``delta`` more
    (``inv_freq``: the model's RoPE frequencies, ``[head_dim / 2]``), values as they are.  A new
    tensor.  The angles are computed in float64.  O(size of kv).

    >>> kv = torch.randn(1, 2, 3, 1, 4)
    >>> torch.allclose(recover_positions(recover_positions(kv, 5, torch.ones(2)), -5, torch.ones(2)), kv, atol=1e-6)
    True
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be a [layers, 2, n, kv_heads, head_dim] tensor, got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"delta must be an int, got {type(delta).__name__}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] != kv.shape[-1]:
        raise ValueError(f"inv_freq must be [head_dim / 2] = [{kv.shape[-1] // 2}], got {tuple(inv_freq.shape)}")
    angles = delta * inv_freq.detach().to("cpu", torch.float64)
    angles = torch.cat([angles, angles])
    cos, sin = angles.cos().to(kv.device, kv.dtype), angles.sin().to(kv.device, kv.dtype)
    out = kv.clone()
    keys = kv[:, 0]
    out[:, 0] = keys * cos + rotate_half(keys) * sin
    return out


def layer_ratios(ratio: float, num_layers: int) -> tuple[float, ...]:
    """Per layer, the share of the reused tokens recomputed (see the module docstring): 1 on the
    first layer (0 when ``ratio`` is 0), then going down linearly around ``ratio``.  O(layers).

    >>> layer_ratios(0.2, 4)
    (1.0, 0.3, 0.2, 0.1)
    >>> layer_ratios(1.0, 3), layer_ratios(0.0, 3)
    ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0))
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if ratio <= 0:
        return (0.0,) * num_layers
    g = min(0.5, (1 - ratio) / ratio)
    rest = num_layers - 1
    shares = [ratio * (1 + g - 2 * g * j / (rest - 1)) if rest > 1 else ratio for j in range(rest)]
    return (1.0, *(round(min(1.0, s), 12) for s in shares))


def kv_deviation(k: torch.Tensor, v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor) -> torch.Tensor:
    """Per token, the squared distance of its fresh K and V (``[n, kv_heads, dim]`` each) from the
    cached ones: the paper's KV deviation, ``[n]`` (float32).  O(n x kv_heads x dim)."""
    dk = (k.float() - cached_k.float()).square().sum(dim=(1, 2))
    dv = (v.float() - cached_v.float()).square().sum(dim=(1, 2))
    return dk + dv


def select_tokens(deviation: torch.Tensor, count: int) -> torch.Tensor:
    """The indices (ascending, int64) of the ``count`` highest ``deviation`` values; ties go to the
    earlier token.  O(n log n).

    >>> select_tokens(torch.tensor([0.1, 3.0, 0.5, 3.0]), 2).tolist()
    [1, 3]
    """
    if deviation.dim() != 1:
        raise ValueError(f"deviation must be 1-D, got shape {tuple(deviation.shape)}")
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(deviation):
        raise ValueError(f"count must be an int in [0, {len(deviation)}], got {count!r}")
    order = torch.sort(-deviation.float(), stable=True).indices[:count]
    return order.sort().values


def keep_rows(rows: torch.Tensor, reused: torch.Tensor, share: float, num_reused: int, k: torch.Tensor,
              v: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Which of a layer's candidate ``rows`` (ascending token indices) it recomputes, as indices
    into ``rows`` (ascending, int64): every row not ``reused`` (bool, ``[T]``), and of the reused
    ones the ``ceil(share * num_reused)`` whose fresh ``k``/``v`` (this layer's, one per row of
    ``rows``: ``[len(rows), kv_heads, dim]``) deviate most from ``cached`` (``[2, T, kv_heads,
    dim]``, this layer's cached K and V).  The candidates are the rows the layer before
    recomputed: the paper's gradual filtering.  O(len(rows) x kv_heads x dim + len(rows) log
    len(rows)).

    >>> cached = torch.zeros(2, 4, 1, 2)
    >>> k = torch.tensor([[[0., 0.]], [[3., 0.]], [[1., 0.]], [[9., 9.]]])
    >>> keep_rows(torch.arange(4), torch.tensor([True, True, True, False]), 1 / 3, 3, k, k, cached).tolist()
    [1, 3]
    """
    mine = reused[rows]
    local = torch.nonzero(mine).flatten()
    count = min(len(local), math.ceil(round(share * num_reused, 9)))
    if count < len(local):
        where = rows[local].to(k.device)
        deviation = kv_deviation(k[local.to(k.device)], v[local.to(k.device)], cached[0, where], cached[1, where])
        local = local[select_tokens(deviation.cpu(), count)]
    return torch.cat([torch.nonzero(~mine).flatten(), local]).sort().values
