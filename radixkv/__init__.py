"""radixkv: reuse the KV cache of prompt prefixes an LLM engine has already computed.

A radix tree indexes the KV pages resident in the engine's paged pool (level 0); below it, a stack
of hash-keyed tiers (pinned CPU memory, LMDB, S3) keeps chunks the pool evicted or other processes
wrote.  See README.md for a tour and DESIGN notes.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv._version import __version__
from radixkv.cache import Match, PoolExhausted, PrefixCache
from radixkv.request import Request
from radixkv.hashing import Namespace, chunk_keys
from radixkv.pool import KVLayout, KVPool
from radixkv.tree import RadixTree

# Submodules and names that pull optional dependencies (hypothesis, a C++ build) load on first use.
_LAZY = {
    "backends": "radixkv.backends",
    "fleet": "radixkv.fleet",
    "ops": "radixkv.ops",
    "testing": "radixkv.testing",
}

__all__ = sorted([
    "KVLayout",
    "KVPool",
    "Match",
    "Namespace",
    "PoolExhausted",
    "PrefixCache",
    "RadixTree",
    "Request",
    "TierStack",
    "__version__",
    "backends",
    "chunk_keys",
    "fleet",
    "ops",
    "testing",
])


def __getattr__(name: str) -> Any:
    if name == "TierStack":
        from radixkv.tiers import TierStack

        globals()[name] = TierStack
        return TierStack
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
