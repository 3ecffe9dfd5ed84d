"""Block-copy bandwidth: ``gather_pages`` / ``scatter_pages`` and ``gather_blocks`` / ``scatter_blocks``
beside memcpy and torch idioms.

Command that produced ``benchmarks/results/copy_cpu.txt``::

    python -m radixkv.bench copy --out benchmarks/results/copy_cpu.txt

Each repetition moves one 256-token chunk between random pages of a 32-layer, 8-KV-head,
head-dim-128 fp16 pool of 2.5 GiB (page size 16: a chunk is 32 MiB in 1,024 runs of 32 KiB) and
a contiguous chunk buffer, with fresh page ids every repetition.  Beside it, in the same run and
on the same threads:

* the limit: a memcpy of the same bytes to (or from) the same chunk buffer, from (or to) a random
  offset of the pool, which is far larger than the caches.  ATen's parallel ``copy_`` and libc's
  ``memmove`` split over as many Python threads are both timed; the faster is the limit.  A memcpy
  between two buffers of its own, copied again right before, is shown as "hot" for comparison.
* ``index_select`` per layer, advanced indexing ``pool[:, :, ids]``, and a Python loop of
  per-page copies (one ``copy_`` per layer, K/V side and page: what an engine without a block-copy
  kernel writes).
* ``gather_blocks`` / ``scatter_blocks`` on an engine's own per-layer tensors, in the same memory
  as the pool: vLLM's FlashAttention layout ``[2, num_blocks, block_size, H, D]`` per layer
  (contiguous blocks), and the non-contiguous ``[2, num_blocks, H, block_size, D]`` per layer
  (a block is ``block_size * H`` runs of ``D`` elements in the buffer's token order), each beside
  the torch fallback on the same layout.

Variants are timed in interleaved rounds, in a new random order each round; a timing is a burst
of calls in a row (each on fresh pages and offsets) after a read of a buffer four times the size
of the last-level cache, which lets the previous variant's writes drain and leaves every variant
the same caches.  The ratios are medians of per-round ratios.  The machine must be otherwise idle:
a busy core stalls every parallel variant alike, and the ratios drift towards 1.

Targets on CPU: gather and scatter at >= 80% of the limit and >= 3x the per-page loop; the block
ops on the non-contiguous layout at least as fast as the torch fallback on it.  On a GPU
(``--device cuda``): >= 80% of a ``cudaMemcpy`` (``copy_``) of the same bytes, device to device,
and for the pinned-host path device to host and back.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, TypeVar

import numpy as np
import torch

from radixkv.core import ops
from radixkv.bench import Report, out_file
from radixkv.tools._args import Parser

TARGET_OF_LIMIT = 0.80
TARGET_OVER_LOOP = 3.0
TARGET_OVER_FALLBACK = 1.0  # the block ops against the torch fallback on the same layout
FLUSH_BYTES = 128 << 20  # read between timings: four times the last-level cache of the machine here
T = TypeVar("T")


class Variant(NamedTuple):
    name: str
    fn: Callable[[], object]
    hot: bool = False  # run once more, untimed, right before: caches are then warm, not flushed


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench copy``: the block copies timed beside memcpy and the torch idioms (see the
    module docstring); 0, or 2 for ``--device cuda`` without a GPU.  Cost: ``--repeat`` interleaved
    rounds of every variant, each timing a burst of ``--burst`` one-chunk copies after a cache flush,
    over a pool of ``--pool-gib`` GiB; ``--quick`` is a smoke test on a tiny pool."""
    p = Parser(prog="python -m radixkv.bench copy", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--pool-gib", type=float, default=2.5, help="pool size in GiB (default 2.5)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--repeat", type=int, default=21, help="interleaved rounds (default 21)")
    p.add_argument("--burst", type=int, default=4, help="calls in a row per timing (default 4)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="tiny pool, few rounds: a smoke test, not a measurement")
    p.add_argument("--out", type=out_file, help="also write the report to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.pool_gib, args.layers, args.repeat, args.burst = 1 / 64, 2, 2, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no GPU here", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    say = Report("copy", sys.argv[1:] if argv is None else argv)
    say(f"radixkv.core.ops backend: {ops.backend()}")
    load_before = os.getloadavg()[0]
    for line in _run_cuda(args) if args.device == "cuda" else _run_cpu(args):
        say(line)
    # Other processes on the machine stall every parallel variant alike: the ratios drift towards 1.
    say(f"\nload average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} cores")
    say.save(args.out)
    return 0


def _interleaved(variants: list[Variant], repeat: int, burst: int, flush: Callable[[], object],
                 sync: Callable[[], object]) -> dict[str, list[float]]:
    """Seconds per call of each variant in each of ``repeat`` rounds that run every variant once.

    A variant's timing is a burst of ``burst`` calls in a row (each on fresh pages, as a run of
    chunk stores would be) after the flush, so that its Python code, which the flush also evicts,
    is not timed cold every time.  Each round runs the variants in a new random order, so that none
    always follows the same neighbour (whose writes, still draining, would slow it every time).
    """
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    rng = np.random.default_rng(2)
    for round_ in range(repeat + 1):  # round 0 warms up
        for k in rng.permutation(len(variants)):
            v = variants[k]
            flush()
            if v.hot:
                v.fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(burst):
                v.fn()
            sync()
            if round_:
                times[v.name].append((time.perf_counter() - t0) / burst)
    return times


def _ratio(times: dict[str, list[float]], name: str, *baselines: str) -> float:
    """Median over rounds of (the fastest baseline's seconds / ``name``'s seconds) in that round.

    Per-round ratios cancel what drifts between rounds (the machine's load), which a ratio of
    overall medians would not.
    """
    return statistics.median(min(times[b][k] for b in baselines) / t for k, t in enumerate(times[name]))


def _cycle(items: list[T]) -> Callable[[], T]:
    """A function that returns the items in turn, round and round."""
    return itertools.cycle(items).__next__


def _setup(args: argparse.Namespace, device: str) -> tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor],
                                                            Callable[[], torch.Tensor]]:
    """The pool, the chunk buffer, fresh random page ids, and a random pool span of a chunk's bytes."""
    n = args.chunk // args.page_size
    page_bytes = args.layers * 2 * args.page_size * args.heads * args.head_dim * 2
    num_pages = max(4 * n, int(args.pool_gib * (1 << 30)) // page_bytes)
    kv = torch.empty((args.layers, 2, num_pages, args.page_size, args.heads, args.head_dim), dtype=torch.float16,
                     device=device)
    kv.view(torch.uint8).fill_(7)  # touch every page, so that no timing includes a page fault
    buf = torch.ones((args.layers, 2, args.chunk, args.heads, args.head_dim), dtype=torch.float16, device=device)
    rng = np.random.default_rng(0)
    ids = [torch.from_numpy(rng.choice(num_pages, n, replace=False)).to(device) for _ in range(64)]
    flat_pool, nbytes = kv.view(torch.uint8).view(-1), buf.numel() * 2
    starts = [int(o) * 4096 for o in rng.integers(0, (flat_pool.numel() - nbytes) // 4096, 64)]
    spans = [flat_pool[o:o + nbytes] for o in starts]
    return kv, buf, _cycle(ids), _cycle(spans)


def _header(kv: torch.Tensor, buf: torch.Tensor, args: argparse.Namespace) -> list[str]:
    runs = 2 * args.layers * (args.chunk // args.page_size)
    nbytes = buf.numel() * buf.element_size()
    return [f"pool {tuple(kv.shape)} {kv.dtype} = {kv.numel() * kv.element_size() / (1 << 30):.2f} GiB; "
            f"chunk of {args.chunk} tokens = {nbytes / (1 << 20):g} MiB in {runs} runs of "
            f"{nbytes // runs / 1024:g} KiB; {torch.get_num_threads()} torch threads; "
            f"medians of {args.repeat} interleaved rounds of {args.burst} calls", ""]


def _report(times: dict[str, list[float]], nbytes: int, checks: list[tuple[str, float, float | None]]) -> list[str]:
    """Bandwidth of every variant, then the ratios; a ratio without a target is shown for information."""
    width = max(40, *(len(name) + 1 for name in times), *(len(c[0]) + 1 for c in checks))
    lines = [f"{name:<{width}} {nbytes / statistics.median(t) / 1e9:7.2f} GB/s" for name, t in times.items()]
    lines += ["", "ratios: medians of per-round ratios"]
    return lines + [f"{name:<{width}} {ratio:7.2f}" + ("" if target is None else
                    f"  (target >= {target:.2f})  {'PASS' if ratio >= target else 'FAIL'}")
                    for name, ratio, target in checks]


def _run_cpu(args: argparse.Namespace) -> list[str]:
    kv, buf, next_ids, next_span = _setup(args, "cpu")
    ps, layers = args.page_size, args.layers
    nbytes = buf.numel() * buf.element_size()
    flat_buf = buf.view(torch.uint8).view(-1)
    # The hot memcpy has buffers of its own: copied twice in a row, they would otherwise be kept in
    # the last-level cache (which protects lines used again) and flatter the next cold copy.
    hot_src, hot_dst = torch.ones_like(flat_buf), torch.zeros_like(flat_buf)
    flush_buf = torch.ones(FLUSH_BYTES // 4)
    threads = ThreadPoolExecutor(args.threads)
    buf_pages = buf.view(layers, 2, args.chunk // ps, ps, args.heads, args.head_dim)

    def memmove(dst: int, src: int) -> None:
        step = -(-nbytes // args.threads)
        parts = [threads.submit(ctypes.memmove, dst + k * step, src + k * step, min(step, nbytes - k * step))
                 for k in range(args.threads)]
        for part in parts:
            part.result()

    def index_select_gather() -> None:
        ids = next_ids()
        for layer in range(layers):
            torch.index_select(kv[layer], 1, ids, out=buf_pages[layer])

    def index_copy_scatter() -> None:
        ids = next_ids()
        for layer in range(layers):
            kv[layer].index_copy_(1, ids, buf_pages[layer])

    def fancy_scatter() -> None:
        kv[:, :, next_ids()] = buf_pages

    def loop_gather() -> None:
        pages = next_ids().tolist()
        for layer in range(layers):
            for side in range(2):
                for i, page in enumerate(pages):
                    buf[layer, side, i * ps:(i + 1) * ps].copy_(kv[layer, side, page])

    def loop_scatter() -> None:
        pages = next_ids().tolist()
        for layer in range(layers):
            for side in range(2):
                for i, page in enumerate(pages):
                    kv[layer, side, page].copy_(buf[layer, side, i * ps:(i + 1) * ps])

    gather = f"gather_pages ({ops.backend()})"
    scatter = f"scatter_pages ({ops.backend()})"
    block_variants = [*_block_variants("[2,nb,bs,H,D]", list(kv.unbind(0)), buf, next_ids),
                      *_block_variants("[2,nb,H,bs,D]", _vllm_strided(kv), buf, next_ids)]
    variants = [
        Variant("memcpy hot (same buffers again)", lambda: hot_dst.copy_(hot_src), hot=True),
        Variant("memcpy cold read, ATen copy_", lambda: flat_buf.copy_(next_span())),
        Variant("memcpy cold read, libc memmove", lambda: memmove(flat_buf.data_ptr(), next_span().data_ptr())),
        Variant("memcpy cold write, ATen copy_", lambda: next_span().copy_(flat_buf)),
        Variant("memcpy cold write, libc memmove", lambda: memmove(next_span().data_ptr(), flat_buf.data_ptr())),
        Variant(gather, lambda: ops.gather_pages(kv, next_ids(), buf)),
        Variant(scatter, lambda: ops.scatter_pages(buf, kv, next_ids())),
        Variant("torch fallback gather", lambda: ops._gather_torch(kv, next_ids(), buf, 0)),
        Variant("torch fallback scatter", lambda: ops._scatter_torch(buf, kv, next_ids(), 0)),
        Variant("index_select per layer (gather)", index_select_gather),
        Variant("index_copy_ per layer (scatter)", index_copy_scatter),
        Variant("pool[:, :, ids] (gather)", lambda: buf_pages.copy_(kv[:, :, next_ids()])),
        Variant("pool[:, :, ids] = ... (scatter)", fancy_scatter),
        Variant("per-page copy_ loop, gather", loop_gather),
        Variant("per-page copy_ loop, scatter", loop_scatter),
        *block_variants,
    ]
    times = _interleaved(variants, args.repeat, args.burst, flush=flush_buf.sum, sync=lambda: None)
    threads.shutdown()
    return _header(kv, buf, args) + _report(times, nbytes, [
        ("gather / cold memcpy read", _ratio(times, gather, "memcpy cold read, ATen copy_",
                                             "memcpy cold read, libc memmove"), TARGET_OF_LIMIT),
        ("scatter / cold memcpy write", _ratio(times, scatter, "memcpy cold write, ATen copy_",
                                               "memcpy cold write, libc memmove"), TARGET_OF_LIMIT),
        ("gather / per-page loop", _ratio(times, gather, "per-page copy_ loop, gather"), TARGET_OVER_LOOP),
        ("scatter / per-page loop", _ratio(times, scatter, "per-page copy_ loop, scatter"), TARGET_OVER_LOOP),
        *_block_ratios(times, ("[2,nb,bs,H,D]", "[2,nb,H,bs,D]")),
        *((f"{op}_blocks [2,nb,H,bs,D] / cold memcpy", _ratio(times, f"{op}_blocks [2,nb,H,bs,D] ({ops.backend()})",
                                                               *limits), None)
          for op, limits in (("gather", ("memcpy cold read, ATen copy_", "memcpy cold read, libc memmove")),
                             ("scatter", ("memcpy cold write, ATen copy_", "memcpy cold write, libc memmove")))),
    ])


def _vllm_strided(kv: torch.Tensor) -> list[torch.Tensor]:
    """The pool's memory seen as an engine's per-layer ``[2, nb, H, bs, D]`` tensors, as 5-D
    ``[2, nb, bs, H, D]`` views (non-contiguous blocks)."""
    _, _, num_blocks, block_size, heads, dim = kv.shape
    return [layer.view(2, num_blocks, heads, block_size, dim).transpose(2, 3) for layer in kv.unbind(0)]


def _block_ratios(times: dict[str, list[float]], tags: tuple[str, ...]) -> list[tuple[str, float, float | None]]:
    """Each block op against the torch fallback on the same layout."""
    return [(f"{op}_blocks {tag} / torch fallback",
             _ratio(times, f"{op}_blocks {tag} ({ops.backend()})", f"torch fallback {op} {tag}"), TARGET_OVER_FALLBACK)
            for tag in tags for op in ("gather", "scatter")]


def _block_variants(tag: str, layers: list[torch.Tensor], buf: torch.Tensor,
                    next_ids: Callable[[], torch.Tensor]) -> list[Variant]:
    """The block ops and their torch fallback on ``layers`` (one layout, named ``tag``)."""
    return [
        Variant(f"gather_blocks {tag} ({ops.backend()})", lambda: ops.gather_blocks(layers, next_ids(), buf)),
        Variant(f"scatter_blocks {tag} ({ops.backend()})", lambda: ops.scatter_blocks(buf, layers, next_ids())),
        Variant(f"torch fallback gather {tag}", lambda: ops._gather_torch(layers, next_ids(), buf, 0)),
        Variant(f"torch fallback scatter {tag}", lambda: ops._scatter_torch(buf, layers, next_ids(), 0)),
    ]


def _run_cuda(args: argparse.Namespace) -> list[str]:
    kv, buf, next_ids, next_span = _setup(args, "cuda")
    nbytes = buf.numel() * buf.element_size()
    pinned = torch.empty_like(buf, device="cpu").pin_memory()
    flat_buf, flat_pinned = buf.view(torch.uint8).view(-1), pinned.view(torch.uint8).view(-1)
    flush_buf = torch.ones(FLUSH_BYTES // 4, device="cuda")
    variants = [
        Variant("cudaMemcpy device->device", lambda: flat_buf.copy_(next_span())),
        Variant("cudaMemcpy device->pinned host", lambda: flat_pinned.copy_(next_span(), non_blocking=True)),
        Variant("cudaMemcpy pinned host->device", lambda: next_span().copy_(flat_pinned, non_blocking=True)),
        Variant("gather_pages to device", lambda: ops.gather_pages(kv, next_ids(), buf)),
        Variant("scatter_pages from device", lambda: ops.scatter_pages(buf, kv, next_ids())),
        Variant("gather_pages to pinned host", lambda: ops.gather_pages(kv, next_ids(), pinned)),
        Variant("scatter_pages from pinned host", lambda: ops.scatter_pages(pinned, kv, next_ids())),
        *_block_variants("[2,nb,H,bs,D]", _vllm_strided(kv), buf, next_ids),
    ]
    times = _interleaved(variants, args.repeat, args.burst, flush=flush_buf.sum, sync=torch.cuda.synchronize)
    return _header(kv, buf, args) + _report(times, nbytes, [
        ("gather / cudaMemcpy d2d", _ratio(times, "gather_pages to device", "cudaMemcpy device->device"),
         TARGET_OF_LIMIT),
        ("scatter / cudaMemcpy d2d", _ratio(times, "scatter_pages from device", "cudaMemcpy device->device"),
         TARGET_OF_LIMIT),
        ("gather to pinned / cudaMemcpy d2h",
         _ratio(times, "gather_pages to pinned host", "cudaMemcpy device->pinned host"), TARGET_OF_LIMIT),
        ("scatter from pinned / cudaMemcpy h2d",
         _ratio(times, "scatter_pages from pinned host", "cudaMemcpy pinned host->device"), TARGET_OF_LIMIT),
        *_block_ratios(times, ("[2,nb,H,bs,D]",)),
        ("gather_blocks [2,nb,H,bs,D] / cudaMemcpy d2d",
         _ratio(times, f"gather_blocks [2,nb,H,bs,D] ({ops.backend()})", "cudaMemcpy device->device"), None),
    ])
