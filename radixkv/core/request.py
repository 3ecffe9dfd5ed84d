"""``Request``: one engine request's state in the cache, from ``PrefixCache.open`` to ``release``.

A paged, continuous-batching engine keeps each request's KV in pool pages and decodes from them
while other requests come and go.  The cache therefore keeps, per request, in one object:

* the request's tokens, converted once (int32 bytes); ``extend`` converts only what is new;
* the pages it holds: every page of ``tokens[:num_cached]`` — matched, loaded from a tier, or
  computed by the engine and cached with ``extend`` — is in the radix tree and locked for the
  request, so no eviction frees or reuses it until ``release``;
* a pending tier load, when the request was opened with ``load="async"``.

Loads from the tiers (CPU, disk, remote) run on a worker thread and never touch the pool or the
tree: the worker looks the chunks up and fetches and verifies them into CPU buffers, bounded by the
request's deadline.  The engine thread lands them — new pool pages, a scatter, an insert into the
tree — when it calls ``poll`` or ``wait``, so the pool and the tree are only ever changed by the
engine thread.  A load that has not arrived by the deadline is a miss: the request keeps what it
holds and the engine computes the rest.

The three behaviours an engine chooses between (SGLang's HiCache names them ``best_effort``,
``wait_complete`` and ``timeout``):

* ``open(tokens, load="async")`` then schedule the request whenever it suits, calling ``poll()``
  once per step: best effort, nothing ever waits;
* ``open(tokens, load="async")`` then ``wait()`` before the request's prefill: wait for the load,
  bounded by the deadline (``deadline_s``, default the cache's ``load_timeout``);
* ``open(tokens)`` (``load="wait"``): the same in one call, on the engine thread.

``load="none"`` uses the pool only.  The verbs of a request (``poll``, ``wait``, ``extend``,
``release``) live here, on the one object an engine keeps per request; each asks its host, the
cache that made it, through the small ``RequestHost`` interface (the cache implements it privately:
it owns the tree and the pool the verbs change).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np
import torch

from radixkv.core.hashing import as_token_bytes

if TYPE_CHECKING:
    from radixkv.core.stack import ChunkRef, TierStack
    from radixkv.core.tree import RadixNode

__all__ = ["LOAD_MODES", "PendingLoad", "Request", "RequestHost"]

LOAD_MODES = ("wait", "async", "none")
_ids = itertools.count(1)        # global: a request of another cache is never mistaken for ours


@dataclass(slots=True)
class PendingLoad:
    """A tier load in flight: chunks ``first, first + 1, ...`` of the request's tokens, fetched by
    ``future`` (which returns ``(where, chunks, tail)``: the serving tier of each chunk and its CPU
    tensor, the last one possibly a tail, whose key ``tail`` is then), due by ``deadline``
    (``time.monotonic()``)."""

    future: Future[tuple[list[int], list[torch.Tensor], bytes | None]]
    first: int
    deadline: float
    keys: list[bytes]              # the chunk keys of chunks first, first + 1, ...

    def remaining(self) -> float:
        """Seconds left before the deadline (0 when past it).  O(1)."""
        return max(0.0, self.deadline - time.monotonic())


def fetch_chunks(stack: TierStack, refs: Sequence[ChunkRef], limit: int, deadline: float,
                 tail: tuple[bytes, bytes] | None = None) -> tuple[list[int], list[torch.Tensor], bytes | None]:
    """The worker's half of a load: look up ``refs`` in the tiers and fetch and verify at most
    ``limit`` leading chunks, all by ``deadline``; then, given ``tail`` — ``(parent, data)``: the key
    before ``refs[0]`` and the request's usable token bytes from ``refs[0]`` on — and when every
    chunk found was loaded and ``limit`` did not stop them, the longest tail a local tier holds
    after them (``TierStack.find_tail``).  Returns ``(where, chunks, tail key or None)``.  Touches
    neither the pool nor the tree; a tier fault is a miss (the stack never raises for one).  Cost:
    the stack's ``lookup`` and ``load``, and with ``tail`` ``find_tail``'s probes and one load."""
    found = stack.lookup([ref.key for ref in refs], deadline=deadline)
    where = found[:limit]
    chunks = stack.load(refs[:len(where)], where=where, deadline=deadline) if where else []
    where, n = list(where[:len(chunks)]), len(chunks)
    # A tail can only continue the chunks right after the last one the tiers hold: every chunk
    # found must have loaded (not cut by ``limit``, the pool's room, nor by a fault).
    if tail is None or n < len(found) or time.monotonic() >= deadline:
        return where, chunks, None
    chunk_bytes = 4 * stack.chunk_size
    parent = refs[n - 1].key if n else tail[0]
    hit = stack.find_tail(parent, tail[1][n * chunk_bytes:(n + 1) * chunk_bytes], deadline=deadline)
    if hit is not None:
        got = stack.load([hit[1]], where=[hit[0]], deadline=deadline)
        if got:
            return [*where, hit[0]], [*chunks, got[0]], hit[1].key
    return where, chunks, None


class RequestHost(Protocol):
    """What a ``Request`` asks of the cache that made it: the four verbs of a request's life.

    ``PrefixCache`` implements them (privately: an engine calls them on the ``Request``, the one
    handle of a request) and passes itself as each request's host.  Each may change the tree, the
    pool and the request; each raises ``ValueError`` for a request already released."""

    def poll(self, req: Request) -> bool:
        """Land ``req``'s pending load if it arrived; ``True`` when nothing is pending any more."""
        ...

    def wait(self, req: Request, timeout: float | None) -> bool:
        """Block until ``req``'s pending load lands or its deadline passes (at most ``timeout``)."""
        ...

    def extend(self, req: Request, tokens: Any, pages: Any) -> torch.Tensor:
        """Cache the full pages of ``tokens`` past ``req.num_cached`` and hold them for ``req``."""
        ...

    def release(self, req: Request) -> None:
        """Drop every hold of ``req`` and its pending load."""
        ...


