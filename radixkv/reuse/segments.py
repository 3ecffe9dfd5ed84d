"""Segment caching: the KV of a token segment (a retrieved document) computed on its own, reused
wherever the segment appears in a prompt.

A prefix chunk's key names the chunk *and everything before it*; a segment's key names its tokens
only.  Its KV is the KV the model computes for those tokens alone, at positions ``0 .. n - 1``:
reusing it at another position needs positional recovery and, since it lacks the attention to
what precedes it in the prompt, is an approximation (``radixkv.reuse.blend`` repairs the part that
matters most).  Segments live in the same tiers as prefix chunks, in the same chunk format (seals,
namespace ids, TTL and deadlines of the ``TierStack``), under keys of their own domain::

    seg_root = xxh3_128(b"radixkv/segment/v1\\0" || namespace.root)
    P0       = xxh3_128(seg_root || le_int32(tokens[0:C]))          # pieces of C = chunk_size tokens
    Pi       = xxh3_128(P(i-1)   || le_int32(tokens[i*C:(i+1)*C]))
    tail     = xxh3_128(P(last)  || le_int32(the tokens left))         # fewer than C, any number

A segment is the chain of its pieces (a piece is never larger than a chunk, so every tier,
remote ones included, takes it).  Every key of a segment descends from ``seg_root``, every prefix
key from ``namespace.root``: the two never meet short of an xxh3-128 collision, and a stored blob
names its parent, so a segment blob is never decoded as a prefix chunk (nor the reverse).  Two
segments that share their first pieces share those blobs: the KV of a segment's first tokens does
not depend on the tokens after them.

``SegmentCache`` is the engine's API: ``find`` answers "these spans of my prompt are documents:
which are cached?", ``load`` returns one segment's KV (``[layers, 2, n, kv_heads, head_dim]``),
``store`` queues one for the tiers.  Reads never raise for a tier's fault and never return KV that
did not verify: a corrupt or forged piece is a miss (counted by the stack and deleted).

>>> import torch
>>> from radixkv.core.tier import MemoryTier
>>> from radixkv.core.hashing import Namespace
>>> from radixkv.core.pool import KVLayout
>>> from radixkv.core.stack import TierStack
>>> stack = TierStack([MemoryTier()], namespace=Namespace(model="m"),
...                   layout=KVLayout(1, 1, 4, torch.float32, page_size=2), chunk_size=4)
>>> segments = SegmentCache(stack)
>>> doc = [7, 8, 9, 10, 11, 12]                       # one full piece and a tail of 2
>>> segments.store(doc, torch.ones(1, 2, 6, 1, 4))
2
>>> stack.flush(); segments.find([1, *doc, 2], [(1, 7)])
True
[True]
>>> segments.load(doc).shape
torch.Size([1, 2, 6, 1, 4])
>>> stack.close()
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Sequence

import torch
import xxhash

from radixkv.core.hashing import as_token_bytes, keys_from_token_bytes, tail_key
from radixkv.core.stack import ChunkRef, TierStack

__all__ = ["SEGMENT_TAG", "SegmentCache", "Span", "check_spans", "segment_refs", "segment_root"]

#: The domain tag of segment keys (see the module docstring).
SEGMENT_TAG = b"radixkv/segment/v1\0"


class Span(NamedTuple):
    """A segment's place in a prompt: tokens ``start .. end - 1``."""

    start: int
    end: int


def segment_root(namespace_root: bytes) -> bytes:
    """The 16-byte root of a namespace's segment keys (``namespace_root``: ``Namespace.root``).
    O(1).

    >>> from radixkv.core.hashing import Namespace
    >>> root = Namespace(model="m").root
    >>> len(segment_root(root)), segment_root(root) != root
    (16, True)
    """
    if type(namespace_root) is not bytes or len(namespace_root) != 16:
        raise ValueError(f"namespace_root must be 16 bytes (Namespace.root), got {namespace_root!r}")
    return xxhash.xxh3_128_digest(SEGMENT_TAG + namespace_root)


