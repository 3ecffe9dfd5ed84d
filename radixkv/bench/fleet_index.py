"""Fleet index benchmark: lookups of a 32K-token prompt over a fleet, events applied/s, and the
bytes a held block costs; the prompt's vLLM block hashes timed beside the lookup.

    python -m radixkv.bench fleet_index --instances 16 --blocks 1000000 --out benchmarks/results/fleet_index_cpu.txt

The prompt is 2,048 blocks (32K tokens at block size 16) of one chain of 64-bit hashes, as vLLM's
events carry them.  Each of ``--instances`` instances holds ``--blocks`` distinct blocks: instance
i the first (i + 1) / n of the prompt on GPU, the odd ones the whole prompt on CPU too, and the
rest random chains of 64 (applied as ``BlockStored`` batches of ``--batch`` blocks: the events/s
row; the hashes are made before the clock starts, the index's queued events are applied before
it stops).  Lookups (median of ``--repeat``): the whole prompt (every instance matches, one to the
end), a prompt that diverges half-way, one whose first block nobody holds; each from a list of
ints and from a ``numpy.uint64`` array (the list's conversion is the difference), with the active
backend (the extension's one-pass walk where it is loaded, else numpy), the numpy path beside it,
and ``lookup_spread``.  Hashing: the
same prompt's tokens through ``vllm_block_hashes`` (vLLM's default sha256, and xxhash), apart
from the lookup.  Memory: the full fleet's arrays (``Index.nbytes``) and the process's resident
growth, per held block; and tracemalloc's count of everything the index keeps, for
``--memory-blocks`` blocks in one instance and for the same blocks held by every instance.
"""

from __future__ import annotations

import os
import random
import time
import tracemalloc
from typing import Callable

import numpy as np

from radixkv.bench import Report, median_seconds, out_file
from radixkv.core import ops
from radixkv.fleet.events import BlockStored, EventBatch
from radixkv.fleet.hashing import vllm_block_hashes
from radixkv.fleet.index import Index
from radixkv.tools._args import Parser


def stored(hashes: list[int], parent: int | None, medium: str) -> EventBatch:
    """One ``BlockStored`` batch of ``hashes`` (block size 16, no token ids) after ``parent`` on
    ``medium``, as vLLM's events carry it.  O(len(hashes))."""
    hs: list[bytes | int] = list(hashes)
    return EventBatch(ts=0.0, events=[BlockStored(block_hashes=hs, parent_block_hash=parent, token_ids=[],
                                                  block_size=16, lora_id=None, medium=medium, lora_name=None)])


def chains(rng: random.Random, blocks: int, length: int = 64) -> list[list[int]]:
    """``blocks`` random 64-bit hashes in chains of ``length``."""
    flat = np.random.default_rng(rng.getrandbits(32)).integers(0, 2**64, blocks, dtype=np.uint64, endpoint=False)
    hs = flat.tolist()
    return [hs[i:i + length] for i in range(0, blocks, length)]


def feed(idx: Index, instance: str, seq: int, chain_list: list[list[int]], medium: str) -> int:
    """Apply each chain as one batch; returns the next sequence number."""
    for c in chain_list:
        idx.apply(instance, seq, stored(c, None, medium))
        seq += 1
    return seq


