"""Building and loading the block-copy extension: built ahead of time, only loaded at run time.

Contract:

* ``build()`` (``python -m radixkv build-ext``, an install step) compiles ``cuda_ext/`` into a
  directory of its own, ``ext_dir()``: ``$RADIXKV_EXT_DIR/<key>`` when that is set, else
  ``$XDG_CACHE_HOME/radixkv/ext/<key>`` (``~/.cache/radixkv/ext/<key>``), never torch's shared
  extension directory.  ``<key>`` is the torch version, its CUDA version (or ``cpu``), the Python
  version, and a hash of the sources and compiler flags: two environments never share or rebuild
  each other's build, and a changed source gets a new directory.  The directory holds the library
  and ``manifest.json``, written last (by an atomic rename): a directory without the manifest
  holds no usable build.
* ``load()`` only loads: it reads the manifest and ``torch.ops.load_library``-s the library, in
  milliseconds.  It never compiles and never waits on a lock: a missing build, a build in progress
  (its lock held, however long) or a library that does not load is a ``BuildMissing`` error that
  says why, and the caller (``radixkv.core.ops``) decides between the torch kernels and an error.
* Builders take ``<key>.lock`` beside the directory, created exclusively, holding the builder's
  pid and host.  A lock whose process is gone (same host) is stale and taken over at once; a live
  one is waited for at most ``lock_timeout`` seconds, then ``BuildLocked``.  Each attempt compiles
  in a fresh ``build-*`` folder of its own, so torch's own lock (its ``FileBaton``, which waits
  forever on a stale file) is never shared with another process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["BuildLocked", "BuildMissing", "build", "ext_dir", "load", "native_module", "native_tokens", "sources_dir"]

ENV_DIR = "RADIXKV_EXT_DIR"
ENV_MODE = "RADIXKV_EXT"  # auto / off / require: radixkv.core.ops reads it; off also turns native_module off
LIBRARIES = {"cpp": "radixkv_block_copy", "cuda+cpp": "radixkv_block_copy_cuda"}
# ATen's parallel_for is an OpenMP pragma in a header: without -fopenmp it runs on one thread.
CFLAGS = ("-O3", "-fopenmp") if sys.platform.startswith("linux") else ("-O3",)
CUDA_CFLAGS = ("-O3",)
MANIFEST = "manifest.json"
UNREADABLE_LOCK_S = 10.0  # a lock file still unreadable this long after it was written is stale

_loaded: str | None = None  # the backend whose library this process has loaded, if any
_library: Path | None = None  # and its file
_module: Any = False  # native_module(): False before the first call, then the module or None
_load_lock = threading.Lock()


class BuildMissing(RuntimeError):
    """No loadable build of the extension for this torch and these sources (the message says why)."""


class BuildLocked(TimeoutError):
    """Another live process held the build lock longer than the caller would wait."""


def sources_dir() -> Path:
    """``cuda_ext/``: the installed package ``radixkv.cuda_ext``, or the source tree's folder.  O(1)."""
    spec = importlib.util.find_spec("radixkv.cuda_ext")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations)))
    else:
        path = Path(__file__).resolve().parents[2] / "cuda_ext"
    if not (path / "block_copy.cpp").is_file():
        raise FileNotFoundError(f"the extension's sources are not in {path}")
    return path


def _sources(src: Path) -> list[Path]:
    return sorted(p for p in src.iterdir() if p.suffix in (".cpp", ".cu", ".h", ".cuh"))


def build_key(src: Path | None = None) -> str:
    """``<torch>-<cuda or cpu>-py<X.Y>-<hash>``: what a build depends on.  O(size of the sources)."""
    src = src or sources_dir()
    digest = hashlib.sha256()
    for path in _sources(src):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((CFLAGS, CUDA_CFLAGS, sys.platform)).encode())
    variant = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    version = torch.__version__.replace("+", "_")
    return f"{version}-{variant}-py{sys.version_info[0]}.{sys.version_info[1]}-{digest.hexdigest()[:16]}"


