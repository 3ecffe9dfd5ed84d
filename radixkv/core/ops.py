"""Block copies between KV blocks (the paged pool, or an engine's own per-layer KV) and chunk buffers.

Every tier hit and every store moves a chunk of KV between blocks scattered in a KV cache and a
contiguous chunk buffer ``[num_layers, sides, num_tokens, heads, head_dim]`` (the tiers' layout).
Two pairs of ops do it in one call for all layers:

    gather_blocks(layers, ids, out)    out[l, s, (k+i)*bs + t] = layers[l][s, ids[i], t]
    scatter_blocks(src, layers, ids)   layers[l][s, ids[i], t] = src[l, s, (k+i)*bs + t]

for every layer ``l``, side ``s`` (K and V, or one for MLA), ``i < len(ids)``, token ``t`` of a
block of ``bs`` tokens and ``k = skip_blocks``, where each ``layers[l]`` is a 5-D view
``[sides, num_blocks, block_size, heads, head_dim]`` of an engine's own tensor, with any strides;
and ``gather_pages`` / ``scatter_pages``, their special case for radixkv's own pool
(``layers[l] = pool.kv[l]``).  The first ``k`` blocks of the buffer are left alone, which is how an
unaligned match loads a whole chunk but scatters only the pages past what the tree already holds.

Three implementations give the same bytes:

* ``"cpp"``: a C++ kernel (``cuda_ext/block_copy.cpp``), one parallel loop over all (layer, side,
  block) rows: a ``memcpy`` each for a contiguous block, one per contiguous run of a strided one.
* ``"cuda+cpp"``: the same plus a CUDA kernel (``cuda_ext/block_copy_cuda.cu``), one thread block
  per row.  A buffer in pinned host memory is read or written by the kernel directly, with no
  staging copy on the GPU; the copy is asynchronous on the current stream.
* ``"torch"``: ``index_select`` on integer views for a gather, ``copy_`` / ``index_copy_`` for a
  scatter: the reference, and the fallback where the extension is not built (or for a device it
  does not cover, such as GPU layers when only the C++ part was built).

The extension is built ahead of time, never on a request's path: ``python -m radixkv build-ext``
(or ``build()``) compiles it into a directory keyed by the torch version and a hash of the sources
(``extension_dir()``: under ``$RADIXKV_EXT_DIR``, else ``~/.cache/radixkv/ext``); at run time it is
only loaded.  ``RADIXKV_EXT`` chooses: ``auto`` (default: load the build, and use the torch kernels
with one warning when there is none, it is being built, or it does not load), ``off`` (always
torch), ``require`` (no loadable build is an error).  ``backend()`` says which is active.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from radixkv.core import _ext
from radixkv.core.pool import KVPool, as_page_ids, has_duplicates

__all__ = ["backend", "build", "extension_dir", "gather_blocks", "gather_pages", "native_index",
           "scatter_blocks", "scatter_pages"]

ENV_MODE = _ext.ENV_MODE
_MODES = ("auto", "off", "require")

_lock = threading.Lock()
# Outcome of this process's one attempt to load the extension: a backend name, or why it failed.
_outcome: str | BaseException | None = None


# ---------------------------------------------------------------------------------- the ops


def gather_pages(pool: KVPool | torch.Tensor, page_ids: Any, out: torch.Tensor | None = None, *,
                 skip_pages: int = 0) -> torch.Tensor:
    """Copy pool pages ``page_ids`` of every layer, K and V, into a contiguous buffer; return it.

    ``pool`` is a ``KVPool`` or its ``kv`` tensor ``[num_layers, 2, num_pages, page_size,
    num_kv_heads, head_dim]``.  ``out`` is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``,
    contiguous, of the pool's dtype, with ``num_tokens >= (skip_pages + len(page_ids)) *
    page_size``; page ``i`` lands at token ``(skip_pages + i) * page_size`` of every layer and
    the tokens before and after are left as they were.  ``out=None`` allocates one of exactly that
    many tokens.  On a GPU pool, ``out`` is on the pool's device or in pinned host memory (then
    written directly by the kernel: synchronise the stream before reading it).

    The pool's special case of ``gather_blocks`` (its layers are ``pool.kv[l]``).
    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; ``out`` is then untouched.
    Cost: O(len(page_ids) * page_bytes) bytes moved in one call, plus O(len(page_ids)) to check
    the ids (ids on a GPU are read back once: a sync).

    >>> from radixkv.core.pool import KVLayout
    >>> pool = KVPool(KVLayout(1, 1, 1, torch.float32, page_size=2), num_pages=4)
    >>> pool.kv[0, 0, :, :, 0, 0] = torch.arange(8.0).view(4, 2)
    >>> gather_pages(pool, [3, 1])[0, 0, :, 0, 0].tolist()    # K of pages 3 and 1, in that order
    [6.0, 7.0, 2.0, 3.0]
    """
    return _checked_copy(_pool_geometry(pool), page_ids, out, skip_pages, to_buf=True)


def scatter_pages(src: torch.Tensor, pool: KVPool | torch.Tensor, page_ids: Any, *,
                  skip_pages: int = 0) -> None:
    """Copy a contiguous buffer into pool pages ``page_ids`` of every layer, K and V.

    The inverse of ``gather_pages``: token ``(skip_pages + i) * page_size`` of ``src`` (``[num_layers,
    2, num_tokens, num_kv_heads, head_dim]``, contiguous, the pool's dtype) starts the page
    written to ``page_ids[i]``; the first ``skip_pages`` pages of ``src`` are not read.  Page ids
    must be distinct.  On a GPU pool, ``src`` is on the pool's device or in pinned host memory
    (read directly by the kernel).

    The pool's special case of ``scatter_blocks``.
    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; the pool is then untouched.
    Cost: O(len(page_ids) * page_bytes) bytes moved in one call, plus O(n log n) to check the ids.
    """
    _checked_copy(_pool_geometry(pool), page_ids, src, skip_pages, to_buf=False)


def gather_blocks(layers: Sequence[torch.Tensor], block_ids: Any, out: torch.Tensor, *,
                  skip_blocks: int = 0) -> torch.Tensor:
    """Copy blocks ``block_ids`` of an engine's own per-layer KV tensors into a chunk buffer; return it.

    ``layers[l]`` is a 5-D view ``[sides, num_blocks, block_size, heads, head_dim]`` of layer
    ``l``'s KV, with any strides: vLLM's ``[2, num_blocks, block_size, H, D]`` as it is,
    ``[num_blocks, 2, block_size, H, D]`` or ``[2, num_blocks, H, block_size, D]`` permuted into
    that order, MLA's ``[num_blocks, block_size, D]`` unsqueezed to ``sides=1, heads=1``.  All
    layers have one shape, dtype and device (their strides may differ).  ``out`` is the contiguous
    ``[num_layers, sides, num_tokens, heads, head_dim]`` buffer, of the layers' dtype, with
    ``num_tokens >= (skip_blocks + len(block_ids)) * block_size``:

        out[l, s, (skip_blocks + i) * block_size + t] = layers[l][s, block_ids[i], t]

    and every other token of ``out`` is left as it was.  For GPU layers, ``out`` is on their
    device or in pinned host memory (written by the kernel asynchronously: synchronise the stream
    before reading it).

    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; ``out`` is then untouched.
    Cost: O(len(block_ids) * num_layers * sides * block_bytes) bytes moved in one call (the C++ or
    CUDA kernel where built, else the torch fallback: one ``index_select`` per layer), plus
    O(num_layers + len(block_ids)) checks.

    >>> kv = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 1, 2, 1)   # [2, 3 blocks, H=1, bs=2, D=1]
    >>> out = torch.zeros(1, 2, 4, 1, 1)
    >>> gather_blocks([kv.transpose(2, 3)], [2, 0], out)[0, 0, :, 0, 0].tolist()   # K of blocks 2, 0
    [4.0, 5.0, 0.0, 1.0]
    """
    return _checked_copy(_layers_geometry(layers, writable=False), block_ids, out, skip_blocks, to_buf=True)


def scatter_blocks(src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Any, *,
                   skip_blocks: int = 0) -> None:
    """Copy a chunk buffer into blocks ``block_ids`` of an engine's own per-layer KV tensors.

    The inverse of ``gather_blocks`` (same ``layers`` and ``src`` shapes):

        layers[l][s, block_ids[i], t] = src[l, s, (skip_blocks + i) * block_size + t]

    Block ids must be distinct, and the layers must not share elements with each other or
    overlap themselves (an expanded view would be written twice).  For GPU layers, ``src`` is on
    their device or in pinned host memory (read by the kernel asynchronously).

    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; the layers are then
    untouched.  Cost: O(len(block_ids) * num_layers * sides * block_bytes) bytes moved in one call,
    plus O(num_layers + n log n) checks for ``n = len(block_ids)``.
    """
    _checked_copy(_layers_geometry(layers, writable=True), block_ids, src, skip_blocks, to_buf=False)


def _checked_copy(geo: _Geometry, ids_arg: Any, buf: Any, skip_arg: Any, to_buf: bool) -> torch.Tensor:
    """Check the ids, the skip and the buffer against ``geo`` (naming them as the caller does), then
    copy; ``buf=None`` for a gather allocates a buffer of exactly the tokens copied.  Return ``buf``."""
    unit = geo.unit
    skip = _check_skip(skip_arg, f"skip_{unit}s")
    ids = as_page_ids(ids_arg, geo.num_blocks, f"{unit}_ids")
    if not to_buf:
        _check_distinct(ids, f"{unit}_ids", unit)
    if buf is None and to_buf:
        buf = torch.empty(geo.buffer_shape((skip + ids.size) * geo.block_size), dtype=geo.dtype, device=geo.device)
    _check_buffer("out" if to_buf else "src", buf, geo, skip, ids.size)
    if ids.size:
        _copy(geo, torch.from_numpy(np.ascontiguousarray(ids)), buf, skip, to_buf)
    return buf


def _copy(geo: _Geometry, ids: torch.Tensor, buf: torch.Tensor, skip: int, to_buf: bool) -> None:
    """Run a validated copy on the extension where it covers the device, else on torch."""
    if _use_extension(geo.device):
        lib = torch.ops.radixkv
        if geo.pool is not None and to_buf:
            lib.gather_pages(geo.pool, ids, buf, skip)
        elif geo.pool is not None:
            lib.scatter_pages(buf, geo.pool, ids, skip)
        elif to_buf:
            lib.gather_blocks(list(geo.layers), ids, buf, skip)
        else:
            lib.scatter_blocks(buf, list(geo.layers), ids, skip)
    elif to_buf:
        _gather_geo(geo, ids, buf, skip)
    else:
        _scatter_geo(geo, ids, buf, skip)


# ------------------------------------------------------------------------ backend selection


def backend() -> str:
    """The active implementation: ``"cuda+cpp"``, ``"cpp"`` or ``"torch"``.

    The first call under ``RADIXKV_EXT=auto`` or ``require`` loads the built extension (a
    ``dlopen``; it never builds nor waits on a build); later calls are O(1).  With no loadable
    build, ``require`` raises ``RuntimeError`` saying why and how to build, and ``auto`` warns once
    and gives ``"torch"``.
    """
    mode = _mode()
    if mode == "off":
        return "torch"
    outcome = _load_once()
    if isinstance(outcome, str):
        return outcome
    if mode == "require":
        raise RuntimeError(f"radixkv.core.ops: {ENV_MODE}=require, but {outcome}") from outcome
    return "torch"


def build(verbose: bool = False, lock_timeout: float = 600.0) -> str:
    """Build the extension into ``extension_dir()`` (unless built already), load it, return ``backend()``.

    For install steps and tools, not a request's path.  A failed compile raises ``RuntimeError``
    (with the compiler's output when ``verbose``); a build held by another live process longer than
    ``lock_timeout`` seconds raises ``TimeoutError``.  Under ``RADIXKV_EXT=off`` it still builds, but
    ``backend()`` stays ``"torch"``; under ``require`` a failed CUDA part is an error too.
    Cost: a compile (~10-20 s for the C++ part, more with CUDA) once per torch version and source,
    a load after that.
    """
    global _outcome
    outcome = _ext.build(verbose=verbose, lock_timeout=lock_timeout, require_cuda=_mode() == "require")
    with _lock:
        _outcome = outcome
    return backend()


def native_index() -> Any:
    """The extension's fleet-index functions as a module (``index_find``, ``index_put``,
    ``index_walk``: see ``cuda_ext/index_walk.cpp``), or ``None`` where ``backend()`` is
    ``"torch"`` (not built, ``RADIXKV_EXT=off``) or the build lacks them: ``radixkv.fleet.index``
    then takes its numpy path.  The first call loads (see ``backend``); later ones are O(1)."""
    if backend() == "torch":
        return None
    module = _ext.native_module()
    return module if hasattr(module, "index_walk") else None


def extension_dir() -> Path:
    """The directory the extension is built into and loaded from, for this torch and these sources.
    O(size of the sources): they are hashed."""
    return _ext.ext_dir()


def _mode() -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_MODE} must be one of {', '.join(_MODES)}; got {mode!r}")
    return mode


def _load_once() -> str | BaseException:
    global _outcome
    with _lock:
        if _outcome is None:
            try:
                _outcome = _ext.load()
            except _ext.BuildMissing as exc:
                _outcome = exc
                if _mode() == "auto":
                    warnings.warn(f"radixkv.core.ops: {exc} Using the slower torch kernels meanwhile; set "
                                  f"{ENV_MODE}=off to silence this.", RuntimeWarning, stacklevel=5)
        return _outcome


def _use_extension(device: torch.device) -> bool:
    if device.type == "cpu":
        return backend() != "torch"
    return device.type == "cuda" and backend() == "cuda+cpp"


# ------------------------------------------------------------------------- argument checks

# Integer dtypes of each element size: the copies move bytes, and a view of the same element size
# keeps any strides (fp8, bool and every float dtype are then indexed as integers).
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PER_BLOCK_SCATTER_BYTES = 4096  # the torch scatter copies block by block from this row size on


class _Geometry(NamedTuple):
    """A validated source or destination of block copies: the pool tensor or an engine's layers."""

    pool: torch.Tensor | None               # [num_layers, 2, num_pages, page_size, heads, dim], contiguous
    layers: tuple[torch.Tensor, ...]        # () for a pool; else [sides, num_blocks, block_size, heads, dim] each
    shape: tuple[int, int, int, int, int, int]  # num_layers, sides, num_blocks, block_size, heads, head_dim
    dtype: torch.dtype
    device: torch.device
    unit: str                               # "page" or "block", for messages
    owner: str                              # what the buffer must not overlap: "the pool" or "layers"

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def block_size(self) -> int:
        return self.shape[3]

    def buffer_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        num_layers, sides, _, _, heads, dim = self.shape
        return (num_layers, sides, num_tokens, heads, dim)

    def stacks(self) -> list[torch.Tensor]:
        """6-D views ``[k, sides, num_blocks, block_size, heads, dim]`` covering the layers in order."""
        return [self.pool] if self.pool is not None else [t.unsqueeze(0) for t in self.layers]


