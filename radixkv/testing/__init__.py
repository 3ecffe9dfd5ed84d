"""Hypothesis strategies and state machines, for radixkv's tests and for yours.

    from radixkv.testing import PrefixCacheMachine, TierContract, settings
    settings.load_profile()                              # in conftest.py: HYPOTHESIS_PROFILE=ci|dev|...
    TestMyCache = PrefixCacheMachine.TestCase            # collected by pytest / unittest

    def test_my_tier(tmp_path):                          # a backend against the tier contract
        TierContract.check(lambda path: MyTier(path, max_bytes=1200), tmp_path=tmp_path, lru=True)

The machines need ``hypothesis`` (the ``test`` extra) and load on first use, so that
the modules that need no hypothesis (``vllm_server``, ``proxy``) do not need it.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "FaultyPrefixCacheMachine": "machines", "PrefixCacheMachine": "machines", "RadixTreeMachine": "machines",
    "TieredPrefixCacheMachine": "machines", "token_lists": "machines", "token_sequences": "machines",
    "Clock": "contract", "FaultyTier": "wrappers", "PersistentTierContract": "contract", "RecordingTier": "wrappers",
    "TierContract": "contract", "TierFault": "wrappers", "blobs": "contract", "key_universe": "contract",
    "make_blob": "contract", "namespace_ids": "contract", "tier_keys": "contract",
    "GatedTier": "wrappers", "RequestMachine": "requests",
}
_MODULES = {"backends", "settings"}

__all__ = sorted([*_NAMES, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f"radixkv.testing.{_NAMES[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"radixkv.testing.{name}")
    else:
        raise AttributeError(f"module 'radixkv.testing' has no attribute {name!r}")
    globals()[name] = value
    return value
