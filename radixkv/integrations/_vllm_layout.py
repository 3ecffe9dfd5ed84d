"""vLLM's per-layer KV tensors as the 5-D block views that ``radixkv.core.ops.gather_blocks`` and
``scatter_blocks`` copy: ``[sides=2, num_blocks, block_size, heads, head_dim]``, any strides.

What a registered tensor holds is read from its shape and strides, with one fact about the
attention backend that shapes cannot tell: how the content axis of vLLM's logical per-layer view
splits into K and V.

* **4-D ``[num_blocks, heads, block_size, C]``** (vLLM's logical per-layer view; the physical
  order is in the strides, any ``KVCacheLayout``), ``C = 2 * head_dim``:

  - ``"last"`` (FlashAttention, Triton, FlashInfer, ...): each token's ``C`` values are K then V
    (``kv.split(head_dim, dim=-1)``);
  - ``"plane"`` (vLLM's CPU backend): each (block, head) plane of ``block_size * C`` values holds
    the block's K rows, then its V rows (``kv.view(B, H, 2 * N, D).chunk(2, dim=2)``); this needs
    the plane to be dense, which is checked.

* **5-D** tensors with a K/V axis of size 2: ``[2, B, N, H, D]``, ``[B, 2, N, H, D]`` or
  ``[2, B, H, N, D]`` (earlier vLLM releases and other engines), told apart by the sizes of
  ``block_size`` and ``heads``.

Anything else — MLA's single latent per token among them — is a ``ValueError`` naming the layer:
radixkv's chunk format stores K and V.  Views share memory with vLLM's tensors; nothing is copied.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

__all__ = ["PLANE_BACKENDS", "block_views", "split_of"]

# Backends whose logical [B, H, N, 2D] view stores K rows then V rows per (block, head) plane.
PLANE_BACKENDS = frozenset({"CPU_ATTN"})


def split_of(backend_name: str) -> str:
    """How backend ``backend_name`` (``AttentionBackend.get_name()``) splits the content axis of a
    4-D cache: ``"plane"`` or ``"last"`` (see the module docstring).  O(1)."""
    return "plane" if backend_name in PLANE_BACKENDS else "last"


def block_views(kv_caches: Mapping[str, torch.Tensor], *, block_size: int, num_kv_heads: int,
                head_dim: int, split: Mapping[str, str] | str = "last") -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` view per layer of ``kv_caches``
    (in its order), sharing memory with it.  ``block_size`` is the attention kernel's block (the
    tensors' own), ``split`` the content split of 4-D tensors, one for all or per layer name.

    Raises ``ValueError`` naming the layer for a tensor it cannot read.  O(layers), no copy.

    >>> cpu = torch.zeros(3, 2, 4, 2 * 8)                    # [B=3, H=2, N=4, 2D]: CPU backend
    >>> cpu.view(3, 2, 2, 4, 8)[1, 0, 1, 2, :] = 7.0         # block 1, head 0, V, token 2
    >>> v = block_views({"l0": cpu}, block_size=4, num_kv_heads=2, head_dim=8, split="plane")[0]
    >>> tuple(v.shape), v[1, 1, 2, 0, 0].item()
    ((2, 3, 4, 2, 8), 7.0)
    """
    views = []
    for name, kv in kv_caches.items():
        how = split if isinstance(split, str) else split.get(name, "last")
        views.append(_view(name, kv, block_size, num_kv_heads, head_dim, how))
    return views


def _view(name: str, kv: torch.Tensor, n: int, h: int, d: int, split: str) -> torch.Tensor:
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv cache {name!r}: expected a tensor, got {type(kv).__name__}")
    shape = tuple(kv.shape)
    if kv.dim() == 4 and shape[1:] == (h, n, 2 * d):
        sb, sh, sn, sc = kv.stride()
        if split == "last":
            return kv.as_strided((2, shape[0], n, h, d), (d * sc, sb, sn, sh, sc), kv.storage_offset())
        if split == "plane":
            if sc != 1 or sn != 2 * d:
                raise ValueError(f"kv cache {name!r}: a K/V plane per (block, head) needs dense "
                                 f"[block_size, 2 * head_dim] rows; strides are {kv.stride()}")
            return kv.as_strided((2, shape[0], n, h, d), (n * d, sb, d, sh, 1), kv.storage_offset())
        raise ValueError(f"kv cache {name!r}: unknown content split {split!r} (use 'last' or 'plane')")
    if kv.dim() == 5:
        if shape[0] == 2 and shape[2:] == (n, h, d):
            return kv
        if shape[1] == 2 and shape[2:] == (n, h, d):
            return kv.transpose(0, 1)
        if shape[0] == 2 and shape[2:] == (h, n, d):
            return kv.transpose(2, 3)
    raise ValueError(f"kv cache {name!r}: cannot read a [2, blocks, {n}, {h}, {d}] KV cache from shape "
                     f"{list(shape)} (MLA and other single-latent caches are not supported)")