def _pool_geometry(pool: Any) -> _Geometry:
    kv = pool.kv if isinstance(pool, KVPool) else pool
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"pool must be a KVPool or its kv tensor, got {type(pool).__name__}")
    if kv.dim() != 6 or kv.shape[1] not in (1, 2) or kv.shape[3] < 1:
        raise ValueError("pool must be [num_layers, sides (1 or 2), num_pages, page_size >= 1, num_kv_heads, "
                         "head_dim], "
                         f"got shape {tuple(kv.shape)}")
    if kv.layout != torch.strided or not kv.is_contiguous():
        raise ValueError("pool must be a contiguous dense tensor")
    _check_element_size(kv.dtype, "pool")
    shape = tuple(kv.shape)
    return _Geometry(kv, (), shape, kv.dtype, kv.device, "page", "the pool")  # type: ignore[arg-type]


def _layers_geometry(layers: Any, writable: bool) -> _Geometry:
    """Check ``layers`` (a sequence of 5-D views of one shape, dtype and device)."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError("layers must be a sequence (list or tuple) of per-layer tensors, got "
                        f"{type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers is empty: pass one tensor per layer")
    first = layers[0]
    for l, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"layers[{l}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"layers[{l}] must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != 5:
            raise ValueError(f"layers[{l}] must be 5-D [sides, num_blocks, block_size, heads, head_dim], "
                             f"got shape {tuple(t.shape)}")
        if t.shape != first.shape:
            raise ValueError(f"layers[{l}] has shape {tuple(t.shape)} but layers[0] has {tuple(first.shape)}")
        if t.dtype != first.dtype:
            raise TypeError(f"layers[{l}] has dtype {t.dtype} but layers[0] has {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"layers[{l}] is on {t.device} but layers[0] is on {first.device}")
        if writable and _overlaps_itself(t):
            raise ValueError(f"layers[{l}] has elements that overlap (strides {t.stride()}); a scatter "
                             "would write them twice")
    if first.shape[0] < 1 or first.shape[2] < 1:
        raise ValueError(f"layers must have sides >= 1 and block_size >= 1, got shape {tuple(first.shape)}")
    _check_element_size(first.dtype, "layers")
    shape = (len(layers), *first.shape)
    return _Geometry(None, tuple(layers), shape, first.dtype, first.device, "block", "layers")  # type: ignore[arg-type]


def _check_element_size(dtype: torch.dtype, name: str) -> None:
    if torch.empty((), dtype=dtype).element_size() not in _INT_VIEW:
        raise TypeError(f"{name} has dtype {dtype}: only dtypes of 1, 2, 4 or 8 bytes are copied")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` may share an element.  O(dim log dim), sufficient, not exact:
    every view made by slicing, permuting, (un)squeezing or unbinding a dense tensor passes."""
    reach = 0  # elements spanned by the dimensions of smaller stride, minus one
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _check_skip(skip: Any, name: str) -> int:
    if isinstance(skip, bool) or not isinstance(skip, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(skip).__name__}")
    if skip < 0:
        raise ValueError(f"{name} must be >= 0, got {skip}")
    return int(skip)


