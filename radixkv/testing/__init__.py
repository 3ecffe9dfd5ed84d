"""Hypothesis strategies and state machines, for radixkv's tests and for yours.

    from radixkv.testing import PrefixCacheMachine, TierContract
    TestMyCache = PrefixCacheMachine.TestCase          # collected by pytest / unittest

Needs ``hypothesis`` (the ``test`` extra).
"""

from radixkv.testing.index import (PrefixCacheMachine, RadixTreeMachine, TieredPrefixCacheMachine, token_lists,
                                    token_sequences)
from radixkv.testing.tiers import FaultyTier, TierContract, TierFault, blobs, namespace_ids, tier_keys

__all__ = sorted(["FaultyTier", "PrefixCacheMachine", "RadixTreeMachine", "TierContract", "TierFault",
                  "TieredPrefixCacheMachine", "blobs", "namespace_ids", "tier_keys", "token_lists",
                  "token_sequences"])
