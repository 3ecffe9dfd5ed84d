"""Block copies between the paged KV pool and contiguous chunk buffers.

Every tier hit and every store moves a chunk of KV between the pool, where its pages are scattered,
and a contiguous chunk buffer (the tiers' layout).  Two ops do it in one call for all layers:

    gather_pages(pool, page_ids, out)   out[l, s, (k+i)*ps:(k+i+1)*ps] = pool.kv[l, s, page_ids[i]]
    scatter_pages(src, pool, page_ids)  pool.kv[l, s, page_ids[i]] = src[l, s, (k+i)*ps:(k+i+1)*ps]

for every layer ``l``, K/V side ``s``, ``i < len(page_ids)``, page size ``ps`` and ``k =
skip_pages``: the first ``skip_pages`` pages of the buffer are left alone, which is how an
unaligned match loads a whole chunk but scatters only the pages past what the tree already holds.

Three implementations give the same bytes:

* ``"cpp"``: a C++ kernel (``cuda_ext/block_copy.cpp``), one parallel loop over all (layer, K/V,
  page) rows, a ``memcpy`` each.  Built on first use with ``torch.utils.cpp_extension.load`` and
  cached by torch (in ``$RADIXKV_BUILD_DIR`` when set, else torch's extension directory).
* ``"cuda+cpp"``: the same plus a CUDA kernel (``cuda_ext/block_copy_cuda.cu``), built where torch
  has CUDA and ``nvcc`` is found.  A buffer in pinned host memory is read or written by the kernel
  directly, with no staging copy on the GPU; the copy is asynchronous on the current stream.
* ``"torch"``: ``index_select`` on byte views for a gather, one ``copy_`` per page for a scatter:
  the reference, and the fallback where there is no compiler (or for a device the extension does
  not cover, such as a GPU pool when only the C++ part could be built).

``RADIXKV_EXT`` chooses: ``auto`` (default: build, and fall back to torch with one warning if the
build fails), ``off`` (always torch), ``require`` (a failed build raises).  ``backend()`` says which
implementation is active; ``build()`` (``python -m radixkv build-ext``) builds ahead of time.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.pool import KVPool, as_page_ids, has_duplicates

__all__ = ["backend", "build", "gather_pages", "scatter_pages"]

ENV_MODE = "RADIXKV_EXT"
ENV_BUILD_DIR = "RADIXKV_BUILD_DIR"
_MODES = ("auto", "off", "require")

_lock = threading.Lock()
# Outcome of the one build attempt of this process: a backend name, or the exception it raised.
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

    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; ``out`` is then untouched.
    Cost: O(len(page_ids) * page_bytes) bytes moved in one call, plus O(len(page_ids)) to check
    the ids (ids on a GPU are read back once: a sync).

    >>> from radixkv.pool import KVLayout
    >>> pool = KVPool(KVLayout(1, 1, 1, torch.float32, page_size=2), num_pages=4)
    >>> pool.kv[0, 0, :, :, 0, 0] = torch.arange(8.0).view(4, 2)
    >>> gather_pages(pool, [3, 1])[0, 0, :, 0, 0].tolist()    # K of pages 3 and 1, in that order
    [6.0, 7.0, 2.0, 3.0]
    """
    kv = _pool_tensor(pool)
    skip = _check_skip(skip_pages)
    ids = as_page_ids(page_ids, kv.shape[2], "page_ids")
    if out is None:
        num_layers, _, _, page_size, heads, dim = kv.shape
        out = torch.empty((num_layers, 2, (skip + ids.size) * page_size, heads, dim), dtype=kv.dtype,
                          device=kv.device)
    _check_buffer("out", out, kv, skip, ids.size)
    if ids.size:
        ids_t = torch.from_numpy(np.ascontiguousarray(ids))
        if _use_extension(kv):
            torch.ops.radixkv.gather_pages(kv, ids_t, out, skip)
        else:
            _gather_torch(kv, ids_t, out, skip)
    return out


