"""The paged KV pool: one tensor of fixed-size pages and a free-list allocator.

Level 0 of the cache is the engine's own paged KV memory.  ``KVPool`` owns it as a single tensor

    kv: [num_layers, sides, num_pages, page_size, side_heads, side_dim]

so that one page id addresses the same slot in every layer, and hands pages out from a free list
(``PagePool``, the allocator alone).  With K and V of one head size, ``sides`` is 2 (K at 0, V at 1)
of ``num_kv_heads`` heads of ``head_dim``.  MLA models cache sides of different sizes (transformers'
DeepSeek-V3 caches the compressed latent and the RoPE key: 512 and 64 wide); their layout packs
each token's KV into one side of one "head": ``num_kv_heads * head_dim`` values of K, then
``num_kv_heads * v_head_dim`` of V (``v_head_dim=0``: a single latent side), so nothing is padded.
A ``KVLayout`` with
sliding-window layers describes several *KV groups* (``KVLayout.groups``); each group has a pool of
its own (``radixkv.core.groups``).  The pool knows nothing about tokens: the radix tree
(``radixkv.core.tree``) says which pages hold which prefix, and ``radixkv.core.cache.PrefixCache`` keeps the
two consistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from radixkv.core._checks import check_int

__all__ = ["KVGroup", "KVLayout", "KVPool", "PagePool", "PoolExhausted", "as_page_ids", "check_device", "has_duplicates"]


class PoolExhausted(RuntimeError):
    """``alloc`` cannot find enough pages even after evicting every unlocked prefix."""

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
class KVGroup:
    """Layers that share one attention kind, and so one set of pages: ``window == 0`` for full
    attention (a query sees every earlier token), else a sliding window of ``window`` tokens (a
    query sees itself and the ``window - 1`` tokens before it, as transformers' masks do).  ``layers`` are model layer indices."""

    window: int
    layers: tuple[int, ...]

    @property
    def sliding(self) -> bool:
        """Whether the group's layers see only the last ``window`` tokens."""
        return self.window > 0

    def tag(self) -> str:
        """A canonical name of the group, part of its chunks' namespace: ``"w=1024;layers=0,1,2"``."""
        return f"w={self.window};layers={','.join(map(str, self.layers))}"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one model's KV cache, and the page size of its pool.

    ``v_head_dim``: the V head size where it differs from K's (MLA models such as DeepSeek-V3),
    ``0`` for a single latent side, ``None`` (default) for equal K and V heads; with a ``v_head_dim``
    of its own a token's KV is stored packed, K then V, as one side (``num_sides == 1``).
    ``windows``: one entry per layer, ``0`` for full attention or the sliding window in tokens
    (Gemma-2/3, Mistral, Cohere2, Qwen2 with sliding layers); ``None`` means full attention in every
    layer.  Layers of one window form a ``KVGroup`` (``groups``), full attention first.

    >>> KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype=torch.float16, page_size=16).page_bytes
    4096
    >>> [g.tag() for g in KVLayout(3, 1, 8, windows=(4, 0, 4)).groups]
    ['w=0;layers=1', 'w=4;layers=0,2']
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 16
    v_head_dim: int | None = None
    windows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            check_int(value, f"KVLayout.{name}", 1)
        if self.dtype not in _POOL_DTYPES:
            allowed = ", ".join(sorted(str(d) for d in _POOL_DTYPES))
            raise TypeError(f"KVLayout.dtype must be one of {allowed}; got {self.dtype!r}")
        if self.v_head_dim is not None:
            check_int(self.v_head_dim, "KVLayout.v_head_dim")
        if self.windows is not None:
            if not isinstance(self.windows, tuple):
                raise TypeError(f"KVLayout.windows must be a tuple of ints (one per layer), "
                                f"got {type(self.windows).__name__}")
            if len(self.windows) != self.num_layers:
                raise ValueError(f"KVLayout.windows has {len(self.windows)} entries for {self.num_layers} layers")
            for i, w in enumerate(self.windows):
                check_int(w, f"KVLayout.windows[{i}]")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def packed(self) -> bool:
        """Whether K and V differ in size, so that a token's KV is stored as one packed side."""
        return self.v_head_dim is not None and self.v_head_dim != self.head_dim

    @property
    def num_sides(self) -> int:
        """2 (K and V stored apart), or 1 when they are packed (``packed``)."""
        return 1 if self.packed else 2

    @property
    def side_heads(self) -> int:
        """Heads of each stored side: ``num_kv_heads``, or 1 when packed."""
        return 1 if self.packed else self.num_kv_heads

    @property
    def side_dim(self) -> int:
        """Values of each stored head: ``head_dim``, or when packed every head's K then V."""
        if self.packed:
            return self.num_kv_heads * (self.head_dim + (self.v_head_dim or 0))
        return self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes of KV one token takes in all layers, K and V."""
        return self.num_layers * self.num_sides * self.side_heads * self.side_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of KV one page takes in all layers, K and V."""
        return self.token_bytes * self.page_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a contiguous buffer holding ``num_tokens`` tokens of KV (the tiers' chunk layout)."""
        return (self.num_layers, self.num_sides, num_tokens, self.side_heads, self.side_dim)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The layers grouped by attention kind: full attention first, then windows ascending."""
        windows = self.windows or (0,) * self.num_layers
        return tuple(KVGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in sorted(set(windows)))

    @property
    def grouped(self) -> bool:
        """Whether some layer has a sliding window (the layout then has several pools' worth of groups)."""
        return self.windows is not None and any(self.windows)

    def group_layout(self, group: KVGroup) -> KVLayout:
        """The single-group layout of ``group``'s layers (the shape of its pool and its chunks)."""
        return KVLayout(len(group.layers), self.num_kv_heads, self.head_dim, self.dtype, self.page_size,
                        self.v_head_dim)


_SMALL = 64     # up to this many ids, checks run on a Python list (a tolist is cheaper than a reduction)


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
        if pages.dtype is torch.int64 and pages.is_cpu:   # what alloc hands out: no conversion
            arr = pages.numpy()                   # (an integer tensor never requires grad)
        elif pages.dtype.is_floating_point or pages.dtype == torch.bool or pages.is_complex():
            raise TypeError(f"{name} must hold integer page ids, got a {pages.dtype} tensor")
        else:
            arr = pages.detach().to("cpu", torch.int64).numpy()
    elif isinstance(pages, np.ndarray) and pages.dtype == np.int64:
        arr = pages
    else:
        arr = np.asarray(pages)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer page ids, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size <= _SMALL:                          # a few ids: Python's min/max beat two reductions
        values = arr.tolist()
        if not values or (min(values) >= 0 and max(values) < num_pages):
            return arr
    if arr.size and (arr.min() < 0 or arr.max() >= num_pages):
        bad = arr[(arr < 0) | (arr >= num_pages)][0]
        raise ValueError(f"{name} holds page id {int(bad)}, outside the pool's [0, {num_pages})")
    return arr


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether a 1-D id array repeats an id.  O(n log n), a sort and one comparison."""
    if ids.size < 2:
        return False
    if ids.size <= _SMALL:
        return len(set(ids.tolist())) < ids.size
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


class PagePool:
    """The free list of ``num_pages`` page ids, without storage: ``KVPool`` adds the KV tensor.

    Pages are handed out by ``alloc`` and given back by ``free``; a page freed twice, or an id
    outside the pool, is an error that leaves the pool as it was.  A cache whose every layer has a
    sliding window uses one for its token pages, whose KV lives in the groups' pools.

    >>> pool = PagePool(num_pages=4)
    >>> ids = pool.alloc(3); pool.num_free
    1
    >>> pool.free(ids); pool.num_free
    4
    """

    def __init__(self, num_pages: int) -> None:
        check_int(num_pages, "num_pages", 1)
        self.num_pages = num_pages
        # Free list as a stack; pages are handed out from the top.  The first alloc gets page 0.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)

    def __repr__(self) -> str:
        return f"PagePool({self.num_pages} pages, {self.num_free} free)"

    @property
    def num_free(self) -> int:
        """Number of free pages.  O(1)."""
        return self._top

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages and return their ids (int64).  O(n).

        Raises ``ValueError`` if fewer than ``n`` pages are free (the pool is left as it was);
        evicting to make room is the cache's job, not the pool's.
        """
        check_int(n, "n")
        if n > self._top:
            raise ValueError(f"cannot allocate {n} pages: only {self._top} of {self.num_pages} are free")
        return self._take(n)

    def _take(self, n: int) -> np.ndarray:
        """``alloc`` without the checks: the caller knows ``0 <= n <= num_free``."""
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
        self._give_back(ids)

    def _give_back(self, ids: np.ndarray) -> None:
        """``free`` without the checks: the caller knows ``ids`` are distinct pages it took."""
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


class KVPool(PagePool):
    """A paged KV pool on one device, and the free list of its pages (``PagePool``).

    ``kv`` is ``[num_layers, sides, num_pages, page_size, side_heads, side_dim]`` (see ``KVLayout``);
    ``layer(i)`` is the ``[sides, num_pages, page_size, side_heads, side_dim]`` view of one layer.  The layout
    must be of one KV group (``KVLayout.group_layout`` gives a group's).

    >>> pool = KVPool(KVLayout(1, 1, 4, torch.float32, page_size=2), num_pages=4)
    >>> ids = pool.alloc(3); pool.num_free
    1
    >>> pool.free(ids); pool.num_free
    4
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if layout.grouped:
            raise ValueError("layout: it has sliding-window layers, whose groups need a pool each "
                             "(KVPool(layout.group_layout(group), ...), or a PrefixCache, which makes them)")
        super().__init__(num_pages)
        self.layout = layout
        self.device = check_device(device)
        self.kv = torch.zeros(self._shape(), dtype=layout.dtype, device=self.device)

    def _shape(self) -> tuple[int, ...]:
        lay = self.layout
        return (lay.num_layers, lay.num_sides, self.num_pages, lay.page_size, lay.side_heads, lay.side_dim)

    def __repr__(self) -> str:
        return (f"KVPool({self.num_pages} pages x {self.layout.page_size} tokens, "
                f"{self.num_free} free, {self.kv.dtype}, {self.device})")

    def layer(self, i: int) -> torch.Tensor:
        """The ``[sides, num_pages, page_size, side_heads, side_dim]`` view of layer ``i``.  O(1)."""
        return self.kv[i]

    def check(self) -> None:
        """Assert every invariant of the free list and the tensor's shape (O(num_pages))."""
        super().check()
        assert tuple(self.kv.shape) == self._shape(), "pool tensor reshaped"
