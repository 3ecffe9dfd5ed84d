"""TTFT benchmark: time to first token without the cache and with the prefix at each local level.

Command that produced ``benchmarks/results/ttft_cpu.txt``::

    python -m radixkv.bench ttft --out benchmarks/results/ttft_cpu.txt

The table of section 5 of the prefix-caching article, on this machine: prompts of a 2K, 4K and 8K
token prefix and a 256-token question, on a random-weight Llama (grouped-query attention, fp32,
built from a config and a seed) served by ``radixkv.integrations.transformers.PrefixCachedLM``.
For each prefix, in interleaved rounds (each with a new question, so only the prefix is cached):

* **no cache**: the model's prefill of the whole prompt, into a fresh ``DynamicCache``;
* **compute-only**: the question's prefill over a ``DynamicCache`` already holding the prefix's KV
  (no radixkv involved): the limit any prefix cache can reach;
* **pool**: ``PrefixCachedLM.prefill`` with the prefix resident in the page pool;
* **cpu tier**: the same after the pool was emptied, the prefix loaded from a ``CpuTier``;
* **lmdb (restart)**: in a fresh process, on the LMDB path the first process wrote, the pool
  empty before every round, so every prefix is read from LMDB.  That process warms the model up on
  an unrelated prompt first and times its own compute-only limit, which its row is compared with.
  The OS page cache is not dropped (that needs root): the file's pages are likely in memory.

TTFT with the cache is ``match`` (hash, lookups, tier loads and verification, scatter into the
pool) + ``gather`` (pool pages into the model's ``DynamicCache``) + the question's forward: what an
engine pays before it has the first token.  ``store`` (alloc, scatter of the question's KV into the
pool, insert, write-through queueing) comes after the first token and is shown apart.  Queued tier
writes are flushed between timings.  The theoretical speedup is the article's (P+Q)/(2Q).

Sizing.  What a prefix cache buys depends on how prefill FLOPs split between the projections
(linear in the prompt: a cached prefix saves (P+Q)/Q of them) and attention (quadratic: it saves
about (P+Q)/(2Q)).  In Llama-2-7B at 8K the projections are ~85% of prefill; in a tiny model with a
standard MLP (hidden 256) attention dominates, and the ratio stays near (P+Q)/(2Q).  The default
model (2 layers, hidden 512, 8 query / 2 KV heads of 64, MLP 8192) puts ~75% of an 8K prefill in
the projections, closer to a real LLM, while the whole run takes about two minutes on two
cores.  One torch thread by default: on a shared machine a two-thread op waits for its slower
thread, which makes the short timings jumpy.  ``--layers``, ``--hidden`` etc. change the model.
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
from typing import Any, Callable

import numpy as np
import torch

from radixkv.bench import Report, out_file
from radixkv.tools._args import Parser

TARGET_REDUCTION = {2048: 0.80, 4096: 0.85, 8192: 0.95}
TARGET_SPEEDUP_8K = 16.5
TARGET_OF_COMPUTE = {"cpu tier": 0.90, "lmdb (restart)": 0.75}
LEVELS = ("no cache", "compute-only", "pool", "cpu tier", "compute-only (restart)", "lmdb (restart)")
_RESTARTED = ("compute-only (restart)", "lmdb (restart)")
PHASES = ("ttft", "match", "gather", "forward", "store")


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m radixkv.bench ttft", description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", default="2048,4096,8192", help="prefix lengths in tokens (default 2048,4096,8192)")
    p.add_argument("--question", type=int, default=256, help="question length in tokens (default 256)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per prefix (default 5, after one warm-up)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=8192, help="MLP width (default 8192: see the docstring)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=out_file, help="also write the report to this file")
    return p


# ------------------------------------------------------------------------------------ set-up


def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and its layout, the same in every process (same seed, same sizes)."""
    from radixkv.integrations.transformers import layout_for, random_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_model("llama", seed=args.seed, num_layers=args.layers, hidden_size=args.hidden,
                         num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, max_positions=max(_prefixes(args)) + args.question + 1)
    return model, layout_for(model, page_size=args.page_size)


