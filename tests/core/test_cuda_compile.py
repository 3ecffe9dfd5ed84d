"""The CUDA sources compile: ``nvcc -ptx`` of every ``.cu`` against torch's headers.

Runs wherever nvcc is, GPU or not, so that a CPU-only CI still catches a broken kernel.  ``-ptx``
runs nvcc's C++ front end over the whole file, host code included (an undefined host function is
an error), and generates the device code, but skips the host compiler's pass over torch's headers:
about 15 s here instead of about 40 for ``-c``.  A CPU
wheel of torch ships the CUDA headers but not ``c10/cuda/impl/cuda_cmake_macros.h``, which a CUDA
build of torch generates; a one-line shim stands in for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from radixkv.core import _ext

pytestmark = pytest.mark.slow      # nvcc over every .cu: `pytest -m "not slow"` leaves it out

CUDA_SOURCES = sorted(_ext.sources_dir().glob("*.cu"))


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and cpp_extension.CUDA_HOME is not None:
        candidate = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        found = str(candidate) if candidate.is_file() else None
    return found


NVCC = find_nvcc()


def test_there_are_cuda_sources() -> None:
    assert [p.name for p in CUDA_SOURCES] == ["block_copy_cuda.cu"]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (not on PATH nor in CUDA_HOME): "
                    "the CUDA sources are not compile-checked on this machine")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source: Path, tmp_path: Path) -> None:
    assert NVCC is not None
    includes = [*cpp_extension.include_paths(), str(source.parent)]
    if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for d in includes):
        shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
        shim.mkdir(parents=True)
        (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path / "shim"))
    # The flags torch.utils.cpp_extension gives nvcc, less the ones that need a GPU or a link.
    cmd = [NVCC, "-ptx", str(source), "-o", str(tmp_path / "out.ptx"), "-std=c++20", "-O3",
           "--compiler-options", "-fPIC", *cpp_extension.COMMON_NVCC_FLAGS,
           "-DTORCH_EXTENSION_NAME=radixkv_block_copy_cuda", *(f"-I{d}" for d in includes)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LC_ALL": "C"})
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 0, "nvcc failed:\n" + "\n".join(errors[:20] or result.stderr.splitlines()[-40:])
    ptx = (tmp_path / "out.ptx").read_text()
    kernels = [line for line in ptx.splitlines() if line.startswith(".entry") or " .entry " in line]
    assert any("copy_blocks_kernel" in line for line in kernels), "no block-copy kernel in the PTX"
