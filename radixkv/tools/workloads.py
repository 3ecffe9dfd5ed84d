"""Seeded, deterministic request streams with the prefix sharing of real traffic.

``chat_workload`` is the index benchmark's workload and the demo's: system prompts shared by many
conversations (chosen Zipf-like, as a few assistants get most traffic), earlier turns of those
conversations, and a fresh user query at the end of every request.

Decision (the issue leaves it open): a request's earlier turns are ``k`` *consecutive* turns of its
system prompt's turn pool, starting at a random turn, so two requests share a prefix beyond the
system prompt when they continue the same conversation, as multi-turn chat does.

``few_shot_workload`` and ``rag_workload`` are the other two shapes of shared prefixes (examples
shared by every request; documents drawn from a corpus), and ``replay`` drives any of them through
a ``PrefixCache`` and reports hit rates per level: what the notebooks plot against pool size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
from radixkv.core._checks import check_int

if TYPE_CHECKING:
    from radixkv.core.cache import PrefixCache

__all__ = ["ChatWorkload", "chat_workload", "few_shot_workload", "modelled_prefill_saving", "pool_copies", "rag_workload",
           "replay"]


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Knobs of the chat workload (defaults are the index benchmark's)."""

    num_requests: int = 20_000
    num_system_prompts: int = 64
    system_prompt_tokens: int = 2048
    turns_per_prompt: int = 200
    turn_tokens: tuple[int, int] = (64, 512)
    turns_per_request: tuple[int, int] = (1, 4)
    query_tokens: tuple[int, int] = (32, 256)
    vocab_size: int = 32_000
    zipf_s: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_system_prompts", "turns_per_prompt", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_int(self.seed, "seed", 0)
        for name in ("turn_tokens", "turns_per_request", "query_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")

    def __iter__(self) -> Iterator[np.ndarray]:
        return chat_workload(self)


def chat_workload(cfg: ChatWorkload = ChatWorkload()) -> Iterator[np.ndarray]:
    """Yield ``cfg.num_requests`` prompts (int32 arrays), the same ones for the same ``cfg``.

    Memory: the prompt and turn pools (~15 MB at the defaults); each request is built on demand.
    """
    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(0, cfg.vocab_size, (cfg.num_system_prompts, cfg.system_prompt_tokens), dtype=np.int32)
    turns = [[rng.integers(0, cfg.vocab_size, rng.integers(cfg.turn_tokens[0], cfg.turn_tokens[1] + 1),
                           dtype=np.int32) for _ in range(cfg.turns_per_prompt)]
             for _ in range(cfg.num_system_prompts)]
    weights = 1.0 / np.arange(1, cfg.num_system_prompts + 1) ** cfg.zipf_s
    choice = rng.choice(cfg.num_system_prompts, size=cfg.num_requests, p=weights / weights.sum())
    for p in choice:
        k = int(rng.integers(cfg.turns_per_request[0], cfg.turns_per_request[1] + 1))
        start = int(rng.integers(0, cfg.turns_per_prompt))
        history = [turns[p][(start + j) % cfg.turns_per_prompt] for j in range(k)]
        query = rng.integers(0, cfg.vocab_size, rng.integers(cfg.query_tokens[0], cfg.query_tokens[1] + 1),
                             dtype=np.int32)
        yield np.concatenate([prompts[p], *history, query])


def modelled_prefill_saving(prompt_tokens: int, cached_tokens: int) -> tuple[float, float]:
    """Prefill compute with and without a cached prefix, in the attention-dominated model.

    Full prefill of P+Q tokens costs ~(P+Q)^2/2 attention pairs; with P tokens cached only the Q new
    tokens are computed, ~Q*P + Q^2/2.  Returns (full cost, cached cost); their ratio tends to
    (P+Q)/(2Q) for P >> Q, the speedup formula the benchmarks reproduce.

    >>> full, cached = modelled_prefill_saving(8192 + 256, 8192)
    >>> round(full / cached, 1)
    16.8
    """
    q = prompt_tokens - cached_tokens
    return prompt_tokens ** 2 / 2, q * cached_tokens + q * q / 2


def _zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def _check_range(name: str, value: tuple[int, int]) -> None:
    lo, hi = value
    if not 0 <= lo <= hi:
        raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {value}")


def _check_ints(minimum: int, **values: int) -> None:
    for name, value in values.items():
        check_int(value, name, minimum)


def _random_tokens(rng: np.random.Generator, vocab_size: int, length: tuple[int, int]) -> np.ndarray:
    """Fresh token ids, as many as a uniform draw from the inclusive ``length`` range."""
    return rng.integers(0, vocab_size, int(rng.integers(length[0], length[1] + 1)), dtype=np.int32)


