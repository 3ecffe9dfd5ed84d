"""The block-copy extension is built ahead of time and only loaded at run time.

A missing build, a build in progress or a stale lock left by a killed build mean the torch kernels
with one warning, promptly (each case in a fresh process, under a timeout), and ``require`` makes a
missing build a clear error; the build directory is keyed by torch and a hash of the sources and
flags; the build lock is bounded and a dead builder's lock is taken over.  The build-and-load round
trip from an installed copy is in tests/test_packaging.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixkv.core import _ext

RUN_TIMEOUT = 120  # seconds for one fresh process: importing torch is most of it


def run_python(script: str, ext_dir: Path, mode: str = "auto") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RADIXKV_EXT_DIR": str(ext_dir), "RADIXKV_EXT": mode}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)


# Copies through the ops and through a cache with a tier (a store and a load), recording warnings.
USE_THE_OPS = """
import time, warnings
warnings.simplefilter("always")
import torch
import radixkv as rk
from radixkv import ops
with warnings.catch_warnings(record=True) as caught:
    t0 = time.monotonic()
    kv = torch.arange(2 * 2 * 4 * 2 * 1 * 3, dtype=torch.float32).reshape(2, 2, 4, 2, 1, 3)
    out = ops.gather_pages(kv, [3, 1])
    assert torch.equal(out, torch.cat([kv[:, :, 3], kv[:, :, 1]], dim=2))
    layers = [kv[l].transpose(2, 3) for l in range(2)]  # [2, 4, 1, 2, 3]: strided views
    ops.gather_blocks(layers, [2], torch.empty(2, 2, 1, 2, 3))
    layout = rk.KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    cache = rk.PrefixCache(layout, num_pages=8, tiers=[rk.backends.CpuTier(max_bytes=1 << 20)], chunk_size=4)
    tokens = list(range(9))
    m = cache.match(tokens)
    cache.insert(tokens, torch.cat([m.pages, cache.alloc(4 - len(m.pages))]))
    cache.release(m)
    cache.flush()
    cache.evict(8)
    cache.release(cache.match(tokens))
    cache.close()
    seconds = time.monotonic() - t0
ours = [str(w.message) for w in caught if "radixkv.core.ops" in str(w.message)]
print(ops.backend(), f"{seconds:.2f}", len(ours))
for message in ours:
    print(message)
"""


# Then the same process under RADIXKV_EXT=require: the missing build is an error that says what to do.
THEN_REQUIRE = """
import os
os.environ["RADIXKV_EXT"] = "require"
try:
    ops.gather_pages(torch.zeros(1, 2, 2, 1, 1, 1), [0])
except RuntimeError as exc:
    print("require:", exc)
"""


def parse(out: subprocess.CompletedProcess[str]) -> tuple[str, float, list[str]]:
    assert out.returncode == 0, out.stderr[-3000:]
    first, *messages = [line for line in out.stdout.strip().splitlines() if not line.startswith("require:")]
    backend, seconds, count = first.split()
    assert int(count) == len(messages)
    return backend, float(seconds), messages


@pytest.mark.slow                 # a Python process that imports torch: `make test` runs it
def test_a_missing_build_means_the_torch_kernels_and_one_warning_or_under_require_an_error(tmp_path: Path) -> None:
    out = run_python(USE_THE_OPS + THEN_REQUIRE, tmp_path / "ext")
    backend, _, messages = parse(out)
    assert backend == "torch"
    assert len(messages) == 1, messages
    assert "not built" in messages[0] and "python -m radixkv build-ext" in messages[0]
    assert not (tmp_path / "ext").exists()  # nothing was built, not even a directory made
    error = out.stdout.strip().splitlines()[-1]
    assert error.startswith("require: radixkv.core.ops: RADIXKV_EXT=require, but the block-copy extension is not built")
    assert "python -m radixkv build-ext" in error


@pytest.mark.slow                 # a Python process that imports torch: `make test` runs it
def test_stale_locks_do_not_make_a_request_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build killed while compiling leaves its lock (and torch's own) behind: no call waits on them."""
    root = tmp_path / "ext"
    key_dir = root / _ext.build_key()
    (key_dir / "build-killed").mkdir(parents=True)
    (key_dir / "build-killed" / "lock").touch()        # torch's FileBaton of the killed compile
    (key_dir / "lock").touch()                         # and one where torch would put it by default
    # Our lock, held by a process that is alive (pid 1) on this host: a build that never finishes.
    _ext._lock_path(key_dir).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "time": time.time()}))
    t0 = time.monotonic()
    backend, seconds, messages = parse(run_python(USE_THE_OPS, root))
    assert backend == "torch"
    assert len(messages) == 1 and "a build holds" in messages[0], messages
    assert seconds < 60 and time.monotonic() - t0 < RUN_TIMEOUT  # generous: the copies wait on nothing

    # An explicit build waits for that lock only as long as it is told to, then says which file it is.
    monkeypatch.setenv(_ext.ENV_DIR, str(root))
    with pytest.raises(TimeoutError, match=str(_ext._lock_path(key_dir))):
        _ext.build(lock_timeout=0.5)


