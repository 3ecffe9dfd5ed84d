"""Hypothesis strategies and state machines, for radixkv's tests and for yours.

    from radixkv.testing import PrefixCacheMachine, TierContract
    TestMyCache = PrefixCacheMachine.TestCase          # collected by pytest / unittest

The machines need ``hypothesis`` (the ``test`` extra) and load on first use, so that
``radixkv.testing.s3server`` (a local S3 server for tests and benchmarks) does not need it.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "PrefixCacheMachine": "index", "RadixTreeMachine": "index", "TieredPrefixCacheMachine": "index",
    "token_lists": "index", "token_sequences": "index",
    "FaultyTier": "tiers", "TierContract": "tiers", "TierFault": "tiers", "blobs": "tiers",
    "namespace_ids": "tiers", "tier_keys": "tiers",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f"radixkv.testing.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixkv.testing' has no attribute {name!r}")