def few_shot_workload(num_requests: int = 2000, *, num_tasks: int = 1, num_examples: int = 8,
                      instruction_tokens: int = 256, example_tokens: tuple[int, int] = (64, 256),
                      question_tokens: tuple[int, int] = (16, 128), shuffle: bool = False,
                      zipf_s: float = 1.1, vocab_size: int = 32_000, seed: int = 0) -> Iterator[np.ndarray]:
    """Yield ``num_requests`` few-shot prompts (int32 arrays), the same ones for the same arguments.

    Each task has an instruction and ``num_examples`` worked examples, fixed for the whole stream;
    a request picks a task (Zipf-like over ``num_tasks`` with exponent ``zipf_s``; with the default
    single task every request shares the same examples) and is the task's instruction, its
    examples, then a fresh question.

    Decisions: the examples appear in the task's fixed order (``shuffle=False``), so every request
    of a task shares the whole header, as a prompt template does; ``shuffle=True`` puts them in a
    fresh random order per request, so requests share the instruction and only as many leading
    examples as happen to agree (what sampling the order costs a prefix cache).  The question is
    new for every request and is never shared.

    Memory: the tasks' headers (``num_tasks * (instruction + examples)`` tokens); requests are built
    on demand.

    >>> a = list(few_shot_workload(3, num_examples=2, seed=1))
    >>> b = list(few_shot_workload(3, num_examples=2, seed=1))
    >>> all((x == y).all() for x, y in zip(a, b)), len(a)
    (True, 3)
    """
    _check_ints(1, num_requests=num_requests, num_tasks=num_tasks, vocab_size=vocab_size)
    _check_ints(0, num_examples=num_examples, instruction_tokens=instruction_tokens)
    _check_range("example_tokens", example_tokens)
    _check_range("question_tokens", question_tokens)
    rng = np.random.default_rng(seed)
    tasks = [(rng.integers(0, vocab_size, instruction_tokens, dtype=np.int32),
              [_random_tokens(rng, vocab_size, example_tokens) for _ in range(num_examples)])
             for _ in range(num_tasks)]
    choice = rng.choice(num_tasks, size=num_requests, p=_zipf_weights(num_tasks, zipf_s))
    for t in choice:
        instruction, examples = tasks[t]
        order = rng.permutation(num_examples) if shuffle else range(num_examples)
        yield np.concatenate([instruction, *(examples[i] for i in order),
                              _random_tokens(rng, vocab_size, question_tokens)])


def rag_workload(num_requests: int = 2000, *, num_documents: int = 200, docs_per_request: int = 4,
                 system_prompt_tokens: int = 512, document_tokens: tuple[int, int] = (256, 1024),
                 question_tokens: tuple[int, int] = (16, 128), zipf_s: float = 1.1,
                 sort_documents: bool = False, vocab_size: int = 32_000, seed: int = 0) -> Iterator[np.ndarray]:
    """Yield ``num_requests`` retrieval-augmented prompts (int32 arrays), the same ones for the same
    arguments: one system prompt shared by every request, ``docs_per_request`` distinct documents
    of a fixed corpus of ``num_documents``, then a fresh question.

    Decisions: documents are drawn without replacement, Zipf-like by popularity (exponent
    ``zipf_s``: a few documents answer most questions); a request lists them in retrieval order
    (the order drawn, so popular documents tend to come first), as a retriever ranks them.  Since
    a prefix cache reuses only a common *prefix*, two requests retrieving the same documents in
    another order share only the system prompt; ``sort_documents=True`` lists them by document id
    instead, the usual trick to raise prefix reuse (compare the two in a replay).

    Memory: the corpus (``num_documents`` documents); requests are built on demand.

    >>> r = next(rag_workload(1, num_documents=5, docs_per_request=2, system_prompt_tokens=4,
    ...                       document_tokens=(3, 3), question_tokens=(2, 2)))
    >>> len(r)
    12
    """
    _check_ints(1, num_requests=num_requests, num_documents=num_documents, vocab_size=vocab_size)
    _check_ints(0, docs_per_request=docs_per_request, system_prompt_tokens=system_prompt_tokens)
    if docs_per_request > num_documents:
        raise ValueError(f"docs_per_request must be at most num_documents={num_documents}, got {docs_per_request}")
    _check_range("document_tokens", document_tokens)
    _check_range("question_tokens", question_tokens)
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_prompt_tokens, dtype=np.int32)
    corpus = [_random_tokens(rng, vocab_size, document_tokens) for _ in range(num_documents)]
    weights = _zipf_weights(num_documents, zipf_s)
    for _ in range(num_requests):
        docs = rng.choice(num_documents, size=docs_per_request, replace=False, p=weights)
        if sort_documents:
            docs = np.sort(docs)
        yield np.concatenate([system, *(corpus[d] for d in docs), _random_tokens(rng, vocab_size, question_tokens)])


