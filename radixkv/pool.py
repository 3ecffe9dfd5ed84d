"""The paged KV pool: one tensor of fixed-size pages and a free-list allocator.

Level 0 of the cache is the engine's own paged KV memory.  ``KVPool`` owns it as a single tensor

    kv: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]      (K at 1st index 0, V at 1)

so that one page id addresses the same slot in every layer, and hands pages out from a free list.
The pool knows nothing about tokens: the radix tree (``radixkv.tree``) says which pages hold which
prefix, and ``radixkv.cache.PrefixCache`` keeps the two consistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from radixkv._checks import check_int

__all__ = ["KVLayout", "KVPool", "as_page_ids", "check_device", "has_duplicates"]

# dtypes a pool may hold; fp8 and int8 pools are moved as raw bytes by the block-copy ops.
_POOL_DTYPES = {
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one model's KV cache, and the page size of its pool.

    >>> KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype=torch.float16, page_size=16).page_bytes
    4096
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            check_int(value, f"KVLayout.{name}", 1)
        if self.dtype not in _POOL_DTYPES:
            allowed = ", ".join(sorted(str(d) for d in _POOL_DTYPES))
            raise TypeError(f"KVLayout.dtype must be one of {allowed}; got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of KV one token takes in all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of KV one page takes in all layers, K and V."""
        return self.token_bytes * self.page_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a contiguous buffer holding ``num_tokens`` tokens of KV (the tiers' chunk layout)."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)


def check_device(device: Any, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that this process can allocate on: ``ValueError`` naming
    ``name`` for a malformed string or a device type without a usable accelerator ("cuda" on a
    machine without a GPU), ``TypeError`` for a non-device.  O(1).

    >>> check_device("cpu")
    device(type='cpu')
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{name}: {device!r} is not a device ({exc})") from None
    if dev.type == "cpu" or dev.type == "meta":
        return dev
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        raise ValueError(f"{name}: {device!r} needs a {dev.type} accelerator, and none is available here")
    count = getattr(module, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name}: {device!r}, but only {count} {dev.type} device(s) exist")
    return dev


def as_page_ids(pages: Any, num_pages: int, name: str = "pages") -> np.ndarray:
    """Validate page ids and return them as a 1-D int64 numpy array (no copy when already one).

    Accepts a torch tensor, numpy array, list or tuple of integers.  Raises ``TypeError`` for
    non-integer input and ``ValueError`` for ids outside ``[0, num_pages)``, naming ``name``.
    Cost: O(n), vectorised.
    """
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype == torch.bool or pages.is_complex():
            raise TypeError(f"{name} must hold integer page ids, got a {pages.dtype} tensor")
        arr = pages.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(pages)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer page ids, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_pages):
        bad = arr[(arr < 0) | (arr >= num_pages)][0]
        raise ValueError(f"{name} holds page id {int(bad)}, outside the pool's [0, {num_pages})")
    return arr


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether a 1-D id array repeats an id.  O(n log n), a sort and one comparison."""
    if ids.size < 2:
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


class KVPool:
    """A paged KV pool on one device, and the free list of its pages.

    ``kv`` is ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``; ``layer(i)`` is
    the ``[2, num_pages, page_size, num_kv_heads, head_dim]`` view of one layer.  Pages are handed
    out by ``alloc`` and given back by ``free``; a page freed twice, or an id outside the pool, is
    an error that leaves the pool as it was.

    >>> pool = KVPool(KVLayout(1, 1, 4, torch.float32, page_size=2), num_pages=4)
    >>> ids = pool.alloc(3); pool.num_free
    1
    >>> pool.free(ids); pool.num_free
    4
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        check_int(num_pages, "num_pages", 1)
        self.layout = layout
        self.num_pages = num_pages
        self.device = check_device(device)
        shape = (layout.num_layers, 2, num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        # Free list as a stack; pages are handed out from the top.  The first alloc gets page 0.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)

    def __repr__(self) -> str:
        return (f"KVPool({self.num_pages} pages x {self.layout.page_size} tokens, "
                f"{self.num_free} free, {self.kv.dtype}, {self.device})")

    @property
    def num_free(self) -> int:
        """Number of free pages.  O(1)."""
        return self._top

    def layer(self, i: int) -> torch.Tensor:
        """The ``[2, num_pages, page_size, num_kv_heads, head_dim]`` view of layer ``i``.  O(1)."""
        return self.kv[i]

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages and return their ids (int64).  O(n).

        Raises ``ValueError`` if fewer than ``n`` pages are free (the pool is left as it was);
        evicting to make room is the cache's job, not the pool's.
        """
        check_int(n, "n")
        if n > self._top:
            raise ValueError(f"cannot allocate {n} pages: only {self._top} of {self.num_pages} are free")
        ids = self._stack[self._top - n:self._top].copy()
        self._top -= n
        self._is_free[ids] = False
        return ids

    def free(self, pages: Any) -> None:
        """Give pages back.  O(n log n) for the duplicate check.

        Raises ``ValueError`` for an id outside the pool, an id given twice, or a page that is
        already free (double free); nothing is freed then.
        """
        ids = as_page_ids(pages, self.num_pages)
        if ids.size == 0:
            return
        if self._is_free[ids].any():
            bad = ids[self._is_free[ids]][0]
            raise ValueError(f"pages: page {int(bad)} is already free (double free)")
        if has_duplicates(ids):
            raise ValueError("pages: the same page id is given more than once")
        self._stack[self._top:self._top + ids.size] = ids
        self._top += ids.size
        self._is_free[ids] = True

    def is_free(self, pages: Any) -> np.ndarray:
        """Boolean mask: which of ``pages`` are free.  O(n)."""
        return self._is_free[as_page_ids(pages, self.num_pages)]

    def check(self) -> None:
        """Assert every invariant of the free list (O(num_pages)); raises ``AssertionError``."""
        assert 0 <= self._top <= self.num_pages, "free-list top out of range"
        stacked = self._stack[:self._top]
        assert np.unique(stacked).size == stacked.size, "a page is on the free list twice"
        assert int(self._is_free.sum()) == self._top, "free mask and free list disagree on the count"
        assert self._is_free[stacked].all(), "a page on the free list is not marked free"
        assert tuple(self.kv.shape) == (self.layout.num_layers, 2, self.num_pages, self.layout.page_size,
                                        self.layout.num_kv_heads, self.layout.head_dim), "pool tensor reshaped"
