"""Hash benchmark: chained chunk keys, M tokens/s, beside one xxh3 over the whole buffer.

    python -m radixkv.bench hash --out benchmarks/results/hash_cpu.txt

128K tokens at chunk sizes 16 and 256, from an int32 numpy array and from a Python list; the
limit is a single xxh3-128 over the same bytes (no chaining, no per-chunk calls), measured in the
same run.  Target: >= 500 M tokens/s at chunk 256 from an array.
"""

from __future__ import annotations


import numpy as np
import xxhash

from radixkv.bench import Report, median_seconds, out_file
from radixkv.core.hashing import Namespace, chunk_keys
from radixkv.tools._args import Parser

TARGET = 500.0  # M tokens/s, chunk 256, from an array


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench hash``: chained chunk keys of ``--tokens`` tokens at chunk sizes 16 and
    256, from an int32 array and from a list, beside one xxh3-128 over the same bytes, and the target;
    0.  Cost: five timings, each the median of ``--repeat`` hash passes over all the tokens."""
    ap = Parser(prog="python -m radixkv.bench hash", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--out", type=out_file, help="also write the report to this file")
    args = ap.parse_args(argv)
    say = Report("hash", argv)
    ns = Namespace(model="bench")
    array = np.random.default_rng(0).integers(0, 32_000, args.tokens, dtype=np.int32)
    as_list = array.tolist()
    raw = array.tobytes()
    limit = args.tokens / median_seconds(lambda: xxhash.xxh3_128_digest(raw), args.repeat) / 1e6
    say(f"{args.tokens} tokens; limit (one xxh3-128 over the buffer): {limit:,.0f} M tokens/s")
    say(f"{'chunk':>5} {'source':>6} {'M tok/s':>9} {'of limit':>9}")
    headline = 0.0
    for chunk in (16, 256):
        for name, src in (("array", array), ("list", as_list)):
            rate = args.tokens / median_seconds(lambda: chunk_keys(src, chunk, ns), args.repeat) / 1e6
            say(f"{chunk:>5} {name:>6} {rate:>9,.0f} {rate / limit:>9.1%}")
            if chunk == 256 and name == "array":
                headline = rate
    say(f"target: >= {TARGET:.0f} M tokens/s at chunk 256 from an array: "
        f"{'PASS' if headline >= TARGET else 'FAIL'} ({headline:,.0f})")
    say.save(args.out)
    return 0
