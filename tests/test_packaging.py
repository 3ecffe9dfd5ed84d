"""The built wheel carries everything: backends, the extension's sources, py.typed, the integrations;
and the extension builds and runs from the installed copy, not only from the source tree."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch, radixkv, radixkv.ops as ops
assert radixkv.__file__.startswith(sys.argv[1]), radixkv.__file__
print(ops.build())
kv = torch.arange(2 * 2 * 4 * 2 * 1 * 3, dtype=torch.float16).reshape(2, 2, 4, 2, 1, 3)
out = ops.gather_pages(kv, [3, 1])
assert torch.equal(out, torch.cat([kv[:, :, 3], kv[:, :, 1]], dim=2))
"""


def test_wheel_contents_and_extension_from_the_installed_copy(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("radixkv-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("radixkv/py.typed", "radixkv/backends/__init__.py", "radixkv/backends/lmdb.py",
                 "radixkv/backends/s3.py", "radixkv/cuda_ext/block_copy.cpp", "radixkv/cuda_ext/block_copy.h",
                 "radixkv/cuda_ext/block_copy_cuda.cu", "radixkv/integrations/transformers.py",
                 "radixkv/testing/index.py", "radixkv/bench/index.py"):
        assert name in names, name
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    env = {"PYTHONPATH": str(target), "RADIXKV_EXT": "require", "RADIXKV_BUILD_DIR": str(tmp_path / "build"),
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "import sys\n" + SCRIPT, str(target)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] in ("cpp", "cuda+cpp")