def segment_refs(data: bytes, chunk_size: int, namespace_root: bytes) -> list[ChunkRef]:
    """The ``ChunkRef`` of every piece of a segment (validated int32 token bytes, not empty):
    ``chunk_size``-token pieces chained from ``segment_root``, then a tail of the tokens left.
    O(len(data)): one hash pass.

    >>> from radixkv.core.hashing import Namespace, chunk_keys
    >>> ns = Namespace(model="m")
    >>> refs = segment_refs(as_token_bytes(list(range(10))), 4, ns.root)
    >>> [len(r.tokens) // 4 for r in refs]
    [4, 4, 2]
    >>> refs[0].key in chunk_keys(list(range(10)), 4, ns)     # another domain than prefix keys
    False
    """
    if not data:
        raise ValueError("tokens: a segment needs at least one token")
    root = segment_root(namespace_root)
    keys = keys_from_token_bytes(data, chunk_size, root)
    step = 4 * chunk_size
    parents = [root, *keys]
    refs = [ChunkRef(k, p, data[i * step:(i + 1) * step]) for i, (k, p) in enumerate(zip(keys, parents))]
    rest = data[len(keys) * step:]
    if rest:
        refs.append(ChunkRef(tail_key(parents[-1], rest), parents[-1], rest))
    return refs


def check_spans(spans: Any, length: int, name: str = "spans") -> tuple[Span, ...]:
    """``spans`` (pairs ``(start, end)``) as sorted ``Span``s, each non-empty, inside
    ``0 .. length`` and not overlapping another; ``ValueError``/``TypeError`` naming ``name``
    otherwise.  O(len(spans) log len(spans)).

    >>> check_spans([(4, 6), (0, 2)], 8)
    (Span(start=0, end=2), Span(start=4, end=6))
    """
    try:
        pairs = [tuple(s) for s in spans]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of (start, end) pairs, got {type(spans).__name__}") from None
    out = []
    for pair in pairs:
        if len(pair) != 2 or not all(type(x) is int or (isinstance(x, int) and not isinstance(x, bool))
                                     for x in pair):
            raise TypeError(f"{name} must hold (start, end) pairs of ints, got {pair!r}")
        start, end = int(pair[0]), int(pair[1])
        if not 0 <= start < end <= length:
            raise ValueError(f"{name}: ({start}, {end}) is not a non-empty span of the {length} tokens")
        out.append(Span(start, end))
    out.sort()
    for a, b in zip(out, out[1:]):
        if b.start < a.end:
            raise ValueError(f"{name}: {tuple(a)} and {tuple(b)} overlap")
    return tuple(out)