def memory(build: Callable[[], Index]) -> int:
    """Bytes the index built by ``build`` keeps, its hashes included (tracemalloc, after the
    events are dropped)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx = build()
        len(idx)                                   # its queued events applied
        kept = tracemalloc.get_traced_memory()[0] - base
        del idx
    finally:
        tracemalloc.stop()
    return kept


def rss() -> int:
    """The process's resident bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench fleet_index``: the index of a fleet built from events, then the lookup,
    events/s, hashing and memory rows (see the module docstring); 0.  ``--blocks`` below
    ``--prompt-blocks`` is refused.  Cost: ``--instances`` x ``--blocks`` blocks applied as events,
    ``--repeat`` timed lookups per row, and two more indexes of ``--memory-blocks`` blocks under
    tracemalloc."""
    ap = Parser(prog="python -m radixkv.bench fleet_index", description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000, help="distinct blocks per instance (1000000: the headline)")
    ap.add_argument("--prompt-blocks", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64, help="blocks a BlockStored batch")
    ap.add_argument("--memory-blocks", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=201)
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("fleet_index", argv)
    rng = random.Random(0)
    n, k, b = args.prompt_blocks, args.instances, args.batch
    if args.blocks < n:
        ap.error("--blocks must be at least --prompt-blocks")
    prompt = [rng.getrandbits(64) for _ in range(n)]
    idx = Index()
    rss0 = rss()
    applied, spent = 0, 0.0
    for i in range(k):
        name, seq = f"engine-{i}", 0
        cut = n * (i + 1) // k
        batches = [stored(c, None, "GPU") for c in chains(rng, args.blocks - cut, b)]     # made off the clock
        batches += [stored(prompt[s:min(s + b, cut)], prompt[s - 1] if s else None, "GPU") for s in range(0, cut, b)]
        if i % 2:
            batches += [stored(prompt[s:s + b], prompt[s - 1] if s else None, "CPU") for s in range(0, n, b)]
        t0 = time.perf_counter()
        for batch in batches:
            idx.apply(name, seq, batch)
            seq += 1
        len(idx)                                   # the queued events applied, on the clock
        spent += time.perf_counter() - t0
        applied += sum(len(getattr(bt.events[0], "block_hashes", ())) for bt in batches)
        del batches
    grown = rss() - rss0
    holdings = sum(idx.blocks(name) for name in idx.instances())
    say(f"{k} instances x {args.blocks:,} blocks: {holdings:,} held blocks, {len(idx):,} distinct; "
        f"{applied:,} blocks stored in batches of {b}: {applied / spent / 1e6:.2f} M blocks/s applied")
    say(f"memory: {idx.nbytes() / holdings:.1f} bytes a held block in the index's arrays "
        f"({idx.nbytes() / 2**20:,.0f} MiB); the process grew {grown / holdings:.1f} bytes a held block")
    say(f"prompt: {n} blocks ({n * 16:,} tokens at block size 16)")
    full = idx.lookup(prompt)
    assert len(full) == k and max(m.blocks for m in full.values()) == n, full
    assert all(full[f"engine-{j}"].blocks == (n if j % 2 else n * (j + 1) // k) for j in range(k)), full
    say(f"answer for the whole prompt: {', '.join(f'{name}={m.blocks}/{m.medium}' for name, m in full.items())}")
    miss = [rng.getrandbits(64)] + prompt[1:]
    half = prompt[:n // 2] + [rng.getrandbits(64) for _ in range(n - n // 2)]
    walk = ops.backend() != "torch"
    say(f"lookup backend: {'the extension (cuda_ext/index_walk.cpp, one pass in C)' if walk else 'numpy'} "
        f"(radixkv.core.ops backend {ops.backend()}); the numpy path beside it")
    say(f"{'lookup (median)':<34} {'from a list':>12} {'from an array':>14} {'numpy, array':>13} "
        f"{'spread, array':>14}")
    for label, query in (("whole prompt (all match, 1 to end)", prompt),
                         ("diverges half-way", half),
                         ("first block unknown", miss)):
        arr = np.array(query, dtype=np.uint64)
        assert idx.lookup(arr) == idx.lookup(query)
        s_list = median_seconds(lambda: idx.lookup(query), args.repeat)
        s_arr = median_seconds(lambda: idx.lookup(arr), args.repeat)
        s_spread = median_seconds(lambda: idx.lookup_spread(arr), args.repeat)
        idx.native = False
        try:
            assert idx.lookup(arr) == idx.lookup(query) and idx.lookup_spread(arr) == idx.lookup_spread(query)
            s_np = median_seconds(lambda: idx.lookup(arr), args.repeat)
        finally:
            idx.native = True
        if walk:
            assert idx.lookup(arr) == idx.lookup(query)
        say(f"{label:<34} {s_list * 1e6:>9.1f} us {s_arr * 1e6:>11.1f} us {s_np * 1e6:>10.1f} us "
            f"{s_spread * 1e6:>11.1f} us")
    tokens = [rng.randrange(32_000) for _ in range(n * 16)]
    assert vllm_block_hashes(tokens, 16, seed="0", as_int=True)[:1] != prompt[:1]
    for algo in ("sha256", "xxhash"):
        s = median_seconds(lambda: vllm_block_hashes(tokens, 16, algo=algo, seed="0", as_int=True),  # type: ignore[arg-type]
                           max(3, args.repeat // 20))
        say(f"hashing the prompt (vllm_block_hashes, {algo}, as_int): {s * 1e6:,.0f} us "
            f"({s * 1e9 / n:,.0f} ns a block)")
    del idx

    m = args.memory_blocks

    def one_instance() -> Index:
        i = Index(max_blocks=m)
        feed(i, "a", 0, chains(random.Random(1), m), "GPU")
        return i

    def all_instances() -> Index:
        i = Index(max_blocks=m)
        shared = chains(random.Random(2), m // k)
        for j in range(k):
            feed(i, f"engine-{j}", 0, shared, "GPU")
        return i

    per_block = memory(one_instance) / m
    per_holding = memory(all_instances) / (m // k * k)
    say(f"tracemalloc: {per_block:.0f} bytes a block ({per_block * 1e6 / 2**20:.0f} MiB per million blocks), "
        f"{m:,} distinct blocks in one instance; {per_holding:.0f} bytes a holding "
        f"({per_holding * 1e6 / 2**20:.0f} MiB per million) when {k} instances hold the same {m // k:,} blocks")
    say.save(args.out)
    return 0