def _prefixes(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.prefixes).split(",") if x]


def _prompts(args: argparse.Namespace, prefix_len: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The prefix and ``repeat + 1`` questions (the first for the warm-up) for one prefix length."""
    rng = np.random.default_rng([args.seed, prefix_len])
    prefix = rng.integers(0, args.vocab, prefix_len)
    return prefix, [rng.integers(0, args.vocab, args.question) for _ in range(args.repeat + 1)]


def _make_cache(args: argparse.Namespace, model: Any, layout: Any, tiers: list[Any]) -> Any:
    from radixkv import PrefixCache
    from radixkv.integrations.transformers import namespace_for

    tokens = sum(_prefixes(args)) + 2 * (args.repeat + 2) * args.question * len(_prefixes(args))
    return PrefixCache(layout, num_pages=-(-tokens // args.page_size) + 64, namespace=namespace_for(model),
                       tiers=tiers, chunk_size=args.chunk_size)


def _empty_pool(cache: Any) -> None:
    """Finish queued tier writes, then evict every page (an exclusive CPU tier gets them then), so
    that the next match reads the tiers."""
    cache.flush()
    cache.evict(cache.pool.num_pages)
    cache.flush()


def _prefix_kv(lm: Any, model_cache: Any, prefix_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the first ``prefix_len`` tokens of K and V held by a ``DynamicCache``."""
    from radixkv.integrations.transformers import layer_kv

    out = []
    for layer in range(lm.cache.layout.num_layers):
        k, v = layer_kv(model_cache, layer)
        out.append((k[:, :, :prefix_len].clone(), v[:, :, :prefix_len].clone()))
    return out


def _compute_only(lm: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], question: np.ndarray,
                  prefix_len: int) -> tuple[float, torch.Tensor]:
    """The question's forward over a ``DynamicCache`` holding the prefix (built untimed)."""
    model_cache = lm.new_model_cache()
    for layer, (k, v) in enumerate(kv):
        model_cache.update(k, v, layer)
    t0 = time.perf_counter()
    logits = lm.forward(torch.as_tensor(question), model_cache, start=prefix_len)
    return time.perf_counter() - t0, logits[-1]


def _no_cache(lm: Any, prompt: np.ndarray) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    logits = lm.forward(torch.as_tensor(prompt), lm.new_model_cache(), start=0)
    return time.perf_counter() - t0, logits[-1]


def _cached(lm: Any, prompt: np.ndarray, expect: dict[str, int]) -> Any:
    """``lm.prefill(prompt)``, checking that the prefix came from the level the round is about."""
    result = lm.prefill(prompt)
    if result.levels != expect:
        raise RuntimeError(f"expected the prefix from {expect}, got {result.levels}: the benchmark is broken")
    return result


def _tier_bytes(args: argparse.Namespace, layout: Any) -> int:
    """Byte budget of each tier: every prefix and question twice over (the same in both processes)."""
    return 2 * layout.token_bytes * (sum(_prefixes(args)) + 4 * args.question * (args.repeat + 2))


def _reference_path(workdir: str, prefix_len: int, r: int) -> str:
    """Where the first process leaves no cache's last-token logits of round ``r`` for the restart."""
    return os.path.join(workdir, f"logits_{prefix_len}_{r}.npy")