def scatter_pages(src: torch.Tensor, pool: KVPool | torch.Tensor, page_ids: Any, *,
                  skip_pages: int = 0) -> None:
    """Copy a contiguous buffer into pool pages ``page_ids`` of every layer, K and V.

    The inverse of ``gather_pages``: token ``(skip_pages + i) * page_size`` of ``src`` (``[num_layers,
    2, num_tokens, num_kv_heads, head_dim]``, contiguous, the pool's dtype) starts the page
    written to ``page_ids[i]``; the first ``skip_pages`` pages of ``src`` are not read.  Page ids
    must be distinct.  On a GPU pool, ``src`` is on the pool's device or in pinned host memory
    (read directly by the kernel).

    Raises ``TypeError``/``ValueError`` naming the argument for a bad one; the pool is then untouched.
    Cost: O(len(page_ids) * page_bytes) bytes moved in one call, plus O(n log n) to check the ids.
    """
    kv = _pool_tensor(pool)
    skip = _check_skip(skip_pages)
    ids = as_page_ids(page_ids, kv.shape[2], "page_ids")
    if has_duplicates(ids):
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"page_ids holds page {int(values[counts > 1][0])} more than once; "
                         "a scatter would write it twice")
    _check_buffer("src", src, kv, skip, ids.size)
    if ids.size:
        ids_t = torch.from_numpy(np.ascontiguousarray(ids))
        if _use_extension(kv):
            torch.ops.radixkv.scatter_pages(src, kv, ids_t, skip)
        else:
            _scatter_torch(src, kv, ids_t, skip)


# ------------------------------------------------------------------------ backend selection


def backend() -> str:
    """The active implementation: ``"cuda+cpp"``, ``"cpp"`` or ``"torch"``.

    The first call under ``RADIXKV_EXT=auto`` or ``require`` builds the extension (seconds; cached
    on disk by torch, so later processes only load it); later calls are O(1).  Under ``require``
    a failed build raises ``RuntimeError``; under ``auto`` it warns once and gives ``"torch"``.
    """
    mode = _mode()
    if mode == "off":
        return "torch"
    outcome = _build_once(verbose=False, retry=False)
    if isinstance(outcome, str):
        return outcome
    if mode == "require":
        raise RuntimeError(f"radixkv.ops: building the C++ extension failed and {ENV_MODE}=require: "
                           f"{_first_line(outcome)}") from outcome
    return "torch"


def build(verbose: bool = False) -> str:
    """Build (or load the cached build of) the extension now, and return ``backend()``.

    Unlike first use under ``auto``, a failure raises ``RuntimeError`` (with the compiler's output
    when ``verbose``), and an earlier failure is retried.  Under ``RADIXKV_EXT=off`` it still builds,
    so that the cache is warm, but ``backend()`` stays ``"torch"``.  Cost: a compile (~5 s for the
    C++ part, more with CUDA) the first time for a given torch and source, a load after that.
    """
    outcome = _build_once(verbose=verbose, retry=True)
    if not isinstance(outcome, str):
        raise RuntimeError(f"radixkv.ops: building the C++ extension failed: {_first_line(outcome)}") \
            from outcome
    return backend()


def _mode() -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_MODE} must be one of {', '.join(_MODES)}; got {mode!r}")
    return mode


def _build_once(verbose: bool, retry: bool) -> str | BaseException:
    global _outcome
    with _lock:
        if _outcome is None or (retry and not isinstance(_outcome, str)):
            try:
                _outcome = _load_extension(verbose)
            except Exception as exc:  # a missing compiler, nvcc or ninja: all mean "no extension"
                _outcome = exc
                if _mode() == "auto" and not retry:
                    warnings.warn(f"radixkv.ops: could not build the C++ extension "
                                  f"({_first_line(exc)}); using the slower torch fallback. "
                                  f"Set {ENV_MODE}=off to silence this, or run "
                                  f"`python -m radixkv build-ext` to see the compiler's output.",
                                  RuntimeWarning, stacklevel=4)
        return _outcome


def _load_extension(verbose: bool) -> str:
    """Compile (or load from torch's cache) the extension; return the backend it provides."""
    from torch.utils import cpp_extension

    src = _sources_dir()
    cpp = [str(src / "block_copy.cpp")]
    cu = sorted(str(p) for p in src.glob("*.cu"))
    build_dir = os.environ.get(ENV_BUILD_DIR) or None
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
    # ATen's parallel_for is an OpenMP pragma in a header: without -fopenmp it runs on one thread.
    cflags = ["-O3"] + (["-fopenmp"] if sys.platform.startswith("linux") else [])

    def load(name: str, sources: list[str]) -> None:
        cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_cuda_cflags=["-O3"],
                           extra_include_paths=[str(src)], build_directory=build_dir, verbose=verbose,
                           is_python_module=False)

    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and cu:
        try:
            load("radixkv_block_copy_cuda", cpp + cu)
            return "cuda+cpp"
        except Exception as exc:
            if _mode() == "require":
                raise
            warnings.warn(f"radixkv.ops: could not build the CUDA kernel ({_first_line(exc)}); GPU pools "
                          "use the torch fallback, CPU pools the C++ kernel", RuntimeWarning, stacklevel=2)
    load("radixkv_block_copy", cpp)
    return "cpp"


