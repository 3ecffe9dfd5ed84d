"""The built wheel carries everything: backends, the extension's sources, py.typed, the integrations;
and the extension builds from the installed copy into its keyed directory, then a later process
with no compiler at all only loads it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # a wheel built and installed: `pytest -m "not slow"` leaves it out

ROOT = Path(__file__).resolve().parent.parent

BUILD = """
import radixkv, radixkv.core.ops as ops
assert radixkv.__file__.startswith(sys.argv[1]), radixkv.__file__
print(ops.build())
"""

# Under RADIXKV_EXT=require, with no compiler on PATH: the C++ kernel runs only if it was loaded.
USE = """
import torch, radixkv, radixkv.core.ops as ops
assert radixkv.__file__.startswith(sys.argv[1]), radixkv.__file__
kv = torch.arange(2 * 2 * 4 * 2 * 1 * 3, dtype=torch.float16).reshape(2, 2, 4, 2, 1, 3)
out = ops.gather_pages(kv, [3, 1])
assert torch.equal(out, torch.cat([kv[:, :, 3], kv[:, :, 1]], dim=2))
blocks = ops.gather_blocks([kv[l].transpose(2, 3) for l in range(2)], [2], torch.empty(2, 2, 1, 2, 3, dtype=kv.dtype))
assert torch.equal(blocks[:, :, 0], kv[:, :, 2, :, 0])  # heads and block_size swapped
from radixkv.core import _ext
assert _ext.native_tokens()([1, 2**30]) == bytes([1, 0, 0, 0, 0, 0, 0, 64])  # the token converter, too
print(ops.backend(), ops.extension_dir())
"""


def test_wheel_contents_and_extension_from_the_installed_copy(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("radixkv-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("radixkv/py.typed", "radixkv/backends/__init__.py", "radixkv/backends/lmdb.py",
                 "radixkv/backends/s3.py", "radixkv/cuda_ext/block_copy.cpp", "radixkv/cuda_ext/block_copy.h",
                 "radixkv/cuda_ext/tokens.cpp",
                 "radixkv/cuda_ext/block_copy_cuda.cu", "radixkv/integrations/transformers.py",
                 "radixkv/testing/machines.py", "radixkv/bench/tree.py", "radixkv/core/cache.py",
                 "radixkv/p2p/tier.py", "radixkv/reuse/blend.py", "radixkv/tools/cli.py"):
        assert name in names, name
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    env = {"PYTHONPATH": str(target), "RADIXKV_EXT": "require", "RADIXKV_EXT_DIR": str(tmp_path / "ext"),
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "import sys\n" + BUILD, str(target)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    backend = out.stdout.strip().splitlines()[-1]
    assert backend in ("cpp", "cuda+cpp")
    built = sorted(p.name for p in (tmp_path / "ext").iterdir())
    assert len(built) == 1 and (tmp_path / "ext" / built[0] / "manifest.json").is_file(), built

    no_compiler = {**env, "PATH": str(tmp_path / "empty"), "CXX": "/bin/false"}
    out = subprocess.run([sys.executable, "-c", "import sys\n" + USE, str(target)], env=no_compiler,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [backend, str(tmp_path / "ext" / built[0])]
