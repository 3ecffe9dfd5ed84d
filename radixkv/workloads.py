"""Seeded, deterministic request streams with the prefix sharing of real traffic.

``chat_workload`` is the index benchmark's workload and the demo's: system prompts shared by many
conversations (chosen Zipf-like, as a few assistants get most traffic), earlier turns of those
conversations, and a fresh user query at the end of every request.

Decision (the issue leaves it open): a request's earlier turns are ``k`` *consecutive* turns of its
system prompt's turn pool, starting at a random turn, so two requests share a prefix beyond the
system prompt when they continue the same conversation, as multi-turn chat does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

__all__ = ["ChatWorkload", "chat_workload", "modelled_prefill_saving"]


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
