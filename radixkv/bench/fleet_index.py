"""Fleet index benchmark: lookups/s of a 32K-token prompt over 8 instances, events applied/s, and
the memory a million blocks cost.

    python -m radixkv.bench fleet_index --out benchmarks/results/fleet_index_cpu.txt

The prompt is 2,048 blocks (32K tokens at block size 16) of one chain of 64-bit hashes, as vLLM's
events carry them.  Instance i (of 8) holds its first (i + 1) / 8 on GPU, the odd ones the whole
chain on CPU too, and every instance ``--background`` other blocks in chains of 64 (applied as
``BlockStored`` batches of 64 blocks: the events/s row).  Lookups: the whole prompt (every instance
matches, one up to the end: the longest walk), a prompt whose first block nobody holds, and one
that diverges half-way.  Memory: tracemalloc's count of what the index keeps after the events
are gone, for 1M distinct blocks in one instance and for 125K blocks that all 8 instances hold
(1M holdings: the holder entry is shared).
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from typing import Callable

from radixkv.bench import Report, median_seconds
from radixkv.fleet.events import BlockStored, EventBatch
from radixkv.fleet.index import Index


def stored(hashes: list[int], parent: int | None, medium: str) -> EventBatch:
    hs: list[bytes | int] = list(hashes)
    return EventBatch(ts=0.0, events=[BlockStored(block_hashes=hs, parent_block_hash=parent, token_ids=[],
                                                  block_size=16, lora_id=None, medium=medium, lora_name=None)])


def chains(rng: random.Random, blocks: int, length: int = 64) -> list[list[int]]:
    """``blocks`` random 64-bit hashes in chains of ``length``."""
    out = []
    for start in range(0, blocks, length):
        out.append([rng.getrandbits(64) for _ in range(min(length, blocks - start))])
    return out


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
        kept = tracemalloc.get_traced_memory()[0] - base
        del idx
    finally:
        tracemalloc.stop()
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench fleet_index", description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--prompt-blocks", type=int, default=2048)
    ap.add_argument("--background", type=int, default=100_000, help="other blocks per instance")
    ap.add_argument("--memory-blocks", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("fleet_index", argv)
    rng = random.Random(0)
    n, k = args.prompt_blocks, args.instances
    prompt = [rng.getrandbits(64) for _ in range(n)]
    idx = Index()
    background = [chains(rng, args.background) for _ in range(k)]     # made outside the timing
    applied, t0 = 0, time.perf_counter()
    for i in range(k):
        name = f"engine-{i}"
        seq = feed(idx, name, 0, background[i], "GPU")
        cut = n * (i + 1) // k
        for start in range(0, cut, 64):                      # the prompt's chain, in batches of 64
            part = prompt[start:min(start + 64, cut)]
            idx.apply(name, seq, stored(part, prompt[start - 1] if start else None, "GPU"))
            seq += 1
        applied += args.background + cut
        if i % 2:
            for start in range(0, n, 64):
                idx.apply(name, seq, stored(prompt[start:start + 64], prompt[start - 1] if start else None, "CPU"))
                seq += 1
            applied += n
    build_s = time.perf_counter() - t0
    del background
    idx.check()
    say(f"{k} instances, {len(idx):,} distinct blocks, {applied:,} blocks stored in batches of 64: "
        f"{applied / build_s / 1e6:.2f} M blocks/s applied")
    say(f"prompt: {n} blocks ({n * 16:,} tokens at block size 16)")
    full = idx.lookup(prompt)
    assert len(full) == k and max(m.blocks for m in full.values()) == n, full
    say(f"answer for the whole prompt: {', '.join(f'{name}={m.blocks}/{m.medium}' for name, m in sorted(full.items()))}")
    miss = [rng.getrandbits(64)] + prompt[1:]
    half = prompt[:n // 2] + [rng.getrandbits(64) for _ in range(n - n // 2)]
    say(f"{'lookup':<34} {'lookups/s':>10} {'us each':>9}")
    for label, query in (("whole prompt (all match, 1 to end)", prompt),
                         ("diverges half-way", half),
                         ("first block unknown", miss)):
        s = median_seconds(lambda: idx.lookup(query), args.repeat)
        say(f"{label:<34} {1 / s:>10,.0f} {s * 1e6:>9.1f}")
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
    say(f"memory: {per_block:.0f} bytes a block ({per_block * 1e6 / 2**20:.0f} MiB per million blocks), "
        f"1M distinct blocks in one instance; {per_holding:.0f} bytes a holding "
        f"({per_holding * 1e6 / 2**20:.0f} MiB per million) when {k} instances hold the same {m // k:,} blocks")
    say.save(args.out)
    return 0