@pytest.mark.slow                 # a Python process that imports torch: `make test` runs it
def test_an_unloadable_build_is_a_miss_not_a_crash(tmp_path: Path) -> None:
    key_dir = tmp_path / "ext" / _ext.build_key()
    key_dir.mkdir(parents=True)
    (key_dir / "radixkv_block_copy.so").write_bytes(b"not a shared library")
    (key_dir / _ext.MANIFEST).write_text(json.dumps({"backend": "cpp", "library": "radixkv_block_copy.so"}))
    backend, _, messages = parse(run_python(USE_THE_OPS, tmp_path / "ext"))
    assert backend == "torch" and len(messages) == 1 and "does not load" in messages[0], messages


def test_the_directory_is_keyed_by_torch_sources_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    src = tmp_path / "src"
    shutil.copytree(_ext.sources_dir(), src)
    key = _ext.build_key(src)
    assert key == _ext.build_key(_ext.sources_dir())      # the same sources anywhere: the same build
    assert key.startswith(torch.__version__.replace("+", "_") + "-")
    (src / "block_copy.h").write_text((src / "block_copy.h").read_text() + "\n// changed\n")
    changed = _ext.build_key(src)
    assert changed != key
    monkeypatch.setattr(_ext, "CFLAGS", ("-O2",))
    assert _ext.build_key(src) not in (key, changed)

    monkeypatch.setenv(_ext.ENV_DIR, str(tmp_path / "mine"))
    assert _ext.ext_dir(src) == tmp_path / "mine" / _ext.build_key(src)
    monkeypatch.delenv(_ext.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert _ext.ext_dir(src).parent == tmp_path / "cache" / "radixkv" / "ext"


def test_the_build_lock_is_bounded_and_a_dead_builders_lock_is_taken_over(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    with _ext._BuildLock(lock, timeout=5):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        t0 = time.monotonic()
        with pytest.raises(_ext.BuildLocked, match="remove that file"):
            with _ext._BuildLock(lock, timeout=0.3):
                pass
        assert time.monotonic() - t0 < 5
    assert not lock.exists()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": time.time()}))
    with _ext._BuildLock(lock, timeout=0.3):  # taken over at once, no wait
        assert json.loads(lock.read_text())["pid"] == os.getpid()

    lock.write_text("")  # half-written by a builder killed long ago
    old = time.time() - 2 * _ext.UNREADABLE_LOCK_S
    os.utime(lock, (old, old))
    with _ext._BuildLock(lock, timeout=0.3):
        pass


def test_a_failed_build_raises_and_is_reported_by_later_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    shutil.copytree(_ext.sources_dir(), src)
    (src / "block_copy.cpp").write_text("#include \"deliberately_missing.h\"\n" + (src / "block_copy.cpp").read_text())
    monkeypatch.setattr(_ext, "sources_dir", lambda: src)
    monkeypatch.setattr(_ext, "_loaded", None)
    monkeypatch.setenv(_ext.ENV_DIR, str(tmp_path / "ext"))
    with pytest.raises(RuntimeError, match="building the C\\+\\+ extension failed"):
        _ext.build()
    where = _ext.ext_dir()
    assert (where / "failed.txt").is_file() and not (where / _ext.MANIFEST).exists()
    assert not _ext._lock_path(where).exists() and not list(where.glob("build-*"))
    with pytest.raises(_ext.BuildMissing, match="the last build failed"):
        _ext.load()


# Flags that would tie the build to the CPU it runs on (or to one instruction set).
_ISA_FLAG = ("-march", "-mtune=native", "-mcpu", "-mavx", "-msse4", "-mfma", "-mf16c", "-mbmi", "-mpopcnt")


def test_the_build_asks_for_no_instruction_set_of_the_machine_it_runs_on() -> None:
    """The extension is compiled for baseline x86-64 (or the platform's baseline elsewhere): no
    ``-march=native`` or ISA flag, no intrinsics headers, and (where the build exists and objdump
    is there) no AVX register in its machine code — what it runs on another CPU is what it ran here."""
    flags = [*_ext.CFLAGS, *_ext.CUDA_CFLAGS]
    assert not [f for f in flags if f.startswith(_ISA_FLAG)], flags
    sources = [p for p in _ext.sources_dir().iterdir() if p.suffix in (".cpp", ".cu", ".h", ".cuh")]
    assert sources
    for path in sources:
        text = path.read_text()
        for marker in ("immintrin.h", "x86intrin.h", "__attribute__((target", "#pragma GCC target"):
            assert marker not in text, f"{path.name} uses {marker}"
    built = sorted(_ext.ext_dir().glob("*.so"))
    if not built or shutil.which("objdump") is None or os.uname().machine != "x86_64":
        pytest.skip("no x86-64 build of the extension here to disassemble")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built[0])], capture_output=True,
                          text=True, timeout=120).stdout
    assert "%xmm" in code or "ret" in code                       # it disassembled
    assert "%ymm" not in code and "%zmm" not in code, "the extension uses AVX registers"
