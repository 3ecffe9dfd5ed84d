"""``python -m radixkv COMMAND``: the demo (radixkv's main job on embedded defaults) and tools.

    python -m radixkv demo        # a random-weight model served through the cache: TTFT and hit sources
    python -m radixkv replay      # replay a chat workload through a PrefixCache's index, print what it saved
    python -m radixkv build-ext   # build the block-copy extension (an install step: run time only loads it)
    python -m radixkv inspect --config FILE   # what each tier holds per namespace; --verify, --drop NS, --json
    python -m radixkv warm --config FILE      # the remote tier's chunks onto the local disk before serving
    python -m radixkv route --backend URL --events ENDPOINT ...   # prefix-aware router for vllm serve
    python -m radixkv controller --bind tcp://HOST:PORT --config FILE   # who holds what, for p2p sharing
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

from radixkv.tools._args import Parser, Refused

from radixkv.core.cache import PrefixCache
from radixkv.core.pool import KVLayout
from radixkv.tools.workloads import ChatWorkload, modelled_prefill_saving


def replay(args: argparse.Namespace) -> int:
    """Replay the chat workload through a CPU ``PrefixCache``; print hit rate and savings."""
    workload = ChatWorkload(num_requests=args.requests, num_system_prompts=args.system_prompts, seed=args.seed)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, page_size=args.page_size)
    cache = PrefixCache(layout, num_pages=args.pool_tokens // args.page_size, chunk_size=16 * args.page_size)
    print(f"radixkv replay: {args.requests} chat requests ({args.system_prompts} shared system prompts of "
          f"{workload.system_prompt_tokens} tokens, 1-4 earlier turns, a fresh query each) through a "
          f"PrefixCache of {args.pool_tokens:,} token slots, page size {args.page_size}, on CPU")
    full_cost = cached_cost = 0.0
    prompt_tokens = 0
    t0 = time.perf_counter()
    for tokens in workload:
        m = cache.match(tokens)
        new = cache.alloc(-(-len(tokens) // args.page_size) - len(m.pages))
        # (an engine would run its model on tokens[m.num_tokens:] here, writing KV into `new`)
        cache.insert(tokens, torch.cat([m.pages, new]))
        cache.release(m)
        full, cached = modelled_prefill_saving(len(tokens), m.num_tokens)
        full_cost, cached_cost = full_cost + full, cached_cost + cached
        prompt_tokens += len(tokens)
    seconds = time.perf_counter() - t0
    cache.check()
    s = cache.stats()
    saved = s["hit_tokens"]
    print(f"  prompt tokens         {prompt_tokens:>12,}")
    print(f"  served from the cache {saved:>12,}   (token hit rate {s['hit_rate']:.1%})")
    print(f"  computed              {prompt_tokens - saved:>12,}")
    print(f"  pages evicted         {s['evicted_pages']:>12,}   ({s['nodes']:,} tree nodes at the end)")
    print(f"  modelled prefill compute saved: {1 - cached_cost / full_cost:.1%} "
          f"(attention cost (P+Q)^2/2 without the cache vs QP + Q^2/2 with it: "
          f"{full_cost / cached_cost:.1f}x less work)")
    print(f"  index time: {seconds:.2f} s, {args.requests / seconds:,.0f} requests/s "
          f"(match + alloc + insert + release)")
    return 0


def build_ext(args: argparse.Namespace) -> int:
    """Build the block-copy extension into its directory (or find it built); print the backend and where."""
    from radixkv.core import ops

    print(f"radixkv.core.ops backend: {ops.build(verbose=args.verbose, lock_timeout=args.lock_timeout)}")
    print(f"built in: {ops.extension_dir()}")
    return 0


def controller(args: argparse.Namespace) -> int:
    """Run the peer-to-peer controller until SIGINT or SIGTERM, signing with the secret of
    ``--config`` (or ``RADIXKV_SECRET``).  The file is read here, in the tools' floor, so that the
    controller itself (``radixkv.p2p.controller``) takes plain values."""
    from radixkv.config import read_mapping
    from radixkv.p2p.controller import serve

    secret = read_mapping(args.config).get("secret") if args.config else None
    return serve(args.bind, secret or os.environ.get("RADIXKV_SECRET"), heartbeat_timeout_s=args.heartbeat_timeout)


#: The commands whose module parses its own options: (name, module, help, run); the module gives
#: ``add_arguments`` and, where ``run`` is ``None``, ``main``.
_TOOLS = (
    ("inspect", "radixkv.tools.inspection", "what each tier holds per namespace; --verify checks every chunk's seal",
     None),
    ("warm", "radixkv.tools.warm", "bring the remote tier's chunks onto the local disk before serving", None),
    ("route", "radixkv.fleet.router", "a prefix-aware OpenAI-compatible router in front of vllm serve instances",
     None),
    ("controller", "radixkv.p2p.controller", "the cache controller of peer-to-peer sharing (p2p_enabled)",
     controller),
)


def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m radixkv", description="radixkv: prefix caching for LLM engines")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("demo", help="a random-weight model served through the cache: TTFT and where hits came from")
    d = sub.add_parser("replay", help="replay a chat workload through a PrefixCache and print what it saved")
    d.add_argument("--requests", type=int, default=2000)
    d.add_argument("--system-prompts", type=int, default=16)
    d.add_argument("--pool-tokens", type=int, default=1_000_000)
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=replay)
    b = sub.add_parser("build-ext", help="build the block-copy extension (run time only loads it; without a build "
                       "the ops use the torch kernels)")
    b.add_argument("--verbose", action="store_true", help="show the compiler's output")
    b.add_argument("--lock-timeout", type=float, default=600.0,
                   help="seconds to wait for another process's build of the same sources (default 600)")
    b.set_defaults(func=build_ext)
    for name, module, text, run in _TOOLS:       # each tool's module gives add_arguments (and main)
        tool = importlib.import_module(module)
        t = sub.add_parser(name, help=text)
        tool.add_arguments(t)
        t.set_defaults(func=run or tool.main)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status.  Bad input of any kind (a wrong flag, a missing or
    unreadable file, an unknown key, a tier that cannot be opened) is one line on stderr naming the
    problem and a non-zero status, never a traceback (``RADIXKV_TRACEBACK=1`` shows it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else "radixkv"
    try:
        if argv[:1] == ["demo"]:
            from radixkv.tools.demo import main as demo

            return demo(argv[1:])
        args = _parser().parse_args(argv)
        return int(args.func(args))
    except Refused as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, OSError, ImportError, KeyError, RuntimeError) as exc:
        if os.environ.get("RADIXKV_TRACEBACK"):
            raise
        print(f"radixkv {command}: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """The error as one line: its message (its type's name where the message does not say it)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (OSError, KeyError, ImportError, RuntimeError)) and type(exc).__name__ not in text:
        text = f"{type(exc).__name__}: {text}"
    return text
