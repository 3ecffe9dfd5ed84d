"""Runs one vLLM engine through a list of steps and writes what it generated as JSON.

Used by ``tests/test_vllm.py`` (each engine start costs ~20 s, so one process runs every case of
one engine configuration) and usable by hand::

    python tests/helpers/vllm_cases.py SPEC.json OUT.json

``SPEC`` holds ``model`` (a directory), ``connector`` (``null`` for vLLM without any cache, or
``{"role": ..., "config": {...}}`` for ``RadixKVConnector``), ``prefix_caching`` and ``steps``:
each step names a ``prompt`` (a key of ``prompts``: a list of token ids) or a ``batch`` of them
(generated together), and optionally
``salt`` (vLLM's ``cache_salt``), ``reset`` (``llm.reset_prefix_cache()`` first), ``max_tokens``
and ``action`` run before it (``"corrupt_s3"``: overwrite every object of ``s3.bucket`` with
garbage; ``"pause_s3"``/``"resume_s3"``: SIGSTOP/SIGCONT the S3 server ``s3.pid``; ``"start_s3"``: start
an S3 server with the bucket ``late_s3.bucket`` on port ``late_s3.port``, which the engine's
``remote_url`` named since before it started).  ``wrong_kv`` (in-process engines only) makes every
chunk the connector loads in that step wrong on purpose, the control of the exactness checks:
``"zero_layer"`` (layer 0's K and V zeroed), ``"shift_block"`` (each vLLM block of the chunk
given the KV of the block before it, as a block table off by one would) or ``"other_chunk"``
(each chunk replaced by the request's first chunk).
``kv_events`` (a ZMQ endpoint) turns vLLM's KV events on and records them, decoded by vLLM's own
structs, under ``kv_events`` in the output (each with the index of the step it arrived in).
``wait_for`` (a path) waits, before the step, until another process created that file (at most
``wait_s``, default 300 s); ``signal`` (a path) creates that file after it: two engines taking
turns (peer-to-peer sharing).  ``until_loaded`` (a number) repeats the step, after a second's pause, until the connector loaded
tokens for it (at least ``until_tokens``, default 1: a tier's writes land one chunk at a time, so
a try can load the leading chunks only) or that many tries are done (a tier that comes up while
the engine runs); each try's loaded tokens and generated tokens are in the step's ``each_try``.
``ignore_eos`` generates all ``max_tokens``; ``after`` (an earlier step's name) makes the prompt
that step's prompt, what it generated (or, with ``filler``, as many tokens of id 5) and then
``prompt``'s tokens: a conversation's next turn.  The output has the engine's ``block_size`` and
per step the tokens, logprobs (top 3 of each generated token), ``num_cached_tokens``,
``kv_transfer_params`` and the wall time of the step.  ``"in_process": true`` runs vLLM's engine
and its one worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor, as
on one GPU), where the connector answers the CPU tier's lookups in the scheduler's step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Callable

_WRONG_KV: list[str] = []        # the control mode of the step running now (in-process engines)
_LATE_S3: list[Any] = []         # servers started by "start_s3", stopped when the run ends


def make_model(path: str, seed: int) -> str:
    """Save a small random-weight Llama (2 layers, 4 query / 2 KV heads of 64) to ``path`` unless
    one is there.  O(weights)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        from radixkv.integrations.transformers import random_model

        random_model("llama", seed=seed, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                     intermediate_size=512, vocab_size=1000, max_positions=4096).save_pretrained(path)
    return path


