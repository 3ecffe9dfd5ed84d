"""The README's main command and the benchmarks run end to end (small sizes; no timing asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # the demo and the benchmarks end to end, in processes: `pytest -m "not slow"` leaves it out


def run(*args):
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_replay_reports_hits_and_savings():
    out = run("radixkv", "replay", "--requests", "200", "--system-prompts", "4")
    rate = float(re.search(r"token hit rate ([\d.]+)%", out).group(1))
    assert 30 < rate < 100                     # 4 shared 2K-token prompts over 200 requests
    assert "modelled prefill compute saved" in out


def test_bench_index_smoke(tmp_path):
    out = run("radixkv.bench", "tree", "--requests", "300", "--page-sizes", "16,1", "--repeat", "1",
              "--pool-tokens", "200000", "--evict-sizes", "200,2000", "--out", str(tmp_path / "r.txt"))
    assert "req/s" in out and "evict cost per node" in out
    assert (tmp_path / "r.txt").read_text().startswith("# python -m radixkv.bench tree")


def test_bench_hash_smoke():
    out = run("radixkv.bench", "hash", "--tokens", "8192", "--repeat", "1")
    assert "M tokens/s" in out


def test_bench_usage():
    out = subprocess.run([sys.executable, "-m", "radixkv.bench"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stdout


def test_bench_tiers_smoke():
    out = run("radixkv.bench", "tiers", "--chunks", "2", "--repeat", "1")
    assert "LmdbTier" in out and "target: CpuTier get" in out


def test_demo_end_to_end_with_restart_and_cross_instance():
    """The README's main command: every level serves the shared prompt, S3 across two processes."""
    out = run("radixkv", "demo", "--cross-instance", "--system-tokens", "512", "--question-tokens", "32")
    rows = {line.split("  ")[0].strip() + "|" + line[17:53].strip(): line for line in out.splitlines()
            if line[:6] in ("engine", "restar", "s3-wri", "s3-rea")}
    sources = [line[68:90].split()[0] if line[68:90].strip() else "-" for line in rows.values()]
    assert sources == ["-", "pool", "pool", "cpu", "lmdb", "pool", "-", "s3"], out


def test_build_ext_reports_the_backend_and_its_directory():
    out = run("radixkv", "build-ext").splitlines()
    assert out[0].startswith("radixkv.core.ops backend: ") and out[0].split(": ")[1] in ("cpp", "cuda+cpp")
    where = Path(out[1].removeprefix("built in: "))
    assert (where / "manifest.json").is_file()
