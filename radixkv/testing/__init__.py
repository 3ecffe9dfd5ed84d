"""Hypothesis strategies and state machines, for radixkv's tests and for yours.

    from radixkv.testing import PrefixCacheMachine
    TestMyCache = PrefixCacheMachine.TestCase          # collected by pytest / unittest

Needs ``hypothesis`` (the ``test`` extra).
"""

from radixkv.testing.index import PrefixCacheMachine, RadixTreeMachine, token_lists, token_sequences

__all__ = sorted(["PrefixCacheMachine", "RadixTreeMachine", "token_lists", "token_sequences"])
