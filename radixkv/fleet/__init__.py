"""Many engines, one cache: KV events in vLLM's wire format, vLLM's block hashes, a fleet index.

* ``radixkv.fleet.events``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
  ``EventBatch`` (byte-compatible with vLLM's), ``encode_batch``/``decode_batch``, and the ZMQ
  ``Publisher``/``Subscriber`` (replay of missed batches);
* ``radixkv.fleet.hashing``: ``vllm_block_hashes``, the names vLLM's events give blocks;
* ``radixkv.fleet.index``: ``Index``, which instance holds which prefix, on which medium;
* ``radixkv.fleet.publish``: ``KVEvents`` and ``publish(cache, endpoint)``, a cache's holdings as
  events (the observer seam's listener);
* ``radixkv.fleet.follow``: ``Follower``, every instance's stream into one ``Index``;
* ``radixkv.fleet.router``: ``Router``, the prefix-aware proxy of ``python -m radixkv route``;
* ``radixkv.p2p.controller``: ``Controller`` and ``ControllerClient``, the cache controller of
  peer-to-peer sharing (``python -m radixkv controller``; ``radixkv.p2p.node``), over the signed
  messages of ``radixkv.p2p.wire`` (``'radixkv[p2p]'``).

The names load on first use: ``hashing`` and ``index`` need nothing beyond radixkv's own
dependencies; ``events`` (and what uses it) needs msgspec, and its sockets pyzmq
(``pip install 'radixkv[fleet]'``); the router aiohttp and prometheus-client (``'radixkv[router]'``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = sorted([
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Controller",
    "ControllerClient",
    "EventBatch",
    "Follower",
    "Index",
    "KVEvents",
    "Match",
    "Publisher",
    "Router",
    "Subscriber",
    "decode_batch",
    "encode_batch",
    "external_hash",
    "none_hash",
    "publish",
    "vllm_block_hashes",
])

_WHERE = {
    "AllBlocksCleared": "events",
    "BlockRemoved": "events",
    "BlockStored": "events",
    "EventBatch": "events",
    "Publisher": "events",
    "Subscriber": "events",
    "decode_batch": "events",
    "encode_batch": "events",
    "Index": "index",
    "Controller": "controller",
    "ControllerClient": "controller",
    "Follower": "follow",
    "KVEvents": "publish",
    "publish": "publish",
    "Router": "router",
    "Match": "index",
    "external_hash": "hashing",
    "none_hash": "hashing",
    "vllm_block_hashes": "hashing",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv.fleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"radixkv.fleet.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