class Request:
    """One request's tokens, held pages and pending load; made by ``PrefixCache.open``.

    ``num_cached`` leading tokens (a multiple of the page size) have their KV in ``pages``
    (int64 ids, in order), held for this request until ``release``.  ``tier_tokens`` of them were
    loaded from the tiers, ``tier_tokens_by_tier`` by which tier (stack order).  Not thread-safe:
    use it from the engine thread, like the cache.
    """

    __slots__ = ("_host", "_data", "_usable", "node", "_pages", "num_cached", "pool_tokens", "tier_tokens",
                 "tier_tokens_by_tier", "_pending", "id", "released", "approximate")

    def __init__(self, host: RequestHost, data: bytes, usable: int, node: RadixNode, pages: np.ndarray,
                 num_cached: int) -> None:
        self._host = host
        self._data = data                  # every token the request has given, int32 LE bytes
        self._usable = usable              # tokens a match may cover (the last one is left to compute)
        self.node = node                   # the locked node that ends the held prefix
        self._pages = pages
        self.num_cached = num_cached
        self.pool_tokens = num_cached      # of num_cached, how many were resident when opened
        self.tier_tokens = 0
        #: Whether some of its cached KV was approximated by a lossy codec (a load from a coded
        #: tier, now or by an earlier request whose pages it reuses); see ``radixkv.core.codec``.
        self.approximate = False
        self.tier_tokens_by_tier: tuple[int, ...] = ()
        self._pending: PendingLoad | None = None
        self.id = next(_ids)
        self.released = False

    # ---------------------------------------------------------------- state

    @property
    def pages(self) -> torch.Tensor:
        """The held page ids of ``tokens[:num_cached]`` (int64, CPU; a new tensor).  O(pages)."""
        return torch.from_numpy(self._pages.copy())

    @property
    def page_ids(self) -> np.ndarray:
        """The held page ids as a read-only int64 numpy array (no copy).  O(1)."""
        view = self._pages.view()
        view.flags.writeable = False
        return view

    @property
    def num_tokens(self) -> int:
        """Tokens the request has given so far (prompt and anything added by ``extend``).  O(1)."""
        return len(self._data) // 4

    @property
    def pending(self) -> bool:
        """Whether a tier load is in flight (``poll``/``wait`` land it).  O(1)."""
        return self._pending is not None

    def token_bytes(self) -> bytes:
        """The request's tokens as little-endian int32 bytes.  O(1)."""
        return self._data

    def _grow(self, tokens: Any) -> bytes:
        """The token bytes after ``tokens``, the request's whole sequence now: only the ids past
        those it already has are converted (the earlier ones are taken to be unchanged).  Raises
        like ``as_token_bytes``, and ``ValueError`` when ``tokens`` is shorter than before."""
        known = len(self._data) // 4
        if isinstance(tokens, (bytes, bytearray, memoryview)):
            raise TypeError("tokens must be a list, tuple, numpy array or torch tensor of ints, got bytes")
        try:
            n = len(tokens)
        except TypeError:
            raise TypeError(f"tokens must be a list, tuple, numpy array or torch tensor of ints, "
                            f"got {type(tokens).__name__}") from None
        if n < known:
            raise ValueError(f"tokens: {n} tokens, fewer than the {known} the request already has")
        return self._data + as_token_bytes(tokens[known:]) if n > known else self._data

    def _grow_or_prefix(self, tokens: Any) -> tuple[bytes, int]:
        """``extend``'s tokens: the request's whole sequence now (``_grow``), or a prefix of the
        tokens it has (an engine caching only the part whose KV is exact, as a blended prefill's
        before its first reused document).  Returns the whole sequence's bytes and how many of its
        tokens ``tokens`` names.  ``ValueError`` for fewer tokens that are not a prefix."""
        known = len(self._data) // 4
        try:
            n = len(tokens)
        except TypeError:
            raise TypeError(f"tokens must be a list, tuple, numpy array or torch tensor of ints, "
                            f"got {type(tokens).__name__}") from None
        if n < known and not isinstance(tokens, (bytes, bytearray, memoryview)):
            if as_token_bytes(tokens) != self._data[:4 * n]:
                raise ValueError(f"tokens: {n} tokens, fewer than the {known} the request already has, "
                                 f"and not a prefix of them")
            return self._data, n
        data = self._grow(tokens)
        return data, len(data) // 4

    # ---------------------------------------------------------------- the protocol

    def poll(self) -> bool:
        """Land the pending load if it has arrived (new pool pages, a scatter, an insert into the
        tree, on the caller's thread); ``True`` when nothing is pending any more.  Never blocks: a
        load still in flight answers ``False`` until its deadline, then the request keeps what it
        holds (a miss, counted in ``late_loads``).  Cost: O(1), or landing the load."""
        return self._host.poll(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pending load lands or its deadline passes, or ``timeout`` seconds;
        ``True`` when nothing is pending any more.  The wait never outlasts the deadline.  Cost:
        ``poll``'s plus the wait."""
        return self._host.wait(self, timeout)

    def extend(self, tokens: Any, pages: Any) -> torch.Tensor:
        """Cache the KV the engine computed for this request and keep holding it (SGLang's
        ``cache_unfinished_req``): call it after prefill and whenever decoding fills a page.

        ``tokens`` is the request's whole sequence so far (prompt and generated tokens; only those
        past what the request already has are converted), or a prefix of it (to cache only the
        part whose KV is exact); ``pages`` has one id from ``alloc`` per full page of ``tokens``
        past ``num_cached`` (a partial tail page is not passed: it stays the engine's).  Returns the canonical page table of ``tokens[:num_cached]``: where another
        request cached the same tokens first, the tree's pages replace the engine's, which are
        freed — the engine must use the returned ids from now on.  Raises ``ValueError`` /
        ``TypeError`` and changes nothing for a wrong page count or a page not from ``alloc``.  A
        pending load is dropped first (the engine computed those tokens itself).  Cost: O(new
        tokens) to convert, O(d + L/page_size + log n) to insert, plus with ``write_through`` one
        gather per newly completed chunk."""
        return self._host.extend(self, tokens, pages)

    def release(self) -> None:
        """Drop every hold of this request, so its pages may be evicted again, and its pending load
        (SGLang's ``cache_finished_req``, after ``extend``).  Pages the engine still has from
        ``alloc`` stay the engine's.  O(depth).  Raises ``ValueError`` when released twice."""
        self._host.release(self)

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else ("load pending" if self._pending else "holding")
        return (f"Request({self.num_tokens} tokens, {self.num_cached} cached in {len(self._pages)} pages, "
                f"{state}, id={self.id})")