def _check_distinct(ids: np.ndarray, name: str, unit: str) -> None:
    if has_duplicates(ids):
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"{name} holds {unit} {int(values[counts > 1][0])} more than once; "
                         "a scatter would write it twice")


def _check_buffer(name: str, buf: Any, geo: _Geometry, skip: int, n: int) -> None:
    """The chunk buffer ``name`` ("out" or "src") must fit ``n`` blocks after ``skip`` blocks."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    num_layers, sides, _, block_size, heads, dim = geo.shape
    if buf.dim() != 5 or buf.shape[:2] != (num_layers, sides) or buf.shape[3:] != (heads, dim):
        raise ValueError(f"{name} must be [{num_layers}, {sides}, num_tokens, {heads}, {dim}] for these "
                         f"{geo.unit}s, got shape {tuple(buf.shape)}")
    if buf.dtype != geo.dtype:
        raise TypeError(f"{name} has dtype {buf.dtype} but {geo.owner} hold{'s' if geo.pool is not None else ''} "
                        f"{geo.dtype}")
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    need = (skip + n) * block_size
    if buf.shape[2] < need:
        raise ValueError(f"{name} holds {buf.shape[2]} tokens, but skip_{geo.unit}s={skip} plus {n} "
                         f"{geo.unit}s of {block_size} tokens need {need}")
    if buf.device != geo.device:
        pinned_ok = geo.device.type == "cuda" and buf.device.type == "cpu" and buf.is_pinned()
        if not pinned_ok:
            where = " or in pinned CPU memory (pin_memory=True)" if geo.device.type == "cuda" else ""
            raise ValueError(f"{name} is on {buf.device} but must be on the device of {geo.owner}, "
                             f"{geo.device}{where}")
    elif buf.numel():
        for l, t in enumerate(geo.layers or (geo.pool,)):
            if _share_memory(buf, t):  # type: ignore[arg-type]
                where = f"layers[{l}]" if geo.pool is None else "the pool"
                raise ValueError(f"{name} shares memory with {where}")


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` in one storage intersect.  O(dim)."""
    if not b.numel() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