class SegmentCache:
    """Segments of KV in ``stack``'s tiers (usually a ``PrefixCache``'s own ``cache.stack``, so
    that segments and prefixes share tiers, seals and namespace); see the module docstring.

    Thread-safe (the stack is; the counters have a lock).  Reads are bounded by a deadline
    (``deadline``: absolute ``time.monotonic()``; default the stack's ``timeout_s`` from the call).
    """

    def __init__(self, stack: TierStack) -> None:
        if not isinstance(stack, TierStack):
            raise TypeError(f"stack must be a TierStack, got {type(stack).__name__}")
        if stack.layout.grouped:
            raise ValueError("stack: segments hold one KV group; a layout with sliding-window layers has several")
        self.stack = stack
        self.chunk_size = stack.chunk_size
        self._root = stack.namespace.root
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("lookups", "hits", "misses", "hit_tokens", "loads", "loaded",
                                      "load_misses", "stored", "store_dropped"), 0)

    def __repr__(self) -> str:
        return f"SegmentCache({self.stack!r})"

    def _add(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                self._counts[name] += n

    def _deadline(self, deadline: Any) -> float:
        """One absolute deadline for a whole read (lookup and load): ``deadline``, or the stack's
        ``timeout_s`` from now."""
        if deadline is None:
            return time.monotonic() + self.stack.timeout_s
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise TypeError(f"deadline must be a time.monotonic() value or None, got {type(deadline).__name__}")
        return float(deadline)

    def refs(self, tokens: Any) -> list[ChunkRef]:
        """The pieces of segment ``tokens`` (see ``segment_refs``).  O(len(tokens))."""
        return segment_refs(as_token_bytes(tokens), self.chunk_size, self._root)

    def key(self, tokens: Any) -> bytes:
        """The 16-byte key that names segment ``tokens`` whole (its last piece's).  O(len(tokens))."""
        return self.refs(tokens)[-1].key

    def find(self, tokens: Any, spans: Sequence[tuple[int, int]], *, deadline: float | None = None) -> list[bool]:
        """For each span of ``tokens`` (pairs ``(start, end)``, not overlapping), whether the tiers
        hold that segment whole.  Does not load or touch anything.  Cost: one hash pass over the
        spans' tokens and, per span, one ``contains_prefix`` per tier it reaches (within the deadline).
        """
        data = as_token_bytes(tokens)
        spans = check_spans(spans, len(data) // 4)
        deadline = self._deadline(deadline)
        found = []
        for span in spans:
            refs = segment_refs(data[4 * span.start:4 * span.end], self.chunk_size, self._root)
            found.append(len(self.stack.lookup([r.key for r in refs], deadline=deadline)) == len(refs))
        hits = sum(found)
        self._add(lookups=len(found), hits=hits, misses=len(found) - hits)
        return found

    def load(self, tokens: Any, *, deadline: float | None = None) -> torch.Tensor | None:
        """The KV of segment ``tokens`` (``[layers, sides, n, kv_heads, head_dim]``, a new CPU
        tensor of the layout's dtype), or ``None`` unless every piece arrived intact by the
        deadline.  Cost: one hash pass, one lookup round trip per tier, and per piece one read, one
        verification pass and one copy."""
        refs = self.refs(tokens)
        deadline = self._deadline(deadline)
        where = self.stack.lookup([r.key for r in refs], deadline=deadline)
        pieces = self.stack.load(refs[:len(where)], where=where, deadline=deadline) if len(where) == len(refs) else []
        n = sum(len(r.tokens) for r in refs) // 4
        if len(pieces) < len(refs):
            self._add(loads=1, load_misses=1)
            return None
        self._add(loads=1, loaded=1, hit_tokens=n)
        return torch.cat(pieces, dim=2)

    def store(self, tokens: Any, kv: torch.Tensor, *, wait: float = 0.0) -> int:
        """Queue the KV of segment ``tokens`` (computed on its own at positions ``0 .. n - 1``;
        ``[layers, sides, n, kv_heads, head_dim]`` of the layout's dtype, any device) for every
        tier, piece by piece; the number of pieces queued (what does not fit the write queue is
        dropped and counted, as the stack does for chunks; ``wait``: seconds to wait for room).
        ``ValueError`` for a ``kv`` of another shape or dtype, before anything is queued.
        Cost: one hash pass and one device-to-host copy of ``kv``; encoding is the writer's."""
        refs = self.refs(tokens)
        n = sum(len(r.tokens) for r in refs) // 4
        shape = self.stack.layout.chunk_shape(n)
        if not isinstance(kv, torch.Tensor) or kv.dtype != self.stack.layout.dtype or tuple(kv.shape) != shape:
            got = f"{kv.dtype} {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(f"kv must be a {self.stack.layout.dtype} tensor of shape {shape}, got {got}")
        host = kv.detach().to("cpu")
        items, at = [], 0
        for ref in refs:
            size = len(ref.tokens) // 4
            items.append((ref, host[:, :, at:at + size].contiguous()))
            at += size
        queued = self.stack.store(items, wait=wait, chain=True)
        self._add(stored=queued, store_dropped=len(items) - queued)
        return queued

    def stats(self) -> dict[str, int]:
        """Counters: ``lookups``/``hits``/``misses`` (segments asked by ``find``), ``loads``,
        ``loaded``, ``load_misses``, ``hit_tokens`` (tokens of the segments loaded), ``stored``
        and ``store_dropped`` (pieces).  The tiers' own counters are the stack's.  A new dict.  O(1)."""
        with self._lock:
            return dict(self._counts)

    def check(self) -> None:
        """Assert the counters add up, and the stack's invariants.  Raises ``AssertionError``."""
        with self._lock:
            c = dict(self._counts)
        assert all(v >= 0 for v in c.values()), "negative counter"
        assert c["hits"] + c["misses"] == c["lookups"], "segment lookups != hits + misses"
        assert c["loaded"] + c["load_misses"] == c["loads"], "segment loads != loaded + misses"
        self.stack.check()


