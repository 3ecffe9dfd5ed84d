"""Warm-up before traffic: bring stored chunks up into a fast tier, or compute the KV of prompts.

    warm(cache)                                   # this namespace's chunks: LMDB/S3/Redis -> the CPU tier
    warm(cache, prompts=[system_prompt, ...])     # only the chunks of these prompts
    radixkv.tools.warm.precompute(engine, prompts)      # compute and store the KV of prompts (HF adapter, paged engine)
    python -m radixkv warm --config radixkv.yaml [--prompts prompts.jsonl]   # S3/Redis -> the local disk

``warm`` reads chunks from the tiers below the target tier (by default the first in-memory one:
the CPU tier; else the first), verifies each under the stack's seal (``radixkv.core.format``: a corrupt
or forged chunk is skipped and counted, never warmed) and stores it in the target tier through the
stack (so listeners hear it as a load and a store), until the byte budget (default: the target
tier's free room, so that warming evicts nothing) or the deadline is reached.  By namespace, the
most recently used chunks come first (the tiers' stamps; listing order where they have none); by
prompts, their chunks in order, each prompt up to its first chunk no tier holds.

From the command line the CPU tier would die with the command, so ``python -m radixkv warm``
warms the local disk (LMDB) from the remote tier (S3 or Redis) of the configuration: a new machine
pulls the shared chunks before its engine starts.  An engine warms its own CPU tier with
``radixkv.tools.warm.warm(cache)`` at start-up.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

from radixkv.core._checks import check_int
from radixkv.tools._progress import progress
from radixkv.core.deadline import bounded
from radixkv.core.format import ChunkAuthError, ChunkFormatError, verify_chunk
from radixkv.core.hashing import as_token_bytes

if TYPE_CHECKING:
    import argparse

    from radixkv.core.cache import PrefixCache
    from radixkv.core.stack import ChunkRef, TierStack

__all__ = ["WarmReport", "precompute", "warm"]


class WarmReport(NamedTuple):
    """What ``warm`` did: chunks ``warmed`` into the target tier (``nbytes`` of KV), ``present``
    there already, ``bad`` (corrupt or forged: skipped), ``missing`` (listed or looked up, then
    gone), ``left`` (not reached: budget or deadline), and why it stopped (``"done"``,
    ``"budget"`` or ``"deadline"``)."""

    tier: str
    warmed: int
    nbytes: int
    present: int
    bad: int
    missing: int
    left: int
    stopped: str


def _target(stack: TierStack, into: int | str | None) -> int:
    names = [t.name for t in stack.tiers]
    if into is None:
        return next((i for i, t in enumerate(stack.tiers) if t.in_memory), 0)
    if isinstance(into, str):
        if into not in names:
            raise ValueError(f"into: no tier named {into!r}; the stack has {names}")
        return names.index(into)
    if isinstance(into, bool) or not isinstance(into, int) or not 0 <= into < len(names):
        raise ValueError(f"into must be a tier name or an index below {len(names)}, got {into!r}")
    return into


def _budget(stack: TierStack, t: int, max_bytes: int | None) -> float:
    if max_bytes is not None:
        return check_int(max_bytes, "max_bytes")
    tier = stack.tiers[t]
    cap = tier.capacity_bytes
    return float("inf") if cap is None else max(0, cap - tier.used_bytes)


def warm(target: PrefixCache | TierStack, prompts: Iterable[Any] | None = None, *, into: int | str | None = None,
         max_bytes: int | None = None, deadline_s: float | None = None, show_progress: bool = False,
         concurrency: int = 8) -> list[WarmReport]:
    """Bring chunks from the tiers below ``into`` (a tier name or index; default the first
    in-memory tier) up into it: of ``prompts`` (token id sequences), else every chunk of the
    namespace the tiers hold.  ``max_bytes``: the KV bytes to warm at most (default: the target's
    free room); ``deadline_s``: seconds to spend at most (every remote read ends by then);
    ``show_progress``: a bar on stderr.  One report per tier stack (one per KV group).  Waits for
    the stores to be written.  Cost: per chunk one read, one verification, one write; by namespace
    one listing of each tier below the target (``Tier.entries``)."""
    from radixkv.core.cache import PrefixCache
    from radixkv.core.stack import TierStack

    if isinstance(target, PrefixCache):
        stacks = target.stacks
    elif isinstance(target, TierStack):
        stacks = [target]
    else:
        raise TypeError(f"target must be a PrefixCache or a TierStack, got {type(target).__name__}")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or deadline_s <= 0):
        raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    check_int(concurrency, "concurrency", 1)
    data = None if prompts is None else [as_token_bytes(p) for p in prompts]
    deadline = float("inf") if deadline_s is None else time.monotonic() + deadline_s
    return [_warm_stack(stack, data, _target(stack, into), max_bytes, deadline, show_progress)
            for stack in stacks]


def _candidates(stack: TierStack, t: int, data: list[bytes] | None,
                deadline: float) -> tuple[list[tuple[int, Any]], int]:
    """``(tier index, ChunkRef or tier key)`` of what to warm, in order — the prompts' chunks that
    the target lacks and a tier below holds, or the namespace's entries below, newest first — and
    how many the target holds already."""
    if data is not None:
        present = 0
        out: list[tuple[int, Any]] = []
        seen: set[bytes] = set()
        for tokens in data:
            refs = [r for r in stack.refs_from_bytes(tokens) if r.key not in seen]
            seen.update(r.key for r in refs)
            where = stack.lookup([r.key for r in refs], deadline=None if deadline == float("inf") else deadline)
            out.extend((w, ref) for w, ref in zip(where, refs) if w > t)
            present += sum(w == t for w in where)
        return out, present
    ns = stack.namespace.id
    held = {e.key for e in stack.tiers[t].entries(ns)}
    entries: dict[bytes, tuple[float, int]] = {}
    for i in range(t + 1, len(stack.tiers)):
        with bounded(None if deadline == float("inf") else deadline):
            for e in stack.tiers[i].entries(ns):
                if e.key not in held and e.key not in entries:
                    entries[e.key] = (-(e.stamp or 0.0), i)
    return [(i, key) for key, (_, i) in sorted(entries.items(), key=lambda kv: kv[1][0])], len(held)


def _warm_stack(stack: TierStack, data: list[bytes] | None, t: int, max_bytes: int | None, deadline: float,
                show_progress: bool) -> WarmReport:
    from radixkv.core.stack import ChunkRef

    budget = _budget(stack, t, max_bytes)
    todo, present = _candidates(stack, t, data, deadline)
    warmed = nbytes = bad = missing = 0
    stopped = "done"
    left = 0
    with progress(len(todo), f"warm {stack.tiers[t].name}", enabled=show_progress) as bar:
        for n, (i, item) in enumerate(todo):
            if time.monotonic() >= deadline:
                stopped, left = "deadline", len(todo) - n
                break
            if isinstance(item, ChunkRef):
                ref: ChunkRef | None = item
                got = stack.load([item], where=[i], deadline=None if deadline == float("inf") else deadline)
                kv = got[0] if got else None
            else:
                ref, kv = _read_verified(stack, i, item, deadline)
                if ref is None:
                    bad += kv is not None
                    missing += kv is None
                    bar.update(1)
                    continue
            if kv is None or ref is None:
                missing += 1
                bar.update(1)
                continue
            size = kv.numel() * kv.element_size()
            if nbytes + size > budget:
                stopped, left = "budget", len(todo) - n
                break
            remaining = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            stored = stack.store([(ref, kv)], tiers=[t], wait=30.0 if remaining is None else remaining)
            if stored:
                warmed, nbytes = warmed + 1, nbytes + size
            bar.update(1)
    stack.flush(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
    return WarmReport(stack.tiers[t].name, warmed, nbytes, present, bad, missing, left, stopped)


def _read_verified(stack: TierStack, i: int, key: bytes, deadline: float) -> tuple[Any, Any]:
    """Read the entry ``key`` (a tier key) of tier ``i`` and verify it under the stack's seal for
    that tier: ``(ChunkRef, kv)``; ``(None, True)`` when it does not verify (counted in the
    stack's ``corrupt``/``forged`` by the load path: here only skipped); ``(None, None)`` when gone."""
    from radixkv.core.stack import ChunkRef

    try:
        with bounded(None if deadline == float("inf") else deadline):
            blob = stack.tiers[i].get(key)
    except Exception:  # noqa: BLE001 - a fault of a tier: the chunk is not warmed
        return None, None
    if blob is None:
        return None, None
    try:
        found = verify_chunk(blob, namespace_id=key[:8], key=key[8:], seal=stack.seals[i])
    except (ChunkAuthError, ChunkFormatError):
        return None, True
    if tuple(found.kv.shape) != stack.layout.chunk_shape(len(found.tokens) // 4) or found.kv.dtype != stack.layout.dtype:
        return None, True
    return ChunkRef(key[8:], found.parent, found.tokens), found.kv


def precompute(engine: Any, prompts: Sequence[Any], *, pin: bool = False, show_progress: bool = False) -> int:
    """Compute and cache the KV of ``prompts`` (system prompts, few-shot headers) before traffic,
    so that the first user request that starts with one hits: through a ``PrefixCachedLM`` (the
    Hugging Face adapter: one ``prefill`` each) or a ``PagedEngine`` (each run for one token).
    With tiers, ``write_through`` stores the chunks too; this waits for the writes.  ``pin``: keep
    the prompts' pages from eviction (``PrefixCache.pin``, bounded by its ``pin_budget``).
    Returns the tokens the cache holds of them.  Cost: one prefill per prompt."""
    from radixkv.integrations.paged import PagedEngine
    from radixkv.integrations.transformers import PrefixCachedLM

    def run(tokens: Any) -> None:
        if isinstance(engine, PrefixCachedLM):
            engine.prefill(tokens)
        else:
            engine.add(tokens, max_new_tokens=1)
            engine.run()

    if not isinstance(engine, (PrefixCachedLM, PagedEngine)):
        raise TypeError(f"engine must be a PrefixCachedLM or a PagedEngine, got {type(engine).__name__}")
    cache = engine.cache
    prompts = list(prompts)
    with progress(len(prompts), "precompute", unit="prompt", enabled=show_progress) as bar:
        for tokens in prompts:
            run(tokens)
            bar.update(1)
    cache.flush()
    held = 0
    for tokens in prompts:
        if pin:
            held += cache.pin(tokens)
        else:
            m = cache.match(tokens, leave_last=False)
            held += m.num_tokens
            cache.release(m)
    return held


# -- the command ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m radixkv warm``."""
    parser.add_argument("--config", required=True, help="the radixkv YAML/JSON configuration (with a layout)")
    parser.add_argument("--prompts", help="a file of prompts as token ids: JSON lines, each a list of ints or "
                        '{"tokens": [...]}; default: every chunk of the configured namespace')
    parser.add_argument("--max-bytes", type=float, help="KV bytes to warm at most, in GB (default: the free room)")
    parser.add_argument("--deadline", type=float, help="seconds to spend at most")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(path: str) -> list[list[int]]:
    """Token id lists from a JSON-lines file (a list of ints, or an object with ``tokens``)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"prompts: {path!r}, line {n}, column {exc.colno}: {exc.msg}") from None
            tokens = item.get("tokens") if isinstance(item, dict) else item
            if not isinstance(tokens, list):
                raise ValueError(f"prompts: line {n} of {path!r} is neither a list of token ids nor {{'tokens': [...]}}")
            out.append(tokens)
    return out


def main(args: argparse.Namespace) -> int:
    """``python -m radixkv warm``: the configuration's remote chunks onto its local disk."""
    from dataclasses import replace

    from radixkv.config import load_config

    cfg = load_config(args.config)
    if not cfg.local_disk or not cfg.remote_url:
        print("radixkv warm: the command warms the local disk (local_disk) from the remote tier (remote_url); "
              "the configuration lacks one of them (an engine warms its CPU tier with radixkv.tools.warm.warm(cache))")
        return 2
    layout = cfg.make_layout(None)
    prompts = read_prompts(args.prompts) if args.prompts else None     # the input first, then the tiers
    # A tier this command cannot open is an error here (an engine would start without it).
    stack = replace(cfg.without_p2p(), local_cpu=False, max_local_cpu_size=None, local_disk_required=True,
                    remote_required=True).make_stack(layout)
    assert stack is not None
    try:
        max_bytes = None if args.max_bytes is None else int(args.max_bytes * 10**9)
        reports = warm(stack, prompts, into=0, max_bytes=max_bytes, deadline_s=args.deadline,
                       show_progress=not args.no_progress)
    finally:
        stack.close()
    for r in reports:
        print(f"radixkv warm: {r.warmed:,} chunks ({r.nbytes / 1e6:,.1f} MB) into {r.tier}; {r.bad} bad, "
              f"{r.missing} gone, {r.left} not reached ({r.stopped})")
    return 0