# --------------------------------------------------------------- torch reference / fallback


def _buffer_blocks(buf: torch.Tensor, geo: _Geometry, skip: int, n: int) -> torch.Tensor:
    """Blocks ``skip .. skip+n`` of ``buf`` as an integer view ``[num_layers, sides, n, block_size, heads, dim]``."""
    num_layers, sides, _, block_size, heads, dim = geo.shape
    view = buf.view(_INT_VIEW[buf.element_size()]).narrow(2, skip * block_size, n * block_size)
    return view.view(num_layers, sides, n, block_size, heads, dim)


def _gather_torch(source: Any, ids: torch.Tensor, out: torch.Tensor, skip: int) -> None:
    """The torch reference of a gather from a pool (tensor or ``KVPool``) or a sequence of layers,
    unchecked beyond their geometry: ``ids`` is an int64 tensor of valid ids."""
    _gather_geo(_geometry(source, writable=False), ids, out, skip)


def _scatter_torch(src: torch.Tensor, target: Any, ids: torch.Tensor, skip: int) -> None:
    """The torch reference of a scatter into a pool or a sequence of layers (see ``_gather_torch``)."""
    _scatter_geo(_geometry(target, writable=True), ids, src, skip)


def _geometry(x: Any, writable: bool) -> _Geometry:
    is_pool = isinstance(x, KVPool) or (isinstance(x, torch.Tensor) and x.dim() == 6)
    return _pool_geometry(x) if is_pool else _layers_geometry(x, writable)