def _sources_dir() -> Path:
    """``cuda_ext/``: the installed package ``radixkv.cuda_ext``, or the source tree's folder."""
    spec = importlib.util.find_spec("radixkv.cuda_ext")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations)))
    else:
        path = Path(__file__).resolve().parent.parent / "cuda_ext"
    if not (path / "block_copy.cpp").is_file():
        raise FileNotFoundError(f"the extension's sources are not in {path}")
    return path


def _use_extension(kv: torch.Tensor) -> bool:
    if kv.device.type == "cpu":
        return backend() != "torch"
    return kv.device.type == "cuda" and backend() == "cuda+cpp"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ------------------------------------------------------------------------- argument checks


def _pool_tensor(pool: Any) -> torch.Tensor:
    kv = pool.kv if isinstance(pool, KVPool) else pool
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"pool must be a KVPool or its kv tensor, got {type(pool).__name__}")
    if kv.dim() != 6 or kv.shape[1] != 2 or kv.shape[3] < 1:
        raise ValueError("pool must be [num_layers, 2, num_pages, page_size >= 1, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv.shape)}")
    if kv.layout != torch.strided or not kv.is_contiguous():
        raise ValueError("pool must be a contiguous dense tensor")
    return kv


def _check_skip(skip_pages: Any) -> int:
    if isinstance(skip_pages, bool) or not isinstance(skip_pages, (int, np.integer)):
        raise TypeError(f"skip_pages must be an int, got {type(skip_pages).__name__}")
    if skip_pages < 0:
        raise ValueError(f"skip_pages must be >= 0, got {skip_pages}")
    return int(skip_pages)


def _check_buffer(name: str, buf: Any, kv: torch.Tensor, skip: int, n: int) -> None:
    """The chunk buffer ``name`` ("out" or "src") must fit ``n`` pages after ``skip`` pages."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    num_layers, _, _, page_size, heads, dim = kv.shape
    if buf.dim() != 5 or buf.shape[:2] != (num_layers, 2) or buf.shape[3:] != (heads, dim):
        raise ValueError(f"{name} must be [{num_layers}, 2, num_tokens, {heads}, {dim}] for this pool, "
                         f"got shape {tuple(buf.shape)}")
    if buf.dtype != kv.dtype:
        raise TypeError(f"{name} has dtype {buf.dtype} but the pool holds {kv.dtype}")
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    need = (skip + n) * page_size
    if buf.shape[2] < need:
        raise ValueError(f"{name} holds {buf.shape[2]} tokens, but skip_pages={skip} plus {n} pages of "
                         f"{page_size} tokens need {need}")
    if buf.device != kv.device:
        pinned_ok = kv.device.type == "cuda" and buf.device.type == "cpu" and buf.is_pinned()
        if not pinned_ok:
            where = " or in pinned CPU memory (pin_memory=True)" if kv.device.type == "cuda" else ""
            raise ValueError(f"{name} is on {buf.device} but must be on the pool's device {kv.device}{where}")
    elif buf.numel() and buf.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr():
        raise ValueError(f"{name} shares memory with the pool")


# --------------------------------------------------------------- torch reference / fallback


def _pool_rows(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` as bytes ``[2 * num_layers, num_pages, row_bytes]``: one row per page per (layer, K/V)."""
    num_layers, _, num_pages, page_size, heads, dim = kv.shape
    return kv.view(torch.uint8).view(2 * num_layers, num_pages, page_size * heads * dim * kv.element_size())


def _buffer_rows(buf: torch.Tensor, page_size: int, skip: int, n: int) -> torch.Tensor:
    """Pages ``skip .. skip+n`` of ``buf`` as a bytes view ``[2 * num_layers, n, row_bytes]``."""
    num_layers, _, num_tokens, heads, dim = buf.shape
    token_bytes = heads * dim * buf.element_size()
    row = page_size * token_bytes
    flat = buf.view(torch.uint8).view(2 * num_layers, num_tokens * token_bytes)
    return flat.narrow(1, skip * row, n * row).view(2 * num_layers, n, row)


def _gather_torch(kv: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, skip: int) -> None:
    rows = _pool_rows(kv)
    dst = _buffer_rows(out, kv.shape[3], skip, ids.numel())
    if kv.device.type == "cpu":
        torch.index_select(rows, 1, ids, out=dst)
    else:  # through a temporary on the device: also covers a pinned host `out`
        dst.copy_(rows.index_select(1, ids.to(kv.device)))


def _scatter_torch(src: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, skip: int) -> None:
    rows = _buffer_rows(src, kv.shape[3], skip, ids.numel())
    pool = _pool_rows(kv)
    # One copy per page, all layers at once: index_copy_ along dim 1 is several times slower here.
    for i, page in enumerate(ids.tolist()):
        pool[:, page].copy_(rows[:, i])