def build_llm(spec: dict[str, Any]) -> Any:
    """The ``LLM`` a spec describes (fp32, eager, token-id prompts).  Starts an engine: ~20 s."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    conn = spec.get("connector")
    if conn is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=conn.get("name", "RadixKVConnector"),
            kv_connector_module_path=conn.get("module", "radixkv.integrations.vllm"),
            kv_role=conn.get("role", "kv_both"),
            kv_connector_extra_config=conn.get("extra", {"radixkv_config": conn.get("config")}))
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=spec["kv_events"], topic="kv")
    return LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               max_model_len=spec.get("max_model_len", 4096), enable_prefix_caching=spec.get("prefix_caching", True),
               disable_log_stats=not spec.get("log_stats", False), seed=0,
               num_gpu_blocks_override=spec.get("blocks"),
               distributed_executor_backend="uni" if spec.get("in_process") else None, **kw)


def s3_action(action: str, s3: dict[str, Any]) -> None:
    """Damage, pause or resume the test's S3 server."""
    if action == "corrupt_s3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1",
                              aws_access_key_id=s3["key"], aws_secret_access_key=s3["secret"],
                              config=Config(s3={"addressing_style": "path"}))
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3["bucket"])
        for page in pages:
            for obj in page.get("Contents", []):
                body = client.get_object(Bucket=s3["bucket"], Key=obj["Key"])["Body"].read()
                flipped = bytearray(body)
                flipped[len(flipped) // 2] ^= 0xFF        # one bit pattern in the payload
                client.put_object(Bucket=s3["bucket"], Key=obj["Key"], Body=bytes(flipped))
    elif action == "pause_s3":
        os.kill(int(s3["pid"]), signal.SIGSTOP)
    elif action == "resume_s3":
        os.kill(int(s3["pid"]), signal.SIGCONT)
    elif action == "start_s3":
        from radixkv.tools.s3server import MotoServer

        server = MotoServer(port=int(s3["port"])).start()
        _LATE_S3.append(server)
        server.client().create_bucket(Bucket=s3["bucket"])
    else:
        raise ValueError(f"unknown action {action!r}")


def wrong_kv_scatter(scatter: Callable[..., Any], block_tokens: int) -> Callable[..., Any]:
    """``radixkv.core.ops.scatter_blocks`` made to write wrong KV while ``_WRONG_KV`` names a mode (see
    the module docstring); a chunk buffer is ``[layers, 2, chunk tokens, kv heads, head dim]``."""
    first: list[Any] = []

    def wrapped(src: Any, *args: Any, **kwargs: Any) -> Any:
        if not _WRONG_KV:
            first.clear()
            return scatter(src, *args, **kwargs)
        mode = _WRONG_KV[0]
        bad = src.clone()
        if mode == "zero_layer":
            bad[0] = 0
        elif mode == "shift_block":          # each block reads the one before (a rotation of all
            bad[:, :, block_tokens:] = src[:, :, :-block_tokens]   # would not show: attention is order-free)
        elif mode == "other_chunk":
            if not first:
                first.append(src.clone())     # the first chunk loaded stays; later ones become it
            bad = first[0].clone()
        else:
            raise ValueError(f"unknown wrong_kv mode {mode!r}")
        return scatter(bad, *args, **kwargs)

    return wrapped


class EventLog:
    """Subscribes to the engine's KV events (``spec["kv_events"]``, a ZMQ endpoint) and decodes
    them with vLLM's own structs; ``events`` lists them as dicts tagged with the step running when
    they arrived."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.events: list[dict[str, Any]] = []
        self.step = -1
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.bind(endpoint)    # vLLM connects its PUB socket to an endpoint without a wildcard
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while self._running:
            if not self._sock.poll(100):
                continue
            _, seq, payload = self._sock.recv_multipart()
            for e in decoder.decode(payload).events:
                self.events.append({"step": self.step, "seq": int.from_bytes(seq, "big"), "type": type(e).__name__,
                                    "medium": getattr(e, "medium", None),
                                    "hashes": [str(h) for h in getattr(e, "block_hashes", [])],
                                    "parent": None if getattr(e, "parent_block_hash", None) is None
                                    else str(e.parent_block_hash), "block_size": getattr(e, "block_size", None)})

    def close(self) -> list[dict[str, Any]]:
        time.sleep(1.0)                       # the last step's batch
        self._running = False
        self._thread.join(5)
        self._sock.close(0)
        return self.events


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run every step of ``spec`` in one engine; the results."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("in_process"):       # read when vLLM builds its engine client (vLLM's CPU platform
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # keeps "uni" only without multiprocessing)
    if spec.get("in_process"):      # the worker runs here: its chunk scatters can be made wrong
        from radixkv import ops

        ops.scatter_blocks = wrong_kv_scatter(ops.scatter_blocks, spec.get("block_size", 128))
    t0 = time.perf_counter()
    log = EventLog(spec["kv_events"]) if spec.get("kv_events") else None
    llm = build_llm(spec)
    results: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "steps": [],
                               "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    sent: dict[str, tuple[list[int], list[int]]] = {}      # a step's prompt and what it generated
    for i, step in enumerate(spec["steps"]):
        if log is not None:
            log.step = i
        if step.get("wait_for"):      # another process's step must be done first (bounded)
            until = time.monotonic() + float(step.get("wait_s", 300))
            while not os.path.exists(step["wait_for"]) and time.monotonic() < until:
                time.sleep(0.1)
        if step.get("action"):
            s3_action(step["action"], spec["late_s3"] if step["action"] == "start_s3" else spec["s3"])
        names = step.get("batch") or [step["prompt"]]
        prompts = []
        for name in names:
            ids = list(spec["prompts"][name])
            if step.get("after"):           # the next turn: the last prompt, its answer, this prompt
                last, answer = sent[step["after"]]
                ids = last + ([5] * len(answer) if step.get("filler") else answer) + ids
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
            prompts.append(TokensPrompt(**prompt))    # type: ignore[typeddict-item]
        params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=3,
                                ignore_eos=bool(step.get("ignore_eos")))
        _WRONG_KV[:] = [step["wrong_kv"]] if step.get("wrong_kv") else []
        each_try: list[dict[str, Any]] = []
        for tries in range(1, int(step.get("until_loaded", 1)) + 1):
            if step.get("reset"):
                llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            loaded = int((outs[0].kv_transfer_params or {}).get("radixkv_loaded_tokens") or 0)
            each_try.append({"loaded": loaded, "tokens": list(outs[0].outputs[0].token_ids)})
            if loaded >= int(step.get("until_tokens", 1)) or tries == step.get("until_loaded", 1):
                break
            time.sleep(1.0)
        _WRONG_KV.clear()
        for name, out in zip(names, outs):
            gen = out.outputs[0]
            label = step.get("name", step.get("prompt"))
            sent[label] = (list(prompts[0]["prompt_token_ids"]), list(gen.token_ids))
            results["steps"].append({
                "name": f"{label}:{name}" if step.get("batch") else label, "tokens": list(gen.token_ids),
                "logprobs": [sorted([int(k), float(v.logprob)] for k, v in d.items()) for d in gen.logprobs or []],
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "kv_transfer_params": out.kv_transfer_params, "seconds": elapsed, "each_try": each_try})
        if step.get("signal"):        # tell another process this step is done
            with open(step["signal"], "w") as f:
                f.write("done")
    if log is not None:
        results["kv_events"] = log.close()
    if spec.get("log_stats"):
        llm.llm_engine.do_log_stats()
        results["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                              if m.name in ("vllm:num_preemptions", "vllm:external_prefix_cache_hits",
                                            "vllm:external_prefix_cache_queries")}
    # Shut the engine down before the results are written: the connector flushes its tier writes
    # then, so that the next process finds them.
    llm.llm_engine.engine_core.shutdown()
    for server in _LATE_S3:
        server.stop()
    results["total_s"] = time.perf_counter() - t0
    return results


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")        # GiB of KV pool
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # do not pin threads to shared cores
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    results = run(spec)
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