def _gather_geo(geo: _Geometry, ids: torch.Tensor, out: torch.Tensor, skip: int) -> None:
    dst = _buffer_blocks(out, geo, skip, ids.numel())
    first = 0
    for stack in geo.stacks():
        rows, part = stack.view(_INT_VIEW[stack.element_size()]), dst.narrow(0, first, stack.shape[0])
        if stack.device.type == "cpu":
            torch.index_select(rows, 2, ids, out=part)
        else:  # through a temporary on the device: also covers a pinned host `out`
            part.copy_(rows.index_select(2, ids.to(stack.device)))
        first += stack.shape[0]


def _scatter_geo(geo: _Geometry, ids: torch.Tensor, src: torch.Tensor, skip: int) -> None:
    rows = _buffer_blocks(src, geo, skip, ids.numel())
    if geo.pool is not None:
        # One copy per page, all layers at once: index_copy_ along the page axis is several times
        # slower on a contiguous pool.
        pool = geo.pool.view(_INT_VIEW[geo.pool.element_size()])
        for i, page in enumerate(ids.tolist()):
            pool[:, :, page].copy_(rows[:, :, i])
        return
    # A copy_ per block is faster than index_copy_ for rows of a few KiB and more (here 1.7-2.3x on
    # 32 KiB rows); index_copy_ saves the Python loop when the rows are small.
    per_block = geo.block_size * geo.shape[4] * geo.shape[5] * rows.element_size() >= _PER_BLOCK_SCATTER_BYTES
    ids_dev, blocks = ids.to(geo.device), ids.tolist()
    for l, layer in enumerate(geo.layers):
        target = layer.view(_INT_VIEW[layer.element_size()])
        if per_block:
            for i, block in enumerate(blocks):
                target[:, block].copy_(rows[l, :, i])
        else:
            target.index_copy_(1, ids_dev, rows[l].to(geo.device))
