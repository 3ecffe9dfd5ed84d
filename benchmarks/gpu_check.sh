#!/usr/bin/env bash
# The GPU check: what radixkv's CUDA side does on a machine with an NVIDIA GPU, in under 8 minutes,
# written to one results file.  Run from the repository root:
#
#     bash benchmarks/gpu_check.sh [RESULTS_DIR]        # default: benchmarks/results
#
# It needs a Python (PYTHON, default python3) whose torch has CUDA, with numpy, xxhash, hypothesis,
# pytest and ninja; wheels in .whl/ (if any) are installed first into /tmp/radixkv-site, for
# machines that cannot reach a package registry.  The package is used as it installs (backends/
# inside radixkv/, assembled by build_py), so nothing is installed into the machine's Python.
#
# Steps, each bounded by `timeout` and each reported (a failing step does not stop the others):
#   1. build the block-copy extension (C++ and the CUDA kernels) with torch.utils.cpp_extension;
#   2. the CUDA tests: kernels against the torch reference, bit for bit, device to device and
#      through pinned host memory (tests/core/test_ops_cuda.py), and nvcc compiling every .cu;
#   3. python -m radixkv.bench copy --device cuda (gather/scatter against cudaMemcpy of the same
#      bytes, device to device and through pinned host memory);
#   4. the pinned-memory path end to end: a PrefixCache on the GPU over a pinned CpuTier, a prefix
#      evicted to the CPU tier and loaded back, byte for byte;
#   5. a vLLM engine with radixkv's connector, if a CUDA build of vLLM imports here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${1:-benchmarks/results}
mkdir -p "$RESULTS"
OUTFILE="$RESULTS/gpu_check.txt"
exec > >(tee "$OUTFILE") 2>&1
export PYTHONUNBUFFERED=1

echo "# bash benchmarks/gpu_check.sh   ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# gpu: /'
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/radixkv-site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/radixkv-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA GPU here; nothing to check"
    exit 2
fi
rm -rf build/gpu && $PY -c "from setuptools import setup; setup()" -q build_py -d build/gpu >/dev/null 2>&1 || exit 2
export PYTHONPATH=$PWD/build/gpu${PYTHONPATH:+:$PYTHONPATH}
export RADIXKV_EXT_DIR=${RADIXKV_EXT_DIR:-/tmp/radixkv-ext}
$PY -c "import torch; print(f'# torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}')"

failed=0
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo; echo "## $name"
    local t0=$SECONDS
    timeout "$limit" "$@"; local rc=$?
    echo "## $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed=1
}

step "build the extension" 240 $PY -m radixkv build-ext --verbose
step "CUDA tests" 180 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" \
    tests/core/test_ops_cuda.py tests/core/test_cuda_compile.py
step "bench copy --device cuda" 120 $PY -m radixkv.bench copy --device cuda --repeat 9 --pool-gib 4 \
    --out "$RESULTS/copy_cuda.txt"
step "pinned CPU tier under a GPU pool" 60 $PY - <<'PYEOF'
import torch
import radixkv as rk
from radixkv.backends import CpuTier

layout = rk.KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, page_size=16)
cpu = CpuTier(max_bytes=64 << 20, pinned=True)
with rk.PrefixCache(layout, num_pages=256, device="cuda", tiers=[cpu], chunk_size=64) as cache:
    tokens = list(range(1, 1025))
    req = cache.open(tokens)
    pages = cache.alloc(1024 // 16 - len(req.pages))
    cache.pool.kv[:, :, pages] = torch.randn_like(cache.pool.kv[:, :, pages])
    table = req.extend(tokens, pages)
    want = rk.ops.gather_pages(cache.pool, table).cpu()
    req.release()
    cache.evict(cache.pool.num_pages)
    cache.flush()                  # the evicted chunks reach the CPU tier through the write queue
    req = cache.open(tokens)
    req.wait()
    got = rk.ops.gather_pages(cache.pool, req.pages).cpu()
    n = req.num_cached
    assert n >= 1024 - 64 and torch.equal(got, want[:, :, :n]), (n, "loaded KV differs")
    print(f"pinned={cpu.pinned}: {n} tokens back from the CPU tier onto the GPU, byte for byte; "
          f"tier tokens {req.tier_tokens}")
    req.release()
    cache.check()
PYEOF
if $PY -c "import vllm, torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    step "vLLM with the connector" 240 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" \
        tests/integrations/test_vllm.py -x
else
    echo; echo "## vLLM with the connector: skipped (no CUDA build of vLLM imports here)"
fi
echo; echo "# gpu_check: $([ $failed -eq 0 ] && echo "all steps passed" || echo "some steps FAILED")"
exit $failed
