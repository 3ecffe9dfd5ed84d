"""radixkv: reuse the KV cache of prompt prefixes an LLM engine has already computed.

A radix tree indexes the KV pages resident in the engine's paged pool (level 0); below it, a stack
of hash-keyed tiers (pinned CPU memory, LMDB, S3) keeps chunks the pool evicted or other processes
wrote.  The core (the algorithm) is ``radixkv.core``; see docs/architecture.md for the map.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv._version import __version__
from radixkv.core.cache import Match, PoolExhausted, PrefixCache
from radixkv.core.request import Request
from radixkv.core.hashing import Namespace, chunk_keys
from radixkv.core.pool import KVLayout, KVPool
from radixkv.core.tree import RadixTree

# Submodules and names that pull optional dependencies (hypothesis, a C++ build) load on first use.
_LAZY = {
    "backends": "radixkv.backends",
    "fleet": "radixkv.fleet",
    "ops": "radixkv.core.ops",
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
    "from_config",
    "fleet",
    "ops",
    "testing",
])


def __getattr__(name: str) -> Any:
    if name == "TierStack":
        from radixkv.core.stack import TierStack

        globals()[name] = TierStack
        return TierStack
    if name == "from_config":           # the factory lives above the cache: radixkv.config
        from radixkv.config import from_config

        globals()[name] = from_config
        return from_config
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