class _Record:
    """Timings (seconds) per level and phase, and the largest logit difference from no cache."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, list[float]]] = {}
        self.diff: dict[str, float] = {}

    def add(self, level: str, timings: dict[str, float], logits: torch.Tensor, reference: torch.Tensor) -> None:
        for phase, seconds in timings.items():
            self.times.setdefault(level, {}).setdefault(phase, []).append(seconds)
        diff = float((logits.float() - reference.float()).abs().max())
        self.diff[level] = max(self.diff.get(level, 0.0), diff)

    def median(self, level: str, phase: str = "ttft") -> float:
        return statistics.median(self.times[level][phase])

    def as_json(self) -> dict[str, Any]:
        return {"times": self.times, "diff": self.diff}


# ------------------------------------------------------------------------- the two processes


def _run_main_process(args: argparse.Namespace, workdir: str,
                      tick: Callable[[], None]) -> tuple[dict[int, _Record], Any, Any]:
    """No cache, compute-only, pool and CPU tier, interleaved; writes LMDB for the restart."""
    from radixkv.backends import CpuTier, LmdbTier
    from radixkv.integrations.transformers import PrefixCachedLM

    model, layout = _setup(args)
    budget = _tier_bytes(args, layout)
    tiers = [CpuTier(max_bytes=budget), LmdbTier(os.path.join(workdir, "kv"), max_bytes=budget)]
    records: dict[int, _Record] = {}
    with _make_cache(args, model, layout, tiers) as cache:
        lm = PrefixCachedLM(model, cache)
        for prefix_len in _prefixes(args):
            prefix, questions = _prompts(args, prefix_len)
            warm = lm.prefill(np.concatenate([prefix, questions[0]]))     # computes and caches the prefix
            kv = _prefix_kv(lm, warm.model_cache, prefix_len)
            _compute_only(lm, kv, questions[0], prefix_len)                 # warm-up
            tick()
            rec = records[prefix_len] = _Record()
            for r, question in enumerate(questions[1:], start=1):
                prompt = np.concatenate([prefix, question])
                seconds, reference = _no_cache(lm, prompt)
                np.save(_reference_path(workdir, prefix_len, r), reference.numpy())
                rec.add("no cache", {"ttft": seconds}, reference, reference)
                seconds, logits = _compute_only(lm, kv, question, prefix_len)
                rec.add("compute-only", {"ttft": seconds}, logits, reference)
                cache.flush()
                result = _cached(lm, prompt, {"pool": prefix_len})
                rec.add("pool", result.timings, result.logits[-1], reference)
                _empty_pool(cache)
                result = _cached(lm, prompt, {"cpu": prefix_len})
                rec.add("cpu tier", result.timings, result.logits[-1], reference)
                tick()
    return records, model, layout


def _run_restarted_process(args: argparse.Namespace, workdir: str, tick: Callable[[], None]) -> dict[int, _Record]:
    """Run the LMDB rounds in a fresh interpreter on the same path; progress comes back line by line."""
    spec = os.path.join(workdir, "args.json")
    with open(spec, "w") as f:
        json.dump({**vars(args), "workdir": workdir}, f)
    code = "import sys; from radixkv.bench.ttft import _worker; sys.exit(_worker(sys.argv[1]))"
    proc = subprocess.Popen([sys.executable, "-c", code, spec], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    result: dict[str, Any] | None = None
    for line in proc.stdout:
        if line.startswith("tick"):
            tick()
        elif line.startswith("result "):
            result = json.loads(line[len("result "):])
    if proc.wait() != 0 or result is None:
        raise RuntimeError(f"the restarted process failed (exit code {proc.returncode})")
    records = {}
    for key, data in result.items():
        rec = records[int(key)] = _Record()
        rec.times, rec.diff = data["times"], data["diff"]
    return records


def _worker(spec_path: str) -> int:
    """The restarted process: LMDB only, pool emptied before every round; prints ticks and a result."""
    from radixkv.backends import LmdbTier
    from radixkv.integrations.transformers import PrefixCachedLM

    with open(spec_path) as f:
        spec = json.load(f)
    workdir = spec.pop("workdir")
    args = argparse.Namespace(**spec)
    model, layout = _setup(args)
    tier = LmdbTier(os.path.join(workdir, "kv"), max_bytes=_tier_bytes(args, layout))
    out: dict[int, Any] = {}
    with _make_cache(args, model, layout, [tier]) as cache:
        lm = PrefixCachedLM(model, cache)
        unrelated = np.random.default_rng([args.seed, 1]).integers(0, args.vocab, args.question + 1)
        lm.prefill(unrelated)                                  # engine warm-up: a miss, nothing of ours
        for prefix_len in _prefixes(args):
            prefix, questions = _prompts(args, prefix_len)
            rec = _Record()
            kv = None
            for r, question in enumerate(questions, start=0):
                prompt = np.concatenate([prefix, question])
                _empty_pool(cache)
                result = _cached(lm, prompt, {"lmdb": prefix_len})
                if r == 0:                                     # warm-up round: its KV gives compute-only
                    kv = _prefix_kv(lm, result.model_cache, prefix_len)
                    _compute_only(lm, kv, question, prefix_len)
                    continue
                reference = torch.from_numpy(np.load(_reference_path(workdir, prefix_len, r)))
                rec.add("lmdb (restart)", result.timings, result.logits[-1], reference)
                assert kv is not None
                seconds, logits = _compute_only(lm, kv, question, prefix_len)
                rec.add("compute-only (restart)", {"ttft": seconds}, logits, reference)
                print("tick", flush=True)
            out[prefix_len] = rec.as_json()
    print("result " + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench ttft``: time to first token for each of ``--prefixes`` without the cache
    and with the prefix at each local level (see the module docstring), a progress bar on stderr; 0.
    Cost: ``--repeat`` interleaved rounds per prefix, each a few prefills of the model, in this process
    and in a fresh one on the LMDB path (about two minutes on two cores with the defaults)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from tqdm import tqdm

    prefixes = _prefixes(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = Report("ttft", argv, echo=lambda line: tqdm.write(line, file=sys.stdout))
    say(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    workdir = tempfile.mkdtemp(prefix="radixkv-ttft-")
    steps = 2 * len(prefixes) * args.repeat + len(prefixes)
    started = time.perf_counter()
    try:
        with tqdm(total=steps, desc="ttft", unit="round", file=sys.stderr, dynamic_ncols=True) as bar:
            main_records, model, layout = _run_main_process(args, workdir, lambda: bar.update(1))
            restart_records = _run_restarted_process(args, workdir, lambda: bar.update(1))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{time.perf_counter() - started:.0f} s in all")
    _report(args, layout, model, main_records, restart_records, say)
    say.save(args.out)
    return 0


def _projection_share(config: Any, head_dim: int, tokens: int) -> float:
    """Share of the projections (attention's and the MLP's) in the FLOPs of a causal prefill of
    ``tokens`` tokens: per token and layer, 2 FLOPs per weight against 4 * width * tokens / 2."""
    h, width = config.hidden_size, config.num_attention_heads * head_dim
    weights = 2 * h * width + 2 * h * config.num_key_value_heads * head_dim + 3 * h * config.intermediate_size
    attention = 4 * width * tokens / 2
    return 2 * weights / (2 * weights + attention)


def _report(args: argparse.Namespace, layout: Any, model: Any, main_records: dict[int, _Record],
            restart_records: dict[int, _Record], say: Callable[[str], None]) -> None:
    config = model.config
    head_dim = layout.head_dim
    params = sum(p.numel() for p in model.parameters())
    say(f"model: random-weight Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads of {head_dim}, "
        f"MLP {config.intermediate_size}, vocab {config.vocab_size}, fp32, {params / 1e6:.1f} M parameters; "
        f"KV {layout.token_bytes / 1024:.1f} KiB/token")
    say("projections' share of the no-cache prefill FLOPs: " + ", ".join(
        f"{_projection_share(config, head_dim, p + args.question):.0%} at P={p}" for p in _prefixes(args)))
    say(f"prompts: prefix P in {{{', '.join(map(str, _prefixes(args)))}}} + question Q = {args.question} tokens; "
        f"page {args.page_size}, chunk {args.chunk_size} tokens; torch threads {torch.get_num_threads()}")
    say(f"medians of {args.repeat} interleaved rounds (after one warm-up), each with a new question")
    say("TTFT with the cache = match (tier load included) + gather into the DynamicCache + forward of the "
        "question; store (after the first token) apart")
    say("")
    header = (f"{'P':>5} {'level':<22} {'TTFT ms':>8} {'reduce':>7} {'speedup':>8} {'(P+Q)/2Q':>8} "
              f"{'of limit':>8} {'match':>7} {'gather':>7} {'forward':>8} {'store':>7} {'max|dlogit|':>11}")
    say(header)
    say("-" * len(header))
    verdicts: list[tuple[str, bool]] = []
    for prefix_len in _prefixes(args):
        main, restart = main_records[prefix_len], restart_records[prefix_len]
        base = main.median("no cache")
        theory = (prefix_len + args.question) / (2 * args.question)
        speedups = {}
        for level in LEVELS:
            rec, limit = (restart, "compute-only (restart)") if level in _RESTARTED else (main, "compute-only")
            ttft = rec.median(level)
            of_limit = rec.median(limit) / ttft
            speedups[level] = (1 - ttft / base, base / ttft, of_limit)
            phases = [f"{rec.median(level, ph) * 1e3:>{w}.1f}" if ph in rec.times[level] else f"{'':>{w}}"
                      for ph, w in (("match", 7), ("gather", 7), ("forward", 8), ("store", 7))]
            cached = level != "no cache"
            say(f"{prefix_len:>5} {level:<22} {ttft * 1e3:>8.1f} "
                f"{f'{1 - ttft / base:.1%}' if cached else '':>7} {f'{base / ttft:.1f}x' if cached else '':>8} "
                f"{f'{theory:.1f}x' if cached else '':>8} {f'{of_limit:.0%}' if cached else '':>8} "
                f"{' '.join(phases)} {rec.diff[level]:>11.1e}")
        target = TARGET_REDUCTION.get(prefix_len)
        if target is not None:
            worst = min(speedups[lv][0] for lv in ("pool", "cpu tier", "lmdb (restart)"))
            verdicts.append((f"P={prefix_len}: TTFT reduction >= {target:.0%} from pool, CPU tier and LMDB "
                             f"(worst {worst:.1%})", worst >= target))
        if prefix_len == 8192:
            worst = min(speedups[lv][1] for lv in ("pool", "cpu tier", "lmdb (restart)"))
            verdicts.append((f"P=8192: speedup >= {TARGET_SPEEDUP_8K}x from every local level (worst {worst:.1f}x)",
                             worst >= TARGET_SPEEDUP_8K))
            for level, share in TARGET_OF_COMPUTE.items():
                got = speedups[level][2]
                verdicts.append((f"P=8192: {level} speedup >= {share:.0%} of the compute-only speedup "
                                 f"(got {got:.0%})", got >= share))
        worst_diff = max(max(main.diff.values()), max(restart.diff.values()))
        verdicts.append((f"P={prefix_len}: last-token logits equal no-cache's within 1e-4 at every level "
                         f"(worst {worst_diff:.1e})", worst_diff <= 1e-4))
    say("")
    say("'of limit': the compute-only TTFT over this level's (in the restarted process, against its own "
        "compute-only limit); max|dlogit|: largest difference from no cache's last-token logits")
    say("lmdb (restart): a fresh process on the LMDB path the first one wrote, its pool emptied before every "
        "round; the OS page cache was not dropped")
    say("targets:")
    for text, ok in verdicts:
        say(f"  {'PASS' if ok else 'FAIL'}  {text}")


if __name__ == "__main__":
    sys.exit(main())
