"""``python -m radixkv demo``: radixkv's main job, end to end, on embedded defaults.

A small random-weight Llama (no download) is served through a ``PrefixCache`` with a CPU tier and an
LMDB tier in a cache directory.  Several requests share one system prompt:

1. the first is a cold prefill; the next ones reuse the prompt's KV from the pool;
2. the pool is emptied (as memory pressure would): the next request loads it from the CPU tier;
3. the process "restarts": a fresh process on the same cache directory loads it from LMDB;
4. with ``--cross-instance``, two more processes share one bucket on a local S3 server (moto's, on
   127.0.0.1): the first writes, the second, with its own empty pool and disk, loads from S3.

It prints a table of time to first token (TTFT) and where each request's prefix came from.  With
``--config FILE`` (or ``RADIXKV_CONFIG``) the cache is built from that file instead (see
``radixkv.config``; S3 then only if the file names a ``remote_url``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.tools._args import Parser

__all__ = ["main"]

_ROW = "RADIXKV-DEMO-ROW "
# The TTFT benchmark's model: small, but with the projection-heavy FLOP mix of a real LLM.
MODEL = dict(family="llama", seed=0, num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=2,
             intermediate_size=8192, vocab_size=32000, max_positions=8192)


def _config(args: argparse.Namespace, model: Any, remote: str | None = None) -> Any:
    from radixkv.config import CacheConfig, load_config
    from radixkv.integrations.transformers import namespace_for

    if args.config or (os.environ.get("RADIXKV_CONFIG") and not remote):
        return load_config(args.config)
    cfg: dict[str, Any] = {
        "chunk_size": 256, "page_size": 16, "pool_tokens": 64 * 1024, "local_cpu": True, "max_local_cpu_size": 0.5,
        "local_disk": str(Path(args.cache_dir) / "lmdb"), "max_local_disk_size": 2.0,
        "namespace": {"model": namespace_for(model).model, "revision": "demo"}}
    if remote:
        cfg.update(remote_url="s3://radixkv-demo/kv", remote_endpoint=remote)
    return CacheConfig.from_mapping(cfg)


def _prompts(args: argparse.Namespace) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    system = rng.integers(0, MODEL["vocab_size"], args.system_tokens, dtype=np.int64)  # type: ignore[call-overload]
    questions = [rng.integers(0, MODEL["vocab_size"], args.question_tokens, dtype=np.int64)  # type: ignore[call-overload]
                 for _ in range(8)]
    return system, questions


def _serve(args: argparse.Namespace, process: str, plan: list[tuple[str, int]], remote: str | None = None,
           fresh: bool = False) -> list[dict[str, Any]]:
    """Run ``plan`` (request label, question index) in this process; one table row per request."""
    import torch

    from radixkv.integrations.transformers import PrefixCachedLM, layout_for, random_model

    torch.set_num_threads(args.threads)
    model = random_model(**MODEL)  # type: ignore[arg-type]
    cache = _config(args, model, remote).build(layout_for(model, page_size=16))
    if fresh:
        cache.drop_namespace()           # a clean start: every run of the demo begins cold
    lm = PrefixCachedLM(model, cache)
    system, questions = _prompts(args)
    rows = []
    for label, q in plan:
        if label.startswith("after emptying the pool"):
            cache.flush()
            cache.evict(cache.pool.num_pages)
            cache.flush()                # what the pool let go reaches the (exclusive) CPU tier
        prompt = np.concatenate([system, questions[q]])
        result = lm.prefill(prompt)
        source = ", ".join(f"{name} {n}" for name, n in result.levels.items()) or "-"
        rows.append(dict(process=process, request=label, tokens=len(prompt), cached=result.match_tokens,
                         source=source, ttft_ms=result.timings["ttft"] * 1e3))
    cache.close()
    return rows


def _in_child(args: argparse.Namespace, phase: str, cache_dir: str, remote: str | None = None) -> list[dict[str, Any]]:
    """Run one phase in a fresh Python process (the 'restart'); return its rows."""
    cmd = [sys.executable, "-m", "radixkv", "demo", "--phase", phase, "--cache-dir", cache_dir,
           "--system-tokens", str(args.system_tokens), "--question-tokens", str(args.question_tokens),
           "--threads", str(args.threads)]
    if remote:
        cmd += ["--endpoint", remote]
    if args.config:
        cmd += ["--config", args.config]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"demo phase {phase!r} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line[len(_ROW):]) for line in out.stdout.splitlines() if line.startswith(_ROW)]


def _table(rows: list[dict[str, Any]]) -> str:
    cold = rows[0]["ttft_ms"]
    lines = [f"{'process':<16} {'request':<36} {'tokens':>6} {'cached':>6} {'cached KV came from':<22} "
             f"{'TTFT ms':>8} {'vs cold':>7}", "-" * 108]
    for r in rows:
        lines.append(f"{r['process']:<16} {r['request']:<36} {r['tokens']:>6} {r['cached']:>6} {r['source']:<22} "
                     f"{r['ttft_ms']:>8.1f} {cold / r['ttft_ms']:>6.1f}x")
    return "\n".join(lines)


_PLANS = {
    "first": [("1 cold: first request", 0), ("2 same system prompt", 1), ("3 same system prompt", 2),
              ("after emptying the pool: 4", 3)],
    "restart": [("5 restarted process", 4), ("6 same system prompt", 5)],
    "s3-writer": [("7 instance A, cold", 6)],
    "s3-reader": [("8 instance B, same system prompt", 7)],
}


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv demo``: requests sharing one system prompt served through the cache, then the
    table of TTFT and where each request's prefix came from (see the module docstring); 0.  ``--phase``
    (internal) runs one phase and prints its rows for the parent; a failed phase raises
    ``RuntimeError`` with the end of its stderr.  Cost: four prefills of a prompt of
    ``--system-tokens`` + ``--question-tokens`` tokens here and two in a restarted process; with
    ``--cross-instance``, moto's S3 server and one prefill in each of two more processes."""
    ap = Parser(prog="python -m radixkv demo", description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", default=None, help="where the LMDB tier lives (default: a new temporary dir)")
    ap.add_argument("--config", default=None, help="build the cache from this YAML/JSON file (see radixkv.config)")
    ap.add_argument("--cross-instance", action="store_true",
                    help="also share the prefix between two processes through a local S3 server (moto)")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: small forwards on a shared machine time best on one)")
    ap.add_argument("--phase", choices=sorted(_PLANS), help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:                                 # a child process: print rows for the parent
        for row in _serve(args, args.phase, _PLANS[args.phase], remote=args.endpoint,
                          fresh=args.phase in ("first", "s3-writer")):
            print(_ROW + json.dumps(row), flush=True)
        return 0

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="radixkv-demo-") as tmp:
        args.cache_dir = args.cache_dir or tmp
        m = MODEL
        print(f"radixkv demo: a random-weight Llama ({m['num_layers']} layers, hidden {m['hidden_size']}, "
              f"{m['num_heads']} query / {m['num_kv_heads']} KV heads, fp32) on CPU, {args.threads} thread(s); a {args.system_tokens}-token "
              f"system prompt shared by every request, {args.question_tokens}-token questions; "
              f"tiers: {'from ' + args.config if args.config else 'CPU memory, then LMDB in ' + args.cache_dir}",
              flush=True)
        rows = _serve(args, "engine", _PLANS["first"], fresh=True)
        rows += _in_child(args, "restart", args.cache_dir)
        if args.cross_instance:
            from radixkv.tools.s3server import CREDENTIALS, MotoServer

            os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
            with MotoServer() as server:
                server.client().create_bucket(Bucket="radixkv-demo")
                rows += _in_child(args, "s3-writer", os.path.join(tmp, "instance-a"), server.endpoint_url)
                rows += _in_child(args, "s3-reader", os.path.join(tmp, "instance-b"), server.endpoint_url)
    print(_table(rows))
    print(f"(TTFT = prefix match and load + copy into the model's cache + forward of the uncached tokens; "
          f"'vs cold' against request 1; {time.perf_counter() - t0:.0f} s in all)")
    return 0
