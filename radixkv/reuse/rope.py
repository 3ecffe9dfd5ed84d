"""Rotary position embeddings (RoPE), the one operation radixkv needs of them.

RoPE turns the query and key of a token at position ``p`` by angles ``p * inv_freq`` (one angle
per pair of channels, ``inv_freq`` of shape ``[head_dim / 2]``): ``x * cos + rotate_half(x) * sin``
with ``cos``/``sin`` of those angles repeated over the two halves of the head (the Hugging Face
layout, whose pairs are channel ``i`` and ``i + head_dim / 2``).  Turning a key by ``Δ`` more moves
it to position ``p + Δ`` exactly, since rotations compose; the reference paged engine's forward
and CacheBlend's positional recovery (``radixkv.reuse.blend``) both build on ``rotate_half``.
"""

from __future__ import annotations

import torch

__all__ = ["rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's ``rotate_half``: ``[-x2, x1]`` of the two halves ``x1, x2`` of the last axis (a new
    tensor).  O(size of x).

    >>> rotate_half(torch.tensor([1., 2., 3., 4.])).tolist()
    [-3.0, -4.0, 1.0, 2.0]
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