def _level_names(levels: list[dict[str, Any]]) -> list[str]:
    names = [str(level["level"]) for level in levels]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def pool_copies(cache: PrefixCache) -> list[dict[str, int] | None]:
    """Per tier (stack order): how many chunks the tier holds (``chunks``, its ``entries``) and how
    many of those the pool holds too (``in_pool``: a chunk every one of whose tokens a cached
    prefix covers) — the duplicate residency of inclusive caching, which an exclusive tier avoids.
    ``None`` for a tier that is not local (counting would cost round trips).  Reads no LRU order.
    Cost: one hash pass over each leaf's prefix and one ``contains_prefix`` per distinct chunk."""
    if cache.stack is None:
        return []
    leaves = [n for n in cache.tree.nodes() if not n.children]
    prefixes = [cache.tree.prefix_tokens(leaf).tobytes() for leaf in leaves]
    keys = [{stack.namespace.id + ref.key for data in prefixes for ref in stack.refs_from_bytes(data)}
            for stack in cache.stacks]                      # per KV group: its tier keys, hashed once
    out: list[dict[str, int] | None] = []
    for i, tier in enumerate(cache.stack.tiers):
        if not tier.local:
            out.append(None)
            continue
        in_pool = sum(tier.contains_prefix([key]) for group in keys for key in group)
        out.append({"chunks": int(tier.stats().get("entries", 0)), "in_pool": in_pool})
    return out


def replay(cache: PrefixCache, requests: Iterable[Any], *, flush: bool = True) -> dict[str, Any]:
    """Serve ``requests`` (token id sequences) one at a time through ``cache``; return what it hit.

    Per request, as an engine would: ``match``; ``alloc`` the pages for the rest (``alloc`` evicts
    least-recently-used prefixes when the pool is short; when even that is not enough, only as many
    leading pages as fit are allocated and cached); ``insert``; ``release``.  No model runs: the
    pages keep whatever KV they hold, as hit rates do not depend on it.  With ``flush`` (and tiers)
    every request waits until its tier writes are done, so that the result does not depend on the
    speed of the writer thread (a real engine never waits, and may see dropped writes instead).

    Returns the counters of these requests only (a warm cache's earlier traffic is subtracted):
    ``requests``, ``query_tokens``, ``hit_tokens``, ``hit_rate`` (hit / query tokens), ``evicted_pages``,
    ``chunks_stored``, ``dropped_writes``, and ``levels``: ``{name: {"hit_tokens", "hit_rate",
    "bytes_in", "bytes_out", ...}}`` for the pool and then each tier in stack order (the numeric
    per-level counters of ``cache.stats()["levels"]``, differenced; for a local tier also, at the
    end, ``chunks`` held and ``in_pool``, of those also in the pool: ``pool_copies``).  Cost: one
    ``match``, ``alloc`` and ``insert`` per request (with tiers: their hashing, loads and stores),
    two ``stats()`` calls, one ``pool_copies``.

    >>> import torch
    >>> from radixkv import KVLayout, PrefixCache
    >>> cache = PrefixCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
    ...                              page_size=4), num_pages=64, chunk_size=4)
    >>> r = replay(cache, [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2)
    >>> r["hit_tokens"], r["query_tokens"], r["levels"]["pool"]["hit_tokens"]
    (8, 18, 8)
    """
    import torch

    before = cache.stats()
    ps = cache.page_size
    n = 0
    for tokens in requests:
        n += 1
        m = cache.match(tokens)
        try:
            length = len(tokens)
            need = -(-length // ps) - len(m.pages)
            room = cache.pool.num_free + cache.tree.evictable_size // ps
            take = max(0, min(need, room))
            new = cache.alloc(take)
            if take < need:                       # cache only the leading full pages that fit
                length = (len(m.pages) + take) * ps
            cache.insert(tokens[:length], torch.cat([m.pages, new]))
        finally:
            cache.release(m)
        if flush and cache.stack is not None:
            cache.stack.flush()
    after = cache.stats()
    out: dict[str, Any] = {"requests": n}
    for key in ("query_tokens", "hit_tokens", "evicted_pages", "chunks_stored"):
        out[key] = after[key] - before[key]
    out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out["query_tokens"] else 0.0
    out["dropped_writes"] = after.get("stack", {}).get("dropped_writes", 0) - before.get("stack", {}).get(
        "dropped_writes", 0)
    levels: dict[str, dict[str, Any]] = {}
    for name, new_level, old_level in zip(_level_names(after["levels"]), after["levels"], before["levels"]):
        level = {k: v - old_level.get(k, 0) for k, v in new_level.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        level["hit_rate"] = level["hit_tokens"] / out["query_tokens"] if out["query_tokens"] else 0.0
        levels[name] = level
    for name, copies in zip(list(levels)[1:], pool_copies(cache)):
        if copies is not None:
            levels[name].update(copies)
    out["levels"] = levels
    return out