def ext_root() -> Path:
    """Where builds live: ``$RADIXKV_EXT_DIR``, else ``$XDG_CACHE_HOME/radixkv/ext`` (``~/.cache/...``)."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "radixkv" / "ext"


def ext_dir(src: Path | None = None) -> Path:
    """The build directory for this torch and these sources (it may not exist yet).  O(size of the sources)."""
    return ext_root() / build_key(src)


# ------------------------------------------------------------------------------------ load


def load() -> str:
    """Load the built extension; return its backend, ``"cpp"`` or ``"cuda+cpp"``.

    Only loads, never builds or waits: raises ``BuildMissing`` (saying why, and how to build) when
    there is no complete build for this torch and these sources, or it does not load.  A second
    call returns what the first loaded.  Cost: hashing the sources (~1 ms) and a ``dlopen``.
    """
    global _loaded, _library
    with _load_lock:
        if _loaded is not None:
            return _loaded
        try:
            where = ext_dir()
        except OSError as exc:  # an installed copy without its sources
            raise BuildMissing(f"the block-copy extension cannot be found ({_first_line(exc)})") from exc
        manifest = _read_manifest(where)
        if manifest is None:
            raise BuildMissing(_why_missing(where))
        library = where / manifest["library"]
        try:
            torch.ops.load_library(str(library))
        except Exception as exc:  # a library of another ABI, a truncated file
            raise BuildMissing(f"the built extension in {where} does not load ({_first_line(exc)}); "
                               "rebuild it with `python -m radixkv build-ext`") from exc
        _loaded, _library = str(manifest["backend"]), library
        return _loaded


def native_module() -> Any:
    """The built library as a Python module (``cuda_ext/tokens.cpp``'s ``token_bytes``, and the
    fleet index's ``index_find``, ``index_put`` and ``index_walk`` of ``cuda_ext/index_walk.cpp``),
    or ``None`` when the extension is off (``RADIXKV_EXT=off``) or not built: callers then take
    their Python path.  Never builds and never warns (``radixkv.core.ops`` warns for the copies).
    The first call loads (see ``load``); later ones are O(1)."""
    global _module
    if _module is False:
        found = None
        if os.environ.get(ENV_MODE, "auto").strip().lower() != "off":
            try:
                load()
                assert _library is not None
                name = _library.name.split(".")[0]
                spec = importlib.util.spec_from_file_location(name, _library)
                assert spec is not None and spec.loader is not None
                found = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(found)
            except (BuildMissing, ImportError, AssertionError):
                found = None
        _module = found
    return _module


def native_tokens() -> Callable[[Any], bytes | None] | None:
    """The extension's ``token_bytes(seq)`` (``cuda_ext/tokens.cpp``: an exact-int list or tuple of
    ids in ``[0, 2**31)`` as int32 LE bytes, ``None`` for anything else), or ``None`` when the
    extension is off (``RADIXKV_EXT=off``) or not built (see ``native_module``).  O(1) after the
    first call."""
    return getattr(native_module(), "token_bytes", None)


def _read_manifest(where: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(manifest, dict) and manifest.get("backend") in LIBRARIES
          and isinstance(manifest.get("library"), str) and (where / manifest["library"]).is_file())
    return manifest if ok else None


def _why_missing(where: Path) -> str:
    why = f"the block-copy extension is not built for torch {torch.__version__} and these sources (no build in {where})"
    lock = _lock_path(where)
    if lock.exists():
        why += f"; a build holds {lock} ({_describe_lock(lock)})"
    failed = where / "failed.txt"
    if failed.is_file():
        reason = failed.read_text().strip().splitlines()
        why += f"; the last build failed: {reason[0] if reason else '?'}"
    return why + ". Build it with `python -m radixkv build-ext`."


# ----------------------------------------------------------------------------------- build


def build(verbose: bool = False, lock_timeout: float = 600.0, require_cuda: bool = False) -> str:
    """Build the extension into ``ext_dir()`` unless it is built already, load it, return its backend.

    The CUDA kernel is built with the C++ one where torch has CUDA and ``nvcc`` is found; if only
    its build fails, the C++ part is built alone (with a warning), unless ``require_cuda``.  Raises
    ``BuildLocked`` when another live build holds the lock past ``lock_timeout`` seconds, and
    ``RuntimeError`` when the compile fails (its first line; the compiler's whole output when
    ``verbose``).  Cost: a compile
    (~10-20 s for the C++ part, more with CUDA) once per torch and source; a load after that.
    """
    global _loaded, _library, _module
    src = sources_dir()
    where = ext_dir(src)
    if _read_manifest(where) is None:
        where.mkdir(parents=True, exist_ok=True)
        with _BuildLock(_lock_path(where), lock_timeout):
            if _read_manifest(where) is None:  # another process may have built it while we waited
                with _load_lock:
                    if _loaded is not None:
                        raise RuntimeError("radixkv.core.ops: an older build of the extension is loaded in this "
                                           "process; build in a fresh process")
                    _loaded = _compile(src, where, verbose, require_cuda)
                    _library = where / f"{LIBRARIES[_loaded]}.so"
                    _module = False                       # native_module() looks again
                    return _loaded
    return load()


def _compile(src: Path, where: Path, verbose: bool, require_cuda: bool) -> str:
    """Compile in a fresh folder, move the library into ``where``, write the manifest last."""
    from torch.utils import cpp_extension

    cpp = sorted(str(p) for p in src.glob("*.cpp"))
    cu = sorted(str(p) for p in src.glob("*.cu"))
    attempts = []
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and cu:
        attempts.append(("cuda+cpp", cpp + cu))
    attempts.append(("cpp", cpp))
    for backend, sources in attempts:
        name = LIBRARIES[backend]
        scratch = Path(tempfile.mkdtemp(prefix="build-", dir=where))
        try:
            cpp_extension.load(name=name, sources=sources, extra_cflags=list(CFLAGS),
                               extra_cuda_cflags=list(CUDA_CFLAGS), extra_include_paths=[str(src)],
                               build_directory=str(scratch), verbose=verbose, is_python_module=False)
        except Exception as exc:
            if backend == "cpp" or require_cuda:
                (where / "failed.txt").write_text(_first_line(exc) + "\n")
                raise RuntimeError(f"radixkv.core.ops: building the C++ extension failed: {_first_line(exc)}") from exc
            warnings.warn(f"radixkv.core.ops: could not build the CUDA kernel ({_first_line(exc)}); GPU tensors "
                          "use the torch kernels, CPU ones the C++ kernel", RuntimeWarning, stacklevel=3)
            continue
        finally:
            library = scratch / f"{name}.so"
            if library.is_file():
                os.replace(library, where / library.name)
            shutil.rmtree(scratch, ignore_errors=True)
        _write_atomic(where / MANIFEST, json.dumps({
            "backend": backend, "library": f"{name}.so", "torch": torch.__version__,
            "cuda": torch.version.cuda, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        (where / "failed.txt").unlink(missing_ok=True)
        return backend
    raise AssertionError("unreachable: the C++ attempt returns or raises")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ------------------------------------------------------------------------------------ lock


def _lock_path(where: Path) -> Path:
    return where.with_name(where.name + ".lock")


def _describe_lock(lock: Path) -> str:
    try:
        owner = json.loads(lock.read_text())
        age = time.time() - float(owner["time"])
        return f"pid {owner['pid']} on {owner['host']}, for {age:.0f} s"
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable: left by a killed build?"


class _BuildLock:
    """An exclusive lock file with a bounded wait; a lock of a dead process on this host is taken over.

    ``acquire`` polls every 0.2 s for at most ``timeout`` seconds.  Cost per poll: one ``open``.
    """

    def __init__(self, path: Path, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def __enter__(self) -> _BuildLock:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale():
                    self.path.unlink(missing_ok=True)
                    continue
                if time.monotonic() >= deadline:
                    raise BuildLocked(f"radixkv.core.ops: another build has held {self.path} "
                                      f"({_describe_lock(self.path)}) for longer than {self.timeout:g} s; "
                                      "if no build is running, remove that file") from None
                time.sleep(0.2)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}, f)
            return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)

    def _stale(self) -> bool:
        """The lock names a process of this host that is gone."""
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            # Being written right now (wait for it), or left half-written by a killed builder long ago.
            try:
                return time.time() - self.path.stat().st_mtime > UNREADABLE_LOCK_S
            except OSError:
                return False
        if host != socket.gethostname():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
